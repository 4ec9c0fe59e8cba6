//! The network device driven over simulated guest RAM by the test driver, with a socket
//! pair as the tap: frames each way, the policy and the rate limiter on the path, receive
//! backpressure, and hostile descriptor chains.

use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use agentvm_vmm_api::config::{
    EgressPolicy, EgressRule, RateLimiterConfig, TokenBucket as BucketConfig,
};
use vm_memory::{Bytes, GuestAddress};

use crate::kvm::memory::GuestMemoryMmap;
use vmm_sys_util::epoll::{Epoll, EpollEvent};
use vmm_sys_util::eventfd::EventFd;

use super::test_frames::*;
use super::{
    CONFIG_LEN, EgressAllowError, MAX_FRAME_LEN, Net, NetHandler, NetParams, NetStats,
    VNET_HEADER_LEN, feature, lock, process_tx,
};
use crate::devices::bus::BusDevice;
use crate::devices::virtio::mmio::VirtioMmio;
use crate::devices::virtio::test_driver::{
    DESC_NEXT, DESC_WRITE, GuestQueue, QUEUE_SIZE, bring_up_with,
};
use crate::devices::virtio::{Interrupt, VIRTIO_F_VERSION_1, VirtioDevice, status};
use crate::event_loop::{Registry, Subscriber};

const RAM: usize = 16 << 20;
const BUFFERS_START: u64 = 1 << 20;
const RX: usize = 0;
const TX: usize = 1;
/// A descriptor as the test driver writes it verbatim: (index, addr, len, flags, next).
type RawDesc = (u16, u64, u32, u16, u16);

/// What a Linux guest posts per receive buffer without mergeable buffers: header and a
/// 1518-byte frame.
const RX_BUFFER: u32 = 12 + 1518;

/// A connected, nonblocking pair of `kind` sockets (SOCK_DGRAM or SOCK_SEQPACKET): the
/// device's end and the host's.
fn socket_pair(kind: libc::c_int) -> (std::fs::File, OwnedFd) {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: socketpair writes two descriptors into the two-element array it is given.
    let rc = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            kind | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            0,
            fds.as_mut_ptr(),
        )
    };
    assert_eq!(rc, 0, "socketpair: {}", std::io::Error::last_os_error());
    // SAFETY: both descriptors were just created and are owned by nobody else.
    let (device, host) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    (std::fs::File::from(device), host)
}

struct Harness {
    mem: Arc<GuestMemoryMmap>,
    device: Arc<Mutex<VirtioMmio<Net>>>,
    handler: NetHandler,
    epoll: Epoll,
    queues: [GuestQueue; 2],
    notify: Vec<EventFd>,
    stats: Arc<NetStats>,
    /// The host end of the backend.
    host: std::os::unix::net::UnixDatagram,
    next_buffer: u64,
}

fn params(egress: Option<EgressPolicy>, limiter: Option<RateLimiterConfig>) -> NetParams {
    NetParams {
        mac: GUEST_MAC,
        mtu: 1500,
        rate_limiter: limiter,
        egress: egress.map(|p| p.parse().unwrap()),
    }
}

fn policy(allow: Vec<EgressRule>) -> EgressPolicy {
    EgressPolicy {
        guest_ip: GUEST_IP,
        gateway_ip: GATEWAY_IP,
        allow,
        reserved: Vec::new(),
    }
}

impl Harness {
    fn new(params: NetParams) -> Self {
        Self::with_backend(params, libc::SOCK_DGRAM)
    }

