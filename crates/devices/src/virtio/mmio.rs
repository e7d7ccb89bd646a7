//! The virtio-mmio transport, version 2 ("modern", virtio 1.x spec §4.2.2).
//!
//! [`MmioTransport`] owns the common registers (features, queue setup,
//! status, interrupt status) and forwards configuration-space accesses and
//! queue notifications to its [`VirtioDevice`]. Every register write comes
//! from the guest, which is hostile: invalid values and out-of-order writes
//! are ignored (or fail the device with DEVICE_NEEDS_RESET), never panic.

use std::os::fd::RawFd;

use virtio_queue::{Queue, QueueT};
use vm_memory::GuestAddress;

use crate::virtio::persist::{QueueConfigState, RestoreError, TransportState};
use crate::virtio::{ActivateError, VirtioDevice};
use crate::{BusDevice, EventSource, GuestMemory, Interrupt, Work};

/// "virt" in little endian.
pub const MMIO_MAGIC_VALUE: u32 = 0x7472_6976;
/// The modern (non-legacy) virtio-mmio version.
pub const MMIO_VERSION: u32 = 2;
/// Our vendor ID ("FBX\0").
pub const MMIO_VENDOR_ID: u32 = 0x0058_4246;
/// Size of the MMIO window of one device.
pub const MMIO_WINDOW_SIZE: u64 = 0x1000;

/// Register offsets (virtio 1.x §4.2.2).
pub mod reg {
    pub const MAGIC_VALUE: u64 = 0x000;
    pub const VERSION: u64 = 0x004;
    pub const DEVICE_ID: u64 = 0x008;
    pub const VENDOR_ID: u64 = 0x00c;
    pub const DEVICE_FEATURES: u64 = 0x010;
    pub const DEVICE_FEATURES_SEL: u64 = 0x014;
    pub const DRIVER_FEATURES: u64 = 0x020;
    pub const DRIVER_FEATURES_SEL: u64 = 0x024;
    pub const QUEUE_SEL: u64 = 0x030;
    pub const QUEUE_NUM_MAX: u64 = 0x034;
    pub const QUEUE_NUM: u64 = 0x038;
    pub const QUEUE_READY: u64 = 0x044;
    pub const QUEUE_NOTIFY: u64 = 0x050;
    pub const INTERRUPT_STATUS: u64 = 0x060;
    pub const INTERRUPT_ACK: u64 = 0x064;
    pub const STATUS: u64 = 0x070;
    pub const QUEUE_DESC_LOW: u64 = 0x080;
    pub const QUEUE_DESC_HIGH: u64 = 0x084;
    pub const QUEUE_DRIVER_LOW: u64 = 0x090;
    pub const QUEUE_DRIVER_HIGH: u64 = 0x094;
    pub const QUEUE_DEVICE_LOW: u64 = 0x0a0;
    pub const QUEUE_DEVICE_HIGH: u64 = 0x0a4;
    pub const SHM_SEL: u64 = 0x0ac;
    pub const SHM_LEN_LOW: u64 = 0x0b0;
    pub const SHM_LEN_HIGH: u64 = 0x0b4;
    pub const SHM_BASE_LOW: u64 = 0x0b8;
    pub const SHM_BASE_HIGH: u64 = 0x0bc;
    pub const CONFIG_GENERATION: u64 = 0x0fc;
    pub const CONFIG: u64 = 0x100;
}

/// Device status bits (virtio 1.x §2.1).
pub mod status {
    pub const ACKNOWLEDGE: u32 = 1;
    pub const DRIVER: u32 = 2;
    pub const DRIVER_OK: u32 = 4;
    pub const FEATURES_OK: u32 = 8;
    pub const DEVICE_NEEDS_RESET: u32 = 64;
    pub const FAILED: u32 = 128;
}

/// Feature bit every modern device offers and every driver must accept.
pub const VIRTIO_F_VERSION_1: u64 = 1 << 32;

/// What the driver has configured for one queue before activation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct QueueConfig {
    size: u16,
    ready: bool,
    desc: u64,
    driver: u64,
    device: u64,
}

/// A virtio device exposed to the guest through a virtio-mmio window.
pub struct MmioTransport {
    device: Box<dyn VirtioDevice>,
    mem: GuestMemory,
    interrupt: Interrupt,
    status: u32,
    device_features_sel: u32,
    driver_features_sel: u32,
    driver_features: u64,
    queue_sel: u32,
    queues: Vec<QueueConfig>,
    activated: bool,
}

