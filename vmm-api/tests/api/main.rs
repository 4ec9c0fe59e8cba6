//! Behaviour of the API server and client, end to end over unix sockets in a tempdir, against
//! a fake backend that follows Cloud Hypervisor's state machine (vmm-api.md §1.2).

mod client;
mod endpoints;
mod net;
mod requests;
mod robustness;
mod socket;
mod support;
