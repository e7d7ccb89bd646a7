//! Assembling and running one VM: KVM objects in the order that is fast
//! (memory slots before the irqchip), devices, ACPI, boot state, one thread
//! per vCPU, and the main thread's epoll loop, which also serves the
//! control socket (pause, resume, fork, zygote, snapshot).
//!
//! A VM comes to life in one of two ways: [`Machine::boot`] (kernel and
//! initramfs) or [`Machine::restore`] (captured state over a memory
//! mapping). A fork child and `--restore` both take the second path.
//!
//! Its submodules, one concern each:
//! - `event_loop`: the epoll loop, device wiring, the panic watch.
//! - `control_server`: the control socket's clients and requests.
//! - `snapshot`: pause, resume, capture, zygote, snapshot files.
//! - `forking`: fork requests and the fork child's rebuild.

mod control_server;
mod event_loop;
mod forking;
mod orphan;
mod snapshot;

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use forkbox_devices::virtio::overlay::{Overlay, OverlayError, Run};
use kvm_bindings::{kvm_pit_config, KVM_MAX_CPUID_ENTRIES, KVM_PIT_SPEAKER_DUMMY};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use vm_memory::{Bytes, GuestAddress};
use vm_superio::serial::NoEvents;
use vm_superio::Serial;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vmm_sys_util::signal::register_signal_handler;

use forkbox_vmm_api::{self as api, RunState};

use crate::acpi::{self, AcpiConfig};
use crate::boot::{self, BootSpec};
use crate::cpu;
use crate::host;
use crate::layout::{
    MemoryLayout, VirtioWindow, KVM_IDENTITY_MAP_ADDR, KVM_TSS_ADDR, MIB, SERIAL_GSI,
};
use crate::memory::GuestRam;
use crate::net::BrokerLinks;
use crate::pio::{PortBus, PortEvent};
use crate::serial::{Echo, IrqTrigger, SerialLog, SerialOutput, TailBuffer};
use crate::state::{self, Hardware, MachineState, SerialState, StateError, VmState};
use crate::vcpu::{self, ExitSignal, PauseError, VcpuContext, VcpuOutcome, Vcpus};
use crate::virtio::{self, DeviceSpec, HostSides, MmioBus, VirtioSlot};
use crate::{VmConfig, VmExit};

use control_server::CtlItem;
use event_loop::{
    wire_device, Again, DevToken, FIRST_DYNAMIC_TOKEN, TOKEN_DEVICES, TOKEN_EXIT, TOKEN_LISTENER,
};
use forking::{become_child, ChildPlan};

pub use event_loop::PanicWatch;

pub use crate::vcpu::VcpuError;

