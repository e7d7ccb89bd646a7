//! Descriptor chains as lists of guest-memory regions.
//!
//! A chain is walked here, from the descriptor table the driver set up, and
//! flattened once into its device-readable and device-writable parts;
//! devices then read and write at byte offsets into those parts without
//! caring where descriptors begin and end.
//!
//! The walk is ours rather than `virtio-queue`'s `DescriptorChain`
//! iterator, because that iterator (0.18) follows indirect tables whether
//! or not `VIRTIO_RING_F_INDIRECT_DESC` was negotiated, bounds a chain
//! inside an indirect table by the table's length (up to 65535 entries)
//! instead of the queue size, and ends a chain silently where it finds a
//! bad descriptor, so a broken chain looks like a shorter good one. Here
//! every descriptor the guest wrote is checked and a broken chain is an
//! error:
//! - at most `queue size` descriptors per chain, indirect ones included
//!   (virtio 1.x §2.7.5.3.1), so a loop of `next` indices ends;
//! - a `next` index inside the table it indexes;
//! - `VIRTQ_DESC_F_INDIRECT` only when the feature was negotiated, never
//!   together with `VIRTQ_DESC_F_NEXT`, never inside an indirect table, and
//!   a table whose length is a non-zero multiple of 16 that lies in guest
//!   memory;
//! - every buffer inside guest memory, readable buffers before writable
//!   ones, and at most 4 GiB in all (§2.7.5.2).
//!
//! Lengths are summed in `u64`, so nothing here overflows.

use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryBackend};

use crate::GuestMemory;

/// `VIRTQ_DESC_F_NEXT`: the chain goes on at `next`.
const DESC_F_NEXT: u16 = 1;
/// `VIRTQ_DESC_F_WRITE`: the buffer is device-writable.
const DESC_F_WRITE: u16 = 2;
/// `VIRTQ_DESC_F_INDIRECT`: the buffer is a table of descriptors.
const DESC_F_INDIRECT: u16 = 4;
/// Size of one split-ring descriptor.
const DESC_LEN: u64 = 16;
/// Most bytes one chain may describe (virtio 1.x §2.7.5.2).
pub const MAX_CHAIN_BYTES: u64 = 1 << 32;

/// Why a descriptor chain cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ChainError {
    #[error("device-readable descriptor after a device-writable one")]
    ReadableAfterWritable,
    #[error("descriptor at {addr:#x} (+{len:#x}) is outside guest memory")]
    OutOfMemory { addr: u64, len: u32 },
    #[error("guest memory access failed")]
    Memory(#[source] vm_memory::GuestMemoryError),
    #[error("descriptor index {index} is outside a table of {size}")]
    BadIndex { index: u16, size: u16 },
    #[error("chain is longer than the queue size {max} (or loops)")]
    TooLong { max: u16 },
    #[error("chain describes more than 4 GiB")]
    TooManyBytes,
    #[error("indirect descriptor, but VIRTIO_RING_F_INDIRECT_DESC was not negotiated")]
    IndirectNotNegotiated,
    #[error("indirect descriptor inside an indirect table")]
    NestedIndirect,
    #[error("indirect descriptor with the NEXT flag")]
    IndirectWithNext,
    #[error("indirect table at {addr:#x} of {len} bytes is not a whole number of descriptors in guest memory")]
    BadIndirectTable { addr: u64, len: u32 },
}

/// Where a queue's descriptors are: what [`Chain::walk`] needs besides
/// the head index.
#[derive(Clone, Copy, Debug)]
pub struct DescTable {
    /// Guest-physical address of the descriptor table.
    pub addr: GuestAddress,
    /// The queue size: entries in the table and most descriptors per chain.
    pub size: u16,
    /// `VIRTIO_RING_F_INDIRECT_DESC` was negotiated.
    pub indirect: bool,
}

/// One contiguous buffer in guest memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    pub addr: GuestAddress,
    pub len: u32,
}

/// A list of regions read or written as one byte stream.
#[derive(Clone, Debug, Default)]
pub struct Regions {
    regions: Vec<Region>,
    len: u64,
}

impl Regions {
    /// Total length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Number of (non-empty) regions.
    pub fn count(&self) -> usize {
        self.regions.len()
    }

