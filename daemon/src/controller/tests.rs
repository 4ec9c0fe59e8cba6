//! Controller conformance at the controller level: semantics.md §6 A and B, each test named
//! after its scenario number. Harnesses run in-process over the same frame protocol a remote
//! one speaks (`InProcessEndpoint`), the journal is sqlite on disk.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use agentvm_harnesses::sdk::{Execution, Harness, HarnessFailure, Sink, SinkError};
use agentvm_proto::v1::{
    ApprovalResult, Capabilities, ComputeState, EventKind, ExecUpdate, HarnessDescriptor,
    LogRecord, Mediation, Message, ModelCall, Part, Resumability, TextPart, ToolCall, ToolResult,
    event::Body, exec_update::Update, part,
};
use prost_types::{Struct, Value, value::Kind};
use tokio::sync::mpsc;

use super::endpoint::{HarnessEndpoint, HarnessStream, InProcessEndpoint};
use super::error::ControllerError;
use super::tools::{ToolCallContext, ToolExecutor};
use super::*;
use crate::journal::sqlite::{Durability, SqliteJournal};
use crate::journal::verify::verify_chain;
use crate::journal::{Journal, SessionRow};
use crate::model::provider::{Chunk, Completion, EchoProvider, ModelProvider, ProviderError};

// ---------- fixtures ----------

fn text(role: &str, t: &str) -> Message {
    Message {
        role: role.into(),
        parts: vec![Part {
            part: Some(part::Part::Text(TextPart { text: t.into() })),
        }],
    }
}

fn text_of(m: &Message) -> String {
    m.parts
        .iter()
        .filter_map(|p| match &p.part {
            Some(part::Part::Text(t)) => Some(t.text.clone()),
            _ => None,
        })
        .collect()
}

struct Fixture {
    _dir: tempfile::TempDir,
    path: PathBuf,
    journal: Arc<SqliteJournal>,
    uid: String,
}

impl Fixture {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal.db");
        let journal = Arc::new(SqliteJournal::open(&path, Durability::Relaxed).unwrap());
        let uid = "sess-000000000000000000000001".to_owned();
        journal
            .create_session(&SessionRow {
                uid: uid.clone(),
                project: "default".into(),
                harness: "echo".into(),
                compute_state: ComputeState::ComputeNone,
                ..Default::default()
            })
            .unwrap();
        Fixture {
            _dir: dir,
            path,
            journal,
            uid,
        }
    }

    /// A fresh journal handle on the same file (a new process's view).
    fn reopen(&self) -> Arc<SqliteJournal> {
        Arc::new(SqliteJournal::open(&self.path, Durability::Relaxed).unwrap())
    }

    fn records(&self) -> Vec<LogRecord> {
        self.journal.read(&self.uid, 1, 0).unwrap()
    }

    fn kinds(&self) -> Vec<EventKind> {
        kinds(&self.records())
    }

    /// Simulates a crash: every record after `keep` is gone, as if never committed.
    fn cut_after(&self, keep: i64) {
        cut_after(&self.path, &self.uid, keep);
    }

    /// A fresh incarnation: a new fence, the harness dialed in-process.
    fn turn(&self, harness: Arc<dyn Harness>) -> Turn {
        let fence = self.journal.new_fence(&self.uid).unwrap();
        turn_with(&self.uid, fence, harness)
    }
}

fn turn_with(uid: &str, fence: i64, harness: Arc<dyn Harness>) -> Turn {
    Turn {
        session: uid.to_owned(),
        fence,
        fork_seq: 0,
        harness: "echo".into(),
        model: String::new(),
        descriptor: harness.descriptor(),
        endpoint: Arc::new(InProcessEndpoint::new(harness)),
        identity: None,
        observer: None,
        deadline: None,
        interrupt: None,
        harness_holds_through: None,
    }
}

fn cut_after(path: &Path, uid: &str, keep: i64) {
    let conn = rusqlite::Connection::open(path).unwrap();
    conn.execute(
        "DELETE FROM events WHERE session = ?1 AND seq > ?2",
        rusqlite::params![uid, keep],
    )
    .unwrap();
    conn.execute(
        "UPDATE sessions SET last_seq = ?2, head_hash = COALESCE(
             (SELECT hash FROM events WHERE session = ?1 AND seq = ?2), '')
         WHERE session = ?1",
        rusqlite::params![uid, keep],
    )
    .unwrap();
}

fn kinds(records: &[LogRecord]) -> Vec<EventKind> {
    records
        .iter()
        .map(|r| EventKind::try_from(r.event.as_ref().unwrap().kind).unwrap())
        .collect()
}

fn seq_of(records: &[LogRecord], kind: EventKind) -> i64 {
    records
        .iter()
        .find(|r| r.event.as_ref().unwrap().kind == kind as i32)
        .map(|r| r.seq)
        .unwrap()
}

fn outputs(records: &[LogRecord]) -> Vec<String> {
    records
        .iter()
        .filter_map(|r| match &r.event.as_ref().unwrap().body {
            Some(Body::Message(m)) if m.role == "assistant" => Some(text_of(m)),
            _ => None,
        })
        .collect()
}

fn controller(journal: Arc<dyn Journal>, provider: Arc<dyn ModelProvider>) -> Controller {
    Controller::new(journal, provider, None)
}

fn controller_with_tools(journal: Arc<dyn Journal>, executor: Arc<CountingExecutor>) -> Controller {
    Controller::new(journal, Arc::new(EchoProvider), Some(executor))
}

fn inputs(texts: &[&str]) -> NewExecution {
    NewExecution {
        inputs: texts.iter().map(|t| text("user", t)).collect(),
        ..Default::default()
    }
}

fn echo() -> Arc<dyn Harness> {
    Arc::new(agentvm_harnesses::echo::Echo)
}

// ---------- providers ----------

/// A new answer on every call: replay must serve the recorded one.
#[derive(Default)]
struct Nondeterministic {
    calls: AtomicU64,
}

#[async_trait::async_trait]
impl ModelProvider for Nondeterministic {
    fn name(&self) -> &'static str {
        "nondeterministic"
    }
    async fn complete(
        &self,
        _call: &ModelCall,
        _stream: Option<mpsc::Sender<Chunk>>,
    ) -> Result<Completion, ProviderError> {
        let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        Ok(Completion {
            message: text("assistant", &format!("answer-{n}")),
            usage: None,
        })
    }
}

/// Fails the first `failures` calls, then answers like echo.
struct FlakyProvider {
    failures: u64,
    calls: AtomicU64,
}

#[async_trait::async_trait]
impl ModelProvider for FlakyProvider {
    fn name(&self) -> &'static str {
        "flaky"
    }
    async fn complete(
        &self,
        call: &ModelCall,
        stream: Option<mpsc::Sender<Chunk>>,
    ) -> Result<Completion, ProviderError> {
        let n = self.calls.fetch_add(1, Ordering::SeqCst);
        if n < self.failures {
            return Err(ProviderError::Unavailable {
                provider: "flaky",
                reason: format!("failure {}", n + 1),
            });
        }
        EchoProvider.complete(call, stream).await
    }
}

// ---------- harnesses ----------

/// Echo, but tampering with the model input on demand (an I0 violator).
struct AlteredEcho;

#[async_trait::async_trait]
impl Harness for AlteredEcho {
    fn descriptor(&self) -> HarnessDescriptor {
        agentvm_harnesses::echo::Echo.descriptor()
    }
    async fn run(&self, exec: &Execution, sink: &mut Sink) -> Result<(), HarnessFailure> {
        let last = exec.start.inputs.last().map(text_of).unwrap_or_default();
        sink.model(ModelCall {
            model: "echo".into(),
            messages: vec![text("user", &format!("{last}!"))],
            ..Default::default()
        })
        .await?;
        Ok(())
    }
}

/// Emits only its own OUTPUT with a fixed text (no model call).
struct Says(&'static str);

#[async_trait::async_trait]
impl Harness for Says {
    fn descriptor(&self) -> HarnessDescriptor {
        agentvm_harnesses::echo::Echo.descriptor()
    }
    async fn run(&self, _exec: &Execution, sink: &mut Sink) -> Result<(), HarnessFailure> {
        sink.output(text("assistant", self.0)).await?;
        Ok(())
    }
}

/// Two model calls per turn, or just one when `short` (an under-consuming replay).
struct TwoCalls {
    short: bool,
}

#[async_trait::async_trait]
impl Harness for TwoCalls {
    fn descriptor(&self) -> HarnessDescriptor {
        agentvm_harnesses::echo::Echo.descriptor()
    }
    async fn run(&self, _exec: &Execution, sink: &mut Sink) -> Result<(), HarnessFailure> {
        for i in 0..if self.short { 1 } else { 2 } {
            sink.model(ModelCall {
                model: "echo".into(),
                messages: vec![text("user", &format!("call {i}"))],
                ..Default::default()
            })
            .await?;
        }
        Ok(())
    }
}

struct Fails;

#[async_trait::async_trait]
impl Harness for Fails {
    fn descriptor(&self) -> HarnessDescriptor {
        agentvm_harnesses::echo::Echo.descriptor()
    }
    async fn run(&self, _exec: &Execution, _sink: &mut Sink) -> Result<(), HarnessFailure> {
        Err(HarnessFailure::new("the harness gave up"))
    }
}

/// Records what each Start carried.
#[derive(Default)]
struct StartRecorder {
    starts: Mutex<Vec<Execution>>,
    /// Declares the memory tier.
    memory: bool,
    /// Declares `incremental_history` (stateless, the SDK keeping what it was sent).
    keeps_history: bool,
}

#[async_trait::async_trait]
impl Harness for StartRecorder {
    fn descriptor(&self) -> HarnessDescriptor {
        let mut d = agentvm_harnesses::echo::Echo.descriptor();
        let caps = d.capabilities.get_or_insert_with(Default::default);
        caps.incremental_history = self.keeps_history;
        if self.memory {
            caps.resumability = Resumability::RequiresMemorySnapshot as i32;
        }
        d
    }
    async fn run(&self, exec: &Execution, sink: &mut Sink) -> Result<(), HarnessFailure> {
        self.starts.lock().unwrap().push(exec.clone());
        agentvm_harnesses::echo::Echo.run(exec, sink).await
    }
}

/// Calls one tool, then reports its outcome as OUTPUT. Swallows errors from the tool call
/// when `swallow` (the host's sticky failure must still fail the turn).
struct ToolUser {
    call: ToolCall,
    memory: bool,
    swallow: bool,
    seen: Mutex<Vec<ToolAnswerSeen>>,
}

#[derive(Debug, Clone, PartialEq)]
struct ToolAnswerSeen {
    result: ToolResult,
    approval: Option<ApprovalResult>,
}

impl ToolUser {
    fn new(call: ToolCall) -> Self {
        ToolUser {
            call,
            memory: false,
            swallow: false,
            seen: Mutex::default(),
        }
    }
}

#[async_trait::async_trait]
impl Harness for ToolUser {
    fn descriptor(&self) -> HarnessDescriptor {
        let mut d = agentvm_harnesses::echo::Echo.descriptor();
        if self.memory {
            d.capabilities = Some(Capabilities {
                resumability: Resumability::RequiresMemorySnapshot as i32,
                ..Default::default()
            });
        }
        d
    }
    async fn run(&self, _exec: &Execution, sink: &mut Sink) -> Result<(), HarnessFailure> {
        match sink.tool_call(self.call.clone()).await {
            Ok(answer) => {
                self.seen.lock().unwrap().push(ToolAnswerSeen {
                    result: answer.result.clone(),
                    approval: answer.approval.clone(),
                });
                let said = if answer.result.is_error {
                    format!("error:{}", answer.result.error)
                } else {
                    "ok".to_owned()
                };
                sink.output(text("assistant", &said)).await?;
                Ok(())
            }
            Err(SinkError::Parked(p)) => Err(SinkError::Parked(p).into()),
            Err(e) if self.swallow => {
                let _ = e;
                Ok(())
            }
            Err(e) => Err(e.into()),
        }
    }
}

fn args(pairs: &[(&str, f64)]) -> Option<Struct> {
    Some(Struct {
        fields: pairs
            .iter()
            .map(|(k, v)| {
                (
                    (*k).to_owned(),
                    Value {
                        kind: Some(Kind::NumberValue(*v)),
                    },
                )
            })
            .collect::<BTreeMap<_, _>>(),
    })
}

fn tool_call(mediation: Mediation, key: &str) -> ToolCall {
    ToolCall {
        id: "call-1".into(),
        tool: "add".into(),
        args: args(&[("x", 2.0)]),
        mediation: mediation as i32,
        idempotency_key: key.into(),
    }
}

/// A deduplicating executor: a repeated (session, key) returns the first result without
/// repeating the effect.
#[derive(Default)]
struct CountingExecutor {
    calls: AtomicU64,
    effects: AtomicU64,
    done: Mutex<HashMap<(String, String), ToolResult>>,
    fail_with: Option<String>,
}

#[async_trait::async_trait]
impl ToolExecutor for CountingExecutor {
    async fn execute(&self, ctx: &ToolCallContext, call: &ToolCall) -> Result<ToolResult, String> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if let Some(e) = &self.fail_with {
            return Err(e.clone());
        }
        let key = (ctx.session_uid.clone(), call.idempotency_key.clone());
        let mut done = self.done.lock().unwrap();
        if let Some(r) = done.get(&key) {
            return Ok(r.clone());
        }
        self.effects.fetch_add(1, Ordering::SeqCst);
        let r = ToolResult {
            id: "executor-chosen-id".into(),
            output: args(&[("sum", 4.0)]),
            ..Default::default()
        };
        done.insert(key, r.clone());
        Ok(r)
    }
}

