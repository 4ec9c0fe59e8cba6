//! `VmmClient`: what it sends, how it fails, readiness polling, idempotent pause/resume.

use std::path::Path;
use std::time::{Duration, Instant};

use agentvm_vmm_api::client::{Bytes, Method};
use agentvm_vmm_api::{ClientError, VmState, VmmClient};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixListener;
use tokio::task::JoinHandle;

use crate::support::TestServer;

/// Accepts one connection, reads the request head, answers `response` verbatim, and returns
/// the request head it read.
fn answer_once(listener: UnixListener, response: &'static [u8]) -> JoinHandle<String> {
    tokio::spawn(async move { answer_once_on(&listener, response).await })
}

fn listener(dir: &Path) -> (UnixListener, std::path::PathBuf) {
    let path = dir.join("fake.sock");
    (UnixListener::bind(&path).expect("bind"), path)
}

#[tokio::test]
async fn sends_host_localhost_and_connection_close_on_a_fresh_connection() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (listener, path) = listener(dir.path());
    let server = answer_once(listener, b"HTTP/1.1 204 No Content\r\n\r\n");
    VmmClient::new(&path).boot().await.expect("boot");
    let head = server.await.expect("server").to_ascii_lowercase();
    assert!(
        head.starts_with("put /api/v1/vm.boot http/1.1\r\n"),
        "{head}"
    );
    assert!(head.contains("\r\nhost: localhost\r\n"), "{head}");
    assert!(head.contains("\r\nconnection: close\r\n"), "{head}");
    assert!(!head.contains("content-type"), "{head}");
}

#[tokio::test]
async fn a_plain_text_error_body_becomes_one_message() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (listener, path) = listener(dir.path());
    let _server = answer_once(
        listener,
        b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 5\r\n\r\noops!",
    );
    let err = VmmClient::new(&path).pause().await.expect_err("500");
    let ClientError::Api {
        endpoint,
        status,
        messages,
    } = &err
    else {
        panic!("{err:?}");
    };
    assert_eq!((endpoint.as_str(), *status), ("vm.pause", 500));
    assert_eq!(messages, &vec!["oops!".to_owned()]);
    assert_eq!(err.to_string(), "vm.pause: HTTP 500: oops!");
}

#[tokio::test]
async fn an_undecodable_success_body_is_a_bad_response() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (listener, path) = listener(dir.path());
    let _server = answer_once(
        listener,
        b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\nnot json",
    );
    let err = VmmClient::new(&path).ping().await.expect_err("bad body");
    assert!(matches!(err, ClientError::BadResponse { .. }), "{err:?}");
}

#[tokio::test]
async fn times_out_against_a_listener_that_never_answers() {
    let dir = tempfile::tempdir().expect("tempdir");
    // Bound and listening, never accepting: connect succeeds, no answer ever comes.
    let (_listener, path) = listener(dir.path());
    let client = VmmClient::new(&path).with_timeout(Duration::from_millis(200));
    let started = Instant::now();
    let err = client.info().await.expect_err("timeout");
    assert!(
        matches!(&err, ClientError::Timeout { endpoint, after } if endpoint == "vm.info" && *after == Duration::from_millis(200)),
        "{err:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(2));
}

#[tokio::test]
async fn a_missing_socket_is_a_connect_error_naming_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("absent.sock");
    let err = VmmClient::new(&path).ping().await.expect_err("no socket");
    assert!(
        matches!(&err, ClientError::Connect { socket, .. } if socket == &path),
        "{err:?}"
    );
    assert!(err.to_string().contains("absent.sock"), "{err}");
}

#[tokio::test]
async fn wait_ready_polls_until_the_server_appears() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("api.sock");
    let client = VmmClient::new(&path);

    let started = Instant::now();
    let err = client
        .wait_ready(Duration::from_millis(100))
        .await
        .expect_err("nothing there");
    assert!(matches!(err, ClientError::NotReady { .. }), "{err:?}");
    assert!(started.elapsed() < Duration::from_secs(2));

    let late = {
        let path = path.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let listener = agentvm_vmm_api::bind_api_socket(&path).expect("bind");
            let backend = std::sync::Arc::new(crate::support::FakeBackend::default());
            agentvm_vmm_api::serve(listener, backend).await
        })
    };
    let ping = client
        .wait_ready(Duration::from_secs(5))
        .await
        .expect("ready");
    assert_eq!(ping.version, "v0.1.0-test");
    // An unbounded wait is fine too (no deadline arithmetic overflows).
    client.wait_ready(Duration::MAX).await.expect("ready again");
    client.shutdown_vmm().await.expect("vmm.shutdown");
    late.await.expect("task").expect("serve");
}

#[tokio::test]
async fn wait_ready_returns_an_error_status_at_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (listener, path) = listener(dir.path());
    let _server = answer_once(
        listener,
        b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n",
    );
    let started = Instant::now();
    let err = VmmClient::new(&path)
        .wait_ready(Duration::from_secs(5))
        .await
        .expect_err("404");
    assert_eq!(err.status(), Some(404));
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "retried an answered ping"
    );
}

