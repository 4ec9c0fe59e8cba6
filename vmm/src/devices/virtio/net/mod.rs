//! virtio-net (device type 1) on a frame backend: a tap (one read is one frame, one write
//! sends one), or in tests a datagram socket.
//!
//! No offloads and no mergeable buffers: every frame in either direction carries the
//! 12-byte `virtio_net_hdr_v1`, and a receive buffer takes one whole frame. Each frame is
//! checked by the egress policy ([`filter`]) and the rate limiter ([`rate`]) before it
//! crosses; what they refuse is dropped and counted.
//!
//! Everything runs on the device thread and nothing there blocks or spins on the guest's
//! behalf: the backend is nonblocking (a frame the host cannot take now is dropped), the
//! backend is only watched while the guest has receive buffers (without them frames wait
//! in the kernel's queue until the driver posts more and notifies), and each event moves a
//! bounded number of frames so a flood one way cannot starve the other.

pub mod filter;
pub mod rate;
pub mod tap;

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use crate::kvm::memory::GuestMemoryMmap;
use agentvm_vmm_api::config::{ParsedPolicy, ParsedRule, RateLimiterConfig};
use virtio_queue::{DescriptorChain, Queue, QueueOwnedT, QueueT};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

use self::filter::{EgressFilter, TooManyRules, Verdict};
use self::rate::RateLimiter;
use super::mmio::{ActiveDevice, VirtioMmio};
use super::{INT_USED_RING, VIRTIO_F_VERSION_1, VirtioDevice};
use crate::event_loop::{Registry, Subscriber};

pub const DEVICE_TYPE: u32 = 1;
const QUEUE_SIZE: u16 = 256;
const QUEUE_SIZES: [u16; 2] = [QUEUE_SIZE; 2];
const RX: usize = 0;
const TX: usize = 1;
/// `virtio_net_hdr_v1`: flags, gso_type, hdr_len, gso_size, csum_start, csum_offset,
/// num_buffers.
pub const VNET_HEADER_LEN: usize = 12;
/// Largest frame moved either way (what the header's 16-bit lengths can describe).
pub const MAX_FRAME_LEN: usize = 65535;
/// An Ethernet header; anything shorter is not a frame.
const MIN_FRAME_LEN: usize = 14;
/// Frames (or guest buffers) handled per direction per event before the loop serves the
/// other devices and the other direction.
const BUDGET: usize = 64;
/// Size of the config space: mac, status, max_virtqueue_pairs, mtu.
pub const CONFIG_LEN: usize = 12;

/// Feature bits (virtio 1.2 §5.1.3).
mod feature {
    pub const MTU: u64 = 1 << 3;
    pub const MAC: u64 = 1 << 5;
}

/// Epoll tokens.
const TOKEN_RX_QUEUE: u32 = 0;
const TOKEN_TX_QUEUE: u32 = 1;
const TOKEN_BACKEND: u32 = 2;

/// What the guest sees of the device and what crosses it, from the VM's config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetParams {
    pub mac: [u8; 6],
    pub mtu: u16,
    pub rate_limiter: Option<RateLimiterConfig>,
    /// Without one every frame passes, as in Cloud Hypervisor.
    pub egress: Option<ParsedPolicy>,
}

/// Counters the VMM reports per network device.
#[derive(Debug, Default)]
pub struct NetStats {
    pub rx_frames: AtomicU64,
    pub rx_bytes: AtomicU64,
    pub tx_frames: AtomicU64,
    pub tx_bytes: AtomicU64,
    pub tx_dropped_policy: AtomicU64,
    pub rx_dropped_policy: AtomicU64,
    pub tx_dropped_rate_limited: AtomicU64,
    pub rx_dropped_rate_limited: AtomicU64,
    /// Larger than the guest's receive buffer.
    pub rx_dropped_too_big: AtomicU64,
    /// Shorter than an Ethernet header (a zero-length datagram, say).
    pub rx_dropped_malformed: AtomicU64,
    /// Unreadable, shorter than header and Ethernet header, or longer than 64 KiB.
    pub tx_dropped_malformed: AtomicU64,
    /// The backend would not take it (full queue, interface down, gone).
    pub tx_dropped_backend: AtomicU64,
    /// Receive buffers too small for even a header (or unreadable), handed back empty.
    pub rx_unusable_buffers: AtomicU64,
    /// Times receiving stopped because the guest had no buffer posted.
    pub rx_paused_no_buffer: AtomicU64,
}

