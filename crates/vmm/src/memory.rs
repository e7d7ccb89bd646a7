//! Guest RAM: anonymous memory or a memory file, mapped `MAP_PRIVATE` once
//! per RAM range, registered with KVM.
//!
//! All of the VMM's memory-mapping `unsafe` lives here. RAM is never
//! `MAP_SHARED` (DESIGN.md, "Fork: the core"): a `fork()` of the VMM makes
//! it copy-on-write in both directions. Three backings:
//! - boot: anonymous memory (a page the guest touches is one private page;
//!   a private view of an empty memfd would allocate each page twice, once
//!   in the memfd when it is first read and again when it is written);
//! - zygote ([`GuestRam::rebase_to_sealed_memfd`]): the guest's pages copied
//!   into a new memfd, sealed, mapped over the same addresses, so the
//!   process has no private pages and `fork()` copies no page tables;
//! - restore ([`GuestRam::from_file`]): a snapshot's `memory` file.

use std::ffi::CStr;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::FileExt;
use std::path::Path;

use forkbox_devices::GuestMemory;
use kvm_bindings::kvm_userspace_memory_region;
use kvm_ioctls::VmFd;
use rustix::fs::{MemfdFlags, SealFlags, SeekFrom};
use vm_memory::mmap::{MmapRegionBuilder, MmapRegionError};
use vm_memory::{
    FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryRegion, GuestRegionMmap,
    MemoryRegionAddress,
};

use crate::layout::MemoryLayout;
use crate::vcpu::Paused;

