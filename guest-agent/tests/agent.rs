//! The guest agent over unix sockets, as the host sees it: in-process (with a recording
//! kernel) for the protocol, and as its own process supervising a real harness process.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use agentvm_guest::agent::Agent;
use agentvm_guest::bridge::{GrpcLink, HarnessLink};
use agentvm_guest::system::{RecordingSystem, SystemCall};
use agentvm_proto::guest::v1::envelope::Body;
use agentvm_proto::guest::v1::restored::Kind as RestoredKind;
use agentvm_proto::guest::v1::{
    DescribeHarness, HealthCheck, Hello, Identity, Network, Restored, Shutdown,
};
use agentvm_proto::v1::EventKind;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::io::AsyncWriteExt;
use tokio::net::UnixStream;

mod support;
use support::{HostConn, TIMEOUT, serve_harness};

/// Not a test: the harness process the agent supervises in these tests (this test binary
/// re-run with `--ignored --exact helper_harness_process`). Serves the reference harness
/// `$AGENTVM_HELPER_HARNESS` on `$AGENTVM_HARNESS_SOCKET`, writing its pid to
/// `$AGENTVM_HELPER_PIDFILE`.
#[test]
#[ignore = "run by the agent as its harness process"]
fn helper_harness_process() {
    let (Ok(name), Ok(socket)) = (
        std::env::var("AGENTVM_HELPER_HARNESS"),
        std::env::var("AGENTVM_HARNESS_SOCKET"),
    ) else {
        panic!("helper_harness_process runs only as a harness process")
    };
    if let Ok(pidfile) = std::env::var("AGENTVM_HELPER_PIDFILE") {
        std::fs::write(pidfile, std::process::id().to_string()).unwrap();
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let _ = std::fs::remove_file(&socket);
        let listener = tokio::net::UnixListener::bind(&socket).unwrap();
        let harness = agentvm_harnesses::builtin(&name).unwrap();
        tonic::transport::Server::builder()
            .add_service(agentvm_harnesses::server::GrpcHarness::new(harness).into_service())
            .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener))
            .await
            .unwrap();
    });
}

// ---------- in process ----------

/// A harness whose first connection is accepted and never answered (a connection stuck on
/// either side): the agent's Describe gives up on it and answers over a new one.
#[tokio::test]
async fn a_describe_unanswered_on_one_connection_is_answered_on_a_new_one() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("h.sock");
    let listener = tokio::net::UnixListener::bind(&socket).unwrap();
    let (stuck_tx, stuck_rx) = tokio::sync::oneshot::channel();
    let incoming = all_but_the_first(listener, stuck_tx);
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(
                agentvm_harnesses::server::GrpcHarness::new(
                    agentvm_harnesses::builtin("echo").unwrap(),
                )
                .into_service(),
            )
            .serve_with_incoming(incoming),
    );
    let link = GrpcLink::new(socket, None, Duration::from_secs(10))
        .with_first_attempt(Duration::from_millis(300));
    let started = std::time::Instant::now();
    let descriptor = tokio::time::timeout(TIMEOUT, link.describe())
        .await
        .expect("answered in time")
        .expect("answered");
    assert_eq!(descriptor.id, "echo");
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "the first try waited"
    );
    // The stuck connection really was the first one, and it is still held open.
    let _held = stuck_rx.await.unwrap();
}

