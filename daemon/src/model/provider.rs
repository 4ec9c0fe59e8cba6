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

pub(crate) fn message_text(m: &Message) -> String {
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

    /// Answers whole, never streamed, as upstream's echo model: its deltas would be frames
    /// upstream's clients do not expect (agentctl prints each as a line of its own).
    async fn complete(
        &self,
        call: &ModelCall,
        _stream: Option<mpsc::Sender<Chunk>>,
    ) -> Result<Completion, ProviderError> {
        if call.model != "echo" {
            return Err(ProviderError::UnknownModel {
                provider: self.name(),
                model: call.model.clone(),
            });
        }
        let input = call.messages.last().map(message_text).unwrap_or_default();
        let text = format!("echo:{input}");
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

    /// Upstream's echo model answers whole: asked to stream, it sends no chunk (each would be
    /// a Delta frame upstream's agentctl prints as a line of its own).
    #[tokio::test]
    async fn the_echo_model_answers_whole_even_when_asked_to_stream() {
        let (tx, mut rx) = mpsc::channel(64);
        let c = EchoProvider
            .complete(&call("echo", &["hello big world"]), Some(tx))
            .await
            .unwrap();
        assert_eq!(message_text(&c.message), "echo:hello big world");
        assert!(rx.recv().await.is_none(), "no chunk");
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
