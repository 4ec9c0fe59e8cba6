//! agentvm: the client CLI.

#![forbid(unsafe_code)]

/// Like `println!`, but a reader that stopped reading (`agentvm replay S | head -1`) ends the
/// program quietly, as it ends Unix tools, instead of a panic.
macro_rules! outln {
    () => {
        $crate::write_stdout(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::write_stdout(format_args!("{}\n", format_args!($($arg)*)))
    };
}

mod connection;
mod harness_cmd;
mod image_cmd;
mod node_cmd;
mod sessions_cmd;

use std::io::Read;
use std::path::PathBuf;

use connection::Connection;
use std::process::ExitCode;

use agentvm_proto::v1::LogRecord;
use agentvmd::config;
use agentvmd::journal::Journal;
use agentvmd::journal::records_json::{parse_records, write_records};
use agentvmd::journal::sqlite::{Durability, SqliteJournal};
use agentvmd::journal::verify::verify_chain;
use anyhow::Context;
use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "agentvm",
    version,
    about = "The agentvm client: sessions, their journals, nodes, images and harnesses"
)]
struct Cli {
    /// Print machine-readable JSON (errors too, as {"error": {"code", "message"}}).
    #[arg(long, global = true)]
    json: bool,
    /// Print payloads whole in human output (cut to a line otherwise).
    #[arg(long, global = true)]
    full: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Work with hash-chained session journals.
    #[command(subcommand)]
    Journal(JournalCommand),
    /// Run a reference harness.
    #[command(subcommand)]
    Harness(HarnessCommand),
    /// Write guest images.
    #[command(subcommand)]
    Image(ImageCommand),
    /// The node agentvmd runs on.
    #[command(subcommand)]
    Node(NodeCommand),
    /// Print a completion script for SHELL (e.g. `agentvm completions bash >
    /// /etc/bash_completion.d/agentvm`).
    Completions {
        /// bash, zsh, fish, elvish or powershell.
        shell: clap_complete::Shell,
    },
    /// Print the manual page (roff; `agentvm man | man -l -`).
    Man,
    #[command(flatten)]
    Session(sessions_cmd::SessionCommand),
}

#[derive(Subcommand, Debug)]
enum NodeCommand {
    /// Capacity, KVM flavour, VMM version, free memory, sessions and harnesses.
    Status {
        #[command(flatten)]
        conn: Connection,
    },
    /// The nodes sharing this node's journal, with their heartbeats and sessions.
    List {
        #[command(flatten)]
        conn: Connection,
    },
    /// Refuse new work on node NAME, suspend everything it runs and let go of its sessions,
    /// so other nodes take them (found through the node at --addr).
    Drain {
        /// The node's name (`node list` shows them).
        name: String,
        /// How long the suspends may take in all, in seconds.
        #[arg(long, default_value_t = 60)]
        timeout_secs: u32,
        #[command(flatten)]
        conn: Connection,
    },
}

#[derive(Subcommand, Debug)]
enum HarnessCommand {
    /// Serve a built-in harness (echo, counter, chat) over gRPC.
    Serve {
        /// echo, counter or chat.
        name: String,
        /// `unix:PATH` or `HOST:PORT` (loopback).
        #[arg(long)]
        listen: config::ListenAddr,
    },
    #[command(flatten)]
    Registry(harness_cmd::registry::RegistryCommand),
}

