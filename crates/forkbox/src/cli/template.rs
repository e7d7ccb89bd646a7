//! `forkbox template`: bake (built-in by name, or from a TOML file), list,
//! rm. A bake streams NDJSON events; a spinner shows the current step with
//! the setup output printed above it.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::client::{segment, Body, Client};
use anyhow::Context;
use clap::Subcommand;
use forkbox_net::policy::PolicySpec;
use hyper::Method;
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};

use super::{cell, print_json, print_table, Format};

#[derive(Subcommand)]
pub enum TemplateCmd {
    /// Bake a template: boot it, run its setup, wait until it is ready.
    /// Without --file, NAME is a built-in (`minimal`, `debian`) or an
    /// existing template.
    Bake {
        name: String,
        /// A template file (TOML: image, vcpus, memory_mib, setup, ready,
        /// ready_timeout_secs, envs, network); the template is created as
        /// NAME. `[network]` (allow_out, deny_out: lists of rules as in
        /// `sandbox create --allow-out`) holds only while it bakes.
        #[arg(long, short)]
        file: Option<PathBuf>,
    },
    /// List the templates.
    #[command(alias = "ls")]
    List,
    /// Remove a baked template.
    Rm { name: String },
}

pub fn run(client: &Client, cmd: TemplateCmd, format: Format) -> anyhow::Result<i32> {
    match cmd {
        TemplateCmd::Bake { name, file } => {
            let (path, body) = match file {
                None => (format!("/templates/{}/bake", segment(&name)), Body::Empty),
                Some(f) => {
                    let spec = TemplateFile::load(&f)?.into_spec(&name)?;
                    ("/templates".to_owned(), Body::json(&spec))
                }
            };
            bake(client, &path, body, format)
        }
        TemplateCmd::List => {
            let list: Vec<serde_json::Value> = client.get("/templates")?;
            if format == Format::Json {
                print_json(&serde_json::Value::Array(list))?;
                return Ok(0);
            }
            let rows: Vec<Vec<String>> = list
                .iter()
                .map(|t| {
                    let steps = t["setup"].as_array().map_or(0, Vec::len);
                    vec![
                        cell(&t["name"]),
                        cell(&t["image"]),
                        cell(&t["vcpus"]),
                        cell(&t["memory_mib"]),
                        steps.to_string(),
                        t.get("ready")
                            .map_or("-".into(), |r| readiness_text(r).unwrap_or_else(|| cell(r))),
                        t.get("state").map_or("-".into(), cell),
                    ]
                })
                .collect();
            print_table(
                &[
                    "NAME",
                    "IMAGE",
                    "VCPUS",
                    "MEMORY_MIB",
                    "SETUP",
                    "READY",
                    "STATE",
                ],
                &rows,
            );
            Ok(0)
        }
        TemplateCmd::Rm { name } => {
            client.call(
                Method::DELETE,
                &format!("/templates/{}", segment(&name)),
                Body::Empty,
            )?;
            if format == Format::Json {
                print_json(&serde_json::json!({ "removed": name }))?;
            } else {
                println!("removed {name}");
            }
            Ok(0)
        }
    }
}

/// `{"file": "/x"}` as `file /x`.
fn readiness_text(r: &serde_json::Value) -> Option<String> {
    let (k, v) = r.as_object()?.iter().next()?;
    Some(format!("{k} {}", cell(v)))
}

/// One line of a bake's NDJSON stream.
#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum BakeEvent {
    Step {
        step: String,
        #[serde(default)]
        detail: String,
    },
    /// Setup or readiness output (`stream` is not told apart: all of it
    /// goes above the spinner).
    Output { data: String },
    Done {
        #[serde(default)]
        template: serde_json::Value,
        #[serde(default)]
        boot_ms: u64,
        #[serde(default)]
        total_ms: u64,
    },
    Failed {
        step: String,
        #[serde(default)]
        kind: String,
        #[serde(default)]
        message: String,
        #[serde(default)]
        output: String,
    },
    /// An event this client does not know yet: shown in --json, skipped
    /// otherwise.
    #[serde(other)]
    Other,
}

