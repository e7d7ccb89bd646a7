//! What a VMM process gives up before its guest runs: privileges it never
//! needs again (capabilities, set-uid gains, being traced or dumped, core
//! files), and every system call outside what each of its threads uses,
//! through one seccomp filter per thread kind.
//!
//! The order matters and is fixed here:
//! 1. [`drop_privileges`], once, in `main`, while the process has one
//!    thread and after it left the host's network namespace (the only step
//!    that needs `CAP_SYS_ADMIN`): threads and fork children inherit it.
//! 2. [`become_user`], with `--run-as`, once the VM is built and before
//!    its first vCPU thread starts: the daemon's user (root) for the
//!    VMM's own, the last two capabilities gone with it.
//! 3. [`confine_vcpu_thread`] at the start of each vCPU thread.
//! 4. [`confine_main_thread`] when the VM is built and about to run: the
//!    event loop, the control server and the fork path stay on this thread,
//!    and a fork child (whose only thread is this one) inherits the filter,
//!    so it is installed once per process tree, never stacked again.
//!
//! A system call a filter refuses is trapped: [`on_sigsys`] writes which
//! one and on which thread kind to stderr and the serial log (what the
//! host reads of a lost VM), then the process dies of `SIGSYS`. A refused
//! call never runs, whatever a compromised process does with the signal.
//!
//! Only the `forkbox-vmm` binary calls [`enable`]; a library user (the unit
//! tests) runs unconfined.

use std::collections::BTreeMap;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen as Len, SeccompCmpOp as Op, SeccompCondition,
    SeccompFilter, SeccompRule,
};

