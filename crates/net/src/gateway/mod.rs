//! The VMM-side end of the guest's network: a userspace TCP/IP endpoint
//! (smoltcp) that is the guest's gateway and DNS server, and relays each
//! allowed TCP connection to a host-side stream.
//!
//! Addresses (QEMU user networking's, which guests and people know): the
//! guest is 10.0.2.15/24, the gateway **and DNS server** are both
//! 10.0.2.2. One address for both means one ARP entry and one thing to
//! configure in the guest (`nameserver 10.0.2.2`); nothing else lives on
//! 10.0.2.0/24.
//!
//! Life of a guest connection:
//! 1. The guest's SYN is seen here *before* smoltcp (`frames::classify`).
//!    Its destination is decided against the [`Policy`], by address and by
//!    the name the guest looked up for it through this gateway's DNS.
//!    10.0.2.2 itself is [`HOST_INTERNAL`], the host's loopback.
//! 2. Denied, or over the limit of connections: an RST goes back at once,
//!    and a record goes in the log.
//! 3. Allowed: the SYN is held and the [`Connector`] is asked to open the
//!    connection (in forkbox, the daemon checks again and opens it: the VMM
//!    has no network). It may answer at once or later through
//!    [`Gateway::connect_done`]. Refused: RST and a record. Connected: a
//!    smoltcp socket is made listening on exactly that destination, the
//!    held SYN is replayed into it, and the guest's handshake completes
//!    against a destination that is already there.
//! 4. Bytes are relayed (`conn`) until both sides have closed; then the
//!    record (bytes each way, duration) goes in the log.
//!
//! Bounds, since every byte here comes from a guest: frames queued each
//! way, pending connection attempts, open connections, names remembered
//! and log records are all capped ([`GatewayConfig`]). A SYN flood costs
//! RSTs, not memory.
//!
//! Sans-IO: the VMM hands in frames ([`Gateway::receive_frame`]), takes
//! frames out ([`Gateway::take_frame`]), calls [`Gateway::poll`] when a
//! host stream is ready or [`Gateway::poll_delay`] has passed, and passes
//! the time in ([`Now`]).

mod conn;
mod device;
mod echo;
mod frames;
mod names;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddrV4};
use std::time::Duration;

use smoltcp::iface::{Config, Interface, SocketHandle, SocketSet};
use smoltcp::socket::{tcp, udp};
use smoltcp::time::Instant;
use smoltcp::wire::{EthernetAddress, IpAddress, IpCidr, IpListenEndpoint};

pub use conn::HostStream;
pub use device::{MAX_FRAME, MTU};
pub use echo::EchoStream;

use crate::dns::{self, Resolver};
use crate::log::{EgressLog, EgressRecord, LogReason};
use crate::policy::{Decision, Destination, Policy, Protocol, Reason, Verdict, HOST_INTERNAL};
use conn::{Conn, Direction, Progress};
use device::QueueDevice;
use frames::{Inbound, Syn};
use names::NameMap;

/// The guest's address.
pub const GUEST_IP: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 15);
/// The gateway's and DNS server's address; [`HOST_INTERNAL`] resolves here.
pub const GATEWAY_IP: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 2);
/// The guest network's prefix length (10.0.2.0/24).
pub const PREFIX_LEN: u8 = 24;
/// The gateway's MAC address (locally administered).
pub const GATEWAY_MAC: [u8; 6] = [0x02, 0x46, 0x42, 0x00, 0x00, 0x02];
const DNS_PORT: u16 = 53;
/// Local ports (on the gateway address) of inbound connections.
const INBOUND_PORTS: (u16, u16) = (49152, 65535);

/// Why an inbound connection could not be started.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InboundError {
    #[error("port 0 is not a guest port")]
    BadPort,
    #[error("too many connections")]
    Limit,
}

