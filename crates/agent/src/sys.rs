//! Every syscall the agent makes: the only module with `unsafe`.
//!
//! Where `rustix` has a safe call for it, the wrapper is that call. What
//! remains on raw `libc` (each with its `SAFETY` comment) is what rustix
//! does not offer safely: `finit_module`, `waitid` that reports the pid
//! without reaping, `kill` with any signal number (real-time ones
//! included), binding an `AF_VSOCK` address, the interface, route and
//! entropy ioctls, and the `pre_exec` hook. Those wrappers take Rust types,
//! convert them to C ones that live across the call, and turn `-1` into
//! `io::Error::last_os_error()`.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::mem;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;

pub use rustix::mount::MountFlags;
use rustix::net::{AddressFamily, SocketFlags, SocketType};
use rustix::process::{Pid, WaitOptions};

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
    Ok(rustix::io::read(fd, rustix::buffer::spare_capacity(buf))?)
}

/// Clears `O_NONBLOCK` on an open file.
pub fn set_blocking(fd: BorrowedFd<'_>) -> io::Result<()> {
    let flags = rustix::fs::fcntl_getfl(fd)?;
    rustix::fs::fcntl_setfl(fd, flags - rustix::fs::OFlags::NONBLOCK)?;
    Ok(())
}

/// `mount(2)` of a file system.
pub fn mount(
    source: &str,
    target: &str,
    fstype: &str,
    flags: MountFlags,
    data: Option<&str>,
) -> io::Result<()> {
    let data = data.map(cstring).transpose()?;
    Ok(rustix::mount::mount(
        source,
        target,
        fstype,
        flags,
        data.as_deref(),
    )?)
}

