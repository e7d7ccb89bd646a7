//! `forkbox sandbox …` and `forkbox logs`.

use std::collections::BTreeMap;

use crate::client::{segment, with_query, Body, Client};
use clap::Subcommand;
use forkbox::template_file::SandboxLimits;
use forkbox_net::policy::PolicySpec;
use hyper::Method;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::network::{self, PolicyArgs};
use super::{cell, duration_ms, key_value, print_json, print_table, Format, SandboxId};

#[derive(Subcommand)]
pub enum SandboxCmd {
    /// Create a sandbox from a template and wait until it is ready. It
    /// reaches nothing outside itself but what --allow-out allows.
    Create {
        template: String,
        /// Seconds it lives (from ready); default: until killed.
        #[arg(long)]
        timeout: Option<f64>,
        /// KEY=VALUE metadata (repeat for more).
        #[arg(long = "label", value_name = "KEY=VALUE", value_parser = key_value)]
        labels: Vec<(String, String)>,
        /// KEY=VALUE environment for every command in it (repeat for more).
        #[arg(long = "env", value_name = "KEY=VALUE", value_parser = key_value)]
        envs: Vec<(String, String)>,
        #[command(flatten)]
        network: PolicyArgs,
        /// CPU time it may take, in CPUs (default: its template's, else
        /// its vCPUs + 1; never more).
        #[arg(long)]
        cpus: Option<f64>,
        /// Host memory of its own it may hold, in MiB, past which the host
        /// ends it (default: its template's, else its RAM + 512; never more).
        #[arg(long, value_name = "MIB")]
        memory_limit: Option<u32>,
    },
    /// Fork a sandbox into COUNT (1-1024) children.
    Fork {
        sandbox: SandboxId,
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1024))]
        count: u32,
    },
    /// List the live sandboxes (--all: the dead ones still remembered too).
    #[command(alias = "list")]
    Ls {
        /// Only those carrying KEY=VALUE (repeat: all of them).
        #[arg(long = "label", value_name = "KEY=VALUE", value_parser = key_value)]
        labels: Vec<(String, String)>,
        #[arg(long)]
        all: bool,
    },
    /// Kill sandboxes by id, or every one carrying the given labels.
    #[command(alias = "rm")]
    Kill {
        #[arg(required_unless_present = "labels", conflicts_with = "labels")]
        sandboxes: Vec<SandboxId>,
        #[arg(long = "label", value_name = "KEY=VALUE", value_parser = key_value)]
        labels: Vec<(String, String)>,
    },
    /// Save a sandbox as a new template NAME.
    Snapshot { sandbox: SandboxId, name: String },
    /// Stop a sandbox's vCPUs in place.
    Pause { sandbox: SandboxId },
    /// Let a paused sandbox run again.
    Resume { sandbox: SandboxId },
    /// Everything the daemon knows about one sandbox.
    Info { sandbox: SandboxId },
    /// Whether a sandbox's protected paths (its template's `protect`)
    /// still hold what the bake recorded; lists what changed, was added or
    /// removed. Exits 0 when intact, 1 when not.
    Integrity { sandbox: SandboxId },
    /// Show a sandbox's egress policy; with --allow-out/--deny-out (or
    /// --deny-all), replace it. New connections and DNS lookups follow a
    /// new policy at once.
    Network {
        sandbox: SandboxId,
        #[command(flatten)]
        rules: PolicyArgs,
        /// Replace the policy with one that allows nothing.
        #[arg(long, conflicts_with_all = ["allow_out", "deny_out"])]
        deny_all: bool,
    },
    /// What a sandbox tried to reach, oldest first: time (UTC), protocol,
    /// destination, verdict, the rule or reason, bytes out/in, duration.
    /// --json prints one JSON object per line. A killed sandbox's log
    /// stays readable for a while.
    Egress {
        sandbox: SandboxId,
        /// Only the last N records (default: the daemon's).
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
        limit: Option<u32>,
    },
}

