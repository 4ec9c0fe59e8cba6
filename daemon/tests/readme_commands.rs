//! Every `agentvm` command line the README and docs/ show in their code blocks parses as
//! written (issue 34, item 12: the README's `agentvm --addr … node list` was refused by the
//! CLI). Each is run with `AGENTVM_PARSE_ONLY`, so none touches a node or a file; the quick
//! start, which can run whole, is `readme_quickstart.rs`.

use std::path::Path;
use std::process::Command;

/// The `agentvm` invocations in `markdown`'s fenced code blocks, placeholders filled in.
fn commands_in(markdown: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut in_block = false;
    let mut pending = String::new();
    for line in markdown.lines() {
        if line.trim_start().starts_with("```") {
            in_block = !in_block;
            pending.clear();
            continue;
        }
        if !in_block {
            continue;
        }
        // A trailing backslash continues the command on the next line.
        if let Some(head) = line.strip_suffix('\\') {
            pending.push_str(head);
            continue;
        }
        let whole = std::mem::take(&mut pending) + line;
        let whole = whole.trim_start().trim_start_matches("$ ");
        let code = whole.split(" #").next().unwrap_or_default();
        for segment in code.split(['|', ';']).flat_map(|s| s.split("&&")) {
            let segment = segment.trim();
            // `S=$(agentvm …)` runs the command inside.
            let segment = match segment.split_once("=$(") {
                Some((_, inner)) => inner.trim_end_matches(')'),
                None => segment,
            };
            let Some(args) = segment.strip_prefix("agentvm ") else {
                continue;
            };
            let args = args.split(" > ").next().unwrap_or_default();
            out.push(fill_placeholders(args));
        }
    }
    out
}

/// `[--opt X]` groups go (optional syntax), `<…>` and the upper-case names stand for values.
fn fill_placeholders(args: &str) -> String {
    let mut text = String::new();
    let mut depth = (0, 0);
    for c in args.chars() {
        match c {
            '[' => depth.0 += 1,
            ']' => depth.0 -= 1,
            '<' => {
                depth.1 += 1;
                text.push('x');
            }
            '>' => depth.1 -= 1,
            _ if depth == (0, 0) => text.push(c),
            _ => {}
        }
    }
    text.split_whitespace()
        .map(|word| match word {
            "$S" | "$C" | "SESSION" => "sess-0",
            "NAME" => "echo",
            "DIR" | "VMLINUX" => "/nonexistent",
            other => other,
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Shell-like words: quotes group, and are dropped.
fn words(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut quote = None;
    for c in line.chars() {
        match (quote, c) {
            (None, '\'' | '"') => quote = Some(c),
            (Some(q), c) if c == q => quote = None,
            (None, c) if c.is_whitespace() => {
                if !word.is_empty() {
                    words.push(std::mem::take(&mut word));
                }
            }
            (_, c) => word.push(c),
        }
    }
    if !word.is_empty() {
        words.push(word);
    }
    words
}

#[test]
fn the_extraction_takes_what_a_shell_would_run() {
    let doc = "text agentvm outside\n```\n$ S=$(agentvm create --harness echo -q)\n\
               agentvm suspend SESSION && agentvm resume SESSION   # both\n\
               agentvm image build --config image.toml -o DIR [--kernel VMLINUX] \\\n  \
               --arg 1\nagentvm journal verify log.jsonl --expect-head <hash of seq 42>\n\
               agentvm journal export SESSION > log.jsonl\n```\n";
    assert_eq!(
        commands_in(doc),
        [
            "create --harness echo -q",
            "suspend sess-0",
            "resume sess-0",
            "image build --config image.toml -o /nonexistent --arg 1",
            "journal verify log.jsonl --expect-head x",
            "journal export sess-0",
        ]
    );
    assert_eq!(
        words("exec S -i 'hello there'"),
        ["exec", "S", "-i", "hello there"]
    );
}

#[test]
fn every_command_line_in_the_docs_parses() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = vec![root.join("README.md")];
    let mut docs: Vec<_> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    let mut checked = 0;
    let mut refused = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        for command in commands_in(&text) {
            let out = Command::new(env!("CARGO_BIN_EXE_agentvm"))
                .env("AGENTVM_PARSE_ONLY", "1")
                .args(words(&command))
                .output()
                .unwrap();
            checked += 1;
            if !out.status.success() {
                refused.push(format!(
                    "{}: agentvm {command}\n{}",
                    file.file_name().unwrap().to_string_lossy(),
                    String::from_utf8_lossy(&out.stderr)
                ));
            }
        }
    }
    eprintln!("{checked} command lines checked in {} files", files.len());
    assert!(
        checked >= 20,
        "only {checked} command lines found: the extraction broke"
    );
    assert!(refused.is_empty(), "{}", refused.join("\n"));
}
