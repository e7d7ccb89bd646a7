//! The daemon proper: the registry (`core`) plus the VMs (`backend`), the
//! templates, the caps' waiting, the TTL reaper and the metrics. Transports
//! hand it typed values only.
//!
//! Lifecycle requests arrive as one [`Lifecycle`] enum through
//! [`Daemon::execute`]. Commands and file transfers stream bytes both ways,
//! so they are methods of their own ([`Daemon::exec`],
//! [`Daemon::read_file`], ...), still taking typed requests. So are
//! background processes ([`Daemon::spawn_process`],
//! [`Daemon::wait_process`], [`Daemon::attach`], ...)
//! and port forwards ([`Daemon::open_port`]: a host listener whose
//! connections are relayed to a guest port through the agent; every
//! forward of a sandbox closes when it dies).
//!
//! Every sandbox has a network, egress denied unless its policy allows: a
//! creation brings its own policy (none: deny all), fork children inherit
//! their parent's current one, and [`Lifecycle::SetNetwork`] replaces it.
//! A template's policy holds only while it bakes; its zygote is set to
//! deny all before it becomes one. Egress logs ([`Daemon::egress`]) are
//! files the daemon owns (`crate::network`), kept past a sandbox's death
//! until [`Config::egress_log_ttl`].
//!
//! This module owns the daemon's shared state (the registry, the live
//! VMs, the templates) and the helpers every part uses; each concern is a
//! module of its own:
//!
//! - `lifecycle`: typed lifecycle commands: create, kill, pause, fork.
//! - `network`: sandboxes' egress policies and egress logs.
//! - `guest`: calls into a running sandbox's guest agent: commands,
//!   background processes, files; a dead VM found there is marked lost.
//! - `files`: a running sandbox's files, through its guest agent.
//! - `ports`: host listeners relayed to guest ports.
//! - `templates`: the template registry, bakes and their zygotes.
//! - `reaper`: TTLs and VMs that ended by themselves.
//! - `recovery`: writing live VMs down, and re-adopting them after a
//!   restart.
//! - `registry`: baked templates pushed to a registry and pulled from one.
//! - `view`: sandboxes as the API shows them.
//! - `vmm_metrics`: the VMMs' own counters, summed for `/metrics`.
//! - `error`: why a request failed ([`DaemonError`]).

mod error;
mod files;
mod guest;
mod integrity;
mod lifecycle;
mod network;
mod ports;
mod reaper;
mod recovery;
mod registry;
mod templates;
#[cfg(test)]
mod testing;
mod upload;
mod view;
mod vmm_metrics;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use forkbox_net::policy::Policy;
use tokio::sync::{mpsc, Notify};

use crate::backend::{Backend, BackendVm};
use crate::core::{
    CoreError, DeathCause, Labels, Limits, Record, Registry, SandboxId, SandboxState,
};
use crate::metrics::Metrics;
use crate::network::EgressLogs;
use crate::persist::Store;
use crate::template::{ResolvedImage, TemplateSpec};

pub use error::{chain, DaemonError};
pub use files::{Download, Transfer};
pub use guest::{AttachEvent, ExecEvent, ProcessEnded};
pub use integrity::{Baseline, IntegrityReport};
pub use lifecycle::{CreateSandbox, Lifecycle, Reply};
pub use ports::PortForwardInfo;
pub use registry::{RegistryEvent, RegistryRequest};
pub use templates::{BakeEvent, BakeFailure};
pub use upload::{Upload, UploadFailure, CHUNKS_IN_FLIGHT};
pub use view::{NetworkInfo, SandboxInfo, SandboxMetrics};
pub use vmm_metrics::VMM_COUNTERS_WAIT;

use ports::PortForward;
use templates::{Template, Zygote};

/// How the daemon is tuned.
#[derive(Debug, Clone)]
pub struct Config {
    pub limits: Limits,
    /// Longest a creation waits for room under the caps before failing.
    pub create_wait: Duration,
    pub boot_timeout: Duration,
    /// How long a sandbox's egress log is kept after it died.
    pub egress_log_ttl: Duration,
    pub bounds: Bounds,
    /// Host memory every creation must leave available, in bytes, after
    /// what it is predicted to take (`core::predicted_memory`); a creation
    /// that does not fit waits for room as under the caps, then fails.
    pub memory_reserve: u64,
    /// Reads the host's available memory in bytes (`MemAvailable`);
    /// `None`: unknown, and nothing is refused for memory.
    pub host_memory: fn() -> Option<u64>,
    /// The image store templates may name images of, and who this daemon
    /// is to it (its pins are `<holder>: template <name>`); `None`: only
    /// the built-in images.
    pub images: Option<(forkbox_image::Store, String)>,
}

