//! vCPU threads: running, parking at a safe point, and stopping.
//!
//! Pausing (DESIGN.md "Fork: the core", step 1) has two phases. First the
//! main thread raises `pause` and kicks every thread with a signal until
//! each has parked: a thread parks by calling `KVM_RUN` once with
//! `immediate_exit` set, which completes a pending I/O or MMIO exit without
//! entering the guest, then says so and waits on a condition variable,
//! holding no lock. Only when *every* vCPU is parked does the main thread
//! ask them to capture their state: a vCPU that captured itself while a
//! sibling still ran could miss an IPI or PV kick the sibling sent after
//! the capture, which the sibling's own state says was sent (a silent hang
//! in the child). Only then may the main thread `fork()`: a lock held by
//! another thread would stay locked forever in the child.

use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvm_bindings::kvm_cpuid_entry2;
use kvm_ioctls::{VcpuExit, VcpuFd};
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::signal::{Killable, SIGRTMIN};

use crate::counters::{Counters, COUNTERS};
use crate::pio::{PortBus, PortEvent, ResetCause};
use crate::state::{self, VcpuState};
use crate::virtio::MmioBus;

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
    #[error("cannot confine the vCPU thread")]
    Lockdown(#[source] crate::lockdown::LockdownError),
}

/// Why the vCPUs could not be parked.
#[derive(Debug, thiserror::Error)]
pub enum PauseError {
    #[error("vCPU {0} did not park within {PAUSE_TIMEOUT:?}")]
    Timeout(u8),
    #[error("the VM is ending")]
    Ending,
    #[error("vCPU {0}: cannot capture its state: {1}")]
    Capture(u8, String),
}

/// What a vCPU thread reports when it stops.
#[derive(Debug)]
pub enum VcpuOutcome {
    Guest(PortEvent),
    Failed(VcpuError),
    /// The VMM asked it to stop (another vCPU or the main loop ended the VM).
    Stopped,
}

/// The signal that kicks a vCPU thread out of `KVM_RUN`.
pub fn kick_signal() -> i32 {
    SIGRTMIN()
}

pub extern "C" fn on_kick(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // Nothing to do: delivery alone makes KVM_RUN return EINTR.
}

/// Asks of a vCPU thread, done before its next `KVM_RUN`: inject an NMI
/// ([`Vcpus::nmi`]); tell the guest it was stopped ([`Vcpus::resume`]).
const ASK_NMI: u8 = 1;
const ASK_CLOCK_STOPPED: u8 = 2;

/// How long stopping the vCPU threads may take before they are left behind.
const VCPU_STOP_TIMEOUT: Duration = Duration::from_secs(2);
/// How long parking every vCPU may take.
pub const PAUSE_TIMEOUT: Duration = Duration::from_secs(2);

/// The first vCPU to stop wins; the main loop is woken through `evt`.
pub struct ExitSignal {
    outcome: Mutex<Option<(u8, VcpuOutcome)>>,
    /// What the first vCPU to stop on a triple fault saw (registers,
    /// events), for the VMM's exit report.
    detail: Mutex<Option<String>>,
    pub evt: EventFd,
}

impl ExitSignal {
    pub fn new(evt: EventFd) -> Self {
        Self {
            outcome: Mutex::new(None),
            detail: Mutex::new(None),
            evt,
        }
    }

    fn note(&self, detail: String) {
        relock(&self.detail).get_or_insert(detail);
    }

    /// What [`ExitSignal::note`] kept, if anything.
    pub fn detail(&self) -> Option<String> {
        relock(&self.detail).clone()
    }

    fn report(&self, id: u8, outcome: VcpuOutcome) {
        tracing::debug!(vcpu = id, ?outcome, "vCPU stopped");
        let mut slot = relock(&self.outcome);
        if slot.is_none() && !matches!(outcome, VcpuOutcome::Stopped) {
            *slot = Some((id, outcome));
        }
        drop(slot);
        if let Err(e) = self.evt.write(1) {
            tracing::error!("cannot wake the main loop: {e}");
        }
    }

    pub fn take(&self) -> Option<(u8, VcpuOutcome)> {
        relock(&self.outcome).take()
    }
}

fn relock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

struct Park {
    paused: bool,
    /// Bumped by every pause, so a thread still waiting from an earlier
    /// pause parks and captures again for this one.
    epoch: u64,
    /// Which vCPUs have parked in this epoch (phase one).
    parked: Vec<bool>,
    /// Set once every vCPU has parked: each then captures itself (phase two).
    capture: bool,
    states: Vec<Option<Result<VcpuState, String>>>,
}

