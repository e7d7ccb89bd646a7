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
//! - `view`: sandboxes as the API shows them.
//! - `vmm_metrics`: the VMMs' own counters, summed for `/metrics`.
//! - `error`: why a request failed ([`DaemonError`]).

mod error;
mod files;
mod guest;
mod lifecycle;
mod network;
mod ports;
mod reaper;
mod recovery;
mod templates;
#[cfg(test)]
mod testing;
mod view;
mod vmm_metrics;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use forkbox_net::policy::Policy;
use tokio::sync::Notify;

use crate::backend::{Backend, BackendVm};
use crate::core::{
    CoreError, DeathCause, Labels, Limits, Record, Registry, SandboxId, SandboxState,
};
use crate::metrics::Metrics;
use crate::network::EgressLogs;
use crate::persist::Store;
use crate::template::TemplateSpec;

pub use error::{chain, DaemonError};
pub use guest::{AttachEvent, ExecEvent, ProcessEnded};
pub use lifecycle::{CreateSandbox, Lifecycle, Reply};
pub use ports::PortForwardInfo;
pub use templates::{BakeEvent, BakeFailure};
pub use view::{NetworkInfo, SandboxInfo, SandboxMetrics};
pub use vmm_metrics::VMM_COUNTERS_WAIT;

use ports::PortForward;
use templates::{Template, Zygote};

/// How the daemon is tuned.
#[derive(Debug, Clone, Copy)]
pub struct Config {
    pub limits: Limits,
    /// Longest a creation waits for room under the caps before failing.
    pub create_wait: Duration,
    pub boot_timeout: Duration,
    /// How long a sandbox's egress log is kept after it died.
    pub egress_log_ttl: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            limits: Limits::default(),
            create_wait: Duration::from_secs(30),
            boot_timeout: Duration::from_secs(120),
            egress_log_ttl: Duration::from_secs(24 * 3600),
        }
    }
}

struct Live {
    machine: Arc<dyn BackendVm>,
    /// Its egress policy as last set (what is written down; the machine
    /// says what is in force).
    policy: Policy,
    envs: BTreeMap<String, String>,
    /// Its template's recipe and resources (a template made from the
    /// sandbox copies them).
    spec: TemplateSpec,
    /// Open port forwards by guest port; they close with the sandbox
    /// (dropping one stops its listener and its connections).
    ports: BTreeMap<u16, PortForward>,
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
        ]
        .into_iter()
        .map(|i| {
            let t = Template {
                spec: TemplateSpec::builtin(i),
                from_sandbox: None,
                drop_on_failure: false,
                zygote: Zygote::None { error: None },
            };
            (i.as_str().to_owned(), t)
        })
        .collect();
        Self {
            inner: Arc::new(Inner {
                backend,
                config,
                store,
                egress,
                shared: Mutex::new(Shared {
                    registry: Registry::new(config.limits, salt),
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

    /// Counts a failed request by kind (the HTTP edge calls this).
    pub fn count_error(&self, e: &DaemonError) {
        self.inner.metrics.error(e.kind());
    }

    fn machine(&self, id: &SandboxId) -> Result<Arc<dyn BackendVm>, DaemonError> {
        let s = self.lock();
        s.registry.check_usable(id)?;
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
                            if let Some(store) = &self.inner.store {
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