    /// The regions, in order.
    pub fn iter(&self) -> impl Iterator<Item = &Region> + '_ {
        self.regions.iter()
    }

    fn push(&mut self, r: Region) {
        if r.len > 0 {
            self.len += u64::from(r.len);
            self.regions.push(r);
        }
    }

    /// The pieces covering `[offset, offset + len)`, clipped to the end.
    pub fn pieces(&self, offset: u64, len: u64) -> impl Iterator<Item = Region> + '_ {
        let mut skip = offset;
        let mut left = len;
        self.regions.iter().filter_map(move |r| {
            let rlen = u64::from(r.len);
            if skip >= rlen {
                skip -= rlen;
                return None;
            }
            if left == 0 {
                return None;
            }
            let take = (rlen - skip).min(left);
            let piece = Region {
                addr: r.addr.unchecked_add(skip),
                // `take` <= `r.len`, a u32.
                len: u32::try_from(take).unwrap_or(r.len),
            };
            skip = 0;
            left -= take;
            Some(piece)
        })
    }

    /// Copies bytes at `offset` into `buf`; returns how many were copied
    /// (fewer than `buf.len()` at the end of the regions).
    pub fn read_at(
        &self,
        mem: &GuestMemory,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<usize, ChainError> {
        let mut done = 0usize;
        for p in self.pieces(offset, buf.len() as u64) {
            let n = p.len as usize;
            mem.read_slice(&mut buf[done..done + n], p.addr)
                .map_err(ChainError::Memory)?;
            done += n;
        }
        Ok(done)
    }

    /// Copies `buf` to `offset`; returns how many bytes were copied.
    pub fn write_at(
        &self,
        mem: &GuestMemory,
        offset: u64,
        buf: &[u8],
    ) -> Result<usize, ChainError> {
        let mut done = 0usize;
        for p in self.pieces(offset, buf.len() as u64) {
            let n = p.len as usize;
            mem.write_slice(&buf[done..done + n], p.addr)
                .map_err(ChainError::Memory)?;
            done += n;
        }
        Ok(done)
    }
}

/// A popped descriptor chain, flattened.
#[derive(Clone, Debug)]
pub struct Chain {
    pub head: u16,
    pub readable: Regions,
    pub writable: Regions,
}

/// One raw split-ring descriptor.
struct RawDesc {
    addr: u64,
    len: u32,
    flags: u16,
    next: u16,
}

fn read_desc(mem: &GuestMemory, table: GuestAddress, index: u16) -> Result<RawDesc, ChainError> {
    let at = table
        .checked_add(u64::from(index) * DESC_LEN)
        .ok_or(ChainError::OutOfMemory {
            addr: table.raw_value(),
            len: u32::from(index) * DESC_LEN as u32,
        })?;
    let mut raw = [0u8; DESC_LEN as usize];
    mem.read_slice(&mut raw, at).map_err(ChainError::Memory)?;
    let mut addr = [0u8; 8];
    addr.copy_from_slice(&raw[0..8]);
    Ok(RawDesc {
        addr: u64::from_le_bytes(addr),
        len: u32::from_le_bytes([raw[8], raw[9], raw[10], raw[11]]),
        flags: u16::from_le_bytes([raw[12], raw[13]]),
        next: u16::from_le_bytes([raw[14], raw[15]]),
    })
}

impl Chain {
    /// Walks the chain that starts at descriptor `head` of `table` and
    /// flattens it, checking every descriptor (see the module text).
    pub fn walk(mem: &GuestMemory, table: DescTable, head: u16) -> Result<Chain, ChainError> {
        let mut out = Chain {
            head,
            readable: Regions::default(),
            writable: Regions::default(),
        };
        // The table being walked: the queue's, or one indirect table.
        let mut at = table.addr;
        let mut entries = table.size;
        let mut in_indirect = false;
        let mut index = head;
        let mut count: u32 = 0;
        loop {
            if index >= entries {
                return Err(ChainError::BadIndex {
                    index,
                    size: entries,
                });
            }
            count += 1;
            if count > u32::from(table.size) {
                return Err(ChainError::TooLong { max: table.size });
            }
            let d = read_desc(mem, at, index)?;
            if d.flags & DESC_F_INDIRECT != 0 {
                if !table.indirect {
                    return Err(ChainError::IndirectNotNegotiated);
                }
                if in_indirect {
                    return Err(ChainError::NestedIndirect);
                }
                if d.flags & DESC_F_NEXT != 0 {
                    return Err(ChainError::IndirectWithNext);
                }
                let bad = ChainError::BadIndirectTable {
                    addr: d.addr,
                    len: d.len,
                };
                let n = u64::from(d.len) / DESC_LEN;
                if d.len == 0
                    || u64::from(d.len) % DESC_LEN != 0
                    || !mem.check_range(GuestAddress(d.addr), d.len as usize)
                {
                    return Err(bad);
                }
                // Longer than the queue: refused by the count above at the
                // latest; a table of more than 65535 entries cannot be
                // indexed at all.
                entries = u16::try_from(n).map_err(|_| bad)?;
                at = GuestAddress(d.addr);
                in_indirect = true;
                index = 0;
                // The indirect descriptor itself carries no buffer.
                count -= 1;
                continue;
            }
            let r = Region {
                addr: GuestAddress(d.addr),
                len: d.len,
            };
            if !mem.check_range(r.addr, r.len as usize) {
                return Err(ChainError::OutOfMemory {
                    addr: d.addr,
                    len: d.len,
                });
            }
            if d.flags & DESC_F_WRITE != 0 {
                out.writable.push(r);
            } else if out.writable.is_empty() {
                out.readable.push(r);
            } else {
                return Err(ChainError::ReadableAfterWritable);
            }
            if out.readable.len() + out.writable.len() > MAX_CHAIN_BYTES {
                return Err(ChainError::TooManyBytes);
            }
            if d.flags & DESC_F_NEXT == 0 {
                return Ok(out);
            }
            index = d.next;
        }
    }
}

