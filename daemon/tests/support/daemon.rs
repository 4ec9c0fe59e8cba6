//! The real agentvmd binary, started in a directory of its own and driven with the real
//! `agentvm` CLI. Its log goes to `DIR/agentvmd.log` (appended across restarts).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Daemon {
    pub child: Child,
    pub api: PathBuf,
    dir: PathBuf,
}

/// Stops the daemon and the VMMs it started (they outlive a daemon by design).
impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        super::reap_vmms(&self.dir.join("state").join("vms"));
    }
}

/// The agentvm-vmm this build made (`target/<profile>/agentvm-vmm`, beside the test
/// binaries' directory).
pub fn vmm_binary() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let binary = exe
        .parent()
        .and_then(|d| d.parent())
        .unwrap()
        .join("agentvm-vmm");
    assert!(
        binary.is_file(),
        "{} is missing: build the workspace (cargo build -p agentvm-vmm) before these tests",
        binary.display()
    );
    binary
}

/// Why the microVM tests cannot run here, if they cannot.
pub fn kvm_unavailable() -> Option<String> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .err()
        .map(|e| format!("/dev/kvm is not usable here ({e})"))
}

impl Daemon {
    /// Its Sessions API address, as `--addr` takes it.
    pub fn addr(&self) -> String {
        format!("unix:{}", self.api.display())
    }
}

pub fn start_daemon(dir: &Path) -> Daemon {
    start_daemon_with(dir, &[])
}

pub fn start_daemon_with(dir: &Path, extra: &[&str]) -> Daemon {
    start_daemon_env(dir, extra, &[])
}

/// As [`start_daemon_with`], with `env` added to the daemon's environment.
pub fn start_daemon_env(dir: &Path, extra: &[&str], env: &[(String, String)]) -> Daemon {
    let api = dir.join("run/api.sock");
    let admin = dir.join("run/admin.sock");
    let _ = std::fs::remove_file(&api);
    let _ = std::fs::remove_file(&admin);
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("agentvmd.log"))
        .unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_agentvmd"))
        .arg("--state-dir")
        .arg(dir.join("state"))
        .arg("--listen")
        .arg(format!("unix:{}", api.display()))
        .arg("--admin-listen")
        .arg(format!("unix:{}", admin.display()))
        .arg("--harness-bin")
        .arg(env!("CARGO_BIN_EXE_agentvm"))
        .args(extra)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    // Connectable, not just present: a socket file exists from bind(2), a moment before
    // listen(2), and a connection in between is refused.
    let listening = |p: &Path| std::os::unix::net::UnixStream::connect(p).is_ok();
    while !(listening(&api) && listening(&admin)) {
        assert!(
            Instant::now() < deadline,
            "agentvmd sockets never appeared; its log:\n{}",
            std::fs::read_to_string(dir.join("agentvmd.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    Daemon {
        child,
        api,
        dir: dir.to_owned(),
    }
}

/// Runs `agentvm ARGS` against the daemon (AGENTVM_ADDR): (success, stdout, stderr).
pub fn cli(d: &Daemon, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_agentvm"))
        .env("AGENTVM_ADDR", d.addr())
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}
