//! Time travel: every turn of a memory-tier session is a point it can be forked from.
//!
//! When a turn of a memory-tier session ends (its END recorded and sent), its runtime
//! checkpoints the VM in the background: what changed since the last checkpoint, as a layer
//! on it. The client never waits for it, and a next turn waits only until the VM runs
//! again; a suspend, fork or delete waits for it to finish. A checkpoint is recorded in the
//! journal's side table (seq → snapshot) only once it is durable in the store, so the log
//! and its hash chain stay exactly upstream's, and a crash at any step leaves either a
//! recorded checkpoint or an unrecorded snapshot that [`SessionHost::sweep_checkpoints`]
//! removes.
//!
//! Retention keeps the last `keep_last` turns' checkpoints and every `keep_every`th older
//! one. Dropping one folds its pages into the next one kept (`LocalStore::merge_down`), so
//! every kept checkpoint still restores exactly its turn; a chain is at most one layer per
//! kept checkpoint of a VMM's run, and each run starts afresh every `CHECKPOINT_DEPTH`
//! turns (agentvm-vmm).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agentvm_proto::v1::SnapshotRef;
use tokio::sync::watch;
use tonic::Status;

use super::SessionHost;
use crate::api::status::journal_status;
use crate::clock::now_nanos;
use crate::crash_point;
use crate::journal::{CheckpointRow, Journal};
use crate::runtime::{Incarnation, Runtime};

/// A session's annotation that overrides the node's retention: `off`, `K` (the last K
/// turns) or `K/M` (and every Mth older one).
pub const ANNOTATION: &str = "agentvm.dev/checkpoints";

/// How long a turn waits for the VM of the checkpoint before it to run again, and an
/// operation for the checkpoint to finish, before going on without it.
const WAIT_BOUND: Duration = Duration::from_secs(60);

/// Which turns' checkpoints a session keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    /// The last this many turns; 0: no checkpoints at all.
    pub keep_last: u32,
    /// And, of older ones, every turn that is a multiple of this; 0: none.
    pub keep_every: u32,
}

impl Default for Retention {
    fn default() -> Self {
        Self {
            keep_last: 32,
            keep_every: 10,
        }
    }
}

impl Retention {
    /// Parses an [`ANNOTATION`] value.
    pub fn parse(value: &str) -> Result<Self, String> {
        agentvm_guest::image::parse_checkpoint_retention(value)
            .map(|(keep_last, keep_every)| Self {
                keep_last,
                keep_every,
            })
            .ok_or_else(|| {
                format!(
                    "annotation {ANNOTATION}: {value:?} is not \"off\", \"K\" or \"K/M\" (numbers)"
                )
            })
    }

    /// This node's retention as a session's image (its `[vm] checkpoints`) and then its
    /// annotations change it (a value that does not parse was refused when the image was
    /// built or the session created; here it leaves what was).
    pub fn for_session(self, image: Option<&str>, annotations: &BTreeMap<String, String>) -> Self {
        [annotations.get(ANNOTATION).map(String::as_str), image]
            .into_iter()
            .flatten()
            .find_map(|v| Self::parse(v).ok())
            .unwrap_or(self)
    }

    pub fn off(&self) -> bool {
        self.keep_last == 0
    }

    /// Whether the checkpoint of `turn` stays once `latest` is the newest turn.
    fn keeps(&self, turn: u64, latest: u64) -> bool {
        // The newest one is always kept: the next is layered on it.
        let recent = u64::from(self.keep_last.max(1));
        turn + recent > latest
            || (self.keep_every > 0 && turn.is_multiple_of(u64::from(self.keep_every)))
    }
}

/// A checkpoint being taken: when its VM runs again, and when it is finished.
#[derive(Clone)]
struct Flight {
    running_again: watch::Receiver<bool>,
    done: watch::Receiver<bool>,
}

/// The checkpoints being taken, per session.
#[derive(Default)]
pub struct TurnCheckpoints {
    flights: Mutex<HashMap<String, Flight>>,
    /// Held while checkpoints past retention are folded away.
    retaining: Arc<Mutex<()>>,
}

