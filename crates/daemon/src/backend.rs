//! Between the daemon and its VMs: the [`Backend`] trait, and
//! [`VmBackend`], its implementation on `forkbox_host::vm` (one `forkbox-vmm`
//! process per sandbox).
//!
//! Every method here blocks (boots take seconds); the service calls them on
//! `tokio::task::spawn_blocking`.

use std::path::{Path, PathBuf};
use std::sync::{RwLock, TryLockError};
use std::time::Duration;

use forkbox_host::cgroup::VmCgroup;
use forkbox_host::control::Control;
use forkbox_host::image::ImageName;
use forkbox_host::vm::{
    Assets, DiskSpec, Expected, RootImage, Vm, VmEnd, VmError, VmHandle, VmSpec,
};
pub use forkbox_host::vm::{ForkOptions, NetworkSpec};
use forkbox_net::policy::Policy;
use forkbox_proto::client::AgentClient;
use forkbox_vmm_api::VmmCounters;

/// What a VM boots: the part of a template the backend needs. Every VM
/// has a network device; `network` says what it may reach while it runs
/// as booted (a template's bake) and where its egress log goes.
#[derive(Debug, Clone)]
pub struct BackendVmSpec {
    pub image: RootImage,
    pub vcpus: u8,
    pub memory_mib: u32,
    pub boot_timeout: Duration,
    pub network: NetworkSpec,
    pub disks: Vec<crate::template::TemplateDisk>,
}

