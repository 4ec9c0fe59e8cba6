//! Wall-clock time as the journal stores it (unix nanoseconds) and as the API shows it.

use std::time::{SystemTime, UNIX_EPOCH};

/// Now, in unix nanoseconds (0 if the clock reads before 1970).
pub fn now_nanos() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

/// Unix nanoseconds as a protobuf Timestamp (nanos always in 0..1e9, as the JSON form needs).
pub fn timestamp(nanos: i64) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: nanos.div_euclid(1_000_000_000),
        nanos: nanos.rem_euclid(1_000_000_000) as i32,
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn negative_nanos_normalize() {
        let t = super::timestamp(-1);
        assert_eq!((t.seconds, t.nanos), (-1, 999_999_999));
    }
}
