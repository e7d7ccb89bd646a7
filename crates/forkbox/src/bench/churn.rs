//! `forkbox bench churn`: fork → exec → kill cycles, several at once, from a
//! zygote and from running parents, as a training run makes them. Reports
//! each phase's percentiles, the children lost by cause (a replaced child
//! counts: it was lost once), and what is left afterwards that was not
//! there before (VMM processes, this process's descriptors, VM
//! directories, host memory).

use std::collections::BTreeMap;
use std::ops::ControlFlow;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::Stats;
use anyhow::Context;
use forkbox_host::measure::{exited, mem_available_kib};
use forkbox_host::poll::{self, TimedOut};
use forkbox_host::testbed::Environment;
use forkbox_host::vm::{Assets, Vm, VmSpec};
use forkbox_proto::ExecRequest;
use serde_json::{json, Value};

#[derive(clap::Args)]
pub struct Options {
    #[arg(long)]
    pub json: bool,
    /// Cycles in all; each forks one child, runs one command in it and
    /// kills it.
    #[arg(long, default_value_t = 1000)]
    pub cycles: usize,
    /// Cycles under way at once: half of the workers fork the shared
    /// zygote, the other half each its own running parent.
    #[arg(long, default_value_t = 4)]
    pub concurrency: usize,
}

/// How one cycle went.
#[derive(Default)]
struct Tally {
    fork: Vec<Duration>,
    exec: Vec<Duration>,
    kill: Vec<Duration>,
    /// Children lost, by cause; a replaced child is counted here too.
    lost: BTreeMap<String, usize>,
    done: usize,
}

/// A lost child's cause, by signature.
fn cause(text: &str) -> String {
    forkbox_host::vm::loss_signature(text).to_owned()
}

/// What the host holds that a leak would grow.
#[derive(Debug, Clone)]
struct Held {
    vmm_processes: usize,
    fds: usize,
    /// VM directories in the temporary directory, by name.
    vm_dirs: Vec<String>,
    /// VMMs' cgroups (named after their directories), where VMMs get them.
    cgroups: Vec<String>,
    mem_available_kib: u64,
}

impl Held {
    fn now() -> Self {
        let vmm_processes = std::fs::read_dir("/proc")
            .map(|d| {
                d.flatten()
                    .filter(|e| {
                        std::fs::read_to_string(e.path().join("comm"))
                            .is_ok_and(|c| c.trim() == "forkbox-vmm")
                    })
                    .filter(|e| {
                        // A zombie is gone but not yet reaped: not held.
                        let pid = e.file_name().to_str().and_then(|n| n.parse().ok());
                        pid.is_some_and(|pid| !exited(pid))
                    })
                    .count()
            })
            .unwrap_or(0);
        let fds = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count());
        // VM directories, and VMMs' cgroups named after them.
        let vm_names_in = |dir: &Path| -> Vec<String> {
            std::fs::read_dir(dir)
                .map(|d| {
                    d.flatten()
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .filter(|name| is_vm_dir(name))
                        .collect()
                })
                .unwrap_or_default()
        };
        let vm_dirs = vm_names_in(&std::env::temp_dir());
        let cgroups = forkbox_host::cgroup::hierarchy()
            .map(|h| vm_names_in(h.dir()))
            .unwrap_or_default();
        Self {
            vmm_processes,
            fds,
            vm_dirs,
            cgroups,
            mem_available_kib: mem_available_kib().unwrap_or(0),
        }
    }
}

/// A VM's own directory (`forkbox-fork-XXXXXX`, `forkbox-vm-XXXXXX`), not
/// another tool's that shares the prefix (the VM suite's
/// `forkbox-vm-tests-XXXXXX`, which an emulated host sees appear on the
/// machine's live `/tmp`).
fn is_vm_dir(name: &str) -> bool {
    ["forkbox-fork-", "forkbox-vm-"].iter().any(|prefix| {
        name.strip_prefix(prefix)
            .is_some_and(|rest| rest.len() == 6 && rest.chars().all(|c| c.is_ascii_alphanumeric()))
    })
}

