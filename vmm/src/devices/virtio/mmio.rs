//! virtio-mmio transport, version 2 (virtio 1.2 §4.2.2): the register window a guest uses to
//! negotiate features and hand over its virtqueues.
//!
//! Everything here is driven by guest writes, so every value is checked: out-of-range queue
//! selectors read as absent queues, queue settings are ignored while a queue is live, and a
//! driver that goes live with unusable queues gets DEVICE_NEEDS_RESET instead of a device
//! working on garbage.

use std::sync::Arc;

use crate::kvm::memory::GuestMemoryMmap;
use virtio_queue::{Queue, QueueT};
use vmm_sys_util::eventfd::EventFd;

use agentvm_snapshot::state::{QueueState as SavedQueue, VirtioMmioState};

use super::{Interrupt, VIRTIO_F_VERSION_1, VirtioDevice, status};
use crate::devices::bus::BusDevice;

const MAGIC: u32 = 0x7472_6976; // "virt"
const VERSION: u32 = 2;
const VENDOR_ID: u32 = 0x4d56_4741; // "AGVM"

mod reg {
    pub const MAGIC: u64 = 0x000;
    pub const VERSION: u64 = 0x004;
    pub const DEVICE_ID: u64 = 0x008;
    pub const VENDOR_ID: u64 = 0x00c;
    pub const DEVICE_FEATURES: u64 = 0x010;
    pub const DEVICE_FEATURES_SEL: u64 = 0x014;
    pub const DRIVER_FEATURES: u64 = 0x020;
    pub const DRIVER_FEATURES_SEL: u64 = 0x024;
    pub const QUEUE_SEL: u64 = 0x030;
    pub const QUEUE_NUM_MAX: u64 = 0x034;
    pub const QUEUE_NUM: u64 = 0x038;
    pub const QUEUE_READY: u64 = 0x044;
    pub const QUEUE_NOTIFY: u64 = 0x050;
    pub const INTERRUPT_STATUS: u64 = 0x060;
    pub const INTERRUPT_ACK: u64 = 0x064;
    pub const STATUS: u64 = 0x070;
    pub const QUEUE_DESC_LOW: u64 = 0x080;
    pub const QUEUE_DESC_HIGH: u64 = 0x084;
    pub const QUEUE_DRIVER_LOW: u64 = 0x090;
    pub const QUEUE_DRIVER_HIGH: u64 = 0x094;
    pub const QUEUE_DEVICE_LOW: u64 = 0x0a0;
    pub const QUEUE_DEVICE_HIGH: u64 = 0x0a4;
    pub const CONFIG_GENERATION: u64 = 0x0fc;
    pub const CONFIG: u64 = 0x100;
}

/// Offset of QueueNotify in the window, for ioeventfd registration.
pub const NOTIFY_OFFSET: u64 = reg::QUEUE_NOTIFY;

pub struct VirtioMmio<D: VirtioDevice> {
    device: D,
    memory: Arc<GuestMemoryMmap>,
    interrupt: Interrupt,
    queues: Vec<Queue>,
    /// One per queue: written when the driver notifies it (by KVM directly when the
    /// ioeventfd is registered, by us when the write reaches userspace).
    queue_events: Vec<EventFd>,
    status: u32,
    device_features_sel: u32,
    driver_features_sel: u32,
    acked_features: u64,
    queue_sel: u32,
    activated: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum MmioError {
    #[error("creating a virtqueue of size {0}: {1}")]
    Queue(u16, String),
    #[error("creating a queue eventfd: {0}")]
    EventFd(std::io::Error),
    #[error("virtio-mmio state: {0}")]
    State(String),
}

impl<D: VirtioDevice> VirtioMmio<D> {
    pub fn new(
        device: D,
        memory: Arc<GuestMemoryMmap>,
        interrupt: Interrupt,
    ) -> Result<Self, MmioError> {
        let mut queues = Vec::new();
        let mut queue_events = Vec::new();
        for &size in device.queue_max_sizes() {
            queues.push(Queue::new(size).map_err(|e| MmioError::Queue(size, e.to_string()))?);
            queue_events.push(
                EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC).map_err(MmioError::EventFd)?,
            );
        }
        Ok(Self {
            device,
            memory,
            interrupt,
            queues,
            queue_events,
            status: 0,
            device_features_sel: 0,
            driver_features_sel: 0,
            acked_features: 0,
            queue_sel: 0,
            activated: false,
        })
    }

