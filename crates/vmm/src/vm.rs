//! Assembling and running one VM: KVM objects in the order that is fast
//! (memory slots before the irqchip), devices, ACPI, boot state, one thread
//! per vCPU, and the main thread's epoll loop, which also serves the
//! control socket (pause, resume, fork, zygote, snapshot).
//!
//! A VM comes to life in one of two ways: [`Machine::boot`] (kernel and
//! initramfs) or [`Machine::restore`] (captured state over a memory
//! mapping). A fork child and `--restore` both take the second path.

use std::collections::HashMap;
use std::fs::OpenOptions;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use kvm_bindings::{kvm_pit_config, KVM_MAX_CPUID_ENTRIES, KVM_PIT_SPEAKER_DUMMY};
use kvm_ioctls::{IoEventAddress, Kvm, VcpuFd, VmFd};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};
use vm_superio::serial::NoEvents;
use vm_superio::Serial;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vmm_sys_util::signal::register_signal_handler;

use crate::acpi::{self, AcpiConfig};
use crate::boot::{self, BootSpec};
use forkbox_vmm_api::{
    self as api, ChildResult, ChildSpec, Request, Response, RunState, Snapshotted, Status, Then,
    ZygoteMemory, MAX_LINE,
};

use crate::control::{Line, LineBuffer};
use crate::cpu;
use crate::fork::{self, Forked};
use crate::host;
use crate::layout::{
    MemoryLayout, VirtioWindow, KVM_IDENTITY_MAP_ADDR, KVM_TSS_ADDR, MIB, SERIAL_GSI,
    VIRTIO_MMIO_QUEUE_NOTIFY,
};
use crate::memory::{Copied, GuestRam};
use crate::pio::{PortBus, PortEvent};
use crate::serial::{Echo, IrqTrigger, SerialOutput, TailBuffer};
use crate::state::{self, Hardware, MachineState, SerialState, StateError, VcpuState, VmState};
use crate::vcpu::{self, ExitSignal, PauseError, VcpuContext, VcpuOutcome, Vcpus};
use crate::virtio::{self, DeviceSpec, MmioBus, VirtioSlot};
use crate::{VmConfig, VmExit};

pub use crate::vcpu::VcpuError;

