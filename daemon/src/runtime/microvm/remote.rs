//! Where a fleet keeps its snapshots, so a session suspended on one node resumes on any
//! other (`--snapshot-url`):
//! - `file:///DIR`: a directory every node mounts (a shared filesystem);
//! - `s3://BUCKET/PREFIX`: an S3-compatible object store (endpoint, region and credentials
//!   from the standard `AWS_*` environment; `remote/s3.rs`).
//!
//! A snapshot taken into a node's local store is published as a portable archive of the
//! snapshot crate, and the journal records the archive's URI. A snapshot layered on one the
//! fleet already has is published as a layer (only the pages it changed), named after its
//! base: `SESSION/ID@BASE.agvmsnap`; any other flattened: `SESSION/ID.agvmsnap` (ids
//! without the session's name where the directory says it). A node
//! restoring a snapshot it lacks fetches the archive, and the chain of bases under it that
//! it lacks too, into its own store (every digest checked), and restores `MAP_PRIVATE` from
//! there; the node that took it restores from its own copy at once.
//!
//! Archives are kept per session (its directory of the remote), so a session's are found
//! without listing the fleet's; they are deleted once their session is gone and nothing
//! layered on them is kept (`sweep`).
//!
//! Whoever can write the store is not trusted: the URI the journal records pins the chain
//! it names, `URI#sha256=PIN[,PIN…]` (the archive's manifest digest, then its base's, down
//! to the flattened archive at the bottom), and a fetch refuses any archive whose manifest
//! is not the pinned one, so a rewritten archive (every digest inside it self-consistent)
//! is refused as surely as a corrupt one. Each node records the pins of the chains it
//! publishes and fetches in its store, so a layer it publishes can name its base's. A fetch
//! is capped too: no file larger than the session's memory or disk, and never below the
//! node's disk reserve.

mod s3;

use super::turn_checkpoints::CHECKPOINT_PREFIX;
use std::collections::HashSet;
use std::fs::File;
use std::io::{BufReader, BufWriter};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use agentvm_snapshot::LocalStore;
use agentvm_snapshot::archive::ImportLimits;

pub use self::s3::S3Remote;

/// How a published archive's name ends.
const ARCHIVE_SUFFIX: &str = ".agvmsnap";
/// Between a layer's id and its base's in its name (never part of a snapshot id).
const LAYER_MARK: char = '@';
/// The directory of archives whose id names no session.
const NO_SESSION: &str = "_";
/// Deeper chains of archives are refused (the VMM flattens long before).
const MAX_CHAIN: usize = 64;
/// Between an archive's URI and the pins of its chain.
const PIN_MARK: &str = "#sha256=";

/// What a fetch may write: the largest file a snapshot of the session can hold (its memory
/// or a disk), and the free space of the store it must leave.
#[derive(Debug, Clone, Copy)]
pub struct FetchLimits {
    pub max_file_bytes: u64,
    pub min_free_bytes: u64,
}

impl FetchLimits {
    /// How many bytes the next archive may write into `store`.
    fn budget(&self, store: &LocalStore) -> Result<u64, String> {
        let free = crate::disk::free_bytes(store.root())
            .map_err(|e| format!("reading the free space of {}: {e}", store.root().display()))?;
        match free.checked_sub(self.min_free_bytes) {
            Some(budget) if budget > 0 => Ok(budget),
            _ => Err(format!(
                "{} has {} MiB free, below the node's reserve of {} MiB",
                store.root().display(),
                free >> 20,
                self.min_free_bytes >> 20
            )),
        }
    }
}

/// The pins a URI carries, top first: `None` if it carries none (or malformed ones).
fn pins_of(uri: &str) -> Option<Vec<String>> {
    let (_, pins) = uri.split_once(PIN_MARK)?;
    let pins: Vec<String> = pins.split(',').map(str::to_owned).collect();
    let well_formed = pins.len() <= MAX_CHAIN
        && pins
            .iter()
            .all(|p| p.len() == 64 && p.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')));
    well_formed.then_some(pins)
}

/// One published archive: snapshot `id`, flattened, or its layer on snapshot `base`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Archive {
    pub id: String,
    pub base: Option<String>,
}

fn plain_id(id: &str) -> bool {
    !id.is_empty() && !id.starts_with('.') && !id.contains(['/', LAYER_MARK])
}

/// `id` inside `session`'s directory: without the session's name, which the directory
/// says (an id of no session whole; a checkpoint's keeps its prefix: `ckpt.EPOCH-N`). An id
/// of another session keeps it, and has more than one `-` where a shortened one has
/// exactly one (`EPOCH-N`).
fn short_id(id: &str, session: &str) -> String {
    let (prefix, rest) = match id.strip_prefix(CHECKPOINT_PREFIX) {
        Some(rest) => (CHECKPOINT_PREFIX, rest),
        None => ("", id),
    };
    match rest
        .strip_prefix(session)
        .and_then(|rest| rest.strip_prefix('-'))
        .filter(|_| session != NO_SESSION)
    {
        Some(short) => format!("{prefix}{short}"),
        None => id.to_owned(),
    }
}

