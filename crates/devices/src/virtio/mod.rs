//! The virtio device model: the [`VirtioDevice`] trait every device
//! implements, and the transport that exposes one to the guest.

use virtio_queue::Queue;

pub mod block;
pub mod chain;
pub mod mmio;
pub mod net;
pub mod persist;
#[cfg(test)]
pub(crate) mod testutil;
pub mod vsock;

use self::persist::{DeviceState, RestoreError};
use crate::{EventSource, GuestMemory, Interrupt};

/// Why a device could not be activated by the driver.
#[derive(Debug, thiserror::Error)]
pub enum ActivateError {
    #[error("queue {0} is not valid")]
    BadQueue(usize),
    #[error("driver set up {got} queues, device needs {want}")]
    QueueCount { got: usize, want: usize },
    #[error("device backend failed")]
    Backend(#[source] std::io::Error),
}

/// One virtio device behind a transport. The transport owns the common
/// registers (features, queue setup, status); the device owns its
/// configuration space and what happens when the driver kicks a queue.
pub trait VirtioDevice: EventSource {
    /// Virtio device ID (1 = net, 2 = block, 19 = vsock).
    fn device_type(&self) -> u32;
    /// Maximum size of each queue; its length is the number of queues.
    fn queue_max_sizes(&self) -> &[u16];
    /// Feature bits the device offers (VIRTIO_F_VERSION_1 included).
    fn features(&self) -> u64;
    /// The features the driver accepted, before activation.
    fn ack_features(&mut self, features: u64);
    fn read_config(&self, offset: u64, data: &mut [u8]);
    fn write_config(&mut self, offset: u64, data: &[u8]);
    /// The driver set DRIVER_OK: the queues are ready to use.
    fn activate(
        &mut self,
        mem: GuestMemory,
        queues: Vec<Queue>,
        interrupt: Interrupt,
    ) -> Result<(), ActivateError>;
    /// The driver notified queue `index` (a QueueNotify write).
    fn queue_notify(&mut self, index: u16);
    /// The driver wrote 0 to Status: drop the queues and all in-flight work.
    fn reset(&mut self);
    /// Everything needed to rebuild this device in another process
    /// (required: a device that forgets state must not compile).
    fn save(&self) -> DeviceState;
    /// Applies `state` to a freshly created device; when it was active,
    /// rebuilds its queues at the saved positions and activates it with
    /// `mem` and `interrupt`.
    fn restore(
        &mut self,
        mem: GuestMemory,
        interrupt: Interrupt,
        state: &DeviceState,
    ) -> Result<(), RestoreError>;
}
