//! Checkpoints of a running VM on real /dev/kvm with the test guest: each holds only what
//! changed since the one before, the VM runs on with its vsock streams open, and a VM
//! restored from any of them is the guest as it was at that checkpoint.

mod support;

use std::path::{Path, PathBuf};

use agentvm_snapshot::manifest::MEMORY_FILE;
use agentvm_vmm_api::types::VmCheckpointReport;
use support::{GuestLink, Vmm};

const PORT: u32 = agentvm_proto::guest::GUEST_AGENT_PORT;

fn store() -> tempfile::TempDir {
    match tempfile::tempdir_in("/dev/shm") {
        Ok(dir) => dir,
        Err(_) => tempfile::tempdir().unwrap(),
    }
}

async fn checkpoint(vmm: &Vmm, store: &Path, name: &str) -> (PathBuf, VmCheckpointReport) {
    checkpoint_on(vmm, store, name, None).await
}

/// A checkpoint layered on the last one, which was moved to `base`.
async fn checkpoint_on(
    vmm: &Vmm,
    store: &Path,
    name: &str,
    base: Option<&Path>,
) -> (PathBuf, VmCheckpointReport) {
    let dir = store.join(name);
    std::fs::create_dir(&dir).unwrap();
    let taken = vmm
        .client
        .checkpoint(&dir, base)
        .await
        .expect("vm.checkpoint");
    assert!(!taken.durable);
    let report = vmm
        .client
        .checkpoint_wait(None)
        .await
        .expect("vm.checkpoint-wait");
    assert!(report.durable);
    assert_eq!(
        (taken.paused_us, taken.incremental),
        (report.paused_us, report.incremental)
    );
    assert!(dir.join("manifest.json").exists());
    (dir, report)
}

/// A VM restored from `dir`, told so, with its link. Restored paused and then resumed, as
/// agentvmd does.
async fn restored(dir: &Path, generation: u64) -> (Vmm, GuestLink) {
    let vmm = Vmm::spawn().await;
    let request = agentvm_vmm_api::types::RestoreConfig {
        source_url: format!("file://{}", dir.display()),
        memory_restore_mode: agentvm_vmm_api::types::MemoryRestoreMode::OnDemand,
        resume: false,
        vsock_socket: Some(vmm.vsock_socket()),
        serial_file: Some(vmm.serial_log()),
        ..Default::default()
    };
    vmm.client.restore(&request).await.expect("vm.restore");
    vmm.client.resume().await.expect("vm.resume");
    let mut link = GuestLink::connect_ready(&vmm.vsock_socket(), PORT);
    assert_eq!(link.restored(true, generation, "child"), generation);
    (vmm, link)
}

