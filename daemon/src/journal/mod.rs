//! The durable journal: session metadata and each session's hash-chained event log.
//!
//! [`Journal`] is the interface every other part of the daemon uses; [`sqlite::SqliteJournal`]
//! is the embedded backend and [`postgres::PostgresJournal`] the one a fleet of nodes shares,
//! so nothing above this module may assume the journal lives on this node.

pub mod postgres;
pub mod records_json;
pub mod sqlite;
#[cfg(test)]
mod suite;
pub mod verify;

use std::collections::BTreeMap;

use agentvm_proto::canon::CanonError;
use agentvm_proto::v1::{ComputeState, Event, IdentityRef, LogRecord, Origin};

/// What the journal stores about a session besides its log.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SessionRow {
    pub uid: String,
    pub project: String,
    pub name: String,
    pub harness: String,
    pub model: String,
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
    pub origin: Option<Origin>,
    pub identity: Option<IdentityRef>,
    pub parent_uid: String,
    pub fork_seq: i64,
    /// Unix nanoseconds.
    pub created_at: i64,
    pub updated_at: i64,
    /// Projection of the log's lifecycle records, maintained inside each append.
    pub compute_state: ComputeState,
    pub deletion: DeletionState,
    /// Highest fence minted for this session (0 before the first).
    pub fence: i64,
    /// Head of the log (0 when empty).
    pub last_seq: i64,
    /// The node holding the session's compute in a journal a fleet shares (the last to mint
    /// its fence); empty in a node's own journal.
    pub holder: String,
    /// What its log holds: the encoded events (for project quotas; not written on create).
    pub log_bytes: u64,
}

/// A node of a fleet, as its heartbeats in the shared journal describe it.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeEntry {
    pub name: String,
    /// Where its Sessions API listens, for routing a call to it.
    pub address: String,
    /// Its last heartbeat is younger than the lease time.
    pub alive: bool,
    /// How long ago its last heartbeat was, by the database's clock.
    pub heartbeat_age_ms: i64,
    /// What it last reported of itself (JSON).
    pub status: String,
}

/// Who holds a session's compute.
#[derive(Debug, Clone, PartialEq)]
pub enum Holder {
    /// This node, or nobody: this node may act on the session.
    Here,
    /// Another node whose heartbeat is current: calls go there.
    Alive(NodeEntry),
    /// Another node whose heartbeat expired: this node may take the session over (its
    /// next fence supersedes the old holder's).
    Gone(String),
}

/// Ours, not upstream's: a session is deleted by durable intent first, then its compute and
/// snapshots are reclaimed, then it becomes a tombstone that refuses all work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeletionState {
    #[default]
    Active,
    /// Delete requested; reclaiming compute and snapshots.
    Deleting,
    /// Reclaimed; the log is kept for audit per retention policy.
    Deleted,
}

impl DeletionState {
    pub fn as_str(self) -> &'static str {
        match self {
            DeletionState::Active => "ACTIVE",
            DeletionState::Deleting => "DELETING",
            DeletionState::Deleted => "DELETED",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "ACTIVE" => DeletionState::Active,
            "DELETING" => DeletionState::Deleting,
            "DELETED" => DeletionState::Deleted,
            _ => return None,
        })
    }
}

/// A lifecycle operation in progress, written before it acts and removed when it is done, so
/// a daemon that starts after a crash finds every half-done operation and finishes or rolls
/// it back (`session::recovery`). Ours, not upstream's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Operation {
    pub kind: OperationKind,
    pub session: String,
    /// The sessions the operation creates (a fork's children, named before they exist).
    pub children: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OperationKind {
    /// Snapshot the live compute and record SUSPEND (Suspend, a fork's parent, an approval
    /// park).
    Suspend,
    /// Start children from a parent's snapshot and write them. (Starting one session's
    /// compute needs no row here: its VMM directory, made before the VMM, is that intent.)
    Fork,
    Delete,
}

impl OperationKind {
    pub fn as_str(self) -> &'static str {
        match self {
            OperationKind::Suspend => "SUSPEND",
            OperationKind::Fork => "FORK",
            OperationKind::Delete => "DELETE",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "SUSPEND" => OperationKind::Suspend,
            "FORK" => OperationKind::Fork,
            "DELETE" => OperationKind::Delete,
            _ => return None,
        })
    }
}

/// Keyset cursor for listing: strictly after (created_at DESC, uid ASC).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListCursor {
    pub created_at: i64,
    pub uid: String,
}

