//! Checkpoints: snapshots of a running VM taken at each turn's end, so that every turn is a
//! point it can be forked from later.
//!
//! A checkpoint must cost the guest almost nothing, so it differs from `vm.snapshot` in
//! three ways:
//! - It stores only what changed since the VM's previous checkpoint, as a layer on it:
//!   the pages the vCPUs wrote (KVM's dirty log, on from the first checkpoint), the pages
//!   devices wrote (marked by every write through [`GuestMemoryMmap`]), and the disk blocks
//!   the guest wrote (counted by each disk).
//! - The VM is paused only while those pages and blocks are copied aside and its device
//!   state is read; the files are written, hashed and synced after it runs again.
//! - The vsock streams stay open (the daemon keeps talking to the guest); the saved state
//!   says so, and a VM restored from it tells the guest its streams are gone.
//!
//! The first checkpoint of a VM has no previous one: a booted VM's RAM file becomes its
//! memory (linked, not copied, as `vm.fork` does), a restored VM's is a layer of what it
//! changed since it was restored, over the snapshot it runs from. So is every
//! [`CHECKPOINT_DEPTH`]th one, which keeps the chains a restore composes short.
//!
//! [`GuestMemoryMmap`]: crate::kvm::memory::GuestMemoryMmap

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use agentvm_snapshot::Snapshot;
use agentvm_snapshot::dir::SnapshotWriter;
use agentvm_snapshot::manifest::{
    BaseRef, CONFIG_FILE, DigestKind, HostIdentity, MEMORY_FILE, MemoryLayout, STATE_FILE,
};
use agentvm_snapshot::pages::{PAGE_SIZE, PageHasher};
use agentvm_vmm_api::types::VmCheckpointReport;

use super::persist::{PersistError, disk_file};
use super::{Vm, lock_disk};
use crate::devices::virtio::block::WrittenBlocks;
use crate::kvm::Flavour;
use crate::kvm::memory::Backing;

/// Layers a VM's checkpoints stack on one another before one starts a new chain.
pub const CHECKPOINT_DEPTH: u32 = 32;

/// The VM's last checkpoint, which the next one is layered on.
#[derive(Debug, Clone)]
pub(super) struct LastCheckpoint {
    base: BaseRef,
    /// Layers from the start of this run of checkpoints up to it.
    depth: u32,
}

/// What was taken while the VM was paused, to be written once it runs again.
struct Captured {
    state: Vec<u8>,
    memory: Memory,
    /// Per writable disk (by index): its blocks written since the last checkpoint with their
    /// contents, or `None` where the disk was copied into the directory while paused.
    disks: Vec<(usize, Option<WrittenBlocks>)>,
    base: Option<BaseRef>,
}

/// How a checkpoint is taken (see the module comment).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum How {
    /// A layer on the last checkpoint: what was written since.
    Layer,
    /// The first of a restored VM: a layer of what it changed since it was restored.
    SinceRestore,
    /// The first of a booted VM: its RAM file, frozen.
    Freeze,
}

/// Pages and disk blocks copied aside, a later copy of one replacing the earlier.
#[derive(Default)]
struct Staged {
    /// Memory-file page → its slot in `bytes`.
    slots: std::collections::BTreeMap<u64, usize>,
    bytes: Vec<u8>,
    /// Per writable disk (by index): block → contents.
    disks: std::collections::BTreeMap<usize, std::collections::BTreeMap<u64, Vec<u8>>>,
}

impl Staged {
    fn copy_pages(
        &mut self,
        ram: &crate::kvm::memory::GuestRam,
        pages: &[u64],
    ) -> Result<(), PersistError> {
        let page_len = PAGE_SIZE as usize;
        for &page in pages {
            let next = self.slots.len();
            let slot = *self.slots.entry(page).or_insert(next);
            if slot == next {
                self.bytes.resize((next + 1) * page_len, 0);
            }
            ram.read_file_page(
                page,
                &mut self.bytes[slot * page_len..(slot + 1) * page_len],
            )?;
        }
        Ok(())
    }

