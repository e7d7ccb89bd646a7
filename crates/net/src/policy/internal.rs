//! Internal address ranges: private, shared, unique-local, cloud platform
//! endpoints and the host's own addresses. A name rule or `*` never opens
//! them; only a CIDR rule that lies inside one does (see [`Internal::opened_by`]).

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use super::rule::IpNet;

/// A named internal range.
struct Range {
    net: IpNet,
    what: &'static str,
}

const fn v4(a: u8, b: u8, c: u8, d: u8, prefix: u8, what: &'static str) -> Range {
    Range {
        net: IpNet::new_unchecked(IpAddr::V4(Ipv4Addr::new(a, b, c, d)), prefix),
        what,
    }
}

const fn v6(segments: [u16; 3], prefix: u8, what: &'static str) -> Range {
    let [a, b, c] = segments;
    Range {
        net: IpNet::new_unchecked(IpAddr::V6(Ipv6Addr::new(a, b, c, 0, 0, 0, 0, 0)), prefix),
        what,
    }
}

/// Addresses are compared in canonical form, so an IPv4-mapped IPv6
/// address (`::ffff:10.1.2.3`) falls in the IPv4 range it maps into.
const RANGES: &[Range] = &[
    v4(10, 0, 0, 0, 8, "private network, RFC 1918"),
    v4(172, 16, 0, 0, 12, "private network, RFC 1918"),
    v4(192, 168, 0, 0, 16, "private network, RFC 1918"),
    v4(
        100,
        64,
        0,
        0,
        10,
        "shared address space, carrier-grade NAT, RFC 6598",
    ),
    v4(168, 63, 129, 16, 32, "Azure platform endpoint, wireserver"),
    v4(192, 0, 0, 0, 24, "IETF protocol assignments, RFC 6890"),
    v4(198, 18, 0, 0, 15, "benchmarking network, RFC 2544"),
    v4(240, 0, 0, 0, 4, "reserved, RFC 1112"),
    v6([0xfc00, 0, 0], 7, "unique local network, RFC 4193"),
    v6([0xfec0, 0, 0], 10, "site-local network, deprecated"),
    v6([0, 0, 0], 96, "IPv4-compatible address, deprecated"),
    v6([0x64, 0xff9b, 0], 96, "NAT64, embeds an IPv4 address"),
    v6([0x64, 0xff9b, 1], 48, "local NAT64, embeds an IPv4 address"),
    v6([0x2002, 0, 0], 16, "6to4, embeds an IPv4 address"),
];

/// Why an address is internal: the range it is in, or "this host".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Internal {
    /// In a named range: `net` is the range, `what` says what it is.
    Range { net: IpNet, what: &'static str },
    /// One of the addresses of the host the broker runs on.
    HostAddress(IpAddr),
}

impl Internal {
    /// Whether `ip` is internal; `host` lists the host's own addresses
    /// (empty where they are not known, as in the VMM).
    pub fn of(ip: IpAddr, host: &[IpAddr]) -> Option<Self> {
        let ip = ip.to_canonical();
        if host.iter().any(|h| h.to_canonical() == ip) {
            return Some(Internal::HostAddress(ip));
        }
        RANGES
            .iter()
            .find(|r| r.net.contains(ip))
            .map(|r| Internal::Range {
                net: r.net,
                what: r.what,
            })
    }

    /// Whether a CIDR rule of `net` opens this address: the rule must lie
    /// inside the range (`10.1.0.0/16` opens `10.1.2.3`; `0.0.0.0/0` does
    /// not), or, for a host address, name exactly that address.
    pub fn opened_by(&self, net: &IpNet) -> bool {
        match self {
            Internal::Range { net: range, .. } => {
                net.prefix() >= range.prefix() && range.contains(net.addr())
            }
            Internal::HostAddress(ip) => net.prefix() == net.max_prefix() && net.addr() == *ip,
        }
    }
}

impl fmt::Display for Internal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Internal::Range { net, what } => write!(f, "{net} ({what})"),
            Internal::HostAddress(ip) => write!(f, "{ip} (an address of this host)"),
        }
    }
}
