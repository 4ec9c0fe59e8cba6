//! VMMs started ahead of the VMs they will run, so a create, resume or fork child skips the
//! clone into namespaces, the jail, the exec and the VMM's own start-up (its KVM VM is made
//! while it waits). A pooled VMM is jailed with nothing of any session's: it is shown its
//! session's files when it is claimed (`jail::inject`), and told where its VM's RAM goes.
//!
//! Each waits in `RUN_DIR/.pool-UID` (owned by its uid, the record that the uid is taken),
//! holding its API socket and log there until a claim moves them into the session's
//! directory. Unclaimed VMMs end with the runtime; ones a crashed daemon left are stopped by
//! the next one's start-up reconciliation (`remove_leftovers`).

use super::lock;
use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use super::flavour::VmmFlavour;
use super::vmm_process::{self, VmmDir};

/// How long a replacement waits before it starts.
const REFILL_DELAY: std::time::Duration = std::time::Duration::from_millis(50);

/// Prefix of a pooled VMM's directory in the run directory.
pub const SLOT_PREFIX: &str = ".pool-";

/// One VMM waiting to be claimed.
#[derive(Debug)]
pub struct Pooled {
    pub pid: u32,
    pub uid: u32,
    /// Its directory: `api.sock`, `vmm.log` (its pid is on root's record beside it).
    pub slot: PathBuf,
}

impl Pooled {
    pub fn api(&self) -> PathBuf {
        self.slot.join("api.sock")
    }

    /// Kills it, reaps it (it is this daemon's child) and removes its directory.
    pub fn discard(self) {
        vmm_process::kill(self.pid);
        let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(self.pid as i32), None);
        let _ = std::fs::remove_dir_all(&self.slot);
        vmm_process::forget_pid(&self.slot);
    }

    /// Whether it still runs; one that exited is reaped here.
    fn running(&self) -> bool {
        use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
        matches!(
            waitpid(
                nix::unistd::Pid::from_raw(self.pid as i32),
                Some(WaitPidFlag::WNOHANG)
            ),
            Ok(WaitStatus::StillAlive)
        )
    }
}

/// Starts one pooled VMM; blocking.
pub type Launch = dyn Fn() -> Result<Pooled, String> + Send + Sync;

pub struct Pool {
    inner: Arc<Inner>,
}

struct Inner {
    size: usize,
    ready: Mutex<VecDeque<Pooled>>,
    starting: AtomicUsize,
    closed: AtomicBool,
    launch: Box<Launch>,
}

impl Pool {
    /// A pool of `size` VMMs, each started by `launch`; empty until `fill`.
    pub fn new(size: usize, launch: Box<Launch>) -> Self {
        Self {
            inner: Arc::new(Inner {
                size,
                ready: Mutex::default(),
                starting: AtomicUsize::new(0),
                closed: AtomicBool::new(false),
                launch,
            }),
        }
    }

    /// Starts VMMs in the background until `size` are waiting or starting.
    pub fn fill(&self) {
        Inner::fill(&self.inner);
    }

    /// A waiting VMM that still runs, if any; a replacement starts in the background.
    pub fn take(&self) -> Option<Pooled> {
        let taken = loop {
            let next = lock(&self.inner.ready).pop_front();
            match next {
                Some(pooled) if pooled.running() => break Some(pooled),
                Some(dead) => {
                    let log =
                        std::fs::read_to_string(dead.slot.join("vmm.log")).unwrap_or_default();
                    let last = log.lines().rev().take(3).collect::<Vec<_>>().join(" | ");
                    tracing::warn!(pid = dead.pid, log = %last, "a pooled VMM exited before it was claimed");
                    dead.discard();
                }
                None => break None,
            }
        };
        self.fill();
        taken
    }

