//! Journal benchmarks: append throughput with an fsync per record and with group commit,
//! and chain-verify throughput over 100k records. Prints min/median/max over several runs.
//!
//! `cargo bench -p agentvmd --bench journal`

use std::sync::Arc;
use std::time::Instant;

use agentvm_proto::v1::{
    ComputeState, Event, EventKind, Message, Part, TextPart, event::Body, part,
};
use agentvmd::journal::postgres::PostgresJournal;
use agentvmd::journal::sqlite::{Durability, SqliteJournal};
use agentvmd::journal::verify::verify_chain;
use agentvmd::journal::{Journal, SessionRow};

fn event(i: usize) -> Event {
    Event {
        execution_id: format!("{:016x}", i / 5),
        kind: EventKind::EventOutput as i32,
        body: Some(Body::Message(Message {
            role: "assistant".into(),
            parts: vec![Part {
                part: Some(part::Part::Text(TextPart {
                    text: format!("echo:message number {i}"),
                })),
            }],
        })),
        ..Default::default()
    }
}

fn fresh(dir: &tempfile::TempDir, name: &str, durability: Durability) -> SqliteJournal {
    let j = SqliteJournal::open(&dir.path().join(name), durability).unwrap();
    j.create_session(&SessionRow {
        uid: "s".into(),
        project: "bench".into(),
        compute_state: ComputeState::ComputeNone,
        ..Default::default()
    })
    .unwrap();
    j
}

/// Appends `total` records in transactions of `batch`; returns records per second.
fn append_rate(dir: &tempfile::TempDir, run: usize, total: usize, batch: usize) -> f64 {
    let j = fresh(dir, &format!("append-{batch}-{run}.db"), Durability::Full);
    let events: Vec<Event> = (0..total).map(event).collect();
    let start = Instant::now();
    let mut head = 0;
    for chunk in events.chunks(batch) {
        head = j.append("s", head, 0, chunk).unwrap().last().unwrap().seq;
    }
    total as f64 / start.elapsed().as_secs_f64()
}

/// `sessions` threads each append `per_session` records to a session of their own, one
/// record per call, each call durable when it returns; records per second over all of them.
fn concurrent_rate(
    dir: &tempfile::TempDir,
    run: usize,
    sessions: usize,
    per_session: usize,
) -> f64 {
    let j = fresh(
        dir,
        &format!("concurrent-{sessions}-{run}.db"),
        Durability::Full,
    );
    rate_on(Arc::new(j), "c", sessions, per_session, 1)
}

/// Records per second appended to `j` (sessions created here as `PREFIX-N`): `sessions`
/// threads at once, `per_session` calls each of `batch` records.
fn rate_on(
    j: Arc<dyn Journal>,
    prefix: &str,
    sessions: usize,
    per_session: usize,
    batch: usize,
) -> f64 {
    for s in 0..sessions {
        j.create_session(&SessionRow {
            uid: format!("{prefix}-{s}"),
            project: "bench".into(),
            compute_state: ComputeState::ComputeNone,
            ..Default::default()
        })
        .unwrap();
    }
    let start = Instant::now();
    let threads: Vec<_> = (0..sessions)
        .map(|s| {
            let j = Arc::clone(&j);
            let uid = format!("{prefix}-{s}");
            std::thread::spawn(move || {
                let events: Vec<Event> = (0..batch).map(event).collect();
                for n in 0..per_session {
                    j.append(&uid, (n * batch) as i64, 0, &events).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    (sessions * per_session * batch) as f64 / start.elapsed().as_secs_f64()
}

/// The same appends against a real PostgreSQL (a server of the bench's own, fsync on),
/// when the host has one installed.
fn postgres_rows(runs: usize) {
    let server = match agentvmd::testing::TestPostgres::start() {
        Ok(server) => server,
        Err(why) => {
            println!("SKIPPED: PostgreSQL rows: {why}");
            return;
        }
    };
    server.create_database("bench").unwrap();
    let j: Arc<dyn Journal> =
        Arc::new(PostgresJournal::connect(&server.url("bench"), "bench").unwrap());
    let mut run = 0;
    for (name, sessions, per_session, batch) in [
        ("postgres: append, fsync per record", 1, 300, 1),
        ("postgres: append, 16/txn", 1, 64, 16),
        ("postgres: append, 16 sessions at once", 16, 50, 1),
        ("postgres: append, 64 sessions at once", 64, 20, 1),
    ] {
        let rates: Vec<f64> = (0..runs)
            .map(|_| {
                run += 1;
                rate_on(j.clone(), &format!("r{run}"), sessions, per_session, batch)
            })
            .collect();
        summary(name, "records/s", rates);
    }
}

fn summary(name: &str, unit: &str, mut xs: Vec<f64>) {
    xs.sort_by(|a, b| a.partial_cmp(b).unwrap());
    println!(
        "{name:<44} min {:>10.0}  median {:>10.0}  max {:>10.0}  {unit}  (n={})",
        xs[0],
        xs[xs.len() / 2],
        xs[xs.len() - 1],
        xs.len()
    );
}

fn main() {
    // `cargo bench` passes --bench; `cargo test --benches` runs this too, with fewer rounds.
    let quick = !std::env::args().any(|a| a == "--bench");
    let runs = if quick { 1 } else { 5 };
    let dir = tempfile::tempdir().unwrap();

    let per_record: Vec<f64> = (0..runs).map(|r| append_rate(&dir, r, 300, 1)).collect();
    summary("append, fsync per record (1/txn)", "records/s", per_record);
    for batch in [16, 256] {
        let grouped: Vec<f64> = (0..runs)
            .map(|r| append_rate(&dir, r, 256 * 16, batch))
            .collect();
        summary(
            &format!("append, group commit ({batch}/txn)"),
            "records/s",
            grouped,
        );
    }

    for sessions in [16, 64] {
        let rates: Vec<f64> = (0..runs)
            .map(|r| concurrent_rate(&dir, r, sessions, 100))
            .collect();
        summary(
            &format!("append, {sessions} sessions at once (1/call)"),
            "records/s",
            rates,
        );
    }

    postgres_rows(runs);

    let n = if quick { 5_000 } else { 100_000 };
    let j = fresh(&dir, "verify.db", Durability::Relaxed);
    let events: Vec<Event> = (0..n).map(event).collect();
    let mut head = 0;
    for chunk in events.chunks(1000) {
        head = j.append("s", head, 0, chunk).unwrap().last().unwrap().seq;
    }
    let mut read_verify = Vec::new();
    let mut verify_only = Vec::new();
    for _ in 0..runs.min(3) {
        let start = Instant::now();
        let records = j.read("s", 1, 0).unwrap();
        let read = start.elapsed();
        assert_eq!(verify_chain(&records).unwrap(), n as i64);
        let total = start.elapsed();
        read_verify.push(n as f64 / total.as_secs_f64());
        verify_only.push(n as f64 / (total - read).as_secs_f64());
    }
    summary(
        &format!("read + verify {n} records"),
        "records/s",
        read_verify,
    );
    summary(
        &format!("verify only {n} records"),
        "records/s",
        verify_only,
    );
}
