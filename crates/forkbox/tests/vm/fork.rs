//! VM trials of forking: zygote and running-parent forks, what children
//! inherit and what they do not, the capture's exactness (SMP under IPI
//! load, the memory pattern, the clocks, the LAPIC), lost children
//! replaced, snapshot and restore, and `forkbox run --fork`.

use super::*;

/// `forkbox run --fork 3`, the CLI's whole path (boot, warm-up, zygote,
/// fork, the command in every child at once): each child's output comes
/// prefixed with its index, each child is its own machine (its own kernel
/// UUID), and the exit code is the failing children's.
pub(crate) fn fork_cli_runs_the_command_in_every_child() -> TestResult {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_forkbox"))
        .args(["run", "--fork", "3", "--", "sh", "-c"])
        .arg("echo hello $(cat /proc/sys/kernel/random/uuid); exit 3")
        .output()
        .map_err(|e| format!("starting forkbox: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let what = format!(
        "{:?}; stdout {stdout:?}; stderr {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let mut lines: Vec<(&str, &str)> = stdout
        .lines()
        .filter_map(|l| l.split_once(" hello "))
        .collect();
    lines.sort();
    let indices: Vec<&str> = lines.iter().map(|(i, _)| *i).collect();
    check(indices == ["[0]", "[1]", "[2]"], what.clone())?;
    let uuids: std::collections::BTreeSet<&str> = lines.iter().map(|(_, u)| *u).collect();
    check(
        uuids.len() == 3,
        format!("kernel UUIDs not distinct: {what}"),
    )?;
    check(out.status.code() == Some(3), what)
}

pub(crate) fn fork_running_processes_continue_in_parent_and_children() -> TestResult {
    let mut parent = boot(VmSpec::default());
    sh(parent.agent(), BACKGROUND)?;
    background_alive(parent.agent(), "parent before the fork")?;
    let children = fork(&mut parent, 2)?;
    background_alive(parent.agent(), "parent after the fork")?;
    for (i, c) in children.iter().enumerate() {
        background_alive(c.agent(), &format!("child {i}"))?;
    }
    Ok(())
}

pub(crate) fn fork_children_diverge_from_each_other_and_parent() -> TestResult {
    let mut parent = boot(VmSpec::default());
    sh(parent.agent(), "echo parent > /dev/shm/mem")?;
    let children = fork(&mut parent, 2)?;
    let (a, b) = (children[0].agent(), children[1].agent());
    sh(a, "echo a > /tmp/only-a; echo child-a > /dev/shm/mem")?;
    sh(b, "echo child-b > /dev/shm/mem")?;
    sh(parent.agent(), "echo p > /tmp/only-parent")?;
    let probe =
        "for f in /tmp/only-a /tmp/only-parent; do [ -e $f ] && echo $f; done; cat /dev/shm/mem";
    check(sh(a, probe)? == "/tmp/only-a\nchild-a\n", "child a's view")?;
    let got = sh(b, probe)?;
    check(got == "child-b\n", format!("child b's view: {got:?}"))?;
    let got = sh(parent.agent(), probe)?;
    check(
        got == "/tmp/only-parent\nparent\n",
        format!("parent's view: {got:?}"),
    )
}

pub(crate) fn fork_zygote_16_children_answer_with_distinct_randomness() -> TestResult {
    // `debian` has python3, so the children's `uuid.uuid4()` is checked too.
    let mut zygote = boot(VmSpec {
        image: ImageName::Debian.into(),
        ..VmSpec::default()
    });
    // The parent's RNG is initialised and has produced output already.
    sh(zygote.agent(), "head -c 16 /dev/urandom >/dev/null")?;
    zygote.make_zygote().map_err(|e| format!("{e:#}"))?;
    let children = fork(&mut zygote, 16)?;
    let mut seen = std::collections::HashSet::new();
    for (i, c) in children.iter().enumerate() {
        let report = c.after_fork.as_ref().ok_or("no after-fork report")?;
        check(
            report.rng.is_done() && report.clock.is_done(),
            format!("child {i}: {report:?}"),
        )?;
        let out = sh(
            c.agent(),
            &format!(
                "echo {i}; head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'; echo; \
                 cat /proc/sys/kernel/random/uuid; python3 -c 'import uuid; print(uuid.uuid4())'"
            ),
        )?;
        let lines: Vec<&str> = out.lines().collect();
        check(
            lines.len() == 4 && lines[0] == i.to_string(),
            format!("child {i}: {out:?}"),
        )?;
        for (what, value) in ["urandom", "kernel uuid", "uuid4()"]
            .iter()
            .zip(&lines[1..])
        {
            check(
                seen.insert(value.to_string()),
                format!("child {i} repeats its {what} {value}"),
            )?;
        }
    }
    Ok(())
}

pub(crate) fn fork_zygote_dense_memory_is_in_huge_pages() -> TestResult {
    use forkbox_host::hugepages::{selected, SHMEM_ENABLED};
    const HUGE: u64 = 2 << 20;
    let mut zygote = boot(VmSpec::default());
    // Booting turned `never` into `advise` (forkbox_host::hugepages), and
    // the emulated host's init sets `advise` itself. A host where memfds
    // still cannot have huge pages cannot show what this trial checks:
    // it fails saying what the host lacks, never passes unchecked.
    let text = std::fs::read_to_string(SHMEM_ENABLED).map_err(|e| {
        format!(
            "this host's kernel has no {SHMEM_ENABLED} ({e}): without transparent huge \
             pages for shared memory, zygote memory cannot be in 2 MiB pages"
        )
    })?;
    match selected(&text) {
        Some("never") => {
            return Err(format!(
                "{SHMEM_ENABLED} is still `never` after a VMM booted: forkbox could not \
                 set `advise` (as root: echo advise > {SHMEM_ENABLED})"
            )
            .into())
        }
        Some("deny") => {
            return Err(format!(
                "{SHMEM_ENABLED} is `deny` on this host, which keeps huge pages from \
                 forkbox; this trial needs `advise` (as root: echo advise > {SHMEM_ENABLED})"
            )
            .into())
        }
        Some(_) => {}
        None => return Err(format!("cannot read the setting of {SHMEM_ENABLED}: {text:?}").into()),
    }
    let file = zygote.make_warm_zygote().map_err(|e| format!("{e:#}"))?;
    check(
        file.bytes > 0
            && file.huge_bytes >= HUGE
            && file.huge_bytes <= 512 << 20
            && file.huge_bytes % HUGE == 0,
        format!(
            "zygote memory file, with {SHMEM_ENABLED} {:?}: {file:?}",
            selected(&text)
        ),
    )?;
    let child = fork(&mut zygote, 1)?.pop().ok_or("no child")?;
    check(sh(child.agent(), "echo up")? == "up\n", "the child answers")?;
    // A child maps guest RAM at 2 MiB boundaries of address and file, so
    // that a huge page of the file can be mapped whole.
    let maps = std::fs::read_to_string(format!("/proc/{}/maps", child.pid()))
        .map_err(|e| format!("the child's maps: {e}"))?;
    let ram: Vec<&str> = maps
        .lines()
        .filter(|l| l.contains("memfd:forkbox-zygote-ram"))
        .collect();
    check(!ram.is_empty(), "the child maps no zygote memory")?;
    for line in ram {
        let mut f = line.split_whitespace();
        let start = f.next().and_then(|r| r.split_once('-')).map(|(a, _)| a);
        let offset = f.nth(1);
        let parse = |v: Option<&str>| v.and_then(|v| u64::from_str_radix(v, 16).ok());
        let (Some(start), Some(offset)) = (parse(start), parse(offset)) else {
            return Err(format!("cannot parse {line:?}").into());
        };
        check(
            start % HUGE == 0 && offset % HUGE == 0,
            format!("guest RAM not 2 MiB aligned: {line}"),
        )?;
    }
    Ok(())
}

/// Issue 20: a zygote learns the pages a child's first command touches,
/// and its later children map them before their guest runs. Every page
/// the learning child wrote is the next child's own copy as soon as it is
/// up, before any command; and where the host's KVM pre-faults (Linux
/// 6.10+, `KVM_CAP_PRE_FAULT_MEMORY`), that child's guest takes under a
/// third of the nested-page faults (KVM's `pf_taken`) that a child of the
/// same zygote without the set takes for the same first command (measured
/// in the emulated host on 6.12: 43.5 against 1,481.6, docs/SPEC.md).
pub(crate) fn fork_zygote_children_map_a_first_commands_pages_ahead() -> TestResult {
    let mut zygote = boot(VmSpec::default());
    zygote
        .make_warm_zygote_with(false)
        .map_err(|e| format!("{e:#}"))?;
    let first_command = |child: &Vm| -> Result<u64, Failed> {
        let req = ExecRequest::argv(["true"])
            .user(forkbox_proto::User::Name(forkbox_host::image::USER.into()));
        let (r, _, err) = exec(child.agent(), &req);
        check(r.success(), format!("`true` as user: {r:?} {err:?}"))?;
        let counters = forkbox_host::measure::kvm_vm_counters(child.pid()).ok_or(
            "no KVM counters for the child: mount debugfs (mount -t debugfs debugfs /sys/kernel/debug)",
        )?;
        Ok(counters
            .get("pf_taken")
            .copied()
            .ok_or("this KVM keeps no pf_taken")?)
    };
    let plain = fork(&mut zygote, 1)?.pop().ok_or("no child")?;
    let plain_faults = first_command(&plain)?;
    drop(plain);
    let set = zygote
        .learn_working_set()
        .map_err(|e| format!("learning the working set: {e:#}"))?;
    let (written, read) = set.pages();
    eprintln!(
        "working set: {written} pages written, {read} read, in {} ranges",
        set.written.len() + set.read.len()
    );
    check(
        written > 0 && read > 0,
        format!("a first command touched nothing: {set:?}"),
    )?;
    let child = fork(&mut zygote, 1)?.pop().ok_or("no child")?;
    let own = forkbox_host::measure::guest_pages(child.pid())
        .map_err(|e| format!("the child's pagemap: {e}"))?
        .written;
    let missing: Vec<u64> = set
        .written
        .iter()
        .flat_map(|&[first, count]| first..first + count)
        .filter(|p| !own.contains(p))
        .collect();
    check(
        missing.is_empty(),
        format!(
            "{} learned pages are not the new child's own copies: {:?}",
            missing.len(),
            &missing[..missing.len().min(16)]
        ),
    )?;
    let faults = first_command(&child)?;
    let kvm = kvm_ioctls::Kvm::new().map_err(|e| format!("/dev/kvm: {e}"))?;
    let pre_faults = kvm.check_extension_raw(kvm_bindings::KVM_CAP_PRE_FAULT_MEMORY.into()) > 0;
    eprintln!("nested-page faults the guest took for fork and first command: {plain_faults} without the set, {faults} with it (KVM pre-faults: {pre_faults})");
    if pre_faults {
        check(
            faults * 3 < plain_faults,
            format!("with the set the child took {faults} faults, without it {plain_faults}"),
        )?;
    }
    Ok(())
}

pub(crate) fn fork_64_children_of_a_running_parent_all_answer_an_exec() -> TestResult {
    let mut parent = boot(VmSpec::default());
    sh(parent.agent(), "echo before > /tmp/mark")?;
    // Eight fork requests of 8, each wave exec'ing at once, all 64 alive
    // to the end. Not all 64 in one burst: under that load the emulated
    // host's own kernel crashed (twice in one fresh-clone run) and about
    // one guest in a hundred triple-faults there (docs/SPEC.md, known
    // problems; waves of 16 still lost one child in two fresh-clone
    // runs); `forkbox bench fork` measures the burst (100 at once).
    let mut children = Vec::new();
    let mut answers: Vec<Result<String, Failed>> = Vec::new();
    for _wave in 0..8 {
        let wave = fork(&mut parent, 8)?;
        let first = children.len();
        answers.extend(std::thread::scope(|s| {
            let running: Vec<_> = wave
                .iter()
                .enumerate()
                .map(|(k, c)| {
                    let i = first + k;
                    s.spawn(move || sh(c.agent(), &format!("cat /tmp/mark; echo {i}")))
                })
                .collect();
            running
                .into_iter()
                .map(|t| {
                    t.join()
                        .unwrap_or_else(|_| Err("exec thread panicked".into()))
                })
                .collect::<Vec<_>>()
        }));
        children.extend(wave);
    }
    for (i, answer) in answers.into_iter().enumerate() {
        let out = answer.map_err(|e| format!("child {i}: {}", e.message().unwrap_or_default()))?;
        check(
            out == format!("before\n{i}\n"),
            format!("child {i} answered {out:?}"),
        )?;
    }
    let out = sh(parent.agent(), "cat /tmp/mark")?;
    check(out == "before\n", format!("the parent answered {out:?}"))
}

/// DESIGN.md, fork step 1: every vCPU parks before any is captured. A
/// 2-vCPU guest busy with cross-CPU wake-ups (bursts through a pipe between
/// two processes and short-lived processes: reschedule and TLB shootdown
/// IPIs; bursts, not a flat-out loop, which every child inherits) is forked
/// 200 times while it runs; a child whose state lost an IPI in flight would
/// hang, so every one must answer, within two minutes.
pub(crate) fn fork_smp_ipi_load_200_children_all_answer() -> TestResult {
    let mut parent = boot(VmSpec {
        vcpus: 2,
        ..VmSpec::default()
    });
    answer_within(
        &parent,
        "(while :; do yes | head -c 20000 > /dev/null; /bin/true; sleep 0.05; done) >/dev/null 2>&1 & echo started",
        Duration::from_secs(300),
    )?;
    for wave in 0..25 {
        let children = fork(&mut parent, 8)?;
        let answers: Vec<Result<String, Failed>> = std::thread::scope(|s| {
            let running: Vec<_> = children
                .iter()
                .map(|c| {
                    s.spawn(move || {
                        answer_within(
                            c,
                            "echo $(( $(grep -c ^processor /proc/cpuinfo) ))",
                            Duration::from_secs(120),
                        )
                    })
                })
                .collect();
            running
                .into_iter()
                .map(|t| {
                    t.join()
                        .unwrap_or_else(|_| Err("exec thread panicked".into()))
                })
                .collect()
        });
        for (k, a) in answers.into_iter().enumerate() {
            let out = a.map_err(|e| {
                format!(
                    "wave {wave}, child {k}: {}",
                    e.message().unwrap_or_default()
                )
            })?;
            check(
                out == "2\n",
                format!("wave {wave}, child {k} answered {out:?}"),
            )?;
        }
    }
    let out = answer_within(&parent, "echo alive", Duration::from_secs(300))?;
    check(out == "alive\n", format!("the parent answered {out:?}"))
}

/// DESIGN.md, fork: a child is a copy of one instant of its parent, and the
/// two never share a write. A running parent's pattern writer (see
/// [`forkbox_host::isolation`]) is forked while it writes; every child's copy must
/// be one instant of it, each child then marks all its pages, and the
/// parent's memory must stay its own. Then the same from the parent paused.
pub(crate) fn fork_memory_pattern_is_one_instant_in_children_never_in_parent() -> TestResult {
    use forkbox_host::isolation::{mark, start_writer, verdict};
    let mut parent = boot(VmSpec {
        image: ImageName::Debian.into(),
        ..VmSpec::default()
    });
    let agent = parent.agent().clone();
    start_writer(&agent)?;
    let mut checked = 0;
    for (round, paused) in [(0, false), (1, false), (2, true)] {
        if paused {
            parent.pause().map_err(|e| format!("pause: {e:#}"))?;
        }
        let mut children = fork(&mut parent, 4)?;
        if paused {
            parent.resume().map_err(|e| format!("resume: {e:#}"))?;
        }
        for (i, child) in children.iter_mut().enumerate() {
            // A child whose agent fails says what became of its guest.
            let v = verdict(child.agent())
                .map_err(|e| format!("round {round}, child {i}: {e}\n{}", child.post_mortem()))?;
            check(
                v.is_consistent(),
                format!("round {round} (parent paused: {paused}), child {i}: {v:?}"),
            )?;
            mark(child.agent())
                .map_err(|e| format!("round {round}, child {i}: {e}\n{}", child.post_mortem()))?;
            checked += 1;
        }
        let v = verdict(&agent)
            .map_err(|e| format!("round {round}, the parent: {e}\n{}", parent.post_mortem()))?;
        check(
            v.is_consistent(),
            format!("round {round}: the parent after its children marked their memory: {v:?}"),
        )?;
    }
    check(checked == 12, format!("{checked} children checked"))
}

/// A fork request is never held by one child: the first child of this
/// parent comes up with its vCPUs parked (the VMM's test hook), never
/// answers `AfterFork`, and is replaced by a new child of the same instant
/// after the bounded wait; the replacement says why, with where the lost
/// child's vCPUs were, and works.
pub(crate) fn fork_child_that_hangs_is_replaced_and_says_where_it_was() -> TestResult {
    let parent = boot(VmSpec {
        vmm_env: vec![
            ("FORKBOX_VMM_TEST_HANG_CHILD".into(), "1".into()),
            // The hung one's replacement is the 2nd; the next fork's
            // child, the 3rd, fails to come up.
            ("FORKBOX_VMM_TEST_FAIL_CHILD".into(), "3".into()),
        ],
        ..VmSpec::default()
    });
    sh(parent.agent(), "echo before > /tmp/mark")?;
    let started = std::time::Instant::now();
    let mut children = parent.fork(1).map_err(|e| format!("fork request: {e:#}"))?;
    let took = started.elapsed();
    let child = children
        .pop()
        .ok_or("no child")?
        .map_err(|e| format!("the fork failed instead of replacing the child: {e:#}"))?;
    let why = child.replaced.clone().unwrap_or_default();
    check(
        why.contains("did not answer AfterFork")
            && why.contains("--- vCPUs ---")
            && why.contains("\"rip\"")
            && why.contains("--- its VMM's threads in the host kernel ---")
            && why.contains(" state "),
        format!("the replacement says why: {why:?}"),
    )?;
    eprintln!(
        "fork with a hung child: answered in {:.1} s (deadline {} s)",
        took.as_secs_f64(),
        forkbox_host::vm::after_fork_deadline(1).as_secs()
    );
    let out = sh(child.agent(), "cat /tmp/mark; echo replaced")?;
    check(
        out == "before\nreplaced\n",
        format!("the replacement answered {out:?}"),
    )?;
    let out = sh(parent.agent(), "cat /tmp/mark")?;
    check(out == "before\n", format!("the parent answered {out:?}"))?;
    // A child that fails to come up is replaced too, into a cgroup of its
    // own like any child's.
    let failed = parent
        .fork(1)
        .map_err(|e| format!("fork request: {e:#}"))?
        .pop()
        .ok_or("no child")?
        .map_err(|e| format!("the fork failed instead of replacing the child: {e:#}"))?;
    let why = failed.replaced.clone().unwrap_or_default();
    check(
        why.contains("FORKBOX_VMM_TEST_FAIL_CHILD"),
        format!("the replacement says why: {why:?}"),
    )?;
    let out = sh(failed.agent(), "cat /tmp/mark")?;
    check(
        out == "before\n",
        format!("the replacement answered {out:?}"),
    )?;
    if let Some(cgroup) = parent.cgroup() {
        let own = failed
            .cgroup()
            .ok_or("the replacement has no cgroup, its parent has")?;
        let procs = own
            .pids()
            .map_err(|e| format!("{}: {e}", own.dir().display()))?;
        check(
            own.dir() != cgroup.dir() && procs.contains(&failed.pid()),
            format!(
                "the replacement {} is not in its own cgroup {} ({procs:?})",
                failed.pid(),
                own.dir().display()
            ),
        )?;
    }
    Ok(())
}

/// Reads the TSC from guest user space (`rdtsc` through ctypes) and prints
/// the guest's TSC in seconds (at the rate it runs against kvmclock's
/// CLOCK_MONOTONIC over 2 s), CLOCK_MONOTONIC, the wall clock, and the
/// two samples' widths. Each sample is the tightest of 50 (kvmclock read,
/// TSC read, kvmclock read), the TSC paired with the middle: a vCPU
/// preempted between two reads (the emulated host under load) widens that
/// sample, not the rate (a single pair 0.2 s apart skewed it by a fifth).
const TSC_VS_KVMCLOCK: &str = r#"
import ctypes, mmap, time
code = bytes([0x0f, 0x31, 0x48, 0xc1, 0xe2, 0x20, 0x48, 0x09, 0xd0, 0xc3])  # rdtsc; shl rdx,32; or rax,rdx; ret
buf = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
buf.write(code)
rdtsc = ctypes.CFUNCTYPE(ctypes.c_uint64)(ctypes.addressof(ctypes.c_char.from_buffer(buf)))
def sample():
    best = None
    for _ in range(50):
        a = time.clock_gettime(time.CLOCK_MONOTONIC)
        t = rdtsc()
        b = time.clock_gettime(time.CLOCK_MONOTONIC)
        if best is None or b - a < best[0]:
            best = (b - a, t, (a + b) / 2)
    return best
w0, t0, m0 = sample()
time.sleep(2)
w1, t1, m1 = sample()
hz = (t1 - t0) / (m1 - m0)
print("%.3f %.3f %.3f %.6f %.6f" % (t1 / hz, m1, time.time(), w0, w1))
"#;

/// A zygote's children get the vCPUs' TSC and the VM's kvmclock of one
/// instant, both advanced by the same gap: how far the TSC (in seconds
/// since the VM was made) runs ahead of kvmclock's CLOCK_MONOTONIC (since
/// the guest's kernel started keeping time) is the same in a child of a
/// zygote made 90 s earlier as in the VM before it became the zygote,
/// where a TSC captured at the bake beside a kvmclock read at the fork
/// would lag by the zygote's age; and the child's wall clock is the host's.
/// The child's kernel takes its clock's 90 s jump for a stop (the VMM
/// tells it so, `KVM_KVMCLOCK_CTRL`), not for a soft lockup or an RCU
/// stall.
/// (The offset itself is the boot's first seconds, and under load in the
/// emulated host it was 28 s once: the test compares offsets, not 0.)
pub(crate) fn fork_zygote_aged_child_tsc_and_kvmclock_agree() -> TestResult {
    let mut vm = boot(VmSpec {
        image: ImageName::Debian.into(),
        ..VmSpec::default()
    });
    let clocks = |what: &str, agent: &AgentClient| -> Result<[f64; 5], Failed> {
        let out = sh(agent, &format!("python3 -c '{TSC_VS_KVMCLOCK}'"))?;
        let nums: Vec<f64> = out
            .split_whitespace()
            .filter_map(|w| w.parse().ok())
            .collect();
        let [tsc_s, mono_s, real_s, w0, w1] = nums[..] else {
            return Err(format!("{what} printed {out:?}").into());
        };
        eprintln!(
            "{what}: TSC {tsc_s:.1} s, kvmclock {mono_s:.1} s (samples {:.0} and {:.0} µs wide)",
            w0 * 1e6,
            w1 * 1e6
        );
        Ok([tsc_s, mono_s, real_s, w0, w1])
    };
    let [tsc_before, mono_before, ..] = clocks("before the zygote", vm.agent())?;
    vm.make_warm_zygote()
        .map_err(|e| format!("making the zygote: {e:#}"))?;
    std::thread::sleep(Duration::from_secs(90));
    let children = fork(&mut vm, 1)?;
    let child = &children[0];
    let host_before = unix_now();
    let [tsc_s, mono_s, real_s, ..] = clocks("aged zygote's child", child.agent())?;
    let host_after = unix_now();
    let (offset_before, offset_child) = (tsc_before - mono_before, tsc_s - mono_s);
    check(
        (offset_child - offset_before).abs() < 10.0,
        format!(
            "the child's TSC runs {offset_child:.1} s ahead of its kvmclock ({tsc_s:.1} s against \
             {mono_s:.1} s), the VM's before the zygote {offset_before:.1} s"
        ),
    )?;
    check(
        real_s > host_before - 1.0 && real_s < host_after + 1.0,
        format!("child clock {real_s:.3} vs host {host_before:.3}..{host_after:.3}"),
    )?;
    // The guest's watchdogs sample every few seconds: give them time.
    std::thread::sleep(Duration::from_secs(15));
    let dmesg = sh(child.agent(), "dmesg")?;
    let alarms: Vec<&str> = dmesg
        .lines()
        .filter(|l| l.contains("soft lockup") || (l.contains("rcu") && l.contains("stall")))
        .collect();
    check(
        alarms.is_empty(),
        format!("the child's kernel took its clock's jump for a hang: {alarms:#?}"),
    )
}

/// KVM ignores a host write of MSR_IA32_TSC_DEADLINE while the LAPIC timer
/// is not in TSC-deadline mode: restoring the MSRs before the LAPIC drops
/// a pending deadline. Raw KVM: capture a vCPU whose LAPIC timer is in
/// TSC-deadline mode with a deadline set, restore it into a fresh VM, read
/// the deadline back.
pub(crate) fn state_lapic_restored_before_msrs_keeps_tsc_deadline() -> TestResult {
    use forkbox_vmm::state;
    use kvm_ioctls::Kvm;
    const MSR_TSC_DEADLINE: u32 = 0x6e0;
    const APIC_SVR: usize = 0xf0;
    const APIC_LVTT: usize = 0x320;
    let e = |what: &'static str| move |e: kvm_ioctls::Error| format!("{what}: {e}");
    let kvm = Kvm::new().map_err(e("/dev/kvm"))?;
    let mut cpuid = kvm
        .get_supported_cpuid(kvm_bindings::KVM_MAX_CPUID_ENTRIES)
        .map_err(e("supported CPUID"))?;
    for entry in cpuid.as_mut_slice() {
        if entry.function == 1 {
            entry.ecx |= 1 << 24; // TSC-deadline timer
        }
    }
    let fresh_vcpu = || -> Result<(kvm_ioctls::VmFd, kvm_ioctls::VcpuFd), String> {
        let vm = kvm.create_vm().map_err(e("KVM_CREATE_VM"))?;
        vm.create_irq_chip().map_err(e("irqchip"))?;
        let vcpu = vm.create_vcpu(0).map_err(e("vCPU"))?;
        vcpu.set_cpuid2(&cpuid).map_err(e("CPUID"))?;
        Ok((vm, vcpu))
    };
    let (_vm, vcpu) = fresh_vcpu()?;
    let mut lapic = vcpu.get_lapic().map_err(e("get LAPIC"))?;
    let mut set = |reg: usize, value: u32| {
        for (k, b) in value.to_le_bytes().into_iter().enumerate() {
            lapic.regs[reg + k] = b as std::os::raw::c_char;
        }
    };
    set(APIC_SVR, 0x1ff); // software-enabled, spurious vector 0xff
    set(APIC_LVTT, (0b10 << 17) | 0xec); // TSC-deadline mode, vector 236
    vcpu.set_lapic(&lapic).map_err(e("set LAPIC"))?;
    let tsc_now = {
        let mut msrs = kvm_bindings::Msrs::from_entries(&[kvm_bindings::kvm_msr_entry {
            index: 0x10,
            ..Default::default()
        }])
        .map_err(|e| format!("{e:?}"))?;
        vcpu.get_msrs(&mut msrs).map_err(e("read TSC"))?;
        msrs.as_slice()[0].data
    };
    let deadline = tsc_now + (1 << 50);
    let deadline_msr = |value: u64| {
        kvm_bindings::Msrs::from_entries(&[kvm_bindings::kvm_msr_entry {
            index: MSR_TSC_DEADLINE,
            data: value,
            ..Default::default()
        }])
        .map_err(|e| format!("{e:?}"))
    };
    let n = vcpu
        .set_msrs(&deadline_msr(deadline)?)
        .map_err(e("set the deadline"))?;
    check(n == 1, "KVM refused the TSC deadline on the first vCPU")?;
    let indices = state::msr_indices(&kvm).map_err(|e| format!("{e:#}"))?;
    check(
        indices.contains(&MSR_TSC_DEADLINE),
        "KVM does not list MSR_IA32_TSC_DEADLINE among the MSRs to save",
    )?;
    let saved = state::save_vcpu(&vcpu, 0, cpuid.as_slice(), &indices)
        .map_err(|e| format!("capture: {e:#}"))?;
    let (_vm2, restored) = fresh_vcpu()?;
    state::restore_vcpu(&restored, &saved, 0).map_err(|e| format!("restore: {e:#}"))?;
    let mut back = deadline_msr(0)?;
    restored
        .get_msrs(&mut back)
        .map_err(e("read the deadline back"))?;
    let got = back.as_slice()[0].data;
    check(
        got == deadline,
        format!("restored TSC deadline {got:#x}, captured {deadline:#x}"),
    )
}

pub(crate) fn fork_of_fork_of_fork_inherits_and_answers() -> TestResult {
    let mut vm = boot(VmSpec::default());
    sh(vm.agent(), "echo 0 > /tmp/gen0")?;
    let mut lineage = vec![];
    for generation in 1..=3 {
        let mut child = fork(&mut vm, 1)?.remove(0);
        sh(
            child.agent(),
            &format!("echo {generation} > /tmp/gen{generation}"),
        )?;
        std::mem::swap(&mut vm, &mut child);
        lineage.push(child);
    }
    let got = sh(vm.agent(), "cat /tmp/gen0 /tmp/gen1 /tmp/gen2 /tmp/gen3")?;
    check(
        got == "0\n1\n2\n3\n",
        format!("great-grandchild sees {got:?}"),
    )?;
    for (i, ancestor) in lineage.iter().enumerate() {
        let got = sh(ancestor.agent(), "ls /tmp | grep -c gen")?;
        check(
            got.trim() == (i + 1).to_string(),
            format!("generation {i} sees {got:?} gen files"),
        )?;
    }
    Ok(())
}

pub(crate) fn fork_parent_killed_children_keep_running() -> TestResult {
    let mut parent = boot(VmSpec::default());
    sh(parent.agent(), BACKGROUND)?;
    let children = fork(&mut parent, 2)?;
    parent.kill();
    let status = parent
        .wait_exit(Duration::from_secs(30))
        .map_err(|e| e.to_string())?;
    check(status.is_some(), "the parent VMM did not die")?;
    std::thread::sleep(Duration::from_millis(500));
    for (i, c) in children.iter().enumerate() {
        background_alive(c.agent(), &format!("orphaned child {i}"))?;
    }
    Ok(())
}

pub(crate) fn fork_during_commands_parent_finishes_children_report_interrupted() -> TestResult {
    let mut parent = boot(VmSpec::default());
    let (tx, rx) = std::sync::mpsc::channel();
    let runners: Vec<_> = (0..2)
        .map(|i| {
            let agent = parent.agent().clone();
            let tx = tx.clone();
            std::thread::spawn(move || {
                let mut out = Vec::new();
                let r = agent.exec(
                    &ExecRequest::shell(format!("echo started; sleep 4; echo finished {i}")),
                    None,
                    &mut |_, b| {
                        if b.starts_with(b"started") {
                            let _ = tx.send(());
                        }
                        out.extend_from_slice(b);
                    },
                );
                (r, out)
            })
        })
        .collect();
    for _ in 0..2 {
        rx.recv_timeout(Duration::from_secs(60))
            .map_err(|_| "commands did not start")?;
    }
    let children = fork(&mut parent, 2)?;
    for (i, h) in runners.into_iter().enumerate() {
        let (r, out) = h.join().map_err(|_| "runner panicked")?;
        let r = r.map_err(|e| format!("parent exec {i}: {e:#}"))?;
        check(r.success(), format!("parent exec {i}: {r:?}"))?;
        check(
            out == format!("started\nfinished {i}\n").into_bytes(),
            format!("parent exec {i} output {:?}", String::from_utf8_lossy(&out)),
        )?;
    }
    for (i, c) in children.iter().enumerate() {
        let report = c.after_fork.as_ref().ok_or("no after-fork report")?;
        let accounted = report.interrupted.len() + report.still_running.len();
        check(
            accounted == 2,
            format!("child {i} lost commands: {report:?}"),
        )?;
        check(
            report.interrupted.iter().all(
                |e| matches!(&e.command, forkbox_proto::Command::Shell(s) if s.contains("sleep 4")),
            ),
            format!("child {i}: {report:?}"),
        )?;
    }
    Ok(())
}

pub(crate) fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

pub(crate) fn snapshot_restore_resumes_processes_with_current_clock() -> TestResult {
    let mut vm = boot(VmSpec::default());
    sh(vm.agent(), BACKGROUND)?;
    background_alive(vm.agent(), "before the snapshot")?;
    let snap = tempfile::tempdir().map_err(|e| e.to_string())?;
    let snap_dir = snap.path().join("snap");
    // The counter only grows: what it shows now is at most its value when
    // the snapshot is taken.
    let at_pause: u64 = sh(vm.agent(), "cat /tmp/count")?
        .trim()
        .parse()
        .map_err(|_| "counter unreadable")?;
    vm.pause().map_err(|e| format!("{e:#}"))?;
    let bytes = vm.snapshot(&snap_dir).map_err(|e| format!("{e:#}"))?;
    check(bytes > 0, "empty snapshot")?;
    drop(vm);
    // The snapshot ages: its guest clock falls behind.
    std::thread::sleep(Duration::from_secs(4));
    let restored = Vm::restore(assets(), &snap_dir, None, None).map_err(|e| format!("{e:#}"))?;
    let report = restored.after_fork.clone().ok_or("no after-fork report")?;
    check(report.clock.is_done(), format!("{report:?}"))?;
    let before = unix_now();
    let guest =
        forkbox_host::measure::guest_clock(restored.agent()).map_err(|e| format!("{e:#}"))?;
    let after = unix_now();
    // The guest read its clock between `before` and `after`.
    check(
        guest > before - 1.0 && guest < after + 1.0,
        format!(
            "guest clock {guest:.3} vs host {before:.3}..{after:.3} (offset before the hook: {:.3} s)",
            report.clock_offset_ns as f64 / 1e9
        ),
    )?;
    let count: u64 = sh(restored.agent(), "cat /tmp/count")?
        .trim()
        .parse()
        .unwrap_or(0);
    check(
        count >= at_pause,
        format!("counter went back: {at_pause} at pause, {count} after restore"),
    )?;
    background_alive(restored.agent(), "restored")?;
    let log = sh(restored.agent(), "tail -n 1 /tmp/count.log")?;
    let logged: u64 = log.trim().parse().unwrap_or(0);
    check(
        logged > at_pause,
        format!("the open log file stopped at {logged} (pause at {at_pause})"),
    )
}

/// A forked VMM's exit status goes to its parent VMM, so how a child ended
/// comes from the note it leaves: a panic and a power-off are the guest's,
/// a VMM killed from outside is not.
pub(crate) fn fork_child_ended_by_its_guest_says_so_killed_one_does_not() -> TestResult {
    let mut parent = boot(VmSpec::default());
    let mut children = fork(&mut parent, 3)?;
    let bounded = |vm: &Vm| {
        vm.agent()
            .clone()
            .with_call_timeout(Duration::from_secs(120))
    };
    let _ = bounded(&children[0]).exec(
        &ExecRequest::shell("echo c > /proc/sysrq-trigger"),
        None,
        &mut |_, _| {},
    );
    bounded(&children[1])
        .shutdown()
        .map_err(|e| format!("power-off: {e:#}"))?;
    children[2].kill();
    let mut ends = Vec::new();
    for (i, child) in children.iter_mut().enumerate() {
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        let end = loop {
            if let Some(end) = child.ended() {
                break end;
            }
            if std::time::Instant::now() > deadline {
                return Err(format!(
                    "child {i} has not ended after 120 s\n{}",
                    child.serial_tail(20)
                )
                .into());
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        ends.push(end);
    }
    let what = format!("{ends:#?}");
    check(
        ends[0].by_guest && ends[0].how.contains("panicked"),
        format!("a panic is the guest's: {what}"),
    )?;
    check(
        ends[1].by_guest && ends[1].how.contains("powered off"),
        format!("a power-off is the guest's: {what}"),
    )?;
    check(
        !ends[2].by_guest,
        format!("a VMM killed from outside is not the guest's: {what}"),
    )
}
