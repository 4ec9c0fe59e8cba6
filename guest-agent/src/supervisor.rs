//! Runs the image's harness and keeps it running per its restart policy.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::sync::watch;

use crate::image::{ImageConfig, RestartPolicy};
use crate::reaper::{Exit, Reaper};
use crate::sys;

const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// What the host is told about the harness.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HarnessState {
    pub running: bool,
    pub restarts: u32,
    /// Why the harness is down for good (spawn failure, restarts exhausted, policy).
    pub down: Option<String>,
    pub pid: Option<u32>,
}

pub struct Supervisor {
    state: watch::Sender<HarnessState>,
    stopping: watch::Sender<bool>,
    reaper: Reaper,
}

impl Supervisor {
    /// Starts the harness of `config`, serving on `socket`.
    pub fn start(config: &ImageConfig, socket: PathBuf, reaper: Reaper) -> Arc<Self> {
        let (state, _) = watch::channel(HarnessState::default());
        let (stopping, _) = watch::channel(false);
        let supervisor = Arc::new(Supervisor {
            state,
            stopping,
            reaper,
        });
        tokio::spawn(supervisor.clone().run(config.clone(), socket));
        supervisor
    }

    pub fn state(&self) -> HarnessState {
        self.state.borrow().clone()
    }

    pub fn subscribe(&self) -> watch::Receiver<HarnessState> {
        self.state.subscribe()
    }

    /// Tells the running harness that its VM was restored, forked or started from a
    /// template (SIGWINCH, as its environment says): whatever it drew from randomness before
    /// is shared with every other VM of the same snapshot.
    pub fn signal_restored(&self) {
        if let Some(pid) = self.state().pid
            && let Err(e) = kill(Pid::from_raw(pid as i32), Signal::SIGWINCH)
        {
            tracing::warn!(pid, error = %e, "could not tell the harness it was restored");
        }
    }

    fn update(&self, f: impl FnOnce(&mut HarnessState)) {
        self.state.send_modify(f);
    }

    async fn run(self: Arc<Self>, config: ImageConfig, socket: PathBuf) {
        let mut backoff = FIRST_BACKOFF;
        let mut stopping = self.stopping.subscribe();
        loop {
            if *stopping.borrow() {
                return;
            }
            let _ = std::fs::remove_file(&socket);
            let child = spawn(&config, &socket, &self.reaper);
            let pid = match child {
                Ok(pid) => pid,
                Err(e) => {
                    let why = format!("starting {:?}: {e}", config.harness.command[0]);
                    tracing::error!(%why, "harness did not start");
                    self.update(|s| {
                        s.running = false;
                        s.pid = None;
                        s.down = Some(why);
                    });
                    return;
                }
            };
            tracing::info!(pid, "harness started");
            let exited = self.reaper.wait(pid);
            self.update(|s| {
                s.running = true;
                s.pid = Some(pid);
                s.down = None;
            });
            let exit = exited.await.unwrap_or(Exit::Signal(0));
            let stopped = *stopping.borrow();
            tracing::info!(pid, %exit, "harness ended");
            let restarts = self.state().restarts;
            let again = !stopped
                && match config.harness.restart {
                    RestartPolicy::Always => true,
                    RestartPolicy::OnFailure => exit != Exit::Code(0),
                    RestartPolicy::Never => false,
                };
            let down = if stopped {
                Some("the agent stopped it".to_owned())
            } else if !again {
                Some(format!(
                    "the harness ended ({exit}); restart policy {:?}",
                    config.harness.restart
                ))
            } else if restarts >= config.harness.max_restarts {
                Some(format!(
                    "the harness ended ({exit}) after {restarts} restarts; max_restarts is {}",
                    config.harness.max_restarts
                ))
            } else {
                None
            };
            self.update(|s| {
                s.running = false;
                s.pid = None;
                s.down = down.clone();
            });
            if down.is_some() {
                return;
            }
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = stopping.changed() => return,
            }
            backoff = (backoff * 2).min(MAX_BACKOFF);
            self.update(|s| s.restarts += 1);
        }
    }

    /// Stops the harness: SIGTERM, then SIGKILL after `grace`.
    pub async fn stop(&self, grace: Duration) {
        self.stopping.send_replace(true);
        let mut state = self.subscribe();
        let Some(pid) = state.borrow().pid else {
            return;
        };
        let harness = Pid::from_raw(pid as i32);
        let _ = kill(harness, Signal::SIGTERM);
        let ended = tokio::time::timeout(grace, state.wait_for(|s| !s.running))
            .await
            .is_ok();
        if !ended {
            let _ = kill(harness, Signal::SIGKILL);
            let _ =
                tokio::time::timeout(Duration::from_secs(5), state.wait_for(|s| !s.running)).await;
        }
    }
}

fn spawn(config: &ImageConfig, socket: &std::path::Path, reaper: &Reaper) -> std::io::Result<u32> {
    let command = config.command_for(socket);
    let mut cmd = std::process::Command::new(&command[0]);
    cmd.args(&command[1..])
        .env_clear()
        .env(
            "PATH",
            "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin",
        )
        .envs(config.env_for(socket))
        .current_dir(&config.harness.workdir)
        .stdin(std::process::Stdio::null());
    if (config.harness.uid, config.harness.gid) != (0, 0) {
        use std::os::unix::process::CommandExt;
        // The container image's User; its socket directory must let it in.
        cmd.uid(config.harness.uid).gid(config.harness.gid);
        if let Some(dir) = socket.parent() {
            let _ =
                std::os::unix::fs::chown(dir, Some(config.harness.uid), Some(config.harness.gid));
        }
    }
    // The harness must not outlive the agent that answers for it.
    sys::signal_child_on_our_death(&mut cmd, Signal::SIGKILL);
    reaper.spawn(&mut cmd)
}
