//! The hardware side: KVM VM and vCPUs, guest RAM, CPUID and the boot register state.

pub mod cpuid;
pub mod memory;
pub mod regs;
pub mod state;
pub mod vcpu;
pub mod vm;

/// Which KVM implementation serves /dev/kvm. Snapshots taken under one cannot be restored
/// under another, and only PVM-enabled guest kernels run at speed on PVM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavour {
    /// kvm_pvm: a software hypervisor running the guest kernel at CPL3 (no VT-x/AMD-V).
    Pvm,
    Vmx,
    Svm,
}

impl Flavour {
    pub fn detect() -> Self {
        if std::path::Path::new("/sys/module/kvm_pvm").exists() {
            return Self::Pvm;
        }
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let has_flag = |flag: &str| {
            cpuinfo
                .lines()
                .filter(|l| l.starts_with("flags"))
                .any(|l| l.split_whitespace().any(|w| w == flag))
        };
        if has_flag("vmx") {
            Self::Vmx
        } else if has_flag("svm") {
            Self::Svm
        } else {
            Self::Pvm
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Pvm => "PVM",
            Self::Vmx => "VMX",
            Self::Svm => "SVM",
        }
    }
}
