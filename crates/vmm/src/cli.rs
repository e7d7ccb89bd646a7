//! The command line, exactly as the forkbox CLI and daemon call it:
//! `forkbox-vmm --kernel PATH --initramfs PATH --cmdline STR [--vcpus N=1]
//! [--memory-mib N=512] [--disk PATH]... [--vsock-uds PATH]
//! [--serial-log PATH] [--serial-stdout] [--control PATH]
//! [--net-policy PATH [--net-broker PATH] [--net-log PATH]]
//! [--orphan-grace-secs N]`, or
//! `forkbox-vmm --restore DIR [--control PATH] [--vsock-uds PATH]
//! [--serial-log PATH] [--serial-stdout] [--net-policy ...]
//! [--orphan-grace-secs N]` (hardware and
//! disks come from `DIR/state.json`; a VM saved with a network needs
//! `--net-policy` again).

use std::path::PathBuf;

use crate::net::NetConfig;

use clap::Parser;

use crate::{Echo, Endpoints, VmConfig};
use forkbox_vmm_api::shape::{ShapeError, VmShape};

#[derive(Debug, Parser)]
#[command(name = "forkbox-vmm", about = "Run one forkbox microVM on KVM")]
pub struct Args {
    /// Kernel bzImage.
    #[arg(long, required_unless_present = "restore")]
    pub kernel: Option<PathBuf>,
    /// initramfs (cpio, optionally compressed as the kernel supports).
    #[arg(long, required_unless_present = "restore")]
    pub initramfs: Option<PathBuf>,
    /// Kernel command line.
    #[arg(long, required_unless_present = "restore")]
    pub cmdline: Option<String>,
    /// Restore the snapshot in this directory (`memory`, `state.json`)
    /// instead of booting.
    #[arg(long, conflicts_with_all = ["kernel", "initramfs", "cmdline", "layers", "disks"])]
    pub restore: Option<PathBuf>,
    /// Serve the control socket (JSON lines) at this path.
    #[arg(long)]
    pub control: Option<PathBuf>,
    /// Number of vCPUs (1-8: `forkbox_vmm_api::shape`).
    #[arg(long, default_value_t = 1)]
    pub vcpus: u8,
    /// Guest RAM in MiB (128-16384: `forkbox_vmm_api::shape`).
    #[arg(long, default_value_t = 512)]
    pub memory_mib: u64,
    /// An image layer (an erofs file); repeat for each, bottom first. They
    /// make one read-only disk, the first (/dev/vda), partition N holding
    /// layer N (/dev/vdaN).
    #[arg(long = "layer")]
    pub layers: Vec<PathBuf>,
    /// Read-only virtio-blk disk; repeat for more (after the layers' disk,
    /// if any; else the first is /dev/vda).
    #[arg(long = "disk")]
    pub disks: Vec<PathBuf>,
    /// A writable disk's golden base (read-only; a whole number of 4 KiB
    /// blocks); repeat for more (after the read-only disks, in order; the
    /// guest finds disk N by its serial `fbx-rw-N`). Each needs a
    /// `--writable-top`.
    #[arg(long = "writable-disk", conflicts_with = "restore")]
    pub writable: Vec<PathBuf>,
    /// An empty file, one per writable disk (of the command line, or of the
    /// restored snapshot), in order: where that disk's writes go. The VMM
    /// opens it before it enters its own root and unlinks it, so that its
    /// blocks are freed once no VMM holds it.
    #[arg(long = "writable-top")]
    pub writable_tops: Vec<PathBuf>,
    /// Enable virtio-vsock (guest CID 3) with its host side at this unix socket.
    #[arg(long)]
    pub vsock_uds: Option<PathBuf>,
    /// Append serial output to this file.
    #[arg(long)]
    pub serial_log: Option<PathBuf>,
    /// Also copy serial output to stderr.
    #[arg(long)]
    pub serial_stdout: bool,
    /// Attach virtio-net behind the userspace gateway, with this egress
    /// policy (JSON: `{"allow_out": [...], "deny_out": [...]}`).
    #[arg(long)]
    pub net_policy: Option<PathBuf>,
    /// The network broker's socket (SOCK_SEQPACKET): it resolves names and
    /// opens allowed connections. Without it the VMM reaches only
    /// `host.forkbox.internal` (the host's loopback) itself.
    #[arg(long, requires = "net_policy")]
    pub net_broker: Option<PathBuf>,
    /// Append the egress log (JSON lines) to this file.
    #[arg(long, requires = "net_policy")]
    pub net_log: Option<PathBuf>,
    /// End the VM when no control connection has owned it (`{"op":"own"}`)
    /// for this many seconds: from the start, from its last owner's going
    /// (a daemon that died and was not followed by one that adopts it),
    /// and from the last control connection accepted while unowned (an
    /// owner about to say so). Counted by the VMM's running loop: a stall
    /// of the whole machine counts at most 1.5 s. Fork children inherit
    /// it. Without it the VM runs unowned.
    #[arg(long)]
    pub orphan_grace_secs: Option<u64>,
    /// Exit with an error instead of running without a part of the jail
    /// this host does not allow (leaving the host's network and mount
    /// namespaces).
    #[arg(long)]
    pub require_jail: bool,
    /// Build this VMM's own root in this empty directory and `pivot_root`
    /// into it (`mounts::enter_jail`, which needs CAP_SYS_ADMIN): there it
    /// and its fork children find `/proc`, the files this command line
    /// names (kernel, initramfs, disks, the snapshot restored), read-only,
    /// and nothing else of the host's: the sockets and logs it names are
    /// opened before.
    #[arg(long)]
    pub root: Option<PathBuf>,
    /// Run the guest as this user and group (`UID:GID`, both numbers): the
    /// VMM gives up root for them once its VM is built, before any guest
    /// instruction runs (it needs CAP_SETUID and CAP_SETGID to).
    #[arg(long, value_parser = parse_user)]
    pub run_as: Option<(u32, u32)>,
    /// Join this cgroup (a cgroup v2 directory, made with its limits by
    /// the caller) first thing, before opening anything; a fork child
    /// joins its own first thing after the fork, through the cgroup's
    /// `cgroup.procs` the caller sends, opened, with the fork request.
    #[arg(long)]
    pub cgroup: Option<PathBuf>,
}

