//! `forkbox bench boot` and `forkbox bench exec`: one microVM's cold boot,
//! and its exec round trip, output throughput and VMM memory overhead.

use std::time::Instant;

use anyhow::Context;
use forkbox_host::image::ImageName;
use forkbox_host::measure::vmm_overhead_kib;
use forkbox_host::testbed::Environment;
use forkbox_host::vm::{Assets, Vm, VmSpec};
use forkbox_proto::{ExecRequest, OutputStream};
use serde_json::json;

use super::{calibrate, percentile, print_report, Calibration, Stats};

/// Cold boot: VMM start to the agent's handshake, `runs` times.
pub fn boot(image: ImageName, runs: usize, json: bool) -> anyhow::Result<i32> {
    let env = Environment::detect();
    let assets = Assets::prepare()?;
    let spec = VmSpec {
        image: image.into(),
        ..VmSpec::default()
    };
    let mut samples = Vec::new();
    for i in 0..runs {
        let vm = Vm::boot(&assets, &spec).context("booting the microVM")?;
        samples.push(vm.boot_time);
        if !json {
            eprint!("\rforkbox bench boot: {}/{runs}", i + 1);
        }
    }
    if !json {
        eprintln!();
    }
    let s = Stats::from_durations(&samples);
    let c = calibrate();
    print_report(
        json,
        json!({
            "bench": "boot", "environment": env.label(), "image": image.as_str(),
            "vcpus": 1, "memory_mib": 512,
            "runs": s.runs, "p50_ms": s.p50_ms, "p99_ms": s.p99_ms, "min_ms": s.min_ms, "max_ms": s.max_ms,
            "loop_ns_per_iter": c.loop_ns_per_iter, "fork_exec_us": c.fork_exec_us,
            "p50_in_fork_execs": s.p50_ms * 1000.0 / c.fork_exec_us,
        }),
    );
    Ok(0)
}

/// Exec round trip of `true`, 16 MiB of stdout, VMM memory overhead.
pub fn exec(runs: usize, json: bool) -> anyhow::Result<i32> {
    let env = Environment::detect();
    let assets = Assets::prepare()?;
    let vm = Vm::boot(&assets, &VmSpec::default()).context("booting the microVM")?;
    let agent = vm.agent();
    let truth = ExecRequest::argv(["true"]);
    agent.exec(&truth, None, &mut |_, _| {})?;
    let mut samples = Vec::new();
    for _ in 0..runs {
        let t = Instant::now();
        let r = agent.exec(&truth, None, &mut |_, _| {})?;
        samples.push(t.elapsed());
        anyhow::ensure!(r.success(), "`true` failed in the guest: {r:?}");
    }
    let s = Stats::from_durations(&samples);
    const BIG: u64 = 16 << 20;
    // dd with 1 MiB blocks: busybox `head` writes in small pieces and
    // would measure itself rather than the channel.
    let big = ExecRequest::argv(["dd", "if=/dev/zero", "bs=1048576", "count=16"]);
    let mut rates = Vec::new();
    for _ in 0..5 {
        let mut got = 0u64;
        let t = Instant::now();
        agent.exec(&big, None, &mut |stream, b| {
            if stream == OutputStream::Stdout {
                got += b.len() as u64
            }
        })?;
        anyhow::ensure!(got == BIG, "16 MiB exec returned {got} bytes");
        rates.push(BIG as f64 / (1 << 20) as f64 / t.elapsed().as_secs_f64());
    }
    rates.sort_by(f64::total_cmp);
    let overhead = vmm_overhead_kib(vm.pid()).context("reading the VMM's smaps")?;
    let c: Calibration = calibrate();
    print_report(
        json,
        json!({
            "bench": "exec", "environment": env.label(),
            "runs": s.runs, "p50_ms": s.p50_ms, "p99_ms": s.p99_ms, "min_ms": s.min_ms, "max_ms": s.max_ms,
            "stdout_16mib_mib_per_s": percentile(&rates, 50.0),
            "vmm_overhead_mib": overhead as f64 / 1024.0,
            "loop_ns_per_iter": c.loop_ns_per_iter, "fork_exec_us": c.fork_exec_us,
            "p50_in_fork_execs": s.p50_ms * 1000.0 / c.fork_exec_us,
        }),
    );
    Ok(0)
}