/// Sizes and limits of one gateway.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    /// The sandbox the log records name.
    pub sandbox: String,
    /// Seeds smoltcp's TCP initial sequence numbers: pass fresh entropy.
    pub random_seed: u64,
    /// Open connections (past their SYN) plus pending attempts.
    pub max_connections: usize,
    /// Attempts waiting for the [`Connector`]'s answer.
    pub max_pending: usize,
    /// An attempt the connector has not answered by then is refused.
    pub connect_timeout: Duration,
    /// Receive and send buffer of each connection's socket, bytes (each;
    /// allocated when the connection opens). 256 KiB: four of the guest's
    /// ~64 KiB segments in flight, with TCP window scaling (smoltcp scales
    /// its window to fit the buffer). At 256 connections the sockets hold
    /// at most 128 MiB.
    pub tcp_buffer: usize,
    /// A connection whose guest leaves sent data (or our SYN-ACK)
    /// unacknowledged this long is dropped: half-open floods expire.
    pub tcp_timeout: Duration,
    /// Frames queued from the guest, and for the guest.
    pub max_queued_frames: usize,
    /// Bytes queued from the guest, and for the guest (frames are up to
    /// [`MAX_FRAME`], 64 KiB: the frame count alone would allow 64 MiB).
    pub max_queued_bytes: usize,
    /// Addresses whose looked-up name is remembered.
    pub max_names: usize,
    /// Records kept until taken.
    pub log_capacity: usize,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        Self {
            sandbox: String::new(),
            random_seed: 0,
            max_connections: 256,
            max_pending: 64,
            connect_timeout: Duration::from_secs(30),
            tcp_buffer: 256 * 1024,
            tcp_timeout: Duration::from_secs(60),
            max_queued_frames: 1024,
            max_queued_bytes: 4 * 1024 * 1024,
            max_names: 4096,
            log_capacity: 4096,
        }
    }
}

/// The time, passed in: a monotonic clock for the TCP stack's timers and
/// the wall clock for log records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Now {
    pub monotonic: Duration,
    pub unix_ms: u64,
}

impl Now {
    fn instant(&self) -> Instant {
        Instant::from_micros(i64::try_from(self.monotonic.as_micros()).unwrap_or(i64::MAX))
    }
}

/// Names one connection attempt between the gateway and its connector.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnId(pub u64);

/// An allowed attempt the connector is asked to open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectRequest {
    pub id: ConnId,
    /// The name the guest looked up for `address` ([`HOST_INTERNAL`] for
    /// the gateway address: open the host's loopback at `port`).
    pub name: Option<String>,
    pub address: Ipv4Addr,
    pub port: u16,
    /// The gateway's own decision (the connector should decide again: the
    /// VMM is not trusted with the final word).
    pub decision: Decision,
}

/// The connector's answer.
pub enum ConnectOutcome {
    Connected(Box<dyn HostStream>),
    /// Allowed, but the connection could not be opened.
    Refused(String),
    /// The host side's own decision denied what this gateway's copy of the
    /// policy allowed (the broker knows what the VMM does not, such as the
    /// host's addresses): logged as a denial.
    Denied(String),
}

impl std::fmt::Debug for ConnectOutcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConnectOutcome::Connected(_) => f.write_str("Connected"),
            ConnectOutcome::Refused(why) => write!(f, "Refused({why:?})"),
            ConnectOutcome::Denied(why) => write!(f, "Denied({why:?})"),
        }
    }
}

/// Opens host-side connections for allowed attempts.
pub trait Connector {
    /// `Some` to answer now; `None` to answer later with
    /// [`Gateway::connect_done`] (the SYN is held meanwhile).
    fn connect(&mut self, request: &ConnectRequest) -> Option<ConnectOutcome>;
}

/// Counts, for tests, metrics and the memory bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GatewayStats {
    pub connections: usize,
    pub pending: usize,
    /// smoltcp sockets, DNS included.
    pub sockets: usize,
    pub names: usize,
    pub frames_to_guest: usize,
    pub frames_from_guest: usize,
    pub log_records: usize,
}

