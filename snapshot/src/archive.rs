//! Portable snapshot archives: one zstd stream a snapshot can travel in to another node.
//!
//! Layout inside the zstd stream, all integers little-endian:
//! `b"AGVMSNAP"`, u32 archive version, then per file `u16 name length, name, u64 size,
//! (u64 offset, u64 length, bytes)*` closed by an extent of length 0, and after the last
//! file a zero name length.
//!
//! Two kinds travel this way:
//! - a flattened archive (`export`): a layered snapshot's bases composed in, only the non-zero
//!   pages of guest memory stored, so it depends on nothing outside itself;
//! - a layer archive (`export_layer`): only what the layer itself stores, its stored zero
//!   pages included (they override the base), for a node that already holds the base. The
//!   base is named by whoever carries the archive, never inside it: a path means nothing on
//!   another node.
//!
//! Import trusts nothing: names are checked against the manifest (no paths), every extent
//! against its file's size, sizes against the manifest, and every digest is recomputed
//! before the snapshot is accepted. Whoever can write the store can still write a
//! self-consistent archive, so an archive is also *pinned*: export returns the digest of
//! the manifest it wrote (which names every file's digest), the carrier records it where
//! the store's writers cannot reach (the daemon's journal), and import refuses an archive
//! whose manifest digest is not the pinned one. An archive is a bomb until proven
//! otherwise: declared sizes and the bytes written are capped by [`ImportLimits`] before
//! anything is allocated or written.

use std::fs::{File, OpenOptions};
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::Path;

use crate::SnapshotError;
use crate::dir::{Snapshot, SnapshotWriter, sha256_hex};
use crate::manifest::{DigestKind, MANIFEST_FILE, MEMORY_FILE, Manifest, MemoryLayout};
use crate::pages::{self, PAGE_SIZE, PageHasher};

const MAGIC: &[u8; 8] = b"AGVMSNAP";
const ARCHIVE_VERSION: u32 = 1;
const MAX_NAME: usize = 255;
/// The largest file digested whole (config, device state): its readers read it whole.
const MAX_WHOLE_FILE: u64 = 16 << 20;
/// zstd level: fast enough to keep up with a disk, still shrinks guest RAM well.
const ZSTD_LEVEL: i32 = 3;

fn archive_err(what: impl Into<String>) -> SnapshotError {
    SnapshotError::Archive(what.into())
}

fn io_err(e: io::Error) -> SnapshotError {
    archive_err(e.to_string())
}

/// What an import may take: the pinned manifest digest, and caps on what the archive
/// declares and writes.
#[derive(Debug, Clone)]
pub struct ImportLimits {
    /// The digest export returned for this archive; `None` trusts the archive's own
    /// digests only (an archive the caller made itself).
    pub pin: Option<String>,
    /// The largest size any one file may declare.
    pub max_file_bytes: u64,
    /// The most bytes the import may write, all files together.
    pub max_written_bytes: u64,
}

impl ImportLimits {
    /// No pin and no caps beyond the format's own.
    pub fn unpinned() -> Self {
        Self {
            pin: None,
            max_file_bytes: u64::MAX,
            max_written_bytes: u64::MAX,
        }
    }
}

/// Writes `snapshot` (with its bases composed in) as an archive to `out`. Returns its pin:
/// the digest of the manifest it carries.
pub fn export(snapshot: &Snapshot, out: impl Write) -> Result<String, SnapshotError> {
    let chain = snapshot.chain()?;
    let mut z = begin(out)?;
    // The flattened manifest: no base, and the memory digest of the composition.
    let mut manifest = snapshot.manifest.clone();
    manifest.memory.base = None;
    for (name, entry) in &snapshot.manifest.files {
        write_header(&mut z, name, entry.size)?;
        if name == MEMORY_FILE {
            let digest = write_composed_memory(&mut z, &chain)?;
            if let Some(entry) = manifest.files.get_mut(MEMORY_FILE) {
                entry.digest = DigestKind::Pages;
                entry.sha256 = digest;
                entry.stamp = None;
            }
        } else {
            write_extent(&mut z, 0, &snapshot.read(name)?)?;
        }
        write_extent(&mut z, 0, &[])?;
    }
    end(z, &manifest)
}

