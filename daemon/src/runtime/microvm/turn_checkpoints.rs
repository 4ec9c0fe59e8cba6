//! A checkpoint of a memory-tier session's VM at every turn's end (time travel: any turn
//! can be forked from, not only the head).
//!
//! The VMM writes what changed since its last checkpoint as a layer on it (`vm.checkpoint`,
//! paused only while it copies what the guest wrote during its pre-copy) into its own
//! directory; agentvmd takes it into the store. What a layer is layered on is decided here,
//! from this runtime's own record of the last checkpoint it took of the VMM, never from the
//! path the VMM wrote in the manifest. A VMM's first checkpoint is written in its RAM
//! directory: for a booted VM it is its RAM file itself, frozen, which the VM then runs
//! over (as a live fork's), so the store gets a copy.

use std::collections::HashMap;
use std::sync::Mutex;

use agentvm_proto::v1::SnapshotRef;
use agentvm_snapshot::Snapshot;

use super::{MicrovmRuntime, failed, lock, prepare_outbox};
use crate::runtime::{CheckpointCues, Incarnation, Result, Runtime, TurnCheckpoint};

/// Store ids of checkpoints start with this (`ckpt.SESSION-EPOCH-N`): they are the session's
/// but are not the snapshots a suspend or fork takes (which the session's other sweeps
/// judge by the log alone).
pub const CHECKPOINT_PREFIX: &str = "ckpt.";

/// The session a checkpoint's store id names.
pub fn checkpoint_owner(id: &str) -> Option<&str> {
    super::snapshot_owner(id.strip_prefix(CHECKPOINT_PREFIX)?)
}

/// Per session, the store id of the last checkpoint its current VMM took: what the next is
/// layered on. Forgotten when the VMM stops (a new VMM starts a new chain), and when a
/// checkpoint fails to be stored: it and every one taken after it (layered on it, in
/// turn) are then no base, and the next starts a new chain.
#[derive(Default)]
pub struct LastCheckpoints {
    last: Mutex<HashMap<String, (String, u64)>>,
    /// Orders the checkpoints taken, across sessions.
    taken: std::sync::atomic::AtomicU64,
}

impl LastCheckpoints {
    pub fn forget(&self, session: &str) {
        lock(&self.last).remove(session);
    }

    fn get(&self, session: &str) -> Option<String> {
        lock(&self.last).get(session).map(|(id, _)| id.clone())
    }

    /// Makes `id` `session`'s last; returns its place in the order taken.
    fn set(&self, session: &str, id: String) -> u64 {
        let order = self
            .taken
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        lock(&self.last).insert(session.to_owned(), (id, order));
        order
    }

    /// Forgets `session`'s last if it was taken at `order` or after.
    fn forget_from(&self, session: &str, order: u64) {
        let mut last = lock(&self.last);
        if last.get(session).is_some_and(|(_, at)| *at >= order) {
            last.remove(session);
        }
    }
}

