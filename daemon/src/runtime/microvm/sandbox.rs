//! The cgroup each jailed VMM (see `jail.rs`) joins, with memory, CPU and pids limits: v1
//! or v2, detected at start-up.
//!
//! A guest that makes its VMM exceed the memory limit gets the VMM killed by the kernel's
//! OOM killer, alone; the exit watch then records the session's compute as lost.

use std::path::{Path, PathBuf};

/// Per-VMM limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub memory_bytes: u64,
    /// CPU time per period, in whole CPUs (a VMM with 2 vCPUs may use 2 CPUs).
    pub cpus: u32,
    pub pids: u32,
}

/// Where VMM cgroups go: under this daemon's own cgroup, in `agentvm-vms/`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cgroups {
    /// v1: one directory per controller.
    V1 {
        memory: PathBuf,
        cpu: Option<PathBuf>,
        pids: Option<PathBuf>,
    },
    /// v2 with the memory controller available to our subtree.
    V2 { base: PathBuf },
    /// No usable memory controller: VMMs run without cgroup limits (logged once).
    Unavailable(String),
}

const GROUP: &str = "agentvm-vms";

/// Our cgroup path for `controller` (v1) or the unified one (`""`, v2), from
/// `/proc/self/cgroup` lines `ID:CONTROLLERS:PATH`.
fn own_path(proc_cgroup: &str, controller: &str) -> Option<String> {
    proc_cgroup.lines().find_map(|l| {
        let mut parts = l.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let hit = if controller.is_empty() {
            controllers.is_empty()
        } else {
            controllers.split(',').any(|c| c == controller)
        };
        hit.then(|| path.to_owned())
    })
}

impl Cgroups {
    pub fn detect() -> Self {
        let proc_cgroup = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
        Self::detect_in(Path::new("/sys/fs/cgroup"), &proc_cgroup)
    }

    fn detect_in(root: &Path, proc_cgroup: &str) -> Self {
        let v1 = |controller: &str| {
            let mount = root.join(controller);
            let own = own_path(proc_cgroup, controller)?;
            mount
                .join("cgroup.procs")
                .exists()
                .then(|| mount.join(own.trim_start_matches('/')).join(GROUP))
        };
        if let Some(memory) = v1("memory") {
            return Cgroups::V1 {
                memory,
                cpu: v1("cpu"),
                pids: v1("pids"),
            };
        }
        if let Some(own) = own_path(proc_cgroup, "") {
            let mine = root.join(own.trim_start_matches('/'));
            let controllers =
                std::fs::read_to_string(mine.join("cgroup.controllers")).unwrap_or_default();
            if controllers.split_whitespace().any(|c| c == "memory") {
                return Cgroups::V2 {
                    base: mine.join(GROUP),
                };
            }
            return Cgroups::Unavailable(format!(
                "cgroup v2 offers no memory controller to {} (controllers: {:?})",
                mine.display(),
                controllers.trim()
            ));
        }
        Cgroups::Unavailable("no cgroup memory controller is mounted".into())
    }

    /// The cgroup directories of `session` (one per v1 controller, or the one v2 group).
    fn dirs(&self, session: &str) -> Vec<(&'static str, PathBuf)> {
        match self {
            Cgroups::V1 { memory, cpu, pids } => {
                let mut v = vec![("memory", memory.join(session))];
                if let Some(cpu) = cpu {
                    v.push(("cpu", cpu.join(session)));
                }
                if let Some(pids) = pids {
                    v.push(("pids", pids.join(session)));
                }
                v
            }
            Cgroups::V2 { base } => vec![("unified", base.join(session))],
            Cgroups::Unavailable(_) => Vec::new(),
        }
    }

    /// Creates `session`'s cgroups with `limits`; returns the `cgroup.procs` files the VMM
    /// must join.
    pub fn create(&self, session: &str, limits: Limits) -> Result<Vec<PathBuf>, String> {
        let mut procs = Vec::new();
        for (kind, dir) in self.dirs(session) {
            std::fs::create_dir_all(&dir)
                .map_err(|e| format!("creating {}: {e}", dir.display()))?;
            let write = |file: &str, value: String| {
                std::fs::write(dir.join(file), &value)
                    .map_err(|e| format!("{}/{file} = {value}: {e}", dir.display()))
            };
            let period = 100_000u64;
            match kind {
                "memory" => write("memory.limit_in_bytes", limits.memory_bytes.to_string())?,
                "cpu" => {
                    write("cpu.cfs_period_us", period.to_string())?;
                    write(
                        "cpu.cfs_quota_us",
                        (period * u64::from(limits.cpus)).to_string(),
                    )?;
                }
                "pids" => write("pids.max", limits.pids.to_string())?,
                _ => {
                    write("memory.max", limits.memory_bytes.to_string())?;
                    // Controllers the parent does not delegate are left alone.
                    let _ = write("pids.max", limits.pids.to_string());
                    let _ = write(
                        "cpu.max",
                        format!("{} {period}", period * u64::from(limits.cpus)),
                    );
                }
            }
            procs.push(dir.join("cgroup.procs"));
        }
        Ok(procs)
    }

    /// Removes `session`'s cgroups (they must be empty: the VMM has exited).
    pub fn remove(&self, session: &str) {
        for (_, dir) in self.dirs(session) {
            let _ = std::fs::remove_dir(&dir);
        }
    }
}

/// Moves process `pid`, with all its threads, into the cgroups behind `procs`
/// (`cgroup.procs` files). Done from outside, while the VMM starts: a migration waits for an
/// RCU grace period (about 12 ms here), which would otherwise delay every VMM's start.
pub fn join(procs: &[PathBuf], pid: u32) -> Result<(), String> {
    for path in procs {
        std::fs::write(path, pid.to_string())
            .map_err(|e| format!("joining {}: {e}", path.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v1_and_v2_layouts_are_recognised() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        for c in ["memory", "cpu", "pids"] {
            std::fs::create_dir_all(root.join(c)).unwrap();
            std::fs::write(root.join(c).join("cgroup.procs"), "").unwrap();
        }
        let v1 = "4:memory:/process_api/abc\n1:cpu:/\n8:pids:/\n0::/\n";
        assert_eq!(
            Cgroups::detect_in(root, v1),
            Cgroups::V1 {
                memory: root.join("memory/process_api/abc/agentvm-vms"),
                cpu: Some(root.join("cpu/agentvm-vms")),
                pids: Some(root.join("pids/agentvm-vms")),
            }
        );
        let v2root = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(v2root.path().join("system.slice/agentvmd.service")).unwrap();
        std::fs::write(
            v2root
                .path()
                .join("system.slice/agentvmd.service/cgroup.controllers"),
            "cpu memory pids\n",
        )
        .unwrap();
        assert_eq!(
            Cgroups::detect_in(v2root.path(), "0::/system.slice/agentvmd.service\n"),
            Cgroups::V2 {
                base: v2root
                    .path()
                    .join("system.slice/agentvmd.service/agentvm-vms")
            }
        );
        std::fs::write(
            v2root
                .path()
                .join("system.slice/agentvmd.service/cgroup.controllers"),
            "",
        )
        .unwrap();
        assert!(matches!(
            Cgroups::detect_in(v2root.path(), "0::/system.slice/agentvmd.service\n"),
            Cgroups::Unavailable(_)
        ));
    }
}
