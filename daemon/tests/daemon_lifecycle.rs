//! agentvmd starts on a fresh state directory, answers gRPC health on its unix socket, and
//! stops cleanly on SIGTERM, removing its socket.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use agentvmd::config::ListenAddr;
use tonic_health::pb::{
    HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
};

#[tokio::test]
async fn serves_health_on_unix_socket_and_stops_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("run/agentvmd.sock");
    let state = dir.path().join("state");
    let mut child = Command::new(env!("CARGO_BIN_EXE_agentvmd"))
        .arg("--state-dir")
        .arg(&state)
        .arg("--listen")
        .arg(format!("unix:{}", sock.display()))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !sock.exists() {
        assert!(Instant::now() < deadline, "socket never appeared");
        assert!(child.try_wait().unwrap().is_none(), "agentvmd exited early");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let channel = agentvmd::client::connect(&ListenAddr::Unix(sock.clone()))
        .await
        .unwrap();
    let channel_keepalive = channel.clone();
    let resp = HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(resp.status(), ServingStatus::Serving);
    assert!(state.join("journal.db").exists());

    // The channel stays open on purpose: shutdown must not wait forever for idle clients.
    let _held = channel_keepalive;
    // SAFETY: kill(2) on our own child's pid with a valid signal number.
    let rc = unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert_eq!(rc, 0);
    let status = child.wait().unwrap();
    assert!(status.success(), "{status:?}");
    assert!(!sock.exists(), "socket left behind");
}

#[test]
fn refuses_a_path_that_is_not_a_socket() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("not-a-socket");
    std::fs::write(&file, b"keep me").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_agentvmd"))
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .arg("--listen")
        .arg(format!("unix:{}", file.display()))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("is not a socket"));
    assert_eq!(std::fs::read(&file).unwrap(), b"keep me");
}