    fn with_backend(params: NetParams, kind: libc::c_int) -> Self {
        let (backend, host) = socket_pair(kind);
        let host = std::os::unix::net::UnixDatagram::from(host);
        let net = Net::new(backend, &params);
        let stats = net.stats();
        let mem = Arc::new(GuestMemoryMmap::from_ranges(&[(GuestAddress(0), RAM)]).unwrap());
        let interrupt = Interrupt::new(EventFd::new(libc::EFD_NONBLOCK).unwrap());
        let mut transport = VirtioMmio::new(net, mem.clone(), interrupt).unwrap();
        let queues = [GuestQueue::new(0x10000), GuestQueue::new(0x20000)];
        bring_up_with(
            &mut transport,
            &queues,
            (feature::MAC | feature::MTU) as u32,
            1,
        );
        assert!(transport.is_activated());
        let notify = transport
            .queue_events()
            .iter()
            .map(|e| e.try_clone().unwrap())
            .collect();
        let device = Arc::new(Mutex::new(transport));
        let mut handler = NetHandler::new(device.clone()).unwrap();
        let epoll = Epoll::new().unwrap();
        handler.register(&mut Registry::new(&epoll, 0)).unwrap();
        Self {
            mem,
            device,
            handler,
            epoll,
            queues,
            notify,
            stats,
            host,
            next_buffer: BUFFERS_START,
        }
    }

    fn alloc(&mut self, len: u64) -> u64 {
        let at = self.next_buffer;
        self.next_buffer += len.next_multiple_of(64);
        assert!(self.next_buffer < RAM as u64, "out of guest buffer space");
        at
    }

    /// Runs the device until it goes idle: a device that keeps the loop busy fails here.
    fn pump(&mut self) {
        let mut events = vec![EpollEvent::default(); 16];
        for _ in 0..1000 {
            // Everything the device waits for is ready at once here (socket pair, eventfds).
            let n = self.epoll.wait(0, &mut events).unwrap();
            if n == 0 {
                return;
            }
            for event in &events[..n] {
                self.handler.on_event(
                    event.data() as u32,
                    event.event_set(),
                    &mut Registry::new(&self.epoll, 0),
                );
            }
        }
        panic!("the device never went idle");
    }

    fn kick(&mut self, queue: usize) {
        self.notify[queue].write(1).unwrap();
        self.pump();
    }

    /// The guest transmits `frame` with its header in a descriptor of its own.
    fn send(&mut self, frame: &[u8]) {
        let header = self.alloc(VNET_HEADER_LEN as u64);
        let data = self.alloc(frame.len() as u64);
        self.mem.write_slice(frame, GuestAddress(data)).unwrap();
        self.queues[TX].push_chain(
            &self.mem,
            &[
                (header, VNET_HEADER_LEN as u32, false),
                (data, frame.len() as u32, false),
            ],
        );
        self.kick(TX);
    }

    /// Posts `count` receive buffers of `len` bytes; returns (head, address) of each.
    fn post_rx(&mut self, count: usize, len: u32) -> Vec<(u16, u64)> {
        let posted = (0..count)
            .map(|_| {
                let at = self.alloc(u64::from(len));
                (
                    self.queues[RX].push_chain(&self.mem, &[(at, len, true)]),
                    at,
                )
            })
            .collect();
        self.kick(RX);
        posted
    }

    /// A frame from the host side, then the device runs.
    fn host_sends(&mut self, frame: &[u8]) {
        self.host.send(frame).unwrap();
        self.pump();
    }

    /// Frames that reached the host side.
    fn host_received(&self) -> Vec<Vec<u8>> {
        let mut frames = Vec::new();
        let mut buf = vec![0u8; 70000];
        while let Ok(n) = self.host.recv(&mut buf) {
            frames.push(buf[..n].to_vec());
        }
        frames
    }

    /// The frame the device put in the buffer at `at`, after checking its header.
    fn frame_at(&self, at: u64, used_len: u32) -> Vec<u8> {
        let mut header = [0u8; VNET_HEADER_LEN];
        self.mem.read_slice(&mut header, GuestAddress(at)).unwrap();
        assert_eq!(
            header,
            [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0],
            "num_buffers 1, no offload"
        );
        let mut frame = vec![0u8; used_len as usize - VNET_HEADER_LEN];
        self.mem
            .read_slice(&mut frame, GuestAddress(at + VNET_HEADER_LEN as u64))
            .unwrap();
        frame
    }

    fn stat(&self, name: &str) -> u64 {
        self.stats
            .counters()
            .into_iter()
            .find(|(n, _)| *n == name)
            .unwrap_or_else(|| panic!("no counter {name}"))
            .1
    }
}

fn allowed_out() -> Vec<u8> {
    guest_sends(TCP, 40000, std::net::Ipv4Addr::new(1, 1, 1, 1), 443)
}

