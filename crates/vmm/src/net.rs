//! The host side of the guest's virtio-net: `forkbox-net`'s [`Gateway`]
//! as the device's [`FrameBackend`], driven from the main loop.
//!
//! The backend keeps one epoll of its own (the device's single event fd):
//! a timerfd for the gateway's next deadline, the broker connection's
//! replies, and every host stream (edge-triggered: any readiness change
//! means "poll the gateway"; the gateway moves what can move). Each wake-up
//! ends with one gateway poll, its log records appended to the egress log
//! file, and the timer re-armed.
//!
//! Who opens connections ([`AnyConnector`]) and resolves names
//! ([`AnyResolver`]):
//! - with `--net-broker PATH`, the broker (in forkbox, the process that
//!   started this VMM and holds the policy) does both: connects are asked
//!   over a `SOCK_SEQPACKET` socket and answered later with the connected
//!   socket's fd (`SCM_RIGHTS`); names are resolved with a short blocking
//!   request on a second connection. The broker holds the policy: it sends
//!   it first on each connection (the gateway starts with that, not the
//!   command line's) and again whenever it changes;
//! - without one, this process connects itself, and only to the host's
//!   loopback for `host.forkbox.internal`; names resolve through the host's
//!   resolver (blocking the main loop for as long as that takes).
//!
//! The broker's two links ([`BrokerLinks`]) are connected while its path
//! can still be reached: by the VMM before it enters its own root, by the
//! asker of a fork for the child (sent with the request). A broker that
//! hung up (its process died) is replaced by the links the process that
//! adopts the VM sends (`{"op":"broker"}`, [`relink`]); until then the
//! guest's new connections and lookups fail.
//!
//! A fork child or restored VM builds a new backend: a fresh gateway (no
//! TCP state, a fresh ISN seed, its own log), new broker links (to its
//! own broker when the fork request names one). The guest's old
//! connections are answered with RST by the new gateway.

