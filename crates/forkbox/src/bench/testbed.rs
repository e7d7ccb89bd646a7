//! `forkbox bench testbed`: the emulated host's boot time and how much
//! slower it computes and starts processes than this machine.

use std::time::Instant;

use anyhow::Context;
use forkbox_host::testbed::{self, RunOptions, Testbed};
use serde_json::json;

use super::{calibrate, print_report, Calibration, Stats};

pub fn run(runs: usize, json: bool) -> anyhow::Result<i32> {
    let tb = Testbed::prepare().context("preparing the emulated host")?;
    let host = calibrate();
    let exe = std::env::current_exe()?.display().to_string();
    let mut walls = Vec::new();
    for _ in 0..runs.max(1) {
        let t = Instant::now();
        let outcome = tb.run_with(&RunOptions::new(vec!["true".into()]), &mut std::io::sink())?;
        walls.push(t.elapsed());
        anyhow::ensure!(
            matches!(outcome, testbed::Outcome::Exited(0)),
            "`true` inside the emulated host failed: {outcome:?}"
        );
    }
    let opts = RunOptions::new(vec![
        exe,
        "bench".into(),
        "calibrate".into(),
        "--json".into(),
    ]);
    let mut out = Vec::new();
    let outcome = tb.run_with(&opts, &mut out)?;
    anyhow::ensure!(
        matches!(outcome, testbed::Outcome::Exited(0)),
        "calibration inside the emulated host failed: {outcome:?}"
    );
    let inside: Calibration =
        serde_json::from_slice(&out).context("reading the calibration from inside")?;
    let s = Stats::from_durations(&walls);
    print_report(
        json,
        json!({
            "bench": "testbed",
            "run_true_p50_ms": s.p50_ms, "run_true_max_ms": s.max_ms, "runs": s.runs,
            "host_loop_ns_per_iter": host.loop_ns_per_iter, "inside_loop_ns_per_iter": inside.loop_ns_per_iter,
            "loop_slowdown": inside.loop_ns_per_iter / host.loop_ns_per_iter,
            "host_fork_exec_us": host.fork_exec_us, "inside_fork_exec_us": inside.fork_exec_us,
            "fork_exec_slowdown": inside.fork_exec_us / host.fork_exec_us,
        }),
    );
    Ok(0)
}
