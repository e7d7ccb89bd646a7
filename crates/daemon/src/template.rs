//! Templates: an image, resources and a ready recipe (setup commands, then
//! a readiness condition with a timeout). The built-in `minimal` and
//! `debian` have no recipe.
//!
//! Baking runs the recipe once in a fresh VM and keeps that VM, paused, as
//! the template's zygote; every sandbox created from the template is a
//! copy-on-write fork of it, so the recipe never runs again. A template
//! can also be made from a sandbox (the API's `POST
//! /sandboxes/{id}/snapshot`): its zygote is a fork of that sandbox.

use std::collections::BTreeMap;
use std::time::Duration;

use forkbox_host::cgroup::{Limits, CPU_PERIOD_US, MEMORY_BEYOND_GUEST};
use forkbox_host::image::ImageName;
use forkbox_host::vm::RootImage;
use forkbox_net::policy::Policy;
use forkbox_vmm_api::{ShapeError, VmShape};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::backend::{BackendVmSpec, NetworkSpec};

/// When a booted template counts as ready.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Readiness {
    /// A shell command exits 0.
    Command(String),
    /// A path exists.
    File(String),
    /// A TCP port on the guest's loopback accepts a connection.
    TcpPort(u16),
    /// An HTTP URL (seen from the guest) answers 200.
    HttpUrl(String),
}

impl Readiness {
    /// One attempt at the check as a `/bin/sh` script: exit 0 when ready.
    /// TCP and HTTP checks use whatever the image has (bash's `/dev/tcp`,
    /// busybox `nc`/`wget`, curl or python3).
    pub fn script(&self) -> String {
        match self {
            Self::Command(c) => c.clone(),
            Self::File(p) => format!("test -e {}", quote(p)),
            Self::TcpPort(port) => format!(
                "if command -v bash >/dev/null; then bash -c 'exec 3<>/dev/tcp/127.0.0.1/{port}'; \
                 elif command -v nc >/dev/null; then nc -z 127.0.0.1 {port}; \
                 else python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", {port}), 1)'; fi"
            ),
            Self::HttpUrl(url) => {
                let q = quote(url);
                format!(
                    "if command -v curl >/dev/null; then curl -fsS -o /dev/null {q}; \
                     elif command -v wget >/dev/null; then wget -q -O /dev/null {q}; \
                     else python3 -c 'import sys, urllib.request; sys.exit(0 if urllib.request.urlopen(sys.argv[1], timeout=2).status == 200 else 1)' {q}; fi"
                )
            }
        }
    }
}

/// The host resources one sandbox may take: its VMM's cgroup (where the
/// host gives VMMs one; `forkbox_host::cgroup`). Each is at most what the
/// sandbox's shape gets without it, which is its default; a sandbox can be
/// held to less, never given more.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SandboxLimits {
    /// CPU time, in CPUs (`cpu.max`): 0.01 to its vCPUs + 1 (the default:
    /// one for its devices' thread). Below its vCPUs, its guest is slowed,
    /// never ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 0.01)]
    pub cpus: Option<f64>,
    /// Host memory of its own, in MiB (`memory.max`): what its guest
    /// writes (pages it shares with its template's zygote are the
    /// zygote's) plus its VMM's own, 32 to its guest RAM + 512 (the
    /// default). Past it the host's kernel ends the sandbox, and its death
    /// says so.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 32)]
    pub memory_mib: Option<u32>,
}

/// Least `SandboxLimits::memory_mib`: a VMM and its child's first writes.
pub const MIN_LIMIT_MEMORY_MIB: u32 = 32;
/// Least `SandboxLimits::cpus` (1 ms of every 100 ms).
pub const MIN_LIMIT_CPUS: f64 = 0.01;

impl SandboxLimits {
    pub fn is_empty(&self) -> bool {
        self.cpus.is_none() && self.memory_mib.is_none()
    }

    /// These, with `over`'s where it sets them.
    pub fn overridden_by(self, over: Option<SandboxLimits>) -> SandboxLimits {
        let over = over.unwrap_or_default();
        SandboxLimits {
            cpus: over.cpus.or(self.cpus),
            memory_mib: over.memory_mib.or(self.memory_mib),
        }
    }

    /// The cgroup limits of a sandbox of `vcpus` and `memory_mib` held to
    /// these; `Err` says which is out of its range.
    pub fn resolve(&self, vcpus: u8, memory_mib: u32) -> Result<Limits, String> {
        let shape = Limits::for_vm(vcpus, memory_mib);
        let max_cpus = (u64::from(vcpus) + 1) as f64;
        let max_memory = u32::try_from(shape.memory_max.unwrap_or(0) >> 20).unwrap_or(u32::MAX);
        let mut limits = shape;
        if let Some(cpus) = self.cpus {
            if !(MIN_LIMIT_CPUS..=max_cpus).contains(&cpus) {
                return Err(format!(
                    "limits.cpus {cpus}: expected {MIN_LIMIT_CPUS} to {max_cpus} \
                     (the sandbox's {vcpus} vCPUs + 1)"
                ));
            }
            limits.cpu_quota_us = (cpus * CPU_PERIOD_US as f64).round() as u64;
        }
        if let Some(mib) = self.memory_mib {
            if !(MIN_LIMIT_MEMORY_MIB..=max_memory).contains(&mib) {
                return Err(format!(
                    "limits.memory_mib {mib}: expected {MIN_LIMIT_MEMORY_MIB} to {max_memory} \
                     (the sandbox's {memory_mib} MiB of RAM + {})",
                    MEMORY_BEYOND_GUEST >> 20
                ));
            }
            limits = limits.with_memory_max(u64::from(mib) << 20);
        }
        Ok(limits)
    }

