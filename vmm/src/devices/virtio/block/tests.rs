//! The block device driven over simulated guest RAM by the test driver: requests well-formed
//! and hostile, against a real file.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

use crate::kvm::memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

use super::{
    Block, BlockStats, ID_LEN, SECTOR_SIZE, feature, lock, process_queue, request, status,
};
use crate::devices::bus::BusDevice;
use crate::devices::virtio::mmio::VirtioMmio;
use crate::devices::virtio::test_driver::{
    DESC_NEXT, DESC_WRITE, GuestQueue, QUEUE_SIZE, bring_up,
};
use crate::devices::virtio::{Interrupt, VirtioDevice};

const RAM: usize = 16 << 20;
const DISK_SECTORS: u64 = 64;
const HEADER: u64 = 0x10_0000;
const DATA: u64 = 0x20_0000;
const STATUS: u64 = 0x30_0000;

struct Disk {
    _dir: tempfile::TempDir,
    path: std::path::PathBuf,
    mem: Arc<GuestMemoryMmap>,
    device: Arc<Mutex<VirtioMmio<Block>>>,
    queue: GuestQueue,
    stats: Arc<BlockStats>,
}

impl Disk {
    fn new(read_only: bool) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disk.img");
        // Each sector starts with its own number, so a read shows where it came from.
        let mut image = vec![0u8; (DISK_SECTORS * SECTOR_SIZE) as usize];
        for sector in 0..DISK_SECTORS {
            let at = (sector * SECTOR_SIZE) as usize;
            image[at..at + 8].copy_from_slice(&sector.to_le_bytes());
        }
        std::fs::write(&path, &image).unwrap();
        let block = Block::open(&path, read_only, "workspace-0123456789abcdef").unwrap();
        let stats = block.stats();
        let mem = Arc::new(GuestMemoryMmap::from_ranges(&[(GuestAddress(0), RAM)]).unwrap());
        let interrupt = Interrupt::new(EventFd::new(libc::EFD_NONBLOCK).unwrap());
        let mut transport = VirtioMmio::new(block, mem.clone(), interrupt).unwrap();
        let queue = GuestQueue::new(0x1_0000);
        bring_up(&mut transport, std::slice::from_ref(&queue), 1);
        assert!(transport.is_activated());
        Self {
            _dir: dir,
            path,
            mem,
            device: Arc::new(Mutex::new(transport)),
            queue,
            stats,
        }
    }

    fn header(&self, kind: u32, sector: u64) {
        self.mem.write_obj(kind, GuestAddress(HEADER)).unwrap();
        self.mem.write_obj(0u32, GuestAddress(HEADER + 4)).unwrap();
        self.mem
            .write_obj(sector, GuestAddress(HEADER + 8))
            .unwrap();
        self.mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
    }

    /// Runs what the guest made available; returns the used entries (head, length).
    fn run(&mut self) -> Vec<(u32, u32)> {
        {
            let mut transport = lock(&self.device);
            let mut active = transport.active().unwrap();
            process_queue(&mut active);
        }
        self.queue.take_used(&self.mem)
    }

    fn status(&self) -> u8 {
        self.mem.read_obj(GuestAddress(STATUS)).unwrap()
    }

    /// A request of header, `data` segments (addr, len) and the status byte; runs it and
    /// returns (status, used length).
    fn request(&mut self, kind: u32, sector: u64, data: &[(u64, u32)]) -> (u8, u32) {
        self.header(kind, sector);
        let writable = kind != request::OUT;
        let mut chain = vec![(HEADER, 16, false)];
        chain.extend(data.iter().map(|&(addr, len)| (addr, len, writable)));
        chain.push((STATUS, 1, true));
        self.queue.push_chain(&self.mem, &chain);
        let used = self.run();
        assert_eq!(used.len(), 1, "{used:?}");
        (self.status(), used[0].1)
    }

    fn file(&self) -> Vec<u8> {
        std::fs::read(&self.path).unwrap()
    }
}

