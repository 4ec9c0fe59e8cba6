//! No request can break the Sessions service: random messages for every RPC, built from the
//! proto descriptors (every field may be absent, empty, huge, out of range, an unknown enum
//! value or the wrong oneof arm; session names are real ones part of the time so requests get
//! past the lookup), each answered within its deadline with a proper status — never a panic,
//! a dropped connection or a hang — and the node still serving afterwards.
//!
//! Which seeds run: `AGENTVM_FUZZ_SEED=<n>` replays that one run. Otherwise every seed in
//! `request_fuzz_seeds.txt` runs (each one that ever found a bug stays there), and outside CI
//! (`CI` unset) one fresh random seed after them, printed so a failure can be replayed. CI runs
//! the fixed list only, so a run fails on what its change did, never on a seed drawn by chance;
//! `scripts/fuzz.sh` is the separate, reported run of fresh seeds. `AGENTVM_FUZZ_CASES` sets a
//! run's length.

mod support;

use std::time::Duration;

use agentvm_proto::v1::{
    ApproveRequest, CancelRequest, CreateSessionRequest, DeleteSessionRequest, ExecRequest,
    ForkRequest, GetSessionRequest, ListSessionsRequest, ReplayRequest, ResumeRequest, Session,
    SuspendRequest,
};
use prost::Message as _;
use prost_reflect::{DynamicMessage, Kind, MapKey, MessageDescriptor, Value};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use support::{TestNode, start};
use tonic::{Code, Status};

const DEADLINE: Duration = Duration::from_secs(20);

struct Gen {
    rng: StdRng,
    uids: Vec<String>,
}

impl Gen {
    fn string(&mut self) -> String {
        match self.rng.random_range(0..12) {
            0 => String::new(),
            1 => "x".repeat(self.rng.random_range(1000..70_000)),
            2 => "ü🦀\u{202e}\u{0}".into(),
            3 => "../../etc/passwd".into(),
            4 => " padded ".into(),
            5 => "UPPER_case-label.name".into(),
            6 | 7 if !self.uids.is_empty() => {
                let i = self.rng.random_range(0..self.uids.len());
                self.uids[i].clone()
            }
            8 => "echo".into(),
            9 => format!("{}", self.rng.random::<i64>()),
            _ => (0..self.rng.random_range(1..20))
                .map(|_| self.rng.random_range(b'!'..=b'~') as char)
                .collect(),
        }
    }

    fn int(&mut self) -> i64 {
        match self.rng.random_range(0..8) {
            0 => 0,
            1 => -1,
            2 => i64::MIN,
            3 => i64::MAX,
            4 => (1 << 53) + 1,
            5 => i64::from(i32::MAX),
            _ => self.rng.random_range(-5..1000),
        }
    }

    fn value(&mut self, kind: &Kind, depth: u32) -> Value {
        match kind {
            Kind::Double => {
                Value::F64([0.0, -0.0, f64::NAN, f64::INFINITY, 1e308][self.rng.random_range(0..5)])
            }
            Kind::Float => {
                Value::F32([0.0, f32::NAN, f32::NEG_INFINITY, 3.5][self.rng.random_range(0..4)])
            }
            Kind::Int32 | Kind::Sint32 | Kind::Sfixed32 => Value::I32(self.int() as i32),
            Kind::Int64 | Kind::Sint64 | Kind::Sfixed64 => Value::I64(self.int()),
            Kind::Uint32 | Kind::Fixed32 => Value::U32(self.int() as u32),
            Kind::Uint64 | Kind::Fixed64 => Value::U64(self.int() as u64),
            Kind::Bool => Value::Bool(self.rng.random()),
            Kind::String => Value::String(self.string()),
            Kind::Bytes => {
                let len = if self.rng.random_ratio(1, 10) {
                    100_000
                } else {
                    self.rng.random_range(0..64)
                };
                Value::Bytes(
                    (0..len)
                        .map(|_| self.rng.random::<u8>())
                        .collect::<Vec<u8>>()
                        .into(),
                )
            }
            Kind::Enum(e) => {
                let known: Vec<i32> = e.values().map(|v| v.number()).collect();
                if self.rng.random_ratio(1, 5) || known.is_empty() {
                    Value::EnumNumber([999, -1, i32::MAX][self.rng.random_range(0..3)])
                } else {
                    Value::EnumNumber(known[self.rng.random_range(0..known.len())])
                }
            }
            Kind::Message(m) => Value::Message(self.message(m, depth + 1)),
        }
    }