impl NetStats {
    pub fn counters(&self) -> Vec<(&'static str, u64)> {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        vec![
            ("rx_frames", get(&self.rx_frames)),
            ("rx_bytes", get(&self.rx_bytes)),
            ("tx_frames", get(&self.tx_frames)),
            ("tx_bytes", get(&self.tx_bytes)),
            ("tx_dropped_policy", get(&self.tx_dropped_policy)),
            ("rx_dropped_policy", get(&self.rx_dropped_policy)),
            (
                "tx_dropped_rate_limited",
                get(&self.tx_dropped_rate_limited),
            ),
            (
                "rx_dropped_rate_limited",
                get(&self.rx_dropped_rate_limited),
            ),
            ("rx_dropped_too_big", get(&self.rx_dropped_too_big)),
            ("rx_dropped_malformed", get(&self.rx_dropped_malformed)),
            ("tx_dropped_malformed", get(&self.tx_dropped_malformed)),
            ("tx_dropped_backend", get(&self.tx_dropped_backend)),
            ("rx_unusable_buffers", get(&self.rx_unusable_buffers)),
            ("rx_paused_no_buffer", get(&self.rx_paused_no_buffer)),
        ]
    }
}

fn count(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// Why rules could not be added to a device's policy.
#[derive(Debug, thiserror::Error)]
pub enum EgressAllowError {
    #[error("the device has no egress policy: all traffic crosses it already")]
    NoPolicy,
    #[error(transparent)]
    TooMany(#[from] TooManyRules),
}

/// One network device.
pub struct Net {
    backend: File,
    mac: [u8; 6],
    mtu: u16,
    filter: Option<EgressFilter>,
    tx_limiter: RateLimiter,
    rx_limiter: RateLimiter,
    stats: Arc<NetStats>,
    /// One frame, either way (the device thread does one thing at a time).
    frame: Box<[u8]>,
    /// The backend failed for good (closed, interface deleted): it is not read any more.
    backend_failed: bool,
}

impl Net {
    /// A device on `backend`, which must be nonblocking and keep frame boundaries.
    pub fn new(backend: File, params: &NetParams) -> Self {
        let now = Instant::now();
        Self {
            backend,
            mac: params.mac,
            mtu: params.mtu,
            filter: params
                .egress
                .as_ref()
                .map(|policy| EgressFilter::new(params.mac, policy)),
            tx_limiter: RateLimiter::new(params.rate_limiter.as_ref(), now),
            rx_limiter: RateLimiter::new(params.rate_limiter.as_ref(), now),
            stats: Arc::default(),
            frame: vec![0u8; MAX_FRAME_LEN].into_boxed_slice(),
            backend_failed: false,
        }
    }

    pub fn stats(&self) -> Arc<NetStats> {
        Arc::clone(&self.stats)
    }

    pub fn mac(&self) -> [u8; 6] {
        self.mac
    }

    /// The config space: mac, status (0: no VIRTIO_NET_F_STATUS), max_virtqueue_pairs (1),
    /// mtu.
    pub fn config_space(&self) -> [u8; CONFIG_LEN] {
        let mut config = [0u8; CONFIG_LEN];
        config[0..6].copy_from_slice(&self.mac);
        config[8..10].copy_from_slice(&1u16.to_le_bytes());
        config[10..12].copy_from_slice(&self.mtu.to_le_bytes());
        config
    }

    /// Adds rules to the egress policy; they apply from the next frame on.
    pub fn allow_egress(&mut self, rules: &[ParsedRule]) -> Result<(), EgressAllowError> {
        let filter = self.filter.as_mut().ok_or(EgressAllowError::NoPolicy)?;
        filter.allow(rules)?;
        Ok(())
    }

    /// Takes rules out of the egress policy, from the next frame on.
    pub fn revoke_egress(&mut self, rules: &[ParsedRule]) -> Result<(), EgressAllowError> {
        let filter = self.filter.as_mut().ok_or(EgressAllowError::NoPolicy)?;
        filter.revoke(rules);
        Ok(())
    }

    /// Sends the frame of one transmit chain, if it is well-formed and allowed.
    fn transmit(
        &mut self,
        chain: DescriptorChain<&GuestMemoryMmap>,
        memory: &GuestMemoryMmap,
        now: Instant,
    ) {
        let Ok(mut reader) = chain.reader(memory) else {
            count(&self.stats.tx_dropped_malformed);
            return;
        };
        // Checked before a byte is copied: a chain claiming gigabytes costs nothing.
        let len = reader.available_bytes();
        if !(VNET_HEADER_LEN + MIN_FRAME_LEN..=VNET_HEADER_LEN + MAX_FRAME_LEN).contains(&len) {
            count(&self.stats.tx_dropped_malformed);
            return;
        }
        let frame = &mut self.frame[..len - VNET_HEADER_LEN];
        // No offload was negotiated, so the header says nothing we act on.
        let mut header = [0u8; VNET_HEADER_LEN];
        if reader.read_exact(&mut header).is_err() || reader.read_exact(frame).is_err() {
            count(&self.stats.tx_dropped_malformed);
            return;
        }
        if let Some(filter) = &mut self.filter
            && let Verdict::Drop(why) = filter.outbound(frame)
        {
            tracing::trace!(why, "virtio-net: guest frame refused");
            count(&self.stats.tx_dropped_policy);
            return;
        }
        if !self.tx_limiter.allow(frame.len() as u64, now) {
            count(&self.stats.tx_dropped_rate_limited);
            return;
        }
        match (&self.backend).write(frame) {
            Ok(n) if n == frame.len() => {
                count(&self.stats.tx_frames);
                self.stats
                    .tx_bytes
                    .fetch_add(frame.len() as u64, Ordering::Relaxed);
            }
            Ok(_) => count(&self.stats.tx_dropped_backend),
            Err(e) => {
                if e.kind() != std::io::ErrorKind::WouldBlock {
                    tracing::debug!(error = %e, "virtio-net: backend write");
                }
                count(&self.stats.tx_dropped_backend);
            }
        }
    }

    /// Reads the next frame the guest may have into `self.frame`.
    fn next_inbound(&mut self, now: Instant) -> Inbound {
        let n = match (&self.backend).read(&mut self.frame) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Inbound::Empty,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => return Inbound::Dropped,
            Err(e) => {
                tracing::warn!(error = %e, "virtio-net: the backend failed; no more frames for the guest");
                self.backend_failed = true;
                return Inbound::Failed;
            }
        };
        let frame = &self.frame[..n];
        if n < MIN_FRAME_LEN {
            count(&self.stats.rx_dropped_malformed);
            return Inbound::Dropped;
        }
        if let Some(filter) = &mut self.filter
            && let Verdict::Drop(why) = filter.inbound(frame)
        {
            tracing::trace!(why, "virtio-net: frame for the guest refused");
            count(&self.stats.rx_dropped_policy);
            return Inbound::Dropped;
        }
        if !self.rx_limiter.allow(n as u64, now) {
            count(&self.stats.rx_dropped_rate_limited);
            return Inbound::Dropped;
        }
        Inbound::Frame(n)
    }
}

/// One read of the backend.
enum Inbound {
    /// This many bytes of `Net::frame` go to the guest.
    Frame(usize),
    /// A frame was read and dropped (or the read was interrupted): try again.
    Dropped,
    /// Nothing to read now.
    Empty,
    Failed,
}

impl VirtioDevice for Net {
    fn device_type(&self) -> u32 {
        DEVICE_TYPE
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &QUEUE_SIZES
    }

    fn features(&self) -> u64 {
        VIRTIO_F_VERSION_1 | feature::MAC | feature::MTU
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        super::read_config_space(&self.config_space(), offset, data);
    }

    fn write_config(&mut self, _offset: u64, _data: &[u8]) {
        // The MAC is writable only for legacy drivers, which we refuse; nothing else is.
    }

    fn activate(&mut self, _acked_features: u64) {}

    fn reset(&mut self) {
        // Queue state is the transport's; the handler stops watching the backend when it
        // next sees the device inactive.
    }
}

/// Sends what the guest queued for transmission, at most [`BUDGET`] frames. Returns true
/// when it stopped at the budget (there may be more).
pub fn process_tx(active: &mut ActiveDevice<'_, Net>, now: Instant) -> bool {
    let memory = active.memory;
    let queue = &mut active.queues[TX];
    if !queue.ready() {
        return false;
    }
    let mut handled = 0;
    while handled < BUDGET {
        let Some(chain) = queue.pop_descriptor_chain(memory) else {
            break;
        };
        handled += 1;
        let head = chain.head_index();
        active.device.transmit(chain, memory, now);
        if let Err(e) = queue.add_used(memory, head, 0) {
            tracing::warn!(error = %e, "virtio-net tx used ring");
            break;
        }
    }
    if handled > 0 {
        notify(queue, memory, active.interrupt);
    }
    handled == BUDGET
}

/// How receiving stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RxStop {
    /// The backend has nothing more now.
    Drained,
    /// The guest has no buffer: stop watching the backend until it posts one.
    NoBuffers,
    /// The budget ran out with frames perhaps left (the backend stays readable).
    Budget,
    /// The backend failed for good.
    Failed,
}

