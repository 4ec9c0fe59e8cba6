//! Assembles one node's daemon from its configuration: journal, harness registry, runtimes,
//! controller and session host. The binary and the end-to-end tests build it the same way.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use agentvm_proto::v1::{Capabilities, ComputeState, Resumability};
use anyhow::Context;

use crate::api::auth::Authenticator;
use crate::api::node_service::{NodeFacts, NodeService};
use crate::config;
use crate::controller::Controller;
use crate::controller::tools::ToolExecutor;
use crate::disk::DiskReserve;
use crate::journal::Journal;
use crate::journal::postgres::PostgresJournal;
use crate::journal::sqlite::{Durability, SqliteJournal};
use crate::metrics::exposition::NodeState;
use crate::metrics::server::StateFn;
use crate::model::openai::{OpenAiConfig, OpenAiProvider};
use crate::model::provider::{ModelProvider, RoutedProvider};
use crate::registry::store::RegistryStore;
use crate::registry::{Registry, StaticHarness, builtin_harnesses};
use crate::runtime::Runtime;
use crate::runtime::microvm::flavour::VmmFlavour;
use crate::runtime::microvm::{GuestImage, MicrovmConfig, MicrovmRuntime, bundles};
use crate::runtime::placement::can_place;
use crate::runtime::process::ProcessRuntime;
use crate::session::SessionHost;
use crate::tool_webhook::{WebhookConfig, WebhookExecutor};

/// The built-in harnesses the `process` runtime runs (`agentvm harness serve NAME`).
pub const PROCESS_HARNESSES: [&str; 3] = ["chat", "counter", "echo"];

pub struct NodeConfig {
    pub state_dir: PathBuf,
    /// A PostgreSQL journal shared by a fleet; `None`: the embedded sqlite journal in
    /// `state_dir`.
    pub journal_url: Option<String>,
    /// This node's name in the fleet.
    pub node_name: String,
    /// How long a node of the fleet may miss heartbeats before its sessions are taken over.
    pub lease: std::time::Duration,
    /// Where snapshots are published for the fleet; `None`: the node's own store only.
    pub snapshot_remote: Option<crate::runtime::microvm::remote::SnapshotRemote>,
    /// Program and leading arguments that serve a built-in harness; `NAME --listen unix:PATH`
    /// follow. Default: the `agentvm` binary beside this one, `harness serve`.
    pub harness_command: Vec<String>,
    pub durability: Durability,
    /// An OpenAI-compatible endpoint for every model but the built-in `echo`.
    pub openai: Option<OpenAiConfig>,
    /// The agentvm-vmm binary for the microvm runtime; `None` leaves the runtime out.
    /// Default: `agentvm-vmm` beside this executable.
    pub vmm_binary: Option<PathBuf>,
    /// Which VMM `vmm_binary` is.
    pub vmm_flavour: VmmFlavour,
    /// Where guest RAM files live (a tmpfs, so a fork can link instead of copy).
    pub ram_dir: PathBuf,
    /// Guest image bundles (`agentvm image build` output), one directory each: each is served
    /// on the microvm runtime as a harness named after its directory. Default
    /// `<state_dir>/images`.
    pub image_dir: Option<PathBuf>,
    /// The bundles' Linux kernels are PVM guest kernels (`--pvm-guest-kernels`).
    pub pvm_guest_kernels: bool,
    /// The HTTP endpoint that executes host-mediated tool calls; without one such calls fail
    /// with MissingToolExecutor.
    pub tool_executor: Option<WebhookConfig>,
    /// Principals and their projects; with it every Sessions call must authenticate.
    pub auth: Option<Arc<Authenticator>>,
    /// Confine each VMM (cgroup limits, namespaces, rlimits). On by default.
    pub confine_vmms: bool,
    /// The first uid of the range jailed VMMs take theirs from.
    pub vm_uid_base: u32,
    /// How many jailed VMMs wait, started, for the next VM (`MicrovmConfig::vmm_pool`).
    pub vmm_pool: usize,
    /// New microVM sessions start from their image's template (`MicrovmConfig::templates`).
    pub templates: bool,
    /// Make every image's template at start, not at its first session.
    pub warm_templates: bool,
    /// Which turns' checkpoints a memory-tier session keeps.
    pub checkpoints: crate::session::checkpoints::Retention,
    /// Each VMM's memory limit; default: the largest guest plus 128 MiB.
    pub vmm_memory_limit_mib: Option<u64>,
    /// How long a new or restored guest may take to answer Ready on vsock.
    pub guest_ready_timeout: std::time::Duration,
    /// How long the guest agent may take to answer a call of its own (Hello, Restored).
    pub guest_reply_timeout: std::time::Duration,
    /// The bound on each call to a VMM's API (a snapshot or restore is one call).
    pub vmm_api_timeout: std::time::Duration,
    /// How long a harness may stay silent while the host waits on it, before its turn fails.
    pub harness_idle_timeout: std::time::Duration,
    /// Free space kept in the state and RAM directories (`crate::disk`); 0: no reserve.
    pub min_free_disk_mib: u64,
}

