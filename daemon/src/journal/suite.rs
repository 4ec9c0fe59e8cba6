//! The journal's contract, as cases every backend must pass (sqlite's run one test each;
//! PostgreSQL's run against a server of their own). A case opens the journal with `open`,
//! and may open it again to see what survived.

use std::collections::BTreeMap;
use std::sync::Arc;

use agentvm_proto::v1::{
    ComputeState, Event, EventKind, IdentityRef, Lifecycle, LogRecord, Message, Part, TextPart,
    event::Body, lifecycle, part,
};

use super::verify::verify_chain;
use super::{
    CheckpointRow, DeletionState, Journal, JournalError, ListCursor, Operation, OperationKind,
    SessionRow,
};

/// Opens the journal under test (the same store every time).
pub type Opener = dyn Fn() -> Arc<dyn Journal>;

/// Calls `$m! { case, ... }` with every case's name.
macro_rules! journal_cases {
    ($m:ident) => {
        $m! {
            metadata_round_trips_with_absent_fields_absent,
            append_chains_records_and_advances_the_head,
            cas_conflict_is_checked_before_the_fence,
            failed_batch_appends_nothing,
            unknown_session_is_not_found,
            compute_state_follows_lifecycle_records,
            concurrent_appenders_never_gap_or_fork_the_chain,
            concurrent_sessions_share_commits_and_each_chain_stays_whole,
            fork_copy_is_byte_identical_and_links_the_tree,
            fork_children_are_written_all_or_none,
            list_pages_newest_first_with_a_keyset_cursor,
            projects_count_their_live_sessions,
            project_usage_counts_sessions_and_log_bytes,
            deletion_state_persists,
            children_count_until_they_are_deleted,
            operations_are_durable_until_ended,
            checkpoints_sit_beside_the_log_and_merge_all_or_none
        }
    };
}
pub(crate) use journal_cases;

pub fn session(uid: &str, project: &str, created_at: i64) -> SessionRow {
    SessionRow {
        uid: uid.into(),
        project: project.into(),
        harness: "echo".into(),
        model: "echo".into(),
        created_at,
        updated_at: created_at,
        compute_state: ComputeState::ComputeNone,
        ..Default::default()
    }
}

pub fn input(text: &str) -> Event {
    Event {
        execution_id: "x1".into(),
        kind: EventKind::EventInput as i32,
        body: Some(Body::Message(Message {
            role: "user".into(),
            parts: vec![Part {
                part: Some(part::Part::Text(TextPart { text: text.into() })),
            }],
        })),
        ..Default::default()
    }
}

pub fn lifecycle_event(kind: lifecycle::Kind) -> Event {
    Event {
        kind: EventKind::EventLifecycle as i32,
        body: Some(Body::Lifecycle(Lifecycle {
            kind: kind as i32,
            ..Default::default()
        })),
        ..Default::default()
    }
}

/// A NaN in a tool call's arguments cannot be canonicalized: the append fails midway.
pub fn uncanonical() -> Event {
    let mut bad = input("x");
    bad.body = Some(Body::Tool(agentvm_proto::v1::ToolCall {
        id: "c".into(),
        args: Some(prost_types::Struct {
            fields: BTreeMap::from([(
                "n".to_owned(),
                prost_types::Value {
                    kind: Some(prost_types::value::Kind::NumberValue(f64::NAN)),
                },
            )]),
        }),
        ..Default::default()
    }));
    bad
}

pub fn metadata_round_trips_with_absent_fields_absent(open: &Opener) {
    let j = open();
    let mut row = session("sess-a", "p", 10);
    row.labels = BTreeMap::from([("k".into(), "v".into())]);
    row.annotations = BTreeMap::from([("note".into(), "n".into())]);
    row.identity = Some(IdentityRef {
        principal: "alice".into(),
        ..Default::default()
    });
    j.create_session(&row).unwrap();
    let got = j.get_session("sess-a").unwrap().unwrap();
    // The holder is the backend's to fill in (a shared journal names the creating node).
    assert_eq!(
        SessionRow {
            holder: String::new(),
            ..got.clone()
        },
        row
    );
    assert_eq!(
        j.holder_of(&got).unwrap(),
        crate::journal::Holder::Here,
        "the node that created a session holds it"
    );
    assert!(got.origin.is_none());
    assert!(j.get_session("sess-missing").unwrap().is_none());
    assert!(matches!(
        j.create_session(&row),
        Err(JournalError::AlreadyExists(_))
    ));
}

