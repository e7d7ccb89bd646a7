//! The network broker's side of what a VMM asks (a VMM a guest took over
//! may send anything): one request datagram parsed as the broker parses
//! it, and a connect planned against one of a few policies.
//!
//! Input: a policy selector byte, then the datagram (JSON). What must
//! hold: a request round-trips through JSON; a deny-all policy never
//! connects; the gateway's address leads only to the host's loopback on
//! an allowed port; no plan connects to a special address, nor to an
//! internal one (private, shared, metadata, the host's own) unless a CIDR
//! rule names it; a plan that connects goes to the requested address.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4};

use forkbox_net::broker::{plan_connect, BrokerRequest, ConnectPlan, HOST_LOOPBACK, MAX_MESSAGE};
use forkbox_net::gateway::GATEWAY_IP;
use forkbox_net::policy::{Internal, Policy};

use crate::input::Input;
use crate::policy::special;

/// Deny all; any name; names and the host's port 8080; CIDR rules that
/// open a private range and a public one.
const POLICIES: [&str; 4] = [
    r#"{}"#,
    r#"{"allow_out":["*"]}"#,
    r#"{"allow_out":["*.example.org:443","host.forkbox.internal:8080"]}"#,
    r#"{"allow_out":["10.1.0.0/16:22","203.0.113.0/24"]}"#,
];

/// The host's own addresses, as the broker would find them.
const HOST: [IpAddr; 2] = [
    IpAddr::V4(Ipv4Addr::new(10, 9, 9, 9)),
    IpAddr::V4(Ipv4Addr::new(198, 51, 100, 7)),
];

pub fn broker_requests(data: &[u8]) {
    let mut input = Input::new(data);
    let which = usize::from(input.u8()) % POLICIES.len();
    let datagram = input.rest();
    if datagram.len() > MAX_MESSAGE {
        return;
    }
    let Ok(request) = serde_json::from_slice::<BrokerRequest>(datagram) else {
        return;
    };
    let json = serde_json::to_vec(&request).expect("a request serialises");
    let again: BrokerRequest = serde_json::from_slice(&json).expect("a serialised request parses");
    assert_eq!(again, request);
    let BrokerRequest::Connect {
        name,
        address,
        port,
        ..
    } = request
    else {
        return;
    };
    let policy = Policy::from_json(POLICIES[which]).expect("a fixed policy");
    match plan_connect(&policy, &HOST, name.as_deref(), address, port) {
        ConnectPlan::Connect(to) => {
            assert_ne!(which, 0, "deny-all connected {name:?} {address}:{port}");
            if address == GATEWAY_IP {
                assert_eq!(to, SocketAddr::from((HOST_LOOPBACK, port)));
                assert!(
                    which == 2 && port == 8080,
                    "host port {port} under policy {which}"
                );
                return;
            }
            assert_eq!(to, SocketAddr::from((address, port)));
            assert!(!special(address.into()), "{address} under policy {which}");
            if let Some(internal) = Internal::of(address.into(), &HOST) {
                // Only policy 3 names an internal range, and only 10.1/16.
                assert!(
                    which == 3 && address.octets()[..2] == [10, 1] && port == 22,
                    "{address}:{port} ({internal}) under policy {which}"
                );
            }
        }
        ConnectPlan::ConnectIfResolves { name: n, target } => {
            assert_ne!(which, 0, "deny-all would connect {n}");
            assert_eq!(Some(n.as_str()), name.as_deref());
            assert_eq!(target, SocketAddrV4::new(address, port));
        }
        ConnectPlan::Deny(why) => assert!(!why.is_empty()),
    }
}
