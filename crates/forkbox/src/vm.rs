//! One microVM, seen from the host: the assets it boots from, the
//! `forkbox-vmm` process that runs it, its control socket, and the agent
//! client that talks to its guest.
//!
//! Fork: `Vm::fork` asks the VMM to fork itself into N children (each a
//! new process forked *from the VMM*, so not our child: this process makes
//! itself a child subreaper so that orphaned child VMMs are reparented to
//! it, and tracks each by pidfd). Before a child `Vm` is handed out, the
//! host sends its agent `AfterFork` (host time + 64 bytes from the OS RNG),
//! so no command ever runs in a child before its clock is set and its RNG
//! reseeded. `Vm::restore` does the same for a snapshot.

use std::os::fd::OwnedFd;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use forkbox_net::log::{read_json_lines, EgressRecord, ReadLogError};
use forkbox_net::policy::Policy;
use forkbox_proto::client::{AgentClient, ClientError};
use forkbox_proto::{AfterForkReport, AGENT_PORT, MIN_AFTER_FORK_ENTROPY};
use forkbox_vmm_api::{ChildResult, ChildSpec, ShapeError, Then, VmShape, MAX_CHILDREN_PER_FORK};
use rustix::process::{Pid, PidfdFlags, Signal, WaitOptions};

use crate::control::{Control, ControlError};
use crate::image::{self, ImageError, ImageName};
use crate::initramfs::{self, InitramfsError};
use crate::kernel::{Kernel, KernelError};
use crate::netbroker::{NetBroker, NetBrokerError};
use crate::testbed;

/// The guest kernel's command line. `panic=-1` turns a panic into an
/// immediate reset that the VMM reports; `pci=off` skips probing a bus the
/// VM does not have; `quiet` keeps the (slow, emulated) serial port idle.
pub const GUEST_CMDLINE: &str =
    "console=ttyS0 reboot=k panic=-1 pci=off quiet forkbox.root=/dev/vda forkbox.rootfstype=ext4";

