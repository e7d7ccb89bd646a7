//! forkbox's host library: what runs a microVM on this host, used by the
//! daemon (forkboxd) and the CLI alike. It never talks to forkboxd.
//!
//! - [`vm`]: one microVM: its assets, its VMM process, its agent client;
//!   pause, zygote, fork, snapshot and restore.
//! - [`volume`]: golden volumes, the read-only bases of writable disks.
//! - [`control`]: the client of a VMM's control socket (pause, fork, snapshot).
//! - [`netbroker`]: a sandbox's network broker: resolves names and opens
//!   allowed connections for its VMM, passing the sockets over.
//! - Guest assets: [`cache`] (the content-addressed cache directory),
//!   [`debs`] (Debian packages fetched with `apt-get download`),
//!   [`kernel`] (the pinned guest and test-bed kernels), [`cpio`] and
//!   [`initramfs`] (the guest's and the emulated host's initramfs),
//!   [`image`] (the `minimal` and `debian` root filesystems), [`hugepages`]
//!   (the host's shmem huge-page setting).
//! - [`gvisor`]: sandboxes under gVisor (`runsc`) for hosts without
//!   hardware virtualization: the same agent, checkpoints for forks.
//! - [`testbed`]: the emulated KVM host for machines without VMX/SVM.
//! - [`measure`]: what `/proc` says about VMM processes, memory and the CPU
//!   (the one `/proc` parser of forkbox's host side).
//! - [`isolation`]: the memory-isolation check a fork's children and
//!   parent run (a guest process writing a known pattern).
//! - [`socket`]: where forkboxd listens by default; [`owned`]: the checks
//!   that a directory or socket path is one this user made.
//! - [`poll`]: waiting, until a deadline, for what cannot be waited on.
//! - [`open_files`]: the open-file limit against what a wide fork holds.
//! - [`jail`]: which parts of the VMM's jail this host cannot give
//!   (said once by the daemon; `--require-jail` refuses instead);
//!   [`cgroup`]: each VMM's cgroup, with its memory, pids and CPU limits.
//!
//! Must not depend on the VMM's internals: it starts `forkbox-vmm` as a
//! process and talks to the guest through `forkbox-proto`.
#![forbid(unsafe_code)]

pub mod cache;
pub mod cgroup;
pub mod control;
pub mod cpio;
pub mod debs;
pub mod gvisor;
pub mod hugepages;
pub mod image;
pub mod initramfs;
pub mod isolation;
pub mod jail;
pub mod kernel;
pub mod measure;
pub mod netbroker;
pub mod open_files;
pub mod owned;
pub mod poll;
pub mod socket;
pub mod testbed;
pub mod vm;
pub mod volume;
