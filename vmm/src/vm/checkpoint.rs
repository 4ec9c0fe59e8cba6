//! Checkpoints: snapshots of a running VM taken at each turn's end, so that every turn is a
//! point it can be forked from later.
//!
//! A checkpoint must cost the guest almost nothing, so it differs from `vm.snapshot` in
//! three ways:
//! - It stores only what changed since the VM's previous checkpoint, as a layer on it:
//!   the pages the vCPUs wrote (KVM's dirty log, on from the first checkpoint), the pages
//!   devices wrote (marked by every write through [`GuestMemoryMmap`]), and the disk blocks
//!   the guest wrote (counted by each disk).
//! - What changed is copied into the checkpoint's layer files while the VM still runs (a
//!   pre-copy, as live migration does); the VM is then paused only to copy again what it
//!   wrote meanwhile and to read its device state. The files are hashed and synced after it
//!   runs again. Nothing is staged in memory: a checkpoint costs the VMM no more than the
//!   page cache of what it writes.
//! - The vsock streams stay open (the daemon keeps talking to the guest); the saved state
//!   says so, and a VM restored from it tells the guest its streams are gone.
//!
//! Checkpoints are pipelined: the next one may be taken while the files of the one before
//! are still being synced and hashed (its writer waits for them only to name its base in
//! its manifest), and waiting for one to be durable holds up neither the VM nor the API.
//! A next turn that follows its predecessor closely thus waits only for its own pause.
//!
//! The first checkpoint of a VM has no previous one: a booted VM's RAM file becomes its
//! memory (linked, not copied, as `vm.fork` does), a restored VM's is a layer of what it
//! changed since it was restored, over the snapshot it runs from. So is every
//! [`CHECKPOINT_DEPTH`]th one, which keeps the chains a restore composes short.
//!
//! [`GuestMemoryMmap`]: crate::kvm::memory::GuestMemoryMmap

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use agentvm_snapshot::Snapshot;
use agentvm_snapshot::dir::SnapshotWriter;
use agentvm_snapshot::manifest::{
    BaseRef, CONFIG_FILE, DigestKind, HostIdentity, MEMORY_FILE, MemoryLayout, STATE_FILE,
};
use agentvm_snapshot::pages::PAGE_SIZE;
use agentvm_vmm_api::types::VmCheckpointReport;

use super::persist::{PersistError, disk_file};
use super::{Vm, lock_disk};
use crate::kvm::Flavour;
use crate::kvm::memory::{Backing, GuestRam};

/// Layers a VM's checkpoints stack on one another before one starts a new chain.
pub const CHECKPOINT_DEPTH: u32 = 32;

/// Checkpoints kept track of once written and waited for, newest last. One not yet waited
/// for is kept however many follow it (up to [`REMEMBERED_AT_MOST`]): agentvmd waits for
/// each in turn, and while a slow one (a booted VM's first, its whole RAM) is stored, the
/// turns after it may take many more.
const REMEMBERED: usize = 8;
/// A bound on checkpoints kept track of, for a caller that never waits.
const REMEMBERED_AT_MOST: usize = 1024;

/// What a checkpoint is layered on, as known when it is captured.
enum Base {
    /// Nothing: the first of a chain, over a booted VM's RAM.
    None,
    Known(BaseRef),
    /// The previous checkpoint, whose files are still being written: its writer's outcome
    /// names it. `moved_to`: where it lives after it was moved (see `vm.checkpoint`).
    After {
        writing: Arc<Writing>,
        moved_to: Option<PathBuf>,
    },
}

impl Base {
    /// The base to name in the manifest, waiting for the previous checkpoint if need be.
    fn resolve(self) -> Result<Option<BaseRef>, PersistError> {
        match self {
            Base::None => Ok(None),
            Base::Known(base) => Ok(Some(base)),
            Base::After { writing, moved_to } => {
                let written = writing.wait().map_err(|e| {
                    PersistError::Mismatch(format!("the checkpoint below was not written: {e}"))
                })?;
                Ok(Some(match moved_to {
                    Some(dir) => moved_base(&dir, written.base),
                    None => written.base,
                }))
            }
        }
    }
}