/// Waits for a killed VMM's process to be gone (exited: a zombie counts).
fn wait_gone(pid: u32, limit: Duration) -> bool {
    poll::holds_by(Instant::now() + limit, Duration::from_millis(1), || {
        exited(pid)
    })
}

/// One cycle from `source`: fork, exec, kill.
fn cycle(source: &Vm, i: usize, tally: &Mutex<Tally>) {
    let record =
        |f: &mut dyn FnMut(&mut Tally)| f(&mut tally.lock().unwrap_or_else(|p| p.into_inner()));
    let t = Instant::now();
    let child = match source.fork(1).map(|mut c| c.pop()) {
        Ok(Some(Ok(child))) => child,
        Ok(Some(Err(e))) => {
            let text = format!("{e:#}");
            record(&mut |t| *t.lost.entry(cause(&text)).or_default() += 1);
            eprintln!("forkbox bench churn: cycle {i}: child lost: {text}");
            return;
        }
        Ok(None) => {
            record(&mut |t| *t.lost.entry("no child in the answer".into()).or_default() += 1);
            return;
        }
        Err(e) => {
            let text = format!("{e:#}");
            record(&mut |t| {
                *t.lost
                    .entry(format!("fork request failed: {}", cause(&text)))
                    .or_default() += 1
            });
            eprintln!("forkbox bench churn: cycle {i}: fork request failed: {text}");
            return;
        }
    };
    let forked = t.elapsed();
    if let Some(why) = &child.replaced {
        record(&mut |t| {
            *t.lost
                .entry(format!("replaced: {}", cause(why)))
                .or_default() += 1
        });
        eprintln!("forkbox bench churn: cycle {i}: a child was lost and replaced: {why}");
    }
    let t = Instant::now();
    let mut out = Vec::new();
    let r = child.agent().exec(
        &ExecRequest::shell(format!("echo {i}")),
        None,
        &mut |_, b| out.extend_from_slice(b),
    );
    let exec = t.elapsed();
    let answered = matches!(&r, Ok(r) if r.success()) && out == format!("{i}\n").as_bytes();
    if !answered {
        let text = format!("{r:?} {:?}", String::from_utf8_lossy(&out));
        eprintln!("forkbox bench churn: cycle {i}: the child's exec failed: {text}");
        record(&mut |t| *t.lost.entry("exec failed".into()).or_default() += 1);
    }
    let pid = child.pid();
    let t = Instant::now();
    drop(child);
    let gone = wait_gone(pid, Duration::from_secs(30));
    let kill = t.elapsed();
    record(&mut |t| {
        t.fork.push(forked);
        t.exec.push(exec);
        if gone {
            t.kill.push(kill);
        } else {
            *t.lost
                .entry("VMM not gone 30 s after its kill".into())
                .or_default() += 1;
        }
        t.done += 1;
    });
}

