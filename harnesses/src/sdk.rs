//! The harness side of one `Harness.Connect` stream, as typed calls.
//!
//! A [`Harness`] gets the execution's [`Start`] and a [`Sink`]; every sink call becomes one
//! `Event` up the stream and, for model and tool calls, waits for the host's correlated reply.
//! [`drive`] owns the stream: it checks the first frame, runs the harness and ends the stream
//! with `END` (or, after an approval park, with the park acknowledgement and no `END`).
//!
//! The SDK is transport-agnostic: frames arrive as a [`FrameStream`] and events leave through
//! an [`EventSender`], so the same harness runs behind tonic, over the guest frame protocol, or
//! in-process over channels.

use std::pin::Pin;
use std::sync::Arc;

use agentvm_proto::v1::{
    ApprovalRef, ApprovalResult, ControllerFrame, Error as EventError, Event, EventKind,
    HarnessDescriptor, HarnessEnd, Message, ModelCall, ModelResult, Start, ToolCall, ToolResult,
    Usage, controller_frame::Frame, event::Body,
};
use rand::Rng;
use tokio::sync::mpsc;
use tokio_stream::{Stream, StreamExt};
use tonic::Status;

/// Frames from the host, in order.
pub type FrameStream = Pin<Box<dyn Stream<Item = Result<ControllerFrame, Status>> + Send>>;
/// Events to the host, in order. An `Err` ends the stream with that status.
pub type EventSender = mpsc::Sender<Result<Event, Status>>;

/// What one execution starts from: `ControllerFrame.session` / `.execution_id` and its `Start`.
#[derive(Debug, Clone)]
pub struct Execution {
    pub session: String,
    pub execution_id: String,
    pub start: Start,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SinkError {
    #[error("the host ended the execution stream")]
    HostClosed,
    #[error("the host failed the execution stream: {0}")]
    HostFailed(String),
    #[error("the host cancelled the execution: {0}")]
    Cancelled(String),
    #[error("parked: tool call {} awaits approval (request seq {})", .0.tool_call_id, .0.request_seq)]
    Parked(ApprovalRef),
    #[error("host protocol violation: {0}")]
    Protocol(String),
}

/// Why a run failed; becomes `END{FAILED, error}` on the stream.
#[derive(Debug, Clone, PartialEq)]
pub struct HarnessFailure {
    /// A gRPC status code (0 when the harness has none to give).
    pub code: i32,
    pub description: String,
}

impl HarnessFailure {
    pub fn new(description: impl Into<String>) -> Self {
        Self {
            code: tonic::Code::Unknown as i32,
            description: description.into(),
        }
    }
}

impl From<SinkError> for HarnessFailure {
    fn from(e: SinkError) -> Self {
        HarnessFailure::new(e.to_string())
    }
}

#[async_trait::async_trait]
pub trait Harness: Send + Sync {
    fn descriptor(&self) -> HarnessDescriptor;

    /// Whether this harness can take an execution's `config` at all. A host that knows the
    /// harness asks before it journals anything, so a config the harness would only fail on
    /// is refused up front (INVALID_ARGUMENT) instead of costing a failed turn.
    fn check_config(&self, _config: &[u8]) -> Result<(), HarnessFailure> {
        Ok(())
    }

