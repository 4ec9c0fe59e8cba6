//! The lane's scenarios: each drives agentvmd's Sessions API with real Linux images and
//! returns a one-line detail of what it saw, or the first thing that went wrong.

use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use agentvm_proto::v1::ComputeState;
use agentvm_proto::v1::event::Body;
use agentvm_proto::v1::lifecycle::Kind as LifecycleKind;
use anyhow::{Context, bail, ensure};

use crate::daemon::{Daemon, process_alive, signal};
use crate::session::{self, Client};

/// What every scenario gets: the daemon, and the sessions it made (deleted afterwards).
pub struct Lane {
    pub daemon: Daemon,
    pub sessions: Vec<String>,
}

impl Lane {
    pub async fn c(&self) -> anyhow::Result<Client> {
        self.daemon.client().await
    }

    async fn create(&mut self, harness: &str) -> anyhow::Result<String> {
        let mut c = self.c().await?;
        let s = session::create(&mut c, harness).await?;
        self.sessions.push(s.clone());
        Ok(s)
    }

    /// Deletes what the last scenario made, so the next one starts on an empty node.
    pub async fn clean_up(&mut self) {
        if let Ok(mut c) = self.c().await {
            for s in self.sessions.drain(..) {
                let _ = session::delete(&mut c, &s).await;
            }
        }
    }
}

pub type Outcome<'a> = Pin<Box<dyn Future<Output = anyhow::Result<String>> + Send + 'a>>;
pub type Scenario = for<'a> fn(&'a mut Lane) -> Outcome<'a>;

/// Every scenario by name, in the order a full run takes them.
pub const ALL: &[(&str, Scenario)] = &[
    ("testguest-turns", |l| Box::pin(testguest_turns(l))),
    ("echo-turns", |l| Box::pin(echo_turns(l))),
    ("chat-echo-model", |l| Box::pin(chat_echo_model(l))),
    ("counter-suspend-resume", |l| {
        Box::pin(counter_suspend_resume(l))
    }),
    ("counter-long-session", |l| {
        Box::pin(counter_long_session(l))
    }),
    ("fork-three-children", |l| Box::pin(fork_three_children(l))),
    ("workspace-disk-fork", |l| Box::pin(workspace_disk_fork(l))),
    ("oci-harness", |l| Box::pin(oci_harness(l))),
    ("oci-python-harness", |l| Box::pin(oci_python_harness(l))),
    ("egress-policy", |l| Box::pin(egress_policy(l))),
    ("clock-stepped-after-resume", |l| {
        Box::pin(clock_stepped_after_resume(l))
    }),
    ("vmm-killed-mid-turn", |l| Box::pin(vmm_killed_mid_turn(l))),
    ("harness-crash-restarted", |l| {
        Box::pin(harness_crash_restarted(l))
    }),
    ("daemon-restart-readopts", |l| {
        Box::pin(daemon_restart_readopts(l))
    }),
    ("daemon-killed-mid-suspend", |l| {
        Box::pin(daemon_killed_mid_suspend(l))
    }),
    ("template-starts", |l| Box::pin(template_starts(l))),
    ("time-travel", |l| Box::pin(time_travel(l))),
];

/// Scenarios run only when named (`tests/linux/run.sh NAME`), not in a full run: none now.
/// (A scenario too slow or too new for every CI run goes here, saying why.)
pub const NAMED_ONLY: &[(&str, Scenario)] = &[];

fn expect(got: &str, want: &str, what: &str) -> anyhow::Result<()> {
    ensure!(got == want, "{what}: answered {got:?}, expected {want:?}");
    Ok(())
}

fn secs(d: Duration) -> String {
    format!("{:.2}s", d.as_secs_f64())
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or_default()
}

/// One answer of the lane's probe harness.
struct ProbeAnswer {
    count: u64,
    random: String,
    unix_ms: u64,
    /// The workspace's note.txt (None: no such file).
    note: Option<String>,
}

async fn probe(c: &mut Client, session: &str, input: &str) -> anyhow::Result<ProbeAnswer> {
    let text = session::say(c, session, input).await?;
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("probe answered {text:?}"))?;
    let field = |k: &str| {
        v.get(k)
            .with_context(|| format!("probe answer {text:?} has no {k}"))
    };
    Ok(ProbeAnswer {
        count: field("count")?.as_u64().context("count")?,
        random: field("random")?.as_str().context("random")?.to_owned(),
        unix_ms: field("unix_ms")?.as_u64().context("unix_ms")?,
        note: field("note")?.as_str().map(str::to_owned),
    })
}

