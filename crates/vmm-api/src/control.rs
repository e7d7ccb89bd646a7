//! The control socket's protocol (`forkbox-vmm --control PATH`): one JSON
//! request per line in, one JSON answer per line out, on a fresh
//! connection per request. Owns the requests, the answers, the vCPU report
//! and the encoding and decoding of one line; the sockets belong to the two
//! ends (the VMM's event loop, forkbox's `Control`).
//!
//! Requests:
//! - `{"op":"status"}`: the run state, shape, and what the VMM counted
//!   (`counters`, [`VmmCounters`]; absent from an older VMM)
//! - `{"op":"pause"}`, `{"op":"resume"}`
//! - `{"op":"fork","children":[{"control":P,"vsock_uds":P,"serial_log":P,"net_log":P,"net_broker":P}, ...],"then":"resume"|"pause"}`
//!   (`net_log`: the child's own egress log, without it the child has none;
//!   `net_broker`: the child's own broker; `"joins_cgroup":true`: the
//!   child joins its own cgroup before it builds its VM). The request
//!   carries every child's endpoints, opened, as `SCM_RIGHTS`
//!   ([`ChildSpec::carried`]): a fork child opens nothing by path.
//! - `{"op":"zygote"}`
//! - `{"op":"snapshot","then":"resume"|"pause"}`, carrying two files
//!   opened to write (`SCM_RIGHTS`), empty: the guest memory's (written
//!   sparse) and the state's (`state.json`). The asker names them.
//! - `{"op":"broker"}`, carrying two new links to the VM's network broker
//!   (`SCM_RIGHTS`: the connector's, the resolver's): the process that
//!   adopts a VM whose broker died hands over its own.
//! - `{"op":"vcpus"}`: where every vCPU is (registers, MP state, pending
//!   events, LAPIC vectors), for a failure report; a running VM is paused
//!   for the read and resumed.
//! - `{"op":"nmi"}`: an NMI into every vCPU, for a guest that no longer
//!   answers: forkbox's guests boot with `unknown_nmi_panic`, so the guest
//!   kernel prints where it was (its panic and stack) to the serial log and
//!   ends. Only for a VM that is being given up.
//! - `{"op":"prefault","written":[[FIRST,COUNT],...],"read":[...]}`, to a
//!   zygote: the children it forks from now on map these pages of its
//!   memory file before their guest runs, `written` ones as their own
//!   copies, `read` ones shared with it; what one child's first command
//!   touched (read by the asker from that child's `/proc/PID/pagemap`),
//!   so that the next children take no nested-page fault for it. At most
//!   [`crate::MAX_PREFAULT_RANGES`] ranges; an empty request forgets them.
//! - `{"op":"own"}`: this connection owns the VM for as long as it stays
//!   open. A VMM started with `--orphan-grace-secs N` ends when no
//!   connection has owned it for N seconds (from its start, or from its
//!   last owner's going: a daemon that died without another adopting it).
//!
//! Answers are `{"ok":true, ...}` with the request's fields, or
//! `{"ok":false,"error":"..."}`.

use std::fmt;
use std::path::PathBuf;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::{MAX_CHILDREN_PER_FORK, MAX_PREFAULT_RANGES, MAX_PREFAULT_WRITTEN};

/// Pages `[first, count]` of a VM's memory file (4 KiB pages; below 3 GiB
/// the file's page numbers are the guest-physical ones).
pub type PageRange = [u64; 2];

/// What the VMM does after a fork or snapshot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Then {
    Resume,
    Pause,
}

