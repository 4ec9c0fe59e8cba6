//! The Sessions API over gRPC, end to end: an agentvmd node assembled in-process on a unix
//! socket, harnesses as real processes (`agentvm harness serve`, the process runtime) or as
//! test harnesses registered at an address (the remote runtime). Tests are named after the
//! semantics.md §6 scenarios they prove.

use std::sync::Arc;
use std::time::Duration;

use agentvm_harnesses::sdk::{Execution, Harness, HarnessFailure, Sink};
use agentvm_harnesses::server::GrpcHarness;
use agentvm_proto::v1::sessions_client::SessionsClient;
use agentvm_proto::v1::{
    ApprovalRef, ApproveRequest, CancelRequest, Capabilities, ComputeState, CreateSessionRequest,
    DeleteSessionRequest, EventKind, ExecRequest, ExecState, ExecUpdate, ForkRequest,
    GetSessionRequest, HarnessDescriptor, HarnessSpec, IdentityRef, ListSessionsRequest, LogRecord,
    Mediation, Message, ModelCall, Origin, Part, RemotePlacement, ReplayRequest, ResourceMetadata,
    Resumability, ResumeRequest, Session, SuspendRequest, TextPart, ToolCall, event::Body,
    exec_update::Update, harness_spec::Placement, part,
};
use agentvmd::journal::Journal;
use agentvmd::journal::verify::verify_chain;
use tokio::sync::Semaphore;
use tonic::transport::Channel;
use tonic::{Code, Status};

// ---------- fixture ----------

mod support;
use support::{TestNode, start};

impl TestNode {
    /// Serves `harness` on a socket in the test directory and registers it as `name`.
    fn register(&self, name: &str, harness: Arc<dyn Harness>) {
        let socket = self.dir.join(format!("{name}.sock"));
        let listener = tokio::net::UnixListener::bind(&socket).unwrap();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(GrpcHarness::new(harness.clone()).into_service())
                .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener)),
        );
        let spec = HarnessSpec {
            placement: Some(Placement::Remote(RemotePlacement {
                address: format!("unix://{}", socket.display()),
            })),
            capabilities: harness.descriptor().capabilities,
            descriptor_id: String::new(),
        };
        self.node.registry.register(name, Some(spec)).unwrap();
    }

    /// Registers `name` as an echo-like harness at a socket nobody serves; returns the socket.
    fn register_absent(&self, name: &str) -> std::path::PathBuf {
        let socket = self.dir.join(format!("{name}.sock"));
        let spec = HarnessSpec {
            placement: Some(Placement::Remote(RemotePlacement {
                address: format!("unix://{}", socket.display()),
            })),
            capabilities: agentvm_harnesses::echo::Echo.descriptor().capabilities,
            descriptor_id: String::new(),
        };
        self.node.registry.register(name, Some(spec)).unwrap();
        socket
    }

    async fn create(&self, harness: &str) -> Session {
        self.c()
            .create_session(CreateSessionRequest {
                session: Some(Session {
                    harness: harness.into(),
                    ..Default::default()
                }),
            })
            .await
            .unwrap()
            .into_inner()
    }

    async fn get(&self, uid: &str) -> Session {
        self.c()
            .get_session(GetSessionRequest { uid: uid.into() })
            .await
            .unwrap()
            .into_inner()
    }

    async fn replay(&self, uid: &str) -> Vec<LogRecord> {
        support::replay(&mut self.c(), uid).await
    }
}

fn text(role: &str, t: &str) -> Message {
    Message {
        role: role.into(),
        parts: vec![Part {
            part: Some(part::Part::Text(TextPart { text: t.into() })),
        }],
    }
}

fn uid(s: &Session) -> String {
    s.metadata.as_ref().unwrap().uid.clone()
}

fn exec_req(session: &str, input: &str) -> ExecRequest {
    ExecRequest {
        session: session.into(),
        inputs: vec![text("user", input)],
        ..Default::default()
    }
}

