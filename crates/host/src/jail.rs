//! What of a VMM's jail this host lets forkbox set up, said once by its
//! caller (the daemon at start), and refused with `--require-jail`.
//!
//! Every VMM drops its capabilities, sets `no_new_privs` and installs its
//! seccomp filters wherever it runs (no privilege needed). What needs one
//! (`CAP_SYS_ADMIN`): leaving the host's network namespace, without which a
//! VMM that a guest took over could reach the host's network, its IPC
//! namespace (System V shared memory and queues) and hostname, and a mount
//! namespace in which the host's files are read-only to it, without which
//! it could rewrite any file of the daemon's user. What needs root: a user
//! of its own for each VMM (`vm::user`), without which a VMM runs as the
//! daemon's user and may reach whatever that user may. What needs root and
//! cgroup v2: a cgroup of its own for each VMM ([`crate::cgroup`]), without
//! which no sandbox's host memory, tasks or CPU time is limited.

/// `CAP_SYS_ADMIN`'s bit in the capability sets.
const CAP_SYS_ADMIN: u32 = 21;

/// One part of the jail this process cannot give its VMMs, with what to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gap {
    pub missing: String,
    pub remedy: &'static str,
}

impl std::fmt::Display for Gap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.missing, self.remedy)
    }
}

/// The parts of the jail this process's VMMs will run without. Sets up
/// the `forkbox` cgroup ([`crate::cgroup::hierarchy`]) to find out whether
/// VMMs get cgroups of their own.
pub fn gaps() -> Vec<Gap> {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let mut gaps = gaps_in(&status);
    if let Err(why) = crate::cgroup::hierarchy() {
        gaps.push(Gap {
            missing: format!(
                "VMMs run in no cgroup of their own, so no sandbox's host memory, tasks or CPU \
                 time is limited: {why}"
            ),
            remedy: "run forkboxd as root on a host with cgroup v2 (the unified hierarchy)",
        });
    }
    gaps
}

/// [`gaps`] for a `/proc/PID/status` text.
pub fn gaps_in(status: &str) -> Vec<Gap> {
    let effective = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .unwrap_or(0);
    let euid = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|v| v.split_whitespace().nth(1))
        .and_then(|v| v.parse::<u32>().ok());
    let mut gaps = Vec::new();
    if euid != Some(0) {
        gaps.push(Gap {
            missing: "VMMs run as this daemon's user instead of a user of their own each: changing user needs root".into(),
            remedy: "run forkboxd as root",
        });
    }
    if effective & (1 << CAP_SYS_ADMIN) == 0 {
        gaps.push(Gap {
            missing: "VMMs keep the host's network, IPC and UTS namespaces and see (and may write) the host's files where their user may: a root of their own needs CAP_SYS_ADMIN".into(),
            remedy: "run forkboxd as root",
        });
    }
    gaps
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gaps_in_root_has_none_and_unprivileged_names_the_user_and_the_network() {
        let root = "Name:\tforkboxd\nUid:\t0\t0\t0\t0\nCapEff:\t000001ffffffffff\n";
        assert_eq!(gaps_in(root), vec![]);
        let user = "Name:\tforkboxd\nUid:\t65534\t65534\t65534\t65534\nCapEff:\t0000000000000000\n";
        let gaps = gaps_in(user);
        assert_eq!(gaps.len(), 2, "{gaps:?}");
        assert!(
            gaps[0].to_string().contains("changing user needs root"),
            "{}",
            gaps[0]
        );
        assert!(gaps[1].to_string().contains("CAP_SYS_ADMIN"), "{}", gaps[1]);
        // Root without CAP_SYS_ADMIN: that one gap.
        let no_admin = "Uid:\t0\t0\t0\t0\nCapEff:\t000001ffffdfffff\n";
        assert_eq!(gaps_in(no_admin).len(), 1);
        // CAP_SYS_ADMIN but not root: no user of their own.
        let admin = "Uid:\t1000\t1000\t1000\t1000\nCapEff:\t0000000000200000\n";
        assert_eq!(gaps_in(admin).len(), 1);
        // An unreadable status is treated as no privilege.
        assert_eq!(gaps_in("").len(), 2);
    }
}