/// The guest's wall clock, read during a turn that ran between `before` and `after` on the
/// host, is the host's to within `slack_ms`.
fn check_clock(
    answer: &ProbeAnswer,
    before: u64,
    after: u64,
    slack_ms: u64,
    who: &str,
) -> anyhow::Result<()> {
    ensure!(
        answer.unix_ms + slack_ms >= before && answer.unix_ms <= after + slack_ms,
        "{who}'s wall clock reads {} ms, the host's was {before}..{after} during the turn",
        answer.unix_ms
    );
    Ok(())
}

async fn testguest_turns(lane: &mut Lane) -> anyhow::Result<String> {
    let s = lane.create("testguest").await?;
    let mut c = lane.c().await?;
    let t = Instant::now();
    expect(&session::say(&mut c, &s, "go").await?, "1", "first turn")?;
    let first = t.elapsed();
    expect(&session::say(&mut c, &s, "go").await?, "2", "second turn")?;
    Ok(format!("first turn {}", secs(first)))
}

async fn echo_turns(lane: &mut Lane) -> anyhow::Result<String> {
    let s = lane.create("linux-echo").await?;
    let mut c = lane.c().await?;
    let t = Instant::now();
    expect(
        &session::say(&mut c, &s, "hello linux").await?,
        "echo:hello linux",
        "first turn",
    )?;
    let first = t.elapsed();
    let mut warm = Vec::new();
    for text in ["warm one", "warm two", "warm three"] {
        let t = Instant::now();
        expect(
            &session::say(&mut c, &s, text).await?,
            &format!("echo:{text}"),
            "warm turn",
        )?;
        warm.push(t.elapsed());
    }
    let records = session::verify(&mut c, &s).await?;
    warm.sort();
    Ok(format!(
        "first turn (boot + agent + harness) {}, warm turn median {}, {records} records verified",
        secs(first),
        secs(warm[warm.len() / 2])
    ))
}

async fn chat_echo_model(lane: &mut Lane) -> anyhow::Result<String> {
    let s = lane.create("linux-chat").await?;
    let mut c = lane.c().await?;
    let first = session::say(&mut c, &s, "hello chat").await?;
    ensure!(first.contains("hello chat"), "chat answered {first:?}");
    let second = session::say(&mut c, &s, "and again").await?;
    ensure!(second.contains("and again"), "chat answered {second:?}");
    session::verify(&mut c, &s).await?;
    Ok(format!("answers {first:?}, {second:?}"))
}

async fn counter_suspend_resume(lane: &mut Lane) -> anyhow::Result<String> {
    let s = lane.create("linux-counter").await?;
    let mut c = lane.c().await?;
    for n in 1..=3 {
        expect(
            &session::say(&mut c, &s, "go").await?,
            &n.to_string(),
            "turn",
        )?;
    }
    let pid = lane.daemon.vmm_pid(&s)?;
    let t = Instant::now();
    session::suspend(&mut c, &s).await?;
    let suspended = t.elapsed();
    ensure!(
        !process_alive(pid),
        "the suspended session's VMM {pid} still runs"
    );
    ensure!(
        session::compute(&mut c, &s).await? == ComputeState::ComputeCold,
        "a suspended session is not COLD"
    );
    let t = Instant::now();
    session::resume(&mut c, &s).await?;
    let resumed = t.elapsed();
    expect(
        &session::say(&mut c, &s, "go").await?,
        "4",
        "turn after resume",
    )?;
    ensure!(lane.daemon.vmm_pid(&s)? != pid, "resume reused the old VMM");
    let records = session::verify(&mut c, &s).await?;
    Ok(format!(
        "suspend {}, resume {}, answered 4, {records} records verified",
        secs(suspended),
        secs(resumed)
    ))
}

/// Turns the lane's long session runs; its detail compares the first with the last.
const LONG_SESSION_TURNS: u64 = 300;

/// A Linux counter (memory tier) run to 300 turns: each answer is the next count, the log
/// verifies, and the detail gives the median turn near the start and near the end (a turn
/// must not cost more as the session grows; the figure is reported, not asserted on).
async fn counter_long_session(lane: &mut Lane) -> anyhow::Result<String> {
    let s = lane.create("linux-counter").await?;
    let mut c = lane.c().await?;
    let mut took = Vec::with_capacity(LONG_SESSION_TURNS as usize);
    for n in 1..=LONG_SESSION_TURNS {
        let t = Instant::now();
        let answer = session::say(&mut c, &s, "go").await?;
        took.push(t.elapsed());
        expect(&answer, &n.to_string(), "turn")?;
    }
    let median = |window: &[Duration]| {
        let mut w = window.to_vec();
        w.sort();
        w[w.len() / 2]
    };
    // Turns 10..20 (past the first turn's boot) and the last ten.
    let early = median(&took[9..20]);
    let late = median(&took[took.len() - 10..]);
    let records = session::verify(&mut c, &s).await?;
    Ok(format!(
        "{LONG_SESSION_TURNS} turns; median turn 10-20 {}, last 10 {} ({:.2}x); {records} \
         records verified",
        secs(early),
        secs(late),
        late.as_secs_f64() / early.as_secs_f64()
    ))
}

