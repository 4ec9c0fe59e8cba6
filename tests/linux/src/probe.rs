//! `agentvm-lane-probe --listen unix:PATH`: the lane's harness (REQUIRES_MEMORY_SNAPSHOT).
//! Each turn counts in process memory, as `counter` does, and answers one JSON object with
//! what a cloned or restored guest must not get wrong:
//! `{"count": N, "random": "<16 bytes of the kernel RNG, hex>", "unix_ms": <wall clock>}`.
//! The input `crash` aborts the process (the agent must restart it); `sleep MS` answers
//! after MS milliseconds (a turn that is surely in flight); `note TEXT` writes TEXT to
//! `note.txt` on the workspace disk first. Every answer carries `"note"`: that file as it
//! reads now (null when there is none, `"no workspace"` without one). `connect HOST:PORT`
//! resolves HOST through the name server in /etc/resolv.conf (its own query, so what the
//! host's resolver answers is what it sees), connects over TCP and reads one line; the
//! answer's `"connect"` is `{"source": "<the guest's address>", "line": "..."}` or
//! `{"error": "..."}`.

use std::io::Read;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use agentvm_harnesses::text::{text_message, text_of};
use agentvm_harnesses::{Execution, Harness, HarnessFailure, Sink};
use agentvm_proto::v1::{Capabilities, HarnessDescriptor, Resumability};

#[derive(Default)]
struct Probe {
    count: AtomicU64,
}

fn kernel_random() -> Result<String, HarnessFailure> {
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(|e| HarnessFailure::new(format!("reading /dev/urandom: {e}")))?;
    Ok(hex::encode(bytes))
}

