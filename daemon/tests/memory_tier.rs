//! Memory-tier scenarios ([MEM], [FORK], [SUSP] of semantics.md §6) through the Sessions API,
//! against a runtime test double that keeps each session's counter "in RAM" and snapshots,
//! restores and forks it. They prove the host's side of the memory tier — SUSPEND refs, restore
//! on Resume and on Exec, one checkpoint shared by a fork fan-out, children attached rather
//! than cold-booted, historical forks refused — independent of the backend. The same scenarios
//! on real microVMs (the `microvm` runtime and the test guest) belong to the microVM runtime
//! issue.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Semaphore;

use agentvm_harnesses::sdk::{Execution, Harness, HarnessFailure, Sink};
use agentvm_proto::v1::sessions_client::SessionsClient;
use agentvm_proto::v1::{
    Capabilities, ComputeState, CreateSessionRequest, EventKind, ExecRequest, ForkRequest,
    HarnessDescriptor, LogRecord, Mediation, Message, Part, ReplayRequest, Resumability,
    ResumeRequest, RuntimeCapabilities, Session, SnapshotRef, SuspendRequest, TextPart, ToolCall,
    event::Body, exec_update::Update, lifecycle::Kind as LifecycleKind, part,
};
use agentvmd::config::ListenAddr;
use agentvmd::controller::Controller;
use agentvmd::controller::endpoint::{HarnessEndpoint, InProcessEndpoint};
use agentvmd::journal::sqlite::{Durability, SqliteJournal};
use agentvmd::journal::verify::verify_chain;
use agentvmd::model::provider::EchoProvider;
use agentvmd::registry::store::RegistryStore;
use agentvmd::registry::{Registry, builtin_harnesses};
use agentvmd::runtime::{
    ForkOpts, Incarnation, ObservedState, Runtime, RuntimeError, SessionSpec, SnapshotKind,
};
use agentvmd::session::SessionHost;
use tonic::Code;
use tonic::transport::Channel;

// ---------- the runtime test double ----------

/// Each live session has a counter cell (its "RAM"); a snapshot freezes the value under a
/// fresh URI; restore and fork start a new cell from it.
#[derive(Default)]
struct MemoryRuntime {
    live: Mutex<HashMap<String, Arc<AtomicU64>>>,
    snapshots: Mutex<HashMap<String, u64>>,
    next: AtomicU64,
    calls: Mutex<Vec<String>>,
    pause: Arc<PausePoint>,
    /// What each counter Start carried: its session, `history_after_seq` and the kinds of
    /// its history.
    starts: Arc<Mutex<Vec<SeenStart>>>,
}

#[derive(Debug, Clone, PartialEq)]
struct SeenStart {
    session: String,
    after: i64,
    history: Vec<EventKind>,
}

/// Where a test holds the next runtime operation or harness run once armed, so other calls
/// can be made to overlap it.
struct PausePoint {
    armed: Mutex<bool>,
    entered: Semaphore,
    release: Semaphore,
}

impl Default for PausePoint {
    fn default() -> Self {
        PausePoint {
            armed: Mutex::new(false),
            entered: Semaphore::new(0),
            release: Semaphore::new(0),
        }
    }
}

impl PausePoint {
    fn arm(&self) {
        *self.armed.lock().unwrap() = true;
    }
    async fn pass(&self) {
        let armed = std::mem::take(&mut *self.armed.lock().unwrap());
        if armed {
            self.entered.add_permits(1);
            self.release.acquire().await.unwrap().forget();
        }
    }
    async fn entered(&self) {
        tokio::time::timeout(Duration::from_secs(10), self.entered.acquire())
            .await
            .expect("the paused operation never started")
            .unwrap()
            .forget();
    }
    fn release(&self) {
        self.release.add_permits(1);
    }
}

impl MemoryRuntime {
    fn log(&self, call: &str) {
        self.calls.lock().unwrap().push(call.to_owned());
    }
    fn incarnation(uid: &str, harness: &str) -> Incarnation {
        Incarnation {
            id: uid.to_owned(),
            worker: "mem".into(),
            address: harness.to_owned(),
            runtime: "memory-test".into(),
            fence_token: 0,
        }
    }
    fn snapshot_value(&self, r: &SnapshotRef) -> Result<u64, RuntimeError> {
        self.snapshots
            .lock()
            .unwrap()
            .get(&r.external_uri)
            .copied()
            .ok_or_else(|| RuntimeError::Failed {
                runtime: "memory-test",
                session: r.local.clone(),
                reason: format!("no snapshot {:?}", r.external_uri),
            })
    }
}

