//! The VMM process behind a [`Vm`]: spawned by us or forked from another
//! VMM (then watched by pidfd, ours once reparented: we are a subreaper),
//! signalled, waited for and reaped off the caller's path; and the VM's
//! directory, which outlives a process that dies without dropping it.

use std::ops::ControlFlow;
use std::os::fd::OwnedFd;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use rustix::process::{Pid, PidfdFlags, Signal, WaitOptions};

use crate::{poll, testbed};
use forkbox_net::broker::link::BrokerLinks;
use forkbox_vmm_api::{ChildSpec, End, END_FILE};

use super::*;

/// The VMM process behind a [`Vm`].
pub(super) enum Vmm {
    /// Started by us: our child.
    Spawned(Child),
    /// Forked from another VMM: its parent's child until that parent dies,
    /// then ours (we are a subreaper). Signalled and watched by pidfd.
    Forked { pid: u32, pidfd: OwnedFd },
}

/// Variables of ours a VMM may see: its log level, backtraces, and the
/// override of its hardware check. Everything else of the caller's
/// environment (the daemon's token, credentials, `PATH`) stays out of a
/// process its guest may come to control.
const VMM_ENV_PASSED: &[&str] = &[
    "FORKBOX_LOG",
    "RUST_BACKTRACE",
    "FORKBOX_ALLOW_SOFTWARE_KVM",
];

/// A command for the VMM binary with a scrubbed environment: only
/// [`VMM_ENV_PASSED`] from ours, then `extra` (test hooks).
pub(super) fn vmm_command(
    vmm: &Path,
    extra: &[(String, String)],
    user: Option<VmmUser>,
) -> std::process::Command {
    let mut cmd = std::process::Command::new(vmm);
    if let Some(user) = user {
        cmd.arg("--run-as").arg(user.arg());
    }
    cmd.env_clear();
    for name in VMM_ENV_PASSED {
        if let Some(v) = std::env::var_os(name) {
            cmd.env(name, v);
        }
    }
    cmd.envs(extra.iter().map(|(k, v)| (k, v)));
    cmd
}

