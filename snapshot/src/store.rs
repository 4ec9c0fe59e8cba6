//! Where snapshots live: a local directory now (object storage later, behind the same calls).
//!
//! `<root>/<id>/` holds a snapshot; `<root>/.refs/<id>/<holder>` marks a user of it (a VM
//! restored from it maps its memory file). A snapshot is not deleted while it has holders
//! or while another snapshot is layered on it: its memory file must outlive every VM and
//! every layer that depends on it. References are files, so they survive restarts of the
//! daemon that took them.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use crate::SnapshotError;
use crate::archive;
use crate::dir::Snapshot;

const REFS: &str = ".refs";
/// Taken (flock) by every acquire and delete, so a snapshot that one acquires is never
/// deleted under it: a restore pins its snapshot before reading a byte of it.
const REFS_LOCK: &str = ".refs/.lock";
/// Prefix of a copy being made into the store; renamed to its id once complete.
const INCOMING: &str = ".incoming-";
/// Prefix of a snapshot being deleted: renamed out of the store's view under the lock,
/// removed after it.
const DELETING: &str = ".deleting-";
/// `<root>/.pins/<id>`: the pins of the archive chain snapshot `id` was published or
/// fetched as (its own first, then its bases'), one per line. Written by the store's owner
/// only, so a layer published on `id` can name what it is layered on.
const PINS: &str = ".pins";
/// The most pins a record holds (one per archive of a chain).
const MAX_PINS: usize = MAX_CHAIN;
/// Deeper chains are not followed (and are not written: layers are flattened long before).
const MAX_CHAIN: usize = 64;

#[derive(Debug, Clone)]
pub struct LocalStore {
    root: PathBuf,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> SnapshotError + '_ {
    move |source| SnapshotError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Ids and holder names become path components: keep them to a safe alphabet.
fn check_name(kind: &str, name: &str) -> Result<(), SnapshotError> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(SnapshotError::InvalidName {
            kind: kind.to_owned(),
            name: name.to_owned(),
        })
    }
}

/// A VMM wrote what is copied: directories and regular files only, none reached through a
/// symlink (a link to a host file must not pull that file into the store).
fn copy_tree(from: &Path, to: &Path) -> Result<(), SnapshotError> {
    if !std::fs::symlink_metadata(from).map_err(io(from))?.is_dir() {
        return Err(not_plain(from));
    }
    std::fs::create_dir(to).map_err(io(to))?;
    for entry in std::fs::read_dir(from).map_err(io(from))? {
        let entry = entry.map_err(io(from))?;
        let (src, dst) = (entry.path(), to.join(entry.file_name()));
        let kind = entry.file_type().map_err(io(&src))?;
        if kind.is_dir() {
            copy_tree(&src, &dst)?;
        } else if kind.is_file() {
            // Holes stay holes: in a layer, a hole means "as in the base", and a byte of
            // zeros written there would hide the base's page.
            let source = open_regular(&src)?;
            let target = std::fs::File::create_new(&dst).map_err(io(&dst))?;
            let len = source.metadata().map_err(io(&src))?.len();
            target.set_len(len).map_err(io(&dst))?;
            crate::pages::overlay_extents(&source, &target).map_err(io(&src))?;
        } else {
            return Err(not_plain(&src));
        }
    }
    Ok(())
}

fn not_plain(path: &Path) -> SnapshotError {
    SnapshotError::Manifest(format!(
        "{} is neither a regular file nor a directory (a snapshot holds nothing else)",
        path.display()
    ))
}

/// Opens the regular file at `path` for reading, never through a symlink and never blocking
/// on a FIFO; anything else is refused.
fn open_regular(path: &Path) -> Result<std::fs::File, SnapshotError> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(crate::dir::libc_flags::NOFOLLOW_NONBLOCK)
        .open(path)
        .map_err(|_| not_plain(path))?;
    match file.metadata().map_err(io(path))?.is_file() {
        true => Ok(file),
        false => Err(not_plain(path)),
    }
}

/// Takes the directory a VMM wrote out of its hands, before a byte of it is read: it must
/// be a directory (not a symlink to one), and becomes this process's, mode 0700, so the VMM
/// (which may still hold a descriptor of it) can change nothing in it any more.
fn take_over(dir: &Path) -> Result<(), SnapshotError> {
    use rustix::fs::{Mode, OFlags};
    let fd = rustix::fs::open(
        dir,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|_| not_plain(dir))?;
    rustix::fs::fchown(
        &fd,
        Some(rustix::fs::Uid::from_raw(nix::unistd::geteuid().as_raw())),
        Some(rustix::fs::Gid::from_raw(nix::unistd::getegid().as_raw())),
    )
    .map_err(|e| io(dir)(e.into()))?;
    rustix::fs::fchmod(&fd, Mode::from_raw_mode(0o700)).map_err(|e| io(dir)(e.into()))
}

/// Copies the files of the snapshot in `from` into a new directory `to`, each synced; memory
/// files extent by extent, so holes stay holes.
fn copy_snapshot_files(from: &Path, to: &Path) -> Result<(), SnapshotError> {
    std::fs::create_dir(to).map_err(io(to))?;
    for entry in std::fs::read_dir(from).map_err(io(from))? {
        let entry = entry.map_err(io(from))?;
        let (src, dst) = (entry.path(), to.join(entry.file_name()));
        if !entry.file_type().map_err(io(&src))?.is_file() {
            continue;
        }
        let source = open_regular(&src)?;
        let target = std::fs::File::create(&dst).map_err(io(&dst))?;
        crate::pages::copy_extents(&source, &target).map_err(io(&src))?;
        target.sync_all().map_err(io(&dst))?;
    }
    sync_dir(to)
}

