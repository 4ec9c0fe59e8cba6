//! Bounds the `grpc-message` a response carries, in headers and in trailers.
//!
//! Status messages name what was wrong, often quoting the request (a session name, a field
//! value). A client can send a 70 KB name; quoted back, the message would exceed the
//! peer's HTTP/2 header limit and the whole stream would be reset with a protocol error
//! instead of the status. Every message is therefore cut to `MAX_MESSAGE` bytes here, once,
//! for every service, rather than at each of the places that quote input.

use http::HeaderValue;
use http_body_util::BodyExt;
use tonic::body::Body;

/// Longest `grpc-message` sent (percent-encoded bytes).
pub const MAX_MESSAGE: usize = 1024;
const HEADER: &str = "grpc-message";
/// "…" percent-encoded, appended where a message was cut.
const ELLIPSIS: &str = "%E2%80%A6";

/// A cut of an encoded message that does not split a `%XX` escape.
fn truncated(value: &HeaderValue) -> Option<HeaderValue> {
    let bytes = value.as_bytes();
    if bytes.len() <= MAX_MESSAGE {
        return None;
    }
    let mut cut = MAX_MESSAGE - ELLIPSIS.len();
    // A '%' in the last two kept bytes starts an escape the cut would break.
    if let Some(p) = bytes[cut.saturating_sub(2)..cut]
        .iter()
        .rposition(|b| *b == b'%')
    {
        cut = cut.saturating_sub(2) + p;
    }
    let mut out = bytes[..cut].to_vec();
    out.extend_from_slice(ELLIPSIS.as_bytes());
    HeaderValue::from_bytes(&out).ok()
}

fn bound(headers: &mut http::HeaderMap) {
    if let Some(short) = headers.get(HEADER).and_then(truncated) {
        headers.insert(HEADER, short);
    }
}

/// Applied to every response of the gRPC server.
pub fn limit_status(mut response: http::Response<Body>) -> http::Response<Body> {
    bound(response.headers_mut());
    response.map(|body| {
        Body::new(body.map_frame(|frame| match frame.into_trailers() {
            Ok(mut trailers) => {
                bound(&mut trailers);
                http_body::Frame::trailers(trailers)
            }
            Err(frame) => frame,
        }))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_messages_are_cut_without_splitting_escapes() {
        let short = HeaderValue::from_static("session%20x%20not%20found");
        assert!(truncated(&short).is_none());
        for pad in 0..3 {
            let text = format!("{}{}", "a".repeat(pad), "%C3%BC".repeat(2000));
            let value = HeaderValue::from_str(&text).unwrap();
            let cut = truncated(&value).unwrap();
            let cut = cut.to_str().unwrap();
            assert!(cut.len() <= MAX_MESSAGE);
            assert!(cut.ends_with(ELLIPSIS));
            let body = &cut[..cut.len() - ELLIPSIS.len()];
            // Every escape left is whole.
            for (i, b) in body.bytes().enumerate() {
                if b == b'%' {
                    assert!(i + 2 < body.len(), "escape cut at {i} in {body}");
                }
            }
        }
    }
}
