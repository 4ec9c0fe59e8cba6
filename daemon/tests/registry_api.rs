//! HarnessRegistry over gRPC on agentvmd's admin socket: register, observe (a live Describe),
//! list, retire, and persistence across a daemon restart.

use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use agentvm_proto::v1::harness_registry_client::HarnessRegistryClient;
use agentvm_proto::v1::harness_server::{Harness, HarnessServer};
use agentvm_proto::v1::{
    Capabilities, ControllerFrame, DescribeRequest, Event, GetHarnessRequest, HarnessDescriptor,
    HarnessSource, HarnessSpec, HarnessState, ListHarnessesRequest, RegisterHarnessRequest,
    RegisterOutcome, RemotePlacement, Resumability, RetireHarnessRequest, harness_spec::Placement,
};
use agentvmd::config::ListenAddr;
use tonic::{Code, Request, Response, Status, Streaming};

struct FakeHarness;

#[tonic::async_trait]
impl Harness for FakeHarness {
    async fn describe(
        &self,
        _: Request<DescribeRequest>,
    ) -> Result<Response<HarnessDescriptor>, Status> {
        Ok(Response::new(HarnessDescriptor {
            id: "fake".into(),
            version: "7".into(),
            ..Default::default()
        }))
    }

    type ConnectStream =
        Pin<Box<dyn tokio_stream::Stream<Item = Result<Event, Status>> + Send + 'static>>;

    async fn connect(
        &self,
        _: Request<Streaming<ControllerFrame>>,
    ) -> Result<Response<Self::ConnectStream>, Status> {
        Err(Status::failed_precondition(
            "this test harness serves Describe only",
        ))
    }
}

fn serve_fake_harness(path: &Path) {
    let listener = tokio::net::UnixListener::bind(path).unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(HarnessServer::new(FakeHarness))
            .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener)),
    );
}

struct Daemon {
    child: Child,
    admin: PathBuf,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn start_daemon(dir: &Path) -> Daemon {
    let admin = dir.join("run/admin.sock");
    let _ = std::fs::remove_file(&admin);
    let child = Command::new(env!("CARGO_BIN_EXE_agentvmd"))
        .arg("--state-dir")
        .arg(dir.join("state"))
        .arg("--listen")
        .arg(format!("unix:{}", dir.join("run/api.sock").display()))
        .arg("--admin-listen")
        .arg(format!("unix:{}", admin.display()))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !admin.exists() {
        assert!(Instant::now() < deadline, "admin socket never appeared");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Daemon { child, admin }
}

/// A client of the admin socket. The socket file appears when it is bound, a moment before
/// it listens: a refused connection is retried until it does.
async fn client(d: &Daemon) -> HarnessRegistryClient<tonic::transport::Channel> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match agentvmd::client::connect(&ListenAddr::Unix(d.admin.clone())).await {
            Ok(channel) => return HarnessRegistryClient::new(channel),
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("the admin socket never answered: {e}"),
        }
    }
}

fn spec(address: String) -> HarnessSpec {
    HarnessSpec {
        placement: Some(Placement::Remote(RemotePlacement { address })),
        capabilities: Some(Capabilities {
            resumability: Resumability::StatelessReplay as i32,
            ..Default::default()
        }),
        descriptor_id: "fake".into(),
    }
}

#[tokio::test]
async fn register_observe_list_retire_and_survive_restart() {
    let dir = tempfile::tempdir().unwrap();
    let harness_sock = dir.path().join("harness.sock");
    serve_fake_harness(&harness_sock);
    let address = format!("unix://{}", harness_sock.display());

    let daemon = start_daemon(dir.path()).await;
    let mut c = client(&daemon).await;
    let resp = c
        .register_harness(RegisterHarnessRequest {
            name: "fake".into(),
            spec: Some(spec(address.clone())),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(resp.outcome(), RegisterOutcome::Created);
    let digest = resp.harness.unwrap().spec_digest;
    assert!(digest.starts_with("sha256:"));

    let observed = c
        .get_harness(GetHarnessRequest {
            name: "fake".into(),
            observe: true,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(observed.observed.as_ref().unwrap().version, "7");
    assert!(observed.observe_error.is_empty());

    // A registration whose harness is not running: observation reports, the call succeeds.
    let dead = format!("unix://{}", dir.path().join("nobody.sock").display());
    c.register_harness(RegisterHarnessRequest {
        name: "dead".into(),
        spec: Some(spec(dead)),
    })
    .await
    .unwrap();
    let dead_view = c
        .get_harness(GetHarnessRequest {
            name: "dead".into(),
            observe: true,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(dead_view.observed.is_none());
    assert!(!dead_view.observe_error.is_empty());

    let err = c
        .list_harnesses(ListHarnessesRequest {
            page_size: -1,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    let err = c
        .list_harnesses(ListHarnessesRequest {
            page_token: "%%%".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);

    // Page through everything two at a time.
    let mut names = Vec::new();
    let mut token = String::new();
    loop {
        let page = c
            .list_harnesses(ListHarnessesRequest {
                page_size: 2,
                page_token: token.clone(),
                include_retired: false,
            })
            .await
            .unwrap()
            .into_inner();
        names.extend(page.harnesses.iter().map(|h| {
            let source = h.source();
            (h.metadata.clone().unwrap().name, source)
        }));
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    let only_names: Vec<&str> = names.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        only_names,
        vec![
            "chat",
            "counter",
            "dead",
            "echo",
            "fake",
            "testguest",
            "testguest-echo"
        ]
    );
    assert!(names.contains(&("echo".into(), HarnessSource::Static)));

    let retired = c
        .retire_harness(RetireHarnessRequest {
            name: "dead".into(),
            reason: "gone".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(retired.state(), HarnessState::Retired);
    let err = c
        .retire_harness(RetireHarnessRequest {
            name: "echo".into(),
            reason: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);

    drop(c);
    drop(daemon);
    let daemon = start_daemon(dir.path()).await;
    let mut c = client(&daemon).await;
    let again = c
        .register_harness(RegisterHarnessRequest {
            name: "fake".into(),
            spec: Some(spec(address)),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.outcome(), RegisterOutcome::Unchanged);
    assert_eq!(again.harness.unwrap().spec_digest, digest);
    let dead_view = c
        .get_harness(GetHarnessRequest {
            name: "dead".into(),
            observe: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(dead_view.state(), HarnessState::Retired);
    assert_eq!(dead_view.retire_reason, "gone");
    let err = c
        .get_harness(GetHarnessRequest {
            name: "missing".into(),
            observe: false,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
}
