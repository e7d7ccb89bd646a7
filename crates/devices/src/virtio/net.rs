//! virtio-net (virtio 1.x §5.1): Ethernet frames between the guest and a
//! [`FrameBackend`].
//!
//! Features: `VIRTIO_F_VERSION_1`, `VIRTIO_NET_F_MAC` and
//! `VIRTIO_NET_F_MTU` with an [`MTU`] of 65520. The link is virtual, so a
//! large MTU stands in for segmentation offloads: the guest's TCP sends
//! ~64 KiB segments, one tx chain (and one gateway pass) each, instead of
//! forty-odd 1500-byte ones. No checksum or segmentation offloads, no
//! mergeable receive buffers, one queue pair: every frame is at most
//! [`MAX_FRAME`] bytes behind the 12-byte `virtio_net_hdr_v1`, which this
//! device writes as all zeroes (with `num_buffers` = 1) and ignores on
//! transmit. With an MTU over 1500 Linux posts "big packets" rx chains (the
//! header in its own descriptor, then a page-sized descriptor per 4 KiB):
//! a frame is written across the chain's descriptors.
//!
//! Sans-IO like the other devices: the backend decides where frames go
//! (in forkbox, the userspace gateway of `forkbox-net` in the VMM) and
//! exposes at most one fd for its host events. The device moves frames:
//! - tx (queue 1): each chain's readable bytes minus the header are one
//!   frame, handed to [`FrameBackend::send`]; then [`FrameBackend::flush`];
//! - rx (queue 0): frames from [`FrameBackend::recv`] fill the guest's
//!   buffers; a frame that finds no buffer waits in the device until the
//!   guest posts one (its rx kick).
//!
//! Guest bytes are bounded: a tx chain longer than a header plus
//! [`MAX_FRAME`] is returned unread (the frame is dropped and counted).

use std::borrow::Cow;
use std::os::fd::RawFd;

use virtio_bindings::virtio_ids::VIRTIO_ID_NET;
use virtio_bindings::virtio_net::{VIRTIO_NET_F_MAC, VIRTIO_NET_F_MTU};
use virtio_queue::Queue;

use crate::virtio::chain::{Chain, ChainError};
use crate::virtio::mmio::VIRTIO_F_VERSION_1;
use crate::virtio::persist::{DeviceState, NetState, RestoreError};
use crate::virtio::{ActivateError, Active, Budget, VirtioDevice};
use crate::{EventSource, GuestMemory, Interrupt, Work};

/// Size of each queue.
pub const QUEUE_SIZE: u16 = 256;
/// `virtio_net_hdr_v1`: flags, gso_type, hdr_len, gso_size, csum_start,
/// csum_offset, num_buffers.
pub const HDR_LEN: usize = 12;
/// The MTU offered in the configuration space (`VIRTIO_NET_F_MTU`): the
/// largest IPv4 packet (65535) rounded down to a multiple of 16.
pub const MTU: u16 = 65520;
/// Largest Ethernet frame either way ([`MTU`], the 14-byte header, a VLAN
/// tag's 4 bytes of slack).
pub const MAX_FRAME: usize = MTU as usize + 14 + 4;
/// Offset of `mtu` in `virtio_net_config` (after `mac`, `status`,
/// `max_virtqueue_pairs`).
const CONFIG_MTU: usize = 10;
const RX: usize = 0;
const TX: usize = 1;
/// Name in log lines.
const DEVICE: &str = "virtio-net";

/// Where the guest's frames go and where its frames come from.
pub trait FrameBackend: Send {
    /// One Ethernet frame the guest sent.
    fn send(&mut self, frame: &[u8]);
    /// A batch of [`FrameBackend::send`]s is over: process it.
    fn flush(&mut self);
    /// The next frame for the guest, if any.
    fn recv(&mut self) -> Option<Vec<u8>>;
    /// The fd the VMM watches for this backend's host events.
    fn event_fd(&self) -> Option<RawFd>;
    /// The fd is readable: do the host-side work.
    fn handle_events(&mut self);
}

