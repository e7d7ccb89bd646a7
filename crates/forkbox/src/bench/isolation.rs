//! `forkbox bench isolation`: the memory-isolation check
//! (`forkbox_host::isolation`) over many forks. A `debian` VM runs the
//! pattern writer; each fork request forks it (running, then paused, in
//! turn) into a few children; every child must find one instant of the
//! writer's memory, then marks every page, and the parent must never see
//! a mark. A single inconsistent child or parent fails the run, whoever's
//! bug it is; lost children are counted by cause (infrastructure, not a
//! verdict).

use std::collections::BTreeMap;
use std::time::Instant;

use anyhow::Context;
use forkbox_host::image::ImageName;
use forkbox_host::isolation::{mark, start_writer, verdict};
use forkbox_host::testbed::Environment;
use forkbox_host::vm::{loss_signature, Assets, Vm, VmSpec};
use serde_json::{json, Value};

use super::{progress, Stats};

#[derive(clap::Args)]
pub struct Options {
    #[arg(long)]
    pub json: bool,
    /// Fork requests; the parent runs during even ones, is paused during
    /// odd ones.
    #[arg(long, default_value_t = 50)]
    pub forks: usize,
    /// Children per fork request.
    #[arg(long, default_value_t = 4)]
    pub children: usize,
}

/// Runs the check; the report, with `clean` false if any child or the
/// parent was inconsistent or a child was lost.
pub fn run(opts: &Options) -> anyhow::Result<Value> {
    anyhow::ensure!(
        opts.forks > 0 && opts.children > 0,
        "--forks and --children must be at least 1"
    );
    let assets = Assets::prepare()?;
    let spec = VmSpec {
        image: ImageName::Debian.into(),
        ..VmSpec::default()
    };
    let mut parent = Vm::boot(&assets, &spec).context("booting the writer's VM")?;
    start_writer(parent.agent()).map_err(anyhow::Error::msg)?;
    let mut fork_times = Vec::new();
    let mut check_times = Vec::new();
    let mut consistent = 0usize;
    let mut inconsistent: Vec<String> = Vec::new();
    let mut parent_inconsistent: Vec<String> = Vec::new();
    let mut lost: BTreeMap<String, usize> = BTreeMap::new();
    for f in 0..opts.forks {
        let paused = f % 2 == 1;
        if paused {
            parent.pause().context("pausing the parent")?;
        }
        let t = Instant::now();
        let children = parent.fork(opts.children);
        fork_times.push(t.elapsed());
        if paused {
            parent.resume().context("resuming the parent")?;
        }
        for (i, child) in children
            .context("the fork request")?
            .into_iter()
            .enumerate()
        {
            let mut child = match child {
                Ok(c) => c,
                Err(e) => {
                    *lost
                        .entry(loss_signature(&format!("{e:#}")).to_owned())
                        .or_default() += 1;
                    continue;
                }
            };
            if let Some(why) = &child.replaced {
                *lost.entry(loss_signature(why).to_owned()).or_default() += 1;
            }
            let t = Instant::now();
            match verdict(child.agent()) {
                Ok(v) if v.is_consistent() => consistent += 1,
                Ok(v) => inconsistent.push(format!(
                    "fork {f} (parent paused: {paused}), child {i}: {v:?}"
                )),
                Err(e) => inconsistent.push(format!(
                    "fork {f}, child {i}: no verdict: {e}\n{}",
                    child.post_mortem()
                )),
            }
            check_times.push(t.elapsed());
            if let Err(e) = mark(child.agent()) {
                inconsistent.push(format!("fork {f}, child {i}: {e}\n{}", child.post_mortem()));
            }
        }
        match verdict(parent.agent()) {
            Ok(v) if v.is_consistent() => {}
            Ok(v) => parent_inconsistent.push(format!("after fork {f}: {v:?}")),
            Err(e) => parent_inconsistent.push(format!(
                "after fork {f}: no verdict: {e}\n{}",
                parent.post_mortem()
            )),
        }
        progress("isolation", "forks", f + 1, opts.forks);
    }
    let forks = Stats::from_durations(&fork_times);
    let checks = Stats::from_durations(&check_times);
    let lost_total: usize = lost.values().sum();
    Ok(json!({
        "bench": "isolation",
        "environment": Environment::detect().label(),
        "forks": opts.forks,
        "children_per_fork": opts.children,
        "children_consistent": consistent,
        "children_inconsistent": inconsistent.len(),
        "parent_inconsistent": parent_inconsistent.len(),
        "lost_children": lost_total,
        "lost_by_cause": lost,
        "first_inconsistencies": inconsistent.iter().chain(&parent_inconsistent).take(8).collect::<Vec<_>>(),
        "fork_p50_ms": forks.p50_ms,
        "fork_p99_ms": forks.p99_ms,
        "child_check_p50_ms": checks.p50_ms,
        "clean": inconsistent.is_empty() && parent_inconsistent.is_empty() && lost_total == 0,
    }))
}
