//! What each VMM of the runtime gets around it: its directories, owned by a uid no other VMM
//! has; the jail that shows it only them and its VM's files; its cgroups with limits.
//! Needs root; a runtime without confinement (configured off, or not root) runs VMMs as
//! plain child processes.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use super::MicrovmConfig;
use super::cgroups::{Cgroups, Limits};
use super::fast_moves::{self, FastMoves};
use super::flavour::VmmFlavour;
use super::jail::{self, Jail};
use super::vmm_process::{self, VmmDir};

/// How many uids from `vm_uid_base` jailed VMMs may take (more than a node runs VMs).
pub const VM_UIDS: u32 = 65_536;
/// The default `vm_uid_base`: just above the range systemd-nspawn gives containers
/// (0x80000–0x6FFFFFFF), below 2^31.
pub const DEFAULT_VM_UID_BASE: u32 = 0x7000_0000;
/// The directory, in the run directory, every jail's root is mounted on (privately).
const JAIL_STAGING: &str = ".jail";

/// What every jail of the runtime shares.
struct JailBase {
    staging: PathBuf,
    uid_base: u32,
    /// Host library directories, when the VMM binary is dynamically linked.
    libraries: Vec<PathBuf>,
    /// Read-only host paths every VMM needs besides its VM's files.
    readable: Vec<PathBuf>,
    /// Whether each jail gets the host's /dev/userfaultfd, owned by its VMM's uid.
    userfaultfd: bool,
    /// Held while a uid is chosen and its directory made, so two VMMs never share one.
    uid_lock: Mutex<()>,
}

pub struct Confinement {
    run_dir: PathBuf,
    jail: Option<JailBase>,
    cgroups: Option<Arc<Cgroups>>,
    limits: Limits,
    /// Whether VMMs may open a userfaultfd (see [`userfaultfd_for`]).
    userfaultfd: bool,
    /// Held while v1 cgroups are in use, so a new VMM's move into them is quick.
    _fast_moves: Option<FastMoves>,
}

/// The host's userfaultfd device (Linux 6.1 and later), which opens a userfaultfd to
/// whoever may open it.
const USERFAULTFD_DEVICE: &str = "/dev/userfaultfd";
/// When 1, any user may make the userfaultfd(2) system call.
const UNPRIVILEGED_USERFAULTFD: &str = "/proc/sys/vm/unprivileged_userfaultfd";

/// Whether a VMM of `flavour` may open a userfaultfd here, jailed or not (as this process's
/// user): through the system call when the sysctl opens it to every user or the VMM runs as
/// root, or through /dev/userfaultfd, which a jail is given for a VMM that uses it. Only
/// Cloud Hypervisor's lazy restore needs one.
fn userfaultfd_for(flavour: VmmFlavour, jailed: bool) -> bool {
    if flavour != VmmFlavour::CloudHypervisor {
        return false;
    }
    let sysctl = std::fs::read_to_string(UNPRIVILEGED_USERFAULTFD).is_ok_and(|v| v.trim() == "1");
    let device = Path::new(USERFAULTFD_DEVICE);
    let granted = match jailed {
        true => std::fs::metadata(device).is_ok_and(|m| {
            use std::os::unix::fs::FileTypeExt;
            m.file_type().is_char_device()
        }),
        false => {
            nix::unistd::geteuid().is_root()
                || nix::unistd::access(
                    device,
                    nix::unistd::AccessFlags::R_OK | nix::unistd::AccessFlags::W_OK,
                )
                .is_ok()
        }
    };
    sysctl || granted
}

fn create(path: &Path) -> Result<(), String> {
    std::fs::create_dir_all(path).map_err(|e| format!("creating {}: {e}", path.display()))
}

