//! The PostgreSQL schema, as numbered migrations. A database records the last one applied
//! in `agentvm_schema`; every node applies what is missing at start, one node at a time (an
//! advisory lock), and refuses a database stamped newer than it knows.

use tokio_postgres::Client;

use super::pg;
use crate::journal::{JournalError, Result};

/// The migrations, in order; the database's version is how many have been applied.
/// Append only: a shipped migration never changes.
const MIGRATIONS: &[&str] = &[
    // 1: sessions (with the node that holds each: the last to mint its fence), their logs
    // (upstream's column names, events as proto binary), the lifecycle intents of each
    // node, the harness registry, and the nodes with their heartbeats (by the database's
    // clock, nanoseconds).
    "CREATE TABLE sessions (
        session        TEXT PRIMARY KEY,
        fence          BIGINT NOT NULL DEFAULT 0,
        project        TEXT NOT NULL,
        name           TEXT NOT NULL,
        harness        TEXT NOT NULL,
        model          TEXT NOT NULL,
        parent_uid     TEXT NOT NULL DEFAULT '',
        fork_seq       BIGINT NOT NULL DEFAULT 0,
        compute_state  INTEGER NOT NULL,
        created_at     BIGINT NOT NULL,
        updated_at     BIGINT NOT NULL,
        labels         TEXT NOT NULL DEFAULT '{}',
        annotations    TEXT NOT NULL DEFAULT '{}',
        origin         BYTEA,
        identity       BYTEA,
        deletion_state TEXT NOT NULL DEFAULT 'ACTIVE',
        last_seq       BIGINT NOT NULL DEFAULT 0,
        head_hash      TEXT NOT NULL DEFAULT '',
        holder         TEXT NOT NULL DEFAULT ''
    );
    CREATE INDEX sessions_by_holder ON sessions (holder, compute_state);
    CREATE INDEX sessions_by_project ON sessions (project, created_at DESC, session);
    CREATE TABLE events (
        session   TEXT NOT NULL,
        seq       BIGINT NOT NULL,
        prev_hash TEXT NOT NULL,
        hash      TEXT NOT NULL,
        fence     BIGINT NOT NULL,
        event     BYTEA NOT NULL,
        PRIMARY KEY (session, seq)
    );
    CREATE TABLE operations (
        id         BIGSERIAL PRIMARY KEY,
        node       TEXT NOT NULL,
        kind       TEXT NOT NULL,
        session    TEXT NOT NULL,
        children   TEXT NOT NULL DEFAULT '',
        started_at BIGINT NOT NULL
    );
    CREATE INDEX operations_by_node ON operations (node, id);
    CREATE TABLE harnesses (
        name          TEXT PRIMARY KEY,
        uid           TEXT NOT NULL,
        spec          BYTEA NOT NULL,
        spec_digest   TEXT NOT NULL,
        state         INTEGER NOT NULL,
        retire_time   BIGINT,
        retire_reason TEXT NOT NULL DEFAULT '',
        created_at    BIGINT NOT NULL,
        updated_at    BIGINT NOT NULL
    );
    CREATE TABLE nodes (
        name         TEXT PRIMARY KEY,
        address      TEXT NOT NULL,
        heartbeat_at BIGINT NOT NULL,
        status       TEXT NOT NULL DEFAULT '{}'
    );",
    // 2: a session's fork children are looked up when its snapshots may be deleted.
    "CREATE INDEX sessions_by_parent ON sessions (parent_uid);",
    // 3: what each session's log holds, for project quotas; counted for the logs there.
    "ALTER TABLE sessions ADD COLUMN log_bytes BIGINT NOT NULL DEFAULT 0;
    UPDATE sessions SET log_bytes = COALESCE((SELECT SUM(length(event)) FROM events
        WHERE events.session = sessions.session), 0);",
    // 4: each turn's memory snapshot of a memory-tier session, beside its log.
    "CREATE TABLE checkpoints (
        session         TEXT NOT NULL,
        seq             BIGINT NOT NULL,
        turn            BIGINT NOT NULL,
        snapshot        TEXT NOT NULL,
        manifest_sha256 TEXT NOT NULL,
        bytes           BIGINT NOT NULL,
        created_at      BIGINT NOT NULL,
        PRIMARY KEY (session, seq)
    );",
];

/// What this build knows.
pub const SCHEMA_VERSION: i64 = MIGRATIONS.len() as i64;

/// Any fixed number: the key of the advisory lock migrations run under.
const MIGRATION_LOCK: i64 = 0x6167_656e_7476_6d31;

/// Brings the database to [`SCHEMA_VERSION`].
pub async fn migrate(client: &mut Client) -> Result<()> {
    let tx = client
        .transaction()
        .await
        .map_err(pg("begin schema migration"))?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
        .await
        .map_err(pg("take the migration lock"))?;
    tx.batch_execute("CREATE TABLE IF NOT EXISTS agentvm_schema (version BIGINT NOT NULL)")
        .await
        .map_err(pg("create agentvm_schema"))?;
    let found: i64 = tx
        .query_opt("SELECT version FROM agentvm_schema", &[])
        .await
        .map_err(pg("read the schema version"))?
        .map(|row| row.get(0))
        .unwrap_or(0);
    if found > SCHEMA_VERSION {
        return Err(JournalError::SchemaTooNew {
            found,
            supported: SCHEMA_VERSION,
        });
    }
    for (index, migration) in MIGRATIONS.iter().enumerate().skip(found as usize) {
        tx.batch_execute(migration)
            .await
            .map_err(pg(format!("apply schema migration {}", index + 1)))?;
    }
    tx.execute("DELETE FROM agentvm_schema", &[])
        .await
        .map_err(pg("stamp the schema version"))?;
    tx.execute(
        "INSERT INTO agentvm_schema (version) VALUES ($1)",
        &[&SCHEMA_VERSION],
    )
    .await
    .map_err(pg("stamp the schema version"))?;
    tx.commit().await.map_err(pg("commit schema migration"))
}
