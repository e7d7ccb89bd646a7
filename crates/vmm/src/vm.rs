//! Assembling and running one VM: KVM objects in the order that is fast
//! (memory slots before the irqchip), devices, ACPI, boot state, one thread
//! per vCPU, and the main thread's epoll loop.

use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvm_bindings::{kvm_pit_config, KVM_MAX_CPUID_ENTRIES, KVM_PIT_SPEAKER_DUMMY};
use kvm_ioctls::{IoEventAddress, Kvm, VcpuExit, VcpuFd, VmFd};
use vm_memory::{Bytes, GuestAddress};
use vm_superio::Serial;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vmm_sys_util::signal::{register_signal_handler, Killable, SIGRTMIN};

use crate::acpi::{self, AcpiConfig};
use crate::boot::{self, BootSpec};
use crate::cpu;
use crate::host;
use crate::layout::{
    MemoryLayout, VirtioWindow, KVM_IDENTITY_MAP_ADDR, KVM_TSS_ADDR, MIB, SERIAL_GSI,
    VIRTIO_MMIO_QUEUE_NOTIFY,
};
use crate::memory::GuestRam;
use crate::pio::{PortBus, PortEvent, ResetCause};
use crate::serial::{IrqTrigger, SerialOutput, TailBuffer};
use crate::virtio::{self, MmioBus, VirtioSlot};
use crate::{VmConfig, VmExit};

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
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
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
}

