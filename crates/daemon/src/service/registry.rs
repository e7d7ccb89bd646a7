//! Baked templates pushed to a registry and pulled from one
//! (`forkbox_image::artifact`): another daemon (another state directory,
//! another host) forks a pulled template without baking it.
//!
//! A push saves the template first if it was not ([`Daemon::save_template`])
//! and sends its record, its snapshot (the memory compressed) and, for a
//! stored image, the image whole. A pull downloads them, checks that the
//! snapshot is of this host's copy of the same image (layers by digest; a
//! built-in image's disk by digest), names this host's files in the
//! snapshot's state, and starts the zygote from it: the template is then
//! saved here too, and outlives this daemon as any saved template does.

use std::sync::Arc;
use std::time::Instant;

use forkbox_image::artifact::{self, OnTransfer, Transfer};
use forkbox_image::{PullError, Registry};
use forkbox_net::policy::Policy;
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch};
use utoipa::ToSchema;

use super::templates::{Template, Zygote};
use super::{blocking, chain, reap, BakeFailure, Baseline, Daemon, DaemonError};
use crate::backend::NetworkSpec;
use crate::core::SandboxId;
use crate::template::{TemplateInfo, TemplateSpec};
use forkbox_host::vm::Expected;

/// The body of `POST /templates/{name}/push` and `/pull`: where, and how
/// to reach it.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RegistryRequest {
    /// `host[:port]/repository:tag` (a pull may name `…@sha256:…`).
    pub reference: String,
    /// Speak HTTP, not HTTPS: for a registry on loopback.
    #[serde(default)]
    pub plain_http: bool,
    /// Basic auth, or the credentials a token server asks for.
    #[serde(default)]
    pub username: Option<String>,
    #[serde(default)]
    pub password: Option<String>,
}

impl RegistryRequest {
    fn registry(&self) -> Registry {
        Registry {
            auth: self
                .username
                .clone()
                .map(|u| (u, self.password.clone().unwrap_or_default())),
            plain_http: self.plain_http,
        }
    }
}

/// One event of a push or a pull, streamed as NDJSON.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum RegistryEvent {
    /// A step began: `save`, `compress`, `push`, `pull`, `unpack`, `start`.
    Step {
        step: String,
        detail: String,
    },
    /// `bytes` of `what` (of `total`) moved; `present`: the other side
    /// had it, nothing moved.
    Progress {
        what: String,
        bytes: u64,
        total: u64,
        present: bool,
    },
    /// The push ended: the artifact's manifest digest, bytes sent, and
    /// bytes the registry had already.
    Pushed {
        reference: String,
        digest: String,
        sent_bytes: u64,
        present_bytes: u64,
        total_ms: u64,
    },
    /// The pull ended: the template is registered, its zygote up.
    Pulled {
        template: Box<TemplateInfo>,
        digest: String,
        downloaded_bytes: u64,
        total_ms: u64,
    },
    Failed(BakeFailure),
}

/// The artifact's configuration: what a daemon needs of the template
/// besides its snapshot.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct PushedTemplate {
    /// [`FORMAT`].
    format: u32,
    /// The forkbox that pushed it: its guest agent is in the snapshot.
    forkbox: String,
    spec: TemplateSpec,
    /// A stored image's id (it travels in the artifact).
    image_id: Option<forkbox_image::Digest>,
    /// A built-in image's disk digest (it does not travel).
    builtin_disk: Option<String>,
    from_sandbox: Option<SandboxId>,
    bake_ms: u64,
    /// The zygote's egress policy (deny all), its network's presence.
    network: Option<Policy>,
    baseline: Option<Baseline>,
}

const FORMAT: u32 = 1;
const FORKBOX: &str = env!("CARGO_PKG_VERSION");

