//! The virtio device model: the [`VirtioDevice`] trait every device
//! implements, what every device holds once the driver activated it
//! ([`Active`]), and the transport that exposes one to the guest.
//!
//! Shared here so that each device keeps only what is its own: reading
//! the configuration space is a default method over the device's bytes
//! ([`VirtioDevice::config_space`]); the queue count checks of activation
//! and restore, saving the queues and returning served chains to the used
//! ring are [`Active`]'s. `save` and `restore` stay required methods.

use std::borrow::Cow;

use virtio_queue::{Queue, QueueT};

pub mod block;
pub mod chain;
pub mod mmio;
pub mod net;
pub mod persist;
#[cfg(test)]
pub(crate) mod testutil;
pub mod vsock;

use self::chain::{Chain, ChainError};
use self::persist::{DeviceState, QueueState, RestoreError};
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
    /// The device-specific configuration space (what the driver reads at
    /// window+0x100); bytes past its end read as zero.
    fn config_space(&self) -> Cow<'_, [u8]>;

    /// Reads `data.len()` bytes of the configuration space at `offset`.
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let config = self.config_space();
        for (i, b) in data.iter_mut().enumerate() {
            *b = usize::try_from(offset)
                .ok()
                .and_then(|o| o.checked_add(i))
                .and_then(|o| config.get(o))
                .copied()
                .unwrap_or(0);
        }
    }

    /// The driver wrote the configuration space. No field of our devices'
    /// is writable (the MAC, capacity and CID are the host's), so the
    /// write is ignored; a device with a writable field overrides this.
    fn write_config(&mut self, offset: u64, _data: &[u8]) {
        tracing::debug!(
            device = self.device_type(),
            offset,
            "virtio: ignoring config write"
        );
    }

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

/// What a device holds while the driver has it activated: guest memory,
/// its `N` queues in the transport's order, and its interrupt line.
pub struct Active<const N: usize> {
    pub mem: GuestMemory,
    pub queues: [Queue; N],
    pub interrupt: Interrupt,
}

impl<const N: usize> Active<N> {
    /// The queues the transport built at DRIVER_OK, which must be `N`.
    pub fn new(
        mem: GuestMemory,
        queues: Vec<Queue>,
        interrupt: Interrupt,
    ) -> Result<Self, ActivateError> {
        let got = queues.len();
        let queues = <[Queue; N]>::try_from(queues)
            .map_err(|_| ActivateError::QueueCount { got, want: N })?;
        Ok(Self {
            mem,
            queues,
            interrupt,
        })
    }

    /// The queues at their saved positions; `None` if the device was not
    /// active when it was saved.
    pub fn restore(
        mem: GuestMemory,
        interrupt: Interrupt,
        saved: Option<&[QueueState]>,
    ) -> Result<Option<Self>, RestoreError> {
        let Some(saved) = saved else {
            return Ok(None);
        };
        let queues = persist::restore_queues(saved, N)?;
        let got = queues.len();
        let queues = <[Queue; N]>::try_from(queues)
            .map_err(|_| RestoreError::QueueCount { got, want: N })?;
        Ok(Some(Self {
            mem,
            queues,
            interrupt,
        }))
    }

    /// The queues' positions, for the device's saved state.
    pub fn save(&self) -> Vec<QueueState> {
        persist::save_queues(&self.queues)
    }

    /// Serves every chain the driver has made available on queue `index`:
    /// `serve` gets each chain parsed (or why it could not be) and returns
    /// how many bytes it wrote into it; the chain then goes back to the
    /// used ring. True if any chain was used: an interrupt is owed.
    pub fn serve_all(
        &mut self,
        index: usize,
        mut serve: impl FnMut(&GuestMemory, Result<Chain, ChainError>) -> u32,
    ) -> bool {
        let Some(queue) = self.queues.get_mut(index) else {
            return false;
        };
        let mut used = false;
        while let Some(chain) = queue.pop_descriptor_chain(&self.mem) {
            let head = chain.head_index();
            let len = serve(&self.mem, Chain::parse(chain));
            if let Err(e) = queue.add_used(&self.mem, head, len) {
                tracing::warn!(index, "virtio: cannot return a used buffer: {e}");
            }
            used = true;
        }
        used
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use vmm_sys_util::eventfd::EventFd;

    use super::*;
    use crate::virtio::testutil::{memory, Driver};

    fn interrupt() -> Interrupt {
        Interrupt::new(Arc::new(EventFd::new(0).expect("eventfd")))
    }

    #[test]
    fn active_new_with_wrong_queue_count_fails() {
        let mem = memory(0x10_0000);
        let drv = Driver::new(&mem, 0, 16);
        let err = Active::<2>::new(mem.clone(), vec![drv.queue()], interrupt())
            .err()
            .expect("one queue for two");
        assert!(matches!(err, ActivateError::QueueCount { got: 1, want: 2 }));
    }

    #[test]
    fn active_save_restore_round_trips_queue_positions() {
        let mem = memory(0x10_0000);
        let drv = Driver::new(&mem, 0, 16);
        let active =
            Active::<1>::new(mem.clone(), vec![drv.queue()], interrupt()).expect("activate");
        let saved = active.save();
        let back = Active::<1>::restore(mem.clone(), interrupt(), Some(&saved))
            .expect("restore")
            .expect("was active");
        assert_eq!(back.save(), saved);
        assert!(Active::<1>::restore(mem.clone(), interrupt(), None)
            .expect("restore")
            .is_none());
        assert!(matches!(
            Active::<2>::restore(mem, interrupt(), Some(&saved)),
            Err(RestoreError::QueueCount { got: 1, want: 2 })
        ));
    }
}
