//! The control socket's protocol, sans-IO: one JSON request per line in,
//! one JSON response per line out. The event loop in `vm` owns the sockets;
//! this module only turns bytes into [`Request`]s and responses into bytes.
//!
//! Requests (see the VMM's `--control` option):
//! - `{"op":"status"}`
//! - `{"op":"pause"}`, `{"op":"resume"}`
//! - `{"op":"fork","children":[{"control":P,"vsock_uds":P,"serial_log":P,"net_log":P,"net_broker":P}, ...],"then":"resume"|"pause"}`
//!   (`net_log`: the child's own egress log, without it the child has none;
//!   `net_broker`: the child's own broker, without it the parent's)
//! - `{"op":"zygote"}`
//! - `{"op":"snapshot","dir":P,"then":"resume"|"pause"}`
//! - `{"op":"vcpus"}`: where every vCPU is (registers, MP state, pending
//!   events, LAPIC vectors), for a failure report; a running VM is paused
//!   for the read and resumed.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Longest request line, newline excluded.
pub const MAX_LINE: usize = 64 * 1024;
/// Most children one fork request may ask for.
pub const MAX_CHILDREN: usize = 64;

/// What the VMM does after a fork or snapshot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Then {
    Resume,
    Pause,
}

/// Where one fork child listens and logs.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChildSpec {
    pub control: PathBuf,
    #[serde(default)]
    pub vsock_uds: Option<PathBuf>,
    #[serde(default)]
    pub serial_log: Option<PathBuf>,
    #[serde(default)]
    pub net_log: Option<PathBuf>,
    #[serde(default)]
    pub net_broker: Option<PathBuf>,
}

/// A parsed control request.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    Status,
    Pause,
    Resume,
    Fork {
        children: Vec<ChildSpec>,
        then: Then,
    },
    Zygote,
    Snapshot {
        dir: PathBuf,
        then: Then,
    },
    Vcpus,
}

/// Parses one request line (without its newline).
pub fn parse(line: &[u8]) -> Result<Request, String> {
    let req: Request = serde_json::from_slice(line).map_err(|e| format!("bad request: {e}"))?;
    if let Request::Fork { children, .. } = &req {
        if children.is_empty() || children.len() > MAX_CHILDREN {
            return Err(format!(
                "bad request: fork wants 1 to {MAX_CHILDREN} children, got {}",
                children.len()
            ));
        }
    }
    Ok(req)
}

/// The VM's run state as `status` reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RunState {
    Running,
    Paused,
    Zygote,
}

/// One fork child's outcome.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum ChildResult {
    Started { pid: u32 },
    Failed { error: String },
}

/// A response, serialised as one line.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum Response {
    Status {
        ok: bool,
        state: RunState,
        pid: u32,
        vcpus: u8,
        memory_mib: u64,
    },
    Ok {
        ok: bool,
    },
    Fork {
        ok: bool,
        children: Vec<ChildResult>,
    },
    Snapshot {
        ok: bool,
        bytes_written: u64,
    },
    /// The zygote's memory file: bytes of guest RAM that are not zero
    /// pages, and bytes of the file in 2 MiB pages.
    Zygote {
        ok: bool,
        bytes: u64,
        huge_bytes: u64,
    },
    Vcpus {
        ok: bool,
        state: RunState,
        vcpus: Vec<crate::state::VcpuReport>,
    },
    Error {
        ok: bool,
        error: String,
    },
}

impl Response {
    pub fn ok() -> Self {
        Response::Ok { ok: true }
    }

    pub fn error(e: impl std::fmt::Display) -> Self {
        Response::Error {
            ok: false,
            error: e.to_string(),
        }
    }

