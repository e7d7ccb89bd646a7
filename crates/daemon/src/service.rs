//! The daemon proper: the registry (`core`) plus the VMs (`backend`), the
//! templates, the caps' waiting, the TTL reaper and the metrics. Transports
//! hand it typed values only.
//!
//! Lifecycle requests arrive as one [`Command`] enum through
//! [`Daemon::execute`]. Commands and file transfers stream bytes both ways,
//! so they are methods of their own ([`Daemon::exec`], [`Daemon::files`]),
//! still taking typed requests. So are background processes
//! ([`Daemon::spawn_process`], [`Daemon::process`], [`Daemon::attach`])
//! and port forwards ([`Daemon::open_port`]: a host listener whose
//! connections are relayed to a guest port through the agent; every
//! forward of a sandbox closes when it dies).
//!
//! Every sandbox has a network, egress denied unless its policy allows: a
//! creation brings its own policy (none: deny all), fork children inherit
//! their parent's current one, and [`Command::SetNetwork`] replaces it.
//! A template's policy holds only while it bakes; its zygote is set to
//! deny all before it becomes one. Egress logs ([`Daemon::egress`]) are
//! files the daemon owns (`crate::network`), kept past a sandbox's death
//! until [`Config::egress_log_ttl`].

use std::collections::{BTreeMap, HashMap};
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use forkbox_net::log::EgressRecord;
use forkbox_net::policy::Policy;
use forkbox_proto::client::{AgentClient, ClientError};
use forkbox_proto::{AgentError, ErrorKind as GuestKind, ExecRequest, ExecResult, OutputStream};
use serde::Serialize;
use tokio::sync::{mpsc, watch, Notify};
use utoipa::ToSchema;

use crate::backend::{self, Backend, BackendError, ForkOptions, Machine, NetworkSpec};
use crate::core::{
    Admission, CoreError, DeathCause, ExpiryAction, Labels, Limits, Record, Registry, SandboxId,
    SandboxState,
};
use crate::metrics::Metrics;
use crate::network::{EgressLogs, NetworkPolicy};
use crate::persist::{SavedSandbox, SavedTemplate, Store};
use crate::template::{TemplateError, TemplateInfo, TemplateSpec, TemplateState};

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

/// A sandbox creation.
#[derive(Debug, Clone, Default)]
pub struct CreateSandbox {
    pub template: String,
    pub ttl: Option<Duration>,
    pub on_expiry: ExpiryAction,
    pub labels: Labels,
    /// Environment for every command run in the sandbox.
    pub envs: BTreeMap<String, String>,
    /// Overrides [`Config::create_wait`] (zero: fail at once when full).
    pub wait: Option<Duration>,
    /// Its egress policy; `None`: deny all. Never the template's (that
    /// one holds only while the template bakes).
    pub network: Option<Policy>,
}

/// Every lifecycle request.
#[derive(Debug, Clone)]
pub enum Command {
    Create(CreateSandbox),
    Info {
        id: SandboxId,
    },
    List {
        labels: Labels,
        include_dead: bool,
    },
    Kill {
        id: SandboxId,
    },
    KillByLabel {
        labels: Labels,
    },
    SetTimeout {
        id: SandboxId,
        ttl: Option<Duration>,
        on_expiry: Option<ExpiryAction>,
    },
    Pause {
        id: SandboxId,
    },
    Resume {
        id: SandboxId,
    },
    Fork {
        id: SandboxId,
        count: u32,
    },
    /// The egress policy of a running or paused sandbox.
    Network {
        id: SandboxId,
    },
    /// Replaces it: new connections and DNS lookups follow the new
    /// policy, open connections stay.
    SetNetwork {
        id: SandboxId,
        policy: Policy,
    },
}

/// What a [`Command`] returns.
#[derive(Debug)]
pub enum Reply {
    Sandbox(Box<SandboxInfo>),
    Sandboxes(Vec<SandboxInfo>),
    Killed(Vec<SandboxId>),
    /// One entry per fork child, in order.
    Forked(Vec<Result<SandboxInfo, DaemonError>>),
    Network(NetworkInfo),
}

/// Why a request failed. [`DaemonError::is_infrastructure`] separates the
/// sandbox infrastructure failing from the caller's own mistakes.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("{0}")]
    Invalid(String),
    #[error("no sandbox {0}")]
    NoSandbox(SandboxId),
    #[error("no template {0:?}")]
    NoTemplate(String),
    #[error("template {0:?} exists")]
    TemplateExists(String),
    #[error("bad template")]
    BadTemplate(#[source] TemplateError),
    #[error("{0}")]
    State(CoreError),
    #[error("no room after waiting {waited_ms} ms")]
    Capacity {
        waited_ms: u64,
        #[source]
        cause: CoreError,
    },
    /// The request conflicts with work in progress (a bake, say).
    #[error("{0}")]
    Busy(String),
    #[error("{0} is not supported by this backend")]
    Unsupported(&'static str),
    /// Its VM has no network to change: re-adopted from state an older
    /// daemon wrote, without a policy to serve it.
    #[error(
        "sandbox {0} has no network broker (re-adopted without one); its policy cannot change"
    )]
    NoNetwork(SandboxId),
    /// The guest refused a file operation (missing path, permissions…).
    #[error("the guest refused")]
    Guest(#[source] AgentError),
    /// A template's setup or readiness step failed: the recipe's fault.
    #[error("template step {step} failed: {message}")]
    Recipe {
        step: String,
        message: String,
        output: String,
    },
    /// The VM, its VMM or the agent channel failed.
    #[error("sandbox infrastructure failed: {what}")]
    Infrastructure {
        what: String,
        #[source]
        cause: Option<Box<dyn std::error::Error + Send + Sync>>,
    },
}

impl DaemonError {
    /// A short name for the error's class, used in the JSON body and in
    /// `/metrics`.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Invalid(_) | Self::BadTemplate(_) => "invalid_request",
            Self::NoSandbox(_) | Self::NoTemplate(_) => "not_found",
            Self::TemplateExists(_) | Self::State(_) | Self::Busy(_) | Self::NoNetwork(_) => {
                "conflict"
            }
            Self::Capacity { .. } => "capacity",
            Self::Unsupported(_) => "unsupported",
            Self::Guest(_) => "guest",
            Self::Recipe { .. } => "template_failed",
            Self::Infrastructure { .. } => "infrastructure",
        }
    }

    /// True when the sandbox machinery failed rather than the request or
    /// the user's command: training loops mask these instead of scoring
    /// them.
    pub fn is_infrastructure(&self) -> bool {
        matches!(self, Self::Infrastructure { .. })
    }

    fn infra(
        what: impl Into<String>,
        cause: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Self::Infrastructure {
            what: what.into(),
            cause: Some(Box::new(cause)),
        }
    }
}

impl From<CoreError> for DaemonError {
    fn from(e: CoreError) -> Self {
        match e {
            CoreError::NotFound(id) => Self::NoSandbox(id),
            e => Self::State(e),
        }
    }
}

impl From<BackendError> for DaemonError {
    fn from(e: BackendError) -> Self {
        match e {
            BackendError::Unsupported(what) => Self::Unsupported(what),
            e => Self::infra("the VM backend failed", e),
        }
    }
}

/// The chain of an error's causes, `: `-joined.
pub use forkbox_proto::error_chain as chain;

/// A sandbox as the API shows it.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct SandboxInfo {
    pub id: SandboxId,
    pub template: String,
    pub state: SandboxState,
    pub metadata: Labels,
    /// Seconds since the Unix epoch, at admission.
    pub created_at: u64,
    /// Since the sandbox became ready, in milliseconds.
    pub uptime_ms: Option<u64>,
    /// The time-to-live in seconds, `null` for none.
    pub timeout_secs: Option<f64>,
    pub on_timeout: ExpiryAction,
    /// Milliseconds until the time-to-live runs out.
    pub expires_in_ms: Option<u64>,
    /// The sandbox this one was forked from.
    pub parent: Option<SandboxId>,
    pub children: Vec<SandboxId>,
    /// How the sandbox started: always `fork` (of its template's zygote,
    /// or of `parent`).
    pub started_by: &'static str,
    /// Admission to ready, in milliseconds.
    pub create_ms: Option<u64>,
    pub metrics: Option<SandboxMetrics>,
    /// Why it died.
    pub death: Option<DeathCause>,
}

/// A sandbox's egress policy as the API shows it.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct NetworkInfo {
    #[serde(flatten)]
    pub policy: NetworkPolicy,
    /// Whether the policy is in force. False only for a sandbox without
    /// a network broker (re-adopted from state an older daemon wrote, or
    /// forked from such a zygote): it opens no new connection whatever
    /// the policy says (the policy shown is the one recorded).
    pub active: bool,
}

/// What the host sees of a live sandbox's VMM process.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct SandboxMetrics {
    pub vmm_pid: Option<u32>,
    /// Resident memory of the VMM process (guest RAM touched plus the VMM).
    pub memory_rss_kib: Option<u64>,
    /// CPU time of the VMM process (all vCPUs plus devices).
    pub cpu_ms: Option<u64>,
    pub boot_ms: u64,
    /// Set when the first VM forked for this sandbox was lost (its VMM
    /// died, or it did not answer in time) and this one replaced it: what
    /// kind of loss (`triple fault`, `hang`, `VMM died`, ...). The full
    /// cause is in forkboxd's log.
    pub replaced_lost_child: Option<String>,
}

/// One event of a streamed command.
#[derive(Debug)]
pub enum ExecEvent {
    Output(OutputStream, Vec<u8>),
    Exit(ExecResult),
    Failed(DaemonError),
}

/// One event of a template bake.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum BakeEvent {
    /// A step began: `boot`, `setup[N]`, `ready`, `stop`.
    Step {
        step: String,
        detail: String,
    },
    /// Output of a setup or readiness command.
    Output {
        stream: String,
        data: String,
    },
    /// The zygote is up: sandboxes from the template fork it.
    Done {
        template: Box<TemplateInfo>,
        /// The bake's boot, and the whole bake (0 and 0 when it was baked
        /// before this request).
        boot_ms: u64,
        total_ms: u64,
    },
    Failed(BakeFailure),
}

/// Why a bake failed, as its stream's last event says.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct BakeFailure {
    pub step: String,
    pub kind: String,
    pub message: String,
    pub output: String,
}

impl BakeFailure {
    fn of(step: String, e: &DaemonError) -> Self {
        Self {
            step,
            kind: e.kind().into(),
            message: chain(e),
            output: match e {
                DaemonError::Recipe { output, .. } => output.clone(),
                _ => String::new(),
            },
        }
    }

    /// The error a creation that waited on this bake returns.
    fn to_error(&self, template: &str) -> DaemonError {
        if self.kind == "template_failed" {
            DaemonError::Recipe {
                step: self.step.clone(),
                message: format!("baking template {template:?}: {}", self.message),
                output: self.output.clone(),
            }
        } else {
            DaemonError::Infrastructure {
                what: format!(
                    "baking template {template:?} failed at {}: {}",
                    self.step, self.message
                ),
                cause: None,
            }
        }
    }
}

