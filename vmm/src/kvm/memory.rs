//! Guest RAM: one memfd, mapped MAP_SHARED into this process and handed to KVM slot by slot.
//!
//! Backing RAM with a memfd (not anonymous memory) means a snapshot can later take the file as
//! it is instead of copying guest memory out of our address space.

use std::fs::File;
use std::os::fd::FromRawFd;
use std::sync::Arc;

use vm_memory::mmap::MmapRegion;
use vm_memory::{FileOffset, GuestAddress, GuestMemoryMmap, GuestRegionMmap};

use crate::boot::layout;

#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error("memfd_create for guest RAM failed: {0}")]
    Memfd(std::io::Error),
    #[error("sizing the guest RAM memfd to {size} bytes failed: {source}")]
    Truncate { size: u64, source: std::io::Error },
    #[error("mapping guest RAM at {addr:#x} (+{size:#x}) failed: {source}")]
    Map {
        addr: u64,
        size: u64,
        source: vm_memory::mmap::MmapRegionError,
    },
    #[error("guest RAM region at {0:#x} is invalid")]
    Region(u64),
    #[error("guest RAM regions overlap or are out of order: {0}")]
    Collection(String),
    #[error("duplicating the guest RAM memfd failed: {0}")]
    Dup(std::io::Error),
}

/// How RAM should be mapped beyond the defaults.
#[derive(Debug, Clone, Copy, Default)]
pub struct RamOptions {
    /// Touch every page now (MADV_POPULATE_WRITE) instead of on first guest access.
    pub prefault: bool,
    /// Let KSM merge identical pages.
    pub mergeable: bool,
}

/// The guest's RAM: the memfd and its mappings, in guest-physical order.
pub struct GuestRam {
    memory: Arc<GuestMemoryMmap>,
    memfd: File,
    size: u64,
}

impl GuestRam {
    /// Creates `size` bytes of guest RAM laid out around the MMIO hole.
    pub fn new(size: u64, options: RamOptions) -> Result<Self, MemoryError> {
        let memfd = create_memfd(size)?;
        let mut regions = Vec::new();
        let mut file_offset = 0u64;
        for (addr, len) in layout::ram_ranges(size) {
            let fd = memfd.try_clone().map_err(MemoryError::Dup)?;
            let region = MmapRegion::build(
                Some(FileOffset::new(fd, file_offset)),
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_NORESERVE,
            )
            .map_err(|source| MemoryError::Map {
                addr,
                size: len,
                source,
            })?;
            advise(&region, options);
            regions.push(
                GuestRegionMmap::new(region, GuestAddress(addr))
                    .ok_or(MemoryError::Region(addr))?,
            );
            file_offset += len;
        }
        let memory = GuestMemoryMmap::from_regions(regions)
            .map_err(|e| MemoryError::Collection(e.to_string()))?;
        Ok(Self {
            memory: Arc::new(memory),
            memfd,
            size,
        })
    }

    pub fn memory(&self) -> &GuestMemoryMmap {
        &self.memory
    }

    /// A shared handle for devices that access guest RAM from their own thread.
    pub fn shared_memory(&self) -> Arc<GuestMemoryMmap> {
        self.memory.clone()
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    /// The file behind guest RAM; its offsets follow guest-physical order with the MMIO hole
    /// removed.
    pub fn memfd(&self) -> &File {
        &self.memfd
    }

    /// RAM ranges as (guest address, length), for the memory map given to the guest.
    pub fn ranges(&self) -> Vec<(u64, u64)> {
        layout::ram_ranges(self.size)
    }
}

fn create_memfd(size: u64) -> Result<File, MemoryError> {
    // SAFETY: the name is a NUL-terminated string literal and the flags are valid; the return
    // value is checked before use.
    let fd = unsafe { libc::memfd_create(c"agentvm-guest-ram".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(MemoryError::Memfd(std::io::Error::last_os_error()));
    }
    // SAFETY: memfd_create just returned this descriptor and nothing else owns it.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(size)
        .map_err(|source| MemoryError::Truncate { size, source })?;
    Ok(file)
}

fn advise(region: &MmapRegion, options: RamOptions) {
    let advice = [
        (options.mergeable, libc::MADV_MERGEABLE, "MADV_MERGEABLE"),
        (
            options.prefault,
            libc::MADV_POPULATE_WRITE,
            "MADV_POPULATE_WRITE",
        ),
    ];
    for (wanted, advice, name) in advice {
        if !wanted {
            continue;
        }
        // SAFETY: the range is exactly the mapping `region` owns; madvise does not change its
        // contents or validity.
        let rc = unsafe { libc::madvise(region.as_ptr().cast(), region.size(), advice) };
        if rc != 0 {
            tracing::warn!(
                advice = name,
                error = %std::io::Error::last_os_error(),
                "madvise on guest RAM failed; continuing without it"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::{Bytes, GuestMemoryBackend};

    #[test]
    fn ram_is_one_memfd_in_guest_order() {
        let ram = GuestRam::new(8 << 20, RamOptions::default()).unwrap();
        assert_eq!(ram.memfd().metadata().unwrap().len(), 8 << 20);
        ram.memory()
            .write_obj(0xdead_beef_u32, GuestAddress(0x1000))
            .unwrap();
        let mut word = [0u8; 4];
        std::os::unix::fs::FileExt::read_exact_at(ram.memfd(), &mut word, 0x1000).unwrap();
        assert_eq!(u32::from_le_bytes(word), 0xdead_beef);
        assert_eq!(ram.memory().num_regions(), 1);
    }
}
