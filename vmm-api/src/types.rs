//! The other API bodies: `vmm.ping`, `vm.info` and `vm.counters` responses.
//!
//! Response types accept unknown fields, so a client keeps working against a VMM that answers
//! with more than it knows about; the embedded [`VmConfig`] stays strict.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::config::VmConfig;

/// The VM's state as `vm.info` reports it (CH spelling).
///
/// `Created → Running ⇄ Paused → Shutdown`, and `Shutdown → Running` by booting again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum VmState {
    /// A config exists; the VM has not booted.
    Created,
    /// vCPUs run.
    Running,
    /// Torn down after a boot; the config is kept.
    Shutdown,
    /// vCPUs stopped, devices quiesced.
    Paused,
}

/// `GET vm.info` response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmInfo {
    /// The effective config, defaults and generated ids included.
    pub config: VmConfig,
    /// Current state.
    pub state: VmState,
    /// RAM in bytes as the guest sees it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_actual_size: Option<u64>,
    /// Devices by id; absent before boot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_tree: Option<BTreeMap<String, DeviceNode>>,
}

/// One node of `vm.info`'s device tree.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceNode {
    /// Device id (`_vsock0`, `__serial`, …).
    pub id: String,
    /// Resources (I/O ports, MMIO ranges, IRQs) in CH's tagged form, kept opaque.
    #[serde(default)]
    pub resources: Vec<serde_json::Value>,
    /// Ids of child devices.
    #[serde(default)]
    pub children: Vec<String>,
    /// PCI address (`0000:00:01.0`) for PCI devices.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pci_bdf: Option<String>,
}

/// `GET vmm.ping` response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmmPingResponse {
    /// VMM version, e.g. `v0.1.0`.
    pub version: String,
    /// Build identifier (git describe).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub build_version: Option<String>,
    /// The VMM's process id.
    pub pid: i64,
    /// Compiled-in features.
    #[serde(default)]
    pub features: Vec<String>,
}

/// `GET vm.counters` response: device id → counter name → value (values wrap on overflow).
pub type VmCounters = BTreeMap<String, BTreeMap<String, u64>>;

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn vm_info_round_trips_in_cloud_hypervisor_shape() {
        let body = json!({
            "config": {
                "cpus": {"boot_vcpus": 2, "max_vcpus": 2},
                "memory": {"size": 1073741824u64, "shared": false, "hugepages": false,
                           "prefault": false, "mergeable": false, "thp": true},
                "payload": {"kernel": "/var/lib/sbx/vmlinux", "cmdline": "console=ttyS0"},
                "serial": {"mode": "Null"},
                "console": {"mode": "Off"},
                "vsock": {"cid": 3, "socket": "/run/sbx/v1/vsock.sock", "id": "_vsock0"}
            },
            "state": "Running",
            "memory_actual_size": 1073741824u64,
            "device_tree": {
                "_vsock0": {"id": "_vsock0", "resources": [{"MmioAddressRange": {"base": 3489660928u64, "size": 4096}}],
                            "children": [], "pci_bdf": "0000:00:03.0"}
            }
        });
        let info: VmInfo = serde_json::from_value(body.clone()).expect("decode");
        assert_eq!(info.state, VmState::Running);
        assert_eq!(info.memory_actual_size, Some(1 << 30));
        let tree = info.device_tree.as_ref().expect("tree");
        assert_eq!(tree["_vsock0"].pci_bdf.as_deref(), Some("0000:00:03.0"));
        assert_eq!(serde_json::to_value(&info).expect("encode"), body);
    }

    #[test]
    fn vm_info_before_boot_has_no_tree() {
        let info: VmInfo = serde_json::from_value(json!({
            "config": {"payload": {"kernel": "/k"}}, "state": "Created"
        }))
        .expect("decode");
        assert_eq!(info.device_tree, None);
        assert_eq!(info.memory_actual_size, None);
        let encoded = serde_json::to_value(&info).expect("encode");
        assert!(encoded.get("device_tree").is_none());
        assert_eq!(encoded["config"]["console"]["mode"], json!("Off"));
    }

    #[test]
    fn states_use_cloud_hypervisor_spelling() {
        for (state, text) in [
            (VmState::Created, "\"Created\""),
            (VmState::Running, "\"Running\""),
            (VmState::Shutdown, "\"Shutdown\""),
            (VmState::Paused, "\"Paused\""),
        ] {
            assert_eq!(serde_json::to_string(&state).expect("encode"), text);
        }
    }

    #[test]
    fn ping_tolerates_missing_optionals_and_extra_fields() {
        let ping: VmmPingResponse =
            serde_json::from_value(json!({"version": "v53.0", "pid": 42, "extra": 1}))
                .expect("decode");
        assert_eq!(ping.build_version, None);
        assert!(ping.features.is_empty());
        let counters: VmCounters =
            serde_json::from_value(json!({"_net1": {"rx_bytes": 10, "tx_bytes": 20}}))
                .expect("counters");
        assert_eq!(counters["_net1"]["tx_bytes"], 20);
    }
}

