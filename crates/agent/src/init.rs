//! PID 1 duties at boot: pseudo file systems, kernel modules, the root
//! overlay, switching root, writable disks (`forkbox.disks=`), hostname,
//! loopback, and (with `forkbox.net=1`)
//! the guest network: `eth0` at 10.0.2.15/24, default route and DNS server
//! 10.0.2.2 (the VMM's userspace gateway).

use std::fs::{self, File, OpenOptions};
use std::io;
use std::net::Ipv4Addr;
use std::path::Path;
use std::thread;
use std::time::{Duration, Instant};

use forkbox_proto::BootInfo;

use crate::sys::{self, MountFlags};

const MODULES_LIST: &str = "/forkbox/modules.list";
const ROOT_WAIT: Duration = Duration::from_secs(10);
const ROOT_POLL: Duration = Duration::from_millis(5);
/// How long `eth0` may take to appear once `virtio_net` is loaded.
const NET_WAIT: Duration = Duration::from_secs(5);
/// Modules loaded only for a VM with a network.
const NET_MODULES: &[&str] = &["virtio_net", "net_failover", "failover"];
/// The file system of image layers (loaded only for a layered root).
const LAYER_MODULE: &str = "erofs";
/// The most layers a root stacks (the host's layered disk holds 128).
const MAX_LAYERS: u32 = 128;
pub(crate) const GUEST_IP: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 15);
pub(crate) const GATEWAY_IP: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 2);
pub(crate) const PREFIX_LEN: u8 = 24;

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
    #[error("writable disk {0} (serial fbx-rw-{0}) did not appear within {ROOT_WAIT:?}")]
    DiskMissing(usize),
    #[error("switch root")]
    SwitchRoot(#[source] io::Error),
}

/// Kernel command line options for the agent.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Cmdline {
    pub root: Option<String>,
    pub rootfstype: String,
    /// `forkbox.layers=N`: the root device holds an image's N layers, one
    /// per partition, bottom first (`vda1` is the base), stacked by
    /// overlayfs; else the root device is the whole image.
    pub layers: u32,
    /// `forkbox.net=1`: the VM has a virtio-net device to configure.
    pub net: bool,
    /// `forkbox.modules=/dev/vdb`: the kernel's module tree (erofs),
    /// mounted at `/lib/modules/<release>` for the kernel to load from.
    pub modules: Option<String>,
    /// `forkbox.disks=/a,/b`: where writable disk N (serial `fbx-rw-N`)
    /// is mounted, in order (at most [`MAX_DISKS`]; the host checked the
    /// paths).
    pub disks: Vec<String>,
}

/// The most writable disks a VM has (`forkbox_vmm_api::MAX_WRITABLE_DISKS`).
const MAX_DISKS: usize = 4;

