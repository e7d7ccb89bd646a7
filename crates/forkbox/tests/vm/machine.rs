//! VM trials of one machine's life: KVM itself in the test bed, SMP, and
//! how a guest's panic, power-off, reboot or death reaches the caller.

use super::*;
use std::path::PathBuf;

pub(crate) fn testbed_dev_kvm_runs_real_mode_guest() -> TestResult {
    use kvm_ioctls::{Kvm, VcpuExit};
    // mov al, 0x42; out 0x10, al; hlt
    let code: [u8; 5] = [0xb0, 0x42, 0xe6, 0x10, 0xf4];
    let kvm = Kvm::new().map_err(|e| format!("/dev/kvm: {e}"))?;
    let vm = kvm.create_vm().map_err(|e| format!("KVM_CREATE_VM: {e}"))?;
    // KVM wants page-aligned guest memory.
    let mut buf = vec![0u8; 0x10000 + 0x1000];
    let offset = buf.as_ptr().align_offset(0x1000);
    let mem = &mut buf[offset..offset + 0x10000];
    mem[0x1000..0x1005].copy_from_slice(&code);
    let region = kvm_bindings::kvm_userspace_memory_region {
        slot: 0,
        guest_phys_addr: 0,
        memory_size: mem.len() as u64,
        userspace_addr: mem.as_mut_ptr() as u64,
        flags: 0,
    };
    // SAFETY: `buf` outlives `vm` (declared earlier, so dropped later) and
    // is neither moved nor reallocated while the VM exists.
    unsafe { vm.set_user_memory_region(region) }.map_err(|e| format!("memory region: {e}"))?;
    let mut vcpu = vm.create_vcpu(0).map_err(|e| format!("vcpu: {e}"))?;
    let mut sregs = vcpu.get_sregs().map_err(|e| e.to_string())?;
    sregs.cs.base = 0;
    sregs.cs.selector = 0;
    vcpu.set_sregs(&sregs).map_err(|e| e.to_string())?;
    let regs = kvm_bindings::kvm_regs {
        rip: 0x1000,
        rflags: 2,
        ..Default::default()
    };
    vcpu.set_regs(&regs).map_err(|e| e.to_string())?;
    let mut seen = None;
    loop {
        match vcpu.run().map_err(|e| format!("KVM_RUN: {e}"))? {
            VcpuExit::IoOut(port, data) => seen = Some((port, data[0])),
            VcpuExit::Hlt => break,
            other => return Err(format!("unexpected exit {other:?}").into()),
        }
    }
    check(seen == Some((0x10, 0x42)), format!("guest wrote {seen:?}"))
}

/// SMP: 4 vCPUs with hardware virtualization; inside the emulated host as
/// many as it has CPUs (2). There, a guest with more vCPUs than the host
/// has CPUs has stalled a vCPU for minutes (docs/SPEC.md, known problems).
pub(crate) fn vm_smp_vcpus_are_online() -> TestResult {
    let vcpus: u8 = if Environment::detect() == Environment::EmulatedHost {
        std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, 4)) as u8
    } else {
        4
    };
    let vm = boot(VmSpec {
        vcpus,
        memory_mib: 1024,
        ..VmSpec::default()
    });
    // A stalled guest fails the test instead of hanging the suite.
    let agent = vm.agent().clone();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(exec(
            &agent,
            &ExecRequest::shell(
                "grep -c ^processor /proc/cpuinfo; awk '/MemTotal/ {print $2}' /proc/meminfo",
            ),
        ));
    });
    let (r, out, _) = rx.recv_timeout(Duration::from_secs(180)).map_err(|e| {
        let what = match e {
            std::sync::mpsc::RecvTimeoutError::Timeout => "no answer within 180 s",
            std::sync::mpsc::RecvTimeoutError::Disconnected => "the command failed (see above)",
        };
        format!(
            "{what} from a {vcpus}-vCPU guest; serial tail:\n{}",
            vm.serial_tail(20)
        )
    })?;
    check(r.success(), format!("{r:?}"))?;
    let text = String::from_utf8_lossy(&out);
    let mut lines = text.lines();
    check(
        lines.next() == Some(vcpus.to_string().as_str()),
        format!("cpus: {text}"),
    )?;
    let mem_kib: u64 = lines.next().and_then(|l| l.parse().ok()).unwrap_or(0);
    check(
        (900_000..=1_048_576).contains(&mem_kib),
        format!("MemTotal {mem_kib} kB"),
    )
}

