//! Integration tests that boot real microVMs.
//!
//! Where this machine has hardware virtualization they run here; where it
//! does not, this binary re-runs itself inside forkbox's emulated KVM host
//! (`forkbox testbed`) and reports what happened there. They never skip.
//!
//! A custom harness (libtest-mimic) so that the decision is made once, and
//! so that one shared VM serves the many small exec and file tests.

use std::sync::{Mutex, OnceLock, RwLock};
use std::time::Duration;

use forkbox::image::ImageName;
use forkbox::testbed::{self, Environment};
use forkbox::vm::{vmm_exit, Assets, Vm, VmSpec};
use forkbox_proto::client::AgentClient;
use forkbox_proto::{ExecRequest, ExitStatus, FileKind, OutputStream, User};
use libtest_mimic::{Arguments, Failed, Trial};

type TestResult = Result<(), Failed>;

fn main() {
    let args = Arguments::from_args();
    if Environment::detect() == Environment::NeedsEmulatedHost {
        // Build the assets out here: the emulated host sees our files
        // read-only.
        if let Err(e) = Assets::prepare().and_then(|_| {
            forkbox::image::ensure(ImageName::Minimal)?;
            // The network flood trial's guest runs python3.
            forkbox::image::ensure(ImageName::Debian)?;
            Ok(())
        }) {
            eprintln!("vm tests: cannot prepare guest assets: {e:#?}");
            std::process::exit(1);
        }
        let forwarded: Vec<String> = std::env::args().skip(1).collect();
        std::process::exit(run_in_emulated_host(forwarded));
    }
    eprintln!("vm tests: environment: {}", Environment::detect().label());
    let conclusion = libtest_mimic::run(&args, resumed(this_shard(trials())));
    let replaced = REPLACED.lock().unwrap_or_else(|p| p.into_inner()).clone();
    if !replaced.is_empty() {
        eprintln!(
            "vm tests: fork children lost and replaced in this run (test-bed faults or bugs, named above): {replaced:?}"
        );
    }
    // Statics are not dropped: stop the shared VM before exiting.
    if let Some(m) = SHARED.get() {
        if let Ok(mut vm) = m.lock() {
            vm.take();
        }
    }
    conclusion.exit();
}

/// Where there is no hardware virtualization, the trials run in one-CPU
/// emulated hosts side by side, one per host CPU, each taking its share of
/// the trials ([`split`]) (with two emulated CPUs, the emulated host's KVM lost a few
/// guests in a hundred; with one, none: docs/SPEC.md, "The test bed").
/// Their output lines carry the shard's label; the exit code is the first
/// failing shard's.
fn run_in_emulated_host(args: Vec<String>) -> i32 {
    let n = testbed::shards(4);
    eprintln!(
        "vm tests: {n} one-CPU emulated host(s) side by side, the trials split between them by their expected time"
    );
    // Every trial in exactly one shard.
    let names: Vec<&'static str> = trials().iter().map(|(name, _)| *name).collect();
    let mut split_names: Vec<&'static str> = (1..=n).flat_map(|i| split(&names, i, n)).collect();
    split_names.sort_unstable();
    let mut all = names.clone();
    all.sort_unstable();
    if split_names != all {
        eprintln!("vm tests: the split into {n} shards does not hold every trial exactly once");
        return 1;
    }
    let codes: Vec<i32> = std::thread::scope(|scope| {
        let shards: Vec<_> = (0..n)
            .map(|i| {
                let args = args.clone();
                scope.spawn(move || run_shard(args, i, n))
            })
            .collect();
        shards
            .into_iter()
            .map(|h| h.join().unwrap_or(101))
            .collect()
    });
    for (i, code) in codes.iter().enumerate() {
        eprintln!(
            "vm tests: shard {}/{n}: {}",
            i + 1,
            if *code == 0 {
                "passed".to_owned()
            } else {
                format!("FAILED (exit {code})")
            }
        );
    }
    codes.into_iter().find(|&c| c != 0).unwrap_or(0)
}

/// One shard in its emulated host. That host's own kernel has crashed
/// under load here (a fault inside its KVM_RUN, i.e. in QEMU's SVM
/// emulation or its kvm_amd, which no user process may cause;
/// docs/SPEC.md, known problems). Such a crash is not a test result: each
/// trial records how it ended in a file shared with this machine, and
/// after a crash a new emulated host runs only the trials that had not
/// ended. Trials that failed stay failed. Three crashes in one shard end
/// it with 125. (A crash is told apart from an exit code by the run's
/// outcome: the suite's own exit 125 is just a failure.)
fn run_shard(args: Vec<String>, shard: usize, shards: usize) -> i32 {
    const HOSTS: u32 = 3;
    let label = format!("[vm {}/{shards}] ", shard + 1);
    let share = match tempfile::Builder::new()
        .prefix("forkbox-vm-tests-")
        .tempdir()
    {
        Ok(dir) => dir,
        Err(e) => {
            eprintln!("{label}vm tests: cannot make a directory for their progress: {e}");
            return 1;
        }
    };
    let progress = share.path().join("ended");
    const TIMEOUT: Duration = Duration::from_secs(2400);
    for host in 1..=HOSTS {
        let run = testbed::rerun_inside_with(args.clone(), TIMEOUT, |opts| {
            opts.share = Some(share.path().to_owned());
            opts.label = Some(label.clone());
            opts.env
                .push((PROGRESS_ENV.into(), progress.display().to_string()));
            opts.env
                .push((SHARD_ENV.into(), format!("{}/{shards}", shard + 1)));
        });
        match run {
            Ok((argv, outcome @ testbed::Outcome::HostDied { .. })) => {
                // Prints the host's serial log and QEMU's stderr.
                testbed::report(&argv, TIMEOUT, outcome);
                if host == HOSTS {
                    break;
                }
                let ended = Ended::read(&progress);
                eprintln!(
                    "{label}vm tests: the emulated host itself crashed (its serial log is above) after {} trials had ended; \
                     a new one runs the rest ({} of {HOSTS}; a test-bed fault, counted here, not a pass)",
                    ended.len(),
                    host + 1
                );
            }
            Ok((argv, outcome)) => return testbed::report(&argv, TIMEOUT, outcome),
            Err(e) => {
                eprintln!("{label}vm tests: cannot run inside the emulated host: {e}");
                return 1;
            }
        }
    }
    eprintln!("{label}vm tests: the emulated host crashed {HOSTS} times; giving up");
    125
}

/// `i/n` (1-based) inside an emulated host that runs shard i of n.
const SHARD_ENV: &str = "FORKBOX_VM_TESTS_SHARD";

/// Seconds a trial took in a one-CPU emulated host (2026-12-04), for
/// spreading the long ones over the shards; a trial not listed counts 15.
const TRIAL_SECONDS: &[(&str, u32)] = &[
    ("fork_smp_ipi_load_200_children_all_answer", 390),
    (
        "fork_64_children_of_a_running_parent_all_answer_an_exec",
        120,
    ),
    ("fork_zygote_aged_child_tsc_and_kvmclock_agree", 110),
    (
        "fork_memory_pattern_is_one_instant_in_children_never_in_parent",
        60,
    ),
    ("net_connect_flood_keeps_vmm_memory_bounded", 60),
    ("net_fork_child_connections_are_its_own", 60),
    ("snapshot_restore_resumes_processes_with_current_clock", 60),
    (
        "fork_child_that_hangs_is_replaced_and_says_where_it_was",
        40,
    ),
    (
        "fork_zygote_16_children_answer_with_distinct_randomness",
        40,
    ),
];

