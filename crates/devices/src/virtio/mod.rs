//! The virtio device model: the [`VirtioDevice`] trait every device
//! implements, what every device holds once the driver activated it
//! ([`Active`]), and the transport that exposes one to the guest.
//!
//! Shared here so that each device keeps only what is its own: reading
//! the configuration space is a default method over the device's bytes
//! ([`VirtioDevice::config_space`]); the queue count checks of activation
//! and restore, saving the queues and returning served chains to the used
//! ring are [`Active`]'s. `save` and `restore` stay required methods.
//!
//! Everything in a queue is written by the guest, which is hostile. What
//! holds for every device, here in [`Active`]:
//! - chains are walked by [`chain::Chain::walk`] (bounded by the queue
//!   size, indirect descriptors only when negotiated);
//! - a queue whose available index runs more than a queue ahead of the
//!   device, or that names a head descriptor outside the queue, cannot be
//!   served in any sensible way: the device needs a reset
//!   ([`Interrupt::set_needs_reset`]) and serves nothing until it gets one;
//! - one turn of the VMM's event loop serves at most [`BUDGET_CHAINS`]
//!   chains, or about [`BUDGET_BYTES`] bytes, of one queue; a device with
//!   work left says [`Work::More`] and the loop calls it again next turn,
//!   after the other devices, the control socket and the vCPU exits, so a
//!   guest that keeps a queue full (its vCPUs refill it while the device
//!   serves it) cannot keep the loop from the rest.
//! - `virtio-queue` is asked only for the next head index (through
//!   `QueueOwnedT::iter`, which reports instead of logging), so none of its
//!   own error lines can be raised by the guest.

use std::borrow::Cow;

use virtio_bindings::virtio_ring::VIRTIO_RING_F_INDIRECT_DESC;
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::GuestAddress;

pub mod block;
pub mod chain;
pub mod disk;
pub mod mmio;
pub mod net;
pub mod overlay;
pub mod persist;
#[cfg(test)]
pub(crate) mod testutil;
pub mod vsock;

use self::chain::{Chain, ChainError, DescTable};
use self::persist::{DeviceState, QueueState, RestoreError};
use crate::{EventSource, GuestMemory, Interrupt, Work};

/// Most chains one queue serves in one turn of the VMM's event loop.
pub const BUDGET_CHAINS: usize = 64;
/// Bytes of buffers after which a queue's turn ends (the chain that
/// crosses it is still served whole; each device bounds its chains).
pub const BUDGET_BYTES: u64 = 16 << 20;

/// What one queue may still do in this turn.
#[derive(Clone, Copy, Debug)]
pub struct Budget {
    chains: usize,
    bytes: u64,
}

impl Default for Budget {
    fn default() -> Self {
        Budget {
            chains: BUDGET_CHAINS,
            bytes: BUDGET_BYTES,
        }
    }
}

impl Budget {
    /// Counts one chain of `bytes` bytes of buffers.
    pub fn spend(&mut self, bytes: u64) {
        self.chains = self.chains.saturating_sub(1);
        self.bytes = self.bytes.saturating_sub(bytes);
    }

    /// Counts a parsed chain (a broken one costs a chain and no bytes).
    pub fn spend_chain(&mut self, chain: &Result<Chain, ChainError>) {
        let bytes = chain
            .as_ref()
            .map_or(0, |c| c.readable.len().saturating_add(c.writable.len()));
        self.spend(bytes);
    }

    /// Nothing is left for this turn.
    pub fn exhausted(&self) -> bool {
        self.chains == 0 || self.bytes == 0
    }
}

/// Why a queue cannot be served at all (the device then needs a reset).
#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    #[error("queue {index}: the available ring cannot be read")]
    Avail {
        index: usize,
        #[source]
        source: virtio_queue::Error,
    },
    #[error("queue {index}: head descriptor {head} is outside the queue of {size}")]
    Head { index: usize, head: u16, size: u16 },
}

