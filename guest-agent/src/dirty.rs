//! The DirtyMemory hook, as the agent serves it: the test guest stamps pages of guest RAM;
//! the agent stamps pages of a region of its own memory. Either way the host can make a
//! guest use memory on demand, and a restored or forked guest can show that its memory is
//! the snapshot's (the previous call's stamps are checked before new ones are written).

/// One stamped word per page of this size.
const PAGE: usize = 4096;
const PAGES_PER_MIB: usize = (1 << 20) / PAGE;

/// The agent's dirty region and what the last stamping call wrote into it.
#[derive(Default)]
pub struct DirtyRegion {
    memory: Vec<u8>,
    /// Pages the last stamping call covered, and its stamp.
    covered: usize,
    stamp: u32,
}

fn word(memory: &[u8], page: usize) -> u32 {
    let at = page * PAGE;
    u32::from_le_bytes([memory[at], memory[at + 1], memory[at + 2], memory[at + 3]])
}

impl DirtyRegion {
    /// Checks the pages the previous stamping call covered, then (unless `stamp` is 0, verify
    /// only) stamps page i of `mebibytes` MiB with `stamp ^ i`, growing the region by at most
    /// `spare_pages`. Returns the pages visited and the mismatches found.
    pub fn apply(&mut self, mebibytes: u32, stamp: u32, spare_pages: usize) -> (u32, u32) {
        let held = self.memory.len() / PAGE;
        let pages = (mebibytes as usize)
            .saturating_mul(PAGES_PER_MIB)
            .min(held.saturating_add(spare_pages))
            .min(u32::MAX as usize);
        let mismatched = (0..self.covered)
            .filter(|&i| word(&self.memory, i) != self.stamp ^ i as u32)
            .count();
        if stamp != 0 {
            if pages > held {
                self.memory.resize(pages * PAGE, 0);
            }
            for i in 0..pages {
                let at = i * PAGE;
                self.memory[at..at + 4].copy_from_slice(&(stamp ^ i as u32).to_le_bytes());
            }
            self.covered = pages;
            self.stamp = stamp;
        }
        (pages as u32, mismatched as u32)
    }
}

/// Pages the region may still grow by: half the memory the kernel has free, so the hook can
/// never make the agent (PID 1 in a guest) the OOM killer's victim.
pub fn spare_pages() -> usize {
    let Ok(info) = nix::sys::sysinfo::sysinfo() else {
        return 0;
    };
    (info.ram_unused() / 2 / PAGE as u64) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamps_are_checked_by_the_next_call() {
        let mut region = DirtyRegion::default();
        // Nothing stamped yet: nothing to compare.
        assert_eq!(region.apply(2, 7, usize::MAX), (512, 0));
        // Verify only: all match, and nothing changes what the next call compares.
        assert_eq!(region.apply(2, 0, usize::MAX), (512, 0));
        region.memory[5 * PAGE] ^= 1;
        region.memory[300 * PAGE + 3] ^= 0x80;
        assert_eq!(region.apply(1, 0, usize::MAX), (256, 2));
        // A new stamp: the old one is checked first, then 1 MiB is restamped.
        assert_eq!(region.apply(1, 9, usize::MAX), (256, 2));
        assert_eq!(region.apply(1, 0, usize::MAX), (256, 0));
        assert_eq!(word(&region.memory, 3), 9 ^ 3);
    }

    #[test]
    fn growth_is_bounded_by_the_spare_pages() {
        let mut region = DirtyRegion::default();
        assert_eq!(region.apply(4, 1, 300), (300, 0));
        assert_eq!(region.memory.len(), 300 * PAGE);
        // What it holds can be restamped without spare memory.
        assert_eq!(region.apply(4, 2, 0), (300, 0));
        assert!(spare_pages() > 0);
    }
}