#[test]
fn config_space_and_features_describe_the_nic() {
    let h = Harness::new(params(None, None));
    let transport = lock(&h.device);
    let net = transport.device();
    let mut config = [0u8; CONFIG_LEN];
    net.read_config(0, &mut config);
    assert_eq!(&config[0..6], &GUEST_MAC);
    assert_eq!(u16::from_le_bytes([config[6], config[7]]), 0, "status");
    assert_eq!(u16::from_le_bytes([config[8], config[9]]), 1, "queue pairs");
    assert_eq!(u16::from_le_bytes([config[10], config[11]]), 1500, "mtu");
    assert_eq!(net.features(), VIRTIO_F_VERSION_1 | (1 << 5) | (1 << 3));
    assert_eq!(net.queue_max_sizes(), &[256, 256]);
    assert_eq!(net.device_type(), 1);
    let mut past = [0xaau8; 4];
    net.read_config(10, &mut past);
    assert_eq!(past, [0xdc, 0x05, 0, 0]);
}

#[test]
fn frames_the_guest_sends_reach_the_backend_whole() {
    let mut h = Harness::new(params(None, None));
    let frame = allowed_out();
    h.send(&frame);
    // Header and frame in one descriptor, as Linux lays them out.
    let big: Vec<u8> = (0..1514).map(|i| i as u8).collect();
    let at = h.alloc(12 + 1514);
    h.mem.write_slice(&big, GuestAddress(at + 12)).unwrap();
    h.queues[TX].push_chain(&h.mem, &[(at, 12 + 1514, false)]);
    h.kick(TX);
    assert_eq!(h.host_received(), vec![frame.clone(), big]);
    let used = h.queues[TX].take_used(&h.mem);
    assert_eq!(used.len(), 2);
    assert!(used.iter().all(|&(_, len)| len == 0));
    assert_eq!(h.stat("tx_frames"), 2);
    assert_eq!(h.stat("tx_bytes"), (frame.len() + 1514) as u64);
}

#[test]
fn frames_for_the_guest_land_in_its_buffers_with_a_header() {
    let mut h = Harness::new(params(None, None));
    let posted = h.post_rx(2, RX_BUFFER);
    let first = guest_receives(UDP, GATEWAY_IP, 53, 33000);
    h.host_sends(&first);
    let used = h.queues[RX].take_used(&h.mem);
    assert_eq!(
        used,
        vec![(u32::from(posted[0].0), (12 + first.len()) as u32)]
    );
    assert_eq!(h.frame_at(posted[0].1, used[0].1), first);
    // A buffer split over two descriptors: header alone, then the frame.
    let header = h.alloc(12);
    let body = h.alloc(1518);
    let head = h.queues[RX].push_chain(&h.mem, &[(header, 12, true), (body, 1518, true)]);
    h.kick(RX);
    let second: Vec<u8> = (0..1000).map(|i| (i * 7) as u8).collect();
    h.host_sends(&second);
    h.host_sends(&second);
    let used = h.queues[RX].take_used(&h.mem);
    assert_eq!(used.len(), 2);
    assert_eq!(used[0], (u32::from(posted[1].0), 1012));
    assert_eq!(used[1], (u32::from(head), 1012));
    let mut back = vec![0u8; 1000];
    h.mem.read_slice(&mut back, GuestAddress(body)).unwrap();
    assert_eq!(back, second);
    assert_eq!(h.stat("rx_frames"), 3);
    assert_eq!(h.stat("rx_bytes"), (first.len() + 2000) as u64);
    assert_ne!(
        lock(&h.device).interrupt().status(),
        0,
        "the guest was interrupted"
    );
}

