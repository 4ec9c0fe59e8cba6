//! Snapshot, restore and copy-on-write fork on real /dev/kvm with the test guest: the
//! counter and stamped memory survive a snapshot and a new VMM process, forks start from the
//! parent's state and then diverge without seeing each other's writes, and damaged or
//! foreign snapshots are refused.

mod support;

use std::path::{Path, PathBuf};

use agentvm_snapshot::manifest::{MANIFEST_FILE, MEMORY_FILE, STATE_FILE};
use agentvm_vmm_api::VmState;
use agentvm_vmm_api::client::ClientError;
use support::{GuestLink, Vmm};

const PORT: u32 = agentvm_proto::guest::GUEST_AGENT_PORT;

/// A directory for snapshots in the filesystem guest RAM lives in (so forks link, not copy).
fn shm_dir() -> tempfile::TempDir {
    match tempfile::tempdir_in("/dev/shm") {
        Ok(dir) => dir,
        Err(_) => tempfile::tempdir().unwrap(),
    }
}

fn snapshot_dir(parent: &Path, name: &str) -> PathBuf {
    let dir = parent.join(name);
    std::fs::create_dir(&dir).unwrap();
    dir
}

async fn booted_with_counter(turns: u64) -> (Vmm, GuestLink) {
    let vmm = Vmm::spawn().await;
    vmm.boot(&vmm.config(1, 256, "")).await;
    let mut link = GuestLink::connect_ready(&vmm.vsock_socket(), PORT);
    for turn in 1..=turns {
        assert_eq!(
            link.counter_turn(turn, &format!("e{turn}")),
            turn.to_string()
        );
    }
    (vmm, link)
}

#[tokio::test]
async fn counter_and_memory_survive_a_snapshot_and_a_new_process() {
    require_kvm!();
    let (vmm, mut link) = booted_with_counter(2).await;
    assert_eq!(link.dirty(64, 0x5eed_0001), (64 * 256, 0));
    vmm.client.pause().await.unwrap();
    let store = tempfile::tempdir().unwrap();
    let dir = snapshot_dir(store.path(), "snap");
    vmm.client.snapshot(&dir).await.unwrap();
    // The VM stays paused and could go on; here its process is killed outright.
    assert_eq!(vmm.client.info().await.unwrap().state, VmState::Paused);
    drop(link);
    let mut vmm = vmm;
    vmm.child.kill().unwrap();
    vmm.child.wait().unwrap();

    let restored = Vmm::spawn().await;
    restored.restore(&dir).await;
    assert_eq!(
        restored.client.info().await.unwrap().state,
        VmState::Running
    );
    let mut link = GuestLink::connect_ready(&restored.vsock_socket(), PORT);
    assert_eq!(link.restored(false, 1, "restored-1"), 1);
    // The guest recorded the notice: generation and new identity.
    let ready = link.hello();
    assert_eq!(ready.restore_generation, 1);
    assert_eq!(ready.identity.unwrap().session_uid, "restored-1");
    assert_eq!(link.counter_turn(3, "e3"), "3");
    assert_eq!(link.dirty(64, 0), (64 * 256, 0), "every stamp intact");
    restored.shutdown().await;
}

#[tokio::test]
async fn snapshot_needs_a_paused_vm_and_restore_a_fresh_vmm() {
    require_kvm!();
    let (vmm, _link) = booted_with_counter(1).await;
    let store = tempfile::tempdir().unwrap();
    let dir = snapshot_dir(store.path(), "snap");
    let status = |r: Result<(), ClientError>| r.err().and_then(|e| e.status());
    assert_eq!(status(vmm.client.snapshot(&dir).await), Some(500));
    assert_eq!(status(vmm.client.fork(&dir, false).await), Some(500));
    vmm.client.pause().await.unwrap();
    vmm.client.snapshot(&dir).await.unwrap();
    // A snapshot directory is never overwritten.
    assert_eq!(status(vmm.client.snapshot(&dir).await), Some(500));
    // This VMM already has a VM.
    assert_eq!(
        status(vmm.client.restore(&restore_request(&dir)).await),
        Some(500)
    );
    vmm.shutdown().await;
}