#[test]
fn config_space_and_features_describe_the_disk() {
    let disk = Disk::new(true);
    let transport = lock(&disk.device);
    let block = transport.device();
    let mut config = [0u8; 24];
    block.read_config(0, &mut config);
    assert_eq!(
        u64::from_le_bytes(config[0..8].try_into().unwrap()),
        DISK_SECTORS
    );
    assert_eq!(u32::from_le_bytes(config[20..24].try_into().unwrap()), 512);
    assert_ne!(block.features() & feature::RO, 0);
    // Reads past the config space are zeros, and so is a read at an absurd offset.
    let mut past = [0xaau8; 8];
    block.read_config(u64::MAX - 2, &mut past);
    assert_eq!(past, [0; 8]);
    let writable = Disk::new(false);
    assert_eq!(lock(&writable.device).device().features() & feature::RO, 0);
}

#[test]
fn writes_land_in_the_file_and_read_back_across_segments() {
    let mut disk = Disk::new(false);
    let payload: Vec<u8> = (0..3 * SECTOR_SIZE as usize)
        .map(|i| (i % 251) as u8)
        .collect();
    // Three segments of uneven length that add up to three sectors.
    disk.mem
        .write_slice(&payload[..700], GuestAddress(DATA))
        .unwrap();
    disk.mem
        .write_slice(&payload[700..1000], GuestAddress(DATA + 0x1000))
        .unwrap();
    disk.mem
        .write_slice(&payload[1000..], GuestAddress(DATA + 0x2000))
        .unwrap();
    let (status, used) = disk.request(
        request::OUT,
        5,
        &[(DATA, 700), (DATA + 0x1000, 300), (DATA + 0x2000, 536)],
    );
    assert_eq!((status, used), (status::OK, 1));
    let file = disk.file();
    assert_eq!(&file[5 * 512..8 * 512], &payload[..]);
    assert_eq!(
        &file[4 * 512..4 * 512 + 8],
        &4u64.to_le_bytes(),
        "sector 4 untouched"
    );
    assert_eq!(
        &file[8 * 512..8 * 512 + 8],
        &8u64.to_le_bytes(),
        "sector 8 untouched"
    );

    let (status, used) = disk.request(
        request::IN,
        5,
        &[(DATA + 0x8000, 1024), (DATA + 0x9000, 512)],
    );
    assert_eq!((status, used), (status::OK, 1537));
    let mut back = vec![0u8; 1536];
    disk.mem
        .read_slice(&mut back[..1024], GuestAddress(DATA + 0x8000))
        .unwrap();
    disk.mem
        .read_slice(&mut back[1024..], GuestAddress(DATA + 0x9000))
        .unwrap();
    assert_eq!(back, payload);
    assert_eq!(disk.stats.writes.load(Ordering::Relaxed), 1);
    assert_eq!(disk.stats.read_bytes.load(Ordering::Relaxed), 1536);
    assert_eq!(disk.request(request::FLUSH, 0, &[]).0, status::OK);
}

#[test]
fn a_read_of_the_last_sector_works_and_one_past_it_is_refused() {
    let mut disk = Disk::new(false);
    let (status, _) = disk.request(request::IN, DISK_SECTORS - 1, &[(DATA, 512)]);
    assert_eq!(status, status::OK);
    let first: u64 = disk.mem.read_obj(GuestAddress(DATA)).unwrap();
    assert_eq!(first, DISK_SECTORS - 1);
    for (sector, len) in [
        (DISK_SECTORS, 512),
        (DISK_SECTORS - 1, 1024),
        (u64::MAX, 512),
        (u64::MAX / 512 + 1, 512),
        (0, 100),
    ] {
        disk.mem
            .write_obj(0xdead_beefu64, GuestAddress(DATA))
            .unwrap();
        let (status, _) = disk.request(request::IN, sector, &[(DATA, len)]);
        assert_eq!(status, status::IOERR, "sector {sector} len {len}");
        let untouched: u64 = disk.mem.read_obj(GuestAddress(DATA)).unwrap();
        assert_eq!(
            untouched, 0xdead_beef,
            "sector {sector}: data written on a refused read"
        );
    }
    let before = disk.file();
    for (sector, len) in [(DISK_SECTORS, 512), (u64::MAX, 512), (3, 511)] {
        let (status, _) = disk.request(request::OUT, sector, &[(DATA, len)]);
        assert_eq!(status, status::IOERR, "sector {sector} len {len}");
    }
    assert_eq!(disk.file(), before);
    assert!(disk.stats.errors.load(Ordering::Relaxed) >= 8);
}

