//! Fork: N children from one point of a parent's log (semantics.md §3 Fork, §4.3).

use std::sync::Arc;

use agentvm_proto::v1::{ForkRequest, Session, SnapshotRef, lifecycle::Kind as LifecycleKind};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tonic::Status;
use tracing::Instrument;

use super::guard::Hold;
use super::turns::lifecycle_event;
use super::{SessionHost, busy, new_session_uid, resume_record, runtime_status};
use crate::api::status::journal_status;
use crate::clock::now_nanos;
use crate::controller::Interrupt;
use crate::controller::tail::last_execution_record;
use crate::crash_point;
use crate::journal::{OperationKind, SessionRow};
use crate::runtime::placement::can_place;
use crate::runtime::{ForkOpts, Incarnation, SessionSpec};

/// Children started at once; more only queue on the same two cores and VMM spawns.
const FORK_PARALLELISM: usize = 8;

/// Children started so far, in request order, with what the runtime runs them as.
type Provisioned = Vec<(String, Option<Incarnation>)>;

/// Each provisioned child gets this long to stop when a fan-out is rolled back.
const ROLLBACK_STOP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

impl SessionHost {
    pub async fn fork(&self, req: ForkRequest) -> Result<Vec<Session>, Status> {
        let started = std::time::Instant::now();
        let parent = req.session.clone();
        let children = self.fork_children(req).await?;
        let metrics = crate::metrics::global();
        metrics.fork.observe_of(started.elapsed(), &parent);
        metrics.fork_children.inc_by(children.len() as u64);
        Ok(children)
    }

