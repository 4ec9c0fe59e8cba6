//! The controller: the single writer of a session's log while one of its executions runs.
//!
//! - [`Controller::exec`] starts a new execution: EXECUTION_START and its INPUTs in one
//!   CAS-checked append, then the harness's effects as they happen, then END (or an audit ERROR).
//! - [`Controller::resume`] re-drives the trailing interrupted execution: recorded effects are
//!   served, the rest runs live (crash recovery, approval completion).
//! - [`Controller::replay`] re-runs every completed execution against the journal only; it
//!   appends nothing and never reaches the model or a tool executor.
//!
//! The caller (the session service) owns admission, the runtime and the fence: a [`Turn`]
//! carries an already-dialed harness and the fence minted for this incarnation.

pub mod drive;
pub mod endpoint;
pub mod error;
pub mod log;
pub mod sink;
pub mod tail;
pub mod tools;

#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use agentvm_proto::v1::{
    ApprovalRef, ControllerFrame, Error as EventError, Event, EventKind, ExecUpdate,
    ExecutionStart, HarnessDescriptor, HarnessEnd, HistoryChunk, IdentityContext, IdentityRef,
    Lifecycle, Mediation, Message, Resumability, Start, controller_frame::Frame, event::Body,
    lifecycle::Kind as LifecycleKind,
};
use rand::Rng;
use tokio::sync::{mpsc, watch};

use crate::clock::{now_nanos, timestamp};
use crate::journal::Journal;
use crate::model::provider::ModelProvider;
use drive::{RunEnd, run_stream};
use endpoint::HarnessEndpoint;
use error::ControllerError;
use log::{ExecutionLog, Recorded, SessionLog};
use sink::{EffectSink, Mode, TurnIo};
use tools::ToolExecutor;

pub type Result<T, E = ControllerError> = std::result::Result<T, E>;

/// Live side effects the controller performed, for proving replay performs none (I1).
#[derive(Debug, Default)]
pub struct Counters {
    model_calls: AtomicU64,
    executor_calls: AtomicU64,
}

impl Counters {
    pub fn model_calls(&self) -> u64 {
        self.model_calls.load(Ordering::Relaxed)
    }
    pub fn executor_calls(&self) -> u64 {
        self.executor_calls.load(Ordering::Relaxed)
    }
    fn count_model_call(&self) {
        self.model_calls.fetch_add(1, Ordering::Relaxed);
    }
    fn count_executor_call(&self) {
        self.executor_calls.fetch_add(1, Ordering::Relaxed);
    }
}

/// Why the host stops a running execution from outside.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Interrupt {
    /// The Cancel RPC: the execution ends CANCELED.
    Cancel(String),
    /// A checkpoint or a newer incarnation took over; the execution stays resumable.
    Supersede(String),
}

/// One incarnation's turn: everything admission decided.
pub struct Turn {
    pub session: String,
    pub fence: i64,
    /// Records at or below this seq were copied from a fork parent (not owned).
    pub fork_seq: i64,
    /// The resolved registry name, recorded on EXECUTION_START and checked on re-runs (R6).
    pub harness: String,
    /// The session's model: what a model call that names none asks for ("" = [`DEFAULT_MODEL`]).
    pub model: String,
    /// What the dialed harness reported.
    pub descriptor: HarnessDescriptor,
    pub endpoint: Arc<dyn HarnessEndpoint>,
    pub identity: Option<IdentityRef>,
    pub observer: Option<mpsc::Sender<ExecUpdate>>,
    pub deadline: Option<tokio::time::Instant>,
    pub interrupt: Option<watch::Receiver<Option<Interrupt>>>,
    /// How far the dialed harness already holds the log in its memory: a memory-tier
    /// harness on a VM that ran, was restored to or was forked at that point. Its Start
    /// then carries only the events after it. None: it holds nothing of the log.
    pub harness_holds_through: Option<i64>,
}

