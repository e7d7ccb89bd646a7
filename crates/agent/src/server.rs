//! The protocol server: one thread per connection, one request per
//! connection. The edge: it turns frames into a [`Request`] and hands it to
//! `exec` or `files`.

use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Arc;
use std::thread;

use forkbox_proto::frame::{read_frame, write_frame, FrameError};
use forkbox_proto::{
    decode_control, encode_control, AgentError, ErrorKind, FrameKind, Hello, Request, Response,
    User, MAX_FRAME_LEN,
};

use crate::container::{Gate, Open};
use crate::execs::ExecTable;
use crate::fork::{self, RunsOn};
use crate::reaper::Reaper;
use crate::{background, exec, files, ports, protect, sys};

/// Why serving stopped.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("accept failed")]
    Accept(#[source] io::Error),
}

/// Where connections come from.
pub enum Listener {
    Unix(UnixListener),
    /// A listening `AF_VSOCK` socket.
    Vsock(OwnedFd),
}

impl Listener {
    fn accept(&self) -> io::Result<UnixStream> {
        match self {
            Self::Unix(l) => l.accept().map(|(s, _)| s),
            // A connected vsock socket is a stream socket like any other:
            // read, write and shutdown are all `UnixStream` uses of it.
            Self::Vsock(fd) => sys::accept(fd).map(UnixStream::from),
        }
    }
}

/// What a shutdown request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShutdownAction {
    /// We are PID 1: sync and power off.
    PowerOff,
    /// `serve` mode: exit the process.
    Exit,
}

pub struct Agent {
    pub hello: Hello,
    pub reaper: Arc<Reaper>,
    pub execs: ExecTable,
    pub on_shutdown: ShutdownAction,
    /// In `container` mode: the open connections and the quiesce before
    /// a checkpoint.
    pub gate: Option<Arc<Gate>>,
}

impl Agent {
    fn runs_on(&self) -> RunsOn {
        match (&self.gate, self.on_shutdown) {
            (Some(_), _) => RunsOn::Sandbox,
            (None, ShutdownAction::PowerOff) => RunsOn::Guest,
            (None, ShutdownAction::Exit) => RunsOn::Host,
        }
    }
}

/// Accepts connections forever.
pub fn serve(listener: &Listener, agent: &Arc<Agent>) -> Result<(), ServeError> {
    serve_until(listener, agent, || false)
}

/// Accepts connections until `stop` says so after an accept (that
/// connection is closed unanswered).
pub fn serve_until(
    listener: &Listener,
    agent: &Arc<Agent>,
    stop: impl Fn() -> bool,
) -> Result<(), ServeError> {
    let mut consecutive_errors = 0u32;
    loop {
        let conn = match listener.accept() {
            Ok(c) => {
                consecutive_errors = 0;
                c
            }
            Err(e) => {
                // Transient (EMFILE, ECONNABORTED...): log and go on, but
                // do not spin forever on a dead listener.
                consecutive_errors += 1;
                crate::log(&format!("accept: {e}"));
                if consecutive_errors > 1000 {
                    return Err(ServeError::Accept(e));
                }
                thread::sleep(std::time::Duration::from_millis(10));
                continue;
            }
        };
        if stop() {
            return Ok(());
        }
        // Counted while its thread runs, in `container` mode; refused
        // unanswered while a quiesce is under way.
        let open = match &agent.gate {
            Some(gate) => match gate.enter() {
                Some(open) => Some(open),
                None => continue,
            },
            None => None,
        };
        let agent = Arc::clone(agent);
        let spawned = thread::Builder::new().name("conn".into()).spawn(move || {
            handle(conn, open, &agent);
        });
        if let Err(e) = spawned {
            crate::log(&format!("cannot start connection thread: {e}"));
        }
    }
}

/// Writes one control message.
pub fn send(conn: &UnixStream, resp: &Response) -> io::Result<()> {
    let mut w = conn;
    write_frame(&mut w, FrameKind::Control, &encode_control(resp))
}

