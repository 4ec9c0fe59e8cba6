//! Crash consistency (kill -9 at every step of every lifecycle operation): for each named
//! crash point of `agentvmd::crash_point::ALL`, a real agentvmd on microVMs (the test guest's
//! counter, whose count lives only in guest RAM) and again on the process runtime (echo) is
//! started with `AGENTVM_CRASH_POINT`, driven into the operation that reaches the point, dies
//! there by SIGKILL, and is started again.
//! Then the invariants must hold:
//! - no VMM runs for a session that does not exist or is deleted, and every session that says
//!   LIVE has one;
//! - every VMM directory and snapshot belongs to an active session (or is still in use);
//! - every record the client was sent before the crash is still in the log, and
//!   `journal verify` passes for every session;
//! - no memory is lost without a record: each counter goes on from its last count, or its
//!   log says its compute was lost;
//! - every active session answers a turn;
//! - a turn's checkpoint is either recorded with its snapshot in the store, or neither.
//!
//! Skipped, with the reason printed, where there is no usable KVM.

mod support;

use support::daemon::{kvm_unavailable, vmm_binary};

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use agentvm_proto::node::v1::ListCheckpointsRequest;
use agentvm_proto::node::v1::node_client::NodeClient;
use agentvm_proto::v1::sessions_client::SessionsClient;
use agentvm_proto::v1::{
    ComputeState, DeleteSessionRequest, ForkRequest, ListSessionsRequest, LogRecord, ResumeRequest,
    Session, SuspendRequest, event::Body, exec_update::Update, lifecycle::Kind as LifecycleKind,
    part,
};
use agentvmd::config::ListenAddr;
use agentvmd::crash_point;
use agentvmd::journal::verify::verify_chain;
use support::{create_for, replay};
use tonic::transport::Channel;

/// One agentvmd process over `dir`; killed (and its VMMs reaped) when dropped.
struct Daemon {
    dir: PathBuf,
    child: Child,
    api: PathBuf,
    /// Whether dropping it stops its VMMs too (not after a crash: the next daemon adopts them).
    reap: bool,
}

impl Daemon {
    fn start(dir: &Path, crash_at: Option<&str>) -> Daemon {
        let api = dir.join("api.sock");
        let admin = dir.join("admin.sock");
        let _ = std::fs::remove_file(&api);
        let _ = std::fs::remove_file(&admin);
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_agentvmd"));
        cmd.arg("--state-dir")
            .arg(dir.join("state"))
            .arg("--listen")
            .arg(format!("unix:{}", api.display()))
            .arg("--admin-listen")
            .arg(format!("unix:{}", admin.display()))
            .arg("--harness-bin")
            .arg(env!("CARGO_BIN_EXE_agentvm"))
            .arg("--vmm-binary")
            .arg(vmm_binary())
            .env_remove(crash_point::ENV)
            .env(
                "RUST_LOG",
                std::env::var("AGENTVM_CRASH_LOG").unwrap_or_else(|_| "agentvmd=info".into()),
            );
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("agentvmd.log"))
            .unwrap();
        cmd.stdout(log.try_clone().unwrap()).stderr(log);
        if let Some(point) = crash_at {
            cmd.env(crash_point::ENV, point);
        }
        let child = cmd.spawn().unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while !(api.exists() && admin.exists()) {
            assert!(Instant::now() < deadline, "agentvmd sockets never appeared");
            std::thread::sleep(Duration::from_millis(20));
        }
        Daemon {
            dir: dir.to_owned(),
            child,
            api,
            reap: true,
        }
    }

    async fn node_client(&self) -> NodeClient<Channel> {
        NodeClient::new(
            agentvmd::client::connect(&ListenAddr::Unix(self.api.clone()))
                .await
                .unwrap(),
        )
    }

    async fn client(&self) -> SessionsClient<Channel> {
        SessionsClient::new(
            agentvmd::client::connect(&ListenAddr::Unix(self.api.clone()))
                .await
                .unwrap(),
        )
    }

    /// Waits for the daemon to die at its crash point; false if it never did.
    fn died_by_sigkill(&mut self) -> bool {
        use std::os::unix::process::ExitStatusExt;
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.signal() == Some(nix::sys::signal::Signal::SIGKILL as i32);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if !self.reap {
            return;
        }
        for (pid, _) in vmm_processes(&self.dir) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while !vmm_processes(&self.dir).is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        support::reap_vmms(&self.dir.join("state").join("vms"));
    }
}