impl Confinement {
    /// Sets up confinement for the runtime `config` describes, every VMM under `limits`.
    pub fn new(config: &MicrovmConfig, limits: Limits) -> Result<Self, String> {
        let root = nix::unistd::geteuid().is_root();
        if config.confine && !root {
            tracing::warn!(
                "agentvmd is not running as root: VMMs run without their jail and cgroups"
            );
        }
        let on = config.confine && root;
        let mut this = Self {
            run_dir: config.run_dir.clone(),
            jail: None,
            cgroups: None,
            limits,
            userfaultfd: userfaultfd_for(config.flavour, on),
            _fast_moves: None,
        };
        if !on {
            return Ok(this);
        }
        let mut cgroups = Cgroups::detect();
        if let Err(why) = cgroups.prepare() {
            cgroups = Cgroups::Unavailable(why);
        }
        if let Cgroups::Unavailable(why) = &cgroups {
            tracing::warn!(%why, "VMMs run without cgroup limits");
        }
        if let Cgroups::V1 { .. } = &cgroups {
            match fast_moves::favor(&config.run_dir) {
                Ok(held) => this._fast_moves = Some(held),
                Err(why) => tracing::warn!(
                    %why,
                    "cgroup moves wait for an RCU grace period: each VM start takes ~10 ms longer"
                ),
            }
        }
        this.cgroups = Some(Arc::new(cgroups));
        let uid_base = config.vm_uid_base;
        if uid_base == 0 || uid_base.checked_add(VM_UIDS).is_none() {
            return Err(format!(
                "vm_uid_base {uid_base} leaves no room for {VM_UIDS} unprivileged uids"
            ));
        }
        let builds = crate::image::sandbox::BUILD_UID_BASE
            ..crate::image::sandbox::BUILD_UID_BASE + crate::image::sandbox::BUILD_UIDS;
        if uid_base < builds.end && builds.start < uid_base + VM_UIDS {
            return Err(format!(
                "vm_uid_base {uid_base}: its {VM_UIDS} uids overlap those image builds run \
                 as ({}..{})",
                builds.start, builds.end
            ));
        }
        let staging = config.run_dir.join(JAIL_STAGING);
        create(&staging)?;
        this.jail = Some(JailBase {
            staging,
            uid_base,
            libraries: jail::library_dirs_for(&config.vmm_binary),
            // How the VMM tells PVM from hardware KVM.
            readable: [PathBuf::from("/sys/module/kvm_pvm")]
                .into_iter()
                .filter(|p| p.exists())
                .collect(),
            userfaultfd: this.userfaultfd,
            uid_lock: Mutex::new(()),
        });
        Ok(this)
    }

    pub fn jailed(&self) -> bool {
        self.jail.is_some()
    }

    /// Whether VMMs may open a userfaultfd (granted in their jail if it takes a device).
    pub fn userfaultfd(&self) -> bool {
        self.userfaultfd
    }

    pub fn remove_cgroups(&self, session: &str) {
        if let Some(cgroups) = &self.cgroups {
            cgroups.remove(session);
        }
    }

    /// `remove_cgroups` once the VM's last traces in them are gone (see
    /// `Cgroups::remove_settled`).
    /// The cgroups VMMs are put in, for removing a session's after this runtime call ends.
    pub fn cgroups(&self) -> Option<Arc<Cgroups>> {
        self.cgroups.clone()
    }

    pub async fn remove_cgroups_settled(&self, session: &str) {
        if let Some(cgroups) = &self.cgroups {
            cgroups.remove_settled(session).await;
        }
    }

    /// What confines VMMs here (the node status's `vmm_isolation`).
    pub fn isolation(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.jailed() {
            out.push("jail".to_owned());
        }
        match self.cgroups.as_deref() {
            Some(Cgroups::V1 { .. }) => out.push("cgroup-v1".to_owned()),
            Some(Cgroups::V2 { .. }) => out.push("cgroup-v2".to_owned()),
            _ => {}
        }
        // Both VMMs filter their threads' system calls: agentvmd never passes agentvm-vmm's
        // --no-seccomp, nor Cloud Hypervisor's --seccomp false.
        out.push("seccomp".to_owned());
        out
    }

    /// Makes the directories of `session`'s VMM in `dir` and, when confined, the jail that
    /// shows it only them and `files`, and its cgroups (returned as their `cgroup.procs`).
    pub fn prepare(
        &self,
        session: &str,
        dir: &VmmDir,
        files: Vec<PathBuf>,
    ) -> Result<(Option<Jail>, Vec<PathBuf>), String> {
        let Some(base) = &self.jail else {
            create(&dir.dir)?;
            return Ok((None, Vec::new()));
        };
        let uid = self.own_dirs(base, dir)?;
        let cgroup_procs = self.create_cgroups(session)?;
        let jail = Jail {
            staging: base.staging.clone(),
            uid,
            gid: uid,
            writable: vec![dir.dir.clone(), dir.ram.clone()],
            readable: files.into_iter().chain(base.readable.clone()).collect(),
            libraries: base.libraries.clone(),
            userfaultfd: base.userfaultfd,
        };
        Ok((Some(jail), cgroup_procs))
    }

