//! The compute SPI (upstream's Go `api.Runtime`), implemented natively by each backend
//! (`process` for harnesses as local processes, `microvm` on agentvm-vmm).
//!
//! Data flows down only: the controller calls a runtime; a runtime never calls back up.

pub mod microvm;
pub mod placement;
pub mod process;
pub mod remote;

use std::sync::Arc;

use agentvm_proto::v1::{IdentityRef, RuntimeCapabilities, SnapshotRef};

use crate::controller::endpoint::HarnessEndpoint;

/// LOCAL keeps state on this node (warm); EXTERNAL owns the whole cold transition: capture,
/// free the compute, keep a restore handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SnapshotKind {
    Local,
    External,
}

/// What a runtime needs to start a session's compute.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SessionSpec {
    pub session_uid: String,
    /// Image or harness bundle reference, backend-specific.
    pub image: String,
    pub harness: String,
    pub identity: Option<IdentityRef>,
    /// The session's annotations (a fork child's are its parent's): runtimes read their
    /// own keys, such as [`crate::runtime::microvm::network::EGRESS_ANNOTATION`].
    pub annotations: std::collections::BTreeMap<String, String>,
}

/// One live compute instance of a session. `id` is the session uid on every backend.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Incarnation {
    pub id: String,
    pub worker: String,
    /// Where the harness is reached (a unix socket, `host:port`, or a vsock socket path).
    pub address: String,
    pub runtime: String,
    pub fence_token: i64,
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct ForkOpts {
    pub child_session_uid: String,
    /// What the child runs (the parent's image and harness under the child's uid).
    pub spec: SessionSpec,
}

/// The compute state a runtime observes (a live probe, unlike the journal's projection).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ObservedState {
    Live,
    Warm,
    Cold,
    Terminated,
    /// The runtime has no record of this incarnation.
    Unknown,
}

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("{runtime}: {operation} is not supported by this backend")]
    Unsupported {
        runtime: &'static str,
        operation: &'static str,
    },
    #[error("{runtime}: session {session}: {reason}")]
    Failed {
        runtime: &'static str,
        session: String,
        reason: String,
    },
    /// A disk or the RAM directory is full: nothing was written, retrying later may work.
    #[error("{runtime}: session {session}: no space left for {what}")]
    NoSpace {
        runtime: &'static str,
        session: String,
        what: String,
    },
    /// The compute stopped answering within its deadline.
    #[error("{runtime}: session {session}: {reason}")]
    Hung {
        runtime: &'static str,
        session: String,
        reason: String,
    },
    /// The compute exists but cannot run (stopped, frozen): nothing can be asked of it.
    #[error("{runtime}: session {session}: {reason}")]
    Stalled {
        runtime: &'static str,
        session: String,
        reason: String,
    },
    /// A snapshot failed its digests or cannot be read: it never will be.
    #[error("{runtime}: session {session}: {reason}")]
    Corrupt {
        runtime: &'static str,
        session: String,
        reason: String,
    },
    #[error("{runtime}: snapshot of session {session} was superseded")]
    SnapshotSuperseded {
        runtime: &'static str,
        session: String,
    },
    /// The snapshot to restore was deleted before it could be pinned: a concurrent delete
    /// (of the session it belongs to, or a sweep) won the race.
    #[error(
        "{runtime}: session {session}: snapshot {snapshot} was deleted by a concurrent operation before it could be restored; retry"
    )]
    SnapshotGone {
        runtime: &'static str,
        session: String,
        snapshot: String,
    },
}

pub type Result<T> = std::result::Result<T, RuntimeError>;

/// A session's compute ended without the host asking (a VMM killed or crashed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ComputeLost {
    pub session_uid: String,
    /// What ended it, as far as the runtime can tell (exit status, the VMM's last words).
    pub reason: String,
}

/// How a turn's checkpoint keeps time with the turns and checkpoints around it.
pub struct CheckpointCues {
    /// Told as soon as the VM runs again: all a next turn waits for.
    pub running_again: tokio::sync::oneshot::Sender<()>,
    /// Resolves once the checkpoint before this one is stored and recorded (or given up):
    /// this one may be taken while that one is still being written, but is layered on it,
    /// so it is stored after it.
    pub below_stored: std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>,
}

