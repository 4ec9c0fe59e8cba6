//! Start-up recovery, before the node serves anything: every lifecycle operation a previous
//! daemon left open (its intent is still in the journal) is finished or rolled back, then
//! each runtime reconciles what it keeps on the node — VMMs, their directories, snapshots and
//! their users — against the journal, so each belongs to a session or is removed, and every
//! memory-tier session that says LIVE either has its VM (adopted) or gets its loss recorded.
//! Every decision is logged.
//!
//! | open intent | what recovery finds | what it does |
//! |---|---|---|
//! | Suspend | the VM is alive (paused or not) | resumes it and keeps it: nothing was lost |
//! | Suspend | VM gone, an unrecorded snapshot | records it as the SUSPEND (adopted) |
//! | Suspend | VM gone, no snapshot, session LIVE | records the compute loss |
//! | Fork | every child written | keeps the children (their VMMs re-adopted) |
//! | Fork | otherwise | tombstones any written child; the sweep stops their VMMs |
//! | Delete | the session is still DELETING | finishes it (stop, reclaim, tombstone) |

use agentvm_proto::v1::{ComputeState, event::Body, lifecycle::Kind as LifecycleKind};
use tonic::Status;

use super::SessionHost;
use crate::api::status::journal_status;
use crate::journal::{DeletionState, Operation, OperationKind};

impl SessionHost {
    pub(super) async fn recover(&self) {
        let open = match self.journal.open_operations() {
            Ok(open) => open,
            Err(e) => {
                tracing::error!(error = %e, "recovery: cannot read the open operations");
                Vec::new()
            }
        };
        for (id, op) in open {
            let outcome = match op.kind {
                OperationKind::Suspend => {
                    self.recover_suspend(&op.session).await.map(str::to_owned)
                }
                OperationKind::Fork => self.recover_fork(&op).await,
                OperationKind::Delete => self.recover_delete(&op.session).await.map(str::to_owned),
            };
            match outcome {
                Ok(done) => {
                    tracing::warn!(operation = id, kind = op.kind.as_str(), session = %op.session,
                        "recovery: {done}");
                    if let Err(e) = self.journal.end_operation(id) {
                        tracing::warn!(operation = id, error = %e, "recovery: could not end the intent");
                    }
                }
                // Left open: the next start tries again; until then the session's own
                // checks (a LIVE session without compute, a DELETING one) still hold.
                Err(e) => tracing::error!(operation = id, kind = op.kind.as_str(),
                    session = %op.session, error = %e.message(), "recovery failed"),
            }
        }
        let owned = |uid: &str| self.is_active(uid);
        for runtime in self.runtimes() {
            runtime.reconcile(&owned).await;
            // A checkpoint a crash left in the store but not in the journal is not one.
            for uid in runtime.sessions_with_checkpoints() {
                if self.is_active(&uid) {
                    self.sweep_checkpoints(&uid, &runtime);
                }
            }
        }
        self.settle_live_sessions().await;
    }

    /// A memory-tier session that says LIVE has its VM, adopted now; or its VM went while no
    /// daemon watched (or was never finished) and the log says so before anything is served.
    async fn settle_live_sessions(&self) {
        let live = match self.journal.sessions_in_state(ComputeState::ComputeLive) {
            Ok(live) => live,
            Err(e) => {
                tracing::error!(error = %e, "recovery: cannot list the LIVE sessions");
                return;
            }
        };
        for uid in live {
            let Ok(row) = self.row(&uid) else { continue };
            let Ok(placement) = self.place(&row.harness) else {
                continue;
            };
            if !placement.memory_tier() {
                continue;
            }
            match placement.runtime.attach(&uid).await {
                Ok(Some(inc)) => self.live_put(&uid, &row.project, inc, &placement),
                Ok(None) => {
                    if let Err(e) = self.settle_lost_compute(
                        &uid,
                        row.fork_seq,
                        &placement.runtime,
                        "its VMM was gone when this daemon started",
                    ) {
                        tracing::error!(session = %uid, error = %e.message(),
                            "recovery: a LIVE session without its VM could not be settled");
                    }
                }
                Err(e) => tracing::warn!(session = %uid, error = %e,
                    "recovery: could not look for the session's VM"),
            }
        }
    }

