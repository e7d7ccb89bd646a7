//! The smoltcp [`Device`] between the gateway and the guest: two bounded
//! queues of Ethernet frames. The gateway pushes frames the guest sent
//! into `rx` (after its own checks) and the VMM takes frames for the guest
//! from `tx`.

use std::collections::VecDeque;

use smoltcp::phy::{self, Device, DeviceCapabilities, Medium};
use smoltcp::time::Instant;

/// The link's IP MTU: the guest's virtio-net is offered the same
/// (`VIRTIO_NET_F_MTU`). The link is virtual, so a large MTU stands in for
/// segmentation offloads: a ~64 KiB TCP segment is one frame, one pass
/// through the VMM and smoltcp, one ACK.
pub const MTU: usize = 65520;

/// Largest Ethernet frame either way: [`MTU`] plus the 14-byte header
/// (no VLAN tags, no offloads).
pub const MAX_FRAME: usize = MTU + 14;

/// Frames in order, and their total size.
#[derive(Default)]
pub(super) struct FrameQueue {
    frames: VecDeque<Vec<u8>>,
    bytes: usize,
}

impl FrameQueue {
    pub fn push_back(&mut self, frame: Vec<u8>) {
        self.bytes += frame.len();
        self.frames.push_back(frame);
    }

    pub fn push_front(&mut self, frame: Vec<u8>) {
        self.bytes += frame.len();
        self.frames.push_front(frame);
    }

    pub fn pop_front(&mut self) -> Option<Vec<u8>> {
        let frame = self.frames.pop_front()?;
        self.bytes -= frame.len();
        Some(frame)
    }

    pub fn len(&self) -> usize {
        self.frames.len()
    }

    /// Bytes of all queued frames.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

pub(super) struct QueueDevice {
    pub rx: FrameQueue,
    pub tx: FrameQueue,
    /// Frames and bytes `tx` may hold; past either smoltcp is told "not
    /// now" and keeps its data (TCP retransmits), so a guest that stops
    /// reading costs a bounded amount of memory (the byte limit plus one
    /// frame).
    pub tx_limit: usize,
    pub tx_limit_bytes: usize,
}

impl QueueDevice {
    pub fn new(tx_limit: usize, tx_limit_bytes: usize) -> Self {
        Self {
            rx: FrameQueue::default(),
            tx: FrameQueue::default(),
            tx_limit,
            tx_limit_bytes,
        }
    }
}

pub(super) struct RxToken(Vec<u8>);

pub(super) struct TxToken<'a>(&'a mut FrameQueue);

impl phy::RxToken for RxToken {
    fn consume<R, F>(self, f: F) -> R
    where
        F: FnOnce(&[u8]) -> R,
    {
        f(&self.0)
    }
}

impl phy::TxToken for TxToken<'_> {
    fn consume<R, F>(self, len: usize, f: F) -> R
    where
        F: FnOnce(&mut [u8]) -> R,
    {
        let mut frame = vec![0; len];
        let r = f(&mut frame);
        self.0.push_back(frame);
        r
    }
}

impl Device for QueueDevice {
    type RxToken<'a> = RxToken;
    type TxToken<'a> = TxToken<'a>;

    /// Always takes a queued frame, even with `tx` full: a replayed SYN
    /// must reach its listener in the same poll (see `Gateway::open`). The
    /// direct reply this may queue past the limit is bounded by `rx`'s own
    /// limit.
    fn receive(&mut self, _now: Instant) -> Option<(RxToken, TxToken<'_>)> {
        let frame = self.rx.pop_front()?;
        Some((RxToken(frame), TxToken(&mut self.tx)))
    }

    fn transmit(&mut self, _now: Instant) -> Option<TxToken<'_>> {
        if self.tx.len() < self.tx_limit && self.tx.bytes() < self.tx_limit_bytes {
            Some(TxToken(&mut self.tx))
        } else {
            None
        }
    }

    fn capabilities(&self) -> DeviceCapabilities {
        let mut caps = DeviceCapabilities::default();
        caps.medium = Medium::Ethernet;
        caps.max_transmission_unit = MAX_FRAME;
        caps
    }
}