/// The trials of shard `i` of `n` (1-based): the longest trials first, each
/// to the shard with the least time so far (every shard computes the same
/// split, so each trial runs in exactly one).
fn split(names: &[&'static str], i: usize, n: usize) -> Vec<&'static str> {
    let seconds = |name: &str| {
        TRIAL_SECONDS
            .iter()
            .find(|(t, _)| *t == name)
            .map_or(15, |(_, s)| *s)
    };
    let mut order: Vec<&'static str> = names.to_vec();
    // Stable: equal weights keep the list's order.
    order.sort_by_key(|name| std::cmp::Reverse(seconds(name)));
    let mut load = vec![0u32; n];
    let mut mine = Vec::new();
    for name in order {
        let shard = (0..n).min_by_key(|&s| (load[s], s)).unwrap_or(0);
        load[shard] += seconds(name);
        if shard == i - 1 {
            mine.push(name);
        }
    }
    mine
}

/// The trials of this shard (see [`split`]); all of them outside a shard.
fn this_shard(trials: Vec<(&'static str, TrialFn)>) -> Vec<(&'static str, TrialFn)> {
    let Some((i, n)) = std::env::var(SHARD_ENV).ok().and_then(|v| {
        let (i, n) = v.split_once('/')?;
        Some((i.parse::<usize>().ok()?, n.parse::<usize>().ok()?))
    }) else {
        return trials;
    };
    let names: Vec<&'static str> = trials.iter().map(|(name, _)| *name).collect();
    let mine = split(&names, i, n);
    trials
        .into_iter()
        .filter(|(name, _)| mine.contains(name))
        .collect()
}

/// Names the file where trials record how they ended (set inside the
/// emulated host only).
const PROGRESS_ENV: &str = "FORKBOX_VM_TESTS_PROGRESS";

/// How trials ended in earlier emulated hosts of this run: one line each,
/// `ok NAME` or `FAILED NAME MESSAGE` (the message's newlines escaped).
struct Ended(Vec<(String, Option<String>)>);

impl Ended {
    fn read(path: &std::path::Path) -> Self {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        Self(
            text.lines()
                .filter_map(|line| {
                    let (verdict, rest) = line.split_once(' ')?;
                    let (name, msg) = rest.split_once(' ').unwrap_or((rest, ""));
                    let msg = msg.replace("\\n", "\n");
                    match verdict {
                        "ok" => Some((name.to_owned(), None)),
                        "FAILED" => Some((name.to_owned(), Some(msg))),
                        _ => None,
                    }
                })
                .collect(),
        )
    }

    fn len(&self) -> usize {
        self.0.len()
    }

    fn get(&self, name: &str) -> Option<&Option<String>> {
        self.0.iter().find(|(n, _)| n == name).map(|(_, v)| v)
    }

    /// Appends one line, written whole so that a crash leaves whole lines.
    fn record(path: &std::path::Path, name: &str, result: &TestResult) {
        use std::io::Write;
        let line = match result {
            Ok(()) => format!("ok {name}\n"),
            Err(e) => {
                let msg = e.message().unwrap_or("failed").replace('\n', "\\n");
                format!("FAILED {name} {msg}\n")
            }
        };
        let appended = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .and_then(|mut f| f.write_all(line.as_bytes()));
        if let Err(e) = appended {
            eprintln!(
                "vm tests: cannot record that {name} ended in {}: {e}",
                path.display()
            );
        }
    }
}

/// Within a run resumed after the emulated host crashed: trials that passed
/// before are left out (and named), trials that failed before fail again
/// with their message, the rest run. Every trial records how it ends.
fn resumed(trials: Vec<(&'static str, TrialFn)>) -> Vec<Trial> {
    let Some(progress) = std::env::var_os(PROGRESS_ENV).map(std::path::PathBuf::from) else {
        return trials
            .into_iter()
            .map(|(name, f)| Trial::test(name, f))
            .collect();
    };
    let ended = Ended::read(&progress);
    let mut passed = Vec::new();
    let mut out = Vec::new();
    for (name, f) in trials {
        match ended.get(name) {
            Some(None) => passed.push(name),
            Some(Some(msg)) => {
                let msg = format!(
                    "failed in an earlier emulated host of this run (which then crashed): {msg}"
                );
                out.push(Trial::test(name, move || Err(msg.into())));
            }
            None => {
                let progress = progress.clone();
                out.push(Trial::test(name, move || {
                    let result = std::panic::catch_unwind(f).unwrap_or_else(|panic| {
                        let msg = panic
                            .downcast_ref::<String>()
                            .map(String::as_str)
                            .or_else(|| panic.downcast_ref::<&str>().copied())
                            .unwrap_or("panicked");
                        Err(format!("panicked: {msg}").into())
                    });
                    Ended::record(&progress, name, &result);
                    result
                }));
            }
        }
    }
    if !passed.is_empty() {
        eprintln!(
            "vm tests: {} trials passed in an earlier emulated host of this run and are not run again: {}",
            passed.len(),
            passed.join(", ")
        );
    }
    out
}

type TrialFn = Box<dyn FnOnce() -> TestResult + Send + std::panic::UnwindSafe>;

/// Taken shared by every VM test, whole by the one that must run alone.
static LOAD: RwLock<()> = RwLock::new(());

/// Tests that run while no other VM test runs. In the emulated host, a
/// guest with more vCPUs than the host has CPUs, booted while other tests
/// loaded those CPUs, once stalled a vCPU for minutes (an RCU expedited
/// stall: the vCPU never took its IPI; see docs/SPEC.md, known problems).
/// Alone it boots in seconds; a stall alone still fails the test.
/// The 64-children fan-out is the heaviest load of the suite; alone, it
/// does not add to the load under which fork children of other trials
/// were seen to triple-fault in the emulated host (docs/SPEC.md).
const ALONE: &[&str] = &[
    "vm_smp_vcpus_are_online",
    "fork_64_children_of_a_running_parent_all_answer_an_exec",
];

type NamedTest = (&'static str, fn() -> TestResult);

fn trials() -> Vec<(&'static str, TrialFn)> {
    let tests: &[NamedTest] = &[
        (
            "testbed_dev_kvm_runs_real_mode_guest",
            testbed_dev_kvm_runs_real_mode_guest,
        ),
        ("exec_exit_code_is_returned", exec_exit_code_is_returned),
        ("exec_signal_is_reported", exec_signal_is_reported),
        ("exec_stdin_round_trips", exec_stdin_round_trips),
        (
            "exec_64mib_stdout_arrives_byte_for_byte",
            exec_64mib_stdout_arrives_byte_for_byte,
        ),
        (
            "exec_timeout_kills_process_group",
            exec_timeout_kills_process_group,
        ),
        (
            "exec_concurrent_commands_all_complete",
            exec_concurrent_commands_all_complete,
        ),
        (
            "exec_missing_binary_exits_127",
            exec_missing_binary_exits_127,
        ),
        ("exec_output_cap_truncates", exec_output_cap_truncates),
        ("exec_as_user_is_unprivileged", exec_as_user_is_unprivileged),
        ("files_round_trip_with_mode", files_round_trip_with_mode),
        (
            "files_directory_tar_round_trips",
            files_directory_tar_round_trips,
        ),
        (
            "root_is_overlay_on_readonly_image",
            root_is_overlay_on_readonly_image,
        ),
        ("vm_smp_vcpus_are_online", vm_smp_vcpus_are_online),
        (
            "vm_guest_panic_ends_vmm_with_panic_status",
            vm_guest_panic_ends_vmm_with_panic_status,
        ),
        (
            "vm_guest_poweroff_ends_vmm_cleanly",
            vm_guest_poweroff_ends_vmm_cleanly,
        ),
        (
            "vm_guest_reboot_ends_vmm_with_reboot_status",
            vm_guest_reboot_ends_vmm_with_reboot_status,
        ),
        ("vm_dies_mid_call_is_reported", vm_dies_mid_call_is_reported),
        (
            "fork_running_processes_continue_in_parent_and_children",
            fork_running_processes_continue_in_parent_and_children,
        ),
        (
            "fork_children_diverge_from_each_other_and_parent",
            fork_children_diverge_from_each_other_and_parent,
        ),
        (
            "fork_zygote_16_children_answer_with_distinct_randomness",
            fork_zygote_16_children_answer_with_distinct_randomness,
        ),
        (
            "fork_zygote_dense_memory_is_in_huge_pages",
            fork_zygote_dense_memory_is_in_huge_pages,
        ),
        (
            "fork_64_children_of_a_running_parent_all_answer_an_exec",
            fork_64_children_of_a_running_parent_all_answer_an_exec,
        ),
        (
            "fork_of_fork_of_fork_inherits_and_answers",
            fork_of_fork_of_fork_inherits_and_answers,
        ),
        (
            "fork_smp_ipi_load_200_children_all_answer",
            fork_smp_ipi_load_200_children_all_answer,
        ),
        (
            "fork_zygote_aged_child_tsc_and_kvmclock_agree",
            fork_zygote_aged_child_tsc_and_kvmclock_agree,
        ),
        (
            "state_lapic_restored_before_msrs_keeps_tsc_deadline",
            state_lapic_restored_before_msrs_keeps_tsc_deadline,
        ),
        (
            "fork_memory_pattern_is_one_instant_in_children_never_in_parent",
            fork_memory_pattern_is_one_instant_in_children_never_in_parent,
        ),
        (
            "fork_child_that_hangs_is_replaced_and_says_where_it_was",
            fork_child_that_hangs_is_replaced_and_says_where_it_was,
        ),
        (
            "fork_parent_killed_children_keep_running",
            fork_parent_killed_children_keep_running,
        ),
        (
            "fork_during_commands_parent_finishes_children_report_interrupted",
            fork_during_commands_parent_finishes_children_report_interrupted,
        ),
        (
            "fork_cli_runs_the_command_in_every_child",
            fork_cli_runs_the_command_in_every_child,
        ),
        (
            "snapshot_restore_resumes_processes_with_current_clock",
            snapshot_restore_resumes_processes_with_current_clock,
        ),
        (
            "net_allowed_connects_denied_refused_and_both_logged",
            net_allowed_connects_denied_refused_and_both_logged,
        ),
        (
            "net_fork_child_connections_are_its_own",
            net_fork_child_connections_are_its_own,
        ),
        (
            "net_connect_flood_keeps_vmm_memory_bounded",
            net_connect_flood_keeps_vmm_memory_bounded,
        ),
        (
            "net_policy_changed_at_runtime_takes_effect",
            net_policy_changed_at_runtime_takes_effect,
        ),
        (
            "net_git_clone_from_a_loopback_server",
            net_git_clone_from_a_loopback_server,
        ),
        (
            "net_vmm_has_no_network_and_an_adopted_vm_reaches_a_new_broker",
            net_vmm_has_no_network_and_an_adopted_vm_reaches_a_new_broker,
        ),
    ];
    tests
        .iter()
        .map(|&(name, test)| {
            let run: TrialFn = Box::new(move || {
                if ALONE.contains(&name) {
                    let _all = LOAD.write().unwrap_or_else(|p| p.into_inner());
                    test()
                } else {
                    let _some = LOAD.read().unwrap_or_else(|p| p.into_inner());
                    test()
                }
            });
            (name, run)
        })
        .collect()
}

fn assets() -> &'static Assets {
    static ASSETS: OnceLock<Assets> = OnceLock::new();
    ASSETS.get_or_init(|| Assets::prepare().expect("guest assets (run `make build` first)"))
}

static SHARED: OnceLock<Mutex<Option<Vm>>> = OnceLock::new();

/// The agent of one VM shared by the tests that only exec and move files.
fn shared() -> AgentClient {
    let m = SHARED.get_or_init(|| Mutex::new(Some(boot(VmSpec::default()))));
    let vm = m.lock().expect("shared VM lock");
    vm.as_ref().expect("shared VM is up").agent().clone()
}

fn boot(spec: VmSpec) -> Vm {
    match Vm::boot(assets(), &spec) {
        Ok(vm) => vm,
        Err(e) => panic!("boot failed: {e:#}"),
    }
}

/// Runs `req`, collecting stdout and stderr.
fn exec(agent: &AgentClient, req: &ExecRequest) -> (forkbox_proto::ExecResult, Vec<u8>, Vec<u8>) {
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let result = agent
        .exec(req, None, &mut |s, b| match s {
            OutputStream::Stdout => out.extend_from_slice(b),
            OutputStream::Stderr => err.extend_from_slice(b),
        })
        .expect("exec");
    (result, out, err)
}

/// Runs a shell script that must succeed; returns its stdout.
fn sh(agent: &AgentClient, script: &str) -> Result<String, Failed> {
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let r = agent
        .exec(&ExecRequest::shell(script), None, &mut |s, b| match s {
            OutputStream::Stdout => out.extend_from_slice(b),
            OutputStream::Stderr => err.extend_from_slice(b),
        })
        .map_err(|e| format!("`{script}`: {e:#}"))?;
    if !r.success() {
        return Err(format!(
            "`{script}`: {r:?}\nstderr: {}",
            String::from_utf8_lossy(&err)
        )
        .into());
    }
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// [`sh`] in `vm`, failing after `limit` with where the VM's vCPUs are and
/// its serial log instead of waiting on a guest that does not answer.
fn answer_within(vm: &Vm, script: &str, limit: Duration) -> Result<String, Failed> {
    let (tx, rx) = std::sync::mpsc::channel();
    let (agent, owned) = (vm.agent().clone(), script.to_owned());
    // Left behind if the guest never answers: the VM's end ends it.
    std::thread::spawn(move || {
        let _ = tx.send(sh(&agent, &owned).map_err(|e| e.message().unwrap_or_default().to_owned()));
    });
    match rx.recv_timeout(limit) {
        Ok(r) => r.map_err(Failed::from),
        Err(_) => Err(format!(
            "no answer to `{script}` within {limit:?} from VMM {}\n--- vCPUs ---\n{}\n--- serial log (tail) ---\n{}",
            vm.pid(),
            vm.control()
                .vcpus()
                .unwrap_or_else(|e| format!("(not readable: {e})")),
            vm.serial_tail(20)
        )
        .into()),
    }
}

/// Forks `vm` into `n` children, all of which must come up.
fn fork(vm: &mut Vm, n: usize) -> Result<Vec<Vm>, Failed> {
    vm.fork(n)
        .map_err(|e| format!("fork request: {e:#}"))?
        .into_iter()
        .enumerate()
        .map(|(i, c)| {
            let c = c.map_err(|e| format!("fork child {i}: {e:#}"))?;
            if let Some(why) = &c.replaced {
                // Not hidden: a lost child is a fault of the test bed or a
                // bug, counted by signature and named in the suite's output.
                let sig = forkbox::vm::loss_signature(why);
                *REPLACED
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .entry(sig)
                    .or_default() += 1;
                eprintln!("vm tests: fork child {i} was lost ({sig}) and replaced: {why}");
            }
            Ok(c)
        })
        .collect()
}

/// Fork children lost and replaced in this run, by signature (see [`fork`]).
static REPLACED: Mutex<std::collections::BTreeMap<&'static str, usize>> =
    Mutex::new(std::collections::BTreeMap::new());

/// A counter writing to an open file every 10 ms (and to /tmp/count by
/// rename, so a reader never sees it empty), and busybox httpd.
const BACKGROUND: &str = "mkdir -p /www && echo served > /www/index.html && httpd -p 8080 -h /www && \
     (exec 3>/tmp/count.log; i=0; while true; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; echo $i >&3; sleep 0.01; done) \
     </dev/null >/dev/null 2>&1 &";

/// The counter advances and httpd answers in this VM.
fn background_alive(agent: &AgentClient, who: &str) -> TestResult {
    let out = sh(
        agent,
        "a=$(cat /tmp/count); sleep 0.5; b=$(cat /tmp/count); echo $a $b; wget -q -O - http://127.0.0.1:8080/index.html",
    )?;
    let mut words = out.split_whitespace();
    let a: u64 = words.next().and_then(|w| w.parse().ok()).unwrap_or(0);
    let b: u64 = words.next().and_then(|w| w.parse().ok()).unwrap_or(0);
    check(b > a && a > 0, format!("{who}: counter {a} -> {b}"))?;
    check(
        words.next() == Some("served"),
        format!("{who}: httpd answered {out:?}"),
    )
}

fn check(cond: bool, what: impl Into<String>) -> TestResult {
    if cond {
        Ok(())
    } else {
        Err(what.into().into())
    }
}

fn testbed_dev_kvm_runs_real_mode_guest() -> TestResult {
    use kvm_ioctls::{Kvm, VcpuExit};
    // mov al, 0x42; out 0x10, al; hlt
    let code: [u8; 5] = [0xb0, 0x42, 0xe6, 0x10, 0xf4];
    let kvm = Kvm::new().map_err(|e| format!("/dev/kvm: {e}"))?;
    let vm = kvm.create_vm().map_err(|e| format!("KVM_CREATE_VM: {e}"))?;
    // KVM wants page-aligned guest memory.
    let mut buf = vec![0u8; 0x10000 + 0x1000];
    let offset = buf.as_ptr().align_offset(0x1000);
    let mem = &mut buf[offset..offset + 0x10000];
    mem[0x1000..0x1005].copy_from_slice(&code);
    let region = kvm_bindings::kvm_userspace_memory_region {
        slot: 0,
        guest_phys_addr: 0,
        memory_size: mem.len() as u64,
        userspace_addr: mem.as_mut_ptr() as u64,
        flags: 0,
    };
    // SAFETY: `buf` outlives `vm` (declared earlier, so dropped later) and
    // is neither moved nor reallocated while the VM exists.
    unsafe { vm.set_user_memory_region(region) }.map_err(|e| format!("memory region: {e}"))?;
    let mut vcpu = vm.create_vcpu(0).map_err(|e| format!("vcpu: {e}"))?;
    let mut sregs = vcpu.get_sregs().map_err(|e| e.to_string())?;
    sregs.cs.base = 0;
    sregs.cs.selector = 0;
    vcpu.set_sregs(&sregs).map_err(|e| e.to_string())?;
    let regs = kvm_bindings::kvm_regs {
        rip: 0x1000,
        rflags: 2,
        ..Default::default()
    };
    vcpu.set_regs(&regs).map_err(|e| e.to_string())?;
    let mut seen = None;
    loop {
        match vcpu.run().map_err(|e| format!("KVM_RUN: {e}"))? {
            VcpuExit::IoOut(port, data) => seen = Some((port, data[0])),
            VcpuExit::Hlt => break,
            other => return Err(format!("unexpected exit {other:?}").into()),
        }
    }
    check(seen == Some((0x10, 0x42)), format!("guest wrote {seen:?}"))
}

fn exec_exit_code_is_returned() -> TestResult {
    let (r, out, _) = exec(&shared(), &ExecRequest::shell("echo hello; exit 42"));
    check(r.status == ExitStatus::Code(42), format!("{r:?}"))?;
    check(
        out == b"hello\n",
        format!("stdout {:?}", String::from_utf8_lossy(&out)),
    )
}

/// `forkbox run --fork 3`, the CLI's whole path (boot, warm-up, zygote,
/// fork, the command in every child at once): each child's output comes
/// prefixed with its index, each child is its own machine (its own kernel
/// UUID), and the exit code is the failing children's.
fn fork_cli_runs_the_command_in_every_child() -> TestResult {
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

fn exec_signal_is_reported() -> TestResult {
    let (r, _, _) = exec(&shared(), &ExecRequest::shell("kill -9 $$"));
    check(r.status == ExitStatus::Signal(9), format!("{r:?}"))
}

fn exec_stdin_round_trips() -> TestResult {
    let input: Vec<u8> = (0..300_000u32).flat_map(|i| i.to_le_bytes()).collect();
    let mut reader: &[u8] = &input;
    let mut out = Vec::new();
    let r = shared()
        .exec(
            &ExecRequest::argv(["cat"]),
            Some(&mut reader),
            &mut |s, b| {
                if s == OutputStream::Stdout {
                    out.extend_from_slice(b)
                }
            },
        )
        .map_err(|e| format!("{e:#}"))?;
    check(r.success(), format!("{r:?}"))?;
    check(
        out == input,
        format!("got {} bytes back of {}", out.len(), input.len()),
    )
}

fn exec_64mib_stdout_arrives_byte_for_byte() -> TestResult {
    // A deterministic 64 MiB stream: a 512-byte unit (00 01 … ff in hex),
    // 16 × 32 × 256 times.
    const LEN: usize = 64 << 20;
    let script = "i=0; while [ $i -lt 256 ]; do printf '%02x' $i; i=$((i+1)); done > /tmp/p; \
                  for _ in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16; do cat /tmp/p; done > /tmp/q; \
                  for _ in $(seq 1 32); do cat /tmp/q; done > /tmp/r; \
                  for _ in $(seq 1 256); do cat /tmp/r; done";
    let mut got = Vec::with_capacity(LEN);
    let r = shared()
        .exec(&ExecRequest::shell(script), None, &mut |s, b| {
            if s == OutputStream::Stdout {
                got.extend_from_slice(b)
            }
        })
        .map_err(|e| format!("{e:#}"))?;
    check(r.success(), format!("{r:?}"))?;
    let unit: Vec<u8> = (0..256)
        .flat_map(|i: u32| format!("{i:02x}").into_bytes())
        .collect();
    check(
        got.len() == LEN,
        format!("got {} bytes, want {LEN}", got.len()),
    )?;
    let bad = got.chunks(unit.len()).position(|c| c != unit.as_slice());
    check(bad.is_none(), format!("mismatch in chunk {bad:?}"))?;
    check(r.stdout.total_bytes == LEN as u64, format!("{r:?}"))
}

fn exec_timeout_kills_process_group() -> TestResult {
    let agent = shared();
    let req = ExecRequest::shell(
        "(sleep 1000; echo survived > /tmp/grandchild) & echo started; sleep 1000",
    )
    .timeout(Duration::from_secs(2));
    let (r, out, _) = exec(&agent, &req);
    check(r.timed_out, format!("not flagged as timed out: {r:?}"))?;
    check(out == b"started\n", "no output before the timeout")?;
    let (r, out, _) = exec(
        &agent,
        &ExecRequest::shell("ps -o pid,args | grep -c '[s]leep 1000' || true"),
    );
    check(r.success() || r.exit_code() == Some(1), format!("{r:?}"))?;
    check(
        String::from_utf8_lossy(&out).trim() == "0",
        format!("sleepers left: {}", String::from_utf8_lossy(&out)),
    )
}

fn exec_concurrent_commands_all_complete() -> TestResult {
    let agent = shared();
    let handles: Vec<_> = (0..8)
        .map(|i| {
            let agent = agent.clone();
            std::thread::spawn(move || {
                let (r, out, _) = exec(&agent, &ExecRequest::shell(format!("sleep 0.5; echo {i}")));
                (r, out, i)
            })
        })
        .collect();
    for h in handles {
        let (r, out, i) = h.join().map_err(|_| "thread panicked")?;
        check(r.success(), format!("{r:?}"))?;
        check(
            out == format!("{i}\n").into_bytes(),
            format!("exec {i} got {out:?}"),
        )?;
    }
    Ok(())
}

fn exec_missing_binary_exits_127() -> TestResult {
    let (r, _, err) = exec(&shared(), &ExecRequest::argv(["/no/such/binary"]));
    check(r.status == ExitStatus::Code(127), format!("{r:?}"))?;
    check(
        String::from_utf8_lossy(&err).contains("not found"),
        format!("stderr: {}", String::from_utf8_lossy(&err)),
    )
}

fn exec_output_cap_truncates() -> TestResult {
    let req = ExecRequest::shell("head -c 100000 /dev/zero").output_cap(1000);
    let (r, out, _) = exec(&shared(), &req);
    check(out.len() == 1000, format!("kept {} bytes", out.len()))?;
    check(
        r.stdout.truncated && r.stdout.total_bytes == 100_000,
        format!("{r:?}"),
    )
}

fn exec_as_user_is_unprivileged() -> TestResult {
    let req = ExecRequest::argv(["id", "-u"]).user(User::Name("user".into()));
    let (r, out, _) = exec(&shared(), &req);
    check(r.success(), format!("{r:?}"))?;
    check(
        out == b"1000\n",
        format!("uid {:?}", String::from_utf8_lossy(&out)),
    )
}

fn files_round_trip_with_mode() -> TestResult {
    let agent = shared();
    let data: Vec<u8> = (0..1_000_000u32).map(|i| (i * 7) as u8).collect();
    agent
        .mkdir("/tmp/files/a/b", 0o755)
        .map_err(|e| format!("{e:#}"))?;
    let mut src: &[u8] = &data;
    agent
        .write_file("/tmp/files/a/b/data.bin", 0o640, &mut src)
        .map_err(|e| format!("{e:#}"))?;
    let st = agent
        .stat("/tmp/files/a/b/data.bin")
        .map_err(|e| format!("{e:#}"))?;
    check(
        st.size == data.len() as u64 && st.mode & 0o777 == 0o640,
        format!("{st:?}"),
    )?;
    let mut back = Vec::new();
    agent
        .read_file("/tmp/files/a/b/data.bin", &mut back)
        .map_err(|e| format!("{e:#}"))?;
    check(back == data, "read back differs")?;
    let list = agent
        .list_dir("/tmp/files/a/b")
        .map_err(|e| format!("{e:#}"))?;
    check(
        list.iter()
            .any(|e| e.name == "data.bin" && e.stat.kind == FileKind::File),
        format!("{list:?}"),
    )?;
    agent
        .remove("/tmp/files", true)
        .map_err(|e| format!("{e:#}"))?;
    check(agent.stat("/tmp/files").is_err(), "removed dir still there")
}

fn files_directory_tar_round_trips() -> TestResult {
    let agent = shared();
    let (r, _, _) = exec(
        &agent,
        &ExecRequest::shell("mkdir -p /tmp/tree/sub && echo one > /tmp/tree/one && echo two > /tmp/tree/sub/two && chmod 700 /tmp/tree/sub/two"),
    );
    check(r.success(), format!("{r:?}"))?;
    let mut tarball = Vec::new();
    agent
        .download_tar("/tmp/tree", &mut tarball)
        .map_err(|e| format!("{e:#}"))?;
    let mut reader: &[u8] = &tarball;
    agent
        .upload_tar("/tmp/copy", &mut reader)
        .map_err(|e| format!("{e:#}"))?;
    let (r, out, _) = exec(
        &agent,
        &ExecRequest::shell("cat /tmp/copy/one /tmp/copy/sub/two; stat -c %a /tmp/copy/sub/two"),
    );
    check(r.success(), format!("{r:?}"))?;
    check(
        out == b"one\ntwo\n700\n",
        format!("{:?}", String::from_utf8_lossy(&out)),
    )
}

fn root_is_overlay_on_readonly_image() -> TestResult {
    let agent = shared();
    let (r, out, _) = exec(
        &agent,
        &ExecRequest::shell("grep ' / ' /proc/mounts; echo x > /etc/written && cat /etc/written"),
    );
    check(r.success(), format!("{r:?}"))?;
    let text = String::from_utf8_lossy(&out);
    check(
        text.contains("overlay / overlay"),
        format!("mounts: {text}"),
    )?;
    check(
        text.ends_with("x\n"),
        "root is not writable through the overlay",
    )
}

/// SMP: 4 vCPUs with hardware virtualization; inside the emulated host as
/// many as it has CPUs (2). There, a guest with more vCPUs than the host
/// has CPUs has stalled a vCPU for minutes (docs/SPEC.md, known problems).
fn vm_smp_vcpus_are_online() -> TestResult {
    let vcpus: u8 = if Environment::detect() == Environment::EmulatedHost {
        std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, 4)) as u8
    } else {
        4
    };
    let vm = boot(VmSpec {
        vcpus,
        memory_mib: 1024,
        ..VmSpec::default()
    });
    // A stalled guest fails the test instead of hanging the suite.
    let agent = vm.agent().clone();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(exec(
            &agent,
            &ExecRequest::shell(
                "grep -c ^processor /proc/cpuinfo; awk '/MemTotal/ {print $2}' /proc/meminfo",
            ),
        ));
    });
    let (r, out, _) = rx.recv_timeout(Duration::from_secs(180)).map_err(|e| {
        let what = match e {
            std::sync::mpsc::RecvTimeoutError::Timeout => "no answer within 180 s",
            std::sync::mpsc::RecvTimeoutError::Disconnected => "the command failed (see above)",
        };
        format!(
            "{what} from a {vcpus}-vCPU guest; serial tail:\n{}",
            vm.serial_tail(20)
        )
    })?;
    check(r.success(), format!("{r:?}"))?;
    let text = String::from_utf8_lossy(&out);
    let mut lines = text.lines();
    check(
        lines.next() == Some(vcpus.to_string().as_str()),
        format!("cpus: {text}"),
    )?;
    let mem_kib: u64 = lines.next().and_then(|l| l.parse().ok()).unwrap_or(0);
    check(
        (900_000..=1_048_576).contains(&mem_kib),
        format!("MemTotal {mem_kib} kB"),
    )
}

fn vm_guest_panic_ends_vmm_with_panic_status() -> TestResult {
    let mut vm = boot(VmSpec::default());
    let agent = vm.agent().clone();
    // The exec itself dies with the guest: only the VMM's status matters.
    let _ = agent.exec(
        &ExecRequest::shell("echo c > /proc/sysrq-trigger"),
        None,
        &mut |_, _| {},
    );
    let status = vm
        .wait_exit(Duration::from_secs(60))
        .map_err(|e| e.to_string())?;
    let code = status.and_then(|s| s.code());
    check(
        code == Some(vmm_exit::PANIC),
        format!("VMM ended with {status:?}\n{}", vm.serial_tail(20)),
    )
}

fn vm_guest_poweroff_ends_vmm_cleanly() -> TestResult {
    let mut vm = boot(VmSpec::default());
    vm.agent().shutdown().map_err(|e| format!("{e:#}"))?;
    let status = vm
        .wait_exit(Duration::from_secs(60))
        .map_err(|e| e.to_string())?;
    check(
        status.and_then(|s| s.code()) == Some(vmm_exit::POWER_OFF),
        format!("VMM ended with {status:?}\n{}", vm.serial_tail(20)),
    )
}

fn vm_guest_reboot_ends_vmm_with_reboot_status() -> TestResult {
    let mut vm = boot(VmSpec::default());
    let _ = vm
        .agent()
        .exec(&ExecRequest::argv(["reboot", "-f"]), None, &mut |_, _| {});
    let status = vm
        .wait_exit(Duration::from_secs(60))
        .map_err(|e| e.to_string())?;
    check(
        status.and_then(|s| s.code()) == Some(vmm_exit::RESET),
        format!("VMM ended with {status:?}\n{}", vm.serial_tail(20)),
    )
}

fn vm_dies_mid_call_is_reported() -> TestResult {
    let vm = boot(VmSpec::default());
    let agent = vm.agent().clone();
    let pid = vm.pid();
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(500));
        let _ = std::process::Command::new("kill")
            .args(["-9", &pid.to_string()])
            .status();
    });
    let err = agent
        .exec(&ExecRequest::argv(["sleep", "30"]), None, &mut |_, _| {})
        .err();
    killer.join().map_err(|_| "killer panicked")?;
    check(err.is_some(), "exec on a killed VM returned a result")?;
    let text = format!(
        "{:#}",
        err.map(anyhow::Error::from)
            .unwrap_or_else(|| anyhow::anyhow!(""))
    );
    check(
        text.contains("died") || text.contains("connect"),
        format!("error: {text}"),
    )
}

