//! Integration tier: boots a real kernel with a busybox initramfs and checks
//! how `forkbox-vmm` ends (exit status and final line).
//!
//! Needs hardware virtualization (run the compiled test binary inside
//! `forkbox testbed run -- …` on machines without it), a bzImage at
//! `$FORKBOX_TEST_KERNEL` (e.g. Debian's vmlinuz-6.1.0-*-cloud-amd64) and
//! `/bin/busybox` (static). Without them each test prints why it is skipped
//! and passes.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BUSYBOX: &str = "/bin/busybox";
const TIMEOUT: Duration = Duration::from_secs(180);

struct Env {
    kernel: PathBuf,
    dir: PathBuf,
}

fn env(test: &str) -> Option<Env> {
    let skip = |why: String| {
        eprintln!("SKIPPED {test}: {why}");
        None
    };
    if let Err(e) = forkbox_vmm::host::HostFacts::read().and_then(|f| f.check()) {
        if std::env::var(forkbox_vmm::host::ALLOW_SOFTWARE_KVM_ENV).as_deref() != Ok("1") {
            return skip(format!("{e}"));
        }
    }
    if !Path::new("/dev/kvm").exists() {
        return skip("/dev/kvm is missing".into());
    }
    let Some(kernel) = std::env::var_os("FORKBOX_TEST_KERNEL").map(PathBuf::from) else {
        return skip("FORKBOX_TEST_KERNEL is not set".into());
    };
    if !kernel.exists() || !Path::new(BUSYBOX).exists() {
        return skip(format!("{} or {BUSYBOX} is missing", kernel.display()));
    }
    let dir = std::env::temp_dir().join(format!("forkbox-vmm-test-{test}-{}", std::process::id()));
    fs::create_dir_all(&dir).expect("create the test directory");
    Some(Env { kernel, dir })
}

/// One entry of a newc cpio archive.
fn cpio_entry(out: &mut Vec<u8>, ino: u32, name: &str, mode: u32, rdev: (u32, u32), data: &[u8]) {
    let fields = [
        ino,
        mode,
        0,
        0,
        1,
        0,
        data.len() as u32,
        0,
        0,
        rdev.0,
        rdev.1,
        name.len() as u32 + 1,
        0,
    ];
    out.extend_from_slice(b"070701");
    for f in fields {
        out.extend_from_slice(format!("{f:08x}").as_bytes());
    }
    out.extend_from_slice(name.as_bytes());
    out.push(0);
    out.resize(out.len().next_multiple_of(4), 0);
    out.extend_from_slice(data);
    out.resize(out.len().next_multiple_of(4), 0);
}

/// An initramfs with busybox and `/init` = `script`.
fn initramfs(env: &Env, script: &str) -> PathBuf {
    let busybox = fs::read(BUSYBOX).expect("read busybox");
    let init = format!("#!/bin/busybox sh\n/bin/busybox mount -t proc proc /proc\n{script}\n");
    let mut cpio = Vec::new();
    cpio_entry(&mut cpio, 1, ".", 0o040755, (0, 0), &[]);
    cpio_entry(&mut cpio, 2, "bin", 0o040755, (0, 0), &[]);
    cpio_entry(&mut cpio, 3, "proc", 0o040755, (0, 0), &[]);
    cpio_entry(&mut cpio, 4, "dev", 0o040755, (0, 0), &[]);
    cpio_entry(&mut cpio, 5, "dev/console", 0o020600, (5, 1), &[]);
    cpio_entry(&mut cpio, 6, "bin/busybox", 0o100755, (0, 0), &busybox);
    cpio_entry(&mut cpio, 7, "init", 0o100755, (0, 0), init.as_bytes());
    cpio_entry(&mut cpio, 8, "TRAILER!!!", 0, (0, 0), &[]);
    let path = env.dir.join("initramfs.cpio");
    let mut f = fs::File::create(&path).expect("create the initramfs");
    f.write_all(&cpio).expect("write the initramfs");
    path
}

struct Ended {
    code: Option<i32>,
    stderr: String,
    serial: String,
}

fn boot(env: &Env, script: &str, cmdline: &str, vcpus: u8) -> Ended {
    let initrd = initramfs(env, script);
    let log = env.dir.join("serial.log");
    let _ = fs::remove_file(&log);
    let mut child = Command::new(env!("CARGO_BIN_EXE_forkbox-vmm"))
        .arg("--kernel")
        .arg(&env.kernel)
        .arg("--initramfs")
        .arg(&initrd)
        .arg("--cmdline")
        .arg(format!("console=ttyS0 quiet {cmdline}"))
        .arg("--vcpus")
        .arg(vcpus.to_string())
        .arg("--serial-log")
        .arg(&log)
        .stderr(Stdio::piped())
        .spawn()
        .expect("start forkbox-vmm");
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for forkbox-vmm") {
            break status;
        }
        if start.elapsed() > TIMEOUT {
            let _ = child.kill();
            panic!("forkbox-vmm did not end within {TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let mut stderr = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = std::io::Read::read_to_string(&mut e, &mut stderr);
    }
    Ended {
        code: status.code(),
        stderr,
        serial: fs::read_to_string(&log).unwrap_or_default(),
    }
}

#[test]
fn boot_guest_poweroff_exits_0() {
    let Some(env) = env("poweroff") else { return };
    let end = boot(
        &env,
        "echo \"forkbox-test: init ran on $(/bin/busybox grep -c ^processor /proc/cpuinfo) cpus\"\n/bin/busybox sleep 1\n/bin/busybox poweroff -f",
        "panic=-1",
        2,
    );
    assert_eq!(
        end.code,
        Some(forkbox_vmm::EXIT_POWER_OFF),
        "{}",
        end.stderr
    );
    assert!(end.stderr.contains("forkbox-vmm: guest powered off"));
    assert!(
        end.serial.contains("forkbox-test: init ran on 2 cpus"),
        "{}",
        end.serial
    );
}

#[test]
fn boot_guest_reboot_exits_2() {
    let Some(env) = env("reboot") else { return };
    let end = boot(&env, "/bin/busybox reboot -f", "panic=-1", 1);
    assert_eq!(end.code, Some(forkbox_vmm::EXIT_RESET), "{}", end.stderr);
}

#[test]
fn boot_guest_panic_exits_3_with_panic_line() {
    let Some(env) = env("panic") else { return };
    let end = boot(&env, "echo c > /proc/sysrq-trigger", "panic=-1", 1);
    assert_eq!(end.code, Some(forkbox_vmm::EXIT_PANIC), "{}", end.stderr);
    assert!(
        end.stderr.contains("guest kernel panicked:") && end.stderr.contains("Kernel panic"),
        "{}",
        end.stderr
    );
}
