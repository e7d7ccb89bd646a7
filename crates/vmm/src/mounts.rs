//! The VMM's own root: a small read-only tmpfs holding only what the VMM
//! and its fork children read by path (a `/proc` of its own, the kernel,
//! the initramfs, the disk images or the snapshot it restores).
//! Its `/proc` is a new procfs mount with `hidepid=invisible,subset=pid`:
//! it shows the VMM's own processes and no other (no other process's
//! command line, the daemon's included) and none of the host's global
//! files (`/proc/sys`, `/proc/kcore`, ...). Nothing in it
//! is writable: what a VMM writes (its sockets, serial log, end note,
//! egress log, snapshots) and its network broker's links were opened
//! before it entered (by itself, or, for a fork child, by the asker of
//! the fork, who sends them with the request). The rest of the host's
//! files (`/etc`, `/home`, the daemon's state and token, other users'
//! files, other VMs' directories, its own and its siblings') does not
//! exist for a VMM its guest took over.
//!
//! Done once, in `main`, while the process still has `CAP_SYS_ADMIN`:
//! a mount namespace of its own (fork children share it), every mount in
//! it private (nothing reaches the host's), a tmpfs on `root` with a bind
//! of each path at the same path under it and the new procfs,
//! `pivot_root` into it and the old root detached; then every mount is made read-only (the tmpfs
//! itself too). `/dev/kvm` is opened before
//! (`opened::kvm`), so no device node is in the new root.

use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use rustix::mount::{
    mount_bind, mount_change, mount_remount, unmount, MountFlags, MountPropagationFlags,
    UnmountFlags,
};

/// Leaves the host's mount namespace and root for one built in `root` (an
/// empty directory) where only a `/proc` of its own and `readable`
/// (files or directories) exist, each at its own path, all read-only.
pub fn enter_jail(root: &Path, readable: &[PathBuf]) -> io::Result<()> {
    let canonical = |d: &PathBuf| {
        d.canonicalize()
            .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", d.display())))
    };
    let binds: Vec<PathBuf> = readable
        .iter()
        // One that does not exist is left for the VMM to report when it
        // opens it, with what it was for.
        .filter(|p| p.exists())
        .map(canonical)
        .collect::<io::Result<_>>()?;
    let binds = covering(binds);
    // SAFETY: unshare takes no pointers; CLONE_NEWNS affects only this
    // (single-threaded) process's mount namespace.
    if unsafe { libc::unshare(libc::CLONE_NEWNS) } != 0 {
        return Err(io::Error::last_os_error());
    }
    mount_change(
        "/",
        MountPropagationFlags::REC | MountPropagationFlags::PRIVATE,
    )
    .map_err(|e| context(e.into(), "make the mounts private"))?;
    let flags = MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC;
    rustix::mount::mount("tmpfs", root, "tmpfs", flags, None)
        .map_err(|e| context(e.into(), &format!("mount a tmpfs on {}", root.display())))?;
    for bind in &binds {
        let target = root.join(bind.strip_prefix("/").unwrap_or(bind));
        mount_point(bind, &target)
            .map_err(|e| context(e, &format!("make {}", target.display())))?;
        mount_bind(bind, &target)
            .map_err(|e| context(e.into(), &format!("bind {}", bind.display())))?;
    }
    // Not the host's /proc: that one shows every process's command line.
    let proc = root.join("proc");
    std::fs::create_dir_all(&proc).map_err(|e| context(e, "make /proc"))?;
    rustix::mount::mount("proc", &proc, "proc", flags, PROC_OPTIONS)
        .map_err(|e| context(e.into(), &format!("mount a procfs ({PROC_OPTIONS:?})")))?;
    pivot_into(root).map_err(|e| context(e, &format!("pivot_root into {}", root.display())))?;
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")?;
    for (point, flags) in mount_points(&mountinfo) {
        let remount = MountFlags::BIND | MountFlags::RDONLY | flags;
        mount_remount(&point, remount, "")
            .map_err(|e| context(e.into(), &format!("make {} read-only", point.display())))?;
    }
    Ok(())
}

/// A process sees only the processes it could ptrace (itself: a VMM is
/// not dumpable), and no file of /proc but theirs.
const PROC_OPTIONS: &std::ffi::CStr = c"hidepid=invisible,subset=pid";