    /// The pages in order, with their contents.
    fn pages(&self) -> impl Iterator<Item = (u64, &[u8])> {
        let page_len = PAGE_SIZE as usize;
        self.slots
            .iter()
            .map(move |(&page, &slot)| (page, &self.bytes[slot * page_len..(slot + 1) * page_len]))
    }
}

enum Memory {
    /// Pages copied aside, to be written as a layer.
    Staged {
        staged: Staged,
        /// Leave out zero pages no file of the chain holds: a page the guest only read
        /// since it was restored maps the zero page, which looks changed but is not.
        skip_unbacked_zeros: Option<std::collections::BTreeSet<u64>>,
    },
    /// Already in the directory: the RAM file linked (or copied) as `vm.fork` does.
    Written { digest: String, pages: u64 },
}

/// A checkpoint whose files are still being written, by a thread of its own.
pub(super) struct PendingCheckpoint {
    dir: PathBuf,
    report: VmCheckpointReport,
    started: Instant,
    depth: u32,
    writing: std::thread::JoinHandle<Result<Written, PersistError>>,
}

/// What the writing thread produced.
struct Written {
    base: BaseRef,
    memory_pages: u64,
    disk_blocks: u64,
    chain_depth: u32,
}

impl Vm {
    /// Takes a checkpoint of this running VM into `dir` (existing, without a snapshot) and
    /// leaves it running; returns once the VM runs again, with the files still being
    /// written ([`Self::checkpoint_wait`] waits for them). See the module comment.
    pub fn checkpoint(
        &mut self,
        dir: &Path,
        moved_to: Option<&Path>,
        config_json: &[u8],
    ) -> Result<VmCheckpointReport, PersistError> {
        let started = Instant::now();
        if let Some(Err(e)) = self.finish_checkpoint() {
            tracing::warn!(error = %e, "the previous checkpoint was not written; this one starts afresh");
        }
        // Before the pause: turning the log on changes the memory slots, which may wait
        // out a grace period in KVM.
        self.kvm
            .log_dirty_pages(&self.ram)
            .map_err(|e| PersistError::Mismatch(format!("dirty page logging: {e}")))?;
        let mut writer = SnapshotWriter::create(dir, true)?;
        let previous = self
            .last_checkpoint
            .clone()
            .filter(|last| last.depth < CHECKPOINT_DEPTH)
            .and_then(|last| match moved_to {
                // Moved by whoever keeps it: its manifest there, if this VMM can read it
                // (else the caller re-points the layer it gets).
                Some(dir) => Some(LastCheckpoint {
                    base: BaseRef {
                        dir: dir.to_owned(),
                        manifest_sha256: Snapshot::open(dir)
                            .map(|s| s.manifest_sha256)
                            .unwrap_or(last.base.manifest_sha256),
                    },
                    depth: last.depth,
                }),
                None => still_there(&last.base).then_some(last),
            });
        let how = match (&previous, self.ram.backing()) {
            (Some(_), _) => How::Layer,
            (None, Backing::Private { .. }) => How::SinceRestore,
            (None, Backing::Own) => How::Freeze,
        };
        let staged = self.precopy(how)?;
        let paused_at = Instant::now();
        self.pause()
            .map_err(|e| PersistError::Mismatch(format!("pausing for the checkpoint: {e}")))?;
        let captured = self.capture(&mut writer, dir, how, staged, previous.as_ref());
        let (captured, paused) = match captured {
            Ok((captured, resumed_at)) => {
                let paused = resumed_at.unwrap_or_else(Instant::now) - paused_at;
                (Ok(captured), paused)
            }
            Err(e) => (Err(e), paused_at.elapsed()),
        };
        if !self.running() {
            self.resume()
                .map_err(|e| PersistError::Mismatch(format!("resuming after a checkpoint: {e}")))?;
        }
        // Until this one is written, the next has nothing to layer on.
        self.last_checkpoint = None;
        let captured = captured?;
        let report = VmCheckpointReport {
            memory_pages: captured.memory.pages(),
            disk_blocks: captured.disk_blocks(),
            paused_us: micros(paused),
            elapsed_us: micros(started.elapsed()),
            incremental: previous.is_some(),
            chain_depth: 0,
            durable: false,
        };
        let target = Target {
            dir: dir.to_owned(),
            config_json: config_json.to_vec(),
            memory_size: self.ram.size(),
            disk_capacities: self
                .disks
                .iter()
                .map(|d| lock_disk(&d.device).device().capacity())
                .collect(),
        };
        let writing = std::thread::Builder::new()
            .name("checkpoint".into())
            .spawn(move || write_captured(writer, target, captured))
            .map_err(|source| PersistError::DiskCopy {
                path: dir.to_owned(),
                source,
            })?;
        self.pending_checkpoint = Some(PendingCheckpoint {
            dir: dir.to_owned(),
            report: report.clone(),
            started,
            depth: previous.as_ref().map_or(1, |last| last.depth + 1),
            writing,
        });
        Ok(report)
    }

