//! The bodies of forkbox's fuzz targets: one plain function per parser a
//! guest or a client feeds, bytes in, a panic on a broken promise.
//!
//! Owns: how fuzz input becomes each parser's input (guest memory and
//! queues, frames, packets, JSON) and what must hold beyond "no panic"
//! (checked with `assert!`, so libFuzzer reports a broken one as a crash).
//! Must not depend on libFuzzer or nightly: `fuzz/fuzz_targets/*.rs` wrap
//! these for `cargo fuzz`, and `tests/corpus.rs` replays the committed
//! corpus (`fuzz/corpus/<target>/`) through them on stable Rust.
//!
//! Module map (target: the parser it feeds):
//! - [`virtio_chain`]: `forkbox_devices::virtio::chain::Chain::walk` over
//!   guest memory (two regions with a hole) the input fills.
//! - [`virtio_blk`]: the virtio-blk device serving the requests of a queue
//!   the input lays out in guest memory.
//! - [`virtio_mmio`]: the virtio-mmio transport (of a virtio-blk device)
//!   driven by register reads and writes at any offset and width, kicks,
//!   and a save and restore midway.
//! - [`vsock_packets`]: the virtio-vsock device with a host client, driven
//!   by guest packets and host actions the input lists.
//! - [`gateway_frames`]: the sandbox network's gateway fed the guest's
//!   Ethernet frames (checksums optionally fixed up).
//! - [`dns_query`]: the guest's DNS server.
//! - [`agent_frames`]: the agent protocol's framing and control messages,
//!   both directions, sans-IO.
//! - [`agent_client`]: the host's `AgentClient` reading what a hostile
//!   agent sends on a real unix socket.
//! - [`policy_rules`]: egress rules and policies.
//! - [`broker_requests`]: the network broker's parsing and planning of
//!   what a VMM asks it.
//! - [`template_spec`]: forkboxd's template specs (`POST /templates`).
//! - [`template_file`]: the CLI's TOML template files, and the JSON they
//!   become for forkboxd.
//! - [`virtio_net`]: the virtio-net device serving rx and tx queues the
//!   input lays out, with frames for the guest, forks and resets.
//! - [`tar_unpack`]: the CLI's unpacking of a tar archive from a guest
//!   (`forkbox cp SANDBOX:/DIR LOCAL`), into a real directory.

mod agent;
mod blk;
mod broker;
mod chain;
mod dns;
mod gateway;
mod input;
mod mmio;
mod net;
mod policy;
mod ring;
mod template;
mod template_file;
mod unpack;
mod vsock;

pub use agent::{agent_client, agent_frames};
pub use blk::virtio_blk;
pub use broker::broker_requests;
pub use chain::virtio_chain;
pub use dns::dns_query;
pub use gateway::{fix_checksums, gateway_frames};
pub use mmio::virtio_mmio;
pub use net::virtio_net;
pub use policy::policy_rules;
pub use template::template_spec;
pub use template_file::template_file;
pub use unpack::tar_unpack;
pub use vsock::vsock_packets;

/// A fuzz target's body.
pub type Target = fn(&[u8]);

/// Every target by its name, the name of its `cargo fuzz` binary and of
/// its corpus directory.
pub const TARGETS: &[(&str, Target)] = &[
    ("virtio_chain", virtio_chain),
    ("virtio_blk", virtio_blk),
    ("virtio_mmio", virtio_mmio),
    ("vsock_packets", vsock_packets),
    ("gateway_frames", gateway_frames),
    ("dns_query", dns_query),
    ("agent_frames", agent_frames),
    ("agent_client", agent_client),
    ("policy_rules", policy_rules),
    ("broker_requests", broker_requests),
    ("template_spec", template_spec),
    ("template_file", template_file),
    ("virtio_net", virtio_net),
    ("tar_unpack", tar_unpack),
];