impl Turn {
    fn memory_tier(&self) -> bool {
        self.descriptor
            .capabilities
            .as_ref()
            .is_some_and(|c| c.resumability == Resumability::RequiresMemorySnapshot as i32)
    }

    /// The harness declared `incremental_history`: it keeps what it was sent, so it may be
    /// sent only what is new, and a long history in pieces.
    pub fn incremental_history(&self) -> bool {
        self.descriptor
            .capabilities
            .as_ref()
            .is_some_and(|c| c.incremental_history)
    }
}

/// The model a call that names none gets on a session created without one: the built-in
/// `echo`, so a session runs with no provider configured.
pub const DEFAULT_MODEL: &str = "echo";

/// The largest single input message, encoded.
pub const MAX_INPUT_BYTES: usize = 1 << 20;
/// The largest sum of one turn's inputs, encoded.
pub const MAX_TURN_INPUT_BYTES: usize = 1 << 20;

/// Every input must reach the harness in its Start, and once journaled it is sent again on
/// every later turn and replay: one too large for any harness would fail the session for
/// good. So sizes are checked before anything is written.
fn check_input_sizes(inputs: &[Message]) -> Result<()> {
    let mut total = 0;
    for (i, m) in inputs.iter().enumerate() {
        let n = prost::Message::encoded_len(m);
        if n > MAX_INPUT_BYTES {
            return Err(ControllerError::InputTooLarge(format!(
                "inputs[{i}] is {n} bytes; an input may be at most {MAX_INPUT_BYTES} bytes"
            )));
        }
        total += n;
    }
    if total > MAX_TURN_INPUT_BYTES {
        return Err(ControllerError::InputTooLarge(format!(
            "inputs are {total} bytes together; a turn's inputs may be at most \
             {MAX_TURN_INPUT_BYTES} bytes"
        )));
    }
    Ok(())
}

/// The Start frame carries the whole history: past `limit` the harness cannot take it.
fn check_start_size(start: &Start, limit: usize) -> Result<()> {
    let n = prost::Message::encoded_len(start);
    if n > limit {
        return Err(ControllerError::HistoryTooLarge(format!(
            "this turn's Start (history {} events, inputs, config) would be {n} bytes; this \
             harness takes at most {limit}. Nothing was journaled: send less, or fork the \
             session at an earlier seq and continue there (a harness declaring \
             incremental_history takes a history of any length, in pieces)",
            start.history.len()
        )));
    }
    Ok(())
}

/// How much history one frame carries to a harness that takes it in pieces: well under any
/// harness's frame limit, with room for the Start's inputs and config beside the first piece.
pub const HISTORY_PIECE_BYTES: usize = 512 << 10;

/// For a harness that takes its history in pieces: `start.history` cut to its first piece
/// (`history_continues` set when more follow), and the rest as [`HistoryChunk`]s.
fn split_history(start: &mut Start, piece_bytes: usize) -> Vec<HistoryChunk> {
    let mut pieces: Vec<Vec<Event>> = vec![Vec::new()];
    let mut size = 0;
    for event in std::mem::take(&mut start.history) {
        let n = prost::Message::encoded_len(&event);
        let current = pieces.last_mut().expect("one piece at least");
        if size + n > piece_bytes && !current.is_empty() {
            pieces.push(Vec::new());
            size = 0;
        }
        size += n;
        pieces.last_mut().expect("just pushed").push(event);
    }
    let mut pieces = pieces.into_iter();
    start.history = pieces.next().unwrap_or_default();
    let rest: Vec<Vec<Event>> = pieces.collect();
    start.history_continues = !rest.is_empty();
    let last = rest.len().saturating_sub(1);
    rest.into_iter()
        .enumerate()
        .map(|(i, events)| HistoryChunk {
            events,
            more: i < last,
        })
        .collect()
}

