//! Folding a layer into the one above it, so a chain can lose a snapshot from its middle.
//!
//! A session's turn checkpoints form a chain, each a layer on the one before; keeping only
//! some of them means dropping others. A dropped snapshot's pages cannot just go: the layer
//! above may not hold them. So the upper layer is rewritten as a new snapshot holding both
//! (its own pages over the lower's), layered on what the lower was layered on, and whatever
//! was layered on the upper is re-pointed to it. The two old snapshots are then unused.
//!
//! Crash safety is the caller's order of steps: the merged snapshot appears whole or not at
//! all (written aside, renamed into the store), a re-pointed manifest is replaced in one
//! rename, and the old snapshots are deleted only after the caller's own records name the
//! merged one; what a crash leaves in between is unused and swept.

use std::fs::File;
use std::path::{Path, PathBuf};

use crate::SnapshotError;
use crate::dir::Snapshot;
use crate::manifest::{DigestKind, FileEntry};
use crate::pages;
use crate::store::LocalStore;

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> SnapshotError + '_ {
    move |source| SnapshotError::Io {
        path: path.display().to_string(),
        source,
    }
}

impl LocalStore {
    /// Writes `merged`: snapshot `upper` with the pages of `lower` (the snapshot it is
    /// layered on) folded in, layered on what `lower` is layered on. `upper` and `lower`
    /// are left as they are.
    pub fn merge_down(
        &self,
        lower: &str,
        upper: &str,
        merged: &str,
    ) -> Result<PathBuf, SnapshotError> {
        let (lower, upper) = (self.get(lower)?, self.get(upper)?);
        upper.verify()?;
        lower.verify()?;
        let on_lower = upper
            .manifest
            .memory
            .base
            .as_ref()
            .is_some_and(|b| lower.is_base_of(b));
        if !on_lower {
            return Err(SnapshotError::Base {
                dir: upper.dir.display().to_string(),
                reason: format!("is not layered on {}", lower.dir.display()),
            });
        }
        let incoming = self.incoming(merged)?;
        let written = write_merged(&lower, &upper, &incoming);
        match written {
            Ok(()) => self.take_in(merged, &incoming),
            Err(e) => {
                let _ = std::fs::remove_dir_all(&incoming);
                Err(e)
            }
        }
    }

    /// Re-points snapshot `id`, layered on `from`, onto `to` (which holds the same guest
    /// state as `from`: a merge of it).
    pub fn rebase(&self, id: &str, from: &str, to: &str) -> Result<(), SnapshotError> {
        let (snapshot, from, to) = (self.get(id)?, self.get(from)?, self.get(to)?);
        let on_from = snapshot
            .manifest
            .memory
            .base
            .as_ref()
            .is_some_and(|b| b.dir == from.dir);
        if !on_from {
            return Err(SnapshotError::Base {
                dir: snapshot.dir.display().to_string(),
                reason: format!("is not layered on {}", from.dir.display()),
            });
        }
        // What `id` holds is unchanged, so the layers above it (which pin its contents, not
        // its manifest) need nothing.
        let mut manifest = snapshot.manifest;
        manifest.memory.base = Some(to.base_ref());
        self.replace_manifest(&snapshot.dir, &manifest)
    }
}