/// Moves frames from the backend into the guest's receive buffers, at most [`BUDGET`]
/// reads (or unusable buffers). A buffer is taken before the backend is read, so frames
/// wait in the kernel while the guest has none; a frame that is dropped does not use up the
/// buffer it would have gone into.
pub fn process_rx(active: &mut ActiveDevice<'_, Net>, now: Instant) -> RxStop {
    let memory = active.memory;
    let interrupt = active.interrupt;
    let device = &mut *active.device;
    let queue = &mut active.queues[RX];
    if device.backend_failed {
        return RxStop::Failed;
    }
    let mut used = false;
    let mut held = None;
    let mut stop = RxStop::Budget;
    for _ in 0..BUDGET {
        let (head, mut writer) = match held.take() {
            Some(held) => held,
            None => match next_buffer(queue, memory, &device.stats) {
                Buffer::Usable(head, writer) => (head, writer),
                Buffer::Unusable(head) => {
                    if queue.add_used(memory, head, 0).is_err() {
                        stop = RxStop::NoBuffers;
                        break;
                    }
                    used = true;
                    continue;
                }
                Buffer::None => {
                    count(&device.stats.rx_paused_no_buffer);
                    stop = RxStop::NoBuffers;
                    break;
                }
            },
        };
        let len = match device.next_inbound(now) {
            Inbound::Frame(len) => len,
            Inbound::Dropped => {
                held = Some((head, writer));
                continue;
            }
            Inbound::Empty => {
                held = Some((head, writer));
                stop = RxStop::Drained;
                break;
            }
            Inbound::Failed => {
                held = Some((head, writer));
                stop = RxStop::Failed;
                break;
            }
        };
        if writer.available_bytes() < VNET_HEADER_LEN + len {
            // Kept for the next frame, which may fit.
            count(&device.stats.rx_dropped_too_big);
            held = Some((head, writer));
            continue;
        }
        let mut header = [0u8; VNET_HEADER_LEN];
        // num_buffers: one, always (no mergeable buffers).
        header[10..12].copy_from_slice(&1u16.to_le_bytes());
        let written = writer
            .write_all(&header)
            .and_then(|()| writer.write_all(&device.frame[..len]));
        if let Err(e) = written {
            // Checked above, so only guest memory going away mid-copy lands here.
            tracing::debug!(error = %e, "virtio-net: writing a frame into guest memory");
        }
        if let Err(e) = queue.add_used(memory, head, writer.bytes_written() as u32) {
            tracing::warn!(error = %e, "virtio-net rx used ring");
            stop = RxStop::NoBuffers;
            break;
        }
        used = true;
        count(&device.stats.rx_frames);
        device
            .stats
            .rx_bytes
            .fetch_add(len as u64, Ordering::Relaxed);
    }
    if held.is_some() {
        // The buffer we popped but did not fill is the last one popped: put it back.
        queue.go_to_previous_position();
    }
    if used {
        notify(queue, memory, interrupt);
    }
    stop
}