/// Why a device could not be activated by the driver.
#[derive(Debug, thiserror::Error)]
pub enum ActivateError {
    #[error("queue {0} is not valid")]
    BadQueue(usize),
    #[error("driver set up {got} queues, device needs {want}")]
    QueueCount { got: usize, want: usize },
    #[error("device backend failed")]
    Backend(#[source] std::io::Error),
}

/// One virtio device behind a transport. The transport owns the common
/// registers (features, queue setup, status); the device owns its
/// configuration space and what happens when the driver kicks a queue.
pub trait VirtioDevice: EventSource {
    /// Virtio device ID (1 = net, 2 = block, 19 = vsock).
    fn device_type(&self) -> u32;
    /// Maximum size of each queue; its length is the number of queues.
    fn queue_max_sizes(&self) -> &[u16];
    /// Feature bits the device offers (VIRTIO_F_VERSION_1 included).
    fn features(&self) -> u64;
    /// The features the driver accepted, before activation.
    fn ack_features(&mut self, features: u64);
    /// The device-specific configuration space (what the driver reads at
    /// window+0x100); bytes past its end read as zero.
    fn config_space(&self) -> Cow<'_, [u8]>;

    /// Reads `data.len()` bytes of the configuration space at `offset`.
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let config = self.config_space();
        for (i, b) in data.iter_mut().enumerate() {
            *b = usize::try_from(offset)
                .ok()
                .and_then(|o| o.checked_add(i))
                .and_then(|o| config.get(o))
                .copied()
                .unwrap_or(0);
        }
    }

    /// The driver wrote the configuration space. No field of our devices'
    /// is writable (the MAC, capacity and CID are the host's), so the
    /// write is ignored; a device with a writable field overrides this.
    fn write_config(&mut self, offset: u64, _data: &[u8]) {
        tracing::debug!(
            device = self.device_type(),
            offset,
            "virtio: ignoring config write"
        );
    }

    /// The driver set DRIVER_OK: the queues are ready to use.
    fn activate(
        &mut self,
        mem: GuestMemory,
        queues: Vec<Queue>,
        interrupt: Interrupt,
    ) -> Result<(), ActivateError>;
    /// The driver notified queue `index` (a QueueNotify write). Serves it
    /// within the budget of one turn ([`BUDGET_CHAINS`]); [`Work::More`]
    /// asks to be called again next turn.
    fn queue_notify(&mut self, index: u16) -> Work;
    /// The driver wrote 0 to Status: drop the queues and all in-flight work.
    fn reset(&mut self);
    /// Everything needed to rebuild this device in another process
    /// (required: a device that forgets state must not compile).
    fn save(&self) -> DeviceState;
    /// Applies `state` to a freshly created device; when it was active,
    /// rebuilds its queues at the saved positions and activates it with
    /// `mem` and `interrupt`.
    fn restore(
        &mut self,
        mem: GuestMemory,
        interrupt: Interrupt,
        state: &DeviceState,
    ) -> Result<(), RestoreError>;
}

/// What a device holds while the driver has it activated: guest memory,
/// its `N` queues in the transport's order, its interrupt line, and
/// whether the driver accepted indirect descriptors.
pub struct Active<const N: usize> {
    pub mem: GuestMemory,
    pub queues: [Queue; N],
    pub interrupt: Interrupt,
    indirect: bool,
}

impl<const N: usize> Active<N> {
    /// The queues the transport built at DRIVER_OK, which must be `N`;
    /// `features` are the ones the driver accepted.
    pub fn new(
        mem: GuestMemory,
        queues: Vec<Queue>,
        interrupt: Interrupt,
        features: u64,
    ) -> Result<Self, ActivateError> {
        let got = queues.len();
        let queues = <[Queue; N]>::try_from(queues)
            .map_err(|_| ActivateError::QueueCount { got, want: N })?;
        Ok(Self {
            mem,
            queues,
            interrupt,
            indirect: features & (1 << VIRTIO_RING_F_INDIRECT_DESC) != 0,
        })
    }

