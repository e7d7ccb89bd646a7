//! Device tests: a unix-socket client on one side, the test playing the
//! guest driver (real descriptor chains in guest memory) on the other.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::EventFd;

use super::packet::{SHUTDOWN_BOTH, SHUTDOWN_RCV, SHUTDOWN_SEND, TYPE_STREAM};
use super::*;
use crate::virtio::testutil::{memory, ro, wo, Driver};

const CID: u64 = 3;
const RX_BUF: u32 = 4096 + HDR_LEN as u32;
const RX_BASE: u64 = 0x10_0000;
const TX_BASE: u64 = 0x30_0000;
const BIG: u64 = 0x60_0000;

struct Harness {
    dev: Vsock,
    mem: &'static GuestMemory,
    rx: Driver<'static>,
    tx: Driver<'static>,
    rx_bufs: HashMap<u32, u64>,
    rx_slot: u64,
    rx_outstanding: usize,
    tx_slot: u64,
    path: PathBuf,
    irq: Arc<EventFd>,
}

impl Drop for Harness {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn uds_path(name: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("fbx-vsock-{}-{name}.sock", std::process::id()));
    let _ = std::fs::remove_file(&p);
    p
}

fn harness(name: &str) -> Harness {
    let path = uds_path(name);
    let dev = Vsock::new(CID, &path).expect("vsock device");
    let mem: &'static GuestMemory = Box::leak(Box::new(memory(0x80_0000)));
    let irq = Arc::new(EventFd::new(libc::EFD_NONBLOCK).expect("eventfd"));
    Harness {
        dev,
        mem,
        rx: Driver::new(mem, 0, QUEUE_SIZE),
        tx: Driver::new(mem, 0x1_0000, QUEUE_SIZE),
        rx_bufs: HashMap::new(),
        rx_slot: 0,
        rx_outstanding: 0,
        tx_slot: 0,
        path,
        irq,
    }
}

fn guest_hdr(op: Op, src_port: u32, dst_port: u32, len: u32) -> Header {
    Header {
        src_cid: CID,
        dst_cid: HOST_CID,
        src_port,
        dst_port,
        len,
        type_: TYPE_STREAM,
        op: op as u16,
        flags: 0,
        buf_alloc: 64 * 1024,
        fwd_cnt: 0,
    }
}

impl Harness {
    fn activate(&mut self) {
        let event = Driver::new(self.mem, 0x2_0000, QUEUE_SIZE);
        let queues = vec![self.rx.queue(), self.tx.queue(), event.queue()];
        self.dev
            .activate(self.mem.clone(), queues, Interrupt::new(self.irq.clone()))
            .expect("activate");
    }

    /// Posts `n` rx buffers (at most 128 outstanding) and kicks the rx
    /// queue.
    fn post_rx(&mut self, n: usize) {
        for _ in 0..n.min(128 - self.rx_outstanding) {
            self.rx_outstanding += 1;
            let addr = RX_BASE + (self.rx_slot % 128) * 0x2000;
            self.rx_slot += 1;
            let head = self.rx.add(&[wo(addr, RX_BUF)]);
            self.rx_bufs.insert(u32::from(head), addr);
        }
        self.dev.queue_notify(RX_QUEUE);
    }

    /// Packets the device put in rx buffers since the last call.
    fn rx_packets(&mut self) -> Vec<(Header, Vec<u8>)> {
        self.rx
            .used()
            .into_iter()
            .map(|(head, len)| {
                self.rx_outstanding -= 1;
                let addr = self.rx_bufs[&head];
                assert!(len as usize >= HDR_LEN, "rx packet of {len} bytes");
                let mut b = vec![0u8; len as usize];
                self.mem
                    .read_slice(&mut b, GuestAddress(addr))
                    .expect("rx read");
                let h = Header::parse(&b).expect("rx header");
                assert_eq!(h.len as usize, b.len() - HDR_LEN, "used len matches header");
                (h, b[HDR_LEN..].to_vec())
            })
            .collect()
    }

