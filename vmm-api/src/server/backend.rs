//! [`VmmBackend`]: what the server routes requests to. agentvm-vmm implements it.

use crate::config::VmConfig;
use crate::error::ApiError;
use crate::types::{
    RestoreConfig, VmCheckpointConfig, VmCheckpointReport, VmCheckpointWait, VmCounters,
    VmEgressAllow, VmForkConfig, VmInfo, VmSnapshotConfig, VmmPingResponse, VmmRamDir,
};

/// The VMM behind the API.
///
/// Calls are blocking (they do KVM work): the server runs each on a blocking thread and never
/// runs two at once, as Cloud Hypervisor does. Errors carry the *causes*; the server prepends
/// what failed (`"vm.pause failed"`). Status codes follow CH v53 (vmm-api.md §1.1, §2):
/// 404 when no VM config exists, 500 for wrong-state calls and everything else.
pub trait VmmBackend: Send + Sync + 'static {
    /// `GET vmm.ping`.
    fn ping(&self) -> VmmPingResponse;

    /// `PUT vm.create`: store `config` (already decoded and validated by the server).
    /// A config already stored → 500 (`VmAlreadyCreated`).
    fn create(&self, config: VmConfig) -> Result<(), ApiError>;

    /// `PUT vm.boot`: no config → 404; already booted → 500.
    fn boot(&self) -> Result<(), ApiError>;

    /// `GET vm.info`: no config → 404.
    fn info(&self) -> Result<VmInfo, ApiError>;

    /// `PUT vm.pause`: not `Running` → 500.
    fn pause(&self) -> Result<(), ApiError>;

    /// `PUT vm.resume`: not `Paused` → 500.
    fn resume(&self) -> Result<(), ApiError>;

    /// `PUT vm.shutdown`: tear down, keep the config. Not booted → 500.
    fn shutdown(&self) -> Result<(), ApiError>;

    /// `PUT vm.delete`: shut down if running, drop the config. Nothing to delete is success.
    fn delete(&self) -> Result<(), ApiError>;

    /// `GET vm.counters`: not booted → 500.
    fn counters(&self) -> Result<VmCounters, ApiError>;

    /// `PUT vm.snapshot`: the VM must be `Paused` (else 500); it stays paused.
    fn snapshot(&self, config: VmSnapshotConfig) -> Result<(), ApiError>;

    /// `PUT vm.restore`: only into a VMM with no VM config (else 500); the VM comes back
    /// `Paused` unless `resume`.
    fn restore(&self, config: RestoreConfig) -> Result<(), ApiError>;

    /// `PUT vm.fork` (extension): the VM must be `Paused`; it stays paused.
    fn fork(&self, config: VmForkConfig) -> Result<(), ApiError>;

    /// `PUT vm.checkpoint` (extension): the VM must be `Running` (else 500) and stays so.
    /// A backend without checkpoints answers 501.
    fn checkpoint(&self, _config: VmCheckpointConfig) -> Result<VmCheckpointReport, ApiError> {
        Err(ApiError::new(
            501,
            "vm.checkpoint is not supported by this VMM",
        ))
    }

    /// `PUT vm.checkpoint-wait` (extension): no VM → 404; no such checkpoint taken → 404.
    /// Runs beside other calls (it only waits): it must not hold up the VM while it does.
    fn checkpoint_wait(&self, _request: VmCheckpointWait) -> Result<VmCheckpointReport, ApiError> {
        Err(ApiError::new(
            501,
            "vm.checkpoint-wait is not supported by this VMM",
        ))
    }

    /// `PUT vm.egress-allow` (extension): append `request.rules` (already parsed and checked
    /// by the server) to the policy of a booted VM's net device. No VM booted or no such
    /// device → 404; a device without a policy, or past
    /// [`MAX_EGRESS_RULES`](crate::config::MAX_EGRESS_RULES) in all → 400. A backend
    /// without network devices need not implement it.
    fn egress_allow(&self, request: VmEgressAllow) -> Result<(), ApiError> {
        let _ = request;
        Err(ApiError::not_found("this VMM has no network devices"))
    }

    /// `PUT vm.egress-revoke` (extension): remove `request.rules` from the policy of a booted
    /// VM's net device (a rule it does not hold is ignored); flows the guest already opened
    /// stay open. Errors as [`Self::egress_allow`].
    fn egress_revoke(&self, request: VmEgressAllow) -> Result<(), ApiError> {
        let _ = request;
        Err(ApiError::not_found("this VMM has no network devices"))
    }

    /// `PUT vmm.ram-dir`: where the next booted VM's RAM file goes. A backend that keeps
    /// guest RAM elsewhere need not implement it.
    fn set_ram_dir(&self, request: VmmRamDir) -> Result<(), ApiError> {
        let _ = request;
        Err(ApiError::not_found("this VMM does not place RAM files"))
    }

    /// `PUT vmm.shutdown`: called before the 200 is sent; the server then stops serving and
    /// `serve` returns. No backend call runs after this one succeeds.
    fn shutdown_vmm(&self) -> Result<(), ApiError>;
}
