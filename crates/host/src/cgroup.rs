//! A cgroup (v2) of its own for every VMM on the host, with memory, pids
//! and CPU limits, so that no sandbox takes the host's memory or CPUs from
//! the others.
//!
//! The cgroups live under one `forkbox` cgroup at the top of the host's
//! cgroup v2 hierarchy (set up once per process, [`hierarchy`]), each
//! named after its VM's directory (`forkbox-vm-…`, `forkbox-fork-…`), so
//! that a restarted daemon finds the one of a VM it adopts. A booted VMM
//! joins its cgroup itself, first thing (`forkbox-vmm --cgroup`). A fork
//! child starts in its parent's (`fork()` puts it there) and joins its own
//! first thing after the fork, before it builds its VM: the host makes the
//! child's cgroup before the fork request and sends its `cgroup.procs`,
//! opened, with the request ([`VmCgroup::procs_for_joining`]; a jailed VMM
//! may not open it, but the kernel checks the rights of whoever opened it).
//!
//! What the kernel charges where: memory a process allocates stays charged
//! to the cgroup it was in when it did. So a fork child's KVM objects, page
//! tables and vCPU threads count against its own cgroup, and so does the
//! kernel thread KVM makes for its VM (`kvm-nx-lpage-recovery`, where the
//! host mitigates iTLB multihit), which goes to the cgroup of whoever made
//! the VM. What `fork()` itself allocates (the child's task and its copy
//! of the VMM's own page tables, some tens of KiB) counts against the
//! parent, and the pages children share with a zygote count against the
//! zygote. That is why a zygote's cgroup has no memory or task limit
//! ([`VmCgroup::lift_limits_for_zygote`]): a zygote runs nothing, and what
//! is charged to it grows with its children, whose count the daemon
//! bounds.

use std::io;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use forkbox_vmm_api::MAX_CHILDREN_PER_FORK;

/// The controllers a VMM's cgroup needs.
const CONTROLLERS: [&str; 3] = ["memory", "pids", "cpu"];
/// The cgroup under which every VMM's is made, at the top of the hierarchy.
const PARENT: &str = "forkbox";
/// The CPU period `cpu.max` is given in, in microseconds (the kernel's
/// default).
pub const CPU_PERIOD_US: u64 = 100_000;
/// A running VM's memory limit beyond its guest RAM: its VMM's own memory,
/// its KVM objects and page tables, and what `fork()` charges it for each
/// child it forks while it runs.
pub const MEMORY_BEYOND_GUEST: u64 = 512 << 20;

/// The limits of one VMM's cgroup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// `memory.max` in bytes; `None`: no limit.
    pub memory_max: Option<u64>,
    /// `pids.max`: its threads, and its fork children until they join
    /// their own.
    pub pids_max: u64,
    /// `cpu.max` quota per [`CPU_PERIOD_US`], in microseconds.
    pub cpu_quota_us: u64,
    /// `memory_max` is below what the VM's shape gets ([`for_vm`](Self::for_vm)):
    /// a sandbox held to less, which its guest's own writes reach, so an
    /// OOM kill at it is the guest's doing.
    pub memory_held: bool,
}

impl Limits {
    /// The limits of a VM of `vcpus` and `memory_mib`: its guest RAM plus
    /// [`MEMORY_BEYOND_GUEST`]; its vCPUs plus one for its devices' thread
    /// in CPU time; and tasks for its own threads (its vCPUs, its main and
    /// helper threads, KVM's thread for its VM) and for the children of
    /// the largest fork request, which start in its cgroup, one task each,
    /// until they join their own.
    pub fn for_vm(vcpus: u8, memory_mib: u32) -> Self {
        Self {
            memory_max: Some((u64::from(memory_mib) << 20) + MEMORY_BEYOND_GUEST),
            pids_max: 32 + u64::from(vcpus) + MAX_CHILDREN_PER_FORK as u64,
            cpu_quota_us: (u64::from(vcpus) + 1) * CPU_PERIOD_US,
            memory_held: false,
        }
    }

