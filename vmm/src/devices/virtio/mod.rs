//! virtio 1.x devices over the MMIO transport. The transport owns the registers and the
//! queues; a device owns its config space and what it does with the queues.

pub mod block;
pub mod mmio;
pub mod net;
#[cfg(test)]
mod test_driver;
pub mod vsock;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use vmm_sys_util::eventfd::EventFd;

/// Feature bit every modern (virtio 1.x) device offers and we require.
pub const VIRTIO_F_VERSION_1: u64 = 1 << 32;

/// Device status bits (virtio 1.2 §2.1).
pub mod status {
    pub const ACKNOWLEDGE: u32 = 1;
    pub const DRIVER: u32 = 2;
    pub const DRIVER_OK: u32 = 4;
    pub const FEATURES_OK: u32 = 8;
    pub const DEVICE_NEEDS_RESET: u32 = 0x40;
    pub const FAILED: u32 = 0x80;
}

/// InterruptStatus bits.
pub const INT_USED_RING: u32 = 1;
pub const INT_CONFIG_CHANGE: u32 = 2;

/// The device's interrupt line: the status bits the driver reads and acknowledges, and the
/// irqfd that raises the line.
#[derive(Clone)]
pub struct Interrupt {
    status: Arc<AtomicU32>,
    irqfd: Arc<EventFd>,
}

impl Interrupt {
    pub fn new(irqfd: EventFd) -> Self {
        Self {
            status: Arc::new(AtomicU32::new(0)),
            irqfd: Arc::new(irqfd),
        }
    }

    pub fn signal(&self, bits: u32) {
        self.status.fetch_or(bits, Ordering::AcqRel);
        if let Err(e) = self.irqfd.write(1) {
            tracing::warn!(error = %e, "raising a virtio interrupt failed");
        }
    }

    pub fn status(&self) -> u32 {
        self.status.load(Ordering::Acquire)
    }

    pub fn acknowledge(&self, bits: u32) {
        self.status.fetch_and(!bits, Ordering::AcqRel);
    }

    pub fn irqfd(&self) -> &EventFd {
        &self.irqfd
    }
}

/// Fills `data` from a device's config space `config` at `offset`; bytes past its end (or
/// at an offset no config space reaches) read as zero.
pub fn read_config_space(config: &[u8], offset: u64, data: &mut [u8]) {
    for (i, byte) in data.iter_mut().enumerate() {
        *byte = offset
            .checked_add(i as u64)
            .and_then(|at| config.get(usize::try_from(at).ok()?))
            .copied()
            .unwrap_or(0);
    }
}

/// What the transport needs from a device.
pub trait VirtioDevice: Send {
    fn device_type(&self) -> u32;
    /// Maximum size of each queue; the length is the number of queues.
    fn queue_max_sizes(&self) -> &[u16];
    fn features(&self) -> u64;
    fn read_config(&self, offset: u64, data: &mut [u8]);
    fn write_config(&mut self, offset: u64, data: &[u8]);
    /// The driver finished initialisation with these features; queues are valid from now on.
    fn activate(&mut self, acked_features: u64);
    /// The driver reset the device: forget all queue-related state.
    fn reset(&mut self);
}
