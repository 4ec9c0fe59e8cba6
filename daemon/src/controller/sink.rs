//! The host's side of one execution's effects: each harness request is either served from the
//! journal (replay, and the recorded prefix of a recovery) with identity checks, or performed
//! live and recorded before its result is returned (semantics.md I0–I5, §4.4, §4.6).

use std::collections::HashSet;

use agentvm_proto::v1::{
    ApprovalRef, ApprovalRequest, ApprovalResult, Event, EventKind, ExecUpdate, LogRecord,
    Mediation, Message, ModelCall, ModelResult, Part, TextPart, ToolCall, ToolResult, Usage,
    controller_frame::Frame, event::Body, exec_update, part, tool_result::Code as ResultCode,
};
use tokio::sync::mpsc;

use super::error::ControllerError;
use super::log::Recorded;
use super::tools::{ToolCallContext, ToolExecutor, check_args};
use super::{Counters, stamp};
use crate::journal::Journal;
use crate::model::input_hash::input_hash;
use crate::model::provider::{Chunk, ModelProvider};

type Result<T, E = ControllerError> = std::result::Result<T, E>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// A new execution: everything is performed and recorded.
    Live,
    /// Controller replay of a completed execution: everything must come from the journal.
    Replay,
    /// Recovery: the recorded prefix is served, then the sink goes live.
    Recover,
}

/// What the host sends back for one harness event.
pub enum Reply {
    Nothing,
    Frames(Vec<Frame>),
    /// The execution parks at an approval gate; the harness must acknowledge and close.
    Park(ApprovalRef),
}

/// The services one execution uses.
pub struct TurnIo<'a> {
    pub journal: &'a dyn Journal,
    pub provider: &'a dyn ModelProvider,
    pub executor: Option<&'a dyn ToolExecutor>,
    pub counters: &'a Counters,
    pub observer: Option<&'a mpsc::Sender<ExecUpdate>>,
    pub session: &'a str,
    /// What a model call that names no model asks for: the session's model.
    pub model: &'a str,
    pub fence: i64,
    /// Memory-tier harnesses cannot be re-run by replay, so they cannot park at a gate.
    pub memory_tier: bool,
}

pub struct EffectSink<'a> {
    io: TurnIo<'a>,
    execution_id: String,
    mode: Mode,
    recorded: Vec<Recorded>,
    cursor: usize,
    head: i64,
    call_ids: HashSet<String>,
    open_gate: Option<ApprovalRef>,
}

fn kind_name(e: &Event) -> String {
    EventKind::try_from(e.kind)
        .map(|k| k.as_str_name().to_owned())
        .unwrap_or_else(|_| format!("kind {}", e.kind))
}

fn text_part(text: &str) -> Part {
    Part {
        part: Some(part::Part::Text(TextPart { text: text.into() })),
    }
}

impl<'a> EffectSink<'a> {
    pub fn new(
        io: TurnIo<'a>,
        execution_id: String,
        mode: Mode,
        recorded: Vec<Recorded>,
        head: i64,
    ) -> Self {
        Self {
            io,
            execution_id,
            mode,
            recorded,
            cursor: 0,
            head,
            call_ids: HashSet::new(),
            open_gate: None,
        }
    }

    pub fn head(&self) -> i64 {
        self.head
    }

    pub fn execution_id(&self) -> &str {
        &self.execution_id
    }

    /// A gate this execution opened or found open: nothing may be appended after it.
    pub fn open_gate(&self) -> Option<&ApprovalRef> {
        self.open_gate.as_ref()
    }

    fn peek(&self) -> Option<&Recorded> {
        self.recorded.get(self.cursor)
    }

    fn take(&mut self) -> Option<Recorded> {
        let r = self.recorded.get(self.cursor).cloned();
        if r.is_some() {
            self.cursor += 1;
        }
        r
    }

    fn diverged<T>(&self, why: String) -> Result<T> {
        Err(ControllerError::ReplayDiverged(why))
    }

