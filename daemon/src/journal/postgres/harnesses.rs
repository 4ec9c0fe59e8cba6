//! The harness registry's table in the journal a fleet shares: a harness registered through
//! any node serves sessions on every node.

use agentvm_proto::v1::{HarnessSpec, HarnessState};
use prost::Message;
use tokio_postgres::Row;

use super::PostgresJournal;
use crate::registry::store::{HarnessTable, StoreError, StoredHarness};

const COLUMNS: &str =
    "name, uid, spec, spec_digest, state, retire_time, retire_reason, created_at, updated_at";

fn stored(row: &Row) -> StoredHarness {
    let spec: Vec<u8> = row.get(2);
    StoredHarness {
        name: row.get(0),
        uid: row.get(1),
        spec: HarnessSpec::decode(spec.as_slice()).ok(),
        spec_digest: row.get(3),
        state: HarnessState::try_from(row.get::<_, i32>(4)).unwrap_or(HarnessState::Unspecified),
        retire_time: row.get(5),
        retire_reason: row.get(6),
        created_at: row.get(7),
        updated_at: row.get(8),
    }
}

fn store_error(context: &str) -> impl FnOnce(crate::journal::JournalError) -> StoreError + '_ {
    move |e| StoreError::new(context, e)
}

impl HarnessTable for PostgresJournal {
    fn get(&self, name: &str) -> Result<Option<StoredHarness>, StoreError> {
        let name = name.to_owned();
        self.with("get a harness", move |client| async move {
            Ok(client
                .query_opt(
                    &format!("SELECT {COLUMNS} FROM harnesses WHERE name = $1"),
                    &[&name],
                )
                .await
                .map_err(super::pg(format!("get harness {name}")))?
                .as_ref()
                .map(stored))
        })
        .map_err(store_error("get harness"))
    }

    fn list_after(&self, after: &str, limit: usize) -> Result<Vec<StoredHarness>, StoreError> {
        let after = after.to_owned();
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        self.with("list harnesses", move |client| async move {
            Ok(client
                .query(
                    &format!(
                        "SELECT {COLUMNS} FROM harnesses WHERE name > $1 ORDER BY name LIMIT $2"
                    ),
                    &[&after, &limit],
                )
                .await
                .map_err(super::pg("list harnesses"))?
                .iter()
                .map(stored)
                .collect())
        })
        .map_err(store_error("list harnesses"))
    }

    fn put(&self, h: &StoredHarness, spec: &HarnessSpec) -> Result<(), StoreError> {
        let (h, spec) = (h.clone(), spec.encode_to_vec());
        self.with("store a harness", move |client| async move {
            client
                .execute(
                    &format!(
                        "INSERT INTO harnesses ({COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
                         ON CONFLICT (name) DO UPDATE SET uid = $2, spec = $3, spec_digest = $4,
                           state = $5, retire_time = $6, retire_reason = $7, created_at = $8,
                           updated_at = $9"
                    ),
                    &[
                        &h.name,
                        &h.uid,
                        &spec,
                        &h.spec_digest,
                        &(h.state as i32),
                        &h.retire_time,
                        &h.retire_reason,
                        &h.created_at,
                        &h.updated_at,
                    ],
                )
                .await
                .map_err(super::pg(format!("store harness {}", h.name)))?;
            Ok(())
        })
        .map_err(store_error("store harness"))
    }
}