async fn fork_three_children(lane: &mut Lane) -> anyhow::Result<String> {
    let parent = lane.create("linux-probe").await?;
    let mut c = lane.c().await?;
    for n in 1..=3 {
        let a = probe(&mut c, &parent, "go").await?;
        ensure!(a.count == n, "parent turn {n} counted {}", a.count);
    }
    let t = Instant::now();
    let children = session::fork(&mut c, &parent, 3).await?;
    let forked = t.elapsed();
    lane.sessions.extend(children.iter().cloned());
    ensure!(
        children.len() == 3,
        "Fork(3) made {} children",
        children.len()
    );
    // We do not park the parent: its VM ran on through the fork.
    let parent_compute = session::compute(&mut c, &parent).await?;
    ensure!(
        parent_compute == ComputeState::ComputeLive,
        "the forked parent reads {parent_compute:?}, not LIVE"
    );
    let mut randoms = HashSet::new();
    for child in &children {
        let before = unix_ms();
        let a = probe(&mut c, child, "go").await?;
        check_clock(&a, before, unix_ms(), 2000, child)?;
        ensure!(
            a.count == 4,
            "child {child} counted {} (its parent was at 3)",
            a.count
        );
        ensure!(
            randoms.insert(a.random.clone()),
            "child {child}'s kernel RNG repeats a sibling's output {}",
            a.random
        );
    }
    let a = probe(&mut c, &parent, "go").await?;
    ensure!(
        a.count == 4,
        "the parent counted {} after the fork",
        a.count
    );
    ensure!(
        randoms.insert(a.random.clone()),
        "the parent's kernel RNG repeats a child's output {}",
        a.random
    );
    // The children diverge: one more turn in the first child only.
    let a = probe(&mut c, &children[0], "go").await?;
    ensure!(a.count == 5, "child 0's second turn counted {}", a.count);
    let a = probe(&mut c, &children[1], "go").await?;
    ensure!(a.count == 5, "child 1's second turn counted {}", a.count);
    for s in children.iter().chain([&parent]) {
        session::verify(&mut c, s).await?;
    }
    Ok(format!(
        "Fork(3) {}, parent LIVE throughout; children answered 4 then 5, parent 4; 4 distinct RNG outputs; clocks within 2 s",
        secs(forked)
    ))
}

/// The probe image's ext4 workspace: a file written in a turn is there after suspend and
/// resume; fork children start with the parent's file and never see each other's writes.
async fn workspace_disk_fork(lane: &mut Lane) -> anyhow::Result<String> {
    let parent = lane.create("linux-probe").await?;
    let mut c = lane.c().await?;
    let note = |a: &ProbeAnswer| a.note.clone().unwrap_or_else(|| "(none)".into());
    let a = probe(&mut c, &parent, "look").await?;
    ensure!(
        a.note.is_none(),
        "a new workspace holds a note: {}",
        note(&a)
    );
    let a = probe(&mut c, &parent, "note from the parent").await?;
    expect(&note(&a), "from the parent", "the note just written")?;
    session::suspend(&mut c, &parent).await?;
    let a = probe(&mut c, &parent, "look").await?;
    ensure!(a.count == 3, "after resume the parent counted {}", a.count);
    expect(
        &note(&a),
        "from the parent",
        "the note after suspend and resume",
    )?;
    let children = session::fork(&mut c, &parent, 2).await?;
    lane.sessions.extend(children.iter().cloned());
    let a = probe(&mut c, &children[0], "note from child 0").await?;
    expect(&note(&a), "from child 0", "child 0's own note")?;
    let a = probe(&mut c, &children[1], "look").await?;
    expect(&note(&a), "from the parent", "child 1 before writing")?;
    let a = probe(&mut c, &children[1], "note from child 1").await?;
    expect(&note(&a), "from child 1", "child 1's own note")?;
    let a = probe(&mut c, &children[0], "look").await?;
    expect(&note(&a), "from child 0", "child 0 after child 1 wrote")?;
    let a = probe(&mut c, &parent, "look").await?;
    expect(
        &note(&a),
        "from the parent",
        "the parent after its children wrote",
    )?;
    for s in children.iter().chain([&parent]) {
        session::verify(&mut c, s).await?;
    }
    Ok(
        "a note on the ext4 workspace survived suspend/resume; 2 fork children each kept their own"
            .into(),
    )
}