/// A guest sees neither VMX nor SVM, whatever the host's KVM offers (in
/// the emulated host, kvm_amd offers SVM for nesting): no guest reaches
/// the host kernel's nested-virtualization code.
pub(crate) fn vm_guest_has_no_nested_virtualization() -> TestResult {
    let kvm = kvm_ioctls::Kvm::new().map_err(|e| format!("/dev/kvm: {e}"))?;
    let offered = kvm
        .get_supported_cpuid(kvm_bindings::KVM_MAX_CPUID_ENTRIES)
        .map_err(|e| format!("KVM_GET_SUPPORTED_CPUID: {e}"))?
        .as_slice()
        .iter()
        .any(|e| {
            (e.function == 0x1 && e.ecx & (1 << 5) != 0)
                || (e.function == 0x8000_0001 && e.ecx & (1 << 2) != 0)
        });
    eprintln!("host KVM offers VMX or SVM to its guests: {offered}");
    let vm = boot(VmSpec::default());
    let flags = sh(
        vm.agent(),
        "grep -o -w -E 'vmx|svm' /proc/cpuinfo | sort -u | tr '\\n' ' '; grep -c ^processor /proc/cpuinfo",
    )?;
    check(
        flags.trim() == "1",
        format!("the guest's CPU flags name nested virtualization: {flags:?}"),
    )
}

/// The kernel's whole module tree is in every guest, from a disk of its
/// own (no image carries it): a module the boot did not load loads on
/// demand, by `modprobe` and by the kernel's own request (a bridge asked
/// of `ip`), in a built-in image with busybox only.
pub(crate) fn vm_kernel_modules_load_on_demand() -> TestResult {
    let vm = boot(VmSpec::default());
    let out = sh(
        vm.agent(),
        "d=/lib/modules/$(uname -r); grep \" $d \" /proc/mounts | cut -d' ' -f3,4; \
         test -f $d/modules.dep && echo has-dep; \
         grep -c -w '^veth' /proc/modules; modprobe veth && grep -c -w '^veth' /proc/modules; \
         ip link add fbx0 type bridge && grep -c -w '^bridge' /proc/modules",
    )?;
    let lines: Vec<&str> = out.lines().collect();
    check(
        lines.first().is_some_and(|l| l.starts_with("erofs ro")),
        format!("the module tree is not a read-only erofs mount: {out:?}"),
    )?;
    check(
        lines[1..] == ["has-dep", "0", "1", "1"],
        format!("veth and bridge did not load on demand: {out:?}"),
    )
}

/// A VMM sees none of its caller's environment but what it needs (no
/// token, no `PATH`), writes no core dump (the guest's memory) when it
/// crashes, and has its other resource limits; its fork children inherit
/// them all.
pub(crate) fn vmm_environment_scrubbed_and_no_core_dumps() -> TestResult {
    check(
        std::env::var_os("PATH").is_some(),
        "the test itself has no PATH: nothing to scrub",
    )?;
    let vm = boot(VmSpec::default());
    let child = vm
        .fork(1)
        .map_err(|e| format!("fork: {e}"))?
        .pop()
        .ok_or("fork gave no child")?
        .map_err(|e| format!("fork child: {e}"))?;
    for (what, pid) in [("booted", vm.pid()), ("fork child", child.pid())] {
        let environ = std::fs::read(format!("/proc/{pid}/environ")).map_err(|e| e.to_string())?;
        let names: Vec<String> = environ
            .split(|b| *b == 0)
            .filter(|v| !v.is_empty())
            .map(|v| {
                String::from_utf8_lossy(v.split(|b| *b == b'=').next().unwrap_or(v)).into_owned()
            })
            .collect();
        let allowed = [
            "FORKBOX_LOG",
            "RUST_BACKTRACE",
            "FORKBOX_ALLOW_SOFTWARE_KVM",
        ];
        check(
            names.iter().all(|n| allowed.contains(&n.as_str())),
            format!("{what} VMM {pid} sees {names:?}"),
        )?;
        let limits =
            std::fs::read_to_string(format!("/proc/{pid}/limits")).map_err(|e| e.to_string())?;
        let open_files = forkbox_vmm::lockdown::MAX_OPEN_FILES.to_string();
        for (name, want) in [
            ("Max core file size", "0"),
            ("Max open files", open_files.as_str()),
            ("Max locked memory", "0"),
            ("Max msgqueue size", "0"),
        ] {
            // "Max open files  4096  4096  files": soft and hard.
            let line = limits.lines().find(|l| l.starts_with(name)).unwrap_or("");
            let values = line[line.len().min(name.len())..].split_whitespace();
            check(
                values.take(2).eq([want, want]),
                format!("{what} VMM {pid}: {line:?}, want {want} twice"),
            )?;
        }
    }
    Ok(())
}