/// A receive buffer from the guest.
enum Buffer<'a> {
    Usable(u16, crate::kvm::memory::ChainWriter<'a>),
    /// Invalid, or too small for a header and an Ethernet header: handed back empty so the
    /// queue moves on.
    Unusable(u16),
    None,
}

fn next_buffer<'a>(queue: &mut Queue, memory: &'a GuestMemoryMmap, stats: &NetStats) -> Buffer<'a> {
    if !queue.ready() {
        return Buffer::None;
    }
    let Some(chain) = queue.pop_descriptor_chain(memory) else {
        return Buffer::None;
    };
    let head = chain.head_index();
    match chain.writer(memory) {
        Ok(writer) if writer.available_bytes() >= VNET_HEADER_LEN + MIN_FRAME_LEN => {
            Buffer::Usable(head, writer)
        }
        _ => {
            count(&stats.rx_unusable_buffers);
            Buffer::Unusable(head)
        }
    }
}

fn notify(queue: &mut Queue, memory: &GuestMemoryMmap, interrupt: &super::Interrupt) {
    match queue.needs_notification(memory) {
        Ok(false) => {}
        _ => interrupt.signal(INT_USED_RING),
    }
}

pub fn lock(device: &Mutex<VirtioMmio<Net>>) -> MutexGuard<'_, VirtioMmio<Net>> {
    device.lock().unwrap_or_else(|p| p.into_inner())
}

