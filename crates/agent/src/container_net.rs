//! The network of a gVisor sandbox (`container --net unix:PATH`).
//!
//! gVisor's own network stack gets a TAP device, `eth0`, configured as a
//! microVM's guest configures its virtio-net (10.0.2.15/24, default route
//! and DNS server 10.0.2.2). Its frames cross a `SOCK_SEQPACKET` socket,
//! one frame per message, bound at PATH in the host's directory: the host
//! connects the sandbox's gateway there (`forkbox-vmm gateway`, the same
//! `forkbox-net` gateway a microVM's VMM runs), which answers ARP and DNS
//! and relays only what the sandbox's policy allows. Nothing here decides
//! anything: a sandbox that replaces this pump reaches the same gateway.
//!
//! Around a checkpoint the socket is closed like the agent's own (gVisor
//! cannot save one bound to a host file): a quiesce wakes the pump with a
//! connection of its own, the pump closes the listener and the gateway's
//! connection and says so to the [`Gate`], and listens again once the gate
//! opens. The gateway connects again by itself; frames sent meanwhile are
//! lost, as on a wire, and TCP sends them again.
//!
//! gVisor (20240729) cannot save a TCP endpoint on a TAP interface in any
//! state but closed or listening: a connection open, closing, or in
//! TIME_WAIT (60 s after every connection the sandbox closed first) fails
//! the checkpoint. So before it closes, the pump settles them ([`Settle`]):
//! it goes on moving frames, ends each connection no process holds any
//! more (closing, or in TIME_WAIT: a RST from its peer, then a SYN past
//! the old sequence numbers, which RFC 1122 lets a TIME_WAIT endpoint take
//! as a new connection; netstack ignores a RST there), and fails the
//! quiesce by name for any a process still holds when its time is up.
//! Those are never cut: the sandbox's owner closes them.

use std::collections::{HashMap, HashSet};
use std::io;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustix::event::{poll, PollFd, PollFlags};
use rustix::net::{AddressFamily, RecvFlags, SendFlags, SocketAddrUnix, SocketFlags, SocketType};

use crate::container::Gate;
use crate::init::{GATEWAY_IP, GUEST_IP, PREFIX_LEN};
use crate::sys;

/// The sandbox's interface, named as in a microVM.
const IFNAME: &str = "eth0";
/// Its MAC address: a microVM guest's.
const GUEST_MAC: [u8; 6] = [0x02, 0x46, 0x42, 0x00, 0x00, 0x0f];
/// The gateway's MTU (`forkbox_net::gateway::MTU`), so TCP segments are
/// as large as a microVM's.
const MTU: u32 = 65520;
/// Largest frame either way: the MTU and an Ethernet header.
const MAX_FRAME: usize = MTU as usize + 14;

/// Brings `eth0` up and starts the pump that serves its frames on `path`.
pub fn start(path: &Path, gate: &Arc<Gate>) -> Result<(), String> {
    let tap = interface()?;
    let _ = std::fs::remove_file("/etc/resolv.conf");
    std::fs::write("/etc/resolv.conf", format!("nameserver {GATEWAY_IP}\n"))
        .map_err(|e| format!("cannot write /etc/resolv.conf: {e}"))?;
    crate::log(&format!(
        "network: {IFNAME} {GUEST_IP}/{PREFIX_LEN} mtu {MTU}, gateway and DNS {GATEWAY_IP}, frames on {}",
        path.display()
    ));
    let (path, gate) = (path.to_owned(), Arc::clone(gate));
    std::thread::Builder::new()
        .name("net".into())
        .spawn(move || pump_forever(&path, tap, &gate))
        .map_err(|e| format!("cannot start the network thread: {e}"))?;
    Ok(())
}

/// `eth0`, made and configured.
fn interface() -> Result<OwnedFd, String> {
    let tap = sys::open_tap(IFNAME).map_err(|e| format!("cannot make {IFNAME} (TAP): {e}"))?;
    configure().map_err(|e| format!("cannot configure {IFNAME}: {e}"))?;
    Ok(tap)
}

