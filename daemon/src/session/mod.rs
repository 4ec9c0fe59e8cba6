//! The session host: the Sessions API's behaviour behind the tonic adapter (semantics.md §3).
//! It owns admission (harness resolution, CanPlace, runtime, dial, Describe, fence), the
//! per-session guard, the live incarnations, and calls the controller for every execution.
//! Requests reaching it are already validated field by field by `api::sessions_service`.

pub mod checkpoints;
mod decisions;
pub mod fleet;
mod fork;
pub mod guard;
mod intent;
mod lost;
mod quotas;
mod recovery;
pub mod sweep;
mod turns;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agentvm_proto::v1::{
    Capabilities, ComputeState, HarnessDescriptor, IdentityRef, LogRecord, Origin, Resumability,
    Session, SnapshotRef, event::Body, harness_spec::Placement as SpecPlacement,
    lifecycle::Kind as LifecycleKind,
};
use rand::Rng;
use tonic::Status;

use crate::api::session_view::session_view;
use crate::api::status::journal_status;
use crate::clock::now_nanos;
use crate::controller::Controller;
use crate::controller::endpoint::HarnessEndpoint;
use crate::journal::{DeletionState, Holder, Journal, ListCursor, SessionRow};
use crate::registry::{Entry, Registry};
use crate::runtime::remote::RemoteRuntime;
use crate::runtime::{Incarnation, Runtime, RuntimeError};
use guard::{Busy, Guards, Hold};

/// Describe is bounded (R6 / admission).
pub const DESCRIBE_TIMEOUT: Duration = Duration::from_secs(10);
pub const DEFAULT_PROJECT: &str = "default";
pub const DEFAULT_HARNESS: &str = "echo";

/// A harness name resolved to where it runs.
#[derive(Clone)]
pub struct Placement {
    pub harness: String,
    pub runtime: Arc<dyn Runtime>,
    /// What the registry declares; re-checked against the live descriptor after dial.
    pub capabilities: Capabilities,
    /// Required `Descriptor.id` ("" accepts any).
    pub descriptor_id: String,
    pub registered: bool,
    pub retired: bool,
}

impl Placement {
    pub fn memory_tier(&self) -> bool {
        self.capabilities.resumability == Resumability::RequiresMemorySnapshot as i32
    }
}

struct Live {
    incarnation: Incarnation,
    runtime: Arc<dyn Runtime>,
    /// The harness it serves: a turn for another one must not be answered by it.
    harness: String,
    /// The harness channel, dialed once per incarnation and reused by every turn.
    endpoint: Option<Arc<dyn HarnessEndpoint>>,
    /// The session's project, and the guest memory of its VM if it runs one (quotas).
    project: String,
    vm_mib: Option<u64>,
    /// How far its harness holds the log in memory (memory tier): see
    /// [`crate::controller::Turn::harness_holds_through`].
    holds_through: Option<i64>,
}

/// The fields a new session takes from its creator.
#[derive(Debug, Clone, Default)]
pub struct NewSession {
    pub project: String,
    pub name: String,
    pub harness: String,
    pub model: String,
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
    pub origin: Option<Origin>,
    pub identity: Option<IdentityRef>,
}

pub struct SessionHost {
    journal: Arc<dyn Journal>,
    registry: Arc<Registry>,
    controller: Arc<Controller>,
    /// Which runtime serves each built-in harness on this node.
    builtin_runtimes: HashMap<String, Arc<dyn Runtime>>,
    guards: Arc<Guards>,
    live: Mutex<HashMap<String, Live>>,
    /// Set once the runtimes' lost-compute reports are being recorded.
    watching: std::sync::atomic::AtomicBool,
    /// Set by a drain: new work goes to other nodes.
    /// Set once the node drains; watched by what tells probes (gRPC health, `/readyz`).
    draining: tokio::sync::watch::Sender<bool>,
    /// Free space new work must leave in the node's directories.
    disk: Option<crate::disk::DiskReserve>,
    /// The bound on a harness's Describe (at least [`DESCRIBE_TIMEOUT`]).
    describe_timeout: Duration,
    /// The projects' quotas (from the auth file), with the VM starts they count.
    quotas: Option<Arc<crate::quota::Quotas>>,
    starting: Arc<Mutex<quotas::Starting>>,
    admitting: Mutex<()>,
    /// Which turns' checkpoints memory-tier sessions keep (the node's default).
    retention: checkpoints::Retention,
    turn_checkpoints: Arc<checkpoints::TurnCheckpoints>,
}