#[test]
fn without_buffers_the_device_stops_reading_until_the_driver_posts_more() {
    let mut h = Harness::new(params(None, None));
    // No buffer posted yet: the frames wait in the kernel.
    for i in 0..3u8 {
        h.host.send(&[i; 60]).unwrap();
    }
    h.pump();
    assert_eq!(h.stat("rx_frames"), 0);
    // One buffer: one frame; the device stops again with two waiting in the kernel (and
    // `pump` returning proves the loop went idle rather than spinning on them).
    let posted = h.post_rx(1, RX_BUFFER);
    assert_eq!(
        h.queues[RX].take_used(&h.mem),
        vec![(u32::from(posted[0].0), 72)]
    );
    assert!(h.stat("rx_paused_no_buffer") >= 1);
    h.pump();
    assert_eq!(h.stat("rx_frames"), 1);
    let posted = h.post_rx(3, RX_BUFFER);
    let used = h.queues[RX].take_used(&h.mem);
    assert_eq!(used.len(), 2, "two frames were waiting");
    assert_eq!(h.frame_at(posted[0].1, used[0].1), vec![1; 60]);
    assert_eq!(h.frame_at(posted[1].1, used[1].1), vec![2; 60]);
    // The third buffer is still there for the next frame.
    h.host_sends(&[9; 60]);
    assert_eq!(
        h.queues[RX].take_used(&h.mem),
        vec![(u32::from(posted[2].0), 72)]
    );
    assert_eq!(
        h.stat("rx_dropped_too_big") + h.stat("rx_dropped_policy"),
        0
    );
}

#[test]
fn a_frame_too_big_for_the_buffer_is_dropped_and_the_buffer_kept() {
    let mut h = Harness::new(params(None, None));
    let posted = h.post_rx(1, 12 + 100);
    h.host_sends(&[0x11; 200]);
    assert!(h.queues[RX].take_used(&h.mem).is_empty());
    assert_eq!(h.stat("rx_dropped_too_big"), 1);
    h.host_sends(&[0x22; 100]);
    let used = h.queues[RX].take_used(&h.mem);
    assert_eq!(used, vec![(u32::from(posted[0].0), 112)]);
    assert_eq!(h.frame_at(posted[0].1, 112), vec![0x22; 100]);
    // Shorter than an Ethernet header, and a 64 KiB frame: both dropped.
    h.post_rx(1, RX_BUFFER);
    h.host_sends(&[1; 13]);
    h.host_sends(&vec![3u8; MAX_FRAME_LEN]);
    assert!(h.queues[RX].take_used(&h.mem).is_empty());
    assert_eq!(h.stat("rx_dropped_malformed"), 1);
    assert_eq!(h.stat("rx_dropped_too_big"), 2);
}

#[test]
fn the_policy_drops_both_ways_without_using_up_guest_buffers() {
    let github = std::net::Ipv4Addr::new(140, 82, 112, 4);
    let rules = vec![EgressRule {
        cidr: "140.82.112.0/20".into(),
        ports: Some("443".into()),
        protocol: Some("tcp".into()),
    }];
    let mut h = Harness::new(params(Some(policy(rules)), None));
    let posted = h.post_rx(1, RX_BUFFER);
    // Unsolicited: dropped, the buffer stays.
    h.host_sends(&guest_receives(TCP, github, 443, 40000));
    assert_eq!(h.stat("rx_dropped_policy"), 1);
    assert!(h.queues[RX].take_used(&h.mem).is_empty());
    // Refused out, then allowed out.
    h.send(&guest_sends(TCP, 40000, github, 80));
    h.send(&guest_sends(
        TCP,
        40000,
        std::net::Ipv4Addr::new(8, 8, 8, 8),
        443,
    ));
    let mut spoofed = guest_sends(TCP, 40000, github, 443);
    spoofed[6..12].copy_from_slice(&[2, 0, 0, 0, 0, 9]);
    h.send(&spoofed);
    assert!(h.host_received().is_empty());
    assert_eq!(h.stat("tx_dropped_policy"), 3);
    let allowed = guest_sends(TCP, 40000, github, 443);
    h.send(&allowed);
    assert_eq!(h.host_received(), vec![allowed]);
    // The reply now passes, into the buffer the refused frame did not take.
    let reply = guest_receives(TCP, github, 443, 40000);
    h.host_sends(&reply);
    let used = h.queues[RX].take_used(&h.mem);
    assert_eq!(
        used,
        vec![(u32::from(posted[0].0), (12 + reply.len()) as u32)]
    );
    assert_eq!(h.frame_at(posted[0].1, used[0].1), reply);
    // Every chain the guest sent came back used, refused or not.
    assert_eq!(h.queues[TX].take_used(&h.mem).len(), 4);
}

