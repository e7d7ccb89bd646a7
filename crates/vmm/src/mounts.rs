//! The VMM's own root: a small read-only tmpfs holding only what the VMM
//! and its fork children use by path (`/proc`, the kernel, the initramfs,
//! the disk images or the snapshot it restores, and the directories they
//! write: their sockets, serial and egress logs, snapshots). The rest of
//! the host's files (`/etc`, `/home`, the daemon's state and token, other
//! users' files) does not exist for a VMM its guest took over.
//!
//! Done once, in `main`, while the process still has `CAP_SYS_ADMIN`:
//! a mount namespace of its own (fork children share it), every mount in
//! it private (nothing reaches the host's), a tmpfs on `root` with a bind
//! of each path at the same path under it, `pivot_root` into it and the
//! old root detached; then every mount but the writable directories is
//! made read-only (the tmpfs itself too). `/dev/kvm` is opened before
//! (`opened::kvm`), so no device node is in the new root.

use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use rustix::mount::{
    mount_bind, mount_change, mount_remount, unmount, MountFlags, MountPropagationFlags,
    UnmountFlags,
};

/// Leaves the host's mount namespace and root for one built in `root` (an
/// empty directory) where only `readable` (files or directories, read
/// only) and `writable` (directories) exist, each at its own path.
pub fn enter_jail(root: &Path, readable: &[PathBuf], writable: &[PathBuf]) -> io::Result<()> {
    let canonical = |d: &PathBuf| {
        d.canonicalize()
            .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", d.display())))
    };
    let writable: Vec<PathBuf> = writable.iter().map(canonical).collect::<io::Result<_>>()?;
    let mut binds: Vec<Bind> = std::iter::once(Ok(Bind::read_only(PathBuf::from("/proc"))))
        // One that does not exist is left for the VMM to report when it
        // opens it, with what it was for.
        .chain(
            readable
                .iter()
                .filter(|p| p.exists())
                .map(|p| canonical(p).map(Bind::read_only)),
        )
        .collect::<io::Result<_>>()?;
    binds.extend(writable.iter().cloned().map(|path| Bind {
        path,
        writable: true,
    }));
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
        let target = root.join(bind.path.strip_prefix("/").unwrap_or(&bind.path));
        mount_point(&bind.path, &target)
            .map_err(|e| context(e, &format!("make {}", target.display())))?;
        mount_bind(&bind.path, &target)
            .map_err(|e| context(e.into(), &format!("bind {}", bind.path.display())))?;
    }
    pivot_into(root).map_err(|e| context(e, &format!("pivot_root into {}", root.display())))?;
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")?;
    for (point, flags) in mount_points(&mountinfo) {
        if writable.iter().any(|w| point.starts_with(w)) {
            continue;
        }
        let remount = MountFlags::BIND | MountFlags::RDONLY | flags;
        mount_remount(&point, remount, "")
            .map_err(|e| context(e.into(), &format!("make {} read-only", point.display())))?;
    }
    Ok(())
}

/// A path of the host that the jail shows at the same path.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Bind {
    path: PathBuf,
    writable: bool,
}

impl Bind {
    fn read_only(path: PathBuf) -> Self {
        Self {
            path,
            writable: false,
        }
    }
}

/// The binds to make, parents first: one that another bind already shows
/// with as much access (a disk image inside the restored snapshot's
/// directory, the network policy in a writable directory) is left out, so
/// every mount point but those inside a bind is made in the tmpfs.
fn covering(mut binds: Vec<Bind>) -> Vec<Bind> {
    binds.sort_by(|a, b| {
        (a.path.components().count(), &a.path).cmp(&(b.path.components().count(), &b.path))
    });
    let mut kept: Vec<Bind> = Vec::new();
    for bind in binds {
        let covered = kept
            .iter()
            .any(|k| bind.path.starts_with(&k.path) && (k.writable || !bind.writable));
        if let Some(same) = kept.iter_mut().find(|k| k.path == bind.path) {
            same.writable |= bind.writable;
        } else if !covered {
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
        let ro = |p: &str| Bind::read_only(PathBuf::from(p));
        let rw = |p: &str| Bind {
            path: PathBuf::from(p),
            writable: true,
        };
        let got = covering(vec![
            ro("/cache/disk.img"),
            rw("/tmp"),
            ro("/tmp/vm/policy.json"),
            ro("/snap"),
            ro("/snap/disk.img"),
            rw("/snap/out"),
            ro("/proc"),
            ro("/cache/disk.img"),
            rw("/proc"),
        ]);
        assert_eq!(
            got,
            vec![
                rw("/proc"),
                ro("/snap"),
                rw("/tmp"),
                ro("/cache/disk.img"),
                rw("/snap/out"),
            ]
        );
    }

    /// As root, in a child process: the jail shows what it was given at
    /// the same paths (the read-only file unwritable, the writable
    /// directory a real bind of the host's), `/proc`, and nothing else;
    /// its root itself is read-only. Otherwise refused (no CAP_SYS_ADMIN).
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
            let code = match enter_jail(
                &root,
                std::slice::from_ref(&file),
                std::slice::from_ref(&out),
            ) {
                Err(_) => 10,
                Ok(()) => match () {
                    _ if std::fs::read_to_string(&file).ok().as_deref() != Some("input") => 11,
                    _ if !erofs(std::fs::write(&file, "changed")) => 12,
                    _ if std::fs::write(out.join("made"), "x").is_err() => 13,
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
                        if now == want {
                            0
                        } else {
                            18
                        }
                    }
                },
            };
            // SAFETY: ends the child without running the parent's atexit
            // handlers or destructors.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: `pid` is our child; `status` is a valid out pointer.
        let rc = unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(rc, pid, "waitpid: {}", io::Error::last_os_error());
        assert!(libc::WIFEXITED(status), "status {status:#x}");
        if rustix::process::geteuid().is_root() {
            assert_eq!(libc::WEXITSTATUS(status), 0, "see the codes in the child");
            assert_eq!(
                std::fs::read_to_string(out.join("made")).ok().as_deref(),
                Some("x")
            );
        } else {
            assert_eq!(
                libc::WEXITSTATUS(status),
                10,
                "refused without CAP_SYS_ADMIN"
            );
        }
    }
}
