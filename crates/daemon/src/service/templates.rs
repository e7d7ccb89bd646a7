//! Templates and their zygotes: the registry of templates, the bake
//! runner (boot, setup, readiness, then the VM becomes a zygote), the
//! waiting of concurrent creations on one bake, and templates made from a
//! sandbox's current state.

use std::collections::BTreeMap;
use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use forkbox_host::measure;
use forkbox_host::poll::{self, TimedOut};
use forkbox_net::policy::Policy;
use forkbox_proto::client::{AgentClient, ClientError};
use forkbox_proto::{ExecRequest, OutputStream};
use serde::Serialize;
use tokio::sync::{mpsc, watch};
use utoipa::ToSchema;

use super::lifecycle::{fork_one, MemoryRoom};
use super::{blocking, chain, reap, Baseline, Daemon, DaemonError};
use crate::backend::{BackendError, BackendVm, ForkOptions};
use crate::core::SandboxId;
use crate::persist::SavedTemplate;
use crate::template::{ResolvedImage, TemplateInfo, TemplateSpec, TemplateState};

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
    pub(super) fn of(step: String, e: &DaemonError) -> Self {
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
    pub(super) fn to_error(&self, template: &str) -> DaemonError {
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

/// A zygote made, with the record of its protected paths.
pub(super) type Baked = (Arc<dyn BackendVm>, Option<Arc<Baseline>>);

/// `None` while the bake runs, then its outcome.
pub(super) type BakeWatch = watch::Receiver<Option<Result<(), BakeFailure>>>;

/// A template and its zygote.
pub(super) struct Template {
    pub(super) spec: TemplateSpec,
    /// Its image, found once when the template was made: every sandbox
    /// of it gets this image's configuration without asking the store.
    pub(super) image: Arc<ResolvedImage>,
    pub(super) from_sandbox: Option<SandboxId>,
    /// Made by a request (not built in): a failed first bake unregisters
    /// it, so the same name can be tried again.
    pub(super) drop_on_failure: bool,
    pub(super) zygote: Zygote,
    /// Bytes of its zygote's snapshot in the state directory, once saved
    /// ([`Daemon::save_template`]).
    pub(super) saved_bytes: Option<u64>,
}

pub(super) enum Zygote {
    None {
        error: Option<String>,
    },
    Baking(BakeWatch),
    Ready {
        machine: Arc<dyn BackendVm>,
        bake_ms: u64,
        /// Its protected paths as baked (a template from a sandbox: the
        /// sandbox's template's).
        baseline: Option<Arc<Baseline>>,
    },
}

impl Template {
    pub(super) fn new(spec: TemplateSpec, image: ResolvedImage, zygote: Zygote) -> Self {
        Self {
            spec,
            image: Arc::new(image),
            from_sandbox: None,
            drop_on_failure: true,
            zygote,
            saved_bytes: None,
        }
    }

    /// What the state directory keeps of it while its zygote is up.
    pub(super) fn record(&self) -> Option<SavedTemplate> {
        let Zygote::Ready {
            machine,
            bake_ms,
            baseline,
        } = &self.zygote
        else {
            return None;
        };
        Some(SavedTemplate {
            spec: self.spec.clone(),
            image_id: self.image.id.clone(),
            from_sandbox: self.from_sandbox.clone(),
            drop_on_failure: self.drop_on_failure,
            bake_ms: *bake_ms,
            vm: machine.handle()?,
            network: machine.network_policy(),
            baseline: baseline.as_deref().cloned(),
            saved_bytes: self.saved_bytes,
        })
    }

    pub(super) fn info(&self) -> TemplateInfo {
        let (state, error, bake_ms, pid) = match &self.zygote {
            Zygote::None { error: None } => (TemplateState::NotBaked, None, None, None),
            Zygote::None { error } => (TemplateState::Failed, error.clone(), None, None),
            Zygote::Baking(_) => (TemplateState::Baking, None, None, None),
            Zygote::Ready {
                machine, bake_ms, ..
            } => (TemplateState::Ready, None, Some(*bake_ms), machine.pid()),
        };
        TemplateInfo {
            spec: self.spec.clone(),
            state,
            from_sandbox: self.from_sandbox.clone(),
            error,
            bake_ms,
            zygote_pid: pid,
            zygote_rss_kib: pid.and_then(measure::rss_kib),
            image_id: self.image.id.as_ref().map(ToString::to_string),
            saved_bytes: self.saved_bytes,
        }
    }
}

/// A zygote's template, as a sandbox forked from it needs it.
pub(super) struct ZygoteOf {
    pub(super) spec: TemplateSpec,
    pub(super) image: Arc<ResolvedImage>,
    /// Its protected paths' record.
    pub(super) baseline: Option<Arc<Baseline>>,
}

/// What asking for a bake found.
pub(super) enum BakeStart {
    Ready,
    /// This call started it: the events go to the sender it was given.
    Started(BakeWatch),
    /// Another bake of the template runs.
    InProgress(BakeWatch),
}

impl Daemon {
    /// Makes `name` a template whose zygote is a fork of the sandbox's
    /// current state (the sandbox runs on, or stays paused).
    pub async fn template_from_sandbox(
        &self,
        id: &SandboxId,
        name: String,
    ) -> Result<TemplateInfo, DaemonError> {
        let (machine, mut spec, baseline, image_id) = {
            let s = self.lock();
            // "snapshot": the API's word for it, in messages and events.
            let (_, live) = s.forkable(id, "snapshot")?;
            let mut spec = live.spec.clone();
            spec.envs = live.envs.clone();
            let image_id = live.image_id.clone();
            (live.machine.clone(), spec, live.baseline.clone(), image_id)
        };
        // The sandbox's own image, whatever its name names now.
        let image = spec
            .root_image(self.images(), image_id.as_ref())
            .map_err(DaemonError::BadTemplate)?;
        // Its state holds what the recipe did; it is never baked.
        spec.name = name.clone();
        spec.setup.clear();
        spec.ready = None;
        spec.run_image_cmd = false;
        spec.network = None;
        spec.validate().map_err(DaemonError::BadTemplate)?;
        let (tx, rx) = watch::channel(None);
        self.register(
            Template {
                from_sandbox: Some(id.clone()),
                ..Template::new(spec, image, Zygote::Baking(rx))
            },
            false,
        )?;
        let start = Instant::now();
        // A zygote denies all egress: each sandbox forked from it gets the
        // policy of its own creation.
        let opts = ForkOptions {
            policy: Some(Policy::deny_all()),
            ..ForkOptions::default()
        };
        let made = blocking(move || -> Result<Box<dyn BackendVm>, DaemonError> {
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
            Ok(z) => Ok((Arc::from(z), baseline)),
            Err(e) => Err(BakeFailure::of("snapshot".into(), &e)),
        };
        let result = self.bake_ended(&name, outcome, start.elapsed(), &tx);
        result.map_err(|f| f.to_error(&name))
    }

    /// Writes the zygote of `name` (its memory, sparse, and its state)
    /// to the state directory, so that a daemon that cannot re-adopt it
    /// (it was stopped, or the host rebooted) starts it from there instead
    /// of baking. Saved again, the snapshot is replaced. Creations from the
    /// template wait while it is written.
    pub async fn save_template(&self, name: &str) -> Result<TemplateInfo, DaemonError> {
        let Some(store) = self.inner.store.clone() else {
            return Err(DaemonError::Invalid(
                "this daemon keeps no state (forkboxd --no-state): a template saved now \
                 would not outlive it"
                    .into(),
            ));
        };
        let machine = {
            let s = self.lock();
            let t = s
                .templates
                .get(name)
                .ok_or_else(|| DaemonError::NoTemplate(name.into()))?;
            match &t.zygote {
                Zygote::Ready { machine, .. } => machine.clone(),
                _ => {
                    return Err(DaemonError::Busy(format!(
                        "template {name:?} is not baked: bake it (or create a sandbox from it) \
                         before saving it"
                    )))
                }
            }
        };
        // Written aside, then put in place only if the template still has
        // this zygote: a delete or a stop meanwhile never loses the
        // snapshot it keeps, nor gets a stale one.
        let tmp = store.snapshot_tmp_dir(name);
        let _ = std::fs::remove_dir_all(&tmp);
        let (zygote, into) = (machine.clone(), tmp.clone());
        let written = blocking(move || zygote.snapshot(&into))
            .await
            .and_then(|r| r.map_err(DaemonError::from));
        let bytes = match written {
            Ok(bytes) => bytes,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&tmp);
                return Err(e);
            }
        };
        let mut s = self.lock();
        let current = s.templates.get_mut(name).filter(
            |t| matches!(&t.zygote, Zygote::Ready { machine: m, .. } if Arc::ptr_eq(m, &machine)),
        );
        let Some(t) = current else {
            drop(s);
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(DaemonError::Busy(format!(
                "template {name:?} was deleted or made again while it was saved"
            )));
        };
        let dir = store.snapshot_dir(name);
        let _ = std::fs::remove_dir_all(&dir);
        if let Err(e) = std::fs::rename(&tmp, &dir) {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(DaemonError::infra(
                format!("putting the snapshot in {}", dir.display()),
                e,
            ));
        }
        t.saved_bytes = Some(bytes);
        if let Some(record) = t.record() {
            store.save_template(&record);
        }
        Ok(t.info())
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
        t.saved_bytes = None;
        if t.drop_on_failure {
            s.templates.remove(name);
            self.unpin_image(name);
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
        let spec = spec
            .resolve_disk_images(self.images())
            .map_err(DaemonError::BadTemplate)?;
        let image = spec
            .root_image(self.images(), None)
            .map_err(DaemonError::BadTemplate)?;
        spec.image_cmd(&image).map_err(DaemonError::BadTemplate)?;
        let name = spec.name.clone();
        self.register(
            Template::new(spec, image, Zygote::None { error: None }),
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

    pub(super) fn register(&self, t: Template, replace: bool) -> Result<(), DaemonError> {
        let mut s = self.lock();
        if !replace && s.templates.contains_key(&t.spec.name) {
            return Err(DaemonError::TemplateExists(t.spec.name));
        }
        self.pin_image(&t)?;
        s.templates.insert(t.spec.name.clone(), t);
        Ok(())
    }

    /// The image store templates may name images of, if this daemon has one.
    pub(super) fn images(&self) -> Option<&forkbox_image::Store> {
        self.inner.config.images.as_ref().map(|(store, _)| store)
    }

    /// Keeps the stored image of `t` in the store while the template
    /// lives (`forkbox image rm` and `gc` leave it); nothing for a
    /// built-in image.
    fn pin_image(&self, t: &Template) -> Result<(), DaemonError> {
        let Some((store, holder)) = &self.inner.config.images else {
            return Ok(());
        };
        let name = &t.spec.name;
        let root = pin_holder(holder, name, None);
        match &t.image.id {
            Some(id) => store.pin(&root, id),
            None => store.unpin(&root),
        }
        .map_err(|e| DaemonError::infra("pinning the template's image in the store", e))?;
        // Its disks' images: read again only if their volumes must be.
        for i in 0..usize::from(forkbox_host::vm::MAX_WRITABLE_DISKS) {
            let disk = pin_holder(holder, name, Some(i));
            let image = t.spec.disks.get(i).and_then(|d| d.image_id.as_deref());
            match image.map(str::parse::<forkbox_image::Digest>) {
                Some(Ok(id)) => store.pin(&disk, &id),
                _ => store.unpin(&disk),
            }
            .map_err(|e| DaemonError::infra("pinning a template disk's image in the store", e))?;
        }
        Ok(())
    }

    /// Lets the store remove the image of the template `name` (gone).
    pub(super) fn unpin_image(&self, name: &str) {
        if let Some((store, holder)) = &self.inner.config.images {
            let disks = (0..usize::from(forkbox_host::vm::MAX_WRITABLE_DISKS)).map(Some);
            for which in std::iter::once(None).chain(disks) {
                if let Err(e) = store.unpin(&pin_holder(holder, name, which)) {
                    tracing::warn!(template = name, "unpinning its images: {e}");
                }
            }
        }
    }

    /// The zygote of `name` with its template, baking it first when
    /// needed.
    pub(super) async fn zygote(
        &self,
        name: &str,
    ) -> Result<(Arc<dyn BackendVm>, ZygoteOf), DaemonError> {
        loop {
            let mut w = match self.start_bake(name, None)? {
                BakeStart::Ready => {
                    let s = self.lock();
                    let t = s
                        .templates
                        .get(name)
                        .ok_or_else(|| DaemonError::NoTemplate(name.into()))?;
                    if let Zygote::Ready {
                        machine, baseline, ..
                    } = &t.zygote
                    {
                        return Ok((
                            machine.clone(),
                            ZygoteOf {
                                spec: t.spec.clone(),
                                image: t.image.clone(),
                                baseline: baseline.clone(),
                            },
                        ));
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
    pub(super) fn start_bake(
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
            // Made from a sandbox's state, which no recipe makes again.
            Zygote::None { error } if t.from_sandbox.is_some() => {
                return Err(DaemonError::Busy(format!(
                    "template {name:?} holds a sandbox's state and has no zygote ({}); it \
                     cannot be baked: delete it",
                    error.as_deref().unwrap_or("gone")
                )))
            }
            Zygote::None { .. } => {}
        }
        let machine_spec = t.spec.boot_spec(self.inner.config.boot_timeout, &t.image);
        // The recipe runs in the image's environment and directory, the
        // template's own variables over the image's.
        let image = t.image.clone();
        let mut envs = image.env();
        envs.extend(t.spec.envs.clone());
        let run = RecipeRun {
            envs,
            cwd: image.working_dir(),
            service: t.spec.image_cmd(&image).map_err(DaemonError::BadTemplate)?,
        };
        // A bake boots a whole VM, whose setup may write all its RAM: the
        // host's memory must have room for it above the reserve.
        if let Some(available) = (self.inner.config.host_memory)() {
            let room = MemoryRoom {
                available,
                reserve: self.inner.config.memory_reserve,
                each: u64::from(t.spec.memory_mib) << 20,
                basis: "its bake: a VM whose setup may write all its RAM".into(),
                template: name.into(),
            };
            if room.fitting(1) == 0 {
                return Err(DaemonError::Capacity {
                    waited_ms: 0,
                    cause: room.refusal(),
                });
            }
        }
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
            let max_exec = this.bounds().max_exec;
            let backend = this.inner.backend.clone();
            let recipe = spec.clone();
            let send2 = send.clone();
            let baked = blocking(
                move || -> Result<(Box<dyn BackendVm>, u64, _), BakeFailure> {
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
                    run_recipe(&machine.agent(), max_exec, &recipe, &run, &mut |e| send2(e))
                        .map_err(|e| BakeFailure::of(step_of(&e), &e))?;
                    let baseline = if recipe.protect.is_empty() {
                        None
                    } else {
                        send2(BakeEvent::Step {
                            step: "protect".into(),
                            detail: format!(
                                "making {} root's and read-only to everyone else, and \
                             recording what they hold",
                                recipe.protect.join(", ")
                            ),
                        });
                        let agent = machine.agent().with_call_timeout(max_exec);
                        let b = Baseline::take(&agent, &recipe.protect)
                            .map_err(|e| BakeFailure::of("protect".into(), &e))?;
                        Some(Arc::new(b))
                    };
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
                    Ok((machine, boot_ms, baseline))
                },
            )
            .await;
            let (outcome, boot_ms) = match baked {
                Ok(Ok((m, boot_ms, baseline))) => (Ok((Arc::from(m), baseline)), boot_ms),
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

    /// Records how a bake (or a template from a sandbox) ended and wakes
    /// its waiters.
    pub(super) fn bake_ended(
        &self,
        name: &str,
        outcome: Result<Baked, BakeFailure>,
        took: Duration,
        done: &watch::Sender<Option<Result<(), BakeFailure>>>,
    ) -> Result<TemplateInfo, BakeFailure> {
        let mut s = self.lock();
        let result = match (outcome, s.templates.get_mut(name)) {
            (Ok((machine, baseline)), Some(t)) => {
                t.zygote = Zygote::Ready {
                    machine,
                    bake_ms: took.as_millis() as u64,
                    baseline,
                };
                if let (Some(store), Some(record)) = (&self.inner.store, t.record()) {
                    store.save_template(&record);
                    // Baked anew: a snapshot left from before is stale.
                    if t.saved_bytes.is_none() {
                        store.forget_snapshot(name);
                    }
                }
                Ok(t.info())
            }
            (Ok((machine, _)), None) => {
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
                    self.unpin_image(name);
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
        counter.inc();
        let _ = done.send(Some(result.as_ref().map(|_| ()).map_err(Clone::clone)));
        result
    }
}

pub(super) fn step_of(e: &DaemonError) -> String {
    match e {
        DaemonError::Recipe { step, .. } => step.clone(),
        _ => "recipe".into(),
    }
}

/// What a recipe runs with, from its template's image: the environment
/// and directory of its commands, and the image's service if the
/// template starts it.
pub(super) struct RecipeRun {
    pub(super) envs: BTreeMap<String, String>,
    pub(super) cwd: Option<String>,
    pub(super) service: Option<(Vec<String>, forkbox_proto::User)>,
}

/// Setup commands in order (each at most `max_exec`), then the image's
/// service if asked for, then the readiness check until it passes or its
/// timeout ends. Blocking; every agent call
/// has a deadline.
pub(super) fn run_recipe(
    agent: &AgentClient,
    max_exec: Duration,
    t: &TemplateSpec,
    run: &RecipeRun,
    progress: &mut dyn FnMut(BakeEvent),
) -> Result<(), DaemonError> {
    let (envs, cwd) = (&run.envs, run.cwd.as_deref());
    for (i, cmd) in t.setup.iter().enumerate() {
        let step = format!("setup[{i}]");
        progress(BakeEvent::Step {
            step: step.clone(),
            detail: cmd.clone(),
        });
        let mut req = ExecRequest::shell(cmd.clone()).timeout(max_exec);
        req.env = envs.clone();
        req.cwd = cwd.map(str::to_owned);
        let mut output = Vec::new();
        let r = agent
            .clone()
            .with_call_timeout(max_exec.saturating_add(super::EXEC_MARGIN))
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
    if let Some((argv, user)) = &run.service {
        progress(BakeEvent::Step {
            step: "service".into(),
            detail: format!(
                "the image's {argv:?} in the background, as {}",
                match user {
                    forkbox_proto::User::Name(n) => n.clone(),
                    forkbox_proto::User::Uid(u) => format!("uid {u}"),
                }
            ),
        });
        let mut req = ExecRequest::argv(argv.clone());
        req.env = envs.clone();
        req.cwd = cwd.map(str::to_owned);
        req.user = Some(user.clone());
        let pid = agent
            .clone()
            .with_call_timeout(max_exec.min(super::SERVICE_START))
            .spawn(&req)
            .map_err(|e| match e {
                // The guest could not start it (no such file, no such
                // user): the image's or the template's doing.
                ClientError::Agent(refused) => DaemonError::Recipe {
                    step: "service".into(),
                    message: format!("starting {argv:?}: {refused}"),
                    output: String::new(),
                },
                e => DaemonError::infra("starting the image's service", e),
            })?;
        progress(BakeEvent::Output {
            stream: "stdout".into(),
            data: format!("service started: pid {pid}\n"),
        });
    }
    if let Some(ready) = &t.ready {
        progress(BakeEvent::Step {
            step: "ready".into(),
            detail: format!("{ready:?}, up to {} s", t.ready_timeout_secs),
        });
        // `validate` bounds `ready_timeout_secs`; `deadline_in` is the
        // second line.
        let deadline = super::deadline_in(Duration::from_secs(t.ready_timeout_secs));
        const CHECK: Duration = Duration::from_secs(10);
        let mut req = ExecRequest::shell(ready.script()).timeout(CHECK);
        req.env = envs.clone();
        req.cwd = cwd.map(str::to_owned);
        let agent = agent
            .clone()
            .with_call_timeout(CHECK.saturating_add(super::EXEC_MARGIN));
        poll::until(deadline, Duration::from_millis(200), || {
            let mut output = Vec::new();
            match agent.exec(&req, None, &mut |_, b| output.extend_from_slice(b)) {
                Ok(r) if r.success() => ControlFlow::Break(Ok(())),
                Ok(_) => ControlFlow::Continue(output),
                Err(e) => {
                    ControlFlow::Break(Err(DaemonError::infra("running the readiness check", e)))
                }
            }
        })
        .unwrap_or_else(|TimedOut(output)| {
            Err(DaemonError::Recipe {
                step: "ready".into(),
                message: format!("{ready:?} not ready after {} s", t.ready_timeout_secs),
                output: tail(&output),
            })
        })?;
    }
    Ok(())
}

pub(super) fn stream_name(s: OutputStream) -> &'static str {
    match s {
        OutputStream::Stdout => "stdout",
        OutputStream::Stderr => "stderr",
    }
}

/// The last 4 KiB of a command's output, for error reports.
pub(super) fn tail(out: &[u8]) -> String {
    String::from_utf8_lossy(&out[out.len().saturating_sub(4096)..]).into_owned()
}

/// The name under which this daemon (`holder`) pins template `name`'s
/// image in the store, or its disk `disk`'s image.
fn pin_holder(holder: &str, name: &str, disk: Option<usize>) -> String {
    match disk {
        None => format!("{holder}: template {name}"),
        Some(i) => format!("{holder}: template {name} disk {i}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::testing::*;

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
        assert_eq!(world.vms().alive, 3, "zygote + 2");
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

    /// What a stored image's configuration says reaches every command: its
    /// `Env` under the template's variables (under the command's own), its
    /// `WorkingDir` where the command names none; the setup runs so too.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stored_image_s_env_and_working_dir_reach_its_recipe_service_and_commands() {
        use forkbox_proto::{ExecResult, ExitStatus, Request, Response};
        let dir = tempfile::tempdir().expect("tempdir");
        let store = forkbox_image::Store::open(&dir.path().join("store")).expect("store");
        let image = forkbox_image::Image {
            id: forkbox_image::Digest::of(b"config"),
            layers: Vec::new(),
            config: forkbox_image::RunConfig {
                env: vec!["PATH=/img/bin".into(), "SHARED=image".into()],
                working_dir: Some("/work".into()),
                user: Some("app".into()),
                entrypoint: vec!["/img/bin/serve".into()],
                cmd: vec!["--port".into(), "8080".into()],
            },
            manifest: None,
            created: None,
        };
        store.put_image(&image).expect("image");
        store.tag("task:1", &image.id).expect("tag");
        let bare = forkbox_image::Image {
            id: forkbox_image::Digest::of(b"no cmd"),
            config: Default::default(),
            ..image.clone()
        };
        store.put_image(&bare).expect("image");
        store.tag("bare:1", &bare.id).expect("tag");
        type Seen = Vec<(String, BTreeMap<String, String>, Option<String>)>;
        let seen: Arc<std::sync::Mutex<Seen>> = Default::default();
        let record = seen.clone();
        let sock = crate::backend::fake::scripted_agent(dir.path(), move |conn, req| {
            if let Request::Spawn { exec } = req {
                let what = format!("spawn {:?} as {:?}", exec.command, exec.user);
                record
                    .lock()
                    .expect("seen")
                    .push((what, exec.env, exec.cwd));
                let r = Response::Spawned { pid: 7 };
                let _ = forkbox_proto::frame::write_frame(
                    conn,
                    forkbox_proto::FrameKind::Control,
                    &forkbox_proto::encode_control(&r),
                );
            } else if let Request::Exec { exec, .. } = req {
                let what = format!("{:?}", exec.command);
                record
                    .lock()
                    .expect("seen")
                    .push((what, exec.env, exec.cwd));
                let result = ExecResult {
                    status: ExitStatus::Code(0),
                    timed_out: false,
                    duration: Duration::ZERO,
                    stdout: Default::default(),
                    stderr: Default::default(),
                };
                let r = Response::Exec { result };
                let _ = forkbox_proto::frame::write_frame(
                    conn,
                    forkbox_proto::FrameKind::Control,
                    &forkbox_proto::encode_control(&r),
                );
            }
        });
        let fake = Fake::default();
        *fake.world.agent_sock.lock().expect("agent_sock") = Some(sock);
        let d = Daemon::new(
            Arc::new(fake),
            Config {
                images: Some((store, "forkboxd test".into())),
                ..config(4)
            },
        )
        .expect("daemon");
        let mut spec = TemplateSpec::builtin(forkbox_host::image::ImageName::Minimal);
        spec.name = "t".into();
        spec.image = "task:1".into();
        spec.setup = vec!["make setup".into()];
        spec.envs = BTreeMap::from([("SHARED".into(), "template".into())]);
        spec.run_image_cmd = true;
        spec.ready = Some(crate::template::Readiness::Command(
            "curl -fs localhost:8080".into(),
        ));
        let e = d
            .bake(TemplateSpec {
                image: "bare:1".into(),
                ..spec.clone()
            })
            .expect_err("no command to run");
        assert_eq!(e.kind(), "invalid_request", "{e}");
        assert!(
            chain(&e).contains("no `Entrypoint` or `Cmd`"),
            "{}",
            chain(&e)
        );
        let mut rx = d.bake(spec).expect("starts");
        let mut last = None;
        while let Some(e) = rx.recv().await {
            last = Some(e);
        }
        assert!(matches!(last, Some(BakeEvent::Done { .. })), "{last:?}");
        let a = created_with(&d, "t", None).await;
        let mut own = ExecRequest::shell("pwd");
        own.env.insert("SHARED".into(), "command".into());
        own.cwd = Some("/elsewhere".into());
        for req in [ExecRequest::shell("ls"), own] {
            let mut events = d.exec(&a.id, req, None).expect("exec");
            while events.recv().await.is_some() {}
        }
        assert_eq!(
            d.default_user(&a.id),
            forkbox_proto::User::Name("app".into()),
            "the image's User"
        );
        let seen = seen.lock().expect("seen").clone();
        let want = |cmd: &str, shared: &str, cwd: &str| {
            let env = BTreeMap::from([
                ("PATH".to_owned(), "/img/bin".to_owned()),
                ("SHARED".to_owned(), shared.to_owned()),
            ]);
            (cmd.to_owned(), env, Some(cwd.to_owned()))
        };
        let shell = |c: &str| format!("{:?}", ExecRequest::shell(c).command);
        let service = format!(
            "spawn {:?} as {:?}",
            ExecRequest::argv(["/img/bin/serve", "--port", "8080"]).command,
            Some(forkbox_proto::User::Name("app".into()))
        );
        let ready = crate::template::Readiness::Command("curl -fs localhost:8080".into()).script();
        assert_eq!(
            seen,
            vec![
                want(&shell("make setup"), "template", "/work"),
                want(&service, "template", "/work"),
                want(&shell(&ready), "template", "/work"),
                want(&shell("ls"), "template", "/work"),
                want(&shell("pwd"), "command", "/elsewhere"),
            ]
        );
        // A snapshot of a sandbox holds the service running already.
        let snap = d
            .template_from_sandbox(&a.id, "snap".into())
            .await
            .expect("snapshot");
        assert!(!snap.spec.run_image_cmd);
    }

    #[tokio::test]
    async fn a_template_keeps_the_stored_image_it_found_pinned_until_it_is_deleted() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = forkbox_image::Store::open(dir.path()).expect("store");
        let image_of = |config: &[u8], user: &str| forkbox_image::Image {
            id: forkbox_image::Digest::of(config),
            layers: Vec::new(),
            config: forkbox_image::RunConfig {
                user: Some(user.into()),
                ..Default::default()
            },
            manifest: None,
            created: None,
        };
        let image = image_of(b"config", "app");
        store.put_image(&image).expect("image");
        store.tag("task:1", &image.id).expect("tag");
        let d = Daemon::new(
            Arc::new(Fake::default()),
            Config {
                images: Some((store.clone(), "forkboxd test".into())),
                ..config(4)
            },
        )
        .expect("daemon");
        let mut spec = TemplateSpec::builtin(forkbox_host::image::ImageName::Minimal);
        spec.name = "t".into();
        spec.image = "nope:1".into();
        let err = d.bake(spec.clone()).expect_err("not in the store");
        assert_eq!(err.kind(), "invalid_request");
        assert!(err.to_string().contains("nope:1") || format!("{err:?}").contains("nope:1"));
        spec.image = "task:1".into();
        let mut rx = d.bake(spec).expect("starts");
        while rx.recv().await.is_some() {}
        let pins = store.pins().expect("pins");
        assert_eq!(pins.get("forkboxd test: template t"), Some(&image.id));
        assert!(matches!(
            store.remove("task:1"),
            Err(forkbox_image::StoreError::InUse { .. })
        ));
        // The name moves to another image: the template, its sandboxes
        // and a snapshot of one keep the image the bake found.
        let other = image_of(b"other config", "bob");
        store.put_image(&other).expect("other image");
        store.tag("task:1", &other.id).expect("moved");
        let a = created_with(&d, "t", None).await;
        assert_eq!(
            d.default_user(&a.id),
            forkbox_proto::User::Name("app".into())
        );
        let snap = d
            .template_from_sandbox(&a.id, "snap".into())
            .await
            .expect("snapshot");
        let id = Some(image.id.to_string());
        assert_eq!(
            (d.template("t").expect("t").image_id, snap.image_id),
            (id.clone(), id)
        );
        let pins = store.pins().expect("pins");
        assert_eq!(pins.get("forkboxd test: template snap"), Some(&image.id));
        let b = created_with(&d, "snap", None).await;
        assert_eq!(
            d.default_user(&b.id),
            forkbox_proto::User::Name("app".into())
        );
        d.delete_template("t").expect("deleted");
        d.delete_template("snap").expect("deleted");
        assert!(store.pins().expect("pins").is_empty());
        store.remove(&image.id.to_string()).expect("free to go");
    }

    #[tokio::test]
    async fn template_from_sandbox_is_a_template_whose_creations_fork_it() {
        let fake = Fake::default();
        let world = fake.world.clone();
        let d = daemon(fake, 4);
        let a = created(&d, None).await;
        let t = d
            .template_from_sandbox(&a.id, "after-step-3".into())
            .await
            .expect("template from sandbox");
        assert_eq!(t.state, TemplateState::Ready);
        assert_eq!(t.from_sandbox.as_ref(), Some(&a.id));
        assert!(t.spec.setup.is_empty());
        let err = d
            .template_from_sandbox(&a.id, "after-step-3".into())
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
    async fn a_bake_the_hosts_memory_has_no_room_for_is_refused_and_boots_nothing() {
        let fake = Fake::default();
        let world = fake.world.clone();
        // 100 MiB available: no room for `minimal`'s 512 MiB VM.
        let d = Daemon::new(
            Arc::new(fake),
            Config {
                host_memory: || Some(100 << 20),
                ..config(4)
            },
        )
        .expect("daemon");
        let err = d
            .execute(create("minimal", None))
            .await
            .expect_err("no room to bake");
        assert_eq!(err.kind(), "capacity");
        let text = chain(&err);
        assert!(
            text.contains("its bake") && text.contains("512 MiB"),
            "{text}"
        );
        assert_eq!(world.boots.load(ORD), 0);
        assert_eq!(
            d.template("minimal").expect("registered").state,
            TemplateState::NotBaked
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
        // The zygote of a template from a sandbox denies all too.
        d.template_from_sandbox(&own.id, "snap".into())
            .await
            .expect("template from sandbox");
        let zygote_policy = match &d.lock().templates["snap"].zygote {
            Zygote::Ready { machine, .. } => machine.network_policy(),
            _ => panic!("template from sandbox not ready"),
        };
        assert_eq!(zygote_policy, Some(Policy::deny_all()));
    }
}
