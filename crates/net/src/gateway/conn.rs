//! One relayed TCP connection: the smoltcp socket facing the guest and the
//! host-side stream the [`Connector`](super::Connector) opened, and the
//! bytes moved between them.
//!
//! Backpressure is TCP's own: bytes leave smoltcp's receive buffer only as
//! fast as the host stream takes them, so a slow destination closes the
//! guest's window instead of growing a queue here; host bytes are read
//! only into free room in smoltcp's send buffer.

use std::io::{self, ErrorKind, Read, Write};
use std::net::SocketAddrV4;
use std::time::Duration;

use smoltcp::iface::SocketHandle;
use smoltcp::socket::tcp::{self, State};

use super::ConnId;
use crate::log::EgressRecord;

/// The host side of a connection: a connected, non-blocking byte stream
/// (`read`/`write` answer `WouldBlock` when they cannot make progress;
/// `read` answers `Ok(0)` at end of stream). `Send`: the VMM's devices
/// (and so the gateway behind its virtio-net) move between threads.
pub trait HostStream: Read + Write + Send {
    /// Close the write half: the guest sent FIN.
    fn shutdown_write(&mut self) -> io::Result<()>;
}

impl HostStream for std::net::TcpStream {
    fn shutdown_write(&mut self) -> io::Result<()> {
        self.shutdown(std::net::Shutdown::Write)
    }
}

impl HostStream for std::os::unix::net::UnixStream {
    fn shutdown_write(&mut self) -> io::Result<()> {
        self.shutdown(std::net::Shutdown::Write)
    }
}

/// Who opened a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Direction {
    /// The guest, to a destination its policy allows: logged.
    Outbound,
    /// The daemon, to a port of the guest (the ports API): not egress.
    Inbound,
}

/// A connection past its SYN.
pub(super) struct Conn {
    pub id: ConnId,
    pub direction: Direction,
    pub handle: SocketHandle,
    pub key: (SocketAddrV4, SocketAddrV4),
    pub stream: Box<dyn HostStream>,
    /// Filled in as bytes move; logged when the connection ends.
    pub record: EgressRecord,
    pub started: Duration,
    host_eof: bool,
    guest_eof: bool,
}

/// Whether a connection is still worth keeping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Progress {
    Open,
    Done,
}

impl Conn {
    pub fn new(
        id: ConnId,
        direction: Direction,
        handle: SocketHandle,
        key: (SocketAddrV4, SocketAddrV4),
        stream: Box<dyn HostStream>,
        record: EgressRecord,
        started: Duration,
    ) -> Self {
        Self {
            id,
            direction,
            handle,
            key,
            stream,
            record,
            started,
            host_eof: false,
            guest_eof: false,
        }
    }

    /// Move every byte that can move now, both ways, and pass on FINs.
    pub fn relay(&mut self, sock: &mut tcp::Socket<'_>) -> Progress {
        if let Err(e) = self
            .guest_to_host(sock)
            .and_then(|_| self.host_to_guest(sock))
        {
            self.record.error = Some(e.to_string());
            sock.abort();
            return Progress::Done;
        }
        match sock.state() {
            State::Closed | State::TimeWait => Progress::Done,
            _ => Progress::Open,
        }
    }

    fn guest_to_host(&mut self, sock: &mut tcp::Socket<'_>) -> io::Result<()> {
        let stream = &mut self.stream;
        while sock.can_recv() {
            let moved = sock.recv(|buf| match stream.write(buf) {
                Ok(n) => (n, Ok(n)),
                Err(e) => (0, Err(e)),
            });
            match moved {
                Ok(Ok(0)) => return Err(ErrorKind::WriteZero.into()),
                Ok(Ok(n)) => self.record.bytes_out += n as u64,
                Ok(Err(e)) if e.kind() == ErrorKind::WouldBlock => break,
                Ok(Err(e)) if e.kind() == ErrorKind::Interrupted => continue,
                Ok(Err(e)) => return Err(e),
                Err(_) => break,
            }
        }
        let guest_closed = matches!(
            sock.state(),
            State::CloseWait | State::LastAck | State::Closing | State::TimeWait | State::Closed
        );
        if guest_closed && sock.recv_queue() == 0 && !self.guest_eof {
            self.guest_eof = true;
            // The host may already be gone; the connection ends either way.
            let _ = stream.shutdown_write();
        }
        Ok(())
    }

    fn host_to_guest(&mut self, sock: &mut tcp::Socket<'_>) -> io::Result<()> {
        let stream = &mut self.stream;
        while !self.host_eof && sock.can_send() {
            let moved = sock.send(|buf| match stream.read(buf) {
                Ok(n) => (n, Ok(n)),
                Err(e) => (0, Err(e)),
            });
            match moved {
                Ok(Ok(0)) => {
                    self.host_eof = true;
                    sock.close();
                }
                Ok(Ok(n)) => self.record.bytes_in += n as u64,
                Ok(Err(e)) if e.kind() == ErrorKind::WouldBlock => break,
                Ok(Err(e)) if e.kind() == ErrorKind::Interrupted => continue,
                Ok(Err(e)) => return Err(e),
                Err(_) => break,
            }
        }
        Ok(())
    }
}
