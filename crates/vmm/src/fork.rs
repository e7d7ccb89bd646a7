//! The process side of a fork: `fork()` itself, the child's clean break
//! from every inherited descriptor, and the readiness pipe through which
//! the child tells the parent it is listening (or why it failed).
//!
//! Linux has no close-on-fork flag, so a child inherits every descriptor of
//! the parent: KVM fds (EIO in the child), eventfds registered as the
//! parent's irqfds and ioeventfds (live cross-talk into the parent's guest,
//! measured), epoll instances, sockets and the parent's control listener.
//! The child never acts on them (no epoll_ctl, shutdown, accept or read):
//! the caller forgets every object that owns one, then [`close_inherited`]
//! closes the descriptors, which only drops the child's references.

use std::io::{Read, Write};
use std::os::fd::{OwnedFd, RawFd};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec};
use rustix::pipe::PipeFlags;
use rustix::process::{Pid, PidfdFlags, WaitOptions};

/// How long a parent waits for a child to report ready.
pub const CHILD_READY_TIMEOUT: Duration = Duration::from_secs(10);

/// A readiness report: the child writes `K` when ready, or `E` + message.
const READY: u8 = b'K';
const FAILED: u8 = b'E';

/// Who we are after [`fork`].
pub enum Forked {
    Parent { pid: libc::pid_t, ready: OwnedFd },
    Child { ready: OwnedFd },
}

fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    Ok(rustix::pipe::pipe_with(PipeFlags::CLOEXEC)?)
}

/// Forks the process with a readiness pipe between parent and child.
///
/// # Safety
/// Only the calling thread exists in the child. The caller guarantees that
/// no other thread holds a lock the child will take (the vCPU threads are
/// parked outside every lock, and the child uses none of their objects).
pub unsafe fn fork() -> std::io::Result<Forked> {
    let (read, write) = pipe()?;
    // SAFETY: per this function's contract.
    let pid = unsafe { libc::fork() };
    match pid {
        p if p < 0 => Err(std::io::Error::last_os_error()),
        0 => {
            drop(read);
            Ok(Forked::Child { ready: write })
        }
        pid => {
            drop(write);
            Ok(Forked::Parent { pid, ready: read })
        }
    }
}

/// Closes every descriptor of this process except `keep`. Call in a fork
/// child after forgetting every object that owns an inherited descriptor.
pub fn close_inherited(keep: &[RawFd]) {
    let mut keep: Vec<u32> = keep.iter().filter_map(|&f| u32::try_from(f).ok()).collect();
    keep.sort_unstable();
    keep.dedup();
    let mut lo = 0u32;
    for &k in keep.iter().chain(std::iter::once(&u32::MAX)) {
        if k > lo {
            let hi = if k == u32::MAX { u32::MAX } else { k - 1 };
            // SAFETY: close_range only closes descriptors; every object that
            // owns one in [lo, hi] was forgotten by the caller.
            let rc = unsafe { libc::syscall(libc::SYS_close_range, lo, hi, 0u32) };
            if rc < 0 {
                tracing::warn!(
                    "close_range({lo}, {hi}): {}",
                    std::io::Error::last_os_error()
                );
            }
        }
        lo = k.saturating_add(1);
    }
}

/// Moves this process into the cgroup whose `cgroup.procs` is `procs`
/// (opened by whoever may move it: the kernel checks the opener's rights),
/// then closes it.
pub fn join_cgroup(procs: OwnedFd) -> std::io::Result<()> {
    // "0" is the writer itself, all its threads (a fork child has one).
    let n = rustix::io::write(&procs, b"0")?;
    if n != 1 {
        return Err(std::io::Error::other("short write to cgroup.procs"));
    }
    Ok(())
}

/// The child reports it is ready (its control socket listens).
pub fn report_ready(ready: OwnedFd) {
    let mut f = std::fs::File::from(ready);
    let _ = f.write_all(&[READY]);
}

/// The child reports why it could not start (then exits).
pub fn report_failure(ready: OwnedFd, error: &str) {
    let mut msg = vec![FAILED];
    // One write below PIPE_BUF arrives whole.
    msg.extend(error.as_bytes().iter().take(4000));
    let mut f = std::fs::File::from(ready);
    let _ = f.write_all(&msg);
}

/// The parent waits for a child's report.
pub fn wait_ready(ready: OwnedFd, timeout: Duration) -> Result<(), String> {
    let deadline = Instant::now() + timeout;
    let mut f = std::fs::File::from(ready);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!("child not ready within {timeout:?}"));
        }
        // Whole milliseconds, at least one, as the wait always was.
        let ms = left.as_millis().max(1);
        let timeout = Timespec {
            tv_sec: (ms / 1000) as _,
            tv_nsec: ((ms % 1000) * 1_000_000) as _,
        };
        let mut pfd = [PollFd::new(&f, PollFlags::IN)];
        match rustix::event::poll(&mut pfd, Some(&timeout)) {
            Ok(0) => continue,
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(format!("waiting for the child: {e}")),
        }
        let mut buf = vec![0u8; 4096];
        let n = match f.read(&mut buf) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(format!("reading the child's report: {e}")),
        };
        return match buf[..n].split_first() {
            Some((&READY, _)) => Ok(()),
            Some((&FAILED, msg)) => Err(String::from_utf8_lossy(msg).into_owned()),
            _ => Err("child exited before it was ready".into()),
        };
    }
}

/// A pidfd for `pid`, so the event loop can reap it when it exits.
pub fn pidfd_open(pid: libc::pid_t) -> std::io::Result<OwnedFd> {
    let pid = Pid::from_raw(pid).ok_or_else(|| std::io::Error::other("not a child's pid"))?;
    Ok(rustix::process::pidfd_open(pid, PidfdFlags::empty())?)
}

/// Reaps `pid` if it has exited (never blocks).
pub fn reap(pid: libc::pid_t) {
    if let Some(pid) = Pid::from_raw(pid) {
        let _ = rustix::process::waitpid(Some(pid), WaitOptions::NOHANG);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_pipe_reports_ready_and_failure() {
        let (r, w) = pipe().expect("pipe");
        report_ready(w);
        assert_eq!(wait_ready(r, Duration::from_secs(1)), Ok(()));
        let (r, w) = pipe().expect("pipe");
        report_failure(w, "cannot bind /x");
        assert_eq!(
            wait_ready(r, Duration::from_secs(1)),
            Err("cannot bind /x".into())
        );
        let (r, w) = pipe().expect("pipe");
        drop(w);
        assert!(wait_ready(r, Duration::from_secs(1)).is_err());
    }
}