/// The host's available memory (`MemAvailable`), in bytes.
pub fn host_memory_available() -> Option<u64> {
    forkbox_host::measure::mem_available_kib().map(|kib| kib << 10)
}

/// The default [`Config::memory_reserve`] for a host of `total` bytes: a
/// sixteenth of it, 256 MiB to 2 GiB.
pub fn default_memory_reserve(total: u64) -> u64 {
    (total / 16).clamp(256 << 20, 2 << 30)
}

/// The default cap on live sandboxes for a host of `total` bytes of
/// memory of which `reserve` stay free: as many as fit at
/// [`PREDICTED_FLOOR`](crate::core::PREDICTED_FLOOR) each (a fork child's
/// own memory with room to spare), 16 to [`MAX_LIVE_DEFAULT_CAP`]. What
/// each template's sandboxes really take is checked at every admission
/// as well (`core::predicted_memory`).
pub fn default_max_live(total: u64, reserve: u64) -> usize {
    let fit = total.saturating_sub(reserve) / crate::core::PREDICTED_FLOOR;
    usize::try_from(fit)
        .unwrap_or(usize::MAX)
        .clamp(16, MAX_LIVE_DEFAULT_CAP)
}

/// The most [`default_max_live`] gives, however large the host.
pub const MAX_LIVE_DEFAULT_CAP: usize = 4096;

/// What bounds the daemon's work for a guest or a client: no agent call
/// holds a thread past its deadline, and no transfer past its size.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    /// Every agent call but a command's (files, processes, ports) ends
    /// within this; past it the guest is the one that did not answer.
    pub agent_call: Duration,
    /// Longest a command may run (one without a `timeout` gets this one),
    /// and the longest wait on or attach to a background process.
    pub max_exec: Duration,
    /// A file read or tar download without `max_bytes` stops past this.
    pub download_default: u64,
    /// The most `max_bytes` may ask for.
    pub download_max: u64,
    /// Largest file, tar or stdin upload body (buffered whole).
    pub upload_max: usize,
    /// On top of a command's own timeout (or a process wait's), for the
    /// agent to kill it (2 s grace), send what is left of its output and
    /// answer, on a slow host: [`EXEC_MARGIN`].
    pub exec_margin: Duration,
}

/// The default [`Bounds::exec_margin`].
pub const EXEC_MARGIN: Duration = Duration::from_secs(30);

/// Bound on starting a template's image service (the agent answers with
/// its pid once it is started; it does not wait for it).
pub const SERVICE_START: Duration = Duration::from_secs(60);

impl Default for Bounds {
    fn default() -> Self {
        Self {
            agent_call: Duration::from_secs(300),
            max_exec: Duration::from_secs(24 * 3600),
            download_default: 256 << 20,
            download_max: 4 << 30,
            upload_max: 1 << 30,
            exec_margin: EXEC_MARGIN,
        }
    }
}

impl Bounds {
    /// The deadline of an agent call that waits up to `wait` on the
    /// guest's own clock (a command's timeout, a process wait).
    pub fn waiting(&self, wait: Duration) -> Duration {
        wait.saturating_add(self.exec_margin)
    }
}

impl Default for Config {
    fn default() -> Self {
        Self {
            limits: Limits::default(),
            create_wait: Duration::from_secs(30),
            boot_timeout: Duration::from_secs(120),
            egress_log_ttl: Duration::from_secs(24 * 3600),
            bounds: Bounds::default(),
            memory_reserve: 256 << 20,
            host_memory: host_memory_available,
            images: None,
        }
    }
}