    /// The response as one line, newline included.
    pub fn to_line(&self) -> Vec<u8> {
        let mut v = serde_json::to_vec(self)
            .unwrap_or_else(|_| br#"{"ok":false,"error":"cannot encode the response"}"#.to_vec());
        v.push(b'\n');
        v
    }
}

/// What a client's bytes amount to so far.
#[derive(Debug, PartialEq, Eq)]
pub enum Line {
    /// A complete line (newline stripped).
    Complete(Vec<u8>),
    /// More than [`MAX_LINE`] bytes without a newline: answer and hang up.
    TooLong,
}

/// Splits a client's byte stream into bounded lines.
#[derive(Debug, Default)]
pub struct LineBuffer {
    buf: Vec<u8>,
}

impl LineBuffer {
    /// Adds bytes; returns every complete line, or `TooLong` (after which
    /// the buffer should be dropped with its client).
    pub fn push(&mut self, bytes: &[u8]) -> Vec<Line> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        while let Some(nl) = self.buf.iter().position(|&b| b == b'\n') {
            let mut line: Vec<u8> = self.buf.drain(..=nl).collect();
            line.pop();
            if line.len() > MAX_LINE {
                out.push(Line::TooLong);
                self.buf.clear();
                return out;
            }
            out.push(Line::Complete(line));
        }
        if self.buf.len() > MAX_LINE {
            out.push(Line::TooLong);
            self.buf.clear();
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_simple_ops() {
        assert_eq!(parse(br#"{"op":"status"}"#), Ok(Request::Status));
        assert_eq!(parse(br#"{"op":"pause"}"#), Ok(Request::Pause));
        assert_eq!(parse(br#"{"op":"resume"}"#), Ok(Request::Resume));
        assert_eq!(parse(br#"{"op":"zygote"}"#), Ok(Request::Zygote));
        assert_eq!(parse(br#"{"op":"vcpus"}"#), Ok(Request::Vcpus));
    }

    #[test]
    fn parse_fork_children_and_then() {
        let r = parse(
            br#"{"op":"fork","children":[{"control":"/c","vsock_uds":"/v","serial_log":"/s","net_log":"/n","net_broker":"/b"},{"control":"/c2"}],"then":"pause"}"#,
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
                    },
                    ChildSpec {
                        control: "/c2".into(),
                        vsock_uds: None,
                        serial_log: None,
                        net_log: None,
                        net_broker: None,
                    }
                ],
                then: Then::Pause
            }
        );
    }

    #[test]
    fn parse_snapshot() {
        assert_eq!(
            parse(br#"{"op":"snapshot","dir":"/snap","then":"resume"}"#),
            Ok(Request::Snapshot {
                dir: "/snap".into(),
                then: Then::Resume
            })
        );
    }

    #[test]
    fn parse_malformed_requests_are_errors() {
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

    #[test]
    fn response_lines_match_the_contract() {
        let s = Response::Status {
            ok: true,
            state: RunState::Zygote,
            pid: 7,
            vcpus: 2,
            memory_mib: 512,
        };
        assert_eq!(
            s.to_line(),
            b"{\"ok\":true,\"state\":\"zygote\",\"pid\":7,\"vcpus\":2,\"memory_mib\":512}\n"
        );
        assert_eq!(Response::ok().to_line(), b"{\"ok\":true}\n");
        let f = Response::Fork {
            ok: true,
            children: vec![
                ChildResult::Started { pid: 5 },
                ChildResult::Failed {
                    error: "boom".into(),
                },
            ],
        };
        assert_eq!(
            f.to_line(),
            b"{\"ok\":true,\"children\":[{\"pid\":5},{\"error\":\"boom\"}]}\n"
        );
        assert_eq!(
            Response::error("x").to_line(),
            b"{\"ok\":false,\"error\":\"x\"}\n"
        );
        assert_eq!(
            Response::Snapshot {
                ok: true,
                bytes_written: 4096
            }
            .to_line(),
            b"{\"ok\":true,\"bytes_written\":4096}\n"
        );
    }

    #[test]
    fn line_buffer_splits_and_bounds() {
        let mut b = LineBuffer::default();
        assert_eq!(b.push(b"{\"op\":"), vec![]);
        assert_eq!(
            b.push(b"\"status\"}\nab\ncd"),
            vec![
                Line::Complete(b"{\"op\":\"status\"}".to_vec()),
                Line::Complete(b"ab".to_vec())
            ]
        );
        assert_eq!(b.push(b"\n"), vec![Line::Complete(b"cd".to_vec())]);
        let big = vec![b'x'; MAX_LINE + 1];
        assert_eq!(b.push(&big), vec![Line::TooLong]);
        assert_eq!(b.push(b"ok\n"), vec![Line::Complete(b"ok".to_vec())]);
    }
}