struct Live {
    machine: Arc<dyn Machine>,
    /// Its egress policy as last set (what is written down; the machine
    /// says what is in force).
    policy: Policy,
    envs: BTreeMap<String, String>,
    /// Its template's recipe and resources (a snapshot copies them).
    spec: TemplateSpec,
    /// Open port forwards by guest port; they close with the sandbox
    /// (dropping one stops its listener and its connections).
    ports: BTreeMap<u16, PortForward>,
}

/// A host listener relaying each connection to a guest port.
struct PortForward {
    host: SocketAddr,
    task: tokio::task::AbortHandle,
}

impl Drop for PortForward {
    fn drop(&mut self) {
        // The task owns the listener and every relay: all close.
        self.task.abort();
    }
}

/// An open port forward.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct PortForwardInfo {
    /// The guest port.
    pub port: u16,
    /// Where to connect on the host: `127.0.0.1:NNNNN`.
    pub host: String,
}

/// What reattaching to a background process yields.
#[derive(Debug)]
pub enum AttachEvent {
    Output(OutputStream, Vec<u8>),
    /// `dropped` bytes had left the guest's bounded buffer; `result` is
    /// `None` while the process runs.
    End {
        dropped: u64,
        result: Option<ExecResult>,
    },
    Failed(DaemonError),
}

/// `None` while the bake runs, then its outcome.
type BakeWatch = watch::Receiver<Option<Result<(), BakeFailure>>>;

/// A template and its zygote.
struct Template {
    spec: TemplateSpec,
    from_sandbox: Option<SandboxId>,
    /// Made by a request (not built in): a failed first bake unregisters
    /// it, so the same name can be tried again.
    drop_on_failure: bool,
    zygote: Zygote,
}

enum Zygote {
    None {
        error: Option<String>,
    },
    Baking(BakeWatch),
    Ready {
        machine: Arc<dyn Machine>,
        bake_ms: u64,
    },
}

impl Template {
    fn info(&self) -> TemplateInfo {
        let (state, error, bake_ms, pid) = match &self.zygote {
            Zygote::None { error: None } => (TemplateState::NotBaked, None, None, None),
            Zygote::None { error } => (TemplateState::Failed, error.clone(), None, None),
            Zygote::Baking(_) => (TemplateState::Baking, None, None, None),
            Zygote::Ready { machine, bake_ms } => {
                (TemplateState::Ready, None, Some(*bake_ms), machine.pid())
            }
        };
        TemplateInfo {
            spec: self.spec.clone(),
            state,
            from_sandbox: self.from_sandbox.clone(),
            error,
            bake_ms,
            zygote_pid: pid,
            zygote_rss_kib: pid.and_then(backend::rss_kib),
        }
    }
}

/// What asking for a bake found.
enum BakeStart {
    Ready,
    /// This call started it: the events go to the sender it was given.
    Started(BakeWatch),
    /// Another bake of the template runs.
    InProgress(BakeWatch),
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
}

impl Shared {
    /// A sandbox that can be forked (or snapshot, or have its network
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
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Shared> {
        self.inner.shared.lock().unwrap_or_else(|p| p.into_inner())
    }

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

    /// Runs a lifecycle command.
    pub async fn execute(&self, cmd: Command) -> Result<Reply, DaemonError> {
        match cmd {
            Command::Create(req) => {
                // Its own task: a client that hangs up mid-boot does not
                // abandon a half-registered VM.
                let this = self.clone();
                let task = tokio::spawn(async move { this.create(req).await });
                task.await
                    .map_err(|e| DaemonError::infra("the creation task failed", e))?
                    .map(|i| Reply::Sandbox(Box::new(i)))
            }
            Command::Info { id } => {
                let s = self.lock();
                let r = s.registry.get(&id)?;
                Ok(Reply::Sandbox(Box::new(info(r, s.machines.get(&id)))))
            }
            Command::List {
                labels,
                include_dead,
            } => {
                let s = self.lock();
                Ok(Reply::Sandboxes(
                    s.registry
                        .select(&labels, include_dead)
                        .into_iter()
                        .map(|r| info(r, s.machines.get(&r.id)))
                        .collect(),
                ))
            }
            Command::Kill { id } => {
                self.kill(&id, DeathCause::Killed)?;
                Ok(Reply::Killed(vec![id]))
            }
            Command::KillByLabel { labels } => {
                if labels.is_empty() {
                    return Err(DaemonError::Invalid(
                        "kill by label needs at least one label (refusing to kill everything)"
                            .into(),
                    ));
                }
                let ids: Vec<SandboxId> = self
                    .lock()
                    .registry
                    .select(&labels, false)
                    .into_iter()
                    .map(|r| r.id.clone())
                    .collect();
                let mut killed = Vec::new();
                for id in ids {
                    // Another request may have killed it meanwhile.
                    if self.kill(&id, DeathCause::Killed).is_ok() {
                        killed.push(id);
                    }
                }
                Ok(Reply::Killed(killed))
            }
            Command::SetTimeout { id, ttl, on_expiry } => {
                let mut s = self.lock();
                s.registry
                    .set_timeout(&id, ttl, on_expiry, Instant::now())?;
                self.save(&s, &id);
                let r = s.registry.get(&id)?;
                Ok(Reply::Sandbox(Box::new(info(r, s.machines.get(&id)))))
            }
            Command::Pause { id } => {
                let m = self.machine(&id)?;
                blocking(move || m.pause()).await??;
                let mut s = self.lock();
                s.registry.paused(&id)?;
                self.save(&s, &id);
                let r = s.registry.get(&id)?;
                Ok(Reply::Sandbox(Box::new(info(r, s.machines.get(&id)))))
            }
            Command::Resume { id } => {
                let m = self.machine_any(&id)?;
                blocking(move || m.resume()).await??;
                let mut s = self.lock();
                s.registry.resumed(&id, Instant::now())?;
                self.save(&s, &id);
                let r = s.registry.get(&id)?;
                Ok(Reply::Sandbox(Box::new(info(r, s.machines.get(&id)))))
            }
            Command::Fork { id, count } => {
                if count == 0 || count > 256 {
                    return Err(DaemonError::Invalid("count must be 1-256".into()));
                }
                // Its own task, as for creations.
                let this = self.clone();
                let task = tokio::spawn(async move { this.fork(id, count as usize).await });
                task.await
                    .map_err(|e| DaemonError::infra("the fork task failed", e))?
                    .map(Reply::Forked)
            }
            Command::Network { id } => {
                let (machine, recorded) = {
                    let s = self.lock();
                    let (_, live) = s.forkable(&id, "read its network policy")?;
                    (live.machine.clone(), live.policy.clone())
                };
                let in_force = blocking(move || machine.network_policy()).await?;
                Ok(Reply::Network(network_info(in_force, &recorded)))
            }
            Command::SetNetwork { id, policy } => {
                let machine = {
                    let s = self.lock();
                    s.forkable(&id, "change its network policy")?
                        .1
                        .machine
                        .clone()
                };
                let p = policy.clone();
                let in_force = blocking(move || {
                    if machine.network_policy().is_none() {
                        return Ok(None);
                    }
                    machine.set_network_policy(&p)?;
                    Ok::<_, BackendError>(machine.network_policy())
                })
                .await??
                .ok_or_else(|| DaemonError::NoNetwork(id.clone()))?;
                let mut s = self.lock();
                // Killed meanwhile: nothing left to record.
                if let Some(live) = s.machines.get_mut(&id) {
                    live.policy = policy.clone();
                }
                self.save(&s, &id);
                Ok(Reply::Network(network_info(Some(in_force), &policy)))
            }
        }
    }

    /// The last `limit` records of a sandbox's egress log, live or dead
    /// (until its log TTL), oldest first. A known sandbox without a log
    /// file (nothing logged yet, or deleted after the TTL) has an empty
    /// one; an unknown id is `NoSandbox` unless a log of it is left (its
    /// record forgotten, or from an earlier daemon run).
    pub async fn egress(
        &self,
        id: &SandboxId,
        limit: usize,
    ) -> Result<Vec<EgressRecord>, DaemonError> {
        let known = self.lock().registry.get(id).is_ok();
        let this = self.clone();
        let target = id.clone();
        match blocking(move || this.inner.egress.read(&target, limit)).await? {
            Ok(Some(records)) => Ok(records),
            Ok(None) if known => Ok(Vec::new()),
            Ok(None) => Err(DaemonError::NoSandbox(id.clone())),
            Err(e) => Err(DaemonError::infra(
                format!("reading the egress log of {id}"),
                e,
            )),
        }
    }

    /// A sandbox from a template: a fork of the template's zygote, baked
    /// first if it is not yet.
    async fn create(&self, req: CreateSandbox) -> Result<SandboxInfo, DaemonError> {
        let (zygote, template) = match self.zygote(&req.template).await {
            Ok(z) => z,
            Err(e) => {
                if !matches!(e, DaemonError::NoTemplate(_)) {
                    self.inner.metrics.creations_failed.fetch_add(1, ORD);
                }
                return Err(e);
            }
        };
        let id = self
            .admit(
                Admission {
                    template: template.name.clone(),
                    labels: req.labels,
                    ttl: req.ttl,
                    on_expiry: req.on_expiry,
                    parent: None,
                },
                req.wait.unwrap_or(self.inner.config.create_wait),
            )
            .await?;
        let started = Instant::now();
        let mut envs = template.envs.clone();
        envs.extend(req.envs);
        let policy = req.network.unwrap_or_else(Policy::deny_all);
        let opts = ForkOptions {
            policy: Some(policy.clone()),
            egress_logs: vec![self.inner.egress.path(&id)],
        };
        let forked = blocking(move || fork_one(&*zygote, &opts, "forking the template's zygote"))
            .await
            .and_then(|r| r);
        let now = Instant::now();
        let result = match forked {
            Err(e) => {
                let _ = self.lock().registry.creation_failed(&id, now, chain(&e));
                self.inner.egress.retire(&id, now);
                self.inner.metrics.creations_failed.fetch_add(1, ORD);
                Err(e)
            }
            Ok(machine) => {
                self.note_replaced(&id, &*machine);
                let machine: Arc<dyn Machine> = Arc::from(machine);
                let mut s = self.lock();
                match s.registry.created(&id, now) {
                    Ok(()) => {
                        s.machines.insert(
                            id.clone(),
                            Live {
                                machine,
                                policy,
                                envs,
                                spec: template,
                                ports: BTreeMap::new(),
                            },
                        );
                        self.save(&s, &id);
                        self.inner.metrics.creations_ok.fetch_add(1, ORD);
                        self.inner.metrics.create_latency.observe(started.elapsed());
                        let r = s.registry.get(&id)?;
                        Ok(info(r, s.machines.get(&id)))
                    }
                    Err(e) => {
                        // Killed while it was booting.
                        drop(s);
                        reap(machine);
                        Err(e.into())
                    }
                }
            }
        };
        self.inner.room.notify_waiters();
        result
    }

