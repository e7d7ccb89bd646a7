//! Sandbox networks: `forkbox sandbox create --allow-out/--deny-out`,
//! `forkbox sandbox network` (show or replace the egress policy) and
//! `forkbox sandbox egress` (what a sandbox tried to reach).
//!
//! The policy and the egress records are the net crate's own types
//! ([`PolicySpec`], [`EgressRecord`]), so the CLI reads what the daemon
//! writes; rules given on the command line are checked with the same
//! parser the daemon uses before anything is sent.

use crate::client::{with_query, Body, Client};
use clap::Args;
use forkbox_net::log::{EgressRecord, LogReason};
use forkbox_net::policy::{PolicySpec, Protocol, Rule, Verdict};
use hyper::Method;
use serde_json::Value;

use super::{duration_ms, print_json, print_table, Format, SandboxId};
use crate::cli::sandbox::sandbox_path;

/// `--allow-out`/`--deny-out`, on `sandbox create` and `sandbox network`.
#[derive(Args, Debug, Clone, Default)]
pub struct PolicyArgs {
    /// Let the sandbox reach RULE (repeat for more): a DNS name
    /// (`pypi.org`), a suffix (`*.debian.org`), an address or CIDR
    /// (`10.1.0.0/16`) or `*`, each with an optional `:PORT`, `:LO-HI` or
    /// `:*`; `host.forkbox.internal:PORT` is this host's loopback (one
    /// port). A name or `*` never opens private, shared or the host's own
    /// addresses: only a CIDR rule inside such a range does.
    /// Without any, the sandbox reaches nothing outside itself.
    #[arg(long = "allow-out", value_name = "RULE", value_parser = allow_rule)]
    pub allow_out: Vec<String>,
    /// Deny RULE even where an --allow-out rule allows it (repeat for more).
    #[arg(long = "deny-out", value_name = "RULE", value_parser = rule)]
    pub deny_out: Vec<String>,
}

impl PolicyArgs {
    pub fn is_empty(&self) -> bool {
        self.allow_out.is_empty() && self.deny_out.is_empty()
    }

    pub fn into_spec(self) -> PolicySpec {
        PolicySpec {
            allow_out: self.allow_out,
            deny_out: self.deny_out,
        }
    }
}

/// A rule as typed, once the daemon's parser accepts it (the daemon
/// normalises it).
fn rule(s: &str) -> Result<String, String> {
    s.parse::<Rule>()
        .map(|_| s.to_owned())
        .map_err(|e| e.to_string())
}

/// An allow rule: a rule, and `host.forkbox.internal` only with one port.
fn allow_rule(s: &str) -> Result<String, String> {
    s.parse::<Rule>()
        .and_then(|r| r.check_allow())
        .map(|()| s.to_owned())
        .map_err(|e| e.to_string())
}

fn network_path(sandbox: &SandboxId) -> String {
    format!("{}/network", sandbox_path(sandbox))
}

/// `forkbox sandbox network ID`: the policy now (`replace: None`), or
/// replaced by the one given.
pub fn network(
    client: &Client,
    sandbox: &SandboxId,
    replace: Option<PolicySpec>,
    format: Format,
) -> anyhow::Result<i32> {
    let answer: Value = match replace {
        None => client.get(&network_path(sandbox))?,
        Some(spec) => client
            .call(Method::POST, &network_path(sandbox), Body::json(&spec))?
            .json()?,
    };
    if format == Format::Json {
        print_json(&answer)?;
    } else {
        for line in policy_lines(&serde_json::from_value(answer)?) {
            println!("{line}");
        }
    }
    Ok(0)
}

/// forkboxd's answer about a sandbox's network: its policy, and whether
/// the policy is in force (not for a sandbox re-adopted after a daemon
/// restart, which opens no new connection).
#[derive(Debug, Default, serde::Deserialize)]
#[serde(default)]
struct NetworkView {
    allow_out: Vec<String>,
    deny_out: Vec<String>,
    active: Option<bool>,
}

