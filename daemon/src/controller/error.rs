//! Why a turn, a recovery or a replay did not complete, named after upstream's sentinels so
//! logs and tests can match them, with the gRPC code each maps to (semantics.md §3).

use tonic::Code;

use crate::journal::JournalError;
use crate::model::provider::ProviderError;

#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    #[error(transparent)]
    Journal(#[from] JournalError),
    /// I0/R1/R2/R3: the harness did not reproduce what the journal recorded.
    #[error("ReplayDiverged: {0}")]
    ReplayDiverged(String),
    #[error("InvalidExecutionLog: {0}")]
    InvalidExecutionLog(String),
    /// The trailing execution lacks inputs its EXECUTION_START promised (R5).
    #[error("IncompleteInvocation: {0}")]
    IncompleteInvocation(String),
    /// A fork child cannot re-drive a tool call its parent started (I3).
    #[error("InheritedToolIntent: tool call {0:?} was started by the parent session")]
    InheritedToolIntent(String),
    #[error("MissingIdempotencyKey: tool call {0:?} needs an idempotency_key")]
    MissingIdempotencyKey(String),
    #[error(
        "UnmediatedToolCall: tool call {0:?} has mediation {1}; the host runs only CONTROLLER_MEDIATED or REQUIRES_APPROVAL calls"
    )]
    UnmediatedToolCall(String, String),
    #[error("InvalidToolArgs: tool call {0:?}: {1}")]
    InvalidToolArgs(String, String),
    #[error("ApprovalUnavailable: {0}")]
    ApprovalUnavailable(String),
    #[error("InvalidApprovalCall: {0}")]
    InvalidApprovalCall(String),
    #[error(
        "ApprovalReceiptReport: a harness report may not carry approval receipt data (call {0:?})"
    )]
    ApprovalReceiptReport(String),
    #[error("MissingToolExecutor: no tool executor is configured for tool {0:?}")]
    MissingToolExecutor(String),
    #[error(
        "HarnessMismatch: the execution was recorded with harness {recorded:?}, this host serves {served:?}"
    )]
    HarnessMismatch { recorded: String, served: String },
    #[error(
        "HarnessVersionMismatch: the execution was recorded with version {recorded:?}, the harness reports {served:?}"
    )]
    HarnessVersionMismatch { recorded: String, served: String },
    /// The harness reported a failure (END with a state other than COMPLETED, or a stream error).
    #[error("harness failed: {0}")]
    HarnessFailed(String),
    #[error("harness protocol violation: {0}")]
    HarnessProtocol(String),
    #[error("harness unreachable: {0}")]
    HarnessUnavailable(String),
    /// The harness sent nothing for this long while the host waited on it.
    #[error("harness silent: no event for {0:?} while the host waited on it")]
    HarnessSilent(std::time::Duration),
    #[error("model call failed: {0}")]
    Model(#[from] ProviderError),
    #[error("tool executor failed: {0}")]
    Executor(String),
    #[error("execution cancelled: {0}")]
    Cancelled(String),
    /// A checkpoint (Suspend, memory fork) or a newer incarnation took the session over.
    #[error("execution superseded: {0}")]
    Superseded(String),
    #[error("execution deadline exceeded")]
    DeadlineExceeded,
    /// An input, or a turn's inputs together, over the limit every harness can carry.
    #[error("InputTooLarge: {0}")]
    InputTooLarge(String),
    /// The session's history with this turn's inputs would not fit the harness's Start.
    #[error("HistoryTooLarge: {0}")]
    HistoryTooLarge(String),
    #[error("SinkClosed: the execution already ended")]
    SinkClosed,
}

impl ControllerError {
    pub fn code(&self) -> Code {
        use ControllerError as E;
        match self {
            E::Journal(j) => match j {
                _ if j.is_disk_full() => Code::ResourceExhausted,
                JournalError::Conflict { .. } | JournalError::Fenced { .. } => Code::Aborted,
                JournalError::NotFound(_) => Code::NotFound,
                JournalError::CorruptRecord { .. } => Code::DataLoss,
                // A record the harness produced that does not canonicalize is not the caller's.
                _ => Code::Internal,
            },
            E::Superseded(_) => Code::Aborted,
            E::InvalidExecutionLog(_)
            | E::IncompleteInvocation(_)
            | E::InheritedToolIntent(_)
            | E::ApprovalUnavailable(_)
            | E::MissingToolExecutor(_)
            | E::HarnessMismatch { .. }
            | E::HarnessVersionMismatch { .. } => Code::FailedPrecondition,
            E::HarnessUnavailable(_) => Code::Unavailable,
            E::InputTooLarge(_) => Code::InvalidArgument,
            E::HistoryTooLarge(_) => Code::FailedPrecondition,
            E::Cancelled(_) => Code::Cancelled,
            E::DeadlineExceeded | E::HarnessSilent(_) => Code::DeadlineExceeded,
            E::ReplayDiverged(_)
            | E::MissingIdempotencyKey(_)
            | E::UnmediatedToolCall(..)
            | E::InvalidToolArgs(..)
            | E::InvalidApprovalCall(_)
            | E::ApprovalReceiptReport(_)
            | E::HarnessFailed(_)
            | E::HarnessProtocol(_)
            | E::Model(_)
            | E::Executor(_)
            | E::SinkClosed => Code::Internal,
        }
    }

    /// The host interrupted the turn itself (a newer writer, a checkpoint, Cancel): journaling
    /// an ERROR for it would blame the harness for what the host did.
    pub fn is_host_interruption(&self) -> bool {
        matches!(
            self,
            ControllerError::Superseded(_)
                | ControllerError::Cancelled(_)
                | ControllerError::Journal(JournalError::Fenced { .. })
                | ControllerError::Journal(JournalError::Conflict { .. })
        )
    }
}

impl From<ControllerError> for tonic::Status {
    fn from(e: ControllerError) -> Self {
        tonic::Status::new(e.code(), e.to_string())
    }
}
