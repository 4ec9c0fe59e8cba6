//! The boot information the kernel reads first: the PVH `hvm_start_info` or the Linux zero
//! page, each carrying the memory map, the command line and the initramfs.

use linux_loader::loader::bootparam::{boot_e820_entry, boot_params, setup_header};
use linux_loader::loader::elf::start_info::{
    hvm_memmap_table_entry, hvm_modlist_entry, hvm_start_info,
};
use vm_memory::{Bytes, GuestAddress};

use crate::kvm::memory::GuestMemoryMmap;

use super::layout;
use super::loader::LoadedInitrd;

const E820_RAM: u32 = 1;
const E820_RESERVED: u32 = 2;
const PVH_MAGIC: u32 = 0x336e_c578;
/// "HdrS": the zero page's setup header is valid.
const KERNEL_HDR_MAGIC: u32 = 0x5372_6448;
const KERNEL_BOOT_FLAG_MAGIC: u16 = 0xaa55;
/// "Undefined" boot loader id: we are not one of the registered ones.
const KERNEL_LOADER_OTHER: u8 = 0xff;
const KERNEL_MIN_ALIGNMENT: u32 = 0x0100_0000;

#[derive(Debug, thiserror::Error)]
pub enum ParamsError {
    #[error("the memory map has {0} entries; at most {max} fit", max = layout::PVH_MEMMAP_MAX)]
    TooManyEntries(usize),
    #[error("writing {what} into guest RAM: {reason}")]
    Write { what: &'static str, reason: String },
}

/// One memory-map entry as both protocols describe it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MapEntry {
    pub addr: u64,
    pub size: u64,
    pub kind: u32,
}

/// The guest's memory map: RAM below the EBDA, the EBDA/BIOS hole as reserved, then RAM from
/// 1 MiB up to the MMIO hole and above 4 GiB.
pub fn memory_map(ram: &[(u64, u64)]) -> Vec<MapEntry> {
    let mut map = vec![
        MapEntry {
            addr: 0,
            size: layout::EBDA_START,
            kind: E820_RAM,
        },
        MapEntry {
            addr: layout::EBDA_START,
            size: layout::HIMEM_START - layout::EBDA_START,
            kind: E820_RESERVED,
        },
    ];
    for &(addr, size) in ram {
        let start = addr.max(layout::HIMEM_START);
        let end = addr + size;
        if end > start {
            map.push(MapEntry {
                addr: start,
                size: end - start,
                kind: E820_RAM,
            });
        }
    }
    map
}

/// Writes `hvm_start_info`, its module list (the initramfs) and memory map.
pub fn write_pvh(
    memory: &GuestMemoryMmap,
    map: &[MapEntry],
    cmdline_len: usize,
    initrd: Option<LoadedInitrd>,
) -> Result<(), ParamsError> {
    if map.len() > layout::PVH_MEMMAP_MAX {
        return Err(ParamsError::TooManyEntries(map.len()));
    }
    let mut info = hvm_start_info {
        magic: PVH_MAGIC,
        version: 1,
        cmdline_paddr: if cmdline_len > 0 { layout::CMDLINE } else { 0 },
        memmap_paddr: layout::PVH_MEMMAP,
        memmap_entries: map.len() as u32,
        ..Default::default()
    };
    if let Some(initrd) = initrd {
        info.nr_modules = 1;
        info.modlist_paddr = layout::PVH_MODLIST;
        let module = hvm_modlist_entry {
            paddr: initrd.address,
            size: initrd.size,
            ..Default::default()
        };
        write(memory, module, layout::PVH_MODLIST, "the PVH module list")?;
    }
    for (i, entry) in map.iter().enumerate() {
        let entry = hvm_memmap_table_entry {
            addr: entry.addr,
            size: entry.size,
            type_: entry.kind,
            reserved: 0,
        };
        let at = layout::PVH_MEMMAP + (i * std::mem::size_of::<hvm_memmap_table_entry>()) as u64;
        write(memory, entry, at, "the PVH memory map")?;
    }
    write(memory, info, layout::PVH_START_INFO, "hvm_start_info")
}