impl TurnCheckpoints {
    fn flight(&self, uid: &str) -> Option<Flight> {
        self.flights
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(uid)
            .cloned()
    }

    /// Waits until no checkpoint of `uid` holds its VM paused: what a next turn waits for.
    /// Not for a VM that is gone or stalled (`given_up`): its checkpoint will not finish,
    /// and what comes next finds out about the VM itself.
    pub async fn running_again(&self, uid: &str, given_up: impl Fn() -> bool) {
        if let Some(flight) = self.flight(uid) {
            wait_until(flight.running_again, given_up).await;
        }
    }

    /// Waits until no checkpoint of `uid` is being taken: what a suspend, fork or delete
    /// waits for (they change or stop the VM it is taken of). As `running_again`.
    pub async fn settled(&self, uid: &str, given_up: impl Fn() -> bool) {
        if let Some(flight) = self.flight(uid) {
            wait_until(flight.done, given_up).await;
        }
    }
}

/// Until `flag` is set, `given_up()` says to stop waiting, or [`WAIT_BOUND`] passes.
async fn wait_until(mut flag: watch::Receiver<bool>, given_up: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT_BOUND;
    while !*flag.borrow() && !given_up() && tokio::time::Instant::now() < deadline {
        let _ = tokio::time::timeout(Duration::from_millis(100), flag.changed()).await;
    }
}

impl SessionHost {
    /// Whether `uid`'s VM is gone or stalled: a checkpoint of it will not finish.
    pub(super) fn checkpoint_hopeless(&self, uid: &str) -> bool {
        match self.live_get(uid) {
            Some((inc, runtime)) => !runtime.alive(&inc) || runtime.stalled(&inc).is_some(),
            None => true,
        }
    }

    /// Keeps memory-tier sessions' checkpoints by `retention` (the node's default).
    pub fn with_checkpoints(mut self, retention: Retention) -> Self {
        self.retention = retention;
        self
    }

