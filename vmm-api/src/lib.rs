//! The Cloud Hypervisor REST subset: plain config types with validation, the HTTP server glue and the client.
