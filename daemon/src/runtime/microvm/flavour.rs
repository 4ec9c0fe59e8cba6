//! The two VMMs the runtime drives through the same Cloud Hypervisor REST API, and the few
//! places where they differ: how one is started, whether it can fork copy-on-write, and how
//! a snapshot is restored as a new VM with its own sockets.
//!
//! - `agentvm`: agentvm-vmm. `vm.restore` takes `vsock_socket` and `serial_file` (our
//!   extensions), so every clone restores straight from the one snapshot directory, whose
//!   digests stay valid, and maps its memory copy-on-write.
//! - `cloud-hypervisor`: a stock Cloud Hypervisor, v52 or later (`resume` and
//!   `memory_restore_mode` in `vm.restore`). It restores a VM exactly as the snapshot's
//!   `config.json` describes it, vsock socket path included, so each restore gets its own
//!   copy of the snapshot directory with `config.json` rewritten to its paths (the spec's
//!   advice for clones) and the large files hard-linked. Its memory is copied in, not shared:
//!   the runtime reports `cow_fork = false`.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use agentvm_vmm_api::types::{MemoryRestoreMode, RestoreConfig};

/// Where a Cloud Hypervisor snapshot keeps the VM's config; rewritten per clone.
const CH_CONFIG_FILE: &str = "config.json";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum VmmFlavour {
    #[default]
    Agentvm,
    CloudHypervisor,
}

impl VmmFlavour {
    pub fn name(self) -> &'static str {
        match self {
            Self::Agentvm => "agentvm",
            Self::CloudHypervisor => "cloud-hypervisor",
        }
    }

    /// The binary looked up when none is configured.
    pub fn default_binary(self) -> &'static str {
        match self {
            Self::Agentvm => "agentvm-vmm",
            Self::CloudHypervisor => "cloud-hypervisor",
        }
    }

    /// Arguments that start a VMM serving its API on `api`, with no VM yet.
    pub fn args(self, api: &Path, ram_dir: &Path, api_fd: Option<i32>) -> Vec<OsString> {
        match self {
            Self::Agentvm => {
                let mut args: Vec<OsString> = vec![
                    "--api-socket".into(),
                    api.into(),
                    "--ram-dir".into(),
                    ram_dir.into(),
                ];
                if let Some(fd) = api_fd {
                    args.extend(["--api-fd".into(), fd.to_string().into()]);
                }
                args
            }
            Self::CloudHypervisor => {
                let mut socket = OsString::from("path=");
                socket.push(api);
                vec!["--api-socket".into(), socket]
            }
        }
    }

    /// Whether the VMM serves its API on a listening socket handed down to it (`args`'
    /// `api_fd`), bound by agentvmd before the VMM runs.
    pub fn takes_api_listener(self) -> bool {
        self == Self::Agentvm
    }

    /// Whether `arg`, one argument of a running process, is how this VMM was told to serve
    /// its API on `api` — so a pid that was reused by another program is not taken for it.
    pub fn names_api_socket(self, arg: &[u8], api: &Path) -> bool {
        let api = api.as_os_str().as_encoded_bytes();
        match self {
            Self::Agentvm => arg == api,
            Self::CloudHypervisor => arg.strip_prefix(b"path=").unwrap_or(arg) == api,
        }
    }

    /// Children of one snapshot share its memory pages until they write them.
    pub fn cow_fork(self) -> bool {
        self == Self::Agentvm
    }

    /// The test guest finds its vsock device on virtio-mmio, which Cloud Hypervisor (PCI
    /// only) does not offer.
    pub fn boots_mmio_guests(self) -> bool {
        self == Self::Agentvm
    }

    /// The `vm.restore` request that brings `snapshot` up as the VM of a new session whose
    /// sockets and serial log are `vsock` and `serial`; for Cloud Hypervisor, `scratch` (a
    /// directory that lives as long as the VM) first receives the rewritten copy to restore.
    pub fn restore_request(
        self,
        snapshot: &Path,
        scratch: &Path,
        vsock: &Path,
        serial: &Path,
    ) -> Result<RestoreConfig, String> {
        match self {
            Self::Agentvm => Ok(RestoreConfig {
                source_url: file_url(snapshot),
                memory_restore_mode: MemoryRestoreMode::OnDemand,
                resume: true,
                vsock_socket: Some(vsock.to_owned()),
                serial_file: Some(serial.to_owned()),
                ..Default::default()
            }),
            Self::CloudHypervisor => {
                prepare_clone_source(snapshot, scratch, vsock, serial)?;
                Ok(RestoreConfig {
                    source_url: file_url(scratch),
                    // `OnDemand` needs userfaultfd access and fails hard without it; a copy
                    // works everywhere Cloud Hypervisor does.
                    memory_restore_mode: MemoryRestoreMode::Copy,
                    resume: true,
                    ..Default::default()
                })
            }
        }
    }
}