#[test]
fn rules_can_be_added_to_a_running_device_with_a_policy_only() {
    let target = std::net::Ipv4Addr::new(93, 184, 216, 34);
    let mut h = Harness::new(params(Some(policy(vec![])), None));
    h.send(&guest_sends(TCP, 40000, target, 443));
    assert!(h.host_received().is_empty());
    let rule = EgressRule::host(target).parse().unwrap();
    lock(&h.device).device_mut().allow_egress(&[rule]).unwrap();
    let frame = guest_sends(TCP, 40000, target, 443);
    h.send(&frame);
    assert_eq!(h.host_received(), vec![frame]);
    let open = Harness::new(params(None, None));
    let err = lock(&open.device)
        .device_mut()
        .allow_egress(&[rule])
        .unwrap_err();
    assert!(matches!(err, EgressAllowError::NoPolicy), "{err}");
}

#[test]
fn the_rate_limiter_polices_each_direction_on_its_own() {
    let limiter = RateLimiterConfig {
        bandwidth: None,
        ops: Some(BucketConfig {
            size: 2,
            one_time_burst: None,
            refill_time: 3_600_000,
        }),
    };
    let mut h = Harness::new(params(None, Some(limiter)));
    for _ in 0..3 {
        h.send(&allowed_out());
    }
    assert_eq!(h.host_received().len(), 2);
    assert_eq!(h.stat("tx_dropped_rate_limited"), 1);
    let posted = h.post_rx(3, RX_BUFFER);
    for i in 0..3u8 {
        h.host_sends(&[i; 64]);
    }
    let used = h.queues[RX].take_used(&h.mem);
    assert_eq!(used.len(), 2, "the receive side has its own two tokens");
    assert_eq!(h.stat("rx_dropped_rate_limited"), 1);
    assert_eq!(used[0].0, u32::from(posted[0].0));
}

#[test]
fn hostile_transmit_chains_cost_the_guest_its_frame_and_nothing_else() {
    let mut h = Harness::new(params(None, None));
    let data = h.alloc(0x2_0000);
    let raw = |h: &mut Harness, descs: &[RawDesc]| {
        h.queues[TX].push_raw(&h.mem, descs, descs[0].0);
        h.kick(TX);
        h.queues[TX].take_used(&h.mem)
    };
    let malformed: [&[RawDesc]; 6] = [
        // Only device-writable space: nothing to send.
        &[(0, data, 100, DESC_WRITE, 0)],
        // Shorter than header and Ethernet header.
        &[(0, data, 25, 0, 0)],
        // 4 GiB claimed.
        &[(0, data, u32::MAX, 0, 0)],
        // One byte over the largest frame.
        &[
            (0, data, 12, DESC_NEXT, 1),
            (1, data + 12, MAX_FRAME_LEN as u32 + 1, 0, 0),
        ],
        // Outside guest memory.
        &[(0, RAM as u64 - 10, 100, 0, 0)],
        &[(0, u64::MAX - 50, 100, 0, 0)],
    ];
    for descs in malformed {
        assert_eq!(raw(&mut h, descs), [(0, 0)], "{descs:?}");
    }
    assert!(h.host_received().is_empty());
    assert_eq!(h.stat("tx_dropped_malformed"), 6);
    // A loop, and a next index past the table: the chain ends where the queue's bounds
    // end it (what is read is the guest's own bytes), and the queue moves on.
    for descs in [
        vec![(0, data, 60, DESC_NEXT, 1), (1, data, 60, DESC_NEXT, 0)],
        vec![(0, data, 60, DESC_NEXT, 200)],
    ] {
        assert_eq!(raw(&mut h, &descs).len(), 1, "{descs:?}");
    }
    let _ = h.host_received();
    // The largest frame passes.
    let largest = vec![0x5a; MAX_FRAME_LEN];
    h.mem
        .write_slice(&largest, GuestAddress(data + 12))
        .unwrap();
    raw(
        &mut h,
        &[
            (0, data, 12, DESC_NEXT, 1),
            (1, data + 12, MAX_FRAME_LEN as u32, 0, 0),
        ],
    );
    assert_eq!(h.host_received(), vec![largest]);
}

