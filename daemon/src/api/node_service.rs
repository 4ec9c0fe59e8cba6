//! `agentvm.node.v1.Node`: the node's capacity and make-up, for a fleet scheduler.

use std::sync::Arc;

use agentvm_proto::node::v1::node_server::{Node as NodeApi, NodeServer};
use agentvm_proto::node::v1::{
    Checkpoint, DrainRequest, DrainResponse, FleetNode, GetStatusRequest, ListCheckpointsRequest,
    ListCheckpointsResponse, ListNodesRequest, ListNodesResponse, ListProjectsRequest,
    ListProjectsResponse, NodeStatus, Project, Template, WarmImageRequest, WarmImageResponse,
};
use agentvm_proto::v1::ComputeState;
use tonic::{Request, Response, Status};

use crate::api::auth::{node_actor, principal_of, require_operator};
use crate::api::status::journal_status;
use crate::journal::Journal;
use crate::registry::{Entry, Registry, entry_name};
use crate::runtime::microvm::MicrovmRuntime;

/// What does not change while the daemon runs.
#[derive(Debug, Clone, Default)]
pub struct NodeFacts {
    pub hostname: String,
    pub kvm_flavour: String,
    pub vmm_flavour: String,
    pub vmm_version: String,
    pub microvm_unavailable: String,
    pub cpus: u32,
}

impl NodeFacts {
    pub fn probe(vmm: Option<(&str, &std::path::Path)>, microvm_unavailable: Option<&str>) -> Self {
        let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_owned())
            .unwrap_or_default();
        let kvm_flavour = if !std::path::Path::new("/dev/kvm").exists() {
            "none"
        } else if std::path::Path::new("/sys/module/kvm_pvm").exists() {
            "pvm"
        } else if std::path::Path::new("/sys/module/kvm_intel").exists() {
            "vmx"
        } else if std::path::Path::new("/sys/module/kvm_amd").exists() {
            "svm"
        } else {
            "unknown"
        };
        let (vmm_flavour, vmm_version) = match (vmm, microvm_unavailable) {
            (Some((flavour, binary)), None) => (flavour.to_owned(), version_of(binary)),
            _ => (String::new(), String::new()),
        };
        Self {
            hostname,
            kvm_flavour: kvm_flavour.to_owned(),
            vmm_flavour,
            vmm_version,
            microvm_unavailable: microvm_unavailable.unwrap_or_default().to_owned(),
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get() as u32),
        }
    }
}

/// The first line of `binary --version` (empty when it has none to give).
fn version_of(binary: &std::path::Path) -> String {
    std::process::Command::new(binary)
        .arg("--version")
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.lines().next().map(str::to_owned))
        .unwrap_or_default()
}

/// (MemTotal, MemAvailable) in bytes.
fn meminfo() -> (u64, u64) {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|kib| kib.parse::<u64>().ok())
            .map_or(0, |kib| kib * 1024)
    };
    (field("MemTotal:"), field("MemAvailable:"))
}

pub struct NodeService {
    /// This node's name in its fleet.
    pub name: String,
    pub host: Arc<crate::session::SessionHost>,
    pub facts: NodeFacts,
    pub journal: Arc<dyn Journal>,
    pub registry: Arc<Registry>,
    pub microvm: Option<Arc<MicrovmRuntime>>,
    pub disk: crate::disk::DiskReserve,
    pub vmm_footprint: VmmFootprint,
}

/// The mean PSS of the VMMs last seen running, and how many there were.
pub type VmmFootprint = Arc<std::sync::Mutex<Option<(u64, usize)>>>;

/// What capacity assumes an idle microVM costs before any has run here to measure: the test
/// guest's measured footprint, rounded up.
const ASSUMED_VMM_FOOTPRINT: u64 = 1 << 20;

impl NodeService {
    pub fn into_server(self) -> NodeServer<Self> {
        NodeServer::new(self)
    }

    /// How many more idle microVM sessions fit in `available` bytes, and how that was reached:
    /// at the mean PSS of the running VMMs, else of those that ran last, else an assumption.
    fn capacity(&self, available: u64, vmms: &[(String, u64)]) -> (u64, String) {
        let mut measured = self.vmm_footprint.lock().unwrap_or_else(|p| p.into_inner());
        let total: u64 = vmms.iter().map(|(_, pss)| pss).sum();
        let (per_vmm, basis) = if vmms.is_empty() {
            match *measured {
                Some((per_vmm, count)) => (
                    per_vmm,
                    format!("the mean PSS of the {count} VMMs that ran here last"),
                ),
                None => (
                    ASSUMED_VMM_FOOTPRINT,
                    "an assumed footprint: no VMM has run here yet to measure".to_owned(),
                ),
            }
        } else {
            let per_vmm = (total / vmms.len() as u64).max(1);
            *measured = Some((per_vmm, vmms.len()));
            (
                per_vmm,
                format!("the mean PSS of the {} running VMMs", vmms.len()),
            )
        };
        let mib = |b: u64| b as f64 / f64::from(1 << 20);
        (
            available / per_vmm,
            format!(
                "{:.0} MiB available / {:.2} MiB per idle session, {basis}",
                mib(available),
                mib(per_vmm)
            ),
        )
    }