#[tokio::test]
async fn idempotent_pause_and_resume_accept_the_target_state() {
    let server = TestServer::start().await;
    let client = server.client();
    client.create(&TestServer::config()).await.expect("create");

    // Created: pausing is a real error, and stays one.
    let err = client.pause_idempotent().await.expect_err("not running");
    assert_eq!(err.status(), Some(500));

    client.boot().await.expect("boot");
    client
        .resume_idempotent()
        .await
        .expect("already running is fine");
    assert!(client.resume().await.is_err(), "plain resume still fails");
    client.pause_idempotent().await.expect("pause");
    client
        .pause_idempotent()
        .await
        .expect("already paused is fine");
    assert_eq!(server.backend.state(), Some(VmState::Paused));
    client.resume_idempotent().await.expect("resume");
    assert_eq!(server.backend.state(), Some(VmState::Running));

    client.shutdown().await.expect("shutdown");
    let err = client.resume_idempotent().await.expect_err("shut down");
    assert_eq!(err.status(), Some(500));
}

#[tokio::test]
async fn generic_requests_reach_new_endpoints() {
    let server = TestServer::start().await;
    let client = server.client();
    let response = client
        .request(Method::GET, "vmm.ping", None)
        .await
        .expect("ping");
    assert_eq!(response.status, 200);
    let err = client
        .request(Method::PUT, "vm.resize", Some(Bytes::from_static(b"{}")))
        .await
        .expect_err("not routed");
    assert_eq!(err.status(), Some(404));
    // Snapshot, restore and fork bodies are checked like vm.create's.
    for (endpoint, body, names) in [
        ("vm.snapshot", &b"{}"[..], "destination_url"),
        (
            "vm.snapshot",
            br#"{"destination_url":"s3://bucket/x"}"#,
            "destination_url",
        ),
        (
            "vm.fork",
            br#"{"destination_url":"file://relative"}"#,
            "destination_url",
        ),
        (
            "vm.restore",
            br#"{"source_url":"file:///s","resume":"yes"}"#,
            "resume",
        ),
        (
            "vm.restore",
            br#"{"source_url":"file:///s","net_fds":[{"id":"x"}]}"#,
            "net_fds",
        ),
        (
            "vm.restore",
            br#"{"source_url":"file:///s","memory_restore_mode":"Lazy"}"#,
            "memory_restore_mode",
        ),
    ] {
        let err = client
            .request(Method::PUT, endpoint, Some(Bytes::copy_from_slice(body)))
            .await
            .expect_err("bad body");
        assert_eq!(err.status(), Some(400), "{endpoint} {body:?}");
        assert!(err.to_string().contains(names), "{endpoint}: {err}");
    }
    let err = client
        .request(Method::GET, "bad path with spaces", None)
        .await
        .expect_err("invalid uri");
    assert!(matches!(err, ClientError::InvalidRequest { .. }), "{err:?}");
}

/// A `vm.info` as Cloud Hypervisor v53 answers it: config sections this crate's strict
/// types do not model (rng, platform, landlock, …).
fn cloud_hypervisor_info() -> &'static [u8] {
    let body = serde_json::json!({
        "config": {
            "cpus": {"boot_vcpus": 1, "max_vcpus": 1, "kvm_hyperv": false},
            "memory": {"size": 268435456, "mergeable": false, "hotplug_method": "Acpi"},
            "rng": {"src": "/dev/urandom", "iommu": false},
            "platform": {"num_pci_segments": 1},
            "landlock_enable": false
        },
        "state": "Paused",
        "memory_actual_size": 268435456,
        "device_tree": {}
    })
    .to_string();
    let response = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    Box::leak(response.into_bytes().into_boxed_slice())
}

#[tokio::test]
async fn state_reads_a_cloud_hypervisor_vm_info() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (listener, path) = listener(dir.path());
    let _server = answer_once(listener, cloud_hypervisor_info());
    assert_eq!(
        VmmClient::new(&path).state().await.expect("state"),
        VmState::Paused
    );
}

#[tokio::test]
async fn idempotent_pause_accepts_cloud_hypervisor_409_for_already_paused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (listener, path) = listener(dir.path());
    let server = tokio::spawn(async move {
        let conflict = answer_once_on(
            &listener,
            b"HTTP/1.1 409 Conflict\r\nContent-Length: 2\r\n\r\n[]",
        )
        .await;
        let info = answer_once_on(&listener, cloud_hypervisor_info()).await;
        (conflict, info)
    });
    VmmClient::new(&path)
        .pause_idempotent()
        .await
        .expect("already paused");
    let (conflict, info) = server.await.expect("server");
    assert!(conflict.starts_with("PUT /api/v1/vm.pause"), "{conflict}");
    assert!(info.starts_with("GET /api/v1/vm.info"), "{info}");
}

/// Like [`answer_once`], on a listener that stays open for the next connection.
async fn answer_once_on(listener: &UnixListener, response: &[u8]) -> String {
    let (mut stream, _) = listener.accept().await.expect("accept");
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if stream.read(&mut byte).await.expect("read") == 0 {
            break;
        }
        head.push(byte[0]);
    }
    stream.write_all(response).await.expect("write");
    String::from_utf8_lossy(&head).into_owned()
}
