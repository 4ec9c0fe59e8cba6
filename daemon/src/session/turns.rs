//! Exec, Resume and Suspend: everything that runs an execution or moves a session's compute.

use agentvm_proto::v1::{
    ComputeState, EventKind, ExecRequest, ExecUpdate, Lifecycle, Session, SnapshotRef, event::Body,
    exec_update::Update, lifecycle::Kind as LifecycleKind,
};
use tokio::sync::mpsc;
use tonic::Status;
use tracing::Instrument;

use super::guard::{Held, Hold};
use super::intent::Intent;
use super::{
    NewSession, Placement, SessionHost, busy, resume_record, runtime_status, snapshot_status,
    view_of,
};
use crate::api::status::journal_status;
use crate::controller::error::ControllerError;
use crate::controller::log::SessionLog;
use crate::controller::tail::{last_execution_record, read_back};
use crate::controller::{
    GateState, Interrupt, NewExecution, Turn, TurnOutcome, gate_state, inherited_open_intent, stamp,
};
use crate::crash_point;
use crate::journal::{OperationKind, SessionRow};
use crate::runtime::placement::can_place;
use crate::runtime::{Incarnation, RuntimeError, SessionSpec, SnapshotKind};

pub type Updates = mpsc::Sender<Result<ExecUpdate, Status>>;

/// A LIFECYCLE event of `kind`, naming `snapshot` (the state it leaves the session in).
pub(super) fn lifecycle_event(
    kind: LifecycleKind,
    detail: &str,
    snapshot: Option<SnapshotRef>,
) -> agentvm_proto::v1::Event {
    let snapshot = snapshot.unwrap_or_default();
    stamp(
        "",
        EventKind::EventLifecycle,
        Body::Lifecycle(Lifecycle {
            kind: kind as i32,
            detail: detail.to_owned(),
            snapshot_local: snapshot.local,
            snapshot_external_uri: snapshot.external_uri,
            snapshot_memory: snapshot.memory,
            snapshot_sealed: snapshot.sealed,
        }),
    )
}

fn session_frame(s: Session) -> Result<ExecUpdate, Status> {
    Ok(ExecUpdate {
        update: Some(Update::Session(s)),
    })
}

fn parse_log(records: Vec<agentvm_proto::v1::LogRecord>) -> Result<SessionLog, Status> {
    SessionLog::parse(records).map_err(Status::from)
}

/// Sessions a draining node suspends at once: enough to overlap their snapshot writes,
/// few enough not to flood the disk or starve the turns still finishing.
const DRAIN_PARALLELISM: usize = 8;

/// A config the built-in harness would only fail on is refused before anything is journaled
/// or started. Registered harnesses are asked nothing: their config is theirs to judge.
fn check_config(placement: &Placement, config: &[u8]) -> Result<(), Status> {
    if placement.registered {
        return Ok(());
    }
    match agentvm_harnesses::builtin(&placement.harness) {
        Some(harness) => harness.check_config(config).map_err(|e| {
            Status::invalid_argument(format!(
                "config: harness {:?} cannot take it: {}",
                placement.harness, e.description
            ))
        }),
        None => Ok(()),
    }
}

impl SessionHost {
    /// The harness a new execution runs on: the session's, or the request's where the
    /// session allows switching (built-in stateless harnesses only; a registered harness
    /// pins the session, and none can be switched to). A harness whose state is its
    /// compute's memory is never switched from or to: the turn would run without that
    /// memory, or leave it behind. Refused here, before any compute is touched.
    fn turn_harness(&self, row: &SessionRow, requested: &str) -> Result<String, Status> {
        if requested.is_empty() || requested == row.harness {
            return Ok(row.harness.clone());
        }
        let over = self.place(requested)?;
        let current = self.place(&row.harness).ok();
        if over.registered || current.as_ref().is_none_or(|p| p.registered) {
            return Err(Status::failed_precondition(format!(
                "harness: session {} is pinned to {:?}; a registered harness cannot be switched per turn",
                row.uid, row.harness
            )));
        }
        if let Some(memory) = [current.as_ref(), Some(&over)]
            .into_iter()
            .flatten()
            .find(|p| p.memory_tier())
        {
            return Err(Status::failed_precondition(format!(
                "harness: session {} runs {:?}; a turn cannot run on {requested:?} instead, \
                 because {:?} keeps its state in its compute's memory (fork the session, or \
                 create one for {requested:?})",
                row.uid, row.harness, memory.harness
            )));
        }
        Ok(requested.to_owned())
    }

