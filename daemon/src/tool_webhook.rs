//! The node's host tool executor: CONTROLLER_MEDIATED and approved REQUIRES_APPROVAL calls
//! are POSTed as JSON to an operator's HTTP endpoint (`agentvmd --tool-executor-url`).
//!
//! Request body: `{"session_uid", "call": {"id", "tool", "args", "idempotency_key",
//! "mediation"}}`, with the key also in an `Idempotency-Key: <session_uid>/<key>` header. The
//! host calls only after the TOOL_CALL intent is durable and may call again for the same key
//! after a crash, so the endpoint must answer a repeated key with its first result.
//!
//! Response: 2xx with `{"output": {…}, "content": "text", "is_error": bool, "error": "text"}`
//! (all optional; `output` must be an object). Any other status, an unreadable body or a
//! timeout is an executor error, which the harness receives and nothing records.

use std::time::Duration;

use agentvm_proto::v1::{Mediation, Part, TextPart, ToolCall, ToolResult, part};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use serde_json::{Value, json};

use crate::controller::tools::{ToolCallContext, ToolExecutor, check_args};
use crate::json::{json_to_value, struct_to_json};

/// A response larger than this is refused rather than buffered.
const RESPONSE_LIMIT: usize = 4 << 20;
/// Error bodies are quoted back to the harness only this far.
const ERROR_BODY_LIMIT: usize = 512;

#[derive(Debug, Clone)]
pub struct WebhookConfig {
    /// `http://` or `https://` URL the calls are POSTed to.
    pub url: String,
    /// Per call, from connect to the last byte.
    pub timeout: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum WebhookConfigError {
    #[error("tool executor URL {0:?} must start with http:// or https://")]
    Scheme(String),
    #[error("tool executor URL {url:?}: {reason}")]
    Invalid { url: String, reason: String },
}

pub struct WebhookExecutor {
    config: WebhookConfig,
    client: crate::json::HttpsClient,
}

impl WebhookExecutor {
    pub fn new(config: WebhookConfig) -> Result<Self, WebhookConfigError> {
        if !(config.url.starts_with("http://") || config.url.starts_with("https://")) {
            return Err(WebhookConfigError::Scheme(config.url));
        }
        config
            .url
            .parse::<hyper::Uri>()
            .map_err(|e| WebhookConfigError::Invalid {
                url: config.url.clone(),
                reason: e.to_string(),
            })?;
        Ok(Self {
            config,
            client: crate::json::https_client(),
        })
    }

    async fn post(&self, ctx: &ToolCallContext, call: &ToolCall) -> Result<Value, String> {
        let mediation = Mediation::try_from(call.mediation)
            .map(|m| m.as_str_name())
            .unwrap_or("MEDIATION_UNSPECIFIED");
        let body = json!({
            "session_uid": ctx.session_uid,
            "call": {
                "id": call.id,
                "tool": call.tool,
                "args": call.args.as_ref().map(struct_to_json).unwrap_or_else(|| json!({})),
                "idempotency_key": call.idempotency_key,
                "mediation": mediation,
            },
        });
        let req = hyper::Request::post(&self.config.url)
            .header("content-type", "application/json")
            .header(
                "idempotency-key",
                format!("{}/{}", ctx.session_uid, call.idempotency_key),
            )
            .body(Full::new(Bytes::from(body.to_string())))
            .map_err(|e| format!("building the request: {e}"))?;
        let resp = self
            .client
            .request(req)
            .await
            .map_err(|e| format!("POST {}: {e}", self.config.url))?;
        let status = resp.status();
        let bytes = Limited::new(resp.into_body(), RESPONSE_LIMIT)
            .collect()
            .await
            .map_err(|e| format!("reading the executor's answer: {e}"))?
            .to_bytes();
        if !status.is_success() {
            let mut text = String::from_utf8_lossy(&bytes).into_owned();
            if text.len() > ERROR_BODY_LIMIT {
                let mut cut = ERROR_BODY_LIMIT;
                while !text.is_char_boundary(cut) {
                    cut -= 1;
                }
                text.truncate(cut);
            }
            return Err(format!("tool executor answered HTTP {status}: {text}"));
        }
        serde_json::from_slice(&bytes)
            .map_err(|e| format!("the executor's answer is not JSON: {e}"))
    }
}

/// The executor's JSON answer as the ToolResult of `call`.
pub fn parse_answer(call: &ToolCall, answer: &Value) -> Result<ToolResult, String> {
    let obj = answer
        .as_object()
        .ok_or("the executor's answer must be a JSON object")?;
    let output = match obj.get("output") {
        None | Some(Value::Null) => None,
        Some(v @ Value::Object(_)) => match json_to_value(v).kind {
            Some(prost_types::value::Kind::StructValue(s)) => Some(s),
            _ => None,
        },
        Some(_) => return Err("output: must be a JSON object".into()),
    };
    check_args(output.as_ref()).map_err(|e| format!("output: {e}"))?;
    let text_field = |name: &str| -> Result<String, String> {
        match obj.get(name) {
            None | Some(Value::Null) => Ok(String::new()),
            Some(Value::String(s)) => Ok(s.clone()),
            Some(_) => Err(format!("{name}: must be a string")),
        }
    };
    let is_error = match obj.get("is_error") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err("is_error: must be a boolean".into()),
    };
    let content = text_field("content")?;
    Ok(ToolResult {
        id: call.id.clone(),
        output,
        is_error,
        error: text_field("error")?,
        content: if content.is_empty() {
            Vec::new()
        } else {
            vec![Part {
                part: Some(part::Part::Text(TextPart { text: content })),
            }]
        },
        ..Default::default()
    })
}