/// The paths of the host to bind at the same paths, parents first: one
/// that another bind already shows (a disk image inside the restored
/// snapshot's directory) is left out, so every mount point but those
/// inside a bind is made in the tmpfs.
fn covering(mut binds: Vec<PathBuf>) -> Vec<PathBuf> {
    binds.sort_by(|a, b| (a.components().count(), a).cmp(&(b.components().count(), b)));
    let mut kept: Vec<PathBuf> = Vec::new();
    for bind in binds {
        if !kept.iter().any(|k| bind.starts_with(k)) {
            kept.push(bind);
        }
    }
    kept
}

/// An empty directory or file at `target` for `source` to be bound on.
fn mount_point(source: &Path, target: &Path) -> io::Result<()> {
    if source.is_dir() {
        return std::fs::create_dir_all(target);
    }
    if let Some(parent) = target.parent() {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(target)
        .map(drop)
}

/// Makes `root` (a mount point) this process's `/` and detaches the old
/// root, so no path leads back to the host's files.
fn pivot_into(root: &Path) -> io::Result<()> {
    std::env::set_current_dir(root)?;
    // With both ".", the old root ends up stacked on the new one, and
    // detaching the top mount on "." takes it out of this namespace.
    rustix::process::pivot_root(".", ".")?;
    unmount(".", UnmountFlags::DETACH)?;
    std::env::set_current_dir("/")
}

fn context(e: io::Error, what: &str) -> io::Error {
    io::Error::new(e.kind(), format!("cannot {what}: {e}"))
}

/// Every mount point in a `/proc/self/mountinfo` text, with the
/// per-mount flags a read-only remount must keep (`nosuid`, `nodev`,
/// `noexec`, the atime ones).
fn mount_points(mountinfo: &str) -> Vec<(PathBuf, MountFlags)> {
    mountinfo
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split(' ').collect();
            let point = unescape(fields.get(4)?);
            let flags = fields
                .get(5)?
                .split(',')
                .map(|o| match o {
                    "nosuid" => MountFlags::NOSUID,
                    "nodev" => MountFlags::NODEV,
                    "noexec" => MountFlags::NOEXEC,
                    "noatime" => MountFlags::NOATIME,
                    "nodiratime" => MountFlags::NODIRATIME,
                    "relatime" => MountFlags::RELATIME,
                    _ => MountFlags::empty(),
                })
                .fold(MountFlags::empty(), |a, b| a | b);
            Some((point, flags))
        })
        .collect()
}