#[tokio::test]
async fn each_checkpoint_holds_what_changed_and_restores_the_guest_as_it_was() {
    require_kvm!();
    let vmm = Vmm::spawn().await;
    vmm.boot(&vmm.config(1, 256, "")).await;
    let mut link = GuestLink::connect_ready(&vmm.vsock_socket(), PORT);
    assert_eq!(link.counter_turn(1, "e1"), "1");
    assert_eq!(link.counter_turn(2, "e2"), "2");
    let store = store();

    // The first of a booted VM: its RAM, linked.
    let (first, report) = checkpoint(&vmm, store.path(), "c1").await;
    assert!(!report.incremental);
    assert_eq!(report.chain_depth, 1);
    // The VM runs on and the host's stream to it is still open.
    assert_eq!(link.counter_turn(3, "e3"), "3");
    assert_eq!(link.dirty(8, 0x0c0f_fee0), (8 * 256, 0));

    // The second: a layer holding the 8 MiB stamped and the few pages the turn touched.
    let (second, report) = checkpoint(&vmm, store.path(), "c2").await;
    assert!(report.incremental, "{report:?}");
    assert_eq!(report.chain_depth, 2);
    assert!(
        (8 * 256..8 * 256 + 64).contains(&report.memory_pages),
        "{report:?}"
    );
    let layer = agentvm_snapshot::Snapshot::open(&second).unwrap();
    assert!(layer.manifest.memory.base.is_some());

    // An idle turn between checkpoints stores a handful of pages. The last checkpoint was
    // moved (as a store takes it in): the next is layered on it where it is now.
    assert_eq!(link.counter_turn(4, "e4"), "4");
    let moved = store.path().join("kept-c2");
    std::fs::rename(&second, &moved).unwrap();
    let second = moved;
    let (third, report) = checkpoint_on(&vmm, store.path(), "c3", Some(&second)).await;
    assert!(report.incremental);
    assert_eq!(report.chain_depth, 3);
    assert!(report.memory_pages < 64, "{report:?}");
    assert_eq!(link.counter_turn(5, "e5"), "5");

    // Each restores the guest as that checkpoint found it: counter and stamps.
    let (at_first, mut child) = restored(&first, 1).await;
    assert_eq!(child.counter_turn(1, "x"), "3");
    at_first.shutdown().await;
    let (at_second, mut child) = restored(&second, 1).await;
    assert_eq!(child.dirty(8, 0), (8 * 256, 0), "every stamp at c2");
    assert_eq!(child.counter_turn(1, "x"), "4");
    at_second.shutdown().await;
    let (at_third, mut child) = restored(&third, 1).await;
    assert_eq!(child.counter_turn(1, "x"), "5");
    at_third.shutdown().await;

    // A checkpoint of a restored VM is a layer over what it was restored from.
    let (again, mut again_link) = restored(&third, 1).await;
    assert_eq!(again_link.counter_turn(1, "y"), "5");
    let (fourth, report) = checkpoint(&again, store.path(), "c4").await;
    assert!(!report.incremental);
    assert_eq!(report.chain_depth, 4);
    assert!(report.memory_pages < 8 * 256, "{report:?}");
    let sparse = std::fs::metadata(fourth.join(MEMORY_FILE)).unwrap();
    assert_eq!(sparse.len(), 256 << 20);
    again.shutdown().await;
    let (at_fourth, mut child) = restored(&fourth, 1).await;
    assert_eq!(child.counter_turn(1, "z"), "6");
    at_fourth.shutdown().await;

    assert_eq!(link.counter_turn(6, "e6"), "6");
    vmm.shutdown().await;
}

#[tokio::test]
async fn a_checkpoint_needs_a_running_vm_and_a_fresh_directory() {
    require_kvm!();
    let vmm = Vmm::spawn().await;
    let store = store();
    let dir = store.path().join("c");
    std::fs::create_dir(&dir).unwrap();
    let status = |r: Result<VmCheckpointReport, agentvm_vmm_api::client::ClientError>| {
        r.err().and_then(|e| e.status())
    };
    assert_eq!(status(vmm.client.checkpoint(&dir, None).await), Some(404));
    vmm.boot(&vmm.config(1, 128, "")).await;
    vmm.client.pause().await.unwrap();
    assert_eq!(status(vmm.client.checkpoint(&dir, None).await), Some(500));
    vmm.client.resume().await.unwrap();
    assert_eq!(status(vmm.client.checkpoint_wait(None).await), Some(404));
    vmm.client
        .checkpoint(&dir, None)
        .await
        .expect("vm.checkpoint");
    // Never over a checkpoint already written; the VM still runs.
    assert_eq!(status(vmm.client.checkpoint(&dir, None).await), Some(500));
    assert_eq!(
        vmm.client.info().await.unwrap().state,
        agentvm_vmm_api::VmState::Running
    );
    vmm.shutdown().await;
}

