//! Per-project quotas from the auth file: each limit refuses RESOURCE_EXHAUSTED naming
//! itself, before anything is written, and other projects are untouched.

use std::sync::Arc;

use agentvm_proto::v1::sessions_client::SessionsClient;
use agentvm_proto::v1::{
    CreateSessionRequest, ExecRequest, ForkRequest, ListSessionsRequest, ReplayRequest,
    ResourceMetadata, Session,
};
use agentvmd::api::auth::Authenticator;
use sha2::{Digest, Sha256};
use tonic::Code;
use tonic::transport::Channel;

mod support;

const TOKEN: &str = "quota-token";

fn authed<T>(msg: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.metadata_mut()
        .insert("authorization", format!("Bearer {TOKEN}").parse().unwrap());
    r
}

/// A node whose auth file gives one principal two projects and sets `quotas` (TOML).
async fn node_with_quotas(quotas: &str) -> support::TestNode {
    node_with_quotas_and(quotas, |_| {}).await
}

async fn node_with_quotas_and(
    quotas: &str,
    configure: impl FnOnce(&mut agentvmd::node::NodeConfig),
) -> support::TestNode {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("auth.toml");
    std::fs::write(
        &path,
        format!(
            "[[principal]]\nname = \"tenant\"\nprojects = [\"team-a\", \"team-b\"]\n\
             token_sha256 = [\"{}\"]\n\n{quotas}",
            hex::encode(Sha256::digest(TOKEN))
        ),
    )
    .unwrap();
    let auth = Arc::new(Authenticator::load(&path).unwrap());
    support::start_with(move |cfg| {
        cfg.auth = Some(auth);
        configure(cfg);
    })
    .await
}

async fn create(c: &mut SessionsClient<Channel>, project: &str) -> Result<String, tonic::Status> {
    create_for(c, project, "echo").await
}