    /// The guest sends one packet on the tx queue.
    fn send(&mut self, h: Header, payload: &[u8]) {
        let slot = TX_BASE + (self.tx_slot % 64) * 0x1000;
        self.tx_slot += 1;
        self.mem
            .write_slice(&h.to_bytes(), GuestAddress(slot))
            .expect("tx header");
        if payload.is_empty() {
            self.tx.add(&[ro(slot, HDR_LEN as u32)]);
        } else {
            let at = if payload.len() > 0xf00 {
                BIG
            } else {
                slot + 0x80
            };
            self.mem
                .write_slice(payload, GuestAddress(at))
                .expect("tx payload");
            self.tx
                .add(&[ro(slot, HDR_LEN as u32), ro(at, payload.len() as u32)]);
        }
        self.dev.queue_notify(TX_QUEUE);
        assert!(!self.tx.used().is_empty(), "tx buffer returned");
    }

    fn client(&self) -> UnixStream {
        let s = UnixStream::connect(&self.path).expect("connect to vsock uds");
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("read timeout");
        s
    }

    /// Client connects to guest port `port`; the guest accepts with credit
    /// `buf_alloc`. Returns the client and the host-side port.
    fn connect(&mut self, port: u32, buf_alloc: u32) -> (UnixStream, u32) {
        let mut c = self.client();
        c.write_all(format!("CONNECT {port}\n").as_bytes())
            .expect("write CONNECT");
        self.dev.handle_events();
        self.post_rx(1);
        let pkts = self.rx_packets();
        assert_eq!(pkts.len(), 1, "{pkts:?}");
        let req = pkts[0].0;
        assert_eq!(req.op(), Some(Op::Request));
        assert_eq!(
            (req.src_cid, req.dst_cid, req.dst_port),
            (HOST_CID, CID, port)
        );
        assert_eq!(req.buf_alloc, CONN_BUF_ALLOC);
        let mut resp = guest_hdr(Op::Response, port, req.src_port, 0);
        resp.buf_alloc = buf_alloc;
        self.send(resp, &[]);
        assert_eq!(read_line(&mut c), format!("OK {}", req.src_port));
        (c, req.src_port)
    }
}

fn rw_data(pkts: &[(Header, Vec<u8>)]) -> Vec<u8> {
    pkts.iter()
        .filter(|(p, _)| p.op() == Some(Op::Rw))
        .flat_map(|(_, d)| d.clone())
        .collect()
}

fn read_line(c: &mut UnixStream) -> String {
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    loop {
        c.read_exact(&mut b).expect("read line");
        if b[0] == b'\n' {
            return String::from_utf8(line).expect("utf8 line");
        }
        line.push(b[0]);
    }
}

fn read_n(c: &mut UnixStream, n: usize) -> Vec<u8> {
    let mut b = vec![0u8; n];
    c.read_exact(&mut b).expect("read bytes");
    b
}

fn assert_eof(c: &mut UnixStream) {
    // Closing a unix stream with unread bytes resets it: also "closed".
    let mut b = [0u8; 16];
    match c.read(&mut b) {
        Ok(n) => assert_eq!(n, 0, "EOF"),
        Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset),
    }
}

#[test]
fn vsock_config_and_identity() {
    let h = harness("config");
    let mut cfg = [0u8; 8];
    h.dev.read_config(0, &mut cfg);
    assert_eq!(u64::from_le_bytes(cfg), CID);
    let mut past = [0xffu8; 4];
    h.dev.read_config(6, &mut past);
    assert_eq!(past, [0, 0, 0, 0]);
    assert_eq!(h.dev.device_type(), 19);
    assert_eq!(h.dev.queue_max_sizes().len(), 3);
    assert!(h.dev.event_fd().is_some());
}

#[test]
fn vsock_connect_then_bytes_flow_both_ways() {
    let mut h = harness("basic");
    h.activate();
    let (mut c, port) = h.connect(52, 64 * 1024);
    // Host -> guest.
    c.write_all(b"hello guest").expect("client write");
    h.post_rx(4);
    h.dev.handle_events();
    let pkts = h.rx_packets();
    assert_eq!(pkts.len(), 1, "{pkts:?}");
    let (rw, data) = &pkts[0];
    assert_eq!(rw.op(), Some(Op::Rw));
    assert_eq!((rw.src_port, rw.dst_port), (port, 52));
    assert_eq!(data, b"hello guest");
    assert!(h.irq.read().is_ok(), "interrupt raised");
    // Guest -> host.
    h.send(guest_hdr(Op::Rw, 52, port, 11), b"hello host!");
    assert_eq!(read_n(&mut c, 11), b"hello host!");
    // A large packet goes through too.
    let big: Vec<u8> = (0..MAX_PKT_LEN).map(|i| (i % 253) as u8).collect();
    h.send(guest_hdr(Op::Rw, 52, port, MAX_PKT_LEN), &big);
    assert_eq!(read_n(&mut c, big.len()), big);
    assert_eq!(h.dev.connection_count(), 1);
}

