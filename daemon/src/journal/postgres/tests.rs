use std::sync::Arc;

use super::*;
use crate::journal::suite::{self, Opener, journal_cases};
use crate::testing::TestPostgres;

fn server() -> Option<TestPostgres> {
    match TestPostgres::start() {
        Ok(server) => Some(server),
        Err(why) => {
            println!("SKIPPED: no PostgreSQL server to test against: {why}");
            None
        }
    }
}

macro_rules! every_case {
    ($($case:ident),* $(,)?) => {
        [$((stringify!($case), suite::$case as fn(&Opener))),*]
    };
}

/// The journal suite against a real server, each case on a fresh database.
#[test]
fn a_postgres_journal_passes_the_journal_suite() {
    let Some(server) = server() else { return };
    for (n, (name, case)) in journal_cases!(every_case).into_iter().enumerate() {
        let db = format!("suite_{n}");
        server.create_database(&db).unwrap();
        let url = server.url(&db);
        let open = move || -> Arc<dyn Journal> {
            Arc::new(PostgresJournal::connect(&url, "node-a").unwrap())
        };
        println!("case {name}");
        case(&open);
    }
}

fn connect(server: &TestPostgres, db: &str, node: &str) -> PostgresJournal {
    PostgresJournal::connect(&server.url(db), node).unwrap()
}

/// Upstream's verifier reads either database: the same appends give the same records,
/// hashes included, on both backends.
#[test]
fn both_backends_store_the_same_records_byte_for_byte() {
    use crate::journal::sqlite::{Durability, SqliteJournal};
    use crate::journal::suite::{input, lifecycle_event, session};
    use agentvm_proto::v1::lifecycle;
    let Some(server) = server() else { return };
    server.create_database("same").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let sqlite = SqliteJournal::open(&dir.path().join("j.db"), Durability::Full).unwrap();
    let postgres = connect(&server, "same", "node-a");
    let backends: [&dyn Journal; 2] = [&sqlite, &postgres];
    for j in backends {
        j.create_session(&session("s", "p", 1)).unwrap();
        j.append("s", 0, 1, &[input("a"), input("b")]).unwrap();
        j.append(
            "s",
            2,
            1,
            &[lifecycle_event(lifecycle::Kind::LifecycleSuspend)],
        )
        .unwrap();
    }
    let (a, b) = (
        sqlite.read("s", 0, 0).unwrap(),
        postgres.read("s", 0, 0).unwrap(),
    );
    assert_eq!(a.len(), 3);
    assert_eq!(a, b);
    let (ra, rb) = (
        sqlite.get_session("s").unwrap().unwrap(),
        postgres.get_session("s").unwrap().unwrap(),
    );
    assert_eq!(
        (ra.last_seq, ra.compute_state),
        (rb.last_seq, rb.compute_state)
    );
}

/// Two nodes append to one session at once through their own connections: every append
/// that returned is in the log exactly once and the chain has no gap or fork.
#[test]
fn two_nodes_appending_to_one_session_serialize_on_its_head() {
    use crate::journal::suite::{race_appends, session};
    use crate::journal::verify::verify_chain;
    let Some(server) = server() else { return };
    server.create_database("race").unwrap();
    let (a, b): (Arc<dyn Journal>, Arc<dyn Journal>) = (
        Arc::new(connect(&server, "race", "node-a")),
        Arc::new(connect(&server, "race", "node-b")),
    );
    a.create_session(&session("s", "p", 1)).unwrap();
    race_appends(vec![a.clone(), a, b.clone(), b.clone()], 10);
    let all = b.read("s", 0, 0).unwrap();
    assert_eq!(verify_chain(&all), Ok(40));
}

/// A node sees only the intents it began: another node's unfinished Fork is not its to
/// recover.
#[test]
fn intents_belong_to_the_node_that_began_them() {
    let Some(server) = server() else { return };
    server.create_database("intents").unwrap();
    let a = connect(&server, "intents", "node-a");
    let b = connect(&server, "intents", "node-b");
    let op = |session: &str| Operation {
        kind: OperationKind::Suspend,
        session: session.into(),
        children: vec![],
    };
    let ia = a.begin_operation(&op("on-a")).unwrap();
    let ib = b.begin_operation(&op("on-b")).unwrap();
    assert_eq!(a.open_operations().unwrap(), [(ia, op("on-a"))]);
    assert_eq!(b.open_operations().unwrap(), [(ib, op("on-b"))]);
}

