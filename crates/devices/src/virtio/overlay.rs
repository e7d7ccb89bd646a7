//! A writable disk that forks: a read-only **base** (a golden volume),
//! the **frozen** layers of writes made before earlier forks (shared, read
//! only, with every relative forked since), and this VM's own **top**, where
//! its writes go. Each is a file the size of the disk holding its blocks
//! at their own offsets (sparse: only written blocks take host disk); a
//! map says, per 4 KiB block, which of them holds the block's newest bytes.
//!
//! A fork captures memory and disk at one instant by construction: the
//! VMM is paused and serves no request while it forks, the parent's top
//! becomes a frozen layer ([`Overlay::freeze`]), and the parent and every
//! child go on with a new, empty top each. The map lives in the VMM's heap,
//! which a fork child inherits copy-on-write with the guest's RAM, so a
//! child starts with its parent's map at no cost. A reset (a new fork of
//! the zygote) copies nothing.
//!
//! Tops and frozen layers are files no path names (the host opens them
//! with `O_TMPFILE`, or unlinks them at once): their blocks are freed when
//! the last VMM holding them ends, so nothing of a dead sandbox's disk
//! remains.
//!
//! A flushed write survives as long as the VM: a write is in the host's
//! page cache when the request completes, and the VMM's own end does not
//! lose it; a host crash ends every sandbox with it, so a flush needs no
//! `fsync` (a snapshot syncs its files).
//!
//! The top's page cache is charged to the VMM's cgroup, whose memory
//! limit also holds the guest's RAM: a guest writing faster than the
//! host's disk takes it would fill that limit with dirty pages, and the
//! kernel ended the VMM (measured: 1 GiB written by a 512 MiB guest). So
//! after every [`WRITEBACK_EVERY`] bytes the top is told it will not be
//! needed (`POSIX_FADV_DONTNEED`): its dirty pages go to the disk at once,
//! and the clean ones are let go.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::OnceLock;

/// The unit the map tracks: a guest's write smaller than this copies the
/// rest of its block up from below first.
pub const BLOCK: u64 = 4096;
/// Frozen layers at most: the map stores a layer's index in a byte (0 is
/// the base, the top is one above the last frozen layer).
pub const MAX_FROZEN: usize = 254;
/// Bytes written to a top between two writebacks of its page cache.
pub const WRITEBACK_EVERY: u64 = 8 << 20;

/// Host write failures (a full host disk) of this process's writable
/// disks, for the VMM's counters: the guest saw an I/O error for each.
pub static HOST_WRITE_ERRORS: AtomicU64 = AtomicU64::new(0);
/// The first host write failure of this process's writable disks.
static HOST_WRITE_FAILURE: OnceLock<String> = OnceLock::new();

/// The first host write failure of this process's writable disks, if one
/// failed: the guest's file system lost a write it was told of as an I/O
/// error, through no fault of its own, and the VMM ends the VM for it.
pub fn host_write_failure() -> Option<&'static str> {
    HOST_WRITE_FAILURE.get().map(String::as_str)
}

/// Bytes this process's writable disks took into their tops.
pub static BYTES_WRITTEN: AtomicU64 = AtomicU64::new(0);

