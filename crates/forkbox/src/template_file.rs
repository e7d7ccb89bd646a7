//! Template files: the TOML that `forkbox template bake NAME --file F`
//! reads, and the JSON body of `POST /templates` it becomes.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Context;
use forkbox_net::policy::PolicySpec;
use serde::{Deserialize, Serialize};

/// A template file: what `forkbox template bake NAME --file F` reads.
///
/// ```toml
/// image = "debian"          # or "minimal", or a stored image (`forkbox image ls`)
/// vcpus = 2
/// memory_mib = 1024
/// setup = ["apt-get install -y python3", "mkdir /work"]
/// ready = { tcp_port = 8000 }   # or command = "…", file = "/path", http_url = "…"
/// ready_timeout_secs = 60
/// protect = ["/task/tests", "/task/grade.sh"]   # the policy may not change these
/// run_image_cmd = true      # a stored image's Entrypoint/Cmd, started before `ready`
/// [limits]                  # each sandbox's host resources; default: its shape's
/// cpus = 1.5                # CPU time, up to vcpus + 1
/// memory_mib = 768          # host memory of its own, up to memory_mib + 512
/// [envs]
/// PYTHONUNBUFFERED = "1"
/// [network]                 # egress while it bakes only; default: none
/// allow_out = ["deb.debian.org:80", "*.pythonhosted.org:443"]
/// deny_out = []
/// [[disks]]                 # writable disks (at most 4), mounted before setup
/// path = "/var/lib/docker"
/// size_mib = 8192           # an empty ext4; only written blocks take host disk
/// [[disks]]
/// path = "/workspace"
/// size_mib = 1024
/// image = "task/repo:1"     # starts with a stored image's files
/// ```
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TemplateFile {
    /// Must match NAME when given.
    #[serde(default)]
    pub name: Option<String>,
    pub image: String,
    #[serde(default)]
    pub vcpus: Option<u8>,
    #[serde(default)]
    pub memory_mib: Option<u32>,
    #[serde(default)]
    pub setup: Vec<String>,
    #[serde(default)]
    pub ready: Option<Readiness>,
    #[serde(default)]
    pub ready_timeout_secs: Option<u64>,
    #[serde(default, alias = "env")]
    pub envs: BTreeMap<String, String>,
    /// The egress policy while it bakes (sandboxes do not inherit it).
    #[serde(default)]
    pub network: Option<PolicySpec>,
    /// Paths the policy may not change (made root's, read-only to others,
    /// and recorded at the end of the bake).
    #[serde(default)]
    pub protect: Vec<String>,
    /// Each sandbox's host resources (a creation may set its own).
    #[serde(default)]
    pub limits: Option<SandboxLimits>,
    /// Start the stored image's `Entrypoint`/`Cmd` in the background
    /// after setup, before the readiness check.
    #[serde(default)]
    pub run_image_cmd: bool,
    /// Writable disks, mounted before the setup commands run.
    #[serde(default)]
    pub disks: Vec<TemplateDisk>,
}

/// A writable disk (forkboxd's `TemplateDisk`): an ext4 file system of
/// `size_mib` MiB mounted at `path`, empty or holding a stored image's files.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TemplateDisk {
    pub path: String,
    pub size_mib: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
}

/// The host resources one sandbox may take (forkboxd's `SandboxLimits`):
/// at most what its shape gets, the default.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SandboxLimits {
    /// CPU time, in CPUs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpus: Option<f64>,
    /// Host memory of its own, in MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u32>,
}

/// When a baked template counts as ready (forkboxd's `Readiness`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Readiness {
    Command(String),
    File(String),
    TcpPort(u16),
    HttpUrl(String),
}

/// The body of `POST /templates` (forkboxd's `TemplateSpec`); absent
/// resources take the daemon's defaults.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TemplateSpec {
    pub name: String,
    pub image: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vcpus: Option<u8>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u32>,
    pub setup: Vec<String>,
    pub ready: Option<Readiness>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ready_timeout_secs: Option<u64>,
    pub envs: BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network: Option<PolicySpec>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub protect: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limits: Option<SandboxLimits>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub run_image_cmd: bool,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub disks: Vec<TemplateDisk>,
}

