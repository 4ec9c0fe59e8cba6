//! Snapshots of a paused VM and VMs restored from them.
//!
//! Saving resets every vsock stream first (the guest hears TRANSPORT_RESET from its event
//! queue, so the VM that resumes and every VM restored later agree that no stream
//! survived), then writes `state.json`, `config.json`, the memory file and, last, the
//! manifest. Memory is written one of three ways:
//! - a VM running on its own RAM file: the non-zero pages are copied (`vm.snapshot`), or the
//!   file itself becomes the snapshot's memory and the VM continues copy-on-write over it
//!   (`vm.fork`: nothing copied);
//! - a VM running copy-on-write over a snapshot: only the pages it changed since, as a layer
//!   on that snapshot.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use agentvm_snapshot::dir::SnapshotWriter;
use agentvm_snapshot::manifest::{
    CONFIG_FILE, DigestKind, HostIdentity, MEMORY_FILE, MemoryLayout, STATE_FILE,
};
use agentvm_snapshot::state::{Raw, VirtioMmioState, VmState};

/// The snapshot's copy of writable disk `index`.
pub fn disk_file(index: usize) -> String {
    format!("disk-{index}")
}
use agentvm_snapshot::{Snapshot, SnapshotError};
use kvm_ioctls::VcpuFd;

use super::{
    BuildError, Parts, RamSpec, SerialStats, Vm, VmError, VmSpec, create_disk, create_net,
    create_vsock, serial_device,
};
use crate::devices::virtio::block::DiskCopy;
use crate::devices::virtio::vsock;
use crate::kvm::Flavour;
use crate::kvm::memory::{Backing, GuestRam, MemoryError, RamOptions};
use crate::kvm::state::{self as kvm_state, StateError, VmKvmState};
use crate::kvm::vm::KvmVm;