#[test]
fn hostile_receive_chains_are_handed_back_empty() {
    let mut h = Harness::new(params(None, None));
    let data = h.alloc(0x1000);
    // Queued frames first, so every chain meets one.
    for i in 0..8u8 {
        h.host.send(&[i; 60]).unwrap();
    }
    let raw = |h: &mut Harness, descs: &[RawDesc]| {
        h.queues[RX].push_raw(&h.mem, descs, descs[0].0);
        h.kick(RX);
        h.queues[RX].take_used(&h.mem)
    };
    let unusable: [&[RawDesc]; 4] = [
        // Nothing writable.
        &[(0, data, 2000, 0, 0)],
        // Room for the header and 13 bytes.
        &[(0, data, 25, DESC_WRITE, 0)],
        // Writable space outside guest memory, or claiming 4 GiB.
        &[(0, RAM as u64 - 100, 2000, DESC_WRITE, 0)],
        &[(0, data, u32::MAX, DESC_WRITE, 0)],
    ];
    for descs in unusable {
        assert_eq!(raw(&mut h, descs), [(0, 0)], "{descs:?}");
    }
    assert_eq!(h.stat("rx_frames"), 0);
    assert_eq!(h.stat("rx_unusable_buffers"), 4);
    // A loop is as long as the queue lets it be: a frame fits in its first descriptor.
    let used = raw(
        &mut h,
        &[
            (0, data, 100, DESC_WRITE | DESC_NEXT, 1),
            (1, data, 100, DESC_WRITE | DESC_NEXT, 0),
        ],
    );
    assert_eq!(used, [(0, 72)]);
    // The other frames waited; a good buffer gets the next.
    let posted = h.post_rx(1, RX_BUFFER);
    assert_eq!(
        h.queues[RX].take_used(&h.mem),
        vec![(u32::from(posted[0].0), 72)]
    );
    assert_eq!(h.frame_at(posted[0].1, 72), vec![1; 60]);
}

#[test]
fn random_descriptor_tables_never_break_the_device() {
    let mut h = Harness::new(params(None, None));
    let area = h.alloc(0x10_0000);
    let mut noise = Noise(0x9e37_79b9_7f4a_7c15);
    h.mem
        .write_slice(&allowed_out(), GuestAddress(area + 12))
        .unwrap();
    for round in 0..2000 {
        let queue = (noise.next() % 2) as usize;
        let count = 1 + noise.next() % 6;
        let descs: Vec<RawDesc> = (0..count)
            .map(|i| {
                let addr = match noise.next() % 4 {
                    0 => noise.next(),
                    1 => RAM as u64 - noise.next() % 4096,
                    _ => area + noise.next() % 0x8_0000,
                };
                let len = match noise.next() % 4 {
                    0 => noise.next() as u32,
                    1 => (noise.next() % 64) as u32,
                    _ => (noise.next() % 4000) as u32,
                };
                let flags = (noise.next() % 4) as u16 & (DESC_NEXT | DESC_WRITE);
                let next = (noise.next() % u64::from(QUEUE_SIZE)) as u16;
                (i as u16, addr, len, flags, next)
            })
            .collect();
        if noise.next().is_multiple_of(3) {
            let len = (noise.next() % 1600) as usize;
            h.host.send(&noise.bytes(len)).unwrap();
        }
        h.queues[queue].push_raw(&h.mem, &descs, 0);
        h.kick(queue);
        let _ = h.queues[queue].take_used(&h.mem);
        // Like a driver, keep the receive queue from overflowing: small frames fill
        // whatever usable buffers it still holds.
        for _ in 0..2 * QUEUE_SIZE {
            if h.queues[RX].outstanding() == 0 {
                break;
            }
            h.host_sends(&[round as u8; 14]);
            let _ = h.queues[RX].take_used(&h.mem);
        }
        assert_eq!(h.queues[RX].outstanding(), 0, "round {round}");
        let _ = h.host_received();
    }
    // Still a working NIC.
    while h.host.recv(&mut [0u8; 2000]).is_ok() {}
    h.send(&allowed_out());
    assert_eq!(h.host_received(), vec![allowed_out()]);
    // Frames left waiting in the kernel go into buffers until one stays empty.
    let posted = loop {
        let posted = h.post_rx(1, 2048);
        if h.queues[RX].take_used(&h.mem).is_empty() {
            break posted;
        }
    };
    let reply = guest_receives(TCP, std::net::Ipv4Addr::new(1, 1, 1, 1), 443, 40000);
    h.host_sends(&reply);
    let used = h.queues[RX].take_used(&h.mem);
    assert_eq!(
        used,
        vec![(u32::from(posted[0].0), (12 + reply.len()) as u32)]
    );
    assert_eq!(h.frame_at(posted[0].1, used[0].1), reply);
    let mut magic = [0u8; 4];
    lock(&h.device).read(0, &mut magic);
    assert_eq!(u32::from_le_bytes(magic), 0x7472_6976);
}

