//! virtio-vsock (device type 19) with Firecracker's hybrid host side: guest streams end in
//! unix sockets on the host instead of a host vsock stack (which PVM hosts do not have).
//!
//! The device runs on the device thread: queue notifications and host socket readiness both
//! arrive there, and every step reads the guest's descriptors defensively, so a malformed
//! packet costs the guest that stream and nothing else.

pub mod connection;
pub mod host;
pub mod muxer;
pub mod packet;

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use crate::kvm::memory::GuestMemoryMmap;
use virtio_queue::{DescriptorChain, QueueOwnedT, QueueT};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

use self::muxer::{Muxer, TOKEN_LISTENER, TOKEN_STREAM_BASE};
use self::packet::{HEADER_LEN, Header};
use super::mmio::{ActiveDevice, VirtioMmio};
use super::{INT_USED_RING, VIRTIO_F_VERSION_1, VirtioDevice};
use crate::event_loop::{Registry, Subscriber};

pub use self::muxer::VsockStats;

pub const DEVICE_TYPE: u32 = 19;
const QUEUE_SIZE: u16 = 256;
const QUEUE_SIZES: [u16; 3] = [QUEUE_SIZE; 3];
const RX: usize = 0;
const TX: usize = 1;
const EVENT: usize = 2;
/// Epoll tokens of the three queue-notify eventfds (between the listener and the streams).
const TOKEN_QUEUE_BASE: u32 = 1;

pub struct Vsock {
    cid: u64,
    muxer: Muxer,
}

impl Vsock {
    pub fn new(cid: u64, muxer: Muxer) -> Self {
        Self { cid, muxer }
    }

    pub fn muxer(&self) -> &Muxer {
        &self.muxer
    }

    pub fn cid(&self) -> u64 {
        self.cid
    }
}

impl VirtioDevice for Vsock {
    fn device_type(&self) -> u32 {
        DEVICE_TYPE
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &QUEUE_SIZES
    }

    fn features(&self) -> u64 {
        VIRTIO_F_VERSION_1
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        // The config space is the guest CID (le64).
        super::read_config_space(&self.cid.to_le_bytes(), offset, data);
    }

    fn write_config(&mut self, _offset: u64, _data: &[u8]) {
        // The CID is read-only.
    }

    fn activate(&mut self, _acked_features: u64) {}

    fn reset(&mut self) {
        // The driver starts over: nothing it knew about survives. Connections are closed when
        // the device thread next runs (it owns the epoll registrations).
    }
}

/// The vsock device's presence on the device thread.
pub struct VsockHandler {
    device: Arc<Mutex<VirtioMmio<Vsock>>>,
    queue_events: Vec<EventFd>,
    was_active: bool,
}

impl VsockHandler {
    pub fn new(device: Arc<Mutex<VirtioMmio<Vsock>>>) -> std::io::Result<Self> {
        let queue_events = lock(&device)
            .queue_events()
            .iter()
            .map(EventFd::try_clone)
            .collect::<Result<_, _>>()?;
        Ok(Self {
            device,
            queue_events,
            was_active: false,
        })
    }
}

fn lock(device: &Mutex<VirtioMmio<Vsock>>) -> MutexGuard<'_, VirtioMmio<Vsock>> {
    device.lock().unwrap_or_else(|p| p.into_inner())
}

impl Subscriber for VsockHandler {
    fn register(&mut self, registry: &mut Registry<'_>) -> std::io::Result<()> {
        lock(&self.device).device_mut().muxer.register(registry)?;
        for (i, event) in self.queue_events.iter().enumerate() {
            registry.add(event.as_raw_fd(), TOKEN_QUEUE_BASE + i as u32, EventSet::IN)?;
        }
        Ok(())
    }

    fn on_event(&mut self, token: u32, events: EventSet, registry: &mut Registry<'_>) {
        let mut transport = lock(&self.device);
        if !transport.is_activated() && self.was_active {
            // The driver reset the device: its streams are gone.
            transport.device_mut().muxer.reset_all(registry);
        }
        self.was_active = transport.is_activated();
        match token {
            TOKEN_LISTENER => transport.device_mut().muxer.accept(registry),
            t if (TOKEN_QUEUE_BASE..TOKEN_STREAM_BASE).contains(&t) => {
                if let Some(event) = self.queue_events.get((t - TOKEN_QUEUE_BASE) as usize) {
                    let _ = event.read();
                }
            }
            t => transport
                .device_mut()
                .muxer
                .on_stream_event(t, events, registry),
        }
        if let Some(mut active) = transport.active() {
            process_rx(&mut active, registry);
            if process_tx(&mut active, registry) {
                // Our budget ran out with packets left: come back after serving the others.
                let _ = self.queue_events[TX].write(1);
            }
            process_rx(&mut active, registry);
        }
    }

    fn deadline(&self) -> Option<Instant> {
        lock(&self.device).device().muxer.deadline()
    }

    fn on_deadline(&mut self, now: Instant, registry: &mut Registry<'_>) {
        let mut transport = lock(&self.device);
        transport.device_mut().muxer.on_deadline(now, registry);
        if let Some(mut active) = transport.active() {
            process_rx(&mut active, registry);
        }
    }
}

