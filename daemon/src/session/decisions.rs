//! Approve, Cancel and DeleteSession: decisions about a session that run no harness.

use agentvm_proto::v1::{
    ApprovalResult, ApproveRequest, CancelRequest, Error as EventError, EventKind, HarnessEnd,
    IdentityRef, Lifecycle, LogRecord, Session, event::Body, lifecycle::Kind as LifecycleKind,
};
use tonic::Status;

use super::guard::Hold;
use super::{SessionHost, busy};
use crate::api::status::journal_status;
use crate::controller::log::SessionLog;
use crate::controller::{GateState, Interrupt, gate_state, stamp};
use crate::crash_point;
use crate::journal::{DeletionState, OperationKind};

fn decision_of(r: &LogRecord) -> Option<(&ApprovalResult, Option<&IdentityRef>)> {
    let e = r.event.as_ref()?;
    match &e.body {
        Some(Body::ApprovalResult(d)) if e.kind == EventKind::EventApprovalResult as i32 => {
            Some((d, e.actor.as_ref()))
        }
        _ => None,
    }
}

impl SessionHost {
    /// Approve: appends only the decision (no harness, no compute, no executor).
    pub async fn approve(&self, req: ApproveRequest) -> Result<(Session, LogRecord), Status> {
        let row = self.active_row(&req.session)?;
        let uid = row.uid.clone();
        let _held = self
            .guards
            .try_hold(&uid, Hold::Turn)
            .map_err(|b| busy(&uid, b))?;
        let approved = req.approved.unwrap_or_default();
        // With authentication the decider is who authenticated, not who the request says.
        let decider = crate::api::auth::ACTOR
            .try_with(Clone::clone)
            .ok()
            .or_else(|| req.identity.clone());
        let records = self.records(&uid)?;
        // An exact repeat returns the original record; a different decision is refused.
        let existing = records.iter().find(|r| {
            decision_of(r).is_some_and(|(d, _)| {
                r.event
                    .as_ref()
                    .is_some_and(|e| e.execution_id == req.execution_id)
                    && d.tool_call_id == req.tool_call_id
                    && d.request_seq == req.request_seq
            })
        });
        if let Some(record) = existing {
            let (d, actor) = decision_of(record).expect("found above");
            if d.approved == approved && d.reason == req.reason && actor == decider.as_ref() {
                return Ok((self.view(&uid)?, record.clone()));
            }
            return Err(Status::failed_precondition(format!(
                "request {} of call {:?} is already decided differently (approved={})",
                req.request_seq, req.tool_call_id, d.approved
            )));
        }
        let log = SessionLog::parse(records).map_err(Status::from)?;
        let latest = log.executions.last().filter(|x| x.id == req.execution_id);
        let Some(x) = latest else {
            return Err(Status::failed_precondition(format!(
                "execution {:?} is not the latest execution of session {uid}; its request is superseded",
                req.execution_id
            )));
        };
        if let Some((_, end)) = &x.end {
            return Err(Status::failed_precondition(format!(
                "execution {:?} ended {}; its approval request {} is superseded",
                req.execution_id, end.state, req.request_seq
            )));
        }
        match gate_state(x) {
            GateState::Pending(p)
                if p.tool_call_id == req.tool_call_id && p.request_seq == req.request_seq =>
            {
                if p.request_seq <= row.fork_seq {
                    return Err(Status::failed_precondition(format!(
                        "request {} was inherited from the parent session; decide it there",
                        p.request_seq
                    )));
                }
            }
            _ => {
                return Err(Status::failed_precondition(format!(
                    "no pending approval request {} for call {:?} in execution {:?}",
                    req.request_seq, req.tool_call_id, req.execution_id
                )));
            }
        }
        let fence = self
            .journal
            .new_fence(&uid)
            .map_err(|e| journal_status(&e))?;
        let mut event = stamp(
            &req.execution_id,
            EventKind::EventApprovalResult,
            Body::ApprovalResult(ApprovalResult {
                tool_call_id: req.tool_call_id.clone(),
                approved,
                reason: req.reason.clone(),
                request_seq: req.request_seq,
            }),
        );
        event.actor = decider;
        let record = self
            .journal
            .append(&uid, log.head(), fence, &[event])
            .map_err(|e| journal_status(&e))?
            .remove(0);
        tracing::info!(session = %uid, approved, "approval decided");
        Ok((self.view(&uid)?, record))
    }

