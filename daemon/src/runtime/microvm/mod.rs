//! The `microvm` runtime: each session's harness runs inside its own KVM microVM, one
//! agentvm-vmm process per session, driven only through the VMM's Cloud Hypervisor API.
//!
//! - Create: spawn a VMM, `vm.create` + `vm.boot` the session's image, wait for the guest
//!   agent's Ready over hybrid vsock.
//! - Suspend (EXTERNAL snapshot): pause → `vm.snapshot` into the snapshot store → stop the VMM.
//! - Resume/restore and fork: a fresh VMM `vm.restore`s the snapshot (memory mapped
//!   copy-on-write, so children of one snapshot share its pages), then the guest is sent its
//!   Restored notice — fresh entropy, the host's clock, its (new) identity — before anything
//!   else reaches it.
//! - The harness channel is the guest frame protocol ([`guest::GuestEndpoint`]).

pub mod bundles;
pub mod cgroups;
mod confinement;
pub mod exit_watch;
mod failed_starts;
mod fast_moves;
pub mod flavour;
mod fleet_templates;
pub mod guest;
pub mod jail;
pub mod network;
mod pool;
pub mod remote;
mod stall;
pub mod templates;
mod turn_checkpoints;
pub mod vmm_process;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use agentvm_proto::guest::v1::restored::Kind as RestoredKind;
use agentvm_proto::guest::v1::{Identity, Restored};
use agentvm_proto::v1::{RuntimeCapabilities, SnapshotRef};
use agentvm_snapshot::LocalStore;
use agentvm_vmm_api::config::{
    ConsoleOutputMode, CpusConfig, DiskConfig, MemoryConfig, SerialConfig, VmConfig, VsockConfig,
};
use rand::RngCore;

use self::cgroups::Limits;
use self::confinement::Confinement;
pub use self::confinement::{DEFAULT_VM_UID_BASE, VM_UIDS};
use self::exit_watch::ExitWatch;
use self::flavour::VmmFlavour;
use self::guest::{GuestConn, GuestEndpoint};
use self::vmm_process::VmmDir;
use super::{
    ForkOpts, Incarnation, ObservedState, Result, Runtime, RuntimeError, SessionSpec, SnapshotKind,
    SnapshotOwner,
};
use crate::controller::endpoint::HarnessEndpoint;

/// The workspace disk's device id and the serial its guest sees.
const WORKSPACE: &str = "workspace";
/// The same for a container image's root filesystem.
const ROOTFS: &str = "rootfs";

/// The runtime's name, as sessions and node status name it.
pub const NAME: &str = "microvm";
/// Guest CID: with hybrid vsock it is visible only inside the guest, so every VM may use it.
const GUEST_CID: u32 = 3;

/// A kernel that boots into a guest serving `harness`.
#[derive(Debug, Clone, Default)]
pub struct GuestImage {
    pub harness: String,
    pub kernel: PathBuf,
    pub initramfs: Option<PathBuf>,
    /// Appended to the kernel command line (how one image serves several harnesses).
    pub cmdline: String,
    /// The harness keeps state in RAM (REQUIRES_MEMORY_SNAPSHOT). A stateless one is
    /// suspended by stopping its VM, and resumed by replay into a fresh one.
    pub memory_snapshot: bool,
    /// The image's own VM size, where it asks for one (else the runtime's default).
    pub vcpus: Option<u8>,
    pub memory_mib: Option<u64>,
    /// A writable disk of this many MiB per session (0: none), blank at first boot; its
    /// snapshots carry a copy, so it follows the session through suspend, resume and fork.
    pub workspace_mib: u64,
    /// What a new session's workspace starts as (a formatted filesystem); blank without.
    pub workspace_template: Option<PathBuf>,
    /// A container image's root filesystem, attached read-only (serial `rootfs`) to every VM
    /// of the image, which all share it through the host's page cache.
    pub rootfs: Option<PathBuf>,
    /// `[network] enabled`: each VM gets a network device and what the image allows.
    pub network: Option<network::ImageNetwork>,
    /// Its kernel is Linux (a PVM host boots it only if it is a PVM guest kernel).
    pub linux_kernel: bool,
    /// `[vm] cold_boot`: every session boots the image; it has no template.
    pub cold_boot: bool,
    /// `[vm] checkpoints`: which turns of its sessions stay fork points, if the image says.
    pub checkpoints: Option<String>,
}

/// What the runtime needs from the node.
#[derive(Debug, Clone)]
pub struct MicrovmConfig {
    /// The VMM binary, of `flavour`.
    pub vmm_binary: PathBuf,
    pub flavour: VmmFlavour,
    /// Per-session VMM directories (API and vsock sockets, serial log).
    pub run_dir: PathBuf,
    /// Where guest RAM files live (a tmpfs).
    pub ram_dir: PathBuf,
    /// Snapshot store root.
    pub snapshot_dir: PathBuf,
    /// The guest image that serves each harness.
    pub images: Vec<GuestImage>,
    pub vcpus: u8,
    pub memory_mib: u64,
    /// The guest protocol's deadlines (a booted or restored guest's first answer, the
    /// guest agent's replies).
    pub guest_timeouts: guest::GuestTimeouts,
    /// The bound on each call to a VMM's API.
    pub vmm_api_timeout: Duration,
    /// Run each VMM jailed (jail.rs, cgroups.rs): its own uid, cgroup with limits, mount,
    /// PID, network, IPC and UTS namespaces, rlimits.
    pub confine: bool,
    /// The first of the uids (and gids) given to jailed VMMs, one each.
    pub vm_uid_base: u32,
    /// The memory limit of each VMM's cgroup. Default: the largest guest memory of any image
    /// plus 128 MiB for the VMM itself.
    pub memory_limit_mib: Option<u64>,
    /// Where snapshots are published for the whole fleet (`remote.rs`); `None`: they stay in
    /// this node's store.
    pub snapshot_remote: Option<remote::SnapshotRemote>,
    /// The node's disk reserve: a fetch from the fleet's store never writes below it.
    pub min_free_disk_bytes: u64,
    /// How many jailed VMMs wait, started, for the next create, resume or fork child
    /// (`pool.rs`); 0 starts each when it is needed. Confined agentvm-vmm VMMs only.
    pub vmm_pool: usize,
    /// New sessions start from their image's template (`templates.rs`) where it can serve
    /// them; `false` boots every one.
    pub templates: bool,
}

/// The default `vmm_pool`: none. On a 2-core host a claim (showing the jail its files,
/// moving it into its cgroups) and the refill behind it cost about what starting a VMM
/// does (see the README's figures); hosts with cores to spare can turn it on.
pub const DEFAULT_VMM_POOL: usize = 0;

/// Prefix of the directories and cgroups of a VMM on its way out (see `retire_vmm`).
pub(super) const RETIRED: &str = ".retired-";
/// How old a snapshot of no known session must be before a sweep deletes it: longer than
/// any fork takes to write the children it was taken for.
const ORPHAN_GRACE: Duration = Duration::from_secs(15 * 60);

/// What a VMM costs beyond its guest's RAM, in the default cgroup limit.
const VMM_MEMORY_OVERHEAD_MIB: u64 = 128;

pub struct MicrovmRuntime {
    config: MicrovmConfig,
    store: LocalStore,
    next_snapshot: AtomicU64,
    /// Drawn at random when the runtime starts (base 36), for the ids of its snapshots: a
    /// PID repeats on other nodes of a fleet, and after a reboot on this one.
    snapshot_epoch: String,
    exits: ExitWatch,
    confinement: Arc<Confinement>,
    /// VMMs started ahead of their VMs; `None` when there is no pool.
    pool: Option<pool::Pool>,
    /// The stream each new VM answered Ready on, handed to its endpoint at the first dial
    /// (so a first turn costs no second vsock dial and Hello).
    ready_conns: std::sync::Mutex<std::collections::HashMap<String, GuestConn>>,
    /// VMMs a suspend asked to exit, still on their way out (their files and cgroups go
    /// once they have): the session's next VMM waits for that.
    retiring: std::sync::Mutex<std::collections::HashMap<String, tokio::task::JoinHandle<()>>>,
    /// Held while a snapshot is fetched from the fleet's store: the children of one fork
    /// restore the same snapshot at once, and it is fetched once.
    fetching: tokio::sync::Mutex<()>,
    networks: network::Networks,
    templates: Arc<templates::Templates>,
    /// The fleet's shared journal, where other nodes say which templates they published.
    fleet_journal: std::sync::OnceLock<Arc<dyn crate::journal::Journal>>,
    /// The host CPU as a template's key names it.
    cpu: String,
    /// What each session's next turn checkpoint is layered on.
    last_checkpoints: turn_checkpoints::LastCheckpoints,
}