fn set_low(v: &mut u64, low: u32) {
    *v = (*v & !0xffff_ffff) | u64::from(low);
}

fn set_high(v: &mut u64, high: u32) {
    *v = (*v & 0xffff_ffff) | (u64::from(high) << 32);
}

impl MmioTransport {
    pub fn new(device: Box<dyn VirtioDevice>, mem: GuestMemory, interrupt: Interrupt) -> Self {
        let queues = device
            .queue_max_sizes()
            .iter()
            .map(|&max| QueueConfig {
                size: max,
                ..QueueConfig::default()
            })
            .collect();
        Self {
            device,
            mem,
            interrupt,
            status: 0,
            device_features_sel: 0,
            driver_features_sel: 0,
            driver_features: 0,
            queue_sel: 0,
            queues,
            activated: false,
        }
    }

    /// Captures the registers, InterruptStatus and the device's state.
    pub fn save(&self) -> TransportState {
        TransportState {
            status: self.status_reg(),
            device_features_sel: self.device_features_sel,
            driver_features_sel: self.driver_features_sel,
            driver_features: self.driver_features,
            queue_sel: self.queue_sel,
            queues: self
                .queues
                .iter()
                .map(|q| QueueConfigState {
                    size: q.size,
                    ready: q.ready,
                    desc: q.desc,
                    driver: q.driver,
                    device: q.device,
                })
                .collect(),
            activated: self.activated,
            interrupt_status: self.interrupt.status(),
            device: self.device.save(),
        }
    }

    /// A transport around a freshly created `device`, put back into the
    /// saved state (the device's queues and activation included).
    pub fn restore(
        mut device: Box<dyn VirtioDevice>,
        mem: GuestMemory,
        interrupt: Interrupt,
        state: &TransportState,
    ) -> Result<Self, RestoreError> {
        let want = device.queue_max_sizes().len();
        if state.queues.len() != want {
            return Err(RestoreError::QueueCount {
                got: state.queues.len(),
                want,
            });
        }
        interrupt.restore_status(state.interrupt_status);
        interrupt.restore_needs_reset(state.status & status::DEVICE_NEEDS_RESET != 0);
        device.restore(mem.clone(), interrupt.clone(), &state.device)?;
        Ok(Self {
            device,
            mem,
            interrupt,
            status: state.status,
            device_features_sel: state.device_features_sel,
            driver_features_sel: state.driver_features_sel,
            driver_features: state.driver_features,
            queue_sel: state.queue_sel,
            queues: state
                .queues
                .iter()
                .map(|q| QueueConfig {
                    size: q.size,
                    ready: q.ready,
                    desc: q.desc,
                    driver: q.driver,
                    device: q.device,
                })
                .collect(),
            activated: state.activated,
        })
    }

    /// The device behind this transport.
    pub fn device(&self) -> &dyn VirtioDevice {
        self.device.as_ref()
    }

    /// The device behind this transport, mutably.
    pub fn device_mut(&mut self) -> &mut dyn VirtioDevice {
        self.device.as_mut()
    }

    /// The interrupt line of this device.
    pub fn interrupt(&self) -> &Interrupt {
        &self.interrupt
    }

    /// The Status register.
    pub fn status(&self) -> u32 {
        self.status_reg()
    }

    /// Status as the driver reads it: what it wrote, plus
    /// DEVICE_NEEDS_RESET if the device asked for a reset.
    fn status_reg(&self) -> u32 {
        if self.interrupt.needs_reset() {
            self.status | status::DEVICE_NEEDS_RESET
        } else {
            self.status
        }
    }

    /// Whether the driver set DRIVER_OK and the device accepted its queues.
    pub fn is_activated(&self) -> bool {
        self.activated
    }

    /// The driver kicked queue `index`: either a QueueNotify write that
    /// reached [`BusDevice::write`], or the VMM's ioeventfd on
    /// window+0x50 (datamatch = queue index). Ignored before activation and
    /// for queues the device does not have. [`Work::More`]: the device's
    /// budget for this turn ran out, call it again next turn.
    pub fn queue_notify(&mut self, index: u16) -> Work {
        if !self.activated || usize::from(index) >= self.queues.len() {
            tracing::debug!(index, "ignoring notification of inactive queue");
            return Work::Done;
        }
        self.device.queue_notify(index)
    }