/// Why a transmit chain could not be read as a packet.
struct Unreadable {
    header: Option<Header>,
    why: &'static str,
}

fn read_packet(
    chain: DescriptorChain<&GuestMemoryMmap>,
    memory: &GuestMemoryMmap,
) -> Result<(Header, Vec<u8>), Unreadable> {
    let unreadable = |header, why| Unreadable { header, why };
    let mut reader = chain
        .reader(memory)
        .map_err(|_| unreadable(None, "descriptor chain is invalid"))?;
    if reader.available_bytes() < HEADER_LEN {
        return Err(unreadable(None, "shorter than a packet header"));
    }
    let mut raw = [0u8; HEADER_LEN];
    reader
        .read_exact(&mut raw)
        .map_err(|_| unreadable(None, "header not readable"))?;
    let header = Header::parse(&raw);
    if header.len > muxer::MAX_PAYLOAD {
        return Err(unreadable(Some(header), "payload larger than 64 KiB"));
    }
    if header.len as usize > reader.available_bytes() {
        return Err(unreadable(Some(header), "payload longer than its buffers"));
    }
    let mut payload = vec![0u8; header.len as usize];
    reader
        .read_exact(&mut payload)
        .map_err(|_| unreadable(Some(header), "payload not readable"))?;
    Ok((header, payload))
}

/// Takes guest packets off the transmit queue. Returns true when it stopped with packets
/// left because its per-call budget ran out.
fn process_tx(active: &mut ActiveDevice<'_, Vsock>, registry: &mut Registry<'_>) -> bool {
    let memory = active.memory;
    let muxer = &mut active.device.muxer;
    let queue = &mut active.queues[TX];
    let mut budget = queue.size();
    let mut used = false;
    let mut exhausted = false;
    while !muxer.backlogged() {
        if budget == 0 {
            exhausted = true;
            break;
        }
        let Some(chain) = queue.pop_descriptor_chain(memory) else {
            break;
        };
        budget -= 1;
        let head = chain.head_index();
        match read_packet(chain, memory) {
            Ok((header, payload)) => muxer.on_guest_packet(header, &payload, registry),
            Err(Unreadable { header, why }) => muxer.on_unreadable_packet(header, why, registry),
        }
        if let Err(e) = queue.add_used(memory, head, 0) {
            tracing::warn!(error = %e, "vsock tx used ring");
            break;
        }
        used = true;
    }
    if used {
        notify(active, TX);
    }
    exhausted
}

/// Fills guest receive buffers with whatever the muxer has for the guest.
fn process_rx(active: &mut ActiveDevice<'_, Vsock>, registry: &mut Registry<'_>) {
    let memory = active.memory;
    let muxer = &mut active.device.muxer;
    let queue = &mut active.queues[RX];
    let mut used = false;
    while muxer.has_work_for_guest() {
        let Some(chain) = queue.pop_descriptor_chain(memory) else {
            break;
        };
        let head = chain.head_index();
        let mut writer = match chain.writer(memory) {
            Ok(writer) if writer.available_bytes() >= HEADER_LEN => writer,
            _ => {
                // A receive buffer we cannot use: hand it back empty so the queue moves on.
                tracing::debug!("unusable vsock receive buffer from the guest");
                if queue.add_used(memory, head, 0).is_err() {
                    break;
                }
                used = true;
                continue;
            }
        };
        let Some((header, payload)) = muxer.next_for_guest(writer.available_bytes(), registry)
        else {
            queue.go_to_previous_position();
            break;
        };
        let written = writer
            .write_all(&header.to_bytes())
            .and_then(|()| writer.write_all(&payload));
        if let Err(e) = written {
            tracing::debug!(error = %e, "writing a vsock packet into guest memory");
        }
        if let Err(e) = queue.add_used(memory, head, writer.bytes_written() as u32) {
            tracing::warn!(error = %e, "vsock rx used ring");
            break;
        }
        used = true;
    }
    if used {
        notify(active, RX);
    }
}

fn notify(active: &mut ActiveDevice<'_, Vsock>, queue: usize) {
    match active.queues[queue].needs_notification(active.memory) {
        Ok(false) => {}
        _ => active.interrupt.signal(INT_USED_RING),
    }
}

/// Posts TRANSPORT_RESET on the event queue: the guest drops every stream and keeps its
/// listeners. Used when a snapshot cuts all host connections.
pub fn transport_reset(active: &mut ActiveDevice<'_, Vsock>, registry: &mut Registry<'_>) {
    active.device.muxer.reset_all(registry);
    let memory = active.memory;
    let queue = &mut active.queues[EVENT];
    let Some(chain) = queue.pop_descriptor_chain(memory) else {
        tracing::warn!("no vsock event buffer for the transport reset");
        return;
    };
    let head = chain.head_index();
    let len = match chain.writer(memory) {
        Ok(mut writer) => writer
            .write_all(&packet::EVENT_TRANSPORT_RESET.to_le_bytes())
            .map(|()| 4)
            .unwrap_or(0),
        Err(_) => 0,
    };
    if queue.add_used(memory, head, len).is_ok() {
        notify(active, EVENT);
    }
}

#[cfg(test)]
mod tests;
