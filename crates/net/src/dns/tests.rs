use std::collections::HashMap;
use std::net::Ipv4Addr;

use simple_dns::rdata::RData;
use simple_dns::{Name, Packet, PacketFlag, Question, CLASS, QCLASS, QTYPE, RCODE, TYPE};

use super::*;
use crate::policy::{Policy, Reason, Verdict};

const GATEWAY: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 2);

/// A resolver over a fixed table that counts its calls.
#[derive(Default)]
struct Table {
    names: HashMap<String, Result<Vec<Ipv4Addr>, ResolveError>>,
    calls: Vec<String>,
}

impl Table {
    fn with(mut self, name: &str, answer: Result<Vec<Ipv4Addr>, ResolveError>) -> Self {
        self.names.insert(name.to_owned(), answer);
        self
    }
}

impl Resolver for Table {
    fn resolve_v4(&mut self, name: &str) -> Result<Vec<Ipv4Addr>, ResolveError> {
        self.calls.push(name.to_owned());
        self.names
            .get(name)
            .cloned()
            .unwrap_or(Err(ResolveError::NotFound))
    }
}

fn policy(json: &str) -> Policy {
    Policy::from_json(json).expect("test policy parses")
}

fn query(id: u16, name: &str, qtype: TYPE) -> Vec<u8> {
    let mut p = Packet::new_query(id);
    p.set_flags(PacketFlag::RECURSION_DESIRED);
    p.questions.push(Question::new(
        Name::new_unchecked(name),
        QTYPE::TYPE(qtype),
        QCLASS::CLASS(CLASS::IN),
        false,
    ));
    p.build_bytes_vec().expect("test query builds")
}

fn ask(p: &Policy, r: &mut Table, bytes: &[u8]) -> DnsOutcome {
    answer(bytes, p, GATEWAY, r)
}

fn a_records(reply: &[u8]) -> Vec<Ipv4Addr> {
    let p = Packet::parse(reply).expect("reply parses");
    p.answers
        .iter()
        .filter_map(|rr| match &rr.rdata {
            RData::A(a) => Some(Ipv4Addr::from(a.address)),
            _ => None,
        })
        .collect()
}

fn rcode(reply: &[u8]) -> RCODE {
    Packet::parse(reply).expect("reply parses").rcode()
}