    fn selected_queue(&mut self) -> Option<&mut QueueConfig> {
        self.queues.get_mut(self.queue_sel as usize)
    }

    /// Queue registers may change only while the queue is not ready and the
    /// driver has not yet set DRIVER_OK.
    fn selected_queue_writable(&mut self) -> Option<&mut QueueConfig> {
        if self.status & status::DRIVER_OK != 0 {
            return None;
        }
        self.selected_queue().filter(|q| !q.ready)
    }

    fn read_reg(&self, offset: u64) -> u32 {
        let features = self.device.features();
        match offset {
            reg::MAGIC_VALUE => MMIO_MAGIC_VALUE,
            reg::VERSION => MMIO_VERSION,
            reg::DEVICE_ID => self.device.device_type(),
            reg::VENDOR_ID => MMIO_VENDOR_ID,
            reg::DEVICE_FEATURES => match self.device_features_sel {
                0 => features as u32,
                1 => (features >> 32) as u32,
                _ => 0,
            },
            reg::QUEUE_NUM_MAX => self
                .device
                .queue_max_sizes()
                .get(self.queue_sel as usize)
                .copied()
                .map_or(0, u32::from),
            reg::QUEUE_READY => self
                .queues
                .get(self.queue_sel as usize)
                .map_or(0, |q| u32::from(q.ready)),
            reg::INTERRUPT_STATUS => self.interrupt.status(),
            reg::STATUS => self.status_reg(),
            // No shared memory regions: length all ones means "absent".
            reg::SHM_LEN_LOW | reg::SHM_LEN_HIGH | reg::SHM_BASE_LOW | reg::SHM_BASE_HIGH => {
                u32::MAX
            }
            reg::CONFIG_GENERATION => 0,
            _ => {
                tracing::debug!(offset, "read of unknown or write-only virtio-mmio register");
                0
            }
        }
    }

    fn write_reg(&mut self, offset: u64, v: u32) {
        match offset {
            reg::DEVICE_FEATURES_SEL => self.device_features_sel = v,
            reg::DRIVER_FEATURES_SEL => self.driver_features_sel = v,
            reg::DRIVER_FEATURES => {
                // Features are negotiated once, before FEATURES_OK.
                if self.status & status::FEATURES_OK != 0 || self.status & status::DRIVER == 0 {
                    tracing::debug!("ignoring DriverFeatures write in status {:#x}", self.status);
                    return;
                }
                match self.driver_features_sel {
                    0 => set_low(&mut self.driver_features, v),
                    1 => set_high(&mut self.driver_features, v),
                    _ => {}
                }
            }
            reg::QUEUE_SEL => self.queue_sel = v,
            reg::QUEUE_NUM => {
                let max = self
                    .device
                    .queue_max_sizes()
                    .get(self.queue_sel as usize)
                    .copied()
                    .unwrap_or(0);
                if let Some(q) = self.selected_queue_writable() {
                    // Split virtqueues have power-of-two sizes.
                    match u16::try_from(v) {
                        Ok(n) if n != 0 && n <= max && n.is_power_of_two() => q.size = n,
                        _ => tracing::debug!(v, "ignoring invalid QueueNum"),
                    }
                }
            }
            reg::QUEUE_READY => {
                if self.status & status::DRIVER_OK != 0 {
                    return;
                }
                if let Some(q) = self.selected_queue() {
                    q.ready = v == 1;
                }
            }
            // A kick that did not go through the VMM's ioeventfd (there
            // is one per queue): served within the budget like any other;
            // work left waits for the next kick.
            reg::QUEUE_NOTIFY => match u16::try_from(v) {
                Ok(index) => {
                    let _ = self.queue_notify(index);
                }
                Err(_) => tracing::debug!(v, "ignoring QueueNotify of a queue out of range"),
            },
            reg::INTERRUPT_ACK => self.interrupt.ack(v),
            reg::STATUS => self.write_status(v),
            reg::QUEUE_DESC_LOW => {
                if let Some(q) = self.selected_queue_writable() {
                    set_low(&mut q.desc, v);
                }
            }
            reg::QUEUE_DESC_HIGH => {
                if let Some(q) = self.selected_queue_writable() {
                    set_high(&mut q.desc, v);
                }
            }
            reg::QUEUE_DRIVER_LOW => {
                if let Some(q) = self.selected_queue_writable() {
                    set_low(&mut q.driver, v);
                }
            }
            reg::QUEUE_DRIVER_HIGH => {
                if let Some(q) = self.selected_queue_writable() {
                    set_high(&mut q.driver, v);
                }
            }
            reg::QUEUE_DEVICE_LOW => {
                if let Some(q) = self.selected_queue_writable() {
                    set_low(&mut q.device, v);
                }
            }
            reg::QUEUE_DEVICE_HIGH => {
                if let Some(q) = self.selected_queue_writable() {
                    set_high(&mut q.device, v);
                }
            }
            reg::SHM_SEL => {}
            _ => tracing::debug!(offset, "write to unknown or read-only virtio-mmio register"),
        }
    }

