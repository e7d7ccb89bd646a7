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
//!
//! The parts: [`assets`] (kernel, initramfs, binaries), [`boot`] (boot,
//! restore, adopt after a restart), [`fork`] (fork requests, the
//! after-fork hook, lost children replaced), [`net`] (the broker and the
//! egress log), [`process`] (the VMM process: pidfds, reaping, the VM's
//! directory). Here: the [`Vm`] itself, its spec and its errors.

use std::path::{Path, PathBuf};
use std::time::Duration;

use forkbox_net::log::ReadLogError;
use forkbox_proto::client::{AgentClient, ClientError};
use forkbox_proto::{AfterForkReport, AGENT_PORT};

use crate::cgroup::{Limits, VmCgroup};
use crate::control::{Control, ControlError};
use crate::image::{ImageError, ImageName};
use crate::initramfs::InitramfsError;
use crate::kernel::KernelError;
use crate::netbroker::NetBrokerError;
use forkbox_vmm_api::{ShapeError, Then, VmShape};

mod assets;
mod boot;
mod fork;
mod net;
mod prefault;
mod process;
mod user;

pub(crate) use assets::find_binary;
pub use assets::Assets;
pub use boot::Expected;
pub use fork::{
    after_fork_deadline, child_seed, in_order, loss_signature, seeded_entropy, ForkOptions,
    HOOK_WORKERS,
};
pub(crate) use fork::{after_fork_entropy, on_workers, unix_now_ns};
pub use forkbox_vmm_api::{snapshot_disk_file, MAX_CHILDREN_PER_FORK, MAX_WRITABLE_DISKS};
pub use net::NetworkSpec;
pub use prefault::WorkingSet;
pub use process::{become_subreaper, describe_exit, VmEnd};

use fork::*;
use net::*;
use process::*;
use user::VmmUser;

/// The guest kernel's command line. `panic=-1` turns a panic into an
/// immediate reset that the VMM reports; `pci=off` skips probing a bus the
/// VM does not have; `quiet` keeps the (slow, emulated) serial port idle;
/// `unknown_nmi_panic` makes a guest that no longer answers say where it
/// was when forkbox gives it up (an NMI, [`Control::nmi`]: the panic prints
/// its stack).
pub const GUEST_CMDLINE: &str =
    "console=ttyS0 reboot=k panic=-1 pci=off quiet unknown_nmi_panic forkbox.root=/dev/vda";

/// `forkbox-vmm` exit codes (its command-line contract).
pub use forkbox_vmm_api::exit_code as vmm_exit;
pub use forkbox_vmm_api::{RunState, ZygoteMemory};

#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error(
        "forking {children} children needs about {need} open files and this process may open \
         {limit} (the hard limit): raise it (`ulimit -Hn`, or LimitNOFILE= for a service) or \
         fork fewer at once"
    )]
    OpenFiles {
        children: usize,
        need: u64,
        limit: u64,
    },
    #[error("preparing the guest kernel")]
    Kernel(#[from] KernelError),
    #[error("building the guest initramfs")]
    Initramfs(#[from] InitramfsError),
    #[error("building the guest image")]
    Image(#[from] ImageError),
    #[error("an image with no layers cannot be a root")]
    NoLayers,
    /// A snapshot's `state.json` (which its VMM wrote, and so a guest
    /// that took the VMM over may have) names other files or another
    /// shape than the VM it is restored as.
    #[error("the snapshot in {dir} is not of this VM: {why}")]
    SnapshotMismatch { dir: PathBuf, why: String },
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
        /// Where each vCPU was (`Control::vcpus`), then where its VMM's
        /// threads were in the host's kernel.
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
    #[error("the VMM's cgroup: {0}")]
    Cgroup(String),
}

/// Where a running VM can be found again by another process: its
/// directory and its VMM's pid (what a daemon records to re-adopt its VMs
/// after it restarts).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct VmHandle {
    pub dir: PathBuf,
    pub pid: u32,
}

impl VmHandle {
    /// The prefixes of the directories [`Vm`]s are given (`vm_dir`).
    pub const DIR_PREFIXES: [&str; 3] = ["forkbox-vm-", "forkbox-fork-", "forkbox-restore-"];

    /// Whether `dir` is one a VM of this user was given: a directory of
    /// ours right in the temporary directory, with one of
    /// [`Self::DIR_PREFIXES`], compared after canonicalizing (a handle
    /// read back from a file is checked before it is used or removed).
    pub fn dir_is_ours(&self) -> bool {
        let tmp = std::env::temp_dir();
        Self::DIR_PREFIXES
            .iter()
            .any(|p| crate::owned::is_made_under(&self.dir, &tmp, p))
    }
}

/// Added to [`GUEST_CMDLINE`]: the kernel's module tree is the second
/// disk ([`Assets::modules`], after the root's), which the agent mounts at
/// `/lib/modules/<release>`.
pub const MODULES_CMDLINE: &str = " forkbox.modules=/dev/vdb";

/// Added to [`GUEST_CMDLINE`] for a VM with a network: the agent loads
/// `virtio_net` and configures `eth0`.
pub const NET_CMDLINE: &str = " forkbox.net=1";

/// What a VM's root file system is made of (read-only, under a tmpfs
/// upper layer in the guest).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RootImage {
    /// A built-in image: one ext4 file, built once from Debian packages.
    Builtin(ImageName),
    /// An image of the store (`forkbox_image`): its layers' erofs files,
    /// bottom first, one partition each of the VM's first disk.
    Layers(Vec<PathBuf>),
}

