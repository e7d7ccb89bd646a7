//! The egress log: one record per attempt to reach out, allowed or not.
//!
//! The gateway appends records to a bounded in-memory [`EgressLog`] (a
//! guest flooding connection attempts must not grow the VMM's memory); the
//! daemon drains it and appends JSON lines to the sandbox's log file with a
//! [`JsonLinesWriter`], which outlives the sandbox until its log TTL. The
//! field names are the SDK's (`sb.network.egress_log()` returns these as
//! dicts).

use std::collections::VecDeque;
use std::io::{self, BufRead, Write};
use std::net::IpAddr;

use serde::{Deserialize, Serialize};

use crate::policy::{Decision, Protocol, Reason, Verdict};

/// Why an attempt ended as it did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LogReason {
    /// A policy rule decided (see `rule`).
    Rule,
    /// No rule matched: default deny.
    NoRule,
    /// A loopback, link-local, multicast, broadcast or unspecified address.
    SpecialAddress,
    /// UDP other than DNS.
    UdpNotAllowed,
    /// An internal address (private, shared, unique-local, a cloud
    /// platform endpoint, the host's own) matched only by a name rule, `*`
    /// or a wider CIDR (see `rule` and `error`).
    InternalAddress,
    /// A name of one label, never resolved.
    SingleLabelName,
    /// Allowed by the VMM's copy of the policy, denied by the broker's
    /// own decision (see `error`): e.g. an address of the host.
    BrokerDenied,
    /// Too many connections or attempts at once: refused to bound memory.
    Limit,
    /// Allowed by the policy, but the host side could not connect (see
    /// `error`).
    ConnectFailed,
    /// Allowed by the policy, but the name did not resolve.
    NotFound,
}

impl LogReason {
    /// The log's words for a policy decision.
    pub fn of(decision: &Decision) -> (LogReason, Option<String>) {
        match &decision.reason {
            Reason::AllowRule(r) | Reason::DenyRule(r) => (LogReason::Rule, Some(r.clone())),
            Reason::NoRule => (LogReason::NoRule, None),
            Reason::SpecialAddress => (LogReason::SpecialAddress, None),
            Reason::UdpNotAllowed => (LogReason::UdpNotAllowed, None),
            Reason::InternalAddress { rule, .. } => {
                (LogReason::InternalAddress, Some(rule.clone()))
            }
            Reason::SingleLabelName => (LogReason::SingleLabelName, None),
        }
    }
}

/// One attempt. For DNS, `name` is the name asked, `port` is 53 and
/// `answers` the addresses given; for TCP, `address:port` is where the
/// guest connected and `name` the name it had looked up for it, if any.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EgressRecord {
    /// When the attempt began, milliseconds since the Unix epoch.
    pub time_ms: u64,
    pub sandbox: String,
    pub protocol: Protocol,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<IpAddr>,
    pub port: u16,
    pub verdict: Verdict,
    pub reason: LogReason,
    /// The rule that decided, in normal form.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub answers: Vec<IpAddr>,
    /// Bytes from the guest to the destination.
    pub bytes_out: u64,
    /// Bytes from the destination to the guest.
    pub bytes_in: u64,
    /// From the attempt to the close of the connection (0 for refusals).
    pub duration_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// A bounded ring of records: past `capacity` the oldest are dropped and
/// counted, so a flood costs a fixed amount of memory.
#[derive(Debug, Clone)]
pub struct EgressLog {
    records: VecDeque<EgressRecord>,
    capacity: usize,
    dropped: u64,
}

impl EgressLog {
    pub fn new(capacity: usize) -> Self {
        Self {
            records: VecDeque::new(),
            capacity: capacity.max(1),
            dropped: 0,
        }
    }

    pub fn push(&mut self, record: EgressRecord) {
        if self.records.len() == self.capacity {
            self.records.pop_front();
            self.dropped += 1;
        }
        self.records.push_back(record);
    }

    pub fn len(&self) -> usize {
        self.records.len()
    }

    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// Records dropped for lack of room since this log was made.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Oldest first.
    pub fn iter(&self) -> impl Iterator<Item = &EgressRecord> {
        self.records.iter()
    }

    /// Take every record, oldest first, leaving the log empty.
    pub fn drain(&mut self) -> Vec<EgressRecord> {
        self.records.drain(..).collect()
    }
}

/// Writes records as JSON lines (one object per line), up to a byte
/// budget: past it records are counted, not written, so that a guest
/// flooding attempts cannot fill the disk either.
#[derive(Debug)]
pub struct JsonLinesWriter<W: Write> {
    out: W,
    room: u64,
    dropped: u64,
}

impl<W: Write> JsonLinesWriter<W> {
    pub fn new(out: W) -> Self {
        Self::with_room(out, u64::MAX)
    }

    /// Writes at most `room` more bytes.
    pub fn with_room(out: W, room: u64) -> Self {
        Self {
            out,
            room,
            dropped: 0,
        }
    }

    pub fn write(&mut self, record: &EgressRecord) -> io::Result<()> {
        let mut line = serde_json::to_vec(record)?;
        line.push(b'\n');
        match self.room.checked_sub(line.len() as u64) {
            Some(left) => {
                self.out.write_all(&line)?;
                self.room = left;
            }
            None => self.dropped += 1,
        }
        Ok(())
    }

    /// Records not written for want of room.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    pub fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }

    pub fn into_inner(self) -> W {
        self.out
    }
}