    /// Appends this execution's events at the head under the turn's fence and shows each
    /// committed record to the observer.
    pub async fn append(&mut self, bodies: Vec<(EventKind, Body)>) -> Result<Vec<LogRecord>> {
        let events: Vec<Event> = bodies
            .into_iter()
            .map(|(kind, body)| stamp(&self.execution_id, kind, body))
            .collect();
        let records = self
            .io
            .journal
            .append(self.io.session, self.head, self.io.fence, &events)?;
        if let Some(last) = records.last() {
            self.head = last.seq;
        }
        if let Some(observer) = self.io.observer {
            for r in &records {
                // A caller that stopped reading does not stop the turn: the log is the truth.
                let _ = observer
                    .send(ExecUpdate {
                        update: Some(exec_update::Update::Record(r.clone())),
                    })
                    .await;
            }
        }
        Ok(records)
    }

    /// EVENT_MODEL_CALL: serve the recorded completion after the I0 check, or invoke the model.
    pub async fn model(&mut self, mut call: ModelCall) -> Result<Reply> {
        // Resolved before hashing: the session's model never changes (fork children inherit
        // it), so a replayed call resolves, and hashes, exactly as the recorded one did.
        if call.model.is_empty() {
            call.model = self.io.model.to_owned();
        }
        let hash = input_hash(&call).map_err(|e| {
            ControllerError::HarnessProtocol(format!(
                "model call {:?} cannot be hashed: {e}",
                call.id
            ))
        })?;
        if let Some(rec) = self.peek() {
            let seq = rec.seq;
            let recorded_hash = match (&rec.event.body, rec.event.kind) {
                (Some(Body::Model(m)), k) if k == EventKind::EventModelCall as i32 => {
                    m.input_hash.clone()
                }
                _ => {
                    return self.diverged(format!(
                        "the harness made a model call where seq {seq} records {}",
                        kind_name(&rec.event)
                    ));
                }
            };
            if recorded_hash != hash {
                return self.diverged(format!(
                    "I0: model input hash {hash} differs from {recorded_hash} recorded at seq {seq} \
                     (harness violated STATELESS_REPLAY)"
                ));
            }
            self.cursor += 1;
            return match self.peek() {
                Some(Recorded { event, .. }) if event.kind == EventKind::EventOutput as i32 => {
                    let message = match &event.body {
                        Some(Body::Message(m)) => m.clone(),
                        _ => return self.diverged(format!("the OUTPUT after seq {seq} has no message")),
                    };
                    self.cursor += 1;
                    Ok(model_reply(message, call.id))
                }
                Some(_) => Err(ControllerError::Model(
                    crate::model::provider::ProviderError::Unavailable {
                        provider: "journal",
                        reason: format!("the model call recorded at seq {seq} has no completion"),
                    },
                )),
                None if self.mode == Mode::Replay => self.diverged(format!(
                    "the model call recorded at seq {seq} has no completion; replay never calls the model"
                )),
                // I3: the crash point. Invoke once; the existing MODEL_CALL stands.
                None => self.invoke(call).await,
            };
        }
        if self.mode == Mode::Replay {
            return self.diverged("the harness made more model calls than were recorded".into());
        }
        let recorded = ModelCall {
            model: call.model.clone(),
            params: call.params.clone(),
            input_hash: hash,
            id: call.id.clone(),
            ..Default::default()
        };
        self.append(vec![(EventKind::EventModelCall, Body::Model(recorded))])
            .await?;
        self.invoke(call).await
    }

