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

use forkbox_host::image::ImageName;
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

/// A template as the API describes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct TemplateSpec {
    pub name: String,
    /// `minimal` or `debian`.
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
}

/// Why a template is not acceptable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    #[error("unknown image {0:?}: expected `minimal` or `debian`")]
    UnknownImage(String),
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
}

/// Most paths a template may protect.
pub const MAX_PROTECTED: usize = 64;

/// Longest `ready_timeout_secs`.
pub const MAX_READY_TIMEOUT_SECS: u64 = 86400;

impl TemplateSpec {
    pub fn builtin(image: ImageName) -> Self {
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
        }
    }

    pub fn image_name(&self) -> Result<ImageName, TemplateError> {
        match self.image.as_str() {
            "minimal" => Ok(ImageName::Minimal),
            "debian" => Ok(ImageName::Debian),
            other => Err(TemplateError::UnknownImage(other.into())),
        }
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
        self.image_name()?;
        VmShape {
            vcpus: self.vcpus,
            memory_mib: self.memory_mib.into(),
        }
        .validate()
        .map_err(TemplateError::BadResources)?;
        if self.ready_timeout_secs > MAX_READY_TIMEOUT_SECS {
            return Err(TemplateError::BadReadyTimeout(self.ready_timeout_secs));
        }
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
        Ok(())
    }

    pub fn boot_spec(&self, boot_timeout: Duration) -> Result<BackendVmSpec, TemplateError> {
        Ok(BackendVmSpec {
            image: self.image_name()?,
            vcpus: self.vcpus,
            memory_mib: self.memory_mib,
            boot_timeout,
            network: NetworkSpec {
                policy: self.network.clone().unwrap_or_else(Policy::deny_all),
                // In the VM's own directory: the bake's log is nobody's.
                egress_log: None,
            },
        })
    }

    /// Whether creating from it replays a recipe after boot.
    pub fn has_recipe(&self) -> bool {
        !self.setup.is_empty() || self.ready.is_some()
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
    fn template_validate_rejects_bad_names_and_images() {
        let mut t = TemplateSpec::builtin(ImageName::Minimal);
        t.validate().expect("builtin is valid");
        t.name = "../x".into();
        assert!(matches!(t.validate(), Err(TemplateError::BadName(_))));
        t.name = "ok".into();
        t.image = "ubuntu".into();
        assert!(matches!(t.validate(), Err(TemplateError::UnknownImage(_))));
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
        assert_eq!(
            t.boot_spec(boot).expect("boot spec").network.policy,
            Policy::deny_all()
        );
        t = serde_json::from_str(
            r#"{"name":"py","image":"minimal","network":{"allow_out":["mirror.local:80"]}}"#,
        )
        .expect("parse");
        let policy = t.boot_spec(boot).expect("boot spec").network.policy;
        assert_eq!(policy.allow_rules().len(), 1);
        let bad = serde_json::from_str::<TemplateSpec>(
            r#"{"name":"py","image":"minimal","network":{"allow_out":["x:99999"]}}"#,
        )
        .expect_err("bad rule");
        assert!(bad.to_string().contains("allow_out[0]"), "{bad}");
    }
}