impl Cmdline {
    pub fn parse(text: &str) -> Self {
        let mut c = Self {
            root: None,
            rootfstype: "ext4".into(),
            layers: 0,
            net: false,
            modules: None,
            disks: Vec::new(),
        };
        for word in text.split_whitespace() {
            if let Some(v) = word.strip_prefix("forkbox.root=") {
                c.root = Some(v.to_string()).filter(|v| !v.is_empty());
            } else if let Some(v) = word.strip_prefix("forkbox.rootfstype=") {
                c.rootfstype = v.to_string();
            } else if let Some(v) = word.strip_prefix("forkbox.layers=") {
                c.layers = v.parse().unwrap_or(0).min(MAX_LAYERS);
            } else if let Some(v) = word.strip_prefix("forkbox.net=") {
                c.net = v == "1";
            } else if let Some(v) = word.strip_prefix("forkbox.modules=") {
                c.modules = Some(v.to_string()).filter(|v| v.starts_with("/dev/"));
            } else if let Some(v) = word.strip_prefix("forkbox.disks=") {
                c.disks = v
                    .split(',')
                    .filter(|p| p.starts_with('/') && p.len() > 1)
                    .take(MAX_DISKS)
                    .map(str::to_owned)
                    .collect();
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
    flags: MountFlags,
    data: Option<&str>,
) -> Result<(), InitError> {
    mkdir(target)?;
    sys::mount(source, target, fstype, flags, data).map_err(|source| InitError::Mount {
        target: target.into(),
        fstype: fstype.into(),
        source,
    })
}

/// Mounts that may already exist (EBUSY is fine).
fn mount_early(source: &str, target: &str, fstype: &str) -> Result<(), InitError> {
    match mount(source, target, fstype, MountFlags::NOSUID, None) {
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
            let _ = sys::set_stdio(&console);
        }
        Err(e) => crate::log(&format!("cannot open /dev/console: {e}")),
    }
}

/// The module's name from its path (`.../virtio_net.ko` → `virtio_net`).
fn module_name(path: &str) -> &str {
    let file = path.rsplit('/').next().unwrap_or(path);
    file.split('.').next().unwrap_or(file)
}

/// Loads the modules listed in `/forkbox/modules.list` (the network's only
/// with `net`, erofs only with an erofs disk: a layered root or the
/// module tree); returns the ones that failed (already loaded is not a
/// failure).
fn load_modules(net: bool, erofs: bool) -> Vec<String> {
    let list = match fs::read_to_string(MODULES_LIST) {
        Ok(l) => l,
        Err(e) => {
            crate::log(&format!("no {MODULES_LIST}: {e}"));
            return Vec::new();
        }
    };
    let mut failed = Vec::new();
    let wanted = |p: &&str| {
        let name = module_name(p);
        (net || !NET_MODULES.contains(&name)) && (erofs || name != LAYER_MODULE)
    };
    for path in list
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .filter(wanted)
    {
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

/// Read-only root (one image, or an image's layers) + tmpfs upper joined
/// by overlayfs at `/newroot`, then `/dev`, `/proc`, `/sys` moved in and
/// the root switched.
fn switch_to_root(dev: &str, fstype: &str, layers: u32) -> Result<(), InitError> {
    wait_for(dev)?;
    let lower = if layers == 0 {
        mount(dev, "/.lower", fstype, MountFlags::RDONLY, None)?;
        "/.lower".to_owned()
    } else {
        // Partition i holds layer i; overlayfs wants the top one first.
        let mut dirs = Vec::new();
        for i in (1..=layers).rev() {
            let (part, dir) = (format!("{dev}{i}"), format!("/.lower/{i}"));
            wait_for(&part)?;
            mkdir(&dir)?;
            mount(&part, &dir, fstype, MountFlags::RDONLY, None)?;
            dirs.push(dir);
        }
        dirs.join(":")
    };
    let options = format!("lowerdir={lower},upperdir=/.rw/upper,workdir=/.rw/work");
    mount(
        "tmpfs",
        "/.rw",
        "tmpfs",
        MountFlags::empty(),
        Some("mode=0755"),
    )?;
    mkdir("/.rw/upper")?;
    mkdir("/.rw/work")?;
    mount(
        "overlay",
        "/newroot",
        "overlay",
        MountFlags::empty(),
        Some(&options),
    )?;
    for dir in ["/dev", "/proc", "/sys"] {
        let target = format!("/newroot{dir}");
        mkdir(&target)?;
        sys::mount_move(dir, &target).map_err(|source| InitError::Mount {
            target,
            fstype: "move".into(),
            source,
        })?;
    }
    free_initramfs();
    // As switch_root(8): the initramfs cannot be pivot_root'ed, so move the
    // new root over `/` and chroot into it.
    std::env::set_current_dir("/newroot").map_err(InitError::SwitchRoot)?;
    sys::mount_move(".", "/").map_err(InitError::SwitchRoot)?;
    std::os::unix::fs::chroot(".").map_err(InitError::SwitchRoot)?;
    std::env::set_current_dir("/").map_err(InitError::SwitchRoot)?;
    Ok(())
}

/// The block device whose serial is `serial` (`/sys/block/*/serial`),
/// waiting for it as for the root.
fn device_with_serial(serial: &str) -> Option<String> {
    let start = Instant::now();
    loop {
        let found = fs::read_dir("/sys/block").ok().and_then(|entries| {
            entries.flatten().find_map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                let theirs = fs::read_to_string(e.path().join("serial")).ok()?;
                (theirs.trim_end_matches(['\0', '\n']) == serial).then(|| format!("/dev/{name}"))
            })
        });
        if found.is_some() || start.elapsed() > ROOT_WAIT {
            return found;
        }
        thread::sleep(ROOT_POLL);
    }
}

/// Mounts the kernel's module tree (`dev`, erofs) read-only at
/// `/lib/modules/<release>`, so that `modprobe` and the kernel's own
/// requests find every module. A failure is logged: the guest runs on
/// without modules it did not load at boot.
fn mount_module_tree(dev: &str) {
    let target = format!("/lib/modules/{}", kernel_release());
    let mounted = wait_for(dev)
        .and_then(|()| {
            fs::create_dir_all(&target).map_err(|source| InitError::Mkdir {
                path: target.clone(),
                source,
            })
        })
        .and_then(|()| mount(dev, &target, "erofs", MountFlags::RDONLY, None));
    if let Err(e) = mounted {
        crate::log(&format!("the kernel's modules: {}", crate::chain(&e)));
    }
}

/// Mounts writable disk `i` at `mounts[i]` (created in the root if
/// missing). The kernel is told not to initialise its inode tables in the
/// background: that would write all of them into the VM's own blocks.
fn mount_disks(mounts: &[String]) -> Result<(), InitError> {
    for (i, target) in mounts.iter().enumerate() {
        let dev = device_with_serial(&format!("fbx-rw-{i}")).ok_or(InitError::DiskMissing(i))?;
        fs::create_dir_all(target).map_err(|source| InitError::Mkdir {
            path: target.clone(),
            source,
        })?;
        mount(
            &dev,
            target,
            "ext4",
            MountFlags::empty(),
            Some("noinit_itable"),
        )?;
        crate::log(&format!("writable disk {i}: {dev} at {target}"));
    }
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
    let cmdline = Cmdline::parse(&fs::read_to_string("/proc/cmdline").unwrap_or_default());
    let module_failures =
        load_modules(cmdline.net, cmdline.layers > 0 || cmdline.modules.is_some());
    if let Some(dev) = &cmdline.root {
        switch_to_root(dev, &cmdline.rootfstype, cmdline.layers)?;
        crate::log(&format!(
            "root: {dev} ({}, {} layers, read-only) under a tmpfs overlay",
            cmdline.rootfstype, cmdline.layers
        ));
    }
    if let Some(dev) = &cmdline.modules {
        mount_module_tree(dev);
    }
    mount_disks(&cmdline.disks)?;
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
        let flags = MountFlags::NOSUID | MountFlags::NODEV;
        if let Err(e) = mount(src, target, fstype, flags, data) {
            crate::log(&crate::chain(&e));
        }
    }
    if let Err(e) = crate::cgroup::setup() {
        crate::log(&format!(
            "commands run without cgroups (no bounds on the policy's, no cgroup.kill): {e}"
        ));
    }
    if let Err(e) = sys::sethostname("forkbox") {
        crate::log(&format!("sethostname: {e}"));
    }
    if let Err(e) = sys::interface_up("lo") {
        crate::log(&format!("lo up: {e}"));
    }
    if cmdline.net {
        if let Err(e) = network_up() {
            crate::log(&format!("network: {e}"));
        }
    }
    Ok(BootInfo {
        pid1: true,
        kernel: kernel_release(),
        root_device: cmdline.root,
        boot_ms: u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX),
        module_failures,
    })
}

