//! PID 1 duties at boot: pseudo file systems, kernel modules, the root
//! overlay, switching root, hostname, loopback.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::path::Path;
use std::thread;
use std::time::{Duration, Instant};

use forkbox_proto::BootInfo;

use crate::sys;

const MODULES_LIST: &str = "/forkbox/modules.list";
const ROOT_WAIT: Duration = Duration::from_secs(10);
const ROOT_POLL: Duration = Duration::from_millis(5);

/// Why the boot could not finish.
#[derive(Debug, thiserror::Error)]
pub enum InitError {
    #[error("mount {target} ({fstype})")]
    Mount {
        target: String,
        fstype: String,
        #[source]
        source: io::Error,
    },
    #[error("create {path}")]
    Mkdir {
        path: String,
        #[source]
        source: io::Error,
    },
    #[error("root device {0} did not appear within {ROOT_WAIT:?}")]
    RootMissing(String),
    #[error("switch root")]
    SwitchRoot(#[source] io::Error),
}

/// Kernel command line options for the agent.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Cmdline {
    pub root: Option<String>,
    pub rootfstype: String,
}

impl Cmdline {
    pub fn parse(text: &str) -> Self {
        let mut c = Self {
            root: None,
            rootfstype: "ext4".into(),
        };
        for word in text.split_whitespace() {
            if let Some(v) = word.strip_prefix("forkbox.root=") {
                c.root = Some(v.to_string()).filter(|v| !v.is_empty());
            } else if let Some(v) = word.strip_prefix("forkbox.rootfstype=") {
                c.rootfstype = v.to_string();
            }
        }
        c
    }
}

fn mkdir(path: &str) -> Result<(), InitError> {
    fs::create_dir_all(path).map_err(|source| InitError::Mkdir {
        path: path.into(),
        source,
    })
}

fn mount(
    source: &str,
    target: &str,
    fstype: &str,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> Result<(), InitError> {
    mkdir(target)?;
    sys::mount(source, target, Some(fstype), flags, data).map_err(|source| InitError::Mount {
        target: target.into(),
        fstype: fstype.into(),
        source,
    })
}

/// Mounts that may already exist (EBUSY is fine).
fn mount_early(source: &str, target: &str, fstype: &str) -> Result<(), InitError> {
    match mount(source, target, fstype, libc::MS_NOSUID, None) {
        Err(InitError::Mount { source, .. }) if source.raw_os_error() == Some(libc::EBUSY) => {
            Ok(())
        }
        other => other,
    }
}

/// Points fds 0, 1 and 2 at the console (the initramfs has no
/// `/dev/console` node when the kernel starts us, so they may be closed).
fn attach_console() {
    match OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/console")
    {
        Ok(console) => {
            for fd in 0..3 {
                let _ = sys::dup2(&console, fd);
            }
        }
        Err(e) => crate::log(&format!("cannot open /dev/console: {e}")),
    }
}

/// Loads the modules listed in `/forkbox/modules.list`; returns the ones
/// that failed (already loaded is not a failure).
fn load_modules() -> Vec<String> {
    let list = match fs::read_to_string(MODULES_LIST) {
        Ok(l) => l,
        Err(e) => {
            crate::log(&format!("no {MODULES_LIST}: {e}"));
            return Vec::new();
        }
    };
    let mut failed = Vec::new();
    for path in list.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let res = match File::open(path) {
            Ok(f) => match sys::finit_module(&f) {
                Ok(()) => Ok(()),
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) => Ok(()),
                // What the kernel answers for an unresolved symbol.
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Err(format!(
                    "{e} (unknown symbol: is a dependency missing or listed later?)"
                )),
                Err(e) => Err(e.to_string()),
            },
            Err(e) => Err(format!("open: {e}")),
        };
        if let Err(e) = res {
            crate::log(&format!("module {path}: {e}"));
            failed.push(path.to_string());
        }
    }
    failed
}

fn wait_for(dev: &str) -> Result<(), InitError> {
    let start = Instant::now();
    while !Path::new(dev).exists() {
        if start.elapsed() > ROOT_WAIT {
            return Err(InitError::RootMissing(dev.into()));
        }
        thread::sleep(ROOT_POLL);
    }
    Ok(())
}