#[derive(Subcommand, Debug)]
enum ImageCommand {
    /// Write the VMM's test guest (a PVH ELF) to a file.
    Testguest {
        /// Where to write it (mode 0644).
        #[arg(short, long)]
        output: PathBuf,
    },
    /// Build a Linux guest image bundle (vmlinux, initramfs.cpio, image.toml, manifest.json).
    Build {
        /// The image's image.toml: [harness], [vm], [network] and [build] (docs/harness-protocol.md,
        /// "Running a harness inside a microVM").
        #[arg(long)]
        config: PathBuf,
        /// The bundle directory.
        #[arg(short, long)]
        output: PathBuf,
        /// The kernel, where the configuration's [build] names none.
        #[arg(long)]
        kernel: Option<PathBuf>,
        /// The static agentvm-guest binary, where [build] names none (default: beside this
        /// binary).
        #[arg(long)]
        agent: Option<PathBuf>,
        /// A container image to boot as the guest's root filesystem, where [build] names
        /// none: an OCI image layout (directory or tar) or `docker save` output. Its
        /// Entrypoint and Cmd are the harness unless image.toml gives harness.command.
        #[arg(long, value_name = "DIR|ARCHIVE")]
        oci: Option<PathBuf>,
        /// As root, handle the container image in this process with root's rights, not as
        /// an unprivileged uid in a user namespace of its own (for hosts where user
        /// namespaces are off).
        #[arg(long)]
        no_sandbox: bool,
    },
    /// Make a microVM image's template on the node now (its booted, ready VM, saved), so its
    /// next session restores it instead of booting. Needs an operator's credential.
    Warm {
        /// The harness the image serves (a bundle's directory name, or testguest).
        name: String,
        #[command(flatten)]
        conn: Connection,
    },
    /// What a root build runs in its user namespace: one job on standard input, in the
    /// current directory (docs/security.md, row O1).
    #[command(hide = true)]
    Unpack {
        job: String,
        dir: PathBuf,
        label: String,
        budget: Option<u64>,
    },
}

#[derive(Subcommand, Debug)]
enum JournalCommand {
    /// Verify a log of LogRecords (proto3 JSON: an array or JSON lines; `-` reads stdin).
    /// An empty log is refused: it proves nothing.
    Verify {
        /// The log file (`-`: standard input).
        file: String,
        /// The content_hash the last record must have (catches a log cut short).
        #[arg(long, value_name = "HASH")]
        expect_head: Option<String>,
        /// The seq the last record must have (catches a log cut short).
        #[arg(long, value_name = "N")]
        expect_last_seq: Option<i64>,
    },
    /// Write a session's log as JSON lines, in the format `verify` reads: through the API
    /// (--addr), or read offline from a journal database (--db).
    Export {
        /// The session's uid.
        session: String,
        /// Read this sqlite journal database directly instead (agentvmd's
        /// STATE_DIR/journal.db; works with no daemon running).
        #[arg(long)]
        db: Option<PathBuf>,
        #[command(flatten)]
        conn: Connection,
    },
}

/// The exit status of a program that wrote to a pipe its reader closed (killed by SIGPIPE,
/// as a shell reports it).
const CLOSED_STDOUT: u8 = 128 + 13;

fn write_stdout(args: std::fmt::Arguments) {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    match stdout.write_fmt(args).and_then(|()| stdout.flush()) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
            std::process::exit(i32::from(CLOSED_STDOUT))
        }
        Err(e) => {
            eprintln!("agentvm: writing to stdout: {e}");
            std::process::exit(2)
        }
    }
}

/// Whether `e` is the reader of stdout having gone away (from a writer other than
/// [`write_stdout`], such as an export streamed to stdout).
fn closed_stdout(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// The connection options, which only the commands that talk to a daemon take.
const CONNECTION_OPTIONS: [&str; 5] = ["--addr", "--token", "--tls-ca", "--tls-cert", "--tls-key"];

/// `args` with the connection options given before the command (`agentvm --addr A node
/// list`, as the fleet examples write it) moved after it, where the command takes them: a
/// global option goes anywhere, and a command that takes none still refuses them by name.
fn connection_options_last(args: Vec<std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    let mut kept = Vec::with_capacity(args.len());
    let mut moved = Vec::new();
    let mut args = args.into_iter();
    kept.extend(args.next());
    while let Some(arg) = args.next() {
        let text = arg.to_string_lossy();
        let option = text.split_once('=').map_or(&*text, |(name, _)| name);
        if CONNECTION_OPTIONS.contains(&option) {
            let takes_next = !text.contains('=');
            moved.push(arg);
            if takes_next {
                moved.extend(args.next());
            }
        } else if text.starts_with('-') && text != "--" {
            kept.push(arg);
        } else {
            // The command: everything from here is its own.
            kept.push(arg);
            break;
        }
    }
    let mut rest: Vec<std::ffi::OsString> = args.collect();
    let at = rest.iter().position(|a| a == "--").unwrap_or(rest.len());
    rest.splice(at..at, moved);
    kept.extend(rest);
    kept
}

fn main() -> ExitCode {
    let cli = Cli::parse_from(connection_options_last(std::env::args_os().collect()));
    // Set by the test that checks every command line the docs show: parsed, none is run.
    if std::env::var_os("AGENTVM_PARSE_ONLY").is_some() {
        return ExitCode::SUCCESS;
    }
    match run(&cli) {
        Ok(code) => code,
        Err(e) if closed_stdout(&e) => ExitCode::from(CLOSED_STDOUT),
        Err(e) => {
            let (code, message) = match e.downcast_ref::<tonic::Status>() {
                Some(status) => (format!("{:?}", status.code()), status.message().to_owned()),
                None => ("Client".to_owned(), format!("{e:#}")),
            };
            match cli.json {
                true => eprintln!(
                    "{}",
                    serde_json::json!({"error": {"code": code, "message": message}})
                ),
                false => eprintln!("agentvm: {code}: {message}"),
            }
            ExitCode::from(2)
        }
    }
}

fn async_runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")
}

