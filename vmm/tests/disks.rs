//! virtio-blk on real /dev/kvm with the test guest: it finds its disk on the command line,
//! reads, writes, flushes and is refused past the end; a read-only disk refuses writes; a
//! snapshot keeps the disks' transports, and a restore may put a clone on its own copy.
//! Each test prints SKIPPED and returns when the machine has no usable KVM.

mod support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use agentvm_vmm_api::config::DiskConfig;
use support::{Vmm, wait_for_serial};

const SECTORS: u64 = 2048;

/// A 1 MiB disk image whose sector 0 starts with `label`.
fn disk_image(dir: &Path, name: &str, label: &str) -> PathBuf {
    let path = dir.join(name);
    let mut image = vec![0u8; (SECTORS * 512) as usize];
    image[..label.len()].copy_from_slice(label.as_bytes());
    std::fs::write(&path, image).unwrap();
    path
}

fn sector(path: &Path, n: usize) -> Vec<u8> {
    std::fs::read(path).unwrap()[n * 512..(n + 1) * 512].to_vec()
}

/// Sector `n` as a VM restored from `snapshot` onto `top` sees it: through the snapshot
/// chain's layers of disk 0.
fn restored_sector(snapshot: &Path, top: &Path, n: u64) -> Vec<u8> {
    let mut buf = vec![0u8; 512];
    agentvm_snapshot::disk::read_restored(snapshot, "disk-0", top, &mut buf, n * 512).unwrap();
    buf
}

/// The test guest's two DISK lines, once both are on the serial log.
fn disk_report(vmm: &Vmm) -> (String, String) {
    let log = wait_for_serial(
        &vmm.serial_log(),
        "TESTGUEST DISK capacity=",
        Duration::from_secs(20),
    );
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.starts_with("TESTGUEST DISK"))
        .collect();
    assert_eq!(lines.len(), 2, "{log}");
    (lines[0].to_owned(), lines[1].to_owned())
}

#[tokio::test]
async fn a_guest_reads_writes_and_flushes_its_disk_and_is_refused_past_its_end() {
    require_kvm!();
    let vmm = Vmm::spawn().await;
    let disk = disk_image(vmm.dir.path(), "workspace.img", "agentvm disk image");
    let mut config = vmm.config(1, 128, "testguest.disk=7");
    config.disks = vec![DiskConfig {
        path: disk.clone(),
        readonly: false,
        id: Some("workspace".into()),
        serial: Some("ws-0001".into()),
    }];
    vmm.boot(&config).await;
    let (identity, results) = disk_report(&vmm);
    assert_eq!(
        identity,
        "TESTGUEST DISK id=ws-0001 sector0=agentvm disk image"
    );
    assert_eq!(
        results,
        format!("TESTGUEST DISK capacity={SECTORS} ro=0 write=0 flush=0 readback=OK beyond=1")
    );
    assert!(sector(&disk, 1).starts_with(b"testguest wrote 7\0"));
    let counters = vmm.client.counters().await.unwrap();
    let disk0 = &counters["_disk0"];
    assert!(
        disk0["write_ops"] >= 1 && disk0["flush_ops"] >= 1,
        "{counters:?}"
    );
    assert!(disk0["errors"] >= 1, "the read past the end: {counters:?}");
    let tree = vmm
        .client
        .info()
        .await
        .unwrap()
        .device_tree
        .unwrap_or_default();
    assert!(tree.contains_key("workspace"), "{:?}", tree.keys());
    vmm.shutdown().await;
}

#[tokio::test]
async fn a_read_only_disk_refuses_the_guest_s_writes() {
    require_kvm!();
    let vmm = Vmm::spawn().await;
    let disk = disk_image(vmm.dir.path(), "root.img", "read only root");
    let before = std::fs::read(&disk).unwrap();
    let mut config = vmm.config(1, 128, "testguest.disk=9");
    config.disks = vec![DiskConfig {
        path: disk.clone(),
        readonly: true,
        id: None,
        serial: None,
    }];
    vmm.boot(&config).await;
    let (identity, results) = disk_report(&vmm);
    // Without a serial of its own, the guest reads the device id.
    assert_eq!(identity, "TESTGUEST DISK id=_disk0 sector0=read only root");
    assert_eq!(
        results,
        format!("TESTGUEST DISK capacity={SECTORS} ro=1 write=1 flush=0 readback=BAD beyond=1")
    );
    assert_eq!(std::fs::read(&disk).unwrap(), before);
    vmm.shutdown().await;
}

