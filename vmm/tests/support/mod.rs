//! Shared by the VMM's integration tests and benchmarks: spawning `agentvm-vmm`, the test
//! guest image, the serial log, and a frame-protocol link over hybrid vsock.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use agentvm_proto::guest::framing::{FrameDecoder, frame_bytes};
use agentvm_proto::guest::v1::{
    DirtyMemory, Envelope, HarnessFrame, Hello, envelope::Body, harness_frame,
};
use agentvm_proto::v1::{ControllerFrame, EventKind, Start, controller_frame, event, part};
use agentvm_vmm_api::VmmClient;
use agentvm_vmm_api::config::{
    ConsoleOutputMode, CpusConfig, MemoryConfig, SerialConfig, VmConfig, VsockConfig,
};

/// The VMM binary under test: cargo's build, or `AGENTVM_VMM_BIN` (e.g. the static build
/// from scripts/build-vmm.sh, which is what benchmarks should measure).
pub fn vmm_bin() -> std::path::PathBuf {
    std::env::var_os("AGENTVM_VMM_BIN")
        .map(Into::into)
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_agentvm-vmm").into())
}

/// Why VMM tests cannot run here, if they cannot. They print it and return early.
pub fn kvm_unavailable() -> Option<String> {
    match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
    {
        Ok(_) => None,
        Err(e) => Some(format!("/dev/kvm is not usable here ({e})")),
    }
}

/// Returns early from a test, saying why, when there is no usable KVM.
#[macro_export]
macro_rules! require_kvm {
    () => {
        if let Some(reason) = $crate::support::kvm_unavailable() {
            eprintln!("SKIPPED: {reason}; this test needs KVM");
            return;
        }
    };
}

/// A VMM process with its own directory for sockets, logs and the guest image.
pub struct Vmm {
    pub child: Child,
    pub dir: tempfile::TempDir,
    pub api: PathBuf,
    pub client: VmmClient,
}

impl Vmm {
    pub async fn spawn() -> Self {
        Self::spawn_wrapped(&[]).await
    }

