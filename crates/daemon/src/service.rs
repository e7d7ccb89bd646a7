//! The daemon proper: the registry (`core`) plus the VMs (`backend`), the
//! templates, the caps' waiting, the TTL reaper and the metrics. Transports
//! hand it typed values only.
//!
//! Lifecycle requests arrive as one [`Command`] enum through
//! [`Daemon::execute`]. Commands and file transfers stream bytes both ways,
//! so they are methods of their own ([`Daemon::exec`], [`Daemon::files`]),
//! still taking typed requests.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use forkbox_proto::client::{AgentClient, ClientError};
use forkbox_proto::{AgentError, ExecRequest, ExecResult, OutputStream};
use serde::Serialize;
use tokio::sync::{mpsc, Notify};
use utoipa::ToSchema;

use crate::backend::{self, Backend, BackendError, Machine};
use crate::core::{
    Admission, CoreError, DeathCause, ExpiryAction, Labels, Limits, Record, Registry, SandboxId,
    SandboxState,
};
use crate::metrics::Metrics;
use crate::template::{TemplateError, TemplateSpec};

/// How the daemon is tuned.
#[derive(Debug, Clone, Copy)]
pub struct Config {
    pub limits: Limits,
    /// Longest a creation waits for room under the caps before failing.
    pub create_wait: Duration,
    pub boot_timeout: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            limits: Limits::default(),
            create_wait: Duration::from_secs(30),
            boot_timeout: Duration::from_secs(120),
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
}

