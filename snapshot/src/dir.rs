//! A snapshot directory: writing one (files first, manifest last, so a directory with a
//! manifest is complete) and opening one with its digests checked.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::SnapshotError;
use crate::manifest::{
    BaseRef, DigestKind, FORMAT_VERSION, FileEntry, FileStamp, HostIdentity, MANIFEST_FILE,
    Manifest, MemoryLayout,
};
use crate::pages;

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> SnapshotError + '_ {
    move |source| SnapshotError::Io {
        path: path.display().to_string(),
        source,
    }
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    pages::hex(&Sha256::digest(bytes))
}

/// The largest manifest read: one lists a handful of files.
pub const MAX_MANIFEST: u64 = 1 << 20;

/// The bytes of the regular file at `path`, at most `max` of them: opened without following
/// a symlink and without blocking on a FIFO, refused if it is anything but a regular file.
pub fn read_regular(path: &Path, max: u64) -> Result<Vec<u8>, SnapshotError> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc_flags::NOFOLLOW_NONBLOCK)
        .open(path)
        .map_err(io(path))?;
    let meta = file.metadata().map_err(io(path))?;
    if !meta.is_file() || meta.len() > max {
        return Err(SnapshotError::Manifest(format!(
            "{} is not a regular file of at most {max} bytes",
            path.display()
        )));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    file.take(max).read_to_end(&mut bytes).map_err(io(path))?;
    Ok(bytes)
}

/// `O_NOFOLLOW | O_NONBLOCK`, for files a VMM could have replaced.
pub(crate) mod libc_flags {
    pub const NOFOLLOW_NONBLOCK: i32 =
        (rustix::fs::OFlags::NOFOLLOW.bits() | rustix::fs::OFlags::NONBLOCK.bits()) as i32;
}

/// Writes a snapshot into an existing, empty-of-snapshot directory.
pub struct SnapshotWriter {
    dir: PathBuf,
    files: BTreeMap<String, (DigestKind, String)>,
    durable: bool,
}