struct Live {
    machine: Arc<dyn BackendVm>,
    /// Its egress policy as last set (what is written down; the machine
    /// says what is in force).
    policy: Policy,
    /// Its image's `Env` under its template's variables under its own.
    envs: BTreeMap<String, String>,
    /// Where its commands start when they do not say: its image's
    /// `WorkingDir` (`None`: the agent's default).
    cwd: Option<String>,
    /// Whom its commands and file calls act as when they name nobody
    /// (`ResolvedImage::default_user`).
    user: forkbox_proto::User,
    /// Its template's recipe and resources (a template made from the
    /// sandbox copies them).
    spec: TemplateSpec,
    /// Its template's stored image (`None`: a built-in image), which a
    /// template made from the sandbox boots too.
    image_id: Option<forkbox_image::Digest>,
    /// Open port forwards by guest port; they close with the sandbox
    /// (dropping one stops its listener and its connections).
    ports: BTreeMap<u16, PortForward>,
    /// Its template's protected paths as baked, if it protects any.
    baseline: Option<Arc<Baseline>>,
}

struct Shared {
    registry: Registry,
    machines: HashMap<SandboxId, Live>,
    templates: BTreeMap<String, Template>,
}

struct Inner {
    backend: Arc<dyn Backend>,
    config: Config,
    /// Where live VMs are written down, when the daemon keeps state.
    store: Option<Store>,
    egress: EgressLogs,
    shared: Mutex<Shared>,
    room: Notify,
    metrics: Metrics,
    /// Sandboxes whose VMM has a metrics question out.
    asking: vmm_metrics::Asking,
}

impl Shared {
    /// A sandbox that can be forked (or made a template, or have its network
    /// read or changed): running or paused.
    fn forkable(
        &self,
        id: &SandboxId,
        wanted: &'static str,
    ) -> Result<(&Record, &Live), DaemonError> {
        let r = self.registry.get(id)?;
        if !matches!(r.state, SandboxState::Running | SandboxState::Paused) {
            return Err(DaemonError::State(CoreError::WrongState {
                id: id.clone(),
                state: r.state,
                wanted,
                needs: "running or paused",
            }));
        }
        let live = self
            .machines
            .get(id)
            .ok_or_else(|| DaemonError::NoSandbox(id.clone()))?;
        Ok((r, live))
    }
}

/// The daemon. Cheap to clone.
#[derive(Clone)]
pub struct Daemon {
    inner: Arc<Inner>,
}

impl Daemon {
    /// A daemon that keeps no state: its VMs die with it, and its egress
    /// logs are in a temporary directory removed with it.
    pub fn new(backend: Arc<dyn Backend>, config: Config) -> std::io::Result<Self> {
        let egress = EgressLogs::temporary(config.egress_log_ttl)?;
        Ok(Self::with_store(backend, config, None, egress))
    }

