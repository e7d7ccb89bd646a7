//! The guest's DNS server answering one UDP payload.
//!
//! Input: a byte choosing the policy, then the query's bytes.
//!
//! What must hold: nothing shorter than a header and no response gets an
//! answer; every reply parses, carries the query's id with QR set and is
//! at most 512 bytes (no EDNS: a bigger one would be truncated on the
//! guest's side); a name the policy denies is answered NXDOMAIN with no
//! address, and the addresses a reply carries are the ones recorded for
//! the egress log, at most `MAX_ANSWERS`.

use std::net::Ipv4Addr;

use forkbox_net::dns::{answer, MAX_ANSWERS};
use forkbox_net::gateway::GATEWAY_IP;
use forkbox_net::policy::{Policy, HOST_INTERNAL};
use simple_dns::rdata::RData;
use simple_dns::{Packet, RCODE};

use crate::gateway::{Table, POLICIES};
use crate::input::Input;

pub fn dns_query(data: &[u8]) {
    let mut input = Input::new(data);
    let choice = usize::from(input.u8()) % POLICIES.len();
    let policy = Policy::from_json(POLICIES[choice]).expect("fuzz policy");
    let query = input.rest();
    let out = answer(query, &policy, GATEWAY_IP, &mut Table::new());
    let is_response = query.get(2).is_some_and(|f| f & 0x80 != 0);
    let Some(reply) = out.reply else {
        assert!(query.len() < 12 || is_response, "a query without a reply");
        assert!(out.query.is_none());
        return;
    };
    assert!(query.len() >= 12 && !is_response, "answered a response");
    assert!(reply.len() <= 512, "a reply of {} bytes", reply.len());
    assert_eq!(reply[..2], query[..2], "reply id");
    assert!(reply[2] & 0x80 != 0, "reply without QR");
    let parsed = Packet::parse(&reply).expect("our reply parses");
    let addrs: Vec<Ipv4Addr> = parsed
        .answers
        .iter()
        .filter_map(|rr| match &rr.rdata {
            RData::A(a) => Some(Ipv4Addr::from(a.address)),
            _ => None,
        })
        .collect();
    assert_eq!(addrs.len(), parsed.answers.len(), "only A records");
    match out.query {
        Some(record) => {
            assert_eq!(addrs, record.answers, "the log shows what was answered");
            assert!(record.answers.len() <= MAX_ANSWERS);
            if !record.decision.is_allowed() {
                assert!(record.answers.is_empty(), "addresses for a denied name");
                assert_eq!(parsed.rcode(), RCODE::NameError);
            }
            assert_eq!(record.decision, policy.decide_name(&record.name));
            if record.name == HOST_INTERNAL && !record.answers.is_empty() {
                assert_eq!(record.answers, vec![GATEWAY_IP]);
            }
        }
        None => assert!(addrs.is_empty(), "addresses for no question"),
    }
}
