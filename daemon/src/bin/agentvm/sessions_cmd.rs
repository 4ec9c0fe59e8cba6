//! The Sessions commands (upstream agentctl's set): create, get, list, exec, replay, fork,
//! suspend, resume, approve, cancel, delete, verify. Human output by default; `--json` prints
//! one proto3-JSON object per line.

use std::collections::HashMap;
use std::io::Write;

use agentvm_proto::canon::to_proto_json;
use agentvm_proto::node::v1::node_client::NodeClient;
use agentvm_proto::node::v1::{ListCheckpointsRequest, ListProjectsRequest};
use agentvm_proto::v1::sessions_client::SessionsClient;
use agentvm_proto::v1::{
    ApproveRequest, CancelRequest, CreateSessionRequest, DeleteSessionRequest, ExecRequest,
    ForkRequest, GetSessionRequest, IdentityRef, ListSessionsRequest, ListSessionsResponse,
    LogRecord, Message, Part, ReplayRequest, ResourceMetadata, ResumeRequest, Session,
    SuspendRequest, TextPart, event::Body, exec_update::Update, part,
};
use agentvmd::client::AuthedChannel;
use agentvmd::journal::verify::verify_chain;
use anyhow::Context;
use clap::Subcommand;

use crate::connection::Connection;

/// Where a command's session comes from: the positional argument or `--session`.
#[derive(clap::Args, Debug, Clone)]
pub struct SessionArg {
    /// The session's uid.
    #[arg(
        value_name = "SESSION",
        required_unless_present = "session_flag",
        value_parser = session_uid
    )]
    positional: Option<String>,
    /// The session's uid (the same as the positional argument).
    #[arg(
        long = "session",
        value_name = "SESSION",
        conflicts_with = "positional",
        value_parser = session_uid
    )]
    session_flag: Option<String>,
}

/// A session uid as given on the command line: never empty. An empty one is almost always a
/// shell variable that the command meant to set it failed (`S=$(agentvm create -q)`), and
/// sent on it would mean "a new session" to Exec.
fn session_uid(s: &str) -> Result<String, String> {
    match s.trim() {
        "" => Err(
            "the session is empty (did the command that set it fail?); to run a turn \
                   on a new session, leave the session out"
                .into(),
        ),
        uid => Ok(uid.to_owned()),
    }
}

impl SessionArg {
    fn uid(self) -> String {
        self.positional.or(self.session_flag).unwrap_or_default()
    }
}

