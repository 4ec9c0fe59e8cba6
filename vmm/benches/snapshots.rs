//! Snapshot, restore and fork benchmarks on real /dev/kvm with the test guest. Prints
//! min/median/max.
//!
//! `AGENTVM_VMM_BIN=$(scripts/build-vmm.sh) cargo bench -p agentvm-vmm --bench snapshots`
//!
//! - `vm.snapshot` of a 256 MiB guest with 64 MiB written (copied to disk, fsynced), and
//!   `vm.fork` of the same (memory linked, nothing copied);
//! - `vm.restore` call, and spawn → first frame answered after a restore; and restore →
//!   first frame on a VMM spawned ahead of time (a warm pool: its KVM VM is prepared);
//! - k-way fork (k = 1, 16, 64, 128): spawn k VMMs, restore each from the fork, until every
//!   child has answered a frame;
//! - host memory per idle child: PSS and private (unshared) memory of its VMM process;
//! - the same guest with a 1 GiB workspace disk holding 64 MiB of data: `vm.snapshot` (the
//!   disk's data copied into the snapshot too) and `vm.restore` (copied out to the clone's
//!   own file).

#[path = "../tests/support/mod.rs"]
mod support;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use support::{GuestLink, Vmm, ms, summary};

/// Snapshots live next to guest RAM (tmpfs) so forks can link; disk snapshots in a tempdir.
fn shm_dir() -> tempfile::TempDir {
    tempfile::tempdir_in("/dev/shm").unwrap_or_else(|_| tempfile::tempdir().unwrap())
}

fn new_dir(parent: &Path, name: &str) -> PathBuf {
    let dir = parent.join(name);
    std::fs::create_dir(&dir).unwrap();
    dir
}

/// A paused 256 MiB guest with 64 MiB stamped and its counter at 1.
async fn dirty_paused_guest() -> Vmm {
    let vmm = Vmm::spawn().await;
    vmm.boot(&vmm.config(1, 256, "")).await;
    let mut link = GuestLink::connect_ready(&vmm.vsock_socket(), 1024);
    link.counter_turn(1, "e1");
    link.dirty(64, 0xbe_0000);
    drop(link);
    vmm.client.pause().await.unwrap();
    vmm
}

/// A 1 GiB disk image in `dir` whose first `data_mib` MiB hold data (the rest a hole).
fn disk_with_data(dir: &Path, data_mib: usize) -> PathBuf {
    use std::io::Write;
    let path = dir.join("workspace.img");
    let mut file = std::fs::File::create(&path).unwrap();
    let block: Vec<u8> = (0..1 << 20).map(|i| (i % 251) as u8 + 1).collect();
    for _ in 0..data_mib {
        file.write_all(&block).unwrap();
    }
    file.set_len(1 << 30).unwrap();
    path
}

/// (private, PSS) KiB of a process, from smaps_rollup.
fn memory_kib(pid: u32) -> (u64, u64) {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap_or_default();
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    (
        field("Private_Clean:") + field("Private_Dirty:"),
        field("Pss:"),
    )
}

