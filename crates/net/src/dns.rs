//! The guest's DNS server: one UDP payload in, at most one payload out.
//!
//! The guest's resolver points at the gateway; every name it looks up is
//! decided here against the sandbox's [`Policy`]:
//! - a name the policy does not allow gets NXDOMAIN, so a denied host does
//!   not even learn an address;
//! - [`HOST_INTERNAL`], when allowed, is the gateway address (the gateway
//!   relays connections to it to the host's loopback);
//! - any other allowed name is resolved by a [`Resolver`] (in forkbox, the
//!   daemon: the VMM has no network of its own) to A records. Queries for
//!   other types of an allowed name get an empty answer (NODATA): the guest
//!   network is IPv4 only, and an empty AAAA answer makes resolvers fall
//!   back at once instead of waiting.
//!
//! Guest bytes are hostile: anything shorter than a header, or a response,
//! is dropped; anything else that does not parse gets FORMERR. Nothing here
//! panics on any input (see the seeded random-input test).
//!
//! The wire format is `simple-dns`; it bounds name length and only follows
//! compression pointers backwards, so a crafted loop cannot spin.

use std::net::Ipv4Addr;

use simple_dns::rdata::{RData, A};
use simple_dns::{
    Packet, PacketFlag, Question, ResourceRecord, CLASS, OPCODE, QCLASS, QTYPE, RCODE, TYPE,
};

use crate::policy::{Decision, Policy, HOST_INTERNAL};

/// DNS header length: id, flags, four counts.
const HEADER_LEN: usize = 12;
/// Most A records put in one answer; keeps every reply far below 512 bytes.
pub const MAX_ANSWERS: usize = 8;
/// TTL of every answer. Short, because the policy can change at runtime
/// (open during setup, locked before the policy model acts) and a cached
/// answer should not outlive it by much. Connections are checked again
/// anyway.
pub const ANSWER_TTL_SECS: u32 = 30;

/// Why a name could not be resolved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResolveError {
    /// The name does not exist (answered NXDOMAIN).
    #[error("no such name")]
    NotFound,
    /// The resolver failed (answered SERVFAIL).
    #[error("resolver failed: {0}")]
    Failed(String),
}

/// Resolves allowed names to IPv4 addresses. Only ever called for names the
/// policy allows, never for [`HOST_INTERNAL`].
pub trait Resolver {
    fn resolve_v4(&mut self, name: &str) -> Result<Vec<Ipv4Addr>, ResolveError>;
}

/// What was asked, for the egress log and for the gateway's map from
/// answered addresses back to names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueryRecord {
    /// The name as asked (lower case, no trailing dot); names that are not
    /// valid host names are shown with non-printable bytes escaped.
    pub name: String,
    /// The question's type code (1 = A, 28 = AAAA, ...).
    pub qtype: u16,
    pub decision: Decision,
    /// The addresses answered (empty for NXDOMAIN, NODATA, failures).
    pub answers: Vec<Ipv4Addr>,
}

/// The result of one query.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DnsOutcome {
    /// The payload to send back, if any.
    pub reply: Option<Vec<u8>>,
    /// The question, if the query got as far as naming one.
    pub query: Option<QueryRecord>,
}