/// Writes `write` to the workspace's note.txt when given; the note as it reads now.
fn workspace_note(write: Option<&str>) -> Result<serde_json::Value, HarnessFailure> {
    let Ok(workspace) = std::env::var("AGENTVM_WORKSPACE") else {
        return Ok("no workspace".into());
    };
    let path = std::path::Path::new(&workspace).join("note.txt");
    if let Some(text) = write {
        std::fs::write(&path, text)
            .map_err(|e| HarnessFailure::new(format!("writing {}: {e}", path.display())))?;
    }
    Ok(match std::fs::read_to_string(&path) {
        Ok(text) => text.into(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => serde_json::Value::Null,
        Err(e) => {
            return Err(HarnessFailure::new(format!(
                "reading {}: {e}",
                path.display()
            )));
        }
    })
}

#[async_trait::async_trait]
impl Harness for Probe {
    fn descriptor(&self) -> HarnessDescriptor {
        HarnessDescriptor {
            id: "lane-probe".into(),
            capabilities: Some(Capabilities {
                resumability: Resumability::RequiresMemorySnapshot as i32,
                ..Default::default()
            }),
            version: "1".into(),
            ..Default::default()
        }
    }

    async fn run(&self, exec: &Execution, sink: &mut Sink) -> Result<(), HarnessFailure> {
        let input = exec.start.inputs.last().map(text_of).unwrap_or_default();
        if input == "crash" {
            std::process::abort();
        }
        if let Some(ms) = input.strip_prefix("sleep ").and_then(|m| m.parse().ok()) {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        let note = workspace_note(input.strip_prefix("note "))?;
        let connect = match input.strip_prefix("connect ") {
            Some(target) => match connect(target).await {
                Ok((source, line)) => serde_json::json!({"source": source, "line": line}),
                Err(e) => serde_json::json!({"error": e}),
            },
            None => serde_json::Value::Null,
        };
        let count = self.count.fetch_add(1, Ordering::SeqCst) + 1;
        let unix_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or_default();
        let answer = serde_json::json!({
            "count": count,
            "random": kernel_random()?,
            "unix_ms": unix_ms,
            "note": note,
            "connect": connect,
        });
        sink.output(text_message("assistant", answer.to_string()))
            .await?;
        Ok(())
    }
}

const NET_TIMEOUT: Duration = Duration::from_secs(3);

/// Connects to `HOST:PORT`; the local address and the first line the server sent.
async fn connect(target: &str) -> Result<(String, String), String> {
    let (host, port) = target
        .rsplit_once(':')
        .ok_or_else(|| format!("{target:?}: HOST:PORT expected"))?;
    let port: u16 = port
        .parse()
        .map_err(|_| format!("{port:?} is not a port"))?;
    let address = match host.parse::<std::net::Ipv4Addr>() {
        Ok(a) => a,
        Err(_) => resolve(host).await?,
    };
    let mut stream =
        tokio::time::timeout(NET_TIMEOUT, tokio::net::TcpStream::connect((address, port)))
            .await
            .map_err(|_| format!("connecting to {address}:{port} timed out"))?
            .map_err(|e| format!("connecting to {address}:{port}: {e}"))?;
    let source = stream
        .local_addr()
        .map(|a| a.ip().to_string())
        .map_err(|e| e.to_string())?;
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while line.len() < 256 {
        match tokio::time::timeout(
            NET_TIMEOUT,
            tokio::io::AsyncReadExt::read(&mut stream, &mut byte),
        )
        .await
        {
            Ok(Ok(1)) if byte[0] != b'\n' => line.push(byte[0]),
            Ok(Ok(_)) => break,
            Ok(Err(e)) => return Err(format!("reading from {address}:{port}: {e}")),
            Err(_) => return Err(format!("reading from {address}:{port} timed out")),
        }
    }
    Ok((source, String::from_utf8_lossy(&line).into_owned()))
}

/// `name`'s first A record from the name server /etc/resolv.conf names.
async fn resolve(name: &str) -> Result<std::net::Ipv4Addr, String> {
    let conf = std::fs::read_to_string("/etc/resolv.conf")
        .map_err(|e| format!("/etc/resolv.conf: {e}"))?;
    let server: std::net::Ipv4Addr = conf
        .lines()
        .find_map(|l| l.strip_prefix("nameserver "))
        .and_then(|s| s.trim().parse().ok())
        .ok_or("/etc/resolv.conf names no IPv4 name server")?;
    let mut query = vec![0x4c, 0x61, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0];
    for label in name.split('.') {
        query.push(label.len() as u8);
        query.extend_from_slice(label.as_bytes());
    }
    query.extend_from_slice(&[0, 0, 1, 0, 1]);
    let socket = tokio::net::UdpSocket::bind("0.0.0.0:0")
        .await
        .map_err(|e| e.to_string())?;
    socket
        .send_to(&query, (server, 53))
        .await
        .map_err(|e| format!("asking {server}: {e}"))?;
    let mut reply = [0u8; 512];
    let n = tokio::time::timeout(NET_TIMEOUT, socket.recv(&mut reply))
        .await
        .map_err(|_| format!("{server} did not answer for {name}"))?
        .map_err(|e| e.to_string())?;
    let reply = &reply[..n];
    if reply.len() < 12 || reply[..2] != query[..2] {
        return Err(format!("{server} answered garbage for {name}"));
    }
    match reply[3] & 0x0f {
        0 => {}
        5 => return Err(format!("{server} refused {name}")),
        code => return Err(format!("{server} answered rcode {code} for {name}")),
    }
    // The answers follow the echoed question; the last 4 bytes of the first A record.
    let first = query.len();
    let record = reply
        .get(first..first + 16)
        .ok_or_else(|| format!("{server} had no address for {name}"))?;
    Ok(std::net::Ipv4Addr::new(
        record[12], record[13], record[14], record[15],
    ))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let path = match args.as_slice() {
        [listen, addr] if listen == "--listen" => addr.strip_prefix("unix:").map(str::to_owned),
        _ => None,
    };
    let Some(path) = path.filter(|p| !p.is_empty()) else {
        eprintln!("usage: agentvm-lane-probe --listen unix:PATH");
        return ExitCode::from(2);
    };
    match agentvm_harnesses::server::serve_on_unix_socket(Arc::new(Probe::default()), &path) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("agentvm-lane-probe: {e}");
            ExitCode::FAILURE
        }
    }
}