/// A booted VMM and a fork child have no capabilities, `no_new_privs`
/// and a seccomp filter on every thread, and their guests still answer.
/// Their root is read-only throughout and holds no VM's directory: not
/// their own, not the parent's, not a sibling fork child's.
pub(crate) fn vmm_confined_without_capabilities_and_filtered() -> TestResult {
    let mut vm = boot(VmSpec::default());
    let mut children = fork(&mut vm, 2)?;
    let sibling = children.pop().ok_or("fork gave no second child")?;
    let child = children.pop().ok_or("fork gave no child")?;
    let vm_dirs = [&vm, &child, &sibling].map(|v| v.handle().dir);
    for (what, v) in [("booted", &vm), ("fork child", &child)] {
        let pid = v.pid();
        let status = proc_status(&format!("/proc/{pid}/status"))?;
        for (field, want) in [
            ("NoNewPrivs", "1"),
            ("Seccomp", "2"),
            ("CapInh", "0000000000000000"),
            ("CapPrm", "0000000000000000"),
            ("CapEff", "0000000000000000"),
            ("CapBnd", "0000000000000000"),
            ("CapAmb", "0000000000000000"),
        ] {
            let got = status.get(field).map(String::as_str);
            check(
                got == Some(want),
                format!("{what} VMM {pid}: {field} is {got:?}, want {want}"),
            )?;
        }
        let mut vcpu_threads = 0;
        for task in std::fs::read_dir(format!("/proc/{pid}/task")).map_err(|e| e.to_string())? {
            let dir = task.map_err(|e| e.to_string())?.path();
            let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
            let status = proc_status(&dir.join("status").to_string_lossy())?;
            check(
                status.get("Seccomp").map(String::as_str) == Some("2"),
                format!(
                    "{what} VMM {pid}: thread {} ({}) unfiltered",
                    dir.display(),
                    comm.trim()
                ),
            )?;
            vcpu_threads += usize::from(comm.starts_with("vcpu"));
        }
        check(
            vcpu_threads >= 1,
            format!("{what} VMM {pid}: no vCPU thread seen"),
        )?;
        // Namespaces of its own (a fork child shares its parent's): the
        // network, System V IPC and hostname, and the mounts.
        for kind in ["net", "ipc", "uts", "mnt"] {
            let ns = |p: &str| {
                std::fs::read_link(format!("/proc/{p}/ns/{kind}")).map_err(|e| e.to_string())
            };
            check(
                ns(&pid.to_string())? != ns("self")?,
                format!("{what} VMM {pid}: in this process's {kind} namespace"),
            )?;
        }
        let writable = writable_mounts(pid)?;
        check(
            writable.is_empty(),
            format!("{what} VMM {pid} may write {writable:?}"),
        )?;
        let root = PathBuf::from(format!("/proc/{pid}/root"));
        for dir in &vm_dirs {
            check(
                !root.join(dir.strip_prefix("/").unwrap_or(dir)).exists(),
                format!(
                    "{what} VMM {pid} reaches the VM directory {}",
                    dir.display()
                ),
            )?;
        }
        jail_shows_only_inputs(what, pid)?;
        sh(v.agent(), "true")?;
    }
    Ok(())
}

/// A VMM's root (`/proc/PID/root`) holds `/proc` and the paths its command
/// line names (kernel, initramfs, disks), each at its own path, and
/// nothing else of the host's: no `/etc`, and beside the kernel none of
/// the cache's other files.
fn jail_shows_only_inputs(what: &str, pid: u32) -> TestResult {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).map_err(|e| e.to_string())?;
    let args: Vec<String> = cmdline
        .split(|b| *b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let inputs: Vec<PathBuf> = args
        .windows(2)
        .filter(|w| ["--kernel", "--initramfs", "--disk"].contains(&w[0].as_str()))
        .map(|w| {
            PathBuf::from(&w[1])
                .canonicalize()
                .unwrap_or(PathBuf::from(&w[1]))
        })
        .chain([PathBuf::from("/proc")])
        .collect();
    let root = PathBuf::from(format!("/proc/{pid}/root"));
    let kernel = inputs
        .first()
        .ok_or("no --kernel on the VMM's command line")?;
    // Every entry of a directory in the jail leads to an input.
    for dir in [Path::new("/"), kernel.parent().unwrap_or(Path::new("/"))] {
        let inside = root.join(dir.strip_prefix("/").unwrap_or(dir));
        for entry in std::fs::read_dir(&inside).map_err(|e| format!("{}: {e}", inside.display()))? {
            let path = dir.join(entry.map_err(|e| e.to_string())?.file_name());
            check(
                inputs.iter().any(|i| i.starts_with(&path)),
                format!(
                    "{what} VMM {pid} sees {}, which is none of {inputs:?}",
                    path.display()
                ),
            )?;
        }
    }
    check(
        !root.join("etc").exists() && root.join("proc/self/status").exists(),
        format!("{what} VMM {pid}: /etc is in its root, or /proc is not"),
    )?;
    // Its /proc is a procfs of its own that shows it no other process.
    let path = format!("/proc/{pid}/mountinfo");
    let mountinfo = std::fs::read_to_string(&path).map_err(|e| format!("{path}: {e}"))?;
    let proc = mountinfo
        .lines()
        .find(|l| l.split(' ').nth(4) == Some("/proc"))
        .ok_or_else(|| format!("{what} VMM {pid}: no /proc mount in {mountinfo}"))?;
    check(
        proc.contains(" - proc proc ")
            && proc.contains("hidepid=invisible")
            && proc.contains("subset=pid"),
        format!("{what} VMM {pid}: its /proc is not its own hidepid procfs: {proc}"),
    )
}