    /// Cancel: stops the running execution, or closes the interrupted one, with END CANCELED
    /// and a LIFECYCLE CANCEL. Repeating it after the execution ended is a no-op.
    pub async fn cancel(&self, req: CancelRequest) -> Result<Session, Status> {
        let uid = self.active_row(&req.session)?.uid;
        let reason = if req.reason.is_empty() {
            "canceled".to_owned()
        } else {
            req.reason.clone()
        };
        let _held = self
            .guards
            .preempt_and_hold(&uid, Hold::Checkpoint, Interrupt::Cancel(reason.clone()))
            .await
            .map_err(|b| busy(&uid, b))?;
        let log = SessionLog::parse(self.tail(&self.row(&uid)?)?).map_err(Status::from)?;
        let Some(x) = log.pending() else {
            let last = log.executions.last();
            let just_canceled = last.is_some_and(|x| {
                x.end.as_ref().is_some_and(|(_, e)| e.state == "CANCELED")
                    && (req.execution_id.is_empty() || req.execution_id == x.id)
            });
            if just_canceled {
                return self.view(&uid);
            }
            return Err(Status::failed_precondition(format!(
                "session {uid} has no unfinished execution to cancel"
            )));
        };
        if !req.execution_id.is_empty() && req.execution_id != x.id {
            return Err(Status::failed_precondition(format!(
                "execution_id: {:?} is not the session's unfinished execution ({:?})",
                req.execution_id, x.id
            )));
        }
        if x.is_legacy() {
            return Err(Status::failed_precondition(
                "the unfinished turn is a legacy turn without an execution id",
            ));
        }
        let fence = self
            .journal
            .new_fence(&uid)
            .map_err(|e| journal_status(&e))?;
        let end = stamp(
            &x.id,
            EventKind::EventEnd,
            Body::End(HarnessEnd {
                state: "CANCELED".into(),
                error: Some(EventError {
                    code: tonic::Code::Cancelled as i32,
                    description: reason.clone(),
                }),
            }),
        );
        let marker = stamp(
            "",
            EventKind::EventLifecycle,
            Body::Lifecycle(Lifecycle {
                kind: LifecycleKind::LifecycleCancel as i32,
                detail: reason,
                ..Default::default()
            }),
        );
        self.journal
            .append(&uid, log.head(), fence, &[end, marker])
            .map_err(|e| journal_status(&e))?;
        tracing::info!(session = %uid, "execution canceled");
        self.view(&uid)
    }

    /// DeleteSession: durable intent first, then the compute is reclaimed, then the session
    /// becomes a tombstone (log kept for audit, hidden from List, refuses all work).
    pub async fn delete(&self, uid: &str) -> Result<Session, Status> {
        let row = self.row(uid)?;
        if row.deletion == DeletionState::Deleted {
            return self.view(uid);
        }
        self.held_here(&row)?;
        let _held = self
            .guards
            .preempt_and_hold(
                uid,
                Hold::Checkpoint,
                Interrupt::Supersede("deleted".into()),
            )
            .await
            .map_err(|b| busy(uid, b))?;
        let j = |e| journal_status(&e);
        let intent = self.intend(OperationKind::Delete, uid, Vec::new())?;
        self.journal
            .set_deletion(uid, DeletionState::Deleting)
            .map_err(j)?;
        // Fence out any writer that survived the preemption.
        self.journal.new_fence(uid).map_err(j)?;
        crash_point::reached(crash_point::DELETE_BEGUN);
        self.finish_delete(uid, &row.harness).await?;
        drop(intent);
        tracing::info!(session = %uid, "session deleted");
        self.view(uid)
    }

    /// The steps of a delete after its durable mark: stop the compute, reclaim snapshots,
    /// tombstone. Also how recovery finishes a delete a crash interrupted.
    pub(super) async fn finish_delete(&self, uid: &str, harness: &str) -> Result<(), Status> {
        self.adopt(uid).await?;
        if let Some((inc, runtime)) = self.live_take(uid) {
            runtime.stop(&inc).await.map_err(|e| {
                Status::internal(format!(
                    "session {uid} is marked for deletion but its compute did not stop ({e}); retry DeleteSession"
                ))
            })?;
        }
        crash_point::reached(crash_point::DELETE_STOPPED);
        let owned = |s: &str| s != uid && self.is_active(s);
        if let Ok(placement) = self.place(harness)
            && let Err(e) = placement.runtime.reclaim(uid, &owned).await
        {
            // The session is gone either way; what could not be freed yet stays for later.
            tracing::warn!(session = %uid, error = %e, "reclaiming the session's snapshots");
        }
        crash_point::reached(crash_point::DELETE_RECLAIMED);
        self.journal
            .set_deletion(uid, DeletionState::Deleted)
            .map_err(|e| journal_status(&e))
    }
}
