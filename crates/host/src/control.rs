//! The client of `forkbox-vmm --control PATH`: one JSON request per line,
//! one JSON response per line (`{"ok":false,"error":"…"}` on failure).
//! One connection per request.

use std::io::{self, BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

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

/// What the VM does once a fork or snapshot is done.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Then {
    Resume,
    Pause,
}

/// The sockets and log of one fork child, chosen by the caller.
#[derive(Debug, Clone, Serialize)]
pub struct ChildPaths {
    pub control: PathBuf,
    pub vsock_uds: PathBuf,
    pub serial_log: PathBuf,
    /// The child's own egress log (a VM with a network only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub net_log: Option<PathBuf>,
    /// The child's own network broker (a VM with a network only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub net_broker: Option<PathBuf>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "snake_case", tag = "op")]
pub enum Request<'a> {
    Status,
    Pause,
    Resume,
    Fork {
        children: &'a [ChildPaths],
        then: Then,
    },
    Zygote,
    Snapshot {
        dir: &'a Path,
        then: Then,
    },
    Vcpus,
}

impl Request<'_> {
    fn op(&self) -> &'static str {
        match self {
            Self::Status => "status",
            Self::Pause => "pause",
            Self::Resume => "resume",
            Self::Fork { .. } => "fork",
            Self::Zygote => "zygote",
            Self::Snapshot { .. } => "snapshot",
            Self::Vcpus => "vcpus",
        }
    }
}

/// The VMM's `status`.
#[derive(Debug, Clone, Deserialize)]
pub struct Status {
    /// `running`, `paused` or `zygote`.
    pub state: String,
    pub pid: u32,
    pub vcpus: u32,
    pub memory_mib: u32,
}

/// One entry of a fork's answer: the child's pid, or why it failed.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum ForkedChild {
    Ok { pid: u32 },
    Err { error: String },
}

#[derive(Deserialize)]
struct Forked {
    children: Vec<ForkedChild>,
}

/// What a VM's guest RAM became when it was made a zygote: its memory file.
#[derive(Debug, Clone, Copy, Deserialize)]
pub struct ZygoteMemory {
    /// Bytes of guest RAM that are not zero pages.
    pub bytes: u64,
    /// Bytes of the memory file in 2 MiB pages, which a fork child maps
    /// with one page-table entry until it writes there (docs/SPEC.md).
    pub huge_bytes: u64,
}

#[derive(Deserialize)]
struct Snapshotted {
    bytes_written: u64,
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
        self.call_typed(&Request::Status)
    }

    pub fn pause(&self) -> Result<(), ControlError> {
        self.call(&Request::Pause).map(drop)
    }

    pub fn resume(&self) -> Result<(), ControlError> {
        self.call(&Request::Resume).map(drop)
    }

    pub fn zygote(&self) -> Result<ZygoteMemory, ControlError> {
        self.call_typed(&Request::Zygote)
    }

    /// Forks the VM; one entry per requested child, in order.
    pub fn fork(
        &self,
        children: &[ChildPaths],
        then: Then,
    ) -> Result<Vec<ForkedChild>, ControlError> {
        let req = Request::Fork { children, then };
        let forked: Forked = self.call_typed(&req)?;
        if forked.children.len() != children.len() {
            return Err(ControlError::Malformed {
                op: "fork",
                detail: format!(
                    "{} children asked for, {} answered",
                    children.len(),
                    forked.children.len()
                ),
            });
        }
        Ok(forked.children)
    }

    /// Writes a snapshot into `dir`; returns the bytes written.
    pub fn snapshot(&self, dir: &Path, then: Then) -> Result<u64, ControlError> {
        let s: Snapshotted = self.call_typed(&Request::Snapshot { dir, then })?;
        Ok(s.bytes_written)
    }

    /// Where every vCPU is (registers, MP state, pending events, LAPIC
    /// vectors), one line per vCPU, for a failure report. Bounded by
    /// [`DIAGNOSE_TIMEOUT`]: a VMM too wedged to answer says so.
    pub fn vcpus(&self) -> Result<String, ControlError> {
        let answer = self.call_within(&Request::Vcpus, DIAGNOSE_TIMEOUT)?;
        let vcpus = answer
            .get("vcpus")
            .and_then(|v| v.as_array())
            .ok_or_else(|| ControlError::Malformed {
                op: "vcpus",
                detail: format!("no vcpus in {answer}"),
            })?;
        Ok(vcpus
            .iter()
            .map(|v| v.to_string())
            .collect::<Vec<_>>()
            .join("\n"))
    }

    fn call_typed<T: serde::de::DeserializeOwned>(
        &self,
        req: &Request<'_>,
    ) -> Result<T, ControlError> {
        let value = self.call(req)?;
        serde_json::from_value(value).map_err(|e| ControlError::Malformed {
            op: req.op(),
            detail: e.to_string(),
        })
    }

    /// Sends `req`; returns the answer of an `"ok":true` response.
    pub fn call(&self, req: &Request<'_>) -> Result<serde_json::Value, ControlError> {
        self.call_within(req, ANSWER_TIMEOUT)
    }

    fn call_within(
        &self,
        req: &Request<'_>,
        timeout: Duration,
    ) -> Result<serde_json::Value, ControlError> {
        let op = req.op();
        let stream = self.connect()?;
        let io_err = |source| ControlError::Io { op, source };
        stream.set_read_timeout(Some(timeout)).map_err(io_err)?;
        let mut line = serde_json::to_vec(req).expect("control requests always serialise");
        line.push(b'\n');
        (&stream).write_all(&line).map_err(io_err)?;
        let mut answer = String::new();
        BufReader::new(&stream)
            .read_line(&mut answer)
            .map_err(io_err)?;
        parse_answer(op, &answer)
    }

    fn connect(&self) -> Result<UnixStream, ControlError> {
        let start = Instant::now();
        loop {
            match UnixStream::connect(&self.path) {
                Ok(s) => return Ok(s),
                Err(e)
                    if start.elapsed() < CONNECT_RETRY
                        && matches!(
                            e.kind(),
                            io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused
                        ) =>
                {
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(source) => {
                    return Err(ControlError::Connect {
                        path: self.path.clone(),
                        source,
                    })
                }
            }
        }
    }
}

