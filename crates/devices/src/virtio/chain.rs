//! Descriptor chains as lists of guest-memory regions.
//!
//! A chain popped from a queue is flattened once into its device-readable
//! and device-writable parts; devices then read and write at byte offsets
//! into those parts without caring where descriptors begin and end. The
//! chain iterator of `virtio-queue` already bounds a chain to the queue size
//! (no loops); lengths are summed in `u64`, so nothing here overflows.

use virtio_queue::DescriptorChain;
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryBackend};

use crate::GuestMemory;

/// Why a descriptor chain cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ChainError {
    #[error("device-readable descriptor after a device-writable one")]
    ReadableAfterWritable,
    #[error("descriptor at {addr:#x} (+{len:#x}) is outside guest memory")]
    OutOfMemory { addr: u64, len: u32 },
    #[error("guest memory access failed")]
    Memory(#[source] vm_memory::GuestMemoryError),
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

impl Chain {
    /// Flattens `chain`, checking that every buffer lies in guest memory and
    /// that readable buffers come before writable ones.
    pub fn parse(chain: DescriptorChain<&GuestMemory>) -> Result<Chain, ChainError> {
        let head = chain.head_index();
        let mem = chain.memory();
        let mut out = Chain {
            head,
            readable: Regions::default(),
            writable: Regions::default(),
        };
        for desc in chain.clone() {
            let r = Region {
                addr: desc.addr(),
                len: desc.len(),
            };
            if !mem.check_range(r.addr, r.len as usize) {
                return Err(ChainError::OutOfMemory {
                    addr: r.addr.raw_value(),
                    len: r.len,
                });
            }
            if desc.is_write_only() {
                out.writable.push(r);
            } else if out.writable.is_empty() {
                out.readable.push(r);
            } else {
                return Err(ChainError::ReadableAfterWritable);
            }
        }
        Ok(out)
    }
}
