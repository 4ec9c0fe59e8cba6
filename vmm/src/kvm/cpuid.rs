//! Per-vCPU CPUID: what KVM supports on this host, with the topology fields filled in for
//! each vCPU. The hypervisor leaves (0x4000_0000 and up) pass through untouched: PVM guests
//! find their hypervisor there, and rewriting the signature breaks that detection.

use kvm_bindings::{CpuId, kvm_cpuid_entry2};

const LEAF_FEATURES: u32 = 0x1;
const LEAF_CACHE_TOPOLOGY: u32 = 0x4;
const LEAF_EXT_TOPOLOGY: u32 = 0xb;
const LEAF_V2_EXT_TOPOLOGY: u32 = 0x1f;
const HYPERVISOR_LEAVES: u32 = 0x4000_0000;

const ECX_HYPERVISOR: u32 = 1 << 31;
const EDX_HTT: u32 = 1 << 28;
/// Level types in leaf 0xb/0x1f ECX[15:8].
const LEVEL_SMT: u32 = 1;
const LEVEL_CORE: u32 = 2;

/// Adjusts `supported` (from KVM_GET_SUPPORTED_CPUID) for vCPU `index` of `count`, modelled
/// as one socket with `count` single-threaded cores.
pub fn for_vcpu(supported: &CpuId, index: u8, count: u8) -> CpuId {
    let mut cpuid = supported.clone();
    let apic_id = u32::from(index);
    let count = u32::from(count);
    // Bits needed to number `count` cores: the x2APIC id shift of the core level.
    let core_bits = u32::BITS - (count.max(1) - 1).leading_zeros();
    for entry in cpuid.as_mut_slice() {
        if entry.function >= HYPERVISOR_LEAVES {
            continue;
        }
        match entry.function {
            LEAF_FEATURES => {
                entry.ebx = (entry.ebx & 0x0000_ffff) | (apic_id << 24) | (count << 16);
                entry.ecx |= ECX_HYPERVISOR;
                if count > 1 {
                    entry.edx |= EDX_HTT;
                } else {
                    entry.edx &= !EDX_HTT;
                }
            }
            LEAF_CACHE_TOPOLOGY => {
                // EAX[31:26]: cores per package - 1; EAX[25:14]: threads sharing this cache - 1
                // (1 for per-core caches, all cores for the last level).
                let level = (entry.eax >> 5) & 0x7;
                let sharing = if level >= 3 { count - 1 } else { 0 };
                entry.eax = (entry.eax & 0x3fff) | ((count - 1) << 26) | (sharing << 14);
            }
            LEAF_EXT_TOPOLOGY | LEAF_V2_EXT_TOPOLOGY => {
                topology_level(entry, apic_id, count, core_bits);
            }
            _ => {}
        }
    }
    cpuid
}

fn topology_level(entry: &mut kvm_cpuid_entry2, apic_id: u32, count: u32, core_bits: u32) {
    entry.edx = apic_id;
    match entry.index {
        0 => {
            entry.eax = 0;
            entry.ebx = 1;
            entry.ecx = (LEVEL_SMT << 8) | entry.index;
        }
        1 => {
            entry.eax = core_bits;
            entry.ebx = count;
            entry.ecx = (LEVEL_CORE << 8) | entry.index;
        }
        _ => {
            entry.eax = 0;
            entry.ebx = 0;
            entry.ecx = entry.index;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(function: u32, index: u32) -> kvm_cpuid_entry2 {
        kvm_cpuid_entry2 {
            function,
            index,
            ..Default::default()
        }
    }

    fn supported() -> CpuId {
        let mut signature = entry(HYPERVISOR_LEAVES, 0);
        signature.ebx = u32::from_le_bytes(*b"KVMK");
        signature.ecx = u32::from_le_bytes(*b"VMKV");
        signature.edx = u32::from_le_bytes(*b"M\0\0\0");
        let mut features = entry(LEAF_FEATURES, 0);
        features.ebx = 0x0000_0800;
        CpuId::from_entries(&[
            features,
            entry(LEAF_EXT_TOPOLOGY, 0),
            entry(LEAF_EXT_TOPOLOGY, 1),
            signature,
        ])
        .unwrap()
    }

    #[test]
    fn apic_ids_and_topology_per_vcpu() {
        let cpuid = for_vcpu(&supported(), 3, 4);
        let leaves = cpuid.as_slice();
        assert_eq!(leaves[0].ebx >> 24, 3);
        assert_eq!((leaves[0].ebx >> 16) & 0xff, 4);
        assert_eq!(leaves[0].ebx & 0xffff, 0x0800);
        assert_ne!(leaves[0].ecx & ECX_HYPERVISOR, 0);
        assert_ne!(leaves[0].edx & EDX_HTT, 0);
        assert_eq!(leaves[1].edx, 3);
        assert_eq!((leaves[2].eax, leaves[2].ebx), (2, 4));
    }

    #[test]
    fn hypervisor_signature_is_passed_through() {
        let before = supported();
        let after = for_vcpu(&before, 0, 1);
        assert_eq!(before.as_slice()[3], after.as_slice()[3]);
    }
}