    /// After a completed turn of memory-tier session `uid` whose END is at `seq`: checkpoints
    /// its VM in the background, unless its retention keeps none.
    pub(super) fn checkpoint_turn(
        &self,
        uid: &str,
        seq: i64,
        incarnation: Incarnation,
        runtime: Arc<dyn Runtime>,
        harness: &str,
        annotations: &BTreeMap<String, String>,
    ) {
        let image = runtime.checkpoint_retention(harness);
        let retention = self.retention.for_session(image.as_deref(), annotations);
        if retention.off() {
            return;
        }
        let previous = self.turn_checkpoints.flight(uid);
        let (running_tx, running_rx) = watch::channel(false);
        let (done_tx, done_rx) = watch::channel(false);
        self.turn_checkpoints
            .flights
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(
                uid.to_owned(),
                Flight {
                    running_again: running_rx,
                    done: done_rx.clone(),
                },
            );
        let journal = self.journal.clone();
        let flights = self.turn_checkpoints.clone();
        let uid = uid.to_owned();
        tokio::spawn(async move {
            // One at a time per session: the next is layered on this one.
            // Taken in turn order (the VMM layers each on the one it took last), but stored
            // after the one before only: the next turn need not wait for that one's writing.
            let below_stored: std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> =
                match previous {
                    Some(previous) => {
                        wait_until(previous.running_again, || false).await;
                        let mut done = previous.done;
                        Box::pin(async move {
                            let _ = done.wait_for(|d| *d).await;
                        })
                    }
                    None => Box::pin(std::future::ready(())),
                };
            let (tx, rx) = tokio::sync::oneshot::channel();
            let running = tokio::spawn(async move {
                let _ = rx.await;
                let _ = running_tx.send(true);
            });
            let cues = crate::runtime::CheckpointCues {
                running_again: tx,
                below_stored,
            };
            let taken = runtime.checkpoint_turn(&incarnation, cues).await;
            let _ = running.await;
            let recorded = match taken {
                Ok(Some(taken)) => {
                    crash_point::reached(crash_point::CHECKPOINT_TAKEN);
                    let (journal, session) = (journal.clone(), uid.clone());
                    // Journal and file work, off the async workers.
                    let recorded = tokio::task::spawn_blocking(move || {
                        record(&*journal, &session, seq, &taken.snapshot, &taken)
                    })
                    .await;
                    match recorded {
                        Ok(Ok(())) => true,
                        Ok(Err(e)) => {
                            tracing::warn!(session = %uid, seq, error = %e,
                                "the turn's checkpoint was not recorded; it is swept");
                            false
                        }
                        Err(e) => {
                            tracing::warn!(session = %uid, seq, error = %e,
                                "recording the turn's checkpoint failed");
                            false
                        }
                    }
                }
                Ok(None) => false,
                Err(e) => {
                    tracing::warn!(session = %uid, seq, error = %e,
                        "the turn's checkpoint was not taken");
                    false
                }
            };
            let _ = done_tx.send(true);
            // Retention after: the next checkpoint need not wait for a fold of old ones
            // (which touches only checkpoints older than the one just taken, and layers pin
            // their bases' contents, not their manifests). One fold at a time on the node.
            if recorded {
                let (journal, uid, runtime) = (journal.clone(), uid.clone(), runtime.clone());
                let lock = flights.retaining.clone();
                let _ = tokio::task::spawn_blocking(move || {
                    let _one = lock.lock().unwrap_or_else(|p| p.into_inner());
                    if let Err(e) = retain(&*journal, &*runtime, &uid, retention) {
                        tracing::warn!(session = %uid, error = %e, "retention of checkpoints");
                    }
                })
                .await;
            }
            let mut flights = flights.flights.lock().unwrap_or_else(|p| p.into_inner());
            if flights
                .get(&uid)
                .is_some_and(|f| f.done.same_channel(&done_rx))
            {
                flights.remove(&uid);
            }
        });
    }

    /// The seqs `uid` can be forked at besides its head, and where each one's memory is.
    pub fn checkpoints_of(&self, uid: &str) -> Result<Vec<CheckpointRow>, Status> {
        self.row(uid)?;
        self.journal
            .checkpoints(uid)
            .map_err(|e| journal_status(&e))
    }

    /// The checkpoint a fork of `uid` at `seq` starts from, or FAILED_PRECONDITION naming
    /// the nearest seqs that can be forked.
    pub(super) fn checkpoint_at(
        &self,
        uid: &str,
        seq: i64,
        head: i64,
    ) -> Result<SnapshotRef, Status> {
        let rows = self.checkpoints_of(uid)?;
        if let Some(row) = rows.iter().find(|r| r.seq == seq) {
            return Ok(as_ref(uid, row));
        }
        let before = rows.iter().rev().find(|r| r.seq < seq).map(|r| r.seq);
        let after = rows.iter().find(|r| r.seq > seq).map(|r| r.seq);
        let nearest: Vec<String> = before
            .into_iter()
            .chain(after)
            .map(|s| s.to_string())
            .chain(std::iter::once(format!("{head} (the head)")))
            .collect();
        Err(Status::failed_precondition(format!(
            "SnapshotSuperseded: at_seq: session {uid} has no checkpoint at seq {seq}; the \
             nearest seqs it can be forked at are {}",
            nearest.join(", ")
        )))
    }

