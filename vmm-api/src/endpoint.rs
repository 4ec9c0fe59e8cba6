//! Endpoint names and their paths: the one definition both the server's route table and
//! the client use.

/// Every endpoint lives under this prefix, e.g. `/api/v1/vm.create`.
pub const API_PREFIX: &str = "/api/v1/";

/// `GET`: liveness and version.
pub const VMM_PING: &str = "vmm.ping";
/// `PUT`: delete the VM, answer 200, stop serving.
pub const VMM_SHUTDOWN: &str = "vmm.shutdown";
/// `PUT` with a `VmConfig` body: store the config, do not boot.
pub const VM_CREATE: &str = "vm.create";
/// `PUT`: boot the stored config.
pub const VM_BOOT: &str = "vm.boot";
/// `GET`: config, state and device tree.
pub const VM_INFO: &str = "vm.info";
/// `GET`: per-device counters.
pub const VM_COUNTERS: &str = "vm.counters";
/// `PUT`: stop the vCPUs.
pub const VM_PAUSE: &str = "vm.pause";
/// `PUT`: restart the vCPUs.
pub const VM_RESUME: &str = "vm.resume";
/// `PUT`: tear the VM down, keep the config.
pub const VM_SHUTDOWN: &str = "vm.shutdown";
/// `PUT`: tear the VM down and drop the config.
pub const VM_DELETE: &str = "vm.delete";
/// `PUT` with a `VmSnapshotConfig` body: write a snapshot of the paused VM.
pub const VM_SNAPSHOT: &str = "vm.snapshot";
/// `PUT` with a `RestoreConfig` body: bring a snapshot back in a VMM with no VM.
pub const VM_RESTORE: &str = "vm.restore";
/// `PUT` with a `VmForkConfig` body (agentvm extension): freeze the paused VM's memory as a
/// base that any number of restored children share copy-on-write.
pub const VM_FORK: &str = "vm.fork";
/// `PUT` with a `VmCheckpointConfig` body (agentvm extension): checkpoint the running VM
/// (paused only while what changed is captured); answers a `VmCheckpointReport`.
pub const VM_CHECKPOINT: &str = "vm.checkpoint";
/// `PUT` (agentvm extension): wait until the last checkpoint is written and durable;
/// answers its `VmCheckpointReport`.
pub const VM_CHECKPOINT_WAIT: &str = "vm.checkpoint-wait";
/// `PUT` with a `VmEgressAllow` body (agentvm extension): append allow rules to a booted
/// VM's egress policy.
pub const VM_EGRESS_ALLOW: &str = "vm.egress-allow";
/// `PUT` with a `VmEgressAllow` body (agentvm extension): take allow rules back out of a
/// booted VM's egress policy (flows already open stay open).
pub const VM_EGRESS_REVOKE: &str = "vm.egress-revoke";

/// `PUT` with a `VmmRamDir` body (agentvm extension): where the next VM's RAM file goes. A
/// VMM started ahead of its VM (a node's pool) learns its directory only once it is claimed.
pub const VMM_RAM_DIR: &str = "vmm.ram-dir";

/// The request path of `endpoint`: `path("vm.boot") == "/api/v1/vm.boot"`.
pub fn path(endpoint: &str) -> String {
    format!("{API_PREFIX}{endpoint}")
}

/// The endpoint named by a request path, if it has the API prefix.
pub fn from_path(path: &str) -> Option<&str> {
    path.strip_prefix(API_PREFIX)
}