impl MicrovmRuntime {
    pub(super) async fn take_turn_checkpoint(
        &self,
        incarnation: &Incarnation,
        cues: CheckpointCues,
    ) -> Result<Option<TurnCheckpoint>> {
        let session = &incarnation.id;
        let dir = self.vmm_dir(session);
        // Stock Cloud Hypervisor has no vm.checkpoint; a stateless harness's VM is not kept.
        if !self.keeps_memory(&dir) || !self.config.flavour.cow_fork() {
            return Ok(None);
        }
        if let super::vmm_process::VmmHealth::Stalled(why) = dir.health() {
            return Err(failed(session, format!("its VMM {why}: no checkpoint")));
        }
        let id = format!("{CHECKPOINT_PREFIX}{}", self.new_snapshot_id(session));
        // The last one may still be being written (and not yet in the store): the VMM layers
        // this one on it where the store will keep it, and it is stored after it.
        let base = self.last_checkpoints.get(session);
        // A first checkpoint may be the VM's RAM file, which must stay in the RAM directory.
        let outbox = match &base {
            Some(_) => dir.checkpoint_outbox(&id),
            None => dir.fork_dir(&id),
        };
        if let Some(parent) = outbox.parent() {
            std::fs::create_dir_all(parent)
                .map_err(|e| failed(session, format!("creating {}: {e}", parent.display())))?;
        }
        prepare_outbox(&dir, &outbox).map_err(|e| failed(session, e))?;
        let client = dir.client();
        let base_dir = match &base {
            Some(base) => Some(
                self.store
                    .dir(base)
                    .map_err(|e| failed(session, e.to_string()))?,
            ),
            None => None,
        };
        // Without a last one this node knows of, a new chain, whatever the VMM took before.
        let taken = match &base_dir {
            Some(base_dir) => client.checkpoint(&outbox, Some(base_dir)).await,
            None => client.checkpoint_afresh(&outbox).await,
        };
        let _ = cues.running_again.send(());
        let taken = match taken {
            Ok(taken) => taken,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&outbox);
                self.last_checkpoints.forget(session);
                return Err(failed(session, format!("vm.checkpoint: {e}")));
            }
        };
        // The next is layered on this one from now on, even before it is stored.
        let order = self.last_checkpoints.set(session, id.clone());
        let given_up = |why: String| {
            let _ = std::fs::remove_dir_all(&outbox);
            self.last_checkpoints.forget_from(session, order);
            Err(failed(session, why))
        };
        cues.below_stored.await;
        let report = match client.checkpoint_wait(Some(&outbox)).await {
            Ok(report) => report,
            Err(e) => return given_up(format!("vm.checkpoint-wait: {e}")),
        };
        let (store, outbox_in) = (self.store.clone(), outbox.clone());
        let (layer_on, id_in) = (base.clone().filter(|_| report.incremental), id.clone());
        let target = tokio::task::spawn_blocking(move || match layer_on {
            Some(base) => store.adopt_layer(&id_in, &outbox_in, &base),
            None => {
                let frozen_ram =
                    Snapshot::open(&outbox_in).is_ok_and(|s| s.manifest.memory.base.is_none());
                match frozen_ram {
                    // The VM runs over this memory file now: the store gets a copy.
                    true => store.copy_in(&id_in, &outbox_in),
                    false => store.adopt(&id_in, &outbox_in),
                }
            }
        })
        .await
        .map_err(|e| {
            failed(
                session,
                format!("taking the checkpoint into the store: {e}"),
            )
        })?;
        let target = match target {
            Ok(target) => target,
            // Its base among them, if that was not stored.
            Err(e) => return given_up(format!("taking the checkpoint into the store: {e}")),
        };
        crate::crash_point::reached(crate::crash_point::CHECKPOINT_STORED);
        let sealed = Snapshot::open(&target).map_err(|e| failed(session, e.to_string()))?;
        // This node's: checkpoints go to the fleet's store only with their session's suspend
        // (`SessionHost::publish_checkpoints`), not at every turn.
        let external_uri = format!("file://{}", target.display());
        Ok(Some(TurnCheckpoint {
            snapshot: SnapshotRef {
                local: session.clone(),
                external_uri,
                memory: true,
                sealed: false,
            },
            manifest_sha256: sealed.manifest_sha256,
            bytes: bytes_on_disk(&target),
            paused: std::time::Duration::from_micros(taken.paused_us),
            pages: report.memory_pages,
            disk_blocks: report.disk_blocks,
            incremental: report.incremental,
        }))
    }

    /// Folds checkpoint `lower` into `upper` as a new checkpoint (see
    /// `LocalStore::merge_down`), re-pointing what was layered on `upper` to it.
    pub(super) fn merge_turn_checkpoints(
        &self,
        session: &str,
        lower: &SnapshotRef,
        upper: &SnapshotRef,
    ) -> Result<Option<TurnCheckpoint>> {
        let (Some(lower), Some(upper)) = (self.local_id(lower), self.local_id(upper)) else {
            return Ok(None);
        };
        if checkpoint_owner(&lower) != Some(session) || checkpoint_owner(&upper) != Some(session) {
            return Err(failed(session, "only its own checkpoints are merged"));
        }
        // A checkpoint that starts a chain of its own (a VMM's first, or every
        // CHECKPOINT_DEPTH-th) is not layered on the one before: nothing to fold, and the
        // one before is dropped as it is.
        let upper_dir = self
            .store
            .dir(&upper)
            .map_err(|e| failed(session, e.to_string()))?;
        let upper_snapshot =
            Snapshot::open(&upper_dir).map_err(|e| failed(session, e.to_string()))?;
        let lower_dir = self
            .store
            .dir(&lower)
            .map_err(|e| failed(session, e.to_string()))?;
        let on_lower = upper_snapshot
            .manifest
            .memory
            .base
            .as_ref()
            .is_some_and(|b| std::fs::canonicalize(&lower_dir).is_ok_and(|d| d == b.dir));
        if !on_lower {
            return Ok(Some(TurnCheckpoint {
                snapshot: SnapshotRef {
                    local: session.to_owned(),
                    external_uri: format!("file://{}", upper_dir.display()),
                    memory: true,
                    sealed: false,
                },
                manifest_sha256: upper_snapshot.manifest_sha256,
                bytes: bytes_on_disk(&upper_dir),
                paused: std::time::Duration::ZERO,
                pages: 0,
                disk_blocks: 0,
                incremental: upper_snapshot.manifest.memory.base.is_some(),
            }));
        }
        let merged = format!("{CHECKPOINT_PREFIX}{}", self.new_snapshot_id(session));
        let target = self
            .store
            .merge_down(&lower, &upper, &merged)
            .map_err(|e| {
                failed(
                    session,
                    format!("merging checkpoint {lower} into {upper}: {e}"),
                )
            })?;
        for dependent in self.store.dependents(&upper).unwrap_or_default() {
            if dependent == merged {
                continue;
            }
            if let Err(e) = self.store.rebase(&dependent, &upper, &merged) {
                let _ = self.store.delete(&merged);
                return Err(failed(
                    session,
                    format!("re-pointing {dependent} from {upper} to {merged}: {e}"),
                ));
            }
        }
        if self.last_checkpoints.get(session).as_deref() == Some(upper.as_str()) {
            self.last_checkpoints.set(session, merged.clone());
        }
        let sealed = Snapshot::open(&target).map_err(|e| failed(session, e.to_string()))?;
        Ok(Some(TurnCheckpoint {
            snapshot: SnapshotRef {
                local: session.to_owned(),
                external_uri: format!("file://{}", target.display()),
                memory: true,
                sealed: false,
            },
            manifest_sha256: sealed.manifest_sha256,
            bytes: bytes_on_disk(&target),
            paused: std::time::Duration::ZERO,
            pages: 0,
            disk_blocks: 0,
            incremental: sealed.manifest.memory.base.is_some(),
        }))
    }

    /// Publishes a checkpoint of this node's store to the fleet's (see
    /// `Runtime::publish_checkpoint`); `None` without a fleet store or if it is published.
    pub(super) async fn publish_turn_checkpoint(
        &self,
        snapshot: &SnapshotRef,
    ) -> Result<Option<String>> {
        if self.config.snapshot_remote.is_none() || Runtime::is_published(self, snapshot) {
            return Ok(None);
        }
        let session = snapshot.local.as_str();
        let Some(id) = self
            .local_id(snapshot)
            .filter(|id| checkpoint_owner(id) == Some(session))
        else {
            return Err(failed(
                session,
                format!("{} is none of its checkpoints", snapshot.external_uri),
            ));
        };
        let target = self
            .store
            .dir(&id)
            .map_err(|e| failed(session, e.to_string()))?;
        self.publish(&id, &target)
            .await
            .map(Some)
            .map_err(|e| failed(session, e))
    }

    /// Deletes checkpoint `snapshot` from the store; false if a layer or a VM still needs it.
    pub(super) fn delete_checkpoint(&self, snapshot: &SnapshotRef) -> bool {
        let Some(id) = self.local_id(snapshot) else {
            return true;
        };
        if checkpoint_owner(&id).is_none() {
            return false;
        }
        match self.store.delete(&id) {
            Ok(()) | Err(agentvm_snapshot::SnapshotError::NotFound(_)) => true,
            Err(e) => {
                tracing::debug!(snapshot = %id, error = %e, "checkpoint kept for now");
                false
            }
        }
    }

    /// `session`'s checkpoints in the store, oldest first.
    pub(super) fn checkpoints_in_store(&self, session: &str) -> Vec<SnapshotRef> {
        self.stored_of(session, checkpoint_owner, false)
    }
}

/// What the files of the snapshot in `dir` take on disk.
fn bytes_on_disk(dir: &std::path::Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok()?.metadata().ok())
                .map(|m| m.blocks() * 512)
                .sum()
        })
        .unwrap_or(0)
}