/// The host's name, the default name of its node.
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|name| name.trim().to_owned())
        .ok()
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "localhost".to_owned())
}

/// Ready within this, or the guest is taken for stuck: a Linux guest boots in well under a
/// second on hardware KVM, so this leaves room for a loaded node.
pub const DEFAULT_GUEST_READY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(20);
/// The guest agent answers its own calls at once; this covers a loaded or emulated node.
pub const DEFAULT_GUEST_REPLY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);
/// A snapshot or restore of a large guest is one API call, bounded by this (raise it for
/// guests of many GiB on slow disks).
pub const DEFAULT_VMM_API_TIMEOUT: std::time::Duration = agentvm_vmm_api::client::DEFAULT_TIMEOUT;

impl NodeConfig {
    pub fn new(state_dir: PathBuf) -> Self {
        Self {
            state_dir,
            journal_url: None,
            node_name: host_name(),
            lease: crate::journal::postgres::DEFAULT_LEASE,
            snapshot_remote: None,
            harness_command: default_harness_command(),
            durability: Durability::Full,
            openai: None,
            vmm_binary: Some(sibling_binary("agentvm-vmm")),
            vmm_flavour: VmmFlavour::Agentvm,
            ram_dir: PathBuf::from("/dev/shm"),
            image_dir: None,
            pvm_guest_kernels: false,
            tool_executor: None,
            auth: None,
            confine_vmms: true,
            vm_uid_base: crate::runtime::microvm::DEFAULT_VM_UID_BASE,
            vmm_pool: crate::runtime::microvm::DEFAULT_VMM_POOL,
            templates: true,
            warm_templates: false,
            checkpoints: crate::session::checkpoints::Retention::default(),
            vmm_memory_limit_mib: None,
            guest_ready_timeout: DEFAULT_GUEST_READY_TIMEOUT,
            guest_reply_timeout: DEFAULT_GUEST_REPLY_TIMEOUT,
            vmm_api_timeout: DEFAULT_VMM_API_TIMEOUT,
            harness_idle_timeout: crate::controller::DEFAULT_HARNESS_IDLE_TIMEOUT,
            min_free_disk_mib: crate::disk::DEFAULT_MIN_FREE_MIB,
        }
    }
}

/// The first `name` on `$PATH`.
pub fn find_in_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|dir| dir.join(name))
            .find(|candidate| candidate.is_file())
    })
}

/// `name` in the directory of this executable.
fn sibling_binary(name: &str) -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(|d| d.join(name)))
        .unwrap_or_else(|| PathBuf::from(name))
}

/// The harnesses the microvm runtime runs and their guest images.
pub const MICROVM_HARNESSES: [&str; 2] = ["testguest", "testguest-echo"];