/// `vm.snapshot` body: where to write the snapshot (`file:///absolute/dir`, which must exist).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmSnapshotConfig {
    pub destination_url: String,
}

/// `vm.fork` body (agentvm extension): like `vm.snapshot`, but the memory file becomes the
/// frozen base the VM itself continues on copy-on-write, so no guest RAM is copied.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmForkConfig {
    pub destination_url: String,
    /// Run the VM again as soon as its RAM is frozen (the snapshot's digests are then taken
    /// beside it) instead of leaving it paused.
    #[serde(default)]
    pub resume: bool,
}

/// `vm.checkpoint` body (agentvm extension): where to write the checkpoint
/// (`file:///absolute/dir`, existing and empty).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmCheckpointConfig {
    pub destination_url: String,
    /// Where the VMM's last checkpoint lives now, if it was moved after it was written
    /// (into a snapshot store): the new one is layered on it there. Without it, a
    /// checkpoint is layered on the last one only if that is still where it was written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_url: Option<String>,
    /// Start a new run of checkpoints whatever the last one was: this one is not layered on
    /// it but on what the VM runs over (the snapshot it was restored from, or its first
    /// checkpoint's frozen RAM), holding everything it changed since; a booted VM's first is
    /// its whole RAM. For a caller that lost track of the last (it failed to store it).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub fresh: bool,
}

/// Body of `vm.checkpoint-wait` (extension; optional): which checkpoint to wait for, by the
/// directory it was taken into. Without it, the last one taken.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmCheckpointWait {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub destination_url: Option<String>,
}

/// What `vm.checkpoint` did. The first checkpoint of a VM holds what it changed since it was
/// restored (or, booted, its whole RAM, linked rather than copied); each later one is a
/// layer on the one before holding only the pages and disk blocks written in between.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct VmCheckpointReport {
    /// Guest pages the checkpoint's memory file stores.
    pub memory_pages: u64,
    /// 4 KiB disk blocks its disk layers store, all disks together.
    pub disk_blocks: u64,
    /// How long the VM was paused, microseconds.
    pub paused_us: u64,
    /// How long what changed was copied before the pause, with the VM running, microseconds.
    #[serde(default)]
    pub precopy_us: u64,
    /// From the call to a durable checkpoint, microseconds.
    pub elapsed_us: u64,
    /// Layered on the VM's previous checkpoint (false: the first, or a flattened one).
    pub incremental: bool,
    /// Layers in the checkpoint's chain, itself included (0 until it is written).
    pub chain_depth: u32,
    /// Written and synced, manifest last (`vm.checkpoint-wait`'s answer); `vm.checkpoint`
    /// answers as soon as the VM runs again, with the files still being written.
    pub durable: bool,
}

/// How `vm.restore` brings memory back (Cloud Hypervisor's names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum MemoryRestoreMode {
    /// Cloud Hypervisor reads all memory up front; agentvm-vmm maps the snapshot
    /// copy-on-write either way and treats this as `OnDemand` with `prefault`.
    #[default]
    Copy,
    /// Pages load when the guest touches them.
    OnDemand,
}

/// `vm.restore` body.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RestoreConfig {
    pub source_url: String,
    /// Touch every page before returning (read-faults only: pages stay shared).
    #[serde(default)]
    pub prefault: bool,
    #[serde(default)]
    pub memory_restore_mode: MemoryRestoreMode,
    /// Run the VM right away instead of leaving it paused.
    #[serde(default)]
    pub resume: bool,
    /// agentvm extension: bind the vsock device here instead of the path in the snapshot's
    /// config (every clone needs its own; the snapshot stays untouched so its digests hold).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vsock_socket: Option<std::path::PathBuf>,
    /// agentvm extension: write the serial port's output to this file instead of where the
    /// snapshot's config says (which belonged to the VM that was snapshotted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial_file: Option<std::path::PathBuf>,
    /// agentvm extension: the restored VM's disk files, in the order of the snapshot's
    /// `disks` (a clone's own copies of them); empty keeps the paths its config names.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disk_paths: Vec<std::path::PathBuf>,
    /// agentvm extension: per network device (by id), a new tap, MAC and egress policy for
    /// the restored VM (a fork child or resumed VM gets a new MAC, a new address and its
    /// policy); a device without an entry keeps the snapshot's config.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub net_overrides: Vec<NetOverride>,
    /// Cloud Hypervisor's tap FDs; agentvm-vmm opens taps by name (`net[].tap`,
    /// `net_overrides`), so only empty is accepted.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub net_fds: Vec<serde_json::Value>,
}