/// Page size used for zero-page detection and residency checks.
pub const PAGE: usize = 4096;

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
    #[error("cannot copy guest RAM into the memory file")]
    Copy(#[source] std::io::Error),
    #[error("cannot seal the memory file")]
    Seal(#[source] std::io::Error),
    #[error("cannot map the sealed memory file over guest RAM")]
    Remap(#[source] std::io::Error),
    #[error("cannot open memory file {0}")]
    Open(std::path::PathBuf, #[source] std::io::Error),
    #[error("memory file {path} has {found} bytes, the VM needs {want}")]
    FileSize {
        path: std::path::PathBuf,
        found: u64,
        want: u64,
    },
}

/// What the mapping is a private view of.
enum Backing {
    /// Anonymous memory: a page this process does not map is a zero page.
    Anonymous,
    /// A memfd: a page absent from memory is a zero page.
    Memfd(File),
    /// A file on disk: absent pages may hold data.
    File(File),
}

impl Backing {
    fn file(&self) -> Option<&File> {
        match self {
            Backing::Anonymous => None,
            Backing::Memfd(f) | Backing::File(f) => Some(f),
        }
    }
}

/// Guest RAM and what is behind it.
pub struct GuestRam {
    mem: GuestMemory,
    backing: Backing,
}

impl GuestRam {
    /// Maps each RAM range of `layout` as anonymous `MAP_PRIVATE` memory
    /// ([`anonymous_at_huge_boundary`]).
    pub fn new(layout: &MemoryLayout) -> Result<Self, MemoryError> {
        Ok(Self {
            mem: map(layout, None)?,
            backing: Backing::Anonymous,
        })
    }

    /// Maps a snapshot's memory file `MAP_PRIVATE` at fresh addresses: the
    /// file is never written, guest writes become private pages.
    pub fn from_file(layout: &MemoryLayout, path: &Path) -> Result<Self, MemoryError> {
        let file = File::open(path).map_err(|e| MemoryError::Open(path.to_path_buf(), e))?;
        let found = file
            .metadata()
            .map_err(|e| MemoryError::Open(path.to_path_buf(), e))?
            .len();
        if found != layout.total() {
            return Err(MemoryError::FileSize {
                path: path.to_path_buf(),
                found,
                want: layout.total(),
            });
        }
        let mem = map(layout, Some(&file))?;
        Ok(Self {
            mem,
            backing: Backing::File(file),
        })
    }

    /// The guest memory, as devices and the loader see it.
    pub fn memory(&self) -> &GuestMemory {
        &self.mem
    }

    /// Every file descriptor this object owns (a fork child keeps these).
    pub fn fds(&self) -> Vec<RawFd> {
        let mut v: Vec<RawFd> = self.backing.file().iter().map(|f| f.as_raw_fd()).collect();
        v.extend(
            self.mem
                .iter()
                .filter_map(|r| r.file_offset().map(|f| f.file().as_raw_fd())),
        );
        v
    }

    /// RAM's size in pages of its memory file (every range, one after the
    /// other, as [`map`] lays them out).
    pub fn pages(&self) -> u64 {
        self.mem.iter().map(|r| r.len() / PAGE as u64).sum()
    }

    /// The part of each RAM range that `pages` (pages of the memory file)
    /// covers: (guest-physical address, host address, bytes).
    pub fn spans_of(&self, pages: &std::ops::Range<u64>) -> Vec<(u64, usize, usize)> {
        let mut out = Vec::new();
        let mut first = 0u64;
        for region in self.mem.iter() {
            let len = region.len() / PAGE as u64;
            let (from, to) = (pages.start.max(first), pages.end.min(first + len));
            if from < to {
                if let Ok(host) = region.get_host_address(MemoryRegionAddress(0)) {
                    let skip = (from - first) * PAGE as u64;
                    out.push((
                        region.start_addr().0 + skip,
                        host as usize + skip as usize,
                        ((to - from) * PAGE as u64) as usize,
                    ));
                }
            }
            first += len;
        }
        out
    }

    /// Maps `pages` (pages of the memory file) into this process's page
    /// tables now rather than at the guest's first touch: `write`, as this
    /// process's own copies (`MADV_POPULATE_WRITE`, what a guest write
    /// does); otherwise shared with the file (`MADV_POPULATE_READ`).
    pub fn populate(&self, pages: &std::ops::Range<u64>, write: bool) -> io::Result<()> {
        let advice = match write {
            true => libc::MADV_POPULATE_WRITE,
            false => libc::MADV_POPULATE_READ,
        };
        for (_, host, len) in self.spans_of(pages) {
            // SAFETY: `host..host + len` lies inside a RAM range this object
            // keeps mapped (`spans_of` clips to them); populating changes
            // which pages are mapped, never what guest memory holds.
            if unsafe { libc::madvise(host as *mut libc::c_void, len, advice) } < 0 {
                return Err(io::Error::last_os_error());
            }
        }
        Ok(())
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
            // A fork child registers the same range it inherited, which its
            // own `GuestRam` (never dropped there) keeps mapped.
            unsafe { vm.set_user_memory_region(desc) }
                .map_err(|e| MemoryError::Register(slot, e))?;
        }
        Ok(())
    }

    /// Each RAM range as (host bytes, offset in the memory file), while
    /// the VM is `paused`: no vCPU writes guest memory while the slices
    /// live, and devices, which run only on the main thread (the caller's),
    /// do not run either while it is here.
    fn ranges<'a>(&'a self, _paused: &'a Paused<'_>) -> Result<Vec<(&'a [u8], u64)>, MemoryError> {
        let mut out = Vec::new();
        let mut offset = 0u64;
        for region in self.mem.iter() {
            let host = region
                .get_host_address(MemoryRegionAddress(0))
                .map_err(|_| MemoryError::Region(region.start_addr().0))?;
            let len = region.len() as usize;
            // SAFETY: `host..host+len` is mapped readable for as long as
            // `self.mem` lives (borrowed here for the slice's lifetime); no
            // vCPU writes it while `_paused` lives (the slice cannot outlive
            // it), and no device runs on the main thread, which is here.
            out.push((unsafe { std::slice::from_raw_parts(host, len) }, offset));
            offset += region.len();
        }
        Ok(out)
    }

    /// Writes guest RAM to `file` (already sized to the total) without its
    /// zero pages, which stay holes, while the VM is `paused`. Returns the
    /// bytes written.
    pub fn write_sparse_to(&self, file: &File, paused: &Paused<'_>) -> Result<u64, MemoryError> {
        let mut written = 0;
        for (bytes, offset) in self.ranges(paused)? {
            let resident = self.may_hold_data(bytes, offset);
            written += write_sparse(file, offset, bytes, resident.as_deref())
                .map_err(MemoryError::Copy)?;
        }
        Ok(written)
    }

    /// Makes this RAM a zygote's: copies it into a new memfd, seals the
    /// memfd (no write, shrink, grow, or new seals) and maps it `MAP_PRIVATE`
    /// over the same addresses. Afterwards the process has no private guest
    /// pages, so `fork()` is O(1) in guest memory size, and children fault
    /// pages lazily from the shared page cache. The VM must be `paused`.
    pub fn rebase_to_sealed_memfd(&mut self, paused: &Paused<'_>) -> Result<Copied, MemoryError> {
        let file = memfd(c"forkbox-zygote-ram")?;
        let total: u64 = self.mem.iter().map(|r| r.len()).sum();
        file.set_len(total)
            .map_err(|e| MemoryError::Resize(total, e))?;
        let copied = self.copy_to_memfd(&file, paused)?;
        // No writable shared mapping of it is left (`copy_to_memfd` dropped
        // its own), or F_SEAL_WRITE would fail.
        let seals = SealFlags::WRITE | SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL;
        rustix::fs::fcntl_add_seals(&file, seals).map_err(|e| MemoryError::Seal(e.into()))?;
        let mut offset = 0u64;
        for region in self.mem.iter() {
            let host = region
                .get_host_address(MemoryRegionAddress(0))
                .map_err(|_| MemoryError::Region(region.start_addr().0))?;
            // SAFETY: MAP_FIXED replaces exactly the range `self.mem` owns
            // (same address and length), with a private view of the same
            // bytes; no reference into it is live (`copy_to_memfd`'s are
            // gone, and no vCPU runs while `paused` lives; devices run only
            // on this thread, which is here), and KVM's memory slot refers to the address range,
            // whose contents it re-faults through its MMU notifier.
            let p = unsafe {
                libc::mmap(
                    host.cast(),
                    region.len() as usize,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_FIXED | libc::MAP_NORESERVE,
                    file.as_raw_fd(),
                    offset as libc::off_t,
                )
            };
            if p == libc::MAP_FAILED {
                return Err(MemoryError::Remap(io::Error::last_os_error()));
            }
            offset += region.len();
        }
        self.backing = Backing::Memfd(file);
        Ok(copied)
    }

    /// Which pages of the range `bytes` (at `offset` in the memory file)
    /// may hold data; `None`: any of them may (a file on disk).
    fn may_hold_data(&self, bytes: &[u8], offset: u64) -> Option<Vec<bool>> {
        match &self.backing {
            Backing::Anonymous => Some(possibly_written(bytes, None, offset)),
            Backing::Memfd(file) => Some(possibly_written(bytes, Some(file), offset)),
            Backing::File(_) => None,
        }
    }

    /// Copies guest RAM into the empty memfd `file`, leaving out its zero
    /// pages, through a shared mapping of the memfd. Each full 2 MiB region
    /// with at least [`HUGE_MIN_PAGES`] data pages is asked to be one huge
    /// page (`MADV_HUGEPAGE`), the others to be 4 KiB pages
    /// (`MADV_NOHUGEPAGE`). A fork child then maps a region it only reads
    /// with one page-table entry, on the host and in KVM's nested page
    /// tables: fewer page faults and page tables per child. The host grants
    /// huge pages where its `shmem_enabled` allows (`advise` or more) and
    /// it has free 2 MiB blocks.
    fn copy_to_memfd(&self, file: &File, paused: &Paused<'_>) -> Result<Copied, MemoryError> {
        let mut copied = Copied::default();
        for (bytes, offset) in self.ranges(paused)? {
            let resident = self.may_hold_data(bytes, offset);
            let data: Vec<bool> = bytes
                .chunks(PAGE)
                .enumerate()
                .map(|(i, page)| resident.as_ref().is_none_or(|r| r[i]) && !is_zero(page))
                .collect();
            let dst = SharedMap::new(file, offset, bytes.len()).map_err(MemoryError::Copy)?;
            // A huge page helps only where the guest-RAM mapping can map it
            // whole: at a 2 MiB boundary of both the address and the file.
            let aligned = (bytes.as_ptr() as u64 | offset).is_multiple_of(HUGE as u64);
            for (region, pages) in data.chunks(HUGE / PAGE).enumerate() {
                let n = pages.iter().filter(|&&d| d).count();
                let advice = if aligned && wants_huge(pages.len(), n) {
                    libc::MADV_HUGEPAGE
                } else {
                    libc::MADV_NOHUGEPAGE
                };
                dst.advise(region * HUGE, pages.len() * PAGE, advice)
                    .map_err(MemoryError::Copy)?;
                for (i, _) in pages.iter().enumerate().filter(|(_, &d)| d) {
                    let at = region * HUGE + i * PAGE;
                    dst.write(at, &bytes[at..(at + PAGE).min(bytes.len())]);
                }
                copied.bytes += (n * PAGE) as u64;
            }
            copied.huge_bytes += dst.huge_bytes();
        }
        Ok(copied)
    }
}

/// What [`GuestRam::rebase_to_sealed_memfd`] put in the zygote's memfd.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Copied {
    /// Bytes of guest RAM that are not zero pages.
    pub bytes: u64,
    /// Bytes of the memfd in 2 MiB huge pages (zero pages among them too).
    pub huge_bytes: u64,
}