    async fn fork_children(&self, req: ForkRequest) -> Result<Vec<Session>, Status> {
        self.refuse_if_draining()?;
        let parent = self.active_row(&req.session)?;
        let uid = parent.uid.clone();
        // Every child carries the parent's annotations and origin, and the request's labels
        // and a name: all of them come back in this one response.
        let inherited = child_row(&parent, "", &req, 0, 0);
        let name = req.child_names.iter().map(String::len).max().unwrap_or(0);
        crate::api::metadata_limits::check_fork_fan_out(
            req.count.max(1) as usize,
            metadata_bytes(&inherited) + name,
        )?;
        self.admit_disk("a fork")?;
        let placement = self.place(&parent.harness)?;
        can_place(
            &placement.capabilities,
            placement.runtime.name(),
            &placement.runtime.capabilities(),
        )
        .map_err(|e| Status::failed_precondition(e.to_string()))?;
        let mut quota = self.admit_fork(&parent, &placement, req.count.max(1) as u64)?;
        if placement.runtime.name() == crate::runtime::remote::NAME {
            // As upstream: the harness is asked before a fork writes anything, so one that is
            // down is UNAVAILABLE and no child exists. (Reaching it costs a Describe; every
            // other runtime proves itself when it starts the children.)
            let spec = SessionSpec {
                session_uid: uid.clone(),
                harness: placement.harness.clone(),
                ..Default::default()
            };
            let incarnation = placement
                .runtime
                .create(&spec)
                .await
                .map_err(|e| runtime_status(&e))?;
            self.describe(&placement, &incarnation).await?;
        }
        let head = parent.last_seq;
        let at_seq = if req.at_seq == 0 { head } else { req.at_seq };
        if at_seq > head {
            return Err(Status::invalid_argument(format!(
                "at_seq: {at_seq} is beyond the head of session {uid} ({head})"
            )));
        }
        let memory = placement.memory_tier();
        // Before its head, a memory-tier session forks from that turn's checkpoint, which
        // nothing changes: the parent is neither held nor checkpointed again.
        let past = match memory && at_seq != head {
            true => Some(self.checkpoint_at(&uid, at_seq, head)?),
            false => None,
        };
        let mut held = if past.is_some() {
            None
        } else if memory {
            Some(
                self.guards
                    .preempt_and_hold(
                        &uid,
                        Hold::Checkpoint,
                        Interrupt::Supersede("forked".into()),
                    )
                    .await
                    .map_err(|b| busy(&uid, b))?,
            )
        } else {
            Some(
                self.guards
                    .try_hold(&uid, Hold::Checkpoint)
                    .map_err(|b| busy(&uid, b))?,
            )
        };

        let mut children_hold = None;
        let source = if let Some(past) = past {
            // What the parent's harness held when that turn ended: the log through it.
            children_hold = Some(at_seq);
            past
        } else if memory {
            let fence = self
                .journal
                .new_fence(&uid)
                .map_err(|e| journal_status(&e))?;
            if self.row(&uid)?.last_seq != at_seq {
                return Err(Status::aborted(format!(
                    "session {uid} advanced during the fork; fork again at the new head"
                )));
            }
            if self
                .settle_if_gone(&parent, "its VMM was gone when the session was forked")
                .await?
            {
                // Children at `at_seq` would claim memory the session no longer has.
                return Err(Status::aborted(format!(
                    "session {uid} lost its compute; its log now says so at a new head: fork \
                     again there"
                )));
            }
            // What the parent's harness holds of the log is what its children's clones hold.
            children_hold = self.live_holds_through(&uid);
            let live = match self.live_get(&uid) {
                Some(_) => self.checkpoint_live(&uid).await?,
                None => None,
            };
            let snapshot = if let Some((snapshot, intent)) = live {
                // The parent checkpointed and went on running (we do not park it, unlike
                // upstream): its log says both, so it stays LIVE and the checkpoint is where
                // it continues from should its VM be lost later.
                self.journal
                    .append(
                        &uid,
                        at_seq,
                        fence,
                        &[
                            lifecycle_event(
                                LifecycleKind::LifecycleSuspend,
                                "fork",
                                Some(snapshot.clone()),
                            ),
                            lifecycle_event(LifecycleKind::LifecycleResume, "fork", None),
                        ],
                    )
                    .map_err(|e| journal_status(&e))?;
                crash_point::reached(crash_point::SUSPEND_RECORDED);
                drop(intent);
                // The parent answers turns again while its children start.
                held.take();
                snapshot
            } else if self.live_get(&uid).is_some() {
                let (snapshot, intent) = self.checkpoint(&uid).await?;
                self.append_lifecycle(
                    &uid,
                    at_seq,
                    fence,
                    LifecycleKind::LifecycleSuspend,
                    "fork",
                    Some(snapshot.clone()),
                )?;
                crash_point::reached(crash_point::SUSPEND_RECORDED);
                drop(intent);
                self.superseded(&uid, &snapshot).await;
                snapshot
            } else {
                // Cold (suspended, or an earlier fork already parked it): its head is the
                // last snapshot it took, so the children start from that one.
                let records = self.records(&uid)?;
                let (seq, snapshot) = resume_record(&records, parent.fork_seq).unwrap_or_default();
                children_hold = Some(last_execution_record(&records, seq));
                snapshot
            };
            if snapshot.external_uri.is_empty() {
                return Err(Status::failed_precondition(format!(
                    "the runtime gave no external snapshot of session {uid} to fork from"
                )));
            }
            snapshot
        } else {
            SnapshotRef {
                local: uid.clone(),
                ..Default::default()
            }
        };

        let count = req.count as usize;
        let uids: Vec<String> = (0..count).map(|_| new_session_uid()).collect();
        let intent = self.intend(OperationKind::Fork, &uid, uids.clone())?;
        crash_point::reached(crash_point::FORK_BEGUN);
        let started = std::time::Instant::now();
        let provisioned = match self
            .provision_children(&placement, &source, uids, &parent.annotations)
            .await
        {
            Ok(p) => p,
            Err((provisioned, e)) => {
                self.roll_back(&placement, &provisioned).await;
                return Err(e);
            }
        };

        crash_point::reached(crash_point::FORK_PROVISIONED);
        let provisioned_in = started.elapsed();
        // A memory child's FORK record names the snapshot it was cloned from: the state it
        // continues from should its VM be lost before it suspends itself.
        let cloned_from = memory.then(|| source.clone());
        let rows: Vec<_> = provisioned
            .iter()
            .enumerate()
            .map(|(i, (child, _))| {
                (
                    child_row(&parent, child, &req, i, at_seq),
                    lifecycle_event(
                        LifecycleKind::LifecycleFork,
                        &format!("parent@{at_seq}"),
                        cloned_from.clone(),
                    ),
                )
            })
            .collect();
        // Every child in one transaction: all of them exist, or none does.
        if let Err(e) = self.journal.create_children(&uid, at_seq, &rows) {
            self.roll_back(&placement, &provisioned).await;
            return Err(journal_status(&e));
        }
        crash_point::reached(crash_point::FORK_WRITTEN);
        let mut children = Vec::with_capacity(count);
        for (child, inc) in provisioned {
            if let Some(inc) = inc {
                let incarnation = inc.id.clone();
                self.live_put(&child, &parent.project, inc, &placement);
                self.live_holds(&child, &incarnation, children_hold);
            }
            children.push(self.view(&child)?);
        }
        quota.forks_made();
        drop(quota);
        drop(intent);
        tracing::info!(
            session = %uid,
            children = children.len(),
            at_seq,
            provision_ms = provisioned_in.as_secs_f64() * 1e3,
            journal_ms = (started.elapsed() - provisioned_in).as_secs_f64() * 1e3,
            "session forked"
        );
        Ok(children)
    }

