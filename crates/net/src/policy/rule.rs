//! One rule of a policy: its parser, its normal form and its matcher.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

use super::HOST_INTERNAL;

/// Longest DNS name in text form, without the trailing dot (RFC 1035).
const MAX_NAME_LEN: usize = 253;
const MAX_LABEL_LEN: usize = 63;

/// Why a rule's text is not a rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RuleError {
    #[error("empty rule")]
    Empty,
    #[error("bad port {0:?}: want 1-65535, a range like 8000-8999, or *")]
    BadPort(String),
    #[error("bad network {0:?}: want an address and a prefix length like 10.1.0.0/16")]
    BadNetwork(String),
    #[error("{net} has host bits set past /{prefix}: did you mean {masked}/{prefix}?")]
    HostBitsSet {
        net: String,
        masked: IpAddr,
        prefix: u8,
    },
    #[error("bad name {name:?}: {why}")]
    BadName { name: String, why: &'static str },
    #[error("a wildcard is only allowed as `*` or a leading `*.`")]
    BadWildcard,
    #[error("missing `]` after an IPv6 address")]
    UnclosedBracket,
    #[error(
        "{name:?} is a single-label name: forkbox never resolves one (the host's resolver \
         would complete it with the host's own search domains); write the full name, \
         e.g. {name}.example.com"
    )]
    SingleLabel { name: String },
    #[error(
        "an allow rule for host.forkbox.internal needs exactly one port, e.g. \
         host.forkbox.internal:8080: without one (or with `*` or a range) it would open \
         every service on the host's loopback"
    )]
    HostInternalNeedsPort,
}

/// The host side of a rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostPattern {
    /// `*`: every destination but [`HOST_INTERNAL`].
    Any,
    /// One name, ASCII lower case, no trailing dot.
    Exact(String),
    /// `*.suffix`: names with at least one label before `.suffix`.
    Suffix(String),
    /// An address network.
    Net(IpNet),
}

/// An address and a prefix length, host bits zero, in canonical form (an
/// IPv4-mapped IPv6 network is stored as the IPv4 network).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpNet {
    addr: IpAddr,
    prefix: u8,
}

impl IpNet {
    /// `addr/prefix` as given: the caller knows the host bits are zero
    /// and the prefix fits the family.
    pub(super) const fn new_unchecked(addr: IpAddr, prefix: u8) -> Self {
        Self { addr, prefix }
    }

    pub fn addr(&self) -> IpAddr {
        self.addr
    }

    pub fn prefix(&self) -> u8 {
        self.prefix
    }

    /// 32 or 128: the prefix of a single address of this family.
    pub fn max_prefix(&self) -> u8 {
        if self.addr.is_ipv4() {
            32
        } else {
            128
        }
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, ip.to_canonical()) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => mask_v4(ip, self.prefix) == net,
            (IpAddr::V6(net), IpAddr::V6(ip)) => mask_v6(ip, self.prefix) == net,
            _ => false,
        }
    }

    fn parse(text: &str) -> Result<Self, RuleError> {
        let bad = || RuleError::BadNetwork(text.to_owned());
        let (addr, prefix) = match text.split_once('/') {
            Some((a, p)) => {
                let addr: IpAddr = a.parse().map_err(|_| bad())?;
                if p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(bad());
                }
                let prefix: u8 = p.parse().map_err(|_| bad())?;
                (addr, prefix)
            }
            None => {
                let addr: IpAddr = text.parse().map_err(|_| bad())?;
                (addr, if addr.is_ipv4() { 32 } else { 128 })
            }
        };
        let max = if addr.is_ipv4() { 32 } else { 128 };
        if prefix > max {
            return Err(bad());
        }
        let masked = match addr {
            IpAddr::V4(a) => IpAddr::V4(mask_v4(a, prefix)),
            IpAddr::V6(a) => IpAddr::V6(mask_v6(a, prefix)),
        };
        if masked != addr {
            return Err(RuleError::HostBitsSet {
                net: text.to_owned(),
                masked,
                prefix,
            });
        }
        Ok(Self::canonical(masked, prefix))
    }

    /// `::ffff:a.b.c.d/n` with n ≥ 96 is the IPv4 network `a.b.c.d/(n-96)`.
    fn canonical(addr: IpAddr, prefix: u8) -> Self {
        if let IpAddr::V6(v6) = addr {
            if let Some(v4) = v6.to_ipv4_mapped() {
                if prefix >= 96 {
                    return Self {
                        addr: IpAddr::V4(v4),
                        prefix: prefix - 96,
                    };
                }
            }
        }
        Self { addr, prefix }
    }
}