/// A lock whose holder panicked still guards plain data: go on with it.
fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The limits every VMM of this runtime runs under.
fn limits(config: &MicrovmConfig) -> Limits {
    let guest_mib = config
        .images
        .iter()
        .filter_map(|i| i.memory_mib)
        .chain([config.memory_mib])
        .max()
        .unwrap_or(config.memory_mib);
    let vcpus = config
        .images
        .iter()
        .filter_map(|i| i.vcpus)
        .chain([config.vcpus])
        .max()
        .unwrap_or(1);
    Limits {
        memory_bytes: config
            .memory_limit_mib
            .unwrap_or(guest_mib + VMM_MEMORY_OVERHEAD_MIB)
            << 20,
        cpus: u32::from(vcpus),
        pids: 32 + u32::from(vcpus),
    }
}

/// A pool of `config.vmm_pool` jailed agentvm-vmm VMMs, started ahead of their VMs.
fn vmm_pool(
    config: &MicrovmConfig,
    confinement: Arc<Confinement>,
) -> std::result::Result<pool::Pool, String> {
    use std::os::fd::AsFd;
    let binary = config.vmm_binary.clone();
    // Each pooled VMM holds the read end: once this process is gone (however it ended), the
    // ones no session claimed exit on their own.
    let (anchor, anchor_writer) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
        .map_err(|e| format!("a pipe for the VMM pool: {e}"))?;
    Ok(pool::Pool::new(
        config.vmm_pool,
        Box::new(move || {
            // Open for as long as the pool can start VMMs.
            let _writer = &anchor_writer;
            let (slot, jail) = confinement.pooled_jail()?;
            let launched = vmm_process::launch(
                &binary,
                VmmFlavour::Agentvm,
                &slot,
                // Told at the claim (vmm.ram-dir).
                Path::new("none"),
                Some(&jail),
                Some(anchor.as_fd()),
            );
            let pooled = match launched {
                Ok(pid) => pool::Pooled {
                    pid,
                    uid: jail.uid,
                    slot,
                },
                Err(e) => {
                    let _ = std::fs::remove_dir_all(&slot);
                    return Err(e);
                }
            };
            // Its first call costs it a thread: paid here, not by the claim.
            let client = agentvm_vmm_api::VmmClient::new(pooled.api());
            let ready = tokio::runtime::Handle::current()
                .block_on(client.wait_ready(vmm_process::READY_TIMEOUT));
            match ready {
                Ok(_) => Ok(pooled),
                Err(e) => {
                    pooled.discard();
                    Err(format!("a pooled VMM did not come up: {e}"))
                }
            }
        }),
    ))
}

/// A failure, by what it means for the caller. The VMM and the snapshot store report theirs
/// as text (over HTTP, through the jail), so the kinds that need their own status are told
/// apart by the messages those produce.
fn failed(session: &str, reason: impl Into<String>) -> RuntimeError {
    let reason = reason.into();
    let session = session.to_owned();
    const NO_SPACE: [&str; 2] = ["No space left on device", "os error 28"];
    const HUNG: [&str; 1] = ["no answer within"];
    const CORRUPT: [&str; 4] = [
        "does not match its digest",
        "is listed in the manifest but missing",
        "the manifest says",
        "manifest.json:",
    ];
    let has = |needles: &[&str]| needles.iter().any(|n| reason.contains(n));
    if has(&NO_SPACE) {
        RuntimeError::NoSpace {
            runtime: NAME,
            session,
            what: reason,
        }
    } else if has(&CORRUPT) {
        RuntimeError::Corrupt {
            runtime: NAME,
            session,
            reason,
        }
    } else if has(&HUNG) {
        RuntimeError::Hung {
            runtime: NAME,
            session,
            reason,
        }
    } else {
        RuntimeError::Failed {
            runtime: NAME,
            session,
            reason,
        }
    }
}

impl MicrovmRuntime {
    pub fn new(config: MicrovmConfig) -> std::result::Result<Self, String> {
        let store = LocalStore::open(&config.snapshot_dir)
            .map_err(|e| format!("snapshot store {}: {e}", config.snapshot_dir.display()))?;
        std::fs::create_dir_all(&config.run_dir)
            .map_err(|e| format!("creating {}: {e}", config.run_dir.display()))?;
        let confinement = Arc::new(Confinement::new(&config, limits(&config))?);
        let pool = match config.vmm_pool > 0
            && confinement.jailed()
            && config.flavour == VmmFlavour::Agentvm
        {
            true => Some(vmm_pool(&config, confinement.clone())?),
            false => None,
        };
        let exits = ExitWatch::default();
        Ok(Self {
            config,
            store,
            next_snapshot: AtomicU64::new(0),
            snapshot_epoch: base36(rand::random()),
            exits,
            confinement,
            pool,
            ready_conns: Default::default(),
            retiring: Default::default(),
            fetching: Default::default(),
            networks: Default::default(),
            templates: Default::default(),
            fleet_journal: Default::default(),
            cpu: templates::host_cpu(),
            last_checkpoints: Default::default(),
        })
    }

    /// Where the consoles of failed starts are kept: beside the VMM directories.
    fn failed_starts_dir(&self) -> PathBuf {
        self.config
            .run_dir
            .parent()
            .unwrap_or(&self.config.run_dir)
            .join("failed-starts")
    }

    fn vmm_dir(&self, session: &str) -> VmmDir {
        let run = self.config.run_dir.join(session);
        match self.confinement.jailed() {
            // A RAM directory of its own: a jailed VMM sees nobody else's.
            true => VmmDir::new(
                run,
                self.config.flavour,
                self.config.ram_dir.join(format!("agentvm-{session}")),
                true,
            ),
            false => VmmDir::new(run, self.config.flavour, self.config.ram_dir.clone(), false),
        }
        .with_api_timeout(self.config.vmm_api_timeout)
    }

    /// Each running VMM's session and proportional set size in bytes (for metrics).
    /// Whether a VM can be started now (what `/readyz` asks): the VMM binary is there and
    /// executable, and the RAM directory exists.
    pub fn ready(&self) -> std::result::Result<(), String> {
        use std::os::unix::fs::PermissionsExt;
        let vmm = &self.config.vmm_binary;
        match std::fs::metadata(vmm) {
            Ok(m) if m.is_file() && m.permissions().mode() & 0o111 != 0 => {}
            Ok(_) => {
                return Err(format!(
                    "the VMM {} is not an executable file",
                    vmm.display()
                ));
            }
            Err(e) => return Err(format!("the VMM {}: {e}", vmm.display())),
        }
        if !self.config.ram_dir.is_dir() {
            return Err(format!(
                "the RAM directory {} is missing",
                self.config.ram_dir.display()
            ));
        }
        Ok(())
    }

    pub fn vmm_memory(&self) -> Vec<(String, u64)> {
        let mut out: Vec<(String, u64)> = vmm_process::sessions(&self.config.run_dir)
            .into_iter()
            .filter_map(|session| {
                let dir = self.vmm_dir(&session);
                if !dir.vmm_alive() {
                    return None;
                }
                let pid = vmm_process::pid_of(&dir)?;
                let rollup = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
                let kib: u64 = rollup
                    .lines()
                    .find_map(|l| l.strip_prefix("Pss:"))?
                    .split_whitespace()
                    .next()?
                    .parse()
                    .ok()?;
                Some((session, kib * 1024))
            })
            .collect();
        out.sort();
        out
    }

    /// What confines its VMMs (the node status's `vmm_isolation`).
    pub fn isolation(&self) -> Vec<String> {
        self.confinement.isolation()
    }

    /// How its VMMs bring a snapshot's memory back (the node status's `vmm_restore`).
    pub fn restore_memory(&self) -> flavour::RestoreMemory {
        self.config
            .flavour
            .restore_memory(self.confinement.userfaultfd())
    }

    /// The images this runtime boots, one per harness.
    pub fn images(&self) -> &[GuestImage] {
        &self.config.images
    }

