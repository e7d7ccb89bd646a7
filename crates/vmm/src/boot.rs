//! Loading a bzImage for the 64-bit boot protocol: the kernel at 1 MiB, the
//! initramfs at the top of low RAM, the command line, the zero page
//! (`boot_params` with the image's setup header and the e820 map), identity
//! page tables and a GDT. Writes guest memory only; vCPU registers are set in
//! [`crate::cpu`] from the returned [`BootEntry`].

use std::fs::File;
use std::path::{Path, PathBuf};

use forkbox_devices::GuestMemory;
use linux_loader::loader::bootparam::{boot_e820_entry, boot_params};
use linux_loader::loader::{BzImage, KernelLoader};
use vm_memory::{Bytes, GuestAddress};

use crate::layout::{
    MemoryLayout, BOOT_STACK_TOP, CMDLINE_ADDR, CMDLINE_MAX, GDT_ADDR, IDT_ADDR, KERNEL_ADDR,
    PDPT_ADDR, PD_ADDR, PD_COUNT, PML4_ADDR, ZERO_PAGE_ADDR,
};

/// Offset of the 64-bit entry point from the protected-mode kernel's start.
const STARTUP_64_OFFSET: u64 = 0x200;
/// `type_of_loader`: "undefined" boot loader.
const LOADER_TYPE_UNDEFINED: u8 = 0xff;
/// The x86 reset vector (F000:FFF0), where a BIOS reboot jumps.
const RESET_VECTOR: u64 = 0xF_FFF0;
/// What runs at the reset vector: there is no firmware, so a guest that
/// reboots through the BIOS (the kernel's default on hardware-reduced ACPI
/// without EFI) writes the FADT reset register instead:
/// `mov dx, RESET_PORT; mov al, RESET_VALUE; out dx, al; hlt; jmp $-1`.
pub const RESET_VECTOR_STUB: [u8; 9] = [
    0xba,
    (crate::acpi::RESET_PORT & 0xff) as u8,
    (crate::acpi::RESET_PORT >> 8) as u8,
    0xb0,
    crate::acpi::RESET_VALUE,
    0xee,
    0xf4,
    0xeb,
    0xfd,
];
/// Largest number of e820 entries the zero page holds.
const E820_MAX: usize = 128;

/// GDT: null, null, code (0x10 = __BOOT_CS), data (0x18 = __BOOT_DS), TSS (0x20).
pub const BOOT_CS: u16 = 0x10;
pub const BOOT_DS: u16 = 0x18;
pub const BOOT_TSS: u16 = 0x20;
const GDT_CODE64: u64 = gdt_entry(0xa09b, 0, 0xfffff);
const GDT_DATA: u64 = gdt_entry(0xc093, 0, 0xfffff);
const GDT_TSS: u64 = gdt_entry(0x808b, 0, 0xfffff);
pub const GDT: [u64; 5] = [0, 0, GDT_CODE64, GDT_DATA, GDT_TSS];

#[derive(Debug, thiserror::Error)]
pub enum BootError {
    #[error("cannot open {path}")]
    Open {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot load the kernel image")]
    Kernel(#[source] linux_loader::loader::Error),
    #[error("the kernel image has no setup header (not a bzImage?)")]
    NoSetupHeader,
    #[error("the command line is {len} bytes; this kernel takes at most {max}")]
    CmdlineTooLong { len: usize, max: usize },
    #[error("the command line contains a NUL byte")]
    CmdlineNul,
    #[error("the initramfs ({size} bytes) does not fit in low RAM above the kernel")]
    InitramfsTooLarge { size: u64 },
    #[error("cannot read the initramfs into guest memory")]
    Initramfs(#[source] vm_memory::GuestMemoryError),
    #[error("cannot write {what} to guest memory")]
    Write {
        what: &'static str,
        #[source]
        source: vm_memory::GuestMemoryError,
    },
    #[error("the e820 map has {0} entries, the zero page holds {E820_MAX}")]
    E820TooLong(usize),
}

/// Where a vCPU starts the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BootEntry {
    pub rip: u64,
    pub zero_page: u64,
    pub stack: u64,
    pub pml4: u64,
    pub gdt: u64,
    pub idt: u64,
}

/// What to boot.
#[derive(Debug, Clone)]
pub struct BootSpec<'a> {
    pub kernel: &'a Path,
    pub initramfs: &'a Path,
    pub cmdline: &'a str,
    pub rsdp_addr: u64,
}

/// An x86 segment descriptor from access/flags (`0xF0FF` mask), base and limit.
pub const fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    let base = base as u64;
    let limit = limit as u64;
    let flags = flags as u64;
    ((base & 0xff00_0000) << 32)
        | ((flags & 0xf0ff) << 40)
        | ((limit & 0x000f_0000) << 32)
        | ((base & 0x00ff_ffff) << 16)
        | (limit & 0xffff)
}