#[test]
fn vsock_bytes_after_connect_line_are_kept() {
    let mut h = harness("prefix");
    h.activate();
    let mut c = h.client();
    c.write_all(b"CONNECT 7\nearly bytes").expect("write");
    h.dev.handle_events();
    h.post_rx(1);
    let req = h.rx_packets()[0].0;
    h.post_rx(2);
    h.send(guest_hdr(Op::Response, 7, req.src_port, 0), &[]);
    assert_eq!(read_line(&mut c), format!("OK {}", req.src_port));
    let pkts = h.rx_packets();
    let data: Vec<u8> = pkts.iter().flat_map(|(_, d)| d.clone()).collect();
    assert_eq!(data, b"early bytes");
}

#[test]
fn vsock_host_data_respects_guest_credit() {
    let mut h = harness("credit");
    h.activate();
    let (mut c, port) = h.connect(52, 8);
    c.write_all(b"0123456789abcdefghij").expect("client write");
    h.post_rx(8);
    h.dev.handle_events();
    let pkts = h.rx_packets();
    assert_eq!(rw_data(&pkts), b"01234567", "no more than the credit");
    assert!(
        pkts.iter().any(|(p, _)| p.op() == Some(Op::CreditRequest)),
        "{pkts:?}"
    );
    // Nothing more until the guest frees space.
    h.dev.handle_events();
    h.dev.queue_notify(RX_QUEUE);
    assert!(h.rx_packets().is_empty());
    let mut upd = guest_hdr(Op::CreditUpdate, 52, port, 0);
    upd.buf_alloc = 8;
    upd.fwd_cnt = 8;
    h.send(upd, &[]);
    assert_eq!(rw_data(&h.rx_packets()), b"89abcdef");
    upd.fwd_cnt = 16;
    h.send(upd, &[]);
    assert_eq!(rw_data(&h.rx_packets()), b"ghij");
}

#[test]
fn vsock_stops_reading_without_rx_buffers() {
    let mut h = harness("norx");
    h.activate();
    let (mut c, _) = h.connect(52, 1 << 20);
    c.write_all(&[7u8; 10_000]).expect("client write");
    h.dev.handle_events();
    assert!(h.rx_packets().is_empty(), "no buffers, no packets");
    h.post_rx(1);
    let pkts = h.rx_packets();
    assert_eq!(pkts.len(), 1);
    assert_eq!(pkts[0].1.len(), 4096);
    h.post_rx(8);
    let total: usize = h.rx_packets().iter().map(|(_, d)| d.len()).sum();
    assert_eq!(total, 10_000 - 4096);
}

#[test]
fn vsock_guest_sends_credit_updates_as_host_drains() {
    let mut h = harness("fwdcnt");
    h.activate();
    let (mut c, port) = h.connect(52, 1 << 20);
    h.post_rx(16);
    let chunk = vec![1u8; 32 * 1024];
    let mut best_fwd = 0;
    for _ in 0..16 {
        h.send(guest_hdr(Op::Rw, 52, port, chunk.len() as u32), &chunk);
        read_n(&mut c, chunk.len());
        for (p, _) in h.rx_packets() {
            assert_eq!(p.op(), Some(Op::CreditUpdate));
            best_fwd = best_fwd.max(p.fwd_cnt);
        }
    }
    assert!(
        best_fwd >= 12 * 32 * 1024,
        "credit updates keep up: {best_fwd}"
    );
}

#[test]
fn vsock_guest_rst_closes_stream() {
    let mut h = harness("rst");
    h.activate();
    let (mut c, port) = h.connect(52, 4096);
    h.send(guest_hdr(Op::Rst, 52, port, 0), &[]);
    assert_eof(&mut c);
    assert_eq!(h.dev.connection_count(), 0);
    h.post_rx(1);
    assert!(h.rx_packets().is_empty(), "no RST answers an RST");
}

