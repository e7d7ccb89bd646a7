//! Running one command for one connection.
//!
//! Threads per exec: two output pumps (pipe → `Stdout`/`Stderr` frames),
//! one client watcher (stdin frames → pipe, and disconnect detection), and
//! the connection's own thread, which waits for events, enforces the
//! timeout and kills the process group when needed.

use std::collections::BTreeMap;
use std::fs;
use std::io::{self, Write};
use std::os::unix::net::UnixStream;
use std::process::{ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use forkbox_proto::frame::{read_frame, write_frame};
use forkbox_proto::{
    encode_control, AgentError, ErrorKind, ExecRequest, ExecResult, ExitStatus, FrameKind,
    OutputStream, Response, StreamSummary, User, DATA_CHUNK, MAX_FRAME_LEN,
};

use crate::background::Background;
use crate::cgroup::ExecCgroup;
use crate::execs::ExecTable;
use crate::reaper::Reaper;
use crate::sys::{self, WaitStatus};

const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// How long to wait for output pipes to close after the group was killed
/// (a process that left the group may still hold them).
const KILL_GRACE: Duration = Duration::from_secs(2);
/// How often a running exec checks that its client is still connected.
const HANGUP_POLL: Duration = Duration::from_millis(500);
/// Pipe capacity requested for stdout/stderr (large pipes, fewer wakeups).
const PIPE_SIZE: usize = 1 << 20;

/// The connection's write half, shared by the pumps and the final
/// response. `None` once the exec is over: late writers get an error
/// instead of interleaving with whatever follows.
struct Sink(Mutex<Option<UnixStream>>);

impl Sink {
    fn send(&self, kind: FrameKind, body: &[u8]) -> io::Result<()> {
        let mut guard = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        match guard.as_mut() {
            Some(s) => write_frame(s, kind, body),
            None => Err(io::ErrorKind::BrokenPipe.into()),
        }
    }

    fn close(&self) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = None;
    }
}

enum Event {
    Exited(WaitStatus),
    PumpDone(OutputStream, StreamSummary),
    ClientGone,
}

/// A command ready to spawn, with what it runs in.
struct Prepared {
    cmd: Command,
    argv0: String,
    /// Its own cgroup (as PID 1): a bounded one for an unprivileged user.
    /// Dropped once the command has ended.
    cgroup: Option<ExecCgroup>,
}