/// Records acknowledged before the server crashed are there after it restarts, and the
/// journal goes on appending once it is back.
#[test]
fn a_server_crash_loses_no_acknowledged_record() {
    use crate::journal::suite::{input, session};
    use crate::journal::verify::verify_chain;
    let Some(server) = server() else { return };
    server.create_database("crash").unwrap();
    let j = connect(&server, "crash", "node-a");
    j.create_session(&session("s", "p", 1)).unwrap();
    for n in 0..20 {
        j.append("s", n, 0, &[input(&format!("r{n}"))]).unwrap();
    }
    server.restart_after_crash().unwrap();
    // The pool's connections died with the server: they are replaced, not handed out.
    assert_eq!(verify_chain(&j.read("s", 0, 0).unwrap()), Ok(20));
    assert_eq!(j.append("s", 20, 0, &[input("after")]).unwrap()[0].seq, 21);
}

#[test]
fn a_database_stamped_newer_is_refused() {
    let Some(server) = server() else { return };
    server.create_database("newer").unwrap();
    drop(connect(&server, "newer", "node-a"));
    let url = server.url("newer");
    let bridge = bridge::Bridge::new().unwrap();
    bridge
        .run(async move {
            let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
                .await
                .map_err(pg("connect"))?;
            tokio::spawn(connection);
            client
                .execute("UPDATE agentvm_schema SET version = 99", &[])
                .await
                .map_err(pg("restamp"))?;
            Ok(())
        })
        .unwrap();
    match PostgresJournal::connect(&server.url("newer"), "node-a") {
        Err(JournalError::SchemaTooNew {
            found: 99,
            supported,
        }) => {
            assert_eq!(supported, SCHEMA_VERSION)
        }
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("a newer schema was accepted"),
    }
}