/// `POST /sandboxes`.
#[derive(Serialize)]
struct CreateBody {
    template: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    timeout_secs: Option<f64>,
    metadata: BTreeMap<String, String>,
    envs: BTreeMap<String, String>,
    /// Absent: the daemon's default, deny all.
    #[serde(skip_serializing_if = "Option::is_none")]
    network: Option<PolicySpec>,
    /// Absent: its template's.
    #[serde(skip_serializing_if = "Option::is_none")]
    limits: Option<SandboxLimits>,
}

/// The fields of forkboxd's `SandboxInfo` that tables show.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct SandboxView {
    id: String,
    template: String,
    state: String,
    metadata: BTreeMap<String, String>,
    uptime_ms: Option<u64>,
    expires_in_ms: Option<u64>,
    parent: Option<String>,
}

pub(super) fn sandbox_path(id: &SandboxId) -> String {
    format!("/sandboxes/{}", segment(id.as_str()))
}

pub fn run(client: &Client, cmd: SandboxCmd, format: Format) -> anyhow::Result<i32> {
    match cmd {
        SandboxCmd::Create {
            template,
            timeout,
            labels,
            envs,
            network,
            cpus,
            memory_limit,
        } => {
            let limits = SandboxLimits {
                cpus,
                memory_mib: memory_limit,
            };
            let body = CreateBody {
                limits: (cpus.is_some() || memory_limit.is_some()).then_some(limits),
                template,
                timeout_secs: timeout,
                metadata: labels.into_iter().collect(),
                envs: envs.into_iter().collect(),
                network: (!network.is_empty()).then(|| network.into_spec()),
            };
            let info: Value = client
                .call(Method::POST, "/sandboxes", Body::json(&body))?
                .json()?;
            one(&info, format, |v| println!("{}", v.id))
        }
        SandboxCmd::Fork { sandbox, count } => {
            let children: Vec<Value> = client
                .call(
                    Method::POST,
                    &format!("{}/fork", sandbox_path(&sandbox)),
                    Body::json(&serde_json::json!({ "count": count })),
                )?
                .json()?;
            fork_result(&children, format)
        }
        SandboxCmd::Ls { labels, all } => {
            let mut q: Vec<(&str, String)> = labels
                .iter()
                .map(|(k, v)| ("label", format!("{k}={v}")))
                .collect();
            if all {
                q.push(("all", "true".into()));
            }
            let path = with_query("/sandboxes", q.iter().map(|(k, v)| (*k, v.as_str())));
            let list: Vec<Value> = client.get(&path)?;
            if format == Format::Json {
                print_json(&Value::Array(list))?;
            } else {
                table(&list)?;
            }
            Ok(0)
        }
        SandboxCmd::Kill { sandboxes, labels } => {
            let mut failed = 0;
            let killed: Vec<String> = if labels.is_empty() {
                // Every id is tried; the ones that fail are reported.
                let mut killed = Vec::new();
                for id in &sandboxes {
                    match client.call(Method::DELETE, &sandbox_path(id), Body::Empty) {
                        Ok(_) => killed.push(id.to_string()),
                        Err(e) => {
                            failed += 1;
                            eprintln!("forkbox: error: {id}: {:#}", anyhow::Error::from(e));
                        }
                    }
                }
                killed
            } else {
                #[derive(Deserialize)]
                struct Killed {
                    killed: Vec<String>,
                }
                let metadata: BTreeMap<_, _> = labels.into_iter().collect();
                let k: Killed = client
                    .call(
                        Method::POST,
                        "/sandboxes/kill",
                        Body::json(&serde_json::json!({ "metadata": metadata })),
                    )?
                    .json()?;
                k.killed
            };
            if format == Format::Json {
                print_json(&serde_json::json!({ "killed": killed }))?;
            } else {
                for id in killed {
                    println!("killed {id}");
                }
            }
            Ok(if failed > 0 { 1 } else { 0 })
        }
        SandboxCmd::Snapshot { sandbox, name } => {
            let template: Value = client
                .call(
                    Method::POST,
                    &format!("{}/snapshot", sandbox_path(&sandbox)),
                    Body::json(&serde_json::json!({ "name": name })),
                )?
                .json()?;
            if format == Format::Json {
                print_json(&template)?;
            } else {
                println!(
                    "template {} (snapshot of {sandbox})",
                    cell(&template["name"])
                );
            }
            Ok(0)
        }
        SandboxCmd::Integrity { sandbox } => integrity(client, &sandbox, format),
        SandboxCmd::Pause { sandbox } => state_change(client, &sandbox, "pause", format),
        SandboxCmd::Resume { sandbox } => state_change(client, &sandbox, "resume", format),
        SandboxCmd::Info { sandbox } => {
            let info: Value = client.get(&sandbox_path(&sandbox))?;
            if format == Format::Json {
                print_json(&info)?;
            } else {
                details(&info);
            }
            Ok(0)
        }
        SandboxCmd::Network {
            sandbox,
            rules,
            deny_all,
        } => {
            let replace = if deny_all {
                Some(PolicySpec::default())
            } else {
                (!rules.is_empty()).then(|| rules.into_spec())
            };
            network::network(client, &sandbox, replace, format)
        }
        SandboxCmd::Egress { sandbox, limit } => network::egress(client, &sandbox, limit, format),
    }
}