use std::fs::{File, OpenOptions};
use std::io;
use std::net::{Ipv4Addr, SocketAddr, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use forkbox_devices::virtio::net::FrameBackend;
use forkbox_net::broker::link::{recv_message, send_request};
use forkbox_net::broker::{BrokerMessage, BrokerRequest};
use forkbox_net::dns::{ResolveError, Resolver};
use forkbox_net::gateway::{
    ConnId, ConnectOutcome, ConnectRequest, Connector, Gateway, GatewayConfig, Now, GATEWAY_IP,
};
use forkbox_net::log::JsonLinesWriter;
use forkbox_net::policy::{Policy, HOST_INTERNAL};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::timerfd::TimerFd;

use crate::counters::{Counters, COUNTERS};

/// The guest's MAC address (locally administered; every VM has the same:
/// no two VMs share a network).
pub const GUEST_MAC: [u8; 6] = [0x02, 0x46, 0x42, 0x00, 0x00, 0x0f];

// The guest's eth0 takes the device's MTU; the gateway's smoltcp must
// send and accept frames of the same size.
const _: () = assert!(
    forkbox_devices::virtio::net::MTU as usize == forkbox_net::gateway::MTU,
    "virtio-net and the gateway disagree on the MTU"
);

const TOKEN_TIMER: u64 = 1;
const TOKEN_BROKER: u64 = 2;
const TOKEN_STREAM: u64 = 3;
/// How long a loopback connect or a broker resolve may block the loop.
const BLOCKING_LIMIT: Duration = Duration::from_secs(5);
/// Most an egress log grows to (about 250 000 records); later records are
/// dropped (and counted) so a flooding guest cannot fill the disk.
pub const EGRESS_LOG_MAX_BYTES: u64 = forkbox_vmm_api::EGRESS_LOG_MAX_BYTES;
/// The timer's shortest wait (a zero wait would disarm it).
const MIN_WAIT: Duration = Duration::from_micros(50);

/// The network of one VM, as the command line gives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetConfig {
    /// The egress policy, JSON (`{"allow_out": [...], "deny_out": [...]}`).
    pub policy_json: String,
    /// The broker's socket; `None`: this process connects (loopback only).
    pub broker: Option<PathBuf>,
    /// Append the egress log here (JSON lines).
    pub log: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("bad network policy")]
    Policy(#[source] serde_json::Error),
    #[error("cannot reach the network broker at {path}")]
    Broker {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot open the egress log {path}")]
    Log {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("network event setup")]
    Setup(#[source] io::Error),
}

/// A VM's two links to its network broker, connected while its path
/// could still be reached.
pub use forkbox_net::broker::link::BrokerLinks;

/// Links to a new broker, waiting for the connector and the resolver to
/// take them on their next use ([`relink`]). One network per VMM process.
static RELINKED_CONNECTOR: Mutex<Option<OwnedFd>> = Mutex::new(None);
static RELINKED_RESOLVER: Mutex<Option<OwnedFd>> = Mutex::new(None);

fn take_relinked(slot: &Mutex<Option<OwnedFd>>) -> Option<OwnedFd> {
    slot.lock().unwrap_or_else(|p| p.into_inner()).take()
}

/// Hands the network links to a new broker (the process that adopted
/// this VM after its broker's died): the guest's next connection and
/// lookup use them, and the connector's first message, the policy, is
/// the gateway's from then on.
pub fn relink(links: BrokerLinks) {
    for (slot, fd) in [
        (&RELINKED_CONNECTOR, links.connector),
        (&RELINKED_RESOLVER, links.resolver),
    ] {
        *slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(fd);
    }
}

/// In a fork child: links its parent was handed and had not taken yet are
/// the parent's. Their descriptors were closed with everything else the
/// child inherited, so they are forgotten here, never closed again (the
/// numbers may be the child's own by now).
pub fn forget_relinks() {
    for slot in [&RELINKED_CONNECTOR, &RELINKED_RESOLVER] {
        if let Some(fd) = take_relinked(slot) {
            std::mem::forget(fd);
        }
    }
}

/// Waits (up to [`BLOCKING_LIMIT`]) for the policy a broker sends first
/// on a new connection, and the egress log it may send with it (opened
/// to append by the broker, whose user may open it; the VMM's may not).
fn first_policy(conn: &OwnedFd) -> io::Result<(Policy, Option<OwnedFd>)> {
    use rustix::net::sockopt::{set_socket_timeout, Timeout};
    set_socket_timeout(conn, Timeout::Recv, Some(BLOCKING_LIMIT))?;
    let first = recv_message(conn);
    set_socket_timeout(conn, Timeout::Recv, None)?;
    match first? {
        Some((BrokerMessage::Policy { policy }, log)) => Ok((policy, log)),
        Some((BrokerMessage::Reply(r), _)) => Err(io::Error::other(format!(
            "expected the policy first, got a reply to {}",
            r.id
        ))),
        None => Err(io::Error::other("the broker hung up")),
    }
}

/// Makes `stream` non-blocking and watches it (edge-triggered).
fn watch_stream(epoll: &Epoll, stream: &TcpStream) -> io::Result<()> {
    stream.set_nonblocking(true)?;
    let _ = stream.set_nodelay(true);
    let ev = EpollEvent::new(
        EventSet::IN | EventSet::OUT | EventSet::READ_HANG_UP | EventSet::EDGE_TRIGGERED,
        TOKEN_STREAM,
    );
    epoll.ctl(ControlOperation::Add, stream.as_raw_fd(), ev)
}

/// Takes `conn` as the connector's link: its first message (the policy,
/// and the egress log if the broker keeps one) read, then non-blocking
/// and watched by `epoll`.
fn take_connect_link(
    conn: OwnedFd,
    epoll: &Epoll,
) -> io::Result<(OwnedFd, Policy, Option<OwnedFd>)> {
    let (policy, log) = first_policy(&conn)?;
    rustix::io::ioctl_fionbio(&conn, true)?;
    epoll.ctl(
        ControlOperation::Add,
        conn.as_raw_fd(),
        EpollEvent::new(EventSet::IN, TOKEN_BROKER),
    )?;
    Ok((conn, policy, log))
}

/// Takes `conn` as the resolver's link: blocking, each answer awaited at
/// most [`BLOCKING_LIMIT`]. (Its first message, the policy, is skipped
/// like any message that answers nothing asked.)
fn take_resolve_link(conn: OwnedFd) -> io::Result<OwnedFd> {
    rustix::net::sockopt::set_socket_timeout(
        &conn,
        rustix::net::sockopt::Timeout::Recv,
        Some(BLOCKING_LIMIT),
    )?;
    Ok(conn)
}

/// Opens the gateway's allowed connections.
pub enum AnyConnector {
    /// Asks the broker at `path`; answers arrive later. `sock` is `None`
    /// once the broker hung up (the process that held it died), until the
    /// process that adopts the VM hands over a link to its own
    /// ([`relink`]).
    Broker {
        path: PathBuf,
        sock: Option<OwnedFd>,
        epoll: Arc<Epoll>,
        /// The policy a new link started with, not yet given the gateway.
        pending_policy: Option<Policy>,
    },
    /// Connects to the host's loopback for `host.forkbox.internal` only.
    Loopback { epoll: Arc<Epoll> },
}

impl AnyConnector {
    /// The broker's answers so far, with their streams watched, and the
    /// newest policy it sent, if any.
    fn take_messages(&mut self) -> (Vec<(ConnId, ConnectOutcome)>, Option<Policy>) {
        let AnyConnector::Broker {
            sock: link,
            epoll,
            pending_policy,
            ..
        } = self
        else {
            return (Vec::new(), None);
        };
        let mut out = Vec::new();
        let mut policy = pending_policy.take();
        while let Some(sock) = link {
            match recv_message(&*sock) {
                Ok(Some((BrokerMessage::Policy { policy: p }, _))) => policy = Some(p),
                Ok(Some((BrokerMessage::Reply(reply), fd))) => {
                    let outcome = match (reply.ok, fd) {
                        (true, Some(fd)) => {
                            let stream = TcpStream::from(fd);
                            match watch_stream(epoll, &stream) {
                                Ok(()) => ConnectOutcome::Connected(Box::new(stream)),
                                Err(e) => ConnectOutcome::Refused(format!("watch: {e}")),
                            }
                        }
                        (true, None) => ConnectOutcome::Refused("broker sent no socket".into()),
                        (false, _) => {
                            let why = reply
                                .error
                                .unwrap_or_else(|| "refused by the broker".into());
                            match reply.denied {
                                true => ConnectOutcome::Denied(why),
                                false => ConnectOutcome::Refused(why),
                            }
                        }
                    };
                    out.push((ConnId(reply.id), outcome));
                }
                Ok(None) => {
                    tracing::warn!(
                        "network broker hung up: connections in progress will time out, \
                         new ones fail until a process adopts this VM"
                    );
                    let _ = epoll.ctl(
                        ControlOperation::Delete,
                        sock.as_raw_fd(),
                        EpollEvent::default(),
                    );
                    *link = None;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    tracing::warn!("network broker: {e}");
                    break;
                }
            }
        }
        (out, policy)
    }
}

impl Connector for AnyConnector {
    fn connect(&mut self, request: &ConnectRequest) -> Option<ConnectOutcome> {
        match self {
            AnyConnector::Broker {
                path,
                sock,
                epoll,
                pending_policy,
            } => {
                if let Some(conn) = take_relinked(&RELINKED_CONNECTOR) {
                    match take_connect_link(conn, epoll) {
                        // The log this VMM has is the same file.
                        Ok((new, policy, _log)) => {
                            tracing::info!("network broker reached again");
                            if let Some(old) = sock.replace(new) {
                                let _ = epoll.ctl(
                                    ControlOperation::Delete,
                                    old.as_raw_fd(),
                                    EpollEvent::default(),
                                );
                            }
                            *pending_policy = Some(policy);
                        }
                        Err(e) => tracing::warn!("the new network broker's link: {e}"),
                    }
                }
                let Some(sock) = sock.as_ref() else {
                    return Some(ConnectOutcome::Refused(format!(
                        "the broker ({}) is gone and no other was handed over",
                        path.display()
                    )));
                };
                let req = BrokerRequest::Connect {
                    id: request.id.0,
                    name: request.name.clone(),
                    address: request.address,
                    port: request.port,
                };
                match send_request(sock, &req) {
                    Ok(()) => None,
                    Err(e) => Some(ConnectOutcome::Refused(format!("broker: {e}"))),
                }
            }
            AnyConnector::Loopback { epoll } => Some(loopback_connect(epoll, request)),
        }
    }
}

fn loopback_connect(epoll: &Epoll, request: &ConnectRequest) -> ConnectOutcome {
    if request.address != GATEWAY_IP || !request.decision.is_allowed() {
        return ConnectOutcome::Refused(format!(
            "without a broker only {HOST_INTERNAL} is reachable"
        ));
    }
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, request.port));
    match TcpStream::connect_timeout(&addr, BLOCKING_LIMIT) {
        Ok(stream) => match watch_stream(epoll, &stream) {
            Ok(()) => ConnectOutcome::Connected(Box::new(stream)),
            Err(e) => ConnectOutcome::Refused(format!("watch: {e}")),
        },
        Err(e) => ConnectOutcome::Refused(e.to_string()),
    }
}

