//! Background processes: commands started by `Spawn` that outlive the
//! connection that started them. Each keeps its output in a bounded
//! buffer (oldest bytes dropped first, and counted), its stdin pipe open
//! until asked to close it, and its result once it ended, so that a client
//! can wait for it, write to it, kill it or reattach to its output later.
//!
//! The process itself is run by `exec::spawn` (same preparation, pumps and
//! timeout as a foreground exec); it is tracked in the [`ExecTable`].

use std::collections::VecDeque;
use std::io::{self, Write};
use std::os::unix::net::UnixStream;
use std::process::ChildStdin;
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use forkbox_proto::frame::{read_frame, write_frame};
use forkbox_proto::{
    AgentError, ErrorKind, ExecResult, FrameKind, OutputStream, Response, MAX_FRAME_LEN,
};

use crate::exec::OutputSink;
use crate::execs::ExecTable;
use crate::server::send;
use crate::sys;

/// Output kept per background process (both streams together).
pub const OUTPUT_BUFFER: usize = 1 << 20;
/// How often a blocked wait or attach checks that its client is still
/// there.
const HANGUP_POLL: Duration = Duration::from_millis(500);

/// Output read back: (offset, stream, bytes) per chunk.
type Chunks = Vec<(u64, OutputStream, Vec<u8>)>;

struct Chunk {
    /// Bytes of output (both streams) before this chunk.
    offset: u64,
    stream: OutputStream,
    bytes: Vec<u8>,
}

#[derive(Default)]
struct State {
    chunks: VecDeque<Chunk>,
    /// Bytes of output so far, kept or dropped.
    total: u64,
    buffered: usize,
    result: Option<ExecResult>,
}

/// One background process's output, stdin and result.
pub struct Background {
    state: Mutex<State>,
    changed: Condvar,
    /// Held for the whole of one stdin transfer, so that writers do not
    /// interleave; `None` once closed.
    stdin: Mutex<Option<ChildStdin>>,
}

