//! Forking a VM: requests of at most [`MAX_CHILDREN_PER_FORK`] children,
//! the after-fork hook (host time and entropy) every child answers before
//! it is handed out, and a child that does not answer in time replaced
//! once by a new child of the same state.

use std::ops::ControlFlow;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use forkbox_net::policy::Policy;
use forkbox_proto::client::ClientError;
use forkbox_proto::MIN_AFTER_FORK_ENTROPY;
use rustix::process::Signal;
use sha2::{Digest, Sha256};

use crate::control::Control;
use crate::open_files;
use crate::poll::{self, TimedOut};
use crate::testbed;
use forkbox_vmm_api::{ChildResult, Then};

use super::*;

/// How fork children's networks differ from their parent's (a parent
/// without a network ignores them).
#[derive(Debug, Clone, Default)]
pub struct ForkOptions {
    /// Every child's egress policy; `None`: the parent's at the fork.
    pub policy: Option<Policy>,
    /// Child `i`'s egress log is `egress_logs[i]` when given, else a file
    /// in its own directory.
    pub egress_logs: Vec<PathBuf>,
    /// Child `i`'s seed when given ([`child_seed`]): its after-fork
    /// entropy derives from it ([`seeded_entropy`]) instead of the host's
    /// RNG, and its guest gets it as `FORKBOX_SEED`. A child without one
    /// gets fresh host entropy.
    pub seeds: Vec<u64>,
    /// Every child's cgroup limits; `None`: its parent's. Ignored where
    /// the parent has no cgroup (the host gives VMMs none).
    pub limits: Option<Limits>,
}

/// The seed of child `index` of a fork seeded with `seed`: the same pair
/// gives the same child seed, different children different ones.
pub fn child_seed(seed: u64, index: usize) -> u64 {
    let digest = Sha256::new()
        .chain_update(b"forkbox child seed\0")
        .chain_update(seed.to_le_bytes())
        .chain_update((index as u64).to_le_bytes())
        .finalize();
    u64::from_le_bytes(digest[..8].try_into().expect("8 of 32 bytes"))
}

/// The after-fork entropy of a child whose seed is `seed`
/// ([`MIN_AFTER_FORK_ENTROPY`] bytes).
pub fn seeded_entropy(seed: u64) -> Vec<u8> {
    (0u8..)
        .flat_map(|block| {
            Sha256::new()
                .chain_update(b"forkbox after-fork entropy\0")
                .chain_update(seed.to_le_bytes())
                .chain_update([block])
                .finalize()
        })
        .take(MIN_AFTER_FORK_ENTROPY)
        .collect()
}

impl Vm {
    /// A new top for each of its writable disks, for a fork request: its
    /// written top becomes a layer its children share ([`unnamed_file`]s
    /// in its directory).
    fn new_tops(&self) -> Result<Vec<OwnedFd>, VmError> {
        (0..self.disks)
            .map(|_| unnamed_file(self.dir.path()).map(OwnedFd::from))
            .collect()
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
        in_order(
            n,
            |_| {
                Err(VmError::Io(std::io::Error::other(
                    "a fork child was never given",
                )))
            },
            |on_child| self.fork_each(n, opts, on_child),
        )
    }

