//! Lifecycle intents: an operation records one in the journal before it acts and ends it once
//! it is done or rolled back. A daemon that dies in between leaves it open, and the next one
//! finishes or rolls back that operation before serving (`recovery`).

use std::sync::Arc;

use tonic::Status;

use super::SessionHost;
use crate::api::status::journal_status;
use crate::journal::{Journal, Operation, OperationKind};

/// An open intent; ended when dropped. A crash is the only way it stays open.
pub(super) struct Intent {
    journal: Arc<dyn Journal>,
    id: Option<i64>,
}

impl Intent {
    /// Nothing to recover from (the operation has nothing to act on).
    pub fn none(journal: Arc<dyn Journal>) -> Self {
        Self { journal, id: None }
    }
}

impl Drop for Intent {
    fn drop(&mut self) {
        if let Some(id) = self.id.take()
            && let Err(e) = self.journal.end_operation(id)
        {
            // Harmless: recovery of a finished operation finds nothing to do.
            tracing::warn!(operation = id, error = %e, "could not end an operation's intent");
        }
    }
}

impl SessionHost {
    pub(super) fn intend(
        &self,
        kind: OperationKind,
        session: &str,
        children: Vec<String>,
    ) -> Result<Intent, Status> {
        let id = self
            .journal
            .begin_operation(&Operation {
                kind,
                session: session.to_owned(),
                children,
            })
            .map_err(|e| journal_status(&e))?;
        Ok(Intent {
            journal: self.journal.clone(),
            id: Some(id),
        })
    }
}
