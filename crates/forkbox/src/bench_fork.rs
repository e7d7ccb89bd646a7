//! `forkbox bench fork`: what a fork costs, against the baselines it
//! replaces, measured in one run in one environment.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;
use forkbox::bench::{calibrate, guest_clock, progress, Stats};
use forkbox::testbed::Environment;
use forkbox::vm::{Assets, Vm, VmSpec};
use forkbox_proto::{AgentClient, ExecRequest};
use serde_json::{json, Value};

#[derive(clap::Args)]
pub struct Options {
    #[arg(long)]
    pub json: bool,
    /// Guest memory sizes (MiB) of the zygote-fork measurement.
    #[arg(long, value_delimiter = ',', default_value = "512,2048,8192")]
    pub memory: Vec<u32>,
    /// Forks per memory size.
    #[arg(long, default_value_t = 100)]
    pub forks: usize,
    /// "Restore a snapshot per rollout" runs (baseline).
    #[arg(long, default_value_t = 20)]
    pub restore_runs: usize,
    /// "Cold boot per rollout" runs (baseline).
    #[arg(long, default_value_t = 10)]
    pub boot_runs: usize,
    /// Children forked at once from one zygote (fan-out, memory per child).
    #[arg(long, default_value_t = 100)]
    pub children: usize,
    /// Dirty guest memory of the running sandbox that is forked (MiB).
    #[arg(long, default_value_t = 256)]
    pub dirty_mib: u32,
    /// Forks of the dirty running sandbox.
    #[arg(long, default_value_t = 100)]
    pub dirty_forks: usize,
    /// Guest memory of the snapshot measurement (MiB).
    #[arg(long, default_value_t = 2048)]
    pub snapshot_memory: u32,
    /// Guest memory in use (written) at the snapshot (MiB).
    #[arg(long, default_value_t = 300)]
    pub snapshot_used: u32,
    /// How old the snapshot is when it is restored (seconds).
    #[arg(long, default_value_t = 60)]
    pub snapshot_age: u64,
}

fn first_exec(agent: &AgentClient) -> anyhow::Result<()> {
    let r = agent.exec(&ExecRequest::argv(["true"]), None, &mut |_, _| {})?;
    anyhow::ensure!(r.success(), "`true` failed in the guest: {r:?}");
    Ok(())
}

fn sh(agent: &AgentClient, script: &str) -> anyhow::Result<String> {
    let mut out = Vec::new();
    let r = agent.exec(&ExecRequest::shell(script), None, &mut |_, b| {
        out.extend_from_slice(b)
    })?;
    anyhow::ensure!(r.success(), "`{script}` failed in the guest: {r:?}");
    Ok(String::from_utf8_lossy(&out).into_owned())
}

fn boot(assets: &Assets, memory_mib: u32) -> anyhow::Result<Vm> {
    let spec = VmSpec {
        memory_mib,
        ..VmSpec::default()
    };
    Vm::boot(assets, &spec).with_context(|| format!("booting a {memory_mib} MiB microVM"))
}

/// One fork, request → child's first exec result, split in phases.
struct ForkSample {
    total: Duration,
    /// Request → the VMM's answer (child listening).
    vmm: Duration,
    /// VMM answer → AfterFork answered (connect retries included).
    hook: Duration,
}

fn fork_one(parent: &mut Vm) -> anyhow::Result<(ForkSample, Vm)> {
    let t = Instant::now();
    let child = parent
        .fork(1)?
        .pop()
        .context("the VMM answered no child")??;
    first_exec(child.agent())?;
    let total = t.elapsed();
    let vmm = child.vmm_answered.unwrap_or_default();
    let sample = ForkSample {
        total,
        vmm,
        hook: child.boot_time.saturating_sub(vmm),
    };
    Ok((sample, child))
}

/// Stats of the total, plus the p50 of each phase.
fn fork_stats_json(samples: &[ForkSample]) -> (Stats, Value) {
    let total: Vec<Duration> = samples.iter().map(|s| s.total).collect();
    let vmm: Vec<Duration> = samples.iter().map(|s| s.vmm).collect();
    let hook: Vec<Duration> = samples.iter().map(|s| s.hook).collect();
    let s = Stats::from_durations(&total);
    let mut v = stats_json(&s);
    v["vmm_answer_p50_ms"] = json!(Stats::from_durations(&vmm).p50_ms);
    v["after_fork_hook_p50_ms"] = json!(Stats::from_durations(&hook).p50_ms);
    (s, v)
}

fn stats_json(s: &Stats) -> Value {
    json!({"runs": s.runs, "p50_ms": s.p50_ms, "p99_ms": s.p99_ms, "min_ms": s.min_ms, "max_ms": s.max_ms})
}

fn mem_available_kib() -> anyhow::Result<u64> {
    forkbox::bench::mem_available_kib().context("no MemAvailable in /proc/meminfo")
}