#[test]
fn a_read_only_disk_refuses_writes_and_keeps_its_bytes() {
    let mut disk = Disk::new(true);
    let before = disk.file();
    disk.mem
        .write_slice(&[0x55; 512], GuestAddress(DATA))
        .unwrap();
    let (status, _) = disk.request(request::OUT, 0, &[(DATA, 512)]);
    assert_eq!(status, status::IOERR);
    assert_eq!(disk.file(), before);
    assert_eq!(disk.request(request::IN, 2, &[(DATA, 512)]).0, status::OK);
    assert_eq!(disk.request(request::FLUSH, 0, &[]).0, status::OK);
}

#[test]
fn get_id_answers_the_serial_and_unknown_requests_are_unsupported() {
    let mut disk = Disk::new(false);
    let (status, used) = disk.request(request::GET_ID, 0, &[(DATA, ID_LEN as u32)]);
    assert_eq!((status, used), (status::OK, ID_LEN as u32 + 1));
    let mut id = [0u8; ID_LEN];
    disk.mem.read_slice(&mut id, GuestAddress(DATA)).unwrap();
    assert_eq!(&id, b"workspace-0123456789");
    // A shorter buffer gets what fits.
    let (status, used) = disk.request(request::GET_ID, 0, &[(DATA, 4)]);
    assert_eq!((status, used), (status::OK, 5));
    for kind in [2, 3, 11, 13, u32::MAX] {
        assert_eq!(disk.request(kind, 0, &[]).0, status::UNSUPP, "type {kind}");
    }
}

#[test]
fn hostile_chains_cost_the_guest_its_request_and_nothing_else() {
    let mut disk = Disk::new(false);
    let before = disk.file();
    let raw = |disk: &mut Disk, descs: &[(u16, u64, u32, u16, u16)]| {
        disk.header(request::IN, 0);
        disk.queue.push_raw(&disk.mem, descs, descs[0].0);
        disk.run()
    };
    // No writable byte at all: nowhere to put a status, so nothing is written.
    let used = raw(&mut disk, &[(0, HEADER, 16, 0, 0)]);
    assert_eq!(used, [(0, 0)]);
    // A header shorter than 16 bytes.
    let used = raw(
        &mut disk,
        &[(0, HEADER, 8, DESC_NEXT, 1), (1, STATUS, 1, DESC_WRITE, 0)],
    );
    assert_eq!(used, [(0, 1)]);
    assert_eq!(disk.status(), status::IOERR);
    // Buffers outside guest memory.
    let used = raw(
        &mut disk,
        &[
            (0, HEADER, 16, DESC_NEXT, 1),
            (1, RAM as u64 - 256, 4096, DESC_WRITE | DESC_NEXT, 2),
            (2, STATUS, 1, DESC_WRITE, 0),
        ],
    );
    assert_eq!(used.len(), 1);
    // A data length that would be 4 GiB of I/O is refused by the bounds check before
    // anything is read or allocated.
    let used = raw(
        &mut disk,
        &[
            (0, HEADER, 16, DESC_NEXT, 1),
            (1, DATA, u32::MAX, DESC_WRITE | DESC_NEXT, 2),
            (2, STATUS, 1, DESC_WRITE, 0),
        ],
    );
    assert_eq!(used.len(), 1);
    // A descriptor loop.
    let used = raw(
        &mut disk,
        &[
            (0, HEADER, 16, DESC_NEXT, 1),
            (1, STATUS, 1, DESC_WRITE | DESC_NEXT, 0),
        ],
    );
    assert!(used.len() <= 1, "{used:?}");
    assert_eq!(disk.file(), before);
    // The device still serves a good request afterwards.
    let (status, _) = disk.request(request::IN, 7, &[(DATA, 512)]);
    assert_eq!(status, status::OK);
    let first: u64 = disk.mem.read_obj(GuestAddress(DATA)).unwrap();
    assert_eq!(first, 7);
}