    pub fn status(&self) -> Result<NodeStatus, Status> {
        let counts = self
            .journal
            .count_by_compute_state()
            .map_err(|e| Status::internal(e.to_string()))?;
        let sessions = counts.iter().map(|(_, n)| n).sum();
        let sessions_live = counts
            .iter()
            .filter(|(s, _)| *s == ComputeState::ComputeLive)
            .map(|(_, n)| n)
            .sum();
        let vmms = self
            .microvm
            .as_ref()
            .map(|m| m.vmm_memory())
            .unwrap_or_default();
        let vmm_memory_bytes: u64 = vmms.iter().map(|(_, pss)| pss).sum();
        let (memory_total_bytes, memory_available_bytes) = meminfo();
        let running = self.host.running();
        let mut running_sessions = std::collections::HashMap::<String, u64>::new();
        for (_, runtime) in &running {
            *running_sessions.entry((*runtime).to_owned()).or_default() += 1;
        }
        let vmms_without_session = vmms
            .iter()
            .filter(|(vm, _)| {
                !running
                    .iter()
                    .any(|(uid, runtime)| uid == vm && *runtime == crate::runtime::microvm::NAME)
            })
            .count() as u64;
        let (capacity_sessions, capacity_basis) = match &self.microvm {
            Some(_) => self.capacity(memory_available_bytes, &vmms),
            None => (0, "no microvm runtime on this node".to_owned()),
        };
        let harnesses = self
            .registry
            .list("", 10_000, false)
            .map_err(|e| Status::internal(e.to_string()))?
            .iter()
            .filter(|e| !matches!(e, Entry::Static(s) if !s.unservable_reason.is_empty()))
            .map(|e| entry_name(e).to_owned())
            .collect();
        let free = self.disk.free();
        let free_of = |label: &str| free.iter().find(|(l, _)| *l == label).map_or(0, |f| f.1);
        Ok(NodeStatus {
            state_dir_free_bytes: free_of("state"),
            ram_dir_free_bytes: free_of("ram"),
            min_free_disk_bytes: self.disk.min_free_bytes,
            agentvmd_version: env!("CARGO_PKG_VERSION").to_owned(),
            hostname: self.facts.hostname.clone(),
            kvm_flavour: self.facts.kvm_flavour.clone(),
            vmm_flavour: self.facts.vmm_flavour.clone(),
            vmm_version: self.facts.vmm_version.clone(),
            microvm_unavailable: self.facts.microvm_unavailable.clone(),
            cpus: self.facts.cpus,
            memory_total_bytes,
            memory_available_bytes,
            sessions,
            sessions_live,
            vmms: vmms.len() as u64,
            vmm_memory_bytes,
            capacity_sessions,
            capacity_basis,
            running_sessions,
            vmms_without_session,
            harnesses,
            vmm_isolation: self
                .microvm
                .as_ref()
                .map(|m| m.isolation())
                .unwrap_or_default(),
            vmm_restore: self
                .microvm
                .as_ref()
                .map(|m| m.restore_memory().name().to_owned())
                .unwrap_or_default(),
            vm_starts: self
                .microvm
                .as_ref()
                .map(|m| m.vm_starts())
                .unwrap_or_default()
                .into_iter()
                .map(|(session, path)| (session, path.name().to_owned()))
                .collect(),
            templates: self
                .microvm
                .as_ref()
                .map(|m| m.template_status())
                .unwrap_or_default()
                .into_iter()
                .map(|t| Template {
                    harness: t.harness,
                    id: t.id,
                    bytes: t.bytes,
                    sessions: t.sessions,
                    current: t.current,
                    published: t.published,
                })
                .collect(),
        })
    }
}

#[tonic::async_trait]
impl NodeApi for NodeService {
    async fn get_status(
        &self,
        request: Request<GetStatusRequest>,
    ) -> Result<Response<NodeStatus>, Status> {
        // Every figure is node-wide: other projects' sessions, VMMs and capacity.
        require_operator(principal_of(&request).as_ref(), "GetStatus")?;
        Ok(Response::new(self.status()?))
    }

    async fn list_nodes(
        &self,
        request: Request<ListNodesRequest>,
    ) -> Result<Response<ListNodesResponse>, Status> {
        // Every node's address: the map of the fleet.
        require_operator(principal_of(&request).as_ref(), "ListNodes")?;
        let journal = self.journal.clone();
        let nodes = tokio::task::spawn_blocking(move || journal.nodes())
            .await
            .map_err(|e| Status::internal(format!("listing nodes: {e}")))?
            .map_err(|e| journal_status(&e))?;
        Ok(Response::new(ListNodesResponse {
            nodes: nodes
                .into_iter()
                .map(|n| FleetNode {
                    name: n.name,
                    address: n.address,
                    alive: n.alive,
                    heartbeat_age_ms: n.heartbeat_age_ms,
                    status_json: n.status,
                })
                .collect(),
            this_node: self.name.clone(),
        }))
    }

