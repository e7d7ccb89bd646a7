//! What a read-only block device reads: one file, or a **layered disk**:
//! several files (an image's layers, bottom first) laid one after another
//! behind a GUID partition table, one partition per file, so the guest
//! sees them as `vda1`, `vda2`, ... on a single device (one queue, one
//! interrupt line, however many layers; the VM has 19 lines in all).
//!
//! The partition table is made here, in memory, at each start; the files
//! are read where they are, so every VM using a layer reads the same file
//! (and the host's page cache holds it once). The layout is a pure
//! function of the files' sizes: a restored or forked VM gets the same
//! disk its guest already read the table of.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

const SECTOR: u64 = 512;
/// Each partition starts on a 4 KiB boundary: the erofs block size and
/// the host's page size, so a guest page is one host page of one file.
const ALIGN: u64 = 4096;
/// Entries in each partition array: at least 128 (the UEFI minimum).
const MIN_ENTRIES: usize = 128;
const ENTRY_SIZE: usize = 128;
/// The most files a layered disk takes: the guest kernel's limit of
/// partitions per disk (255) less headroom.
pub const MAX_LAYERS: usize = 128;
/// "Linux filesystem data", as stored (its first three fields little-endian).
const LINUX_DATA: [u8; 16] = [
    0xaf, 0x3d, 0xc6, 0x0f, 0x83, 0x84, 0x72, 0x47, 0x8e, 0x79, 0x3d, 0x69, 0xd8, 0x47, 0x7d, 0xe4,
];

/// One stretch of the disk.
enum Backing {
    File(File),
    Bytes(Vec<u8>),
    Zeros,
}

struct Extent {
    start: u64,
    len: u64,
    backing: Backing,
}

/// A read-only disk: extents in order, covering `0..len` without gaps.
pub struct Disk {
    extents: Vec<Extent>,
    len: u64,
    layers: usize,
}

impl Disk {
    /// The disk that is `file`, its length rounded down to whole sectors.
    pub fn file(file: File) -> io::Result<Disk> {
        let len = file.metadata()?.len() / SECTOR * SECTOR;
        Ok(Disk {
            extents: vec![Extent {
                start: 0,
                len,
                backing: Backing::File(file),
            }],
            len,
            layers: 0,
        })
    }

    /// A layered disk: partition `i + 1` holds `files[i]` whole.
    pub fn layered(files: Vec<File>) -> io::Result<Disk> {
        if files.is_empty() || files.len() > MAX_LAYERS {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "a layered disk holds 1 to {MAX_LAYERS} files, not {}",
                    files.len()
                ),
            ));
        }
        let sizes = files
            .iter()
            .map(|f| f.metadata().map(|m| m.len()))
            .collect::<io::Result<Vec<u64>>>()?;
        let table = PartitionTable::new(&sizes);
        // Each extent starts where the one before it ends.
        let mut extents: Vec<Extent> = Vec::with_capacity(2 * files.len() + 3);
        let end = |extents: &[Extent]| extents.last().map_or(0, |e| e.start + e.len);
        let push = |extents: &mut Vec<Extent>, upto: u64, backing: Backing| {
            let start = end(extents);
            if upto > start {
                extents.push(Extent {
                    start,
                    len: upto - start,
                    backing,
                });
            }
        };
        let head_len = table.head.len() as u64;
        push(&mut extents, head_len, Backing::Bytes(table.head));
        for ((file, &start), &size) in files.into_iter().zip(&table.starts).zip(&sizes) {
            push(&mut extents, start, Backing::Zeros);
            push(&mut extents, start + size, Backing::File(file));
        }
        push(&mut extents, table.tail_start, Backing::Zeros);
        push(&mut extents, table.len, Backing::Bytes(table.tail));
        Ok(Disk {
            extents,
            len: table.len,
            layers: sizes.len(),
        })
    }

    /// Bytes, a whole number of sectors.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Partitions (0 for a plain file).
    pub fn layers(&self) -> usize {
        self.layers
    }

    /// Fills `buf` from `offset`; the range must lie inside the disk.
    pub fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let end = offset
            .checked_add(buf.len() as u64)
            .filter(|&e| e <= self.len)
            .ok_or_else(|| {
                io::Error::new(io::ErrorKind::UnexpectedEof, "read past the disk's end")
            })?;
        let mut at = offset;
        let first = self.extents.partition_point(|e| e.start + e.len <= offset);
        for extent in &self.extents[first..] {
            if at >= end {
                break;
            }
            let upto = end.min(extent.start + extent.len);
            let out = &mut buf[(at - offset) as usize..(upto - offset) as usize];
            let within = at - extent.start;
            match &extent.backing {
                Backing::File(f) => f.read_exact_at(out, within)?,
                Backing::Bytes(b) => out.copy_from_slice(&b[within as usize..][..out.len()]),
                Backing::Zeros => out.fill(0),
            }
            at = upto;
        }
        Ok(())
    }
}

