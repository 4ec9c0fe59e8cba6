//! Puts the kernel, the initramfs and the command line into guest RAM and decides how the
//! vCPU enters the kernel.
//!
//! An ELF with a PVH note (XEN_ELFNOTE_PHYS32_ENTRY) boots through PVH; any other ELF, and a
//! bzImage, through the 64-bit Linux boot protocol. Real mode is never used: on PVM hosts it
//! runs in KVM's instruction emulator and does not finish.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use linux_loader::loader::bootparam::setup_header;
use linux_loader::loader::{self, BzImage, Elf, KernelLoader, PvhBootCapability};
use vm_memory::{Address, Bytes, GuestAddress, ReadVolatile};

use crate::kvm::memory::GuestMemoryMmap;

use super::layout;

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("opening {what} {path}: {source}")]
    Open {
        what: &'static str,
        path: String,
        source: std::io::Error,
    },
    #[error("kernel {path} is neither an ELF (vmlinux/PVH) nor a bzImage: {elf}; {bzimage}")]
    Format {
        path: String,
        elf: String,
        bzimage: String,
    },
    #[error("kernel {path} could not be loaded: {source}")]
    Kernel { path: String, source: loader::Error },
    #[error(
        "initramfs {path} ({size} bytes) does not fit in guest RAM below {limit:#x} above the kernel's end {kernel_end:#x}"
    )]
    InitrdTooLarge {
        path: String,
        size: u64,
        limit: u64,
        kernel_end: u64,
    },
    #[error("reading initramfs {path} into guest RAM: {reason}")]
    Initrd { path: String, reason: String },
    #[error("kernel command line is {len} bytes; at most {max} fit")]
    CmdlineTooLong { len: usize, max: usize },
    #[error("kernel command line contains a NUL byte")]
    CmdlineNul,
    #[error("writing the kernel command line into guest RAM: {0}")]
    CmdlineWrite(String),
}

/// How the boot vCPU enters the kernel.
#[derive(Debug, Clone, Copy)]
pub enum EntryPoint {
    /// 32-bit protected mode, paging off, EBX = `hvm_start_info`.
    Pvh { entry: u64 },
    /// 64-bit long mode, RSI = zero page. `setup_header` is the bzImage's, if it was one.
    Linux64 {
        entry: u64,
        setup_header: Option<setup_header>,
    },
}

#[derive(Debug, Clone, Copy)]
pub struct LoadedKernel {
    pub entry: EntryPoint,
    /// First guest-physical byte after the kernel image.
    pub kernel_end: u64,
}

#[derive(Debug, Clone, Copy)]
pub struct LoadedInitrd {
    pub address: u64,
    pub size: u64,
}

/// Loads the kernel at the addresses its headers ask for (at or above 1 MiB).
pub fn load_kernel(memory: &GuestMemoryMmap, path: &Path) -> Result<LoadedKernel, LoadError> {
    let mut file = open("kernel", path)?;
    let himem = Some(GuestAddress(layout::HIMEM_START));
    let elf_error = match Elf::load(memory, None, &mut file, himem) {
        Ok(result) => {
            let entry = match result.pvh_boot_cap {
                PvhBootCapability::PvhEntryPresent(entry) => EntryPoint::Pvh {
                    entry: entry.raw_value(),
                },
                _ => EntryPoint::Linux64 {
                    entry: result.kernel_load.raw_value(),
                    setup_header: None,
                },
            };
            return Ok(LoadedKernel {
                entry,
                kernel_end: result.kernel_end,
            });
        }
        Err(loader::Error::Elf(loader::elf::Error::InvalidElfMagicNumber)) => {
            "not an ELF".to_owned()
        }
        Err(source) => {
            return Err(LoadError::Kernel {
                path: path.display().to_string(),
                source,
            });
        }
    };
    match BzImage::load(memory, None, &mut file, himem) {
        Ok(result) => Ok(LoadedKernel {
            // The 64-bit entry of a bzImage sits 0x200 bytes into the protected-mode code.
            entry: EntryPoint::Linux64 {
                entry: result.kernel_load.raw_value() + 0x200,
                setup_header: result.setup_header,
            },
            kernel_end: result.kernel_end,
        }),
        Err(bz) => Err(LoadError::Format {
            path: path.display().to_string(),
            elf: elf_error,
            bzimage: bz.to_string(),
        }),
    }
}

