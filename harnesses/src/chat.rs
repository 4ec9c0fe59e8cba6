//! `chat` (STATELESS_REPLAY, fork-safe): a history-aware conversation. The model request is
//! every INPUT and OUTPUT message of History in journal order, then this turn's inputs, with an
//! optional system prompt from the JSON config `{"system_prompt": "...", "model": "..."}`.
//! Without a model in the config the call names none, and the host asks the session's model
//! (`create --model`; `echo` for a session created without one). A config that is not JSON
//! fails the turn.

use agentvm_proto::v1::{
    Capabilities, EventKind, HarnessDescriptor, ModelCall, Resumability, event::Body,
};

use crate::sdk::{Execution, Harness, HarnessFailure, Sink};
use crate::text::text_message;

pub struct Chat;

pub const VERSION: &str = "1";

struct ChatConfig {
    system_prompt: Option<String>,
    /// Empty: the session's model.
    model: String,
}

fn parse_config(config: &[u8]) -> Result<ChatConfig, HarnessFailure> {
    let mut parsed = ChatConfig {
        system_prompt: None,
        model: String::new(),
    };
    if config.is_empty() {
        return Ok(parsed);
    }
    let value: serde_json::Value = serde_json::from_slice(config)
        .map_err(|e| HarnessFailure::new(format!("chat config is not JSON: {e}")))?;
    let obj = value
        .as_object()
        .ok_or_else(|| HarnessFailure::new("chat config must be a JSON object"))?;
    if let Some(unknown) = obj
        .keys()
        .find(|k| !matches!(k.as_str(), "system_prompt" | "model"))
    {
        return Err(HarnessFailure::new(format!(
            "chat config: unknown key {unknown:?} (known: system_prompt, model)"
        )));
    }
    if let Some(p) = obj.get("system_prompt") {
        let p = p
            .as_str()
            .ok_or_else(|| HarnessFailure::new("chat config system_prompt must be a string"))?;
        parsed.system_prompt = Some(p.to_owned());
    }
    if let Some(m) = obj.get("model") {
        parsed.model = m
            .as_str()
            .ok_or_else(|| HarnessFailure::new("chat config model must be a string"))?
            .to_owned();
    }
    Ok(parsed)
}

#[async_trait::async_trait]
impl Harness for Chat {
    fn descriptor(&self) -> HarnessDescriptor {
        HarnessDescriptor {
            id: "chat".into(),
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

    fn check_config(&self, config: &[u8]) -> Result<(), HarnessFailure> {
        parse_config(config).map(drop)
    }

    async fn run(&self, exec: &Execution, sink: &mut Sink) -> Result<(), HarnessFailure> {
        let config = parse_config(&exec.start.config)?;
        let mut messages = Vec::new();
        if let Some(p) = config.system_prompt {
            messages.push(text_message("system", p));
        }
        for event in &exec.start.history {
            let conversational = event.kind == EventKind::EventInput as i32
                || event.kind == EventKind::EventOutput as i32;
            if let (true, Some(Body::Message(m))) = (conversational, &event.body) {
                messages.push(m.clone());
            }
        }
        messages.extend(exec.start.inputs.iter().cloned());
        sink.model(ModelCall {
            model: config.model,
            messages,
            ..Default::default()
        })
        .await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configs_chat_cannot_take_are_refused_naming_why() {
        let chat = Chat;
        for ok in [
            &b""[..],
            b"{}",
            br#"{"system_prompt": "be brief", "model": "echo"}"#,
        ] {
            chat.check_config(ok).unwrap();
        }
        for (bad, why) in [
            (&b"\xff not json"[..], "not JSON"),
            (b"[1]", "JSON object"),
            (br#"{"modl": "x"}"#, "unknown key \"modl\""),
            (br#"{"model": 3}"#, "model must be a string"),
            (
                br#"{"system_prompt": null}"#,
                "system_prompt must be a string",
            ),
        ] {
            let err = chat.check_config(bad).unwrap_err().description;
            assert!(err.contains(why), "{bad:?}: {err}");
        }
    }
}
