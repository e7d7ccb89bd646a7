//! The egress policy of one sandbox: which destinations its guest may reach.
//!
//! A policy is two lists of rules in the SDK's spelling,
//! `{"allow_out": [...], "deny_out": [...]}`. A rule names a host and
//! optionally a port:
//!
//! | rule | matches |
//! |---|---|
//! | `pypi.example.org` | that name, any port |
//! | `pypi.example.org:443` | that name, port 443 |
//! | `*.debian.org` | any name *below* `debian.org` (not `debian.org` itself) |
//! | `10.1.0.0/16`, `10.1.2.3` | addresses in that network (a bare address is a /32) |
//! | `2001:db8::/32`, `[2001:db8::/32]:443` | IPv6 likewise (brackets to add a port) |
//! | `*`, `*:443` | every destination except `host.forkbox.internal` |
//! | `name:8000-8999`, `name:*` | a port range, any port |
//! | `host.forkbox.internal:8080` | the host's loopback, that one port (an allow rule must name one port) |
//!
//! A name rule must have a dot: a single-label name (`foo`) is refused, as
//! the broker never resolves one (the host's search list would make it a
//! name of the host's own network).
//!
//! Decisions, in order (first that applies):
//! 1. UDP other than DNS is denied: the sandbox network carries TCP only.
//! 2. Loopback, unspecified, link-local (169.254.0.0/16 with cloud metadata
//!    services, fe80::/10), multicast and broadcast addresses are denied
//!    whatever the rules say: the host's loopback is reachable only as the
//!    name [`HOST_INTERNAL`].
//! 3. A matching `deny_out` rule denies (deny wins over allow).
//! 4. An internal address ([`Internal`]: private, shared, unique-local and
//!    cloud platform ranges, and the host's own addresses where the caller
//!    knows them) is allowed only by a CIDR rule that lies inside its range
//!    (for a host address: that names exactly it). A name rule or `*` that
//!    matches denies it with [`Reason::InternalAddress`]: a name that
//!    resolves into such a range is not thereby opened.
//! 5. A matching `allow_out` rule allows.
//! 6. Otherwise denied (default deny).
//!
//! [`HOST_INTERNAL`] is matched only by a rule that names it exactly: no
//! wildcard and no CIDR reaches the host's loopback by accident.
//!
//! Names are compared in their ASCII (punycode) form, lower case, without
//! the trailing dot, so `Bücher.Example.` in a rule and
//! `xn--bcher-kva.example` in a DNS query are the same name. Addresses are
//! compared in canonical form: an IPv4-mapped IPv6 address
//! (`::ffff:10.1.2.3`) is the IPv4 address it maps.

mod internal;
mod rule;
#[cfg(test)]
mod tests;

use std::net::IpAddr;

use serde::{Deserialize, Serialize};

pub use internal::Internal;
pub use rule::{HostPattern, IpNet, PortRange, Rule, RuleError};

/// The name under which a guest reaches the host's own loopback (through
/// the gateway address), as QEMU's user networking does with its host alias.
pub const HOST_INTERNAL: &str = "host.forkbox.internal";

/// The transport protocol of an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    Tcp,
    Udp,
    /// A DNS question (a name, no address or port yet).
    Dns,
}

/// What the guest tried to reach. `name` is the DNS name the guest looked
/// up for `ip`, when the gateway knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Destination<'a> {
    pub name: Option<&'a str>,
    pub ip: IpAddr,
    pub port: u16,
    pub protocol: Protocol,
}

/// Allowed or not.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    Allow,
    Deny,
}

/// Why a decision came out as it did: what goes in the egress log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reason {
    /// This `allow_out` rule matched and no deny rule did.
    AllowRule(String),
    /// This `deny_out` rule matched.
    DenyRule(String),
    /// No rule matched: default deny.
    NoRule,
    /// Loopback, link-local, multicast, broadcast or unspecified address.
    SpecialAddress,
    /// UDP other than DNS to the gateway.
    UdpNotAllowed,
    /// The address is internal and the allow rule that matched it (a name
    /// rule, `*`, or a CIDR wider than the range) does not open it.
    InternalAddress { internal: Internal, rule: String },
    /// A name of one label: never resolved (see the module doc).
    SingleLabelName,
}

