//! What this VMM process counts, answered in `status`
//! (`forkbox-vmm-api`'s [`VmmCounters`]): relaxed atomics bumped where the
//! thing happens (a vCPU exit, a control request, a network frame), read
//! whole on request. A fork child starts again from zero ([`Counters::reset`]);
//! the vsock device counts its host connections itself
//! ([`forkbox_devices::virtio::vsock::HOST_CONNECTIONS`]).
//!
//! A relaxed increment costs tens of nanoseconds even when vCPU threads
//! share the cache line; the exit it counts costs microseconds.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use forkbox_devices::virtio::overlay::{BYTES_WRITTEN, HOST_WRITE_ERRORS};
use forkbox_devices::virtio::vsock::HOST_CONNECTIONS;
use forkbox_vmm_api::VmmCounters;

/// The process's counters (one VM per process).
pub static COUNTERS: Counters = Counters::new();

/// One atomic per field of [`VmmCounters`] the VMM counts itself.
#[derive(Debug)]
pub struct Counters {
    pub exits_io: AtomicU64,
    pub exits_mmio: AtomicU64,
    pub exits_other: AtomicU64,
    pub control_requests: AtomicU64,
    pub control_micros: AtomicU64,
    pub net_tx_frames: AtomicU64,
    pub net_tx_bytes: AtomicU64,
    pub net_rx_frames: AtomicU64,
    pub net_rx_bytes: AtomicU64,
}

impl Default for Counters {
    fn default() -> Self {
        Self::new()
    }
}

impl Counters {
    pub const fn new() -> Self {
        Self {
            exits_io: AtomicU64::new(0),
            exits_mmio: AtomicU64::new(0),
            exits_other: AtomicU64::new(0),
            control_requests: AtomicU64::new(0),
            control_micros: AtomicU64::new(0),
            net_tx_frames: AtomicU64::new(0),
            net_tx_bytes: AtomicU64::new(0),
            net_rx_frames: AtomicU64::new(0),
            net_rx_bytes: AtomicU64::new(0),
        }
    }

    /// Counts one of something.
    pub fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Relaxed);
    }

    /// Counts `n` of something (bytes, microseconds).
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Relaxed);
    }

    /// Every counter as it is now (each read on its own: a count may move
    /// between two reads).
    pub fn snapshot(&self) -> VmmCounters {
        let get = |c: &AtomicU64| c.load(Relaxed);
        VmmCounters {
            exits_io: get(&self.exits_io),
            exits_mmio: get(&self.exits_mmio),
            exits_other: get(&self.exits_other),
            control_requests: get(&self.control_requests),
            control_micros: get(&self.control_micros),
            vsock_connections: get(&HOST_CONNECTIONS),
            net_tx_frames: get(&self.net_tx_frames),
            net_tx_bytes: get(&self.net_tx_bytes),
            net_rx_frames: get(&self.net_rx_frames),
            net_rx_bytes: get(&self.net_rx_bytes),
            disk_bytes_written: get(&BYTES_WRITTEN),
            disk_host_write_errors: get(&HOST_WRITE_ERRORS),
        }
    }

    /// Back to zero, the vsock device's and the writable disks' counts included: a fork child is a
    /// new VM, and what its parent counted is the parent's.
    pub fn reset(&self) {
        let Counters {
            exits_io,
            exits_mmio,
            exits_other,
            control_requests,
            control_micros,
            net_tx_frames,
            net_tx_bytes,
            net_rx_frames,
            net_rx_bytes,
        } = self;
        for c in [
            exits_io,
            exits_mmio,
            exits_other,
            control_requests,
            control_micros,
            net_tx_frames,
            net_tx_bytes,
            net_rx_frames,
            net_rx_bytes,
            &HOST_CONNECTIONS,
            &BYTES_WRITTEN,
            &HOST_WRITE_ERRORS,
        ] {
            c.store(0, Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_snapshot_reports_what_was_counted() {
        let c = Counters::new();
        Counters::bump(&c.exits_io);
        Counters::bump(&c.exits_io);
        Counters::bump(&c.exits_mmio);
        Counters::bump(&c.control_requests);
        Counters::add(&c.control_micros, 250);
        Counters::bump(&c.net_rx_frames);
        Counters::add(&c.net_rx_bytes, 60);
        let s = c.snapshot();
        assert_eq!(s.exits_io, 2);
        assert_eq!(s.exits_mmio, 1);
        assert_eq!(s.exits_other, 0);
        assert_eq!((s.control_requests, s.control_micros), (1, 250));
        assert_eq!((s.net_rx_frames, s.net_rx_bytes), (1, 60));
        assert_eq!((s.net_tx_frames, s.net_tx_bytes), (0, 0));
    }

    #[test]
    fn counters_reset_zeroes_every_own_field() {
        let c = Counters::new();
        let Counters {
            exits_io,
            exits_mmio,
            exits_other,
            control_requests,
            control_micros,
            net_tx_frames,
            net_tx_bytes,
            net_rx_frames,
            net_rx_bytes,
        } = &c;
        for f in [
            exits_io,
            exits_mmio,
            exits_other,
            control_requests,
            control_micros,
            net_tx_frames,
            net_tx_bytes,
            net_rx_frames,
            net_rx_bytes,
        ] {
            Counters::add(f, 5);
        }
        c.reset();
        let s = c.snapshot();
        // The devices' counts are the process's, shared with other tests.
        assert_eq!(
            VmmCounters {
                vsock_connections: 0,
                disk_bytes_written: 0,
                disk_host_write_errors: 0,
                ..s
            },
            VmmCounters::default()
        );
    }
}