/// The frames that open an execution's stream: its Start, then (to a harness that takes
/// its history in pieces) the rest of the history. Each must fit what the harness reads.
fn opening_frames(
    turn: &Turn,
    execution_id: &str,
    mut start: Start,
) -> Result<Vec<ControllerFrame>> {
    let limit = turn.endpoint.max_start_bytes();
    let chunks = match turn.incremental_history() {
        true => split_history(&mut start, HISTORY_PIECE_BYTES.min(limit / 2)),
        false => Vec::new(),
    };
    check_start_size(&start, limit)?;
    let frame = |frame: Frame| ControllerFrame {
        session: turn.session.clone(),
        execution_id: execution_id.to_owned(),
        frame: Some(frame),
    };
    let mut frames = vec![frame(Frame::Start(start))];
    for chunk in chunks {
        let n = prost::Message::encoded_len(&chunk);
        if n > limit {
            return Err(ControllerError::HistoryTooLarge(format!(
                "one event of the history is {n} bytes encoded; this harness takes at most \
                 {limit} in a frame. Nothing was journaled: fork the session before that \
                 event and continue there"
            )));
        }
        frames.push(frame(Frame::History(chunk)));
    }
    Ok(frames)
}

/// What a new execution brings.
#[derive(Debug, Clone, Default)]
pub struct NewExecution {
    pub inputs: Vec<Message>,
    pub config: Vec<u8>,
    pub resume_from_seq: i64,
    /// None appends at the head; Some(n) asserts the head is n (0 = "no events yet").
    pub expected_last_seq: Option<i64>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TurnOutcome {
    Completed {
        execution_id: String,
        /// The last seq of the history a new execution sent its harness (what a harness
        /// that keeps its history now holds); None for a re-run.
        history_through: Option<i64>,
    },
    /// Stopped at an approval gate; `head` is the log head the park left (for the SUSPEND).
    Parked { park: ApprovalRef, head: i64 },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReplaySummary {
    pub executions: usize,
}

/// Where an execution's last gated call stands (semantics.md §4.6).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GateState {
    /// No gated call lacks its receipt.
    Clear,
    /// A gated TOOL_CALL whose APPROVAL_REQUEST was never appended.
    CallOnly { tool_call_id: String },
    /// Request appended, no decision yet.
    Pending(ApprovalRef),
    /// Decided, receipt still to be produced.
    Decided(ApprovalRef),
}

pub fn gate_state(x: &ExecutionLog) -> GateState {
    let mut state = GateState::Clear;
    for Recorded { seq, event } in &x.effects {
        match (&event.body, EventKind::try_from(event.kind)) {
            (Some(Body::Tool(call)), Ok(EventKind::EventToolCall))
                if call.mediation == Mediation::RequiresApproval as i32 =>
            {
                state = GateState::CallOnly {
                    tool_call_id: call.id.clone(),
                };
            }
            (Some(Body::Approval(req)), Ok(EventKind::EventApprovalRequest)) => {
                state = GateState::Pending(ApprovalRef {
                    execution_id: x.id.clone(),
                    tool_call_id: req.tool_call_id.clone(),
                    request_seq: *seq,
                });
            }
            (Some(Body::ApprovalResult(d)), Ok(EventKind::EventApprovalResult)) => {
                if let GateState::Pending(r) = &state
                    && r.tool_call_id == d.tool_call_id
                {
                    state = GateState::Decided(r.clone());
                }
            }
            (Some(Body::Result(r)), Ok(EventKind::EventToolResult)) => {
                let answers = match &state {
                    GateState::Decided(g) | GateState::Pending(g) => g.tool_call_id == r.id,
                    GateState::CallOnly { tool_call_id } => *tool_call_id == r.id,
                    GateState::Clear => false,
                };
                if answers {
                    state = GateState::Clear;
                }
            }
            _ => {}
        }
    }
    state
}

/// The first tool call at or below `fork_seq` that has no result in `x` (I3: a child cannot
/// re-drive its parent's effect).
pub fn inherited_open_intent(x: &ExecutionLog, fork_seq: i64) -> Option<String> {
    x.effects
        .iter()
        .filter(|r| r.seq <= fork_seq)
        .find_map(|r| match &r.event.body {
            Some(Body::Tool(call)) if r.event.kind == EventKind::EventToolCall as i32 => {
                let answered = x.effects.iter().any(|later| {
                    later.seq > r.seq
                        && matches!(&later.event.body, Some(Body::Result(res)) if res.id == call.id)
                });
                (!answered).then(|| call.id.clone())
            }
            _ => None,
        })
}

/// A fresh execution id: 16 lowercase hex characters.
pub fn new_execution_id() -> String {
    let bytes: [u8; 8] = rand::rng().random();
    hex::encode(bytes)
}

/// A host-stamped event of `execution_id` (empty for session-scoped lifecycle records).
pub fn stamp(execution_id: &str, kind: EventKind, body: Body) -> Event {
    Event {
        execution_id: execution_id.to_owned(),
        ts: Some(timestamp(now_nanos())),
        schema_version: 1,
        kind: kind as i32,
        body: Some(body),
        // The authenticated caller whose request this event belongs to, if the node has auth.
        actor: crate::api::auth::ACTOR.try_with(Clone::clone).ok(),
    }
}

pub struct Controller {
    journal: Arc<dyn Journal>,
    provider: Arc<dyn ModelProvider>,
    executor: Option<Arc<dyn ToolExecutor>>,
    counters: Arc<Counters>,
    harness_idle_timeout: std::time::Duration,
}

/// How long the host waits for a harness's next event before it fails the turn: long enough
/// for a harness that works locally between events, short enough that a dead one does not
/// hold its session for good.
pub const DEFAULT_HARNESS_IDLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);