/// A line of a log file that is not a record.
#[derive(Debug, thiserror::Error)]
pub enum ReadLogError {
    #[error("reading the egress log")]
    Io(#[from] io::Error),
    #[error("line {line} of the egress log is not a record")]
    BadLine {
        line: usize,
        #[source]
        cause: serde_json::Error,
    },
}

/// Read the last `limit` records of a JSON-lines log. Blank lines are
/// skipped; a line cut short by a crash mid-write is skipped only when it
/// is the last one.
pub fn read_json_lines<R: BufRead>(
    input: R,
    limit: usize,
) -> Result<Vec<EgressRecord>, ReadLogError> {
    let mut ring = EgressLog::new(limit);
    let mut pending_error = None;
    for (i, line) in input.lines().enumerate() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        if let Some(e) = pending_error.take() {
            return Err(e);
        }
        match serde_json::from_str(&line) {
            Ok(r) => ring.push(r),
            Err(cause) => pending_error = Some(ReadLogError::BadLine { line: i + 1, cause }),
        }
    }
    Ok(ring.drain())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(i: u64) -> EgressRecord {
        EgressRecord {
            time_ms: 1_700_000_000_000 + i,
            sandbox: "sb-1".into(),
            protocol: Protocol::Tcp,
            name: Some("pypi.example.org".into()),
            address: Some("192.0.2.1".parse().expect("address")),
            port: 443,
            verdict: Verdict::Allow,
            reason: LogReason::Rule,
            rule: Some("pypi.example.org:443".into()),
            answers: vec![],
            bytes_out: 100,
            bytes_in: 2000,
            duration_ms: 12,
            error: None,
        }
    }

    #[test]
    fn json_lines_writer_stops_at_its_room_and_counts_the_rest() {
        let one = {
            let mut w = JsonLinesWriter::new(Vec::new());
            w.write(&record(0)).expect("write");
            w.into_inner().len() as u64
        };
        // Room for two records and a bit.
        let mut w = JsonLinesWriter::with_room(Vec::new(), 2 * one + one / 2);
        for i in 0..5 {
            w.write(&record(i)).expect("write");
        }
        assert_eq!(w.dropped(), 3);
        let out = w.into_inner();
        let back = read_json_lines(&out[..], 10).expect("read");
        assert_eq!(back, vec![record(0), record(1)]);
    }

    #[test]
    fn record_json_has_sdk_field_names() {
        let v = serde_json::to_value(record(0)).expect("serialises");
        assert_eq!(
            v,
            serde_json::json!({
                "time_ms": 1_700_000_000_000u64,
                "sandbox": "sb-1",
                "protocol": "tcp",
                "name": "pypi.example.org",
                "address": "192.0.2.1",
                "port": 443,
                "verdict": "allow",
                "reason": "rule",
                "rule": "pypi.example.org:443",
                "bytes_out": 100,
                "bytes_in": 2000,
                "duration_ms": 12,
            })
        );
    }

    #[test]
    fn record_without_optional_fields_round_trips() {
        let mut r = record(1);
        r.name = None;
        r.rule = None;
        r.verdict = Verdict::Deny;
        r.reason = LogReason::NoRule;
        let line = serde_json::to_string(&r).expect("serialises");
        assert!(!line.contains("name"));
        let back: EgressRecord = serde_json::from_str(&line).expect("parses");
        assert_eq!(back, r);
    }

    #[test]
    fn ring_full_drops_oldest_and_counts() {
        let mut log = EgressLog::new(3);
        for i in 0..10 {
            log.push(record(i));
        }
        assert_eq!(log.len(), 3);
        assert_eq!(log.dropped(), 7);
        let times: Vec<u64> = log.iter().map(|r| r.time_ms % 100).collect();
        assert_eq!(times, vec![7, 8, 9]);
        assert_eq!(log.drain().len(), 3);
        assert!(log.is_empty());
    }

    #[test]
    fn ring_zero_capacity_still_keeps_one() {
        let mut log = EgressLog::new(0);
        log.push(record(0));
        log.push(record(1));
        assert_eq!(log.len(), 1);
    }

    #[test]
    fn json_lines_write_then_read_last_n() {
        let mut w = JsonLinesWriter::new(Vec::new());
        for i in 0..5 {
            w.write(&record(i)).expect("writes");
        }
        let bytes = w.into_inner();
        assert_eq!(bytes.iter().filter(|&&b| b == b'\n').count(), 5);
        let all = read_json_lines(&bytes[..], 100).expect("reads");
        assert_eq!(all.len(), 5);
        assert_eq!(all[4], record(4));
        let last = read_json_lines(&bytes[..], 2).expect("reads");
        assert_eq!(last, vec![record(3), record(4)]);
    }

    #[test]
    fn json_lines_torn_last_line_skipped_bad_middle_line_refused() {
        let mut w = JsonLinesWriter::new(Vec::new());
        w.write(&record(0)).expect("writes");
        let mut bytes = w.into_inner();
        bytes.extend_from_slice(b"{\"time_ms\": 17");
        assert_eq!(read_json_lines(&bytes[..], 10).expect("reads").len(), 1);
        bytes.extend_from_slice(b"\n\n");
        let mut w = JsonLinesWriter::new(bytes);
        w.write(&record(1)).expect("writes");
        let bytes = w.into_inner();
        let err = read_json_lines(&bytes[..], 10).expect_err("bad line in the middle");
        assert!(
            matches!(err, ReadLogError::BadLine { line: 2, .. }),
            "{err}"
        );
    }
}
