//! `forkbox bench …`: measurements printed as percentiles and ratios, each
//! naming the environment it ran in. Absolute times inside the emulated
//! host are inflated; every run therefore also measures a calibration
//! baseline (a tight loop and fork+exec) in the same environment, so that
//! figures can be compared across environments.
//!
//! One file per benchmark: [`fork`], [`churn`], [`isolation`], [`net`], [`service`] (the
//! daemon's API), [`vm`] (boot and exec), [`testbed`], [`gvisor`] (the gVisor backend); here the command
//! line, the statistics and the calibration they share.

pub mod churn;
pub mod disk;
pub mod fork;
pub mod gvisor;
pub mod image;
pub mod isolation;
pub mod net;
pub mod service;
pub mod template;
pub mod testbed;
pub mod vm;

use clap::Subcommand;
use forkbox_host::image::ImageName;
use forkbox_host::testbed::Environment;

use std::process::Command;
use std::time::{Duration, Instant};

use serde::Serialize;

#[derive(Subcommand)]
pub enum BenchCmd {
    /// Fork: zygote forks at several memory sizes against restore and cold
    /// boot baselines, fan-out, memory per child, dirty fork, snapshot.
    Fork(fork::Options),
    /// Writable disks: fork → first exec and reset of a zygote with a
    /// disk, by volume size and what was written, beside one without.
    Disk(disk::Options),
    /// Churn: fork → exec → kill cycles, concurrent, from a zygote and from
    /// running parents: percentiles per phase, lost children by cause, leaks.
    Churn(churn::Options),
    /// Memory isolation: a guest writes a pattern while it is forked (running
    /// and paused, in turn); every child must hold one instant of it, the
    /// parent none of the children's writes.
    Isolation(isolation::Options),
    /// Network: guest ↔ host-loopback TCP throughput and connect latency
    /// (allowed and denied) in one `debian` microVM.
    Net(net::Options),
    /// Cold boot: VMM start to the agent's handshake.
    Boot {
        #[arg(long, default_value = "minimal")]
        image: ImageName,
        #[arg(long, default_value_t = 30)]
        runs: usize,
        #[arg(long)]
        json: bool,
    },
    /// Exec round trip of `true`, 16 MiB of stdout, VMM memory overhead.
    Exec {
        #[arg(long, default_value_t = 100)]
        runs: usize,
        #[arg(long)]
        json: bool,
    },
    /// The service through its HTTP API: create-from-template → first
    /// command result beside the raw fork, and group fan-out.
    Service(service::Options),
    /// Image import into a fresh store: an image, a second one on the same
    /// base, the first again; percentiles, ratios, what the store holds.
    Image(image::Options),
    /// A template that travels: bake + first command on one daemon, push,
    /// then pull + first command on another (its own state directory).
    Template(template::Options),
    /// The gVisor backend, natively: cold start, exec round trip,
    /// checkpoint, fork → first exec, memory per idle sandbox, and a
    /// syscall-heavy loop against the host's.
    Gvisor(gvisor::Options),
    /// A tight loop and fork+exec, here: the yardstick for other figures.
    Calibrate {
        #[arg(long)]
        json: bool,
    },
    /// The emulated host: its boot time and how much slower it is than here.
    Testbed {
        #[arg(long, default_value_t = 3)]
        runs: usize,
        #[arg(long)]
        json: bool,
    },
}

pub(crate) fn print_report(json: bool, report: serde_json::Value) {
    if json {
        println!("{report}");
    } else if let Some(obj) = report.as_object() {
        for (k, v) in obj {
            println!("{k:>22}: {v}");
        }
    }
}

/// Runs one benchmark; its exit code.
pub fn run(what: BenchCmd) -> anyhow::Result<i32> {
    let env = Environment::detect();
    match what {
        BenchCmd::Fork(opts) => {
            if let Some(code) = crate::delegate(ImageName::Minimal)? {
                return Ok(code);
            }
            let report = fork::run(&opts)?;
            print_report(opts.json, report);
            Ok(0)
        }
        BenchCmd::Isolation(opts) => {
            if let Some(code) = crate::delegate(ImageName::Debian)? {
                return Ok(code);
            }
            let report = isolation::run(&opts)?;
            let clean = report["clean"] == true;
            print_report(opts.json, report);
            Ok(if clean { 0 } else { 1 })
        }
        BenchCmd::Disk(opts) => {
            if let Some(code) = crate::delegate(ImageName::Minimal)? {
                return Ok(code);
            }
            let report = disk::run(&opts)?;
            print_report(opts.json, report);
            Ok(0)
        }
        BenchCmd::Churn(opts) => {
            if let Some(code) = crate::delegate(ImageName::Minimal)? {
                return Ok(code);
            }
            let report = churn::run(&opts)?;
            let clean = report["lost_children"] == 0
                && report["leaks"]["vmm_processes"] == 0
                && report["leaks"]["fds"] == 0
                && report["leaks"]["vm_dirs"] == 0
                && report["leaks"]["cgroups"] == 0;
            print_report(opts.json, report);
            Ok(if clean { 0 } else { 1 })
        }
        BenchCmd::Net(opts) => {
            if let Some(code) = crate::delegate(ImageName::Debian)? {
                return Ok(code);
            }
            let report = net::run(&opts)?;
            if opts.json {
                println!("{report}");
            } else {
                net::print(&report);
            }
            Ok(0)
        }
        BenchCmd::Service(opts) => {
            if let Some(code) = crate::delegate(ImageName::Minimal)? {
                return Ok(code);
            }
            let report = service::run(&opts)?;
            if opts.json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                report.print();
            }
            Ok(0)
        }
        BenchCmd::Template(opts) => {
            if let Some(code) = crate::delegate(ImageName::Minimal)? {
                return Ok(code);
            }
            let report = template::run(&opts)?;
            if opts.json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                report.print();
            }
            Ok(0)
        }
        BenchCmd::Calibrate { json } => {
            let c = calibrate();
            print_report(
                json,
                serde_json::json!({"environment": env.label(), "loop_ns_per_iter": c.loop_ns_per_iter, "fork_exec_us": c.fork_exec_us}),
            );
            Ok(0)
        }
        BenchCmd::Boot { image, runs, json } => {
            if let Some(code) = crate::delegate(image)? {
                return Ok(code);
            }
            vm::boot(image, runs, json)
        }
        BenchCmd::Exec { runs, json } => {
            if let Some(code) = crate::delegate(ImageName::Minimal)? {
                return Ok(code);
            }
            vm::exec(runs, json)
        }
        BenchCmd::Testbed { runs, json } => testbed::run(runs, json),
        BenchCmd::Gvisor(opts) => {
            let report = gvisor::run(&opts)?;
            print_report(opts.json, report);
            Ok(0)
        }
        BenchCmd::Image(opts) => {
            let report = image::run(&opts)?;
            print_report(opts.json, report);
            Ok(0)
        }
    }
}