#[cfg(test)]
mod tests {
    use vm_memory::Bytes;

    use super::*;
    use crate::virtio::testutil::{memory, Driver};

    const TABLE: u64 = 0x8000;
    const BUF: u64 = 0x2_0000;

    fn table(size: u16, indirect: bool) -> DescTable {
        DescTable {
            addr: GuestAddress(0),
            size,
            indirect,
        }
    }

    /// Writes an indirect table of `n` descriptors at `at`, each 16 bytes
    /// device-readable, chained 0 -> 1 -> ... -> n-1.
    fn indirect_table(mem: &GuestMemory, at: u64, n: u16, flags_of_first: u16) {
        for i in 0..n {
            let mut raw = [0u8; 16];
            raw[0..8].copy_from_slice(&(BUF + u64::from(i) * 16).to_le_bytes());
            raw[8..12].copy_from_slice(&16u32.to_le_bytes());
            let mut flags = if i + 1 < n { DESC_F_NEXT } else { 0 };
            if i == 0 {
                flags |= flags_of_first;
            }
            raw[12..14].copy_from_slice(&flags.to_le_bytes());
            raw[14..16].copy_from_slice(&(i + 1).to_le_bytes());
            mem.write_slice(&raw, GuestAddress(at + u64::from(i) * 16))
                .expect("indirect descriptor");
        }
    }

    #[test]
    fn chain_walk_flattens_readable_then_writable() {
        let mem = memory(0x10_0000);
        let drv = Driver::new(&mem, 0, 16);
        drv.write_desc(0, BUF, 100, DESC_F_NEXT, 5);
        drv.write_desc(5, BUF + 0x1000, 0, DESC_F_NEXT, 2);
        drv.write_desc(2, BUF + 0x2000, 50, DESC_F_WRITE, 9);
        let c = Chain::walk(&mem, table(16, false), 0).expect("good chain");
        assert_eq!((c.readable.len(), c.readable.count()), (100, 1));
        assert_eq!((c.writable.len(), c.writable.count()), (50, 1));
    }

    #[test]
    fn chain_walk_bounds_loops_and_indices() {
        let mem = memory(0x10_0000);
        let drv = Driver::new(&mem, 0, 16);
        // A loop 0 -> 1 -> 0.
        drv.write_desc(0, BUF, 16, DESC_F_NEXT, 1);
        drv.write_desc(1, BUF, 16, DESC_F_NEXT, 0);
        assert!(matches!(
            Chain::walk(&mem, table(16, false), 0),
            Err(ChainError::TooLong { max: 16 })
        ));
        // A next index outside the table.
        drv.write_desc(1, BUF, 16, DESC_F_NEXT, 16);
        assert!(matches!(
            Chain::walk(&mem, table(16, false), 0),
            Err(ChainError::BadIndex {
                index: 16,
                size: 16
            })
        ));
        // A head outside the table.
        assert!(matches!(
            Chain::walk(&mem, table(16, false), u16::MAX),
            Err(ChainError::BadIndex { .. })
        ));
        // A chain of exactly the queue size is fine.
        for i in 0..16u16 {
            let flags = if i < 15 { DESC_F_NEXT } else { 0 };
            drv.write_desc(i, BUF, 16, flags, i + 1);
        }
        let c = Chain::walk(&mem, table(16, false), 0).expect("16 descriptors");
        assert_eq!(c.readable.count(), 16);
    }

