//! The embedded image is what a PVH-capable loader (linux-loader, qemu) expects.

use agentvm_testguest::{IMAGE_LIMIT, LOAD_ADDR, TESTGUEST_ELF};

fn u16_at(b: &[u8], o: usize) -> u16 {
    u16::from_le_bytes(b[o..o + 2].try_into().unwrap())
}
fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes(b[o..o + 4].try_into().unwrap())
}
fn u64_at(b: &[u8], o: usize) -> u64 {
    u64::from_le_bytes(b[o..o + 8].try_into().unwrap())
}

struct Phdr {
    kind: u32,
    offset: u64,
    paddr: u64,
    filesz: u64,
    memsz: u64,
}

fn phdrs(elf: &[u8]) -> Vec<Phdr> {
    let phoff = u64_at(elf, 32) as usize;
    let phentsize = u16_at(elf, 54) as usize;
    let phnum = u16_at(elf, 56) as usize;
    (0..phnum)
        .map(|i| {
            let p = phoff + i * phentsize;
            Phdr {
                kind: u32_at(elf, p),
                offset: u64_at(elf, p + 8),
                paddr: u64_at(elf, p + 24),
                filesz: u64_at(elf, p + 32),
                memsz: u64_at(elf, p + 40),
            }
        })
        .collect()
}

/// The entry point announced by XEN_ELFNOTE_PHYS32_ENTRY, if any PT_NOTE carries it.
fn pvh_entry(elf: &[u8]) -> Option<u32> {
    for ph in phdrs(elf).iter().filter(|p| p.kind == 4) {
        let mut note = &elf[ph.offset as usize..(ph.offset + ph.filesz) as usize];
        while note.len() >= 12 {
            let (namesz, descsz, kind) = (u32_at(note, 0), u32_at(note, 4), u32_at(note, 8));
            let name_end = 12 + namesz.next_multiple_of(4) as usize;
            if kind == 18 && &note[12..12 + namesz as usize] == b"Xen\0" {
                return Some(u32_at(note, name_end));
            }
            note = &note[name_end + descsz.next_multiple_of(4) as usize..];
        }
    }
    None
}

#[test]
fn is_an_elf64_x86_64_executable_with_a_pvh_entry() {
    let elf = TESTGUEST_ELF;
    assert_eq!(&elf[..4], b"\x7fELF");
    assert_eq!(elf[4], 2, "ELFCLASS64: linux-loader only takes ELF64");
    assert_eq!(elf[5], 1, "little endian");
    assert_eq!(u16_at(elf, 16), 2, "ET_EXEC");
    assert_eq!(u16_at(elf, 18), 62, "EM_X86_64");
    assert_eq!(u16_at(elf, 54), 56, "Elf64_Phdr size");
    let entry = pvh_entry(elf).expect("XEN_ELFNOTE_PHYS32_ENTRY note");
    assert_eq!(u64::from(entry), u64_at(elf, 24), "note and e_entry agree");
    assert!(u64::from(entry) >= LOAD_ADDR);
}

#[test]
fn loads_between_one_mib_and_the_dirty_region() {
    let loads: Vec<_> = phdrs(TESTGUEST_ELF)
        .into_iter()
        .filter(|p| p.kind == 1)
        .collect();
    assert!(!loads.is_empty());
    assert_eq!(loads[0].paddr, LOAD_ADDR);
    for p in &loads {
        assert!(p.paddr >= LOAD_ADDR);
        assert!(p.paddr + p.memsz <= IMAGE_LIMIT);
        assert!(p.offset + p.filesz <= TESTGUEST_ELF.len() as u64);
    }
    // The image is small; megabytes of buffers are NOBITS.
    assert!(
        TESTGUEST_ELF.len() < 128 * 1024,
        "{} bytes",
        TESTGUEST_ELF.len()
    );
}
