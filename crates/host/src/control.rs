//! The client of `forkbox-vmm --control PATH`: one connection per request,
//! one JSON line each way. The requests and answers are
//! `forkbox-vmm-api`'s; this module only carries them.

use std::io::{self, BufRead, BufReader, IoSlice, Write};
use std::mem::MaybeUninit;
use std::ops::ControlFlow;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use forkbox_vmm_api::{
    decode_answer, AnswerError, ChildResult, ChildSpec, Done, Forked, Request, Snapshotted, Status,
    Then, Vcpus, VmmCounters, ZygoteMemory, MAX_FDS_PER_REQUEST,
};
use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
use serde::de::DeserializeOwned;

use crate::poll::{self, TimedOut};

#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("cannot reach the VMM's control socket {path}")]
    Connect {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("control request `{op}` failed on the way")]
    Io {
        op: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("the VMM refused `{op}`: {error}")]
    Refused { op: &'static str, error: String },
    #[error("malformed answer to `{op}` from the VMM: {detail}")]
    Malformed { op: &'static str, detail: String },
}

impl ControlError {
    fn answer(op: &'static str, e: AnswerError) -> Self {
        match e {
            AnswerError::Refused { error } => ControlError::Refused { op, error },
            AnswerError::Malformed { detail } => ControlError::Malformed { op, detail },
        }
    }
}

/// Longest wait for an answer (a fork of 100 children inside the emulated
/// host takes seconds).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(600);

/// Longest wait for a diagnostic answer (`vcpus`): the VMM parks its vCPUs
/// within 2 s or says why not.
const DIAGNOSE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a missing or refusing socket is retried (a VMM just started).
const CONNECT_RETRY: Duration = Duration::from_secs(5);

/// A handle on one VMM's control socket.
#[derive(Debug, Clone)]
pub struct Control {
    path: PathBuf,
}

impl Control {
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self { path: path.into() }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn status(&self) -> Result<Status, ControlError> {
        self.call(&Request::Status)
    }

    pub fn pause(&self) -> Result<(), ControlError> {
        self.call::<Done>(&Request::Pause).map(drop)
    }

    pub fn resume(&self) -> Result<(), ControlError> {
        self.call::<Done>(&Request::Resume).map(drop)
    }

    pub fn zygote(&self) -> Result<ZygoteMemory, ControlError> {
        self.call(&Request::Zygote)
    }

    /// The pages a zygote's children map before their guest runs, from
    /// now on (`prefault`); empty lists forget them.
    pub fn prefault(
        &self,
        written: Vec<forkbox_vmm_api::PageRange>,
        read: Vec<forkbox_vmm_api::PageRange>,
    ) -> Result<(), ControlError> {
        self.call::<Done>(&Request::Prefault { written, read })
            .map(drop)
    }

    /// Forks the VM; one entry per requested child, in order. `carried`
    /// are the parent's new tops of its `disks` writable disks, then the
    /// children's descriptors ([`ChildSpec::carried`]), in their order,
    /// sent with the request.
    pub fn fork(
        &self,
        children: Vec<ChildSpec>,
        then: Then,
        disks: u8,
        carried: &[OwnedFd],
    ) -> Result<Vec<ChildResult>, ControlError> {
        let asked = children.len();
        let fds: Vec<BorrowedFd<'_>> = carried.iter().map(AsFd::as_fd).collect();
        let request = Request::Fork {
            children,
            then,
            disks,
        };
        let (_, forked): (_, Forked) = self.exchange_with(&request, &fds, ANSWER_TIMEOUT)?;
        if forked.children.len() != asked {
            return Err(ControlError::Malformed {
                op: "fork",
                detail: format!(
                    "{asked} children asked for, {} answered",
                    forked.children.len()
                ),
            });
        }
        Ok(forked.children)
    }

    /// Writes a snapshot into `memory`, `state` and `disks`, one per
    /// writable disk of the VM (new, empty files); returns the bytes
    /// written.
    pub fn snapshot(
        &self,
        memory: &std::fs::File,
        state: &std::fs::File,
        disks: &[std::fs::File],
        then: Then,
    ) -> Result<u64, ControlError> {
        let fds: Vec<BorrowedFd<'_>> = [memory, state]
            .into_iter()
            .chain(disks)
            .map(AsFd::as_fd)
            .collect();
        let request = Request::Snapshot {
            then,
            disks: u8::try_from(disks.len()).unwrap_or(u8::MAX),
        };
        let (_, s): (_, Snapshotted) = self.exchange_with(&request, &fds, ANSWER_TIMEOUT)?;
        Ok(s.bytes_written)
    }

    /// Hands the VMM two new links to its network broker (the connector's
    /// and the resolver's), for a VM whose broker died with its process.
    pub fn broker(
        &self,
        links: &forkbox_net::broker::link::BrokerLinks,
    ) -> Result<(), ControlError> {
        let (_, Done {}) = self.exchange_with(
            &Request::Broker,
            &[links.connector.as_fd(), links.resolver.as_fd()],
            ANSWER_TIMEOUT,
        )?;
        Ok(())
    }

    /// Injects an NMI into every vCPU of a guest being given up: its kernel
    /// (booted with `unknown_nmi_panic`) prints where it was to the serial
    /// log and ends. Bounded by [`DIAGNOSE_TIMEOUT`].
    pub fn nmi(&self) -> Result<(), ControlError> {
        self.call_within::<Done>(&Request::Nmi, DIAGNOSE_TIMEOUT)
            .map(drop)
    }

    /// Where every vCPU is (registers, MP state, pending events, LAPIC
    /// vectors), one JSON line per vCPU, for a failure report. Bounded by
    /// [`DIAGNOSE_TIMEOUT`]: a VMM too wedged to answer says so.
    pub fn vcpus(&self) -> Result<String, ControlError> {
        let answer: Vcpus = self.call_within(&Request::Vcpus, DIAGNOSE_TIMEOUT)?;
        Ok(answer
            .vcpus
            .iter()
            .map(|v| serde_json::to_string(v).expect("a vCPU report is plain data"))
            .collect::<Vec<_>>()
            .join("\n"))
    }

    /// What the VMM has counted (`status`; `None` from a VMM older than
    /// its counters), waiting at most `within` for the answer: for
    /// metrics, where a hung VMM must not hold its caller.
    pub fn counters(&self, within: Duration) -> Result<Option<VmmCounters>, ControlError> {
        let status: Status = self.call_within(&Request::Status, within)?;
        Ok(status.counters)
    }

    /// Owns the VM for as long as the returned connection stays open: a
    /// VMM started with an orphan grace ends that long after its last
    /// owner's connection closed (this process died) unless another
    /// process owns it again.
    /// Bounded by [`DIAGNOSE_TIMEOUT`]: a VMM answers `own` at once, so
    /// one that does not (a wedged fork child) is not waited for.
    pub fn own(&self) -> Result<UnixStream, ControlError> {
        let (stream, Done {}) = self.exchange(&Request::Own, DIAGNOSE_TIMEOUT)?;
        Ok(stream)
    }

    /// Sends `req`; returns the answer of an `"ok":true` response.
    pub fn call<T: DeserializeOwned>(&self, req: &Request) -> Result<T, ControlError> {
        self.call_within(req, ANSWER_TIMEOUT)
    }

    fn call_within<T: DeserializeOwned>(
        &self,
        req: &Request,
        timeout: Duration,
    ) -> Result<T, ControlError> {
        self.exchange(req, timeout).map(|(_, answer)| answer)
    }

    /// Sends `req` on a new connection; its answer, and the connection.
    fn exchange<T: DeserializeOwned>(
        &self,
        req: &Request,
        timeout: Duration,
    ) -> Result<(UnixStream, T), ControlError> {
        self.exchange_with(req, &[], timeout)
    }

    /// [`exchange`](Self::exchange), with `fds` sent along (`SCM_RIGHTS`,
    /// with the request's first bytes).
    fn exchange_with<T: DeserializeOwned>(
        &self,
        req: &Request,
        fds: &[BorrowedFd<'_>],
        timeout: Duration,
    ) -> Result<(UnixStream, T), ControlError> {
        let op = req.op();
        let stream = self.connect()?;
        let io_err = |source| ControlError::Io { op, source };
        stream.set_read_timeout(Some(timeout)).map_err(io_err)?;
        let line = req.to_line();
        let sent = send_with_fds(&stream, &line, fds).map_err(io_err)?;
        (&stream).write_all(&line[sent..]).map_err(io_err)?;
        let mut answer = String::new();
        BufReader::new(&stream)
            .read_line(&mut answer)
            .map_err(io_err)?;
        let answer = decode_answer(&answer).map_err(|e| ControlError::answer(op, e))?;
        Ok((stream, answer))
    }

    fn connect(&self) -> Result<UnixStream, ControlError> {
        let deadline = Instant::now() + CONNECT_RETRY;
        poll::until(deadline, Duration::from_millis(5), || {
            match UnixStream::connect(&self.path) {
                // Not listening yet.
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused
                    ) =>
                {
                    ControlFlow::Continue(e)
                }
                done => ControlFlow::Break(done),
            }
        })
        .unwrap_or_else(|TimedOut(e)| Err(e))
        .map_err(|source| ControlError::Connect {
            path: self.path.clone(),
            source,
        })
    }
}

/// Sends the start of `bytes` with `fds` (`SCM_RIGHTS`, at most a fork
/// request's worth); returns how many bytes went (the rest follow as
/// plain writes). Without fds, nothing is sent here.
fn send_with_fds(stream: &UnixStream, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<usize> {
    if fds.is_empty() {
        return Ok(0);
    }
    if fds.len() > MAX_FDS_PER_REQUEST {
        return Err(io::Error::other(format!(
            "{} descriptors for one request; at most {MAX_FDS_PER_REQUEST}",
            fds.len()
        )));
    }
    let mut space =
        [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS_PER_REQUEST))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(io::Error::other("no room for the descriptors"));
    }
    loop {
        match rustix::net::sendmsg(
            stream,
            &[IoSlice::new(bytes)],
            &mut control,
            SendFlags::NOSIGNAL,
        ) {
            Ok(n) => return Ok(n),
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_error_refusal_carries_op_and_error_text() {
        let err = ControlError::answer(
            "pause",
            AnswerError::Refused {
                error: "already paused".into(),
            },
        );
        assert!(
            matches!(err, ControlError::Refused { op: "pause", ref error } if error == "already paused"),
            "{err}"
        );
        assert_eq!(err.to_string(), "the VMM refused `pause`: already paused");
    }

    /// A VMM's control socket in `dir` that reads one request and
    /// answers `answer` (without it: never).
    fn one_answer(dir: &Path, answer: Option<&'static str>) -> Control {
        let path = dir.join("control.sock");
        let listener = std::os::unix::net::UnixListener::bind(&path).expect("bind");
        std::thread::spawn(move || {
            let (stream, _) = listener.accept().expect("accept");
            let mut line = String::new();
            BufReader::new(&stream)
                .read_line(&mut line)
                .expect("request");
            assert_eq!(line, "{\"op\":\"status\"}\n");
            match answer {
                Some(a) => (&stream).write_all(a.as_bytes()).expect("answer"),
                // Holds the connection open until the client gives up.
                None => {
                    let _ = BufReader::new(&stream).read_line(&mut line);
                }
            }
        });
        Control::new(path)
    }

    #[test]
    fn control_counters_reads_the_status_answers_counters() {
        let dir = tempfile::tempdir().expect("tempdir");
        let control = one_answer(
            dir.path(),
            Some("{\"ok\":true,\"state\":\"running\",\"pid\":7,\"vcpus\":1,\"memory_mib\":256,\"counters\":{\"exits_mmio\":12,\"vsock_connections\":3}}\n"),
        );
        let counters = control
            .counters(Duration::from_secs(30))
            .expect("an answer");
        assert_eq!(
            counters,
            Some(VmmCounters {
                exits_mmio: 12,
                vsock_connections: 3,
                ..VmmCounters::default()
            })
        );
    }

    #[test]
    fn control_counters_of_an_older_vmm_are_none() {
        let dir = tempfile::tempdir().expect("tempdir");
        let control = one_answer(
            dir.path(),
            Some("{\"ok\":true,\"state\":\"paused\",\"pid\":7,\"vcpus\":1,\"memory_mib\":256}\n"),
        );
        assert_eq!(
            control
                .counters(Duration::from_secs(30))
                .expect("an answer"),
            None
        );
    }

    #[test]
    fn control_counters_of_a_silent_vmm_fail_after_within() {
        let dir = tempfile::tempdir().expect("tempdir");
        let control = one_answer(dir.path(), None);
        let err = control
            .counters(Duration::from_millis(20))
            .expect_err("no answer");
        assert!(
            matches!(err, ControlError::Io { op: "status", .. }),
            "{err}"
        );
    }

    #[test]
    fn control_error_malformed_names_op() {
        let err = ControlError::answer(
            "status",
            AnswerError::Malformed {
                detail: "nothing".into(),
            },
        );
        assert!(matches!(err, ControlError::Malformed { op: "status", .. }));
    }
}