    /// A VMM started through `wrapper` (a command that runs the rest of its arguments, such
    /// as `nsenter --net=…`).
    pub async fn spawn_wrapped(wrapper: &[&std::ffi::OsStr]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let api = dir.path().join("api.sock");
        let mut command = match wrapper.split_first() {
            Some((program, args)) => {
                let mut command = Command::new(program);
                command.args(args).arg(vmm_bin());
                command
            }
            None => Command::new(vmm_bin()),
        };
        let child = command
            .arg("--api-socket")
            .arg(&api)
            .stdin(Stdio::null())
            .spawn()
            .expect("spawning agentvm-vmm");
        let client = VmmClient::new(&api);
        client
            .wait_ready(Duration::from_secs(10))
            .await
            .expect("VMM API never came up");
        Self {
            child,
            dir,
            api,
            client,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Writes the test guest into the VMM's directory.
    pub fn testguest(&self) -> PathBuf {
        let path = self.path("testguest.elf");
        if !path.exists() {
            std::fs::write(&path, agentvm_testguest::TESTGUEST_ELF).unwrap();
        }
        path
    }

    pub fn serial_log(&self) -> PathBuf {
        self.path("serial.log")
    }

    pub fn vsock_socket(&self) -> PathBuf {
        self.path("vsock.sock")
    }

    /// A test-guest VM: serial to the log, vsock on the VMM's socket.
    pub fn config(&self, cpus: u8, memory_mib: u64, extra_cmdline: &str) -> VmConfig {
        let mut config = VmConfig::with_kernel(self.testguest());
        config.cpus = CpusConfig {
            boot_vcpus: cpus,
            max_vcpus: cpus,
        };
        config.memory = MemoryConfig {
            size: memory_mib << 20,
            ..MemoryConfig::default()
        };
        config.payload.cmdline = Some(format!("console=ttyS0 {extra_cmdline}").trim().to_owned());
        config.serial = SerialConfig {
            mode: ConsoleOutputMode::File,
            file: Some(self.serial_log()),
            socket: None,
        };
        config.vsock = Some(VsockConfig {
            cid: 3,
            socket: self.vsock_socket(),
            id: None,
        });
        config
    }

    /// Restores the snapshot in `dir` into this (fresh) VMM, running, with its own vsock
    /// socket in this VMM's directory.
    pub async fn restore(&self, dir: &Path) {
        let request = agentvm_vmm_api::types::RestoreConfig {
            source_url: format!("file://{}", dir.display()),
            memory_restore_mode: agentvm_vmm_api::types::MemoryRestoreMode::OnDemand,
            resume: true,
            vsock_socket: Some(self.vsock_socket()),
            serial_file: Some(self.serial_log()),
            ..Default::default()
        };
        self.client.restore(&request).await.expect("vm.restore");
    }

    /// Creates and boots `config`, then waits for the guest's ready marker.
    pub async fn boot(&self, config: &VmConfig) {
        self.client.create(config).await.expect("vm.create");
        self.client.boot().await.expect("vm.boot");
        wait_for_serial(
            &self.serial_log(),
            "TESTGUEST READY",
            Duration::from_secs(20),
        );
    }

    pub async fn shutdown(mut self) {
        let _ = self.client.shutdown_vmm().await;
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        panic!("agentvm-vmm did not exit after vmm.shutdown");
    }
}

impl Drop for Vmm {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Waits until the serial log has a line containing `marker`; returns the whole log.
pub fn wait_for_serial(log: &Path, marker: &str, timeout: Duration) -> String {
    let deadline = Instant::now() + timeout;
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if text.lines().any(|l| l.contains(marker)) {
            return text;
        }
        assert!(
            Instant::now() < deadline,
            "no `{marker}` on serial within {timeout:?}; log so far:\n{text}"
        );
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// One host → guest stream speaking the agentvm.guest.v1 frame protocol.
pub struct GuestLink {
    pub stream: UnixStream,
    decoder: FrameDecoder,
    next_id: u64,
}

impl GuestLink {
    /// `CONNECT <port>` on the VM's vsock socket; fails if the guest does not accept.
    pub fn connect(socket: &Path, port: u32) -> std::io::Result<Self> {
        let mut stream = UnixStream::connect(socket)?;
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        stream.write_all(format!("CONNECT {port}\n").as_bytes())?;
        let mut line = String::new();
        // Byte-wise, so no frame bytes after the line are consumed.
        let mut byte = [0u8];
        while !line.ends_with('\n') {
            if stream.read(&mut byte)? == 0 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::ConnectionRefused,
                    format!("vsock connect to port {port} refused (got {line:?})"),
                ));
            }
            line.push(byte[0] as char);
        }
        if !line.starts_with("OK ") {
            return Err(std::io::Error::other(format!("unexpected reply {line:?}")));
        }
        Ok(Self::from_stream(stream))
    }

    /// Connects and says Hello, retrying while a just-restored guest is still dropping the
    /// streams its snapshot cut (it processes the transport reset when it next runs).
    pub fn connect_ready(socket: &Path, port: u32) -> Self {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let attempt = Self::connect(socket, port).and_then(|mut link| {
                link.set_timeout(Duration::from_secs(2));
                link.try_hello().map(|_| link)
            });
            match attempt {
                Ok(link) => {
                    link.set_timeout(Duration::from_secs(10));
                    return link;
                }
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => panic!("guest on {} never answered: {e}", socket.display()),
            }
        }
    }

    fn try_hello(&mut self) -> std::io::Result<agentvm_proto::guest::v1::Ready> {
        self.send(Body::Hello(Hello {
            protocol_version: agentvm_proto::guest::PROTOCOL_VERSION,
            host_version: "vmm-tests".into(),
        }));
        match self.recv()?.body {
            Some(Body::Ready(ready)) => Ok(ready),
            other => Err(std::io::Error::other(format!(
                "expected Ready, got {other:?}"
            ))),
        }
    }

