//! Guest RAM: one memfd, mapped once per RAM range, registered with KVM.
//!
//! All of the VMM's memory-mapping `unsafe` lives here. Today the memfd is
//! mapped `MAP_SHARED`; the fork work will seal it and map it `MAP_PRIVATE`
//! (see DESIGN.md, "Fork: the core"), which changes only this module.

use std::ffi::CStr;
use std::fs::File;
use std::os::fd::{FromRawFd, OwnedFd};

use forkbox_devices::GuestMemory;
use kvm_bindings::kvm_userspace_memory_region;
use kvm_ioctls::VmFd;
use vm_memory::mmap::{MmapRegionBuilder, MmapRegionError};
use vm_memory::{
    FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryRegion, GuestRegionMmap,
    MemoryRegionAddress,
};

use crate::layout::MemoryLayout;

#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error("cannot create the guest memory file")]
    Memfd(#[source] std::io::Error),
    #[error("cannot size the guest memory file to {0} bytes")]
    Resize(u64, #[source] std::io::Error),
    #[error("cannot map guest RAM at {0:#x}")]
    Map(u64, #[source] MmapRegionError),
    #[error("guest RAM range at {0:#x} is invalid")]
    Region(u64),
    #[error("cannot assemble guest memory")]
    Assemble(#[source] vm_memory::GuestRegionCollectionError),
    #[error("cannot register guest RAM slot {0} with KVM")]
    Register(u32, #[source] kvm_ioctls::Error),
}

/// Guest RAM and the file behind it.
pub struct GuestRam {
    mem: GuestMemory,
    /// Kept for the fork work (sealing, re-mapping `MAP_PRIVATE`).
    _file: File,
}

impl GuestRam {
    /// Creates a memfd of `layout.total()` bytes and maps each RAM range of
    /// `layout` from consecutive offsets of it.
    pub fn new(layout: &MemoryLayout) -> Result<Self, MemoryError> {
        let file = memfd(c"forkbox-guest-ram")?;
        file.set_len(layout.total())
            .map_err(|e| MemoryError::Resize(layout.total(), e))?;
        let mut regions = Vec::new();
        let mut offset = 0u64;
        for range in layout.ranges() {
            let size = usize::try_from(range.size).map_err(|_| MemoryError::Region(range.start))?;
            let fd = file.try_clone().map_err(MemoryError::Memfd)?;
            let mapping = MmapRegionBuilder::new(size)
                .with_file_offset(FileOffset::new(fd, offset))
                .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
                .with_mmap_flags(libc::MAP_SHARED | libc::MAP_NORESERVE)
                .build()
                .map_err(|e| MemoryError::Map(range.start, e))?;
            let region = GuestRegionMmap::new(mapping, GuestAddress(range.start))
                .ok_or(MemoryError::Region(range.start))?;
            regions.push(region);
            offset += range.size;
        }
        let mem = GuestMemory::from_regions(regions).map_err(MemoryError::Assemble)?;
        Ok(Self { mem, _file: file })
    }

    /// The guest memory, as devices and the loader see it.
    pub fn memory(&self) -> &GuestMemory {
        &self.mem
    }

    /// Registers every RAM range as a KVM memory slot (slot i = range i).
    /// Call before `KVM_CREATE_IRQCHIP`: afterwards each call costs
    /// milliseconds (measured, DESIGN.md).
    pub fn register(&self, vm: &VmFd) -> Result<(), MemoryError> {
        for (slot, region) in self.mem.iter().enumerate() {
            let slot = slot as u32;
            let host = region
                .get_host_address(MemoryRegionAddress(0))
                .map_err(|_| MemoryError::Region(region.start_addr().0))?;
            let desc = kvm_userspace_memory_region {
                slot,
                flags: 0,
                guest_phys_addr: region.start_addr().0,
                memory_size: region.len(),
                userspace_addr: host as u64,
            };
            // SAFETY: `host..host+len` is a live mapping owned by `self.mem`
            // (an `Arc`ed `MmapRegion`), which the `Vm` keeps for as long as
            // the VM fd exists; KVM drops the slot when the VM fd is closed,
            // and the slot never overlaps another one (ranges are disjoint).
            unsafe { vm.set_user_memory_region(desc) }
                .map_err(|e| MemoryError::Register(slot, e))?;
        }
        Ok(())
    }
}

fn memfd(name: &CStr) -> Result<File, MemoryError> {
    // SAFETY: `name` is a valid NUL-terminated string for the duration of
    // the call; the flags are valid memfd_create flags.
    let fd =
        unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(MemoryError::Memfd(std::io::Error::last_os_error()));
    }
    // SAFETY: `fd` was just returned by memfd_create, is open, and is owned
    // by nothing else.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    Ok(File::from(owned))
}

#[cfg(test)]
mod tests {
    use vm_memory::Bytes;

    use super::*;
    use crate::layout::{GIB, HIGH_RAM_START, MIB, MMIO_HOLE_START};

    #[test]
    fn new_16gib_maps_low_and_high_ranges() {
        let ram = GuestRam::new(&MemoryLayout::new(16 * GIB)).expect("sparse memfd");
        let regions: Vec<(u64, u64)> = ram
            .memory()
            .iter()
            .map(|r| (r.start_addr().0, r.len()))
            .collect();
        assert_eq!(
            regions,
            vec![(0, MMIO_HOLE_START), (HIGH_RAM_START, 13 * GIB)]
        );
        let mem = ram.memory();
        mem.write_obj(0xfeed_u64, GuestAddress(HIGH_RAM_START + 8))
            .expect("high RAM writable");
        assert_eq!(
            mem.read_obj::<u64>(GuestAddress(HIGH_RAM_START + 8))
                .expect("readable"),
            0xfeed
        );
        assert!(mem.read_obj::<u8>(GuestAddress(MMIO_HOLE_START)).is_err());
    }

    #[test]
    fn new_128mib_single_range() {
        let ram = GuestRam::new(&MemoryLayout::new(128 * MIB)).expect("memfd");
        assert_eq!(ram.memory().num_regions(), 1);
    }
}
