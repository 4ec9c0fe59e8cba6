//! protobuf Struct/Value <-> JSON, and the HTTP client, for the HTTP peers (model providers,
//! tool executors) that speak JSON where the journal speaks protobuf.

use prost_types::{Struct, Value as PValue, value::Kind};
use serde_json::{Value, json};

pub fn struct_to_json(s: &Struct) -> Value {
    Value::Object(
        s.fields
            .iter()
            .map(|(k, v)| (k.clone(), value_to_json(v)))
            .collect(),
    )
}

fn value_to_json(v: &PValue) -> Value {
    match &v.kind {
        None | Some(Kind::NullValue(_)) => Value::Null,
        Some(Kind::NumberValue(n)) => {
            serde_json::Number::from_f64(*n).map_or(Value::Null, Value::Number)
        }
        Some(Kind::StringValue(s)) => json!(s),
        Some(Kind::BoolValue(b)) => json!(b),
        Some(Kind::StructValue(s)) => struct_to_json(s),
        Some(Kind::ListValue(l)) => Value::Array(l.values.iter().map(value_to_json).collect()),
    }
}

pub fn json_to_value(v: &Value) -> PValue {
    PValue {
        kind: Some(match v {
            Value::Null => Kind::NullValue(0),
            Value::Bool(b) => Kind::BoolValue(*b),
            Value::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or(0.0)),
            Value::String(s) => Kind::StringValue(s.clone()),
            Value::Array(a) => Kind::ListValue(prost_types::ListValue {
                values: a.iter().map(json_to_value).collect(),
            }),
            Value::Object(o) => Kind::StructValue(Struct {
                fields: o
                    .iter()
                    .map(|(k, v)| (k.clone(), json_to_value(v)))
                    .collect(),
            }),
        }),
    }
}

/// An HTTP/1.1 client for `http://` and `https://` (rustls, webpki roots).
pub type HttpsClient = hyper_util::client::legacy::Client<
    hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
    http_body_util::Full<bytes::Bytes>,
>;

/// Nagle's algorithm is off on its connections: a request written in two segments would
/// otherwise wait for the peer's delayed ACK (~40 ms) before its second one left.
pub fn https_client() -> HttpsClient {
    let mut http = hyper_util::client::legacy::connect::HttpConnector::new();
    http.set_nodelay(true);
    http.enforce_http(false);
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_webpki_roots()
        .https_or_http()
        .enable_http1()
        .wrap_connector(http);
    hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build(connector)
}