/// A VMM started by root runs its guest as a user and group of its own,
/// with no other group, which its fork children share, and another VM's
/// VMM has another. That user can write in its VM's directory, but not
/// list another VM's, connect to a socket only root may (the daemon's
/// API, the service manager's), or signal root's processes or another
/// VM's VMM: what a VMM its guest took over could try, tried by a process
/// of the test with the VMM's ids.
pub(crate) fn vmm_runs_as_its_own_user_who_reaches_nothing_of_roots_or_another_vms() -> TestResult {
    check(
        rustix::process::geteuid().is_root(),
        "the VM trials run as root; a VMM started by another user keeps that user",
    )?;
    let mut vm = boot(VmSpec::default());
    let other = boot(VmSpec::default());
    let child = fork(&mut vm, 1)?.pop().ok_or("fork gave no child")?;
    let ids = |what: &str, pid: u32| -> Result<(u32, u32), Failed> {
        let status = proc_status(&format!("/proc/{pid}/status"))?;
        let same = |field: &str| -> Result<u32, Failed> {
            let v: Vec<&str> = status
                .get(field)
                .map(|v| v.split_whitespace().collect())
                .unwrap_or_default();
            check(
                v.len() == 4 && v.iter().all(|x| *x == v[0]),
                format!("{what} VMM {pid}: {field} is {v:?}, not one id four times"),
            )?;
            v[0].parse().map_err(|e| format!("{field}: {e}").into())
        };
        let (uid, gid) = (same("Uid")?, same("Gid")?);
        let groups = status.get("Groups").map(String::as_str).unwrap_or("?");
        check(
            uid != 0 && gid != 0 && groups.is_empty(),
            format!("{what} VMM {pid}: uid {uid}, gid {gid}, groups {groups:?}"),
        )?;
        Ok((uid, gid))
    };
    let user = ids("booted", vm.pid())?;
    check(
        ids("fork child", child.pid())? == user,
        "the fork child runs as another user than its parent",
    )?;
    let other_user = ids("other", other.pid())?;
    check(
        other_user != user,
        format!("two booted VMs share the user {user:?}"),
    )?;
    // A socket only root may connect to, as the daemon's is.
    let rooms = tempfile::tempdir().map_err(|e| e.to_string())?;
    let root_socket = rooms.path().join("root-only.sock");
    let _listener =
        std::os::unix::net::UnixListener::bind(&root_socket).map_err(|e| e.to_string())?;
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(rooms.path(), std::fs::Permissions::from_mode(0o755))
            .and_then(|()| {
                std::fs::set_permissions(&root_socket, std::fs::Permissions::from_mode(0o600))
            })
            .map_err(|e| e.to_string())?;
    }
    let cstr = |p: &Path| {
        std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).map_err(|e| e.to_string())
    };
    let own_file = cstr(&vm.handle().dir.join("written-by-its-user"))?;
    let other_dir = cstr(&other.handle().dir)?;
    let socket_addr = {
        let path = root_socket.as_os_str().as_encoded_bytes();
        // SAFETY: sockaddr_un is plain data; zeroed is a valid value.
        let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
        addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
        for (d, s) in addr.sun_path.iter_mut().zip(path) {
            *d = *s as libc::c_char;
        }
        addr
    };
    let other_pid = other.pid() as libc::pid_t;
    // SAFETY: the child makes system calls on values prepared above (no
    // allocation, no lock) and ends with _exit.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(format!("fork: {}", std::io::Error::last_os_error()).into());
    }
    if pid == 0 {
        let errno = || std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
        // SAFETY: as above; each call's pointers are to live values.
        let code = unsafe {
            if libc::setgroups(0, std::ptr::null()) != 0
                || libc::setresgid(user.1, user.1, user.1) != 0
                || libc::setresuid(user.0, user.0, user.0) != 0
            {
                10
            } else if libc::open(own_file.as_ptr(), libc::O_CREAT | libc::O_WRONLY, 0o600) < 0 {
                11
            } else if libc::open(other_dir.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY) >= 0
                || errno() != libc::EACCES
            {
                12
            } else {
                let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
                let connected = libc::connect(
                    fd,
                    std::ptr::addr_of!(socket_addr).cast(),
                    std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t,
                );
                if fd < 0 || connected == 0 || errno() != libc::EACCES {
                    13
                } else if libc::kill(1, 0) == 0 || errno() != libc::EPERM {
                    14
                } else if libc::kill(other_pid, 0) == 0 || errno() != libc::EPERM {
                    15
                } else {
                    0
                }
            }
        };
        // SAFETY: ends the child without running the parent's destructors.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: `pid` is our child; `status` is a valid out pointer.
    if unsafe { libc::waitpid(pid, &mut status, 0) } != pid {
        return Err(format!("waitpid: {}", std::io::Error::last_os_error()).into());
    }
    let why = match libc::WEXITSTATUS(status) {
        0 if libc::WIFEXITED(status) => return sh(child.agent(), "true").map(drop),
        10 => "could not take the VMM's ids",
        11 => "could not write in its own VM's directory",
        12 => "could open another VM's directory (or failed otherwise than EACCES)",
        13 => "could connect to a socket only root may (or failed otherwise than EACCES)",
        14 => "could signal pid 1 (or failed otherwise than EPERM)",
        15 => "could signal another VM's VMM (or failed otherwise than EPERM)",
        _ => "ended otherwise",
    };
    Err(format!("as the VMM's user {user:?}: {why} (status {status:#x})").into())
}

