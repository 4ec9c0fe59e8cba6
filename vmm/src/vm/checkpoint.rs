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

enum Memory {
    /// Pages (memory-file indices, in order) and their contents, page after page.
    Staged {
        pages: Vec<u64>,
        bytes: Vec<u8>,
        /// Leave out zero pages no file of the chain holds: a page the guest only read
        /// since it was restored maps the zero page, which looks changed but is not.
        skip_unbacked_zeros: Option<std::collections::BTreeSet<u64>>,
    },
    /// Already in the directory: the RAM file linked (or copied) as `vm.fork` does.
    Written { digest: String, pages: u64 },
}

impl Vm {
    /// Writes a checkpoint of this running VM into `dir` (existing, without a snapshot) and
    /// leaves it running. See the module comment.
    pub fn checkpoint(
        &mut self,
        dir: &Path,
        config_json: &[u8],
    ) -> Result<VmCheckpointReport, PersistError> {
        let started = Instant::now();
        // Before the pause: turning the log on changes the memory slots, which may wait
        // out a grace period in KVM.
        self.kvm
            .log_dirty_pages(&self.ram)
            .map_err(|e| PersistError::Mismatch(format!("dirty page logging: {e}")))?;
        let mut writer = SnapshotWriter::create(dir, true)?;
        let previous = self
            .last_checkpoint
            .clone()
            .filter(|last| last.depth < CHECKPOINT_DEPTH && still_there(&last.base));
        let paused_at = Instant::now();
        self.pause()
            .map_err(|e| PersistError::Mismatch(format!("pausing for the checkpoint: {e}")))?;
        let (captured, paused) = match self.capture(&mut writer, dir, previous.as_ref()) {
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
        let captured = match captured {
            Ok(captured) => captured,
            Err(e) => {
                // What the next checkpoint would layer on is unknown now: start afresh.
                self.last_checkpoint = None;
                return Err(e);
            }
        };
        let depth = previous.as_ref().map_or(1, |last| last.depth + 1);
        let written = self.write_captured(writer, dir, config_json, captured);
        let (manifest, memory_pages, disk_blocks) = match written {
            Ok(done) => done,
            Err(e) => {
                self.last_checkpoint = None;
                return Err(e);
            }
        };
        let snapshot = Snapshot::open(dir)?;
        debug_assert_eq!(snapshot.manifest.memory.base, manifest.memory.base);
        self.last_checkpoint = Some(LastCheckpoint {
            base: snapshot.base_ref(),
            depth,
        });
        let report = VmCheckpointReport {
            memory_pages,
            disk_blocks,
            paused_us: micros(paused),
            elapsed_us: micros(started.elapsed()),
            incremental: previous.is_some(),
            chain_depth: snapshot.chain().map_or(0, |c| c.len() as u32),
        };
        tracing::info!(?report, dir = %dir.display(), "checkpoint written");
        Ok(report)
    }

    /// Everything that needs the VM paused. Returns when the VM was resumed, if it was
    /// (a linked RAM file lets it run again before the file's digest is taken).
    fn capture(
        &mut self,
        writer: &mut SnapshotWriter,
        dir: &Path,
        previous: Option<&LastCheckpoint>,
    ) -> Result<(Captured, Option<Instant>), PersistError> {
        let mut state = self.save_state()?;
        state.streams_live = true;
        let state = state.to_json()?;
        let mut resumed_at = None;
        let (memory, disks, base) = match previous {
            Some(last) => {
                let guest = self
                    .kvm
                    .take_dirty_log(&self.ram)
                    .map_err(|e| PersistError::Mismatch(format!("dirty page log: {e}")))?;
                let pages = self.ram.dirty_file_pages(&guest);
                let bytes = self.ram.stage_pages(&pages)?;
                let mut disks = Vec::new();
                for (index, disk) in self.disks.iter().enumerate() {
                    let mut transport = lock_disk(&disk.device);
                    let block = transport.device_mut();
                    if block.read_only() {
                        continue;
                    }
                    let blocks =
                        block
                            .take_written_blocks()
                            .map_err(|source| PersistError::DiskCopy {
                                path: block.path().to_owned(),
                                source,
                            })?;
                    match blocks {
                        Some(blocks) => disks.push((index, Some(blocks))),
                        None => {
                            return Err(PersistError::Mismatch(format!(
                                "disk {index} counted no writes since the last checkpoint"
                            )));
                        }
                    }
                }
                let memory = Memory::Staged {
                    pages,
                    bytes,
                    skip_unbacked_zeros: None,
                };
                (memory, disks, Some(last.base.clone()))
            }
            None => {
                // What the next checkpoint stores starts now, for the guest, its devices
                // and disks: before anything below may let the VM run again.
                self.start_tracking()?;
                match self.ram.backing().clone() {
                    Backing::Private { top } => {
                        let top = Snapshot::open(&top)?;
                        let chain = top.chain()?;
                        let files: Vec<PathBuf> =
                            chain.iter().map(|s| s.path(MEMORY_FILE)).collect();
                        let pages = self.ram.changed_file_pages()?;
                        let bytes = self.ram.stage_pages(&pages)?;
                        let backed = agentvm_snapshot::pages::owners(
                            &files
                                .iter()
                                .map(File::open)
                                .collect::<Result<Vec<_>, _>>()
                                .map_err(|source| PersistError::DiskCopy {
                                    path: top.dir.clone(),
                                    source,
                                })?,
                        )
                        .map_err(|source| PersistError::DiskCopy {
                            path: top.dir.clone(),
                            source,
                        })?
                        .into_keys()
                        .collect();
                        self.copy_disks(writer, true)?;
                        let memory = Memory::Staged {
                            pages,
                            bytes,
                            skip_unbacked_zeros: Some(backed),
                        };
                        (memory, self.copied_disks(), Some(top.base_ref()))
                    }
                    Backing::Own => {
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
                        (Memory::Written { digest, pages }, self.copied_disks(), None)
                    }
                }
            }
        };
        Ok((
            Captured {
                state,
                memory,
                disks,
                base,
            },
            resumed_at,
        ))
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

    /// Writes what was captured, with the VM running. Returns the manifest and how many
    /// pages and disk blocks the checkpoint stores.
    fn write_captured(
        &self,
        mut writer: SnapshotWriter,
        dir: &Path,
        config_json: &[u8],
        captured: Captured,
    ) -> Result<(agentvm_snapshot::Manifest, u64, u64), PersistError> {
        writer.write_file(STATE_FILE, &captured.state)?;
        writer.write_file(CONFIG_FILE, config_json)?;
        let (kind, digest, memory_pages) = match captured.memory {
            Memory::Written { digest, pages } => (DigestKind::Pages, digest, pages),
            Memory::Staged {
                pages,
                bytes,
                skip_unbacked_zeros,
            } => {
                let path = dir.join(MEMORY_FILE);
                let (digest, stored) = write_layer(
                    &path,
                    self.ram.size(),
                    pages
                        .iter()
                        .copied()
                        .zip(bytes.chunks_exact(PAGE_SIZE as usize))
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
            let capacity = lock_disk(&self.disks[index].device).device().capacity();
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
        let manifest = writer.finish(
            HostIdentity::current(Flavour::detect().name()),
            env!("CARGO_PKG_VERSION"),
            MemoryLayout {
                size: self.ram.size(),
                base: captured.base,
            },
        )?;
        Ok((manifest, memory_pages, disk_blocks))
    }
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

/// The previous checkpoint is still where it was written, unchanged: else the next one
/// cannot be layered on it.
fn still_there(base: &BaseRef) -> bool {
    Snapshot::open(&base.dir).is_ok_and(|s| s.manifest_sha256 == base.manifest_sha256)
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}
