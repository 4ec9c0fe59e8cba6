//! ListSessions page tokens: base64url (no padding) of `"<created_at unix nanos>\0<uid>"`,
//! the keyset cursor upstream uses. A token that does not parse is INVALID_ARGUMENT, never a
//! silent first page.

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;

use crate::journal::ListCursor;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("page_token is not a token this server issued: {0}")]
pub struct BadPageToken(&'static str);

pub fn encode(cursor: &ListCursor) -> String {
    URL_SAFE_NO_PAD.encode(format!("{}\0{}", cursor.created_at, cursor.uid))
}

pub fn decode(token: &str) -> Result<ListCursor, BadPageToken> {
    let raw = URL_SAFE_NO_PAD
        .decode(token)
        .map_err(|_| BadPageToken("not base64url"))?;
    let text = String::from_utf8(raw).map_err(|_| BadPageToken("not UTF-8"))?;
    let (nanos, uid) = text
        .split_once('\0')
        .ok_or(BadPageToken("missing separator"))?;
    let created_at = nanos
        .parse::<i64>()
        .map_err(|_| BadPageToken("bad timestamp"))?;
    if uid.is_empty() {
        return Err(BadPageToken("empty uid"));
    }
    Ok(ListCursor {
        created_at,
        uid: uid.to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        let c = ListCursor {
            created_at: 1_700_000_000_123_456_789,
            uid: "sess-0123456789abcdef01234567".into(),
        };
        let t = encode(&c);
        assert!(!t.contains('=') && !t.contains('+') && !t.contains('/'));
        assert_eq!(decode(&t), Ok(c));
    }

    #[test]
    fn refuses_foreign_tokens() {
        for bad in [
            "",
            "!!!",
            "bm9zZXBhcmF0b3I",
            &URL_SAFE_NO_PAD.encode("x\0s"),
            &URL_SAFE_NO_PAD.encode("5\0"),
        ] {
            assert!(decode(bad).is_err(), "{bad:?}");
        }
    }
}