    /// [`fork_with`](Self::fork_with), giving each child to `on_child`
    /// with its index as soon as its after-fork hook has answered (or it
    /// was lost and replaced), in the order they come up, on at most
    /// [`HOOK_WORKERS`] threads whatever `n` is. `Err` (and no call) when
    /// the request as a whole failed; otherwise one call per index.
    pub fn fork_each(
        &self,
        n: usize,
        opts: &ForkOptions,
        on_child: &(dyn Fn(usize, Result<Vm, VmError>) + Sync),
    ) -> Result<(), VmError> {
        let start = Instant::now();
        // Raised as far as it may be, or a clear error before anything
        // is made (an EMFILE halfway would lose the children made).
        open_files::make_room(n as u64 * open_files::PER_CHILD).map_err(|(need, limit)| {
            VmError::OpenFiles {
                children: n,
                need,
                limit,
            }
        })?;
        let dirs = (0..n)
            .map(|_| vm_dir("forkbox-fork-", self.user))
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
                disks: self.disks,
                ..paths_in(d.path())
            })
            .collect();
        // A running parent is paused for the whole request (and resumed
        // however it ends), so a replacement child is of the same instant.
        let _paused = match self.state {
            RunState::Running => Some(PausedWhileForking::pause(&self.control)?),
            RunState::Paused | RunState::Zygote => None,
        };
        // Each child's own cgroup, with its parent's limits, made first:
        // the child joins it before it builds its VM.
        let limits = self
            .cgroup
            .as_ref()
            .map(|c| opts.limits.unwrap_or_else(|| c.limits()));
        let cgroups = dirs
            .iter()
            .map(|d| child_cgroup(d.path(), limits))
            .collect::<Result<Vec<_>, _>>()?;
        let procs = cgroups
            .iter()
            .map(NewCgroup::procs_for_joining)
            .collect::<Result<Vec<_>, _>>()?;
        // The VMM takes at most this many children per request. Should a
        // later request fail, the children of the earlier ones are killed.
        // Each child is taken hold of as soon as its request is answered:
        // a wide fork's last request may come minutes after its first
        // (in the emulated host), longer than a child lives unowned.
        let mut held: Vec<Result<Held, VmError>> = Vec::with_capacity(n);
        let mut procs = procs.into_iter();
        for batch in paths.chunks(forkbox_vmm_api::children_per_request(self.disks)) {
            let batch_procs: Vec<Option<OwnedFd>> = procs.by_ref().take(batch.len()).collect();
            let specs = batch
                .iter()
                .zip(&batch_procs)
                .map(|(p, fd)| p.spec(fd.is_some()))
                .collect();
            let mut fds: Vec<OwnedFd> = match self.new_tops() {
                Ok(tops) => tops,
                Err(e) => {
                    kill_forked(held);
                    return Err(e);
                }
            };
            for (paths, cgroup) in batch.iter().zip(batch_procs) {
                fds.extend(cgroup);
                match paths.open() {
                    Ok(opened) => fds.extend(opened),
                    Err(e) => {
                        kill_forked(held);
                        return Err(e);
                    }
                }
            }
            match self.control.fork(specs, Then::Pause, self.disks, &fds) {
                Ok(a) => {
                    for answer in a {
                        let index = held.len();
                        held.push(match paths.get(index) {
                            Some(p) => take_hold(index, answer, &p.control),
                            None => {
                                if let ChildResult::Started { pid } = answer {
                                    end_unready(Some(pid));
                                }
                                Err(VmError::Io(std::io::Error::other(
                                    "the VMM answered more children than asked",
                                )))
                            }
                        });
                    }
                }
                Err(e) => {
                    kill_forked(held);
                    return Err(e.into());
                }
            }
        }
        let answered = start.elapsed();
        let deadline = after_fork_deadline(n);
        // Each child's place, taken once by the worker that hooks it.
        let places: Vec<Mutex<Option<_>>> = held
            .into_iter()
            .zip(dirs)
            .zip(paths)
            .zip(nets)
            .zip(cgroups)
            .map(|place| Mutex::new(Some(place)))
            .collect();
        let hook = |index: usize| {
            let taken = places[index]
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take();
            let Some(((((held, dir), paths), net), cgroup)) = taken else {
                return Err(VmError::Io(std::io::Error::other(
                    "a fork child's place was taken twice",
                )));
            };
            let child = ForkedVm {
                dir,
                paths,
                net,
                start,
                answered,
                seed: opts.seeds.get(index).copied(),
                user: self.user,
                cgroup,
                limits,
            };
            let first = match held {
                Ok(held) => child.hook(held, deadline),
                Err(e) => Err((e, Box::new(child))),
            };
            let (lost, child) = match first {
                Ok(vm) => return Ok(vm),
                Err(lost) => lost,
            };
            let why = format!("{lost:#}");
            tracing::warn!(index, cause = %why, "fork child was lost; replacing it with a new child of the same state");
            (*child).replace(self, deadline, why)
        };
        on_workers(n, HOOK_WORKERS, |index| {
            let child = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| hook(index)))
                .unwrap_or_else(|_| {
                    Err(VmError::Io(std::io::Error::other(
                        "a fork child's after-fork hook panicked",
                    )))
                });
            on_child(index, child);
        });
        Ok(())
    }

    /// Sends `AfterFork` (host time, fresh host entropy or, with `seed`,
    /// entropy derived from it), retrying while the child's agent is not
    /// reachable yet; keeps the report.
    pub(super) fn after_fork_hook(
        &mut self,
        timeout: Duration,
        seed: Option<u64>,
    ) -> Result<(), VmError> {
        let deadline = Instant::now() + timeout;
        let pid = self.pid();
        let report = poll::until(deadline, Duration::from_millis(2), || {
            let entropy = match after_fork_entropy(seed) {
                Ok(entropy) => entropy,
                Err(e) => return ControlFlow::Break(Err(VmError::Entropy(e))),
            };
            // A guest that hangs must not hold an attempt past the deadline.
            let left = deadline
                .saturating_duration_since(Instant::now())
                .clamp(Duration::from_secs(1), AGENT_HANDSHAKE);
            let agent = self.agent.clone().with_handshake_timeout(left);
            match agent.after_fork_seeded(unix_now_ns(), entropy, seed) {
                Ok(report) => ControlFlow::Break(Ok(report)),
                // Not delivered: nothing listens yet, or the VMM refused
                // the connection. Safe to retry while the VMM lives.
                Err(ClientError::Connect { .. } | ClientError::NotReady { .. }) => {
                    if self.has_exited() {
                        return ControlFlow::Break(Err(VmError::DiedBeforeAfterFork {
                            pid,
                            serial_tail: self.serial_tail(30),
                        }));
                    }
                    ControlFlow::Continue(())
                }
                Err(source) => ControlFlow::Break(Err(VmError::AfterFork { pid, source })),
            }
        })
        .unwrap_or_else(|TimedOut(())| {
            Err(VmError::AfterForkTimeout {
                pid,
                secs: timeout.as_secs(),
                vcpus: format!(
                    "{}\n--- its VMM's threads in the host kernel ---\n{}",
                    where_vcpus_are(&self.control),
                    where_threads_are(pid)
                ),
                serial_tail: self.guest_says_where(),
            })
        })?;
        self.after_fork = Some(report);
        Ok(())
    }
}

