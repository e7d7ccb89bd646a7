//! Control messages, carried as JSON in [`FrameKind::Control`] frames.
//!
//! Conversation on one connection (one request per connection):
//!
//! 1. agent → client: [`Hello`].
//! 2. client → agent: [`Request`].
//! 3. per request:
//!    - `Exec`: if `stdin` is set the client streams `Data` frames and one
//!      `Eof`; the agent streams `Stdout`/`Stderr` frames, then
//!      `Response::Exec`.
//!    - `ReadFile`, `DownloadTar`: the agent streams `Data` frames, then
//!      `Response::Done { bytes }` (with `max_bytes`, an
//!      `ErrorKind::TooLarge` error instead once that much was sent, or
//!      before any data when the size is known to be over).
//!    - `WriteFile`, `UploadTar`: the agent answers `Response::Ready` (or an
//!      error), the client streams `Data` frames and one `Eof`, the agent
//!      answers `Response::Done { bytes }`.
//!    - `AsUser`: what its file request's conversation is.
//!    - `AfterFork`: one `Response::AfterFork`, sent only once the clock
//!      is set, the RNG reseeded and the execs cut off by the fork have
//!      ended (see [`AfterForkReport`]).
//!    - `ListDir`: zero or more `Response::Entries` batches (each frame
//!      stays under the frame limit), then `Response::Done { bytes }` with
//!      the number of entries.
//!    - `ConnectPort`: `Response::Ready` once the agent is connected to the
//!      guest port; from then on the connection carries raw bytes both
//!      ways (no frames) until either side closes.
//!    - `Spawn`: `Response::Spawned { pid }` at once; the command runs on
//!      in the background, its output kept in a bounded buffer.
//!    - `ProcessStdin`: like `WriteFile` (`Ready`, `Data`… `Eof`, `Done`).
//!    - `AttachProcess`: the buffered output as `Stdout`/`Stderr` frames,
//!      with `follow` then the live output until the process ends, then
//!      `Response::Attached`.
//!    - the others: one response.
//!
//! Any step may be replaced by `Response::Error`, after which the agent
//! closes the connection.
//!
//! [`FrameKind::Control`]: crate::FrameKind::Control

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Sent by the agent first on every connection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    pub protocol_version: u32,
    pub agent_version: String,
    pub boot: BootInfo,
}

/// Only the version of a [`Hello`]: parsed first, so that a client can
/// report a version mismatch even if the rest of the message changed shape.
#[derive(Debug, Clone, Copy, Deserialize)]
pub struct HelloVersion {
    pub protocol_version: u32,
}

/// What the agent knows about the boot it ran.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BootInfo {
    /// Whether the agent runs as PID 1 (false for `serve --listen`).
    pub pid1: bool,
    /// Kernel release (`uname -r`).
    pub kernel: String,
    /// The root device mounted under the overlay, if any.
    pub root_device: Option<String>,
    /// Time from agent start to serving, in milliseconds.
    pub boot_ms: u64,
    /// Kernel modules that failed to load (logged, not fatal).
    pub module_failures: Vec<String>,
}

