//! Where a fleet keeps its snapshots, so a session suspended on one node resumes on any
//! other (`--snapshot-url`):
//! - `file:///DIR`: a directory every node mounts (a shared filesystem);
//! - `s3://BUCKET/PREFIX`: an S3-compatible object store (endpoint, region and credentials
//!   from the standard `AWS_ENDPOINT_URL`, `AWS_REGION`, `AWS_ACCESS_KEY_ID` and
//!   `AWS_SECRET_ACCESS_KEY`; `remote/s3.rs`).
//!
//! A snapshot taken into a node's local store is published as one portable archive (the
//! snapshot crate's, flattened: it depends on nothing else), and the journal records the
//! archive's URI. A node restoring a snapshot it lacks fetches the archive into its own
//! store (every digest checked) and restores `MAP_PRIVATE` from there; the node that took
//! it restores from its own copy at once.

mod s3;

use std::fs::File;
use std::io::{BufReader, BufWriter};
use std::path::{Path, PathBuf};

use agentvm_snapshot::LocalStore;

pub use self::s3::S3Remote;

/// How a published archive's name ends.
const ARCHIVE_SUFFIX: &str = ".agvmsnap";

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

/// `ID.agvmsnap` → `ID`.
fn id_in(name: &str) -> Option<String> {
    let id = name.strip_suffix(ARCHIVE_SUFFIX)?;
    (!id.is_empty() && !id.starts_with('.') && !id.contains('/')).then(|| id.to_owned())
}

/// Exports snapshot `id` of `store` into `to` as an archive, synced.
fn export(store: &LocalStore, id: &str, to: &Path) -> Result<(), String> {
    let file = File::create(to).map_err(|e| format!("creating {}: {e}", to.display()))?;
    let mut out = BufWriter::new(file);
    store
        .export(id, &mut out)
        .map_err(|e| format!("writing snapshot {id} to {}: {e}", to.display()))?;
    out.into_inner()
        .map_err(|e| format!("writing {}: {e}", to.display()))?
        .sync_all()
        .map_err(|e| format!("syncing {}: {e}", to.display()))
}