    async fn recover_suspend(&self, uid: &str) -> Result<&'static str, Status> {
        let Some(row) = self
            .journal
            .get_session(uid)
            .map_err(|e| journal_status(&e))?
        else {
            return Ok("the session does not exist; the sweep removes what it left");
        };
        if row.deletion != DeletionState::Active {
            return Ok("the session is deleted; the sweep removes what it left");
        }
        let placement = self.place(&row.harness)?;
        let runtime = &placement.runtime;
        if let Some(inc) = runtime
            .attach(uid)
            .await
            .map_err(|e| super::runtime_status(&e))?
        {
            self.live_put(uid, &row.project, inc, &placement);
            let records = self.records(uid)?;
            for snapshot in runtime.snapshots_of(uid) {
                if !super::lost::names_snapshot(&records, &snapshot) {
                    runtime.discard_snapshot(&snapshot);
                }
            }
            return Ok("rolled back: the VM was still alive and runs on, its memory intact");
        }
        if row.compute_state == agentvm_proto::v1::ComputeState::ComputeLive {
            self.settle_lost_compute(
                uid,
                row.fork_seq,
                runtime,
                "its VMM was gone after a restart that interrupted a suspend",
            )?;
            return Ok("finished: the VM was gone; its snapshot or its loss is recorded");
        }
        Ok("already complete: the SUSPEND was recorded")
    }

    async fn recover_fork(&self, op: &Operation) -> Result<String, Status> {
        let mut written = Vec::new();
        for child in &op.children {
            if self.child_written(child)? {
                written.push(child.as_str());
            }
        }
        if !op.children.is_empty() && written.len() == op.children.len() {
            for child in &written {
                let _ = self.adopt(child).await;
            }
            return Ok(format!(
                "completed: all {} children had been written",
                op.children.len()
            ));
        }
        // All or nothing, as a fork that fails while running: the children go.
        for child in &op.children {
            if self
                .journal
                .get_session(child)
                .map_err(|e| journal_status(&e))?
                .is_some()
            {
                self.journal
                    .set_deletion(child, DeletionState::Deleted)
                    .map_err(|e| journal_status(&e))?;
            }
        }
        Ok(format!(
            "rolled back: {} of {} children had been written; all are removed",
            written.len(),
            op.children.len()
        ))
    }

    /// A child whose row and FORK record both exist (the last step of writing it).
    fn child_written(&self, child: &str) -> Result<bool, Status> {
        let Some(row) = self
            .journal
            .get_session(child)
            .map_err(|e| journal_status(&e))?
        else {
            return Ok(false);
        };
        if row.deletion != DeletionState::Active || row.last_seq == 0 {
            return Ok(false);
        }
        let last = self
            .journal
            .read(child, row.last_seq, row.last_seq)
            .map_err(|e| journal_status(&e))?;
        Ok(last.iter().any(|r| {
            matches!(r.event.as_ref().and_then(|e| e.body.as_ref()),
                Some(Body::Lifecycle(l)) if l.kind == LifecycleKind::LifecycleFork as i32)
        }))
    }

    async fn recover_delete(&self, uid: &str) -> Result<&'static str, Status> {
        let Some(row) = self
            .journal
            .get_session(uid)
            .map_err(|e| journal_status(&e))?
        else {
            return Ok("the session does not exist");
        };
        if row.deletion == DeletionState::Deleted {
            return Ok("already complete");
        }
        if row.deletion == DeletionState::Active {
            // The intent was written, the mark was not: the delete never happened.
            return Ok("never started: the session was not marked; it stays");
        }
        self.finish_delete(uid, &row.harness).await?;
        Ok("finished: compute stopped, snapshots reclaimed, session tombstoned")
    }
}