impl Vm {
    /// Asks a guest being given up where it is: an NMI, which its kernel
    /// answers by printing its panic and the interrupted stack to the
    /// serial log ([`GUEST_CMDLINE`]'s `unknown_nmi_panic`); waits up to
    /// [`GUEST_REPORT_WAIT`] for the report's end, then returns the serial
    /// log's tail, or says why the guest was not asked.
    pub fn guest_says_where(&self) -> String {
        // The panic's last line before the guest resets (`panic=-1`).
        const END: &str = "Kernel Offset:";
        if let Err(e) = self.control.nmi() {
            return format!(
                "(no NMI to make the guest say where it is: {:#})\n{}",
                anyhow::Error::new(e),
                self.serial_tail(30)
            );
        }
        poll::until(
            Instant::now() + GUEST_REPORT_WAIT,
            Duration::from_millis(50),
            || {
                let tail = self.serial_tail(80);
                if tail.contains(END) {
                    ControlFlow::Break(tail)
                } else {
                    ControlFlow::Continue(tail)
                }
            },
        )
        .unwrap_or_else(|TimedOut(tail)| tail)
    }
}

/// How long a guest sent an NMI may take to print where it was.
const GUEST_REPORT_WAIT: Duration = Duration::from_secs(5);

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
pub(super) fn where_vcpus_are(control: &Control) -> String {
    control
        .vcpus()
        .unwrap_or_else(|e| format!("(not readable: {:#})", anyhow::Error::new(e)))
}

/// Where the threads of process `pid` are in the host's kernel: each
/// one's state and wait channel, and the top of its kernel stack (root
/// reads it): what a VMM whose control socket no longer answers is
/// waiting on.
pub(super) fn where_threads_are(pid: u32) -> String {
    let tasks = match std::fs::read_dir(format!("/proc/{pid}/task")) {
        Ok(tasks) => tasks,
        Err(e) => return format!("(not readable: {e})"),
    };
    let mut out = String::new();
    for task in tasks.flatten().take(64) {
        let dir = task.path();
        let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap_or_default();
        let stat = read("stat");
        // After the command's closing parenthesis: state, then the rest.
        let state = stat
            .rsplit_once(") ")
            .map_or("?", |(_, rest)| &rest[..1.min(rest.len())]);
        let stack_text = read("stack");
        let stack: Vec<&str> = stack_text
            .lines()
            .take(6)
            .map(|l| l.split_once(' ').map_or(l, |(_, f)| f))
            .collect();
        out.push_str(&format!(
            "{} {} state {state} wchan {} stack [{}]\n",
            task.file_name().to_string_lossy(),
            read("comm").trim(),
            read("wchan").trim(),
            stack.join(" < ")
        ));
    }
    out
}

