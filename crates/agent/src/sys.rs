//! Every raw syscall the agent makes: the only module with `unsafe`.
//!
//! Each wrapper takes Rust types, converts them to C ones that live across
//! the call, and turns `-1` into `io::Error::last_os_error()`.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::mem;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::Command;

fn cstring(s: &str) -> io::Result<CString> {
    CString::new(s).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL byte in string"))
}

fn check(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// One `read(2)` from `fd` into `buf`'s spare capacity, replacing its
/// contents; returns the bytes read (0 at EOF). Only the pages the kernel
/// writes are touched, unlike a zero-filled buffer: in a fork child every
/// guest page written costs a host page, and zeroing a 256 KiB buffer per
/// output stream cost 128 pages (0.5 MiB) per exec.
pub fn read_into(fd: BorrowedFd<'_>, buf: &mut Vec<u8>) -> io::Result<usize> {
    buf.clear();
    let spare = buf.spare_capacity_mut();
    // SAFETY: the kernel writes at most `spare.len()` bytes into the
    // vector's allocation, which `buf` owns for the call.
    let n = unsafe { libc::read(fd.as_raw_fd(), spare.as_mut_ptr().cast(), spare.len()) };
    let n = usize::try_from(n).map_err(|_| io::Error::last_os_error())?;
    // SAFETY: read(2) initialised the first `n` bytes of the spare capacity.
    unsafe { buf.set_len(n) };
    Ok(n)
}

/// `mount(2)`.
pub fn mount(
    source: &str,
    target: &str,
    fstype: Option<&str>,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> io::Result<()> {
    let source = cstring(source)?;
    let target = cstring(target)?;
    let fstype = fstype.map(cstring).transpose()?;
    let data = data.map(cstring).transpose()?;
    // SAFETY: every pointer is either null (allowed by mount(2) for fstype
    // and data) or points into a CString that outlives the call.
    let ret = unsafe {
        libc::mount(
            source.as_ptr(),
            target.as_ptr(),
            fstype.as_ref().map_or(std::ptr::null(), |s| s.as_ptr()),
            flags,
            data.as_ref()
                .map_or(std::ptr::null(), |s| s.as_ptr().cast::<libc::c_void>()),
        )
    };
    check(ret).map(drop)
}

/// `finit_module(2)` with no parameters.
pub fn finit_module(module: &File) -> io::Result<()> {
    let params = c"";
    // SAFETY: the fd is open for the duration of the call (borrowed from
    // `module`) and `params` is a static NUL-terminated string.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_finit_module,
            module.as_raw_fd(),
            params.as_ptr(),
            0 as libc::c_int,
        )
    };
    if ret == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// `sethostname(2)`.
pub fn sethostname(name: &str) -> io::Result<()> {
    // SAFETY: the pointer and length describe `name`'s bytes, which are
    // valid for the duration of the call; the kernel copies them.
    check(unsafe { libc::sethostname(name.as_ptr().cast(), name.len()) }).map(drop)
}

/// `sync(2)`.
pub fn sync() {
    // SAFETY: sync takes no arguments and cannot fail.
    unsafe { libc::sync() }
}

/// `reboot(RB_POWER_OFF)`. Returns only on failure.
pub fn power_off() -> io::Error {
    // SAFETY: reboot with a valid command constant; it either stops the
    // machine or fails with errno set (e.g. EPERM outside PID 1's rights).
    unsafe { libc::reboot(libc::RB_POWER_OFF) };
    io::Error::last_os_error()
}

/// Makes this process the reaper of its orphaned descendants (what PID 1
/// is anyway), so `serve` mode exercises the same reaping paths.
pub fn set_child_subreaper() -> io::Result<()> {
    // SAFETY: PR_SET_CHILD_SUBREAPER takes one integer argument and
    // touches no memory of ours.
    check(unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1 as libc::c_ulong) }).map(drop)
}

/// `dup2(from, to)`.
pub fn dup2(from: &impl AsRawFd, to: RawFd) -> io::Result<()> {
    // SAFETY: `from` is an open fd borrowed for the call; replacing `to`
    // (0, 1 or 2 here) is the intent, and nothing in the agent holds an
    // owned handle to those descriptors.
    check(unsafe { libc::dup2(from.as_raw_fd(), to) }).map(drop)
}

