//! virtio-vsock (device 19) with a userspace "hybrid vsock" backend.
//!
//! The host reaches guest ports through one unix socket: a client connects
//! to `uds_path`, writes `CONNECT <port>\n`, and once the guest accepts it
//! reads `OK <local port>\n`; from then on the unix stream carries the
//! connection's bytes both ways. A guest RST (or no listener) closes the
//! stream; the client sees EOF and may retry. Guest-initiated connections
//! are refused with RST.
//!
//! Layout: [`packet`] (the 44-byte header, sans-IO), [`conn`] (one
//! connection's state and credit accounting, sans-IO), and this module: the
//! device, which moves bytes between virtqueues and unix streams.
//!
//! Bounds: at most [`MAX_CONNECTIONS`] streams; per connection at most
//! [`CONN_BUF_ALLOC`] host-bound bytes buffered (that is the credit the guest
//! gets, and a guest that overruns it is reset); host-bound data is read from
//! a stream only into a guest rx buffer, and only while the guest has credit
//! and rx buffers, so nothing accumulates on the host side.
//!
//! Data moves between guest memory and sockets without an intermediate copy
//! (`read`/`write` straight on guest memory slices), except for host-bound
//! bytes the host stream could not take at once.
//!
//! The device's epoll fd (listener + every stream, edge-triggered; EPOLLOUT
//! only while a stream has pending bytes) is its [`EventSource`] fd.
//!
//! Writes to a stream whose peer has gone raise SIGPIPE; Rust binaries
//! ignore SIGPIPE by default, so this surfaces as EPIPE and resets the
//! connection.

pub mod conn;
pub mod packet;
#[cfg(test)]
mod tests;

use std::borrow::Cow;
use std::collections::{HashMap, VecDeque};
use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;

use virtio_bindings::virtio_ids::VIRTIO_ID_VSOCK;
use virtio_queue::Queue;
use vm_memory::{GuestMemory as _, Permissions, ReadVolatile, VolatileMemoryError, WriteVolatile};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use self::conn::{Action, Conn};
use self::packet::{Header, Op, HDR_LEN, HOST_CID, MAX_PKT_LEN};
use crate::virtio::chain::{Chain, Regions};
use crate::virtio::mmio::VIRTIO_F_VERSION_1;
use crate::virtio::persist::{DeviceState, RestoreError, VsockState};
use crate::virtio::{ActivateError, Budget, VirtioDevice};
use crate::{EventSource, GuestMemory, Interrupt, Work};

/// Host connections this process's vsock devices have taken (one VM per
/// VMM process), for the VMM's counters; it resets this in a fork child.
pub static HOST_CONNECTIONS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Queue indices.
pub const RX_QUEUE: u16 = 0;
pub const TX_QUEUE: u16 = 1;
pub const EVENT_QUEUE: u16 = 2;
/// Size of each queue.
pub const QUEUE_SIZE: u16 = 256;
/// Most host connections at once; more are accepted and closed at once.
pub const MAX_CONNECTIONS: usize = 1024;
/// Receive buffer we advertise per connection, and the most host-bound
/// bytes we ever buffer for one.
pub const CONN_BUF_ALLOC: u32 = 256 * 1024;
/// Longest `CONNECT <port>\n` line.
const MAX_CONNECT_LINE: usize = 64;
/// Most RSTs for unknown connections waiting for rx buffers.
const MAX_PENDING_RST: usize = 1024;
/// First local port we hand out; epoll tokens below it are not streams.
const FIRST_PORT: u32 = 1024;
const LISTENER_TOKEN: u64 = 0;
/// Name in log lines.
const DEVICE: &str = "virtio-vsock";