/// Builds the command for `req`: argv, user, working directory,
/// environment, a new session, its cgroup. `stdin_piped`: stdin is a pipe
/// (else `/dev/null`).
fn prepare(req: &ExecRequest, stdin_piped: bool) -> Result<Prepared, AgentError> {
    let argv = match &req.command {
        forkbox_proto::Command::Argv(v) if v.is_empty() => {
            return Err(AgentError::new(ErrorKind::InvalidRequest, "empty argv"))
        }
        forkbox_proto::Command::Argv(v) => v.clone(),
        forkbox_proto::Command::Shell(s) => vec!["/bin/sh".into(), "-c".into(), s.clone()],
    };
    let account = match &req.user {
        Some(u) => Some(lookup_user(u)?),
        None => None,
    };
    let home = match &account {
        Some(a) => a.home.clone(),
        None => current_home(),
    };
    // Default: the user's home if it exists, else `/`.
    let cwd = req.cwd.clone().unwrap_or_else(|| {
        let home_ok = fs::metadata(&home).map(|m| m.is_dir()).unwrap_or(false);
        if account.is_some() && home_ok {
            home.clone()
        } else {
            "/".into()
        }
    });
    if !fs::metadata(&cwd).map(|m| m.is_dir()).unwrap_or(false) {
        return Err(AgentError::new(
            ErrorKind::NotFound,
            format!("working directory {cwd} is not a directory"),
        ));
    }

    let cwd_c = std::ffi::CString::new(cwd.clone()).map_err(|_| {
        AgentError::new(
            ErrorKind::InvalidRequest,
            "working directory holds a NUL byte",
        )
    })?;
    let mut cmd = Command::new(&argv[0]);
    cmd.args(&argv[1..])
        .env_clear()
        .envs(default_env(&home, account.as_ref()))
        .envs(&req.env)
        .stdin(if stdin_piped {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let unprivileged = account.as_ref().is_some_and(|a| a.uid != 0);
    let cgroup = ExecCgroup::new(unprivileged);
    sys::prepare_child(
        &mut cmd,
        cgroup.as_ref().and_then(ExecCgroup::procs_fd),
        account.as_ref().map(|a| (a.uid, a.gid, a.groups.clone())),
        cwd_c,
    );
    Ok(Prepared {
        cmd,
        argv0: argv[0].clone(),
        cgroup,
    })
}

/// Runs `req`, streaming output to `conn`, and writes the final
/// `Response::Exec`. An `Err` means nothing was started and the caller
/// should report it.
pub fn run(
    conn: &UnixStream,
    reaper: &Reaper,
    execs: &ExecTable,
    req: &ExecRequest,
    stdin_streamed: bool,
) -> Result<(), AgentError> {
    let Prepared {
        mut cmd,
        argv0,
        cgroup,
    } = prepare(req, stdin_streamed)?;
    let out_sock = conn
        .try_clone()
        .map_err(|e| internal("cannot clone connection", &e))?;
    let sink = Arc::new(Sink(Mutex::new(Some(out_sock))));
    let watcher_sock = conn
        .try_clone()
        .map_err(|e| internal("cannot clone connection", &e))?;
    let (tx, rx) = mpsc::channel::<Event>();
    let start = Instant::now();
    let exit_tx = tx.clone();
    let spawned = reaper.spawn(
        &mut cmd,
        Box::new(move |status| {
            let _ = exit_tx.send(Event::Exited(status));
        }),
    );
    let mut child = match spawned {
        Ok(child) => child,
        Err(e) => return spawn_failed(&sink, &argv0, &e, stdin_streamed, conn, start),
    };
    let pgid = child.id();
    let exec_id = conn
        .try_clone()
        .ok()
        .map(|c| execs.register(req.command.clone(), pgid, c));

    // Watch the client: stdin frames, and disconnects.
    let stdin = child.stdin.take();
    let watch_tx = tx.clone();
    spawn_thread("exec-stdin", move || {
        watch_client(watcher_sock, stdin, &watch_tx)
    });

    start_pumps(&mut child, &sink, req.output_cap, &tx);
    drop(tx);
    // `child` is dropped without waiting: the reaper owns its status.
    drop(child);

    let outcome = wait_events(
        &rx,
        Some(conn),
        &Group {
            pgid,
            cgroup: cgroup.as_ref(),
        },
        start,
        req.timeout.and_then(|t| start.checked_add(t)),
    );
    let result = outcome.result(start);
    if let Some(id) = exec_id {
        execs.finished(id, result.status, outcome.client_gone);
    }
    finish(&sink, conn, &Response::Exec { result });
    Ok(())
}

/// Starts `req` in the background: answers `Response::Spawned` on `conn`
/// at once, then (on this thread) waits for it to end and records how.
/// Its output goes to a bounded buffer, its stdin is a pipe kept open.
/// A background process started and answered for: what is left is to
/// wait for its end ([`Spawned::wait`]), with its connection closed.
pub struct Spawned {
    rx: mpsc::Receiver<Event>,
    pgid: u32,
    cgroup: Option<ExecCgroup>,
    start: Instant,
    deadline: Option<Instant>,
    exec_id: u64,
    bg: Arc<Background>,
}

impl Spawned {
    /// Waits for the process (and its output) to end and records how.
    pub fn wait(self, execs: &ExecTable) {
        let outcome = wait_events(
            &self.rx,
            None,
            &Group {
                pgid: self.pgid,
                cgroup: self.cgroup.as_ref(),
            },
            self.start,
            self.deadline,
        );
        let result = outcome.result(self.start);
        execs.finished(self.exec_id, result.status, false);
        self.bg.finish(result);
    }
}

/// Starts a background process and answers with its pid; the caller
/// closes the connection, then waits on the [`Spawned`].
pub fn spawn(
    conn: &UnixStream,
    reaper: &Reaper,
    execs: &ExecTable,
    req: &ExecRequest,
) -> Result<Spawned, AgentError> {
    let Prepared {
        mut cmd,
        argv0,
        cgroup,
    } = prepare(req, true)?;
    let (tx, rx) = mpsc::channel::<Event>();
    let start = Instant::now();
    let exit_tx = tx.clone();
    let mut child = reaper
        .spawn(
            &mut cmd,
            Box::new(move |status| {
                let _ = exit_tx.send(Event::Exited(status));
            }),
        )
        .map_err(|e| match e.kind() {
            io::ErrorKind::NotFound => {
                AgentError::new(ErrorKind::NotFound, format!("{argv0}: command not found"))
            }
            _ => AgentError::new(ErrorKind::from_io(e.kind()), format!("{argv0}: {e}")),
        })?;
    let pgid = child.id();
    let bg = Arc::new(Background::new(child.stdin.take()));
    let exec_id = execs.register_background(req.command.clone(), pgid, Arc::clone(&bg));
    start_pumps(&mut child, &bg, req.output_cap, &tx);
    drop(tx);
    drop(child);
    // The client has its pid; it may go at once.
    let _ = crate::server::send(conn, &Response::Spawned { pid: pgid });
    Ok(Spawned {
        rx,
        pgid,
        cgroup,
        start,
        deadline: req.timeout.and_then(|t| start.checked_add(t)),
        exec_id,
        bg,
    })
}

/// Starts the stdout and stderr pumps of `child` into `sink`.
fn start_pumps<S: OutputSink + 'static>(
    child: &mut std::process::Child,
    sink: &Arc<S>,
    cap: Option<u64>,
    tx: &Sender<Event>,
) {
    for (stream, pipe) in [
        (
            OutputStream::Stdout,
            child
                .stdout
                .take()
                .map(|p| Box::new(p) as Box<dyn ReadPipe>),
        ),
        (
            OutputStream::Stderr,
            child
                .stderr
                .take()
                .map(|p| Box::new(p) as Box<dyn ReadPipe>),
        ),
    ] {
        let Some(pipe) = pipe else {
            let _ = tx.send(Event::PumpDone(stream, StreamSummary::default()));
            continue;
        };
        let _ = sys::set_pipe_size(&pipe.as_fd_ref(), PIPE_SIZE);
        let (sink, tx) = (Arc::clone(sink), tx.clone());
        spawn_thread("exec-pump", move || pump(pipe, stream, cap, &*sink, &tx));
    }
}

/// Sends the final response, then closes the sink and unblocks the watcher.
fn finish(sink: &Sink, conn: &UnixStream, resp: &Response) {
    let _ = sink.send(FrameKind::Control, &encode_control(resp));
    sink.close();
    let _ = conn.shutdown(std::net::Shutdown::Read);
}

/// Where a pump puts output.
pub trait OutputSink: Send + Sync {
    fn output(&self, stream: OutputStream, bytes: &[u8]) -> io::Result<()>;
}

impl OutputSink for Sink {
    fn output(&self, stream: OutputStream, bytes: &[u8]) -> io::Result<()> {
        let kind = match stream {
            OutputStream::Stdout => FrameKind::Stdout,
            OutputStream::Stderr => FrameKind::Stderr,
        };
        self.send(kind, bytes)
    }
}

#[derive(Default)]
struct Outcome {
    status: Option<WaitStatus>,
    duration: Option<Duration>,
    timed_out: bool,
    /// Killed because the client vanished (e.g. a fork reset its connection).
    client_gone: bool,
    stdout: StreamSummary,
    stderr: StreamSummary,
}

impl Outcome {
    fn result(&self, start: Instant) -> ExecResult {
        let status = match self.status {
            Some(WaitStatus::Exited(c)) => ExitStatus::Code(c),
            Some(WaitStatus::Signaled(s)) => ExitStatus::Signal(s),
            // Only if the reaper vanished; report as killed.
            None => ExitStatus::Signal(libc::SIGKILL),
        };
        ExecResult {
            status,
            timed_out: self.timed_out,
            duration: self.duration.unwrap_or_else(|| start.elapsed()),
            stdout: self.stdout,
            stderr: self.stderr,
        }
    }
}

/// Waits for the exit and both pumps, enforcing the deadline; with a
/// client `conn`, kills the group when the client vanishes.
fn wait_events(
    rx: &mpsc::Receiver<Event>,
    conn: Option<&UnixStream>,
    group: &Group<'_>,
    start: Instant,
    deadline: Option<Instant>,
) -> Outcome {
    let mut out = Outcome::default();
    let mut pumps_left = 2;
    // Once set, the group was killed and `deadline` is the grace period.
    let mut killed = false;
    let mut deadline = deadline;
    while out.status.is_none() || pumps_left > 0 {
        let wait = deadline.map_or(HANGUP_POLL, |d| {
            d.saturating_duration_since(Instant::now()).min(HANGUP_POLL)
        });
        let event = match rx.recv_timeout(wait) {
            Ok(ev) => ev,
            Err(RecvTimeoutError::Disconnected) => break,
            Err(RecvTimeoutError::Timeout) => {
                let expired = deadline.is_some_and(|d| Instant::now() >= d);
                if expired && killed {
                    // Grace over: something that left the group holds the
                    // pipes. Stop waiting for them (never for the exit).
                    if out.status.is_some() {
                        break;
                    }
                    deadline = None;
                } else if expired {
                    out.timed_out = true;
                    group.kill();
                    killed = true;
                    deadline = Some(Instant::now() + KILL_GRACE);
                } else if !killed && conn.is_some_and(sys::peer_hung_up) {
                    // The watcher may be stuck writing stdin the command
                    // does not read; notice a vanished client anyway.
                    out.client_gone = true;
                    group.kill();
                    killed = true;
                    deadline = Some(Instant::now() + KILL_GRACE);
                }
                continue;
            }
        };
        match event {
            Event::Exited(status) => {
                out.status = Some(status);
                out.duration = Some(start.elapsed());
            }
            Event::PumpDone(OutputStream::Stdout, s) => {
                out.stdout = s;
                pumps_left -= 1;
            }
            Event::PumpDone(OutputStream::Stderr, s) => {
                out.stderr = s;
                pumps_left -= 1;
            }
            Event::ClientGone => {
                if !killed {
                    out.client_gone = true;
                    group.kill();
                    killed = true;
                    deadline = Some(Instant::now() + KILL_GRACE);
                }
            }
        }
    }
    out
}

/// What a command started: its process group, and its cgroup if it has
/// one.
struct Group<'a> {
    pgid: u32,
    cgroup: Option<&'a ExecCgroup>,
}

