//! virtio-blk (device type 2): a disk image file as the guest's block device, read-only (a
//! root filesystem every VM of an image shares through the page cache) or writable (a
//! session's workspace).
//!
//! Requests run on the device thread, synchronously, through a fixed bounce buffer: a request
//! costs the host no memory in proportion to its size. Every request is checked against the
//! disk's bounds and its own descriptors before any byte moves, and a request that fails a
//! check is answered with an error status, never by stopping the device.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::kvm::memory::GuestMemoryMmap;
use virtio_queue::{DescriptorChain, QueueT};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

use super::mmio::{ActiveDevice, VirtioMmio};
use super::{INT_USED_RING, VIRTIO_F_VERSION_1, VirtioDevice};
use crate::event_loop::{Registry, Subscriber};

pub const DEVICE_TYPE: u32 = 2;
pub const SECTOR_SIZE: u64 = 512;
const QUEUE_SIZE: u16 = 256;
const QUEUE_SIZES: [u16; 1] = [QUEUE_SIZE];
/// Most data segments the driver may put in one request (advertised as `seg_max`).
const SEG_MAX: u32 = 128;
/// Bytes moved between the file and guest memory per step.
const BOUNCE: usize = 64 << 10;
/// Length of the device id GET_ID answers with (virtio 1.2 §5.2.6).
pub const ID_LEN: usize = 20;

/// Feature bits (virtio 1.2 §5.2.3).
mod feature {
    pub const SEG_MAX: u64 = 1 << 2;
    pub const RO: u64 = 1 << 5;
    pub const BLK_SIZE: u64 = 1 << 6;
    pub const FLUSH: u64 = 1 << 9;
}

/// Request types.
mod request {
    pub const IN: u32 = 0;
    pub const OUT: u32 = 1;
    pub const FLUSH: u32 = 4;
    pub const GET_ID: u32 = 8;
}

/// The status byte the device writes last.
mod status {
    pub const OK: u8 = 0;
    pub const IOERR: u8 = 1;
    pub const UNSUPP: u8 = 2;
}

/// The 16-byte request header: type, reserved, sector.
const HEADER_LEN: usize = 16;

#[derive(Debug, thiserror::Error)]
pub enum BlockError {
    #[error("disk {path}: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("disk {path}: {size} bytes is not a whole number of 512-byte sectors")]
    Unaligned { path: PathBuf, size: u64 },
}

/// Disk blocks (4 KiB index, contents) in block order.
pub type WrittenBlocks = Vec<(u64, Vec<u8>)>;

/// What the guest sees of one disk.
pub struct Block {
    file: File,
    path: PathBuf,
    read_only: bool,
    /// In bytes, a multiple of [`SECTOR_SIZE`], fixed when the disk is attached.
    capacity: u64,
    id: [u8; ID_LEN],
    stats: Arc<BlockStats>,
    /// For a restored VM's writable disk: the snapshot layers under `file`.
    layers: Option<agentvm_snapshot::disk::Layers>,
    /// 4 KiB blocks the guest wrote since the VM's last checkpoint; `None` until its first.
    written_since_checkpoint: Option<std::collections::BTreeSet<u64>>,
}

/// How [`Block::copy_to`] stored the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DiskCopy {
    /// The whole disk (its non-zero pages): a file of its own.
    Whole,
    /// Only the blocks written since the VM was restored, over the snapshot it was restored
    /// from (its disk layers).
    Layer,
}

/// Counters the VMM reports per disk.
#[derive(Debug, Default)]
pub struct BlockStats {
    pub reads: std::sync::atomic::AtomicU64,
    pub writes: std::sync::atomic::AtomicU64,
    pub flushes: std::sync::atomic::AtomicU64,
    pub read_bytes: std::sync::atomic::AtomicU64,
    pub written_bytes: std::sync::atomic::AtomicU64,
    /// Requests answered IOERR or UNSUPP: out of bounds, malformed, refused or failed.
    pub errors: std::sync::atomic::AtomicU64,
}

