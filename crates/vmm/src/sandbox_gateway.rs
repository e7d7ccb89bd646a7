//! `forkbox-vmm gateway`: the network of a sandbox that is not a microVM
//! (a gVisor sandbox): the same [`GatewayBackend`] a VMM runs behind its
//! guest's virtio-net, fed with the Ethernet frames the sandbox's agent
//! serves on a `SOCK_SEQPACKET` socket (one frame per message; the
//! agent's `container_net`).
//!
//! The sandbox's side of that socket closes around each checkpoint (its
//! agent quiesces); the gateway keeps its state and connects again, so
//! the sandbox that was checkpointed keeps its connections. A fork child
//! gets a gateway of its own, new like a microVM child's.
//!
//! What the sandbox sends is as hostile as a guest's frames: the gateway
//! parses them (smoltcp), decides with the sandbox's policy and asks the
//! broker for every connection, exactly as in a VMM. This process gives
//! up what a VMM does before its guest runs: the host's network (with a
//! broker), IPC and UTS namespaces, and every capability. With
//! `--until-stdin-closes` it ends when its stdin does: its starter holds
//! the other end of that pipe for as long as it holds the sandbox. Each
//! time it connects to the sandbox's socket it prints `connected` on its
//! stdout, so its starter knows when the network is up.

