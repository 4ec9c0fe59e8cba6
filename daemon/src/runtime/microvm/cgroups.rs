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
    /// v2 with the memory controller available to our subtree. `leaf`: where agentvmd moves
    /// itself so its own cgroup may hand controllers down (v2 allows no processes in a
    /// cgroup that does); none at the root, which is exempt.
    V2 {
        base: PathBuf,
        leaf: Option<PathBuf>,
    },
    /// No usable memory controller: VMMs run without cgroup limits (logged once).
    Unavailable(String),
}

const GROUP: &str = "agentvm-vms";
/// v2: the leaf cgroup agentvmd itself moves into (with Delegate=yes, the subtree is ours).
const DAEMON_LEAF: &str = "agentvmd";
/// v2: the controllers VMM cgroups use; memory is required, the others are taken if offered.
const V2_CONTROLLERS: [&str; 3] = ["memory", "cpu", "pids"];

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
                    leaf: (mine != root).then(|| mine.join(DAEMON_LEAF)),
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

    /// Makes the VMM cgroups' parent ready, once at start-up. v2 only: agentvmd moves into
    /// its leaf, then the controllers are enabled down to `agentvm-vms` (each cgroup's
    /// `cgroup.subtree_control`), so every VMM group gets memory.max, cpu.max and pids.max.
    pub fn prepare(&self) -> Result<(), String> {
        let Cgroups::V2 { base, leaf } = self else {
            return Ok(());
        };
        let write = |path: &Path, value: &str| {
            std::fs::write(path, value).map_err(|e| format!("{} = {value}: {e}", path.display()))
        };
        if let Some(leaf) = leaf {
            std::fs::create_dir_all(leaf)
                .map_err(|e| format!("creating {}: {e}", leaf.display()))?;
            write(&leaf.join("cgroup.procs"), &std::process::id().to_string())?;
        }
        std::fs::create_dir_all(base).map_err(|e| format!("creating {}: {e}", base.display()))?;
        let mine = base.parent().unwrap_or(base);
        let offered = std::fs::read_to_string(mine.join("cgroup.controllers")).unwrap_or_default();
        let enable: Vec<String> = V2_CONTROLLERS
            .iter()
            .filter(|c| offered.split_whitespace().any(|o| o == **c))
            .map(|c| format!("+{c}"))
            .collect();
        for dir in [mine, base.as_path()] {
            let control = dir.join("cgroup.subtree_control");
            // All at once; if one is refused, memory alone (the one a limit needs).
            write(&control, &enable.join(" ")).or_else(|_| write(&control, "+memory"))?;
        }
        Ok(())
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
            Cgroups::V2 { base, .. } => vec![("unified", base.join(session))],
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

    /// Renames `from`'s cgroups to `to` (the processes in them stay), all or none.
    pub fn rename(&self, from: &str, to: &str) -> Result<(), String> {
        let pairs: Vec<(PathBuf, PathBuf)> = self
            .dirs(from)
            .into_iter()
            .zip(self.dirs(to))
            .map(|((_, a), (_, b))| (a, b))
            .collect();
        for (done, (a, b)) in pairs.iter().enumerate() {
            if let Err(e) = std::fs::rename(a, b) {
                for (a, b) in &pairs[..done] {
                    let _ = std::fs::rename(b, a);
                }
                return Err(format!("renaming {} to {}: {e}", a.display(), b.display()));
            }
        }
        Ok(())
    }

    /// Removes `session`'s cgroups (they must be empty: the VMM has exited). Returns the ones
    /// still busy.
    pub fn remove(&self, session: &str) -> Vec<PathBuf> {
        let mut busy = Vec::new();
        for (_, dir) in self.dirs(session) {
            match std::fs::remove_dir(&dir) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) if e.raw_os_error() == Some(nix::errno::Errno::EBUSY as i32) => {
                    busy.push(dir)
                }
                Err(e) => tracing::warn!(dir = %dir.display(), error = %e,
                    "a VMM's cgroup could not be removed"),
            }
        }
        busy
    }

    /// `remove`, waiting out what outlives a VMM's last thread for a moment: KVM's own
    /// worker threads of the VM, which sit in its cgroups until the VM is torn down.
    pub async fn remove_settled(&self, session: &str) {
        const SETTLE: std::time::Duration = std::time::Duration::from_secs(3);
        let deadline = tokio::time::Instant::now() + SETTLE;
        loop {
            let busy = self.remove(session);
            if busy.is_empty() {
                return;
            }
            if tokio::time::Instant::now() >= deadline {
                for dir in busy {
                    tracing::warn!(dir = %dir.display(), "a VMM's cgroup is still busy; left");
                }
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
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
    fn a_rename_moves_every_hierarchy_or_none() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let cgroups = Cgroups::V1 {
            memory: root.join("memory"),
            cpu: Some(root.join("cpu")),
            pids: Some(root.join("pids")),
        };
        for (_, d) in cgroups.dirs("s1") {
            std::fs::create_dir_all(d).unwrap();
        }
        cgroups.rename("s1", ".retired-s1-7").unwrap();
        for ((_, old), (_, new)) in cgroups
            .dirs("s1")
            .into_iter()
            .zip(cgroups.dirs(".retired-s1-7"))
        {
            assert!(!old.exists() && new.is_dir(), "{} moved", old.display());
        }
        // One hierarchy cannot take the new name: the others are put back.
        for (_, d) in cgroups.dirs("s2") {
            std::fs::create_dir_all(d).unwrap();
        }
        std::fs::create_dir_all(root.join("pids/busy/child")).unwrap();
        let err = cgroups.rename("s2", "busy").unwrap_err();
        assert!(err.contains("pids"), "{err}");
        for (_, d) in cgroups.dirs("s2") {
            assert!(d.is_dir(), "{} is back", d.display());
        }
    }

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
                    .join("system.slice/agentvmd.service/agentvm-vms"),
                leaf: Some(v2root.path().join("system.slice/agentvmd.service/agentvmd")),
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

    #[test]
    fn v2_moves_agentvmd_into_a_leaf_and_hands_controllers_down() {
        let root = tempfile::tempdir().unwrap();
        let mine = root.path().join("system.slice/agentvmd.service");
        std::fs::create_dir_all(&mine).unwrap();
        std::fs::write(
            mine.join("cgroup.controllers"),
            "cpuset cpu io memory pids\n",
        )
        .unwrap();
        let cgroups = Cgroups::detect_in(root.path(), "0::/system.slice/agentvmd.service\n");
        cgroups.prepare().unwrap();
        let read = |p: &Path| std::fs::read_to_string(p).unwrap();
        assert_eq!(
            read(&mine.join("agentvmd/cgroup.procs")),
            std::process::id().to_string()
        );
        for dir in [mine.clone(), mine.join("agentvm-vms")] {
            assert_eq!(
                read(&dir.join("cgroup.subtree_control")),
                "+memory +cpu +pids",
                "{}",
                dir.display()
            );
        }
        let procs = cgroups
            .create(
                "s1",
                Limits {
                    memory_bytes: 64 << 20,
                    cpus: 2,
                    pids: 40,
                },
            )
            .unwrap();
        let group = mine.join("agentvm-vms/s1");
        assert_eq!(procs, vec![group.join("cgroup.procs")]);
        assert_eq!(read(&group.join("memory.max")), (64u64 << 20).to_string());
        assert_eq!(read(&group.join("cpu.max")), "200000 100000");
        assert_eq!(read(&group.join("pids.max")), "40");
        // At the root of the hierarchy nothing moves: the root may hold processes.
        std::fs::write(root.path().join("cgroup.controllers"), "memory\n").unwrap();
        assert_eq!(
            Cgroups::detect_in(root.path(), "0::/\n"),
            Cgroups::V2 {
                base: root.path().join("agentvm-vms"),
                leaf: None
            }
        );
    }
}
