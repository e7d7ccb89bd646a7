//! The smoltcp [`Device`] between the gateway and the guest: two bounded
//! queues of Ethernet frames. The gateway pushes frames the guest sent
//! into `rx` (after its own checks) and the VMM takes frames for the guest
//! from `tx`.

use std::collections::VecDeque;

use smoltcp::phy::{self, Device, DeviceCapabilities, Medium};
use smoltcp::time::Instant;

/// Largest Ethernet frame either way: a 1500-byte MTU plus the 14-byte
/// header (no VLAN tags, no offloads).
pub const MAX_FRAME: usize = 1514;

pub(super) struct QueueDevice {
    pub rx: VecDeque<Vec<u8>>,
    pub tx: VecDeque<Vec<u8>>,
    /// Frames `tx` may hold; past that smoltcp is told "not now" and keeps
    /// its data (TCP retransmits), so a guest that stops reading costs a
    /// bounded amount of memory.
    pub tx_limit: usize,
}

impl QueueDevice {
    pub fn new(tx_limit: usize) -> Self {
        Self {
            rx: VecDeque::new(),
            tx: VecDeque::new(),
            tx_limit,
        }
    }
}

pub(super) struct RxToken(Vec<u8>);

pub(super) struct TxToken<'a>(&'a mut VecDeque<Vec<u8>>);

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
        if self.tx.len() < self.tx_limit {
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
