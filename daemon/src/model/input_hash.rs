//! `ModelCall.input_hash` (invariant I0): SHA-256 hex of the model request serialized the way
//! the Go reference host serializes its `api.ModelRequest` with `encoding/json`.
//!
//! Upstream calls this encoding host-internal. We reproduce it anyway so that journals written
//! by a Go host replay on ours and the other way round (wire.md §3.8). The rules that matter:
//! keys are Go field names in declaration order; nil pointers, maps and slices are `null`;
//! fields tagged omitempty vanish when empty; map keys are sorted; `[]byte` is base64; strings
//! escape `<`, `>`, `&`, U+2028 and U+2029; floats use Go's shortest formatting.

use agentvm_proto::v1::{
    FilePart, Message, ModelCall, Part, ReasoningPart, ToolCall, ToolChoice, ToolDefinition,
    ToolResult, file_part, part, reasoning_part, tool_choice,
};
use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use prost_types::{Struct, Value, value::Kind};
use sha2::{Digest, Sha256};

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum InputHashError {
    #[error("model request holds a non-finite number ({0}); JSON cannot carry it")]
    NonFinite(f64),
    #[error("tool_choice.mode {0} is not a known mode")]
    UnknownToolChoice(i32),
    #[error("mediation {0} is not a known mediation")]
    UnknownMediation(i32),
}

type Result<T> = std::result::Result<T, InputHashError>;

/// The hash recorded on a MODEL_CALL, over the wire-only request fields as well.
pub fn input_hash(call: &ModelCall) -> Result<String> {
    let mut out = String::with_capacity(256);
    write_request(call, &mut out)?;
    Ok(hex::encode(Sha256::digest(out.as_bytes())))
}

/// The exact bytes hashed; exposed for tests and diagnostics.
pub fn go_json(call: &ModelCall) -> Result<String> {
    let mut out = String::new();
    write_request(call, &mut out)?;
    Ok(out)
}

fn write_request(call: &ModelCall, out: &mut String) -> Result<()> {
    out.push_str("{\"Model\":");
    string(&call.model, out);
    out.push_str(",\"Messages\":");
    slice(&call.messages, out, message)?;
    out.push_str(",\"Params\":");
    if call.params.is_empty() {
        // The Go host passes the harness's map through; an absent one is nil.
        out.push_str("null");
    } else {
        let mut keys: Vec<&String> = call.params.keys().collect();
        keys.sort();
        out.push('{');
        for (i, k) in keys.into_iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            string(k, out);
            out.push(':');
            string(&call.params[k], out);
        }
        out.push('}');
    }
    if !call.tools.is_empty() {
        out.push_str(",\"Tools\":");
        slice(&call.tools, out, tool_definition)?;
    }
    if let Some(choice) = &call.tool_choice {
        out.push_str(",\"ToolChoice\":");
        tool_choice_json(choice, out)?;
    }
    out.push('}');
    Ok(())
}

fn slice<T>(items: &[T], out: &mut String, f: fn(&T, &mut String) -> Result<()>) -> Result<()> {
    if items.is_empty() {
        out.push_str("null");
        return Ok(());
    }
    out.push('[');
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        f(item, out)?;
    }
    out.push(']');
    Ok(())
}

fn message(m: &Message, out: &mut String) -> Result<()> {
    out.push_str("{\"Role\":");
    string(&m.role, out);
    out.push_str(",\"Parts\":");
    slice(&m.parts, out, part_json)?;
    out.push('}');
    Ok(())
}

fn part_json(p: &Part, out: &mut String) -> Result<()> {
    let body = p.part.as_ref();
    out.push_str("{\"Text\":");
    match body {
        Some(part::Part::Text(t)) => {
            out.push_str("{\"Text\":");
            string(&t.text, out);
            out.push('}');
        }
        _ => out.push_str("null"),
    }
    out.push_str(",\"File\":");
    match body {
        Some(part::Part::File(f)) => file(f, out),
        _ => out.push_str("null"),
    }
    out.push_str(",\"Data\":");
    match body {
        Some(part::Part::Data(d)) => optional_struct(d.data.as_ref(), out)?,
        _ => out.push_str("null"),
    }
    out.push_str(",\"Reasoning\":");
    match body {
        Some(part::Part::Reasoning(r)) => reasoning(r, out)?,
        _ => out.push_str("null"),
    }
    match body {
        Some(part::Part::ToolCall(c)) => {
            out.push_str(",\"ToolCall\":");
            tool_call(c, out)?;
        }
        Some(part::Part::ToolResult(r)) => {
            out.push_str(",\"ToolResult\":");
            tool_result(r, out)?;
        }
        _ => {}
    }
    out.push('}');
    Ok(())
}

