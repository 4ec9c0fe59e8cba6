//! A restored VM's writable disk as a layer over its snapshots' copies of the disk
//! (`disk-N`): the VM's own file (the top) starts empty and holds only the 4 KiB blocks the
//! guest writes; every other block reads from the topmost snapshot layer holding it, else as
//! zeros. So a restore copies no disk data, and the next snapshot stores only what the VM
//! wrote since it was restored (a layer of its own, like its memory). The VMM's disk device
//! reads and writes through [`Layers`]; anyone else reads a restored disk the same way.
//!
//! A write that covers part of a block the top does not hold yet first copies the block up
//! from the layers, so the top always holds whole blocks and a block it holds is never read
//! from below.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

use crate::Snapshot;
use crate::manifest::DigestKind;
use crate::pages::{self, PAGE_SIZE};

/// The snapshot layers under one disk, and which blocks the top holds.
pub struct Layers {
    /// Read-only, base first.
    chain: Vec<File>,
    /// Block index → the topmost layer holding data there.
    owner: BTreeMap<u64, usize>,
    /// Blocks the top holds.
    written: BTreeSet<u64>,
}

impl Layers {
    /// `chain` (base first) under `top`, whose data extents are blocks it already holds.
    pub fn open(chain: Vec<File>, top: &File) -> io::Result<Self> {
        let owner = pages::owners(&chain)?;
        let mut written = BTreeSet::new();
        for (offset, len) in pages::data_extents(top)? {
            written.extend(offset / PAGE_SIZE..(offset + len).div_ceil(PAGE_SIZE));
        }
        Ok(Self {
            chain,
            owner,
            written,
        })
    }

    /// Fills `buf` with the disk's bytes at `offset`.
    pub fn read_at(&self, top: &File, buf: &mut [u8], offset: u64) -> io::Result<()> {
        for_blocks(buf.len(), offset, |at, range| {
            let piece = &mut buf[range];
            self.read_block_piece(top, piece, at)
        })
    }

    fn read_block_piece(&self, top: &File, piece: &mut [u8], at: u64) -> io::Result<()> {
        let block = at / PAGE_SIZE;
        if self.written.contains(&block) {
            return top.read_exact_at(piece, at);
        }
        match self.owner.get(&block) {
            Some(&layer) => read_or_zero(&self.chain[layer], piece, at),
            None => {
                piece.fill(0);
                Ok(())
            }
        }
    }

    /// Writes `buf` at `offset` into the top, copying up what it partly covers.
    pub fn write_at(&mut self, top: &File, buf: &[u8], offset: u64) -> io::Result<()> {
        for_blocks(buf.len(), offset, |at, range| {
            let piece = &buf[range];
            let block = at / PAGE_SIZE;
            let whole = at % PAGE_SIZE == 0 && piece.len() as u64 == PAGE_SIZE;
            if !whole && !self.written.contains(&block) {
                let start = block * PAGE_SIZE;
                let mut full = vec![0u8; PAGE_SIZE as usize];
                self.read_block_piece(top, &mut full, start)?;
                let from = (at - start) as usize;
                full[from..from + piece.len()].copy_from_slice(piece);
                top.write_all_at(&full, start)?;
            } else {
                top.write_all_at(piece, at)?;
            }
            self.written.insert(block);
            Ok(())
        })
    }

    /// The top as a snapshot layer in the empty `copy` (its blocks, stored zeros included:
    /// they hide what is below); returns the layer digest and block count.
    pub fn copy_top(&self, top: &File, copy: &File) -> io::Result<(String, u64)> {
        pages::copy_extents(top, copy)?;
        copy.sync_all()?;
        pages::layer_digest(copy)
    }

