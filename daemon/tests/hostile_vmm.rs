//! A compromised VMM rewrites every file its uid can in its own directory (`vms/SESSION/`):
//! its pid file names a process of root's, its other files and its snapshot outbox become
//! symlinks to root's files. Suspend, turns and delete then go on around it, and root acts on
//! none of what it names: the process lives, the files keep their bytes and modes.
//! Prints SKIPPED and returns when the machine has no usable KVM.

mod support;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::time::Duration;

use agentvm_proto::v1::{DeleteSessionRequest, SuspendRequest};
use support::daemon::{kvm_unavailable, vmm_binary};
use support::{create_for, start_with};

/// One turn's whole output text, or the status it ended with.
async fn turn(
    c: &mut agentvm_proto::v1::sessions_client::SessionsClient<tonic::transport::Channel>,
    session: &str,
) -> Result<(), tonic::Status> {
    let mut stream = c
        .exec(support::exec_text(session, "tick"))
        .await?
        .into_inner();
    while stream.message().await?.is_some() {}
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn root_acts_on_nothing_a_vmm_rewrote_in_its_directory() {
    if let Some(reason) = kvm_unavailable() {
        eprintln!("SKIPPED: {reason}; this test needs KVM");
        return;
    }
    let binary = vmm_binary();
    let node = start_with(move |cfg| {
        cfg.vmm_binary = Some(binary);
        cfg.ram_dir = std::env::temp_dir();
    })
    .await;
    let mut c = node.c();
    let s = create_for(&mut c, "testguest").await;
    turn(&mut c, &s).await.unwrap();
    let dir = node.dir.join("state").join("vms").join(&s);
    let meta = std::fs::metadata(&dir).unwrap();
    let (uid, gid) = (meta.uid(), meta.gid());
    assert_ne!(uid, 0, "the VMM runs as a uid of its own");

    // Root's: a directory with a secret, and a process.
    let host = tempfile::tempdir().unwrap();
    std::fs::set_permissions(host.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let secret = host.path().join("secret");
    std::fs::write(&secret, b"root's").unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    let mut sleeper = std::process::Command::new("sleep")
        .arg("120")
        .spawn()
        .unwrap();

    // As the VMM's uid: everything it can rewrite, rewritten (its sockets stay: it still
    // answers its API, as a compromised VMM would).
    let script = format!(
        "cd {dir} && echo {pid} > vmm.pid.new && mv -f vmm.pid.new vmm.pid && \
         for f in harness serial.log vmm.log; do rm -f $f; ln -s {secret} $f; done && \
         rm -rf snapshot restore && ln -s {host} snapshot && ln -s {host} restore && \
         echo /tmp/elsewhere.sock > pooled-api && ln -s {secret} network.json",
        dir = dir.display(),
        pid = sleeper.id(),
        secret = secret.display(),
        host = host.path().display(),
    );
    // In its jail the VMM reaches its directory through a bind mount; here its uid gets there
    // through the state directory (0700, root's), opened for traversal only.
    for traversed in [node.dir.join("state"), node.dir.join("state").join("vms")] {
        std::fs::set_permissions(&traversed, std::fs::Permissions::from_mode(0o711)).unwrap();
    }
    let rewrote = std::process::Command::new("/bin/sh")
        .args(["-c", &script])
        .uid(uid)
        .gid(gid)
        .status()
        .unwrap();
    assert!(rewrote.success(), "the VMM's uid rewrote its directory");

    let untouched = |what: &str| {
        let meta = std::fs::metadata(&secret).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o600, "{what}: mode");
        assert_eq!(meta.uid(), 0, "{what}: owner");
        assert_eq!(std::fs::read(&secret).unwrap(), b"root's", "{what}: bytes");
        let host_meta = std::fs::metadata(host.path()).unwrap();
        assert_eq!(host_meta.uid(), 0, "{what}: the directory's owner");
        assert_eq!(host_meta.permissions().mode() & 0o777, 0o755, "{what}");
        let names: Vec<_> = std::fs::read_dir(host.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["secret"], "{what}: the directory's entries");
    };

    // A suspend writes its snapshot through the planted outbox into nothing of root's (it
    // fails, or succeeds in an outbox of its own), and the session goes on either way.
    let _ = c.suspend(SuspendRequest { session: s.clone() }).await;
    untouched("after a suspend");
    let _ = turn(&mut c, &s).await;
    untouched("after a turn");
    // Delete stops the VMM: by its API, never by the pid it wrote.
    c.delete_session(DeleteSessionRequest { uid: s.clone() })
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    untouched("after a delete");
    assert!(
        sleeper.try_wait().unwrap().is_none(),
        "root's process named in the pid file was signalled"
    );
    let _ = sleeper.kill();
    let _ = sleeper.wait();
}
