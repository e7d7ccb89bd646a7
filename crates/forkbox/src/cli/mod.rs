//! The daemon's client commands: `daemon`, `template`, `sandbox`, `exec`,
//! `cp`, `logs`. Each parses its arguments, calls forkboxd through
//! [`crate::client`] and prints a table (or, with `--json`, the
//! daemon's JSON, pretty-printed, nothing dropped).
//!
//! - `template`: bake (with progress), list, rm; template TOML files.
//! - `sandbox`: create, fork, ls, kill, snapshot, pause, resume, info; `logs`.
//! - `network`: `sandbox network` (the egress policy) and `sandbox egress`
//!   (the egress log); `--allow-out`/`--deny-out` on `sandbox create`.
//! - `exec`: a command with streamed output and its exit code passed through.
//! - `cp`: files and directories in and out, `SANDBOX:PATH` on the guest side.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use crate::client::Client;
use anyhow::{bail, Context};
use clap::{Args, Subcommand};

mod cp;
mod exec;
mod network;
mod sandbox;
mod template;

/// The exit status of `forkbox exec` when the sandbox machinery (or the
/// daemon, or the request) failed rather than the command: like
/// `docker run`'s 125.
pub const EXIT_INFRA: i32 = 125;

#[derive(Subcommand)]
pub enum ClientCmd {
    /// Start forkboxd, the daemon the commands below talk to (ARGS go to
    /// it: see `forkbox daemon --help`).
    #[command(disable_help_flag = true)]
    Daemon {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
    /// Templates: bake one, list them, remove one.
    Template {
        #[command(subcommand)]
        command: template::TemplateCmd,
        #[command(flatten)]
        out: Out,
    },
    /// Sandboxes: create, fork, list, kill, snapshot, pause, resume, info,
    /// network (egress policy), egress (what they tried to reach).
    Sandbox {
        #[command(subcommand)]
        command: sandbox::SandboxCmd,
        #[command(flatten)]
        out: Out,
    },
    /// Run a command in a sandbox, streaming its output; exit with its
    /// code (a signal: 128+N, a timeout: 124, forkbox's own failure: 125).
    Exec(exec::ExecArgs),
    /// Copy a file or a directory into or out of a sandbox; SANDBOX:PATH
    /// names the guest side (an absolute path).
    Cp(cp::CpArgs),
    /// The sandbox's serial console, its last 1000 lines (kernel and
    /// agent messages).
    Logs {
        sandbox: SandboxId,
        #[command(flatten)]
        out: Out,
    },
}

/// `--json` on every client command.
#[derive(Args, Clone, Copy)]
pub struct Out {
    /// Print the daemon's JSON (every field) instead of a table.
    #[arg(long, global = true)]
    json: bool,
}

impl Out {
    fn format(self) -> Format {
        if self.json {
            Format::Json
        } else {
            Format::Human
        }
    }
}

/// How a command prints its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Human,
    Json,
}

pub fn run(cmd: ClientCmd) -> anyhow::Result<i32> {
    match cmd {
        ClientCmd::Daemon { args } => daemon(args),
        ClientCmd::Template { command, out } => template::run(&connect()?, command, out.format()),
        ClientCmd::Sandbox { command, out } => sandbox::run(&connect()?, command, out.format()),
        ClientCmd::Exec(args) => Ok(exec::run(args)),
        ClientCmd::Cp(args) => cp::run(&connect()?, args),
        ClientCmd::Logs { sandbox, out } => sandbox::logs(&connect()?, &sandbox, out.format()),
    }
}

fn connect() -> anyhow::Result<Client> {
    Ok(Client::from_env()?)
}

/// Replaces this process with `forkboxd ARGS`: the one next to this
/// executable, else the first on `PATH`.
fn daemon(args: Vec<OsString>) -> anyhow::Result<i32> {
    use std::os::unix::process::CommandExt;
    let beside = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|d| d.join("forkboxd")))
        .filter(|p| p.is_file());
    let exe = match beside.or_else(|| on_path("forkboxd")) {
        Some(p) => p,
        None => bail!(
            "forkboxd not found next to this forkbox or on PATH (build it: `make build`, \
             or `cargo build --release -p forkboxd`)"
        ),
    };
    let err = std::process::Command::new(&exe).args(args).exec();
    Err(err).with_context(|| format!("starting {}", exe.display()))
}

fn on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| is_executable(p))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// A sandbox's id as the user typed it (`sb-…`). Checked only for the
/// characters that keep it one URL path segment; the daemon says whether
/// it exists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxId(String);

impl SandboxId {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::str::FromStr for SandboxId {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if !s.is_empty()
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            Ok(Self(s.into()))
        } else {
            Err(format!("{s:?} is not a sandbox id (sb-…)"))
        }
    }
}

impl std::fmt::Display for SandboxId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// `KEY=VALUE` (labels, environment variables); the value may be empty or
/// hold more `=`.
pub fn key_value(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.into(), v.into())),
        _ => Err(format!("{s:?}: expected KEY=VALUE")),
    }
}

/// Prints `value` as pretty JSON on stdout.
fn print_json(value: &serde_json::Value) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

/// Prints rows under headers in columns two spaces apart.
fn print_table(headers: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let mut s = String::new();
        for (i, (cell, w)) in cells.iter().zip(&widths).enumerate() {
            if i + 1 == cells.len() {
                s.push_str(cell);
            } else {
                s.push_str(&format!("{cell:<w$}  "));
            }
        }
        println!("{}", s.trim_end());
    };
    line(headers.to_vec());
    for row in rows {
        line(row.iter().map(String::as_str).collect());
    }
}

/// A JSON value as a table cell: strings bare, `null` as `-`.
fn cell(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::Null => "-".into(),
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Milliseconds as a short duration (`850ms`, `12.3s`, `4m05s`, `2h10m`).
fn duration_ms(ms: u64) -> String {
    match ms {
        0..=999 => format!("{ms}ms"),
        1_000..=59_999 => format!("{:.1}s", ms as f64 / 1000.0),
        60_000..=3_599_999 => format!("{}m{:02}s", ms / 60_000, ms / 1000 % 60),
        _ => format!("{}h{:02}m", ms / 3_600_000, ms / 60_000 % 60),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_value_splits_at_the_first_equals() {
        assert_eq!(key_value("a=b"), Ok(("a".into(), "b".into())));
        assert_eq!(key_value("a=b=c"), Ok(("a".into(), "b=c".into())));
        assert_eq!(key_value("a="), Ok(("a".into(), String::new())));
        assert!(key_value("=b").is_err());
        assert!(key_value("ab").is_err());
    }

    #[test]
    fn sandbox_id_refuses_path_characters() {
        assert!("sb-00000001a3f09c11".parse::<SandboxId>().is_ok());
        for bad in ["", "sb/1", "../x", "sb 1", "sb:1", "a%2f"] {
            assert!(bad.parse::<SandboxId>().is_err(), "{bad}");
        }
    }

    #[test]
    fn duration_ms_picks_a_readable_unit() {
        assert_eq!(duration_ms(850), "850ms");
        assert_eq!(duration_ms(12_340), "12.3s");
        assert_eq!(duration_ms(245_000), "4m05s");
        assert_eq!(duration_ms(7_800_000), "2h10m");
    }

    #[test]
    fn cell_prints_null_as_dash() {
        assert_eq!(cell(&serde_json::Value::Null), "-");
        assert_eq!(cell(&serde_json::json!("x")), "x");
        assert_eq!(cell(&serde_json::json!(3)), "3");
    }
}
