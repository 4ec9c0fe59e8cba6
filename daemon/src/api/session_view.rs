//! The `Session` resource as the API reports it: stored metadata plus what is derived from the
//! log at read time (exec_state, pending_approval), per semantics.md §1.5. Beyond upstream,
//! which reports every started session COMPLETED, exec_state tells a running turn (no END
//! yet), a failed one (a final ERROR, or END FAILED) and a canceled one (END CANCELED).

use agentvm_proto::v1::{
    ApprovalRef, EventKind, ExecState, LogRecord, ResourceMetadata, Session, event::Body,
};

use crate::clock::timestamp;
use crate::journal::SessionRow;

/// The unresolved, owned approval request of the session's latest execution, if any.
///
/// The latest execution is the one whose first record comes last (lifecycle records belong to
/// no execution). Its request is pending while no decision answers it and the execution has no
/// END. A request at or below `fork_seq` was inherited from the parent and is not owned.
pub fn pending_approval(records: &[LogRecord], fork_seq: i64) -> Option<ApprovalRef> {
    let latest = latest_execution(records)?;
    let mut pending: Option<ApprovalRef> = None;
    for r in records {
        let Some(e) = r.event.as_ref().filter(|e| e.execution_id == latest) else {
            continue;
        };
        match &e.body {
            Some(Body::Approval(req)) if e.kind == EventKind::EventApprovalRequest as i32 => {
                pending = Some(ApprovalRef {
                    execution_id: latest.to_owned(),
                    tool_call_id: req.tool_call_id.clone(),
                    request_seq: r.seq,
                });
            }
            Some(Body::ApprovalResult(res))
                if e.kind == EventKind::EventApprovalResult as i32
                    && pending.as_ref().is_some_and(|p| {
                        p.tool_call_id == res.tool_call_id
                            && (res.request_seq == 0 || res.request_seq == p.request_seq)
                    }) =>
            {
                pending = None;
            }
            _ if e.kind == EventKind::EventEnd as i32 => return None,
            _ => {}
        }
    }
    pending.filter(|p| p.request_seq > fork_seq)
}

/// The execution whose first record comes last; lifecycle records belong to none.
fn latest_execution(records: &[LogRecord]) -> Option<&str> {
    records
        .iter()
        .filter_map(|r| r.event.as_ref())
        .filter(|e| e.kind != EventKind::EventLifecycle as i32)
        .map(|e| e.execution_id.as_str())
        .fold(Vec::<&str>::new(), |mut order, id| {
            if !order.contains(&id) {
                order.push(id);
            }
            order
        })
        .pop()
}

/// How the latest execution stands, from its last record: END says how it ended; a final
/// ERROR is a failure (re-driven by an Exec without inputs); anything else is still running.
fn latest_execution_state(records: &[LogRecord]) -> Option<ExecState> {
    let latest = latest_execution(records)?;
    let last = records
        .iter()
        .rev()
        .filter_map(|r| r.event.as_ref())
        .find(|e| e.execution_id == latest && e.kind != EventKind::EventLifecycle as i32)?;
    Some(match &last.body {
        Some(Body::End(end)) => match end.state.as_str() {
            "FAILED" => ExecState::ExecFailed,
            "CANCELED" => ExecState::ExecCanceled,
            _ => ExecState::ExecCompleted,
        },
        _ if last.kind == EventKind::EventError as i32 => ExecState::ExecFailed,
        _ => ExecState::ExecRunning,
    })
}