fn restore_request(dir: &Path) -> agentvm_vmm_api::types::RestoreConfig {
    agentvm_vmm_api::types::RestoreConfig {
        source_url: format!("file://{}", dir.display()),
        memory_restore_mode: agentvm_vmm_api::types::MemoryRestoreMode::OnDemand,
        resume: true,
        ..Default::default()
    }
}

#[tokio::test]
async fn sixteen_forks_start_from_the_parent_and_diverge() {
    require_kvm!();
    let (parent, mut parent_link) = booted_with_counter(5).await;
    assert_eq!(parent_link.dirty(16, 0x00aa_0000), (16 * 256, 0));
    parent.client.pause().await.unwrap();
    let store = shm_dir();
    let base = snapshot_dir(store.path(), "fork");
    // Resumed by the VMM itself once its RAM is frozen, while the digests are taken.
    parent.client.fork(&base, true).await.unwrap();
    assert_eq!(
        parent.client.info().await.unwrap().state,
        agentvm_vmm_api::VmState::Running
    );

    let mut children = Vec::new();
    for i in 0..16u32 {
        let child = Vmm::spawn().await;
        child.restore(&base).await;
        let mut link = GuestLink::connect_ready(&child.vsock_socket(), PORT);
        assert_eq!(link.restored(true, 1, &format!("child-{i}")), 1);
        children.push((child, link));
    }
    // The parent goes on from where it was, on its own.
    let mut parent_link = GuestLink::connect_ready(&parent.vsock_socket(), PORT);
    assert_eq!(parent_link.counter_turn(6, "p6"), "6");
    assert_eq!(parent_link.dirty(16, 0x00bb_0000), (16 * 256, 0));

    for (i, (_, link)) in children.iter_mut().enumerate() {
        // Each child starts from the parent's count at the fork.
        assert_eq!(link.counter_turn(6, "c6"), "6", "child {i}");
        // ... and from the parent's memory at the fork, not what the parent wrote since.
        assert_eq!(
            link.dirty(16, 0x0100_0000 + i as u32),
            (16 * 256, 0),
            "child {i}"
        );
    }
    for (i, (_, link)) in children.iter_mut().enumerate() {
        assert_eq!(link.counter_turn(7, "c7"), "7", "child {i}");
        // Its own stamps, untouched by its fifteen siblings' writes.
        assert_eq!(link.dirty(16, 0), (16 * 256, 0), "child {i}");
    }
    assert_eq!(
        parent_link.dirty(16, 0),
        (16 * 256, 0),
        "the parent saw no child write"
    );
    assert_eq!(parent_link.counter_turn(7, "p7"), "7");

    // Two levels: fork child 0 and check its children against it and its siblings.
    let child0 = &children[0].0;
    child0.client.pause().await.unwrap();
    let second = snapshot_dir(store.path(), "fork2");
    child0.client.fork(&second, false).await.unwrap();
    child0.client.resume().await.unwrap();
    let manifest = agentvm_snapshot::Snapshot::open(&second).unwrap().manifest;
    assert!(
        manifest.memory.base.is_some(),
        "a fork of a fork is a layer"
    );
    for g in 0..2 {
        let grandchild = Vmm::spawn().await;
        grandchild.restore(&second).await;
        let mut link = GuestLink::connect_ready(&grandchild.vsock_socket(), PORT);
        link.restored(true, 2, &format!("grandchild-{g}"));
        assert_eq!(link.counter_turn(8, "g8"), "8");
        assert_eq!(
            link.dirty(16, 0),
            (16 * 256, 0),
            "child 0's stamps, as at its fork"
        );
        assert_eq!(link.dirty(16, 0x0200_0000 + g), (16 * 256, 0));
        grandchild.shutdown().await;
    }
    // The fork cut child 0's streams too.
    children[0].1 = GuestLink::connect_ready(&children[0].0.vsock_socket(), PORT);
    let (_, link0) = &mut children[0];
    assert_eq!(
        link0.dirty(16, 0),
        (16 * 256, 0),
        "grandchildren did not write into child 0"
    );
    let (_, link1) = &mut children[1];
    assert_eq!(link1.dirty(16, 0), (16 * 256, 0), "nor into a sibling");
    for (child, _) in children {
        child.shutdown().await;
    }
    parent.shutdown().await;
}

