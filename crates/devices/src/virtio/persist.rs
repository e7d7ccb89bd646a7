//! Plain, serialisable device state for snapshot, restore and fork.
//!
//! DESIGN.md: "restore and fork are one code path", and "a device that
//! forgets a piece of state is a fork bug". So every type here is explicit
//! (no `Default`), and [`crate::virtio::VirtioDevice`] has required
//! `save`/`restore` methods: a device without them does not compile.
//!
//! What a restored device does NOT get back: host-side connections (vsock
//! streams are the parent's open files). The vsock state therefore carries
//! one RST per connection the guest had, delivered after restore.

use serde::{Deserialize, Serialize};
use virtio_queue::Queue;

/// Why device state could not be applied.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error("state is for a {found} device, this is a {expected} device")]
    WrongDevice {
        expected: &'static str,
        found: &'static str,
    },
    #[error("saved queue {0} is invalid")]
    BadQueue(usize, #[source] virtio_queue::Error),
    #[error("saved state has {got} queues, device has {want}")]
    QueueCount { got: usize, want: usize },
    #[error("saved vsock header {0} is not {len} bytes", len = super::vsock::packet::HDR_LEN)]
    BadHeader(usize),
}

/// One virtqueue as the device left it (mirrors `virtio_queue::QueueState`,
/// which has no serde support): where its rings are and how far the device
/// got in each.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueState {
    pub max_size: u16,
    pub size: u16,
    pub ready: bool,
    pub desc_table: u64,
    pub avail_ring: u64,
    pub used_ring: u64,
    /// Next available-ring entry the device will read.
    pub next_avail: u16,
    /// Next used-ring entry the device will write.
    pub next_used: u16,
    pub event_idx_enabled: bool,
}

impl QueueState {
    pub fn save(q: &Queue) -> QueueState {
        let s = q.state();
        QueueState {
            max_size: s.max_size,
            size: s.size,
            ready: s.ready,
            desc_table: s.desc_table,
            avail_ring: s.avail_ring,
            used_ring: s.used_ring,
            next_avail: s.next_avail,
            next_used: s.next_used,
            event_idx_enabled: s.event_idx_enabled,
        }
    }

    /// Rebuilds queue `index` at the saved ring positions.
    pub fn restore(&self, index: usize) -> Result<Queue, RestoreError> {
        Queue::try_from(virtio_queue::QueueState {
            max_size: self.max_size,
            next_avail: self.next_avail,
            next_used: self.next_used,
            event_idx_enabled: self.event_idx_enabled,
            size: self.size,
            ready: self.ready,
            desc_table: self.desc_table,
            avail_ring: self.avail_ring,
            used_ring: self.used_ring,
        })
        .map_err(|e| RestoreError::BadQueue(index, e))
    }
}

/// Saves a device's queues (`None` before activation).
pub fn save_queues<'a>(queues: impl IntoIterator<Item = &'a Queue>) -> Vec<QueueState> {
    queues.into_iter().map(QueueState::save).collect()
}

/// Rebuilds `want` queues from their saved state.
pub fn restore_queues(saved: &[QueueState], want: usize) -> Result<Vec<Queue>, RestoreError> {
    if saved.len() != want {
        return Err(RestoreError::QueueCount {
            got: saved.len(),
            want,
        });
    }
    saved
        .iter()
        .enumerate()
        .map(|(i, q)| q.restore(i))
        .collect()
}

/// virtio-blk: features and, once active, its one queue. The disk file is
/// re-opened by path by the VMM.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockState {
    pub acked_features: u64,
    /// `Some` once the driver activated the device.
    pub queues: Option<Vec<QueueState>>,
}

/// virtio-vsock: features, queues (rx, tx, event), the next host port and
/// the RSTs the guest is owed for connections that did not survive.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VsockState {
    pub guest_cid: u64,
    pub acked_features: u64,
    pub queues: Option<Vec<QueueState>>,
    pub next_port: u32,
    /// 44-byte `virtio_vsock_hdr`s (RST), one per connection the guest had
    /// and any RSTs still queued.
    pub pending_rsts: Vec<Vec<u8>>,
}

/// virtio-net: its MAC, features and, once active, its rx and tx queues.
/// The backend (the gateway and its host connections) is not device
/// state: a restored or forked VM gets a fresh one.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetState {
    pub mac: [u8; 6],
    pub acked_features: u64,
    pub queues: Option<Vec<QueueState>>,
}

/// The state of whichever device sits behind a transport.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum DeviceState {
    Block(BlockState),
    Vsock(VsockState),
    Net(NetState),
}

impl DeviceState {
    pub fn kind(&self) -> &'static str {
        match self {
            DeviceState::Block(_) => "block",
            DeviceState::Vsock(_) => "vsock",
            DeviceState::Net(_) => "net",
        }
    }

    /// The error for restoring this state into a device of another kind.
    pub fn wrong_device(&self, expected: &'static str) -> RestoreError {
        RestoreError::WrongDevice {
            expected,
            found: self.kind(),
        }
    }
}

/// One queue's registers as the driver programmed them into the transport.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueConfigState {
    pub size: u16,
    pub ready: bool,
    pub desc: u64,
    pub driver: u64,
    pub device: u64,
}

/// A virtio-mmio transport: its registers, InterruptStatus, and its device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransportState {
    pub status: u32,
    pub device_features_sel: u32,
    pub driver_features_sel: u32,
    pub driver_features: u64,
    pub queue_sel: u32,
    pub queues: Vec<QueueConfigState>,
    pub activated: bool,
    pub interrupt_status: u32,
    pub device: DeviceState,
}