/// Why an overlay could not be made or frozen.
#[derive(Debug, thiserror::Error)]
pub enum OverlayError {
    #[error("the golden volume is {0} bytes: a writable disk is a whole number of 4 KiB blocks, at least one")]
    BadSize(u64),
    #[error("cannot size a layer file")]
    Io(#[source] io::Error),
    #[error("the disk has {MAX_FROZEN} layers of writes made before forks already: fork from a sandbox nearer its template")]
    TooDeep,
    #[error("a saved run of blocks {start}+{count} is past the disk's {blocks} blocks")]
    SavedRun { start: u64, count: u64, blocks: u64 },
}

/// A run of blocks: `start` and how many.
pub type Run = (u64, u64);

/// One writable disk (see the module's documentation).
#[derive(Debug)]
pub struct Overlay {
    base: File,
    frozen: Vec<File>,
    top: File,
    /// Blocks the top holds.
    top_blocks: u64,
    /// Bytes written to the top since its page cache was last written back.
    unwritten: u64,
    /// Per block, the layer holding it: 0 the base, `i` frozen layer `i - 1`,
    /// `frozen.len() + 1` the top. Allocated zeroed, so only the pages
    /// covering written blocks are resident.
    map: Vec<u8>,
    len: u64,
}

impl Overlay {
    /// A disk that is `base` (opened to read) until written; its writes go
    /// to `top`, an empty file opened to read and write, sized here.
    pub fn new(base: File, top: File) -> Result<Overlay, OverlayError> {
        let len = base.metadata().map_err(OverlayError::Io)?.len();
        if len == 0 || !len.is_multiple_of(BLOCK) {
            return Err(OverlayError::BadSize(len));
        }
        sized(&top, len)?;
        Ok(Overlay {
            base,
            frozen: Vec::new(),
            top,
            top_blocks: 0,
            unwritten: 0,
            map: vec![0; (len / BLOCK) as usize],
            len,
        })
    }

    /// A disk restored from a snapshot: `base`, then `saved` (what
    /// [`Overlay::save`] wrote) holding `runs` as one frozen layer, then
    /// the empty `top`.
    pub fn restored(
        base: File,
        saved: File,
        runs: &[Run],
        top: File,
    ) -> Result<Overlay, OverlayError> {
        let mut disk = Overlay::new(base, top)?;
        let blocks = disk.map.len() as u64;
        for &(start, count) in runs {
            let end = start.checked_add(count).filter(|&e| e <= blocks);
            let Some(end) = end else {
                return Err(OverlayError::SavedRun {
                    start,
                    count,
                    blocks,
                });
            };
            disk.map[start as usize..end as usize].fill(1);
        }
        disk.frozen.push(saved);
        // The top's index is one above the frozen layer now.
        Ok(disk)
    }

    /// Bytes, a whole number of blocks.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Layers of writes under the top.
    pub fn frozen(&self) -> usize {
        self.frozen.len()
    }

    /// Blocks this VM wrote since its last fork (or start).
    pub fn top_blocks(&self) -> u64 {
        self.top_blocks
    }

    fn top_index(&self) -> u8 {
        // At most MAX_FROZEN + 1 = 255.
        (self.frozen.len() + 1) as u8
    }

    fn layer(&self, index: u8) -> &File {
        match index {
            0 => &self.base,
            i if usize::from(i) <= self.frozen.len() => &self.frozen[usize::from(i) - 1],
            _ => &self.top,
        }
    }

    fn check(&self, len: usize, offset: u64) -> io::Result<u64> {
        offset
            .checked_add(len as u64)
            .filter(|&end| end <= self.len)
            .ok_or_else(|| io::Error::new(io::ErrorKind::UnexpectedEof, "past the disk's end"))
    }

    /// Fills `buf` from `offset`: each stretch from the layer holding it.
    pub fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let end = self.check(buf.len(), offset)?;
        let mut at = offset;
        while at < end {
            let index = self.map[(at / BLOCK) as usize];
            // The stretch of blocks from `at` held by the same layer.
            let mut upto = (at / BLOCK + 1) * BLOCK;
            while upto < end && self.map[(upto / BLOCK) as usize] == index {
                upto += BLOCK;
            }
            let upto = upto.min(end);
            let out = &mut buf[(at - offset) as usize..(upto - offset) as usize];
            self.layer(index).read_exact_at(out, at)?;
            at = upto;
        }
        Ok(())
    }