#[test]
fn vsock_no_guest_listener_closes_stream() {
    let mut h = harness("nolisten");
    h.activate();
    let mut c = h.client();
    c.write_all(b"CONNECT 9999\n").expect("write");
    h.dev.handle_events();
    h.post_rx(1);
    let req = h.rx_packets()[0].0;
    h.send(guest_hdr(Op::Rst, 9999, req.src_port, 0), &[]);
    assert_eof(&mut c);
}

#[test]
fn vsock_bad_connect_line_closes_stream() {
    let mut h = harness("badline");
    h.activate();
    let mut c = h.client();
    c.write_all(b"HELLO 1\n").expect("write");
    h.dev.handle_events();
    assert_eof(&mut c);
    let mut c = h.client();
    c.write_all(&[b'A'; 100]).expect("write");
    h.dev.handle_events();
    assert_eof(&mut c);
    assert_eq!(h.dev.connection_count(), 0);
}

#[test]
fn vsock_host_eof_then_guest_shutdown_finishes() {
    let mut h = harness("hosteof");
    h.activate();
    let (mut c, port) = h.connect(52, 4096);
    c.write_all(b"last").expect("write");
    c.shutdown(std::net::Shutdown::Write).expect("shutdown");
    h.post_rx(4);
    h.dev.handle_events();
    let pkts = h.rx_packets();
    assert_eq!(pkts[0].1, b"last");
    let sd = pkts.last().expect("shutdown packet").0;
    assert_eq!((sd.op(), sd.flags), (Some(Op::Shutdown), SHUTDOWN_SEND));
    // The guest can still answer.
    h.send(guest_hdr(Op::Rw, 52, port, 5), b"reply");
    assert_eq!(read_n(&mut c, 5), b"reply");
    let mut sd = guest_hdr(Op::Shutdown, 52, port, 0);
    sd.flags = SHUTDOWN_BOTH;
    h.send(sd, &[]);
    assert_eof(&mut c);
    assert_eq!(h.dev.connection_count(), 0);
    let pkts = h.rx_packets();
    assert_eq!(pkts.last().map(|p| p.0.op()), Some(Some(Op::Rst)));
}

#[test]
fn vsock_guest_send_shutdown_closes_host_write_side() {
    let mut h = harness("guestshut");
    h.activate();
    let (mut c, port) = h.connect(52, 4096);
    h.send(guest_hdr(Op::Rw, 52, port, 3), b"bye");
    let mut sd = guest_hdr(Op::Shutdown, 52, port, 0);
    sd.flags = SHUTDOWN_SEND;
    h.send(sd, &[]);
    assert_eq!(read_n(&mut c, 3), b"bye");
    assert_eof(&mut c);
    // Host -> guest still flows.
    c.write_all(b"still").expect("write");
    h.post_rx(2);
    h.dev.handle_events();
    assert_eq!(h.rx_packets()[0].1, b"still");
    // Guest stops receiving too: connection over.
    sd.flags = SHUTDOWN_RCV;
    h.send(sd, &[]);
    assert_eq!(h.dev.connection_count(), 0);
}

#[test]
fn vsock_guest_request_is_refused() {
    let mut h = harness("guestreq");
    h.activate();
    h.post_rx(1);
    h.send(guest_hdr(Op::Request, 1234, 99, 0), &[]);
    let pkts = h.rx_packets();
    assert_eq!(pkts.len(), 1);
    let rst = pkts[0].0;
    assert_eq!(rst.op(), Some(Op::Rst));
    assert_eq!(
        (rst.src_cid, rst.dst_cid, rst.src_port, rst.dst_port),
        (HOST_CID, CID, 99, 1234)
    );
}

#[test]
fn vsock_malformed_packets_do_not_panic() {
    let mut h = harness("malformed");
    h.activate();
    let (mut c, port) = h.connect(52, 4096);
    h.post_rx(8);
    // Wrong CIDs: dropped silently.
    let mut bad = guest_hdr(Op::Rw, 52, port, 0);
    bad.src_cid = 77;
    h.send(bad, &[]);
    let mut bad = guest_hdr(Op::Rw, 52, port, 0);
    bad.dst_cid = 5;
    h.send(bad, &[]);
    assert!(h.rx_packets().is_empty());
    assert_eq!(h.dev.connection_count(), 1);
    // Short header: ignored.
    let slot = TX_BASE + 0x3f000;
    h.tx.add(&[ro(slot, 20)]);
    h.dev.queue_notify(TX_QUEUE);
    // Length beyond the buffers on a live connection: reset.
    h.send(guest_hdr(Op::Rw, 52, port, 5000), b"tiny");
    assert_eof(&mut c);
    let pkts = h.rx_packets();
    assert_eq!(pkts.last().map(|p| p.0.op()), Some(Some(Op::Rst)));
    // Unknown op and unknown type for no connection: RST.
    let mut odd = guest_hdr(Op::Rw, 1, 2, 0);
    odd.op = 0x99;
    h.send(odd, &[]);
    odd.type_ = 9;
    h.send(odd, &[]);
    assert_eq!(h.rx_packets().len(), 2);
}