// ---------- A. replay conformance ----------

#[tokio::test]
async fn scenario_01_replay_under_nondeterminism() {
    let f = Fixture::new();
    let provider = Arc::new(Nondeterministic::default());
    let c = controller(f.journal.clone(), provider.clone());
    c.exec(&f.turn(echo()), inputs(&["hi"])).await.unwrap();
    let before = f.records();
    assert_eq!(outputs(&before), ["answer-1"]);

    let fresh = controller(f.reopen(), provider.clone());
    let summary = fresh.replay(&f.turn(echo())).await.unwrap();
    assert_eq!(summary.executions, 1);
    assert_eq!(fresh.counters().model_calls(), 0);
    assert_eq!(provider.calls.load(Ordering::SeqCst), 1);
    assert_eq!(f.records(), before, "replay is read-only");
    // A direct call to the model now answers differently.
    let direct = provider
        .complete(&ModelCall::default(), None)
        .await
        .unwrap();
    assert_ne!(text_of(&direct.message), "answer-1");
}

#[tokio::test]
async fn scenario_02_multi_turn_across_incarnations() {
    let f = Fixture::new();
    for word in ["one", "two", "three"] {
        let journal = f.reopen();
        let head = journal.get_session(&f.uid).unwrap().unwrap().last_seq;
        let c = controller(journal, Arc::new(EchoProvider));
        let mut new = inputs(&[word]);
        new.expected_last_seq = Some(head);
        c.exec(&f.turn(echo()), new).await.unwrap();
    }
    let records = f.records();
    assert_eq!(outputs(&records), ["echo:one", "echo:two", "echo:three"]);
    assert_eq!(records.len(), 15);
    verify_chain(&records).unwrap();
}

#[tokio::test]
async fn scenario_03_crash_after_output_before_end() {
    let f = Fixture::new();
    let c = controller(f.journal.clone(), Arc::new(EchoProvider));
    c.exec(&f.turn(echo()), inputs(&["hi"])).await.unwrap();
    f.cut_after(4);
    let fresh = controller(f.reopen(), Arc::new(EchoProvider));
    let outcome = fresh.resume(&f.turn(echo())).await.unwrap();
    assert!(matches!(outcome, Some(TurnOutcome::Completed { .. })));
    assert_eq!(fresh.counters().model_calls(), 0);
    let records = f.records();
    assert_eq!(*kinds(&records).last().unwrap(), EventKind::EventEnd);
    assert_eq!(outputs(&records).len(), 1);
    verify_chain(&records).unwrap();
    // Nothing left to resume.
    assert_eq!(fresh.resume(&f.turn(echo())).await.unwrap(), None);
}

#[tokio::test]
async fn scenario_05_single_writer_stale_cas() {
    let f = Fixture::new();
    let c = controller(f.journal.clone(), Arc::new(EchoProvider));
    c.exec(&f.turn(echo()), inputs(&["first"])).await.unwrap();
    let second = controller(f.reopen(), Arc::new(EchoProvider));
    let mut stale = inputs(&["second"]);
    stale.expected_last_seq = Some(0);
    let err = second.exec(&f.turn(echo()), stale).await.unwrap_err();
    assert!(
        matches!(err, ControllerError::Journal(JournalError::Conflict { .. })),
        "{err}"
    );
    assert_eq!(err.code(), tonic::Code::Aborted);
    assert_eq!(f.records().len(), 5);
}

#[tokio::test]
async fn scenario_07_crash_between_tool_execute_and_result() {
    let f = Fixture::new();
    let exec = Arc::new(CountingExecutor::default());
    let c = controller_with_tools(f.journal.clone(), exec.clone());
    let h = Arc::new(ToolUser::new(tool_call(
        Mediation::ControllerMediated,
        "k1",
    )));
    c.exec(&f.turn(h.clone()), inputs(&["go"])).await.unwrap();
    let records = f.records();
    assert_eq!(
        kinds(&records),
        [
            EventKind::EventExecutionStart,
            EventKind::EventInput,
            EventKind::EventToolCall,
            EventKind::EventToolResult,
            EventKind::EventOutput,
            EventKind::EventEnd
        ]
    );
    // The recorded result answers the call id, whatever id the executor chose (scenario 44).
    match &records[3].event.as_ref().unwrap().body {
        Some(Body::Result(r)) => assert_eq!(r.id, "call-1"),
        other => panic!("{other:?}"),
    }
    f.cut_after(seq_of(&records, EventKind::EventToolCall));
    let fresh = controller_with_tools(f.reopen(), exec.clone());
    fresh.resume(&f.turn(h)).await.unwrap().unwrap();
    assert_eq!(exec.calls.load(Ordering::SeqCst), 2, "re-driven once");
    assert_eq!(
        exec.effects.load(Ordering::SeqCst),
        1,
        "the executor deduplicated"
    );
    let records = f.records();
    let results = kinds(&records)
        .iter()
        .filter(|k| **k == EventKind::EventToolResult)
        .count();
    assert_eq!(results, 1);
    assert_eq!(*kinds(&records).last().unwrap(), EventKind::EventEnd);
    verify_chain(&records).unwrap();
}

#[tokio::test]
async fn scenario_08_keyless_mediated_tool() {
    let f = Fixture::new();
    let exec = Arc::new(CountingExecutor::default());
    let c = controller_with_tools(f.journal.clone(), exec.clone());
    let h = Arc::new(ToolUser::new(tool_call(Mediation::ControllerMediated, "")));
    let err = c.exec(&f.turn(h), inputs(&["go"])).await.unwrap_err();
    assert!(
        matches!(err, ControllerError::MissingIdempotencyKey(_)),
        "{err}"
    );
    assert!(!f.kinds().contains(&EventKind::EventToolCall));
    assert_eq!(*f.kinds().last().unwrap(), EventKind::EventError);
    assert_eq!(exec.calls.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn scenario_09_unmediated_tool_call() {
    let f = Fixture::new();
    let exec = Arc::new(CountingExecutor::default());
    let c = controller_with_tools(f.journal.clone(), exec.clone());
    let h = Arc::new(ToolUser::new(tool_call(Mediation::Unspecified, "k")));
    let err = c.exec(&f.turn(h), inputs(&["go"])).await.unwrap_err();
    assert!(
        matches!(err, ControllerError::UnmediatedToolCall(..)),
        "{err}"
    );
    let k = f.kinds();
    assert!(!k.contains(&EventKind::EventToolResult) && !k.contains(&EventKind::EventToolCall));
}

/// Chat model requests go to a real HTTP client; the counting server sees every call.
struct ChatModel;

#[async_trait::async_trait]
impl Harness for ChatModel {
    fn descriptor(&self) -> HarnessDescriptor {
        agentvm_harnesses::echo::Echo.descriptor()
    }
    async fn run(&self, exec: &Execution, sink: &mut Sink) -> Result<(), HarnessFailure> {
        sink.model(ModelCall {
            model: "gpt-test".into(),
            messages: exec.start.inputs.clone(),
            ..Default::default()
        })
        .await?;
        Ok(())
    }
}

#[tokio::test]
async fn scenario_10_replay_never_reaches_the_provider() {
    use crate::model::openai::tests::FakeOpenAi;
    let server = FakeOpenAi::counting().await;
    let f = Fixture::new();
    let c = controller(f.journal.clone(), Arc::new(server.provider(None)));
    c.exec(&f.turn(Arc::new(ChatModel)), inputs(&["hi"]))
        .await
        .unwrap();
    assert_eq!(server.requests.lock().unwrap().len(), 1);
    assert_eq!(outputs(&f.records()), ["answer-1"]);
    let before = f.records();
    let fresh = controller(f.reopen(), Arc::new(server.provider(None)));
    fresh.replay(&f.turn(Arc::new(ChatModel))).await.unwrap();
    assert_eq!(
        server.requests.lock().unwrap().len(),
        1,
        "replay sent no request"
    );
    assert_eq!(f.records(), before);
}

/// The echo model, streamed in word-sized chunks (the built-in one answers whole, as
/// upstream's): a streaming provider for the paths that carry deltas.
struct ChunkedEcho;

#[async_trait::async_trait]
impl ModelProvider for ChunkedEcho {
    fn name(&self) -> &'static str {
        "chunked-echo"
    }

    async fn complete(
        &self,
        call: &ModelCall,
        stream: Option<mpsc::Sender<Chunk>>,
    ) -> Result<Completion, ProviderError> {
        let completion = EchoProvider.complete(call, None).await?;
        if let Some(tx) = stream {
            let text = crate::model::provider::message_text(&completion.message);
            let mut rest = text.as_str();
            while !rest.is_empty() {
                let cut = rest
                    .char_indices()
                    .skip(1)
                    .find(|(_, c)| *c == ' ' || *c == ':')
                    .map_or(rest.len(), |(i, _)| i);
                let (head, tail) = rest.split_at(cut);
                let _ = tx
                    .send(Chunk {
                        part_index: 0,
                        text: head.to_owned(),
                        done: false,
                    })
                    .await;
                rest = tail;
            }
            let _ = tx
                .send(Chunk {
                    part_index: 0,
                    text: String::new(),
                    done: true,
                })
                .await;
        }
        Ok(completion)
    }
}

#[tokio::test]
async fn scenario_11_and_12_streaming_changes_nothing_and_replay_has_no_deltas() {
    let f = Fixture::new();
    let c = controller(f.journal.clone(), Arc::new(ChunkedEcho));
    let (tx, mut rx) = mpsc::channel(256);
    let mut t = f.turn(echo());
    t.observer = Some(tx);
    c.exec(&t, inputs(&["hello big world"])).await.unwrap();
    drop(t);
    let mut deltas = Vec::new();
    let mut streamed = Vec::new();
    while let Some(ExecUpdate { update }) = rx.recv().await {
        match update {
            Some(Update::Delta(d)) => deltas.push(d),
            Some(Update::Record(r)) => streamed.push(r),
            _ => {}
        }
    }
    assert!(
        deltas.len() > 2 && deltas.last().unwrap().done,
        "{deltas:?}"
    );
    let joined: String = deltas.iter().map(|d| d.chunk.as_str()).collect();
    assert_eq!(joined, "echo:hello big world");
    // The streamed records are the journal, and its shape equals an unstreamed turn's.
    assert_eq!(streamed, f.records());
    let g = Fixture::new();
    controller(g.journal.clone(), Arc::new(EchoProvider))
        .exec(&g.turn(echo()), inputs(&["hello big world"]))
        .await
        .unwrap();
    assert_eq!(kinds(&streamed), g.kinds());
    assert_eq!(outputs(&streamed), outputs(&g.records()));

    let (tx, mut rx) = mpsc::channel(256);
    let mut t = f.turn(echo());
    t.observer = Some(tx);
    let fresh = controller(f.reopen(), Arc::new(EchoProvider));
    fresh.replay(&t).await.unwrap();
    drop(t);
    assert!(
        rx.recv().await.is_none(),
        "replay emits neither deltas nor records"
    );
    assert_eq!(fresh.counters().model_calls(), 0);
}

#[tokio::test]
async fn scenario_13_failed_harness() {
    let f = Fixture::new();
    let c = controller(f.journal.clone(), Arc::new(EchoProvider));
    let err = c
        .exec(&f.turn(Arc::new(Fails)), inputs(&["hi"]))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("the harness gave up"), "{err}");
    assert_eq!(err.code(), tonic::Code::Internal);
    let records = f.records();
    assert_eq!(*kinds(&records).last().unwrap(), EventKind::EventError);
    verify_chain(&records).unwrap();
}