/// One request per connection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "op")]
pub enum Request {
    Ping,
    /// Sync and power off (outside PID 1: exit the agent).
    Shutdown,
    Exec {
        exec: ExecRequest,
        /// The client streams stdin (`Data` frames then `Eof`); otherwise
        /// the command's stdin is `/dev/null`.
        stdin: bool,
    },
    ReadFile {
        path: String,
        /// Stop past this many bytes: a regular file known to be larger
        /// is refused before any data ([`ErrorKind::TooLarge`]); a stream
        /// that grows past it ends with that error after `max_bytes` of
        /// data. The client enforces it too: the agent is not trusted.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        max_bytes: Option<u64>,
    },
    WriteFile {
        path: String,
        mode: u32,
        /// Create missing parent directories (`mkdir -p`); otherwise a
        /// missing parent is `NotFound`.
        create_parents: bool,
    },
    ListDir {
        path: String,
    },
    Stat {
        path: String,
    },
    /// `mkdir -p`.
    Mkdir {
        path: String,
        mode: u32,
    },
    Remove {
        path: String,
        recursive: bool,
    },
    DownloadTar {
        path: String,
        /// As for `ReadFile`: the archive ends with
        /// [`ErrorKind::TooLarge`] once it would pass this many bytes.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        max_bytes: Option<u64>,
    },
    UploadTar {
        path: String,
    },
    /// Sent by the host to a fork child or a restored VM before anything
    /// else: set the guest clock to `unix_time_ns` (`CLOCK_REALTIME`),
    /// credit `entropy` to the kernel RNG and reseed it, and report the
    /// execs the fork cut off. Outside PID 1 the clock and RNG steps are
    /// skipped (the agent would be changing its host).
    AfterFork {
        unix_time_ns: u64,
        /// Fresh host randomness, at least [`MIN_AFTER_FORK_ENTROPY`] bytes
        /// (derived from `seed` when the fork was seeded).
        entropy: Vec<u8>,
        /// The child's seed, when the fork was given one: the guest gets it
        /// as `FORKBOX_SEED` in every later command's environment and in
        /// [`SEED_FILE`].
        #[serde(default, skip_serializing_if = "Option::is_none")]
        seed: Option<u64>,
    },
    /// Only to an agent serving a sandbox in `container` mode (gVisor),
    /// before the host checkpoints it: gVisor cannot save a socket bound
    /// to a host file, so the agent closes its listener, waits (at most
    /// `timeout_ms`) until this is its only connection, answers `Ok` and
    /// closes it. It takes no connection until the host writes one byte
    /// to its stdin (after the checkpoint); a copy restored from the
    /// checkpoint waits the same way on its own stdin.
    Quiesce {
        timeout_ms: u64,
    },
    /// Connect to `127.0.0.1:port` inside the guest and relay raw bytes
    /// (a dev server, a browser's debugging port). Refused:
    /// [`ErrorKind::ConnectionRefused`].
    ConnectPort {
        port: u16,
    },
    /// Start a command in the background (stdin is a pipe kept open until
    /// `ProcessStdin { close: true }`); it outlives this connection.
    Spawn {
        exec: ExecRequest,
    },
    /// Background processes (running or recently ended) and the execs
    /// running with a client.
    ListProcesses,
    /// Wait for a background process to end, at most `timeout` (none:
    /// until it ends).
    WaitProcess {
        pid: u32,
        #[serde(default)]
        timeout: Option<Duration>,
    },
    /// Send `signal` to the process group of a running process.
    KillProcess {
        pid: u32,
        signal: i32,
    },
    /// Stream bytes to a background process's stdin; with `close`, close
    /// its stdin after them.
    ProcessStdin {
        pid: u32,
        close: bool,
    },
    /// The output of a background process so far; with `follow`, then
    /// its output as it comes until it ends.
    AttachProcess {
        pid: u32,
        follow: bool,
    },
    /// Make `paths` unchangeable by anyone but root: everything under
    /// them (links not followed) becomes root's, without write permission
    /// for group and others, and immutable (`chattr +i`; links, devices
    /// and FIFOs are covered by their directory's immutability), so no
    /// other user can write, rename or remove a protected path, even in
    /// a directory it owns. A missing path is `NotFound`; a file system
    /// without the immutable attribute is an error.
    Protect {
        paths: Vec<String>,
    },
    /// Everything under `paths` (links not followed), in path order:
    /// `Digests` batches, then `Done` with the count. A missing path has
    /// no entries.
    Digest {
        paths: Vec<String>,
    },
    /// A file request (`ReadFile`, `WriteFile`, `ListDir`, `Stat`,
    /// `Mkdir`, `Remove`, `DownloadTar`, `UploadTar`) carried out with
    /// `user`'s rights: the kernel checks every path, link and directory
    /// it walks as that user's, so a link to where `user` may not go is
    /// refused ([`ErrorKind::PermissionDenied`]), and what it creates is
    /// `user`'s. Without it, file requests act as root.
    AsUser {
        user: User,
        request: Box<Request>,
    },
}

impl Request {
    /// Whether this is a file request, which [`Request::AsUser`] may carry.
    pub fn is_file_request(&self) -> bool {
        matches!(
            self,
            Request::ReadFile { .. }
                | Request::WriteFile { .. }
                | Request::ListDir { .. }
                | Request::Stat { .. }
                | Request::Mkdir { .. }
                | Request::Remove { .. }
                | Request::DownloadTar { .. }
                | Request::UploadTar { .. }
        )
    }
}

