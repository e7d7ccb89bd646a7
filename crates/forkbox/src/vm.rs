//! One microVM, seen from the host: the assets it boots from, the
//! `forkbox-vmm` process that runs it, and the agent client that talks to
//! its guest.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use forkbox_proto::client::{AgentClient, ClientError};
use forkbox_proto::AGENT_PORT;

use crate::image::{self, ImageError, ImageName};
use crate::initramfs::{self, InitramfsError};
use crate::kernel::{Kernel, KernelError};
use crate::testbed;

/// The guest kernel's command line. `panic=-1` turns a panic into an
/// immediate reset that the VMM reports; `pci=off` skips probing a bus the
/// VM does not have; `quiet` keeps the (slow, emulated) serial port idle.
pub const GUEST_CMDLINE: &str =
    "console=ttyS0 reboot=k panic=-1 pci=off quiet forkbox.root=/dev/vda forkbox.rootfstype=ext4";

/// `forkbox-vmm` exit codes (its command-line contract).
pub mod vmm_exit {
    pub const POWERED_OFF: i32 = 0;
    pub const ERROR: i32 = 1;
    pub const REBOOTED: i32 = 2;
    pub const PANICKED: i32 = 3;
}

#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error("preparing the guest kernel")]
    Kernel(#[from] KernelError),
    #[error("building the guest initramfs")]
    Initramfs(#[from] InitramfsError),
    #[error("building the guest image")]
    Image(#[from] ImageError),
    #[error("cannot find {name}: build it with `make build` (looked in: {looked})")]
    MissingBinary { name: &'static str, looked: String },
    #[error("cannot start forkbox-vmm")]
    Spawn(#[source] std::io::Error),
    #[error("the VM stopped during boot ({how})\n--- serial log (tail) ---\n{serial_tail}")]
    DiedDuringBoot { how: String, serial_tail: String },
    #[error("the guest agent did not become ready within {secs} s\n--- serial log (tail) ---\n{serial_tail}")]
    NeverReady { secs: u64, serial_tail: String },
    #[error("the guest agent refused the handshake")]
    Handshake(#[source] ClientError),
    #[error("VM working directory")]
    Io(#[source] std::io::Error),
}

/// How big a VM is and what it boots.
#[derive(Debug, Clone)]
pub struct VmSpec {
    pub image: ImageName,
    pub vcpus: u8,
    pub memory_mib: u32,
    /// Copy the guest's serial console to our stderr as well as the log.
    pub serial_to_stderr: bool,
    pub boot_timeout: Duration,
}

impl Default for VmSpec {
    fn default() -> Self {
        Self {
            image: ImageName::Minimal,
            vcpus: 1,
            memory_mib: 512,
            serial_to_stderr: false,
            boot_timeout: Duration::from_secs(120),
        }
    }
}

/// Everything a boot needs besides the image: kernel, initramfs, VMM.
#[derive(Debug, Clone)]
pub struct Assets {
    pub kernel: Kernel,
    pub initramfs: PathBuf,
    pub vmm: PathBuf,
}

impl Assets {
    /// Fetches or builds (once, cached) the guest kernel and initramfs and
    /// finds the `forkbox-vmm` and `forkbox-agent` binaries.
    pub fn prepare() -> Result<Self, VmError> {
        let kernel = Kernel::guest()?;
        let agent = find_binary("forkbox-agent", "FORKBOX_AGENT")?;
        let initramfs = initramfs::guest(&kernel, &agent)?;
        let vmm = find_binary("forkbox-vmm", "FORKBOX_VMM")?;
        Ok(Self {
            kernel,
            initramfs,
            vmm,
        })
    }
}

/// Where the build puts forkbox's binaries, nearest first: next to the
/// running program (or its parent, for test binaries in `deps/`), and the
/// static agent's own target directory.
fn find_binary(name: &'static str, env: &str) -> Result<PathBuf, VmError> {
    if let Some(p) = std::env::var_os(env) {
        return Ok(PathBuf::from(p));
    }
    let mut looked = Vec::new();
    if let Some(dir) = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(Path::to_owned))
    {
        let mut candidates = Vec::new();
        for d in [Some(dir.as_path()), dir.parent()].into_iter().flatten() {
            if name == "forkbox-agent" {
                // target/<profile>/ → target/x86_64-unknown-linux-gnu/release/
                if let Some(target) = d.parent() {
                    candidates.push(target.join("x86_64-unknown-linux-gnu/release").join(name));
                }
            } else {
                candidates.push(d.join(name));
            }
        }
        for c in candidates {
            if c.is_file() {
                return Ok(c);
            }
            looked.push(c.display().to_string());
        }
    }
    Err(VmError::MissingBinary {
        name,
        looked: looked.join(", "),
    })
}

/// A running microVM. Dropping it kills the VMM.
pub struct Vm {
    child: Child,
    dir: tempfile::TempDir,
    agent: AgentClient,
    /// From spawning the VMM to the agent's handshake.
    pub boot_time: Duration,
}

impl Vm {
    pub fn boot(assets: &Assets, spec: &VmSpec) -> Result<Self, VmError> {
        let image = image::ensure(spec.image)?;
        Self::boot_image(assets, &image, spec)
    }

    /// Boots `image` (an ext4 root image) and waits for the agent.
    pub fn boot_image(assets: &Assets, image: &Path, spec: &VmSpec) -> Result<Self, VmError> {
        let dir = tempfile::Builder::new()
            .prefix("forkbox-vm-")
            .tempdir()
            .map_err(VmError::Io)?;
        let vsock = dir.path().join("vsock.sock");
        let serial = dir.path().join("serial.log");
        let mut cmd = Command::new(&assets.vmm);
        cmd.arg("--kernel")
            .arg(&assets.kernel.vmlinuz)
            .arg("--initramfs")
            .arg(&assets.initramfs)
            .args(["--cmdline", GUEST_CMDLINE])
            .args(["--vcpus", &spec.vcpus.to_string()])
            .args(["--memory-mib", &spec.memory_mib.to_string()])
            .arg("--disk")
            .arg(image)
            .arg("--vsock-uds")
            .arg(&vsock)
            .arg("--serial-log")
            .arg(&serial)
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        if spec.serial_to_stderr {
            cmd.arg("--serial-stdout");
        }
        let start = Instant::now();
        let mut child = cmd.spawn().map_err(VmError::Spawn)?;
        let agent = AgentClient::hybrid_vsock(&vsock, AGENT_PORT);
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(VmError::DiedDuringBoot {
                    how: describe_exit(status),
                    serial_tail: testbed::tail(&serial, 30),
                });
            }
            if start.elapsed() > spec.boot_timeout {
                let _ = child.kill();
                let _ = child.wait();
                return Err(VmError::NeverReady {
                    secs: spec.boot_timeout.as_secs(),
                    serial_tail: testbed::tail(&serial, 30),
                });
            }
            if vsock.exists() {
                match agent.wait_ready(Duration::from_millis(500)) {
                    Ok(_) => break,
                    Err(e @ ClientError::VersionMismatch { .. }) => {
                        let _ = child.kill();
                        let _ = child.wait();
                        return Err(VmError::Handshake(e));
                    }
                    Err(_) => {}
                }
            } else {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        Ok(Self {
            child,
            dir,
            agent,
            boot_time: start.elapsed(),
        })
    }

    pub fn agent(&self) -> &AgentClient {
        &self.agent
    }

    /// The last `lines` lines the guest wrote to its serial console.
    pub fn serial_tail(&self, lines: usize) -> String {
        testbed::tail(&self.dir.path().join("serial.log"), lines)
    }

    /// The VMM's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits up to `timeout` for the VMM to exit by itself.
    pub fn wait_exit(&mut self, timeout: Duration) -> std::io::Result<Option<ExitStatus>> {
        let start = Instant::now();
        while start.elapsed() < timeout {
            if let Some(status) = self.child.try_wait()? {
                return Ok(Some(status));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(None)
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// "powered off", "kernel panic", "exit code 1", "killed by signal 9".
pub fn describe_exit(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(vmm_exit::POWERED_OFF), _) => "the guest powered off".into(),
        (Some(vmm_exit::REBOOTED), _) => "the guest rebooted".into(),
        (Some(vmm_exit::PANICKED), _) => "the guest kernel panicked".into(),
        (Some(vmm_exit::ERROR), _) => "forkbox-vmm failed; its error is above".into(),
        (Some(code), _) => format!("forkbox-vmm exited with code {code}"),
        (None, Some(sig)) => format!("forkbox-vmm was killed by signal {sig}"),
        (None, None) => "forkbox-vmm ended".into(),
    }
}
