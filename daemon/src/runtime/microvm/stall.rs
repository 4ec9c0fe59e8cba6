//! A VMM that is alive but cannot run: stopped by a signal or a debugger, or its cgroup
//! frozen. Its guest answers nothing, yet every liveness check (the pid runs, its socket
//! accepts connections into the kernel's backlog) says it is fine, so without this a turn
//! waited for a deadline made for slow guests, not for stopped ones.
//!
//! Such a VMM is treated as lost compute: the turn ends at once and the VMM is killed.
//! Killing it needs care: a v1 freezer holds even SIGKILL until the group thaws.

use std::path::{Path, PathBuf};

/// Why a VMM cannot run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stall {
    /// Stopped by a signal (SIGSTOP, SIGTSTP, …).
    Stopped,
    /// Stopped by a debugger (ptrace).
    Traced,
    /// Its freezer cgroup (this directory) is frozen or freezing.
    Frozen(PathBuf),
}

impl std::fmt::Display for Stall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Stall::Stopped => f.write_str("is stopped (SIGSTOP)"),
            Stall::Traced => f.write_str("is stopped by a debugger"),
            Stall::Frozen(group) => write!(f, "is frozen (cgroup {})", group.display()),
        }
    }
}

const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// Why process `pid` cannot run, if it cannot.
pub fn stall(pid: u32) -> Option<Stall> {
    stall_in(Path::new(CGROUP_ROOT), pid)
}

fn stall_in(cgroup_root: &Path, pid: u32) -> Option<Stall> {
    match super::vmm_process::process_state(pid)? {
        'T' => return Some(Stall::Stopped),
        't' => return Some(Stall::Traced),
        _ => {}
    }
    let groups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    frozen_group(cgroup_root, &groups).map(Stall::Frozen)
}

/// The frozen cgroup among `/proc/PID/cgroup`'s `ID:CONTROLLERS:PATH` lines: the v1 freezer
/// hierarchy's `freezer.state` (it shows a parent's freeze too), or v2's `cgroup.events`.
fn frozen_group(root: &Path, proc_cgroup: &str) -> Option<PathBuf> {
    for line in proc_cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let relative = path.trim_start_matches('/');
        if controllers.split(',').any(|c| c == "freezer") {
            let group = root.join("freezer").join(relative);
            let state = std::fs::read_to_string(group.join("freezer.state")).unwrap_or_default();
            if matches!(state.trim(), "FROZEN" | "FREEZING") {
                return Some(group);
            }
        } else if controllers.is_empty() {
            let group = root.join(relative);
            let events = std::fs::read_to_string(group.join("cgroup.events")).unwrap_or_default();
            if events.lines().any(|l| l.trim() == "frozen 1") {
                return Some(group);
            }
        }
    }
    None
}

/// Kills a stalled process for good: SIGKILL first, so it is pending when a frozen group
/// thaws (the task then dies before it runs another instruction of its own), then the thaw.
pub fn kill(vmm: &super::vmm_process::Pinned, stall: &Stall) {
    let pid = vmm.pid;
    vmm.kill();
    if let Stall::Frozen(group) = stall {
        let (file, thawed) = match group.join("freezer.state").exists() {
            true => ("freezer.state", "THAWED"),
            false => ("cgroup.freeze", "0"),
        };
        if let Err(e) = std::fs::write(group.join(file), thawed) {
            tracing::warn!(pid, group = %group.display(), error = %e,
                "could not thaw a frozen VMM's cgroup; it dies when the group thaws");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sys::signal::{Signal, kill as signal};
    use nix::unistd::Pid;

    struct Child(std::process::Child);
    impl Drop for Child {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    fn sleeper() -> Child {
        Child(
            std::process::Command::new("sleep")
                .arg("60")
                .spawn()
                .unwrap(),
        )
    }

    /// Polls for what the kernel shows after a signal, which lands asynchronously.
    fn eventually(pid: u32, want: Option<Stall>) {
        for _ in 0..500 {
            if stall(pid) == want {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        panic!("pid {pid}: {:?}, not {want:?}", stall(pid));
    }

    #[test]
    fn a_stopped_process_is_stalled_until_it_continues() {
        let child = sleeper();
        let pid = child.0.id();
        assert_eq!(stall(pid), None);
        signal(Pid::from_raw(pid as i32), Signal::SIGSTOP).unwrap();
        eventually(pid, Some(Stall::Stopped));
        signal(Pid::from_raw(pid as i32), Signal::SIGCONT).unwrap();
        eventually(pid, None);
    }

    #[test]
    fn frozen_groups_are_read_from_either_hierarchy() {
        let root = tempfile::tempdir().unwrap();
        let v1 = root.path().join("freezer/agentvm-vms/a");
        let v2 = root.path().join("system.slice/b");
        std::fs::create_dir_all(&v1).unwrap();
        std::fs::create_dir_all(&v2).unwrap();
        std::fs::write(v1.join("freezer.state"), "THAWED\n").unwrap();
        std::fs::write(v2.join("cgroup.events"), "populated 1\nfrozen 0\n").unwrap();
        let lines = "7:freezer:/agentvm-vms/a\n4:memory:/x\n0::/system.slice/b\n";
        assert_eq!(frozen_group(root.path(), lines), None);
        std::fs::write(v1.join("freezer.state"), "FREEZING\n").unwrap();
        assert_eq!(frozen_group(root.path(), lines), Some(v1.clone()));
        std::fs::write(v1.join("freezer.state"), "THAWED\n").unwrap();
        std::fs::write(v2.join("cgroup.events"), "populated 1\nfrozen 1\n").unwrap();
        assert_eq!(frozen_group(root.path(), lines), Some(v2));
        // A group without a state file (not a freezer mount) is not frozen.
        assert_eq!(frozen_group(root.path(), "3:freezer:/elsewhere\n"), None);
    }

    /// A real v1 freezer: the frozen process is found, and `kill` makes it go though a
    /// frozen task holds even SIGKILL.
    #[test]
    fn a_frozen_process_is_found_and_killed() {
        let freezer = Path::new(CGROUP_ROOT).join("freezer");
        if !nix::unistd::geteuid().is_root() || !freezer.join("cgroup.procs").exists() {
            eprintln!("SKIPPED: needs root and a cgroup v1 freezer hierarchy");
            return;
        }
        /// Thawed, emptied and removed however the test ends (a frozen member would hang the
        /// wait for it), so no frozen group is left behind.
        struct Frozen {
            group: PathBuf,
            child: Option<Child>,
        }
        impl Drop for Frozen {
            fn drop(&mut self) {
                let _ = std::fs::write(self.group.join("freezer.state"), "THAWED");
                drop(self.child.take());
                let _ = std::fs::remove_dir(&self.group);
            }
        }
        let group = freezer.join(format!("agentvm-test-stall-{}", std::process::id()));
        std::fs::create_dir(&group).unwrap();
        let mut frozen = Frozen {
            group: group.clone(),
            child: Some(sleeper()),
        };
        let pid = frozen.child.as_ref().unwrap().0.id();
        std::fs::write(group.join("cgroup.procs"), pid.to_string()).unwrap();
        std::fs::write(group.join("freezer.state"), "FROZEN").unwrap();
        eventually(pid, Some(Stall::Frozen(group.clone())));
        let pinned = super::super::vmm_process::Pinned::open(pid).unwrap();
        kill(&pinned, &Stall::Frozen(group.clone()));
        let status = frozen.child.as_mut().unwrap().0.wait().unwrap();
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(9)
        );
        drop(frozen);
        assert!(!group.exists());
    }
}
