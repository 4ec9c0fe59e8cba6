//! How large what a client attaches to a session may be: its labels, annotations, origin,
//! name and model, a turn's config, and what a fork's children inherit all together.
//!
//! Why: every one of them is stored in the session's row and sent back in every Session a
//! response carries. Unbounded, one 48 MiB annotation was accepted, then inherited by each
//! fork child; `Fork(2)` committed both children and answered OUT_OF_RANGE (its response over
//! the 4 MiB a gRPC client reads), and that project's ListSessions failed from then on. Each
//! is refused here before anything is written, naming the field and the limit, and a page of
//! sessions stops short of that 4 MiB (`MAX_PAGE_BYTES`).

use std::collections::HashMap;

use prost::Message as _;
use tonic::Status;

/// Labels of one session, keys and values together.
pub const MAX_LABELS_BYTES: usize = 16 << 10;
/// Annotations of one session, keys and values together.
pub const MAX_ANNOTATIONS_BYTES: usize = 64 << 10;
/// One label or annotation key (as Kubernetes bounds a qualified name).
pub const MAX_KEY_BYTES: usize = 253;
/// A session's `origin`, encoded.
pub const MAX_ORIGIN_BYTES: usize = 16 << 10;
/// A session's display name, and its model's name.
pub const MAX_NAME_BYTES: usize = 253;
/// A turn's harness config (journaled verbatim in EXECUTION_START).
pub const MAX_CONFIG_BYTES: usize = 256 << 10;
/// What one response may carry of sessions: under the 4 MiB a gRPC client reads by default.
pub const MAX_PAGE_BYTES: usize = 3 << 20;

fn too_large(field: &str, what: &str, got: usize, limit: usize) -> Status {
    Status::invalid_argument(format!(
        "{field}: {what} is {got} bytes, more than the {limit} allowed"
    ))
}

/// Labels or annotations: no empty key, no key over [`MAX_KEY_BYTES`], at most `limit`
/// bytes of keys and values together.
pub fn check_map(field: &str, map: &HashMap<String, String>, limit: usize) -> Result<(), Status> {
    if map.keys().any(String::is_empty) {
        return Err(Status::invalid_argument(format!(
            "{field}: keys may not be empty"
        )));
    }
    if let Some(key) = map.keys().find(|k| k.len() > MAX_KEY_BYTES) {
        return Err(too_large(
            &format!("{field}[{:?}…]", &key[..key.floor_char_boundary(32)]),
            "the key",
            key.len(),
            MAX_KEY_BYTES,
        ));
    }
    let total: usize = map.iter().map(|(k, v)| k.len() + v.len()).sum();
    if total > limit {
        return Err(too_large(field, "the whole", total, limit));
    }
    Ok(())
}

/// A name-like string field.
pub fn check_name(field: &str, value: &str) -> Result<(), Status> {
    match value.len() > MAX_NAME_BYTES {
        true => Err(too_large(field, "it", value.len(), MAX_NAME_BYTES)),
        false => Ok(()),
    }
}

/// A session's origin, encoded.
pub fn check_origin(field: &str, origin: Option<&agentvm_proto::v1::Origin>) -> Result<(), Status> {
    let len = origin.map_or(0, |o| o.encoded_len());
    match len > MAX_ORIGIN_BYTES {
        true => Err(too_large(field, "it", len, MAX_ORIGIN_BYTES)),
        false => Ok(()),
    }
}

/// A turn's config.
pub fn check_config(field: &str, config: &[u8]) -> Result<(), Status> {
    match config.len() > MAX_CONFIG_BYTES {
        true => Err(too_large(field, "it", config.len(), MAX_CONFIG_BYTES)),
        false => Ok(()),
    }
}

/// `count` children, each carrying `child_bytes` of metadata, fit one Fork response.
pub fn check_fork_fan_out(count: usize, child_bytes: usize) -> Result<(), Status> {
    let total = count.saturating_mul(child_bytes);
    match total > MAX_PAGE_BYTES {
        true => Err(Status::invalid_argument(format!(
            "count: {count} children inheriting {child_bytes} bytes of metadata each would \
             answer {total} bytes, more than the {MAX_PAGE_BYTES} a response may carry; fork \
             fewer at a time"
        ))),
        false => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_limit_names_its_field_and_allows_up_to_it() {
        let at = |n: usize| HashMap::from([("k".to_owned(), "v".repeat(n - 1))]);
        check_map("labels", &at(MAX_LABELS_BYTES), MAX_LABELS_BYTES).unwrap();
        let err = check_map("labels", &at(MAX_LABELS_BYTES + 1), MAX_LABELS_BYTES).unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.message().starts_with("labels:"), "{err:?}");
        let long_key = HashMap::from([("ü".repeat(200), String::new())]);
        let err = check_map("annotations", &long_key, MAX_ANNOTATIONS_BYTES).unwrap_err();
        assert!(err.message().contains("the key"), "{err:?}");
        let empty_key = HashMap::from([(String::new(), "v".to_owned())]);
        assert!(check_map("labels", &empty_key, 100).is_err());
        check_name("name", &"n".repeat(MAX_NAME_BYTES)).unwrap();
        assert!(check_name("name", &"n".repeat(MAX_NAME_BYTES + 1)).is_err());
        check_config("config", &vec![0; MAX_CONFIG_BYTES]).unwrap();
        assert!(check_config("config", &vec![0; MAX_CONFIG_BYTES + 1]).is_err());
        check_fork_fan_out(128, 20 << 10).unwrap();
        assert!(check_fork_fan_out(128, 64 << 10).is_err());
    }
}