/// `allow RULE` and `deny RULE` lines, or one line saying that nothing
/// is allowed; a note first when the policy is not in force.
fn policy_lines(view: &NetworkView) -> Vec<String> {
    let mut lines = Vec::new();
    if view.active == Some(false) {
        lines
            .push("inactive: re-adopted after a daemon restart, it opens no new connection".into());
    }
    if view.allow_out.is_empty() {
        lines.push("deny all (no allow rules)".into());
    }
    lines.extend(view.allow_out.iter().map(|r| format!("allow  {r}")));
    lines.extend(view.deny_out.iter().map(|r| format!("deny   {r}")));
    lines
}

/// `forkbox sandbox egress ID`: the last `limit` records (the daemon's
/// default without one), oldest first: a table, or with `--json` one
/// JSON object per line as the daemon sent it.
pub fn egress(
    client: &Client,
    sandbox: &SandboxId,
    limit: Option<u32>,
    format: Format,
) -> anyhow::Result<i32> {
    let limit = limit.map(|n| n.to_string());
    let path = with_query(
        &format!("{}/egress", sandbox_path(sandbox)),
        limit.as_deref().map(|n| ("limit", n)),
    );
    let page: Value = client.get(&path)?;
    let records = match page.get("records") {
        Some(Value::Array(r)) => r.clone(),
        _ => anyhow::bail!("forkboxd's egress answer has no `records` list: {page}"),
    };
    if format == Format::Json {
        for r in &records {
            println!("{}", serde_json::to_string(r)?);
        }
        return Ok(0);
    }
    let mut rows = Vec::with_capacity(records.len());
    for r in records {
        rows.push(egress_row(&serde_json::from_value(r)?));
    }
    print_table(
        &[
            "TIME(UTC)",
            "PROTO",
            "DESTINATION",
            "VERDICT",
            "REASON",
            "OUT/IN",
            "DURATION",
        ],
        &rows,
    );
    Ok(0)
}

fn egress_row(r: &EgressRecord) -> Vec<String> {
    vec![
        time_of_day(r.time_ms),
        protocol_text(r.protocol).into(),
        destination(r),
        match r.verdict {
            Verdict::Allow => "allow".into(),
            Verdict::Deny => "deny".into(),
        },
        reason_text(r),
        format!("{}/{}", r.bytes_out, r.bytes_in),
        duration_ms(r.duration_ms),
    ]
}

/// `HH:MM:SS.mmm` (UTC) of a time in milliseconds since the epoch.
fn time_of_day(ms: u64) -> String {
    let s = ms / 1000;
    format!(
        "{:02}:{:02}:{:02}.{:03}",
        s / 3600 % 24,
        s / 60 % 60,
        s % 60,
        ms % 1000
    )
}

fn protocol_text(p: Protocol) -> &'static str {
    match p {
        Protocol::Tcp => "tcp",
        Protocol::Udp => "udp",
        Protocol::Dns => "dns",
    }
}

/// DNS: the name asked (and the answers); else `name:port (address)`,
/// or `address:port` when no name is known.
fn destination(r: &EgressRecord) -> String {
    let addr = r.address.map(|a| match a {
        std::net::IpAddr::V6(v6) => format!("[{v6}]"),
        v4 => v4.to_string(),
    });
    if r.protocol == Protocol::Dns {
        let name = r.name.clone().unwrap_or_else(|| "-".into());
        if r.answers.is_empty() {
            return name;
        }
        let answers: Vec<String> = r.answers.iter().map(|a| a.to_string()).collect();
        return format!("{name} -> {}", answers.join(","));
    }
    match (&r.name, addr) {
        (Some(n), Some(a)) => format!("{n}:{} ({a})", r.port),
        (Some(n), None) => format!("{n}:{}", r.port),
        (None, Some(a)) => format!("{a}:{}", r.port),
        (None, None) => format!("-:{}", r.port),
    }
}

/// The rule that decided, or why no rule did (with the rule that let a
/// failed connect through); the error after it.
fn reason_text(r: &EgressRecord) -> String {
    let mut s = match (r.reason, &r.rule) {
        (LogReason::Rule, Some(rule)) => format!("rule {rule}"),
        (reason, Some(rule)) => format!("{} (rule {rule})", reason_word(reason)),
        (reason, None) => reason_word(reason).into(),
    };
    if let Some(e) = &r.error {
        s.push_str(": ");
        s.push_str(e);
    }
    s
}