/// Read-only root + tmpfs upper joined by overlayfs at `/newroot`, then
/// `/dev`, `/proc`, `/sys` moved in and the root switched.
fn switch_to_root(dev: &str, fstype: &str) -> Result<(), InitError> {
    wait_for(dev)?;
    mount(dev, "/.lower", fstype, libc::MS_RDONLY, None)?;
    mount("tmpfs", "/.rw", "tmpfs", 0, Some("mode=0755"))?;
    mkdir("/.rw/upper")?;
    mkdir("/.rw/work")?;
    mount(
        "overlay",
        "/newroot",
        "overlay",
        0,
        Some("lowerdir=/.lower,upperdir=/.rw/upper,workdir=/.rw/work"),
    )?;
    for dir in ["/dev", "/proc", "/sys"] {
        let target = format!("/newroot{dir}");
        mkdir(&target)?;
        sys::mount(dir, &target, None, libc::MS_MOVE, None).map_err(|source| InitError::Mount {
            target,
            fstype: "move".into(),
            source,
        })?;
    }
    free_initramfs();
    // As switch_root(8): the initramfs cannot be pivot_root'ed, so move the
    // new root over `/` and chroot into it.
    std::env::set_current_dir("/newroot").map_err(InitError::SwitchRoot)?;
    sys::mount(".", "/", None, libc::MS_MOVE, None).map_err(InitError::SwitchRoot)?;
    std::os::unix::fs::chroot(".").map_err(InitError::SwitchRoot)?;
    std::env::set_current_dir("/").map_err(InitError::SwitchRoot)?;
    Ok(())
}

/// Deletes what the initramfs held once it is no longer needed (modules
/// are loaded, the root is mounted), as switch_root(8) does: its pages
/// would otherwise stay resident, hidden under the new root. Best effort.
fn free_initramfs() {
    for path in ["/init", "/forkbox", "/lib/modules"] {
        let res = match fs::symlink_metadata(path) {
            Ok(m) if m.is_dir() => fs::remove_dir_all(path),
            Ok(_) => fs::remove_file(path),
            Err(_) => continue,
        };
        if let Err(e) = res {
            crate::log(&format!("cannot free {path}: {e}"));
        }
    }
}

/// Runs the whole boot sequence.
pub fn boot(start: Instant) -> Result<BootInfo, InitError> {
    mount_early("devtmpfs", "/dev", "devtmpfs")?;
    attach_console();
    mount_early("proc", "/proc", "proc")?;
    mount_early("sysfs", "/sys", "sysfs")?;
    let module_failures = load_modules();
    let cmdline = Cmdline::parse(&fs::read_to_string("/proc/cmdline").unwrap_or_default());
    if let Some(dev) = &cmdline.root {
        switch_to_root(dev, &cmdline.rootfstype)?;
        crate::log(&format!(
            "root: {dev} ({}, read-only) under a tmpfs overlay",
            cmdline.rootfstype
        ));
    }
    // Conveniences: failures are logged, not fatal.
    let extra = [
        (
            "devpts",
            "/dev/pts",
            "devpts",
            Some("mode=0620,ptmxmode=0666"),
        ),
        ("tmpfs", "/dev/shm", "tmpfs", Some("mode=1777")),
        ("tmpfs", "/tmp", "tmpfs", Some("mode=1777")),
        ("tmpfs", "/run", "tmpfs", Some("mode=0755")),
    ];
    for (src, target, fstype, data) in extra {
        let flags = libc::MS_NOSUID | libc::MS_NODEV;
        if let Err(e) = mount(src, target, fstype, flags, data) {
            crate::log(&crate::chain(&e));
        }
    }
    if let Err(e) = sys::sethostname("forkbox") {
        crate::log(&format!("sethostname: {e}"));
    }
    if let Err(e) = sys::interface_up("lo") {
        crate::log(&format!("lo up: {e}"));
    }
    Ok(BootInfo {
        pid1: true,
        kernel: kernel_release(),
        root_device: cmdline.root,
        boot_ms: u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX),
        module_failures,
    })
}

pub fn kernel_release() -> String {
    fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cmdline_root_and_fstype_parsed() {
        let c = Cmdline::parse("console=ttyS0 forkbox.root=/dev/vda forkbox.rootfstype=xfs quiet");
        assert_eq!(c.root.as_deref(), Some("/dev/vda"));
        assert_eq!(c.rootfstype, "xfs");
    }

    #[test]
    fn cmdline_without_root_stays_in_initramfs() {
        let c = Cmdline::parse("console=ttyS0 forkbox.root=");
        assert_eq!(c.root, None);
        assert_eq!(c.rootfstype, "ext4");
    }
}