/// Syncs every file in `dir`, then the directory.
fn sync_files(dir: &Path) -> Result<(), SnapshotError> {
    for entry in std::fs::read_dir(dir).map_err(io(dir))? {
        let path = entry.map_err(io(dir))?.path();
        std::fs::File::open(&path)
            .and_then(|f| f.sync_all())
            .map_err(io(&path))?;
    }
    sync_dir(dir)
}

fn sync_dir(dir: &Path) -> Result<(), SnapshotError> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io(dir))
}

/// The same files with the same digests (stamps aside: a copy has other inodes).
fn same_contents(a: &Snapshot, b: &Snapshot) -> bool {
    a.manifest.memory == b.manifest.memory
        && a.manifest.files.len() == b.manifest.files.len()
        && a.manifest.files.iter().all(|(name, entry)| {
            b.manifest.files.get(name).is_some_and(|other| {
                other.size == entry.size
                    && other.digest == entry.digest
                    && other.sha256 == entry.sha256
            })
        })
}

/// Replaces `dir`'s manifest, synced, under a temporary name first: whole or not at all.
fn write_manifest(dir: &Path, manifest: &crate::Manifest) -> Result<(), SnapshotError> {
    let tmp = dir.join(format!(".{}.tmp", crate::manifest::MANIFEST_FILE));
    let mut file = std::fs::File::create(&tmp).map_err(io(&tmp))?;
    file.write_all(&manifest.to_json()).map_err(io(&tmp))?;
    file.sync_all().map_err(io(&tmp))?;
    let path = dir.join(crate::manifest::MANIFEST_FILE);
    std::fs::rename(&tmp, &path).map_err(io(&path))?;
    sync_dir(dir)
}

/// Writes `manifest` into `dir` (a snapshot being made), synced.
pub(crate) fn write_new_manifest(
    dir: &Path,
    manifest: &crate::Manifest,
) -> Result<(), SnapshotError> {
    write_manifest(dir, manifest)
}

/// Records every file's identity as it is now, sealed, in `dir`'s manifest: its digests were
/// taken (or checked) before sealing, which changed only the files' ctimes, so a VMM
/// restoring it need not rehash them (see `Snapshot::verify`). A directory without our
/// manifest is left alone.
fn restamp(dir: &Path) -> Result<(), SnapshotError> {
    use std::os::unix::fs::PermissionsExt;
    let mut manifest = match Snapshot::open(dir) {
        Ok(s) => s.manifest,
        Err(SnapshotError::Io { .. }) => return Ok(()),
        Err(e) => return Err(e),
    };
    for (name, entry) in manifest.files.iter_mut() {
        let path = dir.join(name);
        let meta = std::fs::metadata(&path).map_err(io(&path))?;
        entry.stamp = Some(crate::manifest::FileStamp::of(&meta));
    }
    write_manifest(dir, &manifest)?;
    let path = dir.join(crate::manifest::MANIFEST_FILE);
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o444)).map_err(io(&path))
}

/// Makes every file under `dir` read-only and owned by this process's user and group. Each
/// directory is taken before its entries are looked at; anything but a regular file or a
/// directory (a symlink a VMM planted to a host file) is refused.
fn seal(dir: &Path) -> Result<(), SnapshotError> {
    use std::os::unix::fs::PermissionsExt;
    let (uid, gid) = (
        nix::unistd::geteuid().as_raw(),
        nix::unistd::getegid().as_raw(),
    );
    std::os::unix::fs::lchown(dir, Some(uid), Some(gid)).map_err(io(dir))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).map_err(io(dir))?;
    for entry in std::fs::read_dir(dir).map_err(io(dir))? {
        let path = entry.map_err(io(dir))?.path();
        let meta = std::fs::symlink_metadata(&path).map_err(io(&path))?;
        if meta.is_dir() {
            seal(&path)?;
        } else if meta.is_file() {
            std::os::unix::fs::lchown(&path, Some(uid), Some(gid)).map_err(io(&path))?;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o444))
                .map_err(io(&path))?;
        } else {
            return Err(not_plain(&path));
        }
    }
    Ok(())
}

impl LocalStore {
    /// Opens (creating) the store at `root`, and drops copies an earlier process left
    /// unfinished (see [`Self::copy_in`]): a store is opened before anything copies into it.
    pub fn open(root: &Path) -> Result<Self, SnapshotError> {
        std::fs::create_dir_all(root.join(REFS)).map_err(io(root))?;
        let root = std::fs::canonicalize(root).map_err(io(root))?;
        // Made once here, so the store's files do not change with its first acquire.
        let lock = root.join(REFS_LOCK);
        std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock)
            .map_err(io(&lock))?;
        for entry in std::fs::read_dir(&root).map_err(io(&root))?.flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.starts_with(INCOMING) || name.starts_with(DELETING) {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
        Ok(Self { root })
    }