/// Why confining a thread failed (the VMM then does not run its guest).
#[derive(Debug, thiserror::Error)]
pub enum LockdownError {
    #[error("cannot build the {0} thread's seccomp filter")]
    Build(&'static str, #[source] seccompiler::BackendError),
    #[error("cannot install the {0} thread's seccomp filter")]
    Install(&'static str, #[source] seccompiler::Error),
    #[error("cannot install the SIGSYS handler")]
    Handler(#[source] std::io::Error),
    #[error("cannot {0}")]
    Privileges(&'static str, #[source] std::io::Error),
}

static ENABLED: AtomicBool = AtomicBool::new(false);
static HOST_NETWORK: AtomicBool = AtomicBool::new(false);
static MAIN_CONFINED: AtomicBool = AtomicBool::new(false);
/// The serial log's descriptor, where [`on_sigsys`] also reports.
static SERIAL_LOG_FD: AtomicI32 = AtomicI32::new(-1);

/// The test hook that makes a confined thread try a forbidden call.
const TEST_SYSCALL_ENV: &str = "FORKBOX_VMM_TEST_FORBIDDEN_SYSCALL";

/// Confines this process's threads as they start. `host_network`: the
/// VM's network connects out itself (no broker), so its main thread may
/// open internet sockets.
pub fn enable(host_network: bool) {
    HOST_NETWORK.store(host_network, Ordering::SeqCst);
    ENABLED.store(true, Ordering::SeqCst);
}

fn enabled() -> bool {
    ENABLED.load(Ordering::SeqCst)
}

/// Tells the SIGSYS handler where the serial log is (`-1`: none).
pub(crate) fn note_serial_log(fd: RawFd) {
    SERIAL_LOG_FD.store(fd, Ordering::SeqCst);
}

/// Appends `bytes` to the serial log (the descriptor [`note_serial_log`]
/// named; the log is opened to append).
pub(crate) fn append_to_serial_log(bytes: &[u8]) -> std::io::Result<()> {
    let fd = SERIAL_LOG_FD.load(Ordering::SeqCst);
    if fd < 0 {
        return Err(std::io::Error::other("no serial log is open"));
    }
    // SAFETY: the serial output owns this descriptor for the life of the
    // VM, which outlives this call (made while the VM ends).
    let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    let mut rest = bytes;
    while !rest.is_empty() {
        match rustix::io::write(fd, rest) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => rest = &rest[n..],
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// No capabilities (effective, permitted, inheritable, ambient, bounding),
/// no privileges gained through exec (`no_new_privs`), not dumpable (no
/// `ptrace` attach or `/proc/PID/mem` by a process of the same user, a
/// sibling VMM included), no core files, and the rest of [`LIMITS`]. Call
/// while single-threaded.
///
/// With `run_as`, `CAP_SETUID` and `CAP_SETGID` stay (effective and
/// permitted, nothing else) until [`become_user`] spends them: the VMM
/// opens what it boots from as the daemon's user, then becomes its own
/// before its guest runs.
pub fn drop_privileges(run_as: Option<(u32, u32)>) -> Result<(), LockdownError> {
    use rustix::thread::{self, CapabilitySet, CapabilitySets};
    let io = |what| move |e: rustix::io::Errno| LockdownError::Privileges(what, e.into());
    // The bounding set first: dropping from it needs CAP_SETPCAP, which the
    // capset below takes away. EINVAL ends the kernel's list; EPERM means
    // we never had CAP_SETPCAP (not root), and then nothing to drop.
    for cap in 0..64 {
        // SAFETY: PR_CAPBSET_DROP takes an integer and changes only this
        // process's bounding set.
        let rc = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) };
        if rc < 0 {
            match std::io::Error::last_os_error().raw_os_error() {
                Some(libc::EINVAL) | Some(libc::EPERM) => break,
                _ => {
                    return Err(LockdownError::Privileges(
                        "drop a capability from the bounding set",
                        std::io::Error::last_os_error(),
                    ))
                }
            }
        }
    }
    thread::clear_ambient_capability_set().map_err(io("clear the ambient capabilities"))?;
    let kept = match run_as {
        Some(user) => {
            let _ = RUN_AS.set(user);
            CapabilitySet::SETUID | CapabilitySet::SETGID
        }
        None => CapabilitySet::empty(),
    };
    thread::set_capabilities(
        None,
        CapabilitySets {
            effective: kept,
            permitted: kept,
            inheritable: CapabilitySet::empty(),
        },
    )
    .map_err(io("drop every capability"))?;
    thread::set_no_new_privs(true).map_err(io("set no_new_privs"))?;
    not_dumpable()?;
    for (resource, limit, what) in LIMITS {
        let both = rustix::process::Rlimit {
            current: Some(limit),
            maximum: Some(limit),
        };
        rustix::process::setrlimit(resource, both).map_err(io(what))?;
    }
    Ok(())
}

/// The resource limits [`drop_privileges`] sets, soft and hard alike (so a
/// VMM its guest took over cannot raise them again), with what each stops.
pub const LIMITS: [(rustix::process::Resource, u64, &str); 4] = {
    use rustix::process::Resource;
    [
        // No core file: it would be the guest's memory on the host's disk.
        (Resource::Core, 0, "forbid core files"),
        // A VMM holds its VM's descriptors, at most
        // `vsock::MAX_CONNECTIONS` host streams and its control clients:
        // well under this, which bounds what a runaway one can hold.
        (Resource::Nofile, MAX_OPEN_FILES, "bound its open files"),
        // Nothing of a VMM's is locked in memory, and no POSIX message
        // queue is its.
        (Resource::Memlock, 0, "forbid locked memory"),
        (Resource::Msgqueue, 0, "forbid message queues"),
    ]
};

/// `RLIMIT_NOFILE` of a VMM and its fork children.
pub const MAX_OPEN_FILES: u64 = 4096;

fn not_dumpable() -> Result<(), LockdownError> {
    rustix::process::set_dumpable_behavior(rustix::process::DumpableBehavior::NotDumpable)
        .map_err(|e| LockdownError::Privileges("make the process not dumpable", e.into()))
}

/// The user [`drop_privileges`] was told to become (`--run-as`).
static RUN_AS: std::sync::OnceLock<(u32, u32)> = std::sync::OnceLock::new();
/// [`become_user`] is done (a fork child inherits it done).
static BECAME: AtomicBool = AtomicBool::new(false);

/// Becomes the `--run-as` user and group, with no supplementary groups,
/// as real, effective and saved ids: the kernel then clears the last two
/// capabilities, and the VMM can open, connect to or signal only what
/// that user may. Call while single-threaded (the ids are per thread to
/// the kernel), before the first vCPU runs. A no-op without `--run-as`,
/// and after the first call in a process tree.
pub fn become_user() -> Result<(), LockdownError> {
    let Some(&(uid, gid)) = RUN_AS.get() else {
        return Ok(());
    };
    if BECAME.swap(true, Ordering::SeqCst) {
        return Ok(());
    }
    crate::memory::keep_pagemap();
    let last = || std::io::Error::last_os_error();
    // SAFETY: setgroups reads no memory with a count of 0; setresgid and
    // setresuid take integers. The C library applies each to every thread
    // (there is one).
    unsafe {
        if libc::setgroups(0, std::ptr::null()) != 0 {
            return Err(LockdownError::Privileges(
                "drop the supplementary groups",
                last(),
            ));
        }
        if libc::setresgid(gid, gid, gid) != 0 {
            return Err(LockdownError::Privileges("become the VMM's group", last()));
        }
        if libc::setresuid(uid, uid, uid) != 0 {
            return Err(LockdownError::Privileges("become the VMM's user", last()));
        }
    }
    // Changing user makes the process dumpable again.
    not_dumpable()?;
    let caps = rustix::thread::capabilities(None)
        .map_err(|e| LockdownError::Privileges("read the capabilities", e.into()))?;
    if !(caps.effective.is_empty() && caps.permitted.is_empty()) {
        return Err(LockdownError::Privileges(
            "give up CAP_SETUID and CAP_SETGID",
            std::io::Error::other(format!("{caps:?} left after changing user")),
        ));
    }
    Ok(())
}

/// Installs the main thread's filter, once per process tree (a fork child
/// has it already). A no-op unless [`enable`]d.
pub(crate) fn confine_main_thread() -> Result<(), LockdownError> {
    if !enabled() || MAIN_CONFINED.swap(true, Ordering::SeqCst) {
        return Ok(());
    }
    KIND.with(|k| k.set(Kind::Main));
    install_handler()?;
    let allowed = main_rules(HOST_NETWORK.load(Ordering::SeqCst));
    install("main", allowed)?;
    test_forbidden_syscall("main");
    Ok(())
}

/// Installs a vCPU thread's filter on the calling thread. A no-op unless
/// [`enable`]d.
pub(crate) fn confine_vcpu_thread(id: u8) -> Result<(), LockdownError> {
    if !enabled() {
        return Ok(());
    }
    KIND.with(|k| k.set(Kind::Vcpu));
    install_handler()?;
    install("vcpu", vcpu_rules())?;
    if id == 0 {
        test_forbidden_syscall("vcpu");
    }
    Ok(())
}

type Rules = BTreeMap<i64, Vec<SeccompRule>>;

/// Builds and installs on this thread the filters of [`programs`].
fn install(kind: &'static str, allowed: Rules) -> Result<(), LockdownError> {
    let progs = programs(kind, allowed)?;
    apply(kind, &progs)
}

/// A filter that answers `clone3` with `ENOSYS`, so that the C library
/// falls back to `clone`, whose flags a filter can read; then an
/// allowlist that traps everything else (installed last: installing a
/// filter takes `prctl` and `seccomp` calls the allowlist may refuse).
fn programs(kind: &'static str, allowed: Rules) -> Result<[BpfProgram; 2], LockdownError> {
    let arch = seccompiler::TargetArch::x86_64;
    let build = |rules, mismatch, matched| -> Result<BpfProgram, LockdownError> {
        SeccompFilter::new(rules, mismatch, matched, arch)
            .and_then(BpfProgram::try_from)
            .map_err(|e| LockdownError::Build(kind, e))
    };
    Ok([
        build(
            [(libc::SYS_clone3, vec![])].into_iter().collect(),
            SeccompAction::Allow,
            SeccompAction::Errno(libc::ENOSYS as u32),
        )?,
        build(allowed, SeccompAction::Trap, SeccompAction::Allow)?,
    ])
}

/// Installs `progs` on the calling thread (no allocation: safe after
/// `fork()` in a multi-threaded process).
fn apply(kind: &'static str, progs: &[BpfProgram; 2]) -> Result<(), LockdownError> {
    for prog in progs {
        seccompiler::apply_filter(prog).map_err(|e| LockdownError::Install(kind, e))?;
    }
    Ok(())
}

/// `arg` compared (as 64 bits) to `value`.
fn arg_is(arg: u8, value: u64) -> SeccompCondition {
    SeccompCondition::new(arg, Len::Qword, Op::Eq, value).expect("argument index below 6")
}

/// `arg` with none of `bits` set.
fn arg_lacks(arg: u8, bits: u64) -> SeccompCondition {
    SeccompCondition::new(arg, Len::Qword, Op::MaskedEq(bits), 0).expect("argument index below 6")
}

fn rule(conditions: Vec<SeccompCondition>) -> SeccompRule {
    SeccompRule::new(conditions).expect("a rule with conditions")
}

fn allow_all(rules: &mut Rules, syscalls: &[i64]) {
    for &nr in syscalls {
        rules.insert(nr, vec![]);
    }
}

/// What every thread does: memory, locks, clocks, its descriptors' I/O,
/// signals to end or to abort, KVM ioctls.
fn common_rules() -> Rules {
    let mut r = Rules::new();
    allow_all(
        &mut r,
        &[
            libc::SYS_read,
            libc::SYS_write,
            libc::SYS_readv,
            libc::SYS_writev,
            libc::SYS_pread64,
            libc::SYS_pwrite64,
            libc::SYS_preadv,
            libc::SYS_pwritev,
            libc::SYS_preadv2,
            libc::SYS_pwritev2,
            libc::SYS_lseek,
            libc::SYS_close,
            libc::SYS_fstat,
            libc::SYS_newfstatat,
            libc::SYS_statx,
            libc::SYS_mmap,
            libc::SYS_munmap,
            libc::SYS_mremap,
            libc::SYS_mprotect,
            libc::SYS_madvise,
            libc::SYS_brk,
            libc::SYS_futex,
            libc::SYS_sched_yield,
            libc::SYS_sched_getaffinity,
            libc::SYS_nanosleep,
            libc::SYS_clock_nanosleep,
            libc::SYS_clock_gettime,
            libc::SYS_gettimeofday,
            libc::SYS_getpid,
            libc::SYS_gettid,
            libc::SYS_getrandom,
            libc::SYS_rt_sigaction,
            libc::SYS_rt_sigprocmask,
            libc::SYS_rt_sigreturn,
            libc::SYS_sigaltstack,
            libc::SYS_restart_syscall,
            libc::SYS_exit,
            libc::SYS_exit_group,
            libc::SYS_epoll_ctl,
            libc::SYS_epoll_wait,
            libc::SYS_epoll_pwait,
            libc::SYS_poll,
            libc::SYS_ppoll,
            libc::SYS_timerfd_settime,
            libc::SYS_timerfd_gettime,
            libc::SYS_sendmsg,
            libc::SYS_recvmsg,
            libc::SYS_sendto,
            libc::SYS_recvfrom,
            libc::SYS_shutdown,
            libc::SYS_getsockopt,
            libc::SYS_setsockopt,
            libc::SYS_fcntl,
            libc::SYS_fsync,
            libc::SYS_fdatasync,
            // A writable disk's top: written-back pages let go of
            // (`forkbox_devices::virtio::overlay`).
            libc::SYS_fadvise64,
        ],
    );
    // KVM's ioctls (type 0xAE) and FIONBIO (non-blocking sockets).
    r.insert(
        libc::SYS_ioctl,
        vec![
            rule(vec![SeccompCondition::new(
                1,
                Len::Dword,
                Op::MaskedEq(0xff00),
                0xae00,
            )
            .expect("argument 1")]),
            rule(vec![arg_is(1, libc::FIONBIO)]),
        ],
    );
    // A thread aborting (a Rust panic in a release build aborts) signals
    // itself with SIGABRT; no other signal to any other process or thread.
    r.insert(
        libc::SYS_tgkill,
        vec![rule(vec![arg_is(2, libc::SIGABRT as u64)])],
    );
    r
}

/// A vCPU thread: the common calls (its exits' work: port and MMIO
/// writes, device activation and reset, which may touch a device's
/// sockets, timers and epoll sets but never create them).
fn vcpu_rules() -> Rules {
    common_rules()
}

/// The main thread: the common calls, plus what building a fork child
/// takes (a new KVM VM, its event sources and threads), the control
/// socket, snapshots, and waiting for fork children. Never a listening
/// socket of its own: its own and its fork children's are bound before
/// the filter (by itself, or by the fork's asker), so `bind` and
/// `listen` are refused (`bind` stays for a VM that connects out itself:
/// the host's resolver binds a netlink socket). Nor a name made, moved or
/// removed (`mkdir`, `rename`, `unlink`): a snapshot is written into
/// files its asker opened and names.
fn main_rules(host_network: bool) -> Rules {
    let mut r = common_rules();
    allow_all(
        &mut r,
        &[
            libc::SYS_openat,
            libc::SYS_copy_file_range,
            libc::SYS_sendfile,
            libc::SYS_splice,
            libc::SYS_ftruncate,
            libc::SYS_fallocate,
            libc::SYS_getdents64,
            libc::SYS_memfd_create,
            libc::SYS_eventfd2,
            libc::SYS_epoll_create1,
            libc::SYS_timerfd_create,
            libc::SYS_pipe2,
            libc::SYS_dup,
            libc::SYS_dup3,
            libc::SYS_close_range,
            libc::SYS_accept4,
            libc::SYS_connect,
            libc::SYS_getsockname,
            libc::SYS_getpeername,
            libc::SYS_socketpair,
            libc::SYS_wait4,
            libc::SYS_waitid,
            libc::SYS_pidfd_open,
            libc::SYS_set_robust_list,
            libc::SYS_rseq,
        ],
    );
    // Reading its own limits (the C library's getrlimit), never setting
    // them, nor another process's.
    r.insert(
        libc::SYS_prlimit64,
        vec![rule(vec![arg_is(0, 0), arg_is(2, 0)])],
    );
    // Sockets: unix ones always; internet ones only for a VM that
    // connects out itself.
    let mut families = vec![rule(vec![arg_is(0, libc::AF_UNIX as u64)])];
    if host_network {
        families.push(rule(vec![arg_is(0, libc::AF_INET as u64)]));
        families.push(rule(vec![arg_is(0, libc::AF_INET6 as u64)]));
        // The host's resolver asks the kernel for its addresses.
        families.push(rule(vec![arg_is(0, libc::AF_NETLINK as u64)]));
        r.insert(libc::SYS_bind, Vec::new());
    }
    r.insert(libc::SYS_socket, families);
    // `fork()` and new threads, never into new namespaces.
    let namespaces = (libc::CLONE_NEWNS
        | libc::CLONE_NEWUSER
        | libc::CLONE_NEWPID
        | libc::CLONE_NEWNET
        | libc::CLONE_NEWIPC
        | libc::CLONE_NEWUTS
        | libc::CLONE_NEWCGROUP) as u64;
    r.insert(libc::SYS_clone, vec![rule(vec![arg_lacks(0, namespaces)])]);
    r.insert(libc::SYS_clone3, vec![]);
    // Kicking a vCPU out of KVM_RUN, and aborting.
    r.insert(
        libc::SYS_tgkill,
        vec![
            rule(vec![arg_is(2, libc::SIGABRT as u64)]),
            rule(vec![arg_is(2, crate::vcpu::kick_signal() as u64)]),
        ],
    );
    // Naming a new thread (the C library's pthread_setname_np on itself),
    // and a fork child's new vCPU threads adding their own filters (which
    // can only take more away).
    r.insert(
        libc::SYS_prctl,
        vec![
            rule(vec![arg_is(0, libc::PR_SET_NAME as u64)]),
            rule(vec![
                arg_is(0, libc::PR_SET_NO_NEW_PRIVS as u64),
                arg_is(1, 1),
            ]),
        ],
    );
    r.insert(
        libc::SYS_seccomp,
        vec![rule(vec![arg_is(0, libc::SECCOMP_SET_MODE_FILTER as u64)])],
    );
    r
}

/// Which kind of thread this is, for the SIGSYS report.
#[derive(Clone, Copy)]
enum Kind {
    Unconfined,
    Main,
    Vcpu,
}

thread_local! {
    static KIND: std::cell::Cell<Kind> = const { std::cell::Cell::new(Kind::Unconfined) };
}

fn install_handler() -> Result<(), LockdownError> {
    static INSTALLED: AtomicBool = AtomicBool::new(false);
    if INSTALLED.swap(true, Ordering::SeqCst) {
        return Ok(());
    }
    // SAFETY: a zeroed sigaction is a valid "no flags, empty mask" value;
    // the handler is an `extern "C"` function that only makes
    // async-signal-safe calls (write, sigaction, the trapped syscall).
    let rc = unsafe {
        let mut act: libc::sigaction = std::mem::zeroed();
        act.sa_sigaction = on_sigsys as *const () as usize;
        act.sa_flags = libc::SA_SIGINFO;
        libc::sigaction(libc::SIGSYS, &act, std::ptr::null_mut())
    };
    if rc < 0 {
        INSTALLED.store(false, Ordering::SeqCst);
        return Err(LockdownError::Handler(std::io::Error::last_os_error()));
    }
    Ok(())
}

/// The SIGSYS handler: reports the refused call, then dies of it.
extern "C" fn on_sigsys(_sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // On x86_64 the SIGSYS part of siginfo_t holds the call's address (8
    // bytes) at offset 16, then its number (an int) at offset 24.
    // SAFETY: the kernel passes a valid siginfo_t for SA_SIGINFO handlers.
    let nr = unsafe { info.cast::<u8>().add(24).cast::<i32>().read_unaligned() };
    let kind = KIND.with(|k| k.get());
    let mut msg = [0u8; 160];
    let len = format_report(&mut msg, kind, nr);
    for fd in [2, SERIAL_LOG_FD.load(Ordering::SeqCst)] {
        if fd >= 0 {
            // SAFETY: write(2) is async-signal-safe; `msg[..len]` is valid.
            unsafe { libc::write(fd, msg.as_ptr().cast(), len) };
        }
    }
    // The call's own arguments, from the registers the kernel saved: the
    // filter decides some calls by their arguments, so only the same
    // arguments are sure to be refused again.
    // SAFETY: the kernel passes a valid ucontext_t for SA_SIGINFO handlers.
    let args = unsafe {
        let regs = &(*ctx.cast::<libc::ucontext_t>()).uc_mcontext.gregs;
        [
            libc::REG_RDI,
            libc::REG_RSI,
            libc::REG_RDX,
            libc::REG_R10,
            libc::REG_R8,
            libc::REG_R9,
        ]
        .map(|r| regs[r as usize])
    };
    // SAFETY: restoring the default action and repeating the refused call
    // as it was made (which the filter traps again) kills the process with
    // SIGSYS; both are async-signal-safe.
    unsafe {
        let mut act: libc::sigaction = std::mem::zeroed();
        act.sa_sigaction = libc::SIG_DFL;
        libc::sigaction(libc::SIGSYS, &act, std::ptr::null_mut());
        libc::syscall(
            nr as libc::c_long,
            args[0],
            args[1],
            args[2],
            args[3],
            args[4],
            args[5],
        );
        libc::_exit(forkbox_vmm_api::exit_code::VMM_ERROR);
    }
}

/// "\n[forkbox-vmm] the vcpu thread made system call 59, which its seccomp
/// filter forbids: the VMM ends\n", without allocating.
fn format_report(buf: &mut [u8; 160], kind: Kind, nr: i32) -> usize {
    let kind: &[u8] = match kind {
        Kind::Unconfined => b"a",
        Kind::Main => b"the main",
        Kind::Vcpu => b"a vCPU",
    };
    let mut digits = [0u8; 12];
    let mut n = nr.unsigned_abs();
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    let parts: [&[u8]; 5] = [
        b"\n[forkbox-vmm] ",
        kind,
        b" thread made system call ",
        &digits[i..],
        b", which its seccomp filter forbids: the VMM ends\n",
    ];
    let mut len = 0;
    for p in parts {
        let end = (len + p.len()).min(buf.len());
        buf[len..end].copy_from_slice(&p[..end - len]);
        len = end;
    }
    len
}

/// Test hook: `FORKBOX_VMM_TEST_FORBIDDEN_SYSCALL=<kind>:<number>` (set by
/// the host for this VMM only) makes the first confined thread of that
/// kind (`main`, or `vcpu` for vCPU 0) make that system call: how the VM
/// tests see a refused call end the VMM. The guest cannot set it.
fn test_forbidden_syscall(kind: &str) {
    let Ok(v) = std::env::var(TEST_SYSCALL_ENV) else {
        return;
    };
    let Some(nr) = v
        .strip_prefix(kind)
        .and_then(|r| r.strip_prefix(':'))
        .and_then(|n| n.parse::<libc::c_long>().ok())
    else {
        return;
    };
    tracing::warn!("{TEST_SYSCALL_ENV}: the {kind} thread makes system call {nr}");
    // SAFETY: a test-only call with zero arguments; every call the tests
    // name is refused by the filter before it runs.
    let rc = unsafe { libc::syscall(nr, 0, 0, 0, 0, 0, 0) };
    tracing::error!("{TEST_SYSCALL_ENV}: system call {nr} was allowed (returned {rc})");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_names_the_thread_and_the_call() {
        let mut buf = [0u8; 160];
        let n = format_report(&mut buf, Kind::Vcpu, 59);
        assert_eq!(
            std::str::from_utf8(&buf[..n]).expect("ascii"),
            "\n[forkbox-vmm] a vCPU thread made system call 59, which its seccomp filter forbids: the VMM ends\n"
        );
        let n = format_report(&mut buf, Kind::Main, 0);
        assert!(std::str::from_utf8(&buf[..n])
            .expect("ascii")
            .contains("the main thread made system call 0,"));
    }

    /// As root: the user and group given, no supplementary group, no
    /// capability, not dumpable, every limit of [`LIMITS`]. Otherwise: refused (no CAP_SETUID to
    /// keep), which is what a daemon that is not root must not ask.
    #[test]
    fn become_user_leaves_that_user_and_no_capability() {
        const NOBODY: u32 = 65534;
        // SAFETY: the child makes system calls and reads what they return
        // into stack values, then ends with _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
        if pid == 0 {
            let code = match drop_privileges(Some((NOBODY, NOBODY))) {
                Err(_) => 10,
                Ok(()) => match become_user() {
                    Err(_) => 11,
                    Ok(()) => {
                        let (mut r, mut e, mut s) = (0, 0, 0);
                        let (mut rg, mut eg, mut sg) = (0, 0, 0);
                        // SAFETY: out pointers to stack values.
                        let ids = unsafe {
                            libc::getresuid(&mut r, &mut e, &mut s) == 0
                                && libc::getresgid(&mut rg, &mut eg, &mut sg) == 0
                        };
                        // SAFETY: a count of 0 makes getgroups write nothing.
                        let groups = unsafe { libc::getgroups(0, std::ptr::null_mut()) };
                        let caps = rustix::thread::capabilities(None);
                        let dumpable = rustix::process::dumpable_behavior();
                        match () {
                            _ if !ids || [r, e, s] != [NOBODY; 3] => 12,
                            _ if [rg, eg, sg] != [NOBODY; 3] => 13,
                            _ if groups != 0 => 14,
                            _ if !caps.is_ok_and(|c| {
                                c.effective.is_empty()
                                    && c.permitted.is_empty()
                                    && c.inheritable.is_empty()
                            }) =>
                            {
                                15
                            }
                            _ if !matches!(
                                dumpable,
                                Ok(rustix::process::DumpableBehavior::NotDumpable)
                            ) =>
                            {
                                16
                            }
                            _ if !LIMITS.iter().all(|&(resource, limit, _)| {
                                let got = rustix::process::getrlimit(resource);
                                (got.current, got.maximum) == (Some(limit), Some(limit))
                            }) =>
                            {
                                17
                            }
                            _ => 0,
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
        assert_eq!(rc, pid, "waitpid: {}", std::io::Error::last_os_error());
        assert!(libc::WIFEXITED(status), "status {status:#x}");
        let want = if rustix::process::geteuid().is_root() {
            0
        } else {
            10
        };
        assert_eq!(libc::WEXITSTATUS(status), want, "status {status:#x}");
    }

    /// Runs `f` in a fork child whose thread has `kind`'s filters, and
    /// returns how the child ended (its wait status).
    fn in_filtered_child(kind: &'static str, rules: Rules, f: fn() -> i32) -> i32 {
        let progs = programs(kind, rules).expect("filters");
        // SAFETY: the child only makes raw system calls (no allocation,
        // no lock) and ends with _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
        if pid == 0 {
            let code = match apply(kind, &progs) {
                Ok(()) => f(),
                Err(_) => 90,
            };
            // SAFETY: ends the child without running the parent's atexit
            // handlers or destructors.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: `pid` is our child; `status` is a valid out pointer.
        let rc = unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(rc, pid, "waitpid: {}", std::io::Error::last_os_error());
        status
    }

    #[test]
    fn vcpu_filter_allows_its_calls_and_kills_on_others() {
        let allowed = in_filtered_child("vcpu", vcpu_rules(), || {
            // SAFETY: getpid and a zero-length write to stderr have no
            // memory arguments to get wrong.
            let ok = unsafe { libc::getpid() > 0 && libc::write(2, [].as_ptr(), 0) == 0 };
            if ok {
                0
            } else {
                1
            }
        });
        assert!(
            libc::WIFEXITED(allowed) && libc::WEXITSTATUS(allowed) == 0,
            "status {allowed:#x}"
        );
        fn socket() -> i32 {
            // SAFETY: socket takes no pointers.
            unsafe { libc::syscall(libc::SYS_socket, libc::AF_UNIX, libc::SOCK_STREAM, 0) as i32 }
        }
        fn openat() -> i32 {
            // SAFETY: the path is a valid C string that outlives the call.
            unsafe {
                libc::syscall(
                    libc::SYS_openat,
                    libc::AT_FDCWD,
                    c"/".as_ptr(),
                    libc::O_RDONLY,
                ) as i32
            }
        }
        fn kill() -> i32 {
            // SAFETY: signal 0 only checks that pid 1 exists (were the
            // call allowed).
            unsafe { libc::syscall(libc::SYS_kill, 1, 0) as i32 }
        }
        for (what, call) in [
            ("socket", socket as fn() -> i32),
            ("openat", openat),
            ("kill", kill),
        ] {
            let status = in_filtered_child("vcpu", vcpu_rules(), call);
            assert!(
                libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGSYS,
                "{what}: status {status:#x}"
            );
        }
    }

    /// `bind` of a new unix socket to an unnamed address (the call is
    /// what the filter decides on; the socket call before it is allowed).
    fn bind_unix() -> i32 {
        // SAFETY: socket takes no pointers; bind gets a valid
        // sockaddr_un of the length passed.
        unsafe {
            let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
            let addr = libc::sockaddr_un {
                sun_family: libc::AF_UNIX as libc::sa_family_t,
                sun_path: [0; 108],
            };
            libc::syscall(
                libc::SYS_bind,
                fd,
                std::ptr::addr_of!(addr),
                std::mem::size_of::<libc::sa_family_t>(),
            ) as i32
        }
    }

    fn unlink_nothing() -> i32 {
        // SAFETY: the path is a valid C string; the call is refused
        // before it runs (were it allowed, the name does not exist).
        unsafe {
            libc::syscall(
                libc::SYS_unlinkat,
                libc::AT_FDCWD,
                c"/nonexistent-forkbox".as_ptr(),
                0,
            ) as i32
        }
    }

    fn rename_nothing() -> i32 {
        let name = c"/nonexistent-forkbox";
        // SAFETY: as in unlink_nothing.
        unsafe {
            libc::syscall(
                libc::SYS_renameat2,
                libc::AT_FDCWD,
                name.as_ptr(),
                libc::AT_FDCWD,
                name.as_ptr(),
                0,
            ) as i32
        }
    }

    fn mkdir_nothing() -> i32 {
        // SAFETY: as in unlink_nothing (were it allowed, it fails: the
        // root exists).
        unsafe { libc::syscall(libc::SYS_mkdirat, libc::AT_FDCWD, c"/".as_ptr(), 0o700) as i32 }
    }

    fn listen_on_stdin() -> i32 {
        // SAFETY: listen takes no pointers.
        unsafe { libc::syscall(libc::SYS_listen, 0, 1) as i32 }
    }

    #[test]
    fn main_filter_refuses_namespaces_and_clone3_falls_back() {
        // clone3 answers ENOSYS (not a kill), so the C library uses clone.
        let clone3 = in_filtered_child("main", main_rules(false), || {
            // SAFETY: clone3 is refused before it reads its arguments.
            let rc = unsafe { libc::syscall(libc::SYS_clone3, 0, 0) };
            let errno = std::io::Error::last_os_error().raw_os_error();
            i32::from(!(rc == -1 && errno == Some(libc::ENOSYS)))
        });
        assert!(
            libc::WIFEXITED(clone3) && libc::WEXITSTATUS(clone3) == 0,
            "status {clone3:#x}"
        );
        let netns = in_filtered_child("main", main_rules(false), || {
            // SAFETY: a clone with a namespace flag is refused before it runs.
            unsafe { libc::syscall(libc::SYS_clone, libc::CLONE_NEWNET | libc::SIGCHLD, 0) as i32 }
        });
        assert!(
            libc::WIFSIGNALED(netns) && libc::WTERMSIG(netns) == libc::SIGSYS,
            "status {netns:#x}"
        );
        // No listening socket: its own were bound before the filter. No
        // name made, moved or removed.
        for (what, call) in [
            ("bind", bind_unix as fn() -> i32),
            ("listen", listen_on_stdin),
            ("unlinkat", unlink_nothing),
            ("renameat2", rename_nothing),
            ("mkdirat", mkdir_nothing),
        ] {
            let status = in_filtered_child("main", main_rules(false), call);
            assert!(
                libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGSYS,
                "{what}: status {status:#x}"
            );
        }
        let inet = in_filtered_child("main", main_rules(false), || {
            // SAFETY: socket takes no pointers.
            unsafe { libc::syscall(libc::SYS_socket, libc::AF_INET, libc::SOCK_STREAM, 0) as i32 }
        });
        assert!(
            libc::WIFSIGNALED(inet) && libc::WTERMSIG(inet) == libc::SIGSYS,
            "status {inet:#x}"
        );
    }

    #[test]
    fn refused_call_decided_by_its_arguments_still_ends_by_sigsys() {
        // The handler repeats the call with its own arguments: `clone`
        // with a namespace flag is refused again (with no arguments it
        // would have been allowed, and the process would have gone on).
        let status = in_filtered_child("main", main_rules(false), || {
            if install_handler().is_err() {
                return 91;
            }
            // SAFETY: a clone with a namespace flag is refused before it runs.
            unsafe { libc::syscall(libc::SYS_clone, libc::CLONE_NEWNET | libc::SIGCHLD, 0) as i32 }
        });
        assert!(
            libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGSYS,
            "status {status:#x}"
        );
    }

    #[test]
    fn filters_compile_for_both_thread_kinds() {
        for (kind, rules) in [
            ("vcpu", vcpu_rules()),
            ("main", main_rules(false)),
            ("main", main_rules(true)),
        ] {
            let prog = SeccompFilter::new(
                rules,
                SeccompAction::Trap,
                SeccompAction::Allow,
                seccompiler::TargetArch::x86_64,
            )
            .and_then(BpfProgram::try_from)
            .unwrap_or_else(|e| panic!("{kind}: {e}"));
            assert!(!prog.is_empty());
        }
    }

    #[test]
    fn vcpu_calls_are_a_subset_of_the_main_threads() {
        // A fork child's new vCPU threads inherit the main filter and add
        // their own: a call only the vCPU filter allowed would be refused.
        let main = main_rules(false);
        for nr in vcpu_rules().keys() {
            assert!(main.contains_key(nr), "system call {nr}");
        }
    }

    #[test]
    fn forbidden_calls_stay_forbidden() {
        for rules in [vcpu_rules(), main_rules(true)] {
            for nr in [
                libc::SYS_execve,
                libc::SYS_execveat,
                libc::SYS_ptrace,
                libc::SYS_process_vm_readv,
                libc::SYS_process_vm_writev,
                libc::SYS_mount,
                libc::SYS_umount2,
                libc::SYS_pivot_root,
                libc::SYS_unshare,
                libc::SYS_setns,
                libc::SYS_kill,
                libc::SYS_init_module,
                libc::SYS_finit_module,
                libc::SYS_kexec_load,
                libc::SYS_bpf,
                libc::SYS_perf_event_open,
                libc::SYS_keyctl,
                libc::SYS_add_key,
                libc::SYS_setuid,
                libc::SYS_capset,
                libc::SYS_userfaultfd,
                libc::SYS_io_uring_setup,
            ] {
                assert!(!rules.contains_key(&nr), "system call {nr} allowed");
            }
        }
    }
}