/// How many sessions the default project lists (one page).
async fn session_count(c: &mut SessionsClient<Channel>) -> usize {
    c.list_sessions(ListSessionsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .sessions
        .len()
}

/// Everything an Exec stream delivered, and how it ended.
#[derive(Debug, Default)]
struct ExecResult {
    frames: Vec<Update>,
    end: Option<Status>,
}

impl ExecResult {
    fn records(&self) -> Vec<LogRecord> {
        self.frames
            .iter()
            .filter_map(|u| match u {
                Update::Record(r) => Some(r.clone()),
                _ => None,
            })
            .collect()
    }
    fn sessions(&self) -> Vec<Session> {
        self.frames
            .iter()
            .filter_map(|u| match u {
                Update::Session(s) => Some(s.clone()),
                _ => None,
            })
            .collect()
    }
    fn outputs(&self) -> Vec<String> {
        outputs(&self.records())
    }
    fn code(&self) -> Code {
        self.end.as_ref().map_or(Code::Ok, |s| s.code())
    }
}

async fn exec(c: &mut SessionsClient<Channel>, req: ExecRequest) -> ExecResult {
    let mut result = ExecResult::default();
    let mut stream = match c.exec(req).await {
        Ok(s) => s.into_inner(),
        Err(s) => {
            result.end = Some(s);
            return result;
        }
    };
    loop {
        match stream.message().await {
            Ok(Some(ExecUpdate { update: Some(u) })) => result.frames.push(u),
            Ok(Some(_)) => {}
            Ok(None) => return result,
            Err(s) => {
                result.end = Some(s);
                return result;
            }
        }
    }
}

fn outputs(records: &[LogRecord]) -> Vec<String> {
    records
        .iter()
        .filter_map(|r| match &r.event.as_ref()?.body {
            Some(Body::Message(m)) if m.role == "assistant" => Some(
                m.parts
                    .iter()
                    .filter_map(|p| match &p.part {
                        Some(part::Part::Text(t)) => Some(t.text.clone()),
                        _ => None,
                    })
                    .collect(),
            ),
            _ => None,
        })
        .collect()
}

fn kinds(records: &[LogRecord]) -> Vec<EventKind> {
    records
        .iter()
        .map(|r| EventKind::try_from(r.event.as_ref().unwrap().kind).unwrap())
        .collect()
}

// ---------- test harnesses ----------

/// Echo that waits for a permit before answering: a turn that stays running.
struct Gate {
    permits: Arc<Semaphore>,
    started: Arc<Semaphore>,
}

impl Gate {
    fn new() -> Arc<Self> {
        Arc::new(Gate {
            permits: Arc::new(Semaphore::new(0)),
            started: Arc::new(Semaphore::new(0)),
        })
    }
}

#[async_trait::async_trait]
impl Harness for Gate {
    fn descriptor(&self) -> HarnessDescriptor {
        agentvm_harnesses::echo::Echo.descriptor()
    }
    async fn run(&self, exec: &Execution, sink: &mut Sink) -> Result<(), HarnessFailure> {
        self.started.add_permits(1);
        let permit = self
            .permits
            .acquire()
            .await
            .map_err(|_| HarnessFailure::new("closed"))?;
        permit.forget();
        agentvm_harnesses::echo::Echo.run(exec, sink).await
    }
}

/// Asks for approval of one tool call, then says how it went.
struct Approver;

#[async_trait::async_trait]
impl Harness for Approver {
    fn descriptor(&self) -> HarnessDescriptor {
        HarnessDescriptor {
            id: "approver".into(),
            version: "1".into(),
            capabilities: Some(Capabilities {
                resumability: Resumability::StatelessReplay as i32,
                ..Default::default()
            }),
            ..Default::default()
        }
    }
    async fn run(&self, _exec: &Execution, sink: &mut Sink) -> Result<(), HarnessFailure> {
        let answer = sink
            .tool_call(ToolCall {
                id: "call-1".into(),
                tool: "deploy".into(),
                args: None,
                mediation: Mediation::RequiresApproval as i32,
                idempotency_key: "deploy-1".into(),
            })
            .await?;
        let said = if answer.result.is_error {
            "refused"
        } else {
            "done"
        };
        sink.output(text("assistant", said)).await?;
        Ok(())
    }
}

/// Echo with a config and cursor check: answers with what Start carried.
struct StartEcho;

#[async_trait::async_trait]
impl Harness for StartEcho {
    fn descriptor(&self) -> HarnessDescriptor {
        agentvm_harnesses::echo::Echo.descriptor()
    }
    async fn run(&self, exec: &Execution, sink: &mut Sink) -> Result<(), HarnessFailure> {
        sink.model(ModelCall {
            model: "echo".into(),
            messages: vec![text(
                "user",
                &format!(
                    "config={} cursor={}",
                    exec.start
                        .config
                        .iter()
                        .map(|b| format!("{b:02x}"))
                        .collect::<String>(),
                    exec.start.resume_from_seq
                ),
            )],
            ..Default::default()
        })
        .await?;
        Ok(())
    }
}

// ---------- C. placement & service ----------

#[tokio::test]
async fn scenario_58_service_end_to_end() {
    let n = start().await;
    let mut c = n.c();
    let s = n.create("echo").await;
    let id = uid(&s);
    assert_eq!(s.exec_state, ExecState::ExecPending as i32);
    assert_eq!(s.compute_state, ComputeState::ComputeNone as i32);
    let r = exec(&mut c, exec_req(&id, "hi")).await;
    assert_eq!(r.code(), Code::Ok, "{:?}", r.end);
    assert_eq!(r.outputs(), ["echo:hi"]);
    let replayed = n.replay(&id).await;
    assert_eq!(replayed.len(), 5);
    assert_eq!(
        replayed,
        r.records(),
        "Replay is byte-identical to what Exec streamed"
    );
    assert!(replayed.iter().all(|r| r.content_hash.len() == 64));

    let children = c
        .fork(ForkRequest {
            session: id.clone(),
            count: 1,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .children;
    assert_eq!(children.len(), 1);
    let child = n.replay(&uid(&children[0])).await;
    assert_eq!(child.len(), 6);
    assert_eq!(child[..5], replayed[..]);

    let suspended = c
        .suspend(SuspendRequest {
            session: id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(suspended.compute_state, ComputeState::ComputeCold as i32);
    let resumed = c
        .resume(ResumeRequest {
            session: id.clone(),
            boot: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(resumed.compute_state, ComputeState::ComputeLive as i32);
    let mut bye = exec_req(&id, "bye");
    bye.expected_last_seq = Some(resumed.last_seq);
    let r = exec(&mut c, bye).await;
    assert_eq!(r.code(), Code::Ok, "{:?}", r.end);
    assert_eq!(r.outputs(), ["echo:bye"]);
    let mut stale = exec_req(&id, "again");
    stale.expected_last_seq = Some(0);
    let r = exec(&mut c, stale).await;
    assert_eq!(r.code(), Code::Aborted, "{:?}", r.end);
    let all = n.replay(&id).await;
    verify_chain(&all).unwrap();
    assert_eq!(
        kinds(&all)[5..7],
        [EventKind::EventLifecycle, EventKind::EventLifecycle]
    );
}

#[tokio::test]
async fn scenario_59_fork_bounds() {
    let n = start().await;
    let mut c = n.c();
    let id = uid(&n.create("echo").await);
    assert_eq!(exec(&mut c, exec_req(&id, "x")).await.code(), Code::Ok);
    let err = c
        .fork(ForkRequest {
            session: id.clone(),
            count: 129,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("count"), "{}", err.message());
    // (0 is unset: one child, as upstream's server and Go SDK take it.)
    for bad in [-1, i32::MIN] {
        let err = c
            .fork(ForkRequest {
                session: id.clone(),
                count: bad,
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
    }
    let children = c
        .fork(ForkRequest {
            session: id.clone(),
            count: 128,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .children;
    assert_eq!(children.len(), 128);
    let mut uids: Vec<String> = children.iter().map(uid).collect();
    uids.sort();
    uids.dedup();
    assert_eq!(uids.len(), 128);
}

#[tokio::test]
async fn scenario_60_routing_errors() {
    let n = start().await;
    let mut c = n.c();
    let err = c
        .create_session(CreateSessionRequest {
            session: Some(Session {
                harness: "nope".into(),
                ..Default::default()
            }),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(
        err.message().contains("echo"),
        "lists served names: {}",
        err.message()
    );
    let id = uid(&n.create("echo").await);
    let mut over = exec_req(&id, "x");
    over.harness = "nope".into();
    assert_eq!(exec(&mut c, over).await.code(), Code::InvalidArgument);
    let r = exec(&mut c, exec_req("sess-000000000000000000000000", "x")).await;
    assert_eq!(r.code(), Code::NotFound);
    // A memory-snapshot harness cannot run on the process runtime: refused as the session
    // is created (a session that could never run a turn is not written), and on an implicit
    // create by Exec.
    let err = c
        .create_session(CreateSessionRequest {
            session: Some(Session {
                harness: "counter".into(),
                ..Default::default()
            }),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(
        err.message().contains("REQUIRES_MEMORY_SNAPSHOT"),
        "{err:?}"
    );
    let mut implicit = exec_req("", "x");
    implicit.harness = "counter".into();
    let r = exec(&mut c, implicit).await;
    assert_eq!(r.code(), Code::FailedPrecondition, "{:?}", r.end);
}

#[tokio::test]
async fn scenario_61_implicit_create() {
    let n = start().await;
    let mut c = n.c();
    let r = exec(
        &mut c,
        ExecRequest {
            inputs: vec![text("user", "hi")],
            harness: "chat".into(),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(r.code(), Code::Ok, "{:?}", r.end);
    let first = &r.sessions()[0];
    let got = n.get(&uid(first)).await;
    assert_eq!(got.harness, "chat");
    assert_eq!(r.outputs(), ["echo:hi"]);

    // As upstream's clients send it: inputs only, no session and no harness. The session is
    // made on the node's default harness, which answers once.
    let r = exec(
        &mut c,
        ExecRequest {
            inputs: vec![text("user", "hi")],
            ..Default::default()
        },
    )
    .await;
    assert_eq!(r.code(), Code::Ok, "{:?}", r.end);
    let made = uid(&r.sessions()[0]);
    assert!(!made.is_empty());
    assert_eq!(n.get(&made).await.harness, "echo");
    assert_eq!(r.outputs(), ["echo:hi"]);
}

/// The models the session's MODEL_CALL records name, in order.
fn called_models(records: &[LogRecord]) -> Vec<String> {
    records
        .iter()
        .filter_map(|r| match &r.event.as_ref()?.body {
            Some(Body::Model(m)) => Some(m.model.clone()),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn chat_asks_the_session_model_unless_its_config_names_one() {
    let n = start().await;
    let mut c = n.c();
    let create = |model: &str| CreateSessionRequest {
        session: Some(Session {
            harness: "chat".into(),
            model: model.into(),
            ..Default::default()
        }),
    };
    let plain = uid(&c.create_session(create("")).await.unwrap().into_inner());
    let r = exec(&mut c, exec_req(&plain, "hi")).await;
    assert_eq!(r.code(), Code::Ok, "{:?}", r.end);
    assert_eq!(r.outputs(), ["echo:hi"]);
    assert_eq!(called_models(&n.replay(&plain).await), ["echo"]);

    // This node has no provider for it, so the turn fails naming the model it asked for.
    let modelled = uid(&c
        .create_session(create("gpt-test"))
        .await
        .unwrap()
        .into_inner());
    let r = exec(&mut c, exec_req(&modelled, "hi")).await;
    assert_ne!(r.code(), Code::Ok, "{:?}", r.end);
    assert!(format!("{:?}", r.end).contains("gpt-test"), "{:?}", r.end);
    assert_eq!(called_models(&n.replay(&modelled).await), ["gpt-test"]);

    let mut overridden = exec_req(&modelled, "again");
    overridden.config = br#"{"model": "echo"}"#.to_vec();
    let r = exec(&mut c, overridden).await;
    assert_eq!(r.code(), Code::Ok, "{:?}", r.end);
    assert_eq!(r.outputs(), ["echo:again"]);
    assert_eq!(
        called_models(&n.replay(&modelled).await),
        ["gpt-test", "echo"]
    );
}

#[tokio::test]
async fn scenario_62_session_frame_first_even_on_error() {
    let n = start().await;
    let mut c = n.c();
    let id = uid(&n.create("echo").await);
    let mut stale = exec_req(&id, "x");
    stale.expected_last_seq = Some(7);
    let r = exec(&mut c, stale).await;
    assert!(
        matches!(r.frames.first(), Some(Update::Session(_))),
        "{:?}",
        r.frames
    );
    assert_eq!(r.code(), Code::Aborted);
    let ok = exec(&mut c, exec_req(&id, "y")).await;
    assert!(matches!(ok.frames.first(), Some(Update::Session(s)) if s.last_seq == 0));
    // As upstream's: a completed turn ends with its last record, not a second Session
    // (agentctl prints a line for every Session frame), and the echo model sends no deltas.
    assert_eq!(ok.sessions().len(), 1, "{:?}", ok.frames);
    assert_eq!(ok.frames.len(), 1 + 5, "{:?}", ok.frames);
    assert!(matches!(ok.frames.last(), Some(Update::Record(r)) if r.seq == 5));
}

/// A request error (an unknown or pinned harness, a config the harness cannot take) is the
/// stream's status on the first receive, before any frame, as upstream answers it.
#[tokio::test]
async fn a_request_error_is_the_stream_s_status_before_any_frame() {
    let n = start().await;
    let mut c = n.c();
    let id = uid(&n.create("echo").await);
    let mut unknown = exec_req(&id, "x");
    unknown.harness = "no-such-harness".into();
    let mut bad_config = exec_req(&id, "x");
    bad_config.harness = "chat".into();
    bad_config.config = b"not json".to_vec();
    for (req, code) in [
        (unknown, Code::InvalidArgument),
        (bad_config, Code::InvalidArgument),
        (exec_req("sess-does-not-exist", "x"), Code::NotFound),
    ] {
        let r = exec(&mut c, req).await;
        assert_eq!(r.code(), code, "{r:?}");
        assert!(r.frames.is_empty(), "{:?}", r.frames);
    }
    assert_eq!(n.get(&id).await.last_seq, 0);
}

#[tokio::test]
async fn scenario_63_no_cas_appends_at_head_and_explicit_zero() {
    let n = start().await;
    let mut c = n.c();
    let id = uid(&n.create("echo").await);
    for w in ["a", "b", "c"] {
        assert_eq!(exec(&mut c, exec_req(&id, w)).await.code(), Code::Ok);
    }
    assert_eq!(n.get(&id).await.last_seq, 15);
    let fresh = uid(&n.create("echo").await);
    let mut zero = exec_req(&fresh, "a");
    zero.expected_last_seq = Some(0);
    assert_eq!(exec(&mut c, zero.clone()).await.code(), Code::Ok);
    assert_eq!(exec(&mut c, zero).await.code(), Code::Aborted);
}

#[tokio::test]
async fn scenario_64_metadata_round_trip() {
    let n = start().await;
    let mut c = n.c();
    let created = c
        .create_session(CreateSessionRequest {
            session: Some(Session {
                metadata: Some(ResourceMetadata {
                    project: "tenant".into(),
                    name: "my-session".into(),
                    ..Default::default()
                }),
                harness: "echo".into(),
                model: "m".into(),
                identity: Some(IdentityRef {
                    principal: "p".into(),
                    issuer: "i".into(),
                    subject: "s".into(),
                }),
                origin: Some(Origin {
                    source: "src".into(),
                    ..Default::default()
                }),
                labels: [("team".to_owned(), "a".to_owned())].into(),
                annotations: [("note".to_owned(), "v".to_owned())].into(),
                ..Default::default()
            }),
        })
        .await
        .unwrap()
        .into_inner();
    let got = n.get(&uid(&created)).await;
    assert_eq!(got.metadata.as_ref().unwrap().name, "my-session");
    assert_eq!(got.metadata.as_ref().unwrap().project, "tenant");
    assert_eq!(got.identity.as_ref().unwrap().principal, "p");
    assert_eq!(got.origin.as_ref().unwrap().source, "src");
    assert_eq!(got.labels["team"], "a");
    assert_eq!(got.annotations["note"], "v");
    let bare = n.get(&uid(&n.create("echo").await)).await;
    assert!(bare.identity.is_none() && bare.origin.is_none() && bare.labels.is_empty());
    assert_eq!(bare.metadata.as_ref().unwrap().project, "default");

    let listed = c
        .list_sessions(ListSessionsRequest {
            project: "tenant".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.sessions.len(), 1);
    assert_eq!(listed.sessions[0].labels["team"], "a");

    let id = uid(&created);
    assert_eq!(exec(&mut c, exec_req(&id, "x")).await.code(), Code::Ok);
    let child = &c
        .fork(ForkRequest {
            session: id,
            count: 1,
            labels: [("fork".to_owned(), "yes".to_owned())].into(),
            child_names: vec!["kid".into()],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .children[0];
    assert_eq!(
        child.labels.len(),
        1,
        "labels come from the request, never inherited"
    );
    assert_eq!(child.labels["fork"], "yes");
    assert_eq!(child.annotations["note"], "v");
    assert_eq!(child.origin.as_ref().unwrap().source, "src");
    assert_eq!(child.metadata.as_ref().unwrap().name, "kid");
    assert_eq!(child.parent_uid, uid(&created));
    assert_eq!(child.fork_seq, 5);
    assert_eq!(child.compute_state, ComputeState::ComputeCold as i32);
}

#[tokio::test]
async fn scenario_65_exec_state_and_past_deadline() {
    let n = start().await;
    let mut c = n.c();
    let id = uid(&n.create("echo").await);
    assert_eq!(n.get(&id).await.exec_state, ExecState::ExecPending as i32);
    assert_eq!(exec(&mut c, exec_req(&id, "x")).await.code(), Code::Ok);
    assert_eq!(n.get(&id).await.exec_state, ExecState::ExecCompleted as i32);
    let mut late = exec_req(&id, "y");
    late.deadline_unix = 1;
    assert_eq!(exec(&mut c, late).await.code(), Code::DeadlineExceeded);
    assert_eq!(n.get(&id).await.last_seq, 5);
}

#[tokio::test]
async fn scenario_66_config_and_cursor_reach_the_harness() {
    let n = start().await;
    n.register("startecho", Arc::new(StartEcho));
    let mut c = n.c();
    let id = uid(&n.create("startecho").await);
    // Bytes, not text (upstream's own test sends these): they reach the harness and the
    // record exactly.
    let config = vec![0, 255, b' ', b'\n', b'\t'];
    let mut req = exec_req(&id, "x");
    req.config = config.clone();
    req.resume_from_seq = 42;
    let r = exec(&mut c, req).await;
    assert_eq!(r.code(), Code::Ok, "{:?}", r.end);
    assert_eq!(r.outputs(), ["echo:config=00ff200a09 cursor=42"]);
    let first = &r.records()[0];
    assert_eq!(first.seq, 1);
    match &first.event.as_ref().unwrap().body {
        Some(Body::ExecutionStart(s)) => {
            assert_eq!(s.config, config);
            assert_eq!(s.resume_from_seq, 42);
            assert_eq!(s.harness, "startecho");
        }
        other => panic!("{other:?}"),
    }
    let mut one = c
        .replay(ReplayRequest {
            session: id,
            from_seq: 0,
            to_seq: 1,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(one.message().await.unwrap().as_ref(), Some(first));
    assert_eq!(
        one.message().await.unwrap(),
        None,
        "to_seq 1 ends after seq 1"
    );
}

#[tokio::test]
async fn scenario_68_and_69_overlap_and_checkpoint_preemption() {
    let n = start().await;
    let gate = Gate::new();
    n.register("gate", gate.clone());
    let id = uid(&n.create("gate").await);
    let other = uid(&n.create("echo").await);
    let turn = {
        let mut c = n.c();
        let id = id.clone();
        tokio::spawn(async move { exec(&mut c, exec_req(&id, "slow")).await })
    };
    tokio::time::timeout(Duration::from_secs(10), gate.started.acquire())
        .await
        .expect("the gated turn never started")
        .unwrap()
        .forget();
    let mut c = n.c();
    // Overlapping Exec and Resume are refused at once, changing nothing.
    let before = n.get(&id).await;
    assert_eq!(
        exec(&mut c, exec_req(&id, "again")).await.code(),
        Code::Aborted
    );
    let err = c
        .resume(ResumeRequest {
            session: id.clone(),
            boot: false,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Aborted);
    assert_eq!(n.get(&id).await.last_seq, before.last_seq);
    // An independent session proceeds.
    assert_eq!(exec(&mut c, exec_req(&other, "x")).await.code(), Code::Ok);
    // Suspend preempts the running turn, which ends ABORTED and stays resumable.
    let s = c
        .suspend(SuspendRequest {
            session: id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(s.compute_state, ComputeState::ComputeCold as i32);
    let r = turn.await.unwrap();
    assert_eq!(r.code(), Code::Aborted, "{:?}", r.end);
    let records = n.replay(&id).await;
    assert!(!kinds(&records).contains(&EventKind::EventError));
    assert_eq!(*kinds(&records).last().unwrap(), EventKind::EventLifecycle);
    // Resume re-drives the interrupted turn. The preempted run still waits in the harness
    // (the host only closed its stream), so it takes one permit and the re-drive the other.
    gate.permits.add_permits(2);
    let resumed = c
        .resume(ResumeRequest {
            session: id.clone(),
            boot: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(resumed.compute_state, ComputeState::ComputeLive as i32);
    let records = n.replay(&id).await;
    assert_eq!(outputs(&records), ["echo:slow"]);
    verify_chain(&records).unwrap();
}

#[tokio::test]
async fn cancel_stops_a_running_execution() {
    let n = start().await;
    let gate = Gate::new();
    n.register("gate", gate.clone());
    let id = uid(&n.create("gate").await);
    let turn = {
        let mut c = n.c();
        let id = id.clone();
        tokio::spawn(async move { exec(&mut c, exec_req(&id, "slow")).await })
    };
    tokio::time::timeout(Duration::from_secs(10), gate.started.acquire())
        .await
        .expect("the gated turn never started")
        .unwrap()
        .forget();
    let mut c = n.c();
    c.cancel(CancelRequest {
        session: id.clone(),
        execution_id: String::new(),
        reason: "user pressed stop".into(),
    })
    .await
    .unwrap();
    assert_eq!(turn.await.unwrap().code(), Code::Cancelled);
    let records = n.replay(&id).await;
    assert_eq!(
        kinds(&records)[2..],
        [EventKind::EventEnd, EventKind::EventLifecycle]
    );
    match &records[2].event.as_ref().unwrap().body {
        Some(Body::End(e)) => assert_eq!(e.state, "CANCELED"),
        other => panic!("{other:?}"),
    }
    // Nothing unfinished remains: a second Cancel with nothing running is refused.
    let again = c
        .cancel(CancelRequest {
            session: id.clone(),
            execution_id: "0000000000000000".into(),
            reason: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(again.code(), Code::FailedPrecondition);
    // New work still runs after a cancel (one permit frees the abandoned run).
    gate.permits.add_permits(2);
    assert_eq!(exec(&mut c, exec_req(&id, "next")).await.code(), Code::Ok);
    verify_chain(&n.replay(&id).await).unwrap();
}

#[tokio::test]
async fn delete_session_refuses_further_work() {
    let n = start().await;
    let mut c = n.c();
    let id = uid(&n.create("echo").await);
    assert_eq!(exec(&mut c, exec_req(&id, "x")).await.code(), Code::Ok);
    let deleted = c
        .delete_session(DeleteSessionRequest { uid: id.clone() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        deleted.compute_state,
        ComputeState::ComputeTerminated as i32
    );
    // Idempotent.
    c.delete_session(DeleteSessionRequest { uid: id.clone() })
        .await
        .unwrap();
    let r = exec(&mut c, exec_req(&id, "y")).await;
    assert_eq!(r.code(), Code::FailedPrecondition);
    let listed = c
        .list_sessions(ListSessionsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(listed.sessions.iter().all(|s| uid(s) != id));
    // The log stays readable for audit.
    assert_eq!(n.replay(&id).await.len(), 5);
    let err = c
        .delete_session(DeleteSessionRequest {
            uid: "sess-000000000000000000000000".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
}

#[tokio::test]
async fn scenario_81_approval_park_decide_resume() {
    let n = start().await;
    n.register("approver", Arc::new(Approver));
    let mut c = n.c();
    let id = uid(&n.create("approver").await);
    let r = exec(&mut c, exec_req(&id, "deploy it")).await;
    assert_eq!(r.code(), Code::Ok, "a park ends the stream OK: {:?}", r.end);
    let last = r.sessions().pop().unwrap();
    assert_eq!(last.exec_state, ExecState::ExecAwaiting as i32);
    assert_eq!(last.compute_state, ComputeState::ComputeCold as i32);
    let pending = last.pending_approval.clone().unwrap();
    assert_eq!(pending.tool_call_id, "call-1");
    // While pending: Resume and inputless Exec change nothing; new input is refused.
    let head = n.get(&id).await.last_seq;
    let again = c
        .resume(ResumeRequest {
            session: id.clone(),
            boot: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.pending_approval, Some(pending.clone()));
    let inputless = exec(
        &mut c,
        ExecRequest {
            session: id.clone(),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(inputless.code(), Code::Ok);
    assert_eq!(n.get(&id).await.last_seq, head);
    assert_eq!(
        exec(&mut c, exec_req(&id, "more")).await.code(),
        Code::FailedPrecondition
    );
    // Decide: deny. An exact retry returns the same record; a changed one is refused.
    let approve = ApproveRequest {
        session: id.clone(),
        execution_id: pending.execution_id.clone(),
        tool_call_id: pending.tool_call_id.clone(),
        request_seq: pending.request_seq,
        approved: Some(false),
        reason: "not today".into(),
        identity: Some(IdentityRef {
            principal: "human".into(),
            ..Default::default()
        }),
    };
    let decided = c.approve(approve.clone()).await.unwrap().into_inner();
    let retry = c.approve(approve.clone()).await.unwrap().into_inner();
    assert_eq!(decided.decision, retry.decision);
    let mut changed = approve.clone();
    changed.approved = Some(true);
    assert_eq!(
        c.approve(changed).await.unwrap_err().code(),
        Code::FailedPrecondition
    );
    assert!(decided.session.unwrap().pending_approval.is_none());
    // Resume completes the turn with the denial receipt.
    let done = c
        .resume(ResumeRequest {
            session: id.clone(),
            boot: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(done.exec_state, ExecState::ExecCompleted as i32);
    let records = n.replay(&id).await;
    assert_eq!(outputs(&records), ["refused"]);
    verify_chain(&records).unwrap();
    // The receipt unlocks new input.
    let next = exec(&mut c, exec_req(&id, "again")).await;
    assert_eq!(next.code(), Code::Ok, "{:?}", next.end);
}

fn approval_of(session: &str, pending: &ApprovalRef, approved: bool) -> ApproveRequest {
    ApproveRequest {
        session: session.into(),
        execution_id: pending.execution_id.clone(),
        tool_call_id: pending.tool_call_id.clone(),
        request_seq: pending.request_seq,
        approved: Some(approved),
        reason: "reviewed".into(),
        identity: Some(IdentityRef {
            principal: "human".into(),
            ..Default::default()
        }),
    }
}

#[tokio::test]
async fn scenario_53_approve_idempotency() {
    // Denials: an approval would need a tool executor (scenario 67).
    const DENY: bool = false;
    let n = start().await;
    n.register("approver", Arc::new(Approver));
    let mut c = n.c();
    let id = uid(&n.create("approver").await);
    let fence = || n.node.journal.get_session(&id).unwrap().unwrap().fence;
    let r = exec(&mut c, exec_req(&id, "deploy")).await;
    let first = r.sessions().pop().unwrap().pending_approval.unwrap();
    let decided = c
        .approve(approval_of(&id, &first, DENY))
        .await
        .unwrap()
        .into_inner();
    let (head, fenced) = (n.get(&id).await.last_seq, fence());
    // An identical retry returns the original record and fences nobody.
    let retry = c
        .approve(approval_of(&id, &first, DENY))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(retry.decision, decided.decision);
    assert_eq!((n.get(&id).await.last_seq, fence()), (head, fenced));
    // The turn completes; the old decision stays retryable, a changed one does not.
    c.resume(ResumeRequest {
        session: id.clone(),
        boot: false,
    })
    .await
    .unwrap();
    assert_eq!(outputs(&n.replay(&id).await), ["refused"]);
    let head = n.get(&id).await.last_seq;
    let later = c
        .approve(approval_of(&id, &first, DENY))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(later.decision, decided.decision);
    assert_eq!(n.get(&id).await.last_seq, head);
    let flipped = c
        .approve(approval_of(&id, &first, !DENY))
        .await
        .unwrap_err();
    assert_eq!(flipped.code(), Code::FailedPrecondition, "{flipped:?}");
    // A request superseded without a decision (its execution canceled) cannot be decided.
    let r = exec(&mut c, exec_req(&id, "deploy again")).await;
    let second = r.sessions().pop().unwrap().pending_approval.unwrap();
    assert_ne!(second.execution_id, first.execution_id);
    c.cancel(CancelRequest {
        session: id.clone(),
        execution_id: second.execution_id.clone(),
        reason: "changed my mind".into(),
    })
    .await
    .unwrap();
    let head = n.get(&id).await.last_seq;
    let superseded = c
        .approve(approval_of(&id, &second, true))
        .await
        .unwrap_err();
    assert_eq!(
        superseded.code(),
        Code::FailedPrecondition,
        "{superseded:?}"
    );
    assert!(
        superseded.message().contains("superseded"),
        "{superseded:?}"
    );
    // Naming a request of an execution that is not the latest is refused as superseded too.
    let mut foreign = approval_of(&id, &second, true);
    foreign.execution_id = first.execution_id.clone();
    let err = c.approve(foreign).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert_eq!(n.get(&id).await.last_seq, head, "nothing written");
    verify_chain(&n.replay(&id).await).unwrap();
}

/// Calls one CONTROLLER_MEDIATED tool and says what came back.
struct ToolCaller {
    tool: &'static str,
    key: &'static str,
}

#[async_trait::async_trait]
impl Harness for ToolCaller {
    fn descriptor(&self) -> HarnessDescriptor {
        agentvm_harnesses::echo::Echo.descriptor()
    }
    async fn run(&self, _exec: &Execution, sink: &mut Sink) -> Result<(), HarnessFailure> {
        let mut args = prost_types::Struct::default();
        args.fields.insert(
            "x".into(),
            prost_types::Value {
                kind: Some(prost_types::value::Kind::NumberValue(2.0)),
            },
        );
        let answer = sink
            .tool_call(ToolCall {
                id: "call-1".into(),
                tool: self.tool.into(),
                args: Some(args),
                mediation: Mediation::ControllerMediated as i32,
                idempotency_key: self.key.into(),
            })
            .await?;
        let r = answer.result;
        let said = if r.is_error {
            format!("error:{}", r.error)
        } else {
            let sum = r.output.as_ref().and_then(|o| o.fields.get("sum"));
            match sum.and_then(|v| v.kind.clone()) {
                Some(prost_types::value::Kind::NumberValue(n)) => format!("ok:{n}"),
                other => format!("ok:{other:?}"),
            }
        };
        sink.output(text("assistant", &said)).await?;
        Ok(())
    }
}

/// What the tool endpoint saw of one call.
#[derive(Debug, Clone)]
struct ToolRequest {
    body: serde_json::Value,
    idempotency_key: String,
    /// Whether the session's log already ended in this call's TOOL_CALL when it arrived.
    intent_durable: bool,
}

/// An operator's tool endpoint: `add` answers x+2, `fail` answers HTTP 500.
async fn tool_endpoint(
    listener: tokio::net::TcpListener,
    journal: Arc<dyn Journal>,
    seen: Arc<std::sync::Mutex<Vec<ToolRequest>>>,
) {
    use http_body_util::{BodyExt, Full};
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            return;
        };
        let (journal, seen) = (journal.clone(), seen.clone());
        let service = hyper::service::service_fn(
            move |req: hyper::Request<hyper::body::Incoming>| {
                let (journal, seen) = (journal.clone(), seen.clone());
                async move {
                    let idempotency_key = req
                        .headers()
                        .get("idempotency-key")
                        .map(|v| v.to_str().unwrap().to_owned())
                        .unwrap_or_default();
                    let bytes = req.into_body().collect().await.unwrap().to_bytes();
                    let body: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
                    let uid = body["session_uid"].as_str().unwrap();
                    let last = journal.read(uid, 1, 0).unwrap().pop().unwrap();
                    let intent_durable = matches!(
                        &last.event.as_ref().unwrap().body,
                        Some(Body::Tool(c)) if c.idempotency_key == body["call"]["idempotency_key"]
                    );
                    seen.lock().unwrap().push(ToolRequest {
                        body: body.clone(),
                        idempotency_key,
                        intent_durable,
                    });
                    let (status, answer) = match body["call"]["tool"].as_str() {
                        Some("add") => (
                            200,
                            serde_json::json!({
                                "output": {"sum": body["call"]["args"]["x"].as_f64().unwrap() + 2.0},
                                "content": "added",
                            }),
                        ),
                        _ => (500, serde_json::json!({"message": "the ledger is locked"})),
                    };
                    Ok::<_, std::convert::Infallible>(
                        hyper::Response::builder()
                            .status(status)
                            .body(Full::new(bytes::Bytes::from(answer.to_string())))
                            .unwrap(),
                    )
                }
            },
        );
        tokio::spawn(
            hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service),
        );
    }
}

#[tokio::test]
async fn scenario_67_host_tool_executor() {
    let (n, seen) = node_with_tool_executor().await;
    n.register(
        "adder",
        Arc::new(ToolCaller {
            tool: "add",
            key: "k-add",
        }),
    );
    n.register(
        "failer",
        Arc::new(ToolCaller {
            tool: "fail",
            key: "k-fail",
        }),
    );
    n.register(
        "keyless",
        Arc::new(ToolCaller {
            tool: "add",
            key: "",
        }),
    );
    let mut c = n.c();

    // The executor sees the durable intent first, scoped to the session.
    let id = uid(&n.create("adder").await);
    let r = exec(&mut c, exec_req(&id, "add")).await;
    assert_eq!(r.code(), Code::Ok, "{:?}", r.end);
    let records = n.replay(&id).await;
    assert_eq!(outputs(&records), ["ok:4"]);
    let call = seen.lock().unwrap()[0].clone();
    assert!(call.intent_durable, "{call:?}");
    assert_eq!(call.body["session_uid"], id.as_str());
    assert_eq!(call.body["call"]["idempotency_key"], "k-add");
    assert_eq!(
        call.body["call"]["mediation"],
        "MEDIATION_CONTROLLER_MEDIATED"
    );
    assert_eq!(call.idempotency_key, format!("{id}/k-add"));
    let result = records
        .iter()
        .find_map(|r| match &r.event.as_ref().unwrap().body {
            Some(Body::Result(res)) => Some(res.clone()),
            _ => None,
        })
        .expect("a TOOL_RESULT");
    assert_eq!(result.id, "call-1");
    assert_eq!(seen.lock().unwrap().len(), 1, "one call, one request");

    // An executor error reaches the harness and nothing records it.
    let id = uid(&n.create("failer").await);
    let r = exec(&mut c, exec_req(&id, "fail")).await;
    assert_eq!(r.code(), Code::Ok, "{:?}", r.end);
    let records = n.replay(&id).await;
    let said = outputs(&records).pop().unwrap();
    assert!(
        said.starts_with("error:")
            && said.contains("HTTP 500")
            && said.contains("ledger is locked"),
        "{said}"
    );
    assert!(!kinds(&records).contains(&EventKind::EventToolResult));
    assert_eq!(seen.lock().unwrap().len(), 2);

    // A call without a key is refused before its intent, and the executor never hears of it.
    let id = uid(&n.create("keyless").await);
    let r = exec(&mut c, exec_req(&id, "add")).await;
    assert_eq!(r.code(), Code::Internal, "{:?}", r.end);
    assert!(
        r.end
            .as_ref()
            .unwrap()
            .message()
            .contains("MissingIdempotencyKey")
    );
    assert!(!kinds(&n.replay(&id).await).contains(&EventKind::EventToolCall));
    assert_eq!(seen.lock().unwrap().len(), 2);

    // A node without an executor refuses host-mediated calls before any intent.
    let bare = start().await;
    bare.register(
        "adder",
        Arc::new(ToolCaller {
            tool: "add",
            key: "k-add",
        }),
    );
    let id = uid(&bare.create("adder").await);
    let r = exec(&mut bare.c(), exec_req(&id, "add")).await;
    assert_eq!(r.code(), Code::FailedPrecondition, "{:?}", r.end);
    assert!(
        r.end
            .as_ref()
            .unwrap()
            .message()
            .contains("MissingToolExecutor")
    );
    assert!(!kinds(&bare.replay(&id).await).contains(&EventKind::EventToolCall));
}

/// A node whose tool executor is `tool_endpoint`, and what the endpoint saw.
async fn node_with_tool_executor() -> (TestNode, Arc<std::sync::Mutex<Vec<ToolRequest>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/tools", listener.local_addr().unwrap());
    let n = support::start_with(|cfg| {
        cfg.tool_executor = Some(agentvmd::tool_webhook::WebhookConfig {
            url,
            timeout: Duration::from_secs(10),
        })
    })
    .await;
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    tokio::spawn(tool_endpoint(
        listener,
        n.node.journal.clone(),
        seen.clone(),
    ));
    (n, seen)
}

/// What a daemon that died in the middle of a host-mediated tool call leaves: START, INPUT
/// and the call's durable intent, with its result too when `answered`.
fn interrupted_tool_turn(n: &TestNode, id: &str, harness: &str, answered: bool) {
    use agentvm_proto::v1::{Event, ExecutionStart, ToolResult};
    let event = |kind: EventKind, body: Body| Event {
        execution_id: "interrupted".into(),
        kind: kind as i32,
        body: Some(body),
        ..Default::default()
    };
    let mut args = prost_types::Struct::default();
    args.fields.insert(
        "x".into(),
        prost_types::Value {
            kind: Some(prost_types::value::Kind::NumberValue(2.0)),
        },
    );
    let mut events = vec![
        event(
            EventKind::EventExecutionStart,
            Body::ExecutionStart(ExecutionStart {
                input_count: Some(1),
                harness: harness.into(),
                ..Default::default()
            }),
        ),
        event(EventKind::EventInput, Body::Message(text("user", "add"))),
        event(
            EventKind::EventToolCall,
            Body::Tool(ToolCall {
                id: "call-1".into(),
                tool: "add".into(),
                args: Some(args),
                mediation: Mediation::ControllerMediated as i32,
                idempotency_key: "orig-key".into(),
            }),
        ),
    ];
    if answered {
        let mut output = prost_types::Struct::default();
        output.fields.insert(
            "sum".into(),
            prost_types::Value {
                kind: Some(prost_types::value::Kind::NumberValue(4.0)),
            },
        );
        events.push(event(
            EventKind::EventToolResult,
            Body::Result(ToolResult {
                id: "call-1".into(),
                output: Some(output),
                ..Default::default()
            }),
        ));
    }
    let fence = n.node.journal.new_fence(id).unwrap();
    n.node.journal.append(id, 0, fence, &events).unwrap();
}

/// Upstream's host-tool resume tests, through the Resume RPC: an interrupted turn whose tool
/// call has no result gets it from the executor (once, under the call's own key, the intent
/// durable); one whose result is recorded is answered from the log with no executor at all.
/// Either way the log is the turn whole, then RESUME.
#[tokio::test]
async fn resume_finishes_an_interrupted_host_tool_call_once() {
    use agentvm_proto::v1::lifecycle::Kind as LifecycleKind;
    let (n, seen) = node_with_tool_executor().await;
    let bare = start().await;
    for (node, answered) in [(&n, false), (&bare, true)] {
        node.register(
            "adder",
            Arc::new(ToolCaller {
                tool: "add",
                key: "orig-key",
            }),
        );
        let id = uid(&node.create("adder").await);
        interrupted_tool_turn(node, &id, "adder", answered);
        node.c()
            .resume(ResumeRequest {
                session: id.clone(),
                boot: false,
            })
            .await
            .unwrap_or_else(|s| panic!("answered={answered}: {s:?}"));
        let records = node.replay(&id).await;
        assert_eq!(
            kinds(&records),
            [
                EventKind::EventExecutionStart,
                EventKind::EventInput,
                EventKind::EventToolCall,
                EventKind::EventToolResult,
                EventKind::EventOutput,
                EventKind::EventEnd,
                EventKind::EventLifecycle,
            ],
            "answered={answered}"
        );
        assert_eq!(outputs(&records), ["ok:4"]);
        match &records[3].event.as_ref().unwrap().body {
            Some(Body::Result(r)) => assert_eq!(r.id, "call-1"),
            other => panic!("{other:?}"),
        }
        match &records[6].event.as_ref().unwrap().body {
            Some(Body::Lifecycle(l)) => assert_eq!(l.kind, LifecycleKind::LifecycleResume as i32),
            other => panic!("{other:?}"),
        }
        verify_chain(&records).unwrap();
        if !answered {
            let calls = seen.lock().unwrap().clone();
            assert_eq!(calls.len(), 1, "{calls:?}");
            assert!(calls[0].intent_durable);
            assert_eq!(calls[0].body["session_uid"], id.as_str());
            assert_eq!(calls[0].body["call"]["idempotency_key"], "orig-key");
            assert_eq!(calls[0].body["call"]["tool"], "add");
        }
    }
}

/// Says which principal its Start named and whether it may mint tokens.
struct IdentityEcho;

#[async_trait::async_trait]
impl Harness for IdentityEcho {
    fn descriptor(&self) -> HarnessDescriptor {
        agentvm_harnesses::echo::Echo.descriptor()
    }
    async fn run(&self, exec: &Execution, sink: &mut Sink) -> Result<(), HarnessFailure> {
        let said = match &exec.start.identity {
            None => "no identity".to_owned(),
            Some(i) => format!(
                "principal={} can_mint_tokens={}",
                i.principal.as_ref().map_or("", |p| p.principal.as_str()),
                i.can_mint_tokens
            ),
        };
        sink.output(text("assistant", &said)).await?;
        Ok(())
    }
}

#[tokio::test]
async fn scenario_23_credential_vending_variant() {
    // [VAR] The wire has no credential channel (no CREDENTIAL_REQUEST kind, no token frame;
    // wire.md §6.2), so this host vends nothing: Start names the session's principal and
    // says can_mint_tokens=false — the refusal a harness sees — and no token can reach the log.
    let n = start().await;
    n.register("whoami", Arc::new(IdentityEcho));
    let mut c = n.c();
    let created = c
        .create_session(CreateSessionRequest {
            session: Some(Session {
                harness: "whoami".into(),
                identity: Some(IdentityRef {
                    principal: "alice@example.com".into(),
                    issuer: "https://idp.example.com".into(),
                    subject: "u-1".into(),
                }),
                ..Default::default()
            }),
        })
        .await
        .unwrap()
        .into_inner();
    let id = uid(&created);
    let r = exec(&mut c, exec_req(&id, "who am I")).await;
    assert_eq!(r.code(), Code::Ok, "{:?}", r.end);
    let records = n.replay(&id).await;
    assert_eq!(
        outputs(&records),
        ["principal=alice@example.com can_mint_tokens=false"]
    );
    // A session without an identity gets none: nothing is invented for it.
    let anonymous = uid(&n.create("whoami").await);
    exec(&mut c, exec_req(&anonymous, "who am I")).await;
    assert_eq!(outputs(&n.replay(&anonymous).await), ["no identity"]);
}

/// Asks a model the node sends upstream (anything but `echo`).
struct AsksUpstream;

#[async_trait::async_trait]
impl Harness for AsksUpstream {
    fn descriptor(&self) -> HarnessDescriptor {
        agentvm_harnesses::echo::Echo.descriptor()
    }
    async fn run(&self, _exec: &Execution, sink: &mut Sink) -> Result<(), HarnessFailure> {
        sink.model(ModelCall {
            model: "upstream-model".into(),
            messages: vec![text("user", "think hard")],
            ..Default::default()
        })
        .await?;
        Ok(())
    }
}

#[tokio::test]
async fn scenario_79_suspend_under_an_idle_stream() {
    // A model endpoint that takes the request and never answers: the turn's stream is idle.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base_url = format!("http://{}/v1", listener.local_addr().unwrap());
    let asked = Arc::new(Semaphore::new(0));
    {
        let asked = asked.clone();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((conn, _)) = listener.accept().await {
                held.push(conn);
                asked.add_permits(1);
            }
        });
    }
    let n = support::start_with(|cfg| {
        cfg.openai = Some(agentvmd::model::openai::OpenAiConfig {
            base_url,
            api_key: None,
            timeout: Duration::from_secs(600),
        })
    })
    .await;
    n.register("thinker", Arc::new(AsksUpstream));
    let id = uid(&n.create("thinker").await);
    let turn = {
        let mut c = n.c();
        let id = id.clone();
        tokio::spawn(async move { exec(&mut c, exec_req(&id, "go")).await })
    };
    tokio::time::timeout(Duration::from_secs(10), asked.acquire())
        .await
        .expect("the model call never went out")
        .unwrap()
        .forget();
    // Suspend does not wait for the model: it closes the turn's stream and checkpoints.
    let suspended = tokio::time::timeout(
        Duration::from_secs(20),
        n.c().suspend(SuspendRequest {
            session: id.clone(),
        }),
    )
    .await
    .expect("Suspend waited for the idle model call")
    .unwrap()
    .into_inner();
    assert_eq!(suspended.compute_state, ComputeState::ComputeCold as i32);
    let r = turn.await.unwrap();
    assert_eq!(r.code(), Code::Aborted, "{:?}", r.end);
    let records = n.replay(&id).await;
    assert_eq!(
        kinds(&records),
        [
            EventKind::EventExecutionStart,
            EventKind::EventInput,
            EventKind::EventModelCall,
            EventKind::EventLifecycle
        ],
        "the interrupted call stays the crash point; no ERROR"
    );
    verify_chain(&records).unwrap();
}

#[tokio::test]
async fn list_sessions_pages_newest_first() {
    let n = start().await;
    let mut c = n.c();
    let mut made = Vec::new();
    for _ in 0..5 {
        made.push(uid(&n.create("echo").await));
    }
    let mut seen = Vec::new();
    let mut token = String::new();
    loop {
        let page = c
            .list_sessions(ListSessionsRequest {
                project: String::new(),
                page_size: 2,
                page_token: token,
            })
            .await
            .unwrap()
            .into_inner();
        assert!(page.sessions.len() <= 2);
        seen.extend(page.sessions.iter().map(uid));
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    made.reverse();
    assert_eq!(seen, made);
    let err = c
        .list_sessions(ListSessionsRequest {
            page_token: "garbage!".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
}

#[tokio::test]
async fn bad_requests_name_the_field() {
    let n = start().await;
    let mut c = n.c();
    let id = uid(&n.create("echo").await);
    let field = |s: Status, f: &str| {
        assert_eq!(s.code(), Code::InvalidArgument, "{f}: {s:?}");
        assert!(s.message().starts_with(f), "{f}: {}", s.message());
    };
    field(
        c.get_session(GetSessionRequest::default())
            .await
            .unwrap_err(),
        "uid",
    );
    field(
        c.suspend(SuspendRequest::default()).await.unwrap_err(),
        "session",
    );
    field(
        c.resume(ResumeRequest::default()).await.unwrap_err(),
        "session",
    );
    field(
        c.cancel(CancelRequest::default()).await.unwrap_err(),
        "session",
    );
    field(
        c.delete_session(DeleteSessionRequest::default())
            .await
            .unwrap_err(),
        "uid",
    );
    let base = ApproveRequest {
        session: id.clone(),
        execution_id: "e".into(),
        tool_call_id: "t".into(),
        request_seq: 3,
        approved: Some(true),
        ..Default::default()
    };
    for (f, req) in [
        (
            "session",
            ApproveRequest {
                session: String::new(),
                ..base.clone()
            },
        ),
        (
            "execution_id",
            ApproveRequest {
                execution_id: String::new(),
                ..base.clone()
            },
        ),
        (
            "tool_call_id",
            ApproveRequest {
                tool_call_id: String::new(),
                ..base.clone()
            },
        ),
        (
            "request_seq",
            ApproveRequest {
                request_seq: 0,
                ..base.clone()
            },
        ),
        (
            "approved",
            ApproveRequest {
                approved: None,
                ..base.clone()
            },
        ),
    ] {
        field(c.approve(req).await.unwrap_err(), f);
    }
    let fork = ForkRequest {
        session: id.clone(),
        count: 2,
        ..Default::default()
    };
    field(
        c.fork(ForkRequest {
            child_names: vec!["a".into()],
            ..fork.clone()
        })
        .await
        .unwrap_err(),
        "child_names",
    );
    field(
        c.fork(ForkRequest {
            identity: Some(IdentityRef::default()),
            ..fork.clone()
        })
        .await
        .unwrap_err(),
        "ForkRequest.identity",
    );
    field(
        c.fork(ForkRequest {
            at_seq: -1,
            ..fork.clone()
        })
        .await
        .unwrap_err(),
        "at_seq",
    );
    let mut bad_role = exec_req(&id, "x");
    bad_role.inputs[0].role = "robot".into();
    field(c.exec(bad_role).await.err().unwrap(), "inputs[0].role");
    let mut neg = exec_req(&id, "x");
    neg.expected_last_seq = Some(-1);
    field(c.exec(neg).await.err().unwrap(), "expected_last_seq");
    field(
        c.replay(ReplayRequest {
            session: id.clone(),
            from_seq: 5,
            to_seq: 2,
        })
        .await
        .err()
        .unwrap(),
        "to_seq",
    );
    field(
        c.create_session(CreateSessionRequest {
            session: Some(Session {
                metadata: Some(ResourceMetadata {
                    uid: "sess-x".into(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
        })
        .await
        .unwrap_err(),
        "session.metadata.uid",
    );
    let err = c
        .get_session(GetSessionRequest {
            uid: "sess-nope".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
}

// ---------- hostile input ----------

/// Random requests on every RPC: each answers OK or a deliberate status, never a panic or a
/// dropped connection, and every session's log still verifies afterwards.
#[tokio::test]
async fn random_requests_never_break_the_server() {
    use rand::{Rng, SeedableRng};
    let n = start().await;
    let mut c = n.c();
    let mut uids = vec![uid(&n.create("echo").await), uid(&n.create("chat").await)];
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x5e55_1095);
    let pick_str = |rng: &mut rand::rngs::StdRng, uids: &[String]| -> String {
        match rng.random_range(0..6) {
            0 => String::new(),
            1 | 2 => uids[rng.random_range(0..uids.len())].clone(),
            3 => "sess-000000000000000000000000".into(),
            4 => "\u{0}\u{ffff}../../etc".into(),
            _ => (0..rng.random_range(1..40))
                .map(|_| rng.random_range(32u8..127) as char)
                .collect(),
        }
    };
    let pick_int = |rng: &mut rand::rngs::StdRng| -> i64 {
        match rng.random_range(0..6) {
            0 => 0,
            1 => -1,
            2 => i64::MAX,
            3 => i64::MIN,
            _ => rng.random_range(-3..40),
        }
    };
    let roles = ["user", "assistant", "system", "tool", "", "robot"];
    let allowed = [
        Code::Ok,
        Code::InvalidArgument,
        Code::NotFound,
        Code::FailedPrecondition,
        Code::Aborted,
        Code::DeadlineExceeded,
        Code::Cancelled,
    ];
    for i in 0..400 {
        let session = pick_str(&mut rng, &uids);
        let code = match i % 9 {
            0 => {
                let inputs = (0..rng.random_range(0..3))
                    .map(|_| {
                        let mut m = text(
                            roles[rng.random_range(0..roles.len())],
                            &pick_str(&mut rng, &uids),
                        );
                        if rng.random_bool(0.1) {
                            m.parts.push(Part { part: None });
                        }
                        m
                    })
                    .collect();
                let req = ExecRequest {
                    session,
                    inputs,
                    resume_from_seq: pick_int(&mut rng),
                    harness: ["", "echo", "chat", "counter", "nope"][rng.random_range(0..5)].into(),
                    config: pick_str(&mut rng, &uids).into_bytes(),
                    expected_last_seq: rng.random_bool(0.5).then(|| pick_int(&mut rng)),
                    deadline_unix: if rng.random_bool(0.8) {
                        0
                    } else {
                        pick_int(&mut rng)
                    },
                };
                let r = exec(&mut c, req).await;
                if let Some(Update::Session(s)) = r.frames.first()
                    && !uids.contains(&uid(s))
                {
                    uids.push(uid(s));
                }
                r.code()
            }
            1 => c
                .fork(ForkRequest {
                    session,
                    at_seq: pick_int(&mut rng),
                    count: rng.random_range(-2..6),
                    child_names: vec![pick_str(&mut rng, &uids); rng.random_range(0..3)],
                    ..Default::default()
                })
                .await
                .map(|_| ())
                .err()
                .map_or(Code::Ok, |s| s.code()),
            2 => c
                .replay(ReplayRequest {
                    session,
                    from_seq: pick_int(&mut rng),
                    to_seq: pick_int(&mut rng),
                })
                .await
                .map(|_| ())
                .err()
                .map_or(Code::Ok, |s| s.code()),
            3 => c
                .approve(ApproveRequest {
                    session,
                    execution_id: pick_str(&mut rng, &uids),
                    tool_call_id: pick_str(&mut rng, &uids),
                    request_seq: pick_int(&mut rng),
                    approved: rng.random_bool(0.7).then(|| rng.random_bool(0.5)),
                    ..Default::default()
                })
                .await
                .map(|_| ())
                .err()
                .map_or(Code::Ok, |s| s.code()),
            4 => c
                .suspend(SuspendRequest { session })
                .await
                .map(|_| ())
                .err()
                .map_or(Code::Ok, |s| s.code()),
            5 => c
                .resume(ResumeRequest {
                    session,
                    boot: rng.random_bool(0.5),
                })
                .await
                .map(|_| ())
                .err()
                .map_or(Code::Ok, |s| s.code()),
            6 => c
                .cancel(CancelRequest {
                    session,
                    execution_id: pick_str(&mut rng, &uids),
                    reason: pick_str(&mut rng, &uids),
                })
                .await
                .map(|_| ())
                .err()
                .map_or(Code::Ok, |s| s.code()),
            7 => c
                .list_sessions(ListSessionsRequest {
                    project: pick_str(&mut rng, &uids),
                    page_size: pick_int(&mut rng) as i32,
                    page_token: pick_str(&mut rng, &uids),
                })
                .await
                .map(|_| ())
                .err()
                .map_or(Code::Ok, |s| s.code()),
            _ => c
                .get_session(GetSessionRequest { uid: session })
                .await
                .map(|_| ())
                .err()
                .map_or(Code::Ok, |s| s.code()),
        };
        assert!(allowed.contains(&code), "request {i}: unexpected {code:?}");
    }
    for u in &uids {
        verify_chain(&n.replay(u).await).unwrap();
    }
}

/// The built-in echo as an upstream harness is: it keeps no history, so each Start carries
/// the whole of it.
struct WholeHistoryEcho;

#[async_trait::async_trait]
impl Harness for WholeHistoryEcho {
    fn descriptor(&self) -> HarnessDescriptor {
        let mut d = agentvm_harnesses::echo::Echo.descriptor();
        if let Some(caps) = d.capabilities.as_mut() {
            caps.incremental_history = false;
        }
        d
    }
    async fn run(&self, exec: &Execution, sink: &mut Sink) -> Result<(), HarnessFailure> {
        agentvm_harnesses::echo::Echo.run(exec, sink).await
    }
}

/// Issue: an 8 MiB input was journaled and then failed every later turn and replay for
/// good. Inputs over the limit are refused with INVALID_ARGUMENT naming it, before anything
/// is written; a history that would outgrow the harness's Start is refused with
/// FAILED_PRECONDITION, the session keeps working, and a fork at an earlier seq goes on.
#[tokio::test]
async fn oversized_input_is_refused_before_it_is_journaled_and_the_session_goes_on() {
    let n = start().await;
    // The built-in echo takes a history of any length (`incremental_history`); a harness
    // that does not declare it is sent the whole history in one Start, as upstream's are.
    n.register("plain-echo", Arc::new(WholeHistoryEcho));
    let mut c = n.c();
    let id = uid(&n.create("plain-echo").await);
    assert_eq!(exec(&mut c, exec_req(&id, "first")).await.code(), Code::Ok);
    let before = n.replay(&id).await;

    let huge = "x".repeat(8 << 20);
    let r = exec(&mut c, exec_req(&id, &huge)).await;
    assert_eq!(r.code(), Code::InvalidArgument, "{:?}", r.end);
    let message = r.end.as_ref().unwrap().message().to_owned();
    assert!(
        message.contains("inputs[0]") && message.contains("1048576"),
        "{message}"
    );
    let mut two = exec_req(&id, &"y".repeat(600 << 10));
    two.inputs.push(text("user", &"z".repeat(600 << 10)));
    let r = exec(&mut c, two).await;
    assert_eq!(r.code(), Code::InvalidArgument, "{:?}", r.end);
    assert!(r.end.unwrap().message().contains("together"));
    assert_eq!(n.replay(&id).await, before, "nothing was journaled");

    // History grows toward the 4 MiB a harness's gRPC server takes: echo's output repeats
    // each input, so every turn adds twice its input.
    let chunk = "h".repeat(900 << 10);
    let mut turns = 0;
    let refusal = loop {
        let r = exec(&mut c, exec_req(&id, &chunk)).await;
        if r.code() != Code::Ok {
            break r;
        }
        turns += 1;
        assert!(turns < 10, "the history never hit its limit");
    };
    assert_eq!(
        refusal.code(),
        Code::FailedPrecondition,
        "{:?}",
        refusal.end
    );
    let message = refusal.end.unwrap().message().to_owned();
    assert!(message.contains("fork the session"), "{message}");
    let head = n.replay(&id).await;
    // Small turns still fit, and the log still replays and verifies.
    let r = exec(&mut c, exec_req(&id, "small")).await;
    assert_eq!(r.code(), Code::Ok, "{:?}", r.end);
    assert_eq!(r.outputs(), ["echo:small"]);
    verify_chain(&n.replay(&id).await).unwrap();
    // A fork before the big turns carries on with room to spare.
    let child = c
        .fork(ForkRequest {
            session: id.clone(),
            at_seq: before.last().unwrap().seq,
            count: 1,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .children;
    let r = exec(&mut c, exec_req(&uid(&child[0]), &chunk)).await;
    assert_eq!(r.code(), Code::Ok, "{:?}", r.end);
    assert!(head.len() > before.len());
}

/// Issue (crash consistency, disk pressure): below the node's free-space reserve, new work
/// that writes (a session, a suspend's snapshot, a fork) is refused with RESOURCE_EXHAUSTED
/// naming the directory, and changes nothing; sessions already running keep taking turns.
#[tokio::test]
async fn below_the_disk_reserve_new_work_is_refused_and_running_sessions_go_on() {
    let n = start().await;
    let id = uid(&n.create("echo").await);
    assert_eq!(
        exec(&mut n.c(), exec_req(&id, "one")).await.code(),
        Code::Ok
    );
    // More free space than any disk has.
    let n = n.restart(|cfg| cfg.min_free_disk_mib = u64::MAX).await;
    let mut c = n.c();
    let before = n.replay(&id).await;
    let refused = |code: Code, message: &str| {
        code == Code::ResourceExhausted
            && message.contains("state directory")
            && message.contains("--min-free-disk-mib")
    };
    let create = c
        .create_session(CreateSessionRequest {
            session: Some(Session {
                harness: "echo".into(),
                ..Default::default()
            }),
        })
        .await
        .unwrap_err();
    assert!(refused(create.code(), create.message()), "{create:?}");
    let implicit = exec(&mut c, exec_req("", "new")).await;
    let end = implicit.end.unwrap();
    assert!(refused(end.code(), end.message()), "{end:?}");
    let fork = c
        .fork(ForkRequest {
            session: id.clone(),
            count: 1,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert!(refused(fork.code(), fork.message()), "{fork:?}");
    assert_eq!(n.replay(&id).await, before, "refusals changed nothing");
    let listed = c
        .list_sessions(ListSessionsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .sessions;
    assert_eq!(listed.len(), 1, "no session was created");
    // The running session goes on.
    let r = exec(&mut c, exec_req(&id, "two")).await;
    assert_eq!(r.code(), Code::Ok, "{:?}", r.end);
    let suspend = c
        .suspend(SuspendRequest {
            session: id.clone(),
        })
        .await
        .unwrap_err();
    assert!(refused(suspend.code(), suspend.message()), "{suspend:?}");
}

/// A small filesystem mounted for one test, unmounted when dropped.
struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    fn mount(at: &std::path::Path, size: &str) -> Result<Tmpfs, String> {
        std::fs::create_dir_all(at).unwrap();
        let out = std::process::Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0700"),
                "tmpfs",
            ])
            .arg(at)
            .output()
            .map_err(|e| format!("mount: {e}"))?;
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).trim().to_owned());
        }
        Ok(Tmpfs(at.to_owned()))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

/// Issue: a full disk gave INTERNAL ("database or disk is full"). It is RESOURCE_EXHAUSTED
/// naming the journal, nothing acknowledged is lost, and turns work again once there is room.
#[tokio::test]
async fn a_full_journal_disk_is_resource_exhausted_and_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let _fs = match Tmpfs::mount(&dir.path().join("state"), "4m") {
        Ok(fs) => fs,
        Err(why) => {
            eprintln!("SKIPPED: cannot mount a small tmpfs here ({why}); this test needs root");
            return;
        }
    };
    let n = support::start_in(dir, |cfg| cfg.min_free_disk_mib = 0).await;
    let mut c = n.c();
    let id = uid(&n.create("echo").await);
    assert_eq!(exec(&mut c, exec_req(&id, "fits")).await.code(), Code::Ok);
    let filler = n.dir.join("state").join("filler");
    {
        use std::io::Write;
        let mut f = std::fs::File::create(&filler).unwrap();
        let block = vec![0xa5u8; 64 << 10];
        while f.write_all(&block).is_ok() {}
        let _ = f.sync_all();
    }
    // Each turn writes its records; until one does not fit. None may fail otherwise.
    let mut full = None;
    for i in 0..200 {
        let r = exec(&mut c, exec_req(&id, &"w".repeat(16 << 10))).await;
        match r.code() {
            Code::Ok => continue,
            Code::ResourceExhausted => {
                full = r.end;
                break;
            }
            other => panic!("turn {i} on a full disk: {other:?} {:?}", r.end),
        }
    }
    let full = full.expect("the disk never filled");
    assert!(full.message().contains("disk is full"), "{full:?}");
    let acknowledged = n.replay(&id).await;
    verify_chain(&acknowledged).unwrap();
    std::fs::remove_file(&filler).unwrap();
    let r = exec(&mut c, exec_req(&id, "room again")).await;
    assert_eq!(r.code(), Code::Ok, "{:?}", r.end);
    let after = n.replay(&id).await;
    assert_eq!(after[..acknowledged.len()], acknowledged[..]);
    verify_chain(&after).unwrap();
}

/// Upstream (fork_metadata_test.go): children never inherit the parent's identity, and a
/// ForkRequest carrying any identity, even an empty one, is refused with upstream's exact
/// message before the session is even looked up, changing nothing.
#[tokio::test]
async fn fork_children_have_no_identity_and_a_supplied_identity_is_refused_first() {
    let n = start().await;
    let mut c = n.c();
    let parent = c
        .create_session(CreateSessionRequest {
            session: Some(Session {
                harness: "echo".into(),
                identity: Some(IdentityRef {
                    principal: "agent://parent".into(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
        })
        .await
        .unwrap()
        .into_inner();
    let id = uid(&parent);
    assert_eq!(exec(&mut c, exec_req(&id, "hi")).await.code(), Code::Ok);
    let children = c
        .fork(ForkRequest {
            session: id.clone(),
            count: 2,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .children;
    for child in &children {
        assert!(child.identity.is_none(), "{child:?}");
        assert!(n.get(&uid(child)).await.identity.is_none());
    }
    let log = n.replay(&id).await;
    for target in [id.as_str(), "sess-does-not-exist", ""] {
        for identity in [
            IdentityRef {
                principal: "agent://do-not-leak".into(),
                ..Default::default()
            },
            IdentityRef::default(),
        ] {
            let err = c
                .fork(ForkRequest {
                    session: target.into(),
                    count: 2,
                    identity: Some(identity),
                    ..Default::default()
                })
                .await
                .unwrap_err();
            assert_eq!(err.code(), Code::InvalidArgument);
            assert_eq!(
                err.message(),
                "ForkRequest.identity is unsupported: per-child principals are not enforced"
            );
        }
    }
    assert_eq!(n.replay(&id).await, log, "the parent's log is unchanged");
}

/// A config the built-in `chat` cannot take (not JSON, not an object, an unknown key) is
/// INVALID_ARGUMENT naming the field, and changes nothing: no record on the session, no new
/// session for an Exec that names none (request fuzz seed 401050968944503328 found it
/// answering INTERNAL after journaling EXECUTION_START).
#[tokio::test]
async fn a_config_the_harness_cannot_take_is_refused_before_anything_is_written() {
    let n = start().await;
    let mut c = n.c();
    let id = uid(&n.create("chat").await);
    assert_eq!(exec(&mut c, exec_req(&id, "hi")).await.code(), Code::Ok);
    let log = n.replay(&id).await;
    let sessions = session_count(&mut c).await;
    for config in [&b"not json"[..], b"[1]", br#"{"modl": "echo"}"#] {
        for session in [id.as_str(), ""] {
            let mut req = exec_req(session, "again");
            req.config = config.to_vec();
            if session.is_empty() {
                req.harness = "chat".into();
            }
            let result = exec(&mut c, req).await;
            assert_eq!(
                result.code(),
                Code::InvalidArgument,
                "{config:?}: {result:?}"
            );
            assert!(
                result
                    .end
                    .as_ref()
                    .unwrap()
                    .message()
                    .starts_with("config:"),
                "{result:?}"
            );
            assert!(result.records().is_empty(), "{result:?}");
        }
    }
    assert_eq!(n.replay(&id).await, log, "the session's log is unchanged");
    assert_eq!(
        session_count(&mut c).await,
        sessions,
        "no session was created"
    );
    // A config it takes still runs.
    let mut req = exec_req(&id, "ok");
    req.config = br#"{"system_prompt": "be brief"}"#.to_vec();
    assert_eq!(exec(&mut c, req).await.code(), Code::Ok);
}

/// A per-turn switch between stateless harnesses is answered by the harness the turn names,
/// never by the compute still running the other one: `chat` sends the history to its model
/// (`echo` only the last input, so its model call hashes as a fresh session's would), and
/// EXECUTION_START names who answered.
#[tokio::test]
async fn a_turn_on_another_stateless_harness_is_answered_by_that_harness() {
    let n = start().await;
    let mut c = n.c();
    // (harness of the turn, the input hash of its model call)
    let turn = |result: &ExecResult| {
        assert_eq!(result.code(), Code::Ok, "{result:?}");
        let mut harness = None;
        let mut hash = None;
        for r in result.records() {
            match r.event.unwrap().body {
                Some(Body::ExecutionStart(s)) => harness = Some(s.harness),
                Some(Body::Model(call)) if hash.is_none() => hash = Some(call.input_hash),
                _ => {}
            }
        }
        (harness.unwrap(), hash.unwrap())
    };
    let id = uid(&n.create("echo").await);
    let fresh = uid(&n.create("echo").await);
    let (_, two_alone) = turn(&exec(&mut c, exec_req(&fresh, "two")).await);
    let (_, three_alone) = turn(&exec(&mut c, exec_req(&fresh, "three")).await);

    assert_eq!(turn(&exec(&mut c, exec_req(&id, "one")).await).0, "echo");
    let mut switched = exec_req(&id, "two");
    switched.harness = "chat".into();
    let (harness, hash) = turn(&exec(&mut c, switched).await);
    assert_eq!(harness, "chat");
    assert_ne!(hash, two_alone, "echo answered a turn journaled as chat's");
    // The next turn is the session's own harness's again.
    assert_eq!(
        turn(&exec(&mut c, exec_req(&id, "three")).await),
        ("echo".to_owned(), three_alone)
    );
}

/// Labels, annotations, origin, names and configs are bounded, each refused naming its
/// field before anything is written; a fork whose children together would outgrow one
/// response is refused before any child exists.
#[tokio::test]
async fn oversized_metadata_is_refused_before_anything_is_written() {
    use std::collections::HashMap;
    let n = start().await;
    let mut c = n.c();
    let big = "x".repeat(100 << 10);
    let with = |labels: HashMap<String, String>, annotations: HashMap<String, String>| {
        CreateSessionRequest {
            session: Some(Session {
                harness: "echo".into(),
                labels,
                annotations,
                ..Default::default()
            }),
        }
    };
    for (req, field) in [
        (
            with(HashMap::from([("k".into(), big.clone())]), HashMap::new()),
            "session.labels",
        ),
        (
            with(HashMap::new(), HashMap::from([("k".into(), big.clone())])),
            "session.annotations",
        ),
        (
            with(
                HashMap::from([("k".repeat(300), "v".into())]),
                HashMap::new(),
            ),
            "session.labels",
        ),
    ] {
        let err = c.create_session(req).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
        assert!(err.message().starts_with(field), "{err:?}");
    }
    assert_eq!(session_count(&mut c).await, 0, "nothing was created");

    // 40 KiB of annotations is allowed; 128 children of it would answer 5 MiB.
    let parent = uid(&c
        .create_session(with(
            HashMap::new(),
            HashMap::from([("note".into(), "y".repeat(40 << 10))]),
        ))
        .await
        .unwrap()
        .into_inner());
    assert_eq!(exec(&mut c, exec_req(&parent, "hi")).await.code(), Code::Ok);
    let err = c
        .fork(ForkRequest {
            session: parent.clone(),
            count: 128,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().starts_with("count:"), "{err:?}");
    assert_eq!(session_count(&mut c).await, 1, "no child was created");
    // A config over its limit.
    let mut req = exec_req(&parent, "again");
    req.config = vec![b' '; (256 << 10) + 1];
    let r = exec(&mut c, req).await;
    assert_eq!(r.code(), Code::InvalidArgument, "{r:?}");
}

/// A page of sessions ends before it outgrows one response (4 MiB by default), and the
/// pages together still list every session once.
#[tokio::test]
async fn a_page_of_large_sessions_stops_short_of_a_response_s_limit() {
    let n = start().await;
    let mut c = n.c();
    for _ in 0..60 {
        c.create_session(CreateSessionRequest {
            session: Some(Session {
                harness: "echo".into(),
                annotations: std::collections::HashMap::from([(
                    "note".into(),
                    "z".repeat(60 << 10),
                )]),
                ..Default::default()
            }),
        })
        .await
        .unwrap();
    }
    let mut seen = std::collections::HashSet::new();
    let mut token = String::new();
    let mut pages = 0;
    loop {
        let page = c
            .list_sessions(ListSessionsRequest {
                page_size: 500,
                page_token: token.clone(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        pages += 1;
        assert!(page.sessions.len() < 60 || pages > 1);
        for s in &page.sessions {
            assert!(seen.insert(uid(s)), "listed twice");
        }
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    assert_eq!((seen.len(), pages), (60, 2));
}

/// Upstream's Go SDK forks with `ForkOptions{}`, leaving `count` unset: one child, as
/// upstream's server takes it. A negative or too large count is still refused, changing
/// nothing.
/// Issue: a stateless session with 8 KiB turns stopped for good near turn 170 with
/// `HistoryTooLarge` (its Start would pass the 4 MiB a gRPC harness reads). The built-in echo
/// keeps its history (`incremental_history`, the SDK's cache in its process), so the host sends
/// its process only what is new, and a fresh process (after a suspend) the whole history in
/// pieces. The session goes on past 4 MiB, and after the suspend too.
#[tokio::test]
async fn a_stateless_session_goes_on_past_the_start_frame_cap() {
    let n = start().await;
    let mut c = n.c();
    let id = uid(&n.create("echo").await);
    let big = "y".repeat(8 << 10);
    let turns = 300; // ~16 KiB of events a turn: ~5 MiB of history at the end
    for i in 0..turns {
        let r = exec(&mut c, exec_req(&id, &big)).await;
        assert_eq!(r.code(), Code::Ok, "turn {i}: {:?}", r.end);
    }
    let history: usize = n
        .replay(&id)
        .await
        .iter()
        .map(|r| prost::Message::encoded_len(r.event.as_ref().unwrap()))
        .sum();
    assert!(history > 4 << 20, "the history is {history} bytes");
    c.suspend(SuspendRequest {
        session: id.clone(),
    })
    .await
    .unwrap();
    let r = exec(&mut c, exec_req(&id, "after the suspend")).await;
    assert_eq!(r.code(), Code::Ok, "{:?}", r.end);
    assert_eq!(r.outputs(), ["echo:after the suspend"]);
    verify_chain(&n.replay(&id).await).unwrap();
}

#[tokio::test]
async fn fork_with_count_unset_makes_one_child() {
    let n = start().await;
    let mut c = n.c();
    let id = uid(&n.create("echo").await);
    assert_eq!(exec(&mut c, exec_req(&id, "hi")).await.code(), Code::Ok);
    let children = c
        .fork(ForkRequest {
            session: id.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .children;
    assert_eq!(children.len(), 1);
    let log = n.replay(&id).await;
    for count in [-1, 129] {
        let err = c
            .fork(ForkRequest {
                session: id.clone(),
                count,
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{count}: {err:?}");
        assert!(err.message().contains("count"), "{err:?}");
    }
    assert_eq!(n.replay(&id).await, log, "the parent's log is unchanged");
}

/// Upstream keeps the harness SPI and the admin HarnessRegistry off its Sessions listener;
/// reflection there lists only what the listener serves.
#[tokio::test]
async fn reflection_on_the_sessions_listener_lists_only_its_own_services() {
    use tonic_reflection::pb::v1::{
        ServerReflectionRequest, server_reflection_client::ServerReflectionClient,
        server_reflection_request::MessageRequest, server_reflection_response::MessageResponse,
    };
    let n = start().await;
    let mut reflection = ServerReflectionClient::new(n.channel().await);
    let request = ServerReflectionRequest {
        message_request: Some(MessageRequest::ListServices(String::new())),
        ..Default::default()
    };
    let mut responses = reflection
        .server_reflection_info(tokio_stream::once(request))
        .await
        .unwrap()
        .into_inner();
    let Some(MessageResponse::ListServicesResponse(list)) =
        responses.message().await.unwrap().unwrap().message_response
    else {
        panic!("no ListServices answer");
    };
    let mut names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    names.sort();
    assert_eq!(
        names,
        [
            "agentsessions.v1.Sessions",
            "agentvm.node.v1.Node",
            "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection",
        ]
    );
    // Older grpcurl and grpc_cli ask the v1alpha service, and hear the same.
    use tonic_reflection::pb::v1alpha as alpha;
    let mut reflection =
        alpha::server_reflection_client::ServerReflectionClient::new(n.channel().await);
    let request = alpha::ServerReflectionRequest {
        message_request: Some(
            alpha::server_reflection_request::MessageRequest::ListServices(String::new()),
        ),
        ..Default::default()
    };
    let mut responses = reflection
        .server_reflection_info(tokio_stream::once(request))
        .await
        .unwrap()
        .into_inner();
    let Some(alpha::server_reflection_response::MessageResponse::ListServicesResponse(list)) =
        responses.message().await.unwrap().unwrap().message_response
    else {
        panic!("no v1alpha ListServices answer");
    };
    assert_eq!(list.service.len(), names.len());
}

/// gRPC health answers for the server and for each service by name, and says NOT_SERVING
/// for all of them once the node drains (a balancer then sends new work elsewhere).
#[tokio::test]
async fn health_answers_per_service_and_not_serving_once_the_node_drains() {
    use tonic_health::pb::{
        HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
    };
    let n = start().await;
    let mut health = HealthClient::new(n.channel().await);
    let services = ["", "agentsessions.v1.Sessions", "agentvm.node.v1.Node"];
    let status = |service: &str| HealthCheckRequest {
        service: service.to_owned(),
    };
    for service in services {
        let answer = health.check(status(service)).await.unwrap().into_inner();
        assert_eq!(answer.status(), ServingStatus::Serving, "{service:?}");
    }
    let unknown = health.check(status("no.such.Service")).await.unwrap_err();
    assert_eq!(unknown.code(), Code::NotFound);
    n.node.host.start_draining();
    for service in services {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        loop {
            let answer = health.check(status(service)).await.unwrap().into_inner();
            if answer.status() == ServingStatus::NotServing {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{service:?} still serving"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }
}

/// A registered harness that is not there: the turn fails UNAVAILABLE naming the address
/// (upstream's TestRemoteHarnessEndToEnd), nothing is journaled, and the session is usable
/// once the harness is up.
#[tokio::test]
async fn an_absent_remote_harness_is_unavailable_naming_its_address() {
    let n = start().await;
    let mut c = n.c();
    let socket = n.register_absent("absent");
    let id = uid(&n.create("absent").await);
    let r = exec(&mut c, exec_req(&id, "hi")).await;
    assert_eq!(r.code(), Code::Unavailable, "{:?}", r.end);
    let message = r.end.unwrap().message().to_owned();
    assert!(message.contains(&socket.display().to_string()), "{message}");
    assert!(n.replay(&id).await.is_empty(), "nothing journaled");
}

/// Forking a session whose registered harness is down is UNAVAILABLE naming the harness's
/// address, before anything is written (upstream refuses it so): no child exists.
#[tokio::test]
async fn a_fork_of_a_session_whose_harness_is_down_writes_nothing() {
    let n = start().await;
    let mut c = n.c();
    let socket = n.register_absent("absent");
    let id = uid(&n.create("absent").await);
    let err = c
        .fork(ForkRequest {
            session: id.clone(),
            count: 2,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert!(
        err.message().contains(&socket.display().to_string()),
        "{err:?}"
    );
    assert_eq!(session_count(&mut c).await, 1, "no child");
    assert!(n.replay(&id).await.is_empty());
}

/// Upstream's Resume re-drives an interrupted turn and then appends RESUME, whether or not
/// the session was cold (semantics.md, Resume step 6): the log ends `END, LIFECYCLE(RESUME)`.
#[tokio::test]
async fn resuming_an_interrupted_turn_ends_with_end_then_resume() {
    use agentvm_proto::v1::{Event, ExecutionStart, lifecycle::Kind as LifecycleKind};
    let n = start().await;
    let mut c = n.c();
    let id = uid(&n.create("echo").await);
    // What a daemon that died mid-turn leaves: EXECUTION_START and INPUT, no END.
    let event = |kind: EventKind, body: Body| Event {
        execution_id: "interrupted".into(),
        kind: kind as i32,
        body: Some(body),
        ..Default::default()
    };
    let fence = n.node.journal.new_fence(&id).unwrap();
    n.node
        .journal
        .append(
            &id,
            0,
            fence,
            &[
                event(
                    EventKind::EventExecutionStart,
                    Body::ExecutionStart(ExecutionStart {
                        input_count: Some(1),
                        harness: "echo".into(),
                        ..Default::default()
                    }),
                ),
                event(EventKind::EventInput, Body::Message(text("user", "again"))),
            ],
        )
        .unwrap();
    c.resume(ResumeRequest {
        session: id.clone(),
        boot: false,
    })
    .await
    .unwrap();
    let records = n.replay(&id).await;
    assert_eq!(outputs(&records), ["echo:again"]);
    let tail: Vec<EventKind> = kinds(&records).into_iter().rev().take(2).rev().collect();
    assert_eq!(tail, [EventKind::EventEnd, EventKind::EventLifecycle]);
    let Some(Body::Lifecycle(l)) = records.last().unwrap().event.as_ref().unwrap().body.clone()
    else {
        panic!("no lifecycle record last");
    };
    assert_eq!(l.kind, LifecycleKind::LifecycleResume as i32);
    verify_chain(&records).unwrap();
}

/// Upstream's approval routing tests: an inputless Exec that recovers a decided approval
/// runs on the route the execution recorded, even when the request names another harness
/// (recovery ignores the request's harness, config and cursor).
#[tokio::test]
async fn inputless_approval_recovery_keeps_the_recorded_route() {
    let n = start().await;
    n.register("approver", Arc::new(Approver));
    let mut c = n.c();
    let id = uid(&n.create("approver").await);
    let r = exec(&mut c, exec_req(&id, "deploy it")).await;
    assert_eq!(r.code(), Code::Ok, "{:?}", r.end);
    let pending = r.sessions().pop().unwrap().pending_approval.unwrap();
    let elsewhere = || ExecRequest {
        session: id.clone(),
        harness: "echo".into(),
        ..Default::default()
    };
    // Still pending: the same Session back, nothing written.
    let head = n.get(&id).await.last_seq;
    let waiting = exec(&mut c, elsewhere()).await;
    assert_eq!(waiting.code(), Code::Ok, "{:?}", waiting.end);
    assert_eq!(n.get(&id).await.last_seq, head);
    c.approve(approval_of(&id, &pending, false)).await.unwrap();
    // Decided: the recovery runs on the recorded harness, not on `echo`.
    let recovered = exec(&mut c, elsewhere()).await;
    assert_eq!(recovered.code(), Code::Ok, "{:?}", recovered.end);
    let records = n.replay(&id).await;
    assert_eq!(outputs(&records), ["refused"]);
    verify_chain(&records).unwrap();
}
