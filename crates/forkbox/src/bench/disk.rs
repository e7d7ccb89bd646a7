//! `forkbox bench disk`: writable disks. For each golden volume size and
//! each amount a VM wrote to its disk before it became a zygote: a fork
//! of the zygote to its child's first exec, and a reset (the child killed,
//! a new one forked, its first exec), p50/p99, beside the same zygote
//! without a disk; what the written blocks hold on the host, and what a
//! child's own top holds once it wrote 1 MiB. A fork's disk side is O(1):
//! its figures should not grow with the volume or with what was written.

use std::os::unix::fs::MetadataExt;
use std::time::Instant;

use anyhow::Context;
use forkbox_host::testbed::Environment;
use forkbox_host::vm::{Assets, DiskSpec, Vm, VmSpec};
use forkbox_proto::ExecRequest;
use serde_json::{json, Value};

use super::{progress, Stats};

#[derive(clap::Args)]
pub struct Options {
    #[arg(long)]
    pub json: bool,
    /// Golden volume sizes, in MiB.
    #[arg(long, value_delimiter = ',', default_value = "1024,10240")]
    pub volumes_mib: Vec<u32>,
    /// MiB the VM writes to its disk before it becomes a zygote.
    #[arg(long, value_delimiter = ',', default_value = "1,100,1024")]
    pub written_mib: Vec<u32>,
    /// Forks (and resets) measured per case.
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
}

const MIB: u64 = 1 << 20;

/// Host bytes held by the unnamed files (writable disks' tops and frozen
/// layers) VMM `pid` has open, largest first.
fn unnamed_bytes(pid: u32) -> Vec<u64> {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return Vec::new();
    };
    let mut sizes: Vec<u64> = dir
        .flatten()
        .filter(|e| {
            std::fs::read_link(e.path()).is_ok_and(|t| {
                let t = t.to_string_lossy();
                t.contains("top-") && t.ends_with("(deleted)")
            })
        })
        .filter_map(|e| std::fs::metadata(e.path()).ok())
        .map(|m| m.blocks() * 512)
        .collect();
    sizes.sort_unstable_by(|a, b| b.cmp(a));
    sizes
}

fn run_ok(vm: &Vm, script: &str) -> anyhow::Result<()> {
    let r = vm
        .agent()
        .exec(&ExecRequest::shell(script), None, &mut |_, _| {})
        .with_context(|| format!("`{script}`"))?;
    anyhow::ensure!(r.success(), "`{script}`: {r:?}");
    Ok(())
}

/// One child forked from `zygote` and its first exec of `true`.
fn fork_one(zygote: &Vm) -> anyhow::Result<Vm> {
    let child = zygote
        .fork(1)
        .context("the fork request")?
        .pop()
        .context("no child")?
        .context("the child")?;
    run_ok(&child, "true")?;
    Ok(child)
}

/// Forks and resets of `zygote`: (fork → first exec, reset, and with a
/// disk, the last child's top after it wrote 1 MiB).
fn measure(
    zygote: &Vm,
    runs: usize,
    what: &str,
    disk: bool,
) -> anyhow::Result<(Stats, Stats, u64)> {
    let (mut forks, mut resets) = (Vec::new(), Vec::new());
    let mut child: Option<Vm> = None;
    for i in 0..runs {
        let t = Instant::now();
        let had = child.take();
        let reset = had.is_some();
        drop(had);
        let t_fork = Instant::now();
        let c = fork_one(zygote)?;
        let done = Instant::now();
        forks.push(done - t_fork);
        if reset {
            resets.push(done - t);
        }
        child = Some(c);
        progress("disk", what, i + 1, runs);
    }
    let c = child.context("no runs")?;
    if !disk {
        return Ok((
            Stats::from_durations(&forks),
            Stats::from_durations(&resets),
            0,
        ));
    }
    run_ok(&c, "head -c 1048576 /dev/zero > /data/child && sync")?;
    let own = unnamed_bytes(c.pid());
    // Its own top: the newest file, the first its VMM opened after the
    // shared layers, is not known by name; the smallest that holds the
    // 1 MiB is it (the shared ones hold what the zygote wrote).
    let top = own.iter().copied().filter(|&b| b >= MIB).min().unwrap_or(0);
    Ok((
        Stats::from_durations(&forks),
        Stats::from_durations(&resets),
        top,
    ))
}

pub fn run(opts: &Options) -> anyhow::Result<Value> {
    anyhow::ensure!(
        opts.runs >= 2,
        "--runs must be at least 2 (a reset needs a child)"
    );
    let assets = Assets::prepare()?;
    let boot = |spec: &VmSpec| Vm::boot(&assets, spec).context("booting");
    // The same zygote without a disk: the baseline.
    let mut plain = boot(&VmSpec::default())?;
    plain.make_warm_zygote().context("the zygote")?;
    let (base_fork, base_reset, _) = measure(&plain, opts.runs, "no disk", false)?;
    drop(plain);
    let mut cases = Vec::new();
    for &volume_mib in &opts.volumes_mib {
        let volume = forkbox_host::volume::empty_ext4(volume_mib)?;
        for &written in &opts.written_mib {
            // ext4's own metadata (journal, inode tables) takes part of the
            // volume: as much data as the volume's size never fits.
            if u64::from(written) * 10 > u64::from(volume_mib) * 9 {
                let why = format!(
                    "{written} MiB of data do not fit the file system of a {volume_mib} MiB volume"
                );
                eprintln!("forkbox bench disk: skipped: {why}");
                cases.push(json!({
                    "volume_mib": volume_mib,
                    "written_mib": written,
                    "skipped": why,
                }));
                continue;
            }
            let spec = VmSpec {
                disks: vec![DiskSpec {
                    base: volume.clone(),
                    mount: "/data".into(),
                }],
                ..VmSpec::default()
            };
            let mut vm = boot(&spec)?;
            let t = Instant::now();
            run_ok(
                &vm,
                &format!("dd if=/dev/zero of=/data/w bs=1M count={written} 2>/dev/null && sync"),
            )?;
            let write_time = t.elapsed();
            // Guest RAM counted once: a page cache filled by the write is
            // the guest's RAM, not that and a copy.
            let rss_kib = forkbox_host::measure::rss_kib(vm.pid()).unwrap_or(0);
            vm.make_warm_zygote().context("the zygote")?;
            let held = unnamed_bytes(vm.pid()).first().copied().unwrap_or(0);
            let what = format!("volume {volume_mib} MiB, {written} MiB written");
            let (fork, reset, child_top) = measure(&vm, opts.runs, &what, true)?;
            cases.push(json!({
                "volume_mib": volume_mib,
                "written_mib": written,
                "write_s": round(write_time.as_secs_f64()),
                "vmm_rss_mib_after_write": round(rss_kib as f64 / 1024.0),
                "zygote_disk_host_bytes": held,
                "fork_first_exec": fork.json(),
                "reset": reset.json(),
                "fork_vs_no_disk_p50": round(fork.p50_ms / base_fork.p50_ms),
                "reset_vs_no_disk_p50": round(reset.p50_ms / base_reset.p50_ms),
                "child_top_host_bytes_after_1mib": child_top,
            }));
        }
    }
    Ok(json!({
        "environment": Environment::detect().label(),
        "no_disk": {"fork_first_exec": base_fork.json(), "reset": base_reset.json()},
        "cases": cases,
    }))
}

fn round(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}