/// Serves frames on `path` between each checkpoint's quiesce. gVisor
/// cannot save a TAP device either: once the sandbox's connections are
/// settled, `eth0` is closed (gVisor removes it) and made again after.
fn pump_forever(path: &Path, tap: OwnedFd, gate: &Arc<Gate>) {
    let mut frame = Vec::with_capacity(MAX_FRAME + 1);
    let mut conns = Conns::default();
    let mut tap = Some(tap);
    loop {
        gate.net_wait_open();
        if tap.is_none() {
            tap = interface()
                .map_err(|e| crate::log(&format!("network: {e}: the sandbox has none")))
                .ok();
        }
        let unsaved = match &tap {
            Some(t) => match pump(path, t, gate, &mut frame, &mut conns) {
                Ok(None) => {
                    // Settled for a checkpoint.
                    tap = None;
                    None
                }
                Ok(Some(why)) => Some(why),
                Err(e) => {
                    crate::log(&format!("network: {e}; listening again"));
                    std::thread::sleep(SETTLE_POLL);
                    None
                }
            },
            // Nothing to serve or settle: on to the next quiesce.
            None => {
                gate.net_wait_quiesce();
                None
            }
        };
        let _ = std::fs::remove_file(path);
        gate.net_closed(unsaved);
    }
}

/// Removes a socket's name when dropped.
struct Unlink<'a>(&'a Path);

impl Drop for Unlink<'_> {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.0);
    }
}

/// How often a settling pump looks at the sandbox's connections.
const SETTLE_POLL: Duration = Duration::from_millis(20);