#[test]
fn vsock_guest_overrunning_credit_is_reset_with_bounded_buffer() {
    let mut h = harness("overrun");
    h.activate();
    let (mut c, port) = h.connect(52, 4096);
    h.post_rx(4);
    let chunk = vec![5u8; MAX_PKT_LEN as usize];
    let mut closed = false;
    for _ in 0..200 {
        h.send(guest_hdr(Op::Rw, 52, port, MAX_PKT_LEN), &chunk);
        match h.dev.backend.conns.get(&port) {
            Some(hc) => assert!(hc.pending_to_host() <= CONN_BUF_ALLOC as usize),
            None => {
                closed = true;
                break;
            }
        }
    }
    assert!(closed, "a guest ignoring credit is reset");
    h.post_rx(16);
    let pkts = h.rx_packets();
    assert!(
        pkts.iter().any(|(p, _)| p.op() == Some(Op::Rst)),
        "{pkts:?}"
    );
    // The client gets what was accepted, then EOF.
    let mut sink = vec![0u8; 1 << 16];
    loop {
        match c.read(&mut sink) {
            Ok(0) => break,
            Ok(n) => assert!(sink[..n].iter().all(|&b| b == 5)),
            Err(e) => {
                assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset);
                break;
            }
        }
    }
}

#[test]
fn vsock_slow_host_reader_gets_everything_in_order() {
    let mut h = harness("slow");
    h.activate();
    let (mut c, port) = h.connect(52, 4096);
    h.post_rx(64);
    let total = 2 * 1024 * 1024usize;
    let mut sent = 0usize;
    let mut got = Vec::with_capacity(total);
    let mut guest_credit_seen = 0u32;
    let mut guest_tx = 0u32;
    let mut buf = vec![0u8; 100_000];
    while got.len() < total {
        // The guest sends what its credit allows.
        for (p, _) in h.rx_packets() {
            guest_credit_seen = guest_credit_seen.max(p.fwd_cnt);
        }
        let free = CONN_BUF_ALLOC - (guest_tx - guest_credit_seen);
        let n = (free as usize).min(MAX_PKT_LEN as usize).min(total - sent);
        if n > 0 {
            let data: Vec<u8> = (sent..sent + n).map(|i| (i % 241) as u8).collect();
            h.send(guest_hdr(Op::Rw, 52, port, n as u32), &data);
            sent += n;
            guest_tx += n as u32;
        }
        h.post_rx(4);
        // The host reads a little, then the device flushes.
        let k = c.read(&mut buf).expect("client read");
        got.extend_from_slice(&buf[..k]);
        h.dev.handle_events();
        assert_eq!(h.dev.connection_count(), 1, "never reset");
    }
    assert!(got.iter().enumerate().all(|(i, &b)| b == (i % 241) as u8));
}

#[test]
fn vsock_many_concurrent_connections() {
    let mut h = harness("many");
    h.activate();
    let mut clients = Vec::new();
    for i in 0..40u32 {
        let mut c = h.client();
        c.write_all(format!("CONNECT {}\n", 1000 + i).as_bytes())
            .expect("write");
        clients.push(c);
    }
    h.dev.handle_events();
    h.post_rx(40);
    let reqs = h.rx_packets();
    assert_eq!(reqs.len(), 40);
    let mut ports = HashMap::new();
    for (r, _) in &reqs {
        assert_eq!(r.op(), Some(Op::Request));
        ports.insert(r.dst_port, r.src_port);
    }
    assert_eq!(ports.len(), 40);
    for (guest, host) in &ports {
        h.send(guest_hdr(Op::Response, *guest, *host, 0), &[]);
    }
    for (i, c) in clients.iter_mut().enumerate() {
        let host = ports[&(1000 + i as u32)];
        assert_eq!(read_line(c), format!("OK {host}"));
        let msg = format!("conn {i}");
        h.send(
            guest_hdr(Op::Rw, 1000 + i as u32, host, msg.len() as u32),
            msg.as_bytes(),
        );
        assert_eq!(read_n(c, msg.len()), msg.as_bytes());
    }
    assert_eq!(h.dev.connection_count(), 40);
    h.dev.reset_connections();
    assert_eq!(h.dev.connection_count(), 0);
    for c in clients.iter_mut() {
        assert_eof(c);
    }
}