/// A 2 MiB page: one page-table entry maps it, on the host and in KVM's
/// nested page tables.
const HUGE: usize = 2 << 20;

/// Data pages (of 512) that put a 2 MiB region of a zygote's memory into
/// one huge page. A huge page holds the region's zero pages too, once per
/// zygote; a sparser region costs the zygote more than its children gain.
pub const HUGE_MIN_PAGES: usize = 128;

/// Whether a region of guest RAM, `pages` 4 KiB pages long with `data` of
/// them holding data, goes into one huge page.
fn wants_huge(pages: usize, data: usize) -> bool {
    pages == HUGE / PAGE && data >= HUGE_MIN_PAGES
}

/// A writable shared mapping of part of a memfd, unmapped on drop.
struct SharedMap {
    addr: *mut u8,
    len: usize,
}

impl SharedMap {
    fn new(file: &File, offset: u64, len: usize) -> io::Result<Self> {
        // SAFETY: a fresh mapping at an address the kernel picks; nothing
        // else refers to it.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                offset as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let map = Self {
            addr: p.cast(),
            len,
        };
        // A process forked while this mapping lives (a fork child of this
        // VMM, or any fork in a test binary's other threads) must not
        // inherit it: its writable copy would outlive this one and make
        // F_SEAL_WRITE fail with EBUSY.
        map.advise(0, len, libc::MADV_DONTFORK)?;
        Ok(map)
    }

    fn advise(&self, at: usize, len: usize, advice: libc::c_int) -> io::Result<()> {
        assert!(at + len <= self.len);
        // SAFETY: the range lies inside this mapping; advice changes how
        // its pages are allocated, not what it holds.
        if unsafe { libc::madvise(self.addr.add(at).cast(), len, advice) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    fn write(&self, at: usize, bytes: &[u8]) {
        assert!(at + bytes.len() <= self.len);
        // SAFETY: the destination lies inside this mapping, which only this
        // object refers to; the source is a distinct (private) mapping.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.addr.add(at), bytes.len()) };
    }

    /// Bytes of this mapping mapped by 2 MiB entries (`ShmemPmdMapped` of
    /// its VMAs in `/proc/self/smaps`); 0 if that cannot be read.
    fn huge_bytes(&self) -> u64 {
        let Ok(smaps) = std::fs::read_to_string("/proc/self/smaps") else {
            return 0;
        };
        let (start, end) = (self.addr as u64, self.addr as u64 + self.len as u64);
        let mut inside = false;
        let mut kib = 0;
        for line in smaps.lines() {
            let mut fields = line.split_whitespace();
            let first = fields.next().unwrap_or("");
            if let Some((a, b)) = first.split_once('-') {
                if let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) {
                    inside = a >= start && b <= end;
                    continue;
                }
            }
            if inside && first == "ShmemPmdMapped:" {
                kib += fields
                    .next()
                    .and_then(|v| v.parse::<u64>().ok())
                    .unwrap_or(0);
            }
        }
        kib * 1024
    }
}

