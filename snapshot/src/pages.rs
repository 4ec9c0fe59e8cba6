//! Guest memory files at page granularity: which pages hold data, copying only those, and a
//! digest that does not depend on how a filesystem happens to store zeros.
//!
//! A memory file is sparse: pages the guest never wrote are holes. The page digest is SHA-256
//! over every non-zero 4 KiB page as `(page index as le64 || page bytes)`, in page order, so a
//! hole and a page of written zeros hash the same, and copying the file to another filesystem
//! (or through an archive) keeps its digest.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

use sha2::{Digest, Sha256};

pub const PAGE_SIZE: u64 = 4096;
/// Bytes read per system call when walking a file.
const CHUNK: usize = 1 << 20;

/// Data ranges of `file` as (offset, length), page aligned, in order (SEEK_DATA/SEEK_HOLE).
pub fn data_extents(file: &File) -> io::Result<Vec<(u64, u64)>> {
    use nix::errno::Errno;
    use nix::unistd::{Whence, lseek};
    let len = file.metadata()?.len();
    let mut extents = Vec::new();
    let mut offset: i64 = 0;
    while (offset as u64) < len {
        let data = match lseek(file, offset, Whence::SeekData) {
            Ok(data) => data,
            Err(Errno::ENXIO) => break, // no data past `offset`
            Err(e) => return Err(e.into()),
        };
        let hole = lseek(file, data, Whence::SeekHole)?;
        let start = (data as u64) & !(PAGE_SIZE - 1);
        let end = (hole as u64).min(len).next_multiple_of(PAGE_SIZE);
        if end > start {
            extents.push((start, end - start));
        }
        offset = hole;
    }
    Ok(extents)
}

/// Incremental page digest.
#[derive(Default, Clone)]
pub struct PageHasher {
    hasher: Sha256,
    pages: u64,
}

impl PageHasher {
    /// Adds one page; all-zero pages are skipped, exactly like holes.
    pub fn page(&mut self, index: u64, bytes: &[u8]) {
        if is_zero(bytes) {
            return;
        }
        self.stored_page(index, bytes);
    }

    /// Adds one page whatever it holds (layer files, where a stored zero page matters).
    pub fn stored_page(&mut self, index: u64, bytes: &[u8]) {
        self.hasher.update(index.to_le_bytes());
        self.hasher.update(bytes);
        self.pages += 1;
    }

    /// Non-zero pages seen so far.
    pub fn pages(&self) -> u64 {
        self.pages
    }

    pub fn finish(self) -> String {
        hex(&self.hasher.finalize())
    }
}

pub fn is_zero(bytes: &[u8]) -> bool {
    // Word-wise: this runs over every page a snapshot writes.
    let words = bytes.chunks_exact(8);
    let rest = words.remainder();
    words
        .map(|w| u64::from_ne_bytes(w.try_into().unwrap_or([1; 8])))
        .all(|w| w == 0)
        && rest.iter().all(|b| *b == 0)
}

/// Page digest of a whole file, reading only its data extents. Returns the digest and the
/// number of non-zero pages.
pub fn file_digest(file: &File) -> io::Result<(String, u64)> {
    let mut hasher = PageHasher::default();
    let mut buf = vec![0u8; CHUNK];
    for (offset, len) in data_extents(file)? {
        walk(file, offset, len, &mut buf, |index, page| {
            hasher.page(index, page);
            Ok(())
        })?;
    }
    let pages = hasher.pages();
    Ok((hasher.finish(), pages))
}

/// For a chain of memory files (base first), the file each page's content comes from: the
/// topmost one holding data there. Only indices are kept, never page contents.
pub fn owners(files: &[File]) -> io::Result<std::collections::BTreeMap<u64, usize>> {
    let mut owner = std::collections::BTreeMap::new();
    for (layer, file) in files.iter().enumerate() {
        for (offset, len) in data_extents(file)? {
            for index in offset / PAGE_SIZE..(offset + len).div_ceil(PAGE_SIZE) {
                owner.insert(index, layer);
            }
        }
    }
    Ok(owner)
}