impl fmt::Display for IpNet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

fn mask_v4(ip: Ipv4Addr, prefix: u8) -> Ipv4Addr {
    let bits = u32::from(ip);
    let mask = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
    Ipv4Addr::from(bits & mask)
}

fn mask_v6(ip: Ipv6Addr, prefix: u8) -> Ipv6Addr {
    let bits = u128::from(ip);
    let mask = u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0);
    Ipv6Addr::from(bits & mask)
}

/// An inclusive port range; `1-65535` is "any port".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortRange {
    pub lo: u16,
    pub hi: u16,
}

impl PortRange {
    pub const ANY: PortRange = PortRange { lo: 1, hi: 65535 };

    pub fn contains(&self, port: u16) -> bool {
        (self.lo..=self.hi).contains(&port)
    }

    pub fn is_any(&self) -> bool {
        *self == Self::ANY
    }

    fn parse(text: &str) -> Result<Self, RuleError> {
        let bad = || RuleError::BadPort(text.to_owned());
        let port = |s: &str| -> Result<u16, RuleError> {
            if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
                return Err(bad());
            }
            match s.parse::<u16>() {
                Ok(p) if p > 0 => Ok(p),
                _ => Err(bad()),
            }
        };
        if text == "*" {
            return Ok(Self::ANY);
        }
        let (lo, hi) = match text.split_once('-') {
            Some((lo, hi)) => (port(lo)?, port(hi)?),
            None => {
                let p = port(text)?;
                (p, p)
            }
        };
        if lo > hi {
            return Err(bad());
        }
        Ok(Self { lo, hi })
    }
}

impl fmt::Display for PortRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.lo == self.hi {
            write!(f, "{}", self.lo)
        } else {
            write!(f, "{}-{}", self.lo, self.hi)
        }
    }
}

/// One parsed rule. Displays in normal form (`*.debian.org`,
/// `[2001:db8::/32]:443`), which parses back to the same rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    pub host: HostPattern,
    pub ports: PortRange,
}

/// What a rule is matched against. `ip: None` means "match by name only"
/// (DNS, or [`HOST_INTERNAL`]); `port: None` means "is there any port".
pub(super) struct Target<'a> {
    pub name: Option<&'a str>,
    pub ip: Option<IpAddr>,
    pub port: Option<u16>,
}

impl Rule {
    /// Checks what only an allow rule must satisfy: [`HOST_INTERNAL`] with
    /// exactly one port.
    pub fn check_allow(&self) -> Result<(), RuleError> {
        match &self.host {
            HostPattern::Exact(n) if n == HOST_INTERNAL && self.ports.lo != self.ports.hi => {
                Err(RuleError::HostInternalNeedsPort)
            }
            _ => Ok(()),
        }
    }

    /// Allow rules are narrow: [`HOST_INTERNAL`] only by its exact name.
    pub(super) fn matches_allow(&self, t: &Target<'_>) -> bool {
        let port_ok = t.port.is_none_or(|p| self.ports.contains(p));
        let internal = t.name == Some(HOST_INTERNAL);
        port_ok
            && match &self.host {
                HostPattern::Any => !internal && (t.name.is_some() || t.ip.is_some()),
                HostPattern::Exact(n) => t.name == Some(n.as_str()),
                HostPattern::Suffix(s) => !internal && t.name.is_some_and(|n| below(n, s)),
                HostPattern::Net(net) => t.ip.is_some_and(|ip| net.contains(ip)),
            }
    }

    /// Deny rules are broad: a wildcard denies [`HOST_INTERNAL`] too, and
    /// for "any port" questions only a port-less deny rule counts.
    pub(super) fn matches_deny(&self, t: &Target<'_>) -> bool {
        let port_ok = match t.port {
            Some(p) => self.ports.contains(p),
            None => self.ports.is_any(),
        };
        port_ok
            && match &self.host {
                HostPattern::Any => true,
                HostPattern::Exact(n) => t.name == Some(n.as_str()),
                HostPattern::Suffix(s) => t.name.is_some_and(|n| below(n, s)),
                HostPattern::Net(net) => t.ip.is_some_and(|ip| net.contains(ip)),
            }
    }
}

/// `name` is strictly below `suffix` (`a.b.c` is below `b.c`; `b.c` and
/// `xb.c` are not).
fn below(name: &str, suffix: &str) -> bool {
    name.len() > suffix.len() + 1
        && name.ends_with(suffix)
        && name.as_bytes()[name.len() - suffix.len() - 1] == b'.'
}

impl FromStr for Rule {
    type Err = RuleError;

