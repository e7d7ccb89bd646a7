//! `forkbox exec`: runs a command in a sandbox with its output streamed
//! (NDJSON `stdout`/`stderr`/`exit`/`error` events) and its exit status
//! passed through.

use std::collections::BTreeMap;
use std::io::{Read, Write};

use crate::client::{segment, Body, Client};
use anyhow::Context;
use clap::Args;
use hyper::Method;
use serde::{Deserialize, Serialize};

use super::{key_value, print_json, SandboxId, EXIT_INFRA};

/// The exit status of a command that ran out of time (as `timeout(1)`).
pub const EXIT_TIMEOUT: i32 = 124;

#[derive(Args)]
pub struct ExecArgs {
    sandbox: SandboxId,
    /// Working directory in the guest.
    #[arg(long)]
    cwd: Option<String>,
    /// KEY=VALUE environment (repeat for more).
    #[arg(long = "env", value_name = "KEY=VALUE", value_parser = key_value)]
    envs: Vec<(String, String)>,
    /// A user name or uid (default `user`, the image's unprivileged user;
    /// `--user root` when the command needs root).
    #[arg(long)]
    user: Option<String>,
    /// Kill the command after this many seconds (exit status 124).
    #[arg(long)]
    timeout: Option<f64>,
    /// Send this command's standard input (read to its end first, UTF-8)
    /// to the guest command.
    #[arg(long)]
    stdin: bool,
    /// Wait for the end and print one JSON result (stdout, stderr,
    /// exit_code, signal, timed_out, …); the exit status is passed through
    /// all the same.
    #[arg(long)]
    json: bool,
    #[arg(required = true, last = true, value_name = "CMD")]
    argv: Vec<String>,
}

/// `POST /sandboxes/{id}/commands`.
#[derive(Serialize)]
struct ExecBody {
    argv: Vec<String>,
    envs: BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cwd: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    user: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    timeout_secs: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stdin: Option<String>,
}

/// How a command ended (forkboxd's `ExecOutput`, the fields that matter
/// here).
#[derive(Debug, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct Ended {
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub timed_out: bool,
}

impl Ended {
    /// The status a shell would give: the code, 128+N for signal N, 124
    /// for a timeout.
    pub fn status(&self) -> i32 {
        if self.timed_out {
            return EXIT_TIMEOUT;
        }
        match (self.exit_code, self.signal) {
            (Some(c), _) => c,
            (None, Some(n)) => 128 + n,
            (None, None) => EXIT_INFRA,
        }
    }
}

/// One NDJSON line of a streamed command.
#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Event {
    Stdout { data: String },
    Stderr { data: String },
    Exit(Ended),
    Error { error: crate::client::ApiError },
}

/// The command's exit status, or [`EXIT_INFRA`] (with a message) when
/// forkbox, the daemon or the sandbox failed.
pub fn run(args: ExecArgs) -> i32 {
    match exec(args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("forkbox: exec failed: {e:#}");
            EXIT_INFRA
        }
    }
}

fn exec(args: ExecArgs) -> anyhow::Result<i32> {
    let client = Client::from_env()?;
    let stdin = if args.stdin {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .context("reading standard input (it must be UTF-8 text)")?;
        Some(s)
    } else {
        None
    };
    let body = Body::json(&ExecBody {
        argv: args.argv,
        envs: args.envs.into_iter().collect(),
        cwd: args.cwd,
        user: args.user,
        timeout_secs: args.timeout,
        stdin,
    });
    let path = format!("/sandboxes/{}/commands", segment(args.sandbox.as_str()));
    if args.json {
        let out: serde_json::Value = client.call(Method::POST, &path, body)?.json()?;
        print_json(&out)?;
        let ended: Ended = serde_json::from_value(out)?;
        return Ok(ended.status());
    }
    let mut resp = client
        .send(Method::POST, &path, body, Some("application/x-ndjson"))?
        .ok()?;
    let (mut stdout, mut stderr) = (std::io::stdout().lock(), std::io::stderr().lock());
    while let Some(event) = resp.next_json::<Event>()? {
        match event {
            Event::Stdout { data } => {
                stdout.write_all(data.as_bytes())?;
                stdout.flush()?;
            }
            Event::Stderr { data } => {
                stderr.write_all(data.as_bytes())?;
                stderr.flush()?;
            }
            Event::Exit(ended) => return Ok(ended.status()),
            Event::Error { error } => {
                let what = if error.infrastructure {
                    "the sandbox failed"
                } else {
                    "the command could not run"
                };
                anyhow::bail!("{what}: {} ({})", error.message, error.kind);
            }
        }
    }
    anyhow::bail!("the command's stream ended without its exit status")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ended(exit_code: Option<i32>, signal: Option<i32>, timed_out: bool) -> Ended {
        Ended {
            exit_code,
            signal,
            timed_out,
        }
    }

    #[test]
    fn ended_status_passes_codes_signals_and_timeouts() {
        assert_eq!(ended(Some(0), None, false).status(), 0);
        assert_eq!(ended(Some(3), None, false).status(), 3);
        assert_eq!(ended(None, Some(9), false).status(), 137);
        assert_eq!(ended(None, Some(9), true).status(), EXIT_TIMEOUT);
        assert_eq!(ended(None, None, false).status(), EXIT_INFRA);
    }

    #[test]
    fn stream_events_parse() {
        let e: Event = serde_json::from_str(r#"{"type":"stdout","data":"hi\n"}"#).expect("out");
        assert!(matches!(e, Event::Stdout { data } if data == "hi\n"));
        let e: Event = serde_json::from_str(
            r#"{"type":"exit","exit_code":null,"signal":15,"timed_out":false,"duration_ms":3.5,"stdout_truncated":false,"stderr_truncated":false}"#,
        )
        .expect("exit");
        assert!(matches!(e, Event::Exit(ref x) if x.status() == 143));
        let e: Event = serde_json::from_str(
            r#"{"type":"error","error":{"kind":"infrastructure","message":"agent gone","infrastructure":true}}"#,
        )
        .expect("error");
        assert!(matches!(e, Event::Error { error } if error.infrastructure));
    }

    #[test]
    fn exec_args_take_the_command_after_dashes() {
        use clap::Parser;
        #[derive(Parser)]
        struct T {
            #[command(flatten)]
            a: ExecArgs,
        }
        let t = T::try_parse_from([
            "x",
            "sb-1",
            "--cwd",
            "/tmp",
            "--env",
            "A=1",
            "--timeout",
            "2.5",
            "--",
            "ls",
            "-l",
        ])
        .expect("parse");
        assert_eq!(t.a.argv, ["ls", "-l"]);
        assert_eq!(t.a.envs, [("A".to_owned(), "1".to_owned())]);
        assert_eq!(t.a.timeout, Some(2.5));
        assert!(T::try_parse_from(["x", "sb-1"]).is_err());
    }
}