#[derive(Subcommand, Debug, Clone)]
pub enum SessionCommand {
    /// Create a session (no events yet).
    Create {
        /// The harness that runs its turns. Default: the node's default harness.
        #[arg(long)]
        harness: Option<String>,
        /// The project it belongs to. Default: the node's default project.
        #[arg(long)]
        project: Option<String>,
        /// A display name.
        #[arg(long)]
        name: Option<String>,
        /// The model its harness asks for (the chat harness's model).
        #[arg(long)]
        model: Option<String>,
        /// KEY=VALUE, repeatable.
        #[arg(long = "label", value_parser = key_value)]
        labels: Vec<(String, String)>,
        /// Print only the new session's uid (for `S=$(agentvm create -q)`; over --json).
        #[arg(short, long)]
        quiet: bool,
        #[command(flatten)]
        conn: Connection,
    },
    /// Show one session.
    Get {
        #[command(flatten)]
        session: SessionArg,
        #[command(flatten)]
        conn: Connection,
    },
    /// List a project's sessions, newest first.
    List {
        /// The project. Default: the node's default project.
        #[arg(long)]
        project: Option<String>,
        /// Every project's sessions (those the credential may see), newest first, each line
        /// naming its project; every page is fetched.
        #[arg(long, conflicts_with_all = ["project", "page_token"])]
        all_projects: bool,
        /// Sessions per page. Default: the server's page size.
        #[arg(long)]
        page_size: Option<i32>,
        /// Where to go on from (a previous page's `next page` token).
        #[arg(long)]
        page_token: Option<String>,
        #[command(flatten)]
        conn: Connection,
    },
    /// Run one turn and stream its records. Without input it only re-drives a turn that did
    /// not finish (interrupted or FAILED); a session whose last turn completed is refused.
    Exec {
        /// The session's uid. Omitted: a new session with the server's defaults.
        #[arg(value_name = "SESSION", value_parser = session_uid)]
        positional: Option<String>,
        /// The session's uid (the same as the positional argument).
        #[arg(
            long = "session",
            value_name = "SESSION",
            conflicts_with = "positional",
            value_parser = session_uid
        )]
        session_flag: Option<String>,
        /// User input text; repeatable (one INPUT each).
        #[arg(long = "input", short = 'i', value_name = "TEXT", value_parser = input_text)]
        inputs: Vec<String>,
        /// User input read from a file (`-`: standard input), uncapped by the command line;
        /// repeatable, each one INPUT after those of -i.
        #[arg(long = "input-file", value_name = "PATH")]
        input_files: Vec<String>,
        /// The harness for this turn. Default: the session's.
        #[arg(long)]
        harness: Option<String>,
        /// Opaque harness config, journaled verbatim.
        #[arg(long)]
        config: Option<String>,
        /// An opaque cursor for the harness (Start.resume_from_seq), journaled with the turn;
        /// the host does not interpret it. Not negative.
        #[arg(long, value_name = "SEQ")]
        resume_from_seq: Option<i64>,
        /// Compare-and-swap on the head (0 = "no events yet").
        #[arg(long, value_name = "SEQ")]
        expected_last_seq: Option<i64>,
        /// Unix seconds after which the host cancels the turn.
        #[arg(long, value_name = "UNIX_SECONDS")]
        deadline_unix: Option<i64>,
        #[command(flatten)]
        conn: Connection,
    },
    /// Print a session's records (read-only).
    Replay {
        #[command(flatten)]
        session: SessionArg,
        /// The first seq to print. Default: the first record.
        #[arg(long, value_name = "SEQ")]
        from_seq: Option<i64>,
        /// The last seq to print. Default: the head.
        #[arg(long, value_name = "SEQ")]
        to_seq: Option<i64>,
        #[command(flatten)]
        conn: Connection,
    },
    /// Fork children from a point of the log (default: its head). A memory-tier session
    /// forks at its head or at a turn it has a checkpoint of (`agentvm checkpoints`).
    Fork {
        #[command(flatten)]
        session: SessionArg,
        /// How many children.
        #[arg(long, default_value_t = 1)]
        count: i32,
        /// The seq the children start from. Default: the head.
        #[arg(long, visible_alias = "at", value_name = "SEQ")]
        at_seq: Option<i64>,
        /// A child's display name; repeatable, one per child in order.
        #[arg(long = "name")]
        child_names: Vec<String>,
        /// KEY=VALUE for every child, repeatable.
        #[arg(long = "label", value_parser = key_value)]
        labels: Vec<(String, String)>,
        /// Print only the children's uids, one a line (over --json).
        #[arg(short, long)]
        quiet: bool,
        #[command(flatten)]
        conn: Connection,
    },
    /// The turns a memory-tier session can be forked at besides its head (`fork --at SEQ`):
    /// its checkpoints, oldest first.
    Checkpoints {
        #[command(flatten)]
        session: SessionArg,
        #[command(flatten)]
        conn: Connection,
    },
    /// Snapshot the session's compute and stop it (memory tier: COLD, resumable anywhere
    /// its snapshot is).
    Suspend {
        #[command(flatten)]
        session: SessionArg,
        #[command(flatten)]
        conn: Connection,
    },
    /// Bring a suspended session's compute back (its next turn would too).
    Resume {
        #[command(flatten)]
        session: SessionArg,
        #[command(flatten)]
        conn: Connection,
    },
    /// Decide a pending approval, then resume the session.
    Approve {
        #[command(flatten)]
        session: SessionArg,
        /// The execution that asked.
        #[arg(long)]
        execution_id: String,
        /// The tool call awaiting the decision.
        #[arg(long)]
        tool_call_id: String,
        /// The seq of the approval request record.
        #[arg(long)]
        request_seq: i64,
        /// Deny instead of approve.
        #[arg(long)]
        deny: bool,
        /// Why, recorded with the decision.
        #[arg(long)]
        reason: Option<String>,
        /// The decider's principal, recorded as the decision's actor.
        #[arg(long)]
        principal: Option<String>,
        /// Only record the decision; do not resume.
        #[arg(long)]
        no_resume: bool,
        #[command(flatten)]
        conn: Connection,
    },
    /// Stop the running or interrupted execution.
    Cancel {
        #[command(flatten)]
        session: SessionArg,
        /// The execution to stop. Default: the current one.
        #[arg(long)]
        execution_id: Option<String>,
        /// Why, recorded with the cancellation.
        #[arg(long)]
        reason: Option<String>,
        #[command(flatten)]
        conn: Connection,
    },
    /// Delete a session: stop its compute, free its snapshots, keep its log as a tombstone.
    Delete {
        #[command(flatten)]
        session: SessionArg,
        #[command(flatten)]
        conn: Connection,
    },
    /// Fetch a session's log and verify its hash chain.
    Verify {
        #[command(flatten)]
        session: SessionArg,
        #[command(flatten)]
        conn: Connection,
    },
}

