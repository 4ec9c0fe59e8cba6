//! The REST API of a real agentvm-vmm process: every endpoint, wrong-state answers and bad
//! bodies. The first test needs no KVM (nothing boots); the others skip without it.

mod support;

use std::time::Duration;

use agentvm_vmm_api::VmState;
use agentvm_vmm_api::client::{ClientError, Method};
use support::Vmm;

fn status(result: Result<impl std::fmt::Debug, ClientError>) -> u16 {
    match result {
        Ok(v) => panic!("expected an error, got {v:?}"),
        Err(ClientError::Api { status, .. }) => status,
        Err(other) => panic!("expected an API error, got {other}"),
    }
}

fn messages(result: Result<impl std::fmt::Debug, ClientError>) -> String {
    match result {
        Err(ClientError::Api { messages, .. }) => messages.join(" | "),
        other => panic!("expected an API error, got {other:?}"),
    }
}

#[tokio::test]
async fn lifecycle_without_booting() {
    let mut vmm = Vmm::spawn().await;
    let ping = vmm.client.ping().await.unwrap();
    assert_eq!(ping.pid, i64::from(vmm.pid()));
    assert!(ping.features.iter().any(|f| f == "hybrid_vsock"));

    // Nothing created yet: 404 for everything about the VM, delete is a no-op.
    assert_eq!(status(vmm.client.info().await), 404);
    assert_eq!(status(vmm.client.boot().await), 404);
    assert_eq!(status(vmm.client.pause().await), 404);
    assert_eq!(status(vmm.client.resume().await), 404);
    assert_eq!(status(vmm.client.shutdown().await), 404);
    assert_eq!(status(vmm.client.counters().await), 404);
    vmm.client.delete().await.unwrap();

    // Bad bodies name what is wrong.
    let bad = vmm
        .client
        .request(
            Method::PUT,
            "vm.create",
            Some(r#"{"payload":{"kernel":"/k"},"cpus":{"boot_vcpus":0,"max_vcpus":0}}"#.into()),
        )
        .await;
    assert_eq!(status(bad.map(|r| r.status)), 400);
    let unknown = vmm
        .client
        .request(
            Method::PUT,
            "vm.create",
            Some(r#"{"payload":{"kernel":"/k"},"net":[{"tap":"t","num_queues":2}]}"#.into()),
        )
        .await;
    assert!(messages(unknown.map(|r| r.status)).contains("num_queues"));
    // vm.egress-allow needs a booted VM.
    let rules = [agentvm_vmm_api::config::EgressRule::host(
        [1, 1, 1, 1].into(),
    )];
    assert_eq!(status(vmm.client.egress_allow(None, &rules).await), 404);

    let config = vmm.config(1, 64, "");
    vmm.client.create(&config).await.unwrap();
    assert_eq!(status(vmm.client.create(&config).await), 500);
    let info = vmm.client.info().await.unwrap();
    assert_eq!(info.state, VmState::Created);
    assert_eq!(info.config, config);
    assert_eq!(info.memory_actual_size, None);
    assert_eq!(status(vmm.client.pause().await), 500);
    assert_eq!(status(vmm.client.resume().await), 500);
    assert_eq!(status(vmm.client.shutdown().await), 500);
    assert_eq!(status(vmm.client.counters().await), 500);
    vmm.client.delete().await.unwrap();
    assert_eq!(status(vmm.client.info().await), 404);

    // vmm.shutdown answers 200 and the process exits, removing its socket.
    vmm.client.shutdown_vmm().await.unwrap();
    let exit = tokio::task::spawn_blocking(move || {
        let status = vmm.child.wait().unwrap();
        (status, vmm)
    })
    .await
    .unwrap();
    assert!(exit.0.success());
    assert!(!exit.1.api.exists());
}

#[tokio::test]
async fn boot_failures_are_reported_and_leave_the_config() {
    require_kvm!();
    let vmm = Vmm::spawn().await;
    let mut config = vmm.config(1, 64, "");
    config.payload.kernel = Some("/nonexistent/vmlinux".into());
    vmm.client.create(&config).await.unwrap();
    let text = messages(vmm.client.boot().await);
    assert!(text.contains("/nonexistent/vmlinux"), "{text}");
    assert_eq!(vmm.client.info().await.unwrap().state, VmState::Created);
    vmm.client.delete().await.unwrap();

    // A vsock socket path that is taken.
    let config = vmm.config(1, 64, "");
    std::fs::write(vmm.vsock_socket(), b"occupied").unwrap();
    vmm.client.create(&config).await.unwrap();
    let text = messages(vmm.client.boot().await);
    assert!(text.contains("vsock.sock"), "{text}");
    vmm.shutdown().await;
}

#[tokio::test]
async fn wrong_state_calls_on_a_running_vm() {
    require_kvm!();
    let vmm = Vmm::spawn().await;
    vmm.boot(&vmm.config(1, 64, "")).await;
    assert_eq!(status(vmm.client.boot().await), 500);
    assert_eq!(status(vmm.client.resume().await), 500);
    assert_eq!(status(vmm.client.create(&vmm.config(1, 64, "")).await), 500);
    vmm.client.pause().await.unwrap();
    assert_eq!(status(vmm.client.pause().await), 500);
    // The idempotent helpers treat "already there" as success.
    vmm.client.pause_idempotent().await.unwrap();
    vmm.client.resume().await.unwrap();
    vmm.client.resume_idempotent().await.unwrap();
    let info = vmm.client.info().await.unwrap();
    assert_eq!(info.state, VmState::Running);
    let tree = info.device_tree.expect("device tree once booted");
    assert!(tree.contains_key("_vsock0") && tree.contains_key("_serial"));
    let counters = vmm.client.counters().await.unwrap();
    assert!(counters["vcpus"]["io_exits"] > 0);
    assert!(counters["_serial"]["out_bytes"] > 0);
    vmm.client.shutdown().await.unwrap();
    assert_eq!(status(vmm.client.shutdown().await), 500);
    assert_eq!(status(vmm.client.pause().await), 500);
    assert_eq!(status(vmm.client.counters().await), 500);
    vmm.shutdown().await;
}

#[tokio::test]
async fn one_shot_mode_boots_and_exits_with_the_guest() {
    require_kvm!();
    let vmm = Vmm::spawn().await;
    let kernel = vmm.testguest();
    let log = vmm.path("oneshot.log");
    let sock = vmm.path("oneshot.vsock");
    let child = std::process::Command::new(support::vmm_bin())
        .arg("--kernel")
        .arg(&kernel)
        .arg("--serial")
        .arg(&log)
        .arg("--vsock")
        .arg(format!("cid=3,socket={}", sock.display()))
        .spawn()
        .unwrap();
    support::wait_for_serial(&log, "TESTGUEST READY", Duration::from_secs(20));
    let mut link = support::GuestLink::connect(&sock, 1024).unwrap();
    link.send(agentvm_proto::guest::v1::envelope::Body::Shutdown(
        agentvm_proto::guest::v1::Shutdown::default(),
    ));
    let output = tokio::task::spawn_blocking(move || child.wait_with_output().unwrap())
        .await
        .unwrap();
    assert!(output.status.success());
    assert!(!sock.exists());
    vmm.shutdown().await;
}

#[tokio::test]
async fn the_ram_directory_is_set_through_the_api_before_the_vm_boots() {
    require_kvm!();
    let vmm = Vmm::spawn().await;
    // Refused with the field named: relative, or not a directory the VMM sees.
    let text = messages(vmm.client.set_ram_dir(Some("relative/dir".as_ref())).await);
    assert!(
        text.contains("path") && text.contains("not absolute"),
        "{text}"
    );
    let missing = vmm.dir.path().join("missing");
    let text = messages(vmm.client.set_ram_dir(Some(&missing)).await);
    assert!(
        text.contains("path") && text.contains("not a directory"),
        "{text}"
    );

    let ram = tempfile::tempdir_in("/dev/shm").unwrap();
    vmm.client.set_ram_dir(Some(ram.path())).await.unwrap();
    vmm.boot(&vmm.config(1, 64, "")).await;
    // The guest's RAM is an unnamed file in that directory, mapped by the VMM.
    let maps = std::fs::read_to_string(format!("/proc/{}/maps", vmm.pid())).unwrap();
    let prefix = format!("{}/", ram.path().display());
    assert!(
        maps.lines()
            .any(|l| l.contains(&prefix) && l.ends_with("(deleted)")),
        "no RAM file in {prefix}:\n{maps}"
    );
}

/// A VMM started with `--exit-with-fd 3`, descriptor 3 the read end of a pipe whose only
/// writer is returned.
async fn anchored_vmm(
    dir: &std::path::Path,
) -> (
    std::process::Child,
    std::io::PipeWriter,
    agentvm_vmm_api::VmmClient,
) {
    let (reader, writer) = std::io::pipe().unwrap();
    let api = dir.join("api.sock");
    let child = std::process::Command::new("sh")
        .arg("-c")
        .arg("exec \"$0\" --api-socket \"$1\" --exit-with-fd 3 3<&0 </dev/null")
        .arg(support::vmm_bin())
        .arg(&api)
        .stdin(reader)
        .spawn()
        .unwrap();
    let client = agentvm_vmm_api::VmmClient::new(&api);
    client.wait_ready(Duration::from_secs(10)).await.unwrap();
    (child, writer, client)
}

#[tokio::test]
async fn a_vmm_anchored_to_its_starter_goes_with_it_until_a_vm_is_asked_for() {
    let dir = tempfile::tempdir().unwrap();
    // Nothing asked of it: the writer's end is its end.
    let (mut idle, writer, _) = anchored_vmm(dir.path()).await;
    drop(writer);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let status = loop {
        if let Some(status) = idle.try_wait().unwrap() {
            break status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the anchored VMM outlived its anchor"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert!(status.success(), "{status}");

    // Once a VM was asked for, it outlives whoever started it.
    let dir = tempfile::tempdir().unwrap();
    let (mut serving, writer, client) = anchored_vmm(dir.path()).await;
    let vmm = Vmm::spawn().await;
    let config = vmm.config(1, 64, "");
    client.create(&config).await.unwrap();
    drop(writer);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        serving.try_wait().unwrap().is_none(),
        "a VMM with a VM exited with its anchor"
    );
    client.ping().await.unwrap();
    client.shutdown_vmm().await.unwrap();
    serving.wait().unwrap();
}
