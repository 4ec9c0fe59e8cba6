//! The Sessions commands (upstream agentctl's set): create, get, list, exec, replay, fork,
//! suspend, resume, approve, cancel, delete, verify. Human output by default; `--json` prints
//! one proto3-JSON object per line.

use std::collections::HashMap;
use std::io::Write;

use agentvm_proto::canon::to_proto_json;
use agentvm_proto::v1::sessions_client::SessionsClient;
use agentvm_proto::v1::{
    ApproveRequest, CancelRequest, CreateSessionRequest, DeleteSessionRequest, ExecRequest,
    ForkRequest, GetSessionRequest, IdentityRef, ListSessionsRequest, LogRecord, Message, Part,
    ReplayRequest, ResourceMetadata, ResumeRequest, Session, SuspendRequest, TextPart, event::Body,
    exec_update::Update, part,
};
use agentvmd::client::AuthedChannel;
use agentvmd::config::ListenAddr;
use agentvmd::journal::verify::verify_chain;
use anyhow::Context;
use clap::Subcommand;

#[derive(Subcommand, Debug, Clone)]
pub enum SessionCommand {
    /// Create a session (no events yet).
    Create {
        #[arg(long, default_value = "")]
        harness: String,
        #[arg(long, default_value = "")]
        project: String,
        #[arg(long, default_value = "")]
        name: String,
        #[arg(long, default_value = "")]
        model: String,
        /// KEY=VALUE, repeatable.
        #[arg(long = "label", value_parser = key_value)]
        labels: Vec<(String, String)>,
    },
    /// Show one session.
    Get {
        session: String,
    },
    /// List a project's sessions, newest first.
    List {
        #[arg(long, default_value = "")]
        project: String,
        #[arg(long, default_value_t = 0)]
        page_size: i32,
        #[arg(long, default_value = "")]
        page_token: String,
    },
    /// Run one turn and stream its records; no input re-drives an interrupted turn.
    Exec {
        /// Session uid; omitted = create one with the server defaults.
        #[arg(long, default_value = "")]
        session: String,
        /// User input text; repeatable (one INPUT each).
        #[arg(long = "input", short = 'i')]
        inputs: Vec<String>,
        #[arg(long, default_value = "")]
        harness: String,
        /// Opaque harness config, journaled verbatim.
        #[arg(long, default_value = "")]
        config: String,
        #[arg(long, default_value_t = 0)]
        resume_from_seq: i64,
        /// Compare-and-swap on the head (0 = "no events yet").
        #[arg(long)]
        expected_last_seq: Option<i64>,
        /// Unix seconds after which the host cancels the turn.
        #[arg(long, default_value_t = 0)]
        deadline_unix: i64,
    },
    /// Print a session's records (read-only).
    Replay {
        session: String,
        #[arg(long, default_value_t = 0)]
        from_seq: i64,
        #[arg(long, default_value_t = 0)]
        to_seq: i64,
    },
    /// Fork children from a point of the log (default: its head).
    Fork {
        session: String,
        #[arg(long, default_value_t = 1)]
        count: i32,
        #[arg(long, default_value_t = 0)]
        at_seq: i64,
        #[arg(long = "name")]
        child_names: Vec<String>,
        #[arg(long = "label", value_parser = key_value)]
        labels: Vec<(String, String)>,
    },
    Suspend {
        session: String,
    },
    Resume {
        session: String,
    },
    /// Decide a pending approval, then resume the session.
    Approve {
        session: String,
        #[arg(long)]
        execution_id: String,
        #[arg(long)]
        tool_call_id: String,
        #[arg(long)]
        request_seq: i64,
        /// Deny instead of approve.
        #[arg(long)]
        deny: bool,
        #[arg(long, default_value = "")]
        reason: String,
        /// The decider's principal, recorded as the decision's actor.
        #[arg(long, default_value = "")]
        principal: String,
        /// Only record the decision; do not resume.
        #[arg(long)]
        no_resume: bool,
    },
    /// Stop the running or interrupted execution.
    Cancel {
        session: String,
        #[arg(long, default_value = "")]
        execution_id: String,
        #[arg(long, default_value = "")]
        reason: String,
    },
    Delete {
        session: String,
    },
    /// Fetch a session's log and verify its hash chain.
    Verify {
        session: String,
    },
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
    println!("{v}");
    Ok(())
}

fn session_line(s: &Session) -> String {
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
        line.push_str(&format!(" name={}", m.name));
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

fn record_line(r: &LogRecord) -> String {
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
        Some(Body::Lifecycle(l)) => agentvm_proto::v1::lifecycle::Kind::try_from(l.kind)
            .map(|k| k.as_str_name().trim_start_matches("LIFECYCLE_").to_owned())
            .unwrap_or_default(),
        _ => String::new(),
    };
    format!("{:>5}  {kind:<16} {detail}", r.seq)
}

fn show_session(s: &Session, json: bool) -> anyhow::Result<()> {
    if json {
        print_json(s)
    } else {
        println!("{}", session_line(s));
        Ok(())
    }
}

