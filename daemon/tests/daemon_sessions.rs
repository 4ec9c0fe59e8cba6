//! The real agentvmd binary with the `agentvm` CLI: sessions through the command line, and a
//! kill -9 in the middle of a turn (every committed record survives; Exec with no inputs
//! completes the turn after restart).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use agentvm_harnesses::sdk::{Execution, Harness, HarnessFailure, Sink};
use agentvm_harnesses::server::GrpcHarness;
use agentvm_proto::v1::harness_registry_client::HarnessRegistryClient;
use agentvm_proto::v1::sessions_client::SessionsClient;
use agentvm_proto::v1::{
    CreateSessionRequest, EventKind, ExecRequest, GetSessionRequest, HarnessDescriptor,
    HarnessSpec, Message, Part, RegisterHarnessRequest, RemotePlacement, ReplayRequest, Session,
    TextPart, exec_update::Update, harness_spec::Placement, part,
};
use agentvmd::config::ListenAddr;
use agentvmd::journal::verify::verify_chain;
use tokio::sync::Semaphore;

struct Daemon {
    child: Child,
    api: PathBuf,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_daemon(dir: &Path) -> Daemon {
    start_daemon_with(dir, &[])
}

fn start_daemon_with(dir: &Path, extra: &[&str]) -> Daemon {
    let api = dir.join("run/api.sock");
    let admin = dir.join("run/admin.sock");
    let _ = std::fs::remove_file(&api);
    let _ = std::fs::remove_file(&admin);
    let child = Command::new(env!("CARGO_BIN_EXE_agentvmd"))
        .arg("--state-dir")
        .arg(dir.join("state"))
        .arg("--listen")
        .arg(format!("unix:{}", api.display()))
        .arg("--admin-listen")
        .arg(format!("unix:{}", admin.display()))
        .arg("--harness-bin")
        .arg(env!("CARGO_BIN_EXE_agentvm"))
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !(api.exists() && admin.exists()) {
        assert!(Instant::now() < deadline, "agentvmd sockets never appeared");
        std::thread::sleep(Duration::from_millis(20));
    }
    Daemon { child, api }
}

fn cli(d: &Daemon, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_agentvm"))
        .arg("--addr")
        .arg(format!("unix:{}", d.api.display()))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn cli_create_exec_replay_fork_verify() {
    let dir = tempfile::tempdir().unwrap();
    let d = start_daemon(dir.path());
    let (ok, out, err) = cli(
        &d,
        &["--json", "create", "--harness", "echo", "--label", "a=b"],
    );
    assert!(ok, "{err}");
    let created: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let uid = created["metadata"]["uid"].as_str().unwrap().to_owned();
    assert_eq!(created["labels"]["a"], "b");

    let (ok, out, err) = cli(&d, &["exec", "--session", &uid, "-i", "hello"]);
    assert!(ok, "{err}");
    assert!(out.contains("echo:hello"), "{out}");
    assert!(
        out.contains("EXECUTION_START") && out.contains("COMPLETED"),
        "{out}"
    );

    let (ok, out, _) = cli(&d, &["--json", "replay", &uid]);
    assert!(ok);
    assert_eq!(out.lines().count(), 5);
    let (ok, out, err) = cli(&d, &["fork", &uid, "--count", "2"]);
    assert!(ok, "{err}");
    assert_eq!(out.lines().count(), 2);
    assert!(out.contains(&format!("parent={uid}@5")), "{out}");
    let (ok, out, err) = cli(&d, &["verify", &uid]);
    assert!(ok, "{err}");
    assert!(out.contains("5 records, chain intact"), "{out}");
    let (ok, out, _) = cli(&d, &["suspend", &uid]);
    assert!(ok && out.contains("compute=COLD"), "{out}");
    let (ok, out, _) = cli(&d, &["resume", &uid]);
    assert!(ok && out.contains("compute=LIVE"), "{out}");
    let (ok, out, _) = cli(&d, &["list"]);
    assert!(ok && out.lines().count() == 3, "{out}");
    let (ok, _, err) = cli(&d, &["get", "sess-000000000000000000000000"]);
    assert!(!ok && err.contains("NotFound"), "{err}");
    let (ok, out, _) = cli(&d, &["delete", &uid]);
    assert!(ok && out.contains("compute=TERMINATED"), "{out}");
}

/// Echo that waits for a permit: lets the test kill the daemon mid-turn.
struct Gate {
    permits: Arc<Semaphore>,
    started: Arc<Semaphore>,
}

#[async_trait::async_trait]
impl Harness for Gate {
    fn descriptor(&self) -> HarnessDescriptor {
        agentvm_harnesses::echo::Echo.descriptor()
    }
    async fn run(&self, exec: &Execution, sink: &mut Sink) -> Result<(), HarnessFailure> {
        self.started.add_permits(1);
        self.permits
            .acquire()
            .await
            .map_err(|_| HarnessFailure::new("closed"))?
            .forget();
        agentvm_harnesses::echo::Echo.run(exec, sink).await
    }
}

fn text(t: &str) -> Message {
    Message {
        role: "user".into(),
        parts: vec![Part {
            part: Some(part::Part::Text(TextPart { text: t.into() })),
        }],
    }
}

async fn sessions(d: &Daemon) -> SessionsClient<tonic::transport::Channel> {
    SessionsClient::new(
        agentvmd::client::connect(&ListenAddr::Unix(d.api.clone()))
            .await
            .unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_during_a_turn_then_exec_without_inputs_completes_it() {
    let dir = tempfile::tempdir().unwrap();
    let gate = Arc::new(Gate {
        permits: Arc::new(Semaphore::new(0)),
        started: Arc::new(Semaphore::new(0)),
    });
    let harness_sock = dir.path().join("gate.sock");
    let listener = tokio::net::UnixListener::bind(&harness_sock).unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(GrpcHarness::new(gate.clone()).into_service())
            .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener)),
    );

    let mut daemon = start_daemon(dir.path());
    let mut admin = HarnessRegistryClient::new(
        agentvmd::client::connect(&ListenAddr::Unix(dir.path().join("run/admin.sock")))
            .await
            .unwrap(),
    );
    admin
        .register_harness(RegisterHarnessRequest {
            name: "gate".into(),
            spec: Some(HarnessSpec {
                placement: Some(Placement::Remote(RemotePlacement {
                    address: format!("unix://{}", harness_sock.display()),
                })),
                capabilities: gate.descriptor().capabilities,
                descriptor_id: String::new(),
            }),
        })
        .await
        .unwrap();
    let mut c = sessions(&daemon).await;
    let s = c
        .create_session(CreateSessionRequest {
            session: Some(Session {
                harness: "gate".into(),
                ..Default::default()
            }),
        })
        .await
        .unwrap()
        .into_inner();
    let uid = s.metadata.unwrap().uid;
    let mut stream = c
        .exec(ExecRequest {
            session: uid.clone(),
            inputs: vec![text("survive")],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let mut committed = Vec::new();
    while committed.len() < 2 {
        match stream.message().await.unwrap().unwrap().update {
            Some(Update::Record(r)) => committed.push(r),
            _ => continue,
        }
    }
    tokio::time::timeout(Duration::from_secs(10), gate.started.acquire())
        .await
        .unwrap()
        .unwrap()
        .forget();

    // SIGKILL: no shutdown path runs.
    daemon.child.kill().unwrap();
    daemon.child.wait().unwrap();
    drop(stream);
    let daemon = start_daemon(dir.path());
    let mut c = sessions(&daemon).await;
    let mut replay = c
        .replay(ReplayRequest {
            session: uid.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let mut after = Vec::new();
    while let Some(r) = replay.message().await.unwrap() {
        after.push(r);
    }
    assert_eq!(
        after, committed,
        "every committed record survived, byte for byte"
    );

    // One permit frees the run the dead daemon abandoned, the other the re-drive.
    gate.permits.add_permits(2);
    let mut stream = c
        .exec(ExecRequest {
            session: uid.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    while stream.message().await.unwrap().is_some() {}
    let mut replay = c
        .replay(ReplayRequest {
            session: uid.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let mut all = Vec::new();
    while let Some(r) = replay.message().await.unwrap() {
        all.push(r);
    }
    let kinds: Vec<i32> = all.iter().map(|r| r.event.as_ref().unwrap().kind).collect();
    assert_eq!(
        kinds,
        [
            EventKind::EventExecutionStart as i32,
            EventKind::EventInput as i32,
            EventKind::EventModelCall as i32,
            EventKind::EventOutput as i32,
            EventKind::EventEnd as i32
        ]
    );
    assert_eq!(
        all[0].event.as_ref().unwrap().execution_id,
        all[4].event.as_ref().unwrap().execution_id,
        "the interrupted execution was completed, not a new one started"
    );
    verify_chain(&all).unwrap();
    let s = c
        .get_session(GetSessionRequest { uid })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(s.last_seq, 5);
}

#[test]
fn node_status_reports_what_a_scheduler_needs() {
    let dir = tempfile::tempdir().unwrap();
    let d = start_daemon(dir.path());
    let (ok, _, err) = cli(&d, &["create", "--harness", "echo"]);
    assert!(ok, "{err}");
    let (ok, out, err) = cli(&d, &["--json", "node", "status"]);
    assert!(ok, "{err}");
    let s: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(s["agentvmd_version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(s["sessions"], "1", "uint64 is a string in proto3 JSON: {s}");
    assert!(s["cpus"].as_u64().unwrap() >= 1);
    assert!(
        s["memory_available_bytes"]
            .as_str()
            .unwrap()
            .parse::<u64>()
            .unwrap()
            > 0
    );
    let kvm = s["kvm_flavour"].as_str().unwrap();
    assert!(
        ["vmx", "svm", "pvm", "none", "unknown"].contains(&kvm),
        "{kvm}"
    );
    let harnesses: Vec<&str> = s["harnesses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h.as_str().unwrap())
        .collect();
    assert!(harnesses.contains(&"echo"), "{harnesses:?}");
    let has_microvm = s["microvm_unavailable"].as_str().unwrap_or("").is_empty();
    let isolation: Vec<&str> = s["vmm_isolation"]
        .as_array()
        .map(|a| a.iter().map(|v| v.as_str().unwrap()).collect())
        .unwrap_or_default();
    // SAFETY: geteuid cannot fail.
    if has_microvm && unsafe { libc::geteuid() } == 0 {
        for expected in ["jail", "seccomp"] {
            assert!(isolation.contains(&expected), "{s}");
        }
    } else {
        eprintln!("vmm_isolation not checked: no microvm runtime or not root");
    }
    // Human output too.
    let (ok, out, _) = cli(&d, &["node", "status"]);
    assert!(ok && out.contains("sessions    1"), "{out}");
    if has_microvm {
        assert!(out.contains("isolation   "), "{out}");
    }
}

#[test]
fn shutdown_policy_suspend_suspends_running_sessions() {
    let dir = tempfile::tempdir().unwrap();
    let mut d = start_daemon_with(dir.path(), &["--shutdown-policy", "suspend"]);
    let (ok, out, err) = cli(&d, &["--json", "create", "--harness", "echo"]);
    assert!(ok, "{err}");
    let created: serde_json::Value = serde_json::from_str(out.lines().next().unwrap()).unwrap();
    let uid = created["metadata"]["uid"].as_str().unwrap().to_owned();
    let (ok, _, err) = cli(&d, &["exec", "--session", &uid, "-i", "hello"]);
    assert!(ok, "{err}");
    let (_, out, _) = cli(&d, &["--json", "get", &uid]);
    assert!(out.contains("COMPUTE_LIVE"), "{out}");
    // SAFETY: kill(2) on our own child's pid with a valid signal number.
    assert_eq!(unsafe { libc::kill(d.child.id() as i32, libc::SIGTERM) }, 0);
    assert!(d.child.wait().unwrap().success());
    drop(d);
    let d = start_daemon(dir.path());
    let (ok, out, err) = cli(&d, &["--json", "get", &uid]);
    assert!(ok, "{err}");
    assert!(out.contains("COMPUTE_COLD"), "{out}");
    let (ok, out, _) = cli(&d, &["exec", "--session", &uid, "-i", "after"]);
    assert!(ok && out.contains("echo:after"), "{out}");
}
