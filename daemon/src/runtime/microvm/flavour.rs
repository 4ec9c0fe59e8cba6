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
//!   advice for clones) and the large files hard-linked, the kernel command line naming the
//!   new session. It reopens the payload (kernel, initramfs, firmware) and disks its
//!   `config.json` names, so a jailed restore is shown those too. Its memory is not shared
//!   between clones (the runtime reports `cow_fork = false`): filled lazily through
//!   userfaultfd where its VMMs may open one (`OnDemand`), else copied in before the VM runs.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use agentvm_vmm_api::types::{MemoryRestoreMode, RestoreConfig};

/// Where a Cloud Hypervisor snapshot keeps the VM's config; rewritten per clone.
const CH_CONFIG_FILE: &str = "config.json";
/// The kernel command-line parameter that tells the guest its session.
const SESSION_PARAM: &str = "agentvm.session=";

/// How a restored VM gets its memory back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RestoreMemory {
    /// The snapshot's memory file mapped copy-on-write (agentvm-vmm): shared between clones.
    MapPrivate,
    /// Filled lazily through userfaultfd (Cloud Hypervisor's `OnDemand`).
    OnDemand,
    /// Copied in whole before the VM runs (Cloud Hypervisor's `Copy`).
    Copy,
}

impl RestoreMemory {
    /// As the node status shows it.
    pub fn name(self) -> &'static str {
        match self {
            Self::MapPrivate => "map-private",
            Self::OnDemand => "on-demand",
            Self::Copy => "copy",
        }
    }
}

/// What a restored VM attaches from the host, as the daemon's own record of its image says.
/// Never as the snapshot's `config.json` says: whoever wrote the snapshot (its VMM, anyone
/// who can write the fleet's store) would choose which host files enter the VM's jail.
#[derive(Debug, Clone, Default)]
pub struct Attachments {
    pub kernel: Option<PathBuf>,
    pub initramfs: Option<PathBuf>,
    /// The image's read-only root filesystem, the only read-only disk a VM has.
    pub rootfs: Option<PathBuf>,
}

/// The new session a snapshot is restored as, and where its VM lives.
pub struct RestoreTarget<'a> {
    pub session: &'a str,
    /// For Cloud Hypervisor: a directory that lives as long as the VM, which first receives
    /// the rewritten copy to restore.
    pub scratch: &'a Path,
    pub vsock: &'a Path,
    pub serial: &'a Path,
    /// Where the restored VM's copy of its workspace disk goes (a snapshot with one).
    pub workspace: &'a Path,
    /// What the VM attaches from the host.
    pub attach: &'a Attachments,
}

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

    /// How this VMM brings a snapshot's memory back, on a host where its VMMs may open a
    /// userfaultfd or not: Cloud Hypervisor's `OnDemand` fails hard without one.
    pub fn restore_memory(self, userfaultfd: bool) -> RestoreMemory {
        match self {
            Self::Agentvm => RestoreMemory::MapPrivate,
            Self::CloudHypervisor if userfaultfd => RestoreMemory::OnDemand,
            Self::CloudHypervisor => RestoreMemory::Copy,
        }
    }

    /// Every host file restoring `snapshot` opens, for its VMM's jail: the snapshot and the
    /// bases under it, the image's root filesystem, and for Cloud Hypervisor (which reopens
    /// its payload) the image's kernel and initramfs. All from `attach`, none from the
    /// snapshot's own files.
    pub fn restore_files(self, snapshot: &Path, attach: &Attachments) -> Vec<PathBuf> {
        let mut files = agentvm_snapshot::store::LocalStore::chain(snapshot);
        // agentvm-vmm copies writable disks out of the snapshot; the read-only one is the
        // image's, opened where it is.
        files.extend(attach.rootfs.clone());
        if self == Self::CloudHypervisor {
            files.extend(attach.kernel.clone());
            files.extend(attach.initramfs.clone());
        }
        files
    }

    /// The `vm.restore` request that brings `snapshot` up as the VM of `target`, with its
    /// memory back as `memory` says.
    pub fn restore_request(
        self,
        snapshot: &Path,
        target: &RestoreTarget,
        memory: RestoreMemory,
    ) -> Result<RestoreConfig, String> {
        let memory_restore_mode = match memory {
            RestoreMemory::Copy => MemoryRestoreMode::Copy,
            RestoreMemory::MapPrivate | RestoreMemory::OnDemand => MemoryRestoreMode::OnDemand,
        };
        match self {
            Self::Agentvm => Ok(RestoreConfig {
                source_url: file_url(snapshot),
                memory_restore_mode,
                resume: true,
                vsock_socket: Some(target.vsock.to_owned()),
                serial_file: Some(target.serial.to_owned()),
                disk_paths: disk_paths(&read_config(snapshot)?, target)?,
                ..Default::default()
            }),
            Self::CloudHypervisor => {
                prepare_clone_source(snapshot, target)?;
                Ok(RestoreConfig {
                    source_url: file_url(target.scratch),
                    memory_restore_mode,
                    resume: true,
                    ..Default::default()
                })
            }
        }
    }
}