/// Layer digest of a file: every page of its data extents, zero pages included.
pub fn layer_digest(file: &File) -> io::Result<(String, u64)> {
    let mut hasher = PageHasher::default();
    let mut buf = vec![0u8; CHUNK];
    for (offset, len) in data_extents(file)? {
        walk(file, offset, len, &mut buf, |index, page| {
            hasher.stored_page(index, page);
            Ok(())
        })?;
    }
    let pages = hasher.pages();
    Ok((hasher.finish(), pages))
}

/// Makes the empty `dst` share `src`'s blocks (a reflink: the filesystem copies a block only
/// when one of them writes it), where the filesystem can (XFS, btrfs, bcachefs; both files on
/// it). Ok(false), with `dst` untouched, where it cannot.
pub fn reflink(src: &File, dst: &File) -> io::Result<bool> {
    use rustix::io::Errno;
    match rustix::fs::ioctl_ficlone(dst, src) {
        Ok(()) => Ok(true),
        // No reflinks on this filesystem, or not between these two files.
        Err(Errno::OPNOTSUPP | Errno::XDEV | Errno::INVAL | Errno::NOTTY | Errno::NOSYS) => {
            Ok(false)
        }
        Err(e) => Err(e.into()),
    }
}

/// Copies the non-zero pages of `src` to the same offsets of `dst` (sized to `src`'s
/// length, holes elsewhere), returning the page digest and page count. A reflink where the
/// filesystem has them (the pages are then read for the digest, not written).
pub fn copy_sparse(src: &File, dst: &File) -> io::Result<(String, u64)> {
    if reflink(src, dst)? {
        return file_digest(src);
    }
    dst.set_len(src.metadata()?.len())?;
    let mut hasher = PageHasher::default();
    let mut buf = vec![0u8; CHUNK];
    for (offset, extent) in data_extents(src)? {
        walk(src, offset, extent, &mut buf, |index, page| {
            if is_zero(page) {
                return Ok(());
            }
            hasher.page(index, page);
            dst.write_all_at(page, index * PAGE_SIZE)
        })?;
    }
    let pages = hasher.pages();
    Ok((hasher.finish(), pages))
}

/// Copies `src` into the empty `dst` byte for byte where `src` holds data, leaving its holes
/// holes. Unlike [`copy_sparse`] it keeps stored pages of zeros, which in a layer mean "zero,
/// not as in the base".
pub fn copy_extents(src: &File, dst: &File) -> io::Result<()> {
    if reflink(src, dst)? {
        return Ok(());
    }
    dst.set_len(src.metadata()?.len())?;
    overlay_extents(src, dst)
}

/// Writes the data extents of `src` over `dst` at the same offsets (never a reflink: what
/// `dst` holds elsewhere stays).
pub fn overlay_extents(src: &File, dst: &File) -> io::Result<()> {
    let len = src.metadata()?.len();
    let mut buf = vec![0u8; CHUNK];
    for (offset, extent) in data_extents(src)? {
        let end = (offset + extent).min(len);
        let mut at = offset;
        while at < end {
            let n = ((end - at) as usize).min(CHUNK);
            src.read_exact_at(&mut buf[..n], at)?;
            dst.write_all_at(&buf[..n], at)?;
            at += n as u64;
        }
    }
    Ok(())
}