    /// Where a new turn runs, and whether the request may run there: the recorded harness of
    /// an interrupted execution being recovered, else the session's or the request's (with
    /// its config judged).
    fn turn_placement(
        &self,
        row: &SessionRow,
        req: &ExecRequest,
        pending: Option<&crate::controller::log::ExecutionLog>,
        recovering: bool,
    ) -> Result<Placement, Status> {
        let harness = match pending
            .filter(|_| recovering)
            .and_then(|x| x.start.as_ref())
        {
            Some(start) if !start.harness.is_empty() => start.harness.clone(),
            _ if recovering => row.harness.clone(),
            _ => self.turn_harness(row, &req.harness)?,
        };
        let placement = self.place(&harness).map_err(|s| {
            if recovering {
                Status::failed_precondition(format!(
                    "the interrupted execution's harness is not served here: {}",
                    s.message()
                ))
            } else {
                s
            }
        })?;
        if !recovering {
            check_config(&placement, &req.config)?;
        }
        Ok(placement)
    }

    /// Exec: streams the Session first, then records (and a streaming model's deltas); a
    /// Session again at the end only after an approval park, as upstream. What the request
    /// itself gets wrong is returned before the first frame; an error after it is returned
    /// for the caller to send as the stream's end.
    pub async fn exec(&self, req: ExecRequest, updates: &Updates) -> Result<(), Status> {
        self.refuse_if_draining()?;
        let input_bytes: u64 = req
            .inputs
            .iter()
            .map(|m| prost::Message::encoded_len(m) as u64)
            .sum();
        let mut quota = None;
        let row = if req.session.is_empty() {
            // A new session's turn is never a recovery: its config and its quotas (the
            // session, its inputs, its VM) are judged before the session is created, so a
            // refused Exec leaves no session behind.
            let harness = match req.harness.as_str() {
                "" => super::DEFAULT_HARNESS,
                named => named,
            };
            let placement = self.place(harness)?;
            check_config(&placement, &req.config)?;
            quota = Some(self.admit_quota(
                super::DEFAULT_PROJECT,
                crate::quota::Ask {
                    sessions: 1,
                    log_bytes: Some(input_bytes),
                    vms: 1,
                    ..Default::default()
                },
                placement.runtime.vm_memory_mib(&placement.harness),
            )?);
            self.create_row(NewSession {
                harness: req.harness.clone(),
                ..Default::default()
            })?
        } else {
            self.active_row(&req.session)?
        };
        let uid = row.uid.clone();
        let started = std::time::Instant::now();
        tracing::info!(
            session = %uid,
            inputs = req.inputs.len(),
            expected_last_seq = ?req.expected_last_seq,
            "exec"
        );
        let records = self.tail(&row)?;
        let first = session_frame(view_of(&row, &records));
        let log = parse_log(records)?;
        let pending = log.pending().filter(|x| !x.is_legacy());
        // An inputless Exec on a turn parked at an approval only reports the session.
        let waiting = req.inputs.is_empty()
            && pending.is_some_and(|x| matches!(gate_state(x), GateState::Pending(_)));
        // Recovery takes the route the interrupted execution recorded, whatever harness the
        // request names (as upstream: its config, cursor and harness are ignored).
        let recovering = req.inputs.is_empty() && pending.is_some();
        // What the request itself gets wrong (an unknown or pinned harness, a config the
        // harness cannot take) is the stream's status before any frame, as upstream answers.
        let placement = match waiting {
            true => None,
            false => Some(self.turn_placement(&row, &req, pending, recovering)?),
        };
        // Over a quota, the request is refused as what it gets wrong: before any frame.
        if let (None, Some(placement)) = (&quota, &placement) {
            quota = Some(self.admit_turn(&row, placement, Some(input_bytes))?);
        }
        if updates.send(first).await.is_err() {
            return Ok(());
        }

        let held = self
            .guards
            .try_hold(&uid, Hold::Turn)
            .map_err(|b| busy(&uid, b))?;
        let deadline = match req.deadline_unix {
            0 => None,
            unix => {
                let now = crate::clock::now_nanos() / 1_000_000_000;
                if unix <= now {
                    return Err(Status::deadline_exceeded(format!(
                        "deadline_unix {unix} has already passed"
                    )));
                }
                Some(
                    tokio::time::Instant::now()
                        + std::time::Duration::from_secs((unix - now) as u64),
                )
            }
        };
        if let Some(x) = pending {
            match gate_state(x) {
                GateState::Clear => {}
                GateState::Pending(_) if req.inputs.is_empty() => {
                    // Waiting for a decision: the same Session, no IO, no journal change.
                    let _ = updates.send(session_frame(self.view(&uid)?)).await;
                    return Ok(());
                }
                _ if !req.inputs.is_empty() => {
                    return Err(Status::failed_precondition(format!(
                        "ApprovalBlocked: execution {} has an approval gate without a receipt; decide it and resume before new input",
                        x.id
                    )));
                }
                _ => {}
            }
        }
        let Some(placement) = placement else {
            // Only a waiting turn has none, and it returned above.
            return Err(Status::internal("no harness resolved for the turn"));
        };
        // The last turn's checkpoint may still hold the VM paused: its input waits for that.
        self.turn_checkpoints
            .running_again(&uid, || self.checkpoint_hopeless(&uid))
            .await;
        let turn = self
            .admit(&row, &placement, &held, deadline, Some(updates.clone()))
            .await?;
        // The compute is live (and counted as such) from here.
        drop(quota);
        let (turn, forward) = turn;
        let incarnation = self.live_get(&uid).map(|(inc, _)| inc.id);
        let outcome = if recovering {
            self.controller.resume(&turn).await
        } else {
            self.controller
                .exec(
                    &turn,
                    NewExecution {
                        inputs: req.inputs,
                        config: req.config,
                        resume_from_seq: req.resume_from_seq,
                        expected_last_seq: req.expected_last_seq,
                    },
                )
                .await
                .map(Some)
        };
        let fence = turn.fence;
        let keeps_history =
            turn.incremental_history() && placement.runtime.harness_lives_with_incarnation();
        drop(turn);
        let _ = forward.await;
        let outcome = match outcome {
            Ok(outcome) => outcome,
            Err(e) => return Err(self.turn_failed(&row, &placement, e).await),
        };
        let (parked, history_through) = match outcome {
            Some(TurnOutcome::Parked { head, .. }) => {
                self.park_handoff(&uid, head, fence).await?;
                (true, None)
            }
            Some(TurnOutcome::Completed {
                history_through, ..
            }) => (false, history_through),
            None => (false, None),
        };
        let view = self.view(&uid)?;
        // Every completed turn of a memory-tier session is a point it can be forked from.
        if !parked
            && placement.memory_tier()
            && let Some((inc, runtime)) = self.live_get(&uid)
        {
            self.checkpoint_turn(
                &uid,
                view.last_seq,
                inc,
                runtime,
                &placement.harness,
                &row.annotations,
            );
        }
        // What the harness now holds: a memory-tier one ran the whole turn, so the log
        // through its last record; one that keeps its history, what it was sent. (A failed
        // turn leaves the mark where it was: a memory-tier harness is then sent more than it
        // needs, never less, and one that keeps its history trims what it already has.)
        if let (false, Some(incarnation)) = (parked, &incarnation) {
            let holds = match placement.memory_tier() {
                true => Some(view.last_seq),
                false if keeps_history => history_through,
                false => None,
            };
            self.live_holds(&uid, incarnation, holds);
        }
        drop(held);
        tracing::info!(
            session = %uid,
            last_seq = view.last_seq,
            ms = started.elapsed().as_millis() as u64,
            "exec finished"
        );
        // Only a park ends with the session (awaiting, cold, its pending approval): upstream
        // sends no trailing frame after a completed turn, and its agentctl prints a line for
        // every Session frame.
        if parked {
            let _ = updates.send(session_frame(view)).await;
        }
        Ok(())
    }