#[test]
fn transmit_work_per_event_is_bounded() {
    let mut h = Harness::new(params(None, None));
    let frame = allowed_out();
    for _ in 0..QUEUE_SIZE {
        let at = h.alloc(12 + frame.len() as u64);
        h.mem.write_slice(&frame, GuestAddress(at + 12)).unwrap();
        h.queues[TX].push_chain(&h.mem, &[(at, 12 + frame.len() as u32, false)]);
    }
    let more = {
        let mut transport = lock(&h.device);
        let mut active = transport.active().unwrap();
        process_tx(&mut active, Instant::now())
    };
    assert!(more, "a full budget says there may be more");
    assert_eq!(
        h.queues[TX].take_used(&h.mem).len(),
        usize::from(QUEUE_SIZE)
    );
    // Through the handler, the re-kick settles once the queue is empty.
    h.kick(TX);
    assert_eq!(h.stat("tx_frames"), u64::from(QUEUE_SIZE));
}

#[test]
fn a_backend_that_hangs_up_or_fails_is_dropped_and_the_loop_stays_idle() {
    let mut h = Harness::with_backend(params(None, None), libc::SOCK_SEQPACKET);
    h.post_rx(2, RX_BUFFER);
    h.host_sends(&[7; 60]);
    assert_eq!(h.stat("rx_frames"), 1);
    // The host end closes: the device stops watching it (pump would panic on a busy loop).
    let closed = std::mem::replace(
        &mut h.host,
        std::os::unix::net::UnixDatagram::unbound().unwrap(),
    );
    drop(closed);
    h.pump();
    h.kick(RX);
    // Transmission fails and is counted, the queue keeps moving.
    h.send(&allowed_out());
    assert_eq!(h.stat("tx_dropped_backend"), 1);
    assert_eq!(h.queues[TX].take_used(&h.mem).len(), 1);
}

#[test]
fn a_reset_stops_the_device_and_a_new_bring_up_starts_it_again() {
    let mut h = Harness::new(params(None, None));
    h.post_rx(1, RX_BUFFER);
    lock(&h.device).write(0x70, &0u32.to_le_bytes());
    assert!(!lock(&h.device).is_activated());
    // Frames arriving now wait, notifications do nothing, and the loop stays idle.
    h.host_sends(&[1; 60]);
    h.kick(RX);
    h.kick(TX);
    assert_eq!(h.stat("rx_frames"), 0);
    // The driver starts over with new rings.
    h.queues = [GuestQueue::new(0x30000), GuestQueue::new(0x40000)];
    bring_up_with(
        &mut lock(&h.device),
        &h.queues,
        (feature::MAC | feature::MTU) as u32,
        1,
    );
    let mut status_now = [0u8; 4];
    lock(&h.device).read(0x70, &mut status_now);
    assert_eq!(
        u32::from_le_bytes(status_now) & status::DRIVER_OK,
        status::DRIVER_OK
    );
    let posted = h.post_rx(1, RX_BUFFER);
    assert_eq!(
        h.queues[RX].take_used(&h.mem),
        vec![(u32::from(posted[0].0), 72)]
    );
    assert_eq!(h.frame_at(posted[0].1, 72), vec![1; 60]);
}
