//! Blocking host-side client: one connection per request.
//!
//! Reaches the agent either through the VMM's hybrid vsock unix socket
//! (`CONNECT <port>\n` → `OK <port>\n`, then frames) or through a direct
//! unix socket (tests, `forkbox-agent serve --listen unix:PATH`).

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::thread;
use std::time::{Duration, Instant};

use crate::frame::{read_frame, write_frame, Frame, FrameError, FrameKind};
use crate::msg::{
    AfterForkReport, AgentError, DigestEntry, DirEntry, ExecRequest, ExecResult, FileStat, Hello,
    HelloVersion, OutputStream, ProcessInfo, Request, Response, User,
};
use crate::{decode_control, encode_control, DATA_CHUNK, MAX_FRAME_LEN, PROTOCOL_VERSION};

/// Why a call to the agent failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot connect to {path}")]
    Connect {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("agent not ready: {reason}")]
    NotReady { reason: String },
    #[error("protocol version mismatch: client speaks {client}, agent speaks {agent}")]
    VersionMismatch { client: u32, agent: u32 },
    #[error("connection dropped mid-call: the sandbox died or the agent crashed mid-call")]
    Disconnected(#[source] io::Error),
    #[error("agent reported an error")]
    Agent(#[source] AgentError),
    #[error("malformed frame from the agent")]
    Frame(#[source] FrameError),
    #[error("malformed message from the agent: {0}")]
    Malformed(String),
    #[error("local I/O failed")]
    Local(#[source] io::Error),
    /// The call's deadline ([`AgentClient::with_call_timeout`]) passed
    /// with the agent still owing an answer (or not reading ours).
    #[error("the agent did not finish the call within {after:?}")]
    TimedOut { after: Duration },
    /// The agent sent more than the `max_bytes` the call allowed; the
    /// client stopped reading at the limit and closed the connection.
    #[error("the agent sent more than the limit of {limit} bytes")]
    TooLarge { limit: u64 },
    /// A directory listing went past [`MAX_DIR_ENTRIES`]; the client
    /// stopped reading there.
    #[error(
        "the directory has more than {limit} entries: list a smaller one, or download it as a tar"
    )]
    TooManyEntries { limit: usize },
}

/// Most entries one `list_dir` gathers: a hostile agent cannot make the
/// caller hold an endless listing until the call's deadline.
pub const MAX_DIR_ENTRIES: usize = 100_000;

impl ClientError {
    /// The agent's typed error, if the agent reported one.
    pub fn agent_error(&self) -> Option<&AgentError> {
        match self {
            Self::Agent(e) => Some(e),
            _ => None,
        }
    }
}

#[derive(Debug, Clone)]
enum Target {
    HybridVsock { uds: PathBuf, port: u32 },
    Unix(PathBuf),
}

/// A handle on one sandbox's agent. Cheap to clone; every call opens its
/// own connection, so calls may run concurrently from several threads.
#[derive(Debug, Clone)]
pub struct AgentClient {
    target: Target,
    handshake_timeout: Duration,
    call_timeout: Option<Duration>,
    /// Whose rights file requests act with (`None`: root).
    file_user: Option<User>,
}

/// Default bound on connecting and receiving the agent's [`Hello`].
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest accepted `OK <port>` line from the VMM.
const MAX_CONNECT_LINE: usize = 64;
/// Pause between attempts in [`AgentClient::wait_ready`].
const RETRY_PAUSE: Duration = Duration::from_millis(10);

impl AgentClient {
    /// Through the VMM's hybrid vsock socket at `uds`, to guest port `port`.
    pub fn hybrid_vsock(uds: impl Into<PathBuf>, port: u32) -> Self {
        Self {
            target: Target::HybridVsock {
                uds: uds.into(),
                port,
            },
            handshake_timeout: HANDSHAKE_TIMEOUT,
            call_timeout: None,
            file_user: None,
        }
    }

    /// Directly to an agent listening on a unix socket.
    pub fn unix(path: impl Into<PathBuf>) -> Self {
        Self {
            target: Target::Unix(path.into()),
            handshake_timeout: HANDSHAKE_TIMEOUT,
            call_timeout: None,
            file_user: None,
        }
    }

    /// Bounds connecting plus receiving the agent's `Hello` (default 5 s).
    pub fn with_handshake_timeout(mut self, timeout: Duration) -> Self {
        self.handshake_timeout = timeout;
        self
    }

    /// Bounds every call, from connecting to its last answer, by
    /// `timeout` (default: no bound). Past it the call fails with
    /// [`ClientError::TimedOut`] and its connection is closed, so a guest
    /// that never answers (or never reads what is sent to it) cannot hold
    /// the calling thread. An overlong `timeout` (past what an `Instant`
    /// holds) is no bound.
    pub fn with_call_timeout(mut self, timeout: Duration) -> Self {
        self.call_timeout = Some(timeout);
        self
    }

    /// File requests from this client act with `user`'s rights
    /// ([`Request::AsUser`]); `None`: as root.
    pub fn with_file_user(mut self, user: Option<User>) -> Self {
        self.file_user = user;
        self
    }

    /// `req` (a file request) as this client's file user sends it.
    fn file_request(&self, req: Request) -> Request {
        match &self.file_user {
            Some(user) => Request::AsUser {
                user: user.clone(),
                request: Box::new(req),
            },
            None => req,
        }
    }

    /// Retries [`ping`](Self::ping) until it succeeds or `timeout` passes.
    /// A version mismatch fails at once.
    pub fn wait_ready(&self, timeout: Duration) -> Result<Hello, ClientError> {
        let start = Instant::now();
        loop {
            match self.ping() {
                Ok(hello) => return Ok(hello),
                Err(e @ ClientError::VersionMismatch { .. }) => return Err(e),
                Err(e) if start.elapsed() >= timeout => {
                    return Err(ClientError::NotReady {
                        reason: format!("not ready after {timeout:?}: {}", crate::error_chain(&e)),
                    })
                }
                Err(_) => thread::sleep(RETRY_PAUSE),
            }
        }
    }

    /// Handshake plus a ping round trip; returns the agent's `Hello`.
    pub fn ping(&self) -> Result<Hello, ClientError> {
        let conn = self.connect()?;
        conn.send(&Request::Ping)?;
        match conn.response()? {
            Response::Pong => Ok(conn.hello),
            other => Err(unexpected(&other)),
        }
    }

    /// Asks the agent to sync and power the VM off.
    pub fn shutdown(&self) -> Result<(), ClientError> {
        let conn = self.connect()?;
        conn.send(&Request::Shutdown)?;
        match conn.response()? {
            Response::Ok => Ok(()),
            other => Err(unexpected(&other)),
        }
    }

    /// Asks an agent in `container` mode to close every connection and
    /// its listener before a checkpoint ([`Request::Quiesce`]), waiting at
    /// most `within` for its other connections to end. Returns once the
    /// agent has closed this one too.
    pub fn quiesce(&self, within: Duration) -> Result<(), ClientError> {
        let conn = self.connect()?;
        conn.send(&Request::Quiesce {
            timeout_ms: u64::try_from(within.as_millis()).unwrap_or(u64::MAX),
        })?;
        match conn.response()? {
            Response::Ok => conn.wait_closed(),
            other => Err(unexpected(&other)),
        }
    }

    /// The after-fork hook: sets the guest clock, reseeds the guest RNG
    /// with `entropy` and reports the execs the fork cut off. Send it to a
    /// fork child or restored VM before anything else.
    pub fn after_fork(
        &self,
        unix_time_ns: u64,
        entropy: Vec<u8>,
    ) -> Result<AfterForkReport, ClientError> {
        self.after_fork_seeded(unix_time_ns, entropy, None)
    }

    /// [`after_fork`](Self::after_fork) that also hands the guest the
    /// child's `seed`.
    pub fn after_fork_seeded(
        &self,
        unix_time_ns: u64,
        entropy: Vec<u8>,
        seed: Option<u64>,
    ) -> Result<AfterForkReport, ClientError> {
        let conn = self.connect()?;
        conn.send(&Request::AfterFork {
            unix_time_ns,
            entropy,
            seed,
        })?;
        match conn.response()? {
            Response::AfterFork { report } => Ok(report),
            other => Err(unexpected(&other)),
        }
    }

    /// Runs a command. Output chunks are passed to `out` as they arrive.
    /// With `stdin`, its bytes are streamed to the command until EOF; the
    /// call returns only once `stdin` reached EOF *and* the command ended,
    /// so do not pass an interactive stream that never ends.
    pub fn exec(
        &self,
        req: &ExecRequest,
        stdin: Option<&mut (dyn Read + Send)>,
        out: &mut dyn FnMut(OutputStream, &[u8]),
    ) -> Result<ExecResult, ClientError> {
        let conn = self.connect()?;
        conn.send(&Request::Exec {
            exec: req.clone(),
            stdin: stdin.is_some(),
        })?;
        let stream = conn.io();
        thread::scope(|scope| {
            let writer = stdin.map(|input| scope.spawn(move || pump_to_agent(input, stream)));
            let result = read_exec_output(&conn, out);
            let stdin_result = match writer {
                Some(handle) => handle.join().unwrap_or_else(|_| {
                    Err(PumpError::Local(io::Error::other("stdin thread panicked")))
                }),
                None => Ok(0),
            };
            let result = result?;
            match stdin_result {
                // The command ended before taking all of stdin: the agent
                // closed the connection under our writes. Not an error.
                Ok(_) | Err(PumpError::Remote(_)) => Ok(result),
                Err(PumpError::Local(e)) => Err(ClientError::Local(e)),
            }
        })
    }

    /// Streams a guest file into `to`; returns its size.
    pub fn read_file(&self, path: &str, to: &mut dyn Write) -> Result<u64, ClientError> {
        self.read_file_max(path, None, to)
    }

    /// [`read_file`](Self::read_file) that stops past `max_bytes`: the
    /// agent is asked to stop there, and whatever it sends beyond is
    /// refused here ([`ClientError::TooLarge`], or the agent's
    /// `ErrorKind::TooLarge`); `to` never gets more than `max_bytes`, and
    /// gets exactly that much from a stream cut for its size (unless the
    /// agent refused before any data, knowing the size).
    pub fn read_file_max(
        &self,
        path: &str,
        max_bytes: Option<u64>,
        to: &mut dyn Write,
    ) -> Result<u64, ClientError> {
        let conn = self.connect()?;
        conn.send(&self.file_request(Request::ReadFile {
            path: path.into(),
            max_bytes,
        }))?;
        conn.receive_data(to, max_bytes)
    }

    /// Writes `from` into a guest file with permission bits `mode`. The
    /// parent directory must exist.
    pub fn write_file(
        &self,
        path: &str,
        mode: u32,
        from: &mut dyn Read,
    ) -> Result<u64, ClientError> {
        self.write_file_with(path, mode, false, from)
    }

    /// Like [`write_file`](Self::write_file), creating missing parent
    /// directories if `create_parents`.
    pub fn write_file_with(
        &self,
        path: &str,
        mode: u32,
        create_parents: bool,
        from: &mut dyn Read,
    ) -> Result<u64, ClientError> {
        let conn = self.connect()?;
        conn.send(&self.file_request(Request::WriteFile {
            path: path.into(),
            mode,
            create_parents,
        }))?;
        conn.send_data(from)
    }

    /// Lists a directory (entries are `lstat`ed; `.` and `..` omitted).
    pub fn list_dir(&self, path: &str) -> Result<Vec<DirEntry>, ClientError> {
        let conn = self.connect()?;
        conn.send(&self.file_request(Request::ListDir { path: path.into() }))?;
        conn.batches(|r| match r {
            Response::Entries { entries } => Ok(entries),
            other => Err(other),
        })
    }

    /// Makes `paths` unchangeable by anyone but root (see
    /// [`Request::Protect`]).
    pub fn protect(&self, paths: &[String]) -> Result<(), ClientError> {
        let conn = self.connect()?;
        conn.send(&Request::Protect {
            paths: paths.to_vec(),
        })?;
        match conn.response()? {
            Response::Ok => Ok(()),
            other => Err(unexpected(&other)),
        }
    }

    /// What is under `paths` now, in path order (see [`Request::Digest`]);
    /// at most [`MAX_DIR_ENTRIES`] entries.
    pub fn digest(&self, paths: &[String]) -> Result<Vec<DigestEntry>, ClientError> {
        let conn = self.connect()?;
        conn.send(&Request::Digest {
            paths: paths.to_vec(),
        })?;
        conn.batches(|r| match r {
            Response::Digests { entries } => Ok(entries),
            other => Err(other),
        })
    }

    /// `lstat` of a guest path.
    pub fn stat(&self, path: &str) -> Result<FileStat, ClientError> {
        let conn = self.connect()?;
        conn.send(&self.file_request(Request::Stat { path: path.into() }))?;
        match conn.response()? {
            Response::Stat { stat } => Ok(stat),
            other => Err(unexpected(&other)),
        }
    }

    /// `mkdir -p` with permission bits `mode` for created directories.
    pub fn mkdir(&self, path: &str, mode: u32) -> Result<(), ClientError> {
        self.simple(self.file_request(Request::Mkdir {
            path: path.into(),
            mode,
        }))
    }

    /// Removes a file, symlink or empty directory; with `recursive`, a
    /// whole tree.
    pub fn remove(&self, path: &str, recursive: bool) -> Result<(), ClientError> {
        self.simple(self.file_request(Request::Remove {
            path: path.into(),
            recursive,
        }))
    }

    /// Streams guest directory `dir` as a tar archive into `to`; returns
    /// the archive size.
    pub fn download_tar(&self, dir: &str, to: &mut dyn Write) -> Result<u64, ClientError> {
        self.download_tar_max(dir, None, to)
    }

    /// [`download_tar`](Self::download_tar) that stops past `max_bytes`,
    /// as [`read_file_max`](Self::read_file_max) does.
    pub fn download_tar_max(
        &self,
        dir: &str,
        max_bytes: Option<u64>,
        to: &mut dyn Write,
    ) -> Result<u64, ClientError> {
        let conn = self.connect()?;
        conn.send(&self.file_request(Request::DownloadTar {
            path: dir.into(),
            max_bytes,
        }))?;
        conn.receive_data(to, max_bytes)
    }

    /// Unpacks the tar archive read from `from` into guest directory `dir`
    /// (created if missing). Entries escaping `dir` are refused.
    pub fn upload_tar(&self, dir: &str, from: &mut dyn Read) -> Result<u64, ClientError> {
        let conn = self.connect()?;
        conn.send(&self.file_request(Request::UploadTar { path: dir.into() }))?;
        conn.send_data(from)
    }

    /// Connects to `127.0.0.1:port` inside the guest. The returned stream
    /// carries the raw bytes of that TCP connection both ways. Nothing
    /// listening is an agent error of kind `ConnectionRefused`.
    pub fn connect_port(&self, port: u16) -> Result<UnixStream, ClientError> {
        let conn = self.connect()?;
        conn.send(&Request::ConnectPort { port })?;
        match conn.response()? {
            // The relay that follows is the caller's to bound.
            Response::Ready => {
                conn.stream
                    .set_read_timeout(None)
                    .and_then(|()| conn.stream.set_write_timeout(None))
                    .map_err(ClientError::Local)?;
                Ok(conn.stream)
            }
            other => Err(unexpected(&other)),
        }
    }

    /// Starts a command in the background; returns its guest pid.
    pub fn spawn(&self, req: &ExecRequest) -> Result<u32, ClientError> {
        let conn = self.connect()?;
        conn.send(&Request::Spawn { exec: req.clone() })?;
        match conn.response()? {
            Response::Spawned { pid } => Ok(pid),
            other => Err(unexpected(&other)),
        }
    }

    /// Background processes (running or recently ended) and running execs.
    pub fn processes(&self) -> Result<Vec<ProcessInfo>, ClientError> {
        let conn = self.connect()?;
        conn.send(&Request::ListProcesses)?;
        match conn.response()? {
            Response::Processes { processes } => Ok(processes),
            other => Err(unexpected(&other)),
        }
    }

    /// Waits for background process `pid` to end, at most `timeout`;
    /// `None` if it still runs then.
    pub fn wait_process(
        &self,
        pid: u32,
        timeout: Option<Duration>,
    ) -> Result<Option<ExecResult>, ClientError> {
        let conn = self.connect()?;
        conn.send(&Request::WaitProcess { pid, timeout })?;
        match conn.response()? {
            Response::Waited { result } => Ok(result),
            other => Err(unexpected(&other)),
        }
    }

    /// Sends `signal` to the process group of process `pid`.
    pub fn kill_process(&self, pid: u32, signal: i32) -> Result<(), ClientError> {
        self.simple(Request::KillProcess { pid, signal })
    }

    /// Writes `from` to the stdin of background process `pid`; with
    /// `close`, closes its stdin after. Returns the bytes written.
    pub fn process_stdin(
        &self,
        pid: u32,
        close: bool,
        from: &mut dyn Read,
    ) -> Result<u64, ClientError> {
        let conn = self.connect()?;
        conn.send(&Request::ProcessStdin { pid, close })?;
        conn.send_data(from)
    }

    /// The buffered output of background process `pid`, passed to `out`;
    /// with `follow`, then its output as it comes until it ends. Returns
    /// the bytes lost to the bounded buffer and the result, if it ended.
    pub fn attach_process(
        &self,
        pid: u32,
        follow: bool,
        out: &mut dyn FnMut(OutputStream, &[u8]),
    ) -> Result<(u64, Option<ExecResult>), ClientError> {
        let conn = self.connect()?;
        conn.send(&Request::AttachProcess { pid, follow })?;
        loop {
            let frame = conn.frame()?;
            match frame.kind {
                FrameKind::Stdout => out(OutputStream::Stdout, &frame.body),
                FrameKind::Stderr => out(OutputStream::Stderr, &frame.body),
                FrameKind::Control => {
                    return match parse_response(&frame.body)? {
                        Response::Attached { dropped, result } => Ok((dropped, result)),
                        other => Err(unexpected(&other)),
                    }
                }
                kind => {
                    return Err(ClientError::Malformed(format!(
                        "unexpected {kind:?} frame while attached"
                    )))
                }
            }
        }
    }

    fn simple(&self, req: Request) -> Result<(), ClientError> {
        let conn = self.connect()?;
        conn.send(&req)?;
        match conn.response()? {
            Response::Ok => Ok(()),
            other => Err(unexpected(&other)),
        }
    }

    fn connect(&self) -> Result<Conn, ClientError> {
        let deadline = self.call_timeout.and_then(|after| {
            Instant::now()
                .checked_add(after)
                .map(|at| Deadline { at, after })
        });
        let path = match &self.target {
            Target::HybridVsock { uds, .. } => uds,
            Target::Unix(p) => p,
        };
        let stream = UnixStream::connect(path).map_err(|source| ClientError::Connect {
            path: path.clone(),
            source,
        })?;
        let timeout = Some(self.handshake_timeout).filter(|t| !t.is_zero());
        let timeout = match (timeout, deadline) {
            (_, Some(d)) if d.left().is_zero() => return Err(d.passed()),
            (Some(t), Some(d)) => Some(t.min(d.left())),
            (None, Some(d)) => Some(d.left()),
            (t, None) => t,
        };
        stream
            .set_read_timeout(timeout)
            .map_err(ClientError::Local)?;
        if let Target::HybridVsock { port, .. } = &self.target {
            hybrid_handshake(&stream, *port)?;
        }
        let hello = read_hello(&stream)?;
        stream.set_read_timeout(None).map_err(ClientError::Local)?;
        Ok(Conn {
            stream,
            hello,
            deadline,
        })
    }
}

fn hybrid_handshake(mut stream: &UnixStream, port: u32) -> Result<(), ClientError> {
    stream
        .write_all(format!("CONNECT {port}\n").as_bytes())
        .map_err(|e| ClientError::NotReady {
            reason: format!("VMM refused CONNECT: {e}"),
        })?;
    // Byte by byte: frames follow the line directly and must stay unread.
    let mut line = Vec::with_capacity(MAX_CONNECT_LINE);
    let mut byte = [0u8; 1];
    loop {
        match stream.read(&mut byte) {
            Ok(0) => {
                return Err(ClientError::NotReady {
                    reason: format!("nothing listens on guest port {port} yet"),
                })
            }
            Ok(_) if byte[0] == b'\n' => break,
            Ok(_) if line.len() < MAX_CONNECT_LINE => line.push(byte[0]),
            Ok(_) => {
                return Err(ClientError::NotReady {
                    reason: "overlong reply to CONNECT".into(),
                })
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                return Err(ClientError::NotReady {
                    reason: format!("no reply to CONNECT: {e}"),
                })
            }
        }
    }
    if line.starts_with(b"OK ") {
        Ok(())
    } else {
        Err(ClientError::NotReady {
            reason: format!(
                "VMM answered CONNECT with {:?}",
                String::from_utf8_lossy(&line)
            ),
        })
    }
}

fn read_hello(mut stream: &UnixStream) -> Result<Hello, ClientError> {
    let frame = match read_frame(&mut stream, MAX_FRAME_LEN) {
        Ok(Some(f)) => f,
        Ok(None) => {
            return Err(ClientError::NotReady {
                reason: "connection closed before the agent's hello".into(),
            })
        }
        Err(FrameError::Io(e)) => {
            return Err(ClientError::NotReady {
                reason: format!("no hello from the agent: {e}"),
            })
        }
        Err(e) => return Err(ClientError::Frame(e)),
    };
    if frame.kind != FrameKind::Control {
        return Err(ClientError::Malformed(format!(
            "expected hello, got a {:?} frame",
            frame.kind
        )));
    }
    let version: HelloVersion =
        decode_control(&frame.body).map_err(|e| ClientError::Malformed(format!("hello: {e}")))?;
    if version.protocol_version != PROTOCOL_VERSION {
        return Err(ClientError::VersionMismatch {
            client: PROTOCOL_VERSION,
            agent: version.protocol_version,
        });
    }
    decode_control(&frame.body).map_err(|e| ClientError::Malformed(format!("hello: {e}")))
}

/// When a call must have ended.
#[derive(Debug, Clone, Copy)]
struct Deadline {
    at: Instant,
    /// The call timeout it came from, for the error.
    after: Duration,
}

impl Deadline {
    fn left(&self) -> Duration {
        self.at.saturating_duration_since(Instant::now())
    }

    fn passed(&self) -> ClientError {
        ClientError::TimedOut { after: self.after }
    }
}

/// The connection's socket with the call's deadline applied to every
/// read and write: each waits at most for what is left of the call.
#[derive(Clone, Copy)]
struct Bounded<'a> {
    stream: &'a UnixStream,
    deadline: Option<Deadline>,
}

