//! `forkbox template`: bake (built-in by name, or from a TOML file), list,
//! save, push, pull, rm. A bake streams NDJSON events; a spinner shows the
//! current step with the setup output printed above it. A push or a pull
//! streams its steps and bytes the same way.

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use crate::client::{segment, Body, Client};
use anyhow::Context;
use clap::Subcommand;
use forkbox::template_file::TemplateFile;
use hyper::Method;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Deserialize;

use super::{cell, print_json, print_table, Format};

#[derive(Subcommand)]
pub enum TemplateCmd {
    /// Bake a template: boot it, run its setup, wait until it is ready.
    /// Without --file, NAME is a built-in (`minimal`, `debian`, `docker`)
    /// or an existing template.
    Bake {
        name: String,
        /// A template file (TOML: image, vcpus, memory_mib, setup, ready,
        /// ready_timeout_secs, envs, network, protect, limits, disks); the
        /// template is created as NAME. `[network]` (allow_out, deny_out:
        /// lists of rules as in `sandbox create --allow-out`) holds only
        /// while it bakes; `[[disks]]` (path, size_mib, and optionally image:
        /// a stored image whose files the disk starts with) are writable
        /// disks.
        #[arg(long, short)]
        file: Option<PathBuf>,
    },
    /// List the templates.
    #[command(alias = "ls")]
    List,
    /// Save a baked template's zygote in the daemon's state directory: a
    /// restarted daemon (even after a reboot) starts it from there instead
    /// of baking. Saved again, the snapshot is replaced.
    Save { name: String },
    /// Push a baked template to a registry (`host[:port]/repo:tag`) as one
    /// OCI artifact: its snapshot (memory compressed) and, for a stored
    /// image, the image whole. Saved first if it was not.
    Push {
        name: String,
        reference: String,
        #[command(flatten)]
        registry: RegistryArgs,
    },
    /// Pull a pushed template and start its zygote from the snapshot,
    /// without baking: sandboxes fork from it at once.
    Pull {
        reference: String,
        /// Its name here (default: the repository's last part, as
        /// `pytest-env` for `host:5000/team/pytest-env:v3`).
        #[arg(long)]
        name: Option<String>,
        #[command(flatten)]
        registry: RegistryArgs,
    },
    /// Remove a baked template (and its saved snapshot).
    Rm { name: String },
}

/// How the daemon reaches a registry.
#[derive(clap::Args)]
pub struct RegistryArgs {
    /// Speak plain HTTP (a registry on loopback), not HTTPS.
    #[arg(long)]
    plain_http: bool,
    /// Basic auth (bearer tokens are fetched as the registry asks); the
    /// password comes from `FORKBOX_REGISTRY_PASSWORD`.
    #[arg(long)]
    user: Option<String>,
}

impl RegistryArgs {
    fn body(self, reference: String) -> anyhow::Result<serde_json::Value> {
        let password = match &self.user {
            Some(_) => Some(
                std::env::var("FORKBOX_REGISTRY_PASSWORD")
                    .context("--user needs the password in FORKBOX_REGISTRY_PASSWORD")?,
            ),
            None => None,
        };
        Ok(serde_json::json!({
            "reference": reference,
            "plain_http": self.plain_http,
            "username": self.user,
            "password": password,
        }))
    }
}

/// The name a pulled template gets without `--name`: the repository's
/// last part.
fn default_name(reference: &str) -> String {
    let path = reference.split('@').next().unwrap_or(reference);
    let last = path.rsplit('/').next().unwrap_or(path);
    last.split(':').next().unwrap_or(last).to_owned()
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
                        t["saved_bytes"]
                            .as_u64()
                            .map_or("-".into(), |b| format!("{:.1} MiB", b as f64 / 1048576.0)),
                        disks_text(&t["disks"]),
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
                    "SAVED",
                    "DISKS",
                ],
                &rows,
            );
            Ok(0)
        }
        TemplateCmd::Save { name } => {
            let spinner = ProgressBar::new_spinner();
            spinner.set_message(format!("saving template {name}'s zygote"));
            spinner.enable_steady_tick(Duration::from_millis(120));
            let saved: Result<serde_json::Value, _> = client
                .call(
                    Method::POST,
                    &format!("/templates/{}/save", segment(&name)),
                    Body::Empty,
                )
                .and_then(|r| r.json());
            spinner.finish_and_clear();
            let saved = saved?;
            if format == Format::Json {
                print_json(&saved)?;
            } else {
                let bytes = saved["saved_bytes"].as_u64().unwrap_or(0);
                println!(
                    "saved {name}: {:.1} MiB; a restarted forkboxd starts it from there, without baking",
                    bytes as f64 / 1048576.0
                );
            }
            Ok(0)
        }
        TemplateCmd::Push {
            name,
            reference,
            registry,
        } => {
            let body = Body::json(&registry.body(reference)?);
            let path = format!("/templates/{}/push", segment(&name));
            transfer(client, &path, body, format)
        }
        TemplateCmd::Pull {
            reference,
            name,
            registry,
        } => {
            let name = name.unwrap_or_else(|| default_name(&reference));
            let body = Body::json(&registry.body(reference)?);
            let path = format!("/templates/{}/pull", segment(&name));
            transfer(client, &path, body, format)
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

/// Follows a POST's NDJSON event stream: each line printed with `--json`,
/// each event given to `on` with the progress display, until `on` says
/// the exit code (the stream's last event).
fn follow<E: serde::de::DeserializeOwned>(
    client: &Client,
    path: &str,
    body: Body,
    format: Format,
    what: &str,
    mut on: impl FnMut(E, &mut Progress) -> Option<i32>,
) -> anyhow::Result<i32> {
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
        let event: E = serde_json::from_slice(&line)
            .with_context(|| format!("reading the {what}'s event stream"))?;
        if let Some(code) = on(event, &mut progress) {
            progress.finish();
            return Ok(code);
        }
    }
    progress.finish();
    anyhow::bail!("the {what}'s event stream ended before its last event")
}

