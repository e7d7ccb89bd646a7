//! The `forkbox` command.
#![forbid(unsafe_code)]

use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Parser, Subcommand};
use forkbox_host::image::{self, ImageName};
use forkbox_host::testbed::{self, Environment, RunOptions, Testbed};
use forkbox_host::vm::{Assets, NetworkSpec, RootImage, Vm, VmSpec};
use forkbox_net::policy::Policy;
use forkbox_proto::{ExecRequest, ExitStatus, OutputStream};

mod bench;
mod cli;
mod client;
mod demo;
mod image_cmd;
mod local_daemon;

#[derive(Parser)]
#[command(
    name = "forkbox",
    version,
    about = "Hardware-isolated microVM sandboxes that fork"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Boot a microVM, run CMD in it, stream its output, exit with its code.
    Run {
        #[arg(long, default_value = "minimal")]
        image: ImageName,
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=8))]
        vcpus: u8,
        /// Guest memory in MiB (128 to 16384).
        #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u32).range(128..=16384))]
        memory: u32,
        /// Kill the command after this many seconds.
        #[arg(long)]
        timeout: Option<u64>,
        /// Show the guest's serial console (kernel and agent messages).
        #[arg(long)]
        serial: bool,
        /// Fork the booted VM into N children and run CMD in every one;
        /// output lines are prefixed with the child's index.
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1000))]
        fork: Option<u32>,
        /// With --fork: what to fork from.
        #[arg(long, value_enum, default_value = "zygote", requires = "fork")]
        fork_from: ForkFrom,
        /// Give the VM a network whose egress allows RULE (repeat it:
        /// `host.forkbox.internal:8080`, `*.debian.org:443`, `10.1.0.0/16`);
        /// without it the VM has no network device.
        #[arg(long = "allow-out", value_name = "RULE")]
        allow_out: Vec<String>,
        #[arg(required = true, last = true)]
        argv: Vec<String>,
    },
    /// One GRPO-style step through a forkboxd of our own: bake a warm
    /// `debian` template, fork a group from it, solve, grade, kill; print
    /// fork and exec latency, memory per sandbox and wall time.
    Demo(demo::Options),
    /// Images: the built-in ones, and the store of imported OCI images.
    Image {
        #[command(subcommand)]
        command: image_cmd::ImageCmd,
    },
    /// The emulated KVM host for machines without hardware virtualization.
    Testbed {
        #[command(subcommand)]
        command: TestbedCmd,
    },
    /// Benchmarks: percentiles and ratios, naming the environment.
    Bench {
        #[command(subcommand)]
        what: bench::BenchCmd,
    },
    /// The clients of forkboxd (`daemon`, `template`, `sandbox`, `exec`,
    /// `cp`, `logs`).
    #[command(flatten)]
    Client(cli::ClientCmd),
}

/// What `run --fork` forks.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum ForkFrom {
    /// Make the booted VM a zygote first: forks are O(1) in memory size.
    Zygote,
    /// Fork the running VM; it runs on.
    Running,
}

#[derive(Subcommand)]
enum TestbedCmd {
    /// Boot the emulated host, run CMD inside with forkbox's binaries on its
    /// PATH, stream its output and exit with its status.
    Run {
        /// Time limit for the whole run, in seconds.
        #[arg(long, default_value_t = 3600)]
        timeout: u64,
        /// Memory of the emulated host, in MiB.
        #[arg(long, default_value_t = 6144)]
        memory: u32,
        /// vCPUs of the emulated host [default: 1, or $FORKBOX_TESTBED_CPUS].
        #[arg(long)]
        cpus: Option<u32>,
        /// Run CMD directly where this machine has hardware virtualization
        /// (or is the emulated host already); boot the emulated host only
        /// where microVMs could not run otherwise.
        #[arg(long)]
        if_needed: bool,
        /// When the emulated host itself crashes or wedges (its kernel or
        /// QEMU, not CMD), run CMD again in a new one, up to N times. CMD
        /// runs from the start, told by its ledger ($FORKBOX_TESTBED_LEDGER)
        /// what ended before; only for commands that may safely run again.
        #[arg(long, value_name = "N", default_value_t = 0)]
        host_crash_retries: u32,
        /// Run CMD in up to N one-CPU emulated hosts side by side (one per
        /// CPU of this machine; $FORKBOX_TESTBED_SHARDS overrides), each
        /// told its share in $FORKBOX_TESTBED_SHARD (`i/n`); a test suite
        /// runs only its share (sdk/python/tests/conftest.py does).
        #[arg(long, value_name = "N", default_value_t = 1,
              value_parser = clap::value_parser!(u32).range(1..=16))]
        shards: u32,
        /// With --shards: put `[NAME i/n] ` before each output line.
        #[arg(long, value_name = "NAME", default_value = "run")]
        label: String,
        #[arg(required = true, last = true)]
        argv: Vec<String>,
    },
    /// Build (or find in the cache) the emulated host's kernel and initramfs.
    Prepare,
}

