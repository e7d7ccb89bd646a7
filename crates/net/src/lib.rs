//! The sandbox network, sans-IO.
//!
//! Owns: what a sandbox's guest may reach and the record of what it tried.
//! Bytes and decisions in, bytes and events out; no sockets of its own, no
//! clocks, no threads here, so every piece is unit-tested and fuzzable
//! without a VM. The one piece of I/O is [`broker::link`]: a message and its
//! fd across a socket the caller owns, written once for both ends.
//!
//! Module map:
//! - [`policy`]: egress rules (`allow_out` / `deny_out`: names, `*.suffix`,
//!   CIDRs, ports), parsed from the SDK's JSON, and the decision function.
//! - [`dns`]: the guest's DNS server: allowed names resolve (through a
//!   [`dns::Resolver`]), others get NXDOMAIN.
//! - [`log`]: the egress record (JSON line), a bounded ring, a writer.
//! - [`gateway`]: the VMM-side userspace TCP/IP endpoint (smoltcp) behind
//!   the guest's virtio-net: ARP, DNS through [`dns`], and each allowed TCP
//!   connection relayed to a host stream a [`gateway::Connector`] opens.
//! - [`broker`]: the messages between a VMM and the broker that resolves
//!   names and opens connections for it, and the broker's own decision.
//!   - [`broker::link`]: one message with its `SCM_RIGHTS` fd sent or
//!     received on a `SOCK_SEQPACKET` socket (safe `rustix` calls).
//!
//! Must not depend on KVM, the VMM or the daemon: the VMM feeds this crate
//! frames from its virtio-net device and the daemon feeds it policies.

#![forbid(unsafe_code)]

pub mod broker;
pub mod dns;
pub mod gateway;
pub mod log;
pub mod policy;
