//! A minimal split-virtqueue driver for tests: plays the guest side of a
//! queue in a `GuestMemoryMmap`, with ring indices that wrap.
//!
//! It lays the rings out itself: `virtio_queue::mock::MockSplitQueue`
//! (0.18) places the used ring `len` *bytes* after the avail ring's start,
//! so for large queues the avail ring overwrites the used index.

use virtio_queue::{Queue, QueueT};
use vm_memory::{Address, Bytes, GuestAddress};

use crate::GuestMemory;

pub const VRING_DESC_F_NEXT: u16 = 1;
pub const VRING_DESC_F_WRITE: u16 = 2;

pub fn memory(size: usize) -> GuestMemory {
    GuestMemory::from_ranges(&[(GuestAddress(0), size)]).expect("test guest memory")
}

/// One buffer of a chain: guest address, length, device-writable.
#[derive(Clone, Copy, Debug)]
pub struct Buf {
    pub addr: u64,
    pub len: u32,
    pub write: bool,
}

pub fn ro(addr: u64, len: u32) -> Buf {
    Buf {
        addr,
        len,
        write: false,
    }
}

pub fn wo(addr: u64, len: u32) -> Buf {
    Buf {
        addr,
        len,
        write: true,
    }
}

/// Guest-physical addresses of one split queue's three parts.
struct Layout {
    desc: GuestAddress,
    avail: GuestAddress,
    used: GuestAddress,
}

pub struct Driver<'a> {
    mem: &'a GuestMemory,
    layout: Layout,
    size: u16,
    next_desc: u16,
    avail_idx: u16,
    used_seen: u16,
}

impl<'a> Driver<'a> {
    pub fn new(mem: &'a GuestMemory, base: u64, size: u16) -> Self {
        let n = u64::from(size);
        let avail = base + 16 * n;
        let used = (avail + 6 + 2 * n + 3) & !3;
        let layout = Layout {
            desc: GuestAddress(base),
            avail: GuestAddress(avail),
            used: GuestAddress(used),
        };
        for at in [avail, used] {
            mem.write_obj(0u32, GuestAddress(at)).expect("ring init");
        }
        Self {
            mem,
            layout,
            size,
            next_desc: 0,
            avail_idx: 0,
            used_seen: 0,
        }
    }

    /// A device-side queue over the same rings, ready to activate.
    pub fn queue(&self) -> Queue {
        let mut q = Queue::new(self.size).expect("queue size");
        q.try_set_desc_table_address(self.layout.desc)
            .expect("desc");
        q.try_set_avail_ring_address(self.layout.avail)
            .expect("avail");
        q.try_set_used_ring_address(self.layout.used).expect("used");
        q.set_ready(true);
        q
    }

    /// Writes a raw descriptor into table slot `index`.
    pub fn write_desc(&self, index: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let at = self.layout.desc.unchecked_add(u64::from(index) * 16);
        let mut raw = [0u8; 16];
        raw[0..8].copy_from_slice(&addr.to_le_bytes());
        raw[8..12].copy_from_slice(&len.to_le_bytes());
        raw[12..14].copy_from_slice(&flags.to_le_bytes());
        raw[14..16].copy_from_slice(&next.to_le_bytes());
        self.mem.write_slice(&raw, at).expect("descriptor write");
    }

    /// Makes descriptor `head` available to the device.
    pub fn publish(&mut self, head: u16) {
        let slot = u64::from(self.avail_idx % self.size);
        let ring = self.layout.avail.unchecked_add(4 + slot * 2);
        self.mem.write_obj(head.to_le(), ring).expect("avail write");
        self.avail_idx = self.avail_idx.wrapping_add(1);
        self.mem
            .write_obj(self.avail_idx.to_le(), self.layout.avail.unchecked_add(2))
            .expect("avail idx write");
    }

    /// Adds a chain and publishes it; returns its head index.
    pub fn add(&mut self, bufs: &[Buf]) -> u16 {
        let head = self.next_desc;
        for (i, b) in bufs.iter().enumerate() {
            let index = self.next_desc;
            self.next_desc = (self.next_desc + 1) % self.size;
            let mut flags = if b.write { VRING_DESC_F_WRITE } else { 0 };
            if i + 1 < bufs.len() {
                flags |= VRING_DESC_F_NEXT;
            }
            self.write_desc(index, b.addr, b.len, flags, self.next_desc);
        }
        self.publish(head);
        head
    }

    /// The used ring's index as the device last wrote it.
    pub fn used_idx(&self) -> u16 {
        self.mem
            .read_obj(self.layout.used.unchecked_add(2))
            .expect("used idx read")
    }

    /// Sets the available index without writing ring entries (a driver
    /// claiming more chains than it made).
    pub fn set_avail_idx(&mut self, idx: u16) {
        self.avail_idx = idx;
        self.mem
            .write_obj(idx.to_le(), self.layout.avail.unchecked_add(2))
            .expect("avail idx write");
    }

    /// Used-ring entries (head, len) the device added since the last call.
    pub fn used(&mut self) -> Vec<(u32, u32)> {
        let used = self.layout.used;
        let idx: u16 = self
            .mem
            .read_obj(used.unchecked_add(2))
            .expect("used idx read");
        let mut out = Vec::new();
        while self.used_seen != idx {
            let slot = u64::from(self.used_seen % self.size);
            let at = used.unchecked_add(4 + slot * 8);
            let id: u32 = self.mem.read_obj(at).expect("used id");
            let len: u32 = self.mem.read_obj(at.unchecked_add(4)).expect("used len");
            out.push((id, len));
            self.used_seen = self.used_seen.wrapping_add(1);
        }
        out
    }
}
