//! The Sessions API calls the scenarios make, with errors that say which call failed.

use std::time::{Duration, Instant};

use agentvm_proto::v1::sessions_client::SessionsClient;
use agentvm_proto::v1::{
    ComputeState, CreateSessionRequest, DeleteSessionRequest, ExecRequest, ExecUpdate, ForkRequest,
    GetSessionRequest, LogRecord, Message, Part, ReplayRequest, ResumeRequest, Session,
    SuspendRequest, TextPart, event::Body, exec_update::Update, part,
};
use anyhow::{Context, bail};
use tonic::transport::Channel;

pub type Client = SessionsClient<Channel>;

pub async fn create(c: &mut Client, harness: &str) -> anyhow::Result<String> {
    create_with(c, harness, &[]).await
}

/// A session of `harness` with `annotations`.
pub async fn create_with(
    c: &mut Client,
    harness: &str,
    annotations: &[(&str, &str)],
) -> anyhow::Result<String> {
    let session = c
        .create_session(CreateSessionRequest {
            session: Some(Session {
                harness: harness.into(),
                annotations: annotations
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
                ..Default::default()
            }),
        })
        .await
        .with_context(|| format!("CreateSession({harness})"))?
        .into_inner();
    Ok(session.metadata.unwrap_or_default().uid)
}

fn exec_request(session: &str, text: &str) -> ExecRequest {
    ExecRequest {
        session: session.into(),
        inputs: vec![Message {
            role: "user".into(),
            parts: vec![Part {
                part: Some(part::Part::Text(TextPart { text: text.into() })),
            }],
        }],
        ..Default::default()
    }
}

/// One turn with input `text`; the assistant's text output.
pub async fn say(c: &mut Client, session: &str, text: &str) -> anyhow::Result<String> {
    let mut stream = c
        .exec(exec_request(session, text))
        .await
        .with_context(|| format!("Exec({session}, {text:?})"))?
        .into_inner();
    let mut out = String::new();
    while let Some(ExecUpdate { update }) = stream
        .message()
        .await
        .with_context(|| format!("Exec({session}, {text:?}) stream"))?
    {
        if let Some(Update::Record(record)) = update
            && let Some(Body::Message(m)) = record.event.and_then(|e| e.body)
            && m.role == "assistant"
        {
            for p in m.parts {
                if let Some(part::Part::Text(t)) = p.part {
                    out.push_str(&t.text);
                }
            }
        }
    }
    Ok(out)
}

/// One turn that must fail; how it failed (the status message). `started` fires once the
/// turn's records are durable (its INPUT is journaled: the harness has it).
pub async fn failing_turn(
    mut c: Client,
    session: String,
    text: String,
    started: Option<tokio::sync::oneshot::Sender<()>>,
) -> anyhow::Result<String> {
    let mut started = started;
    let mut stream = match c.exec(exec_request(&session, &text)).await {
        Err(status) => return Ok(status.message().to_owned()),
        Ok(stream) => stream.into_inner(),
    };
    loop {
        match stream.message().await {
            Ok(Some(ExecUpdate {
                update: Some(Update::Record(record)),
            })) => {
                let input = record
                    .event
                    .is_some_and(|e| e.kind == agentvm_proto::v1::EventKind::EventInput as i32);
                if input && let Some(started) = started.take() {
                    let _ = started.send(());
                }
            }
            Ok(Some(_)) => continue,
            Ok(None) => bail!("the turn {text:?} on {session} succeeded"),
            Err(status) => return Ok(status.message().to_owned()),
        }
    }
}

pub async fn replay(c: &mut Client, session: &str) -> anyhow::Result<Vec<LogRecord>> {
    let mut stream = c
        .replay(ReplayRequest {
            session: session.into(),
            ..Default::default()
        })
        .await
        .with_context(|| format!("Replay({session})"))?
        .into_inner();
    let mut records = Vec::new();
    while let Some(r) = stream.message().await? {
        records.push(r);
    }
    Ok(records)
}

/// The session's log replays and its hash chain verifies.
pub async fn verify(c: &mut Client, session: &str) -> anyhow::Result<usize> {
    let records = replay(c, session).await?;
    agentvmd::journal::verify::verify_chain(&records)
        .map_err(|e| anyhow::anyhow!("the chain of {session} does not verify: {e}"))?;
    Ok(records.len())
}

pub async fn compute(c: &mut Client, session: &str) -> anyhow::Result<ComputeState> {
    let s = c
        .get_session(GetSessionRequest {
            uid: session.into(),
        })
        .await
        .with_context(|| format!("GetSession({session})"))?
        .into_inner();
    Ok(ComputeState::try_from(s.compute_state).unwrap_or(ComputeState::Unspecified))
}

pub async fn wait_compute(
    c: &mut Client,
    session: &str,
    want: ComputeState,
    within: Duration,
) -> anyhow::Result<()> {
    let started = Instant::now();
    loop {
        let now = compute(c, session).await?;
        if now == want {
            return Ok(());
        }
        if started.elapsed() > within {
            bail!("{session} reads {now:?}, not {want:?}, after {within:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

pub async fn suspend(c: &mut Client, session: &str) -> anyhow::Result<()> {
    c.suspend(SuspendRequest {
        session: session.into(),
    })
    .await
    .with_context(|| format!("Suspend({session})"))?;
    Ok(())
}

pub async fn resume(c: &mut Client, session: &str) -> anyhow::Result<()> {
    c.resume(ResumeRequest {
        session: session.into(),
        ..Default::default()
    })
    .await
    .with_context(|| format!("Resume({session})"))?;
    Ok(())
}

pub async fn fork(c: &mut Client, session: &str, count: i32) -> anyhow::Result<Vec<String>> {
    let children = c
        .fork(ForkRequest {
            session: session.into(),
            count,
            ..Default::default()
        })
        .await
        .with_context(|| format!("Fork({session}, {count})"))?
        .into_inner()
        .children;
    Ok(children
        .into_iter()
        .map(|s| s.metadata.unwrap_or_default().uid)
        .collect())
}

/// One child of `session` at `at_seq`.
pub async fn fork_at(c: &mut Client, session: &str, at_seq: i64) -> anyhow::Result<String> {
    let children = c
        .fork(ForkRequest {
            session: session.into(),
            count: 1,
            at_seq,
            ..Default::default()
        })
        .await
        .with_context(|| format!("Fork({session} at {at_seq})"))?
        .into_inner()
        .children;
    Ok(children
        .into_iter()
        .next()
        .and_then(|s| s.metadata)
        .unwrap_or_default()
        .uid)
}

/// `session`'s checkpoints (Node.ListCheckpoints), oldest first.
pub async fn checkpoints(
    node: &mut agentvm_proto::node::v1::node_client::NodeClient<Channel>,
    session: &str,
) -> anyhow::Result<Vec<agentvm_proto::node::v1::Checkpoint>> {
    Ok(node
        .list_checkpoints(agentvm_proto::node::v1::ListCheckpointsRequest {
            session: session.into(),
        })
        .await
        .with_context(|| format!("ListCheckpoints({session})"))?
        .into_inner()
        .checkpoints)
}

pub async fn delete(c: &mut Client, session: &str) -> anyhow::Result<()> {
    c.delete_session(DeleteSessionRequest {
        uid: session.into(),
    })
    .await
    .with_context(|| format!("DeleteSession({session})"))?;
    Ok(())
}
