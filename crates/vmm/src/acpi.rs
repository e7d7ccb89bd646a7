//! ACPI tables: RSDP, XSDT, FADT (hardware-reduced, with sleep and reset
//! registers on I/O ports), DSDT (`_S5_` and one `LNRO0005` virtio-mmio
//! device per window) and MADT (one local APIC per vCPU, one IOAPIC).
//! Pure: builds byte blobs at chosen guest addresses; the caller writes them.

use acpi_tables::aml;
use acpi_tables::fadt::{FADTBuilder, Flags};
use acpi_tables::gas::{AccessSize, AddressSpace, GAS};
use acpi_tables::madt::{
    EnabledStatus, IoApic, LocalInterruptController, ProcessorLocalApic, MADT,
};
use acpi_tables::rsdp::Rsdp;
use acpi_tables::sdt::Sdt;
use acpi_tables::xsdt::XSDT;
use acpi_tables::Aml;

use crate::layout::{
    VirtioWindow, ACPI_END, ACPI_START, COM1_PORT, IOAPIC_ADDR, LAPIC_ADDR, SERIAL_GSI,
};

const OEM_ID: [u8; 6] = *b"FRKBOX";
const OEM_REVISION: u32 = 1;

/// I/O port of the FADT sleep control register (guest writes SLP_TYP|SLP_EN).
pub const SLEEP_CONTROL_PORT: u16 = 0x600;
/// I/O port of the FADT sleep status register (reads as 0).
pub const SLEEP_STATUS_PORT: u16 = 0x601;
/// I/O port of the FADT reset register.
pub const RESET_PORT: u16 = 0x602;
/// Value the guest writes to [`RESET_PORT`] to reset.
pub const RESET_VALUE: u8 = 1;
/// SLP_TYP of `_S5_` (soft off).
pub const S5_SLEEP_TYPE: u8 = 5;
/// SLP_EN bit of the sleep control register.
pub const SLEEP_ENABLE: u8 = 1 << 5;

/// IAPC_BOOT_ARCH: no VGA, no CMOS RTC (so the kernel does not probe them).
const IAPC_BOOT_ARCH_VGA_NOT_PRESENT: u16 = 1 << 2;
const IAPC_BOOT_ARCH_CMOS_RTC_NOT_PRESENT: u16 = 1 << 5;

#[derive(Debug, thiserror::Error)]
pub enum AcpiError {
    #[error("ACPI tables need {needed} bytes, the ACPI area has {available}")]
    TooLarge { needed: u64, available: u64 },
    #[error("{0} vCPUs do not fit in the MADT")]
    TooManyVcpus(usize),
}

/// What the tables describe.
#[derive(Debug, Clone)]
pub struct AcpiConfig {
    pub vcpus: u8,
    pub virtio: Vec<VirtioWindow>,
}

/// The tables, each with the guest address it must be written at.
#[derive(Debug, Clone)]
pub struct AcpiTables {
    pub rsdp_addr: u64,
    pub blobs: Vec<(u64, Vec<u8>)>,
}

/// What a sleep-control write asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SleepRequest {
    PowerOff,
    Ignored,
}

/// Decodes a byte written to the sleep control register.
pub fn decode_sleep_control(value: u8) -> SleepRequest {
    let sleep_type = (value >> 2) & 0x7;
    if value & SLEEP_ENABLE != 0 && sleep_type == S5_SLEEP_TYPE {
        SleepRequest::PowerOff
    } else {
        SleepRequest::Ignored
    }
}

fn aml_bytes(obj: &dyn Aml) -> Vec<u8> {
    let mut v = Vec::new();
    obj.to_aml_bytes(&mut v);
    v
}