    fn message(&mut self, desc: &MessageDescriptor, depth: u32) -> DynamicMessage {
        let mut msg = DynamicMessage::new(desc.clone());
        if depth > 4 {
            return msg;
        }
        for field in desc.fields() {
            if self.rng.random_ratio(1, 2) {
                continue;
            }
            let value = if field.is_map() {
                let Kind::Message(entry) = field.kind() else {
                    continue;
                };
                let (Some(k), Some(v)) = (entry.get_field(1), entry.get_field(2)) else {
                    continue;
                };
                let mut map = std::collections::HashMap::new();
                for _ in 0..self.rng.random_range(0..4) {
                    let key = match self.value(&k.kind(), depth) {
                        Value::String(s) => MapKey::String(s),
                        Value::I32(i) => MapKey::I32(i),
                        Value::I64(i) => MapKey::I64(i),
                        Value::U32(i) => MapKey::U32(i),
                        Value::U64(i) => MapKey::U64(i),
                        Value::Bool(b) => MapKey::Bool(b),
                        _ => continue,
                    };
                    map.insert(key, self.value(&v.kind(), depth));
                }
                Value::Map(map)
            } else if field.is_list() {
                let n = if self.rng.random_ratio(1, 20) {
                    300
                } else {
                    self.rng.random_range(0..4)
                };
                Value::List((0..n).map(|_| self.value(&field.kind(), depth)).collect())
            } else {
                self.value(&field.kind(), depth)
            };
            msg.set_field(&field, value);
        }
        msg
    }

    /// A random `T` (the message `agentsessions.v1.<name>`), built through its descriptor and
    /// decoded as the generated type.
    fn request<T: prost::Message + Default>(&mut self, name: &str) -> T {
        let desc = agentvm_proto::canon::descriptor_pool()
            .get_message_by_name(&format!("agentsessions.v1.{name}"))
            .expect("the message is in the descriptor set");
        let bytes = self.message(&desc, 0).encode_to_vec();
        T::decode(bytes.as_slice()).expect("a descriptor-built message decodes")
    }
}

/// What a well-behaved service may answer; anything else means a handler broke.
fn acceptable(status: &Status) -> bool {
    !matches!(
        status.code(),
        Code::Unknown | Code::Unavailable | Code::Internal
    )
}

async fn check<T>(rpc: &str, call: impl std::future::Future<Output = Result<T, Status>>) {
    match tokio::time::timeout(DEADLINE, call).await {
        Err(_) => panic!("{rpc}: no answer within {DEADLINE:?}"),
        Ok(Err(status)) if !acceptable(&status) => panic!("{rpc}: {status:?}"),
        Ok(_) => {}
    }
}

async fn drain<T>(
    stream: Result<tonic::Response<tonic::Streaming<T>>, Status>,
) -> Result<(), Status> {
    let mut stream = stream?.into_inner();
    for _ in 0..64 {
        match stream.message().await? {
            Some(_) => {}
            None => break,
        }
    }
    Ok(())
}

/// The seeds every run replays, one per line (`#` starts a comment).
const FIXED_SEEDS: &str = include_str!("request_fuzz_seeds.txt");