impl Block {
    /// Opens `path` (read-write unless `read_only`). `id` is what GET_ID answers: the serial
    /// the guest sees as `/sys/block/vdX/serial`, cut to 20 bytes.
    pub fn open(path: &Path, read_only: bool, id: &str) -> Result<Self, BlockError> {
        let open_error = |source| BlockError::Open {
            path: path.to_owned(),
            source,
        };
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(!read_only)
            .open(path)
            .map_err(open_error)?;
        let capacity = file.metadata().map_err(open_error)?.len();
        if capacity % SECTOR_SIZE != 0 {
            return Err(BlockError::Unaligned {
                path: path.to_owned(),
                size: capacity,
            });
        }
        let mut serial = [0u8; ID_LEN];
        let n = id.len().min(ID_LEN);
        serial[..n].copy_from_slice(&id.as_bytes()[..n]);
        Ok(Self {
            file,
            path: path.to_owned(),
            read_only,
            capacity,
            id: serial,
            stats: Arc::default(),
            layers: None,
            written_since_checkpoint: None,
        })
    }

    /// A writable disk whose file `top` holds only what this VM writes, over the read-only
    /// snapshot layers `chain` (base first).
    pub fn open_layered(top: &Path, id: &str, chain: &[PathBuf]) -> Result<Self, BlockError> {
        let mut block = Self::open(top, false, id)?;
        let layer_error = |path: &Path| {
            let path = path.to_owned();
            move |source| BlockError::Open { path, source }
        };
        let files = chain
            .iter()
            .map(|p| File::open(p).map_err(layer_error(p)))
            .collect::<Result<Vec<_>, _>>()?;
        block.layers = Some(
            agentvm_snapshot::disk::Layers::open(files, &block.file).map_err(layer_error(top))?,
        );
        Ok(block)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn read_only(&self) -> bool {
        self.read_only
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    pub fn stats(&self) -> Arc<BlockStats> {
        Arc::clone(&self.stats)
    }

    /// Makes every write the guest was told is done durable.
    pub fn sync(&self) -> std::io::Result<()> {
        if self.read_only {
            return Ok(());
        }
        self.file.sync_data()
    }

    /// Copies the disk into the empty `copy` and syncs it: as a layer (what it wrote since
    /// it was restored) when `layer` is asked for and the disk runs over layers, else whole
    /// (its data pages; holes stay holes). Returns how, the digest (a layer digest for a
    /// layer, a page digest otherwise) and the page count. The VM must be paused.
    pub fn copy_to(&self, copy: &File, layer: bool) -> std::io::Result<(DiskCopy, String, u64)> {
        match &self.layers {
            Some(layers) if layer => {
                let (digest, pages) = layers.copy_top(&self.file, copy)?;
                Ok((DiskCopy::Layer, digest, pages))
            }
            Some(layers) => {
                let (digest, pages) = layers.copy_merged(&self.file, self.capacity, copy)?;
                Ok((DiskCopy::Whole, digest, pages))
            }
            None => {
                let (digest, pages) = agentvm_snapshot::pages::copy_sparse(&self.file, copy)?;
                copy.sync_all()?;
                Ok((DiskCopy::Whole, digest, pages))
            }
        }
    }

    /// Starts (or restarts) counting the blocks the guest writes, for the next checkpoint.
    pub fn track_writes(&mut self) {
        self.written_since_checkpoint = Some(Default::default());
    }

    /// The blocks written since [`Self::track_writes`] (or the last call) with what each now
    /// holds, in block order; counting starts afresh. `None` if writes were not counted.
    /// The VM must be paused.
    pub fn take_written_blocks(&mut self) -> std::io::Result<Option<WrittenBlocks>> {
        let Some(written) = self.written_since_checkpoint.as_mut() else {
            return Ok(None);
        };
        let written = std::mem::take(written);
        let block = agentvm_snapshot::pages::PAGE_SIZE;
        let mut out = Vec::with_capacity(written.len());
        for index in written {
            let at = index * block;
            // The last block may be short: the disk's size is a multiple of 512 only.
            let len = block.min(self.capacity.saturating_sub(at)) as usize;
            let mut bytes = vec![0u8; block as usize];
            self.read_disk(&mut bytes[..len], at)?;
            out.push((index, bytes));
        }
        Ok(Some(out))
    }

    /// Reads the disk's bytes at `at` (through its layers, if it has them).
    fn read_disk(&self, buf: &mut [u8], at: u64) -> std::io::Result<()> {
        match &self.layers {
            Some(layers) => layers.read_at(&self.file, buf, at),
            None => self.file.read_exact_at(buf, at),
        }
    }

    fn config(&self) -> [u8; 24] {
        let mut config = [0u8; 24];
        config[0..8].copy_from_slice(&(self.capacity / SECTOR_SIZE).to_le_bytes());
        // size_max (8..12) stays 0: segments may be any length.
        config[12..16].copy_from_slice(&SEG_MAX.to_le_bytes());
        // geometry (16..20) stays 0.
        config[20..24].copy_from_slice(&(SECTOR_SIZE as u32).to_le_bytes());
        config
    }

    /// Serves one request chain; returns how many bytes it wrote into guest memory (data and
    /// status), for the used ring.
    fn serve(&mut self, chain: DescriptorChain<&GuestMemoryMmap>, memory: &GuestMemoryMmap) -> u32 {
        let (Ok(mut reader), Ok(mut writer)) = (chain.clone().reader(memory), chain.writer(memory))
        else {
            self.count_error();
            return 0;
        };
        // The status byte is the last byte the driver gave us to write.
        let writable = writer.available_bytes();
        if writable == 0 {
            // Nowhere to say how it went: the request is dropped with nothing written.
            self.count_error();
            return 0;
        }
        let mut status_writer = match writer.split_at(writable - 1) {
            Ok(status) => status,
            Err(_) => {
                self.count_error();
                return 0;
            }
        };
        let mut header = [0u8; HEADER_LEN];
        let status = if std::io::Read::read_exact(&mut reader, &mut header).is_err() {
            status::IOERR
        } else {
            let kind = u32::from_le_bytes(header[0..4].try_into().unwrap_or_default());
            let sector = u64::from_le_bytes(header[8..16].try_into().unwrap_or_default());
            match kind {
                request::IN => self.read(sector, &mut writer),
                request::OUT => self.write(sector, &mut reader),
                request::FLUSH => self.flush(),
                request::GET_ID => {
                    let shown = ID_LEN.min(writer.available_bytes());
                    match std::io::Write::write_all(&mut writer, &self.id[..shown]) {
                        Ok(()) => status::OK,
                        Err(_) => status::IOERR,
                    }
                }
                _ => status::UNSUPP,
            }
        };
        if status != status::OK {
            self.count_error();
        }
        let _ = std::io::Write::write_all(&mut status_writer, &[status]);
        u32::try_from(writer.bytes_written() + status_writer.bytes_written()).unwrap_or(u32::MAX)
    }

    fn count_error(&self) {
        self.stats
            .errors
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// The byte range `sector..` of length `len` on the disk, if it is whole sectors inside it.
    fn range(&self, sector: u64, len: usize) -> Option<u64> {
        let len = u64::try_from(len).ok()?;
        if len % SECTOR_SIZE != 0 {
            return None;
        }
        let start = sector.checked_mul(SECTOR_SIZE)?;
        (start.checked_add(len)? <= self.capacity).then_some(start)
    }

    fn read(&mut self, sector: u64, writer: &mut crate::kvm::memory::ChainWriter<'_>) -> u8 {
        let len = writer.available_bytes();
        let Some(offset) = self.range(sector, len) else {
            return status::IOERR;
        };
        let this = &*self;
        let moved = in_steps(len, offset, |buf, at| {
            this.read_disk(buf, at)?;
            std::io::Write::write_all(writer, buf)
        });
        counted(moved, &self.stats.reads, &self.stats.read_bytes, len)
    }

    fn write(&mut self, sector: u64, reader: &mut crate::kvm::memory::ChainReader<'_>) -> u8 {
        if self.read_only {
            return status::IOERR;
        }
        let len = reader.available_bytes();
        let Some(offset) = self.range(sector, len) else {
            return status::IOERR;
        };
        let (file, layers) = (&self.file, &mut self.layers);
        let written = &mut self.written_since_checkpoint;
        let moved = in_steps(len, offset, |buf, at| {
            std::io::Read::read_exact(reader, buf)?;
            if let Some(written) = written.as_mut() {
                let block = agentvm_snapshot::pages::PAGE_SIZE;
                let end = (at + buf.len() as u64).div_ceil(block);
                written.extend(at / block..end);
            }
            match layers {
                Some(layers) => layers.write_at(file, buf, at),
                None => file.write_all_at(buf, at),
            }
        });
        counted(moved, &self.stats.writes, &self.stats.written_bytes, len)
    }

    fn flush(&mut self) -> u8 {
        self.stats
            .flushes
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        match self.sync() {
            Ok(()) => status::OK,
            Err(_) => status::IOERR,
        }
    }
}

impl VirtioDevice for Block {
    fn device_type(&self) -> u32 {
        DEVICE_TYPE
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &QUEUE_SIZES
    }

    fn features(&self) -> u64 {
        let mut features =
            VIRTIO_F_VERSION_1 | feature::SEG_MAX | feature::BLK_SIZE | feature::FLUSH;
        if self.read_only {
            features |= feature::RO;
        }
        features
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        super::read_config_space(&self.config(), offset, data);
    }

    fn write_config(&mut self, _offset: u64, _data: &[u8]) {
        // Nothing in the config space is writable without the features that make it so
        // (writeback toggling), which this device does not offer.
    }

    fn activate(&mut self, _acked_features: u64) {}

    fn reset(&mut self) {}
}

/// The status of a transfer of `len` bytes, counted in `ops` and `bytes` when it worked.
fn counted(
    moved: std::io::Result<()>,
    ops: &std::sync::atomic::AtomicU64,
    bytes: &std::sync::atomic::AtomicU64,
    len: usize,
) -> u8 {
    if moved.is_err() {
        return status::IOERR;
    }
    ops.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    bytes.fetch_add(len as u64, std::sync::atomic::Ordering::Relaxed);
    status::OK
}

/// Moves `len` bytes starting at disk offset `offset` through one bounce buffer: `step`
/// gets each piece of the buffer and the disk offset it belongs at.
fn in_steps(
    len: usize,
    mut offset: u64,
    mut step: impl FnMut(&mut [u8], u64) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let mut bounce = vec![0u8; BOUNCE.min(len)];
    let mut left = len;
    while left > 0 {
        let n = left.min(bounce.len());
        step(&mut bounce[..n], offset)?;
        offset += n as u64;
        left -= n;
    }
    Ok(())
}

/// Serves every request the guest has made available on the queue.
pub fn process_queue(active: &mut ActiveDevice<'_, Block>) {
    let memory = active.memory;
    let queue = &mut active.queues[0];
    let mut used = false;
    while let Some(chain) = queue.pop_descriptor_chain(memory) {
        let head = chain.head_index();
        let written = active.device.serve(chain, memory);
        if let Err(e) = queue.add_used(memory, head, written) {
            tracing::warn!(error = %e, "virtio-blk used ring");
            break;
        }
        used = true;
    }
    if used {
        match queue.needs_notification(memory) {
            Ok(false) => {}
            _ => active.interrupt.signal(INT_USED_RING),
        }
    }
}

/// A disk's presence on the device thread.
pub struct BlockHandler {
    device: Arc<Mutex<VirtioMmio<Block>>>,
    queue_event: EventFd,
}

impl BlockHandler {
    pub fn new(device: Arc<Mutex<VirtioMmio<Block>>>) -> std::io::Result<Self> {
        let queue_event = lock(&device).queue_events()[0].try_clone()?;
        Ok(Self {
            device,
            queue_event,
        })
    }
}

pub fn lock(device: &Mutex<VirtioMmio<Block>>) -> MutexGuard<'_, VirtioMmio<Block>> {
    device.lock().unwrap_or_else(|p| p.into_inner())
}

impl Subscriber for BlockHandler {
    fn register(&mut self, registry: &mut Registry<'_>) -> std::io::Result<()> {
        registry.add(self.queue_event.as_raw_fd(), 0, EventSet::IN)
    }

    fn on_event(&mut self, _token: u32, _events: EventSet, _registry: &mut Registry<'_>) {
        let _ = self.queue_event.read();
        let mut transport = lock(&self.device);
        if let Some(mut active) = transport.active() {
            process_queue(&mut active);
        }
    }
}

#[cfg(test)]
mod tests;