/// Checkpoints are pipelined: the next is taken before the last is durable, each layered
/// on the one before (named where it will be moved to), and waiting for one holds up
/// neither the VM nor the API.
#[tokio::test]
async fn a_checkpoint_can_be_taken_while_the_last_is_still_being_written() {
    require_kvm!();
    let vmm = Vmm::spawn().await;
    vmm.boot(&vmm.config(1, 256, "")).await;
    let mut link = GuestLink::connect_ready(&vmm.vsock_socket(), PORT);
    assert_eq!(link.counter_turn(1, "e1"), "1");
    let store = store();
    let (first, _) = checkpoint(&vmm, store.path(), "c1").await;

    // Twelve back to back, none waited for until all are taken (more than the VMM keeps
    // track of once waited for: one not yet waited for is never forgotten), each naming
    // where its base will be once moved.
    let mut dirs = Vec::new();
    let mut base: Option<PathBuf> = Some(first.clone());
    for n in 2..=13u64 {
        assert_eq!(link.counter_turn(n, &format!("e{n}")), n.to_string());
        let dir = store.path().join(format!("c{n}"));
        std::fs::create_dir(&dir).unwrap();
        let taken = vmm
            .client
            .checkpoint(&dir, base.as_deref())
            .await
            .expect("vm.checkpoint");
        assert!(taken.incremental, "{taken:?}");
        base = Some(store.path().join(format!("kept-c{n}")));
        dirs.push(dir);
    }
    // The VMM answers other calls while a wait is under way.
    let waiting = {
        let client = vmm.client.clone();
        let dir = dirs[0].clone();
        tokio::spawn(async move { client.checkpoint_wait(Some(&dir)).await })
    };
    vmm.client.info().await.expect("vm.info beside a wait");
    let report = waiting.await.unwrap().expect("the second, durable");
    assert!(report.durable && report.chain_depth >= 2, "{report:?}");
    // Moved in order, as agentvmd's store takes them in.
    let mut kept = Vec::new();
    for (i, dir) in dirs.iter().enumerate() {
        let report = vmm
            .client
            .checkpoint_wait(Some(dir))
            .await
            .expect("each one, by where it was taken");
        assert!(report.durable, "{report:?}");
        let moved = store.path().join(format!("kept-c{}", i + 2));
        std::fs::rename(dir, &moved).unwrap();
        kept.push(moved);
    }
    assert_eq!(link.counter_turn(14, "e14"), "14");
    // Each is the guest as it was when taken, over the chain as it was moved.
    for (i, dir) in kept.iter().enumerate() {
        let snapshot = agentvm_snapshot::Snapshot::open(dir).unwrap();
        assert_eq!(snapshot.chain().unwrap().len(), i + 2, "{}", dir.display());
    }
    for i in [0, 5, kept.len() - 1] {
        let (child_vmm, mut child) = restored(&kept[i], 1).await;
        assert_eq!(child.counter_turn(1, "x"), (i + 3).to_string());
        child_vmm.shutdown().await;
    }
    // A new run of checkpoints when asked: not layered on the last one taken, but on what
    // the VM runs over (its first checkpoint froze its RAM file), holding all it changed.
    let dir = store.path().join("fresh");
    std::fs::create_dir(&dir).unwrap();
    let taken = vmm.client.checkpoint_afresh(&dir).await.expect("fresh");
    assert!(!taken.incremental, "{taken:?}");
    let report = vmm.client.checkpoint_wait(Some(&dir)).await.unwrap();
    let chain = agentvm_snapshot::Snapshot::open(&dir)
        .unwrap()
        .chain()
        .unwrap();
    assert_eq!(chain.len(), 2, "{report:?}");
    assert_eq!(chain[0].dir, first, "bottom first");
    let (child_vmm, mut child) = restored(&dir, 1).await;
    assert_eq!(child.counter_turn(1, "x"), "15");
    child_vmm.shutdown().await;
    // A wait for a checkpoint never taken is a 404 naming it.
    let never = store.path().join("never");
    let e = vmm.client.checkpoint_wait(Some(&never)).await.unwrap_err();
    assert_eq!(e.status(), Some(404));
    vmm.shutdown().await;
}