/// The microvm runtime, or why this node cannot have one.
fn microvm_runtime(cfg: &NodeConfig) -> Result<MicrovmRuntime, String> {
    let binary = cfg
        .vmm_binary
        .clone()
        .ok_or("no VMM binary is configured")?;
    if !binary.is_file() {
        return Err(format!("the VMM binary {} is missing", binary.display()));
    }
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .map_err(|e| format!("/dev/kvm is not usable ({e})"))?;
    let images = cfg.state_dir.join("images");
    std::fs::create_dir_all(&images).map_err(|e| format!("creating {}: {e}", images.display()))?;
    let mut guest_images = Vec::new();
    if cfg.vmm_flavour.boots_mmio_guests() {
        let testguest = images.join("testguest.elf");
        if std::fs::read(&testguest).ok().as_deref() != Some(agentvm_testguest::TESTGUEST_ELF) {
            std::fs::write(&testguest, agentvm_testguest::TESTGUEST_ELF)
                .map_err(|e| format!("writing {}: {e}", testguest.display()))?;
        }
        // One image, two harnesses: the counter (memory snapshots) and, with
        // `testguest.echo`, a stateless one that resumes by replay.
        guest_images.push(GuestImage {
            harness: "testguest".into(),
            kernel: testguest.clone(),
            cmdline: String::new(),
            memory_snapshot: true,
            ..Default::default()
        });
        guest_images.push(GuestImage {
            harness: "testguest-echo".into(),
            kernel: testguest,
            cmdline: "testguest.echo".into(),
            memory_snapshot: false,
            ..Default::default()
        });
    } else {
        tracing::warn!(
            vmm = cfg.vmm_flavour.name(),
            "the test guest needs virtio-mmio, which this VMM does not offer: \
             testguest and testguest-echo sessions will be refused"
        );
    }
    let image_dir = cfg.image_dir.clone().unwrap_or(images);
    let reserved: Vec<&str> = PROCESS_HARNESSES
        .iter()
        .chain(MICROVM_HARNESSES.iter())
        .copied()
        .collect();
    let (bundles, skipped) = bundles::load(&image_dir, &reserved);
    for s in &skipped {
        tracing::warn!(dir = %s.dir.display(), why = %s.why, "guest image not served");
    }
    guest_images.extend(bundles);
    MicrovmRuntime::new(MicrovmConfig {
        vmm_binary: binary,
        flavour: cfg.vmm_flavour,
        run_dir: cfg.state_dir.join("vms"),
        ram_dir: cfg.ram_dir.clone(),
        snapshot_dir: cfg.state_dir.join("snapshots"),
        images: guest_images,
        vcpus: 1,
        memory_mib: 256,
        guest_timeouts: crate::runtime::microvm::guest::GuestTimeouts {
            ready: cfg.guest_ready_timeout,
            reply: cfg.guest_reply_timeout,
        },
        vmm_api_timeout: cfg.vmm_api_timeout,
        confine: cfg.confine_vmms,
        vm_uid_base: cfg.vm_uid_base,
        vmm_pool: cfg.vmm_pool,
        memory_limit_mib: cfg.vmm_memory_limit_mib,
        snapshot_remote: cfg.snapshot_remote.clone(),
        min_free_disk_bytes: cfg.min_free_disk_mib.saturating_mul(1 << 20),
        templates: cfg.templates,
    })
}

/// `<dir of this executable>/agentvm harness serve`.
pub fn default_harness_command() -> Vec<String> {
    let cli = std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(|d| d.join("agentvm")))
        .unwrap_or_else(|| PathBuf::from("agentvm"));
    vec![cli.display().to_string(), "harness".into(), "serve".into()]
}

pub struct Node {
    pub journal: Arc<dyn Journal>,
    pub registry: Arc<Registry>,
    pub host: Arc<SessionHost>,
    pub microvm: Option<Arc<MicrovmRuntime>>,
    pub facts: NodeFacts,
    pub auth: Option<Arc<Authenticator>>,
    pub disk: DiskReserve,
    /// This node's name in its fleet.
    pub name: String,
    /// What node status last measured an idle VMM to cost (shared by every NodeService).
    vmm_footprint: crate::api::node_service::VmmFootprint,
}