fn parse_answer(op: &'static str, answer: &str) -> Result<serde_json::Value, ControlError> {
    if answer.is_empty() {
        return Err(ControlError::Malformed {
            op,
            detail: "the VMM closed the connection without answering".into(),
        });
    }
    let value: serde_json::Value =
        serde_json::from_str(answer.trim_end()).map_err(|e| ControlError::Malformed {
            op,
            detail: format!("{e}: {:?}", answer.trim_end()),
        })?;
    match value.get("ok").and_then(serde_json::Value::as_bool) {
        Some(true) => Ok(value),
        Some(false) => Err(ControlError::Refused {
            op,
            error: value
                .get("error")
                .and_then(serde_json::Value::as_str)
                .unwrap_or("(no error text)")
                .to_string(),
        }),
        None => Err(ControlError::Malformed {
            op,
            detail: format!("no `ok` field: {:?}", answer.trim_end()),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fork_request_serialises_as_the_vmm_expects() {
        let children = [ChildPaths {
            control: "/c".into(),
            vsock_uds: "/v".into(),
            serial_log: "/s".into(),
            net_log: None,
            net_broker: None,
        }];
        let req = Request::Fork {
            children: &children,
            then: Then::Pause,
        };
        assert_eq!(
            serde_json::to_string(&req).expect("json"),
            r#"{"op":"fork","children":[{"control":"/c","vsock_uds":"/v","serial_log":"/s"}],"then":"pause"}"#
        );
        assert_eq!(
            serde_json::to_string(&Request::Status).expect("json"),
            r#"{"op":"status"}"#
        );
    }

    #[test]
    fn parse_answer_refusal_carries_error_text() {
        let err = parse_answer("pause", "{\"ok\":false,\"error\":\"already paused\"}\n")
            .expect_err("refused");
        assert!(
            matches!(err, ControlError::Refused { ref error, .. } if error == "already paused"),
            "{err}"
        );
    }

    #[test]
    fn fork_answer_mixes_pids_and_errors() {
        let v = parse_answer(
            "fork",
            r#"{"ok":true,"children":[{"pid":42},{"error":"no memory"}]}"#,
        )
        .expect("ok");
        let f: Forked = serde_json::from_value(v).expect("typed");
        assert!(matches!(f.children[0], ForkedChild::Ok { pid: 42 }));
        assert!(matches!(f.children[1], ForkedChild::Err { ref error } if error == "no memory"));
    }

    #[test]
    fn parse_answer_empty_is_malformed() {
        assert!(matches!(
            parse_answer("status", ""),
            Err(ControlError::Malformed { .. })
        ));
    }
}
