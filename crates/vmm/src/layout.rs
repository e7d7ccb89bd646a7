//! Guest-physical memory layout: where RAM, the MMIO hole, boot structures,
//! ACPI tables and virtio-mmio windows live, and the e820 map that tells the
//! guest kernel. Pure data: no KVM, no mappings.

/// 1 MiB.
pub const MIB: u64 = 1 << 20;
/// 1 GiB.
pub const GIB: u64 = 1 << 30;

/// Start of the 32-bit MMIO hole; RAM beyond this continues at 4 GiB.
pub const MMIO_HOLE_START: u64 = 0xC000_0000;
/// First address above the 32-bit MMIO hole.
pub const HIGH_RAM_START: u64 = 1 << 32;

/// GDT used for the 64-bit entry.
pub const GDT_ADDR: u64 = 0x500;
/// An empty IDT: the kernel installs its own before enabling interrupts.
pub const IDT_ADDR: u64 = 0x520;
/// `struct boot_params`, the "zero page".
pub const ZERO_PAGE_ADDR: u64 = 0x7000;
/// Top of the stack the kernel's entry code starts on.
pub const BOOT_STACK_TOP: u64 = 0x8ff0;
/// Identity page tables: PML4, one PDPT, four page directories (4 GiB of 2 MiB pages).
pub const PML4_ADDR: u64 = 0x9000;
pub const PDPT_ADDR: u64 = 0xA000;
pub const PD_ADDR: u64 = 0xB000;
pub const PD_COUNT: u64 = 4;
/// Kernel command line (NUL-terminated).
pub const CMDLINE_ADDR: u64 = 0x2_0000;
/// Upper bound on the command line we place, whatever the kernel allows.
pub const CMDLINE_MAX: usize = 0x1_0000;
/// End of conventional low memory the guest may use (EBDA starts here).
pub const EBDA_START: u64 = 0x9_FC00;
/// The BIOS area the kernel scans for the RSDP; we keep all ACPI tables here.
pub const ACPI_START: u64 = 0xE_0000;
pub const ACPI_END: u64 = 0x10_0000;
/// Where the protected-mode part of the bzImage is loaded.
pub const KERNEL_ADDR: u64 = 0x10_0000;

/// KVM's TSS and identity-map pages (needed on Intel), inside the MMIO hole.
pub const KVM_TSS_ADDR: u64 = 0xFFFB_D000;
pub const KVM_IDENTITY_MAP_ADDR: u64 = 0xFFFB_C000;

/// Local APIC and I/O APIC (the in-kernel irqchip answers at these).
pub const LAPIC_ADDR: u32 = 0xFEE0_0000;
pub const IOAPIC_ADDR: u32 = 0xFEC0_0000;

/// virtio-mmio windows: `VIRTIO_MMIO_BASE + i * VIRTIO_MMIO_SIZE`, GSI `VIRTIO_GSI_BASE + i`.
pub const VIRTIO_MMIO_BASE: u64 = 0xD000_0000;
pub const VIRTIO_MMIO_SIZE: u64 = 0x1000;
pub const VIRTIO_GSI_BASE: u32 = 5;
/// The in-kernel IOAPIC has 24 pins: GSIs 5..=23.
pub const MAX_VIRTIO_DEVICES: usize = 19;
/// Offset of QueueNotify in a virtio-mmio window.
pub const VIRTIO_MMIO_QUEUE_NOTIFY: u64 = 0x50;

/// COM1's I/O base (8 ports).
pub const COM1_PORT: u16 = 0x3f8;
/// The serial port's GSI (COM1).
pub const SERIAL_GSI: u32 = 4;

/// One virtio-mmio window and its interrupt line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VirtioWindow {
    pub base: u64,
    pub size: u64,
    pub gsi: u32,
}

impl VirtioWindow {
    /// The window of the `index`-th virtio device.
    pub fn nth(index: usize) -> Option<Self> {
        if index >= MAX_VIRTIO_DEVICES {
            return None;
        }
        Some(Self {
            base: VIRTIO_MMIO_BASE + index as u64 * VIRTIO_MMIO_SIZE,
            size: VIRTIO_MMIO_SIZE,
            gsi: VIRTIO_GSI_BASE + index as u32,
        })
    }

    pub fn contains(&self, addr: u64) -> bool {
        addr >= self.base && addr < self.base + self.size
    }
}

/// A range of guest RAM: `[start, start + size)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RamRange {
    pub start: u64,
    pub size: u64,
}

impl RamRange {
    pub fn end(&self) -> u64 {
        self.start + self.size
    }
}

/// e820 entry types the guest understands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum E820Kind {
    Ram = 1,
    Reserved = 2,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct E820Entry {
    pub addr: u64,
    pub size: u64,
    pub kind: E820Kind,
}