/// The nearest-rank `p`th percentile (0 to 100) of `sorted` (ascending);
/// NaN when there are no samples. The p50 of an even count is the lower
/// middle sample.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    let n = sorted.len();
    if n == 0 {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * n as f64).ceil() as usize;
    sorted[rank.clamp(1, n) - 1]
}

/// Summary of a set of samples, in milliseconds.
#[derive(Debug, Clone, Serialize)]
pub struct Stats {
    pub runs: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub min_ms: f64,
    pub max_ms: f64,
    pub mean_ms: f64,
}

impl Stats {
    pub fn from_durations(samples: &[Duration]) -> Self {
        let mut ms: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1000.0).collect();
        ms.sort_by(f64::total_cmp);
        let n = ms.len();
        Self {
            runs: n,
            p50_ms: percentile(&ms, 50.0),
            p99_ms: percentile(&ms, 99.0),
            min_ms: ms.first().copied().unwrap_or(f64::NAN),
            max_ms: ms.last().copied().unwrap_or(f64::NAN),
            mean_ms: if n == 0 {
                f64::NAN
            } else {
                ms.iter().sum::<f64>() / n as f64
            },
        }
    }

    /// The summary as a report shows it (without the mean).
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "runs": self.runs, "p50_ms": self.p50_ms, "p99_ms": self.p99_ms,
            "min_ms": self.min_ms, "max_ms": self.max_ms,
        })
    }

    pub fn line(&self, what: &str) -> String {
        format!(
            "{what}: p50 {:.2} ms  p99 {:.2} ms  min {:.2} ms  max {:.2} ms  ({} runs)",
            self.p50_ms, self.p99_ms, self.min_ms, self.max_ms, self.runs
        )
    }
}

/// Reports step `i` of `n` of a long phase on stderr, with `--json` too
/// (the report goes to stdout). A terminal sees one line redrawn; a log
/// gets a line about every tenth of the phase and at its end.
pub fn progress(bench: &str, what: &str, i: usize, n: usize) {
    use std::io::IsTerminal;
    if std::io::stderr().is_terminal() {
        eprint!("\rforkbox bench {bench}: {what} {i}/{n}   ");
        if i == n {
            eprintln!();
        }
    } else if i == n || i.is_multiple_of(n.div_ceil(10).max(1)) {
        eprintln!("forkbox bench {bench}: {what} {i}/{n}");
    }
}

/// How fast this environment is at the two things that dominate forkbox's
/// own overheads: plain computation and process creation.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct Calibration {
    /// Nanoseconds per iteration of a dependent integer loop.
    pub loop_ns_per_iter: f64,
    /// Microseconds for one fork+exec+wait of `/bin/true` (p50).
    pub fork_exec_us: f64,
}

/// Measures [`Calibration`] here; takes about a second on real hardware.
pub fn calibrate() -> Calibration {
    const ITERS: u64 = 50_000_000;
    let start = Instant::now();
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for i in 0..ITERS {
        x = std::hint::black_box(x.rotate_left(5) ^ i).wrapping_mul(0x2545_f491_4f6c_dd1d);
    }
    std::hint::black_box(x);
    let loop_ns_per_iter = start.elapsed().as_nanos() as f64 / ITERS as f64;
    let mut spawns = Vec::new();
    for _ in 0..50 {
        let t = Instant::now();
        let _ = Command::new("/bin/true").status();
        spawns.push(t.elapsed());
    }
    Calibration {
        loop_ns_per_iter,
        fork_exec_us: Stats::from_durations(&spawns).p50_ms * 1000.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_percentiles_nearest_rank() {
        let samples: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        let s = Stats::from_durations(&samples);
        assert_eq!(s.p50_ms, 50.0);
        assert_eq!(s.p99_ms, 99.0);
        assert_eq!(s.min_ms, 1.0);
        assert_eq!(s.max_ms, 100.0);
        assert_eq!(s.runs, 100);
    }

    #[test]
    fn percentile_nearest_rank_takes_the_lower_middle_and_nan_for_none() {
        assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0], 50.0), 2.0);
        assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0, 5.0], 50.0), 3.0);
        assert_eq!(percentile(&[7.0], 99.0), 7.0);
        assert_eq!(percentile(&[1.0, 2.0], 0.0), 1.0);
        assert!(percentile(&[], 50.0).is_nan());
    }
}