#[derive(Debug, thiserror::Error)]
pub enum PersistError {
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    #[error(transparent)]
    Kvm(#[from] StateError),
    #[error(transparent)]
    Memory(#[from] MemoryError),
    #[error("snapshot state does not fit this VM: {0}")]
    Mismatch(String),
    #[error("copying disk {path} into the snapshot: {source}")]
    DiskCopy {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// A snapshot of a VM whose chain of snapshots is this deep is written whole instead of as
/// another layer.
pub const FLATTEN_AT: usize = 8;

/// Whether a new snapshot over `chain` (top first, its flattened base last) is written as
/// another layer. A layer stores only what the VM changed, which saves time and space while
/// the chain is short and its layers together take less than half its base. Past that (a
/// guest that rewrites most of its memory between snapshots) a whole copy is smaller than
/// what the chain would keep, and a restore reads one file: so a session's snapshots take
/// at most about twice one whole copy, however often it suspends.
fn worth_a_layer(chain: &[Snapshot]) -> bool {
    use std::os::unix::fs::MetadataExt;
    let Some((base, layers)) = chain.split_last() else {
        return false;
    };
    let on_disk = |s: &Snapshot| {
        std::fs::metadata(s.path(MEMORY_FILE)).map_or(u64::MAX, |m| m.blocks() * 512)
    };
    let layers = layers
        .iter()
        .map(on_disk)
        .fold(0u64, |sum, n| sum.saturating_add(n));
    chain.len() < FLATTEN_AT && layers.saturating_mul(2) < on_disk(base)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SaveKind {
    /// `vm.snapshot`: a self-contained copy (or a layer on the snapshot the VM runs from).
    Snapshot,
    /// `vm.fork`: the VM's memory becomes a shared, immutable base.
    Fork,
}

/// What a save did, for logs and benchmarks.
#[derive(Debug, Clone)]
pub struct SaveReport {
    pub memory_pages: u64,
    /// Memory was linked into the snapshot, not copied.
    pub zero_copy: bool,
    pub layered: bool,
    pub elapsed: Duration,
}

/// A snapshot opened, checked and decoded, ready to become a VM.
pub struct RestoreSpec {
    pub spec: VmSpec,
    pub state: VmState,
    /// Each writable disk's layers in the snapshot chain (index, files base first: the
    /// nearest whole copy, then the layers above it). The restored VM's disk is a new, empty
    /// file at the disk's path in `spec` over them.
    pub disk_layers: Vec<(usize, Vec<PathBuf>)>,
    /// The network devices' transports, one per entry of `spec.nets`.
    pub nets: Vec<VirtioMmioState>,
    /// Memory files, base first.
    pub chain: Vec<PathBuf>,
    /// The snapshot the VM will run on (the top of the chain).
    pub top: PathBuf,
    pub prefault: bool,
}

impl RestoreSpec {
    /// Opens `dir`: manifest, host identity, digests of it and every base under it, state.
    /// The caller supplies the VM spec (from the snapshot's `config.json`, with overrides).
    pub fn open(
        dir: &Path,
        flavour: Flavour,
        spec: impl FnOnce(&[u8]) -> Result<VmSpec, String>,
        prefault: bool,
    ) -> Result<Self, PersistError> {
        let snapshot = Snapshot::open(dir)?;
        snapshot.check_host(&HostIdentity::current(flavour.name()))?;
        let chain = snapshot.chain()?;
        let spec = spec(&snapshot.read(CONFIG_FILE)?)
            .map_err(|e| PersistError::Mismatch(format!("config.json: {e}")))?;
        if spec.memory_bytes != snapshot.manifest.memory.size {
            return Err(PersistError::Mismatch(format!(
                "config.json asks for {} bytes of RAM, the memory is {}",
                spec.memory_bytes, snapshot.manifest.memory.size
            )));
        }
        let mut state = VmState::from_json(&snapshot.read(STATE_FILE)?)?;
        if state.vcpus.len() != usize::from(spec.vcpus) {
            return Err(PersistError::Mismatch(format!(
                "{} vCPUs saved, config.json has {}",
                state.vcpus.len(),
                spec.vcpus
            )));
        }
        if state.vsock.is_some() != spec.vsock.is_some() {
            return Err(PersistError::Mismatch(
                "vsock device in state.json and config.json disagree".into(),
            ));
        }
        if state.disks.len() != spec.disks.len() {
            return Err(PersistError::Mismatch(format!(
                "{} disks saved, config.json has {}",
                state.disks.len(),
                spec.disks.len()
            )));
        }
        let mut disk_layers = Vec::new();
        for (index, disk) in spec.disks.iter().enumerate() {
            let name = disk_file(index);
            let saved = snapshot.manifest.files.contains_key(&name);
            if saved == disk.read_only {
                return Err(PersistError::Mismatch(format!(
                    "disk {index} is {} but the snapshot {} a copy of it",
                    if disk.read_only {
                        "read-only"
                    } else {
                        "writable"
                    },
                    if saved { "holds" } else { "lacks" }
                )));
            }
            if saved {
                disk_layers.push((
                    index,
                    agentvm_snapshot::disk::chain_files(&chain, &name)
                        .map_err(PersistError::Mismatch)?,
                ));
            }
        }
        let nets = std::mem::take(&mut state.nets);
        if nets.len() != spec.nets.len() {
            return Err(PersistError::Mismatch(format!(
                "{} network devices saved, config.json has {}",
                nets.len(),
                spec.nets.len()
            )));
        }
        Ok(Self {
            spec,
            state,
            disk_layers,
            nets,
            chain: chain.iter().map(|s| s.path(MEMORY_FILE)).collect(),
            top: snapshot.dir,
            prefault,
        })
    }
}

impl Vm {
    /// Writes a snapshot of this (paused) VM into `dir` (existing, without a snapshot). With
    /// `resume_when_frozen`, a fork whose RAM is linked resumes the VM as soon as the RAM is
    /// frozen, before its digest is taken: the VM is paused for the link, not the hashing.
    pub fn save(
        &mut self,
        dir: &Path,
        kind: SaveKind,
        config_json: &[u8],
        resume_when_frozen: bool,
    ) -> Result<SaveReport, PersistError> {
        let started = Instant::now();
        if let Some(Err(e)) = self.settle_checkpoints() {
            tracing::warn!(error = %e, "the last checkpoint was not written");
        }
        let mut writer = SnapshotWriter::create(dir, kind == SaveKind::Snapshot)?;
        self.reset_vsock_streams();
        let state = self.save_state()?;
        writer.write_file(STATE_FILE, &state.to_json()?)?;
        writer.write_file(CONFIG_FILE, config_json)?;
        // Before the memory: a fork resumes the VM once its RAM is frozen, and the disks must
        // be captured at the same instant as the memory that knows what it wrote to them. A
        // layered snapshot stores its disks as layers too, on the same chain.
        // The snapshot the VM runs on and its chain, when it runs on one: a new snapshot is
        // a layer over it unless the chain is long enough to flatten.
        let under = match self.ram.backing() {
            Backing::Private { top } => {
                let top = Snapshot::open(top)?;
                let chain = top.chain()?;
                Some((top, chain))
            }
            Backing::Own => None,
        };
        let layered = under
            .as_ref()
            .is_some_and(|(_, chain)| worth_a_layer(chain));
        self.copy_disks(&mut writer, layered)?;

        let memory_path = dir.join(MEMORY_FILE);
        let (digest_kind, digest, pages, zero_copy, base) = match (under, kind) {
            (None, SaveKind::Snapshot) => {
                let (digest, pages) = self.ram.write_full(&memory_path)?;
                (DigestKind::Pages, digest, pages, false, None)
            }
            (None, SaveKind::Fork) => {
                let (devices, vcpus) = (&self.devices, &self.vcpus);
                let (digest, pages, linked) =
                    self.ram.freeze_into_then(&memory_path, dir, || {
                        if resume_when_frozen && devices.resume().is_ok() {
                            vcpus.resume();
                        }
                    })?;
                (DigestKind::Pages, digest, pages, linked, None)
            }
            (Some((top, chain)), _) => {
                let files: Vec<PathBuf> = chain.iter().map(|s| s.path(MEMORY_FILE)).collect();
                if !layered {
                    // Long chains cost restore time and pin every base: start afresh.
                    let (digest, pages) = self.ram.write_flattened(&files, &memory_path)?;
                    (DigestKind::Pages, digest, pages, false, None)
                } else {
                    let (digest, pages) = self.ram.write_layer(&memory_path, &files)?;
                    (
                        DigestKind::LayerPages,
                        digest,
                        pages,
                        false,
                        Some(top.base_ref()),
                    )
                }
            }
        };
        writer.add_memory_file(MEMORY_FILE, digest_kind, digest)?;
        writer.finish(
            HostIdentity::current(Flavour::detect().name()),
            env!("CARGO_PKG_VERSION"),
            MemoryLayout {
                size: self.ram.size(),
                base,
            },
        )?;
        let report = SaveReport {
            memory_pages: pages,
            zero_copy,
            layered,
            elapsed: started.elapsed(),
        };
        tracing::info!(?report, dir = %dir.display(), "snapshot written");
        Ok(report)
    }

    /// A copy of each writable disk as the snapshot's `disk-N` (its data pages only; holes
    /// stay holes), so the snapshot is whole on its own: it can be archived, fetched by
    /// another node and restored any number of times, each restore writing to a copy of its
    /// own. Read-only disks are images shared by path, not copied.
    pub(super) fn copy_disks(
        &self,
        writer: &mut SnapshotWriter,
        layered: bool,
    ) -> Result<(), PersistError> {
        for (index, disk) in self.disks.iter().enumerate() {
            let transport = super::lock_disk(&disk.device);
            let block = transport.device();
            if block.read_only() {
                continue;
            }
            let name = disk_file(index);
            let failed = |source| PersistError::DiskCopy {
                path: block.path().to_owned(),
                source,
            };
            // Readable too: a layer's digest is taken from the copy itself.
            let copy = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .open(writer.path(&name))
                .map_err(failed)?;
            let (how, digest, _pages) = block.copy_to(&copy, layered).map_err(failed)?;
            let kind = match how {
                DiskCopy::Whole => DigestKind::Pages,
                DiskCopy::Layer => DigestKind::LayerPages,
            };
            writer.add_memory_file(&name, kind, digest)?;
        }
        Ok(())
    }

    /// Every host stream ends at a snapshot; the guest is told through its event queue.
    pub(super) fn reset_vsock_streams(&self) {
        if let Some(attached) = &self.vsock {
            let mut transport = super::lock_vsock(&attached.device);
            if let Some(mut active) = transport.active() {
                vsock::transport_reset(&mut active, &mut self.devices.registry(0));
            }
        }
    }

    pub(super) fn save_state(&self) -> Result<VmState, PersistError> {
        let vcpus = self.vcpus.vcpus();
        let msrs = match self.msrs.get() {
            Some(msrs) => msrs,
            None => {
                let first = vcpus
                    .first()
                    .ok_or_else(|| PersistError::Mismatch("the VM has no vCPU".into()))?;
                let probed = kvm_state::saveable_msrs(
                    &self.kvm.kvm,
                    &first.lock().unwrap_or_else(|p| p.into_inner()),
                )?;
                self.msrs.get_or_init(|| probed)
            }
        };
        let mut saved = Vec::with_capacity(vcpus.len());
        for (id, vcpu) in vcpus.iter().enumerate() {
            let vcpu = vcpu.lock().unwrap_or_else(|p| p.into_inner());
            saved.push(kvm_state::save_vcpu(&vcpu, id as u8, msrs)?);
        }
        let chips = kvm_state::save_vm(&self.kvm.fd)?;
        Ok(VmState {
            vcpus: saved,
            pic_master: Raw(chips.pic_master),
            pic_slave: Raw(chips.pic_slave),
            ioapic: Raw(chips.ioapic),
            pit: Raw(chips.pit),
            clock: Raw(chips.clock),
            serial: self
                .serial
                .as_ref()
                .map(|s| s.lock().unwrap_or_else(|p| p.into_inner()).save()),
            vsock: self.vsock.as_ref().map(|v| {
                let transport = super::lock_vsock(&v.device);
                let cid = transport.device().cid();
                transport.save(cid.to_le_bytes().to_vec())
            }),
            disks: self
                .disks
                .iter()
                .map(|d| {
                    let transport = super::lock_disk(&d.device);
                    let capacity = transport.device().capacity();
                    transport.save(capacity.to_le_bytes().to_vec())
                })
                .collect(),
            nets: self
                .nets
                .iter()
                .map(|n| {
                    let transport = crate::devices::virtio::net::lock(&n.device);
                    let config = transport.device().config_space().to_vec();
                    transport.save(config)
                })
                .collect(),
            streams_live: false,
        })
    }

    /// Builds a VM from an opened snapshot, paused unless `resume`.
    pub fn restore(
        restore: RestoreSpec,
        kvm: impl FnOnce() -> Result<KvmVm, VmError>,
        resume: bool,
    ) -> Result<Self, BuildError> {
        let RestoreSpec {
            spec,
            state,
            disk_layers,
            nets: net_states,
            chain,
            top,
            prefault,
        } = restore;
        let RamSpec { mergeable, .. } = spec.ram;
        let ram = GuestRam::restore(
            spec.memory_bytes,
            &chain,
            &top,
            RamOptions {
                prefault,
                mergeable,
            },
        )?;
        let vsock = match (&spec.vsock, &state.vsock) {
            (Some(vsock_spec), Some(saved)) => {
                if saved.device_config != u64::from(vsock_spec.cid).to_le_bytes() {
                    return Err(BuildError::State(
                        "the vsock CID in state.json differs from config.json".into(),
                    ));
                }
                Some(create_vsock(&ram, vsock_spec, Some(saved))?)
            }
            _ => None,
        };
        for (index, layers) in &disk_layers {
            let target = &spec.disks[*index].path;
            new_top(layers, target).map_err(|e| {
                BuildError::State(format!(
                    "making the restored disk {index} at {}: {e} (each restore needs a new \
                     file for it: vm.restore's disk_paths)",
                    target.display()
                ))
            })?;
        }
        let disks = spec
            .disks
            .iter()
            .enumerate()
            .zip(&state.disks)
            .map(|((index, disk), saved)| {
                let layers = disk_layers
                    .iter()
                    .find(|(i, _)| *i == index)
                    .map(|(_, layers)| layers.as_slice());
                let attached = create_disk(&ram, disk, Some(saved), layers)?;
                // The guest sized its view of the disk when it booted; a file of another
                // size would put its filesystem's end somewhere else.
                let capacity = super::lock_disk(&attached.device).device().capacity();
                if saved.device_config != capacity.to_le_bytes() {
                    return Err(BuildError::State(format!(
                        "disk {} is {capacity} bytes, not the size the snapshot was taken with",
                        disk.path.display()
                    )));
                }
                Ok(attached)
            })
            .collect::<Result<Vec<_>, _>>()?;
        // Each from the config as restored (a new tap, MAC and policy when overridden).
        let nets = spec
            .nets
            .iter()
            .zip(&net_states)
            .enumerate()
            .map(|(i, (net, saved))| create_net(&ram, i, net, Some(saved)))
            .collect::<Result<Vec<_>, _>>()?;
        let stats = Arc::new(SerialStats::default());
        let serial = serial_device(&spec, stats.clone(), state.serial.as_ref())?;
        let streams_live = state.streams_live;
        let parts = Parts {
            ram,
            vsock,
            disks,
            nets,
            serial,
            serial_stats: stats,
        };
        // Streams saved open are dead here: the guest hears so before it runs.
        let vm = Self::assemble(
            parts,
            kvm,
            |kvm, _ram| restore_kvm_state(kvm, &state),
            !resume || streams_live,
        )?;
        if streams_live {
            vm.reset_vsock_streams();
            if resume {
                vm.resume()
                    .map_err(|e| BuildError::State(format!("resuming the restored VM: {e}")))?;
            }
        }
        Ok(vm)
    }
}

/// The restored VM's own file for a disk over `layers`: new (a restore never writes into a
/// file someone else may be using) and empty, the disk's size. Not synced: like the VM's RAM
/// file it is scratch state; after a host crash the session goes on from its snapshot.
fn new_top(layers: &[PathBuf], target: &Path) -> std::io::Result<()> {
    let size = match layers.first() {
        Some(whole) => std::fs::metadata(whole)?.len(),
        None => return Err(std::io::Error::other("no copy of the disk in the snapshot")),
    };
    let made = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(target)?;
    let sized = made.set_len(size);
    if sized.is_err() {
        let _ = std::fs::remove_file(target);
    }
    sized
}

/// Interrupt controllers and PIT, then every vCPU, then the clock (last, so kvmclock is
/// recomputed against the restored TSCs).
fn restore_kvm_state(kvm: &KvmVm, state: &VmState) -> Result<Vec<VcpuFd>, BuildError> {
    kvm_state::check_xsave_size(&kvm.kvm)?;
    kvm_state::restore_chips(
        &kvm.fd,
        &VmKvmState {
            pic_master: state.pic_master.0,
            pic_slave: state.pic_slave.0,
            ioapic: state.ioapic.0,
            pit: state.pit.0,
            clock: state.clock.0,
        },
    )?;
    let mut vcpus = Vec::with_capacity(state.vcpus.len());
    for (index, saved) in state.vcpus.iter().enumerate() {
        if usize::from(saved.id) != index {
            return Err(BuildError::State(format!(
                "vCPU {} saved in slot {index}",
                saved.id
            )));
        }
        let vcpu = kvm
            .fd
            .create_vcpu(u64::from(saved.id))
            .map_err(super::ioctl("KVM_CREATE_VCPU"))?;
        kvm_state::restore_vcpu(&vcpu, saved)?;
        vcpus.push(vcpu);
    }
    kvm_state::restore_clock(&kvm.fd, &state.clock.0)?;
    Ok(vcpus)
}