#[test]
fn vsock_client_before_activation_is_served_after() {
    let mut h = harness("early");
    let mut c = h.client();
    c.write_all(b"CONNECT 52\n").expect("write");
    h.dev.handle_events();
    h.activate();
    h.post_rx(1);
    let req = h.rx_packets()[0].0;
    h.send(guest_hdr(Op::Response, 52, req.src_port, 0), &[]);
    assert_eq!(read_line(&mut c), format!("OK {}", req.src_port));
    h.dev.reset();
    assert_eof(&mut c);
}

#[test]
fn vsock_random_tx_packets_do_not_panic() {
    let mut h = harness("fuzz");
    h.activate();
    let (_c, port) = h.connect(52, 4096);
    h.post_rx(64);
    let mut x: u64 = 0x1234_5678_9abc_def1;
    let mut rnd = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for _ in 0..3000 {
        let r = rnd();
        let mut hdr = guest_hdr(
            Op::from_u16((r % 9) as u16).unwrap_or(Op::Rw),
            if r & 0x100 == 0 {
                52
            } else {
                (rnd() % 4) as u32
            },
            if r & 0x200 == 0 { port } else { rnd() as u32 },
            (rnd() % 70_000) as u32,
        );
        hdr.op = if r & 0x400 == 0 {
            hdr.op
        } else {
            (rnd() % 12) as u16
        };
        hdr.flags = rnd() as u32;
        hdr.buf_alloc = rnd() as u32;
        hdr.fwd_cnt = rnd() as u32;
        if r & 0x800 != 0 {
            hdr.src_cid = rnd() % 5;
        }
        let payload = vec![0xaau8; (rnd() % 5000) as usize];
        h.send(hdr, &payload);
        // Raw random descriptors on both queues.
        let a = rnd();
        h.tx.write_desc(
            (a % 256) as u16,
            rnd() % 0x90_0000,
            (rnd() % 0x1_0000) as u32,
            (rnd() % 8) as u16,
            (rnd() % 300) as u16,
        );
        // Heads inside the queue: one outside it needs a reset (tested
        // on its own), after which nothing would be served.
        h.tx.publish((rnd() % 256) as u16);
        h.dev.queue_notify(TX_QUEUE);
        h.tx.used();
        if r & 0x1000 != 0 {
            h.post_rx(1);
            h.rx_packets();
        }
        h.dev.handle_events();
    }
}

#[test]
fn vsock_guest_shutdown_then_host_eof_drops_connection() {
    let mut h = harness("bothshut");
    h.activate();
    let (mut c, port) = h.connect(52, 4096);
    let mut sd = guest_hdr(Op::Shutdown, 52, port, 0);
    sd.flags = SHUTDOWN_SEND;
    h.send(sd, &[]);
    assert_eof(&mut c);
    c.shutdown(std::net::Shutdown::Write).expect("shutdown");
    h.post_rx(4);
    h.dev.handle_events();
    let ops: Vec<_> = h.rx_packets().iter().map(|(p, _)| p.op()).collect();
    assert_eq!(ops, vec![Some(Op::Shutdown), Some(Op::Rst)]);
    assert_eq!(h.dev.connection_count(), 0);
}