pub fn append_chains_records_and_advances_the_head(open: &Opener) {
    let j = open();
    j.create_session(&session("s", "p", 1)).unwrap();
    let f = j.new_fence("s").unwrap();
    assert_eq!(f, 1);
    let recs = j.append("s", 0, f, &[input("a"), input("b")]).unwrap();
    assert_eq!(recs.iter().map(|r| r.seq).collect::<Vec<_>>(), vec![1, 2]);
    assert_eq!(recs[0].prev_hash, "");
    assert_eq!(recs[1].prev_hash, recs[0].content_hash);
    let more = j.append("s", 2, f, &[input("c")]).unwrap();
    assert_eq!(more[0].prev_hash, recs[1].content_hash);
    let all = j.read("s", 0, 0).unwrap();
    assert_eq!(all.len(), 3);
    assert_eq!(&all[..2], &recs[..]);
    assert_eq!(verify_chain(&all), Ok(3));
    assert_eq!(j.read("s", 2, 2).unwrap(), vec![all[1].clone()]);
    let row = j.get_session("s").unwrap().unwrap();
    assert_eq!(row.last_seq, 3);
    assert_eq!(row.compute_state, ComputeState::ComputeLive);
}

pub fn cas_conflict_is_checked_before_the_fence(open: &Opener) {
    let j = open();
    j.create_session(&session("s", "p", 1)).unwrap();
    let f1 = j.new_fence("s").unwrap();
    j.append("s", 0, f1, &[input("a")]).unwrap();
    // stale head AND stale fence: the CAS failure wins
    let f2 = j.new_fence("s").unwrap();
    let err = j.append("s", 0, f1, &[input("b")]).unwrap_err();
    assert!(
        matches!(
            err,
            JournalError::Conflict {
                expected: 0,
                head: 1,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.is_retryable());
    // correct head, superseded fence
    let err = j.append("s", 1, f1, &[input("b")]).unwrap_err();
    assert!(
        matches!(
            err,
            JournalError::Fenced {
                fence: 1,
                current: 2,
                ..
            }
        ),
        "{err}"
    );
    // current and higher fences are accepted, and appending does not raise the fence
    j.append("s", 1, f2, &[input("b")]).unwrap();
    j.append("s", 2, f2 + 5, &[input("c")]).unwrap();
    assert_eq!(j.get_session("s").unwrap().unwrap().fence, f2);
    assert_eq!(j.read("s", 0, 0).unwrap().len(), 3);
}

pub fn failed_batch_appends_nothing(open: &Opener) {
    let j = open();
    j.create_session(&session("s", "p", 1)).unwrap();
    let err = j
        .append("s", 0, 0, &[input("ok"), uncanonical()])
        .unwrap_err();
    assert!(matches!(err, JournalError::Canon { .. }), "{err}");
    assert!(j.read("s", 0, 0).unwrap().is_empty());
    assert_eq!(j.get_session("s").unwrap().unwrap().last_seq, 0);
}

pub fn unknown_session_is_not_found(open: &Opener) {
    let j = open();
    assert!(matches!(
        j.append("nope", 0, 0, &[input("a")]),
        Err(JournalError::NotFound(_))
    ));
    assert!(matches!(
        j.new_fence("nope"),
        Err(JournalError::NotFound(_))
    ));
}

pub fn compute_state_follows_lifecycle_records(open: &Opener) {
    let j = open();
    j.create_session(&session("s", "p", 1)).unwrap();
    let state = |j: &Arc<dyn Journal>| j.get_session("s").unwrap().unwrap().compute_state;
    assert_eq!(state(&j), ComputeState::ComputeNone);
    j.append("s", 0, 0, &[input("a")]).unwrap();
    assert_eq!(state(&j), ComputeState::ComputeLive);
    j.append(
        "s",
        1,
        0,
        &[lifecycle_event(lifecycle::Kind::LifecycleSuspend)],
    )
    .unwrap();
    assert_eq!(state(&j), ComputeState::ComputeCold);
    j.append(
        "s",
        2,
        0,
        &[lifecycle_event(lifecycle::Kind::LifecycleBaseline)],
    )
    .unwrap();
    assert_eq!(state(&j), ComputeState::ComputeCold);
    j.append(
        "s",
        3,
        0,
        &[lifecycle_event(lifecycle::Kind::LifecycleResume)],
    )
    .unwrap();
    assert_eq!(state(&j), ComputeState::ComputeLive);
}

pub fn concurrent_appenders_never_gap_or_fork_the_chain(open: &Opener) {
    let j = open();
    j.create_session(&session("s", "p", 1)).unwrap();
    race_appends(vec![j.clone(); 4], 25);
    let all = j.read("s", 0, 0).unwrap();
    assert_eq!(all.len(), 100);
    assert_eq!(verify_chain(&all), Ok(100));
}

/// Each of `writers` (one thread each) appends to session "s" at the head it last read
/// until `wins` of its appends went in, retrying on conflicts.
pub fn race_appends(writers: Vec<Arc<dyn Journal>>, wins: usize) {
    let threads: Vec<_> = writers
        .into_iter()
        .enumerate()
        .map(|(t, j)| {
            std::thread::spawn(move || {
                let mut won = 0;
                while won < wins {
                    let head = j.get_session("s").unwrap().unwrap().last_seq;
                    match j.append("s", head, 0, &[input(&format!("t{t}-{won}"))]) {
                        Ok(_) => won += 1,
                        Err(JournalError::Conflict { .. }) => {}
                        Err(e) => panic!("{e}"),
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

pub fn concurrent_sessions_share_commits_and_each_chain_stays_whole(open: &Opener) {
    let j = open();
    let sessions = 8;
    for s in 0..sessions {
        j.create_session(&session(&format!("s{s}"), "p", 1))
            .unwrap();
    }
    let threads: Vec<_> = (0..sessions)
        .map(|s| {
            let j = Arc::clone(&j);
            std::thread::spawn(move || {
                let uid = format!("s{s}");
                for n in 0..40 {
                    let records = j
                        .append(&uid, n, 0, &[input(&format!("{uid}-{n}"))])
                        .unwrap();
                    assert_eq!(records[0].seq, n + 1);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    for s in 0..sessions {
        let all = j.read(&format!("s{s}"), 0, 0).unwrap();
        assert_eq!(verify_chain(&all), Ok(40));
    }
}

pub fn fork_copy_is_byte_identical_and_links_the_tree(open: &Opener) {
    let j = open();
    j.create_session(&session("parent", "p", 1)).unwrap();
    j.append("parent", 0, 0, &[input("a"), input("b"), input("c")])
        .unwrap();
    j.create_session(&session("child", "p", 2)).unwrap();
    let cf = j.new_fence("child").unwrap();
    j.copy_prefix("parent", "child", 2, cf).unwrap();
    let marker = j
        .append(
            "child",
            2,
            cf,
            &[lifecycle_event(lifecycle::Kind::LifecycleFork)],
        )
        .unwrap();
    let parent = j.read("parent", 0, 0).unwrap();
    let child = j.read("child", 0, 0).unwrap();
    for (p, c) in parent.iter().zip(&child[..2]) {
        assert_eq!(
            (p.seq, &p.prev_hash, &p.content_hash, &p.event),
            (c.seq, &c.prev_hash, &c.content_hash, &c.event)
        );
    }
    assert_eq!(marker[0].seq, 3);
    assert_eq!(marker[0].prev_hash, parent[1].content_hash);
    assert_eq!(verify_chain(&child), Ok(3));
    assert_eq!(
        j.get_session("child").unwrap().unwrap().compute_state,
        ComputeState::ComputeCold
    );
    // a second copy into a non-empty child is refused; so is a prefix past the parent's head
    assert!(j.copy_prefix("parent", "child", 1, cf).is_err());
    j.create_session(&session("child2", "p", 3)).unwrap();
    assert!(j.copy_prefix("parent", "child2", 9, 1).is_err());
}

/// A fork's children are written in one transaction: each a byte-identical copy of the
/// parent's prefix, fence 1, its FORK record after it; and if any child cannot be written,
/// none is.
pub fn fork_children_are_written_all_or_none(open: &Opener) {
    let j = open();
    j.create_session(&session("parent", "p", 1)).unwrap();
    j.append("parent", 0, 0, &[input("a"), input("b"), input("c")])
        .unwrap();
    let fork = || lifecycle_event(lifecycle::Kind::LifecycleFork);
    j.create_children(
        "parent",
        2,
        &[
            (session("c1", "p", 2), fork()),
            (session("c2", "p", 2), fork()),
        ],
    )
    .unwrap();
    let parent = j.read("parent", 0, 0).unwrap();
    for child in ["c1", "c2"] {
        let log = j.read(child, 0, 0).unwrap();
        let same = |r: &LogRecord| {
            (
                r.seq,
                r.prev_hash.clone(),
                r.content_hash.clone(),
                r.event.clone(),
            )
        };
        assert_eq!(
            log[..2].iter().map(same).collect::<Vec<_>>(),
            parent[..2].iter().map(same).collect::<Vec<_>>()
        );
        assert_eq!(log.len(), 3);
        assert_eq!(log[2].fence, 1);
        assert_eq!(verify_chain(&log), Ok(3));
        let row = j.get_session(child).unwrap().unwrap();
        assert_eq!((row.fence, row.last_seq), (1, 3));
        assert_eq!(row.compute_state, ComputeState::ComputeCold);
    }
    // c1 exists already: the batch fails and c3, written before it, is not there either.
    let err = j
        .create_children(
            "parent",
            2,
            &[
                (session("c3", "p", 3), fork()),
                (session("c1", "p", 3), fork()),
            ],
        )
        .unwrap_err();
    assert!(matches!(err, JournalError::AlreadyExists(_)), "{err}");
    assert!(j.get_session("c3").unwrap().is_none());
    assert!(j.read("c3", 0, 0).unwrap().is_empty());
    assert_eq!(j.read("c1", 0, 0).unwrap().len(), 3, "c1 untouched");
}

pub fn list_pages_newest_first_with_a_keyset_cursor(open: &Opener) {
    let j = open();
    for (uid, at) in [("s-b", 5), ("s-a", 5), ("s-c", 7), ("s-d", 1)] {
        j.create_session(&session(uid, "p", at)).unwrap();
    }
    j.create_session(&session("other", "q", 9)).unwrap();
    let page1 = j.list_sessions("p", None, 2).unwrap();
    let uids = |rows: &[SessionRow]| rows.iter().map(|r| r.uid.clone()).collect::<Vec<_>>();
    assert_eq!(uids(&page1), vec!["s-c", "s-a"]);
    let last = page1.last().unwrap();
    let cursor = ListCursor {
        created_at: last.created_at,
        uid: last.uid.clone(),
    };
    let page2 = j.list_sessions("p", Some(&cursor), 10).unwrap();
    assert_eq!(uids(&page2), vec!["s-b", "s-d"]);
}

pub fn projects_count_their_live_sessions(open: &Opener) {
    let j = open();
    assert!(j.projects().unwrap().is_empty());
    for (uid, project) in [
        ("a1", "alpha"),
        ("a2", "alpha"),
        ("b1", "beta"),
        ("g1", "gone"),
    ] {
        j.create_session(&session(uid, project, 1)).unwrap();
    }
    j.set_deletion("g1", DeletionState::Deleted).unwrap();
    j.set_deletion("a2", DeletionState::Deleting).unwrap();
    assert_eq!(
        j.projects().unwrap(),
        vec![("alpha".to_owned(), 2), ("beta".to_owned(), 1)]
    );
}

/// A project's usage: its live sessions and what their logs hold (a forked prefix counted
/// in every copy), kept across a reopen.
pub fn project_usage_counts_sessions_and_log_bytes(open: &Opener) {
    use super::ProjectUsage;
    use prost::Message as _;
    let j = open();
    assert_eq!(j.project_usage("p").unwrap(), ProjectUsage::default());
    j.create_session(&session("parent", "p", 1)).unwrap();
    j.create_session(&session("other", "q", 1)).unwrap();
    let events = [input("a"), input("bb"), input("ccc")];
    let bytes = |events: &[Event]| events.iter().map(|e| e.encoded_len() as u64).sum::<u64>();
    j.append("parent", 0, 0, &events).unwrap();
    j.append("other", 0, 0, &[input("zzzz")]).unwrap();
    assert_eq!(
        j.project_usage("p").unwrap(),
        ProjectUsage {
            sessions: 1,
            log_bytes: bytes(&events)
        }
    );
    let fork = lifecycle_event(lifecycle::Kind::LifecycleFork);
    j.create_children("parent", 2, &[(session("child", "p", 2), fork.clone())])
        .unwrap();
    let child_bytes = bytes(&events[..2]) + bytes(std::slice::from_ref(&fork));
    let want = ProjectUsage {
        sessions: 2,
        log_bytes: bytes(&events) + child_bytes,
    };
    assert_eq!(j.project_usage("p").unwrap(), want);
    assert_eq!(open().project_usage("p").unwrap(), want);
    j.set_deletion("parent", DeletionState::Deleted).unwrap();
    assert_eq!(
        j.project_usage("p").unwrap(),
        ProjectUsage {
            sessions: 1,
            log_bytes: child_bytes
        }
    );
    assert_eq!(j.project_usage("q").unwrap().sessions, 1);
}

pub fn deletion_state_persists(open: &Opener) {
    let j = open();
    j.create_session(&session("s", "p", 1)).unwrap();
    j.set_deletion("s", DeletionState::Deleting).unwrap();
    assert_eq!(
        j.get_session("s").unwrap().unwrap().deletion,
        DeletionState::Deleting
    );
    assert!(matches!(
        j.set_deletion("nope", DeletionState::Deleted),
        Err(JournalError::NotFound(_))
    ));
}

/// A session's fork children keep its snapshots wanted until each is DELETED.
pub fn children_count_until_they_are_deleted(open: &Opener) {
    let j = open();
    let child = |uid: &str, parent: &str| SessionRow {
        parent_uid: parent.into(),
        fork_seq: 1,
        ..session(uid, "p", 2)
    };
    j.create_session(&session("parent", "p", 1)).unwrap();
    j.create_session(&child("c1", "parent")).unwrap();
    j.create_session(&child("c2", "parent")).unwrap();
    j.create_session(&child("grandchild", "c1")).unwrap();
    assert!(j.has_undeleted_children("parent").unwrap());
    assert!(!j.has_undeleted_children("c2").unwrap());
    assert!(!j.has_undeleted_children("nobody").unwrap());
    j.set_deletion("c1", DeletionState::Deleting).unwrap();
    j.set_deletion("c2", DeletionState::Deleted).unwrap();
    assert!(
        j.has_undeleted_children("parent").unwrap(),
        "c1 is only DELETING"
    );
    j.set_deletion("c1", DeletionState::Deleted).unwrap();
    assert!(!j.has_undeleted_children("parent").unwrap());
    assert!(j.has_undeleted_children("c1").unwrap());
}

/// Intents survive a reopen (a crash) until ended, in the order they were begun.
pub fn operations_are_durable_until_ended(open: &Opener) {
    let (a, b) = {
        let j = open();
        let a = j
            .begin_operation(&Operation {
                kind: OperationKind::Fork,
                session: "parent".into(),
                children: vec!["c1".into(), "c2".into()],
            })
            .unwrap();
        let b = j
            .begin_operation(&Operation {
                kind: OperationKind::Suspend,
                session: "parent".into(),
                children: vec![],
            })
            .unwrap();
        (a, b)
    };
    let j = open();
    let open_ops = j.open_operations().unwrap();
    assert_eq!(open_ops.len(), 2);
    assert_eq!(open_ops[0].0, a);
    assert_eq!(open_ops[0].1.kind, OperationKind::Fork);
    assert_eq!(open_ops[0].1.children, ["c1", "c2"]);
    assert_eq!(open_ops[1].1.kind, OperationKind::Suspend);
    j.end_operation(a).unwrap();
    assert_eq!(
        j.open_operations()
            .unwrap()
            .into_iter()
            .map(|(id, _)| id)
            .collect::<Vec<_>>(),
        [b]
    );
}

/// Checkpoints are recorded beside the log (which they leave exactly as it was), only at
/// seqs the log has, survive a reopen, and a merge drops one and replaces its successor in
/// one transaction.
pub fn checkpoints_sit_beside_the_log_and_merge_all_or_none(open: &Opener) {
    let j = open();
    j.create_session(&session("s", "p", 1)).unwrap();
    let records = j
        .append("s", 0, 0, &[input("a"), input("b"), input("c")])
        .unwrap();
    let at = |seq: i64, snapshot: &str| CheckpointRow {
        seq,
        turn: seq as u64,
        snapshot: snapshot.into(),
        manifest_sha256: format!("sha-{snapshot}"),
        bytes: 4096 * seq as u64,
        created_at: 10 + seq,
    };
    for seq in 1..=3 {
        j.record_checkpoint("s", &at(seq, &format!("c{seq}")))
            .unwrap();
    }
    // Past the head, before the first record, unnamed, or of no session: refused.
    for (uid, row) in [
        ("s", at(4, "c4")),
        ("s", at(0, "c0")),
        ("s", at(2, "")),
        ("nobody", at(1, "c1")),
    ] {
        let refused = j.record_checkpoint(uid, &row);
        assert!(
            matches!(
                refused,
                Err(JournalError::InvalidArgument(_) | JournalError::NotFound(_))
            ),
            "{uid} {row:?}: {refused:?}"
        );
    }
    // Recording again at a seq replaces what was there.
    j.record_checkpoint("s", &at(3, "c3-again")).unwrap();
    let j = open();
    let kept = j.checkpoints("s").unwrap();
    assert_eq!(
        kept.iter().map(|c| c.snapshot.as_str()).collect::<Vec<_>>(),
        ["c1", "c2", "c3-again"]
    );
    assert_eq!(kept[1], at(2, "c2"));
    // The log is untouched.
    assert_eq!(j.read("s", 1, 0).unwrap(), records);
    // A merge of 1 into 2: both changes or neither (a replacement of a seq never recorded
    // fails the whole transaction).
    let merged = CheckpointRow {
        snapshot: "c12".into(),
        ..at(2, "c12")
    };
    assert!(
        j.retain_checkpoints("s", &[1], &[merged.clone(), at(7, "c7")])
            .is_err()
    );
    assert_eq!(j.checkpoints("s").unwrap().len(), 3);
    j.retain_checkpoints("s", &[1], std::slice::from_ref(&merged))
        .unwrap();
    let kept = j.checkpoints("s").unwrap();
    assert_eq!(kept.len(), 2);
    assert_eq!(kept[0].snapshot, "c12");
    assert_eq!(kept[0].created_at, at(2, "").created_at);
    assert!(j.checkpoints("nobody").unwrap().is_empty());
}
