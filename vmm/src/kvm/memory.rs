//! Guest RAM: a file mapped into this process and handed to KVM slot by slot.
//!
//! A fresh VM's RAM is its own file, mapped `MAP_SHARED`, so the file *is* the memory: an
//! unnamed tmpfs file (`O_TMPFILE` in the RAM directory) that a fork can give a name in the
//! same filesystem without copying a byte, or a memfd where no such directory is available.
//!
//! A restored or forked VM maps snapshot memory files `MAP_PRIVATE` instead: pages load
//! from the page cache when touched and writes stay private, so every VM restored from one
//! snapshot shares its clean pages. Only the file's data extents are mapped from it, over
//! anonymous memory: a hole in the file (guest RAM never written) reads as the zero page and
//! costs the page cache nothing, where a file mapping would read it in as zero-filled page
//! cache (whole large folios at a time), so a restored VM would hold its full RAM size in
//! cache. Layers (files holding only pages changed since their base) are mapped over the
//! base where they hold data.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use agentvm_snapshot::pages::{self, PAGE_SIZE, PageHasher};
use vm_memory::bitmap::AtomicBitmap;
use vm_memory::{Bytes, FileOffset, GuestAddress, GuestMemoryBackend};

/// Guest RAM as devices and vCPU set-up see it. Every write through it marks its page in the
/// region's bitmap: a checkpoint takes those pages (device writes, which KVM's dirty log
/// never sees) together with the pages the vCPUs wrote.
pub type GuestMemoryMmap = vm_memory::GuestMemoryMmap<AtomicBitmap>;
type GuestRegionMmap = vm_memory::GuestRegionMmap<AtomicBitmap>;
/// What a device writes a descriptor chain's buffers through (marks the pages it writes).
pub type ChainWriter<'a> = virtio_queue::Writer<'a, vm_memory::bitmap::RefSlice<'a, AtomicBitmap>>;
/// What a device reads a descriptor chain's buffers through.
pub type ChainReader<'a> = virtio_queue::Reader<'a, vm_memory::bitmap::RefSlice<'a, AtomicBitmap>>;
type MmapRegion = vm_memory::mmap::MmapRegion<AtomicBitmap>;

use crate::boot::layout;

#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error("creating the guest RAM file: {0}")]
    Create(io::Error),
    #[error("sizing the guest RAM file to {size} bytes failed: {source}")]
    Truncate { size: u64, source: io::Error },
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
    #[error("duplicating the guest RAM file descriptor failed: {0}")]
    Dup(io::Error),
    #[error("snapshot memory {path}: {source}")]
    Snapshot { path: String, source: io::Error },
    #[error("snapshot memory {path} is {found} bytes, the VM has {expected}")]
    SnapshotSize {
        path: String,
        expected: u64,
        found: u64,
    },
    #[error("writing snapshot memory {path}: {source}")]
    Write { path: String, source: io::Error },
    #[error("reading which guest pages changed (/proc/self/pagemap): {0}")]
    Pagemap(io::Error),
    #[error("remapping guest RAM copy-on-write: {0}")]
    Remap(io::Error),
}

/// How RAM should be mapped beyond the defaults.
#[derive(Debug, Clone, Copy, Default)]
pub struct RamOptions {
    /// Touch every page now (MADV_POPULATE_WRITE) instead of on first guest access.
    pub prefault: bool,
    /// Let KSM merge identical pages.
    pub mergeable: bool,
}

/// What the RAM mappings are backed by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backing {
    /// The VM's own file, mapped shared: nobody else sees it.
    Own,
    /// Copy-on-write over the memory file of the snapshot in `top` (and the bases under it):
    /// pages the guest wrote since are private to this process.
    Private { top: PathBuf },
}

/// One RAM region: guest-physical start, length, and where it sits in the memory file.
#[derive(Debug, Clone, Copy)]
struct Region {
    gpa: u64,
    len: u64,
    file_offset: u64,
}

fn regions(size: u64) -> Vec<Region> {
    let mut file_offset = 0;
    layout::ram_ranges(size)
        .into_iter()
        .map(|(gpa, len)| {
            let region = Region {
                gpa,
                len,
                file_offset,
            };
            file_offset += len;
            region
        })
        .collect()
}