fn seeds() -> Vec<u64> {
    if let Some(seed) = std::env::var("AGENTVM_FUZZ_SEED")
        .ok()
        .filter(|s| !s.is_empty())
    {
        return vec![
            seed.trim()
                .parse()
                .expect("AGENTVM_FUZZ_SEED is an unsigned integer"),
        ];
    }
    let mut seeds: Vec<u64> = FIXED_SEEDS
        .lines()
        .map(|l| l.split('#').next().unwrap_or("").trim())
        .filter(|l| !l.is_empty())
        .map(|l| l.parse().expect("request_fuzz_seeds.txt holds integers"))
        .collect();
    if std::env::var_os("CI").is_none() {
        seeds.push(rand::random());
    }
    seeds
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_requests_get_a_proper_answer_and_the_node_keeps_serving() {
    let cases: usize = std::env::var("AGENTVM_FUZZ_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(400);
    for seed in seeds() {
        println!("request fuzz: AGENTVM_FUZZ_SEED={seed} AGENTVM_FUZZ_CASES={cases}");
        fuzz_one_node(seed, cases).await;
    }
}

/// One run: a fresh node, `cases` random requests drawn from `seed`.
async fn fuzz_one_node(seed: u64, cases: usize) {
    let node: TestNode = start().await;
    let mut g = Gen {
        rng: StdRng::seed_from_u64(seed),
        uids: Vec::new(),
    };
    for harness in ["echo", "chat"] {
        let session = node
            .c()
            .create_session(CreateSessionRequest {
                session: Some(Session {
                    harness: harness.into(),
                    ..Default::default()
                }),
            })
            .await
            .unwrap()
            .into_inner();
        g.uids.push(session.metadata.unwrap_or_default().uid);
    }
    let known = g.uids[0].clone();

    let mut c = node.c();
    for _ in 0..cases {
        match g.rng.random_range(0..11) {
            0 => {
                check(
                    "CreateSession",
                    c.create_session(g.request::<CreateSessionRequest>("CreateSessionRequest")),
                )
                .await
            }
            1 => {
                check(
                    "GetSession",
                    c.get_session(g.request::<GetSessionRequest>("GetSessionRequest")),
                )
                .await
            }
            2 => {
                check(
                    "ListSessions",
                    c.list_sessions(g.request::<ListSessionsRequest>("ListSessionsRequest")),
                )
                .await
            }
            3 => {
                check(
                    "DeleteSession",
                    c.delete_session(g.request::<DeleteSessionRequest>("DeleteSessionRequest")),
                )
                .await
            }
            4 => {
                check(
                    "Exec",
                    drain(c.exec(g.request::<ExecRequest>("ExecRequest")).await),
                )
                .await
            }
            5 => {
                check(
                    "Replay",
                    drain(c.replay(g.request::<ReplayRequest>("ReplayRequest")).await),
                )
                .await
            }
            6 => {
                check(
                    "Approve",
                    c.approve(g.request::<ApproveRequest>("ApproveRequest")),
                )
                .await
            }
            7 => {
                check(
                    "Cancel",
                    c.cancel(g.request::<CancelRequest>("CancelRequest")),
                )
                .await
            }
            8 => {
                check(
                    "Suspend",
                    c.suspend(g.request::<SuspendRequest>("SuspendRequest")),
                )
                .await
            }
            9 => {
                check(
                    "Resume",
                    c.resume(g.request::<ResumeRequest>("ResumeRequest")),
                )
                .await
            }
            _ => check("Fork", c.fork(g.request::<ForkRequest>("ForkRequest"))).await,
        }
    }
    // Still serving, and a session a random request may have touched still answers (or was
    // deleted by one, which is a proper answer too).
    match c.get_session(GetSessionRequest { uid: known }).await {
        Ok(_) => {}
        Err(status) => assert_eq!(status.code(), Code::NotFound, "{status:?}"),
    }
    c.list_sessions(ListSessionsRequest::default())
        .await
        .unwrap();
}