/// Guest RAM placement for a given memory size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryLayout {
    /// RAM below the MMIO hole, starting at 0.
    pub low: RamRange,
    /// RAM above 4 GiB, if the size does not fit below the hole.
    pub high: Option<RamRange>,
}

impl MemoryLayout {
    /// Splits `size` bytes of RAM around the 32-bit MMIO hole.
    pub fn new(size: u64) -> Self {
        let low_size = size.min(MMIO_HOLE_START);
        let high = (size > low_size).then(|| RamRange {
            start: HIGH_RAM_START,
            size: size - low_size,
        });
        Self {
            low: RamRange {
                start: 0,
                size: low_size,
            },
            high,
        }
    }

    /// Every RAM range, low first.
    pub fn ranges(&self) -> Vec<RamRange> {
        std::iter::once(self.low).chain(self.high).collect()
    }

    pub fn total(&self) -> u64 {
        self.low.size + self.high.map_or(0, |h| h.size)
    }

    /// First address past low RAM: the initramfs goes just below it.
    pub fn low_end(&self) -> u64 {
        self.low.end()
    }

    /// The e820 map handed to the kernel in the zero page.
    pub fn e820(&self) -> Vec<E820Entry> {
        let mut map = vec![
            E820Entry {
                addr: 0,
                size: EBDA_START,
                kind: E820Kind::Ram,
            },
            E820Entry {
                addr: ACPI_START,
                size: ACPI_END - ACPI_START,
                kind: E820Kind::Reserved,
            },
            E820Entry {
                addr: KERNEL_ADDR,
                size: self.low.end() - KERNEL_ADDR,
                kind: E820Kind::Ram,
            },
        ];
        if let Some(high) = self.high {
            map.push(E820Entry {
                addr: high.start,
                size: high.size,
                kind: E820Kind::Ram,
            });
        }
        map
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ram_total(map: &[E820Entry]) -> u64 {
        map.iter()
            .filter(|e| e.kind == E820Kind::Ram)
            .map(|e| e.size)
            .sum()
    }

    fn assert_sorted_disjoint(map: &[E820Entry]) {
        for pair in map.windows(2) {
            assert!(pair[0].addr + pair[0].size <= pair[1].addr, "{map:?}");
        }
    }

    #[test]
    fn layout_128mib_all_low() {
        let l = MemoryLayout::new(128 * MIB);
        assert_eq!(l.low.size, 128 * MIB);
        assert_eq!(l.high, None);
        let map = l.e820();
        assert_sorted_disjoint(&map);
        assert_eq!(map.last().map(|e| e.addr + e.size), Some(128 * MIB));
        // Everything but the [EBDA, 1 MiB) gap is RAM.
        assert_eq!(ram_total(&map), 128 * MIB - (KERNEL_ADDR - EBDA_START));
    }

    #[test]
    fn layout_3gib_exactly_fills_low() {
        let l = MemoryLayout::new(3 * GIB);
        assert_eq!(l.low_end(), MMIO_HOLE_START);
        assert_eq!(l.high, None);
        assert_eq!(l.total(), 3 * GIB);
        assert_sorted_disjoint(&l.e820());
    }

    #[test]
    fn layout_16gib_splits_around_hole() {
        let l = MemoryLayout::new(16 * GIB);
        assert_eq!(l.low_end(), MMIO_HOLE_START);
        assert_eq!(
            l.high,
            Some(RamRange {
                start: HIGH_RAM_START,
                size: 13 * GIB
            })
        );
        assert_eq!(l.total(), 16 * GIB);
        let map = l.e820();
        assert_sorted_disjoint(&map);
        assert_eq!(map.last().map(|e| e.addr + e.size), Some(17 * GIB));
        assert_eq!(ram_total(&map), 16 * GIB - (KERNEL_ADDR - EBDA_START));
    }

    #[test]
    fn e820_acpi_area_reserved_for_every_size() {
        for size in [128 * MIB, 3 * GIB, 16 * GIB] {
            let map = MemoryLayout::new(size).e820();
            assert!(map
                .iter()
                .any(|e| e.addr == ACPI_START && e.kind == E820Kind::Reserved));
        }
    }

    #[test]
    fn virtio_window_nth_beyond_ioapic_pins_none() {
        assert_eq!(
            VirtioWindow::nth(0),
            Some(VirtioWindow {
                base: 0xD000_0000,
                size: 0x1000,
                gsi: 5
            })
        );
        assert_eq!(VirtioWindow::nth(18).map(|w| w.gsi), Some(23));
        assert_eq!(VirtioWindow::nth(19), None);
    }
}
