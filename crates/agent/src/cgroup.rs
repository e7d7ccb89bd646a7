//! Where the guest's commands run: each in a cgroup of its own (cgroup v2),
//! so that a timeout or a vanished client ends everything the command
//! started (`cgroup.kill`), even what left its process group or forks
//! faster than signals reach it.
//!
//! Commands of an unprivileged user (the policy) run under
//! [`POLICY`], which bounds them all together: at most [`POLICY_PIDS`]
//! tasks, all but a reserve of the guest's memory (an exec that runs it
//! out is killed whole), and a small CPU weight. A fork bomb, a memory hog
//! or a spinner there leaves the agent (in the root cgroup) and root's
//! commands (the grader, under [`ADMIN`], unbounded) room to run, so the
//! sandbox can still be graded.
//!
//! A command's cgroup, once empty, is kept as its parent's spare for the
//! next command instead of removed ([`SPARE`]), and a zygote holds one
//! under each parent: a fork child's commands make no cgroups.
//!
//! Only as the guest's PID 1: an agent serving elsewhere (its tests, on a
//! host) runs commands without cgroups.

use std::collections::BTreeSet;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock, PoisonError};

const MOUNT: &str = "/sys/fs/cgroup";
/// The unprivileged users' commands, bounded together.
pub const POLICY: &str = "forkbox-policy";
/// Root's commands (setup, graders), unbounded.
pub const ADMIN: &str = "forkbox-admin";
/// Most tasks (processes and threads) the policy's commands may have at
/// once.
pub const POLICY_PIDS: u32 = 1024;
/// The policy's CPU weight; the agent and root's commands have the
/// default, 100.
const POLICY_CPU_WEIGHT: u32 = 20;
/// Memory the policy cannot have: the larger of this and an eighth of the
/// guest's.
const MIN_RESERVE_MIB: u64 = 96;

static READY: OnceLock<bool> = OnceLock::new();
/// The command cgroups in use (by number), which a sweep leaves alone
/// even while empty (made, not yet joined, or spare); and the next number.
static IN_USE: Mutex<(BTreeSet<u64>, u64)> = Mutex::new((BTreeSet::new(), 1));

/// Empty command cgroups kept for the next commands, at most one per
/// parent: making a cgroup (its memory controller's per-CPU statistics,
/// its kernfs nodes) writes tens of guest pages, which in a fork child
/// are host pages of its own. The zygote holds a spare under each
/// parent, so a child's commands make none.
static SPARE: Mutex<Vec<Spare>> = Mutex::new(Vec::new());

struct Spare {
    bounded: bool,
    dir: PathBuf,
    number: u64,
    procs: File,
}

fn write(path: &Path, value: &str) -> io::Result<()> {
    fs::write(path, value).map_err(|e| {
        io::Error::new(
            e.kind(),
            format!("writing {value:?} to {}: {e}", path.display()),
        )
    })
}

/// Mounts cgroup v2 and makes the two parents, the policy's bounded. An
/// error leaves commands without cgroups (logged by the caller).
pub fn setup() -> io::Result<()> {
    let made = (|| {
        let root = Path::new(MOUNT);
        if !root.join("cgroup.controllers").exists() {
            crate::sys::mount(
                "cgroup2",
                MOUNT,
                "cgroup2",
                crate::sys::MountFlags::NOSUID
                    | crate::sys::MountFlags::NODEV
                    | crate::sys::MountFlags::NOEXEC,
                None,
            )?;
        }
        write(&root.join("cgroup.subtree_control"), "+pids +memory +cpu")?;
        let policy = root.join(POLICY);
        for dir in [&policy, &root.join(ADMIN)] {
            match fs::create_dir(dir) {
                Err(e) if e.kind() != io::ErrorKind::AlreadyExists => return Err(e),
                _ => {}
            }
        }
        write(&policy.join("cgroup.subtree_control"), "+pids +memory")?;
        write(&policy.join("pids.max"), &POLICY_PIDS.to_string())?;
        write(&policy.join("cpu.weight"), &POLICY_CPU_WEIGHT.to_string())?;
        let total = total_memory_bytes()?;
        let reserve = (MIN_RESERVE_MIB << 20).max(total / 8);
        write(
            &policy.join("memory.max"),
            &total.saturating_sub(reserve).to_string(),
        )?;
        Ok(())
    })();
    let _ = READY.set(made.is_ok());
    made
}

fn total_memory_bytes() -> io::Result<u64> {
    let info = fs::read_to_string("/proc/meminfo")?;
    info.lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kib| kib * 1024)
        .ok_or_else(|| io::Error::other("no MemTotal in /proc/meminfo"))
}

/// The cgroup one command runs in; removed when dropped if it is empty by
/// then (a command's leftover background processes keep it, and a later
/// command's sweep removes it once they end).
pub struct ExecCgroup {
    bounded: bool,
    dir: PathBuf,
    number: u64,
    /// Its `cgroup.procs`, open for the child to join by (the child can
    /// no longer open it once it has become the command's user); taken
    /// when it is kept as a spare.
    procs: Option<File>,
}