/// The guest's RAM: its mappings in guest-physical order and the file behind them.
pub struct GuestRam {
    memory: Arc<GuestMemoryMmap>,
    /// `Own`: the RAM file itself. `Private`: the bottom (base) memory file.
    file: File,
    /// The RAM file can be linked into a directory (O_TMPFILE, not memfd).
    linkable: bool,
    size: u64,
    backing: Backing,
}

impl GuestRam {
    /// `size` bytes of fresh, zeroed RAM, backed by an unnamed file in `ram_dir` (or a memfd).
    pub fn new(
        size: u64,
        options: RamOptions,
        ram_dir: Option<&Path>,
    ) -> Result<Self, MemoryError> {
        let (file, linkable) = match ram_dir.map(tmpfile) {
            Some(Ok(file)) => (file, true),
            Some(Err(e)) => {
                tracing::warn!(error = %e, "no O_TMPFILE in the RAM directory; using a memfd (forks will copy RAM)");
                (memfd().map_err(MemoryError::Create)?, false)
            }
            None => (memfd().map_err(MemoryError::Create)?, false),
        };
        file.set_len(size)
            .map_err(|source| MemoryError::Truncate { size, source })?;
        let memory = map(&file, size, libc::MAP_SHARED, options)?;
        Ok(Self {
            memory: Arc::new(memory),
            file,
            linkable,
            size,
            backing: Backing::Own,
        })
    }

