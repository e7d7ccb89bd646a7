//! Refusing to run where KVM cannot run a stock kernel: `/dev/kvm` missing
//! or not ours to open, or backed by `kvm_pvm` (software) instead of VMX/SVM.

use std::path::Path;

/// Set to `1` to run under a software `/dev/kvm` anyway (experiments only).
pub const ALLOW_SOFTWARE_KVM_ENV: &str = "FORKBOX_ALLOW_SOFTWARE_KVM";

const HINT: &str =
    "run it inside forkbox's emulated host (`forkbox testbed run -- forkbox-vmm ...`), \
or use a host with VMX/SVM (bare metal or a cloud VM with nested virtualization)";

#[derive(Debug, thiserror::Error)]
pub enum HostError {
    #[error(
        "no hardware virtualization: this /dev/kvm is kvm_pvm, a software hypervisor under which a \
         stock kernel crawls and crashes; {HINT} (or set {ALLOW_SOFTWARE_KVM_ENV}=1 to try anyway)"
    )]
    SoftwareKvm,
    #[error(
        "no hardware virtualization: /proc/cpuinfo has neither the vmx nor the svm flag; {HINT} \
         (or set {ALLOW_SOFTWARE_KVM_ENV}=1 to try anyway)"
    )]
    NoVmxSvm,
    #[error("/dev/kvm does not exist: load kvm_intel or kvm_amd, or {HINT}")]
    NoDevKvm,
    #[error("permission denied opening /dev/kvm: run as a user in the `kvm` group (or as root)")]
    KvmAccess,
    #[error("cannot open /dev/kvm")]
    KvmOpen(#[source] std::io::Error),
    #[error("cannot read /proc/cpuinfo")]
    CpuInfo(#[source] std::io::Error),
}

/// What the host offers, as read from /sys and /proc.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostFacts {
    pub kvm_pvm_loaded: bool,
    pub cpu_has_vmx_or_svm: bool,
}

impl HostFacts {
    pub fn read() -> Result<Self, HostError> {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").map_err(HostError::CpuInfo)?;
        Ok(Self {
            kvm_pvm_loaded: Path::new("/sys/module/kvm_pvm").exists(),
            cpu_has_vmx_or_svm: cpuinfo_has_virt_flag(&cpuinfo),
        })
    }

    /// Decides whether a stock kernel can run here.
    pub fn check(&self) -> Result<(), HostError> {
        if self.kvm_pvm_loaded {
            return Err(HostError::SoftwareKvm);
        }
        if !self.cpu_has_vmx_or_svm {
            return Err(HostError::NoVmxSvm);
        }
        Ok(())
    }
}

/// True if any `flags` line of /proc/cpuinfo lists `vmx` or `svm`.
pub fn cpuinfo_has_virt_flag(cpuinfo: &str) -> bool {
    cpuinfo
        .lines()
        .filter_map(|l| l.split_once(':'))
        .filter(|(k, _)| k.trim() == "flags")
        .any(|(_, v)| v.split_whitespace().any(|f| f == "vmx" || f == "svm"))
}

/// Checks the host unless the bypass variable is set to `1`.
pub fn check_host() -> Result<(), HostError> {
    if std::env::var(ALLOW_SOFTWARE_KVM_ENV).as_deref() == Ok("1") {
        tracing::warn!("{ALLOW_SOFTWARE_KVM_ENV}=1: skipping the hardware virtualization check");
        return Ok(());
    }
    HostFacts::read()?.check()
}

/// Translates a failure to open /dev/kvm.
pub fn kvm_open_error(errno: i32) -> HostError {
    match errno {
        libc::ENOENT => HostError::NoDevKvm,
        libc::EACCES | libc::EPERM => HostError::KvmAccess,
        e => HostError::KvmOpen(std::io::Error::from_raw_os_error(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpuinfo_svm_flag_detected() {
        let info = "processor\t: 0\nflags\t\t: fpu vme svm lm\n";
        assert!(cpuinfo_has_virt_flag(info));
    }

    #[test]
    fn cpuinfo_without_flags_not_detected() {
        let info = "processor\t: 0\nflags\t\t: fpu vme lm svmx\nbugs\t\t: vmx\n";
        assert!(!cpuinfo_has_virt_flag(info));
    }

    #[test]
    fn check_kvm_pvm_refused_even_with_vmx() {
        let facts = HostFacts {
            kvm_pvm_loaded: true,
            cpu_has_vmx_or_svm: true,
        };
        let err = facts.check().expect_err("kvm_pvm must be refused");
        assert!(matches!(err, HostError::SoftwareKvm));
        assert!(err.to_string().contains("forkbox testbed run"));
    }

    #[test]
    fn check_no_flags_refused() {
        let facts = HostFacts {
            kvm_pvm_loaded: false,
            cpu_has_vmx_or_svm: false,
        };
        assert!(matches!(facts.check(), Err(HostError::NoVmxSvm)));
    }

    #[test]
    fn open_error_enoent_and_eacces_explained() {
        assert!(matches!(kvm_open_error(libc::ENOENT), HostError::NoDevKvm));
        assert!(matches!(kvm_open_error(libc::EACCES), HostError::KvmAccess));
    }
}
