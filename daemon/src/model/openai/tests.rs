use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use agentvm_proto::v1::{ToolChoice, ToolDefinition};
use prost_types::value::Kind;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::*;

/// A minimal chat-completions server on loopback: records each request body and answers with
/// what `respond` returns (status, content type, body).
pub(crate) struct FakeOpenAi {
    pub base_url: String,
    pub requests: Arc<Mutex<Vec<(String, Value)>>>,
}

type Responder = Arc<dyn Fn(&Value) -> (u16, &'static str, String) + Send + Sync>;

impl FakeOpenAi {
    pub async fn start(respond: Responder) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base_url = format!("http://{}/v1", listener.local_addr().unwrap());
        let requests = Arc::new(Mutex::new(Vec::new()));
        let seen = requests.clone();
        tokio::spawn(async move {
            loop {
                let Ok((mut sock, _)) = listener.accept().await else {
                    return;
                };
                let respond = respond.clone();
                let seen = seen.clone();
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 4096];
                    let (head_end, length) = loop {
                        let n = sock.read(&mut chunk).await.unwrap_or(0);
                        if n == 0 {
                            return;
                        }
                        buf.extend_from_slice(&chunk[..n]);
                        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            let head = String::from_utf8_lossy(&buf[..i]).to_lowercase();
                            let length = head
                                .lines()
                                .find_map(|l| l.strip_prefix("content-length:"))
                                .and_then(|v| v.trim().parse::<usize>().ok())
                                .unwrap_or(0);
                            break (i + 4, length);
                        }
                    };
                    while buf.len() < head_end + length {
                        let n = sock.read(&mut chunk).await.unwrap_or(0);
                        if n == 0 {
                            return;
                        }
                        buf.extend_from_slice(&chunk[..n]);
                    }
                    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
                    let body: Value = serde_json::from_slice(&buf[head_end..head_end + length])
                        .unwrap_or(Value::Null);
                    let (status, ctype, answer) = respond(&body);
                    seen.lock().unwrap().push((head, body));
                    let resp = format!(
                        "HTTP/1.1 {status} X\r\ncontent-type: {ctype}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{answer}",
                        answer.len()
                    );
                    let _ = sock.write_all(resp.as_bytes()).await;
                    let _ = sock.shutdown().await;
                });
            }
        });
        FakeOpenAi { base_url, requests }
    }

    /// A server that answers every request with the text `answer-<n>`.
    pub async fn counting() -> Self {
        let n = Arc::new(std::sync::atomic::AtomicU64::new(0));
        Self::start(Arc::new(move |_| {
            let i = n.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
            (
                200,
                "application/json",
                completion_json(&format!("answer-{i}")),
            )
        }))
        .await
    }

    pub fn provider(&self, key: Option<&str>) -> OpenAiProvider {
        OpenAiProvider::new(OpenAiConfig {
            base_url: self.base_url.clone(),
            api_key: key.map(str::to_owned),
            timeout: Duration::from_secs(10),
        })
    }
}

fn completion_json(text: &str) -> String {
    json!({
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2}
    })
    .to_string()
}

fn user(text: &str) -> Message {
    Message {
        role: "user".into(),
        parts: vec![text_part(text.into())],
    }
}

#[tokio::test]
async fn completion_with_tools_and_key() {
    let server = FakeOpenAi::start(Arc::new(|_| {
        (
            200,
            "application/json",
            json!({"choices": [{"message": {"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{\"x\":2}"}}
            ]}}]})
            .to_string(),
        )
    }))
    .await;
    let call = ModelCall {
        model: "gpt-test".into(),
        params: HashMap::from([
            ("temperature".into(), "0".into()),
            ("user".into(), "u1".into()),
        ]),
        messages: vec![user("add 2")],
        tools: vec![ToolDefinition {
            name: "add".into(),
            description: "adds".into(),
            input_schema: None,
        }],
        tool_choice: Some(ToolChoice {
            mode: Mode::Required as i32,
            name: String::new(),
        }),
        ..Default::default()
    };
    let c = server
        .provider(Some("sk-secret"))
        .complete(&call, None)
        .await
        .unwrap();
    match &c.message.parts[0].part {
        Some(part::Part::ToolCall(t)) => {
            assert_eq!((t.id.as_str(), t.tool.as_str()), ("call_1", "add"));
            assert_eq!(
                t.args.as_ref().unwrap().fields["x"].kind,
                Some(Kind::NumberValue(2.0))
            );
        }
        other => panic!("{other:?}"),
    }
    let (head, body) = server.requests.lock().unwrap()[0].clone();
    assert!(head.starts_with("POST /v1/chat/completions"), "{head}");
    assert!(
        head.to_lowercase()
            .contains("authorization: bearer sk-secret")
    );
    assert_eq!(body["model"], "gpt-test");
    assert_eq!(body["temperature"], 0);
    assert_eq!(body["user"], "u1");
    assert_eq!(body["tool_choice"], "required");
    assert_eq!(body["tools"][0]["function"]["name"], "add");
    assert_eq!(
        body["messages"][0],
        json!({"role": "user", "content": "add 2"})
    );
}