    /// Tells a restored or forked guest so, as the daemon does first thing; returns the
    /// generation the guest acknowledged.
    pub fn restored(&mut self, forked: bool, generation: u64, identity: &str) -> u64 {
        use agentvm_proto::guest::v1::{Identity, Restored, restored::Kind};
        self.send(Body::Restored(Restored {
            kind: if forked { Kind::Forked } else { Kind::Restored } as i32,
            entropy: identity.as_bytes().repeat(4),
            wall_clock_unix_nanos: 1_700_000_000_000_000_000,
            identity: Some(Identity {
                session_uid: identity.into(),
                hostname: identity.into(),
                vsock_cid: 3,
                vm_id: identity.into(),
            }),
            generation,
            network: None,
        }));
        match self.recv().expect("RestoredAck").body {
            Some(Body::RestoredAck(ack)) => ack.generation,
            other => panic!("expected RestoredAck, got {other:?}"),
        }
    }

    /// One counter turn on `stream`; returns the OUTPUT text and checks the END and close frames.
    pub fn counter_turn(&mut self, stream: u64, execution: &str) -> String {
        self.send(Body::Harness(HarnessFrame {
            stream,
            frame: Some(harness_frame::Frame::Controller(ControllerFrame {
                session: "s-1".into(),
                execution_id: execution.into(),
                frame: Some(controller_frame::Frame::Start(Start::default())),
            })),
        }));
        let mut frames = Vec::new();
        for _ in 0..3 {
            match self.recv().expect("harness frame").body {
                Some(Body::Harness(frame)) => {
                    assert_eq!(frame.stream, stream);
                    frames.push(frame.frame.expect("frame body"));
                }
                other => panic!("expected a harness frame, got {other:?}"),
            }
        }
        let output = match &frames[0] {
            harness_frame::Frame::Event(e) => {
                assert_eq!(e.kind, EventKind::EventOutput as i32);
                assert_eq!(e.execution_id, execution);
                match &e.body {
                    Some(event::Body::Message(m)) => match &m.parts[0].part {
                        Some(part::Part::Text(t)) => t.text.clone(),
                        other => panic!("{other:?}"),
                    },
                    other => panic!("{other:?}"),
                }
            }
            other => panic!("expected OUTPUT, got {other:?}"),
        };
        match &frames[1] {
            harness_frame::Frame::Event(e) => {
                assert_eq!(e.kind, EventKind::EventEnd as i32);
                match &e.body {
                    Some(event::Body::End(end)) => assert_eq!(end.state, "COMPLETED"),
                    other => panic!("{other:?}"),
                }
            }
            other => panic!("expected END, got {other:?}"),
        }
        assert!(matches!(&frames[2], harness_frame::Frame::Close(c) if c.code == 0));
        output
    }

    pub fn dirty(&mut self, mebibytes: u32, stamp: u32) -> (u32, u32) {
        self.send(Body::DirtyMemory(DirtyMemory { mebibytes, stamp }));
        match self.recv().expect("DirtyMemoryDone").body {
            Some(Body::DirtyMemoryDone(done)) => (done.pages, done.mismatched),
            other => panic!("expected DirtyMemoryDone, got {other:?}"),
        }
    }

    pub fn from_stream(stream: UnixStream) -> Self {
        Self {
            stream,
            decoder: FrameDecoder::default(),
            next_id: 1,
        }
    }

    pub fn send(&mut self, body: Body) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        self.send_envelope(&Envelope {
            id,
            body: Some(body),
        });
        id
    }

    pub fn send_envelope(&mut self, envelope: &Envelope) {
        self.stream.write_all(&frame_bytes(envelope)).unwrap();
    }

    /// The next frame, or an error on timeout / close / bad frame.
    pub fn recv(&mut self) -> std::io::Result<Envelope> {
        let mut buf = [0u8; 4096];
        loop {
            match self.decoder.next_frame() {
                Ok(Some(envelope)) => return Ok(envelope),
                Ok(None) => {}
                Err(e) => return Err(std::io::Error::other(e.to_string())),
            }
            let n = self.stream.read(&mut buf)?;
            if n == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            self.decoder.extend(&buf[..n]);
        }
    }

    pub fn set_timeout(&self, timeout: Duration) {
        self.stream.set_read_timeout(Some(timeout)).unwrap();
    }

    /// Hello → Ready.
    pub fn hello(&mut self) -> agentvm_proto::guest::v1::Ready {
        let id = self.send(Body::Hello(Hello {
            protocol_version: agentvm_proto::guest::PROTOCOL_VERSION,
            host_version: "vmm-tests".into(),
        }));
        let reply = self.recv().expect("reply to Hello");
        assert_eq!(reply.id, id);
        match reply.body {
            Some(Body::Ready(ready)) => ready,
            other => panic!("expected Ready, got {other:?}"),
        }
    }
}