    fn write_status(&mut self, v: u32) {
        if v == 0 {
            self.reset();
            return;
        }
        if v & status::FAILED != 0 {
            self.status |= status::FAILED;
            return;
        }
        // The driver only ever adds bits (§3.1.1); anything else is a bug or
        // an attack, and is ignored.
        if v & self.status != self.status {
            tracing::debug!(
                old = self.status,
                new = v,
                "ignoring status that clears bits"
            );
            return;
        }
        let added = v & !self.status;
        if added & status::FEATURES_OK != 0 {
            let offered = self.device.features();
            let ok = self.status & status::DRIVER != 0
                && self.driver_features & !offered == 0
                && self.driver_features & VIRTIO_F_VERSION_1 != 0;
            if !ok {
                tracing::debug!(
                    driver = self.driver_features,
                    offered,
                    "refusing driver features"
                );
                // FEATURES_OK stays clear: the driver re-reads it and gives up.
                self.status = v & !(status::FEATURES_OK | status::DRIVER_OK);
                return;
            }
            self.device.ack_features(self.driver_features);
        }
        if added & status::DRIVER_OK != 0 {
            if v & status::FEATURES_OK == 0 {
                tracing::debug!("DRIVER_OK without FEATURES_OK");
                return;
            }
            self.status = v;
            if let Err(e) = self.activate() {
                self.interrupt.guest_error(
                    "virtio-mmio",
                    &format_args!("cannot activate the device: {e}"),
                );
                self.status |= status::DEVICE_NEEDS_RESET;
                self.interrupt.signal_config();
            }
            return;
        }
        self.status = v;
    }

    fn build_queue(&self, index: usize, cfg: &QueueConfig) -> Result<Queue, ActivateError> {
        let bad = |_| ActivateError::BadQueue(index);
        let max = self
            .device
            .queue_max_sizes()
            .get(index)
            .copied()
            .ok_or(ActivateError::BadQueue(index))?;
        // Checked here first: `virtio-queue` logs an error line for each of
        // these, and a guest may reset and activate in a loop.
        if !queue_fits(&self.mem, cfg, max) {
            return Err(ActivateError::BadQueue(index));
        }
        let mut q = Queue::new(max).map_err(bad)?;
        q.try_set_size(cfg.size).map_err(bad)?;
        q.try_set_desc_table_address(GuestAddress(cfg.desc))
            .map_err(bad)?;
        q.try_set_avail_ring_address(GuestAddress(cfg.driver))
            .map_err(bad)?;
        q.try_set_used_ring_address(GuestAddress(cfg.device))
            .map_err(bad)?;
        q.set_ready(cfg.ready);
        Ok(q)
    }

    fn activate(&mut self) -> Result<(), ActivateError> {
        let queues = self
            .queues
            .iter()
            .enumerate()
            .map(|(i, cfg)| self.build_queue(i, cfg))
            .collect::<Result<Vec<_>, _>>()?;
        self.device
            .activate(self.mem.clone(), queues, self.interrupt.clone())?;
        self.activated = true;
        Ok(())
    }

    fn reset(&mut self) {
        if self.activated || self.status != 0 {
            self.device.reset();
        }
        self.interrupt.restore_needs_reset(false);
        self.activated = false;
        self.status = 0;
        self.device_features_sel = 0;
        self.driver_features_sel = 0;
        self.driver_features = 0;
        self.queue_sel = 0;
        for (q, &max) in self.queues.iter_mut().zip(self.device.queue_max_sizes()) {
            *q = QueueConfig {
                size: max,
                ..QueueConfig::default()
            };
        }
        self.interrupt.ack(u32::MAX);
    }
}