    /// Waits until the last checkpoint is written and durable; returns its report. `None`
    /// if none was being written.
    pub fn checkpoint_wait(&mut self) -> Option<Result<VmCheckpointReport, PersistError>> {
        self.finish_checkpoint()
    }

    /// Waits for the checkpoint being written, if any, and makes it what the next one
    /// layers on. Every other save waits for it too: one snapshot at a time.
    pub(super) fn finish_checkpoint(&mut self) -> Option<Result<VmCheckpointReport, PersistError>> {
        let pending = self.pending_checkpoint.take()?;
        let written = pending.writing.join().unwrap_or_else(|_| {
            Err(PersistError::Mismatch(
                "the checkpoint's writer panicked".into(),
            ))
        });
        Some(written.map(|written| {
            self.last_checkpoint = Some(LastCheckpoint {
                base: written.base,
                depth: pending.depth,
            });
            let report = VmCheckpointReport {
                memory_pages: written.memory_pages,
                disk_blocks: written.disk_blocks,
                elapsed_us: micros(pending.started.elapsed()),
                chain_depth: written.chain_depth,
                durable: true,
                ..pending.report
            };
            tracing::info!(?report, dir = %pending.dir.display(), "checkpoint written");
            report
        }))
    }

    /// What can be copied aside while the VM still runs (a pre-copy, as live migration
    /// does): the pages and blocks written since the last checkpoint, or, for a restored VM's
    /// first, every page it changed since it was restored. Whatever the guest writes from
    /// here on is logged again and copied once more while paused, so the pause copies only
    /// what changed during this copy.
    fn precopy(&mut self, how: How) -> Result<Staged, PersistError> {
        let mut staged = Staged::default();
        match how {
            How::Layer => {
                self.stage_logged(&mut staged)?;
                self.stage_disks(&mut staged)?;
            }
            How::SinceRestore => {
                self.start_tracking()?;
                let pages = self.ram.changed_file_pages()?;
                staged.copy_pages(&self.ram, &pages)?;
            }
            How::Freeze => {}
        }
        Ok(staged)
    }

    /// The pages written since the dirty log was last read, into `staged`.
    fn stage_logged(&mut self, staged: &mut Staged) -> Result<(), PersistError> {
        let guest = self
            .kvm
            .take_dirty_log(&self.ram)
            .map_err(|e| PersistError::Mismatch(format!("dirty page log: {e}")))?;
        let pages = self.ram.dirty_file_pages(&guest);
        staged.copy_pages(&self.ram, &pages)?;
        Ok(())
    }

    /// Each writable disk's blocks written since they were last taken, into `staged`.
    fn stage_disks(&mut self, staged: &mut Staged) -> Result<(), PersistError> {
        for (index, disk) in self.disks.iter().enumerate() {
            let mut transport = lock_disk(&disk.device);
            let block = transport.device_mut();
            if block.read_only() {
                continue;
            }
            let blocks = block
                .take_written_blocks()
                .map_err(|source| PersistError::DiskCopy {
                    path: block.path().to_owned(),
                    source,
                })?
                .ok_or_else(|| {
                    PersistError::Mismatch(format!(
                        "disk {index} counted no writes since the last checkpoint"
                    ))
                })?;
            staged.disks.entry(index).or_default().extend(blocks);
        }
        Ok(())
    }

