use agentvm_proto::v1::{RemotePlacement, SubstratePlacement};

use super::*;

fn registry(dir: &tempfile::TempDir) -> Registry {
    let store = RegistryStore::open(&dir.path().join("journal.db")).unwrap();
    Registry::new(
        builtin_harnesses(|_, _| Some("no runtime in this test".into())),
        store,
    )
}

fn remote(address: &str) -> HarnessSpec {
    HarnessSpec {
        placement: Some(Placement::Remote(RemotePlacement {
            address: address.into(),
        })),
        capabilities: Some(Capabilities {
            resumability: Resumability::StatelessReplay as i32,
            ..Default::default()
        }),
        descriptor_id: "echo".into(),
    }
}

#[test]
fn register_is_created_then_unchanged_then_conflicting() {
    let dir = tempfile::tempdir().unwrap();
    let r = registry(&dir);
    let (reg, outcome) = r
        .register("my-echo", Some(remote("127.0.0.1:9000")))
        .unwrap();
    assert_eq!(outcome, RegisterOutcome::Created);
    assert_eq!(
        reg.spec_digest,
        "sha256:f0c96c8b67d5dc75be557f64ccd59496eaf9cfb102754ee54e9d4c571eb2eafc"
    );
    assert_eq!(reg.source(), HarnessSource::Registered);
    let uid = reg.metadata.unwrap().uid;
    assert!(uid.starts_with("harness-") && uid.len() == 8 + 24, "{uid}");
    let (again, outcome) = r
        .register("my-echo", Some(remote("127.0.0.1:9000")))
        .unwrap();
    assert_eq!(outcome, RegisterOutcome::Unchanged);
    assert_eq!(again.metadata.unwrap().uid, uid);
    let err = r
        .register("my-echo", Some(remote("127.0.0.1:9001")))
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::AlreadyExists);
}

#[test]
fn retire_is_idempotent_and_register_reactivates() {
    let dir = tempfile::tempdir().unwrap();
    let r = registry(&dir);
    r.register("h1", Some(remote("unix:///run/h.sock")))
        .unwrap();
    let retired = r.retire("h1", "first").unwrap();
    assert_eq!(retired.state(), HarnessState::Retired);
    let first_time = retired.retire_time;
    let again = r.retire("h1", "second").unwrap();
    assert_eq!(again.retire_reason, "first");
    assert_eq!(again.retire_time, first_time);
    assert!(
        r.list("", 50, false)
            .unwrap()
            .iter()
            .all(|e| entry_name(e) != "h1")
    );
    assert!(
        r.list("", 50, true)
            .unwrap()
            .iter()
            .any(|e| entry_name(e) == "h1")
    );
    let (back, outcome) = r
        .register("h1", Some(remote("unix:///run/h.sock")))
        .unwrap();
    assert_eq!(outcome, RegisterOutcome::Reactivated);
    assert_eq!(back.state(), HarnessState::Active);
    assert!(back.retire_time.is_none() && back.retire_reason.is_empty());
    assert_eq!(
        r.retire("nope", "").unwrap_err().code(),
        tonic::Code::NotFound
    );
    assert_eq!(
        r.retire("echo", "").unwrap_err().code(),
        tonic::Code::FailedPrecondition
    );
}

#[test]
fn bad_registrations_name_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let r = registry(&dir);
    let long = "a".repeat(64);
    let cases: Vec<(&str, Option<HarnessSpec>, &str)> = vec![
        ("Bad_Name", Some(remote("127.0.0.1:1")), "name"),
        ("-x", Some(remote("127.0.0.1:1")), "name"),
        (&long, Some(remote("127.0.0.1:1")), "name"),
        ("ok", None, "spec"),
        (
            "ok",
            Some(HarnessSpec {
                placement: None,
                ..remote("x:1")
            }),
            "spec.placement",
        ),
        (
            "ok",
            Some(HarnessSpec {
                capabilities: None,
                ..remote("127.0.0.1:1")
            }),
            "spec.capabilities.resumability",
        ),
        ("ok", Some(remote("")), "spec.remote.address"),
    ];
    for (name, spec, field) in cases {
        let err = r.register(name, spec).unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{name}: {err}");
        assert!(err.to_string().starts_with(field), "{err}");
    }
    // Forms this host cannot dial are its failed precondition, as upstream's placer factory
    // reports them, and nothing is stored.
    for (address, says) in [
        ("http://127.0.0.1:8080", "unsupported scheme \"http\""),
        ("dns:///harness:443", "unsupported scheme \"dns\""),
        ("no-port", "neither unix://PATH nor HOST:PORT"),
        ("unix://", "empty socket path"),
    ] {
        let err = r.register("ok", Some(remote(address))).unwrap_err();
        assert_eq!(
            err.code(),
            tonic::Code::FailedPrecondition,
            "{address}: {err}"
        );
        assert!(err.to_string().contains(says), "{address}: {err}");
        assert!(err.to_string().contains(address), "{err}");
    }
    let err = r.register("echo", Some(remote("127.0.0.1:1"))).unwrap_err();
    assert_eq!(err.code(), tonic::Code::AlreadyExists);
    let substrate = HarnessSpec {
        placement: Some(Placement::Substrate(SubstratePlacement::default())),
        ..remote("x:1")
    };
    let err = r.register("sub", Some(substrate)).unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition);
    assert!(
        r.list("", 500, true)
            .unwrap()
            .iter()
            .all(|e| matches!(e, Entry::Static(_)))
    );
}

#[test]
fn list_merges_static_and_registered_in_name_order_and_pages() {
    let dir = tempfile::tempdir().unwrap();
    let r = registry(&dir);
    for name in ["alpha", "delta", "zeta"] {
        r.register(name, Some(remote("127.0.0.1:9"))).unwrap();
    }
    r.retire("delta", "").unwrap();
    let names = |v: Vec<Entry<'_>>| {
        v.iter()
            .map(|e| entry_name(e).to_owned())
            .collect::<Vec<_>>()
    };
    assert_eq!(
        names(r.list("", 50, false).unwrap()),
        vec![
            "alpha",
            "chat",
            "counter",
            "echo",
            "testguest",
            "testguest-echo",
            "zeta"
        ]
    );
    assert_eq!(names(r.list("", 2, true).unwrap()), vec!["alpha", "chat"]);
    assert_eq!(
        names(r.list("counter", 3, true).unwrap()),
        vec!["delta", "echo", "testguest"]
    );
}

#[test]
fn registrations_survive_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let digest = registry(&dir)
        .register("keep", Some(remote("127.0.0.1:9")))
        .unwrap()
        .0
        .spec_digest;
    match registry(&dir).get("keep").unwrap() {
        Entry::Registered(h) => {
            assert_eq!(h.spec_digest, digest);
            assert_eq!(h.spec, Some(remote("127.0.0.1:9")));
        }
        Entry::Static(_) => panic!("expected a registered entry"),
    }
}
