//! The captured state of a VM as plain, versioned, serialisable data, and
//! the KVM ioctls that capture and apply it.
//!
//! DESIGN.md: restore and fork are one code path. A fork child and
//! `--restore` both rebuild every kernel object from a [`MachineState`];
//! nothing here has a `Default`, so a forgotten field fails to compile.
//!
//! Restore order (research/kvm-fork-measurements.md): VM, memory slots,
//! TSS/identity map, irqchip, PIT2, vCPUs (CPUID first), irqchip state,
//! PIT state, per-vCPU registers, LAPIC, then MSRs (see [`restore_vcpu`]),
//! then kvmclock, then the guest is told it was stopped
//! ([`tell_guest_it_was_stopped`]). Configuration no
//! GET ioctl returns is replayed from constants the boot path also uses:
//! CPUID (saved per vCPU as configured), the PIT config (speaker dummy), and
//! the default GSI routing and PIT reinjection (never changed by this VMM).
//! irqfds and ioeventfds are registered afresh by the caller.

use std::path::PathBuf;

use forkbox_devices::virtio::persist::TransportState;
use forkbox_vmm_api::VcpuReport;
use kvm_bindings::{
    kvm_clock_data, kvm_cpuid_entry2, kvm_debugregs, kvm_irqchip, kvm_lapic_state, kvm_mp_state,
    kvm_msr_entry, kvm_pit_state2, kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave,
    CpuId, Msrs, KVM_CLOCK_REALTIME, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER,
    KVM_IRQCHIP_PIC_SLAVE, KVM_VCPUEVENT_VALID_NMI_PENDING, KVM_VCPUEVENT_VALID_SIPI_VECTOR,
};
use kvm_ioctls::{VcpuFd, VmFd};
use serde::{Deserialize, Serialize};

/// Bumped whenever a state type changes shape or meaning.
pub const FORMAT_VERSION: u32 = 1;

/// This build's state-format identifier, written into every state file.
pub fn state_format() -> String {
    format!(
        "forkbox-vmm-{}/state-v{FORMAT_VERSION}",
        env!("CARGO_PKG_VERSION")
    )
}

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("KVM: cannot {0}")]
    Kvm(&'static str, #[source] kvm_ioctls::Error),
    #[error("vCPU {0}: KVM accepted none of MSR {1:#x} onwards")]
    Msrs(u8, u32),
    #[error("saved xsave region has {0} words, KVM wants 1024")]
    XsaveSize(usize),
    #[error("cannot build an ioctl list of {0} entries")]
    FamList(usize),
    #[error("state file has format {found:?} (version {found_version}); this forkbox-vmm reads {expected:?} (version {expected_version})")]
    Version {
        found: String,
        found_version: u32,
        expected: String,
        expected_version: u32,
    },
    #[error("state file is not valid JSON for this format")]
    Parse(#[source] serde_json::Error),
    #[error("cannot encode the state")]
    Encode(#[source] serde_json::Error),
}

/// What the VM is made of, beside its state (the command line's hardware).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hardware {
    pub vcpus: u8,
    pub memory_mib: u64,
    /// An image's layers, bottom first, behind one partitioned disk that
    /// comes before `disks` (state files without the field have none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub layers: Vec<PathBuf>,
    /// Disks in window order; re-opened from these paths on restore.
    pub disks: Vec<PathBuf>,
    /// Writable disks, after the read-only ones (state files without the
    /// field have none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub writable: Vec<WritableDisk>,
    /// Whether a vsock device follows the disks.
    pub vsock: bool,
    /// Whether a virtio-net device follows (state files without the field
    /// have none).
    #[serde(default)]
    pub net: bool,
}

/// A writable disk ([`forkbox_devices::virtio::overlay`]): its golden base,
/// re-opened by path on restore, and in a snapshot's state the runs of
/// blocks its snapshot file ([`forkbox_vmm_api::snapshot_disk_file`])
/// holds above the base.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WritableDisk {
    pub base: PathBuf,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub saved: Vec<(u64, u64)>,
}

