//! API security: bearer tokens and mTLS client certificates mapped to principals, per-project
//! authorization, operators for what acts on the whole node, the principal recorded on the
//! events it causes, TLS on TCP and who may listen beyond loopback.

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use agentvm_proto::node::v1::node_client::NodeClient;
use agentvm_proto::node::v1::{
    DrainRequest, GetStatusRequest, ListNodesRequest, ListProjectsRequest,
};
use agentvm_proto::v1::sessions_client::SessionsClient;
use agentvm_proto::v1::{
    CreateSessionRequest, ExecRequest, GetSessionRequest, ListSessionsRequest, ReplayRequest,
    ResourceMetadata, Session,
};
use agentvmd::api::auth::Authenticator;
use sha2::{Digest, Sha256};
use tonic::Code;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

mod support;

fn sha256_hex(b: &[u8]) -> String {
    hex::encode(Sha256::digest(b))
}

fn auth_file(dir: &Path, extra: &str) -> std::path::PathBuf {
    let path = dir.join("auth.toml");
    std::fs::write(
        &path,
        format!(
            "[[principal]]\nname = \"alice\"\nprojects = [\"team-a\"]\ntoken_sha256 = [\"{}\"]\n\n\
             [[principal]]\nname = \"bob\"\nprojects = [\"team-b\"]\ntoken_sha256 = [\"{}\"]\n{extra}",
            sha256_hex(b"alice-token"),
            sha256_hex(b"bob-token"),
        ),
    )
    .unwrap();
    path
}

fn with_token<T>(msg: T, token: &str) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    r
}

fn create_in(project: &str) -> CreateSessionRequest {
    CreateSessionRequest {
        session: Some(Session {
            harness: "echo".into(),
            metadata: Some(ResourceMetadata {
                project: project.into(),
                ..Default::default()
            }),
            ..Default::default()
        }),
    }
}