#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error(transparent)]
    Host(#[from] host::HostError),
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
    #[error("cannot write {path}")]
    SnapshotWrite {
        path: PathBuf,
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
    #[error("this VM has a network device: a network policy is required")]
    NetConfigMissing,
    #[error("saved state has {saved} vCPUs, its hardware says {hardware}")]
    VcpuCount { saved: usize, hardware: u8 },
    #[error("guest memory is shared with another owner")]
    RamShared,
}

fn kvm_err(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VmError {
    move |e| VmError::Kvm(what, e)
}

fn eventfd() -> Result<EventFd, VmError> {
    EventFd::new(EFD_NONBLOCK).map_err(|e| VmError::EventLoop("eventfd", e))
}

/// How often the main loop looks at the serial tail for a kernel panic.
const PANIC_POLL_MS: i32 = 1000;
/// Polls a panic line may stay unanswered by a reset before the VMM stops
/// the VM itself (a guest booted without `panic=-1` would hang forever).
const PANIC_GRACE_POLLS: u32 = 5;

/// Decides when a kernel panic without a following reset ends the VM.
/// Driven by poll ticks, not clocks, so it is tested without sleeping.
#[derive(Debug, Default)]
pub struct PanicWatch {
    polls_since_panic: u32,
}

impl PanicWatch {
    /// Records one poll; true once a panic has been seen for longer than
    /// [`PANIC_GRACE_POLLS`] polls.
    pub fn poll(&mut self, panic_seen: bool) -> bool {
        if panic_seen {
            self.polls_since_panic += 1;
        }
        self.polls_since_panic > PANIC_GRACE_POLLS
    }
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
}

/// Why the main loop stopped.
enum LoopEnd {
    Vcpu(u8, VcpuOutcome),
    PanicWithoutReset(String),
    /// This process is a fork child now: rebuild from the plan.
    Child(Box<ChildPlan>),
}

/// What a freshly forked child restores.
struct ChildPlan {
    /// When the parent received the fork request (timing logs only).
    requested: Instant,
    /// Children this VMM process had forked, this one included.
    ordinal: u64,
    state: MachineState,
    spec: ChildSpec,
    ready: OwnedFd,
}

/// What handling one request led to.
enum Outcome {
    Reply(Response),
    Child(Box<ChildPlan>),
}

/// Device work items, indexed by epoll token of the device epoll.
enum DevToken {
    QueueNotify {
        slot: usize,
        queue: u16,
        evt: EventFd,
    },
    DeviceEvents {
        slot: usize,
    },
}

/// Control-epoll tokens below this are fixed; clients and children above.
const TOKEN_EXIT: u64 = 0;
const TOKEN_LISTENER: u64 = 1;
const TOKEN_DEVICES: u64 = 2;
const FIRST_DYNAMIC_TOKEN: u64 = 16;

enum CtlItem {
    Client {
        stream: UnixStream,
        lines: LineBuffer,
    },
    /// A fork child, reaped when its pidfd becomes readable.
    Child { pid: libc::pid_t, _pidfd: OwnedFd },
}

/// One running VM and everything the main thread drives.
pub struct Machine {
    hw: Hardware,
    endpoints: Endpoints,
    vm: VmFd,
    ram: Arc<GuestRam>,
    pio: Arc<PortBus>,
    tail: Arc<Mutex<TailBuffer>>,
    slots: Vec<VirtioSlot>,
    dev_epoll: Epoll,
    dev_tokens: Vec<DevToken>,
    ctl_epoll: Epoll,
    listener: Option<UnixListener>,
    items: HashMap<u64, CtlItem>,
    next_token: u64,
    exit: Arc<ExitSignal>,
    vcpus: Vcpus,
    run_state: RunState,
    /// The VM-wide state (irqchip, PIT, kvmclock) read in the same pause as
    /// the vCPUs' states, kept while the VM stays paused: a zygote forked
    /// minutes after its bake gives every child the clock and the TSC of
    /// one instant, both advanced by the same gap.
    paused_vm: Option<VmState>,
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
    endpoints: &Endpoints,
    saved: Option<&SerialState>,
) -> Result<(Arc<PortBus>, Arc<Mutex<TailBuffer>>), VmError> {
    let tail = Arc::new(Mutex::new(TailBuffer::default()));
    let log = match &endpoints.serial_log {
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
    let irq = eventfd()?;
    vm.register_irqfd(&irq, SERIAL_GSI)
        .map_err(kvm_err("register the serial irqfd"))?;
    let out = SerialOutput::new(log, Arc::clone(&tail), endpoints.echo);
    let serial = match saved {
        Some(s) => Serial::from_state(&s.to_superio(), IrqTrigger(irq), NoEvents, out)
            .map_err(|_| VmError::SerialRestore)?,
        None => Serial::new(IrqTrigger(irq), out),
    };
    Ok((Arc::new(PortBus::new(serial)), tail))
}

fn device_specs(hw: &Hardware, endpoints: &Endpoints) -> Result<Vec<DeviceSpec>, VmError> {
    let mut specs: Vec<DeviceSpec> = hw.disks.iter().cloned().map(DeviceSpec::Block).collect();
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

fn listen(path: &Path) -> Result<UnixListener, VmError> {
    let err = |source| VmError::ControlSocket {
        path: path.to_path_buf(),
        source,
    };
    let l = UnixListener::bind(path).map_err(err)?;
    l.set_nonblocking(true).map_err(err)?;
    Ok(l)
}

/// The parts every new VM shares, whichever way it came to life.
struct Parts {
    hw: Hardware,
    endpoints: Endpoints,
    vm: VmFd,
    ram: Arc<GuestRam>,
    pio: Arc<PortBus>,
    tail: Arc<Mutex<TailBuffer>>,
    slots: Vec<VirtioSlot>,
    vcpus: Vec<(VcpuFd, Vec<kvm_bindings::kvm_cpuid_entry2>)>,
    msr_indices: Arc<Vec<u32>>,
}

impl Machine {
    /// Boots the VM `cfg` describes.
    pub fn boot(cfg: &VmConfig) -> Result<Machine, VmError> {
        let kvm = Kvm::new().map_err(|e| host::kvm_open_error(e.errno()))?;
        let layout = MemoryLayout::new(cfg.memory_mib * MIB);
        let ram = GuestRam::new(&layout)?;
        let vm = create_vm(&kvm, &ram)?;
        let endpoints = Endpoints {
            control: cfg.control.clone(),
            vsock_uds: cfg.vsock_uds.clone(),
            serial_log: cfg.serial_log.clone(),
            echo: cfg.echo,
            net: cfg.net.clone(),
        };
        let hw = Hardware {
            vcpus: cfg.vcpus,
            memory_mib: cfg.memory_mib,
            disks: cfg.disks.clone(),
            vsock: cfg.vsock_uds.is_some(),
            net: cfg.net.is_some(),
        };
        let (pio, tail) = open_serial(&vm, &endpoints, None)?;
        let slots = virtio::create(&device_specs(&hw, &endpoints)?, ram.memory())?;

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
            endpoints,
            vm,
            ram: Arc::new(ram),
            pio,
            tail,
            slots,
            vcpus,
            msr_indices,
        })
    }

    /// Rebuilds a VM from `state` over `ram`: the one code path of a fork
    /// child (`ram` is the inherited mapping, now copy-on-write) and of
    /// `--restore` (`ram` maps the snapshot's memory file).
    pub fn restore(
        ram: Arc<GuestRam>,
        saved: &MachineState,
        endpoints: Endpoints,
    ) -> Result<Machine, VmError> {
        let hw = saved.hardware.clone();
        if saved.vcpus.len() != usize::from(hw.vcpus) {
            return Err(VmError::VcpuCount {
                saved: saved.vcpus.len(),
                hardware: hw.vcpus,
            });
        }
        let t0 = Instant::now();
        let kvm = Kvm::new().map_err(|e| host::kvm_open_error(e.errno()))?;
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
        tracing::debug!(elapsed = ?t0.elapsed(), "restore: KVM state applied");
        // Devices last: a restored device may raise its interrupt at once
        // (vsock RSTs), which must land on the restored irqchip.
        let (pio, tail) = open_serial(&vm, &endpoints, Some(&saved.serial))?;
        let slots = virtio::restore(
            &device_specs(&hw, &endpoints)?,
            ram.memory(),
            &saved.devices,
        )?;
        let msr_indices = Arc::new(state::msr_indices(&kvm)?);
        tracing::debug!(elapsed = ?t0.elapsed(), "restore: devices");
        Machine::start(Parts {
            hw,
            endpoints,
            vm,
            ram,
            pio,
            tail,
            slots,
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
        let listener = match &p.endpoints.control {
            Some(path) => {
                let l = listen(path)?;
                add(l.as_raw_fd(), TOKEN_LISTENER)?;
                Some(l)
            }
            None => None,
        };
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
        let vcpus = Vcpus::start(contexts).map_err(|(id, e)| VmError::Thread(id, e))?;
        Ok(Machine {
            hw: p.hw,
            endpoints: p.endpoints,
            vm: p.vm,
            ram: p.ram,
            pio: p.pio,
            tail: p.tail,
            slots: p.slots,
            dev_epoll,
            dev_tokens,
            ctl_epoll,
            listener,
            items: HashMap::new(),
            next_token: FIRST_DYNAMIC_TOKEN,
            exit,
            vcpus,
            run_state: RunState::Running,
            paused_vm: None,
        })
    }

    /// Runs the VM to its end, becoming a fork child as often as a fork
    /// request makes this process one.
    pub fn run(self) -> Result<VmExit, VmError> {
        let mut m = self;
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
        exit
    }

    fn note_in_serial_log(&self, line: &str) {
        let Some(path) = &self.endpoints.serial_log else {
            return;
        };
        let written = OpenOptions::new()
            .append(true)
            .open(path)
            .and_then(|mut f| f.write_all(format!("\n{line}\n").as_bytes()));
        if let Err(e) = written {
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

    fn event_loop(&mut self) -> Result<LoopEnd, VmError> {
        let mut events = vec![EpollEvent::default(); 64];
        let mut panic_watch = PanicWatch::default();
        loop {
            let n = match self.ctl_epoll.wait(PANIC_POLL_MS, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(VmError::EventLoop("epoll_wait", e)),
            };
            if n == 0 {
                if self.run_state == RunState::Running {
                    let line = self.tail.lock().ok().and_then(|t| t.panic_line());
                    if panic_watch.poll(line.is_some()) {
                        if let Some(line) = line {
                            return Ok(LoopEnd::PanicWithoutReset(line));
                        }
                    }
                }
                continue;
            }
            for ev in &events[..n] {
                match ev.data() {
                    TOKEN_EXIT => {
                        let _ = self.exit.evt.read();
                        if let Some((id, outcome)) = self.exit.take() {
                            return Ok(LoopEnd::Vcpu(id, outcome));
                        }
                    }
                    TOKEN_LISTENER => self.accept_clients(),
                    TOKEN_DEVICES => self.device_events()?,
                    token => {
                        if let Some(plan) = self.item_event(token) {
                            return Ok(LoopEnd::Child(plan));
                        }
                    }
                }
            }
        }
    }

    fn device_events(&mut self) -> Result<(), VmError> {
        if self.run_state != RunState::Running {
            return Ok(());
        }
        let mut events = vec![EpollEvent::default(); self.dev_tokens.len().max(1)];
        let n = match self.dev_epoll.wait(0, &mut events) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => 0,
            Err(e) => return Err(VmError::EventLoop("epoll_wait", e)),
        };
        for ev in &events[..n] {
            match self.dev_tokens.get(ev.data() as usize) {
                Some(DevToken::QueueNotify { slot, queue, evt }) => {
                    let _ = evt.read();
                    virtio::lock(&self.slots[*slot].device).queue_notify(*queue);
                }
                Some(DevToken::DeviceEvents { slot }) => {
                    virtio::lock(&self.slots[*slot].device).handle_events();
                }
                None => {}
            }
        }
        Ok(())
    }

    /// Device events are watched only while the VM runs (a paused VM's
    /// devices do nothing; level-triggered fds would spin the loop).
    fn watch_devices(&self, on: bool) {
        let op = if on {
            ControlOperation::Add
        } else {
            ControlOperation::Delete
        };
        let ev = EpollEvent::new(EventSet::IN, TOKEN_DEVICES);
        if let Err(e) = self.ctl_epoll.ctl(op, self.dev_epoll.as_raw_fd(), ev) {
            tracing::warn!("cannot change the device watch: {e}");
        }
    }

    fn add_item(&mut self, fd: i32, item: CtlItem) {
        let token = self.next_token;
        self.next_token += 1;
        let ev = EpollEvent::new(EventSet::IN | EventSet::READ_HANG_UP, token);
        match self.ctl_epoll.ctl(ControlOperation::Add, fd, ev) {
            Ok(()) => {
                self.items.insert(token, item);
            }
            Err(e) => tracing::warn!("cannot watch a control item: {e}"),
        }
    }

    fn accept_clients(&mut self) {
        loop {
            let Some(l) = &self.listener else { return };
            match l.accept() {
                Ok((stream, _)) => {
                    if let Err(e) = stream.set_nonblocking(true) {
                        tracing::warn!("control client: {e}");
                        continue;
                    }
                    let fd = stream.as_raw_fd();
                    self.add_item(
                        fd,
                        CtlItem::Client {
                            stream,
                            lines: LineBuffer::default(),
                        },
                    );
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    tracing::warn!("control socket accept: {e}");
                    return;
                }
            }
        }
    }

    /// A client or child fd is ready. Returns a plan if this process has
    /// just become a fork child.
    fn item_event(&mut self, token: u64) -> Option<Box<ChildPlan>> {
        let mut item = self.items.remove(&token)?;
        match &mut item {
            CtlItem::Child { pid, .. } => {
                fork::reap(*pid);
                None // dropping the pidfd unwatches it
            }
            CtlItem::Client { stream, lines } => {
                let mut buf = [0u8; 4096];
                let mut open = true;
                let mut got = Vec::new();
                // Bounded per wake-up; the level-triggered epoll calls again.
                let mut budget = 4 * MAX_LINE;
                while budget > 0 {
                    match stream.read(&mut buf) {
                        Ok(0) => {
                            open = false;
                            break;
                        }
                        Ok(n) => {
                            budget = budget.saturating_sub(n);
                            got.extend(lines.push(&buf[..n]));
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(_) => {
                            open = false;
                            break;
                        }
                    }
                    if got.contains(&Line::TooLong) {
                        break;
                    }
                }
                for line in got {
                    let response = match line {
                        Line::TooLong => {
                            open = false;
                            Response::error(format!("request longer than {MAX_LINE} bytes"))
                        }
                        Line::Complete(line) => match self.handle_line(&line) {
                            Outcome::Reply(r) => r,
                            // Dropping `item` here only closes this
                            // process's descriptor of the parent's client.
                            Outcome::Child(plan) => return Some(plan),
                        },
                    };
                    if stream.write_all(&response.to_line()).is_err() {
                        open = false;
                        break;
                    }
                    if !open {
                        break;
                    }
                }
                if open {
                    self.items.insert(token, item);
                }
                None
            }
        }
    }

    fn handle_line(&mut self, line: &[u8]) -> Outcome {
        let request = match Request::from_line(line) {
            Ok(r) => r,
            Err(e) => return Outcome::Reply(Response::error(e)),
        };
        tracing::debug!(?request, "control request");
        let started = Instant::now();
        let outcome = match request {
            Request::Status => Outcome::Reply(Response::Status(Status {
                state: self.run_state,
                pid: std::process::id(),
                vcpus: self.hw.vcpus,
                memory_mib: self.hw.memory_mib,
            })),
            Request::Pause => Outcome::Reply(reply(self.pause().map(|_| ()))),
            Request::Resume => {
                self.resume();
                Outcome::Reply(Response::Done)
            }
            Request::Zygote => Outcome::Reply(match self.zygote() {
                Ok(copied) => Response::Zygote(ZygoteMemory {
                    bytes: copied.bytes,
                    huge_bytes: copied.huge_bytes,
                }),
                Err(e) => Response::error(chain(e)),
            }),
            Request::Snapshot { dir, then } => Outcome::Reply(match self.snapshot(&dir, then) {
                Ok(n) => Response::Snapshotted(Snapshotted { bytes_written: n }),
                Err(e) => Response::error(chain(e)),
            }),
            Request::Fork { children, then } => match self.fork(&children, then) {
                Ok(o) => o,
                Err(e) => Outcome::Reply(Response::error(chain(e))),
            },
            Request::Vcpus => Outcome::Reply(match self.report_vcpus() {
                Ok(vcpus) => Response::Vcpus(api::Vcpus {
                    state: self.run_state,
                    vcpus,
                }),
                Err(e) => Response::error(chain(e)),
            }),
        };
        tracing::debug!(elapsed = ?started.elapsed(), "control request done");
        outcome
    }

    /// Parks the vCPUs, stops device work, and captures the vCPUs and the
    /// VM-wide state while all are parked (a VM already paused returns what
    /// its pause captured).
    fn pause(&mut self) -> Result<(Vec<VcpuState>, VmState), VmError> {
        let states = self.vcpus.pause()?;
        if self.run_state == RunState::Running {
            self.watch_devices(false);
            self.run_state = RunState::Paused;
        }
        let vm = match &self.paused_vm {
            Some(vm) => vm.clone(),
            None => {
                let vm = state::save_vm(&self.vm)?;
                self.paused_vm = Some(vm.clone());
                vm
            }
        };
        Ok((states, vm))
    }

    /// Where every vCPU is; a running VM is paused for the read and resumed.
    fn report_vcpus(&mut self) -> Result<Vec<api::VcpuReport>, VmError> {
        let was_running = self.run_state == RunState::Running;
        let (vcpus, _) = self.pause()?;
        if was_running {
            self.resume();
        }
        Ok(vcpus.iter().map(state::vcpu_report).collect())
    }

    fn resume(&mut self) {
        if self.run_state != RunState::Running {
            self.watch_devices(true);
            self.run_state = RunState::Running;
        }
        self.paused_vm = None;
        self.vcpus.resume();
    }

    /// The whole VM as plain data (vCPUs and VM-wide state already
    /// captured in one pause).
    fn capture(&self, (vcpus, vm): (Vec<VcpuState>, VmState)) -> Result<MachineState, VmError> {
        Ok(MachineState {
            format_version: state::FORMAT_VERSION,
            state_format: state::state_format(),
            hardware: self.hw.clone(),
            vm,
            vcpus,
            serial: SerialState::from_superio(&self.pio.serial_state()),
            devices: self
                .slots
                .iter()
                .map(|s| virtio::lock(&s.device).save())
                .collect(),
        })
    }

    fn zygote(&mut self) -> Result<Copied, VmError> {
        self.pause()?;
        let ram = Arc::get_mut(&mut self.ram).ok_or(VmError::RamShared)?;
        // SAFETY: the vCPUs are parked and devices run only on this thread,
        // which is here: nothing touches guest memory during the copy.
        let copied = unsafe { ram.rebase_to_sealed_memfd() }?;
        tracing::info!(
            bytes = copied.bytes,
            huge_bytes = copied.huge_bytes,
            "zygote: guest RAM now a sealed memfd"
        );
        self.run_state = RunState::Zygote;
        Ok(copied)
    }

    fn snapshot(&mut self, dir: &Path, then: Then) -> Result<u64, VmError> {
        let vcpus = self.pause()?;
        let result = self.write_snapshot(dir, vcpus);
        if then == Then::Resume {
            self.resume();
        }
        result
    }

    /// Writes `DIR/memory` (sparse) and `DIR/state.json`, each to a
    /// temporary name first and renamed into place: the directory may be
    /// the one this VM was restored from, whose `memory` file is mapped
    /// here (truncating it in place would fault the guest).
    fn write_snapshot(
        &self,
        dir: &Path,
        paused: (Vec<VcpuState>, VmState),
    ) -> Result<u64, VmError> {
        let saved = self.capture(paused)?;
        let werr = |path: &Path| {
            let path = path.to_path_buf();
            move |source| VmError::SnapshotWrite { path, source }
        };
        std::fs::create_dir_all(dir).map_err(werr(dir))?;
        let mem_path = dir.join("memory");
        let mem_tmp = dir.join(".memory.tmp");
        let file = OpenOptions::new()
            .create(true)
            .truncate(true)
            .write(true)
            .open(&mem_tmp)
            .map_err(werr(&mem_tmp))?;
        let total: u64 = self.ram.memory().iter().map(|r| r.len()).sum();
        file.set_len(total).map_err(werr(&mem_tmp))?;
        // SAFETY: the vCPUs are parked and devices run only on this thread.
        let mut written = unsafe { self.ram.write_sparse_to(&file) }?;
        file.sync_all().map_err(werr(&mem_tmp))?;
        std::fs::rename(&mem_tmp, &mem_path).map_err(werr(&mem_path))?;
        let json = saved.to_json()?;
        let state_path = dir.join("state.json");
        let state_tmp = dir.join(".state.json.tmp");
        std::fs::write(&state_tmp, &json).map_err(werr(&state_tmp))?;
        std::fs::rename(&state_tmp, &state_path).map_err(werr(&state_path))?;
        written += json.len() as u64;
        Ok(written)
    }

    fn fork(&mut self, children: &[ChildSpec], then: Then) -> Result<Outcome, VmError> {
        let started = Instant::now();
        let vcpus = self.pause()?;
        let paused = started.elapsed();
        let saved = self.capture(vcpus)?;
        tracing::debug!(?paused, captured = ?started.elapsed(), "fork: state captured");
        // Fork every child first, then wait for all: they restore in
        // parallel (KVM_CREATE_VM dominates a child's start).
        let mut pending: Vec<Result<(libc::pid_t, OwnedFd), String>> = Vec::new();
        for spec in children {
            if self.hw.vsock && spec.vsock_uds.is_none() {
                pending.push(Err(VmError::VsockPathMissing.to_string()));
                continue;
            }
            let before_fork = Instant::now();
            let ordinal = FORKED.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
            // SAFETY: every vCPU thread is parked in a condition wait
            // holding no lock, device work runs only on this thread, and the
            // child uses none of the parent's objects (it forgets them).
            match unsafe { fork::fork() } {
                Err(e) => pending.push(Err(format!("fork: {e}"))),
                Ok(Forked::Child { ready }) => {
                    // Earlier siblings' pipe ends close with everything else
                    // inherited (`close_inherited`).
                    std::mem::forget(pending);
                    return Ok(Outcome::Child(Box::new(ChildPlan {
                        requested: started,
                        ordinal,
                        state: saved.clone(),
                        spec: spec.clone(),
                        ready,
                    })));
                }
                Ok(Forked::Parent { pid, ready }) => {
                    tracing::debug!(pid, fork_syscall = ?before_fork.elapsed(), "fork: forked");
                    match fork::pidfd_open(pid) {
                        Ok(pidfd) => {
                            let fd = pidfd.as_raw_fd();
                            self.add_item(fd, CtlItem::Child { pid, _pidfd: pidfd });
                        }
                        Err(e) => tracing::warn!(pid, "pidfd_open: {e}; child not reaped"),
                    }
                    pending.push(Ok((pid, ready)));
                }
            }
        }
        let deadline = Instant::now() + fork::CHILD_READY_TIMEOUT;
        let results = pending
            .into_iter()
            .map(|p| match p {
                Err(error) => ChildResult::Failed { error },
                Ok((pid, ready)) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    let r = fork::wait_ready(ready, left.max(std::time::Duration::from_millis(1)));
                    tracing::info!(pid, elapsed = ?started.elapsed(), ok = r.is_ok(), "fork child");
                    match r {
                        Ok(()) => ChildResult::Started { pid: pid as u32 },
                        Err(error) => ChildResult::Failed { error },
                    }
                }
            })
            .collect();
        if then == Then::Resume {
            self.resume();
        }
        Ok(Outcome::Reply(Response::Forked(api::Forked {
            children: results,
        })))
    }
}

fn reply(r: Result<(), VmError>) -> Response {
    match r {
        Ok(()) => Response::Done,
        Err(e) => Response::error(chain(e)),
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

/// In a fork child: forget the parent's objects (their descriptors are the
/// parent's open files), close every inherited descriptor but guest RAM's,
/// and rebuild the VM from the captured state over the inherited mapping.
fn become_child(parent: Machine, plan: Box<ChildPlan>) -> Machine {
    let ram = Arc::clone(&parent.ram);
    let echo = parent.endpoints.echo;
    // Its own log (or none), its own broker if named (the broker sends
    // the child's policy); otherwise the parent's.
    let net = parent.endpoints.net.clone().map(|n| crate::net::NetConfig {
        log: plan.spec.net_log.clone(),
        broker: plan.spec.net_broker.clone().or(n.broker),
        ..n
    });
    // No Drop may run on the parent's objects: KVM fds, eventfds, epolls,
    // sockets and vCPU thread handles all belong to the parent's VM.
    std::mem::forget(parent);
    let mut keep = ram.fds();
    keep.extend([0, 1, 2, plan.ready.as_raw_fd()]);
    fork::close_inherited(&keep);
    tracing::debug!(since_request = ?plan.requested.elapsed(), "fork child: inherited fds closed");
    let endpoints = Endpoints {
        control: Some(plan.spec.control.clone()),
        vsock_uds: plan.spec.vsock_uds.clone(),
        serial_log: plan.spec.serial_log.clone(),
        echo,
        net,
    };
    match Machine::restore(ram, &plan.state, endpoints) {
        Ok(mut m) => {
            tracing::debug!(since_request = ?plan.requested.elapsed(), "fork child: ready");
            if test_hang_child(plan.ordinal) {
                tracing::warn!(
                    ordinal = plan.ordinal,
                    "FORKBOX_VMM_TEST_HANG_CHILD: this fork child's vCPUs stay parked"
                );
                if let Err(e) = m.pause() {
                    tracing::error!("cannot park the test's hanging child: {}", chain(e));
                }
            }
            fork::report_ready(plan.ready);
            m
        }
        Err(e) => {
            let msg = chain(e);
            tracing::error!("fork child: {msg}");
            fork::report_failure(plan.ready, &msg);
            std::process::exit(api::exit_code::VMM_ERROR);
        }
    }
}

/// Children this VMM process has forked (a fork child counts on from its
/// parent's count).
static FORKED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Test hook: `FORKBOX_VMM_TEST_HANG_CHILD=N` (set by the host for this
/// VMM only) makes the N-th fork child of this VMM process come up with its
/// vCPUs parked, a child that never answers its agent's calls: how the
/// host's handling of a hung child is tested. The guest cannot set it.
fn test_hang_child(ordinal: u64) -> bool {
    std::env::var("FORKBOX_VMM_TEST_HANG_CHILD")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        == Some(ordinal)
}

/// Registers a device's irqfd and queue ioeventfds (fresh eventfds), and
/// watches its events.
fn wire_device(
    vm: &VmFd,
    index: usize,
    slot: &VirtioSlot,
    epoll: &Epoll,
    tokens: &mut Vec<DevToken>,
) -> Result<(), VmError> {
    let mut watch = |fd: i32, token: DevToken| -> Result<(), VmError> {
        let ev = EpollEvent::new(EventSet::IN, tokens.len() as u64);
        epoll
            .ctl(ControlOperation::Add, fd, ev)
            .map_err(|e| VmError::EventLoop("epoll_ctl", e))?;
        tokens.push(token);
        Ok(())
    };
    vm.register_irqfd(&slot.irq, slot.window.gsi)
        .map_err(kvm_err("register a virtio irqfd"))?;
    // A restored device whose interrupt was raised but not acknowledged at
    // the capture may have had it still in flight (an irqfd injects
    // asynchronously): raise it again on the fresh irqfd, or the driver can
    // wait forever. A driver that already saw it finds the status it
    // acknowledges, so a repeat is harmless.
    if virtio::lock(&slot.device).interrupt_status() != 0 {
        slot.irq
            .write(1)
            .map_err(|e| VmError::EventLoop("raise a restored interrupt", e))?;
    }
    for queue in 0..slot.queues {
        let evt = eventfd()?;
        let addr = IoEventAddress::Mmio(slot.window.base + VIRTIO_MMIO_QUEUE_NOTIFY);
        vm.register_ioevent(&evt, &addr, u32::from(queue))
            .map_err(kvm_err("register a queue ioeventfd"))?;
        let fd = evt.as_raw_fd();
        watch(
            fd,
            DevToken::QueueNotify {
                slot: index,
                queue,
                evt,
            },
        )?;
    }
    if let Some(fd) = virtio::lock(&slot.device).event_fd() {
        watch(fd, DevToken::DeviceEvents { slot: index })?;
    }
    Ok(())
}

/// Builds the VM described by `cfg`, runs it to its end and says how it ended.
///
/// Every vCPU thread has ended (or, after a bounded wait, been abandoned
/// with a warning) when this returns.
pub fn run(cfg: &VmConfig) -> Result<VmExit, VmError> {
    host::check_host()?;
    Machine::boot(cfg)?.run()
}

/// Restores the snapshot in `dir` (`memory` + `state.json`) and runs it.
pub fn run_restore(dir: &Path, endpoints: Endpoints) -> Result<VmExit, VmError> {
    let state_path = dir.join("state.json");
    let bytes = std::fs::read(&state_path).map_err(|source| VmError::StateFile {
        path: state_path,
        source,
    })?;
    let saved = MachineState::from_json(&bytes)?;
    host::check_host()?;
    let layout = MemoryLayout::new(saved.hardware.memory_mib * MIB);
    let ram = GuestRam::from_file(&layout, &dir.join("memory"))?;
    Machine::restore(Arc::new(ram), &saved, endpoints)?.run()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panic_watch_without_panic_never_fires() {
        let mut w = PanicWatch::default();
        assert!((0..100).all(|_| !w.poll(false)));
    }

    #[test]
    fn panic_watch_fires_after_grace_polls() {
        let mut w = PanicWatch::default();
        for _ in 0..PANIC_GRACE_POLLS {
            assert!(!w.poll(true));
        }
        assert!(w.poll(true));
    }
}