    /// Writes `buf` at `offset` into the top. A block it covers only in
    /// part is first copied up whole from the layer holding it. On a host
    /// error (a full disk) the map is unchanged for the blocks not written.
    pub fn write_all_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
        let result = self.write_inner(buf, offset);
        match &result {
            Ok(()) => {
                BYTES_WRITTEN.fetch_add(buf.len() as u64, Relaxed);
                self.unwritten += buf.len() as u64;
                if self.unwritten >= WRITEBACK_EVERY {
                    self.write_back();
                }
            }
            // Past the end is the guest's request, refused before any write.
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {}
            Err(e) => {
                HOST_WRITE_ERRORS.fetch_add(1, Relaxed);
                let _ = HOST_WRITE_FAILURE.set(e.to_string());
            }
        }
        result
    }

    fn write_inner(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
        let end = self.check(buf.len(), offset)?;
        if buf.is_empty() {
            return Ok(());
        }
        let (first, last) = (offset / BLOCK, (end - 1) / BLOCK);
        let top = self.top_index();
        // Partly covered edge blocks come up whole first.
        let partial_head = !offset.is_multiple_of(BLOCK);
        let partial_tail = !end.is_multiple_of(BLOCK);
        for (block, partial) in [(first, partial_head), (last, partial_tail)] {
            if partial && self.map[block as usize] != top {
                let mut whole = vec![0u8; BLOCK as usize];
                self.read_exact_at(&mut whole, block * BLOCK)?;
                self.top.write_all_at(&whole, block * BLOCK)?;
                self.mark(block);
            }
        }
        self.top.write_all_at(buf, offset)?;
        for block in first..=last {
            self.mark(block);
        }
        Ok(())
    }

    /// Starts writing the top's dirty pages to the host's disk and lets
    /// its clean ones go (see the module's documentation). Advice: a
    /// failure changes nothing the guest sees.
    pub fn write_back(&mut self) {
        self.unwritten = 0;
        let _ = rustix::fs::fadvise(&self.top, 0, None, rustix::fs::Advice::DontNeed);
    }

    fn mark(&mut self, block: u64) {
        let top = self.top_index();
        let entry = &mut self.map[block as usize];
        if *entry != top {
            *entry = top;
            self.top_blocks += 1;
        }
    }

    /// At a fork, in the paused parent: the top, if it holds anything,
    /// becomes a frozen layer its children share, and `new_top` (an empty
    /// file) is this VM's top from now on. A top with nothing in it stays
    /// (`new_top` is dropped): the children's frozen layers are the same.
    pub fn freeze(&mut self, new_top: File) -> Result<(), OverlayError> {
        if self.top_blocks == 0 {
            return Ok(());
        }
        if self.frozen.len() >= MAX_FROZEN {
            return Err(OverlayError::TooDeep);
        }
        sized(&new_top, self.len)?;
        let old = std::mem::replace(&mut self.top, new_top);
        self.frozen.push(old);
        self.top_blocks = 0;
        Ok(())
    }

    /// In a fork child, whose parent froze its top before the fork: the
    /// same layers and map, and `top` (an empty file) as its own top.
    pub fn with_top(&mut self, top: File) -> Result<(), OverlayError> {
        sized(&top, self.len)?;
        self.top = top;
        self.top_blocks = 0;
        Ok(())
    }

    /// Every file it reads or writes: the base, the frozen layers, the top
    /// (a fork child keeps them open).
    pub fn files(&self) -> impl Iterator<Item = &File> {
        std::iter::once(&self.base)
            .chain(&self.frozen)
            .chain(std::iter::once(&self.top))
    }

    /// Writes every block not the base's into `out` (an empty file), at
    /// its own offset, and returns their runs: what [`Overlay::restored`]
    /// takes back.
    pub fn save(&self, out: &File) -> io::Result<Vec<Run>> {
        out.set_len(self.len)?;
        let mut runs: Vec<Run> = Vec::new();
        let mut buf = vec![0u8; 1 << 20];
        let blocks = self.map.len() as u64;
        let mut block = 0u64;
        while block < blocks {
            if self.map[block as usize] == 0 {
                block += 1;
                continue;
            }
            let start = block;
            while block < blocks
                && self.map[block as usize] != 0
                && (block - start + 1) * BLOCK <= buf.len() as u64
            {
                block += 1;
            }
            let bytes = &mut buf[..((block - start) * BLOCK) as usize];
            self.read_exact_at(bytes, start * BLOCK)?;
            out.write_all_at(bytes, start * BLOCK)?;
            match runs.last_mut() {
                Some((s, n)) if *s + *n == start => *n += block - start,
                _ => runs.push((start, block - start)),
            }
        }
        out.sync_all()?;
        Ok(runs)
    }
}

