//! API actions mapped onto the VM: the Cloud Hypervisor state machine (`Created → Running ⇄
//! Paused → Shutdown`) with its status codes, implemented as the server's [`VmmBackend`].
//!
//! A VM can also stop on its own (guest reset, triple fault, vCPU failure). A watcher thread
//! per booted VM waits for that and moves the state to `Shutdown`, so `vm.info` tells the
//! truth without anyone polling.

use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use std::path::PathBuf;

use agentvm_vmm_api::config::{ConsoleOutputMode, VmConfig};
use agentvm_vmm_api::types::{
    DeviceNode, MemoryRestoreMode, RestoreConfig, VmEgressAllow, VmForkConfig, VmSnapshotConfig,
    dir_from_url,
};
use agentvm_vmm_api::{ApiError, VmCounters, VmInfo, VmState, VmmBackend, VmmPingResponse};

use crate::boot::layout;
use crate::devices::virtio::net::NetParams;
use crate::exit::{ExitReason, ExitSignal};
use crate::kvm::Flavour;
use crate::kvm::vm::{KvmVm, VmError};
use crate::vm::{
    DiskSpec, NetSpec, RamSpec, RestoreSpec, SaveKind, SerialSpec, Vm, VmSpec, VsockSpec,
};

enum Slot {
    Empty,
    Created(VmConfig),
    Running(VmConfig, Booted),
    Paused(VmConfig, Booted),
    Shutdown(VmConfig),
}

struct Booted {
    vm: Vm,
    generation: u64,
}

struct Inner {
    slot: Slot,
    generation: u64,
    last_exit: Option<ExitReason>,
    /// The KVM VM for the next boot, being created in the background so `vm.boot` does not
    /// wait for it.
    next_vm: Option<JoinHandle<Result<KvmVm, VmError>>>,
    /// The VM `vmm.shutdown` stopped: tearing a KVM VM down takes milliseconds (~14 ms on
    /// PVM hosts), so it is left to the process's exit, after the reply.
    retired: Option<crate::vm::Halted>,
}

impl Inner {
    fn prepare_next_vm(&mut self) {
        if self.next_vm.is_some() {
            return;
        }
        match std::thread::Builder::new()
            .name("vm-prepare".into())
            .spawn(KvmVm::new)
        {
            Ok(handle) => self.next_vm = Some(handle),
            // Booting will create the VM itself, just later.
            Err(e) => tracing::warn!(error = %e, "could not prepare a VM in the background"),
        }
    }

    fn take_prepared_vm(&mut self) -> Result<KvmVm, VmError> {
        match self.next_vm.take().map(JoinHandle::join) {
            Some(Ok(prepared)) => prepared,
            Some(Err(_)) | None => KvmVm::new(),
        }
    }
}

/// The VMM behind the API: at most one VM.
pub struct Vmm {
    inner: Arc<Mutex<Inner>>,
    /// Signalled whenever a VM stops, for callers that wait for the end (one-shot mode).
    stopped: Arc<Condvar>,
    flavour: Flavour,
    /// Where new VMs' RAM files live (a tmpfs), so forks can link them instead of copying.
    ram_dir: Mutex<Option<PathBuf>>,
    /// A VM was asked of this VMM (created or restored), whether or not that worked.
    asked_for_vm: std::sync::atomic::AtomicBool,
}

impl Default for Vmm {
    fn default() -> Self {
        Self::new()
    }
}

/// The configuration and the VM of a booted (running or paused) slot.
fn booted_mut(slot: &mut Slot) -> Result<(&mut VmConfig, &mut Booted), ApiError> {
    match slot {
        Slot::Running(config, booted) | Slot::Paused(config, booted) => Ok((config, booted)),
        _ => Err(ApiError::not_found(
            "no VM is booted (vm.boot or vm.restore first)",
        )),
    }
}

fn lock(inner: &Mutex<Inner>) -> MutexGuard<'_, Inner> {
    inner.lock().unwrap_or_else(|p| p.into_inner())
}

impl Vmm {
    pub fn new() -> Self {
        let mut inner = Inner {
            slot: Slot::Empty,
            generation: 0,
            last_exit: None,
            next_vm: None,
            retired: None,
        };
        inner.prepare_next_vm();
        Self {
            inner: Arc::new(Mutex::new(inner)),
            stopped: Arc::new(Condvar::new()),
            flavour: Flavour::detect(),
            ram_dir: Mutex::new(crate::kvm::memory::default_ram_dir()),
            asked_for_vm: Default::default(),
        }
    }