impl std::str::FromStr for VmmFlavour {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "agentvm" => Ok(Self::Agentvm),
            "cloud-hypervisor" => Ok(Self::CloudHypervisor),
            other => Err(format!(
                "unknown VMM flavour {other:?} (agentvm or cloud-hypervisor)"
            )),
        }
    }
}

fn file_url(dir: &Path) -> String {
    format!("file://{}", dir.display())
}

/// Fills `target` with a restorable copy of the Cloud Hypervisor snapshot in `snapshot`:
/// every file hard-linked (copied across filesystems) except `config.json`, which is
/// rewritten so the clone binds its own vsock socket and writes its own serial log.
pub fn prepare_clone_source(
    snapshot: &Path,
    target: &Path,
    vsock: &Path,
    serial: &Path,
) -> Result<(), String> {
    let config_path = snapshot.join(CH_CONFIG_FILE);
    let text = std::fs::read(&config_path)
        .map_err(|e| format!("reading {}: {e}", config_path.display()))?;
    let mut config: serde_json::Value = serde_json::from_slice(&text)
        .map_err(|e| format!("{} is not JSON: {e}", config_path.display()))?;
    rewrite_paths(&mut config, vsock, serial)
        .map_err(|e| format!("{}: {e}", config_path.display()))?;

    std::fs::create_dir_all(target).map_err(|e| format!("creating {}: {e}", target.display()))?;
    let entries =
        std::fs::read_dir(snapshot).map_err(|e| format!("reading {}: {e}", snapshot.display()))?;
    for entry in entries {
        let entry = entry.map_err(|e| format!("reading {}: {e}", snapshot.display()))?;
        let name = entry.file_name();
        if name == CH_CONFIG_FILE || !entry.file_type().is_ok_and(|t| t.is_file()) {
            continue;
        }
        link_or_copy(&entry.path(), &target.join(&name))?;
    }
    let out = target.join(CH_CONFIG_FILE);
    let bytes = serde_json::to_vec(&config).map_err(|e| format!("encoding config: {e}"))?;
    std::fs::write(&out, bytes).map_err(|e| format!("writing {}: {e}", out.display()))
}

/// Points the config's vsock device at `vsock` and a file-backed serial port at `serial`.
fn rewrite_paths(
    config: &mut serde_json::Value,
    vsock: &Path,
    serial: &Path,
) -> Result<(), String> {
    let vsock_section = config
        .get_mut("vsock")
        .and_then(|v| v.as_object_mut())
        .ok_or("the snapshotted VM has no vsock device, so no harness channel")?;
    vsock_section.insert("socket".into(), path_value(vsock));
    if let Some(serial_section) = config.get_mut("serial").and_then(|v| v.as_object_mut())
        && serial_section.get("mode").and_then(|m| m.as_str()) == Some("File")
    {
        serial_section.insert("file".into(), path_value(serial));
    }
    Ok(())
}

fn path_value(path: &Path) -> serde_json::Value {
    serde_json::Value::String(path.display().to_string())
}