#[async_trait::async_trait]
impl Runtime for MemoryRuntime {
    fn name(&self) -> &'static str {
        "memory-test"
    }
    fn capabilities(&self) -> RuntimeCapabilities {
        RuntimeCapabilities {
            memory_snapshot: true,
            cow_fork: true,
            ..Default::default()
        }
    }
    async fn create(&self, spec: &SessionSpec) -> agentvmd::runtime::Result<Incarnation> {
        self.log("create");
        self.pause.pass().await;
        self.live
            .lock()
            .unwrap()
            .entry(spec.session_uid.clone())
            .or_default();
        Ok(Self::incarnation(&spec.session_uid, &spec.harness))
    }
    async fn snapshot(
        &self,
        inc: &Incarnation,
        kind: SnapshotKind,
    ) -> agentvmd::runtime::Result<SnapshotRef> {
        assert_eq!(kind, SnapshotKind::External);
        self.log("snapshot");
        self.pause.pass().await;
        let cell = self
            .live
            .lock()
            .unwrap()
            .remove(&inc.id)
            .unwrap_or_default();
        let uri = format!(
            "mem://{}/{}",
            inc.id,
            self.next.fetch_add(1, Ordering::SeqCst)
        );
        self.snapshots
            .lock()
            .unwrap()
            .insert(uri.clone(), cell.load(Ordering::SeqCst));
        Ok(SnapshotRef {
            local: inc.id.clone(),
            external_uri: uri,
            memory: true,
            sealed: false,
        })
    }
    async fn restore(
        &self,
        r: &SnapshotRef,
        spec: &SessionSpec,
    ) -> agentvmd::runtime::Result<Incarnation> {
        self.log("restore");
        self.pause.pass().await;
        let v = self.snapshot_value(r)?;
        self.live
            .lock()
            .unwrap()
            .insert(spec.session_uid.clone(), Arc::new(AtomicU64::new(v)));
        Ok(Self::incarnation(&spec.session_uid, &spec.harness))
    }
    async fn fork(
        &self,
        r: &SnapshotRef,
        opts: &ForkOpts,
    ) -> agentvmd::runtime::Result<Option<Incarnation>> {
        self.log("fork");
        let v = self.snapshot_value(r)?;
        self.live
            .lock()
            .unwrap()
            .insert(opts.child_session_uid.clone(), Arc::new(AtomicU64::new(v)));
        Ok(Some(Self::incarnation(
            &opts.child_session_uid,
            &opts.spec.harness,
        )))
    }
    async fn stop(&self, inc: &Incarnation) -> agentvmd::runtime::Result<()> {
        self.log("stop");
        self.live.lock().unwrap().remove(&inc.id);
        Ok(())
    }
    async fn status(&self, inc: &Incarnation) -> agentvmd::runtime::Result<ObservedState> {
        Ok(if self.live.lock().unwrap().contains_key(&inc.id) {
            ObservedState::Live
        } else {
            ObservedState::Unknown
        })
    }
    async fn dial(&self, inc: &Incarnation) -> agentvmd::runtime::Result<Arc<dyn HarnessEndpoint>> {
        let cell = self
            .live
            .lock()
            .unwrap()
            .get(&inc.id)
            .cloned()
            .ok_or_else(|| RuntimeError::Failed {
                runtime: "memory-test",
                session: inc.id.clone(),
                reason: "not running".into(),
            })?;
        let pause = self.pause.clone();
        let harness: Arc<dyn Harness> = match inc.address.as_str() {
            "testguest" => Arc::new(GatedMemoryHarness),
            "echo" => Arc::new(PausingEcho { pause }),
            _ => Arc::new(CellCounter {
                cell,
                pause,
                starts: self.starts.clone(),
            }),
        };
        Ok(Arc::new(InProcessEndpoint::new(harness)))
    }
}

fn memory_caps() -> Option<Capabilities> {
    Some(Capabilities {
        resumability: Resumability::RequiresMemorySnapshot as i32,
        ..Default::default()
    })
}

/// Counter whose integer lives in the runtime's cell: only memory carries it.
struct CellCounter {
    cell: Arc<AtomicU64>,
    pause: Arc<PausePoint>,
    starts: Arc<Mutex<Vec<SeenStart>>>,
}

