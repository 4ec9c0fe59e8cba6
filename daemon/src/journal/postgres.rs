//! The fleet's journal backend: PostgreSQL, shared by every node.
//!
//! Same tables, columns, records and hashes as the sqlite backend, byte for byte (events as
//! proto binary under upstream's column names). An append is one transaction that locks the
//! session's row (`FOR UPDATE`), checks the head (CAS) and then the fence, inserts the records
//! and moves the head, so two nodes appending to one session serialize on that row and the
//! loser gets `Conflict` or `Fenced`. Commits are durable when they return (the server's
//! `synchronous_commit`); appends of different sessions run on separate pooled connections,
//! and the server flushes concurrent commits together (its own group commit).
//!
//! Each session has a holder: the node that created it or last minted its fence. Node-wide
//! views (`sessions_in_state`, `count_by_compute_state`: what a node recovers, suspends and
//! reports at start and stop) are the holder's alone, and lifecycle intents (`operations`)
//! belong to the node that began them, so a node never settles another node's sessions.

mod bridge;
mod harnesses;
mod schema;

use std::collections::BTreeMap;

use agentvm_proto::v1::{ComputeState, Event, IdentityRef, LogRecord, Origin};
use deadpool_postgres::{GenericClient, Manager, ManagerConfig, Pool, RecyclingMethod};
use prost::Message;
use tokio_postgres::Row;

pub use self::schema::SCHEMA_VERSION;
use super::{
    CheckpointRow, DeletionState, Head, Holder, Journal, JournalError, ListCursor, NodeEntry,
    Operation, OperationKind, ProjectUsage, Result, SessionRow, chain_onto, check_checkpoint,
    check_copied, check_copy, decode_record, json_map, read_upto, timed_append,
};
use crate::clock::now_nanos;
use bridge::Bridge;

/// Connections a node keeps to the database at most.
const POOL_SIZE: usize = 16;
/// How long a call waits for a connection (a free one, or a new one to connect) before the
/// journal counts as unreachable: an unreachable database fails calls, it does not hang
/// them.
const CONNECTION_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

pub struct PostgresJournal {
    pool: Pool,
    node: String,
    /// A node whose last heartbeat is older than this has lost its sessions.
    lease: std::time::Duration,
    bridge: Bridge,
}

/// The default lease: a node missing heartbeats this long is taken for dead.
pub const DEFAULT_LEASE: std::time::Duration = std::time::Duration::from_secs(15);

/// The database's clock in nanoseconds: every node's heartbeat and every lease check read
/// the same clock, so the nodes' own clocks may disagree.
macro_rules! db_now {
    () => {
        "(extract(epoch from clock_timestamp()) * 1000000000)::bigint"
    };
}
const DB_NOW: &str = db_now!();

/// What `node_from` reads: a node's name, address, heartbeat age and status.
const NODE_COLUMNS: &str = concat!("name, address, ", db_now!(), " - heartbeat_at, status");

fn node_from(row: &Row, lease: std::time::Duration) -> NodeEntry {
    let age_ns: i64 = row.get(2);
    NodeEntry {
        name: row.get(0),
        address: row.get(1),
        alive: u128::try_from(age_ns).unwrap_or(0) < lease.as_nanos(),
        heartbeat_age_ms: age_ns / 1_000_000,
        status: row.get(3),
    }
}

/// Maps a database error, saying what was being done.
fn pg(context: impl Into<String>) -> impl FnOnce(tokio_postgres::Error) -> JournalError {
    let context = context.into();
    move |source| JournalError::Postgres { context, source }
}

async fn connection(pool: &Pool, context: &str) -> Result<deadpool_postgres::Object> {
    pool.get().await.map_err(|e| match e {
        deadpool_postgres::PoolError::Backend(source) => JournalError::Postgres {
            context: context.to_owned(),
            source,
        },
        other => JournalError::Unavailable {
            context: context.to_owned(),
            reason: other.to_string(),
        },
    })
}