fn bytes_or_null(b: Option<&Vec<u8>>, out: &mut String) {
    match b {
        Some(b) if !b.is_empty() => {
            out.push('"');
            out.push_str(&STANDARD.encode(b));
            out.push('"');
        }
        _ => out.push_str("null"),
    }
}

fn file(f: &FilePart, out: &mut String) {
    let (bytes, uri) = match &f.source {
        Some(file_part::Source::Bytes(b)) => (Some(b), ""),
        Some(file_part::Source::Uri(u)) => (None, u.as_str()),
        None => (None, ""),
    };
    out.push_str("{\"MIME\":");
    string(&f.mime, out);
    out.push_str(",\"Bytes\":");
    bytes_or_null(bytes, out);
    out.push_str(",\"URI\":");
    string(uri, out);
    out.push_str(",\"Digest\":");
    string(&f.digest, out);
    out.push_str(",\"Name\":");
    string(&f.name, out);
    out.push('}');
}

fn reasoning(r: &ReasoningPart, out: &mut String) -> Result<()> {
    let (opaque, uri) = match &r.opaque {
        Some(reasoning_part::Opaque::OpaqueBytes(b)) => (Some(b), ""),
        Some(reasoning_part::Opaque::OpaqueUri(u)) => (None, u.as_str()),
        None => (None, ""),
    };
    out.push_str("{\"Provider\":");
    string(&r.provider, out);
    out.push_str(",\"ModelID\":");
    string(&r.model_id, out);
    out.push_str(",\"Opaque\":");
    bytes_or_null(opaque, out);
    out.push_str(",\"OpaqueURI\":");
    string(uri, out);
    out.push_str(",\"OpaqueDigest\":");
    string(&r.opaque_digest, out);
    out.push_str(",\"Summary\":");
    slice(&r.summary, out, part_json)?;
    out.push_str(",\"ItemID\":");
    string(&r.item_id, out);
    out.push_str(",\"Ordinal\":");
    out.push_str(&r.ordinal.to_string());
    out.push_str(",\"ValidityScope\":");
    string(&r.validity_scope, out);
    out.push('}');
    Ok(())
}

fn mediation_name(m: i32) -> Result<&'static str> {
    use agentvm_proto::v1::Mediation;
    Ok(match Mediation::try_from(m) {
        Ok(Mediation::Unspecified) => "",
        Ok(Mediation::InHarnessReported) => "IN_HARNESS_REPORTED",
        Ok(Mediation::ControllerMediated) => "CONTROLLER_MEDIATED",
        Ok(Mediation::RequiresApproval) => "REQUIRES_APPROVAL",
        Err(_) => return Err(InputHashError::UnknownMediation(m)),
    })
}

fn tool_call(c: &ToolCall, out: &mut String) -> Result<()> {
    out.push_str("{\"ID\":");
    string(&c.id, out);
    out.push_str(",\"Tool\":");
    string(&c.tool, out);
    out.push_str(",\"Args\":");
    optional_struct(c.args.as_ref(), out)?;
    out.push_str(",\"Mediation\":");
    string(mediation_name(c.mediation)?, out);
    out.push_str(",\"IdempotencyKey\":");
    string(&c.idempotency_key, out);
    out.push('}');
    Ok(())
}