    /// A turn failed. A harness that went silent past the idle deadline is taken for hung:
    /// its compute is stopped (a memory-tier session's loss recorded), so the next turn
    /// starts from the session's last state instead of waiting on it again.
    async fn turn_failed(
        &self,
        row: &SessionRow,
        placement: &Placement,
        e: ControllerError,
    ) -> Status {
        if let Some((inc, runtime)) = self.live_get(&row.uid)
            && let Some(why) = runtime.stalled(&inc)
        {
            self.live_take(&row.uid);
            if let Err(stop) = runtime.stop(&inc).await {
                tracing::warn!(session = %row.uid, error = %stop, "stopping stalled compute");
            }
            if placement.memory_tier() {
                self.record_lost(&row.uid, row.fork_seq, &format!("{why}; it was killed"));
            }
            return stalled_status(&why, &Status::from(e));
        }
        if let ControllerError::HarnessSilent(idle) = &e
            && let Some((inc, runtime)) = self.live_take(&row.uid)
        {
            if let Err(stop) = runtime.stop(&inc).await {
                tracing::warn!(session = %row.uid, error = %stop, "stopping hung compute");
            }
            if placement.memory_tier() {
                self.record_lost(
                    &row.uid,
                    row.fork_seq,
                    &format!(
                        "the guest stopped answering (nothing for {idle:?}); its VM was stopped"
                    ),
                );
            }
            return Status::deadline_exceeded(format!(
                "{e}; the session's compute was stopped as hung and the next turn continues \
                 from the session's last state (--harness-idle-timeout-secs sets the deadline)"
            ));
        }
        self.turn_failure(&row.uid, Status::from(e))
    }