/// Names of a process's threads that belong to a VM (vCPUs, device thread, exit watcher).
pub fn vm_threads(pid: u32) -> Vec<String> {
    thread_names(pid)
        .into_iter()
        .filter(|n| n.starts_with("vcpu") || n == "devices" || n == "vm-exit")
        .collect()
}

/// Open file descriptors and threads of a process, for leak checks.
pub fn fds_and_threads(pid: u32) -> (usize, usize) {
    let count = |dir: String| std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(0);
    (
        count(format!("/proc/{pid}/fd")),
        count(format!("/proc/{pid}/task")),
    )
}

/// What each open descriptor of a process points at, for leak reports.
pub fn fd_targets(pid: u32) -> Vec<String> {
    let mut out: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter_map(|e| std::fs::read_link(e.path()).ok())
                .map(|t| t.display().to_string())
                .collect()
        })
        .unwrap_or_default();
    out.sort();
    out
}

fn thread_names(pid: u32) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter_map(|e| std::fs::read_to_string(e.path().join("comm")).ok())
                .map(|n| n.trim().to_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// What a process holds open, for leak checks: its fd targets other than sockets (kind
/// and count), and how many sockets. API connections come and go around every request, so
/// sockets are compared as "no more than before" and everything else exactly.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holdings {
    pub files: Vec<String>,
    pub sockets: usize,
}

fn holdings(pid: u32) -> Holdings {
    let targets = fd_targets(pid);
    let sockets = targets.iter().filter(|t| t.starts_with("socket:")).count();
    let mut files: Vec<String> = targets
        .into_iter()
        .filter(|t| !t.starts_with("socket:"))
        // Pipe and anon-inode instance numbers differ between otherwise equal fds.
        .map(|t| t.split('[').next().unwrap_or_default().to_owned())
        .collect();
    files.sort();
    Holdings { files, sockets }
}

/// Holdings once the VMM is idle: no KVM VM being prepared in the background (a VMM
/// prepares the next VM right after start and after every VM ends) and no request in flight.
pub fn idle_holdings(pid: u32) -> Holdings {
    let deadline = Instant::now() + Duration::from_secs(10);
    while thread_names(pid).iter().any(|n| n == "vm-prepare") && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(100));
    holdings(pid)
}

/// Waits for a process to hold no more than `baseline` again (see [`Holdings`]) and to have
/// no VM thread left (a VM's exit watcher ends on its own, just after the VM does).
pub fn settles_to(pid: u32, baseline: &Holdings) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let now = holdings(pid);
        let preparing = thread_names(pid).iter().any(|n| n == "vm-prepare");
        if !preparing
            && vm_threads(pid).is_empty()
            && now.files == baseline.files
            && now.sockets <= baseline.sockets
        {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "holds {now:?}, expected {baseline:?}; threads: {:?}",
                thread_names(pid)
            ));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Resident memory of a process in KiB (VmRSS).
pub fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Prints one benchmark line: min, median and max of `xs`.
pub fn summary(name: &str, unit: &str, mut xs: Vec<f64>) {
    xs.sort_by(|a, b| a.total_cmp(b));
    println!(
        "{name:<50} min {:>9.2}  median {:>9.2}  max {:>9.2}  {unit}  (n={})",
        xs[0],
        xs[xs.len() / 2],
        xs[xs.len() - 1],
        xs.len()
    );
}

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