    #[test]
    fn chain_walk_refuses_indirect_unless_negotiated() {
        let mem = memory(0x10_0000);
        let drv = Driver::new(&mem, 0, 16);
        indirect_table(&mem, TABLE, 4, 0);
        drv.write_desc(0, TABLE, 4 * 16, DESC_F_INDIRECT, 0);
        assert!(matches!(
            Chain::walk(&mem, table(16, false), 0),
            Err(ChainError::IndirectNotNegotiated)
        ));
        let c = Chain::walk(&mem, table(16, true), 0).expect("negotiated");
        assert_eq!((c.readable.count(), c.readable.len()), (4, 64));
    }

    #[test]
    fn chain_walk_bounds_indirect_tables() {
        let mem = memory(0x10_0000);
        let drv = Driver::new(&mem, 0, 16);
        let walk = || Chain::walk(&mem, table(16, true), 0);
        // More descriptors than the queue size, inside an indirect table.
        indirect_table(&mem, TABLE, 17, 0);
        drv.write_desc(0, TABLE, 17 * 16, DESC_F_INDIRECT, 0);
        assert!(matches!(walk(), Err(ChainError::TooLong { max: 16 })));
        // A loop inside the table.
        indirect_table(&mem, TABLE, 2, 0);
        let mut raw = [0u8; 16];
        raw[0..8].copy_from_slice(&BUF.to_le_bytes());
        raw[8..12].copy_from_slice(&16u32.to_le_bytes());
        raw[12..14].copy_from_slice(&DESC_F_NEXT.to_le_bytes());
        mem.write_slice(&raw, GuestAddress(TABLE + 16))
            .expect("looping entry");
        drv.write_desc(0, TABLE, 2 * 16, DESC_F_INDIRECT, 0);
        assert!(matches!(walk(), Err(ChainError::TooLong { .. })));
        // Nested indirect.
        indirect_table(&mem, TABLE, 2, DESC_F_INDIRECT);
        assert!(matches!(walk(), Err(ChainError::NestedIndirect)));
        // INDIRECT together with NEXT.
        indirect_table(&mem, TABLE, 2, 0);
        drv.write_desc(0, TABLE, 2 * 16, DESC_F_INDIRECT | DESC_F_NEXT, 1);
        assert!(matches!(walk(), Err(ChainError::IndirectWithNext)));
        // Tables of a bad length, or outside memory.
        for (addr, len) in [
            (TABLE, 0u32),
            (TABLE, 24),
            (u64::MAX - 15, 16),
            (0x10_0000, 16),
        ] {
            drv.write_desc(0, addr, len, DESC_F_INDIRECT, 0);
            assert!(
                matches!(walk(), Err(ChainError::BadIndirectTable { .. })),
                "{addr:#x}+{len}"
            );
        }
        // A table longer than 65535 entries (4 GiB - 16 bytes) is refused
        // without being read.
        drv.write_desc(0, 0, 0xffff_fff0, DESC_F_INDIRECT, 0);
        assert!(matches!(walk(), Err(ChainError::BadIndirectTable { .. })));
    }

    #[test]
    fn chain_walk_refuses_more_than_4_gib() {
        // 8 GiB of address space, never touched beyond the descriptors
        // (an anonymous mapping: pages come only when written).
        let mem = memory(0x2_0000_0000);
        let drv = Driver::new(&mem, 0, 16);
        drv.write_desc(0, BUF, u32::MAX, DESC_F_NEXT, 1);
        drv.write_desc(1, BUF, 1, 0, 0);
        let c = Chain::walk(&mem, table(16, false), 0).expect("exactly 4 GiB");
        assert_eq!(c.readable.len(), MAX_CHAIN_BYTES);
        drv.write_desc(1, BUF, 2, 0, 0);
        assert!(matches!(
            Chain::walk(&mem, table(16, false), 0),
            Err(ChainError::TooManyBytes)
        ));
    }

    #[test]
    fn chain_walk_random_tables_never_panic() {
        let mem = memory(0x10_0000);
        let mut x: u64 = 0x0123_4567_89ab_cdef;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..20_000 {
            let drv = Driver::new(&mem, 0, 16);
            for i in 0..16u16 {
                let r = rnd();
                let addr = match r % 4 {
                    0 => rnd(),
                    1 => TABLE,
                    _ => rnd() % 0x10_0000,
                };
                drv.write_desc(
                    i,
                    addr,
                    (rnd() >> 40) as u32,
                    (rnd() % 8) as u16,
                    (rnd() % 20) as u16,
                );
            }
            let mut junk = [0u8; 64];
            junk.iter_mut().for_each(|b| *b = rnd() as u8);
            mem.write_slice(&junk, GuestAddress(TABLE))
                .expect("junk table");
            let _ = Chain::walk(&mem, table(16, rnd() & 1 == 0), (rnd() % 18) as u16);
        }
    }
}