    fn image(&self, harness: &str) -> Option<&GuestImage> {
        self.config.images.iter().find(|i| i.harness == harness)
    }

    /// What a VM of `harness` attaches from the host: its image's files, by this daemon's
    /// own record of the image (a restore never takes them from the snapshot).
    fn attachments(&self, harness: &str) -> flavour::Attachments {
        self.image(harness)
            .map(|image| flavour::Attachments {
                kernel: Some(image.kernel.clone()),
                initramfs: image.initramfs.clone(),
                rootfs: image.rootfs.clone(),
            })
            .unwrap_or_default()
    }

    /// Whether the VM in `dir` runs a harness whose state lives in RAM. A VM restored from a
    /// snapshot (no harness file) always does: only memory-tier sessions are snapshotted.
    fn keeps_memory(&self, dir: &VmmDir) -> bool {
        vmm_process::read_vmm_file(&dir.harness_file(), 256)
            .and_then(|harness| String::from_utf8(harness).ok())
            .and_then(|harness| self.image(harness.trim()).map(|i| i.memory_snapshot))
            .unwrap_or(true)
    }

    fn incarnation(&self, session: &str) -> Incarnation {
        Incarnation {
            id: session.to_owned(),
            worker: String::new(),
            address: self.vmm_dir(session).vsock().display().to_string(),
            runtime: NAME.into(),
            fence_token: 0,
        }
    }

    fn vm_config(
        &self,
        spec: &SessionSpec,
        image: &GuestImage,
        dir: &VmmDir,
        network: Option<(&network::ImageNetwork, &network::Slot)>,
    ) -> VmConfig {
        let mut config = VmConfig::with_kernel(image.kernel.clone());
        config.payload.initramfs = image.initramfs.clone();
        let vcpus = image.vcpus.unwrap_or(self.config.vcpus);
        config.cpus = CpusConfig {
            boot_vcpus: vcpus,
            max_vcpus: vcpus,
        };
        config.memory = MemoryConfig {
            size: image.memory_mib.unwrap_or(self.config.memory_mib) << 20,
            ..MemoryConfig::default()
        };
        // The guest agent waits for its harness as long as this host waits for the guest.
        let mut cmdline = format!(
            "console=ttyS0 reboot=k panic=1 agentvm.session={} agentvm.harness_ready_ms={}",
            spec.session_uid,
            self.config.guest_timeouts.ready.as_millis()
        );
        if let Some((_, slot)) = network {
            cmdline.push(' ');
            cmdline.push_str(&slot.cmdline());
        }
        if !image.cmdline.is_empty() {
            cmdline.push(' ');
            cmdline.push_str(&image.cmdline);
        }
        config.payload.cmdline = Some(cmdline);
        config.serial = SerialConfig {
            mode: ConsoleOutputMode::File,
            file: Some(dir.serial()),
            socket: None,
        };
        config.vsock = Some(VsockConfig {
            cid: GUEST_CID,
            socket: dir.vsock(),
            id: None,
        });
        if let Some(rootfs) = &image.rootfs {
            config.disks.push(DiskConfig {
                path: rootfs.clone(),
                readonly: true,
                id: Some(ROOTFS.into()),
                serial: Some(ROOTFS.into()),
            });
        }
        if image.workspace_mib > 0 {
            config.disks.push(DiskConfig {
                path: dir.workspace(),
                readonly: false,
                id: Some(WORKSPACE.into()),
                serial: Some(WORKSPACE.into()),
            });
        }
        if let Some((network, slot)) = network {
            config.net.push(network.device(slot));
        }
        config
    }

    /// The network a VM of `spec` on `image` gets: the image's, narrowed by the session.
    fn session_network(
        image: Option<&GuestImage>,
        spec: &SessionSpec,
    ) -> std::result::Result<Option<network::ImageNetwork>, String> {
        image
            .and_then(|i| i.network.as_ref())
            .map(|n| n.for_session(&spec.annotations))
            .transpose()
    }

    /// Gives the just-spawned VMM in `dir` its network, if `image` has one.
    async fn attach_network(
        &self,
        session: &str,
        dir: &VmmDir,
        image: Option<&network::ImageNetwork>,
    ) -> std::result::Result<Option<network::Slot>, String> {
        let Some(image) = image else {
            return Ok(None);
        };
        if !self.config.flavour.boots_mmio_guests() {
            return Err(format!(
                "guest networking needs the agentvm VMM (the {} flavour has no egress policy)",
                self.config.flavour.name()
            ));
        }
        let pid = vmm_process::pid_of(dir).ok_or("the VMM wrote no pid file")?;
        self.networks
            .attach(session, pid, &dir.api(), image)
            .await
            .map(Some)
    }

    /// A VMM already running this session (after a daemon restart, or a repeated create).
    async fn running(&self, session: &str) -> Option<Incarnation> {
        // A VMM on its way out is not the session's compute.
        self.retired(session).await;
        let dir = self.vmm_dir(session);
        if !dir.vmm_alive() {
            return None;
        }
        let state = tokio::time::timeout(Duration::from_secs(2), dir.client().state())
            .await
            .ok()?
            .ok()?;
        match state {
            agentvm_vmm_api::VmState::Running => {}
            // Paused by an operation that never finished (the daemon died mid-Suspend): its
            // memory is intact, so it runs on rather than being replaced.
            agentvm_vmm_api::VmState::Paused => {
                tokio::time::timeout(Duration::from_secs(10), dir.client().resume_idempotent())
                    .await
                    .ok()?
                    .ok()?;
                let _ = std::fs::remove_dir_all(dir.snapshot_outbox());
                tracing::info!(
                    session,
                    "resumed a VM left paused by an interrupted operation"
                );
            }
            _ => return None,
        }
        if let Some(pid) = vmm_process::pid_of(&dir) {
            if let Err(e) = self.networks.reattach(session, pid, &dir.api()).await {
                tracing::warn!(session, error = %e, "the guest's resolver is not served");
            }
            self.exits.watch(dir, pid);
        }
        Some(self.incarnation(session))
    }

    fn take_stock(&self) {
        for session in vmm_process::sessions(&self.config.run_dir) {
            let dir = self.vmm_dir(&session);
            match vmm_process::pid_of(&dir) {
                Some(pid) if dir.vmm_alive() => self.exits.watch(dir, pid),
                _ => {
                    self.exits.report(
                        &session,
                        "its VMM was gone when this daemon started (killed while no daemon \
                         watched it, or the node restarted)"
                            .into(),
                    );
                    self.discard(&session, &dir);
                }
            }
        }
    }

    /// Boots a VM of `image` for `spec` and waits until its guest agent is ready.
    async fn boot(&self, spec: &SessionSpec, image: &GuestImage) -> Result<Incarnation> {
        let session = &spec.session_uid;
        let network = Self::session_network(Some(image), spec).map_err(|e| failed(session, e))?;
        let started = std::time::Instant::now();
        let files = [
            Some(image.kernel.clone()),
            image.initramfs.clone(),
            image.rootfs.clone(),
        ]
        .into_iter()
        .flatten()
        .collect();
        let inc = self
            .start(session, files, |dir, confined| async move {
                let slot = self.attach_network(session, &dir, network.as_ref()).await?;
                let config = self.vm_config(spec, image, &dir, network.as_ref().zip(slot.as_ref()));
                if image.workspace_mib > 0 {
                    vmm_process::new_disk(
                        &dir,
                        &dir.workspace(),
                        image.workspace_mib << 20,
                        image.workspace_template.as_deref(),
                    )?;
                }
                let client = dir.client();
                client
                    .create(&config)
                    .await
                    .map_err(|e| format!("vm.create: {e}"))?;
                vmm_process::write_vmm_file(&dir.harness_file(), spec.harness.as_bytes())?;
                confined.wait().await?;
                client.boot().await.map_err(|e| format!("vm.boot: {e}"))?;
                let (conn, _) =
                    GuestConn::ready(&dir.vsock(), self.config.guest_timeouts, &dir.liveness())
                        .await
                        .map_err(|e| format!("the guest never became ready: {e}"))?;
                self.keep_ready_conn(session, conn);
                Ok(())
            })
            .await?;
        crate::metrics::global()
            .vmm_boot
            .observe_of(started.elapsed(), session);
        Ok(inc)
    }