/// Starts an archive on `out`: the zstd stream, the magic and the version.
fn begin<W: Write>(out: W) -> Result<zstd::Encoder<'static, BufWriter<W>>, SnapshotError> {
    let mut z = zstd::Encoder::new(BufWriter::new(out), ZSTD_LEVEL).map_err(io_err)?;
    z.write_all(MAGIC).map_err(io_err)?;
    z.write_all(&ARCHIVE_VERSION.to_le_bytes())
        .map_err(io_err)?;
    Ok(z)
}

/// Closes an archive: `manifest` last, then the end mark, flushed. Returns the archive's
/// pin.
fn end<W: Write>(
    mut z: zstd::Encoder<'static, BufWriter<W>>,
    manifest: &Manifest,
) -> Result<String, SnapshotError> {
    let json = manifest.to_json();
    write_header(&mut z, MANIFEST_FILE, json.len() as u64)?;
    write_extent(&mut z, 0, &json)?;
    write_extent(&mut z, 0, &[])?;
    z.write_all(&0u16.to_le_bytes()).map_err(io_err)?;
    z.finish().and_then(|mut w| w.flush()).map_err(io_err)?;
    Ok(sha256_hex(&json))
}

/// Writes layered `snapshot` as a layer archive: its own files as they are, guest memory as
/// exactly the pages its layer stores. Returns its pin.
pub fn export_layer(snapshot: &Snapshot, out: impl Write) -> Result<String, SnapshotError> {
    if snapshot.manifest.memory.base.is_none() {
        return Err(archive_err("a layer archive needs a layered snapshot"));
    }
    let mut z = begin(out)?;
    let mut manifest = snapshot.manifest.clone();
    manifest.memory.base = None;
    for (name, entry) in manifest.files.iter_mut() {
        write_header(&mut z, name, entry.size)?;
        if entry.digest == DigestKind::LayerPages {
            write_stored_pages(&mut z, &snapshot.path(name))?;
        } else {
            write_extent(&mut z, 0, &snapshot.read(name)?)?;
        }
        write_extent(&mut z, 0, &[])?;
        entry.stamp = None;
    }
    end(z, &manifest)
}

/// Streams every data extent of a layer's memory file, zero pages included, in pieces the
/// importer accepts.
fn write_stored_pages(z: &mut impl Write, path: &Path) -> Result<(), SnapshotError> {
    const PIECE: u64 = 1 << 20;
    let file = File::open(path).map_err(io_err)?;
    let len = file.metadata().map_err(io_err)?.len();
    let mut buf = vec![0u8; PIECE as usize];
    for (offset, extent) in pages::data_extents(&file).map_err(io_err)? {
        let end = (offset + extent).min(len);
        let mut at = offset;
        while at < end {
            let n = (end - at).min(PIECE) as usize;
            file.read_exact_at(&mut buf[..n], at).map_err(io_err)?;
            write_extent(z, at, &buf[..n])?;
            at += n as u64;
        }
    }
    Ok(())
}

fn write_header(z: &mut impl Write, name: &str, size: u64) -> Result<(), SnapshotError> {
    z.write_all(&(name.len() as u16).to_le_bytes())
        .map_err(io_err)?;
    z.write_all(name.as_bytes()).map_err(io_err)?;
    z.write_all(&size.to_le_bytes()).map_err(io_err)
}

fn write_extent(z: &mut impl Write, offset: u64, bytes: &[u8]) -> Result<(), SnapshotError> {
    z.write_all(&offset.to_le_bytes()).map_err(io_err)?;
    z.write_all(&(bytes.len() as u64).to_le_bytes())
        .map_err(io_err)?;
    z.write_all(bytes).map_err(io_err)
}