    /// The store's reference lock, held until the returned guard drops.
    fn lock_refs(&self) -> Result<nix::fcntl::Flock<std::fs::File>, SnapshotError> {
        let path = self.root.join(REFS_LOCK);
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(io(&path))?;
        nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusive)
            .map_err(|(_, errno)| io(&path)(errno.into()))
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// A fresh, empty directory for snapshot `id`, for a VMM to write into.
    pub fn create_dir(&self, id: &str) -> Result<PathBuf, SnapshotError> {
        check_name("snapshot id", id)?;
        let dir = self.root.join(id);
        std::fs::create_dir(&dir).map_err(|e| match e.kind() {
            std::io::ErrorKind::AlreadyExists => SnapshotError::Exists(dir.display().to_string()),
            _ => io(&dir)(e),
        })?;
        Ok(dir)
    }

    /// Where snapshot `id` goes, which nothing may hold yet.
    fn unused_dir(&self, id: &str) -> Result<PathBuf, SnapshotError> {
        check_name("snapshot id", id)?;
        let dir = self.root.join(id);
        if dir.exists() {
            return Err(SnapshotError::Exists(dir.display().to_string()));
        }
        Ok(dir)
    }

    /// Moves the snapshot a VMM wrote in `written` (outside the store: a jailed VMM sees only
    /// its own directory) into the store as `id`, and seals it: owned by the store's owner,
    /// every file read-only. Any VMM restoring it later, whatever its uid, can read it and
    /// none can change it.
    ///
    /// `written` is in a directory the VMM owns: whatever it left there (a symlink to a host
    /// directory, a FIFO) is moved in and judged here, never followed; nothing stays if it
    /// is refused.
    pub fn adopt(&self, id: &str, written: &Path) -> Result<PathBuf, SnapshotError> {
        self.adopt_then(id, written, |dir| self.settle_bases(dir))
    }

    /// [`Self::adopt`] for a layer whose base the caller knows from its own records (a VMM's
    /// next checkpoint, layered on the last, which was moved into the store after it was
    /// written): whatever base the VMM wrote, the layer's base is the store's `base`.
    pub fn adopt_layer(
        &self,
        id: &str,
        written: &Path,
        base: &str,
    ) -> Result<PathBuf, SnapshotError> {
        let base = self.get(base)?;
        self.adopt_then(id, written, |dir| {
            let mut layer = Snapshot::open(dir)?;
            if layer.manifest.memory.size != base.manifest.memory.size {
                return Err(SnapshotError::Base {
                    dir: base.dir.display().to_string(),
                    reason: "its guest memory size differs from the layer's".into(),
                });
            }
            layer.manifest.memory.base = Some(base.base_ref());
            write_manifest(dir, &layer.manifest)
        })
    }

    fn adopt_then(
        &self,
        id: &str,
        written: &Path,
        settle: impl FnOnce(&Path) -> Result<(), SnapshotError>,
    ) -> Result<PathBuf, SnapshotError> {
        let dir = self.unused_dir(id)?;
        match std::fs::rename(written, &dir) {
            Ok(()) => {}
            // Another filesystem: copy, then drop the original.
            Err(e) if e.raw_os_error() == Some(nix::errno::Errno::EXDEV as i32) => {
                copy_tree(written, &dir).inspect_err(|_| {
                    let _ = std::fs::remove_dir_all(&dir);
                })?;
                let _ = std::fs::remove_dir_all(written);
            }
            Err(e) => return Err(io(written)(e)),
        }
        let adopted = take_over(&dir)
            .and_then(|()| settle(&dir))
            .and_then(|()| seal(&dir))
            .and_then(|()| restamp(&dir));
        if let Err(e) = adopted {
            // `remove_dir_all` removes a symlink itself, never what it points to.
            match std::fs::symlink_metadata(&dir).map(|m| m.is_dir()) {
                Ok(true) => {
                    let _ = std::fs::remove_dir_all(&dir);
                }
                _ => {
                    let _ = std::fs::remove_file(&dir);
                }
            }
            return Err(e);
        }
        Ok(dir)
    }

    /// Copies the snapshot in `written` into the store as `id`, durably (every file and the
    /// directory synced before it appears under its name), and seals it. `written` stays as
    /// it is: a running VM may map its memory file (a live fork's base in the VMM's RAM
    /// directory). Holes and stored zero pages are kept as they are.
    pub fn copy_in(&self, id: &str, written: &Path) -> Result<PathBuf, SnapshotError> {
        let dir = self.unused_dir(id)?;
        let incoming = self.root.join(format!("{INCOMING}{id}"));
        let _ = std::fs::remove_dir_all(&incoming);
        // The copy is checked against its digests once, here, and stamped once sealed: the
        // VMMs restoring it then trust it without rehashing.
        let copied = copy_snapshot_files(written, &incoming)
            .and_then(|()| Snapshot::open(&incoming)?.verify())
            .and_then(|()| self.settle_bases(&incoming))
            .and_then(|()| {
                std::fs::rename(&incoming, &dir).map_err(io(&dir))?;
                sync_dir(&self.root)
            });
        if let Err(e) = copied {
            let _ = std::fs::remove_dir_all(&incoming);
            return Err(e);
        }
        seal(&dir)?;
        restamp(&dir)?;
        Ok(dir)
    }