/// What the probe's `connect` saw: the guest's own address and the server's line, or why not.
async fn probe_connect(
    c: &mut Client,
    session: &str,
    target: &str,
) -> anyhow::Result<Result<(String, String), String>> {
    let text = session::say(c, session, &format!("connect {target}")).await?;
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("probe answered {text:?}"))?;
    let connect = &v["connect"];
    if let Some(error) = connect["error"].as_str() {
        return Ok(Err(error.to_owned()));
    }
    match (connect["source"].as_str(), connect["line"].as_str()) {
        (Some(source), Some(line)) => Ok(Ok((source.to_owned(), line.to_owned()))),
        _ => bail!("probe answered {text:?} to connect {target}"),
    }
}

/// Guest networking and its egress policy, against two test hosts in the L1: a VM of an
/// image without `[network]` reaches nothing; one whose image allows `allowed.test:8080`
/// reaches that host by name, and not the other host (by name: the resolver refuses it; by
/// address: the device drops it), nor the allowed host on another port, nor its gateway. A
/// fork child and a resumed VM get addresses of their own and still reach the allowed host.
async fn egress_policy(lane: &mut Lane) -> anyhow::Result<String> {
    crate::test_hosts::start()?;
    let mut c = lane.c().await?;
    let offline = lane.create("linux-probe").await?;
    let refused = |r: &Result<(String, String), String>, what: &str| -> anyhow::Result<()> {
        ensure!(r.is_err(), "{what} got through: {r:?}");
        Ok(())
    };
    refused(
        &probe_connect(&mut c, &offline, "10.78.1.2:8080").await?,
        "a VM without a network",
    )?;
    let s = lane.create("linux-probe-net").await?;
    let allowed = |r: Result<(String, String), String>, what: &str| -> anyhow::Result<String> {
        match r {
            Ok((source, line)) if line == "allowed.test" => Ok(source),
            other => bail!("{what}: {other:?}"),
        }
    };
    let t = Instant::now();
    let parent_address = allowed(
        probe_connect(&mut c, &s, "allowed.test:8080").await?,
        "the allowed host by name",
    )?;
    let first = t.elapsed();
    let by_name = probe_connect(&mut c, &s, "refused.test:8080").await?;
    ensure!(
        matches!(&by_name, Err(e) if e.contains("refused refused.test")),
        "the refused host by name: {by_name:?}"
    );
    refused(
        &probe_connect(&mut c, &s, "10.78.2.2:8080").await?,
        "the refused host by address",
    )?;
    refused(
        &probe_connect(&mut c, &s, "10.78.1.2:22").await?,
        "the allowed host on another port",
    )?;
    let gateway = {
        let mut octets: std::net::Ipv4Addr = parent_address.parse()?;
        let o = octets.octets();
        octets = std::net::Ipv4Addr::new(o[0], o[1], o[2], o[3] - 1);
        octets
    };
    refused(
        &probe_connect(&mut c, &s, &format!("{gateway}:22")).await?,
        "the gateway (a host service)",
    )?;
    let children = session::fork(&mut c, &s, 1).await?;
    lane.sessions.extend(children.iter().cloned());
    let child_address = allowed(
        probe_connect(&mut c, &children[0], "allowed.test:8080").await?,
        "the fork child to the allowed host",
    )?;
    ensure!(
        child_address != parent_address,
        "the fork child kept its parent's address {parent_address}"
    );
    allowed(
        probe_connect(&mut c, &s, "allowed.test:8080").await?,
        "the parent after its fork",
    )?;
    session::suspend(&mut c, &s).await?;
    let resumed_address = allowed(
        probe_connect(&mut c, &s, "allowed.test:8080").await?,
        "the parent after suspend and resume",
    )?;
    refused(
        &probe_connect(&mut c, &s, "10.78.2.2:8080").await?,
        "the refused host after resume",
    )?;
    for s in children.iter().chain([&s]) {
        session::verify(&mut c, s).await?;
    }
    Ok(format!(
        "offline VM reached nothing; allowed.test reached in {} ({parent_address}), refused.test \
         refused by name and address, other port and gateway dropped; fork child at \
         {child_address}, resumed at {resumed_address}",
        secs(first)
    ))
}

