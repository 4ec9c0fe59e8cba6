//! An OpenAI-compatible chat-completions provider (OpenAI, vLLM, llama.cpp, Ollama …) over
//! HTTP/1.1, TLS by rustls with the webpki roots. Tool definitions and tool choice are passed
//! through, tool calls come back as `tool_call` parts, and with a stream the text arrives as
//! server-sent events that become Deltas. The API key lives only in this process's memory and
//! the Authorization header: it is never journaled or logged.

use std::path::Path;
use std::time::Duration;

use agentvm_proto::v1::{
    Message, ModelCall, Part, TextPart, ToolCall, Usage, part, tool_choice::Mode,
};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use prost_types::Struct;
use serde_json::{Map, Value, json};
use tokio::sync::mpsc;

use super::provider::{Chunk, Completion, ModelProvider, ProviderError};
use crate::json::{json_to_value, struct_to_json};

const NAME: &str = "openai";
/// Error bodies are quoted back to the harness only this far.
const ERROR_BODY_LIMIT: usize = 512;

#[derive(Debug, Clone)]
pub struct OpenAiConfig {
    /// Up to and including the version path, e.g. `https://api.openai.com/v1`.
    pub base_url: String,
    pub api_key: Option<String>,
    /// Per request, from connect to the last byte.
    pub timeout: Duration,
}

/// Reads the API key from a file (first line, trimmed) or else an environment variable.
pub fn load_api_key(env_var: Option<&str>, file: Option<&Path>) -> std::io::Result<Option<String>> {
    if let Some(path) = file {
        let text = std::fs::read_to_string(path)?;
        let key = text.lines().next().unwrap_or_default().trim().to_owned();
        return Ok((!key.is_empty()).then_some(key));
    }
    Ok(env_var
        .and_then(|v| std::env::var(v).ok())
        .map(|k| k.trim().to_owned())
        .filter(|k| !k.is_empty()))
}

pub struct OpenAiProvider {
    config: OpenAiConfig,
    client: crate::json::HttpsClient,
}

fn unavailable(reason: impl Into<String>) -> ProviderError {
    ProviderError::Unavailable {
        provider: NAME,
        reason: reason.into(),
    }
}

fn rejected(reason: impl Into<String>) -> ProviderError {
    ProviderError::Rejected {
        provider: NAME,
        reason: reason.into(),
    }
}

impl OpenAiProvider {
    pub fn new(config: OpenAiConfig) -> Self {
        Self {
            config,
            client: crate::json::https_client(),
        }
    }

    async fn post(
        &self,
        body: Value,
    ) -> Result<hyper::Response<hyper::body::Incoming>, ProviderError> {
        let url = format!(
            "{}/chat/completions",
            self.config.base_url.trim_end_matches('/')
        );
        let mut req = hyper::Request::post(&url)
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream");
        if let Some(key) = &self.config.api_key {
            req = req.header("authorization", format!("Bearer {key}"));
        }
        let req = req
            .body(Full::new(Bytes::from(body.to_string())))
            .map_err(|e| rejected(format!("building the request to {url}: {e}")))?;
        let resp = self
            .client
            .request(req)
            .await
            .map_err(|e| unavailable(format!("POST {url}: {e}")))?;
        let status = resp.status();
        if status.is_success() {
            return Ok(resp);
        }
        let body = resp
            .into_body()
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let mut text = String::from_utf8_lossy(&body).into_owned();
        text.truncate(ERROR_BODY_LIMIT);
        let reason = format!("HTTP {status}: {text}");
        Err(if status.as_u16() == 429 || status.is_server_error() {
            unavailable(reason)
        } else {
            rejected(reason)
        })
    }
}

#[async_trait::async_trait]
impl ModelProvider for OpenAiProvider {
    fn name(&self) -> &'static str {
        NAME
    }

    async fn complete(
        &self,
        call: &ModelCall,
        stream: Option<mpsc::Sender<Chunk>>,
    ) -> Result<Completion, ProviderError> {
        let body = request_body(call, stream.is_some())?;
        let work = async {
            let resp = self.post(body).await?;
            match stream {
                None => {
                    let bytes = resp
                        .into_body()
                        .collect()
                        .await
                        .map_err(|e| unavailable(format!("reading the response: {e}")))?
                        .to_bytes();
                    let v: Value = serde_json::from_slice(&bytes)
                        .map_err(|e| rejected(format!("response is not JSON: {e}")))?;
                    parse_completion(&v, &call.model)
                }
                Some(tx) => read_stream(resp.into_body(), tx, &call.model).await,
            }
        };
        tokio::time::timeout(self.config.timeout, work)
            .await
            .map_err(|_| {
                unavailable(format!(
                    "no complete answer within {:?}",
                    self.config.timeout
                ))
            })?
    }
}