/// COM1 as an ACPI device. On hardware-reduced ACPI the kernel maps no
/// legacy ISA IRQs by itself; describing IRQ 4 here is what makes the
/// 8250 driver's interrupt reach the IOAPIC (without it the console is
/// output-only from the kernel, and user space writes never drain).
fn com1() -> Vec<u8> {
    let io = aml::IO::new(COM1_PORT, COM1_PORT, 1, 8);
    let irq = aml::Interrupt::new(true, true, false, false, SERIAL_GSI);
    let crs = aml::ResourceTemplate::new(vec![&io, &irq]);
    let hid_id = aml::EISAName::new("PNP0501");
    let hid = aml::Name::new("_HID".into(), &hid_id);
    let uid = aml::Name::new("_UID".into(), &0u8);
    let crs_name = aml::Name::new("_CRS".into(), &crs);
    aml_bytes(&aml::Device::new(
        "\\_SB_.COM1".into(),
        vec![&hid, &uid, &crs_name],
    ))
}

/// The DSDT: `\_S5_`, COM1 and `\_SB_.VRxx` for every virtio-mmio window.
pub fn dsdt(virtio: &[VirtioWindow]) -> Vec<u8> {
    let mut body = aml_bytes(&aml::Name::new(
        "_S5_".into(),
        &aml::Package::new(vec![&S5_SLEEP_TYPE, &0u8, &0u8, &0u8]),
    ));
    body.extend(com1());
    for (i, w) in virtio.iter().enumerate() {
        let mem = aml::Memory32Fixed::new(true, w.base as u32, w.size as u32);
        // Edge-triggered, active-high, exclusive: the line is an irqfd pulse.
        let irq = aml::Interrupt::new(true, true, false, false, w.gsi);
        let crs = aml::ResourceTemplate::new(vec![&mem, &irq]);
        let hid = aml::Name::new("_HID".into(), &"LNRO0005");
        let uid_val = i as u32;
        let uid = aml::Name::new("_UID".into(), &uid_val);
        let crs_name = aml::Name::new("_CRS".into(), &crs);
        let path = format!("\\_SB_.VR{i:02X}");
        let dev = aml::Device::new(path.as_str().into(), vec![&hid, &uid, &crs_name]);
        dev.to_aml_bytes(&mut body);
    }
    let mut sdt = Sdt::new(*b"DSDT", 36, 6, OEM_ID, *b"FBXDSDT ", OEM_REVISION);
    sdt.append_slice(&body);
    sdt.update_checksum();
    sdt.as_slice().to_vec()
}

fn fadt(dsdt_addr: u64) -> Vec<u8> {
    let io_byte = |port: u16| {
        GAS::new(
            AddressSpace::SystemIo,
            8,
            0,
            AccessSize::ByteAccess,
            port.into(),
        )
    };
    let mut b = FADTBuilder::new(OEM_ID, *b"FBXFACP ", OEM_REVISION)
        .dsdt_64(dsdt_addr)
        .flag(Flags::HwReducedAcpi)
        .flag(Flags::ResetRegSup)
        .flag(Flags::PwrButton)
        .flag(Flags::SlpButton);
    b.reset_reg = io_byte(RESET_PORT);
    b.reset_value = RESET_VALUE;
    b.sleep_control_reg = io_byte(SLEEP_CONTROL_PORT);
    b.sleep_status_reg = io_byte(SLEEP_STATUS_PORT);
    b.iapc_boot_arch =
        (IAPC_BOOT_ARCH_VGA_NOT_PRESENT | IAPC_BOOT_ARCH_CMOS_RTC_NOT_PRESENT).into();
    aml_bytes(&b.finalize())
}

fn madt(vcpus: u8) -> Vec<u8> {
    let mut madt = MADT::new(
        OEM_ID,
        *b"FBXMADT ",
        OEM_REVISION,
        LocalInterruptController::Address(LAPIC_ADDR),
    );
    for id in 0..vcpus {
        madt.add_structure(ProcessorLocalApic::new(id, id, EnabledStatus::Enabled));
    }
    madt.add_structure(IoApic::new(0, IOAPIC_ADDR, 0));
    aml_bytes(&madt)
}

fn align16(addr: u64) -> u64 {
    (addr + 15) & !15
}

