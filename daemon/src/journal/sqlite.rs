//! The embedded journal backend: sqlite in WAL mode.
//!
//! The `events` table keeps upstream's column names and stores each event as proto binary,
//! so upstream's own chain verifier can read our database as it reads theirs.
//! Writes go through one connection (sqlite has one writer at a time anyway); reads use a
//! second connection so a long Replay never waits behind an append. Appends of concurrent
//! sessions share commits (`group_commit`).

use std::path::Path;
use std::sync::Mutex;

use agentvm_proto::v1::{ComputeState, Event, IdentityRef, LogRecord, Origin};
use prost::Message;
use rusqlite::{Connection, OptionalExtension, TransactionBehavior, params};

use super::{
    CheckpointRow, DeletionState, Head, Journal, JournalError, ListCursor, Operation,
    OperationKind, ProjectUsage, Result, SessionRow, chain_onto, check_checkpoint, check_copied,
    check_copy, decode_record, json_map, read_upto, timed_append,
};
use crate::clock::now_nanos;
use group_commit::GroupCommit;

mod group_commit;

/// Stamped in `PRAGMA user_version`; a database with a higher stamp is refused.
/// 2 added `operations` (lifecycle intents); a version 1 database gains it on open.
/// 3 added `sessions.log_bytes` (what each log holds, for project quotas), counted from
/// the events on open.
/// 4 added `checkpoints` (each turn's memory snapshot, beside the log).
pub const SCHEMA_VERSION: i64 = 4;

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS sessions (
    session        TEXT PRIMARY KEY,
    fence          INTEGER NOT NULL DEFAULT 0,
    project        TEXT NOT NULL,
    name           TEXT NOT NULL,
    harness        TEXT NOT NULL,
    model          TEXT NOT NULL,
    parent_uid     TEXT NOT NULL DEFAULT '',
    fork_seq       INTEGER NOT NULL DEFAULT 0,
    compute_state  INTEGER NOT NULL,
    created_at     INTEGER NOT NULL,
    updated_at     INTEGER NOT NULL,
    labels         TEXT NOT NULL DEFAULT '{}',
    annotations    TEXT NOT NULL DEFAULT '{}',
    origin         BLOB,
    identity       BLOB,
    deletion_state TEXT NOT NULL DEFAULT 'ACTIVE',
    last_seq       INTEGER NOT NULL DEFAULT 0,
    head_hash      TEXT NOT NULL DEFAULT '',
    log_bytes      INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS sessions_by_project ON sessions (project, created_at DESC, session);
CREATE INDEX IF NOT EXISTS sessions_by_parent ON sessions (parent_uid);
CREATE TABLE IF NOT EXISTS events (
    session   TEXT NOT NULL,
    seq       INTEGER NOT NULL,
    prev_hash TEXT NOT NULL,
    hash      TEXT NOT NULL,
    fence     INTEGER NOT NULL,
    event     BLOB NOT NULL,
    PRIMARY KEY (session, seq)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS checkpoints (
    session         TEXT NOT NULL,
    seq             INTEGER NOT NULL,
    turn            INTEGER NOT NULL,
    snapshot        TEXT NOT NULL,
    manifest_sha256 TEXT NOT NULL,
    bytes           INTEGER NOT NULL,
    created_at      INTEGER NOT NULL,
    PRIMARY KEY (session, seq)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS operations (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    kind       TEXT NOT NULL,
    session    TEXT NOT NULL,
    children   TEXT NOT NULL DEFAULT '',
    started_at INTEGER NOT NULL
);
";

/// How hard a commit waits for the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// fsync on every commit: a record is on disk when `append` returns.
    Full,
    /// WAL without fsync per commit: survives a process crash, not a power loss.
    /// For tests and benchmarks only.
    Relaxed,
}

pub struct SqliteJournal {
    writer: Mutex<Connection>,
    reader: Mutex<Connection>,
    appends: GroupCommit,
}

fn storage(context: impl Into<String>) -> impl FnOnce(rusqlite::Error) -> JournalError {
    let context = context.into();
    move |source| JournalError::Storage { context, source }
}

/// Opens a connection to the journal database with the settings every user of that file
/// shares (WAL, the commit durability, a generous busy timeout for the single writer).
pub fn open_connection(path: &Path, durability: Durability) -> rusqlite::Result<Connection> {
    let conn = Connection::open(path)?;
    let sync = match durability {
        Durability::Full => "FULL",
        Durability::Relaxed => "NORMAL",
    };
    conn.execute_batch(&format!(
        "PRAGMA journal_mode = WAL; PRAGMA synchronous = {sync}; PRAGMA busy_timeout = 10000;"
    ))?;
    Ok(conn)
}

impl SqliteJournal {
    /// Opens (creating if needed) the journal database at `path`.
    pub fn open(path: &Path, durability: Durability) -> Result<Self> {
        let writer = open_connection(path, durability)
            .map_err(storage(format!("open {}", path.display())))?;
        let found: i64 = writer
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .map_err(storage("read schema version"))?;
        if found > SCHEMA_VERSION {
            return Err(JournalError::SchemaTooNew {
                found,
                supported: SCHEMA_VERSION,
            });
        }
        let has_log_bytes = writer
            .prepare("SELECT 1 FROM pragma_table_info('sessions') WHERE name = 'log_bytes'")
            .and_then(|mut st| st.exists([]))
            .map_err(storage("read the sessions table's columns"))?;
        if (1..3).contains(&found) && !has_log_bytes {
            // `CREATE TABLE IF NOT EXISTS` keeps the old table: add the column and count
            // what each log already holds, in one transaction.
            writer
                .execute_batch(
                    "BEGIN;
                     ALTER TABLE sessions ADD COLUMN log_bytes INTEGER NOT NULL DEFAULT 0;
                     UPDATE sessions SET log_bytes = (SELECT COALESCE(SUM(length(event)), 0)
                         FROM events WHERE events.session = sessions.session);
                     COMMIT;",
                )
                .map_err(storage("add sessions.log_bytes"))?;
        }
        writer
            .execute_batch(SCHEMA)
            .map_err(storage("create schema"))?;
        writer
            .execute_batch(&format!("PRAGMA user_version = {SCHEMA_VERSION}"))
            .map_err(storage("stamp schema version"))?;
        let reader = open_connection(path, durability)
            .map_err(storage(format!("open {}", path.display())))?;
        Ok(Self {
            writer: Mutex::new(writer),
            reader: Mutex::new(reader),
            appends: GroupCommit::default(),
        })
    }

    fn writer(&self) -> std::sync::MutexGuard<'_, Connection> {
        // A panic while holding the lock cannot leave sqlite inconsistent (transactions roll
        // back on drop), so a poisoned lock is still safe to use.
        self.writer.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn reader(&self) -> std::sync::MutexGuard<'_, Connection> {
        self.reader.lock().unwrap_or_else(|p| p.into_inner())
    }
}

const SESSION_COLUMNS: &str = "session, fence, project, name, harness, model, parent_uid, fork_seq,
    compute_state, created_at, updated_at, labels, annotations, origin, identity,
    deletion_state, last_seq, log_bytes";

fn row_to_session(r: &rusqlite::Row<'_>) -> rusqlite::Result<SessionRow> {
    let labels: String = r.get(11)?;
    let annotations: String = r.get(12)?;
    let origin: Option<Vec<u8>> = r.get(13)?;
    let identity: Option<Vec<u8>> = r.get(14)?;
    let deletion: String = r.get(15)?;
    let bad = |col: usize, e: String| {
        rusqlite::Error::FromSqlConversionFailure(col, rusqlite::types::Type::Text, e.into())
    };
    Ok(SessionRow {
        uid: r.get(0)?,
        fence: r.get(1)?,
        project: r.get(2)?,
        name: r.get(3)?,
        harness: r.get(4)?,
        model: r.get(5)?,
        parent_uid: r.get(6)?,
        fork_seq: r.get(7)?,
        compute_state: ComputeState::try_from(r.get::<_, i32>(8)?)
            .unwrap_or(ComputeState::Unspecified),
        created_at: r.get(9)?,
        updated_at: r.get(10)?,
        labels: serde_json::from_str(&labels).map_err(|e| bad(11, e.to_string()))?,
        annotations: serde_json::from_str(&annotations).map_err(|e| bad(12, e.to_string()))?,
        origin: origin
            .map(|b| Origin::decode(b.as_slice()))
            .transpose()
            .map_err(|e| bad(13, e.to_string()))?,
        identity: identity
            .map(|b| IdentityRef::decode(b.as_slice()))
            .transpose()
            .map_err(|e| bad(14, e.to_string()))?,
        deletion: DeletionState::parse(&deletion)
            .ok_or_else(|| bad(15, format!("unknown deletion state {deletion:?}")))?,
        last_seq: r.get(16)?,
        // One node's own journal: every session is its own.
        holder: String::new(),
        log_bytes: r.get::<_, i64>(17)? as u64,
    })
}

fn read_head(tx: &Connection, uid: &str) -> Result<Head> {
    tx.prepare_cached(
        "SELECT fence, last_seq, head_hash, compute_state FROM sessions WHERE session = ?1",
    )
    .and_then(|mut st| {
        st.query_row([uid], |r| {
            Ok(Head {
                fence: r.get(0)?,
                last_seq: r.get(1)?,
                head_hash: r.get(2)?,
                compute_state: ComputeState::try_from(r.get::<_, i32>(3)?)
                    .unwrap_or(ComputeState::Unspecified),
            })
        })
        .optional()
    })
    .map_err(storage(format!("read head of {uid}")))?
    .ok_or_else(|| JournalError::NotFound(uid.to_owned()))
}

fn insert_session(conn: &Connection, row: &SessionRow) -> Result<()> {
    let inserted = conn
        .prepare_cached(
            "INSERT INTO sessions (session, fence, project, name, harness, model, parent_uid,
                fork_seq, compute_state, created_at, updated_at, labels, annotations, origin,
                identity, deletion_state, last_seq, head_hash)
             VALUES (?1, 0, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, 0, '')
             ON CONFLICT (session) DO NOTHING",
        )
        .and_then(|mut st| {
            st.execute(params![
                row.uid,
                row.project,
                row.name,
                row.harness,
                row.model,
                row.parent_uid,
                row.fork_seq,
                row.compute_state as i32,
                row.created_at,
                row.updated_at,
                json_map(&row.labels),
                json_map(&row.annotations),
                row.origin.as_ref().map(Message::encode_to_vec),
                row.identity.as_ref().map(Message::encode_to_vec),
                row.deletion.as_str(),
            ])
        })
        .map_err(storage(format!("create session {}", row.uid)))?;
    if inserted == 0 {
        return Err(JournalError::AlreadyExists(row.uid.clone()));
    }
    Ok(())
}

