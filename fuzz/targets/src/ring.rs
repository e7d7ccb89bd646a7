//! A split virtqueue's layout in guest memory, played from the guest's
//! side: the harness puts chains in it, the device under test serves them.

use std::sync::Arc;

use forkbox_devices::{GuestMemory, Interrupt};
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::EventFd;

/// `VIRTQ_DESC_F_NEXT`, `VIRTQ_DESC_F_WRITE`.
pub const F_NEXT: u16 = 1;
pub const F_WRITE: u16 = 2;

/// Guest memory of `size` bytes from address 0.
pub fn memory(size: usize) -> GuestMemory {
    GuestMemory::from_ranges(&[(GuestAddress(0), size)]).expect("fuzz guest memory")
}

/// An interrupt line whose eventfd nobody reads.
pub fn interrupt() -> Interrupt {
    Interrupt::new(Arc::new(
        EventFd::new(libc::EFD_NONBLOCK).expect("eventfd for a fuzz interrupt"),
    ))
}

#[derive(Clone, Copy)]
pub struct Ring {
    pub desc: u64,
    pub avail: u64,
    pub used: u64,
    pub size: u16,
}

impl Ring {
    /// The descriptor table at `desc`, the rings right after it.
    pub fn at(desc: u64, size: u16) -> Ring {
        let n = u64::from(size);
        let avail = desc + 16 * n;
        let used = (avail + 6 + 2 * n + 3) & !3;
        Ring {
            desc,
            avail,
            used,
            size,
        }
    }

    /// The device's side of the queue.
    pub fn queue(&self) -> Queue {
        let mut q = Queue::new(self.size).expect("power-of-two queue size");
        q.try_set_desc_table_address(GuestAddress(self.desc))
            .expect("descriptor table address");
        q.try_set_avail_ring_address(GuestAddress(self.avail))
            .expect("avail ring address");
        q.try_set_used_ring_address(GuestAddress(self.used))
            .expect("used ring address");
        q.set_ready(true);
        q
    }

    pub fn write_desc(
        &self,
        mem: &GuestMemory,
        index: u16,
        addr: u64,
        len: u32,
        flags: u16,
        next: u16,
    ) {
        let mut raw = [0u8; 16];
        raw[0..8].copy_from_slice(&addr.to_le_bytes());
        raw[8..12].copy_from_slice(&len.to_le_bytes());
        raw[12..14].copy_from_slice(&flags.to_le_bytes());
        raw[14..16].copy_from_slice(&next.to_le_bytes());
        let at = self.desc + u64::from(index % self.size) * 16;
        mem.write_slice(&raw, GuestAddress(at))
            .expect("descriptor inside guest memory");
    }

    pub fn avail_idx(&self, mem: &GuestMemory) -> u16 {
        mem.read_obj(GuestAddress(self.avail + 2))
            .expect("avail index inside guest memory")
    }

    pub fn set_avail_idx(&self, mem: &GuestMemory, idx: u16) {
        mem.write_obj(idx, GuestAddress(self.avail + 2))
            .expect("avail index inside guest memory");
    }

    /// Puts `head` in the next avail slot and publishes it.
    pub fn publish(&self, mem: &GuestMemory, head: u16) {
        let idx = self.avail_idx(mem);
        let slot = self.avail + 4 + u64::from(idx % self.size) * 2;
        mem.write_obj(head, GuestAddress(slot))
            .expect("avail slot inside guest memory");
        self.set_avail_idx(mem, idx.wrapping_add(1));
    }

    pub fn used_idx(&self, mem: &GuestMemory) -> u16 {
        mem.read_obj(GuestAddress(self.used + 2))
            .expect("used index inside guest memory")
    }

    /// The used-ring entry `i` (modulo the size): (head, length).
    pub fn used_elem(&self, mem: &GuestMemory, i: u16) -> (u32, u32) {
        let at = self.used + 4 + u64::from(i % self.size) * 8;
        let id = mem.read_obj(GuestAddress(at)).expect("used id");
        let len = mem.read_obj(GuestAddress(at + 4)).expect("used len");
        (id, len)
    }
}
