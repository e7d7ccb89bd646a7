//! `forkbox bench fork`: what a fork costs, against the baselines it
//! replaces, measured in one run in one environment.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::{calibrate, progress, Stats};
use anyhow::Context;
use forkbox_host::measure::{guest_clock, guest_pages_written_kib};
use forkbox_host::testbed::Environment;
use forkbox_host::vm::{in_order, Assets, ForkOptions, Vm, VmSpec};
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
    /// Whom the fan-out children's first exec runs as: `user` (the
    /// unprivileged user forkboxd runs sandboxes' commands as, in the
    /// bounded policy cgroup) or `root` (the agent's default).
    #[arg(long, default_value = forkbox_host::image::USER)]
    pub fanout_user: String,
    /// Zygotes do not learn a first command's pages for their children to
    /// map ahead: each child faults them in (the measurement's before).
    #[arg(long)]
    pub no_map_ahead: bool,
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

/// A fan-out child that answered its first exec (or why not), and when,
/// from the fork request.
type Answered = (anyhow::Result<Vm>, Duration);

fn first_exec(agent: &AgentClient) -> anyhow::Result<()> {
    first_exec_as(agent, None)
}

/// `true` as `user` (`None`: the agent's default, root).
fn first_exec_as(agent: &AgentClient, user: Option<&str>) -> anyhow::Result<()> {
    let mut req = ExecRequest::argv(["true"]);
    if let Some(user) = user {
        req = req.user(forkbox_proto::User::Name(user.into()));
    }
    let r = agent.exec(&req, None, &mut |_, _| {})?;
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

/// Kills a VM and waits until its VMM is gone, so that its teardown (tens
/// of ms) does not overlap the next sample. Taking the zygote sizes in
/// turns without this made each size pay for the teardown of the size
/// before it.
fn retire(mut vm: Vm) {
    vm.kill();
    let _ = vm.wait_exit(Duration::from_secs(30));
}

/// Boots a zygote-to-be and makes it a zygote after the warm-up command
/// (`sh -c true`), as the daemon's bake does: without it, each child's
/// first exec reads busybox from the image on its own (about 380 guest
/// pages, 1.5 MiB, per child); and, with `map_ahead`, learns what a
/// child's first command touches, for its children to map ahead.
fn zygote(assets: &Assets, memory_mib: u32, map_ahead: bool) -> anyhow::Result<(Vm, Value)> {
    let mut vm = boot(assets, memory_mib)?;
    let file = vm
        .make_warm_zygote_with(map_ahead)
        .context("making the zygote")?;
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    // The memory file every child shares, and how much of it is in 2 MiB
    // pages (which depends on the host: forkbox_host::hugepages).
    let file = json!({ "data_mib": mib(file.bytes), "huge_mib": mib(file.huge_bytes) });
    Ok((vm, file))
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
    let mut v = s.json();
    v["vmm_answer_p50_ms"] = json!(Stats::from_durations(&vmm).p50_ms);
    v["after_fork_hook_p50_ms"] = json!(Stats::from_durations(&hook).p50_ms);
    (s, v)
}

fn meminfo() -> anyhow::Result<std::collections::BTreeMap<String, u64>> {
    forkbox_host::measure::meminfo().context("reading /proc/meminfo")
}

/// `/proc/meminfo` counters reported per fan-out child: the children's
/// private pages (guest copies and VMM heap), the host page tables of
/// their guest-RAM mappings, KVM's nested page tables, kernel objects, and
/// the vmalloc'd memory behind each VM and vCPU (kernel stacks included).
const HOST_COUNTERS: &[&str] = &[
    "AnonPages",
    "PageTables",
    "SecPageTables",
    "Slab",
    "KernelStack",
    "VmallocUsed",
    "Shmem",
];

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

/// Puts one result in the report and echoes it on stderr at once, so a
/// run cut short (a crashed host, an interrupt) still leaves its finished
/// phases behind.
fn record(report: &mut serde_json::Map<String, Value>, key: &str, value: Value) {
    eprintln!("forkbox bench fork: {key} = {value}");
    report.insert(key.into(), value);
}

pub fn run(o: &Options) -> anyhow::Result<Value> {
    let env = Environment::detect();
    let assets = Assets::prepare()?;
    let mut report = serde_json::Map::new();
    report.insert("bench".into(), json!("fork"));
    report.insert("environment".into(), json!(env.label()));

    // 1. Zygote forks at each memory size, taken in turns (one fork per
    // size per round) so that drift in the host over the run (page cache,
    // an emulated host's load) weighs on every size alike.
    let snap_root = tempfile::tempdir()?;
    let mut zygotes = Vec::new();
    for &mib in &o.memory {
        let (zygote, file) = zygote(&assets, mib, !o.no_map_ahead)?;
        zygotes.push((mib, zygote, file, Vec::with_capacity(o.forks)));
    }
    for i in 0..o.forks {
        for (_, zygote, _, samples) in &mut zygotes {
            let (took, child) = fork_one(zygote)?;
            samples.push(took);
            retire(child);
        }
        progress("fork", "zygote forks (every size in turn)", i + 1, o.forks);
    }
    let mut per_size = Vec::new();
    let mut first_p50 = None;
    let mut baseline_zygote_dir = None;
    for (k, (mib, mut zygote, file, samples)) in zygotes.into_iter().enumerate() {
        let (s, mut v) = fork_stats_json(&samples);
        v["zygote_file"] = file;
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
    record(
        &mut report,
        "zygote_fork_to_first_exec",
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
    record(&mut report, "zygote_fork_p50_max_over_min", json!(flat));

    // 2. Baselines serving the same request.
    let fork_p50 = first_p50.unwrap_or(f64::NAN);
    if let Some((dir, mib)) = &baseline_zygote_dir {
        let mut samples = Vec::new();
        for i in 0..o.restore_runs {
            let t = Instant::now();
            let vm =
                Vm::restore(&assets, dir, None, None).context("restoring the baseline snapshot")?;
            first_exec(vm.agent())?;
            samples.push(t.elapsed());
            retire(vm);
            progress("fork", "restore baseline", i + 1, o.restore_runs);
        }
        let s = Stats::from_durations(&samples);
        let mut v = s.json();
        v["memory_mib"] = json!(mib);
        record(&mut report, "restore_per_rollout", v);
        record(
            &mut report,
            "restore_over_fork_p50",
            json!(s.p50_ms / fork_p50),
        );
        let mut samples = Vec::new();
        for i in 0..o.boot_runs {
            let t = Instant::now();
            let vm = boot(&assets, *mib)?;
            first_exec(vm.agent())?;
            samples.push(t.elapsed());
            retire(vm);
            progress("fork", "cold boot baseline", i + 1, o.boot_runs);
        }
        let s = Stats::from_durations(&samples);
        let mut v = s.json();
        v["memory_mib"] = json!(mib);
        record(&mut report, "cold_boot_per_rollout", v);
        record(
            &mut report,
            "boot_over_fork_p50",
            json!(s.p50_ms / fork_p50),
        );
    }

    // 3. Fan-out: N children of one zygote all answering an exec; host
    // memory added per idle child.
    if o.children > 0 {
        let mib = o.memory.first().copied().unwrap_or(512);
        eprintln!("forkbox bench fork: fan-out of {} children", o.children);
        let (zygote, file) = zygote(&assets, mib, !o.no_map_ahead)?;
        std::thread::sleep(Duration::from_secs(1));
        let before = meminfo()?;
        let t = Instant::now();
        // A child that fails (to come up or to answer) is counted and named,
        // not fatal: the report says how many of the N answered. Each runs
        // its first exec as soon as it is up, on the fork's own workers
        // (a bounded few, however wide the group), timed from the request.
        let done = AtomicUsize::new(0);
        let answered: Vec<Answered> = in_order(
            o.children,
            |_| (Err(anyhow::anyhow!("never given")), Duration::ZERO),
            |give| {
                zygote.fork_each(o.children, &ForkOptions::default(), &|i, child| {
                    let r = child.map_err(anyhow::Error::from).and_then(|c| {
                        first_exec_as(c.agent(), Some(&o.fanout_user))?;
                        Ok(c)
                    });
                    give(i, (r, t.elapsed()));
                    let n = done.fetch_add(1, Ordering::Relaxed) + 1;
                    progress("fork", "fan-out children up and answered", n, o.children);
                })
            },
        )?;
        let wall = t.elapsed();
        let mut children = Vec::new();
        let mut failures = Vec::new();
        let mut to_first_exec = Vec::new();
        for (i, (r, took)) in answered.into_iter().enumerate() {
            match r {
                Ok(c) => {
                    children.push(c);
                    to_first_exec.push(took);
                }
                Err(e) => failures.push(format!("child {i}: {e:#}")),
            }
        }
        let first_exec_ms = Stats::from_durations(&to_first_exec);
        for f in &failures {
            eprintln!("forkbox bench fork: fan-out {f}");
        }
        anyhow::ensure!(!children.is_empty(), "no fan-out child answered");
        std::thread::sleep(Duration::from_secs(2));
        let after = meminfo()?;
        let n = children.len() as f64;
        let added = |key: &str| {
            let (b, a) = (before.get(key), after.get(key));
            a.zip(b).map(|(a, b)| (*a as f64 - *b as f64) / n)
        };
        let per_child_kib = -added("MemAvailable").unwrap_or(f64::NAN);
        // Where it goes: the guest pages each child wrote since the fork
        // (its copy-on-write copies), and the host's own counters.
        let written: Vec<u64> = children
            .iter()
            .filter_map(|c| guest_pages_written_kib(c.pid()).ok())
            .collect();
        // KVM's own count of each child's nested-page faults and exits,
        // fork to now (its first exec and 2 s idle), where debugfs shows them.
        let kvm: Vec<_> = children
            .iter()
            .filter_map(|c| forkbox_host::measure::kvm_vm_counters(c.pid()))
            .collect();
        let per_child_kvm = if kvm.is_empty() {
            json!({"unread": "no KVM counters: debugfs is not mounted at /sys/kernel/debug"})
        } else {
            let mean = |k: &str| {
                kvm.iter()
                    .map(|c| c.get(k).copied().unwrap_or(0))
                    .sum::<u64>() as f64
                    / kvm.len() as f64
            };
            // `pf_taken`: faults the guest took; `pf_fixed` counts the
            // pages KVM mapped, ahead of the guest (pre-faulted) or not.
            json!({"children": kvm.len(), "pf_taken": mean("pf_taken"), "pf_fixed": mean("pf_fixed"), "exits": mean("exits")})
        };
        let mut where_kib = serde_json::Map::new();
        where_kib.insert(
            "guest_pages_written".into(),
            json!(written.iter().sum::<u64>() as f64 / written.len().max(1) as f64),
        );
        for key in HOST_COUNTERS {
            if let Some(d) = added(key) {
                where_kib.insert((*key).into(), json!(d));
            }
        }
        // What the kernel charges each child's own cgroup (it joins it
        // before it builds its VM): its KVM objects, page tables, VMM
        // heap and the guest pages it wrote, not what it shares.
        let charged: Vec<u64> = children
            .iter()
            .filter_map(|c| c.cgroup().and_then(|g| g.memory_current()))
            .collect();
        if !charged.is_empty() {
            where_kib.insert(
                "cgroup_charged".into(),
                json!(charged.iter().sum::<u64>() as f64 / charged.len() as f64 / 1024.0),
            );
        }
        record(
            &mut report,
            "fanout",
            json!({
                "children": o.children, "answered": children.len(), "failures": failures,
                "first_exec_user": o.fanout_user,
                "map_ahead": !o.no_map_ahead,
                "memory_mib": mib, "zygote_file": file,
                "wall_ms": wall.as_secs_f64() * 1000.0,
                "fork_to_first_exec_ms": {"p50": first_exec_ms.p50_ms, "p99": first_exec_ms.p99_ms, "max": first_exec_ms.max_ms},
                "vmm_answer_ms": children.first().and_then(|c| c.vmm_answered).map(|d| d.as_secs_f64() * 1000.0),
                "host_mem_per_idle_child_mib": per_child_kib / 1024.0,
                "per_idle_child_kib": where_kib,
                "per_child_kvm": per_child_kvm,
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
            retire(child);
            progress("fork", "dirty running forks", i + 1, o.dirty_forks);
        }
        let (_, mut v) = fork_stats_json(&samples);
        v["dirty_mib"] = json!(o.dirty_mib);
        v["memory_mib"] = json!(mib);
        record(&mut report, "running_dirty_fork_to_first_exec", v);
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
        let restored = Vm::restore(&assets, &dir, None, None).context("restore")?;
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
        record(
            &mut report,
            "snapshot",
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