    /// Stops every waiting VMM; none starts any more (those starting are stopped as they
    /// come up).
    pub fn close(&self) {
        self.inner.closed.store(true, Ordering::SeqCst);
        let waiting: Vec<Pooled> = lock(&self.inner.ready).drain(..).collect();
        for pooled in waiting {
            pooled.discard();
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.close();
    }
}

impl Inner {
    fn fill(this: &Arc<Self>) {
        while !this.closed.load(Ordering::SeqCst) {
            let starting = this.starting.load(Ordering::SeqCst);
            if lock(&this.ready).len() + starting >= this.size {
                return;
            }
            if this
                .starting
                .compare_exchange(starting, starting + 1, Ordering::SeqCst, Ordering::SeqCst)
                .is_err()
            {
                continue;
            }
            let this = this.clone();
            // Blocking, and never cut short: once cloned, a VMM is either queued or stopped.
            tokio::task::spawn_blocking(move || {
                // After the start that claimed the last one, not competing with it for the
                // node's cores.
                std::thread::sleep(REFILL_DELAY);
                let launched = (this.launch)();
                this.starting.fetch_sub(1, Ordering::SeqCst);
                match launched {
                    Ok(pooled) if this.closed.load(Ordering::SeqCst) => pooled.discard(),
                    Ok(pooled) => lock(&this.ready).push_back(pooled),
                    // Not retried here: the next claim tries again.
                    Err(e) => tracing::warn!(error = %e, "could not start a pooled VMM"),
                }
            });
        }
    }
}

/// The pooled VMMs' directories in `run_dir`.
pub fn slots(run_dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(run_dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(SLOT_PREFIX))
        .map(|e| e.path())
        .collect()
}

/// Stops the unclaimed VMMs an earlier daemon left (the pid on record for a slot naming a
/// VMM that serves that slot's socket) and removes their slots.
pub fn remove_leftovers(run_dir: &Path) {
    for slot in slots(run_dir) {
        // As for a session's VMM: the pid on record, checked to be a process of the slot's
        // owner, pinned by a pidfd.
        let owner = VmmDir::new(slot.clone(), VmmFlavour::Agentvm, slot.clone(), false);
        if let Some(vmm) = vmm_process::pinned_vmm(&owner) {
            let pid = vmm.pid;
            let api = slot.join("api.sock");
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let ours = cmdline
                .split(|b| *b == 0)
                .any(|arg| arg == api.as_os_str().as_encoded_bytes());
            if ours {
                tracing::info!(pid, slot = %slot.display(), "reconcile: stopping an unclaimed pooled VMM");
                vmm.kill();
            }
        }
        let _ = std::fs::remove_dir_all(&slot);
        vmm_process::forget_pid(&slot);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sleeper(dir: &Path, n: u32) -> Result<Pooled, String> {
        let slot = dir.join(format!("{SLOT_PREFIX}{n}"));
        std::fs::create_dir_all(&slot).unwrap();
        let child = std::process::Command::new("sleep")
            .arg("60")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .map_err(|e| e.to_string())?;
        Ok(Pooled {
            pid: child.id(),
            uid: n,
            slot,
        })
    }

    async fn until(what: &str, cond: impl Fn() -> bool) {
        for _ in 0..500 {
            if cond() {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        panic!("timed out waiting for {what}");
    }

    #[test]
    fn leftovers_of_a_dead_daemon_are_stopped_and_only_they() {
        let dir = tempfile::tempdir().unwrap();
        let slot = dir.path().join(format!("{SLOT_PREFIX}7"));
        std::fs::create_dir(&slot).unwrap();
        let api = slot.join("api.sock");
        // A process started for this slot names its socket; another does not.
        // `cat - API` waits on its stdin (held open here) and names the socket.
        let mut ours = std::process::Command::new("cat")
            .arg("-")
            .arg(&api)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let mut other = std::process::Command::new("sleep")
            .arg("60")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        vmm_process::record_pid(&slot, ours.id(), None).unwrap();
        let other_slot = dir.path().join(format!("{SLOT_PREFIX}8"));
        std::fs::create_dir(&other_slot).unwrap();
        // A pid reused by an unrelated process since.
        vmm_process::record_pid(&other_slot, other.id(), None).unwrap();
        remove_leftovers(dir.path());
        assert!(ours.wait().unwrap().code().is_none(), "killed by a signal");
        assert!(
            other.try_wait().unwrap().is_none(),
            "an unrelated process was killed"
        );
        assert!(slots(dir.path()).is_empty());
        other.kill().unwrap();
        other.wait().unwrap();
    }

    #[tokio::test]
    async fn a_pool_keeps_its_size_replaces_what_is_taken_and_stops_the_rest_when_closed() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().to_owned();
        let next = Arc::new(AtomicUsize::new(0));
        let counter = next.clone();
        let pool = Pool::new(
            2,
            Box::new(move || sleeper(&root, counter.fetch_add(1, Ordering::SeqCst) as u32)),
        );
        pool.fill();
        pool.fill();
        until("two pooled", || lock(&pool.inner.ready).len() == 2).await;
        assert_eq!(next.load(Ordering::SeqCst), 2, "filled past its size");

        // One that died while waiting is skipped (and reaped), not handed out.
        let first_pid = lock(&pool.inner.ready)[0].pid;
        vmm_process::kill(first_pid);
        until("the kill", || !vmm_process::alive(first_pid)).await;
        let taken = pool.take().expect("a running one");
        assert_ne!(taken.pid, first_pid);
        until("the refill", || lock(&pool.inner.ready).len() == 2).await;
        assert_eq!(next.load(Ordering::SeqCst), 4);

        let waiting: Vec<u32> = lock(&pool.inner.ready).iter().map(|p| p.pid).collect();
        pool.close();
        for pid in waiting {
            assert!(!vmm_process::alive(pid), "{pid} survived close");
        }
        assert_eq!(
            slots(dir.path()),
            vec![taken.slot.clone()],
            "only the taken one's slot is left"
        );
        // Closed: taking starts nothing new.
        assert!(pool.take().is_none());
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        assert_eq!(next.load(Ordering::SeqCst), 4);
        taken.discard();
    }
}
