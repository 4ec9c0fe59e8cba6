//! The README's quick start, run as written against a fresh agentvmd: each `$` line through
//! one bash (so `S=$(…)` carries over), each printed line compared with the README's, where
//! `…` stands for any text (a session's random uid).

mod support;

use std::process::Command;

use support::daemon::{kvm_unavailable, start_daemon};

/// The README's quick start block: (command, the lines it prints).
fn quick_start() -> Vec<(String, Vec<String>)> {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md"))
        .expect("reading README.md");
    let block = readme
        .split_once("<!-- quickstart:begin -->")
        .and_then(|(_, rest)| rest.split_once("<!-- quickstart:end -->"))
        .map(|(block, _)| block)
        .expect("README.md has no quick start block");
    let mut steps: Vec<(String, Vec<String>)> = Vec::new();
    for line in block.lines().filter(|l| !l.starts_with("```")) {
        match line.strip_prefix("$ ") {
            Some(command) => steps.push((command.to_owned(), Vec::new())),
            None if line.is_empty() => {}
            None => steps
                .last_mut()
                .expect("output before the first command")
                .1
                .push(line.to_owned()),
        }
    }
    steps
}

/// Whether `line` is `pattern`, where each `…` in the pattern stands for any text.
fn matches(pattern: &str, line: &str) -> bool {
    let mut parts = pattern.split('…');
    let first = parts.next().unwrap_or_default();
    let Some(mut rest) = line.strip_prefix(first) else {
        return false;
    };
    let parts: Vec<&str> = parts.collect();
    for (i, part) in parts.iter().enumerate() {
        let last = i + 1 == parts.len();
        match last {
            true => return rest.ends_with(part),
            false => match rest.find(part) {
                Some(at) => rest = &rest[at + part.len()..],
                None => return false,
            },
        }
    }
    rest.is_empty()
}

#[test]
fn the_wildcard_matches_what_it_should_and_nothing_else() {
    assert!(matches("sess-…  x", "sess-abc  x"));
    assert!(matches("a=sess-…@9 b", "a=sess-12@9 b"));
    assert!(matches("plain", "plain"));
    assert!(!matches("plain", "plain and more"));
    assert!(!matches("sess-…@9", "sess-12@8"));
    assert!(!matches("x…y…z", "x-y"));
}

#[test]
fn the_readme_quick_start_runs_as_written() {
    let steps = quick_start();
    assert!(steps.len() >= 8, "{steps:?}");
    if let Some(why) = kvm_unavailable() {
        println!("SKIPPED: the quick start's testguest session needs KVM: {why}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = start_daemon(dir.path());
    let work = dir.path().join("work");
    std::fs::create_dir(&work).unwrap();
    // Each command's output begins with a separator line of its own.
    const SEPARATOR: &str = "\u{1e}quickstart-step";
    let mut script = String::from("set -euo pipefail\n");
    for (command, _) in &steps {
        script.push_str(&format!("echo '{SEPARATOR}'\n{command}\n"));
    }
    let cli_dir = std::path::Path::new(env!("CARGO_BIN_EXE_agentvm"))
        .parent()
        .unwrap();
    let path = format!(
        "{}:{}",
        cli_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = Command::new("bash")
        .arg("-c")
        .arg(&script)
        .current_dir(&work)
        .env("PATH", path)
        .env("AGENTVM_ADDR", d.addr())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let printed: Vec<&str> = stdout.split(&format!("{SEPARATOR}\n")).skip(1).collect();
    assert_eq!(printed.len(), steps.len(), "{stdout}");
    for ((command, expected), printed) in steps.iter().zip(printed) {
        let lines: Vec<&str> = printed.lines().collect();
        assert_eq!(
            lines.len(),
            expected.len(),
            "$ {command}\nprinted:\n{printed}\nthe README says:\n{}",
            expected.join("\n")
        );
        for (want, got) in expected.iter().zip(&lines) {
            assert!(
                matches(want, got),
                "$ {command}\nprinted:   {got:?}\nthe README: {want:?}"
            );
        }
    }
}
