//! Every endpoint's success path and CH's wrong-state answers.

use std::sync::atomic::Ordering;

use agentvm_vmm_api::VmState;
use agentvm_vmm_api::types::VmmPingResponse;

use crate::support::{TestServer, create_body, get, put};

#[tokio::test]
async fn every_endpoint_succeeds_with_cloud_hypervisor_status_codes() {
    let server = TestServer::start().await;
    let s = &server.socket;

    let ping = get(s, "vmm.ping").await;
    assert_eq!(ping.status, 200);
    assert_eq!(ping.header("content-type"), Some("application/json"));
    let ping: VmmPingResponse = serde_json::from_slice(&ping.body).expect("ping body");
    assert_eq!(ping.version, "v0.1.0-test");
    assert_eq!(ping.pid, i64::from(std::process::id()));

    let created = put(s, "vm.create", Some(&create_body())).await;
    assert_eq!(created.status, 204, "{created:?}");
    assert!(created.body.is_empty());
    assert_eq!(created.header("content-type"), None);

    let info = get(s, "vm.info").await;
    assert_eq!(info.status, 200);
    assert_eq!(info.header("content-type"), Some("application/json"));
    let client = server.client();
    let info = client.info().await.expect("info");
    assert_eq!(info.state, VmState::Created);
    assert_eq!(info.config, TestServer::config());
    assert_eq!(info.device_tree, None);

    assert_eq!(put(s, "vm.boot", None).await.status, 204);
    let info = client.info().await.expect("info");
    assert_eq!(info.state, VmState::Running);
    assert!(info.device_tree.is_some_and(|t| t.contains_key("__serial")));
    assert_eq!(info.memory_actual_size, Some(512 << 20));

    let counters = get(s, "vm.counters").await;
    assert_eq!(counters.status, 200);
    assert_eq!(counters.header("content-type"), Some("application/json"));
    let counters = client.counters().await.expect("counters");
    assert_eq!(counters["_vsock0"]["tx_bytes"], 9);

    assert_eq!(put(s, "vm.pause", None).await.status, 204);
    assert_eq!(server.backend.state(), Some(VmState::Paused));
    assert_eq!(put(s, "vm.resume", None).await.status, 204);
    assert_eq!(server.backend.state(), Some(VmState::Running));
    assert_eq!(put(s, "vm.shutdown", None).await.status, 204);
    assert_eq!(server.backend.state(), Some(VmState::Shutdown));
    // A shut-down VM keeps its config and boots again.
    assert_eq!(put(s, "vm.boot", None).await.status, 204);
    assert_eq!(server.backend.state(), Some(VmState::Running));
    assert_eq!(put(s, "vm.delete", None).await.status, 204);
    assert_eq!(server.backend.state(), None);
}

#[tokio::test]
async fn the_client_drives_every_endpoint() {
    let mut server = TestServer::start().await;
    let client = server.client();
    assert_eq!(client.ping().await.expect("ping").features, vec!["kvm"]);
    client.create(&TestServer::config()).await.expect("create");
    client.boot().await.expect("boot");
    client.pause().await.expect("pause");
    client.resume().await.expect("resume");
    assert!(!client.counters().await.expect("counters").is_empty());
    client.shutdown().await.expect("shutdown");
    assert_eq!(client.info().await.expect("info").state, VmState::Shutdown);
    client.delete().await.expect("delete");
    client.shutdown_vmm().await.expect("vmm.shutdown");
    server.finished().await.expect("serve result");
    assert!(server.backend.vmm_shut_down.load(Ordering::SeqCst));
}