    /// These with the memory limit `bytes`, held if below these'.
    pub fn with_memory_max(self, bytes: u64) -> Self {
        Self {
            memory_max: Some(bytes),
            memory_held: self.memory_max.is_some_and(|m| bytes < m),
            ..self
        }
    }
}

/// The `forkbox` cgroup this process makes VMMs' cgroups under.
#[derive(Debug)]
pub struct Hierarchy {
    dir: PathBuf,
}

/// The `forkbox` cgroup, set up on first use: found under the host's
/// cgroup v2 mount, made if missing, with the memory, pids and CPU
/// controllers enabled for its children. `Err` says what is missing (a
/// host with no cgroup v2, or one whose controllers are with cgroup v1, or
/// a process that may not write there) and is the same for the life of
/// the process.
pub fn hierarchy() -> Result<&'static Hierarchy, &'static str> {
    static ONCE: OnceLock<Result<Hierarchy, String>> = OnceLock::new();
    ONCE.get_or_init(|| {
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")
            .map_err(|e| format!("cannot read /proc/self/mountinfo: {e}"))?;
        let root = cgroup2_mount(&mountinfo).ok_or("no cgroup v2 file system is mounted")?;
        Hierarchy::set_up(&root)
    })
    .as_ref()
    .map_err(String::as_str)
}

impl Hierarchy {
    fn set_up(root: &Path) -> Result<Self, String> {
        let available = std::fs::read_to_string(root.join("cgroup.controllers"))
            .map_err(|e| format!("cannot read {}/cgroup.controllers: {e}", root.display()))?;
        let missing: Vec<&str> = CONTROLLERS
            .iter()
            .copied()
            .filter(|c| !available.split_whitespace().any(|a| a == *c))
            .collect();
        if !missing.is_empty() {
            return Err(format!(
                "cgroup v2 at {} lacks the {} controller(s) (in use by cgroup v1?)",
                root.display(),
                missing.join(", ")
            ));
        }
        let dir = root.join(PARENT);
        enable_controllers(root)?;
        match std::fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(format!("cannot make the cgroup {}: {e}", dir.display())),
        }
        enable_controllers(&dir)?;
        Ok(Self { dir })
    }

    /// The directory of the `forkbox` cgroup.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Makes (or, if it is there, takes) the cgroup `name` and sets its
    /// `limits`.
    pub fn create(&self, name: &str, limits: Limits) -> io::Result<VmCgroup> {
        let cgroup = VmCgroup {
            dir: self.path_of(name)?,
            limits,
        };
        match std::fs::create_dir(&cgroup.dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
        cgroup.set_memory_max(limits.memory_max)?;
        cgroup.write("pids.max", &limits.pids_max.to_string())?;
        cgroup.write(
            "cpu.max",
            &format!("{} {CPU_PERIOD_US}", limits.cpu_quota_us),
        )?;
        Ok(cgroup)
    }

    /// Removes the cgroup `name` if it is there and empty (the kernel
    /// refuses to remove one with a process in it).
    pub fn remove(&self, name: &str) -> io::Result<()> {
        remove_dir(&self.path_of(name)?)
    }

    /// The cgroup `name` (made by [`create`](Self::create), maybe by
    /// another process: a daemon adopting VMs), not checked for. Its
    /// limits, what its VM's fork children get, are what its files say
    /// where they say a number (a zygote's lifted `max` does not), else
    /// `shape`'s.
    pub fn existing(&self, name: &str, shape: Limits) -> io::Result<VmCgroup> {
        let dir = self.path_of(name)?;
        let mut limits = shape;
        if let Some(bytes) = read_number(&dir, "memory.max") {
            limits = limits.with_memory_max(bytes);
        }
        if let Some(quota) = read_number(&dir, "cpu.max") {
            limits.cpu_quota_us = quota;
        }
        Ok(VmCgroup { dir, limits })
    }

    /// The directory of the cgroup `name`, one plain path component.
    fn path_of(&self, name: &str) -> io::Result<PathBuf> {
        if name.is_empty() || name.contains('/') || name.starts_with('.') {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{name:?} cannot name a cgroup"),
            ));
        }
        Ok(self.dir.join(name))
    }
}