impl From<ImageName> for RootImage {
    fn from(name: ImageName) -> Self {
        RootImage::Builtin(name)
    }
}

impl RootImage {
    /// What the VMM is given (`--disk` or `--layer`s) and what the guest
    /// is told (the root's file system and layer count), the built-in
    /// image built first if need be.
    /// The files its VMM is given: layers (one partitioned disk), then
    /// whole disks, as a snapshot's state records them.
    pub fn files(&self) -> Result<(Vec<PathBuf>, Vec<PathBuf>), VmError> {
        Ok(match self {
            RootImage::Builtin(name) => (Vec::new(), vec![crate::image::ensure(*name)?]),
            RootImage::Layers(layers) => (layers.clone(), Vec::new()),
        })
    }

    fn prepare(&self) -> Result<(Vec<String>, String), VmError> {
        Ok(match self {
            RootImage::Builtin(name) => {
                let path = crate::image::ensure(*name)?;
                let arg = path.to_string_lossy().into_owned();
                (
                    vec!["--disk".into(), arg],
                    " forkbox.rootfstype=ext4".into(),
                )
            }
            RootImage::Layers(layers) => {
                if layers.is_empty() {
                    return Err(VmError::NoLayers);
                }
                let args = layers
                    .iter()
                    .flat_map(|l| ["--layer".to_owned(), l.to_string_lossy().into_owned()])
                    .collect();
                let cmdline = format!(" forkbox.rootfstype=erofs forkbox.layers={}", layers.len());
                (args, cmdline)
            }
        })
    }
}

/// How big a VM is, what it boots and what network it has: all a boot
/// takes besides the [`Assets`].
#[derive(Debug, Clone)]
pub struct VmSpec {
    pub image: RootImage,
    pub vcpus: u8,
    pub memory_mib: u32,
    /// Copy the guest's serial console to our stderr as well as the log.
    pub serial_to_stderr: bool,
    pub boot_timeout: Duration,
    /// Variables set for the VMM process (and so its fork children) only:
    /// test hooks such as `FORKBOX_VMM_TEST_HANG_CHILD` and `FORKBOX_VMM_TEST_FAIL_CHILD`.
    pub vmm_env: Vec<(String, String)>,
    /// Its network; `None`: none at all.
    pub network: Option<NetworkSpec>,
    /// How long its VMM (and each fork child's) lives on without an owner
    /// (the process holding its [`Vm`]: one that died, or
    /// [`detach`](Vm::detach)ed it) before ending: a restarted daemon
    /// adopts it within this time, or it ends.
    pub orphan_grace: Duration,
    /// Refuse to run (the VMM exits with an error) where a part of its
    /// jail cannot be set up ([`crate::jail`]), instead of running
    /// without it.
    pub require_jail: bool,
    /// Writable disks, at most [`forkbox_vmm_api::MAX_WRITABLE_DISKS`].
    pub disks: Vec<DiskSpec>,
}

/// A writable disk: a golden volume (read-only, an ext4 file system: see
/// [`crate::volume`]) under the VM's own writes, mounted in the guest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskSpec {
    pub base: PathBuf,
    /// Where the guest mounts it: an absolute path of plain names (no
    /// `,`, space or `..`; checked by [`check_mount_path`]).
    pub mount: String,
}

/// Why a writable disk's mount path is refused: one the guest agent is
/// told on the kernel's command line, so it must be one word of plain
/// path names, and not where the guest's own file systems are.
pub fn check_mount_path(path: &str) -> Result<(), String> {
    let bad = |why: &str| Err(format!("mount path `{path}`: {why}"));
    if !path.starts_with('/') || path.len() < 2 {
        return bad("not an absolute path below /");
    }
    if path.len() > 200 {
        return bad("longer than 200 bytes");
    }
    if path.ends_with('/') || path.contains("//") {
        return bad("has an empty component");
    }
    let plain = |c: char| c.is_ascii_alphanumeric() || "/._-+@".contains(c);
    if !path.chars().all(plain) {
        return bad("only letters, digits and / . _ - + @ are allowed");
    }
    if path.split('/').any(|c| c == "." || c == "..") {
        return bad("has a `.` or `..` component");
    }
    let reserved = ["/proc", "/sys", "/dev", "/run", "/tmp", "/forkbox"];
    if reserved
        .iter()
        .any(|r| path == *r || path.starts_with(&format!("{r}/")))
    {
        return bad("inside a file system the guest mounts itself");
    }
    Ok(())
}

