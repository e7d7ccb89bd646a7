//! [`GvisorBackend`]: the [`Backend`] on gVisor (`forkbox_host::gvisor`),
//! for hosts without hardware virtualization. The same agent serves each
//! sandbox, so commands, files, processes and ports go through the same
//! service code; what differs is how a sandbox is made and forked:
//!
//! - boot: `runsc run` of a built-in image's files;
//! - zygote: one warm-up command, then a checkpoint; the sandbox itself
//!   ends (the checkpoint is the zygote);
//! - fork: restores of the zygote's checkpoint, or of a checkpoint of the
//!   running sandbox taken for that fork (it goes on running);
//! - snapshot: the checkpoint in a directory, restored by [`Backend::restore`];
//! - network: each sandbox's own broker and gateway, as a microVM's
//!   (`forkbox_host::gvisor::SandboxNet`): the same policy, allowlist and
//!   egress log. gVisor cannot checkpoint a TCP connection a process of
//!   the sandbox holds: a fork or snapshot then fails by name (those no
//!   process holds any more are ended first).
//!
//! Not here yet, each refused with its own error: images of the store,
//! writable disks, re-adopting sandboxes of an earlier daemon run, pulled
//! templates, and the policy's cgroup bounds inside a sandbox (the
//! sandbox as a whole has its template's memory and CPUs as the limits of
//! runsc's cgroup).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use forkbox_host::cgroup::VmCgroup;
use forkbox_host::gvisor::{GvisorError, Runsc, Sandbox, SandboxNet, SandboxSpec};
use forkbox_host::image::ImageName;
use forkbox_host::vm::{Expected, RootImage, VmEnd, VmHandle};
use forkbox_net::policy::Policy;
use forkbox_proto::client::AgentClient;
use forkbox_proto::ExecRequest;
use forkbox_vmm_api::VmmCounters;

use crate::backend::{
    Backend, BackendError, BackendVm, BackendVmSpec, ChildVm, ForkOptions, NetworkSpec,
};

/// The file beside a snapshot's checkpoint that names its image.
const SNAPSHOT_NOTE: &str = "gvisor.json";

/// Sandboxes under gVisor.
pub struct GvisorBackend {
    runsc: Arc<Runsc>,
    /// Checkpoints of zygotes and of running parents mid-fork.
    checkpoints: PathBuf,
    dir: PathBuf,
    /// A directory of its own, removed with it.
    _temporary: Option<Arc<tempfile::TempDir>>,
}

impl GvisorBackend {
    /// [`new`](Self::new) in a temporary directory of its own (runsc's
    /// state, the sandboxes' bundles, the checkpoints), removed when the
    /// backend is dropped.
    ///
    /// What a daemon that died left there is cleared first: a sandbox ends
    /// itself when its daemon dies (its agent's stdin closes), but a
    /// paused one cannot, so its runsc state is swept here.
    pub fn temporary() -> Result<Self, BackendError> {
        sweep_dead(&std::env::temp_dir());
        let dir = tempfile::Builder::new()
            .prefix(TEMPORARY_PREFIX)
            .tempdir()
            .map_err(io_error("making a directory", &std::env::temp_dir()))?;
        let owner = dir.path().join(OWNER);
        std::fs::write(&owner, std::process::id().to_string())
            .map_err(io_error("writing the owner's pid", &owner))?;
        let mut backend = Self::new(dir.path())?;
        backend._temporary = Some(Arc::new(dir));
        Ok(backend)
    }

    /// Where its state is.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Finds `runsc` and keeps its state, bundles and checkpoints under
    /// `dir`.
    pub fn new(dir: &Path) -> Result<Self, BackendError> {
        let runsc = Runsc::find(dir).map_err(|source| BackendError::Gvisor {
            what: "finding runsc",
            source,
        })?;
        let checkpoints = dir.join("checkpoints");
        std::fs::create_dir_all(&checkpoints)
            .map_err(io_error("making the checkpoints' directory", &checkpoints))?;
        Ok(Self {
            runsc: Arc::new(runsc),
            checkpoints,
            dir: dir.to_owned(),
            _temporary: None,
        })
    }
}

