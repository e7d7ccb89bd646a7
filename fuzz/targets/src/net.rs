//! The virtio-net device between a guest's queues and a backend.
//!
//! Input: a count of operations (at most 16) and that many operation
//! bytes, a count of frames the backend has for the guest (at most 8) and
//! each one's length (le16, at most 4 KiB, filled with a known pattern),
//! then guest memory from address 0 on: the rx queue (16 entries) laid out
//! at 0, the tx queue (16 entries) at 0x200, and buffers wherever their
//! descriptors point. The guest owns all of it, avail indices included.
//!
//! Operations, by the byte modulo 5: kick rx, kick tx, the backend's
//! event (frames for the guest arrive), a save and restore into a new
//! device (a fork), a reset and activation again.
//!
//! What must hold beyond "no panic": every frame handed to the backend is
//! at most `MAX_FRAME` bytes; every turn ends; every frame the backend gave
//! up was delivered or dropped and counted (or is the one waiting for a
//! buffer); every state the device reaches restores.

use std::collections::VecDeque;
use std::os::fd::RawFd;
use std::sync::{Arc, Mutex};

use forkbox_devices::virtio::net::{FrameBackend, Net, MAX_FRAME};
use forkbox_devices::virtio::VirtioDevice;
use forkbox_devices::{EventSource, Work};
use vm_memory::{Bytes, GuestAddress};

use crate::input::Input;
use crate::ring::{interrupt, memory, Ring};

const MEM: usize = 0x4_0000;
const QUEUE: u16 = 16;
const MAX_OPS: u8 = 16;
const MAX_FRAMES: u8 = 8;
const MAX_RX_FRAME: u16 = 4096;
/// Turns of the VMM's loop one operation gets.
const TURNS: usize = 8;
const MAC: [u8; 6] = [0x02, 0xfb, 0, 0, 0, 1];

/// What went through the backend, shared with the harness.
#[derive(Default)]
struct Wire {
    to_guest: VecDeque<Vec<u8>>,
    handed_out: u64,
    from_guest: u64,
}

#[derive(Clone, Default)]
struct Backend(Arc<Mutex<Wire>>);

impl Backend {
    fn wire(&self) -> std::sync::MutexGuard<'_, Wire> {
        self.0.lock().expect("the fuzz wire")
    }
}

impl FrameBackend for Backend {
    fn send(&mut self, frame: &[u8]) {
        assert!(
            frame.len() <= MAX_FRAME,
            "a {}-byte frame reached the backend",
            frame.len()
        );
        self.wire().from_guest += 1;
    }

    fn flush(&mut self) {}

    fn recv(&mut self) -> Option<Vec<u8>> {
        let mut wire = self.wire();
        let frame = wire.to_guest.pop_front()?;
        wire.handed_out += 1;
        Some(frame)
    }

    fn event_fd(&self) -> Option<RawFd> {
        None
    }

    fn handle_events(&mut self) {}
}

/// Runs `turn` until it says the work is done, at most [`TURNS`] times.
fn turns(mut turn: impl FnMut() -> Work) {
    for _ in 0..TURNS {
        if turn() == Work::Done {
            break;
        }
    }
}

pub fn virtio_net(data: &[u8]) {
    let mut input = Input::new(data);
    let ops: Vec<u8> = {
        let n = input.u8() % (MAX_OPS + 1);
        (0..n).map(|_| input.u8()).collect()
    };
    let backend = Backend::default();
    {
        let n = input.u8() % (MAX_FRAMES + 1);
        let mut wire = backend.wire();
        for i in 0..n {
            let len = input.u16() % (MAX_RX_FRAME + 1);
            wire.to_guest
                .push_back((0..len).map(|b| (b as u8) ^ i).collect());
        }
    }
    let mem = memory(MEM);
    let image = input.rest();
    mem.write_slice(&image[..image.len().min(MEM)], GuestAddress(0))
        .expect("guest memory image");
    let rings = [Ring::at(0, QUEUE), Ring::at(0x200, QUEUE)];
    let queues = || rings.iter().map(Ring::queue).collect::<Vec<_>>();

    let mut net = Net::new(MAC, Box::new(backend.clone()));
    net.ack_features(net.features());
    net.activate(mem.clone(), queues(), interrupt())
        .expect("activate");
    // Frames the device itself counted before a restore replaced it.
    let mut counted = 0u64;
    // Frames a fork or a reset may lose: the one waiting for a buffer.
    let mut may_lose = 1u64;
    for op in ops {
        match op % 5 {
            0 => turns(|| net.queue_notify(0)),
            1 => turns(|| net.queue_notify(1)),
            2 => turns(|| net.handle_events()),
            3 => {
                let state = net.save();
                let c = net.counters();
                counted += c.rx_frames + c.rx_dropped;
                let mut child = Net::new([0; 6], Box::new(backend.clone()));
                child
                    .restore(mem.clone(), interrupt(), &state)
                    .unwrap_or_else(|e| panic!("a state the device reached does not restore: {e}"));
                net = child;
                may_lose += 1;
            }
            _ => {
                net.reset();
                may_lose += 1;
                net.ack_features(net.features());
                net.activate(mem.clone(), queues(), interrupt())
                    .expect("activate again");
            }
        }
    }
    let c = net.counters();
    let delivered_or_dropped = counted + c.rx_frames + c.rx_dropped;
    let handed_out = backend.wire().handed_out;
    // A frame taken from the backend is delivered, dropped (and counted),
    // waiting for a buffer (at most one), or lost with a reset or a fork
    // (at most one each time, as on a wire).
    assert!(
        delivered_or_dropped <= handed_out && handed_out - delivered_or_dropped <= may_lose,
        "{delivered_or_dropped} frames delivered or dropped of {handed_out} handed out \
         (at most {may_lose} may be lost)"
    );
}