/// The chat-completions request for a host-mediated model call.
pub fn request_body(call: &ModelCall, stream: bool) -> Result<Value, ProviderError> {
    let mut messages = Vec::new();
    for m in &call.messages {
        messages.extend(chat_messages(m)?);
    }
    let mut body = Map::new();
    body.insert("model".into(), json!(call.model));
    body.insert("messages".into(), Value::Array(messages));
    if stream {
        body.insert("stream".into(), json!(true));
        body.insert("stream_options".into(), json!({"include_usage": true}));
    }
    if !call.tools.is_empty() {
        let tools = call
            .tools
            .iter()
            .map(|t| {
                json!({
                    "type": "function",
                    "function": {
                        "name": t.name,
                        "description": t.description,
                        "parameters": t.input_schema.as_ref().map(struct_to_json).unwrap_or_else(|| json!({"type": "object"})),
                    }
                })
            })
            .collect();
        body.insert("tools".into(), Value::Array(tools));
    }
    if let Some(choice) = &call.tool_choice {
        let v = match Mode::try_from(choice.mode).unwrap_or(Mode::Unspecified) {
            _ if !choice.name.is_empty() => {
                json!({"type": "function", "function": {"name": choice.name}})
            }
            Mode::Auto => json!("auto"),
            Mode::None => json!("none"),
            Mode::Required => json!("required"),
            Mode::Unspecified => Value::Null,
        };
        if !v.is_null() {
            body.insert("tool_choice".into(), v);
        }
    }
    // Params are strings on the wire; numbers and booleans are sent as such.
    for (k, v) in &call.params {
        if matches!(
            k.as_str(),
            "model" | "messages" | "stream" | "tools" | "tool_choice"
        ) {
            return Err(rejected(format!("param {k:?} is set by the host")));
        }
        let value = serde_json::from_str::<Value>(v)
            .ok()
            .filter(|p| p.is_number() || p.is_boolean())
            .unwrap_or_else(|| json!(v));
        body.insert(k.clone(), value);
    }
    Ok(Value::Object(body))
}

fn chat_messages(m: &Message) -> Result<Vec<Value>, ProviderError> {
    let mut text = String::new();
    let mut tool_calls = Vec::new();
    let mut results = Vec::new();
    for p in &m.parts {
        match &p.part {
            Some(part::Part::Text(t)) => text.push_str(&t.text),
            Some(part::Part::Data(d)) => {
                let v = d.data.as_ref().map(struct_to_json).unwrap_or(Value::Null);
                text.push_str(&v.to_string());
            }
            Some(part::Part::ToolCall(c)) => tool_calls.push(json!({
                "id": c.id,
                "type": "function",
                "function": {
                    "name": c.tool,
                    "arguments": c.args.as_ref().map(struct_to_json).unwrap_or_else(|| json!({})).to_string(),
                }
            })),
            Some(part::Part::ToolResult(r)) => {
                let content: String = r
                    .content
                    .iter()
                    .filter_map(|p| match &p.part {
                        Some(part::Part::Text(t)) => Some(t.text.clone()),
                        _ => None,
                    })
                    .collect();
                let content = if !content.is_empty() {
                    content
                } else if r.is_error {
                    r.error.clone()
                } else {
                    r.output.as_ref().map(struct_to_json).unwrap_or(Value::Null).to_string()
                };
                results.push(json!({"role": "tool", "tool_call_id": r.id, "content": content}));
            }
            // Opaque reasoning belongs to the provider that produced it (I2); not resent.
            Some(part::Part::Reasoning(_)) | None => {}
            Some(part::Part::File(_)) => {
                return Err(rejected("file parts are not supported by the chat-completions provider"));
            }
        }
    }
    let mut out = Vec::new();
    if !text.is_empty() || !tool_calls.is_empty() || results.is_empty() {
        let mut msg = Map::new();
        msg.insert("role".into(), json!(m.role));
        msg.insert(
            "content".into(),
            if text.is_empty() && !tool_calls.is_empty() {
                Value::Null
            } else {
                json!(text)
            },
        );
        if !tool_calls.is_empty() {
            msg.insert("tool_calls".into(), Value::Array(tool_calls));
        }
        out.push(Value::Object(msg));
    }
    out.extend(results);
    Ok(out)
}

fn tool_call_part(id: &str, name: &str, arguments: &str) -> Result<Part, ProviderError> {
    let args: Value = if arguments.trim().is_empty() {
        json!({})
    } else {
        serde_json::from_str(arguments)
            .map_err(|e| rejected(format!("tool call {id:?} arguments are not JSON: {e}")))?
    };
    let Value::Object(obj) = args else {
        return Err(rejected(format!(
            "tool call {id:?} arguments are not a JSON object"
        )));
    };
    Ok(Part {
        part: Some(part::Part::ToolCall(ToolCall {
            id: id.to_owned(),
            tool: name.to_owned(),
            args: Some(Struct {
                fields: obj
                    .iter()
                    .map(|(k, v)| (k.clone(), json_to_value(v)))
                    .collect(),
            }),
            ..Default::default()
        })),
    })
}