    /// The limits a cgroup has, as the API shows them.
    pub fn of(limits: Limits) -> SandboxLimits {
        SandboxLimits {
            cpus: Some(limits.cpu_quota_us as f64 / CPU_PERIOD_US as f64),
            memory_mib: limits
                .memory_max
                .map(|b| u32::try_from(b >> 20).unwrap_or(u32::MAX)),
        }
    }
}

/// A template as the API describes it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct TemplateSpec {
    pub name: String,
    /// A built-in image (`minimal`, `debian` or `docker`), or an image of the store
    /// (`forkbox image import`) by name or id.
    pub image: String,
    /// vCPUs, 1-8 (the VMM's limits, `forkbox_vmm_api::shape`).
    #[serde(default = "default_vcpus")]
    #[schema(minimum = 1, maximum = 8)]
    pub vcpus: u8,
    /// Guest memory in MiB, 128-16384.
    #[serde(default = "default_memory")]
    #[schema(minimum = 128, maximum = 16384)]
    pub memory_mib: u32,
    /// Shell commands run in order as root after boot; each must exit 0.
    #[serde(default)]
    pub setup: Vec<String>,
    #[serde(default)]
    pub ready: Option<Readiness>,
    /// Bound on waiting for `ready`, in seconds (at most 86400).
    #[serde(default = "default_ready_timeout")]
    #[schema(maximum = 86400)]
    pub ready_timeout_secs: u64,
    /// Environment for the setup commands and every later command.
    #[serde(default)]
    pub envs: BTreeMap<String, String>,
    /// What the setup commands may reach (a local package mirror, say);
    /// default: nothing. It holds only while the template bakes: the
    /// zygote is set to deny all egress, and each sandbox gets the policy
    /// of its own creation.
    #[serde(default)]
    #[schema(value_type = Option<crate::network::NetworkPolicy>)]
    pub network: Option<Policy>,
    /// Paths the policy may not change: the grader, the tests, the task.
    /// At the end of the bake they become root's and read-only to
    /// everyone else, and what is under them is recorded; a sandbox's
    /// integrity check compares with that record (at most 64 absolute
    /// paths, each of which must exist once setup has run).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub protect: Vec<String>,
    /// The host resources each of its sandboxes may take (a creation may
    /// set its own); default: what its shape gets. Its bake runs without
    /// them.
    #[serde(default, skip_serializing_if = "SandboxLimits::is_empty")]
    pub limits: SandboxLimits,
    /// Start the stored image's `Entrypoint` and `Cmd` (its service: a
    /// web app, a database) in the background after the setup commands
    /// and before the readiness check, as the image's `User` (root when
    /// it names none, as a container runtime would), in its `WorkingDir`,
    /// with its `Env` under `envs`; the zygote holds it running, so every
    /// sandbox of the template has it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub run_image_cmd: bool,
    /// Writable disks (at most 4), mounted before the setup commands run:
    /// what the setup writes there is in every sandbox of the template.
    /// Each sandbox's writes are its own, a fork's children start from
    /// its disk at the instant of its memory, and unchanged blocks are
    /// shared: only what a sandbox writes takes host disk, and it is
    /// gone with the sandbox.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disks: Vec<TemplateDisk>,
}

/// A writable disk of a template's sandboxes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TemplateDisk {
    /// Where the guest mounts it: an absolute path of letters, digits and
    /// `/ . _ - + @`, not under `/proc`, `/sys`, `/dev`, `/run` or `/tmp`
    /// (made if missing; root's, mode 0755: a setup command may `chown`
    /// it to the sandbox's user).
    pub path: String,
    /// Its size in MiB (16 to 1048576): an ext4 file system, empty unless
    /// `image` is given.
    #[schema(minimum = 16, maximum = 1048576)]
    pub size_mib: u32,
    /// A stored image (a name or an id, as `forkbox image ls` shows) whose
    /// files the disk starts with: its layers merged as a guest sees them,
    /// owners, modes and times kept, laid out once per image and size and
    /// shared by every sandbox (a sandbox's writes are its own). Without
    /// it the disk starts empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// The id `image` named when the template was made (set by the daemon):
    /// its sandboxes keep that image's files after the name moves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_id: Option<String>,
}

