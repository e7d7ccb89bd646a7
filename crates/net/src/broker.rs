//! The messages between a VMM and its connection broker, sans-IO.
//!
//! The VMM is not trusted with the network: it asks a broker (in forkbox,
//! a process that holds the sandbox's policy) to resolve allowed names and
//! to open allowed TCP connections, and receives each connected socket as
//! a file descriptor (`SCM_RIGHTS`). One JSON message per `SOCK_SEQPACKET`
//! datagram each way; every reply names the request it answers, so
//! connects can be answered out of order. The broker also sends the
//! sandbox's policy, first on every connection and again whenever it
//! changes, so the VMM's gateway decides (and logs) with the same rules.
//!
//! [`link`] moves one message (and its fd) across the socket, for both
//! ends.

pub mod link;

use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4};

use serde::{Deserialize, Serialize};

use crate::gateway::GATEWAY_IP;
use crate::policy::{Decision, Destination, Policy, Protocol, Reason, HOST_INTERNAL};

/// Longest message either way (a policy of a few hundred rules fits).
pub const MAX_MESSAGE: usize = 64 * 1024;

/// What a VMM asks its broker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum BrokerRequest {
    /// Open a TCP connection to `address:port` (the guest's destination;
    /// [`GATEWAY_IP`] is the host's loopback), which the guest looked up
    /// as `name`. Answered with the connected socket.
    Connect {
        id: u64,
        #[serde(default)]
        name: Option<String>,
        address: Ipv4Addr,
        port: u16,
    },
    /// Resolve an allowed name to IPv4 addresses.
    Resolve { id: u64, name: String },
}

/// The broker's answer. A successful `connect` carries one fd.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BrokerReply {
    pub id: u64,
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub addresses: Vec<Ipv4Addr>,
    /// For `resolve`: the name does not exist.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub not_found: bool,
    /// For `connect`: the broker's policy denied it (`error` says why),
    /// as opposed to a connection that failed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub denied: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl BrokerReply {
    pub fn failed(id: u64, error: impl Into<String>) -> Self {
        Self {
            id,
            ok: false,
            addresses: Vec::new(),
            not_found: false,
            denied: false,
            error: Some(error.into()),
        }
    }

    /// A connect the broker's policy denies.
    pub fn denied(id: u64, why: impl Into<String>) -> Self {
        Self {
            denied: true,
            ..Self::failed(id, why)
        }
    }
}

/// What a broker sends a VMM.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum BrokerMessage {
    /// The sandbox's policy from now on.
    Policy {
        policy: Policy,
    },
    Reply(BrokerReply),
}

/// Where `host.forkbox.internal` goes on the host: its loopback address.
pub const HOST_LOOPBACK: Ipv4Addr = Ipv4Addr::LOCALHOST;

/// Where the daemon's port forwards (host → guest) listen: a loopback
/// address the broker never connects to, so that no sandbox reaches
/// another's forward, whatever port its `host.forkbox.internal` rule
/// names (a listener bound to one address does not accept connections
/// made to another).
pub const PORT_FORWARD_IP: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);

const _: () = assert!(
    u32::from_be_bytes(HOST_LOOPBACK.octets()) != u32::from_be_bytes(PORT_FORWARD_IP.octets())
);

/// Where the broker connects for an allowed request, or why it will not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConnectPlan {
    /// Connect here ([`HOST_LOOPBACK`] for [`HOST_INTERNAL`]).
    Connect(SocketAddr),
    /// Allowed only by the name's rules: connect only if `name` resolves
    /// (on the broker's side) to the address, since the VMM's word for
    /// which name an address belongs to is not trusted.
    ConnectIfResolves {
        name: String,
        target: SocketAddrV4,
    },
    Deny(String),
}