    /// Whether a VM was ever asked of this VMM (`vm.create`, `vm.restore`).
    pub fn asked_for_vm(&self) -> bool {
        self.asked_for_vm.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Puts new VMs' RAM files in `dir` (which should be a tmpfs), or in memfds with `None`.
    pub fn set_ram_dir(&self, dir: Option<PathBuf>) {
        *self.ram_dir.lock().unwrap_or_else(|p| p.into_inner()) = dir;
    }

    /// Snapshot or fork of the paused VM into the directory `url` names; `resume` runs it
    /// again as early as the save allows (see `Vm::save`).
    fn save(&self, url: &str, kind: SaveKind, what: &str, resume: bool) -> Result<(), ApiError> {
        let dir = dir_from_url("destination_url", url)
            .map_err(|e| ApiError::bad_request(e.to_string()))?;
        let mut inner = lock(&self.inner);
        let saved = match &mut inner.slot {
            Slot::Paused(config, booted) => {
                let config_json = serde_json::to_vec_pretty(config)
                    .map_err(|e| ApiError::internal(format!("encoding config.json: {e}")))?;
                booted
                    .vm
                    .save(&dir, kind, &config_json, resume)
                    .map(drop)
                    .map_err(|e| ApiError::from_error(500, &e))
            }
            Slot::Empty => return Err(no_vm()),
            other => {
                return Err(ApiError::internal(format!(
                    "cannot {what} a VM in state {}: pause it first",
                    state_name(other)
                )));
            }
        };
        if resume {
            // Running already if the save resumed it early; else it is resumed now (a
            // failed save too: the caller asked for a running VM either way).
            if let Slot::Paused(config, booted) = std::mem::replace(&mut inner.slot, Slot::Empty) {
                let resumed = booted.vm.running() || booted.vm.resume().is_ok();
                inner.slot = match resumed {
                    true => Slot::Running(config, booted),
                    false => Slot::Paused(config, booted),
                };
            }
        }
        saved
    }

    /// Blocks until no VM is running; returns why the last one stopped.
    pub fn wait_stopped(&self) -> Option<ExitReason> {
        let mut inner = lock(&self.inner);
        while matches!(inner.slot, Slot::Running(..) | Slot::Paused(..)) {
            inner = self.stopped.wait(inner).unwrap_or_else(|p| p.into_inner());
        }
        inner.last_exit.clone()
    }

    fn watch(&self, exit: Arc<ExitSignal>, generation: u64) {
        let inner = self.inner.clone();
        let stopped = self.stopped.clone();
        let spawned = std::thread::Builder::new()
            .name("vm-exit".into())
            .spawn(move || {
                if let Err(e) = exit.event().read() {
                    tracing::error!(error = %e, "waiting for the VM to exit");
                    return;
                }
                let mut guard = lock(&inner);
                let current = match &guard.slot {
                    Slot::Running(_, b) | Slot::Paused(_, b) => b.generation == generation,
                    _ => false,
                };
                if !current {
                    return;
                }
                let reason = exit.reason();
                let slot = std::mem::replace(&mut guard.slot, Slot::Empty);
                if let Slot::Running(config, booted) | Slot::Paused(config, booted) = slot {
                    booted.vm.stop();
                    guard.slot = Slot::Shutdown(config);
                }
                guard.last_exit = reason;
                guard.prepare_next_vm();
                stopped.notify_all();
            });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "starting the VM exit watcher");
        }
    }

    fn stop_booted(inner: &mut Inner, booted: Booted, reason: ExitReason) {
        booted.vm.exit_signal().request(reason.clone());
        booted.vm.stop();
        inner.last_exit = Some(reason);
        inner.prepare_next_vm();
    }
}

fn no_vm() -> ApiError {
    ApiError::not_found("no VM has been created (vm.create first)")
}

fn state_name(slot: &Slot) -> &'static str {
    match slot {
        Slot::Empty => "not created",
        Slot::Created(_) => "Created",
        Slot::Running(..) => "Running",
        Slot::Paused(..) => "Paused",
        Slot::Shutdown(_) => "Shutdown",
    }
}

fn wrong_state(action: &str, slot: &Slot) -> ApiError {
    ApiError::internal(format!(
        "cannot {action} a VM in state {}",
        state_name(slot)
    ))
}