#[tokio::test]
async fn scenario_16_invalid_tool_args() {
    for bad in [f64::NAN, f64::INFINITY, 9_007_199_254_740_993.0] {
        let f = Fixture::new();
        let exec = Arc::new(CountingExecutor::default());
        let c = controller_with_tools(f.journal.clone(), exec.clone());
        let mut call = tool_call(Mediation::ControllerMediated, "k");
        call.args = args(&[("x", bad)]);
        let err = c
            .exec(&f.turn(Arc::new(ToolUser::new(call))), inputs(&["go"]))
            .await
            .unwrap_err();
        assert!(matches!(err, ControllerError::InvalidToolArgs(..)), "{err}");
        assert_eq!(exec.calls.load(Ordering::SeqCst), 0);
        assert_eq!(
            f.kinds(),
            [
                EventKind::EventExecutionStart,
                EventKind::EventInput,
                EventKind::EventError
            ]
        );
    }
}

#[tokio::test]
async fn scenario_18_swallowed_invalid_args_still_fail() {
    let f = Fixture::new();
    let exec = Arc::new(CountingExecutor::default());
    let c = controller_with_tools(f.journal.clone(), exec.clone());
    let mut call = tool_call(Mediation::ControllerMediated, "k");
    call.args = args(&[("x", f64::NAN)]);
    let mut h = ToolUser::new(call);
    h.swallow = true;
    let err = c
        .exec(&f.turn(Arc::new(h)), inputs(&["go"]))
        .await
        .unwrap_err();
    assert!(matches!(err, ControllerError::InvalidToolArgs(..)), "{err}");
    assert!(!f.kinds().contains(&EventKind::EventEnd));
    assert_eq!(exec.calls.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn scenario_19_changed_tool_request_on_resume() {
    let f = Fixture::new();
    let exec = Arc::new(CountingExecutor::default());
    let c = controller_with_tools(f.journal.clone(), exec.clone());
    let h = Arc::new(ToolUser::new(tool_call(Mediation::ControllerMediated, "k")));
    c.exec(&f.turn(h), inputs(&["go"])).await.unwrap();
    f.cut_after(seq_of(&f.records(), EventKind::EventToolCall));
    let mut changed = tool_call(Mediation::ControllerMediated, "k");
    changed.args = args(&[("x", 3.0)]);
    let err = c
        .resume(&f.turn(Arc::new(ToolUser::new(changed))))
        .await
        .unwrap_err();
    assert!(
        matches!(err, ControllerError::ReplayDiverged(ref m) if m.contains("args")),
        "{err}"
    );
    assert_eq!(
        exec.calls.load(Ordering::SeqCst),
        1,
        "only the original run executed"
    );
}

// ---------- B. controller ----------

#[tokio::test]
async fn scenario_24_restart_replay_is_byte_identical() {
    let f = Fixture::new();
    controller(f.journal.clone(), Arc::new(EchoProvider))
        .exec(&f.turn(echo()), inputs(&["hi"]))
        .await
        .unwrap();
    let before = f.records();
    drop(f.journal.clone());
    let fresh = controller(f.reopen(), Arc::new(EchoProvider));
    fresh.replay(&f.turn(echo())).await.unwrap();
    assert_eq!(fresh.counters().model_calls(), 0);
    assert_eq!(f.records(), before);
    verify_chain(&before).unwrap();
}

#[tokio::test]
async fn scenario_25_i0_mismatch() {
    let f = Fixture::new();
    let c = controller(f.journal.clone(), Arc::new(EchoProvider));
    c.exec(&f.turn(echo()), inputs(&["hi"])).await.unwrap();
    let before = f.records();
    let err = c.replay(&f.turn(Arc::new(AlteredEcho))).await.unwrap_err();
    assert!(
        matches!(err, ControllerError::ReplayDiverged(ref m) if m.contains("I0")),
        "{err}"
    );
    assert_eq!(f.records(), before, "a diverging replay appends nothing");
}

#[tokio::test]
async fn scenario_26_stale_fence() {
    let f = Fixture::new();
    let c = controller(f.journal.clone(), Arc::new(EchoProvider));
    let old = f.turn(echo());
    let _newer = f.journal.new_fence(&f.uid).unwrap();
    let head = f.journal.get_session(&f.uid).unwrap().unwrap().last_seq;
    let mut new = inputs(&["hi"]);
    new.expected_last_seq = Some(head);
    let err = c.exec(&old, new).await.unwrap_err();
    assert!(
        matches!(err, ControllerError::Journal(JournalError::Fenced { .. })),
        "{err}"
    );
    assert!(f.records().is_empty());
}

#[tokio::test]
async fn scenario_27_cas_conflict() {
    let f = Fixture::new();
    let c = controller(f.journal.clone(), Arc::new(EchoProvider));
    let mut first = inputs(&["one"]);
    first.expected_last_seq = Some(0);
    c.exec(&f.turn(echo()), first.clone()).await.unwrap();
    let err = c.exec(&f.turn(echo()), first).await.unwrap_err();
    assert!(
        matches!(err, ControllerError::Journal(JournalError::Conflict { .. })),
        "{err}"
    );
}

#[tokio::test]
async fn scenario_30_under_consumption_and_output_divergence() {
    let f = Fixture::new();
    let c = controller(f.journal.clone(), Arc::new(EchoProvider));
    c.exec(&f.turn(Arc::new(TwoCalls { short: false })), inputs(&["x"]))
        .await
        .unwrap();
    let err = c
        .replay(&f.turn(Arc::new(TwoCalls { short: true })))
        .await
        .unwrap_err();
    assert!(
        matches!(err, ControllerError::ReplayDiverged(ref m) if m.contains("consumed 2 of 4")),
        "{err}"
    );
    c.replay(&f.turn(Arc::new(TwoCalls { short: false })))
        .await
        .unwrap();

    let g = Fixture::new();
    let c = controller(g.journal.clone(), Arc::new(EchoProvider));
    c.exec(&g.turn(Arc::new(Says("a"))), inputs(&["x"]))
        .await
        .unwrap();
    let err = c.replay(&g.turn(Arc::new(Says("b")))).await.unwrap_err();
    assert!(matches!(err, ControllerError::ReplayDiverged(_)), "{err}");
    c.replay(&g.turn(Arc::new(Says("a")))).await.unwrap();
}

#[tokio::test]
async fn scenario_31_and_70_cut_at_model_call() {
    // Provider error: the journal ends MODEL_CALL + ERROR; Resume invokes once.
    let f = Fixture::new();
    let flaky = Arc::new(FlakyProvider {
        failures: 1,
        calls: AtomicU64::new(0),
    });
    let c = controller(f.journal.clone(), flaky.clone());
    let err = c.exec(&f.turn(echo()), inputs(&["hi"])).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Internal, "{err}");
    assert_eq!(
        f.kinds(),
        [
            EventKind::EventExecutionStart,
            EventKind::EventInput,
            EventKind::EventModelCall,
            EventKind::EventError
        ]
    );
    c.resume(&f.turn(echo())).await.unwrap().unwrap();
    assert_eq!(flaky.calls.load(Ordering::SeqCst), 2);
    let records = f.records();
    let count = |k| kinds(&records).iter().filter(|x| **x == k).count();
    assert_eq!(count(EventKind::EventModelCall), 1);
    assert_eq!(count(EventKind::EventOutput), 1);
    assert_eq!(*kinds(&records).last().unwrap(), EventKind::EventEnd);
    let fresh = controller(f.reopen(), flaky.clone());
    fresh.replay(&f.turn(echo())).await.unwrap();
    assert_eq!(
        flaky.calls.load(Ordering::SeqCst),
        2,
        "replay makes no call"
    );
    verify_chain(&records).unwrap();
}

#[tokio::test]
async fn scenario_32_repeated_failed_resumes() {
    let f = Fixture::new();
    let flaky = Arc::new(FlakyProvider {
        failures: 3,
        calls: AtomicU64::new(0),
    });
    let c = controller(f.journal.clone(), flaky.clone());
    c.exec(&f.turn(echo()), inputs(&["hi"])).await.unwrap_err();
    c.resume(&f.turn(echo())).await.unwrap_err();
    c.resume(&f.turn(echo())).await.unwrap_err();
    c.resume(&f.turn(echo())).await.unwrap().unwrap();
    assert_eq!(flaky.calls.load(Ordering::SeqCst), 4);
    let k = f.kinds();
    assert_eq!(k.iter().filter(|x| **x == EventKind::EventError).count(), 3);
    assert_eq!(*k.last().unwrap(), EventKind::EventEnd);
}

#[tokio::test]
async fn scenario_34_hash_mismatch_at_cut() {
    let f = Fixture::new();
    let flaky = Arc::new(FlakyProvider {
        failures: 1,
        calls: AtomicU64::new(0),
    });
    let c = controller(f.journal.clone(), flaky.clone());
    c.exec(&f.turn(echo()), inputs(&["hi"])).await.unwrap_err();
    let err = c.resume(&f.turn(Arc::new(AlteredEcho))).await.unwrap_err();
    assert!(matches!(err, ControllerError::ReplayDiverged(_)), "{err}");
    assert_eq!(
        flaky.calls.load(Ordering::SeqCst),
        1,
        "no provider call on divergence"
    );
    assert_eq!(*f.kinds().last().unwrap(), EventKind::EventError);
    c.resume(&f.turn(echo())).await.unwrap().unwrap();
    assert_eq!(flaky.calls.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn scenario_36_recorded_output_before_cut() {
    let f = Fixture::new();
    let provider = Arc::new(Nondeterministic::default());
    let c = controller(f.journal.clone(), provider.clone());
    c.exec(&f.turn(Arc::new(TwoCalls { short: false })), inputs(&["x"]))
        .await
        .unwrap();
    // Cut after the first call's OUTPUT: the first completion is served, the second invoked.
    f.cut_after(4);
    c.resume(&f.turn(Arc::new(TwoCalls { short: false })))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(provider.calls.load(Ordering::SeqCst), 3);
    assert_eq!(outputs(&f.records()), ["answer-1", "answer-3"]);
}

#[tokio::test]
async fn scenario_37_and_39_incomplete_inputs_are_refused() {
    let f = Fixture::new();
    let c = controller(f.journal.clone(), Arc::new(EchoProvider));
    c.exec(&f.turn(echo()), inputs(&["a", "b"])).await.unwrap();
    // The second INPUT never committed.
    f.cut_after(2);
    let before = f.records();
    let err = c.resume(&f.turn(echo())).await.unwrap_err();
    assert!(
        matches!(err, ControllerError::IncompleteInvocation(_)),
        "{err}"
    );
    assert_eq!(err.code(), tonic::Code::FailedPrecondition);
    assert_eq!(f.records(), before);
}

#[tokio::test]
async fn scenario_38_inputless_execution_resumes_and_runs_once() {
    let f = Fixture::new();
    let provider = Arc::new(Nondeterministic::default());
    let c = controller(f.journal.clone(), provider.clone());
    c.exec(&f.turn(echo()), NewExecution::default())
        .await
        .unwrap();
    f.cut_after(1);
    c.resume(&f.turn(echo())).await.unwrap().unwrap();
    assert_eq!(provider.calls.load(Ordering::SeqCst), 2);
    assert_eq!(*f.kinds().last().unwrap(), EventKind::EventEnd);
}

/// A memory-tier harness is sent only the events after what it holds in memory, with the
/// seq they follow; one that holds nothing, and every stateless harness, gets them all.
#[tokio::test]
async fn a_memory_tier_harness_is_sent_only_what_it_does_not_hold() {
    let f = Fixture::new();
    let c = controller(f.journal.clone(), Arc::new(EchoProvider));
    c.exec(&f.turn(echo()), inputs(&["one"])).await.unwrap();
    c.exec(&f.turn(echo()), inputs(&["two"])).await.unwrap();
    let records = f.records();
    let first_turn_end = 5;
    let run = |memory: bool, holds: Option<i64>| {
        let recorder = Arc::new(StartRecorder {
            memory,
            ..Default::default()
        });
        let mut turn = f.turn(recorder.clone());
        turn.harness_holds_through = holds;
        let c = &c;
        async move {
            c.exec(&turn, inputs(&["more"])).await.unwrap();
            let start = recorder.starts.lock().unwrap()[0].start.clone();
            (start.history, start.history_after_seq)
        }
    };
    let kinds_of = |events: &[Event]| events.iter().map(|e| e.kind).collect::<Vec<_>>();
    let (history, after) = run(true, Some(first_turn_end)).await;
    assert_eq!(after, first_turn_end);
    let unseen: Vec<Event> = records[first_turn_end as usize..]
        .iter()
        .filter_map(|r| r.event.clone())
        .collect();
    assert_eq!(history, unseen, "the second turn's events, nothing before");

    let head = f.records().last().unwrap().seq;
    let (history, after) = run(true, Some(head)).await;
    assert!(history.is_empty(), "{:?}", kinds_of(&history));
    assert_eq!(after, head);

    for (memory, holds) in [(true, None), (true, Some(0)), (false, Some(5))] {
        let head = f.records().last().unwrap().seq;
        let (history, after) = run(memory, holds).await;
        assert_eq!(after, 0);
        assert_eq!(
            history.len() as i64,
            head,
            "memory {memory}, holds {holds:?}"
        );
    }
    // What it claims to hold beyond the head is not believed.
    let head = f.records().last().unwrap().seq;
    let (history, after) = run(true, Some(head + 10)).await;
    assert_eq!((history.len() as i64, after), (head, 0));
}

/// An endpoint that reads small frames: a long history no longer fits one Start.
struct SmallFrames(InProcessEndpoint);

#[async_trait::async_trait]
impl HarnessEndpoint for SmallFrames {
    async fn describe(&self) -> Result<HarnessDescriptor, tonic::Status> {
        self.0.describe().await
    }
    async fn connect(&self) -> Result<HarnessStream, tonic::Status> {
        self.0.connect().await
    }
    fn max_start_bytes(&self) -> usize {
        16 << 10
    }
}

/// A harness that keeps its history (`incremental_history`) is sent a long history in
/// pieces, and only what is new once it holds the rest; either way it sees the whole
/// history. A plain stateless harness at the same size is refused before anything is written.
#[tokio::test]
async fn a_harness_that_keeps_its_history_takes_any_length_and_only_what_is_new() {
    let f = Fixture::new();
    let c = controller(f.journal.clone(), Arc::new(EchoProvider));
    let big = "x".repeat(3 << 10);
    // ~12 turns of 3 KiB in and out: the history outgrows a 16 KiB frame.
    for _ in 0..12 {
        c.exec(&f.turn(echo()), inputs(&[big.as_str()]))
            .await
            .unwrap();
    }
    let events = |records: &[LogRecord]| -> Vec<Event> {
        records.iter().filter_map(|r| r.event.clone()).collect()
    };

    let plain = Arc::new(StartRecorder::default());
    let mut turn = f.turn(plain.clone());
    turn.endpoint = Arc::new(SmallFrames(InProcessEndpoint::new(plain.clone())));
    let before = f.records();
    let err = c.exec(&turn, inputs(&["hi"])).await.unwrap_err();
    assert!(
        matches!(err, ControllerError::HistoryTooLarge(_)),
        "{err:?}"
    );
    assert_eq!(f.records(), before, "nothing was journaled");

    let keeper = Arc::new(StartRecorder {
        keeps_history: true,
        ..Default::default()
    });
    let endpoint: Arc<dyn HarnessEndpoint> =
        Arc::new(SmallFrames(InProcessEndpoint::new(keeper.clone())));
    let mut turn = f.turn(keeper.clone());
    turn.endpoint = endpoint.clone();
    let outcome = c.exec(&turn, inputs(&["hi"])).await.unwrap();
    let sent_through = match outcome {
        TurnOutcome::Completed {
            history_through, ..
        } => history_through.unwrap(),
        parked => panic!("{parked:?}"),
    };
    assert_eq!(sent_through, before.last().unwrap().seq);
    let seen = keeper.starts.lock().unwrap()[0].start.clone();
    assert_eq!(
        seen.history,
        events(&before),
        "the whole history, from its pieces"
    );

    // The same process, told it holds the history it was sent: only what is new goes, and
    // its SDK puts the whole history together again.
    let before = f.records();
    let mut turn = f.turn(keeper.clone());
    turn.endpoint = endpoint.clone();
    turn.harness_holds_through = Some(sent_through);
    c.exec(&turn, inputs(&["again"])).await.unwrap();
    let seen = keeper.starts.lock().unwrap()[1].start.clone();
    assert_eq!(seen.history, events(&before));
    assert_eq!(
        seen.history_after_seq, 0,
        "the harness sees a whole history"
    );

    // A fresh process claimed to hold the history has nothing to put it together from: the
    // host sent only what was new, and the SDK says so rather than run on part of it.
    let mut turn = f.turn(keeper.clone());
    turn.endpoint = Arc::new(SmallFrames(InProcessEndpoint::new(keeper.clone())));
    turn.harness_holds_through = Some(sent_through);
    let err = c.exec(&turn, inputs(&["gap"])).await.unwrap_err();
    assert!(err.to_string().contains("HistoryGap"), "{err}");
}

#[tokio::test]
async fn scenario_40_turn_boundaries_by_execution_id() {
    let f = Fixture::new();
    let c = controller(f.journal.clone(), Arc::new(EchoProvider));
    c.exec(&f.turn(echo()), inputs(&["same"])).await.unwrap();
    c.exec(&f.turn(echo()), inputs(&["same"])).await.unwrap();
    let records = f.records();
    let first = &records[0].event.as_ref().unwrap().execution_id;
    let second = &records[5].event.as_ref().unwrap().execution_id;
    assert_ne!(first, second);
    assert!(
        records[..5]
            .iter()
            .all(|r| &r.event.as_ref().unwrap().execution_id == first)
    );
    let recorder = Arc::new(StartRecorder::default());
    c.replay(&f.turn(recorder.clone())).await.unwrap();
    let starts = recorder.starts.lock().unwrap();
    assert_eq!(starts.len(), 2);
    assert!(starts[0].start.history.is_empty());
    let history_kinds: Vec<i32> = starts[1].start.history.iter().map(|e| e.kind).collect();
    assert_eq!(
        history_kinds,
        kinds(&records[..5])
            .iter()
            .map(|k| *k as i32)
            .collect::<Vec<_>>()
    );
    assert_eq!(starts[1].execution_id, *second);
    assert_eq!(text_of(&starts[1].start.inputs[0]), "same");
    assert_eq!(f.records(), records);
}

#[tokio::test]
async fn scenario_41_failed_turn_in_later_history() {
    let f = Fixture::new();
    let c = controller(f.journal.clone(), Arc::new(EchoProvider));
    c.exec(&f.turn(Arc::new(Fails)), inputs(&["bad"]))
        .await
        .unwrap_err();
    c.exec(&f.turn(echo()), inputs(&["good"])).await.unwrap();
    let recorder = Arc::new(StartRecorder::default());
    c.replay(&f.turn(recorder.clone())).await.unwrap();
    let starts = recorder.starts.lock().unwrap();
    assert_eq!(starts.len(), 1, "only the completed turn replays");
    let history: Vec<i32> = starts[0].start.history.iter().map(|e| e.kind).collect();
    assert_eq!(
        history,
        [
            EventKind::EventExecutionStart as i32,
            EventKind::EventInput as i32,
            EventKind::EventError as i32
        ]
    );
}

#[tokio::test]
async fn scenario_42_missing_execution_id_after_modern_start() {
    let f = Fixture::new();
    let c = controller(f.journal.clone(), Arc::new(EchoProvider));
    c.exec(&f.turn(echo()), inputs(&["hi"])).await.unwrap();
    let fence = f.journal.new_fence(&f.uid).unwrap();
    f.journal
        .append(
            &f.uid,
            5,
            fence,
            &[stamp(
                "",
                EventKind::EventInput,
                Body::Message(text("user", "x")),
            )],
        )
        .unwrap();
    let err = c.replay(&f.turn(echo())).await.unwrap_err();
    assert!(
        matches!(err, ControllerError::InvalidExecutionLog(_)),
        "{err}"
    );
}

#[tokio::test]
async fn scenario_43_tool_identity_divergence_on_replay() {
    let f = Fixture::new();
    let exec = Arc::new(CountingExecutor::default());
    let c = controller_with_tools(f.journal.clone(), exec.clone());
    c.exec(
        &f.turn(Arc::new(ToolUser::new(tool_call(
            Mediation::ControllerMediated,
            "k",
        )))),
        inputs(&["go"]),
    )
    .await
    .unwrap();
    type Change = Box<dyn Fn(&mut ToolCall)>;
    let variants: Vec<(&str, Change)> = vec![
        ("id", Box::new(|c| c.id = "call-2".into())),
        ("tool", Box::new(|c| c.tool = "sub".into())),
        (
            "idempotency_key",
            Box::new(|c| c.idempotency_key = "k2".into()),
        ),
        (
            "mediation",
            Box::new(|c| c.mediation = Mediation::RequiresApproval as i32),
        ),
        ("args", Box::new(|c| c.args = Some(Struct::default()))),
        ("args", Box::new(|c| c.args = None)),
    ];
    for (field, change) in variants {
        let mut call = tool_call(Mediation::ControllerMediated, "k");
        change(&mut call);
        let h = Arc::new(ToolUser::new(call));
        let err = c.replay(&f.turn(h.clone())).await.unwrap_err();
        assert!(
            matches!(err, ControllerError::ReplayDiverged(ref m) if m.contains(field)),
            "{field}: {err}"
        );
        assert!(h.seen.lock().unwrap().is_empty(), "no result served");
    }
    assert_eq!(exec.calls.load(Ordering::SeqCst), 1);
    // The identical call replays and is served the recorded result, decorated with its id.
    let h = Arc::new(ToolUser::new(tool_call(Mediation::ControllerMediated, "k")));
    c.replay(&f.turn(h.clone())).await.unwrap();
    assert_eq!(h.seen.lock().unwrap()[0].result.id, "call-1");
    assert_eq!(exec.calls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn scenario_46_recovery_executes_only_new_calls() {
    // An executor error is returned to the harness unrecorded; the turn still completes.
    let f = Fixture::new();
    let failing = Arc::new(CountingExecutor {
        fail_with: Some("disk full".into()),
        ..Default::default()
    });
    let c = controller_with_tools(f.journal.clone(), failing.clone());
    let h = Arc::new(ToolUser::new(tool_call(Mediation::ControllerMediated, "k")));
    c.exec(&f.turn(h.clone()), inputs(&["go"])).await.unwrap();
    assert_eq!(outputs(&f.records()), ["error:disk full"]);
    assert!(!f.kinds().contains(&EventKind::EventToolResult));
    // Replay answers the result-less call with the bounded error, without the executor.
    let h2 = Arc::new(ToolUser::new(tool_call(Mediation::ControllerMediated, "k")));
    let fresh = controller_with_tools(f.reopen(), Arc::new(CountingExecutor::default()));
    let err = fresh.replay(&f.turn(h2)).await.unwrap_err();
    // The harness then says something else than it recorded: that is a divergence.
    assert!(matches!(err, ControllerError::ReplayDiverged(_)), "{err}");
    assert_eq!(fresh.counters().executor_calls(), 0);
}

// ---------- approvals ----------

fn gated() -> ToolCall {
    tool_call(Mediation::RequiresApproval, "k-approve")
}

async fn park(f: &Fixture, c: &Controller) -> ApprovalRef {
    match c
        .exec(&f.turn(Arc::new(ToolUser::new(gated()))), inputs(&["go"]))
        .await
        .unwrap()
    {
        TurnOutcome::Parked { park, head } => {
            assert_eq!(head, park.request_seq);
            park
        }
        other => panic!("{other:?}"),
    }
}

fn decide(f: &Fixture, park: &ApprovalRef, approved: bool) -> i64 {
    let fence = f.journal.new_fence(&f.uid).unwrap();
    let head = f.journal.get_session(&f.uid).unwrap().unwrap().last_seq;
    let ev = stamp(
        &park.execution_id,
        EventKind::EventApprovalResult,
        Body::ApprovalResult(ApprovalResult {
            tool_call_id: park.tool_call_id.clone(),
            approved,
            reason: "reviewed".into(),
            request_seq: park.request_seq,
        }),
    );
    f.journal.append(&f.uid, head, fence, &[ev]).unwrap()[0].seq
}

#[tokio::test]
async fn scenario_47_live_park() {
    let f = Fixture::new();
    let exec = Arc::new(CountingExecutor::default());
    let c = controller_with_tools(f.journal.clone(), exec.clone());
    let p = park(&f, &c).await;
    let records = f.records();
    assert_eq!(
        kinds(&records),
        [
            EventKind::EventExecutionStart,
            EventKind::EventInput,
            EventKind::EventToolCall,
            EventKind::EventApprovalRequest
        ]
    );
    assert!(p.request_seq > seq_of(&records, EventKind::EventToolCall));
    assert_eq!(p.tool_call_id, "call-1");
    assert_eq!(exec.calls.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn scenario_49_pending_resume_is_idempotent() {
    let f = Fixture::new();
    let c = controller_with_tools(f.journal.clone(), Arc::new(CountingExecutor::default()));
    let p = park(&f, &c).await;
    let before = f.records();
    for _ in 0..2 {
        let again = c
            .resume(&f.turn(Arc::new(ToolUser::new(gated()))))
            .await
            .unwrap();
        assert_eq!(
            again,
            Some(TurnOutcome::Parked {
                park: p.clone(),
                head: before.len() as i64
            })
        );
    }
    assert_eq!(f.records(), before);

    // A call-only cut is repaired once: one APPROVAL_REQUEST, then the same park.
    f.cut_after(seq_of(&before, EventKind::EventToolCall));
    let repaired = c
        .resume(&f.turn(Arc::new(ToolUser::new(gated()))))
        .await
        .unwrap();
    let again = c
        .resume(&f.turn(Arc::new(ToolUser::new(gated()))))
        .await
        .unwrap();
    assert_eq!(repaired, again);
    let requests = f
        .kinds()
        .iter()
        .filter(|k| **k == EventKind::EventApprovalRequest)
        .count();
    assert_eq!(requests, 1);
    verify_chain(&f.records()).unwrap();
}

#[tokio::test]
async fn scenario_50_decided_recovery_approved_and_denied() {
    for approved in [true, false] {
        let f = Fixture::new();
        let exec = Arc::new(CountingExecutor::default());
        let c = controller_with_tools(f.journal.clone(), exec.clone());
        let p = park(&f, &c).await;
        let decision_seq = decide(&f, &p, approved);
        let h = Arc::new(ToolUser::new(gated()));
        c.resume(&f.turn(h.clone())).await.unwrap().unwrap();
        assert_eq!(exec.calls.load(Ordering::SeqCst), u64::from(approved));
        let seen = h.seen.lock().unwrap()[0].clone();
        assert_eq!(seen.approval.as_ref().unwrap().approved, approved);
        assert_eq!(seen.result.approval_request_seq, p.request_seq);
        assert_eq!(seen.result.approval_decision_seq, decision_seq);
        if approved {
            assert!(!seen.result.is_error);
        } else {
            assert!(seen.result.is_error);
            assert_eq!(seen.result.code, tool_result::Code::ApprovalDenied as i32);
            assert_eq!(
                text_of(&Message {
                    role: String::new(),
                    parts: seen.result.content.clone()
                }),
                "denied"
            );
        }
        assert_eq!(*f.kinds().last().unwrap(), EventKind::EventEnd);
        // Replay serves request, decision and receipt without the executor.
        let before = f.records();
        let h2 = Arc::new(ToolUser::new(gated()));
        c.replay(&f.turn(h2.clone())).await.unwrap();
        assert_eq!(h2.seen.lock().unwrap()[0], seen);
        assert_eq!(exec.calls.load(Ordering::SeqCst), u64::from(approved));
        assert_eq!(f.records(), before);
        verify_chain(&before).unwrap();
    }
}

#[tokio::test]
async fn scenario_51_missing_executor_after_approval_is_recoverable() {
    let f = Fixture::new();
    let c = controller(f.journal.clone(), Arc::new(EchoProvider));
    let p = park(&f, &c).await;
    decide(&f, &p, true);
    let err = c
        .resume(&f.turn(Arc::new(ToolUser::new(gated()))))
        .await
        .unwrap_err();
    assert!(
        matches!(err, ControllerError::MissingToolExecutor(_)),
        "{err}"
    );
    assert_eq!(err.code(), tonic::Code::FailedPrecondition);
    let with = controller_with_tools(f.journal.clone(), Arc::new(CountingExecutor::default()));
    with.resume(&f.turn(Arc::new(ToolUser::new(gated()))))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(*f.kinds().last().unwrap(), EventKind::EventEnd);
}

#[tokio::test]
async fn scenario_52_validation_before_intent() {
    let f = Fixture::new();
    let c = controller_with_tools(f.journal.clone(), Arc::new(CountingExecutor::default()));
    let mut memory = ToolUser::new(gated());
    memory.memory = true;
    let err = c
        .exec(&f.turn(Arc::new(memory)), inputs(&["go"]))
        .await
        .unwrap_err();
    assert!(
        matches!(err, ControllerError::ApprovalUnavailable(_)),
        "{err}"
    );
    assert_eq!(err.code(), tonic::Code::FailedPrecondition);
    let mut no_id = gated();
    no_id.id.clear();
    let err = c
        .exec(&f.turn(Arc::new(ToolUser::new(no_id))), inputs(&["go"]))
        .await
        .unwrap_err();
    assert!(
        matches!(err, ControllerError::InvalidApprovalCall(_)),
        "{err}"
    );
    let mut no_key = gated();
    no_key.idempotency_key.clear();
    let err = c
        .exec(&f.turn(Arc::new(ToolUser::new(no_key))), inputs(&["go"]))
        .await
        .unwrap_err();
    assert!(
        matches!(err, ControllerError::MissingIdempotencyKey(_)),
        "{err}"
    );
    let k = f.kinds();
    assert!(
        !k.contains(&EventKind::EventToolCall) && !k.contains(&EventKind::EventApprovalRequest)
    );
}

// ---------- interruption ----------

/// Waits forever inside a model call (a provider that never answers).
struct Stuck;

#[async_trait::async_trait]
impl ModelProvider for Stuck {
    fn name(&self) -> &'static str {
        "stuck"
    }
    async fn complete(
        &self,
        _call: &ModelCall,
        _stream: Option<mpsc::Sender<Chunk>>,
    ) -> Result<Completion, ProviderError> {
        std::future::pending().await
    }
}

#[tokio::test]
async fn cancel_ends_the_execution_canceled() {
    let f = Fixture::new();
    let c = controller(f.journal.clone(), Arc::new(Stuck));
    let (tx, rx) = tokio::sync::watch::channel(None);
    let mut t = f.turn(echo());
    t.interrupt = Some(rx);
    let run = c.exec(&t, inputs(&["hi"]));
    let cancel = async {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        tx.send(Some(Interrupt::Cancel("user asked".into())))
            .unwrap();
    };
    let (r, ()) = tokio::join!(run, cancel);
    assert!(matches!(r, Err(ControllerError::Cancelled(_))));
    let records = f.records();
    assert_eq!(
        kinds(&records)[3..],
        [EventKind::EventEnd, EventKind::EventLifecycle]
    );
    // A canceled execution is finished: nothing to resume, nothing to replay.
    assert_eq!(c.resume(&f.turn(echo())).await.unwrap(), None);
    assert_eq!(c.replay(&f.turn(echo())).await.unwrap().executions, 0);
}

#[tokio::test]
async fn supersede_leaves_the_execution_resumable() {
    let f = Fixture::new();
    let c = controller(f.journal.clone(), Arc::new(Stuck));
    let (tx, rx) = tokio::sync::watch::channel(None);
    let mut t = f.turn(echo());
    t.interrupt = Some(rx);
    tx.send(Some(Interrupt::Supersede("suspend".into())))
        .unwrap();
    let err = c.exec(&t, inputs(&["hi"])).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Aborted);
    assert!(
        !f.kinds().contains(&EventKind::EventError),
        "no ERROR for a host interruption"
    );
    let live = controller(f.journal.clone(), Arc::new(EchoProvider));
    live.resume(&f.turn(echo())).await.unwrap().unwrap();
    assert_eq!(outputs(&f.records()), ["echo:hi"]);
}

#[tokio::test]
async fn deadline_fails_the_turn() {
    let f = Fixture::new();
    let c = controller(f.journal.clone(), Arc::new(Stuck));
    let mut t = f.turn(echo());
    t.deadline = Some(tokio::time::Instant::now() + std::time::Duration::from_millis(30));
    let err = c.exec(&t, inputs(&["hi"])).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::DeadlineExceeded);
    assert_eq!(*f.kinds().last().unwrap(), EventKind::EventError);
}

#[tokio::test]
async fn harness_version_and_name_must_match_on_rerun() {
    let f = Fixture::new();
    let c = controller(f.journal.clone(), Arc::new(EchoProvider));
    c.exec(&f.turn(echo()), inputs(&["hi"])).await.unwrap();
    let mut t = f.turn(echo());
    t.descriptor.version = "2".into();
    assert!(matches!(
        c.replay(&t).await.unwrap_err(),
        ControllerError::HarnessVersionMismatch { .. }
    ));
    let mut t = f.turn(echo());
    t.harness = "chat".into();
    assert!(matches!(
        c.replay(&t).await.unwrap_err(),
        ControllerError::HarnessMismatch { .. }
    ));
}

use crate::journal::JournalError;
use agentvm_proto::v1::{ApprovalRef, tool_result};

// ---------- over the wire ----------

/// Serves `harness` with tonic on a unix socket and returns a gRPC endpoint to it, so the
/// turn crosses a real `Harness.Connect` stream.
async fn grpc_endpoint(dir: &Path, harness: Arc<dyn Harness>) -> Arc<dyn HarnessEndpoint> {
    let socket = dir.join(format!("h-{}.sock", new_execution_id()));
    let listener = tokio::net::UnixListener::bind(&socket).unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(agentvm_harnesses::server::GrpcHarness::new(harness).into_service())
            .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener)),
    );
    let channel = crate::client::connect_address(&format!("unix://{}", socket.display()))
        .await
        .unwrap();
    Arc::new(super::endpoint::GrpcEndpoint::new(channel))
}

impl Fixture {
    async fn wire_turn(&self, harness: Arc<dyn Harness>) -> Turn {
        let mut t = self.turn(harness.clone());
        t.endpoint = grpc_endpoint(self.path.parent().unwrap(), harness).await;
        t
    }
}

#[tokio::test]
async fn scenario_14_nondeterministic_replay_over_the_wire() {
    let f = Fixture::new();
    let provider = Arc::new(Nondeterministic::default());
    let c = controller(f.journal.clone(), provider.clone());
    c.exec(&f.wire_turn(echo()).await, inputs(&["hi"]))
        .await
        .unwrap();
    let before = f.records();
    c.replay(&f.wire_turn(echo()).await).await.unwrap();
    assert_eq!(provider.calls.load(Ordering::SeqCst), 1);
    assert_eq!(f.records(), before);
    assert_eq!(outputs(&before), ["answer-1"]);
}

#[tokio::test]
async fn scenario_15_mediated_tool_over_the_wire() {
    let f = Fixture::new();
    let exec = Arc::new(CountingExecutor::default());
    let c = controller_with_tools(f.journal.clone(), exec.clone());
    let h = || Arc::new(ToolUser::new(tool_call(Mediation::ControllerMediated, "k")));
    c.exec(&f.wire_turn(h()).await, inputs(&["go"]))
        .await
        .unwrap();
    c.replay(&f.wire_turn(h()).await).await.unwrap();
    assert_eq!(
        exec.calls.load(Ordering::SeqCst),
        1,
        "replay does not re-execute"
    );
    let k = f.kinds();
    assert_eq!(
        k.iter().filter(|x| **x == EventKind::EventToolCall).count(),
        1
    );
    assert_eq!(
        k.iter()
            .filter(|x| **x == EventKind::EventToolResult)
            .count(),
        1
    );
}

type BoxFuture = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;
type RawScript = dyn Fn(
        mpsc::Receiver<agentvm_proto::v1::ControllerFrame>,
        mpsc::Sender<Result<agentvm_proto::v1::Event, tonic::Status>>,
    ) -> BoxFuture
    + Send
    + Sync;

/// A harness speaking raw frames: `script` gets the host's frames and sends the events.
struct RawEndpoint {
    script: Arc<RawScript>,
}

#[async_trait::async_trait]
impl HarnessEndpoint for RawEndpoint {
    async fn describe(&self) -> Result<HarnessDescriptor, tonic::Status> {
        Ok(agentvm_harnesses::echo::Echo.descriptor())
    }
    async fn connect(&self) -> Result<super::endpoint::HarnessStream, tonic::Status> {
        let (ftx, frx) = mpsc::channel(16);
        let (etx, erx) = mpsc::channel(16);
        tokio::spawn((self.script)(frx, etx));
        Ok(super::endpoint::HarnessStream {
            frames: ftx,
            events: Box::pin(tokio_stream::wrappers::ReceiverStream::new(erx)),
        })
    }
}

fn raw_event(execution_id: &str, kind: EventKind, body: Body) -> agentvm_proto::v1::Event {
    agentvm_proto::v1::Event {
        execution_id: execution_id.into(),
        kind: kind as i32,
        body: Some(body),
        ..Default::default()
    }
}

fn raw_turn(f: &Fixture, endpoint: RawEndpoint) -> Turn {
    let mut t = f.turn(echo());
    t.endpoint = Arc::new(endpoint);
    t
}

#[tokio::test]
async fn scenario_17_raw_peer_nan_args_rejected_before_effects() {
    let f = Fixture::new();
    let exec = Arc::new(CountingExecutor::default());
    let c = controller_with_tools(f.journal.clone(), exec.clone());
    let endpoint = RawEndpoint {
        script: Arc::new(|mut frames, events| {
            Box::pin(async move {
                let start = frames.recv().await.unwrap();
                let mut call = tool_call(Mediation::ControllerMediated, "k");
                call.args = args(&[("x", f64::NAN)]);
                let _ = events
                    .send(Ok(raw_event(
                        &start.execution_id,
                        EventKind::EventToolCall,
                        Body::Tool(call),
                    )))
                    .await;
                while frames.recv().await.is_some() {}
            })
        }),
    };
    let err = c
        .exec(&raw_turn(&f, endpoint), inputs(&["go"]))
        .await
        .unwrap_err();
    assert!(matches!(err, ControllerError::InvalidToolArgs(..)), "{err}");
    assert_eq!(exec.calls.load(Ordering::SeqCst), 0);
    assert!(!f.kinds().contains(&EventKind::EventToolCall));
}

/// Sends a gated call, then answers the park with `ack` (or keeps talking).
fn parking_peer(ack: fn(&ApprovalRef) -> agentvm_proto::v1::Event) -> RawEndpoint {
    RawEndpoint {
        script: Arc::new(move |mut frames, events| {
            Box::pin(async move {
                let start = frames.recv().await.unwrap();
                let eid = start.execution_id.clone();
                let _ = events
                    .send(Ok(raw_event(
                        &eid,
                        EventKind::EventToolCall,
                        Body::Tool(gated()),
                    )))
                    .await;
                if let Some(agentvm_proto::v1::ControllerFrame {
                    frame: Some(agentvm_proto::v1::controller_frame::Frame::Park(p)),
                    ..
                }) = frames.recv().await
                {
                    let _ = events.send(Ok(ack(&p))).await;
                }
                // Hold the stream open: the host must not wait for us forever.
                while frames.recv().await.is_some() {}
            })
        }),
    }
}

#[tokio::test]
async fn scenario_21_wrong_park_ack_is_rejected() {
    let f = Fixture::new();
    let c = controller_with_tools(f.journal.clone(), Arc::new(CountingExecutor::default()));
    let wrong = parking_peer(|p| {
        let mut foreign = p.clone();
        foreign.tool_call_id = "someone-else".into();
        raw_event(
            &p.execution_id,
            EventKind::EventParked,
            Body::Parked(foreign),
        )
    });
    let err = c
        .exec(&raw_turn(&f, wrong), inputs(&["go"]))
        .await
        .unwrap_err();
    assert!(
        matches!(err, ControllerError::HarnessProtocol(ref m) if m.contains("someone-else")),
        "{err}"
    );
    let k = f.kinds();
    assert_eq!(
        *k.last().unwrap(),
        EventKind::EventApprovalRequest,
        "the durable request stays"
    );
    assert!(!k.contains(&EventKind::EventError) && !k.contains(&EventKind::EventEnd));
}

#[tokio::test]
async fn scenario_48_continuation_after_a_park_is_refused() {
    let f = Fixture::new();
    let c = controller_with_tools(f.journal.clone(), Arc::new(CountingExecutor::default()));
    let chatty = parking_peer(|p| {
        raw_event(
            &p.execution_id,
            EventKind::EventOutput,
            Body::Message(text("assistant", "carrying on regardless")),
        )
    });
    let err = c
        .exec(&raw_turn(&f, chatty), inputs(&["go"]))
        .await
        .unwrap_err();
    assert!(matches!(err, ControllerError::HarnessProtocol(_)), "{err}");
    assert_eq!(*f.kinds().last().unwrap(), EventKind::EventApprovalRequest);
    assert!(!f.kinds().contains(&EventKind::EventOutput));
}

#[tokio::test]
async fn unsolicited_host_kinds_are_protocol_violations() {
    for kind in [
        EventKind::EventApprovalRequest,
        EventKind::EventExecutionStart,
        EventKind::EventLifecycle,
        EventKind::EventParked,
    ] {
        let f = Fixture::new();
        let c = controller(f.journal.clone(), Arc::new(EchoProvider));
        let endpoint = RawEndpoint {
            script: Arc::new(move |mut frames, events| {
                Box::pin(async move {
                    let start = frames.recv().await.unwrap();
                    let mut e = raw_event(
                        &start.execution_id,
                        kind,
                        Body::Message(text("assistant", "x")),
                    );
                    e.kind = kind as i32;
                    let _ = events.send(Ok(e)).await;
                    while frames.recv().await.is_some() {}
                })
            }),
        };
        let err = c
            .exec(&raw_turn(&f, endpoint), inputs(&["x"]))
            .await
            .unwrap_err();
        assert!(
            matches!(err, ControllerError::HarnessProtocol(_)),
            "{kind:?}: {err}"
        );
    }
}

// ---------- forks and legacy logs ----------

#[tokio::test]
async fn scenario_04_and_28_fork_equivalence_and_shape() {
    let f = Fixture::new();
    let c = controller(f.journal.clone(), Arc::new(EchoProvider));
    c.exec(&f.turn(echo()), inputs(&["hi"])).await.unwrap();
    let parent = f.records();
    let child = "sess-000000000000000000000002";
    fork_child(&f, child, 5);
    let records = f.journal.read(child, 1, 0).unwrap();
    assert_eq!(records.len(), 6);
    assert_eq!(
        records[..5],
        parent[..],
        "the copied prefix is byte-identical"
    );
    assert_eq!(records[5].prev_hash, parent[4].content_hash);
    verify_chain(&records).unwrap();
    verify_chain(&parent).unwrap();
    // The child replays its inherited turn and continues on its own.
    let mut t = turn_with(child, f.journal.new_fence(child).unwrap(), echo());
    t.fork_seq = 5;
    assert_eq!(c.replay(&t).await.unwrap().executions, 1);
    c.exec(&t, inputs(&["child"])).await.unwrap();
    assert_eq!(
        outputs(&f.journal.read(child, 1, 0).unwrap()),
        ["echo:hi", "echo:child"]
    );
    assert_eq!(f.records(), parent, "the parent is untouched");
}

#[tokio::test]
async fn scenario_57_forked_tool_intent_is_not_redriven() {
    let f = Fixture::new();
    let exec = Arc::new(CountingExecutor::default());
    let c = controller_with_tools(f.journal.clone(), exec.clone());
    let h = || Arc::new(ToolUser::new(tool_call(Mediation::ControllerMediated, "k")));
    c.exec(&f.turn(h()), inputs(&["go"])).await.unwrap();
    let call_seq = seq_of(&f.records(), EventKind::EventToolCall);
    let result_seq = seq_of(&f.records(), EventKind::EventToolResult);
    let fork_at = |seq: i64, name: &str| {
        let child = format!("sess-00000000000000000000{name}");
        f.journal
            .create_session(&SessionRow {
                uid: child.clone(),
                project: "default".into(),
                fork_seq: seq,
                ..Default::default()
            })
            .unwrap();
        let fence = f.journal.new_fence(&child).unwrap();
        f.journal.copy_prefix(&f.uid, &child, seq, fence).unwrap();
        child
    };
    // Forked at the unresolved call: the child may not re-drive the parent's effect.
    let at_call = fork_at(call_seq, "0003");
    let mut t = turn_with(&at_call, f.journal.new_fence(&at_call).unwrap(), h());
    t.fork_seq = call_seq;
    let err = c.resume(&t).await.unwrap_err();
    assert!(
        matches!(err, ControllerError::InheritedToolIntent(_)),
        "{err}"
    );
    assert_eq!(err.code(), tonic::Code::FailedPrecondition);
    assert_eq!(
        f.journal.read(&at_call, 1, 0).unwrap().len() as i64,
        call_seq
    );
    // Forked at the result: the parent's receipt is served, nothing re-executes.
    let at_result = fork_at(result_seq, "0004");
    let mut t = turn_with(&at_result, f.journal.new_fence(&at_result).unwrap(), h());
    t.fork_seq = result_seq;
    c.resume(&t).await.unwrap().unwrap();
    assert_eq!(exec.calls.load(Ordering::SeqCst), 1);
}

fn legacy(kind: EventKind, body: Body) -> agentvm_proto::v1::Event {
    agentvm_proto::v1::Event {
        kind: kind as i32,
        body: Some(body),
        ..Default::default()
    }
}

#[tokio::test]
async fn scenario_71_legacy_logs() {
    let f = Fixture::new();
    let c = controller(f.journal.clone(), Arc::new(EchoProvider));
    let fence = f.journal.new_fence(&f.uid).unwrap();
    // A v0.1.2 turn that ended in ERROR: finished, so nothing to re-drive.
    f.journal
        .append(
            &f.uid,
            0,
            fence,
            &[
                legacy(EventKind::EventInput, Body::Message(text("user", "hello"))),
                legacy(
                    EventKind::EventError,
                    Body::Error(agentvm_proto::v1::Error {
                        code: 13,
                        description: "boom".into(),
                    }),
                ),
            ],
        )
        .unwrap();
    assert_eq!(c.resume(&f.turn(echo())).await.unwrap(), None);
    c.exec(&f.turn(echo()), inputs(&["new"])).await.unwrap();
    assert_eq!(outputs(&f.records()), ["echo:new"]);
    verify_chain(&f.records()).unwrap();

    // An unfinished legacy turn followed by a modern execution is ambiguous: refused.
    let g = Fixture::new();
    let fence = g.journal.new_fence(&g.uid).unwrap();
    g.journal
        .append(
            &g.uid,
            0,
            fence,
            &[legacy(
                EventKind::EventInput,
                Body::Message(text("user", "half")),
            )],
        )
        .unwrap();
    let c = controller(g.journal.clone(), Arc::new(EchoProvider));
    let err = c.exec(&g.turn(echo()), inputs(&["x"])).await.unwrap_err();
    assert!(
        matches!(err, ControllerError::InvalidExecutionLog(_)),
        "{err}"
    );
    assert_eq!(err.code(), tonic::Code::FailedPrecondition);
    assert_eq!(g.records().len(), 1, "journal unchanged");
    let err = c.resume(&g.turn(echo())).await.unwrap_err();
    assert!(
        matches!(err, ControllerError::InvalidExecutionLog(_)),
        "{err}"
    );
}

// ---------- scenarios adapted to a Connect-only host ----------

/// Fails the calls whose 1-based numbers are listed, answers the others like echo.
struct ScriptedProvider {
    fail_on: Vec<u64>,
    calls: AtomicU64,
}

impl ScriptedProvider {
    fn failing(fail_on: &[u64]) -> Arc<Self> {
        Arc::new(ScriptedProvider {
            fail_on: fail_on.to_vec(),
            calls: AtomicU64::new(0),
        })
    }
    fn calls(&self) -> u64 {
        self.calls.load(Ordering::SeqCst)
    }
}

#[async_trait::async_trait]
impl ModelProvider for ScriptedProvider {
    fn name(&self) -> &'static str {
        "scripted"
    }
    async fn complete(
        &self,
        call: &ModelCall,
        stream: Option<mpsc::Sender<Chunk>>,
    ) -> Result<Completion, ProviderError> {
        let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        if self.fail_on.contains(&n) {
            return Err(ProviderError::Unavailable {
                provider: "scripted",
                reason: format!("call {n} fails"),
            });
        }
        EchoProvider.complete(call, stream).await
    }
}

