//! Where a fleet keeps its snapshots, so a session suspended on one node resumes on any
//! other: `--snapshot-url file:///DIR` names a directory every node mounts (a shared
//! filesystem). A snapshot taken into a node's local store is published there as one
//! portable archive (the snapshot crate's, flattened: it depends on nothing else), and the
//! journal records the archive's URI. A node restoring a snapshot it lacks fetches the
//! archive into its own store (every digest checked) and restores `MAP_PRIVATE` from
//! there; the node that took it restores from its own copy at once.

use std::fs::File;
use std::io::{BufReader, BufWriter};
use std::path::{Path, PathBuf};

use agentvm_snapshot::LocalStore;

/// How a published archive's file name ends.
const ARCHIVE_SUFFIX: &str = ".agvmsnap";

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SnapshotRemote {
    /// A directory on a filesystem the fleet shares.
    Dir(PathBuf),
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
            _ => Err(format!(
                "snapshot_url {url:?}: only file:///DIR (a directory the fleet shares) is \
                 supported"
            )),
        }
    }
}

impl SnapshotRemote {
    fn archive(&self, id: &str) -> PathBuf {
        match self {
            Self::Dir(dir) => dir.join(format!("{id}{ARCHIVE_SUFFIX}")),
        }
    }

    /// The URI the journal records for snapshot `id` once published.
    pub fn uri(&self, id: &str) -> String {
        format!("file://{}", self.archive(id).display())
    }

    /// The snapshot a URI of this remote names, or `None` for any other URI.
    pub fn id_of(&self, uri: &str) -> Option<String> {
        let Self::Dir(dir) = self;
        let path = Path::new(uri.strip_prefix("file://")?);
        if path.parent() != Some(dir.as_path()) {
            return None;
        }
        let name = path.file_name()?.to_str()?.strip_suffix(ARCHIVE_SUFFIX)?;
        (!name.is_empty() && !name.starts_with('.')).then(|| name.to_owned())
    }

    /// Publishes snapshot `id` of `store`: written under a temporary name, synced, then
    /// renamed into place, so no node ever reads half an archive. Returns its URI.
    pub fn publish(&self, store: &LocalStore, id: &str) -> Result<String, String> {
        let target = self.archive(id);
        let Self::Dir(dir) = self;
        let partial = dir.join(format!(".{id}.{}.partial", std::process::id()));
        let written = (|| -> Result<(), String> {
            let file = File::create(&partial)
                .map_err(|e| format!("creating {}: {e}", partial.display()))?;
            let mut out = BufWriter::new(file);
            store
                .export(id, &mut out)
                .map_err(|e| format!("writing snapshot {id} to {}: {e}", partial.display()))?;
            let file = out
                .into_inner()
                .map_err(|e| format!("writing {}: {e}", partial.display()))?;
            file.sync_all()
                .map_err(|e| format!("syncing {}: {e}", partial.display()))?;
            std::fs::rename(&partial, &target)
                .map_err(|e| format!("publishing {}: {e}", target.display()))?;
            File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(|e| format!("syncing {}: {e}", dir.display()))
        })();
        if let Err(e) = written {
            let _ = std::fs::remove_file(&partial);
            return Err(e);
        }
        Ok(self.uri(id))
    }

    /// The local directory of the snapshot `uri` names, fetched into `store` first if this
    /// node does not have it yet.
    pub fn fetch(&self, uri: &str, store: &LocalStore) -> Result<PathBuf, String> {
        let id = self
            .id_of(uri)
            .ok_or_else(|| format!("{uri} is not an archive of {}", self.describe()))?;
        let local = store.dir(&id).map_err(|e| e.to_string())?;
        if local.is_dir() {
            return Ok(local);
        }
        let archive = self.archive(&id);
        let file =
            File::open(&archive).map_err(|e| format!("opening {}: {e}", archive.display()))?;
        let started = std::time::Instant::now();
        let dir = store
            .fetch(&id, BufReader::new(file))
            .map_err(|e| format!("fetching {}: {e}", archive.display()))?;
        tracing::info!(snapshot = %id, ms = started.elapsed().as_millis() as u64,
            "fetched a snapshot from the fleet's store");
        Ok(dir)
    }