impl ExecCgroup {
    /// A cgroup under [`POLICY`] (`bounded`) or [`ADMIN`], the spare one
    /// if there is one, else a new one; `None` where commands run without
    /// cgroups.
    pub fn new(bounded: bool) -> Option<Self> {
        if READY.get() != Some(&true) {
            return None;
        }
        let spare = {
            let mut spares = SPARE.lock().unwrap_or_else(PoisonError::into_inner);
            let at = spares.iter().position(|s| s.bounded == bounded);
            at.map(|i| spares.swap_remove(i))
        };
        let Spare {
            dir, number, procs, ..
        } = spare.or_else(|| make(bounded))?;
        Some(Self {
            bounded,
            dir,
            number,
            procs: Some(procs),
        })
    }

    /// The open `cgroup.procs` a child writes `0` to, to join.
    pub fn procs_fd(&self) -> Option<RawFd> {
        self.procs.as_ref().map(AsRawFd::as_raw_fd)
    }

    /// Kills every process in it at once (`cgroup.kill`): none can fork
    /// its way out meanwhile.
    pub fn kill(&self) {
        if let Err(e) = OpenOptions::new()
            .write(true)
            .open(self.dir.join("cgroup.kill"))
            .and_then(|mut f| f.write_all(b"1"))
        {
            crate::log(&format!("cgroup.kill of {}: {e}", self.dir.display()));
        }
    }
}

impl Drop for ExecCgroup {
    /// Kept as its parent's spare if it is empty and there is none; else
    /// removed (EBUSY while processes remain: left to a later sweep).
    /// Then the other parent gets a spare if it has none: after the
    /// zygote's warm-up command both have one.
    fn drop(&mut self) {
        let spare = self.procs.take().map(|procs| Spare {
            bounded: self.bounded,
            dir: std::mem::take(&mut self.dir),
            number: self.number,
            procs,
        });
        if let Some(refused) = spare.and_then(|s| if is_empty(&s.dir) { keep(s) } else { Some(s) })
        {
            discard(refused);
        }
        let other = !self.bounded;
        let missing = !SPARE
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .any(|s| s.bounded == other);
        if let Some(refused) = missing.then(|| make(other)).flatten().and_then(keep) {
            discard(refused);
        }
    }
}

/// A new command cgroup under [`POLICY`] (`bounded`) or [`ADMIN`].
fn make(bounded: bool) -> Option<Spare> {
    let parent = Path::new(MOUNT).join(if bounded { POLICY } else { ADMIN });
    let number = {
        let mut in_use = IN_USE.lock().unwrap_or_else(PoisonError::into_inner);
        sweep(&parent, &in_use.0);
        let n = in_use.1;
        in_use.1 += 1;
        in_use.0.insert(n);
        n
    };
    let dir = parent.join(format!("exec-{number}"));
    let made = fs::create_dir(&dir).and_then(|()| {
        if bounded {
            // Out of memory, the whole command goes, not one process
            // of it the kernel happened to pick.
            write(&dir.join("memory.oom.group"), "1")?;
        }
        OpenOptions::new()
            .write(true)
            .open(dir.join("cgroup.procs"))
    });
    match made {
        Ok(procs) => Some(Spare {
            bounded,
            dir,
            number,
            procs,
        }),
        Err(e) => {
            crate::log(&format!("command cgroup {}: {e}", dir.display()));
            let _ = fs::remove_dir(&dir);
            release(number);
            None
        }
    }
}

/// Keeps `s` as its parent's spare, or gives it back if that parent has
/// one already.
fn keep(s: Spare) -> Option<Spare> {
    let mut spares = SPARE.lock().unwrap_or_else(PoisonError::into_inner);
    if spares.iter().any(|kept| kept.bounded == s.bounded) {
        return Some(s);
    }
    spares.push(s);
    None
}

/// Removes a command cgroup no command will use again (EBUSY while
/// processes remain: left to a later sweep).
fn discard(s: Spare) {
    let _ = fs::remove_dir(&s.dir);
    release(s.number);
}

/// Whether no process is in the cgroup at `dir` (or below it).
fn is_empty(dir: &Path) -> bool {
    fs::read_to_string(dir.join("cgroup.events"))
        .is_ok_and(|events| events.lines().any(|l| l == "populated 0"))
}

fn release(number: u64) {
    IN_USE
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .0
        .remove(&number);
}

/// Removes the empty command cgroups under `parent` that no command uses.
fn sweep(parent: &Path, in_use: &BTreeSet<u64>) {
    let Ok(entries) = fs::read_dir(parent) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let number = name.to_str().and_then(|n| n.strip_prefix("exec-"));
        match number.and_then(|n| n.parse::<u64>().ok()) {
            Some(n) if !in_use.contains(&n) => {
                let _ = fs::remove_dir(entry.path());
            }
            _ => {}
        }
    }
}