#[async_trait::async_trait]
impl ToolExecutor for WebhookExecutor {
    async fn execute(&self, ctx: &ToolCallContext, call: &ToolCall) -> Result<ToolResult, String> {
        let answer = tokio::time::timeout(self.config.timeout, self.post(ctx, call))
            .await
            .map_err(|_| {
                format!(
                    "tool executor did not answer within {:?}",
                    self.config.timeout
                )
            })??;
        let result = parse_answer(call, &answer)?;
        tracing::info!(
            session = %ctx.session_uid,
            tool = %call.tool,
            is_error = result.is_error,
            "tool executed"
        );
        Ok(result)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call() -> ToolCall {
        ToolCall {
            id: "call-1".into(),
            tool: "add".into(),
            ..Default::default()
        }
    }

    #[test]
    fn answers_become_results_of_the_call() {
        let r = parse_answer(
            &call(),
            &json!({"output": {"sum": 4}, "content": "four", "is_error": false}),
        )
        .unwrap();
        assert_eq!(r.id, "call-1");
        assert_eq!(
            struct_to_json(r.output.as_ref().unwrap()),
            json!({"sum": 4.0})
        );
        assert_eq!(r.content.len(), 1);
        let r = parse_answer(
            &call(),
            &json!({"is_error": true, "error": "no such account"}),
        )
        .unwrap();
        assert!(r.is_error && r.error == "no such account" && r.output.is_none());
    }

    #[test]
    fn malformed_answers_name_the_field() {
        for (answer, field) in [
            (json!([1]), "object"),
            (json!({"output": 3}), "output"),
            (json!({"output": {"big": 1e300}}), "output"),
            (json!({"is_error": "yes"}), "is_error"),
            (json!({"error": 5}), "error"),
            (json!({"content": {}}), "content"),
        ] {
            let err = parse_answer(&call(), &answer).unwrap_err();
            assert!(err.contains(field), "{answer}: {err}");
        }
    }

    #[test]
    fn only_http_urls_are_accepted() {
        for url in ["ftp://x", "unix:///tmp/s", "http://bad host/"] {
            let config = WebhookConfig {
                url: url.into(),
                timeout: Duration::from_secs(1),
            };
            assert!(WebhookExecutor::new(config).is_err(), "{url}");
        }
    }

    #[tokio::test]
    async fn an_unreachable_executor_is_an_executor_error() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        drop(listener);
        let exec = WebhookExecutor::new(WebhookConfig {
            url: format!("http://127.0.0.1:{port}/tools"),
            timeout: Duration::from_secs(5),
        })
        .unwrap();
        let ctx = ToolCallContext {
            session_uid: "sess-1".into(),
        };
        let err = exec.execute(&ctx, &call()).await.unwrap_err();
        assert!(err.contains("POST http://127.0.0.1"), "{err}");
    }
}