/// One listener's life: until a quiesce is asked and the sandbox's TCP
/// connections settled (`Some`: why they did not).
fn pump(
    path: &Path,
    tap: &OwnedFd,
    gate: &Gate,
    frame: &mut Vec<u8>,
    conns: &mut Conns,
) -> io::Result<Option<String>> {
    let _ = std::fs::remove_file(path);
    // Dropped in the reverse order: the socket's name goes first, then the
    // listener, then the gateway's connection; the gateway, connecting
    // again at once, must not reach a listener about to go (gVisor's host
    // side of it would take the connection and never answer).
    let mut conn: Option<OwnedFd> = None;
    let listener = seqpacket()?;
    rustix::net::bind(&listener, &SocketAddrUnix::new(path)?)?;
    let _name = Unlink(path);
    rustix::net::listen(&listener, 4)?;
    // A quiesce asked before the bind could not wake this loop.
    let mut settle = (!gate.is_open()).then(|| Settle::new(gate.settle_by()));
    loop {
        if let Some(s) = &mut settle {
            match s.step(tap, conns) {
                Settled::Done => return Ok(None),
                Settled::Unsaved(why) => return Ok(Some(why)),
                Settled::Waiting => {}
            }
        }
        let mut fds = vec![
            PollFd::new(&listener, PollFlags::IN),
            PollFd::new(tap, PollFlags::IN),
        ];
        if let Some(c) = &conn {
            fds.push(PollFd::new(c, PollFlags::IN));
        }
        let timeout = settle
            .as_ref()
            .and_then(|_| rustix::event::Timespec::try_from(SETTLE_POLL).ok());
        match poll(&mut fds, timeout.as_ref()) {
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
        let ready: Vec<bool> = fds.iter().map(|f| !f.revents().is_empty()).collect();
        drop(fds);
        if ready[0] {
            // A quiesce wakes this loop with a connection of its own.
            let new = rustix::net::accept_with(&listener, SocketFlags::CLOEXEC)?;
            if !gate.is_open() {
                settle.get_or_insert_with(|| Settle::new(gate.settle_by()));
            } else {
                conn = Some(new);
            }
            continue;
        }
        if ready.get(2) == Some(&true) {
            if let Some(c) = &conn {
                match recv_frame(c, frame) {
                    Ok(true) => {
                        conns.received(frame);
                        // A full queue drops the frame, as a wire would.
                        let _ = rustix::io::write(tap, frame);
                    }
                    Ok(false) | Err(_) => conn = None,
                }
            }
        }
        if ready[1] {
            frame.clear();
            let n = rustix::io::read(tap, rustix::buffer::spare_capacity(frame))?;
            conns.sent(frame);
            if let (Some(c), true) = (&conn, n > 0) {
                match rustix::net::send(c, frame, SendFlags::DONTWAIT) {
                    Ok(_) | Err(rustix::io::Errno::AGAIN) => {}
                    Err(_) => conn = None,
                }
            }
        }
    }
}

/// The sandbox's TCP connections on `eth0` as its frames show them: each
/// one's last acknowledgement from the sandbox (its next expected
/// sequence number), until a RST either way ends it. Bounded: a sandbox
/// that opens more forgets its oldest (and may then fail its own
/// checkpoint, which is its own doing).
#[derive(Debug, Default)]
struct Conns {
    open: HashMap<(u16, SocketAddrV4), Conn>,
    /// The sandbox's MAC address, as its frames give it (gVisor may not
    /// take the one `configure` asks for).
    mac: Option<[u8; 6]>,
}

#[derive(Debug, Clone, Copy)]
struct Conn {
    /// The sandbox's last acknowledgement number on it.
    rcv_nxt: u32,
    seen: Instant,
}

/// Most connections remembered.
const MAX_CONNS: usize = 4096;
/// A connection silent this long is gone (TIME_WAIT is 60 s).
const CONN_FORGET: Duration = Duration::from_secs(120);

/// The TCP header fields the tracking needs.
struct Segment {
    src: SocketAddrV4,
    dst: SocketAddrV4,
    ack: u32,
    flags: u8,
}

const TCP_RST: u8 = 0x04;
const TCP_SYN: u8 = 0x02;
const TCP_ACK: u8 = 0x10;

/// An Ethernet frame's IPv4 TCP segment, if it carries one.
fn segment(frame: &[u8]) -> Option<Segment> {
    if frame.get(12..14)? != [0x08, 0x00] {
        return None;
    }
    let ip = frame.get(14..)?;
    let ihl = usize::from(ip.first()? & 0x0f) * 4;
    if *ip.get(9)? != 6 || ihl < 20 {
        return None;
    }
    let addr = |at: usize| -> Option<Ipv4Addr> {
        let b = ip.get(at..at + 4)?;
        Some(Ipv4Addr::new(b[0], b[1], b[2], b[3]))
    };
    let tcp = ip.get(ihl..)?;
    let word = |at: usize| -> Option<u32> {
        let b = tcp.get(at..at + 4)?;
        Some(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    };
    let port = |at: usize| -> Option<u16> {
        let b = tcp.get(at..at + 2)?;
        Some(u16::from_be_bytes([b[0], b[1]]))
    };
    Some(Segment {
        src: SocketAddrV4::new(addr(12)?, port(0)?),
        dst: SocketAddrV4::new(addr(16)?, port(2)?),
        ack: word(8)?,
        flags: *tcp.get(13)?,
    })
}

impl Conns {
    /// A frame the sandbox sent.
    fn sent(&mut self, frame: &[u8]) {
        if let Some(mac) = frame.get(6..12).and_then(|m| <[u8; 6]>::try_from(m).ok()) {
            self.mac = Some(mac);
        }
        let Some(s) = segment(frame) else { return };

        if *s.src.ip() != GUEST_IP {
            return;
        }
        let key = (s.src.port(), s.dst);
        if s.flags & TCP_RST != 0 {
            self.open.remove(&key);
        } else if s.flags & TCP_ACK != 0 {
            if !self.open.contains_key(&key) && self.open.len() >= MAX_CONNS {
                self.forget_oldest();
            }
            let conn = self.open.entry(key).or_insert(Conn {
                rcv_nxt: s.ack,
                seen: Instant::now(),
            });
            conn.rcv_nxt = s.ack;
            conn.seen = Instant::now();
        }
    }

    /// A frame for the sandbox.
    fn received(&mut self, frame: &[u8]) {
        let Some(s) = segment(frame) else { return };
        if s.flags & TCP_RST != 0 && *s.dst.ip() == GUEST_IP {
            self.open.remove(&(s.dst.port(), s.src));
        }
    }

    fn forget_oldest(&mut self) {
        if let Some(key) = self
            .open
            .iter()
            .min_by_key(|(_, c)| c.seen)
            .map(|(k, _)| *k)
        {
            self.open.remove(&key);
        }
    }

    fn forget_silent(&mut self) {
        self.open.retain(|_, c| c.seen.elapsed() < CONN_FORGET);
    }
}

/// The sandbox's TCP connections on `eth0`, settled for a checkpoint.
struct Settle {
    by: Instant,
    last_strike: Option<Instant>,
    /// Listeners on the ports of connections in TIME_WAIT.
    catchers: HashMap<u16, std::net::TcpListener>,
}

enum Settled {
    Done,
    Waiting,
    Unsaved(String),
}

/// How often the closed connections are sent their ending SYNs again.
const STRIKE_EVERY: Duration = Duration::from_millis(200);

impl Settle {
    fn new(by: Instant) -> Self {
        Self {
            by,
            last_strike: None,
            catchers: HashMap::new(),
        }
    }

    /// Connections a process still holds are waited for; those no process
    /// holds any more (closing, or in TIME_WAIT) are ended, as if by their
    /// peer: a RST at the sandbox's last acknowledgement ends one that is
    /// closing (data it had not sent yet is lost: no process waits for
    /// it); a TIME_WAIT endpoint ignores RSTs, so a SYN just past it
    /// follows, which it hands to a listener on its port (one is made) and
    /// goes. Both again every 200 ms, until the sandbox's answers (a RST,
    /// or the gateway's to the listener's SYN-ACK) show each gone.
    fn step(&mut self, tap: &OwnedFd, conns: &mut Conns) -> Settled {
        conns.forget_silent();
        let held = tcp_endpoints();
        let held_keys: HashSet<(u16, SocketAddrV4)> =
            held.iter().map(|e| (e.local.port(), e.remote)).collect();
        if held.is_empty() && conns.open.is_empty() {
            return Settled::Done;
        }
        if self.last_strike.is_none_or(|t| t.elapsed() >= STRIKE_EVERY) {
            self.last_strike = Some(Instant::now());
            for ((port, remote), conn) in &conns.open {
                if held_keys.contains(&(*port, *remote)) {
                    continue;
                }
                let local = SocketAddrV4::new(GUEST_IP, *port);
                // A TIME_WAIT endpoint hands a new SYN to a listener on its
                // port, and goes; with none, it drops the SYN and stays.
                if !self.catchers.contains_key(port) {
                    if let Ok(l) = std::net::TcpListener::bind(local) {
                        self.catchers.insert(*port, l);
                    }
                }
                let mac = conns.mac.unwrap_or(GUEST_MAC);
                let rst = segment_to(mac, *remote, local, conn.rcv_nxt, TCP_RST);
                let syn = segment_to(mac, *remote, local, conn.rcv_nxt.wrapping_add(1), TCP_SYN);
                let _ = rustix::io::write(tap, &rst);
                let _ = rustix::io::write(tap, &syn);
            }
        }
        if Instant::now() < self.by {
            return Settled::Waiting;
        }
        let mut list: Vec<String> = held
            .iter()
            .map(|e| format!("{} -> {} ({})", e.local, e.remote, state_name(e.state)))
            .collect();
        list.extend(
            conns
                .open
                .keys()
                .filter(|k| !held_keys.contains(k))
                .map(|(port, remote)| format!("{GUEST_IP}:{port} -> {remote} (closing)")),
        );
        Settled::Unsaved(format!(
            "gVisor cannot checkpoint a sandbox with TCP connections through its network, and \
             these did not close: {}: close them before a fork or a snapshot",
            list.join(", ")
        ))
    }
}

/// A TCP endpoint a process of the sandbox holds (`/proc/net/tcp`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Endpoint {
    local: SocketAddrV4,
    remote: SocketAddrV4,
    state: u8,
}

const CLOSE: u8 = 0x07;
const LISTEN: u8 = 0x0a;

fn state_name(state: u8) -> &'static str {
    match state {
        0x01 => "established",
        0x02 => "SYN sent",
        0x03 => "SYN received",
        0x04 => "FIN-WAIT-1",
        0x05 => "FIN-WAIT-2",
        0x06 => "TIME-WAIT",
        0x08 => "CLOSE-WAIT",
        0x09 => "LAST-ACK",
        0x0b => "closing",
        _ => "other",
    }
}