impl Drop for SharedMap {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping `new` made; no reference into
        // it outlives `self`.
        unsafe { libc::munmap(self.addr.cast(), self.len) };
    }
}

/// Maps each range of `layout` from consecutive offsets of `file`, or as
/// anonymous memory without one.
fn map(layout: &MemoryLayout, file: Option<&File>) -> Result<GuestMemory, MemoryError> {
    let mut regions = Vec::new();
    let mut offset = 0u64;
    for range in layout.ranges() {
        let size = usize::try_from(range.size).map_err(|_| MemoryError::Region(range.start))?;
        let builder =
            MmapRegionBuilder::new(size).with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE);
        let builder = match file {
            Some(file) => {
                let fd = file.try_clone().map_err(MemoryError::Memfd)?;
                builder
                    .with_mmap_flags(libc::MAP_PRIVATE | libc::MAP_NORESERVE)
                    .with_file_offset(FileOffset::new(fd, offset))
            }
            None => {
                let addr = anonymous_at_huge_boundary(size)
                    .map_err(|e| MemoryError::Map(range.start, MmapRegionError::Mmap(e)))?;
                // SAFETY: `addr..addr + size` is a fresh private anonymous
                // mapping, readable and writable, that only this region will
                // refer to; it is never unmapped (guest RAM lives as long as
                // the VMM's process).
                unsafe {
                    builder
                        .with_mmap_flags(ANONYMOUS_FLAGS)
                        .with_raw_mmap_pointer(addr)
                }
            }
        };
        let mapping = builder
            .build()
            .map_err(|e| MemoryError::Map(range.start, e))?;
        let region = GuestRegionMmap::new(mapping, GuestAddress(range.start))
            .ok_or(MemoryError::Region(range.start))?;
        regions.push(region);
        offset += range.size;
    }
    GuestMemory::from_regions(regions).map_err(MemoryError::Assemble)
}

/// How booted guest RAM is mapped.
const ANONYMOUS_FLAGS: libc::c_int = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;