async fn restore_and_answer(base: &Path) -> (Vmm, GuestLink) {
    let child = Vmm::spawn().await;
    child.restore(base).await;
    let socket = child.vsock_socket();
    let link = tokio::task::spawn_blocking(move || GuestLink::connect_ready(&socket, 1024))
        .await
        .unwrap();
    (child, link)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let quick = !std::env::args().any(|a| a == "--bench");
    if let Some(reason) = support::kvm_unavailable() {
        println!("SKIPPED: {reason}; the snapshot benchmarks need KVM");
        return;
    }
    let runs = if quick { 1 } else { 10 };
    println!("VMM binary: {}", support::vmm_bin().display());

    let disk = tempfile::tempdir().unwrap();
    let shm = shm_dir();
    let mut snapshot_ms = Vec::new();
    let mut fork_ms = Vec::new();
    let mut snapshot_dir = None;
    for run in 0..runs {
        let vmm = dirty_paused_guest().await;
        let dir = new_dir(disk.path(), &format!("snap-{run}"));
        let start = Instant::now();
        vmm.client.snapshot(&dir).await.unwrap();
        snapshot_ms.push(ms(start.elapsed()));
        let fork = new_dir(shm.path(), &format!("fork-{run}"));
        let start = Instant::now();
        vmm.client.fork(&fork, false).await.unwrap();
        fork_ms.push(ms(start.elapsed()));
        snapshot_dir.get_or_insert(dir);
        vmm.shutdown().await;
    }
    summary(
        "vm.snapshot, 256 MiB guest, 64 MiB written (fsync)",
        "ms",
        snapshot_ms,
    );
    summary("vm.fork, same guest (RAM linked)", "ms", fork_ms);

    // The same guest with a workspace disk: what its data adds to a snapshot and a restore.
    let mut disk_snapshot_ms = Vec::new();
    let mut disk_restore_ms = Vec::new();
    for run in 0..runs {
        let scratch = tempfile::tempdir_in(disk.path()).unwrap();
        let image = disk_with_data(scratch.path(), 64);
        let vmm = Vmm::spawn().await;
        let mut config = vmm.config(1, 256, "");
        config.disks = vec![agentvm_vmm_api::config::DiskConfig {
            path: image,
            readonly: false,
            id: None,
            serial: Some("workspace".into()),
        }];
        vmm.boot(&config).await;
        vmm.client.pause().await.unwrap();
        let dir = new_dir(scratch.path(), &format!("disk-snap-{run}"));
        let start = Instant::now();
        vmm.client.snapshot(&dir).await.unwrap();
        disk_snapshot_ms.push(ms(start.elapsed()));
        vmm.shutdown().await;
        let clone = Vmm::spawn().await;
        let request = agentvm_vmm_api::types::RestoreConfig {
            source_url: format!("file://{}", dir.display()),
            vsock_socket: Some(clone.vsock_socket()),
            serial_file: Some(clone.serial_log()),
            disk_paths: vec![scratch.path().join("clone.img")],
            ..Default::default()
        };
        let start = Instant::now();
        clone.client.restore(&request).await.unwrap();
        disk_restore_ms.push(ms(start.elapsed()));
        clone.shutdown().await;
    }
    summary(
        "vm.snapshot, 256 MiB guest + 1 GiB disk, 64 MiB of disk data",
        "ms",
        disk_snapshot_ms,
    );
    summary(
        "vm.restore of it (the clone's disk a layer over the snapshot's copy)",
        "ms",
        disk_restore_ms,
    );

    // A live fork: with `resume` the VM runs again once its RAM is frozen, and answers while
    // the VMM still takes the fork's digests.
    let mut answered_ms = Vec::new();
    for run in 0..runs {
        let vmm = dirty_paused_guest().await;
        let fork = new_dir(shm.path(), &format!("live-fork-{run}"));
        let client = vmm.client.clone();
        let start = Instant::now();
        let forking = tokio::spawn(async move { client.fork(&fork, true).await });
        let socket = vmm.vsock_socket();
        let answered = tokio::task::spawn_blocking(move || {
            GuestLink::connect_ready(&socket, 1024);
            start.elapsed()
        })
        .await
        .unwrap();
        forking.await.unwrap().unwrap();
        answered_ms.push(ms(answered));
        vmm.shutdown().await;
    }
    summary(
        "vm.fork {resume}: fork start -> VM answers again",
        "ms",
        answered_ms,
    );

    // Restores of one snapshot (on disk; its pages come from the page cache after the first).
    let snapshot_dir = snapshot_dir.unwrap();
    let mut restore_call = Vec::new();
    let mut spawn_to_answer = Vec::new();
    for _ in 0..runs.max(2) * 2 {
        let start = Instant::now();
        let child = Vmm::spawn().await;
        let call = Instant::now();
        child.restore(&snapshot_dir).await;
        restore_call.push(ms(call.elapsed()));
        let socket = child.vsock_socket();
        let _link = tokio::task::spawn_blocking(move || GuestLink::connect_ready(&socket, 1024))
            .await
            .unwrap();
        spawn_to_answer.push(ms(start.elapsed()));
        child.shutdown().await;
    }
    summary(
        "vm.restore call (256 MiB, 64 MiB written)",
        "ms",
        restore_call,
    );
    summary(
        "spawn -> restore -> first frame answered",
        "ms",
        spawn_to_answer,
    );
    let mut warm = Vec::new();
    for _ in 0..runs.max(2) * 2 {
        let child = Vmm::spawn().await;
        // Spawned ahead of time: its background KVM VM preparation is done.
        tokio::time::sleep(Duration::from_millis(30)).await;
        let start = Instant::now();
        child.restore(&snapshot_dir).await;
        let socket = child.vsock_socket();
        let _link = tokio::task::spawn_blocking(move || GuestLink::connect_ready(&socket, 1024))
            .await
            .unwrap();
        warm.push(ms(start.elapsed()));
        child.shutdown().await;
    }
    summary("warm VMM: restore -> first frame answered", "ms", warm);

    // Fan-out from one running parent.
    let parent = dirty_paused_guest().await;
    let base = new_dir(shm.path(), "fanout");
    parent.client.fork(&base, false).await.unwrap();
    parent.client.resume().await.unwrap();
    let widths: &[usize] = if quick { &[1, 4] } else { &[1, 16, 64, 128] };
    for &k in widths {
        let start = Instant::now();
        let mut set = tokio::task::JoinSet::new();
        for _ in 0..k {
            let base = base.clone();
            set.spawn(async move { restore_and_answer(&base).await });
        }
        let mut children = Vec::with_capacity(k);
        while let Some(done) = set.join_next().await {
            children.push(done.unwrap());
        }
        let wall = start.elapsed();
        println!(
            "{:<50} {:>9.2} ms  ({:.2} ms per child)",
            format!("{k}-way fork: spawn -> all children answered"),
            ms(wall),
            ms(wall) / k as f64
        );
        if k == *widths.last().unwrap() {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let (private, pss): (Vec<f64>, Vec<f64>) = children
                .iter()
                .map(|(vmm, _)| {
                    let (private, pss) = memory_kib(vmm.pid());
                    (private as f64 / 1024.0, pss as f64 / 1024.0)
                })
                .unzip();
            summary(
                &format!("idle child of a {k}-way fork: private memory"),
                "MiB",
                private,
            );
            summary(&format!("idle child of a {k}-way fork: PSS"), "MiB", pss);
        }
        for (child, link) in children {
            drop(link);
            child.shutdown().await;
        }
    }
    parent.shutdown().await;
}
