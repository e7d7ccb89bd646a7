//! COM1: a vm-superio 8250 whose output goes to a log file, an in-memory
//! tail (the last 64 KiB, searched for kernel panics) and optionally stderr.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, Write};
use std::sync::{Arc, Mutex};

use vm_superio::serial::NoEvents;
use vm_superio::{Serial, Trigger};
use vmm_sys_util::eventfd::EventFd;

/// Bytes of serial output kept in memory.
pub const TAIL_CAPACITY: usize = 64 * 1024;
/// What the guest kernel prints when it panics.
pub const PANIC_MARKER: &str = "Kernel panic - not syncing";

/// The last [`TAIL_CAPACITY`] bytes of serial output.
#[derive(Debug, Default)]
pub struct TailBuffer {
    buf: VecDeque<u8>,
}

impl TailBuffer {
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend(bytes);
        let excess = self.buf.len().saturating_sub(TAIL_CAPACITY);
        self.buf.drain(..excess);
    }

    pub fn contents(&self) -> Vec<u8> {
        self.buf.iter().copied().collect()
    }

    /// The first line containing [`PANIC_MARKER`], trimmed.
    pub fn panic_line(&self) -> Option<String> {
        let text = String::from_utf8_lossy(&self.contents()).into_owned();
        text.lines()
            .find(|l| l.contains(PANIC_MARKER))
            .map(|l| l.trim().to_owned())
    }
}

/// Whether serial output is also copied to the VMM's stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Echo {
    Stderr,
    Off,
}

/// Where the guest's serial bytes go.
pub struct SerialOutput {
    log: Option<File>,
    tail: Arc<Mutex<TailBuffer>>,
    echo: Echo,
}

impl SerialOutput {
    pub fn new(log: Option<File>, tail: Arc<Mutex<TailBuffer>>, echo: Echo) -> Self {
        Self { log, tail, echo }
    }
}

impl Write for SerialOutput {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        if let Ok(mut tail) = self.tail.lock() {
            tail.push(bytes);
        }
        if let Some(log) = self.log.as_mut() {
            // A full disk must not stop the guest: drop the log, keep running.
            if let Err(e) = log.write_all(bytes) {
                tracing::warn!("serial log write failed, closing it: {e}");
                self.log = None;
            }
        }
        if self.echo == Echo::Stderr {
            let _ = io::stderr().write_all(bytes);
        }
        Ok(bytes.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Raises the serial IRQ through its irqfd.
pub struct IrqTrigger(pub EventFd);

impl Trigger for IrqTrigger {
    type E = io::Error;
    fn trigger(&self) -> io::Result<()> {
        self.0.write(1)
    }
}

pub type SerialDevice = Serial<IrqTrigger, NoEvents, SerialOutput>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_keeps_only_last_64k() {
        let mut t = TailBuffer::default();
        t.push(&vec![b'a'; TAIL_CAPACITY]);
        t.push(b"xyz");
        let c = t.contents();
        assert_eq!(c.len(), TAIL_CAPACITY);
        assert!(c.ends_with(b"axyz"));
    }

    #[test]
    fn panic_line_found_across_writes() {
        let mut t = TailBuffer::default();
        t.push(b"[ 1.0] ok\r\n[ 2.0] Kernel panic - not ");
        t.push(b"syncing: sysrq triggered crash\r\n[ 2.1] more\r\n");
        assert_eq!(
            t.panic_line().as_deref(),
            Some("[ 2.0] Kernel panic - not syncing: sysrq triggered crash")
        );
    }

    #[test]
    fn panic_line_absent_none() {
        let mut t = TailBuffer::default();
        t.push(b"reboot: Restarting system\n");
        assert_eq!(t.panic_line(), None);
    }
}
