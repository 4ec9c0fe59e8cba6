//! Where things live in guest-physical memory. One table, so the boot code, the memory map
//! and the devices cannot disagree.

/// GDT used for the first instructions (both boot protocols).
pub const BOOT_GDT: u64 = 0x500;
/// An empty IDT: the guest installs its own before enabling interrupts.
pub const BOOT_IDT: u64 = 0x520;
/// PVH `hvm_start_info`, then the module list and the memory map right after it.
pub const PVH_START_INFO: u64 = 0x6000;
pub const PVH_MODLIST: u64 = 0x6040;
pub const PVH_MEMMAP: u64 = 0x6100;
/// Room for this many PVH memory-map entries before the zero page.
pub const PVH_MEMMAP_MAX: usize = 32;
/// Linux zero page (`struct boot_params`) for the 64-bit boot protocol.
pub const ZERO_PAGE: u64 = 0x7000;
/// Initial stack of the 64-bit boot protocol.
pub const BOOT_STACK_POINTER: u64 = 0x8ff0;
/// Identity page tables for the 64-bit boot protocol (first 1 GiB, 2 MiB pages).
pub const PML4: u64 = 0x9000;
pub const PDPTE: u64 = 0xa000;
pub const PDE: u64 = 0xb000;
/// Kernel command line, NUL-terminated.
pub const CMDLINE: u64 = 0x20000;
/// Linux's COMMAND_LINE_SIZE on x86, including the NUL.
pub const CMDLINE_MAX: usize = 2048;
/// Start of the extended BIOS data area: RAM below it, the MP table in it.
pub const EBDA_START: u64 = 0x9fc00;
/// Kernels load at or above 1 MiB.
pub const HIMEM_START: u64 = 0x10_0000;
/// The 32-bit MMIO hole: RAM stops here and resumes at 4 GiB.
pub const MMIO_GAP_START: u64 = 0xc000_0000;
pub const MMIO_GAP_END: u64 = 0x1_0000_0000;
/// virtio-mmio devices, one 4 KiB window each.
pub const VIRTIO_MMIO_BASE: u64 = 0xd000_0000;
pub const VIRTIO_MMIO_SIZE: u64 = 0x1000;
pub const IOAPIC_ADDR: u64 = 0xfec0_0000;
pub const LAPIC_ADDR: u64 = 0xfee0_0000;
/// KVM needs three pages for the real-mode TSS (Intel) just below the BIOS area.
pub const KVM_TSS_ADDR: usize = 0xfffb_d000;

/// Legacy IRQ lines (GSIs): COM1 is 4, virtio devices take 5 and up.
pub const SERIAL_IRQ: u32 = 4;
pub const VIRTIO_IRQ_BASE: u32 = 5;
/// Pins on the IOAPIC.
pub const IOAPIC_PINS: u32 = 24;

/// COM1 and the i8042 controller.
pub const SERIAL_PORT_BASE: u16 = 0x3f8;
pub const SERIAL_PORT_LEN: u16 = 8;
pub const I8042_DATA_PORT: u16 = 0x60;
pub const I8042_COMMAND_PORT: u16 = 0x64;

// The boot structures must not overlap one another; checked when compiling.
const _: () = {
    assert!(PVH_MODLIST + 32 <= PVH_MEMMAP);
    assert!(PVH_MEMMAP + (PVH_MEMMAP_MAX as u64) * 24 <= ZERO_PAGE);
    assert!(ZERO_PAGE + 4096 <= BOOT_STACK_POINTER);
    assert!(BOOT_STACK_POINTER < PML4);
    assert!(PDE + 4096 <= CMDLINE);
    assert!(CMDLINE + CMDLINE_MAX as u64 <= EBDA_START);
    assert!(VIRTIO_MMIO_BASE >= MMIO_GAP_START && VIRTIO_MMIO_BASE < IOAPIC_ADDR);
};

/// Guest RAM ranges for `size` bytes: below the MMIO hole first, the rest above 4 GiB.
pub fn ram_ranges(size: u64) -> Vec<(u64, u64)> {
    if size <= MMIO_GAP_START {
        vec![(0, size)]
    } else {
        vec![(0, MMIO_GAP_START), (MMIO_GAP_END, size - MMIO_GAP_START)]
    }
}

/// The guest-physical window of the `index`th virtio-mmio device.
pub fn virtio_mmio_window(index: u32) -> (u64, u64) {
    (
        VIRTIO_MMIO_BASE + u64::from(index) * VIRTIO_MMIO_SIZE,
        VIRTIO_MMIO_SIZE,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ram_splits_around_the_mmio_hole() {
        assert_eq!(ram_ranges(256 << 20), vec![(0, 256 << 20)]);
        assert_eq!(ram_ranges(MMIO_GAP_START), vec![(0, MMIO_GAP_START)]);
        assert_eq!(
            ram_ranges(4 << 30),
            vec![
                (0, MMIO_GAP_START),
                (MMIO_GAP_END, (4 << 30) - MMIO_GAP_START)
            ]
        );
    }
}