/// The whole id of `short` found in `session`'s directory.
fn whole_id(short: &str, session: &str) -> String {
    let (prefix, rest) = match short.strip_prefix(CHECKPOINT_PREFIX) {
        Some(rest) => (CHECKPOINT_PREFIX, rest),
        None => ("", short),
    };
    match session != NO_SESSION && rest.matches('-').count() == 1 {
        true => format!("{prefix}{session}-{rest}"),
        false => short.to_owned(),
    }
}

impl Archive {
    /// The session whose directory holds the archive.
    pub fn session(&self) -> &str {
        super::snapshot_owner(&self.id)
            .or_else(|| super::turn_checkpoints::checkpoint_owner(&self.id))
            .unwrap_or(NO_SESSION)
    }

    /// Its name in its session's directory: `EPOCH-N`, and the base's id after
    /// [`LAYER_MARK`] for a layer (as short, if the base is the same session's).
    fn name(&self) -> String {
        let session = self.session();
        let id = short_id(&self.id, session);
        match &self.base {
            None => format!("{id}{ARCHIVE_SUFFIX}"),
            Some(base) => format!(
                "{id}{LAYER_MARK}{}{ARCHIVE_SUFFIX}",
                short_id(base, session)
            ),
        }
    }

    /// Its path below the remote's root: `SESSION/NAME`.
    fn key(&self) -> String {
        format!("{}/{}", self.session(), self.name())
    }

    /// The archive a `SESSION/NAME` path below the remote's root names.
    fn from_key(key: &str) -> Option<Self> {
        let (session, name) = key.split_once('/')?;
        let stem = name.strip_suffix(ARCHIVE_SUFFIX)?;
        let (id, base) = match stem.split_once(LAYER_MARK) {
            None => (stem, None),
            Some((id, base)) => (id, Some(base)),
        };
        if !plain_id(id) || !base.is_none_or(plain_id) {
            return None;
        }
        let archive = Self {
            id: whole_id(id, session),
            base: base.map(|base| whole_id(base, session)),
        };
        (archive.session() == session && archive.key() == key).then_some(archive)
    }
}

#[derive(Debug, Clone)]
pub enum SnapshotRemote {
    /// A directory on a filesystem the fleet shares.
    Dir(PathBuf),
    /// A bucket (and key prefix) of an S3-compatible store.
    S3(S3Remote),
}

impl std::str::FromStr for SnapshotRemote {
    type Err = String;

    fn from_str(url: &str) -> Result<Self, String> {
        match url.split_once("://") {
            Some(("file", path)) if path.starts_with('/') => {
                Ok(Self::Dir(PathBuf::from(path.trim_end_matches('/'))))
            }
            Some(("file", _)) => Err(format!(
                "snapshot_url {url:?}: a file URL needs an absolute path (file:///DIR)"
            )),
            Some(("s3", rest)) => S3Remote::from_env(rest).map(Self::S3),
            _ => Err(format!(
                "snapshot_url {url:?}: file:///DIR (a directory the fleet shares) or \
                 s3://BUCKET/PREFIX"
            )),
        }
    }
}

/// Exports snapshot `id` of `store` into `to` as an archive (a layer if `layer`), synced.
/// Returns its pin.
fn export(store: &LocalStore, id: &str, layer: bool, to: &Path) -> Result<String, String> {
    let file = File::create(to).map_err(|e| format!("creating {}: {e}", to.display()))?;
    let mut out = BufWriter::new(file);
    let pin = match layer {
        true => store.export_layer(id, &mut out),
        false => store.export(id, &mut out),
    }
    .map_err(|e| format!("writing snapshot {id} to {}: {e}", to.display()))?;
    out.into_inner()
        .map_err(|e| format!("writing {}: {e}", to.display()))?
        .sync_all()
        .map_err(|e| format!("syncing {}: {e}", to.display()))?;
    Ok(pin)
}

/// Imports the archive at `from` into `store` (onto the store's copy of its base), checked
/// against `limits`.
fn import(
    store: &LocalStore,
    archive: &Archive,
    from: &Path,
    limits: &ImportLimits,
) -> Result<PathBuf, String> {
    let file = File::open(from).map_err(|e| format!("opening {}: {e}", from.display()))?;
    store
        .fetch(
            &archive.id,
            BufReader::new(file),
            archive.base.as_deref(),
            limits,
        )
        .map_err(|e| format!("fetching {}: {e}", from.display()))
}

async fn blocking<T: Send + 'static>(
    what: &str,
    work: impl FnOnce() -> Result<T, String> + Send + 'static,
) -> Result<T, String> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| format!("{what}: {e}"))?
}

/// A staging file in `store` for moving archive bytes, unique to this process.
fn staging(store: &LocalStore, what: &str, archive: &Archive) -> PathBuf {
    store
        .root()
        .join(format!(".{what}-{}-{}", archive.id, std::process::id()))
}

impl SnapshotRemote {
    fn path(dir: &Path, archive: &Archive) -> PathBuf {
        dir.join(archive.key())
    }