/// What a [`Command`] returns.
#[derive(Debug)]
pub enum Reply {
    Sandbox(Box<SandboxInfo>),
    Sandboxes(Vec<SandboxInfo>),
    Killed(Vec<SandboxId>),
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
    #[error("{0} is not available yet: it needs the fork/pause work in forkbox::vm")]
    Unsupported(&'static str),
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
            Self::TemplateExists(_) | Self::State(_) => "conflict",
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
    /// How the sandbox started: `cold_boot` (its own boot, plus the
    /// template's recipe replayed) until zygote forks land.
    pub started_by: &'static str,
    /// Admission to ready, in milliseconds.
    pub create_ms: Option<u64>,
    pub metrics: Option<SandboxMetrics>,
    /// Why it died.
    pub death: Option<DeathCause>,
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
    Step { step: String, detail: String },
    /// Output of a setup or readiness command.
    Output { stream: String, data: String },
    Done {
        template: TemplateSpec,
        boot_ms: u64,
        total_ms: u64,
    },
    Failed {
        step: String,
        kind: String,
        message: String,
        output: String,
    },
}

struct Live {
    machine: Arc<dyn Machine>,
    envs: BTreeMap<String, String>,
}

struct Shared {
    registry: Registry,
    machines: HashMap<SandboxId, Live>,
    templates: BTreeMap<String, TemplateSpec>,
}

struct Inner {
    backend: Arc<dyn Backend>,
    config: Config,
    shared: Mutex<Shared>,
    room: Notify,
    metrics: Metrics,
}

/// The daemon. Cheap to clone.
#[derive(Clone)]
pub struct Daemon {
    inner: Arc<Inner>,
}

impl Daemon {
    pub fn new(backend: Arc<dyn Backend>, config: Config) -> Self {
        let salt = std::process::id()
            ^ (SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map(|d| d.subsec_nanos())
                .unwrap_or(0));
        let templates = [
            forkbox::image::ImageName::Minimal,
            forkbox::image::ImageName::Debian,
        ]
        .into_iter()
        .map(|i| (i.as_str().to_owned(), TemplateSpec::builtin(i)))
        .collect();
        Self {
            inner: Arc::new(Inner {
                backend,
                config,
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
                if on_expiry == Some(ExpiryAction::Pause) {
                    return Err(DaemonError::Unsupported("on_timeout: pause"));
                }
                let mut s = self.lock();
                s.registry
                    .set_timeout(&id, ttl, on_expiry, Instant::now())?;
                let r = s.registry.get(&id)?;
                Ok(Reply::Sandbox(Box::new(info(r, s.machines.get(&id)))))
            }
            Command::Pause { id } => {
                let m = self.machine(&id)?;
                blocking(move || m.pause()).await??;
                let mut s = self.lock();
                s.registry.paused(&id)?;
                let r = s.registry.get(&id)?;
                Ok(Reply::Sandbox(Box::new(info(r, s.machines.get(&id)))))
            }
            Command::Resume { id } => {
                let m = self.machine_any(&id)?;
                blocking(move || m.resume()).await??;
                let mut s = self.lock();
                s.registry.resumed(&id, Instant::now())?;
                let r = s.registry.get(&id)?;
                Ok(Reply::Sandbox(Box::new(info(r, s.machines.get(&id)))))
            }
            Command::Fork { id, count } => {
                if count == 0 || count > 256 {
                    return Err(DaemonError::Invalid("count must be 1-256".into()));
                }
                self.lock().registry.get(&id)?;
                Err(DaemonError::Unsupported("fork"))
            }
        }
    }

    async fn create(&self, req: CreateSandbox) -> Result<SandboxInfo, DaemonError> {
        if req.on_expiry == ExpiryAction::Pause {
            return Err(DaemonError::Unsupported("on_timeout: pause"));
        }
        let template = self
            .lock()
            .templates
            .get(&req.template)
            .cloned()
            .ok_or_else(|| DaemonError::NoTemplate(req.template.clone()))?;
        let spec = template
            .machine(self.inner.config.boot_timeout)
            .map_err(DaemonError::BadTemplate)?;
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
        let backend = self.inner.backend.clone();
        let mut envs = template.envs.clone();
        envs.extend(req.envs);
        let recipe_envs = envs.clone();
        let booted = blocking(move || -> Result<Box<dyn Machine>, DaemonError> {
            let machine = backend.boot(&spec)?;
            run_recipe(&machine.agent(), &template, &recipe_envs, &mut |_| {})?;
            Ok(machine)
        })
        .await
        .and_then(|r| r);
        let now = Instant::now();
        let result = match booted {
            Err(e) => {
                let _ = self.lock().registry.creation_failed(&id, now, chain(&e));
                self.inner.metrics.creations_failed.fetch_add(1, ORD);
                Err(e)
            }
            Ok(machine) => {
                let machine: Arc<dyn Machine> = Arc::from(machine);
                let mut s = self.lock();
                match s.registry.created(&id, now) {
                    Ok(()) => {
                        s.machines.insert(id.clone(), Live { machine, envs });
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

    fn machine(&self, id: &SandboxId) -> Result<Arc<dyn Machine>, DaemonError> {
        let s = self.lock();
        s.registry.check_usable(id)?;
        Ok(s.machines
            .get(id)
            .ok_or_else(|| DaemonError::NoSandbox(id.clone()))?
            .machine
            .clone())
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
        let (machine, envs) = {
            let s = self.lock();
            s.registry.check_usable(id)?;
            let live = s
                .machines
                .get(id)
                .ok_or_else(|| DaemonError::NoSandbox(id.clone()))?;
            (live.machine.clone(), live.envs.clone())
        };
        for (k, v) in envs {
            req.env.entry(k).or_insert(v);
        }
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

    pub fn templates(&self) -> Vec<TemplateSpec> {
        self.lock().templates.values().cloned().collect()
    }

    pub fn template(&self, name: &str) -> Result<TemplateSpec, DaemonError> {
        self.lock()
            .templates
            .get(name)
            .cloned()
            .ok_or_else(|| DaemonError::NoTemplate(name.into()))
    }

    pub fn delete_template(&self, name: &str) -> Result<(), DaemonError> {
        if TemplateSpec::builtin(forkbox::image::ImageName::Minimal).name == name
            || TemplateSpec::builtin(forkbox::image::ImageName::Debian).name == name
        {
            return Err(DaemonError::Invalid(format!("{name:?} is built in")));
        }
        self.lock()
            .templates
            .remove(name)
            .map(|_| ())
            .ok_or_else(|| DaemonError::NoTemplate(name.into()))
    }

    /// Validates a template and starts baking it; progress arrives on the
    /// channel, ending in `Done` (the template is then registered) or
    /// `Failed`. The bake counts against the creation cap.
    pub fn bake(&self, spec: TemplateSpec) -> Result<mpsc::Receiver<BakeEvent>, DaemonError> {
        spec.validate().map_err(DaemonError::BadTemplate)?;
        if self.lock().templates.contains_key(&spec.name) {
            return Err(DaemonError::TemplateExists(spec.name));
        }
        let machine_spec = spec
            .machine(self.inner.config.boot_timeout)
            .map_err(DaemonError::BadTemplate)?;
        let (tx, rx) = mpsc::channel(64);
        let this = self.clone();
        tokio::spawn(async move {
            let start = Instant::now();
            let backend = this.inner.backend.clone();
            let tx2 = tx.clone();
            let spec2 = spec.clone();
            let outcome = blocking(move || -> Result<u64, (String, DaemonError)> {
                let send = |e: BakeEvent| {
                    let _ = tx2.blocking_send(e);
                };
                send(BakeEvent::Step {
                    step: "boot".into(),
                    detail: format!(
                        "image {}, {} vCPU, {} MiB",
                        spec2.image, spec2.vcpus, spec2.memory_mib
                    ),
                });
                let machine = backend.boot(&machine_spec).map_err(|e| ("boot".to_owned(), e.into()))?;
                let boot_ms = machine.boot_time().as_millis() as u64;
                run_recipe(&machine.agent(), &spec2, &spec2.envs, &mut |e| send(e))
                    .map_err(|e| (step_of(&e), e))?;
                send(BakeEvent::Step {
                    step: "stop".into(),
                    detail: "no zygote yet: sandboxes from this template cold-boot and replay the recipe".into(),
                });
                drop(machine);
                Ok(boot_ms)
            })
            .await;
            let event = match outcome {
                Ok(Ok(boot_ms)) => {
                    let mut s = this.lock();
                    if s.templates.contains_key(&spec.name) {
                        BakeEvent::Failed {
                            step: "register".into(),
                            kind: "conflict".into(),
                            message: format!("template {:?} was created meanwhile", spec.name),
                            output: String::new(),
                        }
                    } else {
                        s.templates.insert(spec.name.clone(), spec.clone());
                        BakeEvent::Done {
                            template: spec,
                            boot_ms,
                            total_ms: start.elapsed().as_millis() as u64,
                        }
                    }
                }
                Ok(Err((step, e))) => {
                    let output = match &e {
                        DaemonError::Recipe { output, .. } => output.clone(),
                        _ => String::new(),
                    };
                    BakeEvent::Failed {
                        step,
                        kind: e.kind().into(),
                        message: chain(&e),
                        output,
                    }
                }
                Err(e) => BakeEvent::Failed {
                    step: "task".into(),
                    kind: e.kind().into(),
                    message: chain(&e),
                    output: String::new(),
                },
            };
            let _ = tx.send(event).await;
        });
        Ok(rx)
    }

    /// Kills expired sandboxes and notices VMs that ended by themselves.
    /// The reaper task calls it; tests call it with their own `now`.
    pub fn tick(&self, now: Instant) {
        let expired = self.lock().registry.expired(now);
        for (id, action) in expired {
            match action {
                ExpiryAction::Kill | ExpiryAction::Pause => {
                    // Pause is refused at creation until the backend can.
                    let _ = self.kill(&id, DeathCause::Expired);
                }
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
fn reap(machine: Arc<dyn Machine>) {
    match tokio::runtime::Handle::try_current() {
        Ok(h) => {
            h.spawn_blocking(move || drop(machine));
        }
        Err(_) => drop(machine),
    }
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
        started_by: "cold_boot",
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
            },
        )
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
    async fn create_boot_failure_frees_the_slot_and_counts() {
        let d = Daemon::new(
            Arc::new(Fake {
                fail: true,
                ..Fake::default()
            }),
            Config::default(),
        );
        let err = d
            .execute(create("minimal", None))
            .await
            .expect_err("boot fails");
        // The fake says "unsupported"; a real boot failure is infrastructure.
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
        let alive = fake.alive.clone();
        let d = daemon(fake, 4);
        let a = created(&d, Some(Duration::from_secs(5))).await;
        let b = created(&d, None).await;
        assert_eq!(alive.load(ORD), 2);
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
            if alive.load(ORD) == 1 {
                break;
            }
            tokio::task::yield_now().await;
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(alive.load(ORD), 1);
    }

    #[tokio::test]
    async fn kill_by_label_kills_only_matching_and_refuses_empty_filter() {
        let d = daemon(Fake::default(), 8);
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
    async fn pause_and_fork_say_unsupported_until_fork_lands() {
        let d = daemon(Fake::default(), 4);
        let a = created(&d, None).await;
        let err = d
            .execute(Command::Pause { id: a.id.clone() })
            .await
            .expect_err("pause");
        assert_eq!(err.kind(), "unsupported");
        let err = d
            .execute(Command::Fork { id: a.id, count: 2 })
            .await
            .expect_err("fork");
        assert_eq!(err.kind(), "unsupported");
    }

    impl Daemon {
        fn execute_sync_info(&self, id: &SandboxId) -> Option<SandboxInfo> {
            let s = self.lock();
            s.registry.get(id).ok().map(|r| info(r, s.machines.get(id)))
        }
    }
}
