//! Compute that ended on its own (a VMM killed or crashed) is recorded in the session's log:
//! a SUSPEND whose detail says what happened and whose snapshot is the state the session
//! continues from. Its compute state then reads COLD instead of claiming a VM that is gone
//! (upstream's projection stays LIVE after the process dies), and the next turn restores.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use agentvm_proto::v1::lifecycle::Kind as LifecycleKind;
use tokio::sync::broadcast::error::RecvError;

use super::guard::Hold;
use super::{SessionHost, resume_point};
use crate::runtime::ComputeLost;

/// How long a report waits for a turn on the lost compute to end by itself (it fails as
/// soon as its harness channel does).
const BUSY_WAIT: Duration = Duration::from_secs(30);
const BUSY_POLL: Duration = Duration::from_millis(20);

impl SessionHost {
    /// Starts recording every runtime's lost-compute reports. Needs a tokio runtime; calling
    /// it again does nothing.
    pub fn watch_compute(self: &Arc<Self>) {
        if self.watching.swap(true, Ordering::SeqCst) {
            return;
        }
        let mut runtimes: Vec<_> = self.builtin_runtimes.values().cloned().collect();
        runtimes.sort_by_key(|r| Arc::as_ptr(r) as *const () as usize);
        runtimes.dedup_by_key(|r| Arc::as_ptr(r) as *const () as usize);
        for runtime in runtimes {
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
        crate::metrics::global()
            .vmm_lost
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
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
        self.live_take(uid);
        self.record_lost(uid, row.fork_seq, &lost.reason);
    }

    /// Appends the SUSPEND that records lost compute; the caller holds the session.
    pub(super) fn record_lost(&self, uid: &str, fork_seq: i64, reason: &str) {
        let result = (|| {
            let snapshot = resume_point(&self.records(uid)?, fork_seq);
            let fence = self
                .journal
                .new_fence(uid)
                .map_err(|e| crate::api::status::journal_status(&e))?;
            let head = self.row(uid)?.last_seq;
            self.append_lifecycle(
                uid,
                head,
                fence,
                LifecycleKind::LifecycleSuspend,
                &format!("compute lost: {reason}"),
                snapshot,
            )
        })();
        match result {
            Ok(_) => tracing::warn!(session = %uid, %reason,
                "compute lost; the session continues from its last snapshot"),
            Err(e) => tracing::error!(session = %uid, %reason, error = %e,
                "compute lost and could not be recorded"),
        }
    }
}
