//! virtio-blk (virtio 1.x §5.2): read-only over a host file, or several
//! behind a partition table ([`Disk`]); or writable over an [`Overlay`].
//!
//! Image layers are read-only and shared by every fork, so such a device
//! offers `VIRTIO_BLK_F_RO`, answers IN, GET_ID and FLUSH, and fails OUT
//! with IOERR. A writable disk answers OUT too, offers FLUSH (a no-op: see
//! [`Overlay`]) and 4 KiB logical blocks (its map's unit, so a guest's
//! writes need no copy-up). It is driven only by queue notifications (no
//! host events).
//!
//! Reads use `pread` (positionless, so a forked child sharing the open file
//! description cannot move our offset) into a bounded bounce buffer, then
//! copy into guest memory: this keeps the crate free of `unsafe`.

use std::borrow::Cow;
use std::fs::File;
use std::io;
use std::os::fd::RawFd;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::{Arc, Mutex};

use super::disk::Disk;
use super::overlay::Overlay;
use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_F_BLK_SIZE, VIRTIO_BLK_F_FLUSH, VIRTIO_BLK_F_RO, VIRTIO_BLK_F_SEG_MAX,
    VIRTIO_BLK_F_SIZE_MAX, VIRTIO_BLK_ID_BYTES, VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK,
    VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN,
    VIRTIO_BLK_T_OUT,
};
use virtio_bindings::virtio_ids::VIRTIO_ID_BLOCK;
use virtio_queue::Queue;

use crate::virtio::chain::{Chain, ChainError};
use crate::virtio::mmio::VIRTIO_F_VERSION_1;
use crate::virtio::persist::{BlockState, DeviceState, RestoreError};
use crate::virtio::{ActivateError, Active, VirtioDevice};
use crate::{EventSource, GuestMemory, Interrupt, Work};

/// Sector size of the virtio-blk protocol.
pub const SECTOR_SIZE: u64 = 512;
/// Size of the only queue.
pub const QUEUE_SIZE: u16 = 256;
/// Largest single data segment the driver may use (`size_max`).
pub const SIZE_MAX: u32 = 1 << 20;
/// Most data segments in one request (`seg_max`): the queue minus the
/// header and status descriptors.
pub const SEG_MAX: u32 = QUEUE_SIZE as u32 - 2;
/// Most data bytes in one request. Linux asks for at most
/// `max_sectors_kb` (1280 KiB by default) per request; a guest that raises
/// it past this gets IOERR rather than a main loop busy copying hundreds
/// of MiB for one request.
pub const MAX_REQUEST_BYTES: u64 = 8 << 20;
/// Name in log lines.
const DEVICE: &str = "virtio-blk";
/// Length of the request header (`virtio_blk_outhdr`).
const HEADER_LEN: usize = 16;
/// Bounce buffer size for reads.
const BOUNCE_LEN: usize = 128 * 1024;
/// Length of the configuration space we expose (capacity .. blk_size).
const CONFIG_LEN: usize = 24;

/// Why a request failed (logged; the guest sees a status byte).
#[derive(Debug, thiserror::Error)]
pub enum BlockError {
    #[error("bad descriptor chain")]
    Chain(#[source] ChainError),
    #[error("request header is {0} bytes, want {HEADER_LEN}")]
    ShortHeader(usize),
    #[error("no room for the status byte")]
    NoStatus,
    #[error("sectors {sector}+{len}B past the end of the disk")]
    OutOfRange { sector: u64, len: u64 },
    #[error("cannot read the backing file")]
    Io(#[source] io::Error),
    #[error("cannot write the guest's blocks")]
    HostWrite(#[source] io::Error),
    #[error("write to a read-only disk")]
    ReadOnly,
    #[error("unsupported request type {0}")]
    Unsupported(u32),
    #[error("request has {0} data segments, more than seg_max {SEG_MAX}")]
    TooManySegments(usize),
    #[error("data segment of {0} bytes is larger than size_max {SIZE_MAX}")]
    SegmentTooLarge(u32),
    #[error("request of {0} data bytes is larger than {MAX_REQUEST_BYTES}")]
    TooLarge(u64),
}

/// What a block device serves.
pub enum Backing {
    ReadOnly(Disk),
    /// Shared with the VMM, which freezes it at a fork and saves it in a
    /// snapshot while the device serves nothing.
    Writable(Arc<Mutex<Overlay>>),
}

impl Backing {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        match self {
            Backing::ReadOnly(disk) => disk.read_exact_at(buf, offset),
            Backing::Writable(o) => lock(o).read_exact_at(buf, offset),
        }
    }

    fn len(&self) -> u64 {
        match self {
            Backing::ReadOnly(disk) => disk.len(),
            Backing::Writable(o) => lock(o).len(),
        }
    }
}

/// Locks an overlay; a poisoned lock (a panicked thread) still yields it.
pub fn lock(o: &Mutex<Overlay>) -> std::sync::MutexGuard<'_, Overlay> {
    o.lock().unwrap_or_else(|p| p.into_inner())
}

/// A virtio block device backed by a read-only [`Disk`] or a writable
/// [`Overlay`].
pub struct Block {
    disk: Backing,
    capacity: u64,
    id: [u8; VIRTIO_BLK_ID_BYTES as usize],
    acked_features: u64,
    active: Option<Active<1>>,
    bounce: Vec<u8>,
}

impl Block {
    /// Opens `path` read-only. The disk is the file's length rounded down
    /// to whole sectors.
    pub fn new(path: &Path) -> io::Result<Block> {
        Self::from_file(File::open(path)?)
    }