/// A container image as the guest's root: the reference harness from an OCI layout (two
/// layers, a whiteout), booted from an erofs disk under an overlay, run by the image's
/// Entrypoint/Cmd as its User; turns, suspend and resume (a fresh VM by replay), and a fork.
async fn oci_harness(lane: &mut Lane) -> anyhow::Result<String> {
    let s = lane.create("linux-oci-echo").await?;
    let mut c = lane.c().await?;
    let t = Instant::now();
    expect(
        &session::say(&mut c, &s, "from a container image").await?,
        "echo:from a container image",
        "first turn",
    )?;
    let first = t.elapsed();
    session::suspend(&mut c, &s).await?;
    expect(
        &session::say(&mut c, &s, "after resume").await?,
        "echo:after resume",
        "turn after suspend and resume",
    )?;
    let children = session::fork(&mut c, &s, 1).await?;
    lane.sessions.extend(children.iter().cloned());
    expect(
        &session::say(&mut c, &children[0], "in the child").await?,
        "echo:in the child",
        "the fork child's turn",
    )?;
    for session in children.iter().chain([&s]) {
        session::verify(&mut c, session).await?;
    }
    Ok(format!(
        "first turn (boot from the erofs root) {}; resumed and forked",
        secs(first)
    ))
}

/// One answer of the Python reference harness: (count, what it said, lines in its log).
async fn python_turn(
    c: &mut Client,
    session: &str,
    text: &str,
) -> anyhow::Result<(u64, String, u64)> {
    let answer = session::say(c, session, text).await?;
    let v: serde_json::Value = serde_json::from_str(&answer)
        .with_context(|| format!("the Python harness answered {answer:?}"))?;
    Ok((
        v["count"].as_u64().context("count")?,
        v["said"].as_str().context("said")?.to_owned(),
        v["logged"]
            .as_u64()
            .with_context(|| format!("no workspace log in {answer}"))?,
    ))
}

/// What the Python harness's `connect` saw: the server's first line, or why not.
async fn python_connect(
    c: &mut Client,
    session: &str,
    target: &str,
) -> anyhow::Result<Result<String, String>> {
    let answer = session::say(c, session, &format!("connect {target}")).await?;
    let v: serde_json::Value = serde_json::from_str(&answer)
        .with_context(|| format!("the Python harness answered {answer:?}"))?;
    match (
        v["connect"]["line"].as_str(),
        v["connect"]["error"].as_str(),
    ) {
        (Some(line), _) => Ok(Ok(line.to_owned())),
        (None, Some(error)) => Ok(Err(error.to_owned())),
        _ => bail!("the Python harness answered {answer:?} to connect"),
    }
}

/// The Python reference harness from a container image (Debian's python3 and grpcio): its
/// count lives in memory and its log on the workspace disk; both survive suspend and resume,
/// and each fork child carries on with its own copy of both. Its image allows
/// `allowed.test:8080`, which it reaches by name (glibc's resolver in the image asking
/// agentvmd's), and nothing else.
async fn oci_python_harness(lane: &mut Lane) -> anyhow::Result<String> {
    crate::test_hosts::start()?;
    let s = lane.create("linux-python").await?;
    let mut c = lane.c().await?;
    let t = Instant::now();
    let first = python_turn(&mut c, &s, "one").await?;
    let first_turn = t.elapsed();
    ensure!(first == (1, "one".into(), 1), "first turn: {first:?}");
    let reached = python_connect(&mut c, &s, "allowed.test:8080").await?;
    ensure!(
        reached.as_deref() == Ok("allowed.test"),
        "the allowed host: {reached:?}"
    );
    let refused = python_connect(&mut c, &s, "refused.test:8080").await?;
    ensure!(refused.is_err(), "the refused host answered: {refused:?}");
    session::suspend(&mut c, &s).await?;
    let second = python_turn(&mut c, &s, "two").await?;
    ensure!(second == (4, "two".into(), 4), "after resume: {second:?}");
    let children = session::fork(&mut c, &s, 2).await?;
    lane.sessions.extend(children.iter().cloned());
    for (i, child) in children.iter().enumerate() {
        let text = format!("child {i}");
        let got = python_turn(&mut c, child, &text).await?;
        ensure!(got == (5, text.clone(), 5), "child {i}: {got:?}");
    }
    let reached = python_connect(&mut c, &children[1], "allowed.test:8080").await?;
    ensure!(
        reached.as_deref() == Ok("allowed.test"),
        "a fork child to the allowed host: {reached:?}"
    );
    let third = python_turn(&mut c, &s, "three").await?;
    ensure!(
        third == (5, "three".into(), 5),
        "the parent after the fork: {third:?}"
    );
    for session in children.iter().chain([&s]) {
        session::verify(&mut c, session).await?;
    }
    Ok(format!(
        "first turn (boot, python3 and grpcio from the erofs root) {}; allowed.test reached by \
         name, refused.test not; count and workspace log kept through suspend/resume; 2 fork \
         children each went on with their own, one reaching allowed.test",
        secs(first_turn)
    ))
}