/// Loads the initramfs as high as possible below `limit` (page aligned), above the kernel.
pub fn load_initrd(
    memory: &GuestMemoryMmap,
    path: &Path,
    kernel_end: u64,
    limit: u64,
) -> Result<LoadedInitrd, LoadError> {
    let mut file = open("initramfs", path)?;
    let size = file
        .seek(SeekFrom::End(0))
        .and_then(|size| file.rewind().map(|()| size))
        .map_err(|e| LoadError::Initrd {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
    let too_large = || LoadError::InitrdTooLarge {
        path: path.display().to_string(),
        size,
        limit,
        kernel_end,
    };
    let address = limit.checked_sub(size).ok_or_else(too_large)? & !0xfff;
    if address < kernel_end {
        return Err(too_large());
    }
    read_into(memory, &mut file, address, size).map_err(|reason| LoadError::Initrd {
        path: path.display().to_string(),
        reason,
    })?;
    Ok(LoadedInitrd { address, size })
}

/// Writes the command line, NUL-terminated, at its fixed address.
pub fn write_cmdline(memory: &GuestMemoryMmap, cmdline: &str) -> Result<(), LoadError> {
    if cmdline.as_bytes().contains(&0) {
        return Err(LoadError::CmdlineNul);
    }
    if cmdline.len() >= layout::CMDLINE_MAX {
        return Err(LoadError::CmdlineTooLong {
            len: cmdline.len(),
            max: layout::CMDLINE_MAX - 1,
        });
    }
    let mut bytes = Vec::with_capacity(cmdline.len() + 1);
    bytes.extend_from_slice(cmdline.as_bytes());
    bytes.push(0);
    memory
        .write_slice(&bytes, GuestAddress(layout::CMDLINE))
        .map_err(|e| LoadError::CmdlineWrite(e.to_string()))
}

fn open(what: &'static str, path: &Path) -> Result<File, LoadError> {
    File::open(path).map_err(|source| LoadError::Open {
        what,
        path: path.display().to_string(),
        source,
    })
}

fn read_into<F: Read + ReadVolatile>(
    memory: &GuestMemoryMmap,
    file: &mut F,
    address: u64,
    size: u64,
) -> Result<(), String> {
    let size = usize::try_from(size).map_err(|e| e.to_string())?;
    memory
        .read_exact_volatile_from(GuestAddress(address), file, size)
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn ram() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 64 << 20)]).unwrap()
    }

    #[test]
    fn garbage_kernel_is_refused_naming_both_formats() {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        file.write_all(&[0x42; 4096]).unwrap();
        let err = load_kernel(&ram(), file.path()).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("neither an ELF"), "{text}");
    }

    #[test]
    fn missing_kernel_names_the_path() {
        let err = load_kernel(&ram(), Path::new("/nonexistent/vmlinux")).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/vmlinux"));
    }

    #[test]
    fn initrd_goes_high_and_page_aligned() {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        file.write_all(&[7u8; 10_000]).unwrap();
        let memory = ram();
        let initrd = load_initrd(&memory, file.path(), 2 << 20, 64 << 20).unwrap();
        assert_eq!(initrd.address % 4096, 0);
        assert!(initrd.address + initrd.size <= 64 << 20);
        let byte: u8 = memory
            .read_obj(GuestAddress(initrd.address + 9_999))
            .unwrap();
        assert_eq!(byte, 7);
    }

    #[test]
    fn initrd_that_would_overlap_the_kernel_is_refused() {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        file.write_all(&vec![0u8; (1 << 20) + 1]).unwrap();
        let err = load_initrd(&ram(), file.path(), 63 << 20, 64 << 20).unwrap_err();
        assert!(matches!(err, LoadError::InitrdTooLarge { .. }));
    }

    #[test]
    fn cmdline_limits() {
        let memory = ram();
        write_cmdline(&memory, "console=ttyS0").unwrap();
        let bytes: [u8; 14] = memory.read_obj(GuestAddress(layout::CMDLINE)).unwrap();
        assert_eq!(&bytes, b"console=ttyS0\0");
        assert!(matches!(
            write_cmdline(&memory, "a\0b"),
            Err(LoadError::CmdlineNul)
        ));
        assert!(matches!(
            write_cmdline(&memory, &"x".repeat(layout::CMDLINE_MAX)),
            Err(LoadError::CmdlineTooLong { .. })
        ));
    }
}