/// Answer one query from the guest. `gateway` is the address
/// [`HOST_INTERNAL`] resolves to.
pub fn answer(
    query: &[u8],
    policy: &Policy,
    gateway: Ipv4Addr,
    resolver: &mut dyn Resolver,
) -> DnsOutcome {
    let Some(head) = query.get(..HEADER_LEN) else {
        return DnsOutcome::default();
    };
    let id = u16::from_be_bytes([head[0], head[1]]);
    let flags = u16::from_be_bytes([head[2], head[3]]);
    if flags & 0x8000 != 0 {
        // A response: answering it could start a loop.
        return DnsOutcome::default();
    }
    let error = |rcode: RCODE| DnsOutcome {
        reply: Some(bare_reply(id, flags, rcode)),
        query: None,
    };
    let Ok(packet) = Packet::parse(query) else {
        return error(RCODE::FormatError);
    };
    if packet.opcode() != OPCODE::StandardQuery {
        return error(RCODE::NotImplemented);
    }
    let [question] = packet.questions.as_slice() else {
        return error(RCODE::FormatError);
    };
    if !matches!(question.qclass, QCLASS::CLASS(CLASS::IN) | QCLASS::ANY) {
        return error(RCODE::NotImplemented);
    }
    let name = name_text(question);
    let decision = policy.decide_name(&name);
    let mut record = QueryRecord {
        name,
        qtype: u16::from(question.qtype),
        decision,
        answers: Vec::new(),
    };
    let rcode = if !record.decision.is_allowed() {
        RCODE::NameError
    } else {
        let resolved = if record.name == HOST_INTERNAL {
            Ok(vec![gateway])
        } else {
            resolver.resolve_v4(&record.name)
        };
        match resolved {
            Ok(mut addrs) => {
                addrs.truncate(MAX_ANSWERS);
                if is_a_query(question.qtype) {
                    record.answers = addrs;
                }
                RCODE::NoError
            }
            Err(ResolveError::NotFound) => RCODE::NameError,
            Err(ResolveError::Failed(_)) => RCODE::ServerFailure,
        }
    };
    let reply = build_reply(id, &packet, question, rcode, &record.answers)
        .unwrap_or_else(|| bare_reply(id, flags, RCODE::ServerFailure));
    DnsOutcome {
        reply: Some(reply),
        query: Some(record),
    }
}

fn is_a_query(qtype: QTYPE) -> bool {
    matches!(qtype, QTYPE::TYPE(TYPE::A) | QTYPE::ANY)
}

/// The question's name as text: labels joined by dots, lower case. A label
/// holding a dot or a byte outside printable ASCII is escaped so the text
/// can never pass for a different, allowed name.
fn name_text(q: &Question<'_>) -> String {
    let mut out = String::new();
    for (i, label) in q.qname.as_bytes().enumerate() {
        if i > 0 {
            out.push('.');
        }
        for &b in label {
            match b {
                b'.' | b'\\' => {
                    out.push('\\');
                    out.push(char::from(b));
                }
                0x21..=0x7e => out.push(char::from(b.to_ascii_lowercase())),
                _ => out.push_str(&format!("\\{b:03}")),
            }
        }
    }
    out
}

fn build_reply(
    id: u16,
    query: &Packet<'_>,
    question: &Question<'_>,
    rcode: RCODE,
    answers: &[Ipv4Addr],
) -> Option<Vec<u8>> {
    let mut reply = Packet::new_reply(id);
    if query.has_flags(PacketFlag::RECURSION_DESIRED) {
        reply.set_flags(PacketFlag::RECURSION_DESIRED);
    }
    reply.set_flags(PacketFlag::RECURSION_AVAILABLE);
    *reply.rcode_mut() = rcode;
    reply.questions.push(question.clone());
    for addr in answers {
        reply.answers.push(ResourceRecord::new(
            question.qname.clone(),
            CLASS::IN,
            ANSWER_TTL_SECS,
            RData::A(A {
                address: u32::from(*addr),
            }),
        ));
    }
    reply.build_bytes_vec_compressed().ok()
}

/// A reply of just a header, for queries we cannot or will not echo: the
/// query's id, opcode and RD bit, QR set, no sections.
fn bare_reply(id: u16, query_flags: u16, rcode: RCODE) -> Vec<u8> {
    const QR: u16 = 0x8000;
    const OPCODE_MASK: u16 = 0x7800;
    const RD: u16 = 0x0100;
    const RA: u16 = 0x0080;
    let flags = QR | (query_flags & (OPCODE_MASK | RD)) | RA | (rcode as u16 & 0x000f);
    let mut out = vec![0; HEADER_LEN];
    out[..2].copy_from_slice(&id.to_be_bytes());
    out[2..4].copy_from_slice(&flags.to_be_bytes());
    out
}

#[cfg(test)]
mod tests;