/// Resolves the names the policy allows.
pub enum AnyResolver {
    /// Asks the broker at `path` (blocking, bounded by a receive
    /// timeout); `sock` is `None` after it hung up, until a link to
    /// another is handed over ([`relink`]).
    Broker {
        path: PathBuf,
        sock: Option<OwnedFd>,
        next_id: u64,
    },
    /// The host's resolver.
    Host,
}

impl Resolver for AnyResolver {
    fn resolve_v4(&mut self, name: &str) -> Result<Vec<Ipv4Addr>, ResolveError> {
        match self {
            AnyResolver::Host => match (name, 0u16).to_socket_addrs() {
                Ok(addrs) => {
                    let v4: Vec<Ipv4Addr> = addrs
                        .filter_map(|a| match a {
                            SocketAddr::V4(a) => Some(*a.ip()),
                            SocketAddr::V6(_) => None,
                        })
                        .collect();
                    if v4.is_empty() {
                        Err(ResolveError::NotFound)
                    } else {
                        Ok(v4)
                    }
                }
                Err(_) => Err(ResolveError::NotFound),
            },
            AnyResolver::Broker {
                path,
                sock,
                next_id,
            } => {
                *next_id += 1;
                let req = BrokerRequest::Resolve {
                    id: *next_id,
                    name: name.to_owned(),
                };
                if let Some(conn) = take_relinked(&RELINKED_RESOLVER) {
                    match take_resolve_link(conn) {
                        Ok(new) => *sock = Some(new),
                        Err(e) => tracing::warn!("the new network broker's link: {e}"),
                    }
                }
                let Some(link) = sock.as_ref() else {
                    return Err(ResolveError::Failed(format!(
                        "the broker ({}) is gone and no other was handed over",
                        path.display()
                    )));
                };
                match ask_resolve(link, &req, *next_id) {
                    Some(answer) => answer,
                    None => {
                        *sock = None;
                        Err(ResolveError::Failed("the broker hung up".into()))
                    }
                }
            }
        }
    }
}