impl Bounded<'_> {
    /// Sets the socket's timeout (`set`) to what is left of the call.
    fn arm(
        &self,
        set: impl FnOnce(&UnixStream, Option<Duration>) -> io::Result<()>,
    ) -> io::Result<()> {
        let Some(d) = self.deadline else {
            return Ok(());
        };
        let left = d.left();
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the call's deadline passed",
            ));
        }
        set(self.stream, Some(left))
    }

    /// An I/O error that is the deadline passing.
    fn timed_out(&self, e: &io::Error) -> Option<ClientError> {
        let d = self.deadline?;
        let timeout = matches!(
            e.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
        );
        (timeout && d.left().is_zero()).then(|| d.passed())
    }
}

impl Read for Bounded<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.arm(UnixStream::set_read_timeout)?;
        (&mut &*self.stream).read(buf)
    }
}

impl Write for Bounded<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.arm(UnixStream::set_write_timeout)?;
        (&mut &*self.stream).write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// One open connection, past the handshake.
struct Conn {
    stream: UnixStream,
    hello: Hello,
    deadline: Option<Deadline>,
}

impl Conn {
    fn io(&self) -> Bounded<'_> {
        Bounded {
            stream: &self.stream,
            deadline: self.deadline,
        }
    }

    /// A failed write to the agent: the deadline, or a lost connection.
    fn write_failed(&self, e: io::Error) -> ClientError {
        self.io()
            .timed_out(&e)
            .unwrap_or(ClientError::Disconnected(e))
    }

    fn send(&self, req: &Request) -> Result<(), ClientError> {
        write_frame(&mut self.io(), FrameKind::Control, &encode_control(req))
            .map_err(|e| self.write_failed(e))
    }

    fn frame(&self) -> Result<Frame, ClientError> {
        match read_frame(&mut self.io(), MAX_FRAME_LEN) {
            Ok(Some(f)) => Ok(f),
            Ok(None) => Err(ClientError::Disconnected(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "agent closed the connection",
            ))),
            Err(FrameError::Io(e)) => Err(self.write_failed(e)),
            Err(e) => Err(ClientError::Frame(e)),
        }
    }

    /// Waits for the agent to close the connection, sending nothing; more
    /// than a few bytes from it first is a protocol error.
    fn wait_closed(&self) -> Result<(), ClientError> {
        let mut buf = [0u8; 64];
        match self.io().read(&mut buf) {
            Ok(0) => Ok(()),
            Ok(_) => Err(ClientError::Malformed(
                "the agent sent more after its last answer".into(),
            )),
            Err(e) => Err(self.write_failed(e)),
        }
    }

    /// Next control message; an agent error becomes `Err`.
    /// Answers in batches (`batch` takes each one's items, or gives back
    /// what is not a batch) until `Done`; at most [`MAX_DIR_ENTRIES`]
    /// items in all, whatever the agent sends.
    fn batches<T>(
        &self,
        batch: impl Fn(Response) -> Result<Vec<T>, Response>,
    ) -> Result<Vec<T>, ClientError> {
        let mut all = Vec::new();
        loop {
            match batch(self.response()?) {
                Ok(items) => {
                    if all.len() + items.len() > MAX_DIR_ENTRIES {
                        return Err(ClientError::TooManyEntries {
                            limit: MAX_DIR_ENTRIES,
                        });
                    }
                    all.extend(items)
                }
                Err(Response::Done { .. }) => return Ok(all),
                Err(other) => return Err(unexpected(&other)),
            }
        }
    }

    fn response(&self) -> Result<Response, ClientError> {
        let frame = self.frame()?;
        if frame.kind != FrameKind::Control {
            return Err(ClientError::Malformed(format!(
                "expected a response, got a {:?} frame",
                frame.kind
            )));
        }
        parse_response(&frame.body)
    }

    /// `Data` frames into `to` until `Done`; with `max`, refuses (and
    /// stops reading) once more than `max` bytes would have arrived.
    fn receive_data(&self, to: &mut dyn Write, max: Option<u64>) -> Result<u64, ClientError> {
        let mut received = 0u64;
        loop {
            let frame = self.frame()?;
            match frame.kind {
                FrameKind::Data => {
                    let total = received.saturating_add(frame.body.len() as u64);
                    if let Some(limit) = max.filter(|m| total > *m) {
                        // Up to the limit exactly, so that what was cut
                        // for size can be told by its length.
                        let room = (limit - received) as usize;
                        to.write_all(&frame.body[..room])
                            .map_err(ClientError::Local)?;
                        return Err(ClientError::TooLarge { limit });
                    }
                    to.write_all(&frame.body).map_err(ClientError::Local)?;
                    received = total;
                }
                FrameKind::Control => match parse_response(&frame.body)? {
                    Response::Done { bytes } if bytes == received => {
                        to.flush().map_err(ClientError::Local)?;
                        return Ok(bytes);
                    }
                    Response::Done { bytes } => {
                        return Err(ClientError::Malformed(format!(
                            "agent announced {bytes} bytes but sent {received}"
                        )))
                    }
                    other => return Err(unexpected(&other)),
                },
                kind => {
                    return Err(ClientError::Malformed(format!(
                        "unexpected {kind:?} frame in a data stream"
                    )))
                }
            }
        }
    }

    /// Waits for `Ready`, streams `from`, returns the agent's `Done` count.
    fn send_data(&self, from: &mut dyn Read) -> Result<u64, ClientError> {
        match self.response()? {
            Response::Ready => {}
            other => return Err(unexpected(&other)),
        }
        match pump_to_agent(from, self.io()) {
            Ok(_) => {}
            Err(PumpError::Local(e)) => return Err(ClientError::Local(e)),
            Err(PumpError::Remote(e)) if self.io().timed_out(&e).is_some() => {
                return Err(self.write_failed(e))
            }
            // The agent may have stopped reading to report an error.
            Err(PumpError::Remote(e)) => {
                return match self.response() {
                    Err(ClientError::Disconnected(_)) => Err(ClientError::Disconnected(e)),
                    Err(other) => Err(other),
                    Ok(other) => Err(unexpected(&other)),
                }
            }
        }
        match self.response()? {
            Response::Done { bytes } => Ok(bytes),
            other => Err(unexpected(&other)),
        }
    }
}

