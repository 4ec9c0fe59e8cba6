//! The canonical form behind every hash agentvm computes, byte-compatible with upstream:
//! proto3 JSON (proto field names, enums by name, defaults omitted, 64-bit integers as strings,
//! bytes as padded base64) re-serialized per RFC 8785 (JCS), then SHA-256.
//!
//! Everything that hashes a message calls into this module; nothing else serializes for hashing.

use std::sync::LazyLock;

use prost::{Message, Name};
use prost_reflect::{DescriptorPool, DeserializeOptions, DynamicMessage, SerializeOptions};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::v1::{Event, HarnessSpec};

/// Why a message could not be put into canonical form or read back from JSON.
#[derive(Debug, thiserror::Error)]
pub enum CanonError {
    #[error("message type {0} is not in the agentvm descriptor set")]
    UnknownType(String),
    #[error("{type_name} is not representable as proto3 JSON: {reason}")]
    NotRepresentable { type_name: String, reason: String },
    #[error("number {0} has no JSON form (NaN and infinities are not allowed)")]
    NonFiniteNumber(f64),
    #[error("invalid {type_name} JSON: {reason}")]
    InvalidJson { type_name: String, reason: String },
}

static POOL: LazyLock<DescriptorPool> = LazyLock::new(|| {
    DescriptorPool::decode(crate::FILE_DESCRIPTOR_SET)
        .expect("the descriptor set compiled into this crate decodes")
});

/// The descriptor pool of every agentvm proto (agentsessions.v1, agentvm.guest.v1 and WKTs).
pub fn descriptor_pool() -> &'static DescriptorPool {
    &POOL
}

const SERIALIZE: SerializeOptions = SerializeOptions::new()
    .use_proto_field_name(true)
    .stringify_64_bit_integers(true)
    .use_enum_numbers(false)
    .skip_default_fields(true);

fn dynamic<M: Message + Name>(msg: &M) -> Result<DynamicMessage, CanonError> {
    let name = M::full_name();
    let desc = POOL
        .get_message_by_name(&name)
        .ok_or_else(|| CanonError::UnknownType(name.clone()))?;
    DynamicMessage::decode(desc, msg.encode_to_vec().as_slice()).map_err(|e| {
        CanonError::NotRepresentable {
            type_name: name,
            reason: e.to_string(),
        }
    })
}

/// `msg` as a proto3-JSON value with the upstream hashing options.
pub fn to_proto_json<M: Message + Name>(msg: &M) -> Result<Value, CanonError> {
    let dynamic = dynamic(msg)?;
    dynamic
        .serialize_with_options(serde_json::value::Serializer, &SERIALIZE)
        .map_err(|e| CanonError::NotRepresentable {
            type_name: M::full_name(),
            reason: e.to_string(),
        })
}

/// Parses proto3 JSON (proto or lowerCamel field names) into `M`, refusing unknown fields and
/// unknown enum names.
pub fn from_proto_json<M: Message + Name + Default>(value: &Value) -> Result<M, CanonError> {
    let name = M::full_name();
    let desc = POOL
        .get_message_by_name(&name)
        .ok_or_else(|| CanonError::UnknownType(name.clone()))?;
    let invalid = |reason: String| CanonError::InvalidJson {
        type_name: name.clone(),
        reason,
    };
    let dynamic = DynamicMessage::deserialize_with_options(
        desc,
        value,
        &DeserializeOptions::new().deny_unknown_fields(true),
    )
    .map_err(|e| invalid(e.to_string()))?;
    dynamic.transcode_to().map_err(|e| invalid(e.to_string()))
}

/// `canon.Proto`: the JCS bytes of any message's proto3 JSON.
pub fn canonical_proto<M: Message + Name>(msg: &M) -> Result<Vec<u8>, CanonError> {
    jcs(&to_proto_json(msg)?)
}

/// `canon.Event`: the JCS bytes of an event, with no record envelope.
pub fn canonical_event(event: &Event) -> Result<Vec<u8>, CanonError> {
    canonical_proto(event)
}

/// The bytes hashed for a journal record: `{"event":…,"prev_hash":…,"seq":"<decimal>"}` in JCS.
pub fn record_preimage(seq: i64, prev_hash: &str, event: &Event) -> Result<Vec<u8>, CanonError> {
    let envelope = serde_json::json!({
        "event": to_proto_json(event)?,
        "prev_hash": prev_hash,
        "seq": seq.to_string(),
    });
    jcs(&envelope)
}

