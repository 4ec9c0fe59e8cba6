//! What a failed VM start leaves for diagnosis. A start that fails removes its VMM and
//! directory (nothing half-made is kept), yet the guest's serial console is the only
//! witness of why a kernel did not boot or an agent did not answer: its tail is kept in the
//! node's `failed-starts/` directory, the newest few only, and the error names the file.
//!
//! The console file is the VMM's (its uid can replace it): it is opened without following
//! links, only as a regular file, and read from its end, never whole.

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// The most of a console kept (its end).
const KEEP_BYTES: u64 = 256 << 10;
/// Logs kept; older ones go as new ones come.
const KEEP_LOGS: usize = 32;

/// The last `KEEP_BYTES` of the console log at `serial`, if it is a regular file.
pub fn console_tail(serial: &Path) -> Option<Vec<u8>> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(serial)
        .ok()?;
    let meta = file.metadata().ok()?;
    if !meta.is_file() {
        return None;
    }
    file.seek(SeekFrom::Start(meta.len().saturating_sub(KEEP_BYTES)))
        .ok()?;
    let mut tail = Vec::new();
    file.take(KEEP_BYTES).read_to_end(&mut tail).ok()?;
    Some(tail)
}

/// Its last `n` lines, newest first, joined for one error message.
pub fn last_lines(tail: &[u8], n: usize) -> String {
    String::from_utf8_lossy(tail)
        .lines()
        .rev()
        .filter(|l| !l.trim().is_empty())
        .take(n)
        .collect::<Vec<_>>()
        .join(" | ")
}

/// Keeps `tail` as `dir/SESSION.serial.log` (a session's latest failed start; readable by
/// root only: a guest's console may hold anything), then drops all but the newest
/// `KEEP_LOGS`; returns its path. The same path for every failure of a session keeps the
/// errors that name it alike (a failure recorded once is recognised by its text).
pub fn keep(dir: &Path, session: &str, tail: &[u8]) -> std::io::Result<PathBuf> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    let path = dir.join(format!("{session}.serial.log"));
    std::io::Write::write_all(
        &mut std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&path)?,
        tail,
    )?;
    prune(dir);
    Ok(path)
}

fn prune(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut logs: Vec<(std::time::SystemTime, PathBuf)> = entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".serial.log"))
        .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
        .collect();
    logs.sort();
    let excess = logs.len().saturating_sub(KEEP_LOGS);
    for (_, path) in logs.into_iter().take(excess) {
        let _ = std::fs::remove_file(path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tail_of_a_console_is_kept_and_only_the_newest_logs() {
        let dir = tempfile::tempdir().unwrap();
        let serial = dir.path().join("serial.log");
        let mut text = "x".repeat(KEEP_BYTES as usize);
        text.push_str("\nKernel panic - not syncing: VFS\n\n");
        std::fs::write(&serial, &text).unwrap();
        let tail = console_tail(&serial).unwrap();
        assert_eq!(tail.len() as u64, KEEP_BYTES);
        assert!(tail.ends_with(b"VFS\n\n"));
        assert!(last_lines(&tail, 1).starts_with("Kernel panic"));

        let kept = dir.path().join("failed-starts");
        let mut paths = Vec::new();
        for i in 0..KEEP_LOGS + 3 {
            paths.push(keep(&kept, &format!("sess-{i}"), &tail).unwrap());
            // Distinct modification times order the logs.
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        assert_eq!(std::fs::read_dir(&kept).unwrap().count(), KEEP_LOGS);
        assert!(!paths[0].exists(), "the oldest went");
        assert_eq!(std::fs::read(paths.last().unwrap()).unwrap(), tail);
    }

    #[test]
    fn a_console_replaced_by_a_link_or_a_fifo_is_not_read() {
        let dir = tempfile::tempdir().unwrap();
        let secret = dir.path().join("secret");
        std::fs::write(&secret, "root's").unwrap();
        let link = dir.path().join("serial.log");
        std::os::unix::fs::symlink(&secret, &link).unwrap();
        assert_eq!(console_tail(&link), None);
        let fifo = dir.path().join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        assert_eq!(console_tail(&fifo), None, "and does not hang");
    }
}
