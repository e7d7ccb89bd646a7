//! Relaying one host connection to a TCP port inside the guest. The
//! sandbox may have no network device at all, so inbound connections come
//! over the agent's own channel: after `Response::Ready` the connection
//! carries the raw bytes of a TCP connection to `127.0.0.1:port`.

use std::io;
use std::net::{Shutdown, TcpStream};
use std::os::unix::net::UnixStream;
use std::thread;

use forkbox_proto::{AgentError, ErrorKind, Response};

use crate::server::send;

/// Connects to the guest port, answers `Ready` and copies bytes both ways
/// until both directions ended. A refused port is a `ConnectionRefused`
/// error, answered before anything is relayed.
pub fn relay(conn: &UnixStream, port: u16) -> Result<(), AgentError> {
    let tcp = TcpStream::connect(("127.0.0.1", port)).map_err(|e| {
        let kind = ErrorKind::from_io(e.kind());
        let message = if kind == ErrorKind::ConnectionRefused {
            format!("guest port {port} refused the connection")
        } else {
            format!("connecting to guest port {port}: {e}")
        };
        AgentError::new(kind, message)
    })?;
    let _ = tcp.set_nodelay(true);
    let clone_failed =
        |e: io::Error| AgentError::new(ErrorKind::Internal, format!("cannot clone a socket: {e}"));
    let host_r = conn.try_clone().map_err(clone_failed)?;
    let host_w = conn.try_clone().map_err(clone_failed)?;
    let tcp_w = tcp.try_clone().map_err(clone_failed)?;
    send(conn, &Response::Ready)
        .map_err(|e| AgentError::new(ErrorKind::Io, format!("answering the host: {e}")))?;
    let inbound = thread::Builder::new()
        .name("port-in".into())
        .spawn(move || copy_half(host_r, tcp_w));
    match inbound {
        Ok(h) => {
            copy_half(tcp, host_w);
            let _ = h.join();
        }
        Err(e) => {
            // Already answered Ready: close rather than report.
            crate::log(&format!("port {port}: cannot start a relay thread: {e}"));
        }
    }
    Ok(())
}

/// Copies `from` into `to` until EOF, then half-closes `to`; on an error
/// shuts both down so that the other direction ends too.
fn copy_half<R, W>(mut from: R, mut to: W)
where
    R: io::Read + HalfClose,
    W: io::Write + HalfClose,
{
    match io::copy(&mut from, &mut to) {
        Ok(_) => to.shutdown_write(),
        Err(_) => {
            from.shutdown_all();
            to.shutdown_all();
        }
    }
}

trait HalfClose {
    fn shutdown_write(&self);
    fn shutdown_all(&self);
}

impl HalfClose for TcpStream {
    fn shutdown_write(&self) {
        let _ = self.shutdown(Shutdown::Write);
    }
    fn shutdown_all(&self) {
        let _ = self.shutdown(Shutdown::Both);
    }
}

impl HalfClose for UnixStream {
    fn shutdown_write(&self) {
        let _ = self.shutdown(Shutdown::Write);
    }
    fn shutdown_all(&self) {
        let _ = self.shutdown(Shutdown::Both);
    }
}
