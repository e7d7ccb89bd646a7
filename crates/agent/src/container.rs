//! `container` mode: the agent as PID 1 of a gVisor sandbox, serving on a
//! unix socket whose file is the host's (a directory the host mounts in).
//!
//! gVisor cannot checkpoint a socket bound to a host file, so before the
//! host checkpoints the sandbox (a template's bake, a fork) it asks the
//! agent to quiesce ([`Request::Quiesce`](forkbox_proto::Request)): the
//! agent stops accepting, closes its listener, waits until the quiesce
//! request is its only connection, answers and closes it. Then it waits
//! for one byte on stdin, which the host writes once the checkpoint is
//! made, and listens again. A sandbox restored from the checkpoint
//! resumes in that same wait, on the stdin its restorer gave it.
//!
//! Stdin is also the host's hold on the sandbox: when it closes (the
//! process that made the sandbox ended without ending it), the agent
//! ends, and the sandbox with it.
//!
//! The [`Gate`] is the state the accept loop and the connection threads
//! share for that: how many connections are open, and where a quiesce is.

use std::io::{self, Read};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use forkbox_proto::{AgentError, ErrorKind};

use crate::server::{self, Agent, Listener};

/// Where a quiesce is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Serving.
    Open,
    /// A connection asked; the accept loop is to close the listener.
    Asked,
    /// The listener is closed; the asking connection waits for the others.
    Closed,
    /// The asking connection answered: wait for the host's byte on stdin.
    Quiesced,
    /// The others did not end in time: listen again at once.
    GaveUp,
}

#[derive(Debug)]
struct State {
    /// Connections accepted and not yet ended.
    open: usize,
    phase: Phase,
    /// The host's byte came since the last quiesce was answered.
    go: bool,
    /// The network pump's socket is bound (`container --net`).
    net_bound: bool,
    /// When the pump must have settled the sandbox's TCP connections by,
    /// in a quiesce.
    settle_by: Instant,
    /// Why the pump could not settle them (the quiesce fails with it).
    net_unsaved: Option<String>,
}

/// Shared by the accept loop and the connection threads.
#[derive(Debug)]
pub struct Gate {
    path: PathBuf,
    /// The network pump's socket, when the sandbox has a network.
    net: Option<PathBuf>,
    state: Mutex<State>,
    changed: Condvar,
}

/// Held by each connection's thread; counts it out when dropped.
#[derive(Debug)]
pub struct Open(Arc<Gate>);

impl Drop for Open {
    fn drop(&mut self) {
        let mut state = self.0.lock();
        state.open = state.open.saturating_sub(1);
        self.0.changed.notify_all();
    }
}

