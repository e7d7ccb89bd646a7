//! vCPU setup: CPUID (from `KVM_GET_SUPPORTED_CPUID`, patched per vCPU),
//! boot MSRs, LAPIC LINT0/LINT1, and the 64-bit register state for the
//! kernel's entry point. [`patch_cpuid`] is pure; the rest issues vCPU ioctls.

use kvm_bindings::{
    kvm_cpuid_entry2, kvm_fpu, kvm_lapic_state, kvm_msr_entry, kvm_regs, kvm_segment, CpuId, Msrs,
};
use kvm_ioctls::VcpuFd;

use crate::boot::{BootEntry, BOOT_CS, BOOT_DS, BOOT_TSS, GDT};

#[derive(Debug, thiserror::Error)]
pub enum CpuError {
    #[error("cannot set CPUID")]
    Cpuid(#[source] kvm_ioctls::Error),
    #[error("cannot set boot MSRs")]
    Msrs(#[source] kvm_ioctls::Error),
    #[error("KVM accepted {set} of {want} boot MSRs")]
    MsrsPartial { set: usize, want: usize },
    #[error("cannot build the MSR list")]
    MsrList,
    #[error("cannot set {0}")]
    Regs(&'static str, #[source] kvm_ioctls::Error),
    #[error("cannot program the local APIC")]
    Lapic(#[source] kvm_ioctls::Error),
}

const CPUID_ECX_HYPERVISOR: u32 = 1 << 31;
/// Leaf 1 ECX: Intel VMX. Leaf 0x8000_0001 ECX: AMD SVM.
const CPUID_ECX_VMX: u32 = 1 << 5;
const CPUID_EXT_ECX_SVM: u32 = 1 << 2;
const CPUID_EDX_HTT: u32 = 1 << 28;
/// Leaf 0xB/0x1F level types.
const LEVEL_TYPE_SMT: u32 = 1;
const LEVEL_TYPE_CORE: u32 = 2;

/// Bits needed to number `n` things (0 for 1).
fn id_bits(n: u32) -> u32 {
    if n <= 1 {
        0
    } else {
        32 - (n - 1).leading_zeros()
    }
}

/// Adapts the supported CPUID to vCPU `apic_id` of `vcpus`: one socket,
/// one thread per core, `vcpus` cores; APIC ID = vCPU index. Guests get
/// no nested virtualization: VMX, SVM and SVM's feature leaf are hidden,
/// so a guest cannot reach the host kernel's nested-virtualization code.
pub fn patch_cpuid(entries: &mut [kvm_cpuid_entry2], apic_id: u8, vcpus: u8) {
    let id = u32::from(apic_id);
    let n = u32::from(vcpus);
    for e in entries.iter_mut() {
        match e.function {
            0x1 => {
                e.ebx = (e.ebx & 0x0000_ffff) | (id << 24) | (n << 16);
                e.ecx |= CPUID_ECX_HYPERVISOR;
                e.ecx &= !CPUID_ECX_VMX;
                if vcpus > 1 {
                    e.edx |= CPUID_EDX_HTT;
                } else {
                    e.edx &= !CPUID_EDX_HTT;
                }
            }
            0x4 => {
                // Cores per package - 1 in EAX[31:26]; caches private per core.
                e.eax = (e.eax & 0x0000_3fff) | ((n - 1) << 26);
            }
            0xb | 0x1f => {
                e.edx = id;
                match e.index {
                    0 => {
                        e.eax = 0;
                        e.ebx = 1;
                        e.ecx = (LEVEL_TYPE_SMT << 8) | e.index;
                    }
                    1 => {
                        e.eax = id_bits(n);
                        e.ebx = n;
                        e.ecx = (LEVEL_TYPE_CORE << 8) | e.index;
                    }
                    _ => {
                        e.eax = 0;
                        e.ebx = 0;
                        e.ecx = e.index;
                    }
                }
            }
            0x8000_0001 => e.ecx &= !CPUID_EXT_ECX_SVM,
            0x8000_000a => {
                e.eax = 0;
                e.ebx = 0;
                e.ecx = 0;
                e.edx = 0;
            }
            0x8000_001e => {
                // AMD: extended APIC ID and core ID.
                e.eax = id;
                e.ebx = (e.ebx & 0xffff_ff00) | id;
            }
            _ => {}
        }
    }
}

/// MSRs every vCPU starts with.
pub fn boot_msrs() -> Vec<kvm_msr_entry> {
    const MSR_IA32_TSC: u32 = 0x10;
    const MSR_IA32_SYSENTER_CS: u32 = 0x174;
    const MSR_IA32_SYSENTER_ESP: u32 = 0x175;
    const MSR_IA32_SYSENTER_EIP: u32 = 0x176;
    const MSR_IA32_MISC_ENABLE: u32 = 0x1a0;
    const MSR_MTRR_DEF_TYPE: u32 = 0x2ff;
    const MSR_STAR: u32 = 0xc000_0081;
    const MSR_LSTAR: u32 = 0xc000_0082;
    const MSR_CSTAR: u32 = 0xc000_0083;
    const MSR_SYSCALL_MASK: u32 = 0xc000_0084;
    const MSR_KERNEL_GS_BASE: u32 = 0xc000_0102;
    const MISC_ENABLE_FAST_STRING: u64 = 1;
    const MTRR_ENABLE_WRITEBACK: u64 = (1 << 11) | 6;
    [
        (MSR_IA32_SYSENTER_CS, 0),
        (MSR_IA32_SYSENTER_ESP, 0),
        (MSR_IA32_SYSENTER_EIP, 0),
        (MSR_STAR, 0),
        (MSR_CSTAR, 0),
        (MSR_KERNEL_GS_BASE, 0),
        (MSR_SYSCALL_MASK, 0),
        (MSR_LSTAR, 0),
        (MSR_IA32_TSC, 0),
        (MSR_IA32_MISC_ENABLE, MISC_ENABLE_FAST_STRING),
        (MSR_MTRR_DEF_TYPE, MTRR_ENABLE_WRITEBACK),
    ]
    .into_iter()
    .map(|(index, data)| kvm_msr_entry {
        index,
        data,
        ..Default::default()
    })
    .collect()
}

fn segment(selector: u16) -> kvm_segment {
    let entry = GDT[usize::from(selector >> 3)];
    let granular = (entry >> 55) & 1;
    let raw_limit = ((entry >> 32) & 0x000f_0000) | (entry & 0xffff);
    let limit = if granular == 1 {
        (raw_limit << 12) | 0xfff
    } else {
        raw_limit
    };
    let present = ((entry >> 47) & 1) as u8;
    kvm_segment {
        base: ((entry >> 32) & 0xff00_0000) | ((entry >> 16) & 0x00ff_ffff),
        limit: limit as u32,
        selector,
        type_: ((entry >> 40) & 0xf) as u8,
        present,
        dpl: ((entry >> 45) & 0x3) as u8,
        db: ((entry >> 54) & 1) as u8,
        s: ((entry >> 44) & 1) as u8,
        l: ((entry >> 53) & 1) as u8,
        g: granular as u8,
        avl: ((entry >> 52) & 1) as u8,
        unusable: u8::from(present == 0),
        padding: 0,
    }
}

/// Sets CPUID and MSRs and programs the LAPIC: every vCPU.
pub fn configure(vcpu: &VcpuFd, cpuid: &CpuId) -> Result<(), CpuError> {
    vcpu.set_cpuid2(cpuid).map_err(CpuError::Cpuid)?;
    let entries = boot_msrs();
    let msrs = Msrs::from_entries(&entries).map_err(|_| CpuError::MsrList)?;
    let set = vcpu.set_msrs(&msrs).map_err(CpuError::Msrs)?;
    if set != entries.len() {
        return Err(CpuError::MsrsPartial {
            set,
            want: entries.len(),
        });
    }
    let mut lapic = vcpu.get_lapic().map_err(CpuError::Lapic)?;
    set_lint_modes(&mut lapic);
    vcpu.set_lapic(&lapic).map_err(CpuError::Lapic)?;
    Ok(())
}

const APIC_LVT_LINT0: usize = 0x350;
const APIC_LVT_LINT1: usize = 0x360;
const APIC_MODE_NMI: u32 = 0x4;
const APIC_MODE_EXTINT: u32 = 0x7;

fn lapic_reg(lapic: &kvm_lapic_state, off: usize) -> u32 {
    let b = &lapic.regs[off..off + 4];
    u32::from_le_bytes([b[0] as u8, b[1] as u8, b[2] as u8, b[3] as u8])
}

fn set_lapic_reg(lapic: &mut kvm_lapic_state, off: usize, val: u32) {
    for (dst, src) in lapic.regs[off..off + 4].iter_mut().zip(val.to_le_bytes()) {
        *dst = src as _;
    }
}

/// LINT0 = ExtINT (the PIC), LINT1 = NMI, as a PC's BIOS leaves them.
pub fn set_lint_modes(lapic: &mut kvm_lapic_state) {
    let set_mode = |reg: u32, mode: u32| (reg & !0x700) | (mode << 8);
    let l0 = lapic_reg(lapic, APIC_LVT_LINT0);
    set_lapic_reg(lapic, APIC_LVT_LINT0, set_mode(l0, APIC_MODE_EXTINT));
    let l1 = lapic_reg(lapic, APIC_LVT_LINT1);
    set_lapic_reg(lapic, APIC_LVT_LINT1, set_mode(l1, APIC_MODE_NMI));
}

/// Puts the boot vCPU in 64-bit mode at the kernel's entry point.
pub fn set_boot_registers(vcpu: &VcpuFd, entry: &BootEntry) -> Result<(), CpuError> {
    const CR0_PE: u64 = 1;
    const CR0_ET: u64 = 1 << 4;
    const CR0_PG: u64 = 1 << 31;
    const CR4_PAE: u64 = 1 << 5;
    const EFER_LME: u64 = 1 << 8;
    const EFER_LMA: u64 = 1 << 10;

    let fpu = kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    };
    vcpu.set_fpu(&fpu)
        .map_err(|e| CpuError::Regs("FPU state", e))?;

    let mut sregs = vcpu.get_sregs().map_err(|e| CpuError::Regs("sregs", e))?;
    sregs.gdt.base = entry.gdt;
    sregs.gdt.limit = (std::mem::size_of_val(&GDT) - 1) as u16;
    sregs.idt.base = entry.idt;
    sregs.idt.limit = 7;
    sregs.cs = segment(BOOT_CS);
    let data = segment(BOOT_DS);
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = segment(BOOT_TSS);
    sregs.cr3 = entry.pml4;
    sregs.cr4 |= CR4_PAE;
    sregs.cr0 |= CR0_PE | CR0_ET | CR0_PG;
    sregs.efer |= EFER_LME | EFER_LMA;
    vcpu.set_sregs(&sregs)
        .map_err(|e| CpuError::Regs("sregs", e))?;

    let regs = kvm_regs {
        rflags: 0x2,
        rip: entry.rip,
        rsp: entry.stack,
        rbp: entry.stack,
        rsi: entry.zero_page,
        ..Default::default()
    };
    vcpu.set_regs(&regs)
        .map_err(|e| CpuError::Regs("regs", e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(function: u32, index: u32) -> kvm_cpuid_entry2 {
        kvm_cpuid_entry2 {
            function,
            index,
            eax: 0xdead_beef,
            ebx: 0x1234_0800,
            ecx: 0x11,
            edx: 0x22,
            ..Default::default()
        }
    }

    fn supported() -> Vec<kvm_cpuid_entry2> {
        vec![
            entry(0x1, 0),
            entry(0x4, 0),
            entry(0xb, 0),
            entry(0xb, 1),
            entry(0xb, 2),
            entry(0x1f, 0),
            entry(0x8000_001e, 0),
        ]
    }

    fn find(e: &[kvm_cpuid_entry2], f: u32, i: u32) -> kvm_cpuid_entry2 {
        *e.iter()
            .find(|x| x.function == f && x.index == i)
            .expect("leaf present")
    }

    #[test]
    fn patch_cpuid_hides_nested_virtualization() {
        let mut e = vec![
            kvm_cpuid_entry2 {
                function: 0x1,
                ecx: u32::MAX,
                ..Default::default()
            },
            kvm_cpuid_entry2 {
                function: 0x8000_0001,
                ecx: u32::MAX,
                ..Default::default()
            },
            kvm_cpuid_entry2 {
                function: 0x8000_000a,
                eax: 1,
                ebx: 0x8000,
                edx: u32::MAX,
                ..Default::default()
            },
        ];
        patch_cpuid(&mut e, 0, 1);
        assert_eq!(find(&e, 0x1, 0).ecx & CPUID_ECX_VMX, 0, "VMX shown");
        assert_eq!(
            find(&e, 0x8000_0001, 0).ecx,
            !CPUID_EXT_ECX_SVM,
            "SVM shown, or more hidden"
        );
        let svm = find(&e, 0x8000_000a, 0);
        assert_eq!((svm.eax, svm.ebx, svm.ecx, svm.edx), (0, 0, 0, 0));
    }

    #[test]
    fn patch_cpuid_leaf1_apic_id_count_hypervisor() {
        let mut e = supported();
        patch_cpuid(&mut e, 5, 8);
        let l1 = find(&e, 1, 0);
        assert_eq!(l1.ebx >> 24, 5);
        assert_eq!((l1.ebx >> 16) & 0xff, 8);
        assert_eq!(l1.ebx & 0xffff, 0x0800, "CLFLUSH size kept");
        assert_ne!(l1.ecx & CPUID_ECX_HYPERVISOR, 0);
        assert_ne!(l1.edx & CPUID_EDX_HTT, 0);
    }

    #[test]
    fn patch_cpuid_leaf_b_and_1f_x2apic_id_per_vcpu() {
        for id in 0..4u8 {
            let mut e = supported();
            patch_cpuid(&mut e, id, 4);
            for (f, i) in [(0xb, 0), (0xb, 1), (0xb, 2), (0x1f, 0)] {
                assert_eq!(find(&e, f, i).edx, u32::from(id), "leaf {f:#x}.{i}");
            }
            let core = find(&e, 0xb, 1);
            assert_eq!(core.eax, 2, "shift for 4 cores");
            assert_eq!(core.ebx, 4);
            assert_eq!(core.ecx, (LEVEL_TYPE_CORE << 8) | 1);
            let invalid = find(&e, 0xb, 2);
            assert_eq!(
                invalid.ecx >> 8 & 0xff,
                0,
                "level type invalid ends enumeration"
            );
        }
    }

    #[test]
    fn patch_cpuid_single_vcpu_no_htt() {
        let mut e = supported();
        patch_cpuid(&mut e, 0, 1);
        assert_eq!(find(&e, 1, 0).edx & CPUID_EDX_HTT, 0);
        assert_eq!(find(&e, 4, 0).eax >> 26, 0);
        assert_eq!(find(&e, 0xb, 1).eax, 0);
    }

    #[test]
    fn id_bits_rounds_up() {
        assert_eq!([1, 2, 3, 4, 5, 8].map(id_bits), [0, 1, 2, 2, 3, 3]);
    }

    #[test]
    fn lint_modes_extint_and_nmi() {
        let mut lapic = kvm_lapic_state::default();
        set_lapic_reg(&mut lapic, APIC_LVT_LINT0, 0x0001_0000);
        set_lint_modes(&mut lapic);
        assert_eq!(lapic_reg(&lapic, APIC_LVT_LINT0), 0x0001_0700);
        assert_eq!(lapic_reg(&lapic, APIC_LVT_LINT1), 0x400);
    }

    #[test]
    fn segment_code64_long_mode() {
        let cs = segment(BOOT_CS);
        assert_eq!((cs.l, cs.db, cs.present, cs.type_), (1, 0, 1, 0xb));
        assert_eq!(cs.limit, 0xffff_ffff);
        let tss = segment(BOOT_TSS);
        assert_eq!(tss.s, 0);
    }
}