/// Builds every table, placed in `[ACPI_START, ACPI_END)` with the RSDP first.
pub fn build(cfg: &AcpiConfig) -> Result<AcpiTables, AcpiError> {
    if cfg.vcpus == 0 || cfg.vcpus == u8::MAX {
        return Err(AcpiError::TooManyVcpus(cfg.vcpus.into()));
    }
    let rsdp_addr = ACPI_START;
    let mut next = align16(rsdp_addr + Rsdp::len() as u64);
    let mut place = |len: usize| {
        let at = next;
        next = align16(next + len as u64);
        at
    };
    let dsdt = dsdt(&cfg.virtio);
    let dsdt_addr = place(dsdt.len());
    let fadt = fadt(dsdt_addr);
    let fadt_addr = place(fadt.len());
    let madt = madt(cfg.vcpus);
    let madt_addr = place(madt.len());
    let mut xsdt = XSDT::new(OEM_ID, *b"FBXXSDT ", OEM_REVISION);
    xsdt.add_entry(fadt_addr);
    xsdt.add_entry(madt_addr);
    let xsdt = aml_bytes(&xsdt);
    let xsdt_addr = place(xsdt.len());
    let end = next;
    if end > ACPI_END {
        return Err(AcpiError::TooLarge {
            needed: end - ACPI_START,
            available: ACPI_END - ACPI_START,
        });
    }
    let rsdp = aml_bytes(&Rsdp::new(OEM_ID, xsdt_addr));
    Ok(AcpiTables {
        rsdp_addr,
        blobs: vec![
            (rsdp_addr, rsdp),
            (dsdt_addr, dsdt),
            (fadt_addr, fadt),
            (madt_addr, madt),
            (xsdt_addr, xsdt),
        ],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sum(bytes: &[u8]) -> u8 {
        bytes.iter().fold(0u8, |a, b| a.wrapping_add(*b))
    }

    fn windows(n: usize) -> Vec<VirtioWindow> {
        (0..n)
            .map(|i| VirtioWindow::nth(i).expect("in range"))
            .collect()
    }

    fn tables(vcpus: u8, devices: usize) -> AcpiTables {
        build(&AcpiConfig {
            vcpus,
            virtio: windows(devices),
        })
        .expect("tables fit")
    }

    fn table<'a>(t: &'a AcpiTables, sig: &[u8]) -> &'a [u8] {
        &t.blobs
            .iter()
            .find(|(_, b)| b.starts_with(sig))
            .expect("table present")
            .1
    }

    fn count(hay: &[u8], needle: &[u8]) -> usize {
        hay.windows(needle.len()).filter(|w| *w == needle).count()
    }

    #[test]
    fn build_every_table_checksums_to_zero() {
        let t = tables(8, 3);
        for (addr, blob) in &t.blobs {
            if blob.starts_with(b"RSD PTR ") {
                assert_eq!(sum(&blob[..20]), 0, "RSDP v1 checksum");
                assert_eq!(sum(blob), 0, "RSDP extended checksum");
            } else {
                assert_eq!(sum(blob), 0, "table at {addr:#x}");
                let len = u32::from_le_bytes([blob[4], blob[5], blob[6], blob[7]]);
                assert_eq!(len as usize, blob.len(), "length field at {addr:#x}");
            }
        }
    }

    #[test]
    fn build_tables_inside_acpi_area_disjoint() {
        let t = tables(8, 19);
        assert_eq!(t.rsdp_addr, ACPI_START);
        let mut spans: Vec<(u64, u64)> = t
            .blobs
            .iter()
            .map(|(a, b)| (*a, a + b.len() as u64))
            .collect();
        spans.sort();
        for s in &spans {
            assert!(s.0 >= ACPI_START && s.1 <= ACPI_END);
        }
        for pair in spans.windows(2) {
            assert!(pair[0].1 <= pair[1].0);
        }
    }

    #[test]
    fn rsdp_points_at_xsdt_listing_fadt_and_madt() {
        let t = tables(2, 1);
        let rsdp = table(&t, b"RSD PTR ");
        let xsdt_addr = u64::from_le_bytes(rsdp[24..32].try_into().expect("8 bytes"));
        let (_, xsdt) = t.blobs.iter().find(|(a, _)| *a == xsdt_addr).expect("xsdt");
        assert!(xsdt.starts_with(b"XSDT"));
        let entries: Vec<u64> = xsdt[36..]
            .chunks(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect();
        let sigs: Vec<&[u8]> = entries
            .iter()
            .map(|e| &t.blobs.iter().find(|(a, _)| a == e).expect("entry").1[..4])
            .collect();
        assert_eq!(sigs, vec![&b"FACP"[..], &b"APIC"[..]]);
    }

    #[test]
    fn dsdt_has_one_lnro0005_per_window_with_its_resources() {
        let w = windows(3);
        let dsdt = dsdt(&w);
        assert_eq!(count(&dsdt, b"LNRO0005\0"), 3);
        assert_eq!(count(&dsdt, b"_S5_"), 1);
        assert_eq!(count(&dsdt, b"COM1"), 1);
        for win in &w {
            // Memory32Fixed: tag 0x86, length 9, read-write, base, size.
            let mut mem = vec![0x86, 0x09, 0x00, 0x01];
            mem.extend_from_slice(&(win.base as u32).to_le_bytes());
            mem.extend_from_slice(&(win.size as u32).to_le_bytes());
            assert_eq!(count(&dsdt, &mem), 1, "window {win:?}");
            // Extended interrupt: tag 0x89, length 6, consumer|edge, 1 irq, GSI.
            let mut irq = vec![0x89, 0x06, 0x00, 0x03, 0x01];
            irq.extend_from_slice(&win.gsi.to_le_bytes());
            assert_eq!(count(&dsdt, &irq), 1, "irq of {win:?}");
        }
    }

    #[test]
    fn dsdt_without_devices_still_has_s5() {
        let dsdt = dsdt(&[]);
        assert_eq!(count(&dsdt, b"LNRO0005"), 0);
        assert_eq!(count(&dsdt, b"_S5_"), 1);
    }

    #[test]
    fn madt_has_one_enabled_lapic_per_vcpu_and_one_ioapic() {
        for vcpus in [1u8, 2, 8] {
            let t = tables(vcpus, 0);
            let madt = table(&t, b"APIC");
            let mut lapics = Vec::new();
            let mut ioapics = 0;
            let mut off = 44;
            while off < madt.len() {
                let (kind, len) = (madt[off], madt[off + 1] as usize);
                match kind {
                    0 => lapics.push((madt[off + 2], madt[off + 3], madt[off + 4] & 1)),
                    1 => ioapics += 1,
                    _ => {}
                }
                off += len;
            }
            let want: Vec<_> = (0..vcpus).map(|i| (i, i, 1)).collect();
            assert_eq!(lapics, want);
            assert_eq!(ioapics, 1);
        }
    }

    #[test]
    fn fadt_is_hw_reduced_with_reset_and_sleep_ports() {
        let t = tables(1, 0);
        let fadt = table(&t, b"FACP");
        let flags = u32::from_le_bytes(fadt[112..116].try_into().expect("4 bytes"));
        assert_ne!(flags & (1 << 20), 0, "HW_REDUCED_ACPI");
        assert_ne!(flags & (1 << 10), 0, "RESET_REG_SUP");
        // reset_reg GAS at 116: I/O space, address RESET_PORT; value at 128.
        assert_eq!(fadt[116], 1);
        assert_eq!(
            u64::from_le_bytes(fadt[120..128].try_into().expect("8")),
            0x602
        );
        assert_eq!(fadt[128], RESET_VALUE);
        // sleep control GAS at 244, sleep status at 256.
        assert_eq!(
            u64::from_le_bytes(fadt[248..256].try_into().expect("8")),
            0x600
        );
        assert_eq!(
            u64::from_le_bytes(fadt[260..268].try_into().expect("8")),
            0x601
        );
    }

    #[test]
    fn sleep_control_s5_with_enable_powers_off() {
        assert_eq!(
            decode_sleep_control((5 << 2) | 0x20),
            SleepRequest::PowerOff
        );
        assert_eq!(decode_sleep_control(5 << 2), SleepRequest::Ignored);
        assert_eq!(decode_sleep_control((3 << 2) | 0x20), SleepRequest::Ignored);
    }
}
