//! The emulated KVM host ("test bed"): where forkbox runs its microVMs on
//! machines without hardware virtualization.
//!
//! QEMU's software emulator (TCG) with an SVM-capable CPU boots Debian's
//! generic kernel, which loads `kvm_amd` and so has a working `/dev/kvm`.
//! Its init (busybox) mounts this machine's root filesystem read-only over
//! 9p, under a tmpfs overlay so that every path is there and writable with
//! nothing written back, chroots into it, and runs one command at the same working directory
//! with the same environment, so every forkbox binary, test program and
//! cached guest asset is at the same path inside as outside. The command's
//! stdout, stderr and exit status come back through a second, writable 9p
//! share, and are streamed to the caller as they are written.

pub mod suite;
pub mod wedge;

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::debs::{self, DebError};
use crate::initramfs::{self, Entry, InitramfsError};
use crate::kernel::{Kernel, KernelError};

/// Modules the emulated host loads: KVM for AMD, 9p over virtio-pci for the
/// shared root, and overlayfs to make it writable.
const MODULES: &[&str] = &[
    "kvm_amd",
    "9p",
    "9pnet_virtio",
    "virtio_pci",
    "overlay",
    // The scratch disk under the overlay ([`scratch_disk`]).
    "crc32c_generic",
    "virtio_blk",
    "ext4",
];

/// Size of an emulated host's scratch disk (sparse: only what is written
/// takes this machine's disk, and it is deleted with the host).
const SCRATCH_GIB: u64 = 64;