    /// The whole disk as it reads, `capacity` bytes, into the empty `copy` as a file of its
    /// own (non-zero blocks only); returns the page digest and page count.
    pub fn copy_merged(&self, top: &File, capacity: u64, copy: &File) -> io::Result<(String, u64)> {
        copy.set_len(capacity)?;
        let mut hasher = pages::PageHasher::default();
        let mut block = vec![0u8; PAGE_SIZE as usize];
        let held: BTreeSet<u64> = self
            .owner
            .keys()
            .chain(&self.written)
            .copied()
            .filter(|b| b * PAGE_SIZE < capacity)
            .collect();
        for index in held {
            self.read_block_piece(top, &mut block, index * PAGE_SIZE)?;
            if pages::is_zero(&block) {
                continue;
            }
            hasher.page(index, &block);
            copy.write_all_at(&block, index * PAGE_SIZE)?;
        }
        copy.sync_all()?;
        let count = hasher.pages();
        Ok((hasher.finish(), count))
    }
}

/// The files that make up writable disk `name` (`disk-N`) at the top of `chain` (top first,
/// as [`Snapshot::chain`] gives it): from the nearest snapshot holding a whole copy up to
/// the top, base first. Every snapshot above that copy holds a layer of the disk.
pub fn chain_files(chain: &[Snapshot], name: &str) -> Result<Vec<std::path::PathBuf>, String> {
    let mut layers = Vec::new();
    for snapshot in chain {
        match snapshot.manifest.files.get(name).map(|f| f.digest) {
            Some(DigestKind::LayerPages) => layers.push(snapshot.path(name)),
            Some(DigestKind::Pages) => {
                layers.push(snapshot.path(name));
                layers.reverse();
                return Ok(layers);
            }
            Some(DigestKind::Bytes) | None => {
                return Err(format!(
                    "snapshot {} holds no copy of {name} under the layers above it",
                    snapshot.dir.display()
                ));
            }
        }
    }
    Err(format!(
        "{name} is a layer all the way down its snapshot chain"
    ))
}

/// Fills `buf` with writable disk `name`'s bytes at `offset` as a VM restored from the
/// snapshot in `dir` onto the file `top` sees them (for inspecting a restored VM's disk).
pub fn read_restored(
    dir: &std::path::Path,
    name: &str,
    top: &std::path::Path,
    buf: &mut [u8],
    offset: u64,
) -> Result<(), String> {
    let chain = Snapshot::open(dir)
        .and_then(|s| s.chain())
        .map_err(|e| e.to_string())?;
    let files = chain_files(&chain, name)?
        .iter()
        .map(|p| File::open(p).map_err(|e| format!("{}: {e}", p.display())))
        .collect::<Result<Vec<_>, _>>()?;
    let top = File::open(top).map_err(|e| format!("{}: {e}", top.display()))?;
    let layers = Layers::open(files, &top).map_err(|e| e.to_string())?;
    layers.read_at(&top, buf, offset).map_err(|e| e.to_string())
}

/// Reads `piece` at `at`; bytes past the layer's end (a shorter file) read as zeros.
fn read_or_zero(file: &File, piece: &mut [u8], at: u64) -> io::Result<()> {
    let mut done = 0;
    while done < piece.len() {
        match file.read_at(&mut piece[done..], at + done as u64)? {
            0 => {
                piece[done..].fill(0);
                break;
            }
            n => done += n,
        }
    }
    Ok(())
}