/// The VM description a validated API config stands for.
pub fn spec_from_config(config: &VmConfig) -> Result<VmSpec, ApiError> {
    let kernel = config
        .payload
        .kernel
        .clone()
        .ok_or_else(|| ApiError::bad_request("payload.kernel: required"))?;
    let serial = match config.serial.mode {
        ConsoleOutputMode::Off => SerialSpec::Off,
        ConsoleOutputMode::Null => SerialSpec::Null,
        ConsoleOutputMode::Tty => SerialSpec::Stdout,
        ConsoleOutputMode::File => SerialSpec::File(
            config
                .serial
                .file
                .clone()
                .ok_or_else(|| ApiError::bad_request("serial.file: required in File mode"))?,
        ),
        other => {
            return Err(ApiError::bad_request(format!(
                "serial.mode: {other:?} is not supported"
            )));
        }
    };
    Ok(VmSpec {
        vcpus: config.cpus.boot_vcpus,
        memory_bytes: config.memory.size,
        ram: RamSpec {
            prefault: config.memory.prefault,
            mergeable: config.memory.mergeable,
        },
        kernel,
        initramfs: config.payload.initramfs.clone(),
        cmdline: config.payload.cmdline.clone().unwrap_or_default(),
        serial,
        vsock: config.vsock.as_ref().map(|v| VsockSpec {
            cid: v.cid,
            socket: v.socket.clone(),
        }),
        disks: config
            .disks
            .iter()
            .enumerate()
            .map(|(i, d)| DiskSpec {
                path: d.path.clone(),
                read_only: d.readonly,
                serial: d
                    .serial
                    .clone()
                    .unwrap_or_else(|| disk_id(d.id.as_deref(), i)),
            })
            .collect(),
        nets: config
            .net
            .iter()
            .enumerate()
            .map(|(i, net)| net_spec(i, net))
            .collect::<Result<_, _>>()?,
        ram_dir: None,
    })
}

/// What the VMM builds network device `index` from; the config was validated, so a failure
/// here is still answered as the 400 it would have been.
fn net_spec(index: usize, net: &agentvm_vmm_api::config::NetConfig) -> Result<NetSpec, ApiError> {
    let at = format!("net[{index}]");
    let bad = |e: agentvm_vmm_api::ConfigError| ApiError::bad_request(e.within(&at).to_string());
    Ok(NetSpec {
        id: net.device_id(index),
        tap: net.tap.clone(),
        params: NetParams {
            mac: net.mac_bytes().map_err(bad)?,
            mtu: net.mtu(),
            rate_limiter: net.rate_limiter_config.clone(),
            egress: net
                .egress
                .as_ref()
                .map(|p| p.parse().map_err(|e| bad(e.within("egress"))))
                .transpose()?,
        },
    })
}

fn device_tree(config: &VmConfig) -> BTreeMap<String, DeviceNode> {
    let mut tree = BTreeMap::new();
    let node = |id: &str, resources: Vec<serde_json::Value>| DeviceNode {
        id: id.to_owned(),
        resources,
        children: Vec::new(),
        pci_bdf: None,
    };
    if config.serial.mode != ConsoleOutputMode::Off {
        tree.insert(
            "_serial".to_owned(),
            node(
                "_serial",
                vec![
                    serde_json::json!({"PioAddressRange": {"base": layout::SERIAL_PORT_BASE, "size": layout::SERIAL_PORT_LEN}}),
                    serde_json::json!({"LegacyIrq": layout::SERIAL_IRQ}),
                ],
            ),
        );
    }
    let mut virtio = |id: String, window: u32| {
        let (base, size) = layout::virtio_mmio_window(window);
        let resources = vec![
            serde_json::json!({"MmioAddressRange": {"base": base, "size": size}}),
            serde_json::json!({"LegacyIrq": layout::VIRTIO_IRQ_BASE + window}),
        ];
        tree.insert(id.clone(), node(&id, resources));
    };
    if let Some(vsock) = &config.vsock {
        virtio(vsock.id.clone().unwrap_or_else(|| "_vsock0".to_owned()), 0);
    }
    for (i, disk) in config.disks.iter().enumerate() {
        virtio(disk_id(disk.id.as_deref(), i), crate::vm::disk_window(i));
    }
    for (i, net) in config.net.iter().enumerate() {
        virtio(net.device_id(i), crate::vm::net_window(i));
    }
    tree
}