/// The bytes of a GUID partition table for partitions of `sizes` bytes,
/// and where each partition starts.
struct PartitionTable {
    /// LBA 0 (a protective MBR), LBA 1 (the header), the entries.
    head: Vec<u8>,
    /// Byte offset of each partition.
    starts: Vec<u64>,
    /// The backup entries, then the backup header (the disk's last LBA).
    tail: Vec<u8>,
    tail_start: u64,
    len: u64,
}

impl PartitionTable {
    fn new(sizes: &[u64]) -> Self {
        let count = sizes.len().max(MIN_ENTRIES).next_multiple_of(4);
        let array_sectors = (count * ENTRY_SIZE) as u64 / SECTOR;
        let mut at = (2 + array_sectors) * SECTOR;
        let mut starts = Vec::with_capacity(sizes.len());
        let mut entries = vec![0u8; count * ENTRY_SIZE];
        let disk_guid = guid(sizes, u64::MAX);
        for (i, &size) in sizes.iter().enumerate() {
            let start = at.next_multiple_of(ALIGN);
            let sectors = size.div_ceil(SECTOR).max(1);
            let e = &mut entries[i * ENTRY_SIZE..][..ENTRY_SIZE];
            e[0..16].copy_from_slice(&LINUX_DATA);
            e[16..32].copy_from_slice(&guid(sizes, i as u64));
            e[32..40].copy_from_slice(&(start / SECTOR).to_le_bytes());
            e[40..48].copy_from_slice(&(start / SECTOR + sectors - 1).to_le_bytes());
            // Attribute bit 60: read-only.
            e[48..56].copy_from_slice(&(1u64 << 60).to_le_bytes());
            let name = format!("forkbox-layer-{}", i + 1);
            for (j, unit) in name.encode_utf16().take(36).enumerate() {
                e[56 + 2 * j..][..2].copy_from_slice(&unit.to_le_bytes());
            }
            starts.push(start);
            at = start + sectors * SECTOR;
        }
        let tail_start = at.next_multiple_of(ALIGN);
        let last_lba = tail_start / SECTOR + array_sectors;
        let len = (last_lba + 1) * SECTOR;
        let entries_crc = crc32fast::hash(&entries);
        let header = |mine: u64, other: u64, array: u64| {
            let mut h = vec![0u8; SECTOR as usize];
            h[0..8].copy_from_slice(b"EFI PART");
            h[8..12].copy_from_slice(&0x0001_0000u32.to_le_bytes());
            h[12..16].copy_from_slice(&92u32.to_le_bytes());
            h[24..32].copy_from_slice(&mine.to_le_bytes());
            h[32..40].copy_from_slice(&other.to_le_bytes());
            h[40..48].copy_from_slice(&(2 + array_sectors).to_le_bytes());
            h[48..56].copy_from_slice(&(last_lba - 1 - array_sectors).to_le_bytes());
            h[56..72].copy_from_slice(&disk_guid);
            h[72..80].copy_from_slice(&array.to_le_bytes());
            h[80..84].copy_from_slice(&(count as u32).to_le_bytes());
            h[84..88].copy_from_slice(&(ENTRY_SIZE as u32).to_le_bytes());
            h[88..92].copy_from_slice(&entries_crc.to_le_bytes());
            let crc = crc32fast::hash(&h[..92]);
            h[16..20].copy_from_slice(&crc.to_le_bytes());
            h
        };
        let mut head = protective_mbr(last_lba);
        head.extend(header(1, last_lba, 2));
        head.extend(&entries);
        let mut tail = entries;
        tail.extend(header(last_lba, 1, last_lba - array_sectors));
        PartitionTable {
            head,
            starts,
            tail,
            tail_start,
            len,
        }
    }
}

/// LBA 0: one partition of type 0xEE over the whole disk, as the UEFI
/// specification asks, so that MBR tools leave the disk alone.
fn protective_mbr(last_lba: u64) -> Vec<u8> {
    let mut mbr = vec![0u8; SECTOR as usize];
    let p = &mut mbr[446..462];
    p[1..4].copy_from_slice(&[0x00, 0x02, 0x00]);
    p[4] = 0xee;
    p[5..8].copy_from_slice(&[0xff, 0xff, 0xff]);
    p[8..12].copy_from_slice(&1u32.to_le_bytes());
    let size = u32::try_from(last_lba).unwrap_or(u32::MAX);
    p[12..16].copy_from_slice(&size.to_le_bytes());
    mbr[510] = 0x55;
    mbr[511] = 0xaa;
    mbr
}

