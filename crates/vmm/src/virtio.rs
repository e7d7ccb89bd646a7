//! virtio-mmio devices as the VMM sees them: a window on the MMIO bus, an
//! interrupt line (irqfd), one ioeventfd per queue, and an event source for
//! the main loop. The devices themselves live in `forkbox-devices`.

use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use forkbox_devices::virtio::block::Block;
use forkbox_devices::virtio::disk::Disk;
use forkbox_devices::virtio::mmio::MmioTransport;
use forkbox_devices::virtio::net::Net;
use forkbox_devices::virtio::overlay::Overlay;
use forkbox_devices::virtio::persist::{RestoreError, TransportState};
use forkbox_devices::virtio::vsock::Vsock;
use forkbox_devices::virtio::VirtioDevice;
use forkbox_devices::{BusDevice, EventSource, GuestMemory, Interrupt, Work};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::layout::VirtioWindow;
use crate::net::{BrokerLinks, GatewayBackend, NetConfig, NetError, GUEST_MAC};

/// Guest CID of the VM's vsock device.
pub const GUEST_CID: u64 = 3;

/// A virtio-mmio transport: register accesses, host events, queue kicks.
pub trait VirtioMmio: BusDevice + EventSource {
    /// The driver kicked queue `index` (delivered through an ioeventfd);
    /// [`Work::More`]: the device's budget for this turn ran out.
    fn queue_notify(&mut self, index: u16) -> Work;
    /// The transport's and its device's state.
    fn save(&self) -> TransportState;
    /// The interrupt status register: non-zero while an interrupt the
    /// driver has not acknowledged is outstanding.
    fn interrupt_status(&self) -> u32;
    /// Whether the driver has set the device up (`DRIVER_OK`): only a
    /// restored device is, when its VM is wired.
    fn is_activated(&self) -> bool;
}

/// The host sides of a VM's devices that are opened by path: opened
/// before the VMM entered its own root (or by the asker of its fork),
/// and taken by the devices [`create`] or [`restore`] makes.
#[derive(Debug, Default)]
pub struct HostSides {
    /// The vsock device's socket, bound and listening.
    pub vsock: Option<UnixListener>,
    /// The network's links to its broker.
    pub broker: Option<BrokerLinks>,
    /// The writable disks, in order (built by the VMM from their bases and
    /// tops, or a fork child's from its parent's).
    pub disks: Vec<Arc<Mutex<Overlay>>>,
}

/// A device the command line asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceSpec {
    /// Read-only virtio-blk backed by a file.
    Block(PathBuf),
    /// Read-only virtio-blk with a partition per file (an image's layers,
    /// bottom first).
    Layers(Vec<PathBuf>),
    /// Writable virtio-blk over the VM's writable disk `n` ([`HostSides`]),
    /// its serial `fbx-rw-N`, by which the guest finds it.
    Writable(usize),
    /// virtio-vsock whose host side is a unix socket (opened before the
    /// VMM entered its own root, and handed to [`create`] or [`restore`]).
    Vsock { uds: PathBuf },
    /// virtio-net behind the userspace gateway.
    Net(NetConfig),
}

