//! The network broker of one sandbox: the trusted side of its egress.
//!
//! A VMM started with `--net-broker PATH` has no network of its own to
//! use: it asks here, over a `SOCK_SEQPACKET` unix socket, to resolve the
//! names its guest looks up and to open the TCP connections its guest
//! makes (messages: `forkbox_net::broker`). Every request is decided again
//! against the sandbox's [`Policy`] (the VMM is not trusted with the final
//! word); an allowed connection is opened here and its socket passed back
//! with `SCM_RIGHTS`. `host.forkbox.internal` (the gateway address) is the
//! host's loopback, `127.0.0.1` (never the address the daemon's port
//! forwards listen on, `forkbox_net::broker::PORT_FORWARD_IP`).
//!
//! What the broker adds to the VMM's decision: it knows the host's own
//! addresses (listed at each connect) and treats them as internal, so only
//! a CIDR rule naming one exactly opens it; it decides on the very address
//! it then connects to, and a connect allowed by a name rule goes ahead
//! only if the broker's own resolution of the name, now, gives that
//! address (DNS rebinding gains nothing: the address is checked, not the
//! name). Names are resolved as fully qualified (a trailing dot), so the
//! host's resolver never completes them with its search domains, and a
//! single-label name is refused.
//!
//! The policy can be replaced while the VM runs ([`NetBroker::set_policy`]):
//! every later request is decided by the new one, and the new policy is
//! pushed to every connected VMM (as it is sent first on each new
//! connection), so the gateway answers DNS and logs with the same rules.
//!
//! One thread accepts; each VMM connection gets a thread that reads
//! requests, and each connect runs on a thread of its own (bounded per
//! VMM connection) so a slow destination holds up nothing else.
//!
//! `vm` runs one broker per networked VM (a fork child gets its
//! own, so its policy can change alone) in the process that started the
//! VM: the daemon, for sandboxes.

use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream, ToSocketAddrs};
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::Duration;

use forkbox_net::broker::{
    link, plan_connect, BrokerMessage, BrokerReply, BrokerRequest, ConnectPlan, MAX_MESSAGE,
};
use forkbox_net::dns::MAX_ANSWERS;
use forkbox_net::policy::Policy;
use rustix::net::{AddressFamily, RecvFlags, SendFlags, SocketAddrUnix, SocketFlags, SocketType};