    /// Spawns a VMM for `session`, able to read `files` (when jailed, nothing else of the
    /// host's), and runs `start` against it; on any failure the VMM and its directory are
    /// removed, so a failed start leaves nothing behind.
    async fn start<F, Fut>(
        &self,
        session: &str,
        files: Vec<PathBuf>,
        start: F,
    ) -> Result<Incarnation>
    where
        F: FnOnce(VmmDir, vmm_process::Confinement) -> Fut,
        Fut: std::future::Future<Output = std::result::Result<(), String>>,
    {
        let started = std::time::Instant::now();
        self.retired(session).await;
        let dir = self.vmm_dir(session);
        if dir.dir.exists() {
            // A dead VMM's leftovers.
            self.stop_vmm(session, &dir).await;
        }
        let claimed = match self.pool.as_ref().and_then(pool::Pool::take) {
            Some(pooled) => self.claim(session, &dir, files.clone(), pooled).await,
            None => None,
        };
        let confined = match claimed {
            Some(confined) => confined,
            None => self.spawn_vmm(session, &dir, files).await?,
        };
        // A session's start; a template's VM is no session's (its crash leaves a VMM
        // directory of no session, which the next start-up reaps).
        if !templates::is_template_vm(session) {
            crate::crash_point::reached(crate::crash_point::START_SPAWNED);
        }
        let spawned = started.elapsed();
        match start(dir.clone(), confined).await {
            Ok(()) => {
                tracing::debug!(
                    session,
                    spawned_ms = spawned.as_secs_f64() * 1e3,
                    ready_ms = started.elapsed().as_secs_f64() * 1e3,
                    "VMM started"
                );
                Ok(self.incarnation(session))
            }
            Err(reason) => {
                let console = failed_starts::console_tail(&dir.serial()).unwrap_or_default();
                self.stop_vmm(session, &dir).await;
                let mut reason = reason;
                let lines = failed_starts::last_lines(&console, 5);
                if !lines.is_empty() {
                    reason = format!("{reason} (serial, last lines first: {lines})");
                }
                match failed_starts::keep(&self.failed_starts_dir(), session, &console) {
                    Ok(kept) => {
                        reason = format!("{reason}; the console is kept in {}", kept.display())
                    }
                    Err(e) => {
                        tracing::warn!(session, error = %e, "could not keep the console of a failed start")
                    }
                }
                Err(failed(session, reason))
            }
        }
    }

    /// The URI the journal records for snapshot `id` (sealed in the store at `target`): its
    /// published archive when the fleet shares a snapshot store, else the local directory.
    async fn publish(
        &self,
        id: &str,
        target: &std::path::Path,
    ) -> std::result::Result<String, String> {
        let Some(remote) = &self.config.snapshot_remote else {
            return Ok(format!("file://{}", target.display()));
        };
        remote
            .publish(&self.store, id)
            .await
            .map_err(|e| format!("publishing the snapshot for the fleet: {e}"))
    }

    /// The id in this node's store of the snapshot `snapshot` names.
    fn local_id(&self, snapshot: &SnapshotRef) -> Option<String> {
        if let Some(remote) = &self.config.snapshot_remote
            && let Some(archive) = remote.archive_of(&snapshot.external_uri)
        {
            return Some(archive.id);
        }
        snapshot_dir(snapshot)?
            .file_name()?
            .to_str()
            .map(str::to_owned)
    }

    /// The local directory of the snapshot `snapshot` names: this node's own, or fetched
    /// from the fleet's snapshot store, no file of it larger than a VM of `harness` has.
    async fn local_snapshot(
        &self,
        snapshot: &SnapshotRef,
        harness: &str,
    ) -> std::result::Result<PathBuf, String> {
        if let Some(remote) = &self.config.snapshot_remote
            && remote.archive_of(&snapshot.external_uri).is_some()
        {
            let memory = Runtime::vm_memory_mib(self, harness).unwrap_or(self.config.memory_mib);
            let workspace = self.image(harness).map_or(0, |i| i.workspace_mib);
            let limits = remote::FetchLimits {
                max_file_bytes: memory.max(workspace) << 20,
                min_free_bytes: self.config.min_free_disk_bytes,
            };
            let _one_at_a_time = self.fetching.lock().await;
            return remote
                .fetch(&snapshot.external_uri, &self.store, limits)
                .await;
        }
        snapshot_dir(snapshot).ok_or_else(|| {
            format!(
                "snapshot {:?} holds no memory to restore",
                snapshot.external_uri
            )
        })
    }

    /// Restores `snapshot` as `session` and tells the guest it was restored or forked.
    async fn restore_as(
        &self,
        snapshot: &SnapshotRef,
        spec: &SessionSpec,
        start: templates::StartPath,
    ) -> Result<Incarnation> {
        let session = spec.session_uid.as_str();
        let network = Self::session_network(self.image(&spec.harness), spec)
            .map_err(|e| failed(session, e))?;
        let source = self
            .local_snapshot(snapshot, &spec.harness)
            .await
            .map_err(|e| failed(session, e))?;
        let id = source
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
            .to_owned();
        let pinned_here = self.pin(&id, session, &source)?;
        let started = std::time::Instant::now();
        let attach = self.attachments(&spec.harness);
        let files = self.config.flavour.restore_files(&source, &attach);
        let memory = self.restore_memory();
        let restored = self
            .start(session, files, |dir, confined| async move {
                let t0 = std::time::Instant::now();
                let target = flavour::RestoreTarget {
                    session,
                    scratch: &dir.restore_scratch(),
                    vsock: &dir.vsock(),
                    serial: &dir.serial(),
                    workspace: &dir.workspace(),
                    attach: &attach,
                };
                let mut request = dir.flavour.restore_request(&source, &target, memory)?;
                let slot = self.attach_network(session, &dir, network.as_ref()).await?;
                if let (Some(network), Some(slot)) = (&network, &slot) {
                    request.net_overrides.push(network.restore_override(slot));
                }
                // Restored paused while the VMM's cgroup move finishes; run once it has.
                request.resume = false;
                let client = dir.client();
                client
                    .restore(&request)
                    .await
                    .map_err(|e| format!("vm.restore: {e}"))?;
                confined.wait().await?;
                client
                    .resume()
                    .await
                    .map_err(|e| format!("vm.resume after vm.restore: {e}"))?;
                let t_restore = t0.elapsed();
                let (mut conn, ready) =
                    GuestConn::ready(&dir.vsock(), self.config.guest_timeouts, &dir.liveness())
                        .await
                        .map_err(|e| format!("the restored guest did not answer: {e}"))?;
                let t_ready = t0.elapsed();
                // A session from a template is a fork of the template's VM, as the guest sees it.
                let kind = match start {
                    templates::StartPath::Restore => RestoredKind::Restored,
                    _ => RestoredKind::Forked,
                };
                let mut notice = restored_notice(session, kind, ready.restore_generation + 1);
                notice.network = slot.map(|s| s.guest_network());
                conn.restored(notice)
                    .await
                    .map_err(|e| format!("the restored guest did not take its notice: {e}"))?;
                // What the VM serves decides how it is suspended (a stateless harness's VM
                // is stopped, not saved), whatever it was restored from.
                vmm_process::write_vmm_file(&dir.harness_file(), spec.harness.as_bytes())?;
                tracing::debug!(
                    session,
                    restore_ms = t_restore.as_secs_f64() * 1e3,
                    guest_ready_ms = t_ready.as_secs_f64() * 1e3,
                    notified_ms = t0.elapsed().as_secs_f64() * 1e3,
                    "VM restored"
                );
                self.keep_ready_conn(session, conn);
                Ok(())
            })
            .await;
        let inc = match restored {
            Ok(inc) => inc,
            Err(e) => {
                if pinned_here {
                    let _ = self.store.release(&id, session);
                }
                return Err(e);
            }
        };
        crate::metrics::global()
            .vmm_restore
            .observe_of(started.elapsed(), session);
        self.templates.record_start(session, start);
        Ok(inc)
    }