/// Runs `work` on a task of its own; its outcome (`end` of its result
/// and its milliseconds, or the step it failed at) is the stream's last
/// event.
fn to_the_end<T>(
    tx: mpsc::Sender<RegistryEvent>,
    work: impl std::future::Future<Output = Result<T, (&'static str, DaemonError)>> + Send + 'static,
    end: impl FnOnce(T, u64) -> RegistryEvent + Send + 'static,
) {
    tokio::spawn(async move {
        let start = Instant::now();
        let event = match work.await {
            Ok(done) => end(done, start.elapsed().as_millis() as u64),
            Err((step, e)) => RegistryEvent::Failed(BakeFailure::of(step.into(), &e)),
        };
        let _ = tx.send(event).await;
    });
}

impl From<PullError> for DaemonError {
    fn from(e: PullError) -> Self {
        match e {
            PullError::Reference(_)
            | PullError::NotATemplate { .. }
            | PullError::Artifact(_)
            | PullError::Mismatch { .. } => DaemonError::Invalid(chain(&e)),
            e => DaemonError::infra("the registry transfer", e),
        }
    }
}

/// Progress into the stream; a slow reader misses some, never the end.
fn on_transfer(tx: &mpsc::Sender<RegistryEvent>) -> OnTransfer {
    let tx = tx.clone();
    Arc::new(move |t: Transfer| {
        let _ = tx.try_send(RegistryEvent::Progress {
            what: t.what,
            bytes: t.bytes,
            total: t.total,
            present: t.present,
        });
    })
}

/// Why a template with writable disks neither leaves nor arrives
/// through a registry (yet).
const NO_DISKS_YET: &str = "a template with writable disks cannot go through a registry yet: \
     its disks' blocks would have to travel with its memory. Save it here \
     (`forkbox template save`), or push one without disks";

impl Daemon {
    /// The state directory, or why `what` needs one.
    fn state_for(&self, what: &str) -> Result<(), DaemonError> {
        match self.inner.store {
            Some(_) => Ok(()),
            None => Err(DaemonError::Invalid(format!(
                "this daemon keeps no state (forkboxd --no-state): {what}"
            ))),
        }
    }

    /// Pushes the baked template `name` to a registry, saving it first if
    /// it was not.
    pub fn push_template(
        &self,
        name: &str,
        req: RegistryRequest,
    ) -> Result<mpsc::Receiver<RegistryEvent>, DaemonError> {
        self.state_for("a template is pushed from its saved snapshot")?;
        if !self.template(name)?.spec.disks.is_empty() {
            return Err(DaemonError::Invalid(NO_DISKS_YET.into()));
        }
        let (tx, rx) = mpsc::channel(64);
        let (this, name, events) = (self.clone(), name.to_owned(), tx.clone());
        let reference = req.reference.clone();
        to_the_end(
            tx,
            async move { this.push(&name, &req, &events).await },
            |pushed, total_ms| RegistryEvent::Pushed {
                reference,
                digest: pushed.digest.to_string(),
                sent_bytes: pushed.sent,
                present_bytes: pushed.present,
                total_ms,
            },
        );
        Ok(rx)
    }

    async fn push(
        &self,
        name: &str,
        req: &RegistryRequest,
        tx: &mpsc::Sender<RegistryEvent>,
    ) -> Result<artifact::Pushed, (&'static str, DaemonError)> {
        let store = self.inner.store.clone().expect("checked");
        let step = |step: &str, detail: String| {
            let _ = tx.try_send(RegistryEvent::Step {
                step: step.into(),
                detail,
            });
        };
        if self
            .template(name)
            .map_err(|e| ("save", e))?
            .saved_bytes
            .is_none()
        {
            step(
                "save",
                "writing the zygote's snapshot to the state directory".into(),
            );
            self.save_template(name).await.map_err(|e| ("save", e))?;
        }
        // The snapshot's two files as one save left them (and its memory
        // packed by an earlier push): read together under the lock a save
        // renames them under.
        let work = store.dir().join("snapshots");
        let dir = store.snapshot_dir(name);
        let packed_at = dir.join("memory.zst");
        let (record, state, memory, kept) = {
            let s = self.lock();
            let t = s
                .templates
                .get(name)
                .ok_or_else(|| ("save", DaemonError::NoTemplate(name.into())))?;
            let Zygote::Ready {
                machine,
                bake_ms,
                baseline,
            } = &t.zygote
            else {
                return Err((
                    "save",
                    DaemonError::Busy(format!("template {name:?} is not baked")),
                ));
            };
            let read = || -> std::io::Result<_> {
                Ok((
                    std::fs::read(dir.join("state.json"))?,
                    std::fs::File::open(dir.join("memory"))?,
                    artifact::PackedMemory::kept(&packed_at, &work)?,
                ))
            };
            let (state, memory, kept) = read().map_err(|e| {
                (
                    "save",
                    DaemonError::infra(format!("reading the snapshot in {}", dir.display()), e),
                )
            })?;
            let record = PushedTemplate {
                format: FORMAT,
                forkbox: FORKBOX.into(),
                spec: t.spec.clone(),
                image_id: t.image.id.clone(),
                builtin_disk: None,
                from_sandbox: t.from_sandbox.clone(),
                bake_ms: *bake_ms,
                network: machine.network_policy(),
                baseline: baseline.as_deref().cloned(),
            };
            (record, state, memory, kept)
        };
        let mut record = record;
        let backend = self.inner.backend.clone();
        let builtin = record.spec.builtin_image();
        let fresh = kept.is_none();
        if fresh {
            step(
                "compress",
                "compressing the guest memory (zstd) and hashing what is sent".into(),
            );
        }
        let ino = |f: &std::fs::File| {
            f.metadata()
                .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
        };
        let packed_ino = ino(&memory).ok();
        let (packed, disk) = blocking(move || -> Result<_, DaemonError> {
            let packed = match kept {
                Some(packed) => packed,
                None => artifact::pack_memory(memory, &work)
                    .map_err(|e| DaemonError::infra("compressing the guest memory", e))?,
            };
            let disk = builtin.map(|b| backend.disk_digest(b)).transpose()?;
            Ok((packed, disk))
        })
        .await
        .and_then(|r| r)
        .map_err(|e| ("compress", e))?;
        record.builtin_disk = disk;
        if fresh {
            // Kept beside the snapshot it was made of, if that is still
            // the one there: the next push sends it without compressing.
            let _s = self.lock();
            let same = std::fs::File::open(dir.join("memory"))
                .and_then(|f| ino(&f))
                .ok();
            if same.is_some() && same == packed_ino {
                if let Err(e) = packed.keep(&packed_at) {
                    tracing::warn!(template = name, "keeping the packed memory: {e}");
                }
            }
        }
        let state_file = tempfile::NamedTempFile::new_in(store.dir().join("snapshots"))
            .and_then(|f| std::fs::write(f.path(), &state).map(|()| f))
            .map_err(|e| ("compress", DaemonError::infra("writing the state aside", e)))?;
        let image = match &record.image_id {
            Some(id) => {
                let images = self.images().ok_or_else(|| {
                    (
                        "push",
                        DaemonError::Invalid("this daemon has no image store".into()),
                    )
                })?;
                let image = images.image(id).map_err(|e| {
                    (
                        "push",
                        DaemonError::infra("reading the template's image", e),
                    )
                })?;
                Some((images, image))
            }
            None => None,
        };
        step("push", format!("sending to {}", req.reference));
        let config = serde_json::to_vec(&record).expect("a record serializes");
        let push = artifact::TemplatePush {
            config,
            state: state_file.path(),
            memory: &packed,
            image: image.as_ref().map(|(s, i)| (*s, i)),
        };
        let access = req.registry();
        artifact::push_template(&req.reference, &access, push, on_transfer(tx))
            .await
            .map_err(|e| ("push", e.into()))
    }

    /// Pulls a template artifact, registers it as `name` and starts its
    /// zygote from the snapshot.
    pub fn pull_template(
        &self,
        name: &str,
        req: RegistryRequest,
    ) -> Result<mpsc::Receiver<RegistryEvent>, DaemonError> {
        self.state_for("a pulled template's snapshot lives in the state directory")?;
        let probe = TemplateSpec {
            name: name.to_owned(),
            ..TemplateSpec::builtin(forkbox_host::image::ImageName::Minimal)
        };
        probe.validate().map_err(DaemonError::BadTemplate)?;
        if self.template(name).is_ok() {
            return Err(DaemonError::TemplateExists(name.to_owned()));
        }
        let (tx, rx) = mpsc::channel(64);
        let (this, name, events) = (self.clone(), name.to_owned(), tx.clone());
        to_the_end(
            tx,
            async move { this.pull(&name, &req, &events).await },
            |(template, digest, downloaded), total_ms| RegistryEvent::Pulled {
                template: Box::new(template),
                digest,
                downloaded_bytes: downloaded,
                total_ms,
            },
        );
        Ok(rx)
    }

    async fn pull(
        &self,
        name: &str,
        req: &RegistryRequest,
        tx: &mpsc::Sender<RegistryEvent>,
    ) -> Result<(TemplateInfo, String, u64), (&'static str, DaemonError)> {
        let store = self.inner.store.clone().expect("checked");
        let _ = tx.try_send(RegistryEvent::Step {
            step: "pull".into(),
            detail: format!("downloading {}", req.reference),
        });
        let access = req.registry();
        let work = store.dir().join("snapshots");
        let pulled = artifact::pull_template(
            self.images(),
            &req.reference,
            &access,
            &work,
            on_transfer(tx),
        )
        .await
        .map_err(|e| ("pull", e.into()))?;
        let bad = |why: String| {
            (
                "pull",
                DaemonError::Invalid(format!("{}: {why}", req.reference)),
            )
        };
        let record: PushedTemplate = serde_json::from_slice(&pulled.config)
            .map_err(|e| bad(format!("its record does not parse ({e})")))?;
        if (record.format, record.forkbox.as_str()) != (FORMAT, FORKBOX) {
            return Err(bad(format!(
                "it was pushed by forkbox {} (format {}), and this daemon is forkbox {FORKBOX} \
                 (format {FORMAT}): its snapshot holds the guest agent of its forkbox; bake \
                 the template here instead",
                record.forkbox, record.format
            )));
        }
        let mut spec = record.spec;
        spec.name = name.to_owned();
        spec.validate()
            .map_err(|e| ("pull", DaemonError::BadTemplate(e)))?;
        if !spec.disks.is_empty() {
            return Err(bad(NO_DISKS_YET.into()));
        }
        let name = spec.name.clone();
        match (&record.image_id, &pulled.image) {
            (Some(id), Some(image)) if *id == image.id => {}
            (None, None) => {}
            _ => return Err(bad("its record and the image it carries disagree".into())),
        }
        let image = spec
            .root_image(self.images(), record.image_id.as_ref())
            .map_err(|e| ("pull", DaemonError::BadTemplate(e)))?;
        if let Some(builtin) = spec.builtin_image() {
            let backend = self.inner.backend.clone();
            let ours = blocking(move || backend.disk_digest(builtin))
                .await
                .and_then(|r| r.map_err(DaemonError::from))
                .map_err(|e| ("pull", e))?;
            if record.builtin_disk.as_deref() != Some(ours.as_str()) {
                return Err(bad(format!(
                    "it was baked on a built-in image `{builtin}` whose disk is {}, and this \
                     host's is {ours} (built from other packages): a snapshot restores only over \
                     the same bytes. Bake the template here, or base it on a stored image, which \
                     travels with it",
                    record.builtin_disk.as_deref().unwrap_or("unknown")
                )));
            }
        }
        let expect = Expected {
            image: image.root.clone(),
            vcpus: spec.vcpus,
            memory_mib: spec.memory_mib,
            volumes: Vec::new(),
        };
        // Registered now, as baking: the name is taken, creations wait.
        let (done, rx) = watch::channel(None);
        self.register(
            Template {
                from_sandbox: record.from_sandbox,
                ..Template::new(spec, image, Zygote::Baking(rx))
            },
            false,
        )
        .map_err(|e| ("register", e))?;
        let _ = tx.try_send(RegistryEvent::Step {
            step: "unpack".into(),
            detail: "writing the snapshot (the memory sparse) into the state directory".into(),
        });
        let backend = self.inner.backend.clone();
        let (dir, tmp) = (store.snapshot_dir(&name), store.snapshot_tmp_dir(&name));
        let (state, memory) = (pulled.state, pulled.memory);
        let (to, at, exp) = (tmp.clone(), dir.clone(), expect.clone());
        let written = blocking(move || -> Result<u64, DaemonError> {
            let _ = std::fs::remove_dir_all(&to);
            let state = backend.rebase(&state, &exp)?;
            let io =
                |e| DaemonError::infra(format!("writing the snapshot into {}", to.display()), e);
            std::fs::create_dir(&to).map_err(io)?;
            std::fs::write(to.join("state.json"), &state).map_err(io)?;
            let limit = u64::from(exp.memory_mib) << 20;
            artifact::unpack_memory(memory.path(), &to.join("memory"), limit).map_err(|e| {
                DaemonError::Invalid(format!("the pulled memory does not unpack: {e}"))
            })?;
            memory.unpacked();
            let _ = std::fs::remove_dir_all(&at);
            std::fs::rename(&to, &at).map_err(io)?;
            Ok(std::fs::metadata(at.join("memory"))
                .map_or(0, |m| std::os::unix::fs::MetadataExt::blocks(&m) * 512)
                + state.len() as u64)
        })
        .await
        .and_then(|r| r);
        let started = match written {
            Ok(bytes) => {
                if let Some(t) = self.lock().templates.get_mut(&name) {
                    t.saved_bytes = Some(bytes);
                }
                let _ = tx.try_send(RegistryEvent::Step {
                    step: "start".into(),
                    detail: "starting the zygote from the snapshot".into(),
                });
                let backend = self.inner.backend.clone();
                let network = record.network.map(|policy| NetworkSpec {
                    policy,
                    egress_log: None,
                });
                let from = dir.clone();
                blocking(move || -> Result<_, DaemonError> {
                    let m = backend.restore(&from, network.as_ref(), &expect)?;
                    m.make_zygote()?;
                    Ok(m)
                })
                .await
                .and_then(|r| r)
                .map_err(|e| ("start", e))
            }
            Err(e) => Err(("unpack", e)),
        };
        let mut s = self.lock();
        let result = match (started, s.templates.get_mut(&name)) {
            (Ok(m), Some(t)) => {
                t.zygote = Zygote::Ready {
                    machine: Arc::from(m),
                    bake_ms: record.bake_ms,
                    baseline: record.baseline.map(Arc::new),
                };
                if let Some(r) = t.record() {
                    store.save_template(&r);
                }
                Ok((t.info(), pulled.digest.to_string(), pulled.downloaded))
            }
            (Ok(m), None) => {
                reap(Arc::from(m));
                Err(("register", DaemonError::NoTemplate(name.clone())))
            }
            (Err(e), _) => {
                s.templates.remove(&name);
                self.unpin_image(&name);
                store.forget_template(&name);
                Err(e)
            }
        };
        drop(s);
        let outcome = match &result {
            Ok(_) => Ok(()),
            Err((step, e)) => Err(BakeFailure::of((*step).into(), e)),
        };
        let _ = done.send(Some(outcome));
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::network::EgressLogs;
    use crate::persist::Store;
    use crate::service::testing::*;
    use forkbox_image::local_registry::LocalRegistry;

    fn daemon_in(dir: &std::path::Path, fake: Fake) -> Daemon {
        let egress =
            EgressLogs::open(&dir.join("egress"), Duration::from_secs(60)).expect("egress");
        let store = Some(Store::open(dir).expect("store"));
        Daemon::with_store(Arc::new(fake), Config::default(), store, egress)
    }

    async fn last(mut rx: mpsc::Receiver<RegistryEvent>) -> (RegistryEvent, Vec<RegistryEvent>) {
        let mut seen = Vec::new();
        while let Some(e) = rx.recv().await {
            seen.push(e);
        }
        (seen.pop().expect("a last event"), seen)
    }

    fn access(reference: String) -> (RegistryRequest, RegistryRequest) {
        (
            RegistryRequest {
                reference: reference.clone(),
                plain_http: true,
                username: None,
                password: None,
            },
            RegistryRequest {
                reference,
                plain_http: true,
                username: None,
                password: None,
            },
        )
    }

    /// A template pushed by one daemon is pulled by another (its own
    /// state directory) and forked there without a bake; a name taken,
    /// or a host whose built-in disk differs, is refused and leaves
    /// nothing behind.
    #[tokio::test]
    async fn a_pushed_template_is_pulled_by_another_daemon_and_forks_without_a_bake() {
        let registry = LocalRegistry::start().expect("a registry");
        let (here, there) = (
            tempfile::tempdir().expect("tmp"),
            tempfile::tempdir().expect("tmp"),
        );
        let a = daemon_in(here.path(), Fake::default());
        created(&a, None).await; // bakes `minimal`
        let (push, pull) = access(format!("{}/templates/minimal:v1", registry.addr));
        let (end, events) = last(a.push_template("minimal", push).expect("push")).await;
        let RegistryEvent::Pushed { present_bytes, .. } = end else {
            panic!("{end:?}");
        };
        assert_eq!(present_bytes, 0);
        assert!(
            events
                .iter()
                .any(|e| matches!(e, RegistryEvent::Step { step, .. } if step == "save")),
            "saved first: {events:?}"
        );
        assert!(a.template("minimal").expect("t").saved_bytes.is_some());
        let packed = here.path().join("snapshots/minimal/memory.zst");
        assert!(packed.is_file(), "the packed memory kept for the next push");
        // Pushed again (another tag): nothing compressed, nothing but the
        // record and manifest sent.
        let (again, _) = access(format!("{}/templates/minimal:v2", registry.addr));
        let (end, events) = last(a.push_template("minimal", again).expect("push")).await;
        let RegistryEvent::Pushed { present_bytes, .. } = end else {
            panic!("{end:?}");
        };
        assert!(present_bytes > 0);
        assert!(
            !events
                .iter()
                .any(|e| matches!(e, RegistryEvent::Step { step, .. } if step == "compress")),
            "compressed again: {events:?}"
        );

        let fake = Fake::default();
        let world = fake.world.clone();
        let b = daemon_in(there.path(), fake);
        let (end, _) = last(b.pull_template("copy", pull.clone()).expect("pull")).await;
        let RegistryEvent::Pulled { template, .. } = end else {
            panic!("{end:?}");
        };
        assert_eq!(
            (template.state, template.spec.name.as_str()),
            (TemplateState::Ready, "copy")
        );
        assert_eq!((world.boots.load(ORD), world.restores.load(ORD)), (0, 1));
        assert!(there.path().join("snapshots/copy/memory").is_file());
        assert!(
            there.path().join("templates/copy.json").is_file(),
            "saved here too"
        );
        let child = b
            .execute(create("copy", None))
            .await
            .expect("a sandbox of it");
        assert!(matches!(child, Reply::Sandbox(_)));
        assert_eq!(world.boots.load(ORD), 0, "forked, not booted");

        let e = b.pull_template("copy", pull.clone()).expect_err("taken");
        assert_eq!(e.kind(), "conflict", "{e}");

        // Another host's build of the built-in disk.
        *world.disks.lock().expect("disks") = 1;
        let (end, _) = last(b.pull_template("other", pull).expect("pull")).await;
        let RegistryEvent::Failed(f) = end else {
            panic!("{end:?}");
        };
        assert!(
            f.message.contains("restores only over the same bytes"),
            "{}",
            f.message
        );
        assert!(b.template("other").is_err(), "not registered");
        assert!(!there.path().join("snapshots/other").exists());
    }
}