/// A disk's device id: its own, else `_diskN` (Cloud Hypervisor's naming).
fn disk_id(id: Option<&str>, index: usize) -> String {
    id.map_or_else(|| format!("_disk{index}"), str::to_owned)
}

impl VmmBackend for Vmm {
    fn ping(&self) -> VmmPingResponse {
        VmmPingResponse {
            version: env!("CARGO_PKG_VERSION").to_owned(),
            build_version: Some(format!("agentvm-vmm {}", env!("CARGO_PKG_VERSION"))),
            pid: i64::from(std::process::id()),
            features: vec![
                "kvm".to_owned(),
                format!("kvm_{}", self.flavour.name().to_lowercase()),
                "hybrid_vsock".to_owned(),
                "pvh".to_owned(),
                "virtio_net".to_owned(),
            ],
        }
    }

    fn create(&self, config: VmConfig) -> Result<(), ApiError> {
        self.asked_for_vm
            .store(true, std::sync::atomic::Ordering::SeqCst);
        spec_from_config(&config)?;
        let mut inner = lock(&self.inner);
        match inner.slot {
            Slot::Empty => {
                inner.slot = Slot::Created(config);
                Ok(())
            }
            _ => Err(ApiError::internal(
                "a VM is already created (VmAlreadyCreated); vm.delete it first",
            )),
        }
    }

    fn boot(&self) -> Result<(), ApiError> {
        let mut inner = lock(&self.inner);
        let config = match &inner.slot {
            Slot::Empty => return Err(no_vm()),
            Slot::Created(config) | Slot::Shutdown(config) => config.clone(),
            other => return Err(wrong_state("boot", other)),
        };
        let mut spec = spec_from_config(&config)?;
        spec.ram_dir = self
            .ram_dir
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let booted = Vm::boot(&spec, || inner.take_prepared_vm());
        if booted.is_err() {
            inner.prepare_next_vm();
        }
        let vm = booted.map_err(|e| ApiError::from_error(500, &e))?;
        inner.generation += 1;
        let generation = inner.generation;
        let exit = vm.exit_signal().clone();
        inner.slot = Slot::Running(config, Booted { vm, generation });
        inner.last_exit = None;
        drop(inner);
        self.watch(exit, generation);
        Ok(())
    }

    fn info(&self) -> Result<VmInfo, ApiError> {
        let inner = lock(&self.inner);
        let (config, state, booted) = match &inner.slot {
            Slot::Empty => return Err(no_vm()),
            Slot::Created(c) => (c, VmState::Created, None),
            Slot::Running(c, b) => (c, VmState::Running, Some(b)),
            Slot::Paused(c, b) => (c, VmState::Paused, Some(b)),
            Slot::Shutdown(c) => (c, VmState::Shutdown, None),
        };
        Ok(VmInfo {
            config: config.clone(),
            state,
            memory_actual_size: booted.map(|b| b.vm.memory_size()),
            device_tree: booted.map(|_| device_tree(config)),
        })
    }

    fn pause(&self) -> Result<(), ApiError> {
        let mut inner = lock(&self.inner);
        match std::mem::replace(&mut inner.slot, Slot::Empty) {
            Slot::Running(config, booted) => match booted.vm.pause() {
                Ok(()) => {
                    inner.slot = Slot::Paused(config, booted);
                    Ok(())
                }
                Err(e) => {
                    inner.slot = Slot::Running(config, booted);
                    Err(ApiError::from_error(500, &e))
                }
            },
            Slot::Empty => Err(no_vm()),
            other => {
                let err = wrong_state("pause", &other);
                inner.slot = other;
                Err(err)
            }
        }
    }

    fn resume(&self) -> Result<(), ApiError> {
        let mut inner = lock(&self.inner);
        match std::mem::replace(&mut inner.slot, Slot::Empty) {
            Slot::Paused(config, booted) => match booted.vm.resume() {
                Ok(()) => {
                    inner.slot = Slot::Running(config, booted);
                    Ok(())
                }
                Err(e) => {
                    inner.slot = Slot::Paused(config, booted);
                    Err(ApiError::from_error(500, &e))
                }
            },
            Slot::Empty => Err(no_vm()),
            other => {
                let err = wrong_state("resume", &other);
                inner.slot = other;
                Err(err)
            }
        }
    }