/// Every agentvm-vmm process serving an API socket under `dir`, with the session it runs.
fn vmm_processes(dir: &Path) -> Vec<(i32, String)> {
    let vms = dir.join("state").join("vms");
    let prefix = vms.as_os_str().as_encoded_bytes().to_vec();
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        if !args.first().is_some_and(|a| a.ends_with(b"agentvm-vmm")) {
            continue;
        }
        let session = args.iter().find_map(|a| {
            let rest = a.strip_prefix(prefix.as_slice())?.strip_prefix(b"/")?;
            let uid = rest.split(|b| *b == b'/').next()?;
            Some(String::from_utf8_lossy(uid).into_owned())
        });
        if let Some(session) = session {
            found.push((pid, claimed_by(&vms, &session).unwrap_or(session)));
        }
    }
    found
}

/// The session that claimed the pooled VMM started for `slot` (`.pool-UID`): the one whose
/// directory records that slot's socket. `None` while it waits in its slot.
fn claimed_by(vms: &Path, slot: &str) -> Option<String> {
    if !slot.starts_with(".pool-") || vms.join(slot).exists() {
        return None;
    }
    let api = vms.join(slot).join("api.sock");
    std::fs::read_dir(vms).ok()?.flatten().find_map(|e| {
        let recorded = std::fs::read(e.path().join("pooled-api")).ok()?;
        (recorded == api.as_os_str().as_encoded_bytes())
            .then(|| e.file_name().to_string_lossy().into_owned())
    })
}

fn uid(s: &Session) -> String {
    s.metadata.as_ref().unwrap().uid.clone()
}

/// One turn: the records it streamed and the count it answered (or the error it ended in).
async fn turn(
    c: &mut SessionsClient<Channel>,
    session: &str,
) -> (Vec<LogRecord>, Result<String, tonic::Status>) {
    let mut records = Vec::new();
    let mut stream = match c.exec(support::exec_text(session, "go")).await {
        Ok(s) => s.into_inner(),
        Err(e) => return (records, Err(e)),
    };
    loop {
        match stream.message().await {
            Ok(Some(u)) => {
                if let Some(Update::Record(r)) = u.update {
                    records.push(r);
                }
            }
            Ok(None) => break,
            Err(e) => return (records, Err(e)),
        }
    }
    let answer = records
        .iter()
        .rev()
        .find_map(|r| match r.event.as_ref()?.body.as_ref()? {
            Body::Message(m) if m.role == "assistant" => {
                m.parts.iter().find_map(|p| match &p.part {
                    Some(part::Part::Text(t)) => Some(t.text.clone()),
                    _ => None,
                })
            }
            _ => None,
        })
        .unwrap_or_default();
    (records, Ok(answer))
}

/// What the client knew before the crash, per session: the records it was sent and the
/// last count the counter answered.
#[derive(Default)]
struct Known {
    records: Vec<(String, Vec<LogRecord>)>,
    counts: Vec<(String, u64)>,
}

impl Known {
    fn saw(&mut self, session: &str, records: Vec<LogRecord>) {
        match self.records.iter_mut().find(|(s, _)| s == session) {
            Some((_, r)) => r.extend(records),
            None => self.records.push((session.to_owned(), records)),
        }
    }

    /// A counter's answer (an echo's is not a count: there is no memory to lose).
    fn counted(&mut self, session: &str, count: &str) {
        let Ok(n) = count.parse() else {
            return;
        };
        self.counts.retain(|(s, _)| s != session);
        self.counts.push((session.to_owned(), n));
    }
}

/// How a start is reached: a new session's first turn boots a VM, a Resume restores one.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Via {
    Boot,
    Restore,
}