    /// Where `archive` is, without pins.
    pub fn uri(&self, archive: &Archive) -> String {
        match self {
            Self::Dir(dir) => format!("file://{}", Self::path(dir, archive).display()),
            Self::S3(s3) => s3.uri(&archive.key()),
        }
    }

    /// The URI the journal records for `archive`: where it is, and the pins of its chain.
    pub fn pinned_uri(&self, archive: &Archive, pins: &[String]) -> String {
        format!("{}{PIN_MARK}{}", self.uri(archive), pins.join(","))
    }

    /// The archive a URI of this remote names (pinned or not), or `None` for any other URI.
    pub fn archive_of(&self, uri: &str) -> Option<Archive> {
        let uri = uri.split_once('#').map_or(uri, |(uri, _)| uri);
        let key = match self {
            Self::Dir(dir) => Path::new(uri.strip_prefix("file://")?)
                .strip_prefix(dir)
                .ok()?
                .to_str()?
                .to_owned(),
            Self::S3(s3) => s3.key_of(uri)?,
        };
        Archive::from_key(&key)
    }

    async fn exists(&self, archive: &Archive) -> Result<bool, String> {
        match self {
            Self::Dir(dir) => Ok(Self::path(dir, archive).is_file()),
            Self::S3(s3) => s3.exists(&archive.key()).await,
        }
    }

    /// Snapshot `id`'s archive in the remote, if it was published: as a layer on `base`
    /// (what the local copy is layered on, if any) or flattened; else among its session's.
    async fn locate(&self, id: &str, base: Option<String>) -> Result<Option<Archive>, String> {
        let id = id.to_owned();
        let guesses = [base.map(|base| Archive {
            id: id.clone(),
            base: Some(base),
        })]
        .into_iter()
        .flatten()
        .chain([Archive {
            id: id.clone(),
            base: None,
        }]);
        for guess in guesses {
            if self.exists(&guess).await? {
                return Ok(Some(guess));
            }
        }
        let session = Archive {
            id: id.clone(),
            base: None,
        }
        .session()
        .to_owned();
        Ok(self
            .list(Some(&session))
            .await?
            .into_iter()
            .map(|(archive, _)| archive)
            .find(|archive| archive.id == id))
    }

    /// Publishes snapshot `id` of `store`, so that no node ever reads half an archive: in a
    /// directory, written under a temporary name, synced and renamed into place; in a
    /// bucket, uploaded in parts that appear as one object when the upload completes. A
    /// snapshot layered on one the remote holds (and whose pins this node knows) goes as a
    /// layer on it. Returns its pinned URI.
    pub async fn publish(&self, store: &LocalStore, id: &str) -> Result<String, String> {
        let local_base = store.base_of(id).map_err(|e| e.to_string())?;
        let (base, base_pins) = match local_base {
            Some(base) => match store.pins(&base).map_err(|e| e.to_string())? {
                Some(pins) if pins.len() < MAX_CHAIN => {
                    let under = store.base_of(&base).map_err(|e| e.to_string())?;
                    match self.locate(&base, under).await? {
                        Some(_) => (Some(base), pins),
                        None => (None, Vec::new()),
                    }
                }
                _ => (None, Vec::new()),
            },
            None => (None, Vec::new()),
        };
        let archive = Archive {
            id: id.to_owned(),
            base,
        };
        let layer = archive.base.is_some();
        let (owned_store, owned_id) = (store.clone(), id.to_owned());
        let pin = match self {
            Self::Dir(dir) => {
                let target = Self::path(dir, &archive);
                let parent = target.parent().map(Path::to_owned).unwrap_or_default();
                blocking("publishing", move || {
                    // The session's directory only: the shared one must be there (mounted).
                    match std::fs::create_dir(&parent) {
                        Ok(()) => {}
                        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                        Err(e) => return Err(format!("creating {}: {e}", parent.display())),
                    }
                    let partial =
                        parent.join(format!(".{owned_id}.{}.partial", std::process::id()));
                    let written =
                        export(&owned_store, &owned_id, layer, &partial).and_then(|pin| {
                            std::fs::rename(&partial, &target)
                                .map_err(|e| format!("publishing {}: {e}", target.display()))?;
                            File::open(&parent)
                                .and_then(|d| d.sync_all())
                                .map_err(|e| format!("syncing {}: {e}", parent.display()))?;
                            Ok(pin)
                        });
                    if written.is_err() {
                        let _ = std::fs::remove_file(&partial);
                    }
                    written
                })
                .await?
            }
            Self::S3(s3) => {
                let staged = staging(store, "upload", &archive);
                let local = staged.clone();
                let exported = blocking("publishing", move || {
                    export(&owned_store, &owned_id, layer, &local)
                })
                .await;
                let uploaded = match exported {
                    Ok(pin) => s3.upload(&staged, &archive.key()).await.map(|()| pin),
                    Err(e) => Err(e),
                };
                let _ = std::fs::remove_file(&staged);
                uploaded?
            }
        };
        let pins: Vec<String> = [pin].into_iter().chain(base_pins).collect();
        store
            .record_pins(id, &pins)
            .map_err(|e| format!("recording the pins of {id}: {e}"))?;
        Ok(self.pinned_uri(&archive, &pins))
    }