/// A process the agent tracks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessInfo {
    /// Process id (and process group id) in the guest.
    pub pid: u32,
    pub command: Command,
    /// Started by `Spawn` (otherwise an exec with a live client).
    pub background: bool,
    /// How long it has run (until it ended, if it did).
    pub ran_for: Duration,
    /// How it ended; `None` while it runs.
    pub result: Option<ExecResult>,
}

/// Where a seeded fork child's guest finds its seed (decimal, a newline).
pub const SEED_FILE: &str = "/run/forkbox/seed";

/// Fewest entropy bytes an `AfterFork` request may carry (512 bits: the
/// kernel credits at most this much per `RNDADDENTROPY` towards a reseed).
pub const MIN_AFTER_FORK_ENTROPY: usize = 64;

/// What one step of the after-fork hook did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "status")]
pub enum HookStep {
    Done {
        detail: String,
    },
    /// Deliberately not done (e.g. not PID 1); `reason` says why.
    Skipped {
        reason: String,
    },
}

impl HookStep {
    pub fn is_done(&self) -> bool {
        matches!(self, Self::Done { .. })
    }
}

/// An exec that was running when the VM forked.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForkedExec {
    /// The agent's id for the exec (unique within one boot's lineage).
    pub exec_id: u64,
    pub command: Command,
    /// Process id (and process group id) of the command in the guest.
    pub pid: u32,
    /// How long the command had run when the hook looked at it (for an
    /// interrupted one: until it ended).
    pub ran_for: Duration,
    /// How it ended: `None` while it still runs.
    pub status: Option<ExitStatus>,
}

/// The answer to `AfterFork`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AfterForkReport {
    pub clock: HookStep,
    /// Guest clock minus host time before the clock was set, in
    /// nanoseconds (negative: the guest was behind, e.g. by the age of a
    /// snapshot).
    pub clock_offset_ns: i64,
    pub rng: HookStep,
    /// Execs whose client connection the fork reset: the agent killed
    /// their process groups (their output had nowhere to go) and reports
    /// them here, once, with how they ended. In the parent they ran on.
    pub interrupted: Vec<ForkedExec>,
    /// Execs still running with a live client connection (none in a fork
    /// child: every inherited connection is reset), and background
    /// processes (a fork does not cut them off: the child runs its copy).
    pub still_running: Vec<ForkedExec>,
}

/// What to run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Command {
    /// `argv[0]` is looked up in `PATH`.
    Argv(Vec<String>),
    /// Run with `/bin/sh -c`.
    Shell(String),
}

impl Default for Command {
    fn default() -> Self {
        Self::Argv(Vec::new())
    }
}

/// Who runs the command.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum User {
    /// A name from the guest's `/etc/passwd`.
    Name(String),
    /// A numeric uid (gid = uid unless `/etc/passwd` says otherwise).
    Uid(u32),
}

/// An exec request. Build with [`ExecRequest::argv`] or
/// [`ExecRequest::shell`] and the chained setters.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecRequest {
    pub command: Command,
    /// Added to (and overriding) the default environment
    /// (`PATH`, `HOME`, `USER`, `LOGNAME`, `TERM`).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Working directory; default `/` (the user's home when `user` is set).
    #[serde(default)]
    pub cwd: Option<String>,
    /// Default: root.
    #[serde(default)]
    pub user: Option<User>,
    /// Wall-clock limit; on expiry the whole process group is killed.
    #[serde(default)]
    pub timeout: Option<Duration>,
    /// Per-stream cap in bytes; output beyond it is counted and dropped.
    #[serde(default)]
    pub output_cap: Option<u64>,
}

impl ExecRequest {
    pub fn argv<I, S>(argv: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self {
            command: Command::Argv(argv.into_iter().map(Into::into).collect()),
            ..Self::default()
        }
    }