fn bake(client: &Client, path: &str, body: Body, format: Format) -> anyhow::Result<i32> {
    follow(client, path, body, format, "bake", |event, progress| {
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
                return Some(0);
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
                return Some(1);
            }
            BakeEvent::Other => {}
        }
        None
    })
}

/// One line of a push's or a pull's NDJSON stream.
#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum RegistryEvent {
    Step {
        step: String,
        #[serde(default)]
        detail: String,
    },
    Progress {
        what: String,
        bytes: u64,
        total: u64,
        #[serde(default)]
        present: bool,
    },
    Pushed {
        reference: String,
        digest: String,
        sent_bytes: u64,
        present_bytes: u64,
        total_ms: u64,
    },
    Pulled {
        #[serde(default)]
        template: serde_json::Value,
        digest: String,
        downloaded_bytes: u64,
        total_ms: u64,
    },
    Failed {
        step: String,
        #[serde(default)]
        kind: String,
        #[serde(default)]
        message: String,
    },
    #[serde(other)]
    Other,
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / 1048576.0)
}

/// A push or a pull: its steps and bytes on the spinner, its end printed.
fn transfer(client: &Client, path: &str, body: Body, format: Format) -> anyhow::Result<i32> {
    follow(client, path, body, format, "transfer", |event, progress| {
        match event {
            RegistryEvent::Step { step, detail } => progress.step(&step, &detail),
            RegistryEvent::Progress {
                what,
                bytes,
                total,
                present,
            } => {
                let msg = if present {
                    format!("{what}: {} there already", mib(total))
                } else {
                    format!("{what}: {} of {}", mib(bytes), mib(total))
                };
                progress.status(&msg);
            }
            RegistryEvent::Pushed {
                reference,
                digest,
                sent_bytes,
                present_bytes,
                total_ms,
            } => {
                progress.finish();
                if format == Format::Human {
                    println!(
                        "pushed {reference} ({digest}) in {:.1} s: {} sent, {} the registry had",
                        total_ms as f64 / 1000.0,
                        mib(sent_bytes),
                        mib(present_bytes)
                    );
                }
                return Some(0);
            }
            RegistryEvent::Pulled {
                template,
                digest,
                downloaded_bytes,
                total_ms,
            } => {
                progress.finish();
                if format == Format::Human {
                    println!(
                        "pulled {} ({digest}) in {:.1} s, {} downloaded: its zygote is up, no bake",
                        cell(&template["name"]),
                        total_ms as f64 / 1000.0,
                        mib(downloaded_bytes)
                    );
                }
                return Some(0);
            }
            RegistryEvent::Failed {
                step,
                kind,
                message,
            } => {
                progress.finish();
                if format == Format::Human {
                    eprintln!("forkbox: failed at step {step} ({kind}): {message}");
                }
                return Some(1);
            }
            RegistryEvent::Other => {}
        }
        None
    })
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

    /// Replaces the spinner's message (a terminal only: bytes moving are
    /// not worth a line each).
    fn status(&mut self, msg: &str) {
        if let Some(bar) = &self.bar {
            if !bar.is_hidden() {
                bar.set_message(msg.to_owned());
            }
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

/// A template's disks as `/data:64M`, `/workspace:1024M(task/repo:1)`,
/// comma-separated; `-` for none.
fn disks_text(disks: &serde_json::Value) -> String {
    let Some(disks) = disks.as_array().filter(|d| !d.is_empty()) else {
        return "-".into();
    };
    disks
        .iter()
        .map(|d| {
            let image = d["image"]
                .as_str()
                .map(|i| format!("({i})"))
                .unwrap_or_default();
            format!("{}:{}M{image}", cell(&d["path"]), cell(&d["size_mib"]))
        })
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn a_pulled_template_is_named_for_its_repository() {
        for (reference, name) in [
            ("127.0.0.1:5000/team/pytest-env:v3", "pytest-env"),
            ("registry.example/tasks/swe@sha256:00ff", "swe"),
            ("localhost:5000/plain", "plain"),
        ] {
            assert_eq!(default_name(reference), name, "{reference}");
        }
    }

    #[test]
    fn disks_text_shows_each_disk_and_its_image() {
        assert_eq!(disks_text(&serde_json::json!([])), "-");
        assert_eq!(disks_text(&serde_json::Value::Null), "-");
        let disks = serde_json::json!([
            {"path": "/data", "size_mib": 64},
            {"path": "/workspace", "size_mib": 1024, "image": "task/repo:1", "image_id": "sha256:ab"}
        ]);
        assert_eq!(
            disks_text(&disks),
            "/data:64M,/workspace:1024M(task/repo:1)"
        );
    }
}