/// How long one outbound connect may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Connects in flight per VMM connection (the gateway's own limit of
/// pending attempts is 64).
const MAX_CONNECTS: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum NetBrokerError {
    #[error("cannot listen on {path}")]
    Listen {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot start the broker thread")]
    Thread(#[source] io::Error),
    #[error("the policy is too large: {bytes} bytes as JSON, at most {MAX_MESSAGE}")]
    PolicyTooLarge { bytes: usize },
    #[error("cannot encode the policy")]
    Encode(#[source] serde_json::Error),
}

/// The policy, and the VMM connections it is pushed to.
struct Shared {
    policy: RwLock<Policy>,
    /// The sandbox's egress log, opened here once (to append) and sent with
    /// the first policy on each VMM connection: the VMM's own user may not
    /// open it.
    egress_log: Option<std::fs::File>,
    /// Held while the policy changes and while a new connection is sent
    /// its first policy, so that no connection misses a change.
    pushed: Mutex<Pushed>,
}

/// What every VMM connection is told, and the connections.
struct Pushed {
    /// The policy as its message (encoded once per change).
    message: Vec<u8>,
    conns: Vec<Weak<OwnedFd>>,
}

impl Shared {
    fn policy(&self) -> Policy {
        self.policy
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// The message that tells a VMM its policy.
fn policy_message(policy: &Policy) -> Result<Vec<u8>, NetBrokerError> {
    let msg = serde_json::to_vec(&BrokerMessage::Policy {
        policy: policy.clone(),
    })
    .map_err(NetBrokerError::Encode)?;
    match msg.len() {
        bytes if bytes > MAX_MESSAGE => Err(NetBrokerError::PolicyTooLarge { bytes }),
        _ => Ok(msg),
    }
}

/// A running broker; dropping it stops it and hangs up on its VMMs.
pub struct NetBroker {
    path: PathBuf,
    listener: Arc<OwnedFd>,
    stop: Arc<AtomicBool>,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for NetBroker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NetBroker")
            .field("path", &self.path)
            .finish()
    }
}

impl NetBroker {
    /// Listens at `path` and serves `policy`.
    pub fn start(path: &Path, policy: Policy) -> Result<Self, NetBrokerError> {
        Self::start_with_log(path, policy, None)
    }

    /// [`start`](Self::start), handing each VMM that connects
    /// `egress_log` (created if missing, opened to append) with its first
    /// policy.
    pub fn start_with_log(
        path: &Path,
        policy: Policy,
        egress_log: Option<PathBuf>,
    ) -> Result<Self, NetBrokerError> {
        let message = policy_message(&policy)?;
        let err = |source: io::Error| NetBrokerError::Listen {
            path: path.to_path_buf(),
            source,
        };
        let fd = rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
        .map_err(|e| err(e.into()))?;
        let addr = SocketAddrUnix::new(path).map_err(|e| err(e.into()))?;
        rustix::net::bind(&fd, &addr).map_err(|e| err(e.into()))?;
        rustix::net::listen(&fd, 64).map_err(|e| err(e.into()))?;
        let listener = Arc::new(fd);
        let stop = Arc::new(AtomicBool::new(false));
        let shared = Arc::new(Shared {
            policy: RwLock::new(policy),
            egress_log: egress_log.as_deref().and_then(open_egress_log),
            pushed: Mutex::new(Pushed {
                message,
                conns: Vec::new(),
            }),
        });
        let (l, s, sh) = (
            Arc::clone(&listener),
            Arc::clone(&stop),
            Arc::clone(&shared),
        );
        std::thread::Builder::new()
            .name("net-broker".into())
            .spawn(move || accept_loop(&l, &s, &sh))
            .map_err(NetBrokerError::Thread)?;
        Ok(Self {
            path: path.to_path_buf(),
            listener,
            stop,
            shared,
        })
    }

    /// The policy requests are decided by now.
    pub fn policy(&self) -> Policy {
        self.shared.policy()
    }

    /// Decides every later request by `policy`, and tells every connected
    /// VMM. Connections already open stay open.
    pub fn set_policy(&self, policy: Policy) -> Result<(), NetBrokerError> {
        let msg = policy_message(&policy)?;
        let mut pushed = self.shared.pushed.lock().unwrap_or_else(|p| p.into_inner());
        *self
            .shared
            .policy
            .write()
            .unwrap_or_else(|p| p.into_inner()) = policy;
        pushed.message = msg;
        let Pushed { message, conns } = &mut *pushed;
        conns.retain(|c| match c.upgrade() {
            Some(conn) => {
                if let Err(e) = rustix::net::send(&*conn, message, SendFlags::NOSIGNAL) {
                    tracing::warn!(error = %e, "net broker: cannot send the new policy");
                }
                true
            }
            None => false,
        });
        Ok(())
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for NetBroker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wakes the blocked accept (it fails with EINVAL).
        let _ = rustix::net::shutdown(&*self.listener, rustix::net::Shutdown::Both);
        let _ = std::fs::remove_file(&self.path);
        // Hangs up on every VMM, as a broker whose process died would:
        // their serving threads end.
        let pushed = self.shared.pushed.lock().unwrap_or_else(|p| p.into_inner());
        for conn in pushed.conns.iter().filter_map(Weak::upgrade) {
            let _ = rustix::net::shutdown(&*conn, rustix::net::Shutdown::Both);
        }
    }
}

fn accept_loop(listener: &OwnedFd, stop: &AtomicBool, shared: &Arc<Shared>) {
    while !stop.load(Ordering::SeqCst) {
        match rustix::net::accept_with(listener, SocketFlags::CLOEXEC) {
            Ok(conn) => {
                let conn = Arc::new(conn);
                {
                    let log = shared.egress_log.as_ref().map(AsFd::as_fd);
                    let mut pushed = shared.pushed.lock().unwrap_or_else(|p| p.into_inner());
                    if let Err(e) = link::send_encoded(&*conn, &pushed.message, log) {
                        tracing::warn!(error = %e, "net broker: cannot send the policy");
                    }
                    pushed.conns.retain(|c| c.strong_count() > 0);
                    pushed.conns.push(Arc::downgrade(&conn));
                }
                let shared = Arc::clone(shared);
                let spawned = std::thread::Builder::new()
                    .name("net-broker-conn".into())
                    .spawn(move || serve(conn, &shared));
                if let Err(e) = spawned {
                    tracing::warn!(error = %e, "net broker: cannot start a thread");
                }
            }
            Err(rustix::io::Errno::INTR) => {}
            Err(_) => return,
        }
    }
}

/// The egress log, opened to append for a VMM (`None`, said, if it
/// cannot be: the VMM then tries the path itself).
fn open_egress_log(path: &Path) -> Option<std::fs::File> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| tracing::warn!(path = %path.display(), error = %e, "net broker: cannot open the egress log"))
        .ok()
}

/// Serves one VMM connection until it hangs up.
fn serve(conn: Arc<OwnedFd>, shared: &Shared) {
    let in_flight = Arc::new(AtomicUsize::new(0));
    let mut buf = vec![0u8; MAX_MESSAGE];
    loop {
        let n = match rustix::net::recv(&*conn, &mut buf[..], RecvFlags::empty()) {
            Ok((0, _)) => return,
            Ok((n, _)) => n,
            Err(rustix::io::Errno::INTR) => continue,
            Err(_) => return,
        };
        let request: BrokerRequest = match serde_json::from_slice(&buf[..n]) {
            Ok(r) => r,
            Err(e) => {
                // Nothing to name in a reply: drop the connection.
                tracing::warn!(error = %e, "net broker: bad request; dropping the connection");
                return;
            }
        };
        let policy = shared.policy();
        match request {
            BrokerRequest::Resolve { id, name } => {
                let reply = resolve(&policy, id, &name);
                let _ = send(&*conn, reply, None);
            }
            BrokerRequest::Connect {
                id,
                name,
                address,
                port,
            } => {
                let plan = match host_addresses() {
                    Ok(host) => plan_connect(&policy, &host, name.as_deref(), address, port),
                    // Fail closed: without the list, no host address is known to be safe.
                    Err(e) => ConnectPlan::Deny(format!("cannot list this host's addresses: {e}")),
                };
                if in_flight.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTS {
                    in_flight.fetch_sub(1, Ordering::SeqCst);
                    let _ = send(&*conn, BrokerReply::failed(id, "too many connects"), None);
                    continue;
                }
                let (conn, in_flight) = (Arc::clone(&conn), Arc::clone(&in_flight));
                let spawned = std::thread::Builder::new()
                    .name("net-broker-connect".into())
                    .spawn(move || {
                        let reply = match connect(plan) {
                            Ok(stream) => {
                                let ok = BrokerReply {
                                    id,
                                    ok: true,
                                    addresses: Vec::new(),
                                    not_found: false,
                                    denied: false,
                                    error: None,
                                };
                                send(&*conn, ok, Some(stream.as_fd()))
                            }
                            Err(ConnectError::Denied(why)) => {
                                tracing::debug!(id, %why, "net broker: connect denied");
                                send(&*conn, BrokerReply::denied(id, why), None)
                            }
                            Err(ConnectError::Failed(e)) => {
                                send(&*conn, BrokerReply::failed(id, e), None)
                            }
                        };
                        if let Err(e) = reply {
                            tracing::warn!(error = %e, "net broker: cannot answer");
                        }
                        in_flight.fetch_sub(1, Ordering::SeqCst);
                    });
                if let Err(e) = spawned {
                    tracing::warn!(error = %e, "net broker: cannot start a thread");
                }
            }
        }
    }
}

/// The addresses of this host's interfaces (in the broker's network
/// namespace), loopback included.
fn host_addresses() -> io::Result<Vec<IpAddr>> {
    Ok(if_addrs::get_if_addrs()?
        .into_iter()
        .map(|i| i.ip())
        .collect())
}

fn resolve(policy: &Policy, id: u64, name: &str) -> BrokerReply {
    let decision = policy.decide_name(name);
    if !decision.is_allowed() {
        let why = decision
            .explain()
            .unwrap_or_else(|| "not allowed".to_owned());
        return BrokerReply {
            not_found: true,
            ..BrokerReply::failed(id, why)
        };
    }
    match resolve_v4(name) {
        Ok(addresses) => BrokerReply {
            id,
            ok: true,
            addresses: addresses.into_iter().take(MAX_ANSWERS).collect(),
            not_found: false,
            denied: false,
            error: None,
        },
        Err(e) => BrokerReply {
            not_found: true,
            ..BrokerReply::failed(id, e.to_string())
        },
    }
}

/// `name` as an absolute name (`pypi.org.`): the resolver then asks for
/// exactly it, never `name` + one of the host's search domains. A
/// single-label name is refused: even absolute, it is a top-level domain
/// nobody means, or a name of the host's own network.
fn absolute_name(name: &str) -> io::Result<String> {
    let bare = name.strip_suffix('.').unwrap_or(name);
    if bare.is_empty() || !bare.contains('.') {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{name:?} is a single-label name: never resolved"),
        ));
    }
    Ok(format!("{bare}."))
}