/// `LogRecord.content_hash`: lowercase hex SHA-256 of [`record_preimage`].
pub fn content_hash(seq: i64, prev_hash: &str, event: &Event) -> Result<String, CanonError> {
    Ok(sha256_hex(&record_preimage(seq, prev_hash, event)?))
}

/// `HarnessRegistration.spec_digest`: `"sha256:"` + hex SHA-256 of the spec's canonical form.
pub fn spec_digest(spec: &HarnessSpec) -> Result<String, CanonError> {
    Ok(format!("sha256:{}", sha256_hex(&canonical_proto(spec)?)))
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// RFC 8785 serialization of a JSON value.
pub fn jcs(value: &Value) -> Result<Vec<u8>, CanonError> {
    let mut out = Vec::with_capacity(256);
    write_value(value, &mut out)?;
    Ok(out)
}

fn write_value(value: &Value, out: &mut Vec<u8>) -> Result<(), CanonError> {
    match value {
        Value::Null => out.extend_from_slice(b"null"),
        Value::Bool(true) => out.extend_from_slice(b"true"),
        Value::Bool(false) => out.extend_from_slice(b"false"),
        Value::Number(n) => write_number(n, out)?,
        Value::String(s) => write_string(s, out),
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_value(item, out)?;
            }
            out.push(b']');
        }
        Value::Object(map) => {
            // JCS orders members by their keys as UTF-16 code units, which differs from the
            // UTF-8 byte order of the map only for characters beyond the BMP.
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_by(|(a, _), (b, _)| a.encode_utf16().cmp(b.encode_utf16()));
            out.push(b'{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_string(k, out);
                out.push(b':');
                write_value(v, out)?;
            }
            out.push(b'}');
        }
    }
    Ok(())
}

fn write_string(s: &str, out: &mut Vec<u8>) {
    out.push(b'"');
    for c in s.chars() {
        match c {
            '"' => out.extend_from_slice(b"\\\""),
            '\\' => out.extend_from_slice(b"\\\\"),
            '\u{08}' => out.extend_from_slice(b"\\b"),
            '\t' => out.extend_from_slice(b"\\t"),
            '\n' => out.extend_from_slice(b"\\n"),
            '\u{0c}' => out.extend_from_slice(b"\\f"),
            '\r' => out.extend_from_slice(b"\\r"),
            c if (c as u32) < 0x20 => {
                out.extend_from_slice(format!("\\u{:04x}", c as u32).as_bytes());
            }
            c => {
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
    out.push(b'"');
}

fn write_number(n: &serde_json::Number, out: &mut Vec<u8>) -> Result<(), CanonError> {
    // JCS numbers are IEEE doubles printed by the ECMAScript algorithm. Integers from int32
    // fields and enum numbers arrive as i64/u64; they go through the same double conversion.
    let v = if let Some(i) = n.as_i64() {
        i as f64
    } else if let Some(u) = n.as_u64() {
        u as f64
    } else {
        n.as_f64().unwrap_or(f64::NAN)
    };
    out.extend_from_slice(ecmascript_number(v)?.as_bytes());
    Ok(())
}

/// ECMAScript Number::toString for a finite double (ECMA-262 §6.1.6.1.20).
pub fn ecmascript_number(v: f64) -> Result<String, CanonError> {
    if !v.is_finite() {
        return Err(CanonError::NonFiniteNumber(v));
    }
    if v == 0.0 {
        return Ok("0".to_owned());
    }
    // Rust's `{:e}` prints the shortest digits that round-trip, as ECMAScript requires.
    let sci = format!("{:e}", v.abs());
    let (mantissa, exp) = sci.split_once('e').expect("{:e} always has an exponent");
    let exp: i32 = exp.parse().expect("{:e} exponent is an integer");
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let k = digits.len() as i32;
    let n = exp + 1;
    let mut s = String::with_capacity(32);
    if v < 0.0 {
        s.push('-');
    }
    if k <= n && n <= 21 {
        s.push_str(&digits);
        s.extend(std::iter::repeat_n('0', (n - k) as usize));
    } else if 0 < n && n <= 21 {
        s.push_str(&digits[..n as usize]);
        s.push('.');
        s.push_str(&digits[n as usize..]);
    } else if -6 < n && n <= 0 {
        s.push_str("0.");
        s.extend(std::iter::repeat_n('0', (-n) as usize));
        s.push_str(&digits);
    } else {
        s.push_str(&digits[..1]);
        if k > 1 {
            s.push('.');
            s.push_str(&digits[1..]);
        }
        s.push('e');
        s.push(if n > 0 { '+' } else { '-' });
        s.push_str(&(n - 1).abs().to_string());
    }
    Ok(s)
}

#[cfg(test)]
mod tests;