impl PostgresJournal {
    /// Connects to the database at `url` (`postgres://user:password@host:port/db`, or
    /// `postgresql:///db?host=/run/postgresql` for a unix socket) as node `node`, and brings
    /// its schema up to date.
    pub fn connect(url: &str, node: &str) -> Result<Self> {
        let config: tokio_postgres::Config = url.parse().map_err(pg("parse --journal-url"))?;
        let manager = Manager::from_config(
            config,
            tokio_postgres::NoTls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let bridge = Bridge::new()?;
        let pool = {
            let _entered = bridge.enter();
            Pool::builder(manager)
                .max_size(POOL_SIZE)
                .wait_timeout(Some(CONNECTION_TIMEOUT))
                .create_timeout(Some(CONNECTION_TIMEOUT))
                .recycle_timeout(Some(CONNECTION_TIMEOUT))
                .runtime(deadpool_postgres::Runtime::Tokio1)
                .build()
                .map_err(|e| JournalError::Unavailable {
                    context: "building the connection pool".into(),
                    reason: e.to_string(),
                })?
        };
        let migrating = pool.clone();
        bridge.run(async move {
            let mut client = connection(&migrating, "connect to the journal database").await?;
            schema::migrate(&mut client).await
        })?;
        Ok(Self {
            pool,
            node: node.to_owned(),
            lease: DEFAULT_LEASE,
            bridge,
        })
    }

    /// How long a node may miss heartbeats before its sessions may be taken over.
    pub fn with_lease(mut self, lease: std::time::Duration) -> Self {
        self.lease = lease;
        self
    }

    /// Runs `work` with a pooled connection.
    fn with<T, F, Fut>(&self, context: &'static str, work: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(deadpool_postgres::Object) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = Result<T>> + Send,
    {
        let pool = self.pool.clone();
        self.bridge.run(async move {
            let client = connection(&pool, context).await?;
            work(client).await
        })
    }
}

const SESSION_COLUMNS: &str = "session, fence, project, name, harness, model, parent_uid, fork_seq,
    compute_state, created_at, updated_at, labels, annotations, origin, identity,
    deletion_state, last_seq, holder, log_bytes";

fn session_from(row: &Row) -> Result<SessionRow> {
    let uid: String = row.try_get(0).map_err(pg("decode a session row"))?;
    let get = |what: &str, reason: String| JournalError::CorruptRecord {
        session: uid.clone(),
        seq: 0,
        reason: format!("{what}: {reason}"),
    };
    let text = |i: usize| -> Result<String> { row.try_get(i).map_err(pg("decode a session row")) };
    let int = |i: usize| -> Result<i64> { row.try_get(i).map_err(pg("decode a session row")) };
    let blob = |i: usize| -> Result<Option<Vec<u8>>> {
        row.try_get(i).map_err(pg("decode a session row"))
    };
    let map = |i: usize, what: &str| -> Result<BTreeMap<String, String>> {
        serde_json::from_str(&text(i)?).map_err(|e| get(what, e.to_string()))
    };
    let compute: i32 = row.try_get(8).map_err(pg("decode a session row"))?;
    let deletion = text(15)?;
    Ok(SessionRow {
        fence: int(1)?,
        project: text(2)?,
        name: text(3)?,
        harness: text(4)?,
        model: text(5)?,
        parent_uid: text(6)?,
        fork_seq: int(7)?,
        compute_state: ComputeState::try_from(compute).unwrap_or(ComputeState::Unspecified),
        created_at: int(9)?,
        updated_at: int(10)?,
        labels: map(11, "labels")?,
        annotations: map(12, "annotations")?,
        origin: blob(13)?
            .map(|b| Origin::decode(b.as_slice()))
            .transpose()
            .map_err(|e| get("origin", e.to_string()))?,
        identity: blob(14)?
            .map(|b| IdentityRef::decode(b.as_slice()))
            .transpose()
            .map_err(|e| get("identity", e.to_string()))?,
        deletion: DeletionState::parse(&deletion)
            .ok_or_else(|| get("deletion state", format!("unknown {deletion:?}")))?,
        last_seq: int(16)?,
        holder: text(17)?,
        log_bytes: int(18)? as u64,
        uid,
    })
}

async fn lock_head(tx: &impl GenericClient, uid: &str) -> Result<Head> {
    let statement = tx
        .prepare_cached(
            "SELECT fence, last_seq, head_hash, compute_state FROM sessions
             WHERE session = $1 FOR UPDATE",
        )
        .await
        .map_err(pg("prepare reading a head"))?;
    let row = tx
        .query_opt(&statement, &[&uid])
        .await
        .map_err(pg(format!("read head of {uid}")))?
        .ok_or_else(|| JournalError::NotFound(uid.to_owned()))?;
    Ok(Head {
        fence: row.get(0),
        last_seq: row.get(1),
        head_hash: row.get(2),
        compute_state: ComputeState::try_from(row.get::<_, i32>(3))
            .unwrap_or(ComputeState::Unspecified),
    })
}

async fn append_in(
    tx: &impl GenericClient,
    uid: &str,
    expected_last_seq: i64,
    fence: i64,
    events: &[Event],
) -> Result<Vec<LogRecord>> {
    let head = lock_head(tx, uid).await?;
    let (last_seq, head_hash) = (head.last_seq, head.head_hash.clone());
    let (records, compute) = chain_onto(uid, head, expected_last_seq, fence, events)?;
    let insert = tx
        .prepare_cached(
            "INSERT INTO events (session, seq, prev_hash, hash, fence, event)
             VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .await
        .map_err(pg("prepare appending"))?;
    let mut added = 0i64;
    for r in &records {
        let event = r
            .event
            .as_ref()
            .map(Message::encode_to_vec)
            .unwrap_or_default();
        added += event.len() as i64;
        tx.execute(
            &insert,
            &[&uid, &r.seq, &r.prev_hash, &r.content_hash, &fence, &event],
        )
        .await
        .map_err(pg(format!("append seq {} to {uid}", r.seq)))?;
    }
    let (seq, hash) = records
        .last()
        .map_or((last_seq, head_hash), |r| (r.seq, r.content_hash.clone()));
    let advance = tx
        .prepare_cached(
            "UPDATE sessions SET last_seq = $2, head_hash = $3, compute_state = $4,
             updated_at = $5, log_bytes = log_bytes + $6 WHERE session = $1",
        )
        .await
        .map_err(pg("prepare advancing a head"))?;
    tx.execute(
        &advance,
        &[&uid, &seq, &hash, &(compute as i32), &now_nanos(), &added],
    )
    .await
    .map_err(pg(format!("advance head of {uid}")))?;
    Ok(records)
}

/// Creates `row`, held by `node`.
async fn insert_session(tx: &impl GenericClient, row: &SessionRow, node: &str) -> Result<()> {
    let inserted = tx
        .execute(
            "INSERT INTO sessions (session, fence, project, name, harness, model, parent_uid,
                fork_seq, compute_state, created_at, updated_at, labels, annotations, origin,
                identity, deletion_state, last_seq, head_hash, holder)
             VALUES ($1, 0, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, 0, '',
                $16)
             ON CONFLICT (session) DO NOTHING",
            &[
                &row.uid,
                &row.project,
                &row.name,
                &row.harness,
                &row.model,
                &row.parent_uid,
                &row.fork_seq,
                &(row.compute_state as i32),
                &row.created_at,
                &row.updated_at,
                &json_map(&row.labels),
                &json_map(&row.annotations),
                &row.origin.as_ref().map(Message::encode_to_vec),
                &row.identity.as_ref().map(Message::encode_to_vec),
                &row.deletion.as_str(),
                &node,
            ],
        )
        .await
        .map_err(pg(format!("create session {}", row.uid)))?;
    if inserted == 0 {
        return Err(JournalError::AlreadyExists(row.uid.clone()));
    }
    Ok(())
}

/// Copies `parent`'s records 1..=`upto_seq` into `child` (empty), byte for byte.
async fn copy_in(
    tx: &impl GenericClient,
    parent: &str,
    child: &str,
    upto_seq: i64,
    fence: i64,
) -> Result<()> {
    let parent_head = lock_head(tx, parent).await?;
    let child_head = lock_head(tx, child).await?;
    check_copy(
        parent,
        parent_head.last_seq,
        child,
        child_head.last_seq,
        upto_seq,
    )?;
    let copied = tx
        .execute(
            "INSERT INTO events (session, seq, prev_hash, hash, fence, event)
             SELECT $2, seq, prev_hash, hash, $4, event FROM events
             WHERE session = $1 AND seq <= $3",
            &[&parent, &child, &upto_seq, &fence],
        )
        .await
        .map_err(pg(format!("copy {parent}@{upto_seq} into {child}")))?;
    check_copied(parent, upto_seq, copied)?;
    let head_hash: String = match upto_seq {
        0 => String::new(),
        _ => tx
            .query_one(
                "SELECT hash FROM events WHERE session = $1 AND seq = $2",
                &[&parent, &upto_seq],
            )
            .await
            .map_err(pg(format!("read {parent}@{upto_seq}")))?
            .get(0),
    };
    tx.execute(
        "UPDATE sessions SET last_seq = $2, head_hash = $3, updated_at = $4,
             fence = GREATEST(fence, $5),
             log_bytes = (SELECT COALESCE(SUM(length(event)), 0)::BIGINT FROM events
                          WHERE session = $1)
         WHERE session = $1",
        &[&child, &upto_seq, &head_hash, &now_nanos(), &fence],
    )
    .await
    .map_err(pg(format!("advance head of {child}")))?;
    Ok(())
}

impl Journal for PostgresJournal {
    fn create_session(&self, row: &SessionRow) -> Result<()> {
        let row = row.clone();
        let node = self.node.clone();
        self.with("create a session", move |client| async move {
            insert_session(&client, &row, &node).await
        })
    }

    fn get_session(&self, uid: &str) -> Result<Option<SessionRow>> {
        let uid = uid.to_owned();
        self.with("get a session", move |client| async move {
            let statement = client
                .prepare_cached(&format!(
                    "SELECT {SESSION_COLUMNS} FROM sessions WHERE session = $1"
                ))
                .await
                .map_err(pg("prepare getting a session"))?;
            client
                .query_opt(&statement, &[&uid])
                .await
                .map_err(pg(format!("get session {uid}")))?
                .as_ref()
                .map(session_from)
                .transpose()
        })
    }

    fn projects(&self) -> Result<Vec<(String, u64)>> {
        self.with("list projects", move |client| async move {
            Ok(client
                .query(
                    "SELECT project, COUNT(*) FROM sessions WHERE deletion_state != 'DELETED'
                     GROUP BY project ORDER BY project",
                    &[],
                )
                .await
                .map_err(pg("list projects"))?
                .iter()
                .map(|r| (r.get::<_, String>(0), r.get::<_, i64>(1) as u64))
                .collect())
        })
    }

    fn project_usage(&self, project: &str) -> Result<ProjectUsage> {
        let project = project.to_owned();
        self.with("read a project's usage", move |client| async move {
            let row = client
                .query_one(
                    "SELECT COUNT(*), COALESCE(SUM(log_bytes), 0)::BIGINT FROM sessions
                     WHERE project = $1 AND deletion_state != 'DELETED'",
                    &[&project],
                )
                .await
                .map_err(pg(format!("usage of project {project}")))?;
            Ok(ProjectUsage {
                sessions: row.get::<_, i64>(0) as u64,
                log_bytes: row.get::<_, i64>(1) as u64,
            })
        })
    }

    fn list_sessions(
        &self,
        project: &str,
        after: Option<&ListCursor>,
        limit: usize,
    ) -> Result<Vec<SessionRow>> {
        let project = project.to_owned();
        let after = after.cloned();
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        self.with("list sessions", move |client| async move {
            let rows = match after {
                None => {
                    client
                        .query(
                            &format!(
                                "SELECT {SESSION_COLUMNS} FROM sessions WHERE project = $1
                                   AND deletion_state != 'DELETED'
                                 ORDER BY created_at DESC, session ASC LIMIT $2"
                            ),
                            &[&project, &limit],
                        )
                        .await
                }
                Some(c) => {
                    client
                        .query(
                            &format!(
                                "SELECT {SESSION_COLUMNS} FROM sessions WHERE project = $1
                                   AND deletion_state != 'DELETED'
                                   AND (created_at < $2 OR (created_at = $2 AND session > $3))
                                 ORDER BY created_at DESC, session ASC LIMIT $4"
                            ),
                            &[&project, &c.created_at, &c.uid, &limit],
                        )
                        .await
                }
            }
            .map_err(pg(format!("list sessions of project {project}")))?;
            rows.iter().map(session_from).collect()
        })
    }

    /// Also makes this node the session's holder: from here on its node-wide sweeps are
    /// this node's, and another node's writes under an older fence are refused. Only a
    /// session nobody holds, this node holds, or whose holder's heartbeats stopped for a
    /// lease can be taken: of two nodes racing for one session, one gets it and the other
    /// `HeldElsewhere`, in one statement.
    fn new_fence(&self, uid: &str) -> Result<i64> {
        let uid = uid.to_owned();
        let node = self.node.clone();
        let lease_ns = i64::try_from(self.lease.as_nanos()).unwrap_or(i64::MAX);
        self.with("mint a fence", move |client| async move {
            let minted = client
                .query_opt(
                    &format!(
                        "UPDATE sessions SET fence = fence + 1, updated_at = $2, holder = $3
                         WHERE session = $1 AND (holder = '' OR holder = $3 OR NOT EXISTS (
                           SELECT 1 FROM nodes WHERE nodes.name = sessions.holder
                             AND nodes.heartbeat_at > {DB_NOW} - $4))
                         RETURNING fence"
                    ),
                    &[&uid, &now_nanos(), &node, &lease_ns],
                )
                .await
                .map_err(pg(format!("mint fence for {uid}")))?;
            if let Some(row) = minted {
                return Ok(row.get(0));
            }
            let holder = client
                .query_opt("SELECT holder FROM sessions WHERE session = $1", &[&uid])
                .await
                .map_err(pg(format!("read the holder of {uid}")))?;
            match holder {
                None => Err(JournalError::NotFound(uid)),
                Some(row) => Err(JournalError::HeldElsewhere {
                    session: uid,
                    node: row.get(0),
                }),
            }
        })
    }

    fn append(
        &self,
        uid: &str,
        expected_last_seq: i64,
        fence: i64,
        events: &[Event],
    ) -> Result<Vec<LogRecord>> {
        let uid = uid.to_owned();
        let events = events.to_vec();
        timed_append(|| {
            self.with("append", move |mut client| async move {
                let tx = client
                    .transaction()
                    .await
                    .map_err(pg(format!("begin append to {uid}")))?;
                let records = append_in(&tx, &uid, expected_last_seq, fence, &events).await?;
                tx.commit()
                    .await
                    .map_err(pg(format!("commit append to {uid}")))?;
                Ok(records)
            })
        })
    }

    fn read(&self, uid: &str, from_seq: i64, to_seq: i64) -> Result<Vec<LogRecord>> {
        let uid = uid.to_owned();
        let to = read_upto(to_seq);
        self.with("read a log", move |client| async move {
            let statement = client
                .prepare_cached(
                    "SELECT seq, prev_hash, hash, fence, event FROM events
                     WHERE session = $1 AND seq >= $2 AND seq <= $3 ORDER BY seq",
                )
                .await
                .map_err(pg("prepare reading a log"))?;
            let rows = client
                .query(&statement, &[&uid, &from_seq.max(1), &to])
                .await
                .map_err(pg(format!("read log of {uid}")))?;
            rows.iter()
                .map(|r| {
                    let blob: Vec<u8> = r.get(4);
                    decode_record(&uid, r.get(0), r.get(1), r.get(2), r.get(3), &blob)
                })
                .collect()
        })
    }

    fn copy_prefix(&self, parent: &str, child: &str, upto_seq: i64, fence: i64) -> Result<()> {
        let (parent, child) = (parent.to_owned(), child.to_owned());
        self.with("copy a log", move |mut client| async move {
            let tx = client
                .transaction()
                .await
                .map_err(pg(format!("begin fork copy {parent} -> {child}")))?;
            copy_in(&tx, &parent, &child, upto_seq, fence).await?;
            tx.commit()
                .await
                .map_err(pg(format!("commit fork copy {parent} -> {child}")))
        })
    }

    fn create_children(
        &self,
        parent: &str,
        upto_seq: i64,
        children: &[(SessionRow, Event)],
    ) -> Result<()> {
        let parent = parent.to_owned();
        let children = children.to_vec();
        let node = self.node.clone();
        self.with("write fork children", move |mut client| async move {
            let tx = client
                .transaction()
                .await
                .map_err(pg(format!("begin writing the children of {parent}")))?;
            for (row, first) in &children {
                insert_session(&tx, row, &node).await?;
                // The child's first writer: fence 1, as `new_fence` would mint it.
                copy_in(&tx, &parent, &row.uid, upto_seq, 1).await?;
                append_in(&tx, &row.uid, upto_seq, 1, std::slice::from_ref(first)).await?;
            }
            tx.commit()
                .await
                .map_err(pg(format!("commit the children of {parent}")))
        })
    }

    fn set_deletion(&self, uid: &str, state: DeletionState) -> Result<()> {
        let uid = uid.to_owned();
        self.with("set a deletion state", move |client| async move {
            let n = client
                .execute(
                    "UPDATE sessions SET deletion_state = $2, updated_at = $3 WHERE session = $1",
                    &[&uid, &state.as_str(), &now_nanos()],
                )
                .await
                .map_err(pg(format!("set deletion state of {uid}")))?;
            if n == 0 {
                return Err(JournalError::NotFound(uid));
            }
            Ok(())
        })
    }

    fn record_checkpoint(&self, uid: &str, row: &CheckpointRow) -> Result<()> {
        let (uid, row) = (uid.to_owned(), row.clone());
        self.with("record a checkpoint", move |client| async move {
            let head = client
                .query_opt("SELECT last_seq FROM sessions WHERE session = $1", &[&uid])
                .await
                .map_err(pg(format!("read the head of {uid}")))?
                .map(|r| r.get::<_, i64>(0))
                .ok_or_else(|| JournalError::NotFound(uid.clone()))?;
            check_checkpoint(&uid, &row, head)?;
            let bytes = i64::try_from(row.bytes).unwrap_or(i64::MAX);
            let turn = i64::try_from(row.turn).unwrap_or(i64::MAX);
            client
                .execute(
                    "INSERT INTO checkpoints
                         (session, seq, snapshot, manifest_sha256, bytes, created_at, turn)
                     VALUES ($1, $2, $3, $4, $5, $6, $7)
                     ON CONFLICT (session, seq) DO UPDATE SET snapshot = EXCLUDED.snapshot,
                         manifest_sha256 = EXCLUDED.manifest_sha256, bytes = EXCLUDED.bytes,
                         created_at = EXCLUDED.created_at, turn = EXCLUDED.turn",
                    &[
                        &uid,
                        &row.seq,
                        &row.snapshot,
                        &row.manifest_sha256,
                        &bytes,
                        &row.created_at,
                        &turn,
                    ],
                )
                .await
                .map_err(pg(format!("record checkpoint {uid}@{}", row.seq)))?;
            Ok(())
        })
    }

    fn checkpoints(&self, uid: &str) -> Result<Vec<CheckpointRow>> {
        let uid = uid.to_owned();
        self.with("list checkpoints", move |client| async move {
            let rows = client
                .query(
                    "SELECT seq, snapshot, manifest_sha256, bytes, created_at, turn FROM checkpoints
                     WHERE session = $1 ORDER BY seq",
                    &[&uid],
                )
                .await
                .map_err(pg(format!("list the checkpoints of {uid}")))?;
            Ok(rows
                .iter()
                .map(|r| CheckpointRow {
                    seq: r.get(0),
                    snapshot: r.get(1),
                    manifest_sha256: r.get(2),
                    bytes: r.get::<_, i64>(3).max(0) as u64,
                    created_at: r.get(4),
                    turn: r.get::<_, i64>(5).max(0) as u64,
                })
                .collect())
        })
    }

    fn retain_checkpoints(&self, uid: &str, drop: &[i64], replace: &[CheckpointRow]) -> Result<()> {
        let (uid, drop, replace) = (uid.to_owned(), drop.to_vec(), replace.to_vec());
        self.with("retain checkpoints", move |mut client| async move {
            let tx = client
                .transaction()
                .await
                .map_err(pg(format!("retain the checkpoints of {uid}")))?;
            for seq in &drop {
                tx.execute(
                    "DELETE FROM checkpoints WHERE session = $1 AND seq = $2",
                    &[&uid, seq],
                )
                .await
                .map_err(pg(format!("drop checkpoint {uid}@{seq}")))?;
            }
            for row in &replace {
                let bytes = i64::try_from(row.bytes).unwrap_or(i64::MAX);
                let n = tx
                    .execute(
                        "UPDATE checkpoints SET snapshot = $3, manifest_sha256 = $4, bytes = $5
                         WHERE session = $1 AND seq = $2",
                        &[&uid, &row.seq, &row.snapshot, &row.manifest_sha256, &bytes],
                    )
                    .await
                    .map_err(pg(format!("replace checkpoint {uid}@{}", row.seq)))?;
                if n == 0 {
                    return Err(JournalError::NotFound(format!(
                        "checkpoint {uid}@{}",
                        row.seq
                    )));
                }
            }
            tx.commit()
                .await
                .map_err(pg(format!("retain the checkpoints of {uid}")))
        })
    }

    fn has_undeleted_children(&self, uid: &str) -> Result<bool> {
        let uid = uid.to_owned();
        self.with("look for children", move |client| async move {
            client
                .query_one(
                    "SELECT EXISTS (SELECT 1 FROM sessions WHERE parent_uid = $1
                       AND deletion_state <> 'DELETED')",
                    &[&uid],
                )
                .await
                .map(|row| row.get(0))
                .map_err(pg(format!("look for children of {uid}")))
        })
    }

    fn sessions_in_state(&self, state: ComputeState) -> Result<Vec<String>> {
        let node = self.node.clone();
        self.with("list sessions by state", move |client| async move {
            Ok(client
                .query(
                    "SELECT session FROM sessions WHERE holder = $2
                       AND deletion_state = 'ACTIVE' AND compute_state = $1 ORDER BY session",
                    &[&(state as i32), &node],
                )
                .await
                .map_err(pg("list sessions by compute state"))?
                .iter()
                .map(|r| r.get(0))
                .collect())
        })
    }

    fn count_by_compute_state(&self) -> Result<Vec<(ComputeState, u64)>> {
        let node = self.node.clone();
        self.with("count sessions by state", move |client| async move {
            Ok(client
                .query(
                    "SELECT compute_state, COUNT(*) FROM sessions
                     WHERE holder = $1 AND deletion_state = 'ACTIVE'
                     GROUP BY compute_state ORDER BY compute_state",
                    &[&node],
                )
                .await
                .map_err(pg("count sessions by compute state"))?
                .iter()
                .map(|r| {
                    (
                        ComputeState::try_from(r.get::<_, i32>(0))
                            .unwrap_or(ComputeState::ComputeNone),
                        r.get::<_, i64>(1) as u64,
                    )
                })
                .collect())
        })
    }

    fn begin_operation(&self, op: &Operation) -> Result<i64> {
        let op = op.clone();
        let node = self.node.clone();
        self.with("record an intent", move |client| async move {
            Ok(client
                .query_one(
                    "INSERT INTO operations (node, kind, session, children, started_at)
                     VALUES ($1, $2, $3, $4, $5) RETURNING id",
                    &[
                        &node,
                        &op.kind.as_str(),
                        &op.session,
                        &op.children.join(" "),
                        &now_nanos(),
                    ],
                )
                .await
                .map_err(pg(format!(
                    "record the {} intent of {}",
                    op.kind.as_str(),
                    op.session
                )))?
                .get(0))
        })
    }

    fn end_operation(&self, id: i64) -> Result<()> {
        self.with("end an intent", move |client| async move {
            client
                .execute("DELETE FROM operations WHERE id = $1", &[&id])
                .await
                .map_err(pg(format!("end operation {id}")))?;
            Ok(())
        })
    }

    fn holder_of(&self, row: &SessionRow) -> Result<Holder> {
        self.holder(row)
    }

    fn heartbeat(&self, address: &str, status: &str) -> Result<()> {
        self.beat(address, status)
    }

    fn nodes(&self) -> Result<Vec<NodeEntry>> {
        self.fleet()
    }

    fn release(&self, uid: &str) -> Result<()> {
        let (node, uid) = (self.node.clone(), uid.to_owned());
        self.with("release a session", move |client| async move {
            client
                .execute(
                    "UPDATE sessions SET holder = '' WHERE session = $1 AND holder = $2
                       AND compute_state != $3",
                    &[&uid, &node, &(ComputeState::ComputeLive as i32)],
                )
                .await
                .map_err(pg(format!("release {uid}")))?;
            Ok(())
        })
    }

    fn release_held(&self) -> Result<u64> {
        let node = self.node.clone();
        self.with("release held sessions", move |client| async move {
            client
                .execute(
                    "UPDATE sessions SET holder = '' WHERE holder = $1 AND compute_state != $2",
                    &[&node, &(ComputeState::ComputeLive as i32)],
                )
                .await
                .map_err(pg(format!("release the sessions of {node}")))
        })
    }

    fn open_operations(&self) -> Result<Vec<(i64, Operation)>> {
        let node = self.node.clone();
        self.with("list open intents", move |client| async move {
            let rows = client
                .query(
                    "SELECT id, kind, session, children FROM operations WHERE node = $1
                     ORDER BY id",
                    &[&node],
                )
                .await
                .map_err(pg("list open operations"))?;
            Ok(rows
                .iter()
                .filter_map(|r| {
                    let kind = OperationKind::parse(r.get(1))?;
                    let children: String = r.get(3);
                    Some((
                        r.get(0),
                        Operation {
                            kind,
                            session: r.get(2),
                            children: children.split_whitespace().map(str::to_owned).collect(),
                        },
                    ))
                })
                .collect())
        })
    }
}

/// The fleet side of the journal: who holds what, and who is alive.
impl PostgresJournal {
    fn node_entry(&self, name: &str) -> Result<Option<NodeEntry>> {
        let name = name.to_owned();
        let lease = self.lease;
        self.with("look up a node", move |client| async move {
            Ok(client
                .query_opt(
                    &format!("SELECT {NODE_COLUMNS} FROM nodes WHERE name = $1"),
                    &[&name],
                )
                .await
                .map_err(pg(format!("look up node {name}")))?
                .map(|row| node_from(&row, lease)))
        })
    }