/// Writes the zero page for the 64-bit Linux boot protocol.
pub fn write_zero_page(
    memory: &GuestMemoryMmap,
    map: &[MapEntry],
    cmdline_len: usize,
    initrd: Option<LoadedInitrd>,
    header: Option<setup_header>,
) -> Result<(), ParamsError> {
    let mut params = boot_params::default();
    if let Some(header) = header {
        params.hdr = header;
    }
    params.hdr.type_of_loader = KERNEL_LOADER_OTHER;
    params.hdr.boot_flag = KERNEL_BOOT_FLAG_MAGIC;
    params.hdr.header = KERNEL_HDR_MAGIC;
    params.hdr.cmd_line_ptr = layout::CMDLINE as u32;
    params.hdr.cmdline_size = cmdline_len as u32;
    if params.hdr.kernel_alignment == 0 {
        params.hdr.kernel_alignment = KERNEL_MIN_ALIGNMENT;
    }
    if let Some(initrd) = initrd {
        params.hdr.ramdisk_image = initrd.address as u32;
        params.hdr.ramdisk_size = initrd.size as u32;
    }
    if map.len() > params.e820_table.len() {
        return Err(ParamsError::TooManyEntries(map.len()));
    }
    for (slot, entry) in params.e820_table.iter_mut().zip(map) {
        *slot = boot_e820_entry {
            addr: entry.addr,
            size: entry.size,
            r#type: entry.kind,
        };
    }
    params.e820_entries = map.len() as u8;
    write(memory, params, layout::ZERO_PAGE, "the zero page")
}

fn write<T: vm_memory::ByteValued>(
    memory: &GuestMemoryMmap,
    value: T,
    at: u64,
    what: &'static str,
) -> Result<(), ParamsError> {
    memory
        .write_obj(value, GuestAddress(at))
        .map_err(|e| ParamsError::Write {
            what,
            reason: e.to_string(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn map_skips_the_legacy_hole_and_the_mmio_gap() {
        let map = memory_map(&layout::ram_ranges(5 << 30));
        assert_eq!(
            map[0],
            MapEntry {
                addr: 0,
                size: 0x9fc00,
                kind: E820_RAM
            }
        );
        assert_eq!(map[1].kind, E820_RESERVED);
        assert_eq!(
            map[2],
            MapEntry {
                addr: 1 << 20,
                size: layout::MMIO_GAP_START - (1 << 20),
                kind: E820_RAM
            }
        );
        assert_eq!(
            map[3],
            MapEntry {
                addr: 1 << 32,
                size: (5 << 30) - layout::MMIO_GAP_START,
                kind: E820_RAM
            }
        );
    }

    #[test]
    fn pvh_start_info_points_at_its_tables() {
        let memory = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 16 << 20)]).unwrap();
        let map = memory_map(&[(0, 16 << 20)]);
        let initrd = LoadedInitrd {
            address: 0x80_0000,
            size: 1234,
        };
        write_pvh(&memory, &map, 10, Some(initrd)).unwrap();
        let info: hvm_start_info = memory
            .read_obj(GuestAddress(layout::PVH_START_INFO))
            .unwrap();
        assert_eq!(info.magic, PVH_MAGIC);
        assert_eq!(info.memmap_entries, 3);
        assert_eq!(info.cmdline_paddr, layout::CMDLINE);
        assert_eq!(info.nr_modules, 1);
        let module: hvm_modlist_entry = memory.read_obj(GuestAddress(info.modlist_paddr)).unwrap();
        assert_eq!((module.paddr, module.size), (0x80_0000, 1234));
        let last: hvm_memmap_table_entry = memory
            .read_obj(GuestAddress(info.memmap_paddr + 2 * 24))
            .unwrap();
        assert_eq!((last.addr, last.size), (1 << 20, 15 << 20));
    }

    #[test]
    fn zero_page_has_magic_cmdline_and_e820() {
        let memory = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 16 << 20)]).unwrap();
        let map = memory_map(&[(0, 16 << 20)]);
        write_zero_page(&memory, &map, 5, None, None).unwrap();
        let params: boot_params = memory.read_obj(GuestAddress(layout::ZERO_PAGE)).unwrap();
        assert_eq!({ params.hdr.header }, KERNEL_HDR_MAGIC);
        assert_eq!({ params.hdr.cmd_line_ptr }, layout::CMDLINE as u32);
        assert_eq!(params.e820_entries, 3);
    }
}
