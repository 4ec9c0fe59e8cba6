//! Compute that ended on its own (a VMM killed or crashed) is recorded in the session's log:
//! a SUSPEND whose detail says what happened and whose snapshot is the state the session
//! continues from. Its compute state then reads COLD instead of claiming a VM that is gone
//! (upstream's projection stays LIVE after the process dies), and the next turn restores.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use agentvm_proto::v1::{ComputeState, LogRecord, SnapshotRef, event::Body};
use tokio::sync::broadcast::error::RecvError;
use tonic::Status;

use super::guard::Hold;
use super::{SessionHost, resume_point};
use crate::runtime::{ComputeLost, Runtime};

/// How long a report waits for a turn on the lost compute to end by itself (it fails as
/// soon as its harness channel does).
const BUSY_WAIT: Duration = Duration::from_secs(30);
const BUSY_POLL: Duration = Duration::from_millis(20);

impl SessionHost {
    /// Each runtime of this node once.
    pub(super) fn runtimes(&self) -> Vec<Arc<dyn Runtime>> {
        let mut runtimes: Vec<_> = self.builtin_runtimes.values().cloned().collect();
        runtimes.sort_by_key(|r| Arc::as_ptr(r) as *const () as usize);
        runtimes.dedup_by_key(|r| Arc::as_ptr(r) as *const () as usize);
        runtimes
    }

    /// Lets every runtime finish what it left running in the background; before the node
    /// stops.
    pub async fn settle(&self) {
        for runtime in self.runtimes() {
            runtime.settle().await;
        }
    }

    /// Recovers what a previous daemon left half done (`recovery`), then starts recording
    /// every runtime's lost-compute reports. Runs before the node serves; calling it again
    /// does nothing.
    pub async fn watch_compute(self: &Arc<Self>) {
        if self.watching.swap(true, Ordering::SeqCst) {
            return;
        }
        self.recover().await;
        for runtime in self.runtimes() {
            let Some(mut reports) = runtime.compute_lost() else {
                continue;
            };
            let host = Arc::downgrade(self);
            tokio::spawn(async move {
                loop {
                    match reports.recv().await {
                        Ok(lost) => match host.upgrade() {
                            Some(host) => host.record_lost_compute(lost).await,
                            None => break,
                        },
                        Err(RecvError::Lagged(missed)) => tracing::warn!(
                            missed,
                            "lost-compute reports dropped; those sessions find out at their next turn"
                        ),
                        Err(RecvError::Closed) => break,
                    }
                }
            });
        }
    }