use std::io::{self, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::PathBuf;
use std::time::Duration;

use forkbox_devices::virtio::net::FrameBackend;
use forkbox_net::broker::link::BrokerLinks;
use rustix::event::{poll, PollFd, PollFlags};
use rustix::net::{AddressFamily, RecvFlags, SendFlags, SocketAddrUnix, SocketFlags, SocketType};

use crate::net::{GatewayBackend, NetConfig};

/// Largest frame either way: the gateway's MTU and an Ethernet header.
const MAX_FRAME: usize = forkbox_net::gateway::MTU + 14;
/// The longest wait between attempts to reach the sandbox's socket.
const MAX_RETRY: Duration = Duration::from_millis(200);
/// Room for frames in flight each way on the sandbox's socket.
const SOCKET_BUFFER: usize = 4 << 20;

/// `forkbox-vmm gateway --frames PATH --net-policy FILE [--net-broker PATH] [--net-log PATH]`.
#[derive(Debug, clap::Parser)]
#[command(
    name = "forkbox-vmm gateway",
    about = "The network gateway of a sandbox whose frames come over a socket"
)]
pub struct GatewayArgs {
    /// The sandbox's frame socket (SOCK_SEQPACKET), connected again
    /// whenever it closes.
    #[arg(long)]
    pub frames: PathBuf,
    /// The egress policy (JSON file).
    #[arg(long)]
    pub net_policy: PathBuf,
    /// The network broker's socket: it resolves names and opens
    /// connections (without one, this process connects to the host's
    /// loopback itself).
    #[arg(long)]
    pub net_broker: Option<PathBuf>,
    /// Append the egress log (JSON lines) here.
    #[arg(long)]
    pub net_log: Option<PathBuf>,
    /// End when stdin closes (the starter's hold on this gateway).
    #[arg(long)]
    pub until_stdin_closes: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum SandboxGatewayError {
    #[error("cannot read the network policy {path}")]
    Policy {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot reach the network broker at {path}")]
    Broker {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(transparent)]
    Net(#[from] crate::net::NetError),
    #[error("the sandbox's frame socket {path}")]
    Frames {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// The gateway's configuration and its broker links, made while the
/// host's files and network can still be reached.
pub fn prepare(
    args: &GatewayArgs,
) -> Result<(NetConfig, Option<BrokerLinks>), SandboxGatewayError> {
    let policy_json = std::fs::read_to_string(&args.net_policy).map_err(|source| {
        SandboxGatewayError::Policy {
            path: args.net_policy.clone(),
            source,
        }
    })?;
    let links = args
        .net_broker
        .as_ref()
        .map(|path| {
            BrokerLinks::connect(path).map_err(|source| SandboxGatewayError::Broker {
                path: path.clone(),
                source,
            })
        })
        .transpose()?;
    Ok((
        NetConfig {
            policy_json,
            broker: args.net_broker.clone(),
            log: args.net_log.clone(),
        },
        links,
    ))
}

/// Serves the sandbox's frames for good: returns only on an error of the
/// gateway's own.
pub fn run(
    args: &GatewayArgs,
    cfg: &NetConfig,
    links: Option<BrokerLinks>,
) -> Result<(), SandboxGatewayError> {
    let frames = args.frames.as_path();
    let mut backend = GatewayBackend::new(cfg, links)?;
    let stdin = std::io::stdin();
    let hold = args.until_stdin_closes.then(|| stdin.as_fd());
    let err = |source| SandboxGatewayError::Frames {
        path: frames.to_owned(),
        source,
    };
    let addr = SocketAddrUnix::new(frames).map_err(|e| err(e.into()))?;
    let mut buf = vec![0u8; MAX_FRAME + 1];
    loop {
        let Some(conn) = connect(&addr, &mut backend, hold) else {
            return Ok(());
        };
        match pump(&conn, &mut backend, &mut buf, hold) {
            Ok(()) => return Ok(()),
            Err(e) => tracing::debug!("the sandbox's frame socket: {e}; connecting again"),
        }
    }
}

/// Whether the starter let go: its end of stdin closed (or stdin says
/// anything at all: nothing is ever written there).
fn let_go(revents: PollFlags) -> bool {
    !revents.is_empty()
}

/// Connects to the sandbox's socket, retrying (its agent listens again
/// after a checkpoint) while the gateway goes on with its own work;
/// `None` once the starter let go.
fn connect(
    addr: &SocketAddrUnix,
    backend: &mut GatewayBackend,
    hold: Option<BorrowedFd<'_>>,
) -> Option<OwnedFd> {
    let mut wait = Duration::from_millis(5);
    loop {
        let made = rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
        .and_then(|s| rustix::net::connect(&s, addr).map(|()| s));
        if let Ok(s) = made {
            let _ = rustix::net::sockopt::set_socket_send_buffer_size(&s, SOCKET_BUFFER);
            let _ = rustix::net::sockopt::set_socket_recv_buffer_size(&s, SOCKET_BUFFER);
            // The starter waits for this line to know the network is up.
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "connected").and_then(|()| out.flush());
            return Some(s);
        }
        // Host streams and timers go on meanwhile; frames for the sandbox
        // are dropped, as on an unplugged wire.
        if !wait_for_backend(backend, wait, hold) {
            return None;
        }
        while backend.recv().is_some() {}
        wait = (wait * 2).min(MAX_RETRY);
    }
}

/// Waits up to `limit` for the backend's events and handles them;
/// `false` once the starter let go.
fn wait_for_backend(
    backend: &mut GatewayBackend,
    limit: Duration,
    hold: Option<BorrowedFd<'_>>,
) -> bool {
    let timeout = rustix::event::Timespec::try_from(limit).ok();
    let (ready, ended) = {
        let events = backend.events();
        let mut fds = vec![PollFd::new(&events, PollFlags::IN)];
        if let Some(hold) = &hold {
            fds.push(PollFd::new(hold, PollFlags::IN));
        }
        let _ = poll(&mut fds, timeout.as_ref());
        (
            !fds[0].revents().is_empty(),
            fds.get(1).is_some_and(|f| let_go(f.revents())),
        )
    };
    if ready {
        backend.handle_events();
    }
    !ended
}

/// Moves frames both ways until the sandbox's side closes (an error) or
/// the starter lets go (`Ok`).
fn pump(
    conn: &OwnedFd,
    backend: &mut GatewayBackend,
    buf: &mut [u8],
    hold: Option<BorrowedFd<'_>>,
) -> io::Result<()> {
    loop {
        let (from_sandbox, from_host) = {
            let events = backend.events();
            let mut fds = vec![
                PollFd::new(conn, PollFlags::IN),
                PollFd::new(&events, PollFlags::IN),
            ];
            if let Some(hold) = &hold {
                fds.push(PollFd::new(hold, PollFlags::IN));
            }
            match poll(&mut fds, None) {
                Ok(_) => {}
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
            }
            if fds.get(2).is_some_and(|f| let_go(f.revents())) {
                return Ok(());
            }
            (!fds[0].revents().is_empty(), !fds[1].revents().is_empty())
        };
        if from_sandbox {
            // Every frame waiting, then one pass of the gateway.
            loop {
                match rustix::net::recv(conn, &mut *buf, RecvFlags::DONTWAIT) {
                    Ok((0, _)) => return Err(io::ErrorKind::UnexpectedEof.into()),
                    // Longer than any frame (cut by the kernel): dropped,
                    // as the device of a VMM drops one.
                    Ok((n, _)) if n > MAX_FRAME => {}
                    Ok((n, _)) => backend.send(&buf[..n]),
                    Err(rustix::io::Errno::AGAIN) => break,
                    Err(rustix::io::Errno::INTR) => {}
                    Err(e) => return Err(e.into()),
                }
            }
            backend.flush();
        }
        if from_host {
            backend.handle_events();
        }
        while let Some(frame) = backend.recv() {
            // A full socket drops the frame, as a full queue would.
            match rustix::net::send(conn, &frame, SendFlags::DONTWAIT) {
                Ok(_) | Err(rustix::io::Errno::AGAIN) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn gateway_args_need_the_frames_socket_and_a_policy() {
        let args = GatewayArgs::try_parse_from([
            "gateway",
            "--frames",
            "/s/net.sock",
            "--net-policy",
            "/s/policy.json",
            "--net-broker",
            "/s/broker.sock",
            "--until-stdin-closes",
        ])
        .expect("parsed");
        assert_eq!(args.frames, PathBuf::from("/s/net.sock"));
        assert_eq!(args.net_broker, Some(PathBuf::from("/s/broker.sock")));
        assert!(args.until_stdin_closes && args.net_log.is_none());
        assert!(GatewayArgs::try_parse_from(["gateway", "--net-policy", "/p"]).is_err());
        assert!(GatewayArgs::try_parse_from(["gateway", "--frames", "/f"]).is_err());
    }

    #[test]
    fn a_policy_file_that_is_not_there_is_named() {
        let args = GatewayArgs::try_parse_from([
            "gateway",
            "--frames",
            "/nonexistent/net.sock",
            "--net-policy",
            "/nonexistent/policy.json",
        ])
        .expect("parsed");
        let err = prepare(&args).expect_err("no policy file");
        assert!(
            err.to_string().contains("/nonexistent/policy.json"),
            "{err}"
        );
    }
}
