//! The sandbox network's gateway fed the guest's Ethernet frames.
//!
//! Input: a mode byte (what the connector does with allowed attempts:
//! echo, answer later, refuse, deny), then operations (first byte modulo
//! 6): a frame from the guest (u16 length, a flags byte whose bit 0 fixes
//! the IPv4, TCP, UDP and ICMP checksums so that a frame reaches past
//! them, then the bytes), time passing, the connector answering the
//! oldest attempt it held, the frames for the guest taken, the policy
//! replaced, every connection reset.
//!
//! What must hold: every frame for the guest is an Ethernet frame from the
//! gateway's MAC of at most `MAX_FRAME` bytes, and every bound of
//! `GatewayConfig` (connections, attempts, queued frames, names, log
//! records) holds after each step.

use std::collections::{HashMap, VecDeque};
use std::net::Ipv4Addr;
use std::time::Duration;

use forkbox_net::dns::{ResolveError, Resolver};
use forkbox_net::gateway::{
    ConnId, ConnectOutcome, ConnectRequest, Connector, EchoStream, Gateway, GatewayConfig, Now,
    GATEWAY_MAC, MAX_FRAME,
};
use forkbox_net::policy::Policy;
use smoltcp::wire::{
    EthernetAddress, EthernetFrame, EthernetProtocol, Icmpv4Packet, IpAddress, IpProtocol,
    Ipv4Packet, TcpPacket, UdpPacket,
};

use crate::input::Input;

const MAX_OPS: usize = 128;

/// The policies a guest is tried against.
pub const POLICIES: [&str; 2] = [
    r#"{"allow_out": ["*.example.com:80", "allowed.test", "10.9.0.0/16", "93.184.216.0/24:443",
        "host.forkbox.internal:8080"], "deny_out": ["blocked.example.com"]}"#,
    r#"{"allow_out": ["*"], "deny_out": ["*:25"]}"#,
];

