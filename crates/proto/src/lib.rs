//! forkbox-proto: the wire protocol between the host and the guest agent,
//! and a blocking host-side client.
//!
//! Owns: framing, message types, protocol version, and the client. Must
//! not depend on any other forkbox crate (the agent and the CLI both
//! depend on it). No unsafe code.
//!
//! Module map:
//! - [`frame`]: sans-IO framing codec (`u8 kind | u32 LE length | body`),
//!   bounded by [`MAX_FRAME_LEN`], plus blocking read/write helpers.
//! - [`msg`]: JSON control messages: [`Hello`], [`Request`], [`Response`],
//!   exec and file types, typed [`AgentError`]s.
//! - [`client`]: [`AgentClient`], one connection per request, over a direct
//!   unix socket or the VMM's hybrid vsock socket.
#![forbid(unsafe_code)]

pub mod client;
pub mod frame;
pub mod msg;

pub use client::{AgentClient, ClientError};
pub use frame::{Frame, FrameError, FrameKind, MAX_FRAME_LEN};
pub use msg::*;

/// An error and its causes on one line, `: `-joined.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// Version of this protocol; bumped on any incompatible change.
/// 2: `AfterFork` (the host requires it of every fork child).
/// 3: `ConnectPort` (raw relay to a guest port) and background processes
/// (`Spawn`, `ListProcesses`, `WaitProcess`, `KillProcess`,
/// `ProcessStdin`, `AttachProcess`); `ErrorKind::ConnectionRefused`.
/// 4: `AsUser` (file requests with a user's rights), `AfterFork`'s seed,
/// `Protect` and `Digest` (protected paths).
pub const PROTOCOL_VERSION: u32 = 4;

/// The vsock port the agent listens on.
pub const AGENT_PORT: u32 = 1024;

/// Data frames carry at most this many bytes (a quarter of the frame limit
/// keeps memory per stream small while amortising syscalls).
pub const DATA_CHUNK: usize = 256 * 1024;

/// Serialises a control message into a frame body.
pub fn encode_control<T: serde::Serialize>(msg: &T) -> Vec<u8> {
    // Our message types have only string map keys and no fallible
    // `Serialize` impls, so serialisation cannot fail.
    serde_json::to_vec(msg).expect("control messages always serialise")
}

/// Parses a control frame body.
pub fn decode_control<T: serde::de::DeserializeOwned>(body: &[u8]) -> serde_json::Result<T> {
    serde_json::from_slice(body)
}