/// What went wrong with one chain (logged at debug level; the guest sees
/// a dropped frame).
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("bad descriptor chain")]
    Chain(#[source] ChainError),
    #[error("tx chain of {0} bytes is shorter than the header")]
    ShortTx(u64),
    #[error("tx frame of {0} bytes is over the limit")]
    LongTx(u64),
    #[error("rx buffer of {have} bytes cannot hold {need}")]
    SmallRx { have: u64, need: usize },
}

/// Frames dropped, for tests and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NetCounters {
    pub tx_frames: u64,
    pub rx_frames: u64,
    pub tx_dropped: u64,
    pub rx_dropped: u64,
}

/// A virtio-net device in front of a [`FrameBackend`].
pub struct Net {
    mac: [u8; 6],
    backend: Box<dyn FrameBackend>,
    acked_features: u64,
    active: Option<Active<2>>,
    /// A frame taken from the backend that found no rx buffer yet.
    waiting: Option<Vec<u8>>,
    counters: NetCounters,
    scratch: Vec<u8>,
}

impl Net {
    pub fn new(mac: [u8; 6], backend: Box<dyn FrameBackend>) -> Net {
        Net {
            mac,
            backend,
            acked_features: 0,
            active: None,
            waiting: None,
            counters: NetCounters::default(),
            scratch: Vec::new(),
        }
    }

    pub fn counters(&self) -> NetCounters {
        self.counters
    }

    /// Sends the guest's frames, within one turn's budget; says whether
    /// it used buffers (an interrupt is owed) and whether work is left.
    fn process_tx(&mut self) -> (bool, Work) {
        let Some(active) = self.active.as_mut() else {
            return (false, Work::Done);
        };
        let irq = active.interrupt.clone();
        let mut sent = false;
        let served = active.serve(TX, |mem, chain| {
            let frame = chain
                .map_err(NetError::Chain)
                .and_then(|c| read_tx(mem, &c, &mut self.scratch));
            match frame {
                Ok(frame) => {
                    self.backend.send(frame);
                    self.counters.tx_frames += 1;
                    sent = true;
                }
                Err(e) => {
                    irq.guest_error(DEVICE, &e);
                    self.counters.tx_dropped += 1;
                }
            }
            0
        });
        if sent {
            self.backend.flush();
        }
        served
    }

    /// Moves frames from the backend into the guest's rx buffers, within
    /// one turn's budget; says whether it used buffers (an interrupt is
    /// owed) and whether work is left.
    fn process_rx(&mut self) -> (bool, Work) {
        let Some(active) = self.active.as_mut() else {
            return (false, Work::Done);
        };
        let mut used = false;
        let mut budget = Budget::default();
        while !budget.exhausted() {
            let Some(frame) = self.waiting.take().or_else(|| self.backend.recv()) else {
                return (used, Work::Done);
            };
            let Some((head, chain)) = active.pop(RX) else {
                self.waiting = Some(frame);
                return (used, Work::Done);
            };
            budget.spend(frame.len() as u64);
            let written = chain
                .map_err(NetError::Chain)
                .and_then(|c| write_rx(&active.mem, &c, &frame));
            let len = match written {
                Ok(n) => {
                    self.counters.rx_frames += 1;
                    n
                }
                Err(e) => {
                    active.interrupt.guest_error(DEVICE, &e);
                    self.counters.rx_dropped += 1;
                    0
                }
            };
            active.add_used(RX, head, len);
            used = true;
        }
        (used, Work::More)
    }

    /// One interrupt for whatever `used` says both queues returned.
    fn signal(&self, used: bool) {
        if let (true, Some(active)) = (used, self.active.as_ref()) {
            active.interrupt.signal_used_queue();
        }
    }
}

/// The frame in a tx chain, copied into `buf` (the header skipped).
fn read_tx<'a>(
    mem: &GuestMemory,
    chain: &Chain,
    buf: &'a mut Vec<u8>,
) -> Result<&'a [u8], NetError> {
    let total = chain.readable.len();
    if total < HDR_LEN as u64 {
        return Err(NetError::ShortTx(total));
    }
    let len = total - HDR_LEN as u64;
    if len > MAX_FRAME as u64 {
        return Err(NetError::LongTx(len));
    }
    // `len` <= MAX_FRAME.
    buf.resize(len as usize, 0);
    let n = chain
        .readable
        .read_at(mem, HDR_LEN as u64, buf)
        .map_err(NetError::Chain)?;
    Ok(&buf[..n])
}