/// Whether a queue as the driver set it up can be used: ready, a size the
/// device allows, rings aligned as virtio 1.x §2.7 asks (16, 2, 4), the
/// available ring not at guest-physical 0 (where `virtio-queue` sees "not
/// set up"), and all inside guest memory.
fn queue_fits(mem: &GuestMemory, cfg: &QueueConfig, max: u16) -> bool {
    use vm_memory::GuestMemoryBackend;
    let n = u64::from(cfg.size);
    let parts = [
        (cfg.desc, 16, 16 * n),
        (cfg.driver, 2, 6 + 2 * n),
        (cfg.device, 4, 6 + 8 * n),
    ];
    if cfg.driver == 0 {
        return false;
    }
    cfg.ready
        && cfg.size != 0
        && cfg.size <= max
        && cfg.size.is_power_of_two()
        && parts.iter().all(|&(addr, align, len)| {
            addr % align == 0
                && usize::try_from(len).is_ok_and(|len| mem.check_range(GuestAddress(addr), len))
        })
}

impl BusDevice for MmioTransport {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if offset >= reg::CONFIG {
            self.device.read_config(offset - reg::CONFIG, data);
            return;
        }
        if data.len() != 4 || offset & 3 != 0 {
            tracing::debug!(offset, len = data.len(), "bad virtio-mmio register read");
            data.fill(0);
            return;
        }
        data.copy_from_slice(&self.read_reg(offset).to_le_bytes());
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset >= reg::CONFIG {
            self.device.write_config(offset - reg::CONFIG, data);
            return;
        }
        let Ok(bytes) = <[u8; 4]>::try_from(data) else {
            tracing::debug!(offset, len = data.len(), "bad virtio-mmio register write");
            return;
        };
        if offset & 3 != 0 {
            return;
        }
        self.write_reg(offset, u32::from_le_bytes(bytes));
    }
}

impl EventSource for MmioTransport {
    fn event_fd(&self) -> Option<RawFd> {
        self.device.event_fd()
    }

    fn handle_events(&mut self) -> Work {
        self.device.handle_events()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use virtio_queue::mock::MockSplitQueue;
    use vm_memory::GuestAddress;
    use vmm_sys_util::eventfd::EventFd;

    use super::*;

    #[derive(Default)]
    struct Log {
        activated: Vec<usize>,
        notified: Vec<u16>,
        resets: usize,
        acked: u64,
    }

    struct Dummy {
        log: Arc<Mutex<Log>>,
        config: [u8; 8],
    }

    impl EventSource for Dummy {
        fn event_fd(&self) -> Option<RawFd> {
            None
        }
        fn handle_events(&mut self) -> Work {
            Work::Done
        }
    }

    impl VirtioDevice for Dummy {
        fn device_type(&self) -> u32 {
            42
        }
        fn queue_max_sizes(&self) -> &[u16] {
            &[16, 16]
        }
        fn features(&self) -> u64 {
            VIRTIO_F_VERSION_1 | 1
        }
        fn ack_features(&mut self, features: u64) {
            self.log.lock().expect("test lock").acked = features;
        }
        fn config_space(&self) -> std::borrow::Cow<'_, [u8]> {
            std::borrow::Cow::Borrowed(&self.config)
        }
        fn activate(
            &mut self,
            _mem: GuestMemory,
            queues: Vec<Queue>,
            _interrupt: Interrupt,
        ) -> Result<(), ActivateError> {
            self.log
                .lock()
                .expect("test lock")
                .activated
                .push(queues.len());
            Ok(())
        }
        fn queue_notify(&mut self, index: u16) -> Work {
            self.log.lock().expect("test lock").notified.push(index);
            Work::Done
        }
        fn save(&self) -> crate::virtio::persist::DeviceState {
            crate::virtio::persist::DeviceState::Block(crate::virtio::persist::BlockState {
                acked_features: 0,
                queues: None,
            })
        }
        fn restore(
            &mut self,
            _mem: GuestMemory,
            _interrupt: Interrupt,
            _state: &crate::virtio::persist::DeviceState,
        ) -> Result<(), RestoreError> {
            Ok(())
        }
        fn reset(&mut self) {
            self.log.lock().expect("test lock").resets += 1;
        }
    }

