//! The fake backend, a harness that serves it, and a raw HTTP/1.1 speaker for requests the
//! client would never send.

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agentvm_vmm_api::types::{
    DeviceNode, RestoreConfig, VmCheckpointReport, VmCheckpointWait, VmEgressAllow, VmForkConfig,
    VmSnapshotConfig,
};
use agentvm_vmm_api::{
    ApiError, ServerConfig, VmConfig, VmCounters, VmInfo, VmState, VmmBackend, VmmClient,
    VmmPingResponse, bind_api_socket, serve_with,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// Bound on anything a test waits for.
pub const WAIT: Duration = Duration::from_secs(5);

#[derive(Default)]
struct Vm {
    config: Option<VmConfig>,
    state: Option<VmState>,
}

/// A backend with CH's state machine and wrong-state answers, plus instrumentation.
#[derive(Default)]
pub struct FakeBackend {
    vm: Mutex<Vm>,
    /// Backend calls running right now, and the most ever seen at once.
    in_call: AtomicUsize,
    pub max_in_call: AtomicUsize,
    /// Calls made, in order.
    pub calls: Mutex<Vec<&'static str>>,
    /// Each call sleeps this long (ms) while "in" the backend.
    pub delay_ms: AtomicU64,
    /// Rules `vm.egress-allow` added, per device id.
    pub egress_rules: Mutex<BTreeMap<String, usize>>,
    /// The last restore request.
    pub restored: Mutex<Option<RestoreConfig>>,
    /// The next `counters` call panics.
    pub panic_on_counters: AtomicBool,
    pub vmm_shut_down: AtomicBool,
    /// `vm.checkpoint-wait` answers only once this is set (bounded by [`WAIT`]), with the
    /// destination it was asked for in the report's place.
    pub checkpoint_written: AtomicBool,
    pub checkpoint_waits: Mutex<Vec<Option<String>>>,
}

struct InCall<'a>(&'a FakeBackend);

impl Drop for InCall<'_> {
    fn drop(&mut self) {
        self.0.in_call.fetch_sub(1, Ordering::SeqCst);
    }
}

impl FakeBackend {
    fn enter(&self, name: &'static str) -> InCall<'_> {
        let now = self.in_call.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_in_call.fetch_max(now, Ordering::SeqCst);
        self.calls.lock().expect("calls").push(name);
        let delay = self.delay_ms.load(Ordering::SeqCst);
        if delay > 0 {
            std::thread::sleep(Duration::from_millis(delay));
        }
        InCall(self)
    }

    fn vm(&self) -> std::sync::MutexGuard<'_, Vm> {
        self.vm.lock().expect("vm")
    }

    pub fn state(&self) -> Option<VmState> {
        self.vm().state
    }

    pub fn call_count(&self) -> usize {
        self.calls.lock().expect("calls").len()
    }

    /// Moves Running/Paused/… along CH's allowed transitions, or answers 500.
    fn transition(&self, allowed_from: &[VmState], to: VmState) -> Result<(), ApiError> {
        let mut vm = self.vm();
        match vm.state {
            Some(from) if allowed_from.contains(&from) => {
                vm.state = Some(to);
                Ok(())
            }
            Some(from) => Err(ApiError::internal(format!(
                "InvalidStateTransition({from:?}, {to:?})"
            ))),
            None => Err(ApiError::internal("VmNotCreated")),
        }
    }
}

impl VmmBackend for FakeBackend {
    fn ping(&self) -> VmmPingResponse {
        let _g = self.enter("ping");
        VmmPingResponse {
            version: "v0.1.0-test".to_owned(),
            build_version: Some("test".to_owned()),
            pid: i64::from(std::process::id()),
            features: vec!["kvm".to_owned()],
        }
    }

    fn create(&self, config: VmConfig) -> Result<(), ApiError> {
        let _g = self.enter("create");
        let mut vm = self.vm();
        if vm.config.is_some() {
            return Err(ApiError::internal("VmAlreadyCreated"));
        }
        vm.config = Some(config);
        vm.state = Some(VmState::Created);
        Ok(())
    }

    fn boot(&self) -> Result<(), ApiError> {
        let _g = self.enter("boot");
        if self.vm().config.is_none() {
            return Err(ApiError::not_found("VmMissingConfig"));
        }
        self.transition(&[VmState::Created, VmState::Shutdown], VmState::Running)
            .map_err(|e| e.caused_by("VmAlreadyBooted"))
    }

    fn info(&self) -> Result<VmInfo, ApiError> {
        let _g = self.enter("info");
        let vm = self.vm();
        let (Some(config), Some(state)) = (vm.config.clone(), vm.state) else {
            return Err(ApiError::not_found("VmNotCreated"));
        };
        let booted = matches!(state, VmState::Running | VmState::Paused);
        Ok(VmInfo {
            memory_actual_size: booted.then_some(config.memory.size),
            device_tree: booted.then(|| {
                BTreeMap::from([(
                    "__serial".to_owned(),
                    DeviceNode {
                        id: "__serial".to_owned(),
                        resources: vec![
                            serde_json::json!({"PioAddressRange": {"base": 1016, "size": 8}}),
                        ],
                        children: vec![],
                        pci_bdf: None,
                    },
                )])
            }),
            config,
            state,
        })
    }