/// One vCPU, captured while parked outside `KVM_RUN` after an
/// `immediate_exit` run completed any pending I/O.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct VcpuState {
    pub id: u8,
    /// The table given to `KVM_SET_CPUID2` (no GET ioctl returns it as set).
    pub cpuid: Vec<kvm_cpuid_entry2>,
    pub regs: kvm_regs,
    pub sregs: kvm_sregs,
    /// The 4 KiB `kvm_xsave` region (`KVM_GET_XSAVE`; no AMX state here).
    pub xsave: Vec<u32>,
    pub xcrs: kvm_xcrs,
    /// Every MSR of [`msr_indices`] that `KVM_GET_MSRS` returns, the TSC
    /// (0x10) among them: restoring it sets the TSC offset.
    pub msrs: Vec<kvm_msr_entry>,
    pub lapic: kvm_lapic_state,
    pub mp_state: kvm_mp_state,
    pub events: kvm_vcpu_events,
    pub debugregs: kvm_debugregs,
}

const APIC_ISR: usize = 0x100;
const APIC_IRR: usize = 0x200;
const APIC_LVTT: usize = 0x320;

fn lapic_reg(lapic: &kvm_lapic_state, offset: usize) -> u32 {
    let b = |k: usize| lapic.regs[offset + k] as u8;
    u32::from_le_bytes([b(0), b(1), b(2), b(3)])
}

/// The vectors set in the 256-bit LAPIC register starting at `base` (eight
/// 32-bit words, 16 bytes apart).
fn lapic_vectors(lapic: &kvm_lapic_state, base: usize) -> Vec<u8> {
    (0..8usize)
        .flat_map(|word| {
            let bits = lapic_reg(lapic, base + word * 16);
            (0..32u32)
                .filter(move |bit| bits & (1 << bit) != 0)
                .map(move |bit| (word as u32 * 32 + bit) as u8)
        })
        .collect()
}

fn mp_state_name(state: u32) -> String {
    match state {
        kvm_bindings::KVM_MP_STATE_RUNNABLE => "runnable".into(),
        kvm_bindings::KVM_MP_STATE_UNINITIALIZED => "uninitialized".into(),
        kvm_bindings::KVM_MP_STATE_INIT_RECEIVED => "init_received".into(),
        kvm_bindings::KVM_MP_STATE_HALTED => "halted".into(),
        kvm_bindings::KVM_MP_STATE_SIPI_RECEIVED => "sipi_received".into(),
        other => format!("state {other}"),
    }
}

/// Where the vCPU captured in `s` was, for a failure report.
pub fn vcpu_report(s: &VcpuState) -> VcpuReport {
    let e = &s.events;
    let exception = (e.exception.injected != 0 || e.exception.pending != 0).then(|| {
        format!(
            "nr {} error {:#x} ({})",
            e.exception.nr,
            e.exception.error_code,
            if e.exception.injected != 0 {
                "injected"
            } else {
                "pending"
            }
        )
    });
    VcpuReport {
        id: s.id,
        rip: s.regs.rip,
        rsp: s.regs.rsp,
        rflags: s.regs.rflags,
        cs: s.sregs.cs.selector,
        cr0: s.sregs.cr0,
        cr2: s.sregs.cr2,
        cr3: s.sregs.cr3,
        cr4: s.sregs.cr4,
        efer: s.sregs.efer,
        mp_state: mp_state_name(s.mp_state.mp_state),
        exception,
        interrupt: (e.interrupt.injected != 0).then_some(e.interrupt.nr),
        nmi_pending: e.nmi.pending != 0,
        lapic_irr: lapic_vectors(&s.lapic, APIC_IRR),
        lapic_isr: lapic_vectors(&s.lapic, APIC_ISR),
        lapic_lvtt: lapic_reg(&s.lapic, APIC_LVTT),
    }
}