/// A verdict and the reason for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub verdict: Verdict,
    pub reason: Reason,
}

impl Decision {
    fn deny(reason: Reason) -> Self {
        Self {
            verdict: Verdict::Deny,
            reason,
        }
    }

    pub fn is_allowed(&self) -> bool {
        self.verdict == Verdict::Allow
    }

    /// The text of the rule that decided, if a rule did (for
    /// [`Reason::InternalAddress`], the allow rule that did not suffice).
    pub fn rule(&self) -> Option<&str> {
        match &self.reason {
            Reason::AllowRule(r) | Reason::DenyRule(r) => Some(r),
            Reason::InternalAddress { rule, .. } => Some(rule),
            _ => None,
        }
    }

    /// A sentence for the log where the reason's name alone does not say
    /// what to do.
    pub fn explain(&self) -> Option<String> {
        match &self.reason {
            Reason::InternalAddress { internal, rule } => Some(format!(
                "the address is in {internal}: {rule:?} does not open it; only a CIDR rule \
                 inside that range does{}",
                match internal {
                    Internal::HostAddress(ip) => format!(" (exactly {ip})"),
                    Internal::Range { .. } => String::new(),
                }
            )),
            Reason::SingleLabelName => {
                Some("a single-label name is never resolved: look up the full name".to_owned())
            }
            _ => None,
        }
    }
}

/// A policy as the SDK and the daemon's API spell it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicySpec {
    #[serde(default)]
    pub allow_out: Vec<String>,
    #[serde(default)]
    pub deny_out: Vec<String>,
}

/// Which list a bad rule was in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RuleList {
    AllowOut,
    DenyOut,
}

impl std::fmt::Display for RuleList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RuleList::AllowOut => "allow_out",
            RuleList::DenyOut => "deny_out",
        })
    }
}

/// A policy that could not be built from its spec.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    #[error("{list}[{index}] {text:?} is not a valid rule")]
    BadRule {
        list: RuleList,
        index: usize,
        text: String,
        #[source]
        cause: RuleError,
    },
}

/// A parsed policy. Serialises as its [`PolicySpec`] (rules in normalised
/// form), deserialises from one with every rule checked.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "PolicySpec", into = "PolicySpec")]
pub struct Policy {
    allow: Vec<Rule>,
    deny: Vec<Rule>,
}

impl TryFrom<PolicySpec> for Policy {
    type Error = PolicyError;

    fn try_from(spec: PolicySpec) -> Result<Self, PolicyError> {
        Ok(Self {
            allow: parse_list(RuleList::AllowOut, &spec.allow_out)?,
            deny: parse_list(RuleList::DenyOut, &spec.deny_out)?,
        })
    }
}

impl From<Policy> for PolicySpec {
    fn from(p: Policy) -> Self {
        let texts = |rules: &[Rule]| rules.iter().map(|r| r.to_string()).collect();
        Self {
            allow_out: texts(&p.allow),
            deny_out: texts(&p.deny),
        }
    }
}

fn parse_list(list: RuleList, texts: &[String]) -> Result<Vec<Rule>, PolicyError> {
    texts
        .iter()
        .enumerate()
        .map(|(index, text)| {
            let rule = text.parse::<Rule>().and_then(|rule| match list {
                RuleList::AllowOut => rule.check_allow().map(|()| rule),
                RuleList::DenyOut => Ok(rule),
            });
            rule.map_err(|cause| PolicyError::BadRule {
                list,
                index,
                text: text.clone(),
                cause,
            })
        })
        .collect()
}

impl Policy {
    /// The policy that denies everything (the default of every sandbox).
    pub fn deny_all() -> Self {
        Self::default()
    }

    /// Parse the SDK spelling, e.g. `{"allow_out": ["*.debian.org"]}`.
    pub fn from_json(json: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(json)
    }

    pub fn allow_rules(&self) -> &[Rule] {
        &self.allow
    }

