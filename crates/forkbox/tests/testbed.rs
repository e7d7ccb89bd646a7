//! The emulated KVM host, end to end: QEMU really boots, the command's
//! output and status come back, a hung command is ended by the time limit,
//! and `forkbox-vmm` refuses a KVM without hardware virtualization.
//! QEMU's emulator runs anywhere, so these run on every machine.

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use forkbox_host::testbed::Environment;

fn bin(name: &str) -> std::path::PathBuf {
    // target/<profile>/deps/testbed-… → target/<profile>/<name>
    let exe = std::env::current_exe().expect("current_exe");
    let dir = exe.parent().and_then(|d| d.parent()).expect("target dir");
    dir.join(name)
}

fn forkbox() -> Command {
    Command::new(env!("CARGO_BIN_EXE_forkbox"))
}

#[test]
fn testbed_run_streams_output_and_exit_status() {
    let out = forkbox()
        .args(["testbed", "run", "--timeout", "300", "--"])
        .args([
            "sh",
            "-c",
            "echo out-$FORKBOX_IN_TESTBED; echo err >&2; test -c /dev/kvm && exit 7",
        ])
        .output()
        .expect("run forkbox");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(7),
        "stdout: {stdout}\nstderr: {stderr}"
    );
    assert_eq!(stdout, "out-1\n");
    assert!(stderr.contains("err\n"), "stderr: {stderr}");
}

#[test]
fn testbed_run_hung_command_ends_at_time_limit() {
    let out = forkbox()
        .args(["testbed", "run", "--timeout", "20", "--", "sleep", "1000"])
        .output()
        .expect("run forkbox");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(124), "stderr: {stderr}");
    assert!(
        stderr.contains("did not finish within 20 s"),
        "stderr: {stderr}"
    );
    assert!(stderr.contains("serial log"), "stderr: {stderr}");
}

/// A `forkbox testbed run` that is killed takes its emulated host with it
/// (QEMU's parent-death signal): no QEMU is left running on its own.
#[test]
fn testbed_run_killed_leaves_no_qemu_behind() {
    use std::time::Instant;
    let mut runner = forkbox()
        .args(["testbed", "run", "--timeout", "900", "--", "sleep", "1000"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("run forkbox");
    let runner_pid = runner.id();
    // (comm, parent pid, state) of a process, from /proc/PID/stat.
    let stat = |pid: u32| -> Option<(String, u32, char)> {
        let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let (head, tail) = s.rsplit_once(") ")?;
        let comm = head.split_once(" (")?.1.to_owned();
        let mut f = tail.split_whitespace();
        let state = f.next()?.chars().next()?;
        Some((comm, f.next()?.parse().ok()?, state))
    };
    // Generous: a cold cache fetches and builds the host's assets first.
    let deadline = Instant::now() + Duration::from_secs(600);
    let qemu = loop {
        let found = std::fs::read_dir("/proc")
            .expect("/proc")
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
            .find(|&p| {
                stat(p).is_some_and(|(comm, ppid, _)| {
                    ppid == runner_pid && comm.starts_with("qemu-system")
                })
            });
        if let Some(q) = found {
            break q;
        }
        if Instant::now() > deadline || runner.try_wait().ok().flatten().is_some() {
            let _ = runner.kill();
            panic!("no QEMU started under `forkbox testbed run` (pid {runner_pid})");
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    runner.kill().expect("kill the runner");
    runner.wait().expect("reap the runner");
    let deadline = Instant::now() + Duration::from_secs(30);
    while stat(qemu).is_some_and(|(_, _, state)| state != 'Z') {
        if Instant::now() > deadline {
            // Not left running by this test either.
            let _ = Command::new("kill")
                .args(["-9", &qemu.to_string()])
                .status();
            panic!("QEMU {qemu} still ran 30 s after its `forkbox testbed run` was killed");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Runs `cmd` to its end. `guard` is a hang guard, not a performance
/// bound: past it the command is killed and the test fails saying so.
fn output_within(cmd: &mut Command, guard: Duration) -> Output {
    let child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("run {cmd:?} (is it built? `make build`): {e}"));
    let pid = rustix::process::Pid::from_child(&child);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(guard) {
        Ok(out) => out.expect("wait for the command"),
        Err(_) => {
            // Not reaped yet (the waiting thread is still waiting), so
            // the pid is still this child's.
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
            panic!("{cmd:?} had not ended after {guard:?} (a hang guard, not a time limit)");
        }
    }
}

/// The refusal comes from the host check, before the VMM reads its kernel
/// (the paths here do not exist). How long it takes is not asserted.
#[test]
fn vmm_without_hardware_virtualization_refuses_before_loading_a_kernel() {
    let out = output_within(
        Command::new(bin("forkbox-vmm"))
            .args([
                "--kernel",
                "/nonexistent/vmlinuz",
                "--initramfs",
                "/nonexistent/initrd",
            ])
            .args(["--cmdline", "console=ttyS0"])
            .env_remove("FORKBOX_ALLOW_SOFTWARE_KVM"),
        Duration::from_secs(120),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {stderr}");
    match Environment::detect() {
        Environment::NeedsEmulatedHost => {
            assert!(
                stderr.contains("hardware virtualization"),
                "no explanation: {stderr}"
            );
            assert!(
                stderr.contains("forkbox testbed run"),
                "no way out: {stderr}"
            );
            assert!(
                !stderr.contains("/nonexistent/"),
                "looked at its kernel before refusing: {stderr}"
            );
        }
        // With VMX/SVM the VMM must get past the check and fail on the
        // missing kernel instead.
        _ => assert!(
            !stderr.contains("no hardware virtualization"),
            "refused a host that has it: {stderr}"
        ),
    }
}

#[test]
fn testbed_prepare_concurrent_on_empty_cache_all_succeed() {
    let cache = tempfile::tempdir().expect("tempdir");
    let children: Vec<_> = (0..3)
        .map(|_| {
            forkbox()
                .args(["testbed", "prepare"])
                .env("FORKBOX_CACHE", cache.path())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("spawn forkbox")
        })
        .collect();
    for child in children {
        let out = child.wait_with_output().expect("wait");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let downloads = std::fs::read_dir(cache.path().join("debs"))
        .expect("debs dir")
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().ends_with(".deb"))
        .count();
    assert_eq!(downloads, 2, "kernel and busybox, each downloaded once");
}