    pub(crate) async fn record_lost_compute(&self, lost: ComputeLost) {
        crate::metrics::global().vmm_lost.inc();
        let uid = lost.session_uid.as_str();
        let deadline = tokio::time::Instant::now() + BUSY_WAIT;
        let _held = loop {
            match self.guards.try_hold(uid, Hold::Checkpoint) {
                Ok(held) => break held,
                Err(_) if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(BUSY_POLL).await
                }
                Err(_) => {
                    tracing::warn!(session = %uid, reason = %lost.reason,
                        "lost compute not recorded: the session stayed busy");
                    return;
                }
            }
        };
        // Deleted, or never ours: nothing to record.
        let Ok(row) = self.active_row(uid) else {
            return;
        };
        let Ok(placement) = self.place(&row.harness) else {
            return;
        };
        // A newer incarnation may already serve it (the report raced a restart of its VM).
        if let Ok(Some(_)) = placement.runtime.attach(uid).await {
            return;
        }
        // What the dead compute left (its VMM directory, cgroups, snapshot uses) goes now:
        // holding the session, no new compute of it is starting.
        let dead = self.live_take(uid).map(|(inc, _)| inc).unwrap_or_else(|| {
            crate::runtime::Incarnation {
                id: uid.to_owned(),
                ..Default::default()
            }
        });
        if let Err(e) = placement.runtime.stop(&dead).await {
            tracing::warn!(session = %uid, error = %e, "clearing up after lost compute");
        }
        // Cold sessions claim no compute (a fork child that never ran a turn is still its
        // FORK snapshot): nothing was lost that the log does not already say.
        if row.compute_state != ComputeState::ComputeLive {
            return;
        }
        if let Err(e) =
            self.settle_lost_compute(uid, row.fork_seq, &placement.runtime, &lost.reason)
        {
            tracing::error!(session = %uid, reason = %lost.reason, error = %e,
                "compute lost and could not be recorded");
        }
    }

    /// A LIVE memory-tier session whose compute is gone (and not yet recorded as such) gets
    /// its loss settled now, before a suspend or fork would take its last snapshot for its
    /// state. True when it was.
    pub(super) async fn settle_if_gone(
        &self,
        row: &crate::journal::SessionRow,
        reason: &str,
    ) -> Result<bool, Status> {
        self.adopt(&row.uid).await?;
        if row.compute_state != ComputeState::ComputeLive || self.live_get(&row.uid).is_some() {
            return Ok(false);
        }
        let Ok(placement) = self.place(&row.harness) else {
            return Ok(false);
        };
        if !placement.memory_tier() {
            return Ok(false);
        }
        self.settle_lost_compute(&row.uid, row.fork_seq, &placement.runtime, reason)?;
        Ok(true)
    }

    /// A LIVE session's compute is gone; before anything runs on an older state, the log must
    /// say so. A complete snapshot that a Suspend took but did not live to record is that
    /// state (nothing is lost): it is recorded as the SUSPEND. Otherwise the loss is.
    pub(super) fn settle_lost_compute(
        &self,
        uid: &str,
        fork_seq: i64,
        runtime: &Arc<dyn Runtime>,
        reason: &str,
    ) -> Result<(), Status> {
        let records = self.records(uid)?;
        let recorded = |s: &SnapshotRef| names_snapshot(&records, s);
        let held = runtime.snapshots_of(uid);
        // Only the newest snapshot can be the session's state; an unrecorded older one is a
        // leftover of a Suspend that failed before its record.
        let adopt = held.first().filter(|s| !recorded(s)).cloned();
        for stale in held.iter().skip(1).filter(|s| !recorded(s)) {
            runtime.discard_snapshot(stale);
        }
        match adopt {
            Some(snapshot) => {
                self.suspend_at_head(
                    uid,
                    "suspend completed after a restart: its snapshot was taken, not yet recorded",
                    Some(snapshot),
                )?;
                tracing::warn!(session = %uid, "adopted the snapshot of an interrupted suspend");
            }
            None => {
                let snapshot = resume_point(&records, fork_seq);
                self.suspend_at_head(uid, &format!("compute lost: {reason}"), snapshot)?;
                tracing::warn!(session = %uid, %reason,
                    "compute lost; the session continues from its last snapshot");
            }
        }
        Ok(())
    }

    /// The snapshot a session continues from failed its digests or cannot be read: that never
    /// clears, so the log says it once (a SUSPEND naming the same snapshot, so the session
    /// stays where it was) and every turn answers DATA_LOSS until the session is forked from
    /// an earlier point or deleted. The caller holds the session.
    pub(super) fn record_unusable_snapshot(&self, uid: &str, snapshot: &SnapshotRef, reason: &str) {
        let detail = format!("snapshot unusable: {reason}");
        let result = (|| {
            let records = self.records(uid)?;
            let said = records.last().is_some_and(|r| {
                matches!(r.event.as_ref().and_then(|e| e.body.as_ref()),
                    Some(Body::Lifecycle(l)) if l.detail == detail)
            });
            if said {
                return Ok(());
            }
            self.suspend_at_head(uid, &detail, Some(snapshot.clone()))
                .map(|_| ())
        })();
        match result {
            Ok(()) => {
                tracing::error!(session = %uid, %reason, "the session's snapshot is unusable")
            }
            Err(e) => tracing::error!(session = %uid, %reason, error = %e,
                "the session's snapshot is unusable, and that could not be recorded"),
        }
    }

    /// Appends the SUSPEND that records lost compute; the caller holds the session.
    pub(super) fn record_lost(&self, uid: &str, fork_seq: i64, reason: &str) {
        let result = (|| {
            let snapshot = resume_point(&self.records(uid)?, fork_seq);
            self.suspend_at_head(uid, &format!("compute lost: {reason}"), snapshot)
        })();
        match result {
            Ok(_) => tracing::warn!(session = %uid, %reason,
                "compute lost; the session continues from its last snapshot"),
            Err(e) => tracing::error!(session = %uid, %reason, error = %e,
                "compute lost and could not be recorded"),
        }
    }
}

/// Whether a LIFECYCLE record of `records` names `snapshot`.
pub(super) fn names_snapshot(records: &[LogRecord], snapshot: &SnapshotRef) -> bool {
    records
        .iter()
        .any(|r| match r.event.as_ref().and_then(|e| e.body.as_ref()) {
            Some(Body::Lifecycle(l)) => l.snapshot_external_uri == snapshot.external_uri,
            _ => false,
        })
}