    async fn invoke(&mut self, call: ModelCall) -> Result<Reply> {
        self.io.counters.count_model_call();
        let completion = match self.io.observer {
            None => self.io.provider.complete(&call, None).await?,
            Some(observer) => {
                let (tx, mut rx) = mpsc::channel::<Chunk>(64);
                let execution_id = self.execution_id.clone();
                let observer = observer.clone();
                let forward = async move {
                    while let Some(chunk) = rx.recv().await {
                        if chunk.text.is_empty() && !chunk.done {
                            continue;
                        }
                        let delta = agentvm_proto::v1::Delta {
                            execution_id: execution_id.clone(),
                            part_index: chunk.part_index,
                            chunk: chunk.text,
                            done: chunk.done,
                        };
                        let _ = observer
                            .send(ExecUpdate {
                                update: Some(exec_update::Update::Delta(delta)),
                            })
                            .await;
                    }
                };
                let (completion, ()) =
                    tokio::join!(self.io.provider.complete(&call, Some(tx)), forward);
                completion?
            }
        };
        self.append(vec![(
            EventKind::EventOutput,
            Body::Message(completion.message.clone()),
        )])
        .await?;
        Ok(model_reply(completion.message, call.id))
    }

    /// EVENT_OUTPUT: must equal the recorded OUTPUT, or is recorded.
    pub async fn output(&mut self, message: Message) -> Result<Reply> {
        self.plain_effect(EventKind::EventOutput, Body::Message(message), "output")
            .await
    }

    /// EVENT_USAGE: must equal the recorded USAGE exactly, or is recorded.
    pub async fn usage(&mut self, usage: Usage) -> Result<Reply> {
        self.plain_effect(EventKind::EventUsage, Body::Usage(usage), "usage")
            .await
    }

    /// EVENT_TOOL_RESULT (an IN_HARNESS_REPORTED result): no host-owned receipt data allowed.
    pub async fn report(&mut self, result: ToolResult) -> Result<Reply> {
        if result.approval_request_seq != 0
            || result.approval_decision_seq != 0
            || result.code == ResultCode::ApprovalDenied as i32
        {
            return Err(ControllerError::ApprovalReceiptReport(result.id));
        }
        self.plain_effect(
            EventKind::EventToolResult,
            Body::Result(result),
            "tool report",
        )
        .await
    }

    async fn plain_effect(&mut self, kind: EventKind, body: Body, what: &str) -> Result<Reply> {
        if let Some(rec) = self.peek() {
            if rec.event.kind != kind as i32 || rec.event.body.as_ref() != Some(&body) {
                return self.diverged(format!(
                    "the harness's {what} differs from the {} recorded at seq {}",
                    kind_name(&rec.event),
                    rec.seq
                ));
            }
            self.cursor += 1;
            return Ok(Reply::Nothing);
        }
        if self.mode == Mode::Replay {
            return self.diverged(format!(
                "the harness emitted an {what} that was never recorded"
            ));
        }
        self.append(vec![(kind, body)]).await?;
        Ok(Reply::Nothing)
    }

