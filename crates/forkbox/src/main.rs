//! The `forkbox` command.

use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Parser, Subcommand};
use forkbox::image::{self, ImageName};
use forkbox::testbed::{self, Environment, RunOptions, Testbed};
use forkbox::vm::{Assets, Vm, VmSpec};
use forkbox_proto::{ExecRequest, ExitStatus, OutputStream};

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
        #[arg(long, value_enum, default_value = "minimal")]
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
        #[arg(required = true, last = true)]
        argv: Vec<String>,
    },
    /// Boot the `debian` image and run a few commands in it, timing each step.
    Demo,
    /// Build the guest images (cached; a second build is instant).
    Image {
        #[arg(value_enum)]
        name: ImageName,
    },
    /// The emulated KVM host for machines without hardware virtualization.
    Testbed {
        #[command(subcommand)]
        command: TestbedCmd,
    },
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
        /// vCPUs of the emulated host.
        #[arg(long, default_value_t = 2)]
        cpus: u32,
        #[arg(required = true, last = true)]
        argv: Vec<String>,
    },
    /// Build (or find in the cache) the emulated host's kernel and initramfs.
    Prepare,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        Err(e) => {
            eprintln!("forkbox: error: {e:#}");
            ExitCode::from(1)
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<i32> {
    match cli.command {
        Cmd::Run {
            image,
            vcpus,
            memory,
            timeout,
            serial,
            argv,
        } => {
            let spec = VmSpec {
                image,
                vcpus,
                memory_mib: memory,
                serial_to_stderr: serial,
                ..VmSpec::default()
            };
            run_cmd(&spec, timeout.map(Duration::from_secs), argv)
        }
        Cmd::Demo => demo(),
        Cmd::Image { name } => {
            let path = image::ensure(name)?;
            println!("{}", path.display());
            Ok(0)
        }
        Cmd::Testbed { command } => testbed_cmd(command),
    }
}

/// Prepares assets here (the emulated host sees this machine's files
/// read-only), then re-runs this command inside the emulated host if this
/// machine cannot run microVMs itself. `None`: carry on here.
fn delegate(image: ImageName) -> anyhow::Result<Option<i32>> {
    Assets::prepare().context("preparing the guest kernel and initramfs")?;
    image::ensure(image).context("preparing the guest image")?;
    if Environment::detect() != Environment::NeedsEmulatedHost {
        return Ok(None);
    }
    let args = std::env::args().skip(1).collect();
    Ok(Some(testbed::rerun_inside(
        args,
        Duration::from_secs(3600),
    )?))
}

fn run_cmd(spec: &VmSpec, timeout: Option<Duration>, argv: Vec<String>) -> anyhow::Result<i32> {
    if let Some(code) = delegate(spec.image)? {
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

fn forward_output(stream: OutputStream, bytes: &[u8]) {
    let _ = match stream {
        OutputStream::Stdout => std::io::stdout().write_all(bytes),
        OutputStream::Stderr => std::io::stderr().write_all(bytes),
    };
}

fn demo() -> anyhow::Result<i32> {
    let image = ImageName::Debian;
    let t = Instant::now();
    if let Some(code) = delegate(image)? {
        return Ok(code);
    }
    let env = Environment::detect();
    println!("forkbox demo: environment: {}", env.label());
    println!(
        "forkbox demo: assets ready in {:.2} s",
        t.elapsed().as_secs_f64()
    );
    let assets = Assets::prepare()?;
    let spec = VmSpec {
        image,
        ..VmSpec::default()
    };
    let vm = Vm::boot(&assets, &spec).context("booting the microVM")?;
    println!(
        "forkbox demo: booted a `debian` microVM (1 vCPU, 512 MiB) to its agent in {:.0} ms",
        vm.boot_time.as_secs_f64() * 1000.0
    );
    let steps: &[(&str, ExecRequest)] = &[
        ("kernel", ExecRequest::argv(["uname", "-sr"])),
        ("python", ExecRequest::argv(["python3", "-c", "import sys; print('python', sys.version.split()[0], 'says 2**64 =', 2**64)"])),
        ("git", ExecRequest::shell("cd /tmp && git init -q repo && cd repo && echo hi > f && git add f && git -c user.email=a@b -c user.name=demo commit -qm first && git log --oneline")),
        ("whoami", ExecRequest::argv(["id"])),
        ("exit code", ExecRequest::shell("exit 3")),
    ];
    for (name, req) in steps {
        let t = Instant::now();
        let mut out = Vec::new();
        let result = vm
            .agent()
            .exec(req, None, &mut |_, b| out.extend_from_slice(b))?;
        println!(
            "forkbox demo: {name:<9} {:>7.1} ms  {:?}  {}",
            t.elapsed().as_secs_f64() * 1000.0,
            result.status,
            String::from_utf8_lossy(&out).trim()
        );
    }
    println!("forkbox demo: done");
    Ok(0)
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
            argv,
        } => {
            let tb = Testbed::prepare().context("preparing the emulated host")?;
            let mut opts = RunOptions::new(argv.clone());
            opts.timeout = Duration::from_secs(timeout);
            opts.memory_mib = memory;
            opts.cpus = cpus;
            opts.path_prefix = std::env::current_exe()
                .ok()
                .and_then(|e| e.parent().map(Into::into))
                .into_iter()
                .collect();
            let outcome = tb.run(&opts)?;
            Ok(testbed::report(&argv, opts.timeout, outcome))
        }
    }
}