#[test]
fn dns_allowed_name_resolves_to_a_records() {
    let p = policy(r#"{"allow_out": ["*.debian.org"]}"#);
    let addrs = vec![Ipv4Addr::new(192, 0, 2, 10), Ipv4Addr::new(192, 0, 2, 11)];
    let mut r = Table::default().with("deb.debian.org", Ok(addrs.clone()));
    let out = ask(&p, &mut r, &query(0x1234, "Deb.Debian.org", TYPE::A));
    let reply = out.reply.expect("answered");
    let parsed = Packet::parse(&reply).expect("reply parses");
    assert_eq!(parsed.id(), 0x1234);
    assert!(parsed.has_flags(PacketFlag::RESPONSE));
    assert!(parsed.has_flags(PacketFlag::RECURSION_DESIRED));
    assert_eq!(parsed.rcode(), RCODE::NoError);
    assert_eq!(parsed.questions.len(), 1);
    assert_eq!(parsed.answers[0].ttl, ANSWER_TTL_SECS);
    assert_eq!(a_records(&reply), addrs);
    assert_eq!(r.calls, vec!["deb.debian.org"]);
    let rec = out.query.expect("recorded");
    assert_eq!(rec.name, "deb.debian.org");
    assert_eq!(rec.qtype, 1);
    assert_eq!(
        rec.decision.reason,
        Reason::AllowRule("*.debian.org".into())
    );
    assert_eq!(rec.answers, addrs);
}

#[test]
fn dns_denied_name_gets_nxdomain_without_resolving() {
    let p = policy(r#"{"allow_out": ["*.debian.org"], "deny_out": ["evil.debian.org"]}"#);
    let mut r = Table::default().with("example.org", Ok(vec![Ipv4Addr::new(192, 0, 2, 1)]));
    for name in ["example.org", "debian.org", "evil.debian.org"] {
        let out = ask(&p, &mut r, &query(7, name, TYPE::A));
        let reply = out.reply.expect("answered");
        assert_eq!(rcode(&reply), RCODE::NameError, "{name}");
        assert!(a_records(&reply).is_empty());
        let rec = out.query.expect("recorded");
        assert_eq!(rec.decision.verdict, Verdict::Deny);
    }
    assert!(
        r.calls.is_empty(),
        "a denied name never reaches the resolver"
    );
}

#[test]
fn dns_host_internal_resolves_to_gateway_when_allowed() {
    let mut r = Table::default();
    let open = policy(r#"{"allow_out": ["host.forkbox.internal:8080"]}"#);
    let out = ask(&open, &mut r, &query(1, "host.forkbox.internal", TYPE::A));
    assert_eq!(a_records(&out.reply.expect("answered")), vec![GATEWAY]);
    let closed = policy(r#"{"allow_out": ["*"]}"#);
    let out = ask(&closed, &mut r, &query(2, "host.forkbox.internal", TYPE::A));
    assert_eq!(rcode(&out.reply.expect("answered")), RCODE::NameError);
    assert!(
        r.calls.is_empty(),
        "the host alias is never sent to the resolver"
    );
}

#[test]
fn dns_aaaa_for_allowed_name_is_empty_noerror() {
    let p = policy(r#"{"allow_out": ["a.example"]}"#);
    let mut r = Table::default().with("a.example", Ok(vec![Ipv4Addr::new(192, 0, 2, 1)]));
    let out = ask(&p, &mut r, &query(3, "a.example", TYPE::AAAA));
    let reply = out.reply.expect("answered");
    assert_eq!(rcode(&reply), RCODE::NoError);
    assert!(Packet::parse(&reply).expect("parses").answers.is_empty());
    assert!(out.query.expect("recorded").answers.is_empty());
}

#[test]
fn dns_resolver_errors_map_to_nxdomain_and_servfail() {
    let p = policy(r#"{"allow_out": ["*.example"]}"#);
    let mut r = Table::default().with("down.example", Err(ResolveError::Failed("timeout".into())));
    let nx = ask(&p, &mut r, &query(4, "gone.example", TYPE::A));
    assert_eq!(rcode(&nx.reply.expect("answered")), RCODE::NameError);
    let sf = ask(&p, &mut r, &query(5, "down.example", TYPE::A));
    assert_eq!(rcode(&sf.reply.expect("answered")), RCODE::ServerFailure);
}

#[test]
fn dns_answers_capped() {
    let p = policy(r#"{"allow_out": ["many.example"]}"#);
    let addrs: Vec<Ipv4Addr> = (0..50).map(|i| Ipv4Addr::new(192, 0, 2, i)).collect();
    let mut r = Table::default().with("many.example", Ok(addrs));
    let reply = ask(&p, &mut r, &query(6, "many.example", TYPE::A))
        .reply
        .expect("answered");
    assert_eq!(a_records(&reply).len(), MAX_ANSWERS);
    assert!(reply.len() <= 512);
}

#[test]
fn dns_short_input_and_responses_are_dropped() {
    let p = policy(r#"{"allow_out": ["*"]}"#);
    let mut r = Table::default();
    for len in 0..HEADER_LEN {
        assert_eq!(ask(&p, &mut r, &vec![0; len]), DnsOutcome::default());
    }
    let mut resp = query(9, "a.example", TYPE::A);
    resp[2] |= 0x80;
    assert_eq!(ask(&p, &mut r, &resp), DnsOutcome::default());
}

#[test]
fn dns_malformed_query_gets_formerr_with_its_id() {
    let p = policy(r#"{"allow_out": ["*"]}"#);
    let mut r = Table::default();
    let mut q = query(0xbeef, "a.example", TYPE::A);
    q.truncate(q.len() - 3);
    let reply = ask(&p, &mut r, &q).reply.expect("answered");
    assert_eq!(reply.len(), HEADER_LEN);
    assert_eq!(&reply[..2], &[0xbe, 0xef]);
    assert_eq!(reply[2] & 0x80, 0x80, "QR set");
    assert_eq!(reply[3] & 0x0f, 1, "FORMERR");
    // Two questions: FORMERR too.
    let mut two = Packet::new_query(5);
    for n in ["a.example", "b.example"] {
        two.questions.push(Question::new(
            Name::new_unchecked(n),
            QTYPE::TYPE(TYPE::A),
            QCLASS::CLASS(CLASS::IN),
            false,
        ));
    }
    let bytes = two.build_bytes_vec().expect("builds");
    assert_eq!(
        rcode(&ask(&p, &mut r, &bytes).reply.expect("answered")),
        RCODE::FormatError
    );
}

#[test]
fn dns_compression_pointer_loop_is_formerr() {
    let p = policy(r#"{"allow_out": ["*"]}"#);
    let mut r = Table::default();
    // Header with one question whose name is a pointer to itself (offset 12).
    let mut q = vec![0, 1, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0];
    q.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1]);
    let reply = ask(&p, &mut r, &q).reply.expect("answered");
    assert_eq!(reply[3] & 0x0f, 1);
}

#[test]
fn dns_other_opcode_and_class_not_implemented() {
    let p = policy(r#"{"allow_out": ["*"]}"#);
    let mut r = Table::default();
    let mut status = query(1, "a.example", TYPE::A);
    status[2] |= 2 << 3; // opcode STATUS
    assert_eq!(
        ask(&p, &mut r, &status).reply.expect("answered")[3] & 0x0f,
        4
    );
    let mut chaos = query(2, "version.bind", TYPE::A);
    let n = chaos.len();
    chaos[n - 1] = 3; // class CH
    assert_eq!(
        ask(&p, &mut r, &chaos).reply.expect("answered")[3] & 0x0f,
        4
    );
    assert!(r.calls.is_empty());
}

#[test]
fn dns_label_with_dot_cannot_pose_as_allowed_name() {
    let p = policy(r#"{"allow_out": ["a.example"]}"#);
    let mut r = Table::default().with("a.example", Ok(vec![Ipv4Addr::new(192, 0, 2, 1)]));
    // One label "a.example" (with a dot inside it), not two labels.
    let mut q = vec![0, 1, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 9];
    q.extend_from_slice(b"a.example");
    q.extend_from_slice(&[0, 0, 1, 0, 1]);
    let out = ask(&p, &mut r, &q);
    assert_eq!(rcode(&out.reply.expect("answered")), RCODE::NameError);
    assert_eq!(out.query.expect("recorded").name, "a\\.example");
    assert!(r.calls.is_empty());
}

#[test]
fn dns_random_and_mutated_input_never_panics() {
    let p = policy(r#"{"allow_out": ["*"], "deny_out": ["x.example"]}"#);
    let mut r = Table::default().with("a.example", Ok(vec![Ipv4Addr::new(192, 0, 2, 1)]));
    let mut rng = fastrand::Rng::with_seed(0x5eed_d115);
    let seeds = [
        query(1, "a.example", TYPE::A),
        query(2, "x.example", TYPE::AAAA),
        query(3, "host.forkbox.internal", TYPE::A),
    ];
    for i in 0..20_000 {
        let bytes: Vec<u8> = if i % 2 == 0 {
            let len = rng.usize(0..600);
            (0..len).map(|_| rng.u8(..)).collect()
        } else {
            let mut b = seeds[rng.usize(..seeds.len())].clone();
            for _ in 0..rng.usize(1..6) {
                let at = rng.usize(..b.len());
                b[at] = rng.u8(..);
            }
            if rng.bool() {
                b.truncate(rng.usize(..=b.len()));
            }
            b
        };
        let out = ask(&p, &mut r, &bytes);
        if let Some(reply) = out.reply {
            assert!(reply.len() >= HEADER_LEN);
            assert_eq!(reply[..2], bytes[..2], "reply carries the query id");
            assert_eq!(reply[2] & 0x80, 0x80, "reply is a response");
            assert!(reply.len() <= 1024);
        }
    }
}
