//! The `agentvm` CLI as a user meets it, through the real binary against a real agentvmd:
//! sessions named positionally or by flag, inputs from files and stdin, turns that would run
//! empty refused, errors said once (as JSON under --json), long payloads cut unless --full,
//! help for every option, completions and the manual page.

mod support;

use std::io::Write;
use std::process::{Command, Stdio};

use support::daemon::{Daemon, cli, start_daemon, start_daemon_with};

fn agentvm_with_stdin(d: &Daemon, args: &[&str], stdin: &[u8]) -> (bool, String, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_agentvm"))
        .env("AGENTVM_ADDR", d.addr())
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(stdin).unwrap();
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `agentvm ARGS` with no daemon address: (success, stdout, stderr).
fn agentvm(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_agentvm"))
        .args(args)
        .env_remove("AGENTVM_ADDR")
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn create_echo(d: &Daemon) -> String {
    let (ok, out, err) = cli(d, &["--json", "create", "--harness", "echo"]);
    assert!(ok, "{err}");
    let created: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    created["metadata"]["uid"].as_str().unwrap().to_owned()
}

#[test]
fn a_session_is_named_positionally_or_by_flag_and_inputs_come_from_files_and_stdin() {
    let dir = tempfile::tempdir().unwrap();
    let d = start_daemon(dir.path());
    let uid = create_echo(&d);
    let (ok, out, err) = cli(&d, &["exec", &uid, "-i", "positional"]);
    assert!(ok && out.contains("echo:positional"), "{out}{err}");
    let (ok, out, err) = cli(&d, &["exec", "--session", &uid, "-i", "flag"]);
    assert!(ok && out.contains("echo:flag"), "{out}{err}");
    let (ok, _, err) = cli(&d, &["exec", &uid, "--session", &uid, "-i", "both"]);
    assert!(!ok && err.contains("cannot be used with"), "{err}");

    // Larger than a command line takes in one argument (MAX_ARG_STRLEN is 128 KiB).
    let big = "x".repeat(200 << 10);
    let file = dir.path().join("input.txt");
    std::fs::write(&file, &big).unwrap();
    let (ok, out, err) = cli(
        &d,
        &[
            "--json",
            "exec",
            &uid,
            "--input-file",
            file.to_str().unwrap(),
        ],
    );
    assert!(ok, "{err}");
    assert!(
        out.contains(&format!("echo:{big}")),
        "the file's text was not the input"
    );
    let (ok, out, err) = agentvm_with_stdin(&d, &["exec", &uid, "--input-file", "-"], b"piped");
    assert!(ok && out.contains("echo:piped"), "{out}{err}");
    let (ok, _, err) = cli(&d, &["exec", &uid, "--input-file", "/nonexistent/input"]);
    assert!(
        !ok && err.contains("--input-file /nonexistent/input"),
        "{err}"
    );

    for args in [
        vec!["get", &uid],
        vec!["replay", &uid],
        vec!["verify", &uid],
    ] {
        let (ok, out, err) = cli(&d, &args);
        assert!(ok && !out.is_empty(), "{args:?}: {err}");
    }
}

#[test]
fn a_turn_that_would_run_empty_is_refused_and_so_is_a_seq_beyond_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let d = start_daemon(dir.path());
    let uid = create_echo(&d);
    let (ok, out, err) = cli(&d, &["exec", &uid, "-i", "hello"]);
    assert!(ok, "{out}{err}");
    let (_, head, _) = cli(&d, &["--json", "get", &uid]);
    let head: serde_json::Value = serde_json::from_str(head.trim()).unwrap();

    let (ok, _, err) = cli(&d, &["exec", &uid]);
    assert!(!ok, "an empty turn ran");
    assert!(
        err.contains("no input") && err.contains("COMPLETED"),
        "{err}"
    );
    let (ok, _, err) = cli(&d, &["exec"]);
    assert!(!ok && err.contains("no input"), "{err}");
    let (ok, _, err) = cli(&d, &["exec", &uid, "-i", "x", "--resume-from-seq", "999"]);
    assert!(!ok && err.contains("beyond the log"), "{err}");
    // Nothing of that reached the journal.
    let (_, after, _) = cli(&d, &["--json", "get", &uid]);
    let after: serde_json::Value = serde_json::from_str(after.trim()).unwrap();
    assert_eq!(after["lastSeq"], head["lastSeq"], "{after}");
}

#[test]
fn errors_are_said_once_and_as_json_under_json() {
    let dir = tempfile::tempdir().unwrap();
    let d = start_daemon(dir.path());
    let (ok, out, err) = cli(&d, &["--json", "get", "sess-nope"]);
    assert!(!ok && out.is_empty(), "{out}");
    let error: serde_json::Value = serde_json::from_str(err.trim()).unwrap();
    assert_eq!(error["error"]["code"], "NotFound", "{error}");
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("sess-nope"),
        "{error}"
    );

    let (ok, _, err) = agentvm(&["get", "x", "--addr", "unix:/nonexistent/agentvmd.sock"]);
    assert!(!ok);
    assert!(
        err.contains("unix:/nonexistent/agentvmd.sock")
            && err.contains("does not exist")
            && err.contains("AGENTVM_ADDR"),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
    // A socket file nobody listens on: the cause once, not the transport's layers of it.
    let stale = dir.path().join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    let addr = format!("unix:{}", stale.display());
    let (ok, _, err) = agentvm(&["get", "x", "--addr", &addr]);
    assert!(!ok && err.contains("cannot reach agentvmd"), "{err}");
    assert_eq!(err.matches("Connection refused").count(), 1, "{err}");
    let (ok, _, err) = agentvm(&["get", "x", "--addr", "nowhere"]);
    assert!(!ok && err.contains("address \"nowhere\""), "{err}");
    assert!(!err.contains("listen address"), "{err}");
}

#[test]
fn long_payloads_are_cut_to_a_line_unless_full() {
    let dir = tempfile::tempdir().unwrap();
    let d = start_daemon(dir.path());
    let uid = create_echo(&d);
    let long = format!("first line\n{}", "y".repeat(1000));
    let (ok, out, err) = cli(&d, &["exec", &uid, "-i", &long]);
    assert!(ok, "{err}");
    // Records are a line each; the reply streamed as it is written comes whole.
    let input = |out: &str| {
        out.lines()
            .find(|l| l.contains(" INPUT "))
            .unwrap_or_else(|| panic!("no INPUT record:\n{out}"))
            .to_owned()
    };
    let cut = input(&out);
    assert!(cut.contains("more characters; --full shows all"), "{cut}");
    assert!(!cut.contains(&"y".repeat(1000)), "{cut}");
    let (ok, out, err) = cli(&d, &["replay", &uid]);
    assert!(ok && !input(&out).contains(&"y".repeat(1000)), "{out}{err}");
    let (ok, out, err) = cli(&d, &["--full", "replay", &uid]);
    assert!(ok && out.contains(&"y".repeat(1000)), "{out}{err}");
}

/// The lines of a help page's command list.
fn command_lines(help: &str) -> impl Iterator<Item = &str> {
    help.lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
}

/// The commands a help page lists (but `help`).
fn commands_in(help: &str) -> Vec<String> {
    command_lines(help)
        .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
        .filter(|c| c != "help")
        .collect()
}

#[test]
fn every_command_and_option_says_what_it_is_for() {
    let (ok, top, err) = agentvm(&["--help"]);
    assert!(ok, "{err}");
    let commands = commands_in(&top);
    assert!(commands.len() > 15, "{top}");
    let mut pages = vec![(String::from("agentvm"), top.clone())];
    for command in &commands {
        let (ok, help, err) = agentvm(&[command, "--help"]);
        assert!(ok, "{command}: {err}");
        // Nested commands (journal, node, image, harness) have their own.
        for sub in commands_in(&help) {
            let (ok, help, err) = agentvm(&[command, &sub, "--help"]);
            assert!(ok, "{command} {sub}: {err}");
            pages.push((format!("{command} {sub}"), help));
        }
        pages.push((command.clone(), help));
    }
    for (page, help) in &pages {
        assert!(!help.contains("[default: ]"), "{page}:\n{help}");
        // A line naming an option or argument carries its description, or the next line does.
        let lines: Vec<&str> = help.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let trimmed = line.trim_start();
            let names_one = line.starts_with("  ")
                && (trimmed.starts_with('-')
                    || trimmed.starts_with('<')
                    || trimmed.starts_with('['));
            if !names_one {
                continue;
            }
            let described = trimmed.contains("  ")
                || lines
                    .get(i + 1)
                    .is_some_and(|next| next.starts_with("          ") && !next.trim().is_empty());
            assert!(described, "{page}: {line:?} has no description:\n{help}");
        }
    }
    // Subcommands too: each has a line of its own in its parent's list.
    for line in command_lines(&top) {
        assert!(line.trim().contains("  "), "{line:?} has no description");
    }
}