    /// A failed turn whose compute died under it says so (UNAVAILABLE: the next turn
    /// brings the session back), whatever broken stream the harness side saw first.
    fn turn_failure(&self, uid: &str, status: Status) -> Status {
        let Some((inc, runtime)) = self.live_get(uid) else {
            return status;
        };
        if !runtime.alive(&inc) {
            return Status::unavailable(format!(
                "compute lost: the session's VM exited during the turn ({}); the next turn \
                 continues from the session's last snapshot",
                status.message()
            ));
        }
        match runtime.stalled(&inc) {
            Some(why) => stalled_status(&why, &status),
            None => status,
        }
    }

    /// CanPlace, compute (attach, restore or create), dial, Describe, then a fresh fence.
    /// The returned task forwards the controller's records and deltas to `updates`.
    async fn admit(
        &self,
        row: &SessionRow,
        placement: &Placement,
        held: &Held,
        deadline: Option<tokio::time::Instant>,
        updates: Option<Updates>,
    ) -> Result<(Turn, tokio::task::JoinHandle<()>), Status> {
        let runtime = &placement.runtime;
        can_place(
            &placement.capabilities,
            runtime.name(),
            &runtime.capabilities(),
        )
        .map_err(|e| Status::failed_precondition(e.to_string()))?;
        let started = std::time::Instant::now();
        let (incarnation, how) = self.provision(row, placement).await?;
        tracing::info!(
            session = %row.uid,
            harness = %placement.harness,
            runtime = %runtime.name(),
            compute = %how,
            ms = started.elapsed().as_millis() as u64,
            "compute ready"
        );
        let (endpoint, descriptor) = match self.describe(placement, &incarnation).await {
            Ok(d) => d,
            Err(s) => {
                let mut s = self.turn_failure(&row.uid, s);
                // A compute we cannot reach is not kept as the session's incarnation; a
                // memory-tier session's RAM goes with it, which its log then says.
                if let Some((inc, rt)) = self.live_take(&row.uid) {
                    let _ = rt.stop(&inc).await;
                    if placement.memory_tier() && row.compute_state == ComputeState::ComputeLive {
                        self.record_lost(
                            &row.uid,
                            row.fork_seq,
                            &format!("unreachable: {}", s.message()),
                        );
                    }
                    if s.code() == tonic::Code::DeadlineExceeded {
                        s = Status::deadline_exceeded(format!(
                            "{}; the session's compute was stopped as hung and the next turn \
                             continues from the session's last state",
                            s.message()
                        ));
                    }
                }
                return Err(s);
            }
        };
        let fence = match self.journal.new_fence(&row.uid) {
            Ok(fence) => fence,
            Err(e) => {
                if let crate::journal::JournalError::HeldElsewhere { .. } = e {
                    // Another node took the session while this one started its compute.
                    if let Some((inc, rt)) = self.live_take(&row.uid) {
                        let _ = rt.stop(&inc).await;
                    }
                }
                return Err(journal_status(&e));
            }
        };
        let (observer, forward) = match updates {
            Some(updates) => {
                let (tx, mut rx) = mpsc::channel::<ExecUpdate>(64);
                let task = tokio::spawn(
                    async move {
                        while let Some(u) = rx.recv().await {
                            if updates.send(Ok(u)).await.is_err() {
                                // The caller stopped reading; keep draining so the turn never
                                // blocks.
                                while rx.recv().await.is_some() {}
                                return;
                            }
                        }
                    }
                    .in_current_span(),
                );
                (Some(tx), task)
            }
            None => (None, tokio::spawn(async {})),
        };
        Ok((
            Turn {
                session: row.uid.clone(),
                fence,
                fork_seq: row.fork_seq,
                harness: placement.harness.clone(),
                model: row.model.clone(),
                descriptor,
                endpoint,
                identity: row.identity.clone(),
                observer,
                deadline,
                interrupt: Some(held.interrupt.clone()),
                harness_holds_through: self.live_holds_through(&row.uid),
            },
            forward,
        ))
    }