/// A mountinfo path: spaces, tabs, newlines and backslashes are written
/// as octal escapes (`\040`).
fn unescape(field: &str) -> PathBuf {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes.get(i + 1..i + 4).and_then(|d| {
            std::str::from_utf8(d)
                .ok()
                .and_then(|d| u8::from_str_radix(d, 8).ok())
        });
        match (bytes[i], octal) {
            (b'\\', Some(b)) => {
                out.push(b);
                i += 4;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    PathBuf::from(std::ffi::OsStr::from_bytes(&out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_points_keep_their_flags_and_unescape_their_paths() {
        let info = "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n\
                    30 22 0:25 / /tmp rw,nosuid,nodev shared:5 - tmpfs tmpfs rw\n\
                    31 22 0:26 / /mnt/a\\040b ro,noexec - tmpfs tmpfs rw\n";
        assert_eq!(
            mount_points(info),
            vec![
                (PathBuf::from("/"), MountFlags::RELATIME),
                (
                    PathBuf::from("/tmp"),
                    MountFlags::NOSUID | MountFlags::NODEV
                ),
                (PathBuf::from("/mnt/a b"), MountFlags::NOEXEC),
            ]
        );
        assert_eq!(unescape("a\\134b\\011"), PathBuf::from("a\\b\t"));
        assert_eq!(unescape("trailing\\04"), PathBuf::from("trailing\\04"));
    }

    #[test]
    fn covering_keeps_parents_first_and_leaves_out_what_they_show() {
        let p = PathBuf::from;
        let got = covering(vec![
            p("/cache/disk.img"),
            p("/snap/disk.img"),
            p("/snap"),
            p("/proc"),
            p("/cache/disk.img"),
            p("/snapshots"),
        ]);
        assert_eq!(
            got,
            vec![
                p("/proc"),
                p("/snap"),
                p("/snapshots"),
                p("/cache/disk.img")
            ]
        );
    }

    /// As root, in a child process: the jail shows what it was given at
    /// the same paths, read-only (a file and a directory), `/proc`, and
    /// nothing else; its root itself is read-only; once the child is
    /// another user and not dumpable (as a VMM), its `/proc` shows itself
    /// and no other process (not the test's command line) and no global
    /// file. Otherwise refused (no CAP_SYS_ADMIN).
    #[test]
    fn enter_jail_shows_only_what_it_was_given() {
        let dir = tempfile::tempdir().expect("tempdir");
        let dir = dir.path().canonicalize().expect("canonical");
        let (root, file, out) = (dir.join("root"), dir.join("in.txt"), dir.join("out"));
        std::fs::create_dir(&root).expect("root");
        std::fs::create_dir(&out).expect("out");
        std::fs::write(&file, "input").expect("file");
        // SAFETY: the child makes system calls and file operations, then
        // ends with _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", io::Error::last_os_error());
        if pid == 0 {
            let erofs = |r: io::Result<()>| r.is_err_and(|e| e.raw_os_error() == Some(libc::EROFS));
            let code = match enter_jail(&root, &[file.clone(), out.clone()]) {
                Err(_) => 10,
                Ok(()) => match () {
                    _ if std::fs::read_to_string(&file).ok().as_deref() != Some("input") => 11,
                    _ if !erofs(std::fs::write(&file, "changed")) => 12,
                    _ if !erofs(std::fs::write(out.join("made"), "x")) => 13,
                    _ if Path::new("/etc").exists() || dir.join("root").exists() => 14,
                    _ if std::fs::read_to_string("/proc/self/status").is_err() => 15,
                    _ if !erofs(std::fs::create_dir("/new")) => 16,
                    _ => {
                        let mut now: Vec<String> = std::fs::read_dir("/")
                            .map(|d| {
                                d.filter_map(|e| e.ok())
                                    .map(|e| e.file_name().to_string_lossy().into_owned())
                                    .collect()
                            })
                            .unwrap_or_default();
                        now.sort();
                        let first = dir
                            .components()
                            .nth(1)
                            .map(|c| c.as_os_str().to_string_lossy().into_owned());
                        let mut want = vec!["proc".to_owned()];
                        want.extend(first);
                        want.sort();
                        want.dedup();
                        if now != want {
                            18
                        } else {
                            unprivileged_proc_view()
                        }
                    }
                },
            };
            // SAFETY: ends the child without running the parent's atexit
            // handlers or destructors.
            unsafe { libc::_exit(code) };
        }
        let parent = rustix::process::getpid().as_raw_nonzero().get();
        assert!(
            std::fs::read(format!("/proc/{parent}/cmdline")).is_ok(),
            "the host's /proc shows the test"
        );
        let mut status = 0;
        // SAFETY: `pid` is our child; `status` is a valid out pointer.
        let rc = unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(rc, pid, "waitpid: {}", io::Error::last_os_error());
        assert!(libc::WIFEXITED(status), "status {status:#x}");
        if rustix::process::geteuid().is_root() {
            assert_eq!(libc::WEXITSTATUS(status), 0, "see the codes in the child");
            assert!(!out.join("made").exists());
        } else {
            assert_eq!(
                libc::WEXITSTATUS(status),
                10,
                "refused without CAP_SYS_ADMIN"
            );
        }
    }

    /// In the jailed child: as user 65534, not dumpable, what its `/proc`
    /// shows. 0 when it shows itself only, else a code for what leaked.
    fn unprivileged_proc_view() -> i32 {
        let parent = rustix::process::getppid().map_or(1, |p| p.as_raw_nonzero().get());
        // SAFETY: prctl and setresgid/setresuid take integers only.
        let dropped = unsafe {
            libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) == 0
                && libc::setresgid(65534, 65534, 65534) == 0
                && libc::setresuid(65534, 65534, 65534) == 0
        };
        match () {
            _ if !dropped => 20,
            _ if std::fs::read_to_string("/proc/self/status").is_err() => 21,
            _ if std::fs::read(format!("/proc/{parent}/cmdline")).is_ok() => 22,
            _ if Path::new(&format!("/proc/{parent}")).exists() => 23,
            _ if Path::new("/proc/1").exists() => 24,
            _ if Path::new("/proc/cpuinfo").exists() || Path::new("/proc/sys").exists() => 25,
            _ => 0,
        }
    }
}