/// Raises a pipe's capacity (`F_SETPIPE_SZ`); best effort.
pub fn set_pipe_size(pipe: &impl AsRawFd, size: usize) -> io::Result<()> {
    let size = libc::c_int::try_from(size)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "pipe size too large"))?;
    // SAFETY: F_SETPIPE_SZ on a borrowed, open pipe fd; no memory passed.
    check(unsafe { libc::fcntl(pipe.as_raw_fd(), libc::F_SETPIPE_SZ, size) }).map(drop)
}

/// Makes the command the leader of a new session (and so of a new process
/// group whose id is its pid), so that `kill_group` reaches everything it
/// starts.
pub fn spawn_in_new_session(cmd: &mut Command) {
    // SAFETY: the closure runs between fork and exec in the child, where
    // only async-signal-safe calls are allowed: setsid is one, and the
    // closure neither allocates nor takes locks.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() == -1 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// `kill(-pgid, sig)`: signals a whole process group.
pub fn kill_group(pgid: u32, sig: libc::c_int) -> io::Result<()> {
    let pgid = libc::pid_t::try_from(pgid)
        .ok()
        .filter(|p| *p > 1)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "bad process group id"))?;
    // SAFETY: kill takes plain integers; the negative pid addresses the
    // group we created with setsid (pgid > 1, so never "all processes").
    check(unsafe { libc::kill(-pgid, sig) }).map(drop)
}

/// How a reaped process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitStatus {
    Exited(i32),
    Signaled(i32),
}

/// Blocks until some child has exited and returns its pid *without*
/// reaping it (`waitid(P_ALL, WEXITED | WNOWAIT)`).
pub fn wait_any_exited() -> io::Result<u32> {
    // SAFETY: siginfo_t is plain old data; all-zero is a valid value.
    let mut info: libc::siginfo_t = unsafe { mem::zeroed() };
    // SAFETY: `info` is a valid, writable siginfo_t for the kernel to fill.
    check(unsafe { libc::waitid(libc::P_ALL, 0, &mut info, libc::WEXITED | libc::WNOWAIT) })?;
    // SAFETY: after a successful waitid with WEXITED, si_pid is the
    // field the kernel filled in for a SIGCHLD-style siginfo.
    let pid = unsafe { info.si_pid() };
    u32::try_from(pid).map_err(|_| io::Error::other("waitid returned a negative pid"))
}

/// Reaps `pid` if it is a zombie: `Ok(None)` if it is not (yet) or no
/// longer our child.
pub fn reap(pid: u32) -> io::Result<Option<WaitStatus>> {
    let pid = libc::pid_t::try_from(pid)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "bad pid"))?;
    let mut status: libc::c_int = 0;
    // SAFETY: `status` is a valid writable int for the kernel.
    let ret = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
    if ret == -1 {
        let e = io::Error::last_os_error();
        return if e.raw_os_error() == Some(libc::ECHILD) {
            Ok(None)
        } else {
            Err(e)
        };
    }
    if ret == 0 {
        return Ok(None);
    }
    if libc::WIFEXITED(status) {
        Ok(Some(WaitStatus::Exited(libc::WEXITSTATUS(status))))
    } else if libc::WIFSIGNALED(status) {
        Ok(Some(WaitStatus::Signaled(libc::WTERMSIG(status))))
    } else {
        Ok(None)
    }
}

/// Whether the peer of a connected stream socket has closed or shut down
/// its write side (`POLLRDHUP`), without consuming any data.
pub fn peer_hung_up(sock: &impl AsRawFd) -> bool {
    let mut pfd = libc::pollfd {
        fd: sock.as_raw_fd(),
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: one valid pollfd, count 1, zero timeout; the fd is borrowed
    // open for the duration of the call.
    let ret = unsafe { libc::poll(&mut pfd, 1, 0) };
    ret > 0 && pfd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
}

/// A listening `AF_VSOCK` stream socket on `port`, any CID.
pub fn vsock_listen(port: u32) -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2) call; the returned fd is checked and then
    // owned exactly once.
    let fd =
        check(unsafe { libc::socket(libc::AF_VSOCK, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) })?;
    // SAFETY: `fd` was just returned by socket(2) and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: sockaddr_vm is plain old data; all-zero is valid.
    let mut addr: libc::sockaddr_vm = unsafe { mem::zeroed() };
    addr.svm_family = libc::AF_VSOCK as libc::sa_family_t;
    addr.svm_port = port;
    addr.svm_cid = libc::VMADDR_CID_ANY;
    // SAFETY: the pointer and length describe `addr`, a valid sockaddr_vm
    // that outlives the call.
    check(unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&addr as *const libc::sockaddr_vm).cast(),
            mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t,
        )
    })?;
    // SAFETY: listen on a bound socket fd we own.
    check(unsafe { libc::listen(fd.as_raw_fd(), 128) })?;
    Ok(fd)
}

