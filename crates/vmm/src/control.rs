//! The control socket's byte stream, sans-IO: splits what a client sends
//! into bounded lines. The requests and answers themselves are
//! `forkbox-vmm-api`'s ([`forkbox_vmm_api::control`]); the event loop in
//! `vm` owns the sockets.

use forkbox_vmm_api::MAX_LINE;

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