    /// `session`'s cgroups with the runtime's limits, as their `cgroup.procs` (none without
    /// cgroups).
    fn create_cgroups(&self, session: &str) -> Result<Vec<PathBuf>, String> {
        match &self.cgroups {
            Some(cgroups) => cgroups.create(session, self.limits),
            None => Ok(Vec::new()),
        }
    }

    /// Makes `dir` and its RAM directory, owned (mode 0700) by the lowest uid from the base
    /// that no other VMM directory has; returns it. The owners of the directories are the
    /// record, so a restarted daemon knows the uids in use.
    fn own_dirs(&self, base: &JailBase, dir: &VmmDir) -> Result<u32, String> {
        let _held = base.uid_lock.lock().unwrap_or_else(|p| p.into_inner());
        let uid = self.free_uid(base)?;
        own(&[&dir.dir, &dir.ram], uid)?;
        Ok(uid)
    }

    /// The lowest uid from the base that no VMM directory (a session's, a stopping VMM's or
    /// a pooled one's) is owned by. Call with `uid_lock` held until a directory owns it.
    fn free_uid(&self, base: &JailBase) -> Result<u32, String> {
        // A VMM still on its way out keeps its uid until it is gone.
        let taken: std::collections::HashSet<u32> = vmm_process::sessions(&self.run_dir)
            .iter()
            .chain(&vmm_process::retired(&self.run_dir))
            .map(|s| self.run_dir.join(s))
            .chain(super::pool::slots(&self.run_dir))
            .filter_map(|path| std::fs::metadata(path).ok())
            .map(|m| m.uid())
            .collect();
        (base.uid_base..base.uid_base + VM_UIDS)
            .find(|uid| !taken.contains(uid))
            .ok_or_else(|| "every VM uid is taken".to_owned())
    }

    /// A directory for a VMM started ahead of its session (`RUN_DIR/.pool-UID`, owned by
    /// the uid it gets) and the jail it starts in: its own uid, devices and namespaces, and
    /// none of any session's files. Confined VMMs only.
    pub fn pooled_jail(&self) -> Result<(PathBuf, Jail), String> {
        let Some(base) = &self.jail else {
            return Err("VMMs here run without a jail".to_owned());
        };
        let _held = base.uid_lock.lock().unwrap_or_else(|p| p.into_inner());
        let uid = self.free_uid(base)?;
        let slot = self
            .run_dir
            .join(format!("{}{uid}", super::pool::SLOT_PREFIX));
        own(&[&slot], uid)?;
        let jail = Jail {
            staging: base.staging.clone(),
            uid,
            gid: uid,
            writable: Vec::new(),
            readable: base.readable.clone(),
            libraries: base.libraries.clone(),
            userfaultfd: base.userfaultfd,
        };
        Ok((slot, jail))
    }

    /// Gives `session` the pooled VMM `pooled`: its directories in `dir`, owned by the
    /// VMM's uid, shown to it read-write and `files` read-only (as `prepare` would have had
    /// its jail show them), and its cgroups (returned as their `cgroup.procs`).
    pub fn claim(
        &self,
        session: &str,
        dir: &VmmDir,
        files: Vec<PathBuf>,
        pooled: &super::pool::Pooled,
    ) -> Result<Vec<PathBuf>, String> {
        let Some(base) = &self.jail else {
            return Err("VMMs here run without a jail".to_owned());
        };
        let started = std::time::Instant::now();
        {
            let _held = base.uid_lock.lock().unwrap_or_else(|p| p.into_inner());
            own(&[&dir.dir, &dir.ram], pooled.uid)?;
        }
        let owned = started.elapsed();
        let cgroup_procs = self.create_cgroups(session)?;
        let grouped = started.elapsed();
        jail::inject(pooled.pid, &[dir.dir.clone(), dir.ram.clone()], &files)?;
        tracing::debug!(
            session,
            owned_ms = owned.as_secs_f64() * 1e3,
            cgroups_ms = grouped.as_secs_f64() * 1e3,
            shown_ms = started.elapsed().as_secs_f64() * 1e3,
            "pooled VMM claimed"
        );
        Ok(cgroup_procs)
    }
}

/// Makes each of `paths` a directory owned by `uid` alone (mode 0700).
fn own(paths: &[&PathBuf], uid: u32) -> Result<(), String> {
    for path in paths {
        create(path)?;
        std::os::unix::fs::chown(path, Some(uid), Some(uid))
            .map_err(|e| format!("chown {} {uid}: {e}", path.display()))?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| format!("chmod {}: {e}", path.display()))?;
    }
    Ok(())
}