    /// Transport registers and queues, for a snapshot (the VM is paused).
    pub fn save(&self, device_config: Vec<u8>) -> VirtioMmioState {
        VirtioMmioState {
            status: self.status,
            acked_features: self.acked_features,
            device_features_sel: self.device_features_sel,
            driver_features_sel: self.driver_features_sel,
            queue_sel: self.queue_sel,
            activated: self.activated,
            interrupt_status: self.interrupt.status(),
            queues: self
                .queues
                .iter()
                .map(|q| {
                    let s = q.state();
                    SavedQueue {
                        max_size: s.max_size,
                        size: s.size,
                        ready: s.ready,
                        desc_table: s.desc_table,
                        avail_ring: s.avail_ring,
                        used_ring: s.used_ring,
                        next_avail: s.next_avail,
                        next_used: s.next_used,
                        event_idx_enabled: s.event_idx_enabled,
                    }
                })
                .collect(),
            device_config,
        }
    }

    /// A transport continuing from `state`. Queue settings are checked as a driver's writes
    /// would be: a snapshot cannot smuggle in a queue the guest could not have configured.
    pub fn restore(
        device: D,
        memory: Arc<GuestMemoryMmap>,
        interrupt: Interrupt,
        state: &VirtioMmioState,
    ) -> Result<Self, MmioError> {
        let mut transport = Self::new(device, memory, interrupt)?;
        if state.queues.len() != transport.queues.len() {
            return Err(MmioError::State(format!(
                "{} queues saved, the device has {}",
                state.queues.len(),
                transport.queues.len()
            )));
        }
        for (queue, saved) in transport.queues.iter_mut().zip(&state.queues) {
            if saved.max_size != queue.max_size() {
                return Err(MmioError::State("queue size limits differ".into()));
            }
            let restored = Queue::try_from(virtio_queue::QueueState {
                max_size: saved.max_size,
                next_avail: saved.next_avail,
                next_used: saved.next_used,
                event_idx_enabled: saved.event_idx_enabled,
                size: saved.size,
                ready: saved.ready,
                desc_table: saved.desc_table,
                avail_ring: saved.avail_ring,
                used_ring: saved.used_ring,
            })
            .map_err(|e| MmioError::State(format!("queue: {e}")))?;
            *queue = restored;
        }
        transport.status = state.status;
        transport.acked_features = state.acked_features;
        transport.device_features_sel = state.device_features_sel;
        transport.driver_features_sel = state.driver_features_sel;
        transport.queue_sel = state.queue_sel;
        if state.activated {
            if !transport.queues_valid() {
                return Err(MmioError::State(
                    "an active device with unusable queues".into(),
                ));
            }
            transport.activated = true;
            transport.device.activate(state.acked_features);
        }
        if state.interrupt_status != 0 {
            transport.interrupt.signal(state.interrupt_status);
        }
        Ok(transport)
    }

    pub fn queue_events(&self) -> &[EventFd] {
        &self.queue_events
    }

    pub fn interrupt(&self) -> &Interrupt {
        &self.interrupt
    }

    pub fn device(&self) -> &D {
        &self.device
    }

    pub fn device_mut(&mut self) -> &mut D {
        &mut self.device
    }