#[test]
fn only_commands_that_talk_to_the_daemon_take_connection_options() {
    for command in [
        &["exec"][..],
        &["list"],
        &["get"],
        &["node", "status"],
        &["node", "drain"],
        &["journal", "export"],
    ] {
        let (ok, help, err) = agentvm(&[command, &["--help"]].concat());
        assert!(ok, "{command:?}: {err}");
        assert!(
            help.contains("Connection:") && help.contains("--addr") && help.contains("--tls-ca"),
            "{command:?}:\n{help}"
        );
    }
    for command in [
        &["completions", "bash"][..],
        &["man"],
        &["journal", "verify", "-"],
        &["image", "testguest", "-o", "/dev/null"],
        &["harness", "serve", "echo", "--listen", "unix:/nonexistent"],
    ] {
        let (ok, _, err) = agentvm(&[command, &["--addr", "unix:/x"]].concat());
        assert!(
            !ok && err.contains("unexpected argument '--addr'"),
            "{command:?}: {err}"
        );
    }
}

#[test]
fn list_all_projects_shows_every_project_newest_first() {
    let dir = tempfile::tempdir().unwrap();
    let d = start_daemon(dir.path());
    let mut created = Vec::new();
    for project in ["alpha", "beta", "alpha"] {
        let (ok, out, err) = cli(
            &d,
            &[
                "--json",
                "create",
                "--harness",
                "echo",
                "--project",
                project,
            ],
        );
        assert!(ok, "{err}");
        let s: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        created.push((s["metadata"]["uid"].as_str().unwrap().to_owned(), project));
        // Distinct creation times, so newest first has one answer.
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    // One project per call, as ListSessions is: only beta's.
    let (ok, out, err) = cli(&d, &["list", "--project", "beta"]);
    assert!(ok, "{err}");
    assert_eq!(out.lines().count(), 1, "{out}");
    // A page size of 1 makes it page through each project.
    let (ok, out, err) = cli(&d, &["list", "--all-projects", "--page-size", "1"]);
    assert!(ok, "{err}");
    let lines: Vec<&str> = out.lines().collect();
    let expected: Vec<(String, &str)> = created.iter().rev().cloned().collect();
    assert_eq!(lines.len(), expected.len(), "{out}");
    for (line, (uid, project)) in lines.iter().zip(&expected) {
        assert!(
            line.starts_with(uid.as_str()) && line.ends_with(&format!("project={project}")),
            "{out}"
        );
    }
    let (ok, out, err) = cli(&d, &["--json", "list", "--all-projects"]);
    assert!(ok, "{err}");
    let listed: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(listed["sessions"].as_array().unwrap().len(), 3, "{out}");
    let (ok, _, err) = cli(&d, &["list", "--all-projects", "--project", "alpha"]);
    assert!(!ok && err.contains("--project"), "{err}");
}

#[test]
fn completions_and_the_manual_page_come_from_the_cli_definition() {
    let (ok, bash, err) = agentvm(&["completions", "bash"]);
    assert!(
        ok && bash.contains("_agentvm") && bash.contains("--input-file"),
        "{err}"
    );
    let (ok, zsh, err) = agentvm(&["completions", "zsh"]);
    assert!(ok && zsh.contains("#compdef agentvm"), "{err}");
    let (ok, fish, err) = agentvm(&["completions", "fish"]);
    assert!(ok && fish.contains("complete -c agentvm"), "{err}");
    let (ok, _, err) = agentvm(&["completions", "tcsh"]);
    assert!(!ok && err.contains("tcsh"), "{err}");
    let (ok, man, err) = agentvm(&["man"]);
    assert!(
        ok && man.contains(".TH agentvm") && man.contains("AGENTVM_ADDR"),
        "{err}"
    );
}

#[test]
fn journal_export_goes_through_the_api() {
    let dir = tempfile::tempdir().unwrap();
    let d = start_daemon(dir.path());
    let uid = create_echo(&d);
    let (ok, _, err) = cli(&d, &["exec", &uid, "-i", "exported"]);
    assert!(ok, "{err}");
    let (ok, log, err) = cli(&d, &["journal", "export", &uid]);
    assert!(ok && log.contains("exported"), "{err}");
    let (ok, out, err) = agentvm_with_stdin(&d, &["journal", "verify", "-"], log.as_bytes());
    assert!(ok && out.contains("chain intact"), "{out}{err}");
    let (ok, _, err) = cli(&d, &["journal", "export", "sess-nope"]);
    assert!(!ok && err.contains("NotFound"), "{err}");
}

#[test]
fn a_harness_the_node_cannot_run_is_refused_at_create() {
    let dir = tempfile::tempdir().unwrap();
    // No VMM: the counter, which keeps its count in RAM, has only the process runtime.
    let d = start_daemon_with(dir.path(), &["--vmm-binary", "/nonexistent/agentvm-vmm"]);
    let (ok, out, err) = cli(&d, &["create", "--harness", "counter"]);
    assert!(!ok, "created: {out}");
    assert!(
        err.contains("FailedPrecondition") && err.contains("REQUIRES_MEMORY_SNAPSHOT"),
        "{err}"
    );
    let (ok, out, _) = cli(&d, &["--json", "list"]);
    assert!(
        ok && !out.contains("counter"),
        "a refused session was written: {out}"
    );
    let (ok, _, err) = cli(&d, &["create", "--harness", "echo"]);
    assert!(ok, "{err}");
}

/// A failed `S=$(agentvm create -q)` leaves `$S` empty: `exec "$S"` must not quietly make a
/// new session, and an empty `-i` is not an empty message to journal. Both are refused before
/// the daemon is asked anything.
#[test]
fn an_empty_session_or_input_is_refused_and_creates_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let d = start_daemon(dir.path());
    let uid = create_echo(&d);
    let sessions = |d: &Daemon| {
        let (ok, out, err) = cli(d, &["--json", "list"]);
        assert!(ok, "{err}");
        out.matches("\"uid\"").count()
    };
    let before = sessions(&d);
    for args in [
        &["exec", "", "-i", "tick"][..],
        &["exec", "--session", "", "-i", "tick"],
        &["get", ""],
        &["exec", &uid, "-i", ""],
    ] {
        let (ok, _, err) = cli(&d, args);
        assert!(!ok && err.contains("empty"), "{args:?}: {err}");
    }
    assert_eq!(sessions(&d), before, "a refused command made a session");
}