impl Gate {
    fn new(path: PathBuf, net: Option<PathBuf>) -> Arc<Self> {
        Arc::new(Self {
            path,
            net,
            state: Mutex::new(State {
                open: 0,
                phase: Phase::Open,
                go: false,
                net_bound: false,
                settle_by: Instant::now(),
                net_unsaved: None,
            }),
            changed: Condvar::new(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Counts a connection in; `None` when a quiesce is under way (the
    /// connection is closed unanswered).
    pub fn enter(self: &Arc<Self>) -> Option<Open> {
        let mut state = self.lock();
        if state.phase != Phase::Open {
            return None;
        }
        state.open += 1;
        Some(Open(Arc::clone(self)))
    }

    /// The quiesce request, on its connection's thread: has the listener
    /// closed, waits until its own is the one connection left, and answers
    /// `Ok` (the connection is closed by its thread's end).
    pub fn quiesce(&self, conn: &UnixStream, within: Duration) -> Result<(), AgentError> {
        let deadline = Instant::now() + within;
        {
            let mut state = self.lock();
            if state.phase != Phase::Open {
                return Err(AgentError::new(
                    ErrorKind::InvalidRequest,
                    "a quiesce is already under way",
                ));
            }
            state.phase = Phase::Asked;
            // Room to say why, if the network cannot settle in time.
            state.settle_by = deadline - within / 10;
            state.net_unsaved = None;
        }
        // Wake the accept loop, blocked in accept, and the network pump,
        // in poll, with a connection of our own: each sees the phase and
        // closes its listener.
        let _ = UnixStream::connect(&self.path);
        if let Some(net) = &self.net {
            crate::container_net::wake(net);
        }
        let mut state = self.lock();
        while state.phase == Phase::Asked
            || (state.phase == Phase::Closed && (state.open > 1 || state.net_bound))
        {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let others = state.open.saturating_sub(1);
                let net = if state.net_bound {
                    " (and the network socket not closed)"
                } else {
                    ""
                };
                state.phase = Phase::GaveUp;
                self.changed.notify_all();
                return Err(AgentError::new(
                    ErrorKind::InvalidRequest,
                    format!(
                        "{others} other request(s) still open{net} after {within:?}: a sandbox is \
                         checkpointed between requests (wait for its commands, or end them)"
                    ),
                ));
            }
            state = self
                .changed
                .wait_timeout(state, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        if let Some(why) = state.net_unsaved.take() {
            state.phase = Phase::GaveUp;
            self.changed.notify_all();
            return Err(AgentError::new(ErrorKind::InvalidRequest, why));
        }
        // The answer goes out before the accept loop may wait on stdin; the
        // host reads it, then waits for this connection to close.
        let _ = server::send(conn, &forkbox_proto::Response::Ok);
        state.phase = Phase::Quiesced;
        state.go = false;
        self.changed.notify_all();
        Ok(())
    }

    /// The accept loop, after it closed the listener: waits until the
    /// quiesce is answered (or given up), then, once answered, for the
    /// host's byte on stdin.
    fn wait_to_reopen(&self) {
        let mut state = self.lock();
        state.phase = Phase::Closed;
        self.changed.notify_all();
        let wait = |state, until_not: fn(&mut State) -> bool| {
            self.changed
                .wait_while(state, until_not)
                .unwrap_or_else(PoisonError::into_inner)
        };
        state = wait(state, |s| s.phase == Phase::Closed);
        if state.phase == Phase::Quiesced {
            // The quiescing connection's thread closes it right after its
            // answer (the host checkpoints once it sees it closed); then
            // the host's byte.
            state = wait(state, |s| s.open > 0 || !s.go);
        }
        state.phase = Phase::Open;
        // The network pump waits for this to listen again.
        self.changed.notify_all();
    }

    /// Whether requests are served (no quiesce under way).
    pub fn is_open(&self) -> bool {
        self.lock().phase == Phase::Open
    }

    /// The network pump, before it binds: waits until no quiesce is under
    /// way, and counts its socket in.
    pub fn net_wait_open(&self) {
        let mut state = self
            .changed
            .wait_while(self.lock(), |s| s.phase != Phase::Open)
            .unwrap_or_else(PoisonError::into_inner);
        state.net_bound = true;
    }

    /// Waits until a quiesce is asked.
    pub fn net_wait_quiesce(&self) {
        drop(
            self.changed
                .wait_while(self.lock(), |s| s.phase == Phase::Open)
                .unwrap_or_else(PoisonError::into_inner),
        );
    }

    /// When a quiesce needs the sandbox's TCP connections settled by.
    pub fn settle_by(&self) -> Instant {
        self.lock().settle_by
    }

    /// The network pump closed its socket; `unsaved`: why the sandbox
    /// cannot be checkpointed (its connections did not settle).
    pub fn net_closed(&self, unsaved: Option<String>) {
        let mut state = self.lock();
        state.net_bound = false;
        state.net_unsaved = unsaved;
        self.changed.notify_all();
    }

    /// Reads stdin for good: each byte is the host's go-ahead after a
    /// checkpoint; its end is the host letting go, which ends the agent.
    fn watch_stdin(&self) -> ! {
        let mut stdin = io::stdin().lock();
        let mut byte = [0u8; 1];
        loop {
            match stdin.read(&mut byte) {
                Ok(1) => {
                    self.lock().go = true;
                    self.changed.notify_all();
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                end => {
                    let why = match end {
                        Err(e) => e.to_string(),
                        _ => "end of file".into(),
                    };
                    crate::log(&format!(
                        "the host let go of this sandbox (stdin: {why}): ending it"
                    ));
                    crate::shutdown(server::ShutdownAction::Exit)
                }
            }
        }
    }
}

/// Serves on `path` forever, closing and reopening the listener around
/// each checkpoint.
pub fn serve(path: &Path, agent: &Arc<Agent>, gate: &Arc<Gate>) -> Result<(), String> {
    let watcher = Arc::clone(gate);
    std::thread::Builder::new()
        .name("stdin".into())
        .spawn(move || watcher.watch_stdin())
        .map_err(|e| format!("cannot start the stdin thread: {e}"))?;
    loop {
        let _ = std::fs::remove_file(path);
        let listener =
            UnixListener::bind(path).map_err(|e| format!("bind {}: {e}", path.display()))?;
        let listener = Listener::Unix(listener);
        server::serve_until(&listener, agent, || gate.lock().phase != Phase::Open)
            .map_err(|e| crate::chain(&e))?;
        drop(listener);
        let _ = std::fs::remove_file(path);
        gate.wait_to_reopen();
    }
}

/// A gate for serving on `path`, with the network pump's socket `net`.
pub fn gate(path: &Path, net: Option<&Path>) -> Arc<Gate> {
    Gate::new(path.to_owned(), net.map(Path::to_owned))
}