    /// Everything that needs the VM paused. Returns when the VM was resumed, if it was
    /// (a linked RAM file lets it run again before the file's digest is taken).
    fn capture(
        &mut self,
        writer: &mut SnapshotWriter,
        dir: &Path,
        how: How,
        mut staged: Staged,
        previous: Option<&LastCheckpoint>,
    ) -> Result<(Captured, Option<Instant>), PersistError> {
        let mut state = self.save_state()?;
        state.streams_live = true;
        let state = state.to_json()?;
        let mut resumed_at = None;
        let captured = match how {
            How::Layer => {
                self.stage_logged(&mut staged)?;
                self.stage_disks(&mut staged)?;
                let disks = std::mem::take(&mut staged.disks)
                    .into_iter()
                    .map(|(index, blocks)| (index, Some(blocks.into_iter().collect())))
                    .collect();
                Captured {
                    state,
                    memory: Memory::Staged {
                        staged,
                        skip_unbacked_zeros: None,
                    },
                    disks,
                    base: previous.map(|last| last.base.clone()),
                }
            }
            How::SinceRestore => {
                self.stage_logged(&mut staged)?;
                let Backing::Private { top } = self.ram.backing().clone() else {
                    return Err(PersistError::Mismatch(
                        "the VM no longer runs from a snapshot".into(),
                    ));
                };
                let top = Snapshot::open(&top)?;
                let backed = backed_pages(&top)?;
                self.copy_disks(writer, true)?;
                Captured {
                    state,
                    memory: Memory::Staged {
                        staged,
                        skip_unbacked_zeros: Some(backed),
                    },
                    disks: self.copied_disks(),
                    base: Some(top.base_ref()),
                }
            }
            How::Freeze => {
                // What the next checkpoint stores starts now: before the VM runs again.
                self.start_tracking()?;
                self.copy_disks(writer, false)?;
                let (devices, vcpus) = (&self.devices, &self.vcpus);
                let resumed = &mut resumed_at;
                let (digest, pages, _linked) =
                    self.ram.freeze_into_then(&dir.join(MEMORY_FILE), dir, || {
                        if devices.resume().is_ok() {
                            vcpus.resume();
                            *resumed = Some(Instant::now());
                        }
                    })?;
                Captured {
                    state,
                    memory: Memory::Written { digest, pages },
                    disks: self.copied_disks(),
                    base: None,
                }
            }
        };
        Ok((captured, resumed_at))
    }

    /// Disks `copy_disks` wrote into the directory while paused.
    fn copied_disks(&self) -> Vec<(usize, Option<WrittenBlocks>)> {
        self.disks
            .iter()
            .enumerate()
            .filter(|(_, d)| !lock_disk(&d.device).device().read_only())
            .map(|(index, _)| (index, None))
            .collect()
    }

    fn start_tracking(&mut self) -> Result<(), PersistError> {
        self.kvm
            .take_dirty_log(&self.ram)
            .map_err(|e| PersistError::Mismatch(format!("dirty page log: {e}")))?;
        self.ram.reset_device_dirty();
        for disk in &self.disks {
            let mut transport = lock_disk(&disk.device);
            if !transport.device().read_only() {
                transport.device_mut().track_writes();
            }
        }
        Ok(())
    }
}

/// Where a captured checkpoint goes, and what of the VM writing it needs.
struct Target {
    dir: PathBuf,
    config_json: Vec<u8>,
    memory_size: u64,
    disk_capacities: Vec<u64>,
}

impl Memory {
    fn pages(&self) -> u64 {
        match self {
            Memory::Staged { staged, .. } => staged.slots.len() as u64,
            Memory::Written { pages, .. } => *pages,
        }
    }
}

impl Captured {
    fn disk_blocks(&self) -> u64 {
        self.disks
            .iter()
            .filter_map(|(_, blocks)| blocks.as_ref())
            .map(|b| b.len() as u64)
            .sum()
    }
}