    /// Removes the published archive of `id` (gone already is fine).
    pub fn remove(&self, id: &str) -> Result<(), String> {
        let archive = self.archive(id);
        match std::fs::remove_file(&archive) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(format!("removing {}: {e}", archive.display())),
        }
    }

    pub fn describe(&self) -> String {
        let Self::Dir(dir) = self;
        format!("file://{}", dir.display())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use agentvm_snapshot::SnapshotWriter;
    use agentvm_snapshot::manifest::{HostIdentity, MemoryLayout, STATE_FILE};

    fn snapshot_in(store: &LocalStore, id: &str) {
        let dir = store.create_dir(id).unwrap();
        let mut w = SnapshotWriter::create(&dir, false).unwrap();
        w.write_file(STATE_FILE, b"{\"vcpus\":1}").unwrap();
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
    fn urls_name_a_directory_the_fleet_shares() {
        assert_eq!(
            "file:///srv/snaps/".parse::<SnapshotRemote>(),
            Ok(SnapshotRemote::Dir(PathBuf::from("/srv/snaps")))
        );
        assert!(
            "file://relative"
                .parse::<SnapshotRemote>()
                .unwrap_err()
                .contains("absolute")
        );
        assert!(
            "s3://bucket/prefix"
                .parse::<SnapshotRemote>()
                .unwrap_err()
                .contains("file:///DIR")
        );
        let remote = SnapshotRemote::Dir(PathBuf::from("/srv/snaps"));
        assert_eq!(remote.id_of(&remote.uri("s-1")), Some("s-1".into()));
        for other in [
            "file:///srv/snaps/s-1",
            "file:///srv/other/s-1.agvmsnap",
            "file:///srv/snaps/.s-1.agvmsnap",
            "s3://srv/snaps/s-1.agvmsnap",
        ] {
            assert_eq!(remote.id_of(other), None, "{other}");
        }
    }

    #[test]
    fn a_published_snapshot_is_fetched_whole_into_another_store() {
        let (a, b, shared) = (
            tempfile::tempdir().unwrap(),
            tempfile::tempdir().unwrap(),
            tempfile::tempdir().unwrap(),
        );
        let (store_a, store_b) = (
            LocalStore::open(a.path()).unwrap(),
            LocalStore::open(b.path()).unwrap(),
        );
        let remote = SnapshotRemote::Dir(shared.path().to_owned());
        snapshot_in(&store_a, "snap-1");
        let uri = remote.publish(&store_a, "snap-1").unwrap();
        assert_eq!(
            std::fs::read_dir(shared.path()).unwrap().count(),
            1,
            "nothing but the archive is left in the shared directory"
        );
        // The node that took it uses its own copy; another fetches the archive.
        assert_eq!(
            remote.fetch(&uri, &store_a).unwrap(),
            store_a.dir("snap-1").unwrap()
        );
        let fetched = remote.fetch(&uri, &store_b).unwrap();
        assert_eq!(fetched, store_b.dir("snap-1").unwrap());
        let copy = store_b.get("snap-1").unwrap();
        copy.verify().unwrap();
        assert_eq!(
            std::fs::read(fetched.join(STATE_FILE)).unwrap(),
            b"{\"vcpus\":1}"
        );
        // A damaged archive is refused and leaves nothing in the store.
        let archive = remote.archive("snap-1");
        let mut bytes = std::fs::read(&archive).unwrap();
        let middle = bytes.len() / 2;
        bytes[middle] ^= 0xff;
        std::fs::write(&archive, &bytes).unwrap();
        let c = tempfile::tempdir().unwrap();
        let store_c = LocalStore::open(c.path()).unwrap();
        assert!(remote.fetch(&uri, &store_c).is_err());
        assert!(store_c.list().unwrap().is_empty());
        remote.remove("snap-1").unwrap();
        remote.remove("snap-1").unwrap();
        assert!(
            remote
                .fetch(&uri, &store_c)
                .unwrap_err()
                .contains("opening")
        );
    }
}