fn state_change(
    client: &Client,
    sandbox: &SandboxId,
    action: &str,
    format: Format,
) -> anyhow::Result<i32> {
    let info: Value = client
        .call(
            Method::POST,
            &format!("{}/{action}", sandbox_path(sandbox)),
            Body::Empty,
        )?
        .json()?;
    one(&info, format, |v| println!("{} {}", v.id, v.state))
}

/// Prints one `SandboxInfo`: as JSON, or through `human`.
fn one(info: &Value, format: Format, human: impl Fn(&SandboxView)) -> anyhow::Result<i32> {
    if format == Format::Json {
        print_json(info)?;
    } else {
        human(&serde_json::from_value(info.clone())?);
    }
    Ok(0)
}

/// A fork's answer: one entry per child, `{"sandbox": info}` or
/// `{"error": {...}}` (a bare info is taken as a child too). Non-zero
/// when any child failed.
fn fork_result(children: &[Value], format: Format) -> anyhow::Result<i32> {
    let failed = children.iter().filter(|c| c.get("error").is_some()).count();
    if format == Format::Json {
        print_json(&Value::Array(children.to_vec()))?;
    } else {
        for (i, c) in children.iter().enumerate() {
            if let Some(e) = c.get("error") {
                eprintln!(
                    "forkbox: child {i} failed: {} ({})",
                    cell(&e["message"]),
                    cell(&e["kind"])
                );
            } else {
                let info = c.get("sandbox").unwrap_or(c);
                println!("{}", cell(&info["id"]));
            }
        }
    }
    Ok(if failed > 0 { 1 } else { 0 })
}