/// Calls `f(disk offset, range of the buffer)` for each piece of `len` bytes from `offset`
/// that lies within one block.
fn for_blocks(
    len: usize,
    offset: u64,
    mut f: impl FnMut(u64, std::ops::Range<usize>) -> io::Result<()>,
) -> io::Result<()> {
    let mut done = 0usize;
    while done < len {
        let at = offset + done as u64;
        let room = (PAGE_SIZE - at % PAGE_SIZE) as usize;
        let n = room.min(len - done);
        f(at, done..done + n)?;
        done += n;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file_with(len: u64, blocks: &[(u64, u8)]) -> File {
        let f = tempfile::tempfile().unwrap();
        f.set_len(len).unwrap();
        for (index, byte) in blocks {
            f.write_all_at(&[*byte; PAGE_SIZE as usize], index * PAGE_SIZE)
                .unwrap();
        }
        f
    }

    fn read(layers: &Layers, top: &File, offset: u64, len: usize) -> Vec<u8> {
        let mut buf = vec![0xeeu8; len];
        layers.read_at(top, &mut buf, offset).unwrap();
        buf
    }

    #[test]
    fn reads_come_from_the_top_then_the_topmost_layer_then_zeros() {
        const LEN: u64 = 64 * PAGE_SIZE;
        let base = file_with(LEN, &[(1, 1), (2, 1), (3, 1)]);
        // The upper layer overrides block 2 and zeroes block 3 (a stored zero block).
        let upper = file_with(LEN, &[(2, 2), (3, 0)]);
        let top = file_with(LEN, &[]);
        let mut layers = Layers::open(vec![base, upper], &top).unwrap();
        assert_eq!(read(&layers, &top, PAGE_SIZE, 4096), vec![1u8; 4096]);
        assert_eq!(read(&layers, &top, 2 * PAGE_SIZE, 4096), vec![2u8; 4096]);
        assert_eq!(read(&layers, &top, 3 * PAGE_SIZE, 4096), vec![0u8; 4096]);
        assert_eq!(read(&layers, &top, 9 * PAGE_SIZE, 4096), vec![0u8; 4096]);

        // A 512-byte write into block 1 copies the block up first.
        layers
            .write_at(&top, &[7u8; 512], PAGE_SIZE + 1024)
            .unwrap();
        let got = read(&layers, &top, PAGE_SIZE, 4096);
        assert_eq!(&got[..1024], &[1u8; 1024]);
        assert_eq!(&got[1024..1536], &[7u8; 512]);
        assert_eq!(&got[1536..], &[1u8; 2560]);
        // A write across a block boundary, into an empty block and a held one.
        layers
            .write_at(&top, &[9u8; 1024], 5 * PAGE_SIZE - 512)
            .unwrap();
        let got = read(&layers, &top, 4 * PAGE_SIZE, 2 * 4096);
        assert_eq!(&got[..4096 - 512], &vec![0u8; 4096 - 512][..]);
        assert_eq!(&got[4096 - 512..4096 + 512], &[9u8; 1024]);
        assert_eq!(&got[4096 + 512..], &vec![0u8; 4096 - 512][..]);

        // The layer holds the blocks written (1, 4, 5), the merged copy the disk.
        let layer = tempfile::tempfile().unwrap();
        let (_, blocks) = layers.copy_top(&top, &layer).unwrap();
        assert_eq!(blocks, 3);
        let merged = tempfile::tempfile().unwrap();
        let (digest, pages_held) = layers.copy_merged(&top, LEN, &merged).unwrap();
        assert_eq!(pages_held, 4, "blocks 1, 2, 4 and 5; 3 is zero");
        assert_eq!((digest, pages_held), pages::file_digest(&merged).unwrap());
        let mut block = vec![0u8; 4096];
        merged.read_exact_at(&mut block, 2 * PAGE_SIZE).unwrap();
        assert_eq!(block, vec![2u8; 4096]);
    }

    #[test]
    fn a_reopened_top_knows_the_blocks_it_holds() {
        const LEN: u64 = 16 * PAGE_SIZE;
        let base = file_with(LEN, &[(0, 1)]);
        let top = file_with(LEN, &[]);
        let mut layers = Layers::open(vec![base.try_clone().unwrap()], &top).unwrap();
        layers.write_at(&top, &[5u8; 4096], 0).unwrap();
        let reopened = Layers::open(vec![base], &top).unwrap();
        assert_eq!(read(&reopened, &top, 0, 4096), vec![5u8; 4096]);
    }
}