#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error(transparent)]
    Host(#[from] host::HostError),
    #[error("cannot confine the main thread")]
    Lockdown(#[source] crate::lockdown::LockdownError),
    #[error("no process has owned this VM for {} s (its daemon ended and none adopted it): the VM ends", .0.as_secs())]
    Orphaned(std::time::Duration),
    #[error(
        "the host failed a write to the guest's writable disk ({0}): the guest's file system \
         lost it, through no fault of the guest's, so the VM ends; the host's disk is likely \
         full: free space where the VMs' directories are (the daemon's TMPDIR)"
    )]
    HostDisk(String),
    #[error("KVM: cannot {0}")]
    Kvm(&'static str, #[source] kvm_ioctls::Error),
    #[error("guest memory")]
    Memory(#[from] crate::memory::MemoryError),
    #[error("ACPI tables")]
    Acpi(#[from] acpi::AcpiError),
    #[error("cannot write ACPI tables to guest memory")]
    AcpiWrite(#[source] vm_memory::GuestMemoryError),
    #[error("boot")]
    Boot(#[from] boot::BootError),
    #[error("vCPU {id} setup")]
    Cpu {
        id: u8,
        #[source]
        source: cpu::CpuError,
    },
    #[error("virtio devices")]
    Devices(#[from] virtio::DeviceError),
    #[error("cannot open the serial log {path}")]
    SerialLog {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot restore the serial port")]
    SerialRestore,
    #[error("event loop: {0}")]
    EventLoop(&'static str, #[source] std::io::Error),
    #[error("cannot start vCPU thread {0}")]
    Thread(u8, #[source] std::io::Error),
    #[error("cannot install the vCPU kick signal handler")]
    KickSignal(#[source] vmm_sys_util::errno::Error),
    #[error("vCPU {id} failed")]
    Vcpu {
        id: u8,
        #[source]
        source: VcpuError,
    },
    #[error("VM state")]
    State(#[from] StateError),
    #[error("cannot pause the VM")]
    Pause(#[from] PauseError),
    #[error("cannot listen on the control socket {path}")]
    ControlSocket {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot listen on the vsock socket {path}")]
    VsockSocket {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot open the end note {path}")]
    EndNote {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the fork request carries {carried} descriptors; its children need {needed}")]
    ChildFds { needed: usize, carried: usize },
    #[error("cannot write the snapshot's {what} file")]
    SnapshotWrite {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot read the state file {path}")]
    StateFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("this VM has a vsock device: a vsock socket path is required")]
    VsockPathMissing,
    #[error("this VM's network has a broker: a fork child needs one of its own")]
    ChildBrokerMissing,
    #[error("this VM has a network device: a network policy is required")]
    NetConfigMissing,
    #[error("saved state has {saved} vCPUs, its hardware says {hardware}")]
    VcpuCount { saved: usize, hardware: u8 },
    #[error("guest memory is shared with another owner")]
    RamShared,
    #[error("cannot open the writable disk's top {path}")]
    WritableTop {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("writable disk {index} ({base})")]
    WritableDisk {
        index: usize,
        base: PathBuf,
        #[source]
        source: OverlayError,
    },
    #[error("{got} tops for {want} writable disks")]
    WritableCount { got: usize, want: usize },
    #[error("cannot read the snapshot's file of writable disk {index}")]
    WritableSaved {
        index: usize,
        #[source]
        source: std::io::Error,
    },
}

fn kvm_err(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VmError {
    move |e| VmError::Kvm(what, e)
}

fn eventfd() -> Result<EventFd, VmError> {
    EventFd::new(EFD_NONBLOCK).map_err(|e| VmError::EventLoop("eventfd", e))
}

/// Where a VM's host-side endpoints are (per process: a fork child gets
/// its own).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoints {
    pub control: Option<PathBuf>,
    pub vsock_uds: Option<PathBuf>,
    pub serial_log: Option<PathBuf>,
    pub echo: Echo,
    /// The network's policy, broker and log (a VM with a net device).
    pub net: Option<crate::net::NetConfig>,
    /// Empty files, one per writable disk: where its writes go.
    pub writable_tops: Vec<PathBuf>,
}

impl Endpoints {
    /// Binds the control and vsock sockets, opens the serial log and the
    /// end note ([`api::END_FILE`], beside the control socket). A VMM
    /// does it before it enters its own root, where these paths may lead
    /// nowhere; a fork child's come opened with the fork request.
    pub fn open(self) -> Result<Opened, VmError> {
        let control = self.control.as_deref().map(listen).transpose()?;
        let vsock = match &self.vsock_uds {
            Some(path) => {
                Some(
                    UnixListener::bind(path).map_err(|source| VmError::VsockSocket {
                        path: path.clone(),
                        source,
                    })?,
                )
            }
            None => None,
        };
        let serial_log = match &self.serial_log {
            Some(path) => Some(
                OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .map_err(|source| VmError::SerialLog {
                        path: path.clone(),
                        source,
                    })?,
            ),
            None => None,
        };
        let end_note = match &self.control {
            Some(control) => {
                let path = control.with_file_name(api::END_FILE);
                let file =
                    File::create(&path).map_err(|source| VmError::EndNote { path, source })?;
                // Room for the note on a disk that fills up later.
                if let Err(e) = api::reserve_end_file(&file) {
                    tracing::debug!("cannot reserve room for the end note: {e}");
                }
                Some(file)
            }
            None => None,
        };
        let tops = self
            .writable_tops
            .iter()
            .map(|path| open_top(path))
            .collect::<Result<Vec<File>, VmError>>()?;
        let broker = match self.net.as_ref().and_then(|n| n.broker.as_ref()) {
            Some(path) => Some(BrokerLinks::connect(path).map_err(|source| {
                VmError::Devices(virtio::DeviceError::Net(crate::net::NetError::Broker {
                    path: path.clone(),
                    source,
                }))
            })?),
            None => None,
        };
        Ok(Opened {
            control,
            sides: HostSides {
                vsock,
                broker,
                disks: Vec::new(),
            },
            serial_log,
            end_note,
            tops,
            names: self,
        })
    }
}

/// A writable disk's top: the empty file at `path`, opened to read and
/// write and unlinked, so that its blocks are freed when the last VMM
/// holding it (this one, its fork children) ends.
fn open_top(path: &Path) -> Result<File, VmError> {
    let err = |source| VmError::WritableTop {
        path: path.to_owned(),
        source,
    };
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(err)?;
    std::fs::remove_file(path).map_err(err)?;
    Ok(file)
}

/// A VM's host-side endpoints, open: what [`Endpoints::open`] opened, or
/// what came with a fork request for a child. `names` says where they
/// are, for messages.
#[derive(Debug)]
pub struct Opened {
    pub control: Option<UnixListener>,
    /// The vsock socket and the network broker's links.
    pub sides: HostSides,
    pub serial_log: Option<File>,
    /// Where the VMM notes how its VM ended.
    pub end_note: Option<File>,
    /// The writable disks' tops, in order (the disks are built of them).
    pub tops: Vec<File>,
    pub names: Endpoints,
}

impl Opened {
    /// What the machine keeps, the serial console's log, the devices'
    /// host sides, and the writable disks' tops.
    fn split(self) -> (Kept, Option<File>, HostSides, Vec<File>) {
        let kept = Kept {
            endpoints: self.names,
            control: self.control,
            end_note: self.end_note,
        };
        (kept, self.serial_log, self.sides, self.tops)
    }
}

/// The endpoints a machine keeps itself (the others go to the serial
/// console and the devices).
struct Kept {
    endpoints: Endpoints,
    control: Option<UnixListener>,
    end_note: Option<File>,
}

/// How long a VM may go unowned (`--orphan-grace-secs`), for this process
/// and the fork children it makes; unset, forever.
static ORPHAN_GRACE: std::sync::OnceLock<std::time::Duration> = std::sync::OnceLock::new();

/// Sets, once, how long a VM of this process may go without an owner
/// (`{"op":"own"}`) before it ends.
pub fn set_orphan_grace(grace: std::time::Duration) {
    let _ = ORPHAN_GRACE.set(grace);
}

fn orphan_grace() -> Option<std::time::Duration> {
    ORPHAN_GRACE.get().copied()
}

/// Why the main loop stopped.
enum LoopEnd {
    Vcpu(u8, VcpuOutcome),
    PanicWithoutReset(String),
    /// This process is a fork child now: rebuild from the plan.
    Child(Box<ChildPlan>),
}

/// One running VM and everything the main thread drives.
pub struct Machine {
    hw: Hardware,
    /// Its endpoints' names, and its end note (the listeners, the serial
    /// log and the vsock socket went to their users).
    endpoints: Endpoints,
    end_note: Option<File>,
    vm: VmFd,
    ram: Arc<GuestRam>,
    pio: Arc<PortBus>,
    tail: Arc<Mutex<TailBuffer>>,
    slots: Vec<VirtioSlot>,
    dev_epoll: Epoll,
    dev_tokens: Vec<DevToken>,
    /// Device tokens whose device had work left at the end of a turn.
    dev_again: Again,
    ctl_epoll: Epoll,
    listener: Option<UnixListener>,
    items: HashMap<u64, CtlItem>,
    next_token: u64,
    exit: Arc<ExitSignal>,
    vcpus: Vcpus,
    run_state: RunState,
    /// Control connections that own the VM (`own`), and how long it has
    /// had none.
    owners: usize,
    unowned: orphan::Unowned,
    /// The writable disks, shared with their devices: frozen at a fork,
    /// saved in a snapshot, while the devices serve nothing.
    disks: Vec<Arc<Mutex<Overlay>>>,
    /// The VM-wide state (irqchip, PIT, kvmclock) read in the same pause as
    /// the vCPUs' states, kept while the VM stays paused: a zygote forked
    /// minutes after its bake gives every child the clock and the TSC of
    /// one instant, both advanced by the same gap.
    paused_vm: Option<VmState>,
    /// What a zygote's children map before their guest runs (`prefault`,
    /// [`crate::prefault`]).
    working_set: crate::prefault::WorkingSet,
}

/// A new VM with guest memory registered (before the irqchip: measured
/// milliseconds faster), the TSS and identity map, the irqchip and PIT2.
/// GSI routing and PIT reinjection stay KVM's defaults on every path, so
/// there is nothing about them to replay.
fn create_vm(kvm: &Kvm, ram: &GuestRam) -> Result<VmFd, VmError> {
    let t = Instant::now();
    let vm = kvm.create_vm().map_err(kvm_err("create a VM"))?;
    let created = t.elapsed();
    ram.register(&vm)?;
    let registered = t.elapsed();
    vm.set_tss_address(KVM_TSS_ADDR as usize)
        .map_err(kvm_err("set the TSS address"))?;
    vm.set_identity_map_address(KVM_IDENTITY_MAP_ADDR)
        .map_err(kvm_err("set the identity map address"))?;
    vm.create_irq_chip()
        .map_err(kvm_err("create the irqchip"))?;
    let irqchip = t.elapsed();
    let pit = kvm_pit_config {
        flags: KVM_PIT_SPEAKER_DUMMY,
        ..Default::default()
    };
    vm.create_pit2(pit).map_err(kvm_err("create the PIT"))?;
    tracing::debug!(?created, ?registered, ?irqchip, pit = ?t.elapsed(), "create_vm");
    Ok(vm)
}

/// Creates vCPU `id` and keeps its `kvm_run` mapping out of fork children
/// (there it would belong to a VM bound to the parent's mm).
fn create_vcpu(vm: &VmFd, id: u8, mmap_size: usize) -> Result<VcpuFd, VmError> {
    let mut vcpu = vm
        .create_vcpu(id.into())
        .map_err(kvm_err("create a vCPU"))?;
    let run: *mut kvm_bindings::kvm_run = vcpu.get_kvm_run();
    // SAFETY: `run` is the start of the vCPU's `kvm_run` mapping, which is
    // `mmap_size` bytes long (KVM_GET_VCPU_MMAP_SIZE) and owned by `vcpu`;
    // MADV_DONTFORK changes only what a child inherits.
    let rc = unsafe { libc::madvise(run.cast(), mmap_size, libc::MADV_DONTFORK) };
    if rc < 0 {
        tracing::warn!(
            "madvise(MADV_DONTFORK) on kvm_run: {}",
            std::io::Error::last_os_error()
        );
    }
    Ok(vcpu)
}

fn open_serial(
    vm: &VmFd,
    log: Option<File>,
    echo: Echo,
    saved: Option<&SerialState>,
) -> Result<(Arc<PortBus>, Arc<Mutex<TailBuffer>>), VmError> {
    let tail = Arc::new(Mutex::new(TailBuffer::default()));
    let irq = eventfd()?;
    vm.register_irqfd(&irq, SERIAL_GSI)
        .map_err(kvm_err("register the serial irqfd"))?;
    crate::lockdown::note_serial_log(log.as_ref().map_or(-1, |f| f.as_raw_fd()));
    let out = SerialOutput::new(log.map(SerialLog::new), Arc::clone(&tail), echo);
    let serial = match saved {
        Some(s) => Serial::from_state(&s.to_superio(), IrqTrigger(irq), NoEvents, out)
            .map_err(|_| VmError::SerialRestore)?,
        None => Serial::new(IrqTrigger(irq), out),
    };
    Ok((Arc::new(PortBus::new(serial)), tail))
}

fn device_specs(hw: &Hardware, endpoints: &Endpoints) -> Result<Vec<DeviceSpec>, VmError> {
    let layers = (!hw.layers.is_empty()).then(|| DeviceSpec::Layers(hw.layers.clone()));
    let disks = hw.disks.iter().cloned().map(DeviceSpec::Block);
    let writable = (0..hw.writable.len()).map(DeviceSpec::Writable);
    let mut specs: Vec<DeviceSpec> = layers.into_iter().chain(disks).chain(writable).collect();
    if hw.vsock {
        let uds = endpoints
            .vsock_uds
            .clone()
            .ok_or(VmError::VsockPathMissing)?;
        specs.push(DeviceSpec::Vsock { uds });
    }
    if hw.net {
        let net = endpoints.net.clone().ok_or(VmError::NetConfigMissing)?;
        specs.push(DeviceSpec::Net(net));
    }
    Ok(specs)
}

/// The control socket, bound and listening (made non-blocking by
/// `Machine::start`, as a fork child's is).
fn listen(path: &Path) -> Result<UnixListener, VmError> {
    UnixListener::bind(path).map_err(|source| VmError::ControlSocket {
        path: path.to_path_buf(),
        source,
    })
}

/// The parts every new VM shares, whichever way it came to life.
struct Parts {
    hw: Hardware,
    kept: Kept,
    vm: VmFd,
    ram: Arc<GuestRam>,
    pio: Arc<PortBus>,
    tail: Arc<Mutex<TailBuffer>>,
    slots: Vec<VirtioSlot>,
    disks: Vec<Arc<Mutex<Overlay>>>,
    vcpus: Vec<(VcpuFd, Vec<kvm_bindings::kvm_cpuid_entry2>)>,
    msr_indices: Arc<Vec<u32>>,
}

/// Writable disk `index`: `base` (opened once for the process tree, as
/// the read-only disks are) under `top`, with the blocks a snapshot's
/// file holds (`saved`: the file and its runs) between them.
fn writable_disk(
    index: usize,
    base: &Path,
    top: File,
    saved: Option<(File, &[Run])>,
) -> Result<Arc<Mutex<Overlay>>, VmError> {
    let err = |source| VmError::WritableDisk {
        index,
        base: base.to_owned(),
        source,
    };
    let base_file = crate::opened::disk(base).map_err(|e| err(OverlayError::Io(e)))?;
    let overlay = match saved {
        Some((file, runs)) => Overlay::restored(base_file, file, runs, top),
        None => Overlay::new(base_file, top),
    }
    .map_err(err)?;
    Ok(Arc::new(Mutex::new(overlay)))
}

/// Checks that `tops` has one top per writable disk of `hw`.
fn check_tops(hw: &Hardware, tops: &[File]) -> Result<(), VmError> {
    if tops.len() != hw.writable.len() {
        return Err(VmError::WritableCount {
            got: tops.len(),
            want: hw.writable.len(),
        });
    }
    Ok(())
}

impl Machine {
    /// Boots the VM `cfg` describes, behind `opened` (its endpoints).
    pub fn boot(cfg: &VmConfig, opened: Opened) -> Result<Machine, VmError> {
        let kvm = crate::opened::kvm()?;
        let layout = MemoryLayout::new(cfg.memory_mib * MIB);
        let ram = GuestRam::new(&layout)?;
        let vm = create_vm(&kvm, &ram)?;
        let (kept, serial_log, mut sides, tops) = opened.split();
        let hw = Hardware {
            vcpus: cfg.vcpus,
            memory_mib: cfg.memory_mib,
            layers: cfg.layers.clone(),
            disks: cfg.disks.clone(),
            writable: cfg
                .writable
                .iter()
                .map(|base| state::WritableDisk {
                    base: base.clone(),
                    saved: Vec::new(),
                })
                .collect(),
            vsock: cfg.vsock_uds.is_some(),
            net: cfg.net.is_some(),
        };
        check_tops(&hw, &tops)?;
        sides.disks = cfg
            .writable
            .iter()
            .zip(tops)
            .enumerate()
            .map(|(i, (base, top))| writable_disk(i, base, top, None))
            .collect::<Result<_, _>>()?;
        let disks = sides.disks.clone();
        let (pio, tail) = open_serial(&vm, serial_log, kept.endpoints.echo, None)?;
        let slots = virtio::create(&device_specs(&hw, &kept.endpoints)?, ram.memory(), sides)?;

        // ACPI and boot state.
        let windows: Vec<VirtioWindow> = slots.iter().map(|s| s.window).collect();
        let tables = acpi::build(&AcpiConfig {
            vcpus: cfg.vcpus,
            virtio: windows,
        })?;
        for (addr, blob) in &tables.blobs {
            ram.memory()
                .write_slice(blob, GuestAddress(*addr))
                .map_err(VmError::AcpiWrite)?;
        }
        let entry = boot::load(
            ram.memory(),
            &layout,
            &BootSpec {
                kernel: &cfg.kernel,
                initramfs: &cfg.initramfs,
                cmdline: &cfg.cmdline,
                rsdp_addr: tables.rsdp_addr,
            },
        )?;

        // vCPUs: all configured before any runs.
        let supported = kvm
            .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(kvm_err("get the supported CPUID"))?;
        let mmap_size = kvm
            .get_vcpu_mmap_size()
            .map_err(kvm_err("get the vCPU mmap size"))?;
        let mut vcpus = Vec::new();
        for id in 0..cfg.vcpus {
            let vcpu = create_vcpu(&vm, id, mmap_size)?;
            let mut cpuid = supported.clone();
            cpu::patch_cpuid(cpuid.as_mut_slice(), id, cfg.vcpus);
            cpu::configure(&vcpu, &cpuid).map_err(|source| VmError::Cpu { id, source })?;
            if id == 0 {
                cpu::set_boot_registers(&vcpu, &entry)
                    .map_err(|source| VmError::Cpu { id, source })?;
            }
            vcpus.push((vcpu, cpuid.as_slice().to_vec()));
        }
        let msr_indices = Arc::new(state::msr_indices(&kvm)?);
        Machine::start(Parts {
            hw,
            kept,
            vm,
            ram: Arc::new(ram),
            pio,
            tail,
            slots,
            disks,
            vcpus,
            msr_indices,
        })
    }

    /// Rebuilds a VM from `state` over `ram`: the one code path of a fork
    /// child (`ram` is the inherited mapping, now copy-on-write) and of
    /// `--restore` (`ram` maps the snapshot's memory file). Its writable
    /// disks come built in `opened.sides` (a fork child's from its
    /// parent's, a snapshot's from its files: [`run_restore`]).
    pub fn restore(
        ram: Arc<GuestRam>,
        saved: &MachineState,
        opened: Opened,
        working_set: &crate::prefault::WorkingSet,
        map_until: Instant,
    ) -> Result<Machine, VmError> {
        let (kept, serial_log, sides, _) = opened.split();
        let mut hw = saved.hardware.clone();
        if sides.disks.len() != hw.writable.len() {
            return Err(VmError::WritableCount {
                got: sides.disks.len(),
                want: hw.writable.len(),
            });
        }
        // The saved runs were the snapshot's; from here the disks know.
        for w in &mut hw.writable {
            w.saved.clear();
        }
        let disks = sides.disks.clone();
        if saved.vcpus.len() != usize::from(hw.vcpus) {
            return Err(VmError::VcpuCount {
                saved: saved.vcpus.len(),
                hardware: hw.vcpus,
            });
        }
        let t0 = Instant::now();
        let kvm = crate::opened::kvm()?;
        let vm = create_vm(&kvm, &ram)?;
        tracing::debug!(elapsed = ?t0.elapsed(), "restore: VM, memory slots, irqchip, PIT");
        let mmap_size = kvm
            .get_vcpu_mmap_size()
            .map_err(kvm_err("get the vCPU mmap size"))?;
        let mut vcpus = Vec::new();
        for s in &saved.vcpus {
            let vcpu = create_vcpu(&vm, s.id, mmap_size)?;
            state::restore_cpuid(&vcpu, s)?;
            vcpus.push((vcpu, s.cpuid.clone()));
        }
        state::restore_irqchip_and_pit(&vm, &saved.vm)?;
        let gap_ns = state::realtime_gap_ns(&saved.vm);
        for ((vcpu, _), s) in vcpus.iter().zip(&saved.vcpus) {
            state::restore_vcpu(vcpu, s, gap_ns)?;
        }
        state::restore_clock(&vm, &saved.vm, gap_ns)?;
        for ((vcpu, _), s) in vcpus.iter().zip(&saved.vcpus) {
            state::tell_guest_it_was_stopped(vcpu, s.id);
        }
        if let (false, Some((vcpu, _))) = (working_set.is_empty(), vcpus.first()) {
            let kvm = crate::prefault::kvm_can(&vm);
            crate::prefault::map_ahead(working_set, &ram, vcpu, kvm, map_until);
        }
        tracing::debug!(elapsed = ?t0.elapsed(), "restore: KVM state applied");
        // Devices last: a restored device may raise its interrupt at once
        // (vsock RSTs), which must land on the restored irqchip.
        let (pio, tail) = open_serial(&vm, serial_log, kept.endpoints.echo, Some(&saved.serial))?;
        let slots = virtio::restore(
            &device_specs(&hw, &kept.endpoints)?,
            ram.memory(),
            &saved.devices,
            sides,
        )?;
        let msr_indices = Arc::new(state::msr_indices(&kvm)?);
        tracing::debug!(elapsed = ?t0.elapsed(), "restore: devices");
        Machine::start(Parts {
            hw,
            kept,
            vm,
            ram,
            pio,
            tail,
            slots,
            disks,
            vcpus,
            msr_indices,
        })
    }

    /// Wires devices (fresh irqfds and ioeventfds), listens on the control
    /// socket and starts the vCPU threads.
    fn start(p: Parts) -> Result<Machine, VmError> {
        let dev_epoll = Epoll::new().map_err(|e| VmError::EventLoop("epoll_create", e))?;
        let mut dev_tokens = Vec::new();
        for (i, slot) in p.slots.iter().enumerate() {
            wire_device(&p.vm, i, slot, &dev_epoll, &mut dev_tokens)?;
        }
        let mmio = Arc::new(MmioBus::new(&p.slots));
        let ctl_epoll = Epoll::new().map_err(|e| VmError::EventLoop("epoll_create", e))?;
        let exit = Arc::new(ExitSignal::new(eventfd()?));
        let add = |fd: i32, token: u64| {
            ctl_epoll
                .ctl(
                    ControlOperation::Add,
                    fd,
                    EpollEvent::new(EventSet::IN, token),
                )
                .map_err(|e| VmError::EventLoop("epoll_ctl", e))
        };
        add(exit.evt.as_raw_fd(), TOKEN_EXIT)?;
        add(dev_epoll.as_raw_fd(), TOKEN_DEVICES)?;
        let listener = p.kept.control;
        if let Some(l) = &listener {
            l.set_nonblocking(true)
                .map_err(|source| VmError::ControlSocket {
                    path: p.kept.endpoints.control.clone().unwrap_or_default(),
                    source,
                })?;
            add(l.as_raw_fd(), TOKEN_LISTENER)?;
        }
        register_signal_handler(vcpu::kick_signal(), vcpu::on_kick).map_err(VmError::KickSignal)?;
        let contexts = p
            .vcpus
            .into_iter()
            .zip(0u8..)
            .map(|((vcpu, cpuid), id)| VcpuContext {
                vcpu,
                id,
                cpuid,
                msr_indices: Arc::clone(&p.msr_indices),
                pio: Arc::clone(&p.pio),
                mmio: Arc::clone(&mmio),
                exit: Arc::clone(&exit),
            })
            .collect();
        // The last step as the daemon's user: the guest runs as the VMM's.
        crate::lockdown::become_user().map_err(VmError::Lockdown)?;
        let vcpus = Vcpus::start(contexts).map_err(|(id, e)| VmError::Thread(id, e))?;
        Ok(Machine {
            hw: p.hw,
            endpoints: p.kept.endpoints,
            end_note: p.kept.end_note,
            vm: p.vm,
            ram: p.ram,
            pio: p.pio,
            tail: p.tail,
            slots: p.slots,
            disks: p.disks,
            dev_epoll,
            // Every device once at the start: a restored or forked device
            // may hold work whose kick went to the old process.
            dev_again: Again::all(dev_tokens.len()),
            dev_tokens,
            ctl_epoll,
            listener,
            items: HashMap::new(),
            next_token: FIRST_DYNAMIC_TOKEN,
            exit,
            vcpus,
            run_state: RunState::Running,
            owners: 0,
            unowned: orphan::Unowned::new(std::time::Instant::now()),
            paused_vm: None,
            working_set: Default::default(),
        })
    }

    /// Runs the VM to its end, becoming a fork child as often as a fork
    /// request makes this process one.
    pub fn run(self) -> Result<VmExit, VmError> {
        let mut m = self;
        if let Err(e) = crate::lockdown::confine_main_thread() {
            return m.finish(Err(VmError::Lockdown(e)));
        }
        loop {
            match m.event_loop() {
                Ok(LoopEnd::Child(plan)) => m = become_child(m, plan),
                end => return m.finish(end),
            }
        }
    }

    fn finish(mut self, end: Result<LoopEnd, VmError>) -> Result<VmExit, VmError> {
        self.vcpus.stop();
        let exit = self.conclude(end);
        // The serial log is what a host reading a lost VM has: say there
        // how it ended, and where the vCPU was on a triple fault.
        let how = match &exit {
            Ok(exit) => exit.to_string(),
            Err(e) => format!("error: {}", chain_ref(e)),
        };
        let detail = self
            .exit
            .detail()
            .map(|d| format!("; {d}"))
            .unwrap_or_default();
        self.note_in_serial_log(&format!("[forkbox-vmm] {how}{detail}"));
        self.note_end(&exit, &how);
        exit
    }

    /// Writes [`api::END_FILE`] beside the control socket, through the
    /// descriptor opened for it: how the VM ended, for the process that
    /// owns it (which cannot read a forked VMM's exit status). The serial
    /// log is no place for it: the guest writes there too.
    fn note_end(&self, exit: &Result<VmExit, VmError>, how: &str) {
        let Some(mut file) = self.end_note.as_ref() else {
            return;
        };
        let end = match exit {
            Ok(exit) => exit.end(),
            Err(_) => api::End::Error,
        };
        if let Err(e) = std::io::Write::write_all(&mut file, end.file_text(how).as_bytes()) {
            tracing::warn!("cannot note the VM's end in its {}: {e}", api::END_FILE);
        }
    }

    /// Through the descriptor the serial console writes to: the VMM's
    /// user may not open the log again (it was opened as the daemon's).
    fn note_in_serial_log(&self, line: &str) {
        let Some(path) = &self.endpoints.serial_log else {
            return;
        };
        if let Err(e) = crate::lockdown::append_to_serial_log(format!("\n{line}\n").as_bytes()) {
            tracing::warn!("cannot note the VM's end in {}: {e}", path.display());
        }
    }

    fn conclude(&mut self, end: Result<LoopEnd, VmError>) -> Result<VmExit, VmError> {
        let end = end?;
        let (id, outcome) = match end {
            LoopEnd::Vcpu(id, outcome) => (id, outcome),
            LoopEnd::PanicWithoutReset(line) => return Ok(VmExit::Panic { line }),
            LoopEnd::Child(_) => unreachable!("handled by Machine::run"),
        };
        match outcome {
            VcpuOutcome::Guest(PortEvent::PowerOff) => Ok(VmExit::PowerOff),
            VcpuOutcome::Guest(PortEvent::Reset(cause)) => {
                let panic = self.tail.lock().ok().and_then(|t| t.panic_line());
                Ok(match panic {
                    Some(line) => VmExit::Panic { line },
                    None => VmExit::Reset { cause },
                })
            }
            VcpuOutcome::Failed(source) => Err(VmError::Vcpu { id, source }),
            VcpuOutcome::Stopped => Err(VmError::Vcpu {
                id,
                source: VcpuError::Unexpected("stopped without a reason".into()),
            }),
        }
    }
}

fn chain(e: VmError) -> String {
    chain_ref(&e)
}

/// The error and its causes, `a: b: c`.
fn chain_ref(e: &VmError) -> String {
    let mut s = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        s.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    s
}

/// Builds the VM described by `cfg`, runs it to its end and says how it
/// ended. The caller checked the host first (`host::check_host`).
///
/// Every vCPU thread has ended (or, after a bounded wait, been abandoned
/// with a warning) when this returns.
pub fn run(cfg: &VmConfig, opened: Opened) -> Result<VmExit, VmError> {
    Machine::boot(cfg, opened)?.run()
}

/// Restores the snapshot in `dir` (`memory` + `state.json`) and runs it
/// behind `opened`.
pub fn run_restore(dir: &Path, opened: Opened) -> Result<VmExit, VmError> {
    let state_path = dir.join("state.json");
    let bytes = std::fs::read(&state_path).map_err(|source| VmError::StateFile {
        path: state_path,
        source,
    })?;
    let saved = MachineState::from_json(&bytes)?;
    let layout = MemoryLayout::new(saved.hardware.memory_mib * MIB);
    let ram = GuestRam::from_file(&layout, &dir.join("memory"))?;
    let mut opened = opened;
    let tops = std::mem::take(&mut opened.tops);
    check_tops(&saved.hardware, &tops)?;
    opened.sides.disks = saved
        .hardware
        .writable
        .iter()
        .zip(tops)
        .enumerate()
        .map(|(i, (w, top))| {
            let path = dir.join(api::snapshot_disk_file(i));
            let file =
                File::open(&path).map_err(|source| VmError::WritableSaved { index: i, source })?;
            writable_disk(i, &w.base, top, Some((file, &w.saved)))
        })
        .collect::<Result<_, _>>()?;
    Machine::restore(
        Arc::new(ram),
        &saved,
        opened,
        &Default::default(),
        Instant::now(),
    )?
    .run()
}