    fn transport() -> (MmioTransport, Arc<Mutex<Log>>, GuestMemory) {
        let mem = GuestMemory::from_ranges(&[(GuestAddress(0), 0x10_0000)]).expect("guest memory");
        let log = Arc::new(Mutex::new(Log::default()));
        let dev = Dummy {
            log: log.clone(),
            config: *b"abcdefgh",
        };
        let irq = Arc::new(EventFd::new(0).expect("eventfd"));
        let t = MmioTransport::new(Box::new(dev), mem.clone(), Interrupt::new(irq));
        (t, log, mem)
    }

    fn r(t: &mut MmioTransport, off: u64) -> u32 {
        let mut b = [0u8; 4];
        t.read(off, &mut b);
        u32::from_le_bytes(b)
    }

    fn w(t: &mut MmioTransport, off: u64, v: u32) {
        t.write(off, &v.to_le_bytes());
    }

    fn setup_queue(t: &mut MmioTransport, mem: &GuestMemory, index: u32, base: u64) {
        let q = MockSplitQueue::create(mem, GuestAddress(base), 16);
        w(t, reg::QUEUE_SEL, index);
        assert_eq!(r(t, reg::QUEUE_NUM_MAX), 16);
        w(t, reg::QUEUE_NUM, 16);
        let (d, a, u) = (q.desc_table_addr().0, q.avail_addr().0, q.used_addr().0);
        w(t, reg::QUEUE_DESC_LOW, d as u32);
        w(t, reg::QUEUE_DESC_HIGH, (d >> 32) as u32);
        w(t, reg::QUEUE_DRIVER_LOW, a as u32);
        w(t, reg::QUEUE_DRIVER_HIGH, (a >> 32) as u32);
        w(t, reg::QUEUE_DEVICE_LOW, u as u32);
        w(t, reg::QUEUE_DEVICE_HIGH, (u >> 32) as u32);
        w(t, reg::QUEUE_READY, 1);
        assert_eq!(r(t, reg::QUEUE_READY), 1);
    }

    fn negotiate(t: &mut MmioTransport) {
        w(t, reg::STATUS, status::ACKNOWLEDGE);
        w(t, reg::STATUS, status::ACKNOWLEDGE | status::DRIVER);
        w(t, reg::DRIVER_FEATURES_SEL, 1);
        w(t, reg::DRIVER_FEATURES, 1);
        w(t, reg::DRIVER_FEATURES_SEL, 0);
        w(t, reg::DRIVER_FEATURES, 1);
        w(
            t,
            reg::STATUS,
            status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK,
        );
    }

    const ALL_OK: u32 =
        status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK | status::DRIVER_OK;

    #[test]
    fn mmio_identity_registers_read_spec_values() {
        let (mut t, _, _) = transport();
        assert_eq!(r(&mut t, reg::MAGIC_VALUE), 0x7472_6976);
        assert_eq!(r(&mut t, reg::VERSION), 2);
        assert_eq!(r(&mut t, reg::DEVICE_ID), 42);
        assert_eq!(r(&mut t, reg::VENDOR_ID), MMIO_VENDOR_ID);
        w(&mut t, reg::DEVICE_FEATURES_SEL, 0);
        assert_eq!(r(&mut t, reg::DEVICE_FEATURES), 1);
        w(&mut t, reg::DEVICE_FEATURES_SEL, 1);
        assert_eq!(r(&mut t, reg::DEVICE_FEATURES), 1);
        w(&mut t, reg::DEVICE_FEATURES_SEL, 7);
        assert_eq!(r(&mut t, reg::DEVICE_FEATURES), 0);
        w(&mut t, reg::QUEUE_SEL, 5);
        assert_eq!(r(&mut t, reg::QUEUE_NUM_MAX), 0);
        let mut cfg = [0u8; 2];
        t.read(reg::CONFIG + 2, &mut cfg);
        assert_eq!(&cfg, b"cd");
    }

