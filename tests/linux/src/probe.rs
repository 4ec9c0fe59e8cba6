//! `agentvm-lane-probe --listen unix:PATH`: the lane's harness (REQUIRES_MEMORY_SNAPSHOT).
//! Each turn counts in process memory, as `counter` does, and answers one JSON object with
//! what a cloned or restored guest must not get wrong:
//! `{"count": N, "random": "<16 bytes of the kernel RNG, hex>", "unix_ms": <wall clock>}`.
//! The input `crash` aborts the process (the agent must restart it); `sleep MS` answers
//! after MS milliseconds (a turn that is surely in flight); `note TEXT` writes TEXT to
//! `note.txt` on the workspace disk first. Every answer carries `"note"`: that file as it
//! reads now (null when there is none, `"no workspace"` without one).

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
        });
        sink.output(text_message("assistant", answer.to_string()))
            .await?;
        Ok(())
    }
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