fn open(path: &Path) -> Result<File, BootError> {
    File::open(path).map_err(|source| BootError::Open {
        path: path.to_owned(),
        source,
    })
}

fn write(mem: &GuestMemory, what: &'static str, addr: u64, bytes: &[u8]) -> Result<(), BootError> {
    mem.write_slice(bytes, GuestAddress(addr))
        .map_err(|source| BootError::Write { what, source })
}

/// Where the initramfs goes: page-aligned, as high as low RAM and the
/// kernel's `initrd_addr_max` allow, never below `floor`.
pub fn initramfs_addr(size: u64, low_end: u64, addr_max: u64, floor: u64) -> Option<u64> {
    let top = low_end.min(addr_max.saturating_add(1));
    let addr = top.checked_sub(size)? & !0xfff;
    (addr >= floor).then_some(addr)
}

/// Identity page tables for the first 4 GiB with 2 MiB pages.
pub fn page_tables() -> (Vec<u8>, Vec<u8>, Vec<u8>) {
    const PRESENT_RW: u64 = 0x3;
    const HUGE: u64 = 0x80;
    let pml4: Vec<u8> = (PDPT_ADDR | PRESENT_RW).to_le_bytes().to_vec();
    let pdpt: Vec<u8> = (0..PD_COUNT)
        .flat_map(|i| ((PD_ADDR + i * 0x1000) | PRESENT_RW).to_le_bytes())
        .collect();
    let pd: Vec<u8> = (0..PD_COUNT * 512)
        .flat_map(|i| ((i << 21) | PRESENT_RW | HUGE).to_le_bytes())
        .collect();
    (pml4, pdpt, pd)
}

/// Fills the zero page from the image's setup header.
fn zero_page(
    hdr: linux_loader::loader::bootparam::setup_header,
    layout: &MemoryLayout,
    cmdline_len: usize,
    initramfs: (u64, u64),
    rsdp_addr: u64,
) -> Result<boot_params, BootError> {
    let mut params = boot_params {
        hdr,
        ..Default::default()
    };
    params.hdr.type_of_loader = LOADER_TYPE_UNDEFINED;
    params.hdr.cmd_line_ptr = CMDLINE_ADDR as u32;
    params.hdr.cmdline_size = cmdline_len as u32;
    params.hdr.ramdisk_image = initramfs.0 as u32;
    params.hdr.ramdisk_size = initramfs.1 as u32;
    params.acpi_rsdp_addr = rsdp_addr;
    let map = layout.e820();
    if map.len() > E820_MAX {
        return Err(BootError::E820TooLong(map.len()));
    }
    for (slot, e) in params.e820_table.iter_mut().zip(&map) {
        *slot = boot_e820_entry {
            addr: e.addr,
            size: e.size,
            r#type: e.kind as u32,
        };
    }
    params.e820_entries = map.len() as u8;
    Ok(params)
}