fn labels_text(m: &BTreeMap<String, String>) -> String {
    if m.is_empty() {
        return "-".into();
    }
    m.iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

fn table(list: &[Value]) -> anyhow::Result<()> {
    let mut rows = Vec::new();
    for v in list {
        let s: SandboxView = serde_json::from_value(v.clone())?;
        rows.push(vec![
            s.id,
            s.template,
            s.state,
            s.uptime_ms.map_or("-".into(), duration_ms),
            s.expires_in_ms.map_or("-".into(), duration_ms),
            s.parent.unwrap_or_else(|| "-".into()),
            labels_text(&s.metadata),
        ]);
    }
    print_table(
        &[
            "ID", "TEMPLATE", "STATE", "UPTIME", "EXPIRES", "PARENT", "LABELS",
        ],
        &rows,
    );
    Ok(())
}

/// `key: value` lines of a `SandboxInfo`, nested objects flattened as
/// `metrics.cpu_ms`.
fn details(info: &Value) {
    fn walk(prefix: &str, v: &Value, out: &mut Vec<(String, String)>) {
        match v {
            Value::Object(m) if !m.is_empty() => {
                for (k, v) in m {
                    let key = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    walk(&key, v, out);
                }
            }
            Value::Array(a) => out.push((
                prefix.into(),
                if a.is_empty() {
                    "-".into()
                } else {
                    a.iter().map(cell).collect::<Vec<_>>().join(", ")
                },
            )),
            Value::Object(_) => out.push((prefix.into(), "-".into())),
            other => out.push((prefix.into(), cell(other))),
        }
    }
    let mut lines = Vec::new();
    walk("", info, &mut lines);
    let w = lines.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    for (k, v) in lines {
        println!("{:<w$}  {v}", format!("{k}:"), w = w + 1);
    }
}

/// `forkbox sandbox integrity`.
fn integrity(client: &Client, sandbox: &SandboxId, format: Format) -> anyhow::Result<i32> {
    let path = format!("{}/integrity", sandbox_path(sandbox));
    let report: Value = client.call(Method::GET, &path, Body::Empty)?.json()?;
    let intact = report["intact"].as_bool().unwrap_or(false);
    if format == Format::Json {
        print_json(&report)?;
    } else {
        let paths = |key: &str| -> Vec<String> {
            report[key]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|p| p.as_str().map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default()
        };
        let protected = paths("protected");
        if protected.is_empty() {
            println!("{sandbox}: its template protects nothing");
        } else if intact {
            println!(
                "{sandbox}: intact ({} entries under {})",
                report["entries"],
                protected.join(", ")
            );
        } else {
            println!("{sandbox}: TAMPERED (protected: {})", protected.join(", "));
            for (key, mark) in [
                ("changed", "changed"),
                ("added", "added  "),
                ("removed", "removed"),
            ] {
                for p in paths(key) {
                    println!("  {mark}  {p}");
                }
            }
        }
    }
    Ok(if intact { 0 } else { 1 })
}

/// `forkbox logs`: the sandbox's serial console, its last lines (kernel
/// and agent messages; commands' output goes to their callers). `--json`
/// wraps them as `{"sandbox", "lines"}`.
pub fn logs(client: &Client, sandbox: &SandboxId, format: Format) -> anyhow::Result<i32> {
    let path = format!("{}/logs?lines=1000", sandbox_path(sandbox));
    let text = client.call(Method::GET, &path, Body::Empty)?.bytes()?;
    let text = String::from_utf8_lossy(&text);
    if format == Format::Json {
        let lines: Vec<&str> = text.lines().collect();
        print_json(&serde_json::json!({ "sandbox": sandbox.as_str(), "lines": lines }))?;
    } else {
        print!("{text}");
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fork_result_counts_failed_children() {
        let ok = serde_json::json!([{"sandbox": {"id": "sb-1"}}, {"id": "sb-2"}]);
        assert_eq!(
            fork_result(ok.as_array().expect("array"), Format::Json).ok(),
            Some(0)
        );
        let mixed = serde_json::json!([{"sandbox": {"id": "sb-1"}}, {"error": {"kind": "capacity", "message": "full"}}]);
        assert_eq!(
            fork_result(mixed.as_array().expect("array"), Format::Json).ok(),
            Some(1)
        );
    }

    #[test]
    fn labels_text_joins_pairs() {
        let m: BTreeMap<String, String> =
            [("a".into(), "1".into()), ("b".into(), "2".into())].into();
        assert_eq!(labels_text(&m), "a=1,b=2");
        assert_eq!(labels_text(&BTreeMap::new()), "-");
    }
}