/// `eth0` at 10.0.2.15/24, up, default route via 10.0.2.2, which is also
/// the DNS server (`/etc/resolv.conf` on the overlay root).
fn network_up() -> io::Result<()> {
    let start = Instant::now();
    while !Path::new("/sys/class/net/eth0").exists() {
        if start.elapsed() > NET_WAIT {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("eth0 did not appear within {NET_WAIT:?}"),
            ));
        }
        thread::sleep(ROOT_POLL);
    }
    sys::set_ipv4("eth0", GUEST_IP, PREFIX_LEN)?;
    sys::interface_up("eth0")?;
    sys::add_default_route(GATEWAY_IP)?;
    // /etc/resolv.conf may be a symlink into /run (systemd-resolved).
    let _ = fs::remove_file("/etc/resolv.conf");
    fs::write("/etc/resolv.conf", format!("nameserver {GATEWAY_IP}\n"))?;
    // The MTU is the device's (virtio-net offers 65520): left alone here.
    let mtu = fs::read_to_string("/sys/class/net/eth0/mtu").unwrap_or_default();
    crate::log(&format!(
        "network: eth0 {GUEST_IP}/{PREFIX_LEN} mtu {}, gateway and DNS {GATEWAY_IP}",
        mtu.trim()
    ));
    Ok(())
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
    fn cmdline_layers_parsed_and_bounded() {
        let c = Cmdline::parse("forkbox.root=/dev/vda forkbox.rootfstype=erofs forkbox.layers=3");
        assert_eq!((c.rootfstype.as_str(), c.layers), ("erofs", 3));
        assert_eq!(Cmdline::parse("forkbox.layers=100000").layers, MAX_LAYERS);
        assert_eq!(Cmdline::parse("forkbox.layers=x").layers, 0);
        assert_eq!(Cmdline::parse("").layers, 0);
    }

    #[test]
    fn cmdline_without_root_stays_in_initramfs() {
        let c = Cmdline::parse("console=ttyS0 forkbox.root=");
        assert_eq!(c.root, None);
        assert_eq!(c.rootfstype, "ext4");
        assert!(!c.net);
    }

    #[test]
    fn cmdline_modules_device_parsed() {
        let c = Cmdline::parse("forkbox.root=/dev/vda forkbox.modules=/dev/vdb");
        assert_eq!(c.modules.as_deref(), Some("/dev/vdb"));
        assert_eq!(Cmdline::parse("forkbox.modules=/etc/x").modules, None);
    }

    #[test]
    fn cmdline_disks_parsed_in_order_and_bounded() {
        let c = Cmdline::parse("quiet forkbox.disks=/var/lib/docker,/workspace net");
        assert_eq!(c.disks, ["/var/lib/docker", "/workspace"]);
        let c = Cmdline::parse("forkbox.disks=/a,relative,/,/b,/c,/d,/e");
        assert_eq!(c.disks, ["/a", "/b", "/c", "/d"], "absolute, at most 4");
        assert!(Cmdline::parse("forkbox.net=1").disks.is_empty());
    }

    #[test]
    fn cmdline_net_flag_and_module_names() {
        assert!(Cmdline::parse("quiet forkbox.net=1").net);
        assert!(!Cmdline::parse("forkbox.net=0").net);
        assert_eq!(
            module_name("/lib/modules/6.1/kernel/drivers/net/virtio_net.ko"),
            "virtio_net"
        );
        assert_eq!(module_name("net_failover.ko.xz"), "net_failover");
    }
}