    /// The queues at their saved positions; `None` if the device was not
    /// active when it was saved.
    pub fn restore(
        mem: GuestMemory,
        interrupt: Interrupt,
        saved: Option<&[QueueState]>,
        features: u64,
    ) -> Result<Option<Self>, RestoreError> {
        let Some(saved) = saved else {
            return Ok(None);
        };
        let queues = persist::restore_queues(saved, N)?;
        let got = queues.len();
        let queues = <[Queue; N]>::try_from(queues)
            .map_err(|_| RestoreError::QueueCount { got, want: N })?;
        Ok(Some(Self {
            mem,
            queues,
            interrupt,
            indirect: features & (1 << VIRTIO_RING_F_INDIRECT_DESC) != 0,
        }))
    }

    /// The queues' positions, for the device's saved state.
    pub fn save(&self) -> Vec<QueueState> {
        persist::save_queues(&self.queues)
    }

    /// The next chain the driver made available on queue `index`, with its
    /// head index, walked (or why it could not be). `None` when the queue
    /// is empty, does not exist, or the device needs a reset; a queue the
    /// guest broke sets that ([`QueueError`]).
    pub fn pop(&mut self, index: usize) -> Option<(u16, Result<Chain, ChainError>)> {
        if self.interrupt.needs_reset() {
            return None;
        }
        let queue = self.queues.get_mut(index)?;
        let table = DescTable {
            addr: GuestAddress(queue.desc_table()),
            size: queue.size(),
            indirect: self.indirect,
        };
        let next = match queue.iter(&self.mem) {
            Ok(mut avail) => avail.next().map(|c| c.head_index()),
            Err(source) => {
                self.broken(&QueueError::Avail { index, source });
                return None;
            }
        };
        let head = next?;
        if head >= table.size {
            self.broken(&QueueError::Head {
                index,
                head,
                size: table.size,
            });
            return None;
        }
        Some((head, Chain::walk(&self.mem, table, head)))
    }

    /// Puts the last popped chain back: it is popped again next time.
    pub fn unpop(&mut self, index: usize) {
        if let Some(q) = self.queues.get_mut(index) {
            q.go_to_previous_position();
        }
    }

    /// Returns chain `head` of queue `index` to the driver, `len` bytes
    /// written into it.
    pub fn add_used(&mut self, index: usize, head: u16, len: u32) {
        let Some(q) = self.queues.get_mut(index) else {
            return;
        };
        // `head` came from `pop`, which checked it against the queue size,
        // and the used ring was checked at activation: this cannot fail
        // unless guest memory went away.
        if let Err(e) = q.add_used(&self.mem, head, len) {
            tracing::warn!(index, "virtio: cannot return a used buffer: {e}");
        }
    }

    fn broken(&self, e: &QueueError) {
        self.interrupt.guest_error("virtio", e);
        self.interrupt.set_needs_reset();
    }