impl SnapshotWriter {
    /// `durable` fsyncs every file and the directory before the manifest appears (suspend to
    /// disk); without it a power loss may lose the snapshot (fine for fork bases in tmpfs).
    pub fn create(dir: &Path, durable: bool) -> Result<Self, SnapshotError> {
        let meta = std::fs::metadata(dir).map_err(io(dir))?;
        if !meta.is_dir() {
            return Err(SnapshotError::NotADirectory(dir.display().to_string()));
        }
        if dir.join(MANIFEST_FILE).exists() {
            return Err(SnapshotError::Exists(dir.display().to_string()));
        }
        Ok(Self {
            dir: dir.to_owned(),
            files: BTreeMap::new(),
            durable,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Writes a small file in one go and records its byte digest.
    pub fn write_file(&mut self, name: &str, bytes: &[u8]) -> Result<(), SnapshotError> {
        let path = self.dir.join(name);
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(io(&path))?;
        file.write_all(bytes).map_err(io(&path))?;
        if self.durable {
            file.sync_all().map_err(io(&path))?;
        }
        self.files
            .insert(name.to_owned(), (DigestKind::Bytes, sha256_hex(bytes)));
        Ok(())
    }

    /// Records a file already in the directory whose digest the caller computed.
    pub fn record(&mut self, name: &str, kind: DigestKind, sha256: String) {
        self.files.insert(name.to_owned(), (kind, sha256));
    }

    /// Records a file the caller wrote itself (guest memory) with its page digest.
    pub fn add_pages_file(&mut self, name: &str, page_digest: String) -> Result<(), SnapshotError> {
        self.add_memory_file(name, DigestKind::Pages, page_digest)
    }

    /// Records a memory file the caller wrote itself, with its digest of `kind`.
    pub fn add_memory_file(
        &mut self,
        name: &str,
        kind: DigestKind,
        digest: String,
    ) -> Result<(), SnapshotError> {
        let path = self.dir.join(name);
        if self.durable {
            File::open(&path)
                .and_then(|f| f.sync_all())
                .map_err(io(&path))?;
        }
        self.files.insert(name.to_owned(), (kind, digest));
        Ok(())
    }

    /// Writes the manifest, which makes the snapshot complete.
    pub fn finish(
        self,
        host: HostIdentity,
        vmm_version: &str,
        memory: MemoryLayout,
    ) -> Result<Manifest, SnapshotError> {
        let mut files = BTreeMap::new();
        for (name, (digest, sha256)) in self.files {
            let path = self.dir.join(&name);
            let meta = std::fs::metadata(&path).map_err(io(&path))?;
            files.insert(
                name,
                FileEntry {
                    size: meta.len(),
                    digest,
                    sha256,
                    stamp: Some(FileStamp::of(&meta)),
                },
            );
        }
        let manifest = Manifest {
            format_version: FORMAT_VERSION,
            created_unix_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0),
            vmm_version: vmm_version.to_owned(),
            host,
            files,
            memory,
        };
        // Written under a temporary name and renamed: a manifest is either whole or absent.
        let tmp = self.dir.join(format!(".{MANIFEST_FILE}.tmp"));
        let mut file = File::create(&tmp).map_err(io(&tmp))?;
        file.write_all(&manifest.to_json()).map_err(io(&tmp))?;
        if self.durable {
            file.sync_all().map_err(io(&tmp))?;
        }
        let path = self.dir.join(MANIFEST_FILE);
        std::fs::rename(&tmp, &path).map_err(io(&path))?;
        if self.durable {
            File::open(&self.dir)
                .and_then(|d| d.sync_all())
                .map_err(io(&self.dir))?;
        }
        Ok(manifest)
    }
}

/// An opened snapshot directory.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub dir: PathBuf,
    pub manifest: Manifest,
    /// SHA-256 of manifest.json as stored, which layered snapshots record for their base.
    pub manifest_sha256: String,
}

impl Snapshot {
    /// Reads the manifest (strictly). Digests are checked by [`Snapshot::verify`]. A VMM
    /// wrote it: it is read only as a regular file (never through a symlink, never a FIFO or
    /// a device) of at most [`MAX_MANIFEST`] bytes.
    pub fn open(dir: &Path) -> Result<Self, SnapshotError> {
        let path = dir.join(MANIFEST_FILE);
        let bytes = read_regular(&path, MAX_MANIFEST)?;
        let manifest = Manifest::from_json(&bytes)?;
        let dir = std::fs::canonicalize(dir).map_err(io(dir))?;
        Ok(Self {
            dir,
            manifest,
            manifest_sha256: sha256_hex(&bytes),
        })
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// How a layer taken on top of this snapshot refers to it.
    pub fn base_ref(&self) -> BaseRef {
        BaseRef {
            dir: self.dir.clone(),
            manifest_sha256: self.manifest_sha256.clone(),
            content_sha256: Some(self.content_sha256()),
        }
    }

    /// SHA-256 of what this snapshot holds: every file's name, size, digest kind and
    /// digest, and the memory's size (not its stamps, nor what it is layered on).
    pub fn content_sha256(&self) -> String {
        let mut hasher = sha2::Sha256::new();
        use sha2::Digest;
        hasher.update(self.manifest.memory.size.to_le_bytes());
        for (name, entry) in &self.manifest.files {
            hasher.update((name.len() as u64).to_le_bytes());
            hasher.update(name.as_bytes());
            hasher.update(entry.size.to_le_bytes());
            hasher.update(format!("{:?}", entry.digest).as_bytes());
            hasher.update(entry.sha256.as_bytes());
        }
        crate::pages::hex(&hasher.finalize())
    }

    /// Whether `base`, recorded by a layer, still names this snapshot as it was.
    pub fn is_base_of(&self, base: &BaseRef) -> bool {
        self.dir == base.dir
            && match &base.content_sha256 {
                Some(content) => *content == self.content_sha256(),
                None => self.manifest_sha256 == base.manifest_sha256,
            }
    }

    /// Refuses a snapshot from an incompatible host.
    pub fn check_host(&self, here: &HostIdentity) -> Result<(), SnapshotError> {
        match self.manifest.host.incompatibility(here) {
            Some(why) => Err(SnapshotError::Incompatible(why)),
            None => Ok(()),
        }
    }

    /// Checks every file against the manifest: present, the recorded size, the recorded
    /// digest. A file whose identity (inode, size, times) is unchanged since the digest was
    /// taken is trusted without rehashing: any write to it changes its ctime.
    pub fn verify(&self) -> Result<(), SnapshotError> {
        for (name, entry) in &self.manifest.files {
            let path = self.dir.join(name);
            let meta = std::fs::metadata(&path).map_err(|e| match e.kind() {
                std::io::ErrorKind::NotFound => SnapshotError::MissingFile(name.clone()),
                _ => io(&path)(e),
            })?;
            if meta.len() != entry.size {
                return Err(SnapshotError::SizeMismatch {
                    file: name.clone(),
                    expected: entry.size,
                    found: meta.len(),
                });
            }
            if entry.stamp == Some(FileStamp::of(&meta)) {
                continue;
            }
            let found = match entry.digest {
                DigestKind::Bytes => sha256_hex(&std::fs::read(&path).map_err(io(&path))?),
                DigestKind::Pages => {
                    let file = File::open(&path).map_err(io(&path))?;
                    pages::file_digest(&file).map_err(io(&path))?.0
                }
                DigestKind::LayerPages => {
                    let file = File::open(&path).map_err(io(&path))?;
                    pages::layer_digest(&file).map_err(io(&path))?.0
                }
            };
            if found != entry.sha256 {
                return Err(SnapshotError::DigestMismatch {
                    file: name.clone(),
                    expected: entry.sha256.clone(),
                    found,
                });
            }
        }
        Ok(())
    }

    /// This snapshot and the bases under it, base first, each verified and each base matching
    /// the manifest digest its child recorded.
    pub fn chain(&self) -> Result<Vec<Snapshot>, SnapshotError> {
        let mut chain = vec![self.clone()];
        while let Some(base) = &chain[chain.len() - 1].manifest.memory.base {
            if chain.len() > MAX_CHAIN {
                return Err(SnapshotError::Manifest(format!(
                    "more than {MAX_CHAIN} layered bases"
                )));
            }
            let opened = Snapshot::open(&base.dir).map_err(|e| SnapshotError::Base {
                dir: base.dir.display().to_string(),
                reason: e.to_string(),
            })?;
            if !opened.is_base_of(base) {
                return Err(SnapshotError::Base {
                    dir: base.dir.display().to_string(),
                    reason: "its manifest changed since the layer on top was taken".into(),
                });
            }
            chain.push(opened);
        }
        for snapshot in &chain {
            snapshot.verify()?;
            if snapshot.manifest.memory.size != self.manifest.memory.size {
                return Err(SnapshotError::Base {
                    dir: snapshot.dir.display().to_string(),
                    reason: "its guest memory size differs".into(),
                });
            }
        }
        chain.reverse();
        Ok(chain)
    }

    pub fn read(&self, name: &str) -> Result<Vec<u8>, SnapshotError> {
        let path = self.dir.join(name);
        if !self.manifest.files.contains_key(name) {
            return Err(SnapshotError::MissingFile(name.to_owned()));
        }
        std::fs::read(&path).map_err(io(&path))
    }
}

/// Deeper layering than this is refused (each level is a restore-time mapping pass).
pub const MAX_CHAIN: usize = 64;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::{CONFIG_FILE, MEMORY_FILE, STATE_FILE};
    use std::os::unix::fs::FileExt;

