//! forkbox-vmm: one process per microVM, built on rust-vmm crates.
//!
//! Its contract with callers (the control protocol, exit codes, limits of a
//! VM's shape) is `forkbox-vmm-api`'s.
//!
//! Owns booting a stock Debian kernel on KVM (x86_64) and running it to a
//! typed end ([`VmExit`]). Devices beyond COM1 come from `forkbox-devices`;
//! this crate must not be depended on by it (the direction is vmm → devices).
//!
//! Module map:
//! - [`cli`]: the command-line contract, parsed into an [`cli::Invocation`].
//! - [`host`]: refuses software-only `/dev/kvm` (kvm_pvm) and explains why.
//! - [`layout`]: guest-physical layout, MMIO hole, e820 (pure).
//! - [`memory`]: memfd-backed guest RAM and its KVM slots (unsafe lives here).
//! - [`boot`]: bzImage, initramfs, command line, zero page, page tables, GDT.
//! - [`cpu`]: CPUID patching, boot MSRs, LAPIC LINT pins, 64-bit registers.
//! - [`acpi`]: RSDP/XSDT/FADT/DSDT/MADT via `acpi_tables` (pure).
//! - [`serial`]: COM1 output: log file, 64 KiB tail, optional stderr echo.
//! - [`pio`]: the port I/O bus (COM1, i8042 reset, ACPI sleep/reset, PCI).
//! - [`virtio`]: virtio-mmio windows, MMIO dispatch, queue ioeventfds.
//! - [`net`]: the guest network's host side: `forkbox-net`'s gateway as
//!   the virtio-net backend, its connector (broker or loopback) and log.
//! - [`sandbox_gateway`]: `forkbox-vmm gateway`, the same gateway for a
//!   sandbox that is not a microVM (gVisor), fed frames over a socket.
//! - [`state`]: the captured VM state (versioned, serde) and the KVM ioctls
//!   that capture and apply it.
//! - [`control`]: the control socket's line framing (sans-IO); its requests
//!   and answers are `forkbox-vmm-api`'s.
//! - [`counters`]: what the VMM counts (exits, control requests, network
//!   frames) for the `status` answer.
//! - [`vcpu`]: vCPU threads; parking them at a safe point for capture.
//! - [`fork`]: `fork()`, the child's break from inherited fds, readiness.
//! - [`mounts`]: the VMM's own root (a mount namespace and `pivot_root`):
//!   `/proc` and its inputs (kernel, initramfs, disks, or the snapshot
//!   restored), read-only, and nothing else: no VM's directory, its own
//!   included (what it writes is opened before it enters, or, for a fork
//!   child, sent opened by the host with the fork request).
//! - [`opened`]: `/dev/kvm` and the disk images, opened once as the
//!   daemon's user and used again by fork children (which run as the
//!   VMM's own).
//! - [`lockdown`]: what the process gives up before its guest runs: its
//!   privileges, and every system call outside each thread's seccomp filter.
//! - [`vm`]: boots or restores the VM (`vm/mod.rs`); its submodules run
//!   the epoll loop (`event_loop`), serve the control socket
//!   (`control_server`), pause, capture and write snapshots (`snapshot`),
//!   and fork (`forking`).
//!
//! Testing: unit tests beside the code need no KVM. The tests that boot
//! real VMs (exit codes for power-off, reboot and panic among them) live in
//! `crates/forkbox/tests/vm/`, which runs them inside the emulated host
//! where this machine has no hardware virtualization; none skip.

use std::path::PathBuf;

use forkbox_vmm_api::exit_code;

pub mod acpi;
pub mod boot;
pub mod cli;
pub mod control;
pub mod counters;
pub mod cpu;
pub mod fork;
pub mod host;
pub mod layout;
pub mod lockdown;
pub mod memory;
pub mod mounts;
pub mod namespaces;
pub mod net;
pub mod opened;
pub mod pio;
pub mod prefault;
pub mod sandbox_gateway;
pub mod serial;
pub mod state;
pub mod vcpu;
pub mod virtio;
pub mod vm;