/// A turn's checkpoint, in the runtime's store (see `session::checkpoints`).
#[derive(Debug, Clone, PartialEq)]
pub struct TurnCheckpoint {
    pub snapshot: SnapshotRef,
    /// SHA-256 of its manifest as sealed in the store.
    pub manifest_sha256: String,
    /// Bytes its own files take on disk (not its bases').
    pub bytes: u64,
    /// How long the VM was paused for it.
    pub paused: std::time::Duration,
    /// Guest pages and disk blocks it stores.
    pub pages: u64,
    pub disk_blocks: u64,
    /// Layered on the checkpoint named as its base.
    pub incremental: bool,
}

/// What the journal says of the session a snapshot belongs to, for a sweep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SnapshotOwner {
    /// Not DELETED, or one of its fork children is not (or the journal could not say):
    /// its snapshots stay.
    Wanted,
    /// DELETED, and its children too: its snapshots go once nothing kept is layered on
    /// them.
    Gone,
    /// No such session: a snapshot of a fork whose children were never written. It goes
    /// once older than any fork takes to write them.
    Unknown,
}

#[async_trait::async_trait]
pub trait Runtime: Send + Sync {
    /// The backend's name as ComputeRef.runtime reports it.
    fn name(&self) -> &'static str;

    fn capabilities(&self) -> RuntimeCapabilities;

    /// The guest memory one VM of `harness` takes, for a backend that runs VMs (what the
    /// projects' `live_vms` and `live_memory_mib` quotas count); `None` for one that does not.
    fn vm_memory_mib(&self, _harness: &str) -> Option<u64> {
        None
    }

    /// Whether a session's harness process lives exactly as long as its incarnation here
    /// (one process, or one VM, per session, started and stopped by this runtime): what it
    /// was sent in an earlier turn it still holds, so a harness that keeps its history may
    /// be sent only what is new. False where the harness is shared or outlives what the
    /// runtime sees (a remote harness may restart unseen).
    fn harness_lives_with_incarnation(&self) -> bool {
        false
    }

    /// Starts a session's compute from nothing (or attaches to it when already running).
    async fn create(&self, spec: &SessionSpec) -> Result<Incarnation>;

    /// The session's compute if it is still running without the host knowing it (the
    /// daemon restarted): re-adopted as it is. Backends whose compute cannot outlive the
    /// daemon have nothing to attach to.
    async fn attach(&self, _session_uid: &str) -> Result<Option<Incarnation>> {
        Ok(None)
    }

    async fn snapshot(&self, incarnation: &Incarnation, kind: SnapshotKind) -> Result<SnapshotRef>;

    /// A snapshot of a running compute that keeps running: durable (in the store the
    /// journal names snapshots in) by the time it is returned, and the source a live fork
    /// clones its children from. `None` when the backend can only snapshot by stopping the
    /// compute (the host then suspends the session to fork it, as upstream does).
    async fn checkpoint_live(&self, _incarnation: &Incarnation) -> Result<Option<SnapshotRef>> {
        Ok(None)
    }

    /// Brings a session back from `snapshot`. Unlike upstream's SPI it also gets the session's
    /// spec: a backend that re-provisions (a process, a VMM) must know what to start.
    async fn restore(&self, snapshot: &SnapshotRef, spec: &SessionSpec) -> Result<Incarnation>;

    /// Takes a checkpoint of a running memory-tier incarnation at a turn's end, layered on
    /// the last one it took of this incarnation where it can be, keeping time by `cues`;
    /// returns it once durable in the store. `None`: this runtime keeps no checkpoints (of
    /// this incarnation).
    async fn checkpoint_turn(
        &self,
        _incarnation: &Incarnation,
        _cues: CheckpointCues,
    ) -> Result<Option<TurnCheckpoint>> {
        Ok(None)
    }

    /// Deletes checkpoint `snapshot` (and nothing it is layered on); false if something still
    /// depends on it (a layer or a VM restored from it), which a later sweep retries.
    fn discard_checkpoint(&self, _snapshot: &SnapshotRef) -> bool {
        true
    }

    /// The sessions this runtime holds checkpoints of.
    fn sessions_with_checkpoints(&self) -> Vec<String> {
        Vec::new()
    }

    /// The checkpoints of `session_uid` this runtime holds (recorded or not), oldest first.
    fn checkpoints_held(&self, _session_uid: &str) -> Vec<SnapshotRef> {
        Vec::new()
    }

    /// Folds checkpoint `lower` into `upper` (layered on it) as a new checkpoint that
    /// restores exactly what `upper` does, re-pointing what was layered on `upper` to it;
    /// `lower` and `upper` are then unused. An `upper` not layered on `lower` is returned as
    /// it is (`lower` alone is then unused). `None`: this runtime cannot.
    fn merge_checkpoints(
        &self,
        _session_uid: &str,
        _lower: &SnapshotRef,
        _upper: &SnapshotRef,
    ) -> Result<Option<TurnCheckpoint>> {
        Ok(None)
    }