    /// An empty directory to write snapshot `id` in before [`Self::take_in`] makes it one of
    /// the store's (an earlier unfinished one is dropped).
    pub(crate) fn incoming(&self, id: &str) -> Result<PathBuf, SnapshotError> {
        self.unused_dir(id)?;
        let incoming = self.root.join(format!("{INCOMING}{id}"));
        let _ = std::fs::remove_dir_all(&incoming);
        std::fs::create_dir(&incoming).map_err(io(&incoming))?;
        Ok(incoming)
    }

    /// Makes the snapshot written in `incoming` (by this process) the store's `id`: synced,
    /// renamed into place, sealed and stamped.
    pub(crate) fn take_in(&self, id: &str, incoming: &Path) -> Result<PathBuf, SnapshotError> {
        let dir = self.unused_dir(id)?;
        let taken = sync_dir(incoming)
            .and_then(|()| std::fs::rename(incoming, &dir).map_err(io(&dir)))
            .and_then(|()| sync_dir(&self.root));
        if let Err(e) = taken {
            let _ = std::fs::remove_dir_all(incoming);
            return Err(e);
        }
        seal(&dir)?;
        restamp(&dir)?;
        Ok(dir)
    }

    /// Replaces the manifest of the store's snapshot in `dir` (in one rename), keeping it
    /// sealed and stamped.
    pub(crate) fn replace_manifest(
        &self,
        dir: &Path,
        manifest: &crate::Manifest,
    ) -> Result<(), SnapshotError> {
        use std::os::unix::fs::PermissionsExt;
        let path = dir.join(crate::manifest::MANIFEST_FILE);
        write_manifest(dir, manifest)?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o444)).map_err(io(&path))
    }

    /// Makes the base the snapshot in `dir` is layered on one of this store's, so a snapshot
    /// in the store never depends on a file outside it (a base in a VMM's RAM directory is
    /// gone at the next reboot). A base outside the store (which must still be there) is
    /// replaced by its copy here: the store entry of the same name, made now if there is
    /// none, after checking the copy holds the same files.
    fn settle_bases(&self, dir: &Path) -> Result<(), SnapshotError> {
        let snapshot = match Snapshot::open(dir) {
            Ok(s) => s,
            // Not ours (a foreign VMM's snapshot): nothing to follow.
            Err(SnapshotError::Io { .. }) => return Ok(()),
            Err(e) => return Err(e),
        };
        let Some(base) = snapshot.manifest.memory.base.clone() else {
            return Ok(());
        };
        if base.dir.starts_with(&self.root) {
            return Ok(());
        }
        let name = base
            .dir
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| SnapshotError::Base {
                dir: base.dir.display().to_string(),
                reason: "has no name to keep it under in the store".into(),
            })?
            .to_owned();
        let twin_dir = self.dir(&name)?;
        // Only the original can vouch for a copy (stamps make the copy's manifest differ).
        let original = Snapshot::open(&base.dir).map_err(|e| SnapshotError::Base {
            dir: base.dir.display().to_string(),
            reason: format!("cannot be read to move it into the store: {e}"),
        })?;
        if !original.is_base_of(&base) {
            return Err(SnapshotError::Base {
                dir: base.dir.display().to_string(),
                reason: "changed since the layer was taken on it".into(),
            });
        }
        if !twin_dir.is_dir() {
            self.copy_in(&name, &base.dir)?;
        }
        let twin = Snapshot::open(&twin_dir)?;
        if !same_contents(&original, &twin) {
            return Err(SnapshotError::Base {
                dir: base.dir.display().to_string(),
                reason: format!("the store's {name} holds other contents"),
            });
        }
        let mut manifest = snapshot.manifest;
        manifest.memory.base = Some(twin.base_ref());
        write_manifest(dir, &manifest)
    }

    /// The directories of snapshot `dir` and of every base under it, top first: what a VM
    /// restored from `dir` reads. A snapshot without our manifest is a chain of one.
    pub fn chain(dir: &Path) -> Vec<PathBuf> {
        let mut chain = vec![dir.to_owned()];
        while chain.len() < MAX_CHAIN {
            let Some(base) = chain
                .last()
                .and_then(|top| Snapshot::open(top).ok())
                .and_then(|s| s.manifest.memory.base)
            else {
                break;
            };
            if chain.contains(&base.dir) {
                break;
            }
            chain.push(base.dir);
        }
        chain
    }

    pub fn dir(&self, id: &str) -> Result<PathBuf, SnapshotError> {
        check_name("snapshot id", id)?;
        Ok(self.root.join(id))
    }

    pub fn get(&self, id: &str) -> Result<Snapshot, SnapshotError> {
        Snapshot::open(&self.dir(id)?)
    }

    pub fn list(&self) -> Result<Vec<String>, SnapshotError> {
        let mut ids: Vec<String> = std::fs::read_dir(&self.root)
            .map_err(io(&self.root))?
            .filter_map(|e| e.ok())
            .filter_map(|e| e.file_name().into_string().ok())
            .filter(|name| !name.starts_with('.'))
            .collect();
        ids.sort();
        Ok(ids)
    }

    /// Marks `holder` (a VM, a session) as using snapshot `id`. Idempotent. Any directory
    /// in the store counts, a foreign VMM's snapshot without our manifest too.
    pub fn acquire(&self, id: &str, holder: &str) -> Result<(), SnapshotError> {
        check_name("holder", holder)?;
        let _locked = self.lock_refs()?;
        if !self.dir(id)?.is_dir() {
            return Err(SnapshotError::NotFound(id.to_owned()));
        }
        let refs = self.root.join(REFS).join(id);
        std::fs::create_dir_all(&refs).map_err(io(&refs))?;
        let path = refs.join(holder);
        std::fs::write(&path, b"").map_err(io(&path))
    }

    /// Idempotent: releasing what is not held is fine.
    pub fn release(&self, id: &str, holder: &str) -> Result<(), SnapshotError> {
        check_name("snapshot id", id)?;
        check_name("holder", holder)?;
        let path = self.root.join(REFS).join(id).join(holder);
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io(&path)(e)),
        }
    }

    pub fn holders(&self, id: &str) -> Result<Vec<String>, SnapshotError> {
        check_name("snapshot id", id)?;
        let refs = self.root.join(REFS).join(id);
        let mut holders: Vec<String> = match std::fs::read_dir(&refs) {
            Ok(entries) => entries
                .filter_map(|e| e.ok())
                .filter_map(|e| e.file_name().into_string().ok())
                .collect(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(io(&refs)(e)),
        };
        holders.sort();
        Ok(holders)
    }

    /// Snapshots in this store layered directly on `id`.
    pub fn dependents(&self, id: &str) -> Result<Vec<String>, SnapshotError> {
        let dir = self.dir(id)?;
        let mut out = Vec::new();
        for other in self.list()? {
            if other == id {
                continue;
            }
            // Most snapshots are layered on something else: a manifest that does not even
            // name `id` is skipped unparsed (a store of many sessions' checkpoints is read
            // whole at every delete).
            let manifest = self.root.join(&other).join(crate::manifest::MANIFEST_FILE);
            let names_it = crate::dir::read_regular(&manifest, crate::dir::MAX_MANIFEST)
                .is_ok_and(|bytes| bytes.windows(id.len()).any(|w| w == id.as_bytes()));
            if !names_it {
                continue;
            }
            if let Ok(snapshot) = self.get(&other)
                && snapshot
                    .manifest
                    .memory
                    .base
                    .as_ref()
                    .is_some_and(|b| b.dir == dir)
            {
                out.push(other);
            }
        }
        Ok(out)
    }

    /// Deletes snapshot `id`, unless something still uses it. Decided and taken out of the
    /// store under the reference lock: an acquire either comes first (and the snapshot
    /// stays) or finds it gone.
    pub fn delete(&self, id: &str) -> Result<(), SnapshotError> {
        let dir = self.dir(id)?;
        let doomed = {
            let _locked = self.lock_refs()?;
            let holders = self.holders(id)?;
            let dependents = self.dependents(id)?;
            if !holders.is_empty() || !dependents.is_empty() {
                return Err(SnapshotError::InUse {
                    id: id.to_owned(),
                    holders,
                    dependents,
                });
            }
            let doomed = self.root.join(format!("{DELETING}{id}"));
            match std::fs::rename(&dir, &doomed) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    return Err(SnapshotError::NotFound(id.to_owned()));
                }
                Err(e) => return Err(io(&dir)(e)),
            }
            let _ = std::fs::remove_dir(self.root.join(REFS).join(id));
            let _ = std::fs::remove_file(self.root.join(PINS).join(id));
            doomed
        };
        std::fs::remove_dir_all(&doomed).map_err(io(&doomed))
    }

    /// Writes snapshot `id` (flattened) as a portable archive; returns its pin.
    pub fn export(&self, id: &str, out: impl Write) -> Result<String, SnapshotError> {
        archive::export(&self.get(id)?, out)
    }

    /// Writes layered snapshot `id` as a layer archive: only what it stores over its base.
    /// Returns its pin.
    pub fn export_layer(&self, id: &str, out: impl Write) -> Result<String, SnapshotError> {
        archive::export_layer(&self.get(id)?, out)
    }

    /// Records the pins of the archive chain `id` travels as (its own first), replacing any
    /// earlier record; written whole or not at all.
    pub fn record_pins(&self, id: &str, pins: &[String]) -> Result<(), SnapshotError> {
        check_name("snapshot id", id)?;
        let dir = self.root.join(PINS);
        match std::fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io(&dir)(e)),
        }
        let partial = dir.join(format!(".{id}.{}", std::process::id()));
        let path = dir.join(id);
        std::fs::write(&partial, pins.join("\n"))
            .and_then(|()| std::fs::rename(&partial, &path))
            .map_err(io(&path))
            .inspect_err(|_| {
                let _ = std::fs::remove_file(&partial);
            })
    }

    /// The pins [`LocalStore::record_pins`] recorded for `id`, if any.
    pub fn pins(&self, id: &str) -> Result<Option<Vec<String>>, SnapshotError> {
        check_name("snapshot id", id)?;
        let path = self.root.join(PINS).join(id);
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io(&path)(e)),
        };
        let pins: Vec<String> = text.lines().map(str::to_owned).collect();
        let well_formed = !pins.is_empty()
            && pins.len() <= MAX_PINS
            && pins
                .iter()
                .all(|p| p.len() == 64 && p.bytes().all(|b| b.is_ascii_hexdigit()));
        Ok(well_formed.then_some(pins))
    }

    /// The store's snapshot `id` is layered on, if any (a base outside the store has none).
    pub fn base_of(&self, id: &str) -> Result<Option<String>, SnapshotError> {
        let Some(base) = self.get(id)?.manifest.memory.base else {
            return Ok(None);
        };
        Ok((base.dir.parent() == Some(self.root.as_path()))
            .then(|| base.dir.file_name()?.to_str().map(str::to_owned))
            .flatten())
    }

    /// Imports an archive another node exported as snapshot `id`, durably: checked against
    /// every digest, each file and the directory synced, before it appears under its name;
    /// then sealed and stamped like every snapshot of the store. A layer archive lands on
    /// this store's snapshot `base`, which must be there. Nothing stays if it fails.
    pub fn fetch(
        &self,
        id: &str,
        input: impl Read,
        base: Option<&str>,
        limits: &archive::ImportLimits,
    ) -> Result<PathBuf, SnapshotError> {
        let base = base.map(|base| self.get(base)).transpose()?;
        let dir = self.unused_dir(id)?;
        let incoming = self.root.join(format!("{INCOMING}{id}"));
        let _ = std::fs::remove_dir_all(&incoming);
        let fetched = std::fs::create_dir(&incoming)
            .map_err(io(&incoming))
            .and_then(|()| archive::import(input, &incoming, base.as_ref(), limits))
            .and_then(|_| sync_files(&incoming))
            .and_then(|()| {
                std::fs::rename(&incoming, &dir).map_err(io(&dir))?;
                sync_dir(&self.root)
            });
        if let Err(e) = fetched {
            let _ = std::fs::remove_dir_all(&incoming);
            return Err(e);
        }
        seal(&dir)?;
        restamp(&dir)?;
        Ok(dir)
    }

    /// Imports an archive as snapshot `id`; nothing is left behind if it fails.
    pub fn import(
        &self,
        id: &str,
        input: impl Read,
        limits: &archive::ImportLimits,
    ) -> Result<Snapshot, SnapshotError> {
        let dir = self.create_dir(id)?;
        archive::import(input, &dir, None, limits)
            .map(|(snapshot, _pin)| snapshot)
            .inspect_err(|_| {
                let _ = std::fs::remove_dir_all(&dir);
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SnapshotWriter;
    use crate::manifest::{HostIdentity, MemoryLayout, STATE_FILE};

    fn put(store: &LocalStore, id: &str, base: Option<&str>) {
        let dir = store.create_dir(id).unwrap();
        let mut w = SnapshotWriter::create(&dir, false).unwrap();
        w.write_file(STATE_FILE, b"{}").unwrap();
        let base = base.map(|b| store.get(b).unwrap().base_ref());
        w.finish(
            HostIdentity::current("PVM"),
            "t",
            MemoryLayout { size: 0, base },
        )
        .unwrap();
    }

    /// A snapshot as a VMM writes it, in `written` (created).
    fn written_by_a_vmm(written: &Path) {
        std::fs::create_dir(written).unwrap();
        let mut w = SnapshotWriter::create(written, false).unwrap();
        w.write_file(STATE_FILE, b"{}").unwrap();
        w.finish(
            HostIdentity::current("PVM"),
            "t",
            MemoryLayout {
                size: 0,
                base: None,
            },
        )
        .unwrap();
    }

    #[test]
    fn what_a_vmm_plants_in_its_snapshot_never_reaches_host_files() {
        use std::os::unix::fs::PermissionsExt;
        let root = tempfile::tempdir().unwrap();
        let store = LocalStore::open(root.path()).unwrap();
        // A host directory with a secret the VMM must never have read or changed.
        let host = tempfile::tempdir().unwrap();
        let secret = host.path().join("secret");
        std::fs::write(&secret, b"root's").unwrap();
        std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
        let untouched = |what: &str| {
            let mode = std::fs::metadata(&secret).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600, "{what}: the host file's mode changed");
            assert_eq!(std::fs::read(&secret).unwrap(), b"root's", "{what}");
            assert!(
                store.list().unwrap().is_empty(),
                "{what}: {:?}",
                store.list()
            );
        };
        let outside = tempfile::tempdir().unwrap();
        let written = outside.path().join("snapshot");

        // The snapshot directory itself a symlink to the host directory: sealing it would
        // have made every file there 0444.
        std::os::unix::fs::symlink(host.path(), &written).unwrap();
        assert!(store.adopt("s1", &written).is_err());
        untouched("a symlinked snapshot directory");

        // A file of the snapshot a symlink to the host file: bound into a restore's jail
        // it would show the VMM that file.
        written_by_a_vmm(&written);
        std::fs::remove_file(written.join(STATE_FILE)).unwrap();
        std::os::unix::fs::symlink(&secret, written.join(STATE_FILE)).unwrap();
        assert!(store.adopt("s2", &written).is_err());
        untouched("a symlinked snapshot file");

        // A manifest that never ends, or never comes: refused at once.
        let zero: fn(&Path) = |m| std::os::unix::fs::symlink("/dev/zero", m).unwrap();
        let fifo: fn(&Path) = |m| nix::unistd::mkfifo(m, nix::sys::stat::Mode::S_IRWXU).unwrap();
        for (what, plant) in [("/dev/zero", zero), ("a FIFO", fifo)] {
            written_by_a_vmm(&written);
            std::fs::remove_file(written.join(crate::manifest::MANIFEST_FILE)).unwrap();
            plant(&written.join(crate::manifest::MANIFEST_FILE));
            assert!(store.adopt("s3", &written).is_err(), "{what}");
            untouched(what);
        }

        // A copy (a live fork's) takes regular files only.
        written_by_a_vmm(&written);
        std::fs::remove_file(written.join(STATE_FILE)).unwrap();
        std::os::unix::fs::symlink(&secret, written.join(STATE_FILE)).unwrap();
        assert!(store.copy_in("s4", &written).is_err());
        untouched("a copy through a symlink");
    }

    #[test]
    fn adopted_snapshots_are_moved_in_sealed_and_chained_to_their_bases() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let root = tempfile::tempdir().unwrap();
        let store = LocalStore::open(root.path()).unwrap();
        put(&store, "base", None);
        // A layer written outside the store, as a jailed VMM writes it.
        let outside = tempfile::tempdir().unwrap();
        let written = outside.path().join("snapshot");
        std::fs::create_dir(&written).unwrap();
        let mut w = SnapshotWriter::create(&written, false).unwrap();
        w.write_file(STATE_FILE, b"{}").unwrap();
        let base = store.get("base").unwrap().base_ref();
        w.finish(
            HostIdentity::current("PVM"),
            "t",
            MemoryLayout {
                size: 0,
                base: Some(base),
            },
        )
        .unwrap();
        let dir = store.adopt("layer", &written).unwrap();
        assert_eq!(dir, store.dir("layer").unwrap());
        assert!(!written.exists());
        assert!(store.get("layer").is_ok());
        for entry in std::fs::read_dir(&dir).unwrap() {
            let meta = entry.unwrap().metadata().unwrap();
            assert_eq!(meta.uid(), nix::unistd::geteuid().as_raw());
            assert_eq!(meta.permissions().mode() & 0o777, 0o444);
        }
        assert_eq!(
            LocalStore::chain(&dir),
            vec![dir.clone(), store.dir("base").unwrap()]
        );
        assert_eq!(store.dependents("base").unwrap(), ["layer"]);
        // An id already taken is refused and the written snapshot left where it was.
        std::fs::create_dir(&written).unwrap();
        assert!(matches!(
            store.adopt("layer", &written),
            Err(SnapshotError::Exists(_))
        ));
        assert!(written.exists());
        // A sealed snapshot can still be deleted by the store.
        store.delete("layer").unwrap();
        store.delete("base").unwrap();
    }

    #[test]
    fn held_or_layered_snapshots_are_not_deleted() {
        let root = tempfile::tempdir().unwrap();
        let store = LocalStore::open(root.path()).unwrap();
        put(&store, "base", None);
        put(&store, "layer", Some("base"));
        store.acquire("layer", "vm-1").unwrap();
        store.acquire("layer", "vm-1").unwrap();
        assert_eq!(store.holders("layer").unwrap(), ["vm-1"]);
        assert!(matches!(
            store.delete("layer"),
            Err(SnapshotError::InUse { .. })
        ));
        match store.delete("base") {
            Err(SnapshotError::InUse { dependents, .. }) => assert_eq!(dependents, ["layer"]),
            other => panic!("{other:?}"),
        }
        store.release("layer", "vm-1").unwrap();
        store.release("layer", "vm-1").unwrap();
        store.delete("layer").unwrap();
        store.delete("base").unwrap();
        assert!(store.list().unwrap().is_empty());
        assert!(matches!(
            store.delete("base"),
            Err(SnapshotError::NotFound(_))
        ));
        assert!(matches!(
            store.acquire("gone", "x"),
            Err(SnapshotError::NotFound(_))
        ));
    }

    /// Issue 34 (item 4): a fork read a snapshot that a concurrent delete took away
    /// ("reading …/config.json: No such file"). Whoever acquires a snapshot now finds it
    /// whole until released; an acquire that loses the race is told NotFound.
    #[test]
    fn a_snapshot_acquired_is_never_deleted_under_its_holder() {
        let root = tempfile::tempdir().unwrap();
        let store = LocalStore::open(root.path()).unwrap();
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|scope| {
            scope.spawn(|| {
                let outside = tempfile::tempdir().unwrap();
                let written = outside.path().join("s");
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    if store.get("s").is_err() {
                        // Written aside and moved in whole, as a VMM's snapshot is.
                        written_by_a_vmm(&written);
                        store.adopt("s", &written).unwrap();
                    }
                    let _ = store.delete("s");
                }
            });
            /// Stops the deleter however this thread ends (a panic too), or the scope waits.
            struct Stop<'a>(&'a std::sync::atomic::AtomicBool);
            impl Drop for Stop<'_> {
                fn drop(&mut self) {
                    self.0.store(true, std::sync::atomic::Ordering::Relaxed);
                }
            }
            let _stop = Stop(&stop);
            let mut held = 0;
            for _ in 0..2000 {
                match store.acquire("s", "vm") {
                    Ok(()) => {
                        held += 1;
                        std::thread::yield_now();
                        store.get("s").expect("deleted while held");
                        store.release("s", "vm").unwrap();
                    }
                    Err(SnapshotError::NotFound(_)) => {}
                    Err(e) => panic!("{e}"),
                }
            }
            assert!(held > 0);
        });
        let names: Vec<_> = std::fs::read_dir(root.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.starts_with(DELETING))
            .collect();
        assert!(names.is_empty(), "left {names:?}");
    }

    #[test]
    fn names_cannot_escape_the_store() {
        let root = tempfile::tempdir().unwrap();
        let store = LocalStore::open(root.path()).unwrap();
        for bad in ["", "../x", "a/b", ".refs", &"x".repeat(200)] {
            assert!(
                matches!(
                    store.create_dir(bad),
                    Err(SnapshotError::InvalidName { .. })
                ),
                "{bad}"
            );
        }
        put(&store, "s", None);
        assert!(store.acquire("s", "../../etc").is_err());
        assert!(matches!(
            store.create_dir("s"),
            Err(SnapshotError::Exists(_))
        ));
    }

    #[test]
    fn failed_imports_leave_nothing() {
        let root = tempfile::tempdir().unwrap();
        let store = LocalStore::open(root.path()).unwrap();
        assert!(
            store
                .import("bad", &b"garbage"[..], &archive::ImportLimits::unpinned())
                .is_err()
        );
        assert!(store.list().unwrap().is_empty());
    }

    /// A snapshot written outside any store, on `base` when given.
    fn write_outside(dir: &Path, state: &[u8], base: Option<&Snapshot>) -> Snapshot {
        std::fs::create_dir(dir).unwrap();
        let mut w = SnapshotWriter::create(dir, false).unwrap();
        w.write_file(STATE_FILE, state).unwrap();
        w.finish(
            HostIdentity::current("PVM"),
            "t",
            MemoryLayout {
                size: 0,
                base: base.map(Snapshot::base_ref),
            },
        )
        .unwrap();
        Snapshot::open(dir).unwrap()
    }

    #[test]
    fn an_import_is_a_sealed_copy_that_leaves_the_original_in_place() {
        let root = tempfile::tempdir().unwrap();
        let store = LocalStore::open(root.path()).unwrap();
        let ram = tempfile::tempdir().unwrap();
        let fork = write_outside(&ram.path().join("fork-1"), b"{\"a\":1}", None);
        let dir = store.copy_in("fork-1", &fork.dir).unwrap();
        assert!(fork.dir.join(STATE_FILE).is_file(), "the original stays");
        let copy = store.get("fork-1").unwrap();
        copy.verify().unwrap();
        assert_eq!(copy.manifest.files.len(), fork.manifest.files.len());
        for (name, entry) in &copy.manifest.files {
            let meta = std::fs::metadata(dir.join(name)).unwrap();
            assert_eq!(
                entry.stamp,
                Some(crate::manifest::FileStamp::of(&meta)),
                "{name} is stamped as sealed, so restoring it does not rehash it"
            );
            assert_eq!(entry.sha256, fork.manifest.files[name].sha256);
        }
        assert!(matches!(
            store.copy_in("fork-1", &fork.dir),
            Err(SnapshotError::Exists(_))
        ));
        assert!(std::fs::read_dir(root.path()).unwrap().all(|e| {
            !e.unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with(".incoming")
        }));
        assert_eq!(dir, store.dir("fork-1").unwrap());
    }

    #[test]
    fn a_layer_on_a_base_outside_the_store_is_rebased_onto_its_copy() {
        let root = tempfile::tempdir().unwrap();
        let store = LocalStore::open(root.path()).unwrap();
        let ram = tempfile::tempdir().unwrap();
        let base = write_outside(&ram.path().join("fork-1"), b"{\"base\":1}", None);
        // The layer a VM running over the base writes at its next suspend.
        let layer = write_outside(&ram.path().join("outbox"), b"{\"layer\":1}", Some(&base));
        let dir = store.adopt("suspend-2", &layer.dir).unwrap();
        let adopted = Snapshot::open(&dir).unwrap();
        let twin = store.dir("fork-1").unwrap();
        assert_eq!(adopted.manifest.memory.base.as_ref().unwrap().dir, twin);
        let chain = adopted.chain().unwrap();
        assert_eq!(chain.len(), 2);
        assert_eq!(chain[0].dir, twin, "the base was copied into the store");
        assert_eq!(store.dependents("fork-1").unwrap(), ["suspend-2"]);
        // Once the original is gone, the store's copy carries on.
        std::fs::remove_dir_all(&base.dir).unwrap();
        assert_eq!(Snapshot::open(&dir).unwrap().chain().unwrap().len(), 2);
    }

    #[test]
    fn a_base_copy_with_other_contents_is_refused() {
        let root = tempfile::tempdir().unwrap();
        let store = LocalStore::open(root.path()).unwrap();
        let ram = tempfile::tempdir().unwrap();
        let base = write_outside(&ram.path().join("fork-1"), b"{\"base\":1}", None);
        let impostor = write_outside(&ram.path().join("other"), b"{\"base\":2}", None);
        store.copy_in("fork-1", &impostor.dir).unwrap();
        let layer = write_outside(&ram.path().join("outbox"), b"{}", Some(&base));
        let err = store.adopt("suspend-2", &layer.dir).unwrap_err();
        assert!(err.to_string().contains("other contents"), "{err}");
    }
}