    /// The session's live incarnation; otherwise restore its own memory snapshot (memory
    /// tier, cold) or create fresh compute.
    async fn provision(
        &self,
        row: &SessionRow,
        placement: &Placement,
    ) -> Result<(Incarnation, &'static str), Status> {
        if let Some((inc, runtime)) = self.live_get(&row.uid) {
            let serves = self.live_harness(&row.uid);
            if serves.as_deref() != Some(placement.harness.as_str()) {
                // It serves another harness than this turn's (a per-turn switch, which only
                // stateless harnesses make: their state is the log, so nothing is lost).
                // Answered by it, the turn would be journaled as the other's.
                tracing::info!(session = %row.uid, from = ?serves, to = %placement.harness,
                    "switching harness: stopping the compute of the other one");
                self.live_take(&row.uid);
                if let Err(e) = runtime.stop(&inc).await {
                    tracing::warn!(session = %row.uid, error = %e, "stopping the other harness's compute");
                }
            } else if runtime.alive(&inc) {
                return Ok((inc, "attached"));
            } else {
                // Died since the last turn, before its exit was recorded: record it here, so
                // this turn goes on from the session's last state instead of failing on a
                // dead VM.
                self.live_take(&row.uid);
            }
        }
        if let Some(inc) = placement
            .runtime
            .attach(&row.uid)
            .await
            .map_err(|e| runtime_status(&e))?
        {
            self.live_put(&row.uid, &row.project, inc.clone(), placement);
            return Ok((inc, "re-adopted"));
        }
        let spec = SessionSpec {
            session_uid: row.uid.clone(),
            image: String::new(),
            harness: placement.harness.clone(),
            identity: row.identity.clone(),
            annotations: row.annotations.clone(),
        };
        // Memory tier: suspended, or its compute is gone (a VMM killed, a node restarted
        // without it) — either way the last snapshot is the state to continue from, and a
        // loss is recorded before anything runs on that older state.
        let snapshot = if placement.memory_tier() {
            if row.compute_state == ComputeState::ComputeLive {
                self.settle_lost_compute(
                    &row.uid,
                    row.fork_seq,
                    &placement.runtime,
                    "its VMM was gone when the next turn came",
                )?;
            }
            // Read back from the head only as far as the snapshot to continue from and the
            // last execution before it (what its harness has seen the log through).
            let found = |records: &[agentvm_proto::v1::LogRecord]| {
                resume_record(records, row.fork_seq)
                    .is_some_and(|(seq, _)| last_execution_record(records, seq) > 0)
            };
            let records = read_back(self.journal.as_ref(), &row.uid, row.last_seq, found)
                .map_err(|e| journal_status(&e))?;
            resume_record(&records, row.fork_seq)
                .map(|(seq, snapshot)| (snapshot, last_execution_record(&records, seq)))
        } else {
            None
        };
        crash_point::reached(crash_point::START_BEGUN);
        let (inc, how, holds) = match snapshot {
            Some((r, holds)) => {
                let restored = placement.runtime.restore(&r, &spec).await;
                if let Err(RuntimeError::Corrupt { reason, .. }) = &restored {
                    self.record_unusable_snapshot(&row.uid, &r, reason);
                }
                (restored, "restored", Some(holds))
            }
            None => (placement.runtime.create(&spec).await, "created", None),
        };
        let inc = inc.map_err(|e| runtime_status(&e))?;
        crash_point::reached(crash_point::START_READY);
        self.live_put(&row.uid, &row.project, inc.clone(), placement);
        self.live_holds(&row.uid, &inc.id, holds);
        Ok((inc, how))
    }