    /// EVENT_TOOL_CALL: a host-mediated tool (I3) or an approval gate (§4.6).
    pub async fn tool_call(&mut self, call: ToolCall) -> Result<Reply> {
        let gated = match Mediation::try_from(call.mediation) {
            Ok(Mediation::ControllerMediated) => false,
            Ok(Mediation::RequiresApproval) => true,
            Ok(m) => {
                return Err(ControllerError::UnmediatedToolCall(
                    call.id,
                    m.as_str_name().to_owned(),
                ));
            }
            Err(_) => {
                return Err(ControllerError::UnmediatedToolCall(
                    call.id,
                    format!("value {}", call.mediation),
                ));
            }
        };
        if gated {
            if self.io.memory_tier {
                return Err(ControllerError::ApprovalUnavailable(
                    "approval gates need a STATELESS_REPLAY harness; a memory-snapshot harness cannot be re-run by replay".into(),
                ));
            }
            if self.io.session.is_empty() {
                return Err(ControllerError::InvalidApprovalCall(
                    "MissingSessionUID: the execution has no session".into(),
                ));
            }
            if call.id.is_empty() {
                return Err(ControllerError::InvalidApprovalCall(
                    "a gated tool call needs an id".into(),
                ));
            }
        }
        if call.idempotency_key.is_empty() {
            return Err(ControllerError::MissingIdempotencyKey(call.id));
        }
        check_args(call.args.as_ref())
            .map_err(|why| ControllerError::InvalidToolArgs(call.id.clone(), why))?;
        if !call.id.is_empty() && !self.call_ids.insert(call.id.clone()) {
            return Err(ControllerError::InvalidApprovalCall(format!(
                "tool call id {:?} is used twice in one execution",
                call.id
            )));
        }

        if let Some(rec) = self.peek() {
            let seq = rec.seq;
            match &rec.event.body {
                Some(Body::Tool(recorded)) if rec.event.kind == EventKind::EventToolCall as i32 => {
                    if let Some(field) = tool_call_difference(recorded, &call) {
                        return self.diverged(format!(
                            "tool call {:?} differs from the call recorded at seq {seq} in {field}",
                            call.id
                        ));
                    }
                }
                _ => {
                    return self.diverged(format!(
                        "the harness made a tool call where seq {seq} records {}",
                        kind_name(&rec.event)
                    ));
                }
            }
            self.cursor += 1;
            if gated {
                return self.recorded_gate(call).await;
            }
            return match self.peek() {
                Some(Recorded { event, seq: rseq })
                    if event.kind == EventKind::EventToolResult as i32 =>
                {
                    let rseq = *rseq;
                    let result = match &event.body {
                        Some(Body::Result(r)) => r.clone(),
                        _ => {
                            return self
                                .diverged(format!("the TOOL_RESULT at seq {rseq} has no result"));
                        }
                    };
                    if result.id != call.id {
                        return self.diverged(format!(
                            "the TOOL_RESULT at seq {rseq} answers {:?}, not call {:?}",
                            result.id, call.id
                        ));
                    }
                    self.cursor += 1;
                    Ok(tool_reply(result))
                }
                None if self.mode == Mode::Recover => self.execute(call).await,
                // The original executor failed and the harness carried on; answer the same way.
                _ => Ok(tool_reply(ToolResult {
                    id: call.id,
                    is_error: true,
                    error: "recorded tool call has no result".into(),
                    ..Default::default()
                })),
            };
        }
        if self.mode == Mode::Replay {
            return self.diverged(format!(
                "the harness made tool call {:?}, which was never recorded",
                call.id
            ));
        }
        if gated {
            let records = self
                .append(vec![
                    (EventKind::EventToolCall, Body::Tool(call.clone())),
                    (
                        EventKind::EventApprovalRequest,
                        Body::Approval(ApprovalRequest {
                            tool_call_id: call.id.clone(),
                            reason: String::new(),
                        }),
                    ),
                ])
                .await?;
            return Ok(self.park(call.id, records[1].seq));
        }
        if self.io.executor.is_none() {
            return Err(ControllerError::MissingToolExecutor(call.tool));
        }
        self.append(vec![(EventKind::EventToolCall, Body::Tool(call.clone()))])
            .await?;
        self.execute(call).await
    }

    fn park(&mut self, tool_call_id: String, request_seq: i64) -> Reply {
        let park = ApprovalRef {
            execution_id: self.execution_id.clone(),
            tool_call_id,
            request_seq,
        };
        self.open_gate = Some(park.clone());
        Reply::Park(park)
    }