/// Builds the API view of a session from its row and its log.
pub fn session_view(row: &SessionRow, records: &[LogRecord]) -> Session {
    let pending = pending_approval(records, row.fork_seq);
    let exec_state = if row.last_seq == 0 {
        ExecState::ExecPending
    } else if pending.is_some() {
        ExecState::ExecAwaiting
    } else {
        latest_execution_state(records).unwrap_or(ExecState::ExecCompleted)
    };
    Session {
        metadata: Some(ResourceMetadata {
            project: row.project.clone(),
            name: row.name.clone(),
            uid: row.uid.clone(),
            version: row.last_seq,
            create_time: Some(timestamp(row.created_at)),
            update_time: Some(timestamp(row.updated_at)),
        }),
        harness: row.harness.clone(),
        model: row.model.clone(),
        last_seq: row.last_seq,
        parent_uid: row.parent_uid.clone(),
        fork_seq: row.fork_seq,
        identity: row.identity.clone(),
        compute: None,
        origin: row.origin.clone(),
        labels: row.labels.clone().into_iter().collect(),
        annotations: row.annotations.clone().into_iter().collect(),
        exec_state: exec_state as i32,
        compute_state: row.compute_state as i32,
        pending_approval: pending,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use agentvm_proto::v1::{
        ApprovalRequest, ApprovalResult, ComputeState, Event, HarnessEnd, Lifecycle, ToolCall,
    };

    fn rec(seq: i64, execution_id: &str, kind: EventKind, body: Body) -> LogRecord {
        LogRecord {
            seq,
            event: Some(Event {
                execution_id: execution_id.into(),
                kind: kind as i32,
                body: Some(body),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn gated_turn(x: &str, start: i64) -> Vec<LogRecord> {
        vec![
            rec(
                start,
                x,
                EventKind::EventToolCall,
                Body::Tool(ToolCall {
                    id: "c1".into(),
                    ..Default::default()
                }),
            ),
            rec(
                start + 1,
                x,
                EventKind::EventApprovalRequest,
                Body::Approval(ApprovalRequest {
                    tool_call_id: "c1".into(),
                    reason: String::new(),
                }),
            ),
            rec(
                start + 2,
                "",
                EventKind::EventLifecycle,
                Body::Lifecycle(Lifecycle::default()),
            ),
        ]
    }

    #[test]
    fn open_gate_is_pending_until_decided() {
        let mut log = gated_turn("x1", 1);
        assert_eq!(
            pending_approval(&log, 0),
            Some(ApprovalRef {
                execution_id: "x1".into(),
                tool_call_id: "c1".into(),
                request_seq: 2
            })
        );
        log.push(rec(
            4,
            "x1",
            EventKind::EventApprovalResult,
            Body::ApprovalResult(ApprovalResult {
                tool_call_id: "c1".into(),
                approved: true,
                request_seq: 2,
                reason: String::new(),
            }),
        ));
        assert_eq!(pending_approval(&log, 0), None);
    }

    #[test]
    fn inherited_gate_and_finished_turns_are_not_pending() {
        let log = gated_turn("x1", 1);
        // forked at seq 3: the request at seq 2 belongs to the parent
        assert_eq!(pending_approval(&log, 3), None);
        let mut ended = gated_turn("x1", 1);
        ended.push(rec(
            4,
            "x1",
            EventKind::EventEnd,
            Body::End(HarnessEnd::default()),
        ));
        assert_eq!(pending_approval(&ended, 0), None);
        // a later execution supersedes the gate of an earlier one
        let mut later = gated_turn("x1", 1);
        later.push(rec(
            4,
            "x2",
            EventKind::EventEnd,
            Body::End(HarnessEnd::default()),
        ));
        assert_eq!(pending_approval(&later, 0), None);
    }

    #[test]
    fn view_derives_exec_state() {
        let mut row = SessionRow {
            uid: "sess-1".into(),
            project: "p".into(),
            created_at: 1_500_000_000,
            compute_state: ComputeState::ComputeNone,
            ..Default::default()
        };
        let s = session_view(&row, &[]);
        assert_eq!(s.exec_state(), ExecState::ExecPending);
        assert_eq!(s.compute_state(), ComputeState::ComputeNone);
        let ct = s.metadata.unwrap().create_time.unwrap();
        assert_eq!((ct.seconds, ct.nanos), (1, 500_000_000));

        let log = gated_turn("x1", 1);
        row.last_seq = 3;
        let s = session_view(&row, &log);
        assert_eq!(s.exec_state(), ExecState::ExecAwaiting);
        assert_eq!(s.pending_approval.unwrap().request_seq, 2);
        assert!(s.origin.is_none() && s.identity.is_none() && s.labels.is_empty());
    }

    #[test]
    fn exec_state_tells_running_failed_and_canceled_turns_from_completed_ones() {
        use agentvm_proto::v1::{Error as EventError, Lifecycle, Message};
        let row = SessionRow {
            uid: "sess-1".into(),
            last_seq: 1,
            ..Default::default()
        };
        let state = |log: &[LogRecord]| session_view(&row, log).exec_state();
        let start = |x: &str, seq| {
            rec(
                seq,
                x,
                EventKind::EventInput,
                Body::Message(Message::default()),
            )
        };
        let end = |x: &str, seq, s: &str| {
            rec(
                seq,
                x,
                EventKind::EventEnd,
                Body::End(HarnessEnd {
                    state: s.into(),
                    ..Default::default()
                }),
            )
        };
        let error = |x: &str, seq| {
            rec(
                seq,
                x,
                EventKind::EventError,
                Body::Error(EventError::default()),
            )
        };
        let lifecycle = |seq| {
            rec(
                seq,
                "",
                EventKind::EventLifecycle,
                Body::Lifecycle(Lifecycle::default()),
            )
        };
        assert_eq!(state(&[start("x1", 1)]), ExecState::ExecRunning);
        assert_eq!(
            state(&[start("x1", 1), end("x1", 2, "COMPLETED")]),
            ExecState::ExecCompleted
        );
        assert_eq!(
            state(&[start("x1", 1), error("x1", 2)]),
            ExecState::ExecFailed
        );
        assert_eq!(
            state(&[start("x1", 1), end("x1", 2, "FAILED")]),
            ExecState::ExecFailed
        );
        // Cancel writes END CANCELED, then a session-wide LIFECYCLE CANCEL.
        assert_eq!(
            state(&[start("x1", 1), end("x1", 2, "CANCELED"), lifecycle(3)]),
            ExecState::ExecCanceled
        );
        // The latest execution counts: a failed turn followed by one in flight is running,
        // and a re-driven failed turn that completed is completed.
        assert_eq!(
            state(&[start("x1", 1), error("x1", 2), start("x2", 3)]),
            ExecState::ExecRunning
        );
        assert_eq!(
            state(&[
                start("x1", 1),
                error("x1", 2),
                lifecycle(3),
                end("x1", 4, "COMPLETED")
            ]),
            ExecState::ExecCompleted
        );
    }
}