impl TemplateFile {
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        Self::parse(&text).with_context(|| format!("parsing {}", path.display()))
    }

    pub fn parse(text: &str) -> Result<Self, toml::de::Error> {
        toml::from_str(text)
    }

    pub fn into_spec(self, name: &str) -> anyhow::Result<TemplateSpec> {
        if let Some(n) = &self.name {
            anyhow::ensure!(
                n == name,
                "the file names the template {n:?} but the command line says {name:?}"
            );
        }
        Ok(TemplateSpec {
            name: name.into(),
            image: self.image,
            vcpus: self.vcpus,
            memory_mib: self.memory_mib,
            setup: self.setup,
            ready: self.ready,
            ready_timeout_secs: self.ready_timeout_secs,
            envs: self.envs,
            network: self.network,
            protect: self.protect,
            limits: self.limits,
            run_image_cmd: self.run_image_cmd,
            disks: self.disks,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn template_file_full_becomes_the_daemons_json() {
        let f = TemplateFile::parse(
            r#"
image = "debian"
vcpus = 2
memory_mib = 1024
setup = ["apt-get install -y python3", "mkdir /work"]
ready = { tcp_port = 8000 }
ready_timeout_secs = 30
protect = ["/task/tests"]
[limits]
cpus = 1.5
memory_mib = 768
[envs]
A = "1"
[network]
allow_out = ["deb.debian.org:80"]
[[disks]]
path = "/var/lib/docker"
size_mib = 4096
[[disks]]
path = "/workspace"
size_mib = 64
image = "task/repo:1"
"#,
        )
        .expect("parse");
        let spec = f.into_spec("py").expect("spec");
        assert_eq!(
            serde_json::to_value(&spec).expect("json"),
            serde_json::json!({
                "name": "py", "image": "debian", "vcpus": 2, "memory_mib": 1024,
                "setup": ["apt-get install -y python3", "mkdir /work"],
                "ready": {"tcp_port": 8000}, "ready_timeout_secs": 30,
                "envs": {"A": "1"},
                "network": {"allow_out": ["deb.debian.org:80"], "deny_out": []},
                "protect": ["/task/tests"],
                "limits": {"cpus": 1.5, "memory_mib": 768},
                "disks": [{"path": "/var/lib/docker", "size_mib": 4096},
                          {"path": "/workspace", "size_mib": 64, "image": "task/repo:1"}]
            })
        );
    }

    #[test]
    fn template_file_minimal_leaves_defaults_to_the_daemon() {
        let spec = TemplateFile::parse("image = \"minimal\"\n")
            .expect("parse")
            .into_spec("m")
            .expect("spec");
        assert_eq!(
            serde_json::to_value(&spec).expect("json"),
            serde_json::json!({"name": "m", "image": "minimal", "setup": [], "ready": null, "envs": {}})
        );
    }

    #[test]
    fn template_file_readiness_forms_parse() {
        for (toml, want) in [
            (
                "[ready]\ncommand = \"test -e /x\"",
                Readiness::Command("test -e /x".into()),
            ),
            (
                "ready = { file = \"/tmp\" }",
                Readiness::File("/tmp".into()),
            ),
            (
                "ready = { http_url = \"http://127.0.0.1/\" }",
                Readiness::HttpUrl("http://127.0.0.1/".into()),
            ),
        ] {
            let f = TemplateFile::parse(&format!("image = \"minimal\"\n{toml}\n")).expect(toml);
            assert_eq!(f.ready, Some(want));
        }
    }

    #[test]
    fn template_file_typos_and_bad_values_are_refused() {
        for bad in [
            "image = \"debian\"\nmemory = 512\n",
            "vcpus = 1\n",
            "image = \"debian\"\nready = { port = 1 }\n",
            "image = \"debian\"\nready = { tcp_port = 70000 }\n",
            "image = \"debian\"\nsetup = \"one\"\n",
            "image = \"debian\"\n[network]\nallow = [\"a.org\"]\n",
            "image = \"debian\"\n[network]\nallow_out = \"a.org\"\n",
            "image = \"debian\"\n[[disks]]\npath = \"/d\"\n",
            "image = \"debian\"\n[[disks]]\npath = \"/d\"\nsize = 16\n",
        ] {
            assert!(TemplateFile::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn template_file_name_must_match_the_command_line() {
        let f = TemplateFile::parse("name = \"a\"\nimage = \"minimal\"\n").expect("parse");
        assert!(f.clone().into_spec("a").is_ok());
        assert!(f.into_spec("b").is_err());
    }
}