    /// Runs one execution. `Ok` ends the stream with END{COMPLETED}; a [`SinkError::Parked`]
    /// returned (or swallowed) ends it with the park acknowledgement only.
    async fn run(&self, exec: &Execution, sink: &mut Sink) -> Result<(), HarnessFailure>;
}

/// The harness's handle on the host for one execution. Errors are sticky: after the first
/// failure every later call returns it again, so a harness that swallows an error cannot
/// carry on as if the host had answered.
pub struct Sink {
    session: String,
    execution_id: String,
    frames: FrameStream,
    events: EventSender,
    sticky: Option<SinkError>,
}

/// A fresh call id: 16 lowercase hex characters, as upstream's harnesses choose them. Drawn
/// from the kernel each time: a process-local generator's state is copied into every VM
/// restored from one snapshot (a template, a fork), and its ids with it.
pub fn new_call_id() -> String {
    use rand::TryRngCore;
    let mut bytes = [0u8; 8];
    if rand::rngs::OsRng.try_fill_bytes(&mut bytes).is_err() {
        bytes = rand::rng().random();
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The restore signal (docs/harness-protocol.md, "Restores and forks"): one item after
/// every restore, fork or start from a template of this harness's VM, once the kernel's RNG
/// is fresh. Reseed anything drawn from randomness before it.
pub fn restored() -> std::io::Result<tokio::signal::unix::Signal> {
    tokio::signal::unix::signal(tokio::signal::unix::SignalKind::window_change())
}

impl Sink {
    pub fn execution_id(&self) -> &str {
        &self.execution_id
    }

    pub fn session(&self) -> &str {
        &self.session
    }

    /// Asks the host for a completion. The id is chosen here when the call has none.
    pub async fn model(&mut self, mut call: ModelCall) -> Result<ModelResult, SinkError> {
        self.check()?;
        if call.id.is_empty() {
            call.id = new_call_id();
        }
        let id = call.id.clone();
        self.emit(EventKind::EventModelCall, Body::Model(call))
            .await?;
        match self.next_frame().await? {
            Frame::Model(result) if result.model_call_id == id => Ok(result),
            Frame::Model(result) => self.fail(SinkError::Protocol(format!(
                "model reply for call {:?}, expected {id:?}",
                result.model_call_id
            ))),
            other => self.fail(unexpected("model", &other)),
        }
    }

    pub async fn output(&mut self, message: Message) -> Result<(), SinkError> {
        self.check()?;
        self.emit(EventKind::EventOutput, Body::Message(message))
            .await
    }

    pub async fn usage(&mut self, usage: Usage) -> Result<(), SinkError> {
        self.check()?;
        self.emit(EventKind::EventUsage, Body::Usage(usage)).await
    }

    /// Reports the result of a tool the harness ran itself (IN_HARNESS_REPORTED).
    pub async fn report(&mut self, result: ToolResult) -> Result<(), SinkError> {
        self.check()?;
        self.emit(EventKind::EventToolResult, Body::Result(result))
            .await
    }

    /// Asks the host to run a mediated tool and waits for its result. For REQUIRES_APPROVAL the
    /// host either parks the execution ([`SinkError::Parked`], after which the harness must
    /// return) or sends the decision and then the receipt.
    pub async fn tool_call(&mut self, call: ToolCall) -> Result<ToolAnswer, SinkError> {
        self.check()?;
        let id = call.id.clone();
        self.emit(EventKind::EventToolCall, Body::Tool(call))
            .await?;
        let decision = match self.next_frame().await? {
            Frame::Tool(result) => return self.correlated(&id, None, result),
            Frame::Approval(decision) => decision,
            Frame::Park(park) => return self.park(&id, park).await,
            other => return self.fail(unexpected("tool", &other)),
        };
        if decision.tool_call_id != id {
            return self.fail(SinkError::Protocol(format!(
                "approval for call {:?}, expected {id:?}",
                decision.tool_call_id
            )));
        }
        match self.next_frame().await? {
            Frame::Tool(result) => self.correlated(&id, Some(decision), result),
            other => self.fail(unexpected("tool receipt", &other)),
        }
    }

    fn correlated(
        &mut self,
        id: &str,
        approval: Option<ApprovalResult>,
        result: ToolResult,
    ) -> Result<ToolAnswer, SinkError> {
        if result.id != id {
            return self.fail(SinkError::Protocol(format!(
                "tool result for call {:?}, expected {id:?}",
                result.id
            )));
        }
        Ok(ToolAnswer { result, approval })
    }

    async fn park(&mut self, id: &str, park: ApprovalRef) -> Result<ToolAnswer, SinkError> {
        if park.tool_call_id != id
            || park.execution_id != self.execution_id
            || park.request_seq <= 0
        {
            return self.fail(SinkError::Protocol(format!(
                "park {park:?} does not name call {id:?} of this execution"
            )));
        }
        self.emit(EventKind::EventParked, Body::Parked(park.clone()))
            .await?;
        self.fail(SinkError::Parked(park))
    }

    fn check(&self) -> Result<(), SinkError> {
        match &self.sticky {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    fn fail<T>(&mut self, e: SinkError) -> Result<T, SinkError> {
        self.sticky.get_or_insert(e.clone());
        Err(e)
    }

    async fn emit(&mut self, kind: EventKind, body: Body) -> Result<(), SinkError> {
        let event = Event {
            execution_id: self.execution_id.clone(),
            schema_version: 1,
            kind: kind as i32,
            body: Some(body),
            ..Default::default()
        };
        if self.events.send(Ok(event)).await.is_err() {
            return self.fail(SinkError::HostClosed);
        }
        Ok(())
    }

    async fn next_frame(&mut self) -> Result<Frame, SinkError> {
        let frame = match self.frames.next().await {
            None => return self.fail(SinkError::HostClosed),
            Some(Err(status)) => {
                return self.fail(SinkError::HostFailed(status.message().to_owned()));
            }
            Some(Ok(frame)) => frame,
        };
        if frame.execution_id != self.execution_id || frame.session != self.session {
            return self.fail(SinkError::Protocol(format!(
                "frame for session {:?} execution {:?} on the stream of {:?} {:?}",
                frame.session, frame.execution_id, self.session, self.execution_id
            )));
        }
        match frame.frame {
            Some(Frame::Cancel(c)) => self.fail(SinkError::Cancelled(c.reason)),
            Some(Frame::Start(_)) => self.fail(SinkError::Protocol("a second start".into())),
            Some(f) => Ok(f),
            None => self.fail(SinkError::Protocol("an empty frame".into())),
        }
    }
}

/// The host's answer to a mediated tool call. `approval` is the decision for a gated call;
/// it is transient (never journaled).
#[derive(Debug, Clone, PartialEq)]
pub struct ToolAnswer {
    pub result: ToolResult,
    pub approval: Option<ApprovalResult>,
}

fn frame_name(frame: &Frame) -> &'static str {
    match frame {
        Frame::Start(_) => "start",
        Frame::Cancel(_) => "cancel",
        Frame::Approval(_) => "approval",
        Frame::Tool(_) => "tool",
        Frame::Model(_) => "model",
        Frame::Park(_) => "park",
        Frame::History(_) => "history",
    }
}

fn unexpected(waiting_for: &str, got: &Frame) -> SinkError {
    let name = frame_name(got);
    SinkError::Protocol(format!(
        "a {name} frame while waiting for a {waiting_for} reply"
    ))
}

fn end_event(execution_id: &str, state: &str, error: Option<EventError>) -> Event {
    Event {
        execution_id: execution_id.to_owned(),
        schema_version: 1,
        kind: EventKind::EventEnd as i32,
        body: Some(Body::End(HarnessEnd {
            state: state.to_owned(),
            error,
        })),
        ..Default::default()
    }
}

/// Serves one Connect stream with `harness`: the first frame must be a `start` with an
/// execution id; the run's outcome becomes END{COMPLETED}, END{FAILED} or (parked) nothing.
pub async fn drive(harness: Arc<dyn Harness>, frames: FrameStream, events: EventSender) {
    drive_with(harness, frames, events, None).await
}

/// The history each session's executions have brought this harness process, for a harness
/// that declares `incremental_history`. The host then sends only what is new
/// (`Start.history_after_seq`) and a long history in pieces; the cache hands the harness the
/// whole history every time, as if it had all been sent, so the harness's code is the same
/// either way. One per harness process (or per host connection), shared by its streams.
#[derive(Default)]
pub struct HistoryCache {
    sessions: std::sync::Mutex<std::collections::HashMap<String, Vec<Event>>>,
}

/// Sessions a cache keeps at once; past that, the least recently used one is dropped (the
/// host sends only what is new only to a process of one session, so a shared harness never
/// depends on this).
const CACHED_SESSIONS: usize = 64;

impl HistoryCache {
    fn lock(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, Vec<Event>>> {
        self.sessions.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Makes `start.history` the whole history of `session`: what this process holds up to
    /// `history_after_seq`, then what the host sent. Err when the host sent from further on
    /// than this process holds (a process that lost what it had).
    pub fn complete(&self, session: &str, start: &mut Start) -> Result<(), String> {
        let after = start.history_after_seq;
        if after <= 0 {
            return Ok(());
        }
        let mut held = self.lock().remove(session).unwrap_or_default();
        if (held.len() as i64) < after {
            return Err(format!(
                "HistoryGap: the host sent session {session}'s history after seq {after}, but \
                 this harness process holds {} events of it",
                held.len()
            ));
        }
        // The records are numbered from 1 with no gap, so event i is seq i + 1.
        held.truncate(after as usize);
        held.append(&mut start.history);
        start.history = held;
        start.history_after_seq = 0;
        Ok(())
    }

    /// Keeps `history`, the whole history of `session` as its last execution began, for the
    /// next one.
    pub fn keep(&self, session: &str, history: Vec<Event>) {
        let mut sessions = self.lock();
        if !sessions.contains_key(session) && sessions.len() >= CACHED_SESSIONS {
            let evict = sessions.keys().next().cloned();
            if let Some(evict) = evict {
                sessions.remove(&evict);
            }
        }
        sessions.insert(session.to_owned(), history);
    }
}

/// Reads the rest of a Start's history (`history_continues`): [`Frame::History`] pieces until
/// the last.
async fn rest_of_history(frames: &mut FrameStream, start: &mut Start) -> Result<(), String> {
    let mut more = start.history_continues;
    while more {
        match frames.next().await {
            Some(Ok(ControllerFrame {
                frame: Some(Frame::History(mut chunk)),
                ..
            })) => {
                start.history.append(&mut chunk.events);
                more = chunk.more;
            }
            Some(Ok(other)) => {
                return Err(format!(
                    "the Start's history continues, but the next frame is {:?}",
                    other.frame.map(|f| frame_name(&f))
                ));
            }
            Some(Err(_)) | None => return Err("the host ended the stream mid-history".into()),
        }
    }
    start.history_continues = false;
    Ok(())
}

/// [`drive`], for a harness process that keeps `cache` across its streams: a harness
/// declaring `incremental_history` then gets its whole history on every execution.
pub async fn drive_with(
    harness: Arc<dyn Harness>,
    mut frames: FrameStream,
    events: EventSender,
    cache: Option<&HistoryCache>,
) {
    let first = match frames.next().await {
        Some(Ok(f)) => f,
        // The host went away before starting anything: nothing to answer.
        Some(Err(_)) | None => return,
    };
    let mut start = match first.frame {
        Some(Frame::Start(start)) if !first.execution_id.is_empty() => start,
        _ => {
            let _ = events
                .send(Err(Status::invalid_argument(
                    "the first frame must be start with a non-empty execution_id",
                )))
                .await;
            return;
        }
    };
    let keeps_history = harness
        .descriptor()
        .capabilities
        .is_some_and(|c| c.incremental_history);
    let assembled = match rest_of_history(&mut frames, &mut start).await {
        Ok(()) => match (keeps_history, cache) {
            (true, Some(cache)) => cache.complete(&first.session, &mut start),
            (true, None) if start.history_after_seq > 0 => Err(format!(
                "HistoryGap: the host sent only the history after seq {}, and this harness \
                 keeps none",
                start.history_after_seq
            )),
            _ => Ok(()),
        },
        Err(e) => Err(e),
    };
    if let Err(why) = assembled {
        let _ = events.send(Err(Status::failed_precondition(why))).await;
        return;
    }
    let mut exec = Execution {
        session: first.session.clone(),
        execution_id: first.execution_id.clone(),
        start,
    };
    let mut sink = Sink {
        session: first.session,
        execution_id: first.execution_id,
        frames,
        events: events.clone(),
        sticky: None,
    };
    let outcome = harness.run(&exec, &mut sink).await;
    if let (true, Some(cache)) = (keeps_history, cache) {
        cache.keep(&exec.session, std::mem::take(&mut exec.start.history));
    }
    let end = match (outcome, sink.sticky.take()) {
        // The park ack is already sent; the stream closes without END.
        (_, Some(SinkError::Parked(_))) => return,
        (_, Some(SinkError::HostClosed | SinkError::HostFailed(_))) => return,
        (Ok(()), None) => end_event(&exec.execution_id, "COMPLETED", None),
        (Ok(()), Some(swallowed)) => failed(&exec.execution_id, &HarnessFailure::from(swallowed)),
        (Err(f), _) => failed(&exec.execution_id, &f),
    };
    let _ = events.send(Ok(end)).await;
}

fn failed(execution_id: &str, f: &HarnessFailure) -> Event {
    end_event(
        execution_id,
        "FAILED",
        Some(EventError {
            code: f.code,
            description: f.description.clone(),
        }),
    )
}
