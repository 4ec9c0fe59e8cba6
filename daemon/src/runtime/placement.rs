//! CanPlace: whether a runtime can host a harness, checked on every Exec, Resume and Fork
//! before anything is created or journaled.
//!
//! Upstream checks one rule (a memory-snapshot harness needs memory snapshots). We also refuse
//! a GPU harness on a runtime without GPU state, which upstream declares but never checks.

use agentvm_proto::v1::{Capabilities, Resumability, RuntimeCapabilities};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementRefusal {
    #[error(
        "harness requires memory snapshots (REQUIRES_MEMORY_SNAPSHOT) but runtime {runtime} cannot take them"
    )]
    NeedsMemorySnapshot { runtime: String },
    #[error("harness requires a GPU but runtime {runtime} has no GPU state")]
    NeedsGpu { runtime: String },
}

pub fn can_place(
    harness: &Capabilities,
    runtime_name: &str,
    runtime: &RuntimeCapabilities,
) -> Result<(), PlacementRefusal> {
    if harness.resumability == Resumability::RequiresMemorySnapshot as i32
        && !runtime.memory_snapshot
    {
        return Err(PlacementRefusal::NeedsMemorySnapshot {
            runtime: runtime_name.to_owned(),
        });
    }
    if harness.requires_gpu && !runtime.gpu_state {
        return Err(PlacementRefusal::NeedsGpu {
            runtime: runtime_name.to_owned(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn harness(resumability: Resumability) -> Capabilities {
        Capabilities {
            resumability: resumability as i32,
            ..Default::default()
        }
    }

    /// Scenario 29, CanPlace matrix: stateless on a process ✓, memory on a process ✗,
    /// memory on a microVM ✓.
    #[test]
    fn scenario_29_can_place_matrix() {
        let process = RuntimeCapabilities::default();
        let microvm = RuntimeCapabilities {
            memory_snapshot: true,
            cow_fork: true,
            ..Default::default()
        };
        let stateless = harness(Resumability::StatelessReplay);
        let memory = harness(Resumability::RequiresMemorySnapshot);
        assert_eq!(can_place(&stateless, "process", &process), Ok(()));
        assert_eq!(
            can_place(&memory, "process", &process),
            Err(PlacementRefusal::NeedsMemorySnapshot {
                runtime: "process".into()
            })
        );
        assert_eq!(can_place(&memory, "microvm", &microvm), Ok(()));
        assert_eq!(can_place(&stateless, "microvm", &microvm), Ok(()));
        // An unspecified resumability is the default tier, STATELESS_REPLAY.
        assert_eq!(
            can_place(&harness(Resumability::Unspecified), "process", &process),
            Ok(())
        );
    }

    #[test]
    fn gpu_harness_needs_gpu_state() {
        let gpu = Capabilities {
            requires_gpu: true,
            ..harness(Resumability::StatelessReplay)
        };
        let plain = RuntimeCapabilities::default();
        assert!(matches!(
            can_place(&gpu, "microvm", &plain),
            Err(PlacementRefusal::NeedsGpu { .. })
        ));
        let with_gpu = RuntimeCapabilities {
            gpu_state: true,
            ..Default::default()
        };
        assert_eq!(can_place(&gpu, "microvm", &with_gpu), Ok(()));
    }
}