    fn host() -> HostIdentity {
        HostIdentity::current("PVM")
    }

    fn write_snapshot(dir: &Path, base: Option<&Snapshot>) -> Snapshot {
        let mut w = SnapshotWriter::create(dir, false).unwrap();
        w.write_file(CONFIG_FILE, b"{\"config\":1}").unwrap();
        w.write_file(STATE_FILE, b"{\"state\":1}").unwrap();
        let mem = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(dir.join(MEMORY_FILE))
            .unwrap();
        mem.set_len(1 << 20).unwrap();
        mem.write_all_at(&[0xab; 4096], 8192).unwrap();
        let (digest, _) = pages::file_digest(&mem).unwrap();
        w.add_pages_file(MEMORY_FILE, digest).unwrap();
        w.finish(
            host(),
            "test",
            MemoryLayout {
                size: 1 << 20,
                base: base.map(Snapshot::base_ref),
            },
        )
        .unwrap();
        Snapshot::open(dir).unwrap()
    }

    #[test]
    fn written_snapshots_verify_and_refuse_overwrite() {
        let dir = tempfile::tempdir().unwrap();
        let snap = write_snapshot(dir.path(), None);
        snap.verify().unwrap();
        assert_eq!(snap.read(CONFIG_FILE).unwrap(), b"{\"config\":1}");
        assert!(matches!(
            SnapshotWriter::create(dir.path(), false),
            Err(SnapshotError::Exists(_))
        ));
        assert!(matches!(
            snap.read("other"),
            Err(SnapshotError::MissingFile(_))
        ));
    }