/// Writes what was captured, with the VM running: state, config, the memory and disk
/// layers, each synced, then the manifest.
fn write_captured(
    mut writer: SnapshotWriter,
    target: Target,
    captured: Captured,
) -> Result<Written, PersistError> {
    let dir = &target.dir;
    writer.write_file(STATE_FILE, &captured.state)?;
    writer.write_file(CONFIG_FILE, &target.config_json)?;
    let (kind, digest, memory_pages) = match captured.memory {
        Memory::Written { digest, pages } => (DigestKind::Pages, digest, pages),
        Memory::Staged {
            staged,
            skip_unbacked_zeros,
        } => {
            let path = dir.join(MEMORY_FILE);
            let (digest, stored) = write_layer(
                &path,
                target.memory_size,
                staged
                    .pages()
                    .filter(|(page, bytes)| match &skip_unbacked_zeros {
                        Some(backed) => {
                            backed.contains(page) || !agentvm_snapshot::pages::is_zero(bytes)
                        }
                        None => true,
                    }),
            )
            .map_err(|source| PersistError::DiskCopy { path, source })?;
            (DigestKind::LayerPages, digest, stored)
        }
    };
    writer.add_memory_file(MEMORY_FILE, kind, digest)?;
    let mut disk_blocks = 0;
    for (index, blocks) in captured.disks {
        let Some(blocks) = blocks else {
            continue;
        };
        let name = disk_file(index);
        let path = dir.join(&name);
        let capacity = target.disk_capacities.get(index).copied().unwrap_or(0);
        let (digest, stored) = write_layer(
            &path,
            capacity,
            blocks
                .iter()
                .map(|(block, bytes)| (*block, bytes.as_slice())),
        )
        .map_err(|source| PersistError::DiskCopy { path, source })?;
        disk_blocks += stored;
        writer.add_memory_file(&name, DigestKind::LayerPages, digest)?;
    }
    writer.finish(
        HostIdentity::current(Flavour::detect().name()),
        env!("CARGO_PKG_VERSION"),
        MemoryLayout {
            size: target.memory_size,
            base: captured.base,
        },
    )?;
    let snapshot = Snapshot::open(dir)?;
    Ok(Written {
        base: snapshot.base_ref(),
        memory_pages,
        disk_blocks,
        // Bases this VMM cannot read (moved where it cannot see) count as unknown: 0.
        chain_depth: snapshot.chain().map_or(0, |c| c.len() as u32),
    })
}

/// A new layer file of `size` bytes at `path` holding `pages` (index, 4 KiB contents, in
/// index order) and holes elsewhere. Returns its layer digest and page count.
fn write_layer<'a>(
    path: &Path,
    size: u64,
    pages: impl Iterator<Item = (u64, &'a [u8])>,
) -> std::io::Result<(String, u64)> {
    let out = File::create_new(path)?;
    out.set_len(size)?;
    let mut hasher = PageHasher::default();
    for (index, bytes) in pages {
        out.write_all_at(bytes, index * PAGE_SIZE)?;
        hasher.stored_page(index, bytes);
    }
    let pages = hasher.pages();
    Ok((hasher.finish(), pages))
}

/// The memory-file pages some file of `top`'s chain holds.
fn backed_pages(top: &Snapshot) -> Result<std::collections::BTreeSet<u64>, PersistError> {
    let failed = |source| PersistError::DiskCopy {
        path: top.dir.clone(),
        source,
    };
    let files = top
        .chain()?
        .iter()
        .map(|s| File::open(s.path(MEMORY_FILE)))
        .collect::<Result<Vec<_>, _>>()
        .map_err(failed)?;
    Ok(agentvm_snapshot::pages::owners(&files)
        .map_err(failed)?
        .into_keys()
        .collect())
}

/// The previous checkpoint is still where it was written, unchanged: else the next one
/// cannot be layered on it.
fn still_there(base: &BaseRef) -> bool {
    Snapshot::open(&base.dir).is_ok_and(|s| s.manifest_sha256 == base.manifest_sha256)
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}
