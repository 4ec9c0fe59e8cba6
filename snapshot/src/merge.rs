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
            .is_some_and(|b| b.dir == lower.dir && b.manifest_sha256 == lower.manifest_sha256);
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
        let mut manifest = snapshot.manifest;
        manifest.memory.base = Some(to.base_ref());
        self.replace_manifest(&snapshot.dir, &manifest)?;
        self.refresh_dependents(id)
    }

    /// After `id`'s manifest changed: whatever is layered on it names its new digest, and
    /// so on up every chain built on it.
    fn refresh_dependents(&self, id: &str) -> Result<(), SnapshotError> {
        let mut changed = vec![id.to_owned()];
        while let Some(id) = changed.pop() {
            let base = self.get(&id)?.base_ref();
            for dependent in self.dependents(&id)? {
                let snapshot = self.get(&dependent)?;
                let mut manifest = snapshot.manifest;
                manifest.memory.base = Some(base.clone());
                self.replace_manifest(&snapshot.dir, &manifest)?;
                changed.push(dependent);
            }
        }
        Ok(())
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
