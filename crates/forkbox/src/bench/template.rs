//! `forkbox bench template`: a template that travels, against one baked
//! where it is used. Two forkboxds of our own, each with its own state
//! directory, and a `docker-registry` on loopback:
//!
//! - the first bakes the template and runs a sandbox's first command
//!   (the fresh path), then pushes it;
//! - the second pulls it (as a new name each run) and runs a sandbox's
//!   first command (the travelled path).

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use hyper::Method;
use serde::Serialize;
use serde_json::{json, Value};

use crate::bench::Stats;
use crate::client::{segment, Body, Client};
use crate::local_daemon::{calls, LocalDaemon};
use forkbox_image::local_registry::LocalRegistry;

#[derive(Debug, Clone, clap::Args)]
pub struct Options {
    /// Pulls, each into a new name, each followed by a first command.
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// The template's guest memory.
    #[arg(long, default_value_t = 512)]
    pub memory_mib: u32,
    /// The built-in image it boots.
    #[arg(long, default_value = "minimal")]
    pub image: String,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub environment: String,
    pub image: String,
    pub memory_mib: u32,
    /// Bake, then create → first command result, on the pushing daemon.
    pub bake_ms: u64,
    pub bake_then_first_command_ms: f64,
    /// The push (saving the snapshot first), the client's view.
    pub push_ms: f64,
    pub pushed_bytes: u64,
    /// A second push of the same template: only the record and manifest.
    pub push_again_ms: f64,
    pub push_again_sent_bytes: u64,
    /// Pull (download, unpack, zygote started) on the other daemon.
    pub pull: Stats,
    pub pulled_bytes: u64,
    /// Pull, then create → first command result.
    pub pull_then_first_command: Stats,
    /// The last pull's steps as its event stream told them: each step's
    /// name and the milliseconds from the request to its start.
    pub pull_steps_ms: Vec<(String, f64)>,
    /// The first push's steps, the same way.
    pub push_steps_ms: Vec<(String, f64)>,
    /// p50 of `pull_then_first_command` over `bake_then_first_command_ms`.
    pub ratio_to_fresh_bake: f64,
}