/// Where one fork child listens and logs. Its endpoints come opened, by
/// the asker, with the request ([`ChildSpec::carried`]): a fork child
/// lives in its parent's root, where no path leads to its own directory
/// (or to a sibling's). The paths name them in messages; the child opens
/// nothing by them but its network broker and egress log.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChildSpec {
    /// The child's control socket, which the asker bound; the listening
    /// socket comes with the request.
    pub control: PathBuf,
    /// The child's hybrid-vsock socket (a VM with vsock must name one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vsock_uds: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial_log: Option<PathBuf>,
    /// The child's own egress log; without it the child has none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub net_log: Option<PathBuf>,
    /// The child's own network broker, two links to which come with the
    /// request; a child of a VM with a broker must have its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub net_broker: Option<PathBuf>,
    /// An open `cgroup.procs` of the child's own cgroup comes with the
    /// request (`SCM_RIGHTS`): the child writes itself into it first
    /// thing, so that what it allocates (its KVM objects, page tables,
    /// KVM's kernel thread for its VM) is charged there, not to its parent.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub joins_cgroup: bool,
    /// One empty file per writable disk of the VM comes with the request,
    /// opened to read and write and named by no path: the child's own
    /// top of each disk, in the disks' order.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub disks: u8,
}

fn is_zero(n: &u8) -> bool {
    *n == 0
}

impl ChildSpec {
    /// How many descriptors the fork request carries for this child
    /// (`SCM_RIGHTS`), in this order: its cgroup's `cgroup.procs` opened
    /// to write (with `joins_cgroup`); its control socket, bound and
    /// listening; its vsock socket, bound and listening (with
    /// `vsock_uds`); its serial log opened to append (with `serial_log`);
    /// its [`crate::END_FILE`], opened to write; two links to its network
    /// broker, the connector's and the resolver's (with `net_broker`); the
    /// tops of its writable disks (`disks`). A request's children's
    /// descriptors follow each other in the children's order, after the
    /// parent's own new tops ([`Request::Fork`]'s `disks`).
    pub fn carried(&self) -> usize {
        usize::from(self.joins_cgroup)
            + 1
            + usize::from(self.vsock_uds.is_some())
            + usize::from(self.serial_log.is_some())
            + 1
            + 2 * usize::from(self.net_broker.is_some())
            + usize::from(self.disks)
    }
}

/// One control request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    Status,
    Pause,
    Resume,
    Fork {
        children: Vec<ChildSpec>,
        then: Then,
        /// The VM's writable disks: as many empty files come first in the
        /// request, the parent's new tops (its written top becomes a layer
        /// its children share).
        #[serde(default, skip_serializing_if = "is_zero")]
        disks: u8,
    },
    Zygote,
    /// Its files come with it: the memory's, the state's, then one per
    /// writable disk (`disks`, all of them), where the blocks it holds
    /// beyond its base are written.
    Snapshot {
        then: Then,
        #[serde(default, skip_serializing_if = "is_zero")]
        disks: u8,
    },
    Vcpus,
    Nmi,
    Own,
    /// Its two links come with it: the connector's, the resolver's.
    Broker,
    Prefault {
        #[serde(default)]
        written: Vec<PageRange>,
        #[serde(default)]
        read: Vec<PageRange>,
    },
}

/// Why a request line is not a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RequestError {
    /// Not JSON, or not one of the requests.
    Malformed(String),
    /// A fork asking for no children or more than [`MAX_CHILDREN_PER_FORK`].
    ChildCount(usize),
    /// A prefault naming more than [`MAX_PREFAULT_RANGES`] ranges, or an
    /// empty or overflowing one.
    PrefaultRanges(String),
}

impl fmt::Display for RequestError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RequestError::Malformed(e) => write!(f, "bad request: {e}"),
            RequestError::ChildCount(n) => write!(
                f,
                "bad request: fork wants 1 to {MAX_CHILDREN_PER_FORK} children, got {n}"
            ),
            RequestError::PrefaultRanges(e) => write!(f, "bad request: prefault {e}"),
        }
    }
}

impl std::error::Error for RequestError {}

