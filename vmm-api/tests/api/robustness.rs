//! Whatever a client sends, the server keeps serving everybody else.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use agentvm_vmm_api::ServerConfig;

use crate::support::{RawConn, TestServer, WAIT, get, put};

/// The server still answers a well-formed request.
async fn still_serving(server: &TestServer) {
    let response = get(&server.socket, "vmm.ping").await;
    assert_eq!(response.status, 200, "{response:?}");
}

#[tokio::test]
async fn garbage_bytes_do_not_kill_the_server() {
    let server = TestServer::start().await;
    for garbage in [
        &b"\x00\xff\xfe garbage \r\n\r\n"[..],
        b"GET\r\n\r\n",
        b"PUT /api/v1/vm.boot HTTP/9.9\r\n\r\n",
        b"PUT /api/v1/vm.create HTTP/1.1\r\nContent-Length: nope\r\n\r\n",
        b"PUT /api/v1/vm.create HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
        b"PUT /api/v1/vm.create HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    ] {
        let mut conn = RawConn::connect(&server.socket).await;
        conn.send(garbage).await;
        // Whatever the server answers, it ends this connection.
        assert!(conn.closed_within(WAIT).await, "{garbage:?}");
        still_serving(&server).await;
    }
    // Blank lines before a request are allowed (RFC 9112 §2.2): the connection waits for the
    // request (bounded by the header timeout) and nobody else is held up.
    let mut blank = RawConn::connect(&server.socket).await;
    blank.send(b"\r\n\r\n\r\n\r\n").await;
    still_serving(&server).await;
    blank.send(b"GET /api/v1/vmm.ping HTTP/1.1\r\n\r\n").await;
    assert_eq!(blank.response().await.status, 200);

    // A head far larger than any header buffer.
    let mut conn = RawConn::connect(&server.socket).await;
    let mut huge = b"GET /api/v1/vmm.ping HTTP/1.1\r\nX-Big: ".to_vec();
    huge.resize(1 << 20, b'a');
    let _ = tokio::io::AsyncWriteExt::write_all(&mut conn.stream, &huge).await;
    assert!(conn.closed_within(WAIT).await);
    still_serving(&server).await;
    assert_eq!(server.backend.state(), None);
}

#[tokio::test]
async fn truncated_requests_and_hang_ups_do_not_kill_the_server() {
    let server = TestServer::start().await;
    // Head cut off mid-header, then the client leaves.
    {
        let mut conn = RawConn::connect(&server.socket).await;
        conn.send(b"PUT /api/v1/vm.create HTTP/1.1\r\nContent-Len")
            .await;
    }
    still_serving(&server).await;
    // Body cut off: 10 of 100 bytes, then the client leaves.
    {
        let mut conn = RawConn::connect(&server.socket).await;
        conn.send(b"PUT /api/v1/vm.create HTTP/1.1\r\nContent-Length: 100\r\n\r\n{\"payload\"")
            .await;
    }
    still_serving(&server).await;
    // Request sent, client leaves before reading the answer.
    {
        let mut conn = RawConn::connect(&server.socket).await;
        conn.send(b"GET /api/v1/vm.info HTTP/1.1\r\n\r\n").await;
    }
    still_serving(&server).await;
    assert_eq!(
        server.backend.state(),
        None,
        "no truncated create got through"
    );
}

#[tokio::test]
async fn a_hanging_client_does_not_block_another() {
    let server = TestServer::start().await;
    // One client stuck mid-head, another stuck mid-body of vm.create.
    let mut stuck_head = RawConn::connect(&server.socket).await;
    stuck_head
        .send(b"GET /api/v1/vmm.ping HTTP/1.1\r\nHost: loc")
        .await;
    let mut stuck_body = RawConn::connect(&server.socket).await;
    stuck_body
        .send(b"PUT /api/v1/vm.create HTTP/1.1\r\nContent-Length: 100\r\n\r\n{")
        .await;
    tokio::time::sleep(Duration::from_millis(50)).await;

    let started = Instant::now();
    let client = server.client().with_timeout(Duration::from_secs(2));
    client.ping().await.expect("ping while others hang");
    client
        .create(&TestServer::config())
        .await
        .expect("create while others hang");
    // Blocked behind either would take the 10 s header/body timeout.
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    drop((stuck_head, stuck_body));
}

