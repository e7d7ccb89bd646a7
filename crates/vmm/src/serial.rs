//! COM1: a vm-superio 8250 whose output goes to a log file (capped at
//! [`SERIAL_LOG_MAX_BYTES`]: the guest writes what it likes to its serial
//! port), an in-memory tail (the last 64 KiB, searched for kernel panics)
//! and optionally stderr.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, Write};
use std::sync::{Arc, Mutex};

use vm_superio::serial::NoEvents;
use vm_superio::{Serial, Trigger};
use vmm_sys_util::eventfd::EventFd;

/// Bytes of serial output kept in memory.
pub const TAIL_CAPACITY: usize = 64 * 1024;
/// Most a serial log grows to. Past it the guest's output is dropped
/// (the tail in memory still has the last of it), after one line saying
/// so, so that a guest printing without end cannot fill the host's disk.
pub const SERIAL_LOG_MAX_BYTES: u64 = forkbox_vmm_api::SERIAL_LOG_MAX_BYTES;
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

/// A serial log file with the room left in it.
pub struct SerialLog {
    file: File,
    room: u64,
    dropped: u64,
}

impl SerialLog {
    /// `file` (opened to append) with room up to [`SERIAL_LOG_MAX_BYTES`]
    /// less what it holds already (a fork child replaced in place, a
    /// restored VM).
    pub fn new(file: File) -> Self {
        Self::with_max(file, SERIAL_LOG_MAX_BYTES)
    }

    pub fn with_max(file: File, max: u64) -> Self {
        let used = file.metadata().map_or(0, |m| m.len());
        Self {
            file,
            room: max.saturating_sub(used),
            dropped: 0,
        }
    }

    /// Bytes dropped since the log was full.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Writes what fits; the first time something does not, one line
    /// saying so.
    fn write(&mut self, bytes: &[u8]) -> io::Result<()> {
        let fits = bytes
            .len()
            .min(usize::try_from(self.room).unwrap_or(usize::MAX));
        if fits > 0 {
            self.file.write_all(&bytes[..fits])?;
            self.room -= fits as u64;
        }
        let rest = (bytes.len() - fits) as u64;
        if rest > 0 {
            if self.dropped == 0 {
                tracing::warn!(
                    "serial log full ({SERIAL_LOG_MAX_BYTES} bytes): later guest output is dropped"
                );
                self.file.write_all(
                    b"\n[forkbox-vmm] serial log full: later guest output is dropped\n",
                )?;
            }
            self.dropped += rest;
        }
        Ok(())
    }
}

/// Where the guest's serial bytes go.
pub struct SerialOutput {
    log: Option<SerialLog>,
    tail: Arc<Mutex<TailBuffer>>,
    echo: Echo,
}

impl SerialOutput {
    pub fn new(log: Option<SerialLog>, tail: Arc<Mutex<TailBuffer>>, echo: Echo) -> Self {
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
            if let Err(e) = log.write(bytes) {
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
    fn serial_log_full_drops_the_rest_after_one_line() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("serial.log");
        std::fs::write(&path, b"0123").expect("earlier output");
        let file = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .expect("open");
        let tail = Arc::new(Mutex::new(TailBuffer::default()));
        let mut out =
            SerialOutput::new(Some(SerialLog::with_max(file, 10)), tail.clone(), Echo::Off);
        out.write_all(b"abcd").expect("fits");
        out.write_all(b"efghij").expect("half fits");
        out.write_all(&[b'x'; 100_000])
            .expect("dropped, not an error");
        let text = std::fs::read_to_string(&path).expect("read");
        assert_eq!(
            text, "0123abcdef\n[forkbox-vmm] serial log full: later guest output is dropped\n",
            "the cap counts what was there; one line says so, once"
        );
        assert_eq!(out.log.as_ref().expect("log").dropped(), 4 + 100_000);
        assert!(
            tail.lock().expect("tail").contents().ends_with(b"xxxx"),
            "the tail in memory still sees everything"
        );
    }

    #[test]
    fn panic_line_absent_none() {
        let mut t = TailBuffer::default();
        t.push(b"reboot: Restarting system\n");
        assert_eq!(t.panic_line(), None);
    }
}