impl Request {
    /// The request's `op`, for error messages.
    pub fn op(&self) -> &'static str {
        match self {
            Request::Status => "status",
            Request::Pause => "pause",
            Request::Resume => "resume",
            Request::Fork { .. } => "fork",
            Request::Zygote => "zygote",
            Request::Snapshot { .. } => "snapshot",
            Request::Vcpus => "vcpus",
            Request::Nmi => "nmi",
            Request::Own => "own",
            Request::Broker => "broker",
            Request::Prefault { .. } => "prefault",
        }
    }

    /// Checks what the JSON cannot say: a fork's number of children.
    pub fn check(&self) -> Result<(), RequestError> {
        match self {
            Request::Fork { children, .. }
                if children.is_empty() || children.len() > MAX_CHILDREN_PER_FORK =>
            {
                Err(RequestError::ChildCount(children.len()))
            }
            Request::Prefault { written, read } => {
                let n = written.len() + read.len();
                if n > MAX_PREFAULT_RANGES {
                    return Err(RequestError::PrefaultRanges(format!(
                        "names {n} ranges, at most {MAX_PREFAULT_RANGES}"
                    )));
                }
                let bad =
                    |[first, count]: &PageRange| *count == 0 || first.checked_add(*count).is_none();
                if let Some([first, count]) = written.iter().chain(read).find(|r| bad(r)) {
                    return Err(RequestError::PrefaultRanges(format!(
                        "range [{first}, {count}] is empty or overflows"
                    )));
                }
                let copies = written.iter().map(|r| r[1]).fold(0u64, u64::saturating_add);
                if copies > MAX_PREFAULT_WRITTEN {
                    return Err(RequestError::PrefaultRanges(format!(
                        "has each child copy {copies} pages, at most {MAX_PREFAULT_WRITTEN}"
                    )));
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// Parses one request line (without its newline).
    pub fn from_line(line: &[u8]) -> Result<Request, RequestError> {
        let req: Request =
            serde_json::from_slice(line).map_err(|e| RequestError::Malformed(e.to_string()))?;
        req.check()?;
        Ok(req)
    }

    /// The request as one line, newline included.
    pub fn to_line(&self) -> Vec<u8> {
        let mut v = serde_json::to_vec(self).expect("requests are plain data and always encode");
        v.push(b'\n');
        v
    }
}

/// The VM's run state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunState {
    Running,
    Paused,
    /// A paused VM whose memory is a `MAP_PRIVATE` mapping of a memory
    /// file: forks of it cost O(1) in memory size.
    Zygote,
}

/// The answer to `status`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Status {
    pub state: RunState,
    pub pid: u32,
    pub vcpus: u8,
    pub memory_mib: u64,
    /// Its writable disks (a fork or snapshot request sends a file for
    /// each).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub writable_disks: u8,
    /// What the VMM counted; absent from a VMM older than them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub counters: Option<VmmCounters>,
}

/// What one VMM process has counted since it started (a fork child:
/// since it was forked; a restored VM: since it was restored). Every
/// field defaults to 0, so either end may know fields the other does not.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct VmmCounters {
    /// vCPU exits to the VMM for port I/O.
    pub exits_io: u64,
    /// vCPU exits to the VMM for MMIO (virtio registers).
    pub exits_mmio: u64,
    /// Every other vCPU exit (a signal's kick, an interrupt window, ...).
    pub exits_other: u64,
    /// Control requests served (this `status` not included).
    pub control_requests: u64,
    /// Time spent serving them, in microseconds.
    pub control_micros: u64,
    /// Host connections to a guest vsock port (the agent's included).
    pub vsock_connections: u64,
    /// Ethernet frames from the guest to the network gateway, and bytes.
    pub net_tx_frames: u64,
    pub net_tx_bytes: u64,
    /// Ethernet frames from the gateway to the guest, and bytes.
    pub net_rx_frames: u64,
    pub net_rx_bytes: u64,
    /// Bytes the guest wrote to its writable disks.
    pub disk_bytes_written: u64,
    /// Writes to its writable disks the host failed (a full host disk):
    /// the guest saw an I/O error for each.
    pub disk_host_write_errors: u64,
}

