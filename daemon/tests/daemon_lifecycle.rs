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
    let child = Command::new(env!("CARGO_BIN_EXE_agentvmd"))
        .arg("--state-dir")
        .arg(&state)
        .arg("--listen")
        .arg(format!("unix:{}", sock.display()))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut child = KillOnDrop(child);
    let deadline = Instant::now() + Duration::from_secs(20);
    // Connectable, not just present (the file exists from bind(2), before listen(2)).
    while std::os::unix::net::UnixStream::connect(&sock).is_err() {
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
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
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

/// A daemon a failing test does not leave running.
struct KillOnDrop(std::process::Child);

impl std::ops::Deref for KillOnDrop {
    type Target = std::process::Child;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl std::ops::DerefMut for KillOnDrop {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts agentvmd on `state` listening on `sock` and waits for the socket.
fn start_on(state: &std::path::Path, sock: &std::path::Path) -> std::process::Child {
    let mut child = Command::new(env!("CARGO_BIN_EXE_agentvmd"))
        .arg("--state-dir")
        .arg(state)
        .arg("--listen")
        .arg(format!("unix:{}", sock.display()))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::os::unix::net::UnixStream::connect(sock).is_err() {
        assert!(Instant::now() < deadline, "socket never appeared");
        assert!(child.try_wait().unwrap().is_none(), "agentvmd exited early");
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

fn stop(mut child: std::process::Child) {
    let _ = child.kill();
    let _ = child.wait();
}

/// Issue: a second agentvmd on the same state directory started, and one on the same socket
/// path replaced the live daemon's socket (and deleted it on exit). Both are refused now,
/// with the first daemon still reachable.
#[test]
fn a_second_agentvmd_on_the_same_state_dir_or_socket_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let sock = dir.path().join("a.sock");
    let first = start_on(&state, &sock);

    let same_state = Command::new(env!("CARGO_BIN_EXE_agentvmd"))
        .arg("--state-dir")
        .arg(&state)
        .arg("--listen")
        .arg(format!("unix:{}", dir.path().join("b.sock").display()))
        .output()
        .unwrap();
    assert!(!same_state.status.success());
    let err = String::from_utf8_lossy(&same_state.stderr);
    assert!(
        err.contains("in use by another agentvmd") && err.contains(&first.id().to_string()),
        "{err}"
    );

    let same_socket = Command::new(env!("CARGO_BIN_EXE_agentvmd"))
        .arg("--state-dir")
        .arg(dir.path().join("other-state"))
        .arg("--listen")
        .arg(format!("unix:{}", sock.display()))
        .output()
        .unwrap();
    assert!(!same_socket.status.success());
    let err = String::from_utf8_lossy(&same_socket.stderr);
    assert!(err.contains("is in use"), "{err}");
    assert!(
        std::os::unix::net::UnixStream::connect(&sock).is_ok(),
        "the first daemon is still reachable on its socket"
    );

    // A socket left by a daemon that died (kill -9) is stale, and replaced.
    stop(first);
    assert!(sock.exists());
    let second = start_on(&state, &sock);
    stop(second);
}

/// Two nodes on one host, each with its own state directory and TCP address and nothing
/// else said: their admin sockets do not collide (they did, both in the runtime directory).
#[test]
fn two_nodes_with_their_own_state_and_address_share_no_default_socket() {
    let dir = tempfile::tempdir().unwrap();
    let mut nodes = Vec::new();
    for name in ["a", "b"] {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let state = dir.path().join(name);
        let mut child = KillOnDrop(
            Command::new(env!("CARGO_BIN_EXE_agentvmd"))
                .arg("--state-dir")
                .arg(&state)
                .arg("--listen")
                .arg(format!("127.0.0.1:{port}"))
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap(),
        );
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "node {name} never listened");
            if child.try_wait().unwrap().is_some() {
                let mut err = String::new();
                std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
                panic!("node {name} exited: {err}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(
            state.join("admin.sock").exists(),
            "node {name}'s admin socket"
        );
        nodes.push(child);
    }
}

/// The sd_notify protocol against a fake NOTIFY_SOCKET: READY once both sockets accept,
/// watchdog pings at half of WATCHDOG_USEC, STOPPING on SIGTERM.
#[test]
fn notifies_systemd_ready_watchdog_and_stopping() {
    use std::os::unix::net::UnixDatagram;
    let dir = tempfile::tempdir().unwrap();
    let notify = dir.path().join("notify.sock");
    let systemd = UnixDatagram::bind(&notify).unwrap();
    systemd
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let sock = dir.path().join("run/agentvmd.sock");
    let mut child = Command::new(env!("CARGO_BIN_EXE_agentvmd"))
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .arg("--listen")
        .arg(format!("unix:{}", sock.display()))
        .env("NOTIFY_SOCKET", &notify)
        .env("WATCHDOG_USEC", "200000")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let recv = || {
        let mut buf = [0u8; 512];
        let n = systemd
            .recv(&mut buf)
            .expect("no notification from agentvmd");
        String::from_utf8_lossy(&buf[..n]).into_owned()
    };
    let ready = recv();
    assert!(ready.starts_with("READY=1\n"), "{ready}");
    assert!(sock.exists(), "READY came before the API socket");
    assert_eq!(recv(), "WATCHDOG=1");
    assert_eq!(recv(), "WATCHDOG=1");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let stopping = loop {
        let m = recv();
        if m != "WATCHDOG=1" {
            break m;
        }
    };
    assert_eq!(stopping, "STOPPING=1");
    assert!(child.wait().unwrap().success());
}

/// The shipped unit file passes `systemd-analyze verify` (with ExecStart pointed at this
/// build's binary, which verify requires to exist).
#[test]
fn the_unit_file_verifies() {
    let Ok(analyze) = which("systemd-analyze") else {
        eprintln!("SKIPPED: systemd-analyze is not installed");
        return;
    };
    let unit = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/agentvmd.service"),
    )
    .unwrap();
    assert!(unit.contains("Type=notify") && unit.contains("WatchdogSec="));
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("agentvmd.service");
    std::fs::write(
        &path,
        unit.replace("/usr/local/bin/agentvmd", env!("CARGO_BIN_EXE_agentvmd")),
    )
    .unwrap();
    let out = Command::new(analyze)
        .arg("verify")
        .arg(&path)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        !stderr.contains("agentvmd.service"),
        "verify complained about the unit: {stderr}"
    );
}

fn which(name: &str) -> Result<std::path::PathBuf, ()> {
    std::env::var_os("PATH")
        .and_then(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join(name))
                .find(|c| c.is_file())
        })
        .ok_or(())
}