    /// The queues, guest memory and device, once the driver has brought the device up.
    pub fn active(&mut self) -> Option<ActiveDevice<'_, D>> {
        self.activated.then(|| ActiveDevice {
            device: &mut self.device,
            queues: &mut self.queues,
            memory: &self.memory,
            interrupt: &self.interrupt,
        })
    }

    pub fn is_activated(&self) -> bool {
        self.activated
    }

    fn selected_queue(&mut self) -> Option<&mut Queue> {
        if self.activated {
            return None;
        }
        self.queues.get_mut(self.queue_sel as usize)
    }

    fn read_register(&self, offset: u64) -> u32 {
        match offset {
            reg::MAGIC => MAGIC,
            reg::VERSION => VERSION,
            reg::DEVICE_ID => self.device.device_type(),
            reg::VENDOR_ID => VENDOR_ID,
            reg::DEVICE_FEATURES => match self.device_features_sel {
                0 => self.device.features() as u32,
                1 => (self.device.features() >> 32) as u32,
                _ => 0,
            },
            reg::QUEUE_NUM_MAX => self
                .queues
                .get(self.queue_sel as usize)
                .map_or(0, |q| u32::from(q.max_size())),
            reg::QUEUE_READY => self
                .queues
                .get(self.queue_sel as usize)
                .map_or(0, |q| u32::from(q.ready())),
            reg::INTERRUPT_STATUS => self.interrupt.status(),
            reg::STATUS => self.status,
            reg::CONFIG_GENERATION => 0,
            _ => 0,
        }
    }

    fn write_register(&mut self, offset: u64, value: u32) {
        match offset {
            reg::DEVICE_FEATURES_SEL => self.device_features_sel = value,
            reg::DRIVER_FEATURES_SEL => self.driver_features_sel = value,
            reg::DRIVER_FEATURES => {
                // Features are fixed once FEATURES_OK is set.
                if self.status & status::FEATURES_OK != 0 || self.driver_features_sel > 1 {
                    return;
                }
                let shift = 32 * self.driver_features_sel;
                self.acked_features = (self.acked_features & !(0xffff_ffff_u64 << shift))
                    | (u64::from(value) << shift);
            }
            reg::QUEUE_SEL => self.queue_sel = value,
            reg::QUEUE_NUM => {
                if let Some(q) = self.selected_queue() {
                    q.set_size(value.min(u32::from(u16::MAX)) as u16);
                }
            }
            reg::QUEUE_READY => {
                if let Some(q) = self.selected_queue() {
                    q.set_ready(value == 1);
                }
            }
            reg::QUEUE_DESC_LOW => {
                self.set_queue_address(|q| q.set_desc_table_address(Some(value), None))
            }
            reg::QUEUE_DESC_HIGH => {
                self.set_queue_address(|q| q.set_desc_table_address(None, Some(value)))
            }
            reg::QUEUE_DRIVER_LOW => {
                self.set_queue_address(|q| q.set_avail_ring_address(Some(value), None))
            }
            reg::QUEUE_DRIVER_HIGH => {
                self.set_queue_address(|q| q.set_avail_ring_address(None, Some(value)))
            }
            reg::QUEUE_DEVICE_LOW => {
                self.set_queue_address(|q| q.set_used_ring_address(Some(value), None))
            }
            reg::QUEUE_DEVICE_HIGH => {
                self.set_queue_address(|q| q.set_used_ring_address(None, Some(value)))
            }
            reg::QUEUE_NOTIFY => {
                if let Some(event) = self.queue_events.get(value as usize)
                    && let Err(e) = event.write(1)
                {
                    tracing::warn!(error = %e, "queue notify");
                }
            }
            reg::INTERRUPT_ACK => self.interrupt.acknowledge(value),
            reg::STATUS => self.write_status(value),
            _ => {}
        }
    }

    fn set_queue_address(&mut self, set: impl FnOnce(&mut Queue)) {
        if let Some(q) = self.selected_queue()
            && !q.ready()
        {
            set(q);
        }
    }

    fn write_status(&mut self, value: u32) {
        if value == 0 {
            self.reset();
            return;
        }
        // Bits are only ever added by a driver; anything else is a driver bug we refuse.
        if value & self.status != self.status {
            tracing::warn!(
                old = self.status,
                new = value,
                "virtio driver cleared status bits"
            );
            return;
        }
        let added = value & !self.status;
        let mut value = value;
        if added & status::FEATURES_OK != 0 {
            let offered = self.device.features();
            let unknown = self.acked_features & !offered;
            if unknown != 0 || self.acked_features & VIRTIO_F_VERSION_1 == 0 {
                tracing::warn!(
                    acked = self.acked_features,
                    offered,
                    "virtio driver accepted features we did not offer or not VERSION_1"
                );
                value &= !status::FEATURES_OK;
            }
        }
        if added & status::DRIVER_OK != 0 && !self.activated {
            if value & status::FEATURES_OK == 0 || !self.queues_valid() {
                tracing::warn!("virtio driver went live with unusable queues");
                value = (value & !status::DRIVER_OK) | status::DEVICE_NEEDS_RESET;
                self.interrupt.signal(super::INT_CONFIG_CHANGE);
            } else {
                self.activated = true;
                self.device.activate(self.acked_features);
            }
        }
        self.status = value;
    }

    fn queues_valid(&self) -> bool {
        // A queue the driver left disabled is allowed (it will not be used); an enabled one
        // must fit in guest memory with valid alignment and size.
        self.queues.iter().any(|q| q.ready())
            && self
                .queues
                .iter()
                .all(|q| !q.ready() || q.is_valid(self.memory.as_ref()))
    }

    fn reset(&mut self) {
        if self.activated {
            self.device.reset();
        }
        self.activated = false;
        self.status = 0;
        self.acked_features = 0;
        self.device_features_sel = 0;
        self.driver_features_sel = 0;
        self.queue_sel = 0;
        for q in &mut self.queues {
            q.reset();
        }
        self.interrupt.acknowledge(u32::MAX);
    }
}