impl RestoreConfig {
    /// Checks `net_overrides` on their own (that their ids name devices of the snapshot's VM
    /// is the VMM's to check); errors name the field (`net_overrides[0].mac`).
    pub fn validate_net_overrides(&self) -> Result<(), crate::ConfigError> {
        for (i, entry) in self.net_overrides.iter().enumerate() {
            let at = format!("net_overrides[{i}]");
            entry.validate().map_err(|e| e.within(&at))?;
            if self.net_overrides[..i].iter().any(|o| o.id == entry.id) {
                return Err(crate::ConfigError {
                    path: format!("{at}.id"),
                    reason: format!("{:?} is overridden twice", entry.id),
                });
            }
        }
        Ok(())
    }
}

/// One entry of RestoreConfig.net_overrides.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetOverride {
    /// The device's id in the snapshot's config (`_net0` unless it named one).
    pub id: String,
    /// Attach to this tap instead.
    #[serde(default)]
    pub tap: Option<String>,
    /// The guest's new MAC ("xx:xx:xx:xx:xx:xx", unicast), in the device's config space.
    #[serde(default)]
    pub mac: Option<String>,
    /// Replaces the policy (the flow table never survives a restore either way).
    #[serde(default)]
    pub egress: Option<crate::config::EgressPolicy>,
}

impl NetOverride {
    /// Checks each field given; errors name it (`tap`, `egress.allow[1].cidr`).
    pub fn validate(&self) -> Result<(), crate::ConfigError> {
        let err = |path: &str, reason: String| crate::ConfigError {
            path: path.to_owned(),
            reason,
        };
        if self.id.is_empty() {
            return Err(err("id", "must not be empty".to_owned()));
        }
        if let Some(tap) = &self.tap {
            crate::config::check_tap_name(tap).map_err(|r| err("tap", r))?;
        }
        if let Some(mac) = &self.mac {
            crate::config::parse_mac(mac).map_err(|r| err("mac", r))?;
        }
        if let Some(egress) = &self.egress {
            egress.validate().map_err(|e| e.within("egress"))?;
        }
        Ok(())
    }

    /// Applies the override to `net`.
    pub fn apply(&self, net: &mut crate::config::NetConfig) {
        if let Some(tap) = &self.tap {
            net.tap = tap.clone();
        }
        if let Some(mac) = &self.mac {
            net.mac = Some(mac.clone());
        }
        if let Some(egress) = &self.egress {
            net.egress = Some(egress.clone());
        }
    }
}

/// `PUT /api/v1/vm.egress-allow` body (agentvm extension): rules appended to a running VM's
/// egress policy (the daemon's DNS resolver adds the addresses of names it allowed).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmEgressAllow {
    /// The net device's id; absent means the VM's first (`_net0` by default).
    #[serde(default)]
    pub id: Option<String>,
    pub rules: Vec<crate::config::EgressRule>,
}

impl VmEgressAllow {
    /// The rules parsed; errors name the rule (`rules[3].cidr`). More than
    /// [`MAX_EGRESS_RULES`](crate::config::MAX_EGRESS_RULES) in one body is refused here;
    /// the device's total is the VMM's to check.
    pub fn parse(&self) -> Result<Vec<crate::config::ParsedRule>, crate::ConfigError> {
        if self.id.as_deref() == Some("") {
            return Err(crate::ConfigError {
                path: "id".to_owned(),
                reason: "must not be empty".to_owned(),
            });
        }
        if self.rules.len() > crate::config::MAX_EGRESS_RULES {
            return Err(crate::ConfigError {
                path: "rules".to_owned(),
                reason: format!(
                    "at most {} rules per device, got {}",
                    crate::config::MAX_EGRESS_RULES,
                    self.rules.len()
                ),
            });
        }
        crate::config::parse_rules(&self.rules).map_err(|e| e.within("rules"))
    }
}

/// The absolute directory a `file://` URL names.
pub fn dir_from_url(field: &str, url: &str) -> Result<std::path::PathBuf, crate::ConfigError> {
    let err = |reason: &str| crate::ConfigError {
        path: field.to_owned(),
        reason: reason.to_owned(),
    };
    let path = url
        .strip_prefix("file://")
        .ok_or_else(|| err("must be a file:// URL"))?;
    if !path.starts_with('/') {
        return Err(err("must name an absolute path (file:///dir)"));
    }
    if path.contains('\0') {
        return Err(err("must not contain NUL"));
    }
    Ok(std::path::PathBuf::from(path))
}

/// `PUT vmm.ram-dir` (agentvm extension): the directory, a tmpfs, the next booted VM's RAM
/// file goes in (as `--ram-dir` says at start); `null` puts it in a memfd.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmmRamDir {
    pub path: Option<std::path::PathBuf>,
}

impl VmmRamDir {
    /// A path must be absolute: the VMM may run elsewhere than its caller.
    pub fn check(&self) -> Result<(), String> {
        match &self.path {
            Some(path) if !path.is_absolute() => {
                Err(format!("path: {} is not absolute", path.display()))
            }
            _ => Ok(()),
        }
    }
}
