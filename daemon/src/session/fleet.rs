//! A node's part in a fleet sharing one journal: it beats (so the sessions it holds stay
//! its own and other nodes route calls for them here), and it lets go of the compute of
//! sessions another node has taken over while this one could not beat (a partition, a
//! pause): their VMs must not run on beside the new holder's.

use std::sync::Arc;
use std::time::Duration;

use crate::journal::Holder;

use super::SessionHost;

impl SessionHost {
    /// From now until the node restarts, new work (sessions, turns, resumes, forks) is
    /// refused, so a drain's suspends are the last word here.
    pub fn start_draining(&self) {
        self.draining
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    pub(super) fn refuse_if_draining(&self) -> Result<(), tonic::Status> {
        match self.draining.load(std::sync::atomic::Ordering::SeqCst) {
            true => Err(tonic::Status::unavailable(
                "NodeDraining: this node is draining; send the call to another node of the fleet",
            )),
            false => Ok(()),
        }
    }

    /// Stops this node's compute of every session another live node now holds. Nothing is
    /// recorded: the session's log is the new holder's to write.
    pub async fn release_taken_over(&self) -> usize {
        let held: Vec<String> = self
            .live
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .keys()
            .cloned()
            .collect();
        // The journal is asked off the async threads: one question per running session.
        let journal = self.journal.clone();
        let taken = tokio::task::spawn_blocking(move || {
            held.into_iter()
                .filter_map(|uid| {
                    let row = journal.get_session(&uid).ok()??;
                    match journal.holder_of(&row) {
                        Ok(Holder::Alive(node)) => Some((uid, node.name)),
                        _ => None,
                    }
                })
                .collect::<Vec<_>>()
        })
        .await
        .unwrap_or_default();
        let mut released = 0;
        for (uid, holder) in taken {
            if let Some((inc, runtime)) = self.live_take(&uid) {
                tracing::warn!(session = %uid, %holder,
                    "another node took the session over: stopping its compute here");
                if let Err(e) = runtime.stop(&inc).await {
                    tracing::warn!(session = %uid, error = %e, "stopping taken-over compute");
                }
                released += 1;
            }
        }
        released
    }
}

/// Beats every `every` (a third of the lease) until the task is dropped, the first time at
/// once, with what `status` says of the node then (`agentvm node list` shows it); after
/// each beat, lets go of what other nodes took over.
pub fn heartbeat(
    host: Arc<SessionHost>,
    address: String,
    every: Duration,
    status: Arc<dyn Fn() -> String + Send + Sync>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut failing = false;
        loop {
            tick.tick().await;
            let journal = host.journal.clone();
            let address = address.clone();
            let status = status.clone();
            let beat =
                tokio::task::spawn_blocking(move || journal.heartbeat(&address, &status())).await;
            match beat {
                Ok(Ok(())) if failing => {
                    tracing::info!("heartbeats reach the journal again");
                    failing = false;
                }
                Ok(Err(e)) if !failing => {
                    tracing::error!(error = %e,
                        "heartbeat failed: other nodes take this node's sessions over after a lease");
                    failing = true;
                }
                _ => {}
            }
            host.release_taken_over().await;
        }
    })
}