    fn shutdown(&self) -> Result<(), ApiError> {
        let mut inner = lock(&self.inner);
        match std::mem::replace(&mut inner.slot, Slot::Empty) {
            Slot::Running(config, booted) | Slot::Paused(config, booted) => {
                Self::stop_booted(&mut inner, booted, ExitReason::Requested);
                inner.slot = Slot::Shutdown(config);
                self.stopped.notify_all();
                Ok(())
            }
            Slot::Empty => Err(no_vm()),
            other => {
                let err = wrong_state("shut down", &other);
                inner.slot = other;
                Err(err)
            }
        }
    }

    fn delete(&self) -> Result<(), ApiError> {
        let mut inner = lock(&self.inner);
        if let Slot::Running(_, booted) | Slot::Paused(_, booted) =
            std::mem::replace(&mut inner.slot, Slot::Empty)
        {
            Self::stop_booted(&mut inner, booted, ExitReason::Requested);
            self.stopped.notify_all();
        }
        Ok(())
    }

    fn counters(&self) -> Result<VmCounters, ApiError> {
        let inner = lock(&self.inner);
        match &inner.slot {
            Slot::Running(_, b) | Slot::Paused(_, b) => Ok(b.vm.counters()),
            Slot::Empty => Err(no_vm()),
            other => Err(wrong_state("read the counters of", other)),
        }
    }

    fn snapshot(&self, config: VmSnapshotConfig) -> Result<(), ApiError> {
        self.save(
            &config.destination_url,
            SaveKind::Snapshot,
            "snapshot",
            false,
        )
    }

    fn fork(&self, config: VmForkConfig) -> Result<(), ApiError> {
        self.save(
            &config.destination_url,
            SaveKind::Fork,
            "fork",
            config.resume,
        )
    }

    fn checkpoint(
        &self,
        config: agentvm_vmm_api::types::VmCheckpointConfig,
    ) -> Result<agentvm_vmm_api::types::VmCheckpointReport, ApiError> {
        let dir = dir_from_url("destination_url", &config.destination_url)
            .map_err(|e| ApiError::bad_request(e.to_string()))?;
        let base = config
            .base_url
            .as_deref()
            .map(|url| dir_from_url("base_url", url))
            .transpose()
            .map_err(|e| ApiError::bad_request(e.to_string()))?;
        let fresh = config.fresh;
        let mut inner = lock(&self.inner);
        match &mut inner.slot {
            Slot::Running(config, booted) => {
                let config_json = serde_json::to_vec_pretty(config)
                    .map_err(|e| ApiError::internal(format!("encoding config.json: {e}")))?;
                booted
                    .vm
                    .checkpoint(&dir, base.as_deref(), fresh, &config_json)
                    .map_err(|e| ApiError::from_error(500, &e))
            }
            Slot::Empty => Err(no_vm()),
            other => Err(ApiError::internal(format!(
                "cannot checkpoint a VM in state {}: a checkpoint is of a running VM",
                state_name(other)
            ))),
        }
    }

    fn checkpoint_wait(
        &self,
        request: agentvm_vmm_api::types::VmCheckpointWait,
    ) -> Result<agentvm_vmm_api::types::VmCheckpointReport, ApiError> {
        let dir = request
            .destination_url
            .as_deref()
            .map(|url| dir_from_url("destination_url", url))
            .transpose()
            .map_err(|e| ApiError::bad_request(e.to_string()))?;
        // Found under the lock, waited for without it: the VM's other calls (the next
        // checkpoint among them) go on meanwhile.
        let waiter = {
            let inner = lock(&self.inner);
            match &inner.slot {
                Slot::Running(_, booted) | Slot::Paused(_, booted) => {
                    booted.vm.checkpoint_waiter(dir.as_deref())
                }
                _ => return Err(no_vm()),
            }
        };
        match waiter {
            Some(waiter) => waiter.wait().map_err(|e| ApiError::from_error(500, &e)),
            None => Err(ApiError::not_found(match dir {
                Some(dir) => format!("no checkpoint was taken into {}", dir.display()),
                None => "no checkpoint was taken".into(),
            })),
        }
    }

