//! The KVM VM: in-kernel interrupt controllers and timer, and guest RAM registered as slots.
//!
//! Creating a VM is split in two. [`KvmVm::new`] does everything that does not depend on the
//! VM's configuration and can run before `vm.create` arrives, including a one-page warm-up
//! memory slot: the first memory slot a KVM VM gets costs milliseconds (measured here: 3–11 ms
//! whatever its size, later ones ~0.1 ms), so that cost is paid ahead of time and off the boot
//! path. [`KvmVm::map_ram`] then registers the real RAM and drops the warm-up slot.

use kvm_bindings::{
    CpuId, KVM_MAX_CPUID_ENTRIES, KVM_PIT_SPEAKER_DUMMY, kvm_pit_config,
    kvm_userspace_memory_region,
};
use kvm_ioctls::{Kvm, VmFd};
use vm_memory::mmap::MmapRegion;
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
    #[error("allocating the warm-up page: {0}")]
    WarmupPage(vm_memory::mmap::MmapRegionError),
    #[error("guest RAM is already mapped into this VM")]
    AlreadyMapped,
}

fn ioctl(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VmError {
    move |source| VmError::Kvm { what, source }
}

/// Where the warm-up slot sits: far above any RAM we hand out, and gone before vCPUs run.
const WARMUP_GPA: u64 = 1 << 40;
const WARMUP_SLOT: u32 = 0;
/// RAM slots follow the warm-up slot.
const FIRST_RAM_SLOT: u32 = 1;

pub struct KvmVm {
    pub kvm: Kvm,
    pub fd: VmFd,
    supported_cpuid: CpuId,
    /// The page behind the warm-up slot, until RAM replaces it.
    warmup: Option<MmapRegion>,
}

impl KvmVm {
    /// A VM with the PIC/IOAPIC/LAPIC and PIT emulated in the kernel, its first-slot cost
    /// already paid, and no RAM yet.
    pub fn new() -> Result<Self, VmError> {
        let kvm = Kvm::new().map_err(VmError::OpenKvm)?;
        let fd = kvm.create_vm().map_err(ioctl("KVM_CREATE_VM"))?;
        let warmup = warmup_slot(&fd)?;
        setup_irqchip_and_pit(&fd)?;
        let supported_cpuid = kvm
            .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(ioctl("KVM_GET_SUPPORTED_CPUID"))?;
        Ok(Self {
            kvm,
            fd,
            supported_cpuid,
            warmup: Some(warmup),
        })
    }

    pub fn supported_cpuid(&self) -> &CpuId {
        &self.supported_cpuid
    }

    /// Registers `ram` as the guest's memory and drops the warm-up slot.
    pub fn map_ram(&mut self, ram: &GuestRam) -> Result<(), VmError> {
        if self.warmup.is_none() {
            return Err(VmError::AlreadyMapped);
        }
        for (index, region) in ram.memory().iter().enumerate() {
            let slot = kvm_userspace_memory_region {
                slot: FIRST_RAM_SLOT + index as u32,
                guest_phys_addr: region.start_addr().raw_value(),
                memory_size: region.len(),
                userspace_addr: region.as_ptr() as u64,
                flags: 0,
            };
            // SAFETY: the host range is a live mapping owned by `ram`, which the caller keeps
            // alive for as long as this VM exists (the VM struct holds both and drops the VM
            // fd first).
            unsafe { self.fd.set_user_memory_region(slot) }
                .map_err(ioctl("KVM_SET_USER_MEMORY_REGION"))?;
        }
        let remove = kvm_userspace_memory_region {
            slot: WARMUP_SLOT,
            memory_size: 0,
            ..Default::default()
        };
        // SAFETY: a zero-sized region deletes the slot; no memory is referenced.
        unsafe { self.fd.set_user_memory_region(remove) }
            .map_err(ioctl("KVM_SET_USER_MEMORY_REGION (drop warm-up)"))?;
        self.warmup = None;
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

fn warmup_slot(fd: &VmFd) -> Result<MmapRegion, VmError> {
    let page = MmapRegion::new(4096).map_err(VmError::WarmupPage)?;
    let slot = kvm_userspace_memory_region {
        slot: WARMUP_SLOT,
        guest_phys_addr: WARMUP_GPA,
        memory_size: 4096,
        userspace_addr: page.as_ptr() as u64,
        flags: 0,
    };
    // SAFETY: the page is a live anonymous mapping that the caller keeps (in `KvmVm::warmup`)
    // until the slot is deleted in `map_ram`; no vCPU exists yet to touch it.
    unsafe { fd.set_user_memory_region(slot) }
        .map_err(ioctl("KVM_SET_USER_MEMORY_REGION (warm-up)"))?;
    Ok(page)
}