struct Pending {
    syn: Syn,
    frame: Vec<u8>,
    record: EgressRecord,
    started: Duration,
}

/// The guest's gateway. See the module doc.
pub struct Gateway<R, C> {
    config: GatewayConfig,
    policy: Policy,
    resolver: R,
    connector: C,
    mac: EthernetAddress,
    iface: Interface,
    device: QueueDevice,
    sockets: SocketSet<'static>,
    dns: SocketHandle,
    pending: HashMap<ConnId, Pending>,
    conns: HashMap<ConnId, Conn>,
    /// (guest, destination) of every pending or open connection.
    keys: HashMap<(SocketAddrV4, SocketAddrV4), ConnId>,
    names: NameMap,
    log: EgressLog,
    next_id: u64,
    /// The next local port tried for an inbound connection.
    next_inbound_port: u16,
}

impl<R: Resolver, C: Connector> Gateway<R, C> {
    pub fn new(config: GatewayConfig, policy: Policy, resolver: R, connector: C, now: Now) -> Self {
        let mac = EthernetAddress(GATEWAY_MAC);
        let mut device = QueueDevice::new(config.max_queued_frames, config.max_queued_bytes);
        let mut iface_config = Config::new(mac.into());
        iface_config.random_seed = config.random_seed;
        let mut iface = Interface::new(iface_config, &mut device, now.instant());
        iface.update_ip_addrs(|addrs| {
            addrs
                .push(IpCidr::new(IpAddress::Ipv4(GATEWAY_IP), PREFIX_LEN))
                .expect("a new interface has room for one address");
        });
        // Every destination is "routed through ourselves", so smoltcp
        // accepts packets for any address (its AnyIP mode); which of them
        // get a socket is decided above it.
        iface
            .routes_mut()
            .add_default_ipv4_route(GATEWAY_IP)
            .expect("a new interface has room for one route");
        iface.set_any_ip(true);

        let mut sockets = SocketSet::new(Vec::new());
        let mut dns_socket = udp::Socket::new(
            udp::PacketBuffer::new(vec![udp::PacketMetadata::EMPTY; 16], vec![0; 8192]),
            udp::PacketBuffer::new(vec![udp::PacketMetadata::EMPTY; 16], vec![0; 8192]),
        );
        dns_socket
            .bind(IpListenEndpoint {
                addr: Some(IpAddress::Ipv4(GATEWAY_IP)),
                port: DNS_PORT,
            })
            .expect("port 53 is a valid endpoint on a fresh socket");
        let dns = sockets.add(dns_socket);

        Self {
            names: NameMap::new(config.max_names),
            log: EgressLog::new(config.log_capacity),
            config,
            policy,
            resolver,
            connector,
            mac,
            iface,
            device,
            sockets,
            dns,
            pending: HashMap::new(),
            conns: HashMap::new(),
            keys: HashMap::new(),
            next_id: 1,
            next_inbound_port: INBOUND_PORTS.0,
        }
    }

