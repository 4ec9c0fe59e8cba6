//! [`ApiError`]: an HTTP status and a chain of messages, outermost first.
//!
//! On the wire this is Cloud Hypervisor's v53 error form: the status code with a JSON array of
//! strings as the body, e.g. `["vm.pause failed", "VM is not running"]`.

use std::error::Error as StdError;
use std::fmt;

/// A failed API call: the status to answer with and the message chain, outermost first.
///
/// Backends return the *causes*; the server prepends what failed (`"vm.pause failed"`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// 400 (bad request or invalid config), 404 (no VM config), 409 (duplicate id) or 500.
    /// Anything that is not a 4xx/5xx code is answered as 500.
    pub status: u16,
    /// The chain, outermost first.
    pub messages: Vec<String>,
}

impl ApiError {
    /// Bad JSON, bad method, invalid config.
    pub const BAD_REQUEST: u16 = 400;
    /// No VM config, unknown path, unknown device id.
    pub const NOT_FOUND: u16 = 404;
    /// Duplicate id or device path.
    pub const CONFLICT: u16 = 409;
    /// Everything else, wrong-state calls included.
    pub const INTERNAL: u16 = 500;

    /// An error with one message.
    pub fn new(status: u16, message: impl Into<String>) -> Self {
        Self {
            status,
            messages: vec![message.into()],
        }
    }

    /// 400 with one message.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(Self::BAD_REQUEST, message)
    }

    /// 404 with one message.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(Self::NOT_FOUND, message)
    }

    /// 409 with one message.
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(Self::CONFLICT, message)
    }

    /// 500 with one message.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(Self::INTERNAL, message)
    }

    /// An error whose messages are `err` and its `source()` chain, outermost first.
    pub fn from_error(status: u16, err: &(dyn StdError + 'static)) -> Self {
        let mut messages = Vec::new();
        let mut next = Some(err);
        while let Some(e) = next {
            messages.push(e.to_string());
            next = e.source();
        }
        Self { status, messages }
    }

    /// Prepends `message` as the new outermost message.
    #[must_use]
    pub fn context(mut self, message: impl Into<String>) -> Self {
        self.messages.insert(0, message.into());
        self
    }

    /// Appends `message` as the innermost cause.
    #[must_use]
    pub fn caused_by(mut self, message: impl Into<String>) -> Self {
        self.messages.push(message.into());
        self
    }

    /// The wire body: a JSON array of strings.
    pub fn to_body(&self) -> Vec<u8> {
        // Serialising a Vec<String> cannot fail; fall back to an empty array regardless.
        serde_json::to_vec(&self.messages).unwrap_or_else(|_| b"[]".to_vec())
    }

    /// Reads an error body: a JSON array of strings, or else the raw text as one message
    /// (CH before v47 sent plain text). An empty body gives no messages.
    pub fn from_body(status: u16, body: &[u8]) -> Self {
        if let Ok(messages) = serde_json::from_slice::<Vec<String>>(body) {
            return Self { status, messages };
        }
        let text = String::from_utf8_lossy(body);
        let text = text.trim();
        let messages = if text.is_empty() {
            Vec::new()
        } else {
            vec![text.to_owned()]
        };
        Self { status, messages }
    }
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HTTP {}", self.status)?;
        for message in &self.messages {
            write!(f, ": {message}")?;
        }
        Ok(())
    }
}

impl StdError for ApiError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_joins_the_chain() {
        let e = ApiError::internal("VM is not running").context("vm.pause failed");
        assert_eq!(
            e.to_string(),
            "HTTP 500: vm.pause failed: VM is not running"
        );
        assert_eq!(
            ApiError {
                status: 404,
                messages: vec![]
            }
            .to_string(),
            "HTTP 404"
        );
    }

    #[test]
    fn body_round_trips_and_falls_back_to_text() {
        let e = ApiError::bad_request("a \"quoted\" thing").caused_by("cause");
        assert_eq!(ApiError::from_body(400, &e.to_body()), e);
        let raw = ApiError::from_body(500, b"plain failure\n");
        assert_eq!(raw.messages, vec!["plain failure".to_owned()]);
        assert!(ApiError::from_body(500, b"").messages.is_empty());
    }

    #[test]
    fn from_error_walks_sources() {
        #[derive(Debug)]
        struct Outer(std::io::Error);
        impl fmt::Display for Outer {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("mapping guest memory")
            }
        }
        impl StdError for Outer {
            fn source(&self) -> Option<&(dyn StdError + 'static)> {
                Some(&self.0)
            }
        }
        let e = ApiError::from_error(500, &Outer(std::io::Error::other("out of memory")));
        assert_eq!(e.messages, vec!["mapping guest memory", "out of memory"]);
    }
}
