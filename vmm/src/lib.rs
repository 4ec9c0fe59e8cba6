//! agentvm-vmm: one KVM microVM per process, driven through the Cloud Hypervisor REST API.
//!
//! Layout follows the kind of state: `kvm/` is the hardware (VM, vCPUs, RAM, registers),
//! `boot/` what the guest finds in memory at its first instruction, `devices/` what it can
//! talk to, `vm` assembles one VM from a spec.

pub mod api;
pub mod boot;
pub mod devices;
pub mod event_loop;
pub mod exit;
pub mod kvm;
pub mod seccomp;
pub mod vm;