#[tokio::test]
async fn wrong_state_calls_answer_like_cloud_hypervisor() {
    let server = TestServer::start().await;
    let s = &server.socket;

    // No VM config yet.
    let m = put(s, "vm.boot", None).await.error(404);
    assert_eq!(m[0], "vm.boot failed");
    get(s, "vm.info").await.error(404);
    get(s, "vm.counters").await.error(500);
    put(s, "vm.pause", None).await.error(500);
    put(s, "vm.resume", None).await.error(500);
    put(s, "vm.shutdown", None).await.error(500);
    assert_eq!(
        put(s, "vm.delete", None).await.status,
        204,
        "delete is idempotent"
    );

    // Created, not booted.
    assert_eq!(put(s, "vm.create", Some(&create_body())).await.status, 204);
    let m = put(s, "vm.create", Some(&create_body())).await.error(500);
    assert_eq!(m, vec!["vm.create failed", "VmAlreadyCreated"]);
    get(s, "vm.counters").await.error(500);
    put(s, "vm.pause", None).await.error(500);
    put(s, "vm.shutdown", None).await.error(500);

    // Running.
    assert_eq!(put(s, "vm.boot", None).await.status, 204);
    let m = put(s, "vm.boot", None).await.error(500);
    assert_eq!(m[0], "vm.boot failed");
    let m = put(s, "vm.resume", None).await.error(500);
    assert_eq!(
        m,
        vec![
            "vm.resume failed",
            "InvalidStateTransition(Running, Running)"
        ]
    );

    // Paused.
    assert_eq!(put(s, "vm.pause", None).await.status, 204);
    let m = put(s, "vm.pause", None).await.error(500);
    assert_eq!(
        m,
        vec!["vm.pause failed", "InvalidStateTransition(Paused, Paused)"]
    );
    put(s, "vm.boot", None).await.error(500);

    // Shut down.
    assert_eq!(put(s, "vm.shutdown", None).await.status, 204);
    put(s, "vm.shutdown", None).await.error(500);
    put(s, "vm.pause", None).await.error(500);
    put(s, "vm.resume", None).await.error(500);
    get(s, "vm.counters").await.error(500);
    assert_eq!(get(s, "vm.info").await.status, 200);

    assert_eq!(put(s, "vm.delete", None).await.status, 204);
    assert_eq!(put(s, "vm.delete", None).await.status, 204);
    get(s, "vm.info").await.error(404);
}

#[tokio::test]
async fn vmm_shutdown_answers_200_then_serve_returns() {
    let mut server = TestServer::start().await;
    let client = server.client();
    client.create(&TestServer::config()).await.expect("create");
    client.boot().await.expect("boot");

    let response = put(&server.socket, "vmm.shutdown", None).await;
    assert_eq!(response.status, 200, "{response:?}");
    assert!(response.body.is_empty());
    server.finished().await.expect("serve returns Ok");
    assert!(server.backend.vmm_shut_down.load(Ordering::SeqCst));
    assert_eq!(server.backend.state(), None);

    // Nobody is listening any more.
    let after = client.ping().await.expect_err("server is gone");
    assert!(
        matches!(after, agentvm_vmm_api::ClientError::Connect { .. }),
        "{after:?}"
    );
}

#[tokio::test]
async fn the_shutdown_future_stops_serving() {
    let mut server = TestServer::start().await;
    server.client().ping().await.expect("ping");
    server.stop();
    server.finished().await.expect("serve returns Ok");
    assert!(!server.backend.vmm_shut_down.load(Ordering::SeqCst));
    assert!(server.client().ping().await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_queued_behind_vmm_shutdown_is_refused() {
    let mut server = TestServer::start().await;
    server.backend.delay_ms.store(200, Ordering::SeqCst);
    let socket = server.socket.clone();
    let shutdown = tokio::spawn(async move { put(&socket, "vmm.shutdown", None).await });
    // Wait until vmm.shutdown is inside the backend, then queue a ping behind it.
    let started = std::time::Instant::now();
    while !server
        .backend
        .calls
        .lock()
        .expect("calls")
        .contains(&"shutdown_vmm")
    {
        assert!(
            started.elapsed() < crate::support::WAIT,
            "vmm.shutdown never ran"
        );
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    let queued = get(&server.socket, "vmm.ping").await;
    assert_eq!(shutdown.await.expect("task").status, 200);
    let m = queued.error(500);
    assert_eq!(m, vec!["vmm.ping failed", "the VMM is shutting down"]);
    server.finished().await.expect("serve returns Ok");
    assert_eq!(
        server.backend.calls.lock().expect("calls").as_slice(),
        ["shutdown_vmm"]
    );
}
