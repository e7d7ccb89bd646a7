//! The gateway against a second smoltcp interface playing the guest, wired
//! back to back in memory, with an in-memory connector. Time is a counter.

mod harness;

use std::net::{IpAddr, Ipv4Addr, SocketAddrV4};

use simple_dns::rdata::RData;
use simple_dns::{Name, Packet, Question, CLASS, QCLASS, QTYPE, RCODE, TYPE};
use smoltcp::socket::tcp::State;

use super::*;
use crate::log::LogReason;
use crate::policy::Verdict;
use harness::{arp_request, syn_frame, Behavior, Net};

const SERVER: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 10);

fn dst(ip: Ipv4Addr, port: u16) -> SocketAddrV4 {
    SocketAddrV4::new(ip, port)
}

fn dns_query(id: u16, name: &str) -> Vec<u8> {
    let mut p = Packet::new_query(id);
    p.questions.push(Question::new(
        Name::new_unchecked(name),
        QTYPE::TYPE(TYPE::A),
        QCLASS::CLASS(CLASS::IN),
        false,
    ));
    p.build_bytes_vec().expect("query builds")
}

#[test]
fn gateway_allowed_connect_relays_echo_and_logs_bytes() {
    let mut net = Net::new(r#"{"allow_out": ["192.0.2.10:7"]}"#, Behavior::Echo);
    let s = net.connect(dst(SERVER, 7));
    assert!(net.run_until(200, |n| n.state(s) == State::Established));
    net.send(s, b"hello forkbox");
    assert!(net.run_until(200, |n| n.received(s).len() == 13));
    assert_eq!(net.received(s), b"hello forkbox");
    let req = &net.gw.connector_mut().requests[0];
    assert_eq!(
        (req.address, req.port, req.name.as_deref()),
        (SERVER, 7, None)
    );
    net.close(s);
    assert!(net.run_until(2_000, |n| n.gw.stats().connections == 0));
    let log = net.gw.take_log();
    assert_eq!(log.len(), 1);
    let r = &log[0];
    assert_eq!(
        (r.protocol, r.verdict, r.reason),
        (Protocol::Tcp, Verdict::Allow, LogReason::Rule)
    );
    assert_eq!(r.rule.as_deref(), Some("192.0.2.10/32:7"));
    assert_eq!((r.bytes_out, r.bytes_in), (13, 13));
    assert_eq!(r.address, Some(IpAddr::V4(SERVER)));
    assert_eq!(r.sandbox, "sb-test");
    assert!(r.duration_ms > 0);
    assert_eq!(net.gw.stats().sockets, 1, "only the DNS socket is left");
}

/// Sends `len` patterned bytes (`i * step % 251`) through an echo
/// connection and asserts they all come back in order; returns the network
/// for further checks.
fn echoed_whole(len: u32, step: u32) -> Net {
    let mut net = Net::new(r#"{"allow_out": ["*:7"]}"#, Behavior::Echo);
    let s = net.connect(dst(SERVER, 7));
    assert!(net.run_until(200, |n| n.state(s) == State::Established));
    let data: Vec<u8> = (0..len).map(|i| (i * step % 251) as u8).collect();
    let mut sent = 0;
    let ok = net.run_until(20_000, |n| {
        sent += n.send(s, &data[sent..]);
        n.received(s).len() == data.len()
    });
    assert!(ok, "received {} of {}", net.received(s).len(), data.len());
    assert_eq!(net.received(s), data);
    net
}

#[test]
fn gateway_large_transfer_both_ways_is_complete() {
    echoed_whole(300_000, 7);
}

#[test]
fn gateway_bulk_transfer_uses_frames_of_the_full_mtu_both_ways() {
    let net = echoed_whole(1_000_000, 13);
    // One ~64 KiB segment per frame, within the link's MTU: both stacks
    // took the MSS from it.
    let (out, back) = net.largest;
    assert!(out > 60_000 && out <= MAX_FRAME, "guest -> gateway {out}");
    assert!(
        back > 60_000 && back <= MAX_FRAME,
        "gateway -> guest {back}"
    );
    assert_eq!(MAX_FRAME, MTU + 14);
}

#[test]
fn gateway_frame_over_the_mtu_is_dropped() {
    let mut net = Net::new(r#"{"allow_out": ["*"]}"#, Behavior::Echo);
    let mut frame = arp_request(GATEWAY_IP);
    frame.resize(MAX_FRAME + 1, 0);
    net.gw.receive_frame(&frame, net.now());
    assert_eq!(net.gw.stats().frames_from_guest, 0);
    frame.truncate(MAX_FRAME);
    net.gw.receive_frame(&frame, net.now());
    assert_eq!(net.gw.stats().frames_from_guest, 1);
}

#[test]
fn gateway_denied_connect_gets_rst_at_once_and_is_logged() {
    let mut net = Net::new(r#"{"allow_out": ["other.example"]}"#, Behavior::Echo);
    let s = net.connect(dst(SERVER, 80));
    // No retransmission timer runs out: the RST comes in the first rounds.
    assert!(net.run_until(5, |n| n.state(s) == State::Closed));
    assert!(
        net.gw.connector_mut().requests.is_empty(),
        "a denied attempt is never opened"
    );
    let log = net.gw.take_log();
    assert_eq!(log.len(), 1);
    assert_eq!(
        (log[0].verdict, log[0].reason),
        (Verdict::Deny, LogReason::NoRule)
    );
    assert_eq!(log[0].port, 80);
    assert_eq!(net.gw.stats().sockets, 1);
}

#[test]
fn gateway_connector_refusal_gets_rst_and_logged_as_connect_failed() {
    let mut net = Net::new(r#"{"allow_out": ["*"]}"#, Behavior::Refuse);
    let s = net.connect(dst(SERVER, 443));
    assert!(net.run_until(5, |n| n.state(s) == State::Closed));
    let log = net.gw.take_log();
    assert_eq!(
        (log[0].verdict, log[0].reason),
        (Verdict::Allow, LogReason::ConnectFailed)
    );
    assert_eq!(log[0].error.as_deref(), Some("connection refused"));
}

#[test]
fn gateway_deferred_connect_completes_when_connector_answers() {
    let mut net = Net::new(r#"{"allow_out": ["*"]}"#, Behavior::Defer);
    let s = net.connect(dst(SERVER, 443));
    net.run_ms(20);
    assert_eq!(net.gw.stats().pending, 1);
    assert_eq!(
        net.state(s),
        State::SynSent,
        "the SYN is held, not answered"
    );
    let id = net.gw.connector_mut().requests[0].id;
    let stream = Box::new(EchoStream::default());
    let now = net.now();
    net.gw
        .connect_done(id, ConnectOutcome::Connected(stream), now);
    assert!(net.run_until(5, |n| n.state(s) == State::Established));
    assert_eq!(net.gw.stats().pending, 0);
    net.send(s, b"ping");
    assert!(net.run_until(200, |n| n.received(s) == b"ping"));
}

#[test]
fn gateway_connector_silence_times_out_with_rst() {
    let mut net = Net::new(r#"{"allow_out": ["*"]}"#, Behavior::Defer);
    let s = net.connect(dst(SERVER, 443));
    net.run_ms(10);
    let timeout = GatewayConfig::default().connect_timeout;
    let delay = net.gw.poll_delay(net.now()).expect("a deadline");
    assert!(delay <= timeout);
    net.advance(timeout);
    assert!(net.run_until(5, |n| n.state(s) == State::Closed));
    assert_eq!(net.gw.stats().pending, 0);
    let log = net.gw.take_log();
    assert_eq!(log[0].error.as_deref(), Some("connect timed out"));
}

#[test]
fn gateway_host_eof_closes_guest_side_after_data() {
    let mut net = Net::new(
        r#"{"allow_out": ["*"]}"#,
        Behavior::Greet(b"220 hello\r\n".to_vec()),
    );
    let s = net.connect(dst(SERVER, 25));
    assert!(net.run_until(500, |n| n.received(s) == b"220 hello\r\n"
        && matches!(n.state(s), State::CloseWait)));
    net.close(s);
    assert!(net.run_until(2_000, |n| n.gw.stats().connections == 0));
    assert_eq!(net.gw.take_log()[0].bytes_in, 11);
}

#[test]
fn gateway_dns_allowed_resolves_denied_nxdomain_and_logs() {
    let mut net = Net::new(r#"{"allow_out": ["a.example:443"]}"#, Behavior::Echo);
    net.gw
        .resolver_mut()
        .names
        .insert("a.example".into(), Ok(vec![Ipv4Addr::new(192, 0, 2, 20)]));
    let reply = net.dns(&dns_query(1, "a.example")).expect("answered");
    let p = Packet::parse(&reply).expect("reply parses");
    assert_eq!(p.rcode(), RCODE::NoError);
    let RData::A(a) = &p.answers[0].rdata else {
        panic!("want an A record, got {:?}", p.answers[0].rdata)
    };
    assert_eq!(Ipv4Addr::from(a.address), Ipv4Addr::new(192, 0, 2, 20));
    let reply = net.dns(&dns_query(2, "b.example")).expect("answered");
    assert_eq!(
        Packet::parse(&reply).expect("parses").rcode(),
        RCODE::NameError
    );
    let log = net.gw.take_log();
    assert_eq!(log.len(), 2);
    assert_eq!(
        (log[0].protocol, log[0].verdict),
        (Protocol::Dns, Verdict::Allow)
    );
    assert_eq!(
        log[0].answers,
        vec![IpAddr::V4(Ipv4Addr::new(192, 0, 2, 20))]
    );
    assert_eq!(
        (log[1].name.as_deref(), log[1].verdict),
        (Some("b.example"), Verdict::Deny)
    );
}

#[test]
fn gateway_name_rule_opens_only_addresses_it_answered() {
    let mut net = Net::new(r#"{"allow_out": ["a.example:443"]}"#, Behavior::Echo);
    net.gw
        .resolver_mut()
        .names
        .insert("a.example".into(), Ok(vec![Ipv4Addr::new(192, 0, 2, 20)]));
    net.dns(&dns_query(1, "a.example")).expect("answered");
    let ok = net.connect(dst(Ipv4Addr::new(192, 0, 2, 20), 443));
    let other = net.connect(dst(Ipv4Addr::new(192, 0, 2, 21), 443));
    assert!(net.run_until(200, |n| n.state(ok) == State::Established
        && n.state(other) == State::Closed));
    let req = &net.gw.connector_mut().requests[0];
    assert_eq!(req.name.as_deref(), Some("a.example"));
}

#[test]
fn gateway_name_resolving_to_private_address_is_denied_and_logged_why() {
    let mut net = Net::new(r#"{"allow_out": ["*"]}"#, Behavior::Echo);
    let private = Ipv4Addr::new(10, 1, 2, 3);
    net.gw
        .resolver_mut()
        .names
        .insert("a.example".into(), Ok(vec![private]));
    net.dns(&dns_query(1, "a.example")).expect("answered");
    let s = net.connect(dst(private, 443));
    assert!(net.run_until(5, |n| n.state(s) == State::Closed));
    assert!(
        net.gw.connector_mut().requests.is_empty(),
        "never asked of the host side"
    );
    let log = net.gw.take_log();
    let rec = log.last().expect("a record");
    assert_eq!(rec.name.as_deref(), Some("a.example"));
    assert_eq!(
        (rec.verdict, rec.reason, rec.rule.as_deref()),
        (Verdict::Deny, LogReason::InternalAddress, Some("*"))
    );
    let why = rec.error.as_deref().expect("explained");
    assert!(why.contains("10.0.0.0/8"), "{why}");
}

#[test]
fn gateway_broker_denial_is_logged_as_a_denial() {
    let mut net = Net::new(r#"{"allow_out": ["*"]}"#, Behavior::BrokerDeny);
    let s = net.connect(dst(SERVER, 443));
    assert!(net.run_until(5, |n| n.state(s) == State::Closed));
    let log = net.gw.take_log();
    assert_eq!(
        (log[0].verdict, log[0].reason),
        (Verdict::Deny, LogReason::BrokerDenied)
    );
    assert_eq!(log[0].error.as_deref(), Some("an address of this host"));
}

#[test]
fn gateway_single_label_name_gets_nxdomain_and_logged_why() {
    let mut net = Net::new(r#"{"allow_out": ["*"]}"#, Behavior::Echo);
    net.gw
        .resolver_mut()
        .names
        .insert("intranet".into(), Ok(vec![SERVER]));
    let reply = net.dns(&dns_query(1, "intranet")).expect("answered");
    let reply = Packet::parse(&reply).expect("parses");
    assert_eq!(reply.rcode(), RCODE::NameError);
    let log = net.gw.take_log();
    assert_eq!(
        (log[0].verdict, log[0].reason),
        (Verdict::Deny, LogReason::SingleLabelName)
    );
}

#[test]
fn gateway_host_internal_reaches_connector_only_when_allowed() {
    let mut net = Net::new(
        r#"{"allow_out": ["host.forkbox.internal:8080"]}"#,
        Behavior::Echo,
    );
    let reply = net
        .dns(&dns_query(1, "host.forkbox.internal"))
        .expect("answered");
    let p = Packet::parse(&reply).expect("parses");
    assert!(matches!(&p.answers[0].rdata, RData::A(a) if Ipv4Addr::from(a.address) == GATEWAY_IP));
    let ok = net.connect(dst(GATEWAY_IP, 8080));
    let no = net.connect(dst(GATEWAY_IP, 8081));
    assert!(net.run_until(200, |n| n.state(ok) == State::Established
        && n.state(no) == State::Closed));
    let reqs = &net.gw.connector_mut().requests;
    assert_eq!(reqs.len(), 1);
    assert_eq!(
        (reqs[0].name.as_deref(), reqs[0].address),
        (Some(HOST_INTERNAL), GATEWAY_IP)
    );
}

#[test]
fn gateway_guest_network_and_loopback_never_connect() {
    let mut net = Net::new(
        r#"{"allow_out": ["*", "10.0.0.0/8", "127.0.0.0/8"]}"#,
        Behavior::Echo,
    );
    // Raw SYNs: a real guest would not even route these to the gateway.
    for (i, to) in [Ipv4Addr::new(10, 0, 2, 3), Ipv4Addr::new(127, 0, 0, 1)]
        .into_iter()
        .enumerate()
    {
        let now = net.now();
        net.gw
            .receive_frame(&syn_frame(40_000 + i as u16, dst(to, 80)), now);
        net.gw.poll(now);
        let rst = net.gw.take_frame().expect("an RST");
        assert!(matches!(
            frames::classify(&rst),
            Some(frames::Inbound::Tcp { .. })
        ));
    }
    assert!(net.gw.connector_mut().requests.is_empty());
    let log = net.gw.take_log();
    assert!(
        log.iter().all(|r| r.reason == LogReason::SpecialAddress),
        "{log:?}"
    );
    assert_eq!(log.len(), 2);
}

#[test]
fn gateway_policy_change_applies_to_new_connections_only() {
    let mut net = Net::new(r#"{"allow_out": ["*:7"]}"#, Behavior::Echo);
    let old = net.connect(dst(SERVER, 7));
    assert!(net.run_until(200, |n| n.state(old) == State::Established));
    net.gw.set_policy(Policy::deny_all());
    let new = net.connect(dst(SERVER, 7));
    assert!(net.run_until(5, |n| n.state(new) == State::Closed));
    net.send(old, b"still here");
    assert!(net.run_until(200, |n| n.received(old) == b"still here"));
}

#[test]
fn gateway_udp_other_than_dns_is_dropped_and_logged() {
    let mut net = Net::new(r#"{"allow_out": ["*"]}"#, Behavior::Echo);
    net.udp_send(dst(SERVER, 123), b"ntp?");
    net.run_ms(5);
    let log = net.gw.take_log();
    assert_eq!(log.len(), 1);
    assert_eq!(
        (log[0].protocol, log[0].reason),
        (Protocol::Udp, LogReason::UdpNotAllowed)
    );
    assert_eq!(log[0].port, 123);
}

#[test]
fn gateway_arp_answered_only_for_gateway_address() {
    let mut net = Net::new("{}", Behavior::Echo);
    net.gw.receive_frame(
        &harness::arp_request(Ipv4Addr::new(10, 0, 2, 77)),
        net.now(),
    );
    net.gw
        .receive_frame(&harness::arp_request(GUEST_IP), net.now());
    net.gw.poll(net.now());
    assert!(
        net.gw.take_frame().is_none(),
        "no answer for other addresses"
    );
    net.gw
        .receive_frame(&harness::arp_request(GATEWAY_IP), net.now());
    net.gw.poll(net.now());
    assert!(net.gw.take_frame().is_some());
}

#[test]
fn gateway_reset_all_resets_guest_connections() {
    let mut net = Net::new(r#"{"allow_out": ["*"]}"#, Behavior::Echo);
    let s = net.connect(dst(SERVER, 7));
    assert!(net.run_until(200, |n| n.state(s) == State::Established));
    let now = net.now();
    net.gw.reset_all("fork", now);
    assert!(net.run_until(5, |n| n.state(s) == State::Closed));
    let stats = net.gw.stats();
    assert_eq!((stats.connections, stats.pending, stats.sockets), (0, 0, 1));
    assert_eq!(net.gw.take_log()[0].error.as_deref(), Some("fork"));
}

#[test]
fn gateway_inbound_connection_reaches_guest_listener_unlogged() {
    let mut net = Net::new("{}", Behavior::Echo);
    let l = net.listen(8888);
    let stream = Box::new(harness::Greeter::new(b"GET / HTTP/1.0\r\n\r\n"));
    let now = net.now();
    net.gw.connect_inbound(8888, stream, now).expect("starts");
    assert!(net.run_until(200, |n| n.received(l) == b"GET / HTTP/1.0\r\n\r\n"));
    net.send(l, b"HTTP/1.0 200 OK\r\n\r\n");
    net.close(l);
    assert!(net.run_until(2_000, |n| n.gw.stats().connections == 0));
    assert!(net.gw.take_log().is_empty(), "inbound is not egress");
}

#[test]
fn gateway_inbound_to_closed_port_ends_and_frees() {
    let mut net = Net::new("{}", Behavior::Echo);
    let now = net.now();
    net.gw
        .connect_inbound(9999, Box::new(EchoStream::default()), now)
        .expect("starts");
    assert_eq!(net.gw.stats().connections, 1);
    assert!(net.run_until(50, |n| n.gw.stats().connections == 0));
    assert_eq!(
        net.gw
            .connect_inbound(0, Box::new(EchoStream::default()), now),
        Err(InboundError::BadPort)
    );
}

#[test]
fn gateway_syn_flood_pending_is_capped() {
    let mut net = Net::new(r#"{"allow_out": ["*"]}"#, Behavior::Defer);
    let max_pending = GatewayConfig::default().max_pending;
    for port in 0..5_000u16 {
        let now = net.now();
        net.gw
            .receive_frame(&syn_frame(10_000 + port, dst(SERVER, 443)), now);
        net.gw.poll(now);
        let stats = net.gw.stats();
        assert!(stats.pending <= max_pending);
        assert!(stats.frames_to_guest <= GatewayConfig::default().max_queued_frames);
        assert!(stats.log_records <= GatewayConfig::default().log_capacity);
    }
    let stats = net.gw.stats();
    assert_eq!((stats.pending, stats.sockets), (max_pending, 1));
    let refused = net.gw.take_log();
    assert!(refused.iter().all(|r| r.reason == LogReason::Limit));
    assert_eq!(
        refused.len() as u64 + net.gw.log_dropped(),
        5_000 - max_pending as u64
    );
}

#[test]
fn gateway_syn_flood_open_connections_are_capped() {
    let mut net = Net::new(r#"{"allow_out": ["*"]}"#, Behavior::Echo);
    let max = GatewayConfig::default().max_connections;
    for port in 0..2_000u16 {
        let now = net.now();
        net.gw
            .receive_frame(&syn_frame(10_000 + port, dst(SERVER, 443)), now);
        net.gw.poll(now);
        while net.gw.take_frame().is_some() {}
    }
    let stats = net.gw.stats();
    assert_eq!(stats.connections, max);
    assert_eq!(stats.sockets, max + 1);
    // Half-open connections the guest never completes time out.
    net.advance(GatewayConfig::default().tcp_timeout * 2);
    for _ in 0..3 {
        net.advance(Duration::from_secs(5));
        let now = net.now();
        net.gw.poll(now);
        while net.gw.take_frame().is_some() {}
    }
    assert_eq!(net.gw.stats().connections, 0);
}

#[test]
fn gateway_random_frames_never_panic() {
    let mut net = Net::new(r#"{"allow_out": ["*"]}"#, Behavior::Echo);
    let mut rng = fastrand::Rng::with_seed(0xf00d);
    let seeds = [
        syn_frame(40_000, dst(SERVER, 80)),
        harness::arp_request(GATEWAY_IP),
        harness::udp_frame(40_001, dst(GATEWAY_IP, 53), &dns_query(3, "a.example")),
    ];
    for i in 0..20_000 {
        let frame: Vec<u8> = if i % 3 == 0 {
            (0..rng.usize(0..1600)).map(|_| rng.u8(..)).collect()
        } else {
            let mut f = seeds[rng.usize(..seeds.len())].clone();
            for _ in 0..rng.usize(0..4) {
                let at = rng.usize(..f.len());
                f[at] = rng.u8(..);
            }
            f
        };
        let now = net.now();
        net.gw.receive_frame(&frame, now);
        net.gw.poll(now);
        while net.gw.take_frame().is_some() {}
        net.advance(Duration::from_millis(1));
    }
    assert!(net.gw.stats().connections <= GatewayConfig::default().max_connections);
}