/// Why a vCPU thread stopped without a guest-requested exit.
#[derive(Debug, thiserror::Error)]
pub enum VcpuError {
    #[error("KVM_RUN failed")]
    Run(#[source] kvm_ioctls::Error),
    #[error("VM entry failed (hardware reason {reason:#x} on cpu {cpu})")]
    FailEntry { reason: u64, cpu: u32 },
    #[error("KVM internal error")]
    Internal,
    #[error("unexpected exit: {0}")]
    Unexpected(String),
}

/// What a vCPU thread reports when it stops.
#[derive(Debug)]
enum VcpuOutcome {
    Guest(PortEvent),
    Failed(VcpuError),
    /// The VMM asked it to stop (another vCPU or the main loop ended the VM).
    Stopped,
}

/// The signal that kicks a vCPU thread out of `KVM_RUN`.
fn kick_signal() -> i32 {
    SIGRTMIN()
}

extern "C" fn on_kick(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // Nothing to do: delivery alone makes KVM_RUN return EINTR.
}

/// How long stopping the vCPU threads may take before they are left behind.
const VCPU_STOP_TIMEOUT: Duration = Duration::from_secs(2);

/// Stops every vCPU thread: sets `stopping`, then signals each thread until
/// it has left `KVM_RUN` and ended (a signal that lands just before the
/// thread enters `KVM_RUN` is lost, hence the repetition).
fn stop_vcpus(threads: Vec<JoinHandle<()>>, stopping: &AtomicBool) {
    stopping.store(true, Ordering::SeqCst);
    let deadline = Instant::now() + VCPU_STOP_TIMEOUT;
    let mut running = threads;
    while !running.is_empty() {
        let (done, rest): (Vec<_>, Vec<_>) = running.into_iter().partition(|t| t.is_finished());
        for t in done {
            let _ = t.join();
        }
        running = rest;
        if running.is_empty() {
            break;
        }
        if Instant::now() > deadline {
            tracing::warn!(
                "{} vCPU thread(s) did not stop; leaving them",
                running.len()
            );
            break;
        }
        for t in &running {
            if let Err(e) = t.kill(kick_signal()) {
                tracing::warn!("cannot kick a vCPU thread: {e}");
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The first vCPU to stop wins; the main loop is woken through `evt`.
struct ExitSignal {
    outcome: Mutex<Option<(u8, VcpuOutcome)>>,
    evt: EventFd,
}

impl ExitSignal {
    fn report(&self, id: u8, outcome: VcpuOutcome) {
        tracing::debug!(vcpu = id, ?outcome, "vCPU stopped");
        let mut slot = match self.outcome.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        if slot.is_none() && !matches!(outcome, VcpuOutcome::Stopped) {
            *slot = Some((id, outcome));
        }
        if let Err(e) = self.evt.write(1) {
            tracing::error!("cannot wake the main loop: {e}");
        }
    }

    fn take(&self) -> Option<(u8, VcpuOutcome)> {
        match self.outcome.lock() {
            Ok(mut g) => g.take(),
            Err(p) => p.into_inner().take(),
        }
    }
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

/// Why the main loop stopped.
enum LoopEnd {
    Vcpu(u8, VcpuOutcome),
    PanicWithoutReset(String),
}

/// Main-loop work items, indexed by epoll token.
enum Token {
    Stop,
    QueueNotify {
        slot: usize,
        queue: u16,
        evt: EventFd,
    },
    DeviceEvents {
        slot: usize,
    },
}

/// Builds the VM described by `cfg`, runs it to its end and says how it ended.
///
/// Every vCPU thread has ended (or, after a bounded wait, been abandoned
/// with a warning) when this returns.
pub fn run(cfg: &VmConfig) -> Result<VmExit, VmError> {
    host::check_host()?;
    let kvm = Kvm::new().map_err(|e| host::kvm_open_error(e.errno()))?;
    let vm = kvm.create_vm().map_err(kvm_err("create a VM"))?;

    let layout = MemoryLayout::new(cfg.memory_mib * MIB);
    let ram = GuestRam::new(&layout)?;
    ram.register(&vm)?; // before KVM_CREATE_IRQCHIP: see GuestRam::register
    vm.set_tss_address(KVM_TSS_ADDR as usize)
        .map_err(kvm_err("set the TSS address"))?;
    vm.set_identity_map_address(KVM_IDENTITY_MAP_ADDR)
        .map_err(kvm_err("set the identity map address"))?;
    vm.create_irq_chip()
        .map_err(kvm_err("create the irqchip"))?;
    let pit = kvm_pit_config {
        flags: KVM_PIT_SPEAKER_DUMMY,
        ..Default::default()
    };
    vm.create_pit2(pit).map_err(kvm_err("create the PIT"))?;

    // COM1.
    let tail = Arc::new(Mutex::new(TailBuffer::default()));
    let log = match &cfg.serial_log {
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
    let serial_irq = eventfd()?;
    vm.register_irqfd(&serial_irq, SERIAL_GSI)
        .map_err(kvm_err("register the serial irqfd"))?;
    let serial = Serial::new(
        IrqTrigger(serial_irq),
        SerialOutput::new(log, Arc::clone(&tail), cfg.echo),
    );
    let pio = Arc::new(PortBus::new(serial));

    // virtio-mmio devices.
    let slots = virtio::create(&cfg.devices(), ram.memory())?;
    let epoll = Epoll::new().map_err(|e| VmError::EventLoop("epoll_create", e))?;
    let exit = Arc::new(ExitSignal {
        outcome: Mutex::new(None),
        evt: eventfd()?,
    });
    let mut tokens = vec![];
    let watch = |fd: i32, token: Token, tokens: &mut Vec<Token>| -> Result<(), VmError> {
        let ev = EpollEvent::new(EventSet::IN, tokens.len() as u64);
        epoll
            .ctl(ControlOperation::Add, fd, ev)
            .map_err(|e| VmError::EventLoop("epoll_ctl", e))?;
        tokens.push(token);
        Ok(())
    };
    watch(exit.evt.as_raw_fd(), Token::Stop, &mut tokens)?;
    for (i, slot) in slots.iter().enumerate() {
        wire_device(&vm, i, slot, &mut |fd, t| watch(fd, t, &mut tokens))?;
    }
    let mmio = Arc::new(MmioBus::new(&slots));

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
    let mut vcpus = Vec::new();
    for id in 0..cfg.vcpus {
        let vcpu = vm
            .create_vcpu(id.into())
            .map_err(kvm_err("create a vCPU"))?;
        let mut cpuid = supported.clone();
        cpu::patch_cpuid(cpuid.as_mut_slice(), id, cfg.vcpus);
        cpu::configure(&vcpu, &cpuid).map_err(|source| VmError::Cpu { id, source })?;
        if id == 0 {
            cpu::set_boot_registers(&vcpu, &entry).map_err(|source| VmError::Cpu { id, source })?;
        }
        vcpus.push(vcpu);
    }
    register_signal_handler(kick_signal(), on_kick).map_err(VmError::KickSignal)?;
    let stopping = Arc::new(AtomicBool::new(false));
    let mut threads = Vec::new();
    for (id, vcpu) in (0u8..).zip(vcpus) {
        let (pio, mmio, exit) = (Arc::clone(&pio), Arc::clone(&mmio), Arc::clone(&exit));
        let stop = Arc::clone(&stopping);
        let spawned = std::thread::Builder::new()
            .name(format!("vcpu{id}"))
            .spawn(move || {
                let outcome = vcpu_loop(vcpu, &pio, &mmio, &stop);
                exit.report(id, outcome);
            });
        match spawned {
            Ok(t) => threads.push(t),
            Err(e) => {
                stop_vcpus(threads, &stopping);
                return Err(VmError::Thread(id, e));
            }
        }
    }

    let end = event_loop(&epoll, &tokens, &slots, &exit, &tail);
    stop_vcpus(threads, &stopping);
    let end = end?;
    // `vm` and `ram` stay alive until here: the slots point into `ram`.
    drop(vm);
    let (id, outcome) = match end {
        LoopEnd::Vcpu(id, outcome) => (id, outcome),
        LoopEnd::PanicWithoutReset(line) => return Ok(VmExit::Panic { line }),
    };
    match outcome {
        VcpuOutcome::Guest(PortEvent::PowerOff) => Ok(VmExit::PowerOff),
        VcpuOutcome::Guest(PortEvent::Reset(cause)) => {
            let panic = tail.lock().ok().and_then(|t| t.panic_line());
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

/// Registers a device's irqfd and queue ioeventfds, and watches its events.
fn wire_device(
    vm: &VmFd,
    index: usize,
    slot: &VirtioSlot,
    watch: &mut dyn FnMut(i32, Token) -> Result<(), VmError>,
) -> Result<(), VmError> {
    vm.register_irqfd(&slot.irq, slot.window.gsi)
        .map_err(kvm_err("register a virtio irqfd"))?;
    for queue in 0..slot.queues {
        let evt = eventfd()?;
        let addr = IoEventAddress::Mmio(slot.window.base + VIRTIO_MMIO_QUEUE_NOTIFY);
        vm.register_ioevent(&evt, &addr, u32::from(queue))
            .map_err(kvm_err("register a queue ioeventfd"))?;
        let fd = evt.as_raw_fd();
        watch(
            fd,
            Token::QueueNotify {
                slot: index,
                queue,
                evt,
            },
        )?;
    }
    if let Some(fd) = virtio::lock(&slot.device).event_fd() {
        watch(fd, Token::DeviceEvents { slot: index })?;
    }
    Ok(())
}

fn event_loop(
    epoll: &Epoll,
    tokens: &[Token],
    slots: &[VirtioSlot],
    exit: &ExitSignal,
    tail: &Mutex<TailBuffer>,
) -> Result<LoopEnd, VmError> {
    let mut events = vec![EpollEvent::default(); tokens.len().max(1)];
    let mut panic_watch = PanicWatch::default();
    loop {
        let n = match epoll.wait(PANIC_POLL_MS, &mut events) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(VmError::EventLoop("epoll_wait", e)),
        };
        if n == 0 {
            let line = tail.lock().ok().and_then(|t| t.panic_line());
            if panic_watch.poll(line.is_some()) {
                if let Some(line) = line {
                    return Ok(LoopEnd::PanicWithoutReset(line));
                }
            }
            continue;
        }
        for ev in &events[..n] {
            match tokens.get(ev.data() as usize) {
                Some(Token::Stop) => {
                    let _ = exit.evt.read();
                    if let Some((id, outcome)) = exit.take() {
                        return Ok(LoopEnd::Vcpu(id, outcome));
                    }
                }
                Some(Token::QueueNotify { slot, queue, evt }) => {
                    let _ = evt.read();
                    virtio::lock(&slots[*slot].device).queue_notify(*queue);
                }
                Some(Token::DeviceEvents { slot }) => {
                    virtio::lock(&slots[*slot].device).handle_events();
                }
                None => {}
            }
        }
    }
}

fn vcpu_loop(
    mut vcpu: VcpuFd,
    pio: &PortBus,
    mmio: &MmioBus,
    stopping: &AtomicBool,
) -> VcpuOutcome {
    loop {
        if stopping.load(Ordering::SeqCst) {
            return VcpuOutcome::Stopped;
        }
        match vcpu.run() {
            Ok(VcpuExit::IoIn(port, data)) => pio.read(port, data),
            Ok(VcpuExit::IoOut(port, data)) => {
                if let Some(event) = pio.write(port, data) {
                    return VcpuOutcome::Guest(event);
                }
            }
            Ok(VcpuExit::MmioRead(addr, data)) => mmio.read(addr, data),
            Ok(VcpuExit::MmioWrite(addr, data)) => mmio.write(addr, data),
            Ok(VcpuExit::Shutdown) => {
                return VcpuOutcome::Guest(PortEvent::Reset(ResetCause::TripleFault))
            }
            Ok(VcpuExit::SystemEvent(kind, _)) => {
                return match kind {
                    kvm_bindings::KVM_SYSTEM_EVENT_SHUTDOWN => {
                        VcpuOutcome::Guest(PortEvent::PowerOff)
                    }
                    kvm_bindings::KVM_SYSTEM_EVENT_RESET => {
                        VcpuOutcome::Guest(PortEvent::Reset(ResetCause::TripleFault))
                    }
                    other => {
                        VcpuOutcome::Failed(VcpuError::Unexpected(format!("system event {other}")))
                    }
                }
            }
            Ok(VcpuExit::Hlt | VcpuExit::IrqWindowOpen | VcpuExit::Intr) => {}
            Ok(VcpuExit::FailEntry(reason, cpu)) => {
                return VcpuOutcome::Failed(VcpuError::FailEntry { reason, cpu })
            }
            Ok(VcpuExit::InternalError) => return VcpuOutcome::Failed(VcpuError::Internal),
            Ok(other) => return VcpuOutcome::Failed(VcpuError::Unexpected(format!("{other:?}"))),
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {}
            Err(e) => return VcpuOutcome::Failed(VcpuError::Run(e)),
        }
    }
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