impl Controller {
    pub fn new(
        journal: Arc<dyn Journal>,
        provider: Arc<dyn ModelProvider>,
        executor: Option<Arc<dyn ToolExecutor>>,
    ) -> Self {
        Self {
            journal,
            provider,
            executor,
            counters: Arc::default(),
            harness_idle_timeout: DEFAULT_HARNESS_IDLE_TIMEOUT,
        }
    }

    pub fn with_harness_idle_timeout(mut self, idle: std::time::Duration) -> Self {
        self.harness_idle_timeout = idle;
        self
    }

    /// How long a harness may stay silent while the host waits on it.
    pub fn harness_idle_timeout(&self) -> std::time::Duration {
        self.harness_idle_timeout
    }

    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    pub fn journal(&self) -> &Arc<dyn Journal> {
        &self.journal
    }

    fn io<'a>(&'a self, turn: &'a Turn) -> TurnIo<'a> {
        TurnIo {
            journal: self.journal.as_ref(),
            provider: self.provider.as_ref(),
            executor: self.executor.as_deref(),
            counters: &self.counters,
            observer: turn.observer.as_ref(),
            session: &turn.session,
            model: match turn.model.as_str() {
                "" => DEFAULT_MODEL,
                model => model,
            },
            fence: turn.fence,
            memory_tier: turn.memory_tier(),
        }
    }

    fn read_log(&self, session: &str) -> Result<SessionLog> {
        SessionLog::parse(self.journal.read(session, 1, 0)?)
    }

    /// The session's head and its latest execution (see [`tail`]): what a new execution
    /// must know of the log, read in time bounded by that execution, not the session.
    fn read_tail(&self, session: &str) -> Result<(i64, SessionLog)> {
        let head = self
            .journal
            .get_session(session)?
            .map_or(0, |row| row.last_seq);
        let log = SessionLog::parse(tail::read_tail(self.journal.as_ref(), session, head)?)?;
        Ok((head, log))
    }

    /// What the harness of `turn` is sent of the log before a new execution at `head`:
    /// the events after what it holds (with that seq), or every event.
    fn history_for(&self, turn: &Turn, head: i64) -> Result<(Vec<Event>, i64)> {
        let after = match turn.harness_holds_through {
            Some(seen)
                if (turn.memory_tier() || turn.incremental_history())
                    && (1..=head).contains(&seen) =>
            {
                seen
            }
            _ => 0,
        };
        let events = self
            .journal
            .read(&turn.session, after + 1, head)?
            .into_iter()
            .filter_map(|r| r.event)
            .collect();
        Ok((events, after))
    }

