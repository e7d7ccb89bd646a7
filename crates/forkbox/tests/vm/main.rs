//! Integration tests that boot real microVMs.
//!
//! Where this machine has hardware virtualization they run here; where it
//! does not, this binary re-runs itself in forkbox's emulated KVM hosts
//! (`forkbox_host::testbed::suite`: one-CPU hosts side by side, each with
//! its share of the trials, surviving its host's own crash) and reports
//! what happened there. They never skip.
//!
//! A custom harness (libtest-mimic) so that the decision is made once, and
//! so that one shared VM serves the many small exec and file tests. The
//! trials live by concern in [`machine`], [`exec`], [`fork`] and [`net`];
//! here are the harness's glue and the helpers they share.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Mutex, OnceLock, RwLock};
use std::time::Duration;

use forkbox_host::image::ImageName;
use forkbox_host::testbed::suite::{Ended, Ledger, Suite};
use forkbox_host::testbed::Environment;
use forkbox_host::vm::{vmm_exit, Assets, Vm, VmError, VmSpec};
use forkbox_proto::client::AgentClient;
use forkbox_proto::{ExecRequest, ExitStatus, FileKind, OutputStream, User};
use libtest_mimic::{Arguments, Failed, Trial};

mod disks;
mod docker;
mod exec;
mod fork;
mod images;
mod machine;
mod net;

use disks::*;
use docker::*;
use exec::*;
use fork::*;
use images::*;
use machine::*;
use net::*;

type TestResult = Result<(), Failed>;

