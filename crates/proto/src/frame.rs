//! Framing: `u8 kind | u32 little-endian length | body`.
//!
//! The codec is sans-IO: [`FrameHeader::parse`] validates a header from
//! bytes, [`Decoder`] turns an arbitrary byte stream into frames, and
//! [`encode_header`] produces a header. Every length is checked against a
//! maximum *before* anything is allocated, so a peer cannot make us
//! allocate more than `max_len` bytes per frame, whatever it sends.
//!
//! [`read_frame`] and [`write_frame`] are thin blocking helpers over
//! `std::io` built on the same header validation.

use std::io::{self, Read, Write};

/// Size of a frame header: one kind byte and a little-endian `u32` length.
pub const HEADER_LEN: usize = 5;

/// Default upper bound on a frame body (1 MiB).
pub const MAX_FRAME_LEN: u32 = 1 << 20;

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FrameKind {
    /// A JSON-encoded control message ([`crate::Hello`], [`crate::Request`],
    /// [`crate::Response`]).
    Control = 1,
    /// Raw bytes of a data stream: stdin, file contents, tar archives.
    Data = 2,
    /// Raw bytes the command wrote to stdout.
    Stdout = 3,
    /// Raw bytes the command wrote to stderr.
    Stderr = 4,
    /// End of the data stream (stdin, file contents, tar). Empty body.
    Eof = 5,
}

impl FrameKind {
    /// Decodes a kind byte.
    pub fn from_u8(b: u8) -> Option<Self> {
        match b {
            1 => Some(Self::Control),
            2 => Some(Self::Data),
            3 => Some(Self::Stdout),
            4 => Some(Self::Stderr),
            5 => Some(Self::Eof),
            _ => None,
        }
    }
}

/// A decoded frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub kind: FrameKind,
    pub body: Vec<u8>,
}

impl Frame {
    pub fn new(kind: FrameKind, body: Vec<u8>) -> Self {
        Self { kind, body }
    }
}

/// Why bytes could not be decoded into a frame.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    #[error("frame of {len} bytes exceeds the {max} byte limit")]
    Oversized { len: u32, max: u32 },
    #[error("frame I/O failed")]
    Io(#[source] io::Error),
}

/// A validated frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    pub kind: FrameKind,
    pub len: u32,
}

impl FrameHeader {
    /// Parses and validates a header. Never allocates.
    pub fn parse(bytes: [u8; HEADER_LEN], max_len: u32) -> Result<Self, FrameError> {
        let kind = FrameKind::from_u8(bytes[0]).ok_or(FrameError::UnknownKind(bytes[0]))?;
        let len = u32::from_le_bytes([bytes[1], bytes[2], bytes[3], bytes[4]]);
        if len > max_len {
            return Err(FrameError::Oversized { len, max: max_len });
        }
        Ok(Self { kind, len })
    }
}

/// Encodes a frame header for a body of `len` bytes.
pub fn encode_header(kind: FrameKind, len: u32) -> [u8; HEADER_LEN] {
    let l = len.to_le_bytes();
    [kind as u8, l[0], l[1], l[2], l[3]]
}

/// Encodes a whole frame into `out` (appending).
pub fn encode_frame(kind: FrameKind, body: &[u8], out: &mut Vec<u8>) -> Result<(), FrameError> {
    let len = u32::try_from(body.len()).map_err(|_| FrameError::Oversized {
        len: u32::MAX,
        max: MAX_FRAME_LEN,
    })?;
    out.reserve(HEADER_LEN + body.len());
    out.extend_from_slice(&encode_header(kind, len));
    out.extend_from_slice(body);
    Ok(())
}

/// Incremental sans-IO decoder: push bytes as they arrive, pop frames.
///
/// The internal buffer never holds more than one maximal frame plus what
/// the caller pushed in one call; a bad header poisons the decoder (the
/// stream cannot be resynchronised).
#[derive(Debug)]
pub struct Decoder {
    buf: Vec<u8>,
    max_len: u32,
    poisoned: bool,
}