async fn clock_stepped_after_resume(lane: &mut Lane) -> anyhow::Result<String> {
    let s = lane.create("linux-probe").await?;
    let mut c = lane.c().await?;
    let first = probe(&mut c, &s, "go").await?;
    session::suspend(&mut c, &s).await?;
    // Long enough that a guest clock frozen at the snapshot would be visibly behind.
    let gap = Duration::from_secs(8);
    tokio::time::sleep(gap).await;
    session::resume(&mut c, &s).await?;
    let before = unix_ms();
    let a = probe(&mut c, &s, "go").await?;
    let after = unix_ms();
    ensure!(a.count == 2, "the resumed probe counted {}", a.count);
    ensure!(
        a.random != first.random,
        "the RNG repeated across a restore"
    );
    check_clock(&a, before, after, 2000, "the resumed guest")?;
    Ok(format!(
        "after an {}s suspension the guest clock was {} ms off the host's",
        gap.as_secs(),
        a.unix_ms as i64 - ((before + after) / 2) as i64
    ))
}

async fn vmm_killed_mid_turn(lane: &mut Lane) -> anyhow::Result<String> {
    let s = lane.create("linux-probe").await?;
    let mut c = lane.c().await?;
    ensure!(probe(&mut c, &s, "go").await?.count == 1, "turn 1");
    ensure!(probe(&mut c, &s, "go").await?.count == 2, "turn 2");
    session::suspend(&mut c, &s).await?;
    ensure!(
        probe(&mut c, &s, "go").await?.count == 3,
        "turn 3 (restored)"
    );
    // A turn the harness holds for a while, killed once its input is journaled: the VMM
    // dies with the execution inside the guest.
    let pid = lane.daemon.vmm_pid(&s)?;
    let (started_tx, started) = tokio::sync::oneshot::channel();
    let in_flight = tokio::spawn(session::failing_turn(
        c.clone(),
        s.clone(),
        "sleep 5000".into(),
        Some(started_tx),
    ));
    tokio::time::timeout(Duration::from_secs(60), started)
        .await
        .context("the slow turn never started")?
        .context("the slow turn ended before its input was journaled")?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    signal(pid, nix::sys::signal::Signal::SIGKILL);
    let message = in_flight.await??;
    session::wait_compute(
        &mut c,
        &s,
        ComputeState::ComputeCold,
        Duration::from_secs(30),
    )
    .await
    .context("the lost VMM was never recorded")?;
    let records = session::replay(&mut c, &s).await?;
    let Some(Body::Lifecycle(last)) = records
        .last()
        .and_then(|r| r.event.as_ref())
        .and_then(|e| e.body.clone())
    else {
        bail!("the last record is not a lifecycle record");
    };
    ensure!(
        last.kind == LifecycleKind::LifecycleSuspend as i32 && last.detail.contains("compute lost"),
        "the last record does not record the lost compute: {last:?}"
    );
    // Turn 3's memory died with the VMM: the next turn continues from the snapshot at 2.
    let after = probe(&mut c, &s, "go").await?;
    ensure!(
        after.count == 3,
        "the turn after the loss counted {}",
        after.count
    );
    let n = session::verify(&mut c, &s).await?;
    Ok(format!(
        "the in-flight turn failed with {message:?}; recovered at 3; {n} records verified"
    ))
}

