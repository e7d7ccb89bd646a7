//! The virtio-vsock device, device side: the guest's packets on the tx
//! queue, its rx buffers, and a host client on the device's unix socket.
//!
//! Each input is a list of operations (first byte of each, modulo 10):
//! post rx buffers, send a packet (44 header bytes and a payload, in one,
//! two or three descriptors), send a raw chain of descriptors the input
//! writes, have the client write, read or shut its side, set a queue's
//! avail index to anything, write bytes into guest memory, let the device
//! handle its host events, reset the device. The client connects with
//! `CONNECT 1024` before the first operation, so a packet with the right
//! ports and CIDs reaches a real connection.
//!
//! What must hold: every packet the device puts in an rx buffer is a well
//! formed header from the host's CID to the guest's, whose length matches
//! the used length; the device never sends the guest more data bytes than
//! the client wrote, nor the client more than the guest sent.

use std::io::{ErrorKind, Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};

use forkbox_devices::virtio::vsock::packet::{
    Header, Op, HDR_LEN, HOST_CID, MAX_PKT_LEN, TYPE_STREAM,
};
use forkbox_devices::virtio::vsock::{Vsock, RX_QUEUE, TX_QUEUE};
use forkbox_devices::virtio::VirtioDevice;
use forkbox_devices::{EventSource, GuestMemory};
use vm_memory::{Bytes, GuestAddress};

use crate::input::Input;
use crate::ring::{interrupt, memory, Ring, F_NEXT, F_WRITE};

const CID: u64 = 3;
const MEM: usize = 0x10_0000;
const QUEUE: u16 = 16;
const RX_BASE: u64 = 0x1_0000;
const RX_STRIDE: u64 = 0x2000;
const RX_BUF: u32 = 4096 + HDR_LEN as u32;
const TX_BASE: u64 = 0x4_0000;
const TX_SLOT: u64 = 0x4000;
/// Where the input may write freely (raw chains point here).
const RAW_BASE: u64 = 0x8_0000;
const RAW_LEN: u64 = 0x8_0000;
const MAX_OPS: usize = 256;
const CONNECT: &[u8] = b"CONNECT 1024\n";

static NEXT_SOCKET: AtomicU64 = AtomicU64::new(0);

struct Harness {
    dev: Vsock,
    mem: GuestMemory,
    rx: Ring,
    tx: Ring,
    event: Ring,
    client: Option<UnixStream>,
    rx_next: u16,
    tx_next: u16,
    used_seen: u16,
    /// Host bytes the client wrote after its CONNECT line.
    client_wrote: u64,
    /// Data bytes the device put in rx packets.
    guest_got: u64,
    /// Payload bytes the guest's packets could have carried.
    guest_sent: u64,
    /// Bytes the client read (the `OK <port>` line included).
    client_got: u64,
}

