//! The virtio-vsock packet header (virtio 1.x §5.10.6), sans-IO.
//!
//! `struct virtio_vsock_hdr` is 44 little-endian bytes: src_cid u64,
//! dst_cid u64, src_port u32, dst_port u32, len u32, type u16, op u16,
//! flags u32, buf_alloc u32, fwd_cnt u32.

/// Length of the packet header.
pub const HDR_LEN: usize = 44;
/// The host's CID, as the guest sees it.
pub const HOST_CID: u64 = 2;
/// `type` of stream sockets, the only type we carry.
pub const TYPE_STREAM: u16 = 1;
/// SHUTDOWN flag: the sender will receive no more data.
pub const SHUTDOWN_RCV: u32 = 1;
/// SHUTDOWN flag: the sender will send no more data.
pub const SHUTDOWN_SEND: u32 = 2;
/// Both SHUTDOWN flags.
pub const SHUTDOWN_BOTH: u32 = SHUTDOWN_RCV | SHUTDOWN_SEND;
/// Largest payload of one packet, either way (Linux's
/// VIRTIO_VSOCK_MAX_PKT_BUF_SIZE).
pub const MAX_PKT_LEN: u32 = 64 * 1024;

/// Packet operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
pub enum Op {
    Request = 1,
    Response = 2,
    Rst = 3,
    Shutdown = 4,
    Rw = 5,
    CreditUpdate = 6,
    CreditRequest = 7,
}

impl Op {
    pub fn from_u16(v: u16) -> Option<Op> {
        Some(match v {
            1 => Op::Request,
            2 => Op::Response,
            3 => Op::Rst,
            4 => Op::Shutdown,
            5 => Op::Rw,
            6 => Op::CreditUpdate,
            7 => Op::CreditRequest,
            _ => return None,
        })
    }
}

/// Why bytes are not a packet header.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PacketError {
    #[error("header is {0} bytes, want {HDR_LEN}")]
    Short(usize),
}

/// A decoded `virtio_vsock_hdr`. `op` is kept raw so unknown operations
/// round-trip; use [`Header::op`] to interpret it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Header {
    pub src_cid: u64,
    pub dst_cid: u64,
    pub src_port: u32,
    pub dst_port: u32,
    pub len: u32,
    pub type_: u16,
    pub op: u16,
    pub flags: u32,
    pub buf_alloc: u32,
    pub fwd_cnt: u32,
}

fn le_u16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn le_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn le_u64(b: &[u8], at: usize) -> u64 {
    u64::from(le_u32(b, at)) | (u64::from(le_u32(b, at + 4)) << 32)
}

impl Header {
    /// Decodes the first [`HDR_LEN`] bytes of `b`.
    pub fn parse(b: &[u8]) -> Result<Header, PacketError> {
        if b.len() < HDR_LEN {
            return Err(PacketError::Short(b.len()));
        }
        Ok(Header {
            src_cid: le_u64(b, 0),
            dst_cid: le_u64(b, 8),
            src_port: le_u32(b, 16),
            dst_port: le_u32(b, 20),
            len: le_u32(b, 24),
            type_: le_u16(b, 28),
            op: le_u16(b, 30),
            flags: le_u32(b, 32),
            buf_alloc: le_u32(b, 36),
            fwd_cnt: le_u32(b, 40),
        })
    }

    pub fn to_bytes(&self) -> [u8; HDR_LEN] {
        let mut b = [0u8; HDR_LEN];
        b[0..8].copy_from_slice(&self.src_cid.to_le_bytes());
        b[8..16].copy_from_slice(&self.dst_cid.to_le_bytes());
        b[16..20].copy_from_slice(&self.src_port.to_le_bytes());
        b[20..24].copy_from_slice(&self.dst_port.to_le_bytes());
        b[24..28].copy_from_slice(&self.len.to_le_bytes());
        b[28..30].copy_from_slice(&self.type_.to_le_bytes());
        b[30..32].copy_from_slice(&self.op.to_le_bytes());
        b[32..36].copy_from_slice(&self.flags.to_le_bytes());
        b[36..40].copy_from_slice(&self.buf_alloc.to_le_bytes());
        b[40..44].copy_from_slice(&self.fwd_cnt.to_le_bytes());
        b
    }

    pub fn op(&self) -> Option<Op> {
        Op::from_u16(self.op)
    }

    /// A header-only reply to `self` with source and destination swapped.
    pub fn reply(&self, op: Op) -> Header {
        Header {
            src_cid: self.dst_cid,
            dst_cid: self.src_cid,
            src_port: self.dst_port,
            dst_port: self.src_port,
            len: 0,
            type_: TYPE_STREAM,
            op: op as u16,
            flags: 0,
            buf_alloc: 0,
            fwd_cnt: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_roundtrips_through_bytes() {
        let h = Header {
            src_cid: 0x0102_0304_0506_0708,
            dst_cid: 2,
            src_port: 0xdead_beef,
            dst_port: 1024,
            len: 5,
            type_: TYPE_STREAM,
            op: Op::Rw as u16,
            flags: SHUTDOWN_BOTH,
            buf_alloc: 1 << 18,
            fwd_cnt: 77,
        };
        let b = h.to_bytes();
        assert_eq!(&b[0..8], &[8, 7, 6, 5, 4, 3, 2, 1]);
        assert_eq!(&b[30..32], &[5, 0]);
        assert_eq!(Header::parse(&b), Ok(h));
        assert_eq!(h.op(), Some(Op::Rw));
    }

    #[test]
    fn header_short_input_is_an_error() {
        assert_eq!(Header::parse(&[0; 43]), Err(PacketError::Short(43)));
    }

    #[test]
    fn header_unknown_op_is_none() {
        let h = Header {
            op: 99,
            ..Header::default()
        };
        assert_eq!(Header::parse(&h.to_bytes()).map(|h| h.op()), Ok(None));
    }
}
