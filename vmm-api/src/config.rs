//! The `VmConfig` subset agentvm-vmm supports, in Cloud Hypervisor's JSON shape.
//!
//! Field names and defaults are CH's (`vmm/src/vm_config.rs`), with two differences:
//! every struct denies unknown fields (a CH field we do not implement, such as `rng`,
//! `cpus.topology` or a disk's `vhost_user`, is a 400 naming it rather than silently ignored), and the console
//! defaults to `Off` (CH: `Tty`) because agentvm-vmm has no virtio-console.
//!
//! Decoding checks types; [`VmConfig::validate`] checks values. Both name the field at fault.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::json::{self, JsonError, at_path};

mod net;

pub use self::net::*;

/// Most vCPUs a VM may have.
pub const MAX_VCPUS: u8 = 32;
/// Default guest RAM: 512 MiB, as in CH.
pub const DEFAULT_MEMORY_SIZE: u64 = 512 << 20;
/// Least guest RAM accepted: 2 MiB.
pub const MIN_MEMORY_SIZE: u64 = 2 << 20;
/// Most guest RAM accepted for now: 64 GiB.
pub const MAX_MEMORY_SIZE: u64 = 64 << 30;
/// Guest RAM is a whole number of these (4 KiB pages).
pub const MEMORY_SIZE_ALIGN: u64 = 4 << 10;
/// Longest kernel command line, in bytes (x86 boot protocol limit minus the NUL).
pub const MAX_CMDLINE_LEN: usize = 2047;
/// Lowest guest CID: 0, 1 and 2 are reserved by vsock.
pub const MIN_GUEST_CID: u32 = 3;
/// `VMADDR_CID_ANY`, never a valid guest CID.
pub const CID_ANY: u32 = u32::MAX;

/// A config value that is well-typed but not acceptable, with the field path at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", at_path(path, reason))]
pub struct ConfigError {
    /// Dotted field path, e.g. `cpus.boot_vcpus`; `.` for the whole body.
    pub path: String,
    /// What is wrong with it.
    pub reason: String,
}

impl ConfigError {
    fn new(path: &str, reason: impl Into<String>) -> Self {
        Self {
            path: path.to_owned(),
            reason: reason.into(),
        }
    }

    /// The same error with its path put under `prefix` (`tap` under `net[0]` is
    /// `net[0].tap`, `[2].ports` under `allow` is `allow[2].ports`).
    #[must_use]
    pub fn within(mut self, prefix: &str) -> Self {
        self.path = if matches!(self.path.as_str(), "" | "." | "?") {
            prefix.to_owned()
        } else if self.path.starts_with('[') {
            format!("{prefix}{}", self.path)
        } else {
            format!("{prefix}.{}", self.path)
        };
        self
    }

    /// The same error under element `index` of a list (`cidr` becomes `[3].cidr`).
    #[must_use]
    pub fn within_index(self, index: usize) -> Self {
        self.within(&format!("[{index}]"))
    }
}

impl From<JsonError> for ConfigError {
    fn from(e: JsonError) -> Self {
        Self {
            path: e.path,
            reason: e.reason,
        }
    }
}

/// The body of `vm.create`, and `config` in `vm.info`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmConfig {
    /// vCPUs; default 1 boot / 1 max.
    #[serde(default)]
    pub cpus: CpusConfig,
    /// Guest RAM; default 512 MiB.
    #[serde(default)]
    pub memory: MemoryConfig,
    /// What to boot. Required.
    pub payload: PayloadConfig,
    /// Legacy 16550 UART (guest `ttyS0`); default mode `Null`.
    #[serde(default)]
    pub serial: SerialConfig,
    /// virtio-console; default mode `Off` (CH: `Tty`). Only `Off` and `Null` are accepted.
    #[serde(default)]
    pub console: ConsoleConfig,
    /// Hybrid vsock device; none by default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vsock: Option<VsockConfig>,
    /// virtio-blk disks, in the order the guest sees them (`vda`, `vdb`, …); none by default.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disks: Vec<DiskConfig>,
    /// virtio-net devices on taps (at most [`MAX_NETS`]); none by default.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub net: Vec<NetConfig>,
}

impl VmConfig {
    /// A config with defaults everywhere and `kernel` as the payload.
    pub fn with_kernel(kernel: impl Into<PathBuf>) -> Self {
        Self {
            cpus: CpusConfig::default(),
            memory: MemoryConfig::default(),
            payload: PayloadConfig {
                kernel: Some(kernel.into()),
                ..PayloadConfig::default()
            },
            serial: SerialConfig::default(),
            console: ConsoleConfig::default(),
            vsock: None,
            disks: Vec::new(),
            net: Vec::new(),
        }
    }