/// Appends `events` to `uid`'s log inside the caller's transaction: CAS on the head, then
/// the fence, then each record chained to the one before.
fn append_events(
    tx: &Connection,
    uid: &str,
    expected_last_seq: i64,
    fence: i64,
    events: &[Event],
) -> Result<Vec<LogRecord>> {
    let head = read_head(tx, uid)?;
    let (last_seq, head_hash) = (head.last_seq, head.head_hash.clone());
    let (records, compute) = chain_onto(uid, head, expected_last_seq, fence, events)?;
    let mut added = 0i64;
    {
        let mut insert = tx
            .prepare_cached(
                "INSERT INTO events (session, seq, prev_hash, hash, fence, event)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            )
            .map_err(storage(format!("prepare append to {uid}")))?;
        for r in &records {
            let seq = r.seq;
            let event = r
                .event
                .as_ref()
                .map(Message::encode_to_vec)
                .unwrap_or_default();
            added += event.len() as i64;
            insert
                .execute(params![uid, seq, r.prev_hash, r.content_hash, fence, event])
                .map_err(|e| match e {
                    // A primary-key clash means another writer got there first.
                    rusqlite::Error::SqliteFailure(f, _)
                        if f.code == rusqlite::ErrorCode::ConstraintViolation =>
                    {
                        JournalError::Conflict {
                            session: uid.to_owned(),
                            expected: expected_last_seq,
                            head: seq,
                        }
                    }
                    e => storage(format!("append seq {seq} to {uid}"))(e),
                })?;
        }
    }
    let (seq, hash) = records
        .last()
        .map_or((last_seq, head_hash), |r| (r.seq, r.content_hash.clone()));
    tx.prepare_cached(
        "UPDATE sessions SET last_seq = ?2, head_hash = ?3, compute_state = ?4,
         updated_at = ?5, log_bytes = log_bytes + ?6 WHERE session = ?1",
    )
    .and_then(|mut st| st.execute(params![uid, seq, hash, compute as i32, now_nanos(), added]))
    .map_err(storage(format!("advance head of {uid}")))?;
    Ok(records)
}

/// Copies `parent`'s records 1..=`upto_seq` into `child` (empty) inside the caller's
/// transaction, byte for byte, and moves the child's head and fence to match.
fn copy_events(
    tx: &Connection,
    parent: &str,
    child: &str,
    upto_seq: i64,
    fence: i64,
) -> Result<()> {
    let parent_head = read_head(tx, parent)?;
    let child_head = read_head(tx, child)?;
    check_copy(
        parent,
        parent_head.last_seq,
        child,
        child_head.last_seq,
        upto_seq,
    )?;
    let copied = tx
        .prepare_cached(
            "INSERT INTO events (session, seq, prev_hash, hash, fence, event)
             SELECT ?2, seq, prev_hash, hash, ?4, event FROM events
             WHERE session = ?1 AND seq <= ?3",
        )
        .and_then(|mut st| st.execute(params![parent, child, upto_seq, fence]))
        .map_err(storage(format!("copy {parent}@{upto_seq} into {child}")))?;
    check_copied(parent, upto_seq, copied as u64)?;
    let head_hash: String = if upto_seq == 0 {
        String::new()
    } else {
        tx.query_row(
            "SELECT hash FROM events WHERE session = ?1 AND seq = ?2",
            params![parent, upto_seq],
            |r| r.get(0),
        )
        .map_err(storage(format!("read {parent}@{upto_seq}")))?
    };
    tx.execute(
        "UPDATE sessions SET last_seq = ?2, head_hash = ?3, updated_at = ?4,
             fence = MAX(fence, ?5),
             log_bytes = (SELECT COALESCE(SUM(length(event)), 0) FROM events
                          WHERE session = ?1)
         WHERE session = ?1",
        params![child, upto_seq, head_hash, now_nanos(), fence],
    )
    .map_err(storage(format!("advance head of {child}")))?;
    Ok(())
}

impl Journal for SqliteJournal {
    /// Active sessions whose stored compute state is `state`.
    fn sessions_in_state(&self, state: ComputeState) -> Result<Vec<String>> {
        let conn = self.reader();
        conn.prepare_cached(
            "SELECT session FROM sessions WHERE deletion_state = 'ACTIVE' AND compute_state = ?1
             ORDER BY session",
        )
        .and_then(|mut st| {
            st.query_map(params![state as i32], |r| r.get(0))?
                .collect::<rusqlite::Result<Vec<String>>>()
        })
        .map_err(storage("list sessions by compute state".to_owned()))
    }

    /// Active sessions by their stored compute state (for metrics).
    fn count_by_compute_state(&self) -> Result<Vec<(ComputeState, u64)>> {
        let conn = self.reader();
        conn.prepare_cached(
            "SELECT compute_state, COUNT(*) FROM sessions WHERE deletion_state = 'ACTIVE'
             GROUP BY compute_state ORDER BY compute_state",
        )
        .and_then(|mut st| {
            st.query_map([], |r| Ok((r.get::<_, i32>(0)?, r.get::<_, i64>(1)?)))?
                .collect::<rusqlite::Result<Vec<_>>>()
        })
        .map(|rows| {
            rows.into_iter()
                .map(|(state, n)| {
                    (
                        ComputeState::try_from(state).unwrap_or(ComputeState::ComputeNone),
                        n as u64,
                    )
                })
                .collect()
        })
        .map_err(storage("count sessions by compute state".to_owned()))
    }

    fn create_session(&self, row: &SessionRow) -> Result<()> {
        insert_session(&self.writer(), row)
    }

    fn get_session(&self, uid: &str) -> Result<Option<SessionRow>> {
        let conn = self.reader();
        conn.prepare_cached(&format!(
            "SELECT {SESSION_COLUMNS} FROM sessions WHERE session = ?1"
        ))
        .and_then(|mut st| st.query_row([uid], row_to_session).optional())
        .map_err(storage(format!("get session {uid}")))
    }

    fn projects(&self) -> Result<Vec<(String, u64)>> {
        let conn = self.reader();
        conn.prepare_cached(
            "SELECT project, COUNT(*) FROM sessions WHERE deletion_state != 'DELETED'
             GROUP BY project ORDER BY project",
        )
        .and_then(|mut st| {
            st.query_map([], |r| {
                Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)? as u64))
            })?
            .collect::<rusqlite::Result<Vec<_>>>()
        })
        .map_err(storage("list projects".to_owned()))
    }

    fn project_usage(&self, project: &str) -> Result<ProjectUsage> {
        let conn = self.reader();
        conn.prepare_cached(
            "SELECT COUNT(*), COALESCE(SUM(log_bytes), 0) FROM sessions
             WHERE project = ?1 AND deletion_state != 'DELETED'",
        )
        .and_then(|mut st| {
            st.query_row([project], |r| {
                Ok(ProjectUsage {
                    sessions: r.get::<_, i64>(0)? as u64,
                    log_bytes: r.get::<_, i64>(1)? as u64,
                })
            })
        })
        .map_err(storage(format!("usage of project {project}")))
    }

    fn list_sessions(
        &self,
        project: &str,
        after: Option<&ListCursor>,
        limit: usize,
    ) -> Result<Vec<SessionRow>> {
        let conn = self.reader();
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let result = match after {
            None => conn
                .prepare_cached(&format!(
                    "SELECT {SESSION_COLUMNS} FROM sessions WHERE project = ?1
                       AND deletion_state != 'DELETED'
                     ORDER BY created_at DESC, session ASC LIMIT ?2"
                ))
                .and_then(|mut st| {
                    st.query_map(params![project, limit], row_to_session)?
                        .collect::<rusqlite::Result<Vec<_>>>()
                }),
            Some(c) => conn
                .prepare_cached(&format!(
                    "SELECT {SESSION_COLUMNS} FROM sessions WHERE project = ?1
                       AND deletion_state != 'DELETED'
                       AND (created_at < ?2 OR (created_at = ?2 AND session > ?3))
                     ORDER BY created_at DESC, session ASC LIMIT ?4"
                ))
                .and_then(|mut st| {
                    st.query_map(params![project, c.created_at, c.uid, limit], row_to_session)?
                        .collect::<rusqlite::Result<Vec<_>>>()
                }),
        };
        result.map_err(storage(format!("list sessions of project {project}")))
    }

    fn new_fence(&self, uid: &str) -> Result<i64> {
        let conn = self.writer();
        conn.prepare_cached(
            "UPDATE sessions SET fence = fence + 1, updated_at = ?2 WHERE session = ?1
             RETURNING fence",
        )
        .and_then(|mut st| {
            st.query_row(params![uid, now_nanos()], |r| r.get(0))
                .optional()
        })
        .map_err(storage(format!("mint fence for {uid}")))?
        .ok_or_else(|| JournalError::NotFound(uid.to_owned()))
    }

    fn append(
        &self,
        uid: &str,
        expected_last_seq: i64,
        fence: i64,
        events: &[Event],
    ) -> Result<Vec<LogRecord>> {
        timed_append(|| {
            self.appends
                .append(|| self.writer(), uid, expected_last_seq, fence, events)
        })
    }

    fn read(&self, uid: &str, from_seq: i64, to_seq: i64) -> Result<Vec<LogRecord>> {
        let conn = self.reader();
        let to = read_upto(to_seq);
        let rows = conn
            .prepare_cached(
                "SELECT seq, prev_hash, hash, fence, event FROM events
                 WHERE session = ?1 AND seq >= ?2 AND seq <= ?3 ORDER BY seq",
            )
            .and_then(|mut st| {
                st.query_map(params![uid, from_seq.max(1), to], |r| {
                    Ok((
                        r.get::<_, i64>(0)?,
                        r.get::<_, String>(1)?,
                        r.get::<_, String>(2)?,
                        r.get::<_, i64>(3)?,
                        r.get::<_, Vec<u8>>(4)?,
                    ))
                })?
                .collect::<rusqlite::Result<Vec<_>>>()
            })
            .map_err(storage(format!("read log of {uid}")))?;
        rows.into_iter()
            .map(|(seq, prev, hash, fence, blob)| decode_record(uid, seq, prev, hash, fence, &blob))
            .collect()
    }

    fn copy_prefix(&self, parent: &str, child: &str, upto_seq: i64, fence: i64) -> Result<()> {
        let mut conn = self.writer();
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(storage(format!("begin fork copy {parent} -> {child}")))?;
        copy_events(&tx, parent, child, upto_seq, fence)?;
        tx.commit()
            .map_err(storage(format!("commit fork copy {parent} -> {child}")))
    }

    fn create_children(
        &self,
        parent: &str,
        upto_seq: i64,
        children: &[(SessionRow, Event)],
    ) -> Result<()> {
        let mut conn = self.writer();
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(storage(format!("begin writing the children of {parent}")))?;
        for (row, first) in children {
            insert_session(&tx, row)?;
            // The child's first writer: fence 1, as `new_fence` would mint it.
            copy_events(&tx, parent, &row.uid, upto_seq, 1)?;
            append_events(&tx, &row.uid, upto_seq, 1, std::slice::from_ref(first))?;
        }
        tx.commit()
            .map_err(storage(format!("commit the children of {parent}")))
    }

    fn begin_operation(&self, op: &Operation) -> Result<i64> {
        self.insert_operation(op)
    }

    fn end_operation(&self, id: i64) -> Result<()> {
        self.writer()
            .execute("DELETE FROM operations WHERE id = ?1", params![id])
            .map_err(storage(format!("end operation {id}")))?;
        Ok(())
    }

    fn open_operations(&self) -> Result<Vec<(i64, Operation)>> {
        let conn = self.reader();
        let rows = conn
            .prepare_cached("SELECT id, kind, session, children FROM operations ORDER BY id")
            .and_then(|mut st| {
                st.query_map([], |r| {
                    Ok((
                        r.get::<_, i64>(0)?,
                        r.get::<_, String>(1)?,
                        r.get::<_, String>(2)?,
                        r.get::<_, String>(3)?,
                    ))
                })?
                .collect::<rusqlite::Result<Vec<_>>>()
            })
            .map_err(storage("list open operations"))?;
        Ok(rows
            .into_iter()
            .filter_map(|(id, kind, session, children)| {
                let kind = OperationKind::parse(&kind)?;
                Some((
                    id,
                    Operation {
                        kind,
                        session,
                        children: children.split_whitespace().map(str::to_owned).collect(),
                    },
                ))
            })
            .collect())
    }

    fn record_checkpoint(&self, uid: &str, row: &CheckpointRow) -> Result<()> {
        let conn = self.writer();
        let head: Option<i64> = conn
            .prepare_cached("SELECT last_seq FROM sessions WHERE session = ?1")
            .and_then(|mut st| st.query_row([uid], |r| r.get(0)).optional())
            .map_err(storage(format!("read the head of {uid}")))?;
        let head = head.ok_or_else(|| JournalError::NotFound(uid.to_owned()))?;
        check_checkpoint(uid, row, head)?;
        conn.execute(
            "INSERT OR REPLACE INTO checkpoints
                 (session, seq, turn, snapshot, manifest_sha256, bytes, created_at)
             VALUES (?1, ?2, ?7, ?3, ?4, ?5, ?6)",
            params![
                uid,
                row.seq,
                row.snapshot,
                row.manifest_sha256,
                i64::try_from(row.bytes).unwrap_or(i64::MAX),
                row.created_at,
                i64::try_from(row.turn).unwrap_or(i64::MAX)
            ],
        )
        .map_err(storage(format!("record checkpoint {uid}@{}", row.seq)))?;
        Ok(())
    }

    fn checkpoints(&self, uid: &str) -> Result<Vec<CheckpointRow>> {
        self.reader()
            .prepare_cached(
                "SELECT seq, snapshot, manifest_sha256, bytes, created_at, turn FROM checkpoints
                 WHERE session = ?1 ORDER BY seq",
            )
            .and_then(|mut st| {
                st.query_map([uid], |r| {
                    Ok(CheckpointRow {
                        seq: r.get(0)?,
                        snapshot: r.get(1)?,
                        manifest_sha256: r.get(2)?,
                        bytes: r.get::<_, i64>(3)?.max(0) as u64,
                        created_at: r.get(4)?,
                        turn: r.get::<_, i64>(5)?.max(0) as u64,
                    })
                })?
                .collect()
            })
            .map_err(storage(format!("list the checkpoints of {uid}")))
    }

    fn retain_checkpoints(&self, uid: &str, drop: &[i64], replace: &[CheckpointRow]) -> Result<()> {
        let mut conn = self.writer();
        let tx = conn
            .transaction()
            .map_err(storage(format!("retain the checkpoints of {uid}")))?;
        for seq in drop {
            tx.execute(
                "DELETE FROM checkpoints WHERE session = ?1 AND seq = ?2",
                params![uid, seq],
            )
            .map_err(storage(format!("drop checkpoint {uid}@{seq}")))?;
        }
        for row in replace {
            let n = tx
                .execute(
                    "UPDATE checkpoints SET snapshot = ?3, manifest_sha256 = ?4, bytes = ?5
                     WHERE session = ?1 AND seq = ?2",
                    params![
                        uid,
                        row.seq,
                        row.snapshot,
                        row.manifest_sha256,
                        i64::try_from(row.bytes).unwrap_or(i64::MAX)
                    ],
                )
                .map_err(storage(format!("replace checkpoint {uid}@{}", row.seq)))?;
            if n == 0 {
                return Err(JournalError::NotFound(format!(
                    "checkpoint {uid}@{}",
                    row.seq
                )));
            }
        }
        tx.commit()
            .map_err(storage(format!("retain the checkpoints of {uid}")))
    }

    fn set_deletion(&self, uid: &str, state: DeletionState) -> Result<()> {
        let conn = self.writer();
        let n = conn
            .execute(
                "UPDATE sessions SET deletion_state = ?2, updated_at = ?3 WHERE session = ?1",
                params![uid, state.as_str(), now_nanos()],
            )
            .map_err(storage(format!("set deletion state of {uid}")))?;
        if n == 0 {
            return Err(JournalError::NotFound(uid.to_owned()));
        }
        Ok(())
    }

    fn has_undeleted_children(&self, uid: &str) -> Result<bool> {
        self.reader()
            .prepare_cached(
                "SELECT EXISTS (SELECT 1 FROM sessions WHERE parent_uid = ?1
                   AND deletion_state != 'DELETED')",
            )
            .and_then(|mut st| st.query_row([uid], |r| r.get(0)))
            .map_err(storage(format!("look for children of {uid}")))
    }
}

impl SqliteJournal {
    fn insert_operation(&self, op: &Operation) -> Result<i64> {
        let conn = self.writer();
        conn.prepare_cached(
            "INSERT INTO operations (kind, session, children, started_at) VALUES (?1, ?2, ?3, ?4)",
        )
        .and_then(|mut st| {
            st.execute(params![
                op.kind.as_str(),
                op.session,
                op.children.join(" "),
                now_nanos()
            ])
        })
        .map_err(storage(format!(
            "record the {} intent of {}",
            op.kind.as_str(),
            op.session
        )))?;
        Ok(conn.last_insert_rowid())
    }
}

#[cfg(test)]
mod tests;