fn tool_result(r: &ToolResult, out: &mut String) -> Result<()> {
    out.push_str("{\"ID\":");
    string(&r.id, out);
    out.push_str(",\"Output\":");
    optional_struct(r.output.as_ref(), out)?;
    out.push_str(",\"OutputURI\":");
    string(&r.output_uri, out);
    out.push_str(",\"OutputDigest\":");
    string(&r.output_digest, out);
    out.push_str(",\"IsError\":");
    out.push_str(if r.is_error { "true" } else { "false" });
    out.push_str(",\"Error\":");
    string(&r.error, out);
    // The approval-era fields are omitempty on the Go struct.
    if !r.content.is_empty() {
        out.push_str(",\"Content\":");
        slice(&r.content, out, part_json)?;
    }
    if r.code != 0 {
        out.push_str(",\"Code\":");
        out.push_str(&r.code.to_string());
    }
    if r.approval_request_seq != 0 {
        out.push_str(",\"ApprovalRequestSeq\":");
        out.push_str(&r.approval_request_seq.to_string());
    }
    if r.approval_decision_seq != 0 {
        out.push_str(",\"ApprovalDecisionSeq\":");
        out.push_str(&r.approval_decision_seq.to_string());
    }
    out.push('}');
    Ok(())
}

fn tool_definition(d: &ToolDefinition, out: &mut String) -> Result<()> {
    out.push_str("{\"Name\":");
    string(&d.name, out);
    out.push_str(",\"Description\":");
    string(&d.description, out);
    out.push_str(",\"InputSchema\":");
    optional_struct(d.input_schema.as_ref(), out)?;
    out.push('}');
    Ok(())
}

fn tool_choice_json(c: &ToolChoice, out: &mut String) -> Result<()> {
    let mode = match tool_choice::Mode::try_from(c.mode) {
        Ok(tool_choice::Mode::Unspecified) => "",
        Ok(tool_choice::Mode::Auto) => "AUTO",
        Ok(tool_choice::Mode::None) => "NONE",
        Ok(tool_choice::Mode::Required) => "REQUIRED",
        Err(_) => return Err(InputHashError::UnknownToolChoice(c.mode)),
    };
    out.push_str("{\"Mode\":");
    string(mode, out);
    out.push_str(",\"Name\":");
    string(&c.name, out);
    out.push('}');
    Ok(())
}

fn optional_struct(s: Option<&Struct>, out: &mut String) -> Result<()> {
    match s {
        None => {
            out.push_str("null");
            Ok(())
        }
        Some(s) => object(s, out),
    }
}

fn object(s: &Struct, out: &mut String) -> Result<()> {
    // BTreeMap iterates in byte order of the keys, which is Go's map-key order.
    out.push('{');
    for (i, (k, v)) in s.fields.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        string(k, out);
        out.push(':');
        value(v, out)?;
    }
    out.push('}');
    Ok(())
}

fn value(v: &Value, out: &mut String) -> Result<()> {
    match &v.kind {
        None | Some(Kind::NullValue(_)) => out.push_str("null"),
        Some(Kind::BoolValue(b)) => out.push_str(if *b { "true" } else { "false" }),
        Some(Kind::NumberValue(n)) => out.push_str(&go_float(*n)?),
        Some(Kind::StringValue(s)) => string(s, out),
        Some(Kind::StructValue(s)) => object(s, out)?,
        Some(Kind::ListValue(l)) => {
            out.push('[');
            for (i, item) in l.values.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                value(item, out)?;
            }
            out.push(']');
        }
    }
    Ok(())
}

/// Go's `encoding/json` float64 form: shortest digits, plain notation for
/// 1e-6 <= |x| < 1e21, otherwise exponent form with a two-digit minimum dropped (`1e-07` → `1e-7`).
pub fn go_float(x: f64) -> Result<String> {
    if !x.is_finite() {
        return Err(InputHashError::NonFinite(x));
    }
    let abs = x.abs();
    if abs == 0.0 || (1e-6..1e21).contains(&abs) {
        // Rust's Display prints the shortest round-trip digits in plain notation.
        return Ok(format!("{x}"));
    }
    let sci = format!("{x:e}");
    let (mantissa, exp) = sci.split_once('e').expect("{:e} has an exponent");
    let exp: i32 = exp.parse().expect("{:e} exponent is an integer");
    Ok(format!(
        "{mantissa}e{}{:02}",
        if exp < 0 { '-' } else { '+' },
        exp.abs()
    )
    .replace("e-0", "e-")
    .replace("e+0", "e+"))
}