/// One resolve question and its answer; `None`: the broker hung up.
fn ask_resolve(
    sock: &OwnedFd,
    req: &BrokerRequest,
    id: u64,
) -> Option<Result<Vec<Ipv4Addr>, ResolveError>> {
    if let Err(e) = send_request(sock, req) {
        return match e.raw_os_error() {
            Some(libc::EPIPE | libc::ECONNRESET | libc::ENOTCONN) => None,
            _ => Some(Err(ResolveError::Failed(e.to_string()))),
        };
    }
    loop {
        match recv_message(sock) {
            Ok(Some((BrokerMessage::Reply(r), _))) if r.id == id => {
                return Some(match (r.ok, r.not_found) {
                    (true, _) => Ok(r.addresses),
                    (false, true) => Err(ResolveError::NotFound),
                    (false, false) => Err(ResolveError::Failed(
                        r.error.unwrap_or_else(|| "resolve failed".into()),
                    )),
                });
            }
            // A late answer to an earlier, timed-out question, or a policy
            // (the connector's copy is the one used).
            Ok(Some(_)) => {}
            Ok(None) => return None,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Some(Err(ResolveError::Failed(e.to_string()))),
        }
    }
}

/// The gateway behind the guest's virtio-net.
pub struct GatewayBackend {
    gateway: Gateway<AnyResolver, AnyConnector>,
    epoll: Arc<Epoll>,
    timer: TimerFd,
    started: Instant,
    log: Option<(PathBuf, JsonLinesWriter<File>)>,
    events: Vec<EpollEvent>,
}

