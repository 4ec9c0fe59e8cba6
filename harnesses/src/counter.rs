//! `counter` (REQUIRES_MEMORY_SNAPSHOT, not fork-safe): each turn increments an integer held
//! only in this process's memory and emits it as one OUTPUT in decimal. It never reads History
//! (I4): only a memory snapshot can carry its state across a suspend, and replaying the log
//! into it would double-count.
//!
//! The count belongs to the process, not to a session id: a memory-tier harness process
//! serves one session, and a fork child's process is a copy of its parent's with a new
//! session id, so it must go on from the parent's count (a per-id count would restart at 1).

use std::sync::atomic::{AtomicU64, Ordering};

use agentvm_proto::v1::{Capabilities, HarnessDescriptor, Resumability};

use crate::sdk::{Execution, Harness, HarnessFailure, Sink};
use crate::text::text_message;

#[derive(Default)]
pub struct Counter {
    count: AtomicU64,
}

pub const VERSION: &str = "1";

#[async_trait::async_trait]
impl Harness for Counter {
    fn descriptor(&self) -> HarnessDescriptor {
        HarnessDescriptor {
            id: "counter".into(),
            capabilities: Some(Capabilities {
                resumability: Resumability::RequiresMemorySnapshot as i32,
                ..Default::default()
            }),
            version: VERSION.into(),
            ..Default::default()
        }
    }

    async fn run(&self, _exec: &Execution, sink: &mut Sink) -> Result<(), HarnessFailure> {
        let n = self.count.fetch_add(1, Ordering::SeqCst) + 1;
        sink.output(text_message("assistant", n.to_string()))
            .await?;
        Ok(())
    }
}