    /// Publishes checkpoint `snapshot` to the fleet's snapshot store (as a layer on its
    /// base where that is published): what a record of it names from then on. `None`: no
    /// fleet store, or this runtime keeps no checkpoints.
    async fn publish_checkpoint(&self, _snapshot: &SnapshotRef) -> Result<Option<String>> {
        Ok(None)
    }

    /// What `harness`'s image says of its sessions' checkpoints (`[vm] checkpoints`), if
    /// anything: a retention as the `agentvm.dev/checkpoints` annotation spells it.
    fn checkpoint_retention(&self, _harness: &str) -> Option<String> {
        None
    }

    /// Whether `snapshot` names an archive in the fleet's snapshot store (published), not
    /// a snapshot of this node's own.
    fn is_published(&self, _snapshot: &SnapshotRef) -> bool {
        false
    }

    /// A child from a parent's snapshot. Must not leak a half-built child on failure.
    /// `None` when the backend provisions nothing at fork time (a replay fork: the child's
    /// first Exec creates its compute and the host replays the copied prefix into it).
    async fn fork(&self, snapshot: &SnapshotRef, opts: &ForkOpts) -> Result<Option<Incarnation>>;

    /// Destroys the compute and frees its worker.
    async fn stop(&self, incarnation: &Incarnation) -> Result<()>;

    /// Frees what the runtime keeps for a deleted session (its snapshots), except what
    /// another session still uses; `owned` tells which sessions still exist.
    async fn reclaim(
        &self,
        _session_uid: &str,
        _owned: &(dyn for<'s> Fn(&'s str) -> bool + Send + Sync),
    ) -> Result<()> {
        Ok(())
    }

    /// `current` was just recorded as `session_uid`'s state to continue from (its SUSPEND is
    /// durable) and its compute is stopped: free what the session kept of older snapshots
    /// that nothing needs any more (no VM maps them, no layer is on them, no other session
    /// holds them), so a session's storage does not grow with its suspends.
    async fn superseded(&self, _session_uid: &str, _current: &SnapshotRef) {}

    async fn status(&self, incarnation: &Incarnation) -> Result<ObservedState>;

    /// Reports of compute that ended on its own, for runtimes whose compute can; the host
    /// records them so a session's state does not claim compute that is gone.
    fn compute_lost(&self) -> Option<tokio::sync::broadcast::Receiver<ComputeLost>> {
        None
    }

    /// Whether the incarnation's compute still exists, as cheaply as the backend can tell
    /// (no request to it): a turn on compute that died is not even tried.
    fn alive(&self, _incarnation: &Incarnation) -> bool {
        true
    }

    /// Why the incarnation's compute exists but cannot run (stopped by a signal, frozen),
    /// if it cannot: it answers nothing, so it is lost compute as much as a dead one.
    fn stalled(&self, _incarnation: &Incarnation) -> Option<String> {
        None
    }

    /// Finishes what earlier calls left running in the background (a stopped VMM's exit and
    /// clean-up), before the node stops.
    async fn settle(&self) {}

    /// Start-up reconciliation of what the runtime keeps on this node (VMMs, their
    /// directories, snapshots and the records of who uses them) against the journal:
    /// whatever belongs to no session that `owned` accepts is stopped or removed, and each
    /// decision is logged. Runs before the node serves anything.
    async fn reconcile(&self, _owned: &(dyn for<'s> Fn(&'s str) -> bool + Send + Sync)) {}

    /// Deletes the snapshots of sessions that are gone, on this node and in the fleet's
    /// snapshot store, as `owner` judges each snapshot's session. Runs while the node
    /// serves: in a fleet, other nodes delete sessions whose snapshots this one holds.
    async fn sweep_snapshots(
        &self,
        _owner: &(dyn for<'s> Fn(&'s str) -> SnapshotOwner + Send + Sync),
    ) {
    }

    /// The memory snapshots this runtime holds of `session_uid`, newest first (a Suspend the
    /// daemon did not live to record leaves one that no record names).
    fn snapshots_of(&self, _session_uid: &str) -> Vec<SnapshotRef> {
        Vec::new()
    }

    /// Removes a snapshot that no record names and nothing uses.
    fn discard_snapshot(&self, _snapshot: &SnapshotRef) {}

    /// Opens the harness channel of a live incarnation.
    async fn dial(&self, incarnation: &Incarnation) -> Result<Arc<dyn HarnessEndpoint>>;
}