pub use pio::ResetCause;
pub use serial::Echo;
pub use vm::{run, run_restore, Endpoints, Opened, VmError};

/// How a VM ended, as decided by the guest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VmExit {
    PowerOff,
    Reset { cause: ResetCause },
    Panic { line: String },
}

impl VmExit {
    /// The process exit status for this end.
    pub fn code(&self) -> i32 {
        match self {
            VmExit::PowerOff => exit_code::POWER_OFF,
            VmExit::Reset { .. } => exit_code::RESET,
            VmExit::Panic { .. } => exit_code::PANIC,
        }
    }

    /// This end as the VMM notes it for its owner.
    pub fn end(&self) -> forkbox_vmm_api::End {
        use forkbox_vmm_api::End;
        match self {
            VmExit::PowerOff => End::PowerOff,
            VmExit::Reset {
                cause: ResetCause::TripleFault,
            } => End::TripleFault,
            VmExit::Reset { .. } => End::Reboot,
            VmExit::Panic { .. } => End::Panic,
        }
    }
}

impl std::fmt::Display for VmExit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            VmExit::PowerOff => write!(f, "guest powered off"),
            VmExit::Reset { cause } => {
                let how = match cause {
                    ResetCause::Keyboard => "i8042 reset",
                    ResetCause::Acpi => "ACPI reset register",
                    ResetCause::TripleFault => "triple fault or KVM reset",
                };
                write!(f, "guest reset ({how})")
            }
            VmExit::Panic { line } => write!(f, "guest kernel panicked: {line}"),
        }
    }
}

/// Everything needed to build and run one VM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmConfig {
    pub kernel: PathBuf,
    pub initramfs: PathBuf,
    pub cmdline: String,
    pub vcpus: u8,
    pub memory_mib: u64,
    /// An image's layers, bottom first: one disk (the first, vda) with a
    /// partition per layer (`virtio::disk::Disk::layered`).
    pub layers: Vec<PathBuf>,
    pub disks: Vec<PathBuf>,
    /// Writable disks' golden bases.
    pub writable: Vec<PathBuf>,
    /// Their tops, one each (opened and unlinked by [`Endpoints::open`]).
    pub writable_tops: Vec<PathBuf>,
    pub vsock_uds: Option<PathBuf>,
    pub serial_log: Option<PathBuf>,
    pub echo: Echo,
    /// The control socket (pause, resume, fork, zygote, snapshot).
    pub control: Option<PathBuf>,
    /// A virtio-net device behind the userspace gateway (opt-in).
    pub net: Option<net::NetConfig>,
}

impl VmConfig {
    /// The virtio devices in window order: the layered disk, then the
    /// disks (vda, vdb, ...), then vsock, then net.
    pub fn devices(&self) -> Vec<virtio::DeviceSpec> {
        let layers = (!self.layers.is_empty()).then(|| self.layers.clone());
        layers
            .map(virtio::DeviceSpec::Layers)
            .into_iter()
            .chain(self.disks.iter().cloned().map(virtio::DeviceSpec::Block))
            .chain((0..self.writable.len()).map(virtio::DeviceSpec::Writable))
            .chain(
                self.vsock_uds
                    .clone()
                    .map(|uds| virtio::DeviceSpec::Vsock { uds }),
            )
            .chain(self.net.clone().map(virtio::DeviceSpec::Net))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_match_contract() {
        assert_eq!(VmExit::PowerOff.code(), 0);
        assert_eq!(
            VmExit::Reset {
                cause: ResetCause::TripleFault
            }
            .code(),
            2
        );
        assert_eq!(VmExit::Panic { line: "x".into() }.code(), 3);
    }

    #[test]
    fn exit_panic_display_includes_line() {
        let e = VmExit::Panic {
            line: "Kernel panic - not syncing: boom".into(),
        };
        assert_eq!(
            e.to_string(),
            "guest kernel panicked: Kernel panic - not syncing: boom"
        );
    }
}