#[tokio::test]
async fn a_restored_vm_snapshots_as_a_layer_that_restores_again() {
    require_kvm!();
    let (vmm, mut link) = booted_with_counter(1).await;
    link.dirty(8, 0x77);
    vmm.client.pause().await.unwrap();
    let store = tempfile::tempdir().unwrap();
    let first = snapshot_dir(store.path(), "first");
    vmm.client.snapshot(&first).await.unwrap();
    vmm.shutdown().await;

    let second_vm = Vmm::spawn().await;
    second_vm.restore(&first).await;
    let mut link = GuestLink::connect_ready(&second_vm.vsock_socket(), PORT);
    assert_eq!(link.counter_turn(2, "e2"), "2");
    second_vm.client.pause().await.unwrap();
    let second = snapshot_dir(store.path(), "second");
    second_vm.client.snapshot(&second).await.unwrap();
    second_vm.shutdown().await;
    let layer = agentvm_snapshot::Snapshot::open(&second).unwrap();
    assert!(layer.manifest.memory.base.is_some());
    let layer_bytes = std::fs::metadata(second.join(MEMORY_FILE)).unwrap();
    assert_eq!(
        layer_bytes.len(),
        256 << 20,
        "a layer has the VM's size, sparse"
    );

    let third_vm = Vmm::spawn().await;
    third_vm.restore(&second).await;
    let mut link = GuestLink::connect_ready(&third_vm.vsock_socket(), PORT);
    assert_eq!(link.counter_turn(3, "e3"), "3");
    assert_eq!(link.dirty(8, 0), (8 * 256, 0));
    third_vm.shutdown().await;
}

/// Takes a snapshot of a freshly booted guest for the refusal tests.
async fn fresh_snapshot(store: &Path) -> PathBuf {
    let (vmm, _link) = booted_with_counter(1).await;
    vmm.client.pause().await.unwrap();
    let dir = snapshot_dir(store, "snap");
    vmm.client.snapshot(&dir).await.unwrap();
    vmm.shutdown().await;
    dir
}

async fn refused(dir: &Path, expect: &str) {
    let vmm = Vmm::spawn().await;
    let mut request = restore_request(dir);
    request.vsock_socket = Some(vmm.vsock_socket());
    request.serial_file = Some(vmm.serial_log());
    let err = vmm
        .client
        .restore(&request)
        .await
        .expect_err("restore must fail");
    let text = err.to_string();
    assert!(text.contains(expect), "expected `{expect}` in: {text}");
    // Nothing runs: no VM exists in the VMM and no vsock socket is left.
    assert_eq!(
        vmm.client.info().await.err().and_then(|e| e.status()),
        Some(404)
    );
    assert!(!vmm.vsock_socket().exists());
    vmm.shutdown().await;
}

fn edit(path: &Path, f: impl FnOnce(&mut Vec<u8>)) {
    let mut bytes = std::fs::read(path).unwrap();
    f(&mut bytes);
    std::fs::write(path, bytes).unwrap();
}

fn edit_manifest(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join(MANIFEST_FILE);
    let mut manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    f(&mut manifest);
    std::fs::write(&path, serde_json::to_vec(&manifest).unwrap()).unwrap();
}

#[tokio::test]
async fn damaged_or_foreign_snapshots_are_refused() {
    require_kvm!();
    let store = tempfile::tempdir().unwrap();

    let dir = fresh_snapshot(&store.path().join("a").tap_mkdir()).await;
    let memory = dir.join(MEMORY_FILE);
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&memory)
        .unwrap();
    std::os::unix::fs::FileExt::write_all_at(&file, b"tampered", 1 << 20).unwrap();
    refused(&dir, "memory does not match its digest").await;

    let dir = fresh_snapshot(&store.path().join("b").tap_mkdir()).await;
    edit(&dir.join(STATE_FILE), |b| {
        let at = b.len() / 2;
        b[at] = if b[at] == b'A' { b'B' } else { b'A' };
    });
    refused(&dir, "state.json does not match its digest").await;

    let dir = fresh_snapshot(&store.path().join("c").tap_mkdir()).await;
    std::fs::OpenOptions::new()
        .write(true)
        .open(dir.join(MEMORY_FILE))
        .unwrap()
        .set_len(4096)
        .unwrap();
    refused(&dir, "memory is 4096 bytes").await;

    let dir = fresh_snapshot(&store.path().join("d").tap_mkdir()).await;
    edit_manifest(&dir, |m| m["format_version"] = 99.into());
    refused(&dir, "format version 99").await;

    let dir = fresh_snapshot(&store.path().join("e").tap_mkdir()).await;
    let other = if agentvm_vmm::kvm::Flavour::detect().name() == "VMX" {
        "SVM"
    } else {
        "VMX"
    };
    edit_manifest(&dir, |m| m["host"]["kvm_flavour"] = other.into());
    refused(&dir, other).await;
}