fn bake(client: &Client, path: &str, body: Body, format: Format) -> anyhow::Result<i32> {
    let mut resp = client
        .send(Method::POST, path, body, Some("application/x-ndjson"))?
        .ok()?;
    let mut progress = Progress::new(format);
    while let Some(line) = resp.next_line()? {
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        if format == Format::Json {
            let mut out = std::io::stdout().lock();
            out.write_all(&line)?;
            out.write_all(b"\n")?;
            out.flush()?;
        }
        let event: BakeEvent =
            serde_json::from_slice(&line).context("reading the bake's event stream")?;
        match event {
            BakeEvent::Step { step, detail } => progress.step(&step, &detail),
            BakeEvent::Output { data } => progress.output(&data),
            BakeEvent::Done {
                template,
                boot_ms,
                total_ms,
            } => {
                progress.finish();
                if format == Format::Human && total_ms == 0 {
                    println!("{} was baked already", cell(&template["name"]));
                } else if format == Format::Human {
                    println!(
                        "baked {} in {:.1} s (boot {boot_ms} ms)",
                        cell(&template["name"]),
                        total_ms as f64 / 1000.0
                    );
                }
                return Ok(0);
            }
            BakeEvent::Failed {
                step,
                kind,
                message,
                output,
            } => {
                progress.finish();
                if format == Format::Human {
                    eprintln!("forkbox: bake failed at step {step} ({kind}): {message}");
                    if !output.is_empty() {
                        eprintln!("--- output of {step} ---");
                        eprint!("{output}");
                        if !output.ends_with('\n') {
                            eprintln!();
                        }
                    }
                }
                return Ok(1);
            }
            BakeEvent::Other => {}
        }
    }
    progress.finish();
    anyhow::bail!("the bake's event stream ended without `done` or `failed`")
}

/// The spinner and the setup output above it. Off a terminal, steps are
/// plain lines on stderr; with `--json`, nothing (the events are printed).
struct Progress {
    bar: Option<ProgressBar>,
    format: Format,
    /// Output not yet ended by a newline.
    partial: String,
}

impl Progress {
    fn new(format: Format) -> Self {
        let bar = (format == Format::Human).then(|| {
            let bar = ProgressBar::new_spinner();
            bar.set_style(
                ProgressStyle::with_template("{spinner} {elapsed:>4} {msg}")
                    .expect("the template is valid"),
            );
            bar.enable_steady_tick(Duration::from_millis(120));
            bar
        });
        Self {
            bar,
            format,
            partial: String::new(),
        }
    }

    fn step(&mut self, step: &str, detail: &str) {
        self.flush_partial();
        let msg = if detail.is_empty() {
            step.to_owned()
        } else {
            format!("{step}: {detail}")
        };
        match &self.bar {
            Some(bar) if !bar.is_hidden() => bar.set_message(msg),
            Some(_) => eprintln!("==> {msg}"),
            None => {}
        }
    }

    fn output(&mut self, data: &str) {
        if self.format == Format::Json {
            return;
        }
        self.partial.push_str(data);
        while let Some(i) = self.partial.find('\n') {
            let line: String = self.partial.drain(..=i).collect();
            self.print(line.trim_end_matches('\n'));
        }
    }

    fn flush_partial(&mut self) {
        if !self.partial.is_empty() {
            let line = std::mem::take(&mut self.partial);
            self.print(&line);
        }
    }

    fn print(&self, line: &str) {
        match &self.bar {
            Some(bar) if !bar.is_hidden() => bar.println(format!("  {line}")),
            _ => eprintln!("  {line}"),
        }
    }

    fn finish(&mut self) {
        self.flush_partial();
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

/// A template file: what `forkbox template bake NAME --file F` reads.
///
/// ```toml
/// image = "debian"          # or "minimal"
/// vcpus = 2
/// memory_mib = 1024
/// setup = ["apt-get install -y python3", "mkdir /work"]
/// ready = { tcp_port = 8000 }   # or command = "…", file = "/path", http_url = "…"
/// ready_timeout_secs = 60
/// protect = ["/task/tests", "/task/grade.sh"]   # the policy may not change these
/// [envs]
/// PYTHONUNBUFFERED = "1"
/// [network]                 # egress while it bakes only; default: none
/// allow_out = ["deb.debian.org:80", "*.pythonhosted.org:443"]
/// deny_out = []
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
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
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
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
[envs]
A = "1"
[network]
allow_out = ["deb.debian.org:80"]
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
                "protect": ["/task/tests"]
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

    #[test]
    fn bake_events_parse_and_unknown_ones_are_skipped() {
        let e: BakeEvent =
            serde_json::from_str(r#"{"type":"step","step":"setup[0]","detail":"true"}"#)
                .expect("step");
        assert!(matches!(e, BakeEvent::Step { step, .. } if step == "setup[0]"));
        let e: BakeEvent = serde_json::from_str(
            r#"{"type":"failed","step":"setup[1]","kind":"template_failed","message":"exit 1","output":"boom"}"#,
        )
        .expect("failed");
        assert!(matches!(e, BakeEvent::Failed { output, .. } if output == "boom"));
        let e: BakeEvent = serde_json::from_str(r#"{"type":"zygote","pid":1}"#).expect("unknown");
        assert!(matches!(e, BakeEvent::Other));
    }
}