    /// A new execution with `new.inputs`.
    pub async fn exec(&self, turn: &Turn, new: NewExecution) -> Result<TurnOutcome> {
        let (head, log) = self.read_tail(&turn.session)?;
        if let Some(x) = log.pending().filter(|x| x.is_legacy()) {
            return Err(ControllerError::InvalidExecutionLog(format!(
                "the legacy turn at seq {} never finished; a new execution after it would be ambiguous",
                x.first_seq
            )));
        }
        let expected = new.expected_last_seq.unwrap_or(head);
        check_input_sizes(&new.inputs)?;
        let (history, history_after_seq) = match head {
            0 => (Vec::new(), 0),
            head => self.history_for(turn, head)?,
        };
        let start = Start {
            config: new.config,
            history,
            inputs: new.inputs,
            identity: identity_context(turn),
            resume_from_seq: new.resume_from_seq,
            history_after_seq,
            history_continues: false,
        };
        let execution_id = new_execution_id();
        let mut bodies = vec![(
            EventKind::EventExecutionStart,
            Body::ExecutionStart(ExecutionStart {
                config: start.config.clone(),
                resume_from_seq: start.resume_from_seq,
                input_count: Some(start.inputs.len() as i64),
                harness: turn.harness.clone(),
                harness_version: turn.descriptor.version.clone(),
            }),
        )];
        bodies.extend(
            start
                .inputs
                .iter()
                .map(|m| (EventKind::EventInput, Body::Message(m.clone()))),
        );
        // Whether the harness can take it is known before anything is journaled.
        let opening = opening_frames(turn, &execution_id, start)?;
        let mut sink = EffectSink::new(
            self.io(turn),
            execution_id.clone(),
            Mode::Live,
            vec![],
            expected,
        );
        sink.append(bodies).await?;
        let outcome = self.run(turn, sink, opening).await?;
        Ok(match outcome {
            TurnOutcome::Completed { execution_id, .. } => TurnOutcome::Completed {
                execution_id,
                history_through: Some(head),
            },
            parked => parked,
        })
    }

    /// Re-drives the trailing unfinished execution; `Ok(None)` when there is none.
    pub async fn resume(&self, turn: &Turn) -> Result<Option<TurnOutcome>> {
        let log = self.read_log(&turn.session)?;
        let Some(x) = log.pending() else {
            return Ok(None);
        };
        if x.is_legacy() {
            return Err(ControllerError::InvalidExecutionLog(format!(
                "the unfinished legacy turn at seq {} has no execution id to re-drive",
                x.first_seq
            )));
        }
        x.check_inputs()
            .map_err(ControllerError::IncompleteInvocation)?;
        if let Some(call) = inherited_open_intent(x, turn.fork_seq) {
            return Err(ControllerError::InheritedToolIntent(call));
        }
        if let GateState::Pending(park) = gate_state(x) {
            if park.request_seq <= turn.fork_seq {
                return Err(ControllerError::InheritedToolIntent(park.tool_call_id));
            }
            // Still waiting for a decision: nothing to do, nothing to append.
            return Ok(Some(TurnOutcome::Parked {
                park,
                head: log.head(),
            }));
        }
        let start_record = x.start.clone().unwrap_or_default();
        check_harness_identity(&start_record, turn)?;
        let start = Start {
            config: start_record.config,
            history: log.history_before(x.first_index),
            inputs: x.inputs.clone(),
            identity: identity_context(turn),
            resume_from_seq: start_record.resume_from_seq,
            history_after_seq: 0,
            history_continues: false,
        };
        let opening = opening_frames(turn, &x.id, start)?;
        let sink = EffectSink::new(
            self.io(turn),
            x.id.clone(),
            Mode::Recover,
            x.effects.clone(),
            log.head(),
        );
        self.run(turn, sink, opening).await.map(Some)
    }