/// Why the vsock device could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum VsockError {
    #[error("cannot listen on {path}")]
    Bind {
        path: std::path::PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot make the host side's listener non-blocking")]
    Listener(#[source] io::Error),
    #[error("cannot set up the device's epoll instance")]
    Epoll(#[source] io::Error),
}

impl From<VsockError> for io::Error {
    fn from(e: VsockError) -> io::Error {
        io::Error::other(e)
    }
}

/// The rx, tx and event queues, in that order. The event queue is held so
/// the driver's setup stays valid; we send no events.
type Active = crate::virtio::Active<3>;
const RX: usize = RX_QUEUE as usize;
const TX: usize = TX_QUEUE as usize;

/// One accepted unix stream.
struct HostConn {
    stream: UnixStream,
    /// `None` until the `CONNECT` line has arrived.
    conn: Option<Conn>,
    line: Vec<u8>,
    /// Host bytes that arrived with the `CONNECT` line: sent first.
    prefix: Vec<u8>,
    /// Guest bytes the stream has not taken yet (`to_host[pos..]`).
    to_host: Vec<u8>,
    pos: usize,
    /// The stream may have bytes to read (edge-triggered epoll).
    readable: bool,
    /// EPOLLOUT is registered.
    want_out: bool,
    /// In `rx_sched`.
    scheduled: bool,
    /// Shut the stream's write side once `to_host` drains.
    shut_write: bool,
}

impl HostConn {
    fn pending_to_host(&self) -> usize {
        self.to_host.len() - self.pos
    }

    fn has_host_data(&self) -> bool {
        self.readable || !self.prefix.is_empty()
    }

    fn wants_rx(&self) -> bool {
        match &self.conn {
            None => false,
            Some(c) => {
                c.has_pending_control()
                    || (c.can_send_data() && self.has_host_data() && c.peer_credit() > 0)
            }
        }
    }
}

/// Everything but the queues, so queue and backend borrow separately.
struct Backend {
    guest_cid: u64,
    listener: UnixListener,
    epoll: Epoll,
    conns: HashMap<u32, HostConn>,
    next_port: u32,
    /// Connections with something for the guest, round robin.
    rx_sched: VecDeque<u32>,
    /// RSTs for packets that matched no connection.
    rst_queue: VecDeque<Header>,
}

/// Outcome of reading a stream into guest buffers.
enum Filled {
    Data(usize),
    Eof,
    WouldBlock,
}

fn volatile_to_io(e: VolatileMemoryError) -> io::Error {
    match e {
        VolatileMemoryError::IOError(e) => e,
        other => io::Error::other(other),
    }
}

/// Reads from `stream` straight into `regions[off..off + max]`.
fn read_into_guest(
    stream: &mut UnixStream,
    mem: &GuestMemory,
    regions: &Regions,
    off: u64,
    max: u64,
) -> io::Result<Filled> {
    let mut total = 0usize;
    for piece in regions.pieces(off, max) {
        let slices = mem
            .get_slices(piece.addr, piece.len as usize, Permissions::Write)
            .map_err(io::Error::other)?;
        for slice in slices {
            let mut slice = slice.map_err(io::Error::other)?;
            let want = slice.len();
            match stream.read_volatile(&mut slice) {
                Ok(0) if total == 0 => return Ok(Filled::Eof),
                Ok(0) => return Ok(Filled::Data(total)),
                Ok(n) => {
                    total += n;
                    if n < want {
                        return Ok(Filled::Data(total));
                    }
                }
                Err(e) => {
                    let e = volatile_to_io(e);
                    return match e.kind() {
                        _ if total > 0 => Ok(Filled::Data(total)),
                        io::ErrorKind::WouldBlock => Ok(Filled::WouldBlock),
                        io::ErrorKind::Interrupted => Ok(Filled::Data(0)),
                        _ => Err(e),
                    };
                }
            }
        }
    }
    Ok(Filled::Data(total))
}

/// Writes `regions[off..off + len]` straight from guest memory to `stream`;
/// returns how many bytes it took before it would block.
fn write_from_guest(
    stream: &mut UnixStream,
    mem: &GuestMemory,
    regions: &Regions,
    off: u64,
    len: u64,
) -> io::Result<usize> {
    let mut total = 0usize;
    for piece in regions.pieces(off, len) {
        let slices = mem
            .get_slices(piece.addr, piece.len as usize, Permissions::Read)
            .map_err(io::Error::other)?;
        for slice in slices {
            let mut slice = slice.map_err(io::Error::other)?;
            while !slice.is_empty() {
                match stream.write_volatile(&slice) {
                    Ok(0) => return Ok(total),
                    Ok(n) => {
                        total += n;
                        slice = slice.offset(n).map_err(io::Error::other)?;
                    }
                    Err(e) => {
                        let e = volatile_to_io(e);
                        return match e.kind() {
                            io::ErrorKind::Interrupted => continue,
                            io::ErrorKind::WouldBlock => Ok(total),
                            _ if total > 0 => Ok(total),
                            _ => Err(e),
                        };
                    }
                }
            }
        }
    }
    Ok(total)
}

fn parse_connect_line(line: &[u8]) -> Option<u32> {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let rest = line.strip_prefix(b"CONNECT ")?;
    std::str::from_utf8(rest).ok()?.trim().parse().ok()
}

fn stream_events(want_out: bool) -> EventSet {
    let base = EventSet::IN | EventSet::READ_HANG_UP | EventSet::EDGE_TRIGGERED;
    if want_out {
        base | EventSet::OUT
    } else {
        base
    }
}

impl Backend {
    fn push_rst(&mut self, h: Header) {
        if self.rst_queue.len() < MAX_PENDING_RST {
            self.rst_queue.push_back(h);
        } else {
            tracing::debug!("vsock: dropping an RST, too many pending");
        }
    }

    fn schedule(&mut self, port: u32) {
        let Some(hc) = self.conns.get_mut(&port) else {
            return;
        };
        let has_data = hc.has_host_data();
        if let Some(c) = hc.conn.as_mut() {
            if c.can_send_data() && has_data && c.peer_credit() == 0 {
                c.want_credit();
            }
        }
        if !hc.scheduled && hc.wants_rx() {
            hc.scheduled = true;
            self.rx_sched.push_back(port);
        }
    }

    /// Drops a connection (closing its stream); `rst` says whether the
    /// guest is owed an RST for it.
    fn close(&mut self, port: u32, rst: bool) {
        let Some(mut hc) = self.conns.remove(&port) else {
            return;
        };
        tracing::debug!(port, rst, "vsock: closing a host stream");
        if let Err(e) = self.epoll.ctl(
            ControlOperation::Delete,
            hc.stream.as_raw_fd(),
            EpollEvent::default(),
        ) {
            tracing::debug!("vsock: epoll delete: {e}");
        }
        if rst {
            if let Some(c) = hc.conn.as_mut() {
                let h = c.rst();
                self.push_rst(h);
            }
        }
    }

    fn set_want_out(&mut self, port: u32, want: bool) {
        let Some(hc) = self.conns.get_mut(&port) else {
            return;
        };
        if hc.want_out == want {
            return;
        }
        hc.want_out = want;
        let ev = EpollEvent::new(stream_events(want), u64::from(port));
        if let Err(e) = self
            .epoll
            .ctl(ControlOperation::Modify, hc.stream.as_raw_fd(), ev)
        {
            tracing::warn!("vsock: epoll modify: {e}");
        }
    }

    fn alloc_port(&mut self) -> u32 {
        loop {
            let p = self.next_port;
            self.next_port = self.next_port.checked_add(1).unwrap_or(FIRST_PORT);
            if !self.conns.contains_key(&p) {
                return p;
            }
        }
    }

    fn accept_all(&mut self) {
        loop {
            let stream = match self.listener.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::warn!("vsock: accept: {e}");
                    return;
                }
            };
            if self.conns.len() >= MAX_CONNECTIONS {
                tracing::warn!("vsock: connection limit reached, closing a new client");
                continue;
            }
            if let Err(e) = stream.set_nonblocking(true) {
                tracing::warn!("vsock: set_nonblocking: {e}");
                continue;
            }
            let port = self.alloc_port();
            let ev = EpollEvent::new(stream_events(false), u64::from(port));
            if let Err(e) = self
                .epoll
                .ctl(ControlOperation::Add, stream.as_raw_fd(), ev)
            {
                tracing::warn!("vsock: epoll add: {e}");
                continue;
            }
            self.conns.insert(
                port,
                HostConn {
                    stream,
                    conn: None,
                    line: Vec::new(),
                    prefix: Vec::new(),
                    to_host: Vec::new(),
                    pos: 0,
                    readable: true,
                    want_out: false,
                    scheduled: false,
                    shut_write: false,
                },
            );
            HOST_CONNECTIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            self.read_connect_line(port);
        }
    }

    /// Reads the `CONNECT <port>\n` line of a new client.
    fn read_connect_line(&mut self, port: u32) {
        let guest_cid = self.guest_cid;
        let Some(hc) = self.conns.get_mut(&port) else {
            return;
        };
        let mut buf = [0u8; MAX_CONNECT_LINE];
        let peer_port = loop {
            let room = MAX_CONNECT_LINE - hc.line.len();
            if room == 0 {
                tracing::debug!("vsock: CONNECT line too long");
                return self.close(port, false);
            }
            match hc.stream.read(&mut buf[..room]) {
                Ok(0) => return self.close(port, false),
                Ok(n) => {
                    let start = hc.line.len();
                    hc.line.extend_from_slice(&buf[..n]);
                    if let Some(i) = hc.line[start..].iter().position(|&b| b == b'\n') {
                        let nl = start + i;
                        hc.prefix = hc.line[nl + 1..].to_vec();
                        let parsed = parse_connect_line(&hc.line[..nl]);
                        hc.line = Vec::new();
                        match parsed {
                            Some(p) => break p,
                            None => {
                                tracing::debug!("vsock: bad CONNECT line");
                                return self.close(port, false);
                            }
                        }
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    hc.readable = false;
                    return;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return self.close(port, false),
            }
        };
        hc.conn = Some(Conn::connect(guest_cid, port, peer_port, CONN_BUF_ALLOC));
        self.schedule(port);
    }

    /// Writes pending guest bytes to the stream.
    fn flush(&mut self, port: u32) {
        let Some(hc) = self.conns.get_mut(&port) else {
            return;
        };
        let mut written = 0usize;
        let mut failed = false;
        while hc.pos < hc.to_host.len() {
            match hc.stream.write(&hc.to_host[hc.pos..]) {
                Ok(0) => break,
                Ok(n) => {
                    hc.pos += n;
                    written += n;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(_) => {
                    failed = true;
                    break;
                }
            }
        }
        if let Some(c) = hc.conn.as_mut() {
            // `written` <= CONN_BUF_ALLOC, a u32.
            c.forwarded(u32::try_from(written).unwrap_or(u32::MAX));
        }
        if failed {
            return self.close(port, true);
        }
        let drained = hc.pos == hc.to_host.len();
        if drained {
            hc.to_host.clear();
            hc.pos = 0;
            if hc.shut_write {
                hc.shut_write = false;
                let _ = hc.stream.shutdown(Shutdown::Write);
            }
        } else if hc.pos > hc.to_host.len() / 2 {
            hc.to_host.drain(..hc.pos);
            hc.pos = 0;
        }
        self.set_want_out(port, !drained);
        self.finish_if_done(port);
        self.schedule(port);
    }

    /// Drops a connection whose both directions are over, once its
    /// host-bound bytes are out.
    fn finish_if_done(&mut self, port: u32) {
        let done = self.conns.get(&port).is_some_and(|hc| {
            hc.pending_to_host() == 0 && hc.conn.as_ref().is_some_and(Conn::is_done)
        });
        if done {
            self.close(port, true);
        }
    }

    /// Handles one packet the guest sent on the tx queue.
    fn on_guest_packet(&mut self, mem: &GuestMemory, chain: &Chain, irq: &Interrupt) {
        let mut hb = [0u8; HDR_LEN];
        let hdr = match chain.readable.read_at(mem, 0, &mut hb) {
            Ok(HDR_LEN) => match Header::parse(&hb) {
                Ok(h) => h,
                Err(e) => return irq.guest_error(DEVICE, &e),
            },
            Ok(n) => return irq.guest_error(DEVICE, &format_args!("tx packet of {n} bytes")),
            Err(e) => return irq.guest_error(DEVICE, &e),
        };
        if chain.readable.len() > (HDR_LEN as u64) + u64::from(MAX_PKT_LEN) {
            // Linux never sends more than MAX_PKT_LEN in one packet; only
            // the header is read, but a bigger one is refused as such.
            irq.guest_error(
                DEVICE,
                &format_args!("tx packet of {} bytes", chain.readable.len()),
            );
            if hdr.src_cid != self.guest_cid || hdr.dst_cid != HOST_CID {
                // Not ours to answer: an RST built from it would carry
                // the guest's made-up CIDs (found by fuzzing).
                return;
            }
            let known = self
                .conns
                .get(&hdr.dst_port)
                .and_then(|hc| hc.conn.as_ref())
                .is_some_and(|c| c.matches(&hdr));
            if known {
                self.close(hdr.dst_port, true);
            } else if hdr.op() != Some(Op::Rst) {
                self.push_rst(hdr.reply(Op::Rst));
            }
            return;
        }
        if hdr.src_cid != self.guest_cid || hdr.dst_cid != HOST_CID {
            return tracing::debug!(
                src = hdr.src_cid,
                dst = hdr.dst_cid,
                "vsock: packet with wrong CIDs"
            );
        }
        let payload = chain.readable.len().saturating_sub(HDR_LEN as u64);
        let payload = u32::try_from(payload.min(u64::from(MAX_PKT_LEN))).unwrap_or(MAX_PKT_LEN);
        let port = hdr.dst_port;
        let known = self
            .conns
            .get(&port)
            .and_then(|hc| hc.conn.as_ref())
            .is_some_and(|c| c.matches(&hdr));
        if !known {
            if hdr.op() != Some(Op::Rst) {
                // Includes guest-initiated REQUESTs: refused for now.
                self.push_rst(hdr.reply(Op::Rst));
            }
            return;
        }
        let Some(hc) = self.conns.get_mut(&port) else {
            return;
        };
        let pending = hc.pending_to_host();
        let Some(c) = hc.conn.as_mut() else {
            return;
        };
        match c.on_packet(&hdr, payload) {
            Action::None => {}
            Action::Established => {
                let line = format!("OK {port}\n");
                // The stream is fresh: a short line always fits its buffer.
                if hc.stream.write(line.as_bytes()).ok() != Some(line.len()) {
                    return self.close(port, true);
                }
            }
            Action::Data { len } => {
                if pending == 0 {
                    let n = match write_from_guest(
                        &mut hc.stream,
                        mem,
                        &chain.readable,
                        HDR_LEN as u64,
                        u64::from(len),
                    ) {
                        Ok(n) => n,
                        Err(_) => return self.close(port, true),
                    };
                    c.forwarded(u32::try_from(n).unwrap_or(len));
                    let rest = (len as usize).saturating_sub(n);
                    if rest > 0 {
                        hc.to_host.clear();
                        hc.to_host.resize(rest, 0);
                        if let Err(e) =
                            chain
                                .readable
                                .read_at(mem, (HDR_LEN + n) as u64, &mut hc.to_host)
                        {
                            tracing::debug!("vsock: {e}");
                            return self.close(port, true);
                        }
                        hc.pos = 0;
                        self.set_want_out(port, true);
                    }
                } else {
                    let old = hc.to_host.len();
                    hc.to_host.resize(old + len as usize, 0);
                    if let Err(e) =
                        chain
                            .readable
                            .read_at(mem, HDR_LEN as u64, &mut hc.to_host[old..])
                    {
                        tracing::debug!("vsock: {e}");
                        return self.close(port, true);
                    }
                    return self.flush(port);
                }
            }
            Action::PeerSendShutdown => {
                if pending == 0 {
                    let _ = hc.stream.shutdown(Shutdown::Write);
                } else {
                    hc.shut_write = true;
                }
            }
            Action::Close { reply } => {
                tracing::debug!(port, op = ?hdr.op(), "vsock: the guest ends a connection");
                return self.close(port, reply);
            }
        }
        self.finish_if_done(port);
        self.schedule(port);
    }

    /// Fills guest rx buffers with what connections owe the guest, within
    /// one turn's budget.
    fn fill_rx(&mut self, a: &mut Active) -> Work {
        let mut used = false;
        let mut budget = Budget::default();
        let mut work = Work::Done;
        // Buffers handed back unused in a row: a guard against spinning on
        // a connection that keeps asking and then has nothing.
        let mut idle = 0usize;
        loop {
            if budget.exhausted() {
                work = Work::More;
                break;
            }
            // Pick what to send before taking a buffer for it.
            let port = if self.rst_queue.is_empty() {
                match self.rx_sched.pop_front() {
                    Some(p) => {
                        let Some(hc) = self.conns.get_mut(&p) else {
                            continue;
                        };
                        hc.scheduled = false;
                        if !hc.wants_rx() {
                            continue;
                        }
                        Some(p)
                    }
                    None => break,
                }
            } else {
                None
            };
            let Some((head, chain)) = a.pop(RX) else {
                if let Some(p) = port {
                    self.schedule(p);
                }
                break;
            };
            budget.spend_chain(&chain);
            let chain = match chain {
                Ok(c) if c.writable.len() > HDR_LEN as u64 => c,
                Ok(c) => {
                    a.interrupt.guest_error(
                        DEVICE,
                        &format_args!("rx buffer of {} bytes", c.writable.len()),
                    );
                    Self::add_used(a, head, 0);
                    used = true;
                    if let Some(p) = port {
                        self.schedule(p);
                    }
                    continue;
                }
                Err(e) => {
                    a.interrupt.guest_error(DEVICE, &e);
                    Self::add_used(a, head, 0);
                    used = true;
                    if let Some(p) = port {
                        self.schedule(p);
                    }
                    continue;
                }
            };
            let Some(port) = port else {
                if let Some(h) = self.rst_queue.pop_front() {
                    Self::write_packet(a, &chain, &h, 0);
                    used = true;
                }
                continue;
            };
            match self.fill_one(a, &chain, port) {
                Some(len) => {
                    Self::add_used(a, head, len);
                    used = true;
                    idle = 0;
                }
                None => {
                    a.unpop(RX);
                    idle += 1;
                }
            }
            self.finish_if_done(port);
            self.schedule(port);
            if idle > self.conns.len() + 1 {
                break;
            }
        }
        if used {
            a.interrupt.signal_used_queue();
        }
        work
    }

    fn add_used(a: &mut Active, head: u16, len: u32) {
        a.add_used(RX, head, len);
    }

    /// Writes a header-only packet and returns the buffer.
    fn write_packet(a: &mut Active, chain: &Chain, h: &Header, payload: u32) {
        match chain.writable.write_at(&a.mem, 0, &h.to_bytes()) {
            Ok(HDR_LEN) => Self::add_used(a, chain.head, HDR_LEN as u32 + payload),
            _ => Self::add_used(a, chain.head, 0),
        }
    }

    /// Puts one packet of connection `port` in `chain`; returns its length,
    /// or `None` if there was nothing to send after all (the buffer goes
    /// back to the ring).
    fn fill_one(&mut self, a: &mut Active, chain: &Chain, port: u32) -> Option<u32> {
        let hc = self.conns.get_mut(&port)?;
        let c = hc.conn.as_mut()?;
        let hdr = if let Some(h) = c.next_control() {
            h
        } else {
            if !c.can_send_data() {
                return None;
            }
            let room = chain.writable.len() - HDR_LEN as u64;
            let max = room
                .min(u64::from(c.peer_credit()))
                .min(u64::from(MAX_PKT_LEN));
            if max == 0 {
                return None;
            }
            let n = if hc.prefix.is_empty() {
                match read_into_guest(&mut hc.stream, &a.mem, &chain.writable, HDR_LEN as u64, max)
                {
                    Ok(Filled::Data(0)) => return None,
                    Ok(Filled::Data(n)) => n,
                    Ok(Filled::WouldBlock) => {
                        hc.readable = false;
                        return None;
                    }
                    Ok(Filled::Eof) => {
                        hc.readable = false;
                        c.host_eof();
                        let h = c.next_control()?;
                        return Self::emit(a, chain, &h);
                    }
                    Err(e) => {
                        tracing::debug!("vsock: stream read: {e}");
                        self.close(port, true);
                        return None;
                    }
                }
            } else {
                let n = hc.prefix.len().min(max as usize);
                if chain
                    .writable
                    .write_at(&a.mem, HDR_LEN as u64, &hc.prefix[..n])
                    .is_err()
                {
                    self.close(port, true);
                    return None;
                }
                hc.prefix.drain(..n);
                n
            };
            // n <= MAX_PKT_LEN.
            c.data_header(u32::try_from(n).unwrap_or(MAX_PKT_LEN))
        };
        Self::emit(a, chain, &hdr)
    }

    fn emit(a: &mut Active, chain: &Chain, h: &Header) -> Option<u32> {
        match chain.writable.write_at(&a.mem, 0, &h.to_bytes()) {
            Ok(HDR_LEN) => Some(HDR_LEN as u32 + h.len),
            _ => Some(0),
        }
    }

    fn handle_events(&mut self) {
        let mut events = [EpollEvent::default(); 64];
        loop {
            let n = match self.epoll.wait(0, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::warn!("vsock: epoll wait: {e}");
                    return;
                }
            };
            for ev in &events[..n] {
                if ev.data() == LISTENER_TOKEN {
                    self.accept_all();
                    continue;
                }
                let Ok(port) = u32::try_from(ev.data()) else {
                    continue;
                };
                let set = ev.event_set();
                let Some(hc) = self.conns.get_mut(&port) else {
                    continue;
                };
                if set.intersects(
                    EventSet::IN | EventSet::READ_HANG_UP | EventSet::HANG_UP | EventSet::ERROR,
                ) {
                    hc.readable = true;
                    if hc.conn.is_none() {
                        self.read_connect_line(port);
                        continue;
                    }
                }
                if set.intersects(EventSet::OUT | EventSet::HANG_UP | EventSet::ERROR)
                    && hc.pending_to_host() > 0
                {
                    self.flush(port);
                }
                self.schedule(port);
            }
            if n < events.len() {
                return;
            }
        }
    }

    fn close_all(&mut self, rst: bool) {
        let ports: Vec<u32> = self.conns.keys().copied().collect();
        for p in ports {
            self.close(p, rst);
        }
        self.rx_sched.clear();
        if !rst {
            self.rst_queue.clear();
        }
    }
}

/// `listener`, made non-blocking, and an epoll instance watching it.
fn watch(listener: UnixListener) -> Result<(UnixListener, Epoll), VsockError> {
    listener
        .set_nonblocking(true)
        .map_err(VsockError::Listener)?;
    let epoll = Epoll::new().map_err(VsockError::Epoll)?;
    epoll
        .ctl(
            ControlOperation::Add,
            listener.as_raw_fd(),
            EpollEvent::new(EventSet::IN, LISTENER_TOKEN),
        )
        .map_err(VsockError::Epoll)?;
    Ok((listener, epoll))
}

/// The virtio-vsock device.
pub struct Vsock {
    backend: Backend,
    config: [u8; 8],
    acked_features: u64,
    active: Option<Active>,
}

impl Vsock {
    /// A device for a guest with CID `guest_cid` whose host side listens
    /// on the unix socket `uds_path` (which must not exist yet).
    pub fn new(guest_cid: u64, uds_path: &Path) -> io::Result<Vsock> {
        let listener = UnixListener::bind(uds_path).map_err(|source| VsockError::Bind {
            path: uds_path.to_path_buf(),
            source,
        })?;
        Vsock::with_listener(guest_cid, listener)
    }

    /// A device for a guest with CID `guest_cid` whose host side is
    /// `listener`, bound and listening already (by a process that could
    /// still reach its path).
    pub fn with_listener(guest_cid: u64, listener: UnixListener) -> io::Result<Vsock> {
        let (listener, epoll) = watch(listener)?;
        Ok(Vsock {
            backend: Backend {
                guest_cid,
                listener,
                epoll,
                conns: HashMap::new(),
                next_port: FIRST_PORT,
                rx_sched: VecDeque::new(),
                rst_queue: VecDeque::new(),
            },
            config: guest_cid.to_le_bytes(),
            acked_features: 0,
            active: None,
        })
    }

    pub fn guest_cid(&self) -> u64 {
        self.backend.guest_cid
    }

    /// Number of open host streams (including ones still sending their
    /// `CONNECT` line).
    pub fn connection_count(&self) -> usize {
        self.backend.conns.len()
    }

    /// Resets every connection: the guest gets an RST for each, the host
    /// clients see EOF.
    pub fn reset_connections(&mut self) {
        self.backend.close_all(true);
        let _ = self.process_rx();
    }

    fn process_rx(&mut self) -> Work {
        match self.active.as_mut() {
            Some(a) => self.backend.fill_rx(a),
            None => Work::Done,
        }
    }

    fn process_tx(&mut self) -> Work {
        let Some(a) = self.active.as_mut() else {
            return Work::Done;
        };
        let irq = a.interrupt.clone();
        let (used, work) = a.serve(TX, |mem, chain| {
            match chain {
                Ok(chain) => self.backend.on_guest_packet(mem, &chain, &irq),
                Err(e) => irq.guest_error(DEVICE, &e),
            }
            0
        });
        if used {
            a.interrupt.signal_used_queue();
        }
        work | self.process_rx()
    }
}

impl EventSource for Vsock {
    fn event_fd(&self) -> Option<RawFd> {
        Some(self.backend.epoll.as_raw_fd())
    }

    fn handle_events(&mut self) -> Work {
        self.backend.handle_events();
        self.process_rx()
    }
}

impl VirtioDevice for Vsock {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_VSOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE; 3]
    }

    fn features(&self) -> u64 {
        VIRTIO_F_VERSION_1
    }

    fn ack_features(&mut self, features: u64) {
        self.acked_features = features & self.features();
    }

    /// `guest_cid` (le64).
    fn config_space(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.config)
    }

    fn activate(
        &mut self,
        mem: GuestMemory,
        queues: Vec<Queue>,
        interrupt: Interrupt,
    ) -> Result<(), ActivateError> {
        self.active = Some(Active::new(mem, queues, interrupt, self.acked_features)?);
        // Connections may have arrived before the driver was ready.
        let _ = self.process_tx();
        Ok(())
    }

    fn queue_notify(&mut self, index: u16) -> Work {
        match index {
            RX_QUEUE => self.process_rx(),
            TX_QUEUE => self.process_tx(),
            _ => Work::Done,
        }
    }

    fn reset(&mut self) {
        self.backend.close_all(false);
        self.active = None;
        self.acked_features = 0;
    }

    fn save(&self) -> DeviceState {
        let b = &self.backend;
        // Every connection the guest knows of ends with an RST in the
        // restored device: its host stream belongs to this process.
        let mut rsts: Vec<Vec<u8>> = b.rst_queue.iter().map(|h| h.to_bytes().to_vec()).collect();
        let mut ports: Vec<&u32> = b.conns.keys().collect();
        ports.sort();
        for port in ports {
            if let Some(c) = b.conns.get(port).and_then(|hc| hc.conn.as_ref()) {
                let mut c = c.clone();
                rsts.push(c.rst().to_bytes().to_vec());
            }
        }
        DeviceState::Vsock(VsockState {
            guest_cid: b.guest_cid,
            acked_features: self.acked_features,
            queues: self.active.as_ref().map(Active::save),
            next_port: b.next_port,
            pending_rsts: rsts,
        })
    }

    fn restore(
        &mut self,
        mem: GuestMemory,
        interrupt: Interrupt,
        state: &DeviceState,
    ) -> Result<(), RestoreError> {
        let DeviceState::Vsock(state) = state else {
            return Err(state.wrong_device("vsock"));
        };
        self.acked_features = state.acked_features & self.features();
        self.backend.next_port = state.next_port.max(FIRST_PORT);
        for raw in &state.pending_rsts {
            let h = Header::parse(raw).map_err(|_| RestoreError::BadHeader(raw.len()))?;
            self.backend.push_rst(h);
        }
        self.active =
            Active::restore(mem, interrupt, state.queues.as_deref(), self.acked_features)?;
        if self.active.is_some() {
            // Packets the guest queued (and kicked through the old
            // process's ioeventfd) before the capture, then the RSTs.
            let _ = self.process_tx();
        }
        Ok(())
    }
}