/// Where each disk of a restored VM is, in the order of the snapshot's config: the writable
/// one (the workspace) is the VM's own copy in its directory, the read-only one the image's
/// root filesystem (`target.attach`). What paths the config names is never used: it only
/// says how many disks of each kind the VM had, and more than its image gives is refused.
fn disk_paths(config: &serde_json::Value, target: &RestoreTarget) -> Result<Vec<PathBuf>, String> {
    let disks = config["disks"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    let writable = disks.iter().filter(|d| d["readonly"] != true).count();
    if writable > 1 {
        return Err(format!(
            "the snapshot's VM has {writable} writable disks; agentvmd gives a VM one (its workspace)"
        ));
    }
    let read_only = disks.len() - writable;
    match (read_only, &target.attach.rootfs) {
        (0, _) | (1, Some(_)) => {}
        (1, None) => {
            return Err(
                "the snapshot's VM has a read-only disk, and its image has no root filesystem \
                 to attach as one (a snapshot does not choose host files)"
                    .into(),
            );
        }
        (n, _) => {
            return Err(format!(
                "the snapshot's VM has {n} read-only disks; its image gives a VM one (its root \
                 filesystem)"
            ));
        }
    }
    Ok(disks
        .iter()
        .map(|disk| match disk["readonly"] == true {
            true => target.attach.rootfs.clone().unwrap_or_default(),
            false => target.workspace.to_owned(),
        })
        .collect())
}

fn read_config(snapshot: &Path) -> Result<serde_json::Value, String> {
    let path = snapshot.join(CH_CONFIG_FILE);
    let text = std::fs::read(&path).map_err(|e| format!("reading {}: {e}", path.display()))?;
    serde_json::from_slice(&text).map_err(|e| format!("{} is not JSON: {e}", path.display()))
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

/// Fills `target.scratch` with a restorable copy of the Cloud Hypervisor snapshot in
/// `snapshot`: every file hard-linked (copied across filesystems) except `config.json`,
/// which is rewritten so the clone binds its own vsock socket, writes its own serial log and
/// boots (should it ever reboot) as its own session.
pub fn prepare_clone_source(snapshot: &Path, target: &RestoreTarget) -> Result<(), String> {
    let mut config = read_config(snapshot)?;
    rewrite_for(&mut config, target)
        .map_err(|e| format!("{}: {e}", snapshot.join(CH_CONFIG_FILE).display()))?;
    // The scratch is in the VMM's directory: whatever it left there goes, and everything is
    // put in through a descriptor of the directory made here (a symlink the VMM swaps in
    // after is never followed).
    let scratch = target.scratch;
    match std::fs::symlink_metadata(scratch) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(scratch),
        Ok(_) => std::fs::remove_file(scratch),
        Err(_) => Ok(()),
    }
    .map_err(|e| format!("clearing {}: {e}", scratch.display()))?;
    if let Some(vmm_dir) = scratch.parent() {
        std::fs::create_dir_all(vmm_dir)
            .map_err(|e| format!("creating {}: {e}", vmm_dir.display()))?;
    }
    std::fs::create_dir(scratch).map_err(|e| format!("creating {}: {e}", scratch.display()))?;
    let held = rustix::fs::open(
        scratch,
        rustix::fs::OFlags::RDONLY
            | rustix::fs::OFlags::DIRECTORY
            | rustix::fs::OFlags::NOFOLLOW
            | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .map_err(|e| format!("opening {}: {e}", scratch.display()))?;
    let target = PathBuf::from(format!(
        "/proc/self/fd/{}",
        std::os::fd::AsRawFd::as_raw_fd(&held)
    ));
    let target = target.as_path();
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
    super::vmm_process::write_vmm_file(&out, &bytes)
}

/// Points the config's vsock device and a file-backed serial port at `target`'s, and its
/// kernel command line at `target`'s session; its payload and disks become what the daemon's
/// records say (`target.attach`), and every other device that names a host path goes.
fn rewrite_for(config: &mut serde_json::Value, target: &RestoreTarget) -> Result<(), String> {
    let disks = disk_paths(config, target)?;
    if let Some(list) = config.get_mut("disks").and_then(|d| d.as_array_mut()) {
        for (disk, path) in list.iter_mut().zip(disks) {
            disk["path"] = path_value(&path);
        }
    }
    if let Some(payload) = config.get_mut("payload").and_then(|p| p.as_object_mut()) {
        payload.remove("firmware");
        for (key, path) in [
            ("kernel", &target.attach.kernel),
            ("initramfs", &target.attach.initramfs),
        ] {
            match path {
                Some(path) => payload.insert(key.into(), path_value(path)),
                None => payload.remove(key),
            };
        }
    }
    if let Some(sections) = config.as_object_mut() {
        for section in ["fs", "pmem", "devices", "user_devices", "vdpa"] {
            sections.remove(section);
        }
    }
    if let Some(console) = config.get_mut("console").and_then(|c| c.as_object_mut())
        && console
            .get("mode")
            .and_then(|m| m.as_str())
            .is_some_and(|m| matches!(m, "File" | "Socket"))
    {
        console.insert("mode".into(), "Off".into());
        console.remove("file");
        console.remove("socket");
    }
    let vsock_section = config
        .get_mut("vsock")
        .and_then(|v| v.as_object_mut())
        .ok_or("the snapshotted VM has no vsock device, so no harness channel")?;
    vsock_section.insert("socket".into(), path_value(target.vsock));
    if let Some(serial_section) = config.get_mut("serial").and_then(|v| v.as_object_mut())
        && serial_section.get("mode").and_then(|m| m.as_str()) == Some("File")
    {
        serial_section.insert("file".into(), path_value(target.serial));
    }
    if let Some(cmdline) = config
        .get_mut("payload")
        .and_then(|p| p.get_mut("cmdline"))
        .and_then(|c| c.as_str().map(str::to_owned))
    {
        config["payload"]["cmdline"] =
            serde_json::Value::String(with_session(&cmdline, target.session));
    }
    Ok(())
}

/// `cmdline` with its session parameter (if any) naming `session`.
fn with_session(cmdline: &str, session: &str) -> String {
    cmdline
        .split(' ')
        .map(|word| match word.starts_with(SESSION_PARAM) {
            true => format!("{SESSION_PARAM}{session}"),
            false => word.to_owned(),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn path_value(path: &Path) -> serde_json::Value {
    serde_json::Value::String(path.display().to_string())
}

fn link_or_copy(from: &Path, to: &PathBuf) -> Result<(), String> {
    // Removed first: a symlink the VMM planted there goes, never what it points to.
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
            "payload": {"kernel": "/images/guest", "initramfs": "/images/initrd",
                        "cmdline": "console=ttyS0 agentvm.session=parent quiet"},
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
        let target = RestoreTarget {
            session: "child",
            scratch: &scratch,
            vsock: Path::new("/vm/vsock.sock"),
            serial: Path::new("/vm/serial.log"),
            workspace: Path::new("/vm/workspace.img"),
            attach: &image_files(),
        };
        let flavour = VmmFlavour::CloudHypervisor;
        for (userfaultfd, mode) in [(false, "Copy"), (true, "OnDemand")] {
            let memory = flavour.restore_memory(userfaultfd);
            let request = flavour.restore_request(&snap, &target, memory).unwrap();
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
            assert_eq!(body["memory_restore_mode"], json!(mode));
        }
        assert_eq!(flavour.restore_memory(true).name(), "on-demand");
        assert_eq!(flavour.restore_memory(false).name(), "copy");
        assert_eq!(
            VmmFlavour::Agentvm.restore_memory(false).name(),
            "map-private"
        );
    }

    /// What the daemon's record of the image says a VM attaches.
    fn image_files() -> Attachments {
        Attachments {
            kernel: Some("/images/guest".into()),
            initramfs: Some("/images/initrd".into()),
            rootfs: Some("/images/rootfs.erofs".into()),
        }
    }

    /// A snapshot whose config.json names host files (the node's journal, another session's
    /// disk, firmware): the jail is shown the snapshot and the image's files, none of those.
    #[test]
    fn a_restore_jail_is_shown_the_image_s_files_never_what_the_snapshot_names() {
        let tmp = tempfile::tempdir().unwrap();
        let snap = tmp.path().join("snap");
        ch_snapshot(&snap);
        let mut config: serde_json::Value =
            serde_json::from_slice(&std::fs::read(snap.join("config.json")).unwrap()).unwrap();
        config["payload"]["firmware"] = json!("/images/hypervisor-fw");
        config["payload"]["kernel"] = json!("/etc/shadow");
        config["disks"] = json!([
            {"path": "/var/lib/agentvm/journal.db", "readonly": true},
            {"path": "/var/lib/agentvm/vms/other/workspace.img"},
        ]);
        std::fs::write(snap.join("config.json"), config.to_string()).unwrap();
        let files = VmmFlavour::CloudHypervisor.restore_files(&snap, &image_files());
        assert_eq!(
            files,
            [
                snap.clone(),
                PathBuf::from("/images/rootfs.erofs"),
                PathBuf::from("/images/guest"),
                PathBuf::from("/images/initrd"),
            ]
        );
        // agentvm-vmm reads the snapshot chain and the image's root filesystem on restore
        // (it copies writable disks out of the snapshot).
        assert_eq!(
            VmmFlavour::Agentvm.restore_files(&snap, &image_files()),
            [snap.clone(), PathBuf::from("/images/rootfs.erofs")]
        );
        assert_eq!(
            VmmFlavour::Agentvm.restore_files(&snap, &Attachments::default()),
            std::slice::from_ref(&snap)
        );
        // What Cloud Hypervisor restores from names only the image's and the VM's own files.
        let scratch = tmp.path().join("vm/restore");
        let target = RestoreTarget {
            session: "child",
            scratch: &scratch,
            vsock: Path::new("/vm/vsock.sock"),
            serial: Path::new("/vm/serial.log"),
            workspace: Path::new("/vm/workspace.img"),
            attach: &image_files(),
        };
        prepare_clone_source(&snap, &target).unwrap();
        let rewritten = std::fs::read_to_string(scratch.join("config.json")).unwrap();
        for named in ["journal.db", "shadow", "hypervisor-fw", "vms/other"] {
            assert!(!rewritten.contains(named), "{named}: {rewritten}");
        }
        let rewritten: serde_json::Value = serde_json::from_str(&rewritten).unwrap();
        assert_eq!(rewritten["payload"]["kernel"], json!("/images/guest"));
        assert_eq!(
            rewritten["disks"],
            json!([
                {"path": "/images/rootfs.erofs", "readonly": true},
                {"path": "/vm/workspace.img"},
            ])
        );
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
            let target = RestoreTarget {
                session: child,
                scratch: &scratch,
                vsock: &vsock,
                serial: &serial,
                workspace: Path::new("/vm/workspace.img"),
                attach: &image_files(),
            };
            prepare_clone_source(&snap, &target).unwrap();
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
            assert_eq!(
                config["payload"]["cmdline"],
                json!(format!("console=ttyS0 agentvm.session={child} quiet"))
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
        let scratch = tmp.path().join("x");
        let target = RestoreTarget {
            session: "s",
            scratch: &scratch,
            vsock: Path::new("/v"),
            serial: Path::new("/s"),
            workspace: Path::new("/w"),
            attach: &Attachments::default(),
        };
        let snap = tmp.path().join("snap");
        let err = prepare_clone_source(&snap, &target).unwrap_err();
        assert!(err.contains("config.json"), "{err}");
        std::fs::create_dir_all(&snap).unwrap();
        std::fs::write(snap.join("config.json"), br#"{"cpus": {}}"#).unwrap();
        let err = prepare_clone_source(&snap, &target).unwrap_err();
        assert!(err.contains("vsock"), "{err}");
        std::fs::write(snap.join("config.json"), b"not json").unwrap();
        let err = prepare_clone_source(&snap, &target).unwrap_err();
        assert!(err.contains("not JSON"), "{err}");
    }

    #[test]
    fn agentvm_restores_in_place_with_its_extensions() {
        let tmp = tempfile::tempdir().unwrap();
        let snap = tmp.path().join("s1");
        std::fs::create_dir(&snap).unwrap();
        let config = |disks: serde_json::Value| {
            std::fs::write(
                snap.join("config.json"),
                json!({"payload": {"kernel": "/k"}, "disks": disks}).to_string(),
            )
            .unwrap();
        };
        // Whatever read-only path the snapshot names, the image's root filesystem is attached.
        config(json!([
            {"path": "/var/lib/agentvm/journal.db", "readonly": true},
            {"path": "/old-vm/workspace.img"}
        ]));
        let target = RestoreTarget {
            session: "s2",
            scratch: Path::new("/unused"),
            vsock: Path::new("/vm/vsock.sock"),
            serial: Path::new("/vm/serial.log"),
            workspace: Path::new("/vm/workspace.img"),
            attach: &image_files(),
        };
        let request = VmmFlavour::Agentvm
            .restore_request(&snap, &target, RestoreMemory::MapPrivate)
            .unwrap();
        assert_eq!(request.source_url, format!("file://{}", snap.display()));
        // The image stays where it is; the workspace is copied into the new VM's directory.
        assert_eq!(
            request.disk_paths,
            [
                PathBuf::from("/images/rootfs.erofs"),
                PathBuf::from("/vm/workspace.img")
            ]
        );
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
        config(json!([]));
        let request = VmmFlavour::Agentvm
            .restore_request(&snap, &target, RestoreMemory::MapPrivate)
            .unwrap();
        assert!(request.disk_paths.is_empty());
        config(json!([{"path": "/a"}, {"path": "/b"}]));
        let err = VmmFlavour::Agentvm
            .restore_request(&snap, &target, RestoreMemory::MapPrivate)
            .unwrap_err();
        assert!(err.contains("2 writable disks"), "{err}");
        // More read-only disks than the image has, or one where it has none: refused.
        config(json!([
            {"path": "/images/rootfs.erofs", "readonly": true},
            {"path": "/var/lib/agentvm/journal.db", "readonly": true}
        ]));
        let err = VmmFlavour::Agentvm
            .restore_request(&snap, &target, RestoreMemory::MapPrivate)
            .unwrap_err();
        assert!(err.contains("2 read-only disks"), "{err}");
        config(json!([{"path": "/var/lib/agentvm/journal.db", "readonly": true}]));
        let bare = RestoreTarget {
            attach: &Attachments::default(),
            ..target
        };
        let err = VmmFlavour::Agentvm
            .restore_request(&snap, &bare, RestoreMemory::MapPrivate)
            .unwrap_err();
        assert!(err.contains("no root filesystem"), "{err}");
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