#[async_trait::async_trait]
impl Harness for CellCounter {
    fn descriptor(&self) -> HarnessDescriptor {
        HarnessDescriptor {
            id: "counter".into(),
            version: "1".into(),
            capabilities: memory_caps(),
            ..Default::default()
        }
    }
    async fn run(&self, exec: &Execution, sink: &mut Sink) -> Result<(), HarnessFailure> {
        self.starts.lock().unwrap().push(SeenStart {
            session: exec.session.clone(),
            after: exec.start.history_after_seq,
            history: exec
                .start
                .history
                .iter()
                .map(|e| EventKind::try_from(e.kind).unwrap())
                .collect(),
        });
        self.pause.pass().await;
        let n = self.cell.fetch_add(1, Ordering::SeqCst) + 1;
        sink.output(Message {
            role: "assistant".into(),
            parts: vec![Part {
                part: Some(part::Part::Text(TextPart {
                    text: n.to_string(),
                })),
            }],
        })
        .await?;
        Ok(())
    }
}

/// The echo harness (STATELESS_REPLAY) on this runtime, pausable like the rest.
struct PausingEcho {
    pause: Arc<PausePoint>,
}

#[async_trait::async_trait]
impl Harness for PausingEcho {
    fn descriptor(&self) -> HarnessDescriptor {
        agentvm_harnesses::echo::Echo.descriptor()
    }
    async fn run(&self, exec: &Execution, sink: &mut Sink) -> Result<(), HarnessFailure> {
        self.pause.pass().await;
        agentvm_harnesses::echo::Echo.run(exec, sink).await
    }
}

/// A memory-tier harness that asks for an approval gate (which it cannot have).
struct GatedMemoryHarness;

#[async_trait::async_trait]
impl Harness for GatedMemoryHarness {
    fn descriptor(&self) -> HarnessDescriptor {
        HarnessDescriptor {
            id: "testguest".into(),
            version: "1".into(),
            capabilities: memory_caps(),
            ..Default::default()
        }
    }
    async fn run(&self, _exec: &Execution, sink: &mut Sink) -> Result<(), HarnessFailure> {
        sink.tool_call(ToolCall {
            id: "c1".into(),
            tool: "deploy".into(),
            args: None,
            mediation: Mediation::RequiresApproval as i32,
            idempotency_key: "k".into(),
        })
        .await?;
        Ok(())
    }
}

// ---------- fixture ----------

struct Node {
    _dir: tempfile::TempDir,
    runtime: Arc<MemoryRuntime>,
    client: SessionsClient<Channel>,
}

async fn start() -> Node {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("journal.db");
    let journal = Arc::new(SqliteJournal::open(&db, Durability::Relaxed).unwrap());
    let registry = Arc::new(Registry::new(
        builtin_harnesses(|_, _| None),
        RegistryStore::open(&db).unwrap(),
    ));
    let controller = Arc::new(Controller::new(
        journal.clone(),
        Arc::new(EchoProvider),
        None,
    ));
    let runtime = Arc::new(MemoryRuntime::default());
    let runtimes: HashMap<String, Arc<dyn Runtime>> = ["counter", "echo", "testguest"]
        .into_iter()
        .map(|n| (n.to_owned(), runtime.clone() as Arc<dyn Runtime>))
        .collect();
    let host = Arc::new(SessionHost::new(journal, registry, controller, runtimes));
    let socket = dir.path().join("api.sock");
    let addr = ListenAddr::Unix(socket.clone());
    let routes = agentvmd::server::api_routes(host).await.unwrap();
    {
        let addr = addr.clone();
        tokio::spawn(async move {
            agentvmd::server::serve(&addr, routes, 0o600, std::future::pending())
                .await
                .unwrap()
        });
    }
    // Connectable, not just present (the file exists from bind(2), before listen(2)).
    while std::os::unix::net::UnixStream::connect(&socket).is_err() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let client = SessionsClient::new(agentvmd::client::connect(&addr).await.unwrap());
    Node {
        _dir: dir,
        runtime,
        client,
    }
}

impl Node {
    async fn create(&self, harness: &str) -> String {
        self.client
            .clone()
            .create_session(CreateSessionRequest {
                session: Some(Session {
                    harness: harness.into(),
                    ..Default::default()
                }),
            })
            .await
            .unwrap()
            .into_inner()
            .metadata
            .unwrap()
            .uid
    }