    fn pause(&self) -> Result<(), ApiError> {
        let _g = self.enter("pause");
        self.transition(&[VmState::Running], VmState::Paused)
    }

    fn resume(&self) -> Result<(), ApiError> {
        let _g = self.enter("resume");
        self.transition(&[VmState::Paused], VmState::Running)
    }

    fn shutdown(&self) -> Result<(), ApiError> {
        let _g = self.enter("shutdown");
        self.transition(&[VmState::Running, VmState::Paused], VmState::Shutdown)
            .map_err(|e| e.caused_by("VmNotRunning"))
    }

    fn delete(&self) -> Result<(), ApiError> {
        let _g = self.enter("delete");
        *self.vm() = Vm::default();
        Ok(())
    }

    fn counters(&self) -> Result<VmCounters, ApiError> {
        let _g = self.enter("counters");
        if self.panic_on_counters.swap(false, Ordering::SeqCst) {
            panic!("fake backend asked to panic");
        }
        match self.vm().state {
            Some(VmState::Running | VmState::Paused) => Ok(BTreeMap::from([(
                "_vsock0".to_owned(),
                BTreeMap::from([("rx_bytes".to_owned(), 7), ("tx_bytes".to_owned(), 9)]),
            )])),
            _ => Err(ApiError::internal("VmNotRunning")),
        }
    }

    fn checkpoint_wait(&self, request: VmCheckpointWait) -> Result<VmCheckpointReport, ApiError> {
        // Not `enter`: it runs beside the other calls.
        self.checkpoint_waits
            .lock()
            .expect("waits")
            .push(request.destination_url);
        let deadline = std::time::Instant::now() + WAIT;
        while !self.checkpoint_written.load(Ordering::SeqCst) {
            if std::time::Instant::now() > deadline {
                return Err(ApiError::internal("never written"));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(VmCheckpointReport {
            durable: true,
            ..Default::default()
        })
    }

    fn snapshot(&self, _: VmSnapshotConfig) -> Result<(), ApiError> {
        let _g = self.enter("snapshot");
        match self.vm().state {
            Some(VmState::Paused) => Ok(()),
            Some(other) => Err(ApiError::internal(format!("VM is {other:?}, not Paused"))),
            None => Err(ApiError::not_found("VmNotCreated")),
        }
    }

    fn restore(&self, config: RestoreConfig) -> Result<(), ApiError> {
        let _g = self.enter("restore");
        let mut vm = self.vm();
        if vm.state.is_some() {
            return Err(ApiError::internal("VmAlreadyCreated"));
        }
        vm.state = Some(VmState::Paused);
        *self.restored.lock().expect("restored") = Some(config);
        Ok(())
    }

    /// 404 unless a booted VM has the device, 400 without a policy; counts what it adds.
    fn egress_allow(&self, request: VmEgressAllow) -> Result<(), ApiError> {
        let _g = self.enter("egress_allow");
        let vm = self.vm();
        let (Some(config), Some(VmState::Running | VmState::Paused)) = (&vm.config, vm.state)
        else {
            return Err(ApiError::not_found("no VM is booted"));
        };
        let index = match &request.id {
            None if !config.net.is_empty() => 0,
            None => return Err(ApiError::not_found("the VM has no net device")),
            Some(id) => (0..config.net.len())
                .find(|&i| config.net[i].device_id(i) == *id)
                .ok_or_else(|| ApiError::not_found(format!("no net device {id:?}")))?,
        };
        if config.net[index].egress.is_none() {
            return Err(ApiError::bad_request("the device has no egress policy"));
        }
        *self
            .egress_rules
            .lock()
            .expect("rules")
            .entry(config.net[index].device_id(index))
            .or_default() += request.rules.len();
        Ok(())
    }

    fn fork(&self, config: VmForkConfig) -> Result<(), ApiError> {
        let _g = self.enter("fork");
        self.snapshot(VmSnapshotConfig {
            destination_url: config.destination_url,
        })
    }

    fn shutdown_vmm(&self) -> Result<(), ApiError> {
        let _g = self.enter("shutdown_vmm");
        *self.vm() = Vm::default();
        self.vmm_shut_down.store(true, Ordering::SeqCst);
        Ok(())
    }
}

/// A served fake backend. Dropping it stops the server.
pub struct TestServer {
    pub socket: PathBuf,
    pub backend: Arc<FakeBackend>,
    pub task: JoinHandle<io::Result<()>>,
    stop: Option<oneshot::Sender<()>>,
    _dir: tempfile::TempDir,
}

impl TestServer {
    pub async fn start() -> Self {
        Self::start_with(ServerConfig::default()).await
    }

    pub async fn start_with(config: ServerConfig) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("api.sock");
        let listener = bind_api_socket(&socket).expect("bind");
        let backend = Arc::new(FakeBackend::default());
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(serve_with(
            listener,
            Arc::clone(&backend) as Arc<dyn VmmBackend>,
            config,
            async {
                let _ = stopped.await;
            },
        ));
        Self {
            socket,
            backend,
            task,
            stop: Some(stop),
            _dir: dir,
        }
    }

    pub fn client(&self) -> VmmClient {
        VmmClient::new(&self.socket).with_timeout(WAIT)
    }

    /// Triggers the external shutdown future.
    pub fn stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }

