//! The real agentvmd binary with the `agentvm` CLI: sessions through the command line, and a
//! kill -9 in the middle of a turn (every committed record survives; Exec with no inputs
//! completes the turn after restart).

mod support;

use support::daemon::{Daemon, cli, kvm_unavailable, start_daemon, start_daemon_with};

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use agentvm_harnesses::sdk::{Execution, Harness, HarnessFailure, Sink};
use agentvm_harnesses::server::GrpcHarness;
use agentvm_proto::v1::harness_registry_client::HarnessRegistryClient;
use agentvm_proto::v1::sessions_client::SessionsClient;
use agentvm_proto::v1::{
    CreateSessionRequest, EventKind, ExecRequest, GetSessionRequest, HarnessDescriptor,
    HarnessSpec, Message, Part, RegisterHarnessRequest, RemotePlacement, Session, TextPart,
    exec_update::Update, harness_spec::Placement, part,
};
use agentvmd::config::ListenAddr;
use agentvmd::journal::verify::verify_chain;
use tokio::sync::Semaphore;

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

impl Gate {
    /// Waits until a turn's run has begun (and is waiting for its permit).
    async fn started(&self) {
        tokio::time::timeout(Duration::from_secs(20), self.started.acquire())
            .await
            .expect("a turn reached the harness")
            .unwrap()
            .forget();
    }
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

/// The session's whole log.
async fn sessions(d: &Daemon) -> SessionsClient<tonic::transport::Channel> {
    SessionsClient::new(
        agentvmd::client::connect(&ListenAddr::Unix(d.api.clone()))
            .await
            .unwrap(),
    )
}

/// A daemon in `dir` with the harness `gate` registered: each turn's run waits for a permit
/// of the returned gate (and says it started).
async fn gated_daemon(dir: &Path) -> (Daemon, Arc<Gate>) {
    let gate = Arc::new(Gate {
        permits: Arc::new(Semaphore::new(0)),
        started: Arc::new(Semaphore::new(0)),
    });
    let harness_sock = dir.join("gate.sock");
    let listener = tokio::net::UnixListener::bind(&harness_sock).unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(GrpcHarness::new(gate.clone()).into_service())
            .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener)),
    );

    let daemon = start_daemon(dir);
    let mut admin = HarnessRegistryClient::new(
        agentvmd::client::connect(&ListenAddr::Unix(dir.join("run/admin.sock")))
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
    (daemon, gate)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_during_a_turn_then_exec_without_inputs_completes_it() {
    let dir = tempfile::tempdir().unwrap();
    let (mut daemon, gate) = gated_daemon(dir.path()).await;
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
    gate.started().await;

    // SIGKILL: no shutdown path runs.
    daemon.child.kill().unwrap();
    daemon.child.wait().unwrap();
    drop(stream);
    let daemon = start_daemon(dir.path());
    let mut c = sessions(&daemon).await;
    let after = support::replay(&mut c, &uid).await;
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
    let all = support::replay(&mut c, &uid).await;
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

/// The CLI streaming a turn when agentvmd is killed says the turn was interrupted and how
/// to re-drive it, not "Unknown: h2 protocol error".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_says_a_turn_was_interrupted_and_how_to_go_on() {
    let dir = tempfile::tempdir().unwrap();
    let (mut daemon, gate) = gated_daemon(dir.path()).await;
    let (ok, out, err) = cli(&daemon, &["create", "--harness", "gate", "-q"]);
    assert!(ok, "{err}");
    let uid = out.trim().to_owned();
    let turn = Command::new(env!("CARGO_BIN_EXE_agentvm"))
        .env("AGENTVM_ADDR", daemon.addr())
        .args(["exec", &uid, "-i", "survive"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    gate.started().await;
    daemon.child.kill().unwrap();
    daemon.child.wait().unwrap();
    let out = tokio::task::spawn_blocking(move || turn.wait_with_output().unwrap())
        .await
        .unwrap();
    // Frees the run the dead daemon abandoned.
    gate.permits.add_permits(1);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("the turn was interrupted")
            && stderr.contains(&format!("agentvm exec {uid}")),
        "{stderr}"
    );
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
    let bytes = |field: &str| s[field].as_str().unwrap_or("0").parse::<u64>().unwrap();
    assert!(bytes("state_dir_free_bytes") > 0, "{s}");
    assert_eq!(
        bytes("min_free_disk_bytes"),
        256 << 20,
        "the default reserve: {s}"
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
    if has_microvm && nix::unistd::geteuid().is_root() {
        for expected in ["jail", "seccomp"] {
            assert!(isolation.contains(&expected), "{s}");
        }
    } else {
        eprintln!("vmm_isolation not checked: no microvm runtime or not root");
    }
    // Human output too.
    let (ok, out, _) = cli(&d, &["node", "status"]);
    assert!(ok && out.contains("sessions    1"), "{out}");
    assert!(out.contains("running     0 here"), "{out}");
    assert!(out.contains("disk free   state "), "{out}");
    if has_microvm {
        assert!(out.contains("isolation   "), "{out}");
        // agentvm-vmm, the default flavour, maps snapshots copy-on-write.
        assert_eq!(s["vmm_restore"], "map-private", "{s}");
        assert!(out.contains("restore     map-private"), "{out}");
    }
    let status = || -> serde_json::Value {
        let (ok, out, err) = cli(&d, &["--json", "node", "status"]);
        assert!(ok, "{err}");
        serde_json::from_str(&out).unwrap()
    };
    let count = |s: &serde_json::Value, field: &str| -> u64 {
        s[field].as_str().unwrap_or("0").parse().unwrap()
    };
    let running = |s: &serde_json::Value, runtime: &str| -> u64 {
        s["running_sessions"][runtime]
            .as_str()
            .unwrap_or("0")
            .parse()
            .unwrap()
    };
    // A turn of the echo harness runs it as a process here.
    let (ok, out, err) = cli(&d, &["--json", "exec", "-i", "hi"]);
    assert!(ok, "{out}{err}");
    let s = status();
    assert_eq!(running(&s, "process"), 1, "{s}");
    assert_eq!(count(&s, "vmms"), 0, "{s}");
    if !has_microvm || kvm_unavailable().is_some() {
        eprintln!("VMM counts not checked: no microvm runtime or no usable /dev/kvm");
        return;
    }
    assert!(
        s["capacity_basis"]
            .as_str()
            .unwrap()
            .contains("no VMM has run here yet"),
        "{s}"
    );
    // A microVM session: its VMM is counted once, as the session running in it.
    let (ok, out, err) = cli(&d, &["--json", "create", "--harness", "testguest"]);
    assert!(ok, "{err}");
    let created: serde_json::Value = serde_json::from_str(out.lines().next().unwrap()).unwrap();
    let vm = created["metadata"]["uid"].as_str().unwrap().to_owned();
    let (ok, out, err) = cli(&d, &["exec", &vm, "-i", "tick"]);
    assert!(ok, "{out}{err}");
    let s = status();
    assert_eq!(running(&s, "microvm"), 1, "{s}");
    assert_eq!(count(&s, "vmms"), 1, "{s}");
    assert_eq!(count(&s, "vmms_without_session"), 0, "{s}");
    let basis = s["capacity_basis"].as_str().unwrap();
    assert!(basis.contains("the mean PSS of the 1 running VMMs"), "{s}");
    assert_eq!(
        count(&s, "capacity_sessions"),
        count(&s, "memory_available_bytes") / count(&s, "vmm_memory_bytes"),
        "{s}"
    );
    let (ok, out, _) = cli(&d, &["node", "status"]);
    assert!(
        ok && out.contains("running     2 here: 1 microvm, 1 process"),
        "{out}"
    );
    // Suspended, it runs nowhere; capacity keeps the footprint it measured.
    let (ok, out, err) = cli(&d, &["suspend", &vm]);
    assert!(ok, "{out}{err}");
    let s = status();
    assert_eq!(running(&s, "microvm"), 0, "{s}");
    assert_eq!(count(&s, "vmms"), 0, "{s}");
    assert!(
        s["capacity_basis"]
            .as_str()
            .unwrap()
            .contains("the 1 VMMs that ran here last"),
        "{s}"
    );
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
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(d.child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    assert!(d.child.wait().unwrap().success());
    drop(d);
    let d = start_daemon(dir.path());
    let (ok, out, err) = cli(&d, &["--json", "get", &uid]);
    assert!(ok, "{err}");
    assert!(out.contains("COMPUTE_COLD"), "{out}");
    let (ok, out, _) = cli(&d, &["exec", "--session", &uid, "-i", "after"]);
    assert!(ok && out.contains("echo:after"), "{out}");
}

// ---------- clients and harnesses on another gRPC stack (grpcio) ----------

/// A Python with grpcio and grpcio-tools (`scripts/setup.sh` makes `target/upstream-venv`),
/// and the agentsessions stubs generated into `stubs`; or why there is none.
fn grpcio_python(stubs: &Path) -> Result<PathBuf, String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let python = [
        root.join("target/upstream-venv/bin/python"),
        PathBuf::from("python3"),
    ]
    .into_iter()
    .find(|p| {
        Command::new(p)
            .args(["-c", "import grpc, grpc_tools"])
            .output()
            .is_ok_and(|o| o.status.success())
    })
    .ok_or("no Python with grpcio and grpcio-tools (scripts/setup.sh installs them)")?;
    let protos = root.join("proto/api");
    let out = Command::new(&python)
        .args(["-m", "grpc_tools.protoc", "-I"])
        .arg(&protos)
        .arg(format!("--python_out={}", stubs.display()))
        .arg(format!("--grpc_python_out={}", stubs.display()))
        .args(["common.proto", "harness.proto", "session.proto"])
        .output()
        .map_err(|e| e.to_string())?;
    assert!(
        out.status.success(),
        "grpc_tools.protoc: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(python)
}

/// A test directory with the stubs generated in it and the Python to run them, or `None`
/// after saying why the test is skipped.
fn grpcio_fixture() -> Option<(tempfile::TempDir, PathBuf, PathBuf)> {
    let dir = tempfile::tempdir().unwrap();
    let stubs = dir.path().join("stubs");
    std::fs::create_dir_all(&stubs).unwrap();
    match grpcio_python(&stubs) {
        Ok(python) => Some((dir, stubs, python)),
        Err(reason) => {
            eprintln!("SKIPPED: {reason}");
            None
        }
    }
}

fn upstream_script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/upstream")
        .join(name)
}

/// A harness process killed when the test ends.
struct Reaped(Child);
impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts the grpcio harness that reads Start before it answers, registered as `py`.
async fn register_read_first_harness(dir: &Path, python: &Path, stubs: &Path) -> Reaped {
    let sock = dir.join("py-harness.sock");
    let mut harness = Reaped(
        Command::new(python)
            .arg(upstream_script("read_first_harness.py"))
            .arg("--stubs")
            .arg(stubs)
            .arg("--listen")
            .arg(format!("unix:{}", sock.display()))
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut ready = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(harness.0.stdout.take().unwrap()),
        &mut ready,
    )
    .unwrap();
    assert_eq!(ready.trim(), "ready");
    let mut admin = HarnessRegistryClient::new(
        agentvmd::client::connect(&ListenAddr::Unix(dir.join("run/admin.sock")))
            .await
            .unwrap(),
    );
    admin
        .register_harness(RegisterHarnessRequest {
            name: "py".into(),
            spec: Some(HarnessSpec {
                placement: Some(Placement::Remote(RemotePlacement {
                    address: format!("unix://{}", sock.display()),
                })),
                capabilities: Some(agentvm_proto::v1::Capabilities {
                    resumability: agentvm_proto::v1::Resumability::StatelessReplay as i32,
                    ..Default::default()
                }),
                descriptor_id: String::new(),
            }),
        })
        .await
        .unwrap();
    harness
}

/// Issue: Harness.Connect deadlocked against a harness that reads Start before it sends
/// response headers (every upstream harness); the turn must complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpcio_harness_that_reads_start_first_answers_the_turn() {
    let Some((dir, stubs, python)) = grpcio_fixture() else {
        return;
    };
    let daemon = start_daemon(dir.path());
    let _harness = register_read_first_harness(dir.path(), &python, &stubs).await;
    let mut c = sessions(&daemon).await;
    let uid = support::create_for(&mut c, "py").await;
    let turn = async {
        let mut stream = c
            .exec(ExecRequest {
                session: uid.clone(),
                inputs: vec![text("hello")],
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        let mut kinds = Vec::new();
        let mut said = String::new();
        while let Some(update) = stream.message().await.unwrap() {
            if let Some(Update::Record(r)) = update.update {
                let event = r.event.unwrap();
                kinds.push(EventKind::try_from(event.kind).unwrap());
                if let Some(agentvm_proto::v1::event::Body::Message(m)) = event.body
                    && m.role == "assistant"
                {
                    for p in m.parts {
                        if let Some(part::Part::Text(t)) = p.part {
                            said.push_str(&t.text);
                        }
                    }
                }
            }
        }
        (kinds, said)
    };
    let (kinds, said) = tokio::time::timeout(Duration::from_secs(20), turn)
        .await
        .expect("the turn hung: the host waited for headers the harness sends only after Start");
    assert_eq!(said, "py:hello");
    assert_eq!(kinds.last(), Some(&EventKind::EventEnd), "{kinds:?}");
    let records = support::replay(&mut c, &uid).await;
    verify_chain(&records).unwrap();
}

/// Issue: grpcio sends the percent-encoded socket path as `:authority` on unix sockets, and
/// the server refused the stream. Its default client must be served.
#[test]
fn a_grpcio_client_with_its_default_authority_is_served_on_the_unix_socket() {
    let Some((dir, stubs, python)) = grpcio_fixture() else {
        return;
    };
    let daemon = start_daemon(dir.path());
    let out = Command::new(&python)
        .arg(upstream_script("client.py"))
        .arg("--stubs")
        .arg(&stubs)
        .arg("--target")
        .arg(format!("unix:{}", daemon.api.display()))
        .args(["--harness", "echo", "--input", "from python"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "the grpcio client failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "echo:from python"
    );
}