#[test]
fn check_config_validates_and_prints_the_effective_settings() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("agentvmd.toml");
    std::fs::write(
        &file,
        format!(
            "state_dir = {:?}\nlisten = \"unix:/run/agentvm/x.sock\"\nmetrics_listen = \"127.0.0.1:9464\"\n",
            dir.path().join("state").display().to_string()
        ),
    )
    .unwrap();
    let run = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_agentvmd"))
            .arg("--config")
            .arg(&file)
            .arg("--check-config")
            .args(extra)
            .output()
            .unwrap()
    };
    let ok = run(&["--listen", "unix:/tmp/flag-wins.sock"]);
    assert!(ok.status.success(), "{ok:?}");
    let out = String::from_utf8_lossy(&ok.stdout);
    assert!(
        out.contains("listen = \"unix:/tmp/flag-wins.sock\""),
        "{out}"
    );
    assert!(out.contains("metrics_listen = \"127.0.0.1:9464\""), "{out}");
    assert!(out.contains("configuration is valid"), "{out}");
    assert!(
        !dir.path().join("state").exists(),
        "a check creates nothing"
    );

    std::fs::write(&file, "listen = \"unix:/x\"\nwatchdog = true\n").unwrap();
    let bad = run(&[]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("watchdog"),
        "{bad:?}"
    );

    std::fs::write(&file, "vmm_binary = \"/nonexistent/agentvm-vmm\"\n").unwrap();
    let missing = run(&[]);
    assert_eq!(missing.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&missing.stderr).contains("vmm_binary: /nonexistent/agentvm-vmm"),
        "{missing:?}"
    );
}

#[tokio::test]
async fn json_logs_are_one_object_per_line() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("run/agentvmd.sock");
    let child = Command::new(env!("CARGO_BIN_EXE_agentvmd"))
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .arg("--listen")
        .arg(format!("unix:{}", sock.display()))
        .arg("--log-format")
        .arg("json")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !sock.exists() {
        assert!(Instant::now() < deadline, "socket never appeared");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(lines.len() >= 2, "{stderr}");
    for line in lines {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        assert!(
            v["level"].is_string() && v["fields"]["message"].is_string(),
            "{line}"
        );
    }
}