/// The `n` children a [`Vm::fork_each`]-shaped call gives, in their
/// order: `run` gets the callback to give each `(index, child)` to, from
/// any thread; an index it never gave is `missing(index)`.
pub fn in_order<T: Send, E>(
    n: usize,
    missing: impl Fn(usize) -> T,
    run: impl FnOnce(&(dyn Fn(usize, T) + Sync)) -> Result<(), E>,
) -> Result<Vec<T>, E> {
    let slots: Vec<Mutex<Option<T>>> = (0..n).map(|_| Mutex::new(None)).collect();
    run(&|index, child| {
        *slots[index].lock().unwrap_or_else(|p| p.into_inner()) = Some(child);
    })?;
    Ok(slots
        .into_iter()
        .enumerate()
        .map(|(index, slot)| {
            slot.into_inner()
                .unwrap_or_else(|p| p.into_inner())
                .unwrap_or_else(|| missing(index))
        })
        .collect())
}

/// Most fork children whose after-fork hooks run at once, however many
/// one request forks: a hook mostly waits on its guest, and a group of
/// 1,024 must not take 1,024 threads. Every child runs from its fork on;
/// only the host's side of its hook waits for a worker, and its time to
/// answer counts from when one takes it.
pub const HOOK_WORKERS: usize = 32;

/// Runs `f(i)` for each `i` in `0..n` on at most `workers` threads, each
/// taking the next index as it is free; returns when every call has.
pub(crate) fn on_workers(n: usize, workers: usize, f: impl Fn(usize) + Sync) {
    let next = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for _ in 0..workers.min(n) {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    break;
                }
                f(i);
            });
        }
    });
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
pub(super) struct PausedWhileForking<'a>(&'a Control);

impl<'a> PausedWhileForking<'a> {
    pub(super) fn pause(control: &'a Control) -> Result<Self, VmError> {
        control.pause()?;
        Ok(Self(control))
    }
}

impl Drop for PausedWhileForking<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.0.resume() {
            tracing::warn!(error = %e, "cannot resume the fork's parent");
        }
    }
}

/// Sends SIGKILL to fork child `pid` through a pidfd, which it returns
/// for waiting on the child.
fn kill_child(pid: u32) -> Result<OwnedFd, VmError> {
    let pidfd = pidfd_of(pid)?;
    let _ = rustix::process::pidfd_send_signal(&pidfd, Signal::KILL);
    Ok(pidfd)
}

/// Ends a fork child its VMM gave up on before it came up (`unready_pid`),
/// and waits for it to be gone: it must not bind its sockets' paths
/// after they were cleared for a replacement.
fn end_unready(pid: Option<u32>) {
    let Some(pid) = pid else { return };
    match kill_child(pid) {
        Ok(pidfd) => {
            if !pidfd_exited(&pidfd, Duration::from_secs(5)) {
                tracing::warn!(
                    pid,
                    "a fork child that did not come up has not ended 5 s after SIGKILL"
                );
            }
        }
        // Gone already.
        Err(e) => tracing::debug!(pid, error = %e, "an unready fork child"),
    }
}

/// A fork child taken hold of as soon as its VMM answered: its pid,
/// pinned by a pidfd, and its owner connection.
pub(super) struct Held {
    pid: u32,
    pidfd: OwnedFd,
    owner: std::os::unix::net::UnixStream,
}

/// Takes hold of fork child `index` as its VMM answered: a pidfd, then
/// ownership through its control socket at `control` (a child no
/// process owns ends after its orphan grace). A child that started but
/// cannot be owned is ended.
fn take_hold(index: usize, answer: ChildResult, control: &Path) -> Result<Held, VmError> {
    match answer {
        ChildResult::Started { pid } => {
            let pidfd = pidfd_of(pid)?;
            match Control::new(control.to_owned()).own() {
                Ok(owner) => Ok(Held { pid, pidfd, owner }),
                Err(e) => {
                    end_unready(Some(pid));
                    Err(e.into())
                }
            }
        }
        ChildResult::Failed { error, unready_pid } => {
            end_unready(unready_pid);
            Err(VmError::ForkChild { index, error })
        }
    }
}

