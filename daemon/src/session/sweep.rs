//! Deleting the snapshots of sessions that are gone, while the node serves. A delete
//! reclaims what the deleting node holds; in a fleet, the copies other nodes fetched and
//! the archives in the fleet's snapshot store outlive it until a sweep finds them.

use std::sync::Arc;
use std::time::Duration;

use crate::journal::DeletionState;
use crate::runtime::SnapshotOwner;

use super::SessionHost;

impl SessionHost {
    /// What the journal says of `uid` for a sweep. With `fleet_wide` false the journal
    /// knows only this node's sessions, so a snapshot of a session it does not know may be
    /// another's and stays.
    fn snapshot_owner(&self, uid: &str, fleet_wide: bool) -> SnapshotOwner {
        match self.journal.get_session(uid) {
            Ok(None) if fleet_wide => SnapshotOwner::Unknown,
            Ok(Some(row)) if row.deletion == DeletionState::Deleted => {
                match self.journal.has_undeleted_children(uid) {
                    Ok(false) => SnapshotOwner::Gone,
                    _ => SnapshotOwner::Wanted,
                }
            }
            _ => SnapshotOwner::Wanted,
        }
    }

    /// One sweep of every runtime's snapshots.
    pub async fn sweep_snapshots(&self, fleet_wide: bool) {
        let owner = |uid: &str| self.snapshot_owner(uid, fleet_wide);
        for runtime in self.runtimes() {
            runtime.sweep_snapshots(&owner).await;
            for uid in runtime.sessions_with_checkpoints() {
                if self.is_active(&uid) {
                    self.sweep_checkpoints(&uid, &runtime);
                }
            }
        }
    }
}

/// Sweeps every `every` until the task is dropped.
pub fn sweeping(
    host: Arc<SessionHost>,
    every: Duration,
    fleet_wide: bool,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(every).await;
            host.sweep_snapshots(fleet_wide).await;
        }
    })
}
