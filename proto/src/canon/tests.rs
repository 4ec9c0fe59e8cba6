//! Every hash vector of shared/spec/wire.md §3 and semantics.md §1.3. The golden vectors A–D
//! are semantics.md scenario 6: a non-Go implementation reproduces every upstream content hash.

use super::*;
use crate::v1::{
    ApprovalResult, EventKind, ExecutionStart, HarnessEnd, IdentityRef, Message, ModelCall, Part,
    TextPart, ToolResult, event::Body, lifecycle, part, tool_result,
};

fn text_message(role: &str, text: &str) -> Message {
    Message {
        role: role.into(),
        parts: vec![Part {
            part: Some(part::Part::Text(TextPart { text: text.into() })),
        }],
    }
}

fn event(execution_id: &str, kind: EventKind, body: Body) -> Event {
    Event {
        execution_id: execution_id.into(),
        kind: kind as i32,
        body: Some(body),
        ..Default::default()
    }
}

fn model_call(id: &str, input_hash: &str) -> Body {
    Body::Model(ModelCall {
        model: "echo".into(),
        id: id.into(),
        input_hash: input_hash.into(),
        ..Default::default()
    })
}

fn completed() -> Body {
    Body::End(HarnessEnd {
        state: "COMPLETED".into(),
        error: None,
    })
}

#[test]
fn scenario_06_vector_a_golden_output_with_ts_and_actor() {
    let ev = Event {
        execution_id: "exec-1".into(),
        schema_version: 1,
        ts: Some(prost_types::Timestamp {
            seconds: 1_700_000_000,
            nanos: 0,
        }),
        kind: EventKind::EventOutput as i32,
        body: Some(Body::Message(text_message("assistant", "hello"))),
        actor: Some(IdentityRef {
            principal: "agent://a".into(),
            issuer: "entra".into(),
            subject: "sub-1".into(),
        }),
    };
    let pre = record_preimage(1, "", &ev).unwrap();
    assert_eq!(
        String::from_utf8(pre).unwrap(),
        r#"{"event":{"actor":{"issuer":"entra","principal":"agent://a","subject":"sub-1"},"execution_id":"exec-1","kind":"EVENT_OUTPUT","message":{"parts":[{"text":{"text":"hello"}}],"role":"assistant"},"schema_version":1,"ts":"2023-11-14T22:13:20Z"},"prev_hash":"","seq":"1"}"#
    );
    assert_eq!(
        content_hash(1, "", &ev).unwrap(),
        "551bd146050c8d630b0c3b999a4445f3792a470db9bca443d8d4a67706283fcc"
    );
}

fn assert_chain(start_seq: i64, mut prev: String, events: &[Event], hashes: &[&str]) {
    for (i, (ev, want)) in events.iter().zip(hashes).enumerate() {
        let seq = start_seq + i as i64;
        let got = content_hash(seq, &prev, ev).unwrap();
        assert_eq!(&got, want, "seq {seq}");
        prev = got;
    }
}

#[test]
fn scenario_06_vector_b_legacy_v0_1_2_journal() {
    let events = [
        event(
            "",
            EventKind::EventInput,
            Body::Message(text_message("user", "hello")),
        ),
        event(
            "",
            EventKind::EventModelCall,
            model_call(
                "49072a2a845249ea",
                "2611c24a1a665deca46265ed96d1e1efc699260c9cba9c07f22cda7939232c30",
            ),
        ),
        event(
            "",
            EventKind::EventOutput,
            Body::Message(text_message("assistant", "echo:hello")),
        ),
        event("", EventKind::EventEnd, completed()),
    ];
    assert_eq!(
        String::from_utf8(record_preimage(1, "", &events[0]).unwrap()).unwrap(),
        r#"{"event":{"kind":"EVENT_INPUT","message":{"parts":[{"text":{"text":"hello"}}],"role":"user"}},"prev_hash":"","seq":"1"}"#
    );
    assert_chain(
        1,
        String::new(),
        &events,
        &[
            "62daf59c5c1e5062b1b0d47d5665b34aa52bf7ed0ca8a0b016af2c9827b5d8f6",
            "699f567f01dcee2cd3bcf8a6dd4eb4c14400a4b85f5cfd0d285dbb99687dd868",
            "ac9431332cbf3d0d3c6bd24dc7c3d41be4226e5494d24eeaa603cb7a2c895ce7",
            "1b0f72670340a5c139b39a2922bca9fa202e191a4d610f2211f53a501f3ab5fa",
        ],
    );
}

