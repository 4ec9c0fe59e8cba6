//! Disk pressure: the node keeps a reserve of free space in its state directory (journal,
//! snapshots) and its guest RAM directory, and refuses new work that would write there
//! (new sessions, snapshots, forks) once below it, so a filling disk degrades admission and
//! never a running session.

use std::path::{Path, PathBuf};

use tonic::Status;

/// The default reserve: room for a few snapshots' page writes and journal growth.
pub const DEFAULT_MIN_FREE_MIB: u64 = 256;

/// Bytes available to unprivileged writers on the filesystem holding `path`.
pub fn free_bytes(path: &Path) -> std::io::Result<u64> {
    let stat = nix::sys::statvfs::statvfs(path)?;
    Ok(stat.blocks_available().saturating_mul(stat.fragment_size()))
}

#[derive(Debug, Clone)]
pub struct DiskReserve {
    /// What each directory is for (`state`, `ram`) and where it is.
    pub dirs: Vec<(&'static str, PathBuf)>,
    pub min_free_bytes: u64,
}

impl DiskReserve {
    /// Free bytes of each directory (0 where it cannot be read).
    pub fn free(&self) -> Vec<(&'static str, u64)> {
        self.dirs
            .iter()
            .map(|(label, dir)| (*label, free_bytes(dir).unwrap_or(0)))
            .collect()
    }

    /// RESOURCE_EXHAUSTED naming the directory when `what` would write below the reserve.
    pub fn admit(&self, what: &str) -> Result<(), Status> {
        if self.min_free_bytes == 0 {
            return Ok(());
        }
        for (label, dir) in &self.dirs {
            let free = match free_bytes(dir) {
                Ok(free) => free,
                // Not there yet (nothing written to it): nothing to protect.
                Err(_) => continue,
            };
            if free < self.min_free_bytes {
                return Err(Status::resource_exhausted(format!(
                    "{what} refused: the {label} directory {} has {} MiB free, below the node's \
                     reserve of {} MiB (--min-free-disk-mib); running sessions go on",
                    dir.display(),
                    free >> 20,
                    self.min_free_bytes >> 20
                )));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_space_is_read_and_the_reserve_refuses_below_it() {
        let dir = tempfile::tempdir().unwrap();
        let free = free_bytes(dir.path()).unwrap();
        assert!(free > 0);
        let roomy = DiskReserve {
            dirs: vec![("state", dir.path().to_owned())],
            min_free_bytes: 1,
        };
        roomy.admit("a new session").unwrap();
        let tight = DiskReserve {
            min_free_bytes: free.saturating_mul(4).max(1 << 40),
            ..roomy
        };
        let refused = tight.admit("a new session").unwrap_err();
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
        assert!(refused.message().contains("state directory"), "{refused:?}");
        assert!(refused.message().contains("--min-free-disk-mib"));
        assert!(free_bytes(Path::new("/nonexistent/dir")).is_err());
    }
}