    /// A disk backed by `file`, opened to read.
    pub fn from_file(file: File) -> io::Result<Block> {
        let meta = file.metadata()?;
        let mut block = Self::from_disk(Disk::file(file)?);
        block.set_id(format!("fbx{:x}-{:x}", meta.dev(), meta.ino()).as_bytes());
        Ok(block)
    }

    /// A device reading `disk`.
    pub fn from_disk(disk: Disk) -> Block {
        let id = format!("fbx-layers-{}", disk.layers());
        Self::with_backing(Backing::ReadOnly(disk), id.as_bytes())
    }

    /// A writable device over `overlay`, whose serial (GET_ID) is `id`:
    /// how the guest tells its writable disks apart.
    pub fn writable(overlay: Arc<Mutex<Overlay>>, id: &[u8]) -> Block {
        Self::with_backing(Backing::Writable(overlay), id)
    }

    fn with_backing(disk: Backing, id: &[u8]) -> Block {
        let mut block = Block {
            capacity: disk.len() / SECTOR_SIZE,
            disk,
            id: [0; VIRTIO_BLK_ID_BYTES as usize],
            acked_features: 0,
            active: None,
            bounce: Vec::new(),
        };
        block.set_id(id);
        block
    }

    fn writable_disk(&self) -> bool {
        matches!(self.disk, Backing::Writable(_))
    }

    /// Replaces the serial the guest reads with GET_ID (at most 20 bytes;
    /// longer ids are truncated).
    pub fn set_id(&mut self, id: &[u8]) {
        self.id = [0; VIRTIO_BLK_ID_BYTES as usize];
        let n = id.len().min(self.id.len());
        self.id[..n].copy_from_slice(&id[..n]);
    }

    /// Capacity in 512-byte sectors.
    pub fn capacity_sectors(&self) -> u64 {
        self.capacity
    }

    fn config_bytes(&self) -> [u8; CONFIG_LEN] {
        let mut c = [0u8; CONFIG_LEN];
        c[0..8].copy_from_slice(&self.capacity.to_le_bytes());
        c[8..12].copy_from_slice(&SIZE_MAX.to_le_bytes());
        c[12..16].copy_from_slice(&SEG_MAX.to_le_bytes());
        // 16..20: geometry, not offered.
        let block_size = match self.writable_disk() {
            true => super::overlay::BLOCK as u32,
            false => SECTOR_SIZE as u32,
        };
        c[20..24].copy_from_slice(&block_size.to_le_bytes());
        c
    }