struct Shared {
    pause: AtomicBool,
    stop: AtomicBool,
    /// Per vCPU: what its thread does before its next `KVM_RUN` ([`ASK_NMI`],
    /// [`ASK_CLOCK_STOPPED`]).
    asks: Vec<AtomicU8>,
    park: Mutex<Park>,
    cond: Condvar,
}

/// What one vCPU thread needs.
pub struct VcpuContext {
    pub vcpu: VcpuFd,
    pub id: u8,
    pub cpuid: Vec<kvm_cpuid_entry2>,
    pub msr_indices: Arc<Vec<u32>>,
    pub pio: Arc<PortBus>,
    pub mmio: Arc<MmioBus>,
    pub exit: Arc<ExitSignal>,
}

/// Proof that every vCPU of a VM is parked: no vCPU runs guest code or
/// touches guest memory while it lives. Only [`Vcpus::pause`] makes one,
/// and it borrows those `Vcpus`, so they cannot be resumed or stopped
/// (both take `&mut self`) before it is gone. The guest-memory functions
/// that read or replace RAM outside KVM ([`crate::memory::GuestRam`])
/// require it.
#[derive(Debug)]
pub struct Paused<'v> {
    _vcpus: PhantomData<&'v Vcpus>,
}

/// The running vCPU threads of a VM.
pub struct Vcpus {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl Vcpus {
    /// Starts one thread per context, running (or parked, with `paused`).
    pub fn start(contexts: Vec<VcpuContext>) -> Result<Self, (u8, std::io::Error)> {
        let n = contexts.len();
        let shared = Arc::new(Shared {
            pause: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            asks: (0..n).map(|_| AtomicU8::new(0)).collect(),
            park: Mutex::new(Park {
                paused: false,
                epoch: 0,
                parked: vec![false; n],
                capture: false,
                states: (0..n).map(|_| None).collect(),
            }),
            cond: Condvar::new(),
        });
        let mut vcpus = Vcpus {
            shared,
            threads: Vec::with_capacity(n),
        };
        for ctx in contexts {
            let id = ctx.id;
            let shared = Arc::clone(&vcpus.shared);
            let spawned = std::thread::Builder::new()
                .name(format!("vcpu{id}"))
                .spawn(move || {
                    let exit = Arc::clone(&ctx.exit);
                    let outcome = match crate::lockdown::confine_vcpu_thread(id) {
                        Ok(()) => vcpu_loop(ctx, &shared),
                        Err(e) => VcpuOutcome::Failed(VcpuError::Lockdown(e)),
                    };
                    exit.report(id, outcome);
                });
            match spawned {
                Ok(t) => vcpus.threads.push(t),
                Err(e) => {
                    vcpus.stop();
                    return Err((id, e));
                }
            }
        }
        Ok(vcpus)
    }

    /// Parks every vCPU, then has each capture its state while all are
    /// parked, and returns the states (in id order) and the proof that they
    /// stay parked while it lives. A VM already paused returns the states
    /// captured when it was paused, at once.
    pub fn pause(&self) -> Result<(Vec<VcpuState>, Paused<'_>), PauseError> {
        let sh = &self.shared;
        {
            let mut p = relock(&sh.park);
            if !p.paused {
                p.paused = true;
                p.epoch += 1;
                p.capture = false;
                p.parked.iter_mut().for_each(|b| *b = false);
                p.states.iter_mut().for_each(|s| *s = None);
            }
        }
        sh.pause.store(true, Ordering::SeqCst);
        let deadline = Instant::now() + PAUSE_TIMEOUT;
        let mut p = relock(&sh.park);
        // Phase one: every vCPU out of KVM_RUN and parked.
        while !p.capture {
            match p.parked.iter().position(|&b| !b) {
                None => {
                    p.capture = true;
                    sh.cond.notify_all();
                }
                Some(missing) => {
                    if self.threads.iter().any(JoinHandle::is_finished) {
                        return Err(PauseError::Ending);
                    }
                    if Instant::now() > deadline {
                        return Err(PauseError::Timeout(missing as u8));
                    }
                    for (t, &parked) in self.threads.iter().zip(p.parked.iter()) {
                        if !parked {
                            kick(t);
                        }
                    }
                    p = wait(&sh.cond, p, Duration::from_millis(1));
                }
            }
        }
        // Phase two: each parked vCPU captures itself; none runs meanwhile.
        while let Some(missing) = p.states.iter().position(Option::is_none) {
            if self.threads.iter().any(JoinHandle::is_finished) {
                return Err(PauseError::Ending);
            }
            if Instant::now() > deadline {
                return Err(PauseError::Timeout(missing as u8));
            }
            p = wait(&sh.cond, p, Duration::from_millis(1));
        }
        let mut out = Vec::with_capacity(p.states.len());
        for (id, s) in p.states.iter().enumerate() {
            match s {
                Some(Ok(state)) => out.push(state.clone()),
                Some(Err(e)) => return Err(PauseError::Capture(id as u8, e.clone())),
                None => return Err(PauseError::Timeout(id as u8)),
            }
        }
        Ok((
            out,
            Paused {
                _vcpus: PhantomData,
            },
        ))
    }