/// Guest -> host throughput through the device (tx chain -> unix stream),
/// with a reader thread as the host client. Not a pass/fail test: run with
/// `cargo test -p forkbox-devices --release -- --ignored --nocapture bench`.
#[test]
#[ignore = "benchmark"]
fn vsock_bench_guest_to_host_throughput() {
    let mut h = harness("bench");
    h.activate();
    let (mut c, port) = h.connect(52, 1 << 20);
    let total: u64 = 4 << 30;
    let reader = std::thread::spawn(move || {
        let mut buf = vec![0u8; 1 << 20];
        let mut got = 0u64;
        while got < total {
            let n = c.read(&mut buf).expect("bench read");
            assert_ne!(n, 0, "early EOF");
            got += n as u64;
        }
    });
    let payload = vec![0x5au8; MAX_PKT_LEN as usize];
    let start = std::time::Instant::now();
    let (mut sent, mut fwd_seen) = (0u64, 0u32);
    while sent < total {
        let in_flight = (sent as u32).wrapping_sub(fwd_seen);
        if CONN_BUF_ALLOC - in_flight >= MAX_PKT_LEN {
            h.send(guest_hdr(Op::Rw, 52, port, MAX_PKT_LEN), &payload);
            sent += u64::from(MAX_PKT_LEN);
        } else {
            h.dev.handle_events();
        }
        h.post_rx(64);
        for (p, _) in h.rx_packets() {
            fwd_seen = p.fwd_cnt;
        }
    }
    reader.join().expect("reader");
    let secs = start.elapsed().as_secs_f64();
    println!(
        "guest->host: {} MiB in {secs:.2}s = {:.0} MiB/s",
        total >> 20,
        (total >> 20) as f64 / secs
    );
}

#[test]
fn vsock_save_restore_resets_connections_and_keeps_ring_positions() {
    let mut h = harness("save");
    h.activate();
    let (_c, port) = h.connect(52, 4096);
    let saved = h.dev.save();
    let json = serde_json::to_string(&saved).expect("encode");
    let saved: crate::virtio::persist::DeviceState = serde_json::from_str(&json).expect("decode");
    let crate::virtio::persist::DeviceState::Vsock(v) = &saved else {
        panic!("not a vsock state: {saved:?}");
    };
    assert_eq!(
        v.pending_rsts.len(),
        1,
        "one RST owed for the open connection"
    );
    let queues = v.queues.as_ref().expect("active");
    assert_eq!(queues.len(), 3);
    assert!(queues[RX_QUEUE as usize].next_avail > 0 && queues[TX_QUEUE as usize].next_used > 0);
    // A fresh device in the "child", same guest memory and rings.
    let new_path = uds_path("save-child");
    let mut dev = Vsock::new(CID, &new_path).expect("vsock device");
    dev.restore(h.mem.clone(), Interrupt::new(h.irq.clone()), &saved)
        .expect("restore");
    // No rx buffer is free yet: the RST waits, so the state is unchanged.
    assert_eq!(dev.save(), saved);
    let old = std::mem::replace(&mut h.dev, dev);
    drop(old);
    h.post_rx(2);
    let pkts = h.rx_packets();
    assert_eq!(pkts.len(), 1, "{pkts:?}");
    assert_eq!((pkts[0].0.op(), pkts[0].0.src_port), (Some(Op::Rst), port));
    let old = std::mem::replace(&mut h.path, new_path);
    let _ = std::fs::remove_file(old);
    let (mut c2, _) = h.connect(53, 4096);
    c2.write_all(b"x").expect("write");
}

#[test]
fn vsock_restore_rejects_block_state() {
    let path = uds_path("wrong");
    let mut dev = Vsock::new(CID, &path).expect("vsock device");
    let mem = memory(0x10_0000);
    let irq = Arc::new(EventFd::new(libc::EFD_NONBLOCK).expect("eventfd"));
    let state = crate::virtio::persist::DeviceState::Block(crate::virtio::persist::BlockState {
        acked_features: 0,
        queues: None,
    });
    assert!(dev.restore(mem, Interrupt::new(irq), &state).is_err());
    let _ = std::fs::remove_file(path);
}

#[test]
fn vsock_tx_packet_larger_than_the_device_allows_resets_the_connection() {
    let mut h = harness("oversize");
    h.activate();
    let (mut c, port) = h.connect(52, 4096);
    let payload = vec![0x55u8; MAX_PKT_LEN as usize + 1];
    // The header claims 100 bytes; the chain holds more than any packet may.
    h.send(guest_hdr(Op::Rw, 52, port, 100), &payload);
    assert_eof(&mut c);
    assert_eq!(h.dev.connection_count(), 0);
    h.post_rx(4);
    let ops: Vec<_> = h.rx_packets().iter().map(|(p, _)| p.op()).collect();
    assert_eq!(ops, vec![Some(Op::Rst)]);
}
