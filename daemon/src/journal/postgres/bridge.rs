//! The journal trait is synchronous (sqlite answers in microseconds, in the caller's
//! thread); PostgreSQL is reached through an async client. The bridge runs that client on a
//! runtime of its own, so a caller on one of the daemon's runtime threads waits for its
//! answer on a channel, never by entering a second runtime from inside the first.

use std::future::Future;
use std::sync::mpsc;

use crate::journal::{JournalError, Result};

pub(super) struct Bridge {
    runtime: Option<tokio::runtime::Runtime>,
}

impl Bridge {
    pub(super) fn new() -> Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("journal-pg")
            .enable_all()
            .build()
            .map_err(|e| JournalError::Unavailable {
                context: "starting the journal's database runtime".into(),
                reason: e.to_string(),
            })?;
        Ok(Self {
            runtime: Some(runtime),
        })
    }

    fn runtime(&self) -> &tokio::runtime::Runtime {
        self.runtime
            .as_ref()
            .expect("the runtime lives until the bridge is dropped")
    }

    /// Runs `work` on the bridge's runtime and waits for its result.
    pub(super) fn run<T: Send + 'static>(
        &self,
        work: impl Future<Output = Result<T>> + Send + 'static,
    ) -> Result<T> {
        let (answer, answered) = mpsc::sync_channel(1);
        self.runtime().spawn(async move {
            let _ = answer.send(work.await);
        });
        answered.recv().unwrap_or_else(|_| {
            Err(JournalError::Unavailable {
                context: "the journal's database runtime".into(),
                reason: "it stopped before answering".into(),
            })
        })
    }

    /// For setting up what lives on the bridge's runtime (the connection pool).
    pub(super) fn enter(&self) -> tokio::runtime::EnterGuard<'_> {
        self.runtime().enter()
    }
}

impl Drop for Bridge {
    fn drop(&mut self) {
        // A runtime dropped in async context would panic; this one may be dropped anywhere.
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}
