//! Learning a zygote's working set (issue 20): one child's first command
//! shows which pages of the zygote's memory file every child touches, and
//! the zygote's later children map them before their guest runs (the VMM's
//! `prefault`, `forkbox_vmm::prefault`), instead of taking a nested-page
//! fault on each.

use std::collections::BTreeSet;
use std::time::Duration;

use forkbox_proto::{ExecRequest, User};
use forkbox_vmm_api::{PageRange, MAX_PREFAULT_RANGES, MAX_PREFAULT_WRITTEN};

use super::{Vm, VmError};

/// Read ranges this close (in pages) are mapped as one: the gap costs a
/// few page-table entries, a range a line of the request.
const READ_GAP: u64 = 8;

/// How long the learning child's first command may take.
const FIRST_COMMAND_WITHIN: Duration = Duration::from_secs(60);

/// What a zygote's children now map ahead: pages of its memory file.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WorkingSet {
    pub written: Vec<PageRange>,
    pub read: Vec<PageRange>,
}

impl WorkingSet {
    /// (written, read) pages.
    pub fn pages(&self) -> (u64, u64) {
        let count = |l: &[PageRange]| l.iter().map(|r| r[1]).sum();
        (count(&self.written), count(&self.read))
    }
}

impl Vm {
    /// Forks one child of this zygote, runs its first command (`true`, as
    /// the images' unprivileged user, or as root in an image without
    /// one), reads which pages of the memory file that child mapped
    /// (`/proc/PID/pagemap`, which needs root), ends it, and hands those
    /// pages to the zygote: its later children map them before their guest
    /// runs.
    pub fn learn_working_set(&self) -> Result<WorkingSet, VmError> {
        let mut child = self
            .fork(1)?
            .pop()
            .unwrap_or_else(|| Err(VmError::Io(std::io::Error::other("no fork child"))))?;
        let agent = child
            .agent()
            .clone()
            .with_call_timeout(FIRST_COMMAND_WITHIN);
        let run = |req: &ExecRequest| {
            agent
                .exec(req, None, &mut |_, _| {})
                .is_ok_and(|r| r.success())
        };
        let as_user = ExecRequest::argv(["true"]).user(User::Name(crate::image::USER.into()));
        if !run(&as_user) {
            run(&ExecRequest::argv(["true"]));
        }
        let pages = crate::measure::guest_pages(child.pid());
        child.kill();
        let _ = child.wait_exit(Duration::from_secs(10));
        let pages = pages.map_err(|e| {
            VmError::Io(std::io::Error::new(
                e.kind(),
                format!("reading the fork child's /proc/PID/pagemap (as root): {e}"),
            ))
        })?;
        let (written, read) = ranges(&pages.written, &pages.mapped);
        self.control.prefault(written.clone(), read.clone())?;
        Ok(WorkingSet { written, read })
    }
}

/// The `written` pages as ranges, exactly, at most
/// [`MAX_PREFAULT_WRITTEN`] of them; the other `mapped` pages as read
/// ranges, gaps of up to [`READ_GAP`] pages filled; at most
/// [`MAX_PREFAULT_RANGES`] in all, written ones first, each list from its
/// lowest page (a child faults in the rest).
pub fn ranges(written: &BTreeSet<u64>, mapped: &BTreeSet<u64>) -> (Vec<PageRange>, Vec<PageRange>) {
    let runs = |pages: &mut dyn Iterator<Item = u64>, gap: u64| {
        let mut out: Vec<PageRange> = Vec::new();
        for p in pages {
            match out.last_mut() {
                Some([first, count]) if p <= *first + *count + gap => *count = p - *first + 1,
                _ => out.push([p, 1]),
            }
        }
        out
    };
    let mut written = runs(
        &mut written.iter().copied().take(MAX_PREFAULT_WRITTEN as usize),
        0,
    );
    written.truncate(MAX_PREFAULT_RANGES);
    let read_only = mapped
        .iter()
        .copied()
        .filter(|p| !written_has(&written, *p));
    let mut read = runs(&mut read_only.into_iter(), READ_GAP);
    read.truncate(MAX_PREFAULT_RANGES - written.len());
    (written, read)
}

fn written_has(ranges: &[PageRange], page: u64) -> bool {
    let i = ranges.partition_point(|r| r[0] + r[1] <= page);
    ranges.get(i).is_some_and(|r| r[0] <= page)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_become_written_ranges_and_read_ranges_with_small_gaps_filled() {
        let written: BTreeSet<u64> = [3, 4, 5, 9].into();
        let mut mapped: BTreeSet<u64> = written.clone();
        mapped.extend([0, 1, 20, 20 + READ_GAP + 1, 100]);
        let (w, r) = ranges(&written, &mapped);
        assert_eq!(w, vec![[3, 3], [9, 1]]);
        // 0-1 read; 20 and 29 one range across the gap; 100 alone. The
        // written pages are not read ones.
        assert_eq!(r, vec![[0, 2], [20, READ_GAP + 2], [100, 1]]);
    }

    #[test]
    fn at_most_the_requests_ranges_written_ones_first() {
        let written: BTreeSet<u64> = (0..2 * MAX_PREFAULT_RANGES as u64).map(|p| p * 2).collect();
        assert!(written.len() as u64 <= MAX_PREFAULT_WRITTEN);
        // Read pages too far apart to join.
        let mapped: BTreeSet<u64> = written.iter().map(|p| p * 10 + 1_000_000).collect();
        let (w, r) = ranges(&written, &mapped);
        assert_eq!(w.len(), MAX_PREFAULT_RANGES);
        assert!(r.is_empty());
        let few: BTreeSet<u64> = [1].into();
        let (w, r) = ranges(&few, &mapped);
        assert_eq!(w.len() + r.len(), MAX_PREFAULT_RANGES);
        // A guest that wrote more than a child may be made to copy: the
        // lowest pages, up to the bound.
        let all: BTreeSet<u64> = (0..3 * MAX_PREFAULT_WRITTEN).collect();
        let (w, _) = ranges(&all, &all);
        assert_eq!(w, vec![[0, MAX_PREFAULT_WRITTEN]]);
    }
}