/// A session uid: `sess-` and 24 lowercase hex characters.
pub fn new_session_uid() -> String {
    let bytes: [u8; 12] = rand::rng().random();
    format!("sess-{}", hex::encode(bytes))
}

fn busy(uid: &str, b: Busy) -> Status {
    let what = match b.0 {
        Hold::Turn => "an execution or approval",
        Hold::Checkpoint => "a checkpoint (suspend, fork, cancel or delete)",
    };
    Status::aborted(format!(
        "SessionBusy: session {uid} is in {what}; retry after reading the session"
    ))
}

fn runtime_status(e: &RuntimeError) -> Status {
    match e {
        RuntimeError::Unsupported { .. } => Status::failed_precondition(e.to_string()),
        RuntimeError::SnapshotSuperseded { .. } | RuntimeError::SnapshotGone { .. } => {
            Status::aborted(e.to_string())
        }
        RuntimeError::NoSpace { .. } => Status::resource_exhausted(e.to_string()),
        RuntimeError::Hung { .. } => Status::deadline_exceeded(e.to_string()),
        RuntimeError::Corrupt { .. } => Status::data_loss(e.to_string()),
        RuntimeError::Failed { .. } | RuntimeError::Stalled { .. } => {
            Status::unavailable(e.to_string())
        }
    }
}

/// A failed snapshot: what cannot clear by retrying keeps its own code, anything else is
/// the host's fault (the session's compute runs on; see `Runtime::snapshot`).
fn snapshot_status(uid: &str, e: &RuntimeError) -> Status {
    match e {
        RuntimeError::Failed { .. } => Status::internal(format!("snapshot of session {uid}: {e}")),
        _ => runtime_status(e),
    }
}

impl SessionHost {
    pub fn new(
        journal: Arc<dyn Journal>,
        registry: Arc<Registry>,
        controller: Arc<Controller>,
        builtin_runtimes: HashMap<String, Arc<dyn Runtime>>,
    ) -> Self {
        Self {
            journal,
            registry,
            controller,
            builtin_runtimes,
            guards: Arc::default(),
            live: Mutex::default(),
            watching: Default::default(),
            draining: tokio::sync::watch::Sender::new(false),
            disk: None,
            describe_timeout: DESCRIBE_TIMEOUT,
            quotas: None,
            starting: Arc::default(),
            admitting: Mutex::default(),
            retention: checkpoints::Retention::default(),
            turn_checkpoints: Arc::default(),
        }
    }

    /// Holds every project to `quotas` (RESOURCE_EXHAUSTED past them).
    pub fn with_quotas(mut self, quotas: crate::quota::Quotas) -> Self {
        self.quotas = Some(Arc::new(quotas));
        self
    }

    /// How long a harness may take to answer its first Describe: a harness that starts with
    /// its guest (a Python runtime importing grpcio) may need as long as the guest does.
    pub fn with_describe_timeout(mut self, timeout: Duration) -> Self {
        self.describe_timeout = timeout.max(DESCRIBE_TIMEOUT);
        self
    }

    pub fn with_disk_reserve(mut self, disk: crate::disk::DiskReserve) -> Self {
        self.disk = Some(disk);
        self
    }

    /// RESOURCE_EXHAUSTED when `what` would write below the node's disk reserve.
    fn admit_disk(&self, what: &str) -> Result<(), Status> {
        self.disk.as_ref().map_or(Ok(()), |d| d.admit(what))
    }

    pub fn controller(&self) -> &Controller {
        &self.controller
    }