/// A JSON string as Go's encoder writes it (HTML-safe escaping on).
fn string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            '<' | '>' | '&' | '\u{2028}' | '\u{2029}' => {
                out.push_str(&format!("\\u{:04x}", c as u32));
            }
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use agentvm_proto::v1::TextPart;

    fn text(role: &str, t: &str) -> Message {
        Message {
            role: role.into(),
            parts: vec![Part {
                part: Some(part::Part::Text(TextPart { text: t.into() })),
            }],
        }
    }

    fn echo_call(input: &str) -> ModelCall {
        ModelCall {
            model: "echo".into(),
            messages: vec![text("user", input)],
            ..Default::default()
        }
    }

    #[test]
    fn reproduces_the_go_host_vectors() {
        let hello = echo_call("hello");
        assert_eq!(
            go_json(&hello).unwrap(),
            r#"{"Model":"echo","Messages":[{"Role":"user","Parts":[{"Text":{"Text":"hello"},"File":null,"Data":null,"Reasoning":null}]}],"Params":null}"#
        );
        assert_eq!(
            input_hash(&hello).unwrap(),
            "2611c24a1a665deca46265ed96d1e1efc699260c9cba9c07f22cda7939232c30"
        );
        assert_eq!(
            input_hash(&echo_call("new")).unwrap(),
            "403e89a947b27e8d1ce3838a7481b8fc33e51c0e03489bdb745ceab8b02f260d"
        );
        let tool = ModelCall {
            model: "m".into(),
            messages: vec![Message {
                role: "tool".into(),
                parts: vec![Part {
                    part: Some(part::Part::ToolResult(ToolResult {
                        id: "c1".into(),
                        ..Default::default()
                    })),
                }],
            }],
            ..Default::default()
        };
        assert_eq!(
            go_json(&tool).unwrap(),
            r#"{"Model":"m","Messages":[{"Role":"tool","Parts":[{"Text":null,"File":null,"Data":null,"Reasoning":null,"ToolResult":{"ID":"c1","Output":null,"OutputURI":"","OutputDigest":"","IsError":false,"Error":""}}]}],"Params":null}"#
        );
        assert_eq!(
            input_hash(&tool).unwrap(),
            "e519b8f957d02755a004b638c9d819f925e8bb9b65fa06a71bfd4f121b95472a"
        );
    }

    #[test]
    fn every_request_field_moves_the_hash() {
        let base = echo_call("hi");
        let h = input_hash(&base).unwrap();
        let mut with_params = base.clone();
        with_params.params.insert("temperature".into(), "0".into());
        let mut with_tools = base.clone();
        with_tools.tools.push(ToolDefinition {
            name: "ls".into(),
            ..Default::default()
        });
        let mut with_choice = base.clone();
        with_choice.tool_choice = Some(ToolChoice {
            mode: tool_choice::Mode::Auto as i32,
            name: String::new(),
        });
        for other in [with_params, with_tools, with_choice] {
            assert_ne!(input_hash(&other).unwrap(), h);
        }
        // id and input_hash are not part of the request
        let mut relabelled = base.clone();
        relabelled.id = "abc".into();
        relabelled.input_hash = "x".into();
        assert_eq!(input_hash(&relabelled).unwrap(), h);
    }

    #[test]
    fn go_string_and_number_rules() {
        let mut s = String::new();
        string("<a&b>\u{2028}\n\u{1}é", &mut s);
        assert_eq!(s, r#""\u003ca\u0026b\u003e\u2028\n\u0001é""#);
        for (x, want) in [
            (2.0, "2"),
            (1.5, "1.5"),
            (1e21, "1e+21"),
            (1e-7, "1e-7"),
            (0.000001, "0.000001"),
            (123456789.0, "123456789"),
            (-2.5e-10, "-2.5e-10"),
        ] {
            assert_eq!(go_float(x).unwrap(), want, "{x:e}");
        }
        assert!(go_float(f64::NAN).is_err());
    }

    #[test]
    fn unknown_enums_are_refused_rather_than_guessed() {
        let mut call = echo_call("x");
        call.tool_choice = Some(ToolChoice {
            mode: 9,
            name: String::new(),
        });
        assert_eq!(input_hash(&call), Err(InputHashError::UnknownToolChoice(9)));
    }
}
