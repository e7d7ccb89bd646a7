//! Lifecycle commands ([`Lifecycle`] in, [`Reply`] out): creating a sandbox
//! as a fork of its template's zygote, admission under the caps, kills,
//! pause and resume, time-to-live changes, and forks of running sandboxes.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use forkbox_net::policy::Policy;
use tokio::sync::mpsc;

use super::view::info;
use super::{blocking, chain, reap, Baseline, Daemon, DaemonError, Live, NetworkInfo, SandboxInfo};
use crate::backend::{BackendVm, ForkOptions};
use crate::core::{
    fitting, predicted_memory, Admission, CoreError, DeathCause, ExpiryAction, Labels, SandboxId,
};
use crate::template::{SandboxLimits, TemplateSpec};
use forkbox_host::cgroup::VmCgroup;
use forkbox_host::vm::child_seed;

/// Most children one fork request asks for.
pub const MAX_FORK_CHILDREN: u32 = 1024;

/// A fork's `count`, checked: 1 to [`MAX_FORK_CHILDREN`].
fn check_fork_count(count: u32) -> Result<(), DaemonError> {
    if count == 0 || count > MAX_FORK_CHILDREN {
        return Err(DaemonError::Invalid(format!(
            "count must be 1-{MAX_FORK_CHILDREN}, not {count}"
        )));
    }
    Ok(())
}

/// One child of a fork as it comes up: its place in the request, and the
/// sandbox or why it failed.
pub type ForkedChild = (usize, Result<SandboxInfo, DaemonError>);

/// A sandbox creation.
#[derive(Debug, Clone, Default)]
pub struct CreateSandbox {
    pub template: String,
    pub ttl: Option<Duration>,
    pub on_expiry: ExpiryAction,
    pub labels: Labels,
    /// Environment for every command run in the sandbox.
    pub envs: BTreeMap<String, String>,
    /// Overrides [`Config::create_wait`](super::Config::create_wait) (zero: fail at once when full).
    pub wait: Option<Duration>,
    /// Its egress policy; `None`: deny all. Never the template's (that
    /// one holds only while the template bakes).
    pub network: Option<Policy>,
    /// Seeds its after-fork entropy and `FORKBOX_SEED` (as child 0 of a
    /// fork seeded so); `None`: fresh host entropy.
    pub seed: Option<u64>,
    /// Its host resources, over the template's; `None`: the template's.
    pub limits: Option<SandboxLimits>,
}

/// The host's memory against what sandboxes of one template are predicted
/// to take ([`predicted_memory`]).
pub(super) struct MemoryRoom {
    pub(super) available: u64,
    pub(super) reserve: u64,
    /// Bytes each one more is predicted to take, and how that was found.
    pub(super) each: u64,
    pub(super) basis: String,
    pub(super) template: String,
}

impl MemoryRoom {
    /// How many of `wanted` more fit above the reserve.
    pub(super) fn fitting(&self, wanted: usize) -> usize {
        fitting(self.available, self.reserve, self.each, wanted)
    }

    pub(super) fn refusal(&self) -> CoreError {
        CoreError::HostMemory {
            available_mib: self.available >> 20,
            reserve_mib: self.reserve >> 20,
            each_mib: self.each.div_ceil(1 << 20),
            template: self.template.clone(),
            basis: self.basis.clone(),
        }
    }
}