/// Streams the chain's guest memory composed (for every page, the topmost layer holding
/// it), non-zero pages only; returns the page digest of the result.
fn write_composed_memory(z: &mut impl Write, chain: &[Snapshot]) -> Result<String, SnapshotError> {
    let files = chain
        .iter()
        .filter(|s| s.manifest.files.contains_key(MEMORY_FILE))
        .map(|s| File::open(s.path(MEMORY_FILE)))
        .collect::<Result<Vec<_>, _>>()
        .map_err(io_err)?;
    let owner = pages::owners(&files).map_err(io_err)?;
    let mut hasher = PageHasher::default();
    let mut page = vec![0u8; PAGE_SIZE as usize];
    for (index, layer) in owner {
        let n = files[layer]
            .read_at(&mut page, index * PAGE_SIZE)
            .map_err(io_err)?;
        page[n..].fill(0);
        if pages::is_zero(&page) {
            continue;
        }
        hasher.page(index, &page);
        write_extent(z, index * PAGE_SIZE, &page)?;
    }
    Ok(hasher.finish())
}

/// Unpacks an archive into `dir` (existing, without a snapshot) and verifies it: a
/// flattened archive when `base` is `None`, else a layer archive, which becomes a snapshot
/// layered on `base`. Returns the snapshot and the archive's pin (its manifest's digest).
pub fn import(
    input: impl Read,
    dir: &Path,
    base: Option<&Snapshot>,
    limits: &ImportLimits,
) -> Result<(Snapshot, String), SnapshotError> {
    let mut z = zstd::Decoder::new(BufReader::new(input)).map_err(io_err)?;
    let mut magic = [0u8; 8];
    read_exact(&mut z, &mut magic)?;
    if &magic != MAGIC {
        return Err(archive_err("not an agentvm snapshot archive"));
    }
    let version = read_u32(&mut z)?;
    if version != ARCHIVE_VERSION {
        return Err(archive_err(format!(
            "archive version {version}, this build reads {ARCHIVE_VERSION}"
        )));
    }
    // The manifest comes last; files are written under their names, checked against it
    // once it is known.
    let mut written: Vec<(String, u64)> = Vec::new();
    let mut written_bytes = 0u64;
    let mut manifest_bytes = None;
    loop {
        let name_len = read_u16(&mut z)? as usize;
        if name_len == 0 {
            break;
        }
        if name_len > MAX_NAME {
            return Err(archive_err("file name too long"));
        }
        let mut name = vec![0u8; name_len];
        read_exact(&mut z, &mut name)?;
        let name = String::from_utf8(name).map_err(|_| archive_err("file name is not UTF-8"))?;
        if name.contains('/') || name.starts_with('.') || written.iter().any(|(n, _)| *n == name) {
            return Err(archive_err(format!("bad or repeated file name {name:?}")));
        }
        let size = read_u64(&mut z)?;
        if size > limits.max_file_bytes {
            return Err(archive_err(format!(
                "{name} declares {size} bytes, over the {} this import allows",
                limits.max_file_bytes
            )));
        }
        if name == MANIFEST_FILE {
            let (offset, len) = (read_u64(&mut z)?, read_u64(&mut z)?);
            if offset != 0 || len != size || size > 1 << 20 {
                return Err(archive_err("malformed manifest entry"));
            }
            let mut bytes = vec![0u8; len as usize];
            read_exact(&mut z, &mut bytes)?;
            if read_u64(&mut z)? != 0 || read_u64(&mut z)? != 0 {
                return Err(archive_err("malformed manifest entry"));
            }
            manifest_bytes = Some(bytes);
            continue;
        }
        let path = dir.join(&name);
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| archive_err(format!("{}: {e}", path.display())))?;
        file.set_len(size).map_err(io_err)?;
        let mut buf = Vec::new();
        loop {
            let (offset, len) = (read_u64(&mut z)?, read_u64(&mut z)?);
            if len == 0 {
                break;
            }
            if offset.checked_add(len).is_none_or(|end| end > size) || len > 64 << 20 {
                return Err(archive_err(format!("extent outside {name}")));
            }
            written_bytes = written_bytes.saturating_add(len);
            if written_bytes > limits.max_written_bytes {
                return Err(archive_err(format!(
                    "the archive writes more than the {} bytes this import allows",
                    limits.max_written_bytes
                )));
            }
            buf.resize(len as usize, 0);
            read_exact(&mut z, &mut buf)?;
            file.write_all_at(&buf, offset).map_err(io_err)?;
        }
        written.push((name, size));
    }
    let manifest_bytes = manifest_bytes.ok_or_else(|| archive_err("no manifest"))?;
    let pin = sha256_hex(&manifest_bytes);
    if let Some(expected) = &limits.pin
        && *expected != pin
    {
        return Err(archive_err(format!(
            "its manifest digest is {pin}, not the {expected} recorded when it was published: \
             the store's copy was replaced"
        )));
    }
    let manifest = Manifest::from_json(&manifest_bytes)?;
    if manifest.memory.size > limits.max_file_bytes {
        return Err(archive_err(format!(
            "its guest memory is {} bytes, over the {} this import allows",
            manifest.memory.size, limits.max_file_bytes
        )));
    }
    if manifest.memory.base.is_some() {
        return Err(archive_err("an archive must not name a base snapshot"));
    }
    let layered = manifest
        .files
        .values()
        .any(|entry| entry.digest == DigestKind::LayerPages);
    match base {
        Some(_) if !layered => {
            return Err(archive_err(
                "not a layer archive: it stores no memory layer",
            ));
        }
        Some(base) if base.manifest.memory.size != manifest.memory.size => {
            return Err(archive_err(format!(
                "the layer's guest memory is {} bytes, its base's {}",
                manifest.memory.size, base.manifest.memory.size
            )));
        }
        None if layered => {
            return Err(archive_err("a layer archive needs its base snapshot"));
        }
        _ => {}
    }
    for (name, size) in &written {
        match manifest.files.get(name) {
            Some(entry) if entry.size == *size => {}
            _ => {
                return Err(archive_err(format!(
                    "{name} is not what the manifest lists"
                )));
            }
        }
    }
    // Re-record digests as verified here (fresh stamps for the new files).
    let mut writer = SnapshotWriter::create(dir, true)?;
    for (name, entry) in &manifest.files {
        if !written.iter().any(|(n, _)| n == name) {
            return Err(SnapshotError::MissingFile(name.clone()));
        }
        if entry.digest == DigestKind::Bytes && entry.size > MAX_WHOLE_FILE {
            return Err(archive_err(format!(
                "{name} is {} bytes, over the {MAX_WHOLE_FILE} a file read whole may be",
                entry.size
            )));
        }
        let path = dir.join(name);
        let found = match entry.digest {
            DigestKind::Bytes => sha256_file(&path)?,
            DigestKind::Pages => {
                pages::file_digest(&File::open(&path).map_err(io_err)?)
                    .map_err(io_err)?
                    .0
            }
            DigestKind::LayerPages => {
                pages::layer_digest(&File::open(&path).map_err(io_err)?)
                    .map_err(io_err)?
                    .0
            }
        };
        if found != entry.sha256 {
            return Err(SnapshotError::DigestMismatch {
                file: name.clone(),
                expected: entry.sha256.clone(),
                found,
            });
        }
        writer.record(name, entry.digest, found);
    }
    writer.finish(
        manifest.host.clone(),
        &manifest.vmm_version,
        MemoryLayout {
            size: manifest.memory.size,
            base: base.map(Snapshot::base_ref),
        },
    )?;
    Ok((Snapshot::open(dir)?, pin))
}