impl VmmCounters {
    /// The sum, field by field (saturating), for totals over VMMs.
    pub fn add(&mut self, other: &VmmCounters) {
        let VmmCounters {
            exits_io,
            exits_mmio,
            exits_other,
            control_requests,
            control_micros,
            vsock_connections,
            net_tx_frames,
            net_tx_bytes,
            net_rx_frames,
            net_rx_bytes,
            disk_bytes_written,
            disk_host_write_errors,
        } = other;
        self.exits_io = self.exits_io.saturating_add(*exits_io);
        self.exits_mmio = self.exits_mmio.saturating_add(*exits_mmio);
        self.exits_other = self.exits_other.saturating_add(*exits_other);
        self.control_requests = self.control_requests.saturating_add(*control_requests);
        self.control_micros = self.control_micros.saturating_add(*control_micros);
        self.vsock_connections = self.vsock_connections.saturating_add(*vsock_connections);
        self.net_tx_frames = self.net_tx_frames.saturating_add(*net_tx_frames);
        self.net_tx_bytes = self.net_tx_bytes.saturating_add(*net_tx_bytes);
        self.net_rx_frames = self.net_rx_frames.saturating_add(*net_rx_frames);
        self.net_rx_bytes = self.net_rx_bytes.saturating_add(*net_rx_bytes);
        self.disk_bytes_written = self.disk_bytes_written.saturating_add(*disk_bytes_written);
        self.disk_host_write_errors = self
            .disk_host_write_errors
            .saturating_add(*disk_host_write_errors);
    }
}

/// The answer to `pause` and `resume`: nothing but `ok`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Done {}

/// One fork child's outcome: its pid, or why it failed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ChildResult {
    Started {
        pid: u32,
    },
    Failed {
        error: String,
        /// A child that did not come up in time but may still: whoever
        /// asked for it must end it (a VMM's filter lets it signal no
        /// process), before its sockets' paths are used again.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        unready_pid: Option<u32>,
    },
}

/// The answer to `fork`: one entry per requested child, in order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Forked {
    pub children: Vec<ChildResult>,
}

/// The answer to `snapshot`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Snapshotted {
    pub bytes_written: u64,
}

/// The answer to `zygote`: what the VM's guest RAM became, its memory file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ZygoteMemory {
    /// Bytes of guest RAM that are not zero pages.
    pub bytes: u64,
    /// Bytes of the memory file in 2 MiB pages, which a fork child maps
    /// with one page-table entry until it writes there (docs/SPEC.md).
    pub huge_bytes: u64,
}

/// The answer to `vcpus`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Vcpus {
    pub state: RunState,
    pub vcpus: Vec<VcpuReport>,
}

/// Where one vCPU is, for a person reading a failure (a fork child that
/// hangs, a guest that faults): its registers, MP state, pending events and
/// the LAPIC's pending (IRR) and in-service (ISR) vectors.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VcpuReport {
    pub id: u8,
    pub rip: u64,
    pub rsp: u64,
    pub rflags: u64,
    pub cs: u16,
    pub cr0: u64,
    pub cr2: u64,
    pub cr3: u64,
    pub cr4: u64,
    pub efer: u64,
    /// `runnable`, `halted`, ... (KVM's `mp_state`).
    pub mp_state: String,
    /// `nr N error 0xE (injected|pending)`, if an exception is queued.
    pub exception: Option<String>,
    /// The vector of an interrupt being injected, if any.
    pub interrupt: Option<u8>,
    pub nmi_pending: bool,
    pub lapic_irr: Vec<u8>,
    pub lapic_isr: Vec<u8>,
    /// The LAPIC timer's LVT entry (mode in bits 17-18, mask bit 16).
    pub lapic_lvtt: u32,
}

/// An answer as the VMM sends it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Response {
    Status(Status),
    Done,
    Forked(Forked),
    Snapshotted(Snapshotted),
    Zygote(ZygoteMemory),
    Vcpus(Vcpus),
    /// The request was refused or failed; the text says why.
    Error(String),
}

/// `{"ok":true}` followed by an answer's own fields.
#[derive(Serialize)]
struct Ok<'a, T: Serialize> {
    ok: bool,
    #[serde(flatten)]
    answer: &'a T,
}

#[derive(Serialize)]
struct Refusal<'a> {
    ok: bool,
    error: &'a str,
}

fn ok_line<T: Serialize>(answer: &T) -> serde_json::Result<Vec<u8>> {
    serde_json::to_vec(&Ok { ok: true, answer })
}

impl Response {
    pub fn error(e: impl fmt::Display) -> Self {
        Response::Error(e.to_string())
    }