fn resolve_v4(name: &str) -> io::Result<Vec<Ipv4Addr>> {
    let v4: Vec<Ipv4Addr> = (absolute_name(name)?.as_str(), 0u16)
        .to_socket_addrs()?
        .filter_map(|a| match a {
            SocketAddr::V4(a) => Some(*a.ip()),
            SocketAddr::V6(_) => None,
        })
        .collect();
    if v4.is_empty() {
        return Err(io::Error::new(io::ErrorKind::NotFound, "no IPv4 address"));
    }
    Ok(v4)
}

/// Why a connect was not opened: the policy said no, or the attempt failed.
enum ConnectError {
    Denied(String),
    Failed(String),
}

fn connect(plan: ConnectPlan) -> Result<TcpStream, ConnectError> {
    use ConnectError::{Denied, Failed};
    let target = match plan {
        ConnectPlan::Deny(why) => return Err(Denied(why)),
        ConnectPlan::Connect(addr) => addr,
        ConnectPlan::ConnectIfResolves { name, target } => {
            let addrs = resolve_v4(&name).map_err(|e| Denied(format!("{name}: {e}")))?;
            if !addrs.contains(target.ip()) {
                return Err(Denied(format!(
                    "{name} does not resolve to {} (now)",
                    target.ip()
                )));
            }
            SocketAddr::V4(target)
        }
    };
    TcpStream::connect_timeout(&target, CONNECT_TIMEOUT).map_err(|e| Failed(e.to_string()))
}