impl Node {
    pub fn open(cfg: NodeConfig) -> anyhow::Result<Node> {
        crate::private_dir::ensure(&cfg.state_dir, crate::private_dir::Use::Own)
            .context("state directory")?;
        let journal_path = config::journal_path(&cfg.state_dir);
        // A fleet's journal also keeps its harness registry; a node's own keeps it in its file.
        let (journal, harnesses): (Arc<dyn Journal>, RegistryStore) = match &cfg.journal_url {
            Some(url) => {
                let shared = Arc::new(
                    PostgresJournal::connect(url, &cfg.node_name)
                        .with_context(|| {
                            format!(
                                "opening the journal at {}",
                                crate::settings::without_password(url)
                            )
                        })?
                        .with_lease(cfg.lease),
                );
                (shared.clone(), RegistryStore::shared(shared))
            }
            None => (
                Arc::new(
                    SqliteJournal::open(&journal_path, cfg.durability)
                        .with_context(|| format!("opening journal {}", journal_path.display()))?,
                ),
                RegistryStore::open(&journal_path).with_context(|| {
                    format!("opening harness registry in {}", journal_path.display())
                })?,
            ),
        };
        let process: Arc<dyn Runtime> = Arc::new(ProcessRuntime::new(
            cfg.harness_command.clone(),
            cfg.state_dir.join("harnesses"),
        ));
        let mut builtin_runtimes: HashMap<String, Arc<dyn Runtime>> = PROCESS_HARNESSES
            .iter()
            .map(|name| ((*name).to_owned(), Arc::clone(&process)))
            .collect();
        // Each bundle's harness, whether it keeps memory, whether it boots Linux.
        let mut image_harnesses: Vec<(String, bool, bool)> = Vec::new();
        let mut microvm = None;
        let microvm_missing = match microvm_runtime(&cfg) {
            Ok(runtime) => {
                image_harnesses = runtime
                    .images()
                    .iter()
                    .filter(|i| !MICROVM_HARNESSES.contains(&i.harness.as_str()))
                    .map(|i| (i.harness.clone(), i.memory_snapshot, i.linux_kernel))
                    .collect();
                let runtime = Arc::new(runtime);
                if cfg.journal_url.is_some() {
                    runtime.join_fleet(Arc::clone(&journal));
                }
                microvm = Some(Arc::clone(&runtime));
                let runtime: Arc<dyn Runtime> = runtime;
                let served: Vec<&str> = MICROVM_HARNESSES
                    .iter()
                    .copied()
                    .chain(image_harnesses.iter().map(|(n, _, _)| n.as_str()))
                    .collect();
                tracing::info!(
                    vmm = %cfg.vmm_binary.as_deref().unwrap_or(std::path::Path::new("")).display(),
                    harnesses = ?served,
                    "microvm runtime ready"
                );
                for name in served {
                    builtin_runtimes.insert(name.to_owned(), Arc::clone(&runtime));
                }
                None
            }
            Err(why) => {
                tracing::warn!(reason = %why, "no microvm runtime on this node");
                Some(why)
            }
        };
        let facts = NodeFacts::probe(
            cfg.vmm_binary
                .as_deref()
                .map(|b| (cfg.vmm_flavour.name(), b)),
            microvm_missing.as_deref(),
        );
        let unservable = |name: &str, caps: &Capabilities| match builtin_runtimes.get(name) {
            Some(rt) => can_place(caps, rt.name(), &rt.capabilities())
                .err()
                .map(|refusal| refusal.to_string()),
            None => Some(format!(
                "it runs on the microvm runtime, which this node does not have: {}",
                microvm_missing.as_deref().unwrap_or("not configured")
            )),
        };
        let mut statics = builtin_harnesses(unservable);
        let pvm = facts.kvm_flavour == "pvm" && !cfg.pvm_guest_kernels;
        statics.extend(image_harnesses.iter().map(|(name, memory, linux)| {
            let resumability = if *memory {
                Resumability::RequiresMemorySnapshot
            } else {
                Resumability::StatelessReplay
            };
            StaticHarness {
                name: name.clone(),
                capabilities: Capabilities {
                    resumability: resumability as i32,
                    fork_safe: !memory,
                    ..Default::default()
                },
                unservable_reason: match pvm && *linux {
                    true => "its bundle boots a Linux kernel, and this host's /dev/kvm is PVM \
                             (kvm_pvm), which boots only PVM guest kernels: serve it from a \
                             node with VMX or SVM KVM, or build the bundle with a PVM guest \
                             kernel and start agentvmd with --pvm-guest-kernels"
                        .to_owned(),
                    false => String::new(),
                },
            }
        }));
        let registry = Arc::new(Registry::new(statics, harnesses));
        let tool_executor = match &cfg.tool_executor {
            Some(c) => Some(Arc::new(WebhookExecutor::new(c.clone())?) as Arc<dyn ToolExecutor>),
            None => None,
        };
        let controller = Arc::new(
            Controller::new(
                journal.clone(),
                Arc::new(RoutedProvider {
                    upstream: cfg
                        .openai
                        .clone()
                        .map(|c| Box::new(OpenAiProvider::new(c)) as Box<dyn ModelProvider>),
                }),
                tool_executor,
            )
            .with_harness_idle_timeout(cfg.harness_idle_timeout),
        );
        let mut dirs = vec![("state", cfg.state_dir.clone())];
        if microvm.is_some() {
            dirs.push(("ram", cfg.ram_dir.clone()));
        }
        let disk = DiskReserve {
            dirs,
            min_free_bytes: cfg.min_free_disk_mib.saturating_mul(1 << 20),
        };
        let mut host = SessionHost::new(
            journal.clone(),
            registry.clone(),
            controller,
            builtin_runtimes,
        )
        .with_disk_reserve(disk.clone())
        .with_describe_timeout(cfg.guest_ready_timeout)
        .with_checkpoints(cfg.checkpoints);
        if let Some(auth) = &cfg.auth {
            host = host.with_quotas(auth.quotas().clone());
        }
        let host = Arc::new(host);
        Ok(Node {
            journal,
            registry,
            host,
            microvm,
            facts,
            auth: cfg.auth.clone(),
            disk,
            name: cfg.node_name.clone(),
            vmm_footprint: Default::default(),
        })
    }
}