#[test]
fn random_descriptor_tables_never_break_the_device() {
    let mut disk = Disk::new(false);
    // xorshift: no dependency, and a failure names its seed.
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for round in 0..2000 {
        let count = 1 + next() % 6;
        let descs: Vec<(u16, u64, u32, u16, u16)> = (0..count)
            .map(|i| {
                let addr = match next() % 4 {
                    0 => next(),
                    1 => RAM as u64 - next() % 4096,
                    _ => DATA + (next() % 64) * 512,
                };
                let len = match next() % 4 {
                    0 => next() as u32,
                    1 => 1,
                    _ => ((next() % 8) as u32 + 1) * 512,
                };
                let flags = (next() % 4) as u16 & (DESC_NEXT | DESC_WRITE);
                (
                    i as u16,
                    addr,
                    len,
                    flags,
                    (next() % u64::from(QUEUE_SIZE)) as u16,
                )
            })
            .collect();
        disk.mem
            .write_obj((next() % 10) as u32, GuestAddress(HEADER))
            .unwrap();
        disk.mem
            .write_obj(next() % 80, GuestAddress(HEADER + 8))
            .unwrap();
        let mut first = descs.clone();
        first[0].1 = HEADER;
        disk.queue.push_raw(&disk.mem, &first, 0);
        let used = disk.run();
        assert!(used.len() <= 1, "round {round}: {used:?}");
    }
    let (status, _) = disk.request(request::IN, 1, &[(DATA, 512)]);
    assert_eq!(status, status::OK);
    // The transport answers register reads as ever.
    let mut magic = [0u8; 4];
    lock(&disk.device).read(0, &mut magic);
    assert_eq!(u32::from_le_bytes(magic), 0x7472_6976);
}

#[test]
fn blocks_written_since_tracking_began_are_handed_over_once() {
    let mut disk = Disk::new(false);
    disk.mem
        .write_slice(&[0x11u8; 512], GuestAddress(DATA))
        .unwrap();
    // Before tracking: nothing is counted.
    assert_eq!(disk.request(request::OUT, 1, &[(DATA, 512)]).0, status::OK);
    assert!(
        lock(&disk.device)
            .device_mut()
            .take_written_blocks()
            .unwrap()
            .is_none()
    );
    lock(&disk.device).device_mut().track_writes();
    // Sector 9 lies in block 1; sectors 15..17 straddle blocks 1 and 2.
    disk.mem
        .write_slice(&[0x22u8; 1536], GuestAddress(DATA))
        .unwrap();
    assert_eq!(disk.request(request::OUT, 9, &[(DATA, 512)]).0, status::OK);
    assert_eq!(
        disk.request(request::OUT, 15, &[(DATA, 1024)]).0,
        status::OK
    );
    // A read is not a write.
    assert_eq!(
        disk.request(request::IN, 40, &[(DATA + 0x8000, 512)]).0,
        status::OK
    );
    let blocks = lock(&disk.device)
        .device_mut()
        .take_written_blocks()
        .unwrap()
        .expect("counting");
    let indices: Vec<u64> = blocks.iter().map(|(i, _)| *i).collect();
    assert_eq!(indices, [1, 2]);
    // Each block as the disk now reads: the write and the sectors around it.
    let file = disk.file();
    assert_eq!(blocks[0].1, file[4096..8192]);
    assert_eq!(blocks[1].1, file[8192..12288]);
    assert_eq!(&blocks[0].1[512..1024], &[0x22u8; 512]);
    // Counting starts afresh.
    let again = lock(&disk.device)
        .device_mut()
        .take_written_blocks()
        .unwrap();
    assert_eq!(again, Some(Vec::new()));
}

#[test]
fn what_the_device_writes_into_guest_memory_is_marked_dirty() {
    let mut disk = Disk::new(false);
    for region in disk.mem.iter() {
        std::ops::Deref::deref(region).bitmap().reset();
    }
    let (status, _) = disk.request(request::IN, 3, &[(DATA + 0x5000, 512)]);
    assert_eq!(status, status::OK);
    let region = disk.mem.iter().next().unwrap();
    let bitmap = std::ops::Deref::deref(region).bitmap();
    // The buffer the read filled and the status byte: both device writes.
    assert!(bitmap.is_addr_set((DATA + 0x5000) as usize));
    assert!(bitmap.is_addr_set(STATUS as usize));
    assert!(!bitmap.is_addr_set((DATA + 0x9000) as usize));
}
