//! Named crash points on the step boundaries of lifecycle operations, for the crash
//! consistency test (`tests/crash_points.rs`): a debug build started with
//! `AGENTVM_CRASH_POINT=NAME` (or `NAME@N`) SIGKILLs itself, as `kill -9` would, the first
//! (or Nth) time it reaches NAME. Release builds compile every point to nothing.

/// Every point, in the order an operation reaches them. The crash test covers each one.
pub const ALL: &[&str] = &[
    // VMM start (Exec on a session without compute, Resume): booted or restored.
    START_BEGUN,
    START_SPAWNED,
    START_READY,
    // Suspend: snapshot the live VM, record SUSPEND. A live fork's checkpoint takes the same
    // steps with the VM running on: forked in place (not yet durable), then copied durably.
    SUSPEND_BEGUN,
    SUSPEND_PAUSED,
    SUSPEND_FORKED,
    SUSPEND_STORED,
    SUSPEND_SNAPSHOTTED,
    SUSPEND_RECORDED,
    // Fork: children started, then written (all in one transaction).
    FORK_BEGUN,
    FORK_PROVISIONED,
    FORK_WRITTEN,
    // A turn's checkpoint, in the background after its END: taken (the VM running again),
    // in the store, recorded in the journal's side table, and one past retention folded
    // into the next.
    CHECKPOINT_TAKEN,
    CHECKPOINT_STORED,
    CHECKPOINT_RECORDED,
    CHECKPOINT_MERGED,
    // Delete: marked, compute stopped, snapshots reclaimed, tombstoned.
    DELETE_BEGUN,
    DELETE_STOPPED,
    DELETE_RECLAIMED,
];

pub const START_BEGUN: &str = "start.begun";
pub const START_SPAWNED: &str = "start.spawned";
pub const START_READY: &str = "start.ready";
pub const SUSPEND_BEGUN: &str = "suspend.begun";
pub const SUSPEND_PAUSED: &str = "suspend.paused";
pub const SUSPEND_FORKED: &str = "suspend.forked";
pub const SUSPEND_STORED: &str = "suspend.stored";
pub const SUSPEND_SNAPSHOTTED: &str = "suspend.snapshotted";
pub const SUSPEND_RECORDED: &str = "suspend.recorded";
pub const FORK_BEGUN: &str = "fork.begun";
pub const FORK_PROVISIONED: &str = "fork.provisioned";
pub const FORK_WRITTEN: &str = "fork.written";
pub const CHECKPOINT_TAKEN: &str = "checkpoint.taken";
pub const CHECKPOINT_STORED: &str = "checkpoint.stored";
pub const CHECKPOINT_RECORDED: &str = "checkpoint.recorded";
pub const CHECKPOINT_MERGED: &str = "checkpoint.merged";
pub const DELETE_BEGUN: &str = "delete.begun";
pub const DELETE_STOPPED: &str = "delete.stopped";
pub const DELETE_RECLAIMED: &str = "delete.reclaimed";

/// The variable naming the point a debug build dies at.
pub const ENV: &str = "AGENTVM_CRASH_POINT";

#[cfg(debug_assertions)]
pub fn reached(name: &'static str) {
    use std::sync::atomic::{AtomicU32, Ordering};
    /// `NAME` or `NAME@N`: die at the Nth time NAME is reached (first by default).
    static WANTED: std::sync::OnceLock<Option<(String, u32)>> = std::sync::OnceLock::new();
    static TIMES: AtomicU32 = AtomicU32::new(0);
    debug_assert!(
        ALL.contains(&name),
        "crash point {name} is not listed in ALL"
    );
    let wanted = WANTED.get_or_init(|| {
        let value = std::env::var(ENV).ok()?;
        Some(match value.split_once('@') {
            Some((point, nth)) => (point.to_owned(), nth.parse().unwrap_or(1)),
            None => (value, 1),
        })
    });
    let Some((point, nth)) = wanted else {
        return;
    };
    if point == name && TIMES.fetch_add(1, Ordering::SeqCst) + 1 == *nth {
        eprintln!("agentvmd: crash point {name} reached; SIGKILL");
        let _ = nix::sys::signal::kill(nix::unistd::getpid(), nix::sys::signal::Signal::SIGKILL);
    }
}

#[cfg(not(debug_assertions))]
#[inline(always)]
pub fn reached(_name: &'static str) {}