/// The broker's own decision on a connect request: the policy again, from
/// the start, on the address the broker would connect to (which is the
/// address it then connects to: no name is resolved after this). The host's
/// own addresses (`host_addresses`) are internal: only a CIDR rule naming
/// one exactly opens it.
pub fn plan_connect(
    policy: &Policy,
    host_addresses: &[IpAddr],
    name: Option<&str>,
    address: Ipv4Addr,
    port: u16,
) -> ConnectPlan {
    if address == GATEWAY_IP {
        let d = Destination {
            name: Some(HOST_INTERNAL),
            ip: address.into(),
            port,
            protocol: Protocol::Tcp,
        };
        return match policy.decide(&d).is_allowed() {
            true => ConnectPlan::Connect(SocketAddr::from((HOST_LOOPBACK, port))),
            false => ConnectPlan::Deny(format!("{HOST_INTERNAL}:{port} is not allowed")),
        };
    }
    let decide = |name: Option<&str>| {
        let d = Destination {
            name,
            ip: address.into(),
            port,
            protocol: Protocol::Tcp,
        };
        policy.decide_on_host(&d, host_addresses)
    };
    let by_address = decide(None);
    if by_address.is_allowed() {
        // A name could only add a deny rule: decide with it too.
        if let Some(n) = name {
            let with_name = decide(Some(n));
            if !with_name.is_allowed() {
                return denial(&format!("{n} ({address}):{port}"), &with_name);
            }
        }
        return ConnectPlan::Connect(SocketAddr::from((address, port)));
    }
    match name {
        Some(n) if n != HOST_INTERNAL => {
            let with_name = decide(Some(n));
            if with_name.is_allowed() {
                ConnectPlan::ConnectIfResolves {
                    name: n.to_owned(),
                    target: SocketAddrV4::new(address, port),
                }
            } else {
                denial(&format!("{n} ({address}):{port}"), &with_name)
            }
        }
        _ => denial(&format!("{address}:{port}"), &by_address),
    }
}

