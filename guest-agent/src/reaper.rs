//! The one place that waits for child processes. As PID 1 (or a subreaper) the agent inherits
//! every orphan in the guest and must reap them all, so nothing else may call `waitpid` on a
//! specific child: the reaper reaps everything on SIGCHLD and hands the exit status of the
//! children someone asked about to them.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::oneshot;

use crate::sys;

/// How a process ended: its exit code, or the signal that killed it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    Code(i32),
    Signal(i32),
}

impl std::fmt::Display for Exit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Exit::Code(c) => write!(f, "exit code {c}"),
            Exit::Signal(s) => write!(f, "killed by signal {s}"),
        }
    }
}

#[derive(Default)]
struct Table {
    waiting: HashMap<i32, oneshot::Sender<Exit>>,
    /// Exits reaped before anyone asked (a child that died at once).
    unclaimed: HashMap<i32, Exit>,
}

#[derive(Clone)]
pub struct Reaper {
    table: Arc<Mutex<Table>>,
}

/// Held while a child is being spawned: std's spawn waits for a child whose exec failed,
/// and must find it unreaped.
static SPAWNING: Mutex<()> = Mutex::new(());

impl Reaper {
    /// Starts reaping on SIGCHLD; needs a tokio runtime.
    pub fn start() -> std::io::Result<Self> {
        let mut sigchld = signal(SignalKind::child())?;
        let reaper = Reaper {
            table: Arc::default(),
        };
        let table = reaper.table.clone();
        tokio::spawn(async move {
            loop {
                reap_all(&table);
                if sigchld.recv().await.is_none() {
                    return;
                }
            }
        });
        Ok(reaper)
    }

    /// Spawns `cmd`; its pid is then ours to wait for with [`Reaper::wait`].
    pub fn spawn(&self, cmd: &mut std::process::Command) -> std::io::Result<u32> {
        let _spawning = SPAWNING.lock().unwrap_or_else(|p| p.into_inner());
        // The handle is not needed: dropping it does not wait, the reaper does.
        cmd.spawn().map(|child| child.id())
    }

    /// Resolves when `pid` (a child of this process) ends.
    pub fn wait(&self, pid: u32) -> oneshot::Receiver<Exit> {
        let (tx, rx) = oneshot::channel();
        let mut t = self.table.lock().unwrap_or_else(|p| p.into_inner());
        match t.unclaimed.remove(&(pid as i32)) {
            Some(exit) => {
                let _ = tx.send(exit);
            }
            None => {
                t.waiting.insert(pid as i32, tx);
            }
        }
        drop(t);
        // A child that ended between the last SIGCHLD pass and the registration above.
        reap_all(&self.table);
        rx
    }
}

fn reap_all(table: &Mutex<Table>) {
    let _not_spawning = SPAWNING.lock().unwrap_or_else(|p| p.into_inner());
    while let Some((pid, exit)) = sys::reap_any_child() {
        let mut t = table.lock().unwrap_or_else(|p| p.into_inner());
        match t.waiting.remove(&pid) {
            Some(tx) => {
                let _ = tx.send(exit);
            }
            None => {
                // An orphan nobody waits for, or a child whose waiter registers next. Keep the
                // table bounded: orphans are forgotten once it grows.
                if t.unclaimed.len() >= 1024 {
                    t.unclaimed.clear();
                }
                t.unclaimed.insert(pid, exit);
            }
        }
    }
}