    /// Admits under the caps, waiting up to `wait` for room.
    async fn admit(&self, adm: Admission, wait: Duration) -> Result<SandboxId, DaemonError> {
        let start = Instant::now();
        loop {
            let notified = self.inner.room.notified();
            let attempt =
                self.lock()
                    .registry
                    .admit(adm.clone(), Instant::now(), SystemTime::now());
            match attempt {
                Ok(id) => return Ok(id),
                Err(e) if e.is_capacity() => {
                    let left = wait.saturating_sub(start.elapsed());
                    if left.is_zero() {
                        return Err(DaemonError::Capacity {
                            waited_ms: start.elapsed().as_millis() as u64,
                            cause: e,
                        });
                    }
                    // Woken when room frees; the bound also covers a
                    // wake-up that raced the check above.
                    let _ =
                        tokio::time::timeout(left.min(Duration::from_millis(250)), notified).await;
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    fn kill(&self, id: &SandboxId, cause: DeathCause) -> Result<(), DaemonError> {
        let expired = cause == DeathCause::Expired;
        let machine = {
            let mut s = self.lock();
            s.registry.kill(id, Instant::now(), cause)?;
            s.machines.remove(id)
        };
        if let Some(store) = &self.inner.store {
            store.forget_sandbox(id);
        }
        self.inner.egress.retire(id, Instant::now());
        if expired {
            self.inner.metrics.expiries.fetch_add(1, ORD);
        } else {
            self.inner.metrics.kills.fetch_add(1, ORD);
        }
        if let Some(live) = machine {
            reap(live.machine);
        }
        self.inner.room.notify_waiters();
        Ok(())
    }

    /// Writes a live sandbox down (when the daemon keeps state).
    fn save(&self, s: &Shared, id: &SandboxId) {
        let Some(store) = &self.inner.store else {
            return;
        };
        let (Ok(r), Some(live)) = (s.registry.get(id), s.machines.get(id)) else {
            return;
        };
        let Some(vm) = live.machine.handle() else {
            return;
        };
        store.save_sandbox(&SavedSandbox {
            id: id.clone(),
            template: r.template.clone(),
            paused: r.state == SandboxState::Paused,
            labels: r.labels.clone(),
            ttl_secs: r.ttl.map(|t| t.as_secs_f64()),
            on_expiry: r.on_expiry,
            deadline_unix_ms: SavedSandbox::deadline_of(r, Instant::now(), SystemTime::now()),
            parent: r.parent.clone(),
            created_unix: r.created_unix,
            envs: live.envs.clone(),
            spec: live.spec.clone(),
            vm,
            network: Some(live.policy.clone()),
        });
    }

    /// Takes back every VM an earlier run of the daemon wrote down: baked
    /// templates' zygotes first, then sandboxes (parents before children).
    /// A VM that cannot be adopted (its VMM died, or its pid is another
    /// process now) is cleared away and forgotten. Blocking; call it before
    /// serving. Returns (adopted, cleared away).
    ///
    /// The network brokers of the earlier run died with it: each VM
    /// re-adopted is served a new one with its recorded policy (a zygote:
    /// deny all) and egress log; its VMM reconnects on the guest's next
    /// connection or lookup. A VM recorded without a policy (state an
    /// older daemon wrote) is adopted without a network: it opens no new
    /// connection, and its `network` says `active: false`. Egress logs of
    /// sandboxes not re-adopted are kept until the log TTL from their
    /// last write.
    pub fn recover(&self) -> (usize, usize) {
        let Some(store) = self.inner.store.clone() else {
            return (0, 0);
        };
        let backend = self.inner.backend.clone();
        let (templates, mut sandboxes) = store.load();
        let (mut adopted, mut cleared) = (0, 0);
        for t in templates {
            let network = t.network.map(|policy| NetworkSpec {
                policy,
                egress_log: None,
            });
            match backend.adopt(&t.vm, network.as_ref()) {
                Ok(m) => {
                    adopted += 1;
                    let name = t.spec.name.clone();
                    self.lock().templates.insert(
                        name,
                        Template {
                            spec: t.spec,
                            from_sandbox: t.from_sandbox,
                            drop_on_failure: t.drop_on_failure,
                            zygote: Zygote::Ready {
                                machine: Arc::from(m),
                                bake_ms: t.bake_ms,
                            },
                        },
                    );
                }
                Err(e) => {
                    cleared += 1;
                    tracing::warn!(template = %t.spec.name, error = %chain(&e), "cannot re-adopt a template's zygote; clearing it away");
                    backend.discard(&t.vm);
                    store.forget_template(&t.spec.name);
                }
            }
        }
        sandboxes.sort_by_key(|s| (s.created_unix, s.parent.is_some()));
        for saved in sandboxes {
            let network = saved.network.clone().map(|policy| NetworkSpec {
                policy,
                egress_log: Some(self.inner.egress.path(&saved.id)),
            });
            match backend.adopt(&saved.vm, network.as_ref()) {
                Ok(m) => {
                    adopted += 1;
                    let mut s = self.lock();
                    s.registry
                        .restore(saved.record(Instant::now(), SystemTime::now()));
                    s.machines.insert(
                        saved.id.clone(),
                        Live {
                            machine: Arc::from(m),
                            policy: saved.network.unwrap_or_else(Policy::deny_all),
                            envs: saved.envs,
                            spec: saved.spec,
                            ports: BTreeMap::new(),
                        },
                    );
                }
                Err(e) => {
                    cleared += 1;
                    tracing::warn!(id = %saved.id, error = %chain(&e), "cannot re-adopt a sandbox's VM; clearing it away");
                    backend.discard(&saved.vm);
                    store.forget_sandbox(&saved.id);
                }
            }
        }
        let s = self.lock();
        self.inner
            .egress
            .retire_leftovers(&|id| s.machines.contains_key(id), Instant::now());
        (adopted, cleared)
    }

    /// The running sandbox a command goes to; the sandbox's environment
    /// fills in what `req` does not set itself.
    fn command_target(
        &self,
        id: &SandboxId,
        req: &mut ExecRequest,
    ) -> Result<Arc<dyn Machine>, DaemonError> {
        let s = self.lock();
        s.registry.check_usable(id)?;
        let live = s
            .machines
            .get(id)
            .ok_or_else(|| DaemonError::NoSandbox(id.clone()))?;
        for (k, v) in &live.envs {
            req.env.entry(k.clone()).or_insert_with(|| v.clone());
        }
        Ok(live.machine.clone())
    }

    fn machine(&self, id: &SandboxId) -> Result<Arc<dyn Machine>, DaemonError> {
        let s = self.lock();
        s.registry.check_usable(id)?;
        Ok(s.machines
            .get(id)
            .ok_or_else(|| DaemonError::NoSandbox(id.clone()))?
            .machine
            .clone())
    }

    /// The last `lines` lines of a live sandbox's serial console.
    pub async fn console(&self, id: &SandboxId, lines: usize) -> Result<String, DaemonError> {
        let machine = self.machine_any(id)?;
        blocking(move || machine.console(lines)).await
    }

    fn machine_any(&self, id: &SandboxId) -> Result<Arc<dyn Machine>, DaemonError> {
        let s = self.lock();
        s.registry.get(id)?;
        Ok(s.machines
            .get(id)
            .ok_or_else(|| DaemonError::NoSandbox(id.clone()))?
            .machine
            .clone())
    }

    /// Turns an agent-call failure into a guest error or an infrastructure
    /// one; a VM found dead is marked so.
    fn agent_failure(
        &self,
        id: &SandboxId,
        machine: &Arc<dyn Machine>,
        e: ClientError,
    ) -> DaemonError {
        if let ClientError::Agent(a) = e {
            return DaemonError::Guest(a);
        }
        // Killed (or expired) while the call ran: the caller's doing, not
        // the machinery's.
        if let Ok(r) = self.lock().registry.get(id) {
            if r.state == SandboxState::Dead {
                return DaemonError::State(CoreError::WrongState {
                    id: id.clone(),
                    state: r.state,
                    wanted: "finish the call",
                    needs: "running",
                });
            }
        }
        if let Some(how) = machine.exited() {
            let _ = self.kill(
                id,
                DeathCause::VmLost {
                    reason: how.clone(),
                },
            );
            return DaemonError::Infrastructure {
                what: format!("sandbox {id} died: {how}"),
                cause: Some(Box::new(e)),
            };
        }
        DaemonError::infra(format!("the agent channel of sandbox {id} failed"), e)
    }

    /// Starts a command; its output and exit status arrive on the
    /// returned channel. Checks that the sandbox exists and runs before
    /// returning, so those errors come first and alone.
    pub fn exec(
        &self,
        id: &SandboxId,
        mut req: ExecRequest,
        stdin: Option<Vec<u8>>,
    ) -> Result<mpsc::Receiver<ExecEvent>, DaemonError> {
        let machine = self.command_target(id, &mut req)?;
        let (tx, rx) = mpsc::channel(64);
        let this = self.clone();
        let id = id.clone();
        tokio::task::spawn_blocking(move || {
            let start = Instant::now();
            this.inner.metrics.execs.fetch_add(1, ORD);
            let agent = machine.agent();
            let mut input = stdin.map(std::io::Cursor::new);
            let stdin: Option<&mut (dyn std::io::Read + Send)> =
                input.as_mut().map(|c| c as &mut (dyn std::io::Read + Send));
            // A client gone mid-stream drops the receiver: sends fail, the
            // output is discarded and the command runs to its end (its
            // timeout bounds that).
            let out_tx = tx.clone();
            let result = agent.exec(&req, stdin, &mut |stream, bytes| {
                let _ = out_tx.blocking_send(ExecEvent::Output(stream, bytes.to_vec()));
            });
            let event = match result {
                Ok(r) => {
                    this.inner.metrics.exec_latency.observe(start.elapsed());
                    ExecEvent::Exit(r)
                }
                Err(e) => {
                    let e = this.agent_failure(&id, &machine, e);
                    this.count_error(&e);
                    ExecEvent::Failed(e)
                }
            };
            let _ = tx.blocking_send(event);
        });
        Ok(rx)
    }

    /// Runs a blocking file operation against a running sandbox's agent.
    pub async fn files<T: Send + 'static>(
        &self,
        id: &SandboxId,
        op: impl FnOnce(&AgentClient) -> Result<T, ClientError> + Send + 'static,
    ) -> Result<T, DaemonError> {
        let machine = self.machine(id)?;
        let m = machine.clone();
        match blocking(move || op(&m.agent())).await? {
            Ok(v) => Ok(v),
            Err(e) => Err(self.agent_failure(id, &machine, e)),
        }
    }

    /// Starts a command in the background; returns its guest pid. `stdin`
    /// is written to it (its stdin stays open for more).
    pub async fn spawn_process(
        &self,
        id: &SandboxId,
        mut req: ExecRequest,
        stdin: Option<Vec<u8>>,
    ) -> Result<u32, DaemonError> {
        let machine = self.command_target(id, &mut req)?;
        self.inner.metrics.execs.fetch_add(1, ORD);
        let m = machine.clone();
        let spawned = blocking(move || {
            let agent = m.agent();
            let pid = agent.spawn(&req)?;
            if let Some(bytes) = stdin {
                agent.process_stdin(pid, false, &mut bytes.as_slice())?;
            }
            Ok(pid)
        })
        .await?;
        spawned.map_err(|e| self.agent_failure(id, &machine, e))
    }

    /// Runs a blocking call about background processes against a running
    /// sandbox's agent (list, wait, kill, stdin).
    pub async fn process<T: Send + 'static>(
        &self,
        id: &SandboxId,
        op: impl FnOnce(&AgentClient) -> Result<T, ClientError> + Send + 'static,
    ) -> Result<T, DaemonError> {
        self.files(id, op).await
    }

    /// Reattaches to background process `pid`: its buffered output, with
    /// `follow` then its output as it comes, then how it ended.
    pub fn attach(
        &self,
        id: &SandboxId,
        pid: u32,
        follow: bool,
    ) -> Result<mpsc::Receiver<AttachEvent>, DaemonError> {
        let machine = self.machine(id)?;
        let (tx, rx) = mpsc::channel(64);
        let this = self.clone();
        let id = id.clone();
        tokio::task::spawn_blocking(move || {
            let out_tx = tx.clone();
            let r = machine
                .agent()
                .attach_process(pid, follow, &mut |stream, bytes| {
                    let _ = out_tx.blocking_send(AttachEvent::Output(stream, bytes.to_vec()));
                });
            let event = match r {
                Ok((dropped, result)) => AttachEvent::End { dropped, result },
                Err(e) => {
                    let e = this.agent_failure(&id, &machine, e);
                    this.count_error(&e);
                    AttachEvent::Failed(e)
                }
            };
            let _ = tx.blocking_send(event);
        });
        Ok(rx)
    }

    /// Opens (or returns the open) forward of guest `port`: a listener on
    /// `127.0.0.1` of the host, each connection relayed to the guest port
    /// through the agent. With `check`, first makes sure the guest port
    /// accepts (one connection, closed at once), retrying for up to
    /// `wait`; a port that refuses is a guest error `ConnectionRefused`.
    pub async fn open_port(
        &self,
        id: &SandboxId,
        port: u16,
        check: bool,
        wait: Duration,
    ) -> Result<PortForwardInfo, DaemonError> {
        if port == 0 {
            return Err(DaemonError::Invalid(
                "guest port 0: expected 1-65535".into(),
            ));
        }
        let machine = self.machine(id)?;
        if let Some(host) = self.forward_of(id, port) {
            return Ok(PortForwardInfo { port, host });
        }
        if check {
            let agent = machine.agent();
            let probed = blocking(move || probe_port(&agent, port, wait)).await?;
            probed.map_err(|e| self.agent_failure(id, &machine, e))?;
        }
        let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .await
            .map_err(|e| DaemonError::infra("binding a host port for a forward", e))?;
        let host = listener
            .local_addr()
            .map_err(|e| DaemonError::infra("binding a host port for a forward", e))?;
        let task = tokio::spawn(serve_forward(listener, machine.agent(), port)).abort_handle();
        let forward = PortForward { host, task };
        let mut s = self.lock();
        // Gone meanwhile: dropping `forward` closes it.
        let live = s
            .machines
            .get_mut(id)
            .ok_or_else(|| DaemonError::NoSandbox(id.clone()))?;
        // Opened concurrently: keep the first, drop ours.
        let kept = live.ports.entry(port).or_insert(forward);
        tracing::info!(%id, port, host = %kept.host, "port forward open");
        Ok(PortForwardInfo {
            port,
            host: kept.host.to_string(),
        })
    }

    fn forward_of(&self, id: &SandboxId, port: u16) -> Option<String> {
        let s = self.lock();
        let f = s.machines.get(id)?.ports.get(&port)?;
        Some(f.host.to_string())
    }

    /// A sandbox's open forwards (none once it died).
    pub fn ports(&self, id: &SandboxId) -> Result<Vec<PortForwardInfo>, DaemonError> {
        let s = self.lock();
        s.registry.get(id)?;
        Ok(s.machines.get(id).map_or_else(Vec::new, |l| {
            l.ports
                .iter()
                .map(|(port, f)| PortForwardInfo {
                    port: *port,
                    host: f.host.to_string(),
                })
                .collect()
        }))
    }

    /// Closes the forward of guest `port` and its connections; `false`
    /// if there was none.
    pub fn close_port(&self, id: &SandboxId, port: u16) -> Result<bool, DaemonError> {
        let mut s = self.lock();
        s.registry.get(id)?;
        Ok(s.machines
            .get_mut(id)
            .and_then(|l| l.ports.remove(&port))
            .is_some())
    }

    /// Forks a running (or paused) sandbox into `count` children that
    /// inherit its labels, time-to-live, environment and current egress
    /// policy. Children past the live cap, or that fail to come up, fail
    /// alone.
    async fn fork(
        &self,
        parent: SandboxId,
        count: usize,
    ) -> Result<Vec<Result<SandboxInfo, DaemonError>>, DaemonError> {
        let (machine, envs, spec, policy, adm) = {
            let s = self.lock();
            let (r, live) = s.forkable(&parent, "fork")?;
            let adm = Admission {
                template: r.template.clone(),
                labels: r.labels.clone(),
                ttl: r.ttl,
                on_expiry: r.on_expiry,
                parent: Some(parent.clone()),
            };
            (
                live.machine.clone(),
                live.envs.clone(),
                live.spec.clone(),
                live.policy.clone(),
                adm,
            )
        };
        let started = Instant::now();
        let mut slots: Vec<Result<SandboxId, DaemonError>> = {
            let mut s = self.lock();
            (0..count)
                .map(|_| {
                    s.registry
                        .admit(adm.clone(), Instant::now(), SystemTime::now())
                        .map_err(|e| match e {
                            e if e.is_capacity() => DaemonError::Capacity {
                                waited_ms: 0,
                                cause: e,
                            },
                            e => e.into(),
                        })
                })
                .collect()
        };
        let admitted: Vec<SandboxId> = slots
            .iter()
            .filter_map(|r| r.as_ref().ok().cloned())
            .collect();
        self.inner.metrics.forks.fetch_add(1, ORD);
        let n = admitted.len();
        // The parent's current policy (`None`); each child its own log.
        let opts = ForkOptions {
            policy: None,
            egress_logs: admitted
                .iter()
                .map(|id| self.inner.egress.path(id))
                .collect(),
        };
        let children = if n == 0 {
            Ok((Vec::new(), None))
        } else {
            blocking(move || {
                let children = machine.fork_with(n, &opts)?;
                Ok((children, machine.network_policy()))
            })
            .await
            .and_then(|r| r.map_err(|e: BackendError| DaemonError::from(e)))
        };
        let now = Instant::now();
        let (mut made, policy) = match children {
            Ok((c, in_force)) => (c.into_iter(), in_force.unwrap_or(policy)),
            Err(e) => {
                // The request as a whole failed: no child exists.
                let mut s = self.lock();
                for id in &admitted {
                    let _ = s.registry.creation_failed(id, now, chain(&e));
                    self.inner.egress.retire(id, now);
                }
                drop(s);
                self.inner.room.notify_waiters();
                return Err(e);
            }
        };
        let mut out = Vec::with_capacity(count);
        for slot in slots.drain(..) {
            let id = match slot {
                Ok(id) => id,
                Err(e) => {
                    out.push(Err(e));
                    continue;
                }
            };
            let child = made.next().unwrap_or_else(|| {
                Err(crate::backend::BackendError::Unsupported(
                    "a fork that answered with fewer children",
                ))
            });
            let child = child.map_err(DaemonError::from);
            out.push(self.adopt(&id, child, &envs, &spec, &policy, now));
        }
        let ok = out.iter().filter(|r| r.is_ok()).count();
        self.inner.metrics.fork_children.fetch_add(ok as u64, ORD);
        self.inner.metrics.fork_latency.observe(started.elapsed());
        self.inner.room.notify_waiters();
        Ok(out)
    }

    /// Counts and logs a fork child that replaced a lost one.
    fn note_replaced(&self, id: &SandboxId, machine: &dyn Machine) {
        if let Some(why) = machine.replaced() {
            self.inner.metrics.fork_children_replaced.fetch_add(1, ORD);
            tracing::warn!(sandbox = %id, "fork child replaced a lost one: {why}");
        }
    }

    /// Records how one fork child's creation ended.
    fn adopt(
        &self,
        id: &SandboxId,
        child: Result<Box<dyn Machine>, DaemonError>,
        envs: &BTreeMap<String, String>,
        spec: &TemplateSpec,
        policy: &Policy,
        now: Instant,
    ) -> Result<SandboxInfo, DaemonError> {
        let mut s = self.lock();
        match child {
            Err(e) => {
                let _ = s.registry.creation_failed(id, now, chain(&e));
                self.inner.egress.retire(id, now);
                self.inner.metrics.creations_failed.fetch_add(1, ORD);
                Err(e)
            }
            Ok(machine) => {
                self.note_replaced(id, &*machine);
                let machine: Arc<dyn Machine> = Arc::from(machine);
                if let Err(e) = s.registry.created(id, now) {
                    // Killed (by label, say) while it was being forked.
                    drop(s);
                    reap(machine);
                    return Err(e.into());
                }
                s.machines.insert(
                    id.clone(),
                    Live {
                        machine,
                        policy: policy.clone(),
                        envs: envs.clone(),
                        spec: spec.clone(),
                        ports: BTreeMap::new(),
                    },
                );
                self.save(&s, id);
                self.inner.metrics.creations_ok.fetch_add(1, ORD);
                let r = s.registry.get(id)?;
                Ok(info(r, s.machines.get(id)))
            }
        }
    }

    /// Makes `name` a template whose zygote is a fork of the sandbox's
    /// current state (the sandbox runs on, or stays paused).
    pub async fn snapshot(
        &self,
        id: &SandboxId,
        name: String,
    ) -> Result<TemplateInfo, DaemonError> {
        let (machine, mut spec) = {
            let s = self.lock();
            let (_, live) = s.forkable(id, "snapshot")?;
            let mut spec = live.spec.clone();
            spec.envs = live.envs.clone();
            (live.machine.clone(), spec)
        };
        // Its state holds what the recipe did; it is never baked.
        spec.name = name.clone();
        spec.setup.clear();
        spec.ready = None;
        spec.network = None;
        spec.validate().map_err(DaemonError::BadTemplate)?;
        let (tx, rx) = watch::channel(None);
        self.register(
            Template {
                spec,
                from_sandbox: Some(id.clone()),
                drop_on_failure: true,
                zygote: Zygote::Baking(rx),
            },
            false,
        )?;
        let start = Instant::now();
        // A zygote denies all egress: each sandbox forked from it gets the
        // policy of its own creation.
        let opts = ForkOptions {
            policy: Some(Policy::deny_all()),
            egress_logs: Vec::new(),
        };
        let made = blocking(move || -> Result<Box<dyn Machine>, DaemonError> {
            let child = fork_one(&*machine, &opts, "forking the sandbox")?;
            // A fork child's memory is already a copy-on-write view of
            // its parent's: it stays as it is, paused, and forks of it
            // share it the same way.
            child.pause()?;
            Ok(child)
        })
        .await
        .and_then(|r| r);
        let outcome = match made {
            Ok(z) => Ok(Arc::from(z)),
            Err(e) => Err(BakeFailure::of("snapshot".into(), &e)),
        };
        let result = self.bake_ended(&name, outcome, start.elapsed(), &tx);
        result.map_err(|f| f.to_error(&name))
    }

    pub fn templates(&self) -> Vec<TemplateInfo> {
        self.lock().templates.values().map(Template::info).collect()
    }

    pub fn template(&self, name: &str) -> Result<TemplateInfo, DaemonError> {
        self.lock()
            .templates
            .get(name)
            .map(Template::info)
            .ok_or_else(|| DaemonError::NoTemplate(name.into()))
    }

    /// Unregisters a template and stops its zygote (sandboxes forked from
    /// it live on). Built-in templates stay registered: deleting one only
    /// drops its zygote.
    pub fn delete_template(&self, name: &str) -> Result<(), DaemonError> {
        let mut s = self.lock();
        let t = s
            .templates
            .get_mut(name)
            .ok_or_else(|| DaemonError::NoTemplate(name.into()))?;
        if matches!(t.zygote, Zygote::Baking(_)) {
            return Err(DaemonError::Busy(format!(
                "template {name:?} is baking; delete it once the bake ends"
            )));
        }
        let old = std::mem::replace(&mut t.zygote, Zygote::None { error: None });
        if t.drop_on_failure {
            s.templates.remove(name);
        }
        drop(s);
        if let Some(store) = &self.inner.store {
            store.forget_template(name);
        }
        if let Zygote::Ready { machine, .. } = old {
            reap(machine);
        }
        Ok(())
    }

    /// Registers a new template and bakes it: progress arrives on the
    /// channel, ending in `Done` (its zygote is up) or `Failed` (it is
    /// unregistered again).
    pub fn bake(&self, spec: TemplateSpec) -> Result<mpsc::Receiver<BakeEvent>, DaemonError> {
        spec.validate().map_err(DaemonError::BadTemplate)?;
        spec.machine(self.inner.config.boot_timeout)
            .map_err(DaemonError::BadTemplate)?;
        let name = spec.name.clone();
        self.register(
            Template {
                spec,
                from_sandbox: None,
                drop_on_failure: true,
                zygote: Zygote::None { error: None },
            },
            false,
        )?;
        self.bake_named(&name)
    }

    /// Bakes a registered template (a built-in one, say) unless it is
    /// baked. A bake already running is waited for.
    pub fn bake_named(&self, name: &str) -> Result<mpsc::Receiver<BakeEvent>, DaemonError> {
        let (tx, rx) = mpsc::channel(64);
        let waiting = match self.start_bake(name, Some(tx.clone()))? {
            BakeStart::Started(_) => return Ok(rx),
            BakeStart::Ready => None,
            BakeStart::InProgress(w) => Some(w),
        };
        let this = self.clone();
        let name = name.to_owned();
        tokio::spawn(async move {
            if let Some(mut w) = waiting {
                let _ = tx
                    .send(BakeEvent::Step {
                        step: "wait".into(),
                        detail: "another request is baking this template".into(),
                    })
                    .await;
                let outcome = w.wait_for(Option::is_some).await.map(|v| v.clone());
                if let Ok(Some(Err(f))) = outcome {
                    let _ = tx.send(BakeEvent::Failed(f)).await;
                    return;
                }
            }
            let event = match this.template(&name) {
                Ok(template) => BakeEvent::Done {
                    template: Box::new(template),
                    boot_ms: 0,
                    total_ms: 0,
                },
                Err(e) => BakeEvent::Failed(BakeFailure::of("register".into(), &e)),
            };
            let _ = tx.send(event).await;
        });
        Ok(rx)
    }

    fn register(&self, t: Template, replace: bool) -> Result<(), DaemonError> {
        let mut s = self.lock();
        if !replace && s.templates.contains_key(&t.spec.name) {
            return Err(DaemonError::TemplateExists(t.spec.name));
        }
        s.templates.insert(t.spec.name.clone(), t);
        Ok(())
    }

    /// The zygote of `name` and its spec, baking it first when needed.
    async fn zygote(&self, name: &str) -> Result<(Arc<dyn Machine>, TemplateSpec), DaemonError> {
        loop {
            let mut w = match self.start_bake(name, None)? {
                BakeStart::Ready => {
                    let s = self.lock();
                    let t = s
                        .templates
                        .get(name)
                        .ok_or_else(|| DaemonError::NoTemplate(name.into()))?;
                    if let Zygote::Ready { machine, .. } = &t.zygote {
                        return Ok((machine.clone(), t.spec.clone()));
                    }
                    continue;
                }
                BakeStart::Started(w) | BakeStart::InProgress(w) => w,
            };
            let outcome = w
                .wait_for(Option::is_some)
                .await
                .map(|v| v.clone())
                .map_err(|e| DaemonError::infra("waiting for the template's bake", e))?;
            if let Some(Err(f)) = outcome {
                return Err(f.to_error(name));
            }
        }
    }

    /// Starts baking `name` unless its zygote is up or being made.
    fn start_bake(
        &self,
        name: &str,
        events: Option<mpsc::Sender<BakeEvent>>,
    ) -> Result<BakeStart, DaemonError> {
        let mut s = self.lock();
        let t = s
            .templates
            .get_mut(name)
            .ok_or_else(|| DaemonError::NoTemplate(name.into()))?;
        match &t.zygote {
            Zygote::Ready { .. } => return Ok(BakeStart::Ready),
            Zygote::Baking(w) => return Ok(BakeStart::InProgress(w.clone())),
            Zygote::None { .. } => {}
        }
        let machine_spec = t
            .spec
            .machine(self.inner.config.boot_timeout)
            .map_err(DaemonError::BadTemplate)?;
        let (tx, rx) = watch::channel(None);
        t.zygote = Zygote::Baking(rx.clone());
        let spec = t.spec.clone();
        drop(s);
        let this = self.clone();
        tokio::spawn(async move {
            let send = move |e: BakeEvent| {
                if let Some(events) = &events {
                    let _ = events.blocking_send(e);
                }
            };
            let start = Instant::now();
            let backend = this.inner.backend.clone();
            let recipe = spec.clone();
            let send2 = send.clone();
            let baked = blocking(move || -> Result<(Box<dyn Machine>, u64), BakeFailure> {
                send2(BakeEvent::Step {
                    step: "boot".into(),
                    detail: format!(
                        "image {}, {} vCPU, {} MiB",
                        recipe.image, recipe.vcpus, recipe.memory_mib
                    ),
                });
                let machine = backend
                    .boot(&machine_spec)
                    .map_err(|e| BakeFailure::of("boot".into(), &DaemonError::from(e)))?;
                let boot_ms = machine.boot_time().as_millis() as u64;
                run_recipe(&machine.agent(), &recipe, &recipe.envs, &mut |e| send2(e))
                    .map_err(|e| BakeFailure::of(step_of(&e), &e))?;
                send2(BakeEvent::Step {
                    step: "zygote".into(),
                    detail: "denying all egress (each sandbox gets its own policy), a warm-up \
                             `sh -c true` (the shell into the page cache every fork \
                             shares), pausing the VM; its memory becomes copy-on-write \
                             for every fork"
                        .into(),
                });
                let zygote_failed =
                    |e: BackendError| BakeFailure::of("zygote".into(), &DaemonError::from(e));
                machine
                    .set_network_policy(&Policy::deny_all())
                    .map_err(zygote_failed)?;
                machine.make_zygote().map_err(zygote_failed)?;
                Ok((machine, boot_ms))
            })
            .await;
            let (outcome, boot_ms) = match baked {
                Ok(Ok((m, boot_ms))) => (Ok(Arc::from(m)), boot_ms),
                Ok(Err(f)) => (Err(f), 0),
                Err(e) => (Err(BakeFailure::of("task".into(), &e)), 0),
            };
            let name = spec.name.clone();
            let event = match this.bake_ended(&name, outcome, start.elapsed(), &tx) {
                Ok(template) => BakeEvent::Done {
                    template: Box::new(template),
                    boot_ms,
                    total_ms: start.elapsed().as_millis() as u64,
                },
                Err(f) => BakeEvent::Failed(f),
            };
            let _ = blocking(move || send(event)).await;
        });
        Ok(BakeStart::Started(rx))
    }

    /// Records how a bake (or a snapshot) ended and wakes its waiters.
    fn bake_ended(
        &self,
        name: &str,
        outcome: Result<Arc<dyn Machine>, BakeFailure>,
        took: Duration,
        done: &watch::Sender<Option<Result<(), BakeFailure>>>,
    ) -> Result<TemplateInfo, BakeFailure> {
        let zygote_policy = outcome.as_ref().ok().and_then(|m| m.network_policy());
        let mut s = self.lock();
        let result = match (outcome, s.templates.get_mut(name)) {
            (Ok(machine), Some(t)) => {
                if let (Some(store), Some(vm)) = (&self.inner.store, machine.handle()) {
                    store.save_template(&SavedTemplate {
                        spec: t.spec.clone(),
                        from_sandbox: t.from_sandbox.clone(),
                        drop_on_failure: t.drop_on_failure,
                        bake_ms: took.as_millis() as u64,
                        vm,
                        network: zygote_policy,
                    });
                }
                t.zygote = Zygote::Ready {
                    machine,
                    bake_ms: took.as_millis() as u64,
                };
                Ok(t.info())
            }
            (Ok(machine), None) => {
                reap(machine);
                Err(BakeFailure {
                    step: "register".into(),
                    kind: "not_found".into(),
                    message: format!("template {name:?} was deleted while it baked"),
                    output: String::new(),
                })
            }
            (Err(f), Some(t)) => {
                if t.drop_on_failure {
                    s.templates.remove(name);
                } else {
                    t.zygote = Zygote::None {
                        error: Some(format!("{}: {}", f.step, f.message)),
                    };
                }
                Err(f)
            }
            (Err(f), None) => Err(f),
        };
        drop(s);
        let counter = match &result {
            Ok(_) => &self.inner.metrics.bakes_ok,
            Err(_) => &self.inner.metrics.bakes_failed,
        };
        counter.fetch_add(1, ORD);
        let _ = done.send(Some(result.as_ref().map(|_| ()).map_err(Clone::clone)));
        result
    }

    /// Kills expired sandboxes, notices VMs that ended by themselves and
    /// deletes egress logs past their TTL. The reaper task calls it; tests
    /// call it with their own `now`.
    pub fn tick(&self, now: Instant) {
        let expired = self.lock().registry.expired(now);
        for (id, action) in expired {
            match action {
                ExpiryAction::Kill => {
                    let _ = self.kill(&id, DeathCause::Expired);
                }
                ExpiryAction::Pause => self.expiry_pause(&id),
            }
        }
        let lost: Vec<(SandboxId, String)> = {
            let s = self.lock();
            s.machines
                .iter()
                .filter_map(|(id, live)| live.machine.exited().map(|how| (id.clone(), how)))
                .collect()
        };
        for (id, reason) in lost {
            tracing::warn!(%id, %reason, "sandbox VM ended by itself");
            let _ = self.kill(&id, DeathCause::VmLost { reason });
        }
        self.inner.egress.sweep(now);
    }

    /// Pauses a sandbox whose time ran out; one that cannot be paused is
    /// killed rather than left running past its time.
    fn expiry_pause(&self, id: &SandboxId) {
        let Ok(machine) = self.machine(id) else {
            return;
        };
        match machine.pause() {
            Ok(()) => {
                let mut s = self.lock();
                let _ = s.registry.paused(id);
                let _ = s.registry.expiry_paused(id);
                self.save(&s, id);
                self.inner.metrics.expiries.fetch_add(1, ORD);
            }
            Err(e) => {
                tracing::warn!(%id, error = %chain(&e), "cannot pause an expired sandbox; killing it");
                let _ = self.kill(id, DeathCause::Expired);
            }
        }
    }

    /// Enforces TTLs even when no client comes back.
    pub fn spawn_reaper(&self) -> tokio::task::JoinHandle<()> {
        let this = self.clone();
        tokio::spawn(async move {
            let mut every = tokio::time::interval(Duration::from_millis(200));
            loop {
                every.tick().await;
                let this = this.clone();
                let _ = blocking(move || this.tick(Instant::now())).await;
            }
        })
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
        let zygotes: Vec<Arc<dyn Machine>> = {
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

const ORD: std::sync::atomic::Ordering = std::sync::atomic::Ordering::Relaxed;

fn step_of(e: &DaemonError) -> String {
    match e {
        DaemonError::Recipe { step, .. } => step.clone(),
        _ => "recipe".into(),
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

/// Stops a VM off the request path (teardown takes tens of ms).
/// Stops a VM at once, whoever else still holds it (a command or file
/// call in flight ends with its connection), and drops our hold off the
/// request path (teardown takes tens of ms).
/// The one child of `machine.fork_with(1, opts)`; `what` names the step
/// in the error when the VMM answered with none.
fn fork_one(
    machine: &dyn Machine,
    opts: &ForkOptions,
    what: &'static str,
) -> Result<Box<dyn Machine>, DaemonError> {
    let child = machine
        .fork_with(1, opts)?
        .into_iter()
        .next()
        .ok_or_else(|| {
            DaemonError::infra(
                what,
                std::io::Error::other("the VMM answered with no child"),
            )
        })?;
    Ok(child?)
}

fn reap(machine: Arc<dyn Machine>) {
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

/// Connects to guest `port` until it accepts or `wait` passed (then the
/// last refusal is the answer); closes the probe connection at once.
fn probe_port(agent: &AgentClient, port: u16, wait: Duration) -> Result<(), ClientError> {
    let start = Instant::now();
    loop {
        match agent.connect_port(port) {
            Ok(_probe) => return Ok(()),
            Err(ClientError::Agent(a))
                if a.kind == GuestKind::ConnectionRefused && start.elapsed() < wait =>
            {
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => return Err(e),
        }
    }
}

/// Accepts connections forever, relaying each to guest `port`. Aborting
/// the task drops the listener and the relays with it.
async fn serve_forward(listener: tokio::net::TcpListener, agent: AgentClient, port: u16) {
    let mut relays = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => {
                    relays.spawn(relay_connection(tcp, agent.clone(), port));
                }
                Err(e) => {
                    // Out of descriptors, say: back off rather than spin.
                    tracing::warn!(port, error = %e, "port forward: accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = relays.join_next(), if !relays.is_empty() => {}
        }
    }
}

/// One forwarded connection: the agent connects to the guest port, then
/// bytes flow both ways. If the guest refuses, the host connection is
/// reset, so the client sees a failure rather than an empty answer.
async fn relay_connection(mut tcp: tokio::net::TcpStream, agent: AgentClient, port: u16) {
    let guest = tokio::task::spawn_blocking(move || agent.connect_port(port)).await;
    let guest = match guest {
        Ok(Ok(g)) => g,
        Ok(Err(e)) => {
            tracing::info!(port, error = %chain(&e), "port forward: guest connection failed; resetting the client's");
            reset(tcp);
            return;
        }
        Err(_) => return,
    };
    let guest = guest
        .set_nonblocking(true)
        .and_then(|()| tokio::net::UnixStream::from_std(guest));
    match guest {
        Ok(mut g) => {
            let _ = tokio::io::copy_bidirectional(&mut tcp, &mut g).await;
        }
        Err(e) => {
            tracing::warn!(port, error = %e, "port forward: cannot use the agent connection");
            reset(tcp);
        }
    }
}

/// Closes with a reset (`SO_LINGER` 0) instead of an orderly close.
fn reset(tcp: tokio::net::TcpStream) {
    let _ = tcp.set_zero_linger();
}

/// Setup commands in order, then the readiness check until it passes or
/// its timeout ends. Blocking.
fn run_recipe(
    agent: &AgentClient,
    t: &TemplateSpec,
    envs: &BTreeMap<String, String>,
    progress: &mut dyn FnMut(BakeEvent),
) -> Result<(), DaemonError> {
    for (i, cmd) in t.setup.iter().enumerate() {
        let step = format!("setup[{i}]");
        progress(BakeEvent::Step {
            step: step.clone(),
            detail: cmd.clone(),
        });
        let mut req = ExecRequest::shell(cmd.clone());
        req.env = envs.clone();
        let mut output = Vec::new();
        let r = agent
            .exec(&req, None, &mut |stream, bytes| {
                output.extend_from_slice(bytes);
                progress(BakeEvent::Output {
                    stream: stream_name(stream).into(),
                    data: String::from_utf8_lossy(bytes).into_owned(),
                });
            })
            .map_err(|e| DaemonError::infra(format!("running {step}"), e))?;
        if !r.success() {
            return Err(DaemonError::Recipe {
                step,
                message: format!("`{cmd}` ended with {:?}", r.status),
                output: tail(&output),
            });
        }
    }
    if let Some(ready) = &t.ready {
        progress(BakeEvent::Step {
            step: "ready".into(),
            detail: format!("{ready:?}, up to {} s", t.ready_timeout_secs),
        });
        let timeout = Duration::from_secs(t.ready_timeout_secs);
        let start = Instant::now();
        let mut req = ExecRequest::shell(ready.script()).timeout(Duration::from_secs(10));
        req.env = envs.clone();
        loop {
            let mut output = Vec::new();
            let r = agent
                .exec(&req, None, &mut |_, b| output.extend_from_slice(b))
                .map_err(|e| DaemonError::infra("running the readiness check", e))?;
            if r.success() {
                break;
            }
            if start.elapsed() >= timeout {
                return Err(DaemonError::Recipe {
                    step: "ready".into(),
                    message: format!("{ready:?} not ready after {} s", t.ready_timeout_secs),
                    output: tail(&output),
                });
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    Ok(())
}

fn stream_name(s: OutputStream) -> &'static str {
    match s {
        OutputStream::Stdout => "stdout",
        OutputStream::Stderr => "stderr",
    }
}

/// The last 4 KiB of a command's output, for error reports.
fn tail(out: &[u8]) -> String {
    String::from_utf8_lossy(&out[out.len().saturating_sub(4096)..]).into_owned()
}

/// The policy in force (`None`: the VM has no network) or else the one
/// recorded.
fn network_info(in_force: Option<Policy>, recorded: &Policy) -> NetworkInfo {
    NetworkInfo {
        policy: NetworkPolicy::of(in_force.as_ref().unwrap_or(recorded)),
        active: in_force.is_some(),
    }
}

fn info(r: &Record, live: Option<&Live>) -> SandboxInfo {
    let now = Instant::now();
    let metrics = live.map(|l| {
        let pid = l.machine.pid();
        SandboxMetrics {
            vmm_pid: pid,
            memory_rss_kib: pid.and_then(backend::rss_kib),
            cpu_ms: pid
                .and_then(backend::cpu_time)
                .map(|d| d.as_millis() as u64),
            boot_ms: l.machine.boot_time().as_millis() as u64,
            replaced_lost_child: l
                .machine
                .replaced()
                .map(|why| forkbox_host::vm::loss_signature(&why).to_owned()),
        }
    });
    SandboxInfo {
        id: r.id.clone(),
        template: r.template.clone(),
        state: r.state,
        metadata: r.labels.clone(),
        created_at: r.created_unix,
        uptime_ms: r
            .ready
            .filter(|_| r.state.is_live())
            .map(|t| now.saturating_duration_since(t).as_millis() as u64),
        timeout_secs: r.ttl.map(|t| t.as_secs_f64()),
        on_timeout: r.on_expiry,
        expires_in_ms: r
            .deadline
            .map(|d| d.saturating_duration_since(now).as_millis() as u64),
        parent: r.parent.clone(),
        children: r.children.clone(),
        started_by: "fork",
        create_ms: r
            .ready
            .map(|t| t.saturating_duration_since(r.admitted).as_millis() as u64),
        metrics,
        death: r.died.as_ref().map(|(_, c)| c.clone()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::fake::Fake;
    use std::sync::atomic::Ordering::Relaxed as ORD;

    fn daemon(fake: Fake, max_live: usize) -> Daemon {
        Daemon::new(
            Arc::new(fake),
            Config {
                limits: Limits {
                    max_live,
                    max_creating: 2,
                    keep_dead: 16,
                },
                create_wait: Duration::ZERO,
                boot_timeout: Duration::from_secs(1),
                egress_log_ttl: Duration::from_secs(3600),
            },
        )
        .expect("daemon")
    }

    fn create(template: &str, ttl: Option<Duration>) -> Command {
        Command::Create(CreateSandbox {
            template: template.into(),
            ttl,
            ..CreateSandbox::default()
        })
    }

    async fn created(d: &Daemon, ttl: Option<Duration>) -> SandboxInfo {
        match d.execute(create("minimal", ttl)).await {
            Ok(Reply::Sandbox(i)) => *i,
            other => panic!("create: {other:?}"),
        }
    }

    #[tokio::test]
    async fn create_beyond_live_cap_fails_with_capacity() {
        let d = daemon(Fake::default(), 1);
        let a = created(&d, None).await;
        assert_eq!(a.state, SandboxState::Running);
        let err = d.execute(create("minimal", None)).await.expect_err("cap");
        assert_eq!(err.kind(), "capacity");
        assert!(!err.is_infrastructure());
        d.execute(Command::Kill { id: a.id }).await.expect("kill");
        created(&d, None).await;
    }

    #[tokio::test]
    async fn create_waits_for_room_freed_by_a_kill() {
        let d = daemon(Fake::default(), 1);
        let a = created(&d, None).await;
        let d2 = d.clone();
        let waiter = tokio::spawn(async move {
            d2.execute(Command::Create(CreateSandbox {
                template: "minimal".into(),
                wait: Some(Duration::from_secs(30)),
                ..CreateSandbox::default()
            }))
            .await
        });
        tokio::task::yield_now().await;
        d.execute(Command::Kill { id: a.id }).await.expect("kill");
        assert!(matches!(waiter.await.expect("join"), Ok(Reply::Sandbox(_))));
    }

    #[tokio::test]
    async fn create_unknown_template_is_not_found() {
        let d = daemon(Fake::default(), 4);
        let err = d.execute(create("nope", None)).await.expect_err("404");
        assert_eq!(err.kind(), "not_found");
    }

    #[tokio::test]
    async fn create_fork_failure_frees_the_slot_and_counts() {
        let fake = Fake::default();
        fake.world.fail_children.store(true, ORD);
        let d = Daemon::new(Arc::new(fake), Config::default()).expect("daemon");
        let err = d
            .execute(create("minimal", None))
            .await
            .expect_err("fork fails");
        // The fake says "unsupported"; a real fork failure is infrastructure.
        assert_eq!(err.kind(), "unsupported");
        assert_eq!(d.lock().registry.creating(), 0);
        assert_eq!(d.lock().registry.live(), 0);
        assert!(d
            .metrics_text()
            .contains("forkbox_sandbox_creations_total{outcome=\"failed\"} 1"));
    }

    #[tokio::test]
    async fn tick_kills_expired_sandboxes_and_stops_their_vms() {
        let fake = Fake::default();
        let world = fake.world.clone();
        let alive = || world.alive.load(ORD) - 1; // the zygote
        let d = daemon(fake, 4);
        let a = created(&d, Some(Duration::from_secs(5))).await;
        let b = created(&d, None).await;
        assert_eq!(alive(), 2);
        d.tick(Instant::now() + Duration::from_secs(4));
        assert_eq!(d.lock().registry.live(), 2);
        d.tick(Instant::now() + Duration::from_secs(6));
        let info = |id: &SandboxId| match d.execute_sync_info(id) {
            Some(i) => i,
            None => panic!("info"),
        };
        assert_eq!(info(&a.id).state, SandboxState::Dead);
        assert_eq!(info(&a.id).death, Some(DeathCause::Expired));
        assert_eq!(info(&b.id).state, SandboxState::Running);
        // Reaping runs on the blocking pool.
        for _ in 0..100 {
            if alive() == 1 {
                break;
            }
            tokio::task::yield_now().await;
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(alive(), 1);
    }

    #[tokio::test]
    async fn kill_by_label_kills_only_matching_and_refuses_empty_filter() {
        let fake = Fake::default();
        let world = fake.world.clone();
        let d = daemon(fake, 8);
        let mk = |run: &str| {
            Command::Create(CreateSandbox {
                template: "minimal".into(),
                labels: [("run".to_owned(), run.to_owned())].into(),
                ..CreateSandbox::default()
            })
        };
        for run in ["1", "1", "2"] {
            d.execute(mk(run)).await.expect("create");
        }
        let err = d
            .execute(Command::KillByLabel {
                labels: Labels::new(),
            })
            .await
            .expect_err("empty");
        assert_eq!(err.kind(), "invalid_request");
        let killed = match d
            .execute(Command::KillByLabel {
                labels: [("run".to_owned(), "1".to_owned())].into(),
            })
            .await
        {
            Ok(Reply::Killed(k)) => k,
            other => panic!("{other:?}"),
        };
        assert_eq!(killed.len(), 2);
        assert_eq!(d.lock().registry.live(), 1);
        // Their VMs are stopped outright, not just dropped (a command in
        // flight may still hold one).
        for _ in 0..200 {
            if world.kills.load(ORD) == 2 {
                break;
            }
            tokio::task::yield_now().await;
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(world.kills.load(ORD), 2);
    }

    #[tokio::test]
    async fn exec_on_unreachable_agent_is_infrastructure() {
        let d = daemon(Fake::default(), 4);
        let a = created(&d, None).await;
        let mut rx = d
            .exec(&a.id, ExecRequest::shell("true"), None)
            .expect("starts");
        match rx.recv().await {
            Some(ExecEvent::Failed(e)) => assert!(e.is_infrastructure(), "{e:?}"),
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn creations_bake_the_template_once_and_fork_its_zygote() {
        let fake = Fake::default();
        let world = fake.world.clone();
        let d = daemon(fake, 4);
        assert_eq!(
            d.template("minimal").expect("t").state,
            TemplateState::NotBaked
        );
        let (a, b) = tokio::join!(created(&d, None), created(&d, None));
        assert_ne!(a.id, b.id);
        assert_eq!(world.boots.load(ORD), 1, "one bake for both");
        assert_eq!(world.forks.load(ORD), 2);
        assert_eq!(world.alive.load(ORD), 3, "zygote + 2");
        assert_eq!(
            d.template("minimal").expect("t").state,
            TemplateState::Ready
        );
        assert_eq!(a.started_by, "fork");
        // Deleting a built-in drops its zygote only; the sandboxes live on.
        d.delete_template("minimal").expect("delete");
        assert_eq!(
            d.template("minimal").expect("t").state,
            TemplateState::NotBaked
        );
        assert_eq!(d.lock().registry.live(), 2);
    }

    #[tokio::test]
    async fn a_failed_bake_fails_the_creation_and_is_retried_by_the_next() {
        let d = daemon(
            Fake {
                fail: true,
                ..Fake::default()
            },
            4,
        );
        let err = d.execute(create("minimal", None)).await.expect_err("bake");
        assert!(err.is_infrastructure(), "{err:?}");
        let t = d.template("minimal").expect("still registered");
        assert_eq!(t.state, TemplateState::Failed);
        assert!(t.error.is_some_and(|e| e.starts_with("boot:")));
        assert_eq!(d.lock().registry.live(), 0);
    }

    #[tokio::test]
    async fn a_failed_bake_of_a_new_template_unregisters_it() {
        let d = daemon(
            Fake {
                fail: true,
                ..Fake::default()
            },
            4,
        );
        let mut spec = TemplateSpec::builtin(forkbox_host::image::ImageName::Minimal);
        spec.name = "mine".into();
        let mut rx = d.bake(spec.clone()).expect("starts");
        let mut last = None;
        while let Some(e) = rx.recv().await {
            last = Some(e);
        }
        assert!(
            matches!(last, Some(BakeEvent::Failed(ref f)) if f.step == "boot"),
            "{last:?}"
        );
        assert_eq!(d.template("mine").expect_err("gone").kind(), "not_found");
        // The name is free again.
        d.bake(spec).expect("starts again");
    }

    async fn forked(
        d: &Daemon,
        id: &SandboxId,
        count: u32,
    ) -> Vec<Result<SandboxInfo, DaemonError>> {
        match d
            .execute(Command::Fork {
                id: id.clone(),
                count,
            })
            .await
        {
            Ok(Reply::Forked(v)) => v,
            other => panic!("fork: {other:?}"),
        }
    }

    #[tokio::test]
    async fn fork_children_inherit_labels_and_fail_alone() {
        let fake = Fake::default();
        let world = fake.world.clone();
        let d = daemon(fake, 8);
        let parent = match d
            .execute(Command::Create(CreateSandbox {
                template: "minimal".into(),
                labels: [("group".to_owned(), "g1".to_owned())].into(),
                ttl: Some(Duration::from_secs(60)),
                ..CreateSandbox::default()
            }))
            .await
        {
            Ok(Reply::Sandbox(i)) => *i,
            other => panic!("{other:?}"),
        };
        world.fail_child.store(1, ORD);
        world.fail_children.store(true, ORD);
        let kids = forked(&d, &parent.id, 3).await;
        assert_eq!(kids.len(), 3);
        assert!(kids[1].as_ref().is_err_and(|e| e.kind() == "unsupported"));
        for k in [&kids[0], &kids[2]] {
            let k = k.as_ref().expect("child");
            assert_eq!(k.state, SandboxState::Running);
            assert_eq!(k.parent.as_ref(), Some(&parent.id));
            assert_eq!(k.metadata.get("group").map(String::as_str), Some("g1"));
            assert_eq!(k.timeout_secs, Some(60.0));
        }
        let p = d.execute_sync_info(&parent.id).expect("parent");
        assert_eq!(p.children.len(), 3, "lineage lists every attempt");
        assert_eq!(d.lock().registry.live(), 3);
        assert_eq!(d.lock().registry.creating(), 0);
    }

    #[tokio::test]
    async fn fork_child_that_replaced_a_lost_one_is_counted_and_shown() {
        let fake = Fake::default();
        let world = fake.world.clone();
        let d = daemon(fake, 8);
        let parent = created(&d, None).await;
        assert_eq!(d.inner.metrics.fork_children_replaced.load(ORD), 0);
        *world.replaced.lock().expect("replaced") = Some(
            "the VMM (pid 7) died before its agent answered AfterFork\n[forkbox-vmm] guest reset (triple fault or KVM reset)".into(),
        );
        let kids = forked(&d, &parent.id, 2).await;
        assert_eq!(kids.len(), 2);
        assert_eq!(d.inner.metrics.fork_children_replaced.load(ORD), 2);
        let kid = kids[0].as_ref().expect("child");
        let info = d.execute_sync_info(&kid.id).expect("info");
        let shown = info.metrics.and_then(|m| m.replaced_lost_child);
        assert_eq!(shown.as_deref(), Some("triple fault"));
        assert!(d
            .inner
            .metrics
            .render(0, 0)
            .contains("forkbox_fork_children_replaced_total 2"));
    }

    #[tokio::test]
    async fn fork_past_the_live_cap_fails_only_the_extra_children() {
        let d = daemon(Fake::default(), 3);
        let parent = created(&d, None).await;
        let kids = forked(&d, &parent.id, 4).await;
        let ok = kids.iter().filter(|k| k.is_ok()).count();
        assert_eq!(ok, 2);
        assert!(kids[2..]
            .iter()
            .all(|k| k.as_ref().is_err_and(|e| e.kind() == "capacity")));
        let err = d
            .execute(Command::Fork {
                id: parent.id.clone(),
                count: 0,
            })
            .await
            .expect_err("count 0");
        assert_eq!(err.kind(), "invalid_request");
    }

    #[tokio::test]
    async fn paused_sandboxes_refuse_commands_until_resumed_and_can_fork() {
        let d = daemon(Fake::default(), 4);
        let a = created(&d, None).await;
        match d.execute(Command::Pause { id: a.id.clone() }).await {
            Ok(Reply::Sandbox(i)) => assert_eq!(i.state, SandboxState::Paused),
            other => panic!("{other:?}"),
        }
        let err = d
            .exec(&a.id, ExecRequest::shell("true"), None)
            .expect_err("paused");
        assert_eq!(err.kind(), "conflict");
        let kids = forked(&d, &a.id, 1).await;
        assert!(kids[0].is_ok());
        match d.execute(Command::Resume { id: a.id.clone() }).await {
            Ok(Reply::Sandbox(i)) => assert_eq!(i.state, SandboxState::Running),
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn expiry_with_pause_pauses_instead_of_killing() {
        let d = daemon(Fake::default(), 4);
        let a = match d
            .execute(Command::Create(CreateSandbox {
                template: "minimal".into(),
                ttl: Some(Duration::from_secs(5)),
                on_expiry: ExpiryAction::Pause,
                ..CreateSandbox::default()
            }))
            .await
        {
            Ok(Reply::Sandbox(i)) => *i,
            other => panic!("{other:?}"),
        };
        d.tick(Instant::now() + Duration::from_secs(6));
        let i = d.execute_sync_info(&a.id).expect("info");
        assert_eq!(i.state, SandboxState::Paused);
        assert_eq!(i.expires_in_ms, None);
    }

    #[tokio::test]
    async fn snapshot_makes_a_template_whose_creations_fork_it() {
        let fake = Fake::default();
        let world = fake.world.clone();
        let d = daemon(fake, 4);
        let a = created(&d, None).await;
        let t = d
            .snapshot(&a.id, "after-step-3".into())
            .await
            .expect("snapshot");
        assert_eq!(t.state, TemplateState::Ready);
        assert_eq!(t.from_sandbox.as_ref(), Some(&a.id));
        assert!(t.spec.setup.is_empty());
        let err = d
            .snapshot(&a.id, "after-step-3".into())
            .await
            .expect_err("exists");
        assert_eq!(err.kind(), "conflict");
        let forks = world.forks.load(ORD);
        let b = match d.execute(create("after-step-3", None)).await {
            Ok(Reply::Sandbox(i)) => *i,
            other => panic!("{other:?}"),
        };
        assert_eq!(b.template, "after-step-3");
        assert_eq!(world.forks.load(ORD), forks + 1);
        assert_eq!(world.boots.load(ORD), 1, "no new boot");
    }

    #[tokio::test]
    async fn a_restarted_daemon_re_adopts_what_it_wrote_down_and_clears_the_rest() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = || Some(Store::open(dir.path()).expect("store"));
        let egress = || {
            EgressLogs::open(&dir.path().join("egress"), Duration::from_secs(60)).expect("egress")
        };
        let first_world = {
            let fake = Fake::default();
            let world = fake.world.clone();
            let d = Daemon::with_store(Arc::new(fake), Config::default(), store(), egress());
            let a = created(&d, Some(Duration::from_secs(600))).await;
            set_network(&d, &a.id, policy(&["pypi.org"]))
                .await
                .expect("set");
            let b = created(&d, None).await;
            d.execute(Command::Pause { id: b.id.clone() })
                .await
                .expect("pause");
            let kids = forked(&d, &a.id, 1).await;
            let c = kids[0].as_ref().expect("child").clone();
            let gone = created(&d, None).await;
            crate::network::tests::append(&d.inner.egress.path(&gone.id), &["x.org"]);
            d.execute(Command::Kill {
                id: gone.id.clone(),
            })
            .await
            .expect("kill");
            // The daemon "crashes": no shutdown; its state stays written.
            (world, a, b, c, gone)
        };
        let (old, a, b, c, gone) = first_world;
        let fake = Fake::default();
        let world = fake.world.clone();
        // Sandbox c's VMM died while no daemon ran.
        let c_pid = old.handed.load(ORD) as u32 + 1000 - 1 - 1;
        world.gone.lock().expect("gone").push(c_pid);
        // Sandbox b's state is as an older daemon wrote it: no policy.
        let b_file = dir.path().join(format!("sandboxes/{}.json", b.id));
        let mut b_state: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&b_file).expect("read")).expect("json");
        b_state.as_object_mut().expect("object").remove("network");
        std::fs::write(&b_file, b_state.to_string()).expect("write");
        let d = Daemon::with_store(Arc::new(fake), Config::default(), store(), egress());
        let (adopted, cleared) = d.recover();
        assert_eq!(
            (adopted, cleared),
            (3, 1),
            "zygote, a, b adopted; c cleared"
        );
        assert_eq!(*world.discarded.lock().expect("discarded"), vec![c_pid]);
        let info = |id: &SandboxId| d.execute_sync_info(id).expect("known");
        assert_eq!(info(&a.id).state, SandboxState::Running);
        assert!(info(&a.id).expires_in_ms.is_some_and(|ms| ms > 590_000));
        assert_eq!(info(&b.id).state, SandboxState::Paused);
        assert!(d.execute_sync_info(&c.id).is_none(), "cleared away");
        // A new broker serves its recorded policy, which can change.
        let n = network(&d, &a.id).await.expect("network");
        assert!(n.active);
        assert_eq!(n.policy.allow_out, vec!["pypi.org".to_owned()]);
        set_network(&d, &a.id, Policy::deny_all())
            .await
            .expect("set");
        // Without a recorded policy: no broker, said so, no changes.
        let n = network(&d, &b.id).await.expect("network");
        assert!(!n.active);
        assert_eq!(n.policy, NetworkPolicy::default());
        let e = set_network(&d, &b.id, Policy::deny_all())
            .await
            .expect_err("no broker");
        assert_eq!(e.kind(), "conflict");
        // A dead sandbox's log outlives the daemon (until its TTL).
        assert_eq!(d.egress(&gone.id, 10).await.expect("log").len(), 1);
        // The re-adopted zygote has a broker: its forks have networks.
        let fresh = created(&d, None).await;
        assert!(network(&d, &fresh.id).await.expect("network").active);
        assert_eq!(
            d.template("minimal").expect("t").state,
            TemplateState::Ready
        );
        // Adopted sandboxes work as before: fork one, no new bake.
        assert!(forked(&d, &a.id, 1).await[0].is_ok());
        created(&d, None).await;
        assert_eq!(world.boots.load(ORD), 0, "the zygote was re-adopted");
        // What was cleared is forgotten: a third run finds the zygote and
        // 5 sandboxes.
        let d3 = Daemon::with_store(
            Arc::new(Fake::default()),
            Config::default(),
            store(),
            egress(),
        );
        assert_eq!(d3.recover(), (6, 0));
    }

    fn policy(allow: &[&str]) -> Policy {
        NetworkPolicy {
            allow_out: allow.iter().map(|r| r.to_string()).collect(),
            deny_out: vec![],
        }
        .parse()
        .expect("valid policy")
    }

    async fn network(d: &Daemon, id: &SandboxId) -> Result<NetworkInfo, DaemonError> {
        match d.execute(Command::Network { id: id.clone() }).await? {
            Reply::Network(n) => Ok(n),
            other => panic!("network: {other:?}"),
        }
    }

    async fn set_network(
        d: &Daemon,
        id: &SandboxId,
        p: Policy,
    ) -> Result<NetworkInfo, DaemonError> {
        match d
            .execute(Command::SetNetwork {
                id: id.clone(),
                policy: p,
            })
            .await?
        {
            Reply::Network(n) => Ok(n),
            other => panic!("set network: {other:?}"),
        }
    }

    async fn created_with(d: &Daemon, template: &str, network: Option<Policy>) -> SandboxInfo {
        match d
            .execute(Command::Create(CreateSandbox {
                template: template.into(),
                network,
                ..CreateSandbox::default()
            }))
            .await
        {
            Ok(Reply::Sandbox(i)) => *i,
            other => panic!("create: {other:?}"),
        }
    }

    #[tokio::test]
    async fn create_with_a_policy_gives_it_to_the_machine_and_none_denies_all() {
        let d = daemon(Fake::default(), 4);
        let open = created_with(&d, "minimal", Some(policy(&["PyPI.org:443"]))).await;
        let n = network(&d, &open.id).await.expect("network");
        assert!(n.active);
        assert_eq!(n.policy.allow_out, vec!["pypi.org:443".to_owned()]);
        let closed = created(&d, None).await;
        let n = network(&d, &closed.id).await.expect("network");
        assert!(n.active);
        assert_eq!(n.policy, NetworkPolicy::default(), "deny all");
    }

    #[tokio::test]
    async fn set_network_replaces_the_policy_and_forks_inherit_the_current_one() {
        let fake = Fake::default();
        let world = fake.world.clone();
        let d = daemon(fake, 4);
        let a = created(&d, None).await;
        let n = set_network(&d, &a.id, policy(&["*.debian.org"]))
            .await
            .expect("set");
        assert_eq!(n.policy.allow_out, vec!["*.debian.org".to_owned()]);
        assert_eq!(network(&d, &a.id).await.expect("get").policy, n.policy);
        let kids = forked(&d, &a.id, 2).await;
        for k in &kids {
            let k = k.as_ref().expect("child");
            assert_eq!(network(&d, &k.id).await.expect("child").policy, n.policy);
        }
        // Each child logs to its own file, named for it.
        let logs = world.egress_logs.lock().expect("logs").clone();
        let kid_logs: Vec<_> = kids
            .iter()
            .map(|k| Some(d.inner.egress.path(&k.as_ref().expect("child").id)))
            .collect();
        assert_eq!(logs[logs.len() - 2..], kid_logs[..]);
    }

    #[tokio::test]
    async fn network_of_a_dead_or_unknown_sandbox_is_refused() {
        let d = daemon(Fake::default(), 4);
        let a = created(&d, None).await;
        d.execute(Command::Kill { id: a.id.clone() })
            .await
            .expect("kill");
        let e = network(&d, &a.id).await.expect_err("dead");
        assert_eq!(e.kind(), "conflict");
        let e = set_network(&d, &a.id, Policy::deny_all())
            .await
            .expect_err("dead");
        assert_eq!(e.kind(), "conflict");
        let unknown = SandboxId::parse("sb-00000000deadbeef").expect("id");
        assert_eq!(
            network(&d, &unknown).await.expect_err("?").kind(),
            "not_found"
        );
    }

    #[tokio::test]
    async fn egress_log_outlives_the_sandbox_until_its_ttl() {
        let fake = Fake::default();
        let world = fake.world.clone();
        let d = daemon(fake, 4);
        let a = created(&d, None).await;
        let path = d.inner.egress.path(&a.id);
        assert_eq!(
            world.egress_logs.lock().expect("logs").last(),
            Some(&Some(path.clone())),
            "the VM logs where the daemon said"
        );
        assert!(d.egress(&a.id, 10).await.expect("empty").is_empty());
        crate::network::tests::append(&path, &["a.org", "b.org", "c.org"]);
        let got = d.egress(&a.id, 2).await.expect("records");
        assert_eq!(got.len(), 2);
        assert_eq!(got[1].name.as_deref(), Some("c.org"));
        assert_eq!(got[0].sandbox, a.id.as_str());
        d.execute(Command::Kill { id: a.id.clone() })
            .await
            .expect("kill");
        d.tick(Instant::now() + Duration::from_secs(3500));
        assert_eq!(d.egress(&a.id, 10).await.expect("kept").len(), 3);
        d.tick(Instant::now() + Duration::from_secs(3601));
        assert!(!path.exists(), "deleted after the TTL");
        assert!(d.egress(&a.id, 10).await.expect("known").is_empty());
        let unknown = SandboxId::parse("sb-00000000deadbeef").expect("id");
        assert_eq!(
            d.egress(&unknown, 10).await.expect_err("?").kind(),
            "not_found"
        );
    }

    #[tokio::test]
    async fn bake_policy_holds_while_baking_only_and_the_zygote_denies_all() {
        let fake = Fake::default();
        let world = fake.world.clone();
        let d = daemon(fake, 4);
        let mut spec = TemplateSpec::builtin(forkbox_host::image::ImageName::Minimal);
        spec.name = "mirrored".into();
        spec.network = Some(policy(&["mirror.local:80"]));
        let mut rx = d.bake(spec).expect("bake");
        let mut last = None;
        while let Some(e) = rx.recv().await {
            last = Some(e);
        }
        assert!(matches!(last, Some(BakeEvent::Done { .. })), "{last:?}");
        assert_eq!(
            *world.boot_policies.lock().expect("boots"),
            vec![policy(&["mirror.local:80"])]
        );
        assert_eq!(
            *world.zygote_policies.lock().expect("zygotes"),
            vec![Some(Policy::deny_all())]
        );
        let plain = created_with(&d, "mirrored", None).await;
        let n = network(&d, &plain.id).await.expect("network");
        assert_eq!(n.policy, NetworkPolicy::default(), "not the bake's");
        let own = created_with(&d, "mirrored", Some(policy(&["pypi.org"]))).await;
        let n = network(&d, &own.id).await.expect("network");
        assert_eq!(n.policy.allow_out, vec!["pypi.org".to_owned()]);
        // A snapshot's zygote denies all too.
        d.snapshot(&own.id, "snap".into()).await.expect("snapshot");
        let zygote_policy = match &d.lock().templates["snap"].zygote {
            Zygote::Ready { machine, .. } => machine.network_policy(),
            _ => panic!("snapshot not ready"),
        };
        assert_eq!(zygote_policy, Some(Policy::deny_all()));
    }

    impl Daemon {
        fn execute_sync_info(&self, id: &SandboxId) -> Option<SandboxInfo> {
            let s = self.lock();
            s.registry.get(id).ok().map(|r| info(r, s.machines.get(id)))
        }
    }
}
