//! The `process` runtime: each session's harness is a local process serving
//! `agentsessions.v1.Harness` on its own unix socket (upstream's `local` backend, out of
//! process). It keeps no memory across a suspend, so it reports `memory_snapshot: false` and
//! REQUIRES_MEMORY_SNAPSHOT harnesses are refused by CanPlace before anything starts.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use agentvm_proto::v1::{RuntimeCapabilities, SnapshotRef};
use tokio::process::{Child, Command};
use tokio::sync::Mutex;

use super::{
    ForkOpts, Incarnation, ObservedState, Result, Runtime, RuntimeError, SessionSpec, SnapshotKind,
};
use crate::client::connect_address;
use crate::controller::endpoint::{GrpcEndpoint, HarnessEndpoint};

const NAME: &str = "process";
/// How long a freshly spawned harness has to start listening.
const START_TIMEOUT: Duration = Duration::from_secs(10);

pub struct ProcessRuntime {
    /// The program and leading arguments; `<harness> --listen unix:<socket>` follow.
    command: Vec<String>,
    socket_dir: PathBuf,
    children: Mutex<HashMap<String, Child>>,
}

fn failed(session: &str, reason: impl Into<String>) -> RuntimeError {
    RuntimeError::Failed {
        runtime: NAME,
        session: session.to_owned(),
        reason: reason.into(),
    }
}

impl ProcessRuntime {
    /// `command` is e.g. `["/usr/bin/agentvm", "harness", "serve"]`.
    pub fn new(command: Vec<String>, socket_dir: PathBuf) -> Self {
        Self {
            command,
            socket_dir,
            children: Mutex::default(),
        }
    }

    fn socket_path(&self, session: &str) -> PathBuf {
        self.socket_dir.join(format!("{session}.sock"))
    }

    async fn spawn(&self, spec: &SessionSpec) -> Result<Incarnation> {
        let uid = &spec.session_uid;
        let mut children = self.children.lock().await;
        let socket = self.socket_path(uid);
        let address = format!("unix://{}", socket.display());
        if let Some(child) = children.get_mut(uid) {
            if matches!(child.try_wait(), Ok(None)) {
                return Ok(incarnation(uid, address));
            }
            children.remove(uid);
        }
        std::fs::create_dir_all(&self.socket_dir).map_err(|e| {
            failed(
                uid,
                format!("socket directory {}: {e}", self.socket_dir.display()),
            )
        })?;
        let _ = std::fs::remove_file(&socket);
        let (program, args) = self
            .command
            .split_first()
            .ok_or_else(|| failed(uid, "no harness command configured"))?;
        let mut cmd = Command::new(program);
        cmd.args(args)
            .arg(&spec.harness)
            .arg("--listen")
            .arg(format!("unix:{}", socket.display()))
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true);
        // The harness must not outlive the daemon that owns its session.
        crate::sys::die_with_parent(cmd.as_std_mut());
        let mut child = cmd
            .spawn()
            .map_err(|e| failed(uid, format!("starting {program}: {e}")))?;
        wait_listening(&mut child, &socket)
            .await
            .map_err(|reason| failed(uid, reason))?;
        children.insert(uid.clone(), child);
        Ok(incarnation(uid, address))
    }

    async fn kill(&self, uid: &str) {
        if let Some(mut child) = self.children.lock().await.remove(uid) {
            let _ = child.kill().await;
        }
        let _ = std::fs::remove_file(self.socket_path(uid));
    }
}

fn incarnation(uid: &str, address: String) -> Incarnation {
    Incarnation {
        id: uid.to_owned(),
        worker: String::new(),
        address,
        runtime: NAME.into(),
        fence_token: 0,
    }
}

async fn wait_listening(child: &mut Child, socket: &Path) -> std::result::Result<(), String> {
    let deadline = tokio::time::Instant::now() + START_TIMEOUT;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(format!("the harness exited during start-up ({status})"));
        }
        if tokio::net::UnixStream::connect(socket).await.is_ok() {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            let _ = child.kill().await;
            return Err(format!(
                "the harness did not listen on {} within {START_TIMEOUT:?}",
                socket.display()
            ));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[async_trait::async_trait]
impl Runtime for ProcessRuntime {
    fn harness_lives_with_incarnation(&self) -> bool {
        true
    }

    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> RuntimeCapabilities {
        RuntimeCapabilities::default()
    }

    async fn create(&self, spec: &SessionSpec) -> Result<Incarnation> {
        self.spawn(spec).await
    }

    /// EXTERNAL frees the process; the host rebuilds state by replay, so the reference is the
    /// session itself and carries no memory.
    async fn snapshot(&self, incarnation: &Incarnation, kind: SnapshotKind) -> Result<SnapshotRef> {
        if kind == SnapshotKind::Local {
            return Err(RuntimeError::Unsupported {
                runtime: NAME,
                operation: "LOCAL (warm) snapshot",
            });
        }
        self.kill(&incarnation.id).await;
        Ok(SnapshotRef {
            local: incarnation.id.clone(),
            ..Default::default()
        })
    }

    async fn restore(&self, _snapshot: &SnapshotRef, spec: &SessionSpec) -> Result<Incarnation> {
        self.spawn(spec).await
    }

    async fn fork(&self, _snapshot: &SnapshotRef, _opts: &ForkOpts) -> Result<Option<Incarnation>> {
        Ok(None)
    }

    async fn stop(&self, incarnation: &Incarnation) -> Result<()> {
        self.kill(&incarnation.id).await;
        Ok(())
    }

    async fn status(&self, incarnation: &Incarnation) -> Result<ObservedState> {
        let mut children = self.children.lock().await;
        Ok(
            match children.get_mut(&incarnation.id).map(|c| c.try_wait()) {
                Some(Ok(None)) => ObservedState::Live,
                Some(_) => ObservedState::Terminated,
                None => ObservedState::Unknown,
            },
        )
    }

    async fn dial(&self, incarnation: &Incarnation) -> Result<Arc<dyn HarnessEndpoint>> {
        let channel = connect_address(&incarnation.address)
            .await
            .map_err(|e| failed(&incarnation.id, format!("{e:#}")))?;
        Ok(Arc::new(GrpcEndpoint::new(channel)))
    }
}