trait TapMkdir {
    fn tap_mkdir(self) -> Self;
}

impl TapMkdir for PathBuf {
    fn tap_mkdir(self) -> Self {
        std::fs::create_dir_all(&self).unwrap();
        self
    }
}

#[tokio::test]
async fn long_snapshot_chains_are_flattened() {
    require_kvm!();
    let (vmm, mut link) = booted_with_counter(1).await;
    link.dirty(4, 0x42);
    vmm.client.pause().await.unwrap();
    let store = tempfile::tempdir().unwrap();
    let mut dir = snapshot_dir(store.path(), "gen-0");
    vmm.client.snapshot(&dir).await.unwrap();
    vmm.shutdown().await;
    let mut depths = Vec::new();
    for generation in 1..=10u64 {
        let vm = Vmm::spawn().await;
        vm.restore(&dir).await;
        let mut link = GuestLink::connect_ready(&vm.vsock_socket(), PORT);
        let count = generation + 1;
        assert_eq!(link.counter_turn(count, "e"), count.to_string());
        vm.client.pause().await.unwrap();
        dir = snapshot_dir(store.path(), &format!("gen-{generation}"));
        vm.client.snapshot(&dir).await.unwrap();
        vm.shutdown().await;
        depths.push(
            agentvm_snapshot::Snapshot::open(&dir)
                .unwrap()
                .chain()
                .unwrap()
                .len(),
        );
    }
    assert!(
        depths.iter().all(|d| *d <= agentvm_vmm::vm::FLATTEN_AT),
        "chains stay short: {depths:?}"
    );
    assert!(
        depths.contains(&1),
        "some generation was written whole: {depths:?}"
    );
    let last = Vmm::spawn().await;
    last.restore(&dir).await;
    let mut link = GuestLink::connect_ready(&last.vsock_socket(), PORT);
    assert_eq!(link.counter_turn(12, "e"), "12");
    assert_eq!(
        link.dirty(4, 0),
        (4 * 256, 0),
        "memory from generation 0 survived"
    );
    last.shutdown().await;
}

/// Pages of `path` that hold data (what the snapshot stores).
fn stored_pages(path: &Path) -> u64 {
    let file = std::fs::File::open(path).unwrap();
    agentvm_snapshot::pages::data_extents(&file)
        .unwrap()
        .iter()
        .map(|(_, len)| len / agentvm_snapshot::pages::PAGE_SIZE)
        .sum()
}

/// Pages of `path` resident in the page cache (for a tmpfs file: the pages it holds).
fn resident_pages(path: &Path) -> u64 {
    use std::os::fd::AsRawFd;
    let file = std::fs::File::open(path).unwrap();
    let len = file.metadata().unwrap().len() as usize;
    let page = agentvm_snapshot::pages::PAGE_SIZE as usize;
    let mut resident = vec![0u8; len.div_ceil(page)];
    // SAFETY: a read-only shared mapping of a file this test opened, used only for mincore,
    // which writes one byte per page into `resident` (sized for every page), then unmapped.
    unsafe {
        let addr = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        );
        assert_ne!(addr, libc::MAP_FAILED);
        assert_eq!(libc::mincore(addr, len, resident.as_mut_ptr()), 0);
        libc::munmap(addr, len);
    }
    resident.iter().filter(|r| **r & 1 != 0).count() as u64
}