/// `agentvm replay S | head -1`: the reader going away ends the CLI as it ends Unix tools
/// (status 141, as if by SIGPIPE), with no panic on stderr.
#[test]
fn a_reader_that_stops_reading_ends_the_cli_quietly() {
    let dir = tempfile::tempdir().unwrap();
    let d = start_daemon(dir.path());
    let uid = create_echo(&d);
    for _ in 0..3 {
        let (ok, _, err) = cli(&d, &["exec", &uid, "-i", &"x".repeat(4096)]);
        assert!(ok, "{err}");
    }
    for args in [&["replay", &uid][..], &["--json", "replay", &uid]] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_agentvm"))
            .env("AGENTVM_ADDR", d.addr())
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // The reader is gone before the first line is written.
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(141), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

/// Connection options go before the command too, as the README's fleet example writes them.
#[test]
fn connection_options_go_anywhere() {
    let dir = tempfile::tempdir().unwrap();
    let d = start_daemon(dir.path());
    let uid = create_echo(&d);
    let addr = d.addr();
    let (ok, out, err) = agentvm(&["--addr", &addr, "get", &uid]);
    assert!(ok && out.contains(&uid), "{out}{err}");
    let (ok, out, err) = agentvm(&["--json", &format!("--addr={addr}"), "list"]);
    assert!(ok && out.contains(&uid), "{out}{err}");
    // A command that talks to no daemon still refuses them by name.
    let (ok, _, err) = agentvm(&["--addr", &addr, "completions", "bash"]);
    assert!(!ok && err.contains("--addr"), "{err}");
}

/// `agentvm harness register|get|list|retire` on the admin socket beside the API socket,
/// with agentctl's flags; `--json` prints the registry's proto-JSON answer as agentctl does.
#[test]
fn the_harness_registry_is_driven_from_the_cli() {
    let dir = tempfile::tempdir().unwrap();
    let d = start_daemon(dir.path());
    let (ok, out, err) = cli(&d, &["harness", "list"]);
    assert!(ok, "{err}");
    for builtin in ["echo", "counter", "testguest"] {
        assert!(
            out.lines()
                .any(|l| l.starts_with(builtin) && l.contains("built-in")),
            "{out}"
        );
    }
    let spec = dir.path().join("spec.json");
    std::fs::write(
        &spec,
        r#"{"remote": {"address": "unix:///nowhere/h.sock"},
            "capabilities": {"resumability": "RESUMABILITY_STATELESS_REPLAY"}}"#,
    )
    .unwrap();
    let spec_arg = spec.to_str().unwrap();
    let (ok, out, err) = cli(
        &d,
        &["harness", "register", "--name", "ext", "--spec", spec_arg],
    );
    assert!(
        ok && out.starts_with("registered ext sha256:"),
        "{out}{err}"
    );
    let (ok, out, _) = cli(
        &d,
        &["harness", "register", "--name", "ext", "--spec", spec_arg],
    );
    assert!(ok && out.starts_with("unchanged ext"), "{out}");

    let (ok, out, err) = cli(&d, &["--json", "harness", "get", "--name", "ext"]);
    assert!(ok, "{err}");
    let got: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(got["metadata"]["name"], "ext");
    assert_eq!(got["state"], "HARNESS_STATE_ACTIVE");
    assert_eq!(got["source"], "HARNESS_SOURCE_REGISTERED");
    assert_eq!(got["spec"]["remote"]["address"], "unix:///nowhere/h.sock");
    // --observe asks the harness, which is not there: said, not fatal.
    let (ok, out, err) = cli(&d, &["harness", "get", "--name", "ext", "--observe"]);
    assert!(ok && out.contains("observe:   failed"), "{out}{err}");

    let (ok, out, err) = cli(
        &d,
        &["harness", "retire", "--name", "ext", "--reason", "moved"],
    );
    assert!(ok && out.trim() == "retired ext", "{out}{err}");
    let listed = |extra: &[&str]| {
        let mut args = vec!["--json", "harness", "list", "--page-size", "2"];
        args.extend(extra);
        let (ok, out, err) = cli(&d, &args);
        assert!(ok, "{err}");
        let all: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        all["harnesses"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| h["metadata"]["name"].as_str().unwrap().to_owned())
            .collect::<Vec<_>>()
    };
    let active = listed(&[]);
    assert!(active.contains(&"echo".to_owned()) && !active.contains(&"ext".to_owned()));
    assert!(listed(&["--include-retired"]).contains(&"ext".to_owned()));

    // Bad input: the spec file and the name are named, and nothing is registered.
    std::fs::write(&spec, "{\"remote\": 7}").unwrap();
    let (ok, _, err) = cli(
        &d,
        &["harness", "register", "--name", "bad", "--spec", spec_arg],
    );
    assert!(!ok && err.contains("spec.json"), "{err}");
    std::fs::write(
        &spec,
        r#"{"remote": {"address": "unix:///h.sock"}, "capabilities": {"resumability": 1}}"#,
    )
    .unwrap();
    let (ok, _, err) = cli(
        &d,
        &[
            "harness",
            "register",
            "--name",
            "Not_A_Label",
            "--spec",
            spec_arg,
        ],
    );
    assert!(!ok && err.contains("name"), "{err}");
    let (ok, _, err) = cli(&d, &["harness", "get", "--name", "bad"]);
    assert!(
        !ok && err.contains("NotFound") && err.contains("\"bad\""),
        "{err}"
    );
}