#[tokio::test]
async fn streamed_events_become_chunks() {
    let server = FakeOpenAi::start(Arc::new(|_| {
        let events = [
            json!({"choices": [{"delta": {"role": "assistant", "content": "Hel"}}]}),
            json!({"choices": [{"delta": {"content": "lo"}}]}),
            json!({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}),
        ];
        let mut body: String = events.iter().map(|e| format!("data: {e}\n\n")).collect();
        body.push_str("data: [DONE]\n\n");
        (200, "text/event-stream", body)
    }))
    .await;
    let (tx, mut rx) = mpsc::channel(16);
    let c = server
        .provider(None)
        .complete(
            &ModelCall {
                model: "m".into(),
                messages: vec![user("hi")],
                ..Default::default()
            },
            Some(tx),
        )
        .await
        .unwrap();
    let mut chunks = Vec::new();
    while let Some(ch) = rx.recv().await {
        chunks.push(ch);
    }
    let texts: Vec<&str> = chunks.iter().map(|c| c.text.as_str()).collect();
    assert_eq!(texts, ["Hel", "lo", ""]);
    assert!(chunks.last().unwrap().done);
    assert_eq!(c.message.parts, vec![text_part("Hello".into())]);
    assert_eq!(c.usage.unwrap().input_tokens, 5);
    assert_eq!(server.requests.lock().unwrap()[0].1["stream"], true);
}

#[tokio::test]
async fn http_errors_are_classified() {
    for (status, unavailable_expected) in [(400u16, false), (401, false), (429, true), (503, true)]
    {
        let server = FakeOpenAi::start(Arc::new(move |_| {
            (status, "application/json", "{\"error\":\"nope\"}".into())
        }))
        .await;
        let err = server
            .provider(None)
            .complete(&ModelCall::default(), None)
            .await
            .unwrap_err();
        assert_eq!(
            matches!(err, ProviderError::Unavailable { .. }),
            unavailable_expected,
            "{status}: {err}"
        );
        assert!(err.to_string().contains("nope"));
    }
    let gone = OpenAiProvider::new(OpenAiConfig {
        base_url: "http://127.0.0.1:1/v1".into(),
        api_key: None,
        timeout: Duration::from_secs(5),
    });
    assert!(matches!(
        gone.complete(&ModelCall::default(), None)
            .await
            .unwrap_err(),
        ProviderError::Unavailable { .. }
    ));
}

#[test]
fn conversation_maps_tool_calls_and_results() {
    let assistant = Message {
        role: "assistant".into(),
        parts: vec![Part {
            part: Some(part::Part::ToolCall(ToolCall {
                id: "c1".into(),
                tool: "add".into(),
                ..Default::default()
            })),
        }],
    };
    let tool = Message {
        role: "tool".into(),
        parts: vec![Part {
            part: Some(part::Part::ToolResult(agentvm_proto::v1::ToolResult {
                id: "c1".into(),
                content: vec![text_part("4".into())],
                ..Default::default()
            })),
        }],
    };
    let body = request_body(
        &ModelCall {
            model: "m".into(),
            messages: vec![assistant, tool],
            ..Default::default()
        },
        false,
    )
    .unwrap();
    assert_eq!(
        body["messages"][0]["tool_calls"][0]["function"]["arguments"],
        "{}"
    );
    assert_eq!(body["messages"][0]["content"], Value::Null);
    assert_eq!(
        body["messages"][1],
        json!({"role": "tool", "tool_call_id": "c1", "content": "4"})
    );
    let reserved = request_body(
        &ModelCall {
            params: HashMap::from([("stream".into(), "true".into())]),
            ..Default::default()
        },
        false,
    );
    assert!(reserved.is_err());
}

#[test]
fn api_key_comes_from_a_file_or_the_environment() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("key");
    std::fs::write(&f, "  sk-file \nignored\n").unwrap();
    assert_eq!(
        load_api_key(None, Some(&f)).unwrap().as_deref(),
        Some("sk-file")
    );
    assert_eq!(
        load_api_key(Some("AGENTVM_TEST_SURELY_UNSET_VAR"), None).unwrap(),
        None
    );
    assert!(load_api_key(None, Some(&dir.path().join("missing"))).is_err());
}