    /// A daemon that writes its live VMs down in `store`, so that its next
    /// run can [`recover`](Self::recover) them, and keeps the sandboxes'
    /// egress logs in `egress`.
    pub fn with_store(
        backend: Arc<dyn Backend>,
        config: Config,
        store: Option<Store>,
        egress: EgressLogs,
    ) -> Self {
        let salt = std::process::id()
            ^ (SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map(|d| d.subsec_nanos())
                .unwrap_or(0));
        let templates = [
            forkbox_host::image::ImageName::Minimal,
            forkbox_host::image::ImageName::Debian,
            forkbox_host::image::ImageName::Docker,
        ]
        .into_iter()
        .map(|i| {
            let t = Template {
                drop_on_failure: false,
                ..Template::new(
                    TemplateSpec::builtin(i),
                    ResolvedImage::builtin(i),
                    Zygote::None { error: None },
                )
            };
            (i.as_str().to_owned(), t)
        })
        .collect();
        let limits = config.limits;
        Self {
            inner: Arc::new(Inner {
                backend,
                config,
                store,
                egress,
                shared: Mutex::new(Shared {
                    registry: Registry::new(limits, salt),
                    machines: HashMap::new(),
                    templates,
                }),
                room: Notify::new(),
                metrics: Metrics::default(),
                asking: vmm_metrics::Asking::default(),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Shared> {
        self.inner.shared.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The metrics as they are, the VMMs' counters as the last
    /// [`scrape`](Self::scrape) found them.
    pub fn metrics_text(&self) -> String {
        let (live, creating) = {
            let s = self.lock();
            (s.registry.live(), s.registry.creating())
        };
        self.inner.metrics.render(live, creating)
    }

    /// How the daemon bounds guests and clients.
    pub fn bounds(&self) -> &Bounds {
        &self.inner.config.bounds
    }

    /// Counts a failed request by kind (the HTTP edge calls this).
    pub fn count_error(&self, e: &DaemonError) {
        self.inner.metrics.error(e.kind());
    }

    /// Whom calls to sandbox `id` act as when they name nobody: its
    /// image's unprivileged user (for a sandbox that is not there, the
    /// built-in images' `user`: the call itself then fails saying why).
    pub fn default_user(&self, id: &SandboxId) -> forkbox_proto::User {
        let s = self.lock();
        s.machines
            .get(id)
            .map_or_else(crate::template::builtin_user, |live| live.user.clone())
    }

    fn machine(&self, id: &SandboxId) -> Result<Arc<dyn BackendVm>, DaemonError> {
        let s = self.lock();
        usable(&s, id)?;
        Ok(s.machines
            .get(id)
            .ok_or_else(|| DaemonError::NoSandbox(id.clone()))?
            .machine
            .clone())
    }

    fn machine_any(&self, id: &SandboxId) -> Result<Arc<dyn BackendVm>, DaemonError> {
        let s = self.lock();
        s.registry.get(id)?;
        Ok(s.machines
            .get(id)
            .ok_or_else(|| DaemonError::NoSandbox(id.clone()))?
            .machine
            .clone())
    }

    /// Stops every VM (daemon shutdown).
    pub async fn shutdown(&self) {
        let ids: Vec<SandboxId> = self
            .lock()
            .registry
            .select(&Labels::new(), false)
            .into_iter()
            .map(|r| r.id.clone())
            .collect();
        for id in &ids {
            let _ = self.kill(id, DeathCause::DaemonStopped);
        }
        let zygotes: Vec<Arc<dyn BackendVm>> = {
            let mut s = self.lock();
            s.templates
                .values_mut()
                .filter_map(|t| {
                    match std::mem::replace(&mut t.zygote, Zygote::None { error: None }) {
                        Zygote::Ready { machine, .. } => {
                            // A saved template's record and snapshot
                            // stay: the next run starts it from there.
                            if let (Some(store), None) = (&self.inner.store, t.saved_bytes) {
                                store.forget_template(&t.spec.name);
                            }
                            Some(machine)
                        }
                        _ => None,
                    }
                })
                .collect()
        };
        zygotes.into_iter().for_each(reap);
        // Let the reaping threads finish.
        let _ = blocking(|| ()).await;
    }
}

/// Sends `item` from the blocking pool, waiting for room at most until
/// `deadline`: a client that stops reading cannot hold the thread.
/// `false` if the receiver is gone or did not take it in time.
fn send_until<T: Send>(tx: &mpsc::Sender<T>, item: T, deadline: Instant) -> bool {
    let left = deadline.saturating_duration_since(Instant::now());
    match tokio::runtime::Handle::try_current() {
        Ok(h) => h
            .block_on(tokio::time::timeout(left, tx.send(item)))
            .is_ok_and(|sent| sent.is_ok()),
        Err(_) => tx.try_send(item).is_ok(),
    }
}

/// `now + d`, or far in the future when that overflows (a bound too long
/// to matter).
fn deadline_in(d: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(d)
        .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 24 * 3600))
}

/// Runs `f` on the blocking pool.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, DaemonError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| DaemonError::infra("a blocking task failed", e))
}

/// Stops a VM at once, whoever else still holds it (a command or file
/// call in flight ends with its connection), and drops our hold off the
/// request path (teardown takes tens of ms).
fn reap(machine: Arc<dyn BackendVm>) {
    let stop = move || {
        machine.kill();
        drop(machine);
    };
    match tokio::runtime::Handle::try_current() {
        Ok(h) => {
            h.spawn_blocking(stop);
        }
        Err(_) => stop(),
    }
}

/// Whether `id` may take a request now; a sandbox whose guest ended its VM
/// is reported as the guest's doing ([`DaemonError::GuestEnded`]), not as
/// a plain wrong state.
fn usable(s: &Shared, id: &SandboxId) -> Result<(), DaemonError> {
    let Err(e) = s.registry.check_usable(id) else {
        return Ok(());
    };
    match s.registry.get(id).ok().and_then(|r| r.died.as_ref()) {
        Some((_, DeathCause::GuestEnded { reason })) => Err(DaemonError::GuestEnded {
            what: format!("sandbox {id} died: {reason}"),
        }),
        _ => Err(e.into()),
    }
}