    /// A mediated call whose intent is durable: run it once and record the result. An executor
    /// error goes back to the harness and is not recorded.
    async fn execute(&mut self, call: ToolCall) -> Result<Reply> {
        let executor = self
            .io
            .executor
            .ok_or_else(|| ControllerError::MissingToolExecutor(call.tool.clone()))?;
        self.io.counters.count_executor_call();
        let ctx = ToolCallContext {
            session_uid: self.io.session.to_owned(),
        };
        match executor.execute(&ctx, &call).await {
            Ok(mut result) => {
                result.id = call.id;
                result.approval_request_seq = 0;
                result.approval_decision_seq = 0;
                if result.code == ResultCode::ApprovalDenied as i32 {
                    result.code = ResultCode::ExecutorError as i32;
                }
                self.append(vec![(
                    EventKind::EventToolResult,
                    Body::Result(result.clone()),
                )])
                .await?;
                Ok(tool_reply(result))
            }
            Err(error) => Ok(tool_reply(ToolResult {
                id: call.id,
                is_error: true,
                error,
                code: ResultCode::ExecutorError as i32,
                ..Default::default()
            })),
        }
    }

    /// A gated call found in the journal: request → decision → receipt, each served if
    /// recorded; the first missing one is repaired (request), parks again (decision) or is
    /// produced (receipt) outside replay.
    async fn recorded_gate(&mut self, call: ToolCall) -> Result<Reply> {
        let request_seq = match self.take() {
            Some(Recorded { seq, event })
                if event.kind == EventKind::EventApprovalRequest as i32
                    && matches!(&event.body, Some(Body::Approval(a)) if a.tool_call_id == call.id) =>
            {
                seq
            }
            Some(other) => {
                return self.diverged(format!(
                    "gated call {:?} is followed by {} at seq {}, not its approval request",
                    call.id,
                    kind_name(&other.event),
                    other.seq
                ));
            }
            None if self.mode == Mode::Replay => {
                return self.diverged(format!("gated call {:?} has no approval request", call.id));
            }
            None => {
                // A call-only cut: the request append was lost. Repair it once and park.
                let records = self
                    .append(vec![(
                        EventKind::EventApprovalRequest,
                        Body::Approval(ApprovalRequest {
                            tool_call_id: call.id.clone(),
                            reason: String::new(),
                        }),
                    )])
                    .await?;
                return Ok(self.park(call.id, records[0].seq));
            }
        };
        let (decision, decision_seq) = match self.take() {
            Some(Recorded { seq, event }) => match (&event.body, event.kind) {
                (Some(Body::ApprovalResult(d)), k)
                    if k == EventKind::EventApprovalResult as i32
                        && d.tool_call_id == call.id
                        && (d.request_seq == 0 || d.request_seq == request_seq) =>
                {
                    (d.clone(), seq)
                }
                _ => {
                    return self.diverged(format!(
                        "approval request at seq {request_seq} is followed by {} at seq {seq}, not its decision",
                        kind_name(&event)
                    ));
                }
            },
            None if self.mode == Mode::Replay => {
                return self.diverged(format!(
                    "a completed execution has an undecided gate at seq {request_seq}"
                ));
            }
            None => return Ok(self.park(call.id, request_seq)),
        };
        let decision = ApprovalResult {
            request_seq,
            ..decision
        };
        let receipt = match self.take() {
            Some(Recorded { seq, event }) => match &event.body {
                Some(Body::Result(r))
                    if event.kind == EventKind::EventToolResult as i32 && r.id == call.id =>
                {
                    if let Err(why) = check_receipt(r, &decision, decision_seq) {
                        return self.diverged(format!("receipt at seq {seq}: {why}"));
                    }
                    r.clone()
                }
                _ => {
                    return self.diverged(format!(
                        "decision at seq {decision_seq} is followed by {} at seq {seq}, not its receipt",
                        kind_name(&event)
                    ));
                }
            },
            None if self.mode == Mode::Replay => {
                return self.diverged(format!(
                    "a completed execution has no receipt for the decision at seq {decision_seq}"
                ));
            }
            None => {
                let receipt = self.make_receipt(&call, &decision, decision_seq).await?;
                self.append(vec![(
                    EventKind::EventToolResult,
                    Body::Result(receipt.clone()),
                )])
                .await?;
                receipt
            }
        };
        Ok(Reply::Frames(vec![
            Frame::Approval(decision),
            Frame::Tool(receipt),
        ]))
    }