fn default_vcpus() -> u8 {
    1
}
fn default_memory() -> u32 {
    512
}
fn default_ready_timeout() -> u64 {
    60
}

/// Where a template's zygote is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum TemplateState {
    /// Registered, no zygote yet: the first creation (or `bake`) bakes it.
    NotBaked,
    Baking,
    /// Its zygote is up: creations fork it.
    Ready,
    /// The last bake failed (`error` says why); the next creation or
    /// `bake` tries again.
    Failed,
}

/// A template as the API shows it: its recipe and its zygote.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TemplateInfo {
    #[serde(flatten)]
    pub spec: TemplateSpec,
    pub state: TemplateState,
    // The API document shows this comment; it keeps the API's word.
    /// For a sandbox's snapshot: the sandbox whose state it holds.
    pub from_sandbox: Option<crate::core::SandboxId>,
    /// Why the last bake failed.
    pub error: Option<String>,
    /// How long the bake took (boot, recipe, zygote), in milliseconds.
    pub bake_ms: Option<u64>,
    /// The zygote's VMM process and its resident memory (shared,
    /// copy-on-write, with every sandbox forked from it).
    pub zygote_pid: Option<u32>,
    pub zygote_rss_kib: Option<u64>,
    /// The stored image it boots, by id, as found when the template was
    /// made: moving the image's name later changes nothing for it (none
    /// for a built-in image).
    pub image_id: Option<String>,
    /// Bytes of its zygote's snapshot in the daemon's state directory
    /// (`POST /templates/{name}/save`): a restarted daemon, even after a
    /// reboot, starts the zygote from it instead of baking.
    pub saved_bytes: Option<u64>,
}

/// Whom calls act as, unnamed, in a built-in image (and in a sandbox
/// whose image is unknown: one recorded before images had users).
pub fn builtin_user() -> forkbox_proto::User {
    forkbox_proto::User::Name(forkbox_host::image::USER.to_owned())
}

/// A template's image, found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedImage {
    pub root: RootImage,
    /// A stored image's id (`None`: a built-in image).
    pub id: Option<forkbox_image::Digest>,
    /// A stored image's `Env`, `WorkingDir`, `User`, ...; empty for a
    /// built-in image.
    pub run: forkbox_image::RunConfig,
}

impl ResolvedImage {
    pub fn builtin(name: ImageName) -> Self {
        Self {
            root: name.into(),
            id: None,
            run: Default::default(),
        }
    }

    /// The image's `Env` as a map (`NAME=value`; an entry without `=` is
    /// a name with an empty value).
    pub fn env(&self) -> BTreeMap<String, String> {
        self.run
            .env
            .iter()
            .map(|e| match e.split_once('=') {
                Some((k, v)) => (k.to_owned(), v.to_owned()),
                None => (e.clone(), String::new()),
            })
            .collect()
    }

    /// The directory commands start in when they do not say (an absolute
    /// `WorkingDir`; a relative one means nothing in a sandbox).
    pub fn working_dir(&self) -> Option<String> {
        self.run.working_dir.clone().filter(|w| w.starts_with('/'))
    }

    /// Whom commands and file calls act as when they name nobody: the
    /// image's `User` where it names one other than root (its group part
    /// is the guest's to look up); else the built-in images' unprivileged
    /// `user`, or uid 1000 in a stored image, which may have no such name.
    /// Root is never the default: it must be asked for.
    pub fn default_user(&self) -> forkbox_proto::User {
        use forkbox_proto::User;
        let named = self
            .image_user()
            .filter(|u| *u != User::Uid(0) && *u != User::Name("root".into()));
        match (named, &self.id) {
            (Some(u), _) => u,
            (None, None) => builtin_user(),
            (None, Some(_)) => User::Uid(1000),
        }
    }

    /// The image's `User` as the guest takes it: its user part (the group
    /// is the guest's to look up), a uid if numeric; `None` if it names
    /// nobody.
    pub fn image_user(&self) -> Option<forkbox_proto::User> {
        use forkbox_proto::User;
        let u = self.run.user.as_deref()?;
        let u = u.split(':').next().unwrap_or(u);
        (!u.is_empty()).then(|| {
            u.parse()
                .map_or_else(|_| User::Name(u.to_owned()), User::Uid)
        })
    }
}