    /// Decodes a `vm.create` body and validates it. Errors name the field path.
    pub fn from_json(bytes: &[u8]) -> Result<Self, ConfigError> {
        let config: Self = json::from_slice(bytes)?;
        config.validate()?;
        Ok(config)
    }

    /// Checks every value agentvm-vmm cares about; the first problem found is returned.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.cpus.validate()?;
        self.memory.validate()?;
        self.payload.validate()?;
        self.serial.validate()?;
        self.console.validate()?;
        if let Some(vsock) = &self.vsock {
            vsock.validate()?;
        }
        if self.disks.len() > MAX_DISKS {
            return Err(ConfigError::new(
                "disks",
                format!("at most {MAX_DISKS} disks, got {}", self.disks.len()),
            ));
        }
        for (i, disk) in self.disks.iter().enumerate() {
            disk.validate(i)?;
            let id = disk.id.as_deref();
            let vsock_id = self.vsock.as_ref().and_then(|v| v.id.as_deref());
            if id.is_some()
                && (id == vsock_id || self.disks[..i].iter().any(|d| d.id.as_deref() == id))
            {
                return Err(ConfigError::new(
                    &format!("disks[{i}].id"),
                    format!("{:?} is the id of another device", id.unwrap_or_default()),
                ));
            }
        }
        self.validate_net()
    }

    fn validate_net(&self) -> Result<(), ConfigError> {
        if self.net.len() > MAX_NETS {
            return Err(ConfigError::new(
                "net",
                format!("at most {MAX_NETS} network devices, got {}", self.net.len()),
            ));
        }
        // Ids key vm.info's device tree and vm.counters: a net device's must not be any
        // other device's (their defaults included) or a counter group's.
        let mut taken: Vec<String> = vec!["_serial".to_owned(), "vcpus".to_owned()];
        if let Some(vsock) = &self.vsock {
            taken.push(vsock.id.clone().unwrap_or_else(|| "_vsock0".to_owned()));
        }
        for (i, disk) in self.disks.iter().enumerate() {
            taken.push(disk.id.clone().unwrap_or_else(|| format!("_disk{i}")));
        }
        for (i, net) in self.net.iter().enumerate() {
            let at = format!("net[{i}]");
            net.validate().map_err(|e| e.within(&at))?;
            let id = net.device_id(i);
            if taken.contains(&id) {
                return Err(ConfigError::new(
                    &format!("{at}.id"),
                    format!("{id:?} is the id of another device"),
                ));
            }
            if let Some(other) = self.net[..i].iter().position(|n| n.tap == net.tap) {
                return Err(ConfigError::new(
                    &format!("{at}.tap"),
                    format!("{:?} is net[{other}]'s tap too", net.tap),
                ));
            }
            taken.push(id);
        }
        Ok(())
    }
}

/// vCPU counts. Both are required when `cpus` is present, as in CH.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CpusConfig {
    /// vCPUs started at boot: 1..=32.
    pub boot_vcpus: u8,
    /// Must equal `boot_vcpus`: agentvm-vmm has no CPU hotplug.
    pub max_vcpus: u8,
}

impl Default for CpusConfig {
    fn default() -> Self {
        Self {
            boot_vcpus: 1,
            max_vcpus: 1,
        }
    }
}

impl CpusConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if !(1..=MAX_VCPUS).contains(&self.boot_vcpus) {
            return Err(ConfigError::new(
                "cpus.boot_vcpus",
                format!("must be between 1 and {MAX_VCPUS}, got {}", self.boot_vcpus),
            ));
        }
        if self.max_vcpus != self.boot_vcpus {
            return Err(ConfigError::new(
                "cpus.max_vcpus",
                format!(
                    "must equal cpus.boot_vcpus ({}), got {}: agentvm-vmm has no CPU hotplug",
                    self.boot_vcpus, self.max_vcpus
                ),
            ));
        }
        Ok(())
    }
}

/// Guest RAM.
///
/// agentvm-vmm always backs guest RAM with a memfd mapped `MAP_SHARED`, so a snapshot can hand
/// the memory over without copying it. `shared` is therefore accepted for compatibility with
/// CH clients but does not change the mapping.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryConfig {
    /// Bytes of RAM: at least 2 MiB, a multiple of 4 KiB, at most 64 GiB. Required when
    /// `memory` is present, as in CH.
    pub size: u64,
    /// Accepted for compatibility; RAM is always a shared memfd (see the type docs).
    #[serde(default)]
    pub shared: bool,
    /// Not supported: `true` is rejected.
    #[serde(default)]
    pub hugepages: bool,
    /// Touch all guest memory at boot.
    #[serde(default)]
    pub prefault: bool,
    /// Mark guest memory `MADV_MERGEABLE` (KSM).
    #[serde(default)]
    pub mergeable: bool,
    /// Mark guest memory `MADV_HUGEPAGE` (transparent huge pages). Default true.
    #[serde(default = "default_true")]
    pub thp: bool,
}