/// A GUID that depends only on the sizes and `salt` (the disk's own, or a
/// partition's index): the same files make the same disk.
fn guid(sizes: &[u64], salt: u64) -> [u8; 16] {
    // FNV-1a over the sizes and the salt, twice with different seeds.
    let mix = |seed: u64| {
        let mut h = seed;
        for v in sizes.iter().chain([&salt]) {
            for b in v.to_le_bytes() {
                h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
            }
        }
        h
    };
    let mut g = [0u8; 16];
    g[..8].copy_from_slice(&mix(0xcbf2_9ce4_8422_2325).to_le_bytes());
    g[8..].copy_from_slice(&mix(0x6c62_272e_07bb_0142).to_le_bytes());
    // Version 4, variant 1, as a random GUID would be.
    g[7] = (g[7] & 0x0f) | 0x40;
    g[8] = (g[8] & 0x3f) | 0x80;
    g
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn file(bytes: &[u8]) -> File {
        let mut f = tempfile_in_tmp();
        f.write_all(bytes).expect("write");
        f
    }

    fn tempfile_in_tmp() -> File {
        let path = std::env::temp_dir().join(format!(
            "forkbox-disk-test-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        let f = File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .expect("create");
        std::fs::remove_file(&path).expect("unlink");
        f
    }

    static COUNTER: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

    fn read(disk: &Disk, offset: u64, len: usize) -> Vec<u8> {
        let mut buf = vec![0xaa; len];
        disk.read_exact_at(&mut buf, offset).expect("read");
        buf
    }

    #[test]
    fn layered_disk_places_each_file_at_its_partition_and_zeros_between() {
        let a: Vec<u8> = (0..10_000u32).map(|i| i as u8).collect();
        let b = vec![7u8; 8192];
        let table = PartitionTable::new(&[a.len() as u64, b.len() as u64]);
        let disk = Disk::layered(vec![file(&a), file(&b)]).expect("disk");
        assert_eq!(disk.len(), table.len);
        assert_eq!(disk.layers(), 2);
        assert!(table.starts.iter().all(|s| s % ALIGN == 0));
        assert_eq!(read(&disk, table.starts[0], a.len()), a);
        assert_eq!(read(&disk, table.starts[1], b.len()), b);
        // The sector tail of `a` and the alignment gap read as zeros.
        let gap = table.starts[1] - table.starts[0] - a.len() as u64;
        assert_eq!(
            read(&disk, table.starts[0] + a.len() as u64, gap as usize),
            vec![0; gap as usize]
        );
        // One read across a file's end, the gap and the next file.
        let across = read(&disk, table.starts[1] - 100, 200);
        assert_eq!(&across[..100], &vec![0; 100][..]);
        assert_eq!(&across[100..], &b[..100]);
        // The whole disk in one read equals its pieces.
        let whole = read(&disk, 0, disk.len() as usize);
        assert_eq!(&whole[..table.head.len()], &table.head[..]);
        assert_eq!(&whole[table.tail_start as usize..], &table.tail[..]);
        let mut past = [0u8; 2];
        assert!(disk.read_exact_at(&mut past, disk.len() - 1).is_err());
        assert!(disk.read_exact_at(&mut past, u64::MAX).is_err());
    }

    #[test]
    fn partition_table_headers_and_entries_carry_valid_checksums() {
        let t = PartitionTable::new(&[4096, 1]);
        let last_lba = t.len / SECTOR - 1;
        let primary = &t.head[512..1024];
        let backup = &t.tail[t.tail.len() - 512..];
        for (h, mine, other) in [(primary, 1, last_lba), (backup, last_lba, 1)] {
            assert_eq!(&h[0..8], b"EFI PART");
            let mut zeroed = h[..92].to_vec();
            zeroed[16..20].fill(0);
            assert_eq!(h[16..20], crc32fast::hash(&zeroed).to_le_bytes());
            assert_eq!(u64::from_le_bytes(h[24..32].try_into().expect("8")), mine);
            assert_eq!(u64::from_le_bytes(h[32..40].try_into().expect("8")), other);
            let array = &t.head[1024..1024 + MIN_ENTRIES * ENTRY_SIZE];
            assert_eq!(h[88..92], crc32fast::hash(array).to_le_bytes());
        }
        assert_eq!(&t.head[510..512], &[0x55, 0xaa]);
        assert_eq!(t.head[446 + 4], 0xee);
        // Entry 2: one byte rounds up to one sector.
        let e = &t.head[1024 + ENTRY_SIZE..][..ENTRY_SIZE];
        let first = u64::from_le_bytes(e[32..40].try_into().expect("8"));
        let last = u64::from_le_bytes(e[40..48].try_into().expect("8"));
        assert_eq!((first * SECTOR, last), (t.starts[1], first));
        assert_eq!(
            t.tail_start + t.tail.len() as u64,
            t.len,
            "the backup header is the last sector"
        );
    }

    #[test]
    fn layered_disk_refuses_no_files_and_too_many() {
        assert!(Disk::layered(Vec::new()).is_err());
        let many = (0..=MAX_LAYERS).map(|_| file(b"x")).collect();
        assert!(Disk::layered(many).is_err());
    }

    #[test]
    fn plain_disk_is_the_file_rounded_down_to_sectors() {
        let data = vec![3u8; 1500];
        let disk = Disk::file(file(&data)).expect("disk");
        assert_eq!((disk.len(), disk.layers()), (1024, 0));
        assert_eq!(read(&disk, 512, 512), vec![3; 512]);
    }
}