    fn process_queue(&mut self) -> Work {
        let Some(active) = self.active.as_mut() else {
            return Work::Done;
        };
        let irq = active.interrupt.clone();
        let (used, work) = active.serve(0, |mem, chain| match chain {
            Ok(c) => handle_request(
                &self.disk,
                self.capacity,
                &self.id,
                &mut self.bounce,
                mem,
                &c,
                &irq,
            ),
            Err(e) => {
                irq.guest_error(DEVICE, &BlockError::Chain(e));
                0
            }
        });
        if used {
            active.interrupt.signal_used_queue();
        }
        work
    }
}

/// Checks the data buffers of a request against what the device offers:
/// at most [`SEG_MAX`] segments of at most [`SIZE_MAX`] bytes each, and at
/// most [`MAX_REQUEST_BYTES`] in all. `data` is the request's data part
/// (without header and status byte).
fn check_segments(chain: &Chain, data: u64) -> Result<(), BlockError> {
    // The header is one readable region at least, the status byte is the
    // last writable one; everything else is data.
    let segments = chain.readable.count() + chain.writable.count();
    let segments = segments.saturating_sub(2);
    if segments > SEG_MAX as usize {
        return Err(BlockError::TooManySegments(segments));
    }
    let largest = chain
        .readable
        .iter()
        .chain(chain.writable.iter())
        .map(|r| r.len)
        .max()
        .unwrap_or(0);
    // The header (16) and status (1) descriptors are far below SIZE_MAX,
    // so the largest region is a data one whenever it is over the limit.
    if largest > SIZE_MAX {
        return Err(BlockError::SegmentTooLarge(largest));
    }
    if data > MAX_REQUEST_BYTES {
        return Err(BlockError::TooLarge(data));
    }
    Ok(())
}

/// Serves one request; returns the number of bytes written into the chain.
fn handle_request(
    disk: &Backing,
    capacity: u64,
    id: &[u8],
    bounce: &mut Vec<u8>,
    mem: &GuestMemory,
    chain: &Chain,
    irq: &Interrupt,
) -> u32 {
    let mut hdr = [0u8; HEADER_LEN];
    let status_offset = match chain.writable.len().checked_sub(1) {
        Some(o) => o,
        None => {
            irq.guest_error(DEVICE, &BlockError::NoStatus);
            return 0;
        }
    };
    let result = match chain.readable.read_at(mem, 0, &mut hdr) {
        Ok(HEADER_LEN) => {
            // A read's data is writable, a write's readable after the header.
            let data = status_offset.max(chain.readable.len().saturating_sub(HEADER_LEN as u64));
            check_segments(chain, data).and_then(|()| {
                let kind = u32::from_le_bytes([hdr[0], hdr[1], hdr[2], hdr[3]]);
                let mut sector = [0u8; 8];
                sector.copy_from_slice(&hdr[8..16]);
                let sector = u64::from_le_bytes(sector);
                serve(
                    disk,
                    capacity,
                    id,
                    bounce,
                    mem,
                    chain,
                    kind,
                    sector,
                    status_offset,
                )
            })
        }
        Ok(n) => Err(BlockError::ShortHeader(n)),
        Err(e) => Err(BlockError::Chain(e)),
    };
    let (status, data_len) = match result {
        Ok(n) => (VIRTIO_BLK_S_OK, n),
        Err(e @ BlockError::Unsupported(_)) => {
            irq.guest_error(DEVICE, &e);
            (VIRTIO_BLK_S_UNSUPP, 0)
        }
        Err(e @ BlockError::Io(_)) => {
            // The host's file failed, not the guest: not rate-limited as
            // the guest's, but it cannot repeat faster than requests do.
            tracing::warn!("{DEVICE}: {e}");
            (VIRTIO_BLK_S_IOERR, 0)
        }
        Err(BlockError::ReadOnly) => (VIRTIO_BLK_S_IOERR, 0),
        Err(e @ BlockError::HostWrite(_)) => {
            // A full host disk: the guest sees an I/O error, the VMM
            // counts it (`overlay::HOST_WRITE_ERRORS`) as the host's.
            irq.host_error(DEVICE, &e);
            (VIRTIO_BLK_S_IOERR, 0)
        }
        Err(e) => {
            irq.guest_error(DEVICE, &e);
            (VIRTIO_BLK_S_IOERR, 0)
        }
    };
    if let Err(e) = chain.writable.write_at(mem, status_offset, &[status as u8]) {
        irq.guest_error(DEVICE, &BlockError::Chain(e));
        return 0;
    }
    // data_len <= status_offset < writable length, which fits the used
    // ring's u32 only if the chain does; saturate instead of wrapping.
    u32::try_from(data_len + 1).unwrap_or(u32::MAX)
}

/// The byte offset of `len` bytes at `sector`, if they lie on the disk.
fn in_range(capacity: u64, sector: u64, len: u64) -> Result<u64, BlockError> {
    let out_of_range = || BlockError::OutOfRange { sector, len };
    let start = sector.checked_mul(SECTOR_SIZE).ok_or_else(out_of_range)?;
    let end = start.checked_add(len).ok_or_else(out_of_range)?;
    if end > capacity * SECTOR_SIZE {
        return Err(out_of_range());
    }
    Ok(start)
}

/// Returns the number of data bytes written to the guest.
#[allow(clippy::too_many_arguments)]
fn serve(
    disk: &Backing,
    capacity: u64,
    id: &[u8],
    bounce: &mut Vec<u8>,
    mem: &GuestMemory,
    chain: &Chain,
    kind: u32,
    sector: u64,
    data_len: u64,
) -> Result<u64, BlockError> {
    match kind {
        VIRTIO_BLK_T_IN => {
            let start = in_range(capacity, sector, data_len)?;
            if bounce.is_empty() {
                bounce.resize(BOUNCE_LEN, 0);
            }
            let mut done = 0u64;
            while done < data_len {
                let n = (data_len - done).min(BOUNCE_LEN as u64) as usize;
                let buf = &mut bounce[..n];
                disk.read_exact_at(buf, start + done)
                    .map_err(BlockError::Io)?;
                chain
                    .writable
                    .write_at(mem, done, buf)
                    .map_err(BlockError::Chain)?;
                done += n as u64;
            }
            Ok(data_len)
        }
        VIRTIO_BLK_T_OUT => {
            let Backing::Writable(overlay) = disk else {
                return Err(BlockError::ReadOnly);
            };
            // The data follows the header in the readable part.
            let len = chain.readable.len().saturating_sub(HEADER_LEN as u64);
            let start = in_range(capacity, sector, len)?;
            if bounce.is_empty() {
                bounce.resize(BOUNCE_LEN, 0);
            }
            let mut overlay = lock(overlay);
            let mut done = 0u64;
            while done < len {
                let n = (len - done).min(BOUNCE_LEN as u64) as usize;
                let buf = &mut bounce[..n];
                chain
                    .readable
                    .read_at(mem, HEADER_LEN as u64 + done, buf)
                    .map_err(BlockError::Chain)?;
                overlay
                    .write_all_at(buf, start + done)
                    .map_err(BlockError::HostWrite)?;
                done += n as u64;
            }
            // Nothing written into the chain but the status.
            Ok(0)
        }
        VIRTIO_BLK_T_FLUSH => {
            // Durable for the VM's life already; the host's disk gets the
            // pages now, and the VMM's cgroup lets them go.
            if let Backing::Writable(overlay) = disk {
                lock(overlay).write_back();
            }
            Ok(0)
        }
        VIRTIO_BLK_T_GET_ID => {
            let n = (id.len() as u64).min(data_len) as usize;
            chain
                .writable
                .write_at(mem, 0, &id[..n])
                .map_err(BlockError::Chain)?;
            Ok(n as u64)
        }
        other => Err(BlockError::Unsupported(other)),
    }
}

impl EventSource for Block {
    fn event_fd(&self) -> Option<RawFd> {
        None
    }