fn main() -> ExitCode {
    init_logging();
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        Err(e) => {
            eprintln!("forkbox: error: {e:#}");
            ExitCode::from(1)
        }
    }
}

/// The host library's diagnostics (`tracing` events) as plain lines on
/// stderr: warnings by default, `FORKBOX_LOG` (or `RUST_LOG`) to change
/// that, e.g. `FORKBOX_LOG=warn,forkbox_host=debug`.
fn init_logging() {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_env("FORKBOX_LOG")
        .or_else(|_| EnvFilter::try_from_default_env())
        .unwrap_or_else(|_| EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .without_time()
        .init();
}

fn run(cli: Cli) -> anyhow::Result<i32> {
    match cli.command {
        Cmd::Run {
            image,
            vcpus,
            memory,
            timeout,
            serial,
            fork,
            fork_from,
            allow_out,
            argv,
        } => {
            let spec = VmSpec {
                image: image.into(),
                vcpus,
                memory_mib: memory,
                serial_to_stderr: serial,
                network: network_policy(&allow_out)?.map(NetworkSpec::from),
                ..VmSpec::default()
            };
            let timeout = timeout.map(Duration::from_secs);
            match fork {
                Some(n) => run_forked(&spec, timeout, n as usize, fork_from, argv),
                None => run_cmd(&spec, timeout, argv),
            }
        }
        Cmd::Demo(opts) => {
            if let Some(code) = delegate(ImageName::Debian)? {
                return Ok(code);
            }
            demo::run(&opts)?;
            Ok(0)
        }
        Cmd::Image { command } => image_cmd::run(command),
        Cmd::Testbed { command } => testbed_cmd(command),
        Cmd::Bench { what } => bench::run(what),
        Cmd::Client(cmd) => cli::run(cmd),
    }
}

/// Prepares assets here (the emulated host sees this machine's files
/// read-only), then re-runs this command inside the emulated host if this
/// machine cannot run microVMs itself. `None`: carry on here.
pub(crate) fn delegate(image: impl Into<RootImage>) -> anyhow::Result<Option<i32>> {
    Assets::prepare().context("preparing the guest kernel and initramfs")?;
    if let RootImage::Builtin(name) = image.into() {
        image::ensure(name).context("preparing the guest image")?;
    }
    if Environment::detect() != Environment::NeedsEmulatedHost {
        return Ok(None);
    }
    let args = std::env::args().skip(1).collect();
    Ok(Some(testbed::rerun_inside(
        args,
        Duration::from_secs(3600),
    )?))
}

/// `run --allow-out RULE...`: the policy, or `None` for no network.
fn network_policy(rules: &[String]) -> anyhow::Result<Option<Policy>> {
    if rules.is_empty() {
        return Ok(None);
    }
    let json = serde_json::json!({ "allow_out": rules }).to_string();
    Ok(Some(Policy::from_json(&json).context("--allow-out")?))
}

fn run_cmd(spec: &VmSpec, timeout: Option<Duration>, argv: Vec<String>) -> anyhow::Result<i32> {
    if let Some(code) = delegate(spec.image.clone())? {
        return Ok(code);
    }
    let assets = Assets::prepare()?;
    let vm = Vm::boot(&assets, spec).context("booting the microVM")?;
    let mut req = ExecRequest::argv(argv.clone());
    if let Some(t) = timeout {
        req = req.timeout(t);
    }
    let mut stdin = std::io::stdin();
    let stdin: Option<&mut (dyn std::io::Read + Send)> = if stdin.is_terminal() {
        None
    } else {
        Some(&mut stdin)
    };
    let result = vm
        .agent()
        .exec(&req, stdin, &mut forward_output)
        .with_context(|| format!("running `{}` in the microVM", argv.join(" ")))?;
    if result.timed_out {
        eprintln!(
            "forkbox: `{}` timed out after {:.1} s and was killed",
            argv.join(" "),
            result.duration.as_secs_f64()
        );
        return Ok(124);
    }
    Ok(match result.status {
        ExitStatus::Code(code) => code,
        ExitStatus::Signal(signal) => 128 + signal,
    })
}

/// `run --fork N`: boot, fork N ways, run the command in every child at
/// once, print each child's output line by line as `[i] line`; exit 0 if
/// every child succeeded, else the first failing child's code.
fn run_forked(
    spec: &VmSpec,
    timeout: Option<Duration>,
    n: usize,
    from: ForkFrom,
    argv: Vec<String>,
) -> anyhow::Result<i32> {
    use std::sync::Mutex;
    if let Some(code) = delegate(spec.image.clone())? {
        return Ok(code);
    }
    let assets = Assets::prepare()?;
    let mut vm = Vm::boot(&assets, spec).context("booting the microVM")?;
    eprintln!(
        "forkbox: booted in {:.0} ms",
        vm.boot_time.as_secs_f64() * 1000.0
    );
    if from == ForkFrom::Zygote {
        let t = Instant::now();
        // A warm-up first (`sh -c true`), as a daemon bake ends: the shell
        // goes into the page cache every child shares.
        let file = vm.make_warm_zygote().context("making the VM a zygote")?;
        eprintln!(
            "forkbox: zygote ready in {:.0} ms: {} MiB of guest memory shared, {} MiB of it in 2 MiB pages",
            t.elapsed().as_secs_f64() * 1000.0,
            file.bytes >> 20,
            file.huge_bytes >> 20
        );
    }
    let t = Instant::now();
    let children = vm.fork(n).context("forking the VM")?;
    eprintln!(
        "forkbox: {n} children forked and reseeded in {:.0} ms",
        t.elapsed().as_secs_f64() * 1000.0
    );
    let mut req = ExecRequest::argv(argv.clone());
    if let Some(t) = timeout {
        req = req.timeout(t);
    }
    let print_lock = Mutex::new(());
    let codes: Vec<i32> = std::thread::scope(|scope| {
        let handles: Vec<_> = children
            .into_iter()
            .enumerate()
            .map(|(i, child)| {
                let (req, print_lock) = (&req, &print_lock);
                scope.spawn(move || -> i32 {
                    let child = match child {
                        Ok(c) => c,
                        Err(e) => {
                            eprintln!("[{i}] forkbox: fork failed: {e:#}");
                            return 1;
                        }
                    };
                    let mut pending = [Vec::new(), Vec::new()];
                    let emit = |stream: OutputStream, line: &[u8]| {
                        let _guard = print_lock.lock();
                        let mut text = format!("[{i}] ").into_bytes();
                        text.extend_from_slice(line);
                        if !text.ends_with(b"\n") {
                            text.push(b'\n');
                        }
                        forward_output(stream, &text);
                    };
                    let result = child.agent().exec(req, None, &mut |stream, bytes| {
                        let buf = &mut pending[stream as usize];
                        buf.extend_from_slice(bytes);
                        while let Some(end) = buf.iter().position(|b| *b == b'\n') {
                            let line: Vec<u8> = buf.drain(..=end).collect();
                            emit(stream, &line);
                        }
                    });
                    for (stream, buf) in [OutputStream::Stdout, OutputStream::Stderr]
                        .into_iter()
                        .zip(pending.iter())
                    {
                        if !buf.is_empty() {
                            emit(stream, buf);
                        }
                    }
                    match result {
                        Ok(r) if r.timed_out => 124,
                        Ok(r) => match r.status {
                            ExitStatus::Code(c) => c,
                            ExitStatus::Signal(s) => 128 + s,
                        },
                        Err(e) => {
                            eprintln!("[{i}] forkbox: {}", forkbox_proto::error_chain(&e));
                            1
                        }
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or(1)).collect()
    });
    let failed: Vec<String> = codes
        .iter()
        .enumerate()
        .filter(|(_, c)| **c != 0)
        .map(|(i, c)| format!("[{i}] exit {c}"))
        .collect();
    if failed.is_empty() {
        return Ok(0);
    }
    eprintln!(
        "forkbox: {} of {n} children failed: {}",
        failed.len(),
        failed.join(", ")
    );
    Ok(codes.into_iter().find(|c| *c != 0).unwrap_or(1))
}

fn forward_output(stream: OutputStream, bytes: &[u8]) {
    let _ = match stream {
        OutputStream::Stdout => std::io::stdout().write_all(bytes),
        OutputStream::Stderr => std::io::stderr().write_all(bytes),
    };
}

fn testbed_cmd(cmd: TestbedCmd) -> anyhow::Result<i32> {
    match cmd {
        TestbedCmd::Prepare => {
            Testbed::prepare().context("preparing the emulated host")?;
            eprintln!("forkbox: emulated host ready");
            Ok(0)
        }
        TestbedCmd::Run {
            timeout,
            memory,
            cpus,
            if_needed,
            host_crash_retries,
            shards,
            label,
            argv,
        } => {
            if if_needed && Environment::detect() != Environment::NeedsEmulatedHost {
                let status = std::process::Command::new(&argv[0])
                    .args(&argv[1..])
                    .status()
                    .with_context(|| format!("running `{}`", argv.join(" ")))?;
                return Ok(status.code().unwrap_or(1));
            }
            let tb = Testbed::prepare().context("preparing the emulated host")?;
            let mut opts = RunOptions::new(argv.clone());
            opts.timeout = Duration::from_secs(timeout);
            opts.memory_mib = memory;
            if let Some(cpus) = cpus {
                opts.cpus = cpus;
            }
            opts.path_prefix = std::env::current_exe()
                .ok()
                .and_then(|e| e.parent().map(Into::into))
                .into_iter()
                .collect();
            let sharded = testbed::suite::Sharded {
                what: &label,
                shards: testbed::shards(shards as usize),
                hosts: host_crash_retries.saturating_add(1),
                timeout: opts.timeout,
            };
            Ok(sharded.run(|adjust| {
                let mut opts = opts.clone();
                adjust(&mut opts);
                Ok((argv.clone(), tb.run(&opts)?))
            }))
        }
    }
}