/// One VMM's cgroup. Removed by [`remove`](Self::remove) once its
/// processes have ended, not when dropped (a VM handed to another process
/// keeps it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmCgroup {
    dir: PathBuf,
    limits: Limits,
}

impl VmCgroup {
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The limits it was made with (a zygote's memory and task limits
    /// lifted since), which its VM's fork children get.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// Moves the process `pid`, all its threads, into this cgroup.
    pub fn add(&self, pid: u32) -> io::Result<()> {
        self.write("cgroup.procs", &pid.to_string())
    }

    /// Its `cgroup.procs`, open for writing: a process that may not move
    /// itself (a jailed VMM's fork child) joins the cgroup by writing "0"
    /// to it, since the kernel checks the rights of whoever opened it.
    pub fn procs_for_joining(&self) -> io::Result<OwnedFd> {
        let path = self.dir.join("cgroup.procs");
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .map(OwnedFd::from)
            .map_err(|e| io::Error::new(e.kind(), format!("cannot open {}: {e}", path.display())))
    }

    /// Removes the memory and task limits (a VM that became a zygote);
    /// its CPU limit stays.
    pub fn lift_limits_for_zygote(&self) -> io::Result<()> {
        self.set_memory_max(None)?;
        self.write("pids.max", "max")
    }

    fn set_memory_max(&self, bytes: Option<u64>) -> io::Result<()> {
        let value = bytes.map_or_else(|| "max".to_owned(), |b| b.to_string());
        self.write("memory.max", &value)
    }

    /// Times the kernel's OOM killer ended a process of this cgroup because
    /// it reached its memory limit (`oom_kill` in `memory.events`).
    pub fn oom_kills(&self) -> u64 {
        std::fs::read_to_string(self.dir.join("memory.events"))
            .ok()
            .and_then(|events| {
                events.lines().find_map(|l| {
                    l.strip_prefix("oom_kill ")
                        .and_then(|n| n.trim().parse().ok())
                })
            })
            .unwrap_or(0)
    }

    /// Bytes the kernel charges it now (`memory.current`): what its VMM
    /// holds of its own, shared pages charged to whoever touched them
    /// first (a zygote, for its children).
    pub fn memory_current(&self) -> Option<u64> {
        read_number(&self.dir, "memory.current")
    }

    /// The processes in it.
    pub fn pids(&self) -> io::Result<Vec<u32>> {
        let procs = std::fs::read_to_string(self.dir.join("cgroup.procs"))?;
        Ok(procs
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect())
    }

    /// Removes the cgroup once its processes have left ([`remove_dir`]).
    pub fn remove(&self) -> io::Result<()> {
        remove_dir(&self.dir)
    }

    fn write(&self, file: &str, value: &str) -> io::Result<()> {
        std::fs::write(self.dir.join(file), value).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!(
                    "cannot write {value:?} to {}/{file}: {e}",
                    self.dir.display()
                ),
            )
        })
    }
}

/// The number a cgroup file `dir/file` starts with; `None` where it cannot
/// be read or says something else (`max`).
fn read_number(dir: &Path, file: &str) -> Option<u64> {
    let text = std::fs::read_to_string(dir.join(file)).ok()?;
    text.split_whitespace().next()?.parse().ok()
}

/// Removes the cgroup directory `dir`, waiting up to a second for processes
/// that are ending to leave it. Gone already is not an error.
fn remove_dir(dir: &Path) -> io::Result<()> {
    let mut tries = 0;
    loop {
        match std::fs::remove_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e)
                if e.raw_os_error() == Some(rustix::io::Errno::BUSY.raw_os_error())
                    && tries < 50 =>
            {
                tries += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(e),
        }
    }
}

