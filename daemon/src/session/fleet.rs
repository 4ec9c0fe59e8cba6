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
        self.draining.send_replace(true);
    }

    /// Whether the node drains, and when that changes.
    pub fn draining(&self) -> tokio::sync::watch::Receiver<bool> {
        self.draining.subscribe()
    }

    pub(super) fn refuse_if_draining(&self) -> Result<(), tonic::Status> {
        match *self.draining.borrow() {
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

/// One heartbeat: this node's address and what `status` says of it, into the journal.
async fn beat(
    host: &SessionHost,
    address: &str,
    status: &Arc<dyn Fn() -> String + Send + Sync>,
) -> Result<(), crate::journal::JournalError> {
    let (journal, address, status) = (host.journal.clone(), address.to_owned(), status.clone());
    tokio::task::spawn_blocking(move || journal.heartbeat(&address, &status()))
        .await
        .unwrap_or_else(|e| {
            Err(crate::journal::JournalError::Unavailable {
                context: "heartbeat".into(),
                reason: e.to_string(),
            })
        })
}

/// Beats once now, before the node serves (a session it creates is held by a node the
/// fleet already sees alive), then every `every` (a third of the lease) until the task is
/// dropped, with what `status` says of the node then (`agentvm node list` shows it); after
/// each beat, lets go of what other nodes took over.
pub async fn heartbeat(
    host: Arc<SessionHost>,
    address: String,
    every: Duration,
    status: Arc<dyn Fn() -> String + Send + Sync>,
) -> Result<tokio::task::JoinHandle<()>, crate::journal::JournalError> {
    beat(&host, &address, &status).await?;
    Ok(tokio::spawn(async move {
        let mut failing = false;
        loop {
            tokio::time::sleep(every).await;
            match beat(&host, &address, &status).await {
                Ok(()) if failing => {
                    tracing::info!("heartbeats reach the journal again");
                    failing = false;
                }
                Err(e) if !failing => {
                    tracing::error!(error = %e,
                        "heartbeat failed: other nodes take this node's sessions over after a lease");
                    failing = true;
                }
                _ => {}
            }
            host.release_taken_over().await;
        }
    }))
}
