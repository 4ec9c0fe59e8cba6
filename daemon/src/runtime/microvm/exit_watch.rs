//! Notices every VMM that exits: reaps the ones this daemon started, and reports the ones
//! that nobody asked to stop (killed, crashed) so the host can record the lost compute.
//!
//! Each VMM is watched through a pidfd, which works the same for a child of this daemon and
//! for a VMM adopted after a restart (whose exit status is then unknown: it is not ours to
//! reap). A pid file that names another process by the time the exit is seen means a newer
//! VMM serves the session; that exit is not news.

use super::lock;
use std::collections::HashSet;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Mutex};

use tokio::io::Interest;
use tokio::sync::broadcast;

use super::vmm_process::{self, VmmDir};
use crate::runtime::ComputeLost;

/// Reports a subscriber has not read yet before the oldest are dropped.
const BACKLOG: usize = 1024;

#[derive(Clone)]
pub struct ExitWatch {
    lost: broadcast::Sender<ComputeLost>,
    /// VMMs the runtime is ending itself: their exit is expected.
    expected: Arc<Mutex<HashSet<u32>>>,
    /// VMMs with a watcher, so adopting one twice does not watch it twice.
    watched: Arc<Mutex<HashSet<u32>>>,
}

impl Default for ExitWatch {
    fn default() -> Self {
        Self {
            lost: broadcast::channel(BACKLOG).0,
            expected: Arc::default(),
            watched: Arc::default(),
        }
    }
}

impl ExitWatch {
    pub fn subscribe(&self) -> broadcast::Receiver<ComputeLost> {
        self.lost.subscribe()
    }

    /// The runtime is about to end `pid` itself. (An unwatched pid has nobody to tell.)
    pub fn expect_exit(&self, pid: u32) {
        if lock(&self.watched).contains(&pid) {
            lock(&self.expected).insert(pid);
        }
    }

    /// Reports `session`'s compute as lost without a process to watch (found dead).
    pub fn report(&self, session: &str, reason: String) {
        tracing::error!(session, %reason, "a session's VMM is gone");
        let _ = self.lost.send(ComputeLost {
            session_uid: session.to_owned(),
            reason,
        });
    }

    /// Watches the VMM `pid` serving `dir` until it exits. Must run inside a tokio runtime.
    pub fn watch(&self, dir: VmmDir, pid: u32) {
        if !lock(&self.watched).insert(pid) {
            return;
        }
        let this = self.clone();
        tokio::spawn(async move {
            let how = wait_exit(pid).await;
            lock(&this.watched).remove(&pid);
            let session = dir
                .dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            if lock(&this.expected).remove(&pid) || vmm_process::recorded_pid(&dir) != Some(pid) {
                return;
            }
            let mut reason = format!("its VMM (pid {pid}) {how}");
            if let Some(last) = last_log_line(&dir) {
                reason.push_str(&format!("; its log ends: {last}"));
            }
            // Nobody listening (no host yet) is fine: the next turn finds the VMM gone too.
            this.report(&session, reason);
        });
    }
}

/// Waits until `pid` exits and says how, reaping it when it is this process's child.
async fn wait_exit(pid: u32) -> String {
    let fd = match crate::sys::pidfd_open(pid) {
        Ok(fd) => fd,
        // Already gone (and reaped by someone) before the watch began.
        Err(_) => return "exited".into(),
    };
    match crate::sys::watch_fd(fd, Interest::READABLE) {
        Ok(async_fd) => {
            // A pidfd turns readable once the process has exited.
            if let Ok(mut ready) = async_fd.readable().await {
                ready.retain_ready();
            }
            reap(async_fd.get_ref())
        }
        Err(_) => {
            // No reactor for it (should not happen); fall back to polling liveness.
            while vmm_process::alive(pid) {
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            "exited".into()
        }
    }
}

/// Reaps an exited child through its pidfd and describes its end; a process that is not our
/// child (an adopted VMM) cannot be reaped here and "exited" is all that is known.
fn reap(pidfd: &OwnedFd) -> String {
    use nix::sys::wait::{Id, WaitPidFlag, WaitStatus, waitid};
    match waitid(
        Id::PIDFd(pidfd.as_fd()),
        WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG,
    ) {
        Ok(WaitStatus::Exited(_, status)) => format!("exited with status {status}"),
        Ok(WaitStatus::Signaled(_, signal, _)) => {
            format!("was killed by signal {}", signal as i32)
        }
        _ => "exited".into(),
    }
}

/// The VMM's last log line, if it wrote one (its own account of an error exit).
fn last_log_line(dir: &VmmDir) -> Option<String> {
    let log = std::fs::read_to_string(dir.log()).ok()?;
    let line = log.lines().rev().find(|l| !l.trim().is_empty())?;
    Some(line.chars().take(300).collect())
}