/// Calls `f(page index, page bytes)` for each page in `[offset, offset + len)`.
fn walk(
    file: &File,
    offset: u64,
    len: u64,
    buf: &mut [u8],
    mut f: impl FnMut(u64, &[u8]) -> io::Result<()>,
) -> io::Result<()> {
    let end = offset + len;
    let mut at = offset;
    while at < end {
        let want = ((end - at) as usize).min(buf.len());
        let got = file.read_at(&mut buf[..want], at)?;
        if got == 0 {
            break;
        }
        for (i, page) in buf[..got].chunks(PAGE_SIZE as usize).enumerate() {
            f(at / PAGE_SIZE + i as u64, page)?;
        }
        at += got as u64;
    }
    Ok(())
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An XFS filesystem (reflinks on) on a loop device, mounted at a temporary directory
    /// until dropped.
    struct Xfs {
        dir: tempfile::TempDir,
        _image: tempfile::TempDir,
    }

    impl Xfs {
        /// `Err(reason)` where one cannot be made here (it needs root and xfsprogs).
        fn mount() -> Result<Self, String> {
            if !nix::unistd::geteuid().is_root() {
                return Err("mounting a loop device needs root".into());
            }
            let image = tempfile::tempdir().map_err(|e| e.to_string())?;
            let file = image.path().join("xfs.img");
            File::create(&file)
                .and_then(|f| f.set_len(320 << 20))
                .map_err(|e| e.to_string())?;
            let run = |program: &str, args: &[&std::ffi::OsStr]| -> Result<(), String> {
                let out = std::process::Command::new(program)
                    .args(args)
                    .output()
                    .map_err(|e| format!("{program}: {e}"))?;
                match out.status.success() {
                    true => Ok(()),
                    false => Err(format!(
                        "{program}: {}",
                        String::from_utf8_lossy(&out.stderr).trim()
                    )),
                }
            };
            run(
                "mkfs.xfs",
                &[
                    "-q".as_ref(),
                    "-m".as_ref(),
                    "reflink=1".as_ref(),
                    file.as_os_str(),
                ],
            )?;
            let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
            run(
                "mount",
                &[
                    "-o".as_ref(),
                    "loop".as_ref(),
                    file.as_os_str(),
                    dir.path().as_os_str(),
                ],
            )?;
            Ok(Self { dir, _image: image })
        }
    }

    impl Drop for Xfs {
        fn drop(&mut self) {
            // Detaches the loop device too (mount -o loop set it to autoclear).
            let _ = std::process::Command::new("umount")
                .arg(self.dir.path())
                .status();
        }
    }

    fn rw(path: &std::path::Path) -> File {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)
            .unwrap()
    }

    #[test]
    fn copies_are_reflinks_where_the_filesystem_has_them() {
        let xfs = match Xfs::mount() {
            Ok(xfs) => xfs,
            Err(reason) => {
                eprintln!("SKIPPED: no XFS to reflink on ({reason})");
                return;
            }
        };
        let at = |name: &str| xfs.dir.path().join(name);
        let src = rw(&at("src"));
        src.set_len(64 << 20).unwrap();
        src.write_all_at(&[7u8; 8192], 4096 * 10).unwrap();
        src.write_all_at(&[9u8; 4096], 32 << 20).unwrap();
        src.sync_all().unwrap();
        let want = file_digest(&src).unwrap();

        let copy = rw(&at("copy"));
        assert_eq!(copy_sparse(&src, &copy).unwrap(), want);
        assert_eq!(file_digest(&copy).unwrap(), want);
        let clone = rw(&at("clone"));
        assert!(
            reflink(&src, &clone).unwrap(),
            "XFS made with reflink=1 reflinks"
        );
        copy_extents(&src, &rw(&at("extents"))).unwrap();
        assert_eq!(
            file_digest(&File::open(at("extents")).unwrap()).unwrap(),
            want
        );
        // The clone is a copy: writing it leaves the source alone.
        clone.write_all_at(&[1u8; 4096], 4096 * 10).unwrap();
        assert_eq!(file_digest(&src).unwrap(), want);
        assert_ne!(file_digest(&clone).unwrap(), want);

        // Across filesystems (or on one without reflinks) it is an ordinary copy.
        let elsewhere = tempfile::tempfile().unwrap();
        assert!(!reflink(&src, &elsewhere).unwrap());
        assert_eq!(copy_sparse(&src, &elsewhere).unwrap(), want);
    }

    #[test]
    fn extents_skip_holes_and_digest_ignores_how_zeros_are_stored() {
        let sparse = tempfile::tempfile().unwrap();
        sparse.set_len(64 << 20).unwrap();
        sparse.write_all_at(&[7u8; 4096], 4096 * 10).unwrap();
        sparse.write_all_at(&[9u8; 100], 32 << 20).unwrap();
        let extents = data_extents(&sparse).unwrap();
        let covered: u64 = extents.iter().map(|e| e.1).sum();
        assert!(
            covered < 4 << 20,
            "only written blocks are data: {extents:?}"
        );
        assert!(extents.iter().any(|(o, l)| *o <= 40960 && o + l >= 45056));

        // The same contents with the zero pages written out: same digest.
        let dense = tempfile::tempfile().unwrap();
        dense.set_len(64 << 20).unwrap();
        dense.write_all_at(&vec![0u8; 1 << 20], 0).unwrap();
        dense.write_all_at(&[7u8; 4096], 4096 * 10).unwrap();
        dense.write_all_at(&[9u8; 100], 32 << 20).unwrap();
        let (a, pages_a) = file_digest(&sparse).unwrap();
        let (b, pages_b) = file_digest(&dense).unwrap();
        assert_eq!(a, b);
        assert_eq!((pages_a, pages_b), (2, 2));

        // Moving a page changes the digest (its index is hashed).
        let moved = tempfile::tempfile().unwrap();
        moved.set_len(64 << 20).unwrap();
        moved.write_all_at(&[7u8; 4096], 4096 * 11).unwrap();
        moved.write_all_at(&[9u8; 100], 32 << 20).unwrap();
        assert_ne!(file_digest(&moved).unwrap().0, a);
    }

    #[test]
    fn sparse_copy_keeps_contents_digest_and_holes() {
        let src = tempfile::tempfile().unwrap();
        src.set_len(16 << 20).unwrap();
        src.write_all_at(&vec![0u8; 8 << 20], 0).unwrap();
        src.write_all_at(&[5u8; 8192], 1 << 20).unwrap();
        let dst = tempfile::tempfile().unwrap();
        let (digest, pages) = copy_sparse(&src, &dst).unwrap();
        assert_eq!(pages, 2);
        assert_eq!(digest, file_digest(&src).unwrap().0);
        assert_eq!(dst.metadata().unwrap().len(), 16 << 20);
        let mut page = [0u8; 4096];
        dst.read_exact_at(&mut page, (1 << 20) + 4096).unwrap();
        assert_eq!(page, [5u8; 4096]);
        let covered: u64 = data_extents(&dst).unwrap().iter().map(|e| e.1).sum();
        assert!(
            covered <= 1 << 20,
            "the zeros written in the source stay holes"
        );
        assert!(is_zero(&[0u8; 4096]) && !is_zero(&[0, 0, 0, 1]));
    }

    #[test]
    fn extent_copy_keeps_stored_zero_pages_and_holes() {
        let src = tempfile::tempfile().unwrap();
        src.set_len((16 << 20) + 100).unwrap();
        src.write_all_at(&[0u8; 4096], 2 << 20).unwrap();
        src.write_all_at(&[7u8; 100], 16 << 20).unwrap();
        let dst = tempfile::tempfile().unwrap();
        copy_extents(&src, &dst).unwrap();
        assert_eq!(dst.metadata().unwrap().len(), (16 << 20) + 100);
        assert_eq!(layer_digest(&dst).unwrap(), layer_digest(&src).unwrap());
        let mut tail = [0u8; 100];
        dst.read_exact_at(&mut tail, 16 << 20).unwrap();
        assert_eq!(tail, [7u8; 100]);
        let covered: u64 = data_extents(&dst).unwrap().iter().map(|e| e.1).sum();
        assert!(
            covered <= 2 * 4096,
            "holes stay holes ({covered} bytes of data)"
        );
    }
}