fn default_true() -> bool {
    true
}

impl Default for MemoryConfig {
    fn default() -> Self {
        Self {
            size: DEFAULT_MEMORY_SIZE,
            shared: false,
            hugepages: false,
            prefault: false,
            mergeable: false,
            thp: true,
        }
    }
}

impl MemoryConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        let size = self.size;
        if size < MIN_MEMORY_SIZE {
            return Err(ConfigError::new(
                "memory.size",
                format!("must be at least {MIN_MEMORY_SIZE} bytes (2 MiB), got {size}"),
            ));
        }
        if !size.is_multiple_of(MEMORY_SIZE_ALIGN) {
            return Err(ConfigError::new(
                "memory.size",
                format!("must be a multiple of {MEMORY_SIZE_ALIGN} bytes (4 KiB), got {size}"),
            ));
        }
        if size > MAX_MEMORY_SIZE {
            return Err(ConfigError::new(
                "memory.size",
                format!("must be at most {MAX_MEMORY_SIZE} bytes (64 GiB), got {size}"),
            ));
        }
        if self.hugepages {
            return Err(ConfigError::new(
                "memory.hugepages",
                "hugepages are not supported by agentvm-vmm",
            ));
        }
        Ok(())
    }
}

/// What to boot. agentvm-vmm loads a kernel directly; firmware boot is not supported.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PayloadConfig {
    /// Kernel image (vmlinux/PVH ELF or bzImage). Required.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel: Option<PathBuf>,
    /// Initramfs image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initramfs: Option<PathBuf>,
    /// Kernel command line: at most 2047 bytes, no NUL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cmdline: Option<String>,
    /// Not supported: setting it is rejected.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub firmware: Option<PathBuf>,
}

impl PayloadConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if self.firmware.is_some() {
            return Err(ConfigError::new(
                "payload.firmware",
                "firmware boot is not supported by agentvm-vmm; set payload.kernel instead",
            ));
        }
        match &self.kernel {
            None => {
                return Err(ConfigError::new(
                    "payload.kernel",
                    "is required: agentvm-vmm boots a kernel directly",
                ));
            }
            Some(kernel) => check_path("payload.kernel", kernel)?,
        }
        if let Some(initramfs) = &self.initramfs {
            check_path("payload.initramfs", initramfs)?;
        }
        if let Some(cmdline) = &self.cmdline {
            if cmdline.len() > MAX_CMDLINE_LEN {
                return Err(ConfigError::new(
                    "payload.cmdline",
                    format!(
                        "is {} bytes long, at most {MAX_CMDLINE_LEN} are allowed",
                        cmdline.len()
                    ),
                ));
            }
            if cmdline.contains('\0') {
                return Err(ConfigError::new(
                    "payload.cmdline",
                    "must not contain NUL bytes",
                ));
            }
        }
        Ok(())
    }
}

/// Where a console's output goes, in CH's spelling.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ConsoleOutputMode {
    /// No device.
    Off,
    /// A pseudo-terminal (not supported).
    Pty,
    /// The VMM's stdout.
    Tty,
    /// A file; `file` is required.
    File,
    /// A unix socket (not supported).
    Socket,
    /// The device exists; output is dropped.
    Null,
}

/// The legacy 16550 UART. Supported modes: `Off`, `Null`, `Tty` (the VMM's stdout) and
/// `File` (with `file`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SerialConfig {
    /// Output mode. Required when `serial` is present.
    pub mode: ConsoleOutputMode,
    /// Output file for mode `File`; only allowed with that mode.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file: Option<PathBuf>,
    /// Socket for mode `Socket`; not supported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub socket: Option<PathBuf>,
}

impl Default for SerialConfig {
    fn default() -> Self {
        Self {
            mode: ConsoleOutputMode::Null,
            file: None,
            socket: None,
        }
    }
}

impl SerialConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        use ConsoleOutputMode::*;
        match self.mode {
            Off | Null | Tty | File => {}
            Pty | Socket => {
                return Err(ConfigError::new(
                    "serial.mode",
                    format!(
                        "{:?} is not supported by agentvm-vmm (use Off, Null, Tty or File)",
                        self.mode
                    ),
                ));
            }
        }
        match (&self.file, self.mode) {
            (None, File) => {
                return Err(ConfigError::new(
                    "serial.file",
                    "is required when serial.mode is File",
                ));
            }
            (Some(file), File) => check_path("serial.file", file)?,
            (Some(_), _) => {
                return Err(ConfigError::new(
                    "serial.file",
                    "is only allowed when serial.mode is File",
                ));
            }
            (None, _) => {}
        }
        if self.socket.is_some() {
            return Err(ConfigError::new(
                "serial.socket",
                "is not supported by agentvm-vmm",
            ));
        }
        Ok(())
    }
}