/// `forkbox-vmm` exit codes (its command-line contract).
pub use forkbox_vmm_api::exit_code as vmm_exit;
pub use forkbox_vmm_api::{RunState, ZygoteMemory};

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
    DiedDuringBoot {
        how: String,
        serial_tail: String,
        /// The VMM's exit code, if it exited rather than was killed.
        code: Option<i32>,
    },
    #[error("the guest agent did not become ready within {secs} s\n--- vCPUs ---\n{vcpus}\n--- serial log (tail) ---\n{serial_tail}")]
    NeverReady {
        secs: u64,
        /// Where each vCPU was (`Control::vcpus`).
        vcpus: String,
        serial_tail: String,
    },
    #[error("the guest agent refused the handshake")]
    Handshake(#[source] ClientError),
    #[error("VM working directory")]
    Io(#[source] std::io::Error),
    #[error("VMM control")]
    Control(#[from] ControlError),
    #[error("cannot become a child subreaper (needed to reap forked VMMs)")]
    Subreaper(#[source] std::io::Error),
    #[error("the VMM could not fork child {index}: {error}")]
    ForkChild { index: usize, error: String },
    #[error("a fork child was lost twice: first {first}; then its replacement: {error}")]
    ForkChildLost { first: String, error: String },
    #[error("fork child {pid} is gone (pidfd_open)")]
    ChildGone {
        pid: u32,
        #[source]
        source: std::io::Error,
    },
    #[error("the VMM (pid {pid}) died before its agent answered AfterFork\n--- serial log (tail) ---\n{serial_tail}")]
    DiedBeforeAfterFork { pid: u32, serial_tail: String },
    #[error("the agent of VMM {pid} did not answer AfterFork within {secs} s\n--- vCPUs ---\n{vcpus}\n--- serial log (tail) ---\n{serial_tail}")]
    AfterForkTimeout {
        pid: u32,
        secs: u64,
        /// Where each vCPU was (`Control::vcpus`).
        vcpus: String,
        serial_tail: String,
    },
    #[error("the agent of VMM {pid} failed AfterFork")]
    AfterFork {
        pid: u32,
        #[source]
        source: ClientError,
    },
    #[error("reading host entropy")]
    Entropy(#[source] std::io::Error),
    #[error("starting the network broker")]
    NetBroker(#[from] NetBrokerError),
    #[error("this VM has no network")]
    NoNetwork,
    #[error("reading the egress log")]
    EgressLog(#[source] ReadLogError),
    #[error("the VMM at {dir} is not the one recorded: {why}")]
    NotAdoptable { dir: PathBuf, why: String },
    #[error("this VM's shape cannot run")]
    Shape(#[from] ShapeError),
    #[error("the zygote's warm-up command (`sh -c true`) failed: {0}")]
    WarmUp(String),
}

/// Where a running VM can be found again by another process: its
/// directory and its VMM's pid (what a daemon records to re-adopt its VMs
/// after it restarts).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct VmHandle {
    pub dir: PathBuf,
    pub pid: u32,
}

/// Added to [`GUEST_CMDLINE`] for a VM with a network: the agent loads
/// `virtio_net` and configures `eth0`.
pub const NET_CMDLINE: &str = " forkbox.net=1";
/// The egress log's name in a VM's directory.
const EGRESS_LOG: &str = "egress.jsonl";

/// How big a VM is and what it boots.
#[derive(Debug, Clone)]
pub struct VmSpec {
    pub image: ImageName,
    pub vcpus: u8,
    pub memory_mib: u32,
    /// Copy the guest's serial console to our stderr as well as the log.
    pub serial_to_stderr: bool,
    pub boot_timeout: Duration,
    /// Variables set for the VMM process (and so its fork children) only:
    /// test hooks such as `FORKBOX_VMM_TEST_HANG_CHILD`.
    pub vmm_env: Vec<(String, String)>,
}

impl VmSpec {
    /// Its vCPUs and memory, as the VMM checks them.
    pub fn shape(&self) -> VmShape {
        VmShape {
            vcpus: self.vcpus,
            memory_mib: self.memory_mib.into(),
        }
    }
}

impl Default for VmSpec {
    fn default() -> Self {
        Self {
            image: ImageName::Minimal,
            vcpus: 1,
            memory_mib: 512,
            serial_to_stderr: false,
            boot_timeout: Duration::from_secs(120),
            vmm_env: Vec::new(),
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

/// The VMM process behind a [`Vm`].
enum Vmm {
    /// Started by us: our child.
    Spawned(Child),
    /// Forked from another VMM: its parent's child until that parent dies,
    /// then ours (we are a subreaper). Signalled and watched by pidfd.
    Forked { pid: u32, pidfd: OwnedFd },
}

/// A running microVM. Dropping it kills the VMM (reaped in the
/// background: tearing a VM down takes tens of milliseconds).
pub struct Vm {
    vmm: Option<Vmm>,
    dir: VmDir,
    agent: AgentClient,
    control: Control,
    state: RunState,
    /// From spawning the VMM (or the fork request) to the agent's answer.
    pub boot_time: Duration,
    /// What the agent's after-fork hook did (fork children, restored VMs).
    pub after_fork: Option<AfterForkReport>,
    /// Fork children: from the fork request to the VMM's answer (every
    /// child's control socket listening); `boot_time` minus this is the
    /// after-fork hook, connection retries included.
    pub vmm_answered: Option<Duration>,
    /// Fork children: why the first child forked in this place was lost
    /// and replaced by this one (a new child of the same state), if it was.
    pub replaced: Option<String>,
    /// Its network, if it has one.
    net: Option<VmNet>,
}

/// A VM's network as this process holds it: the broker its VMM asks (its
/// own: a fork child's policy can change alone) and its egress log.
struct VmNet {
    broker: NetBroker,
    egress_log: PathBuf,
}

impl VmNet {
    fn broker_path(dir: &Path) -> PathBuf {
        dir.join("net-broker.sock")
    }

    /// Starts the broker of a VM whose directory is `dir`.
    fn start(dir: &Path, policy: Policy, egress_log: Option<PathBuf>) -> Result<Self, VmError> {
        Ok(Self {
            broker: NetBroker::start(&Self::broker_path(dir), policy)?,
            egress_log: egress_log.unwrap_or_else(|| dir.join(EGRESS_LOG)),
        })
    }
}

/// A VM's network: virtio-net behind the VMM's userspace gateway, egress
/// decided by `policy`.
#[derive(Debug, Clone, Default)]
pub struct NetworkSpec {
    pub policy: Policy,
    /// Append the egress log (JSON lines) here; `None`: a file in the VM's
    /// own directory, removed with it.
    pub egress_log: Option<PathBuf>,
}

/// How fork children's networks differ from their parent's (a parent
/// without a network ignores them).
#[derive(Debug, Clone, Default)]
pub struct ForkOptions {
    /// Every child's egress policy; `None`: the parent's at the fork.
    pub policy: Option<Policy>,
    /// Child `i`'s egress log is `egress_logs[i]` when given, else a file
    /// in its own directory.
    pub egress_logs: Vec<PathBuf>,
}

/// Makes this process a child subreaper, once: VMMs forked from VMMs we
/// started are reparented to us when their parent dies.
pub fn become_subreaper() -> Result<(), VmError> {
    static DONE: OnceLock<Result<(), std::io::ErrorKind>> = OnceLock::new();
    DONE.get_or_init(|| {
        rustix::process::set_child_subreaper(Some(rustix::process::getpid()))
            .map_err(|e| std::io::Error::from(e).kind())
    })
    .map_err(|k| VmError::Subreaper(k.into()))
}

/// A VM's directory: its control and vsock sockets and serial log.
/// Removed with the VM; it outlives a process that dies without dropping
/// it, so that a restarted daemon can find the VM again.
struct VmDir(PathBuf);

impl VmDir {
    fn path(&self) -> &Path {
        &self.0
    }
}

impl VmDir {
    /// No directory (what is left of one handed on).
    fn none() -> Self {
        VmDir(PathBuf::new())
    }

    /// Leaves the directory in place.
    fn keep(&mut self) {
        self.0 = PathBuf::new();
    }
}

impl Drop for VmDir {
    fn drop(&mut self) {
        if !self.0.as_os_str().is_empty() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

fn vm_dir(prefix: &str) -> Result<VmDir, VmError> {
    tempfile::Builder::new()
        .prefix(prefix)
        .tempdir()
        .map(|d| VmDir(d.keep()))
        .map_err(VmError::Io)
}

/// The sockets and logs of one VM in its directory (a fork child's are
/// chosen by us and sent with the fork request).
#[derive(Debug, Clone)]
struct ChildPaths {
    control: PathBuf,
    vsock_uds: PathBuf,
    serial_log: PathBuf,
    /// The child's own egress log (a VM with a network only).
    net_log: Option<PathBuf>,
    /// The child's own network broker (a VM with a network only).
    net_broker: Option<PathBuf>,
}

impl ChildPaths {
    /// The fork request's entry for a child in these paths.
    fn spec(&self) -> ChildSpec {
        ChildSpec {
            control: self.control.clone(),
            vsock_uds: Some(self.vsock_uds.clone()),
            serial_log: Some(self.serial_log.clone()),
            net_log: self.net_log.clone(),
            net_broker: self.net_broker.clone(),
        }
    }
}

fn paths_in(dir: &Path) -> ChildPaths {
    ChildPaths {
        control: dir.join("control.sock"),
        vsock_uds: dir.join("vsock.sock"),
        serial_log: dir.join("serial.log"),
        net_log: None,
        net_broker: None,
    }
}

impl Vm {
    pub fn boot(assets: &Assets, spec: &VmSpec) -> Result<Self, VmError> {
        Self::boot_with_network(assets, spec, None)
    }

    /// Boots with a network when `network` is given: a virtio-net device
    /// behind the VMM's userspace gateway, egress decided by `network`
    /// (checked again by a broker in this process, which opens the allowed
    /// connections), the guest at 10.0.2.15/24 with 10.0.2.2 as gateway
    /// and DNS server, and the egress log in [`Vm::egress_log_path`].
    pub fn boot_with_network(
        assets: &Assets,
        spec: &VmSpec,
        network: Option<&Policy>,
    ) -> Result<Self, VmError> {
        let network = network.map(|policy| NetworkSpec {
            policy: policy.clone(),
            egress_log: None,
        });
        Self::boot_networked(assets, spec, network.as_ref())
    }

    /// [`boot_with_network`](Self::boot_with_network), choosing where the
    /// egress log goes. (A parameter, not a `VmSpec` field: `VmSpec` is
    /// built field by field elsewhere.)
    pub fn boot_networked(
        assets: &Assets,
        spec: &VmSpec,
        network: Option<&NetworkSpec>,
    ) -> Result<Self, VmError> {
        spec.shape().validate()?;
        let image = image::ensure(spec.image)?;
        Self::boot_image_net(assets, &image, spec, network)
    }

    /// Boots `image` (an ext4 root image) and waits for the agent.
    ///
    /// A guest that resets before its agent is ready is booted again, up
    /// to twice; one that stays silent past the boot timeout, once (a fresh
    /// VMM each time; the old one is killed), with a warning and the serial
    /// tail: in the emulated host an early reset (a triple fault) or hang
    /// happens now and then under load (see docs/SPEC.md). Any other
    /// failure, or one more of the same, is returned.
    pub fn boot_image(assets: &Assets, image: &Path, spec: &VmSpec) -> Result<Self, VmError> {
        Self::boot_image_net(assets, image, spec, None)
    }

    fn boot_image_net(
        assets: &Assets,
        image: &Path,
        spec: &VmSpec,
        network: Option<&NetworkSpec>,
    ) -> Result<Self, VmError> {
        spec.shape().validate()?;
        // A reset costs a boot of seconds; a hang costs the boot timeout.
        let (mut resets, mut hangs) = (0, 0);
        loop {
            match Self::boot_image_once(assets, image, spec, network) {
                Err(
                    e @ VmError::DiedDuringBoot {
                        code: Some(vmm_exit::RESET),
                        ..
                    },
                ) if resets < 2 => {
                    resets += 1;
                    // The error's text carries the serial tail.
                    eprintln!("forkbox: warning: {e}; booting once more");
                }
                Err(e @ VmError::NeverReady { .. }) if hangs < 1 => {
                    hangs += 1;
                    eprintln!("forkbox: warning: {e}; booting once more");
                }
                other => return other,
            }
        }
    }

    fn boot_image_once(
        assets: &Assets,
        image: &Path,
        spec: &VmSpec,
        network: Option<&NetworkSpec>,
    ) -> Result<Self, VmError> {
        become_subreaper()?;
        // Before the VMM maps its RAM: the kernel aligns memfd mappings to
        // 2 MiB only while huge pages are allowed for them.
        crate::hugepages::allow_for_zygotes();
        let dir = vm_dir("forkbox-vm-")?;
        let paths = paths_in(dir.path());
        let (vsock, serial) = (paths.vsock_uds.clone(), paths.serial_log.clone());
        let mut cmd = Command::new(&assets.vmm);
        cmd.envs(spec.vmm_env.iter().map(|(k, v)| (k, v)));
        let mut cmdline = GUEST_CMDLINE.to_owned();
        let net = match network {
            Some(network) => {
                let policy_path = dir.path().join("net-policy.json");
                let json = serde_json::to_string(&network.policy)
                    .map_err(|e| VmError::Io(std::io::Error::other(e)))?;
                std::fs::write(&policy_path, json).map_err(VmError::Io)?;
                let net = VmNet::start(
                    dir.path(),
                    network.policy.clone(),
                    network.egress_log.clone(),
                )?;
                cmd.arg("--net-policy")
                    .arg(&policy_path)
                    .arg("--net-broker")
                    .arg(net.broker.path())
                    .arg("--net-log")
                    .arg(&net.egress_log);
                cmdline.push_str(NET_CMDLINE);
                Some(net)
            }
            None => None,
        };
        cmd.arg("--kernel")
            .arg(&assets.kernel.vmlinuz)
            .arg("--initramfs")
            .arg(&assets.initramfs)
            .args(["--cmdline", &cmdline])
            .args(["--vcpus", &spec.vcpus.to_string()])
            .args(["--memory-mib", &spec.memory_mib.to_string()])
            .arg("--disk")
            .arg(image)
            .arg("--vsock-uds")
            .arg(&vsock)
            .arg("--serial-log")
            .arg(&serial)
            .arg("--control")
            .arg(&paths.control)
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
                    code: status.code(),
                });
            }
            if start.elapsed() > spec.boot_timeout {
                let vcpus = where_vcpus_are(&Control::new(paths.control.clone()));
                let _ = child.kill();
                let _ = child.wait();
                return Err(VmError::NeverReady {
                    secs: spec.boot_timeout.as_secs(),
                    vcpus,
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
            vmm: Some(Vmm::Spawned(child)),
            dir,
            agent: agent.with_handshake_timeout(AGENT_HANDSHAKE),
            control: Control::new(paths.control),
            state: RunState::Running,
            boot_time: start.elapsed(),
            after_fork: None,
            vmm_answered: None,
            replaced: None,
            net,
        })
    }

    /// Where this VM's egress log is (JSON lines), if it has a network.
    pub fn egress_log_path(&self) -> Option<PathBuf> {
        self.net.as_ref().map(|n| n.egress_log.clone())
    }

    /// The egress policy this VM's connections and lookups are decided by
    /// (`None`: no network).
    pub fn network_policy(&self) -> Option<Policy> {
        self.net.as_ref().map(|n| n.broker.policy())
    }

    /// Decides this VM's new connections and DNS lookups by `policy` from
    /// now on (its broker's and its gateway's copy); open connections stay.
    pub fn set_network_policy(&self, policy: &Policy) -> Result<(), VmError> {
        let net = self.net.as_ref().ok_or(VmError::NoNetwork)?;
        Ok(net.broker.set_policy(policy.clone())?)
    }

    /// The last `limit` egress records of this VM (its own: a fork
    /// child's log starts empty).
    pub fn egress_log(&self, limit: usize) -> Result<Vec<EgressRecord>, VmError> {
        let path = self.egress_log_path().ok_or(VmError::NoNetwork)?;
        match std::fs::File::open(&path) {
            Ok(f) => read_json_lines(std::io::BufReader::new(f), limit).map_err(VmError::EgressLog),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(e) => Err(VmError::Io(e)),
        }
    }

    pub fn agent(&self) -> &AgentClient {
        &self.agent
    }

    /// What another process needs to [`adopt`](Self::adopt) this VM.
    pub fn handle(&self) -> VmHandle {
        VmHandle {
            dir: self.dir.path().to_owned(),
            pid: self.pid(),
        }
    }

    /// Takes back a VM that another process (a daemon that died) started:
    /// its VMM must answer on the control socket in `h.dir` with the
    /// recorded pid. The VM keeps its run state.
    pub fn adopt(h: &VmHandle) -> Result<Vm, VmError> {
        Self::adopt_with_network(h, None)
    }

    /// [`adopt`](Self::adopt) a VM that has a network, serving it a broker
    /// again (at the path its VMM knows; the VMM reaches it on the guest's
    /// next connection or lookup) with `network`'s policy. The broker of
    /// the process that died is gone with it. `network.egress_log` must be
    /// where the VMM was started to write it (`None`: its directory's).
    pub fn adopt_with_network(h: &VmHandle, network: Option<&NetworkSpec>) -> Result<Vm, VmError> {
        let not = |why: String| VmError::NotAdoptable {
            dir: h.dir.clone(),
            why,
        };
        let paths = paths_in(&h.dir);
        let control = Control::new(paths.control);
        let status = control.status()?;
        if status.pid != h.pid {
            return Err(not(format!("it has pid {}, not {}", status.pid, h.pid)));
        }
        let state = status.state;
        let pidfd = pidfd_of(h.pid)?;
        let net = match network {
            Some(n) => {
                // The dead broker's socket file.
                let _ = std::fs::remove_file(VmNet::broker_path(&h.dir));
                Some(VmNet::start(
                    &h.dir,
                    n.policy.clone(),
                    n.egress_log.clone(),
                )?)
            }
            None => None,
        };
        Ok(Vm {
            vmm: Some(Vmm::Forked { pid: h.pid, pidfd }),
            dir: VmDir(h.dir.clone()),
            agent: agent_client(&paths.vsock_uds),
            control,
            state,
            boot_time: Duration::ZERO,
            after_fork: None,
            vmm_answered: None,
            replaced: None,
            net,
        })
    }

    /// Lets the VM run on without this process, as when the process dies:
    /// its VMM and directory stay, its broker stops (the guest's new
    /// connections fail until a process adopts it with a network). What
    /// [`adopt`](Self::adopt) needs is returned.
    pub fn detach(mut self) -> VmHandle {
        let handle = self.handle();
        self.net = None;
        // Neither killed nor waited for: dropping a `Child` does neither.
        self.vmm = None;
        self.dir.keep();
        handle
    }

    /// Clears away a VM that cannot be adopted: kills its VMM if `h.pid`
    /// is still a `forkbox-vmm` process, and removes its directory.
    pub fn discard(h: &VmHandle) {
        let exe = std::fs::read_link(format!("/proc/{}/exe", h.pid)).ok();
        let is_vmm = exe
            .as_deref()
            .and_then(Path::file_name)
            .is_some_and(|n| n == "forkbox-vmm");
        if is_vmm {
            if let Ok(fd) = pidfd_of(h.pid) {
                let _ = rustix::process::pidfd_send_signal(&fd, Signal::KILL);
            }
        }
        if h.dir.starts_with(std::env::temp_dir()) {
            let _ = std::fs::remove_dir_all(&h.dir);
        }
    }

    /// The VMM's control socket.
    pub fn control(&self) -> &Control {
        &self.control
    }

    pub fn state(&self) -> RunState {
        self.state
    }

    /// Parks every vCPU.
    pub fn pause(&mut self) -> Result<(), VmError> {
        self.control.pause()?;
        self.state = RunState::Paused;
        Ok(())
    }

    pub fn resume(&mut self) -> Result<(), VmError> {
        self.control.resume()?;
        self.state = RunState::Running;
        Ok(())
    }

    /// Makes the VM a paused zygote: its memory moves to a memory file
    /// mapped `MAP_PRIVATE`, so forks of it are O(1) in memory size.
    /// Dense 2 MiB regions of that file go in huge pages where the host
    /// allows it ([`crate::hugepages`]).
    pub fn make_zygote(&mut self) -> Result<ZygoteMemory, VmError> {
        let memory = self.control.zygote()?;
        self.state = RunState::Zygote;
        Ok(memory)
    }

    /// [`make_zygote`](Self::make_zygote) after a warm-up command
    /// (`sh -c true`), so that the shell and what it loads are in the page
    /// cache every fork shares; otherwise each child's first command reads
    /// them from the image into its own guest memory (about 380 pages,
    /// 1.5 MiB, per child for the `minimal` image's busybox).
    pub fn make_warm_zygote(&mut self) -> Result<ZygoteMemory, VmError> {
        let warm = self
            .agent
            .exec(
                &forkbox_proto::ExecRequest::shell("true"),
                None,
                &mut |_, _| {},
            )
            .map_err(|e| VmError::WarmUp(e.to_string()))?;
        if !warm.success() {
            return Err(VmError::WarmUp(format!("it ended with {:?}", warm.status)));
        }
        self.make_zygote()
    }

    /// Forks the VM into `n` children. A running VM goes on running, a
    /// paused one or a zygote stays paused. `Err` if the request as a whole
    /// failed (then no child is left running); otherwise one entry per
    /// child, in order, each a running VM whose after-fork hook has run, or
    /// why that child could not be had. More than
    /// [`MAX_CHILDREN_PER_FORK`] children take several requests.
    pub fn fork(&self, n: usize) -> Result<Vec<Result<Vm, VmError>>, VmError> {
        self.fork_with(n, &ForkOptions::default())
    }

    /// [`fork`](Self::fork), each child with its own broker and egress
    /// log, its policy `opts.policy` or the parent's.
    ///
    /// No request waits on one child: a child that has not answered
    /// `AfterFork` within [`after_fork_deadline`] (or whose VMM died, a
    /// guest's triple fault, say) is killed and replaced once by a new
    /// child of the same state; its serial log is kept beside the new one
    /// as `serial.log.lost`, and [`Vm::replaced`] says why. A running
    /// parent stays paused until every child answered, so that a
    /// replacement is of the same instant; it runs on afterwards.
    pub fn fork_with(
        &self,
        n: usize,
        opts: &ForkOptions,
    ) -> Result<Vec<Result<Vm, VmError>>, VmError> {
        let start = Instant::now();
        let dirs = (0..n)
            .map(|_| vm_dir("forkbox-fork-"))
            .collect::<Result<Vec<_>, _>>()?;
        let nets: Vec<Option<VmNet>> = match &self.net {
            None => dirs.iter().map(|_| None).collect(),
            Some(parent) => {
                let policy = opts
                    .policy
                    .clone()
                    .unwrap_or_else(|| parent.broker.policy());
                dirs.iter()
                    .enumerate()
                    .map(|(i, d)| {
                        let log = opts.egress_logs.get(i).cloned();
                        VmNet::start(d.path(), policy.clone(), log).map(Some)
                    })
                    .collect::<Result<_, _>>()?
            }
        };
        let paths: Vec<ChildPaths> = dirs
            .iter()
            .zip(&nets)
            .map(|(d, net)| ChildPaths {
                net_log: net.as_ref().map(|n| n.egress_log.clone()),
                net_broker: net.as_ref().map(|n| n.broker.path().to_owned()),
                ..paths_in(d.path())
            })
            .collect();
        // A running parent is paused for the whole request (and resumed
        // however it ends), so a replacement child is of the same instant.
        let _paused = match self.state {
            RunState::Running => Some(PausedWhileForking::pause(&self.control)?),
            RunState::Paused | RunState::Zygote => None,
        };
        // The VMM takes at most this many children per request. Should a
        // later request fail, the children of the earlier ones are killed.
        let mut answers = Vec::with_capacity(n);
        for batch in paths.chunks(MAX_CHILDREN_PER_FORK) {
            let specs = batch.iter().map(ChildPaths::spec).collect();
            match self.control.fork(specs, Then::Pause) {
                Ok(a) => answers.extend(a),
                Err(e) => {
                    kill_forked(&answers);
                    return Err(e.into());
                }
            }
        }
        let answered = start.elapsed();
        // Take hold of every child process first: a pidfd pins its pid.
        let held: Vec<Result<(u32, OwnedFd), VmError>> = answers
            .into_iter()
            .enumerate()
            .map(|(index, a)| match a {
                ChildResult::Started { pid } => Ok((pid, pidfd_of(pid)?)),
                ChildResult::Failed { error } => Err(VmError::ForkChild { index, error }),
            })
            .collect();
        let deadline = after_fork_deadline(n);
        let mut out = Vec::with_capacity(n);
        std::thread::scope(|scope| {
            let handles: Vec<_> = held
                .into_iter()
                .zip(dirs)
                .zip(paths)
                .zip(nets)
                .enumerate()
                .map(|(index, (((held, dir), paths), net))| {
                    scope.spawn(move || {
                        let child = ForkedVm {
                            dir,
                            paths,
                            net,
                            start,
                            answered,
                        };
                        let first = match held {
                            Ok((pid, pidfd)) => child.hook(pid, pidfd, deadline),
                            Err(e) => Err((e, Box::new(child))),
                        };
                        let (lost, child) = match first {
                            Ok(vm) => return Ok(vm),
                            Err(lost) => lost,
                        };
                        let why = format!("{lost:#}");
                        eprintln!("forkbox: fork child {index} was lost ({why}); replacing it with a new child of the same state");
                        (*child).replace(&self.control, deadline, why)
                    })
                })
                .collect();
            for h in handles {
                out.push(h.join().unwrap_or_else(|_| {
                    Err(VmError::Io(std::io::Error::other("fork thread panicked")))
                }));
            }
        });
        Ok(out)
    }

    /// Writes a snapshot of the VM into `dir` (created by the VMM); the VM
    /// keeps its run state. Returns the bytes written.
    pub fn snapshot(&mut self, dir: &Path) -> Result<u64, VmError> {
        let then = match self.state {
            RunState::Running => Then::Resume,
            RunState::Paused | RunState::Zygote => Then::Pause,
        };
        Ok(self.control.snapshot(dir, then)?)
    }

    /// Starts a VMM from the snapshot in `dir`, resumes it if it comes up
    /// paused, and runs the after-fork hook (clock, RNG) before returning.
    pub fn restore(assets: &Assets, snapshot: &Path) -> Result<Vm, VmError> {
        become_subreaper()?;
        let start = Instant::now();
        let dir = vm_dir("forkbox-restore-")?;
        let paths = paths_in(dir.path());
        let child = Command::new(&assets.vmm)
            .arg("--restore")
            .arg(snapshot)
            .arg("--control")
            .arg(&paths.control)
            .arg("--vsock-uds")
            .arg(&paths.vsock_uds)
            .arg("--serial-log")
            .arg(&paths.serial_log)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .map_err(VmError::Spawn)?;
        let mut vm = Vm {
            vmm: Some(Vmm::Spawned(child)),
            agent: agent_client(&paths.vsock_uds),
            control: Control::new(paths.control),
            dir,
            state: RunState::Running,
            boot_time: Duration::ZERO,
            after_fork: None,
            vmm_answered: None,
            replaced: None,
            net: None,
        };
        let status = loop {
            match vm.control.status() {
                Ok(s) => break s,
                Err(e) => {
                    if vm.has_exited() || start.elapsed() > AFTER_FORK_TIMEOUT {
                        return Err(VmError::DiedDuringBoot {
                            how: format!("no control socket: {e}"),
                            serial_tail: vm.serial_tail(30),
                            code: None,
                        });
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
        };
        if status.state != RunState::Running {
            vm.resume()?;
        }
        vm.after_fork_hook(AFTER_FORK_TIMEOUT)?;
        vm.boot_time = start.elapsed();
        Ok(vm)
    }

    /// Sends `AfterFork` (host time, fresh host entropy), retrying while
    /// the child's agent is not reachable yet; keeps the report.
    fn after_fork_hook(&mut self, timeout: Duration) -> Result<(), VmError> {
        let start = Instant::now();
        let pid = self.pid();
        loop {
            let mut entropy = vec![0u8; MIN_AFTER_FORK_ENTROPY];
            rustix::rand::getrandom(&mut entropy[..], rustix::rand::GetRandomFlags::empty())
                .map_err(|e| VmError::Entropy(e.into()))?;
            // A guest that hangs must not hold an attempt past the deadline.
            let left = timeout
                .saturating_sub(start.elapsed())
                .clamp(Duration::from_secs(1), AGENT_HANDSHAKE);
            let agent = self.agent.clone().with_handshake_timeout(left);
            match agent.after_fork(unix_now_ns(), entropy) {
                Ok(report) => {
                    self.after_fork = Some(report);
                    return Ok(());
                }
                // Not delivered: nothing listens yet, or the VMM refused
                // the connection. Safe to retry.
                Err(ClientError::Connect { .. } | ClientError::NotReady { .. }) => {
                    if self.has_exited() {
                        return Err(VmError::DiedBeforeAfterFork {
                            pid,
                            serial_tail: self.serial_tail(30),
                        });
                    }
                    if start.elapsed() > timeout {
                        return Err(VmError::AfterForkTimeout {
                            pid,
                            secs: timeout.as_secs(),
                            vcpus: where_vcpus_are(&self.control),
                            serial_tail: self.serial_tail(30),
                        });
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(source) => return Err(VmError::AfterFork { pid, source }),
            }
        }
    }

    /// Whether the VMM has ended (without reaping it).
    fn has_exited(&mut self) -> bool {
        match &mut self.vmm {
            Some(Vmm::Spawned(c)) => !matches!(c.try_wait(), Ok(None)),
            Some(Vmm::Forked { pidfd, .. }) => pidfd_exited(pidfd, Duration::ZERO),
            None => true,
        }
    }

    /// Sends SIGKILL to the VMM (the `Vm` stays; drop it to reap).
    pub fn kill(&mut self) {
        match &mut self.vmm {
            Some(Vmm::Spawned(c)) => {
                let _ = c.kill();
            }
            Some(Vmm::Forked { pidfd, .. }) => {
                let _ = rustix::process::pidfd_send_signal(&*pidfd, Signal::KILL);
            }
            None => {}
        }
    }

    /// The last `lines` lines the guest wrote to its serial console.
    pub fn serial_tail(&self, lines: usize) -> String {
        testbed::tail(&self.dir.path().join("serial.log"), lines)
    }

    /// The VMM's process id.
    pub fn pid(&self) -> u32 {
        match &self.vmm {
            Some(Vmm::Spawned(c)) => c.id(),
            Some(Vmm::Forked { pid, .. }) => *pid,
            None => 0,
        }
    }

    /// Waits up to `timeout` for the VMM to exit by itself. For a forked
    /// VMM whose parent VMM still lives, the status goes to that parent:
    /// then a signal-less, code-less status (`from_raw(0)`) is not
    /// returned; an error says so instead.
    pub fn wait_exit(&mut self, timeout: Duration) -> std::io::Result<Option<ExitStatus>> {
        match &mut self.vmm {
            Some(Vmm::Spawned(child)) => {
                let start = Instant::now();
                while start.elapsed() < timeout {
                    if let Some(status) = child.try_wait()? {
                        return Ok(Some(status));
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                Ok(None)
            }
            Some(Vmm::Forked { pid, pidfd }) => {
                if !pidfd_exited(pidfd, timeout) {
                    return Ok(None);
                }
                match reap_pid(*pid)? {
                    Some(status) => Ok(Some(status)),
                    None => Err(std::io::Error::other(
                        "the forked VMM exited; its status went to its parent VMM",
                    )),
                }
            }
            None => Ok(None),
        }
    }
}

/// Bound on an agent's hello once the VM is up. An agent too busy to
/// answer makes the handshake wait, and a loaded host (100 fork children
/// exec'ing at once on 2 emulated CPUs) takes more than the client's
/// default 5 s; a dead VMM still fails the call at once.
const AGENT_HANDSHAKE: Duration = Duration::from_secs(30);

/// The client of the agent behind a VMM's hybrid vsock socket.
fn agent_client(vsock_uds: &Path) -> AgentClient {
    AgentClient::hybrid_vsock(vsock_uds, AGENT_PORT).with_handshake_timeout(AGENT_HANDSHAKE)
}

/// What kind of loss a lost fork child's error (or a replacement's
/// [`Vm::replaced`]) names, for counting losses by signature: the VMM notes
/// a triple fault in the serial log the error carries, a hang is a child
/// that did not answer in time.
pub fn loss_signature(cause: &str) -> &'static str {
    if cause.contains("lost twice") {
        "lost twice"
    } else if cause.contains("triple fault") {
        "triple fault"
    } else if cause.contains("did not answer AfterFork") {
        "hang"
    } else if cause.contains("died before") {
        "VMM died"
    } else {
        "other"
    }
}

/// The VMM's report of where each vCPU is, or why it could not be had.
fn where_vcpus_are(control: &Control) -> String {
    control
        .vcpus()
        .unwrap_or_else(|e| format!("(not readable: {:#})", anyhow::Error::new(e)))
}

/// How long the children of one fork request may take to answer
/// `AfterFork` before one is given up and replaced: seconds, growing with
/// the children that start at once (they share the host's CPUs). On
/// hardware virtualization a child answers in milliseconds; in the
/// emulated host a lone child takes about half a second, 64 at once tens
/// of seconds on one emulated CPU.
pub fn after_fork_deadline(children: usize) -> Duration {
    let children = u32::try_from(children).unwrap_or(u32::MAX);
    if testbed::inside() {
        Duration::from_secs(30) + Duration::from_millis(1500).saturating_mul(children)
    } else {
        Duration::from_secs(5) + Duration::from_millis(100).saturating_mul(children)
    }
}

/// A running parent paused for a fork request; resumed when dropped.
struct PausedWhileForking<'a>(&'a Control);

impl<'a> PausedWhileForking<'a> {
    fn pause(control: &'a Control) -> Result<Self, VmError> {
        control.pause()?;
        Ok(Self(control))
    }
}

impl Drop for PausedWhileForking<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.0.resume() {
            eprintln!("forkbox: cannot resume the fork's parent: {e}");
        }
    }
}

/// Kills the children a fork request started (when a later request of the
/// same fork failed); reaped in the background.
fn kill_forked(answers: &[ChildResult]) {
    for a in answers {
        if let ChildResult::Started { pid } = a {
            match pidfd_of(*pid) {
                Ok(pidfd) => {
                    let _ = rustix::process::pidfd_send_signal(&pidfd, Signal::KILL);
                    let vmm = Vmm::Forked { pid: *pid, pidfd };
                    let _ = std::thread::Builder::new()
                        .name("vm-reap".into())
                        .spawn(move || reap_vmm(vmm));
                }
                Err(e) => eprintln!("forkbox: cannot kill fork child {pid}: {e}"),
            }
        }
    }
}

/// One place of a fork request: its directory, paths and network, before
/// a VMM in it has answered.
struct ForkedVm {
    dir: VmDir,
    paths: ChildPaths,
    net: Option<VmNet>,
    start: Instant,
    answered: Duration,
}

impl ForkedVm {
    /// Runs the after-fork hook of the child `pid`; gives the place back
    /// with why the child was lost (the child killed) if it failed.
    fn hook(
        self,
        pid: u32,
        pidfd: OwnedFd,
        deadline: Duration,
    ) -> Result<Vm, (VmError, Box<ForkedVm>)> {
        let mut vm = Vm {
            vmm: Some(Vmm::Forked { pid, pidfd }),
            agent: agent_client(&self.paths.vsock_uds),
            control: Control::new(self.paths.control.clone()),
            dir: self.dir,
            state: RunState::Running,
            boot_time: Duration::ZERO,
            after_fork: None,
            vmm_answered: Some(self.answered),
            replaced: None,
            net: self.net,
        };
        match vm.after_fork_hook(deadline) {
            Ok(()) => {
                vm.boot_time = self.start.elapsed();
                Ok(vm)
            }
            Err(e) => {
                // Killed, and waited for: its sockets are then free.
                vm.kill();
                if let Some(Vmm::Forked { pidfd, pid }) = &vm.vmm {
                    if pidfd_exited(pidfd, Duration::from_secs(10)) {
                        let _ = reap_pid(*pid);
                    }
                }
                let place = Box::new(ForkedVm {
                    dir: std::mem::replace(&mut vm.dir, VmDir::none()),
                    paths: self.paths,
                    net: vm.net.take(),
                    start: self.start,
                    answered: self.answered,
                });
                Err((e, place))
            }
        }
    }

    /// Forks one new child of the parent's (unchanged) state into this
    /// place, keeping the lost child's serial log as `serial.log.lost`.
    fn replace(self, parent: &Control, deadline: Duration, why: String) -> Result<Vm, VmError> {
        let _ = std::fs::rename(
            &self.paths.serial_log,
            self.paths.serial_log.with_extension("log.lost"),
        );
        for socket in [&self.paths.control, &self.paths.vsock_uds] {
            let _ = std::fs::remove_file(socket);
        }
        let lost = |error: String| VmError::ForkChildLost {
            first: why.clone(),
            error,
        };
        let answer = parent
            .fork(vec![self.paths.spec()], Then::Pause)
            .map_err(|e| lost(format!("{:#}", anyhow::Error::new(e))))?;
        let (pid, pidfd) = match answer.into_iter().next() {
            Some(ChildResult::Started { pid }) => (pid, pidfd_of(pid)?),
            Some(ChildResult::Failed { error }) => return Err(lost(error)),
            None => return Err(lost("the VMM answered no child".into())),
        };
        match self.hook(pid, pidfd, deadline) {
            Ok(mut vm) => {
                vm.replaced = Some(why);
                Ok(vm)
            }
            Err((e, _place)) => Err(lost(format!("{e:#}"))),
        }
    }
}

/// How long a fork child or restored VM may take to answer `AfterFork`
/// (generous: the emulated host is slow, and 100 children share 2 CPUs).
const AFTER_FORK_TIMEOUT: Duration = Duration::from_secs(120);

fn unix_now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

fn pidfd_of(pid: u32) -> Result<OwnedFd, VmError> {
    let gone = |source| VmError::ChildGone { pid, source };
    let p = i32::try_from(pid)
        .ok()
        .and_then(Pid::from_raw)
        .ok_or_else(|| gone(std::io::Error::other("bad pid")))?;
    rustix::process::pidfd_open(p, PidfdFlags::empty()).map_err(|e| gone(e.into()))
}

/// Whether the process behind `pidfd` has exited, waiting up to `timeout`.
fn pidfd_exited(pidfd: &OwnedFd, timeout: Duration) -> bool {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let ts = Timespec {
        tv_sec: timeout.as_secs() as _,
        tv_nsec: timeout.subsec_nanos() as _,
    };
    let mut fds = [PollFd::new(pidfd, PollFlags::IN)];
    matches!(poll(&mut fds, Some(&ts)), Ok(n) if n > 0)
}

/// Reaps `pid` if it is our (reparented) child and has exited.
fn reap_pid(pid: u32) -> std::io::Result<Option<ExitStatus>> {
    let Some(p) = i32::try_from(pid).ok().and_then(Pid::from_raw) else {
        return Ok(None);
    };
    match rustix::process::waitpid(Some(p), WaitOptions::NOHANG) {
        Ok(Some((_, status))) => Ok(Some(ExitStatus::from_raw(status.as_raw()))),
        Ok(None) => Ok(None),
        // Not our child: its parent VMM reaps it.
        Err(rustix::io::Errno::CHILD) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        self.kill();
        let Some(vmm) = self.vmm.take() else {
            return;
        };
        // Reap off the caller's path: a VM's teardown takes 17-88 ms.
        let reaped = std::thread::Builder::new()
            .name("vm-reap".into())
            .spawn(move || reap_vmm(vmm));
        if let Err(e) = reaped {
            eprintln!("forkbox: cannot start a reaper thread: {e}");
        }
    }
}

fn reap_vmm(vmm: Vmm) {
    match vmm {
        Vmm::Spawned(mut child) => {
            let _ = child.wait();
        }
        Vmm::Forked { pid, pidfd } => {
            // Exited (a zombie counts); if it is ours by now, reap it,
            // otherwise its parent VMM does.
            if pidfd_exited(&pidfd, Duration::from_secs(30)) {
                let _ = reap_pid(pid);
            }
        }
    }
}

/// "powered off", "kernel panic", "exit code 1", "killed by signal 9".
pub fn describe_exit(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(vmm_exit::POWER_OFF), _) => "the guest powered off".into(),
        (Some(vmm_exit::RESET), _) => "the guest rebooted".into(),
        (Some(vmm_exit::PANIC), _) => "the guest kernel panicked".into(),
        (Some(vmm_exit::VMM_ERROR), _) => "forkbox-vmm failed; its error is above".into(),
        (Some(code), _) => format!("forkbox-vmm exited with code {code}"),
        (None, Some(sig)) => format!("forkbox-vmm was killed by signal {sig}"),
        (None, None) => "forkbox-vmm ended".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loss_signature_names_each_kind_of_loss() {
        let lost = |e: VmError| loss_signature(&format!("{e:#}"));
        let died = VmError::DiedBeforeAfterFork {
            pid: 4,
            serial_tail:
                "[forkbox-vmm] guest reset (triple fault or KVM reset); vCPU 0: rip 0xfff0".into(),
        };
        assert_eq!(lost(died), "triple fault");
        let died = VmError::DiedBeforeAfterFork {
            pid: 4,
            serial_tail: String::new(),
        };
        assert_eq!(lost(died), "VMM died");
        let hung = VmError::AfterForkTimeout {
            pid: 9,
            secs: 31,
            vcpus: "{}".into(),
            serial_tail: String::new(),
        };
        assert_eq!(lost(hung), "hang");
        let twice = VmError::ForkChildLost {
            first: "x".into(),
            error: "y".into(),
        };
        assert_eq!(lost(twice), "lost twice");
        assert_eq!(loss_signature("something else"), "other");
    }

    #[test]
    fn vm_spec_default_shape_is_valid_and_limits_are_the_vmm_s() {
        let mut spec = VmSpec::default();
        assert_eq!(spec.shape().validate(), Ok(()));
        spec.vcpus = 9;
        assert_eq!(spec.shape().validate(), Err(ShapeError::Vcpus(9)));
        spec.vcpus = 1;
        spec.memory_mib = 64;
        assert_eq!(spec.shape().validate(), Err(ShapeError::MemoryMib(64)));
    }

    #[test]
    fn after_fork_deadline_grows_with_the_children() {
        assert!(after_fork_deadline(64) > after_fork_deadline(1));
        assert!(after_fork_deadline(1) >= Duration::from_secs(5));
    }
}