impl GatewayBackend {
    /// The gateway for `cfg`, asking its broker over `links` (required
    /// when `cfg` names a broker).
    pub fn new(cfg: &NetConfig, links: Option<BrokerLinks>) -> Result<Self, NetError> {
        let mut policy = Policy::from_json(&cfg.policy_json).map_err(NetError::Policy)?;
        let epoll = Arc::new(Epoll::new().map_err(NetError::Setup)?);
        let timer = TimerFd::new().map_err(|e| NetError::Setup(e.into()))?;
        epoll
            .ctl(
                ControlOperation::Add,
                timer.as_raw_fd(),
                EpollEvent::new(EventSet::IN, TOKEN_TIMER),
            )
            .map_err(NetError::Setup)?;
        let mut broker_log = None;
        let (resolver, connector) = match &cfg.broker {
            Some(path) => {
                let err = |source| NetError::Broker {
                    path: path.clone(),
                    source,
                };
                let links =
                    links.ok_or_else(|| err(io::Error::other("no link to it was opened")))?;
                // The broker's policy is the sandbox's now (it may have
                // changed since boot, or differ in a fork child).
                let (conn, broker_policy, log) =
                    take_connect_link(links.connector, &epoll).map_err(err)?;
                policy = broker_policy;
                broker_log = log;
                let res = take_resolve_link(links.resolver).map_err(err)?;
                (
                    AnyResolver::Broker {
                        path: path.clone(),
                        sock: Some(res),
                        next_id: 0,
                    },
                    AnyConnector::Broker {
                        path: path.clone(),
                        sock: Some(conn),
                        epoll: Arc::clone(&epoll),
                        pending_policy: None,
                    },
                )
            }
            None => (
                AnyResolver::Host,
                AnyConnector::Loopback {
                    epoll: Arc::clone(&epoll),
                },
            ),
        };
        let log = match (&cfg.log, broker_log) {
            (Some(path), Some(fd)) => Some((path, File::from(fd))),
            (Some(path), None) => Some((
                path,
                OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .map_err(|source| NetError::Log {
                        path: path.clone(),
                        source,
                    })?,
            )),
            (None, _) => None,
        };
        let log = match log {
            Some((path, f)) => {
                let used = f.metadata().map_or(0, |m| m.len());
                let room = EGRESS_LOG_MAX_BYTES.saturating_sub(used);
                Some((path.clone(), JsonLinesWriter::with_room(f, room)))
            }
            None => None,
        };
        let mut seed = [0u8; 8];
        if let Err(e) = rustix::rand::getrandom(&mut seed, rustix::rand::GetRandomFlags::empty()) {
            tracing::warn!("getrandom: {e}; TCP sequence numbers seeded from the clock");
            seed = unix_ms().to_le_bytes();
        }
        let config = GatewayConfig {
            random_seed: u64::from_le_bytes(seed),
            ..GatewayConfig::default()
        };
        let started = Instant::now();
        let now = now_since(started);
        let gateway = Gateway::new(config, policy, resolver, connector, now);
        Ok(Self {
            gateway,
            epoll,
            timer,
            started,
            log,
            events: vec![EpollEvent::default(); 64],
        })
    }

