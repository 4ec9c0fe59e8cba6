//! Checkpoint benchmarks on real /dev/kvm with the test guest. Prints min/median/max.
//!
//! `cargo bench -p agentvm-vmm --bench checkpoints`
//!
//! For a 256 MiB guest that writes N MiB between checkpoints (N = 1, 16, 64):
//! - the pause per checkpoint (what the guest, and a turn waiting on it, loses), the call's
//!   time and the time until the checkpoint is durable;
//! - pages stored per checkpoint against pages the guest wrote;
//! - the guest's write of N MiB with KVM's dirty log on (after a checkpoint) against the
//!   same write without it;
//! - restore → first frame from the latest checkpoint against one ten layers below it.

#[path = "../tests/support/mod.rs"]
mod support;

use std::path::{Path, PathBuf};
use std::time::Instant;

use support::{GuestLink, Vmm, ms, summary};

const PORT: u32 = 1024;

fn shm_dir() -> tempfile::TempDir {
    match std::env::var_os("AGENTVM_BENCH_CHECKPOINT_DIR") {
        Some(dir) => tempfile::tempdir_in(dir).unwrap(),
        None => tempfile::tempdir_in("/dev/shm").unwrap_or_else(|_| tempfile::tempdir().unwrap()),
    }
}

fn new_dir(parent: &Path, name: &str) -> PathBuf {
    let dir = parent.join(name);
    std::fs::create_dir(&dir).unwrap();
    dir
}

/// Restore from `dir` until the guest answers a frame.
async fn restore_to_first_frame(dir: &Path) -> f64 {
    let started = Instant::now();
    let child = Vmm::spawn().await;
    child.restore(dir).await;
    let mut link = GuestLink::connect_ready(&child.vsock_socket(), PORT);
    link.counter_turn(1, "x");
    let elapsed = ms(started.elapsed());
    child.shutdown().await;
    elapsed
}

#[tokio::main]
async fn main() {
    let quick = !std::env::args().any(|a| a == "--bench");
    if let Some(reason) = support::kvm_unavailable() {
        println!("SKIPPED: {reason}; the checkpoint benchmarks need KVM");
        return;
    }
    let rounds = if quick { 2 } else { 20 };
    println!("VMM binary: {}", support::vmm_bin().display());
    let store = shm_dir();

    for mib in [1u32, 16, 64] {
        let vmm = Vmm::spawn().await;
        vmm.boot(&vmm.config(1, 256, "")).await;
        let mut link = GuestLink::connect_ready(&vmm.vsock_socket(), PORT);
        // Touched once, so the timed writes below find their pages mapped.
        link.dirty(mib, 1);
        let mut plain_write = Vec::new();
        for round in 0..rounds {
            let started = Instant::now();
            link.dirty(mib, 2 + round);
            plain_write.push(ms(started.elapsed()));
        }
        let first_dir = new_dir(store.path(), &format!("{mib}-first"));
        vmm.client.checkpoint(&first_dir, None).await.unwrap();
        let first = vmm.client.checkpoint_wait(None).await.unwrap();
        let mut paused = Vec::new();
        let mut call = Vec::new();
        let mut precopy = Vec::new();
        let mut durable = Vec::new();
        let mut stored_per_written = Vec::new();
        let mut logged_write = Vec::new();
        let mut dirs = Vec::new();
        for round in 0..rounds {
            let started = Instant::now();
            link.dirty(mib, 100 + round);
            logged_write.push(ms(started.elapsed()));
            link.counter_turn(u64::from(round) + 1, "turn");
            let dir = new_dir(store.path(), &format!("{mib}-{round}"));
            let started = Instant::now();
            let taken = vmm.client.checkpoint(&dir, None).await.unwrap();
            call.push(ms(started.elapsed()));
            let report = vmm.client.checkpoint_wait(None).await.unwrap();
            durable.push(ms(started.elapsed()));
            assert!(report.incremental || report.chain_depth == 1, "{report:?}");
            paused.push(taken.paused_us as f64 / 1e3);
            precopy.push(taken.precopy_us as f64 / 1e3);
            stored_per_written.push(report.memory_pages as f64 / f64::from(mib * 256));
            dirs.push(dir);
        }
        println!(
            "== {mib} MiB written between checkpoints (first checkpoint: {} pages, paused {:.2} ms)",
            first.memory_pages,
            first.paused_us as f64 / 1e3
        );
        summary("  checkpoint pause", "ms", paused);
        summary("  pre-copy (VM running)", "ms", precopy);
        summary("  vm.checkpoint call (VM running again)", "ms", call);
        summary("  until durable", "ms", durable);
        summary("  pages stored / pages written", "x", stored_per_written);
        summary("  guest writes N MiB, no dirty log", "ms", plain_write);
        summary("  guest writes N MiB, dirty log on", "ms", logged_write);
        if mib == 16 && dirs.len() > 10 {
            let head = dirs.last().unwrap().clone();
            let past = dirs[dirs.len() - 11].clone();
            let (mut at_head, mut at_past) = (Vec::new(), Vec::new());
            for _ in 0..rounds {
                at_head.push(restore_to_first_frame(&head).await);
                at_past.push(restore_to_first_frame(&past).await);
            }
            summary("  restore → first frame, latest checkpoint", "ms", at_head);
            summary(
                "  restore → first frame, ten checkpoints back",
                "ms",
                at_past,
            );
        }
        drop(link);
        vmm.shutdown().await;
    }
}