/// Borrowed pieces of an activated device, for queue processing.
pub struct ActiveDevice<'a, D> {
    pub device: &'a mut D,
    pub queues: &'a mut [Queue],
    pub memory: &'a GuestMemoryMmap,
    pub interrupt: &'a Interrupt,
}

impl<D: VirtioDevice> BusDevice for VirtioMmio<D> {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if offset >= reg::CONFIG {
            self.device.read_config(offset - reg::CONFIG, data);
            return;
        }
        match data.len() {
            4 => data.copy_from_slice(&self.read_register(offset).to_le_bytes()),
            _ => data.fill(0),
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset >= reg::CONFIG {
            self.device.write_config(offset - reg::CONFIG, data);
            return;
        }
        if let Ok(bytes) = <[u8; 4]>::try_from(data) {
            self.write_register(offset, u32::from_le_bytes(bytes));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::GuestAddress;

    struct Dummy {
        activated: Option<u64>,
        resets: usize,
    }

    impl VirtioDevice for Dummy {
        fn device_type(&self) -> u32 {
            19
        }
        fn queue_max_sizes(&self) -> &[u16] {
            &[16, 16]
        }
        fn features(&self) -> u64 {
            VIRTIO_F_VERSION_1 | 1
        }
        fn read_config(&self, offset: u64, data: &mut [u8]) {
            data.fill(offset as u8);
        }
        fn write_config(&mut self, _: u64, _: &[u8]) {}
        fn activate(&mut self, acked: u64) {
            self.activated = Some(acked);
        }
        fn reset(&mut self) {
            self.resets += 1;
        }
    }

    fn transport() -> VirtioMmio<Dummy> {
        let memory = Arc::new(GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap());
        let interrupt = Interrupt::new(EventFd::new(libc::EFD_NONBLOCK).unwrap());
        VirtioMmio::new(
            Dummy {
                activated: None,
                resets: 0,
            },
            memory,
            interrupt,
        )
        .unwrap()
    }

    fn w(t: &mut VirtioMmio<Dummy>, offset: u64, value: u32) {
        t.write(offset, &value.to_le_bytes());
    }

    fn r(t: &mut VirtioMmio<Dummy>, offset: u64) -> u32 {
        let mut data = [0u8; 4];
        t.read(offset, &mut data);
        u32::from_le_bytes(data)
    }

    fn setup_queue(t: &mut VirtioMmio<Dummy>, index: u32, base: u32) {
        w(t, reg::QUEUE_SEL, index);
        w(t, reg::QUEUE_NUM, 16);
        w(t, reg::QUEUE_DESC_LOW, base);
        w(t, reg::QUEUE_DRIVER_LOW, base + 0x1000);
        w(t, reg::QUEUE_DEVICE_LOW, base + 0x2000);
        w(t, reg::QUEUE_READY, 1);
    }

    fn negotiate(t: &mut VirtioMmio<Dummy>) {
        w(t, reg::STATUS, status::ACKNOWLEDGE);
        w(t, reg::STATUS, status::ACKNOWLEDGE | status::DRIVER);
        w(t, reg::DRIVER_FEATURES_SEL, 1);
        w(t, reg::DRIVER_FEATURES, 1);
        w(t, reg::DRIVER_FEATURES_SEL, 0);
        w(t, reg::DRIVER_FEATURES, 1);
        w(
            t,
            reg::STATUS,
            status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK,
        );
    }

    #[test]
    fn identity_and_features() {
        let mut t = transport();
        assert_eq!(r(&mut t, reg::MAGIC), MAGIC);
        assert_eq!(r(&mut t, reg::VERSION), 2);
        assert_eq!(r(&mut t, reg::DEVICE_ID), 19);
        assert_eq!(r(&mut t, reg::DEVICE_FEATURES), 1);
        w(&mut t, reg::DEVICE_FEATURES_SEL, 1);
        assert_eq!(r(&mut t, reg::DEVICE_FEATURES), 1);
        w(&mut t, reg::DEVICE_FEATURES_SEL, 7);
        assert_eq!(r(&mut t, reg::DEVICE_FEATURES), 0);
        w(&mut t, reg::QUEUE_SEL, 9);
        assert_eq!(r(&mut t, reg::QUEUE_NUM_MAX), 0);
    }

    #[test]
    fn full_bring_up_activates_the_device() {
        let mut t = transport();
        negotiate(&mut t);
        assert_ne!(r(&mut t, reg::STATUS) & status::FEATURES_OK, 0);
        setup_queue(&mut t, 0, 0x10000);
        setup_queue(&mut t, 1, 0x20000);
        w(&mut t, reg::STATUS, 0xf);
        assert!(t.is_activated());
        assert_eq!(t.device().activated, Some(VIRTIO_F_VERSION_1 | 1));
        // Queue settings are frozen while live.
        w(&mut t, reg::QUEUE_SEL, 0);
        w(&mut t, reg::QUEUE_NUM, 2);
        assert_eq!(t.queues[0].size(), 16);
        w(&mut t, reg::STATUS, 0);
        assert!(!t.is_activated());
        assert_eq!(t.device().resets, 1);
        assert_eq!(r(&mut t, reg::STATUS), 0);
    }

    #[test]
    fn features_we_did_not_offer_fail_negotiation() {
        let mut t = transport();
        w(&mut t, reg::STATUS, status::ACKNOWLEDGE | status::DRIVER);
        w(&mut t, reg::DRIVER_FEATURES, 0xffff_ffff);
        w(&mut t, reg::DRIVER_FEATURES_SEL, 1);
        w(&mut t, reg::DRIVER_FEATURES, 1);
        w(
            &mut t,
            reg::STATUS,
            status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK,
        );
        assert_eq!(r(&mut t, reg::STATUS) & status::FEATURES_OK, 0);
    }

    #[test]
    fn legacy_driver_without_version_1_is_refused() {
        let mut t = transport();
        w(&mut t, reg::STATUS, status::ACKNOWLEDGE | status::DRIVER);
        w(&mut t, reg::DRIVER_FEATURES, 1);
        w(
            &mut t,
            reg::STATUS,
            status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK,
        );
        assert_eq!(r(&mut t, reg::STATUS) & status::FEATURES_OK, 0);
    }

    #[test]
    fn going_live_with_bad_queues_needs_reset() {
        let mut t = transport();
        negotiate(&mut t);
        // Rings outside guest RAM.
        setup_queue(&mut t, 0, 0xfff0_0000);
        w(&mut t, reg::STATUS, 0xf);
        assert!(!t.is_activated());
        assert_ne!(r(&mut t, reg::STATUS) & status::DEVICE_NEEDS_RESET, 0);
        // No queue at all.
        let mut t = transport();
        negotiate(&mut t);
        w(&mut t, reg::STATUS, 0xf);
        assert!(!t.is_activated());
    }

    #[test]
    fn notify_signals_the_queue_event_and_odd_accesses_are_harmless() {
        let mut t = transport();
        w(&mut t, reg::QUEUE_NOTIFY, 1);
        assert_eq!(t.queue_events()[1].read().unwrap(), 1);
        w(&mut t, reg::QUEUE_NOTIFY, 1000);
        t.write(reg::STATUS, &[1, 2]);
        let mut one = [0xaau8];
        t.read(reg::MAGIC, &mut one);
        assert_eq!(one[0], 0);
        t.read(u64::MAX - 8, &mut [0u8; 4]);
        t.write(u64::MAX - 8, &[0u8; 4]);
        w(&mut t, 0x0ff, 5);
    }
}