/// Enables [`CONTROLLERS`] for the children of the cgroup `dir` (a no-op
/// where they are).
fn enable_controllers(dir: &Path) -> Result<(), String> {
    let file = dir.join("cgroup.subtree_control");
    let enabled = std::fs::read_to_string(&file).unwrap_or_default();
    let wanted: Vec<String> = CONTROLLERS
        .iter()
        .filter(|c| !enabled.split_whitespace().any(|e| e == **c))
        .map(|c| format!("+{c}"))
        .collect();
    if wanted.is_empty() {
        return Ok(());
    }
    std::fs::write(&file, wanted.join(" ")).map_err(|e| {
        format!(
            "cannot enable {} in {}: {e}",
            wanted.join(" "),
            file.display()
        )
    })
}

/// Where the cgroup v2 file system is mounted, from a
/// `/proc/self/mountinfo` text (the first such mount).
fn cgroup2_mount(mountinfo: &str) -> Option<PathBuf> {
    mountinfo.lines().find_map(|line| {
        let (mount, fs) = line.split_once(" - ")?;
        if fs.split(' ').next()? != "cgroup2" {
            return None;
        }
        // Fields: id, parent id, major:minor, root, mount point, ...
        let point = mount.split(' ').nth(4)?;
        Some(PathBuf::from(point.replace("\\040", " ")))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cgroup2_mount_is_found_among_v1_mounts() {
        let hybrid = "\
30 25 0:26 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755
31 30 0:27 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:10 - cgroup2 cgroup2 rw
32 30 0:28 / /sys/fs/cgroup/memory rw,nosuid shared:11 - cgroup cgroup rw,memory
";
        assert_eq!(
            cgroup2_mount(hybrid),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        let v1_only = "32 30 0:28 / /sys/fs/cgroup/memory rw shared:11 - cgroup cgroup rw,memory\n";
        assert_eq!(cgroup2_mount(v1_only), None);
    }

    #[test]
    fn limits_leave_room_for_the_vmm_and_a_whole_fork_request() {
        let l = Limits::for_vm(2, 512);
        assert_eq!(l.memory_max, Some((512 << 20) + MEMORY_BEYOND_GUEST));
        assert_eq!(l.cpu_quota_us, 3 * CPU_PERIOD_US);
        // A request's children start in the parent's cgroup, one task
        // each until they join their own; the parent's threads besides.
        assert!(l.pids_max >= MAX_CHILDREN_PER_FORK as u64 + 2 + 3, "{l:?}");
    }

    #[test]
    fn an_existing_cgroups_limits_are_its_files_numbers_else_the_shapes() {
        let root = tempfile::tempdir().expect("tempdir");
        let h = Hierarchy {
            dir: root.path().to_owned(),
        };
        let shape = Limits::for_vm(1, 512);
        std::fs::create_dir(root.path().join("held")).expect("mkdir");
        std::fs::write(root.path().join("held/memory.max"), "100663296\n").expect("write");
        std::fs::write(root.path().join("held/cpu.max"), "25000 100000\n").expect("write");
        let held = h.existing("held", shape).expect("named").limits();
        assert_eq!(held.memory_max, Some(96 << 20));
        assert!(held.memory_held);
        assert_eq!(held.cpu_quota_us, 25_000);
        assert_eq!(held.pids_max, shape.pids_max);
        // A zygote's lifted limits, and a cgroup gone: the shape's.
        std::fs::create_dir(root.path().join("zygote")).expect("mkdir");
        std::fs::write(root.path().join("zygote/memory.max"), "max\n").expect("write");
        assert_eq!(h.existing("zygote", shape).expect("named").limits(), shape);
        assert_eq!(h.existing("gone", shape).expect("named").limits(), shape);
        // The shape's own limit is not held.
        assert!(
            !shape
                .with_memory_max(shape.memory_max.expect("some"))
                .memory_held
        );
    }

    #[test]
    fn a_cgroup_name_is_one_plain_component() {
        let h = Hierarchy {
            dir: PathBuf::from("/sys/fs/cgroup/forkbox"),
        };
        let l = Limits::for_vm(1, 64);
        for bad in ["", "..", ".hidden", "a/b", "../x"] {
            assert!(h.existing(bad, l).is_err(), "{bad:?}");
        }
        assert_eq!(
            h.existing("forkbox-vm-x", l).expect("plain").dir(),
            Path::new("/sys/fs/cgroup/forkbox/forkbox-vm-x")
        );
    }
}