/// The sandbox's TCP endpoints on `eth0` that gVisor cannot save: all
/// but the listening and the closed.
fn tcp_endpoints() -> Vec<Endpoint> {
    let Ok(table) = std::fs::read_to_string("/proc/net/tcp") else {
        return Vec::new();
    };
    table
        .lines()
        .skip(1)
        .filter_map(parse_tcp_line)
        .filter(|e| *e.local.ip() == GUEST_IP && e.state != LISTEN && e.state != CLOSE)
        .collect()
}

/// One line of `/proc/net/tcp`: `sl local rem st ...`, addresses as
/// `0F02000A:9C4A` (the address's bytes in memory order, the port).
fn parse_tcp_line(line: &str) -> Option<Endpoint> {
    let mut fields = line.split_whitespace().skip(1);
    let addr = |s: &str| {
        let (ip, port) = s.split_once(':')?;
        let ip = u32::from_str_radix(ip, 16).ok()?;
        let port = u16::from_str_radix(port, 16).ok()?;
        Some(SocketAddrV4::new(Ipv4Addr::from(ip.to_le_bytes()), port))
    };
    let local = addr(fields.next()?)?;
    let remote = addr(fields.next()?)?;
    let state = u8::from_str_radix(fields.next()?, 16).ok()?;
    Some(Endpoint {
        local,
        remote,
        state,
    })
}