    /// In a fleet, a suspended session's checkpoints go to the fleet's snapshot store
    /// (oldest first, each a layer on the one before, as its suspends' snapshots go), and
    /// their records name the archives from then on: any node can then fork it at a past
    /// turn. Nothing is lost if this fails: the records keep naming this node's copies.
    pub(super) async fn publish_checkpoints(&self, uid: &str, runtime: &Arc<dyn Runtime>) {
        let Ok(rows) = self.journal.checkpoints(uid) else {
            return;
        };
        let mut published = Vec::new();
        for row in &rows {
            let snapshot = as_ref(uid, row);
            if runtime.is_published(&snapshot) {
                continue;
            }
            match runtime.publish_checkpoint(&snapshot).await {
                Ok(Some(uri)) => published.push((row.snapshot.clone(), uri, row.clone())),
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(session = %uid, seq = row.seq, error = %e,
                        "a checkpoint was not published to the fleet; it and later ones stay this node's");
                    break;
                }
            }
        }
        if published.is_empty() {
            return;
        }
        let (journal, lock, session) = (
            self.journal.clone(),
            self.turn_checkpoints.retaining.clone(),
            uid.to_owned(),
        );
        let n = published.len();
        let recorded = tokio::task::spawn_blocking(move || {
            // Against a fold that ran meanwhile: only records still naming what was sent.
            let _one = lock.lock().unwrap_or_else(|p| p.into_inner());
            let now = journal.checkpoints(&session)?;
            let replace: Vec<CheckpointRow> = published
                .into_iter()
                .filter(|(local, _, row)| {
                    now.iter().any(|r| r.seq == row.seq && &r.snapshot == local)
                })
                .map(|(_, uri, row)| CheckpointRow {
                    snapshot: uri,
                    ..row
                })
                .collect();
            journal.retain_checkpoints(&session, &[], &replace)
        })
        .await;
        match recorded {
            Ok(Ok(())) => tracing::info!(session = %uid, checkpoints = n,
                "checkpoints published to the fleet's snapshot store"),
            Ok(Err(e)) => tracing::warn!(session = %uid, error = %e,
                "published checkpoints not recorded; their records name this node's copies"),
            Err(e) => tracing::warn!(session = %uid, error = %e, "recording published checkpoints"),
        }
    }

    /// Drops what no record names of `uid`'s checkpoints (a crash between the store and the
    /// journal), and records that name what is gone.
    pub(super) fn sweep_checkpoints(&self, uid: &str, runtime: &Arc<dyn Runtime>) {
        if self.turn_checkpoints.flight(uid).is_some() {
            return;
        }
        let Ok(rows) = self.journal.checkpoints(uid) else {
            return;
        };
        // Published to the fleet's store, a record names an archive, not this node's copy.
        if rows.iter().any(|r| runtime.is_published(&as_ref(uid, r))) {
            return;
        }
        let held = runtime.checkpoints_held(uid);
        for snapshot in &held {
            if !rows.iter().any(|r| r.snapshot == snapshot.external_uri) {
                runtime.discard_checkpoint(snapshot);
            }
        }
        let gone: Vec<i64> = rows
            .iter()
            .filter(|r| !held.iter().any(|h| h.external_uri == r.snapshot))
            .map(|r| r.seq)
            .collect();
        if !gone.is_empty()
            && let Err(e) = self.journal.retain_checkpoints(uid, &gone, &[])
        {
            tracing::warn!(session = %uid, error = %e, "could not forget missing checkpoints");
        }
    }
}

/// What `uid`'s checkpoint record `row` names, as a snapshot.
fn as_ref(uid: &str, row: &CheckpointRow) -> SnapshotRef {
    SnapshotRef {
        local: uid.to_owned(),
        external_uri: row.snapshot.clone(),
        memory: true,
        sealed: false,
    }
}

/// Records `taken` as `uid`'s checkpoint at `seq`.
fn record(
    journal: &dyn Journal,
    uid: &str,
    seq: i64,
    snapshot: &SnapshotRef,
    taken: &crate::runtime::TurnCheckpoint,
) -> crate::journal::Result<()> {
    let rows = journal.checkpoints(uid)?;
    let turn = rows.last().map_or(1, |r| r.turn + 1);
    journal.record_checkpoint(
        uid,
        &CheckpointRow {
            seq,
            turn,
            snapshot: snapshot.external_uri.clone(),
            manifest_sha256: taken.manifest_sha256.clone(),
            bytes: taken.bytes,
            created_at: now_nanos(),
        },
    )?;
    crash_point::reached(crash_point::CHECKPOINT_RECORDED);
    tracing::debug!(session = %uid, seq, turn, paused_us = taken.paused.as_micros() as u64,
        pages = taken.pages, disk_blocks = taken.disk_blocks, bytes = taken.bytes,
        incremental = taken.incremental, "turn checkpointed");
    Ok(())
}