/// Limits set on a VMM right after it starts (its fork children inherit
/// them): no core dumps, which would write the guest's memory to the
/// host's disk whenever a guest made its VMM crash.
pub(super) fn limit_vmm(pid: u32) -> Result<(), VmError> {
    use rustix::process::{prlimit, Resource, Rlimit};
    let pid =
        Pid::from_raw(pid as i32).ok_or_else(|| VmError::Io(std::io::Error::other("pid 0")))?;
    let none = Rlimit {
        current: Some(0),
        maximum: Some(0),
    };
    prlimit(Some(pid), Resource::Core, none)
        .map(drop)
        .map_err(|e| {
            VmError::Io(std::io::Error::other(format!(
                "setting the VMM's core limit: {e}"
            )))
        })
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
pub(super) struct VmDir(pub(super) PathBuf);

impl VmDir {
    pub(super) fn path(&self) -> &Path {
        &self.0
    }
}

impl VmDir {
    /// No directory (what is left of one handed on).
    pub(super) fn none() -> Self {
        VmDir(PathBuf::new())
    }

    /// Leaves the directory in place.
    pub(super) fn keep(&mut self) {
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

/// A new VM directory in the temporary directory, granted to the VMM's
/// `user` if it has one of its own.
pub(super) fn vm_dir(prefix: &str, user: Option<VmmUser>) -> Result<VmDir, VmError> {
    let dir = tempfile::Builder::new()
        .prefix(prefix)
        .tempdir()
        .map(|d| VmDir(d.keep()))
        .map_err(VmError::Io)?;
    if let Some(user) = user {
        user.grant_dir(dir.path()).map_err(VmError::Io)?;
    }
    Ok(dir)
}

/// The sockets and logs of one VM in its directory (a fork child's are
/// chosen by us and sent with the fork request).
#[derive(Debug, Clone)]
pub(super) struct ChildPaths {
    pub(super) control: PathBuf,
    pub(super) vsock_uds: PathBuf,
    pub(super) serial_log: PathBuf,
    /// The child's own egress log (a VM with a network only).
    pub(super) net_log: Option<PathBuf>,
    /// The child's own network broker (a VM with a network only).
    pub(super) net_broker: Option<PathBuf>,
    /// Its writable disks (its parent's count): a new top for each.
    pub(super) disks: u8,
}

impl ChildPaths {
    /// The fork request's entry for a child in these paths, which joins
    /// its own cgroup if `joins_cgroup` (its `cgroup.procs` sent along).
    pub(super) fn spec(&self, joins_cgroup: bool) -> ChildSpec {
        ChildSpec {
            joins_cgroup,
            control: self.control.clone(),
            vsock_uds: Some(self.vsock_uds.clone()),
            serial_log: Some(self.serial_log.clone()),
            net_log: self.net_log.clone(),
            net_broker: self.net_broker.clone(),
            disks: self.disks,
        }
    }

    /// The child's endpoints, opened for the fork request to carry
    /// ([`ChildSpec::carried`], after its cgroup's): its control and vsock
    /// sockets bound and listening, its serial log open to append, its
    /// [`END_FILE`] open to write, and two links to its network broker
    /// (with one). The child finds no path to them in its parent's root.
    pub(super) fn open(&self) -> Result<Vec<OwnedFd>, VmError> {
        let err = |path: &Path| {
            let path = path.to_path_buf();
            move |e: std::io::Error| VmError::Io(io_context(e, &path))
        };
        let listen = |path: &Path| {
            std::os::unix::net::UnixListener::bind(path)
                .map(OwnedFd::from)
                .map_err(err(path))
        };
        let end = self.control.with_file_name(END_FILE);
        let mut fds = vec![
            listen(&self.control)?,
            listen(&self.vsock_uds)?,
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&self.serial_log)
                .map(OwnedFd::from)
                .map_err(err(&self.serial_log))?,
            std::fs::File::create(&end)
                .inspect(reserve_end_note)
                .map(OwnedFd::from)
                .map_err(err(&end))?,
        ];
        if let Some(broker) = &self.net_broker {
            let links = BrokerLinks::connect(broker).map_err(err(broker))?;
            fds.extend([links.connector, links.resolver]);
        }
        let dir = self.control.parent().unwrap_or(Path::new("."));
        for _ in 0..self.disks {
            fds.push(OwnedFd::from(unnamed_file(dir)?));
        }
        Ok(fds)
    }
}

/// An empty file in `dir`, opened to read and write, that no path names
/// (made and unlinked at once): a writable disk's top, whose blocks are
/// freed when the last VMM holding it ends. In the VM's own directory,
/// so on the file system that holds its other files.
pub(super) fn unnamed_file(dir: &Path) -> Result<std::fs::File, VmError> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut name = [0u8; 8];
    rustix::rand::getrandom(&mut name, rustix::rand::GetRandomFlags::empty())
        .map_err(|e| VmError::Io(e.into()))?;
    let path = dir.join(format!(".top-{:016x}", u64::from_le_bytes(name)));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .map_err(|e| VmError::Io(io_context(e, &path)))?;
    std::fs::remove_file(&path).map_err(|e| VmError::Io(io_context(e, &path)))?;
    Ok(file)
}

pub(super) fn paths_in(dir: &Path) -> ChildPaths {
    ChildPaths {
        control: dir.join("control.sock"),
        vsock_uds: dir.join("vsock.sock"),
        serial_log: dir.join("serial.log"),
        net_log: None,
        net_broker: None,
        disks: 0,
    }
}

impl Vm {
    /// Whether the VMM has ended (without reaping it).
    pub(super) fn has_exited(&mut self) -> bool {
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

    /// Lets go of owning the VMM: unless a process owns it again
    /// ([`own`](Self::own)) within its orphan grace, it ends. The `Vm`
    /// still kills it when dropped.
    pub fn disown(&mut self) {
        self.owner = None;
    }

    /// Owns the VMM again (after [`disown`](Self::disown)).
    pub fn own(&mut self) -> Result<(), VmError> {
        if self.owner.is_none() {
            self.owner = Some(self.control.own()?);
        }
        Ok(())
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
                let deadline = Instant::now() + timeout;
                poll::until(deadline, Duration::from_millis(20), || {
                    match child.try_wait().transpose() {
                        Some(exited) => ControlFlow::Break(exited.map(Some)),
                        None => ControlFlow::Continue(()),
                    }
                })
                .unwrap_or(Ok(None))
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

pub(super) fn pidfd_of(pid: u32) -> Result<OwnedFd, VmError> {
    let gone = |source| VmError::ChildGone { pid, source };
    let p = i32::try_from(pid)
        .ok()
        .and_then(Pid::from_raw)
        .ok_or_else(|| gone(std::io::Error::other("bad pid")))?;
    rustix::process::pidfd_open(p, PidfdFlags::empty()).map_err(|e| gone(e.into()))
}

/// Whether the process behind `pidfd` has exited, waiting up to `timeout`.
pub(super) fn pidfd_exited(pidfd: &OwnedFd, timeout: Duration) -> bool {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let ts = Timespec {
        tv_sec: timeout.as_secs() as _,
        tv_nsec: timeout.subsec_nanos() as _,
    };
    let mut fds = [PollFd::new(pidfd, PollFlags::IN)];
    matches!(poll(&mut fds, Some(&ts)), Ok(n) if n > 0)
}

/// Reaps `pid` if it is our (reparented) child and has exited.
pub(super) fn reap_pid(pid: u32) -> std::io::Result<Option<ExitStatus>> {
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
        let cgroup = self.cgroup.take();
        // Reap off the caller's path: a VM's teardown takes 17-88 ms.
        let reaped = std::thread::Builder::new()
            .name("vm-reap".into())
            .spawn(move || reap_vmm(vmm, cgroup));
        if let Err(e) = reaped {
            tracing::warn!(error = %e, "cannot start a reaper thread");
        }
    }
}

/// Waits for a VMM that was killed (or ended) and reaps it, then removes
/// its cgroup.
pub(super) fn reap_vmm(vmm: Vmm, cgroup: Option<VmCgroup>) {
    let ended = match vmm {
        Vmm::Spawned(mut child) => child.wait().is_ok(),
        Vmm::Forked { pid, pidfd } => {
            // Exited (a zombie counts); if it is ours by now, reap it,
            // otherwise its parent VMM does.
            let exited = pidfd_exited(&pidfd, Duration::from_secs(30));
            if exited {
                let _ = reap_pid(pid);
            }
            exited
        }
    };
    if let Some(cgroup) = cgroup.filter(|_| ended) {
        if let Err(e) = cgroup.remove() {
            tracing::warn!(cgroup = %cgroup.dir().display(), error = %e, "cannot remove a VMM's cgroup");
        }
    }
}

/// The cgroup of a VM still being made: removed if dropped before the VM
/// takes it (the VMM is then gone: killed and waited for).
pub(super) struct NewCgroup(pub(super) Option<VmCgroup>);

impl NewCgroup {
    pub(super) fn dir(&self) -> Option<&Path> {
        self.0.as_ref().map(VmCgroup::dir)
    }

    /// Hands the cgroup to the VM made.
    pub(super) fn take(mut self) -> Option<VmCgroup> {
        self.0.take()
    }

    /// What a fork child joins it by ([`VmCgroup::procs_for_joining`]);
    /// `None` without a cgroup.
    pub(super) fn procs_for_joining(&self) -> Result<Option<OwnedFd>, VmError> {
        self.0
            .as_ref()
            .map(VmCgroup::procs_for_joining)
            .transpose()
            .map_err(|e| VmError::Cgroup(e.to_string()))
    }
}

impl Drop for NewCgroup {
    fn drop(&mut self) {
        if let Some(cgroup) = self.0.take() {
            let _ = cgroup.remove();
        }
    }
}

/// The name of the cgroup of the VM whose directory is `dir`: the
/// directory's own name (empty, which no cgroup may be named, if none).
pub(super) fn cgroup_name(dir: &Path) -> &str {
    dir.file_name().and_then(|n| n.to_str()).unwrap_or_default()
}

/// The cgroup limits of the VM a VMM's `status` describes.
pub(super) fn shape_limits(status: &forkbox_vmm_api::Status) -> Limits {
    Limits::for_vm(
        status.vcpus,
        u32::try_from(status.memory_mib).unwrap_or(u32::MAX),
    )
}

/// A fork child's own cgroup, in its directory `dir`, with its parent's
/// `limits`; none where its parent has none.
pub(super) fn child_cgroup(dir: &Path, limits: Option<Limits>) -> Result<NewCgroup, VmError> {
    match limits {
        Some(limits) => vm_cgroup(dir, limits, true),
        None => Ok(NewCgroup(None)),
    }
}

/// The cgroup of the VM whose directory is `dir`, named after it, with
/// `limits`. `None` where this host gives VMMs none (`cgroup::hierarchy`
/// says why; the daemon said so once at start), unless `required`.
pub(super) fn vm_cgroup(dir: &Path, limits: Limits, required: bool) -> Result<NewCgroup, VmError> {
    let made = crate::cgroup::hierarchy()
        .map_err(str::to_owned)
        .and_then(|h| {
            h.create(cgroup_name(dir), limits)
                .map_err(|e| e.to_string())
        });
    match made {
        Ok(cgroup) => Ok(NewCgroup(Some(cgroup))),
        Err(why) if required => Err(VmError::Cgroup(why)),
        Err(why) => {
            tracing::debug!("the VMM runs in no cgroup of its own: {why}");
            Ok(NewCgroup(None))
        }
    }
}

/// How a VM ended: a sentence for its user, and whether its guest did it
/// (powered off, rebooted, panicked: the guest's doing, scored) or not (a
/// VMM that failed or was killed, a triple fault: masked).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmEnd {
    pub how: String,
    pub by_guest: bool,
}

impl Vm {
    /// How the VM ended, once its VMM has (reaping it if it is ours); `None`
    /// while it runs. The VMM's own note ([`END_FILE`]) says it when there
    /// is one (a forked VMM's exit status goes to its parent VMM); without
    /// one the VMM was killed before it could write it, and the exit status
    /// (when ours) says how.
    pub fn ended(&mut self) -> Option<VmEnd> {
        let status = match self.wait_exit(Duration::ZERO) {
            Ok(None) => return None,
            Ok(Some(status)) => Ok(status),
            Err(e) => Err(e),
        };
        let note = std::fs::read_to_string(self.dir.path().join(END_FILE)).unwrap_or_default();
        if let Some((end, how)) = End::parse_file(&note) {
            return Some(VmEnd {
                how: if how.is_empty() {
                    end.word().into()
                } else {
                    how
                },
                by_guest: end.by_guest(),
            });
        }
        let mut end = match status {
            Ok(status) => VmEnd {
                how: describe_exit(status),
                // A VMM that saw the guest end says so in its note first;
                // a status alone is never taken for the guest's word.
                by_guest: false,
            },
            Err(e) => VmEnd {
                how: format!("forkbox-vmm ended without saying how (killed?): {e}"),
                by_guest: false,
            },
        };
        if let Some(cgroup) = self.cgroup.as_ref().filter(|c| c.oom_kills() > 0) {
            let limits = cgroup.limits();
            let limit = limits
                .memory_max
                .map_or("none".to_owned(), |b| format!("{} MiB", b >> 20));
            // Held below its shape's, the limit is reached by what its
            // guest writes: the guest's doing, as a guest's own OOM is.
            end.by_guest = limits.memory_held;
            end.how = if limits.memory_held {
                format!(
                    "it reached the memory limit it was held to ({limit} of host memory of \
                     its own: what its guest wrote and its VMM's), and the host kernel's OOM \
                     killer ended it ({}); {}",
                    cgroup.dir().display(),
                    end.how
                )
            } else {
                format!(
                    "the kernel's OOM killer ended it: its cgroup reached its memory limit \
                     ({limit}; {}); {}",
                    cgroup.dir().display(),
                    end.how
                )
            };
        }
        Some(end)
    }
}

impl Vm {
    /// What to say about a VM whose guest stopped answering: how it ended
    /// if its VMM has (after a short wait for the VMM to finish dying),
    /// else where its vCPUs are; with its serial log's tail either way.
    pub fn post_mortem(&mut self) -> String {
        let _ = self.wait_exit(Duration::from_secs(2));
        let state = match self.ended() {
            Some(end) => format!("--- the VM ended ---\n{}", end.how),
            None => format!(
                "--- the VM runs; its vCPUs ---\n{}",
                fork::where_vcpus_are(&self.control)
            ),
        };
        format!(
            "VMM {}\n{state}\n--- serial log (tail) ---\n{}",
            self.pid(),
            self.serial_tail(60)
        )
    }
}

/// Reserves room for a VMM's end note ([`forkbox_vmm_api::reserve_end_file`]).
fn reserve_end_note(file: &std::fs::File) {
    if let Err(e) = forkbox_vmm_api::reserve_end_file(file) {
        tracing::debug!("cannot reserve room for a VMM's end note: {e}");
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
        (None, Some(sig)) if sig == Signal::SYS.as_raw() => {
            "forkbox-vmm made a system call its seccomp filter \
            forbids and was killed by SIGSYS (the serial log names the call): a forkbox bug, \
            or a VMM the guest took over"
                .into()
        }
        (None, Some(sig)) => format!("forkbox-vmm was killed by signal {sig}"),
        (None, None) => "forkbox-vmm ended".into(),
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::FileTypeExt;

    use super::*;

    #[test]
    fn a_childs_endpoints_are_opened_in_the_order_its_spec_counts_them() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut paths = paths_in(dir.path());
        let fds = paths.open().expect("opened");
        assert_eq!(fds.len(), paths.spec(false).carried());
        let is_socket = |p: &Path| std::fs::metadata(p).is_ok_and(|m| m.file_type().is_socket());
        assert!(is_socket(&paths.control) && is_socket(&paths.vsock_uds));
        assert_eq!(std::fs::read(dir.path().join(END_FILE)).ok(), Some(vec![]));
        // Empty, with its room on the disk taken already.
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(dir.path().join(END_FILE)).expect("the end note");
        assert!(
            meta.blocks() * 512 >= forkbox_vmm_api::END_FILE_RESERVE,
            "{meta:?}"
        );
        // The control socket listens: a connection is taken by its first
        // descriptor.
        let _client = std::os::unix::net::UnixStream::connect(&paths.control).expect("connect");
        let listener = std::os::unix::net::UnixListener::from(fds.into_iter().next().expect("fd"));
        listener.set_nonblocking(true).expect("nonblocking");
        assert!(listener.accept().is_ok(), "the control socket's listener");
        drop(listener);
        // With a broker: two links to it follow the end note.
        for stale in [&paths.control, &paths.vsock_uds] {
            std::fs::remove_file(stale).expect("unlink");
        }
        let broker = dir.path().join("broker.sock");
        let listener = rustix::net::socket(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::SEQPACKET,
            None,
        )
        .expect("socket");
        rustix::net::bind(
            &listener,
            &rustix::net::SocketAddrUnix::new(&broker).expect("addr"),
        )
        .expect("bind");
        rustix::net::listen(&listener, 4).expect("listen");
        paths.net_broker = Some(broker);
        let fds = paths.open().expect("opened with a broker");
        assert_eq!(fds.len(), paths.spec(false).carried());
        for link in &fds[4..] {
            let peer = rustix::net::accept(&listener).expect("a link reached the broker");
            rustix::net::send(link, b"x", rustix::net::SendFlags::empty()).expect("send");
            let mut got = [0u8; 1];
            rustix::net::recv(&peer, &mut got, rustix::net::RecvFlags::empty()).expect("recv");
            assert_eq!(&got, b"x");
        }
    }
}