impl SessionCommand {
    fn connection(&self) -> &Connection {
        match self {
            Self::Create { conn, .. }
            | Self::Get { conn, .. }
            | Self::List { conn, .. }
            | Self::Exec { conn, .. }
            | Self::Replay { conn, .. }
            | Self::Fork { conn, .. }
            | Self::Checkpoints { conn, .. }
            | Self::Suspend { conn, .. }
            | Self::Resume { conn, .. }
            | Self::Approve { conn, .. }
            | Self::Cancel { conn, .. }
            | Self::Delete { conn, .. }
            | Self::Verify { conn, .. } => conn,
        }
    }
}

/// An input as given with -i: not empty (an empty shell variable, most likely), which would
/// be journaled as an empty user message.
fn input_text(s: &str) -> Result<String, String> {
    match s.is_empty() {
        true => Err("an input may not be empty; leave -i out to re-drive a turn".into()),
        false => Ok(s.to_owned()),
    }
}

fn key_value(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .filter(|(k, _)| !k.is_empty())
        .ok_or_else(|| format!("{s:?} is not KEY=VALUE"))
}

fn user_text(text: &str) -> Message {
    Message {
        role: "user".into(),
        parts: vec![Part {
            part: Some(part::Part::Text(TextPart { text: text.into() })),
        }],
    }
}

fn print_json<M: prost::Message + prost::Name>(m: &M) -> anyhow::Result<()> {
    let v = to_proto_json(m).context("rendering JSON")?;
    outln!("{v}");
    Ok(())
}

fn session_line(s: &Session, full: bool) -> String {
    let m = s.metadata.clone().unwrap_or_default();
    let exec = agentvm_proto::v1::ExecState::try_from(s.exec_state)
        .map(|e| e.as_str_name().trim_start_matches("EXEC_").to_owned())
        .unwrap_or_default();
    let compute = agentvm_proto::v1::ComputeState::try_from(s.compute_state)
        .map(|c| c.as_str_name().trim_start_matches("COMPUTE_").to_owned())
        .unwrap_or_default();
    let mut line = format!(
        "{}  harness={} exec={exec} compute={compute} last_seq={}",
        m.uid, s.harness, s.last_seq
    );
    if !m.name.is_empty() {
        line.push_str(&format!(" name={}", shown(&m.name, full)));
    }
    if !s.parent_uid.is_empty() {
        line.push_str(&format!(" parent={}@{}", s.parent_uid, s.fork_seq));
    }
    if let Some(p) = &s.pending_approval {
        line.push_str(&format!(
            " pending_approval=execution:{} call:{} request_seq:{}",
            p.execution_id, p.tool_call_id, p.request_seq
        ));
    }
    line
}

fn record_line(r: &LogRecord, full: bool) -> String {
    let Some(e) = &r.event else {
        return format!("{:>5}  (no event)", r.seq);
    };
    let kind = agentvm_proto::v1::EventKind::try_from(e.kind)
        .map(|k| k.as_str_name().trim_start_matches("EVENT_").to_owned())
        .unwrap_or_else(|_| e.kind.to_string());
    let detail = match &e.body {
        Some(Body::Message(m)) => format!(
            "{}: {}",
            m.role,
            m.parts
                .iter()
                .filter_map(|p| match &p.part {
                    Some(part::Part::Text(t)) => Some(t.text.as_str()),
                    _ => None,
                })
                .collect::<String>()
        ),
        Some(Body::Tool(t)) => format!("{} id={}", t.tool, t.id),
        Some(Body::Result(t)) => format!("id={} error={}", t.id, t.is_error),
        Some(Body::End(end)) => end.state.clone(),
        Some(Body::Error(err)) => err.description.clone(),
        Some(Body::Model(m)) => format!("model={}", m.model),
        Some(Body::Approval(a)) => format!("call={}", a.tool_call_id),
        Some(Body::ApprovalResult(a)) => format!("call={} approved={}", a.tool_call_id, a.approved),
        // Its detail too: a loss notice, a fork's parent, why it was suspended.
        Some(Body::Lifecycle(l)) => {
            let kind = agentvm_proto::v1::lifecycle::Kind::try_from(l.kind)
                .map(|k| k.as_str_name().trim_start_matches("LIFECYCLE_").to_owned())
                .unwrap_or_default();
            format!("{kind} {}", l.detail)
        }
        _ => String::new(),
    };
    format!("{:>5}  {kind:<16} {}", r.seq, shown(&detail, full))
        .trim_end()
        .to_owned()
}