fn denial(what: &str, decision: &Decision) -> ConnectPlan {
    let why = match (&decision.reason, decision.explain()) {
        (_, Some(explained)) => format!(": {explained}"),
        (Reason::DenyRule(r), None) => format!(": deny rule {r:?}"),
        (Reason::SpecialAddress, None) => {
            ": loopback, link-local, multicast, broadcast and unspecified addresses are never reachable".to_owned()
        }
        _ => String::new(),
    };
    ConnectPlan::Deny(format!("{what} is not allowed{why}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(json: &str) -> Policy {
        Policy::from_json(json).expect("policy")
    }

    #[test]
    fn broker_messages_tell_policies_from_replies() {
        let p = policy(r#"{"allow_out":["*.example.org:443"]}"#);
        let pushed =
            serde_json::to_string(&BrokerMessage::Policy { policy: p.clone() }).expect("json");
        let reply = serde_json::to_string(&BrokerReply::failed(3, "no")).expect("json");
        let parse = |s: &str| serde_json::from_str::<BrokerMessage>(s).expect("message");
        assert_eq!(parse(&pushed), BrokerMessage::Policy { policy: p });
        assert_eq!(
            parse(&reply),
            BrokerMessage::Reply(BrokerReply::failed(3, "no"))
        );
        // A policy with a bad rule is no message at all.
        assert!(serde_json::from_str::<BrokerMessage>(
            r#"{"policy":{"allow_out":["bad name!:99999"]}}"#
        )
        .is_err());
    }

    #[test]
    fn broker_plan_host_internal_goes_to_loopback_only_when_allowed() {
        let p = policy(r#"{"allow_out":["host.forkbox.internal:8080"]}"#);
        assert_eq!(
            plan_connect(&p, &[], Some(HOST_INTERNAL), GATEWAY_IP, 8080),
            ConnectPlan::Connect("127.0.0.1:8080".parse().expect("addr"))
        );
        assert!(matches!(
            plan_connect(&p, &[], None, GATEWAY_IP, 8081),
            ConnectPlan::Deny(_)
        ));
        // Loopback by address is never reachable.
        assert!(matches!(
            plan_connect(&p, &[], Some(HOST_INTERNAL), Ipv4Addr::LOCALHOST, 8080),
            ConnectPlan::Deny(_)
        ));
    }

    #[test]
    fn broker_plan_name_rules_need_resolution_cidr_rules_do_not() {
        let p = policy(
            r#"{"allow_out":["pypi.example.org:443","192.0.2.0/24"],"deny_out":["bad.example"]}"#,
        );
        let a = Ipv4Addr::new(198, 51, 100, 7);
        assert_eq!(
            plan_connect(&p, &[], Some("pypi.example.org"), a, 443),
            ConnectPlan::ConnectIfResolves {
                name: "pypi.example.org".into(),
                target: SocketAddrV4::new(a, 443)
            }
        );
        assert!(matches!(
            plan_connect(&p, &[], None, a, 443),
            ConnectPlan::Deny(_)
        ));
        let b = Ipv4Addr::new(192, 0, 2, 9);
        assert!(matches!(
            plan_connect(&p, &[], None, b, 80),
            ConnectPlan::Connect(_)
        ));
        assert!(matches!(
            plan_connect(&p, &[], Some("bad.example"), b, 80),
            ConnectPlan::Deny(_)
        ));
    }

    #[test]
    fn broker_plan_name_resolving_into_an_internal_range_is_denied_with_why() {
        let p = policy(r#"{"allow_out":["*","svc.example.org:443"]}"#);
        // The guest looked the name up, the answer (or a rebound one) was a
        // private address: the address connected to is what is checked.
        for a in [
            Ipv4Addr::new(10, 0, 0, 5),
            Ipv4Addr::new(192, 168, 1, 1),
            Ipv4Addr::new(172, 16, 0, 1),
            Ipv4Addr::new(100, 64, 0, 1),
            Ipv4Addr::new(168, 63, 129, 16),
            Ipv4Addr::new(169, 254, 169, 254),
        ] {
            for name in [Some("svc.example.org"), None] {
                match plan_connect(&p, &[], name, a, 443) {
                    ConnectPlan::Deny(why) => assert!(why.contains("not allowed"), "{why}"),
                    other => panic!("{a} {name:?}: {other:?}"),
                }
            }
        }
        let ConnectPlan::Deny(why) = plan_connect(
            &p,
            &[],
            Some("svc.example.org"),
            Ipv4Addr::new(10, 0, 0, 5),
            443,
        ) else {
            panic!("denied");
        };
        assert!(why.contains("10.0.0.0/8") && why.contains("CIDR"), "{why}");
        // Opened only by a CIDR rule inside the range.
        let open = policy(r#"{"allow_out":["svc.example.org:443","10.0.0.0/24:443"]}"#);
        assert_eq!(
            plan_connect(
                &open,
                &[],
                Some("svc.example.org"),
                Ipv4Addr::new(10, 0, 0, 5),
                443
            ),
            ConnectPlan::Connect("10.0.0.5:443".parse().expect("addr"))
        );
    }

    #[test]
    fn broker_plan_host_own_address_needs_an_exact_cidr_rule() {
        let host = [IpAddr::V4(Ipv4Addr::new(203, 0, 113, 5))];
        let a = Ipv4Addr::new(203, 0, 113, 5);
        let p = policy(r#"{"allow_out":["*","203.0.113.0/24"]}"#);
        let ConnectPlan::Deny(why) = plan_connect(&p, &host, Some("a.example.org"), a, 80) else {
            panic!("denied");
        };
        assert!(why.contains("address of this host"), "{why}");
        assert!(matches!(
            plan_connect(&p, &host, None, a, 80),
            ConnectPlan::Deny(_)
        ));
        let exact = policy(r#"{"allow_out":["203.0.113.5:80"]}"#);
        assert!(matches!(
            plan_connect(&exact, &host, None, a, 80),
            ConnectPlan::Connect(_)
        ));
    }

    #[test]
    fn broker_plan_host_internal_goes_to_host_loopback_never_to_port_forwards() {
        let p = policy(r#"{"allow_out":["host.forkbox.internal:4000"]}"#);
        let ConnectPlan::Connect(to) = plan_connect(&p, &[], None, GATEWAY_IP, 4000) else {
            panic!("allowed");
        };
        assert_eq!(to.ip(), IpAddr::V4(HOST_LOOPBACK));
        assert_ne!(to.ip(), IpAddr::V4(PORT_FORWARD_IP));
        // The forwards' address is loopback: no rule reaches it by address.
        let any = policy(r#"{"allow_out":["*","127.0.0.0/8"]}"#);
        assert!(matches!(
            plan_connect(&any, &[], None, PORT_FORWARD_IP, 4000),
            ConnectPlan::Deny(_)
        ));
    }

    #[test]
    fn broker_messages_round_trip() {
        let r = BrokerRequest::Connect {
            id: 3,
            name: Some(HOST_INTERNAL.into()),
            address: GATEWAY_IP,
            port: 80,
        };
        let s = serde_json::to_string(&r).expect("json");
        assert_eq!(serde_json::from_str::<BrokerRequest>(&s).expect("parse"), r);
        let ok = BrokerReply {
            id: 1,
            ok: true,
            addresses: vec![Ipv4Addr::new(192, 0, 2, 1)],
            not_found: false,
            denied: false,
            error: None,
        };
        let s = serde_json::to_string(&ok).expect("json");
        assert_eq!(s, r#"{"id":1,"ok":true,"addresses":["192.0.2.1"]}"#);
        assert_eq!(serde_json::from_str::<BrokerReply>(&s).expect("parse"), ok);
    }
}
