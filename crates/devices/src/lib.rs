//! Emulated devices of the forkbox VMM.
//!
//! Owns: the virtio-mmio transport ([`virtio::mmio`]), virtio-blk
//! ([`virtio::block`]), virtio-vsock with its userspace backend
//! ([`virtio::vsock`]) and virtio-net in front of a frame backend
//! ([`virtio::net`]).
//!
//! Module map:
//! - [`virtio`]: the [`virtio::VirtioDevice`] trait (configuration-space
//!   reads shared as default methods), [`virtio::Active`] (what every
//!   activated device holds: queue count checks, save and restore of its
//!   queues, serving a queue's chains) and activation errors.
//!   - [`virtio::mmio`]: virtio-mmio v2 registers; [`virtio::mmio::MmioTransport`]
//!     is the [`BusDevice`] + [`EventSource`] the VMM maps for each device.
//!   - [`virtio::chain`]: descriptor chains flattened into readable and
//!     writable byte ranges of guest memory.
//!   - [`virtio::block`]: read-only virtio-blk over a file (pread).
//!   - [`virtio::net`]: virtio-net moving Ethernet frames to and from a
//!     [`virtio::net::FrameBackend`] (the VMM's userspace gateway).
//!   - [`virtio::vsock`]: virtio-vsock and its unix-socket ("hybrid") backend.
//!     - [`virtio::vsock::packet`]: the 44-byte packet header, sans-IO.
//!     - [`virtio::vsock::conn`]: one connection's state and credit, sans-IO.
//!   - [`virtio::persist`]: serialisable device and transport state for
//!     snapshot, restore and fork (required `save`/`restore` on every device).
//! - [`warnings`]: the rate limit on warnings a guest causes.
//!
//! No `unsafe` here: guest memory is touched through `vm-memory`'s volatile
//! slices, sockets through `std`, epoll through `vmm-sys-util`.
//!
//! Must not depend on KVM (`kvm-ioctls`, `kvm-bindings`): devices see guest
//! memory through `vm-memory`, raise interrupts by writing an [`EventFd`]
//! (which the VMM registers as an irqfd) and are driven by the VMM calling
//! the methods below. That keeps every device testable without a VM.

#![forbid(unsafe_code)]

use std::fmt::Display;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

pub use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

pub mod virtio;
pub mod warnings;

use self::warnings::Warnings;

/// Guest memory as every device sees it.
pub type GuestMemory = GuestMemoryMmap<()>;

/// A device that answers loads and stores in a window of guest-physical
/// address space. `offset` is relative to the start of the device's window.
pub trait BusDevice: Send {
    fn read(&mut self, offset: u64, data: &mut [u8]);
    fn write(&mut self, offset: u64, data: &[u8]);
}

/// Whether a device stopped because its budget for this turn of the
/// VMM's event loop ran out ([`Work::More`]: call it again next turn, even
/// without a new event) or because it had nothing left to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Work {
    Done,
    More,
}

impl std::ops::BitOr for Work {
    type Output = Work;
    fn bitor(self, other: Work) -> Work {
        if self == Work::More || other == Work::More {
            Work::More
        } else {
            Work::Done
        }
    }
}

/// Host-side events a device waits for (sockets, timers), beside the guest's
/// queue notifications. The VMM's event loop adds `fd` to its epoll set and
/// calls `handle_events` when it is readable. A device that needs several
/// fds keeps its own epoll instance and exposes that one fd, so the set the
/// VMM watches never changes.
pub trait EventSource: Send {
    fn event_fd(&self) -> Option<RawFd>;
    /// Does the host-side work, within the device's per-turn budget.
    fn handle_events(&mut self) -> Work;
}

/// The interrupt line of one virtio-mmio device: the InterruptStatus bits
/// shared with the transport, plus the eventfd behind the device's irqfd.
/// It also carries what else the device tells its transport, for as long
/// as the transport lives (a driver reset does not renew it): that the
/// device needs a reset, and the rate limit on its guest-caused warnings.
#[derive(Clone)]
pub struct Interrupt {
    status: Arc<AtomicU32>,
    irq: Arc<EventFd>,
    health: Arc<Health>,
}

