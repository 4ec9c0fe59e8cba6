//! In-guest agent (PID 1): frame protocol and harness supervisor. Filled in by its own issue; this crate reserves its place in the workspace.