/// Why a template is not acceptable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    #[error("no image {0:?}: the built-in images are `minimal`, `debian` and `docker`; any other must be in the image store (`forkbox image import`, `forkbox image pull`, `forkbox image ls`)")]
    UnknownImage(String),
    #[error(
        "image name {0:?}: a built-in image (`minimal`, `debian`, `docker`) or a stored image's name or id"
    )]
    BadImageName(String),
    #[error("the image store: {0}")]
    ImageStore(String),
    #[error("template name {0:?}: use 1-64 of [a-z0-9._-], starting with a letter or digit")]
    BadName(String),
    /// The VMM's own limits (`forkbox_vmm_api::shape`), so that a template
    /// that validates also bakes.
    #[error("template resources: {0}")]
    BadResources(ShapeError),
    #[error("ready_timeout_secs {0}: expected at most {MAX_READY_TIMEOUT_SECS} (a day)")]
    BadReadyTimeout(u64),
    #[error("protected path {0:?}: expected an absolute path other than /, without `..`, at most 4096 bytes")]
    BadProtectedPath(String),
    #[error("{0} protected paths: expected at most {MAX_PROTECTED}")]
    TooManyProtected(usize),
    #[error("{0}")]
    BadLimits(String),
    #[error("run_image_cmd: image {0:?} has no `Entrypoint` or `Cmd` to run")]
    NoImageCmd(String),
    #[error("disks: {0}")]
    BadDisk(String),
}

/// Most paths a template may protect.
pub const MAX_PROTECTED: usize = 64;

/// Longest `ready_timeout_secs`.
pub const MAX_READY_TIMEOUT_SECS: u64 = 86400;

impl TemplateSpec {
    /// The built-in template of a built-in image: the image as it is,
    /// but for `docker`, whose template starts `dockerd` on a writable disk
    /// before its zygote is made, so that a sandbox of it runs `docker run`
    /// at once.
    pub fn builtin(image: ImageName) -> Self {
        let plain = Self::plain(image);
        match image {
            ImageName::Docker => Self {
                memory_mib: 2048,
                setup: vec![forkbox_host::image::DOCKERD_START.into()],
                ready: Some(Readiness::Command("docker info >/dev/null 2>&1".into())),
                ready_timeout_secs: 300,
                disks: vec![TemplateDisk {
                    path: "/var/lib/docker".into(),
                    size_mib: 16384,
                    image: None,
                    image_id: None,
                }],
                ..plain
            },
            ImageName::Minimal | ImageName::Debian => plain,
        }
    }

    fn plain(image: ImageName) -> Self {
        Self {
            name: image.as_str().into(),
            image: image.as_str().into(),
            vcpus: default_vcpus(),
            memory_mib: default_memory(),
            setup: Vec::new(),
            ready: None,
            ready_timeout_secs: default_ready_timeout(),
            envs: BTreeMap::new(),
            network: None,
            protect: Vec::new(),
            limits: SandboxLimits::default(),
            run_image_cmd: false,
            disks: Vec::new(),
        }
    }

    /// Its built-in image, if it names one.
    pub fn builtin_image(&self) -> Option<ImageName> {
        self.image.parse().ok()
    }

    /// What its VMs boot: a built-in image, or a stored image's layers
    /// (with the image's id, for the store to keep it while the template
    /// lives). `found` is the id an earlier resolution found (a template
    /// written down, a sandbox's): that image, not what the name names
    /// now. Reads the store: done once per template, never per sandbox.
    pub fn root_image(
        &self,
        images: Option<&forkbox_image::Store>,
        found: Option<&forkbox_image::Digest>,
    ) -> Result<ResolvedImage, TemplateError> {
        if let Some(name) = self.builtin_image() {
            return Ok(ResolvedImage::builtin(name));
        }
        let store = images.ok_or_else(|| TemplateError::UnknownImage(self.image.clone()))?;
        let image = match found {
            Some(id) => store.image(id),
            None => store.resolve(&self.image),
        };
        let image = image.map_err(|e| match e {
            forkbox_image::StoreError::NoImage(_) => {
                TemplateError::UnknownImage(self.image.clone())
            }
            other => TemplateError::ImageStore(other.to_string()),
        })?;
        let layers = image
            .layers
            .iter()
            .map(|l| store.layer_path(&l.diff_id))
            .collect();
        Ok(ResolvedImage {
            root: RootImage::Layers(layers),
            id: Some(image.id),
            run: image.config,
        })
    }