    /// Marks `session` as a user of snapshot `id` (at `source`) before anything of it is
    /// read, so no delete takes it away mid-restore; true when this call took the mark (a
    /// session that already held it keeps it, whatever the restore does). A snapshot gone
    /// by then lost a race with a delete: that is the caller's to retry.
    fn pin(&self, id: &str, session: &str, source: &std::path::Path) -> Result<bool> {
        if id.is_empty() {
            return Ok(false);
        }
        let held = self
            .store
            .holders(id)
            .is_ok_and(|holders| holders.iter().any(|h| h == session));
        match self.store.acquire(id, session) {
            Ok(()) => Ok(!held),
            Err(agentvm_snapshot::SnapshotError::NotFound(_)) if !source.exists() => {
                Err(RuntimeError::SnapshotGone {
                    runtime: NAME,
                    session: session.to_owned(),
                    snapshot: id.to_owned(),
                })
            }
            Err(e) => {
                tracing::warn!(session, snapshot = %id, error = %e,
                    "could not record the snapshot's use");
                Ok(false)
            }
        }
    }

    /// Starts a VMM for `session` in `dir`, jailed with `files`.
    async fn spawn_vmm(
        &self,
        session: &str,
        dir: &VmmDir,
        files: Vec<PathBuf>,
    ) -> Result<vmm_process::Confinement> {
        let (jail, cgroup_procs) = self
            .confinement
            .prepare(session, dir, files)
            .inspect_err(|_| self.discard(session, dir))
            .map_err(|e| failed(session, format!("jailing its VMM: {e}")))?;
        match vmm_process::spawn(
            &self.config.vmm_binary,
            dir,
            &self.exits,
            jail.as_ref(),
            cgroup_procs,
        )
        .await
        {
            Ok(spawned) => Ok(spawned.confined),
            Err(e) => {
                self.discard(session, dir);
                Err(failed(session, e))
            }
        }
    }

    /// Makes the pooled VMM `pooled` `session`'s, shown `files`; `None` (the VMM stopped,
    /// and what the claim made removed) if that fails, so the session starts one of its own.
    async fn claim(
        &self,
        session: &str,
        dir: &VmmDir,
        files: Vec<PathBuf>,
        pooled: pool::Pooled,
    ) -> Option<vmm_process::Confinement> {
        let claimed = match self.confinement.claim(session, dir, files, &pooled) {
            Ok(cgroup_procs) => vmm_process::adopt(dir, &pooled, &self.exits, cgroup_procs).await,
            Err(e) => Err(e),
        };
        match claimed {
            Ok(spawned) => Some(spawned.confined),
            Err(e) => {
                tracing::warn!(session, pid = pooled.pid, error = %e, "a pooled VMM could not be claimed; starting one");
                pooled.discard();
                self.discard(session, dir);
                None
            }
        }
    }

    /// `SESSION-EPOCH-N`: unique in the fleet (`snapshot_epoch`), and names the session it
    /// was taken of.
    fn new_snapshot_id(&self, session: &str) -> String {
        format!(
            "{session}-{}-{}",
            self.snapshot_epoch,
            self.next_snapshot.fetch_add(1, Ordering::Relaxed)
        )
    }

    fn keep_ready_conn(&self, session: &str, conn: GuestConn) {
        self.ready_conns
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(session.to_owned(), conn);
    }

    /// Stops `session`'s VMM in `dir` and removes its cgroups (and drops any stream kept to
    /// it). Cgroups go here, where the runtime knows no new VMM of the session is starting,
    /// not when the exit watch sees an exit: that may come after the next VMM's cgroup of the
    /// same name exists.
    async fn stop_vmm(&self, session: &str, dir: &VmmDir) {
        self.retired(session).await;
        self.templates.forget_start(session);
        self.last_checkpoints.forget(session);
        self.take_ready_conn(session);
        self.networks.detach(session);
        vmm_process::stop(dir, &self.exits).await;
        self.confinement.remove_cgroups_settled(session).await;
    }

    /// Stops `session`'s VMM without waiting for its exit: once it has answered the request
    /// to shut down it runs no guest, and its exit (the kernel tears its KVM VM down for
    /// milliseconds) and clean-up go on in the background. Its directories and cgroups are
    /// renamed out of the session's way first (`.retired-SESSION-PID`), so the session's next
    /// VMM need not wait; where that cannot be done, the next VMM waits. Cgroups go before
    /// the files, so whoever finds the directory can still tell what is left.
    async fn retire_vmm(&self, session: &str, dir: &VmmDir) {
        self.retired(session).await;
        self.templates.forget_start(session);
        self.last_checkpoints.forget(session);
        self.take_ready_conn(session);
        self.networks.detach(session);
        let stopping = vmm_process::ask_stop(dir, &self.exits).await;
        let (stopping, name) = match self.move_aside(session, dir, stopping.pid()) {
            Some((name, moved)) => (stopping.moved_to(moved), name),
            None => (stopping, session.to_owned()),
        };
        let cgroups = self.confinement.cgroups();
        let owner = name.clone();
        let task = tokio::spawn(tracing::Instrument::in_current_span(async move {
            stopping.exited().await;
            if let Some(cgroups) = cgroups {
                cgroups.remove_settled(&owner).await;
            }
            stopping.remove_files();
        }));
        self.retiring
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(name, task);
    }

    /// Renames a stopping VMM's directories and cgroups to `.retired-SESSION-PID`; returns
    /// that name and the moved directory, or `None` (nothing moved) if any rename fails.
    fn move_aside(
        &self,
        session: &str,
        dir: &VmmDir,
        pid: Option<u32>,
    ) -> Option<(String, VmmDir)> {
        let name = format!("{RETIRED}{session}-{}", pid?);
        let moved = self.vmm_dir(&name);
        if let Some(cgroups) = self.confinement.cgroups()
            && let Err(e) = cgroups.rename(session, &name)
        {
            tracing::debug!(session, error = %e, "a stopping VMM's cgroups stay in place");
            return None;
        }
        let undo_cgroups = || {
            if let Some(cgroups) = self.confinement.cgroups() {
                let _ = cgroups.rename(&name, session);
            }
        };
        if std::fs::rename(&dir.dir, &moved.dir).is_err() {
            undo_cgroups();
            return None;
        }
        if dir.private_ram && dir.ram.exists() && std::fs::rename(&dir.ram, &moved.ram).is_err() {
            let _ = std::fs::rename(&moved.dir, &dir.dir);
            undo_cgroups();
            return None;
        }
        vmm_process::move_pid(&dir.dir, &moved.dir);
        Some((name, moved))
    }

    /// Waits until a VMM of `session` that is on its way out is gone with its files.
    async fn retired(&self, session: &str) {
        let task = self
            .retiring
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(session);
        if let Some(task) = task {
            let _ = task.await;
        }
    }

    /// Removes what a VMM that never started, or died unwatched, left: its files and cgroups.
    fn discard(&self, session: &str, dir: &VmmDir) {
        self.networks.detach(session);
        vmm_process::remove_files(dir);
        self.confinement.remove_cgroups(session);
    }

    fn take_ready_conn(&self, session: &str) -> Option<GuestConn> {
        self.ready_conns
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(session)
    }

    fn release_snapshots(&self, session: &str) {
        for id in self.store.list().unwrap_or_default() {
            let _ = self.store.release(&id, session);
        }
    }
}

impl MicrovmRuntime {
    /// Releases uses of snapshots by sessions that are gone, then deletes the snapshots of
    /// gone sessions that nothing uses any more (layers before their bases).
    fn reconcile_snapshots(&self, owned: &(dyn for<'s> Fn(&'s str) -> bool + Send + Sync)) {
        let ids = self.store.list().unwrap_or_default();
        for id in &ids {
            for holder in self.store.holders(id).unwrap_or_default() {
                if !owned(&holder) {
                    tracing::info!(snapshot = %id, holder = %holder,
                        "reconcile: releasing a use by a session that is gone");
                    let _ = self.store.release(id, &holder);
                }
            }
        }
        let orphans: Vec<String> = ids
            .into_iter()
            .filter(|id| snapshot_owner(id).is_some_and(|owner| !owned(owner)))
            .collect();
        for id in self.delete_layers_first(orphans) {
            tracing::info!(snapshot = %id, "reconcile: snapshot of a gone session kept: still in use");
        }
    }

    /// Deletes the snapshots `ids` that nothing uses, layers before the bases under them
    /// (a pass at a time while one frees something); returns those still in use.
    fn delete_layers_first(&self, mut ids: Vec<String>) -> Vec<String> {
        loop {
            let before = ids.len();
            ids.retain(|id| match self.store.delete(id) {
                Ok(()) => {
                    tracing::info!(snapshot = %id, "deleted a snapshot nothing needs");
                    false
                }
                Err(_) => true,
            });
            if ids.len() == before {
                return ids;
            }
        }
    }
}

