//! forkbox's host side: everything the `forkbox` command does.
//!
//! - [`bench`]: percentiles, calibration, VMM and host memory figures.
//! - [`bench_service`]: `forkbox bench service`, the API's latencies.
//! - [`demo`]: `forkbox demo`, one GRPO step through the daemon.
//! - [`local_daemon`]: a forkboxd of our own for the demo and benchmarks.
//! - [`client`]: the client of forkboxd's HTTP API (unix socket or TCP).
//! - [`cache`]: the content-addressed cache directory for built assets.
//! - [`debs`]: Debian packages fetched with `apt-get download` and unpacked.
//! - [`kernel`]: the pinned guest and test-bed kernels and their modules.
//! - [`control`]: the client of a VMM's control socket (pause, fork, snapshot).
//! - [`cpio`]: the newc archive writer behind every initramfs.
//! - [`image`]: the `minimal` and `debian` root filesystem images.
//! - [`initramfs`]: the guest's and the emulated host's initramfs.
//! - [`netbroker`]: a sandbox's network broker: resolves names and opens
//!   allowed connections for its VMM, passing the sockets over.
//! - [`testbed`]: the emulated KVM host for machines without VMX/SVM.
//! - [`vm`]: one microVM: its assets, its VMM process, its agent client;
//!   pause, zygote, fork, snapshot and restore.
//!
//! Must not depend on the VMM's internals: it starts `forkbox-vmm` as a
//! process and talks to the guest through `forkbox-proto`.
#![forbid(unsafe_code)]

pub mod bench;
pub mod bench_service;
pub mod cache;
pub mod client;
pub mod control;
pub mod cpio;
pub mod debs;
pub mod demo;
pub mod hugepages;
pub mod image;
pub mod initramfs;
pub mod kernel;
pub mod local_daemon;
pub mod netbroker;
pub mod testbed;
pub mod vm;

/// The VMM's contract (control protocol, exit codes, a VM shape's limits),
/// for callers that reach the VMM only through this crate.
pub use forkbox_vmm_api as vmm_api;