    pub fn deny_rules(&self) -> &[Rule] {
        &self.deny
    }

    /// Decide one connection attempt, knowing no address of the host (as
    /// in the VMM); [`Policy::decide_on_host`] is the broker's.
    pub fn decide(&self, dest: &Destination<'_>) -> Decision {
        self.decide_on_host(dest, &[])
    }

    /// Decide one connection attempt; `host_addresses` are the addresses
    /// of the host that would open the connection, internal like private
    /// ranges (only a CIDR rule naming one exactly opens it).
    pub fn decide_on_host(&self, dest: &Destination<'_>, host_addresses: &[IpAddr]) -> Decision {
        if dest.protocol == Protocol::Dns {
            return match dest.name {
                Some(name) => self.decide_name(name),
                None => Decision::deny(Reason::NoRule),
            };
        }
        if dest.protocol == Protocol::Udp {
            return Decision::deny(Reason::UdpNotAllowed);
        }
        let name = dest.name.and_then(rule::normalize_query_name);
        let host_internal = name.as_deref() == Some(HOST_INTERNAL);
        let ip = dest.ip.to_canonical();
        if !host_internal && is_special(ip) {
            return Decision::deny(Reason::SpecialAddress);
        }
        let target = rule::Target {
            name: name.as_deref(),
            ip: (!host_internal).then_some(ip),
            port: Some(dest.port),
        };
        let internal = match host_internal {
            true => None,
            false => Internal::of(ip, host_addresses),
        };
        match internal {
            None => self.first_match(&target),
            Some(internal) => self.internal_match(&target, internal),
        }
    }

    /// [`Policy::first_match`] for an internal address: deny rules as
    /// ever, then only a CIDR rule inside the range allows.
    fn internal_match(&self, target: &rule::Target<'_>, internal: Internal) -> Decision {
        if let Some(r) = self.deny.iter().find(|r| r.matches_deny(target)) {
            return Decision::deny(Reason::DenyRule(r.to_string()));
        }
        let opens = |r: &&Rule| match &r.host {
            HostPattern::Net(net) => internal.opened_by(net) && r.matches_allow(target),
            _ => false,
        };
        if let Some(r) = self.allow.iter().find(opens) {
            return Decision {
                verdict: Verdict::Allow,
                reason: Reason::AllowRule(r.to_string()),
            };
        }
        match self.allow.iter().find(|r| r.matches_allow(target)) {
            Some(r) => Decision::deny(Reason::InternalAddress {
                internal,
                rule: r.to_string(),
            }),
            None => Decision::deny(Reason::NoRule),
        }
    }

    /// Decide whether a DNS name may be resolved at all. A name resolves
    /// when some allow rule names it (on any port) and no port-less deny
    /// rule names it: `deny_out: ["x.org:25"]` still lets `x.org` resolve.
    pub fn decide_name(&self, name: &str) -> Decision {
        let Some(name) = rule::normalize_query_name(name) else {
            return Decision::deny(Reason::NoRule);
        };
        if !name.contains('.') {
            return Decision::deny(Reason::SingleLabelName);
        }
        let target = rule::Target {
            name: Some(&name),
            ip: None,
            port: None,
        };
        self.first_match(&target)
    }

    fn first_match(&self, target: &rule::Target<'_>) -> Decision {
        if let Some(r) = self.deny.iter().find(|r| r.matches_deny(target)) {
            return Decision::deny(Reason::DenyRule(r.to_string()));
        }
        match self.allow.iter().find(|r| r.matches_allow(target)) {
            Some(r) => Decision {
                verdict: Verdict::Allow,
                reason: Reason::AllowRule(r.to_string()),
            },
            None => Decision::deny(Reason::NoRule),
        }
    }
}

/// Addresses no rule can open (see the module doc).
fn is_special(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            v4.is_loopback()
                || v4.is_unspecified()
                || v4.is_link_local()
                || v4.is_multicast()
                || v4.is_broadcast()
                || v4.octets()[0] == 0
        }
        IpAddr::V6(v6) => {
            v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || (v6.segments()[0] & 0xffc0) == 0xfe80
        }
    }
}