/// The gateway's MAC address (`forkbox_net::gateway::GATEWAY_MAC`).
const GATEWAY_MAC: [u8; 6] = [0x02, 0x46, 0x42, 0x00, 0x00, 0x02];

/// An Ethernet frame carrying a TCP segment with `flags` (SYN or RST, no
/// data) from `src` (the peer) to `dst` (the sandbox, at `mac`), as the
/// gateway would send it.
fn segment_to(mac: [u8; 6], src: SocketAddrV4, dst: SocketAddrV4, seq: u32, flags: u8) -> Vec<u8> {
    let mut tcp = Vec::with_capacity(20);
    tcp.extend_from_slice(&src.port().to_be_bytes());
    tcp.extend_from_slice(&dst.port().to_be_bytes());
    tcp.extend_from_slice(&seq.to_be_bytes());
    tcp.extend_from_slice(&0u32.to_be_bytes()); // ack
    tcp.extend_from_slice(&[5 << 4, flags]); // data offset, flags
    tcp.extend_from_slice(&65535u16.to_be_bytes()); // window
    tcp.extend_from_slice(&[0, 0, 0, 0]); // checksum, urgent
    let mut pseudo = Vec::with_capacity(12 + tcp.len());
    pseudo.extend_from_slice(&src.ip().octets());
    pseudo.extend_from_slice(&dst.ip().octets());
    pseudo.extend_from_slice(&[0, 6]);
    pseudo.extend_from_slice(&u16::try_from(tcp.len()).unwrap_or(0).to_be_bytes());
    pseudo.extend_from_slice(&tcp);
    let sum = checksum(&pseudo).to_be_bytes();
    tcp[16..18].copy_from_slice(&sum);
    let mut ip = vec![0x45, 0];
    ip.extend_from_slice(&u16::try_from(20 + tcp.len()).unwrap_or(0).to_be_bytes());
    ip.extend_from_slice(&[0, 0, 0x40, 0, 64, 6, 0, 0]); // id, don't fragment, TTL, TCP
    ip.extend_from_slice(&src.ip().octets());
    ip.extend_from_slice(&dst.ip().octets());
    let sum = checksum(&ip).to_be_bytes();
    ip[10..12].copy_from_slice(&sum);
    let mut frame = Vec::with_capacity(14 + ip.len() + tcp.len());
    frame.extend_from_slice(&mac);
    frame.extend_from_slice(&GATEWAY_MAC);
    frame.extend_from_slice(&[0x08, 0x00]);
    frame.extend_from_slice(&ip);
    frame.extend_from_slice(&tcp);
    frame
}

/// The Internet checksum (RFC 1071).
fn checksum(bytes: &[u8]) -> u16 {
    let mut sum: u32 = bytes
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], c.get(1).copied().unwrap_or(0)])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// One message from the gateway into `frame`; `false` at its end. A
/// message longer than a frame is cut (the interface drops it).
fn recv_frame(conn: &OwnedFd, frame: &mut Vec<u8>) -> io::Result<bool> {
    frame.clear();
    let (n, _) = rustix::net::recv(
        conn,
        rustix::buffer::spare_capacity(frame),
        RecvFlags::DONTWAIT,
    )?;
    Ok(n > 0)
}