/// `mount(2)` with `MS_MOVE`: moves the mount at `source` to `target`.
pub fn mount_move(source: &str, target: &str) -> io::Result<()> {
    Ok(rustix::mount::mount_move(source, target)?)
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
/// Sets or clears a file's immutable attribute (`chattr +i`): an
/// immutable file cannot be written, renamed, removed or linked to, and an
/// immutable directory's entries cannot change, by any user without
/// `CAP_LINUX_IMMUTABLE`. Returns whether it was set before.
pub fn set_immutable(file: &File, on: bool) -> io::Result<bool> {
    use rustix::fs::IFlags;
    let flags = rustix::fs::ioctl_getflags(file)?;
    let was = flags.contains(IFlags::IMMUTABLE);
    if was != on {
        rustix::fs::ioctl_setflags(file, flags ^ IFlags::IMMUTABLE)?;
    }
    Ok(was)
}

/// Mounts `path` on itself, then makes that mount read-only: nothing under
/// it can be written, and it cannot be renamed or removed (`EBUSY`), by any
/// user, until it is unmounted (`CAP_SYS_ADMIN`).
pub fn bind_read_only(path: &Path) -> io::Result<()> {
    rustix::mount::mount_bind(path, path)?;
    rustix::mount::mount_remount(path, MountFlags::BIND | MountFlags::RDONLY, "")?;
    Ok(())
}

/// Detaches the mount at `path`, if there is one.
pub fn unmount_detached(path: &Path) -> io::Result<()> {
    Ok(rustix::mount::unmount(
        path,
        rustix::mount::UnmountFlags::DETACH,
    )?)
}

pub fn sethostname(name: &str) -> io::Result<()> {
    Ok(rustix::system::sethostname(name.as_bytes())?)
}

/// `sync(2)`.
pub fn sync() {
    rustix::fs::sync();
}

/// `reboot(RB_POWER_OFF)`. Returns only on failure (e.g. EPERM outside
/// PID 1's rights).
pub fn power_off() -> io::Error {
    match rustix::system::reboot(rustix::system::RebootCommand::PowerOff) {
        Ok(()) => io::Error::other("reboot(RB_POWER_OFF) returned"),
        Err(e) => e.into(),
    }
}

/// Makes this process the reaper of its orphaned descendants (what PID 1
/// is anyway), so `serve` mode exercises the same reaping paths.
pub fn set_child_subreaper() -> io::Result<()> {
    Ok(rustix::process::set_child_subreaper(Some(
        rustix::process::getpid(),
    ))?)
}

/// Gives the calling thread (only: Linux keeps credentials per thread)
/// and the threads it starts `uid` and `gid` as real, effective and saved
/// ids, and no supplementary groups. For a uid other than 0 that also
/// clears the thread's capabilities: from then on the kernel checks every
/// file it touches as that user's, and there is no way back to root.
pub fn become_user_on_this_thread(uid: u32, gid: u32) -> io::Result<()> {
    use rustix::process::{Gid, Uid};
    let (uid, gid) = (Uid::from_raw(uid), Gid::from_raw(gid));
    rustix::thread::set_thread_groups(&[])?;
    rustix::thread::set_thread_res_gid(gid, gid, gid)?;
    rustix::thread::set_thread_res_uid(uid, uid, uid)?;
    Ok(())
}

/// `geteuid(2)`.
pub fn effective_uid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// Makes `to` this process's stdin, stdout and stderr (each tried even if
/// another fails; the first error is returned).
pub fn set_stdio(to: &impl AsFd) -> io::Result<()> {
    let stdin = rustix::stdio::dup2_stdin(to);
    let stdout = rustix::stdio::dup2_stdout(to);
    let stderr = rustix::stdio::dup2_stderr(to);
    Ok(stdin.and(stdout).and(stderr)?)
}

/// Raises a pipe's capacity (`F_SETPIPE_SZ`); best effort.
pub fn set_pipe_size(pipe: &impl AsFd, size: usize) -> io::Result<()> {
    rustix::pipe::fcntl_setpipe_size(pipe, size)?;
    Ok(())
}

/// What a command's child does between fork and exec, in this order:
/// lead a new session (and so a new process group whose id is its pid,
/// which `kill_group` reaches); join a cgroup (`cgroup_procs`: its open
/// `cgroup.procs`); become `user` (uid, gid: real, effective and saved;
/// the supplementary groups given, those `/etc/group` lists the user in;
/// no capabilities); change to `cwd`. Joining
/// comes before the change of user, which could not write the cgroup's
/// file, and the change of directory after it, so that the kernel checks
/// the directory as the user's.
pub fn prepare_child(
    cmd: &mut Command,
    cgroup_procs: Option<RawFd>,
    user: Option<(u32, u32, Vec<u32>)>,
    cwd: CString,
) {
    use rustix::process::{Gid, Uid};
    // Made here, before the fork: the child only passes it to the kernel.
    let user = user.map(|(uid, gid, groups)| {
        let groups: Vec<Gid> = groups.into_iter().map(Gid::from_raw).collect();
        (Uid::from_raw(uid), Gid::from_raw(gid), groups)
    });
    // SAFETY: the closure runs between fork and exec in the child, where
    // only async-signal-safe calls are allowed: each rustix call is the
    // bare system call, and the closure neither allocates nor takes locks
    // (its errors convert to `io::Error`s that hold only the errno). The
    // child has one thread, so the thread's credentials are the process's.
    // `cgroup_procs` stays open in the parent until `spawn` returns.
    unsafe {
        cmd.pre_exec(move || {
            rustix::process::setsid()?;
            if let Some(fd) = cgroup_procs {
                rustix::io::write(BorrowedFd::borrow_raw(fd), b"0")?;
            }
            if let Some((uid, gid, groups)) = &user {
                let (uid, gid) = (*uid, *gid);
                rustix::thread::set_thread_groups(groups)?;
                rustix::thread::set_thread_res_gid(gid, gid, gid)?;
                rustix::thread::set_thread_res_uid(uid, uid, uid)?;
            }
            rustix::process::chdir(cwd.as_c_str())?;
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
    let pid = i32::try_from(pid)
        .ok()
        .and_then(Pid::from_raw)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "bad pid"))?;
    let status = match rustix::process::waitpid(Some(pid), WaitOptions::NOHANG) {
        Ok(Some((_, status))) => status,
        Ok(None) | Err(rustix::io::Errno::CHILD) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    if let Some(code) = status.exit_status() {
        Ok(Some(WaitStatus::Exited(code)))
    } else if let Some(signal) = status.terminating_signal() {
        Ok(Some(WaitStatus::Signaled(signal)))
    } else {
        Ok(None)
    }
}

/// Whether the peer of a connected stream socket has closed or shut down
/// its write side (`POLLRDHUP`), without consuming any data.
pub fn peer_hung_up(sock: &impl AsFd) -> bool {
    use rustix::event::{PollFd, PollFlags};
    let mut pfd = [PollFd::new(sock, PollFlags::RDHUP)];
    let zero = rustix::time::Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    let ready = rustix::event::poll(&mut pfd, Some(&zero)).unwrap_or(0);
    ready > 0
        && pfd[0]
            .revents()
            .intersects(PollFlags::RDHUP | PollFlags::HUP | PollFlags::ERR)
}

/// A listening `AF_VSOCK` stream socket on `port`, any CID.
pub fn vsock_listen(port: u32) -> io::Result<OwnedFd> {
    let fd = rustix::net::socket_with(
        AddressFamily::VSOCK,
        SocketType::STREAM,
        SocketFlags::CLOEXEC,
        None,
    )?;
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
    rustix::net::listen(&fd, 128)?;
    Ok(fd)
}

/// Accepts one connection on a listening socket (any family).
pub fn accept(listener: &OwnedFd) -> io::Result<OwnedFd> {
    loop {
        match rustix::net::accept_with(listener, SocketFlags::CLOEXEC) {
            Ok(fd) => return Ok(fd),
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// Sets `IFF_UP` on a network interface (used for `lo`).
pub fn interface_up(name: &str) -> io::Result<()> {
    let sock = inet_socket()?;
    let mut req = ifreq_for(name)?;
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
    let ts = rustix::time::Timespec {
        tv_sec: i64::try_from(unix_time_ns / 1_000_000_000)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "time out of range"))?,
        // Below 10^9: fits.
        tv_nsec: (unix_time_ns % 1_000_000_000) as _,
    };
    Ok(rustix::time::clock_settime(
        rustix::time::ClockId::Realtime,
        ts,
    )?)
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
    Ok(rustix::net::socket_with(
        AddressFamily::INET,
        SocketType::DGRAM,
        SocketFlags::CLOEXEC,
        None,
    )?)
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

/// `TUNSETIFF` from `<linux/if_tun.h>`.
const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const IFF_TAP: libc::c_short = 0x0002;
const IFF_NO_PI: libc::c_short = 0x1000;

/// A TAP device named `name`, Ethernet frames without a packet header:
/// what is written to the descriptor arrives on the interface, what the
/// interface sends is read from it.
pub fn open_tap(name: &str) -> io::Result<OwnedFd> {
    let tun = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")?;
    let mut req = ifreq_for(name)?;
    req.ifr_ifru.ifru_flags = IFF_TAP | IFF_NO_PI;
    // SAFETY: TUNSETIFF reads the name and the flags from `req`, valid for
    // the call, and attaches the descriptor to that interface.
    check(unsafe { libc::ioctl(tun.as_raw_fd(), TUNSETIFF, &req) })?;
    Ok(OwnedFd::from(tun))
}

/// The index of interface `name` (`if_nametoindex(3)`).
pub fn interface_index(name: &str) -> io::Result<u32> {
    let name = cstring(name)?;
    // SAFETY: `name` is a NUL-terminated string that outlives the call.
    match unsafe { libc::if_nametoindex(name.as_ptr()) } {
        0 => Err(io::Error::last_os_error()),
        i => Ok(i),
    }
}