fn uid_of(s: &Session) -> &str {
    s.metadata.as_ref().map_or("", |m| m.uid.as_str())
}

fn show_session(s: &Session, json: bool, full: bool) -> anyhow::Result<()> {
    if json {
        print_json(s)
    } else {
        outln!("{}", session_line(s, full));
        Ok(())
    }
}

/// How much of a payload human output shows without `--full`.
const SHOWN_CHARS: usize = 160;

/// `text` on one line, cut to [`SHOWN_CHARS`] unless `full`.
fn shown(text: &str, full: bool) -> String {
    if full {
        return text.to_owned();
    }
    let flat: String = text
        .chars()
        .map(|c| if c == '\n' { ' ' } else { c })
        .collect();
    match flat.char_indices().nth(SHOWN_CHARS) {
        Some((at, _)) => format!(
            "{}… ({} more characters; --full shows all)",
            &flat[..at],
            flat[at..].chars().count()
        ),
        None => flat,
    }
}

/// The text of one input, from a file or (`-`) standard input.
fn read_input(path: &str) -> anyhow::Result<String> {
    use std::io::Read;
    let mut text = String::new();
    match path {
        "-" => {
            std::io::stdin()
                .read_to_string(&mut text)
                .context("--input-file -: reading standard input")?;
        }
        path => {
            text = std::fs::read_to_string(path).with_context(|| format!("--input-file {path}"))?;
        }
    }
    Ok(text)
}

/// Refuses, before anything runs, a turn that would run empty (no input and nothing
/// interrupted to re-drive) or start from a seq the log does not have.
async fn check_exec(
    c: &mut SessionsClient<AuthedChannel>,
    session: &str,
    no_input: bool,
    resume_from_seq: i64,
) -> anyhow::Result<()> {
    if session.is_empty() {
        anyhow::ensure!(
            !no_input,
            "no input: give -i TEXT or --input-file PATH (a new session has no turn to re-drive)"
        );
        anyhow::ensure!(
            resume_from_seq == 0,
            "--resume-from-seq {resume_from_seq}: a new session has no records"
        );
        return Ok(());
    }
    let s = c
        .get_session(GetSessionRequest {
            uid: session.to_owned(),
        })
        .await?
        .into_inner();
    anyhow::ensure!(
        resume_from_seq <= s.last_seq,
        "--resume-from-seq {resume_from_seq} is beyond the log of {session}, whose head is {}",
        s.last_seq
    );
    use agentvm_proto::v1::ExecState;
    // What an inputless Exec re-drives: an execution that did not finish (a FAILED one
    // included). A session with no execution yet, or whose last one ended, has nothing.
    let interrupted = match ExecState::try_from(s.exec_state) {
        Ok(ExecState::ExecRunning | ExecState::ExecAwaiting | ExecState::ExecFailed) => true,
        Ok(ExecState::ExecPending) => s.last_seq > 0,
        _ => false,
    };
    anyhow::ensure!(
        !no_input || interrupted,
        "no input: give -i TEXT or --input-file PATH; without input exec only re-drives an \
         interrupted turn, and {session}'s last turn is {}",
        ExecState::try_from(s.exec_state)
            .map(|e| e.as_str_name().trim_start_matches("EXEC_").to_owned())
            .unwrap_or_default()
    );
    Ok(())
}

/// How a command prints: `--json` (proto3 JSON, one object per line), and for people, whole
/// payloads (`--full`) or cut to a line.
#[derive(Debug, Clone, Copy)]
pub struct Output {
    pub json: bool,
    pub full: bool,
}