    fn restore(&self, request: RestoreConfig) -> Result<(), ApiError> {
        self.asked_for_vm
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let dir = dir_from_url("source_url", &request.source_url)
            .map_err(|e| ApiError::bad_request(e.to_string()))?;
        let mut inner = lock(&self.inner);
        if !matches!(inner.slot, Slot::Empty) {
            return Err(ApiError::internal(
                "a VM already exists in this VMM (VmAlreadyCreated); restore into a fresh one or vm.delete first",
            ));
        }
        let mut restored_config = None;
        // A request naming a device the snapshot's VM lacks is the caller's mistake (400),
        // though only the snapshot can tell.
        let mut bad_request = None;
        let prefault = request.prefault || request.memory_restore_mode == MemoryRestoreMode::Copy;
        let spec = RestoreSpec::open(
            &dir,
            self.flavour,
            |bytes| {
                let mut config = VmConfig::from_json(bytes).map_err(|e| e.to_string())?;
                match (&request.vsock_socket, &mut config.vsock) {
                    (Some(socket), Some(vsock)) => vsock.socket = socket.clone(),
                    (Some(_), None) => {
                        return Err("vsock_socket: the snapshot's VM has no vsock device".into());
                    }
                    _ => {}
                }
                if let Some(file) = &request.serial_file {
                    if config.serial.mode == ConsoleOutputMode::Off {
                        return Err("serial_file: the snapshot's VM has no serial port".into());
                    }
                    config.serial.mode = ConsoleOutputMode::File;
                    config.serial.file = Some(file.clone());
                }
                if !request.disk_paths.is_empty() {
                    if request.disk_paths.len() != config.disks.len() {
                        return Err(format!(
                            "disk_paths: {} given, the snapshot's VM has {} disks",
                            request.disk_paths.len(),
                            config.disks.len()
                        ));
                    }
                    for (disk, path) in config.disks.iter_mut().zip(&request.disk_paths) {
                        disk.path = path.clone();
                    }
                    config.validate().map_err(|e| e.to_string())?;
                }
                if !request.net_overrides.is_empty() {
                    if let Err(e) = apply_net_overrides(&request, &mut config) {
                        bad_request = Some(e.clone());
                        return Err(e);
                    }
                    config.validate().map_err(|e| e.to_string())?;
                }
                let spec = spec_from_config(&config).map_err(|e| e.to_string())?;
                restored_config = Some(config);
                Ok(spec)
            },
            prefault,
        )
        .map_err(|e| match bad_request.take() {
            Some(message) => ApiError::bad_request(message),
            None => ApiError::from_error(500, &e).context("the snapshot cannot be restored"),
        })?;
        let config = restored_config.ok_or_else(|| ApiError::internal("no config was read"))?;
        let restored = Vm::restore(spec, || inner.take_prepared_vm(), request.resume);
        if restored.is_err() {
            inner.prepare_next_vm();
        }
        let vm = restored.map_err(|e| ApiError::from_error(500, &e))?;
        inner.generation += 1;
        let generation = inner.generation;
        let exit = vm.exit_signal().clone();
        let booted = Booted { vm, generation };
        inner.slot = if request.resume {
            Slot::Running(config, booted)
        } else {
            Slot::Paused(config, booted)
        };
        inner.last_exit = None;
        drop(inner);
        self.watch(exit, generation);
        Ok(())
    }

    fn set_ram_dir(&self, request: agentvm_vmm_api::types::VmmRamDir) -> Result<(), ApiError> {
        if let Some(path) = &request.path
            && !path.is_dir()
        {
            return Err(ApiError::bad_request(format!(
                "path: {} is not a directory this VMM can see",
                path.display()
            )));
        }
        *self.ram_dir.lock().unwrap_or_else(|p| p.into_inner()) = request.path;
        Ok(())
    }