    pub fn shell(script: impl Into<String>) -> Self {
        Self {
            command: Command::Shell(script.into()),
            ..Self::default()
        }
    }

    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.insert(key.into(), value.into());
        self
    }

    pub fn cwd(mut self, cwd: impl Into<String>) -> Self {
        self.cwd = Some(cwd.into());
        self
    }

    pub fn user(mut self, user: User) -> Self {
        self.user = Some(user);
        self
    }

    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    pub fn output_cap(mut self, bytes: u64) -> Self {
        self.output_cap = Some(bytes);
        self
    }
}

/// Which output stream a chunk came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OutputStream {
    Stdout,
    Stderr,
}

/// How the command ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExitStatus {
    /// Exited with this code.
    Code(i32),
    /// Killed by this signal.
    Signal(i32),
}

/// Output accounting of one stream.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamSummary {
    /// Bytes the command wrote, including dropped ones.
    pub total_bytes: u64,
    /// Whether bytes beyond the cap were dropped.
    pub truncated: bool,
}

/// The outcome of an exec.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecResult {
    pub status: ExitStatus,
    pub timed_out: bool,
    pub duration: Duration,
    pub stdout: StreamSummary,
    pub stderr: StreamSummary,
}

impl ExecResult {
    /// The exit code, `None` if a signal ended the command.
    pub fn exit_code(&self) -> Option<i32> {
        match self.status {
            ExitStatus::Code(c) => Some(c),
            ExitStatus::Signal(_) => None,
        }
    }

    /// The signal that ended the command, if any.
    pub fn signal(&self) -> Option<i32> {
        match self.status {
            ExitStatus::Code(_) => None,
            ExitStatus::Signal(s) => Some(s),
        }
    }

    pub fn success(&self) -> bool {
        self.status == ExitStatus::Code(0) && !self.timed_out
    }
}

/// File type as seen by `lstat`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FileKind {
    File,
    Dir,
    Symlink,
    Other,
}

/// `lstat` of a path (symlinks are not followed).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileStat {
    pub kind: FileKind,
    pub size: u64,
    /// Permission bits (`st_mode & 0o7777`).
    pub mode: u32,
    /// Seconds since the Unix epoch.
    pub mtime: i64,
    pub uid: u32,
    pub gid: u32,
}

/// One directory entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirEntry {
    pub name: String,
    pub stat: FileStat,
}

/// One file, directory or link under a protected path, as `Digest`
/// records it: two records are equal exactly when nothing about it that
/// matters to a grader changed (its modification time is left out).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct DigestEntry {
    pub path: String,
    pub kind: FileKind,
    /// Permission bits (`st_mode & 0o7777`).
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub size: u64,
    /// A file's SHA-256 (hex), a link's target; empty for anything else.
    pub content: String,
}

/// Agent → client, after the request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "type")]
pub enum Response {
    Pong,
    /// Generic success (mkdir, remove, shutdown).
    Ok,
    /// The agent is ready for the client's data stream.
    Ready,
    /// A data transfer finished; `bytes` of file or tar data moved.
    Done {
        bytes: u64,
    },
    Exec {
        result: ExecResult,
    },
    Entries {
        entries: Vec<DirEntry>,
    },
    Digests {
        entries: Vec<DigestEntry>,
    },
    Stat {
        stat: FileStat,
    },
    AfterFork {
        report: AfterForkReport,
    },
    /// A background process started.
    Spawned {
        pid: u32,
    },
    Processes {
        processes: Vec<ProcessInfo>,
    },
    /// The end of a `WaitProcess`: `None` if it still ran at the timeout.
    Waited {
        result: Option<ExecResult>,
    },
    /// The end of an `AttachProcess`: `dropped` bytes of output had left
    /// the bounded buffer before they could be sent; `result` is `None`
    /// while the process runs (without `follow`).
    Attached {
        dropped: u64,
        result: Option<ExecResult>,
    },
    Error {
        error: AgentError,
    },
}

/// A typed error reported by the agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{kind:?}: {message}")]
pub struct AgentError {
    pub kind: ErrorKind,
    pub message: String,
}

impl AgentError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }
}

/// Class of an [`AgentError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    NotFound,
    PermissionDenied,
    AlreadyExists,
    NotADirectory,
    IsADirectory,
    DirectoryNotEmpty,
    InvalidRequest,
    /// Nothing listens on the guest port.
    ConnectionRefused,
    /// A read or archive is larger than the `max_bytes` the client asked
    /// for. Sent only to a client that set `max_bytes`, so an older
    /// client never sees it.
    TooLarge,
    /// A frame or message the agent could not decode.
    Protocol,
    Io,
    Internal,
}

