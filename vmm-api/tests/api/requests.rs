//! Routing, method and body rules, and config validation as the server answers them.

use agentvm_vmm_api::ClientError;
use serde_json::json;

use crate::support::{RawConn, TestServer, create_body, get, put, request};

#[tokio::test]
async fn unknown_paths_are_404() {
    let server = TestServer::start().await;
    for path in [
        "/api/v1/vm.nope",
        "/",
        "/api/v1/",
        "/api/v2/vm.info",
        "/api/v1/vm.info/extra",
        "/api/v1/VM.INFO",
        "/vm.info",
    ] {
        let m = request(&server.socket, "GET", path, None).await.error(404);
        assert!(m[0].contains(path), "{path}: {m:?}");
    }
    assert_eq!(server.backend.call_count(), 0);
}

#[tokio::test]
async fn wrong_methods_are_400_naming_method_and_path() {
    let server = TestServer::start().await;
    for (method, endpoint) in [
        ("POST", "vm.boot"),
        ("GET", "vm.boot"),
        ("PUT", "vmm.ping"),
        ("DELETE", "vm.delete"),
        ("PATCH", "vm.pause"),
        ("POST", "vm.create"),
        ("GET", "vmm.shutdown"),
    ] {
        let path = format!("/api/v1/{endpoint}");
        let m = request(&server.socket, method, &path, None)
            .await
            .error(400);
        assert!(m[0].contains(method) && m[0].contains(&path), "{m:?}");
    }
    // A HEAD answer carries no body on the wire, only the status.
    let mut conn = RawConn::connect(&server.socket).await;
    conn.send(b"HEAD /api/v1/vm.info HTTP/1.1\r\nConnection: close\r\n\r\n")
        .await;
    let mut raw = Vec::new();
    let _ = tokio::time::timeout(
        crate::support::WAIT,
        tokio::io::AsyncReadExt::read_to_end(&mut conn.stream, &mut raw),
    )
    .await;
    assert!(raw.starts_with(b"HTTP/1.1 400 "), "{raw:?}");
    assert_eq!(server.backend.call_count(), 0);
}

#[tokio::test]
async fn body_less_actions_refuse_a_body() {
    let server = TestServer::start().await;
    for endpoint in [
        "vm.boot",
        "vm.pause",
        "vm.resume",
        "vm.shutdown",
        "vm.delete",
        "vmm.shutdown",
    ] {
        let m = put(&server.socket, endpoint, Some(b"{}")).await.error(400);
        assert!(m[0].contains("takes no request body"), "{endpoint}: {m:?}");
    }
    let m = request(&server.socket, "GET", "/api/v1/vmm.ping", Some(b"x"))
        .await
        .error(400);
    assert!(m[0].contains("vmm.ping"), "{m:?}");
    // Content-Length: 0 is no body.
    assert_eq!(
        put(&server.socket, "vm.delete", Some(b"")).await.status,
        204
    );
    assert_eq!(
        server.backend.calls.lock().expect("calls").as_slice(),
        ["delete"]
    );
}

#[tokio::test]
async fn create_requires_a_body() {
    let server = TestServer::start().await;
    for body in [None, Some(&b""[..])] {
        let m = put(&server.socket, "vm.create", body).await.error(400);
        assert!(m[0].contains("requires a JSON request body"), "{m:?}");
    }
    assert_eq!(server.backend.call_count(), 0);
}

#[tokio::test]
async fn bodies_over_4_mib_are_400() {
    let server = TestServer::start().await;

    // Declared too large: refused from the header alone, without sending the body.
    let mut conn = RawConn::connect(&server.socket).await;
    conn.send(
        format!(
            "PUT /api/v1/vm.create HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            (4 << 20) + 1
        )
        .as_bytes(),
    )
    .await;
    let m = conn.response().await.error(400);
    assert!(m[0].contains("exceeds"), "{m:?}");

    // Chunked, no declared length: reading stops at the limit.
    let mut conn = RawConn::connect(&server.socket).await;
    conn.send(
        b"PUT /api/v1/vm.create HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n",
    )
    .await;
    let chunk = vec![b' '; 1 << 20];
    let mut framed = format!("{:x}\r\n", chunk.len()).into_bytes();
    framed.extend_from_slice(&chunk);
    framed.extend_from_slice(b"\r\n");
    let writer = {
        let (mut read_half, mut write_half) = conn.stream.into_split();
        let writer = tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            for _ in 0..8 {
                if write_half.write_all(&framed).await.is_err() {
                    break;
                }
            }
            write_half
        });
        let mut raw = Vec::new();
        use tokio::io::AsyncReadExt;
        let _ = tokio::time::timeout(crate::support::WAIT, read_half.read_to_end(&mut raw)).await;
        let text = String::from_utf8_lossy(&raw).into_owned();
        assert!(text.starts_with("HTTP/1.1 400"), "{text}");
        assert!(text.contains("exceeds"), "{text}");
        writer
    };
    let _ = writer.await;

    // Exactly at the limit is fine.
    let mut body = create_body();
    body.resize(4 << 20, b' ');
    assert_eq!(
        put(&server.socket, "vm.create", Some(&body)).await.status,
        204
    );
    assert_eq!(server.backend.call_count(), 1);
}