    /// The local directory of the snapshot `uri` names, fetched into `store` first if this
    /// node does not have it yet, with every base under it that it lacks (bases first),
    /// each checked against its pin in `uri` and against `limits`.
    pub async fn fetch(
        &self,
        uri: &str,
        store: &LocalStore,
        limits: FetchLimits,
    ) -> Result<PathBuf, String> {
        let top = self
            .archive_of(uri)
            .ok_or_else(|| format!("{uri} is not an archive of {}", self.describe()))?;
        let local = store.dir(&top.id).map_err(|e| e.to_string())?;
        if local.is_dir() {
            // This node's own copy (taken here, or fetched and checked before).
            return Ok(local);
        }
        let pins = pins_of(uri).ok_or_else(|| {
            format!(
                "{uri} carries no pin of its archive's digest (recorded by an agentvm older \
                 than pinning, or altered): refusing to trust {} for it",
                self.describe()
            )
        })?;
        // Down the chain to the first snapshot this node has (or a flattened archive).
        let mut missing = Vec::new();
        let mut next = Some(top);
        while let Some(archive) = next.take() {
            let depth = missing.len();
            let Some(pinned) = pins.get(depth..).filter(|rest| !rest.is_empty()) else {
                return Err(format!(
                    "{uri}: the store's chain is deeper than the {} archives its pins name",
                    pins.len()
                ));
            };
            if store.dir(&archive.id).map_err(|e| e.to_string())?.is_dir() {
                // This node's own copy; if it came through the store, the same chain.
                match store.pins(&archive.id).map_err(|e| e.to_string())? {
                    Some(here) if here != pinned => {
                        return Err(format!(
                            "{uri}: this node's copy of {} was fetched under other pins",
                            archive.id
                        ));
                    }
                    _ => break,
                }
            }
            if archive.base.is_none() && pinned.len() != 1 {
                return Err(format!(
                    "{uri}: the store holds {} flattened, where its pins name a chain of {}",
                    archive.id,
                    pins.len()
                ));
            }
            if let Some(base) = &archive.base {
                next = Some(self.locate(base, None).await?.ok_or_else(|| {
                    format!(
                        "{uri}: its base snapshot {base} is neither on this node nor in {}",
                        self.describe()
                    )
                })?);
            }
            missing.push(archive);
        }
        let started = std::time::Instant::now();
        for (depth, archive) in missing.iter().enumerate().rev() {
            self.fetch_one(archive, store, &pins[depth..], limits)
                .await?;
        }
        if !missing.is_empty() {
            tracing::info!(
                uri,
                archives = missing.len(),
                ms = started.elapsed().as_millis() as u64,
                "fetched a snapshot from the fleet's store"
            );
        }
        Ok(local)
    }

    /// Fetches one archive into `store` (whose base, if any, is there already): `pins` are
    /// its chain's from itself down; the first is its own.
    async fn fetch_one(
        &self,
        archive: &Archive,
        store: &LocalStore,
        pins: &[String],
        limits: FetchLimits,
    ) -> Result<PathBuf, String> {
        let (owned_store, owned_archive) = (store.clone(), archive.clone());
        let mut import_limits = ImportLimits {
            pin: pins.first().cloned(),
            max_file_bytes: limits.max_file_bytes,
            max_written_bytes: limits.budget(store)?,
        };
        let fetched = match self {
            Self::Dir(dir) => {
                let path = Self::path(dir, archive);
                blocking("fetching", move || {
                    import(&owned_store, &owned_archive, &path, &import_limits)
                })
                .await
            }
            Self::S3(s3) => {
                let staged = staging(store, "download", archive);
                let downloaded = s3
                    .download(&archive.key(), &staged, import_limits.max_written_bytes)
                    .await;
                let fetched = match downloaded {
                    Ok(()) => {
                        // What the download took is not there for the import to write.
                        let staged_bytes = std::fs::metadata(&staged).map_or(0, |m| m.len());
                        import_limits.max_written_bytes =
                            import_limits.max_written_bytes.saturating_sub(staged_bytes);
                        let local = staged.clone();
                        blocking("fetching", move || {
                            import(&owned_store, &owned_archive, &local, &import_limits)
                        })
                        .await
                    }
                    Err(e) => Err(e),
                };
                let _ = std::fs::remove_file(&staged);
                fetched
            }
        }?;
        store
            .record_pins(&archive.id, pins)
            .map_err(|e| format!("recording the pins of {}: {e}", archive.id))?;
        Ok(fetched)
    }

