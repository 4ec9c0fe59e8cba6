//! JSON decoding that names where a body went wrong (`cpus.boot_vcpus: invalid type: …`).

use serde::de::DeserializeOwned;

/// A body that did not decode, with the path of the field at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", at_path(path, reason))]
pub struct JsonError {
    /// Dotted path of the offending field (`cpus.boot_vcpus`, `disks[0].path`); `.` for the
    /// root, `?` when the input ended or broke before a field was reached.
    pub path: String,
    /// What is wrong there, as serde_json put it.
    pub reason: String,
}

/// Decodes `bytes` as `T`; errors name the field path, e.g.
/// `cpus.boot_vcpus: invalid type: string "x", expected u8 at line 1 column 28`.
pub fn from_slice<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, JsonError> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(&mut de).map_err(|e| JsonError {
        path: e.path().to_string(),
        reason: e.into_inner().to_string(),
    })?;
    // Trailing garbage after the value ("{} x") is an error too.
    de.end().map_err(|e| JsonError {
        path: ".".to_owned(),
        reason: e.to_string(),
    })?;
    Ok(value)
}

/// `"{path}: {reason}"`, or just the reason when the path is the root or unknown
/// (serde_path_to_error writes `.` and `?` for those).
pub(crate) fn at_path(path: &str, reason: &str) -> String {
    if matches!(path, "" | "." | "?") {
        reason.to_owned()
    } else {
        format!("{path}: {reason}")
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    #[test]
    fn errors_name_the_path_or_nothing_at_the_root() {
        let err = from_slice::<BTreeMap<String, u8>>(br#"{"a": "x"}"#).expect_err("type");
        assert_eq!(err.path, "a");
        assert!(
            err.to_string().starts_with("a: invalid type: string"),
            "{err}"
        );
        let err = from_slice::<BTreeMap<String, u8>>(b"{").expect_err("truncated");
        assert!(err.to_string().starts_with("EOF while parsing"), "{err}");
        let err = from_slice::<BTreeMap<String, u8>>(b"null").expect_err("root");
        assert!(err.to_string().starts_with("invalid type: null"), "{err}");
        let err = from_slice::<BTreeMap<String, u8>>(b"{} {}").expect_err("trailing");
        assert!(err.to_string().contains("trailing"), "{err}");
    }
}
