//! The host's files as a VMM sees them: read-only, but for the directories
//! it and its fork children must write (their sockets, serial and egress
//! logs, snapshots). A VMM its guest took over keeps the daemon's user
//! (root), so without this it could rewrite any file root owns; with it,
//! the kernel refuses every write outside those directories (`EROFS`).
//!
//! Done once, in `main`, while the process still has `CAP_SYS_ADMIN`:
//! a mount namespace of its own (fork children share it), every mount in
//! it marked private (nothing reaches the host's) and remounted read-only,
//! each writable directory first made a mount of its own (a bind of
//! itself) that stays writable.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// Leaves the host's mount namespace for one where only `writable` (and
/// what is mounted under them) can be written.
pub fn read_only_host(writable: &[PathBuf]) -> io::Result<()> {
    let writable: Vec<PathBuf> = writable
        .iter()
        .map(|d| {
            d.canonicalize()
                .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", d.display())))
        })
        .collect::<io::Result<_>>()?;
    // SAFETY: unshare takes no pointers; CLONE_NEWNS affects only this
    // (single-threaded) process's mount namespace.
    if unsafe { libc::unshare(libc::CLONE_NEWNS) } != 0 {
        return Err(io::Error::last_os_error());
    }
    mount(None, Path::new("/"), libc::MS_REC | libc::MS_PRIVATE)
        .map_err(|e| context(e, "make the mounts private"))?;
    for dir in &writable {
        mount(Some(dir), dir, libc::MS_BIND | libc::MS_REC)
            .map_err(|e| context(e, &format!("bind {} onto itself", dir.display())))?;
    }
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")?;
    for (point, flags) in mount_points(&mountinfo) {
        if writable.iter().any(|w| point.starts_with(w)) {
            continue;
        }
        let remount = libc::MS_REMOUNT | libc::MS_BIND | libc::MS_RDONLY | flags;
        if let Err(e) = mount(None, &point, remount) {
            // A mount the kernel will not remount (a stale one, one hidden
            // under another) is one this process cannot reach anyway; any
            // other failure leaves a writable host.
            if !matches!(e.raw_os_error(), Some(libc::ENOENT | libc::EINVAL)) {
                return Err(context(e, &format!("make {} read-only", point.display())));
            }
            tracing::debug!(mount = %point.display(), "not remounted read-only: {e}");
        }
    }
    Ok(())
}

fn context(e: io::Error, what: &str) -> io::Error {
    io::Error::new(e.kind(), format!("cannot {what}: {e}"))
}

fn mount(source: Option<&Path>, target: &Path, flags: libc::c_ulong) -> io::Result<()> {
    let c = |p: &Path| {
        CString::new(p.as_os_str().as_bytes()).map_err(|_| io::Error::other("a NUL in a path"))
    };
    let source = source.map(c).transpose()?;
    let target = c(target)?;
    // SAFETY: every pointer is a NUL-terminated string that outlives the
    // call, or null (no source, file system type or data).
    let rc = unsafe {
        libc::mount(
            source.as_ref().map_or(std::ptr::null(), |s| s.as_ptr()),
            target.as_ptr(),
            std::ptr::null(),
            flags,
            std::ptr::null(),
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Every mount point in a `/proc/self/mountinfo` text, with the
/// per-mount flags a read-only remount must keep (`nosuid`, `nodev`,
/// `noexec`, the atime ones).
fn mount_points(mountinfo: &str) -> Vec<(PathBuf, libc::c_ulong)> {
    mountinfo
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split(' ').collect();
            let point = unescape(fields.get(4)?);
            let flags = fields
                .get(5)?
                .split(',')
                .map(|o| match o {
                    "nosuid" => libc::MS_NOSUID,
                    "nodev" => libc::MS_NODEV,
                    "noexec" => libc::MS_NOEXEC,
                    "noatime" => libc::MS_NOATIME,
                    "nodiratime" => libc::MS_NODIRATIME,
                    "relatime" => libc::MS_RELATIME,
                    _ => 0,
                })
                .fold(0, |a, b| a | b);
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
                (PathBuf::from("/"), libc::MS_RELATIME),
                (PathBuf::from("/tmp"), libc::MS_NOSUID | libc::MS_NODEV),
                (PathBuf::from("/mnt/a b"), libc::MS_NOEXEC),
            ]
        );
        assert_eq!(unescape("a\\134b\\011"), PathBuf::from("a\\b\t"));
        assert_eq!(unescape("trailing\\04"), PathBuf::from("trailing\\04"));
    }
}