    /// The archives of `session` (all, if `None`) with when each was published.
    pub async fn list(&self, session: Option<&str>) -> Result<Vec<(Archive, SystemTime)>, String> {
        let found = match self {
            Self::Dir(dir) => {
                let dir = dir.clone();
                let session = session.map(str::to_owned);
                blocking("listing", move || list_dir(&dir, session.as_deref())).await?
            }
            Self::S3(s3) => s3.list(session).await?,
        };
        let mut archives: Vec<(Archive, SystemTime)> = found
            .into_iter()
            .filter_map(|(key, at)| Some((Archive::from_key(&key)?, at)))
            .collect();
        archives.sort();
        Ok(archives)
    }

    /// Removes `archive` (gone already is fine).
    pub async fn remove(&self, archive: &Archive) -> Result<(), String> {
        match self {
            Self::Dir(dir) => {
                let path = Self::path(dir, archive);
                match std::fs::remove_file(&path) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(format!("removing {}: {e}", path.display())),
                }
                // The session's directory goes with its last archive.
                if let Some(parent) = path.parent() {
                    let _ = std::fs::remove_dir(parent);
                }
                Ok(())
            }
            Self::S3(s3) => s3.remove(&archive.key()).await,
        }
    }

    /// Deletes the archives `unwanted` picks, each once no archive still there is layered
    /// on it (layers go before their bases, and a base stays while anything kept needs it).
    /// Returns how many went.
    pub async fn sweep(
        &self,
        unwanted: impl Fn(&Archive, SystemTime) -> bool,
    ) -> Result<usize, String> {
        let (mut doomed, kept): (Vec<_>, Vec<_>) = self
            .list(None)
            .await?
            .into_iter()
            .partition(|(archive, at)| unwanted(archive, *at));
        let bases_kept: HashSet<String> = kept.into_iter().filter_map(|(a, _)| a.base).collect();
        let mut removed = 0;
        loop {
            let bases_doomed: HashSet<String> =
                doomed.iter().filter_map(|(a, _)| a.base.clone()).collect();
            let (free, held): (Vec<_>, Vec<_>) = doomed
                .into_iter()
                .partition(|(a, _)| !bases_kept.contains(&a.id) && !bases_doomed.contains(&a.id));
            if free.is_empty() {
                break;
            }
            for (archive, _) in &free {
                self.remove(archive).await?;
                removed += 1;
            }
            doomed = held;
        }
        Ok(removed)
    }

    pub fn describe(&self) -> String {
        match self {
            Self::Dir(dir) => format!("file://{}", dir.display()),
            Self::S3(s3) => s3.describe(),
        }
    }
}