    /// Starts `count` children from `source`, several at a time: each one is mostly waiting
    /// on its own VMM, so a wide fan-out costs a few child start-ups, not `count` of them.
    /// On failure, hands back what did start so the caller can stop it.
    async fn provision_children(
        &self,
        placement: &super::Placement,
        source: &SnapshotRef,
        uids: Vec<String>,
        annotations: &std::collections::BTreeMap<String, String>,
    ) -> Result<Provisioned, (Provisioned, Status)> {
        let count = uids.len();
        let permits = Arc::new(Semaphore::new(FORK_PARALLELISM));
        let mut set = JoinSet::new();
        for (index, child) in uids.into_iter().enumerate() {
            let opts = ForkOpts {
                child_session_uid: child.clone(),
                spec: SessionSpec {
                    session_uid: child.clone(),
                    image: String::new(),
                    harness: placement.harness.clone(),
                    // A child is a new session: it does not act as its parent's principal.
                    identity: None,
                    // Its row takes the parent's annotations, and so does its compute.
                    annotations: annotations.clone(),
                },
            };
            let runtime = placement.runtime.clone();
            let source = source.clone();
            let permits = permits.clone();
            set.spawn(
                async move {
                    let _permit = permits.acquire_owned().await;
                    (index, child, runtime.fork(&source, &opts).await)
                }
                .in_current_span(),
            );
        }
        let mut slots: Vec<Option<(String, Option<Incarnation>)>> = vec![None; count];
        let mut failure = None;
        while let Some(joined) = set.join_next().await {
            match joined {
                Ok((index, child, Ok(inc))) => slots[index] = Some((child, inc)),
                Ok((_, child, Err(e))) => {
                    tracing::warn!(child = %child, error = %e, "fork: a child did not start");
                    failure.get_or_insert_with(|| runtime_status(&e));
                }
                Err(e) => {
                    failure.get_or_insert_with(|| {
                        Status::internal(format!("fork: starting a child failed: {e}"))
                    });
                }
            }
        }
        let provisioned: Provisioned = slots.into_iter().flatten().collect();
        match failure {
            None => Ok(provisioned),
            Some(e) => Err((provisioned, e)),
        }
    }

    /// All-or-nothing: stop every provisioned child (none was written).
    async fn roll_back(
        &self,
        placement: &super::Placement,
        provisioned: &[(String, Option<Incarnation>)],
    ) {
        for (child, inc) in provisioned {
            if let Some(inc) = inc {
                let stop = placement.runtime.stop(inc);
                if tokio::time::timeout(ROLLBACK_STOP_TIMEOUT, stop)
                    .await
                    .is_err()
                {
                    tracing::warn!(session = %child, "fork rollback: stopping the child timed out");
                }
            }
        }
    }
}

/// A fork child's row: the parent's project, harness, model, annotations and origin, the
/// request's name and labels, and no identity (a child does not act as its parent's
/// principal).
fn child_row(
    parent: &SessionRow,
    child: &str,
    req: &ForkRequest,
    index: usize,
    at_seq: i64,
) -> SessionRow {
    let now = now_nanos();
    SessionRow {
        uid: child.to_owned(),
        project: parent.project.clone(),
        name: req.child_names.get(index).cloned().unwrap_or_default(),
        harness: parent.harness.clone(),
        model: parent.model.clone(),
        labels: req.labels.clone().into_iter().collect(),
        annotations: parent.annotations.clone(),
        origin: parent.origin.clone(),
        identity: None,
        parent_uid: parent.uid.clone(),
        fork_seq: at_seq,
        created_at: now,
        updated_at: now,
        ..Default::default()
    }
}

/// What of a session's row its Session view carries beyond a fixed few hundred bytes: its
/// labels, annotations, origin and names.
fn metadata_bytes(row: &SessionRow) -> usize {
    use prost::Message as _;
    let map = |m: &std::collections::BTreeMap<String, String>| -> usize {
        m.iter().map(|(k, v)| k.len() + v.len() + 8).sum()
    };
    512 + map(&row.labels)
        + map(&row.annotations)
        + row.origin.as_ref().map_or(0, |o| o.encoded_len())
        + row.name.len()
        + row.model.len()
        + row.harness.len()
}