fn run(cli: &Cli) -> anyhow::Result<ExitCode> {
    match &cli.command {
        Command::Session(cmd) => {
            let output = sessions_cmd::Output {
                json: cli.json,
                full: cli.full,
            };
            async_runtime()?.block_on(sessions_cmd::run(output, cmd.clone()))?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Completions { shell } => {
            use clap::CommandFactory;
            let mut command = Cli::command();
            clap_complete::generate(*shell, &mut command, "agentvm", &mut std::io::stdout());
            Ok(ExitCode::SUCCESS)
        }
        Command::Man => {
            manual(&mut std::io::stdout().lock()).context("writing the manual page")?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Node(command) => {
            async_runtime()?.block_on(async {
                match command {
                    NodeCommand::Status { conn } => node_cmd::status(conn, cli.json).await,
                    NodeCommand::List { conn } => node_cmd::list(conn, cli.json).await,
                    NodeCommand::Drain {
                        name,
                        timeout_secs,
                        conn,
                    } => node_cmd::drain(conn, name, *timeout_secs, cli.json).await,
                }
            })?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Harness(HarnessCommand::Serve { name, listen }) => {
            harness_cmd::serve(name, listen)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Harness(HarnessCommand::Registry(command)) => {
            async_runtime()?.block_on(harness_cmd::registry::run(command, cli.json))?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Image(ImageCommand::Build {
            config,
            output,
            kernel,
            agent,
            oci,
            no_sandbox,
        }) => {
            let inputs = agentvmd::image::BuildInputs {
                kernel: kernel.clone(),
                agent: agent.clone(),
                oci: oci.clone(),
                sandbox: image_cmd::sandbox(*no_sandbox)?,
            };
            image_cmd::build(config, output, inputs, cli.json)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Image(ImageCommand::Warm { name, conn }) => {
            async_runtime()?.block_on(node_cmd::warm(conn, name, cli.json))?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Image(ImageCommand::Unpack {
            job,
            dir,
            label,
            budget,
        }) => Ok(image_cmd::unpack(job, dir, label, *budget)),
        Command::Image(ImageCommand::Testguest { output }) => {
            image_cmd::write_testguest(output)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Journal(JournalCommand::Verify {
            file,
            expect_head,
            expect_last_seq,
        }) => verify(file, expect_head.as_deref(), *expect_last_seq, cli.json),
        Command::Journal(JournalCommand::Export { session, db, conn }) => {
            let records = match db {
                Some(db) => read_offline(db, session)?,
                None => async_runtime()?.block_on(sessions_cmd::fetch_log(conn, session))?,
            };
            let stdout = std::io::stdout();
            let mut out = std::io::BufWriter::new(stdout.lock());
            write_records(&records, &mut out)?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// The manual page: clap_mangen's page for the top level, then the connection options, which
/// only the commands that talk to agentvmd take (so the top level does not list them).
fn manual(out: &mut impl std::io::Write) -> std::io::Result<()> {
    use clap::{Args, CommandFactory};
    clap_mangen::Man::new(Cli::command()).render(out)?;
    let roff = |text: &str| text.replace('\\', "\\\\").replace('-', "\\-");
    writeln!(out, ".SH CONNECTION")?;
    writeln!(
        out,
        "The commands that talk to agentvmd (the session commands, node, journal export) take:"
    )?;
    for arg in Connection::augment_args(clap::Command::new("connection")).get_arguments() {
        let Some(long) = arg.get_long() else { continue };
        let help = arg.get_help().map(ToString::to_string).unwrap_or_default();
        let env = arg
            .get_env()
            .map(|e| format!(" (environment: {})", e.to_string_lossy()))
            .unwrap_or_default();
        writeln!(
            out,
            ".TP\n\\fB\\-\\-{}\\fR\n{}{}",
            roff(long),
            roff(&help),
            env
        )?;
    }
    Ok(())
}

/// A session's records read from the journal database at `db`, with no daemon.
fn read_offline(db: &std::path::Path, session: &str) -> anyhow::Result<Vec<LogRecord>> {
    if !db.exists() {
        anyhow::bail!("journal {} does not exist", db.display());
    }
    let journal = SqliteJournal::open(db, Durability::Full)
        .with_context(|| format!("opening journal {}", db.display()))?;
    if journal.get_session(session)?.is_none() {
        anyhow::bail!("session {session} not found in {}", db.display());
    }
    Ok(journal.read(session, 1, 0)?)
}

/// What a verified chain must also be: non-empty, and ending where the caller expects.
fn check_end(
    records: &[LogRecord],
    expect_head: Option<&str>,
    expect_last_seq: Option<i64>,
) -> Result<(), String> {
    let Some(last) = records.last() else {
        return Err("no records: an empty log proves nothing".into());
    };
    if let Some(seq) = expect_last_seq
        && last.seq != seq
    {
        return Err(format!(
            "the log ends at seq {}, not the expected {seq} (cut short or extended)",
            last.seq
        ));
    }
    if let Some(head) = expect_head
        && last.content_hash != head
    {
        return Err(format!(
            "the last record (seq {}) has content_hash {}, not the expected {head}",
            last.seq, last.content_hash
        ));
    }
    Ok(())
}

fn verify(
    file: &str,
    expect_head: Option<&str>,
    expect_last_seq: Option<i64>,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let mut input = String::new();
    if file == "-" {
        std::io::stdin()
            .read_to_string(&mut input)
            .context("reading stdin")?;
    } else {
        input = std::fs::read_to_string(file).with_context(|| format!("reading {file}"))?;
    }
    let records = match parse_records(&input) {
        Ok(r) => r,
        Err(e) => {
            report(json, false, None, &format!("{file}: {e}"));
            return Ok(ExitCode::from(1));
        }
    };
    if let Err(why) = check_end(&records, expect_head, expect_last_seq) {
        report(json, false, None, &format!("{file}: {why}"));
        return Ok(ExitCode::from(1));
    }
    match verify_chain(&records) {
        Ok(n) => {
            report(
                json,
                true,
                None,
                &format!("{file}: {n} records, chain intact"),
            );
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => {
            report(json, false, Some(e.seq()), &format!("{file}: {e}"));
            Ok(ExitCode::from(1))
        }
    }
}

fn report(json: bool, ok: bool, seq: Option<i64>, message: &str) {
    if json {
        let v = serde_json::json!({"ok": ok, "bad_seq": seq, "message": message});
        outln!("{v}");
    } else if ok {
        outln!("{message}");
    } else {
        eprintln!("{message}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn moved(args: &[&str]) -> Vec<String> {
        connection_options_last(args.iter().map(Into::into).collect())
            .into_iter()
            .map(|a| a.into_string().unwrap())
            .collect()
    }

    #[test]
    fn connection_options_before_the_command_go_after_it() {
        assert_eq!(
            moved(&["agentvm", "--addr", "10.0.0.11:7443", "node", "list"]),
            ["agentvm", "node", "list", "--addr", "10.0.0.11:7443"]
        );
        assert_eq!(
            moved(&["agentvm", "--json", "--token=t", "get", "S"]),
            ["agentvm", "--json", "get", "S", "--token=t"]
        );
        // After the command they are the command's already; a `--` still ends options.
        assert_eq!(
            moved(&["agentvm", "exec", "S", "--addr", "A"]),
            ["agentvm", "exec", "S", "--addr", "A"]
        );
        assert_eq!(
            moved(&["agentvm", "--addr", "A", "exec", "S", "--", "-i"]),
            ["agentvm", "exec", "S", "--addr", "A", "--", "-i"]
        );
    }
}