/// The temporary directories of [`GvisorBackend::temporary`], in the
/// system's temporary directory.
const TEMPORARY_PREFIX: &str = "forkboxd-gvisor-";
/// The pid of the process whose directory it is.
const OWNER: &str = "owner";

/// Ends the sandboxes of, and removes, the temporary directories under
/// `tmp` whose owner no longer runs.
fn sweep_dead(tmp: &Path) {
    let Ok(entries) = std::fs::read_dir(tmp) else {
        return;
    };
    for dir in entries.filter_map(|e| e.ok()).map(|e| e.path()) {
        let is_ours = dir
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with(TEMPORARY_PREFIX));
        let owner = std::fs::read_to_string(dir.join(OWNER))
            .ok()
            .and_then(|p| p.trim().parse::<u32>().ok());
        let Some(owner) = owner.filter(|_| is_ours) else {
            continue;
        };
        if !forkbox_host::measure::exited(owner) {
            continue;
        }
        let swept = Runsc::find(&dir).map(|runsc| runsc.delete_all());
        tracing::info!(
            dir = %dir.display(),
            owner,
            sandboxes = swept.unwrap_or(0),
            "swept the gVisor sandboxes of a forkboxd that died"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

fn io_error<'a>(
    what: &'static str,
    path: &'a Path,
) -> impl FnOnce(std::io::Error) -> BackendError + 'a {
    move |source| BackendError::Gvisor {
        what,
        source: GvisorError::Io {
            what: "on the host",
            path: path.to_owned(),
            source,
        },
    }
}

fn gvisor(what: &'static str) -> impl FnOnce(GvisorError) -> BackendError {
    move |source| BackendError::Gvisor { what, source }
}

fn sandbox_net(network: &NetworkSpec) -> SandboxNet {
    SandboxNet {
        policy: network.policy.clone(),
        egress_log: network.egress_log.clone(),
    }
}

fn builtin(image: &RootImage) -> Result<ImageName, BackendError> {
    match image {
        RootImage::Builtin(name) => Ok(*name),
        RootImage::Layers(_) => Err(BackendError::Unsupported(
            "images of the store (`forkbox image import`) on the gVisor backend: it runs the \
             built-in images",
        )),
    }
}

impl Backend for GvisorBackend {
    fn boot(&self, spec: &BackendVmSpec) -> Result<Box<dyn BackendVm>, BackendError> {
        let name = builtin(&spec.image)?;
        if !spec.disks.is_empty() {
            return Err(BackendError::Unsupported(
                "writable disks on the gVisor backend",
            ));
        }
        let sandbox_spec = SandboxSpec {
            memory_mib: Some(spec.memory_mib),
            cpus: Some(spec.vcpus),
            net: Some(sandbox_net(&spec.network)),
            ..SandboxSpec::image(name).map_err(gvisor("preparing the image"))?
        };
        let sandbox =
            Sandbox::start(&self.runsc, &sandbox_spec).map_err(gvisor("starting the sandbox"))?;
        Ok(GvisorVm::boxed(
            &self.runsc,
            &self.checkpoints,
            name,
            sandbox_spec,
            sandbox,
        ))
    }

    fn adopt(
        &self,
        _handle: &VmHandle,
        _network: Option<&NetworkSpec>,
    ) -> Result<Box<dyn BackendVm>, BackendError> {
        Err(BackendError::Unsupported(
            "re-adopting a sandbox of an earlier daemon run on the gVisor backend",
        ))
    }

    fn discard(&self, _handle: &VmHandle) {}