    #[test]
    fn mmio_full_setup_activates_and_forwards_notifications() {
        let (mut t, log, mem) = transport();
        negotiate(&mut t);
        assert_eq!(
            r(&mut t, reg::STATUS) & status::FEATURES_OK,
            status::FEATURES_OK
        );
        setup_queue(&mut t, &mem, 0, 0x1000);
        setup_queue(&mut t, &mem, 1, 0x2000);
        w(&mut t, reg::STATUS, ALL_OK);
        assert!(t.is_activated());
        assert_eq!(r(&mut t, reg::STATUS), ALL_OK);
        assert_eq!(log.lock().expect("lock").activated, vec![2]);
        assert_eq!(log.lock().expect("lock").acked, VIRTIO_F_VERSION_1 | 1);
        w(&mut t, reg::QUEUE_NOTIFY, 1);
        t.queue_notify(0);
        t.queue_notify(9);
        assert_eq!(log.lock().expect("lock").notified, vec![1, 0]);
        // Queue setup is frozen after DRIVER_OK.
        w(&mut t, reg::QUEUE_READY, 0);
        assert_eq!(r(&mut t, reg::QUEUE_READY), 1);
        // Reset.
        w(&mut t, reg::STATUS, 0);
        assert!(!t.is_activated());
        assert_eq!(r(&mut t, reg::STATUS), 0);
        assert_eq!(log.lock().expect("lock").resets, 1);
        w(&mut t, reg::QUEUE_SEL, 0);
        assert_eq!(r(&mut t, reg::QUEUE_READY), 0);
    }

    #[test]
    fn mmio_save_restore_round_trips_registers_and_activation() {
        let (mut t, log, mem) = transport();
        negotiate(&mut t);
        setup_queue(&mut t, &mem, 0, 0x1000);
        setup_queue(&mut t, &mem, 1, 0x2000);
        w(&mut t, reg::STATUS, ALL_OK);
        t.interrupt().signal_used_queue();
        w(&mut t, reg::QUEUE_SEL, 1);
        let saved = t.save();
        assert!(saved.activated);
        assert_eq!(saved.interrupt_status, crate::VIRTIO_MMIO_INT_VRING);
        let dev = Dummy {
            log: log.clone(),
            config: *b"abcdefgh",
        };
        let irq = Arc::new(EventFd::new(0).expect("eventfd"));
        let mut back = MmioTransport::restore(Box::new(dev), mem, Interrupt::new(irq), &saved)
            .expect("restore");
        assert_eq!(back.save(), saved);
        assert!(back.is_activated());
        for off in [reg::STATUS, reg::QUEUE_READY, reg::INTERRUPT_STATUS] {
            assert_eq!(r(&mut back, off), r(&mut t, off), "register {off:#x}");
        }
        back.queue_notify(1);
        assert_eq!(log.lock().expect("lock").notified, vec![1]);
    }

    #[test]
    fn mmio_restore_with_wrong_queue_count_fails() {
        let (t, log, mem) = transport();
        let mut saved = t.save();
        saved.queues.pop();
        let dev = Dummy {
            log,
            config: *b"abcdefgh",
        };
        let irq = Arc::new(EventFd::new(0).expect("eventfd"));
        assert!(MmioTransport::restore(Box::new(dev), mem, Interrupt::new(irq), &saved).is_err());
    }

    #[test]
    fn mmio_features_without_version_1_are_refused() {
        let (mut t, _, _) = transport();
        w(&mut t, reg::STATUS, status::ACKNOWLEDGE | status::DRIVER);
        w(&mut t, reg::DRIVER_FEATURES, 1);
        w(
            &mut t,
            reg::STATUS,
            status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK,
        );
        assert_eq!(r(&mut t, reg::STATUS) & status::FEATURES_OK, 0);
    }

    #[test]
    fn mmio_unoffered_features_are_refused() {
        let (mut t, _, _) = transport();
        w(&mut t, reg::STATUS, status::ACKNOWLEDGE | status::DRIVER);
        w(&mut t, reg::DRIVER_FEATURES, 0b110);
        w(&mut t, reg::DRIVER_FEATURES_SEL, 1);
        w(&mut t, reg::DRIVER_FEATURES, 1);
        w(
            &mut t,
            reg::STATUS,
            status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK,
        );
        assert_eq!(r(&mut t, reg::STATUS) & status::FEATURES_OK, 0);
    }