#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    /// The caller's view of the head is stale (append-CAS lost). Retryable: ABORTED.
    #[error("session {session}: append expected head {expected} but the head is {head}")]
    Conflict {
        session: String,
        expected: i64,
        head: i64,
    },
    /// The appending incarnation was superseded by a newer fence. ABORTED.
    #[error("session {session}: fence {fence} is superseded by fence {current}")]
    Fenced {
        session: String,
        fence: i64,
        current: i64,
    },
    #[error("session {0} not found")]
    NotFound(String),
    #[error("session {0} already exists")]
    AlreadyExists(String),
    #[error("session {session}: {source}")]
    Canon {
        session: String,
        #[source]
        source: CanonError,
    },
    #[error("session {session} seq {seq}: stored event does not decode: {reason}")]
    CorruptRecord {
        session: String,
        seq: i64,
        reason: String,
    },
    #[error("journal schema version {found} is newer than this agentvmd supports ({supported})")]
    SchemaTooNew { found: i64, supported: i64 },
    #[error("journal storage ({context}): {source}")]
    Storage {
        context: String,
        #[source]
        source: rusqlite::Error,
    },
    #[error("journal database ({context}): {source}")]
    Postgres {
        context: String,
        #[source]
        source: tokio_postgres::Error,
    },
    /// Another live node of the fleet holds the session: only it may mint its fences.
    #[error(
        "HeldByAnotherNode: session {session} is held by node {node}, which is alive; send the \
         call there (ListNodes gives its address)"
    )]
    HeldElsewhere { session: String, node: String },
    /// What was asked of the journal cannot be recorded as asked.
    #[error("{0}")]
    InvalidArgument(String),
    /// The journal's database could not be reached (or its connection pool gave up).
    #[error("journal database unreachable ({context}): {reason}")]
    Unavailable { context: String, reason: String },
}

impl JournalError {
    /// The database could not grow (SQLITE_FULL): nothing was written.
    pub fn is_disk_full(&self) -> bool {
        match self {
            JournalError::Storage {
                source: rusqlite::Error::SqliteFailure(e, _),
                ..
            } => e.code == rusqlite::ErrorCode::DiskFull,
            JournalError::Postgres { source, .. } => {
                source.code() == Some(&tokio_postgres::error::SqlState::DISK_FULL)
            }
            _ => false,
        }
    }

    /// Conflicts and fencing are the caller's cue to re-read and retry.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            JournalError::Conflict { .. } | JournalError::Fenced { .. }
        )
    }
}

pub type Result<T, E = JournalError> = std::result::Result<T, E>;

/// What a project's sessions hold in the journal (for its quotas).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProjectUsage {
    pub sessions: u64,
    /// The encoded events of their logs, a forked prefix counted in every copy.
    pub log_bytes: u64,
}

/// A turn's checkpoint: a memory-tier session's memory and disks as they were when the END
/// at `seq` was recorded, which a fork at `seq` starts from. Kept in a side table: the log
/// and its hash chain stay exactly upstream's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointRow {
    pub seq: i64,
    /// Which of the session's turns it ends, counting from 1 (what retention keeps by).
    pub turn: u64,
    /// Where it is: its store directory (`file://…`) or its archive in the fleet's store.
    pub snapshot: String,
    /// SHA-256 of its manifest as sealed in the store: a checkpoint changed since is not it.
    pub manifest_sha256: String,
    /// Bytes its own files take (not its bases').
    pub bytes: u64,
    pub created_at: i64,
}

/// The journal interface. Appends are compare-and-swap on the head and fenced:
/// the CAS is checked first, then the fence (a lower fence is rejected, an equal or higher
/// one accepted; appends never raise the stored fence, only [`Journal::new_fence`] does).
pub trait Journal: Send + Sync {
    /// Stores a new session row. Its log is empty.
    fn create_session(&self, row: &SessionRow) -> Result<()>;

    fn get_session(&self, uid: &str) -> Result<Option<SessionRow>>;

    /// One page of a project's live (not DELETED) sessions, newest first, strictly after `after`.
    fn list_sessions(
        &self,
        project: &str,
        after: Option<&ListCursor>,
        limit: usize,
    ) -> Result<Vec<SessionRow>>;

    /// Every project with a live (not DELETED) session, by name, with how many it has: what
    /// `list_sessions` pages through, project by project.
    fn projects(&self) -> Result<Vec<(String, u64)>>;

    /// What `project`'s live (not DELETED) sessions hold: how many, and their logs' bytes.
    fn project_usage(&self, project: &str) -> Result<ProjectUsage>;

    /// Mints the next fence for the session (first value 1), superseding every lower holder;
    /// this node holds the session from here on.
    fn new_fence(&self, uid: &str) -> Result<i64>;

    /// Appends `events` as consecutive records in one durable transaction (group commit):
    /// all or none. `expected_last_seq` must equal the head; `fence` must not be below the
    /// session's current fence.
    fn append(
        &self,
        uid: &str,
        expected_last_seq: i64,
        fence: i64,
        events: &[Event],
    ) -> Result<Vec<LogRecord>>;