/// Writes the header and `frame` into an rx chain; returns the bytes used.
fn write_rx(mem: &GuestMemory, chain: &Chain, frame: &[u8]) -> Result<u32, NetError> {
    let need = HDR_LEN + frame.len();
    if chain.writable.len() < need as u64 {
        return Err(NetError::SmallRx {
            have: chain.writable.len(),
            need,
        });
    }
    let mut hdr = [0u8; HDR_LEN];
    // num_buffers: one, as always without VIRTIO_NET_F_MRG_RXBUF.
    hdr[10..12].copy_from_slice(&1u16.to_le_bytes());
    chain
        .writable
        .write_at(mem, 0, &hdr)
        .map_err(NetError::Chain)?;
    chain
        .writable
        .write_at(mem, HDR_LEN as u64, frame)
        .map_err(NetError::Chain)?;
    // `need` <= HDR_LEN + the backend's frame size, far below u32::MAX.
    Ok(u32::try_from(need).unwrap_or(u32::MAX))
}

impl EventSource for Net {
    fn event_fd(&self) -> Option<RawFd> {
        self.backend.event_fd()
    }

    fn handle_events(&mut self) -> Work {
        self.backend.handle_events();
        let (used, work) = self.process_rx();
        self.signal(used);
        work
    }
}

