//! gRPC status codes for journal failures (semantics.md §3, common error mapping).

use tonic::{Code, Status};

use crate::journal::JournalError;

/// CAS conflicts and fencing are retryable (ABORTED); a missing session is NOT_FOUND; a
/// record that does not canonicalize is the caller's bad input; a full disk is
/// RESOURCE_EXHAUSTED (nothing was written; it clears when space does); a stored record that
/// no longer decodes is DATA_LOSS; the rest is INTERNAL.
pub fn journal_status(err: &JournalError) -> Status {
    if err.is_disk_full() {
        return Status::resource_exhausted(format!("the journal's disk is full: {err}"));
    }
    let code = match err {
        JournalError::Conflict { .. } | JournalError::Fenced { .. } => Code::Aborted,
        JournalError::NotFound(_) => Code::NotFound,
        JournalError::AlreadyExists(_) => Code::AlreadyExists,
        JournalError::Canon { .. } | JournalError::InvalidArgument(_) => Code::InvalidArgument,
        JournalError::CorruptRecord { .. } => Code::DataLoss,
        JournalError::Unavailable { .. } => Code::Unavailable,
        JournalError::HeldElsewhere { .. } => Code::FailedPrecondition,
        JournalError::SchemaTooNew { .. }
        | JournalError::Storage { .. }
        | JournalError::Postgres { .. } => Code::Internal,
    };
    Status::new(code, err.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retryable_errors_are_aborted() {
        let conflict = JournalError::Conflict {
            session: "s".into(),
            expected: 0,
            head: 3,
        };
        assert_eq!(journal_status(&conflict).code(), Code::Aborted);
        let fenced = JournalError::Fenced {
            session: "s".into(),
            fence: 1,
            current: 2,
        };
        assert_eq!(journal_status(&fenced).code(), Code::Aborted);
        let missing = JournalError::NotFound("sess-x".into());
        let st = journal_status(&missing);
        assert_eq!(st.code(), Code::NotFound);
        assert!(st.message().contains("sess-x"));
    }
}
