//! Intel MultiProcessor Specification 1.4 table: tells a guest without ACPI how many CPUs it
//! has, where the IOAPIC is and how the ISA IRQs are wired. Written into the EBDA, where guests
//! scan for the floating pointer.

use vm_memory::{Bytes, GuestAddress};

use crate::kvm::memory::GuestMemoryMmap;

use super::layout;

/// More CPUs than this would not fit in the 1 KiB EBDA window.
pub const MAX_CPUS: u8 = 32;

const APIC_VERSION: u8 = 0x14;
const IOAPIC_VERSION: u8 = 0x11;
const CPU_ENABLED: u8 = 1;
const CPU_BOOT_PROCESSOR: u8 = 2;
/// Family 6 signature and FPU|APIC feature flags, as a generic x86_64 CPU reports them.
const CPU_SIGNATURE: u32 = 0x600;
const CPU_FEATURES: u32 = 0x201;
const INT_TYPE_INT: u8 = 0;
const INT_TYPE_NMI: u8 = 1;
const INT_TYPE_EXTINT: u8 = 3;

#[derive(Debug, thiserror::Error)]
pub enum MpTableError {
    #[error("{0} vCPUs do not fit in the MP table (at most {MAX_CPUS})")]
    TooManyCpus(u8),
    #[error("the MP table ({0} bytes) does not fit in the EBDA")]
    TooLarge(usize),
    #[error("writing the MP table into guest RAM: {0}")]
    Write(String),
}

/// Writes the floating pointer and the configuration table for `cpus` CPUs.
pub fn write(memory: &GuestMemoryMmap, cpus: u8) -> Result<(), MpTableError> {
    let table = build(cpus)?;
    memory
        .write_slice(&table, GuestAddress(layout::EBDA_START))
        .map_err(|e| MpTableError::Write(e.to_string()))
}

/// The table's bytes, laid out to start at the EBDA.
pub fn build(cpus: u8) -> Result<Vec<u8>, MpTableError> {
    if cpus == 0 || cpus > MAX_CPUS {
        return Err(MpTableError::TooManyCpus(cpus));
    }
    let ioapic_id = cpus + 1;
    let config_addr = layout::EBDA_START as u32 + 16;

    let mut entries = Vec::new();
    for id in 0..cpus {
        let flags = CPU_ENABLED | if id == 0 { CPU_BOOT_PROCESSOR } else { 0 };
        entries.extend_from_slice(&[0, id, APIC_VERSION, flags]);
        entries.extend_from_slice(&CPU_SIGNATURE.to_le_bytes());
        entries.extend_from_slice(&CPU_FEATURES.to_le_bytes());
        entries.extend_from_slice(&[0; 8]);
    }
    // One ISA bus.
    entries.extend_from_slice(&[1, 0]);
    entries.extend_from_slice(b"ISA   ");
    // The IOAPIC.
    entries.extend_from_slice(&[2, ioapic_id, IOAPIC_VERSION, CPU_ENABLED]);
    entries.extend_from_slice(&(layout::IOAPIC_ADDR as u32).to_le_bytes());
    // ISA IRQ n → IOAPIC pin n, with the bus's default polarity and trigger.
    for pin in 0..layout::IOAPIC_PINS as u8 {
        entries.extend_from_slice(&[3, INT_TYPE_INT, 0, 0, 0, pin, ioapic_id, pin]);
    }
    // LINT0 = ExtINT (the PIC) on the boot CPU, LINT1 = NMI on every CPU.
    entries.extend_from_slice(&[4, INT_TYPE_EXTINT, 0, 0, 0, 0, 0, 0]);
    entries.extend_from_slice(&[4, INT_TYPE_NMI, 0, 0, 0, 0, 0xff, 1]);
    let entry_count = u16::from(cpus) + 1 + 1 + layout::IOAPIC_PINS as u16 + 2;

    let mut header = Vec::with_capacity(44);
    header.extend_from_slice(b"PCMP");
    header.extend_from_slice(&((44 + entries.len()) as u16).to_le_bytes());
    header.push(4); // spec revision 1.4
    header.push(0); // checksum, filled below
    header.extend_from_slice(b"AGENTVM ");
    header.extend_from_slice(b"MICROVM     ");
    header.extend_from_slice(&0u32.to_le_bytes()); // no OEM table
    header.extend_from_slice(&0u16.to_le_bytes());
    header.extend_from_slice(&entry_count.to_le_bytes());
    header.extend_from_slice(&(layout::LAPIC_ADDR as u32).to_le_bytes());
    header.extend_from_slice(&[0, 0, 0, 0]); // no extended table
    let mut config = header;
    config.extend_from_slice(&entries);
    config[7] = checksum(&config);

    let mut floating = Vec::with_capacity(16);
    floating.extend_from_slice(b"_MP_");
    floating.extend_from_slice(&config_addr.to_le_bytes());
    floating.extend_from_slice(&[1, 4, 0, 0, 0, 0, 0, 0]);
    floating[10] = checksum(&floating);

    let mut table = floating;
    table.extend_from_slice(&config);
    let room = (0xa0000 - layout::EBDA_START) as usize;
    if table.len() > room {
        return Err(MpTableError::TooLarge(table.len()));
    }
    Ok(table)
}

/// The byte that makes the sum of `bytes` zero mod 256.
fn checksum(bytes: &[u8]) -> u8 {
    bytes
        .iter()
        .fold(0u8, |sum, b| sum.wrapping_add(*b))
        .wrapping_neg()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sum(bytes: &[u8]) -> u8 {
        bytes.iter().fold(0u8, |s, b| s.wrapping_add(*b))
    }

    #[test]
    fn checksums_and_counts() {
        for cpus in [1u8, 2, 7, MAX_CPUS] {
            let table = build(cpus).unwrap();
            assert_eq!(&table[..4], b"_MP_");
            assert_eq!(sum(&table[..16]), 0);
            let len = u16::from_le_bytes([table[20], table[21]]) as usize;
            let config = &table[16..16 + len];
            assert_eq!(&config[..4], b"PCMP");
            assert_eq!(sum(config), 0);
            // Processor entries (type 0, 20 bytes each) come first.
            let mut offset = 44;
            let mut cpus_seen = 0;
            while config[offset] == 0 {
                cpus_seen += 1;
                offset += 20;
            }
            assert_eq!(cpus_seen, cpus);
        }
    }

    #[test]
    fn refuses_zero_and_too_many() {
        assert!(build(0).is_err());
        assert!(build(MAX_CPUS + 1).is_err());
    }
}
