//! Everything the guest finds in RAM before its first instruction: kernel, initramfs,
//! command line, boot parameters and the MP table.

pub mod layout;
pub mod loader;
pub mod mptable;
pub mod params;