fn main() {
    // The host library's warnings (a fork child replaced, a second boot)
    // stay in the suite's output; `FORKBOX_LOG` changes the level.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("FORKBOX_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .without_time()
        .init();
    let args = Arguments::from_args();
    if Environment::detect() == Environment::NeedsEmulatedHost {
        // Build the assets out here: the emulated host sees our files
        // read-only.
        if let Err(e) = Assets::prepare().and_then(|_| {
            forkbox_host::image::ensure(ImageName::Minimal)?;
            // The network flood trial's guest runs python3.
            forkbox_host::image::ensure(ImageName::Debian)?;
            forkbox_host::image::ensure(ImageName::Docker)?;
            Ok(())
        }) {
            eprintln!("vm tests: cannot prepare guest assets: {e:#?}");
            std::process::exit(1);
        }
        // The layered image's trial: imported into the store out here.
        if let Err(e) = fixture_layers() {
            eprintln!("vm tests: cannot import the layered test image: {e:?}");
            std::process::exit(1);
        }
        let forwarded: Vec<String> = std::env::args().skip(1).collect();
        std::process::exit(suite().run_in_emulated_hosts(forwarded));
    }
    eprintln!("vm tests: environment: {}", Environment::detect().label());
    let mine = suite().this_shard();
    let trials = trials()
        .into_iter()
        .filter(|(name, _)| mine.contains(name))
        .collect();
    let conclusion = libtest_mimic::run(&args, resumed(trials));
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

/// The suite as the emulated hosts split it.
fn suite() -> Suite {
    Suite {
        names: trials().iter().map(|(name, _)| *name).collect(),
        seconds: TRIAL_SECONDS,
        default_seconds: 15,
        max_shards: 4,
        timeout: Duration::from_secs(2400),
    }
}

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

/// Within a run resumed after the emulated host crashed: trials that passed
/// before are left out (and named), trials that failed before fail again
/// with their message, the rest run. Every trial records how it ends in
/// the run's [`Ledger`].
fn resumed(trials: Vec<(&'static str, TrialFn)>) -> Vec<Trial> {
    let Some(ledger) = Ledger::from_env() else {
        return trials
            .into_iter()
            .map(|(name, f)| Trial::test(name, f))
            .collect();
    };
    let ended = ledger.ended();
    let mut passed = Vec::new();
    let mut out = Vec::new();
    for (name, f) in trials {
        match ended.iter().find(|(n, _)| n == name).map(|(_, e)| e) {
            Some(Ended::Passed) => passed.push(name),
            Some(Ended::Failed(msg)) => {
                let msg = format!(
                    "failed in an earlier emulated host of this run (which then crashed): {msg}"
                );
                out.push(Trial::test(name, move || Err(msg.into())));
            }
            None => {
                let ledger = ledger.clone();
                out.push(Trial::test(name, move || {
                    ledger.start(name);
                    let result = std::panic::catch_unwind(f).unwrap_or_else(|panic| {
                        let msg = panic
                            .downcast_ref::<String>()
                            .map(String::as_str)
                            .or_else(|| panic.downcast_ref::<&str>().copied())
                            .unwrap_or("panicked");
                        Err(format!("panicked: {msg}").into())
                    });
                    let verdict = match &result {
                        Ok(()) => Ok(()),
                        Err(e) => Err(e.message().unwrap_or("failed")),
                    };
                    ledger.record(name, verdict);
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
            "policy_user_cannot_touch_protected_paths_or_outlive_its_timeout",
            policy_user_cannot_touch_protected_paths_or_outlive_its_timeout,
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
            "files_endless_and_never_ending_reads_are_bounded",
            files_endless_and_never_ending_reads_are_bounded,
        ),
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
            "vm_guest_has_no_nested_virtualization",
            vm_guest_has_no_nested_virtualization,
        ),
        (
            "vmm_environment_scrubbed_and_no_core_dumps",
            vmm_environment_scrubbed_and_no_core_dumps,
        ),
        (
            "vmm_confined_without_capabilities_and_filtered",
            vmm_confined_without_capabilities_and_filtered,
        ),
        (
            "vmm_runs_in_a_cgroup_of_its_own_whose_limits_hold",
            vmm_runs_in_a_cgroup_of_its_own_whose_limits_hold,
        ),
        (
            "vmm_runs_as_its_own_user_who_reaches_nothing_of_roots_or_another_vms",
            vmm_runs_as_its_own_user_who_reaches_nothing_of_roots_or_another_vms,
        ),
        (
            "vmm_forbidden_syscall_ends_it_with_sigsys",
            vmm_forbidden_syscall_ends_it_with_sigsys,
        ),
        (
            "vmm_without_an_owner_ends_after_its_grace",
            vmm_without_an_owner_ends_after_its_grace,
        ),
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
            "vm_nmi_makes_a_given_up_guest_say_where_it_was",
            vm_nmi_makes_a_given_up_guest_say_where_it_was,
        ),
        (
            "vm_guest_kicking_a_queue_in_a_loop_is_still_served",
            vm_guest_kicking_a_queue_in_a_loop_is_still_served,
        ),
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
            "fork_zygote_children_map_a_first_commands_pages_ahead",
            fork_zygote_children_map_a_first_commands_pages_ahead,
        ),
        (
            "fork_64_children_of_a_running_parent_all_answer_an_exec",
            fork_64_children_of_a_running_parent_all_answer_an_exec,
        ),
        (
            "fork_child_ended_by_its_guest_says_so_killed_one_does_not",
            fork_child_ended_by_its_guest_says_so_killed_one_does_not,
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
        (
            "net_star_opens_no_internal_address_nor_single_label_name",
            net_star_opens_no_internal_address_nor_single_label_name,
        ),
        (
            "image_layered_root_boots_stacks_and_forks",
            image_layered_root_boots_stacks_and_forks,
        ),
        (
            "vm_kernel_modules_load_on_demand",
            vm_kernel_modules_load_on_demand,
        ),
        (
            "disk_writable_forks_with_memory_and_holds_only_written_blocks",
            disk_writable_forks_with_memory_and_holds_only_written_blocks,
        ),
        (
            "docker_in_a_sandbox_runs_builds_and_forks_with_containers",
            docker_in_a_sandbox_runs_builds_and_forks_with_containers,
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

/// Longest any guest command of a trial may go unanswered: a hang guard,
/// not a timing (the longest script here loops for two minutes). A guest
/// that stops answering fails its trial instead of holding the suite until
/// the emulated host's limit.
const SH_HANG_GUARD: Duration = Duration::from_secs(600);

/// Runs a shell script that must succeed; returns its stdout. Fails after
/// [`SH_HANG_GUARD`] without an answer; [`answer_within`] says more (the
/// VM's vCPUs and serial log) where the trial has the `Vm`.
fn sh(agent: &AgentClient, script: &str) -> Result<String, Failed> {
    sh_within(agent, script, SH_HANG_GUARD).unwrap_or_else(|| {
        Err(format!(
            "`{script}`: no answer within {SH_HANG_GUARD:?} (hang guard): the guest or its agent stopped answering"
        )
        .into())
    })
}

/// [`sh_unbounded`] on a thread of its own; `None` if no answer came
/// within `limit` (the thread is left behind: the VM's end ends it).
fn sh_within(agent: &AgentClient, script: &str, limit: Duration) -> Option<Result<String, Failed>> {
    let (tx, rx) = std::sync::mpsc::channel();
    let (agent, owned) = (agent.clone(), script.to_owned());
    std::thread::spawn(move || {
        let _ = tx.send(
            sh_unbounded(&agent, &owned).map_err(|e| e.message().unwrap_or_default().to_owned()),
        );
    });
    rx.recv_timeout(limit).ok().map(|r| r.map_err(Failed::from))
}

fn sh_unbounded(agent: &AgentClient, script: &str) -> Result<String, Failed> {
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

/// [`sh`] in `vm`, failing after `limit` with where the VM's vCPUs are,
/// its serial log and whether the guest still answers a second command
/// (a wedged guest, or one only slow at this command), instead of waiting
/// on a guest that does not answer.
fn answer_within(vm: &Vm, script: &str, limit: Duration) -> Result<String, Failed> {
    sh_within(vm.agent(), script, limit).unwrap_or_else(|| {
        let probe = match sh_within(vm.agent(), GUEST_PROBE, Duration::from_secs(30)) {
            Some(Ok(out)) => out,
            Some(Err(e)) => format!("(the probe failed: {e:?})"),
            None => "(no answer within 30 s: the guest or its agent is wedged)".into(),
        };
        Err(format!(
            "no answer to `{script}` within {limit:?} from VMM {}\n--- vCPUs ---\n{}\n--- serial log (tail) ---\n{}\n--- the guest, asked again ---\n{probe}",
            vm.pid(),
            vm.control()
                .vcpus()
                .unwrap_or_else(|e| format!("(not readable: {e})")),
            vm.serial_tail(20)
        )
        .into())
    })
}

/// What a trial that got no answer asks the guest: its load, memory and
/// busiest processes.
const GUEST_PROBE: &str = "cat /proc/loadavg; grep -E 'MemFree|MemAvailable' /proc/meminfo; \
    { ps -eo pid,stat,etime,time,wchan:24,args --sort=-time 2>/dev/null || ps; } | head -n 25";

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
                let sig = forkbox_host::vm::loss_signature(why);
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
