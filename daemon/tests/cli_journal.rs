//! `agentvm journal export | agentvm journal verify` end to end, through the real binary.

use std::io::Write;
use std::process::{Command, Output, Stdio};

use agentvm_proto::v1::{ComputeState, Event, part};
use agentvm_proto::v1::{EventKind, HarnessEnd, Message, Part, TextPart, event::Body};
use agentvmd::journal::sqlite::{Durability, SqliteJournal};
use agentvmd::journal::{Journal, SessionRow};

fn agentvm(args: &[&str], stdin: Option<&[u8]>) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_agentvm"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut pipe = child.stdin.take().unwrap();
    if let Some(bytes) = stdin {
        pipe.write_all(bytes).unwrap();
    }
    drop(pipe);
    child.wait_with_output().unwrap()
}

fn turn(text: &str) -> Vec<Event> {
    let msg = |role: &str, t: &str| Message {
        role: role.into(),
        parts: vec![Part {
            part: Some(part::Part::Text(TextPart { text: t.into() })),
        }],
    };
    vec![
        Event {
            execution_id: "e1".into(),
            kind: EventKind::EventInput as i32,
            body: Some(Body::Message(msg("user", text))),
            ..Default::default()
        },
        Event {
            execution_id: "e1".into(),
            kind: EventKind::EventOutput as i32,
            body: Some(Body::Message(msg("assistant", &format!("echo:{text}")))),
            ..Default::default()
        },
        Event {
            execution_id: "e1".into(),
            kind: EventKind::EventEnd as i32,
            body: Some(Body::End(HarnessEnd {
                state: "COMPLETED".into(),
                error: None,
            })),
            ..Default::default()
        },
    ]
}

fn exported_log(dir: &tempfile::TempDir) -> String {
    let db = dir.path().join("journal.db");
    let j = SqliteJournal::open(&db, Durability::Full).unwrap();
    j.create_session(&SessionRow {
        uid: "sess-1".into(),
        project: "default".into(),
        harness: "echo".into(),
        compute_state: ComputeState::ComputeNone,
        ..Default::default()
    })
    .unwrap();
    j.append("sess-1", 0, 1, &turn("hi")).unwrap();
    j.append("sess-1", 3, 1, &turn("bye")).unwrap();
    let out = agentvm(
        &["journal", "export", "sess-1", "--db", db.to_str().unwrap()],
        None,
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn export_then_verify_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let log = exported_log(&dir);
    assert_eq!(log.lines().count(), 6);
    let out = agentvm(&["journal", "verify", "-"], Some(log.as_bytes()));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("6 records, chain intact"));

    // The same records as a JSON array, from a file.
    let array = format!("[{}]", log.lines().collect::<Vec<_>>().join(","));
    let path = dir.path().join("log.json");
    std::fs::write(&path, array).unwrap();
    let out = agentvm(&["journal", "verify", path.to_str().unwrap()], None);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn verify_names_the_first_bad_seq() {
    let dir = tempfile::tempdir().unwrap();
    let log = exported_log(&dir);
    let tampered = log.replacen("echo:bye", "echo:BYE", 1);
    let out = agentvm(
        &["--json", "journal", "verify", "-"],
        Some(tampered.as_bytes()),
    );
    assert_eq!(out.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["ok"], false);
    assert_eq!(v["bad_seq"], 5);
    assert!(v["message"].as_str().unwrap().contains("hash mismatch"));

    let mut lines: Vec<&str> = log.lines().collect();
    lines.remove(3);
    let gap = lines.join("\n");
    let out = agentvm(&["journal", "verify", "-"], Some(gap.as_bytes()));
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("seq 5: expected seq 4"), "{err}");
}

#[test]
fn verify_reports_malformed_input_without_panicking() {
    let dir = tempfile::tempdir().unwrap();
    let log = exported_log(&dir);
    let cases: [(&str, &str); 4] = [
        (&log[..log.len() / 2], "line"),
        (
            "{\"seq\":\"1\",\"event\":{\"kind\":\"EVENT_WHAT\"}}\n",
            "line 1",
        ),
        ("{\"seq\":[1]}\n", "line 1"),
        ("[{\"seq\":\"1\"},{\"fence\":{}}]", "array element 1"),
    ];
    for (input, position) in cases {
        let out = agentvm(&["journal", "verify", "-"], Some(input.as_bytes()));
        assert_eq!(out.status.code(), Some(1), "{input}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(position), "{input}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

#[test]
fn export_of_unknown_session_fails_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let _ = exported_log(&dir);
    let db = dir.path().join("journal.db");
    let out = agentvm(
        &[
            "journal",
            "export",
            "sess-nope",
            "--db",
            db.to_str().unwrap(),
        ],
        None,
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("sess-nope not found"));
}

/// Issue: an empty input verified as "0 records, chain intact", and a log cut short at any
/// record boundary verified too. Empty input is refused; --expect-last-seq and --expect-head
/// catch the truncation.
#[test]
fn verify_refuses_an_empty_log_and_catches_truncation_against_expectations() {
    for empty in ["", "\n", "[]"] {
        let out = agentvm(&["journal", "verify", "-"], Some(empty.as_bytes()));
        assert_eq!(out.status.code(), Some(1), "{empty:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("no records"), "{empty:?}: {err}");
    }
    let dir = tempfile::tempdir().unwrap();
    let log = exported_log(&dir);
    let last: serde_json::Value = serde_json::from_str(log.lines().last().unwrap()).unwrap();
    let head = last["contentHash"]
        .as_str()
        .or_else(|| last["content_hash"].as_str())
        .unwrap()
        .to_owned();
    let whole = ["--expect-last-seq", "6", "--expect-head", head.as_str()];
    let mut args = vec!["journal", "verify", "-"];
    args.extend(whole);
    let out = agentvm(&args, Some(log.as_bytes()));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // The first four records verify on their own, but not as the whole log.
    let cut: String = log.lines().take(4).collect::<Vec<_>>().join("\n");
    let out = agentvm(&["journal", "verify", "-"], Some(cut.as_bytes()));
    assert!(out.status.success(), "a prefix is a valid chain by itself");
    let out = agentvm(
        &["journal", "verify", "-", "--expect-last-seq", "6"],
        Some(cut.as_bytes()),
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("ends at seq 4, not the expected 6"));
    let out = agentvm(
        &["journal", "verify", "-", "--expect-head", head.as_str()],
        Some(cut.as_bytes()),
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not the expected"));
}