/// Accepts one connection on a listening socket (any family).
pub fn accept(listener: &OwnedFd) -> io::Result<OwnedFd> {
    loop {
        // SAFETY: null address pointers are allowed by accept4(2) when the
        // peer address is not wanted.
        let ret = unsafe {
            libc::accept4(
                listener.as_raw_fd(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                libc::SOCK_CLOEXEC,
            )
        };
        match check(ret) {
            // SAFETY: accept4 returned a fresh fd that nothing else owns.
            Ok(fd) => return Ok(unsafe { OwnedFd::from_raw_fd(fd) }),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
}

/// Sets `IFF_UP` on a network interface (used for `lo`).
pub fn interface_up(name: &str) -> io::Result<()> {
    // SAFETY: plain socket(2) call; the fd is checked and owned once.
    let fd =
        check(unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) })?;
    // SAFETY: fresh fd from socket(2), owned by nobody else.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: ifreq is plain old data; all-zero is valid.
    let mut req: libc::ifreq = unsafe { mem::zeroed() };
    let bytes = name.as_bytes();
    if bytes.len() >= req.ifr_name.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "interface name too long",
        ));
    }
    for (dst, src) in req.ifr_name.iter_mut().zip(bytes) {
        *dst = *src as libc::c_char;
    }
    // SAFETY: SIOCGIFFLAGS reads the NUL-terminated name from `req` and
    // writes the flags into it; `req` is valid and writable.
    check(unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) })?;
    // SAFETY: after SIOCGIFFLAGS the union holds the flags member.
    unsafe { req.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short };
    // SAFETY: SIOCSIFFLAGS reads `req`, valid for the call.
    check(unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) })?;
    Ok(())
}

/// `clock_settime(CLOCK_REALTIME)` to `unix_time_ns`.
pub fn set_realtime(unix_time_ns: u64) -> io::Result<()> {
    let ts = libc::timespec {
        tv_sec: libc::time_t::try_from(unix_time_ns / 1_000_000_000)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "time out of range"))?,
        tv_nsec: (unix_time_ns % 1_000_000_000) as libc::c_long,
    };
    // SAFETY: `ts` is a valid timespec that outlives the call; the kernel
    // only reads it.
    check(unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &ts) }).map(drop)
}

/// `_IOW('R', 0x03, int[2])` from `<linux/random.h>`.
const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;
/// `_IO('R', 0x07)` from `<linux/random.h>`.
const RNDRESEEDCRNG: libc::c_ulong = 0x5207;

/// Mixes `bytes` into the kernel's input pool crediting all their bits
/// (`RNDADDENTROPY`), then forces the CRNG to reseed from it
/// (`RNDRESEEDCRNG`). Needs CAP_SYS_ADMIN.
pub fn add_entropy_and_reseed(bytes: &[u8]) -> io::Result<()> {
    let random = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/urandom")?;
    let len = libc::c_int::try_from(bytes.len())
        .ok()
        .filter(|l| *l <= 1 << 20)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "too much entropy"))?;
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
    // built in u32 words so the header is aligned.
    let mut words = vec![0u32; 2 + bytes.len().div_ceil(4)];
    words[0] = (len * 8) as u32;
    words[1] = len as u32;
    for (i, chunk) in bytes.chunks(4).enumerate() {
        let mut w = [0u8; 4];
        w[..chunk.len()].copy_from_slice(chunk);
        words[2 + i] = u32::from_ne_bytes(w);
    }
    // SAFETY: `words` is a rand_pool_info whose buf_size (`len`) matches
    // the bytes that follow the header; it outlives the call and the
    // kernel only reads it. The fd is borrowed open from `random`.
    check(unsafe { libc::ioctl(random.as_raw_fd(), RNDADDENTROPY, words.as_ptr()) })?;
    // SAFETY: RNDRESEEDCRNG takes no argument.
    check(unsafe { libc::ioctl(random.as_raw_fd(), RNDRESEEDCRNG) })?;
    Ok(())
}