/// VM-wide KVM state.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct VmState {
    pub pic_master: kvm_irqchip,
    pub pic_slave: kvm_irqchip,
    pub ioapic: kvm_irqchip,
    pub pit: kvm_pit_state2,
    pub clock: kvm_clock_data,
    /// Host wall-clock time (ns since the epoch) when `clock` was read:
    /// the restore side's measure of the gap when KVM does not report
    /// `KVM_CLOCK_REALTIME` (it needs a TSC host clocksource).
    pub captured_realtime_ns: u64,
}

/// COM1 (mirrors `vm_superio::serial::SerialState`, which has no serde).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SerialState {
    pub baud_divisor_low: u8,
    pub baud_divisor_high: u8,
    pub interrupt_enable: u8,
    pub interrupt_identification: u8,
    pub line_control: u8,
    pub line_status: u8,
    pub modem_control: u8,
    pub modem_status: u8,
    pub scratch: u8,
    pub in_buffer: Vec<u8>,
}

impl SerialState {
    pub fn from_superio(s: &vm_superio::serial::SerialState) -> Self {
        Self {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer.clone(),
        }
    }

    pub fn to_superio(&self) -> vm_superio::serial::SerialState {
        vm_superio::serial::SerialState {
            baud_divisor_low: self.baud_divisor_low,
            baud_divisor_high: self.baud_divisor_high,
            interrupt_enable: self.interrupt_enable,
            interrupt_identification: self.interrupt_identification,
            line_control: self.line_control,
            line_status: self.line_status,
            modem_control: self.modem_control,
            modem_status: self.modem_status,
            scratch: self.scratch,
            in_buffer: self.in_buffer.clone(),
        }
    }
}

/// Everything a fork child or `--restore` needs besides guest memory.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct MachineState {
    pub format_version: u32,
    pub state_format: String,
    pub hardware: Hardware,
    pub vm: VmState,
    pub vcpus: Vec<VcpuState>,
    pub serial: SerialState,
    /// One per virtio-mmio window, in window order.
    pub devices: Vec<TransportState>,
}

#[derive(Deserialize)]
struct FormatHeader {
    format_version: u32,
    state_format: String,
}

impl MachineState {
    pub fn to_json(&self) -> Result<Vec<u8>, StateError> {
        serde_json::to_vec(self).map_err(StateError::Encode)
    }

    /// Parses a state file, refusing one written by a build whose state
    /// format differs (checked before the body is interpreted).
    pub fn from_json(bytes: &[u8]) -> Result<Self, StateError> {
        let header: FormatHeader = serde_json::from_slice(bytes).map_err(StateError::Parse)?;
        let expected = state_format();
        if header.format_version != FORMAT_VERSION || header.state_format != expected {
            return Err(StateError::Version {
                found: header.state_format,
                found_version: header.format_version,
                expected,
                expected_version: FORMAT_VERSION,
            });
        }
        serde_json::from_slice(bytes).map_err(StateError::Parse)
    }
}