pub async fn run(output: Output, cmd: SessionCommand) -> anyhow::Result<()> {
    let Output { json, full } = output;
    let channel = cmd.connection().connect().await?;
    let mut c = SessionsClient::new(channel.clone());
    match cmd {
        SessionCommand::Create {
            harness,
            project,
            name,
            model,
            labels,
            quiet,
            ..
        } => {
            let s = c
                .create_session(CreateSessionRequest {
                    session: Some(Session {
                        metadata: Some(ResourceMetadata {
                            project: project.unwrap_or_default(),
                            name: name.unwrap_or_default(),
                            ..Default::default()
                        }),
                        harness: harness.unwrap_or_default(),
                        model: model.unwrap_or_default(),
                        labels: labels.into_iter().collect(),
                        ..Default::default()
                    }),
                })
                .await?
                .into_inner();
            if quiet {
                outln!("{}", uid_of(&s));
                return Ok(());
            }
            show_session(&s, json, full)
        }
        SessionCommand::Get { session, .. } => {
            let s = c
                .get_session(GetSessionRequest { uid: session.uid() })
                .await?
                .into_inner();
            show_session(&s, json, full)
        }
        SessionCommand::List {
            all_projects: true,
            page_size,
            ..
        } => {
            let sessions = every_project(&mut c, channel, page_size.unwrap_or_default()).await?;
            if json {
                return print_json(&ListSessionsResponse {
                    sessions,
                    next_page_token: String::new(),
                });
            }
            for s in &sessions {
                let project = s.metadata.as_ref().map_or("", |m| m.project.as_str());
                outln!("{}  project={project}", session_line(s, full));
            }
            Ok(())
        }
        SessionCommand::List {
            project,
            page_size,
            page_token,
            ..
        } => {
            let r = c
                .list_sessions(ListSessionsRequest {
                    project: project.unwrap_or_default(),
                    page_size: page_size.unwrap_or_default(),
                    page_token: page_token.unwrap_or_default(),
                })
                .await?
                .into_inner();
            if json {
                return print_json(&r);
            }
            for s in &r.sessions {
                outln!("{}", session_line(s, full));
            }
            if !r.next_page_token.is_empty() {
                outln!("next page: --page-token {}", r.next_page_token);
            }
            Ok(())
        }
        SessionCommand::Exec {
            positional,
            session_flag,
            inputs,
            input_files,
            harness,
            config,
            resume_from_seq,
            expected_last_seq,
            deadline_unix,
            ..
        } => {
            let session = positional.or(session_flag).unwrap_or_default();
            let mut texts = inputs;
            for path in &input_files {
                texts.push(read_input(path)?);
            }
            let resume_from_seq = resume_from_seq.unwrap_or_default();
            check_exec(&mut c, &session, texts.is_empty(), resume_from_seq).await?;
            let req = ExecRequest {
                session,
                inputs: texts.iter().map(|t| user_text(t)).collect(),
                resume_from_seq,
                harness: harness.unwrap_or_default(),
                config: config.unwrap_or_default().into_bytes(),
                expected_last_seq,
                deadline_unix: deadline_unix.unwrap_or_default(),
            };
            exec(&mut c, req, json, full).await
        }
        SessionCommand::Replay {
            session,
            from_seq,
            to_seq,
            ..
        } => {
            let records = replay(
                &mut c,
                session.uid(),
                from_seq.unwrap_or_default(),
                to_seq.unwrap_or_default(),
            )
            .await?;
            for r in records {
                if json {
                    print_json(&r)?;
                } else {
                    outln!("{}", record_line(&r, full));
                }
            }
            Ok(())
        }
        SessionCommand::Fork {
            session,
            count,
            at_seq,
            child_names,
            labels,
            quiet,
            ..
        } => {
            let r = c
                .fork(ForkRequest {
                    session: session.uid(),
                    at_seq: at_seq.unwrap_or_default(),
                    count,
                    identity: None,
                    labels: labels.into_iter().collect::<HashMap<_, _>>(),
                    child_names,
                })
                .await?
                .into_inner();
            for s in &r.children {
                match quiet {
                    true => outln!("{}", uid_of(s)),
                    false => show_session(s, json, full)?,
                }
            }
            Ok(())
        }
        SessionCommand::Checkpoints { session, .. } => {
            let checkpoints = NodeClient::new(channel)
                .list_checkpoints(ListCheckpointsRequest {
                    session: session.uid(),
                })
                .await?
                .into_inner()
                .checkpoints;
            for c in &checkpoints {
                if json {
                    outln!(
                        "{}",
                        serde_json::json!({
                            "seq": c.seq,
                            "turn": c.turn,
                            "snapshot": c.snapshot,
                            "bytes": c.bytes,
                            "created_at_unix_nanos": c.created_at_unix_nanos,
                        })
                    );
                } else {
                    outln!(
                        "seq {:>6}  turn {:>5}  {:>10} bytes  {}",
                        c.seq,
                        c.turn,
                        c.bytes,
                        c.snapshot
                    );
                }
            }
            Ok(())
        }
        SessionCommand::Suspend { session, .. } => {
            let s = c
                .suspend(SuspendRequest {
                    session: session.uid(),
                })
                .await?
                .into_inner();
            show_session(&s, json, full)
        }
        SessionCommand::Resume { session, .. } => {
            let s = c
                .resume(ResumeRequest {
                    session: session.uid(),
                    boot: false,
                })
                .await?
                .into_inner();
            show_session(&s, json, full)
        }
        SessionCommand::Approve {
            session,
            execution_id,
            tool_call_id,
            request_seq,
            deny,
            reason,
            principal,
            no_resume,
            ..
        } => {
            let session = session.uid();
            let r = c
                .approve(ApproveRequest {
                    session: session.clone(),
                    execution_id,
                    tool_call_id,
                    request_seq,
                    approved: Some(!deny),
                    reason: reason.unwrap_or_default(),
                    identity: principal
                        .filter(|p| !p.is_empty())
                        .map(|principal| IdentityRef {
                            principal,
                            ..Default::default()
                        }),
                })
                .await?
                .into_inner();
            if json {
                print_json(&r)?;
            } else if let Some(d) = &r.decision {
                outln!("decision committed: {}", record_line(d, full));
            }
            if no_resume {
                return Ok(());
            }
            match c
                .resume(ResumeRequest {
                    session,
                    boot: false,
                })
                .await
            {
                Ok(s) => show_session(&s.into_inner(), json, full),
                Err(e) => anyhow::bail!(
                    "decision committed, resume failed: {:?}: {}",
                    e.code(),
                    e.message()
                ),
            }
        }
        SessionCommand::Cancel {
            session,
            execution_id,
            reason,
            ..
        } => {
            let s = c
                .cancel(CancelRequest {
                    session: session.uid(),
                    execution_id: execution_id.unwrap_or_default(),
                    reason: reason.unwrap_or_default(),
                })
                .await?
                .into_inner();
            show_session(&s, json, full)
        }
        SessionCommand::Delete { session, .. } => {
            let s = c
                .delete_session(DeleteSessionRequest { uid: session.uid() })
                .await?
                .into_inner();
            show_session(&s, json, full)
        }
        SessionCommand::Verify { session, .. } => {
            let session = session.uid();
            let records = replay(&mut c, session.clone(), 0, 0).await?;
            match verify_chain(&records) {
                Ok(n) => {
                    if json {
                        outln!("{}", serde_json::json!({"ok": true, "records": n}));
                    } else {
                        outln!("{session}: {n} records, chain intact");
                    }
                    Ok(())
                }
                Err(e) => anyhow::bail!("{session}: {e}"),
            }
        }
    }
}