/// Serves the connection's one request and closes it (a background
/// process's as soon as it is answered), then counts it out (`open`): a
/// quiesce that sees no connection open has none left.
fn handle(owned: UnixStream, open: Option<Open>, agent: &Agent) {
    let counted = Counted {
        conn: owned,
        _open: open,
    };
    let conn = &counted.conn;
    let mut w = conn;
    if write_frame(&mut w, FrameKind::Control, &encode_control(&agent.hello)).is_err() {
        return;
    }
    let mut r = conn;
    let req = match read_frame(&mut r, MAX_FRAME_LEN) {
        // The client closed without asking anything (a readiness probe).
        Ok(None) => return,
        Ok(Some(f)) if f.kind == FrameKind::Control => match decode_control::<Request>(&f.body) {
            Ok(req) => req,
            Err(e) => {
                return reply_error(
                    conn,
                    AgentError::new(ErrorKind::InvalidRequest, format!("bad request: {e}")),
                )
            }
        },
        Ok(Some(f)) => {
            return reply_error(
                conn,
                AgentError::new(
                    ErrorKind::Protocol,
                    format!("expected a request, got a {:?} frame", f.kind),
                ),
            )
        }
        Err(FrameError::Io(_)) => return,
        Err(e) => {
            return reply_error(
                conn,
                AgentError::new(ErrorKind::Protocol, format!("bad frame: {e}")),
            )
        }
    };
    let req = match req {
        Request::AsUser { user, request } => match as_user(&user, *request) {
            Ok(req) => req,
            Err(e) => return reply_error(conn, e),
        },
        req => req,
    };
    let outcome = match req {
        Request::Ping => reply(conn, Ok(Response::Pong)),
        Request::Shutdown => {
            let _ = send(conn, &Response::Ok);
            // Powering off at once can beat the answer out of the VM (the
            // VMM ends with the guest): wait, briefly, for the client to
            // read it and hang up.
            wait_for_hangup(conn, SHUTDOWN_ANSWER_GRACE);
            crate::shutdown(agent.on_shutdown)
        }
        Request::Exec { exec, stdin } => exec::run(conn, &agent.reaper, &agent.execs, &exec, stdin),
        Request::AfterFork {
            unix_time_ns,
            entropy,
            seed,
        } => reply(
            conn,
            fork::after_fork(agent.runs_on(), &agent.execs, unix_time_ns, &entropy, seed)
                .map(|report| Response::AfterFork { report }),
        ),
        Request::ReadFile { path, max_bytes } => files::read_file(conn, &path, max_bytes),
        Request::WriteFile {
            path,
            mode,
            create_parents,
        } => files::write_file(conn, &path, mode, create_parents),
        Request::ListDir { path } => files::list_dir(conn, &path),
        Request::Stat { path } => reply(conn, files::stat(&path)),
        Request::Mkdir { path, mode } => reply(conn, files::mkdir(&path, mode)),
        Request::Remove { path, recursive } => reply(conn, files::remove(&path, recursive)),
        Request::DownloadTar { path, max_bytes } => files::download_tar(conn, &path, max_bytes),
        Request::UploadTar { path } => files::upload_tar(conn, &path),
        Request::Protect { paths } => reply(conn, protect::protect(&paths, agent.runs_on())),
        Request::Digest { paths } => protect::digest(conn, &paths),
        Request::Quiesce { timeout_ms } => match &agent.gate {
            Some(gate) => gate.quiesce(conn, std::time::Duration::from_millis(timeout_ms)),
            None => Err(AgentError::new(
                ErrorKind::InvalidRequest,
                "quiesce is for an agent in container mode (a gVisor sandbox)",
            )),
        },
        Request::ConnectPort { port } => ports::relay(conn, port),
        Request::Spawn { exec } => match exec::spawn(conn, &agent.reaper, &agent.execs, &exec) {
            Ok(spawned) => {
                drop(counted);
                return spawned.wait(&agent.execs);
            }
            Err(e) => Err(e),
        },
        Request::ListProcesses => reply(
            conn,
            Ok(Response::Processes {
                processes: agent.execs.list(),
            }),
        ),
        Request::WaitProcess { pid, timeout } => background::wait(conn, &agent.execs, pid, timeout),
        Request::KillProcess { pid, signal } => reply(
            conn,
            background::kill(&agent.execs, pid, signal).map(|()| Response::Ok),
        ),
        Request::ProcessStdin { pid, close } => background::stdin(conn, &agent.execs, pid, close),
        Request::AttachProcess { pid, follow } => {
            background::attach(conn, &agent.execs, pid, follow)
        }
        Request::AsUser { .. } => Err(AgentError::new(
            ErrorKind::InvalidRequest,
            "AsUser carries one file request, not another AsUser",
        )),
    };
    if let Err(e) = outcome {
        reply_error(conn, e);
    }
}

/// A connection and its count in the gate: fields drop in order, so it
/// is closed before it is counted out.
struct Counted {
    conn: UnixStream,
    _open: Option<Open>,
}

/// Takes on `user`'s rights for the rest of this connection's thread, and
/// returns the file request to carry out with them.
fn as_user(user: &User, request: Request) -> Result<Request, AgentError> {
    if !request.is_file_request() {
        return Err(AgentError::new(
            ErrorKind::InvalidRequest,
            "AsUser carries only a file request (an exec names its user itself)",
        ));
    }
    let account = crate::exec::lookup_user(user)?;
    crate::sys::become_user_on_this_thread(account.uid, account.gid).map_err(|e| {
        AgentError::new(
            ErrorKind::Internal,
            format!("cannot act as {} (uid {}): {e}", account.name, account.uid),
        )
    })?;
    Ok(request)
}

/// How long a shutdown waits for its client to take the answer.
const SHUTDOWN_ANSWER_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// Reads (and discards) until the peer closes, an error, or `grace`.
fn wait_for_hangup(conn: &UnixStream, grace: std::time::Duration) {
    use std::io::Read;
    let deadline = std::time::Instant::now() + grace;
    let mut buf = [0u8; 256];
    let mut r = conn;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() || conn.set_read_timeout(Some(left)).is_err() {
            return;
        }
        match r.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
    }
}

fn reply(conn: &UnixStream, resp: Result<Response, AgentError>) -> Result<(), AgentError> {
    let resp = resp?;
    // A client that left needs no answer.
    let _ = send(conn, &resp);
    Ok(())
}

fn reply_error(conn: &UnixStream, error: AgentError) {
    let _ = send(conn, &Response::Error { error });
}