    fn holder(&self, row: &SessionRow) -> Result<Holder> {
        if row.holder.is_empty() || row.holder == self.node {
            return Ok(Holder::Here);
        }
        Ok(match self.node_entry(&row.holder)? {
            Some(node) if node.alive => Holder::Alive(node),
            _ => Holder::Gone(row.holder.clone()),
        })
    }

    fn beat(&self, address: &str, status: &str) -> Result<()> {
        let (node, address, status) = (self.node.clone(), address.to_owned(), status.to_owned());
        self.with("heartbeat", move |client| async move {
            client
                .execute(
                    &format!(
                        "INSERT INTO nodes (name, address, heartbeat_at, status)
                         VALUES ($1, $2, {DB_NOW}, $3)
                         ON CONFLICT (name) DO UPDATE SET address = $2,
                           heartbeat_at = {DB_NOW}, status = $3"
                    ),
                    &[&node, &address, &status],
                )
                .await
                .map_err(pg(format!("heartbeat of {node}")))?;
            Ok(())
        })
    }

    fn fleet(&self) -> Result<Vec<NodeEntry>> {
        let lease = self.lease;
        self.with("list nodes", move |client| async move {
            Ok(client
                .query(
                    &format!("SELECT {NODE_COLUMNS} FROM nodes ORDER BY name"),
                    &[],
                )
                .await
                .map_err(pg("list nodes"))?
                .iter()
                .map(|row| node_from(row, lease))
                .collect())
        })
    }
}

#[cfg(test)]
mod tests;