#[tokio::test]
async fn slow_clients_are_timed_out() {
    let server = TestServer::start_with(ServerConfig {
        header_read_timeout: Duration::from_millis(200),
        body_read_timeout: Duration::from_millis(200),
        ..ServerConfig::default()
    })
    .await;

    let mut idle = RawConn::connect(&server.socket).await;
    let mut half_head = RawConn::connect(&server.socket).await;
    half_head.send(b"GET /api/v1/vmm.ping HTTP/1.1\r\n").await;
    assert!(idle.closed_within(WAIT).await, "idle connection kept open");
    assert!(half_head.closed_within(WAIT).await, "slow head kept open");

    let mut half_body = RawConn::connect(&server.socket).await;
    half_body
        .send(b"PUT /api/v1/vm.create HTTP/1.1\r\nContent-Length: 100\r\n\r\n{")
        .await;
    let m = half_body.response().await.error(400);
    assert!(m[0].contains("timed out"), "{m:?}");
    still_serving(&server).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_concurrent_connections_are_served() {
    let server = TestServer::start().await;
    let client = server.client();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..100 {
        let client = client.clone();
        tasks.spawn(async move { client.ping().await });
    }
    while let Some(result) = tasks.join_next().await {
        result.expect("task").expect("ping");
    }
    assert_eq!(server.backend.call_count(), 100);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backend_calls_never_overlap() {
    let server = TestServer::start().await;
    let client = server.client();
    client.create(&TestServer::config()).await.expect("create");
    client.boot().await.expect("boot");
    server.backend.delay_ms.store(10, Ordering::SeqCst);
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..12 {
        let client = client.clone();
        tasks.spawn(async move {
            match i % 3 {
                0 => client.ping().await.map(drop),
                1 => client.info().await.map(drop),
                _ => client.counters().await.map(drop),
            }
        });
    }
    while let Some(result) = tasks.join_next().await {
        result.expect("task").expect("call");
    }
    assert_eq!(server.backend.max_in_call.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn keep_alive_and_connection_close_are_both_honoured() {
    let server = TestServer::start().await;
    let mut conn = RawConn::connect(&server.socket).await;
    for _ in 0..3 {
        conn.send(b"GET /api/v1/vmm.ping HTTP/1.1\r\nHost: localhost\r\n\r\n")
            .await;
        assert_eq!(conn.response().await.status, 200);
    }
    conn.send(b"PUT /api/v1/vm.delete HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .await;
    assert_eq!(conn.response().await.status, 204);
    // Errors do not end a keep-alive connection either.
    conn.send(b"GET /api/v1/nope HTTP/1.1\r\n\r\n").await;
    assert_eq!(conn.response().await.status, 404);
    conn.send(b"GET /api/v1/vmm.ping HTTP/1.1\r\nConnection: close\r\n\r\n")
        .await;
    let last = conn.response().await;
    assert_eq!(last.status, 200);
    assert!(conn.closed_within(WAIT).await, "Connection: close ignored");

    // HTTP/1.0 closes by default.
    let mut old = RawConn::connect(&server.socket).await;
    old.send(b"GET /api/v1/vmm.ping HTTP/1.0\r\n\r\n").await;
    assert_eq!(old.response().await.status, 200);
    assert!(old.closed_within(WAIT).await);
}

#[tokio::test]
async fn a_panicking_backend_call_is_a_500() {
    let server = TestServer::start().await;
    server
        .backend
        .panic_on_counters
        .store(true, Ordering::SeqCst);
    let m = get(&server.socket, "vm.counters").await.error(500);
    assert_eq!(m[0], "vm.counters failed");
    // The serialisation lock was released with the panic.
    still_serving(&server).await;
    assert_eq!(put(&server.socket, "vm.delete", None).await.status, 204);
}

/// `vm.checkpoint-wait` only waits: the calls behind it go on meanwhile, and its optional
/// body names which checkpoint, checked like every other body.
#[tokio::test]
async fn a_checkpoint_wait_runs_beside_other_calls() {
    let server = TestServer::start().await;
    let client = server.client();
    let waiting = {
        let client = client.clone();
        tokio::spawn(async move { client.checkpoint_wait(Some(Path::new("/c/1"))).await })
    };
    while server
        .backend
        .checkpoint_waits
        .lock()
        .expect("waits")
        .is_empty()
    {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    client
        .ping()
        .await
        .expect("a ping while a wait is under way");
    client
        .create(&TestServer::config())
        .await
        .expect("create too");
    assert!(!waiting.is_finished());
    server
        .backend
        .checkpoint_written
        .store(true, Ordering::SeqCst);
    let report = waiting.await.expect("task").expect("the wait");
    assert!(report.durable);
    client.checkpoint_wait(None).await.expect("without a body");
    assert_eq!(
        server
            .backend
            .checkpoint_waits
            .lock()
            .expect("waits")
            .as_slice(),
        [Some("file:///c/1".to_owned()), None]
    );
    for (body, names) in [
        (&b"{"[..], "checkpoint wait"),
        (b"{\"dir\": 1}", "dir"),
        (b"{\"destination_url\": \"http://x/y\"}", "destination_url"),
    ] {
        let m = put(&server.socket, "vm.checkpoint-wait", Some(body))
            .await
            .error(400);
        assert!(m.join(" ").contains(names), "{names}: {m:?}");
    }
    assert_eq!(
        server.backend.checkpoint_waits.lock().expect("waits").len(),
        2
    );
}