    /// After a park: close the harness, take the external snapshot and append SUSPEND at the
    /// head the park left, under the execution's fence.
    async fn park_handoff(&self, uid: &str, head: i64, fence: i64) -> Result<(), Status> {
        let (snapshot, intent) = self.checkpoint(uid).await?;
        self.append_lifecycle(
            uid,
            head,
            fence,
            LifecycleKind::LifecycleSuspend,
            "approval park",
            Some(snapshot),
        )?;
        crash_point::reached(crash_point::SUSPEND_RECORDED);
        drop(intent);
        Ok(())
    }

    /// Snapshot(EXTERNAL) of the live compute (freeing it); a session without live compute
    /// has nothing in memory, so its reference is the session itself. The caller records
    /// the SUSPEND, then ends the returned intent.
    pub(super) async fn checkpoint(&self, uid: &str) -> Result<(SnapshotRef, Intent), Status> {
        self.turn_checkpoints
            .settled(uid, || self.checkpoint_hopeless(uid))
            .await;
        self.adopt(uid).await?;
        let Some((inc, runtime)) = self.live_get(uid) else {
            let local = SnapshotRef {
                local: uid.to_owned(),
                ..Default::default()
            };
            return Ok((local, Intent::none(self.journal.clone())));
        };
        let intent = self.intend(OperationKind::Suspend, uid, Vec::new())?;
        crash_point::reached(crash_point::SUSPEND_BEGUN);
        let taken = self.live_take_whole(uid);
        let snapshot = match runtime.snapshot(&inc, SnapshotKind::External).await {
            Ok(snapshot) => snapshot,
            Err(e) => {
                // A failed snapshot leaves the compute running (`Runtime::snapshot`): it stays
                // the session's, so the next turn uses it (or finds it lost and says so)
                // instead of replacing it unrecorded.
                if let Some(live) = taken
                    && runtime.alive(&inc)
                {
                    self.live_return(uid, live);
                }
                return Err(snapshot_status(uid, &e));
            }
        };
        crash_point::reached(crash_point::SUSPEND_SNAPSHOTTED);
        Ok((snapshot, intent))
    }

    /// A live fork's checkpoint: a durable snapshot of the session's compute, which goes on
    /// running. `None` when it has no compute here or its runtime can only snapshot by
    /// stopping it (then [`Self::checkpoint`] is the way). The intent ends when dropped.
    pub(super) async fn checkpoint_live(
        &self,
        uid: &str,
    ) -> Result<Option<(SnapshotRef, Intent)>, Status> {
        self.turn_checkpoints
            .settled(uid, || self.checkpoint_hopeless(uid))
            .await;
        self.adopt(uid).await?;
        let Some((inc, runtime)) = self.live_get(uid) else {
            return Ok(None);
        };
        let intent = self.intend(OperationKind::Suspend, uid, Vec::new())?;
        crash_point::reached(crash_point::SUSPEND_BEGUN);
        let snapshot = runtime
            .checkpoint_live(&inc)
            .await
            .map_err(|e| snapshot_status(uid, &e))?;
        crash_point::reached(crash_point::SUSPEND_SNAPSHOTTED);
        Ok(snapshot.map(|s| (s, intent)))
    }

