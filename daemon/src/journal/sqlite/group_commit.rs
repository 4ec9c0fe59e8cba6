//! Group commit across sessions: appends that arrive while another commit holds the writer
//! wait in a queue, and the next appender to take the writer commits all of them in one
//! transaction, so one fsync makes a whole batch durable.
//!
//! Each append in a batch runs inside its own savepoint: one that fails (a stale head, a
//! superseded fence) is rolled back alone and answered with its own error, while the others
//! commit. Appends to the same session in one batch see each other in queue order, as they
//! would one transaction after another. Every answer is sent before the writer is released,
//! so an appender that takes the writer and finds no answer knows its append is still queued.

use std::sync::{Condvar, Mutex, MutexGuard, mpsc};

use agentvm_proto::v1::{Event, LogRecord};
use rusqlite::{Connection, TransactionBehavior};

use super::{append_events, storage};
use crate::journal::{JournalError, Result};

/// One append waiting for a commit.
struct Pending {
    uid: String,
    expected_last_seq: i64,
    fence: i64,
    events: Vec<Event>,
    answer: mpsc::SyncSender<Result<Vec<LogRecord>>>,
}

#[derive(Default)]
struct Queue {
    waiting: Vec<Pending>,
    /// An appender is committing a batch: the others wait for it rather than for the writer,
    /// so each of them learns of its answer at once when it ends.
    committing: bool,
}

#[derive(Default)]
pub(super) struct GroupCommit {
    queue: Mutex<Queue>,
    batch_ended: Condvar,
}

impl GroupCommit {
    /// Appends through `writer` (the journal's one write connection), in a batch with whatever
    /// else is queued when a commit next starts.
    pub(super) fn append<'a>(
        &self,
        writer: impl Fn() -> MutexGuard<'a, Connection>,
        uid: &str,
        expected_last_seq: i64,
        fence: i64,
        events: &[Event],
    ) -> Result<Vec<LogRecord>> {
        let (answer, answered) = mpsc::sync_channel(1);
        let mut queue = self.lock_queue();
        queue.waiting.push(Pending {
            uid: uid.to_owned(),
            expected_last_seq,
            fence,
            events: events.to_vec(),
            answer,
        });
        let lost_answer = || {
            Err(lost(format!(
                "append to {uid}: the commit holding it ended without an answer"
            )))
        };
        loop {
            match answered.try_recv() {
                Ok(result) => return result,
                Err(mpsc::TryRecvError::Disconnected) => return lost_answer(),
                Err(mpsc::TryRecvError::Empty) => {}
            }
            if queue.committing {
                queue = self
                    .batch_ended
                    .wait(queue)
                    .unwrap_or_else(|p| p.into_inner());
                continue;
            }
            // Ours is still queued and nobody commits: this appender commits the batch.
            queue.committing = true;
            let batch = std::mem::take(&mut queue.waiting);
            drop(queue);
            let ended = CommitEnded(self);
            commit_batch(&mut writer(), batch);
            drop(ended);
            return answered.try_recv().unwrap_or_else(|_| lost_answer());
        }
    }

    fn lock_queue(&self) -> MutexGuard<'_, Queue> {
        // A list and a flag: a panic elsewhere cannot leave them half-changed.
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Ends a commit, also when it panicked: the waiting appenders must not wait forever.
struct CommitEnded<'a>(&'a GroupCommit);

impl Drop for CommitEnded<'_> {
    fn drop(&mut self) {
        self.0.lock_queue().committing = false;
        self.0.batch_ended.notify_all();
    }
}

/// Commits `batch` in one transaction and answers each append in it.
fn commit_batch(conn: &mut Connection, batch: Vec<Pending>) {
    if batch.is_empty() {
        return;
    }
    let mut tx = match conn.transaction_with_behavior(TransactionBehavior::Immediate) {
        Ok(tx) => tx,
        Err(e) => {
            for p in batch {
                let _ = p
                    .answer
                    .send(Err(storage_copy(&e, &p.uid, "begin append to")));
            }
            return;
        }
    };
    let mut done = Vec::with_capacity(batch.len());
    for p in batch {
        let result = tx
            .savepoint()
            .map_err(storage(format!("begin append to {}", p.uid)))
            .and_then(|mut sp| {
                let appended = append_events(&sp, &p.uid, p.expected_last_seq, p.fence, &p.events);
                if appended.is_err() {
                    sp.rollback()
                        .map_err(storage(format!("roll back append to {}", p.uid)))?;
                }
                sp.commit()
                    .map_err(storage(format!("end append to {}", p.uid)))?;
                appended
            });
        done.push((p, result));
    }
    match tx.commit() {
        Ok(()) => {
            for (p, result) in done {
                let _ = p.answer.send(result);
            }
        }
        Err(e) => {
            // Nothing of the batch is durable: every append in it fails with the cause.
            for (p, result) in done {
                let _ = p.answer.send(match result {
                    Ok(_) => Err(storage_copy(&e, &p.uid, "commit append to")),
                    failed => failed,
                });
            }
        }
    }
}

/// `e` for one of the appends it failed (sqlite's code kept, so a full disk reads as one).
fn storage_copy(e: &rusqlite::Error, uid: &str, doing: &str) -> JournalError {
    let source = match e {
        rusqlite::Error::SqliteFailure(code, message) => {
            rusqlite::Error::SqliteFailure(*code, message.clone())
        }
        other => rusqlite::Error::SqliteFailure(
            rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_ERROR),
            Some(other.to_string()),
        ),
    };
    JournalError::Storage {
        context: format!("{doing} {uid}"),
        source,
    }
}

fn lost(context: String) -> JournalError {
    JournalError::Storage {
        context,
        source: rusqlite::Error::SqliteFailure(
            rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_ABORT),
            None,
        ),
    }
}

#[cfg(test)]
pub(super) fn commit_for_test(
    conn: &mut Connection,
    appends: Vec<(&str, i64, i64, Vec<Event>)>,
) -> Vec<Result<Vec<LogRecord>>> {
    let mut answers = Vec::new();
    let batch = appends
        .into_iter()
        .map(|(uid, expected_last_seq, fence, events)| {
            let (answer, answered) = mpsc::sync_channel(1);
            answers.push(answered);
            Pending {
                uid: uid.to_owned(),
                expected_last_seq,
                fence,
                events,
                answer,
            }
        })
        .collect();
    commit_batch(conn, batch);
    answers
        .into_iter()
        .map(|a| a.recv().expect("every append is answered"))
        .collect()
}