impl MicrovmRuntime {
    /// The snapshots in the store that `owner` says are `session`'s, oldest (or newest)
    /// first. In the store means complete: a VMM's snapshot moves in only once written.
    fn stored_of(
        &self,
        session: &str,
        owner: fn(&str) -> Option<&str>,
        newest_first: bool,
    ) -> Vec<SnapshotRef> {
        let mut found: Vec<(SystemTime, PathBuf)> = self
            .store
            .list()
            .unwrap_or_default()
            .into_iter()
            .filter(|id| owner(id) == Some(session))
            .filter_map(|id| {
                let dir = self.store.dir(&id).ok()?;
                let made = std::fs::metadata(&dir).and_then(|m| m.modified()).ok()?;
                Some((made, dir))
            })
            .collect();
        match newest_first {
            true => found.sort_by_key(|(made, _)| std::cmp::Reverse(*made)),
            false => found.sort(),
        }
        found
            .into_iter()
            .map(|(_, dir)| SnapshotRef {
                local: session.to_owned(),
                external_uri: format!("file://{}", dir.display()),
                memory: true,
                sealed: false,
            })
            .collect()
    }
}

/// The session a snapshot id (`SESSION-EPOCH-N`) was taken of.
pub(super) fn snapshot_owner(id: &str) -> Option<&str> {
    if id.starts_with(turn_checkpoints::CHECKPOINT_PREFIX) {
        return None;
    }
    snapshot_session(id)
}

/// The session part of `SESSION-EPOCH-N`.
fn snapshot_session(id: &str) -> Option<&str> {
    let mut parts = id.rsplitn(3, '-');
    let n = parts.next()?;
    let epoch = parts.next()?;
    let session = parts.next().filter(|s| !s.is_empty())?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    // Older ids carry the PID where the epoch is now.
    let epoch_ok = !epoch.is_empty()
        && epoch
            .bytes()
            .all(|b| b.is_ascii_digit() || b.is_ascii_lowercase());
    (digits(n) && epoch_ok).then_some(session)
}

/// `n` in base 36: short ids keep the fleet's archive names short.
fn base36(mut n: u64) -> String {
    const DIGITS: &[u8; 36] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let mut out = Vec::new();
    loop {
        out.push(DIGITS[(n % 36) as usize]);
        n /= 36;
        if n == 0 {
            break;
        }
    }
    out.reverse();
    String::from_utf8(out).unwrap_or_default()
}

/// Pauses the VM to snapshot or fork it (one already paused is fine). A VMM that cannot
/// run (stopped, frozen) cannot answer: that is said at once, not after the API deadline.
async fn pause_to_save(session: &str, dir: &VmmDir) -> Result<()> {
    if let vmm_process::VmmHealth::Stalled(why) = dir.health() {
        return Err(RuntimeError::Stalled {
            runtime: NAME,
            session: session.to_owned(),
            reason: format!("its VMM {why}: nothing can be saved"),
        });
    }
    dir.client()
        .pause_idempotent()
        .await
        .map_err(|e| failed(session, format!("vm.pause: {e}")))?;
    if !templates::is_template_vm(session) {
        crate::crash_point::reached(crate::crash_point::SUSPEND_PAUSED);
    }
    Ok(())
}

/// An empty `outbox` in `dir`, owned like `dir` (by the VMM's uid when jailed).
fn prepare_outbox(dir: &VmmDir, outbox: &Path) -> std::result::Result<(), String> {
    let _ = std::fs::remove_dir_all(outbox);
    std::fs::create_dir(outbox).map_err(|e| format!("creating {}: {e}", outbox.display()))?;
    let owner = std::fs::metadata(&dir.dir).map_err(|e| format!("{}: {e}", dir.dir.display()))?;
    use std::os::unix::fs::MetadataExt;
    // lchown: the VMM may have put a symlink in its place already (a chown through it would
    // give the VMM whatever it points to).
    std::os::unix::fs::lchown(outbox, Some(owner.uid()), Some(owner.gid()))
        .map_err(|e| format!("chown {}: {e}", outbox.display()))
}

/// The store directory an external snapshot reference names.
fn snapshot_dir(snapshot: &SnapshotRef) -> Option<PathBuf> {
    snapshot
        .external_uri
        .strip_prefix("file://")
        .filter(|p| p.starts_with('/'))
        .map(PathBuf::from)
}

/// The notice a restored or forked guest must apply before anything else: entropy to reseed
/// with, the host's clock to step to, the identity it now has.
fn restored_notice(session: &str, kind: RestoredKind, generation: u64) -> Restored {
    let mut entropy = vec![0u8; 64];
    rand::rng().fill_bytes(&mut entropy);
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or_default();
    Restored {
        kind: kind as i32,
        entropy,
        wall_clock_unix_nanos: now,
        identity: Some(Identity {
            session_uid: session.to_owned(),
            hostname: session.to_owned(),
            vsock_cid: GUEST_CID,
            vm_id: session.to_owned(),
        }),
        generation,
        network: None,
    }
}

#[async_trait::async_trait]
impl Runtime for MicrovmRuntime {
    fn harness_lives_with_incarnation(&self) -> bool {
        true
    }

    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> RuntimeCapabilities {
        RuntimeCapabilities {
            memory_snapshot: true,
            cow_fork: self.config.flavour.cow_fork(),
            ..Default::default()
        }
    }

    fn vm_memory_mib(&self, harness: &str) -> Option<u64> {
        Some(
            self.image(harness)
                .and_then(|i| i.memory_mib)
                .unwrap_or(self.config.memory_mib),
        )
    }

    async fn attach(&self, session_uid: &str) -> Result<Option<Incarnation>> {
        Ok(self.running(session_uid).await)
    }

    async fn create(&self, spec: &SessionSpec) -> Result<Incarnation> {
        let session = &spec.session_uid;
        if let Some(inc) = self.running(session).await {
            return Ok(inc);
        }
        let image = self
            .image(&spec.harness)
            .ok_or_else(|| {
                failed(
                    session,
                    format!(
                        "no guest image for harness {:?} on the {} VMM",
                        spec.harness,
                        self.config.flavour.name()
                    ),
                )
            })?
            .to_owned();
        // A session's own network settings are judged before anything starts.
        Self::session_network(Some(&image), spec).map_err(|e| failed(session, e))?;
        if let Some((key, template)) = self.template_for(session, &image).await? {
            match self
                .restore_as(&template, spec, templates::StartPath::Template)
                .await
            {
                Ok(inc) => return Ok(inc),
                Err(e) => {
                    tracing::warn!(session, template = %key.id, error = %e,
                        "the session could not start from its image's template: it boots");
                    self.templates.mark_failed(&key.id);
                }
            }
        }
        let inc = self.boot(spec, &image).await?;
        self.templates
            .record_start(session, templates::StartPath::Boot);
        Ok(inc)
    }