#[tokio::test]
async fn tokens_principals_and_projects() {
    let dir = tempfile::tempdir().unwrap();
    let auth = Arc::new(Authenticator::load(&auth_file(dir.path(), "")).unwrap());
    let node = support::start_with(move |cfg| cfg.auth = Some(auth)).await;
    let mut c = node.c();

    // No credential, or an unknown one.
    let err = c.create_session(create_in("team-a")).await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");
    let err = c
        .create_session(with_token(create_in("team-a"), "guess"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated);
    let err = NodeClient::new(node.channel().await)
        .get_status(GetStatusRequest {})
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated);

    // Alice works in team-a only.
    let s = c
        .create_session(with_token(create_in("team-a"), "alice-token"))
        .await
        .unwrap()
        .into_inner();
    let uid = s.metadata.unwrap().uid;
    let err = c
        .create_session(with_token(create_in("team-b"), "alice-token"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    turn_as(&mut c, &uid, "hi", "alice-token").await;

    // Bob sees neither the session nor the project.
    for code in [
        c.get_session(with_token(
            GetSessionRequest { uid: uid.clone() },
            "bob-token",
        ))
        .await
        .map(drop)
        .unwrap_err()
        .code(),
        c.replay(with_token(
            ReplayRequest {
                session: uid.clone(),
                ..Default::default()
            },
            "bob-token",
        ))
        .await
        .map(drop)
        .unwrap_err()
        .code(),
        c.exec(with_token(
            ExecRequest {
                session: uid.clone(),
                ..Default::default()
            },
            "bob-token",
        ))
        .await
        .map(drop)
        .unwrap_err()
        .code(),
    ] {
        assert_eq!(code, Code::PermissionDenied);
    }
    let err = c
        .list_sessions(with_token(
            ListSessionsRequest {
                project: "team-a".into(),
                ..Default::default()
            },
            "bob-token",
        ))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    let listed = c
        .list_sessions(with_token(
            ListSessionsRequest {
                project: "team-a".into(),
                ..Default::default()
            },
            "alice-token",
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.sessions.len(), 1);
    // Listing projects shows each principal its own only.
    let projects = |token: &'static str| {
        let node = &node;
        async move {
            NodeClient::new(node.channel().await)
                .list_projects(with_token(ListProjectsRequest {}, token))
                .await
                .unwrap()
                .into_inner()
                .projects
                .into_iter()
                .map(|p| (p.name, p.sessions))
                .collect::<Vec<_>>()
        }
    };
    assert_eq!(projects("alice-token").await, [("team-a".to_owned(), 1)]);
    assert!(projects("bob-token").await.is_empty());

    // What Alice's request caused is recorded as hers; the chain still verifies.
    let mut replay = c
        .replay(with_token(
            ReplayRequest {
                session: uid.clone(),
                ..Default::default()
            },
            "alice-token",
        ))
        .await
        .unwrap()
        .into_inner();
    let mut records = Vec::new();
    while let Some(r) = replay.message().await.unwrap() {
        records.push(r);
    }
    assert!(records.len() >= 4);
    for r in &records {
        let actor = r.event.as_ref().unwrap().actor.as_ref().expect("an actor");
        assert_eq!(actor.principal, "alice");
    }
    agentvmd::journal::verify::verify_chain(&records).unwrap();
    // The CLI carries a token from --token or AGENTVM_TOKEN.
    let (addr, session) = (
        format!("unix:{}", node.dir.join("api.sock").display()),
        uid.clone(),
    );
    let cli = move |token: Option<&str>| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_agentvm"));
        cmd.args(["get", &session, "--addr", &addr])
            .env_remove("AGENTVM_TOKEN");
        if let Some(t) = token {
            cmd.env("AGENTVM_TOKEN", t);
        }
        cmd.output().unwrap()
    };
    let out = tokio::task::spawn_blocking(move || {
        (cli(Some("alice-token")), cli(None), cli(Some("bob-token")))
    })
    .await
    .unwrap();
    assert!(out.0.status.success(), "{:?}", out.0);
    assert!(
        String::from_utf8_lossy(&out.1.stderr).contains("Unauthenticated"),
        "{:?}",
        out.1
    );
    assert!(
        String::from_utf8_lossy(&out.2.stderr).contains("PermissionDenied"),
        "{:?}",
        out.2
    );
    // Health needs no credential (probes).
    let health = tonic_health::pb::health_client::HealthClient::new(node.channel().await)
        .check(tonic_health::pb::HealthCheckRequest::default())
        .await;
    assert!(health.is_ok());
}

/// One turn on `uid` as `token`'s principal, run to its end.
async fn turn_as(c: &mut SessionsClient<Channel>, uid: &str, text: &str, token: &str) {
    let mut stream = c
        .exec(with_token(support::exec_text(uid.to_owned(), text), token))
        .await
        .unwrap()
        .into_inner();
    while stream.message().await.unwrap().is_some() {}
}

/// The events of `uid`'s log, as `token` may read them.
async fn events(
    c: &mut SessionsClient<Channel>,
    uid: &str,
    token: &str,
) -> Vec<agentvm_proto::v1::Event> {
    let mut replay = c
        .replay(with_token(
            ReplayRequest {
                session: uid.into(),
                ..Default::default()
            },
            token,
        ))
        .await
        .unwrap()
        .into_inner();
    let mut events = Vec::new();
    while let Some(r) = replay.message().await.unwrap() {
        events.push(r.event.unwrap());
    }
    events
}

/// Drain, the fleet's map and the node-wide status are an operator's: a tenant's token that
/// tries them is refused and changes nothing; an operator's drain is recorded as theirs.
#[tokio::test]
async fn node_wide_rpcs_need_an_operator_and_record_who_drained() {
    let dir = tempfile::tempdir().unwrap();
    let auth = Arc::new(
        Authenticator::load(&auth_file(
            dir.path(),
            &format!(
                "\n[[principal]]\nname = \"ops\"\nprojects = [\"team-ops\"]\noperator = true\n\
                 token_sha256 = [\"{}\"]\n",
                sha256_hex(b"ops-token")
            ),
        ))
        .unwrap(),
    );
    let node = support::start_with(move |cfg| cfg.auth = Some(auth)).await;
    let mut c = node.c();
    let bobs = c
        .create_session(with_token(create_in("team-b"), "bob-token"))
        .await
        .unwrap()
        .into_inner()
        .metadata
        .unwrap()
        .uid;
    turn_as(&mut c, &bobs, "hi", "bob-token").await;
    let before = events(&mut c, &bobs, "bob-token").await.len();

    let mut n = NodeClient::new(node.channel().await);
    let this_node = n
        .list_nodes(with_token(ListNodesRequest {}, "ops-token"))
        .await
        .unwrap()
        .into_inner()
        .this_node;
    let drain = || DrainRequest {
        name: this_node.clone(),
        timeout_secs: 30,
    };
    // Alice is a tenant: every node-wide call is refused, naming why.
    for (rpc, status) in [
        (
            "Drain",
            n.drain(with_token(drain(), "alice-token")).await.map(drop),
        ),
        (
            "ListNodes",
            n.list_nodes(with_token(ListNodesRequest {}, "alice-token"))
                .await
                .map(drop),
        ),
        (
            "GetStatus",
            n.get_status(with_token(GetStatusRequest {}, "alice-token"))
                .await
                .map(drop),
        ),
    ] {
        let status = status.unwrap_err();
        assert_eq!(status.code(), Code::PermissionDenied, "{rpc}: {status:?}");
        assert!(status.message().contains("operator"), "{rpc}: {status:?}");
    }
    // ...and changed nothing: Bob's session has no new record, and the node still serves.
    assert_eq!(events(&mut c, &bobs, "bob-token").await.len(), before);
    turn_as(&mut c, &bobs, "again", "bob-token").await;

    // Reflection tells an anonymous caller nothing on a node with auth.
    let mut reflection =
        tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient::new(
            node.channel().await,
        );
    let request = tonic_reflection::pb::v1::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(
            tonic_reflection::pb::v1::server_reflection_request::MessageRequest::ListServices(
                String::new(),
            ),
        ),
    };
    let refused = match reflection
        .server_reflection_info(tokio_stream::once(request))
        .await
    {
        Err(status) => status,
        Ok(response) => response.into_inner().message().await.unwrap_err(),
    };
    assert_eq!(refused.code(), Code::Unauthenticated, "{refused:?}");

    // The operator drains; Bob's SUSPEND names the operator.
    let drained = n
        .drain(with_token(drain(), "ops-token"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(drained.suspended, 1, "{drained:?}");
    let last = events(&mut c, &bobs, "bob-token").await.pop().unwrap();
    assert_eq!(
        last.kind,
        agentvm_proto::v1::EventKind::EventLifecycle as i32,
        "{last:?}"
    );
    assert_eq!(last.actor.unwrap().principal, "ops");
}

/// Beyond loopback someone is asked who they are: TLS alone (it proves the server, not the
/// client) is refused without an auth file or a client CA, and so are metrics beyond
/// loopback without an auth file.
#[test]
fn network_listeners_need_a_way_to_tell_callers_apart() {
    let Some(dir) = minted_certificates() else {
        return;
    };
    let d = dir.path();
    let check = |extra: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_agentvmd"))
            .arg("--state-dir")
            .arg(d.join("state"))
            .args(["--tls-cert", "server.pem", "--tls-key", "server.key"])
            .args(extra)
            .arg("--check-config")
            .current_dir(d)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, stderr) = check(&["--listen", "0.0.0.0:7443"]);
    assert!(
        !ok && stderr.contains("neither auth_file nor tls_client_ca"),
        "{stderr}"
    );
    let auth = auth_file(d, "");
    let auth = auth.to_str().unwrap();
    let (ok, stderr) = check(&["--listen", "0.0.0.0:7443", "--auth-file", auth]);
    assert!(ok, "{stderr}");
    let (ok, stderr) = check(&["--listen", "0.0.0.0:7443", "--tls-client-ca", "ca.pem"]);
    assert!(ok, "{stderr}");
    let (ok, stderr) = check(&[
        "--listen",
        "127.0.0.1:7443",
        "--metrics-listen",
        "0.0.0.0:9464",
    ]);
    assert!(!ok && stderr.contains("metrics_listen"), "{stderr}");
    let (ok, stderr) = check(&[
        "--listen",
        "127.0.0.1:7443",
        "--metrics-listen",
        "0.0.0.0:9464",
        "--auth-file",
        auth,
    ]);
    assert!(ok, "{stderr}");
}

// ---------- TLS ----------

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .stdout(Stdio::null())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA, a server certificate for localhost/127.0.0.1, a client certificate from the CA and
/// a self-signed client certificate the CA never saw.
fn certificates(dir: &Path) {
    let key = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
    ];
    let mut ca = vec!["req", "-x509"];
    ca.extend(key);
    ca.extend([
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "1",
        "-subj",
        "/CN=agentvm test CA",
    ]);
    openssl(dir, &ca);
    for (name, eku, san) in [
        (
            "server",
            "serverAuth",
            "subjectAltName=DNS:localhost,IP:127.0.0.1\n",
        ),
        ("client", "clientAuth", ""),
    ] {
        std::fs::write(
            dir.join(format!("{name}.ext")),
            format!("basicConstraints=CA:FALSE\nextendedKeyUsage={eku}\n{san}"),
        )
        .unwrap();
        let mut req = vec!["req"];
        req.extend(key);
        let (k, csr, subj) = (
            format!("{name}.key"),
            format!("{name}.csr"),
            format!("/CN={name}"),
        );
        req.extend(["-keyout", &k, "-out", &csr, "-subj", &subj]);
        openssl(dir, &req);
        let (pem, ext) = (format!("{name}.pem"), format!("{name}.ext"));
        openssl(
            dir,
            &[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                &pem,
                "-days",
                "1",
                "-extfile",
                &ext,
            ],
        );
    }
    let mut rogue = vec!["req", "-x509"];
    rogue.extend(key);
    rogue.extend([
        "-keyout",
        "rogue.key",
        "-out",
        "rogue.pem",
        "-days",
        "1",
        "-subj",
        "/CN=client",
    ]);
    openssl(dir, &rogue);
}

