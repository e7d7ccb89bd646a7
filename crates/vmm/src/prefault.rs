//! A zygote's working set, mapped into each fork child before its guest
//! runs (issue 20).
//!
//! A fork child of a zygote starts with nothing mapped: every guest page
//! it touches is a nested-page fault (an exit, a host page-table walk, and
//! for a write a copy), about 1,450 for a child's first command. Every
//! child resumes the same instant of the same guest, so the pages one
//! child touched are, nearly all of them, the pages the next one touches.
//! The asker records them from one child (`/proc/PID/pagemap`) and hands
//! them to the zygote (`prefault`); each later child then maps them before
//! its vCPUs run: the written ones as its own copies
//! (`MADV_POPULATE_WRITE`), the read ones shared (`MADV_POPULATE_READ`),
//! and, where the host's KVM has it (Linux 6.10+), all of them into its
//! nested page tables (`KVM_PRE_FAULT_MEMORY`), so the guest takes no
//! fault on them. On an older KVM the host side is still done ahead, and
//! each fault is only a mapping, not a copy.

use std::ops::Range;
use std::os::fd::AsRawFd;
use std::time::Instant;

use forkbox_vmm_api::PageRange;
use kvm_ioctls::{VcpuFd, VmFd};

use crate::memory::GuestRam;

/// The pages of the memory file a child of this zygote will touch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WorkingSet {
    written: Vec<Range<u64>>,
    read: Vec<Range<u64>>,
}

impl WorkingSet {
    /// The ranges of a `prefault` request, checked against RAM's `pages`.
    pub fn new(written: &[PageRange], read: &[PageRange], pages: u64) -> Result<Self, String> {
        let ranges = |list: &[PageRange]| -> Result<Vec<Range<u64>>, String> {
            list.iter()
                .map(|&[first, count]| match first.checked_add(count) {
                    Some(end) if count > 0 && end <= pages => Ok(first..end),
                    _ => Err(format!(
                        "prefault: pages [{first}, {count}] are not in this VM's {pages} pages"
                    )),
                })
                .collect()
        };
        Ok(Self {
            written: ranges(written)?,
            read: ranges(read)?,
        })
    }

    pub fn is_empty(&self) -> bool {
        self.written.is_empty() && self.read.is_empty()
    }

    /// (written, read) pages.
    pub fn pages(&self) -> (u64, u64) {
        let count = |l: &[Range<u64>]| l.iter().map(|r| r.end - r.start).sum();
        (count(&self.written), count(&self.read))
    }
}

/// `_IOWR(KVMIO, 0xd5, struct kvm_pre_fault_memory)`.
const KVM_PRE_FAULT_MEMORY: libc::c_ulong = 0xc040_aed5;

/// Whether this VM's KVM pre-faults (`KVM_CAP_PRE_FAULT_MEMORY`).
pub fn kvm_can(vm: &VmFd) -> bool {
    vm.check_extension_raw(kvm_bindings::KVM_CAP_PRE_FAULT_MEMORY.into()) > 0
}

/// Maps `set` into this process (`ram`) and, with `kvm`, into the nested
/// page tables of `vcpu`'s VM, stopping at `until`: the child must come
/// up within its parent's window ([`crate::fork::CHILD_READY_TIMEOUT`]),
/// and on a host far slower than hardware (the emulated one, hundreds of
/// guests on one CPU) mapping ahead can take seconds. Call after the
/// vCPU's registers are restored (KVM maps for its paging mode) and
/// before it first runs. What is not mapped, for a failure or for time,
/// the guest faults in: it is logged, not returned.
pub fn map_ahead(set: &WorkingSet, ram: &GuestRam, vcpu: &VcpuFd, kvm: bool, until: Instant) {
    let started = Instant::now();
    let mut failed = None;
    let mut late = false;
    'populate: for (write, list) in [(true, &set.written), (false, &set.read)] {
        for r in list {
            if Instant::now() >= until {
                late = true;
                break 'populate;
            }
            if let Err(e) = ram.populate(r, write) {
                failed.get_or_insert(format!("populating pages {r:?}: {e}"));
            }
        }
    }
    let populated = started.elapsed();
    if kvm && !late {
        'all: for r in set.written.iter().chain(&set.read) {
            for (gpa, _, len) in ram.spans_of(r) {
                if Instant::now() >= until {
                    late = true;
                    break 'all;
                }
                if let Err(e) = pre_fault(vcpu, gpa, len as u64, until) {
                    failed.get_or_insert(format!("KVM_PRE_FAULT_MEMORY at {gpa:#x}: {e}"));
                    break 'all;
                }
            }
        }
    }
    let (written, read) = set.pages();
    tracing::debug!(written, read, kvm, late, ?populated, elapsed = ?started.elapsed(), "fork child: working set mapped ahead");
    if late {
        tracing::info!(elapsed = ?started.elapsed(), "fork child: out of time to map the working set ahead; the guest faults the rest in");
    }
    if let Some(e) = failed {
        tracing::warn!("fork child: the working set was not all mapped ahead ({e}); the guest faults the rest in");
    }
}

/// `KVM_PRE_FAULT_MEMORY` over `[gpa, gpa + len)`; KVM may stop early
/// (a signal, a reschedule) and says how far it got, so it goes on from
/// there, until `until` (then `TimedOut`).
fn pre_fault(vcpu: &VcpuFd, gpa: u64, len: u64, until: Instant) -> std::io::Result<()> {
    let mut arg = kvm_bindings::kvm_pre_fault_memory {
        gpa,
        size: len,
        ..Default::default()
    };
    while arg.size > 0 {
        // SAFETY: the ioctl reads and updates `arg`, a live
        // `kvm_pre_fault_memory` of the size its number encodes, and maps
        // guest memory KVM already knows (registered slots); it writes no
        // memory of this process.
        let rc = unsafe { libc::ioctl(vcpu.as_raw_fd(), KVM_PRE_FAULT_MEMORY as _, &mut arg) };
        if rc < 0 {
            let e = std::io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) | Some(libc::EAGAIN) if Instant::now() < until => continue,
                Some(libc::EINTR) | Some(libc::EAGAIN) => {
                    return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, e))
                }
                _ => return Err(e),
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_working_set_keeps_its_ranges_and_refuses_pages_past_ram() {
        let set = WorkingSet::new(&[[10, 2]], &[[0, 1], [64, 512]], 1024).expect("inside");
        assert_eq!(set.pages(), (2, 513));
        assert!(!set.is_empty());
        assert!(WorkingSet::new(&[], &[], 8).expect("empty").is_empty());
        assert!(WorkingSet::new(&[[1000, 25]], &[], 1024).is_err());
        assert!(WorkingSet::new(&[], &[[u64::MAX, 2]], 1024).is_err());
        assert!(WorkingSet::new(&[], &[[3, 0]], 1024).is_err());
    }

    #[test]
    fn the_ioctl_number_is_kvms() {
        // _IOWR: direction 3 (bits 30-31), size (bits 16-29), type 0xAE, nr 0xd5.
        let size = std::mem::size_of::<kvm_bindings::kvm_pre_fault_memory>() as libc::c_ulong;
        assert_eq!(
            KVM_PRE_FAULT_MEMORY,
            (3 << 30) | (size << 16) | (0xae << 8) | 0xd5
        );
    }
}
