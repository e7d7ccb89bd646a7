//! `forkbox bench gvisor`: the gVisor backend's figures, natively (it
//! needs no virtualization): cold start, exec round trip, checkpoint,
//! fork (restore) → first exec, memory per idle sandbox, and a
//! syscall-heavy loop beside the same loop on the host.

use std::time::{Duration, Instant};

use anyhow::Context;
use forkbox_host::gvisor::{Runsc, Sandbox, SandboxNet, SandboxSpec};
use forkbox_host::image::ImageName;
use forkbox_host::measure::{mem_available_kib, pss_kib};
use forkbox_proto::ExecRequest;
use serde_json::json;

use super::{calibrate, progress, Stats};

#[derive(clap::Args)]
pub struct Options {
    /// Cold starts, and exec round trips ×10.
    #[arg(long, default_value_t = 10)]
    pub runs: usize,
    /// Forks (restores of one checkpoint), kept idle together for the
    /// memory figure.
    #[arg(long, default_value_t = 16)]
    pub children: usize,
    #[arg(long, default_value = "minimal")]
    pub image: ImageName,
    /// Sandboxes without a network (forkboxd gives each one: its own
    /// gateway process and broker, egress denied).
    #[arg(long)]
    pub no_net: bool,
    #[arg(long)]
    pub json: bool,
}

/// A shell loop of `N` fork+execs of `true`: a test suite's syscall mix
/// (process creation, exec, file lookups) in miniature.
const LOOP_N: usize = 500;

fn exec_ok(sandbox: &Sandbox, req: &ExecRequest) -> anyhow::Result<()> {
    let r = sandbox.agent().exec(req, None, &mut |_, _| {})?;
    anyhow::ensure!(r.success(), "{req:?} failed in the sandbox: {r:?}");
    Ok(())
}

pub fn run(opts: &Options) -> anyhow::Result<serde_json::Value> {
    let dir = tempfile::tempdir().context("a scratch directory")?;
    let runsc = std::sync::Arc::new(Runsc::find(dir.path())?);
    let spec = SandboxSpec {
        net: (!opts.no_net).then(SandboxNet::default),
        ..SandboxSpec::image(opts.image)?
    };
    let truth = ExecRequest::argv(["true"]);

    let mut starts = Vec::new();
    for i in 0..opts.runs {
        let sandbox = Sandbox::start(&runsc, &spec)?;
        starts.push(sandbox.ready_after);
        progress("gvisor", "cold starts", i + 1, opts.runs);
    }

    // A template's zygote: started, one warm-up command, checkpointed.
    let parent = Sandbox::start(&runsc, &spec)?;
    exec_ok(&parent, &ExecRequest::shell("true"))?;
    let image = dir.path().join("checkpoint");
    let t = Instant::now();
    parent.checkpoint(&image)?;
    let checkpoint = t.elapsed();
    let checkpoint_bytes = forkbox_host::gvisor::checkpoint_bytes(&image);

    let before = mem_available_kib();
    let mut children = Vec::new();
    let mut restores = Vec::new();
    let mut first_execs = Vec::new();
    for i in 0..opts.children {
        let t = Instant::now();
        let (child, _report) = Sandbox::restore(&runsc, &spec, &image, None)?;
        restores.push(t.elapsed());
        exec_ok(&child, &truth)?;
        first_execs.push(t.elapsed());
        children.push(child);
        progress("gvisor", "forks", i + 1, opts.children);
    }
    std::thread::sleep(Duration::from_secs(2));
    let after = mem_available_kib();
    let pss: Vec<u64> = children
        .iter()
        .map(|c| c.host_pids().into_iter().filter_map(pss_kib).sum())
        .collect();
    let n = opts.children.max(1) as f64;
    let fall_kib = match (before, after) {
        (Some(b), Some(a)) => Some(b.saturating_sub(a) as f64 / n),
        _ => None,
    };
    // Round trips and the loop in a sandbox of their own.
    let busy = Sandbox::start(&runsc, &spec)?;
    exec_ok(&busy, &ExecRequest::shell("true"))?;
    let mut execs = Vec::new();
    for _ in 0..opts.runs * 10 {
        let t = Instant::now();
        exec_ok(&busy, &truth)?;
        execs.push(t.elapsed());
    }
    let script = format!("i=0; while [ $i -lt {LOOP_N} ]; do true; /bin/true; i=$((i+1)); done");
    let looped = ExecRequest::shell(&script);
    let t = Instant::now();
    exec_ok(&busy, &looped)?;
    let loop_sandbox = t.elapsed();
    let t = Instant::now();
    let status = std::process::Command::new("/bin/sh")
        .args(["-c", &script])
        .status()
        .context("the loop on the host")?;
    anyhow::ensure!(status.success(), "the loop failed on the host");
    let loop_host = t.elapsed();

    let c = calibrate();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    Ok(json!({
        "bench": "gvisor",
        "environment": "native (gVisor needs no virtualization)",
        "runsc": runsc_version(),
        "image": opts.image.as_str(),
        "network": !opts.no_net,
        "cold_start": Stats::from_durations(&starts).json(),
        "exec_true": Stats::from_durations(&execs).json(),
        "checkpoint_ms": ms(checkpoint),
        "checkpoint_bytes": checkpoint_bytes,
        "fork_restore": Stats::from_durations(&restores).json(),
        "fork_to_first_exec": Stats::from_durations(&first_execs).json(),
        "children": opts.children,
        "per_idle_child_kib": {
            "mem_available_fall": fall_kib,
            "pss_mean": pss.iter().sum::<u64>() as f64 / n,
        },
        "loop": {
            "fork_execs": LOOP_N * 2,
            "sandbox_ms": ms(loop_sandbox),
            "host_ms": ms(loop_host),
            "ratio": loop_sandbox.as_secs_f64() / loop_host.as_secs_f64().max(1e-9),
        },
        "loop_ns_per_iter": c.loop_ns_per_iter,
        "fork_exec_us": c.fork_exec_us,
    }))
}

fn runsc_version() -> String {
    std::process::Command::new("runsc")
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.lines().next().map(str::to_string))
        .unwrap_or_else(|| "unknown".into())
}