    /// The sessions whose compute runs on this node now, with the runtime each runs on.
    pub fn running(&self) -> Vec<(String, &'static str)> {
        self.live
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(uid, l)| (uid.clone(), l.runtime.name()))
            .collect()
    }

    fn live_get(&self, uid: &str) -> Option<(Incarnation, Arc<dyn Runtime>)> {
        self.live
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(uid)
            .map(|l| (l.incarnation.clone(), l.runtime.clone()))
    }

    /// `incarnation` is the compute of `uid` (of `project`), serving `placement`'s harness.
    fn live_put(&self, uid: &str, project: &str, incarnation: Incarnation, placement: &Placement) {
        self.live.lock().unwrap_or_else(|p| p.into_inner()).insert(
            uid.to_owned(),
            Live {
                incarnation,
                runtime: placement.runtime.clone(),
                harness: placement.harness.clone(),
                endpoint: None,
                project: project.to_owned(),
                vm_mib: placement.runtime.vm_memory_mib(&placement.harness),
                holds_through: None,
            },
        );
    }

    /// The harness of `uid`'s compute holds the log through `seq` in its memory.
    fn live_holds(&self, uid: &str, incarnation: &str, seq: Option<i64>) {
        let mut live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(l) = live
            .get_mut(uid)
            .filter(|l| l.incarnation.id == incarnation)
        {
            l.holds_through = seq;
        }
    }

    fn live_holds_through(&self, uid: &str) -> Option<i64> {
        self.live
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(uid)
            .and_then(|l| l.holds_through)
    }

    /// The harness `uid`'s live compute serves.
    fn live_harness(&self, uid: &str) -> Option<String> {
        self.live
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(uid)
            .map(|l| l.harness.clone())
    }

    fn live_take(&self, uid: &str) -> Option<(Incarnation, Arc<dyn Runtime>)> {
        self.live_take_whole(uid)
            .map(|l| (l.incarnation, l.runtime))
    }

    /// `uid`'s live entry whole, for [`Self::live_return`] should what took it fail.
    fn live_take_whole(&self, uid: &str) -> Option<Live> {
        self.live
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(uid)
    }

    /// Puts back what [`Self::live_take_whole`] took, unless another entry took its place.
    fn live_return(&self, uid: &str, live: Live) {
        self.live
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(uid.to_owned())
            .or_insert(live);
    }

    /// Takes back compute still running for `uid` that this host does not know of (after a
    /// daemon restart), so suspend, fork and delete act on it rather than around it.
    pub(crate) async fn adopt(&self, uid: &str) -> Result<(), Status> {
        if self.live_get(uid).is_some() {
            return Ok(());
        }
        let row = self.row(uid)?;
        let Ok(placement) = self.place(&row.harness) else {
            return Ok(());
        };
        if let Some(inc) = placement
            .runtime
            .attach(uid)
            .await
            .map_err(|e| runtime_status(&e))?
        {
            tracing::info!(session = %uid, "re-adopted running compute");
            self.live_put(uid, &row.project, inc, &placement);
        }
        Ok(())
    }

    /// Resolves a harness name. Unknown → INVALID_ARGUMENT naming what is served.
    pub fn place(&self, name: &str) -> Result<Placement, Status> {
        let entry = self.registry.get(name).map_err(|_| {
            let served: Vec<String> = self
                .registry
                .list("", 50, false)
                .map(|entries| {
                    entries
                        .iter()
                        .map(|e| crate::registry::entry_name(e).to_owned())
                        .collect()
                })
                .unwrap_or_default();
            Status::invalid_argument(format!(
                "harness: {name:?} is not a known harness (known: {})",
                served.join(", ")
            ))
        })?;
        match entry {
            Entry::Static(s) if !s.unservable_reason.is_empty() => {
                Err(Status::failed_precondition(format!(
                    "harness {name:?} cannot run on this node: {}",
                    s.unservable_reason
                )))
            }
            Entry::Static(s) => {
                let runtime = self.builtin_runtimes.get(&s.name).cloned().ok_or_else(|| {
                    Status::failed_precondition(format!(
                        "harness {name:?} cannot run on this node: {}",
                        s.unservable_reason
                    ))
                })?;
                Ok(Placement {
                    harness: s.name.to_owned(),
                    runtime,
                    capabilities: s.capabilities,
                    descriptor_id: String::new(),
                    registered: false,
                    retired: false,
                })
            }
            Entry::Registered(h) => {
                let spec = h.spec.clone().unwrap_or_default();
                let runtime: Arc<dyn Runtime> = match spec.placement {
                    Some(SpecPlacement::Remote(r)) => Arc::new(RemoteRuntime::new(r.address)),
                    Some(SpecPlacement::Substrate(_)) | None => {
                        return Err(Status::failed_precondition(format!(
                            "registered harness {name:?} has a placement this node does not serve"
                        )));
                    }
                };
                Ok(Placement {
                    harness: h.name.clone(),
                    runtime,
                    capabilities: spec.capabilities.unwrap_or_default(),
                    descriptor_id: spec.descriptor_id,
                    registered: true,
                    retired: h.state == agentvm_proto::v1::HarnessState::Retired,
                })
            }
        }
    }

    fn row(&self, uid: &str) -> Result<SessionRow, Status> {
        self.journal
            .get_session(uid)
            .map_err(|e| journal_status(&e))?
            .ok_or_else(|| Status::not_found(format!("session {uid} not found")))
    }

    /// A session that may still be worked on (not being or already deleted) here: no other
    /// live node of the fleet holds it.
    fn active_row(&self, uid: &str) -> Result<SessionRow, Status> {
        let row = self.row(uid)?;
        if row.deletion != DeletionState::Active {
            return Err(Status::failed_precondition(format!(
                "session {uid} is {}; it accepts no further work",
                row.deletion.as_str().to_lowercase()
            )));
        }
        self.held_here(&row)?;
        Ok(row)
    }

    /// Refuses work on a session another live node of the fleet holds, naming that node so
    /// the caller (or a thin scheduler) can route the call there.
    fn held_here(&self, row: &SessionRow) -> Result<(), Status> {
        match self
            .journal
            .holder_of(row)
            .map_err(|e| journal_status(&e))?
        {
            Holder::Here => Ok(()),
            Holder::Alive(node) => Err(Status::failed_precondition(format!(
                "HeldByAnotherNode: session {} is held by node {} at {}; send the call there \
                 (it is taken over only once that node misses its heartbeats)",
                row.uid, node.name, node.address
            ))),
            Holder::Gone(node) => {
                tracing::warn!(session = %row.uid, %node,
                    "taking the session over: its holder's heartbeats stopped");
                Ok(())
            }
        }
    }

    /// Whether `uid` is a session that may still be worked on here (what runtimes keep for
    /// it stays; a session another live node took over is not). A journal that cannot
    /// answer keeps everything.
    pub(crate) fn is_active(&self, uid: &str) -> bool {
        match self.journal.get_session(uid) {
            Ok(Some(row)) => {
                row.deletion == DeletionState::Active
                    && !matches!(self.journal.holder_of(&row), Ok(Holder::Alive(_)))
            }
            Ok(None) => false,
            Err(_) => true,
        }
    }

    fn records(&self, uid: &str) -> Result<Vec<LogRecord>, Status> {
        self.journal.read(uid, 1, 0).map_err(|e| journal_status(&e))
    }

    /// `row`'s latest execution and what follows it: all a turn, a view or a cancel needs of
    /// the log, read in time that does not grow with the session
    /// ([`crate::controller::tail`]).
    fn tail(&self, row: &SessionRow) -> Result<Vec<LogRecord>, Status> {
        crate::controller::tail::read_tail(self.journal.as_ref(), &row.uid, row.last_seq)
            .map_err(|e| journal_status(&e))
    }

    /// `snapshot`, just recorded in `uid`'s SUSPEND with its compute stopped, is all the
    /// session needs of its memory from now on: its runtime frees the older snapshots
    /// nothing needs any more.
    async fn superseded(&self, uid: &str, snapshot: &SnapshotRef) {
        if !snapshot.memory {
            return;
        }
        let Ok(placement) = self.row(uid).and_then(|row| self.place(&row.harness)) else {
            return;
        };
        placement.runtime.superseded(uid, snapshot).await;
    }

    /// The API view, re-read from the journal.
    pub fn view(&self, uid: &str) -> Result<Session, Status> {
        let row = self.row(uid)?;
        Ok(view_of(&row, &self.tail(&row)?))
    }

    pub fn create(&self, new: NewSession) -> Result<Session, Status> {
        let row = self.create_row(new)?;
        Ok(view_of(&row, &[]))
    }

    fn create_row(&self, new: NewSession) -> Result<SessionRow, Status> {
        self.refuse_if_draining()?;
        if let Some(value) = new.annotations.get(checkpoints::ANNOTATION) {
            checkpoints::Retention::parse(value).map_err(Status::invalid_argument)?;
        }
        let harness = if new.harness.is_empty() {
            DEFAULT_HARNESS.to_owned()
        } else {
            new.harness
        };
        let placement = self.place(&harness)?;
        // A session its harness can never run on is refused now, not at its first turn.
        crate::runtime::placement::can_place(
            &placement.capabilities,
            placement.runtime.name(),
            &placement.runtime.capabilities(),
        )
        .map_err(|e| Status::failed_precondition(format!("harness {harness:?}: {e}")))?;
        self.admit_disk("a new session")?;
        if placement.retired {
            return Err(Status::failed_precondition(format!(
                "harness {harness:?} is retired and takes no new sessions"
            )));
        }
        let project = if new.project.is_empty() {
            DEFAULT_PROJECT.to_owned()
        } else {
            new.project
        };
        self.admit_new_session(&project)?;
        let now = now_nanos();
        let row = SessionRow {
            uid: new_session_uid(),
            project,
            name: new.name,
            harness,
            model: new.model,
            labels: new.labels,
            annotations: new.annotations,
            origin: new.origin,
            identity: new.identity,
            created_at: now,
            updated_at: now,
            compute_state: ComputeState::ComputeNone,
            ..Default::default()
        };
        self.journal
            .create_session(&row)
            .map_err(|e| journal_status(&e))?;
        tracing::info!(session = %row.uid, harness = %row.harness, "session created");
        Ok(row)
    }

    pub fn list(
        &self,
        project: &str,
        page_size: usize,
        after: Option<&ListCursor>,
    ) -> Result<(Vec<Session>, Option<ListCursor>), Status> {
        let project = if project.is_empty() {
            DEFAULT_PROJECT
        } else {
            project
        };
        let mut rows = self
            .journal
            .list_sessions(project, after, page_size + 1)
            .map_err(|e| journal_status(&e))?;
        let mut full = rows.len() > page_size;
        rows.truncate(page_size);
        // A page also ends where it would outgrow one response (sessions stored before
        // metadata had limits may be large): the next one starts after its last session.
        let mut sessions = Vec::with_capacity(rows.len());
        let mut bytes = 0;
        for r in &rows {
            let view = view_of(r, &self.tail(r)?);
            bytes += prost::Message::encoded_len(&view);
            if !sessions.is_empty() && bytes > crate::api::metadata_limits::MAX_PAGE_BYTES {
                full = true;
                break;
            }
            sessions.push(view);
        }
        let next = match full {
            true => sessions
                .len()
                .checked_sub(1)
                .and_then(|last| rows.get(last))
                .map(|r| ListCursor {
                    created_at: r.created_at,
                    uid: r.uid.clone(),
                }),
            false => None,
        };
        Ok((sessions, next))
    }

    pub fn replay(&self, uid: &str, from_seq: i64, to_seq: i64) -> Result<Vec<LogRecord>, Status> {
        self.row(uid)?;
        self.journal
            .read(uid, from_seq.max(1), to_seq)
            .map_err(|e| journal_status(&e))
    }

    async fn dial(
        &self,
        placement: &Placement,
        incarnation: &Incarnation,
    ) -> Result<Arc<dyn HarnessEndpoint>, Status> {
        let cached = self
            .live
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&incarnation.id)
            .filter(|l| l.incarnation == *incarnation)
            .and_then(|l| l.endpoint.clone());
        if let Some(endpoint) = cached {
            return Ok(endpoint);
        }
        let endpoint = placement
            .runtime
            .dial(incarnation)
            .await
            .map_err(|e| runtime_status(&e))?;
        if let Some(l) = self
            .live
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(&incarnation.id)
            .filter(|l| l.incarnation == *incarnation)
        {
            l.endpoint = Some(endpoint.clone());
        }
        Ok(endpoint)
    }

    /// Dials a live incarnation and checks what the harness says about itself against the
    /// placement: descriptor id, and CanPlace again with the live capabilities.
    async fn describe(
        &self,
        placement: &Placement,
        incarnation: &Incarnation,
    ) -> Result<
        (
            Arc<dyn crate::controller::endpoint::HarnessEndpoint>,
            HarnessDescriptor,
        ),
        Status,
    > {
        let endpoint = self.dial(placement, incarnation).await?;
        // Bounded like every wait on a harness, by the node's idle deadline where it is lower.
        let bound = self
            .describe_timeout
            .min(self.controller.harness_idle_timeout());
        let descriptor = match tokio::time::timeout(bound, endpoint.describe()).await {
            Ok(Ok(d)) => d,
            Ok(Err(s)) => {
                return Err(Status::unavailable(format!(
                    "HarnessDescribeFailed: harness {:?}: {}",
                    placement.harness,
                    s.message()
                )));
            }
            Err(_) => {
                return Err(Status::deadline_exceeded(format!(
                    "HarnessDescribeFailed: harness {:?} did not answer Describe within {bound:?}",
                    placement.harness
                )));
            }
        };
        if !placement.descriptor_id.is_empty() && descriptor.id != placement.descriptor_id {
            return Err(Status::failed_precondition(format!(
                "harness {:?} reports descriptor id {:?}, registered as {:?}",
                placement.harness, descriptor.id, placement.descriptor_id
            )));
        }
        if let Some(caps) = &descriptor.capabilities {
            crate::runtime::placement::can_place(
                caps,
                placement.runtime.name(),
                &placement.runtime.capabilities(),
            )
            .map_err(|e| Status::failed_precondition(e.to_string()))?;
        }
        Ok((endpoint, descriptor))
    }
}