/// Writes `mib` MiB of incompressible, non-zero data into guest RAM
/// (tmpfs), from 1 MiB of urandom copied over.
fn dirty(agent: &AgentClient, mib: u32) -> anyhow::Result<()> {
    sh(
        agent,
        &format!(
            "mount -o remount,size=90% /dev/shm 2>/dev/null; \
             head -c 1048576 /dev/urandom > /dev/shm/seed && \
             i=0; while [ $i -lt {mib} ]; do cat /dev/shm/seed; i=$((i+1)); done > /dev/shm/dirty && \
             rm /dev/shm/seed"
        ),
    )?;
    Ok(())
}

pub fn run(o: &Options) -> anyhow::Result<Value> {
    let env = Environment::detect();
    let assets = Assets::prepare()?;
    let mut report = serde_json::Map::new();
    report.insert("bench".into(), json!("fork"));
    report.insert("environment".into(), json!(env.label()));

    // 1. Zygote forks at each memory size.
    let mut per_size = Vec::new();
    let mut first_p50 = None;
    let mut baseline_zygote_dir = None;
    let snap_root = tempfile::tempdir()?;
    for (k, &mib) in o.memory.iter().enumerate() {
        let mut zygote = boot(&assets, mib)?;
        zygote.make_zygote().context("making the zygote")?;
        let mut samples = Vec::with_capacity(o.forks);
        for i in 0..o.forks {
            let (took, child) = fork_one(&mut zygote)?;
            samples.push(took);
            drop(child);
            progress(
                "fork",
                &format!("zygote forks at {mib} MiB"),
                i + 1,
                o.forks,
            );
        }
        let (s, v) = fork_stats_json(&samples);
        if k == 0 {
            first_p50 = Some(s.p50_ms);
            // The restore baseline restores this same zygote.
            let dir = snap_root.path().join("baseline");
            zygote.snapshot(&dir).context("snapshot of the zygote")?;
            baseline_zygote_dir = Some((dir, mib));
        }
        per_size.push((mib, s, v));
    }
    let p50s: Vec<f64> = per_size.iter().map(|(_, s, _)| s.p50_ms).collect();
    let flat = p50s.iter().copied().fold(f64::MIN, f64::max)
        / p50s.iter().copied().fold(f64::MAX, f64::min);
    report.insert(
        "zygote_fork_to_first_exec".into(),
        Value::Array(
            per_size
                .iter()
                .map(|(mib, _, v)| {
                    let mut v = v.clone();
                    v["memory_mib"] = json!(mib);
                    v
                })
                .collect(),
        ),
    );
    report.insert("zygote_fork_p50_max_over_min".into(), json!(flat));

    // 2. Baselines serving the same request.
    let fork_p50 = first_p50.unwrap_or(f64::NAN);
    if let Some((dir, mib)) = &baseline_zygote_dir {
        let mut samples = Vec::new();
        for i in 0..o.restore_runs {
            let t = Instant::now();
            let vm = Vm::restore(&assets, dir).context("restoring the baseline snapshot")?;
            first_exec(vm.agent())?;
            samples.push(t.elapsed());
            drop(vm);
            progress("fork", "restore baseline", i + 1, o.restore_runs);
        }
        let s = Stats::from_durations(&samples);
        let mut v = stats_json(&s);
        v["memory_mib"] = json!(mib);
        report.insert("restore_per_rollout".into(), v);
        report.insert("restore_over_fork_p50".into(), json!(s.p50_ms / fork_p50));
        let mut samples = Vec::new();
        for i in 0..o.boot_runs {
            let t = Instant::now();
            let vm = boot(&assets, *mib)?;
            first_exec(vm.agent())?;
            samples.push(t.elapsed());
            drop(vm);
            progress("fork", "cold boot baseline", i + 1, o.boot_runs);
        }
        let s = Stats::from_durations(&samples);
        let mut v = stats_json(&s);
        v["memory_mib"] = json!(mib);
        report.insert("cold_boot_per_rollout".into(), v);
        report.insert("boot_over_fork_p50".into(), json!(s.p50_ms / fork_p50));
    }

    // 3. Fan-out: N children of one zygote all answering an exec; host
    // memory added per idle child.
    if o.children > 0 {
        let mib = o.memory.first().copied().unwrap_or(512);
        eprintln!("forkbox bench fork: fan-out of {} children", o.children);
        let mut zygote = boot(&assets, mib)?;
        zygote.make_zygote()?;
        std::thread::sleep(Duration::from_secs(1));
        let avail_before = mem_available_kib()?;
        let t = Instant::now();
        // A child that fails (to come up or to answer) is counted and named,
        // not fatal: the report says how many of the N answered.
        let forked = zygote.fork(o.children)?;
        let results: Vec<anyhow::Result<Vm>> = std::thread::scope(|scope| {
            let hs: Vec<_> = forked
                .into_iter()
                .map(|c| {
                    scope.spawn(|| {
                        let c = c?;
                        first_exec(c.agent())?;
                        Ok(c)
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(anyhow::anyhow!("panicked")))
                })
                .collect()
        });
        let wall = t.elapsed();
        let mut children = Vec::new();
        let mut failures = Vec::new();
        for (i, r) in results.into_iter().enumerate() {
            match r {
                Ok(c) => children.push(c),
                Err(e) => failures.push(format!("child {i}: {e:#}")),
            }
        }
        for f in &failures {
            eprintln!("forkbox bench fork: fan-out {f}");
        }
        anyhow::ensure!(!children.is_empty(), "no fan-out child answered");
        std::thread::sleep(Duration::from_secs(2));
        let avail_after = mem_available_kib()?;
        let per_child_kib = avail_before.saturating_sub(avail_after) as f64 / children.len() as f64;
        report.insert(
            "fanout".into(),
            json!({
                "children": o.children, "answered": children.len(), "failures": failures,
                "memory_mib": mib,
                "wall_ms": wall.as_secs_f64() * 1000.0,
                "vmm_answer_ms": children.first().and_then(|c| c.vmm_answered).map(|d| d.as_secs_f64() * 1000.0),
                "host_mem_per_idle_child_mib": per_child_kib / 1024.0,
            }),
        );
        drop(children);
    }

    // 4. Fork of a running sandbox with dirty memory.
    if o.dirty_forks > 0 {
        let mib = (o.dirty_mib * 2 + 512).max(1024);
        let mut vm = boot(&assets, mib)?;
        dirty(vm.agent(), o.dirty_mib)?;
        let mut samples = Vec::new();
        for i in 0..o.dirty_forks {
            let (took, child) = fork_one(&mut vm)?;
            samples.push(took);
            drop(child);
            progress("fork", "dirty running forks", i + 1, o.dirty_forks);
        }
        let (_, mut v) = fork_stats_json(&samples);
        v["dirty_mib"] = json!(o.dirty_mib);
        v["memory_mib"] = json!(mib);
        report.insert("running_dirty_fork_to_first_exec".into(), v);
    }

    // 5. Snapshot of a big guest with some memory in use; restore.
    if o.snapshot_memory > 0 {
        eprintln!(
            "forkbox bench fork: snapshot of a {} MiB guest with {} MiB in use",
            o.snapshot_memory, o.snapshot_used
        );
        let mut vm = boot(&assets, o.snapshot_memory)?;
        dirty(vm.agent(), o.snapshot_used)?;
        let dir = snap_root.path().join("big");
        let t = Instant::now();
        let bytes = vm.snapshot(&dir).context("snapshot")?;
        let snapshot_ms = t.elapsed().as_secs_f64() * 1000.0;
        drop(vm);
        let on_disk = du_bytes(&dir);
        if o.snapshot_age > 0 {
            eprintln!(
                "forkbox bench fork: letting the snapshot age {} s",
                o.snapshot_age
            );
        }
        std::thread::sleep(Duration::from_secs(o.snapshot_age));
        let t = Instant::now();
        let restored = Vm::restore(&assets, &dir).context("restore")?;
        first_exec(restored.agent())?;
        let restore_ms = t.elapsed().as_secs_f64() * 1000.0;
        let host_before = unix_now();
        let guest = guest_clock(restored.agent())?;
        let host_after = unix_now();
        // The guest read its clock somewhere in the host's interval: only
        // a reading outside it is an offset.
        let off_after = if guest < host_before {
            guest - host_before
        } else {
            (guest - host_after).max(0.0)
        };
        let offset_before_hook = restored
            .after_fork
            .as_ref()
            .map_or(f64::NAN, |r| r.clock_offset_ns as f64 / 1e9);
        let still_there = sh(restored.agent(), "wc -c < /dev/shm/dirty")?;
        report.insert(
            "snapshot".into(),
            json!({
                "memory_mib": o.snapshot_memory, "used_mib": o.snapshot_used,
                "snapshot_ms": snapshot_ms, "bytes_written": bytes, "bytes_on_disk": on_disk,
                "age_s": o.snapshot_age,
                "restore_to_first_exec_ms": restore_ms,
                "guest_clock_off_before_hook_s": offset_before_hook,
                "guest_clock_off_after_restore_s": off_after,
                "guest_clock_read_window_s": host_after - host_before,
                "dirty_file_bytes_after_restore": still_there.trim().parse::<u64>().unwrap_or(0),
            }),
        );
    }

    let c = calibrate();
    report.insert("loop_ns_per_iter".into(), json!(c.loop_ns_per_iter));
    report.insert("fork_exec_us".into(), json!(c.fork_exec_us));
    report.insert(
        "zygote_fork_p50_in_fork_execs".into(),
        json!(fork_p50 * 1000.0 / c.fork_exec_us),
    );
    Ok(Value::Object(report))
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Allocated bytes of the files under `dir` (sparse files count what they
/// hold, not their length).
fn du_bytes(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(Result::ok)
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.blocks() * 512)
                .sum()
        })
        .unwrap_or(0)
}