#[tokio::test]
async fn a_snapshot_keeps_a_copy_of_its_disk_and_each_restore_writes_to_a_new_one() {
    require_kvm!();
    let vmm = Vmm::spawn().await;
    // Outlives the VMM's own directory.
    let scratch = tempfile::tempdir().unwrap();
    let disk = disk_image(scratch.path(), "workspace.img", "parent");
    let mut config = vmm.config(1, 128, "testguest.disk=3");
    config.disks = vec![DiskConfig {
        path: disk.clone(),
        readonly: false,
        id: None,
        serial: None,
    }];
    vmm.boot(&config).await;
    disk_report(&vmm);
    vmm.client.pause().await.unwrap();
    let snapshot = scratch.path().join("snap");
    std::fs::create_dir(&snapshot).unwrap();
    vmm.client.snapshot(&snapshot).await.unwrap();
    vmm.shutdown().await;

    // The snapshot holds its own copy of the disk: what the parent writes afterwards is
    // not what a clone sees.
    assert!(snapshot.join("disk-0").exists());
    std::fs::write(&disk, vec![0xeeu8; (SECTORS * 512) as usize]).unwrap();
    let child = Vmm::spawn().await;
    let copy = scratch.path().join("child.img");
    let request = agentvm_vmm_api::types::RestoreConfig {
        source_url: format!("file://{}", snapshot.display()),
        resume: true,
        vsock_socket: Some(child.vsock_socket()),
        serial_file: Some(child.serial_log()),
        disk_paths: vec![copy.clone()],
        ..Default::default()
    };
    child.client.restore(&request).await.expect("vm.restore");
    let info = child.client.info().await.unwrap();
    assert_eq!(info.config.disks[0].path, copy);
    assert!(
        child
            .client
            .counters()
            .await
            .unwrap()
            .contains_key("_disk0")
    );
    // A restore copies no disk data: the clone's file, the disk's size, holds only what the
    // clone writes, over the snapshot's copy.
    let top = std::fs::File::open(&copy).unwrap();
    assert_eq!(top.metadata().unwrap().len(), SECTORS * 512);
    assert!(
        agentvm_snapshot::pages::data_extents(&top)
            .unwrap()
            .is_empty()
    );
    assert!(restored_sector(&snapshot, &copy, 0).starts_with(b"parent"));
    assert!(restored_sector(&snapshot, &copy, 1).starts_with(b"testguest wrote 3\0"));
    // The clone's own snapshot stores its disk as a layer over the first; a VM restored from
    // it sees the disk through both.
    child.client.pause().await.unwrap();
    let layer = scratch.path().join("layer");
    std::fs::create_dir(&layer).unwrap();
    child.client.snapshot(&layer).await.unwrap();
    child.shutdown().await;
    let manifest = agentvm_snapshot::Snapshot::open(&layer).unwrap().manifest;
    assert_eq!(
        manifest.files["disk-0"].digest,
        agentvm_snapshot::manifest::DigestKind::LayerPages
    );
    let grandchild = Vmm::spawn().await;
    let grandchild_disk = scratch.path().join("grandchild.img");
    grandchild
        .client
        .restore(&agentvm_vmm_api::types::RestoreConfig {
            source_url: format!("file://{}", layer.display()),
            resume: true,
            vsock_socket: Some(grandchild.vsock_socket()),
            serial_file: Some(grandchild.serial_log()),
            disk_paths: vec![grandchild_disk.clone()],
            ..Default::default()
        })
        .await
        .expect("vm.restore of a layered disk");
    grandchild.shutdown().await;
    assert!(restored_sector(&layer, &grandchild_disk, 0).starts_with(b"parent"));

    // A file that exists is never written over (without disk_paths that is the parent's
    // own disk), and the count must match.
    for (paths, expect) in [
        (vec![], "disk_paths"),
        (vec![copy.clone()], "File exists"),
        (
            vec![scratch.path().join("a"), scratch.path().join("b")],
            "disk_paths",
        ),
    ] {
        let vmm = Vmm::spawn().await;
        let request = agentvm_vmm_api::types::RestoreConfig {
            source_url: format!("file://{}", snapshot.display()),
            vsock_socket: Some(vmm.vsock_socket()),
            disk_paths: paths,
            ..Default::default()
        };
        let err = vmm.client.restore(&request).await.unwrap_err().to_string();
        assert!(err.contains(expect), "{err}");
        vmm.shutdown().await;
    }
    assert_eq!(
        std::fs::read(&disk).unwrap()[0],
        0xee,
        "the parent's disk untouched"
    );
}
