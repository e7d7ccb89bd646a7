//! The command line, exactly as the forkbox CLI and daemon call it:
//! `forkbox-vmm --kernel PATH --initramfs PATH --cmdline STR [--vcpus N=1]
//! [--memory-mib N=512] [--disk PATH]... [--vsock-uds PATH]
//! [--serial-log PATH] [--serial-stdout]`

use std::path::PathBuf;

use clap::Parser;

use crate::layout::{MAX_MEMORY_MIB, MIN_MEMORY_MIB};
use crate::{Echo, VmConfig};

#[derive(Debug, Parser)]
#[command(name = "forkbox-vmm", about = "Run one forkbox microVM on KVM")]
pub struct Args {
    /// Kernel bzImage.
    #[arg(long)]
    pub kernel: PathBuf,
    /// initramfs (cpio, optionally compressed as the kernel supports).
    #[arg(long)]
    pub initramfs: PathBuf,
    /// Kernel command line.
    #[arg(long)]
    pub cmdline: String,
    /// Number of vCPUs (1-8).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=8))]
    pub vcpus: u8,
    /// Guest RAM in MiB (128-16384).
    #[arg(long, default_value_t = 512,
          value_parser = clap::value_parser!(u64).range(MIN_MEMORY_MIB..=MAX_MEMORY_MIB))]
    pub memory_mib: u64,
    /// Read-only virtio-blk disk; repeat for more (first = /dev/vda).
    #[arg(long = "disk")]
    pub disks: Vec<PathBuf>,
    /// Enable virtio-vsock (guest CID 3) with its host side at this unix socket.
    #[arg(long)]
    pub vsock_uds: Option<PathBuf>,
    /// Append serial output to this file.
    #[arg(long)]
    pub serial_log: Option<PathBuf>,
    /// Also copy serial output to stderr.
    #[arg(long)]
    pub serial_stdout: bool,
}

impl Args {
    pub fn into_config(self) -> VmConfig {
        VmConfig {
            kernel: self.kernel,
            initramfs: self.initramfs,
            cmdline: self.cmdline,
            vcpus: self.vcpus,
            memory_mib: self.memory_mib,
            disks: self.disks,
            vsock_uds: self.vsock_uds,
            serial_log: self.serial_log,
            echo: if self.serial_stdout {
                Echo::Stderr
            } else {
                Echo::Off
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: [&str; 7] = [
        "forkbox-vmm",
        "--kernel",
        "/k",
        "--initramfs",
        "/i",
        "--cmdline",
        "console=ttyS0 panic=-1",
    ];

    fn parse(extra: &[&str]) -> Result<VmConfig, clap::Error> {
        let argv = BASE.iter().chain(extra).copied();
        Args::try_parse_from(argv).map(Args::into_config)
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
            "--disk",
            "/b",
            "--vsock-uds",
            "/s",
            "--serial-log",
            "/l",
            "--serial-stdout",
        ])
        .expect("valid");
        assert_eq!((c.vcpus, c.memory_mib), (8, 16384));
        assert_eq!(c.disks, vec![PathBuf::from("/a"), PathBuf::from("/b")]);
        assert_eq!(c.serial_log, Some(PathBuf::from("/l")));
        assert_eq!(c.echo, Echo::Stderr);
        assert_eq!(
            c.devices(),
            vec![
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
    }

    #[test]
    fn parse_missing_kernel_rejected() {
        assert!(
            Args::try_parse_from(["forkbox-vmm", "--initramfs", "/i", "--cmdline", "x"]).is_err()
        );
    }
}