#[tokio::test]
async fn malformed_json_is_400() {
    let server = TestServer::start().await;
    for body in [
        &b"{"[..],
        b"not json",
        b"[]",
        b"null",
        b"{\"payload\":{\"kernel\":\"/k\"}} trailing",
        b"\xff\xfe",
    ] {
        let m = put(&server.socket, "vm.create", Some(body))
            .await
            .error(400);
        assert_eq!(m[0], "vm.create failed", "{m:?}");
        assert_eq!(m[1], "invalid VM config", "{m:?}");
    }
    assert_eq!(server.backend.call_count(), 0);
}

#[tokio::test]
async fn unknown_fields_are_400_naming_the_field() {
    let server = TestServer::start().await;
    for (body, field) in [
        (
            json!({"payload": {"kernel": "/k"}, "disks": [{"path": "/d", "direct": true}]}),
            "direct",
        ),
        (
            json!({"payload": {"kernel": "/k"}, "net": [{"tap": "t", "num_queues": 2}]}),
            "num_queues",
        ),
        (
            json!({"payload": {"kernel": "/k"}, "rng": {"src": "/dev/urandom"}}),
            "rng",
        ),
        (
            json!({"payload": {"kernel": "/k"}, "cpus": {"boot_vcpus": 1, "max_vcpus": 1, "topology": {}}}),
            "topology",
        ),
        (
            json!({"payload": {"kernel": "/k"}, "memory": {"size": 0, "zones": []}}),
            "zones",
        ),
    ] {
        let m = put(
            &server.socket,
            "vm.create",
            Some(body.to_string().as_bytes()),
        )
        .await
        .error(400);
        assert!(
            m[2].contains(&format!("unknown field `{field}`")),
            "{field}: {m:?}"
        );
    }
    assert_eq!(server.backend.call_count(), 0);
}

#[tokio::test]
async fn invalid_values_are_400_naming_the_path() {
    let server = TestServer::start().await;
    let client = server.client();
    let cases = [
        (
            json!({"payload": {"kernel": "/k"}, "vsock": {"cid": 2, "socket": "/v"}}),
            "vsock.cid",
        ),
        (
            json!({"payload": {"kernel": "/k"}, "cpus": {"boot_vcpus": 0, "max_vcpus": 0}}),
            "cpus.boot_vcpus",
        ),
        (
            json!({"payload": {"kernel": "/k"}, "cpus": {"boot_vcpus": 2, "max_vcpus": 3}}),
            "cpus.max_vcpus",
        ),
        (
            json!({"payload": {"kernel": "/k"}, "cpus": {"boot_vcpus": "x", "max_vcpus": 1}}),
            "cpus.boot_vcpus",
        ),
        (
            json!({"payload": {"kernel": "/k"}, "memory": {"size": 0}}),
            "memory.size",
        ),
        (
            json!({"payload": {"kernel": "/k"}, "memory": {"size": 1073741825u64}}),
            "memory.size",
        ),
        (
            json!({"payload": {"kernel": "/k"}, "memory": {"size": 1073741824u64, "hugepages": true}}),
            "memory.hugepages",
        ),
        (
            json!({"payload": {"kernel": "/k"}, "serial": {"mode": "File"}}),
            "serial.file",
        ),
        (
            json!({"payload": {"kernel": "/k"}, "serial": {"mode": "Pty"}}),
            "serial.mode",
        ),
        (
            json!({"payload": {"kernel": "/k"}, "console": {"mode": "Tty"}}),
            "console.mode",
        ),
        (
            json!({"payload": {"kernel": "/k", "cmdline": "a\u{0}b"}}),
            "payload.cmdline",
        ),
        (
            json!({"payload": {"kernel": "/k", "cmdline": "x".repeat(2048)}}),
            "payload.cmdline",
        ),
        (json!({"payload": {"initramfs": "/i"}}), "payload.kernel"),
        (
            json!({"payload": {"kernel": "/k", "firmware": "/fw"}}),
            "payload.firmware",
        ),
    ];
    for (body, path) in cases {
        let err = client.put_json("vm.create", &body).await.expect_err(path);
        let ClientError::Api {
            status, messages, ..
        } = &err
        else {
            panic!("{path}: {err:?}");
        };
        assert_eq!(*status, 400, "{path}: {err}");
        assert_eq!(messages[0], "vm.create failed");
        assert!(
            messages.iter().any(|m| m.starts_with(&format!("{path}: "))),
            "{path}: {messages:?}"
        );
    }
    assert_eq!(server.backend.call_count(), 0);
}

#[tokio::test]
async fn the_error_model_is_a_json_string_array() {
    let server = TestServer::start().await;
    let response = get(&server.socket, "vm.info").await;
    assert_eq!(response.status, 404);
    assert_eq!(response.header("content-type"), Some("application/json"));
    let parsed: serde_json::Value = serde_json::from_slice(&response.body).expect("json");
    assert_eq!(parsed, json!(["vm.info failed", "VmNotCreated"]));
    let err = server.client().info().await.expect_err("no vm");
    assert_eq!(err.status(), Some(404));
    assert_eq!(
        err.api_error().map(|e| e.messages),
        Some(vec!["vm.info failed".to_owned(), "VmNotCreated".to_owned()])
    );
}
