//! Snapshot directory format, manifest and digests. Filled in by its own issue; this crate reserves its place in the workspace.
