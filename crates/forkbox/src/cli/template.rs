//! `forkbox template`: bake (built-in by name, or from a TOML file), list,
//! save, rm. A bake streams NDJSON events; a spinner shows the current step with
//! the setup output printed above it.

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
    /// Save a baked template's zygote in the daemon's state directory: a
    /// restarted daemon (even after a reboot) starts it from there instead
    /// of baking. Saved again, the snapshot is replaced.
    Save { name: String },
    /// Remove a baked template (and its saved snapshot).
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
                        t["saved_bytes"]
                            .as_u64()
                            .map_or("-".into(), |b| format!("{:.1} MiB", b as f64 / 1048576.0)),
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
}
