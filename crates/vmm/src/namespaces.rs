//! The host's namespaces a VMM leaves in `main`, while it has one thread
//! and still `CAP_SYS_ADMIN` (without it, each step fails with `EPERM`).
//! A namespace belongs to a thread, and threads and fork children inherit
//! the caller's: call these before any thread starts. The mount namespace
//! is `mounts`'.

use std::io;

/// Moves this process into a new network namespace of its own, with no
/// interface but a loopback that is down: a VMM whose guest's connections
/// are opened by a broker (or whose guest has no network) has no route to
/// anything, even if the guest took the VMM over. Unix sockets named by a
/// path keep working.
pub fn leave_host_network() -> io::Result<()> {
    unshare(libc::CLONE_NEWNET)
}

/// Moves this process into new IPC and UTS namespaces: a VMM its guest
/// took over finds no System V shared memory, semaphore or message queue
/// of the host's (or of another VMM's) to attach to, and cannot rename
/// the host.
pub fn leave_host_ipc_and_hostname() -> io::Result<()> {
    unshare(libc::CLONE_NEWIPC | libc::CLONE_NEWUTS)
}

fn unshare(flags: libc::c_int) -> io::Result<()> {
    // SAFETY: unshare takes no pointers; namespace flags affect only the
    // calling (single-threaded) process.
    match unsafe { libc::unshare(flags) } {
        0 => Ok(()),
        _ => Err(io::Error::last_os_error()),
    }
}
