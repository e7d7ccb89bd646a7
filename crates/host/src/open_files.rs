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

/// Descriptors this process has open now.
pub fn open_now() -> u64 {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as u64)
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
        // This test's own descriptors, stdin at least.
        assert!(open_now() >= 1);
    }
}