/// `SESSION/NAME` paths of the archives under `dir` (of one session's directory, if given),
/// with their modification times.
fn list_dir(dir: &Path, session: Option<&str>) -> Result<Vec<(String, SystemTime)>, String> {
    let sessions: Vec<String> = match session {
        Some(session) => vec![session.to_owned()],
        None => match std::fs::read_dir(dir) {
            Ok(entries) => entries
                .filter_map(|e| e.ok())
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .filter_map(|e| e.file_name().into_string().ok())
                .collect(),
            Err(e) => return Err(format!("listing {}: {e}", dir.display())),
        },
    };
    let mut found = Vec::new();
    for session in sessions {
        let entries = match std::fs::read_dir(dir.join(&session)) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(format!("listing {}/{session}: {e}", dir.display())),
        };
        for entry in entries.filter_map(|e| e.ok()) {
            let Ok(name) = entry.file_name().into_string() else {
                continue;
            };
            let at = entry
                .metadata()
                .and_then(|m| m.modified())
                .unwrap_or(SystemTime::UNIX_EPOCH);
            found.push((format!("{session}/{name}"), at));
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;
    use agentvm_snapshot::SnapshotWriter;
    use agentvm_snapshot::manifest::{
        DigestKind, HostIdentity, MEMORY_FILE, MemoryLayout, STATE_FILE,
    };
    use agentvm_snapshot::pages;
    use std::os::unix::fs::FileExt;

    const MEMORY: u64 = 1 << 20;
    /// What a session of the tests' snapshots may fetch: its memory, the whole disk.
    const LIMITS: FetchLimits = FetchLimits {
        max_file_bytes: MEMORY,
        min_free_bytes: 0,
    };

    /// Writes snapshot `id` into `store`: `pages` of guest memory (index, byte), layered on
    /// `base` if given.
    pub(super) fn snapshot_in(
        store: &LocalStore,
        id: &str,
        pages: &[(u64, u8)],
        base: Option<&str>,
    ) {
        let dir = store.create_dir(id).unwrap();
        let mut w = SnapshotWriter::create(&dir, false).unwrap();
        w.write_file(STATE_FILE, format!("{{\"id\":\"{id}\"}}").as_bytes())
            .unwrap();
        let memory = File::create_new(dir.join(MEMORY_FILE)).unwrap();
        memory.set_len(MEMORY).unwrap();
        for (index, byte) in pages {
            memory
                .write_all_at(&[*byte; 4096], index * pages::PAGE_SIZE)
                .unwrap();
        }
        let (kind, digest) = match base {
            Some(_) => (
                DigestKind::LayerPages,
                pages::layer_digest(&memory).unwrap().0,
            ),
            None => (DigestKind::Pages, pages::file_digest(&memory).unwrap().0),
        };
        w.add_memory_file(MEMORY_FILE, kind, digest).unwrap();
        w.finish(
            HostIdentity::current("PVM"),
            "t",
            MemoryLayout {
                size: MEMORY,
                base: base.map(|b| store.get(b).unwrap().base_ref()),
            },
        )
        .unwrap();
    }

    /// Guest memory page `index` of the snapshot in `dir`, composed over its bases.
    fn page_of(store: &LocalStore, id: &str, index: u64) -> u8 {
        let chain = store.get(id).unwrap().chain().unwrap();
        let mut byte = 0;
        for layer in &chain {
            let file = File::open(layer.path(MEMORY_FILE)).unwrap();
            let stored = pages::data_extents(&file)
                .unwrap()
                .iter()
                .any(|(at, len)| (*at..at + len).contains(&(index * pages::PAGE_SIZE)));
            if stored {
                let mut page = [0u8; 4096];
                file.read_exact_at(&mut page, index * pages::PAGE_SIZE)
                    .unwrap();
                byte = page[0];
            }
        }
        byte
    }

    fn staged_files(store: &Path) -> usize {
        std::fs::read_dir(store)
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                name.starts_with(".upload-") || name.starts_with(".download-")
            })
            .count()
    }

    /// Publishes a snapshot and a layer on it from one store through `remote`, fetches the
    /// layer (with its base) into others, and sweeps them away; `damage(key)` breaks the
    /// object at `key` (below the remote's root), after which a store fetching it takes
    /// nothing in.
    pub(super) async fn round_trip(remote: &SnapshotRemote, damage: impl Fn(&str)) {
        let dirs: Vec<_> = (0..4).map(|_| tempfile::tempdir().unwrap()).collect();
        let stores: Vec<LocalStore> = dirs
            .iter()
            .map(|d| LocalStore::open(d.path()).unwrap())
            .collect();
        let (a, b, c, d) = (&stores[0], &stores[1], &stores[2], &stores[3]);
        snapshot_in(a, "sess-7-1", &[(1, 1), (2, 2)], None);
        let base_uri = remote.publish(a, "sess-7-1").await.unwrap();
        assert_eq!(
            remote.archive_of(&base_uri),
            Some(Archive {
                id: "sess-7-1".into(),
                base: None
            })
        );
        // A layer on a published snapshot goes as a layer, named after its base.
        snapshot_in(a, "sess-7-2", &[(2, 22), (5, 5)], Some("sess-7-1"));
        let layer_uri = remote.publish(a, "sess-7-2").await.unwrap();
        assert!(
            layer_uri.contains("/sess/7-2@7-1.agvmsnap#sha256="),
            "{layer_uri}"
        );
        // Its pins: its own manifest's digest, then its base's.
        let pins = pins_of(&layer_uri).unwrap();
        assert_eq!(pins.len(), 2);
        assert_eq!(pins[1..], pins_of(&base_uri).unwrap()[..]);

        // The node that took it uses its own copy; another fetches the chain.
        assert_eq!(
            remote.fetch(&layer_uri, a, LIMITS).await.unwrap(),
            a.dir("sess-7-2").unwrap()
        );
        let fetched = remote.fetch(&layer_uri, b, LIMITS).await.unwrap();
        assert_eq!(fetched, b.dir("sess-7-2").unwrap());
        assert_eq!(b.base_of("sess-7-2").unwrap().as_deref(), Some("sess-7-1"));
        b.get("sess-7-2").unwrap().chain().unwrap();
        for (index, want) in [(1, 1), (2, 22), (5, 5), (3, 0)] {
            assert_eq!(page_of(b, "sess-7-2", index), want, "page {index}");
        }
        // A layer published from the fetching node names the same base.
        snapshot_in(b, "sess-8-1", &[(3, 3)], Some("sess-7-2"));
        let on_fetched = remote.publish(b, "sess-8-1").await.unwrap();
        assert!(
            on_fetched.contains("/sess/8-1@7-2.agvmsnap#sha256="),
            "{on_fetched}"
        );
        assert_eq!(pins_of(&on_fetched).unwrap()[1..], pins[..]);
        remote.fetch(&on_fetched, c, LIMITS).await.unwrap();
        for (index, want) in [(1, 1), (2, 22), (3, 3), (5, 5)] {
            assert_eq!(page_of(c, "sess-8-1", index), want, "page {index}");
        }
        for store in &dirs {
            assert_eq!(staged_files(store.path()), 0, "a staging file was left");
        }

        // A damaged base fails the whole fetch and leaves nothing in the store.
        damage("sess/7-1.agvmsnap");
        assert!(remote.fetch(&layer_uri, d, LIMITS).await.is_err());
        assert!(d.list().unwrap().is_empty());
        // So does a base replaced by a self-consistent archive of other memory (as whoever
        // can write the store can make): only the pin tells.
        let other = tempfile::tempdir().unwrap();
        let other = LocalStore::open(other.path()).unwrap();
        snapshot_in(&other, "sess-7-1", &[(1, 66)], None);
        remote.publish(&other, "sess-7-1").await.unwrap();
        let err = remote.fetch(&layer_uri, d, LIMITS).await.unwrap_err();
        assert!(err.contains("was replaced"), "{err}");
        assert!(d.list().unwrap().is_empty());
        // A URI without its pins, or with a chain cut short, is not fetched at all.
        let unpinned = remote.uri(&remote.archive_of(&layer_uri).unwrap());
        let err = remote.fetch(&unpinned, d, LIMITS).await.unwrap_err();
        assert!(err.contains("carries no pin"), "{err}");
        let cut = format!("{unpinned}{PIN_MARK}{}", pins[0]);
        let err = remote.fetch(&cut, d, LIMITS).await.unwrap_err();
        assert!(err.contains("deeper than"), "{err}");
        // Caps: a file larger than the session's VM has, or no room above the reserve.
        let small = FetchLimits {
            max_file_bytes: MEMORY / 2,
            ..LIMITS
        };
        let err = remote.fetch(&on_fetched, d, small).await.unwrap_err();
        assert!(err.contains("this import allows"), "{err}");
        let reserved = FetchLimits {
            min_free_bytes: u64::MAX,
            ..LIMITS
        };
        let err = remote.fetch(&on_fetched, d, reserved).await.unwrap_err();
        assert!(err.contains("reserve"), "{err}");
        assert!(d.list().unwrap().is_empty());

        // Sweeping: a base stays while a layer kept is on it; layers go before bases.
        let unwanted = |ids: &'static [&'static str]| {
            move |archive: &Archive, _at: SystemTime| ids.contains(&archive.id.as_str())
        };
        assert_eq!(remote.sweep(unwanted(&["sess-7-1"])).await.unwrap(), 0);
        assert_eq!(
            remote
                .sweep(unwanted(&["sess-7-1", "sess-8-1"]))
                .await
                .unwrap(),
            1
        );
        assert_eq!(remote.list(None).await.unwrap().len(), 2);
        assert_eq!(remote.sweep(|_, _| true).await.unwrap(), 2);
        assert!(remote.list(None).await.unwrap().is_empty());
        assert!(remote.fetch(&base_uri, d, LIMITS).await.is_err());
    }

    #[tokio::test]
    async fn layers_published_to_a_bucket_are_fetched_as_chains_and_swept() {
        let server = match crate::testing::TestS3::start() {
            Ok(server) => server,
            Err(why) => {
                println!("SKIPPED: no S3-compatible server to test against: {why}");
                return;
            }
        };
        let remote = SnapshotRemote::S3(
            S3Remote::with_vars("agentvm/fleet/snapshots", server.env()).unwrap(),
        );
        assert_eq!(
            remote.uri(&Archive {
                id: "s-1-1".into(),
                base: None
            }),
            "s3://agentvm/fleet/snapshots/s/1-1.agvmsnap"
        );
        round_trip(&remote, |key| {
            let object = server.object_file(&format!("fleet/snapshots/{key}"));
            let mut bytes = std::fs::read(&object).unwrap();
            let middle = bytes.len() / 2;
            bytes[middle] ^= 0xff;
            std::fs::write(&object, &bytes).unwrap();
        })
        .await;
        assert!(server.objects().is_empty(), "{:?}", server.objects());
    }

    #[tokio::test]
    async fn an_unreachable_bucket_fails_the_publish_and_leaves_nothing() {
        let mut server = match crate::testing::TestS3::start() {
            Ok(server) => server,
            Err(why) => {
                println!("SKIPPED: no S3-compatible server to test against: {why}");
                return;
            }
        };
        let remote = SnapshotRemote::S3(S3Remote::with_vars("agentvm/p", server.env()).unwrap());
        let dir = tempfile::tempdir().unwrap();
        let store = LocalStore::open(dir.path()).unwrap();
        snapshot_in(&store, "s-2-1", &[(1, 1)], None);
        server.pause();
        let err = remote.publish(&store, "s-2-1").await.unwrap_err();
        assert!(err.contains("s3://agentvm/p/s/2-1.agvmsnap"), "{err}");
        assert_eq!(staged_files(dir.path()), 0);
        server.resume().unwrap();
        let uri = remote.publish(&store, "s-2-1").await.unwrap();
        assert_eq!(
            remote.archive_of(&uri).map(|a| a.id).as_deref(),
            Some("s-2-1")
        );
        assert_eq!(server.objects(), ["2-1.agvmsnap"]);
    }

    #[test]
    fn urls_name_a_directory_the_fleet_shares_or_a_bucket() {
        match "file:///srv/snaps/".parse::<SnapshotRemote>() {
            Ok(SnapshotRemote::Dir(dir)) => assert_eq!(dir, Path::new("/srv/snaps")),
            other => panic!("{other:?}"),
        }
        assert!(
            "file://relative"
                .parse::<SnapshotRemote>()
                .unwrap_err()
                .contains("absolute")
        );
        assert!(
            "gs://bucket/prefix"
                .parse::<SnapshotRemote>()
                .unwrap_err()
                .contains("s3://BUCKET/PREFIX")
        );
        let layer = Archive {
            id: "s-1-2".into(),
            base: Some("p-3-1".into()),
        };
        let s3 = SnapshotRemote::S3(S3Remote::with_vars("b/x/y/", Vec::new()).unwrap());
        assert_eq!(s3.uri(&layer), "s3://b/x/y/s/1-2@p-3-1.agvmsnap");
        assert_eq!(s3.archive_of(&s3.uri(&layer)), Some(layer.clone()));
        for other in [
            "s3://c/x/y/s/s-1-1.agvmsnap",
            "s3://b/x/s/s-1-1.agvmsnap",
            "s3://b/x/y/s/s-1-1",
            "s3://b/x/y/t/s-1-1.agvmsnap",
            "s3://b/x/y/s-1-1.agvmsnap",
            "s3://b/x/y/s/1-1@.agvmsnap",
            "s3://b/x/y/s/1-1@a@b.agvmsnap",
            "s3://b/x/y/s/s-1-1.agvmsnap",
            "s3://b/x/y/s/1-1@s-1-0.agvmsnap",
            "file:///x/y/s/s-1-1.agvmsnap",
        ] {
            assert_eq!(s3.archive_of(other), None, "{other}");
        }
        assert!(
            S3Remote::with_vars("/x", Vec::new())
                .unwrap_err()
                .contains("bucket")
        );
        let remote = SnapshotRemote::Dir(PathBuf::from("/srv/snaps"));
        assert_eq!(remote.uri(&layer), "file:///srv/snaps/s/1-2@p-3-1.agvmsnap");
        assert_eq!(remote.archive_of(&remote.uri(&layer)), Some(layer));
        for other in [
            "file:///srv/snaps/s/s-1-1",
            "file:///srv/other/s/s-1-1.agvmsnap",
            "file:///srv/snaps/s/.s-1-1.agvmsnap",
            "file:///srv/snaps/s/../s/s-1-1.agvmsnap",
            "s3://srv/snaps/s/s-1-1.agvmsnap",
        ] {
            assert_eq!(remote.archive_of(other), None, "{other}");
        }
    }

    #[test]
    fn snapshot_ids_name_their_session_and_shorten_inside_its_directory() {
        use super::super::snapshot_owner;
        assert_eq!(snapshot_owner("sess-f00d-3fk9x2-12"), Some("sess-f00d"));
        assert_eq!(
            snapshot_owner("sess-f00d-4711-0"),
            Some("sess-f00d"),
            "a PID epoch"
        );
        for not_ours in [
            "sess-f00d-3fk9x2-",
            "sess-f00d-3FK-1",
            "-3fk-1",
            "3fk-1",
            "x",
        ] {
            assert_eq!(snapshot_owner(not_ours), None, "{not_ours}");
        }
        let own = Archive {
            id: "sess-f00d-3fk-2".into(),
            base: Some("sess-f00d-3fk-1".into()),
        };
        assert_eq!(own.key(), "sess-f00d/3fk-2@3fk-1.agvmsnap");
        let on_parent = Archive {
            id: "sess-c1-9z-0".into(),
            base: Some("sess-f00d-3fk-1".into()),
        };
        assert_eq!(on_parent.key(), "sess-c1/9z-0@sess-f00d-3fk-1.agvmsnap");
        let stray = Archive {
            id: "snapshot".into(),
            base: None,
        };
        assert_eq!(stray.key(), "_/snapshot.agvmsnap");
        // A turn's checkpoints go in their session's directory, as short.
        let checkpoint = Archive {
            id: "ckpt.sess-f00d-3fk-4".into(),
            base: Some("ckpt.sess-f00d-3fk-3".into()),
        };
        assert_eq!(checkpoint.key(), "sess-f00d/ckpt.3fk-4@ckpt.3fk-3.agvmsnap");
        let over_its_restore = Archive {
            id: "ckpt.sess-f00d-3fk-5".into(),
            base: Some("sess-f00d-3fk-2".into()),
        };
        assert_eq!(
            over_its_restore.key(),
            "sess-f00d/ckpt.3fk-5@3fk-2.agvmsnap"
        );
        for archive in [own, on_parent, stray, checkpoint, over_its_restore] {
            assert_eq!(Archive::from_key(&archive.key()), Some(archive));
        }
    }

    #[tokio::test]
    async fn layers_published_to_a_shared_directory_are_fetched_as_chains_and_swept() {
        let shared = tempfile::tempdir().unwrap();
        let remote = SnapshotRemote::Dir(shared.path().to_owned());
        let root = shared.path().to_owned();
        round_trip(&remote, |key| {
            let archive = root.join(key);
            let mut bytes = std::fs::read(&archive).unwrap();
            let middle = bytes.len() / 2;
            bytes[middle] ^= 0xff;
            std::fs::write(&archive, &bytes).unwrap();
        })
        .await;
        assert_eq!(
            std::fs::read_dir(shared.path()).unwrap().count(),
            0,
            "nothing but archives is ever left in the shared directory"
        );
    }
}
