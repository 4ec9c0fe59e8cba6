use std::io::{BufRead, BufReader};
use std::sync::Arc;

use agentvm_proto::v1::{EventKind, HarnessEnd, event::Body, part};

use super::*;
use crate::journal::suite::{self, input, journal_cases, session, uncanonical};
use crate::journal::verify::{ChainError, verify_chain};

fn open(dir: &tempfile::TempDir) -> SqliteJournal {
    SqliteJournal::open(&dir.path().join("journal.db"), Durability::Full).unwrap()
}

/// One test per case of the journal suite, each on a database of its own.
macro_rules! sqlite_case {
    ($($case:ident),* $(,)?) => {
        $(
            #[test]
            fn $case() {
                let dir = tempfile::tempdir().unwrap();
                let path = dir.path().join("journal.db");
                suite::$case(&move || -> Arc<dyn Journal> {
                    Arc::new(SqliteJournal::open(&path, Durability::Full).unwrap())
                });
            }
        )*
    };
}
journal_cases!(sqlite_case);

#[test]
fn one_commit_answers_each_append_of_a_batch_on_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let j = open(&dir);
    for uid in ["a", "b", "c"] {
        j.create_session(&session(uid, "p", 1)).unwrap();
    }
    j.append("c", 0, 0, &[input("c1")]).unwrap();
    j.new_fence("c").unwrap();
    let answers = group_commit::commit_for_test(
        &mut j.writer(),
        vec![
            ("a", 0, 0, vec![input("a1"), input("a2")]),
            // Stale head: refused, nothing of it written.
            ("b", 5, 0, vec![input("b-stale")]),
            // Fails after its first record went in: rolled back to its savepoint alone.
            ("b", 0, 0, vec![input("b-half"), uncanonical()]),
            ("b", 0, 0, vec![input("b1")]),
            // Sees the append before it in the same batch.
            ("a", 2, 0, vec![input("a3")]),
            // Superseded fence.
            ("c", 1, 0, vec![input("c-fenced")]),
            ("missing", 0, 0, vec![input("x")]),
        ],
    );
    let kinds: Vec<String> = answers
        .iter()
        .map(|a| match a {
            Ok(records) => format!("ok {}", records.len()),
            Err(JournalError::Conflict { .. }) => "conflict".into(),
            Err(JournalError::Canon { .. }) => "canon".into(),
            Err(JournalError::Fenced { .. }) => "fenced".into(),
            Err(JournalError::NotFound(_)) => "not found".into(),
            Err(e) => format!("other: {e}"),
        })
        .collect();
    assert_eq!(
        kinds,
        [
            "ok 2",
            "conflict",
            "canon",
            "ok 1",
            "ok 1",
            "fenced",
            "not found"
        ]
    );
    let texts = |uid: &str| -> Vec<String> {
        j.read(uid, 0, 0)
            .unwrap()
            .iter()
            .map(|r| match &r.event.as_ref().unwrap().body {
                Some(Body::Message(m)) => match &m.parts[0].part {
                    Some(part::Part::Text(t)) => t.text.clone(),
                    _ => String::new(),
                },
                _ => String::new(),
            })
            .collect()
    };
    assert_eq!(texts("a"), ["a1", "a2", "a3"]);
    assert_eq!(texts("b"), ["b1"]);
    assert_eq!(texts("c"), ["c1"]);
    for uid in ["a", "b", "c"] {
        let all = j.read(uid, 0, 0).unwrap();
        assert_eq!(verify_chain(&all), Ok(all.len() as i64), "{uid}");
        assert_eq!(
            j.get_session(uid).unwrap().unwrap().last_seq,
            all.len() as i64
        );
    }
}