impl ErrorKind {
    /// Maps an I/O error kind onto the protocol's error kinds.
    pub fn from_io(kind: std::io::ErrorKind) -> Self {
        use std::io::ErrorKind as K;
        match kind {
            K::NotFound => Self::NotFound,
            K::PermissionDenied => Self::PermissionDenied,
            K::AlreadyExists => Self::AlreadyExists,
            K::NotADirectory => Self::NotADirectory,
            K::IsADirectory => Self::IsADirectory,
            K::DirectoryNotEmpty => Self::DirectoryNotEmpty,
            K::InvalidInput | K::InvalidData => Self::InvalidRequest,
            K::ConnectionRefused => Self::ConnectionRefused,
            _ => Self::Io,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exec_request_builder_sets_fields() {
        let r = ExecRequest::argv(["ls", "-l"])
            .timeout(Duration::from_secs(5))
            .env("A", "b")
            .cwd("/tmp")
            .output_cap(10);
        assert_eq!(r.command, Command::Argv(vec!["ls".into(), "-l".into()]));
        assert_eq!(r.timeout, Some(Duration::from_secs(5)));
        assert_eq!(r.env.get("A").map(String::as_str), Some("b"));
        assert_eq!(r.cwd.as_deref(), Some("/tmp"));
        assert_eq!(r.output_cap, Some(10));
    }

    #[test]
    fn request_json_roundtrip_preserves_exec() {
        let req = Request::Exec {
            exec: ExecRequest::shell("echo hi").user(User::Uid(1000)),
            stdin: true,
        };
        let json = serde_json::to_vec(&req).expect("serialize");
        let back: Request = serde_json::from_slice(&json).expect("deserialize");
        assert_eq!(back, req);
    }

    #[test]
    fn after_fork_report_json_roundtrip() {
        let resp = Response::AfterFork {
            report: AfterForkReport {
                clock: HookStep::Done {
                    detail: "set".into(),
                },
                clock_offset_ns: -5_000_000_000,
                rng: HookStep::Skipped {
                    reason: "not PID 1".into(),
                },
                interrupted: vec![ForkedExec {
                    exec_id: 3,
                    command: Command::Shell("sleep 9".into()),
                    pid: 77,
                    ran_for: Duration::from_millis(1500),
                    status: Some(ExitStatus::Signal(9)),
                }],
                still_running: Vec::new(),
            },
        };
        let json = serde_json::to_vec(&resp).expect("serialize");
        let back: Response = serde_json::from_slice(&json).expect("deserialize");
        assert_eq!(back, resp);
    }

    #[test]
    fn process_requests_json_roundtrip() {
        for req in [
            Request::ConnectPort { port: 8000 },
            Request::Spawn {
                exec: ExecRequest::shell("sleep 1"),
            },
            Request::WaitProcess {
                pid: 7,
                timeout: Some(Duration::from_millis(250)),
            },
            Request::AttachProcess {
                pid: 7,
                follow: true,
            },
            Request::AsUser {
                user: User::Name("user".into()),
                request: Box::new(Request::ReadFile {
                    path: "/work/answer".into(),
                    max_bytes: Some(10),
                }),
            },
        ] {
            let json = serde_json::to_vec(&req).expect("serialize");
            let back: Request = serde_json::from_slice(&json).expect("deserialize");
            assert_eq!(back, req);
        }
    }

    #[test]
    fn hello_version_parses_from_future_hello() {
        let json = br#"{"protocol_version":99,"something_new":[1,2]}"#;
        let v: HelloVersion = serde_json::from_slice(json).expect("parse");
        assert_eq!(v.protocol_version, 99);
    }

    #[test]
    fn exec_result_signal_has_no_exit_code() {
        let r = ExecResult {
            status: ExitStatus::Signal(9),
            timed_out: false,
            duration: Duration::ZERO,
            stdout: StreamSummary::default(),
            stderr: StreamSummary::default(),
        };
        assert_eq!(r.exit_code(), None);
        assert_eq!(r.signal(), Some(9));
        assert!(!r.success());
    }
}