fn seqpacket() -> io::Result<OwnedFd> {
    Ok(rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )?)
}

/// Wakes a pump blocked in `poll` (a quiesce's first step).
pub fn wake(path: &Path) {
    if let Ok(s) = seqpacket() {
        if let Ok(addr) = SocketAddrUnix::new(path) {
            let _ = rustix::net::connect(&s, &addr);
        }
    }
}

// Route netlink: gVisor configures its interfaces this way, not with the
// SIOCSIF* ioctls a microVM's agent uses.
const RTM_NEWLINK: u16 = 16;
const RTM_NEWADDR: u16 = 20;
const RTM_NEWROUTE: u16 = 24;
const NLMSG_ERROR: u16 = 2;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_EXCL: u16 = 0x200;
const NLM_F_CREATE: u16 = 0x400;
const IFF_UP: u32 = 0x1;
const IFLA_ADDRESS: u16 = 1;
const IFLA_MTU: u16 = 4;
const IFA_ADDRESS: u16 = 1;
const IFA_LOCAL: u16 = 2;
const RTA_OIF: u16 = 4;
const RTA_GATEWAY: u16 = 5;
const AF_INET: u8 = 2;
const RT_TABLE_MAIN: u8 = 254;
const RTPROT_BOOT: u8 = 3;
const RTN_UNICAST: u8 = 1;

/// `eth0` up with the guest's MAC and MTU, its address, and the default
/// route.
fn configure() -> io::Result<()> {
    let index = sys::interface_index(IFNAME)?;
    let index_i32 = i32::try_from(index).map_err(io::Error::other)?;
    let mut link = Vec::new();
    link.extend_from_slice(&[0, 0, 0, 0]); // family, pad, type
    link.extend_from_slice(&index_i32.to_ne_bytes());
    link.extend_from_slice(&IFF_UP.to_ne_bytes()); // flags
    link.extend_from_slice(&IFF_UP.to_ne_bytes()); // change
    attr(&mut link, IFLA_ADDRESS, &GUEST_MAC);
    attr(&mut link, IFLA_MTU, &MTU.to_ne_bytes());
    request(RTM_NEWLINK, 0, &link)?;
    let mut addr = vec![AF_INET, PREFIX_LEN, 0, 0];
    addr.extend_from_slice(&index.to_ne_bytes());
    attr(&mut addr, IFA_LOCAL, &GUEST_IP.octets());
    attr(&mut addr, IFA_ADDRESS, &GUEST_IP.octets());
    request(RTM_NEWADDR, NLM_F_CREATE | NLM_F_EXCL, &addr)?;
    let mut route = vec![AF_INET, 0, 0, 0, RT_TABLE_MAIN, RTPROT_BOOT, 0, RTN_UNICAST];
    route.extend_from_slice(&0u32.to_ne_bytes()); // flags
    attr(&mut route, RTA_GATEWAY, &GATEWAY_IP.octets());
    attr(&mut route, RTA_OIF, &index_i32.to_ne_bytes());
    request(RTM_NEWROUTE, NLM_F_CREATE | NLM_F_EXCL, &route)
}

/// Appends one route attribute, padded to 4 bytes.
fn attr(msg: &mut Vec<u8>, kind: u16, data: &[u8]) {
    let len = u16::try_from(4 + data.len()).unwrap_or(u16::MAX);
    msg.extend_from_slice(&len.to_ne_bytes());
    msg.extend_from_slice(&kind.to_ne_bytes());
    msg.extend_from_slice(data);
    msg.resize(msg.len().next_multiple_of(4), 0);
}