#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("cannot open disk {path}")]
    Block {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("writable disk {0} was not set up beforehand")]
    DiskNotOpened(usize),
    #[error("vsock at {0} was not opened beforehand")]
    VsockNotOpened(PathBuf),
    #[error("cannot set up vsock at {path}")]
    Vsock {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot set up the network")]
    Net(#[source] NetError),
    #[error("too many virtio devices: {0} (at most {max})", max = crate::layout::MAX_VIRTIO_DEVICES)]
    TooMany(usize),
    #[error("cannot create an eventfd")]
    EventFd(#[source] std::io::Error),
    #[error("saved state has {saved} virtio devices, the VM has {have}")]
    StateCount { saved: usize, have: usize },
    #[error("cannot restore virtio device {0}")]
    Restore(usize, #[source] RestoreError),
}

/// One device placed on the bus.
pub struct VirtioSlot {
    pub window: VirtioWindow,
    pub device: Arc<Mutex<dyn VirtioMmio>>,
    pub queues: u16,
    pub irq: Arc<EventFd>,
}

impl VirtioMmio for MmioTransport {
    fn queue_notify(&mut self, index: u16) -> Work {
        MmioTransport::queue_notify(self, index)
    }

    fn save(&self) -> TransportState {
        MmioTransport::save(self)
    }

    fn interrupt_status(&self) -> u32 {
        self.interrupt().status()
    }

    fn is_activated(&self) -> bool {
        MmioTransport::is_activated(self)
    }
}

/// Creates the transports for `specs`, in order, at windows 0, 1, ...,
/// behind `sides`.
pub fn create(
    specs: &[DeviceSpec],
    mem: &GuestMemory,
    sides: HostSides,
) -> Result<Vec<VirtioSlot>, DeviceError> {
    place(specs, mem, None, sides)
}

/// Creates fresh devices for `specs` (disks re-opened, the host sides
/// `sides`, new) and puts each back into its saved state.
pub fn restore(
    specs: &[DeviceSpec],
    mem: &GuestMemory,
    states: &[TransportState],
    sides: HostSides,
) -> Result<Vec<VirtioSlot>, DeviceError> {
    if states.len() != specs.len() {
        return Err(DeviceError::StateCount {
            saved: states.len(),
            have: specs.len(),
        });
    }
    place(specs, mem, Some(states), sides)
}

fn new_device(
    spec: &DeviceSpec,
    sides: &mut HostSides,
) -> Result<Box<dyn VirtioDevice>, DeviceError> {
    Ok(match spec {
        DeviceSpec::Block(path) => Box::new(
            crate::opened::disk(path)
                .and_then(Block::from_file)
                .map_err(|source| DeviceError::Block {
                    path: path.clone(),
                    source,
                })?,
        ),
        DeviceSpec::Layers(paths) => {
            let files = paths
                .iter()
                .map(|path| {
                    crate::opened::disk(path).map_err(|source| DeviceError::Block {
                        path: path.clone(),
                        source,
                    })
                })
                .collect::<Result<Vec<_>, _>>()?;
            let disk = Disk::layered(files).map_err(|source| DeviceError::Block {
                path: paths.first().cloned().unwrap_or_default(),
                source,
            })?;
            Box::new(Block::from_disk(disk))
        }
        DeviceSpec::Writable(n) => {
            let overlay = sides.disks.get(*n).ok_or(DeviceError::DiskNotOpened(*n))?;
            Box::new(Block::writable(
                Arc::clone(overlay),
                format!("fbx-rw-{n}").as_bytes(),
            ))
        }
        DeviceSpec::Vsock { uds } => {
            let listener = sides
                .vsock
                .take()
                .ok_or_else(|| DeviceError::VsockNotOpened(uds.clone()))?;
            Box::new(Vsock::with_listener(GUEST_CID, listener).map_err(|source| {
                DeviceError::Vsock {
                    path: uds.clone(),
                    source,
                }
            })?)
        }
        DeviceSpec::Net(cfg) => Box::new(Net::new(
            GUEST_MAC,
            Box::new(GatewayBackend::new(cfg, sides.broker.take()).map_err(DeviceError::Net)?),
        )),
    })
}

fn place(
    specs: &[DeviceSpec],
    mem: &GuestMemory,
    states: Option<&[TransportState]>,
    mut sides: HostSides,
) -> Result<Vec<VirtioSlot>, DeviceError> {
    if specs.len() > crate::layout::MAX_VIRTIO_DEVICES {
        return Err(DeviceError::TooMany(specs.len()));
    }
    let mut slots = Vec::with_capacity(specs.len());
    for (i, spec) in specs.iter().enumerate() {
        let window = VirtioWindow::nth(i).ok_or(DeviceError::TooMany(specs.len()))?;
        let device = new_device(spec, &mut sides)?;
        let queues = u16::try_from(device.queue_max_sizes().len()).unwrap_or(u16::MAX);
        let irq = Arc::new(EventFd::new(EFD_NONBLOCK).map_err(DeviceError::EventFd)?);
        let interrupt = Interrupt::new(Arc::clone(&irq));
        let transport = match states.and_then(|s| s.get(i)) {
            Some(state) => MmioTransport::restore(device, mem.clone(), interrupt, state)
                .map_err(|e| DeviceError::Restore(i, e))?,
            None => MmioTransport::new(device, mem.clone(), interrupt),
        };
        slots.push(VirtioSlot {
            window,
            device: Arc::new(Mutex::new(transport)),
            queues,
            irq,
        });
    }
    Ok(slots)
}

/// MMIO dispatch for vCPU threads: finds the window and locks its device.
pub struct MmioBus {
    devices: Vec<(VirtioWindow, Arc<Mutex<dyn VirtioMmio>>)>,
}

impl MmioBus {
    pub fn new(slots: &[VirtioSlot]) -> Self {
        Self {
            devices: slots
                .iter()
                .map(|s| (s.window, Arc::clone(&s.device)))
                .collect(),
        }
    }

    fn find(&self, addr: u64) -> Option<(u64, &Arc<Mutex<dyn VirtioMmio>>)> {
        self.devices
            .iter()
            .find(|(w, _)| w.contains(addr))
            .map(|(w, d)| (addr - w.base, d))
    }

    /// A load: unclaimed addresses read as all ones.
    pub fn read(&self, addr: u64, data: &mut [u8]) {
        match self.find(addr) {
            Some((off, dev)) => lock(dev).read(off, data),
            None => data.fill(0xff),
        }
    }

    /// A store: unclaimed addresses ignore it.
    pub fn write(&self, addr: u64, data: &[u8]) {
        if let Some((off, dev)) = self.find(addr) {
            if off == crate::layout::VIRTIO_MMIO_QUEUE_NOTIFY {
                // The queue's ioeventfd should have taken this without an exit.
                tracing::debug!(addr, ?data, "queue notify reached the vCPU thread");
            }
            lock(dev).write(off, data);
        }
    }
}

/// Locks a device; a poisoned lock (a panicked thread) still yields it.
pub fn lock<'a>(
    dev: &'a Mutex<dyn VirtioMmio + 'static>,
) -> std::sync::MutexGuard<'a, dyn VirtioMmio + 'static> {
    match dev.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}