/// Every lifecycle request.
#[derive(Debug, Clone)]
pub enum Lifecycle {
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
        /// Child `i` gets the seed `child_seed(seed, i)`.
        seed: Option<u64>,
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

/// What a [`Lifecycle`] returns.
#[derive(Debug)]
pub enum Reply {
    Sandbox(Box<SandboxInfo>),
    Sandboxes(Vec<SandboxInfo>),
    Killed(Vec<SandboxId>),
    /// One entry per fork child, in order.
    Forked(Vec<Result<SandboxInfo, DaemonError>>),
    Network(NetworkInfo),
}

/// What a fork child takes from its parent besides its memory.
pub(super) struct Inherited {
    envs: BTreeMap<String, String>,
    cwd: Option<String>,
    user: forkbox_proto::User,
    spec: TemplateSpec,
    image_id: Option<forkbox_image::Digest>,
    /// The parent's policy as written down (the one in force, when the
    /// fork says).
    policy: Policy,
    baseline: Option<Arc<Baseline>>,
}

impl Daemon {
    /// Runs a lifecycle command.
    pub async fn execute(&self, cmd: Lifecycle) -> Result<Reply, DaemonError> {
        match cmd {
            Lifecycle::Create(req) => {
                // Its own task: a client that hangs up mid-boot does not
                // abandon a half-registered VM.
                let this = self.clone();
                let task = tokio::spawn(async move { this.create(req).await });
                task.await
                    .map_err(|e| DaemonError::infra("the creation task failed", e))?
                    .map(|i| Reply::Sandbox(Box::new(i)))
            }
            Lifecycle::Info { id } => {
                let s = self.lock();
                let r = s.registry.get(&id)?;
                Ok(Reply::Sandbox(Box::new(info(r, s.machines.get(&id)))))
            }
            Lifecycle::List {
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
            Lifecycle::Kill { id } => {
                self.kill(&id, DeathCause::Killed)?;
                Ok(Reply::Killed(vec![id]))
            }
            Lifecycle::KillByLabel { labels } => {
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
            Lifecycle::SetTimeout { id, ttl, on_expiry } => {
                let mut s = self.lock();
                s.registry
                    .set_timeout(&id, ttl, on_expiry, Instant::now())?;
                self.save(&s, &id);
                let r = s.registry.get(&id)?;
                Ok(Reply::Sandbox(Box::new(info(r, s.machines.get(&id)))))
            }
            Lifecycle::Pause { id } => {
                let m = self.machine(&id)?;
                blocking(move || m.pause()).await??;
                let mut s = self.lock();
                s.registry.paused(&id)?;
                self.save(&s, &id);
                let r = s.registry.get(&id)?;
                Ok(Reply::Sandbox(Box::new(info(r, s.machines.get(&id)))))
            }
            Lifecycle::Resume { id } => {
                let m = self.machine_any(&id)?;
                blocking(move || m.resume()).await??;
                let mut s = self.lock();
                s.registry.resumed(&id, Instant::now())?;
                self.save(&s, &id);
                let r = s.registry.get(&id)?;
                Ok(Reply::Sandbox(Box::new(info(r, s.machines.get(&id)))))
            }
            Lifecycle::Fork { id, count, seed } => {
                check_fork_count(count)?;
                // Its own task, as for creations.
                let this = self.clone();
                let task = tokio::spawn(async move { this.fork(id, count as usize, seed).await });
                task.await
                    .map_err(|e| DaemonError::infra("the fork task failed", e))?
                    .map(Reply::Forked)
            }
            Lifecycle::Network { id } => self.network(&id).await.map(Reply::Network),
            Lifecycle::SetNetwork { id, policy } => {
                self.set_network(&id, policy).await.map(Reply::Network)
            }
        }
    }

    /// A sandbox from a template: a fork of the template's zygote, baked
    /// first if it is not yet.
    pub(super) async fn create(&self, req: CreateSandbox) -> Result<SandboxInfo, DaemonError> {
        let (zygote, of) = match self.zygote(&req.template).await {
            Ok(z) => z,
            Err(e) => {
                if !matches!(e, DaemonError::NoTemplate(_)) {
                    self.inner.metrics.creations_failed.inc();
                }
                return Err(e);
            }
        };
        let template = of.spec;
        let limits = template
            .limits
            .overridden_by(req.limits)
            .resolve(template.vcpus, template.memory_mib)
            .map_err(DaemonError::Invalid)?;
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
        // The image's configuration under the template's and the
        // request's.
        let mut envs = of.image.env();
        envs.extend(template.envs.clone());
        envs.extend(req.envs);
        let cwd = of.image.working_dir();
        let user = of.image.default_user();
        let policy = req.network.unwrap_or_else(Policy::deny_all);
        let opts = ForkOptions {
            policy: Some(policy.clone()),
            egress_logs: vec![self.inner.egress.path(&id)],
            seeds: req.seed.map(|s| child_seed(s, 0)).into_iter().collect(),
            limits: Some(limits),
        };
        let forked = blocking(move || fork_one(&*zygote, &opts, "forking the template's zygote"))
            .await
            .and_then(|r| r);
        let now = Instant::now();
        let result = match forked {
            Err(e) => {
                let _ = self.lock().registry.creation_failed(&id, now, chain(&e));
                self.inner.egress.retire(&id, now);
                self.inner.metrics.creations_failed.inc();
                Err(e)
            }
            Ok(machine) => {
                self.note_replaced(&id, &*machine);
                let machine: Arc<dyn BackendVm> = Arc::from(machine);
                let mut s = self.lock();
                match s.registry.created(&id, now) {
                    Ok(()) => {
                        s.machines.insert(
                            id.clone(),
                            Live {
                                machine,
                                policy,
                                envs,
                                cwd,
                                user,
                                spec: template,
                                image_id: of.image.id.clone(),
                                ports: BTreeMap::new(),
                                baseline: of.baseline,
                            },
                        );
                        self.save(&s, &id);
                        self.inner.metrics.creations_ok.inc();
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
    pub(super) async fn admit(
        &self,
        adm: Admission,
        wait: Duration,
    ) -> Result<SandboxId, DaemonError> {
        let start = Instant::now();
        loop {
            let notified = self.inner.room.notified();
            let attempt = match self.memory_room(&adm.template) {
                Some(room) if room.fitting(1) == 0 => Err(room.refusal()),
                _ => self
                    .lock()
                    .registry
                    .admit(adm.clone(), Instant::now(), SystemTime::now()),
            };
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

    /// The host's memory as admission sees it for one more sandbox of
    /// `template`: `None` where the host's available memory is unknown.
    fn memory_room(&self, template: &str) -> Option<MemoryRoom> {
        let available = (self.inner.config.host_memory)()?;
        let cgroups: Vec<VmCgroup> = {
            let s = self.lock();
            s.machines
                .iter()
                .filter(|(id, _)| s.registry.get(id).is_ok_and(|r| r.template == template))
                .filter_map(|(_, live)| live.machine.cgroup().cloned())
                .collect()
        };
        let charged: Vec<u64> = cgroups
            .iter()
            .filter_map(VmCgroup::memory_current)
            .collect();
        let (each, basis) = predicted_memory(&charged);
        Some(MemoryRoom {
            available,
            reserve: self.inner.config.memory_reserve,
            each,
            basis,
            template: template.to_owned(),
        })
    }

    pub(super) fn kill(&self, id: &SandboxId, cause: DeathCause) -> Result<(), DaemonError> {
        let died = cause.clone();
        let machine = {
            let mut s = self.lock();
            s.registry.kill(id, Instant::now(), cause)?;
            s.machines.remove(id)
        };
        if let Some(store) = &self.inner.store {
            store.forget_sandbox(id);
        }
        self.inner.egress.retire(id, Instant::now());
        let metrics = &self.inner.metrics;
        match died {
            DeathCause::Expired => metrics.expiries.inc(),
            DeathCause::Killed => metrics.kills.inc(),
            _ => 0,
        };
        metrics.died(&died);
        if let Some(live) = machine {
            reap(live.machine);
        }
        self.inner.room.notify_waiters();
        Ok(())
    }

    /// Forks a running (or paused) sandbox into `count` children that
    /// inherit its labels, time-to-live, environment and current egress
    /// policy. Children past the caps, or that fail to come up, fail
    /// alone. One entry per child, in the request's order.
    pub(super) async fn fork(
        &self,
        parent: SandboxId,
        count: usize,
        seed: Option<u64>,
    ) -> Result<Vec<Result<SandboxInfo, DaemonError>>, DaemonError> {
        let (tx, mut rx) = mpsc::unbounded_channel();
        self.fork_each(parent, count, seed, tx).await?;
        let mut out: Vec<Option<Result<SandboxInfo, DaemonError>>> =
            (0..count).map(|_| None).collect();
        while let Ok((index, child)) = rx.try_recv() {
            out[index] = Some(child);
        }
        Ok(out
            .into_iter()
            .map(|c| {
                c.unwrap_or_else(|| {
                    Err(DaemonError::infra(
                        "forking",
                        std::io::Error::other("a fork child was never answered"),
                    ))
                })
            })
            .collect())
    }

    /// [`fork`](Self::fork), sending each child to `each` with its place
    /// in the request as soon as it is up and recorded, in the order they
    /// come up; the children the caps refused last. `Err` (and nothing
    /// sent) when the request as a whole failed; once it returns `Ok`,
    /// every place was sent exactly once.
    pub(super) async fn fork_each(
        &self,
        parent: SandboxId,
        count: usize,
        seed: Option<u64>,
        each: mpsc::UnboundedSender<ForkedChild>,
    ) -> Result<(), DaemonError> {
        let (machine, inherited, adm) = {
            let s = self.lock();
            let (r, live) = s.forkable(&parent, "fork")?;
            let adm = Admission {
                template: r.template.clone(),
                labels: r.labels.clone(),
                ttl: r.ttl,
                on_expiry: r.on_expiry,
                parent: Some(parent.clone()),
            };
            let inherited = Inherited {
                envs: live.envs.clone(),
                cwd: live.cwd.clone(),
                user: live.user.clone(),
                spec: live.spec.clone(),
                image_id: live.image_id.clone(),
                policy: live.policy.clone(),
                baseline: live.baseline.clone(),
            };
            (live.machine.clone(), inherited, adm)
        };
        let started = Instant::now();
        // The children the host's memory has room for; the rest fail alone.
        let room = self.memory_room(&adm.template);
        let fit = room.as_ref().map_or(count, |r| r.fitting(count));
        let slots: Vec<Result<SandboxId, DaemonError>> = {
            let mut s = self.lock();
            (0..count)
                .map(|i| {
                    let admitted = match &room {
                        Some(room) if i >= fit => Err(room.refusal()),
                        _ => s
                            .registry
                            .admit(adm.clone(), Instant::now(), SystemTime::now()),
                    };
                    admitted.map_err(|e| match e {
                        e if e.is_capacity() => DaemonError::Capacity {
                            waited_ms: 0,
                            cause: e,
                        },
                        e => e.into(),
                    })
                })
                .collect()
        };
        // The admitted children: their places in the request and ids.
        let admitted: Vec<(usize, SandboxId)> = slots
            .iter()
            .enumerate()
            .filter_map(|(i, r)| Some((i, r.as_ref().ok()?.clone())))
            .collect();
        self.inner.metrics.forks.inc();
        let n = admitted.len();
        // The parent's current policy (`None`); each child its own log.
        // A child's seed follows its place in the request, whichever
        // children the caps admitted.
        let opts = ForkOptions {
            policy: None,
            egress_logs: admitted
                .iter()
                .map(|(_, id)| self.inner.egress.path(id))
                .collect(),
            seeds: match seed {
                Some(seed) => admitted.iter().map(|(i, _)| child_seed(seed, *i)).collect(),
                None => Vec::new(),
            },
            // Its parent's.
            limits: None,
        };
        if n > 0 {
            let this = self.clone();
            let places = admitted.clone();
            let each = each.clone();
            let forked = blocking(move || {
                // What the children get: the parent's policy in force now.
                let inherited = Inherited {
                    policy: machine.network_policy().unwrap_or(inherited.policy),
                    ..inherited
                };
                machine.fork_each(n, &opts, &|i, child| {
                    let (place, id) = &places[i];
                    let child = child.map_err(DaemonError::from);
                    let recorded = this.record_fork_child(id, child, &inherited, Instant::now());
                    if recorded.is_ok() {
                        this.inner.metrics.fork_children.inc();
                    }
                    // A client that left still has its children recorded.
                    let _ = each.send((*place, recorded));
                })
            })
            .await
            .and_then(|r| r.map_err(DaemonError::from));
            if let Err(e) = forked {
                // The request as a whole failed: no child exists.
                let now = Instant::now();
                let mut s = self.lock();
                for (_, id) in &admitted {
                    let _ = s.registry.creation_failed(id, now, chain(&e));
                    self.inner.egress.retire(id, now);
                }
                drop(s);
                self.inner.room.notify_waiters();
                return Err(e);
            }
        }
        for (place, slot) in slots.into_iter().enumerate() {
            if let Err(e) = slot {
                let _ = each.send((place, Err(e)));
            }
        }
        self.inner.metrics.fork_latency.observe(started.elapsed());
        self.inner.room.notify_waiters();
        Ok(())
    }

    /// Forks sandbox `id` into `count` children as [`Lifecycle::Fork`]
    /// does, streaming them: the first child to come up, then a receiver
    /// of the others as they come (each with its place in the request,
    /// the sandbox or why it failed). `Err` is the request's as a whole (a
    /// bad count, the parent not there or not forkable, its VMM refused),
    /// answered before any child.
    pub async fn fork_streamed(
        &self,
        id: SandboxId,
        count: u32,
        seed: Option<u64>,
    ) -> Result<(ForkedChild, mpsc::UnboundedReceiver<ForkedChild>), DaemonError> {
        check_fork_count(count)?;
        let (tx, mut rx) = mpsc::unbounded_channel();
        let this = self.clone();
        // Its own task, as for creations: a client that leaves does not
        // stop the fork; its children are recorded all the same.
        let mut task =
            tokio::spawn(async move { this.fork_each(id, count as usize, seed, tx).await });
        let first = tokio::select! {
            first = rx.recv() => first,
            ended = &mut task => {
                ended.map_err(|e| DaemonError::infra("the fork task failed", e))??;
                rx.recv().await
            }
        };
        let first = first.ok_or_else(|| {
            DaemonError::infra(
                "forking",
                std::io::Error::other("the fork ended without a child"),
            )
        })?;
        Ok((first, rx))
    }

    /// Counts and logs a fork child that replaced a lost one.
    pub(super) fn note_replaced(&self, id: &SandboxId, machine: &dyn BackendVm) {
        if let Some(why) = machine.replaced() {
            self.inner.metrics.fork_children_replaced.inc();
            tracing::warn!(sandbox = %id, "fork child replaced a lost one: {why}");
        }
    }

    /// Records how one fork child's creation ended.
    pub(super) fn record_fork_child(
        &self,
        id: &SandboxId,
        child: Result<Box<dyn BackendVm>, DaemonError>,
        inherited: &Inherited,
        now: Instant,
    ) -> Result<SandboxInfo, DaemonError> {
        let mut s = self.lock();
        match child {
            Err(e) => {
                let _ = s.registry.creation_failed(id, now, chain(&e));
                self.inner.egress.retire(id, now);
                self.inner.metrics.creations_failed.inc();
                Err(e)
            }
            Ok(machine) => {
                self.note_replaced(id, &*machine);
                let machine: Arc<dyn BackendVm> = Arc::from(machine);
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
                        policy: inherited.policy.clone(),
                        envs: inherited.envs.clone(),
                        cwd: inherited.cwd.clone(),
                        user: inherited.user.clone(),
                        spec: inherited.spec.clone(),
                        image_id: inherited.image_id.clone(),
                        ports: BTreeMap::new(),
                        baseline: inherited.baseline.clone(),
                    },
                );
                self.save(&s, id);
                self.inner.metrics.creations_ok.inc();
                let r = s.registry.get(id)?;
                Ok(info(r, s.machines.get(id)))
            }
        }
    }

    /// The last `lines` lines of a live sandbox's serial console.
    pub async fn console(&self, id: &SandboxId, lines: usize) -> Result<String, DaemonError> {
        let machine = self.machine_any(id)?;
        blocking(move || machine.console(lines)).await
    }
}

/// The one child of `machine.fork_with(1, opts)`; `what` names the step
/// in the error when the VMM answered with none.
pub(super) fn fork_one(
    machine: &dyn BackendVm,
    opts: &ForkOptions,
    what: &'static str,
) -> Result<Box<dyn BackendVm>, DaemonError> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::testing::*;

    #[tokio::test]
    async fn create_holds_its_sandbox_to_its_limits_over_the_templates_and_refuses_more() {
        let fake = Fake::default();
        let world = fake.world.clone();
        let d = daemon(fake, 4);
        let with = |limits| {
            Lifecycle::Create(CreateSandbox {
                template: "minimal".into(),
                limits,
                ..CreateSandbox::default()
            })
        };
        d.execute(with(None)).await.expect("no limits");
        let held = SandboxLimits {
            cpus: Some(0.5),
            memory_mib: Some(128),
        };
        d.execute(with(Some(held))).await.expect("held");
        // `minimal` is 1 vCPU and 512 MiB: 2 CPUs and 1024 MiB at most.
        let err = d
            .execute(with(Some(SandboxLimits {
                cpus: Some(2.5),
                memory_mib: None,
            })))
            .await
            .expect_err("more CPUs than its shape gets");
        assert_eq!(err.kind(), "invalid_request");
        assert!(err.to_string().contains("limits.cpus 2.5"), "{err}");
        let asked = world.fork_limits.lock().expect("limits").clone();
        let shape = forkbox_host::cgroup::Limits::for_vm(1, 512);
        assert_eq!(
            asked,
            vec![Some(shape), Some(held.resolve(1, 512).expect("in range")),],
            "the refused creation forked nothing"
        );
        // Nothing was admitted for it: two live, room for two more.
        created(&d, None).await;
        created(&d, None).await;
    }

    /// What the host memory test's probe reads, in MiB.
    static AVAILABLE_MIB: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

    #[tokio::test]
    async fn host_memory_refuses_creations_and_children_that_would_eat_the_reserve() {
        let fake = Fake::default();
        let d = Daemon::new(
            Arc::new(fake),
            Config {
                memory_reserve: 100 << 20,
                host_memory: || Some(AVAILABLE_MIB.load(ORD) << 20),
                ..config(64)
            },
        )
        .expect("daemon");
        // Room to bake the template's 512 MiB VM, then for one sandbox.
        AVAILABLE_MIB.store(1024, ORD);
        let a = created(&d, None).await;
        // A fresh fork is predicted at 8 MiB: 120 MiB leaves room for 2.
        AVAILABLE_MIB.store(120, ORD);
        let children = forked(&d, &a.id, 4).await;
        assert_eq!(
            children.iter().filter(|c| c.is_ok()).count(),
            2,
            "{children:?}"
        );
        let refused = children[3].as_ref().expect_err("past the reserve");
        assert_eq!(refused.kind(), "capacity");
        assert!(!refused.is_infrastructure());
        let text = chain(refused);
        assert!(
            text.contains("120 MiB available") && text.contains("100 MiB free"),
            "{text}"
        );
        // Less than one sandbox above the reserve: a creation is refused,
        // saying why, and nothing is admitted.
        AVAILABLE_MIB.store(104, ORD);
        let err = d
            .execute(create("minimal", None))
            .await
            .expect_err("no room");
        assert_eq!(err.kind(), "capacity");
        assert!(
            chain(&err).contains("--memory-reserve-mib"),
            "{}",
            chain(&err)
        );
        // Memory freed: the next one is admitted.
        AVAILABLE_MIB.store(4096, ORD);
        created(&d, None).await;
    }

    #[tokio::test]
    async fn create_beyond_live_cap_fails_with_capacity() {
        let d = daemon(Fake::default(), 1);
        let a = created(&d, None).await;
        assert_eq!(a.state, SandboxState::Running);
        let err = d.execute(create("minimal", None)).await.expect_err("cap");
        assert_eq!(err.kind(), "capacity");
        assert!(!err.is_infrastructure());
        d.execute(Lifecycle::Kill { id: a.id }).await.expect("kill");
        created(&d, None).await;
    }

    #[tokio::test]
    async fn create_waits_for_room_freed_by_a_kill() {
        let d = daemon(Fake::default(), 1);
        let a = created(&d, None).await;
        let d2 = d.clone();
        let waiter = tokio::spawn(async move {
            d2.execute(Lifecycle::Create(CreateSandbox {
                template: "minimal".into(),
                wait: Some(Duration::from_secs(30)),
                ..CreateSandbox::default()
            }))
            .await
        });
        tokio::task::yield_now().await;
        d.execute(Lifecycle::Kill { id: a.id }).await.expect("kill");
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
    async fn kill_by_label_kills_only_matching_and_refuses_empty_filter() {
        let fake = Fake::default();
        let world = fake.world.clone();
        let d = daemon(fake, 8);
        let mk = |run: &str| {
            Lifecycle::Create(CreateSandbox {
                template: "minimal".into(),
                labels: [("run".to_owned(), run.to_owned())].into(),
                ..CreateSandbox::default()
            })
        };
        for run in ["1", "1", "2"] {
            d.execute(mk(run)).await.expect("create");
        }
        let err = d
            .execute(Lifecycle::KillByLabel {
                labels: Labels::new(),
            })
            .await
            .expect_err("empty");
        assert_eq!(err.kind(), "invalid_request");
        let killed = match d
            .execute(Lifecycle::KillByLabel {
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
        // flight may still hold one), on the blocking pool; the zygote's
        // and run 2's live on.
        let vms = world
            .vms_until("both killed sandboxes' VMs dropped", |v| v.alive == 2)
            .await;
        assert_eq!(vms.kills, 2, "stopped before they were dropped: {vms:?}");
    }

    #[tokio::test]
    async fn fork_children_inherit_labels_and_fail_alone() {
        let fake = Fake::default();
        let world = fake.world.clone();
        let d = daemon(fake, 8);
        let parent = match d
            .execute(Lifecycle::Create(CreateSandbox {
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
        assert_eq!(d.inner.metrics.fork_children_replaced.get(), 0);
        *world.replaced.lock().expect("replaced") = Some(
            "the VMM (pid 7) died before its agent answered AfterFork\n[forkbox-vmm] guest reset (triple fault or KVM reset)".into(),
        );
        let kids = forked(&d, &parent.id, 2).await;
        assert_eq!(kids.len(), 2);
        assert_eq!(d.inner.metrics.fork_children_replaced.get(), 2);
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
            .execute(Lifecycle::Fork {
                id: parent.id.clone(),
                count: 0,
                seed: None,
            })
            .await
            .expect_err("count 0");
        assert_eq!(err.kind(), "invalid_request");
    }

    #[tokio::test]
    async fn paused_sandboxes_refuse_commands_until_resumed_and_can_fork() {
        let d = daemon(Fake::default(), 4);
        let a = created(&d, None).await;
        match d.execute(Lifecycle::Pause { id: a.id.clone() }).await {
            Ok(Reply::Sandbox(i)) => assert_eq!(i.state, SandboxState::Paused),
            other => panic!("{other:?}"),
        }
        let err = d
            .exec(&a.id, ExecRequest::shell("true"), None)
            .expect_err("paused");
        assert_eq!(err.kind(), "conflict");
        let kids = forked(&d, &a.id, 1).await;
        assert!(kids[0].is_ok());
        match d.execute(Lifecycle::Resume { id: a.id.clone() }).await {
            Ok(Reply::Sandbox(i)) => assert_eq!(i.state, SandboxState::Running),
            other => panic!("{other:?}"),
        }
    }
}
