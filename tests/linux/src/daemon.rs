//! agentvmd as a child process of the lane, restartable as an operator would restart it.

use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use agentvm_proto::v1::sessions_client::SessionsClient;
use agentvmd::config::ListenAddr;
use anyhow::{Context, bail};
use tonic::transport::Channel;

pub struct DaemonConfig {
    pub bin_dir: PathBuf,
    pub state_dir: PathBuf,
    pub image_dir: PathBuf,
    pub socket: PathBuf,
    /// agentvmd's stderr, appended to across restarts.
    pub log: PathBuf,
    pub guest_ready_timeout_secs: u64,
    /// `cloud-hypervisor` runs the sessions on the stock VMM in `bin_dir` of that name;
    /// empty, on agentvm-vmm.
    pub vmm_flavour: String,
    /// New sessions start from their image's template (`--templates`). Off but in
    /// `template-starts`: in L1 boots of the first half of the scenarios, the L1 hung (its
    /// console silent, a CPU in the kernel's int3 handler with interrupts off) right after
    /// a template was saved in 4 of 6 attempts, which no run without templates did; until
    /// that is understood, the other scenarios keep to the boot path they were written for.
    pub templates: bool,
}

pub struct Daemon {
    config: DaemonConfig,
    child: Option<Child>,
}

impl Daemon {
    pub async fn start(config: DaemonConfig) -> anyhow::Result<Self> {
        let mut daemon = Self {
            config,
            child: None,
        };
        daemon.spawn().await?;
        Ok(daemon)
    }

    async fn spawn(&mut self) -> anyhow::Result<()> {
        let c = &self.config;
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&c.log)
            .with_context(|| format!("opening {}", c.log.display()))?;
        let _ = std::fs::remove_file(&c.socket);
        let child = Command::new(c.bin_dir.join("agentvmd"))
            .arg("--state-dir")
            .arg(&c.state_dir)
            .arg("--listen")
            .arg(format!("unix:{}", c.socket.display()))
            .arg("--image-dir")
            .arg(&c.image_dir)
            .arg("--vmm-binary")
            .arg(c.bin_dir.join(match c.vmm_flavour.as_str() {
                "" => "agentvm-vmm",
                flavour => flavour,
            }))
            .args(match c.vmm_flavour.as_str() {
                "" => Vec::new(),
                flavour => vec!["--vmm-flavour", flavour],
            })
            .arg("--guest-ready-timeout-secs")
            .arg(c.guest_ready_timeout_secs.to_string())
            .arg("--templates")
            .arg(c.templates.to_string())
            // Turn checkpoints only where a scenario asks (the time-travel one, by a
            // session's annotation): every checkpoint costs emulated time in each scenario's
            // turns, and the scenarios that kill daemons and VMMs mid-way test what they
            // name, not a checkpoint's timing. The test-guest suites run with the default.
            .arg("--checkpoints-keep")
            .arg("0")
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting agentvmd")?;
        self.child = Some(child);
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(60) {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                bail!(
                    "agentvmd exited at start-up ({status}); see {}",
                    c.log.display()
                );
            }
            if c.socket.exists() && self.client().await.is_ok() {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        bail!(
            "agentvmd did not answer on {} within 60 s",
            c.socket.display()
        )
    }

    pub async fn client(&self) -> anyhow::Result<SessionsClient<Channel>> {
        let channel =
            agentvmd::client::connect(&ListenAddr::Unix(self.config.socket.clone())).await?;
        Ok(SessionsClient::new(channel))
    }

    pub async fn node_client(
        &self,
    ) -> anyhow::Result<agentvm_proto::node::v1::node_client::NodeClient<Channel>> {
        let channel =
            agentvmd::client::connect(&ListenAddr::Unix(self.config.socket.clone())).await?;
        Ok(agentvm_proto::node::v1::node_client::NodeClient::new(
            channel,
        ))
    }

    /// A new agentvmd over the same state with templates on or off (none of the lane's
    /// sessions may be running).
    pub async fn restart_with_templates(&mut self, on: bool) -> anyhow::Result<()> {
        self.kill();
        self.config.templates = on;
        self.spawn().await
    }

    /// kill -9 of agentvmd, then a new one over the same state: what a crash and a systemd
    /// restart do. The VMMs keep running and must be adopted.
    pub async fn crash_and_restart(&mut self) -> anyhow::Result<()> {
        self.kill();
        self.spawn().await
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn vm_dir(&self, session: &str) -> PathBuf {
        self.config.state_dir.join("vms").join(session)
    }

    pub fn vms_dir(&self) -> PathBuf {
        self.config.state_dir.join("vms")
    }

    /// The running VMM of `session`, from the pid file agentvmd keeps.
    pub fn vmm_pid(&self, session: &str) -> anyhow::Result<i32> {
        let file = self.vm_dir(session).join("vmm.pid");
        std::fs::read_to_string(&file)
            .with_context(|| format!("reading {}", file.display()))?
            .trim()
            .parse()
            .with_context(|| format!("parsing {}", file.display()))
    }

    /// Stops agentvmd and every VMM it started, so the L1 can power off cleanly.
    pub fn stop_all(&mut self) {
        self.kill();
        reap_vmms(&self.vms_dir());
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop_all();
    }
}

/// A zombie's or a gone process's cmdline reads empty.
pub fn process_alive(pid: i32) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| !c.is_empty())
}

pub fn signal(pid: i32, signal: nix::sys::signal::Signal) {
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), signal);
}

fn reap_vmms(vms: &Path) {
    let Ok(entries) = std::fs::read_dir(vms) else {
        return;
    };
    for entry in entries.flatten() {
        if let Some(pid) = std::fs::read_to_string(entry.path().join("vmm.pid"))
            .ok()
            .and_then(|p| p.trim().parse().ok())
        {
            signal(pid, nix::sys::signal::Signal::SIGKILL);
        }
    }
}