    fn restore(
        &self,
        snapshot: &Path,
        network: Option<&NetworkSpec>,
        expect: &Expected,
    ) -> Result<Box<dyn BackendVm>, BackendError> {
        let name = builtin(&expect.image)?;
        let note = snapshot.join(SNAPSHOT_NOTE);
        let said: Option<String> = std::fs::read(&note)
            .ok()
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
            .and_then(|v| v["image"].as_str().map(str::to_string));
        if said.as_deref() != Some(name.as_str()) {
            return Err(BackendError::Unsupported(
                "restoring a snapshot the gVisor backend did not make (or of another image)",
            ));
        }
        let spec = SandboxSpec {
            net: network.map(sandbox_net),
            ..SandboxSpec::image(name).map_err(gvisor("preparing the image"))?
        };
        let (sandbox, _report) = Sandbox::restore(&self.runsc, &spec, snapshot, None)
            .map_err(gvisor("restoring the sandbox"))?;
        Ok(GvisorVm::boxed(
            &self.runsc,
            &self.checkpoints,
            name,
            spec,
            sandbox,
        ))
    }

    fn disk_digest(&self, image: ImageName) -> Result<String, BackendError> {
        forkbox_host::image::digest(image).map_err(|e| BackendError::Restore(e.into()))
    }

    fn rebase(&self, _state: &[u8], _expect: &Expected) -> Result<Vec<u8>, BackendError> {
        Err(BackendError::Unsupported(
            "templates pulled from another host on the gVisor backend",
        ))
    }

    fn volume(&self, _disk: &crate::template::TemplateDisk) -> Result<PathBuf, BackendError> {
        Err(BackendError::Unsupported(
            "writable disks on the gVisor backend",
        ))
    }
}

/// What a [`GvisorVm`] is now.
enum State {
    Running(Box<Sandbox>),
    /// Made a zygote: its checkpoint, which its forks restore.
    Zygote(PathBuf),
    Killed,
}

/// One sandbox as the daemon drives it.
struct GvisorVm {
    runsc: Arc<Runsc>,
    checkpoints: PathBuf,
    image: ImageName,
    spec: SandboxSpec,
    agent: AgentClient,
    pid: Option<u32>,
    boot_time: Duration,
    state: Mutex<State>,
    policy: Mutex<Policy>,
}