/// Drops the checkpoints `retention` no longer keeps, oldest first, each folded into the
/// one after it.
fn retain(
    journal: &dyn Journal,
    runtime: &dyn Runtime,
    uid: &str,
    retention: Retention,
) -> crate::journal::Result<()> {
    loop {
        let rows = journal.checkpoints(uid)?;
        let Some(latest) = rows.last().map(|r| r.turn) else {
            return Ok(());
        };
        let Some(i) = rows.iter().position(|r| !retention.keeps(r.turn, latest)) else {
            return Ok(());
        };
        let (dropped, next) = (&rows[i], rows.get(i + 1));
        let Some(next) = next else {
            return Ok(());
        };
        let as_ref = |r: &CheckpointRow| as_ref(uid, r);
        // Published, a checkpoint may be what later archives are layered on (and this
        // node may hold no copy): its record goes, its archive stays with its session's.
        if runtime.is_published(&as_ref(dropped)) {
            journal.retain_checkpoints(uid, &[dropped.seq], &[])?;
            runtime.discard_checkpoint(&as_ref(dropped));
            continue;
        }
        let merged = match runtime.merge_checkpoints(uid, &as_ref(dropped), &as_ref(next)) {
            Ok(Some(merged)) => merged,
            Ok(None) => return Ok(()),
            Err(e) => {
                tracing::warn!(session = %uid, seq = dropped.seq, error = %e,
                    "a checkpoint past retention could not be folded into the next; kept");
                return Ok(());
            }
        };
        crash_point::reached(crash_point::CHECKPOINT_MERGED);
        let folded = merged.snapshot.external_uri != next.snapshot;
        let replaced = CheckpointRow {
            snapshot: merged.snapshot.external_uri.clone(),
            manifest_sha256: merged.manifest_sha256.clone(),
            bytes: merged.bytes,
            ..next.clone()
        };
        let replace = if folded { vec![replaced] } else { Vec::new() };
        journal.retain_checkpoints(uid, &[dropped.seq], &replace)?;
        // Unused now; one a VM still maps goes at a later sweep.
        if folded {
            runtime.discard_checkpoint(&as_ref(next));
        }
        runtime.discard_checkpoint(&as_ref(dropped));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn annotations_parse_or_name_the_problem() {
        assert_eq!(
            Retention::parse("off").unwrap(),
            Retention {
                keep_last: 0,
                keep_every: 0
            }
        );
        assert_eq!(
            Retention::parse("5/3").unwrap(),
            Retention {
                keep_last: 5,
                keep_every: 3
            }
        );
        assert_eq!(Retention::parse(" 7 ").unwrap().keep_every, 0);
        for bad in ["", "x", "5/", "-1", "5/3/2"] {
            let e = Retention::parse(bad).unwrap_err();
            assert!(e.contains(ANNOTATION), "{e}");
        }
    }

    #[test]
    fn the_last_turns_and_every_mth_older_one_are_kept() {
        let r = Retention {
            keep_last: 3,
            keep_every: 4,
        };
        let kept: Vec<u64> = (1..=12).filter(|t| r.keeps(*t, 12)).collect();
        assert_eq!(kept, [4, 8, 10, 11, 12]);
        // What a later turn keeps never includes what an earlier one dropped.
        let later: Vec<u64> = (1..=13).filter(|t| r.keeps(*t, 13)).collect();
        assert!(later.iter().all(|t| kept.contains(t) || *t == 13));
        let none_older = Retention {
            keep_last: 2,
            keep_every: 0,
        };
        assert_eq!(
            (1..=5)
                .filter(|t| none_older.keeps(*t, 5))
                .collect::<Vec<_>>(),
            [4, 5]
        );
    }
}
