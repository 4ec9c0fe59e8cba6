//! `echo` (STATELESS_REPLAY, fork-safe): one host-mediated call to the `echo` model with the
//! last input's text. The host records the completion as the turn's OUTPUT, so the harness
//! never emits OUTPUT itself.

use agentvm_proto::v1::{Capabilities, HarnessDescriptor, ModelCall, Resumability};

use crate::sdk::{Execution, Harness, HarnessFailure, Sink};
use crate::text::{text_message, text_of};

pub struct Echo;

pub const VERSION: &str = "1";

#[async_trait::async_trait]
impl Harness for Echo {
    fn descriptor(&self) -> HarnessDescriptor {
        HarnessDescriptor {
            id: "echo".into(),
            models: vec!["echo".into()],
            capabilities: Some(Capabilities {
                resumability: Resumability::StatelessReplay as i32,
                fork_safe: true,
                // The SDK keeps each session's history in this process (`HistoryCache`).
                incremental_history: true,
                ..Default::default()
            }),
            version: VERSION.into(),
            ..Default::default()
        }
    }

    async fn run(&self, exec: &Execution, sink: &mut Sink) -> Result<(), HarnessFailure> {
        let last = exec.start.inputs.last().map(text_of).unwrap_or_default();
        sink.model(ModelCall {
            model: "echo".into(),
            messages: vec![text_message("user", last)],
            ..Default::default()
        })
        .await?;
        Ok(())
    }
}