/// The virtio-console. agentvm-vmm has none, so only `Off` and `Null` are accepted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConsoleConfig {
    /// Output mode. Required when `console` is present.
    pub mode: ConsoleOutputMode,
    /// Not supported: setting it is rejected.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file: Option<PathBuf>,
    /// Not supported: setting it is rejected.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub socket: Option<PathBuf>,
}

impl Default for ConsoleConfig {
    fn default() -> Self {
        Self {
            mode: ConsoleOutputMode::Off,
            file: None,
            socket: None,
        }
    }
}

impl ConsoleConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        match self.mode {
            ConsoleOutputMode::Off | ConsoleOutputMode::Null => {}
            mode => {
                return Err(ConfigError::new(
                    "console.mode",
                    format!(
                        "{mode:?} is not supported: agentvm-vmm has no virtio-console \
                         (use Off or Null)"
                    ),
                ));
            }
        }
        if self.file.is_some() {
            return Err(ConfigError::new(
                "console.file",
                "is not supported: agentvm-vmm has no virtio-console",
            ));
        }
        if self.socket.is_some() {
            return Err(ConfigError::new(
                "console.socket",
                "is not supported: agentvm-vmm has no virtio-console",
            ));
        }
        Ok(())
    }
}

/// A hybrid vsock device (Firecracker's `CONNECT <port>` protocol on a host unix socket).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VsockConfig {
    /// Guest CID: at least 3, not `u32::MAX`.
    pub cid: u32,
    /// Host socket the VMM **binds** at boot. It must not exist then; that is checked by the
    /// VMM at boot, not here.
    pub socket: PathBuf,
    /// Device id; generated by the VMM when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
}

impl VsockConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if self.cid < MIN_GUEST_CID {
            return Err(ConfigError::new(
                "vsock.cid",
                format!(
                    "must be at least {MIN_GUEST_CID} (0-2 are reserved), got {}",
                    self.cid
                ),
            ));
        }
        if self.cid == CID_ANY {
            return Err(ConfigError::new(
                "vsock.cid",
                format!("{CID_ANY} is VMADDR_CID_ANY, not a guest CID"),
            ));
        }
        check_path("vsock.socket", &self.socket)?;
        if self.id.as_deref() == Some("") {
            return Err(ConfigError::new("vsock.id", "must not be empty"));
        }
        Ok(())
    }
}

/// Most disks a VM may have (each takes a virtio-mmio window and an interrupt line).
pub const MAX_DISKS: usize = 8;
/// Longest disk serial: what virtio-blk's GET_ID carries.
pub const MAX_DISK_SERIAL_LEN: usize = 20;

/// A virtio-blk disk backed by a file (a raw image, a whole number of 512-byte sectors).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskConfig {
    /// The image file. Opened read-write unless `readonly`.
    pub path: PathBuf,
    /// The guest may read it only (writes fail with an I/O error in the guest).
    #[serde(default)]
    pub readonly: bool,
    /// Device id; `_diskN` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// What the guest reads as the disk's serial (`/dev/disk/by-id/virtio-SERIAL`): up to 20
    /// printable ASCII bytes. Default: the device id, cut to 20 bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial: Option<String>,
}

impl DiskConfig {
    fn validate(&self, index: usize) -> Result<(), ConfigError> {
        let field = |name: &str| format!("disks[{index}].{name}");
        check_path(&field("path"), &self.path)?;
        if self.id.as_deref() == Some("") {
            return Err(ConfigError::new(&field("id"), "must not be empty"));
        }
        if let Some(serial) = &self.serial {
            if serial.len() > MAX_DISK_SERIAL_LEN {
                return Err(ConfigError::new(
                    &field("serial"),
                    format!("at most {MAX_DISK_SERIAL_LEN} bytes, got {}", serial.len()),
                ));
            }
            if !serial.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(ConfigError::new(
                    &field("serial"),
                    "must be printable ASCII without spaces",
                ));
            }
        }
        Ok(())
    }
}

/// A path the VMM will open or bind: not empty, no NUL byte.
fn check_path(field: &str, path: &Path) -> Result<(), ConfigError> {
    let bytes = path.as_os_str().as_encoded_bytes();
    if bytes.is_empty() {
        return Err(ConfigError::new(field, "must not be empty"));
    }
    if bytes.contains(&0) {
        return Err(ConfigError::new(field, "must not contain NUL bytes"));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