    /// RAM of a restored VM: the memory files of a snapshot chain (base first, with the
    /// directory of the top snapshot), each mapped copy-on-write where it holds data.
    pub fn restore(
        size: u64,
        chain: &[PathBuf],
        top: &Path,
        options: RamOptions,
    ) -> Result<Self, MemoryError> {
        let open = |path: &PathBuf| {
            File::open(path).map_err(|source| MemoryError::Snapshot {
                path: path.display().to_string(),
                source,
            })
        };
        let base_path = chain.first().ok_or_else(|| MemoryError::Snapshot {
            path: top.display().to_string(),
            source: io::Error::other("no memory file"),
        })?;
        let base = open(base_path)?;
        let found = base.metadata().map(|m| m.len()).unwrap_or(0);
        if found != size {
            return Err(MemoryError::SnapshotSize {
                path: base_path.display().to_string(),
                expected: size,
                found,
            });
        }
        let memory = map_over(&base, base_path, size, options)?;
        for layer_path in &chain[1..] {
            let layer = open(layer_path)?;
            overlay(&memory, size, &layer, Over::Layer).map_err(|source| {
                MemoryError::Snapshot {
                    path: layer_path.display().to_string(),
                    source,
                }
            })?;
        }
        Ok(Self {
            memory: Arc::new(memory),
            file: base,
            linkable: false,
            size,
            backing: Backing::Private {
                top: top.to_owned(),
            },
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

    pub fn backing(&self) -> &Backing {
        &self.backing
    }

    /// RAM ranges as (guest address, length), for the memory map given to the guest.
    pub fn ranges(&self) -> Vec<(u64, u64)> {
        layout::ram_ranges(self.size)
    }

    /// Writes all of an `Own` VM's memory to `dest` (non-zero pages; holes elsewhere).
    /// Returns the page digest and page count.
    pub fn write_full(&self, dest: &Path) -> Result<(String, u64), MemoryError> {
        let out = create_new(dest)?;
        pages::copy_sparse(&self.file, &out).map_err(|source| MemoryError::Write {
            path: dest.display().to_string(),
            source,
        })
    }

    /// Writes the pages a `Private` VM changed since its base to `dest`, a layer file of the
    /// VM's size (zero pages included where a file of `chain`, base first, holds data: in a
    /// layer they override it). Returns the layer digest and page count.
    pub fn write_layer(
        &self,
        dest: &Path,
        chain: &[PathBuf],
    ) -> Result<(String, u64), MemoryError> {
        let out = create_new(dest)?;
        let write_err = |source| MemoryError::Write {
            path: dest.display().to_string(),
            source,
        };
        out.set_len(self.size).map_err(write_err)?;
        // A hole the guest only read maps the zero page, which looks changed; a zero page
        // over a hole changes nothing and is left out.
        let backed = chain_pages(chain).map_err(write_err)?;
        let mut hasher = PageHasher::default();
        let mut page = vec![0u8; PAGE_SIZE as usize];
        for region in regions(self.size) {
            let host = self.host_address(region.gpa);
            for index in changed_pages(host, region.len).map_err(MemoryError::Pagemap)? {
                let gpa = region.gpa + index * PAGE_SIZE;
                self.memory
                    .read_slice(&mut page, GuestAddress(gpa))
                    .map_err(|e| write_err(io::Error::other(e.to_string())))?;
                let file_page = region.file_offset / PAGE_SIZE + index;
                if pages::is_zero(&page) && !backed.contains(&file_page) {
                    continue;
                }
                out.write_all_at(&page, file_page * PAGE_SIZE)
                    .map_err(write_err)?;
                hasher.stored_page(file_page, &page);
            }
        }
        let pages = hasher.pages();
        Ok((hasher.finish(), pages))
    }

    /// Writes all of a `Private` VM's memory as one self-contained file: every page any file
    /// of its chain (`chain`, base first) holds or the VM changed, read through the VM's own
    /// mapping (which composes them), non-zero pages only. Returns the page digest and count.
    pub fn write_flattened(
        &self,
        chain: &[PathBuf],
        dest: &Path,
    ) -> Result<(String, u64), MemoryError> {
        let out = create_new(dest)?;
        let write_err = |source| MemoryError::Write {
            path: dest.display().to_string(),
            source,
        };
        out.set_len(self.size).map_err(write_err)?;
        let mut candidates = chain_pages(chain).map_err(write_err)?;
        for region in regions(self.size) {
            let host = self.host_address(region.gpa);
            let first = region.file_offset / PAGE_SIZE;
            candidates.extend(
                changed_pages(host, region.len)
                    .map_err(MemoryError::Pagemap)?
                    .into_iter()
                    .map(|i| first + i),
            );
        }
        let mut hasher = PageHasher::default();
        let mut page = vec![0u8; PAGE_SIZE as usize];
        for file_page in candidates {
            let Some(gpa) = gpa_of(self.size, file_page * PAGE_SIZE) else {
                continue;
            };
            self.memory
                .read_slice(&mut page, GuestAddress(gpa))
                .map_err(|e| write_err(io::Error::other(e.to_string())))?;
            if pages::is_zero(&page) {
                continue;
            }
            out.write_all_at(&page, file_page * PAGE_SIZE)
                .map_err(write_err)?;
            hasher.page(file_page, &page);
        }
        let pages = hasher.pages();
        Ok((hasher.finish(), pages))
    }

    /// Turns an `Own` VM's RAM file into the immutable base `dest` (linked there when it
    /// can be, copied otherwise) and remaps this VM copy-on-write over it, so the VM and
    /// every VM restored from `dest` share its pages. Returns the page digest, page count,
    /// and whether the file was linked (no copy).
    pub fn freeze_into(
        &mut self,
        dest: &Path,
        snapshot_dir: &Path,
    ) -> Result<(String, u64, bool), MemoryError> {
        self.freeze_into_then(dest, snapshot_dir, || {})
    }

    /// [`Self::freeze_into`], calling `frozen` as soon as the VM's writes no longer reach
    /// the base: the digest of a linked base is taken after, and may run beside the VM.
    pub fn freeze_into_then(
        &mut self,
        dest: &Path,
        snapshot_dir: &Path,
        frozen: impl FnOnce(),
    ) -> Result<(String, u64, bool), MemoryError> {
        let write_err = |source| MemoryError::Write {
            path: dest.display().to_string(),
            source,
        };
        let linked = self.linkable && link_fd(&self.file, dest).is_ok();
        let (copied, base) = if linked {
            (None, self.file.try_clone().map_err(MemoryError::Dup)?)
        } else {
            let copied = self.write_full(dest)?;
            (Some(copied), File::open(dest).map_err(write_err)?)
        };
        remap_private(&self.memory, self.size, &base).map_err(MemoryError::Remap)?;
        self.file = base;
        self.backing = Backing::Private {
            top: snapshot_dir.to_owned(),
        };
        frozen();
        let (digest, pages) = match copied {
            Some(copied) => copied,
            None => pages::file_digest(&self.file).map_err(write_err)?,
        };
        Ok((digest, pages, linked))
    }

    /// Forgets which pages devices wrote: what [`Self::dirty_file_pages`] reports next
    /// starts now.
    pub fn reset_device_dirty(&self) {
        for region in self.memory.iter() {
            std::ops::Deref::deref(region).bitmap().reset();
        }
    }

    /// The memory-file pages written since the last checkpoint, in order: those the guest
    /// wrote (`guest`: KVM's dirty log, one bitmap per region in address order) and those
    /// devices wrote through [`GuestMemoryMmap`] (whose marks are reset).
    pub fn dirty_file_pages(&self, guest: &[Vec<u64>]) -> Vec<u64> {
        let mut out = Vec::new();
        for ((region, mapped), guest) in
            regions(self.size).iter().zip(self.memory.iter()).zip(guest)
        {
            let devices = std::ops::Deref::deref(mapped).bitmap().get_and_reset();
            let first = region.file_offset / PAGE_SIZE;
            let pages = region.len / PAGE_SIZE;
            for (word, (g, d)) in guest
                .iter()
                .zip(devices.iter().chain(std::iter::repeat(&0)))
                .enumerate()
            {
                let mut bits = g | d;
                while bits != 0 {
                    let bit = u64::from(bits.trailing_zeros());
                    bits &= bits - 1;
                    let index = word as u64 * 64 + bit;
                    if index < pages {
                        out.push(first + index);
                    }
                }
            }
        }
        out
    }

    /// The memory-file pages a `Private` VM changed since it was mapped (see
    /// [`changed_pages`]), in order.
    pub fn changed_file_pages(&self) -> Result<Vec<u64>, MemoryError> {
        let mut out = Vec::new();
        for region in regions(self.size) {
            let first = region.file_offset / PAGE_SIZE;
            let host = self.host_address(region.gpa);
            out.extend(
                changed_pages(host, region.len)
                    .map_err(MemoryError::Pagemap)?
                    .into_iter()
                    .map(|i| first + i),
            );
        }
        Ok(out)
    }

    /// Whether memory-file page `page + 1` follows `page` in guest memory too, so a run of
    /// them reads in one go.
    pub fn file_pages_adjacent(&self, page: u64) -> bool {
        let (Some(a), Some(b)) = (
            gpa_of(self.size, page * PAGE_SIZE),
            gpa_of(self.size, (page + 1) * PAGE_SIZE),
        ) else {
            return false;
        };
        // Guest memory reads across regions too: only the addresses need to follow.
        b == a + PAGE_SIZE
    }

    /// Copies memory-file pages from `page` on (an index as the two calls above give them,
    /// the run adjacent in guest memory) into `out`, a whole number of pages.
    pub fn read_file_pages(&self, page: u64, out: &mut [u8]) -> Result<(), MemoryError> {
        let gpa =
            gpa_of(self.size, page * PAGE_SIZE).ok_or(MemoryError::Region(page * PAGE_SIZE))?;
        self.memory
            .read_slice(out, GuestAddress(gpa))
            .map_err(|e| MemoryError::Write {
                path: format!("guest page {gpa:#x}"),
                source: io::Error::other(e.to_string()),
            })
    }

    fn host_address(&self, gpa: u64) -> *mut u8 {
        self.memory
            .get_host_address(GuestAddress(gpa))
            .unwrap_or(std::ptr::null_mut())
    }
}

/// The guest-physical address of a memory-file offset (the file skips the MMIO hole).
fn gpa_of(size: u64, file_offset: u64) -> Option<u64> {
    regions(size)
        .into_iter()
        .find(|r| file_offset >= r.file_offset && file_offset < r.file_offset + r.len)
        .map(|r| r.gpa + (file_offset - r.file_offset))
}

fn create_new(path: &Path) -> Result<File, MemoryError> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(|source| MemoryError::Write {
            path: path.display().to_string(),
            source,
        })
}

/// Maps `file` (offsets in guest-physical order with the MMIO hole removed) as guest RAM.
fn map(
    file: &File,
    size: u64,
    share: i32,
    options: RamOptions,
) -> Result<GuestMemoryMmap, MemoryError> {
    let mut out = Vec::new();
    for region in regions(size) {
        let fd = file.try_clone().map_err(MemoryError::Dup)?;
        let mapping = MmapRegion::build(
            Some(FileOffset::new(fd, region.file_offset)),
            region.len as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            share | libc::MAP_NORESERVE,
        )
        .map_err(|source| MemoryError::Map {
            addr: region.gpa,
            size: region.len,
            source,
        })?;
        advise(&mapping, options, share == libc::MAP_SHARED);
        out.push(
            GuestRegionMmap::new(mapping, GuestAddress(region.gpa))
                .ok_or(MemoryError::Region(region.gpa))?,
        );
    }
    GuestMemoryMmap::from_regions(out).map_err(|e| MemoryError::Collection(e.to_string()))
}

/// The pages (file offsets / page size) any memory file of `chain` holds data for.
fn chain_pages(chain: &[PathBuf]) -> io::Result<std::collections::BTreeSet<u64>> {
    let files = chain
        .iter()
        .map(|p| {
            File::open(p).map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", p.display())))
        })
        .collect::<io::Result<Vec<_>>>()?;
    Ok(pages::owners(&files)?.into_keys().collect())
}

/// Guest RAM of `size` bytes, copy-on-write over `base` (a memory file of that size): the
/// regions are anonymous memory with `base`'s data extents mapped over them.
fn map_over(
    base: &File,
    base_path: &Path,
    size: u64,
    options: RamOptions,
) -> Result<GuestMemoryMmap, MemoryError> {
    let mut out = Vec::new();
    for region in regions(size) {
        let mapping = MmapRegion::build(
            None,
            region.len as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
        )
        .map_err(|source| MemoryError::Map {
            addr: region.gpa,
            size: region.len,
            source,
        })?;
        out.push(
            GuestRegionMmap::new(mapping, GuestAddress(region.gpa))
                .ok_or(MemoryError::Region(region.gpa))?,
        );
    }
    let memory =
        GuestMemoryMmap::from_regions(out).map_err(|e| MemoryError::Collection(e.to_string()))?;
    for region in memory.iter() {
        small_pages(region.as_ptr(), region.size());
    }
    overlay(&memory, size, base, Over::Base).map_err(|source| MemoryError::Snapshot {
        path: base_path.display().to_string(),
        source,
    })?;
    for region in memory.iter() {
        advise_private(region.as_ptr(), region.size(), options);
    }
    Ok(memory)
}

/// Extents closer than this are mapped as one, holes and all: fewer mappings (the kernel
/// allows 65530 per process) for a few zero-filled cache pages if the guest reads that gap.
const MIN_HOLE: u64 = 16 * PAGE_SIZE;
/// At most this many file mappings per memory file; past it, gaps merge more eagerly.
const MAX_EXTENTS: usize = 16_384;

/// `extents` with gaps under `MIN_HOLE` merged, and larger ones too while there are more
/// than `MAX_EXTENTS`.
fn coalesce(extents: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut gap = MIN_HOLE;
    loop {
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(extents.len());
        for &(offset, len) in extents {
            match merged.last_mut() {
                Some((start, span)) if offset <= *start + *span + gap => {
                    *span = (offset + len).max(*start + *span) - *start;
                }
                _ => merged.push((offset, len)),
            }
        }
        if merged.len() <= MAX_EXTENTS {
            return merged;
        }
        gap *= 4;
    }
}

/// Which memory file `overlay` maps.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Over {
    /// The bottom file, over anonymous memory: its holes read as zero either way, so nearby
    /// extents may be mapped as one, holes included.
    Base,
    /// A layer over its base: a hole means "the base's page", so only data is mapped.
    Layer,
}

/// Maps the data extents of `layer` over the matching pages of `memory`, copy-on-write.
fn overlay(memory: &GuestMemoryMmap, size: u64, layer: &File, over: Over) -> io::Result<()> {
    let len = layer.metadata()?.len();
    if len != size {
        return Err(io::Error::other(format!(
            "layer is {len} bytes, the VM has {size}"
        )));
    }
    let extents = pages::data_extents(layer)?;
    let extents = match over {
        Over::Base => coalesce(&extents),
        Over::Layer => extents,
    };
    for region in regions(size) {
        let host = memory
            .get_host_address(GuestAddress(region.gpa))
            .map_err(|e| io::Error::other(e.to_string()))?;
        let region_end = region.file_offset + region.len;
        for &(offset, extent) in &extents {
            let start = offset.max(region.file_offset);
            let end = (offset + extent).min(region_end);
            if start >= end {
                continue;
            }
            // SAFETY: the target range lies inside this region's live mapping (clipped to
            // it above), which MAP_FIXED replaces page for page; no vCPU runs yet and no
            // reference into those pages exists.
            let mapped = unsafe {
                libc::mmap(
                    host.add((start - region.file_offset) as usize).cast(),
                    (end - start) as usize,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_FIXED | libc::MAP_NORESERVE,
                    layer.as_raw_fd(),
                    start as libc::off_t,
                )
            };
            if mapped == libc::MAP_FAILED {
                return Err(io::Error::last_os_error());
            }
            // Fault in only the page touched: readahead would bring neighbours (holes
            // included) into the cache, large folios at a time.
            // SAFETY: exactly the range just mapped; madvise changes no contents.
            unsafe { libc::madvise(mapped, (end - start) as usize, libc::MADV_RANDOM) };
        }
    }
    Ok(())
}

/// Replaces a shared RAM mapping with a private one over `base` at the same addresses:
/// anonymous memory with `base`'s data extents mapped over it (see `map_over`).
fn remap_private(memory: &GuestMemoryMmap, size: u64, base: &File) -> io::Result<()> {
    for region in regions(size) {
        let host = memory
            .get_host_address(GuestAddress(region.gpa))
            .map_err(|e| io::Error::other(e.to_string()))?;
        // SAFETY: the range is exactly this region's live mapping; the VM is paused, so no
        // vCPU or device touches it while it is swapped for fresh anonymous memory, onto
        // which the file's contents are mapped back below before it runs again. KVM follows
        // through its MMU notifier.
        let mapped = unsafe {
            libc::mmap(
                host.cast(),
                region.len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if mapped == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        small_pages(host, region.len as usize);
    }
    overlay(memory, size, base, Over::Base)
}

/// Anonymous guest RAM stays in small pages: a huge page would turn one written page of a
/// hole into 2 MiB of private memory per VM.
fn small_pages(host: *mut u8, len: usize) {
    // SAFETY: the range is one whole guest RAM mapping of this process; the advice changes
    // no contents.
    unsafe { libc::madvise(host.cast(), len, libc::MADV_NOHUGEPAGE) };
}

/// The caller's options on a private RAM mapping (see `advise`), by address.
fn advise_private(host: *mut u8, len: usize, options: RamOptions) {
    let advice = [
        (options.mergeable, libc::MADV_MERGEABLE, "MADV_MERGEABLE"),
        // Populating a private mapping for writing would copy every page: read instead.
        (
            options.prefault,
            libc::MADV_POPULATE_READ,
            "MADV_POPULATE_READ",
        ),
    ];
    for (wanted, advice, name) in advice {
        if !wanted {
            continue;
        }
        // SAFETY: as above.
        let rc = unsafe { libc::madvise(host.cast(), len, advice) };
        if rc != 0 {
            tracing::warn!(
                advice = name,
                error = %io::Error::last_os_error(),
                "madvise on guest RAM failed; continuing without it"
            );
        }
    }
}

/// Pages (index from `host`) of a private mapping that the process wrote to since it was
/// mapped: present and anonymous in /proc/self/pagemap.
fn changed_pages(host: *mut u8, len: u64) -> io::Result<Vec<u64>> {
    const PRESENT: u64 = 1 << 63;
    const SWAPPED: u64 = 1 << 62;
    const FILE_OR_SHARED: u64 = 1 << 61;
    let pagemap = File::open("/proc/self/pagemap")?;
    let pages = len / PAGE_SIZE;
    let first = host as u64 / PAGE_SIZE;
    let mut changed = Vec::new();
    let mut buf = vec![0u8; 8 * 4096];
    let mut index = 0;
    while index < pages {
        let batch = (pages - index).min(4096);
        let bytes = &mut buf[..(batch * 8) as usize];
        pagemap.read_exact_at(bytes, (first + index) * 8)?;
        for (i, entry) in bytes.chunks_exact(8).enumerate() {
            let entry = u64::from_le_bytes(entry.try_into().unwrap_or_default());
            let anonymous = entry & FILE_OR_SHARED == 0;
            if (entry & PRESENT != 0 && anonymous) || entry & SWAPPED != 0 {
                changed.push(index + i as u64);
            }
        }
        index += batch;
    }
    Ok(changed)
}

fn tmpfile(dir: &Path) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_TMPFILE | libc::O_CLOEXEC)
        .mode(0o600)
        .open(dir)
}

fn memfd() -> io::Result<File> {
    // SAFETY: the name is a NUL-terminated string literal and the flags are valid; the return
    // value is checked before use.
    let fd = unsafe { libc::memfd_create(c"agentvm-guest-ram".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: memfd_create just returned this descriptor and nothing else owns it.
    Ok(unsafe { File::from_raw_fd(fd) })
}

/// Gives an unnamed (O_TMPFILE) file a name, through /proc so no capability is needed.
fn link_fd(file: &File, dest: &Path) -> io::Result<()> {
    let source = format!("/proc/self/fd/{}\0", file.as_raw_fd());
    let dest = std::ffi::CString::new(dest.as_os_str().as_encoded_bytes())
        .map_err(|_| io::Error::other("destination path has a NUL"))?;
    // SAFETY: both paths are NUL-terminated and live for the call.
    let rc = unsafe {
        libc::linkat(
            libc::AT_FDCWD,
            source.as_ptr().cast(),
            libc::AT_FDCWD,
            dest.as_ptr(),
            libc::AT_SYMLINK_FOLLOW,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The default RAM directory: /dev/shm when it is a tmpfs (RAM must never be written back
/// to a disk), else none (memfd).
pub fn default_ram_dir() -> Option<PathBuf> {
    const TMPFS_MAGIC: i64 = 0x0102_1994;
    let path = c"/dev/shm";
    // SAFETY: statfs fills the zeroed struct for a NUL-terminated path; result checked.
    let mut stat: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let rc = unsafe { libc::statfs(path.as_ptr(), &mut stat) };
    (rc == 0 && stat.f_type as i64 == TMPFS_MAGIC).then(|| PathBuf::from("/dev/shm"))
}

fn advise(region: &MmapRegion, options: RamOptions, shared: bool) {
    let advice = [
        (options.mergeable, libc::MADV_MERGEABLE, "MADV_MERGEABLE"),
        // Populating a private mapping for writing would copy every page: read instead.
        (
            options.prefault,
            if shared {
                libc::MADV_POPULATE_WRITE
            } else {
                libc::MADV_POPULATE_READ
            },
            "MADV_POPULATE",
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
                error = %io::Error::last_os_error(),
                "madvise on guest RAM failed; continuing without it"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fresh_ram_is_one_file_in_guest_order() {
        let ram =
            GuestRam::new(8 << 20, RamOptions::default(), default_ram_dir().as_deref()).unwrap();
        assert_eq!(ram.file.metadata().unwrap().len(), 8 << 20);
        ram.memory()
            .write_obj(0xdead_beef_u32, GuestAddress(0x1000))
            .unwrap();
        let mut word = [0u8; 4];
        ram.file.read_exact_at(&mut word, 0x1000).unwrap();
        assert_eq!(u32::from_le_bytes(word), 0xdead_beef);
        assert_eq!(ram.memory().num_regions(), 1);
        assert_eq!(ram.backing(), &Backing::Own);
    }

    fn stamp(ram: &GuestRam, page: u64, value: u32) {
        ram.memory()
            .write_obj(value, GuestAddress(page * PAGE_SIZE))
            .unwrap();
    }

    fn read(ram: &GuestRam, page: u64) -> u32 {
        ram.memory()
            .read_obj(GuestAddress(page * PAGE_SIZE))
            .unwrap()
    }

    #[test]
    fn freeze_fork_layer_and_compose() {
        let shm = tempfile::tempdir_in(default_ram_dir().unwrap_or(std::env::temp_dir())).unwrap();
        let mut parent = GuestRam::new(4 << 20, RamOptions::default(), Some(shm.path())).unwrap();
        for page in 0..8 {
            stamp(&parent, page, 100 + page as u32);
        }
        let base_dir = shm.path().join("base");
        std::fs::create_dir(&base_dir).unwrap();
        let (_, pages, linked) = parent
            .freeze_into(&base_dir.join("memory"), &base_dir)
            .unwrap();
        assert_eq!(pages, 8);
        assert!(linked, "tmpfs RAM is linked, not copied");
        // The parent keeps running on its own copy-on-write view.
        stamp(&parent, 1, 999);
        assert_eq!(read(&parent, 1), 999);
        let base_file = File::open(base_dir.join("memory")).unwrap();
        let mut word = [0u8; 4];
        base_file.read_exact_at(&mut word, PAGE_SIZE).unwrap();
        assert_eq!(
            u32::from_le_bytes(word),
            101,
            "the base never sees the parent's writes"
        );

        // A child from the base, writing two pages (one to zero).
        let chain = vec![base_dir.join("memory")];
        let child = GuestRam::restore(4 << 20, &chain, &base_dir, RamOptions::default()).unwrap();
        assert_eq!(read(&child, 1), 101);
        stamp(&child, 2, 777);
        stamp(&child, 3, 0);
        stamp(&child, 700, 5);
        // Reading a page the base has no data for maps the zero page: not a change.
        assert_eq!(read(&child, 500), 0);
        let layer_dir = shm.path().join("layer");
        std::fs::create_dir(&layer_dir).unwrap();
        let (_, layer_pages) = child
            .write_layer(&layer_dir.join("memory"), &chain)
            .unwrap();
        assert_eq!(layer_pages, 3, "two stamps and a zero over the base's data");

        // A grandchild composes base + layer.
        let chain = vec![base_dir.join("memory"), layer_dir.join("memory")];
        let grandchild =
            GuestRam::restore(4 << 20, &chain, &layer_dir, RamOptions::default()).unwrap();
        assert_eq!(read(&grandchild, 1), 101);
        assert_eq!(read(&grandchild, 2), 777);
        assert_eq!(
            read(&grandchild, 3),
            0,
            "a zero written in the layer overrides the base"
        );
        assert_eq!(read(&grandchild, 4), 104);
        assert_eq!(read(&grandchild, 700), 5);
        // Nothing a grandchild writes reaches anyone else.
        stamp(&grandchild, 4, 4444);
        assert_eq!(read(&child, 4), 104);
        assert_eq!(read(&parent, 4), 104);
    }

    #[test]
    fn memfd_ram_forks_by_copy() {
        let dir = tempfile::tempdir().unwrap();
        let mut ram = GuestRam::new(2 << 20, RamOptions::default(), None).unwrap();
        stamp(&ram, 5, 55);
        let (_, pages, linked) = ram
            .freeze_into(&dir.path().join("memory"), dir.path())
            .unwrap();
        assert!(!linked);
        assert_eq!(pages, 1);
        stamp(&ram, 5, 66);
        let file = File::open(dir.path().join("memory")).unwrap();
        let mut word = [0u8; 4];
        file.read_exact_at(&mut word, 5 * PAGE_SIZE).unwrap();
        assert_eq!(u32::from_le_bytes(word), 55);
    }

    #[test]
    fn restore_refuses_a_memory_file_of_the_wrong_size() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("memory");
        File::create(&path).unwrap().set_len(1 << 20).unwrap();
        let err = GuestRam::restore(2 << 20, &[path], dir.path(), RamOptions::default())
            .err()
            .unwrap();
        assert!(matches!(err, MemoryError::SnapshotSize { .. }), "{err}");
    }
}
