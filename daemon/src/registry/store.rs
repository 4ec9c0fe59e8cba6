//! Durable registrations, in the journal's database (table `harnesses`): the node's own
//! sqlite file, or the PostgreSQL journal a fleet shares (so a harness registered through
//! any node serves sessions on every node).

use std::path::Path;
use std::sync::{Arc, Mutex};

use agentvm_proto::v1::{HarnessSpec, HarnessState};
use prost::Message;
use rusqlite::{Connection, OptionalExtension, params};

use crate::journal::sqlite::{Durability, open_connection};

#[derive(Debug, thiserror::Error)]
#[error("harness registry storage ({context}): {source}")]
pub struct StoreError {
    context: String,
    #[source]
    source: Box<dyn std::error::Error + Send + Sync>,
}

impl StoreError {
    pub fn new(
        context: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        Self {
            context: context.into(),
            source: source.into(),
        }
    }
}

fn storage(context: impl Into<String>) -> impl FnOnce(rusqlite::Error) -> StoreError {
    let context = context.into();
    move |source| StoreError::new(context, source)
}

/// Where registrations are kept.
pub trait HarnessTable: Send + Sync {
    fn get(&self, name: &str) -> Result<Option<StoredHarness>, StoreError>;
    /// Registrations with names strictly after `after`, in name order.
    fn list_after(&self, after: &str, limit: usize) -> Result<Vec<StoredHarness>, StoreError>;
    /// Inserts or replaces one registration.
    fn put(&self, h: &StoredHarness, spec: &HarnessSpec) -> Result<(), StoreError>;
}

/// One stored registration. `spec` is `None` when the stored bytes no longer decode on this
/// host (never a partial spec); the digest is kept either way.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredHarness {
    pub name: String,
    pub uid: String,
    pub spec: Option<HarnessSpec>,
    pub spec_digest: String,
    pub state: HarnessState,
    pub retire_time: Option<i64>,
    pub retire_reason: String,
    pub created_at: i64,
    pub updated_at: i64,
}

/// The registry's table, in whichever database holds it.
#[derive(Clone)]
pub struct RegistryStore(Arc<dyn HarnessTable>);

impl RegistryStore {
    /// The table in the sqlite journal file at `path`.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        Ok(Self(Arc::new(SqliteHarnesses::open(path)?)))
    }

    /// The table of a journal a fleet shares.
    pub fn shared(table: Arc<dyn HarnessTable>) -> Self {
        Self(table)
    }

    pub fn get(&self, name: &str) -> Result<Option<StoredHarness>, StoreError> {
        self.0.get(name)
    }

    pub fn list_after(&self, after: &str, limit: usize) -> Result<Vec<StoredHarness>, StoreError> {
        self.0.list_after(after, limit)
    }

    pub fn put(&self, h: &StoredHarness, spec: &HarnessSpec) -> Result<(), StoreError> {
        self.0.put(h, spec)
    }
}

struct SqliteHarnesses {
    conn: Mutex<Connection>,
}

const COLUMNS: &str =
    "name, uid, spec, spec_digest, state, retire_time, retire_reason, created_at, updated_at";

fn row(r: &rusqlite::Row<'_>) -> rusqlite::Result<StoredHarness> {
    let spec: Vec<u8> = r.get(2)?;
    Ok(StoredHarness {
        name: r.get(0)?,
        uid: r.get(1)?,
        spec: HarnessSpec::decode(spec.as_slice()).ok(),
        spec_digest: r.get(3)?,
        state: HarnessState::try_from(r.get::<_, i32>(4)?).unwrap_or(HarnessState::Unspecified),
        retire_time: r.get(5)?,
        retire_reason: r.get(6)?,
        created_at: r.get(7)?,
        updated_at: r.get(8)?,
    })
}

impl SqliteHarnesses {
    fn open(path: &Path) -> Result<Self, StoreError> {
        let conn = open_connection(path, Durability::Full)
            .map_err(storage(format!("open {}", path.display())))?;
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS harnesses (
                 name          TEXT PRIMARY KEY,
                 uid           TEXT NOT NULL,
                 spec          BLOB NOT NULL,
                 spec_digest   TEXT NOT NULL,
                 state         INTEGER NOT NULL,
                 retire_time   INTEGER,
                 retire_reason TEXT NOT NULL DEFAULT '',
                 created_at    INTEGER NOT NULL,
                 updated_at    INTEGER NOT NULL
             );",
        )
        .map_err(storage("create harnesses table"))?;
        Ok(Self {
            conn: Mutex::new(conn),
        })
    }

    fn conn(&self) -> std::sync::MutexGuard<'_, Connection> {
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl HarnessTable for SqliteHarnesses {
    fn get(&self, name: &str) -> Result<Option<StoredHarness>, StoreError> {
        self.conn()
            .prepare_cached(&format!("SELECT {COLUMNS} FROM harnesses WHERE name = ?1"))
            .and_then(|mut st| st.query_row([name], row).optional())
            .map_err(storage(format!("get harness {name}")))
    }

    fn list_after(&self, after: &str, limit: usize) -> Result<Vec<StoredHarness>, StoreError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        self.conn()
            .prepare_cached(&format!(
                "SELECT {COLUMNS} FROM harnesses WHERE name > ?1 ORDER BY name LIMIT ?2"
            ))
            .and_then(|mut st| {
                st.query_map(params![after, limit], row)?
                    .collect::<rusqlite::Result<Vec<_>>>()
            })
            .map_err(storage("list harnesses"))
    }

    fn put(&self, h: &StoredHarness, spec: &HarnessSpec) -> Result<(), StoreError> {
        self.conn()
            .prepare_cached(&format!(
                "INSERT OR REPLACE INTO harnesses ({COLUMNS})
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)"
            ))
            .and_then(|mut st| {
                st.execute(params![
                    h.name,
                    h.uid,
                    spec.encode_to_vec(),
                    h.spec_digest,
                    h.state as i32,
                    h.retire_time,
                    h.retire_reason,
                    h.created_at,
                    h.updated_at
                ])
            })
            .map_err(storage(format!("store harness {}", h.name)))?;
        Ok(())
    }
}