pub fn run(o: &Options) -> anyhow::Result<Value> {
    let env = Environment::detect();
    let assets = Assets::prepare().context("preparing the guest kernel and initramfs")?;
    let workers = o.concurrency.max(1);
    let before = Held::now();
    eprintln!(
        "forkbox bench churn: booting a zygote and {} running parent(s)",
        workers / 2
    );
    let mut zygote = Vm::boot(&assets, &VmSpec::default()).context("booting the zygote")?;
    zygote.make_warm_zygote().context("making the zygote")?;
    let parents: Vec<Vm> = (0..workers / 2)
        .map(|_| Vm::boot(&assets, &VmSpec::default()))
        .collect::<Result<_, _>>()
        .context("booting a running parent")?;
    let tally = Mutex::new(Tally::default());
    let next = AtomicUsize::new(0);
    let started = Instant::now();
    std::thread::scope(|scope| {
        for w in 0..workers {
            // Workers 0, 2, 4, ... fork the zygote; 1, 3, 5, ... their own
            // running parent (a running parent is paused while it forks).
            let source = if w % 2 == 0 || parents.is_empty() {
                &zygote
            } else {
                &parents[(w / 2) % parents.len()]
            };
            let (tally, next) = (&tally, &next);
            scope.spawn(move || loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= o.cycles {
                    break;
                }
                cycle(source, i, tally);
                let done = tally.lock().map_or(0, |t| t.done);
                if done % 50 == 0 || done == o.cycles {
                    eprintln!(
                        "forkbox bench churn: {done}/{} cycles, {:.0} s",
                        o.cycles,
                        started.elapsed().as_secs_f64()
                    );
                }
            });
        }
    });
    let wall = started.elapsed();
    drop(parents);
    drop(zygote);
    // Give the background reapers their time (a pidfd is held until its
    // VMM has exited), then count what is left: a leak is what is still
    // there after 30 s.
    let settle = Instant::now() + Duration::from_secs(30);
    let mut after = poll::until(settle, Duration::from_millis(200), || {
        let now = Held::now();
        if now.vmm_processes > before.vmm_processes
            || now.fds > before.fds
            || now.vm_dirs.iter().any(|d| !before.vm_dirs.contains(d))
            || now.cgroups.iter().any(|c| !before.cgroups.contains(c))
        {
            ControlFlow::Continue(now)
        } else {
            ControlFlow::Break(now)
        }
    })
    .unwrap_or_else(|TimedOut(last)| last);
    // Memory comes back as the last VMMs finish exiting: read it after.
    std::thread::sleep(Duration::from_secs(2));
    after.mem_available_kib = mem_available_kib().unwrap_or(0);
    // What a leaked directory holds says who left it.
    let leaked_dirs: Vec<String> = after
        .vm_dirs
        .iter()
        .filter(|d| !before.vm_dirs.contains(d))
        .map(|d| {
            let files: Vec<String> = std::fs::read_dir(std::env::temp_dir().join(d))
                .map(|r| {
                    r.flatten()
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .collect()
                })
                .unwrap_or_default();
            format!("{d}: [{}]", files.join(", "))
        })
        .collect();
    let leaked_cgroups: Vec<&String> = after
        .cgroups
        .iter()
        .filter(|c| !before.cgroups.contains(c))
        .collect();
    let tally = tally.into_inner().unwrap_or_else(|p| p.into_inner());
    let lost: usize = tally.lost.values().sum();
    let stats =
        |d: &[Duration]| serde_json::to_value(Stats::from_durations(d)).unwrap_or(Value::Null);
    Ok(json!({
        "bench": "churn",
        "environment": env.label(),
        "cycles": o.cycles,
        "cycles_done": tally.done,
        "concurrency": workers,
        "sources": format!("1 zygote ({} workers), {} running parents (one worker each)", workers.div_ceil(2), workers / 2),
        "wall_s": wall.as_secs_f64(),
        "fork_ms": stats(&tally.fork),
        "exec_ms": stats(&tally.exec),
        "kill_ms": stats(&tally.kill),
        "lost_children": lost,
        "lost_by_cause": tally.lost,
        "leaks": {
            "vmm_processes": after.vmm_processes as i64 - before.vmm_processes as i64,
            "fds": after.fds as i64 - before.fds as i64,
            "vm_dirs": leaked_dirs.len(),
            "vm_dirs_left": leaked_dirs,
            "cgroups": leaked_cgroups.len(),
            "cgroups_left": leaked_cgroups,
            "mem_available_kib_drop": before.mem_available_kib as i64 - after.mem_available_kib as i64,
        },
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vm_dir_is_a_vms_own_not_a_suites() {
        assert!(is_vm_dir("forkbox-fork-a1B2c3"));
        assert!(is_vm_dir("forkbox-vm-Zz9yx8"));
        assert!(!is_vm_dir("forkbox-vm-tests-t4VdNQ"));
        assert!(!is_vm_dir("forkbox-testbed-DBxC3o"));
    }
}