impl Harness {
    fn new() -> Harness {
        let path = std::env::temp_dir().join(format!(
            "forkbox-fuzz-vsock-{}-{}.sock",
            std::process::id(),
            NEXT_SOCKET.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_file(&path);
        let dev = Vsock::new(CID, &path).expect("vsock device");
        let client = UnixStream::connect(&path).expect("connect to the vsock device");
        // The listener keeps working without its name.
        std::fs::remove_file(&path).expect("unlink the vsock socket");
        client.set_nonblocking(true).expect("non-blocking client");
        (&client).write_all(CONNECT).expect("CONNECT line");
        let mut h = Harness {
            dev,
            mem: memory(MEM),
            rx: Ring::at(0, QUEUE),
            tx: Ring::at(0x1000, QUEUE),
            event: Ring::at(0x2000, QUEUE),
            client: Some(client),
            rx_next: 0,
            tx_next: 0,
            used_seen: 0,
            client_wrote: 0,
            guest_got: 0,
            guest_sent: 0,
            client_got: 0,
        };
        h.activate();
        h
    }

    fn activate(&mut self) {
        for r in [self.rx, self.tx, self.event] {
            self.mem
                .write_slice(&[0u8; 4], GuestAddress(r.avail))
                .expect("avail ring");
            self.mem
                .write_slice(&[0u8; 4], GuestAddress(r.used))
                .expect("used ring");
        }
        self.used_seen = 0;
        self.dev.ack_features(self.dev.features());
        let queues = vec![self.rx.queue(), self.tx.queue(), self.event.queue()];
        self.dev
            .activate(self.mem.clone(), queues, interrupt())
            .expect("activate");
        self.check_rx();
    }

    fn post_rx(&mut self, n: u8) {
        for _ in 0..n {
            let i = self.rx_next % QUEUE;
            self.rx_next = self.rx_next.wrapping_add(1);
            self.rx.write_desc(
                &self.mem,
                i,
                RX_BASE + u64::from(i) * RX_STRIDE,
                RX_BUF,
                F_WRITE,
                0,
            );
            self.rx.publish(&self.mem, i);
        }
        self.dev.queue_notify(RX_QUEUE);
    }

    /// Writes descriptors `bufs` (address, length, flags but NEXT) as one
    /// chain, publishes and kicks it.
    fn send_chain(&mut self, bufs: &[(u64, u32, u16)]) {
        let head = self.tx_next % QUEUE;
        for (k, &(addr, len, flags)) in bufs.iter().enumerate() {
            let i = self.tx_next % QUEUE;
            self.tx_next = self.tx_next.wrapping_add(1);
            let more = if k + 1 < bufs.len() { F_NEXT } else { 0 };
            self.tx
                .write_desc(&self.mem, i, addr, len, flags | more, self.tx_next % QUEUE);
        }
        self.tx.publish(&self.mem, head);
        self.dev.queue_notify(TX_QUEUE);
    }

    fn send_packet(&mut self, input: &mut Input<'_>) {
        let hdr = input.array::<HDR_LEN>();
        let plen = input.u16() % 8193;
        let layout = input.u8();
        let payload = input.bytes(usize::from(plen));
        let slot = TX_BASE + u64::from(self.tx_next % QUEUE) * TX_SLOT;
        let mut packet = hdr.to_vec();
        packet.extend_from_slice(payload);
        packet.resize(HDR_LEN + usize::from(plen), 0);
        self.mem
            .write_slice(&packet, GuestAddress(slot))
            .expect("tx packet inside guest memory");
        if let Ok(h) = Header::parse(&hdr) {
            if h.op() == Some(Op::Rw) {
                self.guest_sent += u64::from(h.len.min(u32::from(plen)));
            }
        }
        let all = (HDR_LEN as u32) + u32::from(plen);
        let h = HDR_LEN as u32;
        let half = u32::from(plen) / 2;
        match layout % 3 {
            0 => self.send_chain(&[(slot, all, 0)]),
            1 => self.send_chain(&[(slot, h, 0), (slot + u64::from(h), u32::from(plen), 0)]),
            _ => self.send_chain(&[
                (slot, h, 0),
                (slot + u64::from(h), half, 0),
                (slot + u64::from(h + half), u32::from(plen) - half, 0),
            ]),
        }
    }

    fn send_raw(&mut self, input: &mut Input<'_>) {
        let n = input.u8() % 4 + 1;
        let mut bufs = Vec::new();
        for _ in 0..n {
            let addr = RAW_BASE + u64::from(input.u32()) % RAW_LEN;
            let len = u32::from(input.u16());
            let flags = u16::from(input.u8()) & !F_NEXT;
            bufs.push((addr, len, flags));
        }
        // Whatever it carries, no more than one packet's payload.
        self.guest_sent += u64::from(MAX_PKT_LEN);
        self.send_chain(&bufs);
    }

    fn client_write(&mut self, input: &mut Input<'_>) {
        let n = usize::from(input.u16() % 4096);
        let bytes = input.bytes(n);
        if let Some(c) = self.client.as_mut() {
            match c.write(bytes) {
                Ok(n) => self.client_wrote += n as u64,
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(_) => {}
            }
        }
        self.dev.handle_events();
    }

    fn client_read(&mut self) {
        if let Some(c) = self.client.as_mut() {
            let mut buf = [0u8; 16 * 1024];
            loop {
                match c.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => self.client_got += n as u64,
                    Err(_) => break,
                }
            }
        }
        let line = format!("OK {}\n", 1024).len() as u64;
        assert!(
            self.client_got <= self.guest_sent + line,
            "the client read {} bytes, the guest sent at most {}",
            self.client_got,
            self.guest_sent
        );
        self.dev.handle_events();
    }

    /// Every packet the device gave the guest since the last call.
    fn check_rx(&mut self) {
        let idx = self.rx.used_idx(&self.mem);
        let mut budget = 4 * usize::from(QUEUE) * 64;
        while self.used_seen != idx && budget > 0 {
            budget -= 1;
            let (id, len) = self.rx.used_elem(&self.mem, self.used_seen);
            self.used_seen = self.used_seen.wrapping_add(1);
            assert!(id < u32::from(QUEUE), "rx used id {id}");
            if len == 0 {
                continue;
            }
            assert!(
                (HDR_LEN as u32..=RX_BUF).contains(&len),
                "rx used length {len}"
            );
            let mut b = [0u8; HDR_LEN];
            self.mem
                .read_slice(&mut b, GuestAddress(RX_BASE + u64::from(id) * RX_STRIDE))
                .expect("rx buffer");
            let h = Header::parse(&b).expect("a whole header");
            assert_eq!(
                (h.src_cid, h.dst_cid, h.type_),
                (HOST_CID, CID, TYPE_STREAM),
                "{h:?}"
            );
            assert_eq!(u64::from(h.len) + HDR_LEN as u64, u64::from(len), "{h:?}");
            assert!(h.op().is_some(), "{h:?}");
            if h.op() == Some(Op::Rw) {
                self.guest_got += u64::from(h.len);
            } else {
                assert_eq!(h.len, 0, "{h:?}");
            }
            assert!(
                self.guest_got <= self.client_wrote,
                "the guest got {} bytes, the client wrote {}",
                self.guest_got,
                self.client_wrote
            );
        }
    }
}

pub fn vsock_packets(data: &[u8]) {
    crate::input::no_sigpipe();
    let mut input = Input::new(data);
    let mut h = Harness::new();
    h.dev.handle_events();
    h.check_rx();
    for _ in 0..MAX_OPS {
        if input.is_empty() {
            break;
        }
        match input.u8() % 10 {
            0 => {
                let n = input.u8() % 8 + 1;
                h.post_rx(n);
            }
            1 => h.send_packet(&mut input),
            2 => h.send_raw(&mut input),
            3 => h.client_write(&mut input),
            4 => h.client_read(),
            5 => {
                if input.u8() & 1 == 0 {
                    if let Some(c) = h.client.as_ref() {
                        let _ = c.shutdown(Shutdown::Write);
                    }
                } else {
                    h.client = None;
                }
                h.dev.handle_events();
            }
            6 => {
                let (ring, queue) = if input.u8() & 1 == 0 {
                    (h.rx, RX_QUEUE)
                } else {
                    (h.tx, TX_QUEUE)
                };
                ring.set_avail_idx(&h.mem, input.u16());
                h.dev.queue_notify(queue);
            }
            7 => {
                let at = RAW_BASE + u64::from(input.u16()) * 8 % RAW_LEN;
                let n = usize::from(input.u8());
                let bytes = input.bytes(n);
                let room = (RAW_BASE + RAW_LEN - at) as usize;
                h.mem
                    .write_slice(&bytes[..bytes.len().min(room)], GuestAddress(at))
                    .expect("raw area");
            }
            8 => {
                h.dev.handle_events();
            }
            _ => {
                h.check_rx();
                h.dev.reset();
                h.activate();
            }
        }
        h.check_rx();
    }
}