/// The API view: the stored row plus what the log says; a deleted session shows TERMINATED.
pub fn view_of(row: &SessionRow, records: &[LogRecord]) -> Session {
    let mut s = session_view(row, records);
    if row.deletion == DeletionState::Deleted {
        s.compute_state = ComputeState::ComputeTerminated as i32;
    }
    s
}

/// The memory snapshot this session continues from when its compute is gone: the latest
/// SUSPEND it took itself or, for a fork child that never suspended, the snapshot its FORK
/// record names. Records up to `fork_seq` were copied from the parent and are not its own
/// (an older SUSPEND there is an earlier state of the parent, not of this session).
pub fn resume_point(records: &[LogRecord], fork_seq: i64) -> Option<SnapshotRef> {
    resume_record(records, fork_seq).map(|(_, snapshot)| snapshot)
}

/// [`resume_point`] with the seq of the record naming it.
pub fn resume_record(records: &[LogRecord], fork_seq: i64) -> Option<(i64, SnapshotRef)> {
    records
        .iter()
        .rev()
        .take_while(|r| r.seq > fork_seq)
        .find_map(|r| match &r.event.as_ref()?.body {
            Some(Body::Lifecycle(l))
                if (l.kind == LifecycleKind::LifecycleSuspend as i32
                    || l.kind == LifecycleKind::LifecycleFork as i32)
                    && l.snapshot_memory =>
            {
                Some((
                    r.seq,
                    SnapshotRef {
                        local: l.snapshot_local.clone(),
                        external_uri: l.snapshot_external_uri.clone(),
                        memory: l.snapshot_memory,
                        sealed: l.snapshot_sealed,
                    },
                ))
            }
            _ => None,
        })
}