impl Node {
    /// The `agentvm.node.v1.Node` service of this node.
    pub fn node_service(&self) -> NodeService {
        NodeService {
            name: self.name.clone(),
            host: Arc::clone(&self.host),
            facts: self.facts.clone(),
            journal: Arc::clone(&self.journal),
            registry: Arc::clone(&self.registry),
            microvm: self.microvm.clone(),
            disk: self.disk.clone(),
            vmm_footprint: Arc::clone(&self.vmm_footprint),
        }
    }

    /// What the metrics endpoint reports about the node's present state; `per_session`
    /// gives each VMM's memory a series labelled with its session.
    pub fn state_fn(&self, per_session: bool) -> StateFn {
        let journal = Arc::clone(&self.journal);
        let microvm = self.microvm.clone();
        let disk = self.disk.clone();
        Arc::new(move || NodeState {
            disk_free: disk.free(),
            sessions: journal
                .count_by_compute_state()
                .unwrap_or_default()
                .into_iter()
                .map(|(state, n)| (compute_state_label(state).to_owned(), n))
                .collect(),
            vmms: microvm.as_ref().map(|m| m.vmm_memory()).unwrap_or_default(),
            per_session,
        })
    }
}

impl Node {
    /// What `/readyz` answers: whether this node takes new work, and if not, why.
    pub fn ready_fn(&self) -> crate::metrics::server::ReadyFn {
        let journal = Arc::clone(&self.journal);
        let microvm = self.microvm.clone();
        let draining = self.host.draining();
        Arc::new(move || {
            let mut why = Vec::new();
            if *draining.borrow() {
                why.push("the node is draining".to_owned());
            }
            if let Err(e) = journal.count_by_compute_state() {
                why.push(format!("the journal does not answer: {e}"));
            }
            if let Some(Err(e)) = microvm.as_ref().map(|m| m.ready()) {
                why.push(format!("microVMs cannot start: {e}"));
            }
            match why.is_empty() {
                true => Ok(()),
                false => Err(why),
            }
        })
    }
}

fn compute_state_label(state: ComputeState) -> &'static str {
    match state {
        ComputeState::ComputeLive => "live",
        ComputeState::ComputeWarm => "warm",
        ComputeState::ComputeCold => "cold",
        ComputeState::ComputeTerminated => "terminated",
        ComputeState::ComputeNone | ComputeState::Unspecified => "none",
    }
}
