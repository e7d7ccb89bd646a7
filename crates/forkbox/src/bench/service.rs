//! `forkbox bench service`: the service as a client sees it, through the
//! HTTP API of a forkboxd of our own.
//!
//! - create-from-template → first command result, beside the raw fork
//!   (the daemon's fork request to the child's after-fork answer) measured
//!   in the same runs, so the service's own overhead shows;
//! - group fan-out: one `fork` request of N children, wall time to all
//!   ready, and the host memory the group took.

use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;
use serde_json::json;

use crate::bench::Stats;
use crate::local_daemon::{calls, LocalDaemon};
use forkbox_host::measure::mem_available_kib;

#[derive(Debug, Clone, clap::Args)]
pub struct Options {
    /// Create → first command round trips.
    #[arg(long, default_value_t = 20)]
    pub runs: usize,
    /// The template (baked first; a built-in one, `minimal`, `debian` or `docker`, or another).
    #[arg(long, default_value = "minimal")]
    pub template: String,
    /// Group widths to fan out, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "64,256")]
    pub widths: Vec<usize>,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub environment: String,
    pub template: String,
    pub bake_ms: u64,
    /// Client's view: `POST /sandboxes` sent → `true`'s result read.
    pub create_to_first_result: Stats,
    /// The same creations as the daemon timed them (admission to ready).
    pub create_daemon: Stats,
    /// The raw fork inside them: fork request to after-fork answered.
    pub raw_fork: Stats,
    /// The first command alone.
    pub first_exec: Stats,
    /// p50 of the client's view minus p50 of the raw fork.
    pub service_overhead_p50_ms: f64,
    pub fan_out: Vec<FanOut>,
}

#[derive(Debug, Serialize)]
pub struct FanOut {
    pub width: usize,
    pub ready: usize,
    pub wall_ms: f64,
    /// Host `MemAvailable` drop over the group, per child.
    pub host_kib_per_child: Option<u64>,
    pub first_error: Option<String>,
}

pub fn run(o: &Options) -> anyhow::Result<Report> {
    let widest = o.widths.iter().copied().max().unwrap_or(0);
    let daemon = LocalDaemon::start(&[
        "--max-live".into(),
        (widest + 8).to_string(),
        "--create-wait".into(),
        "600".into(),
    ])?;
    let client = daemon.client()?;
    eprintln!("bench service: baking `{}`", o.template);
    let bake_ms = bake(&client, &o.template)
        .with_context(|| format!("baking; daemon log:\n{}", daemon.log_tail(20)))?;

    let (mut whole, mut created, mut raw, mut first) = (vec![], vec![], vec![], vec![]);
    let labels = json!({ "bench": "service" });
    for i in 0..o.runs {
        let t = Instant::now();
        let sb = calls::create(&client, &o.template, &labels)?;
        let t_exec = Instant::now();
        let out = calls::exec(&client, &sb.id, "true")?;
        anyhow::ensure!(out.exit_code == Some(0), "`true` answered {out:?}");
        whole.push(t.elapsed());
        first.push(t_exec.elapsed());
        created.push(Duration::from_millis(sb.create_ms.unwrap_or(0)));
        raw.push(Duration::from_millis(
            sb.metrics.as_ref().map_or(0, |m| m.boot_ms),
        ));
        calls::kill(&client, &sb.id)?;
        if (i + 1) % 5 == 0 {
            eprintln!("bench service: {}/{} creations", i + 1, o.runs);
        }
    }
    let whole = Stats::from_durations(&whole);
    let raw = Stats::from_durations(&raw);
    // Each figure as soon as it is measured: a wide fan-out can take the
    // emulated host down with it.
    eprintln!(
        "bench service: {}",
        whole.line("create → first command result")
    );
    eprintln!("bench service: {}", raw.line("raw fork inside it"));

    let mut fan_out = Vec::new();
    for &width in &o.widths {
        eprintln!("bench service: fan-out of {width}");
        let group = format!("fan-{width}");
        let parent = calls::create(&client, &o.template, &json!({ "bench": group }))?;
        let before = mem_available_kib();
        let t = Instant::now();
        let children = calls::fork(&client, &parent.id, width)?;
        let wall = t.elapsed();
        let after = mem_available_kib();
        let ready = children.iter().filter(|c| c.is_ok()).count();
        let first_error = children.iter().find_map(|c| c.as_ref().err().cloned());
        calls::kill_label(&client, "bench", &group)?;
        eprintln!(
            "bench service: fan-out {width}: {ready} ready in {:.0} ms",
            wall.as_secs_f64() * 1000.0
        );
        fan_out.push(FanOut {
            width,
            ready,
            wall_ms: wall.as_secs_f64() * 1000.0,
            host_kib_per_child: before
                .zip(after)
                .map(|(b, a)| b.saturating_sub(a) / ready.max(1) as u64),
            first_error,
        });
    }
    Ok(Report {
        environment: forkbox_host::testbed::Environment::detect().label().into(),
        template: o.template.clone(),
        bake_ms,
        service_overhead_p50_ms: whole.p50_ms - raw.p50_ms,
        create_to_first_result: whole,
        create_daemon: Stats::from_durations(&created),
        raw_fork: raw,
        first_exec: Stats::from_durations(&first),
        fan_out,
    })
}

/// Bakes a built-in template by name.
fn bake(client: &crate::client::Client, name: &str) -> anyhow::Result<u64> {
    use hyper::Method;
    let path = format!("/templates/{}/bake", crate::client::segment(name));
    let mut resp = client
        .send(
            Method::POST,
            &path,
            crate::client::Body::Empty,
            Some("application/x-ndjson"),
        )?
        .ok()?;
    while let Some(e) = resp.next_json::<serde_json::Value>()? {
        match e["type"].as_str() {
            Some("done") => return Ok(e["total_ms"].as_u64().unwrap_or(0)),
            Some("failed") => anyhow::bail!("bake failed: {}", e["message"]),
            _ => {}
        }
    }
    anyhow::bail!("the bake's stream ended early")
}

impl Report {
    pub fn print(&self) {
        println!(
            "bench service ({}; template `{}`)",
            self.environment, self.template
        );
        println!("  bake: {} ms", self.bake_ms);
        println!(
            "  {}",
            self.create_to_first_result
                .line("create → first command result (client)")
        );
        println!(
            "  {}",
            self.create_daemon
                .line("create, admission → ready (daemon)")
        );
        println!(
            "  {}",
            self.raw_fork
                .line("raw fork, request → after-fork answered")
        );
        println!("  {}", self.first_exec.line("first command alone"));
        println!(
            "  service overhead at p50: {:.1} ms over the raw fork",
            self.service_overhead_p50_ms
        );
        for f in &self.fan_out {
            println!(
                "  fan-out {:>3}: {} ready in {:.0} ms wall{}{}",
                f.width,
                f.ready,
                f.wall_ms,
                f.host_kib_per_child
                    .map(|k| format!(", {:.1} MiB host memory per child", k as f64 / 1024.0))
                    .unwrap_or_default(),
                f.first_error
                    .as_ref()
                    .map(|e| format!(" (first failure: {e})"))
                    .unwrap_or_default()
            );
        }
    }
}