    /// Serves the chains the driver has made available on queue `index`,
    /// within one turn's [`Budget`]: `serve` gets each chain walked (or why
    /// it could not be) and returns how many bytes it wrote into it; the
    /// chain then goes back to the used ring. Says whether any chain was
    /// used (an interrupt is owed) and whether work is left.
    pub fn serve(
        &mut self,
        index: usize,
        mut serve: impl FnMut(&GuestMemory, Result<Chain, ChainError>) -> u32,
    ) -> (bool, Work) {
        let mut budget = Budget::default();
        let mut used = false;
        loop {
            if budget.exhausted() {
                return (used, Work::More);
            }
            let Some((head, chain)) = self.pop(index) else {
                return (used, Work::Done);
            };
            budget.spend_chain(&chain);
            let len = serve(&self.mem, chain);
            self.add_used(index, head, len);
            used = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use vmm_sys_util::eventfd::EventFd;

    use vm_memory::{Bytes, GuestAddress};

    use super::*;
    use crate::virtio::block::Block;
    use crate::virtio::testutil::{memory, ro, wo, Driver};

    fn interrupt() -> Interrupt {
        Interrupt::new(Arc::new(EventFd::new(libc::EFD_NONBLOCK).expect("eventfd")))
    }

    /// A one-sector disk file, removed on drop.
    struct Disk(std::path::PathBuf);

    impl Disk {
        fn new(name: &str) -> Disk {
            let path = std::env::temp_dir().join(format!(
                "forkbox-devices-active-{}-{name}",
                std::process::id()
            ));
            std::fs::write(&path, [7u8; 512]).expect("test disk");
            Disk(path)
        }
    }

    impl Drop for Disk {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    const FLUSH_HDR: u64 = 0x30_0000;
    const STATUS: u64 = 0x30_1000;

    /// A block device on a queue at `base`, and a FLUSH request header
    /// written at FLUSH_HDR.
    fn block<'a>(
        mem: &'a GuestMemory,
        disk: &Disk,
        base: u64,
        size: u16,
    ) -> (Block, Driver<'a>, Interrupt) {
        let mut blk = Block::new(&disk.0).expect("open disk");
        let drv = Driver::new(mem, base, size);
        let irq = interrupt();
        let mut hdr = [0u8; 16];
        hdr[0..4].copy_from_slice(&virtio_bindings::virtio_blk::VIRTIO_BLK_T_FLUSH.to_le_bytes());
        mem.write_slice(&hdr, GuestAddress(FLUSH_HDR))
            .expect("header");
        blk.activate(mem.clone(), vec![drv.queue()], irq.clone())
            .expect("activate");
        (blk, drv, irq)
    }

    #[test]
    fn head_outside_the_queue_needs_reset_and_stops_the_queue() {
        let mem = memory(0x40_0000);
        let disk = Disk::new("head");
        let (mut blk, mut drv, irq) = block(&mem, &disk, 0, 16);
        drv.publish(16);
        drv.add(&[ro(FLUSH_HDR, 16), wo(STATUS, 1)]);
        assert_eq!(blk.queue_notify(0), Work::Done);
        assert!(irq.needs_reset());
        assert_ne!(irq.status() & crate::VIRTIO_MMIO_INT_CONFIG, 0);
        assert_eq!(irq.guest_errors(), 1);
        // Nothing is served until the driver resets the device.
        assert_eq!(drv.used_idx(), 0);
        assert_eq!(blk.queue_notify(0), Work::Done);
        assert_eq!(drv.used_idx(), 0);
    }

    #[test]
    fn avail_index_running_ahead_needs_reset() {
        let mem = memory(0x40_0000);
        let disk = Disk::new("avail");
        let (mut blk, mut drv, irq) = block(&mem, &disk, 0, 16);
        drv.set_avail_idx(17);
        assert_eq!(blk.queue_notify(0), Work::Done);
        assert!(irq.needs_reset());
        assert_eq!(drv.used_idx(), 0);
    }

    #[test]
    fn broken_chains_are_returned_and_counted_without_stopping_the_queue() {
        let mem = memory(0x40_0000);
        let disk = Disk::new("broken");
        let (mut blk, mut drv, irq) = block(&mem, &disk, 0, 16);
        // Indirect, not negotiated (no device offers it).
        drv.write_desc(0, 0x20_0000, 32, 4, 0);
        drv.publish(0);
        // Then a good request.
        drv.write_desc(1, FLUSH_HDR, 16, 1, 2);
        drv.write_desc(2, STATUS, 1, 2, 0);
        drv.publish(1);
        assert_eq!(blk.queue_notify(0), Work::Done);
        assert_eq!(drv.used(), vec![(0, 0), (1, 1)]);
        assert!(!irq.needs_reset());
        assert_eq!(irq.guest_errors(), 1);
        assert_eq!(mem.read_obj::<u8>(GuestAddress(STATUS)).expect("status"), 0);
    }

    /// The test keeps device A's queue full, turn after turn, as a guest
    /// whose vCPUs refill it would; device B gets one request per turn.
    /// Each turn serves at most one budget of A, and B's request is served
    /// in the turn it was made.
    #[test]
    fn full_queue_is_served_one_budget_per_turn_and_another_device_still_runs() {
        let mem = memory(0x80_0000);
        let disk = Disk::new("full");
        let (mut busy, mut a, _) = block(&mem, &disk, 0, 256);
        let (mut other, mut b, _) = block(&mem, &disk, 0x40_0000, 16);
        a.write_desc(0, FLUSH_HDR, 16, 1, 1);
        a.write_desc(1, STATUS, 1, 2, 0);
        let mut outstanding = 0usize;
        let mut served = 0usize;
        for turn in 0..50 {
            // Refill A to the brim.
            while outstanding < 256 {
                a.publish(0);
                outstanding += 1;
            }
            // One request on B.
            b.add(&[ro(FLUSH_HDR, 16), wo(STATUS + 0x10, 1)]);
            // The turn: A's kick, then B's.
            let before = a.used_idx();
            assert_eq!(busy.queue_notify(0), Work::More, "turn {turn}");
            let n = usize::from(a.used_idx().wrapping_sub(before));
            assert_eq!(n, BUDGET_CHAINS, "turn {turn}");
            a.used();
            outstanding -= n;
            served += n;
            assert_eq!(other.queue_notify(0), Work::Done);
            assert_eq!(b.used().len(), 1, "B served in turn {turn}");
        }
        assert_eq!(served, 50 * BUDGET_CHAINS);
    }

    /// Without a budget this would never return: a thread playing the
    /// guest's vCPU refills the queue while the device serves it.
    #[test]
    fn queue_refilled_concurrently_still_returns_within_budget() {
        let mem: &'static GuestMemory = Box::leak(Box::new(memory(0x80_0000)));
        let disk = Disk::new("race");
        let (mut dev, drv, _) = block(mem, &disk, 0, 256);
        drv.write_desc(0, FLUSH_HDR, 16, 1, 1);
        drv.write_desc(1, STATUS, 1, 2, 0);
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let guest = {
            let stop = Arc::clone(&stop);
            let mut drv = drv;
            std::thread::spawn(move || {
                let mut published: u16 = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    // Stay within one queue of what the device consumed.
                    if published.wrapping_sub(drv.used_idx()) < 256 {
                        drv.publish(0);
                        published = published.wrapping_add(1);
                    }
                }
                drv
            })
        };
        // Wait for the guest to fill the queue once, so the first turn
        // surely finds more than a budget.
        let avail_idx = |mem: &GuestMemory| -> u16 {
            mem.read_obj(GuestAddress(16 * 256 + 2)).expect("avail idx")
        };
        while avail_idx(mem).wrapping_sub(guest_used_idx(mem)) < 256 {
            std::thread::yield_now();
        }
        let mut more = 0;
        for _ in 0..200 {
            let before = guest_used_idx(mem);
            if dev.queue_notify(0) == Work::More {
                more += 1;
            }
            let n = guest_used_idx(mem).wrapping_sub(before);
            assert!(usize::from(n) <= BUDGET_CHAINS, "{n} chains in one turn");
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        guest.join().expect("guest thread");
        assert!(more > 0, "the guest never kept the queue busy");
    }

    /// The used index of a 256-entry queue at 0 (as `Driver` lays it out).
    fn guest_used_idx(mem: &GuestMemory) -> u16 {
        let avail = 16 * 256u64;
        let used = (avail + 6 + 2 * 256 + 3) & !3;
        mem.read_obj(GuestAddress(used + 2)).expect("used idx")
    }

    #[test]
    fn active_new_with_wrong_queue_count_fails() {
        let mem = memory(0x10_0000);
        let drv = Driver::new(&mem, 0, 16);
        let err = Active::<2>::new(mem.clone(), vec![drv.queue()], interrupt(), 0)
            .err()
            .expect("one queue for two");
        assert!(matches!(err, ActivateError::QueueCount { got: 1, want: 2 }));
    }

    #[test]
    fn active_save_restore_round_trips_queue_positions() {
        let mem = memory(0x10_0000);
        let drv = Driver::new(&mem, 0, 16);
        let active =
            Active::<1>::new(mem.clone(), vec![drv.queue()], interrupt(), 0).expect("activate");
        let saved = active.save();
        let back = Active::<1>::restore(mem.clone(), interrupt(), Some(&saved), 0)
            .expect("restore")
            .expect("was active");
        assert_eq!(back.save(), saved);
        assert!(Active::<1>::restore(mem.clone(), interrupt(), None, 0)
            .expect("restore")
            .is_none());
        assert!(matches!(
            Active::<2>::restore(mem, interrupt(), Some(&saved), 0),
            Err(RestoreError::QueueCount { got: 1, want: 2 })
        ));
    }
}