#[test]
fn scenario_06_vector_c_current_writer_turn_with_execution_start() {
    let x = "721cca6eababd5be";
    let events = [
        event(
            x,
            EventKind::EventExecutionStart,
            Body::ExecutionStart(ExecutionStart {
                input_count: Some(1),
                ..Default::default()
            }),
        ),
        event(
            x,
            EventKind::EventInput,
            Body::Message(text_message("user", "new")),
        ),
        event(
            x,
            EventKind::EventModelCall,
            model_call(
                "4c42ee2f6d3d2939",
                "403e89a947b27e8d1ce3838a7481b8fc33e51c0e03489bdb745ceab8b02f260d",
            ),
        ),
        event(
            x,
            EventKind::EventOutput,
            Body::Message(text_message("assistant", "echo:new")),
        ),
        event(x, EventKind::EventEnd, completed()),
    ];
    assert_eq!(
        String::from_utf8(canonical_event(&events[0]).unwrap()).unwrap(),
        r#"{"execution_id":"721cca6eababd5be","execution_start":{"input_count":"1"},"kind":"EVENT_EXECUTION_START"}"#
    );
    assert_chain(
        5,
        "f926dbb0a94376a5c8bd1bd9adb73013b1a56411f56df175946cad6b178a4874".into(),
        &events,
        &[
            "40f6b0ad1e0b3db9f22ea475fdc74f38b2fef8e10a4b1996a0c204b98ab59c31",
            "a0af70c858cc1073e7e804871524971bca9ab745f04e6582b96919b035b48647",
            "1b12ec8b986c77224cd2979d87ee4cdb385621fb5af27108924705a98033da38",
            "0f3a449f84537906169b8657749baa1952607a6b8280cf83459e0804421c19b0",
            "efdfe2a4c0450ca5d8f24eb0ad7a5f5f499df09e73b786e9de745c7109aff193",
        ],
    );
}

#[test]
fn scenario_06_vector_d_approval_era_records() {
    let receipt = event(
        "",
        EventKind::EventToolResult,
        Body::Result(ToolResult {
            id: "c1".into(),
            ..Default::default()
        }),
    );
    assert_eq!(
        content_hash(1, "", &receipt).unwrap(),
        "2eddf9826b382796691c15da8ee7dd6af7b41dbab55c949f131ed2933e0b0d8e"
    );
    let decision = event(
        "",
        EventKind::EventApprovalResult,
        Body::ApprovalResult(ApprovalResult {
            tool_call_id: "c1".into(),
            reason: "no".into(),
            ..Default::default()
        }),
    );
    assert_eq!(
        content_hash(1, "", &decision).unwrap(),
        "c36a909b1ea5f243536ff6b4f1770e99e47b35cb1dfb94c2e943b85a42206bea"
    );

    let denied = event(
        "e1",
        EventKind::EventToolResult,
        Body::Result(ToolResult {
            id: "c1".into(),
            is_error: true,
            code: tool_result::Code::ApprovalDenied as i32,
            approval_request_seq: 9_007_199_254_740_993,
            approval_decision_seq: 9_007_199_254_740_994,
            ..Default::default()
        }),
    );
    assert_eq!(
        String::from_utf8(canonical_event(&denied).unwrap()).unwrap(),
        r#"{"execution_id":"e1","kind":"EVENT_TOOL_RESULT","result":{"approval_decision_seq":"9007199254740994","approval_request_seq":"9007199254740993","code":"APPROVAL_DENIED","id":"c1","is_error":true}}"#
    );
    let mut decided = event(
        "e1",
        EventKind::EventApprovalResult,
        Body::ApprovalResult(ApprovalResult {
            tool_call_id: "c1".into(),
            reason: "no".into(),
            request_seq: 9_007_199_254_740_993,
            approved: false,
        }),
    );
    decided.actor = Some(IdentityRef {
        principal: "human".into(),
        ..Default::default()
    });
    assert_eq!(
        String::from_utf8(canonical_event(&decided).unwrap()).unwrap(),
        r#"{"actor":{"principal":"human"},"approval_result":{"reason":"no","request_seq":"9007199254740993","tool_call_id":"c1"},"execution_id":"e1","kind":"EVENT_APPROVAL_RESULT"}"#
    );
}

fn execution_start(id: &str, start: ExecutionStart) -> Event {
    event(
        id,
        EventKind::EventExecutionStart,
        Body::ExecutionStart(start),
    )
}

