//! The virtio-blk device serving a queue the input lays out.
//!
//! Input: a flags byte (bit 0: the device is reset and served again; bit
//! 1: the device is writable, over an overlay of the disk), then
//! guest memory from address 0 on: the descriptor table of a 16-entry
//! queue at 0, its avail ring at 0x100 (index at 0x102), its used ring at
//! 0x124, and headers and buffers wherever the descriptors point. The
//! guest owns all of it, avail index included, as a real one does. The
//! disk is 16 sectors of a known pattern: never written, as a golden
//! volume under a writable disk is not; a writable disk's writes go to its
//! top, which never grows past the disk.

use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use forkbox_devices::virtio::block::Block;
use forkbox_devices::virtio::overlay::Overlay;
use forkbox_devices::virtio::VirtioDevice;
use forkbox_devices::Work;
use vm_memory::{Bytes, GuestAddress};

use crate::input::Input;
use crate::ring::{interrupt, memory, Ring};

const MEM: usize = 0x4_0000;
const QUEUE: u16 = 16;
const SECTORS: u64 = 16;
/// Turns of the VMM's loop one input gets.
const TURNS: usize = 8;

/// The disk: an unlinked temporary file, opened by its `/proc` path (it
/// lives as long as the process, and leaves nothing behind).
pub(crate) fn disk() -> &'static (File, PathBuf) {
    static DISK: OnceLock<(File, PathBuf)> = OnceLock::new();
    DISK.get_or_init(|| {
        let dir = std::env::temp_dir();
        let path = dir.join(format!("forkbox-fuzz-blk-{}", std::process::id()));
        let mut f = File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .expect("create the fuzz disk");
        std::fs::remove_file(&path).expect("unlink the fuzz disk");
        let data: Vec<u8> = (0..SECTORS * 512).map(|i| (i % 251) as u8).collect();
        f.write_all(&data).expect("write the fuzz disk");
        let proc_path = PathBuf::from(format!("/proc/self/fd/{}", f.as_raw_fd()));
        (f, proc_path)
    })
}

pub fn virtio_blk(data: &[u8]) {
    let mut input = Input::new(data);
    let flags = input.u8();
    let mem = memory(MEM);
    let image = input.rest();
    mem.write_slice(&image[..image.len().min(MEM)], GuestAddress(0))
        .expect("guest memory image");
    let ring = Ring::at(0, QUEUE);

    let writable = flags & 2 != 0;
    let top = tempfile::tempfile().expect("a top");
    let mut blk = if writable {
        let base = File::open(&disk().1).expect("open the fuzz disk");
        let top = top.try_clone().expect("dup the top");
        let overlay = Overlay::new(base, top).expect("an overlay of the fuzz disk");
        Block::writable(Arc::new(Mutex::new(overlay)), b"fbx-rw-0")
    } else {
        Block::new(&disk().1).expect("open the fuzz disk")
    };
    assert_eq!(blk.capacity_sectors(), SECTORS);
    blk.ack_features(blk.features());
    let rounds = if flags & 1 != 0 { 2 } else { 1 };
    for _ in 0..rounds {
        blk.activate(mem.clone(), vec![ring.queue()], interrupt())
            .expect("activate");
        // A guest can keep a queue busy (its buffers may overlap its own
        // avail ring), but each turn ends: the budget bounds it.
        for _ in 0..TURNS {
            if blk.queue_notify(0) == Work::Done {
                break;
            }
        }
        blk.reset();
    }
    if writable {
        let len = top.metadata().expect("the top's metadata").len();
        assert_eq!(len, SECTORS * 512, "the top grew past the disk");
    }
    // Nothing a guest sends writes the disk (read-only: OUT is refused;
    // writable: OUT goes to the top; the file is opened read-only).
    let mut now = vec![0u8; (SECTORS * 512) as usize];
    disk()
        .0
        .read_exact_at(&mut now, 0)
        .expect("read the fuzz disk back");
    assert!(
        now.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8),
        "the disk changed"
    );
}