async fn create_for(
    c: &mut SessionsClient<Channel>,
    project: &str,
    harness: &str,
) -> Result<String, tonic::Status> {
    let session = c
        .create_session(authed(CreateSessionRequest {
            session: Some(Session {
                harness: harness.into(),
                metadata: Some(ResourceMetadata {
                    project: project.into(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
        }))
        .await?
        .into_inner();
    Ok(session.metadata.unwrap().uid)
}

async fn count(c: &mut SessionsClient<Channel>, project: &str) -> usize {
    c.list_sessions(authed(ListSessionsRequest {
        project: project.into(),
        ..Default::default()
    }))
    .await
    .unwrap()
    .into_inner()
    .sessions
    .len()
}

/// Runs an Exec to its end: its status, and how many frames came before it.
async fn exec(
    c: &mut SessionsClient<Channel>,
    req: ExecRequest,
) -> (Result<(), tonic::Status>, usize) {
    let mut stream = match c.exec(authed(req)).await {
        Ok(s) => s.into_inner(),
        Err(s) => return (Err(s), 0),
    };
    let mut frames = 0;
    loop {
        match stream.message().await {
            Ok(Some(_)) => frames += 1,
            Ok(None) => return (Ok(()), frames),
            Err(s) => return (Err(s), frames),
        }
    }
}

/// How many records `session`'s log holds.
async fn log_len(c: &mut SessionsClient<Channel>, session: &str) -> usize {
    let mut stream = c
        .replay(authed(ReplayRequest {
            session: session.into(),
            ..Default::default()
        }))
        .await
        .unwrap()
        .into_inner();
    let mut n = 0;
    while stream.message().await.unwrap().is_some() {
        n += 1;
    }
    n
}

fn exhausted(r: Result<impl std::fmt::Debug, tonic::Status>, limit: &str) {
    let e = r.expect_err(limit);
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains(limit), "{limit}: {}", e.message());
}

async fn fork(
    c: &mut SessionsClient<Channel>,
    session: &str,
    count: i32,
) -> Result<usize, tonic::Status> {
    Ok(c.fork(authed(ForkRequest {
        session: session.into(),
        count,
        ..Default::default()
    }))
    .await?
    .into_inner()
    .children
    .len())
}

#[tokio::test]
async fn sessions_and_forks_stop_at_their_project_s_quota_and_write_nothing() {
    let node = node_with_quotas(
        "[quota]\nsessions = 5\nfork_children = 2\nforks_per_minute = 3\n\n\
         [[project]]\nname = \"team-b\"\nsessions = 100\n",
    )
    .await;
    let mut c = node.c();
    let parent = create(&mut c, "team-a").await.unwrap();
    let (turn, _) = exec(&mut c, support::exec_text(&parent, "hi")).await;
    turn.unwrap();

    // One Fork may make 2 children: 3 is refused, and no child exists.
    exhausted(fork(&mut c, &parent, 3).await, "may make 2 children");
    assert_eq!(count(&mut c, "team-a").await, 1);
    assert_eq!(fork(&mut c, &parent, 2).await.unwrap(), 2);
    // 3 a minute: 2 made, 2 more would be 4.
    exhausted(fork(&mut c, &parent, 2).await, "`forks_per_minute` = 3");
    assert_eq!(count(&mut c, "team-a").await, 3);
    // A refused fork took nothing of the minute: one more child still fits.
    assert_eq!(fork(&mut c, &parent, 1).await.unwrap(), 1);

    // 5 sessions: the fifth is made, the sixth refused (Create, and an Exec that would
    // create it); team-b has its own quota.
    create(&mut c, "team-a").await.unwrap();
    exhausted(create(&mut c, "team-a").await, "`sessions` = 5");
    exhausted(fork(&mut c, &parent, 1).await, "`sessions` = 5");
    assert_eq!(count(&mut c, "team-a").await, 5);
    for _ in 0..6 {
        create(&mut c, "team-b").await.unwrap();
    }
}

#[tokio::test]
async fn a_project_s_journal_bytes_stop_at_its_quota_before_the_turn_starts() {
    let node = node_with_quotas("[quota]\njournal_mib = 1\n").await;
    let mut c = node.c();
    let s = create(&mut c, "team-a").await.unwrap();
    // Inputs that alone would cross the quota: refused before the first frame, nothing
    // journaled.
    let (turn, frames) = exec(&mut c, support::exec_text(&s, "x".repeat(1_100_000))).await;
    exhausted(turn, "`journal_mib` = 1");
    assert_eq!(frames, 0);
    assert!(log_len(&mut c, &s).await == 0);
    // Turns that fit go on until the project holds its quota (echo journals its input and
    // the same text back), then nothing more is written, in any of its sessions; another
    // project writes on.
    let (turn, _) = exec(&mut c, support::exec_text(&s, "y".repeat(300_000))).await;
    turn.unwrap();
    let (turn, _) = exec(&mut c, support::exec_text(&s, "z".repeat(300_000))).await;
    turn.unwrap();
    let held = log_len(&mut c, &s).await;
    let (turn, _) = exec(&mut c, support::exec_text(&s, "one more")).await;
    exhausted(turn, "`journal_mib` = 1");
    assert_eq!(log_len(&mut c, &s).await, held);
    exhausted(create(&mut c, "team-a").await, "`journal_mib`");
    let other = create(&mut c, "team-b").await.unwrap();
    let (turn, _) = exec(&mut c, support::exec_text(&other, "fine")).await;
    turn.unwrap();
}

#[tokio::test]
async fn a_project_s_live_vms_and_their_memory_stop_at_its_quota() {
    if let Some(reason) = support::daemon::kvm_unavailable() {
        eprintln!("SKIPPED: {reason}; this test needs KVM");
        return;
    }
    let binary = support::daemon::vmm_binary();
    let node = node_with_quotas_and(
        "[quota]\nlive_vms = 1\n\n[[project]]\nname = \"team-b\"\nlive_memory_mib = 1\n",
        |cfg| {
            cfg.vmm_binary = Some(binary);
            cfg.ram_dir = std::env::temp_dir();
        },
    )
    .await;
    let mut c = node.c();
    let first = create_for(&mut c, "team-a", "testguest").await.unwrap();
    let (turn, _) = exec(&mut c, support::exec_text(&first, "hi")).await;
    turn.unwrap();
    // Its one VM runs: a second session's turn is refused before its first frame, and its
    // log stays empty; a turn of the running one goes on.
    let second = create_for(&mut c, "team-a", "testguest").await.unwrap();
    let (turn, frames) = exec(&mut c, support::exec_text(&second, "hi")).await;
    exhausted(turn, "`live_vms` = 1");
    assert_eq!((frames, log_len(&mut c, &second).await), (0, 0));
    let (turn, _) = exec(&mut c, support::exec_text(&first, "again")).await;
    turn.unwrap();
    // A fork's children would each be a VM.
    exhausted(fork(&mut c, &first, 1).await, "`live_vms` = 1");
    assert_eq!(count(&mut c, "team-a").await, 2);
    // Suspended, the first gives its slot to the second; then it cannot resume.
    c.suspend(authed(agentvm_proto::v1::SuspendRequest {
        session: first.clone(),
    }))
    .await
    .unwrap();
    let (turn, _) = exec(&mut c, support::exec_text(&second, "hi")).await;
    turn.unwrap();
    let (turn, _) = exec(&mut c, support::exec_text(&first, "back")).await;
    exhausted(turn, "`live_vms` = 1");
    // team-b's VMs may hold 1 MiB of guest memory: not one test guest.
    let small = create_for(&mut c, "team-b", "testguest").await.unwrap();
    let (turn, _) = exec(&mut c, support::exec_text(&small, "hi")).await;
    exhausted(turn, "`live_memory_mib` = 1");
}