/// Why the backend failed: always the infrastructure's fault, never the
/// user's command.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("preparing the guest assets")]
    Assets(#[source] VmError),
    #[error("booting the microVM")]
    Boot(#[source] VmError),
    #[error("{what} failed")]
    Control {
        what: &'static str,
        #[source]
        source: VmError,
    },
    #[error("forking the microVM")]
    Fork(#[source] VmError),
    #[error("re-adopting a VM")]
    Adopt(#[source] VmError),
    #[error("restoring a VM from its snapshot")]
    Restore(#[source] VmError),
    #[error("fork child {index} did not come up")]
    ForkChild {
        index: usize,
        #[source]
        source: VmError,
    },
    #[error("fork child {index}: the backend never said how it ended")]
    ForkChildMissing { index: usize },
    #[error("{0} is not supported by this backend")]
    Unsupported(&'static str),
    #[error("gVisor: {what}")]
    Gvisor {
        what: &'static str,
        #[source]
        source: forkbox_host::gvisor::GvisorError,
    },
    #[error("making a writable disk's volume")]
    Volume(#[source] forkbox_host::volume::VolumeError),
}

/// Makes VMs.
pub trait Backend: Send + Sync + 'static {
    /// Boots a fresh VM and waits for its agent. Blocking.
    fn boot(&self, spec: &BackendVmSpec) -> Result<Box<dyn BackendVm>, BackendError>;
    /// Takes back a VM an earlier daemon run started; with `network`, one
    /// that has a network is served a broker again (the earlier run's
    /// died with it) with that policy and egress log.
    fn adopt(
        &self,
        handle: &VmHandle,
        network: Option<&NetworkSpec>,
    ) -> Result<Box<dyn BackendVm>, BackendError>;
    /// Clears away what is left of a VM that cannot be adopted.
    fn discard(&self, handle: &VmHandle);
    /// Starts a VM from a snapshot ([`BackendVm::snapshot`]), running,
    /// its clock and entropy refreshed; with `network`, one that has a
    /// network is served a broker with that policy. The snapshot's state
    /// must be of `expect` (its VMM wrote it, and may have been a
    /// guest's). Blocking.
    fn restore(
        &self,
        snapshot: &Path,
        network: Option<&NetworkSpec>,
        expect: &Expected,
    ) -> Result<Box<dyn BackendVm>, BackendError>;
    /// The `sha256:…` digest of a built-in image's disk, which a snapshot
    /// made on another host must have been made over (built first if need
    /// be; read whole the first time).
    fn disk_digest(&self, image: ImageName) -> Result<String, BackendError>;
    /// A snapshot's state from another host (a pulled template) made to
    /// name this host's files of `expect`'s image.
    fn rebase(&self, state: &[u8], expect: &Expected) -> Result<Vec<u8>, BackendError>;
    /// The golden volume of a writable disk (made once per size, and the
    /// same bytes wherever the same e2fsprogs makes it). Blocking.
    fn volume(&self, disk: &crate::template::TemplateDisk) -> Result<PathBuf, BackendError>;
}

/// One running VM as the daemon drives it (the VMM crate's `Machine` is
/// another thing). Dropping it stops the VM (blocking: call drop off the
/// async runtime).
pub trait BackendVm: Send + Sync {
    /// A client for its guest agent (cheap; one connection per call).
    fn agent(&self) -> AgentClient;
    /// The VMM's process id, if it is a process.
    fn pid(&self) -> Option<u32>;
    /// Whether the VM still runs. `Some(end)` once it ended by itself.
    fn exited(&self) -> Option<VmEnd>;
    /// How long it took to come up: spawn (or fork request) to the
    /// agent's answer.
    fn boot_time(&self) -> Duration;
    /// A fork child that replaced a lost one (its first VMM died or did
    /// not answer in time): why the first was lost.
    fn replaced(&self) -> Option<String>;
    /// Its VMM's cgroup, where the host gives VMMs one.
    fn cgroup(&self) -> Option<&VmCgroup>;
    /// Stop the vCPUs in place.
    fn pause(&self) -> Result<(), BackendError>;
    fn resume(&self) -> Result<(), BackendError>;
    /// Pause for good and move the memory to a copy-on-write file: the VM
    /// becomes a zygote, forked O(1) in its memory size. A warm-up command
    /// runs first (`sh -c true`), so that the shell and what it loads are
    /// in the page cache every fork shares; otherwise each sandbox's first
    /// command reads them from the image into its own guest memory (about
    /// 380 pages, 1.5 MiB, per sandbox for the `minimal` image's busybox).
    fn make_zygote(&self) -> Result<(), BackendError>;
    /// Writes the VM to `dir` (its memory, sparse, and its state), which
    /// [`Backend::restore`] starts again, in another daemon run or after
    /// a reboot; the VM keeps its run state. Returns the bytes written.
    fn snapshot(&self, dir: &Path) -> Result<u64, BackendError>;
    /// `n` copy-on-write children, running, each with its after-fork hook
    /// done (clock, entropy). The parent keeps its run state. `Err` when
    /// the request as a whole failed; otherwise one entry per child.
    /// Children get `opts.policy` (default: the parent's current one) and
    /// log their egress to `opts.egress_logs[i]` when given.
    fn fork_with(&self, n: usize, opts: &ForkOptions) -> Result<Vec<ChildVm>, BackendError> {
        forkbox_host::vm::in_order(
            n,
            |index| Err(BackendError::ForkChildMissing { index }),
            |on_child| self.fork_each(n, opts, on_child),
        )
    }
    /// [`fork_with`](Self::fork_with), giving each child to `on_child`
    /// (from any thread) with its index as soon as it is up, in the order
    /// they come up: the first children of a wide group are served before
    /// its last ones exist. `Err` (and no call) when the request as a
    /// whole failed; otherwise one call per index.
    fn fork_each(
        &self,
        n: usize,
        opts: &ForkOptions,
        on_child: &(dyn Fn(usize, ChildVm) + Sync),
    ) -> Result<(), BackendError>;
    /// Replaces the egress policy: new connections and DNS lookups follow
    /// it, open connections stay.
    fn set_network_policy(&self, policy: &Policy) -> Result<(), BackendError>;
    /// The egress policy in force; `None` for a VM without a network (one
    /// re-adopted without one: its broker died with the earlier daemon).
    fn network_policy(&self) -> Option<Policy>;
    /// Where another daemon run can find this VM again.
    fn handle(&self) -> Option<VmHandle>;
    /// Stops the VM now (SIGKILL), even while others hold this machine.
    fn kill(&self);
    /// The last `lines` lines of its serial console (kernel and agent
    /// messages since it started, or since it was forked).
    fn console(&self, lines: usize) -> String;
    /// What its VMM has counted (exits, control requests, vsock
    /// connections, network frames; `None` from a VMM older than its
    /// counters), waiting at most `within` for the answer. Blocking.
    fn vmm_counters(&self, within: Duration) -> Result<Option<VmmCounters>, BackendError>;
}

/// One child of [`BackendVm::fork_with`]: the VM, or why it did not come up.
pub type ChildVm = Result<Box<dyn BackendVm>, BackendError>;

/// The real thing: `forkbox_host::vm::Vm`.
pub struct VmBackend {
    assets: Assets,
    /// The image store, for disks that start with an image's files.
    images: Option<forkbox_image::Store>,
    orphan_grace: Duration,
    require_jail: bool,
}

impl VmBackend {
    /// Finds the kernel, initramfs and VMM (built once, cached). Its VMs
    /// end `orphan_grace` after this process died unless another adopts
    /// them. With `require_jail`, a VMM that cannot set up its whole jail
    /// refuses to run.
    pub fn new(orphan_grace: Duration, require_jail: bool) -> Result<Self, BackendError> {
        Ok(Self {
            assets: Assets::prepare().map_err(BackendError::Assets)?,
            images: None,
            orphan_grace,
            require_jail,
        })
    }

    /// Gives it the image store that disks' images come from.
    pub fn with_images(mut self, images: Option<forkbox_image::Store>) -> Self {
        self.images = images;
        self
    }
}

impl Backend for VmBackend {
    fn boot(&self, spec: &BackendVmSpec) -> Result<Box<dyn BackendVm>, BackendError> {
        let vm_spec = VmSpec {
            image: spec.image.clone(),
            vcpus: spec.vcpus,
            memory_mib: spec.memory_mib,
            serial_to_stderr: false,
            boot_timeout: spec.boot_timeout,
            vmm_env: Vec::new(),
            network: Some(spec.network.clone()),
            orphan_grace: self.orphan_grace,
            require_jail: self.require_jail,
            disks: spec
                .disks
                .iter()
                .map(|d| {
                    Ok(DiskSpec {
                        base: self.volume(d)?,
                        mount: d.path.clone(),
                    })
                })
                .collect::<Result<_, BackendError>>()?,
        };
        let vm = Vm::boot(&self.assets, &vm_spec).map_err(BackendError::Boot)?;
        Ok(ForkboxVm::boxed(vm))
    }

    fn adopt(
        &self,
        handle: &VmHandle,
        network: Option<&NetworkSpec>,
    ) -> Result<Box<dyn BackendVm>, BackendError> {
        let vm = Vm::adopt(handle, network).map_err(BackendError::Adopt)?;
        Ok(ForkboxVm::boxed(vm))
    }

    fn discard(&self, handle: &VmHandle) {
        Vm::discard(handle);
    }

    fn restore(
        &self,
        snapshot: &Path,
        network: Option<&NetworkSpec>,
        expect: &Expected,
    ) -> Result<Box<dyn BackendVm>, BackendError> {
        let vm = Vm::restore(&self.assets, snapshot, network, Some(expect))
            .map_err(BackendError::Restore)?;
        Ok(ForkboxVm::boxed(vm))
    }

    fn disk_digest(&self, image: ImageName) -> Result<String, BackendError> {
        forkbox_host::image::digest(image).map_err(|e| BackendError::Restore(e.into()))
    }

    fn rebase(&self, state: &[u8], expect: &Expected) -> Result<Vec<u8>, BackendError> {
        expect
            .rebase(state, &self.assets.modules)
            .map_err(BackendError::Restore)
    }

    fn volume(&self, disk: &crate::template::TemplateDisk) -> Result<PathBuf, BackendError> {
        let Some(id) = &disk.image_id else {
            return forkbox_host::volume::empty_ext4(disk.size_mib).map_err(BackendError::Volume);
        };
        // Laid out once per image and size: the image is read only then.
        let fill = |root: &Path, work: &Path| -> Result<(), String> {
            let store = self
                .images
                .as_ref()
                .ok_or("this daemon has no image store")?;
            let image = id
                .parse::<forkbox_image::Digest>()
                .map_err(|e| e.to_string())
                .and_then(|id| store.image(&id).map_err(|e| e.to_string()))?;
            let layers: Vec<_> = image
                .layers
                .iter()
                .map(|l| (store.blob_path(&l.blob), l.diff_id.clone()))
                .collect();
            forkbox_image::layer::unpack_merged(&layers, work, root)
                .map(|_| ())
                .map_err(|e| format!("image {id}: {e}"))
        };
        let key = id.strip_prefix("sha256:").unwrap_or(id);
        let key = &key[..key.len().min(16)];
        forkbox_host::volume::ext4_with_files(disk.size_mib, key, &fill)
            .map_err(BackendError::Volume)
    }
}

/// A `Vm` behind a lock: forks share it (`read`), run-state changes take
/// it whole (`write`).
struct ForkboxVm {
    vm: RwLock<Vm>,
    agent: AgentClient,
    pid: u32,
    boot_time: Duration,
    replaced: Option<String>,
    handle: VmHandle,
    /// Its control socket, asked without the lock (a fork or pause in
    /// progress must not hold up a metrics scrape).
    control: Control,
    /// How it ended, once seen (its VMM is reaped then: it is not seen
    /// twice).
    end: std::sync::OnceLock<VmEnd>,
    cgroup: Option<VmCgroup>,
}

impl ForkboxVm {
    fn boxed(vm: Vm) -> Box<dyn BackendVm> {
        Box::new(Self {
            // Its handshake bound suits a loaded host (`forkbox_host::vm`).
            agent: vm.agent().clone(),
            pid: vm.pid(),
            boot_time: vm.boot_time,
            replaced: vm.replaced.clone(),
            handle: vm.handle(),
            control: vm.control().clone(),
            end: std::sync::OnceLock::new(),
            cgroup: vm.cgroup().cloned(),
            vm: RwLock::new(vm),
        })
    }

    fn with_vm<T>(
        &self,
        what: &'static str,
        f: impl FnOnce(&mut Vm) -> Result<T, VmError>,
    ) -> Result<T, BackendError> {
        let mut vm = self.vm.write().unwrap_or_else(|p| p.into_inner());
        f(&mut vm).map_err(|source| BackendError::Control { what, source })
    }
}

impl BackendVm for ForkboxVm {
    fn agent(&self) -> AgentClient {
        self.agent.clone()
    }

    fn pid(&self) -> Option<u32> {
        Some(self.pid)
    }

    fn exited(&self) -> Option<VmEnd> {
        if let Some(end) = self.end.get() {
            return Some(end.clone());
        }
        // A fork in progress holds the VM shared: it is alive enough.
        let mut vm = match self.vm.try_write() {
            Ok(vm) => vm,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => return None,
        };
        let end = vm.ended()?;
        Some(self.end.get_or_init(|| end).clone())
    }

    fn boot_time(&self) -> Duration {
        self.boot_time
    }

    fn replaced(&self) -> Option<String> {
        self.replaced.clone()
    }

    fn cgroup(&self) -> Option<&VmCgroup> {
        self.cgroup.as_ref()
    }

    fn pause(&self) -> Result<(), BackendError> {
        self.with_vm("pausing the VM", Vm::pause)
    }

    fn resume(&self) -> Result<(), BackendError> {
        self.with_vm("resuming the VM", Vm::resume)
    }

    fn make_zygote(&self) -> Result<(), BackendError> {
        let memory = self.with_vm("making the VM a zygote", Vm::make_warm_zygote)?;
        tracing::info!(
            pid = self.handle.pid,
            mib = memory.bytes >> 20,
            huge_mib = memory.huge_bytes >> 20,
            "zygote memory file (huge_mib: in 2 MiB pages)"
        );
        Ok(())
    }

    fn handle(&self) -> Option<VmHandle> {
        Some(self.handle.clone())
    }

    fn snapshot(&self, dir: &Path) -> Result<u64, BackendError> {
        self.with_vm("writing the VM's snapshot", |vm| vm.snapshot(dir))
    }

    fn kill(&self) {
        self.vm.write().unwrap_or_else(|p| p.into_inner()).kill();
    }

    fn console(&self, lines: usize) -> String {
        self.vm
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .serial_tail(lines)
    }

    fn vmm_counters(&self, within: Duration) -> Result<Option<VmmCounters>, BackendError> {
        self.control
            .counters(within)
            .map_err(|e| BackendError::Control {
                what: "reading the VMM's counters",
                source: VmError::from(e),
            })
    }

    fn set_network_policy(&self, policy: &Policy) -> Result<(), BackendError> {
        self.vm
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .set_network_policy(policy)
            .map_err(|source| BackendError::Control {
                what: "changing the network policy",
                source,
            })
    }

    fn network_policy(&self) -> Option<Policy> {
        self.vm
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .network_policy()
    }

    fn fork_each(
        &self,
        n: usize,
        opts: &ForkOptions,
        on_child: &(dyn Fn(usize, ChildVm) + Sync),
    ) -> Result<(), BackendError> {
        let vm = self.vm.read().unwrap_or_else(|p| p.into_inner());
        vm.fork_each(n, opts, &|index, child| {
            on_child(
                index,
                child
                    .map(ForkboxVm::boxed)
                    .map_err(|source| BackendError::ForkChild { index, source }),
            )
        })
        .map_err(BackendError::Fork)
    }
}

/// A backend for tests without KVM.
#[cfg(test)]
pub(crate) mod fake {
    use std::collections::BTreeMap;
    use std::path::PathBuf;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed as ORD};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use forkbox_net::policy::Policy;
    use forkbox_proto::client::AgentClient;
    use forkbox_vmm_api::VmmCounters;
    use tokio::sync::watch;

    use super::{
        Backend, BackendError, BackendVm, BackendVmSpec, ChildVm, Expected, ForkOptions,
        NetworkSpec, Path, VmCgroup, VmEnd, VmError, VmHandle,
    };

    /// An agent on a unix socket in `dir`: says hello, reads one request,
    /// hands both to `then` (on a thread per connection).
    pub fn scripted_agent(
        dir: &std::path::Path,
        then: impl Fn(&mut std::os::unix::net::UnixStream, forkbox_proto::Request)
            + Send
            + Sync
            + 'static,
    ) -> std::path::PathBuf {
        use forkbox_proto::frame::{read_frame, write_frame};
        use forkbox_proto::{encode_control, FrameKind, Hello, PROTOCOL_VERSION};
        let sock = dir.join("agent.sock");
        let listener = std::os::unix::net::UnixListener::bind(&sock).expect("bind");
        let then = Arc::new(then);
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { return };
                let then = then.clone();
                std::thread::spawn(move || {
                    let hello = Hello {
                        protocol_version: PROTOCOL_VERSION,
                        agent_version: "scripted".into(),
                        boot: Default::default(),
                    };
                    if write_frame(&mut conn, FrameKind::Control, &encode_control(&hello)).is_err()
                    {
                        return;
                    }
                    let Ok(Some(f)) = read_frame(&mut conn, forkbox_proto::MAX_FRAME_LEN) else {
                        return;
                    };
                    let Ok(req) = forkbox_proto::decode_control(&f.body) else {
                        return;
                    };
                    then(&mut conn, req);
                });
            }
        });
        sock
    }

    /// VMs that boot and fork instantly (or fail to), with no agent
    /// behind them.
    #[derive(Default)]
    pub struct Fake {
        pub fail: bool,
        pub world: Arc<World>,
    }

    /// What the fake VMs share with the test.
    #[derive(Default)]
    pub struct World {
        /// VMs alive and stopped, sent as they change: a test reads them
        /// ([`World::vms`]) or awaits a count ([`World::vms_until`]).
        pub vms: watch::Sender<Vms>,
        pub boots: AtomicUsize,
        pub forks: AtomicUsize,
        /// Every child of a fork with this index fails.
        pub fail_child: AtomicUsize,
        /// Every machine says it replaced a lost fork child (this cause).
        pub replaced: Mutex<Option<String>>,
        pub fail_children: AtomicBool,
        /// The pids of the machines told to resume, in order.
        pub resumed: Mutex<Vec<u32>>,
        /// Handles given out (each machine's pid is its index here).
        pub handed: AtomicUsize,
        /// Pids of VMs discarded; adopting a pid listed in `gone` fails.
        pub discarded: std::sync::Mutex<Vec<u32>>,
        pub gone: std::sync::Mutex<Vec<u32>>,
        /// Where the machines' agent listens (default: nowhere).
        pub agent_sock: std::sync::Mutex<Option<std::path::PathBuf>>,
        /// The policy of every boot, in order.
        pub boot_policies: Mutex<Vec<Policy>>,
        /// The policy each zygote had when it became one.
        pub zygote_policies: Mutex<Vec<Option<Policy>>>,
        /// The egress log given to each fork child (none: `None`).
        pub egress_logs: Mutex<Vec<Option<PathBuf>>>,
        /// The cgroup limits asked for each fork's children, in order.
        pub fork_limits: Mutex<Vec<Option<forkbox_host::cgroup::Limits>>>,
        /// VMs that ended by themselves, by pid, with how they ended.
        pub lost: Mutex<BTreeMap<u32, VmEnd>>,
        /// What every machine's VMM counted (`None`: an older VMM).
        pub vmm_counters: Mutex<Option<VmmCounters>>,
        /// Machines (by pid) whose VMM does not answer: they fail at once.
        pub vmm_silent: Mutex<Vec<u32>>,
        /// Machines (by pid) whose VMM hangs: they block until the test
        /// sets `vmm_hang_over`, longer than any wait for them.
        pub vmm_hung: Mutex<Vec<u32>>,
        pub vmm_hang_over: (Mutex<bool>, std::sync::Condvar),
        /// VMs started from a snapshot.
        pub restores: AtomicUsize,
        /// Which build of the built-in images' disks this host has: a
        /// test sets another to play another host.
        pub disks: Mutex<u32>,
    }

    /// What became of the fake VMs.
    #[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
    pub struct Vms {
        /// Made (booted, forked or adopted) and not yet dropped.
        pub alive: usize,
        /// Stopped with [`BackendVm::kill`].
        pub kills: usize,
    }

    impl World {
        pub fn vms(&self) -> Vms {
            *self.vms.borrow()
        }

        /// Waits until `done` holds for the VMs' counts, which change
        /// where the daemon stops VMs: on its blocking pool. The bound is
        /// a hang guard, not a timing: past it the test fails saying what
        /// it waited for.
        pub async fn vms_until(&self, what: &str, done: impl FnMut(&Vms) -> bool) -> Vms {
            const HANG_GUARD: Duration = Duration::from_secs(30);
            let mut changes = self.vms.subscribe();
            // Copied out before returning: the answer borrows `changes`.
            let vms = match tokio::time::timeout(HANG_GUARD, changes.wait_for(done)).await {
                Ok(vms) => *vms.expect("the world holds the sender"),
                Err(_) => panic!(
                    "{what}: not so after {HANG_GUARD:?} (hang guard): {:?}",
                    self.vms()
                ),
            };
            vms
        }

        /// The VM handed out last ends by itself (`how`), not by its
        /// guest's doing: its `exited` says so from now on. Returns its pid.
        pub fn lose_last(&self, how: &str) -> u32 {
            self.end_last(how, false)
        }

        /// The guest of the VM handed out last ends it (`how`: powered
        /// off, say). Returns its pid.
        pub fn guest_ends_last(&self, how: &str) -> u32 {
            self.end_last(how, true)
        }

        fn end_last(&self, how: &str, by_guest: bool) -> u32 {
            let pid = self.handed.load(ORD) as u32 + 1000 - 1;
            let end = VmEnd {
                how: how.into(),
                by_guest,
            };
            self.lost.lock().expect("lost").insert(pid, end);
            pid
        }
    }

    struct FakeVm {
        world: Arc<World>,
        pid: u32,
        /// `None`: no network (re-adopted without one).
        policy: Mutex<Option<Policy>>,
    }

    impl FakeVm {
        fn boxed(world: &Arc<World>, policy: Option<Policy>) -> Box<dyn BackendVm> {
            let pid = world.handed.fetch_add(1, ORD) as u32 + 1000;
            Self::with_pid(world, pid, policy)
        }

        fn with_pid(world: &Arc<World>, pid: u32, policy: Option<Policy>) -> Box<dyn BackendVm> {
            world.vms.send_modify(|v| v.alive += 1);
            Box::new(Self {
                world: world.clone(),
                pid,
                policy: Mutex::new(policy),
            })
        }

        fn policy(&self) -> std::sync::MutexGuard<'_, Option<Policy>> {
            self.policy.lock().expect("policy")
        }
    }

    impl Backend for Fake {
        fn boot(&self, spec: &BackendVmSpec) -> Result<Box<dyn BackendVm>, BackendError> {
            if self.fail {
                return Err(BackendError::Unsupported("booting in this test"));
            }
            self.world.boots.fetch_add(1, ORD);
            let policy = spec.network.policy.clone();
            self.world
                .boot_policies
                .lock()
                .expect("boot_policies")
                .push(policy.clone());
            Ok(FakeVm::boxed(&self.world, Some(policy)))
        }

        fn adopt(
            &self,
            handle: &VmHandle,
            network: Option<&NetworkSpec>,
        ) -> Result<Box<dyn BackendVm>, BackendError> {
            let gone = self.world.gone.lock().expect("gone").contains(&handle.pid);
            if gone {
                return Err(BackendError::Unsupported("adopting a VM that is gone"));
            }
            let policy = network.map(|n| n.policy.clone());
            Ok(FakeVm::with_pid(&self.world, handle.pid, policy))
        }

        fn discard(&self, handle: &VmHandle) {
            self.world
                .discarded
                .lock()
                .expect("discarded")
                .push(handle.pid);
        }

        fn restore(
            &self,
            snapshot: &Path,
            network: Option<&NetworkSpec>,
            _expect: &Expected,
        ) -> Result<Box<dyn BackendVm>, BackendError> {
            // What `FakeVm::snapshot` wrote, or the restore fails as a
            // missing snapshot would.
            std::fs::read(snapshot.join("memory")).map_err(|e| {
                BackendError::Restore(VmError::Io(std::io::Error::new(
                    e.kind(),
                    format!("{}: {e}", snapshot.display()),
                )))
            })?;
            self.world.restores.fetch_add(1, ORD);
            let policy = network.map(|n| n.policy.clone());
            Ok(FakeVm::boxed(&self.world, policy))
        }

        fn disk_digest(
            &self,
            image: forkbox_host::image::ImageName,
        ) -> Result<String, BackendError> {
            let disks = self.world.disks.lock().expect("disks");
            Ok(format!("sha256:{:064}", *disks * 10 + image as u32))
        }

        fn rebase(&self, state: &[u8], _expect: &Expected) -> Result<Vec<u8>, BackendError> {
            Ok(state.to_vec())
        }

        fn volume(&self, disk: &crate::template::TemplateDisk) -> Result<PathBuf, BackendError> {
            Ok(PathBuf::from(format!("/fake/volume-{}m", disk.size_mib)))
        }
    }

    impl Drop for FakeVm {
        fn drop(&mut self) {
            self.world.vms.send_modify(|v| v.alive -= 1);
        }
    }

    impl BackendVm for FakeVm {
        fn agent(&self) -> AgentClient {
            let sock = self.world.agent_sock.lock().expect("agent_sock").clone();
            AgentClient::unix(sock.unwrap_or_else(|| "/nonexistent/forkbox-test.sock".into()))
        }
        fn pid(&self) -> Option<u32> {
            None
        }
        fn exited(&self) -> Option<VmEnd> {
            self.world
                .lost
                .lock()
                .expect("lost")
                .get(&self.pid)
                .cloned()
        }
        fn boot_time(&self) -> Duration {
            Duration::ZERO
        }
        fn replaced(&self) -> Option<String> {
            self.world.replaced.lock().expect("replaced").clone()
        }
        fn cgroup(&self) -> Option<&VmCgroup> {
            None
        }
        fn pause(&self) -> Result<(), BackendError> {
            Ok(())
        }
        fn resume(&self) -> Result<(), BackendError> {
            self.world.resumed.lock().expect("resumed").push(self.pid);
            Ok(())
        }
        fn make_zygote(&self) -> Result<(), BackendError> {
            let policy = self.policy().clone();
            self.world
                .zygote_policies
                .lock()
                .expect("zygote_policies")
                .push(policy);
            Ok(())
        }
        fn kill(&self) {
            self.world.vms.send_modify(|v| v.kills += 1);
        }
        fn console(&self, lines: usize) -> String {
            (0..lines).map(|i| format!("line {i}\n")).collect()
        }
        fn vmm_counters(&self, _within: Duration) -> Result<Option<VmmCounters>, BackendError> {
            if self
                .world
                .vmm_hung
                .lock()
                .expect("vmm_hung")
                .contains(&self.pid)
            {
                let (over, cond) = &self.world.vmm_hang_over;
                let mut over = over.lock().expect("vmm_hang_over");
                while !*over {
                    over = cond.wait(over).expect("vmm_hang_over");
                }
            }
            if self
                .world
                .vmm_silent
                .lock()
                .expect("vmm_silent")
                .contains(&self.pid)
            {
                return Err(BackendError::Unsupported("a silent VMM in this test"));
            }
            Ok(*self.world.vmm_counters.lock().expect("vmm_counters"))
        }
        fn handle(&self) -> Option<VmHandle> {
            Some(VmHandle {
                dir: format!("/nonexistent/vm-{}", self.pid).into(),
                pid: self.pid,
            })
        }
        fn snapshot(&self, dir: &Path) -> Result<u64, BackendError> {
            let memory = format!("the memory of fake VM {}", self.pid);
            std::fs::create_dir_all(dir)
                .and_then(|()| std::fs::write(dir.join("memory"), &memory))
                .and_then(|()| {
                    let state = r#"{"hardware":{"layers":[],"disks":["/fake/disk"]}}"#;
                    std::fs::write(dir.join("state.json"), state)
                })
                .map_err(|e| BackendError::Control {
                    what: "writing the VM's snapshot",
                    source: VmError::Io(e),
                })?;
            Ok(memory.len() as u64)
        }
        fn set_network_policy(&self, policy: &Policy) -> Result<(), BackendError> {
            match &mut *self.policy() {
                Some(p) => {
                    *p = policy.clone();
                    Ok(())
                }
                None => Err(BackendError::Unsupported(
                    "a network policy on a VM without a network",
                )),
            }
        }
        fn network_policy(&self) -> Option<Policy> {
            self.policy().clone()
        }
        fn fork_each(
            &self,
            n: usize,
            opts: &ForkOptions,
            on_child: &(dyn Fn(usize, ChildVm) + Sync),
        ) -> Result<(), BackendError> {
            self.world.forks.fetch_add(1, ORD);
            self.world
                .fork_limits
                .lock()
                .expect("fork_limits")
                .push(opts.limits);
            // As `Vm::fork_with`: a parent without a network ignores
            // `opts`, and its children have none either.
            let policy = self
                .policy()
                .clone()
                .map(|p| opts.policy.clone().unwrap_or(p));
            let mut logs = self.world.egress_logs.lock().expect("egress_logs");
            logs.extend((0..n).map(|i| opts.egress_logs.get(i).cloned()));
            drop(logs);
            let failing = self
                .world
                .fail_children
                .load(ORD)
                .then(|| self.world.fail_child.load(ORD));
            // The last child first: callers must not count on the order.
            for i in (0..n).rev() {
                on_child(
                    i,
                    if failing == Some(i) {
                        Err(BackendError::Unsupported("this fork child in this test"))
                    } else {
                        Ok(FakeVm::boxed(&self.world, policy.clone()))
                    },
                );
            }
            Ok(())
        }
    }
}