/// Nodes starting together all migrate the schema without tripping over each other.
#[test]
fn nodes_starting_at_once_migrate_once() {
    let Some(server) = server() else { return };
    server.create_database("together").unwrap();
    let url = server.url("together");
    let threads: Vec<_> = (0..4)
        .map(|n| {
            let url = url.clone();
            std::thread::spawn(move || {
                PostgresJournal::connect(&url, &format!("node-{n}")).map(drop)
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap().unwrap();
    }
}

/// A node's sweeps see the sessions it holds: created there, or fenced there last. A node
/// that takes a session over holds it from then on, and the old holder's appends under its
/// old fence are refused.
#[test]
fn a_session_is_held_by_the_node_that_last_fenced_it() {
    use crate::journal::suite::{input, session};
    let Some(server) = server() else { return };
    server.create_database("holders").unwrap();
    let a = connect(&server, "holders", "node-a");
    let b = connect(&server, "holders", "node-b");
    a.create_session(&session("s1", "p", 1)).unwrap();
    b.create_session(&session("s2", "p", 2)).unwrap();
    let fa = a.new_fence("s1").unwrap();
    a.append("s1", 0, fa, &[input("a")]).unwrap();
    b.append("s2", 0, 0, &[input("b")]).unwrap();
    let live = |j: &PostgresJournal| j.sessions_in_state(ComputeState::ComputeLive).unwrap();
    assert_eq!(live(&a), ["s1"]);
    assert_eq!(live(&b), ["s2"]);
    assert_eq!(
        a.count_by_compute_state().unwrap(),
        [(ComputeState::ComputeLive, 1)]
    );
    let fb = b.new_fence("s1").unwrap();
    assert!(fb > fa);
    assert!(live(&a).is_empty());
    assert_eq!(live(&b), ["s1", "s2"]);
    assert!(matches!(
        a.append("s1", 1, fa, &[input("stale")]),
        Err(JournalError::Fenced { .. })
    ));
    b.append("s1", 1, fb, &[input("b-now")]).unwrap();
}

/// A node's heartbeat keeps what it holds its own: another node is told where to go while
/// it beats, and may take the session over once its heartbeats stop for a lease.
#[test]
fn a_holder_is_alive_while_it_beats_and_gone_after_a_lease() {
    use crate::journal::Holder;
    use crate::journal::suite::session;
    let Some(server) = server() else { return };
    server.create_database("leases").unwrap();
    let lease = std::time::Duration::from_millis(600);
    let a = connect(&server, "leases", "node-a").with_lease(lease);
    let b = connect(&server, "leases", "node-b").with_lease(lease);
    a.create_session(&session("s", "p", 1)).unwrap();
    let row = b.get_session("s").unwrap().unwrap();
    assert_eq!(row.holder, "node-a");
    // Never beat: nobody vouches for node-a.
    assert_eq!(b.holder_of(&row).unwrap(), Holder::Gone("node-a".into()));
    a.heartbeat("unix:/run/a.sock", "{\"sessions\":1}").unwrap();
    match b.holder_of(&row).unwrap() {
        Holder::Alive(node) => {
            assert_eq!(node.name, "node-a");
            assert_eq!(node.address, "unix:/run/a.sock");
            assert!(node.alive);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(a.holder_of(&row).unwrap(), Holder::Here);
    let nodes = b.nodes().unwrap();
    assert_eq!(nodes.len(), 1);
    assert_eq!(nodes[0].status, "{\"sessions\":1}");
    std::thread::sleep(lease + std::time::Duration::from_millis(200));
    assert_eq!(b.holder_of(&row).unwrap(), Holder::Gone("node-a".into()));
    assert!(!b.nodes().unwrap()[0].alive);
    // Taking it over: node-b's fence makes it the holder.
    b.new_fence("s").unwrap();
    let row = a.get_session("s").unwrap().unwrap();
    assert_eq!(b.holder_of(&row).unwrap(), Holder::Here);
    a.heartbeat("unix:/run/a.sock", "{}").unwrap();
    b.heartbeat("unix:/run/b.sock", "{}").unwrap();
    match a.holder_of(&row).unwrap() {
        Holder::Alive(node) => assert_eq!(node.name, "node-b"),
        other => panic!("{other:?}"),
    }
}

/// Nodes racing to take one session: each fence goes to a node that may take it, so while
/// the winner beats, the others are told who holds it.
#[test]
fn of_nodes_racing_for_a_session_one_holds_it() {
    use crate::journal::suite::session;
    let Some(server) = server() else { return };
    server.create_database("race_fence").unwrap();
    let nodes: Vec<Arc<PostgresJournal>> = (0..4)
        .map(|n| Arc::new(connect(&server, "race_fence", &format!("node-{n}"))))
        .collect();
    for j in &nodes {
        j.heartbeat("unix:/nowhere", "{}").unwrap();
    }
    nodes[0].create_session(&session("s", "p", 1)).unwrap();
    nodes[0].release_held().unwrap();
    let threads: Vec<_> = nodes
        .iter()
        .cloned()
        .map(|j| std::thread::spawn(move || j.new_fence("s")))
        .collect();
    let results: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let won: Vec<_> = results.iter().filter(|r| r.is_ok()).collect();
    assert_eq!(won.len(), 1, "{results:?}");
    for lost in results.iter().filter_map(|r| r.as_ref().err()) {
        assert!(matches!(lost, JournalError::HeldElsewhere { .. }), "{lost}");
    }
}

/// A harness registered through one node serves every node of the fleet: its registration
/// lives in the shared journal, and so does its retirement.
#[test]
fn a_harness_registered_on_one_node_is_known_to_every_node() {
    use crate::registry::store::RegistryStore;
    use crate::registry::{Entry, Registry, builtin_harnesses};
    use agentvm_proto::v1::{
        Capabilities, HarnessSpec, HarnessState, RegisterOutcome, RemotePlacement, Resumability,
        harness_spec::Placement,
    };
    let Some(server) = server() else { return };
    server.create_database("registry").unwrap();
    let registry = |node: &str| {
        Registry::new(
            builtin_harnesses(|_, _| None),
            RegistryStore::shared(Arc::new(connect(&server, "registry", node))),
        )
    };
    let (a, b) = (registry("node-a"), registry("node-b"));
    let spec = |address: &str| HarnessSpec {
        placement: Some(Placement::Remote(RemotePlacement {
            address: address.into(),
        })),
        capabilities: Some(Capabilities {
            resumability: Resumability::StatelessReplay as i32,
            ..Default::default()
        }),
        descriptor_id: "echo".into(),
    };
    let (made, outcome) = a
        .register("shared-echo", Some(spec("unix:///run/e.sock")))
        .unwrap();
    assert_eq!(outcome, RegisterOutcome::Created);
    match b.get("shared-echo").unwrap() {
        Entry::Registered(h) => {
            assert_eq!(h.uid, made.metadata.as_ref().unwrap().uid);
            assert_eq!(h.spec, Some(spec("unix:///run/e.sock")));
        }
        Entry::Static(_) => panic!("a registration read back as a built-in"),
    }
    // The name is taken fleet-wide: another spec under it is refused on the other node.
    let err = b
        .register("shared-echo", Some(spec("unix:///run/other.sock")))
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::AlreadyExists);
    b.retire("shared-echo", "moved").unwrap();
    match a.get("shared-echo").unwrap() {
        Entry::Registered(h) => assert_eq!(h.state, HarnessState::Retired),
        Entry::Static(_) => panic!("a registration read back as a built-in"),
    }
}

/// With the database gone, calls fail with the cause rather than hang, and work again once
/// it is back.
#[test]
fn an_unreachable_database_fails_calls_and_they_work_again_when_it_is_back() {
    use crate::journal::suite::session;
    let Some(server) = server() else { return };
    server.create_database("gone").unwrap();
    let j = connect(&server, "gone", "node-a");
    j.create_session(&session("s", "p", 1)).unwrap();
    server.crash().unwrap();
    match j.get_session("s") {
        Err(JournalError::Postgres { .. } | JournalError::Unavailable { .. }) => {}
        other => panic!("{other:?}"),
    }
    server.start_again().unwrap();
    assert!(j.get_session("s").unwrap().is_some());
}