fn send(
    conn: impl AsFd,
    reply: BrokerReply,
    fd: Option<std::os::fd::BorrowedFd<'_>>,
) -> io::Result<()> {
    link::send_message(conn, &BrokerMessage::Reply(reply), fd)
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::TcpListener;

    use super::*;

    /// Connects, and takes the policy the broker sends first.
    fn client(path: &Path) -> (OwnedFd, Policy) {
        let fd = rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
        .expect("socket");
        rustix::net::connect(&fd, &SocketAddrUnix::new(path).expect("addr")).expect("connect");
        let policy = pushed_policy(&fd);
        (fd, policy)
    }

    fn receive(fd: &OwnedFd) -> (BrokerMessage, Option<OwnedFd>) {
        forkbox_net::broker::link::recv_message(fd)
            .expect("recvmsg")
            .expect("a message")
    }

    fn pushed_policy(fd: &OwnedFd) -> Policy {
        match receive(fd) {
            (BrokerMessage::Policy { policy }, None) => policy,
            other => panic!("expected a policy, got {other:?}"),
        }
    }

    fn ask(fd: &OwnedFd, req: &BrokerRequest) -> (BrokerReply, Option<OwnedFd>) {
        let msg = serde_json::to_vec(req).expect("json");
        rustix::net::send(fd, &msg, SendFlags::empty()).expect("send");
        match receive(fd) {
            (BrokerMessage::Reply(reply), passed) => (reply, passed),
            other => panic!("expected a reply, got {other:?}"),
        }
    }

    fn host_connect(id: u64, port: u16) -> BrokerRequest {
        BrokerRequest::Connect {
            id,
            name: Some("host.forkbox.internal".into()),
            address: forkbox_net::gateway::GATEWAY_IP,
            port,
        }
    }

    #[test]
    fn netbroker_policy_change_reaches_open_connections_and_decides_later_requests() {
        let dir = tempfile::tempdir().expect("tempdir");
        let server = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = server.local_addr().expect("addr").port();
        let broker =
            NetBroker::start(&dir.path().join("b.sock"), Policy::deny_all()).expect("broker");
        let (fd, first) = client(broker.path());
        assert_eq!(first, Policy::deny_all());
        let (reply, _) = ask(&fd, &host_connect(1, port));
        assert!(!reply.ok, "{reply:?}");

        let open = Policy::from_json(&format!(
            r#"{{"allow_out":["host.forkbox.internal:{port}"]}}"#
        ))
        .expect("policy");
        broker.set_policy(open.clone()).expect("set");
        assert_eq!(pushed_policy(&fd), open);
        assert_eq!(broker.policy(), open);
        let (reply, passed) = ask(&fd, &host_connect(2, port));
        assert!(reply.ok && passed.is_some(), "{reply:?}");
        // A new connection starts with the policy of now.
        let (_fd2, now) = client(broker.path());
        assert_eq!(now, open);

        broker.set_policy(Policy::deny_all()).expect("set");
        assert_eq!(pushed_policy(&fd), Policy::deny_all());
        let (reply, _) = ask(&fd, &host_connect(3, port));
        assert!(!reply.ok, "{reply:?}");

        let huge = Policy::from_json(&format!(
            r#"{{"allow_out":[{}]}}"#,
            (0..5000)
                .map(|i| format!(r#""h{i}.example.org:443""#))
                .collect::<Vec<_>>()
                .join(",")
        ))
        .expect("policy");
        assert!(matches!(
            broker.set_policy(huge),
            Err(NetBrokerError::PolicyTooLarge { .. })
        ));
        assert_eq!(broker.policy(), Policy::deny_all());
    }

    #[test]
    fn netbroker_dropped_hangs_up_on_its_vmms() {
        let dir = tempfile::tempdir().expect("tempdir");
        let broker =
            NetBroker::start(&dir.path().join("b.sock"), Policy::deny_all()).expect("broker");
        let (fd, _) = client(broker.path());
        drop(broker);
        let mut buf = [0u8; 16];
        let got = rustix::net::recv(&fd, &mut buf, RecvFlags::empty()).expect("recv");
        assert_eq!(got.0, 0, "hung up");
        assert!(!dir.path().join("b.sock").exists());
    }

    #[test]
    fn netbroker_connects_allowed_loopback_and_refuses_the_rest() {
        let dir = tempfile::tempdir().expect("tempdir");
        let server = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = server.local_addr().expect("addr").port();
        let json = format!(r#"{{"allow_out":["host.forkbox.internal:{port}"]}}"#);
        let broker = NetBroker::start(
            &dir.path().join("b.sock"),
            Policy::from_json(&json).expect("policy"),
        )
        .expect("broker");
        let (fd, _) = client(broker.path());
        let (reply, passed) = ask(&fd, &host_connect(7, port));
        assert!(reply.ok, "{reply:?}");
        assert_eq!(reply.id, 7);
        let mut stream = TcpStream::from(passed.expect("a socket"));
        let (mut accepted, _) = server.accept().expect("accept");
        stream.write_all(b"ping").expect("write");
        let mut got = [0u8; 4];
        accepted.read_exact(&mut got).expect("read");
        assert_eq!(&got, b"ping");

        // Another loopback port, and loopback by address: refused.
        for (address, p) in [
            (forkbox_net::gateway::GATEWAY_IP, port.wrapping_add(1)),
            (Ipv4Addr::LOCALHOST, port),
        ] {
            let (reply, passed) = ask(
                &fd,
                &BrokerRequest::Connect {
                    id: 8,
                    name: None,
                    address,
                    port: p,
                },
            );
            assert!(!reply.ok && passed.is_none(), "{reply:?}");
        }
        let (reply, _) = ask(
            &fd,
            &BrokerRequest::Resolve {
                id: 9,
                name: "denied.example".into(),
            },
        );
        assert!(!reply.ok && reply.not_found, "{reply:?}");
    }

    #[test]
    fn netbroker_denial_and_failure_are_told_apart() {
        let dir = tempfile::tempdir().expect("tempdir");
        // A loopback port nothing listens on any more: allowed, fails.
        let closed = TcpListener::bind("127.0.0.1:0").expect("bind");
        let closed_port = closed.local_addr().expect("addr").port();
        drop(closed);
        // A loopback server the policy does not name: denied, never reached.
        let other = TcpListener::bind("127.0.0.1:0").expect("bind");
        other.set_nonblocking(true).expect("nonblocking");
        let other_port = other.local_addr().expect("addr").port();
        let json = format!(r#"{{"allow_out":["host.forkbox.internal:{closed_port}"]}}"#);
        let broker = NetBroker::start(
            &dir.path().join("b.sock"),
            Policy::from_json(&json).expect("policy"),
        )
        .expect("broker");
        let (fd, _) = client(broker.path());
        let (reply, passed) = ask(&fd, &host_connect(1, closed_port));
        assert!(!reply.ok && !reply.denied && passed.is_none(), "{reply:?}");
        let (reply, passed) = ask(&fd, &host_connect(2, other_port));
        assert!(!reply.ok && reply.denied && passed.is_none(), "{reply:?}");
        assert_eq!(
            other.accept().map(|_| ()).map_err(|e| e.kind()),
            Err(io::ErrorKind::WouldBlock),
            "the server off the allowlist was reached"
        );
    }

    #[test]
    fn netbroker_never_reaches_a_port_forward_address() {
        let dir = tempfile::tempdir().expect("tempdir");
        // Where the daemon's forwards listen; the broker's policy names
        // exactly its port.
        let forward = TcpListener::bind((forkbox_net::broker::PORT_FORWARD_IP, 0)).expect("bind");
        forward.set_nonblocking(true).expect("nonblocking");
        let port = forward.local_addr().expect("addr").port();
        let json = format!(r#"{{"allow_out":["host.forkbox.internal:{port}","*"]}}"#);
        let broker = NetBroker::start(
            &dir.path().join("b.sock"),
            Policy::from_json(&json).expect("policy"),
        )
        .expect("broker");
        let (fd, _) = client(broker.path());
        // As the host alias (whatever answers on 127.0.0.1:port is not the
        // forward), and by the forward's own address (loopback: denied).
        let _ = ask(&fd, &host_connect(1, port));
        let (reply, passed) = ask(
            &fd,
            &BrokerRequest::Connect {
                id: 2,
                name: None,
                address: forkbox_net::broker::PORT_FORWARD_IP,
                port,
            },
        );
        assert!(!reply.ok && reply.denied && passed.is_none(), "{reply:?}");
        assert_eq!(
            forward.accept().map(|_| ()).map_err(|e| e.kind()),
            Err(io::ErrorKind::WouldBlock),
            "a sandbox reached a port forward"
        );
    }

    #[test]
    fn netbroker_single_label_names_are_never_resolved() {
        let dir = tempfile::tempdir().expect("tempdir");
        let broker = NetBroker::start(
            &dir.path().join("b.sock"),
            Policy::from_json(r#"{"allow_out":["*"]}"#).expect("policy"),
        )
        .expect("broker");
        let (fd, _) = client(broker.path());
        for name in ["localhost", "intranet.", "wpad"] {
            let (reply, _) = ask(
                &fd,
                &BrokerRequest::Resolve {
                    id: 1,
                    name: name.into(),
                },
            );
            assert!(!reply.ok && reply.not_found, "{name}: {reply:?}");
            let why = reply.error.unwrap_or_default();
            assert!(why.contains("single-label"), "{name}: {why}");
        }
    }

    #[test]
    fn netbroker_names_are_resolved_as_absolute() {
        assert_eq!(absolute_name("pypi.org").expect("name"), "pypi.org.");
        assert_eq!(absolute_name("pypi.org.").expect("name"), "pypi.org.");
        for name in ["intranet", "intranet.", "", "."] {
            assert!(absolute_name(name).is_err(), "{name:?}");
        }
    }

    #[test]
    fn netbroker_host_addresses_include_loopback() {
        let host = host_addresses().expect("getifaddrs");
        assert!(host.contains(&IpAddr::V4(Ipv4Addr::LOCALHOST)), "{host:?}");
    }
}