/// Added to [`GUEST_CMDLINE`] for a VM with writable disks: where the
/// agent mounts each, in order (`fbx-rw-N` by its serial).
fn disks_cmdline(disks: &[DiskSpec]) -> String {
    match disks.is_empty() {
        true => String::new(),
        false => {
            let mounts: Vec<&str> = disks.iter().map(|d| d.mount.as_str()).collect();
            format!(" forkbox.disks={}", mounts.join(","))
        }
    }
}

/// [`VmSpec::orphan_grace`] unless asked otherwise (and of a restored VM).
pub const ORPHAN_GRACE: Duration = Duration::from_secs(120);

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
            image: ImageName::Minimal.into(),
            vcpus: 1,
            memory_mib: 512,
            serial_to_stderr: false,
            boot_timeout: Duration::from_secs(120),
            vmm_env: Vec::new(),
            network: None,
            orphan_grace: ORPHAN_GRACE,
            require_jail: false,
            disks: Vec::new(),
        }
    }
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
    /// The control connection through which this process owns the VMM
    /// (`own`): when it closes, the VMM's orphan grace starts.
    owner: Option<std::os::unix::net::UnixStream>,
    /// The VMM's own user, if it gave ours up (its fork children share it).
    user: Option<VmmUser>,
    /// The VMM's own cgroup, where this host gives it one
    /// ([`crate::cgroup`]); removed once the VMM is reaped.
    cgroup: Option<VmCgroup>,
    /// Its writable disks: a fork sends it a new top for each, and each
    /// child one of its own; a snapshot, a file for each.
    disks: u8,
}

impl Vm {
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
    ///
    /// Its cgroup's memory and task limits are lifted: a zygote runs
    /// nothing, and the kernel charges it the pages its children share with
    /// it, their page tables and KVM's threads of their VMs
    /// ([`crate::cgroup`]).
    pub fn make_zygote(&mut self) -> Result<ZygoteMemory, VmError> {
        let memory = self.control.zygote()?;
        self.state = RunState::Zygote;
        if let Some(cgroup) = &self.cgroup {
            cgroup
                .lift_limits_for_zygote()
                .map_err(|e| VmError::Cgroup(e.to_string()))?;
        }
        Ok(memory)
    }

    /// The VMM's cgroup on the host, if this host gives it one.
    pub fn cgroup(&self) -> Option<&VmCgroup> {
        self.cgroup.as_ref()
    }

    /// [`make_zygote`](Self::make_zygote) after a warm-up command
    /// (`sh -c true`), so that the shell and what it loads are in the page
    /// cache every fork shares; otherwise each child's first command reads
    /// them from the image into its own guest memory (about 380 pages,
    /// 1.5 MiB, per child for the `minimal` image's busybox). An image
    /// with no shell (`sh` not found: 127) has nothing to warm and becomes
    /// a zygote all the same; only an agent that does not answer fails.
    ///
    /// Then it learns what a child's first command touches and has its
    /// children map that before their guest runs
    /// ([`learn_working_set`](Self::learn_working_set)); where that cannot
    /// be learned, it says so and its children fault those pages in.
    pub fn make_warm_zygote(&mut self) -> Result<ZygoteMemory, VmError> {
        self.make_warm_zygote_with(true)
    }

    /// [`make_warm_zygote`](Self::make_warm_zygote), learning its working
    /// set only with `learn` (a benchmark's before).
    pub fn make_warm_zygote_with(&mut self, learn: bool) -> Result<ZygoteMemory, VmError> {
        // Bounded: a guest that never answers fails the bake, it does not
        // hold its caller.
        let warm = self
            .agent
            .clone()
            .with_call_timeout(WARM_UP_WITHIN)
            .exec(
                &forkbox_proto::ExecRequest::shell("true").timeout(WARM_UP_WITHIN / 2),
                None,
                &mut |_, _| {},
            )
            .map_err(|e| VmError::WarmUp(e.to_string()))?;
        if !warm.success() {
            tracing::info!(status = ?warm.status, "no warm-up: the image's `sh -c true` did not succeed (an image without a shell)");
        }
        let memory = self.make_zygote()?;
        if learn {
            match self.learn_working_set() {
                Ok(set) => {
                    let (written, read) = set.pages();
                    tracing::info!(
                        written,
                        read,
                        "zygote: its children map a first command's pages ahead"
                    )
                }
                Err(e) => tracing::warn!(
                    "zygote: a first command's pages were not learned, so its children fault them in: {e}"
                ),
            }
        }
        Ok(memory)
    }