/// Sends one request and reads its acknowledgement.
fn request(kind: u16, flags: u16, body: &[u8]) -> io::Result<()> {
    let sock = rustix::net::socket_with(
        AddressFamily::NETLINK,
        SocketType::RAW,
        SocketFlags::CLOEXEC,
        None, // NETLINK_ROUTE
    )?;
    let len = u32::try_from(16 + body.len()).map_err(io::Error::other)?;
    let mut msg = Vec::with_capacity(16 + body.len());
    msg.extend_from_slice(&len.to_ne_bytes());
    msg.extend_from_slice(&kind.to_ne_bytes());
    msg.extend_from_slice(&(flags | NLM_F_REQUEST | NLM_F_ACK).to_ne_bytes());
    msg.extend_from_slice(&1u32.to_ne_bytes()); // sequence
    msg.extend_from_slice(&0u32.to_ne_bytes()); // port: the kernel's
    msg.extend_from_slice(body);
    rustix::net::send(&sock, &msg, SendFlags::empty())?;
    let mut reply = [0u8; 1024];
    let (n, _) = rustix::net::recv(&sock, &mut reply, RecvFlags::empty())?;
    let reply = &reply[..n];
    let field = |at: usize, len: usize| reply.get(at..at + len);
    let kind = field(4, 2).map(|b| u16::from_ne_bytes([b[0], b[1]]));
    let errno = field(16, 4).map(|b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]));
    match (kind, errno) {
        (Some(NLMSG_ERROR), Some(0)) => Ok(()),
        (Some(NLMSG_ERROR), Some(e)) => Err(io::Error::from_raw_os_error(-e)),
        _ => Err(io::Error::other(format!(
            "unexpected netlink reply ({n} bytes)"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_net_tcp_lines_parse_addresses_ports_and_state() {
        let line = "   3: 0F02000A:9C4A 0202000A:0050 01 00000000:00000000 00:00000000 00000000  1000        0 42";
        let e = parse_tcp_line(line).expect("parsed");
        assert_eq!(e.local, "10.0.2.15:40010".parse().expect("an address"));
        assert_eq!(e.remote, "10.0.2.2:80".parse().expect("an address"));
        assert_eq!(e.state, 0x01);
        assert!(parse_tcp_line("  sl  local_address rem_address   st").is_none());
    }

    #[test]
    fn a_made_segment_parses_back_and_its_checksums_hold() {
        let (peer, sandbox) = (
            "93.184.216.34:443".parse().expect("an address"),
            "10.0.2.15:51000".parse().expect("an address"),
        );
        let frame = segment_to(GUEST_MAC, peer, sandbox, 0xdead_beef, TCP_SYN);
        let s = segment(&frame).expect("a TCP segment");
        assert_eq!((s.src, s.dst, s.flags), (peer, sandbox, TCP_SYN));
        assert_eq!(&frame[..6], &GUEST_MAC);
        assert_eq!(&frame[38..42], &0xdead_beef_u32.to_be_bytes());
        // A header with its checksum in place sums to zero.
        let ip = &frame[14..34];
        assert_eq!(checksum(ip), 0);
        let tcp = &frame[34..];
        let mut pseudo = Vec::new();
        pseudo.extend_from_slice(&ip[12..20]);
        pseudo.extend_from_slice(&[0, 6, 0, 20]);
        pseudo.extend_from_slice(tcp);
        assert_eq!(checksum(&pseudo), 0);
    }

    #[test]
    fn conns_track_the_sandboxs_acks_until_a_rst_either_way() {
        let (peer, sandbox): (SocketAddrV4, SocketAddrV4) = (
            "10.0.2.2:8080".parse().expect("an address"),
            "10.0.2.15:40000".parse().expect("an address"),
        );
        let mut conns = Conns::default();
        // The sandbox's ACK (a made segment with the ACK flag, its ack
        // field left zero).
        conns.sent(&segment_to(GUEST_MAC, sandbox, peer, 7, TCP_ACK));
        assert_eq!(conns.open.len(), 1);
        conns.received(&segment_to(GUEST_MAC, peer, sandbox, 0, TCP_RST));
        assert!(conns.open.is_empty());
        conns.sent(&segment_to(GUEST_MAC, sandbox, peer, 7, TCP_ACK));
        conns.sent(&segment_to(GUEST_MAC, sandbox, peer, 8, TCP_RST));
        assert!(conns.open.is_empty());
        // Not TCP, or too short: ignored.
        conns.sent(&[0u8; 20]);
        assert!(conns.open.is_empty());
    }
}