impl Group<'_> {
    /// SIGKILL to the process group, and to everything in the cgroup
    /// (what left the group, what forks faster than signals reach it).
    fn kill(&self) {
        // ESRCH (group already gone) is fine.
        let _ = sys::kill_group(self.pgid, libc::SIGKILL);
        if let Some(c) = self.cgroup {
            c.kill();
        }
    }
}

/// A pipe we can read and raise the capacity of.
trait ReadPipe: Send {
    fn as_fd_ref(&self) -> std::os::fd::BorrowedFd<'_>;
}

impl<T: Send + std::os::fd::AsFd> ReadPipe for T {
    fn as_fd_ref(&self) -> std::os::fd::BorrowedFd<'_> {
        self.as_fd()
    }
}

fn pump(
    pipe: Box<dyn ReadPipe>,
    stream: OutputStream,
    cap: Option<u64>,
    sink: &dyn OutputSink,
    events: &Sender<Event>,
) {
    let mut buf = Vec::with_capacity(DATA_CHUNK);
    let (mut total, mut sent) = (0u64, 0u64);
    let mut client_ok = true;
    loop {
        let n = match sys::read_into(pipe.as_fd_ref(), &mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        total += n as u64;
        let allowed = cap.map_or(n, |c| c.saturating_sub(sent).min(n as u64) as usize);
        if allowed > 0 && client_ok {
            if sink.output(stream, &buf[..allowed]).is_err() {
                client_ok = false;
                let _ = events.send(Event::ClientGone);
            }
            sent += allowed as u64;
        }
        // Keep draining after the cap or a disconnect so the command never
        // blocks on a full pipe.
    }
    let summary = StreamSummary {
        total_bytes: total,
        truncated: cap.is_some_and(|c| total > c),
    };
    let _ = events.send(Event::PumpDone(stream, summary));
}

fn watch_client(mut conn: UnixStream, mut stdin: Option<ChildStdin>, events: &Sender<Event>) {
    loop {
        match read_frame(&mut conn, MAX_FRAME_LEN) {
            Ok(Some(f)) if f.kind == FrameKind::Data => {
                if let Some(pipe) = stdin.as_mut() {
                    if pipe.write_all(&f.body).is_err() {
                        // The command closed its stdin; discard the rest.
                        stdin = None;
                    }
                }
            }
            // Eof, or a stray frame: either way stdin is over.
            Ok(Some(_)) => stdin = None,
            Ok(None) | Err(_) => {
                let _ = events.send(Event::ClientGone);
                return;
            }
        }
    }
}

fn spawn_failed(
    sink: &Sink,
    argv0: &str,
    err: &io::Error,
    stdin_streamed: bool,
    conn: &UnixStream,
    start: Instant,
) -> Result<(), AgentError> {
    let (code, msg) = match err.kind() {
        io::ErrorKind::NotFound => (127, format!("forkbox: {argv0}: command not found\n")),
        io::ErrorKind::PermissionDenied => (126, format!("forkbox: {argv0}: Permission denied\n")),
        _ => (126, format!("forkbox: {argv0}: {err}\n")),
    };
    if stdin_streamed {
        // Consume the client's stdin so its writes do not fail.
        let mut c = conn;
        while let Ok(Some(f)) = read_frame(&mut c, MAX_FRAME_LEN) {
            if f.kind != FrameKind::Data {
                break;
            }
        }
    }
    let _ = sink.send(FrameKind::Stderr, msg.as_bytes());
    let result = ExecResult {
        status: ExitStatus::Code(code),
        timed_out: false,
        duration: start.elapsed(),
        stdout: StreamSummary::default(),
        stderr: StreamSummary {
            total_bytes: msg.len() as u64,
            truncated: false,
        },
    };
    finish(sink, conn, &Response::Exec { result });
    Ok(())
}

fn spawn_thread(name: &str, f: impl FnOnce() + Send + 'static) {
    if let Err(e) = thread::Builder::new().name(name.into()).spawn(f) {
        crate::log(&format!("cannot start thread {name}: {e}"));
    }
}

fn internal(what: &str, e: &io::Error) -> AgentError {
    AgentError::new(ErrorKind::Internal, format!("{what}: {e}"))
}

/// A user from `/etc/passwd`, with the groups `/etc/group` names it a
/// member of (its supplementary groups, as a login would give it).
#[derive(Debug, Clone)]
pub(crate) struct Account {
    pub(crate) name: String,
    pub(crate) uid: u32,
    pub(crate) gid: u32,
    pub(crate) groups: Vec<u32>,
    home: String,
}

/// Most supplementary groups a command is given.
const MAX_GROUPS: usize = 64;

/// The groups `/etc/group` lists `name` as a member of (not its primary
/// group), at most [`MAX_GROUPS`].
fn member_of(name: &str, primary: u32) -> Vec<u32> {
    groups_in(
        &fs::read_to_string("/etc/group").unwrap_or_default(),
        name,
        primary,
    )
}

/// [`member_of`] in the text of an `/etc/group`.
fn groups_in(text: &str, name: &str, primary: u32) -> Vec<u32> {
    let mut groups: Vec<u32> = text
        .lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split(':').collect();
            let gid: u32 = f.get(2)?.parse().ok()?;
            let member = f.get(3)?.split(',').any(|m| m == name);
            (member && gid != primary).then_some(gid)
        })
        .take(MAX_GROUPS)
        .collect();
    groups.sort_unstable();
    groups.dedup();
    groups
}