/// `UID:GID`, neither of them root's.
fn parse_user(s: &str) -> Result<(u32, u32), String> {
    let (uid, gid) = s
        .split_once(':')
        .ok_or_else(|| format!("`{s}` is not UID:GID"))?;
    let number = |what: &str, v: &str| {
        v.parse::<u32>()
            .map_err(|e| format!("the {what} in `{s}`: {e}"))
    };
    let (uid, gid) = (number("uid", uid)?, number("gid", gid)?);
    if uid == 0 || gid == 0 {
        return Err(format!(
            "`{s}` is root's: the VMM runs as root without --run-as"
        ));
    }
    Ok((uid, gid))
}

/// Why the command line cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error("cannot read the network policy {path}")]
    NetPolicy {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("this VM cannot run")]
    Shape(#[source] ShapeError),
    #[error("{disks} writable disks and {tops} writable tops: each disk needs one top")]
    WritableTops { disks: usize, tops: usize },
    #[error("{0} writable disks: at most {max}", max = forkbox_vmm_api::MAX_WRITABLE_DISKS)]
    TooManyWritable(usize),
}

/// How this VMM process was asked to run: boot a kernel, or restore a
/// snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Invocation {
    Boot(VmConfig),
    Restore { dir: PathBuf, endpoints: Endpoints },
}

impl Invocation {
    /// The files this VMM reads by path after it starts: the kernel, the
    /// initramfs and the disks, or the snapshot's directory and the disks
    /// its `state.json` names (an unreadable one is left for the restore
    /// to report).
    pub fn inputs(&self) -> Vec<PathBuf> {
        match self {
            Invocation::Boot(c) => [c.kernel.clone(), c.initramfs.clone()]
                .into_iter()
                .chain(c.layers.iter().cloned())
                .chain(c.disks.iter().cloned())
                .chain(c.writable.iter().cloned())
                .collect(),
            Invocation::Restore { dir, .. } => {
                let disks = std::fs::read(dir.join("state.json"))
                    .ok()
                    .and_then(|bytes| crate::state::MachineState::from_json(&bytes).ok())
                    .map(|saved| {
                        let hw = saved.hardware;
                        let bases = hw.writable.into_iter().map(|w| w.base);
                        [hw.layers, hw.disks, bases.collect()].concat()
                    })
                    .unwrap_or_default();
                std::iter::once(dir.clone()).chain(disks).collect()
            }
        }
    }

    /// Where the VM's endpoints are, to be opened ([`Endpoints::open`])
    /// before the VMM enters its own root.
    pub fn endpoints(&self) -> Endpoints {
        match self {
            Invocation::Boot(c) => Endpoints {
                control: c.control.clone(),
                vsock_uds: c.vsock_uds.clone(),
                serial_log: c.serial_log.clone(),
                echo: c.echo,
                net: c.net.clone(),
                writable_tops: c.writable_tops.clone(),
            },
            Invocation::Restore { endpoints, .. } => endpoints.clone(),
        }
    }