impl GvisorVm {
    fn boxed(
        runsc: &Arc<Runsc>,
        checkpoints: &Path,
        image: ImageName,
        spec: SandboxSpec,
        sandbox: Sandbox,
    ) -> Box<dyn BackendVm> {
        let policy = spec
            .net
            .as_ref()
            .map_or_else(Policy::deny_all, |n| n.policy.clone());
        Box::new(Self {
            runsc: Arc::clone(runsc),
            checkpoints: checkpoints.to_owned(),
            image,
            spec,
            agent: sandbox.agent(),
            pid: sandbox.pid(),
            boot_time: sandbox.ready_after,
            state: Mutex::new(State::Running(Box::new(sandbox))),
            policy: Mutex::new(policy),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A fresh directory for a checkpoint of this sandbox.
    fn checkpoint_dir(&self) -> PathBuf {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.checkpoints
            .join(format!("{}-{n}", self.pid.unwrap_or_default()))
    }

    fn running<T>(
        &self,
        what: &'static str,
        f: impl FnOnce(&Sandbox) -> Result<T, GvisorError>,
    ) -> Result<T, BackendError> {
        match &*self.state() {
            State::Running(sandbox) => f(sandbox).map_err(gvisor(what)),
            State::Zygote(_) => Err(BackendError::Unsupported(
                "this on a zygote (it is a checkpoint now)",
            )),
            State::Killed => Err(BackendError::Unsupported("this on a killed sandbox")),
        }
    }
}

impl Drop for GvisorVm {
    fn drop(&mut self) {
        if let State::Zygote(dir) = &*self.state() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

impl BackendVm for GvisorVm {
    fn agent(&self) -> AgentClient {
        self.agent.clone()
    }

    fn pid(&self) -> Option<u32> {
        self.pid
    }

    fn exited(&self) -> Option<VmEnd> {
        match &*self.state() {
            State::Running(sandbox) if sandbox.ended() => Some(VmEnd {
                how: "its gVisor sandbox ended".into(),
                by_guest: false,
            }),
            State::Running(_) | State::Zygote(_) => None,
            State::Killed => Some(VmEnd {
                how: "killed".into(),
                by_guest: false,
            }),
        }
    }

    fn boot_time(&self) -> Duration {
        self.boot_time
    }

    fn replaced(&self) -> Option<String> {
        None
    }

    fn cgroup(&self) -> Option<&VmCgroup> {
        None
    }

    fn pause(&self) -> Result<(), BackendError> {
        self.running("pausing the sandbox", Sandbox::pause)
    }

    fn resume(&self) -> Result<(), BackendError> {
        self.running("resuming the sandbox", Sandbox::resume)
    }

    fn make_zygote(&self) -> Result<(), BackendError> {
        let dir = self.checkpoint_dir();
        let mut state = self.state();
        let State::Running(sandbox) = &*state else {
            return Err(BackendError::Unsupported(
                "making a zygote of what is not a running sandbox",
            ));
        };
        // As on KVM: what the shell loads is then in the checkpoint, which
        // every fork shares.
        let warm = sandbox
            .agent()
            .exec(&ExecRequest::shell("true"), None, &mut |_, _| {});
        if let Err(e) = warm {
            tracing::warn!("the zygote's warm-up command failed: {e}");
        }
        sandbox
            .checkpoint(&dir)
            .map_err(gvisor("checkpointing the zygote"))?;
        tracing::info!(
            bytes = forkbox_host::gvisor::checkpoint_bytes(&dir),
            checkpoint = %dir.display(),
            "gVisor zygote checkpointed"
        );
        // The sandbox itself is no longer needed: dropping it ends it.
        *state = State::Zygote(dir);
        Ok(())
    }

    fn snapshot(&self, dir: &Path) -> Result<u64, BackendError> {
        match &*self.state() {
            State::Running(sandbox) => sandbox
                .checkpoint(dir)
                .map_err(gvisor("checkpointing the sandbox"))?,
            State::Zygote(from) => {
                let copy = || -> std::io::Result<()> {
                    std::fs::create_dir_all(dir)?;
                    for entry in std::fs::read_dir(from)? {
                        let entry = entry?;
                        std::fs::copy(entry.path(), dir.join(entry.file_name()))?;
                    }
                    Ok(())
                };
                copy().map_err(io_error("copying the zygote's checkpoint", dir))?;
            }
            State::Killed => {
                return Err(BackendError::Unsupported("a snapshot of a killed sandbox"))
            }
        }
        let note = serde_json::json!({"backend": "gvisor", "image": self.image.as_str()});
        let note_path = dir.join(SNAPSHOT_NOTE);
        std::fs::write(&note_path, note.to_string())
            .map_err(io_error("writing the snapshot's note", &note_path))?;
        Ok(forkbox_host::gvisor::checkpoint_bytes(dir))
    }

    fn fork_each(
        &self,
        n: usize,
        opts: &ForkOptions,
        on_child: &(dyn Fn(usize, ChildVm) + Sync),
    ) -> Result<(), BackendError> {
        let policy = opts.policy.clone().unwrap_or_else(|| self.policy());
        // A running sandbox is checkpointed for this fork; a zygote already is.
        let (image, temporary) = {
            let state = self.state();
            match &*state {
                State::Zygote(dir) => (dir.clone(), false),
                State::Running(sandbox) => {
                    let dir = self.checkpoint_dir();
                    sandbox
                        .checkpoint(&dir)
                        .map_err(gvisor("checkpointing the sandbox to fork it"))?;
                    (dir, true)
                }
                State::Killed => return Err(BackendError::Unsupported("forking a killed sandbox")),
            }
        };
        // The children's limits, where the fork gives them.
        let mut spec = self.spec.clone();
        if let Some(limits) = &opts.limits {
            spec.memory_mib = limits
                .memory_max
                .map(|bytes| u32::try_from(bytes >> 20).unwrap_or(u32::MAX));
            spec.cpus = Some(
                u8::try_from(
                    limits
                        .cpu_quota_us
                        .div_ceil(forkbox_host::cgroup::CPU_PERIOD_US),
                )
                .unwrap_or(u8::MAX),
            );
        }
        // Each child's network is its own: its policy, its egress log.
        let spec_of = |i: usize| SandboxSpec {
            net: spec.net.as_ref().map(|_| SandboxNet {
                policy: policy.clone(),
                egress_log: opts.egress_logs.get(i).cloned(),
            }),
            ..spec.clone()
        };
        Sandbox::restore_each(
            &self.runsc,
            &spec_of,
            &image,
            n,
            &opts.seeds,
            &|index, child| {
                let child = child
                    .map(|(sandbox, _report)| {
                        GvisorVm::boxed(
                            &self.runsc,
                            &self.checkpoints,
                            self.image,
                            spec_of(index),
                            sandbox,
                        )
                    })
                    .map_err(gvisor("restoring a fork child"));
                on_child(index, child)
            },
        );
        if temporary {
            let _ = std::fs::remove_dir_all(&image);
        }
        Ok(())
    }

    fn set_network_policy(&self, policy: &Policy) -> Result<(), BackendError> {
        if let State::Running(sandbox) = &*self.state() {
            sandbox
                .set_network_policy(policy)
                .map_err(gvisor("changing the network policy"))?;
        }
        // A zygote's forks start with it.
        *self.policy.lock().unwrap_or_else(PoisonError::into_inner) = policy.clone();
        Ok(())
    }

    fn network_policy(&self) -> Option<Policy> {
        self.spec.net.as_ref()?;
        Some(self.policy())
    }

    fn handle(&self) -> Option<VmHandle> {
        None
    }

    fn kill(&self) {
        let mut state = self.state();
        if let State::Running(sandbox) = &*state {
            sandbox.kill();
        }
        if let State::Zygote(dir) = &*state {
            let _ = std::fs::remove_dir_all(dir);
        }
        *state = State::Killed;
    }

    fn console(&self, lines: usize) -> String {
        match &*self.state() {
            State::Running(sandbox) => {
                let text = sandbox.console();
                let all: Vec<&str> = text.lines().collect();
                all[all.len().saturating_sub(lines)..].join("\n")
            }
            _ => String::new(),
        }
    }

    fn vmm_counters(&self, _within: Duration) -> Result<Option<VmmCounters>, BackendError> {
        Ok(None)
    }
}

impl GvisorVm {
    fn policy(&self) -> Policy {
        self.policy
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A dead process's pid: a child that ran and was reaped.
    fn dead_pid() -> u32 {
        let mut child = std::process::Command::new("true").spawn().expect("true");
        let pid = child.id();
        child.wait().expect("wait");
        pid
    }

    #[test]
    fn a_dead_daemons_paused_sandbox_is_swept_and_a_live_ones_is_not() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dead = tmp.path().join(format!("{TEMPORARY_PREFIX}dead"));
        let live = tmp.path().join(format!("{TEMPORARY_PREFIX}live"));
        let runsc = Arc::new(Runsc::find(&dead).expect("runsc (make runsc)"));
        let spec = SandboxSpec::image(ImageName::Minimal).expect("the minimal image");
        let sandbox = Sandbox::start(&runsc, &spec).expect("a sandbox");
        sandbox.pause().expect("pause");
        let sentry = sandbox.pid().expect("its pid");
        // As a daemon that died: nothing ends it but the sweep.
        std::mem::forget(sandbox);
        std::fs::write(dead.join(OWNER), dead_pid().to_string()).expect("owner");
        std::fs::create_dir_all(&live).expect("mkdir");
        std::fs::write(live.join(OWNER), std::process::id().to_string()).expect("owner");
        sweep_dead(tmp.path());
        assert!(!dead.exists(), "the dead daemon's directory is still there");
        assert!(live.exists(), "a live daemon's directory was swept");
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !forkbox_host::measure::exited(sentry) {
            assert!(
                std::time::Instant::now() < deadline,
                "sandbox {sentry} still runs"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}