fn passwd_entries() -> Vec<Account> {
    let text = fs::read_to_string("/etc/passwd").unwrap_or_default();
    text.lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split(':').collect();
            Some(Account {
                name: (*f.first()?).to_string(),
                uid: f.get(2)?.parse().ok()?,
                gid: f.get(3)?.parse().ok()?,
                groups: Vec::new(),
                home: (*f.get(5)?).to_string(),
            })
        })
        .collect()
}

pub(crate) fn lookup_user(user: &User) -> Result<Account, AgentError> {
    let entries = passwd_entries();
    let mut account = match user {
        User::Name(name) => entries
            .into_iter()
            .find(|a| &a.name == name)
            .ok_or_else(|| {
                AgentError::new(ErrorKind::InvalidRequest, format!("unknown user {name}"))
            })?,
        User::Uid(uid) => entries
            .into_iter()
            .find(|a| a.uid == *uid)
            .unwrap_or_else(|| Account {
                name: uid.to_string(),
                uid: *uid,
                gid: *uid,
                groups: Vec::new(),
                home: "/".into(),
            }),
    };
    account.groups = member_of(&account.name, account.gid);
    Ok(account)
}

fn current_home() -> String {
    let uid = sys::effective_uid();
    passwd_entries()
        .into_iter()
        .find(|a| a.uid == uid)
        .map_or_else(|| "/".into(), |a| a.home)
}

fn default_env(home: &str, account: Option<&Account>) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    env.insert("PATH".to_string(), DEFAULT_PATH.to_string());
    env.insert("HOME".to_string(), home.to_string());
    if let Some(seed) = crate::fork::seed() {
        env.insert("FORKBOX_SEED".to_string(), seed.to_string());
    }
    if let Some(a) = account {
        env.insert("USER".to_string(), a.name.clone());
        env.insert("LOGNAME".to_string(), a.name.clone());
    }
    env
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_users_supplementary_groups_are_those_etc_group_lists_it_in() {
        let group = "root:x:0:\nuser:x:1000:\ndocker:x:101:user\nadm:x:4:syslog,user\n\
                     video:x:44:other\nbad:x:notanumber:user\n";
        assert_eq!(groups_in(group, "user", 1000), vec![4, 101]);
        assert!(groups_in(group, "nobody", 65534).is_empty());
        // Its primary group is not repeated.
        assert!(groups_in("docker:x:101:user\n", "user", 101).is_empty());
    }
}
