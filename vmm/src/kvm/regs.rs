//! The architectural state of a vCPU at its first instruction: segments, control registers,
//! page tables (64-bit entry), general registers, FPU, boot MSRs and the local APIC's LINT pins.

use kvm_bindings::{Msrs, kvm_fpu, kvm_msr_entry, kvm_regs, kvm_segment, kvm_sregs};
use kvm_ioctls::VcpuFd;
use vm_memory::{Bytes, GuestAddress};

use crate::kvm::memory::GuestMemoryMmap;

use crate::boot::layout;
use crate::boot::loader::EntryPoint;

#[derive(Debug, thiserror::Error)]
pub enum RegsError {
    #[error("{what} failed: {source}")]
    Kvm {
        what: &'static str,
        source: kvm_ioctls::Error,
    },
    #[error("KVM accepted {set} of {wanted} boot MSRs")]
    Msrs { set: usize, wanted: usize },
    #[error("writing {what} into guest RAM: {reason}")]
    Memory { what: &'static str, reason: String },
}

fn kvm(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> RegsError {
    move |source| RegsError::Kvm { what, source }
}

const X86_CR0_PE: u64 = 1 << 0;
const X86_CR0_ET: u64 = 1 << 4;
const X86_CR0_PG: u64 = 1 << 31;
const X86_CR4_PAE: u64 = 1 << 5;
const EFER_LME: u64 = 1 << 8;
const EFER_LMA: u64 = 1 << 10;
/// Bit 1 of RFLAGS is reserved and always set.
const RFLAGS_RESERVED: u64 = 1 << 1;

/// Access bytes of the boot GDT's descriptors (flags nibble, then P/DPL/S/type).
const GDT_CODE32: u16 = 0xc09b;
const GDT_CODE64: u16 = 0xa09b;
const GDT_DATA: u16 = 0xc093;
const GDT_TSS32: u16 = 0x008b;
const GDT_TSS64: u16 = 0x808b;

/// A GDT descriptor from its flags, base and (20-bit) limit.
pub fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    let base = u64::from(base);
    let limit = u64::from(limit);
    let flags = u64::from(flags);
    ((base & 0xff00_0000) << 32)
        | ((flags & 0xf0ff) << 40)
        | ((limit & 0x000f_0000) << 32)
        | ((base & 0x00ff_ffff) << 16)
        | (limit & 0xffff)
}

/// The KVM segment register a selector of `entry` at GDT slot `index` would load.
pub fn segment(entry: u64, index: u16) -> kvm_segment {
    let base = ((entry >> 16) & 0x00ff_ffff) | ((entry >> 32) & 0xff00_0000);
    let raw_limit = ((entry >> 32) & 0x000f_0000) | (entry & 0xffff);
    let granular = (entry >> 55) & 1 == 1;
    let present = ((entry >> 47) & 1) as u8;
    kvm_segment {
        base,
        limit: if granular {
            ((raw_limit << 12) | 0xfff) as u32
        } else {
            raw_limit as u32
        },
        selector: index * 8,
        type_: ((entry >> 40) & 0xf) as u8,
        present,
        dpl: ((entry >> 45) & 0x3) as u8,
        db: ((entry >> 54) & 1) as u8,
        s: ((entry >> 44) & 1) as u8,
        l: ((entry >> 53) & 1) as u8,
        g: granular as u8,
        avl: ((entry >> 52) & 1) as u8,
        unusable: u8::from(present == 0),
        padding: 0,
    }
}

/// Sets segments and control registers for `entry`, writing the GDT (and for 64-bit entry
/// the identity page tables) into guest RAM.
pub fn setup_sregs(
    memory: &GuestMemoryMmap,
    vcpu: &VcpuFd,
    entry: EntryPoint,
) -> Result<(), RegsError> {
    let mut sregs = vcpu.get_sregs().map_err(kvm("KVM_GET_SREGS"))?;
    let long_mode = matches!(entry, EntryPoint::Linux64 { .. });
    let gdt = if long_mode {
        [
            0,
            gdt_entry(GDT_CODE64, 0, 0xfffff),
            gdt_entry(GDT_DATA, 0, 0xfffff),
            gdt_entry(GDT_TSS64, 0, 0xfffff),
        ]
    } else {
        [
            0,
            gdt_entry(GDT_CODE32, 0, 0xfffff),
            gdt_entry(GDT_DATA, 0, 0xfffff),
            gdt_entry(GDT_TSS32, 0, 0x67),
        ]
    };
    write_gdt_and_idt(memory, &gdt)?;
    load_segments(&mut sregs, &gdt);
    if long_mode {
        write_page_tables(memory)?;
        sregs.cr3 = layout::PML4;
        sregs.cr4 |= X86_CR4_PAE;
        sregs.cr0 |= X86_CR0_PE | X86_CR0_PG | X86_CR0_ET;
        sregs.efer |= EFER_LME | EFER_LMA;
    } else {
        sregs.cr0 = X86_CR0_PE | X86_CR0_ET;
        sregs.cr4 = 0;
        sregs.efer = 0;
    }
    vcpu.set_sregs(&sregs).map_err(kvm("KVM_SET_SREGS"))
}

fn write_gdt_and_idt(memory: &GuestMemoryMmap, gdt: &[u64; 4]) -> Result<(), RegsError> {
    for (i, entry) in gdt.iter().enumerate() {
        memory
            .write_obj(*entry, GuestAddress(layout::BOOT_GDT + (i * 8) as u64))
            .map_err(|e| RegsError::Memory {
                what: "the boot GDT",
                reason: e.to_string(),
            })?;
    }
    memory
        .write_obj(0u64, GuestAddress(layout::BOOT_IDT))
        .map_err(|e| RegsError::Memory {
            what: "the boot IDT",
            reason: e.to_string(),
        })
}

fn load_segments(sregs: &mut kvm_sregs, gdt: &[u64; 4]) {
    let code = segment(gdt[1], 1);
    let data = segment(gdt[2], 2);
    let tss = segment(gdt[3], 3);
    sregs.gdt.base = layout::BOOT_GDT;
    sregs.gdt.limit = (std::mem::size_of_val(gdt) - 1) as u16;
    sregs.idt.base = layout::BOOT_IDT;
    sregs.idt.limit = 7;
    sregs.cs = code;
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = tss;
}

/// Identity-maps the first 1 GiB with 2 MiB pages: enough for the kernel to set up its own.
fn write_page_tables(memory: &GuestMemoryMmap) -> Result<(), RegsError> {
    let err = |e: vm_memory::GuestMemoryError| RegsError::Memory {
        what: "the boot page tables",
        reason: e.to_string(),
    };
    memory
        .write_obj(layout::PDPTE | 0x03, GuestAddress(layout::PML4))
        .map_err(err)?;
    memory
        .write_obj(layout::PDE | 0x03, GuestAddress(layout::PDPTE))
        .map_err(err)?;
    for i in 0..512u64 {
        memory
            .write_obj((i << 21) | 0x83, GuestAddress(layout::PDE + i * 8))
            .map_err(err)?;
    }
    Ok(())
}

/// General registers at the entry point.
pub fn setup_regs(vcpu: &VcpuFd, entry: EntryPoint) -> Result<(), RegsError> {
    let regs = match entry {
        EntryPoint::Pvh { entry } => kvm_regs {
            rflags: RFLAGS_RESERVED,
            rip: entry,
            rbx: layout::PVH_START_INFO,
            ..Default::default()
        },
        EntryPoint::Linux64 { entry, .. } => kvm_regs {
            rflags: RFLAGS_RESERVED,
            rip: entry,
            rsp: layout::BOOT_STACK_POINTER,
            rbp: layout::BOOT_STACK_POINTER,
            rsi: layout::ZERO_PAGE,
            ..Default::default()
        },
    };
    vcpu.set_regs(&regs).map_err(kvm("KVM_SET_REGS"))
}

/// The x87 and SSE control words at their reset values.
pub fn setup_fpu(vcpu: &VcpuFd) -> Result<(), RegsError> {
    let fpu = kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    };
    vcpu.set_fpu(&fpu).map_err(kvm("KVM_SET_FPU"))
}

