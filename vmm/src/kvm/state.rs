//! Reading a paused VM's KVM state out and putting it back: every vCPU's registers, FPU/XSAVE,
//! XCRs, debug registers, LAPIC, events, MP state and MSRs, and the VM's interrupt
//! controllers, PIT and clock.

use agentvm_snapshot::state::{Raw, VcpuState};
use kvm_bindings::{
    CpuId, KVM_CLOCK_REALTIME, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE,
    KVM_MAX_CPUID_ENTRIES, Msrs, kvm_clock_data, kvm_irqchip, kvm_msr_entry, kvm_pit_state2,
};
use kvm_ioctls::{Cap, Kvm, VcpuFd, VmFd};

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("{what} failed: {source}")]
    Kvm {
        what: &'static str,
        source: kvm_ioctls::Error,
    },
    #[error("KVM accepted {set} of the {wanted} saved MSRs; first refused: {first:#x}")]
    Msrs {
        set: usize,
        wanted: usize,
        first: u32,
    },
    #[error("this host's XSAVE area is {0} bytes; snapshots support at most 4096")]
    XsaveTooLarge(i32),
    #[error("{0}")]
    Invalid(String),
}

fn ioctl(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> StateError {
    move |source| StateError::Kvm { what, source }
}

/// MSRs whose values make up a vCPU's state: KVM's own list, less the ones this host refuses
/// to read back (each probed once).
pub fn saveable_msrs(kvm: &Kvm, vcpu: &VcpuFd) -> Result<Vec<u32>, StateError> {
    let listed = kvm
        .get_msr_index_list()
        .map_err(ioctl("KVM_GET_MSR_INDEX_LIST"))?;
    let mut keep = Vec::new();
    for &index in listed.as_slice() {
        let mut one = msrs(&[index])?;
        if vcpu.get_msrs(&mut one).is_ok_and(|n| n == 1) {
            keep.push(index);
        }
    }
    Ok(keep)
}

fn msrs(indices: &[u32]) -> Result<Msrs, StateError> {
    let entries: Vec<kvm_msr_entry> = indices
        .iter()
        .map(|&index| kvm_msr_entry {
            index,
            ..Default::default()
        })
        .collect();
    Msrs::from_entries(&entries).map_err(|e| StateError::Invalid(format!("MSR list: {e:?}")))
}

const MSR_IA32_TSC: u32 = 0x10;
const MSR_IA32_TSC_DEADLINE: u32 = 0x6e0;

/// Checks the host can hold the fixed 4 KiB XSAVE form the snapshot uses.
pub fn check_xsave_size(kvm: &Kvm) -> Result<(), StateError> {
    let size = kvm.check_extension_int(Cap::Xsave2);
    if size > 4096 {
        return Err(StateError::XsaveTooLarge(size));
    }
    Ok(())
}

pub fn save_vcpu(vcpu: &VcpuFd, id: u8, msr_indices: &[u32]) -> Result<VcpuState, StateError> {
    let cpuid = vcpu
        .get_cpuid2(KVM_MAX_CPUID_ENTRIES)
        .map_err(ioctl("KVM_GET_CPUID2"))?;
    let mut msr_buf = msrs(msr_indices)?;
    let read = vcpu.get_msrs(&mut msr_buf).map_err(ioctl("KVM_GET_MSRS"))?;
    if read != msr_indices.len() {
        return Err(StateError::Msrs {
            set: read,
            wanted: msr_indices.len(),
            first: msr_indices.get(read).copied().unwrap_or_default(),
        });
    }
    let mut msrs: Vec<(u32, u64)> = msr_buf
        .as_slice()
        .iter()
        .map(|e| (e.index, e.data))
        .collect();
    // A zero TSC deadline would never fire again after restore; arm it at "now" so the
    // guest's pending timer interrupt is not lost (Firecracker does the same).
    let tsc = msrs.iter().find(|m| m.0 == MSR_IA32_TSC).map(|m| m.1);
    if let (Some(tsc), Some(deadline)) =
        (tsc, msrs.iter_mut().find(|m| m.0 == MSR_IA32_TSC_DEADLINE))
        && deadline.1 == 0
    {
        deadline.1 = tsc;
    }
    Ok(VcpuState {
        id,
        cpuid: cpuid.as_slice().iter().map(|e| Raw(*e)).collect(),
        mp_state: Raw(vcpu.get_mp_state().map_err(ioctl("KVM_GET_MP_STATE"))?),
        regs: Raw(vcpu.get_regs().map_err(ioctl("KVM_GET_REGS"))?),
        sregs: Raw(vcpu.get_sregs().map_err(ioctl("KVM_GET_SREGS"))?),
        xsave: Raw(vcpu.get_xsave().map_err(ioctl("KVM_GET_XSAVE"))?),
        xcrs: Raw(vcpu.get_xcrs().map_err(ioctl("KVM_GET_XCRS"))?),
        debugregs: Raw(vcpu.get_debug_regs().map_err(ioctl("KVM_GET_DEBUGREGS"))?),
        lapic: Raw(vcpu.get_lapic().map_err(ioctl("KVM_GET_LAPIC"))?),
        vcpu_events: Raw(vcpu
            .get_vcpu_events()
            .map_err(ioctl("KVM_GET_VCPU_EVENTS"))?),
        msrs,
        tsc_khz: vcpu.get_tsc_khz().ok(),
    })
}

/// Puts a saved vCPU back, in the order KVM needs: CPUID first (it decides which MSRs and
/// XSAVE features exist), events last.
pub fn restore_vcpu(vcpu: &VcpuFd, state: &VcpuState) -> Result<(), StateError> {
    if let (Some(saved), Ok(here)) = (state.tsc_khz, vcpu.get_tsc_khz())
        && saved != here
    {
        // Without TSC scaling (not on this host) the guest would see time run at another
        // rate; KVM_SET_TSC_KHZ is attempted where supported.
        vcpu.set_tsc_khz(saved).map_err(|_| {
            StateError::Invalid(format!(
                "the snapshot's TSC runs at {saved} kHz, this host's at {here} kHz"
            ))
        })?;
    }
    let entries: Vec<_> = state.cpuid.iter().map(|e| e.0).collect();
    let cpuid = CpuId::from_entries(&entries)
        .map_err(|e| StateError::Invalid(format!("saved CPUID: {e:?}")))?;
    vcpu.set_cpuid2(&cpuid).map_err(ioctl("KVM_SET_CPUID2"))?;
    vcpu.set_mp_state(state.mp_state.0)
        .map_err(ioctl("KVM_SET_MP_STATE"))?;
    vcpu.set_regs(&state.regs.0)
        .map_err(ioctl("KVM_SET_REGS"))?;
    vcpu.set_sregs(&state.sregs.0)
        .map_err(ioctl("KVM_SET_SREGS"))?;
    // SAFETY: `kvm_xsave` is the fixed 4 KiB form KVM_GET_XSAVE produced on this host flavour
    // (the manifest's host check ran) and `check_xsave_size` confirmed it covers the whole area.
    unsafe { vcpu.set_xsave(&state.xsave.0) }.map_err(ioctl("KVM_SET_XSAVE"))?;
    // A host without XSAVE reports no XCRs and refuses KVM_SET_XCRS outright (EINVAL), so
    // a snapshot taken there carries none and restores without the call.
    if state.xcrs.0.nr_xcrs > 0 {
        vcpu.set_xcrs(&state.xcrs.0)
            .map_err(ioctl("KVM_SET_XCRS"))?;
    }
    vcpu.set_debug_regs(&state.debugregs.0)
        .map_err(ioctl("KVM_SET_DEBUGREGS"))?;
    vcpu.set_lapic(&state.lapic.0)
        .map_err(ioctl("KVM_SET_LAPIC"))?;
    let entries: Vec<kvm_msr_entry> = state
        .msrs
        .iter()
        .map(|&(index, data)| kvm_msr_entry {
            index,
            data,
            ..Default::default()
        })
        .collect();
    let msrs = Msrs::from_entries(&entries)
        .map_err(|e| StateError::Invalid(format!("saved MSRs: {e:?}")))?;
    let set = vcpu.set_msrs(&msrs).map_err(ioctl("KVM_SET_MSRS"))?;
    if set != entries.len() {
        return Err(StateError::Msrs {
            set,
            wanted: entries.len(),
            first: entries.get(set).map(|e| e.index).unwrap_or_default(),
        });
    }
    vcpu.set_vcpu_events(&state.vcpu_events.0)
        .map_err(ioctl("KVM_SET_VCPU_EVENTS"))
}

/// The VM-wide device state KVM keeps.
pub struct VmKvmState {
    pub pic_master: kvm_irqchip,
    pub pic_slave: kvm_irqchip,
    pub ioapic: kvm_irqchip,
    pub pit: kvm_pit_state2,
    pub clock: kvm_clock_data,
}

fn get_chip(vm: &VmFd, chip_id: u32) -> Result<kvm_irqchip, StateError> {
    let mut chip = kvm_irqchip {
        chip_id,
        ..Default::default()
    };
    vm.get_irqchip(&mut chip)
        .map_err(ioctl("KVM_GET_IRQCHIP"))?;
    Ok(chip)
}

pub fn save_vm(vm: &VmFd) -> Result<VmKvmState, StateError> {
    Ok(VmKvmState {
        pic_master: get_chip(vm, KVM_IRQCHIP_PIC_MASTER)?,
        pic_slave: get_chip(vm, KVM_IRQCHIP_PIC_SLAVE)?,
        ioapic: get_chip(vm, KVM_IRQCHIP_IOAPIC)?,
        pit: vm.get_pit2().map_err(ioctl("KVM_GET_PIT2"))?,
        clock: vm.get_clock().map_err(ioctl("KVM_GET_CLOCK"))?,
    })
}

/// Restores the interrupt controllers and the PIT; the clock is set separately, last.
pub fn restore_chips(vm: &VmFd, state: &VmKvmState) -> Result<(), StateError> {
    for (chip, expected) in [
        (&state.pic_master, KVM_IRQCHIP_PIC_MASTER),
        (&state.pic_slave, KVM_IRQCHIP_PIC_SLAVE),
        (&state.ioapic, KVM_IRQCHIP_IOAPIC),
    ] {
        if chip.chip_id != expected {
            return Err(StateError::Invalid(format!(
                "interrupt controller {} saved where {expected} belongs",
                chip.chip_id
            )));
        }
        vm.set_irqchip(chip).map_err(ioctl("KVM_SET_IRQCHIP"))?;
    }
    vm.set_pit2(&state.pit).map_err(ioctl("KVM_SET_PIT2"))
}

/// Sets kvmclock. When the snapshot recorded the host's real time with it, KVM moves the
/// guest clock forward by the time the VM spent on disk (as Cloud Hypervisor v53 does), so
/// a kvm-clock guest does not come back in the past.
pub fn restore_clock(vm: &VmFd, saved: &kvm_clock_data) -> Result<(), StateError> {
    let mut clock = kvm_clock_data {
        clock: saved.clock,
        ..Default::default()
    };
    if saved.flags & KVM_CLOCK_REALTIME != 0 {
        clock.flags = KVM_CLOCK_REALTIME;
        clock.realtime = saved.realtime;
    }
    match vm.set_clock(&clock) {
        Ok(()) => Ok(()),
        // Older hosts refuse the realtime form: keep the guest's own notion of time.
        Err(_) if clock.flags != 0 => {
            clock.flags = 0;
            vm.set_clock(&clock).map_err(ioctl("KVM_SET_CLOCK"))
        }
        Err(e) => Err(ioctl("KVM_SET_CLOCK")(e)),
    }
}