    /// Records with `from_seq <= seq <= to_seq` (`to_seq` 0 = head), in order, exactly as stored.
    fn read(&self, uid: &str, from_seq: i64, to_seq: i64) -> Result<Vec<LogRecord>>;

    /// Starts `child`'s log as a byte-identical copy of `parent`'s records 1..=`upto_seq`
    /// (same seqs and hashes, so the chain becomes a tree). The child row must exist and be
    /// empty.
    fn copy_prefix(&self, parent: &str, child: &str, upto_seq: i64, fence: i64) -> Result<()>;

    /// Writes a fork's children in one durable transaction, all or none: for each, its row,
    /// a copy of `parent`'s records up to `upto_seq` (as `copy_prefix`, under fence 1) and its
    /// own first record `event` after them.
    fn create_children(
        &self,
        parent: &str,
        upto_seq: i64,
        children: &[(SessionRow, Event)],
    ) -> Result<()>;

    fn set_deletion(&self, uid: &str, state: DeletionState) -> Result<()>;

    /// Whether a fork child of `uid` is not DELETED yet: it may restore from `uid`'s
    /// snapshots, or its own may be layered on them.
    fn has_undeleted_children(&self, uid: &str) -> Result<bool>;

    /// Active sessions whose stored compute state is `state`, of those this node holds (in a
    /// journal shared by a fleet: the ones it created or last minted a fence for).
    fn sessions_in_state(&self, state: ComputeState) -> Result<Vec<String>>;

    /// Active sessions this node holds by their stored compute state (for metrics and node
    /// status).
    fn count_by_compute_state(&self) -> Result<Vec<(ComputeState, u64)>>;

    /// Records `uid`'s checkpoint at `row.seq` (which must not be past its head), replacing
    /// one recorded there before.
    fn record_checkpoint(&self, uid: &str, row: &CheckpointRow) -> Result<()>;

    /// `uid`'s checkpoints, by seq.
    fn checkpoints(&self, uid: &str) -> Result<Vec<CheckpointRow>>;

    /// Forgets `uid`'s checkpoints at `drop` and records `replace` (a checkpoint merged into
    /// its successor is dropped and the successor replaced), in one transaction.
    fn retain_checkpoints(&self, uid: &str, drop: &[i64], replace: &[CheckpointRow]) -> Result<()>;

    /// Records that `op` is about to act (durably, before it does); returns its id.
    fn begin_operation(&self, op: &Operation) -> Result<i64>;

    /// The operation `id` is complete, or was rolled back.
    fn end_operation(&self, id: i64) -> Result<()>;

    /// Operations begun and never ended, oldest first.
    fn open_operations(&self) -> Result<Vec<(i64, Operation)>>;

    /// Who holds `row`'s compute. A journal of one node's own: always this node.
    fn holder_of(&self, row: &SessionRow) -> Result<Holder> {
        let _ = row;
        Ok(Holder::Here)
    }

    /// Records that this node is alive, where it listens and what it reports of itself.
    /// A journal of one node's own has no fleet to tell.
    fn heartbeat(&self, address: &str, status: &str) -> Result<()> {
        let _ = (address, status);
        Ok(())
    }

    /// The fleet's nodes, by name.
    fn nodes(&self) -> Result<Vec<NodeEntry>> {
        Ok(Vec::new())
    }

    /// Lets go of every session this node holds without running compute (after a drain
    /// suspended them): any node may take each at its next call. Returns how many.
    fn release_held(&self) -> Result<u64> {
        Ok(0)
    }

    /// Lets go of `uid` if this node holds it and its compute is not LIVE (it was just
    /// suspended): any node may take it at its next call.
    fn release(&self, uid: &str) -> Result<()> {
        let _ = uid;
        Ok(())
    }
}

/// What every backend refuses to record as a checkpoint of a session whose head is `head`.
fn check_checkpoint(uid: &str, row: &CheckpointRow, head: i64) -> Result<()> {
    if row.seq < 1 || row.seq > head {
        return Err(JournalError::InvalidArgument(format!(
            "checkpoint of {uid} at seq {}: its log runs 1..={head}",
            row.seq
        )));
    }
    if row.snapshot.is_empty() {
        return Err(JournalError::InvalidArgument(format!(
            "checkpoint of {uid} at seq {}: no snapshot named",
            row.seq
        )));
    }
    Ok(())
}

/// Runs one backend's append, timing it into the append metric when it succeeds.
fn timed_append(append: impl FnOnce() -> Result<Vec<LogRecord>>) -> Result<Vec<LogRecord>> {
    let started = std::time::Instant::now();
    let result = append();
    if result.is_ok() {
        crate::metrics::global()
            .journal_append
            .observe(started.elapsed());
    }
    result
}