/// Names the resolver knows; the rest do not exist.
pub struct Table(HashMap<&'static str, Vec<Ipv4Addr>>);

impl Table {
    pub fn new() -> Table {
        Table(HashMap::from([
            ("www.example.com", vec![Ipv4Addr::new(93, 184, 216, 34)]),
            (
                "allowed.test",
                vec![Ipv4Addr::new(10, 9, 0, 7), Ipv4Addr::new(93, 184, 216, 35)],
            ),
            ("blocked.example.com", vec![Ipv4Addr::new(93, 184, 216, 36)]),
            ("loop.example.com", vec![Ipv4Addr::new(127, 0, 0, 1)]),
            (
                "many.example.com",
                (1..=20).map(|i| Ipv4Addr::new(93, 184, 216, i)).collect(),
            ),
        ]))
    }
}

impl Resolver for Table {
    fn resolve_v4(&mut self, name: &str) -> Result<Vec<Ipv4Addr>, ResolveError> {
        match name {
            "fail.example.com" => Err(ResolveError::Failed("upstream timed out".into())),
            _ => self.0.get(name).cloned().ok_or(ResolveError::NotFound),
        }
    }
}

#[derive(Clone, Copy)]
enum Mode {
    Echo,
    Defer,
    Refuse,
    Deny,
}

struct Mem {
    mode: Mode,
    held: VecDeque<ConnId>,
}

fn outcome(choice: u8) -> ConnectOutcome {
    match choice % 3 {
        0 => ConnectOutcome::Connected(Box::new(EchoStream::with_capacity(64 * 1024))),
        1 => ConnectOutcome::Refused("connection refused".into()),
        _ => ConnectOutcome::Denied("the broker says no".into()),
    }
}

impl Connector for Mem {
    fn connect(&mut self, request: &ConnectRequest) -> Option<ConnectOutcome> {
        assert!(
            request.decision.is_allowed(),
            "asked to open a denied attempt: {request:?}"
        );
        match self.mode {
            Mode::Echo => Some(outcome(0)),
            Mode::Refuse => Some(outcome(1)),
            Mode::Deny => Some(outcome(2)),
            Mode::Defer => {
                self.held.push_back(request.id);
                None
            }
        }
    }
}

fn config() -> GatewayConfig {
    GatewayConfig {
        sandbox: "sb-fuzz".into(),
        random_seed: 7,
        max_connections: 8,
        max_pending: 4,
        connect_timeout: Duration::from_secs(5),
        tcp_buffer: 16 * 1024,
        tcp_timeout: Duration::from_secs(10),
        max_queued_frames: 32,
        max_queued_bytes: 128 * 1024,
        max_names: 8,
        log_capacity: 16,
    }
}

/// Recomputes the checksums of an Ethernet/IPv4 frame where its headers
/// are whole (a no-op on anything else).
pub fn fix_checksums(frame: &mut [u8]) {
    let Ok(mut eth) = EthernetFrame::new_checked(&mut frame[..]) else {
        return;
    };
    if eth.ethertype() != EthernetProtocol::Ipv4 {
        return;
    }
    let Ok(mut ip) = Ipv4Packet::new_checked(eth.payload_mut()) else {
        return;
    };
    ip.fill_checksum();
    let (src, dst) = (
        IpAddress::Ipv4(ip.src_addr()),
        IpAddress::Ipv4(ip.dst_addr()),
    );
    match ip.next_header() {
        IpProtocol::Tcp => {
            if let Ok(mut t) = TcpPacket::new_checked(ip.payload_mut()) {
                t.fill_checksum(&src, &dst);
            }
        }
        IpProtocol::Udp => {
            if let Ok(mut u) = UdpPacket::new_checked(ip.payload_mut()) {
                u.fill_checksum(&src, &dst);
            }
        }
        IpProtocol::Icmp => {
            if let Ok(mut i) = Icmpv4Packet::new_checked(ip.payload_mut()) {
                i.fill_checksum();
            }
        }
        _ => {}
    }
}

fn check(gw: &mut Gateway<Table, Mem>, c: &GatewayConfig) {
    let s = gw.stats();
    assert!(s.connections <= c.max_connections, "{s:?}");
    assert!(s.pending <= c.max_pending, "{s:?}");
    // A frame taken from the guest may queue its direct reply past the
    // limit (`QueueDevice::receive`, by design): at most one per queued
    // guest frame.
    assert!(s.frames_to_guest <= 2 * c.max_queued_frames, "{s:?}");
    assert!(s.frames_from_guest <= c.max_queued_frames, "{s:?}");
    assert!(s.names <= c.max_names, "{s:?}");
    assert!(s.log_records <= c.log_capacity, "{s:?}");
}

fn take_frames(gw: &mut Gateway<Table, Mem>) {
    while let Some(f) = gw.take_frame() {
        assert!(
            f.len() <= MAX_FRAME,
            "a frame of {} bytes for the guest",
            f.len()
        );
        let eth = EthernetFrame::new_checked(&f[..]).expect("an Ethernet frame for the guest");
        assert_eq!(eth.src_addr(), EthernetAddress(GATEWAY_MAC));
    }
}

pub fn gateway_frames(data: &[u8]) {
    let mut input = Input::new(data);
    let mode = match input.u8() % 4 {
        0 => Mode::Echo,
        1 => Mode::Defer,
        2 => Mode::Refuse,
        _ => Mode::Deny,
    };
    let policies: Vec<Policy> = POLICIES
        .iter()
        .map(|p| Policy::from_json(p).expect("fuzz policy"))
        .collect();
    let mut now = Now {
        monotonic: Duration::from_secs(1),
        unix_ms: 1_700_000_000_000,
    };
    let c = config();
    let connector = Mem {
        mode,
        held: VecDeque::new(),
    };
    let mut gw = Gateway::new(c.clone(), policies[0].clone(), Table::new(), connector, now);
    for _ in 0..MAX_OPS {
        if input.is_empty() {
            break;
        }
        match input.u8() % 6 {
            0 => {
                let len = usize::from(input.u16());
                let flags = input.u8();
                let mut frame = input.bytes(len).to_vec();
                if flags & 1 != 0 {
                    fix_checksums(&mut frame);
                }
                gw.receive_frame(&frame, now);
                gw.poll(now);
            }
            1 => {
                let ms = u64::from(input.u16());
                now.monotonic += Duration::from_millis(ms);
                now.unix_ms += ms;
                gw.poll(now);
            }
            2 => {
                let choice = input.u8();
                if let Some(id) = gw.connector_mut().held.pop_front() {
                    gw.connect_done(id, outcome(choice), now);
                }
            }
            3 => take_frames(&mut gw),
            4 => {
                let i = usize::from(input.u8()) % policies.len();
                gw.set_policy(policies[i].clone());
            }
            _ => gw.reset_all("fuzz", now),
        }
        check(&mut gw, &c);
    }
    take_frames(&mut gw);
    let _ = gw.take_log();
}
