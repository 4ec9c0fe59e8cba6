//! Fast cgroup moves for new VMMs under cgroup v1.
//!
//! Moving a process between v1 cgroups write-locks the kernel's thread-group rwsem, whose
//! fast (per-CPU) reader mode makes every writer wait for an RCU grace period first: 10 to
//! 20 ms on our machines for the memory controller, on the path of every VM start, restore
//! and fork child. The `favordynmods` option of a cgroup hierarchy (Linux 6.0 and later)
//! switches that rwsem to its slow reader mode for as long as the hierarchy exists, which
//! makes a move take about 0.1 ms and forks and exits on the host a little dearer. On a
//! node built to start VMs, that is the right trade.
//!
//! The rwsem is global, so any hierarchy with the option will do: agentvmd mounts an empty
//! named one (no controllers), keeps a descriptor on it and detaches the mount at once. The
//! hierarchy lives exactly as long as the descriptor, that is as long as this daemon, and
//! nothing is left mounted behind it, even after `kill -9`.

use std::fs::File;
use std::path::Path;

/// The hierarchy's name: every agentvmd of a host shares it (a second mount by the same
/// name and options joins the first).
const HIERARCHY: &str = "agentvm-favordynmods";

/// Holds cgroup moves fast while it lives.
#[derive(Debug)]
pub struct FastMoves {
    _hierarchy: File,
}

/// Mounts the hierarchy on a fresh directory under `run_dir`, keeps it open and detaches
/// it. Fails on kernels without the option and without the privilege to mount.
pub fn favor(run_dir: &Path) -> Result<FastMoves, String> {
    let at = run_dir.join(format!(".{HIERARCHY}-{}", std::process::id()));
    std::fs::create_dir_all(&at).map_err(|e| format!("creating {}: {e}", at.display()))?;
    let held = mount_and_open(&at);
    // Detached (or never mounted): the directory is only a name now.
    let _ = std::fs::remove_dir(&at);
    held.map(|hierarchy| FastMoves {
        _hierarchy: hierarchy,
    })
}

fn mount_and_open(at: &Path) -> Result<File, String> {
    use nix::mount::{MntFlags, MsFlags, mount, umount2};
    let options = format!("none,name={HIERARCHY},favordynmods");
    mount(
        Some("cgroup"),
        at,
        Some("cgroup"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        Some(options.as_str()),
    )
    .map_err(|e| {
        format!(
            "mounting a favordynmods cgroup hierarchy on {}: {e}",
            at.display()
        )
    })?;
    let opened = File::open(at).map_err(|e| format!("opening {}: {e}", at.display()));
    umount2(at, MntFlags::MNT_DETACH)
        .map_err(|e| format!("detaching the cgroup hierarchy at {}: {e}", at.display()))?;
    opened
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root() -> bool {
        nix::unistd::geteuid().is_root()
    }

    fn mounted_hierarchy() -> bool {
        std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap_or_default()
            .contains(&format!("name={HIERARCHY}"))
    }

    /// Every process is listed in each v1 hierarchy that exists, mounted or not.
    fn hierarchy_exists() -> bool {
        std::fs::read_to_string("/proc/self/cgroup")
            .unwrap_or_default()
            .lines()
            .any(|l| l.split(':').nth(1) == Some(&format!("name={HIERARCHY}")))
    }

    #[test]
    fn the_hierarchy_lives_detached_and_nothing_stays_mounted() {
        if !root() {
            println!("SKIPPED: mounting a cgroup hierarchy needs root");
            return;
        }
        let run = tempfile::tempdir().unwrap();
        let held = match favor(run.path()) {
            Ok(held) => held,
            Err(e) if e.contains("Invalid argument") => {
                println!("SKIPPED: this kernel has no favordynmods ({e})");
                return;
            }
            Err(e) => panic!("{e}"),
        };
        assert!(hierarchy_exists(), "the hierarchy outlives its mount");
        assert!(!mounted_hierarchy(), "the hierarchy is detached at once");
        // A second holder joins the same hierarchy rather than failing on its name.
        let second = favor(run.path()).unwrap();
        assert_eq!(
            std::fs::read_dir(run.path()).unwrap().count(),
            0,
            "no mount point is left in the run directory"
        );
        drop(second);
        drop(held);
    }
}
