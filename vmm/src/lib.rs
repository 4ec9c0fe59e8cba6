//! KVM microVM monitor behind the Cloud Hypervisor REST API. Filled in by its own issue; this crate reserves its place in the workspace.