/// The mount points process `pid` sees mounted other than `ro`.
fn writable_mounts(pid: u32) -> Result<Vec<String>, Failed> {
    let path = format!("/proc/{pid}/mountinfo");
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{path}: {e}"))?;
    Ok(text
        .lines()
        .filter_map(|l| {
            let fields: Vec<&str> = l.split(' ').collect();
            let access = fields.get(5)?.split(',').next()?;
            (access != "ro").then(|| fields.get(4).copied().unwrap_or("?").to_owned())
        })
        .collect())
}

/// `/proc/.../status` as field → value.
fn proc_status(path: &str) -> Result<HashMap<String, String>, Failed> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
    Ok(text
        .lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.to_owned(), v.trim().to_owned()))
        .collect())
}

/// A system call outside a thread's filter ends the VMM with `SIGSYS`,
/// and the serial log says which call and which thread: `execve` and
/// `ptrace` on the main thread, and `socket` (which the main thread may
/// make) on a vCPU thread.
pub(crate) fn vmm_forbidden_syscall_ends_it_with_sigsys() -> TestResult {
    for (kind, nr, thread) in [
        ("main", libc::SYS_execve, "the main thread"),
        ("main", libc::SYS_ptrace, "the main thread"),
        ("vcpu", libc::SYS_socket, "a vCPU thread"),
    ] {
        let spec = VmSpec {
            vmm_env: vec![(
                "FORKBOX_VMM_TEST_FORBIDDEN_SYSCALL".into(),
                format!("{kind}:{nr}"),
            )],
            ..VmSpec::default()
        };
        match Vm::boot(assets(), &spec) {
            Ok(_) => return Err(format!("{kind} thread: system call {nr} was allowed").into()),
            Err(VmError::DiedDuringBoot {
                how, serial_tail, ..
            }) => {
                check(
                    how.contains("SIGSYS"),
                    format!("{kind}:{nr}: the VMM ended as {how:?}"),
                )?;
                let said =
                    format!("{thread} made system call {nr}, which its seccomp filter forbids");
                check(
                    serial_tail.contains(&said),
                    format!("{kind}:{nr}: the serial log does not say {said:?}:\n{serial_tail}"),
                )?;
            }
            Err(e) => return Err(format!("{kind}:{nr}: {e:#}").into()),
        }
    }
    Ok(())
}

/// A VMM ends by itself once no process has owned it for its orphan
/// grace (a daemon that died and none adopted it), fork children too; one
/// owned again within the grace lives on.
pub(crate) fn vmm_without_an_owner_ends_after_its_grace() -> TestResult {
    let grace = Duration::from_secs(10);
    let mut vm = boot(VmSpec {
        orphan_grace: grace,
        ..VmSpec::default()
    });
    let mut child = fork(&mut vm, 1)?.pop().ok_or("fork gave no child")?;
    // Owned: alive past the grace.
    std::thread::sleep(grace + Duration::from_secs(3));
    for (what, v) in [("booted", &vm), ("fork child", &child)] {
        check(
            sh(v.agent(), "true").is_ok(),
            format!("{what}, owned: no answer"),
        )?;
    }
    // Let go of and owned again within the grace: alive past it.
    vm.disown();
    std::thread::sleep(Duration::from_secs(2));
    vm.own().map_err(|e| format!("owning again: {e}"))?;
    std::thread::sleep(grace + Duration::from_secs(2));
    check(sh(vm.agent(), "true").is_ok(), "owned again: no answer")?;
    // Nobody owns them: both end, and say why.
    vm.disown();
    child.disown();
    for (what, v) in [("booted", &mut vm), ("fork child", &mut child)] {
        let ended = v.wait_exit(grace + Duration::from_secs(60));
        // A fork child's status goes to its parent VMM, which reaps it.
        check(
            !matches!(ended, Ok(None)),
            format!("{what}: still running 60 s past its grace"),
        )?;
        let log = v.serial_tail(5);
        check(
            log.contains("no process has owned this VM for 10 s"),
            format!("{what}: its serial log does not say why it ended:\n{log}"),
        )?;
    }
    Ok(())
}