/// Imports the archive at `from` into `store` as `id`.
fn import(store: &LocalStore, id: &str, from: &Path) -> Result<PathBuf, String> {
    let file = File::open(from).map_err(|e| format!("opening {}: {e}", from.display()))?;
    store
        .fetch(id, BufReader::new(file))
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

impl SnapshotRemote {
    fn archive(dir: &Path, id: &str) -> PathBuf {
        dir.join(format!("{id}{ARCHIVE_SUFFIX}"))
    }

    /// The URI the journal records for snapshot `id` once published.
    pub fn uri(&self, id: &str) -> String {
        match self {
            Self::Dir(dir) => format!("file://{}", Self::archive(dir, id).display()),
            Self::S3(s3) => s3.uri(id),
        }
    }

    /// The snapshot a URI of this remote names, or `None` for any other URI.
    pub fn id_of(&self, uri: &str) -> Option<String> {
        match self {
            Self::Dir(dir) => {
                let path = Path::new(uri.strip_prefix("file://")?);
                if path.parent() != Some(dir.as_path()) {
                    return None;
                }
                id_in(path.file_name()?.to_str()?)
            }
            Self::S3(s3) => s3.id_of(uri),
        }
    }

    /// Publishes snapshot `id` of `store`, so that no node ever reads half an archive: in a
    /// directory, written under a temporary name, synced and renamed into place; in a
    /// bucket, uploaded in parts that appear as one object when the upload completes.
    /// Returns its URI.
    pub async fn publish(&self, store: &LocalStore, id: &str) -> Result<String, String> {
        let (store, owned_id) = (store.clone(), id.to_owned());
        match self {
            Self::Dir(dir) => {
                let (dir, target) = (dir.clone(), Self::archive(dir, id));
                blocking("publishing", move || {
                    let partial = dir.join(format!(".{owned_id}.{}.partial", std::process::id()));
                    let written = export(&store, &owned_id, &partial).and_then(|()| {
                        std::fs::rename(&partial, &target)
                            .map_err(|e| format!("publishing {}: {e}", target.display()))?;
                        File::open(&dir)
                            .and_then(|d| d.sync_all())
                            .map_err(|e| format!("syncing {}: {e}", dir.display()))
                    });
                    if written.is_err() {
                        let _ = std::fs::remove_file(&partial);
                    }
                    written
                })
                .await?;
            }
            Self::S3(s3) => {
                let staging = store
                    .root()
                    .join(format!(".upload-{id}-{}", std::process::id()));
                let local = staging.clone();
                blocking("publishing", move || export(&store, &owned_id, &local)).await?;
                let uploaded = s3.upload(&staging, id).await;
                let _ = std::fs::remove_file(&staging);
                uploaded?;
            }
        }
        Ok(self.uri(id))
    }

    /// The local directory of the snapshot `uri` names, fetched into `store` first if this
    /// node does not have it yet.
    pub async fn fetch(&self, uri: &str, store: &LocalStore) -> Result<PathBuf, String> {
        let id = self
            .id_of(uri)
            .ok_or_else(|| format!("{uri} is not an archive of {}", self.describe()))?;
        let local = store.dir(&id).map_err(|e| e.to_string())?;
        if local.is_dir() {
            return Ok(local);
        }
        let started = std::time::Instant::now();
        let (owned_store, owned_id) = (store.clone(), id.clone());
        let dir = match self {
            Self::Dir(dir) => {
                let archive = Self::archive(dir, &id);
                blocking("fetching", move || {
                    import(&owned_store, &owned_id, &archive)
                })
                .await?
            }
            Self::S3(s3) => {
                let staging = store
                    .root()
                    .join(format!(".download-{id}-{}", std::process::id()));
                let fetched = match s3.download(&id, &staging).await {
                    Ok(()) => {
                        let local = staging.clone();
                        blocking("fetching", move || import(&owned_store, &owned_id, &local)).await
                    }
                    Err(e) => Err(e),
                };
                let _ = std::fs::remove_file(&staging);
                fetched?
            }
        };
        tracing::info!(snapshot = %id, ms = started.elapsed().as_millis() as u64,
            "fetched a snapshot from the fleet's store");
        Ok(dir)
    }

    /// Removes the published archive of `id` (gone already is fine).
    pub async fn remove(&self, id: &str) -> Result<(), String> {
        match self {
            Self::Dir(dir) => {
                let archive = Self::archive(dir, id);
                match std::fs::remove_file(&archive) {
                    Ok(()) => Ok(()),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                    Err(e) => Err(format!("removing {}: {e}", archive.display())),
                }
            }
            Self::S3(s3) => s3.remove(id).await,
        }
    }

    pub fn describe(&self) -> String {
        match self {
            Self::Dir(dir) => format!("file://{}", dir.display()),
            Self::S3(s3) => s3.describe(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use agentvm_snapshot::SnapshotWriter;
    use agentvm_snapshot::manifest::{HostIdentity, MemoryLayout, STATE_FILE};

    pub(super) fn snapshot_in(store: &LocalStore, id: &str) {
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

    /// Publishes a snapshot from one store through `remote` and fetches it into another,
    /// then damages the archive through `damage` and checks a third store refuses it.
    pub(super) async fn round_trip(remote: &SnapshotRemote, damage: impl FnOnce()) {
        let (a, b, c) = (
            tempfile::tempdir().unwrap(),
            tempfile::tempdir().unwrap(),
            tempfile::tempdir().unwrap(),
        );
        let (store_a, store_b, store_c) = (
            LocalStore::open(a.path()).unwrap(),
            LocalStore::open(b.path()).unwrap(),
            LocalStore::open(c.path()).unwrap(),
        );
        snapshot_in(&store_a, "snap-1");
        let uri = remote.publish(&store_a, "snap-1").await.unwrap();
        assert_eq!(remote.id_of(&uri).as_deref(), Some("snap-1"));
        // The node that took it uses its own copy; another fetches the archive.
        assert_eq!(
            remote.fetch(&uri, &store_a).await.unwrap(),
            store_a.dir("snap-1").unwrap()
        );
        let fetched = remote.fetch(&uri, &store_b).await.unwrap();
        assert_eq!(fetched, store_b.dir("snap-1").unwrap());
        store_b.get("snap-1").unwrap().verify().unwrap();
        assert_eq!(
            std::fs::read(fetched.join(STATE_FILE)).unwrap(),
            b"{\"vcpus\":1}"
        );
        for store in [a.path(), b.path()] {
            let staged = std::fs::read_dir(store)
                .unwrap()
                .filter_map(|e| e.ok())
                .filter(|e| {
                    let name = e.file_name().to_string_lossy().into_owned();
                    name.starts_with(".upload-") || name.starts_with(".download-")
                })
                .count();
            assert_eq!(staged, 0, "a staging file was left in {}", store.display());
        }
        // A damaged archive is refused and leaves nothing in the store.
        damage();
        assert!(remote.fetch(&uri, &store_c).await.is_err());
        assert!(store_c.list().unwrap().is_empty());
        remote.remove("snap-1").await.unwrap();
        remote.remove("snap-1").await.unwrap();
        assert!(remote.fetch(&uri, &store_c).await.is_err());
    }

    #[tokio::test]
    async fn a_snapshot_published_to_a_bucket_is_fetched_whole_into_another_store() {
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
            remote.uri("snap-1"),
            "s3://agentvm/fleet/snapshots/snap-1.agvmsnap"
        );
        let object = server.object_file("fleet/snapshots/snap-1.agvmsnap");
        round_trip(&remote, || {
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
        snapshot_in(&store, "snap-2");
        server.pause();
        let err = remote.publish(&store, "snap-2").await.unwrap_err();
        assert!(
            err.contains("uploading s3://agentvm/p/snap-2.agvmsnap"),
            "{err}"
        );
        let staged = std::fs::read_dir(dir.path())
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().starts_with(".upload-"))
            .count();
        assert_eq!(staged, 0);
        server.resume().unwrap();
        let uri = remote.publish(&store, "snap-2").await.unwrap();
        assert_eq!(remote.id_of(&uri).as_deref(), Some("snap-2"));
        assert_eq!(server.objects(), ["snap-2.agvmsnap"]);
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
        let s3 = SnapshotRemote::S3(S3Remote::with_vars("b/x/y/", Vec::new()).unwrap());
        assert_eq!(s3.uri("s-1"), "s3://b/x/y/s-1.agvmsnap");
        assert_eq!(s3.id_of("s3://b/x/y/s-1.agvmsnap"), Some("s-1".into()));
        for other in [
            "s3://c/x/y/s-1.agvmsnap",
            "s3://b/x/s-1.agvmsnap",
            "s3://b/x/y/s-1",
            "file:///x/y/s-1.agvmsnap",
        ] {
            assert_eq!(s3.id_of(other), None, "{other}");
        }
        assert!(
            S3Remote::with_vars("/x", Vec::new())
                .unwrap_err()
                .contains("bucket")
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

    #[tokio::test]
    async fn a_published_snapshot_is_fetched_whole_into_another_store() {
        let shared = tempfile::tempdir().unwrap();
        let remote = SnapshotRemote::Dir(shared.path().to_owned());
        let archive = SnapshotRemote::archive(shared.path(), "snap-1");
        round_trip(&remote, || {
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