    /// EXTERNAL: pause, write the snapshot into the store, stop the VMM (compute freed).
    async fn snapshot(&self, incarnation: &Incarnation, kind: SnapshotKind) -> Result<SnapshotRef> {
        let session = &incarnation.id;
        if kind == SnapshotKind::Local {
            return Err(RuntimeError::Unsupported {
                runtime: NAME,
                operation: "LOCAL (warm) snapshot",
            });
        }
        let dir = self.vmm_dir(session);
        if !self.keeps_memory(&dir) {
            // Nothing in its RAM is needed: it resumes by replay into a fresh VM.
            self.retire_vmm(session, &dir).await;
            return Ok(SnapshotRef {
                local: session.clone(),
                ..Default::default()
            });
        }
        let started = std::time::Instant::now();
        pause_to_save(session, &dir).await?;
        let client = dir.client();
        let id = self.new_snapshot_id(session);
        // Written inside the VMM's own directory (all a jailed VMM can write), then moved
        // into the store and sealed.
        let outbox = dir.snapshot_outbox();
        let written = match prepare_outbox(&dir, &outbox) {
            Ok(()) => client
                .snapshot(&outbox)
                .await
                .map_err(|e| format!("vm.snapshot: {e}"))
                .and_then(|()| self.store.adopt(&id, &outbox).map_err(|e| e.to_string())),
            Err(e) => Err(e),
        };
        let target = match written {
            Ok(target) => target,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&outbox);
                let _ = client.resume_idempotent().await;
                return Err(failed(session, e));
            }
        };
        // Published for the fleet while the VM is still there to go on if that fails.
        let external_uri = match self.publish(&id, &target).await {
            Ok(uri) => uri,
            Err(e) => {
                let _ = self.store.delete(&id);
                let _ = client.resume_idempotent().await;
                return Err(failed(session, e));
            }
        };
        crate::metrics::global()
            .vmm_snapshot
            .observe_of(started.elapsed(), session);
        crate::crash_point::reached(crate::crash_point::SUSPEND_STORED);
        self.retire_vmm(session, &dir).await;
        Ok(SnapshotRef {
            local: session.clone(),
            external_uri,
            memory: true,
            sealed: false,
        })
    }

    /// Pauses the VM only while its VMM forks it into its RAM directory: its state is saved
    /// and its RAM file linked there, and the VMM resumes it (copy-on-write over that file)
    /// before it takes the fork's digests. Then copies that fork into the store, durably.
    /// The VM never stops and keeps its memory.
    async fn checkpoint_live(&self, incarnation: &Incarnation) -> Result<Option<SnapshotRef>> {
        let session = &incarnation.id;
        let dir = self.vmm_dir(session);
        // Stock Cloud Hypervisor has no vm.fork: its sessions are parked to fork.
        if !self.keeps_memory(&dir) || !self.config.flavour.cow_fork() {
            return Ok(None);
        }
        let started = std::time::Instant::now();
        let id = self.new_snapshot_id(session);
        let staging = dir.fork_dir(&id);
        pause_to_save(session, &dir).await?;
        let client = dir.client();
        let forked = match staging
            .parent()
            .map(std::fs::create_dir_all)
            .transpose()
            .map_err(|e| format!("creating the forks directory: {e}"))
            .and_then(|_| prepare_outbox(&dir, &staging))
        {
            // Resumed by the VMM once its RAM is frozen: the digests are taken beside it.
            Ok(()) => client
                .fork(&staging, true)
                .await
                .map_err(|e| format!("vm.fork: {e}")),
            Err(e) => Err(e),
        };
        // The fork ended the guest's streams: the one kept for the next turn is dead.
        self.take_ready_conn(session);
        let resumed = client.resume_idempotent().await;
        if let Err(e) = forked {
            let _ = std::fs::remove_dir_all(&staging);
            return Err(failed(session, e));
        }
        resumed.map_err(|e| failed(session, format!("vm.resume after vm.fork: {e}")))?;
        let forked_in = started.elapsed();
        crate::crash_point::reached(crate::crash_point::SUSPEND_FORKED);
        let store = self.store.clone();
        let (copy_id, copy_from) = (id.clone(), staging.clone());
        let target = tokio::task::spawn_blocking(move || store.copy_in(&copy_id, &copy_from))
            .await
            .map_err(|e| failed(session, format!("copying the fork into the store: {e}")))?
            .map_err(|e| failed(session, format!("copying the fork into the store: {e}")))?;
        let external_uri = match self.publish(&id, &target).await {
            Ok(uri) => uri,
            Err(e) => {
                let _ = self.store.delete(&id);
                return Err(failed(session, e));
            }
        };
        crate::crash_point::reached(crate::crash_point::SUSPEND_STORED);
        // A layer (the VM runs from a snapshot) is not what the VM runs over: only the store's
        // copy is needed. A fork of a booted VM is its RAM, which stays while the VM runs.
        if agentvm_snapshot::Snapshot::open(&staging)
            .is_ok_and(|s| s.manifest.memory.base.is_some())
        {
            let _ = std::fs::remove_dir_all(&staging);
        }
        crate::metrics::global()
            .vmm_snapshot
            .observe_of(started.elapsed(), session);
        tracing::debug!(
            session,
            snapshot = %id,
            forked_ms = forked_in.as_secs_f64() * 1e3,
            total_ms = started.elapsed().as_secs_f64() * 1e3,
            "live checkpoint"
        );
        Ok(Some(SnapshotRef {
            local: session.clone(),
            external_uri,
            memory: true,
            sealed: false,
        }))
    }

    async fn restore(&self, snapshot: &SnapshotRef, spec: &SessionSpec) -> Result<Incarnation> {
        self.restore_as(snapshot, spec, templates::StartPath::Restore)
            .await
    }

    async fn fork(&self, snapshot: &SnapshotRef, opts: &ForkOpts) -> Result<Option<Incarnation>> {
        if !snapshot.memory {
            // A replay fork: the child's first turn boots its own VM and is replayed into.
            return Ok(None);
        }
        self.restore_as(snapshot, &opts.spec, templates::StartPath::Fork)
            .await
            .map(Some)
    }

    /// Stops the VM. The snapshots it was restored from stay held by its session: the log
    /// names them (a fork child's FORK record, the SUSPEND it resumed from) as the state to
    /// go back to should its next VM be lost, so they go only when a newer SUSPEND of the
    /// session is recorded (`superseded`) or with the session (`reclaim`).
    async fn stop(&self, incarnation: &Incarnation) -> Result<()> {
        self.stop_vmm(&incarnation.id, &self.vmm_dir(&incarnation.id))
            .await;
        Ok(())
    }

    /// Deletes the session's snapshots that nothing uses any more, and those of sessions
    /// already gone that only it still held (a fork's children keep their parent's alive
    /// until they are gone too).
    async fn reclaim(
        &self,
        session_uid: &str,
        owned: &(dyn for<'s> Fn(&'s str) -> bool + Send + Sync),
    ) -> Result<()> {
        // Whatever a VMM of the session left behind (one that died unasked leaves its
        // directory and cgroups for the next start, which a deleted session never has).
        self.stop_vmm(session_uid, &self.vmm_dir(session_uid)).await;
        self.release_snapshots(session_uid);
        let mine: Vec<String> = self
            .store
            .list()
            .unwrap_or_default()
            .into_iter()
            .filter(|id| {
                snapshot_owner(id)
                    .or_else(|| turn_checkpoints::checkpoint_owner(id))
                    .is_some_and(|owner| owner == session_uid || !owned(owner))
            })
            .collect();
        for id in &self.delete_layers_first(mine) {
            tracing::info!(session = session_uid, snapshot = %id, "snapshot kept: still in use");
        }
        Ok(())
    }

    async fn superseded(&self, session_uid: &str, current: &SnapshotRef) {
        let Some(current) = self.local_id(current) else {
            return;
        };
        let Ok(dir) = self.store.dir(&current) else {
            return;
        };
        if !dir.is_dir() {
            // Not here (published, never fetched): nothing of this node's is superseded.
            return;
        }
        // What a restore of `current` reads: the snapshot and the bases under it.
        let needed: std::collections::HashSet<String> = LocalStore::chain(&dir)
            .iter()
            .filter_map(|d| d.file_name()?.to_str().map(str::to_owned))
            .collect();
        let ids = self.store.list().unwrap_or_default();
        // Its VM is stopped: the session maps nothing it restored earlier any more.
        for id in ids.iter().filter(|id| !needed.contains(*id)) {
            let _ = self.store.release(id, session_uid);
        }
        let older: Vec<String> = ids
            .into_iter()
            .filter(|id| snapshot_owner(id) == Some(session_uid) && !needed.contains(id))
            .collect();
        let count = older.len();
        let kept = self.delete_layers_first(older);
        tracing::info!(
            session = session_uid,
            current = %current,
            reclaimed = count - kept.len(),
            kept = kept.len(),
            "older snapshots reclaimed"
        );
    }

    async fn status(&self, incarnation: &Incarnation) -> Result<ObservedState> {
        let dir = self.vmm_dir(&incarnation.id);
        if vmm_process::pid_of(&dir).is_none() {
            return Ok(ObservedState::Unknown);
        }
        if !dir.vmm_alive() {
            return Ok(ObservedState::Terminated);
        }
        use agentvm_vmm_api::VmState;
        Ok(
            match tokio::time::timeout(Duration::from_secs(2), dir.client().state()).await {
                Ok(Ok(VmState::Running)) => ObservedState::Live,
                Ok(Ok(VmState::Paused)) => ObservedState::Warm,
                Ok(Ok(VmState::Created | VmState::Shutdown)) => ObservedState::Terminated,
                // Alive but not answering: a busy VMM (a snapshot in progress) looks the same.
                Ok(Err(_)) | Err(_) => ObservedState::Unknown,
            },
        )
    }

    /// Subscribing also takes stock of the VMMs a previous daemon left: the running ones are
    /// watched from now on, the dead ones reported (and their directories removed).
    fn compute_lost(&self) -> Option<tokio::sync::broadcast::Receiver<super::ComputeLost>> {
        let reports = self.exits.subscribe();
        self.take_stock();
        Some(reports)
    }

    fn alive(&self, incarnation: &Incarnation) -> bool {
        self.vmm_dir(&incarnation.id).vmm_alive()
    }

    fn stalled(&self, incarnation: &Incarnation) -> Option<String> {
        match self.vmm_dir(&incarnation.id).health() {
            vmm_process::VmmHealth::Stalled(why) => Some(format!("its VMM {why}")),
            _ => None,
        }
    }

    async fn settle(&self) {
        let sessions: Vec<String> = self
            .retiring
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .keys()
            .cloned()
            .collect();
        for session in sessions {
            self.retired(&session).await;
        }
        // The node stops: VMMs nobody claimed go with it.
        if let Some(pool) = &self.pool {
            pool.close();
        }
    }

    async fn reconcile(&self, owned: &(dyn for<'s> Fn(&'s str) -> bool + Send + Sync)) {
        pool::remove_leftovers(&self.config.run_dir);
        for name in vmm_process::retired(&self.config.run_dir) {
            // A VMM a suspend stopped, whose exit the last daemon did not see through.
            tracing::info!(name, "reconcile: removing what a stopped VMM left");
            self.stop_vmm(&name, &self.vmm_dir(&name)).await;
        }
        for session in vmm_process::sessions(&self.config.run_dir) {
            let dir = self.vmm_dir(&session);
            if !owned(&session) {
                tracing::warn!(
                    session,
                    alive = dir.vmm_alive(),
                    "reconcile: reaping a VMM directory whose session does not exist or is deleted"
                );
                self.stop_vmm(&session, &dir).await;
                self.release_snapshots(&session);
                continue;
            }
            if dir.vmm_alive() && self.running(&session).await.is_none() {
                // Alive but neither running nor resumable: a boot or restore the daemon did
                // not live to finish. Its session never had it as compute.
                tracing::warn!(
                    session,
                    "reconcile: stopping a VMM that never finished starting"
                );
                self.stop_vmm(&session, &dir).await;
            }
        }
        self.reconcile_snapshots(owned);
        self.sweep_templates().await;
        if let Some(pool) = &self.pool {
            pool.fill();
        }
    }

    async fn sweep_snapshots(
        &self,
        owner: &(dyn for<'s> Fn(&'s str) -> SnapshotOwner + Send + Sync),
    ) {
        let verdicts = std::sync::Mutex::new(std::collections::HashMap::new());
        let judge = |session: &str| {
            *verdicts
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .entry(session.to_owned())
                .or_insert_with(|| owner(session))
        };
        let now = SystemTime::now();
        let stale = |at: SystemTime| now.duration_since(at).is_ok_and(|age| age > ORPHAN_GRACE);
        let unwanted = |session: &str, at: SystemTime| match judge(session) {
            SnapshotOwner::Gone => true,
            SnapshotOwner::Unknown => stale(at),
            SnapshotOwner::Wanted => false,
        };
        let mut doomed: Vec<String> = Vec::new();
        for id in self.store.list().unwrap_or_default() {
            let Some(session) =
                snapshot_owner(&id).or_else(|| turn_checkpoints::checkpoint_owner(&id))
            else {
                continue;
            };
            let made = self
                .store
                .dir(&id)
                .ok()
                .and_then(|dir| std::fs::metadata(dir).ok()?.modified().ok())
                .unwrap_or(now);
            if !unwanted(session, made) {
                continue;
            }
            // Uses by sessions that are gone as well (fork children deleted on other nodes).
            for holder in self.store.holders(&id).unwrap_or_default() {
                if judge(&holder) != SnapshotOwner::Wanted {
                    let _ = self.store.release(&id, &holder);
                }
            }
            doomed.push(id);
        }
        let kept = self.delete_layers_first(doomed);
        for id in kept {
            tracing::debug!(snapshot = %id, "sweep: a gone session's snapshot is still in use here");
        }
        self.sweep_templates().await;
        // Not at start-up (reconcile): uploading waits for the first periodic sweep.
        self.publish_templates().await;
        if let Some(remote) = &self.config.snapshot_remote {
            // A template is no session's: it goes once no node of the fleet has it as an
            // image's current template (and not while the fleet cannot be asked).
            let wanted_templates = self.templates_the_fleet_wants().await;
            match remote
                .sweep(
                    |archive, at| match archive.id.starts_with(templates::ID_PREFIX) {
                        true => wanted_templates
                            .as_ref()
                            .is_some_and(|wanted| !wanted.contains(&archive.id) && stale(at)),
                        false => unwanted(archive.session(), at),
                    },
                )
                .await
            {
                Ok(0) => {}
                Ok(n) => tracing::info!(archives = n, remote = %remote.describe(),
                    "sweep: deleted the archives of sessions that are gone"),
                Err(e) => tracing::warn!(error = %e, remote = %remote.describe(),
                    "sweep: the fleet's snapshot store"),
            }
        }
    }

    fn snapshots_of(&self, session_uid: &str) -> Vec<SnapshotRef> {
        self.stored_of(session_uid, snapshot_owner, true)
    }

    fn discard_snapshot(&self, snapshot: &SnapshotRef) {
        let Some(id) = snapshot_dir(snapshot)
            .and_then(|d| d.file_name().and_then(|n| n.to_str()).map(str::to_owned))
        else {
            return;
        };
        match self.store.delete(&id) {
            Ok(()) => tracing::info!(snapshot = %id, "discarded a snapshot no record names"),
            Err(e) => tracing::warn!(snapshot = %id, error = %e, "could not discard a snapshot"),
        }
    }

    async fn checkpoint_turn(
        &self,
        incarnation: &Incarnation,
        cues: crate::runtime::CheckpointCues,
    ) -> Result<Option<crate::runtime::TurnCheckpoint>> {
        self.take_turn_checkpoint(incarnation, cues).await
    }

    fn discard_checkpoint(&self, snapshot: &SnapshotRef) -> bool {
        self.delete_checkpoint(snapshot)
    }

    fn sessions_with_checkpoints(&self) -> Vec<String> {
        let mut sessions: Vec<String> = self
            .store
            .list()
            .unwrap_or_default()
            .iter()
            .filter_map(|id| turn_checkpoints::checkpoint_owner(id).map(str::to_owned))
            .collect();
        sessions.sort();
        sessions.dedup();
        sessions
    }

    fn checkpoints_held(&self, session_uid: &str) -> Vec<SnapshotRef> {
        self.checkpoints_in_store(session_uid)
    }

    fn merge_checkpoints(
        &self,
        session_uid: &str,
        lower: &SnapshotRef,
        upper: &SnapshotRef,
    ) -> Result<Option<crate::runtime::TurnCheckpoint>> {
        self.merge_turn_checkpoints(session_uid, lower, upper)
    }

    fn checkpoint_retention(&self, harness: &str) -> Option<String> {
        self.image(harness)?.checkpoints.clone()
    }

    fn is_published(&self, snapshot: &SnapshotRef) -> bool {
        self.config
            .snapshot_remote
            .as_ref()
            .is_some_and(|remote| remote.archive_of(&snapshot.external_uri).is_some())
    }

    async fn publish_checkpoint(&self, snapshot: &SnapshotRef) -> Result<Option<String>> {
        self.publish_turn_checkpoint(snapshot).await
    }

    async fn dial(&self, incarnation: &Incarnation) -> Result<Arc<dyn HarnessEndpoint>> {
        let dir = self.vmm_dir(&incarnation.id);
        if !dir.vmm_alive() {
            return Err(failed(&incarnation.id, "its VMM is not running"));
        }
        Ok(Arc::new(GuestEndpoint::new(
            dir.vsock(),
            self.config.guest_timeouts,
            dir.liveness(),
            self.take_ready_conn(&incarnation.id),
        )))
    }
}
