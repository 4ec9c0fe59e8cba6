//! The freestanding test guest ELF, embedded, and the constants a host needs to drive it.
//!
//! The guest is C (`c/`), compiled by `build.rs` with the system's gcc/ld into 32-bit code
//! (general registers only) linked at [`LOAD_ADDR`], with a PVH entry announced by the ELF
//! note `XEN_ELFNOTE_PHYS32_ENTRY`. The file is an ELF64 container (like vmlinux): that is
//! what linux-loader's ELF loader accepts.
//!
//! # What it does
//! - prints the [`markers`] on COM1, one per line;
//! - with a virtio-mmio vsock device on the command line, listens on vsock port
//!   [`VSOCK_PORT`] and speaks the `agentvm.guest.v1` frame protocol on every connection:
//!   Hello→Ready, HealthCheck→HealthReport, Restored→RestoredAck, DescribeHarness→
//!   HarnessDescriptor, the counter harness (HarnessFrame start→OUTPUT/END/close), DirtyMemory→
//!   DirtyMemoryDone, Shutdown (i8042 reset); anything else gets GuestError 12;
//! - with [`CONNECT_OPTION`]`<port>`, also connects to the host's `<port>` and sends an
//!   unsolicited Ready (id 0) once the host has answered;
//! - with [`IRQTEST_OPTION`], takes a few PIT interrupts (IRQ 0) through the PIC and prints
//!   [`markers::IRQTEST_OK`], which proves interrupt delivery without any virtio device.
//!
//! Its state (the counter, the last Restored notice, the dirty-memory stamps) lives in guest
//! RAM, so snapshots, restores and forks carry it.
//!
//! # What the VMM must provide
//! - PVH entry: 32-bit protected mode, paging off, EBX = `hvm_start_info` (version 1, with
//!   the command line and an E820-style memory map). The guest loads its own GDT, IDT, stack.
//! - A command line with `virtio_mmio.device=<size>@<base>:<irq>` (Linux syntax; base below
//!   4 GiB, irq 1 or 3..=15) for a virtio-mmio **version 2** vsock device (id 19) offering
//!   `VIRTIO_F_VERSION_1`. The guest posts each rx buffer as one device-writable 4 KiB
//!   descriptor (header and payload together) and sends each packet as one descriptor
//!   holding header and payload; event buffers are 4 bytes. Queue sizes are the largest power
//!   of two up to 64 (8 for the event queue) that QueueNumMax allows.
//! - The device's interrupt on that line of the 8259 PIC pair (edge is enough), with the
//!   LAPIC passing PIC interrupts through (LINT0 ExtINT; the guest programs this too).
//! - COM1 at 0x3f8; i8042 at 0x64 for the reset; an MP table if it should count CPUs.
//! - For `HealthReport.uptime_ms`: the TSC and PIT channel 2 gated through port 0x61 (KVM's
//!   in-kernel PIT provides both); without them uptime is reported as 0.
//! - For DirtyMemory: RAM beyond [`DIRTY_REGION_BASE`] in the memory map.

#![forbid(unsafe_code)]

/// The test guest ELF image.
pub static TESTGUEST_ELF: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/testguest.elf"));

/// Physical address the image is linked (and must be loaded) at.
pub const LOAD_ADDR: u64 = 0x10_0000;

/// The guest's code, data, buffers and stack all end below this address.
pub const IMAGE_LIMIT: u64 = 0xc0_0000;

/// Start of the dirty region `DirtyMemory` stamps. It extends to the end of the memory-map
/// RAM entry that contains it, so the VM needs more RAM than this for DirtyMemory to work.
pub const DIRTY_REGION_BASE: u64 = 0x100_0000;

const _: () = assert!(IMAGE_LIMIT < DIRTY_REGION_BASE);

/// `DirtyMemory` stamps the first 32-bit word of each page of this size with `stamp ^ page`.
pub const DIRTY_PAGE_SIZE: u64 = 4096;

/// The vsock port the guest listens on (the same as the real guest agent's).
pub const VSOCK_PORT: u32 = 1024;

/// Local ports of connections the guest opens start here.
pub const EPHEMERAL_PORT_BASE: u32 = 49152;

/// Connections served at once; one more is refused with RST.
pub const MAX_CONNECTIONS: usize = 16;

/// Receive credit (`buf_alloc`) the guest advertises on each connection.
pub const VSOCK_BUF_ALLOC: u32 = 64 * 1024;

/// Largest frame (Envelope bytes, without the length prefix) the guest accepts; a larger one
/// gets `GuestError{code 8}` and the connection is reset.
pub const MAX_FRAME: usize = 256 * 1024;

/// Replies the guest can hold per connection while the host gives it no credit; beyond this
/// the connection is reset.
pub const MAX_QUEUED_REPLIES: usize = 32 * 1024;

/// Command-line option: `testguest.connect=<port>` opens a connection to CID 2 `<port>`.
pub const CONNECT_OPTION: &str = "testguest.connect=";

/// Command-line option: take a few PIT interrupts and print [`markers::IRQTEST_OK`].
pub const IRQTEST_OPTION: &str = "testguest.irqtest";