    #[test]
    fn tampering_truncation_and_loss_are_caught() {
        let dir = tempfile::tempdir().unwrap();
        let snap = write_snapshot(dir.path(), None);
        // Same size, one byte changed: the stamp no longer matches, the digest does not.
        std::fs::write(dir.path().join(STATE_FILE), b"{\"state\":2}").unwrap();
        assert!(matches!(
            snap.verify(),
            Err(SnapshotError::DigestMismatch { ref file, .. }) if file == STATE_FILE
        ));
        let dir = tempfile::tempdir().unwrap();
        let snap = write_snapshot(dir.path(), None);
        let mem = OpenOptions::new()
            .write(true)
            .open(dir.path().join(MEMORY_FILE))
            .unwrap();
        mem.write_all_at(&[1], 100_000).unwrap();
        assert!(matches!(
            snap.verify(),
            Err(SnapshotError::DigestMismatch { ref file, .. }) if file == MEMORY_FILE
        ));
        mem.set_len(4096).unwrap();
        assert!(matches!(
            snap.verify(),
            Err(SnapshotError::SizeMismatch { .. })
        ));
        std::fs::remove_file(dir.path().join(MEMORY_FILE)).unwrap();
        assert!(matches!(snap.verify(), Err(SnapshotError::MissingFile(_))));
    }

    #[test]
    fn a_copied_snapshot_is_rehashed_and_still_verifies() {
        let dir = tempfile::tempdir().unwrap();
        write_snapshot(dir.path(), None);
        let copy = tempfile::tempdir().unwrap();
        for name in [CONFIG_FILE, STATE_FILE, MEMORY_FILE, MANIFEST_FILE] {
            std::fs::copy(dir.path().join(name), copy.path().join(name)).unwrap();
        }
        Snapshot::open(copy.path()).unwrap().verify().unwrap();
    }

    #[test]
    fn layered_chains_resolve_base_first_and_notice_a_changed_base() {
        let base_dir = tempfile::tempdir().unwrap();
        let base = write_snapshot(base_dir.path(), None);
        let top_dir = tempfile::tempdir().unwrap();
        let top = write_snapshot(top_dir.path(), Some(&base));
        let chain = top.chain().unwrap();
        assert_eq!(chain.len(), 2);
        assert_eq!(chain[0].dir, base.dir);
        // A manifest rewritten without changing what the base holds (as a merge below it
        // re-points it) still carries the layer.
        let manifest = base_dir.path().join(MANIFEST_FILE);
        let text = std::fs::read_to_string(&manifest).unwrap();
        let relabeled = text.replace("\"vmm_version\": \"test\"", "\"vmm_version\": \"other\"");
        assert_ne!(relabeled, text);
        std::fs::write(&manifest, &relabeled).unwrap();
        assert_eq!(top.chain().unwrap().len(), 2);
        // One that says the base holds something else: the layer must not be composed onto it.
        let changed = relabeled.replacen("\"sha256\": \"", "\"sha256\": \"0", 1);
        assert_ne!(changed, relabeled);
        std::fs::write(&manifest, changed).unwrap();
        assert!(matches!(top.chain(), Err(SnapshotError::Base { .. })));
    }
}