/// A directory holding [`certificates`], or `None`, the skip said, where the openssl
/// command that mints them is missing.
fn minted_certificates() -> Option<tempfile::TempDir> {
    if Command::new("openssl").arg("version").output().is_err() {
        eprintln!("SKIPPED: the openssl command mints this test's certificates and is missing");
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    certificates(dir.path());
    Some(dir)
}

fn der_sha256(pem_path: &Path) -> String {
    let out = Command::new("openssl")
        .args(["x509", "-outform", "DER", "-in"])
        .arg(pem_path)
        .output()
        .unwrap();
    assert!(out.status.success());
    sha256_hex(&out.stdout)
}

async fn tls_channel(dir: &Path, port: u16, client: Option<&str>) -> Result<Channel, String> {
    let mut tls = ClientTlsConfig::new()
        .domain_name("localhost")
        .ca_certificate(Certificate::from_pem(
            std::fs::read(dir.join("ca.pem")).unwrap(),
        ));
    if let Some(name) = client {
        tls = tls.identity(Identity::from_pem(
            std::fs::read(dir.join(format!("{name}.pem"))).unwrap(),
            std::fs::read(dir.join(format!("{name}.key"))).unwrap(),
        ));
    }
    Endpoint::from_shared(format!("https://127.0.0.1:{port}"))
        .unwrap()
        .tls_config(tls)
        .map_err(|e| e.to_string())?
        .connect()
        .await
        .map_err(|e| format!("{e:?}"))
}

#[tokio::test]
async fn mutual_tls_on_tcp_maps_client_certificates_to_principals() {
    let Some(dir) = minted_certificates() else {
        return;
    };
    let d = dir.path();
    let auth = auth_file(
        d,
        &format!(
            "\n[[principal]]\nname = \"ops\"\nprojects = [\"*\"]\noperator = true\n\
             client_cert_sha256 = [\"{}\"]\n",
            der_sha256(&d.join("client.pem"))
        ),
    );
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child = Command::new(env!("CARGO_BIN_EXE_agentvmd"))
        .arg("--state-dir")
        .arg(d.join("state"))
        .arg("--listen")
        .arg(format!("127.0.0.1:{port}"))
        .arg("--admin-listen")
        .arg(format!("unix:{}", d.join("admin.sock").display()))
        .args([
            "--tls-cert",
            "server.pem",
            "--tls-key",
            "server.key",
            "--tls-client-ca",
            "ca.pem",
        ])
        .arg("--auth-file")
        .arg(&auth)
        .current_dir(d)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "agentvmd never listened");
        assert!(child.try_wait().unwrap().is_none(), "agentvmd exited");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // The CA's client certificate is principal "ops".
    let channel = tls_channel(d, port, Some("client")).await.unwrap();
    let status = NodeClient::new(channel.clone())
        .get_status(GetStatusRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(status.sessions, 0);
    let created = SessionsClient::new(channel)
        .create_session(create_in("anything"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(created.metadata.unwrap().project, "anything");

    // A certificate the CA did not sign, or none, never gets an answer.
    for client in [Some("rogue"), None] {
        let refused = match tls_channel(d, port, client).await {
            Err(_) => true,
            Ok(ch) => NodeClient::new(ch)
                .get_status(GetStatusRequest {})
                .await
                .is_err(),
        };
        assert!(refused, "{client:?} was served");
    }
    // Plaintext on the TLS port is no API either.
    let plain = Endpoint::from_shared(format!("http://127.0.0.1:{port}"))
        .unwrap()
        .connect()
        .await;
    if let Ok(ch) = plain {
        assert!(
            NodeClient::new(ch)
                .get_status(GetStatusRequest {})
                .await
                .is_err()
        );
    }
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn non_loopback_tcp_needs_tls() {
    let out = Command::new(env!("CARGO_BIN_EXE_agentvmd"))
        .args(["--listen", "0.0.0.0:7443", "--check-config"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("loopback only until TLS"), "{stderr}");
}