    fn now(&self) -> Now {
        now_since(self.started)
    }

    /// One gateway poll, its records logged, the timer re-armed.
    fn poll(&mut self) {
        let now = self.now();
        self.gateway.poll(now);
        let records = self.gateway.take_log();
        if let Some((path, w)) = &mut self.log {
            if !records.is_empty() {
                let full = w.dropped() > 0;
                let r = records
                    .iter()
                    .try_for_each(|r| w.write(r))
                    .and_then(|_| w.flush());
                if let Err(e) = r {
                    tracing::warn!("egress log {}: {e}", path.display());
                }
                if !full && w.dropped() > 0 {
                    tracing::warn!(
                        "egress log {} is full ({EGRESS_LOG_MAX_BYTES} bytes): later records are dropped",
                        path.display()
                    );
                }
            }
        }
        let r = match self.gateway.poll_delay(now) {
            Some(d) => self.timer.reset(d.max(MIN_WAIT), None),
            None => self.timer.clear(),
        };
        if let Err(e) = r {
            tracing::warn!("gateway timer: {e}");
        }
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn now_since(started: Instant) -> Now {
    Now {
        monotonic: started.elapsed(),
        unix_ms: unix_ms(),
    }
}

impl GatewayBackend {
    /// The descriptor that is readable when [`FrameBackend::handle_events`]
    /// has work (its epoll), for a loop that waits on more than it.
    pub fn events(&self) -> std::os::fd::BorrowedFd<'_> {
        // SAFETY: the epoll is owned by `self` (an `Arc` no one else
        // closes), so the descriptor is open for the borrow's lifetime.
        unsafe { std::os::fd::BorrowedFd::borrow_raw(self.epoll.as_raw_fd()) }
    }
}

impl FrameBackend for GatewayBackend {
    fn send(&mut self, frame: &[u8]) {
        Counters::bump(&COUNTERS.net_tx_frames);
        Counters::add(&COUNTERS.net_tx_bytes, frame.len() as u64);
        let now = self.now();
        self.gateway.receive_frame(frame, now);
    }

    fn flush(&mut self) {
        self.poll();
    }

    fn recv(&mut self) -> Option<Vec<u8>> {
        let frame = self.gateway.take_frame()?;
        Counters::bump(&COUNTERS.net_rx_frames);
        Counters::add(&COUNTERS.net_rx_bytes, frame.len() as u64);
        Some(frame)
    }

    fn event_fd(&self) -> Option<RawFd> {
        Some(self.epoll.as_raw_fd())
    }

    fn handle_events(&mut self) {
        let n = match self.epoll.wait(0, &mut self.events) {
            Ok(n) => n,
            Err(e) => {
                tracing::debug!("gateway epoll: {e}");
                0
            }
        };
        let (mut timer, mut broker) = (false, false);
        for ev in &self.events[..n] {
            match ev.data() {
                TOKEN_TIMER => timer = true,
                TOKEN_BROKER => broker = true,
                _ => {}
            }
        }
        if timer {
            // Readable: the read does not block.
            let _ = self.timer.wait();
        }
        if broker {
            let now = self.now();
            let (replies, policy) = self.gateway.connector_mut().take_messages();
            if let Some(policy) = policy {
                tracing::info!("network policy replaced by the broker");
                self.gateway.set_policy(policy);
            }
            for (id, outcome) in replies {
                self.gateway.connect_done(id, outcome, now);
            }
        }
        self.poll();
    }
}