    #[test]
    fn mmio_driver_ok_with_bad_queue_sets_needs_reset() {
        let (mut t, log, mem) = transport();
        negotiate(&mut t);
        setup_queue(&mut t, &mem, 0, 0x1000);
        // Queue 1 is never made ready.
        w(&mut t, reg::STATUS, ALL_OK);
        assert!(!t.is_activated());
        assert_ne!(r(&mut t, reg::STATUS) & status::DEVICE_NEEDS_RESET, 0);
        assert!(log.lock().expect("lock").activated.is_empty());
        assert_ne!(
            r(&mut t, reg::INTERRUPT_STATUS) & crate::VIRTIO_MMIO_INT_CONFIG,
            0
        );
        w(&mut t, reg::INTERRUPT_ACK, crate::VIRTIO_MMIO_INT_CONFIG);
        assert_eq!(r(&mut t, reg::INTERRUPT_STATUS), 0);
        t.queue_notify(0);
        assert!(log.lock().expect("lock").notified.is_empty());
    }

    #[test]
    fn mmio_device_needing_reset_shows_it_until_the_driver_resets() {
        let (mut t, _, mem) = transport();
        negotiate(&mut t);
        setup_queue(&mut t, &mem, 0, 0x1000);
        setup_queue(&mut t, &mem, 1, 0x2000);
        w(&mut t, reg::STATUS, ALL_OK);
        assert_eq!(r(&mut t, reg::STATUS), ALL_OK);
        t.interrupt().set_needs_reset();
        assert_eq!(r(&mut t, reg::STATUS), ALL_OK | status::DEVICE_NEEDS_RESET);
        assert_ne!(
            r(&mut t, reg::INTERRUPT_STATUS) & crate::VIRTIO_MMIO_INT_CONFIG,
            0
        );
        // Saved and restored with the flag.
        let saved = t.save();
        assert_ne!(saved.status & status::DEVICE_NEEDS_RESET, 0);
        w(&mut t, reg::STATUS, 0);
        assert_eq!(r(&mut t, reg::STATUS), 0);
        assert!(!t.interrupt().needs_reset());
    }

    #[test]
    fn mmio_misaligned_or_null_rings_are_not_activated() {
        for (reg_low, value) in [
            (reg::QUEUE_DESC_LOW, 0x1008),
            (reg::QUEUE_DRIVER_LOW, 0x1001),
            (reg::QUEUE_DEVICE_LOW, 0x1002),
            (reg::QUEUE_DRIVER_LOW, 0),
        ] {
            let (mut t, _, mem) = transport();
            negotiate(&mut t);
            setup_queue(&mut t, &mem, 0, 0x1000);
            setup_queue(&mut t, &mem, 1, 0x2000);
            w(&mut t, reg::QUEUE_SEL, 1);
            w(&mut t, reg::QUEUE_READY, 0);
            w(&mut t, reg_low, value);
            w(&mut t, reg::QUEUE_READY, 1);
            w(&mut t, reg::STATUS, ALL_OK);
            assert!(!t.is_activated(), "{reg_low:#x} = {value:#x}");
            assert_ne!(r(&mut t, reg::STATUS) & status::DEVICE_NEEDS_RESET, 0);
            assert_eq!(t.interrupt().guest_errors(), 1);
        }
    }

    #[test]
    fn mmio_queue_outside_memory_is_not_activated() {
        let (mut t, _, mem) = transport();
        negotiate(&mut t);
        setup_queue(&mut t, &mem, 0, 0x1000);
        setup_queue(&mut t, &mem, 1, 0x2000);
        w(&mut t, reg::QUEUE_SEL, 1);
        w(&mut t, reg::QUEUE_READY, 0);
        w(&mut t, reg::QUEUE_DESC_HIGH, 0xffff);
        w(&mut t, reg::QUEUE_READY, 1);
        w(&mut t, reg::STATUS, ALL_OK);
        assert!(!t.is_activated());
    }

    #[test]
    fn mmio_invalid_queue_num_is_ignored() {
        let (mut t, _, _) = transport();
        w(&mut t, reg::QUEUE_SEL, 0);
        for bad in [0, 3, 32, 0x1_0000] {
            w(&mut t, reg::QUEUE_NUM, bad);
        }
        w(&mut t, reg::QUEUE_NUM, 8);
        assert_eq!(t.queues[0].size, 8);
    }

    #[test]
    fn mmio_random_accesses_do_not_panic() {
        let (mut t, _, _) = transport();
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..100_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let off = (x >> 8) % 0x140;
            let len = [1usize, 2, 4, 8][(x & 3) as usize];
            let v = (x >> 32).to_le_bytes();
            if x & 0x10 == 0 {
                let mut b = [0u8; 8];
                t.read(off, &mut b[..len]);
            } else {
                t.write(off, &v[..len]);
            }
        }
    }
}