/// Each MODEL_CALL's completions: how many OUTPUTs follow it before the next call or END.
fn completions_per_call(records: &[LogRecord]) -> Vec<usize> {
    let mut per_call = Vec::new();
    for k in kinds(records) {
        match k {
            EventKind::EventModelCall => per_call.push(0),
            EventKind::EventOutput => *per_call.last_mut().unwrap() += 1,
            _ => {}
        }
    }
    per_call
}

#[tokio::test]
async fn scenario_33_retry_after_failed_redrive() {
    // Upstream's in-process harness retries inside Run when its model call fails. Over
    // Harness.Connect a model call has no error reply: a failed call ends the stream with
    // ERROR, so the retry is the next Resume. What must hold is the same: the re-driven call
    // gets exactly one completion, no call has two, and replay calls nobody.
    let f = Fixture::new();
    // Call 1 answers, call 2 (the turn's second) fails, so does its first re-drive (call 3).
    let provider = ScriptedProvider::failing(&[2, 3]);
    let c = controller(f.journal.clone(), provider.clone());
    let two = || Arc::new(TwoCalls { short: false });
    c.exec(&f.turn(two()), inputs(&["x"])).await.unwrap_err();
    let err = c.resume(&f.turn(two())).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Internal, "{err}");
    c.resume(&f.turn(two())).await.unwrap().unwrap();
    assert_eq!(provider.calls(), 4);
    let records = f.records();
    assert_eq!(
        completions_per_call(&records),
        [1, 1],
        "two calls, one completion each: {:?}",
        kinds(&records)
    );
    assert_eq!(
        kinds(&records)
            .iter()
            .filter(|k| **k == EventKind::EventError)
            .count(),
        2,
        "each failure stays as audit"
    );
    assert_eq!(*kinds(&records).last().unwrap(), EventKind::EventEnd);
    controller(f.reopen(), provider.clone())
        .replay(&f.turn(two()))
        .await
        .unwrap();
    assert_eq!(provider.calls(), 4, "replay makes no call");
    verify_chain(&records).unwrap();
}