    fn from_str(text: &str) -> Result<Self, RuleError> {
        let text = text.trim();
        if text.is_empty() {
            return Err(RuleError::Empty);
        }
        let (host, port) = split_host_port(text)?;
        let ports = match port {
            Some(p) => PortRange::parse(p)?,
            None => PortRange::ANY,
        };
        Ok(Self {
            host: parse_host(host)?,
            ports,
        })
    }
}

/// `[v6]:port`, `[v6]`, bare v6 (two or more colons: no port), `host:port`.
fn split_host_port(text: &str) -> Result<(&str, Option<&str>), RuleError> {
    if let Some(rest) = text.strip_prefix('[') {
        let (host, after) = rest.split_once(']').ok_or(RuleError::UnclosedBracket)?;
        return match after {
            "" => Ok((host, None)),
            _ => match after.strip_prefix(':') {
                Some(port) => Ok((host, Some(port))),
                None => Err(RuleError::BadNetwork(text.to_owned())),
            },
        };
    }
    match text.matches(':').count() {
        0 => Ok((text, None)),
        1 => {
            let (h, p) = text.split_once(':').ok_or(RuleError::Empty)?;
            Ok((h, Some(p)))
        }
        _ => Ok((text, None)),
    }
}

fn parse_host(host: &str) -> Result<HostPattern, RuleError> {
    if host.is_empty() {
        return Err(RuleError::Empty);
    }
    if host == "*" {
        return Ok(HostPattern::Any);
    }
    if host.contains('/') || host.parse::<IpAddr>().is_ok() {
        return Ok(HostPattern::Net(IpNet::parse(host)?));
    }
    let (wild, name) = match host.strip_prefix("*.") {
        Some(rest) => (true, rest),
        None => (false, host),
    };
    if name.contains('*') {
        return Err(RuleError::BadWildcard);
    }
    let name = normalize_rule_name(name)?;
    if !wild && !name.contains('.') {
        return Err(RuleError::SingleLabel { name });
    }
    Ok(if wild {
        HostPattern::Suffix(name)
    } else {
        HostPattern::Exact(name)
    })
}

/// A rule's name to ASCII lower case without the trailing dot; Unicode
/// names through IDNA (UTS #46) to punycode.
fn normalize_rule_name(name: &str) -> Result<String, RuleError> {
    let bad = |why| RuleError::BadName {
        name: name.to_owned(),
        why,
    };
    let trimmed = name.strip_suffix('.').unwrap_or(name);
    let ascii = if trimmed.is_ascii() {
        trimmed.to_ascii_lowercase()
    } else {
        idna::domain_to_ascii(trimmed).map_err(|_| bad("not a valid internationalised name"))?
    };
    check_name(&ascii).map_err(bad)?;
    Ok(ascii)
}

/// A name from a DNS query or the gateway, in the form rules are stored
/// in; `None` if it cannot be a host name (then no name rule matches it).
pub(super) fn normalize_query_name(name: &str) -> Option<String> {
    let trimmed = name.strip_suffix('.').unwrap_or(name);
    if !trimmed.is_ascii() {
        return None;
    }
    let lower = trimmed.to_ascii_lowercase();
    check_name(&lower).ok()?;
    Some(lower)
}

fn check_name(name: &str) -> Result<(), &'static str> {
    if name.is_empty() {
        return Err("empty");
    }
    if name.len() > MAX_NAME_LEN {
        return Err("longer than 253 characters");
    }
    for label in name.split('.') {
        if label.is_empty() {
            return Err("empty label");
        }
        if label.len() > MAX_LABEL_LEN {
            return Err("a label is longer than 63 characters");
        }
        let ok = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_';
        if !label.bytes().all(ok) {
            return Err("only letters, digits, '-' and '_' may appear in a label");
        }
    }
    let last = name.rsplit('.').next().unwrap_or(name);
    if last.bytes().all(|b| b.is_ascii_digit()) {
        return Err("all-numeric last label (a mistyped address?)");
    }
    Ok(())
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let v6 = matches!(&self.host, HostPattern::Net(n) if n.addr.is_ipv6());
        let host = match &self.host {
            HostPattern::Any => "*".to_owned(),
            HostPattern::Exact(n) => n.clone(),
            HostPattern::Suffix(s) => format!("*.{s}"),
            HostPattern::Net(n) => n.to_string(),
        };
        match (self.ports.is_any(), v6) {
            (true, _) => f.write_str(&host),
            (false, true) => write!(f, "[{host}]:{}", self.ports),
            (false, false) => write!(f, "{host}:{}", self.ports),
        }
    }
}