fn kvm_err(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> StateError {
    move |e| StateError::Kvm(what, e)
}

/// Most MSRs asked for in one ioctl.
const MSR_CHUNK: usize = 128;

/// The MSRs saved per vCPU: KVM's index list plus the ones the boot code
/// sets, sorted and unique.
pub fn msr_indices(kvm: &kvm_ioctls::Kvm) -> Result<Vec<u32>, StateError> {
    let list = kvm
        .get_msr_index_list()
        .map_err(kvm_err("get the MSR index list"))?;
    let mut v: Vec<u32> = list.as_slice().to_vec();
    v.extend(crate::cpu::boot_msrs().iter().map(|e| e.index));
    v.sort_unstable();
    v.dedup();
    Ok(v)
}

fn msr_list(entries: &[kvm_msr_entry]) -> Result<Msrs, StateError> {
    Msrs::from_entries(entries).map_err(|_| StateError::FamList(entries.len()))
}

/// Reads every MSR of `indices` KVM will return. `KVM_GET_MSRS` stops at
/// the first MSR it cannot read; that one is skipped (logged) and the rest
/// read on.
fn get_msrs(vcpu: &VcpuFd, indices: &[u32]) -> Result<Vec<kvm_msr_entry>, StateError> {
    let mut out = Vec::with_capacity(indices.len());
    let mut rest = indices;
    while !rest.is_empty() {
        let chunk = &rest[..rest.len().min(MSR_CHUNK)];
        let entries: Vec<kvm_msr_entry> = chunk
            .iter()
            .map(|&index| kvm_msr_entry {
                index,
                ..Default::default()
            })
            .collect();
        let mut msrs = msr_list(&entries)?;
        let n = vcpu.get_msrs(&mut msrs).map_err(kvm_err("get MSRs"))?;
        out.extend_from_slice(&msrs.as_slice()[..n]);
        if n < chunk.len() {
            tracing::debug!(msr = chunk[n], "KVM_GET_MSRS refused this MSR; not saved");
            rest = &rest[n + 1..];
        } else {
            rest = &rest[n..];
        }
    }
    Ok(out)
}

/// Writes `entries`; an MSR KVM refuses is skipped with a warning (KVM
/// refuses host writes only to MSRs it reports but treats as read-only, as
/// the PVM MSRs the research notes; none of these are needed to run).
fn set_msrs(vcpu: &VcpuFd, id: u8, entries: &[kvm_msr_entry]) -> Result<(), StateError> {
    let mut rest = entries;
    while !rest.is_empty() {
        let chunk = &rest[..rest.len().min(MSR_CHUNK)];
        let n = vcpu
            .set_msrs(&msr_list(chunk)?)
            .map_err(kvm_err("set MSRs"))?;
        if n < chunk.len() {
            tracing::warn!(
                vcpu = id,
                msr = chunk[n].index,
                "KVM_SET_MSRS refused this MSR; skipped"
            );
            if n == 0 && chunk.len() == rest.len() && rest.len() == 1 {
                return Err(StateError::Msrs(id, chunk[0].index));
            }
            rest = &rest[n + 1..];
        } else {
            rest = &rest[n..];
        }
    }
    Ok(())
}

/// Captures one vCPU. Call only from the thread that parked it, after the
/// completing `immediate_exit` run, while every other vCPU is parked too.
///
/// Order matters: `KVM_GET_MP_STATE` first (it makes the LAPIC accept
/// pending INIT/SIPI events, changing state read later), then
/// `KVM_GET_VCPU_EVENTS`, which, without `KVM_CAP_EXCEPTION_PAYLOAD`,
/// delivers a pending exception's payload (a page fault's CR2) into the
/// registers: read before the system registers, CR2 and the queued fault
/// agree.
pub fn save_vcpu(
    vcpu: &VcpuFd,
    id: u8,
    cpuid: &[kvm_cpuid_entry2],
    msr_indices: &[u32],
) -> Result<VcpuState, StateError> {
    let mp_state = vcpu.get_mp_state().map_err(kvm_err("get the MP state"))?;
    let events = vcpu.get_vcpu_events().map_err(kvm_err("get vCPU events"))?;
    Ok(VcpuState {
        id,
        cpuid: cpuid.to_vec(),
        regs: vcpu.get_regs().map_err(kvm_err("get regs"))?,
        sregs: vcpu.get_sregs().map_err(kvm_err("get sregs"))?,
        xsave: vcpu
            .get_xsave()
            .map_err(kvm_err("get xsave"))?
            .region
            .to_vec(),
        xcrs: vcpu.get_xcrs().map_err(kvm_err("get xcrs"))?,
        msrs: get_msrs(vcpu, msr_indices)?,
        lapic: vcpu.get_lapic().map_err(kvm_err("get the LAPIC"))?,
        mp_state,
        events,
        debugregs: vcpu
            .get_debug_regs()
            .map_err(kvm_err("get debug registers"))?,
    })
}

/// Sets CPUID on a fresh vCPU (before anything else, as KVM requires).
pub fn restore_cpuid(vcpu: &VcpuFd, state: &VcpuState) -> Result<(), StateError> {
    let cpuid =
        CpuId::from_entries(&state.cpuid).map_err(|_| StateError::FamList(state.cpuid.len()))?;
    vcpu.set_cpuid2(&cpuid).map_err(kvm_err("set CPUID"))
}

const MSR_IA32_TSC: u32 = 0x10;

fn realtime_now_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// Nanoseconds of host wall-clock time since `vm` was captured (0 if the
/// host clock went backwards).
pub fn realtime_gap_ns(vm: &VmState) -> u64 {
    realtime_now_ns().saturating_sub(vm.captured_realtime_ns)
}

/// The saved TSC moved on by `gap_ns` at `tsc_khz`, so a guest using the
/// TSC as its clocksource does not lag by the fork or snapshot gap (KVM
/// sets the TSC offset from a host write of this MSR).
pub fn advance_tsc(msrs: &mut [kvm_msr_entry], gap_ns: u64, tsc_khz: u32) {
    let ticks = (u128::from(gap_ns) * u128::from(tsc_khz) / 1_000_000) as u64;
    for e in msrs.iter_mut().filter(|e| e.index == MSR_IA32_TSC) {
        e.data = e.data.wrapping_add(ticks);
    }
}

/// Applies a captured vCPU (after [`restore_cpuid`] and the irqchip state),
/// its TSC advanced by `gap_ns` of wall-clock time.
///
/// The LAPIC goes in before the MSRs: KVM ignores a host write of
/// `MSR_IA32_TSC_DEADLINE` unless the LAPIC timer is already in
/// TSC-deadline mode, so the other order drops the guest's pending timer.
/// The system registers go first of all (they carry the APIC base, which
/// decides how the LAPIC state is read).
pub fn restore_vcpu(vcpu: &VcpuFd, state: &VcpuState, gap_ns: u64) -> Result<(), StateError> {
    vcpu.set_sregs(&state.sregs).map_err(kvm_err("set sregs"))?;
    vcpu.set_regs(&state.regs).map_err(kvm_err("set regs"))?;
    let mut xsave = kvm_xsave::default();
    if state.xsave.len() != xsave.region.len() {
        return Err(StateError::XsaveSize(state.xsave.len()));
    }
    xsave.region.copy_from_slice(&state.xsave);
    // SAFETY: `xsave` is a complete legacy `kvm_xsave` (4 KiB region, no
    // trailing XSAVE2 data), which is all KVM_SET_XSAVE reads.
    unsafe { vcpu.set_xsave(&xsave) }.map_err(kvm_err("set xsave"))?;
    vcpu.set_xcrs(&state.xcrs).map_err(kvm_err("set xcrs"))?;
    let mut msrs = state.msrs.clone();
    if gap_ns > 0 {
        match vcpu.get_tsc_khz() {
            Ok(khz) => advance_tsc(&mut msrs, gap_ns, khz),
            Err(e) => tracing::warn!("cannot read the TSC frequency; TSC not advanced: {e}"),
        }
    }
    vcpu.set_lapic(&state.lapic)
        .map_err(kvm_err("set the LAPIC"))?;
    set_msrs(vcpu, state.id, &msrs)?;
    vcpu.set_mp_state(state.mp_state)
        .map_err(kvm_err("set the MP state"))?;
    let mut events = state.events;
    // Without these flags KVM ignores the saved NMI-pending and SIPI fields.
    events.flags |= KVM_VCPUEVENT_VALID_NMI_PENDING | KVM_VCPUEVENT_VALID_SIPI_VECTOR;
    vcpu.set_vcpu_events(&events)
        .map_err(kvm_err("set vCPU events"))?;
    vcpu.set_debug_regs(&state.debugregs)
        .map_err(kvm_err("set debug registers"))?;
    Ok(())
}

/// Tells the guest that its vCPU was stopped (`KVM_KVMCLOCK_CTRL`: KVM
/// sets `PVCLOCK_GUEST_STOPPED` in its kvmclock page), so that its kernel
/// takes the jump of its clock over a pause, a fork from an aged zygote or
/// a restore for what it is, not for a soft lockup or an RCU stall. A
/// guest without kvmclock has nothing to tell (`EINVAL`).
pub fn tell_guest_it_was_stopped(vcpu: &VcpuFd, id: u8) {
    match vcpu.kvmclock_ctrl() {
        Ok(()) => {}
        Err(e) if e.errno() == libc::EINVAL => {}
        Err(e) => tracing::warn!(vcpu = id, "cannot tell the guest it was stopped: {e}"),
    }
}

fn get_chip(vm: &VmFd, chip_id: u32) -> Result<kvm_irqchip, StateError> {
    let mut chip = kvm_irqchip {
        chip_id,
        ..Default::default()
    };
    vm.get_irqchip(&mut chip)
        .map_err(kvm_err("get the irqchip"))?;
    Ok(chip)
}

/// Captures the irqchip (PIC ×2, IOAPIC), PIT2 and kvmclock.
pub fn save_vm(vm: &VmFd) -> Result<VmState, StateError> {
    Ok(VmState {
        pic_master: get_chip(vm, KVM_IRQCHIP_PIC_MASTER)?,
        pic_slave: get_chip(vm, KVM_IRQCHIP_PIC_SLAVE)?,
        ioapic: get_chip(vm, KVM_IRQCHIP_IOAPIC)?,
        pit: vm.get_pit2().map_err(kvm_err("get the PIT"))?,
        clock: vm.get_clock().map_err(kvm_err("get kvmclock"))?,
        captured_realtime_ns: realtime_now_ns(),
    })
}

/// Applies the irqchip and PIT state (after the vCPUs exist, before their
/// registers: the LAPIC restore reads the irqchip mode).
pub fn restore_irqchip_and_pit(vm: &VmFd, state: &VmState) -> Result<(), StateError> {
    for chip in [&state.pic_master, &state.pic_slave, &state.ioapic] {
        vm.set_irqchip(chip).map_err(kvm_err("set the irqchip"))?;
    }
    vm.set_pit2(&state.pit).map_err(kvm_err("set the PIT"))
}

/// Restores kvmclock last, advanced by the wall-clock time since the
/// capture so the guest does not lag by the fork or snapshot gap: by KVM
/// when the saved flags carry `KVM_CLOCK_REALTIME`, else by `gap_ns`.
pub fn restore_clock(vm: &VmFd, state: &VmState, gap_ns: u64) -> Result<(), StateError> {
    let mut clock = state.clock;
    clock.flags &= KVM_CLOCK_REALTIME;
    if clock.flags == 0 {
        clock.clock = clock.clock.wrapping_add(gap_ns);
    }
    vm.set_clock(&clock).map_err(kvm_err("set kvmclock"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> MachineState {
        let vcpu = VcpuState {
            id: 0,
            cpuid: vec![kvm_cpuid_entry2 {
                function: 1,
                eax: 7,
                ..Default::default()
            }],
            regs: kvm_regs {
                rip: 0xffff_ffff_8100_0000,
                rax: 42,
                ..Default::default()
            },
            sregs: kvm_sregs {
                cr3: 0x9000,
                ..Default::default()
            },
            xsave: vec![0; 1024],
            xcrs: kvm_xcrs::default(),
            msrs: vec![kvm_msr_entry {
                index: 0x10,
                data: 123_456,
                ..Default::default()
            }],
            lapic: kvm_lapic_state::default(),
            mp_state: kvm_mp_state::default(),
            events: kvm_vcpu_events::default(),
            debugregs: kvm_debugregs::default(),
        };
        MachineState {
            format_version: FORMAT_VERSION,
            state_format: state_format(),
            hardware: Hardware {
                vcpus: 1,
                memory_mib: 512,
                layers: Vec::new(),
                disks: vec!["/d".into()],
                writable: vec![WritableDisk {
                    base: "/w".into(),
                    saved: vec![(0, 3), (9, 1)],
                }],
                vsock: true,
                net: false,
            },
            vm: VmState {
                pic_master: kvm_irqchip::default(),
                pic_slave: kvm_irqchip {
                    chip_id: 1,
                    ..Default::default()
                },
                ioapic: kvm_irqchip {
                    chip_id: 2,
                    ..Default::default()
                },
                pit: kvm_pit_state2::default(),
                clock: kvm_clock_data {
                    clock: 99,
                    flags: KVM_CLOCK_REALTIME,
                    ..Default::default()
                },
                captured_realtime_ns: 1,
            },
            vcpus: vec![vcpu],
            serial: SerialState::from_superio(&vm_superio::serial::SerialState::default()),
            devices: vec![],
        }
    }

    #[test]
    fn state_json_round_trip_is_identical() {
        let s = sample();
        let bytes = s.to_json().expect("encode");
        let back = MachineState::from_json(&bytes).expect("decode");
        assert_eq!(back.to_json().expect("encode"), bytes);
        assert_eq!(back.vcpus[0].regs.rax, 42);
        assert_eq!(back.vcpus[0].msrs[0].data, 123_456);
        assert_eq!(back.vm.clock.clock, 99);
        assert_eq!(back.hardware.disks, vec![PathBuf::from("/d")]);
    }

    #[test]
    fn state_other_format_refused_naming_both() {
        let mut s = sample();
        s.format_version = FORMAT_VERSION + 1;
        s.state_format = "forkbox-vmm-9.9.9/state-v2".into();
        let bytes = s.to_json().expect("encode");
        let err = MachineState::from_json(&bytes).expect_err("must refuse");
        let text = err.to_string();
        assert!(text.contains("forkbox-vmm-9.9.9/state-v2"), "{text}");
        assert!(text.contains(&state_format()), "{text}");
    }

    #[test]
    fn advance_tsc_moves_only_the_tsc() {
        let mut msrs = vec![
            kvm_msr_entry {
                index: MSR_IA32_TSC,
                data: 1000,
                ..Default::default()
            },
            kvm_msr_entry {
                index: 0x1a0,
                data: 1,
                ..Default::default()
            },
        ];
        advance_tsc(&mut msrs, 2_000_000, 3_000_000); // 2 ms at 3 GHz
        assert_eq!(msrs[0].data, 1000 + 6_000_000);
        assert_eq!(msrs[1].data, 1);
    }

    #[test]
    fn realtime_gap_counts_from_the_capture() {
        let mut vm = sample().vm;
        vm.captured_realtime_ns = realtime_now_ns() - 5_000_000_000;
        let gap = realtime_gap_ns(&vm);
        assert!((5_000_000_000..6_000_000_000).contains(&gap), "{gap}");
        vm.captured_realtime_ns = u64::MAX;
        assert_eq!(realtime_gap_ns(&vm), 0);
    }

    #[test]
    fn vcpu_report_names_lapic_vectors_and_events() {
        let mut vcpu = sample().vcpus.remove(0);
        // Vector 236 pending (word 7, bit 12), vector 33 in service.
        vcpu.lapic.regs[APIC_IRR + 7 * 16 + 1] = 0x10;
        vcpu.lapic.regs[APIC_ISR + 16] = 0x02;
        vcpu.mp_state.mp_state = kvm_bindings::KVM_MP_STATE_HALTED;
        vcpu.events.exception.injected = 1;
        vcpu.events.exception.nr = 14;
        vcpu.events.exception.error_code = 0x10;
        let r = vcpu_report(&vcpu);
        assert_eq!(r.lapic_irr, vec![236]);
        assert_eq!(r.lapic_isr, vec![33]);
        assert_eq!(r.mp_state, "halted");
        assert_eq!(r.exception.as_deref(), Some("nr 14 error 0x10 (injected)"));
        assert_eq!(r.rip, 0xffff_ffff_8100_0000);
    }

    #[test]
    fn state_garbage_is_a_parse_error() {
        assert!(matches!(
            MachineState::from_json(b"{\"nope\":1}"),
            Err(StateError::Parse(_))
        ));
    }
}