    /// Replace the policy. New attempts (and DNS questions) are decided by
    /// it; connections already open stay open.
    pub fn set_policy(&mut self, policy: Policy) {
        self.policy = policy;
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    pub fn connector_mut(&mut self) -> &mut C {
        &mut self.connector
    }

    pub fn resolver_mut(&mut self) -> &mut R {
        &mut self.resolver
    }

    /// Take the log records gathered so far, oldest first.
    pub fn take_log(&mut self) -> Vec<EgressRecord> {
        self.log.drain()
    }

    /// Log records dropped because nobody took them in time.
    pub fn log_dropped(&self) -> u64 {
        self.log.dropped()
    }

    pub fn stats(&self) -> GatewayStats {
        GatewayStats {
            connections: self.conns.len(),
            pending: self.pending.len(),
            sockets: self.sockets.iter().count(),
            names: self.names.len(),
            frames_to_guest: self.device.tx.len(),
            frames_from_guest: self.device.rx.len(),
            log_records: self.log.len(),
        }
    }

    /// The next frame for the guest's receive queue.
    pub fn take_frame(&mut self) -> Option<Vec<u8>> {
        self.device.tx.pop_front()
    }

    /// When [`Gateway::poll`] wants to be called again at the latest.
    pub fn poll_delay(&mut self, now: Now) -> Option<Duration> {
        let stack = self
            .iface
            .poll_delay(now.instant(), &self.sockets)
            .map(|d| Duration::from_micros(d.total_micros()));
        let pending = self
            .pending
            .values()
            .map(|p| (p.started + self.config.connect_timeout).saturating_sub(now.monotonic))
            .min();
        match (stack, pending) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// A frame the guest sent. Call [`Gateway::poll`] after a batch.
    pub fn receive_frame(&mut self, frame: &[u8], now: Now) {
        if frame.len() > MAX_FRAME
            || self.device.rx.len() >= self.config.max_queued_frames
            || self.device.rx.bytes() + frame.len() > self.config.max_queued_bytes
        {
            return;
        }
        let pass = match frames::classify(frame) {
            None => false,
            Some(Inbound::Arp { target }) => target == GATEWAY_IP,
            Some(Inbound::TcpSyn(syn)) => {
                if *syn.src.ip() != GUEST_IP {
                    return;
                }
                match self.keys.get(&(syn.src, syn.dst)) {
                    // A retransmitted SYN: an open connection's socket
                    // answers it; a pending one is still being decided.
                    Some(id) => self.conns.contains_key(id),
                    None => {
                        self.on_syn(syn, frame, now);
                        false
                    }
                }
            }
            Some(Inbound::Tcp { src, .. }) => *src.ip() == GUEST_IP,
            Some(Inbound::Udp { src, dst }) => {
                let to_dns = dst == SocketAddrV4::new(GATEWAY_IP, DNS_PORT);
                if *src.ip() == GUEST_IP && !to_dns {
                    self.log_udp(dst, now);
                }
                *src.ip() == GUEST_IP && to_dns
            }
            Some(Inbound::Icmp { dst }) => dst == GATEWAY_IP,
        };
        if pass {
            self.device.rx.push_back(frame.to_vec());
        }
    }

    /// Run the stack: process queued frames, answer DNS, relay bytes, end
    /// finished connections and overdue attempts.
    pub fn poll(&mut self, now: Now) {
        self.iface
            .poll(now.instant(), &mut self.device, &mut self.sockets);
        self.serve_dns(now);
        self.relay_all(now);
        self.expire_pending(now);
        self.iface
            .poll(now.instant(), &mut self.device, &mut self.sockets);
    }

    /// The connector's late answer for attempt `id`. An answer for an
    /// attempt that has already timed out is dropped (its stream closed).
    pub fn connect_done(&mut self, id: ConnId, outcome: ConnectOutcome, now: Now) {
        let Some(p) = self.pending.remove(&id) else {
            return;
        };
        self.keys.remove(&(p.syn.src, p.syn.dst));
        match outcome {
            ConnectOutcome::Refused(why) => {
                self.refuse(&p.syn, p.record, LogReason::ConnectFailed, Some(why));
            }
            ConnectOutcome::Denied(why) => {
                let mut record = p.record;
                record.verdict = Verdict::Deny;
                record.rule = None;
                self.refuse(&p.syn, record, LogReason::BrokerDenied, Some(why));
            }
            ConnectOutcome::Connected(stream) => self.open(id, p, stream, now),
        }
    }

    /// Drop every connection and attempt with an RST to the guest: for a
    /// fork child, whose host streams belong to its parent.
    pub fn reset_all(&mut self, why: &str, now: Now) {
        let ids: Vec<ConnId> = self.pending.keys().copied().collect();
        for id in ids {
            self.connect_done(id, ConnectOutcome::Refused(why.to_owned()), now);
        }
        let ids: Vec<ConnId> = self.conns.keys().copied().collect();
        for id in ids {
            if let Some(c) = self.conns.get_mut(&id) {
                self.sockets.get_mut::<tcp::Socket>(c.handle).abort();
                c.record.error = Some(why.to_owned());
            }
        }
        // Send the RSTs, then forget the sockets.
        self.iface
            .poll(now.instant(), &mut self.device, &mut self.sockets);
        for id in self.conns.keys().copied().collect::<Vec<_>>() {
            self.finish(id, now);
        }
    }

    /// Open a TCP connection from the gateway to `guest_port` on the guest
    /// and relay it to `stream` (the daemon's side of a ports-API stream).
    /// If nothing listens there, the guest's RST ends it and `stream` is
    /// dropped. Not an egress attempt: not logged.
    pub fn connect_inbound(
        &mut self,
        guest_port: u16,
        stream: Box<dyn HostStream>,
        now: Now,
    ) -> Result<ConnId, InboundError> {
        if guest_port == 0 {
            return Err(InboundError::BadPort);
        }
        if self.pending.len() + self.conns.len() >= self.config.max_connections {
            return Err(InboundError::Limit);
        }
        let guest = SocketAddrV4::new(GUEST_IP, guest_port);
        let local = self.free_inbound_port(guest).ok_or(InboundError::Limit)?;
        let size = self.config.tcp_buffer;
        let mut socket = tcp::Socket::new(
            tcp::SocketBuffer::new(vec![0; size]),
            tcp::SocketBuffer::new(vec![0; size]),
        );
        socket.set_nagle_enabled(false);
        // ACK every segment at once: the guest's window is our buffer, and a
        // delayed ACK (smoltcp's default 10 ms) stalls a bulk sender.
        socket.set_ack_delay(None);
        socket.set_timeout(Some(self.config.tcp_timeout.into()));
        let remote = (IpAddress::Ipv4(GUEST_IP), guest_port);
        let local_ep = IpListenEndpoint {
            addr: Some(IpAddress::Ipv4(GATEWAY_IP)),
            port: local.port(),
        };
        socket
            .connect(self.iface.context(), remote, local_ep)
            .map_err(|_| InboundError::BadPort)?;
        let handle = self.sockets.add(socket);
        let id = self.next_id();
        let key = (guest, local);
        self.keys.insert(key, id);
        let record = self.record(Protocol::Tcp, None, guest, now);
        let conn = Conn::new(
            id,
            Direction::Inbound,
            handle,
            key,
            stream,
            record,
            now.monotonic,
        );
        self.conns.insert(id, conn);
        self.iface
            .poll(now.instant(), &mut self.device, &mut self.sockets);
        Ok(id)
    }

    fn free_inbound_port(&mut self, guest: SocketAddrV4) -> Option<SocketAddrV4> {
        let (lo, hi) = INBOUND_PORTS;
        for _ in lo..=hi {
            let port = self.next_inbound_port;
            self.next_inbound_port = if port == hi { lo } else { port + 1 };
            let local = SocketAddrV4::new(GATEWAY_IP, port);
            if !self.keys.contains_key(&(guest, local)) {
                return Some(local);
            }
        }
        None
    }

    fn next_id(&mut self) -> ConnId {
        let id = ConnId(self.next_id);
        self.next_id += 1;
        id
    }

    fn record(
        &self,
        protocol: Protocol,
        name: Option<&str>,
        dst: SocketAddrV4,
        now: Now,
    ) -> EgressRecord {
        EgressRecord {
            time_ms: now.unix_ms,
            sandbox: self.config.sandbox.clone(),
            protocol,
            name: name.map(str::to_owned),
            address: Some(IpAddr::V4(*dst.ip())),
            port: dst.port(),
            verdict: Verdict::Deny,
            reason: LogReason::NoRule,
            rule: None,
            answers: Vec::new(),
            bytes_out: 0,
            bytes_in: 0,
            duration_ms: 0,
            error: None,
        }
    }

    fn decide_tcp(&self, dst: SocketAddrV4) -> (Option<String>, Decision) {
        let ip = *dst.ip();
        if ip == GATEWAY_IP {
            let d = Destination {
                name: Some(HOST_INTERNAL),
                ip: IpAddr::V4(ip),
                port: dst.port(),
                protocol: Protocol::Tcp,
            };
            return (Some(HOST_INTERNAL.to_owned()), self.policy.decide(&d));
        }
        let name = self.names.get(ip).map(str::to_owned);
        let on_guest_net =
            u32::from(ip) >> (32 - PREFIX_LEN) == u32::from(GATEWAY_IP) >> (32 - PREFIX_LEN);
        if on_guest_net || ip.is_broadcast() {
            let d = Decision {
                verdict: Verdict::Deny,
                reason: Reason::SpecialAddress,
            };
            return (name, d);
        }
        let d = Destination {
            name: name.as_deref(),
            ip: IpAddr::V4(ip),
            port: dst.port(),
            protocol: Protocol::Tcp,
        };
        let decision = self.policy.decide(&d);
        (name, decision)
    }

    fn on_syn(&mut self, syn: Syn, frame: &[u8], now: Now) {
        let (name, decision) = self.decide_tcp(syn.dst);
        let mut record = self.record(Protocol::Tcp, name.as_deref(), syn.dst, now);
        record.verdict = decision.verdict;
        let (reason, rule) = LogReason::of(&decision);
        record.reason = reason;
        record.rule = rule;
        if !decision.is_allowed() {
            return self.refuse(&syn, record, reason, decision.explain());
        }
        let busy = self.pending.len() + self.conns.len();
        if self.pending.len() >= self.config.max_pending || busy >= self.config.max_connections {
            record.verdict = Verdict::Deny;
            return self.refuse(&syn, record, LogReason::Limit, None);
        }
        let id = self.next_id();
        let request = ConnectRequest {
            id,
            name,
            address: *syn.dst.ip(),
            port: syn.dst.port(),
            decision,
        };
        self.keys.insert((syn.src, syn.dst), id);
        self.pending.insert(
            id,
            Pending {
                syn,
                frame: frame.to_vec(),
                record,
                started: now.monotonic,
            },
        );
        if let Some(outcome) = self.connector.connect(&request) {
            self.connect_done(id, outcome, now);
        }
    }

    fn refuse(
        &mut self,
        syn: &Syn,
        mut record: EgressRecord,
        reason: LogReason,
        error: Option<String>,
    ) {
        record.reason = reason;
        record.error = error;
        if self.device.tx.len() < self.config.max_queued_frames {
            self.device.tx.push_back(frames::rst_for(syn, self.mac));
        }
        self.log.push(record);
    }

    fn open(&mut self, id: ConnId, p: Pending, stream: Box<dyn HostStream>, now: Now) {
        let size = self.config.tcp_buffer;
        let mut socket = tcp::Socket::new(
            tcp::SocketBuffer::new(vec![0; size]),
            tcp::SocketBuffer::new(vec![0; size]),
        );
        socket.set_nagle_enabled(false);
        // ACK every segment at once: the guest's window is our buffer, and a
        // delayed ACK (smoltcp's default 10 ms) stalls a bulk sender.
        socket.set_ack_delay(None);
        socket.set_timeout(Some(self.config.tcp_timeout.into()));
        let endpoint = IpListenEndpoint {
            addr: Some(IpAddress::Ipv4(*p.syn.dst.ip())),
            port: p.syn.dst.port(),
        };
        if socket.listen(endpoint).is_err() {
            let error = Some("cannot listen on the destination".to_owned());
            return self.refuse(&p.syn, p.record, LogReason::ConnectFailed, error);
        }
        let handle = self.sockets.add(socket);
        // Replay the held SYN first: this socket is the only listener, and
        // takes it in this very poll.
        self.device.rx.push_front(p.frame);
        self.iface
            .poll(now.instant(), &mut self.device, &mut self.sockets);
        if self.sockets.get::<tcp::Socket>(handle).state() == tcp::State::Listen {
            // smoltcp did not take the SYN: never leave a listener behind
            // for another attempt's SYN to land in.
            self.sockets.remove(handle);
            let error = Some("SYN not accepted".to_owned());
            return self.refuse(&p.syn, p.record, LogReason::ConnectFailed, error);
        }
        let key = (p.syn.src, p.syn.dst);
        self.keys.insert(key, id);
        let conn = Conn::new(
            id,
            Direction::Outbound,
            handle,
            key,
            stream,
            p.record,
            p.started,
        );
        self.conns.insert(id, conn);
    }

    fn relay_all(&mut self, now: Now) {
        let mut done = Vec::new();
        for conn in self.conns.values_mut() {
            let sock = self.sockets.get_mut::<tcp::Socket>(conn.handle);
            if conn.relay(sock) == Progress::Done {
                done.push(conn.id);
            }
        }
        for id in done {
            self.finish(id, now);
        }
    }

    fn finish(&mut self, id: ConnId, now: Now) {
        let Some(mut conn) = self.conns.remove(&id) else {
            return;
        };
        self.keys.remove(&conn.key);
        self.sockets.remove(conn.handle);
        let elapsed = now.monotonic.saturating_sub(conn.started);
        conn.record.duration_ms = u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX);
        if conn.direction == Direction::Outbound {
            self.log.push(conn.record);
        }
    }

    fn expire_pending(&mut self, now: Now) {
        let timeout = self.config.connect_timeout;
        let overdue: Vec<ConnId> = self
            .pending
            .iter()
            .filter(|(_, p)| now.monotonic.saturating_sub(p.started) >= timeout)
            .map(|(id, _)| *id)
            .collect();
        for id in overdue {
            self.connect_done(id, ConnectOutcome::Refused("connect timed out".into()), now);
        }
    }

    fn serve_dns(&mut self, now: Now) {
        loop {
            let sock = self.sockets.get_mut::<udp::Socket>(self.dns);
            let Ok((payload, meta)) = sock.recv() else {
                break;
            };
            let query = payload.to_vec();
            let out = dns::answer(&query, &self.policy, GATEWAY_IP, &mut self.resolver);
            if let Some(reply) = out.reply {
                // A full send queue drops the reply; the guest asks again.
                let _ = self
                    .sockets
                    .get_mut::<udp::Socket>(self.dns)
                    .send_slice(&reply, meta);
            }
            if let Some(q) = out.query {
                for addr in &q.answers {
                    self.names.insert(*addr, &q.name);
                }
                let dst = SocketAddrV4::new(GATEWAY_IP, DNS_PORT);
                let mut record = self.record(Protocol::Dns, Some(&q.name), dst, now);
                record.address = None;
                record.verdict = q.decision.verdict;
                (record.reason, record.rule) = LogReason::of(&q.decision);
                record.error = q.decision.explain();
                if q.decision.is_allowed() && q.answers.is_empty() && q.qtype == 1 {
                    record.reason = LogReason::NotFound;
                }
                record.answers = q.answers.iter().map(|a| IpAddr::V4(*a)).collect();
                self.log.push(record);
            }
        }
    }

    fn log_udp(&mut self, dst: SocketAddrV4, now: Now) {
        let name = self.names.get(*dst.ip()).map(str::to_owned);
        let mut record = self.record(Protocol::Udp, name.as_deref(), dst, now);
        record.reason = LogReason::UdpNotAllowed;
        self.log.push(record);
    }
}
