//! A host's end of `agentvm.guest.v1` for tests, and the helper harness process.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use agentvm_proto::guest::PROTOCOL_VERSION;
use agentvm_proto::guest::framing::{FrameDecoder, frame_bytes};
use agentvm_proto::guest::v1::envelope::Body;
use agentvm_proto::guest::v1::{Envelope, HarnessFrame, Hello, Ready, harness_frame};
use agentvm_proto::v1::{
    ControllerFrame, Event, Message, ModelResult, Part, Start, TextPart, controller_frame, part,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

pub const TIMEOUT: Duration = Duration::from_secs(15);

pub struct HostConn<S> {
    pub stream: S,
    decoder: FrameDecoder,
    next_id: u64,
}

impl<S: AsyncRead + AsyncWrite + Unpin> HostConn<S> {
    pub fn new(stream: S) -> Self {
        Self {
            stream,
            decoder: FrameDecoder::new(64 << 20),
            next_id: 1,
        }
    }

    pub async fn send(&mut self, body: Body) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        self.stream
            .write_all(&frame_bytes(&Envelope {
                id,
                body: Some(body),
            }))
            .await
            .unwrap();
        id
    }

    /// The next frame, or None when the agent closed the connection.
    pub async fn recv(&mut self) -> Option<Envelope> {
        let mut buf = [0u8; 16 << 10];
        loop {
            if let Some(e) = self
                .decoder
                .next_frame()
                .expect("the agent sent a bad frame")
            {
                return Some(e);
            }
            let n = tokio::time::timeout(TIMEOUT, self.stream.read(&mut buf))
                .await
                .expect("the agent did not answer")
                .unwrap_or(0);
            if n == 0 {
                return None;
            }
            self.decoder.extend(&buf[..n]);
        }
    }

    pub async fn call(&mut self, body: Body) -> Body {
        let id = self.send(body).await;
        loop {
            let e = self.recv().await.expect("closed while waiting for a reply");
            if e.id == id || matches!(e.body, Some(Body::Error(_))) {
                return e.body.unwrap();
            }
        }
    }

    pub async fn hello(&mut self) -> Ready {
        match self
            .call(Body::Hello(Hello {
                protocol_version: PROTOCOL_VERSION,
                host_version: "test host".into(),
            }))
            .await
        {
            Body::Ready(r) => r,
            other => panic!("Hello answered with {other:?}"),
        }
    }

    pub async fn controller(&mut self, stream: u64, frame: ControllerFrame) {
        self.send(Body::Harness(HarnessFrame {
            stream,
            frame: Some(harness_frame::Frame::Controller(frame)),
        }))
        .await;
    }

    /// The next event of `stream`; Err(code, message) when the stream closed.
    pub async fn event(&mut self, stream: u64) -> Result<Event, (i32, String)> {
        loop {
            let e = self.recv().await.expect("closed while a stream was open");
            if let Some(Body::Harness(HarnessFrame {
                stream: s,
                frame: Some(f),
            })) = e.body
            {
                if s != stream {
                    continue;
                }
                return match f {
                    harness_frame::Frame::Event(ev) => Ok(ev),
                    harness_frame::Frame::Close(c) => Err((c.code, c.message)),
                    harness_frame::Frame::Controller(_) => {
                        panic!("the agent sent a controller frame")
                    }
                };
            }
        }
    }

    /// One execution of a reference harness: Start with `input`, answer model calls like the
    /// echo model, collect the event kinds and OUTPUT texts until the stream closes.
    pub async fn execute(&mut self, stream: u64, execution_id: &str, input: &str) -> Turn {
        let frame = |f| ControllerFrame {
            session: "sess-test".into(),
            execution_id: execution_id.into(),
            frame: Some(f),
        };
        self.controller(
            stream,
            frame(controller_frame::Frame::Start(Start {
                inputs: vec![text("user", input)],
                ..Default::default()
            })),
        )
        .await;
        let mut turn = Turn::default();
        loop {
            match self.event(stream).await {
                Ok(ev) => {
                    turn.kinds.push(ev.kind);
                    use agentvm_proto::v1::event::Body as E;
                    match ev.body {
                        Some(E::Model(call)) => {
                            let asked = call.messages.last().map(text_of).unwrap_or_default();
                            self.controller(
                                stream,
                                frame(controller_frame::Frame::Model(ModelResult {
                                    message: Some(text("assistant", &format!("echo:{asked}"))),
                                    usage: None,
                                    model_call_id: call.id,
                                })),
                            )
                            .await;
                        }
                        Some(E::Message(m)) => turn.outputs.push(text_of(&m)),
                        _ => {}
                    }
                }
                Err(close) => {
                    turn.close = close;
                    return turn;
                }
            }
        }
    }
}

#[derive(Debug, Default)]
pub struct Turn {
    pub kinds: Vec<i32>,
    pub outputs: Vec<String>,
    pub close: (i32, String),
}

pub fn text(role: &str, t: &str) -> Message {
    Message {
        role: role.into(),
        parts: vec![Part {
            part: Some(part::Part::Text(TextPart { text: t.into() })),
        }],
    }
}

pub fn text_of(m: &Message) -> String {
    m.parts
        .iter()
        .filter_map(|p| match &p.part {
            Some(part::Part::Text(t)) => Some(t.text.clone()),
            _ => None,
        })
        .collect()
}

/// Serves a reference harness on a unix socket in-process; returns the socket.
pub async fn serve_harness(dir: &Path, name: &str) -> PathBuf {
    let socket = dir.join(format!("{name}-harness.sock"));
    let listener = tokio::net::UnixListener::bind(&socket).unwrap();
    let harness = agentvm_harnesses::builtin(name).unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(agentvm_harnesses::server::GrpcHarness::new(harness).into_service())
            .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener)),
    );
    socket
}