impl Background {
    pub fn new(stdin: Option<ChildStdin>) -> Self {
        Self {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            stdin: Mutex::new(stdin),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records how the process ended (after its output pumps finished),
    /// closes its stdin and wakes every waiter.
    pub fn finish(&self, result: ExecResult) {
        self.lock().result = Some(result);
        *self.stdin.lock().unwrap_or_else(PoisonError::into_inner) = None;
        self.changed.notify_all();
    }

    pub fn result(&self) -> Option<ExecResult> {
        self.lock().result.clone()
    }

    /// Waits until the process ended, at most `timeout`; gives up early
    /// when `conn`'s peer hangs up (no one would get the answer).
    fn wait(&self, conn: &UnixStream, timeout: Option<Duration>) -> Option<ExecResult> {
        // A timeout past what an `Instant` holds is none.
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        let mut st = self.lock();
        loop {
            if let Some(r) = &st.result {
                return Some(r.clone());
            }
            let left = deadline.map_or(HANGUP_POLL, |d| {
                d.saturating_duration_since(Instant::now()).min(HANGUP_POLL)
            });
            if left.is_zero() || sys::peer_hung_up(conn) {
                return None;
            }
            st = self
                .changed
                .wait_timeout(st, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Output from byte `cursor` on (as kept), and the result if the
    /// process ended. With `block`, waits up to [`HANGUP_POLL`] for either.
    fn read_from(&self, cursor: u64, block: bool) -> (Chunks, Option<ExecResult>) {
        let mut st = self.lock();
        if block && st.total <= cursor && st.result.is_none() {
            st = self
                .changed
                .wait_timeout(st, HANGUP_POLL)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        let chunks = st
            .chunks
            .iter()
            .filter(|c| c.offset >= cursor)
            .map(|c| (c.offset, c.stream, c.bytes.clone()))
            .collect();
        (chunks, st.result.clone())
    }
}

impl OutputSink for Background {
    fn output(&self, stream: OutputStream, bytes: &[u8]) -> io::Result<()> {
        let mut st = self.lock();
        let offset = st.total;
        st.total += bytes.len() as u64;
        st.buffered += bytes.len();
        st.chunks.push_back(Chunk {
            offset,
            stream,
            bytes: bytes.to_vec(),
        });
        // Keep the newest chunk even if it alone exceeds the bound (a
        // chunk is at most one pump read, `DATA_CHUNK`).
        while st.buffered > OUTPUT_BUFFER && st.chunks.len() > 1 {
            if let Some(old) = st.chunks.pop_front() {
                st.buffered -= old.bytes.len();
            }
        }
        drop(st);
        self.changed.notify_all();
        Ok(())
    }
}

fn no_process(pid: u32) -> AgentError {
    AgentError::new(ErrorKind::NotFound, format!("no background process {pid}"))
}

/// `WaitProcess`.
pub fn wait(
    conn: &UnixStream,
    execs: &ExecTable,
    pid: u32,
    timeout: Option<Duration>,
) -> Result<(), AgentError> {
    let bg = execs.background(pid).ok_or_else(|| no_process(pid))?;
    let result = bg.wait(conn, timeout);
    let _ = send(conn, &Response::Waited { result });
    Ok(())
}

/// `KillProcess`: any process the agent runs (background or not).
pub fn kill(execs: &ExecTable, pid: u32, signal: i32) -> Result<(), AgentError> {
    if !(1..=64).contains(&signal) {
        return Err(AgentError::new(
            ErrorKind::InvalidRequest,
            format!("bad signal {signal}"),
        ));
    }
    if !execs.is_running(pid) {
        return Err(AgentError::new(
            ErrorKind::NotFound,
            format!("no running process {pid}"),
        ));
    }
    sys::kill_group(pid, signal)
        .map_err(|e| AgentError::new(ErrorKind::from_io(e.kind()), format!("kill {pid}: {e}")))
}

/// `ProcessStdin`: `Ready`, then `Data` frames until `Eof` go to the
/// process's stdin; `Done` with the bytes written.
pub fn stdin(
    conn: &UnixStream,
    execs: &ExecTable,
    pid: u32,
    close: bool,
) -> Result<(), AgentError> {
    let bg = execs.background(pid).ok_or_else(|| no_process(pid))?;
    let mut pipe = bg.stdin.lock().unwrap_or_else(PoisonError::into_inner);
    if pipe.is_none() {
        return Err(AgentError::new(
            ErrorKind::InvalidRequest,
            format!("the stdin of process {pid} is closed"),
        ));
    }
    let _ = send(conn, &Response::Ready);
    let mut r = conn;
    let (mut written, mut failed) = (0u64, None);
    loop {
        match read_frame(&mut r, MAX_FRAME_LEN) {
            Ok(Some(f)) if f.kind == FrameKind::Data => {
                if let Some(p) = pipe.as_mut() {
                    match p.write_all(&f.body) {
                        Ok(()) => written += f.body.len() as u64,
                        Err(e) => {
                            // The process closed its stdin (or ended):
                            // take the rest of the stream, then say so.
                            failed = Some(e);
                            *pipe = None;
                        }
                    }
                }
            }
            Ok(Some(f)) if f.kind == FrameKind::Eof => break,
            Ok(Some(f)) => {
                return Err(AgentError::new(
                    ErrorKind::Protocol,
                    format!("expected stdin data, got a {:?} frame", f.kind),
                ))
            }
            // The client left mid-stream: nothing to answer.
            Ok(None) | Err(_) => return Ok(()),
        }
    }
    if close {
        *pipe = None;
    }
    drop(pipe);
    if let Some(e) = failed {
        return Err(AgentError::new(
            ErrorKind::Io,
            format!("process {pid} does not take stdin any more: {e}"),
        ));
    }
    let _ = send(conn, &Response::Done { bytes: written });
    Ok(())
}

/// `AttachProcess`: the kept output, then with `follow` the output as it
/// comes, then `Attached`.
pub fn attach(
    conn: &UnixStream,
    execs: &ExecTable,
    pid: u32,
    follow: bool,
) -> Result<(), AgentError> {
    let bg = execs.background(pid).ok_or_else(|| no_process(pid))?;
    let mut w = conn;
    let (mut cursor, mut dropped) = (0u64, 0u64);
    let mut first = true;
    loop {
        let (chunks, result) = bg.read_from(cursor, follow && !first);
        first = false;
        let idle = chunks.is_empty();
        for (offset, stream, bytes) in chunks {
            dropped += offset - cursor;
            let kind = match stream {
                OutputStream::Stdout => FrameKind::Stdout,
                OutputStream::Stderr => FrameKind::Stderr,
            };
            if write_frame(&mut w, kind, &bytes).is_err() {
                return Ok(());
            }
            cursor = offset + bytes.len() as u64;
        }
        // `result` is set only after both pumps finished, so once it is
        // there every byte of output is in what we just sent.
        if result.is_some() || !follow {
            let _ = send(conn, &Response::Attached { dropped, result });
            return Ok(());
        }
        if idle && sys::peer_hung_up(conn) {
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_beyond_the_bound_drops_oldest_chunks() {
        let bg = Background::new(None);
        let chunk = vec![b'x'; OUTPUT_BUFFER / 4];
        for _ in 0..6 {
            bg.output(OutputStream::Stdout, &chunk).expect("output");
        }
        let (chunks, result) = bg.read_from(0, false);
        assert!(result.is_none());
        assert_eq!(chunks.len(), 4);
        assert_eq!(chunks[0].0, 2 * chunk.len() as u64);
    }

    #[test]
    fn read_from_cursor_skips_what_was_read() {
        let bg = Background::new(None);
        bg.output(OutputStream::Stdout, b"ab").expect("output");
        bg.output(OutputStream::Stderr, b"cd").expect("output");
        let (chunks, _) = bg.read_from(2, false);
        assert_eq!(chunks.len(), 1);
        assert_eq!(chunks[0].1, OutputStream::Stderr);
        assert_eq!(chunks[0].2, b"cd");
    }
}