/// Kills the children of a fork's earlier requests that it took hold of
/// (when a later request of the same fork failed), through their pidfds;
/// reaped in the background.
pub(super) fn kill_forked(held: Vec<Result<Held, VmError>>) {
    for Held { pid, pidfd, .. } in held.into_iter().flatten() {
        let _ = rustix::process::pidfd_send_signal(&pidfd, Signal::KILL);
        let vmm = Vmm::Forked { pid, pidfd };
        let _ = std::thread::Builder::new()
            .name("vm-reap".into())
            .spawn(move || reap_vmm(vmm, None));
    }
}

/// One place of a fork request: its directory, paths and network, before
/// a VMM in it has answered.
pub(super) struct ForkedVm {
    dir: VmDir,
    paths: ChildPaths,
    net: Option<VmNet>,
    start: Instant,
    answered: Duration,
    /// The child's seed, kept for a replacement of the same place.
    seed: Option<u64>,
    /// Its parent's user, and so its own.
    user: Option<VmmUser>,
    /// Its own cgroup, made before it was forked, which it joined itself.
    cgroup: NewCgroup,
    /// Its cgroup's limits (its parent's), where its parent has one: a
    /// replacement's cgroup gets them.
    limits: Option<Limits>,
}

impl ForkedVm {
    /// Runs the after-fork hook of the child `pid`; gives the place back
    /// with why the child was lost (the child killed) if it failed.
    pub(super) fn hook(
        self,
        held: Held,
        deadline: Duration,
    ) -> Result<Vm, (VmError, Box<ForkedVm>)> {
        let Held { pid, pidfd, owner } = held;
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
            owner: Some(owner),
            user: self.user,
            // It joined its cgroup itself, first thing after the fork.
            cgroup: self.cgroup.take(),
            disks: self.paths.disks,
        };
        let hooked = vm.after_fork_hook(deadline, self.seed);
        match hooked {
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
                        // A replacement makes it again.
                        if let Some(cgroup) = vm.cgroup.take() {
                            let _ = cgroup.remove();
                        }
                    }
                }
                let place = Box::new(ForkedVm {
                    dir: std::mem::replace(&mut vm.dir, VmDir::none()),
                    paths: self.paths,
                    net: vm.net.take(),
                    start: self.start,
                    answered: self.answered,
                    seed: self.seed,
                    user: self.user,
                    // A replacement makes its own.
                    cgroup: NewCgroup(None),
                    limits: self.limits,
                });
                Err((e, place))
            }
        }
    }

    /// Forks one new child of the parent's (unchanged) state into this
    /// place, keeping the lost child's serial log as `serial.log.lost`.
    pub(super) fn replace(
        mut self,
        parent: &Vm,
        deadline: Duration,
        why: String,
    ) -> Result<Vm, VmError> {
        let _ = std::fs::rename(
            &self.paths.serial_log,
            self.paths.serial_log.with_extension("log.lost"),
        );
        let end = self.paths.control.with_file_name(forkbox_vmm_api::END_FILE);
        for stale in [&self.paths.control, &self.paths.vsock_uds, &end] {
            let _ = std::fs::remove_file(stale);
        }
        let lost = |error: String| VmError::ForkChildLost {
            first: why.clone(),
            error,
        };
        // The lost child's cgroup (one that never came up still holds
        // it) goes first: made again after, its removal would take the
        // replacement's with it (they share the directory's name).
        drop(std::mem::replace(&mut self.cgroup, NewCgroup(None)));
        self.cgroup = child_cgroup(self.dir.path(), self.limits)?;
        let mut fds = parent.new_tops()?;
        let procs = self.cgroup.procs_for_joining()?;
        let spec = self.paths.spec(procs.is_some());
        fds.extend(procs);
        fds.extend(self.paths.open()?);
        let answer = parent
            .control
            .fork(vec![spec], Then::Pause, parent.disks, &fds)
            .map_err(|e| lost(format!("{:#}", anyhow::Error::new(e))))?;
        let held = match answer.into_iter().next() {
            Some(answer) => take_hold(0, answer, &self.paths.control)
                .map_err(|e| lost(format!("{:#}", anyhow::Error::new(e))))?,
            None => return Err(lost("the VMM answered no child".into())),
        };
        match self.hook(held, deadline) {
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
pub(super) const AFTER_FORK_TIMEOUT: Duration = Duration::from_secs(120);

/// The entropy an `AfterFork` carries: derived from `seed` when the fork
/// was seeded ([`seeded_entropy`]), else fresh from the host's RNG.
pub(crate) fn after_fork_entropy(seed: Option<u64>) -> std::io::Result<Vec<u8>> {
    match seed {
        Some(seed) => Ok(seeded_entropy(seed)),
        None => {
            let mut fresh = vec![0u8; MIN_AFTER_FORK_ENTROPY];
            rustix::rand::getrandom(&mut fresh[..], rustix::rand::GetRandomFlags::empty())?;
            Ok(fresh)
        }
    }
}

pub(crate) fn unix_now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A child its VMM gave up on is gone when `end_unready` returns, so
    /// that it cannot bind a path cleared for its replacement.
    #[test]
    fn an_unready_child_is_gone_when_end_unready_returns() {
        use std::os::unix::process::ExitStatusExt;
        let mut child = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .expect("sleep runs");
        end_unready(Some(child.id()));
        let status = child.try_wait().expect("waits");
        assert_eq!(status.and_then(|s| s.signal()), Some(9), "SIGKILL");
        end_unready(None);
    }

    #[test]
    pub(super) fn loss_signature_names_each_kind_of_loss() {
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
    fn child_seeds_repeat_per_pair_and_differ_between_children() {
        assert_eq!(child_seed(7, 0), child_seed(7, 0));
        let seeds: std::collections::BTreeSet<u64> = (0..64).map(|i| child_seed(7, i)).collect();
        assert_eq!(seeds.len(), 64);
        assert_ne!(child_seed(7, 0), child_seed(8, 0));
        let e = seeded_entropy(child_seed(7, 3));
        assert_eq!(e.len(), MIN_AFTER_FORK_ENTROPY);
        assert_eq!(e, seeded_entropy(child_seed(7, 3)));
        assert_ne!(e, seeded_entropy(child_seed(7, 4)));
        // Its two 32-byte halves are different hashes, not one repeated.
        assert_ne!(e[..32], e[32..]);
    }

    #[test]
    fn in_order_puts_each_child_at_its_index_and_names_the_missing() {
        let got = in_order(
            4,
            |i| format!("missing {i}"),
            |give| {
                on_workers(3, 2, |i| give(2 - i, format!("child {}", 2 - i)));
                Ok::<_, ()>(())
            },
        );
        assert_eq!(
            got,
            Ok(vec![
                "child 0".to_owned(),
                "child 1".to_owned(),
                "child 2".to_owned(),
                "missing 3".to_owned(),
            ])
        );
        assert_eq!(
            in_order(2, |_| 0, |_| Err("the request")),
            Err("the request")
        );
    }

    #[test]
    fn workers_call_every_index_once_on_at_most_their_number_of_threads() {
        let calls: Vec<AtomicUsize> = (0..1024).map(|_| AtomicUsize::new(0)).collect();
        let threads = Mutex::new(std::collections::HashSet::new());
        on_workers(1024, 8, |i| {
            calls[i].fetch_add(1, Ordering::Relaxed);
            threads
                .lock()
                .expect("threads")
                .insert(std::thread::current().id());
        });
        assert!(calls.iter().all(|c| c.load(Ordering::Relaxed) == 1));
        let used = threads.lock().expect("threads").len();
        assert!((1..=8).contains(&used), "{used} threads");
        // Fewer items than workers: one thread each at most, none idle.
        let seen = AtomicUsize::new(0);
        on_workers(3, 32, |_| {
            seen.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(seen.load(Ordering::Relaxed), 3);
        on_workers(0, 32, |_| unreachable!("no items"));
    }

    #[test]
    pub(super) fn after_fork_deadline_grows_with_the_children() {
        assert!(after_fork_deadline(64) > after_fork_deadline(1));
        assert!(after_fork_deadline(1) >= Duration::from_secs(5));
    }
}