/// An AF_INET socket for interface and route ioctls.
fn inet_socket() -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2) call; the fd is checked and owned once.
    let fd =
        check(unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) })?;
    // SAFETY: fresh fd from socket(2), owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `addr` as a `struct sockaddr` (AF_INET, port 0).
fn sockaddr_v4(addr: std::net::Ipv4Addr) -> libc::sockaddr {
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from_ne_bytes(addr.octets()),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: sockaddr_in and sockaddr are both 16-byte plain-old-data
    // structs; the kernel reads this as the sockaddr_in it is.
    unsafe { mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) }
}

fn ifreq_for(name: &str) -> io::Result<libc::ifreq> {
    // SAFETY: ifreq is plain old data; all-zero is valid.
    let mut req: libc::ifreq = unsafe { mem::zeroed() };
    let bytes = name.as_bytes();
    if bytes.len() >= req.ifr_name.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "interface name too long",
        ));
    }
    for (dst, src) in req.ifr_name.iter_mut().zip(bytes) {
        *dst = *src as libc::c_char;
    }
    Ok(req)
}

/// Gives interface `name` the address `addr/prefix` (SIOCSIFADDR,
/// SIOCSIFNETMASK).
pub fn set_ipv4(name: &str, addr: std::net::Ipv4Addr, prefix: u8) -> io::Result<()> {
    let sock = inet_socket()?;
    let mut req = ifreq_for(name)?;
    req.ifr_ifru.ifru_addr = sockaddr_v4(addr);
    // SAFETY: SIOCSIFADDR reads the name and the address from `req`,
    // which is valid for the call.
    check(unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFADDR, &req) })?;
    let mask = u32::MAX
        .checked_shl(32 - u32::from(prefix.min(32)))
        .unwrap_or(0);
    req.ifr_ifru.ifru_netmask = sockaddr_v4(std::net::Ipv4Addr::from(mask));
    // SAFETY: as above, with the netmask member set.
    check(unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFNETMASK, &req) })?;
    Ok(())
}

/// `struct rtentry` from `<linux/route.h>` (libc has none for glibc).
#[repr(C)]
struct RtEntry {
    rt_pad1: libc::c_ulong,
    rt_dst: libc::sockaddr,
    rt_gateway: libc::sockaddr,
    rt_genmask: libc::sockaddr,
    rt_flags: libc::c_ushort,
    rt_pad2: libc::c_short,
    rt_pad3: libc::c_ulong,
    rt_pad4: *mut libc::c_void,
    rt_metric: libc::c_short,
    rt_dev: *mut libc::c_char,
    rt_mtu: libc::c_ulong,
    rt_window: libc::c_ulong,
    rt_irtt: libc::c_ushort,
}

const RTF_UP: libc::c_ushort = 0x0001;
const RTF_GATEWAY: libc::c_ushort = 0x0002;

/// Adds the default IPv4 route via `gateway` (SIOCADDRT).
pub fn add_default_route(gateway: std::net::Ipv4Addr) -> io::Result<()> {
    let sock = inet_socket()?;
    let any = sockaddr_v4(std::net::Ipv4Addr::UNSPECIFIED);
    let rt = RtEntry {
        rt_pad1: 0,
        rt_dst: any,
        rt_gateway: sockaddr_v4(gateway),
        rt_genmask: any,
        rt_flags: RTF_UP | RTF_GATEWAY,
        rt_pad2: 0,
        rt_pad3: 0,
        rt_pad4: std::ptr::null_mut(),
        rt_metric: 0,
        rt_dev: std::ptr::null_mut(),
        rt_mtu: 0,
        rt_window: 0,
        rt_irtt: 0,
    };
    // SAFETY: SIOCADDRT reads a `struct rtentry`, which `RtEntry` lays out
    // exactly (repr(C)); null `rt_dev` lets the kernel pick the interface
    // by the gateway's subnet. `rt` outlives the call.
    check(unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCADDRT, &rt) })?;
    Ok(())
}
