//! `counter` (REQUIRES_MEMORY_SNAPSHOT, not fork-safe): each turn increments an integer held
//! only in this process's memory and emits it as one OUTPUT in decimal. It never reads History
//! (I4): only a memory snapshot can carry its state across a suspend, and replaying the log
//! into it would double-count.

use std::collections::HashMap;
use std::sync::Mutex;

use agentvm_proto::v1::{Capabilities, HarnessDescriptor, Resumability};

use crate::sdk::{Execution, Harness, HarnessFailure, Sink};
use crate::text::text_message;

/// One count per session, so a process serving several sessions keeps them apart.
#[derive(Default)]
pub struct Counter {
    counts: Mutex<HashMap<String, u64>>,
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

    async fn run(&self, exec: &Execution, sink: &mut Sink) -> Result<(), HarnessFailure> {
        let n = {
            let mut counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
            let n = counts.entry(exec.session.clone()).or_default();
            *n += 1;
            *n
        };
        sink.output(text_message("assistant", n.to_string()))
            .await?;
        Ok(())
    }
}