    /// One turn; the OUTPUT text or the error code.
    async fn turn(&self, uid: &str) -> Result<String, Code> {
        let mut stream = self
            .client
            .clone()
            .exec(ExecRequest {
                session: uid.into(),
                inputs: vec![Message {
                    role: "user".into(),
                    parts: vec![Part {
                        part: Some(part::Part::Text(TextPart { text: "+1".into() })),
                    }],
                }],
                ..Default::default()
            })
            .await
            .map_err(|s| s.code())?
            .into_inner();
        let mut out = None;
        loop {
            match stream.message().await {
                Ok(Some(u)) => {
                    if let Some(Update::Record(r)) = u.update
                        && let Some(Body::Message(m)) = &r.event.as_ref().unwrap().body
                        && m.role == "assistant"
                    {
                        out = Some(match &m.parts[0].part {
                            Some(part::Part::Text(t)) => t.text.clone(),
                            _ => String::new(),
                        });
                    }
                }
                Ok(None) => return out.ok_or(Code::Unknown),
                Err(s) => return Err(s.code()),
            }
        }
    }

    async fn replay(&self, uid: &str) -> Vec<LogRecord> {
        let mut s = self
            .client
            .clone()
            .replay(ReplayRequest {
                session: uid.into(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        let mut v = Vec::new();
        while let Some(r) = s.message().await.unwrap() {
            v.push(r);
        }
        v
    }

    async fn suspend(&self, uid: &str) -> Session {
        self.client
            .clone()
            .suspend(SuspendRequest {
                session: uid.into(),
            })
            .await
            .unwrap()
            .into_inner()
    }

    async fn resume(&self, uid: &str) -> Session {
        self.client
            .clone()
            .resume(ResumeRequest {
                session: uid.into(),
                boot: false,
            })
            .await
            .unwrap()
            .into_inner()
    }

    /// Exec (one turn), Suspend or Resume, reduced to its outcome.
    async fn op(&self, op: Op, uid: &str) -> Result<(), Code> {
        let mut c = self.client.clone();
        match op {
            Op::Exec => self.turn(uid).await.map(drop),
            Op::Suspend => c
                .suspend(SuspendRequest {
                    session: uid.into(),
                })
                .await
                .map(drop)
                .map_err(|s| s.code()),
            Op::Resume => c
                .resume(ResumeRequest {
                    session: uid.into(),
                    boot: false,
                })
                .await
                .map(drop)
                .map_err(|s| s.code()),
        }
    }

    fn calls(&self) -> Vec<String> {
        self.runtime.calls.lock().unwrap().clone()
    }
}

fn lifecycle(r: &LogRecord) -> Option<(LifecycleKind, agentvm_proto::v1::Lifecycle)> {
    match &r.event.as_ref()?.body {
        Some(Body::Lifecycle(l)) => Some((LifecycleKind::try_from(l.kind).ok()?, l.clone())),
        _ => None,
    }
}

fn kinds(records: &[LogRecord]) -> Vec<EventKind> {
    records
        .iter()
        .map(|r| EventKind::try_from(r.event.as_ref().unwrap().kind).unwrap())
        .collect()
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Op {
    Exec,
    Suspend,
    Resume,
}

// ---------- scenarios ----------

#[tokio::test]
async fn scenario_54_overlap_matrix() {
    let n = Arc::new(start().await);
    let independent = n.create("counter").await;
    for harness in ["counter", "echo"] {
        for outer in [Op::Exec, Op::Suspend, Op::Resume] {
            let case = format!("{harness} under {outer:?}");
            let uid = n.create(harness).await;
            n.turn(&uid).await.unwrap();
            if outer == Op::Resume {
                n.suspend(&uid).await;
            }
            n.runtime.pause.arm();
            let running = {
                let (n, uid) = (n.clone(), uid.clone());
                tokio::spawn(async move { n.op(outer, &uid).await })
            };
            n.runtime.pause.entered().await;
            let (records, calls) = (n.replay(&uid).await, n.calls().len());
            for overlap in [Op::Exec, Op::Suspend, Op::Resume] {
                // [VAR] Suspend preempts a turn or a resume instead (scenario 69).
                if overlap == Op::Suspend && outer != Op::Suspend {
                    continue;
                }
                assert_eq!(
                    n.op(overlap, &uid).await,
                    Err(Code::Aborted),
                    "{case}: {overlap:?}"
                );
            }
            assert_eq!(n.replay(&uid).await, records, "{case}: journal unchanged");
            assert_eq!(n.calls().len(), calls, "{case}: the actor is untouched");
            n.turn(&independent)
                .await
                .unwrap_or_else(|c| panic!("{case}: an independent session is refused: {c:?}"));
            n.runtime.pause.release();
            assert_eq!(running.await.unwrap(), Ok(()), "{case}");
            for retry in [Op::Exec, Op::Suspend, Op::Resume] {
                assert_eq!(n.op(retry, &uid).await, Ok(()), "{case}: {retry:?} after");
            }
            verify_chain(&n.replay(&uid).await).unwrap();
        }
    }
}

#[tokio::test]
async fn scenario_55_suspend_resume_keeps_the_snapshot_ref() {
    let n = start().await;
    let uid = n.create("counter").await;
    assert_eq!(n.turn(&uid).await, Ok("1".into()));
    let s = n.suspend(&uid).await;
    assert_eq!(s.compute_state, ComputeState::ComputeCold as i32);
    let records = n.replay(&uid).await;
    let (kind, l) = lifecycle(records.last().unwrap()).unwrap();
    assert_eq!(kind, LifecycleKind::LifecycleSuspend);
    assert_eq!(l.snapshot_local, uid);
    assert!(l.snapshot_memory && l.snapshot_external_uri.starts_with("mem://"));
    n.resume(&uid).await;
    assert_eq!(
        kinds(&n.replay(&uid).await),
        [
            EventKind::EventExecutionStart,
            EventKind::EventInput,
            EventKind::EventOutput,
            EventKind::EventEnd,
            EventKind::EventLifecycle,
            EventKind::EventLifecycle
        ]
    );
    assert_eq!(n.calls(), ["create", "snapshot", "restore"]);
}

#[tokio::test]
async fn scenario_56_suspend_then_exec_without_resume() {
    let n = start().await;
    let uid = n.create("counter").await;
    for want in ["1", "2"] {
        assert_eq!(n.turn(&uid).await, Ok(want.into()));
    }
    n.suspend(&uid).await;
    assert_eq!(n.turn(&uid).await, Ok("3".into()), "RAM state came back");
    let records = n.replay(&uid).await;
    let resumes = records
        .iter()
        .filter_map(lifecycle)
        .filter(|(k, _)| *k == LifecycleKind::LifecycleResume)
        .count();
    assert_eq!(resumes, 0, "Exec restores without a RESUME marker");
    assert_eq!(n.calls(), ["create", "snapshot", "restore"]);
    verify_chain(&records).unwrap();
}

#[tokio::test]
async fn scenario_75_memory_continuity_across_suspend_resume() {
    let n = start().await;
    let uid = n.create("counter").await;
    for want in ["1", "2", "3"] {
        assert_eq!(n.turn(&uid).await, Ok(want.into()));
    }
    let before = n.replay(&uid).await;
    let fence_before = before.last().unwrap().fence;
    n.suspend(&uid).await;
    let resumed = n.resume(&uid).await;
    assert_eq!(resumed.compute_state, ComputeState::ComputeLive as i32);
    // N+1: not 1 (state lost) and not 2N+1 (history applied again).
    assert_eq!(n.turn(&uid).await, Ok("4".into()));
    let records = n.replay(&uid).await;
    verify_chain(&records).unwrap();
    assert!(
        records.last().unwrap().fence > fence_before,
        "new fence after restore"
    );
}

/// A memory-tier harness is sent only what its compute does not hold: nothing more on a live
/// VM, the SUSPEND and RESUME after a restore, the FORK record on a fork child, so a turn's
/// Start does not grow with the session.
#[tokio::test]
async fn a_memory_tier_start_carries_only_what_the_vm_has_not_seen() {
    use EventKind::EventLifecycle as Lifecycle;
    let n = start().await;
    let uid = n.create("counter").await;
    for _ in 0..5 {
        n.turn(&uid).await.unwrap();
    }
    let starts = || n.runtime.starts.lock().unwrap().clone();
    let seen = starts();
    // Created fresh: the first turn gets the (empty) whole log; each later one, nothing.
    assert_eq!((seen[0].after, seen[0].history.len()), (0, 0));
    let turn_records = 4; // EXECUTION_START, INPUT, OUTPUT, END
    for (i, s) in seen.iter().enumerate().skip(1) {
        assert_eq!(s.after, i as i64 * turn_records, "turn {i}");
        assert!(s.history.is_empty(), "turn {i}: {:?}", s.history);
    }
    let head = n.replay(&uid).await.last().unwrap().seq;

    n.suspend(&uid).await;
    n.resume(&uid).await;
    assert_eq!(n.turn(&uid).await, Ok("6".into()));
    let after_restore = starts().last().unwrap().clone();
    assert_eq!(after_restore.after, head);
    assert_eq!(after_restore.history, [Lifecycle, Lifecycle]);

    let head = n.replay(&uid).await.last().unwrap().seq;
    let child = n
        .client
        .clone()
        .fork(ForkRequest {
            session: uid.clone(),
            count: 1,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .children[0]
        .metadata
        .clone()
        .unwrap()
        .uid;
    assert_eq!(n.turn(&child).await, Ok("7".into()));
    let in_child = starts().last().unwrap().clone();
    assert_eq!(in_child.session, child);
    assert_eq!(in_child.after, head);
    assert_eq!(
        in_child.history,
        [Lifecycle],
        "the child's FORK record only"
    );
    // The parent goes on from what it held: only its fork's lifecycle records are new.
    assert_eq!(n.turn(&uid).await, Ok("7".into()));
    let in_parent = starts().last().unwrap().clone();
    assert_eq!(in_parent.after, head);
    assert!(!in_parent.history.is_empty());
    assert!(
        in_parent.history.iter().all(|k| *k == Lifecycle),
        "{:?}",
        in_parent.history
    );
}

#[tokio::test]
async fn scenario_76_fan_out_from_one_memory_snapshot() {
    let n = start().await;
    let uid = n.create("counter").await;
    for _ in 0..3 {
        n.turn(&uid).await.unwrap();
    }
    let head = n.replay(&uid).await.len() as i64;
    let children = n
        .client
        .clone()
        .fork(ForkRequest {
            session: uid.clone(),
            count: 3,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .children;
    assert_eq!(children.len(), 3);
    let snapshots = n.calls().iter().filter(|c| *c == "snapshot").count();
    assert_eq!(snapshots, 1, "one checkpoint shared by all children");
    for child in &children {
        let cuid = child.metadata.as_ref().unwrap().uid.clone();
        assert_eq!(child.fork_seq, head);
        assert_eq!(n.turn(&cuid).await, Ok("4".into()));
        let records = n.replay(&cuid).await;
        verify_chain(&records).unwrap();
        assert!(records.len() as i64 > head + 1);
    }
    assert!(
        !n.calls()[4..].contains(&"create".to_owned()),
        "children attach to their clones, never cold-boot: {:?}",
        n.calls()
    );
    n.resume(&uid).await;
    assert_eq!(n.turn(&uid).await, Ok("4".into()));
}

#[tokio::test]
async fn scenario_77_historical_memory_fork_refused() {
    let n = start().await;
    let uid = n.create("counter").await;
    for _ in 0..3 {
        n.turn(&uid).await.unwrap();
    }
    let head = n.replay(&uid).await.len() as i64;
    let err = n
        .client
        .clone()
        .fork(ForkRequest {
            session: uid.clone(),
            count: 1,
            at_seq: head - 1,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert_eq!(n.replay(&uid).await.len() as i64, head, "no side effects");
    assert!(!n.calls().contains(&"snapshot".to_owned()));
    assert_eq!(n.turn(&uid).await, Ok("4".into()), "the parent continues");
}

#[tokio::test]
async fn scenario_78_concurrent_sessions_are_isolated() {
    let n = start().await;
    let a = n.create("counter").await;
    let b = n.create("counter").await;
    n.turn(&a).await.unwrap();
    n.turn(&a).await.unwrap();
    n.turn(&b).await.unwrap();
    let (ra, rb) = tokio::join!(n.turn(&a), n.turn(&b));
    assert_eq!((ra, rb), (Ok("3".into()), Ok("2".into())));
}

#[tokio::test]
async fn scenario_82_memory_harness_approval_refused() {
    let n = start().await;
    let uid = n.create("testguest").await;
    assert_eq!(n.turn(&uid).await, Err(Code::FailedPrecondition));
    let records = n.replay(&uid).await;
    assert_eq!(
        kinds(&records),
        [
            EventKind::EventExecutionStart,
            EventKind::EventInput,
            EventKind::EventError
        ]
    );
    assert!(
        !n.calls().contains(&"snapshot".to_owned()),
        "no park, no snapshot"
    );
}
