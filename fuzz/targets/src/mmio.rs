//! The virtio-mmio transport of a virtio-blk device, driven as a guest
//! drives it: register reads and writes at any offset and width, queue
//! kicks, and a save and restore (a fork) midway.
//!
//! Input: the length of a guest memory image (u16), the image (from
//! address 0), then operations until the input ends (at most
//! [`MAX_OPS`]): an op byte (low 3 bits: read, write, kick, save and
//! restore, device events; top 2 bits: the access width 1, 2, 4 or 8), a
//! register offset (u16, within the window), and for a write its value.

use forkbox_devices::virtio::block::Block;
use forkbox_devices::virtio::mmio::MmioTransport;
use forkbox_devices::virtio::persist::{DeviceState, TransportState};
use forkbox_devices::{BusDevice, EventSource, Work};
use vm_memory::{Bytes, GuestAddress};

use crate::blk::disk;
use crate::input::Input;
use crate::ring::{interrupt, memory};

const MEM: usize = 0x1_0000;
/// Where the device's config space starts in the window.
const CONFIG: u64 = 0x100;
const MAX_OPS: usize = 256;
/// Turns of the VMM's loop one kick gets.
const TURNS: usize = 8;

fn block() -> Box<Block> {
    Box::new(Block::new(&disk().1).expect("open the fuzz disk"))
}

pub fn virtio_mmio(data: &[u8]) {
    let mut input = Input::new(data);
    let mem = memory(MEM);
    let image_len = usize::from(input.u16()).min(MEM);
    let image = input.bytes(image_len);
    mem.write_slice(image, GuestAddress(0))
        .expect("guest memory image");
    let mut t = MmioTransport::new(block(), mem.clone(), interrupt());
    for _ in 0..MAX_OPS {
        if input.is_empty() {
            break;
        }
        let op = input.u8();
        let width = 1usize << (op >> 6);
        let offset = u64::from(input.u16()) % 0x200;
        match op & 7 {
            0 => {
                let mut buf = [0xa5u8; 8];
                t.read(offset, &mut buf[..width]);
                // A register is read 4 bytes at a time, aligned; anything
                // else reads as zeros.
                if offset < CONFIG && (width != 4 || offset & 3 != 0) {
                    assert!(buf[..width].iter().all(|&b| b == 0), "odd register read");
                }
            }
            1 => {
                let value = u64::from(input.u32()) | (u64::from(input.u32()) << 32);
                t.write(offset, &value.to_le_bytes()[..width]);
            }
            2 => {
                let index = u16::from(input.u8());
                for _ in 0..TURNS {
                    if t.queue_notify(index) == Work::Done {
                        break;
                    }
                }
            }
            3 => {
                // A fork: whatever state the guest brought the transport
                // to restores, with the same registers and queues (a
                // restored block device serves what its ring already
                // holds, so only its positions, its interrupt and a
                // need for a reset may move on).
                let saved = t.save();
                let restored = MmioTransport::restore(block(), mem.clone(), interrupt(), &saved)
                    .expect("a saved transport restores");
                assert_eq!(
                    registers(&restored.save()),
                    registers(&saved),
                    "restore changed the state"
                );
                t = restored;
            }
            _ => {
                for _ in 0..TURNS {
                    if t.handle_events() == Work::Done {
                        break;
                    }
                }
            }
        }
    }
}

/// A saved transport without what serving the ring changes: the queues'
/// positions, the interrupt status and DEVICE_NEEDS_RESET (a chain the
/// guest broke).
fn registers(state: &TransportState) -> TransportState {
    const DEVICE_NEEDS_RESET: u32 = 0x40;
    let mut s = state.clone();
    s.interrupt_status = 0;
    s.status &= !DEVICE_NEEDS_RESET;
    if let DeviceState::Block(b) = &mut s.device {
        for q in b.queues.iter_mut().flatten() {
            q.next_avail = 0;
            q.next_used = 0;
        }
    }
    s
}