fn fork_running_processes_continue_in_parent_and_children() -> TestResult {
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

fn fork_children_diverge_from_each_other_and_parent() -> TestResult {
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

fn fork_zygote_16_children_answer_with_distinct_randomness() -> TestResult {
    // `debian` has python3, so the children's `uuid.uuid4()` is checked too.
    let mut zygote = boot(VmSpec {
        image: ImageName::Debian,
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

fn fork_zygote_dense_memory_is_in_huge_pages() -> TestResult {
    const HUGE: u64 = 2 << 20;
    let mut zygote = boot(VmSpec::default());
    let file = zygote.make_warm_zygote().map_err(|e| format!("{e:#}"))?;
    // Booting set `never` to `advise` (forkbox::hugepages); `deny`, or a
    // kernel without the file, keeps huge pages out.
    let text = std::fs::read_to_string(forkbox::hugepages::SHMEM_ENABLED).unwrap_or_default();
    let setting = forkbox::hugepages::selected(&text).unwrap_or("absent");
    check(
        file.bytes > 0 && file.huge_bytes <= 512 << 20 && file.huge_bytes % HUGE == 0,
        format!("zygote memory file: {file:?}"),
    )?;
    match setting {
        "never" => return Err("booting left shmem_enabled at never".into()),
        "deny" | "absent" => check(
            file.huge_bytes == 0,
            format!("huge pages with shmem_enabled {setting}: {file:?}"),
        )?,
        _ => check(
            file.huge_bytes >= HUGE,
            format!("no huge page with shmem_enabled {setting}: {file:?}"),
        )?,
    }
    let child = fork(&mut zygote, 1)?.pop().ok_or("no child")?;
    check(sh(child.agent(), "echo up")? == "up\n", "the child answers")?;
    if file.huge_bytes == 0 {
        return Ok(());
    }
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

fn fork_64_children_of_a_running_parent_all_answer_an_exec() -> TestResult {
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
fn fork_smp_ipi_load_200_children_all_answer() -> TestResult {
    let mut parent = boot(VmSpec {
        vcpus: 2,
        ..VmSpec::default()
    });
    sh(
        parent.agent(),
        "(while :; do yes | head -c 20000 > /dev/null; /bin/true; sleep 0.05; done) >/dev/null 2>&1 & echo started",
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
    let out = sh(parent.agent(), "echo alive")?;
    check(out == "alive\n", format!("the parent answered {out:?}"))
}

/// A guest process writing a counter into each of 4096 pages, in page
/// order, round after round. At any instant its memory is rounds r on
/// pages [0, k) and r-1 on [k, 4096): a fork child's copy must be such an
/// instant, and nothing a child writes may reach the parent. SIGUSR1 makes
/// it check its own memory between two page writes (`/tmp/verdict`:
/// `ok ROUND PAGE` or `BAD ...`); SIGUSR2 makes it write a marker no round
/// reaches into every page and stop writing.
const PATTERN_WRITER: &str = r#"
import mmap, os, signal, sys
N, PAGE, MARK = 4096, 4096, 1 << 62
mem = mmap.mmap(-1, N * PAGE)
state = {"r": 0, "p": 0, "marked": False}
def word(p):
    return int.from_bytes(mem[p * PAGE:p * PAGE + 8], "little")
def verify(signum, frame):
    v = [word(p) for p in range(N)]
    r = max(v)
    bad = [p for p in range(N) if v[p] not in (r, r - 1)]
    steps = [p for p in range(1, N) if v[p] != v[p - 1]]
    ok = not bad and len(steps) <= 1 and (not steps or v[steps[0] - 1] == r) and r < MARK
    msg = "ok %d %d" % (r, steps[0] if steps else N) if ok else "BAD max %d pages %s steps %s" % (r, bad[:8], steps[:8])
    with open("/tmp/verdict.new", "w") as f:
        print(msg, file=f)
    os.rename("/tmp/verdict.new", "/tmp/verdict")
def mark(signum, frame):
    state["marked"] = True
    for p in range(N):
        mem[p * PAGE:p * PAGE + 8] = (MARK + os.getpid()).to_bytes(8, "little")
    with open("/tmp/marked", "w") as f:
        print("marked", file=f)
signal.signal(signal.SIGUSR1, verify)
signal.signal(signal.SIGUSR2, mark)
with open("/tmp/writer.pid", "w") as f:
    f.write(str(os.getpid()))
while True:
    if state["marked"]:
        signal.pause()
        continue
    state["r"] += 1
    b = state["r"].to_bytes(8, "little")
    for p in range(N):
        if state["marked"]:
            break
        mem[p * PAGE:p * PAGE + 8] = b
    if state["r"] == 2:
        open("/tmp/writer.ready", "w").close()
"#;

/// Asks the pattern writer to check its memory; its verdict.
fn pattern_verdict(agent: &AgentClient) -> Result<String, Failed> {
    sh(
        agent,
        "rm -f /tmp/verdict; kill -USR1 $(cat /tmp/writer.pid); \
         for i in $(seq 600); do [ -f /tmp/verdict ] && break; sleep 0.1; done; cat /tmp/verdict",
    )
}

/// DESIGN.md, fork: a child is a copy of one instant of its parent, and the
/// two never share a write. A running parent's pattern writer (see
/// [`PATTERN_WRITER`]) is forked while it writes; every child's copy must
/// be one instant of it, each child then marks all its pages, and the
/// parent's memory must stay its own. Then the same from the parent paused.
fn fork_memory_pattern_is_one_instant_in_children_never_in_parent() -> TestResult {
    let mut parent = boot(VmSpec {
        image: ImageName::Debian,
        ..VmSpec::default()
    });
    let agent = parent.agent().clone();
    let (r, _, err) = exec(
        &agent,
        &ExecRequest::shell(format!(
            "cat > /tmp/writer.py <<'EOF'\n{PATTERN_WRITER}\nEOF\n\
             nohup python3 /tmp/writer.py >/tmp/writer.log 2>&1 &\n\
             for i in $(seq 1200); do [ -f /tmp/writer.ready ] && exit 0; sleep 0.1; done; cat /tmp/writer.log; exit 1"
        )),
    );
    check(
        r.success(),
        format!(
            "the pattern writer did not start: {r:?} {}",
            String::from_utf8_lossy(&err)
        ),
    )?;
    let mut checked = 0;
    for (round, paused) in [(0, false), (1, false), (2, true)] {
        if paused {
            parent.pause().map_err(|e| format!("pause: {e:#}"))?;
        }
        let children = fork(&mut parent, 4)?;
        if paused {
            parent.resume().map_err(|e| format!("resume: {e:#}"))?;
        }
        for (i, child) in children.iter().enumerate() {
            let verdict = pattern_verdict(child.agent())?;
            check(
                verdict.starts_with("ok "),
                format!("round {round} (parent paused: {paused}), child {i}: {verdict:?}"),
            )?;
            sh(
                child.agent(),
                "kill -USR2 $(cat /tmp/writer.pid); for i in $(seq 600); do [ -f /tmp/marked ] && exit 0; sleep 0.1; done; exit 1",
            )?;
            checked += 1;
        }
        let verdict = pattern_verdict(&agent)?;
        check(
            verdict.starts_with("ok "),
            format!(
                "round {round}: the parent after its children marked their memory: {verdict:?}"
            ),
        )?;
    }
    check(checked == 12, format!("{checked} children checked"))
}

/// A fork request is never held by one child: the first child of this
/// parent comes up with its vCPUs parked (the VMM's test hook), never
/// answers `AfterFork`, and is replaced by a new child of the same instant
/// after the bounded wait; the replacement says why, with where the lost
/// child's vCPUs were, and works.
fn fork_child_that_hangs_is_replaced_and_says_where_it_was() -> TestResult {
    let parent = boot(VmSpec {
        vmm_env: vec![("FORKBOX_VMM_TEST_HANG_CHILD".into(), "1".into())],
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
            && why.contains("\"rip\""),
        format!("the replacement says why: {why:?}"),
    )?;
    eprintln!(
        "fork with a hung child: answered in {:.1} s (deadline {} s)",
        took.as_secs_f64(),
        forkbox::vm::after_fork_deadline(1).as_secs()
    );
    let out = sh(child.agent(), "cat /tmp/mark; echo replaced")?;
    check(
        out == "before\nreplaced\n",
        format!("the replacement answered {out:?}"),
    )?;
    let out = sh(parent.agent(), "cat /tmp/mark")?;
    check(out == "before\n", format!("the parent answered {out:?}"))
}

/// Reads the TSC from guest user space (`rdtsc` through ctypes), measures
/// its rate over a second of CLOCK_MONOTONIC (kvmclock), and prints the TSC
/// in seconds, CLOCK_MONOTONIC and CLOCK_REALTIME.
const TSC_VS_KVMCLOCK: &str = r#"
import ctypes, mmap, time
code = bytes([0x0f, 0x31, 0x48, 0xc1, 0xe2, 0x20, 0x48, 0x09, 0xd0, 0xc3])  # rdtsc; shl rdx,32; or rax,rdx; ret
buf = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
buf.write(code)
rdtsc = ctypes.CFUNCTYPE(ctypes.c_uint64)(ctypes.addressof(ctypes.c_char.from_buffer(buf)))
t0, m0 = rdtsc(), time.clock_gettime(time.CLOCK_MONOTONIC)
time.sleep(1)
t1, m1 = rdtsc(), time.clock_gettime(time.CLOCK_MONOTONIC)
hz = (t1 - t0) / (m1 - m0)
print("%.3f %.3f %.3f" % (t1 / hz, m1, time.time()))
"#;

/// A zygote's children get the vCPUs' TSC and the VM's kvmclock of one
/// instant, both advanced by the same gap: in a child of a zygote made 90 s
/// earlier the TSC (in seconds since the VM was made) and kvmclock's
/// CLOCK_MONOTONIC (since boot) still agree within the boot's few seconds,
/// where a TSC captured at the bake beside a kvmclock read at the fork
/// would lag by the zygote's age; and its wall clock is the host's.
fn fork_zygote_aged_child_tsc_and_kvmclock_agree() -> TestResult {
    let mut vm = boot(VmSpec {
        image: ImageName::Debian,
        ..VmSpec::default()
    });
    let before_zygote = sh(vm.agent(), &format!("python3 -c '{TSC_VS_KVMCLOCK}'"))?;
    vm.make_warm_zygote()
        .map_err(|e| format!("making the zygote: {e:#}"))?;
    std::thread::sleep(Duration::from_secs(90));
    let children = fork(&mut vm, 1)?;
    let child = &children[0];
    let host_before = unix_now();
    let out = sh(child.agent(), &format!("python3 -c '{TSC_VS_KVMCLOCK}'"))?;
    let host_after = unix_now();
    let nums: Vec<f64> = out
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    let [tsc_s, mono_s, real_s] = nums[..] else {
        return Err(format!("the child printed {out:?}").into());
    };
    eprintln!("aged zygote's child: TSC {tsc_s:.1} s, kvmclock {mono_s:.1} s");
    check(
        (tsc_s - mono_s).abs() < 20.0,
        format!(
            "the child's TSC says {tsc_s:.1} s, its kvmclock {mono_s:.1} s (before the zygote: {before_zygote:?})"
        ),
    )?;
    check(
        real_s > host_before - 1.0 && real_s < host_after + 1.0,
        format!("child clock {real_s:.3} vs host {host_before:.3}..{host_after:.3}"),
    )
}

/// KVM ignores a host write of MSR_IA32_TSC_DEADLINE while the LAPIC timer
/// is not in TSC-deadline mode: restoring the MSRs before the LAPIC drops
/// a pending deadline. Raw KVM: capture a vCPU whose LAPIC timer is in
/// TSC-deadline mode with a deadline set, restore it into a fresh VM, read
/// the deadline back.
fn state_lapic_restored_before_msrs_keeps_tsc_deadline() -> TestResult {
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

fn fork_of_fork_of_fork_inherits_and_answers() -> TestResult {
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

fn fork_parent_killed_children_keep_running() -> TestResult {
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

fn fork_during_commands_parent_finishes_children_report_interrupted() -> TestResult {
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

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn snapshot_restore_resumes_processes_with_current_clock() -> TestResult {
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
    let restored = Vm::restore(assets(), &snap_dir).map_err(|e| format!("{e:#}"))?;
    let report = restored.after_fork.clone().ok_or("no after-fork report")?;
    check(report.clock.is_done(), format!("{report:?}"))?;
    let before = unix_now();
    let guest = forkbox::bench::guest_clock(restored.agent()).map_err(|e| format!("{e:#}"))?;
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

/// A server on the test process's loopback (the emulated host's, where the
/// suite runs there) that answers each connection's first line and closes.
fn line_echo_server() -> (u16, std::sync::mpsc::Receiver<String>) {
    use std::io::{BufRead, BufReader, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind loopback");
    let port = listener.local_addr().expect("local addr").port();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            let mut line = String::new();
            let _ = BufReader::new(&conn).read_line(&mut line);
            let _ = conn.write_all(line.as_bytes());
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    (port, rx)
}

/// `sh`, with the VM's egress log and serial tail in the failure.
fn net_sh(vm: &Vm, script: &str) -> Result<String, Failed> {
    // Bounded: a guest that stops answering fails the trial with where its
    // vCPUs are, not the whole suite at its time limit.
    answer_within(vm, script, Duration::from_secs(300)).map_err(|e| {
        let log = vm.egress_log(100);
        let e = e.message().unwrap_or_default().to_owned();
        format!("{e}\negress log: {log:#?}\nserial:\n{}", vm.serial_tail(20)).into()
    })
}

/// A `debian` guest (it has python3) with a network under `policy`.
fn boot_python_net(policy: &forkbox_net::policy::Policy) -> Result<Vm, Failed> {
    let spec = VmSpec {
        image: ImageName::Debian,
        ..VmSpec::default()
    };
    Vm::boot_with_network(assets(), &spec, Some(policy)).map_err(|e| format!("boot: {e:#}").into())
}

fn net_policy(rules: &[String]) -> forkbox_net::policy::Policy {
    let json = serde_json::json!({ "allow_out": rules }).to_string();
    forkbox_net::policy::Policy::from_json(&json).expect("policy")
}

/// Waits (up to 10 s) for a record in `vm`'s egress log that `pred` picks.
fn logged(
    vm: &Vm,
    what: &str,
    pred: impl Fn(&forkbox_net::log::EgressRecord) -> bool,
) -> Result<forkbox_net::log::EgressRecord, Failed> {
    let start = std::time::Instant::now();
    loop {
        let log = vm.egress_log(1000).map_err(|e| format!("{e:#}"))?;
        if let Some(r) = log.iter().find(|r| pred(r)) {
            return Ok(r.clone());
        }
        if start.elapsed() > Duration::from_secs(10) {
            return Err(format!("no {what} in the egress log: {log:#?}").into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn net_allowed_connects_denied_refused_and_both_logged() -> TestResult {
    use forkbox_net::policy::{Protocol, Verdict};
    let (allowed, lines) = line_echo_server();
    // A loopback server that is not on the allowlist: never reached.
    let other = std::net::TcpListener::bind("127.0.0.1:0").expect("bind loopback");
    other.set_nonblocking(true).expect("nonblocking");
    let denied = other.local_addr().expect("addr").port();
    let policy = net_policy(&[format!("host.forkbox.internal:{allowed}")]);
    let vm = Vm::boot_with_network(assets(), &VmSpec::default(), Some(&policy))
        .map_err(|e| format!("boot: {e:#}"))?;
    let agent = vm.agent();

    // The allowed name resolves to the gateway, and connects and echoes.
    let out = net_sh(
        &vm,
        &format!(
            "nslookup host.forkbox.internal 10.0.2.2 | grep -c 10.0.2.2; \
             echo hello-from-guest | timeout 20 nc 10.0.2.2 {allowed}"
        ),
    )?;
    check(
        out.contains("hello-from-guest"),
        format!("allowed echo: {out:?}"),
    )?;
    let got = lines
        .recv_timeout(Duration::from_secs(10))
        .map_err(|e| format!("server: {e}"))?;
    check(got == "hello-from-guest\n", format!("server got {got:?}"))?;
    let r = logged(&vm, "allowed connection", |r| {
        r.protocol == Protocol::Tcp && r.port == allowed
    })?;
    check(
        r.verdict == Verdict::Allow
            && r.name.as_deref() == Some("host.forkbox.internal")
            && r.bytes_out == 17
            && r.bytes_in == 17,
        format!("allowed record: {r:?}"),
    )?;

    // A loopback port off the allowlist: refused at once (no 20 s wait),
    // never reaching the server, on the record as denied.
    let t = std::time::Instant::now();
    let (res, _, err) = exec(
        agent,
        &ExecRequest::shell(format!("echo x | timeout 20 nc 10.0.2.2 {denied}")),
    );
    let took = t.elapsed();
    check(
        !res.success() && took < Duration::from_secs(10),
        format!(
            "denied connect: {res:?} after {took:?}, stderr {:?}",
            String::from_utf8_lossy(&err)
        ),
    )?;
    check(
        matches!(other.accept(), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "the denied server was reached",
    )?;
    let r = logged(&vm, "denied connection", |r| {
        r.protocol == Protocol::Tcp && r.port == denied
    })?;
    check(r.verdict == Verdict::Deny, format!("denied record: {r:?}"))?;

    // A name off the allowlist: NXDOMAIN, logged.
    let (res, out, _) = exec(
        agent,
        &ExecRequest::shell("nslookup denied.forkbox.test 10.0.2.2"),
    );
    let out = String::from_utf8_lossy(&out);
    check(
        !res.success() || out.contains("NXDOMAIN") || out.contains("can't find"),
        format!("denied name answered: {res:?} {out:?}"),
    )?;
    let r = logged(&vm, "denied DNS question", |r| {
        r.protocol == Protocol::Dns && r.name.as_deref() == Some("denied.forkbox.test")
    })?;
    check(r.verdict == Verdict::Deny, format!("dns record: {r:?}"))
}

/// Runs `git` on the host in `dir`.
fn host_git(dir: &std::path::Path, args: &[&str]) -> Result<String, Failed> {
    let out = std::process::Command::new("git")
        .args([
            "-c",
            "user.name=forkbox",
            "-c",
            "user.email=forkbox@localhost",
        ])
        .args(args)
        .current_dir(dir)
        .output()
        .map_err(|e| format!("git {args:?}: {e} (is git installed?)"))?;
    if !out.status.success() {
        return Err(format!("git {args:?}: {}", String::from_utf8_lossy(&out.stderr)).into());
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// What issue 6 asks the network to be good enough for: a guest clones a
/// repository (16 MiB of incompressible files) from a server on the
/// host's loopback, over git's HTTP protocol (a static file server).
fn net_git_clone_from_a_loopback_server() -> TestResult {
    use std::io::Write;
    let tmp = tempfile::tempdir().map_err(|e| format!("tempdir: {e}"))?;
    let work = tmp.path().join("work");
    std::fs::create_dir(&work).map_err(|e| format!("{e}"))?;
    host_git(&work, &["init", "-q"])?;
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    for i in 0..4 {
        let mut f =
            std::fs::File::create(work.join(format!("blob{i}"))).map_err(|e| format!("{e}"))?;
        // xorshift: incompressible, no entropy pool drained.
        let mut buf = vec![0u8; 4 << 20];
        for chunk in buf.chunks_mut(8) {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            chunk.copy_from_slice(&seed.to_le_bytes());
        }
        f.write_all(&buf).map_err(|e| format!("{e}"))?;
    }
    host_git(&work, &["add", "."])?;
    host_git(&work, &["commit", "-qm", "sixteen MiB"])?;
    let head = host_git(&work, &["rev-parse", "HEAD"])?;
    host_git(tmp.path(), &["clone", "-q", "--bare", "work", "repo.git"])?;
    host_git(&tmp.path().join("repo.git"), &["update-server-info"])?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| format!("a free port: {e}"))?
        .port();
    /// Killed and reaped when the trial ends, however it ends.
    struct Server(std::process::Child);
    impl Drop for Server {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _server = std::process::Command::new("python3")
        .args([
            "-m",
            "http.server",
            "--bind",
            "127.0.0.1",
            &port.to_string(),
        ])
        .current_dir(tmp.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .map(Server)
        .map_err(|e| format!("python3 -m http.server: {e}"))?;
    let policy = net_policy(&[format!("host.forkbox.internal:{port}")]);
    let vm = boot_python_net(&policy)?;
    let start = std::time::Instant::now();
    let out = net_sh(
        &vm,
        &format!(
            "i=0; until timeout 5 python3 -c \"import socket; socket.create_connection(('host.forkbox.internal', {port}))\" 2>/dev/null; do \
               i=$((i+1)); [ $i -lt 60 ] || exit 1; sleep 0.5; done; \
             timeout 600 git clone -q http://host.forkbox.internal:{port}/repo.git /tmp/repo && \
             git -C /tmp/repo fsck --no-progress --no-dangling && git -C /tmp/repo rev-parse HEAD && du -sk /tmp/repo/blob0"
        ),
    )?;
    let took = start.elapsed();
    println!(
        "net: git clone + fsck of 16 MiB from the host's loopback: {:.1} s (guest CPU time included)",
        took.as_secs_f64()
    );
    check(
        out.lines().any(|l| l == head) && out.contains("4096\t"),
        format!("the clone: {out:?}, want HEAD {head}"),
    )
}

fn net_vmm_has_no_network_and_an_adopted_vm_reaches_a_new_broker() -> TestResult {
    use forkbox::vm::NetworkSpec;
    let (port, lines) = line_echo_server();
    let policy = net_policy(&[format!("host.forkbox.internal:{port}")]);
    let vm = Vm::boot_with_network(assets(), &VmSpec::default(), Some(&policy))
        .map_err(|e| format!("boot: {e:#}"))?;

    // The VMM sits in a network namespace of its own, with nothing up.
    let ns = |pid: &str| std::fs::read_link(format!("/proc/{pid}/ns/net"));
    let (vmm_ns, own_ns) = (ns(&vm.pid().to_string()), ns("self"));
    check(
        matches!((&vmm_ns, &own_ns), (Ok(a), Ok(b)) if a != b),
        format!("the VMM's network namespace {vmm_ns:?}, ours {own_ns:?}"),
    )?;
    let dev = std::fs::read_to_string(format!("/proc/{}/net/dev", vm.pid()))
        .map_err(|e| format!("the VMM's /proc/net/dev: {e}"))?;
    let ifaces: Vec<&str> = dev
        .lines()
        .skip(2)
        .filter_map(|l| l.split(':').next())
        .collect();
    check(
        ifaces.iter().map(|i| i.trim()).eq(["lo"]),
        format!("the VMM's interfaces: {ifaces:?}"),
    )?;

    let echo = |vm: &Vm, text: &str| -> TestResult {
        let out = net_sh(
            vm,
            &format!("echo {text} | timeout 20 nc host.forkbox.internal {port}"),
        )?;
        check(out.contains(text), format!("echo of {text}: {out:?}"))?;
        let got = lines
            .recv_timeout(Duration::from_secs(10))
            .map_err(|e| format!("server, for {text}: {e}"))?;
        check(got == format!("{text}\n"), format!("server got {got:?}"))
    };
    echo(&vm, "before")?;

    // As if this process died: the VMM runs on, its broker is gone.
    let handle = vm.detach();
    let vm = Vm::adopt(&handle).map_err(|e| format!("adopt: {e:#}"))?;
    let (res, _, _) = exec(
        vm.agent(),
        &ExecRequest::shell(format!(
            "echo orphan | timeout 20 nc host.forkbox.internal {port}"
        )),
    );
    check(
        !res.success() && lines.try_recv().is_err(),
        format!("a connection without a broker: {res:?}"),
    )?;
    // Adopted again with a network: the VMM reaches the new broker, and
    // goes on appending to the log it was started with.
    let handle = vm.detach();
    let network = NetworkSpec {
        policy,
        egress_log: None,
    };
    let vm =
        Vm::adopt_with_network(&handle, Some(&network)).map_err(|e| format!("adopt: {e:#}"))?;
    echo(&vm, "after")?;
    let log = vm.egress_log(1000).map_err(|e| format!("{e:#}"))?;
    let to_port = log.iter().filter(|r| r.port == port).count();
    check(
        to_port == 3,
        format!("before, orphan and after on the record: {log:#?}"),
    )
}

fn net_fork_child_connections_are_its_own() -> TestResult {
    use forkbox_net::policy::{Protocol, Verdict};
    let (port, lines) = line_echo_server();
    let sink = std::net::TcpListener::bind("127.0.0.1:0").expect("bind loopback");
    let sink_port = sink.local_addr().expect("addr").port();
    let policy = net_policy(&[
        format!("host.forkbox.internal:{port}"),
        format!("host.forkbox.internal:{sink_port}"),
    ]);
    let mut vm = Vm::boot_with_network(assets(), &VmSpec::default(), Some(&policy))
        .map_err(|e| format!("boot: {e:#}"))?;
    // Throughput guest → host loopback, for docs/SPEC.md (printed only; the
    // time limit is ten times what the slowest run here needed: a
    // behaviour check, not a timing one).
    let counted = std::thread::spawn(move || -> std::io::Result<(u64, Duration)> {
        use std::io::{Read, Write};
        let (mut c, _) = sink.accept()?;
        let t = std::time::Instant::now();
        let mut buf = vec![0u8; 256 * 1024];
        let mut n = 0u64;
        loop {
            match c.read(&mut buf)? {
                0 => break,
                k => n += k as u64,
            }
        }
        let took = t.elapsed();
        c.write_all(b"done\n")?;
        Ok((n, took))
    });
    let out = net_sh(
        &vm,
        &format!(
            "dd if=/dev/zero bs=64k count=256 2>/dev/null | timeout 300 nc 10.0.2.2 {sink_port}"
        ),
    )?;
    match counted.join() {
        Ok(Ok((n, took))) => eprintln!(
            "net: guest -> host loopback: {n} bytes in {:.2} s = {:.0} Mbit/s ({out:?})",
            took.as_secs_f64(),
            n as f64 * 8.0 / took.as_secs_f64() / 1e6
        ),
        other => eprintln!(
            "net: throughput not measured: {:?}",
            other.map(|r| r.map(|_| ()))
        ),
    }

    let child = fork(&mut vm, 1)?.remove(0);
    let out = net_sh(
        &child,
        &format!("echo from-child | timeout 20 nc 10.0.2.2 {port}"),
    )?;
    check(out.contains("from-child"), format!("child echo: {out:?}"))?;
    let got = lines
        .recv_timeout(Duration::from_secs(10))
        .map_err(|e| format!("server: {e}"))?;
    check(got == "from-child\n", format!("server got {got:?}"))?;
    let r = logged(&child, "the child's connection", |r| {
        r.protocol == Protocol::Tcp && r.port == port
    })?;
    check(r.verdict == Verdict::Allow, format!("child record: {r:?}"))?;
    check(
        child.egress_log_path() != vm.egress_log_path(),
        "child and parent share a log path",
    )?;
    let parent = vm.egress_log(1000).map_err(|e| format!("{e:#}"))?;
    check(
        !parent.iter().any(|r| r.port == port),
        format!("the child's connection is in the parent's log: {parent:#?}"),
    )?;
    // The parent still connects, on its own record.
    let out = net_sh(
        &vm,
        &format!("echo from-parent | timeout 20 nc 10.0.2.2 {port}"),
    )?;
    check(out.contains("from-parent"), format!("parent echo: {out:?}"))?;
    logged(&vm, "the parent's connection", |r| {
        r.protocol == Protocol::Tcp && r.port == port
    })?;
    let child_log = child.egress_log(1000).map_err(|e| format!("{e:#}"))?;
    check(
        child_log.iter().filter(|r| r.port == port).count() == 1,
        format!("the parent's connection is in the child's log: {child_log:#?}"),
    )
}

/// A `python3 -c` program in the guest (the `debian` image) that must
/// succeed; its stdout. `on_line` sees each stdout line as it arrives, while
/// the program still runs.
fn net_python(
    vm: &Vm,
    script: &str,
    args: &[String],
    on_line: &mut dyn FnMut(&str),
) -> Result<String, Failed> {
    let mut argv = vec!["python3".to_owned(), "-c".to_owned(), script.to_owned()];
    argv.extend_from_slice(args);
    let (mut out, mut err, mut line) = (Vec::new(), Vec::new(), Vec::new());
    let r = vm
        .agent()
        .exec(
            &ExecRequest::argv(argv).timeout(Duration::from_secs(300)),
            None,
            &mut |s, b| match s {
                OutputStream::Stdout => {
                    out.extend_from_slice(b);
                    line.extend_from_slice(b);
                    while let Some(i) = line.iter().position(|c| *c == b'\n') {
                        let l: Vec<u8> = line.drain(..=i).collect();
                        on_line(String::from_utf8_lossy(&l).trim_end());
                    }
                }
                OutputStream::Stderr => err.extend_from_slice(b),
            },
        )
        .map_err(|e| format!("python3: {e:#}"))?;
    if !r.success() {
        return Err(format!(
            "python3 {args:?}: {r:?}\nstderr: {}\nserial:\n{}",
            String::from_utf8_lossy(&err),
            vm.serial_tail(20)
        )
        .into());
    }
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// Sequential connection attempts to each `port count` pair; one JSON line
/// of outcome counts per port (`ECONNREFUSED`, `timeout`, `connected`).
const NET_ATTEMPTS: &str = "
import errno, json, socket, sys
a = [int(x) for x in sys.argv[1:]]
res = {}
for port, n in zip(a[0::2], a[1::2]):
    out = res.setdefault(str(port), {})
    for _ in range(n):
        s = socket.socket()
        s.settimeout(30)
        try:
            s.connect(('10.0.2.2', port))
            e = 'connected'
        except socket.timeout:
            e = 'timeout'
        except OSError as x:
            e = errno.errorcode.get(x.errno, str(x.errno))
        out[e] = out.get(e, 0) + 1
        s.close()
print(json.dumps(res))
";

/// Opens N connections to a server that never reads, keeps writing into
/// them (up to EACH bytes each, for at most FILL seconds), prints one JSON
/// line, holds them HOLD seconds more, closes them.
const NET_HOLD: &str = "
import json, selectors, socket, sys, time
port, n, each, fill, hold = (int(x) for x in sys.argv[1:6])
held, refused = [], 0
for _ in range(n):
    s = socket.socket()
    s.settimeout(30)
    try:
        s.connect(('10.0.2.2', port))
        s.setblocking(False)
        held.append(s)
    except OSError:
        refused += 1
        s.close()
chunk = b'x' * 65536
left = {s: each for s in held}
sel = selectors.DefaultSelector()
for s in held:
    sel.register(s, selectors.EVENT_WRITE)
end = time.monotonic() + fill
while left and time.monotonic() < end:
    for key, _ in sel.select(timeout=1):
        s = key.fileobj
        try:
            left[s] -= s.send(chunk[:min(left[s], len(chunk))])
        except BlockingIOError:
            continue
        if left[s] <= 0:
            del left[s]
            sel.unregister(s)
print(json.dumps({'held': len(held), 'refused': refused, 'sent': sum(each - left.get(s, 0) for s in held)}), flush=True)
time.sleep(hold)
for s in held:
    s.close()
";

/// The VMM's memory outside guest RAM (KiB), and its whole VmRSS (KiB).
fn vmm_memory_kib(vm: &Vm) -> Result<(u64, u64), Failed> {
    let outside =
        forkbox::bench::vmm_overhead_kib(vm.pid()).map_err(|e| format!("the VMM's smaps: {e}"))?;
    let status = std::fs::read_to_string(format!("/proc/{}/status", vm.pid()))
        .map_err(|e| format!("the VMM's status: {e}"))?;
    let rss = forkbox::bench::meminfo_kib(&status, "VmRSS:").ok_or("no VmRSS")?;
    Ok((outside, rss))
}

/// Connection floods (refused by the policy, refused by the host, held
/// open against a server that never reads) cost the VMM a bounded amount
/// of memory, and the network works afterwards. Measured: the VMM's
/// memory outside guest RAM (its VmRSS also counts the guest pages the
/// guest touched, which the flood's guest programs do).
fn net_connect_flood_keeps_vmm_memory_bounded() -> TestResult {
    use forkbox_net::policy::Verdict;
    use std::sync::Arc;
    const MIB: u64 = 1024;
    // crates/net: 256 connections × 512 KiB of socket buffers = 128 MiB,
    // plus 4 MiB of queued frames each way; the rest is slack for the
    // allocator's arenas and the log ring.
    const BOUND_KIB: u64 = (128 + 32) * MIB;
    // Attempts that fail hold nothing once refused.
    const FAILED_BOUND_KIB: u64 = 16 * MIB;
    let (echo, lines) = line_echo_server();
    let denied = std::net::TcpListener::bind("127.0.0.1:0").expect("bind loopback");
    denied.set_nonblocking(true).expect("nonblocking");
    let denied_port = denied.local_addr().expect("addr").port();
    let closed_port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind loopback");
        l.local_addr().expect("addr").port()
    };
    // Accepts, never reads, holds every connection until told to let go.
    let stuck = std::net::TcpListener::bind("127.0.0.1:0").expect("bind loopback");
    let stuck_port = stuck.local_addr().expect("addr").port();
    let stuck_held = Arc::new(Mutex::new(Vec::new()));
    {
        let held = Arc::clone(&stuck_held);
        std::thread::spawn(move || {
            for c in stuck.incoming().flatten() {
                held.lock().unwrap_or_else(|p| p.into_inner()).push(c);
            }
        });
    }
    let policy = net_policy(&[
        format!("host.forkbox.internal:{echo}"),
        format!("host.forkbox.internal:{closed_port}"),
        format!("host.forkbox.internal:{stuck_port}"),
    ]);
    let vm = boot_python_net(&policy)?;
    let attempts = |pairs: &[(u16, usize)]| -> Result<serde_json::Value, Failed> {
        let args: Vec<String> = pairs
            .iter()
            .flat_map(|(p, n)| [p.to_string(), n.to_string()])
            .collect();
        let out = net_python(&vm, NET_ATTEMPTS, &args, &mut |_| {})?;
        serde_json::from_str(out.trim()).map_err(|e| format!("{out:?}: {e}").into())
    };
    let refused = |v: &serde_json::Value, port: u16, n: usize| -> TestResult {
        let got = &v[port.to_string()];
        check(
            got["ECONNREFUSED"].as_u64() == Some(n as u64),
            format!("{n} attempts at port {port} ended {got}"),
        )
    };

    // Warm up every path once, then the baseline.
    attempts(&[(denied_port, 5), (closed_port, 5)])?;
    let before = vmm_memory_kib(&vm)?;

    // Round 1: attempts refused by the policy and by the host.
    let (n_denied, n_closed) = (1500, 1000);
    let v = attempts(&[(denied_port, n_denied), (closed_port, n_closed)])?;
    refused(&v, denied_port, n_denied)?;
    refused(&v, closed_port, n_closed)?;
    let after_failed = vmm_memory_kib(&vm)?;

    // Connections held open, written into, against a server that never
    // reads: past the gateway's 256 connections the rest are refused.
    let mut mid = None;
    let mut mid_err = None;
    let hold_args: Vec<String> = [stuck_port as u64, 300, 1 << 20, 40, 3]
        .iter()
        .map(u64::to_string)
        .collect();
    let out = net_python(
        &vm,
        NET_HOLD,
        &hold_args,
        &mut |_| match vmm_memory_kib(&vm) {
            Ok(m) => mid = Some(m),
            Err(e) => mid_err = Some(e),
        },
    )?;
    let mid = match (mid, mid_err) {
        (Some(m), _) => m,
        (None, Some(e)) => return Err(e),
        (None, None) => return Err(format!("no line while held: {out:?}").into()),
    };
    let held: serde_json::Value =
        serde_json::from_str(out.trim()).map_err(|e| format!("{out:?}: {e}"))?;
    let n_held = held["held"].as_u64().unwrap_or(0);
    check(
        (200..=256).contains(&n_held),
        format!("held connections: {held} (the gateway allows 256)"),
    )?;
    stuck_held.lock().unwrap_or_else(|p| p.into_inner()).clear();

    // Round 2: more refused attempts after the held ones are gone.
    let (n_denied2, n_closed2) = (500, 500);
    let v = attempts(&[(denied_port, n_denied2), (closed_port, n_closed2)])?;
    refused(&v, denied_port, n_denied2)?;
    refused(&v, closed_port, n_closed2)?;
    let after = vmm_memory_kib(&vm)?;

    let figures = format!(
        "VMM memory outside guest RAM (VmRSS) in KiB: before {} ({}), after {} refused attempts {} ({}), \
         {n_held} held ({held}) {} ({}), after {} more refused {} ({})",
        before.0,
        before.1,
        n_denied + n_closed,
        after_failed.0,
        after_failed.1,
        mid.0,
        mid.1,
        n_denied2 + n_closed2,
        after.0,
        after.1
    );
    eprintln!("net flood: {figures}");
    check(
        after_failed.0.saturating_sub(before.0) <= FAILED_BOUND_KIB,
        format!("refused attempts grew the VMM by more than {FAILED_BOUND_KIB} KiB: {figures}"),
    )?;
    check(
        mid.0.saturating_sub(before.0) <= BOUND_KIB
            && after.0.saturating_sub(before.0) <= BOUND_KIB,
        format!("the VMM grew by more than {BOUND_KIB} KiB: {figures}"),
    )?;
    check(
        matches!(denied.accept(), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "a denied attempt reached the host",
    )?;

    // The network still works: a new connection echoes (retried while the
    // gateway lets go of the held connections).
    let out = net_python(
        &vm,
        "
import socket, sys, time
end = time.monotonic() + 60
while True:
    try:
        s = socket.create_connection(('10.0.2.2', int(sys.argv[1])), timeout=20)
        break
    except OSError:
        if time.monotonic() > end:
            raise
        time.sleep(0.5)
s.sendall(b'after-the-flood\\n')
print(s.makefile().readline().strip())
",
        &[echo.to_string()],
        &mut |_| {},
    )?;
    check(
        out.trim() == "after-the-flood",
        format!("echo after: {out:?}"),
    )?;
    let got = lines
        .recv_timeout(Duration::from_secs(10))
        .map_err(|e| format!("server: {e}"))?;
    check(got == "after-the-flood\n", format!("server got {got:?}"))?;

    // Every refused attempt is on the record, once (a SYN the guest sent
    // again may add one): bounded by the attempts, not amplified.
    let total_denied = n_denied + n_denied2 + 5;
    let total_closed = n_closed + n_closed2 + 5;
    let start = std::time::Instant::now();
    loop {
        let log = vm.egress_log(100_000).map_err(|e| format!("{e:#}"))?;
        let denied_records = log
            .iter()
            .filter(|r| r.port == denied_port && r.verdict == Verdict::Deny)
            .count();
        let closed_records = log.iter().filter(|r| r.port == closed_port).count();
        let ok = denied_records >= total_denied && closed_records >= total_closed;
        if ok || start.elapsed() > Duration::from_secs(10) {
            let attempts_made = total_denied + total_closed + 300 + 1;
            return check(
                ok && log.len() <= 2 * attempts_made,
                format!(
                    "egress log: {denied_records} denied records for {total_denied} attempts, \
                     {closed_records} for {total_closed} attempts at the closed port, {} records in all \
                     for {attempts_made} attempts",
                    log.len()
                ),
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// A server on the test process's loopback that echoes every line of every
/// connection (each on its own thread) and reports the lines.
fn lines_echo_server() -> (u16, std::sync::mpsc::Receiver<String>) {
    use std::io::{BufRead, BufReader, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind loopback");
    let port = listener.local_addr().expect("local addr").port();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            let tx = tx.clone();
            std::thread::spawn(move || {
                let Ok(read) = conn.try_clone() else { return };
                for line in BufReader::new(read).lines() {
                    let Ok(line) = line else { return };
                    if conn.write_all(format!("{line}\n").as_bytes()).is_err()
                        || tx.send(line).is_err()
                    {
                        return;
                    }
                }
            });
        }
    });
    (port, rx)
}

/// Connects (retrying up to 10 s while the new policy reaches the VMM),
/// echoes `held-1`, says `ready` in /tmp/holder.state, waits for /tmp/go,
/// echoes `held-2` on the same connection, says `done`.
const NET_HOLDER: &str = "
import os, socket, sys, time
port = int(sys.argv[1])
end = time.monotonic() + 10
while True:
    try:
        s = socket.create_connection(('10.0.2.2', port), timeout=20)
        break
    except OSError:
        if time.monotonic() > end:
            raise
        time.sleep(0.2)
f = s.makefile('rw')
def echo(word):
    f.write(word + '\\n')
    f.flush()
    return f.readline().strip()
def state(text):
    open('/tmp/holder.new', 'w').write(text + '\\n')
    os.rename('/tmp/holder.new', '/tmp/holder.state')
state('ready ' + echo('held-1'))
while not os.path.exists('/tmp/go'):
    time.sleep(0.1)
state('done ' + echo('held-2'))
";

/// A VM's policy replaced while it runs: new connections follow the new
/// one at once, in both directions, each attempt on the record; a
/// connection opened while allowed stays open after the deny.
fn net_policy_changed_at_runtime_takes_effect() -> TestResult {
    use forkbox_net::policy::{Protocol, Verdict};
    let (port, lines) = lines_echo_server();
    let deny_all = net_policy(&[]);
    let allow = net_policy(&[format!("host.forkbox.internal:{port}")]);
    let vm = boot_python_net(&deny_all)?;
    let attempt = |what: &str| -> Result<serde_json::Value, Failed> {
        let out = net_python(
            &vm,
            NET_ATTEMPTS,
            &[port.to_string(), "1".into()],
            &mut |_| {},
        )?;
        let v: serde_json::Value =
            serde_json::from_str(out.trim()).map_err(|e| format!("{what}: {out:?}: {e}"))?;
        Ok(v[port.to_string()].clone())
    };
    let tcp_records = || -> Result<Vec<forkbox_net::log::EgressRecord>, Failed> {
        Ok(vm
            .egress_log(1000)
            .map_err(|e| format!("{e:#}"))?
            .into_iter()
            .filter(|r| r.protocol == Protocol::Tcp && r.port == port)
            .collect())
    };

    // Deny-all at boot: refused, on the record as denied.
    let got = attempt("under deny-all")?;
    check(
        got["ECONNREFUSED"] == 1,
        format!("connect under deny-all: {got}"),
    )?;
    let r = logged(&vm, "the denied attempt", |r| {
        r.protocol == Protocol::Tcp && r.port == port
    })?;
    check(r.verdict == Verdict::Deny, format!("first record: {r:?}"))?;

    // Allowed: a connection that stays open, and a fresh one.
    vm.set_network_policy(&allow)
        .map_err(|e| format!("allowing: {e:#}"))?;
    let holder = format!(
        "rm -f /tmp/go /tmp/holder.state; \
         (python3 -c \"$HOLDER\" {port} >/tmp/holder.log 2>&1 &) </dev/null; \
         i=0; while [ $i -lt 300 ] && ! [ -e /tmp/holder.state ]; do sleep 0.1; i=$((i+1)); done; \
         cat /tmp/holder.state /tmp/holder.log"
    );
    let out = {
        let (res, out, err) = exec(
            vm.agent(),
            &ExecRequest::shell(holder).env("HOLDER", NET_HOLDER),
        );
        check(
            res.success(),
            format!("holder: {res:?} {}", String::from_utf8_lossy(&err)),
        )?;
        String::from_utf8_lossy(&out).into_owned()
    };
    check(
        out.starts_with("ready held-1"),
        format!(
            "the connection opened after allowing: {out:?}\nlog: {:#?}",
            tcp_records()?
        ),
    )?;
    let got = attempt("allowed")?;
    check(
        got["connected"] == 1,
        format!("connect once allowed: {got}"),
    )?;
    let n_allowed = tcp_records()?
        .iter()
        .filter(|r| r.verdict == Verdict::Allow)
        .count();
    check(
        n_allowed >= 1,
        format!("no allowed record: {:#?}", tcp_records()?),
    )?;

    // Denied again: a new connection is refused at once and logged…
    vm.set_network_policy(&deny_all)
        .map_err(|e| format!("denying: {e:#}"))?;
    let before = tcp_records()?.len();
    let got = attempt("denied again")?;
    check(
        got["ECONNREFUSED"] == 1,
        format!("connect after denying again: {got}"),
    )?;
    let start = std::time::Instant::now();
    let newest = loop {
        let records = tcp_records()?;
        if records.len() > before {
            break records.last().cloned();
        }
        if start.elapsed() > Duration::from_secs(10) {
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    check(
        newest
            .as_ref()
            .is_some_and(|r| r.verdict == Verdict::Deny && r.bytes_out == 0),
        format!("the attempt after denying again: {newest:?}"),
    )?;
    // …while the connection opened under the allow keeps working.
    let out = sh(
        vm.agent(),
        "touch /tmp/go; i=0; while [ $i -lt 300 ] && ! grep -q done /tmp/holder.state; do sleep 0.1; i=$((i+1)); done; \
         cat /tmp/holder.state /tmp/holder.log",
    )?;
    check(
        out.starts_with("done held-2"),
        format!("the open connection after denying: {out:?}"),
    )?;
    let mut heard = Vec::new();
    while let Ok(l) = lines.recv_timeout(Duration::from_secs(2)) {
        heard.push(l);
    }
    check(
        heard == ["held-1", "held-2"],
        format!("the server heard {heard:?}"),
    )
}