/// A model call, then a USAGE report of its own.
struct ModelThenUsage;

#[async_trait::async_trait]
impl Harness for ModelThenUsage {
    fn descriptor(&self) -> HarnessDescriptor {
        agentvm_harnesses::echo::Echo.descriptor()
    }
    async fn run(&self, _exec: &Execution, sink: &mut Sink) -> Result<(), HarnessFailure> {
        sink.model(ModelCall {
            model: "echo".into(),
            messages: vec![text("user", "count me")],
            ..Default::default()
        })
        .await?;
        sink.usage(agentvm_proto::v1::Usage::default()).await?;
        Ok(())
    }
}

#[tokio::test]
async fn scenario_35_non_trailing_model_call_is_never_invoked() {
    // START, INPUT, MODEL_CALL, USAGE: the call has no completion but is not the crash point
    // (something came after it), so its effect may have happened; re-invoking it is refused.
    let f = Fixture::new();
    let provider = Arc::new(Nondeterministic::default());
    let c = controller(f.journal.clone(), provider.clone());
    c.exec(&f.turn(Arc::new(ModelThenUsage)), inputs(&["go"]))
        .await
        .unwrap();
    let live = f.records();
    let execution_id = live[0].event.as_ref().unwrap().execution_id.clone();
    f.cut_after(seq_of(&live, EventKind::EventModelCall));
    let fence = f.journal.new_fence(&f.uid).unwrap();
    f.journal
        .append(
            &f.uid,
            3,
            fence,
            &[stamp(
                &execution_id,
                EventKind::EventUsage,
                Body::Usage(agentvm_proto::v1::Usage::default()),
            )],
        )
        .unwrap();
    let err = c
        .resume(&f.turn(Arc::new(ModelThenUsage)))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("has no completion"), "{err}");
    assert_eq!(
        provider.calls.load(Ordering::SeqCst),
        1,
        "only the live turn called the model"
    );
    // Connect has no error reply for a model call, so the harness cannot carry on to END as
    // upstream's in-process one does: the turn fails, audited, and nothing else is invented.
    assert_eq!(
        kinds(&f.records())[3..],
        [EventKind::EventUsage, EventKind::EventError]
    );
    verify_chain(&f.records()).unwrap();
}

