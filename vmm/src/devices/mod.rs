//! Guest-visible devices: the legacy ones on the port bus and virtio over MMIO.

pub mod bus;
pub mod i8042;
pub mod serial;
pub mod virtio;