fn read_exec_output(
    conn: &Conn,
    out: &mut dyn FnMut(OutputStream, &[u8]),
) -> Result<ExecResult, ClientError> {
    loop {
        let frame = conn.frame()?;
        match frame.kind {
            FrameKind::Stdout => out(OutputStream::Stdout, &frame.body),
            FrameKind::Stderr => out(OutputStream::Stderr, &frame.body),
            FrameKind::Control => {
                return match parse_response(&frame.body)? {
                    Response::Exec { result } => Ok(result),
                    other => Err(unexpected(&other)),
                }
            }
            kind => {
                return Err(ClientError::Malformed(format!(
                    "unexpected {kind:?} frame during exec"
                )))
            }
        }
    }
}

enum PumpError {
    /// Reading the caller's input failed.
    Local(io::Error),
    /// Writing to the agent failed.
    Remote(io::Error),
}

/// Copies `from` to the agent as `Data` frames, then one `Eof`.
fn pump_to_agent(from: &mut (dyn Read + '_), mut to: Bounded<'_>) -> Result<u64, PumpError> {
    let mut buf = vec![0u8; DATA_CHUNK];
    let mut sent = 0u64;
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                // Let the agent see a clean end before reporting.
                let _ = write_frame(&mut to, FrameKind::Eof, &[]);
                return Err(PumpError::Local(e));
            }
        };
        write_frame(&mut to, FrameKind::Data, &buf[..n]).map_err(PumpError::Remote)?;
        sent += n as u64;
    }
    write_frame(&mut to, FrameKind::Eof, &[]).map_err(PumpError::Remote)?;
    Ok(sent)
}

