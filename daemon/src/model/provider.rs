//! Model providers: what the host calls when a harness asks for a completion live.
//! Replay never reaches a provider (I1); the controller serves recorded completions instead.

use agentvm_proto::v1::{Message, ModelCall, Part, TextPart, Usage, part};
use tokio::sync::mpsc;

/// One streamed chunk of the completion's text part `part_index`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    pub part_index: i32,
    pub text: String,
    pub done: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    pub message: Message,
    pub usage: Option<Usage>,
}

#[derive(Debug, thiserror::Error)]
pub enum ProviderError {
    #[error("model {model:?} is not served by provider {provider}")]
    UnknownModel {
        provider: &'static str,
        model: String,
    },
    #[error("provider {provider} is unavailable: {reason}")]
    Unavailable {
        provider: &'static str,
        reason: String,
    },
    #[error("provider {provider} rejected the request: {reason}")]
    Rejected {
        provider: &'static str,
        reason: String,
    },
}

#[async_trait::async_trait]
pub trait ModelProvider: Send + Sync {
    fn name(&self) -> &'static str;

    /// Completes `call` (its wire fields: messages, tools, tool_choice, params). When `stream`
    /// is given, text is also sent there as it is produced, ending with a `done` chunk per
    /// part; the returned completion is always the whole message.
    async fn complete(
        &self,
        call: &ModelCall,
        stream: Option<mpsc::Sender<Chunk>>,
    ) -> Result<Completion, ProviderError>;
}

/// The deterministic built-in provider, for tests and offline use. Model `echo` answers
/// `"echo:" + the text of the last message`, exactly as upstream's echo model does.
#[derive(Debug, Default, Clone, Copy)]
pub struct EchoProvider;

fn message_text(m: &Message) -> String {
    m.parts
        .iter()
        .filter_map(|p| match &p.part {
            Some(part::Part::Text(t)) => Some(t.text.as_str()),
            _ => None,
        })
        .collect()
}

#[async_trait::async_trait]
impl ModelProvider for EchoProvider {
    fn name(&self) -> &'static str {
        "builtin"
    }

    async fn complete(
        &self,
        call: &ModelCall,
        stream: Option<mpsc::Sender<Chunk>>,
    ) -> Result<Completion, ProviderError> {
        if call.model != "echo" {
            return Err(ProviderError::UnknownModel {
                provider: self.name(),
                model: call.model.clone(),
            });
        }
        let input = call.messages.last().map(message_text).unwrap_or_default();
        let text = format!("echo:{input}");
        if let Some(tx) = stream {
            // Word-sized chunks, so streaming paths see more than one delta. A closed receiver
            // only means nobody watches the stream; the completion still stands.
            let mut rest = text.as_str();
            while !rest.is_empty() {
                let cut = rest
                    .char_indices()
                    .skip(1)
                    .find(|(_, c)| *c == ' ' || *c == ':')
                    .map_or(rest.len(), |(i, _)| i);
                let (head, tail) = rest.split_at(cut);
                let _ = tx
                    .send(Chunk {
                        part_index: 0,
                        text: head.to_owned(),
                        done: false,
                    })
                    .await;
                rest = tail;
            }
            let _ = tx
                .send(Chunk {
                    part_index: 0,
                    text: String::new(),
                    done: true,
                })
                .await;
        }
        Ok(Completion {
            message: Message {
                role: "assistant".into(),
                parts: vec![Part {
                    part: Some(part::Part::Text(TextPart { text })),
                }],
            },
            usage: None,
        })
    }
}

/// Serves the built-in `echo` model itself and every other model through `upstream` (an
/// OpenAI-compatible endpoint) when one is configured.
pub struct RoutedProvider {
    pub upstream: Option<Box<dyn ModelProvider>>,
}

#[async_trait::async_trait]
impl ModelProvider for RoutedProvider {
    fn name(&self) -> &'static str {
        "routed"
    }

    async fn complete(
        &self,
        call: &ModelCall,
        stream: Option<mpsc::Sender<Chunk>>,
    ) -> Result<Completion, ProviderError> {
        match (&self.upstream, call.model.as_str()) {
            (_, "echo") | (None, _) => EchoProvider.complete(call, stream).await,
            (Some(p), _) => p.complete(call, stream).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(model: &str, texts: &[&str]) -> ModelCall {
        ModelCall {
            model: model.into(),
            messages: texts
                .iter()
                .map(|t| Message {
                    role: "user".into(),
                    parts: vec![Part {
                        part: Some(part::Part::Text(TextPart {
                            text: (*t).to_owned(),
                        })),
                    }],
                })
                .collect(),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn echo_answers_the_last_message() {
        let c = EchoProvider
            .complete(&call("echo", &["one", "two"]), None)
            .await
            .unwrap();
        assert_eq!(message_text(&c.message), "echo:two");
        assert_eq!(c.message.role, "assistant");
        let empty = EchoProvider
            .complete(&call("echo", &[]), None)
            .await
            .unwrap();
        assert_eq!(message_text(&empty.message), "echo:");
    }

    #[tokio::test]
    async fn streamed_chunks_add_up_to_the_completion() {
        let (tx, mut rx) = mpsc::channel(64);
        let c = EchoProvider
            .complete(&call("echo", &["hello big world"]), Some(tx))
            .await
            .unwrap();
        let mut chunks = Vec::new();
        while let Some(ch) = rx.recv().await {
            chunks.push(ch);
        }
        assert!(chunks.len() > 2, "{chunks:?}");
        assert!(chunks.last().unwrap().done);
        assert!(
            chunks[..chunks.len() - 1]
                .iter()
                .all(|c| !c.done && !c.text.is_empty())
        );
        let joined: String = chunks.iter().map(|c| c.text.as_str()).collect();
        assert_eq!(joined, message_text(&c.message));
    }

    #[tokio::test]
    async fn other_models_are_refused() {
        let err = EchoProvider
            .complete(&call("gpt-x", &["hi"]), None)
            .await
            .unwrap_err();
        assert!(matches!(err, ProviderError::UnknownModel { .. }));
    }
}