/// The SHA-256 of the file at `path`, read in pieces (a file may be as large as its cap).
fn sha256_file(path: &Path) -> Result<String, SnapshotError> {
    use sha2::{Digest, Sha256};
    let mut file = File::open(path).map_err(io_err)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(io_err)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(pages::hex(&hasher.finalize()))
}

fn read_exact(z: &mut impl Read, buf: &mut [u8]) -> Result<(), SnapshotError> {
    z.read_exact(buf)
        .map_err(|e| archive_err(format!("truncated archive: {e}")))
}

fn read_u16(z: &mut impl Read) -> Result<u16, SnapshotError> {
    let mut b = [0u8; 2];
    read_exact(z, &mut b)?;
    Ok(u16::from_le_bytes(b))
}

fn read_u32(z: &mut impl Read) -> Result<u32, SnapshotError> {
    let mut b = [0u8; 4];
    read_exact(z, &mut b)?;
    Ok(u32::from_le_bytes(b))
}

fn read_u64(z: &mut impl Read) -> Result<u64, SnapshotError> {
    let mut b = [0u8; 8];
    read_exact(z, &mut b)?;
    Ok(u64::from_le_bytes(b))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::{CONFIG_FILE, HostIdentity, STATE_FILE};
    use std::fs::OpenOptions;

    /// A snapshot in `dir` whose memory stores `pages` (index, byte), layered on `base` if
    /// given; `digest` says how its memory is digested.
    fn written(
        dir: &Path,
        pages: &[(u64, u8)],
        base: Option<&Snapshot>,
        digest: DigestKind,
    ) -> Snapshot {
        let mut w = SnapshotWriter::create(dir, false).unwrap();
        w.write_file(CONFIG_FILE, b"{}").unwrap();
        w.write_file(STATE_FILE, b"{\"s\":1}").unwrap();
        let mem = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(dir.join(MEMORY_FILE))
            .unwrap();
        mem.set_len(8 << 20).unwrap();
        for (index, byte) in pages {
            mem.write_all_at(&[*byte; 4096], index * PAGE_SIZE).unwrap();
        }
        let sha = match digest {
            DigestKind::LayerPages => pages::layer_digest(&mem).unwrap().0,
            _ => pages::file_digest(&mem).unwrap().0,
        };
        w.add_memory_file(MEMORY_FILE, digest, sha).unwrap();
        w.finish(
            HostIdentity::current("PVM"),
            "t",
            MemoryLayout {
                size: 8 << 20,
                base: base.map(Snapshot::base_ref),
            },
        )
        .unwrap();
        Snapshot::open(dir).unwrap()
    }

    fn snapshot(dir: &Path, pages: &[(u64, u8)], base: Option<&Snapshot>) -> Snapshot {
        written(dir, pages, base, DigestKind::Pages)
    }

    /// An import that trusts the archive's own digests only (as its maker would).
    fn import(
        input: impl Read,
        dir: &Path,
        base: Option<&Snapshot>,
    ) -> Result<Snapshot, SnapshotError> {
        super::import(input, dir, base, &ImportLimits::unpinned()).map(|(snapshot, _)| snapshot)
    }

    /// A layer on `base` storing `pages` (a byte of 0 is a stored page of zeros).
    fn layer(dir: &Path, pages: &[(u64, u8)], base: &Snapshot) -> Snapshot {
        written(dir, pages, Some(base), DigestKind::LayerPages)
    }

    #[test]
    fn export_import_round_trip_flattens_layers() {
        let base_dir = tempfile::tempdir().unwrap();
        let base = snapshot(base_dir.path(), &[(1, 1), (2, 2), (3, 3)], None);
        let top_dir = tempfile::tempdir().unwrap();
        // The layer rewrites page 2 and zeroes page 3.
        let top = snapshot(top_dir.path(), &[(2, 22), (3, 0), (9, 9)], Some(&base));
        let mut archive = Vec::new();
        export(&top, &mut archive).unwrap();
        assert!(archive.len() < 64 << 10, "{} bytes", archive.len());
        let out = tempfile::tempdir().unwrap();
        let imported = import(&archive[..], out.path(), None).unwrap();
        assert!(imported.manifest.memory.base.is_none());
        imported.verify().unwrap();
        let mem = File::open(out.path().join(MEMORY_FILE)).unwrap();
        let mut page = [0u8; 4096];
        for (index, want) in [(1u64, 1u8), (2, 22), (3, 0), (9, 9), (4, 0)] {
            mem.read_exact_at(&mut page, index * PAGE_SIZE).unwrap();
            assert_eq!(page, [want; 4096], "page {index}");
        }
        assert_eq!(imported.read(STATE_FILE).unwrap(), b"{\"s\":1}");
    }

    #[test]
    fn a_layer_archive_carries_only_the_layer_and_lands_on_another_copy_of_its_base() {
        let base_dir = tempfile::tempdir().unwrap();
        let base = snapshot(base_dir.path(), &[(1, 1), (2, 2), (3, 3)], None);
        let top_dir = tempfile::tempdir().unwrap();
        let top = layer(top_dir.path(), &[(2, 22), (3, 0), (9, 9)], &base);
        // The receiving node's copy of the base came to it flattened, in another directory.
        let mut flat = Vec::new();
        export(&base, &mut flat).unwrap();
        let there = tempfile::tempdir().unwrap();
        let base_there = import(&flat[..], there.path(), None).unwrap();

        let mut archive = Vec::new();
        export_layer(&top, &mut archive).unwrap();
        let out = tempfile::tempdir().unwrap();
        let imported = import(&archive[..], out.path(), Some(&base_there)).unwrap();
        assert_eq!(imported.manifest.memory.base, Some(base_there.base_ref()));
        imported.verify().unwrap();
        // Exactly the layer's pages, its stored zero page kept as data.
        let mem = File::open(out.path().join(MEMORY_FILE)).unwrap();
        assert_eq!(
            pages::layer_digest(&mem).unwrap(),
            pages::layer_digest(&File::open(top.path(MEMORY_FILE)).unwrap()).unwrap()
        );
        assert_eq!(pages::layer_digest(&mem).unwrap().1, 3);
        // Composed, the copy reads as the original chain does.
        let mut composed_here = Vec::new();
        export(&top, &mut composed_here).unwrap();
        let mut composed_there = Vec::new();
        export(&imported, &mut composed_there).unwrap();
        let memory_of = |archive: &[u8]| {
            let out = tempfile::tempdir().unwrap();
            let flat = import(archive, out.path(), None).unwrap();
            pages::file_digest(&File::open(flat.path(MEMORY_FILE)).unwrap()).unwrap()
        };
        let here = memory_of(&composed_here);
        assert_eq!(here.1, 3, "pages 1, 2 and 9 hold data once composed");
        assert!(
            here == memory_of(&composed_there),
            "the compositions differ"
        );
        assert_eq!(imported.chain().unwrap().len(), 2);

        // A layer archive needs its base, a flattened one takes none, a flat snapshot has no
        // layer to send, and a base of another memory size is refused.
        let out = tempfile::tempdir().unwrap();
        let err = import(&archive[..], out.path(), None).unwrap_err();
        assert!(err.to_string().contains("needs its base"), "{err}");
        let out = tempfile::tempdir().unwrap();
        let err = import(&flat[..], out.path(), Some(&base_there)).unwrap_err();
        assert!(err.to_string().contains("not a layer archive"), "{err}");
        assert!(export_layer(&base, &mut Vec::new()).is_err());
        let mut smaller = base_there.clone();
        smaller.manifest.memory.size = 4 << 20;
        let out = tempfile::tempdir().unwrap();
        let err = import(&archive[..], out.path(), Some(&smaller)).unwrap_err();
        assert!(err.to_string().contains("its base's"), "{err}");
    }

    #[test]
    fn corrupt_or_hostile_archives_are_refused_and_leave_nothing_trusted() {
        let dir = tempfile::tempdir().unwrap();
        let snap = snapshot(dir.path(), &[(1, 1)], None);
        let mut good = Vec::new();
        export(&snap, &mut good).unwrap();
        let raw = zstd::decode_all(&good[..]).unwrap();

        // Truncated.
        let out = tempfile::tempdir().unwrap();
        let cut = zstd::encode_all(&raw[..raw.len() - 10], 1).unwrap();
        assert!(import(&cut[..], out.path(), None).is_err());
        // One payload byte flipped: the digest check catches it.
        let out = tempfile::tempdir().unwrap();
        let mut flipped = raw.clone();
        let at = flipped
            .windows(4096)
            .position(|w| w == [1u8; 4096])
            .unwrap();
        flipped[at + 100] ^= 0xff;
        let flipped = zstd::encode_all(&flipped[..], 1).unwrap();
        assert!(matches!(
            import(&flipped[..], out.path(), None),
            Err(SnapshotError::DigestMismatch { .. })
        ));
        // A path in a file name.
        let out = tempfile::tempdir().unwrap();
        let mut evil = Vec::new();
        evil.extend_from_slice(MAGIC);
        evil.extend_from_slice(&ARCHIVE_VERSION.to_le_bytes());
        let name = b"../escape";
        evil.extend_from_slice(&(name.len() as u16).to_le_bytes());
        evil.extend_from_slice(name);
        evil.extend_from_slice(&0u64.to_le_bytes());
        let evil = zstd::encode_all(&evil[..], 1).unwrap();
        assert!(import(&evil[..], out.path(), None).is_err());
        assert!(!out.path().parent().unwrap().join("escape").exists());
        // Not an archive at all.
        let out = tempfile::tempdir().unwrap();
        assert!(import(&b"hello"[..], out.path(), None).is_err());
    }

    /// A raw archive holding one file `name` of `size` bytes, written as `extents` of
    /// `len` zero bytes each, and no manifest.
    fn zero_bomb(name: &str, size: u64, extents: u64, len: u64) -> Vec<u8> {
        let mut raw = Vec::new();
        raw.extend_from_slice(MAGIC);
        raw.extend_from_slice(&ARCHIVE_VERSION.to_le_bytes());
        raw.extend_from_slice(&(name.len() as u16).to_le_bytes());
        raw.extend_from_slice(name.as_bytes());
        raw.extend_from_slice(&size.to_le_bytes());
        let zeros = vec![0u8; len as usize];
        for i in 0..extents {
            raw.extend_from_slice(&(i * len).to_le_bytes());
            raw.extend_from_slice(&len.to_le_bytes());
            raw.extend_from_slice(&zeros);
        }
        raw.extend_from_slice(&0u64.to_le_bytes());
        raw.extend_from_slice(&0u64.to_le_bytes());
        raw.extend_from_slice(&0u16.to_le_bytes());
        zstd::encode_all(&raw[..], 3).unwrap()
    }

    #[test]
    fn a_swapped_archive_fails_its_pin_and_a_bomb_stops_at_its_caps() {
        let dir_a = tempfile::tempdir().unwrap();
        let a = snapshot(dir_a.path(), &[(1, 1)], None);
        let dir_b = tempfile::tempdir().unwrap();
        let b = snapshot(dir_b.path(), &[(1, 2)], None);
        let (mut archive_a, mut archive_b) = (Vec::new(), Vec::new());
        let pin_a = export(&a, &mut archive_a).unwrap();
        let pin_b = export(&b, &mut archive_b).unwrap();
        assert_ne!(pin_a, pin_b);
        let pinned = |pin: &str| ImportLimits {
            pin: Some(pin.to_owned()),
            ..ImportLimits::unpinned()
        };
        // B is self-consistent (every digest its own manifest lists holds): only the pin
        // tells it is not the A that was published.
        let out = tempfile::tempdir().unwrap();
        let err = super::import(&archive_b[..], out.path(), None, &pinned(&pin_a)).unwrap_err();
        assert!(err.to_string().contains("was replaced"), "{err}");
        let out = tempfile::tempdir().unwrap();
        let (_, pin) = super::import(&archive_a[..], out.path(), None, &pinned(&pin_a)).unwrap();
        assert_eq!(pin, pin_a);

        // A declared size over the cap is refused before anything is allocated: a 3 GiB
        // file in a few bytes of archive.
        let capped = ImportLimits {
            pin: None,
            max_file_bytes: 1 << 20,
            max_written_bytes: 4 << 20,
        };
        let out = tempfile::tempdir().unwrap();
        let declared = zero_bomb(MEMORY_FILE, 3 << 30, 0, 0);
        let err = super::import(&declared[..], out.path(), None, &capped).unwrap_err();
        assert!(
            err.to_string().contains("declares 3221225472 bytes"),
            "{err}"
        );
        assert!(!out.path().join(MEMORY_FILE).exists());
        // Written bytes stop at theirs: 64 MiB of zeros in a small archive.
        let capped = ImportLimits {
            max_file_bytes: 64 << 20,
            ..capped
        };
        let written = zero_bomb(MEMORY_FILE, 64 << 20, 64, 1 << 20);
        assert!(written.len() < 64 << 10, "{} bytes", written.len());
        let out = tempfile::tempdir().unwrap();
        let err = super::import(&written[..], out.path(), None, &capped).unwrap_err();
        assert!(err.to_string().contains("writes more than"), "{err}");
        let on_disk = std::fs::metadata(out.path().join(MEMORY_FILE)).unwrap();
        use std::os::unix::fs::MetadataExt;
        assert!(
            on_disk.blocks() * 512 <= 5 << 20,
            "{} bytes",
            on_disk.blocks() * 512
        );
    }
}