/// Every session of every project the node lists for this credential, newest first (ties by
/// uid, as ListSessions orders one project).
async fn every_project(
    c: &mut SessionsClient<AuthedChannel>,
    channel: AuthedChannel,
    page_size: i32,
) -> anyhow::Result<Vec<Session>> {
    let projects = NodeClient::new(channel)
        .list_projects(ListProjectsRequest {})
        .await?
        .into_inner()
        .projects;
    let mut sessions = Vec::new();
    for project in projects {
        let mut page_token = String::new();
        loop {
            let page = c
                .list_sessions(ListSessionsRequest {
                    project: project.name.clone(),
                    page_size,
                    page_token,
                })
                .await?
                .into_inner();
            sessions.extend(page.sessions);
            if page.next_page_token.is_empty() {
                break;
            }
            page_token = page.next_page_token;
        }
    }
    let created = |s: &Session| {
        s.metadata
            .as_ref()
            .and_then(|m| m.create_time)
            .map(|t| (t.seconds, t.nanos))
    };
    let uid = |s: &Session| {
        s.metadata
            .as_ref()
            .map(|m| m.uid.clone())
            .unwrap_or_default()
    };
    sessions.sort_by(|a, b| {
        created(b)
            .cmp(&created(a))
            .then_with(|| uid(a).cmp(&uid(b)))
    });
    Ok(sessions)
}

