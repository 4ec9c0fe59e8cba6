//! A session's latest execution, read from the journal by range.
//!
//! Every turn asks how the session's latest execution stands (running, parked at an
//! approval, finished) and where the head is. Reading the whole log for that made a turn's
//! cost grow with the session's age. Executions never interleave (a session has one writer
//! at a time), so the latest one is the execution of the last record that is not a
//! lifecycle record, and it begins at its EXECUTION_START. Reading backwards from the head in
//! growing windows until that record is found costs what the latest execution and the
//! lifecycle records after it wrote, however long the session is.

use agentvm_proto::v1::{EventKind, LogRecord};

use crate::journal::{Journal, JournalError};

/// The first window read back from the head; each further one is four times as long.
const FIRST_WINDOW: i64 = 64;

/// The records from the first record of `uid`'s latest execution through `head` (the
/// lifecycle records after it included). The whole log when that start is not found: a log
/// with no execution yet, or a legacy (v0.1.2) turn, whose records carry no execution id to
/// find its start by.
pub fn read_tail(
    journal: &dyn Journal,
    uid: &str,
    head: i64,
) -> Result<Vec<LogRecord>, JournalError> {
    let mut records = read_back(journal, uid, head, |r| latest_execution_start(r).is_some())?;
    Ok(match latest_execution_start(&records) {
        Some(start) => records.split_off(start),
        None => records,
    })
}

/// The last records of `uid` through `head`: read backwards in growing windows until
/// `enough` says the window holds what the caller looks for, or the window reaches seq 1.
pub fn read_back(
    journal: &dyn Journal,
    uid: &str,
    head: i64,
    enough: impl Fn(&[LogRecord]) -> bool,
) -> Result<Vec<LogRecord>, JournalError> {
    if head <= 0 {
        return Ok(Vec::new());
    }
    let mut window = FIRST_WINDOW;
    loop {
        let from = (head - window + 1).max(1);
        let records = journal.read(uid, from, head)?;
        if from == 1 || enough(&records) {
            return Ok(records);
        }
        window = window.saturating_mul(4);
    }
}

/// Where in `records` the latest execution's EXECUTION_START is, if they hold it.
fn latest_execution_start(records: &[LogRecord]) -> Option<usize> {
    let latest = records
        .iter()
        .rev()
        .filter_map(|r| r.event.as_ref())
        .find(|e| e.kind != EventKind::EventLifecycle as i32)?;
    if latest.execution_id.is_empty() {
        return None;
    }
    records.iter().position(|r| {
        r.event.as_ref().is_some_and(|e| {
            e.execution_id == latest.execution_id && e.kind == EventKind::EventExecutionStart as i32
        })
    })
}

/// The seq of the last record of an execution (not a lifecycle record) at or below `upto`:
/// how far a harness that ran every execution up to there has seen the log.
pub fn last_execution_record(records: &[LogRecord], upto: i64) -> i64 {
    records
        .iter()
        .rev()
        .filter(|r| r.seq <= upto)
        .find(|r| {
            r.event
                .as_ref()
                .is_some_and(|e| e.kind != EventKind::EventLifecycle as i32)
        })
        .map_or(0, |r| r.seq)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::journal::SessionRow;
    use crate::journal::sqlite::{Durability, SqliteJournal};
    use agentvm_proto::v1::{Event, ExecutionStart, HarnessEnd, Lifecycle, event::Body};

    fn event(x: &str, kind: EventKind, body: Body) -> Event {
        Event {
            execution_id: x.into(),
            kind: kind as i32,
            body: Some(body),
            ..Default::default()
        }
    }

    fn turn(x: &str, effects: usize) -> Vec<Event> {
        let mut events = vec![event(
            x,
            EventKind::EventExecutionStart,
            Body::ExecutionStart(ExecutionStart::default()),
        )];
        for _ in 0..effects {
            events.push(event(
                x,
                EventKind::EventOutput,
                Body::Message(Default::default()),
            ));
        }
        events.push(event(
            x,
            EventKind::EventEnd,
            Body::End(HarnessEnd::default()),
        ));
        events
    }

    fn lifecycle() -> Event {
        event(
            "",
            EventKind::EventLifecycle,
            Body::Lifecycle(Lifecycle::default()),
        )
    }

    /// A session of `turns` executions of `effects` outputs each, a lifecycle record after
    /// each one.
    fn session(turns: usize, effects: usize) -> (SqliteJournal, i64, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let journal =
            SqliteJournal::open(&dir.path().join("journal.db"), Durability::Relaxed).unwrap();
        journal
            .create_session(&SessionRow {
                uid: "s".into(),
                ..Default::default()
            })
            .unwrap();
        let fence = journal.new_fence("s").unwrap();
        let mut head = 0;
        for t in 0..turns {
            let mut events = turn(&format!("x{t}"), effects);
            events.push(lifecycle());
            head = journal
                .append("s", head, fence, &events)
                .unwrap()
                .last()
                .unwrap()
                .seq;
        }
        (journal, head, dir)
    }

    #[test]
    fn the_tail_is_the_latest_execution_and_what_follows_it() {
        let (journal, head, _dir) = session(500, 3);
        let tail = read_tail(&journal, "s", head).unwrap();
        // EXECUTION_START, 3 outputs, END, then the lifecycle record.
        assert_eq!(tail.len(), 6);
        assert_eq!(tail.last().unwrap().seq, head);
        let first = tail[0].event.as_ref().unwrap();
        assert_eq!(first.execution_id, "x499");
        assert_eq!(first.kind, EventKind::EventExecutionStart as i32);
    }

    #[test]
    fn a_long_execution_is_read_whole_and_an_empty_log_is_nothing() {
        // One execution longer than several windows.
        let (journal, head, _dir) = session(1, 1000);
        let tail = read_tail(&journal, "s", head).unwrap();
        assert_eq!(tail.len() as i64, head);
        let (journal, head, _dir) = session(3, 1);
        assert_eq!(read_tail(&journal, "s", head).unwrap().len(), 4);
        assert!(read_tail(&journal, "s", 0).unwrap().is_empty());
    }

    #[test]
    fn a_harness_has_seen_through_the_last_execution_record() {
        let (journal, head, _dir) = session(2, 1);
        let records = journal.read("s", 1, 0).unwrap();
        // Each turn: START, OUTPUT, END, lifecycle (seqs 1-4, 5-8).
        assert_eq!(last_execution_record(&records, head), 7);
        assert_eq!(last_execution_record(&records, 4), 3);
        assert_eq!(last_execution_record(&records, 0), 0);
    }
}