async fn harness_crash_restarted(lane: &mut Lane) -> anyhow::Result<String> {
    let s = lane.create("linux-probe").await?;
    let mut c = lane.c().await?;
    ensure!(probe(&mut c, &s, "go").await?.count == 1, "first turn");
    ensure!(probe(&mut c, &s, "go").await?.count == 2, "second turn");
    let pid = lane.daemon.vmm_pid(&s)?;
    let message = session::failing_turn(c.clone(), s.clone(), "crash".into(), None).await?;
    // The agent restarts the harness in the same VM: a fresh process counts from 1.
    let started = Instant::now();
    let answer = loop {
        match probe(&mut c, &s, "go").await {
            Ok(a) => break a,
            Err(e) if started.elapsed() < Duration::from_secs(30) => {
                tracing_note(&format!("turn after the crash: {e:#}"));
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => return Err(e.context("no turn answered within 30 s of the crash")),
        }
    };
    ensure!(
        answer.count == 1,
        "the restarted harness counted {}",
        answer.count
    );
    ensure!(
        lane.daemon.vmm_pid(&s)? == pid && process_alive(pid),
        "the VM was replaced rather than its harness restarted"
    );
    session::verify(&mut c, &s).await?;
    Ok(format!(
        "the crashed turn failed with {message:?}; the harness answered again after {} in the same VM",
        secs(started.elapsed())
    ))
}

async fn daemon_restart_readopts(lane: &mut Lane) -> anyhow::Result<String> {
    let s = lane.create("linux-counter").await?;
    let mut c = lane.c().await?;
    expect(&session::say(&mut c, &s, "go").await?, "1", "turn 1")?;
    expect(&session::say(&mut c, &s, "go").await?, "2", "turn 2")?;
    let pid = lane.daemon.vmm_pid(&s)?;
    let t = Instant::now();
    lane.daemon.crash_and_restart().await?;
    let restarted = t.elapsed();
    let mut c = lane.c().await?;
    expect(
        &session::say(&mut c, &s, "go").await?,
        "3",
        "turn after the restart",
    )?;
    ensure!(
        lane.daemon.vmm_pid(&s)? == pid,
        "the session runs in a new VMM, not the adopted one"
    );
    session::verify(&mut c, &s).await?;
    Ok(format!(
        "agentvmd killed and back in {}; VMM {pid} adopted, answered 3",
        secs(restarted)
    ))
}

/// kill -9 of agentvmd while it writes a Linux VM's snapshot (its VMM's outbox exists), then
/// a restart: the counter goes on from 2 (the paused VM resumed and re-adopted, or the
/// finished snapshot recorded), or the log says its memory was lost; no VMM or VMM
/// directory is left without its session, and the log verifies.
async fn daemon_killed_mid_suspend(lane: &mut Lane) -> anyhow::Result<String> {
    let s = lane.create("linux-counter").await?;
    let mut c = lane.c().await?;
    expect(&session::say(&mut c, &s, "go").await?, "1", "turn 1")?;
    expect(&session::say(&mut c, &s, "go").await?, "2", "turn 2")?;
    let outbox = lane.daemon.vm_dir(&s).join("snapshot");
    let suspending = {
        let mut c = c.clone();
        let s = s.clone();
        tokio::spawn(async move { session::suspend(&mut c, &s).await })
    };
    let t = Instant::now();
    let mut caught = false;
    while t.elapsed() < Duration::from_secs(60) && !suspending.is_finished() {
        if outbox.exists() {
            caught = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    lane.daemon.crash_and_restart().await?;
    let _ = suspending.await;
    let mut c = lane.c().await?;
    let answer = session::say(&mut c, &s, "go").await?;
    let records = session::replay(&mut c, &s).await?;
    let lost = records.iter().any(|r| {
        matches!(r.event.as_ref().and_then(|e| e.body.as_ref()),
            Some(Body::Lifecycle(l)) if l.detail.starts_with("compute lost"))
    });
    ensure!(
        answer == "3" || lost,
        "counted {answer} after 2 and the log records no loss"
    );
    for entry in std::fs::read_dir(lane.daemon.vms_dir())?.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        ensure!(
            name.starts_with('.') || lane.sessions.contains(&name),
            "vms/{name} belongs to no session of this scenario"
        );
    }
    let n = session::verify(&mut c, &s).await?;
    Ok(format!(
        "killed {} the snapshot was being written; answered {answer}{}; {n} records verified",
        if caught { "while" } else { "after" },
        if lost { " (loss recorded)" } else { "" }
    ))
}

fn tracing_note(message: &str) {
    eprintln!("lane: {message}");
}

/// A turn's text answer on `image`'s harness (echo, or the Python reference's JSON).
async fn first_answer(c: &mut Client, session: &str) -> anyhow::Result<(Duration, String)> {
    let t = Instant::now();
    let answer = session::say(c, session, "first").await?;
    Ok((t.elapsed(), answer))
}

/// The Python reference harness's `random` draw in `answer`.
fn python_random(answer: &str) -> anyhow::Result<f64> {
    let v: serde_json::Value = serde_json::from_str(answer)
        .with_context(|| format!("the Python harness answered {answer:?}"))?;
    v["random"].as_f64().context("no random in the answer")
}

/// Issue 36: a new session starts from its image's template (the image's VM booted once,
/// its harness asked Describe, saved) and is told who it is after the restore. For linux-echo
/// and the Python image: the first session's first turn (which makes the template), two
/// sessions' first turns from it, and the `cold_boot = true` twin's (a boot each time).
/// Sessions from one template differ in the kernel's RNG (the probe) and in Python's
/// `random` (reseeded on the restore signal).
async fn template_starts(lane: &mut Lane) -> anyhow::Result<String> {
    crate::test_hosts::start()?;
    lane.daemon.restart_with_templates(true).await?;
    let outcome = template_starts_on(lane).await;
    lane.clean_up().await;
    lane.daemon.restart_with_templates(false).await?;
    outcome
}

async fn template_starts_on(lane: &mut Lane) -> anyhow::Result<String> {
    let mut c = lane.c().await?;
    let mut report = Vec::new();
    for (image, cold) in [
        ("linux-echo", "linux-echo-cold"),
        ("linux-python", "linux-python-cold"),
    ] {
        let maker = lane.create(image).await?;
        let (made, _) = first_answer(&mut c, &maker).await?;
        let a = lane.create(image).await?;
        let (from_a, answer_a) = first_answer(&mut c, &a).await?;
        let b = lane.create(image).await?;
        let (from_b, answer_b) = first_answer(&mut c, &b).await?;
        let k = lane.create(cold).await?;
        let (booted, _) = first_answer(&mut c, &k).await?;
        let from = from_a.min(from_b);
        ensure!(
            from < booted,
            "{image}: a first turn from the template ({}) is no faster than a boot ({})",
            secs(from),
            secs(booted)
        );
        if image == "linux-python" {
            let (ra, rb) = (python_random(&answer_a)?, python_random(&answer_b)?);
            ensure!(
                ra != rb,
                "two sessions from one template drew the same Python random value {ra}"
            );
        }
        report.push(format!(
            "{image}: first turn from the template {} and {} against a boot {} ({:.2}x); the \
             first session's (template made) {}",
            secs(from_a),
            secs(from_b),
            secs(booted),
            from.as_secs_f64() / booted.as_secs_f64(),
            secs(made)
        ));
    }
    let p1 = lane.create("linux-probe").await?;
    let p2 = lane.create("linux-probe").await?;
    let (r1, r2) = (
        probe(&mut c, &p1, "go").await?.random,
        probe(&mut c, &p2, "go").await?.random,
    );
    ensure!(
        r1 != r2,
        "two probes from one template read the same kernel random {r1}"
    );
    report.push("kernel and Python randomness differ between sessions of one template".into());
    Ok(report.join("; "))
}

/// Every turn a fork point: a Linux counter writing its count into a note on its ext4
/// workspace runs 10 turns, each checkpointed; forks at turns 3 and 7 answer 4 and 8 and
/// read the note as it was then; the parent answers 11; every chain verifies.
async fn time_travel(lane: &mut Lane) -> anyhow::Result<String> {
    let mut c = lane.c().await?;
    let parent = session::create_with(
        &mut c,
        "linux-probe",
        &[("agentvm.dev/checkpoints", "32/10")],
    )
    .await?;
    lane.sessions.push(parent.clone());
    let note = |a: &ProbeAnswer| a.note.clone().unwrap_or_else(|| "(none)".into());
    for n in 1..=10 {
        let a = probe(&mut c, &parent, &format!("note turn {n}")).await?;
        ensure!(a.count == n, "parent turn {n} counted {}", a.count);
        expect(&note(&a), &format!("turn {n}"), "the note just written")?;
    }
    let mut node = lane.daemon.node_client().await?;
    let deadline = Instant::now() + Duration::from_secs(120);
    let kept = loop {
        let kept = session::checkpoints(&mut node, &parent).await?;
        if kept.last().is_some_and(|k| k.turn == 10) {
            break kept;
        }
        ensure!(
            Instant::now() < deadline,
            "no checkpoint of turn 10 within 120 s: {:?}",
            kept.iter().map(|k| k.turn).collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    ensure!(
        kept.iter().map(|k| k.turn).collect::<Vec<_>>() == (1..=10).collect::<Vec<u64>>(),
        "checkpoints of turns {:?}",
        kept.iter().map(|k| k.turn).collect::<Vec<_>>()
    );
    let bytes: u64 = kept.iter().map(|k| k.bytes).sum();
    let mut forked = Vec::new();
    for (turn, count) in [(3u64, 4u64), (7, 8)] {
        let t = Instant::now();
        let child = session::fork_at(&mut c, &parent, kept[turn as usize - 1].seq).await?;
        lane.sessions.push(child.clone());
        let a = probe(&mut c, &child, "look").await?;
        forked.push(t.elapsed());
        ensure!(
            a.count == count,
            "a fork at turn {turn} counted {} (want {count})",
            a.count
        );
        expect(
            &note(&a),
            &format!("turn {turn}"),
            &format!("the note of a fork at turn {turn}"),
        )?;
        session::verify(&mut c, &child).await?;
    }
    let a = probe(&mut c, &parent, "look").await?;
    ensure!(
        a.count == 11,
        "the parent counted {} after its forks",
        a.count
    );
    expect(&note(&a), "turn 10", "the parent's note")?;
    session::verify(&mut c, &parent).await?;
    Ok(format!(
        "10 turns, 10 checkpoints ({:.1} KiB on disk); forks at turns 3 and 7 answered 4 and 8 with their notes in {} and {}; parent 11",
        bytes as f64 / 1024.0,
        secs(forked[0]),
        secs(forked[1])
    ))
}