/// A session's whole log, through the API.
pub async fn fetch_log(conn: &Connection, session: &str) -> anyhow::Result<Vec<LogRecord>> {
    let mut c = SessionsClient::new(conn.connect().await?);
    replay(&mut c, session.to_owned(), 0, 0).await
}

async fn replay(
    c: &mut SessionsClient<AuthedChannel>,
    session: String,
    from_seq: i64,
    to_seq: i64,
) -> anyhow::Result<Vec<LogRecord>> {
    let mut stream = c
        .replay(ReplayRequest {
            session,
            from_seq,
            to_seq,
        })
        .await?
        .into_inner();
    let mut out = Vec::new();
    while let Some(r) = stream.message().await? {
        out.push(r);
    }
    Ok(out)
}

/// What a turn's stream ending in `status` means for its user: a connection to agentvmd that
/// broke mid-turn (the daemon killed or restarted) is an interruption, said so with how to go
/// on, not "Unknown: h2 protocol error"; any other status is the turn's own answer.
fn interrupted(status: tonic::Status, session: Option<&str>) -> anyhow::Error {
    let message = status.message();
    let broken = matches!(
        status.code(),
        tonic::Code::Unknown | tonic::Code::Unavailable
    ) && (message.contains("h2 protocol error")
        || message.contains("transport error")
        || message.contains("connection"));
    match (broken, session) {
        (true, Some(uid)) => anyhow::anyhow!(
            "the turn was interrupted: the connection to agentvmd broke ({message}). What it \
             journaled is kept; once agentvmd answers again, re-drive the turn with \
             `agentvm exec {uid}` (no input)"
        ),
        _ => status.into(),
    }
}

async fn exec(
    c: &mut SessionsClient<AuthedChannel>,
    req: ExecRequest,
    json: bool,
    full: bool,
) -> anyhow::Result<()> {
    let mut stream = c.exec(req).await?.into_inner();
    let mut streaming_delta = false;
    let stdout = std::io::stdout();
    // The session, and whether the stream ended with it (it does only after an approval
    // park, as upstream's): otherwise its state after the turn is asked for, so the output
    // always ends with where the session stands.
    let mut session: Option<String> = None;
    let mut ended_with_session = false;
    loop {
        let u = match stream.message().await {
            Ok(Some(u)) => u,
            Ok(None) => break,
            Err(status) => return Err(interrupted(status, session.as_deref())),
        };
        let Some(update) = u.update else { continue };
        if let Update::Session(s) = &update {
            session.get_or_insert_with(|| {
                s.metadata
                    .as_ref()
                    .map(|m| m.uid.clone())
                    .unwrap_or_default()
            });
        }
        ended_with_session = matches!(update, Update::Session(_));
        if json {
            print_json(&agentvm_proto::v1::ExecUpdate {
                update: Some(update),
            })?;
            continue;
        }
        match update {
            Update::Session(s) => {
                if streaming_delta {
                    outln!();
                    streaming_delta = false;
                }
                outln!("session {}", session_line(&s, full));
            }
            Update::Record(r) => {
                if streaming_delta {
                    outln!();
                    streaming_delta = false;
                }
                outln!("{}", record_line(&r, full));
            }
            Update::Delta(d) => {
                let mut out = stdout.lock();
                write!(out, "{}", d.chunk)?;
                out.flush()?;
                streaming_delta = !d.done;
                if d.done {
                    writeln!(out)?;
                }
            }
        }
    }
    if let (false, Some(uid)) = (ended_with_session, session) {
        let s = c.get_session(GetSessionRequest { uid }).await?.into_inner();
        match json {
            true => print_json(&agentvm_proto::v1::ExecUpdate {
                update: Some(Update::Session(s)),
            })?,
            false => outln!("session {}", session_line(&s, full)),
        }
    }
    Ok(())
}