/// Loads kernel, initramfs and command line and writes every boot structure.
pub fn load(
    mem: &GuestMemory,
    layout: &MemoryLayout,
    spec: &BootSpec<'_>,
) -> Result<BootEntry, BootError> {
    let mut kernel = open(spec.kernel)?;
    let loaded = BzImage::load(mem, Some(GuestAddress(KERNEL_ADDR)), &mut kernel, None)
        .map_err(BootError::Kernel)?;
    let hdr = loaded.setup_header.ok_or(BootError::NoSetupHeader)?;

    // Command line.
    if spec.cmdline.as_bytes().contains(&0) {
        return Err(BootError::CmdlineNul);
    }
    let max = (hdr.cmdline_size as usize).min(CMDLINE_MAX - 1);
    let len = spec.cmdline.len();
    if len > max {
        return Err(BootError::CmdlineTooLong { len, max });
    }
    let mut cmdline = spec.cmdline.as_bytes().to_vec();
    cmdline.push(0);
    write(mem, "the command line", CMDLINE_ADDR, &cmdline)?;

    // Initramfs, above the kernel's decompression area.
    let mut initrd = open(spec.initramfs)?;
    let size = initrd
        .metadata()
        .map_err(|source| BootError::Open {
            path: spec.initramfs.to_owned(),
            source,
        })?
        .len();
    let floor = loaded
        .kernel_end
        .max(KERNEL_ADDR + u64::from(hdr.init_size));
    let addr = initramfs_addr(size, layout.low_end(), hdr.initrd_addr_max.into(), floor)
        .ok_or(BootError::InitramfsTooLarge { size })?;
    mem.read_exact_volatile_from(GuestAddress(addr), &mut initrd, size as usize)
        .map_err(BootError::Initramfs)?;

    let params = zero_page(hdr, layout, len, (addr, size), spec.rsdp_addr)?;
    mem.write_obj(params, GuestAddress(ZERO_PAGE_ADDR))
        .map_err(|source| BootError::Write {
            what: "the zero page",
            source,
        })?;

    let (pml4, pdpt, pd) = page_tables();
    write(mem, "the PML4", PML4_ADDR, &pml4)?;
    write(mem, "the PDPT", PDPT_ADDR, &pdpt)?;
    write(mem, "the page directories", PD_ADDR, &pd)?;
    let gdt: Vec<u8> = GDT.iter().flat_map(|e| e.to_le_bytes()).collect();
    write(mem, "the GDT", GDT_ADDR, &gdt)?;
    write(mem, "the IDT", IDT_ADDR, &[0u8; 8])?;
    write(
        mem,
        "the reset vector stub",
        RESET_VECTOR,
        &RESET_VECTOR_STUB,
    )?;

    Ok(BootEntry {
        rip: loaded.kernel_load.0 + STARTUP_64_OFFSET,
        zero_page: ZERO_PAGE_ADDR,
        stack: BOOT_STACK_TOP,
        pml4: PML4_ADDR,
        gdt: GDT_ADDR,
        idt: IDT_ADDR,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{GIB, MIB};

    #[test]
    fn gdt_entry_code64_matches_known_encoding() {
        assert_eq!(GDT_CODE64, 0x00af_9b00_0000_ffff);
        assert_eq!(GDT_DATA, 0x00cf_9300_0000_ffff);
    }

    #[test]
    fn reset_vector_stub_fits_below_1mib() {
        assert!(RESET_VECTOR + RESET_VECTOR_STUB.len() as u64 <= KERNEL_ADDR);
        assert_eq!(&RESET_VECTOR_STUB[..3], &[0xba, 0x02, 0x06]);
    }

    #[test]
    fn initramfs_addr_top_of_low_ram_page_aligned() {
        let a = initramfs_addr(0x1234, 128 * MIB, 0x7fff_ffff, 64 * MIB);
        assert_eq!(a, Some((128 * MIB - 0x1234) & !0xfff));
    }

    #[test]
    fn initramfs_addr_capped_by_initrd_addr_max() {
        let a = initramfs_addr(MIB, 3 * GIB, 0x7fff_ffff, 64 * MIB);
        assert_eq!(a, Some(2 * GIB - MIB));
    }

    #[test]
    fn initramfs_addr_too_large_none() {
        assert_eq!(
            initramfs_addr(100 * MIB, 128 * MIB, 0x7fff_ffff, 64 * MIB),
            None
        );
        assert_eq!(initramfs_addr(200 * MIB, 128 * MIB, 0x7fff_ffff, 0), None);
    }

    #[test]
    fn page_tables_identity_map_4gib() {
        let (pml4, pdpt, pd) = page_tables();
        assert_eq!(pml4.len(), 8);
        assert_eq!(pdpt.len(), 4 * 8);
        assert_eq!(pd.len(), 2048 * 8);
        let last = u64::from_le_bytes(pd[pd.len() - 8..].try_into().expect("8 bytes"));
        assert_eq!(last & !0xfff, 4 * GIB - 2 * MIB);
    }

    #[test]
    fn zero_page_carries_e820_and_pointers() {
        let layout = MemoryLayout::new(16 * GIB);
        let p = zero_page(
            Default::default(),
            &layout,
            10,
            (0x1000_0000, 0x2000),
            0xe0000,
        )
        .expect("fits");
        assert_eq!(p.e820_entries as usize, layout.e820().len());
        assert_eq!({ p.hdr.cmd_line_ptr }, CMDLINE_ADDR as u32);
        assert_eq!({ p.hdr.ramdisk_image }, 0x1000_0000);
        assert_eq!({ p.acpi_rsdp_addr }, 0xe0000);
        assert_eq!({ p.e820_table[3].addr }, 4 * GIB);
    }
}
