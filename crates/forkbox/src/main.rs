//! The `forkbox` command.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use forkbox::testbed::{Outcome, RunOptions, Testbed};

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
        Ok(code) => code,
        Err(e) => {
            eprintln!("forkbox: error: {e:#}");
            ExitCode::from(1)
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Cmd::Testbed { command } => testbed_cmd(command),
    }
}

/// The directory holding this binary, where its sibling binaries are.
fn bin_dir() -> Option<PathBuf> {
    std::env::current_exe().ok()?.parent().map(PathBuf::from)
}

fn testbed_cmd(cmd: TestbedCmd) -> anyhow::Result<ExitCode> {
    match cmd {
        TestbedCmd::Prepare => {
            Testbed::prepare().context("preparing the emulated host")?;
            eprintln!("forkbox: emulated host ready");
            Ok(ExitCode::SUCCESS)
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
            opts.path_prefix = bin_dir().into_iter().collect();
            match tb.run(&opts)? {
                Outcome::Exited(code) => Ok(ExitCode::from(u8::try_from(code).unwrap_or(1))),
                Outcome::TimedOut { serial_tail } => {
                    eprintln!(
                        "forkbox testbed: `{}` did not finish within {timeout} s; the emulated host was stopped.\n--- emulated host serial log (tail) ---\n{serial_tail}",
                        argv.join(" ")
                    );
                    Ok(ExitCode::from(124))
                }
                Outcome::HostDied {
                    serial_tail,
                    qemu_stderr,
                } => {
                    eprintln!(
                        "forkbox testbed: the emulated host stopped before `{}` finished.\n--- qemu stderr ---\n{}\n--- emulated host serial log (tail) ---\n{serial_tail}",
                        argv.join(" "),
                        qemu_stderr.trim()
                    );
                    Ok(ExitCode::from(125))
                }
            }
        }
    }
}
