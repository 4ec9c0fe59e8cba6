//! Hash-chain verification: the same walk upstream's verifier does, record by record from
//! `prev = ""`. Tampering (a broken link or a hash that does not recompute) is reported apart
//! from records that cannot be canonicalized at all.

use agentvm_proto::canon;
use agentvm_proto::v1::LogRecord;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChainError {
    #[error("seq {seq}: expected seq {expected} (gap or reordering in the log)")]
    Gap { seq: i64, expected: i64 },
    #[error(
        "seq {seq}: broken link: prev_hash is {found:?}, previous record's hash is {expected:?}"
    )]
    BrokenLink {
        seq: i64,
        expected: String,
        found: String,
    },
    #[error("seq {seq}: hash mismatch: stored {stored}, recomputed {computed}")]
    HashMismatch {
        seq: i64,
        stored: String,
        computed: String,
    },
    #[error("seq {seq}: record has no event")]
    MissingEvent { seq: i64 },
    #[error("seq {seq}: event cannot be canonicalized: {reason}")]
    Canonicalization { seq: i64, reason: String },
}

impl ChainError {
    pub fn seq(&self) -> i64 {
        match self {
            ChainError::Gap { seq, .. }
            | ChainError::BrokenLink { seq, .. }
            | ChainError::HashMismatch { seq, .. }
            | ChainError::MissingEvent { seq }
            | ChainError::Canonicalization { seq, .. } => *seq,
        }
    }
}

/// Incremental verifier, so a caller can stream records through it.
#[derive(Debug, Default)]
pub struct ChainVerifier {
    prev: String,
    next_seq: i64,
}

impl ChainVerifier {
    pub fn new() -> Self {
        Self {
            prev: String::new(),
            next_seq: 1,
        }
    }

    /// Checks one record; records must arrive in seq order starting at 1.
    pub fn push(&mut self, record: &LogRecord) -> Result<(), ChainError> {
        let seq = record.seq;
        if seq != self.next_seq {
            return Err(ChainError::Gap {
                seq,
                expected: self.next_seq,
            });
        }
        if record.prev_hash != self.prev {
            return Err(ChainError::BrokenLink {
                seq,
                expected: self.prev.clone(),
                found: record.prev_hash.clone(),
            });
        }
        let event = record
            .event
            .as_ref()
            .ok_or(ChainError::MissingEvent { seq })?;
        let computed = canon::content_hash(seq, &record.prev_hash, event).map_err(|e| {
            ChainError::Canonicalization {
                seq,
                reason: e.to_string(),
            }
        })?;
        if computed != record.content_hash {
            return Err(ChainError::HashMismatch {
                seq,
                stored: record.content_hash.clone(),
                computed,
            });
        }
        self.prev = computed;
        self.next_seq += 1;
        Ok(())
    }

    /// Number of records verified so far.
    pub fn verified(&self) -> i64 {
        self.next_seq - 1
    }
}

/// Verifies a whole log; returns the number of records.
pub fn verify_chain<'a>(
    records: impl IntoIterator<Item = &'a LogRecord>,
) -> Result<i64, ChainError> {
    let mut v = ChainVerifier::new();
    for r in records {
        v.push(r)?;
    }
    Ok(v.verified())
}

#[cfg(test)]
mod tests {
    use super::*;
    use agentvm_proto::v1::{Event, EventKind, HarnessEnd, event::Body};

    fn chain(n: i64) -> Vec<LogRecord> {
        let mut prev = String::new();
        (1..=n)
            .map(|seq| {
                let event = Event {
                    execution_id: format!("x{seq}"),
                    kind: EventKind::EventEnd as i32,
                    body: Some(Body::End(HarnessEnd {
                        state: "COMPLETED".into(),
                        error: None,
                    })),
                    ..Default::default()
                };
                let hash = canon::content_hash(seq, &prev, &event).unwrap();
                let r = LogRecord {
                    seq,
                    prev_hash: prev.clone(),
                    content_hash: hash.clone(),
                    fence: 1,
                    event: Some(event),
                };
                prev = hash;
                r
            })
            .collect()
    }

    #[test]
    fn intact_chain_verifies() {
        assert_eq!(verify_chain(&chain(5)), Ok(5));
        assert_eq!(verify_chain(&[]), Ok(0));
    }

    #[test]
    fn fence_is_not_hashed() {
        let mut c = chain(3);
        c[1].fence = 99;
        assert_eq!(verify_chain(&c), Ok(3));
    }

    #[test]
    fn tampered_event_is_a_hash_mismatch_at_its_seq() {
        let mut c = chain(4);
        c[2].event.as_mut().unwrap().execution_id = "evil".into();
        let err = verify_chain(&c).unwrap_err();
        assert!(
            matches!(err, ChainError::HashMismatch { seq: 3, .. }),
            "{err}"
        );
    }

    #[test]
    fn rewritten_hash_breaks_the_next_link() {
        let mut c = chain(4);
        c[1].content_hash = "00".repeat(32);
        // seq 2's own hash no longer recomputes
        assert!(matches!(
            verify_chain(&c),
            Err(ChainError::HashMismatch { seq: 2, .. })
        ));
        let mut c = chain(4);
        c[2].prev_hash = "ab".into();
        assert!(matches!(
            verify_chain(&c),
            Err(ChainError::BrokenLink { seq: 3, .. })
        ));
    }

    #[test]
    fn gap_and_missing_genesis_are_reported() {
        let mut c = chain(4);
        c.remove(1);
        assert_eq!(
            verify_chain(&c),
            Err(ChainError::Gap {
                seq: 3,
                expected: 2
            })
        );
        let c = chain(3);
        assert!(matches!(
            verify_chain(&c[1..]),
            Err(ChainError::Gap {
                seq: 2,
                expected: 1
            })
        ));
    }
}