    fn handle_events(&mut self) -> Work {
        Work::Done
    }
}

impl VirtioDevice for Block {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_BLOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE]
    }

    fn features(&self) -> u64 {
        let access = match self.writable_disk() {
            true => 1 << VIRTIO_BLK_F_FLUSH,
            false => 1 << VIRTIO_BLK_F_RO,
        };
        VIRTIO_F_VERSION_1
            | access
            | 1 << VIRTIO_BLK_F_SIZE_MAX
            | 1 << VIRTIO_BLK_F_SEG_MAX
            | 1 << VIRTIO_BLK_F_BLK_SIZE
    }

    fn ack_features(&mut self, features: u64) {
        self.acked_features = features & self.features();
    }

    fn config_space(&self) -> Cow<'_, [u8]> {
        Cow::Owned(self.config_bytes().to_vec())
    }

    fn activate(
        &mut self,
        mem: GuestMemory,
        queues: Vec<Queue>,
        interrupt: Interrupt,
    ) -> Result<(), ActivateError> {
        self.active = Some(Active::new(mem, queues, interrupt, self.acked_features)?);
        Ok(())
    }

    fn queue_notify(&mut self, index: u16) -> Work {
        if index == 0 {
            self.process_queue()
        } else {
            Work::Done
        }
    }

    fn reset(&mut self) {
        self.active = None;
        self.acked_features = 0;
    }

    fn save(&self) -> DeviceState {
        DeviceState::Block(BlockState {
            acked_features: self.acked_features,
            queues: self.active.as_ref().map(Active::save),
        })
    }

    fn restore(
        &mut self,
        mem: GuestMemory,
        interrupt: Interrupt,
        state: &DeviceState,
    ) -> Result<(), RestoreError> {
        let DeviceState::Block(state) = state else {
            return Err(state.wrong_device("block"));
        };
        self.acked_features = state.acked_features & self.features();
        self.active =
            Active::restore(mem, interrupt, state.queues.as_deref(), self.acked_features)?;
        // A kick the guest sent just before the capture went to the old
        // process's ioeventfd: serve whatever the ring holds now (the VMM
        // calls every queue once more when its loop starts, for the rest).
        let _ = self.process_queue();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::sync::Arc;

    use vm_memory::{Bytes, GuestAddress};
    use vmm_sys_util::eventfd::EventFd;

    use super::lock as block_lock;
    use super::*;
    use crate::virtio::testutil::{memory, ro, wo, Driver};

    struct TempFile(PathBuf);

    impl Drop for TempFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    /// A disk of `sectors` sectors where byte i of sector s is (s + i) % 251.
    fn disk(name: &str, sectors: u64) -> (TempFile, Vec<u8>) {
        let path =
            std::env::temp_dir().join(format!("forkbox-devices-blk-{}-{name}", std::process::id()));
        let data: Vec<u8> = (0..sectors * SECTOR_SIZE)
            .map(|i| ((i / SECTOR_SIZE + i % SECTOR_SIZE) % 251) as u8)
            .collect();
        std::fs::write(&path, &data).expect("write test disk");
        (TempFile(path), data)
    }

    const HDR: u64 = 0x10_0000;
    const DATA: u64 = 0x20_0000;
    const STATUS: u64 = 0x30_0000;

    fn setup(name: &str, sectors: u64) -> (Block, GuestMemory, TempFile, Vec<u8>, Arc<EventFd>) {
        let (file, data) = disk(name, sectors);
        let blk = Block::new(&file.0).expect("open disk");
        let mem = memory(0x40_0000);
        let irq = Arc::new(EventFd::new(libc::EFD_NONBLOCK).expect("eventfd"));
        (blk, mem, file, data, irq)
    }

    fn header(mem: &GuestMemory, kind: u32, sector: u64) {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&kind.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        mem.write_slice(&h, GuestAddress(HDR)).expect("header");
    }

    fn status(mem: &GuestMemory) -> u8 {
        mem.read_obj(GuestAddress(STATUS)).expect("status")
    }

    #[test]
    fn block_config_reports_capacity_and_ro() {
        let (blk, _, _f, _, _) = setup("config", 8);
        assert_eq!(blk.capacity_sectors(), 8);
        let mut cap = [0u8; 8];
        blk.read_config(0, &mut cap);
        assert_eq!(u64::from_le_bytes(cap), 8);
        let mut seg = [0u8; 4];
        blk.read_config(12, &mut seg);
        assert_eq!(u32::from_le_bytes(seg), SEG_MAX);
        let mut past = [0xffu8; 4];
        blk.read_config(u64::MAX, &mut past);
        assert_eq!(past, [0; 4]);
        assert_ne!(blk.features() & (1 << VIRTIO_BLK_F_RO), 0);
        assert_ne!(blk.features() & VIRTIO_F_VERSION_1, 0);
        assert_eq!(blk.device_type(), 2);
    }

    #[test]
    fn block_chained_read_fills_every_segment() {
        let (mut blk, mem, _f, data, irq) = setup("read", 16);
        let mut drv = Driver::new(&mem, 0, 16);
        blk.activate(mem.clone(), vec![drv.queue()], Interrupt::new(irq.clone()))
            .expect("activate");
        header(&mem, VIRTIO_BLK_T_IN, 3);
        // 3 sectors split 100 / 924 / 512 across three descriptors.
        let head = drv.add(&[
            ro(HDR, 16),
            wo(DATA, 100),
            wo(DATA + 0x1000, 924),
            wo(DATA + 0x2000, 512),
            wo(STATUS, 1),
        ]);
        blk.queue_notify(0);
        assert_eq!(drv.used(), vec![(u32::from(head), 1536 + 1)]);
        assert_eq!(status(&mem), VIRTIO_BLK_S_OK as u8);
        let mut got = vec![0u8; 1536];
        mem.read_slice(&mut got[..100], GuestAddress(DATA))
            .expect("read");
        mem.read_slice(&mut got[100..1024], GuestAddress(DATA + 0x1000))
            .expect("read");
        mem.read_slice(&mut got[1024..], GuestAddress(DATA + 0x2000))
            .expect("read");
        assert_eq!(&got[..], &data[3 * 512..6 * 512]);
        assert_eq!(irq.read().expect("interrupt raised"), 1);
    }

    #[test]
    fn block_large_read_crosses_bounce_buffer() {
        let (mut blk, mem, _f, data, irq) = setup("large", 600);
        let mut drv = Driver::new(&mem, 0, 16);
        blk.activate(mem.clone(), vec![drv.queue()], Interrupt::new(irq))
            .expect("activate");
        header(&mem, VIRTIO_BLK_T_IN, 0);
        drv.add(&[ro(HDR, 16), wo(DATA, 600 * 512), wo(STATUS, 1)]);
        blk.queue_notify(0);
        assert_eq!(status(&mem), VIRTIO_BLK_S_OK as u8);
        let mut got = vec![0u8; 600 * 512];
        mem.read_slice(&mut got, GuestAddress(DATA)).expect("read");
        assert!(got == data);
    }

    #[test]
    fn block_read_past_end_is_ioerr() {
        let (mut blk, mem, _f, _, irq) = setup("past", 4);
        let mut drv = Driver::new(&mem, 0, 16);
        blk.activate(mem.clone(), vec![drv.queue()], Interrupt::new(irq))
            .expect("activate");
        for (sector, len) in [
            (3u64, 1024u32),
            (4, 512),
            (u64::MAX / 256, 512),
            (u64::MAX, 512),
        ] {
            mem.write_obj(0xffu8, GuestAddress(STATUS)).expect("status");
            header(&mem, VIRTIO_BLK_T_IN, sector);
            drv.add(&[ro(HDR, 16), wo(DATA, len), wo(STATUS, 1)]);
            blk.queue_notify(0);
            assert_eq!(status(&mem), VIRTIO_BLK_S_IOERR as u8, "sector {sector}");
            assert_eq!(drv.used().len(), 1);
        }
    }

    #[test]
    fn block_write_is_ioerr_and_file_unchanged() {
        let (mut blk, mem, f, data, irq) = setup("write", 4);
        let mut drv = Driver::new(&mem, 0, 16);
        blk.activate(mem.clone(), vec![drv.queue()], Interrupt::new(irq))
            .expect("activate");
        header(&mem, VIRTIO_BLK_T_OUT, 0);
        drv.add(&[ro(HDR, 16), ro(DATA, 512), wo(STATUS, 1)]);
        blk.queue_notify(0);
        assert_eq!(status(&mem), VIRTIO_BLK_S_IOERR as u8);
        assert_eq!(std::fs::read(&f.0).expect("reread disk"), data);
    }

    #[test]
    fn block_get_id_flush_and_unknown() {
        let (mut blk, mem, _f, _, irq) = setup("id", 4);
        blk.set_id(b"layer-0123");
        let mut drv = Driver::new(&mem, 0, 16);
        blk.activate(mem.clone(), vec![drv.queue()], Interrupt::new(irq))
            .expect("activate");
        header(&mem, VIRTIO_BLK_T_GET_ID, 0);
        drv.add(&[ro(HDR, 16), wo(DATA, 20), wo(STATUS, 1)]);
        blk.queue_notify(0);
        assert_eq!(status(&mem), VIRTIO_BLK_S_OK as u8);
        let mut id = [0u8; 20];
        mem.read_slice(&mut id, GuestAddress(DATA)).expect("id");
        assert_eq!(&id[..10], b"layer-0123");
        assert_eq!(drv.used()[0].1, 21);

        header(&mem, VIRTIO_BLK_T_FLUSH, 0);
        drv.add(&[ro(HDR, 16), wo(STATUS, 1)]);
        blk.queue_notify(0);
        assert_eq!(status(&mem), VIRTIO_BLK_S_OK as u8);

        header(&mem, 77, 0);
        drv.add(&[ro(HDR, 16), wo(STATUS, 1)]);
        blk.queue_notify(0);
        assert_eq!(status(&mem), VIRTIO_BLK_S_UNSUPP as u8);
        assert_eq!(drv.used().len(), 2);
    }

    #[test]
    fn block_requests_past_the_offered_limits_are_ioerr_and_not_read() {
        let (mut blk, mem, _f, _, irq) = setup("limits", 64);
        let mut drv = Driver::new(&mem, 0, 32);
        let irq = Interrupt::new(irq);
        blk.activate(mem.clone(), vec![drv.queue()], irq.clone())
            .expect("activate");
        header(&mem, VIRTIO_BLK_T_IN, 0);
        // One segment larger than size_max.
        mem.write_slice(&[0xee; 16], GuestAddress(DATA))
            .expect("marker");
        drv.add(&[ro(HDR, 16), wo(DATA, SIZE_MAX + 512), wo(STATUS, 1)]);
        assert_eq!(blk.queue_notify(0), Work::Done);
        assert_eq!(status(&mem), VIRTIO_BLK_S_IOERR as u8);
        let mut marker = [0u8; 16];
        mem.read_slice(&mut marker, GuestAddress(DATA))
            .expect("marker");
        assert_eq!(marker, [0xee; 16], "nothing was read into the buffer");
        // More than MAX_REQUEST_BYTES in segments of size_max each (all
        // over the same guest buffer: only the lengths matter).
        let n = (MAX_REQUEST_BYTES / u64::from(SIZE_MAX)) as usize + 1;
        let mut bufs = vec![ro(HDR, 16)];
        bufs.extend(std::iter::repeat_n(wo(DATA, SIZE_MAX), n));
        bufs.push(wo(STATUS, 1));
        mem.write_obj(0xffu8, GuestAddress(STATUS)).expect("status");
        drv.add(&bufs);
        assert_eq!(blk.queue_notify(0), Work::Done);
        assert_eq!(status(&mem), VIRTIO_BLK_S_IOERR as u8);
        assert_eq!(drv.used().iter().map(|u| u.1).collect::<Vec<_>>(), [1, 1]);
        assert_eq!(irq.guest_errors(), 2);
    }

    #[test]
    fn block_malformed_chains_are_returned_without_panic() {
        let (mut blk, mem, _f, _, irq) = setup("bad", 4);
        let mut drv = Driver::new(&mem, 0, 16);
        blk.activate(mem.clone(), vec![drv.queue()], Interrupt::new(irq))
            .expect("activate");
        header(&mem, VIRTIO_BLK_T_IN, 0);
        // No status byte.
        drv.add(&[ro(HDR, 16), ro(DATA, 512)]);
        // Short header.
        drv.add(&[ro(HDR, 8), wo(STATUS, 1)]);
        // Readable after writable.
        drv.add(&[ro(HDR, 16), wo(DATA, 512), ro(STATUS, 1)]);
        // Buffer outside guest memory.
        drv.add(&[ro(HDR, 16), wo(u64::MAX - 10, 512), wo(STATUS, 1)]);
        // Descriptor loop: 0 -> 1 -> 0.
        drv.write_desc(10, HDR, 16, 1, 11);
        drv.write_desc(11, DATA, 16, 1 | 2, 10);
        drv.publish(10);
        blk.queue_notify(0);
        let used = drv.used();
        assert_eq!(used.len(), 5, "{used:?}");
        assert!(used.iter().all(|&(_, len)| len <= 1), "{used:?}");
        assert_eq!(used[0].1, 0);
    }

    /// A writable disk over a base of `blocks` 4 KiB blocks of 0x5a.
    fn writable(top: File, blocks: u64) -> (Block, Arc<Mutex<Overlay>>) {
        let base = tempfile::tempfile().expect("base");
        std::os::unix::fs::FileExt::write_all_at(&base, &vec![0x5a; (blocks * 4096) as usize], 0)
            .expect("fill base");
        let overlay = Arc::new(Mutex::new(Overlay::new(base, top).expect("overlay")));
        (Block::writable(Arc::clone(&overlay), b"fbx-rw-0"), overlay)
    }

    #[test]
    fn block_writable_takes_writes_and_reads_them_back() {
        let (mut blk, overlay) = writable(tempfile::tempfile().expect("top"), 4);
        assert_eq!(blk.features() & (1 << VIRTIO_BLK_F_RO), 0);
        assert_ne!(blk.features() & (1 << VIRTIO_BLK_F_FLUSH), 0);
        let mut bs = [0u8; 4];
        blk.read_config(20, &mut bs);
        assert_eq!(u32::from_le_bytes(bs), 4096, "4 KiB logical blocks");
        let mem = memory(0x40_0000);
        let irq = Arc::new(EventFd::new(libc::EFD_NONBLOCK).expect("eventfd"));
        let mut drv = Driver::new(&mem, 0, 16);
        blk.activate(mem.clone(), vec![drv.queue()], Interrupt::new(irq))
            .expect("activate");
        // Sector 9 (inside block 1), two data segments: 512 + 512 bytes.
        mem.write_slice(&[0x11; 512], GuestAddress(DATA))
            .expect("data");
        mem.write_slice(&[0x22; 512], GuestAddress(DATA + 0x1000))
            .expect("data");
        header(&mem, VIRTIO_BLK_T_OUT, 9);
        drv.add(&[
            ro(HDR, 16),
            ro(DATA, 512),
            ro(DATA + 0x1000, 512),
            wo(STATUS, 1),
        ]);
        blk.queue_notify(0);
        assert_eq!(status(&mem), VIRTIO_BLK_S_OK as u8);
        assert_eq!(drv.used()[0].1, 1, "only the status byte written");
        header(&mem, VIRTIO_BLK_T_FLUSH, 0);
        drv.add(&[ro(HDR, 16), wo(STATUS, 1)]);
        blk.queue_notify(0);
        assert_eq!(status(&mem), VIRTIO_BLK_S_OK as u8);
        // Read sectors 8..11 back through the device.
        header(&mem, VIRTIO_BLK_T_IN, 8);
        drv.add(&[ro(HDR, 16), wo(DATA + 0x2000, 2048), wo(STATUS, 1)]);
        blk.queue_notify(0);
        let mut got = vec![0u8; 2048];
        mem.read_slice(&mut got, GuestAddress(DATA + 0x2000))
            .expect("read");
        let mut want = vec![0x5a; 2048];
        want[512..1024].fill(0x11);
        want[1024..1536].fill(0x22);
        assert_eq!(got, want);
        assert_eq!(block_lock(&overlay).top_blocks(), 1);
        // Past the end: refused, nothing written.
        header(&mem, VIRTIO_BLK_T_OUT, 4 * 8);
        drv.add(&[ro(HDR, 16), ro(DATA, 512), wo(STATUS, 1)]);
        blk.queue_notify(0);
        assert_eq!(status(&mem), VIRTIO_BLK_S_IOERR as u8);
        assert_eq!(block_lock(&overlay).top_blocks(), 1);
    }

    /// A top the host cannot write (here: opened read-only; in life, a
    /// full disk) fails the guest's write with IOERR, changes nothing the
    /// guest reads, and is counted as the host's.
    #[test]
    fn block_writable_host_write_failure_is_ioerr_and_counted() {
        let top = tempfile::NamedTempFile::new().expect("top");
        top.as_file().set_len(4 * 4096).expect("size");
        let (mut blk, overlay) = writable(File::open(top.path()).expect("read-only"), 4);
        let errors =
            || crate::virtio::overlay::HOST_WRITE_ERRORS.load(std::sync::atomic::Ordering::Relaxed);
        let before = errors();
        let mem = memory(0x40_0000);
        let irq = Arc::new(EventFd::new(libc::EFD_NONBLOCK).expect("eventfd"));
        let mut drv = Driver::new(&mem, 0, 16);
        blk.activate(mem.clone(), vec![drv.queue()], Interrupt::new(irq))
            .expect("activate");
        mem.write_slice(&[0x77; 4096], GuestAddress(DATA))
            .expect("data");
        header(&mem, VIRTIO_BLK_T_OUT, 0);
        drv.add(&[ro(HDR, 16), ro(DATA, 4096), wo(STATUS, 1)]);
        blk.queue_notify(0);
        assert_eq!(status(&mem), VIRTIO_BLK_S_IOERR as u8);
        assert!(errors() > before, "counted as the host's");
        let failure = crate::virtio::overlay::host_write_failure().expect("noted for the VMM");
        assert!(failure.contains("Bad file descriptor"), "{failure}");
        let mut first = [0u8; 4];
        block_lock(&overlay)
            .read_exact_at(&mut first, 0)
            .expect("read");
        assert_eq!(first, [0x5a; 4], "the base still shows");
        assert_eq!(block_lock(&overlay).top_blocks(), 0);
    }

    #[test]
    fn block_random_descriptors_do_not_panic() {
        let (mut blk, mem, _f, _, irq) = setup("fuzz", 64);
        let drv = Driver::new(&mem, 0, 16);
        let q = drv.queue();
        let mut drv = drv;
        blk.activate(mem.clone(), vec![q], Interrupt::new(irq))
            .expect("activate");
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for round in 0..2000 {
            for i in 0..16u16 {
                let r = rnd();
                let addr = if r & 1 == 0 { r % 0x40_0000 } else { r };
                drv.write_desc(
                    i,
                    addr,
                    (rnd() % 0x2_0000) as u32,
                    (rnd() % 8) as u16,
                    (rnd() % 20) as u16,
                );
            }
            let mut h = [0u8; 16];
            h.iter_mut().for_each(|b| *b = rnd() as u8);
            h[0] = [0u8, 1, 4, 8, 99][round % 5];
            mem.write_slice(&h, GuestAddress((rnd() % 0x40_0000) & !0xf))
                .expect("hdr");
            drv.publish((rnd() % 16) as u16);
            blk.queue_notify(0);
        }
    }
}