/// The operation a case drives: the point's family (`suspend.paused` → Suspend), or a Fork
/// for a suspend point reached inside a live fork's checkpoint.
fn operation(point: &str, live_fork: bool) -> &str {
    if live_fork {
        "fork"
    } else {
        point.split('.').next().unwrap()
    }
}

/// Drives `family`'s operation, which reaches `point`, against a daemon that dies there.
async fn crash(
    point: &str,
    family: &str,
    via: Via,
    harness: &str,
    c: &mut SessionsClient<Channel>,
    known: &mut Known,
) {
    if family == "checkpoint" {
        // Taken after each turn's END, in the background: the turns succeed, and the
        // daemon dies behind them (a merge needs a checkpoint past retention: the third).
        let s = support::create_annotated(c, harness, &[("agentvm.dev/checkpoints", "2")])
            .await
            .unwrap();
        for _ in 0..4 {
            let (records, answer) = turn(c, &s).await;
            match answer {
                Ok(answer) => {
                    known.saw(&s, records);
                    known.counted(&s, &answer);
                }
                Err(_) => break,
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        return;
    }
    let s = create_for(c, harness).await;
    if family != "start" || via == Via::Restore {
        let (records, answer) = turn(c, &s).await;
        known.saw(&s, records);
        known.counted(&s, &answer.unwrap());
    }
    if via == Via::Restore {
        c.suspend(SuspendRequest { session: s.clone() })
            .await
            .unwrap();
    }
    let outcome = match family {
        "start" if via == Via::Restore => c
            .resume(ResumeRequest {
                session: s,
                boot: false,
            })
            .await
            .map(|_| ()),
        "start" => turn(c, &s).await.1.map(|_| ()),
        "suspend" => c.suspend(SuspendRequest { session: s }).await.map(|_| ()),
        "fork" => c
            .fork(ForkRequest {
                session: s,
                count: 2,
                ..Default::default()
            })
            .await
            .map(|_| ()),
        "delete" => c
            .delete_session(DeleteSessionRequest { uid: s })
            .await
            .map(|_| ()),
        other => panic!("no operation reaches crash points of {other:?}"),
    };
    assert!(outcome.is_err(), "{point}: the operation succeeded");
}

fn compute_lost_after(records: &[LogRecord], seq: i64) -> bool {
    records.iter().any(|r| {
        r.seq > seq
            && matches!(r.event.as_ref().and_then(|e| e.body.as_ref()),
                Some(Body::Lifecycle(l)) if l.kind == LifecycleKind::LifecycleSuspend as i32
                    && l.detail.starts_with("compute lost"))
    })
}

/// The invariants after a restart; returns what is wrong.
async fn check(d: &Daemon, c: &mut SessionsClient<Channel>, known: &Known) -> Vec<String> {
    let mut wrong = Vec::new();
    let sessions = c
        .list_sessions(ListSessionsRequest {
            page_size: 100,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .sessions;
    let active: Vec<String> = sessions.iter().map(uid).collect();
    let vms = d.dir.join("state").join("vms");
    for (pid, session) in vmm_processes(&d.dir) {
        // The restarted daemon's own pool, waiting for sessions.
        if session.starts_with(".pool-") && vms.join(&session).exists() {
            continue;
        }
        if !active.contains(&session) {
            wrong.push(format!(
                "VMM {pid} runs for {session}, which is not an active session"
            ));
        }
    }
    for entry in std::fs::read_dir(&vms).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with(".retired-") {
            wrong.push(format!(
                "vms/{name}: a stopped VMM's leftovers outlived the restart"
            ));
        } else if !name.starts_with('.') && !active.contains(&name) {
            wrong.push(format!("vms/{name} belongs to no active session"));
        }
    }
    let snapshots = d.dir.join("state").join("snapshots");
    for entry in std::fs::read_dir(&snapshots)
        .into_iter()
        .flatten()
        .flatten()
    {
        let name = entry.file_name().to_string_lossy().into_owned();
        // A template is the node's, kept for the sessions to come.
        if name.starts_with('.')
            || name.starts_with(agentvmd::runtime::microvm::templates::ID_PREFIX)
        {
            continue;
        }
        let of_session = name.strip_prefix("ckpt.").unwrap_or(&name);
        if !active
            .iter()
            .any(|s| of_session.starts_with(&format!("{s}-")))
        {
            wrong.push(format!("snapshot {name} belongs to no active session"));
        }
    }
    // A checkpoint is recorded with its snapshot in the store, or is neither.
    let mut nodes = d.node_client().await;
    for session in &active {
        let recorded = nodes
            .list_checkpoints(ListCheckpointsRequest {
                session: session.clone(),
            })
            .await
            .map(|r| r.into_inner().checkpoints)
            .unwrap_or_default();
        let stored: Vec<String> = std::fs::read_dir(&snapshots)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(&format!("ckpt.{session}-")))
            .collect();
        for checkpoint in &recorded {
            if !stored
                .iter()
                .any(|n| checkpoint.snapshot.ends_with(&format!("/{n}")))
            {
                wrong.push(format!(
                    "{session}: checkpoint at seq {} names {}, which is not in the store",
                    checkpoint.seq, checkpoint.snapshot
                ));
            }
        }
        for name in &stored {
            let named = recorded
                .iter()
                .any(|c| c.snapshot.ends_with(&format!("/{name}")));
            // A checkpoint folded into the next stays only as the base of one recorded.
            let a_base = stored.iter().any(|other| {
                std::fs::read_to_string(snapshots.join(other).join("manifest.json"))
                    .is_ok_and(|m| m.contains(&format!("/{name}\"")))
            });
            if !named && !a_base {
                wrong.push(format!(
                    "{session}: checkpoint {name} is stored but not recorded"
                ));
            }
        }
    }
    let running: Vec<String> = vmm_processes(&d.dir).into_iter().map(|(_, s)| s).collect();
    for s in &sessions {
        let on_a_vm = s.harness.starts_with("testguest");
        if on_a_vm
            && s.compute_state == ComputeState::ComputeLive as i32
            && !running.contains(&uid(s))
        {
            // Allowed only until the lost compute is recorded, which happens at start-up.
            wrong.push(format!("{} says LIVE without a VMM", uid(s)));
        }
    }
    for (session, before) in &known.records {
        if !active.contains(session) {
            continue;
        }
        let after = replay(c, session).await;
        if after.len() < before.len() || after[..before.len()] != before[..] {
            wrong.push(format!(
                "{session}: acknowledged records were lost or changed"
            ));
        }
    }
    for session in &active {
        let (_, answer) = turn(c, session).await;
        let records = replay(c, session).await;
        if let Err(e) = verify_chain(&records) {
            wrong.push(format!("{session}: journal verify: {e}"));
        }
        let count = match answer {
            Ok(a) => a,
            Err(e) => {
                wrong.push(format!("{session}: the turn after the restart failed: {e}"));
                continue;
            }
        };
        let Some((_, before)) = known.counts.iter().find(|(s, _)| s == session) else {
            continue;
        };
        let last_known_seq = known
            .records
            .iter()
            .find(|(s, _)| s == session)
            .and_then(|(_, r)| r.last())
            .map_or(0, |r| r.seq);
        if count != (before + 1).to_string() && !compute_lost_after(&records, last_known_seq) {
            wrong.push(format!(
                "{session}: counted {count} after {before}, and its log records no loss"
            ));
        }
        // What the crash left must also carry a suspend (a live fork's base, say, is copied
        // into the store then) and a resume with the count.
        if let Err(e) = c
            .suspend(SuspendRequest {
                session: session.clone(),
            })
            .await
        {
            wrong.push(format!("{session}: suspend after the restart failed: {e}"));
            continue;
        }
        let next = count.parse::<u64>().map(|n| (n + 1).to_string());
        match turn(c, session).await.1 {
            Ok(again) if Ok(&again) == next.as_ref() => {}
            Ok(again) => wrong.push(format!(
                "{session}: counted {again} after a suspend at {count}"
            )),
            Err(e) => wrong.push(format!("{session}: the turn after a suspend failed: {e}")),
        }
    }
    wrong
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_crash_point_recovers_with_nothing_lost_or_leaked() {
    if let Some(reason) = kvm_unavailable() {
        eprintln!("SKIPPED: {reason}; this test needs KVM");
        return;
    }
    let mut failures = Vec::new();
    let restores = crash_point::ALL
        .iter()
        .filter(|p| p.starts_with("start."))
        .map(|p| (*p, Via::Restore));
    // The process runtime (echo) has no VMM to spawn and no memory to snapshot.
    let vmm_only = [
        crash_point::START_SPAWNED,
        crash_point::SUSPEND_PAUSED,
        crash_point::SUSPEND_FORKED,
        crash_point::SUSPEND_STORED,
        crash_point::CHECKPOINT_TAKEN,
        crash_point::CHECKPOINT_STORED,
        crash_point::CHECKPOINT_RECORDED,
        crash_point::CHECKPOINT_MERGED,
    ];
    // Only a live fork's checkpoint forks a VM in place; every suspend point is reached
    // inside one too.
    let live_fork_only = [crash_point::SUSPEND_FORKED];
    let live_forks = crash_point::ALL
        .iter()
        .filter(|p| p.starts_with("suspend."))
        .map(|p| (*p, Via::Boot, "testguest", true));
    let processes = crash_point::ALL
        .iter()
        .filter(|p| !vmm_only.contains(p))
        .map(|p| (*p, Via::Boot, "echo", false));
    let cases: Vec<(&str, Via, &str, bool)> = crash_point::ALL
        .iter()
        .filter(|p| !live_fork_only.contains(p))
        .map(|p| (*p, Via::Boot))
        .chain(restores)
        .map(|(p, via)| (p, via, "testguest", false))
        .chain(live_forks)
        .chain(processes)
        .collect();
    // AGENTVM_CRASH_CASES=SUBSTRING runs only the matching cases, named as they are logged
    // ("suspend.forked (fork)"), when working on one.
    let only = std::env::var("AGENTVM_CRASH_CASES").unwrap_or_default();
    for (point, via, harness, live_fork) in cases {
        let family = operation(point, live_fork);
        let name = format!("{point} ({family})");
        if !name.contains(only.as_str()) {
            continue;
        }
        let started = Instant::now();
        let dir = tempfile::tempdir().unwrap();
        let mut known = Known::default();
        {
            // A restore is the second start of its session: its first turn booted it.
            let armed = match via {
                Via::Boot => point.to_owned(),
                Via::Restore => format!("{point}@2"),
            };
            let mut d = Daemon::start(dir.path(), Some(&armed));
            let mut c = d.client().await;
            crash(point, family, via, harness, &mut c, &mut known).await;
            if !d.died_by_sigkill() {
                failures.push(format!(
                    "{name} ({via:?}, {harness}): the daemon never reached it"
                ));
                continue;
            }
            // Its VMMs run on, as after a real kill -9, for the next daemon to deal with.
            d.reap = false;
        }
        let d = Daemon::start(dir.path(), None);
        let mut c = d.client().await;
        let wrong = check(&d, &mut c, &known).await;
        eprintln!(
            "{name} ({via:?}, {harness}): {} in {:?}",
            if wrong.is_empty() { "ok" } else { "WRONG" },
            started.elapsed()
        );
        if !wrong.is_empty() {
            let log = std::fs::read_to_string(dir.path().join("agentvmd.log")).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            failures.push(format!(
                "{name} ({via:?}, {harness}):\n  {}\n  daemon log, last lines first:\n    {}",
                wrong.join("\n  "),
                tail.join("\n    ")
            ));
        }
        if std::env::var_os("AGENTVM_CRASH_KEEP_LOGS").is_some() {
            let _ = std::fs::copy(
                dir.path().join("agentvmd.log"),
                format!("/tmp/crash-{point}-{family}-{harness}.log"),
            );
        }
        drop(d);
        assert!(
            vmm_processes(dir.path()).is_empty(),
            "{name} ({via:?}, {harness}): VMMs outlived the test"
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