impl VirtioDevice for Net {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_NET
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE, QUEUE_SIZE]
    }

    fn features(&self) -> u64 {
        VIRTIO_F_VERSION_1 | 1 << VIRTIO_NET_F_MAC | 1 << VIRTIO_NET_F_MTU
    }

    fn ack_features(&mut self, features: u64) {
        self.acked_features = features & self.features();
    }

    /// The configuration space: `mac` (6 bytes), `status` and
    /// `max_virtqueue_pairs` as zero (not offered), `mtu` (le16); the rest
    /// reads as zero.
    fn config_space(&self) -> Cow<'_, [u8]> {
        let mut config = [0u8; CONFIG_MTU + 2];
        config[..6].copy_from_slice(&self.mac);
        config[CONFIG_MTU..].copy_from_slice(&MTU.to_le_bytes());
        Cow::Owned(config.to_vec())
    }

    fn activate(
        &mut self,
        mem: GuestMemory,
        queues: Vec<Queue>,
        interrupt: Interrupt,
    ) -> Result<(), ActivateError> {
        self.active = Some(Active::new(mem, queues, interrupt, self.acked_features)?);
        let (used, _) = self.process_rx();
        self.signal(used);
        Ok(())
    }

    fn queue_notify(&mut self, index: u16) -> Work {
        match usize::from(index) {
            RX => {
                let (used, work) = self.process_rx();
                self.signal(used);
                work
            }
            TX => {
                // The tx buffers and the replies they caused, one interrupt.
                let (tx_used, tx_work) = self.process_tx();
                let (rx_used, rx_work) = self.process_rx();
                self.signal(tx_used | rx_used);
                tx_work | rx_work
            }
            _ => {
                tracing::debug!(index, "virtio-net: notify for no queue");
                Work::Done
            }
        }
    }

    fn reset(&mut self) {
        self.active = None;
        self.acked_features = 0;
        self.waiting = None;
    }

    fn save(&self) -> DeviceState {
        DeviceState::Net(NetState {
            mac: self.mac,
            acked_features: self.acked_features,
            queues: self.active.as_ref().map(Active::save),
        })
    }

    /// Frames in flight (one waiting for an rx buffer, any the backend
    /// held) are not part of the state: they are lost as on a wire, and
    /// TCP retransmits.
    fn restore(
        &mut self,
        mem: GuestMemory,
        interrupt: Interrupt,
        state: &DeviceState,
    ) -> Result<(), RestoreError> {
        let DeviceState::Net(state) = state else {
            return Err(state.wrong_device("net"));
        };
        self.mac = state.mac;
        self.acked_features = state.acked_features & self.features();
        self.waiting = None;
        self.active =
            Active::restore(mem, interrupt, state.queues.as_deref(), self.acked_features)?;
        // Kicks sent just before the capture went to the old process.
        let (tx_used, _) = self.process_tx();
        let (rx_used, _) = self.process_rx();
        self.signal(tx_used | rx_used);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::sync::{Arc, Mutex};

    use vm_memory::{Bytes, GuestAddress};
    use vmm_sys_util::eventfd::EventFd;

    use super::*;
    use crate::virtio::testutil::{memory, ro, wo, Buf, Driver};

    /// Frames each way, shared with the test.
    #[derive(Default)]
    struct Wire {
        from_guest: Vec<Vec<u8>>,
        to_guest: VecDeque<Vec<u8>>,
        flushes: usize,
        events: usize,
    }

    #[derive(Clone, Default)]
    struct TestBackend(Arc<Mutex<Wire>>);

    impl TestBackend {
        fn wire(&self) -> std::sync::MutexGuard<'_, Wire> {
            self.0.lock().expect("test wire")
        }
    }

    impl FrameBackend for TestBackend {
        fn send(&mut self, frame: &[u8]) {
            self.wire().from_guest.push(frame.to_vec());
        }
        fn flush(&mut self) {
            self.wire().flushes += 1;
        }
        fn recv(&mut self) -> Option<Vec<u8>> {
            self.wire().to_guest.pop_front()
        }
        fn event_fd(&self) -> Option<RawFd> {
            None
        }
        fn handle_events(&mut self) {
            self.wire().events += 1;
        }
    }

    const MAC: [u8; 6] = [2, 0, 0, 0, 0, 0x0f];
    const RXQ: u64 = 0;
    const TXQ: u64 = 0x1_0000;
    const BUF: u64 = 0x10_0000;

    fn frame(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31) ^ seed)
            .collect()
    }

    type Setup<'a> = (Net, TestBackend, Driver<'a>, Driver<'a>, Arc<EventFd>);

    fn setup(mem: &GuestMemory) -> Setup<'_> {
        setup_sized(mem, 16)
    }

    /// Queues of `size` entries: a 64 KiB frame in page-sized buffers
    /// takes 18 descriptors.
    fn setup_sized(mem: &GuestMemory, size: u16) -> Setup<'_> {
        let backend = TestBackend::default();
        let mut net = Net::new(MAC, Box::new(backend.clone()));
        let rx = Driver::new(mem, RXQ, size);
        let tx = Driver::new(mem, TXQ, size);
        let irq = Arc::new(EventFd::new(libc::EFD_NONBLOCK).expect("eventfd"));
        net.ack_features(net.features());
        net.activate(
            mem.clone(),
            vec![rx.queue(), tx.queue()],
            Interrupt::new(irq.clone()),
        )
        .expect("activate");
        (net, backend, rx, tx, irq)
    }

    #[test]
    fn net_config_is_mac_and_mtu_and_features_are_minimal() {
        let net = Net::new(MAC, Box::new(TestBackend::default()));
        let mut config = [0xffu8; 14];
        net.read_config(0, &mut config);
        assert_eq!(&config[..6], &MAC);
        assert_eq!(&config[6..10], &[0, 0, 0, 0]);
        assert_eq!(u16::from_le_bytes([config[10], config[11]]), 65520);
        assert_eq!(&config[12..], &[0, 0]);
        let mut mtu = [0u8; 2];
        net.read_config(10, &mut mtu);
        assert_eq!(u16::from_le_bytes(mtu), MTU);
        let mut past = [0xffu8; 2];
        net.read_config(u64::MAX, &mut past);
        assert_eq!(past, [0, 0]);
        assert_eq!(net.device_type(), 1);
        assert_eq!(net.features(), VIRTIO_F_VERSION_1 | 1 << 5 | 1 << 3);
        assert_eq!(net.queue_max_sizes().len(), 2);
    }

    #[test]
    fn net_tx_strips_header_and_batches_one_flush() {
        let mem = memory(0x40_0000);
        let (mut net, backend, _rx, mut tx, irq) = setup(&mem);
        let a = frame(60, 1);
        let b = frame(1514, 2);
        mem.write_slice(&[0xee; HDR_LEN], GuestAddress(BUF))
            .expect("hdr");
        mem.write_slice(&a, GuestAddress(BUF + HDR_LEN as u64))
            .expect("a");
        // b split across the header descriptor and two more.
        mem.write_slice(&[0; HDR_LEN], GuestAddress(BUF + 0x1000))
            .expect("hdr");
        mem.write_slice(&b[..100], GuestAddress(BUF + 0x1000 + HDR_LEN as u64))
            .expect("b0");
        mem.write_slice(&b[100..], GuestAddress(BUF + 0x2000))
            .expect("b1");
        tx.add(&[ro(BUF, (HDR_LEN + a.len()) as u32)]);
        tx.add(&[
            ro(BUF + 0x1000, (HDR_LEN + 100) as u32),
            ro(BUF + 0x2000, (b.len() - 100) as u32),
        ]);
        net.queue_notify(1);
        assert_eq!(tx.used().len(), 2);
        assert_eq!(backend.wire().from_guest, vec![a, b]);
        assert_eq!(backend.wire().flushes, 1);
        assert_eq!(irq.read().expect("interrupt"), 1);
    }

    /// Linux's "big packets" rx chain (MTU over 1500, no mergeable
    /// buffers): the header alone, the rest of its page, then whole pages.
    fn big_packets_chain(base: u64, pages: u64) -> Vec<Buf> {
        let mut bufs = vec![wo(base, HDR_LEN as u32), wo(base + 16, 0x1000 - 16)];
        bufs.extend((1..=pages).map(|p| wo(base + p * 0x1000, 0x1000)));
        bufs
    }

    #[test]
    fn net_rx_largest_frame_spans_a_big_packets_chain() {
        let mem = memory(0x40_0000);
        let (mut net, backend, mut rx, _tx, irq) = setup_sized(&mem, 64);
        let big = frame(usize::from(MTU) + 14, 7);
        let small = frame(60, 8);
        backend.wire().to_guest.extend([big.clone(), small.clone()]);
        rx.add(&big_packets_chain(BUF, 16));
        rx.add(&big_packets_chain(BUF + 0x20_0000, 16));
        net.handle_events();
        assert_eq!(
            rx.used(),
            vec![
                (0, (HDR_LEN + big.len()) as u32),
                (18, (HDR_LEN + 60) as u32)
            ]
        );
        assert_eq!(irq.read().expect("interrupt"), 1);
        let mut hdr = [0u8; HDR_LEN];
        mem.read_slice(&mut hdr, GuestAddress(BUF)).expect("hdr");
        assert_eq!(hdr, [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0]);
        // The frame: 4080 bytes after the header's padding, then pages.
        let mut got = vec![0u8; big.len()];
        mem.read_slice(&mut got[..0x1000 - 16], GuestAddress(BUF + 16))
            .expect("first page");
        mem.read_slice(&mut got[0x1000 - 16..], GuestAddress(BUF + 0x1000))
            .expect("pages");
        assert_eq!(got, big);
        let mut got = vec![0u8; 60];
        mem.read_slice(&mut got, GuestAddress(BUF + 0x20_0000 + 16))
            .expect("small");
        assert_eq!(got, small);
        assert_eq!(net.counters().rx_dropped, 0);
    }

    #[test]
    fn net_tx_largest_frame_in_page_sized_descriptors_is_one_frame() {
        let mem = memory(0x40_0000);
        let (mut net, backend, _rx, mut tx, _irq) = setup_sized(&mem, 64);
        let big = frame(MAX_FRAME, 5);
        mem.write_slice(&[0; HDR_LEN], GuestAddress(BUF))
            .expect("hdr");
        let mut bufs = vec![ro(BUF, HDR_LEN as u32)];
        for (i, piece) in big.chunks(0x1000).enumerate() {
            let addr = BUF + 0x1000 * (i as u64 + 1);
            mem.write_slice(piece, GuestAddress(addr)).expect("piece");
            bufs.push(ro(addr, piece.len() as u32));
        }
        assert_eq!(bufs.len(), 18);
        tx.add(&bufs);
        // One byte over the limit, in the same shape: dropped.
        let mut over = vec![ro(BUF, HDR_LEN as u32)];
        over.extend(bufs[1..].iter().copied());
        over.push(ro(BUF, 1));
        tx.add(&over);
        net.queue_notify(1);
        assert_eq!(tx.used().len(), 2);
        assert_eq!(backend.wire().from_guest, vec![big]);
        assert_eq!(net.counters().tx_dropped, 1);
    }

    #[test]
    fn net_tx_and_the_replies_it_causes_raise_one_interrupt() {
        let mem = memory(0x40_0000);
        let (mut net, backend, mut rx, mut tx, irq) = setup(&mem);
        // The backend's answer to the frame (an ACK, say) is ready by the
        // time the tx buffers are returned.
        backend.wire().to_guest.push_back(frame(60, 3));
        rx.add(&[wo(BUF + 0x1000, 1526)]);
        mem.write_slice(&frame(HDR_LEN + 60, 0), GuestAddress(BUF))
            .expect("f");
        tx.add(&[ro(BUF, (HDR_LEN + 60) as u32)]);
        net.queue_notify(1);
        assert_eq!(tx.used().len(), 1);
        assert_eq!(rx.used(), vec![(0, (HDR_LEN + 60) as u32)]);
        // Two would cost the guest a second, empty interrupt per frame (an
        // exit to read the status, another to acknowledge it).
        assert_eq!(irq.read().expect("interrupt"), 1);
    }

    #[test]
    fn net_tx_bad_chains_are_dropped_and_returned() {
        let mem = memory(0x40_0000);
        let (mut net, backend, _rx, mut tx, _irq) = setup(&mem);
        tx.add(&[ro(BUF, 4)]);
        tx.add(&[ro(BUF, (HDR_LEN + MAX_FRAME + 1) as u32)]);
        tx.add(&[ro(u64::MAX - 8, 100)]);
        net.queue_notify(1);
        assert_eq!(tx.used().len(), 3);
        assert!(backend.wire().from_guest.is_empty());
        assert_eq!(net.counters().tx_dropped, 3);
        assert_eq!(backend.wire().flushes, 0);
    }

    #[test]
    fn net_rx_fills_buffers_and_waits_for_more() {
        let mem = memory(0x40_0000);
        let (mut net, backend, mut rx, _tx, irq) = setup(&mem);
        let frames: Vec<Vec<u8>> = (0..3).map(|i| frame(100 + i, i as u8)).collect();
        backend.wire().to_guest.extend(frames.iter().cloned());
        // Two buffers for three frames.
        rx.add(&[wo(BUF, 1526)]);
        rx.add(&[wo(BUF + 0x1000, 20), wo(BUF + 0x2000, 1506)]);
        net.handle_events();
        assert_eq!(backend.wire().events, 1);
        let used = rx.used();
        assert_eq!(used.len(), 2);
        assert_eq!(used[0].1 as usize, HDR_LEN + 100);
        let mut hdr = [0u8; HDR_LEN];
        mem.read_slice(&mut hdr, GuestAddress(BUF)).expect("hdr");
        assert_eq!(hdr, [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0]);
        let mut got = vec![0u8; 100];
        mem.read_slice(&mut got, GuestAddress(BUF + HDR_LEN as u64))
            .expect("f0");
        assert_eq!(got, frames[0]);
        // The second frame straddles two descriptors.
        let mut got = vec![0u8; 101];
        mem.read_slice(&mut got[..8], GuestAddress(BUF + 0x1000 + HDR_LEN as u64))
            .expect("f1");
        mem.read_slice(&mut got[8..], GuestAddress(BUF + 0x2000))
            .expect("f1");
        assert_eq!(got, frames[1]);
        assert_eq!(irq.read().expect("interrupt"), 1);
        // The third waits in the device until the guest posts a buffer.
        assert!(backend.wire().to_guest.is_empty());
        rx.add(&[wo(BUF + 0x3000, 1526)]);
        net.queue_notify(0);
        assert_eq!(rx.used(), vec![(3, (HDR_LEN + 102) as u32)]);
    }

    #[test]
    fn net_rx_and_tx_serve_one_budget_per_turn() {
        use crate::virtio::BUDGET_CHAINS;
        let mem = memory(0x40_0000);
        let (mut net, backend, mut rx, mut tx, _irq) = setup_sized(&mem, 256);
        let frames = BUDGET_CHAINS + 36;
        for i in 0..frames {
            backend.wire().to_guest.push_back(frame(60, i as u8));
            rx.add(&[wo(BUF + (i as u64) * 0x100, 0x100)]);
        }
        assert_eq!(net.handle_events(), Work::More);
        assert_eq!(rx.used().len(), BUDGET_CHAINS);
        assert_eq!(net.handle_events(), Work::Done);
        assert_eq!(rx.used().len(), 36);
        // The same on tx: a queue of frames is sent one budget per turn.
        for i in 0..frames {
            let at = BUF + 0x2_0000 + (i as u64) * 0x100;
            tx.add(&[ro(at, (HDR_LEN + 60) as u32)]);
        }
        assert_eq!(net.queue_notify(1), Work::More);
        assert_eq!(tx.used().len(), BUDGET_CHAINS);
        assert_eq!(net.queue_notify(1), Work::Done);
        assert_eq!(tx.used().len(), 36);
        assert_eq!(backend.wire().from_guest.len(), frames);
    }

    #[test]
    fn net_rx_small_buffer_drops_frame() {
        let mem = memory(0x40_0000);
        let (mut net, backend, mut rx, _tx, _irq) = setup(&mem);
        backend.wire().to_guest.push_back(frame(1000, 0));
        rx.add(&[wo(BUF, 100)]);
        net.queue_notify(0);
        assert_eq!(rx.used(), vec![(0, 0)]);
        assert_eq!(net.counters().rx_dropped, 1);
    }

    #[test]
    fn net_save_restore_keeps_ring_positions() {
        let mem = memory(0x40_0000);
        let (mut net, backend, mut rx, mut tx, _irq) = setup(&mem);
        mem.write_slice(&frame(HDR_LEN + 60, 0), GuestAddress(BUF))
            .expect("f");
        tx.add(&[ro(BUF, (HDR_LEN + 60) as u32)]);
        net.queue_notify(1);
        assert_eq!(tx.used().len(), 1);
        let state = net.save();
        let json = serde_json::to_string(&state).expect("serialise");
        let state: DeviceState = serde_json::from_str(&json).expect("parse");

        // A new device over the same memory, as in a fork child.
        let backend2 = TestBackend::default();
        let mut net2 = Net::new([0; 6], Box::new(backend2.clone()));
        let irq2 = Arc::new(EventFd::new(libc::EFD_NONBLOCK).expect("eventfd"));
        net2.restore(mem.clone(), Interrupt::new(irq2), &state)
            .expect("restore");
        let mut mac = [0u8; 6];
        net2.read_config(0, &mut mac);
        assert_eq!(mac, MAC);
        // A frame the guest queued after the capture is picked up at once.
        tx.add(&[ro(BUF, (HDR_LEN + 60) as u32)]);
        net2.queue_notify(1);
        assert_eq!(tx.used(), vec![(1, 0)]);
        assert_eq!(backend2.wire().from_guest.len(), 1);
        assert_eq!(backend.wire().from_guest.len(), 1);
        backend2.wire().to_guest.push_back(frame(64, 9));
        rx.add(&[wo(BUF + 0x1000, 1526)]);
        net2.queue_notify(0);
        assert_eq!(rx.used(), vec![(0, (HDR_LEN + 64) as u32)]);

        let block = DeviceState::Block(crate::virtio::persist::BlockState {
            acked_features: 0,
            queues: None,
        });
        let irq3 = Arc::new(EventFd::new(libc::EFD_NONBLOCK).expect("eventfd"));
        assert!(net2
            .restore(mem.clone(), Interrupt::new(irq3), &block)
            .is_err());
    }

    #[test]
    fn net_random_descriptors_do_not_panic() {
        let mem = memory(0x40_0000);
        let (mut net, backend, mut rx, mut tx, _irq) = setup(&mem);
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..2000 {
            for drv in [&mut rx, &mut tx] {
                for i in 0..16u16 {
                    let r = rnd();
                    let addr = if r & 1 == 0 { r % 0x40_0000 } else { r };
                    drv.write_desc(
                        i,
                        addr,
                        (rnd() % 0x1000) as u32,
                        (rnd() % 8) as u16,
                        (rnd() % 20) as u16,
                    );
                }
                drv.publish((rnd() % 16) as u16);
            }
            backend
                .wire()
                .to_guest
                .push_back(frame((rnd() % 1600) as usize, 0));
            net.queue_notify(1);
            net.queue_notify(0);
        }
    }
}