    async fn list_projects(
        &self,
        request: Request<ListProjectsRequest>,
    ) -> Result<Response<ListProjectsResponse>, Status> {
        let principal = principal_of(&request);
        let journal = self.journal.clone();
        let projects = tokio::task::spawn_blocking(move || journal.projects())
            .await
            .map_err(|e| Status::internal(format!("listing projects: {e}")))?
            .map_err(|e| journal_status(&e))?;
        Ok(Response::new(ListProjectsResponse {
            projects: projects
                .into_iter()
                // As ListSessions: another principal's projects are not there for this one.
                .filter(|(name, _)| principal.as_ref().is_none_or(|p| p.allows(name)))
                .map(|(name, sessions)| Project { name, sessions })
                .collect(),
        }))
    }

    async fn warm_image(
        &self,
        request: Request<WarmImageRequest>,
    ) -> Result<Response<WarmImageResponse>, Status> {
        require_operator(principal_of(&request).as_ref(), "WarmImage")?;
        let harness = request.into_inner().harness;
        if harness.is_empty() {
            return Err(Status::invalid_argument("harness: empty"));
        }
        let Some(microvm) = &self.microvm else {
            return Err(Status::failed_precondition(format!(
                "harness: this node has no microvm runtime ({})",
                self.facts.microvm_unavailable
            )));
        };
        if !microvm.images().iter().any(|i| i.harness == harness) {
            return Err(Status::not_found(format!(
                "harness: no microVM image serves {harness:?} on this node"
            )));
        }
        let warmed = microvm
            .warm(&harness)
            .await
            .map_err(|why| Status::failed_precondition(format!("harness {harness:?}: {why}")))?;
        tracing::info!(harness, template = %warmed.id, made = warmed.made, "image warmed");
        Ok(Response::new(WarmImageResponse {
            template: warmed.id,
            made: warmed.made,
            took_ms: warmed.took.as_millis() as u64,
        }))
    }

    async fn list_checkpoints(
        &self,
        request: Request<ListCheckpointsRequest>,
    ) -> Result<Response<ListCheckpointsResponse>, Status> {
        let principal = principal_of(&request);
        let uid = request.into_inner().session;
        if uid.is_empty() {
            return Err(Status::invalid_argument("session: empty"));
        }
        if principal.is_some() {
            let session = self.host.view(&uid)?;
            let project = session.metadata.map(|m| m.project).unwrap_or_default();
            crate::api::auth::authorize(principal.as_ref(), &project)?;
        }
        let host = self.host.clone();
        let rows = tokio::task::spawn_blocking(move || host.checkpoints_of(&uid))
            .await
            .map_err(|e| Status::internal(format!("listing checkpoints: {e}")))??;
        Ok(Response::new(ListCheckpointsResponse {
            checkpoints: rows
                .into_iter()
                .map(|r| Checkpoint {
                    seq: r.seq,
                    turn: r.turn,
                    snapshot: r.snapshot,
                    bytes: r.bytes,
                    created_at_unix_nanos: r.created_at,
                })
                .collect(),
        }))
    }

    async fn drain(
        &self,
        request: Request<DrainRequest>,
    ) -> Result<Response<DrainResponse>, Status> {
        let principal = principal_of(&request);
        require_operator(principal.as_ref(), "Drain")?;
        let req = request.into_inner();
        if req.name != self.name {
            return Err(Status::failed_precondition(format!(
                "name: this is node {:?}, not {:?}; drain a node at its own address (ListNodes \
                 gives it)",
                self.name, req.name
            )));
        }
        let budget = std::time::Duration::from_secs(match req.timeout_secs {
            0 => 60,
            secs => u64::from(secs),
        });
        self.host.start_draining();
        tracing::warn!(node = %self.name, "draining: new work is refused, running sessions are suspended");
        let actor = node_actor(principal.as_ref(), "drain");
        let (suspended, failed) = self.host.suspend_all(budget, actor).await;
        let journal = self.journal.clone();
        let released = tokio::task::spawn_blocking(move || journal.release_held())
            .await
            .map_err(|e| Status::internal(format!("releasing sessions: {e}")))?
            .map_err(|e| journal_status(&e))?;
        tracing::warn!(node = %self.name, suspended, failed = failed.len(), released, "drained");
        Ok(Response::new(DrainResponse {
            suspended: suspended as u64,
            failed: failed
                .into_iter()
                .map(|(session, why)| format!("{session}: {why}"))
                .collect(),
            released,
        }))
    }
}