fn text_part(text: String) -> Part {
    Part {
        part: Some(part::Part::Text(TextPart { text })),
    }
}

fn usage_of(v: &Value, model: &str) -> Option<Usage> {
    let u = v.get("usage").filter(|u| u.is_object())?;
    let n = |x: Option<&Value>| x.and_then(Value::as_i64).unwrap_or(0);
    Some(Usage {
        model: model.to_owned(),
        input_tokens: n(u.get("prompt_tokens")),
        output_tokens: n(u.get("completion_tokens")),
        reasoning_tokens: n(u.pointer("/completion_tokens_details/reasoning_tokens")),
    })
}

/// A non-streamed chat completion.
pub fn parse_completion(v: &Value, model: &str) -> Result<Completion, ProviderError> {
    let msg = v
        .pointer("/choices/0/message")
        .ok_or_else(|| rejected("response has no choices[0].message"))?;
    let mut parts = Vec::new();
    if let Some(text) = msg.get("content").and_then(Value::as_str)
        && !text.is_empty()
    {
        parts.push(text_part(text.to_owned()));
    }
    for call in msg
        .get("tool_calls")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let id = call.get("id").and_then(Value::as_str).unwrap_or_default();
        let f = call.get("function").unwrap_or(&Value::Null);
        parts.push(tool_call_part(
            id,
            f.get("name").and_then(Value::as_str).unwrap_or_default(),
            f.get("arguments")
                .and_then(Value::as_str)
                .unwrap_or_default(),
        )?);
    }
    Ok(Completion {
        message: Message {
            role: "assistant".into(),
            parts,
        },
        usage: usage_of(v, model),
    })
}

#[derive(Default)]
struct StreamedCall {
    id: String,
    name: String,
    arguments: String,
}

/// Reads server-sent events: text deltas go to `tx` as they arrive; the finished message is
/// assembled from all of them.
async fn read_stream(
    mut body: hyper::body::Incoming,
    tx: mpsc::Sender<Chunk>,
    model: &str,
) -> Result<Completion, ProviderError> {
    let mut pending = Vec::<u8>::new();
    let mut text = String::new();
    let mut calls: Vec<StreamedCall> = Vec::new();
    let mut usage = None;
    let mut done = false;
    while !done {
        let Some(frame) = body.frame().await else {
            break;
        };
        let frame = frame.map_err(|e| unavailable(format!("reading the event stream: {e}")))?;
        let Some(data) = frame.data_ref() else {
            continue;
        };
        pending.extend_from_slice(data);
        while let Some(end) = pending.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = pending.drain(..=end).collect();
            let line = String::from_utf8_lossy(&line);
            let Some(payload) = line.trim_end().strip_prefix("data:") else {
                continue;
            };
            let payload = payload.trim();
            if payload == "[DONE]" {
                done = true;
                break;
            }
            let v: Value = serde_json::from_str(payload)
                .map_err(|e| rejected(format!("event is not JSON: {e}")))?;
            if let Some(u) = usage_of(&v, model) {
                usage = Some(u);
            }
            let Some(delta) = v.pointer("/choices/0/delta") else {
                continue;
            };
            if let Some(t) = delta.get("content").and_then(Value::as_str)
                && !t.is_empty()
            {
                text.push_str(t);
                let _ = tx
                    .send(Chunk {
                        part_index: 0,
                        text: t.to_owned(),
                        done: false,
                    })
                    .await;
            }
            for c in delta
                .get("tool_calls")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                let index = c.get("index").and_then(Value::as_u64).unwrap_or(0) as usize;
                if index > 1024 {
                    return Err(rejected("tool call index out of range"));
                }
                if calls.len() <= index {
                    calls.resize_with(index + 1, StreamedCall::default);
                }
                let slot = &mut calls[index];
                if let Some(id) = c.get("id").and_then(Value::as_str) {
                    slot.id = id.to_owned();
                }
                if let Some(n) = c.pointer("/function/name").and_then(Value::as_str) {
                    slot.name.push_str(n);
                }
                if let Some(a) = c.pointer("/function/arguments").and_then(Value::as_str) {
                    slot.arguments.push_str(a);
                }
            }
        }
    }
    let _ = tx
        .send(Chunk {
            part_index: 0,
            text: String::new(),
            done: true,
        })
        .await;
    let mut parts = Vec::new();
    if !text.is_empty() {
        parts.push(text_part(text));
    }
    for c in &calls {
        parts.push(tool_call_part(&c.id, &c.name, &c.arguments)?);
    }
    Ok(Completion {
        message: Message {
            role: "assistant".into(),
            parts,
        },
        usage,
    })
}

#[cfg(test)]
pub(crate) mod tests;