/// The device's side of the Status register and its warnings.
#[derive(Default)]
struct Health {
    needs_reset: AtomicBool,
    warnings: Mutex<Warnings>,
}

/// InterruptStatus bit: a queue's used ring was updated.
pub const VIRTIO_MMIO_INT_VRING: u32 = 0x01;
/// InterruptStatus bit: the device configuration changed.
pub const VIRTIO_MMIO_INT_CONFIG: u32 = 0x02;

impl Interrupt {
    pub fn new(irq: Arc<EventFd>) -> Self {
        Self {
            status: Arc::new(AtomicU32::new(0)),
            irq,
            health: Arc::default(),
        }
    }

    /// Tells the guest that a used ring has new entries.
    pub fn signal_used_queue(&self) {
        self.signal(VIRTIO_MMIO_INT_VRING);
    }

    /// Tells the guest that the configuration space changed.
    pub fn signal_config(&self) {
        self.signal(VIRTIO_MMIO_INT_CONFIG);
    }

    fn signal(&self, bit: u32) {
        self.status.fetch_or(bit, Ordering::SeqCst);
        if let Err(e) = self.irq.write(1) {
            tracing::warn!("cannot raise virtio interrupt: {e}");
        }
    }

    /// The InterruptStatus register.
    pub fn status(&self) -> u32 {
        self.status.load(Ordering::SeqCst)
    }

    /// InterruptACK: the guest clears the bits it has handled.
    pub fn ack(&self, bits: u32) {
        self.status.fetch_and(!bits, Ordering::SeqCst);
    }

    /// Sets InterruptStatus as saved (restore only; no interrupt is raised).
    pub fn restore_status(&self, bits: u32) {
        self.status.store(bits, Ordering::SeqCst);
    }

    /// The guest broke the device's protocol in a way it cannot go on from
    /// (virtio 1.x §2.1.2): the transport shows DEVICE_NEEDS_RESET and the
    /// device serves nothing until the driver resets it. The driver hears
    /// of it through a configuration-change interrupt.
    pub fn set_needs_reset(&self) {
        if !self.health.needs_reset.swap(true, Ordering::SeqCst) {
            self.signal_config();
        }
    }

    /// Whether [`Interrupt::set_needs_reset`] was called since the last reset.
    pub fn needs_reset(&self) -> bool {
        self.health.needs_reset.load(Ordering::SeqCst)
    }

    /// The driver reset the device (or a restore put the flag back).
    pub fn restore_needs_reset(&self, on: bool) {
        self.health.needs_reset.store(on, Ordering::SeqCst);
    }

    /// Logs a guest-caused error of `device`, rate-limited
    /// ([`warnings::Warnings`]).
    pub fn guest_error(&self, device: &str, what: &dyn Display) {
        self.limited(device, "guest", what);
    }

    fn limited(&self, device: &str, whose: &str, what: &dyn Display) {
        let mut w = match self.health.warnings.lock() {
            Ok(w) => w,
            Err(p) => p.into_inner(),
        };
        w.warn(device, whose, what);
    }

    /// Logs a host failure the guest can repeat at will (a write to a full
    /// host disk), under the same rate limit as its own errors.
    pub fn host_error(&self, device: &str, what: &dyn Display) {
        self.limited(device, "host", what);
    }

    /// Guest-caused errors seen so far, logged or not.
    pub fn guest_errors(&self) -> u64 {
        match self.health.warnings.lock() {
            Ok(w) => w.total(),
            Err(p) => p.into_inner().total(),
        }
    }

    /// The eventfd behind this line, for the VMM to register as an irqfd.
    pub fn irq_fd(&self) -> &EventFd {
        &self.irq
    }
}
