//! The process's open-file limit against what its VMs hold: a fork of a
//! wide group holds several descriptors per child (its pidfd, control and
//! agent connections, its cgroup's `cgroup.procs` until it joins), and the
//! usual soft limit of 1,024 is met near 100 children.

use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};

/// Descriptors the host side holds per fork child while the fork is made
/// and each live child after, with room to spare.
pub const PER_CHILD: u64 = 8;

/// The soft open-file limit in force (`u64::MAX`: none).
pub fn limit() -> u64 {
    getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX)
}

/// Descriptors this process has open now: a directory read, one entry
/// each (5.5 ms at 5,000 open here), so [`make_room`] asks it last.
pub fn open_now() -> u64 {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as u64)
}

/// The size of this process's descriptor table (`FDSize`), which bounds
/// the descriptors open from above: one short read, whatever is open.
fn table_size() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    crate::measure::kib_field(&status, "FDSize:")
}

/// Makes room for `more` descriptors beyond those open now, raising the
/// soft limit as far as [`raise_to`] may; `Err((need, limit))` when it
/// cannot. Cheap where the limit is far from reached (the table's size
/// already fits under it), so it may sit on every fork's path.
pub fn make_room(more: u64) -> Result<(), (u64, u64)> {
    if table_size().is_some_and(|size| size.saturating_add(more) <= limit()) {
        return Ok(());
    }
    let need = open_now().saturating_add(more);
    match raise_to(need) {
        limit if limit < need => Err((need, limit)),
        _ => Ok(()),
    }
}

/// Raises the soft open-file limit to at least `need`: up to the hard
/// limit, and past it where this process may (root). Returns the soft
/// limit in force after, which is less than `need` only when the hard
/// limit could not be raised.
pub fn raise_to(need: u64) -> u64 {
    let now = getrlimit(Resource::Nofile);
    let soft = now.current.unwrap_or(u64::MAX);
    let hard = now.maximum.unwrap_or(u64::MAX);
    if soft >= need {
        return soft;
    }
    let to = |current: u64, maximum: u64| {
        setrlimit(
            Resource::Nofile,
            Rlimit {
                current: Some(current),
                maximum: Some(maximum),
            },
        )
        .is_ok()
    };
    if to(need, hard.max(need)) {
        need
    } else if to(hard, hard) {
        hard
    } else {
        soft
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raising_never_lowers_and_the_limit_read_back_is_the_one_in_force() {
        let before = limit();
        let after = raise_to(before.saturating_sub(1).max(1));
        assert_eq!(after, before, "a lower need changes nothing");
        let wanted = before.min(1 << 20).saturating_add(64);
        let raised = raise_to(wanted);
        assert!(raised >= before);
        assert_eq!(limit(), raised);
        // This test's own descriptors, stdin at least, within the table.
        assert!(open_now() >= 1);
        assert!(table_size().is_some_and(|t| t >= open_now()));
        // Room for a few more is there; for more than any limit, it is not.
        assert_eq!(make_room(8), Ok(()));
        let (need, limit) = make_room(u64::MAX / 2).expect_err("past any limit");
        assert!(need > limit);
    }
}