    /// Runs every completed execution against the journal (R7): read-only, no model, no tools.
    pub async fn replay(&self, turn: &Turn) -> Result<ReplaySummary> {
        let log = self.read_log(&turn.session)?;
        let completed: Vec<&ExecutionLog> = log
            .executions
            .iter()
            .filter(|x| x.is_completed() && !x.is_legacy())
            .collect();
        // Fail closed before running anything (R5, R6).
        for x in &completed {
            x.check_inputs()
                .map_err(ControllerError::InvalidExecutionLog)?;
            check_harness_identity(x.start.as_ref().expect("checked"), turn)?;
        }
        for x in &completed {
            let recorded_start = x.start.clone().expect("checked");
            let start = Start {
                config: recorded_start.config,
                history: log.history_before(x.first_index),
                inputs: x.inputs.clone(),
                identity: identity_context(turn),
                resume_from_seq: recorded_start.resume_from_seq,
                history_after_seq: 0,
                history_continues: false,
            };
            let mut sink = EffectSink::new(
                self.io(turn),
                x.id.clone(),
                Mode::Replay,
                x.effects.clone(),
                log.head(),
            );
            let stream = turn
                .endpoint
                .connect()
                .await
                .map_err(|s| ControllerError::HarnessUnavailable(s.message().to_owned()))?;
            let opening = opening_frames(turn, &x.id, start)?;
            match run_stream(&mut sink, stream, opening, self.harness_idle_timeout).await? {
                RunEnd::Completed => {}
                RunEnd::Parked(p) => {
                    return Err(ControllerError::ReplayDiverged(format!(
                        "replay of completed execution {} parked at call {:?}",
                        x.id, p.tool_call_id
                    )));
                }
            }
        }
        Ok(ReplaySummary {
            executions: completed.len(),
        })
    }

    async fn run(
        &self,
        turn: &Turn,
        sink: EffectSink<'_>,
        opening: Vec<ControllerFrame>,
    ) -> Result<TurnOutcome> {
        let execution_id = start_execution_id(&sink);
        let inputs = match opening.first().and_then(|f| f.frame.as_ref()) {
            Some(Frame::Start(start)) => start.inputs.len(),
            _ => 0,
        };
        tracing::info!(
            session = %turn.session,
            execution_id = %execution_id,
            harness = %turn.harness,
            inputs,
            "execution started"
        );
        let result = self.run_to_end(turn, sink, opening, &execution_id).await;
        crate::metrics::global().executions.inc(match &result {
            Ok(TurnOutcome::Completed { .. }) => "completed",
            Ok(TurnOutcome::Parked { .. }) => "parked",
            Err(_) => "failed",
        });
        match &result {
            Ok(TurnOutcome::Completed { .. }) => {
                tracing::info!(session = %turn.session, execution_id = %execution_id, "execution completed")
            }
            Ok(TurnOutcome::Parked { park, .. }) => tracing::info!(
                session = %turn.session,
                execution_id = %execution_id,
                tool_call_id = %park.tool_call_id,
                request_seq = park.request_seq,
                "execution parked for approval"
            ),
            Err(e) => tracing::info!(
                session = %turn.session,
                execution_id = %execution_id,
                code = ?e.code(),
                error = %e,
                "execution did not complete"
            ),
        }
        result
    }