/// The base of a checkpoint moved to `dir`: its manifest there if this VMM can read it
/// (else the caller re-points the layer it gets).
fn moved_base(dir: &Path, written: BaseRef) -> BaseRef {
    match Snapshot::open(dir) {
        Ok(moved) => moved.base_ref(),
        Err(_) => BaseRef {
            dir: dir.to_owned(),
            ..written
        },
    }
}

/// The outcome of a checkpoint's writing thread, shared with whoever waits for it.
#[derive(Default)]
pub(super) struct Writing {
    outcome: Mutex<Option<Result<Written, String>>>,
    done: Condvar,
}

impl Writing {
    fn failed(why: String) -> Arc<Self> {
        let writing = Arc::new(Self::default());
        writing.finish(Err(why));
        writing
    }

    fn finish(&self, outcome: Result<Written, String>) {
        *self.outcome.lock().unwrap_or_else(|p| p.into_inner()) = Some(outcome);
        self.done.notify_all();
    }

    fn finished(&self) -> Option<Result<Written, String>> {
        self.outcome
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn wait(&self) -> Result<Written, String> {
        let mut outcome = self.outcome.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(outcome) = outcome.as_ref() {
                return outcome.clone();
            }
            outcome = self.done.wait(outcome).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// What was taken while the VM was paused, to be finished once it runs again.
struct Captured {
    state: Vec<u8>,
    memory: Memory,
    /// Per writable disk (by index): its layer of the blocks written since the last
    /// checkpoint, or `None` where the disk was copied into the directory while paused.
    disks: Vec<(usize, Option<LayerFile>)>,
    base: Base,
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

/// A layer file being filled: pages (or disk blocks) at their offsets, holes elsewhere.
/// A page written again replaces its earlier copy.
struct LayerFile {
    name: String,
    file: File,
    /// The file's length (the VM's memory or the disk's capacity).
    size: u64,
    written: BTreeSet<u64>,
}

impl LayerFile {
    fn create(dir: &Path, name: &str, size: u64) -> Result<Self, PersistError> {
        let path = dir.join(name);
        let failed = |source| PersistError::DiskCopy {
            path: path.clone(),
            source,
        };
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(failed)?;
        file.set_len(size).map_err(failed)?;
        Ok(Self {
            name: name.to_owned(),
            file,
            size,
            written: BTreeSet::new(),
        })
    }

    /// Writes `bytes` (`count` pages) from page `first` on.
    fn put_run(&mut self, first: u64, bytes: &[u8], count: usize) -> Result<(), PersistError> {
        self.file
            .write_all_at(bytes, first * PAGE_SIZE)
            .map_err(|source| PersistError::DiskCopy {
                path: PathBuf::from(&self.name),
                source,
            })?;
        self.written.extend(first..first + count as u64);
        Ok(())
    }

    /// Writes `bytes` (one page) as page `index`, cut at the file's end.
    fn put(&mut self, index: u64, bytes: &[u8]) -> Result<(), PersistError> {
        let at = index * PAGE_SIZE;
        let len = (self.size.saturating_sub(at)).min(bytes.len() as u64) as usize;
        self.file
            .write_all_at(&bytes[..len], at)
            .map_err(|source| PersistError::DiskCopy {
                path: PathBuf::from(&self.name),
                source,
            })?;
        self.written.insert(index);
        Ok(())
    }

    /// Synced, with its layer digest and how many pages it stores.
    fn finish(self) -> Result<(String, String, u64), PersistError> {
        let failed = |source| PersistError::DiskCopy {
            path: PathBuf::from(&self.name),
            source,
        };
        self.file.sync_all().map_err(failed)?;
        let (digest, pages) = agentvm_snapshot::pages::layer_digest(&self.file).map_err(failed)?;
        Ok((self.name, digest, pages))
    }
}

/// The memory layer being copied, with what it may leave out.
struct MemoryLayer {
    layer: LayerFile,
    /// For a restored VM's first checkpoint: the pages some file of its chain holds. A page
    /// it only read since it was restored maps the zero page, which looks changed but is
    /// not; a zero page over none of these is left out.
    backed: Option<BTreeSet<u64>>,
    page: Vec<u8>,
}

/// Pages copied per read of guest memory and write of the layer file.
const RUN_PAGES: usize = 256;

impl MemoryLayer {
    /// Copies `pages` (in order) into the layer: runs of consecutive pages in one read and
    /// one write each.
    fn copy_pages(&mut self, ram: &GuestRam, pages: &[u64]) -> Result<(), PersistError> {
        if self.backed.is_some() {
            return self.copy_each(ram, pages);
        }
        let mut start = 0;
        while start < pages.len() {
            let mut end = start + 1;
            while end < pages.len()
                && end - start < RUN_PAGES
                && pages[end] == pages[end - 1] + 1
                && ram.file_pages_adjacent(pages[end - 1])
            {
                end += 1;
            }
            let len = (end - start) * PAGE_SIZE as usize;
            self.page.resize(len.max(PAGE_SIZE as usize), 0);
            ram.read_file_pages(pages[start], &mut self.page[..len])?;
            self.layer
                .put_run(pages[start], &self.page[..len], end - start)?;
            start = end;
        }
        Ok(())
    }

    /// Page by page, leaving out the unchanged holes `backed` tells of.
    fn copy_each(&mut self, ram: &GuestRam, pages: &[u64]) -> Result<(), PersistError> {
        self.page.resize(PAGE_SIZE as usize, 0);
        for &index in pages {
            ram.read_file_pages(index, &mut self.page)?;
            let unchanged_hole = self.backed.as_ref().is_some_and(|backed| {
                !backed.contains(&index)
                    && !self.layer.written.contains(&index)
                    && agentvm_snapshot::pages::is_zero(&self.page)
            });
            if !unchanged_hole {
                self.layer.put(index, &self.page)?;
            }
        }
        Ok(())
    }
}

/// What is copied before and during the pause.
struct Staged {
    memory: Option<MemoryLayer>,
    disks: BTreeMap<usize, LayerFile>,
}

enum Memory {
    /// A layer file of the pages copied.
    Layer(LayerFile),
    /// Already in the directory: the RAM file linked (or copied) as `vm.fork` does.
    Written { digest: String, pages: u64 },
}

/// A checkpoint taken: its files written by a thread of its own, or being.
pub(super) struct TakenCheckpoint {
    dir: PathBuf,
    report: VmCheckpointReport,
    started: Instant,
    /// Layers from the start of its run of checkpoints up to it.
    depth: u32,
    writing: Arc<Writing>,
    /// Someone asked to wait for it (then it may be forgotten once written).
    waited: std::sync::atomic::AtomicBool,
}

/// Waits for one checkpoint to be durable, without holding the VM.
pub struct CheckpointWaiter {
    dir: PathBuf,
    report: VmCheckpointReport,
    started: Instant,
    writing: Arc<Writing>,
}

impl CheckpointWaiter {
    /// The checkpoint's final report once its files and manifest are synced.
    pub fn wait(self) -> Result<VmCheckpointReport, PersistError> {
        let written = self.writing.wait().map_err(PersistError::Mismatch)?;
        let report = VmCheckpointReport {
            memory_pages: written.memory_pages,
            disk_blocks: written.disk_blocks,
            elapsed_us: micros(self.started.elapsed()),
            chain_depth: written.chain_depth,
            durable: true,
            ..self.report
        };
        tracing::info!(?report, dir = %self.dir.display(), "checkpoint written");
        Ok(report)
    }
}

/// What the writing thread produced.
#[derive(Clone)]
pub(super) struct Written {
    base: BaseRef,
    memory_pages: u64,
    disk_blocks: u64,
    chain_depth: u32,
}

impl Vm {
    /// Takes a checkpoint of this running VM into `dir` (existing, without a snapshot) and
    /// leaves it running; returns once the VM runs again, with the files still being
    /// written ([`Self::checkpoint_waiter`] waits for them). See the module comment.
    pub fn checkpoint(
        &mut self,
        dir: &Path,
        moved_to: Option<&Path>,
        fresh: bool,
        config_json: &[u8],
    ) -> Result<VmCheckpointReport, PersistError> {
        let started = Instant::now();
        // Before the pause: turning the log on changes the memory slots, which may wait
        // out a grace period in KVM.
        self.kvm
            .log_dirty_pages(&self.ram)
            .map_err(|e| PersistError::Mismatch(format!("dirty page logging: {e}")))?;
        let mut writer = SnapshotWriter::create(dir, true)?;
        let (previous, depth) = match fresh {
            true => (Base::None, 1),
            false => self.previous_checkpoint(moved_to),
        };
        let how = match (&previous, self.ram.backing()) {
            (Base::Known(_) | Base::After { .. }, _) => How::Layer,
            (Base::None, Backing::Private { .. }) => How::SinceRestore,
            (Base::None, Backing::Own) => How::Freeze,
        };
        let taken = self.capture_running(&mut writer, dir, how, previous);
        let (captured, precopied, paused) = match taken {
            Ok(taken) => taken,
            Err(e) => {
                // The logs may be consumed: the next checkpoint cannot be layered on this
                // one's predecessor (it would miss pages), so it starts afresh.
                self.remember_checkpoint(TakenCheckpoint {
                    dir: dir.to_owned(),
                    report: VmCheckpointReport::default(),
                    started,
                    depth,
                    writing: Writing::failed(e.to_string()),
                    waited: Default::default(),
                });
                return Err(e);
            }
        };
        let report = VmCheckpointReport {
            memory_pages: captured.memory.pages(),
            disk_blocks: captured
                .disks
                .iter()
                .filter_map(|(_, layer)| layer.as_ref())
                .map(|layer| layer.written.len() as u64)
                .sum(),
            paused_us: micros(paused),
            precopy_us: micros(precopied),
            elapsed_us: micros(started.elapsed()),
            incremental: how == How::Layer,
            chain_depth: 0,
            durable: false,
        };
        let target = Target {
            dir: dir.to_owned(),
            config_json: config_json.to_vec(),
            memory_size: self.ram.size(),
        };
        let writing = Arc::new(Writing::default());
        let outcome = Arc::clone(&writing);
        std::thread::Builder::new()
            .name("checkpoint".into())
            .spawn(move || {
                outcome.finish(write_captured(writer, target, captured).map_err(|e| e.to_string()))
            })
            .map_err(|source| PersistError::DiskCopy {
                path: dir.to_owned(),
                source,
            })?;
        self.remember_checkpoint(TakenCheckpoint {
            dir: dir.to_owned(),
            report: report.clone(),
            started,
            depth,
            writing,
            waited: Default::default(),
        });
        Ok(report)
    }

    /// What the next checkpoint is layered on, and its depth in its run of checkpoints:
    /// the last one, unless that failed, ended a run, or is no longer where it was.
    fn previous_checkpoint(&self, moved_to: Option<&Path>) -> (Base, u32) {
        let Some(last) = self
            .checkpoints
            .back()
            .filter(|last| last.depth < CHECKPOINT_DEPTH)
        else {
            return (Base::None, 1);
        };
        let layered = |base| (base, last.depth + 1);
        match last.writing.finished() {
            None => layered(Base::After {
                writing: Arc::clone(&last.writing),
                moved_to: moved_to.map(Path::to_owned),
            }),
            Some(Err(_)) => (Base::None, 1),
            Some(Ok(written)) => match moved_to {
                Some(dir) => layered(Base::Known(moved_base(dir, written.base))),
                None if still_there(&written.base) => layered(Base::Known(written.base)),
                None => (Base::None, 1),
            },
        }
    }

    /// The pre-copy and the pause: returns what was captured, how long the pre-copy took
    /// and how long the VM was paused. The VM runs again whatever happened.
    fn capture_running(
        &mut self,
        writer: &mut SnapshotWriter,
        dir: &Path,
        how: How,
        previous: Base,
    ) -> Result<(Captured, Duration, Duration), PersistError> {
        let precopy_at = Instant::now();
        let staged = self.precopy(dir, how)?;
        let precopied = precopy_at.elapsed();
        let paused_at = Instant::now();
        self.pause()
            .map_err(|e| PersistError::Mismatch(format!("pausing for the checkpoint: {e}")))?;
        let captured = self.capture(writer, dir, how, staged, previous);
        let paused = match &captured {
            Ok((_, resumed_at)) => resumed_at.unwrap_or_else(Instant::now) - paused_at,
            Err(_) => paused_at.elapsed(),
        };
        if !self.running() {
            self.resume()
                .map_err(|e| PersistError::Mismatch(format!("resuming after a checkpoint: {e}")))?;
        }
        let (captured, _) = captured?;
        Ok((captured, precopied, paused))
    }

    fn remember_checkpoint(&mut self, taken: TakenCheckpoint) {
        self.checkpoints.push_back(taken);
        while self.checkpoints.len() > REMEMBERED {
            let forgettable = self.checkpoints.iter().position(|c| {
                c.waited.load(std::sync::atomic::Ordering::Relaxed)
                    && c.writing.finished().is_some()
            });
            match forgettable {
                Some(i) => {
                    self.checkpoints.remove(i);
                }
                None if self.checkpoints.len() > REMEMBERED_AT_MOST => {
                    self.checkpoints.pop_front();
                }
                None => break,
            }
        }
    }

    /// A waiter for the checkpoint written into `dir` (the newest if `None`); `None` if
    /// there is none such.
    pub fn checkpoint_waiter(&self, dir: Option<&Path>) -> Option<CheckpointWaiter> {
        let taken = match dir {
            Some(dir) => self.checkpoints.iter().rev().find(|c| c.dir == dir)?,
            None => self.checkpoints.back()?,
        };
        taken
            .waited
            .store(true, std::sync::atomic::Ordering::Relaxed);
        Some(CheckpointWaiter {
            dir: taken.dir.clone(),
            report: taken.report.clone(),
            started: taken.started,
            writing: Arc::clone(&taken.writing),
        })
    }

    /// Waits until every checkpoint being written is; returns the newest's outcome, if any
    /// was taken. Every other save waits for them: one snapshot at a time.
    pub(super) fn settle_checkpoints(&self) -> Option<Result<VmCheckpointReport, PersistError>> {
        let newest = self.checkpoint_waiter(None)?;
        for taken in &self.checkpoints {
            let _ = taken.writing.wait();
        }
        Some(newest.wait())
    }

    /// What can be copied while the VM still runs (a pre-copy): the pages and blocks
    /// written since the last checkpoint, or, for a restored VM's first, every page it
    /// changed since it was restored. Whatever the guest writes from here on is logged again
    /// and copied once more while paused, so the pause copies only what changed meanwhile.
    fn precopy(&mut self, dir: &Path, how: How) -> Result<Staged, PersistError> {
        let mut staged = Staged {
            memory: None,
            disks: BTreeMap::new(),
        };
        let memory = |backed| -> Result<MemoryLayer, PersistError> {
            Ok(MemoryLayer {
                layer: LayerFile::create(dir, MEMORY_FILE, self.ram.size())?,
                backed,
                page: vec![0u8; PAGE_SIZE as usize],
            })
        };
        match how {
            How::Layer => {
                staged.memory = Some(memory(None)?);
                for (index, disk) in self.disks.iter().enumerate() {
                    let transport = lock_disk(&disk.device);
                    let block = transport.device();
                    if !block.read_only() {
                        let layer = LayerFile::create(dir, &disk_file(index), block.capacity())?;
                        staged.disks.insert(index, layer);
                    }
                }
                self.copy_logged(&mut staged)?;
                self.copy_disk_writes(&mut staged)?;
            }
            How::SinceRestore => {
                let Backing::Private { top } = self.ram.backing().clone() else {
                    return Err(PersistError::Mismatch(
                        "the VM does not run from a snapshot".into(),
                    ));
                };
                let backed = backed_pages(&Snapshot::open(&top)?)?;
                let mut layer = memory(Some(backed))?;
                self.start_tracking()?;
                let pages = self.ram.changed_file_pages()?;
                layer.copy_pages(&self.ram, &pages)?;
                staged.memory = Some(layer);
            }
            How::Freeze => {}
        }
        Ok(staged)
    }

    /// The pages written since the dirty log was last read, into the memory layer.
    fn copy_logged(&mut self, staged: &mut Staged) -> Result<(), PersistError> {
        let guest = self
            .kvm
            .take_dirty_log(&self.ram)
            .map_err(|e| PersistError::Mismatch(format!("dirty page log: {e}")))?;
        let pages = self.ram.dirty_file_pages(&guest);
        match staged.memory.as_mut() {
            Some(memory) => memory.copy_pages(&self.ram, &pages),
            None => Ok(()),
        }
    }

    /// Each writable disk's blocks written since they were last taken, into its layer.
    fn copy_disk_writes(&mut self, staged: &mut Staged) -> Result<(), PersistError> {
        for (index, layer) in staged.disks.iter_mut() {
            let mut transport = lock_disk(&self.disks[*index].device);
            let block = transport.device_mut();
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
            drop(transport);
            for (at, bytes) in blocks {
                layer.put(at, &bytes)?;
            }
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
        previous: Base,
    ) -> Result<(Captured, Option<Instant>), PersistError> {
        let mut state = self.save_state()?;
        state.streams_live = true;
        let state = state.to_json()?;
        let mut resumed_at = None;
        let captured = match how {
            How::Layer | How::SinceRestore => {
                self.copy_logged(&mut staged)?;
                let disks = if how == How::Layer {
                    self.copy_disk_writes(&mut staged)?;
                    staged
                        .disks
                        .into_iter()
                        .map(|(index, layer)| (index, Some(layer)))
                        .collect()
                } else {
                    self.copy_disks(writer, true)?;
                    self.copied_disks()
                };
                let base = match how {
                    How::Layer => previous,
                    _ => match self.ram.backing() {
                        Backing::Private { top } => Base::Known(Snapshot::open(top)?.base_ref()),
                        Backing::Own => Base::None,
                    },
                };
                let memory = staged
                    .memory
                    .map(|m| m.layer)
                    .ok_or_else(|| PersistError::Mismatch("no memory layer".into()))?;
                Captured {
                    state,
                    memory: Memory::Layer(memory),
                    disks,
                    base,
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
                    base: Base::None,
                }
            }
        };
        Ok((captured, resumed_at))
    }

    /// Disks `copy_disks` wrote into the directory while paused.
    fn copied_disks(&self) -> Vec<(usize, Option<LayerFile>)> {
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
}

impl Memory {
    fn pages(&self) -> u64 {
        match self {
            Memory::Layer(layer) => layer.written.len() as u64,
            Memory::Written { pages, .. } => *pages,
        }
    }
}

/// Finishes what was captured, with the VM running: state and config written, each layer
/// synced and hashed, then the manifest.
fn write_captured(
    mut writer: SnapshotWriter,
    target: Target,
    captured: Captured,
) -> Result<Written, PersistError> {
    let dir = &target.dir;
    writer.write_file(STATE_FILE, &captured.state)?;
    writer.write_file(CONFIG_FILE, &target.config_json)?;
    let memory_pages = match captured.memory {
        Memory::Written { digest, pages } => {
            writer.add_memory_file(MEMORY_FILE, DigestKind::Pages, digest)?;
            pages
        }
        Memory::Layer(layer) => {
            let (name, digest, pages) = layer.finish()?;
            writer.add_memory_file(&name, DigestKind::LayerPages, digest)?;
            pages
        }
    };
    let mut disk_blocks = 0;
    for (_, layer) in captured.disks {
        if let Some(layer) = layer {
            let (name, digest, blocks) = layer.finish()?;
            disk_blocks += blocks;
            writer.add_memory_file(&name, DigestKind::LayerPages, digest)?;
        }
    }
    // Last: the checkpoint below may still be being written.
    let base = captured.base.resolve()?;
    writer.finish(
        HostIdentity::current(Flavour::detect().name()),
        env!("CARGO_PKG_VERSION"),
        MemoryLayout {
            size: target.memory_size,
            base,
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
    Snapshot::open(&base.dir).is_ok_and(|s| s.is_base_of(base))
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}