/// `upper`'s files into `out`, each layer file with `lower`'s pages under its own.
fn write_merged(lower: &Snapshot, upper: &Snapshot, out: &Path) -> Result<(), SnapshotError> {
    let mut manifest = upper.manifest.clone();
    manifest.memory.base = lower.manifest.memory.base.clone();
    for (name, entry) in manifest.files.iter_mut() {
        let (src, dst) = (upper.path(name), out.join(name));
        let below = lower
            .manifest
            .files
            .get(name)
            .filter(|_| entry.digest == DigestKind::LayerPages);
        let Some(below) = below else {
            // Not a layer (state, config, a whole copy): the upper's is the merged one.
            std::fs::copy(&src, &dst).map_err(io(&src))?;
            entry.stamp = None;
            continue;
        };
        let merged = File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&dst)
            .map_err(io(&dst))?;
        let lower_file = File::open(lower.path(name)).map_err(io(&lower.path(name)))?;
        let upper_file = File::open(&src).map_err(io(&src))?;
        merged.set_len(entry.size).map_err(io(&dst))?;
        pages::overlay_extents(&lower_file, &merged).map_err(io(&dst))?;
        pages::overlay_extents(&upper_file, &merged).map_err(io(&dst))?;
        merged.sync_all().map_err(io(&dst))?;
        // Over a whole copy the result is whole (a hole reads as zero); over a layer, a layer.
        let (digest, sha256) = match below.digest {
            DigestKind::LayerPages => (
                DigestKind::LayerPages,
                pages::layer_digest(&merged).map_err(io(&dst))?.0,
            ),
            _ => (
                DigestKind::Pages,
                pages::file_digest(&merged).map_err(io(&dst))?.0,
            ),
        };
        *entry = FileEntry {
            size: entry.size,
            digest,
            sha256,
            stamp: None,
        };
    }
    crate::store::write_new_manifest(out, &manifest)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::FileExt;

    use super::*;
    use crate::SnapshotWriter;
    use crate::manifest::{HostIdentity, MEMORY_FILE, MemoryLayout, STATE_FILE};
    use crate::pages::PAGE_SIZE;

    const PAGES: u64 = 16;

    /// A snapshot in `written` (created) whose memory holds `pages` (index, fill byte), a
    /// layer on `base` or a whole file.
    fn write(written: &Path, pages: &[(u64, u8)], base: Option<&Snapshot>) {
        std::fs::create_dir(written).unwrap();
        let mut w = SnapshotWriter::create(written, false).unwrap();
        w.write_file(STATE_FILE, b"{}").unwrap();
        let memory = File::create_new(written.join(MEMORY_FILE)).unwrap();
        memory.set_len(PAGES * PAGE_SIZE).unwrap();
        for &(index, fill) in pages {
            memory
                .write_all_at(&[fill; PAGE_SIZE as usize], index * PAGE_SIZE)
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
                size: PAGES * PAGE_SIZE,
                base: base.map(Snapshot::base_ref),
            },
        )
        .unwrap();
    }

    /// Into the store as `id`, through a directory on another path (as a VMM's outbox).
    fn adopt(store: &LocalStore, scratch: &Path, id: &str, pages: &[(u64, u8)], on: Option<&str>) {
        let written = scratch.join(id);
        let base = on.map(|b| store.get(b).unwrap());
        write(&written, pages, base.as_ref());
        store.adopt(id, &written).unwrap();
    }

    /// Page `index` of the memory a restore of `id` composes: the topmost file holding it.
    fn page(store: &LocalStore, id: &str, index: u64) -> u8 {
        let chain = store.get(id).unwrap().chain().unwrap();
        for snapshot in chain.iter().rev() {
            let file = File::open(snapshot.path(MEMORY_FILE)).unwrap();
            let held = pages::data_extents(&file)
                .unwrap()
                .iter()
                .any(|&(at, len)| (at..at + len).contains(&(index * PAGE_SIZE)));
            if held {
                let mut byte = [0u8; 1];
                file.read_exact_at(&mut byte, index * PAGE_SIZE).unwrap();
                return byte[0];
            }
        }
        0
    }

    #[test]
    fn a_merged_layer_restores_what_the_upper_did_and_what_was_on_it_follows() {
        let root = tempfile::tempdir().unwrap();
        let scratch = tempfile::tempdir().unwrap();
        let store = LocalStore::open(root.path()).unwrap();
        adopt(
            &store,
            scratch.path(),
            "base",
            &[(0, 1), (1, 1), (2, 1)],
            None,
        );
        // The lower layer writes page 1 and a page of zeros over page 2 (hiding the base's).
        adopt(
            &store,
            scratch.path(),
            "lower",
            &[(1, 2), (2, 0)],
            Some("base"),
        );
        adopt(&store, scratch.path(), "upper", &[(3, 3)], Some("lower"));
        adopt(&store, scratch.path(), "top", &[(4, 4)], Some("upper"));
        let before: Vec<u8> = (0..6).map(|i| page(&store, "top", i)).collect();
        assert_eq!(before, [1, 2, 0, 3, 4, 0]);

        store.merge_down("lower", "upper", "merged").unwrap();
        store.rebase("top", "upper", "merged").unwrap();
        let merged = store.get("merged").unwrap();
        merged.verify().unwrap();
        assert_eq!(
            merged.manifest.memory.base.as_ref().unwrap().dir,
            store.get("base").unwrap().dir
        );
        // The same memory as before, through one layer fewer; the zero page still hides.
        assert_eq!(merged.chain().unwrap().len(), 2);
        let after: Vec<u8> = (0..6).map(|i| page(&store, "top", i)).collect();
        assert_eq!(after, before);
        // The old two are unused: nothing is layered on them any more.
        assert!(store.dependents("upper").unwrap().is_empty());
        store.delete("upper").unwrap();
        store.delete("lower").unwrap();
        assert_eq!(
            (0..6).map(|i| page(&store, "top", i)).collect::<Vec<_>>(),
            before
        );
    }

    #[test]
    fn a_rebase_re_points_every_layer_above_and_a_merge_of_unrelated_snapshots_is_refused() {
        let root = tempfile::tempdir().unwrap();
        let scratch = tempfile::tempdir().unwrap();
        let store = LocalStore::open(root.path()).unwrap();
        adopt(&store, scratch.path(), "a", &[(0, 1)], None);
        adopt(&store, scratch.path(), "b", &[(1, 2)], Some("a"));
        adopt(&store, scratch.path(), "c", &[(2, 3)], Some("b"));
        adopt(&store, scratch.path(), "d", &[(3, 4)], Some("c"));
        adopt(&store, scratch.path(), "e", &[(4, 5)], Some("d"));
        store.merge_down("b", "c", "bc").unwrap();
        // Rewriting d's manifest changes its digest: e, two layers up, must follow.
        store.rebase("d", "c", "bc").unwrap();
        store.get("e").unwrap().chain().unwrap();
        assert_eq!(
            (0..5).map(|i| page(&store, "e", i)).collect::<Vec<_>>(),
            [1, 2, 3, 4, 5]
        );
        assert!(matches!(
            store.merge_down("a", "e", "ae"),
            Err(SnapshotError::Base { .. })
        ));
        assert!(store.get("ae").is_err());
        assert!(matches!(
            store.rebase("e", "c", "bc"),
            Err(SnapshotError::Base { .. })
        ));
    }

    /// A layer a VMM wrote on another filesystem (its RAM directory) keeps its holes when
    /// the store takes it in: a hole means "as below", written zeros would hide the base.
    #[test]
    fn a_layer_taken_in_from_another_directory_keeps_its_holes() {
        let root = tempfile::tempdir().unwrap();
        let shm = tempfile::tempdir_in("/dev/shm").unwrap_or_else(|_| tempfile::tempdir().unwrap());
        let store = LocalStore::open(root.path()).unwrap();
        adopt(&store, shm.path(), "base", &[(0, 7), (5, 7)], None);
        adopt(&store, shm.path(), "layer", &[(1, 8)], Some("base"));
        let layer = File::open(store.get("layer").unwrap().path(MEMORY_FILE)).unwrap();
        assert_eq!(
            pages::data_extents(&layer).unwrap(),
            [(PAGE_SIZE, PAGE_SIZE)]
        );
        assert_eq!(page(&store, "layer", 5), 7);
    }
}