#[test]
fn semantics_vectors_execution_start_beyond_2_pow_53() {
    let with_config = execution_start(
        "exec-config",
        ExecutionStart {
            config: vec![0x00, 0xff, 0x20, 0x0a, 0x09],
            input_count: Some(2),
            resume_from_seq: 9_007_199_254_740_993,
            ..Default::default()
        },
    );
    let json = String::from_utf8(canonical_event(&with_config).unwrap()).unwrap();
    assert!(json.contains(r#""config":"AP8gCgk=""#), "{json}");
    assert!(
        json.contains(r#""resume_from_seq":"9007199254740993""#),
        "{json}"
    );
    assert_eq!(
        content_hash(1, "", &with_config).unwrap(),
        "aa1f42a26b7a227836d32d31608ebb69c59f3b1c57eadd8537b6faf88a01c790"
    );
    let default_zero = execution_start(
        "exec-default",
        ExecutionStart {
            input_count: Some(0),
            ..Default::default()
        },
    );
    assert_eq!(
        content_hash(1, "", &default_zero).unwrap(),
        "b09cbff45d5a30990c3b72be8b06af6bc509d5a29a849aab5fd42153ef10ec65"
    );
    let default_two = execution_start(
        "exec-default",
        ExecutionStart {
            input_count: Some(2),
            ..Default::default()
        },
    );
    assert_eq!(
        content_hash(1, "", &default_two).unwrap(),
        "f06c25ee5b3673ee23b8f91883c7f1c6c5682d94986caf5bc067908a61b2ac4f"
    );
}

#[test]
fn canon_proto_session_vector() {
    use crate::v1::{Origin, ResourceMetadata, Session};
    let s = Session {
        metadata: Some(ResourceMetadata {
            project: "tenant".into(),
            name: "name".into(),
            uid: "s1".into(),
            version: 7,
            ..Default::default()
        }),
        harness: "echo".into(),
        model: "m".into(),
        last_seq: 99,
        identity: Some(IdentityRef {
            principal: "p".into(),
            issuer: "i".into(),
            subject: "s".into(),
        }),
        origin: Some(Origin {
            source: "source".into(),
            subject: "subject".into(),
            uri: "uri".into(),
            attributes: [("context".to_owned(), "value".to_owned())].into(),
        }),
        labels: [("label".to_owned(), "value".to_owned())].into(),
        annotations: [("note".to_owned(), "value".to_owned())].into(),
        ..Default::default()
    };
    assert_eq!(
        String::from_utf8(canonical_proto(&s).unwrap()).unwrap(),
        r#"{"annotations":{"note":"value"},"harness":"echo","identity":{"issuer":"i","principal":"p","subject":"s"},"labels":{"label":"value"},"last_seq":"99","metadata":{"name":"name","project":"tenant","uid":"s1","version":"7"},"model":"m","origin":{"attributes":{"context":"value"},"source":"source","subject":"subject","uri":"uri"}}"#
    );
}

#[test]
fn spec_digest_vector() {
    use crate::v1::{Capabilities, RemotePlacement, Resumability, harness_spec::Placement};
    let spec = HarnessSpec {
        placement: Some(Placement::Remote(RemotePlacement {
            address: "127.0.0.1:9000".into(),
        })),
        capabilities: Some(Capabilities {
            resumability: Resumability::StatelessReplay as i32,
            ..Default::default()
        }),
        descriptor_id: "echo".into(),
    };
    assert_eq!(
        String::from_utf8(canonical_proto(&spec).unwrap()).unwrap(),
        r#"{"capabilities":{"resumability":"RESUMABILITY_STATELESS_REPLAY"},"descriptor_id":"echo","remote":{"address":"127.0.0.1:9000"}}"#
    );
    assert_eq!(
        spec_digest(&spec).unwrap(),
        "sha256:f0c96c8b67d5dc75be557f64ccd59496eaf9cfb102754ee54e9d4c571eb2eafc"
    );
}

#[test]
fn explicit_presence_members_are_emitted_at_their_defaults() {
    // A set-but-empty oneof member gives `{}`; an unset optional is absent.
    let ev = event(
        "",
        EventKind::EventLifecycle,
        Body::Lifecycle(crate::v1::Lifecycle {
            kind: lifecycle::Kind::LifecycleUnspecified as i32,
            ..Default::default()
        }),
    );
    assert_eq!(
        String::from_utf8(canonical_event(&ev).unwrap()).unwrap(),
        r#"{"kind":"EVENT_LIFECYCLE","lifecycle":{}}"#
    );
    let empty_part = Event {
        body: Some(Body::Message(Message {
            role: "user".into(),
            parts: vec![Part { part: None }],
        })),
        ..Default::default()
    };
    assert_eq!(
        String::from_utf8(canonical_event(&empty_part).unwrap()).unwrap(),
        r#"{"message":{"parts":[{}],"role":"user"}}"#
    );
}

#[test]
fn unknown_enum_values_are_emitted_as_numbers() {
    let ev = Event {
        kind: 99,
        ..Default::default()
    };
    assert_eq!(
        String::from_utf8(canonical_event(&ev).unwrap()).unwrap(),
        r#"{"kind":99}"#
    );
}

#[test]
fn fractional_timestamps_use_3_6_or_9_digits() {
    for (nanos, want) in [
        (500_000_000, "2023-11-14T22:13:20.500Z"),
        (1_000, "2023-11-14T22:13:20.000001Z"),
        (1, "2023-11-14T22:13:20.000000001Z"),
    ] {
        let ev = Event {
            ts: Some(prost_types::Timestamp {
                seconds: 1_700_000_000,
                nanos,
            }),
            ..Default::default()
        };
        let json = String::from_utf8(canonical_event(&ev).unwrap()).unwrap();
        assert_eq!(json, format!(r#"{{"ts":"{want}"}}"#));
    }
}

#[test]
fn jcs_numbers_follow_ecmascript() {
    for (v, want) in [
        (2.0, "2"),
        (1.5, "1.5"),
        (1e21, "1e+21"),
        (1e-7, "1e-7"),
        (-0.0, "0"),
        (0.000001, "0.000001"),
        (123456789012345680000.0, "123456789012345680000"),
        (-1.25e-10, "-1.25e-10"),
        (9007199254740993.0, "9007199254740992"),
        (0.1, "0.1"),
        (5e-324, "5e-324"),
        (1.7976931348623157e308, "1.7976931348623157e+308"),
    ] {
        assert_eq!(ecmascript_number(v).unwrap(), want, "{v:e}");
    }
    assert!(ecmascript_number(f64::NAN).is_err());
    assert!(ecmascript_number(f64::INFINITY).is_err());
}

#[test]
fn jcs_strings_and_key_order() {
    let v = serde_json::json!({
        "b": "a\"b\\c\u{1}\n/é<>&",
        "a": [1, true, null],
        "\u{10000}": 1,
        "\u{ff61}": 2,
    });
    // U+10000 is D800 DC00 in UTF-16, which sorts before U+FF61 although its UTF-8 is larger.
    assert_eq!(
        String::from_utf8(jcs(&v).unwrap()).unwrap(),
        "{\"a\":[1,true,null],\"b\":\"a\\\"b\\\\c\\u0001\\n/é<>&\",\"\u{10000}\":1,\"\u{ff61}\":2}"
    );
}

#[test]
fn struct_values_hash_as_doubles() {
    use crate::v1::ToolCall;
    use prost_types::{Struct, Value as PValue, value::Kind};
    let args = Struct {
        fields: [
            (
                "n".to_owned(),
                PValue {
                    kind: Some(Kind::NumberValue(2.0)),
                },
            ),
            (
                "f".to_owned(),
                PValue {
                    kind: Some(Kind::NumberValue(1.5)),
                },
            ),
        ]
        .into(),
    };
    let ev = event(
        "",
        EventKind::EventToolCall,
        Body::Tool(ToolCall {
            id: "c".into(),
            args: Some(args),
            ..Default::default()
        }),
    );
    assert_eq!(
        String::from_utf8(canonical_event(&ev).unwrap()).unwrap(),
        r#"{"kind":"EVENT_TOOL_CALL","tool":{"args":{"f":1.5,"n":2},"id":"c"}}"#
    );
}

#[test]
fn from_proto_json_round_trips_and_rejects_bad_input() {
    let ev = execution_start(
        "x",
        ExecutionStart {
            config: vec![1, 2, 3],
            input_count: Some(0),
            resume_from_seq: 9_007_199_254_740_993,
            harness: "echo".into(),
            harness_version: "1".into(),
        },
    );
    let json = to_proto_json(&ev).unwrap();
    let back: Event = from_proto_json(&json).unwrap();
    assert_eq!(back, ev);

    let unknown_field = serde_json::json!({"kind": "EVENT_INPUT", "bogus": 1});
    assert!(from_proto_json::<Event>(&unknown_field).is_err());
    let unknown_enum = serde_json::json!({"kind": "EVENT_NOPE"});
    let err = from_proto_json::<Event>(&unknown_enum)
        .unwrap_err()
        .to_string();
    assert!(err.contains("EVENT_NOPE"), "{err}");
    let wrong_type = serde_json::json!({"schema_version": "one"});
    assert!(from_proto_json::<Event>(&wrong_type).is_err());
}