pub fn run(o: &Options) -> anyhow::Result<Report> {
    let registry = LocalRegistry::start().context("starting a registry on loopback")?;
    let memory = o.memory_mib.to_string();
    let here = LocalDaemon::start(&[])?;
    let client = here.client()?;
    let spec = json!({ "name": "bench-travel", "image": o.image, "memory_mib": o.memory_mib,
        "setup": ["echo baked > /tmp/baked"] });
    eprintln!(
        "bench template: baking a {memory} MiB `{}` template",
        o.image
    );
    let t = Instant::now();
    let bake_ms = calls::bake(&client, &spec, &mut |_, _| {})
        .with_context(|| format!("baking; daemon log:\n{}", here.log_tail(20)))?;
    first_command(&client, "bench-travel")?;
    let fresh = ms(t.elapsed());
    eprintln!("bench template: bake + first command {fresh:.0} ms; pushing");

    let reference = format!("{}/bench/travel:v1", registry.addr);
    let t = Instant::now();
    let (pushed, push_steps_ms) = transfer(&client, "push", "bench-travel", &reference)?;
    let push_ms = ms(t.elapsed());
    let t = Instant::now();
    let (again, _) = transfer(&client, "push", "bench-travel", &reference)?;
    let push_again_ms = ms(t.elapsed());
    drop(client);
    drop(here);
    eprintln!("bench template: pushed in {push_ms:.0} ms; pulling into another daemon");

    let there = LocalDaemon::start(&[])?;
    let client = there.client()?;
    let (mut pulls, mut whole, mut pulled_bytes) = (Vec::new(), Vec::new(), 0);
    let mut pull_steps_ms = Vec::new();
    for i in 0..o.runs {
        let name = format!("travel-{i}");
        let t = Instant::now();
        let (pulled, steps) = transfer(&client, "pull", &name, &reference)
            .with_context(|| format!("pulling; daemon log:\n{}", there.log_tail(20)))?;
        pull_steps_ms = steps;
        pulls.push(t.elapsed());
        first_command(&client, &name)?;
        whole.push(t.elapsed());
        pulled_bytes = pulled["downloaded_bytes"].as_u64().unwrap_or(0);
        client.call(
            Method::DELETE,
            &format!("/templates/{}", segment(&name)),
            Body::Empty,
        )?;
        eprintln!(
            "bench template: pull {}/{}: {:.0} ms, with the first command {:.0} ms",
            i + 1,
            o.runs,
            ms(pulls[i]),
            ms(whole[i])
        );
    }
    let whole = Stats::from_durations(&whole);
    Ok(Report {
        environment: forkbox_host::testbed::Environment::detect().label().into(),
        image: o.image.clone(),
        memory_mib: o.memory_mib,
        bake_ms,
        bake_then_first_command_ms: fresh,
        push_ms,
        pushed_bytes: pushed["sent_bytes"].as_u64().unwrap_or(0),
        push_again_ms,
        push_again_sent_bytes: again["sent_bytes"].as_u64().unwrap_or(0),
        pull: Stats::from_durations(&pulls),
        pulled_bytes,
        ratio_to_fresh_bake: whole.p50_ms / fresh,
        pull_then_first_command: whole,
        pull_steps_ms,
        push_steps_ms,
    })
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// A sandbox of `template`, its first command checked, then killed.
fn first_command(client: &Client, template: &str) -> anyhow::Result<()> {
    let sb = calls::create(client, template, &json!({ "bench": "template" }))?;
    let out = calls::exec(client, &sb.id, "cat /tmp/baked")?;
    if out.stdout != "baked\n" {
        bail!("the template's setup is not in its sandbox: {out:?}");
    }
    calls::kill(client, &sb.id)
}

/// A push or a pull of template `name` to or from `reference`; its last
/// event (`pushed` or `pulled`), and when each step began (ms).
fn transfer(
    client: &Client,
    verb: &str,
    name: &str,
    reference: &str,
) -> anyhow::Result<(Value, Vec<(String, f64)>)> {
    let start = Instant::now();
    let mut steps = Vec::new();
    let path = format!("/templates/{}/{verb}", segment(name));
    let body = json!({ "reference": reference, "plain_http": true });
    let mut resp = client
        .send(
            Method::POST,
            &path,
            Body::json(&body),
            Some("application/x-ndjson"),
        )?
        .ok()?;
    while let Some(event) = resp.next_json::<Value>()? {
        match event["type"].as_str() {
            Some("step") => steps.push((
                event["step"].as_str().unwrap_or("?").to_owned(),
                ms(start.elapsed()),
            )),
            Some("pushed" | "pulled") => {
                steps.push(("end".into(), ms(start.elapsed())));
                return Ok((event, steps));
            }
            Some("failed") => bail!("{verb} failed: {}", event["message"]),
            _ => {}
        }
    }
    bail!("the {verb}'s event stream ended early")
}

impl Report {
    pub fn print(&self) {
        println!(
            "bench template ({}; a {} MiB `{}` template)",
            self.environment, self.memory_mib, self.image
        );
        println!(
            "  fresh: bake {} ms, bake + first command {:.0} ms",
            self.bake_ms, self.bake_then_first_command_ms
        );
        println!(
            "  push: {:.0} ms, {:.1} MiB sent; again {:.0} ms, {} bytes sent",
            self.push_ms,
            self.pushed_bytes as f64 / 1048576.0,
            self.push_again_ms,
            self.push_again_sent_bytes
        );
        println!(
            "  {} ({:.1} MiB downloaded)",
            self.pull.line("pull"),
            self.pulled_bytes as f64 / 1048576.0
        );
        println!(
            "  {}",
            self.pull_then_first_command.line("pull + first command")
        );
        println!(
            "  pull + first command / fresh bake + first command: {:.2}",
            self.ratio_to_fresh_bake
        );
        let steps = |steps: &[(String, f64)]| {
            let each: Vec<String> = steps
                .iter()
                .map(|(s, t)| format!("{s} at {t:.0} ms"))
                .collect();
            each.join(", ")
        };
        println!("  the first push's steps: {}", steps(&self.push_steps_ms));
        println!("  the last pull's steps: {}", steps(&self.pull_steps_ms));
    }
}