pub(crate) fn vm_guest_panic_ends_vmm_with_panic_status() -> TestResult {
    let mut vm = boot(VmSpec::default());
    // Bounded: a guest or VMM that stops answering fails the trial (with
    // where it was, below) instead of holding the shard.
    let agent = vm
        .agent()
        .clone()
        .with_call_timeout(Duration::from_secs(120));
    // The exec itself dies with the guest: only the VMM's status matters.
    let _ = agent.exec(
        &ExecRequest::shell("echo c > /proc/sysrq-trigger"),
        None,
        &mut |_, _| {},
    );
    let status = vm
        .wait_exit(Duration::from_secs(60))
        .map_err(|e| e.to_string())?;
    let code = status.and_then(|s| s.code());
    check(
        code == Some(vmm_exit::PANIC),
        format!(
            "VMM ended with {status:?}\n--- vCPUs ---\n{}\n--- serial log (tail) ---\n{}",
            vm.control()
                .vcpus()
                .unwrap_or_else(|e| format!("(not readable: {e})")),
            vm.serial_tail(20)
        ),
    )
}

pub(crate) fn vm_guest_poweroff_ends_vmm_cleanly() -> TestResult {
    let mut vm = boot(VmSpec::default());
    vm.agent().shutdown().map_err(|e| format!("{e:#}"))?;
    vmm_ends_with(&mut vm, vmm_exit::POWER_OFF)
}

/// The VMM ends within a minute with exit code `code`.
fn vmm_ends_with(vm: &mut Vm, code: i32) -> TestResult {
    let status = vm
        .wait_exit(Duration::from_secs(60))
        .map_err(|e| e.to_string())?;
    check(
        status.and_then(|s| s.code()) == Some(code),
        format!("VMM ended with {status:?}\n{}", vm.serial_tail(20)),
    )
}

pub(crate) fn vm_guest_reboot_ends_vmm_with_reboot_status() -> TestResult {
    let mut vm = boot(VmSpec::default());
    let _ = vm
        .agent()
        .clone()
        .with_call_timeout(Duration::from_secs(120))
        .exec(&ExecRequest::argv(["reboot", "-f"]), None, &mut |_, _| {});
    vmm_ends_with(&mut vm, vmm_exit::RESET)
}

/// A guest being given up says where it was: forkbox sends it an NMI,
/// which its kernel (booted with `unknown_nmi_panic`) answers with its
/// panic and the interrupted stack on the serial log; the VM then ends as
/// a kernel panic.
pub(crate) fn vm_nmi_makes_a_given_up_guest_say_where_it_was() -> TestResult {
    let mut vm = boot(VmSpec::default());
    let said = vm.guest_says_where();
    check(
        said.contains("NMI received for unknown reason")
            && said.contains("Kernel panic - not syncing")
            && said.contains("Call Trace")
            && said.contains("RIP: "),
        format!("the guest said:\n{said}"),
    )?;
    eprintln!("nmi: the guest said where it was:\n{said}");
    vmm_ends_with(&mut vm, vmm_exit::PANIC)
}