/// The last seq a read covers (`to_seq` 0 or below: the head).
fn read_upto(to_seq: i64) -> i64 {
    if to_seq <= 0 { i64::MAX } else { to_seq }
}

/// The head of one session as a backend reads it inside a write transaction.
struct Head {
    fence: i64,
    last_seq: i64,
    head_hash: String,
    compute_state: ComputeState,
}

/// What appending `events` to `uid` at `head` writes: checked first (the CAS, then the
/// fence, so a stale caller learns it is stale before it learns it was superseded:
/// semantics.md §1.4), then each event hashed into the chain. Returns the records and the
/// compute state they leave the session in.
fn chain_onto(
    uid: &str,
    head: Head,
    expected_last_seq: i64,
    fence: i64,
    events: &[Event],
) -> Result<(Vec<LogRecord>, ComputeState)> {
    if expected_last_seq != head.last_seq {
        return Err(JournalError::Conflict {
            session: uid.to_owned(),
            expected: expected_last_seq,
            head: head.last_seq,
        });
    }
    if fence < head.fence {
        return Err(JournalError::Fenced {
            session: uid.to_owned(),
            fence,
            current: head.fence,
        });
    }
    let mut records = Vec::with_capacity(events.len());
    let (mut prev, mut seq, mut compute) = (head.head_hash, head.last_seq, head.compute_state);
    for event in events {
        seq += 1;
        let hash = agentvm_proto::canon::content_hash(seq, &prev, event).map_err(|source| {
            JournalError::Canon {
                session: uid.to_owned(),
                source,
            }
        })?;
        compute = project_compute_state(compute, event);
        records.push(LogRecord {
            seq,
            prev_hash: std::mem::replace(&mut prev, hash.clone()),
            content_hash: hash,
            fence,
            event: Some(event.clone()),
        });
    }
    Ok((records, compute))
}

/// A fork copy of `parent`'s records 1..=`upto_seq` needs an empty child and a prefix the
/// parent has.
fn check_copy(
    parent: &str,
    parent_last_seq: i64,
    child: &str,
    child_last_seq: i64,
    upto_seq: i64,
) -> Result<()> {
    if child_last_seq != 0 {
        return Err(JournalError::Conflict {
            session: child.to_owned(),
            expected: 0,
            head: child_last_seq,
        });
    }
    if upto_seq > parent_last_seq || upto_seq < 0 {
        return Err(JournalError::Conflict {
            session: parent.to_owned(),
            expected: upto_seq,
            head: parent_last_seq,
        });
    }
    Ok(())
}

/// A copy that moved other than `upto_seq` records found a hole in the parent's log:
/// refused rather than fork a broken chain.
fn check_copied(parent: &str, upto_seq: i64, copied: u64) -> Result<()> {
    if copied as i64 != upto_seq {
        return Err(JournalError::CorruptRecord {
            session: parent.to_owned(),
            seq: upto_seq,
            reason: format!("expected {upto_seq} records up to seq {upto_seq}, found {copied}"),
        });
    }
    Ok(())
}

/// A stored record as the log holds it; an event blob that no longer decodes is reported
/// with where it sits.
fn decode_record(
    uid: &str,
    seq: i64,
    prev_hash: String,
    content_hash: String,
    fence: i64,
    blob: &[u8],
) -> Result<LogRecord> {
    use prost::Message;
    let event = Event::decode(blob).map_err(|e| JournalError::CorruptRecord {
        session: uid.to_owned(),
        seq,
        reason: e.to_string(),
    })?;
    Ok(LogRecord {
        seq,
        prev_hash,
        content_hash,
        fence,
        event: Some(event),
    })
}

/// Labels and annotations as both backends store them: a JSON object.
fn json_map(m: &BTreeMap<String, String>) -> String {
    serde_json::to_string(m).expect("a string map always serializes")
}

/// How one event moves the `compute_state` projection (semantics.md §1.5).
pub fn project_compute_state(current: ComputeState, event: &Event) -> ComputeState {
    use agentvm_proto::v1::{EventKind, event::Body, lifecycle::Kind};
    if event.kind != EventKind::EventLifecycle as i32 {
        return ComputeState::ComputeLive;
    }
    match &event.body {
        Some(Body::Lifecycle(l)) => match Kind::try_from(l.kind) {
            Ok(Kind::LifecycleSuspend | Kind::LifecycleFork) => ComputeState::ComputeCold,
            Ok(Kind::LifecycleResume) => ComputeState::ComputeLive,
            _ => current,
        },
        _ => current,
    }
}