    /// Appends a SUSPEND naming `snapshot` at the session's head, under a fresh fence (which
    /// supersedes any writer still holding an older one). The caller holds the session.
    pub(super) fn suspend_at_head(
        &self,
        uid: &str,
        detail: &str,
        snapshot: Option<SnapshotRef>,
    ) -> Result<agentvm_proto::v1::LogRecord, Status> {
        let fence = self
            .journal
            .new_fence(uid)
            .map_err(|e| journal_status(&e))?;
        let head = self.row(uid)?.last_seq;
        self.append_lifecycle(
            uid,
            head,
            fence,
            LifecycleKind::LifecycleSuspend,
            detail,
            snapshot,
        )
    }

    pub(super) fn append_lifecycle(
        &self,
        uid: &str,
        head: i64,
        fence: i64,
        kind: LifecycleKind,
        detail: &str,
        snapshot: Option<SnapshotRef>,
    ) -> Result<agentvm_proto::v1::LogRecord, Status> {
        let event = lifecycle_event(kind, detail, snapshot);
        let mut records = self
            .journal
            .append(uid, head, fence, &[event])
            .map_err(|e| journal_status(&e))?;
        Ok(records.remove(0))
    }

    /// Suspend: preempts a running turn (it stays resumable), snapshots and frees the compute,
    /// appends SUSPEND. Already cold → unchanged.
    pub async fn suspend(&self, uid: &str) -> Result<Session, Status> {
        self.active_row(uid)?;
        let _held = self
            .guards
            .preempt_and_hold(
                uid,
                Hold::Checkpoint,
                Interrupt::Supersede("suspended".into()),
            )
            .await
            .map_err(|b| busy(uid, b))?;
        let row = self.active_row(uid)?;
        if row.compute_state == ComputeState::ComputeCold && self.live_get(uid).is_none() {
            return self.view(uid);
        }
        if self
            .settle_if_gone(&row, "its VMM was gone when the session was suspended")
            .await?
        {
            return self.view(uid);
        }
        self.admit_disk("a suspend (its snapshot)")?;
        let runtime = self.live_get(uid).map(|(_, runtime)| runtime);
        let (snapshot, intent) = self.checkpoint(uid).await?;
        self.suspend_at_head(uid, "", Some(snapshot.clone()))?;
        crash_point::reached(crash_point::SUSPEND_RECORDED);
        drop(intent);
        self.superseded(uid, &snapshot).await;
        if let Some(runtime) = runtime {
            self.publish_checkpoints(uid, &runtime).await;
        }
        // Nothing runs here any more: any node of a fleet may take it at its next call.
        if let Err(e) = self.journal.release(uid) {
            tracing::warn!(session = %uid, error = %e, "the suspended session stays held here");
        }
        tracing::info!(session = %uid, "session suspended");
        self.view(uid)
    }

    /// Suspends every session with running compute, within `budget` (a node shutting down
    /// with `--shutdown-policy suspend`): memory-tier sessions are snapshotted, stateless ones
    /// just stopped. Fork children count too: they read COLD but run in VMMs of their own
    /// until their first turn. Several at a time, since each mostly waits on its VMM writing
    /// a snapshot. Returns how many were suspended and the failures.
    /// Every suspend is recorded with `actor`: the operator who drained the node, or the node
    /// itself at shutdown.
    pub async fn suspend_all(
        &self,
        budget: std::time::Duration,
        actor: agentvm_proto::v1::IdentityRef,
    ) -> (usize, Vec<(String, String)>) {
        use futures_util::StreamExt;
        let deadline = tokio::time::Instant::now() + budget;
        let mut failed = Vec::new();
        let mut running = Vec::new();
        for state in [ComputeState::ComputeLive, ComputeState::ComputeCold] {
            match self.journal.sessions_in_state(state) {
                Ok(uids) => running.extend(uids.into_iter().filter(|uid| {
                    state == ComputeState::ComputeLive || self.live_get(uid).is_some()
                })),
                Err(e) => failed.push((String::new(), e.to_string())),
            }
        }
        let outcomes: Vec<_> = futures_util::stream::iter(running)
            .map(|uid| {
                let actor = actor.clone();
                async move {
                    let suspend = crate::api::auth::ACTOR.scope(actor, self.suspend(&uid));
                    let outcome = tokio::time::timeout_at(deadline, suspend).await;
                    (uid, outcome)
                }
            })
            .buffer_unordered(DRAIN_PARALLELISM)
            .collect()
            .await;
        let mut done = 0;
        for (uid, outcome) in outcomes {
            match outcome {
                Ok(Ok(_)) => done += 1,
                Ok(Err(s)) => failed.push((uid, s.message().to_owned())),
                Err(_) => failed.push((uid, "the shutdown budget ran out".to_owned())),
            }
        }
        // The node stops next: nothing a suspend left to finish may be cut off.
        self.settle().await;
        (done, failed)
    }