/// The listener's connections, but for the first: that one is sent to `stuck` unserved.
fn all_but_the_first(
    listener: tokio::net::UnixListener,
    stuck: tokio::sync::oneshot::Sender<UnixStream>,
) -> tokio_stream::wrappers::ReceiverStream<std::io::Result<UnixStream>> {
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tokio::spawn(async move {
        let mut stuck = Some(stuck);
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            if let Some(stuck) = stuck.take() {
                let _ = stuck.send(stream);
                continue;
            }
            if tx.send(Ok(stream)).await.is_err() {
                return;
            }
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

fn in_process(socket: PathBuf, system: Arc<RecordingSystem>) -> Arc<Agent> {
    let link = Arc::new(GrpcLink::new(socket, None, Duration::from_millis(500)));
    Agent::new(
        system,
        link,
        None,
        Identity {
            session_uid: "sess-parent".into(),
            hostname: "parent".into(),
            ..Default::default()
        },
        1,
    )
}

fn connect(agent: &Arc<Agent>) -> HostConn<tokio::io::DuplexStream> {
    let (host, guest) = tokio::io::duplex(1 << 20);
    tokio::spawn(agent.clone().serve_connection(guest));
    HostConn::new(host)
}

#[tokio::test]
async fn restored_notice_reseeds_steps_the_clock_and_takes_the_identity() {
    let dir = tempfile::tempdir().unwrap();
    let system = Arc::new(RecordingSystem::default());
    let agent = in_process(serve_harness(dir.path(), "echo").await, system.clone());
    let mut host = connect(&agent);
    let ready = host.hello().await;
    assert_eq!((ready.boot_generation, ready.restore_generation), (1, 0));
    let notice = Restored {
        kind: RestoredKind::Forked as i32,
        entropy: vec![7; 32],
        wall_clock_unix_nanos: 1_796_000_000_123_456_789,
        identity: Some(Identity {
            session_uid: "sess-child".into(),
            hostname: "child-1".into(),
            vsock_cid: 9,
            vm_id: "vm-child".into(),
        }),
        generation: 1,
        network: Some(Network {
            address: "10.77.0.10".into(),
            prefix_len: 30,
            gateway: "10.77.0.9".into(),
            mac: "06:00:0a:4d:00:0a".into(),
        }),
    };
    match host.call(Body::Restored(notice.clone())).await {
        Body::RestoredAck(ack) => assert_eq!(ack.generation, 1),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        system.calls(),
        [
            SystemCall::Entropy(vec![7; 32]),
            SystemCall::WallClock(1_796_000_000_123_456_789),
            SystemCall::Hostname("child-1".into()),
            SystemCall::Network(notice.network.clone().unwrap()),
        ]
    );
    // A new connection sees the new identity and generation.
    let ready = connect(&agent).hello().await;
    assert_eq!(ready.restore_generation, 1);
    assert_eq!(ready.identity.unwrap().session_uid, "sess-child");
    // The same notice again is acknowledged without applying it twice.
    match host.call(Body::Restored(notice.clone())).await {
        Body::RestoredAck(ack) => assert_eq!(ack.generation, 1),
        other => panic!("{other:?}"),
    }
    assert_eq!(system.calls().len(), 4);
    // Bad notices are refused, naming the field, and change nothing.
    for (change, field) in [
        (
            Box::new(|n: &mut Restored| n.generation = 0) as Box<dyn Fn(&mut Restored)>,
            "generation",
        ),
        (Box::new(|n: &mut Restored| n.entropy.clear()), "entropy"),
        (
            Box::new(|n: &mut Restored| n.entropy = vec![1; 513]),
            "entropy",
        ),
        (Box::new(|n: &mut Restored| n.kind = 0), "kind"),
        (
            Box::new(|n: &mut Restored| {
                if let Some(net) = n.network.as_mut() {
                    net.mac = "ff:ff:ff:ff:ff:ff".into();
                }
            }),
            "network.mac",
        ),
    ] {
        let mut bad = notice.clone();
        bad.generation = 2;
        change(&mut bad);
        match host.call(Body::Restored(bad)).await {
            Body::Error(e) => assert!(e.message.contains(field), "{field}: {e:?}"),
            other => panic!("{field}: {other:?}"),
        }
    }
    assert_eq!(system.calls().len(), 4);
    assert_eq!(agent.restore_generation(), 1);
    // The connection is still good.
    assert!(matches!(
        host.call(Body::HealthCheck(HealthCheck {})).await,
        Body::HealthReport(_)
    ));
}

#[tokio::test]
async fn harness_frames_round_trip_to_the_reference_harnesses() {
    let dir = tempfile::tempdir().unwrap();
    let system = Arc::new(RecordingSystem::default());
    let echo = in_process(serve_harness(dir.path(), "echo").await, system.clone());
    let mut host = connect(&echo);
    host.hello().await;
    match host.call(Body::DescribeHarness(DescribeHarness {})).await {
        Body::HarnessDescriptor(d) => assert_eq!(d.id, "echo"),
        other => panic!("{other:?}"),
    }
    // The memory hook: stamped, then verified intact.
    for stamp in [5, 0] {
        let dirty = agentvm_proto::guest::v1::DirtyMemory {
            mebibytes: 1,
            stamp,
        };
        match host.call(Body::DirtyMemory(dirty)).await {
            Body::DirtyMemoryDone(done) => assert_eq!((done.pages, done.mismatched), (256, 0)),
            other => panic!("{other:?}"),
        }
    }
    let turn = host.execute(1, "0000000000000001", "hi").await;
    assert_eq!(turn.close, (0, String::new()), "{turn:?}");
    assert_eq!(
        turn.kinds,
        [EventKind::EventModelCall as i32, EventKind::EventEnd as i32]
    );
    // Two streams on one connection, interleaved by the agent, each complete.
    let (a, b) = {
        host.controller(1, start_frame("00000000000000a1", "one"))
            .await;
        host.controller(2, start_frame("00000000000000a2", "two"))
            .await;
        let mut closed = 0;
        let mut asked = Vec::new();
        while closed < 2 {
            let e = host.recv().await.unwrap();
            if let Some(Body::Harness(f)) = e.body {
                use agentvm_proto::guest::v1::harness_frame::Frame;
                match f.frame.unwrap() {
                    Frame::Event(ev) => {
                        if let Some(agentvm_proto::v1::event::Body::Model(call)) = ev.body {
                            asked.push(f.stream);
                            let eid = ev.execution_id.clone();
                            host.controller(f.stream, model_frame(&eid, &call.id)).await;
                        }
                    }
                    Frame::Close(c) => {
                        assert_eq!(c.code, 0, "{c:?}");
                        closed += 1;
                    }
                    Frame::Controller(_) => panic!(),
                }
            }
        }
        asked.sort();
        (asked[0], asked[1])
    };
    assert_eq!((a, b), (1, 2));

    // The chat harness asks the (host-mediated) model with the conversation so far.
    let chat = in_process(serve_harness(dir.path(), "chat").await, system.clone());
    let mut host = connect(&chat);
    host.hello().await;
    let turn = host.execute(5, "0000000000000005", "hello chat").await;
    assert_eq!(turn.close, (0, String::new()), "{turn:?}");
    assert!(
        turn.kinds.contains(&(EventKind::EventModelCall as i32)),
        "{turn:?}"
    );

    // The counter keeps its integer in the harness process between executions.
    let counter = in_process(serve_harness(dir.path(), "counter").await, system);
    let mut host = connect(&counter);
    host.hello().await;
    for (i, want) in ["1", "2", "3"].iter().enumerate() {
        let turn = host
            .execute(10 + i as u64, &format!("{:016x}", i + 1), "+1")
            .await;
        assert_eq!(turn.outputs, [*want], "{turn:?}");
    }
}

fn start_frame(execution_id: &str, input: &str) -> agentvm_proto::v1::ControllerFrame {
    agentvm_proto::v1::ControllerFrame {
        session: "sess-test".into(),
        execution_id: execution_id.into(),
        frame: Some(agentvm_proto::v1::controller_frame::Frame::Start(
            agentvm_proto::v1::Start {
                inputs: vec![support::text("user", input)],
                ..Default::default()
            },
        )),
    }
}

fn model_frame(execution_id: &str, call_id: &str) -> agentvm_proto::v1::ControllerFrame {
    agentvm_proto::v1::ControllerFrame {
        session: "sess-test".into(),
        execution_id: execution_id.into(),
        frame: Some(agentvm_proto::v1::controller_frame::Frame::Model(
            agentvm_proto::v1::ModelResult {
                message: Some(support::text("assistant", "ok")),
                usage: None,
                model_call_id: call_id.into(),
            },
        )),
    }
}

#[tokio::test]
async fn an_unreachable_harness_is_a_clear_error_not_a_hang() {
    let dir = tempfile::tempdir().unwrap();
    let agent = in_process(dir.path().join("nobody.sock"), Arc::default());
    let mut host = connect(&agent);
    host.hello().await;
    match host.call(Body::DescribeHarness(DescribeHarness {})).await {
        Body::Error(e) => {
            assert_eq!(e.code, tonic::Code::Unavailable as i32);
            assert!(e.message.contains("did not answer within"), "{e:?}");
        }
        other => panic!("{other:?}"),
    }
    let turn = host.execute(1, "0000000000000001", "hi").await;
    assert_eq!(turn.close.0, tonic::Code::Unavailable as i32, "{turn:?}");
}

// ---------- the agent process ----------

struct AgentProcess {
    child: Child,
    dir: tempfile::TempDir,
    socket: PathBuf,
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl AgentProcess {
    fn start(harness: &str, restart: &str, max_restarts: u32) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let exe = std::env::current_exe().unwrap();
        let config = format!(
            r#"
            [harness]
            command = [{exe:?}, "--ignored", "--exact", "helper_harness_process", "--nocapture"]
            env = {{ AGENTVM_HELPER_HARNESS = "{harness}", AGENTVM_HELPER_PIDFILE = {pidfile:?} }}
            resumability = "STATELESS_REPLAY"
            restart = "{restart}"
            max_restarts = {max_restarts}
            "#,
            exe = exe.display().to_string(),
            pidfile = dir.path().join("harness.pid").display().to_string(),
        );
        Self::with_config(dir, &config)
    }

    fn with_config(dir: tempfile::TempDir, config: &str) -> Self {
        std::fs::write(dir.path().join("image.toml"), config).unwrap();
        let socket = dir.path().join("agent.sock");
        let child = Command::new(env!("CARGO_BIN_EXE_agentvm-guest"))
            .arg("--config")
            .arg(dir.path().join("image.toml"))
            .arg("--listen")
            .arg(format!("unix:{}", socket.display()))
            .arg("--harness-socket")
            .arg(dir.path().join("harness.sock"))
            .arg("--system")
            .arg("log")
            .arg("--harness-ready-ms")
            .arg("10000")
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        AgentProcess { child, dir, socket }
    }

    async fn connect(&self) -> HostConn<UnixStream> {
        let deadline = std::time::Instant::now() + TIMEOUT;
        loop {
            match UnixStream::connect(&self.socket).await {
                Ok(s) => return HostConn::new(s),
                Err(e) => {
                    assert!(
                        std::time::Instant::now() < deadline,
                        "agent never listened: {e}"
                    );
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }
    }

    fn harness_pid(&self) -> Option<i32> {
        std::fs::read_to_string(self.dir.path().join("harness.pid"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// Waits for a harness pid other than `old`.
    async fn new_harness_pid(&self, old: Option<i32>) -> i32 {
        let deadline = std::time::Instant::now() + TIMEOUT;
        loop {
            if let Some(pid) = self.harness_pid().filter(|p| Some(*p) != old) {
                return pid;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no new harness started"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

fn alive(pid: i32) -> bool {
    // A zombie still answers kill(0); look at its state instead.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            !s.rsplit(')')
                .next()
                .unwrap_or("")
                .trim_start()
                .starts_with('Z')
        })
        .unwrap_or(false)
}

#[tokio::test]
async fn the_agent_process_runs_its_harness_and_serves_the_host() {
    let agent = AgentProcess::start("echo", "on-failure", 3);
    let mut host = agent.connect().await;
    let ready = host.hello().await;
    assert_eq!(ready.protocol_version, 1);
    assert!(ready.agent_version.starts_with("agentvm-guest"));
    match host.call(Body::DescribeHarness(DescribeHarness {})).await {
        Body::HarnessDescriptor(d) => assert_eq!(d.id, "echo"),
        other => panic!("{other:?}"),
    }
    let turn = host.execute(1, "0000000000000001", "hello").await;
    assert_eq!(turn.close, (0, String::new()));
    match host.call(Body::HealthCheck(HealthCheck {})).await {
        Body::HealthReport(h) => {
            assert!(h.harness_running);
            assert_eq!(h.harness_restarts, 0);
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_crashing_harness_is_restarted_per_policy_then_reported_down() {
    let agent = AgentProcess::start("echo", "on-failure", 1);
    let mut host = agent.connect().await;
    host.hello().await;
    assert!(matches!(
        host.call(Body::DescribeHarness(DescribeHarness {})).await,
        Body::HarnessDescriptor(_)
    ));
    let first = agent.new_harness_pid(None).await;
    let _ = kill(Pid::from_raw(first), Signal::SIGKILL);
    let second = agent.new_harness_pid(Some(first)).await;
    assert!(matches!(
        host.call(Body::DescribeHarness(DescribeHarness {})).await,
        Body::HarnessDescriptor(_)
    ));
    let _ = kill(Pid::from_raw(second), Signal::SIGKILL);
    let deadline = std::time::Instant::now() + TIMEOUT;
    let error = loop {
        match host.call(Body::DescribeHarness(DescribeHarness {})).await {
            // A Describe that meets the dying harness fails on its own (CANCELLED); the
            // supervisor's verdict names the policy.
            Body::Error(e) if e.message.contains("max_restarts") => break e,
            _ => {
                assert!(std::time::Instant::now() < deadline, "never reported down");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    assert_eq!(error.code, tonic::Code::Unavailable as i32);
    assert!(
        error.message.contains("killed by signal 9") && error.message.contains("max_restarts is 1"),
        "{error:?}"
    );
    match host.call(Body::HealthCheck(HealthCheck {})).await {
        Body::HealthReport(h) => assert_eq!((h.harness_running, h.harness_restarts), (false, 1)),
        other => panic!("{other:?}"),
    }
    let turn = host.execute(1, "0000000000000001", "hi").await;
    assert_eq!(turn.close.0, tonic::Code::Unavailable as i32, "{turn:?}");
}

#[tokio::test]
async fn a_harness_that_cannot_start_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let agent = AgentProcess::with_config(
        dir,
        r#"
        [harness]
        command = ["/nonexistent/harness"]
        resumability = "STATELESS_REPLAY"
        "#,
    );
    let mut host = agent.connect().await;
    let deadline = std::time::Instant::now() + TIMEOUT;
    loop {
        host.hello().await;
        match host.call(Body::DescribeHarness(DescribeHarness {})).await {
            Body::Error(e) if e.message.contains("harness is down") => {
                assert!(e.message.contains("/nonexistent/harness"), "{e:?}");
                break;
            }
            _ => {
                assert!(std::time::Instant::now() < deadline);
                host = agent.connect().await;
            }
        }
    }
}

#[tokio::test]
async fn hostile_frames_are_refused_and_the_agent_keeps_serving() {
    let agent = AgentProcess::start("echo", "on-failure", 3);
    let assert_refused = |host_bytes: Vec<u8>, why: &'static str| {
        let agent = &agent;
        async move {
            let mut host = agent.connect().await;
            host.stream.write_all(&host_bytes).await.unwrap();
            match host.recv().await {
                Some(e) => match e.body {
                    Some(Body::Error(err)) => assert!(!err.message.is_empty(), "{why}"),
                    other => panic!("{why}: {other:?}"),
                },
                None => panic!("{why}: closed without an error frame"),
            }
            assert!(
                host.recv().await.is_none(),
                "{why}: the connection stays open"
            );
        }
    };
    // A length prefix of 1 GiB.
    assert_refused(vec![0x80, 0x80, 0x80, 0x80, 0x04], "oversized").await;
    // A 5-byte frame of garbage protobuf.
    assert_refused(vec![5, 0xff, 0xff, 0xff, 0xff, 0xff], "garbage").await;
    // A frame before Hello, and a Hello of another protocol version.
    let frame = |body| {
        agentvm_proto::guest::framing::frame_bytes(&agentvm_proto::guest::v1::Envelope {
            id: 1,
            body: Some(body),
        })
    };
    assert_refused(frame(Body::HealthCheck(HealthCheck {})), "before hello").await;
    assert_refused(
        frame(Body::Hello(Hello {
            protocol_version: 99,
            host_version: String::new(),
        })),
        "version",
    )
    .await;
    // Random bytes in many shapes: whatever happens to each connection, the agent survives.
    let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
    for round in 0..200 {
        let mut host = agent.connect().await;
        let len = (round * 37) % 300;
        let bytes: Vec<u8> = (0..len)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                seed as u8
            })
            .collect();
        let _ = host.stream.write_all(&bytes).await;
        let _ = host.stream.shutdown().await;
        while host.recv().await.is_some() {}
    }
    let mut host = agent.connect().await;
    host.hello().await;
    let turn = host.execute(1, "0000000000000001", "still here").await;
    assert_eq!(turn.close, (0, String::new()));
}

#[tokio::test]
async fn shutdown_stops_the_harness_and_the_agent() {
    let mut agent = AgentProcess::start("echo", "always", 3);
    let mut host = agent.connect().await;
    host.hello().await;
    assert!(matches!(
        host.call(Body::DescribeHarness(DescribeHarness {})).await,
        Body::HarnessDescriptor(_)
    ));
    let harness = agent.new_harness_pid(None).await;
    host.send(Body::Shutdown(Shutdown {
        reason: "test".into(),
        grace_ms: 2000,
    }))
    .await;
    let deadline = std::time::Instant::now() + TIMEOUT;
    let status = loop {
        if let Some(status) = agent.child.try_wait().unwrap() {
            break status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the agent did not stop"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert!(status.success(), "{status:?}");
    assert!(!alive(harness), "the harness outlived the shutdown");
}