/// A guest that takes its network device from its driver (unbinds it)
/// and then kicks the device's queues from `/dev/mem` in a loop, both the
/// kick the VMM's ioeventfd takes (queue 0) and one it does not (queue 9,
/// which exits to the vCPU thread): the kicks reach the VMM (its MMIO exit
/// count grows by at least the unmatched ones), and the VM is served
/// throughout (its agent answers a command every second, each within a
/// minute, until the guest has made 200 kicks; a loop that cannot make
/// them in five minutes fails the trial). A bystander VM beside it answers
/// a command every second too, each within a minute.
pub(crate) fn vm_guest_kicking_a_queue_in_a_loop_is_still_served() -> TestResult {
    let vm =
        Vm::boot(assets(), &networked(&net_policy(&[]))).map_err(|e| format!("boot: {e:#}"))?;
    let bystander = boot(VmSpec::default());
    let mmio_exits = |vm: &Vm| -> Result<u64, Failed> {
        let status = vm.control().status().map_err(|e| format!("status: {e}"))?;
        Ok(status
            .counters
            .ok_or("no counters in the VMM's status")?
            .exits_mmio)
    };
    // The window of the virtio device whose id is 1 (network), from
    // /proc/iomem while its driver still holds it.
    let started = sh(
        vm.agent(),
        r#"set -e
        for d in /sys/bus/virtio/devices/*; do
            if [ "$(cat $d/device)" = 0x0001 ]; then p=$(basename "$(readlink -f $d/..)"); fi
        done
        [ -n "$p" ] || { echo "no virtio-net device"; exit 1; }
        start=$(grep -m1 " : $p\$" /proc/iomem | cut -d- -f1 | tr -d ' ')
        [ -n "$start" ] || { echo "no window of $p in /proc/iomem"; exit 1; }
        notify=$(printf 0x%x $((0x$start + 0x50)))
        echo "$p" > /sys/bus/platform/drivers/virtio-mmio/unbind
        echo 0 > /tmp/kicks
        (i=0; while :; do busybox devmem $notify 32 $((i % 2 * 9)); i=$((i + 1)); echo $i > /tmp/kicks.new; mv /tmp/kicks.new /tmp/kicks; done) >/dev/null 2>&1 &
        echo "kicking $p at $notify""#,
    )?;
    check(
        started.contains("kicking"),
        format!("the guest's setup said {started:?}"),
    )?;
    let kicked = |vm: &Vm| -> Result<u64, Failed> {
        let out = answer_within(vm, "cat /tmp/kicks", Duration::from_secs(60))?;
        Ok(out.trim().parse().map_err(|e| format!("{out:?}: {e}"))?)
    };
    // Kicks counted in the guest after `before` was read: each of them
    // was made after it. The count is renamed into place, so it is never
    // read half written.
    let before = mmio_exits(&vm)?;
    let first = kicked(&vm)?;
    let (start, mut last, mut commands) = (std::time::Instant::now(), first, 0);
    while last - first < 200 || commands < 10 {
        check(
            start.elapsed() < Duration::from_secs(300),
            format!(
                "the guest's loop made {} kicks in 5 minutes, not 200 ({started})",
                last - first
            ),
        )?;
        std::thread::sleep(Duration::from_secs(1));
        last = kicked(&vm)?;
        let heard = answer_within(&bystander, "echo here", Duration::from_secs(60))?;
        check(heard == "here\n", format!("the bystander said {heard:?}"))?;
        commands += 1;
    }
    let exits = mmio_exits(&vm)? - before;
    let kicks = last - first;
    check(
        exits >= kicks / 2,
        format!("{kicks} kicks in the guest, every other one unmatched, but {exits} MMIO exits"),
    )?;
    eprintln!(
        "kick loop: {kicks} kicks in {:.0?}, {exits} MMIO exits, {commands} commands answered \
         by it and by a bystander",
        start.elapsed()
    );
    sh(vm.agent(), "echo still here").map(drop)
}

pub(crate) fn vm_dies_mid_call_is_reported() -> TestResult {
    let vm = boot(VmSpec::default());
    let agent = vm.agent().clone();
    let pid = vm.pid();
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(500));
        let _ = std::process::Command::new("kill")
            .args(["-9", &pid.to_string()])
            .status();
    });
    let err = agent
        .exec(&ExecRequest::argv(["sleep", "30"]), None, &mut |_, _| {})
        .err();
    killer.join().map_err(|_| "killer panicked")?;
    check(err.is_some(), "exec on a killed VM returned a result")?;
    let text = format!(
        "{:#}",
        err.map(anyhow::Error::from)
            .unwrap_or_else(|| anyhow::anyhow!(""))
    );
    check(
        text.contains("died") || text.contains("connect"),
        format!("error: {text}"),
    )
}

/// Every VMM runs in a cgroup of its own under `forkbox` (a fork child
/// joins its own before it builds its VM, so KVM's kernel thread for the
/// child's VM is made there, not in its parent's), with the memory, pids
/// and CPU limits of its shape; a zygote's memory limit is lifted; a VMM
/// that reaches its memory limit is ended by the kernel alone, and says
/// so; each cgroup is removed once its VMM is gone.
pub(crate) fn vmm_runs_in_a_cgroup_of_its_own_whose_limits_hold() -> TestResult {
    use forkbox_host::cgroup::{hierarchy, Limits};
    use forkbox_host::poll;
    use std::ops::ControlFlow;
    use std::time::Instant;
    let hierarchy = hierarchy().map_err(|why| format!("VMMs get no cgroup here: {why}"))?;
    let spec = VmSpec::default();
    let limits = Limits::for_vm(spec.vcpus, spec.memory_mib);
    let mut vm = boot(spec);
    let mut children = fork(&mut vm, 2)?;
    let read = |dir: &Path, file: &str| -> Result<String, Failed> {
        std::fs::read_to_string(dir.join(file))
            .map(|s| s.trim().to_owned())
            .map_err(|e| format!("{}/{file}: {e}", dir.display()).into())
    };
    let mut dirs = Vec::new();
    for (what, v) in [
        ("booted", &vm),
        ("fork child 0", &children[0]),
        ("fork child 1", &children[1]),
    ] {
        let pid = v.pid();
        let cgroup = v.cgroup().ok_or(format!("{what} VMM {pid}: no cgroup"))?;
        let dir = cgroup.dir().to_owned();
        check(
            dir.parent() == Some(hierarchy.dir()),
            format!(
                "{what}: {} is not under {}",
                dir.display(),
                hierarchy.dir().display()
            ),
        )?;
        let procs = cgroup.pids().map_err(|e| e.to_string())?;
        let described: Vec<String> = procs
            .iter()
            .map(|p| {
                let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default();
                format!(
                    "{p}: {}",
                    stat.split(' ').take(4).collect::<Vec<_>>().join(" ")
                )
            })
            .collect();
        // Besides the VMM, at most KVM's kernel thread for its own VM
        // (`kvm-nx-lpage-recovery`, where the host mitigates iTLB
        // multihit), made in the cgroup of whoever made the VM: a fork
        // child's would be in its parent's had it not joined its own first.
        let others: Vec<&String> = described
            .iter()
            .filter(|d| !d.starts_with(&format!("{pid}:")))
            .collect();
        let others_are_its_kvm_thread = others.len() <= 1
            && others
                .iter()
                .all(|d| d.contains("(kvm-") && d.ends_with(" S 2"));
        check(
            procs.contains(&pid) && others_are_its_kvm_thread,
            format!("{what} VMM {pid}: its cgroup holds {described:?}"),
        )?;
        let own =
            std::fs::read_to_string(format!("/proc/{pid}/cgroup")).map_err(|e| e.to_string())?;
        let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or("?");
        check(
            own.trim().ends_with(&format!("/forkbox/{name}")),
            format!("{what} VMM {pid}: /proc/PID/cgroup says {own:?}"),
        )?;
        let memory = limits.memory_max.map(|b| b.to_string());
        for (file, want) in [
            ("memory.max", memory.as_deref().unwrap_or("max").to_owned()),
            ("pids.max", limits.pids_max.to_string()),
            ("cpu.max", format!("{} 100000", limits.cpu_quota_us)),
        ] {
            let got = read(&dir, file)?;
            check(
                got == want,
                format!("{what}: {file} is {got:?}, want {want:?}"),
            )?;
        }
        check(
            !dirs.contains(&dir),
            format!("{what} shares {}", dir.display()),
        )?;
        dirs.push(dir);
    }
    // Child 1's limit lowered under what its guest then writes: the kernel
    // ends that VMM, and only it.
    let mut victim = children.pop().ok_or("no child")?;
    let victim_dir = dirs[2].clone();
    let current: u64 = read(&victim_dir, "memory.current")?
        .parse()
        .map_err(|e| format!("memory.current: {e}"))?;
    // Where the host swaps, the limit would swap instead of ending it.
    let _ = std::fs::write(victim_dir.join("memory.swap.max"), "0");
    std::fs::write(
        victim_dir.join("memory.max"),
        (current + (64 << 20)).to_string(),
    )
    .map_err(|e| format!("lowering memory.max: {e}"))?;
    // 160 MiB: within the guest's tmpfs (half its RAM).
    let wrote = sh(
        victim.agent(),
        "dd if=/dev/zero of=/tmp/fill bs=1M count=160 2>&1 && echo wrote",
    );
    let state = || {
        [
            "memory.current",
            "memory.max",
            "memory.events",
            "cgroup.procs",
        ]
        .map(|f| format!("{f}: {:?}", read(&victim_dir, f).unwrap_or_default()))
        .join(", ")
    };
    check(
        wrote.is_err(),
        format!(
            "160 MiB written past a limit of 64 MiB more: {wrote:?}; {}",
            state()
        ),
    )?;
    let gone = poll::until(
        Instant::now() + Duration::from_secs(60),
        Duration::from_millis(100),
        || match victim.ended() {
            Some(end) => ControlFlow::Break(end),
            None => ControlFlow::Continue(()),
        },
    )
    .map_err(|_| {
        format!(
            "the VMM over its memory limit did not end within 60 s: the command: {wrote:?}; {}",
            state()
        )
    })?;
    check(
        gone.how.contains("OOM killer") && !gone.by_guest,
        format!("the VMM over its limit ended so: {gone:?}"),
    )?;
    sh(children[0].agent(), "true")?;
    sh(vm.agent(), "true")?;
    // A zygote runs nothing and is charged what its children share.
    vm.make_zygote().map_err(|e| format!("zygote: {e:#}"))?;
    for file in ["memory.max", "pids.max"] {
        let got = read(&dirs[0], file)?;
        check(got == "max", format!("the zygote's {file} is {got}"))?;
    }
    drop((victim, children, vm));
    poll::until(
        Instant::now() + Duration::from_secs(60),
        Duration::from_millis(100),
        || match dirs.iter().find(|d| d.exists()) {
            Some(left) => ControlFlow::Continue(left.clone()),
            None => ControlFlow::Break(()),
        },
    )
    .map_err(|poll::TimedOut(left)| {
        format!("{} still there a minute after its VMM", left.display())
    })?;
    Ok(())
}
