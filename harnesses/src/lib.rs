//! The harness side of `agentsessions.v1.Harness`: a small SDK that turns one `Connect` stream
//! into typed sink calls ([`sdk`]), a tonic server adapter ([`server`]), and the reference
//! harnesses `echo`, `counter` and `chat` (semantics.md §5).

#![forbid(unsafe_code)]

pub mod chat;
pub mod counter;
pub mod echo;
pub mod sdk;
pub mod server;
pub mod text;

pub use sdk::{Execution, Harness, HarnessFailure, Sink, SinkError};

/// The reference harnesses by their registry names.
pub fn builtin(name: &str) -> Option<std::sync::Arc<dyn Harness>> {
    use std::sync::Arc;
    Some(match name {
        "echo" => Arc::new(echo::Echo),
        "counter" => Arc::new(counter::Counter::default()),
        "chat" => Arc::new(chat::Chat),
        _ => return None,
    })
}
