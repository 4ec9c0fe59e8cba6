//! The KVM VM: in-kernel interrupt controllers and timer, and guest RAM registered as slots.
//!
//! Creating a VM is split in two. [`KvmVm::new`] does what does not depend on the VM's
//! configuration and can run before `vm.create` arrives: the VM itself and the CPUID KVM
//! supports. [`KvmVm::map_ram`] then registers the RAM and only after it creates the interrupt
//! controllers and the PIT. The order is what makes boots fast: creating the in-kernel irqchip
//! starts a grace period in KVM that the next memory-slot change must wait out (measured on
//! our hosts: 7–11 ms for the first slot change after `KVM_CREATE_IRQCHIP`, ~0.1 ms for one
//! before it or once the grace period has passed), and nothing changes a slot after the
//! irqchip exists.

use kvm_bindings::{
    CpuId, KVM_MAX_CPUID_ENTRIES, KVM_MEM_LOG_DIRTY_PAGES, KVM_PIT_SPEAKER_DUMMY, kvm_pit_config,
    kvm_userspace_memory_region,
};
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
    #[error("guest RAM is already mapped into this VM")]
    AlreadyMapped,
}

fn ioctl(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VmError {
    move |source| VmError::Kvm { what, source }
}

pub struct KvmVm {
    pub kvm: Kvm,
    pub fd: VmFd,
    supported_cpuid: CpuId,
    ram_mapped: bool,
    logging_dirty: bool,
}

impl KvmVm {
    /// A VM with no RAM and no devices yet.
    pub fn new() -> Result<Self, VmError> {
        let kvm = Kvm::new().map_err(VmError::OpenKvm)?;
        let fd = kvm.create_vm().map_err(ioctl("KVM_CREATE_VM"))?;
        let supported_cpuid = kvm
            .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(ioctl("KVM_GET_SUPPORTED_CPUID"))?;
        Ok(Self {
            kvm,
            fd,
            supported_cpuid,
            ram_mapped: false,
            logging_dirty: false,
        })
    }

    pub fn supported_cpuid(&self) -> &CpuId {
        &self.supported_cpuid
    }

    /// Registers `ram` as the guest's memory, then creates the PIC/IOAPIC/LAPIC and the PIT
    /// in the kernel (see the module comment for why in this order).
    pub fn map_ram(&mut self, ram: &GuestRam) -> Result<(), VmError> {
        if self.ram_mapped {
            return Err(VmError::AlreadyMapped);
        }
        self.register_slots(ram, 0)?;
        self.ram_mapped = true;
        setup_irqchip_and_pit(&self.fd)
    }

    /// Turns KVM's log of the pages the guest writes on for every RAM slot (a flags-only
    /// change, allowed while vCPUs run). Once on it stays on; [`Self::take_dirty_log`] then
    /// says what was written since it was last called.
    ///
    /// Done while the VM still runs, before the pause of its first checkpoint: a slot change
    /// waits out the grace period the irqchip's creation started (see the module comment),
    /// which must not be paid with the guest stopped.
    pub fn log_dirty_pages(&mut self, ram: &GuestRam) -> Result<(), VmError> {
        if self.logging_dirty {
            return Ok(());
        }
        self.register_slots(ram, KVM_MEM_LOG_DIRTY_PAGES)?;
        self.logging_dirty = true;
        Ok(())
    }

    pub fn logging_dirty(&self) -> bool {
        self.logging_dirty
    }

    /// Per RAM slot (in guest-address order), a bitmap of the pages the guest wrote since
    /// the last call (or since logging began), one bit per 4 KiB page; the log starts afresh.
    pub fn take_dirty_log(&self, ram: &GuestRam) -> Result<Vec<Vec<u64>>, VmError> {
        ram.memory()
            .iter()
            .enumerate()
            .map(|(index, region)| {
                self.fd
                    .get_dirty_log(index as u32, region.len() as usize)
                    .map_err(ioctl("KVM_GET_DIRTY_LOG"))
            })
            .collect()
    }

    fn register_slots(&self, ram: &GuestRam, flags: u32) -> Result<(), VmError> {
        for (index, region) in ram.memory().iter().enumerate() {
            let slot = kvm_userspace_memory_region {
                slot: index as u32,
                guest_phys_addr: region.start_addr().raw_value(),
                memory_size: region.len(),
                userspace_addr: region.as_ptr() as u64,
                flags,
            };
            // SAFETY: the host range is a live mapping owned by `ram`, which the caller keeps
            // alive for as long as this VM exists (the VM struct holds both and drops the VM
            // fd first). Re-registering a slot with the same range changes only its flags.
            unsafe { self.fd.set_user_memory_region(slot) }
                .map_err(ioctl("KVM_SET_USER_MEMORY_REGION"))?;
        }
        Ok(())
    }
}

fn setup_irqchip_and_pit(fd: &VmFd) -> Result<(), VmError> {
    fd.set_tss_address(layout::KVM_TSS_ADDR)
        .map_err(ioctl("KVM_SET_TSS_ADDR"))?;
    fd.create_irq_chip().map_err(ioctl("KVM_CREATE_IRQCHIP"))?;
    // The speaker port (0x61) is emulated too, so guests calibrating against PIT channel 2
    // never exit to us for it.
    fd.create_pit2(kvm_pit_config {
        flags: KVM_PIT_SPEAKER_DUMMY,
        ..Default::default()
    })
    .map_err(ioctl("KVM_CREATE_PIT2"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kvm::memory::RamOptions;

    #[test]
    fn ram_is_mapped_once_and_brings_the_irqchip_with_it() {
        if std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/kvm")
            .is_err()
        {
            eprintln!("SKIPPED: /dev/kvm is not usable here");
            return;
        }
        let mut vm = KvmVm::new().expect("a VM");
        let ram = GuestRam::new(16 << 20, RamOptions::default(), None).expect("RAM");
        vm.map_ram(&ram).expect("RAM mapped");
        // The irqchip exists now: KVM refuses a second one.
        assert!(vm.fd.create_irq_chip().is_err());
        assert!(matches!(vm.map_ram(&ram), Err(VmError::AlreadyMapped)));
    }
}