fn reason_word(r: LogReason) -> &'static str {
    match r {
        LogReason::Rule => "rule",
        LogReason::NoRule => "no_rule",
        LogReason::SpecialAddress => "special_address",
        LogReason::UdpNotAllowed => "udp_not_allowed",
        LogReason::Limit => "limit",
        LogReason::ConnectFailed => "connect_failed",
        LogReason::InternalAddress => "internal_address",
        LogReason::SingleLabelName => "single_label_name",
        LogReason::BrokerDenied => "broker_denied",
        LogReason::NotFound => "not_found",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(json: Value) -> EgressRecord {
        serde_json::from_value(json).expect("a record")
    }

    #[test]
    fn rule_parser_accepts_rules_and_names_the_fault() {
        for ok in [
            "pypi.org",
            "*.debian.org:443",
            "10.1.0.0/16",
            "host.forkbox.internal:8000",
            "*",
        ] {
            assert_eq!(rule(ok).as_deref(), Ok(ok));
            assert_eq!(allow_rule(ok).as_deref(), Ok(ok));
        }
        let e = allow_rule("host.forkbox.internal").expect_err("no port");
        assert!(e.contains("exactly one port"), "{e}");
        assert!(
            rule("host.forkbox.internal").is_ok(),
            "a deny rule may omit it"
        );
        let e = rule("x:99999").expect_err("bad port");
        assert!(e.contains("99999"), "{e}");
        assert!(rule("10.1.2.3/16").is_err());
    }

    #[test]
    fn policy_lines_say_deny_all_without_allow_rules() {
        let view = |json: Value| -> NetworkView { serde_json::from_value(json).expect("view") };
        assert_eq!(
            policy_lines(&view(
                serde_json::json!({"allow_out": [], "deny_out": [], "active": true})
            )),
            ["deny all (no allow rules)"]
        );
        assert_eq!(
            policy_lines(&view(serde_json::json!({"active": false})))[0],
            "inactive: re-adopted after a daemon restart, it opens no new connection"
        );
        let spec = view(serde_json::json!({
            "allow_out": ["a.org:443"], "deny_out": ["10.0.0.0/8"], "active": true
        }));
        assert_eq!(
            policy_lines(&spec),
            ["allow  a.org:443", "deny   10.0.0.0/8"]
        );
    }

    #[test]
    fn egress_row_tcp_denied_shows_name_port_and_reason() {
        let r = record(serde_json::json!({
            "time_ms": 1_700_000_123_456u64, "sandbox": "sb-1", "protocol": "tcp",
            "name": "host.forkbox.internal", "address": "10.0.2.2", "port": 8000,
            "verdict": "deny", "reason": "no_rule", "bytes_out": 0, "bytes_in": 0,
            "duration_ms": 0
        }));
        assert_eq!(
            egress_row(&r),
            [
                "22:15:23.456",
                "tcp",
                "host.forkbox.internal:8000 (10.0.2.2)",
                "deny",
                "no_rule",
                "0/0",
                "0ms"
            ]
        );
    }

    #[test]
    fn egress_row_dns_and_allowed_rule_and_error() {
        let dns = record(serde_json::json!({
            "time_ms": 0, "sandbox": "sb-1", "protocol": "dns", "name": "a.org", "port": 53,
            "verdict": "allow", "reason": "rule", "rule": "a.org:443",
            "answers": ["192.0.2.1", "2001:db8::1"], "bytes_out": 0, "bytes_in": 0,
            "duration_ms": 0
        }));
        assert_eq!(destination(&dns), "a.org -> 192.0.2.1,2001:db8::1");
        assert_eq!(reason_text(&dns), "rule a.org:443");
        let failed = record(serde_json::json!({
            "time_ms": 0, "sandbox": "sb-1", "protocol": "tcp", "address": "2001:db8::1",
            "port": 443, "verdict": "allow", "reason": "connect_failed", "rule": "*:443",
            "error": "connection refused", "bytes_out": 0, "bytes_in": 0, "duration_ms": 3
        }));
        assert_eq!(destination(&failed), "[2001:db8::1]:443");
        assert_eq!(
            reason_text(&failed),
            "connect_failed (rule *:443): connection refused"
        );
    }

    #[test]
    fn time_of_day_is_utc_with_milliseconds() {
        assert_eq!(time_of_day(0), "00:00:00.000");
        assert_eq!(time_of_day(86_400_000 + 3_723_004), "01:02:03.004");
    }
}