fn parse_response(body: &[u8]) -> Result<Response, ClientError> {
    match decode_control::<Response>(body) {
        Ok(Response::Error { error }) => Err(ClientError::Agent(error)),
        Ok(r) => Ok(r),
        Err(e) => Err(ClientError::Malformed(format!("response: {e}"))),
    }
}

fn unexpected(r: &Response) -> ClientError {
    ClientError::Malformed(format!("unexpected response {r:?}"))
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixListener;

    use super::*;
    use crate::msg::{BootInfo, FileKind};

    /// An agent on a unix socket that says hello, reads the request, then
    /// runs `then` on the connection.
    fn fake_agent(
        dir: &std::path::Path,
        then: impl Fn(&mut UnixStream) + Send + 'static,
    ) -> PathBuf {
        let sock = dir.join("agent.sock");
        let listener = UnixListener::bind(&sock).expect("bind");
        thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { return };
                let hello = Hello {
                    protocol_version: PROTOCOL_VERSION,
                    agent_version: "test".into(),
                    boot: BootInfo::default(),
                };
                if write_frame(&mut conn, FrameKind::Control, &encode_control(&hello)).is_err() {
                    continue;
                }
                if read_frame(&mut conn, MAX_FRAME_LEN).is_err() {
                    continue;
                }
                then(&mut conn);
            }
        });
        sock
    }

    #[test]
    fn read_file_max_refuses_an_agent_that_ignores_the_limit() {
        let dir = tempfile::tempdir().expect("tempdir");
        // A hostile agent: endless data, whatever the limit.
        let sock = fake_agent(dir.path(), |conn| {
            let chunk = vec![7u8; 64 * 1024];
            while write_frame(conn, FrameKind::Data, &chunk).is_ok() {}
        });
        let mut got = Vec::new();
        let err = AgentClient::unix(&sock)
            .with_call_timeout(Duration::from_secs(20))
            .read_file_max("/x", Some(100_000), &mut got)
            .expect_err("over");
        assert!(
            matches!(err, ClientError::TooLarge { limit: 100_000 }),
            "{err:?}"
        );
        assert_eq!(got.len(), 100_000, "up to the limit exactly");
    }

    #[test]
    fn list_dir_refuses_an_endless_listing() {
        let dir = tempfile::tempdir().expect("tempdir");
        // A hostile agent: entries without end, never `Done`.
        let sock = fake_agent(dir.path(), |conn| {
            let entries: Vec<DirEntry> = (0..1000)
                .map(|i| DirEntry {
                    name: format!("f{i}"),
                    stat: FileStat {
                        kind: FileKind::File,
                        size: 0,
                        mode: 0o644,
                        mtime: 0,
                        uid: 0,
                        gid: 0,
                    },
                })
                .collect();
            let frame = encode_control(&Response::Entries { entries });
            while write_frame(conn, FrameKind::Control, &frame).is_ok() {}
        });
        let err = AgentClient::unix(&sock)
            .with_call_timeout(Duration::from_secs(60))
            .list_dir("/x")
            .expect_err("endless");
        assert!(
            matches!(
                err,
                ClientError::TooManyEntries {
                    limit: MAX_DIR_ENTRIES
                }
            ),
            "{err:?}"
        );
    }

    #[test]
    fn a_silent_agent_fails_the_call_at_its_deadline() {
        let dir = tempfile::tempdir().expect("tempdir");
        let sock = fake_agent(dir.path(), |conn| {
            // Holds the connection, never answers.
            let mut sink = [0u8; 1];
            let _ = conn.read(&mut sink);
        });
        let err = AgentClient::unix(&sock)
            .with_call_timeout(Duration::from_millis(200))
            .stat("/x")
            .expect_err("silent");
        assert!(matches!(err, ClientError::TimedOut { .. }), "{err:?}");
    }

    #[test]
    fn an_agent_that_never_reads_an_upload_fails_it_at_its_deadline() {
        let dir = tempfile::tempdir().expect("tempdir");
        let sock = fake_agent(dir.path(), |conn| {
            let _ = write_frame(conn, FrameKind::Control, &encode_control(&Response::Ready));
            // Never reads: the client's writes fill the socket and block.
            loop {
                thread::park();
            }
        });
        let data = vec![0u8; 64 << 20];
        let err = AgentClient::unix(&sock)
            .with_call_timeout(Duration::from_millis(300))
            .write_file("/x", 0o644, &mut data.as_slice())
            .expect_err("never read");
        assert!(matches!(err, ClientError::TimedOut { .. }), "{err:?}");
    }

    #[test]
    fn an_overlong_call_timeout_is_no_bound() {
        let dir = tempfile::tempdir().expect("tempdir");
        let sock = fake_agent(dir.path(), |conn| {
            let _ = write_frame(conn, FrameKind::Control, &encode_control(&Response::Pong));
        });
        AgentClient::unix(&sock)
            .with_call_timeout(Duration::MAX)
            .ping()
            .expect("pong");
    }
}
