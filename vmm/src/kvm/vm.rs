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

const WARMUP_SLOT: u32 = 0;
const PAGE_SIZE: u64 = 4096;
/// CPUID leaf whose EAX[7:0] is the physical-address width KVM accepts for guest memory.
const LEAF_ADDRESS_SIZES: u32 = 0x8000_0008;
/// The width assumed when KVM reports none: the smallest any x86-64 CPU has.
const MIN_PHYS_BITS: u8 = 36;
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
        let supported_cpuid = kvm
            .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(ioctl("KVM_GET_SUPPORTED_CPUID"))?;
        let warmup = warmup_slot(&fd, warmup_gpa(phys_bits(&supported_cpuid)))?;
        setup_irqchip_and_pit(&fd)?;
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

/// The guest-physical address width this host's KVM accepts (CPUID 0x8000_0008 EAX[7:0]):
/// 39 on many client CPUs, 40 under some nested hypervisors, 46-52 on servers.
fn phys_bits(supported: &CpuId) -> u8 {
    supported
        .as_slice()
        .iter()
        .find(|e| e.function == LEAF_ADDRESS_SIZES)
        .map(|e| (e.eax & 0xff) as u8)
        .filter(|&bits| bits >= MIN_PHYS_BITS)
        .unwrap_or(MIN_PHYS_BITS)
}

/// Where the warm-up slot sits: the last page the host can address, far above any RAM we
/// hand out (which must fit below the same limit). A fixed address past the limit makes
/// KVM refuse the slot with EINVAL, as 1 TiB did on a host with 40 address bits.
fn warmup_gpa(phys_bits: u8) -> u64 {
    (1u64 << phys_bits.min(52)) - PAGE_SIZE
}

fn warmup_slot(fd: &VmFd, gpa: u64) -> Result<MmapRegion, VmError> {
    let page = MmapRegion::new(PAGE_SIZE as usize).map_err(VmError::WarmupPage)?;
    let slot = kvm_userspace_memory_region {
        slot: WARMUP_SLOT,
        guest_phys_addr: gpa,
        memory_size: PAGE_SIZE,
        userspace_addr: page.as_ptr() as u64,
        flags: 0,
    };
    // SAFETY: the page is a live anonymous mapping that the caller keeps (in `KvmVm::warmup`)
    // until the slot is deleted in `map_ram`; no vCPU exists yet to touch it.
    unsafe { fd.set_user_memory_region(slot) }
        .map_err(ioctl("KVM_SET_USER_MEMORY_REGION (warm-up)"))?;
    Ok(page)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvm_bindings::kvm_cpuid_entry2;

    fn cpuid_with(entries: &[kvm_cpuid_entry2]) -> CpuId {
        CpuId::from_entries(entries).unwrap()
    }

    #[test]
    fn the_warm_up_page_is_the_last_one_the_host_addresses() {
        assert_eq!(warmup_gpa(40), (1 << 40) - 4096);
        assert_eq!(warmup_gpa(39), (1 << 39) - 4096);
        assert_eq!(warmup_gpa(48), (1 << 48) - 4096);
        assert!(
            warmup_gpa(40) + PAGE_SIZE <= 1 << 40,
            "inside a 40-bit host's range"
        );
    }

    #[test]
    fn the_address_width_comes_from_cpuid_with_a_floor() {
        let leaf = |eax| kvm_cpuid_entry2 {
            function: LEAF_ADDRESS_SIZES,
            eax,
            ..Default::default()
        };
        // EAX[15:8] is the linear width; only [7:0] counts.
        assert_eq!(phys_bits(&cpuid_with(&[leaf(0x3028)])), 40);
        assert_eq!(phys_bits(&cpuid_with(&[leaf(0x3030)])), 48);
        assert_eq!(phys_bits(&cpuid_with(&[leaf(0)])), MIN_PHYS_BITS);
        assert_eq!(phys_bits(&cpuid_with(&[])), MIN_PHYS_BITS);
    }

    #[test]
    fn a_vm_is_created_with_its_warm_up_slot_below_this_hosts_limit() {
        let Ok(kvm) = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/kvm")
        else {
            eprintln!("SKIPPED: /dev/kvm is not usable here");
            return;
        };
        drop(kvm);
        let vm = KvmVm::new().expect("a VM with its warm-up slot");
        let bits = phys_bits(vm.supported_cpuid());
        eprintln!("this host's KVM addresses {bits} physical bits");
        assert!(vm.warmup.is_some());
    }
}