    /// Waits for `serve` to return.
    pub async fn finished(&mut self) -> io::Result<()> {
        tokio::time::timeout(WAIT, &mut self.task)
            .await
            .expect("serve did not return")
            .expect("serve task")
    }

    /// A minimal valid config.
    pub fn config() -> VmConfig {
        VmConfig::with_kernel("/var/lib/sbx/vmlinux")
    }
}

/// A response as read off the wire.
#[derive(Debug)]
pub struct RawResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl RawResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// Asserts this is an API error: `status`, JSON content type, a JSON string array body.
    /// Returns the messages.
    #[track_caller]
    pub fn error(&self, status: u16) -> Vec<String> {
        assert_eq!(self.status, status, "{self:?}");
        assert_eq!(
            self.header("content-type"),
            Some("application/json"),
            "{self:?}"
        );
        let messages: Vec<String> = serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("error body is not a JSON string array ({e}): {self:?}"));
        assert!(!messages.is_empty(), "{self:?}");
        messages
    }
}

/// One connection speaking raw HTTP/1.1.
pub struct RawConn {
    pub stream: UnixStream,
    buf: Vec<u8>,
}

impl RawConn {
    pub async fn connect(socket: &Path) -> Self {
        Self {
            stream: UnixStream::connect(socket).await.expect("connect"),
            buf: Vec::new(),
        }
    }

    pub async fn send(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).await.expect("write");
    }

    /// Reads one response (Content-Length framed, or to EOF without one).
    pub async fn response(&mut self) -> RawResponse {
        tokio::time::timeout(WAIT, self.read_response())
            .await
            .expect("no response in time")
    }

    async fn read_response(&mut self) -> RawResponse {
        let head_end = loop {
            if let Some(i) = find(&self.buf, b"\r\n\r\n") {
                break i;
            }
            assert!(
                self.fill().await > 0,
                "EOF before a response head: {:?}",
                self.buf
            );
        };
        let head = String::from_utf8_lossy(&self.buf[..head_end]).into_owned();
        self.buf.drain(..head_end + 4);
        let mut lines = head.split("\r\n");
        let status_line = lines.next().unwrap_or_default();
        let status = status_line
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("bad status line {status_line:?}"));
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(n, v)| (n.trim().to_owned(), v.trim().to_owned()))
            .collect();
        let length = headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case("content-length"))
            .and_then(|(_, v)| v.parse::<usize>().ok());
        let body = match length {
            Some(n) => {
                while self.buf.len() < n {
                    assert!(self.fill().await > 0, "EOF inside a body");
                }
                self.buf.drain(..n).collect()
            }
            None if status == 204 => Vec::new(),
            None => {
                while self.fill().await > 0 {}
                std::mem::take(&mut self.buf)
            }
        };
        RawResponse {
            status,
            headers,
            body,
        }
    }

    async fn fill(&mut self) -> usize {
        let mut chunk = [0u8; 8192];
        let n = self.stream.read(&mut chunk).await.unwrap_or(0);
        self.buf.extend_from_slice(&chunk[..n]);
        n
    }

    /// True if the server closes the connection within `within` (anything it sends first is
    /// read and dropped).
    pub async fn closed_within(&mut self, within: Duration) -> bool {
        let drain = async {
            let mut chunk = [0u8; 8192];
            while let Ok(n @ 1..) = self.stream.read(&mut chunk).await {
                let _ = n;
            }
        };
        tokio::time::timeout(within, drain).await.is_ok()
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Sends one request with `Connection: close` and reads the response.
pub async fn request(socket: &Path, method: &str, path: &str, body: Option<&[u8]>) -> RawResponse {
    let mut conn = RawConn::connect(socket).await;
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n");
    if let Some(body) = body {
        head.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    head.push_str("\r\n");
    let mut bytes = head.into_bytes();
    bytes.extend_from_slice(body.unwrap_or_default());
    conn.send(&bytes).await;
    conn.response().await
}

pub async fn get(socket: &Path, endpoint: &str) -> RawResponse {
    request(socket, "GET", &format!("/api/v1/{endpoint}"), None).await
}

pub async fn put(socket: &Path, endpoint: &str, body: Option<&[u8]>) -> RawResponse {
    request(socket, "PUT", &format!("/api/v1/{endpoint}"), body).await
}

/// The minimal valid create body as bytes.
pub fn create_body() -> Vec<u8> {
    serde_json::to_vec(&TestServer::config()).expect("encode")
}