fn number_args(json: &str) -> Option<Struct> {
    let v: serde_json::Value = serde_json::from_str(json).unwrap();
    Some(Struct {
        fields: v
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| {
                let n = v.as_f64().expect("a number");
                (
                    k.clone(),
                    Value {
                        kind: Some(Kind::NumberValue(n)),
                    },
                )
            })
            .collect(),
    })
}

#[tokio::test]
async fn scenario_44_normalized_numeric_forms_match() {
    let f = Fixture::new();
    let exec = Arc::new(CountingExecutor::default());
    let c = controller_with_tools(f.journal.clone(), exec.clone());
    let with_x = |json: &str| {
        let mut call = tool_call(Mediation::ControllerMediated, "k");
        call.args = number_args(json);
        Arc::new(ToolUser::new(call))
    };
    c.exec(&f.turn(with_x(r#"{"x":2}"#)), inputs(&["go"]))
        .await
        .unwrap();
    let records = f.records();
    let recorded = records
        .iter()
        .find_map(|r| match &r.event.as_ref().unwrap().body {
            Some(Body::Result(res)) => Some(res.clone()),
            _ => None,
        })
        .unwrap();
    assert_eq!(
        recorded.id, "call-1",
        "the executor's own result id is not what the log keeps"
    );
    let int64 = format!(r#"{{"x":{}}}"#, 2_i64);
    for form in [
        r#"{"x":2.0}"#,
        r#"{"x":2e0}"#,
        r#"{"x":0.2e1}"#,
        r#"{"x":20E-1}"#,
        int64.as_str(),
    ] {
        let h = with_x(form);
        c.replay(&f.turn(h.clone())).await.unwrap();
        let seen = h.seen.lock().unwrap()[0].result.clone();
        assert_eq!(seen.id, "call-1", "{form}");
        assert_eq!(seen.output, recorded.output, "{form}");
    }
    // Resume after the result committed serves it to a call written 2.0.
    f.cut_after(seq_of(&records, EventKind::EventToolResult));
    c.resume(&f.turn(with_x(r#"{"x":2.0}"#)))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(exec.calls.load(Ordering::SeqCst), 1, "no live effect");
    assert_eq!(exec.effects.load(Ordering::SeqCst), 1);
    assert_eq!(*f.kinds().last().unwrap(), EventKind::EventEnd);
}

#[tokio::test]
async fn scenario_45_malformed_tool_evidence_diverges() {
    let call = tool_call(Mediation::ControllerMediated, "k");
    let result = |id: &str| ToolResult {
        id: id.into(),
        output: args(&[("sum", 4.0)]),
        ..Default::default()
    };
    type Evidence = Vec<(EventKind, Option<Body>)>;
    let cases: Vec<(&str, Evidence)> = vec![
        (
            "result without call",
            vec![(
                EventKind::EventToolResult,
                Some(Body::Result(result("call-1"))),
            )],
        ),
        (
            "call without payload",
            vec![
                (EventKind::EventToolCall, None),
                (
                    EventKind::EventToolResult,
                    Some(Body::Result(result("call-1"))),
                ),
            ],
        ),
        (
            "result without payload",
            vec![
                (EventKind::EventToolCall, Some(Body::Tool(call.clone()))),
                (EventKind::EventToolResult, None),
            ],
        ),
        (
            "wrong result id",
            vec![
                (EventKind::EventToolCall, Some(Body::Tool(call.clone()))),
                (
                    EventKind::EventToolResult,
                    Some(Body::Result(result("call-9"))),
                ),
            ],
        ),
    ];
    for (case, evidence) in cases {
        let f = Fixture::new();
        let exec = Arc::new(CountingExecutor::default());
        let c = controller_with_tools(f.journal.clone(), exec.clone());
        c.exec(&f.turn(echo()), inputs(&["go"])).await.unwrap();
        let execution_id = f.records()[0].event.as_ref().unwrap().execution_id.clone();
        f.cut_after(2);
        let mut events: Vec<agentvm_proto::v1::Event> = evidence
            .into_iter()
            .map(|(kind, body)| {
                let mut e = stamp(&execution_id, kind, Body::Message(text("assistant", "")));
                e.body = body;
                e
            })
            .collect();
        events.push(stamp(
            &execution_id,
            EventKind::EventOutput,
            Body::Message(text("assistant", "ok")),
        ));
        events.push(stamp(
            &execution_id,
            EventKind::EventEnd,
            Body::End(agentvm_proto::v1::HarnessEnd {
                state: "COMPLETED".into(),
                error: None,
            }),
        ));
        let fence = f.journal.new_fence(&f.uid).unwrap();
        f.journal.append(&f.uid, 2, fence, &events).unwrap();
        let h = Arc::new(ToolUser::new(call.clone()));
        let err = c.replay(&f.turn(h.clone())).await.unwrap_err();
        assert!(
            matches!(err, ControllerError::ReplayDiverged(_)),
            "{case}: {err}"
        );
        assert!(h.seen.lock().unwrap().is_empty(), "{case}: nothing served");
        // The same evidence in an interrupted execution is no better.
        let head = f.records().len() as i64;
        f.cut_after(head - 1);
        let before = f.records();
        let err = c
            .resume(&f.turn(Arc::new(ToolUser::new(call.clone()))))
            .await
            .unwrap_err();
        assert!(
            matches!(err, ControllerError::ReplayDiverged(_)),
            "{case} on resume: {err}"
        );
        assert_eq!(exec.calls.load(Ordering::SeqCst), 0, "{case}");
        assert!(
            f.records()[..before.len()] == before[..],
            "{case}: the evidence stays"
        );
    }
}

/// Records each Start, then makes two model calls (a turn can be cut between them).
#[derive(Default)]
struct RecordingTwoCalls {
    starts: Mutex<Vec<(String, agentvm_proto::v1::Start)>>,
}

impl RecordingTwoCalls {
    fn starts(&self) -> Vec<(String, agentvm_proto::v1::Start)> {
        self.starts.lock().unwrap().clone()
    }
}

#[async_trait::async_trait]
impl Harness for RecordingTwoCalls {
    fn descriptor(&self) -> HarnessDescriptor {
        agentvm_harnesses::echo::Echo.descriptor()
    }
    async fn run(&self, exec: &Execution, sink: &mut Sink) -> Result<(), HarnessFailure> {
        self.starts
            .lock()
            .unwrap()
            .push((exec.execution_id.clone(), exec.start.clone()));
        TwoCalls { short: false }.run(exec, sink).await
    }
}

/// A child of the fixture's session forked at `at`: prefix copied, FORK appended.
fn fork_child(f: &Fixture, child: &str, at: i64) {
    f.journal
        .create_session(&SessionRow {
            uid: child.into(),
            project: "default".into(),
            parent_uid: f.uid.clone(),
            fork_seq: at,
            ..Default::default()
        })
        .unwrap();
    let fence = f.journal.new_fence(child).unwrap();
    f.journal.copy_prefix(&f.uid, child, at, fence).unwrap();
    let fork = stamp(
        "",
        EventKind::EventLifecycle,
        Body::Lifecycle(agentvm_proto::v1::Lifecycle {
            kind: agentvm_proto::v1::lifecycle::Kind::LifecycleFork as i32,
            detail: format!("parent@{at}"),
            ..Default::default()
        }),
    );
    f.journal.append(child, at, fence, &[fork]).unwrap();
}

#[tokio::test]
async fn scenario_22_execution_start_fidelity() {
    let f = Fixture::new();
    let provider = Arc::new(Nondeterministic::default());
    let c = controller(f.journal.clone(), provider.clone());
    let live = Arc::new(RecordingTwoCalls::default());
    let configs: [&[u8]; 2] = [b"\x00\xff\x01binary one", b"\xfe\x00\x80two\x00"];
    for (i, config) in configs.iter().enumerate() {
        c.exec(
            &f.turn(live.clone()),
            NewExecution {
                inputs: vec![text("user", &format!("turn {i}"))],
                config: config.to_vec(),
                resume_from_seq: 40 + i as i64,
                expected_last_seq: None,
            },
        )
        .await
        .unwrap();
    }
    let live_starts = live.starts();
    for (i, (_, start)) in live_starts.iter().enumerate() {
        assert_eq!(start.config, configs[i]);
        assert_eq!(start.resume_from_seq, 40 + i as i64);
    }
    // START INPUT MC OUTPUT MC OUTPUT END per turn; the second loses its END (seq 14).
    let full = f.records();
    assert_eq!(full.len(), 14);
    f.cut_after(13);
    let fresh = controller(f.reopen(), provider.clone());
    let resumed = Arc::new(RecordingTwoCalls::default());
    fresh
        .resume(&f.turn(resumed.clone()))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        resumed.starts(),
        live_starts[1..],
        "the recorded Start, not the caller's"
    );
    assert_eq!(
        provider.calls.load(Ordering::SeqCst),
        4,
        "both completions served"
    );
    let records = f.records();
    assert_eq!(records.len(), 14);
    assert_eq!(records[..13], full[..13]);

    let replayer = Arc::new(RecordingTwoCalls::default());
    fresh.replay(&f.turn(replayer.clone())).await.unwrap();
    assert_eq!(replayer.starts(), live_starts);
    assert_eq!(outputs(&records).len(), 4);
    assert_eq!(f.records(), records, "replay writes nothing");
    verify_chain(&records).unwrap();

    // Children forked after turn one and at the head replay the Starts they inherited.
    for (child, at, inherited) in [
        ("sess-000000000000000000000007", 7, 1),
        ("sess-000000000000000000000014", 14, 2),
    ] {
        fork_child(&f, child, at);
        let r = Arc::new(RecordingTwoCalls::default());
        let mut t = turn_with(child, f.journal.new_fence(child).unwrap(), r.clone());
        t.fork_seq = at;
        fresh.replay(&t).await.unwrap();
        assert_eq!(r.starts(), live_starts[..inherited], "child at {at}");
        verify_chain(&f.journal.read(child, 1, 0).unwrap()).unwrap();
    }
    assert_eq!(provider.calls.load(Ordering::SeqCst), 4);
}

type SeenFrames = Arc<Mutex<Vec<agentvm_proto::v1::controller_frame::Frame>>>;

/// A raw peer that asks for approval of `gated()`: acknowledges a park with PARKED and
/// closes without END; after a decision takes the approval and its receipt, says "done".
fn approval_peer(seen: SeenFrames) -> RawEndpoint {
    use agentvm_proto::v1::controller_frame::Frame;
    RawEndpoint {
        script: Arc::new(move |mut frames, events| {
            let seen = seen.clone();
            Box::pin(async move {
                let start = frames.recv().await.unwrap();
                let eid = start.execution_id.clone();
                let _ = events
                    .send(Ok(raw_event(
                        &eid,
                        EventKind::EventToolCall,
                        Body::Tool(gated()),
                    )))
                    .await;
                match frames.recv().await.and_then(|f| f.frame) {
                    Some(Frame::Park(p)) => {
                        seen.lock().unwrap().push(Frame::Park(p.clone()));
                        let _ = events
                            .send(Ok(raw_event(&eid, EventKind::EventParked, Body::Parked(p))))
                            .await;
                    }
                    Some(Frame::Approval(a)) => {
                        seen.lock().unwrap().push(Frame::Approval(a));
                        if let Some(receipt) = frames.recv().await.and_then(|f| f.frame) {
                            seen.lock().unwrap().push(receipt);
                        }
                        for (kind, body) in [
                            (
                                EventKind::EventOutput,
                                Body::Message(text("assistant", "done")),
                            ),
                            (
                                EventKind::EventEnd,
                                Body::End(agentvm_proto::v1::HarnessEnd {
                                    state: "COMPLETED".into(),
                                    error: None,
                                }),
                            ),
                        ] {
                            let _ = events.send(Ok(raw_event(&eid, kind, body))).await;
                        }
                    }
                    other => panic!("unexpected host frame {other:?}"),
                }
            })
        }),
    }
}

#[tokio::test]
async fn scenario_20_park_decision_receipt_replay_over_the_wire() {
    use agentvm_proto::v1::controller_frame::Frame;
    for (approved, executor_fails) in [(true, false), (false, false), (true, true)] {
        let case = format!("approved={approved} executor_fails={executor_fails}");
        let f = Fixture::new();
        let exec = Arc::new(CountingExecutor {
            fail_with: executor_fails.then(|| "quota exceeded".to_owned()),
            ..Default::default()
        });
        let c = controller_with_tools(f.journal.clone(), exec.clone());
        let seen = SeenFrames::default();
        let outcome = c
            .exec(&raw_turn(&f, approval_peer(seen.clone())), inputs(&["go"]))
            .await
            .unwrap();
        let records = f.records();
        let request_seq = seq_of(&records, EventKind::EventApprovalRequest);
        let Frame::Park(park) = seen.lock().unwrap()[0].clone() else {
            panic!("{case}: no park frame")
        };
        assert_eq!(park.request_seq, request_seq, "{case}");
        assert_eq!(park.tool_call_id, "call-1");
        assert!(matches!(outcome, TurnOutcome::Parked { park: ref p, .. } if *p == park));
        let k = kinds(&records);
        for absent in [
            EventKind::EventParked,
            EventKind::EventEnd,
            EventKind::EventError,
            EventKind::EventToolResult,
        ] {
            assert!(!k.contains(&absent), "{case}: {absent:?} journaled");
        }
        assert_eq!(exec.calls.load(Ordering::SeqCst), 0);

        let decision_seq = decide(&f, &park, approved);
        let seen = SeenFrames::default();
        controller_with_tools(f.reopen(), exec.clone())
            .resume(&raw_turn(&f, approval_peer(seen.clone())))
            .await
            .unwrap()
            .unwrap();
        let pair = seen.lock().unwrap().clone();
        let [Frame::Approval(a), Frame::Tool(receipt)] = &pair[..] else {
            panic!("{case}: {pair:?}")
        };
        assert_eq!((a.approved, a.request_seq), (approved, request_seq));
        assert_eq!(receipt.id, "call-1");
        assert_eq!(receipt.approval_request_seq, request_seq, "{case}");
        assert_eq!(receipt.approval_decision_seq, decision_seq, "{case}");
        assert_eq!(receipt.is_error, !approved || executor_fails, "{case}");
        assert_eq!(
            exec.effects.load(Ordering::SeqCst),
            u64::from(approved && !executor_fails),
            "{case}"
        );
        assert_eq!(exec.calls.load(Ordering::SeqCst), u64::from(approved));
        let finished = f.records();
        assert_eq!(*kinds(&finished).last().unwrap(), EventKind::EventEnd);

        // Replay re-sends the same pair and writes nothing.
        let again = SeenFrames::default();
        c.replay(&raw_turn(&f, approval_peer(again.clone())))
            .await
            .unwrap();
        assert_eq!(*again.lock().unwrap(), pair, "{case}");
        assert_eq!(f.records(), finished);
        assert_eq!(exec.calls.load(Ordering::SeqCst), u64::from(approved));
        verify_chain(&finished).unwrap();
    }
}

/// A harness that takes Start and then never says anything fails the turn once the idle
/// deadline passes (DEADLINE_EXCEEDED, an ERROR recorded), instead of holding the session.
#[tokio::test]
async fn a_harness_that_never_answers_fails_the_turn_at_the_idle_deadline() {
    let f = Fixture::new();
    let c = controller(f.journal.clone(), Arc::new(EchoProvider))
        .with_harness_idle_timeout(std::time::Duration::from_millis(200));
    let endpoint = RawEndpoint {
        script: Arc::new(|mut frames, events| {
            Box::pin(async move {
                let _start = frames.recv().await.unwrap();
                // Keep both directions open and say nothing.
                while frames.recv().await.is_some() {}
                drop(events);
            })
        }),
    };
    let err = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        c.exec(&raw_turn(&f, endpoint), inputs(&["go"])),
    )
    .await
    .expect("the turn waited past the idle deadline")
    .unwrap_err();
    assert!(matches!(err, ControllerError::HarnessSilent(_)), "{err}");
    assert_eq!(err.code(), tonic::Code::DeadlineExceeded);
    assert!(
        f.kinds().contains(&EventKind::EventError),
        "{:?}",
        f.kinds()
    );
}