/// MSRs a kernel expects to find initialised: syscall entry points cleared, TSC at zero,
/// fast strings on, MTRRs enabled with write-back as the default type.
pub fn setup_msrs(vcpu: &VcpuFd) -> Result<(), RegsError> {
    const MSR_IA32_TSC: u32 = 0x10;
    const MSR_IA32_SYSENTER_CS: u32 = 0x174;
    const MSR_IA32_SYSENTER_ESP: u32 = 0x175;
    const MSR_IA32_SYSENTER_EIP: u32 = 0x176;
    const MSR_IA32_MISC_ENABLE: u32 = 0x1a0;
    const MSR_MTRR_DEF_TYPE: u32 = 0x2ff;
    const MSR_STAR: u32 = 0xc000_0081;
    const MSR_LSTAR: u32 = 0xc000_0082;
    const MSR_CSTAR: u32 = 0xc000_0083;
    const MSR_SYSCALL_MASK: u32 = 0xc000_0084;
    const MSR_KERNEL_GS_BASE: u32 = 0xc000_0102;
    const MISC_ENABLE_FAST_STRING: u64 = 1;
    const MTRR_ENABLE: u64 = 1 << 11;
    const MTRR_TYPE_WRBACK: u64 = 6;

    let entries = [
        (MSR_IA32_SYSENTER_CS, 0),
        (MSR_IA32_SYSENTER_ESP, 0),
        (MSR_IA32_SYSENTER_EIP, 0),
        (MSR_STAR, 0),
        (MSR_CSTAR, 0),
        (MSR_KERNEL_GS_BASE, 0),
        (MSR_SYSCALL_MASK, 0),
        (MSR_LSTAR, 0),
        (MSR_IA32_TSC, 0),
        (MSR_IA32_MISC_ENABLE, MISC_ENABLE_FAST_STRING),
        (MSR_MTRR_DEF_TYPE, MTRR_ENABLE | MTRR_TYPE_WRBACK),
    ]
    .map(|(index, data)| kvm_msr_entry {
        index,
        data,
        ..Default::default()
    });
    let msrs = Msrs::from_entries(&entries).map_err(|_| RegsError::Msrs {
        set: 0,
        wanted: entries.len(),
    })?;
    let set = vcpu.set_msrs(&msrs).map_err(kvm("KVM_SET_MSRS"))?;
    if set != entries.len() {
        return Err(RegsError::Msrs {
            set,
            wanted: entries.len(),
        });
    }
    Ok(())
}

