//! semantics.md scenario 72, log hygiene: one request id on every line an RPC causes (API,
//! session host, placement, runtime, controller), no payloads in the logs, a fixed set of INFO
//! records per Exec, and refusals a caller caused never logged at WARN or ERROR.
//!
//! One test in this binary: it owns the process's tracing subscriber.

use std::io::Write;
use std::sync::{Arc, Mutex};

use agentvm_proto::v1::sessions_client::SessionsClient;
use agentvm_proto::v1::{
    CreateSessionRequest, ExecRequest, ForkRequest, GetSessionRequest, Session,
};
use tonic::Code;
use tonic::transport::Channel;

mod support;

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Captured {
    type Writer = Captured;
    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

impl Captured {
    /// The lines written since the last call.
    fn take(&self) -> Vec<String> {
        let bytes = std::mem::take(&mut *self.0.lock().unwrap());
        String::from_utf8(bytes)
            .unwrap()
            .lines()
            .map(str::to_owned)
            .collect()
    }
}

fn with_id<T>(message: T, id: &str) -> tonic::Request<T> {
    let mut req = tonic::Request::new(message);
    req.metadata_mut()
        .insert("x-request-id", id.parse().unwrap());
    req
}

fn exec_request(session: &str, text: &str) -> ExecRequest {
    support::exec_text(session, text)
}

/// Runs an Exec to its end: the echoed request id and the stream's final code.
async fn exec(c: &mut SessionsClient<Channel>, req: ExecRequest, id: &str) -> (String, Code) {
    let response = c.exec(with_id(req, id)).await.unwrap();
    let echoed = response
        .metadata()
        .get("x-request-id")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let mut stream = response.into_inner();
    loop {
        match stream.message().await {
            Ok(Some(u)) => assert!(u.update.is_some()),
            Ok(None) => return (echoed, Code::Ok),
            Err(s) => return (echoed, s.code()),
        }
    }
}

/// The messages of the INFO lines tagged with `request_id`. A line reads
/// `<time> INFO <spans>: <target>: <message> <key=value>…`.
fn info_messages(lines: &[String], request_id: &str) -> Vec<String> {
    let tag = format!("request_id={request_id}");
    lines
        .iter()
        .filter(|l| l.contains(" INFO ") && l.contains(&tag))
        .filter_map(|l| {
            let after_spans = &l[l.find(": agentvmd::")? + 2..];
            let text = &after_spans[after_spans.find(": ")? + 2..];
            let words: Vec<&str> = text.split(' ').take_while(|w| !w.contains('=')).collect();
            Some(words.join(" "))
        })
        .collect()
}

/// No line holds `payload`, and none is a WARN or an ERROR.
fn assert_quiet(lines: &[String], payload: &str) {
    for line in lines {
        assert!(!line.contains(payload), "a payload in the log: {line}");
        assert!(
            !line.contains(" WARN ") && !line.contains(" ERROR "),
            "{line}"
        );
    }
}

#[tokio::test]
async fn scenario_72_log_hygiene() {
    let captured = Captured::default();
    tracing_subscriber::fmt()
        .with_ansi(false)
        .with_env_filter("agentvmd=debug")
        .with_writer(captured.clone())
        .init();
    let n = support::start().await;
    let mut c = n.c();
    let session: Session = c
        .create_session(with_id(
            CreateSessionRequest {
                session: Some(Session {
                    harness: "echo".into(),
                    ..Default::default()
                }),
            },
            "req-create",
        ))
        .await
        .unwrap()
        .into_inner();
    let uid = session.metadata.unwrap().uid;
    captured.take();

    const SECRET: &str = "confidential-payload-7731";
    let per_exec = [
        "exec",
        "compute ready",
        "execution started",
        "execution completed",
        "exec finished",
    ];
    for (id, compute) in [
        ("req-72-a", "compute=created"),
        ("req-72-b", "compute=attached"),
    ] {
        let (echoed, code) = exec(&mut c, exec_request(&uid, SECRET), id).await;
        assert_eq!((echoed.as_str(), code), (id, Code::Ok));
        let lines = captured.take();
        let tag = format!("request_id={id}");
        for line in lines.iter().filter(|l| l.contains(&uid)) {
            assert!(line.contains(&tag), "a line of {id} without its id: {line}");
        }
        assert_eq!(info_messages(&lines, id), per_exec, "{lines:#?}");
        assert!(
            lines
                .iter()
                .any(|l| l.contains("compute ready") && l.contains(compute)),
            "{lines:#?}"
        );
        assert_quiet(&lines, SECRET);
    }

    // Refusals the caller caused: logged once at INFO under their id, never WARN or ERROR.
    let unknown = c
        .get_session(with_id(
            GetSessionRequest {
                uid: "sess-000000000000000000000000".into(),
            },
            "req-notfound",
        ))
        .await
        .unwrap_err();
    assert_eq!(unknown.code(), Code::NotFound);
    let mut bad_role = exec_request(&uid, SECRET);
    bad_role.inputs[0].role = "wizard".into();
    let err = c.exec(with_id(bad_role, "req-invalid")).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    let err = c
        .fork(with_id(
            ForkRequest {
                session: uid.clone(),
                count: -1,
                ..Default::default()
            },
            "req-fork0",
        ))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    let mut stale = exec_request(&uid, SECRET);
    stale.expected_last_seq = Some(1);
    let (_, code) = exec(&mut c, stale, "req-cas").await;
    assert_eq!(code, Code::Aborted);
    let lines = captured.take();
    for (id, message) in [
        ("req-notfound", "rpc refused"),
        ("req-invalid", "rpc refused"),
        ("req-fork0", "rpc refused"),
        ("req-cas", "exec refused"),
    ] {
        assert!(
            info_messages(&lines, id).iter().any(|m| m == message),
            "{id}: {lines:#?}"
        );
    }
    assert_quiet(&lines, SECRET);

    // Upstream's request-id test: an Exec that names nothing (no session, no inputs, no
    // x-request-id) gets an id of the server's making, echoed, on every line it causes, and
    // the config it carried is never logged either.
    let bare = ExecRequest {
        config: format!("{{\"token\":\"{SECRET}\"}}").into_bytes(),
        ..Default::default()
    };
    let response = c.exec(bare).await.unwrap();
    let made = response
        .metadata()
        .get("x-request-id")
        .map(|v| v.to_str().unwrap().to_owned())
        .expect("a request id is made and echoed");
    assert!(
        made.len() == 16
            && made
                .bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()),
        "{made}"
    );
    let mut stream = response.into_inner();
    let mut new_uid = String::new();
    loop {
        match stream.message().await {
            Ok(Some(u)) => {
                if let Some(agentvm_proto::v1::exec_update::Update::Session(s)) = u.update {
                    new_uid = s.metadata.unwrap().uid;
                }
            }
            Ok(None) => break,
            Err(s) => panic!("{s:?}"),
        }
    }
    assert!(!new_uid.is_empty(), "the implicit session is named");
    let lines = captured.take();
    let ids: std::collections::BTreeSet<&str> = lines
        .iter()
        .filter(|l| l.contains(&new_uid))
        .filter_map(|l| l.split("request_id=").nth(1))
        .map(|rest| rest.split([' ', '}', ':']).next().unwrap_or_default())
        .collect();
    assert_eq!(
        ids.into_iter().collect::<Vec<_>>(),
        [made.as_str()],
        "{lines:#?}"
    );
    assert_quiet(&lines, SECRET);
}
