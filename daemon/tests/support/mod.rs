//! The in-process node the Sessions API tests run against: an agentvmd node on a unix
//! socket in a temporary directory, harness processes started from this build's `agentvm`.
#![allow(dead_code)]

pub mod daemon;

use std::path::PathBuf;
use std::time::Duration;

use agentvm_proto::v1::sessions_client::SessionsClient;
use agentvmd::config::ListenAddr;
use agentvmd::journal::sqlite::Durability;
use agentvmd::node::{Node, NodeConfig};
use tonic::transport::Channel;

pub struct TestNode {
    _dir: tempfile::TempDir,
    pub dir: PathBuf,
    pub node: Node,
    pub client: SessionsClient<Channel>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Drop for TestNode {
    /// A node dropped at the end of a test takes its VMMs with it: they outlive a daemon by
    /// design (a restart adopts them), so nothing else would ever stop them. `restart` takes
    /// `stop` first, and the VMMs it leaves running are the ones the next node adopts.
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
            reap_vmms(&self.dir.join("state").join("vms"));
        }
    }
}

/// SIGKILLs every VMM recorded under `vms` (`SESSION/vmm.pid`) that is still that VMM, waits
/// until each is gone, and removes the private RAM directory each had (`agentvm-SESSION` in
/// whichever RAM directory the tests give nodes).
pub fn reap_vmms(vms: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(vms) else {
        return;
    };
    for entry in entries.flatten() {
        if let Some(pid) = std::fs::read_to_string(entry.path().join("vmm.pid"))
            .ok()
            .and_then(|p| p.trim().parse::<i32>().ok())
        {
            kill_vmm(pid);
        }
        let session = entry.file_name().to_string_lossy().into_owned();
        let ram_name = format!("agentvm-{session}");
        for ram_dir in [std::path::PathBuf::from("/dev/shm"), std::env::temp_dir()] {
            let _ = std::fs::remove_dir_all(ram_dir.join(&ram_name));
        }
        remove_vm_cgroups(&session);
    }
}

/// Removes the cgroups a node in this process (or a daemon it started, which inherits its
/// cgroups) made for `session`'s VMM: `agentvm-vms/SESSION` under this process's own cgroup
/// of each hierarchy.
pub fn remove_vm_cgroups(session: &str) {
    let Ok(own) = std::fs::read_to_string("/proc/self/cgroup") else {
        return;
    };
    for line in own.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) =
            (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        let path = path.trim_start_matches('/');
        let mounts: Vec<String> = if controllers.is_empty() {
            vec![String::new(), "unified".into()]
        } else {
            std::iter::once(controllers.to_owned())
                .chain(controllers.split(',').map(str::to_owned))
                .collect()
        };
        for mount in mounts {
            let dir = std::path::Path::new("/sys/fs/cgroup")
                .join(mount)
                .join(path)
                .join("agentvm-vms")
                .join(session);
            // KVM's worker threads of a killed VM hold its cgroups until the VM is torn down.
            for _ in 0..300 {
                match std::fs::remove_dir(&dir) {
                    Err(e) if e.raw_os_error() == Some(nix::errno::Errno::EBUSY as i32) => {
                        std::thread::sleep(Duration::from_millis(10))
                    }
                    _ => break,
                }
            }
        }
    }
}