pub async fn run(
    addr: &ListenAddr,
    creds: &agentvmd::client::Credentials,
    json: bool,
    cmd: SessionCommand,
) -> anyhow::Result<()> {
    let channel = agentvmd::client::connect_with(addr, creds).await?;
    let mut c =
        SessionsClient::with_interceptor(channel, agentvmd::client::bearer(creds.token.clone())?);
    match cmd {
        SessionCommand::Create {
            harness,
            project,
            name,
            model,
            labels,
        } => {
            let s = c
                .create_session(CreateSessionRequest {
                    session: Some(Session {
                        metadata: Some(ResourceMetadata {
                            project,
                            name,
                            ..Default::default()
                        }),
                        harness,
                        model,
                        labels: labels.into_iter().collect(),
                        ..Default::default()
                    }),
                })
                .await?
                .into_inner();
            show_session(&s, json)
        }
        SessionCommand::Get { session } => {
            let s = c
                .get_session(GetSessionRequest { uid: session })
                .await?
                .into_inner();
            show_session(&s, json)
        }
        SessionCommand::List {
            project,
            page_size,
            page_token,
        } => {
            let r = c
                .list_sessions(ListSessionsRequest {
                    project,
                    page_size,
                    page_token,
                })
                .await?
                .into_inner();
            if json {
                return print_json(&r);
            }
            for s in &r.sessions {
                println!("{}", session_line(s));
            }
            if !r.next_page_token.is_empty() {
                println!("next page: --page-token {}", r.next_page_token);
            }
            Ok(())
        }
        SessionCommand::Exec {
            session,
            inputs,
            harness,
            config,
            resume_from_seq,
            expected_last_seq,
            deadline_unix,
        } => {
            let req = ExecRequest {
                session,
                inputs: inputs.iter().map(|t| user_text(t)).collect(),
                resume_from_seq,
                harness,
                config: config.into_bytes(),
                expected_last_seq,
                deadline_unix,
            };
            exec(&mut c, req, json).await
        }
        SessionCommand::Replay {
            session,
            from_seq,
            to_seq,
        } => {
            for r in replay(&mut c, session, from_seq, to_seq).await? {
                if json {
                    print_json(&r)?;
                } else {
                    println!("{}", record_line(&r));
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
        } => {
            let r = c
                .fork(ForkRequest {
                    session,
                    at_seq,
                    count,
                    identity: None,
                    labels: labels.into_iter().collect::<HashMap<_, _>>(),
                    child_names,
                })
                .await?
                .into_inner();
            for s in &r.children {
                show_session(s, json)?;
            }
            Ok(())
        }
        SessionCommand::Suspend { session } => {
            let s = c.suspend(SuspendRequest { session }).await?.into_inner();
            show_session(&s, json)
        }
        SessionCommand::Resume { session } => {
            let s = c
                .resume(ResumeRequest {
                    session,
                    boot: false,
                })
                .await?
                .into_inner();
            show_session(&s, json)
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
        } => {
            let r = c
                .approve(ApproveRequest {
                    session: session.clone(),
                    execution_id,
                    tool_call_id,
                    request_seq,
                    approved: Some(!deny),
                    reason,
                    identity: (!principal.is_empty()).then(|| IdentityRef {
                        principal,
                        ..Default::default()
                    }),
                })
                .await?
                .into_inner();
            if json {
                print_json(&r)?;
            } else if let Some(d) = &r.decision {
                println!("decision committed: {}", record_line(d));
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
                Ok(s) => show_session(&s.into_inner(), json),
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
        } => {
            let s = c
                .cancel(CancelRequest {
                    session,
                    execution_id,
                    reason,
                })
                .await?
                .into_inner();
            show_session(&s, json)
        }
        SessionCommand::Delete { session } => {
            let s = c
                .delete_session(DeleteSessionRequest { uid: session })
                .await?
                .into_inner();
            show_session(&s, json)
        }
        SessionCommand::Verify { session } => {
            let records = replay(&mut c, session.clone(), 0, 0).await?;
            match verify_chain(&records) {
                Ok(n) => {
                    if json {
                        println!("{}", serde_json::json!({"ok": true, "records": n}));
                    } else {
                        println!("{session}: {n} records, chain intact");
                    }
                    Ok(())
                }
                Err(e) => anyhow::bail!("{session}: {e}"),
            }
        }
    }
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

async fn exec(
    c: &mut SessionsClient<AuthedChannel>,
    req: ExecRequest,
    json: bool,
) -> anyhow::Result<()> {
    let mut stream = c.exec(req).await?.into_inner();
    let mut streaming_delta = false;
    let stdout = std::io::stdout();
    while let Some(u) = stream.message().await? {
        let Some(update) = u.update else { continue };
        if json {
            print_json(&agentvm_proto::v1::ExecUpdate {
                update: Some(update),
            })?;
            continue;
        }
        match update {
            Update::Session(s) => {
                if streaming_delta {
                    println!();
                    streaming_delta = false;
                }
                println!("session {}", session_line(&s));
            }
            Update::Record(r) => {
                if streaming_delta {
                    println!();
                    streaming_delta = false;
                }
                println!("{}", record_line(&r));
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
    Ok(())
}
