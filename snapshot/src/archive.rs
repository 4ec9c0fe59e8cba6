//! Portable snapshot archives: one zstd stream a snapshot can travel in to another node.
//!
//! Layout inside the zstd stream, all integers little-endian:
//! `b"AGVMSNAP"`, u32 archive version, then per file `u16 name length, name, u64 size,
//! (u64 offset, u64 length, bytes)*` closed by an extent of length 0, and after the last
//! file a zero name length. Only non-zero pages of guest memory are stored. A layered snapshot is exported flattened (its
//! bases composed in), so an archive never depends on anything outside itself.
//!
//! Import trusts nothing: names are checked against the manifest (no paths), every extent
//! against its file's size, sizes against the manifest, and every digest is recomputed
//! before the snapshot is accepted.

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
/// zstd level: fast enough to keep up with a disk, still shrinks guest RAM well.
const ZSTD_LEVEL: i32 = 3;

fn archive_err(what: impl Into<String>) -> SnapshotError {
    SnapshotError::Archive(what.into())
}

fn io_err(e: io::Error) -> SnapshotError {
    archive_err(e.to_string())
}

/// Writes `snapshot` (with its bases composed in) as an archive to `out`.
pub fn export(snapshot: &Snapshot, out: impl Write) -> Result<(), SnapshotError> {
    let chain = snapshot.chain()?;
    let mut z = zstd::Encoder::new(BufWriter::new(out), ZSTD_LEVEL).map_err(io_err)?;
    z.write_all(MAGIC).map_err(io_err)?;
    z.write_all(&ARCHIVE_VERSION.to_le_bytes())
        .map_err(io_err)?;
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
    let json = manifest.to_json();
    write_header(&mut z, MANIFEST_FILE, json.len() as u64)?;
    write_extent(&mut z, 0, &json)?;
    write_extent(&mut z, 0, &[])?;
    z.write_all(&0u16.to_le_bytes()).map_err(io_err)?;
    z.finish().and_then(|mut w| w.flush()).map_err(io_err)
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

/// Unpacks an archive into `dir` (existing, without a snapshot) and verifies it.
pub fn import(input: impl Read, dir: &Path) -> Result<Snapshot, SnapshotError> {
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
            buf.resize(len as usize, 0);
            read_exact(&mut z, &mut buf)?;
            file.write_all_at(&buf, offset).map_err(io_err)?;
        }
        written.push((name, size));
    }
    let manifest_bytes = manifest_bytes.ok_or_else(|| archive_err("no manifest"))?;
    let manifest = Manifest::from_json(&manifest_bytes)?;
    if manifest.memory.base.is_some() {
        return Err(archive_err("an archive must not depend on a base snapshot"));
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
        let path = dir.join(name);
        let found = match entry.digest {
            DigestKind::Bytes => sha256_hex(&std::fs::read(&path).map_err(io_err)?),
            DigestKind::Pages => {
                pages::file_digest(&File::open(&path).map_err(io_err)?)
                    .map_err(io_err)?
                    .0
            }
            // Archives are flattened: layer files never travel in them.
            DigestKind::LayerPages => {
                return Err(archive_err(format!(
                    "{name} is a layer; archives hold none"
                )));
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
            base: None,
        },
    )?;
    Snapshot::open(dir)
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

    fn snapshot(dir: &Path, pages: &[(u64, u8)], base: Option<&Snapshot>) -> Snapshot {
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
        let digest = pages::file_digest(&mem).unwrap().0;
        w.add_pages_file(MEMORY_FILE, digest).unwrap();
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
        let imported = import(&archive[..], out.path()).unwrap();
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
    fn corrupt_or_hostile_archives_are_refused_and_leave_nothing_trusted() {
        let dir = tempfile::tempdir().unwrap();
        let snap = snapshot(dir.path(), &[(1, 1)], None);
        let mut good = Vec::new();
        export(&snap, &mut good).unwrap();
        let raw = zstd::decode_all(&good[..]).unwrap();

        // Truncated.
        let out = tempfile::tempdir().unwrap();
        let cut = zstd::encode_all(&raw[..raw.len() - 10], 1).unwrap();
        assert!(import(&cut[..], out.path()).is_err());
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
            import(&flipped[..], out.path()),
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
        assert!(import(&evil[..], out.path()).is_err());
        assert!(!out.path().parent().unwrap().join("escape").exists());
        // Not an archive at all.
        let out = tempfile::tempdir().unwrap();
        assert!(import(&b"hello"[..], out.path()).is_err());
    }
}