    pub fn validate(&self) -> Result<(), TemplateError> {
        let n = &self.name;
        let ok = (1..=64).contains(&n.len())
            && n.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
            && n.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric());
        if !ok {
            return Err(TemplateError::BadName(n.clone()));
        }
        if !forkbox_image::store::is_name(&self.image) {
            return Err(TemplateError::BadImageName(self.image.clone()));
        }
        VmShape {
            vcpus: self.vcpus,
            memory_mib: self.memory_mib.into(),
        }
        .validate()
        .map_err(TemplateError::BadResources)?;
        if self.ready_timeout_secs > MAX_READY_TIMEOUT_SECS {
            return Err(TemplateError::BadReadyTimeout(self.ready_timeout_secs));
        }
        self.limits
            .resolve(self.vcpus, self.memory_mib)
            .map_err(TemplateError::BadLimits)?;
        if self.protect.len() > MAX_PROTECTED {
            return Err(TemplateError::TooManyProtected(self.protect.len()));
        }
        for p in &self.protect {
            let path = std::path::Path::new(p);
            let ok = path.is_absolute()
                && path.parent().is_some()
                && p.len() <= 4096
                && !p.contains('\0')
                && path
                    .components()
                    .all(|c| !matches!(c, std::path::Component::ParentDir));
            if !ok {
                return Err(TemplateError::BadProtectedPath(p.clone()));
            }
        }
        self.validate_disks()
    }

    fn validate_disks(&self) -> Result<(), TemplateError> {
        use forkbox_host::volume::{MAX_MIB, MIN_MIB};
        let max = usize::from(forkbox_host::vm::MAX_WRITABLE_DISKS);
        if self.disks.len() > max {
            return Err(TemplateError::BadDisk(format!(
                "{} disks: at most {max}",
                self.disks.len()
            )));
        }
        for (i, d) in self.disks.iter().enumerate() {
            forkbox_host::vm::check_mount_path(&d.path).map_err(TemplateError::BadDisk)?;
            if !(MIN_MIB..=MAX_MIB).contains(&d.size_mib) {
                return Err(TemplateError::BadDisk(format!(
                    "{}: size_mib {}: expected {MIN_MIB} to {MAX_MIB}",
                    d.path, d.size_mib
                )));
            }
            if let Some(image) = &d.image {
                if image.is_empty() || image.len() > 512 || image.chars().any(char::is_control) {
                    return Err(TemplateError::BadDisk(format!(
                        "{}: image {image:?}: expected an image's name or id",
                        d.path
                    )));
                }
            }
            let nested = |a: &str, b: &str| a == b || b.starts_with(&format!("{a}/"));
            if let Some(other) = self.disks[..i]
                .iter()
                .find(|o| nested(&o.path, &d.path) || nested(&d.path, &o.path))
            {
                return Err(TemplateError::BadDisk(format!(
                    "{} and {}: one disk's path may not be the other's or inside it",
                    other.path, d.path
                )));
            }
        }
        Ok(())
    }

    /// Its disks' images found in `images` (by name or id), each disk's
    /// `image_id` set to what its `image` names now; a disk that has an
    /// `image_id` keeps it.
    pub fn resolve_disk_images(
        mut self,
        images: Option<&forkbox_image::Store>,
    ) -> Result<Self, TemplateError> {
        for d in &mut self.disks {
            let Some(name) = d.image.as_deref().filter(|_| d.image_id.is_none()) else {
                continue;
            };
            let store = images.ok_or_else(|| TemplateError::UnknownImage(name.to_owned()))?;
            let image = store.resolve(name).map_err(|e| match e {
                forkbox_image::StoreError::NoImage(_) => {
                    TemplateError::UnknownImage(name.to_owned())
                }
                other => TemplateError::ImageStore(other.to_string()),
            })?;
            d.image_id = Some(image.id.to_string());
        }
        Ok(self)
    }

    /// What its bake boots, `image` being its image found
    /// ([`Self::root_image`]).
    pub fn boot_spec(&self, boot_timeout: Duration, image: &ResolvedImage) -> BackendVmSpec {
        BackendVmSpec {
            image: image.root.clone(),
            vcpus: self.vcpus,
            memory_mib: self.memory_mib,
            boot_timeout,
            network: NetworkSpec {
                policy: self.network.clone().unwrap_or_else(Policy::deny_all),
                // In the VM's own directory: the bake's log is nobody's.
                egress_log: None,
            },
            disks: self.disks.clone(),
        }
    }

    /// Whether creating from it replays a recipe after boot.
    pub fn has_recipe(&self) -> bool {
        !self.setup.is_empty() || self.ready.is_some() || self.run_image_cmd
    }

    /// The image's service, when the template asks for it: its
    /// `Entrypoint` then `Cmd`, and whom it runs as.
    pub fn image_cmd(
        &self,
        image: &ResolvedImage,
    ) -> Result<Option<(Vec<String>, forkbox_proto::User)>, TemplateError> {
        if !self.run_image_cmd {
            return Ok(None);
        }
        let argv = [image.run.entrypoint.clone(), image.run.cmd.clone()].concat();
        if argv.is_empty() {
            return Err(TemplateError::NoImageCmd(self.image.clone()));
        }
        // As a container runtime runs it: as the image's `User` (its user
        // part), root when it names none; many images' services start as
        // root and drop privileges themselves. Commands of the policy keep
        // their unprivileged default ([`ResolvedImage::default_user`]).
        let user = image.image_user().unwrap_or(forkbox_proto::User::Uid(0));
        Ok(Some((argv, user)))
    }
}