impl Decoder {
    pub fn new(max_len: u32) -> Self {
        Self {
            buf: Vec::new(),
            max_len,
            poisoned: false,
        }
    }

    /// Appends received bytes.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// Bytes buffered but not yet returned as frames.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// Returns the next complete frame, `Ok(None)` if more bytes are needed.
    pub fn next_frame(&mut self) -> Result<Option<Frame>, FrameError> {
        if self.poisoned {
            return Err(FrameError::Io(io::Error::new(
                io::ErrorKind::InvalidData,
                "decoder poisoned by an earlier bad frame",
            )));
        }
        let Some(head) = self.buf.first_chunk::<HEADER_LEN>() else {
            return Ok(None);
        };
        let header = match FrameHeader::parse(*head, self.max_len) {
            Ok(h) => h,
            Err(e) => {
                self.poisoned = true;
                return Err(e);
            }
        };
        let total = HEADER_LEN + header.len as usize;
        if self.buf.len() < total {
            return Ok(None);
        }
        let body = self.buf[HEADER_LEN..total].to_vec();
        self.buf.drain(..total);
        Ok(Some(Frame::new(header.kind, body)))
    }
}

/// Reads one frame. `Ok(None)` on a clean EOF before the first header
/// byte; an EOF inside a frame is an `UnexpectedEof` I/O error.
pub fn read_frame(r: &mut impl Read, max_len: u32) -> Result<Option<Frame>, FrameError> {
    let mut head = [0u8; HEADER_LEN];
    let mut got = 0;
    while got < HEADER_LEN {
        match r.read(&mut head[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => {
                return Err(FrameError::Io(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "EOF inside a frame header",
                )))
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(FrameError::Io(e)),
        }
    }
    let header = FrameHeader::parse(head, max_len)?;
    // Bounded by `max_len`, checked above.
    let mut body = vec![0u8; header.len as usize];
    r.read_exact(&mut body).map_err(FrameError::Io)?;
    Ok(Some(Frame::new(header.kind, body)))
}

/// Writes one frame with a single `write_all` for small bodies and two
/// for large ones (no copy of large bodies).
pub fn write_frame(w: &mut impl Write, kind: FrameKind, body: &[u8]) -> io::Result<()> {
    let len = u32::try_from(body.len())
        .ok()
        .filter(|l| *l <= MAX_FRAME_LEN)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "frame body too large"))?;
    let head = encode_header(kind, len);
    if body.len() <= 4096 {
        let mut buf = Vec::with_capacity(HEADER_LEN + body.len());
        buf.extend_from_slice(&head);
        buf.extend_from_slice(body);
        w.write_all(&buf)
    } else {
        w.write_all(&head)?;
        w.write_all(body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_roundtrip_preserves_kind_and_len() {
        let h = encode_header(FrameKind::Stdout, 1234);
        let p = FrameHeader::parse(h, MAX_FRAME_LEN).expect("valid header");
        assert_eq!(p.kind, FrameKind::Stdout);
        assert_eq!(p.len, 1234);
    }

    #[test]
    fn header_oversized_len_rejected() {
        let h = encode_header(FrameKind::Data, MAX_FRAME_LEN + 1);
        assert!(matches!(
            FrameHeader::parse(h, MAX_FRAME_LEN),
            Err(FrameError::Oversized { .. })
        ));
    }

    #[test]
    fn header_unknown_kind_rejected() {
        assert!(matches!(
            FrameHeader::parse([0, 0, 0, 0, 0], MAX_FRAME_LEN),
            Err(FrameError::UnknownKind(0))
        ));
    }

    #[test]
    fn decoder_byte_at_a_time_yields_all_frames() {
        let mut wire = Vec::new();
        encode_frame(FrameKind::Control, b"{\"a\":1}", &mut wire).expect("encode");
        encode_frame(FrameKind::Eof, b"", &mut wire).expect("encode");
        encode_frame(FrameKind::Data, &[7u8; 300], &mut wire).expect("encode");
        let mut d = Decoder::new(MAX_FRAME_LEN);
        let mut frames = Vec::new();
        for b in &wire {
            d.push(std::slice::from_ref(b));
            while let Some(f) = d.next_frame().expect("valid stream") {
                frames.push(f);
            }
        }
        assert_eq!(frames.len(), 3);
        assert_eq!(frames[0].body, b"{\"a\":1}");
        assert_eq!(frames[1].kind, FrameKind::Eof);
        assert_eq!(frames[2].body, vec![7u8; 300]);
        assert_eq!(d.buffered(), 0);
    }

    #[test]
    fn decoder_bad_header_poisons() {
        let mut d = Decoder::new(16);
        d.push(&encode_header(FrameKind::Data, 17));
        assert!(d.next_frame().is_err());
        d.push(&encode_header(FrameKind::Data, 1));
        assert!(d.next_frame().is_err());
    }

    #[test]
    fn read_frame_clean_eof_returns_none() {
        let mut r: &[u8] = &[];
        assert!(read_frame(&mut r, MAX_FRAME_LEN)
            .expect("clean eof")
            .is_none());
    }

    #[test]
    fn read_frame_truncated_body_errors() {
        let mut wire = encode_header(FrameKind::Data, 10).to_vec();
        wire.extend_from_slice(b"abc");
        let mut r: &[u8] = &wire;
        assert!(matches!(
            read_frame(&mut r, MAX_FRAME_LEN),
            Err(FrameError::Io(_))
        ));
    }

    #[test]
    fn read_frame_oversized_rejected_before_allocating() {
        // A 4 GiB claim must fail on the header, not try to allocate.
        let wire = encode_header(FrameKind::Data, u32::MAX);
        let mut r: &[u8] = &wire;
        assert!(matches!(
            read_frame(&mut r, MAX_FRAME_LEN),
            Err(FrameError::Oversized { .. })
        ));
    }

    #[test]
    fn write_frame_then_read_frame_roundtrips_large_body() {
        let body: Vec<u8> = (0..MAX_FRAME_LEN).map(|i| i as u8).collect();
        let mut wire = Vec::new();
        write_frame(&mut wire, FrameKind::Stdout, &body).expect("write");
        let mut r: &[u8] = &wire;
        let f = read_frame(&mut r, MAX_FRAME_LEN)
            .expect("read")
            .expect("frame");
        assert_eq!(f.kind, FrameKind::Stdout);
        assert_eq!(f.body, body);
    }

    #[test]
    fn write_frame_body_over_limit_rejected() {
        let body = vec![0u8; MAX_FRAME_LEN as usize + 1];
        assert!(write_frame(&mut Vec::new(), FrameKind::Data, &body).is_err());
    }

    /// Fuzz-style: arbitrary bytes, fed in arbitrary chunkings, never panic
    /// and never make the decoder buffer grow beyond what was pushed.
    #[test]
    fn decoder_arbitrary_bytes_never_panics_or_overallocates() {
        // Small deterministic PRNG (xorshift64*), no dependency needed.
        let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut next = move || {
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            state.wrapping_mul(0x2545_F491_4F6C_DD1D)
        };
        for _ in 0..2000 {
            let len = (next() % 600) as usize;
            let mut bytes: Vec<u8> = (0..len).map(|_| next() as u8).collect();
            // Bias some inputs towards valid kinds so deeper paths run.
            if !bytes.is_empty() && next() % 2 == 0 {
                bytes[0] = (next() % 6) as u8;
            }
            let max = 256;
            let mut d = Decoder::new(max);
            let mut pushed = 0usize;
            let mut i = 0;
            while i < bytes.len() {
                let step = 1 + (next() % 64) as usize;
                let end = (i + step).min(bytes.len());
                d.push(&bytes[i..end]);
                pushed += end - i;
                i = end;
                while let Ok(Some(f)) = d.next_frame() {
                    assert!(f.body.len() <= max as usize);
                }
                assert!(d.buffered() <= pushed);
            }
            let mut r: &[u8] = &bytes;
            while let Ok(Some(f)) = read_frame(&mut r, max) {
                assert!(f.body.len() <= max as usize);
            }
        }
    }
}
