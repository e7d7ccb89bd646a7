//! [`EchoStream`]: a host stream in memory that gives back what it was
//! written. For tests and fuzz targets that drive the gateway without
//! sockets.

use std::collections::VecDeque;
use std::io::{self, ErrorKind, Read, Write};

use super::HostStream;

/// Reads back what was written, through a buffer of `capacity` bytes (so
/// backpressure happens too); ends after `shutdown_write` once drained.
pub struct EchoStream {
    buf: VecDeque<u8>,
    capacity: usize,
    shut: bool,
}

impl EchoStream {
    pub fn with_capacity(capacity: usize) -> Self {
        EchoStream {
            buf: VecDeque::new(),
            capacity,
            shut: false,
        }
    }
}

impl Default for EchoStream {
    fn default() -> Self {
        Self::with_capacity(256 * 1024)
    }
}

impl Read for EchoStream {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if self.buf.is_empty() {
            return if self.shut {
                Ok(0)
            } else {
                Err(ErrorKind::WouldBlock.into())
            };
        }
        let n = out.len().min(self.buf.len());
        for (o, b) in out.iter_mut().zip(self.buf.drain(..n)) {
            *o = b;
        }
        Ok(n)
    }
}

impl Write for EchoStream {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        let room = self.capacity.saturating_sub(self.buf.len());
        if room == 0 {
            return Err(ErrorKind::WouldBlock.into());
        }
        let n = data.len().min(room);
        self.buf.extend(&data[..n]);
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl HostStream for EchoStream {
    fn shutdown_write(&mut self) -> io::Result<()> {
        self.shut = true;
        Ok(())
    }
}