/// Single-quotes `s` for a POSIX shell.
pub fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str) -> i32 {
        std::process::Command::new("sh")
            .arg("-c")
            .arg(script)
            .status()
            .expect("sh")
            .code()
            .unwrap_or(-1)
    }

    #[test]
    fn template_disks_are_checked_paths_sizes_counts_and_nesting() {
        let with = |disks: &[(&str, u32)]| TemplateSpec {
            disks: disks
                .iter()
                .map(|&(path, size_mib)| TemplateDisk {
                    path: path.into(),
                    size_mib,
                    image: None,
                    image_id: None,
                })
                .collect(),
            ..TemplateSpec::builtin(ImageName::Minimal)
        };
        with(&[("/var/lib/docker", 4096), ("/workspace", 16)])
            .validate()
            .expect("two plain disks");
        for bad in [
            &[("relative", 64)][..],
            &[("/", 64)],
            &[("/data/../etc", 64)],
            &[("/proc/x", 64)],
            &[("/tmp", 64)],
            &[("/a b", 64)],
            &[("/a,b", 64)],
            &[("/data", 8)],
            &[("/data", (1 << 20) + 1)],
            &[("/data", 64), ("/data/sub", 64)],
            &[("/data", 64), ("/data", 64)],
            &[("/a", 64), ("/b", 64), ("/c", 64), ("/d", 64), ("/e", 64)],
        ] {
            let e = with(bad).validate().expect_err("refused");
            assert!(matches!(e, TemplateError::BadDisk(_)), "{bad:?}: {e}");
        }
    }

    #[test]
    fn sandbox_limits_hold_a_sandbox_to_less_than_its_shape_never_more() {
        let none = SandboxLimits::default();
        assert_eq!(none.resolve(2, 512), Ok(Limits::for_vm(2, 512)));
        let held = SandboxLimits {
            cpus: Some(0.25),
            memory_mib: Some(96),
        };
        let l = held.resolve(2, 512).expect("in range");
        assert_eq!(l.cpu_quota_us, 25_000);
        assert_eq!(l.memory_max, Some(96 << 20));
        assert_eq!(l.pids_max, Limits::for_vm(2, 512).pids_max);
        assert_eq!(SandboxLimits::of(l), held);
        // The ceilings: vCPUs + 1 CPUs, RAM + 512 MiB; the floors.
        for (cpus, mib, ok) in [
            (Some(3.0), None, true),
            (Some(3.01), None, false),
            (Some(0.01), None, true),
            (Some(0.0), None, false),
            (Some(-1.0), None, false),
            (Some(f64::NAN), None, false),
            (None, Some(1024), true),
            (None, Some(1025), false),
            (None, Some(32), true),
            (None, Some(31), false),
        ] {
            let l = SandboxLimits {
                cpus,
                memory_mib: mib,
            };
            assert_eq!(l.resolve(2, 512).is_ok(), ok, "{l:?}");
        }
        let err = SandboxLimits {
            cpus: Some(9.0),
            memory_mib: None,
        }
        .resolve(2, 512)
        .expect_err("too many");
        assert!(
            err.contains("limits.cpus 9") && err.contains("0.01 to 3"),
            "{err}"
        );
        // A creation's own override the template's, field by field.
        let template = SandboxLimits {
            cpus: Some(1.0),
            memory_mib: Some(256),
        };
        let over = SandboxLimits {
            cpus: None,
            memory_mib: Some(64),
        };
        assert_eq!(
            template.overridden_by(Some(over)),
            SandboxLimits {
                cpus: Some(1.0),
                memory_mib: Some(64)
            }
        );
        assert_eq!(template.overridden_by(None), template);
        // A template out of range does not validate.
        let mut t = TemplateSpec::builtin(ImageName::Minimal);
        t.limits.memory_mib = Some(4096);
        assert!(matches!(t.validate(), Err(TemplateError::BadLimits(_))));
        // Unknown fields are refused.
        assert!(serde_json::from_str::<SandboxLimits>(r#"{"cpu":1}"#).is_err());
    }

    #[test]
    fn readiness_file_script_checks_existence() {
        assert_eq!(sh(&Readiness::File("/".into()).script()), 0);
        assert_ne!(sh(&Readiness::File("/no/such/it's".into()).script()), 0);
    }

    #[test]
    fn readiness_tcp_script_fails_on_closed_port() {
        // Port 1 on loopback: nothing listens there.
        assert_ne!(sh(&Readiness::TcpPort(1).script()), 0);
    }

    #[test]
    fn readiness_tcp_script_succeeds_on_listening_port() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = l.local_addr().expect("addr").port();
        assert_eq!(sh(&Readiness::TcpPort(port).script()), 0);
    }

    #[test]
    fn a_disks_image_is_found_once_and_kept_by_id() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = forkbox_image::Store::open(dir.path()).expect("store");
        let image = |config: &[u8]| forkbox_image::Image {
            id: forkbox_image::Digest::of(config),
            layers: Vec::new(),
            config: forkbox_image::RunConfig::default(),
            manifest: None,
            created: None,
        };
        let (first, second) = (image(b"first"), image(b"second"));
        store.put_image(&first).expect("first");
        store.put_image(&second).expect("second");
        store.tag("data/repo:1", &first.id).expect("tag");
        let mut t = TemplateSpec::builtin(ImageName::Minimal);
        t.disks = vec![
            TemplateDisk {
                path: "/workspace".into(),
                size_mib: 64,
                image: Some("data/repo:1".into()),
                image_id: None,
            },
            TemplateDisk {
                path: "/scratch".into(),
                size_mib: 64,
                image: None,
                image_id: None,
            },
        ];
        t.validate().expect("valid");
        let found = t.clone().resolve_disk_images(Some(&store)).expect("found");
        assert_eq!(found.disks[0].image_id, Some(first.id.to_string()));
        assert_eq!(found.disks[1].image_id, None, "an empty disk names none");
        // Found once: the name moving later changes nothing.
        store.tag("data/repo:1", &second.id).expect("moved");
        let again = found
            .clone()
            .resolve_disk_images(Some(&store))
            .expect("kept");
        assert_eq!(again.disks[0].image_id, Some(first.id.to_string()));
        let mut missing = t.clone();
        missing.disks[0].image = Some("data/none:1".into());
        assert!(matches!(
            missing.clone().resolve_disk_images(Some(&store)),
            Err(TemplateError::UnknownImage(n)) if n == "data/none:1"
        ));
        assert!(matches!(
            t.clone().resolve_disk_images(None),
            Err(TemplateError::UnknownImage(_))
        ));
        missing.disks[0].image = Some(String::new());
        assert!(matches!(missing.validate(), Err(TemplateError::BadDisk(_))));
    }

    #[test]
    fn template_stored_image_boots_its_layers_bottom_first() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = forkbox_image::Store::open(dir.path()).expect("store");
        let layer = |b: &[u8]| forkbox_image::LayerRef {
            blob: forkbox_image::Digest::of(b),
            diff_id: forkbox_image::Digest::of(b),
            media_type: "application/vnd.oci.image.layer.v1.tar".into(),
            size: 1,
        };
        let image = forkbox_image::Image {
            id: forkbox_image::Digest::of(b"config"),
            layers: vec![layer(b"base"), layer(b"top")],
            config: forkbox_image::RunConfig {
                env: vec!["PATH=/usr/bin:/bin".into(), "EMPTY".into(), "A=b=c".into()],
                working_dir: Some("/work".into()),
                ..Default::default()
            },
            manifest: None,
            created: None,
        };
        store.put_image(&image).expect("image");
        store.tag("task/base:1", &image.id).expect("tag");
        let mut t = TemplateSpec::builtin(ImageName::Minimal);
        t.image = "task/base:1".into();
        let resolved = t.root_image(Some(&store), None).expect("resolved");
        let paths = image
            .layers
            .iter()
            .map(|l| store.layer_path(&l.diff_id))
            .collect();
        assert_eq!(
            (resolved.root.clone(), resolved.id.clone()),
            (RootImage::Layers(paths), Some(image.id.clone()))
        );
        assert_eq!(
            resolved.env(),
            BTreeMap::from([
                ("PATH".to_owned(), "/usr/bin:/bin".to_owned()),
                ("EMPTY".to_owned(), String::new()),
                ("A".to_owned(), "b=c".to_owned()),
            ])
        );
        assert_eq!(resolved.working_dir().as_deref(), Some("/work"));
        // Found once, the image stays what the template boots: the name
        // moved to another image (or gone) changes nothing.
        let other = forkbox_image::Image {
            id: forkbox_image::Digest::of(b"other config"),
            layers: vec![layer(b"other")],
            ..image.clone()
        };
        store.put_image(&other).expect("other image");
        store.tag("task/base:1", &other.id).expect("moved tag");
        let again = t.root_image(Some(&store), Some(&image.id)).expect("by id");
        assert_eq!(again, resolved);
        let now = t.root_image(Some(&store), None).expect("by name");
        assert_eq!(now.id, Some(other.id.clone()));
        t.image = "task/base:2".into();
        assert!(matches!(
            t.root_image(Some(&store), None),
            Err(TemplateError::UnknownImage(_))
        ));
        t.image = "minimal".into();
        let builtin = t.root_image(Some(&store), None).expect("builtin");
        assert_eq!(
            (builtin.root.clone(), builtin.id.clone()),
            (ImageName::Minimal.into(), None)
        );
        assert!(builtin.env().is_empty() && builtin.working_dir().is_none());
    }

    #[test]
    fn image_cmd_is_entrypoint_then_cmd_as_the_image_s_user_or_root() {
        use forkbox_proto::User;
        let image = |user: Option<&str>| ResolvedImage {
            root: RootImage::Layers(Vec::new()),
            id: Some(forkbox_image::Digest::of(b"x")),
            run: forkbox_image::RunConfig {
                user: user.map(str::to_owned),
                entrypoint: vec!["/entry".into()],
                cmd: vec!["--serve".into()],
                ..Default::default()
            },
        };
        let mut t = TemplateSpec::builtin(ImageName::Minimal);
        assert_eq!(t.image_cmd(&image(None)), Ok(None), "not asked for");
        t.run_image_cmd = true;
        let argv = vec!["/entry".to_owned(), "--serve".to_owned()];
        for (user, want) in [
            (None, User::Uid(0)),
            (Some("postgres"), User::Name("postgres".into())),
            (Some("999:999"), User::Uid(999)),
            (Some("app:staff"), User::Name("app".into())),
        ] {
            assert_eq!(
                t.image_cmd(&image(user)),
                Ok(Some((argv.clone(), want))),
                "{user:?}"
            );
        }
        assert_eq!(
            t.image_cmd(&ResolvedImage::builtin(ImageName::Minimal)),
            Err(TemplateError::NoImageCmd("minimal".into()))
        );
    }

    #[test]
    fn resolved_image_default_user_is_the_image_s_unless_root_never_root() {
        use forkbox_proto::User;
        let stored = |user: Option<&str>| ResolvedImage {
            root: RootImage::Layers(Vec::new()),
            id: Some(forkbox_image::Digest::of(b"x")),
            run: forkbox_image::RunConfig {
                user: user.map(str::to_owned),
                ..Default::default()
            },
        };
        assert_eq!(stored(Some("app")).default_user(), User::Name("app".into()));
        assert_eq!(stored(Some("1001:1001")).default_user(), User::Uid(1001));
        assert_eq!(
            stored(Some("app:staff")).default_user(),
            User::Name("app".into())
        );
        for root in [Some("root"), Some("0"), Some("0:0"), Some(""), None] {
            assert_eq!(stored(root).default_user(), User::Uid(1000), "{root:?}");
        }
        let builtin = ResolvedImage {
            root: ImageName::Minimal.into(),
            id: None,
            run: Default::default(),
        };
        assert_eq!(builtin.default_user(), User::Name("user".into()));
    }

    #[test]
    fn template_validate_rejects_bad_names_and_images() {
        let mut t = TemplateSpec::builtin(ImageName::Minimal);
        t.validate().expect("builtin is valid");
        t.name = "../x".into();
        assert!(matches!(t.validate(), Err(TemplateError::BadName(_))));
        t.name = "ok".into();
        t.image = "../ubuntu".into();
        assert!(matches!(t.validate(), Err(TemplateError::BadImageName(_))));
        // A stored image's name: valid, known only to a store that has it.
        t.image = "ubuntu:24.04".into();
        t.validate().expect("a name the store may have");
        assert!(matches!(
            t.root_image(None, None),
            Err(TemplateError::UnknownImage(_))
        ));
        t.image = "debian".into();
        t.memory_mib = 1;
        assert_eq!(
            t.validate(),
            Err(TemplateError::BadResources(ShapeError::MemoryMib(1)))
        );
        let t = TemplateSpec {
            ready_timeout_secs: u64::MAX,
            ..TemplateSpec::builtin(ImageName::Minimal)
        };
        assert_eq!(t.validate(), Err(TemplateError::BadReadyTimeout(u64::MAX)));
    }

    #[test]
    fn template_validate_resources_are_the_vmm_s_limits() {
        let mut t = TemplateSpec::builtin(ImageName::Minimal);
        for (vcpus, memory_mib, ok) in [
            (1, 128, true),
            (8, 16384, true),
            (0, 512, false),
            (9, 512, false),
            (32, 512, false),
            (1, 127, false),
            (1, 16385, false),
            (1, 65536, false),
        ] {
            (t.vcpus, t.memory_mib) = (vcpus, memory_mib);
            assert_eq!(t.validate().is_ok(), ok, "{vcpus} vCPUs, {memory_mib} MiB");
        }
        t.vcpus = 32;
        assert_eq!(
            t.validate().map_err(|e| e.to_string()),
            Err("template resources: vcpus must be 1-8, not 32".into())
        );
    }

    #[test]
    fn template_json_defaults_fill_resources() {
        let t: TemplateSpec = serde_json::from_str(
            r#"{"name":"py","image":"debian","setup":["true"],"ready":{"file":"/tmp"}}"#,
        )
        .expect("parse");
        assert_eq!((t.vcpus, t.memory_mib, t.ready_timeout_secs), (1, 512, 60));
        assert!(t.has_recipe());
        assert_eq!(t.ready, Some(Readiness::File("/tmp".into())));
        assert_eq!(t.network, None);
    }

    #[test]
    fn template_network_is_the_bake_policy_default_deny() {
        let mut t = TemplateSpec::builtin(ImageName::Minimal);
        let boot = Duration::from_secs(1);
        let image = t.root_image(None, None).expect("built-in");
        assert_eq!(t.boot_spec(boot, &image).network.policy, Policy::deny_all());
        t = serde_json::from_str(
            r#"{"name":"py","image":"minimal","network":{"allow_out":["mirror.local:80"]}}"#,
        )
        .expect("parse");
        let policy = t.boot_spec(boot, &image).network.policy;
        assert_eq!(policy.allow_rules().len(), 1);
        let bad = serde_json::from_str::<TemplateSpec>(
            r#"{"name":"py","image":"minimal","network":{"allow_out":["x:99999"]}}"#,
        )
        .expect_err("bad rule");
        assert!(bad.to_string().contains("allow_out[0]"), "{bad}");
    }
}
