//! Host-executed tools: the executor interface and the checks a call passes before its intent
//! is journaled (I3).

use agentvm_proto::v1::{ToolCall, ToolResult};
use prost_types::{Struct, Value, value::Kind};

/// What an executor learns about the call beyond the call itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCallContext {
    /// The session the call belongs to: with the idempotency key, the dedup namespace.
    pub session_uid: String,
}

/// Runs CONTROLLER_MEDIATED and approved REQUIRES_APPROVAL calls. It runs after the TOOL_CALL
/// intent is durable and may be asked again for the same call after a crash, so it must dedup
/// on (session uid, idempotency key) and never repeat the effect.
#[async_trait::async_trait]
pub trait ToolExecutor: Send + Sync {
    async fn execute(&self, ctx: &ToolCallContext, call: &ToolCall) -> Result<ToolResult, String>;
}

/// The largest integer magnitude every JSON reader represents exactly is 2^53 - 1.
const MAX_SAFE_INTEGER: f64 = 9_007_199_254_740_991.0;

/// Tool args must be representable in the journal's JSON form: no unset values, no NaN or
/// infinities, no numbers beyond ±(2^53 - 1).
pub fn check_args(args: Option<&Struct>) -> Result<(), String> {
    fn value(v: &Value, path: &str) -> Result<(), String> {
        match &v.kind {
            None => Err(format!("{path} has no value")),
            Some(Kind::NumberValue(n)) if !n.is_finite() => {
                Err(format!("{path} is {n}, which JSON cannot carry"))
            }
            Some(Kind::NumberValue(n)) if n.abs() > MAX_SAFE_INTEGER => Err(format!(
                "{path} is {n}, beyond the ±2^53 range JSON numbers keep exactly"
            )),
            Some(Kind::StructValue(s)) => fields(s, path),
            Some(Kind::ListValue(l)) => l
                .values
                .iter()
                .enumerate()
                .try_for_each(|(i, v)| value(v, &format!("{path}[{i}]"))),
            Some(_) => Ok(()),
        }
    }
    fn fields(s: &Struct, path: &str) -> Result<(), String> {
        s.fields
            .iter()
            .try_for_each(|(k, v)| value(v, &format!("{path}.{k}")))
    }
    match args {
        Some(s) => fields(s, "args"),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn args(v: Kind) -> Struct {
        Struct {
            fields: BTreeMap::from([("x".to_owned(), Value { kind: Some(v) })]),
        }
    }

    #[test]
    fn unrepresentable_numbers_are_refused() {
        for bad in [
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
            9_007_199_254_740_992.0,
        ] {
            let e = check_args(Some(&args(Kind::NumberValue(bad)))).unwrap_err();
            assert!(e.contains("args.x"), "{e}");
        }
        assert!(check_args(Some(&args(Kind::NumberValue(9_007_199_254_740_991.0)))).is_ok());
        assert!(check_args(Some(&args(Kind::NumberValue(2.5)))).is_ok());
        assert!(check_args(None).is_ok());
    }

    #[test]
    fn nested_values_are_checked_with_their_path() {
        let nested = args(Kind::ListValue(prost_types::ListValue {
            values: vec![Value { kind: None }],
        }));
        let e = check_args(Some(&nested)).unwrap_err();
        assert!(e.contains("args.x[0]"), "{e}");
    }
}
