//! Keeps every guest's serial log and its VMM's log. agentvmd removes a VM's directory when its VMM stops
//! (suspend, delete, fork parking), so the logs are hard-linked aside while the VMMs run:
//! the link keeps the file, and what the VMM writes later still lands in it.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

pub struct Collector {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    kept: PathBuf,
}

impl Collector {
    /// Watches `vms/*/serial.log` and `vms/*/vmm.log`, linking each new file into `kept`.
    pub fn start(vms: PathBuf, kept: PathBuf) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = stop.clone();
            let kept = kept.clone();
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    link_new_logs(&vms, &kept);
                    std::thread::sleep(Duration::from_millis(100));
                }
                link_new_logs(&vms, &kept);
            })
        };
        Self {
            stop,
            thread: Some(thread),
            kept,
        }
    }

    /// Stops watching and copies every kept log into `out`.
    pub fn finish(mut self, out: &Path) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::create_dir_all(out);
        if let Ok(entries) = std::fs::read_dir(&self.kept) {
            for e in entries.flatten() {
                let _ = std::fs::copy(e.path(), out.join(e.file_name()));
            }
        }
    }
}

/// One name per VM incarnation: the session and the log's inode.
fn link_new_logs(vms: &Path, kept: &Path) {
    let Ok(entries) = std::fs::read_dir(vms) else {
        return;
    };
    let _ = std::fs::create_dir_all(kept);
    for entry in entries.flatten() {
        // The guest's console, and its VMM's own log (what a failed scenario's VMM said).
        for file in ["serial.log", "vmm.log"] {
            let log = entry.path().join(file);
            let Ok(meta) = std::fs::symlink_metadata(&log) else {
                continue;
            };
            let name = format!(
                "{}-{}.{file}",
                entry.file_name().to_string_lossy(),
                meta.ino()
            );
            let target = kept.join(name);
            if !target.exists() {
                let _ = std::fs::hard_link(&log, &target);
            }
        }
    }
}