/// `Ready.agent_version` and `HarnessDescriptor.id` as the guest reports them.
pub const AGENT_VERSION: &str = "testguest-1";
pub const HARNESS_ID: &str = "testguest";

/// Serial console lines, each printed on a line of its own. Prefixes are followed by a value.
pub mod markers {
    /// First line, printed as soon as there is a stack.
    pub const BOOT: &str = "TESTGUEST BOOT";
    /// Prefix of `TESTGUEST CPUS <n>`: processors in the MP table (1 without one).
    pub const CPUS: &str = "TESTGUEST CPUS ";
    /// Prefix of `TESTGUEST VSOCK cid=<cid>`, printed once the vsock device is live.
    pub const VSOCK: &str = "TESTGUEST VSOCK cid=";
    /// Prefix of `TESTGUEST VSOCK RESET cid=<cid>`, after a TRANSPORT_RESET event.
    pub const VSOCK_RESET: &str = "TESTGUEST VSOCK RESET cid=";
    /// Prefix of `TESTGUEST NOVSOCK <reason>`: no usable vsock device.
    pub const NOVSOCK: &str = "TESTGUEST NOVSOCK ";
    /// Printed once the guest is listening (also without vsock).
    pub const READY: &str = "TESTGUEST READY";
    /// Prefix of `TESTGUEST RESTORED <generation>`, on each applied Restored notice.
    pub const RESTORED: &str = "TESTGUEST RESTORED ";
    /// Printed on Shutdown, just before the i8042 reset (port 0x64 ← 0xfe).
    pub const SHUTDOWN: &str = "TESTGUEST SHUTDOWN";
    /// Prefix of `TESTGUEST IRQTEST OK uptime_ms=<n>` (with [`super::IRQTEST_OPTION`]).
    pub const IRQTEST_OK: &str = "TESTGUEST IRQTEST OK";
    /// Prefix of `TESTGUEST ERROR <what>`.
    pub const ERROR: &str = "TESTGUEST ERROR ";
}

/// Minimal kernel images built in memory, for tests of the boot paths and of guests that
/// misbehave: x86-64 code wrapped as an ELF64 without a PVH note, or as a bzImage.
pub mod synthetic {
    /// `hlt` in a loop: a guest that boots and never says anything.
    pub const HALT64: &[u8] = &[0xf4, 0xeb, 0xfd];

    fn put16(buf: &mut [u8], at: usize, v: u16) {
        buf[at..at + 2].copy_from_slice(&v.to_le_bytes());
    }
    fn put32(buf: &mut [u8], at: usize, v: u32) {
        buf[at..at + 4].copy_from_slice(&v.to_le_bytes());
    }
    fn put64(buf: &mut [u8], at: usize, v: u64) {
        buf[at..at + 8].copy_from_slice(&v.to_le_bytes());
    }

    /// A minimal ELF64 executable: one PT_LOAD at 2 MiB, no notes.
    pub fn elf64(code: &[u8]) -> Vec<u8> {
        const LOAD: u64 = 0x20_0000;
        const CODE_OFFSET: usize = 0x1000;
        let mut image = vec![0u8; CODE_OFFSET + code.len()];
        image[..4].copy_from_slice(b"\x7fELF");
        image[4] = 2; // ELFCLASS64
        image[5] = 1; // little endian
        image[6] = 1; // version
        put16(&mut image, 16, 2); // ET_EXEC
        put16(&mut image, 18, 62); // EM_X86_64
        put32(&mut image, 20, 1);
        put64(&mut image, 24, LOAD); // e_entry
        put64(&mut image, 32, 64); // e_phoff
        put16(&mut image, 52, 64); // e_ehsize
        put16(&mut image, 54, 56); // e_phentsize
        put16(&mut image, 56, 1); // e_phnum
        let ph = 64;
        put32(&mut image, ph, 1); // PT_LOAD
        put32(&mut image, ph + 4, 5); // R+X
        put64(&mut image, ph + 8, CODE_OFFSET as u64);
        put64(&mut image, ph + 16, LOAD);
        put64(&mut image, ph + 24, LOAD);
        put64(&mut image, ph + 32, code.len() as u64);
        put64(&mut image, ph + 40, code.len() as u64);
        put64(&mut image, ph + 48, 0x1000);
        image[CODE_OFFSET..].copy_from_slice(code);
        image
    }

    /// A minimal bzImage: one setup sector after the boot sector, then the protected-mode kernel
    /// whose 64-bit entry is 0x200 bytes in.
    pub fn bzimage(code: &[u8]) -> Vec<u8> {
        let setup = 2 * 512;
        let mut image = vec![0u8; setup + 0x200 + code.len()];
        image[0x1f1] = 1; // setup_sects
        put16(&mut image, 0x1fe, 0xaa55);
        image[0x202..0x206].copy_from_slice(b"HdrS");
        put16(&mut image, 0x206, 0x020f); // boot protocol 2.15
        image[0x211] = 1; // LOADED_HIGH
        put32(&mut image, 0x214, 0x10_0000); // code32_start
        image[setup + 0x200..].copy_from_slice(code);
        image
    }
}
