//! The KVM VM: in-kernel interrupt controllers and timer, and guest RAM registered as slots.

use kvm_bindings::{KVM_PIT_SPEAKER_DUMMY, kvm_pit_config, kvm_userspace_memory_region};
use kvm_ioctls::{Kvm, VmFd};
use vm_memory::{Address, GuestMemoryBackend, GuestMemoryRegion};

use super::memory::GuestRam;
use crate::boot::layout;

#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error("opening /dev/kvm: {0}")]
    OpenKvm(kvm_ioctls::Error),
    #[error("{what} failed: {source}")]
    Kvm {
        what: &'static str,
        source: kvm_ioctls::Error,
    },
}

fn ioctl(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VmError {
    move |source| VmError::Kvm { what, source }
}

pub struct KvmVm {
    pub kvm: Kvm,
    pub fd: VmFd,
}

impl KvmVm {
    /// A VM with the PIC/IOAPIC/LAPIC and PIT emulated in the kernel and `ram` mapped.
    pub fn new(ram: &GuestRam) -> Result<Self, VmError> {
        let kvm = Kvm::new().map_err(VmError::OpenKvm)?;
        let fd = kvm.create_vm().map_err(ioctl("KVM_CREATE_VM"))?;
        fd.set_tss_address(layout::KVM_TSS_ADDR)
            .map_err(ioctl("KVM_SET_TSS_ADDR"))?;
        fd.create_irq_chip().map_err(ioctl("KVM_CREATE_IRQCHIP"))?;
        // The speaker port (0x61) is emulated too, so guests calibrating against PIT
        // channel 2 never exit to us for it.
        fd.create_pit2(kvm_pit_config {
            flags: KVM_PIT_SPEAKER_DUMMY,
            ..Default::default()
        })
        .map_err(ioctl("KVM_CREATE_PIT2"))?;
        for (slot, region) in ram.memory().iter().enumerate() {
            let region = kvm_userspace_memory_region {
                slot: slot as u32,
                guest_phys_addr: region.start_addr().raw_value(),
                memory_size: region.len(),
                userspace_addr: region.as_ptr() as u64,
                flags: 0,
            };
            // SAFETY: the host range is a live mapping owned by `ram`, which the caller keeps
            // alive for as long as this VM exists (the VM struct holds both and drops the VM
            // fd first).
            unsafe { fd.set_user_memory_region(region) }
                .map_err(ioctl("KVM_SET_USER_MEMORY_REGION"))?;
        }
        Ok(Self { kvm, fd })
    }
}
