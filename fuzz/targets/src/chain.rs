//! `Chain::walk` over a descriptor table the input writes.
//!
//! Input: queue size (u16, taken modulo 1024, plus one), a flags byte (bit
//! 0: indirect descriptors negotiated), the head index (u16, modulo the
//! size plus two, so heads just outside the table occur), then guest
//! memory from address 0 on. Guest memory is two regions with a hole
//! between them, so buffers that run off a region or across the hole occur.

use forkbox_devices::virtio::chain::{Chain, DescTable, Regions, MAX_CHAIN_BYTES};
use forkbox_devices::GuestMemory;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

use crate::input::Input;

/// (start, length) of the two regions.
const REGIONS: [(u64, usize); 2] = [(0, 0x8000), (0xc000, 0x4000)];

pub fn virtio_chain(data: &[u8]) {
    let mut input = Input::new(data);
    let size = input.u16() % 1024 + 1;
    let flags = input.u8();
    let head = input.u16() % (size + 2);
    let mem = GuestMemory::from_ranges(&[
        (GuestAddress(REGIONS[0].0), REGIONS[0].1),
        (GuestAddress(REGIONS[1].0), REGIONS[1].1),
    ])
    .expect("fuzz guest memory");
    let image = input.rest();
    let (first, second) = image.split_at(image.len().min(REGIONS[0].1));
    mem.write_slice(first, GuestAddress(REGIONS[0].0))
        .expect("first region");
    let second = &second[..second.len().min(REGIONS[1].1)];
    mem.write_slice(second, GuestAddress(REGIONS[1].0))
        .expect("second region");

    let table = DescTable {
        addr: GuestAddress(0),
        size,
        indirect: flags & 1 != 0,
    };
    let Ok(chain) = Chain::walk(&mem, table, head) else {
        return;
    };
    assert_eq!(chain.head, head);
    let total = check_regions(&mem, &chain.readable) + check_regions(&mem, &chain.writable);
    assert!(total <= MAX_CHAIN_BYTES, "a chain of {total} bytes");
    // Every descriptor but an indirect one adds at most one region.
    let regions = chain.readable.count() + chain.writable.count();
    assert!(
        regions <= usize::from(size),
        "{regions} regions from a queue of {size}"
    );

    // Reading a chain back goes exactly as far as it reaches.
    let mut buf = [0u8; 256];
    for offset in [
        0,
        1,
        chain.readable.len().saturating_sub(3),
        chain.readable.len(),
    ] {
        let got = chain
            .readable
            .read_at(&mem, offset, &mut buf)
            .expect("a walked chain's regions are readable");
        let want = chain
            .readable
            .len()
            .saturating_sub(offset)
            .min(buf.len() as u64);
        assert_eq!(got as u64, want, "read at {offset}");
    }
}

/// Every region is non-empty and inside guest memory; the regions add up
/// to the length the chain reports. Returns that length.
fn check_regions(mem: &GuestMemory, regions: &Regions) -> u64 {
    let mut sum = 0u64;
    for r in regions.iter() {
        assert!(r.len > 0, "an empty region was kept");
        assert!(
            mem.check_range(r.addr, r.len as usize),
            "region {:#x}+{:#x} outside guest memory",
            r.addr.0,
            r.len
        );
        sum += u64::from(r.len);
    }
    assert_eq!(sum, regions.len());
    sum
}