#[test]
fn corrupted_row_is_detected() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("journal.db");
    let j = SqliteJournal::open(&path, Durability::Full).unwrap();
    j.create_session(&session("s", "p", 1)).unwrap();
    j.append("s", 0, 0, &[input("a"), input("b"), input("c")])
        .unwrap();
    drop(j);
    let raw = Connection::open(&path).unwrap();
    raw.execute(
        "UPDATE events SET event = ?1 WHERE session = 's' AND seq = 2",
        [input("tampered").encode_to_vec()],
    )
    .unwrap();
    drop(raw);
    let j = SqliteJournal::open(&path, Durability::Full).unwrap();
    let err = verify_chain(&j.read("s", 0, 0).unwrap()).unwrap_err();
    assert!(
        matches!(err, ChainError::HashMismatch { seq: 2, .. }),
        "{err}"
    );

    // Bytes that are not an Event at all are a decode fault, not a hash mismatch.
    let raw = Connection::open(&path).unwrap();
    raw.execute(
        "UPDATE events SET event = x'ffffffff' WHERE session = 's' AND seq = 3",
        [],
    )
    .unwrap();
    let err = j.read("s", 0, 0).unwrap_err();
    assert!(
        matches!(err, JournalError::CorruptRecord { seq: 3, .. }),
        "{err}"
    );
}

#[test]
fn newer_schema_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("journal.db");
    Connection::open(&path)
        .unwrap()
        .execute_batch(&format!("PRAGMA user_version = {}", SCHEMA_VERSION + 1))
        .unwrap();
    assert!(matches!(
        SqliteJournal::open(&path, Durability::Full),
        Err(JournalError::SchemaTooNew { found, supported })
            if found == SCHEMA_VERSION + 1 && supported == SCHEMA_VERSION
    ));
}

/// A version 1 database (no `operations`, no `log_bytes`) opens, gains both (what its logs
/// hold counted) and is stamped with this build's version.
#[test]
fn a_version_1_journal_gains_the_operations_table_and_log_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("journal.db");
    let held;
    {
        let j = open(&dir);
        j.create_session(&session("s1", "p", 1)).unwrap();
        j.append("s1", 0, 0, &[input("hello"), input("world")])
            .unwrap();
        held = j.project_usage("p").unwrap();
        assert!(held.log_bytes > 0);
        let conn = j.writer();
        conn.execute_batch(
            "DROP TABLE operations; ALTER TABLE sessions DROP COLUMN log_bytes;
             PRAGMA user_version = 1",
        )
        .unwrap();
    }
    let j = SqliteJournal::open(&path, Durability::Full).unwrap();
    assert!(j.get_session("s1").unwrap().is_some());
    assert!(j.open_operations().unwrap().is_empty());
    assert_eq!(j.project_usage("p").unwrap(), held);
    let version: i64 = j
        .reader()
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap();
    assert_eq!(version, SCHEMA_VERSION);
}

const CHILD_DB_ENV: &str = "AGENTVM_TEST_APPENDER_DB";

/// Runs inside a child process: appends until killed, printing each seq once `append` returned.
#[test]
#[ignore = "helper process for kill_9_right_after_append_loses_nothing"]
fn appender_child_process() {
    let path = std::env::var(CHILD_DB_ENV).expect("run by kill_9_right_after_append_loses_nothing");
    let j = SqliteJournal::open(Path::new(&path), Durability::Full).unwrap();
    j.create_session(&session("s", "p", 1)).unwrap();
    let end = Event {
        kind: EventKind::EventEnd as i32,
        body: Some(Body::End(HarnessEnd {
            state: "COMPLETED".into(),
            error: None,
        })),
        ..Default::default()
    };
    let mut head = 0;
    loop {
        head = j.append("s", head, 0, std::slice::from_ref(&end)).unwrap()[0].seq;
        println!("appended {head}");
    }
}

#[test]
fn kill_9_right_after_append_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("journal.db");
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "journal::sqlite::tests::appender_child_process",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_DB_ENV, &path)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut acknowledged = 0;
    for line in BufReader::new(stdout).lines() {
        let line = line.unwrap();
        if let Some(n) = line.strip_prefix("appended ") {
            acknowledged = n.parse().unwrap();
            if acknowledged >= 50 {
                break;
            }
        }
    }
    // SIGKILL: no destructors, no chance to flush anything the append had not made durable.
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(acknowledged >= 50, "child stopped early at {acknowledged}");
    let j = SqliteJournal::open(&path, Durability::Full).unwrap();
    let all = j.read("s", 0, 0).unwrap();
    assert!(
        all.len() as i64 >= acknowledged,
        "acknowledged {acknowledged}, found {}",
        all.len()
    );
    assert_eq!(verify_chain(&all), Ok(all.len() as i64));
}