/// A network device's presence on the device thread: its two queue-notify eventfds, and
/// the backend while the guest has receive buffers.
pub struct NetHandler {
    device: Arc<Mutex<VirtioMmio<Net>>>,
    queue_events: Vec<EventFd>,
    backend: RawFd,
    /// The backend is in the epoll set.
    watching: bool,
}

impl NetHandler {
    pub fn new(device: Arc<Mutex<VirtioMmio<Net>>>) -> std::io::Result<Self> {
        let transport = lock(&device);
        let queue_events = transport
            .queue_events()
            .iter()
            .map(EventFd::try_clone)
            .collect::<Result<_, _>>()?;
        let backend = transport.device().backend.as_raw_fd();
        drop(transport);
        Ok(Self {
            device,
            queue_events,
            backend,
            watching: false,
        })
    }

    fn watch(&mut self, registry: &mut Registry<'_>, failed: bool) {
        if self.watching || failed {
            return;
        }
        match registry.add(self.backend, TOKEN_BACKEND, EventSet::IN) {
            Ok(()) => self.watching = true,
            Err(e) => tracing::warn!(error = %e, "virtio-net: watching the backend"),
        }
    }

    fn unwatch(&mut self, registry: &mut Registry<'_>) {
        if self.watching {
            registry.remove(self.backend);
            self.watching = false;
        }
    }
}

impl Subscriber for NetHandler {
    fn register(&mut self, registry: &mut Registry<'_>) -> std::io::Result<()> {
        registry.add(
            self.queue_events[RX].as_raw_fd(),
            TOKEN_RX_QUEUE,
            EventSet::IN,
        )?;
        registry.add(
            self.queue_events[TX].as_raw_fd(),
            TOKEN_TX_QUEUE,
            EventSet::IN,
        )?;
        // A device restored live has its receive buffers posted already, and its driver
        // will not notify again for them.
        if lock(&self.device).is_activated() {
            self.watch(registry, false);
        }
        Ok(())
    }

    fn on_event(&mut self, token: u32, events: EventSet, registry: &mut Registry<'_>) {
        let device = Arc::clone(&self.device);
        let mut transport = lock(&device);
        match token {
            TOKEN_RX_QUEUE | TOKEN_TX_QUEUE => {
                let _ = self.queue_events[token as usize].read();
            }
            _ => {}
        }
        let Some(mut active) = transport.active() else {
            // Not live (or reset): frames wait in the kernel until the driver posts buffers.
            self.unwatch(registry);
            return;
        };
        if token == TOKEN_BACKEND && events.intersects(EventSet::ERROR | EventSet::HANG_UP) {
            // A hung-up or failed backend stays ready forever: stop watching it for good
            // (what it still held is lost with it).
            tracing::warn!("virtio-net: the backend hung up; no more frames for the guest");
            active.device.backend_failed = true;
            self.unwatch(registry);
            return;
        }
        let now = Instant::now();
        if token == TOKEN_TX_QUEUE && process_tx(&mut active, now) {
            // Budget spent with frames perhaps left: come back after the others.
            let _ = self.queue_events[TX].write(1);
        }
        if token == TOKEN_RX_QUEUE {
            // New buffers, perhaps: watch the backend again.
            self.watch(registry, active.device.backend_failed);
        }
        if self.watching && token != TOKEN_TX_QUEUE {
            match process_rx(&mut active, now) {
                RxStop::NoBuffers | RxStop::Failed => self.unwatch(registry),
                RxStop::Drained | RxStop::Budget => {}
            }
        }
    }
}

#[cfg(test)]
mod test_frames;
#[cfg(test)]
mod tests;
