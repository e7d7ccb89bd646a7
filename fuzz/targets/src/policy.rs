//! Egress rules and policies, as a client writes them.
//!
//! Input: a mode byte, then text. Mode 0: one rule; its normal form
//! (`Display`) parses back to the same rule, and is its own normal form.
//! Mode 1: a policy in JSON; it serialises to JSON that parses back to the
//! same policy. Either way the parsed rules then decide a few
//! destinations the input names, and an allowed one never is a special
//! address (loopback, link-local, ...).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use forkbox_net::policy::{Destination, Policy, Protocol, Rule, Verdict, HOST_INTERNAL};

use crate::input::Input;

pub fn policy_rules(data: &[u8]) {
    let mut input = Input::new(data);
    let mode = input.u8();
    let probes = input.array::<24>();
    let Ok(text) = std::str::from_utf8(input.rest()) else {
        return;
    };
    let policy = if mode & 1 == 0 {
        let Ok(rule) = text.parse::<Rule>() else {
            return;
        };
        let normal = rule.to_string();
        let again: Rule = normal
            .parse()
            .unwrap_or_else(|e| panic!("normal form {normal:?} of {text:?} does not parse: {e}"));
        assert_eq!(again, rule, "{text:?} -> {normal:?}");
        assert_eq!(again.to_string(), normal);
        let Ok(json) = serde_json::to_string(&serde_json::json!({ "deny_out": [normal] })) else {
            return;
        };
        Policy::from_json(&json).expect("a parsed rule is a valid deny rule")
    } else {
        let Ok(policy) = Policy::from_json(text) else {
            return;
        };
        let json = serde_json::to_string(&policy).expect("a policy serialises");
        let again = Policy::from_json(&json)
            .unwrap_or_else(|e| panic!("{json:?} (from {text:?}) does not parse: {e}"));
        assert_eq!(again, policy, "{json}");
        policy
    };
    decide(&policy, &probes);
}

fn decide(policy: &Policy, p: &[u8; 24]) {
    let v4 = IpAddr::V4(Ipv4Addr::new(p[0], p[1], p[2], p[3]));
    let mut six = [0u8; 16];
    six.copy_from_slice(&p[4..20]);
    let v6 = IpAddr::V6(Ipv6Addr::from(six));
    let port = u16::from_le_bytes([p[20], p[21]]);
    let names = [
        None,
        Some("www.example.com"),
        Some("host.forkbox.internal"),
        Some("foo"),
    ];
    for ip in [v4, v6] {
        for name in names {
            for protocol in [Protocol::Tcp, Protocol::Udp] {
                let d = policy.decide(&Destination {
                    name,
                    ip,
                    port,
                    protocol,
                });
                if d.verdict == Verdict::Allow {
                    assert_eq!(protocol, Protocol::Tcp, "UDP allowed: {d:?}");
                    // The host's loopback is reached by that name only.
                    if name != Some(HOST_INTERNAL) {
                        assert!(!special(ip), "{ip} allowed: {d:?}");
                    }
                }
            }
        }
    }
    for name in names.into_iter().flatten() {
        let _ = policy.decide_name(name);
    }
}

/// What no rule may open (the policy module's decision 2).
pub(crate) fn special(ip: IpAddr) -> bool {
    let ip = match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    };
    match ip {
        IpAddr::V4(a) => {
            a.is_loopback()
                || a.is_unspecified()
                || a.is_link_local()
                || a.is_multicast()
                || a.is_broadcast()
                || a.octets()[0] == 0
        }
        IpAddr::V6(a) => {
            a.is_loopback()
                || a.is_unspecified()
                || a.is_multicast()
                || (a.segments()[0] & 0xffc0) == 0xfe80
        }
    }
}