/// LINT0 delivers the PIC's interrupts (ExtINT), LINT1 NMIs, as on a PC.
pub fn setup_lapic(vcpu: &VcpuFd) -> Result<(), RegsError> {
    const APIC_LVT0: usize = 0x350;
    const APIC_LVT1: usize = 0x360;
    const DELIVERY_MODE_NMI: u32 = 4;
    const DELIVERY_MODE_EXTINT: u32 = 7;

    let mut lapic = vcpu.get_lapic().map_err(kvm("KVM_GET_LAPIC"))?;
    for (offset, mode) in [
        (APIC_LVT0, DELIVERY_MODE_EXTINT),
        (APIC_LVT1, DELIVERY_MODE_NMI),
    ] {
        let bytes: [u8; 4] = std::array::from_fn(|i| lapic.regs[offset + i] as u8);
        let value = (u32::from_le_bytes(bytes) & !0x700) | (mode << 8);
        for (i, byte) in value.to_le_bytes().iter().enumerate() {
            lapic.regs[offset + i] = *byte as _;
        }
    }
    vcpu.set_lapic(&lapic).map_err(kvm("KVM_SET_LAPIC"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gdt_entries_round_trip_into_segments() {
        let code = segment(gdt_entry(GDT_CODE64, 0, 0xfffff), 1);
        assert_eq!((code.selector, code.l, code.db, code.g), (8, 1, 0, 1));
        assert_eq!(
            (code.limit, code.type_, code.present, code.s),
            (0xffff_ffff, 0xb, 1, 1)
        );
        let code32 = segment(gdt_entry(GDT_CODE32, 0, 0xfffff), 1);
        assert_eq!((code32.l, code32.db), (0, 1));
        let tss = segment(gdt_entry(GDT_TSS32, 0, 0x67), 3);
        assert_eq!(
            (tss.selector, tss.limit, tss.g, tss.s, tss.type_),
            (24, 0x67, 0, 0, 0xb)
        );
        let based = segment(gdt_entry(GDT_DATA, 0x1234_5678, 0x10), 2);
        assert_eq!(based.base, 0x1234_5678);
        let null = segment(0, 0);
        assert_eq!(null.unusable, 1);
    }

    #[test]
    fn page_tables_identity_map_the_first_gigabyte() {
        let memory = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        write_page_tables(&memory).unwrap();
        let pml4: u64 = memory.read_obj(GuestAddress(layout::PML4)).unwrap();
        assert_eq!(pml4, layout::PDPTE | 3);
        let last: u64 = memory
            .read_obj(GuestAddress(layout::PDE + 511 * 8))
            .unwrap();
        assert_eq!(last, (511 << 21) | 0x83);
    }
}