    /// Has every vCPU inject an NMI into its guest (`KVM_NMI`, which only
    /// the thread that runs a vCPU may issue) and returns once each has, or
    /// after [`PAUSE_TIMEOUT`] with the ids of those that have not (a
    /// parked vCPU injects when it runs again).
    pub fn nmi(&self) -> Vec<u8> {
        let sh = &self.shared;
        sh.asks.iter().for_each(|a| {
            a.fetch_or(ASK_NMI, Ordering::SeqCst);
        });
        let deadline = Instant::now() + PAUSE_TIMEOUT;
        loop {
            let waiting: Vec<u8> = (0..sh.asks.len())
                .filter(|&i| sh.asks[i].load(Ordering::SeqCst) & ASK_NMI != 0)
                .map(|i| i as u8)
                .collect();
            if waiting.is_empty() || Instant::now() > deadline {
                return waiting;
            }
            // A kick that lands just before `KVM_RUN` is lost: repeat.
            for &i in &waiting {
                if let Some(t) = self.threads.get(usize::from(i)) {
                    kick(t);
                }
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Lets every parked vCPU run again (no [`Paused`] may be left); each
    /// first tells its guest that it was stopped ([`ASK_CLOCK_STOPPED`]).
    pub fn resume(&mut self) {
        self.shared.asks.iter().for_each(|a| {
            a.fetch_or(ASK_CLOCK_STOPPED, Ordering::SeqCst);
        });
        let mut p = relock(&self.shared.park);
        p.paused = false;
        self.shared.pause.store(false, Ordering::SeqCst);
        drop(p);
        self.shared.cond.notify_all();
    }

    /// Stops every vCPU thread: sets `stop`, wakes parked ones, then signals
    /// each until it has left `KVM_RUN` and ended (a signal that lands just
    /// before the thread enters `KVM_RUN` is lost, hence the repetition).
    pub fn stop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        {
            let _p = relock(&self.shared.park);
            self.shared.cond.notify_all();
        }
        let deadline = Instant::now() + VCPU_STOP_TIMEOUT;
        let mut running = std::mem::take(&mut self.threads);
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
                kick(t);
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// Signals a vCPU thread out of `KVM_RUN` ([`kick_signal`]).
fn kick(t: &JoinHandle<()>) {
    if let Err(e) = t.kill(kick_signal()) {
        tracing::warn!("cannot kick a vCPU thread: {e}");
    }
}

fn wait<'a>(cond: &Condvar, p: MutexGuard<'a, Park>, timeout: Duration) -> MutexGuard<'a, Park> {
    match cond.wait_timeout(p, timeout) {
        Ok((g, _)) => g,
        Err(poison) => poison.into_inner().0,
    }
}

/// Parks the calling vCPU thread until resumed (or stopped): completes any
/// pending exit, says it is parked, captures its state once every vCPU is
/// parked, then waits.
fn park(ctx: &mut VcpuContext, shared: &Shared) {
    // Complete any pending I/O exit without entering the guest.
    ctx.vcpu.set_kvm_immediate_exit(1);
    match ctx.vcpu.run() {
        Err(e) if e.errno() == libc::EINTR => {}
        other => tracing::debug!(vcpu = ctx.id, ?other, "completing run did not return EINTR"),
    }
    ctx.vcpu.set_kvm_immediate_exit(0);
    let id = usize::from(ctx.id);
    let mut p = relock(&shared.park);
    if !p.paused {
        return;
    }
    let epoch = p.epoch;
    let current = |p: &Park| p.paused && p.epoch == epoch && !shared.stop.load(Ordering::SeqCst);
    p.parked[id] = true;
    shared.cond.notify_all();
    while current(&p) && !p.capture {
        p = wait(&shared.cond, p, Duration::from_millis(100));
    }
    if !current(&p) {
        return;
    }
    // Every vCPU is parked: nothing can change this one's LAPIC or events
    // behind the capture (devices run only on the main thread, which waits).
    drop(p);
    let captured = state::save_vcpu(&ctx.vcpu, ctx.id, &ctx.cpuid, &ctx.msr_indices)
        .map_err(|e| format!("{:#}", anyhow::Error::new(e)));
    let mut p = relock(&shared.park);
    if !current(&p) {
        return;
    }
    p.states[id] = Some(captured);
    shared.cond.notify_all();
    while current(&p) {
        p = match shared.cond.wait(p) {
            Ok(g) => g,
            Err(poison) => poison.into_inner(),
        };
    }
}

fn vcpu_loop(mut ctx: VcpuContext, shared: &Shared) -> VcpuOutcome {
    loop {
        if shared.stop.load(Ordering::SeqCst) {
            return VcpuOutcome::Stopped;
        }
        if shared.pause.load(Ordering::SeqCst) {
            park(&mut ctx, shared);
            continue;
        }
        let asks = shared.asks[usize::from(ctx.id)].swap(0, Ordering::SeqCst);
        if asks & ASK_CLOCK_STOPPED != 0 {
            state::tell_guest_it_was_stopped(&ctx.vcpu, ctx.id);
        }
        if asks & ASK_NMI != 0 {
            if let Err(e) = ctx.vcpu.nmi() {
                tracing::warn!(vcpu = ctx.id, "cannot inject an NMI: {e}");
            }
        }
        let (pio, mmio) = (&ctx.pio, &ctx.mmio);
        let run = ctx.vcpu.run();
        Counters::bump(match &run {
            Ok(VcpuExit::IoIn(..) | VcpuExit::IoOut(..)) => &COUNTERS.exits_io,
            Ok(VcpuExit::MmioRead(..) | VcpuExit::MmioWrite(..)) => &COUNTERS.exits_mmio,
            _ => &COUNTERS.exits_other,
        });
        match run {
            Ok(VcpuExit::IoIn(port, data)) => pio.read(port, data),
            Ok(VcpuExit::IoOut(port, data)) => {
                if let Some(event) = pio.write(port, data) {
                    return VcpuOutcome::Guest(event);
                }
            }
            Ok(VcpuExit::MmioRead(addr, data)) => mmio.read(addr, data),
            Ok(VcpuExit::MmioWrite(addr, data)) => mmio.write(addr, data),
            Ok(VcpuExit::Shutdown) => {
                let detail = format!("vCPU {}: {}", ctx.id, where_it_stopped(&ctx.vcpu));
                tracing::warn!("triple fault; {detail}");
                ctx.exit.note(detail);
                return VcpuOutcome::Guest(PortEvent::Reset(ResetCause::TripleFault));
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

/// The registers that say where a vCPU stopped and in what mode, for the
/// log of a triple fault (which the guest cannot report itself). On AMD
/// (SVM) KVM resets the vCPU before it reports the fault, so there the
/// registers show the reset state and only the events say anything.
fn where_it_stopped(vcpu: &kvm_ioctls::VcpuFd) -> String {
    let regs = match vcpu.get_regs() {
        Ok(r) => format!(
            "rip {:#x} rsp {:#x} rflags {:#x} rax {:#x}",
            r.rip, r.rsp, r.rflags, r.rax
        ),
        Err(e) => format!("registers unreadable: {e}"),
    };
    let sregs = match vcpu.get_sregs() {
        Ok(s) => format!(
            "cs {:#x} ss {:#x} cr0 {:#x} cr2 {:#x} cr3 {:#x} cr4 {:#x} efer {:#x} idt {:#x}+{:#x} gdt {:#x}+{:#x} tr {:#x}",
            s.cs.selector, s.ss.selector, s.cr0, s.cr2, s.cr3, s.cr4, s.efer,
            s.idt.base, s.idt.limit, s.gdt.base, s.gdt.limit, s.tr.base
        ),
        Err(e) => format!("system registers unreadable: {e}"),
    };
    let events =
        match vcpu.get_vcpu_events() {
            Ok(e) => format!(
            "exception injected {} nr {} error {:#x}, interrupt injected {} nr {}, nmi pending {}",
            e.exception.injected, e.exception.nr, e.exception.error_code,
            e.interrupt.injected, e.interrupt.nr, e.nmi.pending
        ),
            Err(e) => format!("events unreadable: {e}"),
        };
    format!("{regs}; {sregs}; {events}")
}