/// SIGKILLs `pid` if it is an agentvm-vmm, and waits until every thread of it is gone (a
/// thread still exiting holds its cgroups).
fn kill_vmm(pid: i32) {
    let is_vmm = std::fs::read(format!("/proc/{pid}/cmdline"))
        .is_ok_and(|c| c.windows(b"agentvm-vmm".len()).any(|w| w == b"agentvm-vmm"));
    let zombie = || {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |s| {
            s.rsplit_once(')')
                .is_some_and(|(_, r)| r.trim_start().starts_with('Z'))
        })
    };
    if is_vmm {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    } else if !zombie() {
        // Gone, and the pid is something else's now.
        return;
    }
    let running = || {
        let threads = std::fs::read_dir(format!("/proc/{pid}/task")).map_or(0, |t| t.count());
        !zombie() || threads > 1
    };
    for _ in 0..500 {
        if !running() {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

pub async fn start() -> TestNode {
    start_with(|_| {}).await
}

/// `start`, with the node's configuration adjusted first.
pub async fn start_with(configure: impl FnOnce(&mut NodeConfig)) -> TestNode {
    start_in(tempfile::tempdir().unwrap(), configure).await
}

/// A node over an existing directory: what a restarted daemon finds.
pub async fn start_in(dir: tempfile::TempDir, configure: impl FnOnce(&mut NodeConfig)) -> TestNode {
    // The daemon's logs, when RUST_LOG asks for them (captured per test like its output).
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
    }
    let path = dir.path().to_owned();
    let _ = std::fs::remove_file(path.join("api.sock"));
    let mut cfg = NodeConfig::new(path.join("state"));
    cfg.harness_command = vec![
        env!("CARGO_BIN_EXE_agentvm").into(),
        "harness".into(),
        "serve".into(),
    ];
    cfg.durability = Durability::Relaxed;
    configure(&mut cfg);
    let node = Node::open(cfg).unwrap();
    let socket = path.join("api.sock");
    let addr = ListenAddr::Unix(socket.clone());
    let routes = agentvmd::server::node_routes(&node).await.unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    {
        let addr = addr.clone();
        tokio::spawn(async move {
            agentvmd::server::serve(&addr, routes, 0o600, async {
                let _ = stop_rx.await;
            })
            .await
            .unwrap();
        });
    }
    for _ in 0..200 {
        // Connectable, not just present (the file exists from bind(2), before listen(2)).
        if std::os::unix::net::UnixStream::connect(&socket).is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let channel = agentvmd::client::connect(&addr).await.unwrap();
    TestNode {
        _dir: dir,
        dir: path,
        node,
        client: SessionsClient::new(channel),
        stop: Some(stop_tx),
    }
}

impl TestNode {
    pub fn c(&self) -> SessionsClient<Channel> {
        self.client.clone()
    }

    /// A fresh channel to the node's API socket (for the other services on it).
    pub async fn channel(&self) -> Channel {
        agentvmd::client::connect(&ListenAddr::Unix(self.dir.join("api.sock")))
            .await
            .unwrap()
    }

    /// Stops this node (its API server and session host) and starts a new one over the same
    /// state, as a daemon restart would. Anything outside the process's own objects (harness
    /// or VMM processes) keeps running.
    pub async fn restart(mut self, configure: impl FnOnce(&mut NodeConfig)) -> TestNode {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let dir = std::mem::replace(&mut self._dir, tempfile::tempdir().unwrap());
        drop(self);
        tokio::time::sleep(Duration::from_millis(50)).await;
        start_in(dir, configure).await
    }
}

/// An Exec of `session` with one user message holding `text`.
pub fn exec_text(
    session: impl Into<String>,
    text: impl Into<String>,
) -> agentvm_proto::v1::ExecRequest {
    use agentvm_proto::v1::{ExecRequest, Message, Part, TextPart, part};
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

/// Every record of `session`'s log, through Replay.
pub async fn replay(
    c: &mut SessionsClient<Channel>,
    session: &str,
) -> Vec<agentvm_proto::v1::LogRecord> {
    let mut stream = c
        .replay(agentvm_proto::v1::ReplayRequest {
            session: session.into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let mut records = Vec::new();
    while let Some(r) = stream.message().await.unwrap() {
        records.push(r);
    }
    records
}

/// A new session of `harness`; returns its uid.
pub async fn create_for(c: &mut SessionsClient<Channel>, harness: &str) -> String {
    create_annotated(c, harness, &[]).await.unwrap()
}

/// A new session of `harness` with `annotations`; its uid, or why it was refused.
pub async fn create_annotated(
    c: &mut SessionsClient<Channel>,
    harness: &str,
    annotations: &[(&str, &str)],
) -> Result<String, tonic::Status> {
    Ok(c.create_session(agentvm_proto::v1::CreateSessionRequest {
        session: Some(agentvm_proto::v1::Session {
            harness: harness.into(),
            annotations: annotations
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ..Default::default()
        }),
    })
    .await?
    .into_inner()
    .metadata
    .unwrap_or_default()
    .uid)
}