/// Where an emulated host's writes go (the upper layer of the overlay
/// over this machine's root): an ext4 disk of its own, made here, so that
/// what its VMs write to files (their writable disks' tops, logs) is on a
/// disk whose page cache the kernel can write back and drop, as on a real
/// host, not in its RAM (a tmpfs's pages count as the writer's memory:
/// a VMM writing its disk would be killed at its cgroup's memory limit).
fn scratch_disk() -> Result<tempfile::NamedTempFile, TestbedError> {
    let file = tempfile::Builder::new()
        .prefix("forkbox-testbed-disk-")
        .tempfile()
        .map_err(|source| TestbedError::Io {
            path: std::env::temp_dir(),
            source,
        })?;
    let path = file.path().to_owned();
    let io = |source| TestbedError::Io {
        path: path.clone(),
        source,
    };
    file.as_file().set_len(SCRATCH_GIB << 30).map_err(io)?;
    let out = Command::new("mke2fs")
        .args(["-q", "-F", "-t", "ext4", "-m", "0"])
        .args(["-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard"])
        .arg(&path)
        .output()
        .map_err(io)?;
    if !out.status.success() {
        return Err(io(std::io::Error::other(format!(
            "mke2fs: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))));
    }
    Ok(file)
}

/// The CPU QEMU emulates: everything TCG implements, SVM and nested paging
/// included, which is what `kvm_amd` needs (not `qemu64`: it lacks XSAVE;
/// `EPYC,+svm` also works but makes QEMU warn about features TCG lacks).
const CPU: &str = "max";

const INIT: &str = include_str!("init.sh");

#[derive(Debug, thiserror::Error)]
pub enum TestbedError {
    #[error("preparing the emulated host's kernel")]
    Kernel(#[from] KernelError),
    #[error("preparing busybox for the emulated host")]
    Busybox(#[from] DebError),
    #[error("building the emulated host's initramfs")]
    Initramfs(#[from] InitramfsError),
    #[error("cannot start qemu-system-x86_64 (install it: `apt-get install qemu-system-x86`)")]
    Qemu(#[source] std::io::Error),
    #[error("test bed I/O on {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Is this process already inside the emulated host?
pub fn inside() -> bool {
    std::env::var_os("FORKBOX_IN_TESTBED").is_some()
}

/// Does this machine's KVM run a stock guest kernel at native speed?
/// False where `/dev/kvm` is missing, or is `kvm_pvm` (a software
/// hypervisor), or the CPU has neither VMX nor SVM.
pub fn hardware_virtualization() -> bool {
    if !Path::new("/dev/kvm").exists() || Path::new("/sys/module/kvm_pvm").exists() {
        return false;
    }
    crate::measure::cpu_has_flag(&["vmx", "svm"])
}

/// Where this process can run microVMs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Environment {
    /// KVM backed by VMX/SVM: microVMs run directly.
    HardwareVirtualization,
    /// Inside forkbox's emulated KVM host: microVMs run, slowly.
    EmulatedHost,
    /// No usable KVM here: microVMs must run inside the emulated host.
    NeedsEmulatedHost,
}

impl Environment {
    pub fn detect() -> Self {
        if inside() {
            Environment::EmulatedHost
        } else if hardware_virtualization() {
            Environment::HardwareVirtualization
        } else {
            Environment::NeedsEmulatedHost
        }
    }

    /// How benchmark output names the environment it ran in.
    pub fn label(self) -> &'static str {
        match self {
            Environment::HardwareVirtualization => "hardware virtualization",
            Environment::EmulatedHost | Environment::NeedsEmulatedHost => {
                "emulated KVM host (QEMU TCG with SVM): absolute times inflated, ratios hold"
            }
        }
    }
}

/// The notice printed whenever forkbox moves work into the emulated host.
pub const NOTICE: &str = "no hardware virtualization here: running inside an emulated host; timings are not representative";

/// Runs this very program again, with `args`, inside the emulated host,
/// streaming its output; returns its exit code, or explains what failed.
pub fn rerun_inside(args: Vec<String>, timeout: Duration) -> Result<i32, TestbedError> {
    let (argv, outcome) = rerun_inside_with(args, timeout, |_| {})?;
    Ok(report(&argv, timeout, outcome))
}

/// Like [`rerun_inside`], with `adjust` setting more [`RunOptions`] (a
/// shared directory, environment) first; returns the command line and how
/// it ended, so that a caller can tell a dead host from an exit code (see
/// [`report`]).
pub fn rerun_inside_with(
    args: Vec<String>,
    timeout: Duration,
    adjust: impl FnOnce(&mut RunOptions),
) -> Result<(Vec<String>, Outcome), TestbedError> {
    let exe = std::env::current_exe().map_err(|source| TestbedError::Io {
        path: "/proc/self/exe".into(),
        source,
    })?;
    eprintln!("forkbox: {NOTICE}");
    let tb = Testbed::prepare()?;
    let mut argv = vec![exe.display().to_string()];
    argv.extend(args);
    let mut opts = RunOptions::new(argv.clone());
    opts.timeout = timeout;
    opts.path_prefix = exe.parent().map(Path::to_owned).into_iter().collect();
    adjust(&mut opts);
    let outcome = tb.run(&opts)?;
    Ok((argv, outcome))
}

/// Turns an outcome into an exit code, printing what went wrong if the
/// command did not simply exit: 124 for a timeout, 125 for a dead host.
pub fn report(argv: &[String], timeout: Duration, outcome: Outcome) -> i32 {
    report_labelled("", argv, timeout, outcome)
}

/// Like [`report`], its first line after `label` (`[sdk 1/2] `).
pub fn report_labelled(label: &str, argv: &[String], timeout: Duration, outcome: Outcome) -> i32 {
    match outcome {
        Outcome::Exited(code) => code,
        Outcome::TimedOut { serial_tail, cpus } => {
            eprintln!(
                "{label}forkbox testbed: `{}` did not finish within {} s; the emulated host was stopped.\n--- its CPUs, from QEMU's monitor ---\n{cpus}\n--- emulated host serial log (tail) ---\n{serial_tail}",
                argv.join(" "),
                timeout.as_secs()
            );
            124
        }
        Outcome::HostDied {
            serial_tail,
            qemu_stderr,
        } => {
            eprintln!(
                "{label}forkbox testbed: the emulated host stopped before `{}` finished.\n--- qemu stderr ---\n{}\n--- emulated host serial log (tail) ---\n{serial_tail}",
                argv.join(" "),
                qemu_stderr.trim()
            );
            125
        }
        Outcome::Wedged {
            serial_tail,
            cpus,
            stuck,
        } => {
            eprintln!(
                "{label}forkbox testbed: the emulated host's CPU stopped making progress under `{}`: the same instruction, with an interrupt it should have taken pending, for {} s (QEMU's emulation is stuck; a test-bed fault, not the command's). The emulated host was stopped.\n--- its CPUs, from QEMU's monitor ---\n{cpus}\n--- emulated host serial log (tail) ---\n{serial_tail}",
                argv.join(" "),
                stuck.as_secs()
            );
            125
        }
    }
}

/// What to run inside the emulated host.
#[derive(Debug, Clone)]
pub struct RunOptions {
    pub argv: Vec<String>,
    pub cwd: PathBuf,
    pub timeout: Duration,
    pub memory_mib: u32,
    pub cpus: u32,
    /// Directories put first on the command's PATH (forkbox's binaries).
    pub path_prefix: Vec<PathBuf>,
    /// A directory of this machine the command may write to, at the same
    /// path inside (everything else is read-only there). What is written
    /// outlives the emulated host, even one that crashes.
    pub share: Option<PathBuf>,
    /// Variables set for the command, after this process's own.
    pub env: Vec<(String, String)>,
    /// Put before every line of the command's output (`[shard 2] `), for
    /// emulated hosts that run side by side.
    pub label: Option<String>,
}

impl RunOptions {
    pub fn new(argv: Vec<String>) -> Self {
        Self {
            argv,
            cwd: std::env::current_dir().unwrap_or_else(|_| "/".into()),
            timeout: Duration::from_secs(3600),
            memory_mib: 6144,
            cpus: default_cpus(),
            path_prefix: Vec::new(),
            share: None,
            env: Vec::new(),
            label: None,
        }
    }
}

/// CPUs of an emulated host: one, unless FORKBOX_TESTBED_CPUS says
/// otherwise. With two emulated CPUs, the emulated host's KVM lost a few
/// guests in a hundred to triple faults and hangs under load (and its own
/// kernel crashed now and then); with one, none of hundreds of fork
/// children was lost (docs/SPEC.md, "The test bed"). Work that wants
/// more CPUs runs in several one-CPU hosts side by side ([`shards`]).
pub fn default_cpus() -> u32 {
    std::env::var("FORKBOX_TESTBED_CPUS")
        .ok()
        .and_then(|c| c.parse().ok())
        .filter(|&c| c > 0)
        .unwrap_or(1)
}

/// How many one-CPU emulated hosts to run side by side: one per host CPU
/// (each emulated CPU is one QEMU thread), at most `max`; FORKBOX_TESTBED_SHARDS
/// overrides.
pub fn shards(max: usize) -> usize {
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    std::env::var("FORKBOX_TESTBED_SHARDS")
        .ok()
        .and_then(|c| c.parse().ok())
        .filter(|&c| c > 0)
        .unwrap_or(cpus)
        .clamp(1, max.max(1))
}

/// A command for `program` that is sent SIGKILL when the thread that
/// started it ends (`setpriv --pdeathsig`, util-linux, which then execs
/// it): an emulated host is started and waited for by one thread
/// ([`Testbed::run_with`]), so a `forkbox testbed run` that is killed
/// leaves no QEMU running on its own. Without `setpriv` on `PATH`, the
/// program is started as it is.
fn ends_with_its_starter(program: &str) -> Command {
    let setpriv = std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|dir| dir.join("setpriv"))
            .find(|p| p.is_file())
    });
    match setpriv {
        Some(setpriv) => {
            let mut cmd = Command::new(setpriv);
            cmd.args(["--pdeathsig", "KILL", "--", program]);
            cmd
        }
        None => Command::new(program),
    }
}

/// How a run inside the emulated host ended.
#[derive(Debug)]
pub enum Outcome {
    /// The command ran to completion with this exit status.
    Exited(i32),
    /// The time limit passed; QEMU was killed. `cpus` is what its monitor
    /// said of the emulated CPUs just before (where each one was, whether
    /// it was halted and what its local APIC held), to tell a stuck
    /// emulated host from a slow or blocked command.
    TimedOut { serial_tail: String, cpus: String },
    /// The emulated host stopped before the command finished.
    HostDied {
        serial_tail: String,
        qemu_stderr: String,
    },
    /// An emulated CPU showed the same instruction with an interrupt it
    /// should have taken for `stuck` ([`wedge`]): QEMU stopped running the
    /// emulated host, which was killed. A test-bed fault, like a crash.
    Wedged {
        serial_tail: String,
        cpus: String,
        stuck: Duration,
    },
}

impl Outcome {
    /// The emulated host failed under the command (crashed or wedged): a
    /// fault of the test bed, after which the command may run again in a
    /// new one.
    pub fn host_failed(&self) -> bool {
        matches!(self, Outcome::HostDied { .. } | Outcome::Wedged { .. })
    }
}

/// The assets to boot the emulated host, built once and cached.
pub struct Testbed {
    kernel: Kernel,
    initramfs: PathBuf,
}

impl Testbed {
    pub fn prepare() -> Result<Self, TestbedError> {
        let kernel = Kernel::testbed()?;
        let busybox_dir = debs::unpacked("busybox-static")?;
        let busybox = initramfs::read(&busybox_dir.join("bin/busybox"))?;
        let entries = vec![
            Entry {
                path: "init".into(),
                mode: 0o755,
                data: INIT.as_bytes().to_vec(),
            },
            Entry {
                path: "bin/busybox".into(),
                mode: 0o755,
                data: busybox,
            },
        ];
        let initramfs = initramfs::build("testbed", &kernel, MODULES, entries, &[])?;
        Ok(Self { kernel, initramfs })
    }

    /// Runs `opts.argv` inside a fresh emulated host, streaming its stdout
    /// and stderr to ours as they are produced.
    pub fn run(&self, opts: &RunOptions) -> Result<Outcome, TestbedError> {
        self.run_with(opts, &mut std::io::stdout())
    }

    /// Like [`Testbed::run`], with the command's stdout going to `stdout`.
    pub fn run_with(
        &self,
        opts: &RunOptions,
        stdout: &mut dyn Write,
    ) -> Result<Outcome, TestbedError> {
        let dir = tempfile::Builder::new()
            .prefix("forkbox-testbed-")
            .tempdir()
            .map_err(|source| TestbedError::Io {
                path: std::env::temp_dir(),
                source,
            })?;
        let run = dir.path();
        let io = |path: &Path| {
            let path = path.to_owned();
            move |source| TestbedError::Io { path, source }
        };
        std::fs::write(run.join("cmd.sh"), command_script(opts)).map_err(io(run))?;
        for f in ["stdout", "stderr"] {
            File::create(run.join(f)).map_err(io(run))?;
        }
        let serial = run.join("serial.log");
        let qemu_err = run.join("qemu.stderr");
        // Deleted when this returns, after QEMU has ended.
        let scratch = scratch_disk()?;
        let mut qemu = self
            .qemu_command(run, &serial, scratch.path(), opts)
            .stderr(File::create(&qemu_err).map_err(io(&qemu_err))?)
            .spawn()
            .map_err(TestbedError::Qemu)?;
        let mut watch = CpuWatch::new(
            run.join(MONITOR),
            opts.cpus,
            opts.label.clone().unwrap_or_default(),
        );
        let outcome = match &opts.label {
            None => pump(
                run,
                &mut qemu,
                opts.timeout,
                &mut watch,
                stdout,
                &mut std::io::stderr(),
            ),
            Some(label) => pump(
                run,
                &mut qemu,
                opts.timeout,
                &mut watch,
                &mut Labelled::new(label, stdout),
                &mut Labelled::new(label, std::io::stderr()),
            ),
        }
        .map_err(io(run));
        if watch.nudges > 0 {
            eprintln!(
                "{}forkbox testbed: {} key presses to wake an emulated CPU that owed an interrupt; \
                 it went on after {} of them",
                watch.label, watch.nudges, watch.went_on
            );
        }
        let cpus = match outcome {
            Ok(Some(Pumped::Timeout | Pumped::Wedged(_))) => {
                ask_monitor(&run.join(MONITOR), STALL_QUESTIONS, MONITOR_QUIET)
            }
            _ => String::new(),
        };
        let _ = qemu.kill();
        let _ = qemu.wait();
        let outcome = outcome?;
        Ok(match outcome {
            Some(Pumped::Status(code)) => Outcome::Exited(code),
            Some(Pumped::Timeout) => Outcome::TimedOut {
                serial_tail: tail(&serial, 40),
                cpus,
            },
            Some(Pumped::Wedged(stuck)) => Outcome::Wedged {
                serial_tail: tail(&serial, 40),
                cpus,
                stuck,
            },
            None => Outcome::HostDied {
                serial_tail: tail(&serial, 40),
                qemu_stderr: std::fs::read_to_string(&qemu_err).unwrap_or_default(),
            },
        })
    }

    fn qemu_command(
        &self,
        run: &Path,
        serial: &Path,
        scratch: &Path,
        opts: &RunOptions,
    ) -> Command {
        let mut cmd = ends_with_its_starter("qemu-system-x86_64");
        // no_timer_check: a loaded machine can emulate so slowly that the
        // kernel's IO-APIC timer check fails and it panics at boot.
        let mut cmdline = format!(
            "console=ttyS0 panic=-1 no_timer_check mitigations=off nokaslr quiet forkbox.run={}",
            run.display()
        );
        if let Some(share) = &opts.share {
            cmdline.push_str(&format!(" forkbox.share={}", share.display()));
            cmd.arg("-virtfs").arg(format!(
                "local,path={},mount_tag=share,security_model=none,multidevs=remap",
                share.display()
            ));
        }
        cmd.args(["-accel", "tcg,thread=multi,tb-size=512"])
            .args(["-cpu", CPU])
            .args(["-smp", &opts.cpus.to_string()])
            .args(["-m", &opts.memory_mib.to_string()])
            .args(["-nodefaults", "-no-reboot", "-display", "none"])
            .arg("-monitor")
            .arg(format!(
                "unix:{},server=on,wait=off",
                run.join(MONITOR).display()
            ))
            .arg("-serial")
            .arg(format!("file:{}", serial.display()))
            .arg("-kernel")
            .arg(&self.kernel.vmlinuz)
            .arg("-initrd")
            .arg(&self.initramfs)
            .args(["-append", &cmdline])
            .arg("-drive")
            .arg(format!(
                "file={},if=virtio,format=raw,cache=unsafe",
                scratch.display()
            ))
            .arg("-virtfs")
            .arg("local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap")
            .arg("-virtfs")
            .arg(format!(
                "local,path={},mount_tag=rundir,security_model=none,multidevs=remap",
                run.display()
            ))
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        cmd
    }
}

enum Pumped {
    Status(i32),
    Timeout,
    /// An emulated CPU wedged, for this long.
    Wedged(Duration),
}

/// How often the emulated CPUs are sampled (a CPU that shows the same
/// instruction with an interrupt owed in two samples in a row is nudged:
/// a stall of 3 to 6 s, under the guest-side timeouts of 10 s and more),
/// and how long one may stay so before its host is given up ([`wedge`]).
const WEDGE_SAMPLE_EVERY: Duration = Duration::from_secs(3);
const WEDGED_AFTER: Duration = Duration::from_secs(60);

/// Samples an emulated host's CPUs through its monitor.
struct CpuWatch {
    monitor: PathBuf,
    cpus: Vec<wedge::Watch>,
    next: Instant,
    /// Key presses sent to wake a CPU that owed an interrupt, and how many
    /// of them it went on after ([`wedge`]).
    nudges: u32,
    nudged: Vec<bool>,
    went_on: u32,
    /// Put before its messages (`[sdk 1/2] `).
    label: String,
}

impl CpuWatch {
    fn new(monitor: PathBuf, cpus: u32, label: String) -> Self {
        Self {
            monitor,
            cpus: (0..cpus).map(|_| wedge::Watch::default()).collect(),
            next: Instant::now() + WEDGE_SAMPLE_EVERY,
            nudges: 0,
            nudged: vec![false; cpus as usize],
            went_on: 0,
            label,
        }
    }

    /// Samples every CPU when it is time; how long one has been wedged,
    /// once one has been for [`WEDGED_AFTER`].
    fn check(&mut self) -> Option<Duration> {
        let now = Instant::now();
        if now < self.next {
            return None;
        }
        self.next = now + WEDGE_SAMPLE_EVERY;
        let mut wedged = None;
        for (i, watch) in self.cpus.iter_mut().enumerate() {
            let select = format!("cpu {i}");
            let text = ask_monitor(
                &self.monitor,
                &[&select, "info registers", "info lapic"],
                SAMPLE_QUIET,
            );
            let sample = wedge::CpuSample::parse(&text, &text);
            wedged = wedged.or(watch.sample(now, sample, WEDGED_AFTER));
            let stuck = watch.stuck(now);
            if self.nudged[i] && stuck.is_none_or(|d| d < WEDGE_SAMPLE_EVERY) {
                self.went_on += 1;
                eprintln!(
                    "{}forkbox testbed: emulated CPU {i} went on after the key press",
                    self.label
                );
            }
            self.nudged[i] = false;
            if stuck.is_some_and(|d| d >= WEDGE_SAMPLE_EVERY) && wedged.is_none() {
                self.nudges += 1;
                self.nudged[i] = true;
                eprintln!(
                    "{}forkbox testbed: emulated CPU {i} has owed an interrupt at the same instruction for {} s \
                     (QEMU's lost-interrupt race, a test-bed fault); pressing a key from the monitor to wake it \
                     (nudge {} of this host)",
                    self.label,
                    stuck.unwrap_or_default().as_secs(),
                    self.nudges
                );
                ask_monitor(&self.monitor, &["sendkey shift"], SAMPLE_QUIET);
            }
        }
        wedged
    }
}

/// Copies new stdout/stderr bytes to ours until the status file appears,
/// QEMU exits (`None`), the time limit passes or an emulated CPU wedges.
fn pump(
    run: &Path,
    qemu: &mut Child,
    timeout: Duration,
    watch: &mut CpuWatch,
    stdout: &mut dyn Write,
    stderr: &mut dyn Write,
) -> std::io::Result<Option<Pumped>> {
    let start = Instant::now();
    let mut out = Follower::open(&run.join("stdout"))?;
    let mut err = Follower::open(&run.join("stderr"))?;
    let status = run.join("status");
    loop {
        out.copy_to(stdout)?;
        err.copy_to(stderr)?;
        if let Ok(text) = std::fs::read_to_string(&status) {
            if let Ok(code) = text.trim().parse() {
                out.copy_to(stdout)?;
                err.copy_to(stderr)?;
                return Ok(Some(Pumped::Status(code)));
            }
        }
        if qemu.try_wait()?.is_some() {
            out.copy_to(stdout)?;
            err.copy_to(stderr)?;
            return Ok(None);
        }
        if start.elapsed() > timeout {
            return Ok(Some(Pumped::Timeout));
        }
        if let Some(stuck) = watch.check() {
            out.copy_to(stdout)?;
            err.copy_to(stderr)?;
            return Ok(Some(Pumped::Wedged(stuck)));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A writer that puts `label` before each whole line (a partial line waits
/// for its end, or for the writer's end), so that the output of hosts run
/// side by side interleaves by lines.
struct Labelled<'a, W: Write> {
    label: &'a str,
    to: W,
    partial: Vec<u8>,
}

impl<'a, W: Write> Labelled<'a, W> {
    fn new(label: &'a str, to: W) -> Self {
        Self {
            label,
            to,
            partial: Vec::new(),
        }
    }
}

impl<W: Write> Write for Labelled<'_, W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.partial.extend_from_slice(buf);
        while let Some(end) = self.partial.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.partial.drain(..=end).collect();
            let mut out = Vec::with_capacity(self.label.len() + line.len());
            out.extend_from_slice(self.label.as_bytes());
            out.extend_from_slice(&line);
            self.to.write_all(&out)?;
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.to.flush()
    }
}

impl<W: Write> Drop for Labelled<'_, W> {
    fn drop(&mut self) {
        if !self.partial.is_empty() {
            let mut out = self.label.as_bytes().to_vec();
            out.append(&mut self.partial);
            out.push(b'\n');
            let _ = self.to.write_all(&out);
        }
    }
}

/// The QEMU monitor's socket, in the run directory.
const MONITOR: &str = "monitor.sock";

/// What to ask the monitor of an emulated host that ran out of time.
/// `info status` says whether QEMU still runs it at all (a paused VM
/// stops its clocks too).
const STALL_QUESTIONS: &[&str] = &["info status", "info registers -a", "info lapic"];

/// How long the monitor must be quiet for its answer to count as whole:
/// for a report, and for a routine sample.
const MONITOR_QUIET: Duration = Duration::from_secs(2);
const SAMPLE_QUIET: Duration = Duration::from_millis(300);

/// Asks QEMU's human monitor `questions` and returns what it answered, or
/// why it could not; an answer ends when the monitor has said nothing
/// more for `quiet`.
fn ask_monitor(socket: &Path, questions: &[&str], quiet: Duration) -> String {
    let talk = || -> std::io::Result<String> {
        let mut monitor = std::os::unix::net::UnixStream::connect(socket)?;
        monitor.set_read_timeout(Some(quiet))?;
        read_until_quiet(&mut monitor); // its greeting
        let mut answers = Vec::new();
        for question in questions {
            monitor.write_all(format!("{question}\n").as_bytes())?;
            answers.extend(read_until_quiet(&mut monitor));
        }
        // Drop the monitor's echo of each question (line editing) and the
        // FPU and vector registers.
        let answers = String::from_utf8_lossy(&answers).replace('\r', "");
        let kept: Vec<&str> = answers
            .lines()
            .filter(|l| !l.contains('\x1b') && !l.starts_with("(qemu)"))
            .filter(|l| {
                !["FPR", "YMM", "XMM", "FCW", "DR"]
                    .iter()
                    .any(|p| l.starts_with(p))
            })
            .collect();
        Ok(kept.join("\n"))
    };
    talk().unwrap_or_else(|e| {
        format!(
            "(QEMU's monitor at {} did not answer: {e})",
            socket.display()
        )
    })
}

/// What `from` sends until it has been quiet for its read timeout (at most
/// 1 MiB).
fn read_until_quiet(from: &mut impl Read) -> Vec<u8> {
    let mut got = Vec::new();
    let mut buf = [0u8; 16 * 1024];
    while got.len() < 1 << 20 {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
    got
}

/// Reads a file that another process appends to.
struct Follower {
    file: File,
    pos: u64,
}

impl Follower {
    fn open(path: &Path) -> std::io::Result<Self> {
        Ok(Self {
            file: File::open(path)?,
            pos: 0,
        })
    }

    fn copy_to(&mut self, to: &mut dyn Write) -> std::io::Result<()> {
        self.file.seek(SeekFrom::Start(self.pos))?;
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = self.file.read(&mut buf)?;
            if n == 0 {
                break;
            }
            to.write_all(&buf[..n])?;
            self.pos += n as u64;
        }
        to.flush()
    }
}

/// The last `lines` lines of a file, for error reports.
pub fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read(path).unwrap_or_default();
    let text = String::from_utf8_lossy(&text);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Single-quotes `s` for a POSIX shell.
fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The script the emulated host runs: same environment (forkbox's binaries
/// first on PATH), same directory, then the command.
fn command_script(opts: &RunOptions) -> String {
    let mut s = String::from("# written by forkbox testbed\n");
    for (k, v) in std::env::vars() {
        if k == "PATH" || k.is_empty() || !k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        {
            continue;
        }
        s.push_str(&format!("export {k}={}\n", quote(&v)));
    }
    let mut path: Vec<String> = opts
        .path_prefix
        .iter()
        .map(|p| p.display().to_string())
        .collect();
    path.push(std::env::var("PATH").unwrap_or_else(|_| "/usr/sbin:/usr/bin:/sbin:/bin".into()));
    s.push_str(&format!("export PATH={}\n", quote(&path.join(":"))));
    s.push_str("export FORKBOX_IN_TESTBED=1\n");
    for (k, v) in &opts.env {
        s.push_str(&format!("export {k}={}\n", quote(v)));
    }
    s.push_str(&format!(
        "export FORKBOX_CACHE={}\n",
        quote(&crate::cache::root().display().to_string())
    ));
    s.push_str(&format!(
        "cd {} || exit 125\n",
        quote(&opts.cwd.display().to_string())
    ));
    let argv: Vec<String> = opts.argv.iter().map(|a| quote(a)).collect();
    s.push_str(&format!("exec {}\n", argv.join(" ")));
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quote_single_quote_survives_shell() {
        let tricky = "it's a \"test\" $HOME `x`";
        let out = Command::new("sh")
            .arg("-c")
            .arg(format!("printf %s {}", quote(tricky)))
            .output()
            .expect("sh");
        assert_eq!(String::from_utf8_lossy(&out.stdout), tricky);
    }

    #[test]
    fn labelled_prefixes_whole_lines_only() {
        let mut out = Vec::new();
        {
            let mut w = Labelled::new("[2] ", &mut out);
            w.write_all(b"one\ntw").expect("write");
            w.write_all(b"o\nthree").expect("write");
        }
        assert_eq!(
            String::from_utf8_lossy(&out),
            "[2] one\n[2] two\n[2] three\n"
        );
    }

    #[test]
    fn command_script_runs_argv_in_cwd() {
        let mut opts = RunOptions::new(vec![
            "sh".into(),
            "-c".into(),
            "pwd; echo \"$FORKBOX_IN_TESTBED\"".into(),
        ]);
        opts.cwd = "/".into();
        let out = Command::new("sh")
            .arg("-c")
            .arg(command_script(&opts))
            .output()
            .expect("sh");
        assert_eq!(String::from_utf8_lossy(&out.stdout), "/\n1\n");
    }
}