/// Writes back and evicts `path`'s cached pages, as memory pressure or time would.
fn drop_cached(path: &Path) {
    use std::os::fd::AsRawFd;
    let file = std::fs::File::open(path).unwrap();
    file.sync_all().unwrap();
    // SAFETY: posix_fadvise on a descriptor this test owns; no memory is passed.
    let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    assert_eq!(rc, 0);
}

/// Issue (performance): restoring a snapshot that stores ~0.1 MiB brought the whole 256 MiB
/// memory file into the page cache (holes read in as zero-filled cache, large folios at a
/// time), so every resumed session cost its full RAM size. A restored VM now maps only the
/// file's data over anonymous memory: the cache holds at most the stored pages, plus a
/// little, through a restore, a turn, and 16 forks from the same file.
#[tokio::test]
async fn restored_and_forked_vms_bring_in_only_the_pages_their_snapshot_stores() {
    require_kvm!();
    const SLACK_PAGES: u64 = 512; // 2 MiB
    let (vmm, link) = booted_with_counter(2).await;
    vmm.client.pause().await.unwrap();
    // On disk, where a hole read through the cache costs memory (a tmpfs file is its pages).
    let store = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let dir = snapshot_dir(store.path(), "snap");
    vmm.client.snapshot(&dir).await.unwrap();
    drop(link);
    vmm.shutdown().await;
    let memory = dir.join(MEMORY_FILE);
    let stored = stored_pages(&memory);
    drop_cached(&memory);
    assert!(
        resident_pages(&memory) <= SLACK_PAGES,
        "the cache kept the file"
    );

    let restored = Vmm::spawn().await;
    restored.restore(&dir).await;
    let mut link = GuestLink::connect_ready(&restored.vsock_socket(), PORT);
    assert_eq!(link.restored(false, 1, "restored-1"), 1);
    assert_eq!(link.counter_turn(3, "e3"), "3");
    let after_restore = resident_pages(&memory);
    eprintln!(
        "memory file: {} pages, {stored} stored, {after_restore} cached after a restore and a turn",
        std::fs::metadata(&memory).unwrap().len() / agentvm_snapshot::pages::PAGE_SIZE
    );
    assert!(
        after_restore <= stored + SLACK_PAGES,
        "{after_restore} pages cached for {stored} stored"
    );
    // A layer of the restored VM holds what it changed, not the holes it only read.
    restored.client.pause().await.unwrap();
    let layer_dir = snapshot_dir(store.path(), "layer");
    restored.client.snapshot(&layer_dir).await.unwrap();
    let layer_pages = stored_pages(&layer_dir.join(MEMORY_FILE));
    assert!(
        layer_pages < stored + SLACK_PAGES,
        "the layer stores {layer_pages} pages"
    );
    restored.shutdown().await;
    let again = Vmm::spawn().await;
    again.restore(&layer_dir).await;
    let mut link = GuestLink::connect_ready(&again.vsock_socket(), PORT);
    assert_eq!(link.restored(false, 2, "restored-2"), 2);
    assert_eq!(link.counter_turn(4, "e4"), "4", "the layer restores");
    again.shutdown().await;

    // Forks: 16 children of one parent share its frozen RAM file (on a tmpfs, where its
    // holes would otherwise be filled with pages as they are read).
    let (parent, parent_link) = booted_with_counter(1).await;
    parent.client.pause().await.unwrap();
    let shm = shm_dir();
    let base = snapshot_dir(shm.path(), "fork");
    parent.client.fork(&base, false).await.unwrap();
    drop(parent_link);
    parent.shutdown().await;
    let memory = base.join(MEMORY_FILE);
    let stored = stored_pages(&memory);
    let mut children = Vec::new();
    for i in 0..16u64 {
        let child = Vmm::spawn().await;
        child.restore(&base).await;
        let mut link = GuestLink::connect_ready(&child.vsock_socket(), PORT);
        assert_eq!(link.restored(true, 1, &format!("child-{i}")), 1);
        assert_eq!(link.counter_turn(2, "c2"), "2");
        children.push((child, link));
    }
    let resident = resident_pages(&memory);
    eprintln!("fork file: {stored} stored, {resident} resident under 16 children");
    assert!(
        resident <= stored + SLACK_PAGES,
        "{resident} pages resident for {stored} stored"
    );
    for (child, link) in children {
        drop(link);
        child.shutdown().await;
    }
}