    fn egress_allow(&self, request: VmEgressAllow) -> Result<(), ApiError> {
        let parsed = request
            .parse()
            .map_err(|e| ApiError::bad_request(e.to_string()))?;
        let mut inner = lock(&self.inner);
        let (config, booted) = booted_mut(&mut inner.slot)?;
        let index = net_index(config, request.id.as_deref())?;
        let id = config.net[index].device_id(index);
        let policy = egress_policy(config, index)?;
        // Rules it holds already are not added again (a resolver re-allows the addresses
        // of every answer), so repeats never use up the policy's room.
        let mut held = agentvm_vmm_api::config::parse_rules(&policy.allow)
            .map_err(|e| ApiError::internal(format!("the policy in force: {e}")))?;
        let mut added = Vec::new();
        for (rule, parsed) in request.rules.iter().zip(parsed) {
            if !held.contains(&parsed) {
                held.push(parsed);
                added.push((rule.clone(), parsed));
            }
        }
        if held.len() > agentvm_vmm_api::config::MAX_EGRESS_RULES {
            return Err(ApiError::bad_request(format!(
                "rules: network device {id:?} would hold {} rules, at most {} are allowed",
                held.len(),
                agentvm_vmm_api::config::MAX_EGRESS_RULES
            )));
        }
        let new: Vec<_> = added.iter().map(|(_, parsed)| *parsed).collect();
        booted
            .vm
            .egress_allow(index, &new)
            .map_err(|e| ApiError::from_error(500, &e))?;
        // vm.info shows the policy in force, and a snapshot carries it.
        policy.allow.extend(added.into_iter().map(|(rule, _)| rule));
        tracing::debug!(device = %id, added = new.len(), "egress rules added");
        Ok(())
    }

    fn egress_revoke(&self, request: VmEgressAllow) -> Result<(), ApiError> {
        let parsed = request
            .parse()
            .map_err(|e| ApiError::bad_request(e.to_string()))?;
        let mut inner = lock(&self.inner);
        let (config, booted) = booted_mut(&mut inner.slot)?;
        let index = net_index(config, request.id.as_deref())?;
        let id = config.net[index].device_id(index);
        let policy = egress_policy(config, index)?;
        let held = agentvm_vmm_api::config::parse_rules(&policy.allow)
            .map_err(|e| ApiError::internal(format!("the policy in force: {e}")))?;
        let kept: Vec<usize> = (0..held.len())
            .filter(|&i| !parsed.contains(&held[i]))
            .collect();
        let removed: Vec<_> = held
            .iter()
            .filter(|r| parsed.contains(r))
            .copied()
            .collect();
        booted
            .vm
            .egress_revoke(index, &removed)
            .map_err(|e| ApiError::from_error(500, &e))?;
        // vm.info shows the policy in force, and a snapshot carries it.
        policy.allow = kept.into_iter().map(|i| policy.allow[i].clone()).collect();
        tracing::debug!(device = %id, removed = removed.len(), "egress rules revoked");
        Ok(())
    }

    fn shutdown_vmm(&self) -> Result<(), ApiError> {
        let mut inner = lock(&self.inner);
        if let Slot::Running(_, booted) | Slot::Paused(_, booted) =
            std::mem::replace(&mut inner.slot, Slot::Empty)
        {
            booted.vm.exit_signal().request(ExitReason::Requested);
            inner.retired = Some(booted.vm.halt());
            inner.last_exit = Some(ExitReason::Requested);
            self.stopped.notify_all();
        }
        Ok(())
    }
}

/// Applies `request.net_overrides` to the snapshot's `config`; an id it does not have is an
/// error naming the entry.
fn apply_net_overrides(request: &RestoreConfig, config: &mut VmConfig) -> Result<(), String> {
    for (i, entry) in request.net_overrides.iter().enumerate() {
        let index = (0..config.net.len())
            .find(|&j| config.net[j].device_id(j) == entry.id)
            .ok_or_else(|| {
                format!(
                    "net_overrides[{i}].id: the snapshot's VM has no network device {:?}",
                    entry.id
                )
            })?;
        entry.apply(&mut config.net[index]);
    }
    Ok(())
}

/// The index of the VM's network device `id` (its first when `None`).
fn net_index(config: &VmConfig, id: Option<&str>) -> Result<usize, ApiError> {
    match id {
        None if !config.net.is_empty() => Ok(0),
        None => Err(ApiError::not_found("the VM has no network device")),
        Some(id) => (0..config.net.len())
            .find(|&i| config.net[i].device_id(i) == id)
            .ok_or_else(|| ApiError::not_found(format!("id: the VM has no network device {id:?}"))),
    }
}

/// The egress policy of network device `index` (400 for a device without one).
fn egress_policy(
    config: &mut VmConfig,
    index: usize,
) -> Result<&mut agentvm_vmm_api::config::EgressPolicy, ApiError> {
    let id = config.net[index].device_id(index);
    config.net[index].egress.as_mut().ok_or_else(|| {
        ApiError::bad_request(format!(
            "network device {id:?} has no egress policy: all traffic crosses it already"
        ))
    })
}