fn link_or_copy(from: &Path, to: &PathBuf) -> Result<(), String> {
    let _ = std::fs::remove_file(to);
    if std::fs::hard_link(from, to).is_ok() {
        return Ok(());
    }
    std::fs::copy(from, to)
        .map(drop)
        .map_err(|e| format!("copying {} to {}: {e}", from.display(), to.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// `RestoreConfig` as the Cloud Hypervisor spec lists it (vmm-api.md §3.8); a stock VMM
    /// knows nothing else.
    const CH_RESTORE_FIELDS: [&str; 5] = [
        "source_url",
        "prefault",
        "memory_restore_mode",
        "resume",
        "net_fds",
    ];

    fn ch_snapshot(dir: &Path) {
        std::fs::create_dir_all(dir).unwrap();
        let config = json!({
            "cpus": {"boot_vcpus": 1, "max_vcpus": 1},
            "memory": {"size": 268435456, "shared": false},
            "payload": {"kernel": "/images/guest", "cmdline": "console=ttyS0"},
            "serial": {"mode": "File", "file": "/parent/serial.log", "socket": null, "iommu": false},
            "console": {"mode": "Off", "iommu": false},
            "vsock": {"cid": 3, "socket": "/parent/vsock.sock", "iommu": false, "id": "_vsock0",
                      "pci_segment": 0},
            "rng": {"src": "/dev/urandom", "iommu": false},
        });
        std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
        std::fs::write(dir.join("state.json"), b"{\"state\": 1}").unwrap();
        std::fs::write(dir.join("memory-ranges"), vec![7u8; 8192]).unwrap();
    }

    #[test]
    fn a_cloud_hypervisor_restore_uses_only_fields_cloud_hypervisor_knows() {
        let tmp = tempfile::tempdir().unwrap();
        let snap = tmp.path().join("snap");
        ch_snapshot(&snap);
        let scratch = tmp.path().join("vm/restore");
        let request = VmmFlavour::CloudHypervisor
            .restore_request(
                &snap,
                &scratch,
                Path::new("/vm/vsock.sock"),
                Path::new("/vm/serial.log"),
            )
            .unwrap();
        let body = serde_json::to_value(&request).unwrap();
        for key in body.as_object().unwrap().keys() {
            assert!(
                CH_RESTORE_FIELDS.contains(&key.as_str()),
                "{key} is not a Cloud Hypervisor RestoreConfig field"
            );
        }
        assert_eq!(
            body["source_url"],
            json!(format!("file://{}", scratch.display()))
        );
        assert_eq!(body["resume"], json!(true));
        assert_eq!(body["memory_restore_mode"], json!("Copy"));
    }

    #[test]
    fn each_cloud_hypervisor_clone_gets_its_own_sockets_and_shares_the_big_files() {
        let tmp = tempfile::tempdir().unwrap();
        let snap = tmp.path().join("snap");
        ch_snapshot(&snap);
        let mut seen = Vec::new();
        for child in ["a", "b"] {
            let scratch = tmp.path().join(child).join("restore");
            let vsock = tmp.path().join(child).join("vsock.sock");
            let serial = tmp.path().join(child).join("serial.log");
            prepare_clone_source(&snap, &scratch, &vsock, &serial).unwrap();
            let config: serde_json::Value =
                serde_json::from_slice(&std::fs::read(scratch.join("config.json")).unwrap())
                    .unwrap();
            assert_eq!(
                config["vsock"]["socket"],
                json!(vsock.display().to_string())
            );
            assert_eq!(
                config["serial"]["file"],
                json!(serial.display().to_string())
            );
            // Everything else is the parent's, unknown sections included.
            assert_eq!(config["vsock"]["id"], json!("_vsock0"));
            assert_eq!(config["rng"]["src"], json!("/dev/urandom"));
            assert_eq!(config["memory"]["size"], json!(268435456));
            use std::os::unix::fs::MetadataExt;
            let memory = std::fs::metadata(scratch.join("memory-ranges")).unwrap();
            assert_eq!(
                memory.ino(),
                std::fs::metadata(snap.join("memory-ranges")).unwrap().ino()
            );
            assert!(scratch.join("state.json").is_file());
            seen.push(config["vsock"]["socket"].clone());
        }
        assert_ne!(seen[0], seen[1]);
        // The snapshot itself is untouched.
        let parent: serde_json::Value =
            serde_json::from_slice(&std::fs::read(snap.join("config.json")).unwrap()).unwrap();
        assert_eq!(parent["vsock"]["socket"], json!("/parent/vsock.sock"));
    }

    #[test]
    fn a_snapshot_without_vsock_or_config_is_refused_by_name() {
        let tmp = tempfile::tempdir().unwrap();
        let snap = tmp.path().join("snap");
        let err = prepare_clone_source(
            &snap,
            &tmp.path().join("x"),
            Path::new("/v"),
            Path::new("/s"),
        )
        .unwrap_err();
        assert!(err.contains("config.json"), "{err}");
        std::fs::create_dir_all(&snap).unwrap();
        std::fs::write(snap.join("config.json"), br#"{"cpus": {}}"#).unwrap();
        let err = prepare_clone_source(
            &snap,
            &tmp.path().join("x"),
            Path::new("/v"),
            Path::new("/s"),
        )
        .unwrap_err();
        assert!(err.contains("vsock"), "{err}");
        std::fs::write(snap.join("config.json"), b"not json").unwrap();
        let err = prepare_clone_source(
            &snap,
            &tmp.path().join("x"),
            Path::new("/v"),
            Path::new("/s"),
        )
        .unwrap_err();
        assert!(err.contains("not JSON"), "{err}");
    }

    #[test]
    fn agentvm_restores_in_place_with_its_extensions() {
        let request = VmmFlavour::Agentvm
            .restore_request(
                Path::new("/store/s1"),
                Path::new("/unused"),
                Path::new("/vm/vsock.sock"),
                Path::new("/vm/serial.log"),
            )
            .unwrap();
        assert_eq!(request.source_url, "file:///store/s1");
        assert_eq!(
            request.vsock_socket.as_deref(),
            Some(Path::new("/vm/vsock.sock"))
        );
        assert_eq!(
            request.serial_file.as_deref(),
            Some(Path::new("/vm/serial.log"))
        );
        assert_eq!(request.memory_restore_mode, MemoryRestoreMode::OnDemand);
        assert!(!Path::new("/unused").exists());
    }

    #[test]
    fn start_arguments_and_the_liveness_check_agree() {
        let api = Path::new("/run/vms/s1/api.sock");
        for flavour in [VmmFlavour::Agentvm, VmmFlavour::CloudHypervisor] {
            let fd = flavour.takes_api_listener().then_some(3);
            let args = flavour.args(api, Path::new("/dev/shm"), fd);
            assert_eq!(args[0], "--api-socket");
            assert!(
                args.iter()
                    .any(|a| flavour.names_api_socket(a.as_encoded_bytes(), api)),
                "{flavour:?}: {args:?}"
            );
            assert!(!flavour.names_api_socket(b"/run/vms/s2/api.sock", api));
        }
        assert_eq!(
            VmmFlavour::CloudHypervisor.args(api, Path::new("/dev/shm"), None),
            vec![
                OsString::from("--api-socket"),
                OsString::from("path=/run/vms/s1/api.sock")
            ]
        );
        let handed_down = VmmFlavour::Agentvm.args(api, Path::new("/dev/shm"), Some(3));
        assert_eq!(&handed_down[4..], ["--api-fd", "3"]);
        assert!(VmmFlavour::Agentvm.cow_fork());
        assert!(!VmmFlavour::CloudHypervisor.cow_fork());
        assert_eq!(
            "cloud-hypervisor".parse::<VmmFlavour>(),
            Ok(VmmFlavour::CloudHypervisor)
        );
        assert!("qemu".parse::<VmmFlavour>().unwrap_err().contains("qemu"));
    }
}