/// Makes `file` `len` bytes long (sparse), unless it is already.
fn sized(file: &File, len: u64) -> Result<(), OverlayError> {
    if file.metadata().map_err(OverlayError::Io)?.len() != len {
        file.set_len(len).map_err(OverlayError::Io)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file_with(bytes: &[u8]) -> File {
        let f = tempfile::tempfile().expect("tempfile");
        f.write_all_at(bytes, 0).expect("write");
        f
    }

    /// A base of `blocks` blocks, block i filled with byte i.
    fn base(blocks: u64) -> (File, Vec<u8>) {
        let data: Vec<u8> = (0..blocks * BLOCK).map(|i| (i / BLOCK) as u8).collect();
        (file_with(&data), data)
    }

    fn read(disk: &Overlay, offset: u64, len: usize) -> Vec<u8> {
        let mut buf = vec![0u8; len];
        disk.read_exact_at(&mut buf, offset).expect("read");
        buf
    }

    fn blocks_allocated(f: &File) -> u64 {
        use std::os::unix::fs::MetadataExt;
        f.metadata().expect("metadata").blocks() * 512
    }

    #[test]
    fn overlay_reads_the_base_until_written_then_the_writes_and_never_changes_the_base() {
        let (b, mut want) = base(8);
        let base_copy = b.try_clone().expect("dup");
        let mut disk = Overlay::new(b, tempfile::tempfile().expect("top")).expect("overlay");
        assert_eq!(read(&disk, 0, want.len()), want);
        // Whole blocks, a partial block, a write across a block boundary.
        for (offset, len, byte) in [
            (BLOCK, BLOCK as usize, 0xaa),
            (3 * BLOCK + 100, 10, 0xbb),
            (5 * BLOCK - 7, 20, 0xcc),
        ] {
            disk.write_all_at(&vec![byte; len], offset).expect("write");
            want[offset as usize..offset as usize + len].fill(byte);
        }
        assert_eq!(read(&disk, 0, want.len()), want);
        assert_eq!(disk.top_blocks(), 4, "blocks 1, 3, 4, 5");
        let mut original = vec![0u8; 8 * BLOCK as usize];
        base_copy.read_exact_at(&mut original, 0).expect("base");
        assert_eq!(original, base(8).1, "the base is never written");
        assert!(disk.write_all_at(&[1], 8 * BLOCK).is_err(), "past the end");
        assert!(disk.read_exact_at(&mut [0u8; 2], 8 * BLOCK - 1).is_err());
    }

    /// What a fork does: the parent freezes, the child is a copy with its
    /// own top; each sees the common past and only its own writes after.
    #[test]
    fn overlay_frozen_at_a_fork_gives_parent_and_child_the_same_past_and_their_own_future() {
        let (b, mut past) = base(16);
        let mut parent = Overlay::new(b, tempfile::tempfile().expect("top")).expect("overlay");
        parent.write_all_at(&[7; 4096], 2 * BLOCK).expect("write");
        past[2 * BLOCK as usize..3 * BLOCK as usize].fill(7);
        parent
            .freeze(tempfile::tempfile().expect("new top"))
            .expect("freeze");
        assert_eq!(parent.frozen(), 1);
        // The child: the parent's struct as fork() copies it, another top.
        let mut child = Overlay {
            base: parent.base.try_clone().expect("dup"),
            frozen: parent
                .frozen
                .iter()
                .map(|f| f.try_clone().expect("dup"))
                .collect(),
            top: parent.top.try_clone().expect("dup"),
            top_blocks: parent.top_blocks,
            unwritten: 0,
            map: parent.map.clone(),
            len: parent.len,
        };
        child
            .with_top(tempfile::tempfile().expect("child top"))
            .expect("top");
        parent
            .write_all_at(&[1; 100], 2 * BLOCK + 50)
            .expect("parent writes");
        child
            .write_all_at(&[2; 4096], 9 * BLOCK)
            .expect("child writes");
        let mut p = past.clone();
        p[2 * BLOCK as usize + 50..2 * BLOCK as usize + 150].fill(1);
        let mut c = past.clone();
        c[9 * BLOCK as usize..10 * BLOCK as usize].fill(2);
        assert_eq!(read(&parent, 0, p.len()), p);
        assert_eq!(read(&child, 0, c.len()), c);
        // A second fork of a parent that wrote nothing since keeps its top.
        let mut idle = Overlay::new(base(4).0, tempfile::tempfile().expect("top")).expect("o");
        idle.freeze(tempfile::tempfile().expect("unused"))
            .expect("freeze");
        assert_eq!(idle.frozen(), 0, "an empty top is not frozen");
    }

    #[test]
    fn overlay_tops_hold_only_the_blocks_written() {
        let blocks = 4096; // 16 MiB
        let b = tempfile::tempfile().expect("base");
        b.set_len(blocks * BLOCK).expect("size");
        let top = tempfile::tempfile().expect("top");
        let probe = top.try_clone().expect("dup");
        let mut disk = Overlay::new(b, top).expect("overlay");
        disk.write_all_at(&[9; 8192], 1000 * BLOCK).expect("write");
        let held = blocks_allocated(&probe);
        assert!(
            held <= 64 * 1024,
            "a 16 MiB disk's top holds {held} bytes after 8 KiB"
        );
        assert_eq!(probe.metadata().expect("meta").len(), blocks * BLOCK);
    }

    #[test]
    fn overlay_saved_and_restored_reads_the_same() {
        let (b, mut want) = base(32);
        let b2 = b.try_clone().expect("dup");
        let mut disk = Overlay::new(b, tempfile::tempfile().expect("top")).expect("overlay");
        for (block, byte) in [(0u64, 0x11u8), (1, 0x12), (7, 0x17), (31, 0x1f)] {
            disk.write_all_at(&[byte; 4096], block * BLOCK)
                .expect("write");
            want[(block * BLOCK) as usize..((block + 1) * BLOCK) as usize].fill(byte);
        }
        disk.freeze(tempfile::tempfile().expect("t2"))
            .expect("freeze");
        disk.write_all_at(&[0x33; 4096], 7 * BLOCK)
            .expect("over a frozen block");
        want[(7 * BLOCK) as usize..(8 * BLOCK) as usize].fill(0x33);
        let saved = tempfile::tempfile().expect("saved");
        let runs = disk.save(&saved).expect("save");
        assert_eq!(runs, vec![(0, 2), (7, 1), (31, 1)]);
        let back = Overlay::restored(b2, saved, &runs, tempfile::tempfile().expect("t"))
            .expect("restored");
        assert_eq!(read(&back, 0, want.len()), want);
        assert_eq!(back.frozen(), 1);
        let bad = Overlay::restored(
            base(4).0,
            tempfile::tempfile().expect("s"),
            &[(3, 2)],
            tempfile::tempfile().expect("t"),
        );
        assert!(matches!(bad, Err(OverlayError::SavedRun { .. })), "{bad:?}");
        let odd = Overlay::new(file_with(&[1; 1000]), tempfile::tempfile().expect("t"));
        assert!(matches!(odd, Err(OverlayError::BadSize(1000))));
    }

    #[test]
    fn overlay_forks_past_its_depth_are_refused() {
        let mut disk = Overlay::new(base(2).0, tempfile::tempfile().expect("top")).expect("o");
        for i in 0..MAX_FROZEN {
            disk.write_all_at(&[i as u8; 4096], 0).expect("write");
            disk.freeze(tempfile::tempfile().expect("top"))
                .expect("freeze");
        }
        disk.write_all_at(&[0xee; 4096], BLOCK).expect("write");
        assert!(matches!(
            disk.freeze(tempfile::tempfile().expect("t")),
            Err(OverlayError::TooDeep)
        ));
        assert_eq!(read(&disk, 0, 1)[0], (MAX_FROZEN - 1) as u8);
        assert_eq!(read(&disk, BLOCK, 1)[0], 0xee, "the top still takes writes");
    }
}
