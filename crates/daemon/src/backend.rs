//! Between the daemon and its VMs: the [`Backend`] trait, and
//! [`VmBackend`], its implementation on `forkbox::vm` (one `forkbox-vmm`
//! process per sandbox).
//!
//! Every method here blocks (boots take seconds); the service calls them on
//! `tokio::task::spawn_blocking`.

use std::sync::Mutex;
use std::time::Duration;

use forkbox::image::ImageName;
use forkbox::vm::{Assets, Vm, VmError, VmSpec};
use forkbox_proto::client::AgentClient;

/// What a VM boots: the part of a template the backend needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MachineSpec {
    pub image: ImageName,
    pub vcpus: u8,
    pub memory_mib: u32,
    pub boot_timeout: Duration,
}

/// Why the backend failed: always the infrastructure's fault, never the
/// user's command.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("preparing the guest assets")]
    Assets(#[source] VmError),
    #[error("booting the microVM")]
    Boot(#[source] VmError),
    #[error("{0} is not supported by this backend yet")]
    Unsupported(&'static str),
}

/// Makes VMs.
pub trait Backend: Send + Sync + 'static {
    /// Boots a fresh VM and waits for its agent. Blocking.
    fn boot(&self, spec: &MachineSpec) -> Result<Box<dyn Machine>, BackendError>;
}

/// One running VM. Dropping it stops the VM (blocking: call drop off the
/// async runtime).
pub trait Machine: Send + Sync {
    /// A client for its guest agent (cheap; one connection per call).
    fn agent(&self) -> AgentClient;
    /// The VMM's process id, if it is a process.
    fn pid(&self) -> Option<u32>;
    /// Whether the VM still runs. `Some(reason)` once it ended by itself.
    fn exited(&self) -> Option<String>;
    /// How long its boot took, spawn to agent handshake.
    fn boot_time(&self) -> Duration;
    /// Stop the vCPUs in place.
    fn pause(&self) -> Result<(), BackendError>;
    fn resume(&self) -> Result<(), BackendError>;
}

/// The real thing: `forkbox::vm::Vm`.
pub struct VmBackend {
    assets: Assets,
}

impl VmBackend {
    /// Finds the kernel, initramfs and VMM (built once, cached).
    pub fn new() -> Result<Self, BackendError> {
        Ok(Self {
            assets: Assets::prepare().map_err(BackendError::Assets)?,
        })
    }
}

impl Backend for VmBackend {
    fn boot(&self, spec: &MachineSpec) -> Result<Box<dyn Machine>, BackendError> {
        let vm_spec = VmSpec {
            image: spec.image,
            vcpus: spec.vcpus,
            memory_mib: spec.memory_mib,
            serial_to_stderr: false,
            boot_timeout: spec.boot_timeout,
        };
        let vm = Vm::boot(&self.assets, &vm_spec).map_err(BackendError::Boot)?;
        Ok(Box::new(VmMachine {
            agent: vm.agent().clone(),
            pid: vm.pid(),
            boot_time: vm.boot_time,
            vm: Mutex::new(vm),
        }))
    }
}

struct VmMachine {
    vm: Mutex<Vm>,
    agent: AgentClient,
    pid: u32,
    boot_time: Duration,
}

impl Machine for VmMachine {
    fn agent(&self) -> AgentClient {
        self.agent.clone()
    }

    fn pid(&self) -> Option<u32> {
        Some(self.pid)
    }

    fn exited(&self) -> Option<String> {
        let mut vm = self.vm.lock().unwrap_or_else(|p| p.into_inner());
        match vm.wait_exit(Duration::ZERO) {
            Ok(Some(status)) => Some(forkbox::vm::describe_exit(status)),
            Ok(None) => None,
            Err(e) => Some(format!("cannot wait for forkbox-vmm: {e}")),
        }
    }

    fn boot_time(&self) -> Duration {
        self.boot_time
    }

    // `Vm::pause`/`resume` are being added to forkbox::vm by the fork work;
    // until they land the API answers 501 for pause, resume and fork.
    fn pause(&self) -> Result<(), BackendError> {
        Err(BackendError::Unsupported("pause"))
    }

    fn resume(&self) -> Result<(), BackendError> {
        Err(BackendError::Unsupported("resume"))
    }
}

/// Resident memory of a process in KiB (`VmRSS`), if readable.
pub fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// CPU time (user + system) of a process, if readable.
pub fn cpu_time(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which is in parentheses and may
    // contain spaces.
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let utime: u64 = f.get(11)?.parse().ok()?;
    let stime: u64 = f.get(12)?.parse().ok()?;
    // In USER_HZ clock ticks, which Linux fixes at 100 on x86.
    Some(Duration::from_millis((utime + stime) * 10))
}

/// A backend for tests without KVM.
#[cfg(test)]
pub(crate) mod fake {
    use std::sync::atomic::{AtomicUsize, Ordering::Relaxed as ORD};
    use std::sync::Arc;
    use std::time::Duration;

    use forkbox_proto::client::AgentClient;

    use super::{Backend, BackendError, Machine, MachineSpec};

    /// VMs that boot instantly (or fail to), with no agent behind them.
    #[derive(Default)]
    pub struct Fake {
        pub fail: bool,
        pub alive: Arc<AtomicUsize>,
    }

    struct FakeMachine {
        alive: Arc<AtomicUsize>,
    }

    impl Backend for Fake {
        fn boot(&self, _: &MachineSpec) -> Result<Box<dyn Machine>, BackendError> {
            if self.fail {
                return Err(BackendError::Unsupported("booting in this test"));
            }
            self.alive.fetch_add(1, ORD);
            Ok(Box::new(FakeMachine {
                alive: self.alive.clone(),
            }))
        }
    }

    impl Drop for FakeMachine {
        fn drop(&mut self) {
            self.alive.fetch_sub(1, ORD);
        }
    }

    impl Machine for FakeMachine {
        fn agent(&self) -> AgentClient {
            AgentClient::unix("/nonexistent/forkbox-test.sock")
        }
        fn pid(&self) -> Option<u32> {
            None
        }
        fn exited(&self) -> Option<String> {
            None
        }
        fn boot_time(&self) -> Duration {
            Duration::ZERO
        }
        fn pause(&self) -> Result<(), BackendError> {
            Err(BackendError::Unsupported("pause"))
        }
        fn resume(&self) -> Result<(), BackendError> {
            Err(BackendError::Unsupported("resume"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rss_kib_of_self_is_positive() {
        assert!(rss_kib(std::process::id()).is_some_and(|k| k > 0));
    }

    #[test]
    fn cpu_time_of_self_is_readable() {
        assert!(cpu_time(std::process::id()).is_some());
    }
}