    /// Whether the VMM opens connections itself: a network without a
    /// broker (it connects to the host's loopback). Every other VMM talks
    /// only over unix sockets named by path, which work from any network
    /// namespace.
    pub fn needs_host_network(&self) -> bool {
        let net = match self {
            Invocation::Boot(c) => &c.net,
            Invocation::Restore { endpoints, .. } => &endpoints.net,
        };
        net.as_ref().is_some_and(|n| n.broker.is_none())
    }
}

impl Args {
    pub fn into_invocation(self) -> Result<Invocation, CliError> {
        // Restoring takes the shape from the snapshot, not from these.
        if self.restore.is_none() {
            VmShape {
                vcpus: self.vcpus,
                memory_mib: self.memory_mib,
            }
            .validate()
            .map_err(CliError::Shape)?;
            if self.writable.len() > usize::from(forkbox_vmm_api::MAX_WRITABLE_DISKS) {
                return Err(CliError::TooManyWritable(self.writable.len()));
            }
            if self.writable.len() != self.writable_tops.len() {
                return Err(CliError::WritableTops {
                    disks: self.writable.len(),
                    tops: self.writable_tops.len(),
                });
            }
        }
        let net = match &self.net_policy {
            Some(path) => Some(NetConfig {
                policy_json: std::fs::read_to_string(path).map_err(|source| {
                    CliError::NetPolicy {
                        path: path.clone(),
                        source,
                    }
                })?,
                broker: self.net_broker.clone(),
                log: self.net_log.clone(),
            }),
            None => None,
        };
        let echo = if self.serial_stdout {
            Echo::Stderr
        } else {
            Echo::Off
        };
        Ok(
            match (self.restore, self.kernel, self.initramfs, self.cmdline) {
                (None, Some(kernel), Some(initramfs), Some(cmdline)) => {
                    Invocation::Boot(VmConfig {
                        kernel,
                        initramfs,
                        cmdline,
                        vcpus: self.vcpus,
                        memory_mib: self.memory_mib,
                        layers: self.layers,
                        disks: self.disks,
                        writable: self.writable,
                        writable_tops: self.writable_tops,
                        vsock_uds: self.vsock_uds,
                        serial_log: self.serial_log,
                        echo,
                        control: self.control,
                        net,
                    })
                }
                // clap enforces: either --restore, or all three boot options.
                (restore, ..) => Invocation::Restore {
                    dir: restore.unwrap_or_default(),
                    endpoints: Endpoints {
                        control: self.control,
                        vsock_uds: self.vsock_uds,
                        serial_log: self.serial_log,
                        echo,
                        net,
                        writable_tops: self.writable_tops,
                    },
                },
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use forkbox_vmm_api::shape::{MAX_MEMORY_MIB, MAX_VCPUS, MIN_MEMORY_MIB, MIN_VCPUS};

    const BASE: [&str; 7] = [
        "forkbox-vmm",
        "--kernel",
        "/k",
        "--initramfs",
        "/i",
        "--cmdline",
        "console=ttyS0 panic=-1",
    ];

    fn parse(extra: &[&str]) -> Result<VmConfig, Box<dyn std::error::Error>> {
        let argv = BASE.iter().chain(extra).copied();
        match Args::try_parse_from(argv)?.into_invocation()? {
            Invocation::Boot(c) => Ok(c),
            other => panic!("not a boot: {other:?}"),
        }
    }

    #[test]
    fn parse_minimal_uses_defaults() {
        let c = parse(&[]).expect("valid");
        assert_eq!(c.vcpus, 1);
        assert_eq!(c.memory_mib, 512);
        assert_eq!(c.cmdline, "console=ttyS0 panic=-1");
        assert!(c.disks.is_empty());
        assert_eq!(c.vsock_uds, None);
        assert_eq!(c.echo, Echo::Off);
        assert!(c.devices().is_empty());
    }

    #[test]
    fn parse_full_disks_in_order_then_vsock() {
        let c = parse(&[
            "--vcpus",
            "8",
            "--memory-mib",
            "16384",
            "--disk",
            "/a",
            "--layer",
            "/base",
            "--disk",
            "/b",
            "--layer",
            "/top",
            "--vsock-uds",
            "/s",
            "--serial-log",
            "/l",
            "--serial-stdout",
        ])
        .expect("valid");
        assert_eq!((c.vcpus, c.memory_mib), (8, 16384));
        assert_eq!(c.disks, vec![PathBuf::from("/a"), PathBuf::from("/b")]);
        assert_eq!(
            c.layers,
            vec![PathBuf::from("/base"), PathBuf::from("/top")]
        );
        assert_eq!(c.serial_log, Some(PathBuf::from("/l")));
        assert_eq!(c.echo, Echo::Stderr);
        assert_eq!(
            c.devices(),
            vec![
                crate::virtio::DeviceSpec::Layers(vec!["/base".into(), "/top".into()]),
                crate::virtio::DeviceSpec::Block("/a".into()),
                crate::virtio::DeviceSpec::Block("/b".into()),
                crate::virtio::DeviceSpec::Vsock { uds: "/s".into() },
            ]
        );
    }

    #[test]
    fn parse_out_of_range_rejected() {
        assert!(parse(&["--vcpus", "0"]).is_err());
        assert!(parse(&["--vcpus", "9"]).is_err());
        assert!(parse(&["--memory-mib", "127"]).is_err());
        assert!(parse(&["--memory-mib", "16385"]).is_err());
        assert!(parse(&["--vcpus", "300"]).is_err());
    }

    #[test]
    fn parse_shape_bounds_are_the_api_limits() {
        let vcpus = |n: u8| parse(&["--vcpus", &n.to_string()]).map(|c| c.vcpus);
        let mib = |n: u64| parse(&["--memory-mib", &n.to_string()]).map(|c| c.memory_mib);
        assert_eq!(vcpus(MIN_VCPUS).expect("min"), MIN_VCPUS);
        assert_eq!(vcpus(MAX_VCPUS).expect("max"), MAX_VCPUS);
        assert_eq!(mib(MIN_MEMORY_MIB).expect("min"), MIN_MEMORY_MIB);
        assert_eq!(mib(MAX_MEMORY_MIB).expect("max"), MAX_MEMORY_MIB);
        let e = parse(&["--vcpus", "9"]).expect_err("too many");
        assert_eq!(
            e.source().map(ToString::to_string).as_deref(),
            Some("vcpus must be 1-8, not 9")
        );
    }

    #[test]
    fn parse_restore_needs_no_kernel_and_keeps_endpoints() {
        let a = Args::try_parse_from([
            "forkbox-vmm",
            "--restore",
            "/snap",
            "--control",
            "/c",
            "--vsock-uds",
            "/v",
            "--serial-log",
            "/l",
        ])
        .expect("valid");
        assert_eq!(
            a.into_invocation().expect("no files named"),
            Invocation::Restore {
                dir: "/snap".into(),
                endpoints: Endpoints {
                    control: Some("/c".into()),
                    vsock_uds: Some("/v".into()),
                    serial_log: Some("/l".into()),
                    echo: Echo::Off,
                    net: None,
                    writable_tops: Vec::new(),
                }
            }
        );
        assert!(
            Args::try_parse_from(["forkbox-vmm", "--restore", "/s", "--kernel", "/k"]).is_err()
        );
    }

    #[test]
    fn parse_net_reads_policy_and_needs_it_for_broker_and_log() {
        let dir = std::env::temp_dir().join(format!("forkbox-vmm-cli-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let policy = dir.join("p.json");
        std::fs::write(&policy, r#"{"allow_out":["host.forkbox.internal:80"]}"#).expect("write");
        let p = policy.to_str().expect("utf-8 path");
        let c =
            parse(&["--net-policy", p, "--net-broker", "/b", "--net-log", "/l"]).expect("valid");
        let net = c.net.clone().expect("net");
        assert!(net.policy_json.contains("host.forkbox.internal"));
        assert_eq!(net.broker, Some("/b".into()));
        assert_eq!(net.log, Some("/l".into()));
        assert!(matches!(
            c.devices().last(),
            Some(crate::virtio::DeviceSpec::Net(_))
        ));
        assert!(parse(&["--net-broker", "/b"]).is_err());
        assert!(parse(&["--net-log", "/l"]).is_err());
        let missing = Args::try_parse_from(
            BASE.iter()
                .chain(&["--net-policy", "/nonexistent"])
                .copied(),
        )
        .expect("parses");
        assert!(missing.into_invocation().is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn parse_control_socket() {
        assert_eq!(
            parse(&["--control", "/c"]).expect("valid").control,
            Some("/c".into())
        );
    }

    #[test]
    fn parse_missing_kernel_rejected() {
        assert!(
            Args::try_parse_from(["forkbox-vmm", "--initramfs", "/i", "--cmdline", "x"]).is_err()
        );
    }
}