    /// Writes a snapshot of the VM into `dir` (created if missing: its
    /// `memory`, `state.json` and a file per writable disk,
    /// [`forkbox_vmm_api::snapshot_disk_file`]); the VM keeps its run
    /// state. Returns the bytes written.
    ///
    /// The VMM writes into files opened here, under temporary names, and
    /// they are renamed into place once it answered: it reaches no path
    /// of `dir`, and `dir` may hold the snapshot it was restored from,
    /// whose `memory` it maps.
    pub fn snapshot(&mut self, dir: &Path) -> Result<u64, VmError> {
        let then = match self.state {
            RunState::Running => Then::Resume,
            RunState::Paused | RunState::Zygote => Then::Pause,
        };
        std::fs::create_dir_all(dir).map_err(VmError::Io)?;
        let new = |name: &str| -> Result<(std::fs::File, PathBuf), VmError> {
            let path = dir.join(name);
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(&path)
                .map_err(|e| VmError::Io(io_context(e, &path)))?;
            Ok((file, path))
        };
        let mut names = vec!["memory".to_owned(), "state.json".to_owned()];
        names.extend((0..usize::from(self.disks)).map(forkbox_vmm_api::snapshot_disk_file));
        let mut files = Vec::new();
        let mut renames = Vec::new();
        for name in names {
            let (file, tmp) = match new(&format!(".{name}.tmp")) {
                Ok(made) => made,
                Err(e) => {
                    renames
                        .iter()
                        .for_each(|(tmp, _)| drop(std::fs::remove_file(tmp)));
                    return Err(e);
                }
            };
            files.push(file);
            renames.push((tmp, dir.join(name)));
        }
        let bytes = self
            .control
            .snapshot(&files[0], &files[1], &files[2..], then);
        let bytes = match bytes {
            Ok(bytes) => bytes,
            Err(e) => {
                renames
                    .iter()
                    .for_each(|(tmp, _)| drop(std::fs::remove_file(tmp)));
                return Err(e.into());
            }
        };
        for (tmp, to) in renames {
            std::fs::rename(&tmp, &to).map_err(|e| VmError::Io(io_context(e, &to)))?;
        }
        Ok(bytes)
    }
}

/// `e`, saying which path it was about.
fn io_context(e: std::io::Error, path: &Path) -> std::io::Error {
    std::io::Error::new(e.kind(), format!("{}: {e}", path.display()))
}

/// Bound on the warm-up command before a VM becomes a zygote (it runs
/// `true`; the emulated host is slow).
const WARM_UP_WITHIN: Duration = Duration::from_secs(120);

/// Bound on an agent's hello once the VM is up. An agent too busy to
/// answer makes the handshake wait, and a loaded host (100 fork children
/// exec'ing at once on 2 emulated CPUs) takes more than the client's
/// default 5 s; a dead VMM still fails the call at once.
const AGENT_HANDSHAKE: Duration = Duration::from_secs(30);

/// The client of the agent behind a VMM's hybrid vsock socket.
fn agent_client(vsock_uds: &Path) -> AgentClient {
    AgentClient::hybrid_vsock(vsock_uds, AGENT_PORT).with_handshake_timeout(AGENT_HANDSHAKE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn discard_a_handle_not_made_by_us_removes_nothing() {
        // As a tampered state file would give it: the text starts with the
        // temporary directory, the directory is not one a VM was given.
        let outer = tempfile::tempdir().expect("dir");
        let victim = outer.path().join("forkbox-vm-victim");
        std::fs::create_dir(&victim).expect("mkdir");
        let h = VmHandle {
            dir: victim.clone(),
            pid: std::process::id(),
        };
        assert!(h.dir.starts_with(std::env::temp_dir()));
        assert!(!h.dir_is_ours());
        Vm::discard(&h);
        assert!(victim.exists(), "a directory we did not make stays");
        let dotdot = VmHandle {
            dir: std::env::temp_dir()
                .join("..")
                .join(victim.strip_prefix("/").expect("abs")),
            pid: std::process::id(),
        };
        Vm::discard(&dotdot);
        assert!(victim.exists());
        assert!(matches!(
            Vm::adopt(&h, None),
            Err(VmError::NotAdoptable { .. })
        ));

        let ours = tempfile::Builder::new()
            .prefix("forkbox-vm-")
            .tempdir()
            .expect("dir")
            .keep();
        let h = VmHandle {
            dir: ours.clone(),
            pid: std::process::id(),
        };
        assert!(h.dir_is_ours());
        Vm::discard(&h);
        assert!(!ours.exists(), "a VM directory of ours is cleared away");
    }
}
