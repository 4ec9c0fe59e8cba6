//! `state.json`: everything about a paused VM that is not guest RAM — vCPU registers and
//! MSRs, the in-kernel interrupt controllers, PIT and clock, and device state.
//!
//! KVM's structures are stored as base64 of their exact bytes (kvm-bindings' own
//! serialisation), and read back only if the length is exactly right: a truncated or padded
//! blob is an error, never a zero-filled register file. The schema version is this crate's
//! format version (manifest.json); unknown fields are refused.

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use serde::de::{DeserializeOwned, Error as _};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A KVM structure, serialised as base64 of its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Raw<T>(pub T);

fn bytes_of<T: Serialize>(value: &T) -> Result<Vec<u8>, String> {
    // kvm-bindings serialises its structures as their raw bytes; going through a JSON value
    // recovers exactly those bytes.
    let json = serde_json::to_value(value).map_err(|e| e.to_string())?;
    serde_json::from_value::<Vec<u8>>(json).map_err(|e| e.to_string())
}

impl<T: Serialize> Serialize for Raw<T> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let bytes = bytes_of(&self.0).map_err(serde::ser::Error::custom)?;
        serializer.serialize_str(&STANDARD.encode(bytes))
    }
}

impl<'de, T: DeserializeOwned> Deserialize<'de> for Raw<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        let bytes = STANDARD.decode(text.as_bytes()).map_err(D::Error::custom)?;
        let want = std::mem::size_of::<T>();
        if bytes.len() != want {
            return Err(D::Error::custom(format!(
                "{} is {want} bytes, the snapshot holds {}",
                std::any::type_name::<T>(),
                bytes.len()
            )));
        }
        let value = serde_json::to_value(&bytes).map_err(D::Error::custom)?;
        serde_json::from_value(value)
            .map(Raw)
            .map_err(D::Error::custom)
    }
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmState {
    pub vcpus: Vec<VcpuState>,
    pub pic_master: Raw<kvm_bindings::kvm_irqchip>,
    pub pic_slave: Raw<kvm_bindings::kvm_irqchip>,
    pub ioapic: Raw<kvm_bindings::kvm_irqchip>,
    pub pit: Raw<kvm_bindings::kvm_pit_state2>,
    pub clock: Raw<kvm_bindings::kvm_clock_data>,
    #[serde(default)]
    pub serial: Option<SerialState>,
    #[serde(default)]
    pub vsock: Option<VirtioMmioState>,
    /// The virtio-blk disks' transports, in config order. Their contents are files of their
    /// own, which the snapshot's owner keeps beside it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disks: Vec<VirtioMmioState>,
    /// The network devices' transports (their config space: the MAC), in config order. No
    /// connection state: a restored VM's device starts with no flows.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nets: Vec<VirtioMmioState>,
    /// Saved with its vsock streams open (a checkpoint: the VM went on running and kept
    /// them). A VM restored from it tells the guest every stream is gone before it runs.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub streams_live: bool,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VcpuState {
    pub id: u8,
    pub cpuid: Vec<Raw<kvm_bindings::kvm_cpuid_entry2>>,
    pub mp_state: Raw<kvm_bindings::kvm_mp_state>,
    pub regs: Raw<kvm_bindings::kvm_regs>,
    pub sregs: Raw<kvm_bindings::kvm_sregs>,
    /// XSAVE area (includes the FPU/SSE/AVX state); KVM_GET_XSAVE's fixed 4 KiB form.
    pub xsave: Raw<kvm_bindings::kvm_xsave>,
    pub xcrs: Raw<kvm_bindings::kvm_xcrs>,
    pub debugregs: Raw<kvm_bindings::kvm_debugregs>,
    pub lapic: Raw<kvm_bindings::kvm_lapic_state>,
    pub vcpu_events: Raw<kvm_bindings::kvm_vcpu_events>,
    /// (index, value) of every MSR KVM let us read.
    pub msrs: Vec<(u32, u64)>,
    /// TSC frequency the vCPU ran at; without TSC scaling a restore needs the same.
    #[serde(default)]
    pub tsc_khz: Option<u32>,
}

/// The 16550A's registers (vm-superio's state, by name).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SerialState {
    pub baud_divisor_low: u8,
    pub baud_divisor_high: u8,
    pub interrupt_enable: u8,
    pub interrupt_identification: u8,
    pub line_control: u8,
    pub line_status: u8,
    pub modem_control: u8,
    pub modem_status: u8,
    pub scratch: u8,
    pub in_buffer: Vec<u8>,
}

/// A virtio-mmio transport and its queues.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VirtioMmioState {
    pub status: u32,
    pub acked_features: u64,
    pub device_features_sel: u32,
    pub driver_features_sel: u32,
    pub queue_sel: u32,
    pub activated: bool,
    pub interrupt_status: u32,
    pub queues: Vec<QueueState>,
    /// Device-specific configuration (vsock: the guest CID).
    pub device_config: Vec<u8>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QueueState {
    pub max_size: u16,
    pub size: u16,
    pub ready: bool,
    pub desc_table: u64,
    pub avail_ring: u64,
    pub used_ring: u64,
    pub next_avail: u16,
    pub next_used: u16,
    pub event_idx_enabled: bool,
}

impl VmState {
    pub fn to_json(&self) -> Result<Vec<u8>, crate::SnapshotError> {
        serde_json::to_vec(self).map_err(|e| crate::SnapshotError::State(e.to_string()))
    }

    pub fn from_json(bytes: &[u8]) -> Result<Self, crate::SnapshotError> {
        serde_json::from_slice(bytes).map_err(|e| crate::SnapshotError::State(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvm_bindings::kvm_regs;

    #[test]
    fn raw_structures_round_trip_exactly() {
        let regs = kvm_regs {
            rip: 0x1234_5678_9abc,
            rflags: 2,
            r15: u64::MAX,
            ..Default::default()
        };
        let json = serde_json::to_string(&Raw(regs)).unwrap();
        let back: Raw<kvm_regs> = serde_json::from_str(&json).unwrap();
        assert_eq!(back.0, regs);
    }

    #[test]
    fn a_blob_of_the_wrong_length_is_refused() {
        let json = serde_json::to_string(&Raw(kvm_regs::default())).unwrap();
        let text: String = serde_json::from_str(&json).unwrap();
        let mut bytes = STANDARD.decode(text).unwrap();
        bytes.pop();
        let short = serde_json::to_string(&STANDARD.encode(&bytes)).unwrap();
        let err = serde_json::from_str::<Raw<kvm_regs>>(&short).unwrap_err();
        assert!(err.to_string().contains("bytes"), "{err}");
        assert!(serde_json::from_str::<Raw<kvm_regs>>("\"not base64!\"").is_err());
    }
}