    async fn run_to_end(
        &self,
        turn: &Turn,
        mut sink: EffectSink<'_>,
        opening: Vec<ControllerFrame>,
        execution_id: &str,
    ) -> Result<TurnOutcome> {
        let execution_id = execution_id.to_owned();
        let outcome = self.run_interruptible(turn, &mut sink, opening).await;
        match outcome {
            Ok(RunEnd::Completed) => {
                sink.append(vec![(
                    EventKind::EventEnd,
                    Body::End(HarnessEnd {
                        state: "COMPLETED".into(),
                        error: None,
                    }),
                )])
                .await?;
                Ok(TurnOutcome::Completed {
                    execution_id,
                    history_through: None,
                })
            }
            Ok(RunEnd::Parked(park)) => Ok(TurnOutcome::Parked {
                park,
                head: sink.head(),
            }),
            Err(ControllerError::Cancelled(reason)) if sink.open_gate().is_none() => {
                sink.append(vec![(
                    EventKind::EventEnd,
                    Body::End(HarnessEnd {
                        state: "CANCELED".into(),
                        error: Some(EventError {
                            code: tonic::Code::Cancelled as i32,
                            description: reason.clone(),
                        }),
                    }),
                )])
                .await?;
                let cancel = stamp(
                    "",
                    EventKind::EventLifecycle,
                    Body::Lifecycle(Lifecycle {
                        kind: LifecycleKind::LifecycleCancel as i32,
                        detail: reason.clone(),
                        ..Default::default()
                    }),
                );
                let records =
                    self.journal
                        .append(&turn.session, sink.head(), turn.fence, &[cancel])?;
                if let Some(observer) = &turn.observer {
                    for r in records {
                        let _ = observer
                            .send(ExecUpdate {
                                update: Some(agentvm_proto::v1::exec_update::Update::Record(r)),
                            })
                            .await;
                    }
                }
                Err(ControllerError::Cancelled(reason))
            }
            Err(e) => {
                // No continuation after an open gate (§4.6), and no ERROR for what the host did.
                if sink.open_gate().is_none() && !e.is_host_interruption() {
                    let error = (
                        EventKind::EventError,
                        Body::Error(EventError {
                            code: e.code() as i32,
                            description: e.to_string(),
                        }),
                    );
                    if let Err(append_err) = sink.append(vec![error]).await {
                        tracing::warn!(session = %turn.session, error = %append_err, "could not journal the turn's ERROR");
                    }
                }
                Err(e)
            }
        }
    }

    async fn run_interruptible(
        &self,
        turn: &Turn,
        sink: &mut EffectSink<'_>,
        opening: Vec<ControllerFrame>,
    ) -> Result<RunEnd> {
        let stream = turn
            .endpoint
            .connect()
            .await
            .map_err(|s| ControllerError::HarnessUnavailable(s.message().to_owned()))?;
        let run = run_stream(sink, stream, opening, self.harness_idle_timeout);
        let mut interrupt = turn.interrupt.clone();
        let interrupted = async {
            match interrupt.as_mut() {
                Some(rx) => loop {
                    if let Some(i) = rx.borrow_and_update().clone() {
                        return i;
                    }
                    if rx.changed().await.is_err() {
                        std::future::pending::<()>().await;
                    }
                },
                None => std::future::pending().await,
            }
        };
        let deadline = async {
            match turn.deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            r = run => r,
            i = interrupted => Err(match i {
                Interrupt::Cancel(reason) => ControllerError::Cancelled(reason),
                Interrupt::Supersede(reason) => ControllerError::Superseded(reason),
            }),
            () = deadline => Err(ControllerError::DeadlineExceeded),
        }
    }
}

fn start_execution_id(sink: &EffectSink<'_>) -> String {
    sink.execution_id().to_owned()
}

fn identity_context(turn: &Turn) -> Option<IdentityContext> {
    turn.identity.as_ref().map(|p| IdentityContext {
        principal: Some(p.clone()),
        can_mint_tokens: false,
    })
}

/// R6: a re-run needs the harness the execution was recorded with, at the same version.
fn check_harness_identity(recorded: &ExecutionStart, turn: &Turn) -> Result<()> {
    if !recorded.harness.is_empty() && recorded.harness != turn.harness {
        return Err(ControllerError::HarnessMismatch {
            recorded: recorded.harness.clone(),
            served: turn.harness.clone(),
        });
    }
    if !recorded.harness_version.is_empty() && recorded.harness_version != turn.descriptor.version {
        return Err(ControllerError::HarnessVersionMismatch {
            recorded: recorded.harness_version.clone(),
            served: turn.descriptor.version.clone(),
        });
    }
    Ok(())
}