/// Maps `size` bytes of private anonymous memory at a 2 MiB boundary, so
/// that a zygote's memfd mapped over the same range later ([`HUGE`]) can be
/// mapped in whole huge pages, advised `MADV_DONTDUMP`: a core dump of the
/// VMM leaves the guest's memory out, and host tools tell guest RAM from
/// the VMM's own memory by it (`forkbox_host::measure`; nothing else of the
/// VMM is so advised). The kernel places an anonymous mapping at any page;
/// this one reserves 2 MiB more and gives back what lies outside. The
/// mapping is never unmapped: a VMM's guest RAM lives as long as it.
fn anonymous_at_huge_boundary(size: usize) -> io::Result<*mut u8> {
    let prot = libc::PROT_READ | libc::PROT_WRITE;
    let reserved = size + HUGE;
    // SAFETY: a fresh mapping at an address the kernel picks; nothing else
    // refers to it.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), reserved, prot, ANONYMOUS_FLAGS, -1, 0) };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    let start = p as usize;
    let aligned = start.next_multiple_of(HUGE);
    let (head, tail) = (aligned - start, start + reserved - (aligned + size));
    // SAFETY: both ranges lie inside the mapping just made, outside the
    // part kept, and nothing refers to them.
    unsafe {
        if head > 0 {
            libc::munmap(p, head);
        }
        if tail > 0 {
            libc::munmap((aligned + size) as *mut libc::c_void, tail);
        }
    }
    // SAFETY: the range is exactly the mapping kept; the advice changes
    // what a core dump holds, not the memory.
    if unsafe { libc::madvise(aligned as *mut libc::c_void, size, libc::MADV_DONTDUMP) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(aligned as *mut u8)
}

/// Which pages of `bytes` (page aligned, mapped `MAP_PRIVATE` from the
/// memfd `file` at `offset`, or anonymous without one) may hold data; the
/// others have never been written and read as zero. A page may hold data
/// if the memfd has data there (`SEEK_DATA` counts pages swapped out as
/// data) or the mapping has a page of its own there, present or swapped
/// out (`/proc/self/pagemap`). `mincore` is not enough: it reports
/// swapped-out pages as absent. When either source cannot be read, every
/// page is taken to hold data.
fn possibly_written(bytes: &[u8], file: Option<&File>, offset: u64) -> Vec<bool> {
    let pages = bytes.len().div_ceil(PAGE);
    let mut out = vec![false; pages];
    if file.is_some_and(|f| file_data_pages(f, offset, &mut out).is_err())
        || mapped_pages(bytes.as_ptr() as usize, &mut out).is_err()
    {
        out.fill(true);
    }
    out
}

/// Marks the pages of `file` from `offset` on (one per entry of `out`)
/// that lie in its data ranges (`SEEK_DATA`/`SEEK_HOLE`).
pub fn file_data_pages(file: &File, offset: u64, out: &mut [bool]) -> io::Result<()> {
    let end = offset + (out.len() * PAGE) as u64;
    let seek = |to: SeekFrom| -> io::Result<Option<u64>> {
        match rustix::fs::seek(file, to) {
            Ok(at) => Ok(Some(at)),
            // No data at or after the position.
            Err(rustix::io::Errno::NXIO) => Ok(None),
            Err(e) => Err(e.into()),
        }
    };
    let mut pos = offset;
    while pos < end {
        let Some(data) = seek(SeekFrom::Data(pos))?.filter(|&d| d < end) else {
            break;
        };
        let hole = seek(SeekFrom::Hole(data))?.unwrap_or(end).min(end);
        let first = ((data - offset) / PAGE as u64) as usize;
        let last = (hole - offset).div_ceil(PAGE as u64) as usize;
        out[first..last].fill(true);
        pos = hole;
    }
    Ok(())
}

/// This process's `/proc/self/pagemap`, opened while it could be, and
/// whose it is (a fork child inherits the descriptor, which describes its
/// parent's memory). The file is readable by its owner only, and the
/// files of a process that is not dumpable are root's: once the VMM is
/// its own user it cannot open it again.
static PAGEMAP: std::sync::OnceLock<(u32, File)> = std::sync::OnceLock::new();

/// Opens this process's pagemap for later (before it gives up root).
pub fn keep_pagemap() {
    match File::open("/proc/self/pagemap") {
        Ok(f) => {
            let _ = PAGEMAP.set((std::process::id(), f));
        }
        Err(e) => tracing::debug!("/proc/self/pagemap: {e}"),
    }
}

fn pagemap() -> io::Result<File> {
    match PAGEMAP.get() {
        Some((pid, f)) if *pid == std::process::id() => f.try_clone(),
        _ => File::open("/proc/self/pagemap"),
    }
}

/// Marks the pages from `addr` on (one per entry of `out`) that this
/// process maps: present (bit 63 of a pagemap entry) or swapped (bit 62).
fn mapped_pages(addr: usize, out: &mut [bool]) -> io::Result<()> {
    const PRESENT_OR_SWAPPED: u64 = 0b11 << 62;
    let pagemap = pagemap()?;
    let mut buf = vec![0u8; 8 * 8192];
    for (chunk_index, chunk) in out.chunks_mut(8192).enumerate() {
        let first_page = addr / PAGE + chunk_index * 8192;
        let bytes = &mut buf[..chunk.len() * 8];
        pagemap.read_exact_at(bytes, (first_page * 8) as u64)?;
        for (mark, entry) in chunk.iter_mut().zip(bytes.chunks_exact(8)) {
            let entry = u64::from_ne_bytes(entry.try_into().unwrap_or_default());
            *mark |= entry & PRESENT_OR_SWAPPED != 0;
        }
    }
    Ok(())
}

/// Writes `bytes` to `file` at `offset`, skipping all-zero pages (they stay
/// holes) and pages `resident` marks as never written; runs of data pages go out in
/// one `pwrite`. Returns the bytes written.
pub fn write_sparse(
    file: &File,
    offset: u64,
    bytes: &[u8],
    resident: Option<&[bool]>,
) -> io::Result<u64> {
    let mut written = 0u64;
    let mut run: Option<usize> = None;
    let pages = bytes.len().div_ceil(PAGE);
    for i in 0..=pages {
        let data = i < pages && {
            let present = resident.is_none_or(|r| r.get(i).copied().unwrap_or(true));
            let page = &bytes[i * PAGE..((i + 1) * PAGE).min(bytes.len())];
            present && !is_zero(page)
        };
        match (data, run) {
            (true, None) => run = Some(i),
            (false, Some(start)) => {
                let chunk = &bytes[start * PAGE..(i * PAGE).min(bytes.len())];
                file.write_all_at(chunk, offset + (start * PAGE) as u64)?;
                written += chunk.len() as u64;
                run = None;
            }
            _ => {}
        }
    }
    Ok(written)
}

fn is_zero(page: &[u8]) -> bool {
    let (head, words, tail) = {
        // SAFETY: u64 has no invalid bit patterns; align_to only reinterprets
        // the aligned middle of a byte slice.
        unsafe { page.align_to::<u64>() }
    };
    head.iter().all(|&b| b == 0) && words.iter().all(|&w| w == 0) && tail.iter().all(|&b| b == 0)
}

fn memfd(name: &CStr) -> Result<File, MemoryError> {
    rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
        .map(File::from)
        .map_err(|e| MemoryError::Memfd(e.into()))
}

#[cfg(test)]
mod tests {
    use vm_memory::Bytes;

    use super::*;
    use crate::layout::{GIB, HIGH_RAM_START, MIB, MMIO_HOLE_START};
    use crate::vcpu::Vcpus;

    /// A VM's vCPUs, none of them: what the memory tests pause (they have
    /// no VM) to get the witness the memory functions require.
    fn no_vcpus() -> Vcpus {
        Vcpus::start(Vec::new()).expect("no threads to start")
    }

    #[test]
    fn new_16gib_maps_low_and_high_ranges() {
        let ram = GuestRam::new(&MemoryLayout::new(16 * GIB)).expect("anonymous RAM");
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
        // At 2 MiB boundaries, where a zygote's huge pages can map whole.
        for region in mem.iter() {
            let host = region
                .get_host_address(MemoryRegionAddress(0))
                .expect("mapped");
            assert_eq!(host as usize % HUGE, 0, "{host:?}");
        }
    }

    fn data_ranges(file: &File, len: u64) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        let mut pos = 0u64;
        while pos < len {
            let Ok(data) = rustix::fs::seek(file, SeekFrom::Data(pos)) else {
                break;
            };
            let hole = rustix::fs::seek(file, SeekFrom::Hole(data)).expect("SEEK_HOLE");
            out.push((data, hole));
            pos = hole;
        }
        out
    }

    fn temp_file(name: &str) -> (File, std::path::PathBuf) {
        let path = std::env::temp_dir().join(format!("forkbox-mem-{}-{name}", std::process::id()));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .open(&path)
            .expect("temp file");
        (file, path)
    }

    #[test]
    fn write_sparse_zero_pages_become_holes() {
        let (file, path) = temp_file("sparse");
        let mut bytes = vec![0u8; 64 * PAGE];
        bytes[3 * PAGE + 5] = 1; // page 3
        bytes[4 * PAGE] = 2; // page 4 (joins the run)
        bytes[40 * PAGE + PAGE - 1] = 3; // page 40
        let total = (bytes.len() + 8 * PAGE) as u64;
        file.set_len(total).expect("size");
        let n = write_sparse(&file, (8 * PAGE) as u64, &bytes, None).expect("write");
        assert_eq!(n, 3 * PAGE as u64);
        let meta = file.metadata().expect("meta");
        use std::os::unix::fs::MetadataExt;
        assert!(
            meta.blocks() * 512 <= 3 * PAGE as u64 + 8192,
            "{} blocks",
            meta.blocks()
        );
        assert_eq!(
            data_ranges(&file, total),
            vec![
                (11 * PAGE as u64, 13 * PAGE as u64),
                (48 * PAGE as u64, 49 * PAGE as u64)
            ]
        );
        let mut back = vec![0u8; bytes.len()];
        file.read_exact_at(&mut back, (8 * PAGE) as u64)
            .expect("read");
        assert_eq!(back, bytes);
        let _ = std::fs::remove_file(path);
    }

    #[test]
    fn write_sparse_skips_pages_marked_absent() {
        let (file, path) = temp_file("absent");
        let bytes = vec![7u8; 4 * PAGE];
        file.set_len(bytes.len() as u64).expect("size");
        let n = write_sparse(&file, 0, &bytes, Some(&[true, false, false, true])).expect("write");
        assert_eq!(n, 2 * PAGE as u64);
        assert_eq!(
            data_ranges(&file, bytes.len() as u64),
            vec![(0, PAGE as u64), (3 * PAGE as u64, 4 * PAGE as u64)]
        );
        let _ = std::fs::remove_file(path);
    }

    #[test]
    fn ram_snapshot_then_from_file_round_trips_private() {
        let layout = MemoryLayout::new(128 * MIB);
        let ram = GuestRam::new(&layout).expect("anonymous RAM");
        ram.memory()
            .write_obj(0xabcd_u64, GuestAddress(0x10_0000))
            .expect("write");
        let (file, path) = temp_file("ram");
        file.set_len(layout.total()).expect("size");
        let vcpus = no_vcpus();
        let (_, paused) = vcpus.pause().expect("nothing to park");
        let n = ram.write_sparse_to(&file, &paused).expect("snapshot");
        assert_eq!(n, PAGE as u64, "only the written page");
        let restored = GuestRam::from_file(&layout, &path).expect("map");
        let mem = restored.memory();
        assert_eq!(
            mem.read_obj::<u64>(GuestAddress(0x10_0000)).expect("read"),
            0xabcd
        );
        mem.write_obj(1u64, GuestAddress(0x20_0000))
            .expect("private write");
        let mut probe = [0u8; 8];
        file.read_exact_at(&mut probe, 0x20_0000)
            .expect("read file");
        assert_eq!(probe, [0; 8], "MAP_PRIVATE: the file is untouched");
        let _ = std::fs::remove_file(path);
    }

    #[test]
    fn zygote_rebase_keeps_contents_and_seals() {
        let layout = MemoryLayout::new(128 * MIB);
        let mut ram = GuestRam::new(&layout).expect("anonymous RAM");
        ram.memory()
            .write_obj(0x1234_u64, GuestAddress(0x30_0000))
            .expect("write");
        let vcpus = no_vcpus();
        let (_, paused) = vcpus.pause().expect("nothing to park");
        let n = ram.rebase_to_sealed_memfd(&paused).expect("rebase");
        assert_eq!(n.bytes, PAGE as u64);
        let mem = ram.memory();
        assert_eq!(
            mem.read_obj::<u64>(GuestAddress(0x30_0000)).expect("read"),
            0x1234
        );
        mem.write_obj(5u64, GuestAddress(0x30_0000))
            .expect("private write");
        let file = ram.backing.file().expect("a memfd");
        let seals = rustix::fs::fcntl_get_seals(file).expect("F_GET_SEALS");
        assert!(seals.contains(SealFlags::WRITE), "{seals:?}");
        let mut probe = [0u8; 8];
        file.read_exact_at(&mut probe, 0x30_0000)
            .expect("read memfd");
        assert_eq!(u64::from_le_bytes(probe), 0x1234, "sealed file unchanged");
    }

    #[test]
    fn possibly_written_counts_the_memfds_data_and_the_mappings_own_pages() {
        let layout = MemoryLayout::new(128 * MIB);
        let mut ram = GuestRam::new(&layout).expect("anonymous RAM");
        ram.memory()
            .write_obj(0x1234_u64, GuestAddress(0x30_0000))
            .expect("write");
        let vcpus = no_vcpus();
        let (_, paused) = vcpus.pause().expect("nothing to park");
        ram.rebase_to_sealed_memfd(&paused).expect("rebase");
        // Page 0x30_0000 now lives in the memfd only: this process has not
        // touched it since the rebase. Page 0x50_0000 is a private page.
        ram.memory()
            .write_obj(9u64, GuestAddress(0x50_0000))
            .expect("private write");
        let (bytes, offset) = ram.ranges(&paused).expect("ranges")[0];
        let marked: Vec<usize> = possibly_written(bytes, ram.backing.file(), offset)
            .iter()
            .enumerate()
            .filter_map(|(i, &m)| m.then_some(i))
            .collect();
        assert_eq!(marked, vec![0x300, 0x500]);
        // A snapshot of the rebased RAM keeps both.
        let (file, path) = temp_file("rebased");
        file.set_len(layout.total()).expect("size");
        let n = ram.write_sparse_to(&file, &paused).expect("snapshot");
        assert_eq!(n, 2 * PAGE as u64);
        let _ = std::fs::remove_file(path);
    }

    #[test]
    fn a_process_forked_during_the_copy_does_not_keep_the_memfd_writable() {
        let file = memfd(c"forkbox-test").expect("memfd");
        file.set_len(PAGE as u64).expect("size");
        let map = SharedMap::new(&file, 0, PAGE).expect("map");
        map.write(0, &[7]);
        let (read, write) = rustix::pipe::pipe().expect("pipe");
        // SAFETY: the child only blocks in read(2) and ends with _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", io::Error::last_os_error());
        if pid == 0 {
            let mut byte = [0u8];
            // SAFETY: closes the child's copy of the write end (so the
            // parent's drop ends the read), reads into a local buffer, then
            // ends the child without running the parent's destructors.
            unsafe {
                libc::close(write.as_raw_fd());
                libc::read(read.as_raw_fd(), byte.as_mut_ptr().cast(), 1);
                libc::_exit(0);
            }
        }
        drop(map);
        let sealed = rustix::fs::fcntl_add_seals(&file, SealFlags::WRITE);
        drop(write);
        let mut status = 0;
        // SAFETY: `pid` is our child; `status` is a valid out pointer.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        sealed.expect("F_SEAL_WRITE while a forked child lives");
    }

    #[test]
    fn dense_full_regions_want_huge_pages() {
        assert!(!wants_huge(512, 0));
        assert!(!wants_huge(512, HUGE_MIN_PAGES - 1));
        assert!(wants_huge(512, HUGE_MIN_PAGES));
        assert!(wants_huge(512, 512));
        // The tail of a RAM range shorter than 2 MiB never does.
        assert!(!wants_huge(256, 256));
    }

    #[test]
    fn zygote_rebase_keeps_dense_and_sparse_regions_byte_for_byte() {
        let layout = MemoryLayout::new(8 * MIB);
        let mut ram = GuestRam::new(&layout).expect("anonymous RAM");
        // Region 0: every page written (dense); region 1: 3 pages (sparse);
        // regions 2 and 3: untouched.
        let pattern = |page: u64| page.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let written: Vec<u64> = (0..512).chain([512, 700, 1023]).collect();
        for &page in &written {
            ram.memory()
                .write_obj(pattern(page), GuestAddress(page * PAGE as u64 + 8))
                .expect("write");
        }
        let vcpus = no_vcpus();
        let (_, paused) = vcpus.pause().expect("nothing to park");
        let copied = ram.rebase_to_sealed_memfd(&paused).expect("rebase");
        assert_eq!(copied.bytes, (written.len() * PAGE) as u64);
        assert!(
            copied.huge_bytes <= HUGE as u64,
            "only region 0 may be huge"
        );
        for page in 0..(8 * MIB / PAGE as u64) {
            let want = if written.contains(&page) {
                pattern(page)
            } else {
                0
            };
            let got: u64 = ram
                .memory()
                .read_obj(GuestAddress(page * PAGE as u64 + 8))
                .expect("read");
            assert_eq!(got, want, "page {page}");
        }
    }

    #[test]
    fn new_128mib_single_range() {
        let ram = GuestRam::new(&MemoryLayout::new(128 * MIB)).expect("anonymous RAM");
        assert_eq!(ram.memory().num_regions(), 1);
    }

    /// Resident bytes of the mapping that holds `addr`, from `/proc/self/smaps`.
    fn rss_of_mapping(addr: u64) -> u64 {
        let smaps = std::fs::read_to_string("/proc/self/smaps").expect("smaps");
        let mut inside = false;
        for line in smaps.lines() {
            let first = line.split_whitespace().next().unwrap_or("");
            if let Some((a, b)) = first.split_once('-') {
                if let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) {
                    inside = (a..b).contains(&addr);
                    continue;
                }
            }
            if inside && first == "Rss:" {
                let kib: u64 = line
                    .split_whitespace()
                    .nth(1)
                    .expect("kB")
                    .parse()
                    .expect("number");
                return kib * 1024;
            }
        }
        panic!("no mapping holds {addr:#x}");
    }

    #[test]
    fn booted_ram_costs_only_the_pages_written() {
        // A guest reads much of its RAM before it writes it (the kernel's
        // memory scan, a page cache filled and read). Read pages must cost
        // nothing, and a written page one page, not two.
        let layout = MemoryLayout::new(128 * MIB);
        let ram = GuestRam::new(&layout).expect("anonymous RAM");
        assert!(ram.fds().is_empty(), "no memory file behind booted RAM");
        let mem = ram.memory();
        for page in 0..4096u64 {
            mem.read_obj::<u64>(GuestAddress(page * PAGE as u64))
                .expect("read");
        }
        for page in 0..16u64 {
            mem.write_obj(page + 1, GuestAddress(page * PAGE as u64))
                .expect("write");
        }
        let host = mem.get_host_address(GuestAddress(0)).expect("mapped") as u64;
        let rss = rss_of_mapping(host);
        assert!(
            rss <= 64 * PAGE as u64,
            "{rss} bytes resident for 16 pages written"
        );
        let vcpus = no_vcpus();
        let (_, paused) = vcpus.pause().expect("nothing to park");
        let (file, path) = temp_file("booted");
        file.set_len(layout.total()).expect("size");
        let n = ram.write_sparse_to(&file, &paused).expect("snapshot");
        assert_eq!(n, 16 * PAGE as u64, "the written pages, not the read ones");
        let _ = std::fs::remove_file(path);
    }
}
