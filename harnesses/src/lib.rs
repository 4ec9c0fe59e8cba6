//! Reference agentsessions harnesses (echo, counter, chat). Filled in by its own issue; this crate reserves its place in the workspace.