    /// The answer as one line, newline included.
    pub fn to_line(&self) -> Vec<u8> {
        let encoded = match self {
            Response::Status(a) => ok_line(a),
            Response::Done => ok_line(&Done {}),
            Response::Forked(a) => ok_line(a),
            Response::Snapshotted(a) => ok_line(a),
            Response::Zygote(a) => ok_line(a),
            Response::Vcpus(a) => ok_line(a),
            Response::Error(error) => serde_json::to_vec(&Refusal { ok: false, error }),
        };
        let mut v = encoded
            .unwrap_or_else(|_| br#"{"ok":false,"error":"cannot encode the response"}"#.to_vec());
        v.push(b'\n');
        v
    }
}

/// Why an answer line is not the answer asked for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AnswerError {
    /// `{"ok":false}`: the VMM refused the request or failed it.
    Refused { error: String },
    /// Not an answer of this protocol (or none: the VMM hung up).
    Malformed { detail: String },
}

impl fmt::Display for AnswerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AnswerError::Refused { error } => write!(f, "refused: {error}"),
            AnswerError::Malformed { detail } => write!(f, "malformed answer: {detail}"),
        }
    }
}

impl std::error::Error for AnswerError {}

/// Decodes one answer line (its newline may be there) into the answer `T`
/// of an `"ok":true` response.
pub fn decode_answer<T: DeserializeOwned>(line: &str) -> Result<T, AnswerError> {
    let line = line.trim_end();
    if line.is_empty() {
        return Err(AnswerError::Malformed {
            detail: "the VMM closed the connection without answering".into(),
        });
    }
    let value: serde_json::Value =
        serde_json::from_str(line).map_err(|e| AnswerError::Malformed {
            detail: format!("{e}: {line:?}"),
        })?;
    match value.get("ok").and_then(serde_json::Value::as_bool) {
        Some(true) => T::deserialize(value).map_err(|e| AnswerError::Malformed {
            detail: e.to_string(),
        }),
        Some(false) => Err(AnswerError::Refused {
            error: value
                .get("error")
                .and_then(serde_json::Value::as_str)
                .unwrap_or("(no error text)")
                .to_string(),
        }),
        None => Err(AnswerError::Malformed {
            detail: format!("no `ok` field: {line:?}"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(line: &[u8]) -> Result<Request, RequestError> {
        Request::from_line(line)
    }

    #[test]
    fn request_simple_ops_parse() {
        assert_eq!(parse(br#"{"op":"status"}"#), Ok(Request::Status));
        assert_eq!(parse(br#"{"op":"pause"}"#), Ok(Request::Pause));
        assert_eq!(parse(br#"{"op":"resume"}"#), Ok(Request::Resume));
        assert_eq!(parse(br#"{"op":"zygote"}"#), Ok(Request::Zygote));
        assert_eq!(parse(br#"{"op":"vcpus"}"#), Ok(Request::Vcpus));
        assert_eq!(parse(br#"{"op":"nmi"}"#), Ok(Request::Nmi));
        assert_eq!(parse(br#"{"op":"own"}"#), Ok(Request::Own));
    }

    #[test]
    fn request_fork_parses_children_and_then() {
        let r = parse(
            br#"{"op":"fork","children":[{"control":"/c","vsock_uds":"/v","serial_log":"/s","net_log":"/n","net_broker":"/b"},{"control":"/c2","joins_cgroup":true}],"then":"pause"}"#,
        )
        .expect("valid");
        assert_eq!(
            r,
            Request::Fork {
                children: vec![
                    ChildSpec {
                        control: "/c".into(),
                        vsock_uds: Some("/v".into()),
                        serial_log: Some("/s".into()),
                        net_log: Some("/n".into()),
                        net_broker: Some("/b".into()),
                        joins_cgroup: false,
                        disks: 0,
                    },
                    ChildSpec {
                        control: "/c2".into(),
                        vsock_uds: None,
                        serial_log: None,
                        net_log: None,
                        net_broker: None,
                        joins_cgroup: true,
                        disks: 0,
                    }
                ],
                then: Then::Pause,
                disks: 0,
            }
        );
    }

    #[test]
    fn request_snapshot_and_broker_parse() {
        assert_eq!(
            parse(br#"{"op":"snapshot","then":"resume"}"#),
            Ok(Request::Snapshot {
                then: Then::Resume,
                disks: 0
            })
        );
        // The VMM writes nowhere by path.
        assert!(parse(br#"{"op":"snapshot","dir":"/snap","then":"resume"}"#).is_err());
        assert_eq!(parse(br#"{"op":"broker"}"#), Ok(Request::Broker));
    }

    #[test]
    fn request_prefault_parses_and_is_bounded() {
        assert_eq!(
            parse(br#"{"op":"prefault","written":[[10,2]],"read":[[0,1],[64,512]]}"#),
            Ok(Request::Prefault {
                written: vec![[10, 2]],
                read: vec![[0, 1], [64, 512]],
            })
        );
        assert_eq!(
            parse(br#"{"op":"prefault"}"#),
            Ok(Request::Prefault {
                written: vec![],
                read: vec![],
            })
        );
        for bad in [
            r#"{"op":"prefault","read":[[5,0]]}"#.to_owned(),
            format!(
                r#"{{"op":"prefault","written":[[0,{}]]}}"#,
                crate::MAX_PREFAULT_WRITTEN + 1
            ),
            format!(r#"{{"op":"prefault","written":[[{},2]]}}"#, u64::MAX),
        ] {
            assert!(
                matches!(parse(bad.as_bytes()), Err(RequestError::PrefaultRanges(_))),
                "{bad}"
            );
        }
        let many = vec![[0u64, 1]; MAX_PREFAULT_RANGES + 1];
        let line = Request::Prefault {
            written: many.clone(),
            read: vec![],
        }
        .to_line();
        assert!(matches!(
            Request::from_line(line.trim_ascii_end()),
            Err(RequestError::PrefaultRanges(_))
        ));
        // The most it may name, at the widest numbers, fits in one line.
        let widest = vec![[u64::from(u32::MAX), 512]; MAX_PREFAULT_RANGES];
        let line = Request::Prefault {
            written: vec![],
            read: widest,
        }
        .to_line();
        assert!(line.len() <= crate::MAX_LINE, "{} bytes", line.len());
    }

    #[test]
    fn request_malformed_is_error() {
        for bad in [
            &b"not json"[..],
            br#"{"op":"explode"}"#,
            br#"{"op":"fork","children":[],"then":"resume"}"#,
            br#"{"op":"fork","children":[{"control":"/c"}]}"#,
            br#"{"op":"fork","children":[{"control":"/c"}],"then":"later"}"#,
            br#"{"op":"snapshot"}"#,
            br#"[]"#,
            b"",
            &[0xff, 0xfe],
        ] {
            assert!(parse(bad).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
    }

    /// A child with a control socket and nothing else.
    fn bare_child() -> ChildSpec {
        ChildSpec {
            control: "/c".into(),
            vsock_uds: None,
            serial_log: None,
            net_log: None,
            net_broker: None,
            joins_cgroup: false,
            disks: 0,
        }
    }

    #[test]
    fn request_fork_child_count_bounded() {
        let child = bare_child();
        let fork = |n| Request::Fork {
            children: vec![child.clone(); n],
            then: Then::Pause,
            disks: 0,
        };
        assert_eq!(fork(0).check(), Err(RequestError::ChildCount(0)));
        assert_eq!(fork(1).check(), Ok(()));
        assert_eq!(fork(MAX_CHILDREN_PER_FORK).check(), Ok(()));
        let too_many = fork(MAX_CHILDREN_PER_FORK + 1);
        assert_eq!(
            parse(&too_many.to_line()[..]).map_err(|e| e.to_string()),
            Err(format!(
                "bad request: fork wants 1 to {MAX_CHILDREN_PER_FORK} children, got {}",
                MAX_CHILDREN_PER_FORK + 1
            ))
        );
    }

    #[test]
    fn a_childs_descriptors_are_counted_and_fit_one_message() {
        let mut child = bare_child();
        // The control socket and the end note, always.
        assert_eq!(child.carried(), 2);
        child.vsock_uds = Some("/v".into());
        child.serial_log = Some("/s".into());
        child.net_broker = Some("/b".into());
        child.joins_cgroup = true;
        child.disks = crate::MAX_WRITABLE_DISKS;
        assert_eq!(child.carried(), crate::MAX_FDS_PER_CHILD);
        // SCM_MAX_FD: the kernel's cap on one message's descriptors.
        for disks in 0..=crate::MAX_WRITABLE_DISKS {
            child.disks = disks;
            let n = crate::children_per_request(disks);
            assert!(n >= 16, "{disks} disks: {n} children per request");
            assert!(n * child.carried() + usize::from(disks) <= crate::MAX_FDS_PER_REQUEST);
        }
        assert_eq!(crate::children_per_request(0), MAX_CHILDREN_PER_FORK);
    }

    #[test]
    fn request_fork_serialises_as_the_vmm_expects() {
        let req = Request::Fork {
            children: vec![ChildSpec {
                control: "/c".into(),
                vsock_uds: Some("/v".into()),
                serial_log: Some("/s".into()),
                net_log: None,
                net_broker: None,
                joins_cgroup: false,
                disks: 0,
            }],
            then: Then::Pause,
            disks: 0,
        };
        assert_eq!(
            req.to_line(),
            b"{\"op\":\"fork\",\"children\":[{\"control\":\"/c\",\"vsock_uds\":\"/v\",\"serial_log\":\"/s\"}],\"then\":\"pause\"}\n"
        );
        assert_eq!(Request::Status.to_line(), b"{\"op\":\"status\"}\n");
        assert_eq!(parse(&req.to_line()[..req.to_line().len() - 1]), Ok(req));
    }

    #[test]
    fn response_lines_match_the_contract() {
        let s = Response::Status(Status {
            state: RunState::Zygote,
            pid: 7,
            vcpus: 2,
            memory_mib: 512,
            writable_disks: 0,
            counters: None,
        });
        assert_eq!(
            s.to_line(),
            b"{\"ok\":true,\"state\":\"zygote\",\"pid\":7,\"vcpus\":2,\"memory_mib\":512}\n"
        );
        assert_eq!(Response::Done.to_line(), b"{\"ok\":true}\n");
        let f = Response::Forked(Forked {
            children: vec![
                ChildResult::Started { pid: 5 },
                ChildResult::Failed {
                    error: "boom".into(),
                    unready_pid: None,
                },
                ChildResult::Failed {
                    error: "late".into(),
                    unready_pid: Some(6),
                },
            ],
        });
        assert_eq!(
            f.to_line(),
            b"{\"ok\":true,\"children\":[{\"pid\":5},{\"error\":\"boom\"},{\"error\":\"late\",\"unready_pid\":6}]}\n"
        );
        let back: Forked = serde_json::from_slice(&f.to_line()).expect("parses");
        let Response::Forked(sent) = f else {
            unreachable!()
        };
        assert_eq!(back, sent);
        assert_eq!(
            Response::error("x").to_line(),
            b"{\"ok\":false,\"error\":\"x\"}\n"
        );
        assert_eq!(
            Response::Snapshotted(Snapshotted {
                bytes_written: 4096
            })
            .to_line(),
            b"{\"ok\":true,\"bytes_written\":4096}\n"
        );
        assert_eq!(
            Response::Zygote(ZygoteMemory {
                bytes: 8192,
                huge_bytes: 0
            })
            .to_line(),
            b"{\"ok\":true,\"bytes\":8192,\"huge_bytes\":0}\n"
        );
    }

    fn line(r: &Response) -> String {
        String::from_utf8(r.to_line()).expect("utf-8")
    }

    #[test]
    fn answer_round_trips_every_response() {
        let status = Status {
            state: RunState::Paused,
            pid: 9,
            vcpus: 8,
            memory_mib: 16384,
            writable_disks: 2,
            counters: Some(VmmCounters {
                exits_io: 1,
                exits_mmio: 2,
                exits_other: 3,
                control_requests: 4,
                control_micros: 5,
                vsock_connections: 6,
                net_tx_frames: 7,
                net_tx_bytes: 8,
                net_rx_frames: 9,
                net_rx_bytes: 10,
                disk_bytes_written: 11,
                disk_host_write_errors: 12,
            }),
        };
        assert_eq!(
            decode_answer::<Status>(&line(&Response::Status(status.clone()))),
            Ok(status)
        );
        assert_eq!(decode_answer::<Done>(&line(&Response::Done)), Ok(Done {}));
        let report = VcpuReport {
            id: 1,
            rip: 0xffff_ffff_8100_0000,
            rsp: 2,
            rflags: 0x2,
            cs: 0x10,
            cr0: 3,
            cr2: 4,
            cr3: 5,
            cr4: 6,
            efer: 0xd01,
            mp_state: "halted".into(),
            exception: None,
            interrupt: Some(236),
            nmi_pending: false,
            lapic_irr: vec![236],
            lapic_isr: vec![],
            lapic_lvtt: 0x10000,
        };
        let vcpus = Vcpus {
            state: RunState::Running,
            vcpus: vec![report],
        };
        assert_eq!(
            decode_answer::<Vcpus>(&line(&Response::Vcpus(vcpus.clone()))),
            Ok(vcpus)
        );
        let zygote = ZygoteMemory {
            bytes: 1,
            huge_bytes: 2,
        };
        assert_eq!(
            decode_answer::<ZygoteMemory>(&line(&Response::Zygote(zygote))),
            Ok(zygote)
        );
    }

    #[test]
    fn status_without_counters_parses_as_none() {
        let old = "{\"ok\":true,\"state\":\"running\",\"pid\":7,\"vcpus\":2,\"memory_mib\":512}\n";
        let status = decode_answer::<Status>(old).expect("an older VMM's status");
        assert_eq!(status.counters, None);
    }

    #[test]
    fn status_counters_with_unknown_and_missing_fields_parse() {
        // A newer VMM's extra counter is ignored; a missing one is 0.
        let newer = "{\"ok\":true,\"state\":\"running\",\"pid\":7,\"vcpus\":2,\"memory_mib\":512,\
                     \"counters\":{\"exits_io\":3,\"exits_from_the_future\":1}}";
        let status = decode_answer::<Status>(newer).expect("a newer VMM's status");
        assert_eq!(
            status.counters,
            Some(VmmCounters {
                exits_io: 3,
                ..VmmCounters::default()
            })
        );
    }

    #[test]
    fn vmm_counters_add_sums_every_field() {
        let one = VmmCounters {
            exits_io: 1,
            exits_mmio: 1,
            exits_other: 1,
            control_requests: 1,
            control_micros: 1,
            vsock_connections: 1,
            net_tx_frames: 1,
            net_tx_bytes: 1,
            net_rx_frames: 1,
            net_rx_bytes: 1,
            disk_bytes_written: 1,
            disk_host_write_errors: 1,
        };
        let mut sum = one;
        sum.add(&one);
        let two = serde_json::to_value(sum).expect("plain data");
        let fields = two.as_object().expect("an object");
        assert!(fields.values().all(|v| v == 2), "{two}");
        let mut top = VmmCounters {
            exits_io: u64::MAX,
            ..VmmCounters::default()
        };
        top.add(&one);
        assert_eq!(top.exits_io, u64::MAX);
    }

    #[test]
    fn answer_refusal_carries_error_text() {
        assert_eq!(
            decode_answer::<Done>("{\"ok\":false,\"error\":\"already paused\"}\n"),
            Err(AnswerError::Refused {
                error: "already paused".into()
            })
        );
    }

    #[test]
    fn answer_fork_mixes_pids_and_errors() {
        let f: Forked =
            decode_answer(r#"{"ok":true,"children":[{"pid":42},{"error":"no memory"}]}"#)
                .expect("ok");
        assert_eq!(
            f.children,
            vec![
                ChildResult::Started { pid: 42 },
                ChildResult::Failed {
                    error: "no memory".into(),
                    unready_pid: None,
                }
            ]
        );
    }

    #[test]
    fn answer_empty_or_without_ok_is_malformed() {
        for bad in ["", "\n", "{}", "nope", r#"{"ok":true}"#] {
            assert!(
                matches!(
                    decode_answer::<Status>(bad),
                    Err(AnswerError::Malformed { .. })
                ),
                "{bad:?}"
            );
        }
    }
}