    async fn make_receipt(
        &mut self,
        call: &ToolCall,
        decision: &ApprovalResult,
        decision_seq: i64,
    ) -> Result<ToolResult> {
        let mut receipt = if decision.approved {
            let executor = self
                .io
                .executor
                .ok_or_else(|| ControllerError::MissingToolExecutor(call.tool.clone()))?;
            self.io.counters.count_executor_call();
            let ctx = ToolCallContext {
                session_uid: self.io.session.to_owned(),
            };
            match executor.execute(&ctx, call).await {
                Ok(r) if r.is_error => ToolResult {
                    code: ResultCode::ExecutorError as i32,
                    ..r
                },
                Ok(r) => ToolResult {
                    code: ResultCode::Unspecified as i32,
                    ..r
                },
                Err(error) => ToolResult {
                    is_error: true,
                    error,
                    code: ResultCode::ExecutorError as i32,
                    ..Default::default()
                },
            }
        } else {
            ToolResult {
                is_error: true,
                code: ResultCode::ApprovalDenied as i32,
                content: vec![text_part("denied")],
                ..Default::default()
            }
        };
        receipt.id = call.id.clone();
        receipt.approval_request_seq = decision.request_seq;
        receipt.approval_decision_seq = decision_seq;
        Ok(receipt)
    }

    /// EVENT_END{COMPLETED}: every recorded effect must have been asked for (R1).
    pub fn finish(&self) -> Result<()> {
        if let Some(gate) = &self.open_gate {
            return Err(ControllerError::HarnessProtocol(format!(
                "END after the execution parked at call {:?}",
                gate.tool_call_id
            )));
        }
        if self.cursor < self.recorded.len() {
            return self.diverged(format!(
                "the harness consumed {} of {} recorded effects",
                self.cursor,
                self.recorded.len()
            ));
        }
        Ok(())
    }
}

fn model_reply(message: Message, model_call_id: String) -> Reply {
    Reply::Frames(vec![Frame::Model(ModelResult {
        message: Some(message),
        usage: None,
        model_call_id,
    })])
}

fn tool_reply(result: ToolResult) -> Reply {
    Reply::Frames(vec![Frame::Tool(result)])
}

/// R2: which identity field of an emitted call differs from the recorded one.
fn tool_call_difference(recorded: &ToolCall, emitted: &ToolCall) -> Option<&'static str> {
    if recorded.id != emitted.id {
        Some("id")
    } else if recorded.tool != emitted.tool {
        Some("tool")
    } else if recorded.mediation != emitted.mediation {
        Some("mediation")
    } else if recorded.idempotency_key != emitted.idempotency_key {
        Some("idempotency_key")
    } else if recorded.args != emitted.args {
        Some("args")
    } else {
        None
    }
}

/// A receipt must agree with its decision: denied ⇒ APPROVAL_DENIED/error; approved ⇒
/// UNSPECIFIED/ok or EXECUTOR_ERROR/error; and carry both seqs.
fn check_receipt(
    r: &ToolResult,
    decision: &ApprovalResult,
    decision_seq: i64,
) -> Result<(), String> {
    let code = ResultCode::try_from(r.code).unwrap_or(ResultCode::Unspecified);
    let consistent = if decision.approved {
        matches!(
            (code, r.is_error),
            (ResultCode::Unspecified, false) | (ResultCode::ExecutorError, true)
        )
    } else {
        code == ResultCode::ApprovalDenied && r.is_error
    };
    if !consistent {
        return Err(format!(
            "code {} / is_error {} does not match the decision approved={}",
            code.as_str_name(),
            r.is_error,
            decision.approved
        ));
    }
    if r.approval_request_seq != decision.request_seq || r.approval_decision_seq != decision_seq {
        return Err(format!(
            "seqs {}/{} do not name request {} and decision {decision_seq}",
            r.approval_request_seq, r.approval_decision_seq, decision.request_seq
        ));
    }
    Ok(())
}