    /// Resume: bring compute back (restoring the session's own snapshot), re-drive an
    /// interrupted execution, then append RESUME, whether the session was cold or not, as
    /// upstream does (semantics.md, Resume step 6): a re-driven turn ends `END, RESUME`.
    pub async fn resume(&self, uid: &str) -> Result<Session, Status> {
        self.refuse_if_draining()?;
        let row = self.active_row(uid)?;
        let held = self
            .guards
            .try_hold(uid, Hold::Turn)
            .map_err(|b| busy(uid, b))?;
        let records = self.tail(&row)?;
        let log = parse_log(records.clone())?;
        let pending = log.pending().filter(|x| !x.is_legacy());
        let mut harness = row.harness.clone();
        if let Some(x) = pending {
            if let GateState::Pending(p) = gate_state(x) {
                if p.request_seq <= row.fork_seq {
                    return Err(Status::failed_precondition(format!(
                        "InheritedToolIntent: the approval gate of call {:?} was inherited from the parent; Exec a new turn",
                        p.tool_call_id
                    )));
                }
                return Ok(view_of(&row, &records));
            }
            if let Some(call) = inherited_open_intent(x, row.fork_seq) {
                return Err(Status::failed_precondition(format!(
                    "InheritedToolIntent: tool call {call:?} was started by the parent session; Exec a new turn"
                )));
            }
            if let Some(start) = &x.start
                && !start.harness.is_empty()
            {
                harness = start.harness.clone();
            }
        }
        let placement = self.place(&harness).map_err(|s| {
            Status::failed_precondition(format!(
                "recorded harness not served here: {}",
                s.message()
            ))
        })?;
        // A resume writes a record and may start the session's VM.
        let quota = self.admit_turn(&row, &placement, Some(0))?;
        // As for Exec: a checkpoint may still hold the VM paused.
        self.turn_checkpoints
            .running_again(uid, || self.checkpoint_hopeless(uid))
            .await;
        let (turn, forward) = self.admit(&row, &placement, &held, None, None).await?;
        drop(quota);
        let outcome = if pending.is_some() {
            match self.controller.resume(&turn).await {
                Ok(outcome) => outcome,
                Err(e) => return Err(self.turn_failed(&row, &placement, e).await),
            }
        } else {
            None
        };
        let fence = turn.fence;
        drop(turn);
        let _ = forward.await;
        if let Some(TurnOutcome::Parked { head, .. }) = outcome {
            self.park_handoff(uid, head, fence).await?;
            return self.view(uid);
        }
        let head = self.row(uid)?.last_seq;
        self.append_lifecycle(uid, head, fence, LifecycleKind::LifecycleResume, "", None)?;
        // A re-driven turn that completed (after an approval, or a lost VM) is a fork point
        // like any other: its END is the head RESUME was appended at.
        if let Some(TurnOutcome::Completed { .. }) = outcome
            && placement.memory_tier()
            && let Some((inc, runtime)) = self.live_get(uid)
        {
            self.checkpoint_turn(
                uid,
                head,
                inc,
                runtime,
                &placement.harness,
                &row.annotations,
            );
        }
        tracing::info!(session = %uid, "session resumed");
        self.view(uid)
    }
}

/// A turn that found its compute unable to run (stopped, frozen): UNAVAILABLE, since the
/// next turn goes on without it.
fn stalled_status(why: &str, failure: &Status) -> Status {
    Status::unavailable(format!(
        "compute lost: {why} ({}); it is killed, and the next turn continues from the \
         session's last snapshot",
        failure.message()
    ))
}
