//! One host-initiated vsock stream connection, sans-IO: its state, the
//! credit accounting of both directions, and the control packets it owes
//! the guest. The device feeds it the guest's packets and the byte counts
//! it moved; the connection says what to do next.
//!
//! Credit (virtio 1.x §5.10.6.3): each side advertises `buf_alloc` (its
//! receive buffer) and `fwd_cnt` (bytes it has consumed). A sender may have
//! at most `buf_alloc - (tx_cnt - fwd_cnt)` bytes in flight.

use std::num::Wrapping;

use super::packet::{
    Header, Op, HOST_CID, SHUTDOWN_BOTH, SHUTDOWN_RCV, SHUTDOWN_SEND, TYPE_STREAM,
};

/// Where a connection is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    /// We sent (or will send) REQUEST and wait for RESPONSE or RST.
    Connecting,
    /// RESPONSE received: data flows.
    Established,
}

/// What the device must do after a guest packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Nothing beyond what the connection already recorded.
    None,
    /// The guest accepted: tell the host client `OK <local port>`.
    Established,
    /// `len` payload bytes must be forwarded to the host stream.
    Data { len: u32 },
    /// The guest will send no more: shut the host stream's write side once
    /// pending bytes are flushed.
    PeerSendShutdown,
    /// The connection is over: close the host stream, drop the connection.
    /// `reply` says whether the guest is owed an RST.
    Close { reply: bool },
}

/// Pending control packets, as bits.
const PENDING_REQUEST: u8 = 1;
const PENDING_CREDIT_UPDATE: u8 = 2;
const PENDING_CREDIT_REQUEST: u8 = 4;
const PENDING_SHUTDOWN: u8 = 8;

#[derive(Clone, Debug)]
pub struct Conn {
    guest_cid: u64,
    local_port: u32,
    peer_port: u32,
    state: State,
    /// Our receive buffer (guest -> host bytes we may hold).
    buf_alloc: u32,
    /// Guest bytes we have handed to the host stream.
    fwd_cnt: Wrapping<u32>,
    /// `fwd_cnt` as last told to the guest.
    fwd_cnt_sent: Wrapping<u32>,
    /// Guest bytes received.
    rx_cnt: Wrapping<u32>,
    /// The guest's receive buffer and consumed count.
    peer_buf_alloc: u32,
    peer_fwd_cnt: Wrapping<u32>,
    /// Bytes sent to the guest.
    tx_cnt: Wrapping<u32>,
    /// SHUTDOWN flags the guest sent.
    peer_shutdown: u32,
    /// SHUTDOWN flags we sent (or queued).
    local_shutdown: u32,
    pending: u8,
    /// We asked for credit and have not heard back.
    credit_requested: bool,
}

impl Conn {
    /// A connection the host opens to `peer_port` in the guest; it owes
    /// the guest a REQUEST.
    pub fn connect(guest_cid: u64, local_port: u32, peer_port: u32, buf_alloc: u32) -> Conn {
        Conn {
            guest_cid,
            local_port,
            peer_port,
            state: State::Connecting,
            buf_alloc,
            fwd_cnt: Wrapping(0),
            fwd_cnt_sent: Wrapping(0),
            rx_cnt: Wrapping(0),
            peer_buf_alloc: 0,
            peer_fwd_cnt: Wrapping(0),
            tx_cnt: Wrapping(0),
            peer_shutdown: 0,
            local_shutdown: 0,
            pending: PENDING_REQUEST,
            credit_requested: false,
        }
    }

    pub fn state(&self) -> State {
        self.state
    }

    pub fn local_port(&self) -> u32 {
        self.local_port
    }

    pub fn peer_port(&self) -> u32 {
        self.peer_port
    }

    /// Whether a guest packet with these ports belongs to this connection.
    pub fn matches(&self, hdr: &Header) -> bool {
        hdr.dst_port == self.local_port && hdr.src_port == self.peer_port
    }

    /// Bytes we may still send the guest.
    pub fn peer_credit(&self) -> u32 {
        let in_flight = (self.tx_cnt - self.peer_fwd_cnt).0;
        self.peer_buf_alloc.saturating_sub(in_flight)
    }

    /// Guest bytes received but not yet forwarded to the host.
    pub fn unforwarded(&self) -> u32 {
        (self.rx_cnt - self.fwd_cnt).0
    }

    /// The guest told us it will receive no more.
    pub fn peer_rcv_shutdown(&self) -> bool {
        self.peer_shutdown & SHUTDOWN_RCV != 0
    }

    /// The guest told us it will send no more.
    pub fn peer_send_shutdown(&self) -> bool {
        self.peer_shutdown & SHUTDOWN_SEND != 0
    }

    /// We told (or will tell) the guest the host sends no more.
    pub fn local_send_shutdown(&self) -> bool {
        self.local_shutdown & SHUTDOWN_SEND != 0
    }

    /// Whether host -> guest data may flow now (credit permitting).
    pub fn can_send_data(&self) -> bool {
        self.state == State::Established && !self.peer_rcv_shutdown() && !self.local_send_shutdown()
    }

    pub fn has_pending_control(&self) -> bool {
        self.pending != 0
    }

    /// Both directions are finished: the connection can be dropped once
    /// the host-bound bytes are flushed (the guest is owed an RST).
    pub fn is_done(&self) -> bool {
        self.peer_shutdown == SHUTDOWN_BOTH
            || (self.peer_send_shutdown() && self.local_send_shutdown())
    }

    /// Applies a guest packet addressed to this connection. `payload` is
    /// the number of payload bytes the packet's buffers actually hold.
    pub fn on_packet(&mut self, hdr: &Header, payload: u32) -> Action {
        if hdr.type_ != TYPE_STREAM {
            return Action::Close { reply: true };
        }
        self.peer_buf_alloc = hdr.buf_alloc;
        self.peer_fwd_cnt = Wrapping(hdr.fwd_cnt);
        if self.peer_credit() > 0 {
            self.credit_requested = false;
        }
        match (hdr.op(), self.state) {
            (Some(Op::Rst), _) => Action::Close { reply: false },
            (Some(Op::Response), State::Connecting) => {
                self.state = State::Established;
                Action::Established
            }
            (Some(Op::Rw), State::Established) => {
                if hdr.len > payload || self.peer_send_shutdown() {
                    return Action::Close { reply: true };
                }
                // Never hold more than we advertised.
                if u64::from(self.unforwarded()) + u64::from(hdr.len) > u64::from(self.buf_alloc) {
                    tracing::debug!(port = self.local_port, "guest exceeded its vsock credit");
                    return Action::Close { reply: true };
                }
                self.rx_cnt += hdr.len;
                if hdr.len == 0 {
                    return Action::None;
                }
                Action::Data { len: hdr.len }
            }
            (Some(Op::CreditUpdate), State::Established) => Action::None,
            (Some(Op::CreditRequest), State::Established) => {
                self.pending |= PENDING_CREDIT_UPDATE;
                Action::None
            }
            (Some(Op::Shutdown), State::Established) => {
                let new = hdr.flags & SHUTDOWN_BOTH & !self.peer_shutdown;
                self.peer_shutdown |= hdr.flags & SHUTDOWN_BOTH;
                if new & SHUTDOWN_SEND != 0 {
                    Action::PeerSendShutdown
                } else {
                    Action::None
                }
            }
            // REQUEST on an existing connection, anything before RESPONSE,
            // unknown ops: protocol errors.
            _ => Action::Close { reply: true },
        }
    }

    /// Records `n` guest bytes handed to the host stream; queues a credit
    /// update when the guest could be running short.
    pub fn forwarded(&mut self, n: u32) {
        self.fwd_cnt += n;
        let untold = (self.fwd_cnt - self.fwd_cnt_sent).0;
        let guest_free = self
            .buf_alloc
            .saturating_sub((self.rx_cnt - self.fwd_cnt_sent).0);
        if untold > 0 && (untold >= self.buf_alloc / 4 || guest_free < self.buf_alloc / 4) {
            self.pending |= PENDING_CREDIT_UPDATE;
        }
    }

    /// The host stream reached EOF: owe the guest SHUTDOWN(SEND).
    pub fn host_eof(&mut self) {
        if !self.local_send_shutdown() {
            self.local_shutdown |= SHUTDOWN_SEND;
            self.pending |= PENDING_SHUTDOWN;
        }
    }

    /// There is host data but no credit: ask the guest once.
    pub fn want_credit(&mut self) {
        if !self.credit_requested {
            self.credit_requested = true;
            self.pending |= PENDING_CREDIT_REQUEST;
        }
    }

    fn header(&mut self, op: Op) -> Header {
        self.fwd_cnt_sent = self.fwd_cnt;
        self.pending &= !PENDING_CREDIT_UPDATE;
        Header {
            src_cid: HOST_CID,
            dst_cid: self.guest_cid,
            src_port: self.local_port,
            dst_port: self.peer_port,
            len: 0,
            type_: TYPE_STREAM,
            op: op as u16,
            flags: 0,
            buf_alloc: self.buf_alloc,
            fwd_cnt: self.fwd_cnt.0,
        }
    }

    /// The next control packet owed to the guest, if any.
    pub fn next_control(&mut self) -> Option<Header> {
        let order = [
            (PENDING_REQUEST, Op::Request),
            (PENDING_SHUTDOWN, Op::Shutdown),
            (PENDING_CREDIT_UPDATE, Op::CreditUpdate),
            (PENDING_CREDIT_REQUEST, Op::CreditRequest),
        ];
        let &(bit, op) = order.iter().find(|(bit, _)| self.pending & bit != 0)?;
        self.pending &= !bit;
        let mut h = self.header(op);
        if op == Op::Shutdown {
            h.flags = self.local_shutdown;
        }
        Some(h)
    }

    /// The header of a data packet of `len` bytes (at most
    /// [`Conn::peer_credit`]), recording them as sent.
    pub fn data_header(&mut self, len: u32) -> Header {
        let mut h = self.header(Op::Rw);
        h.len = len;
        self.tx_cnt += len;
        h
    }

    /// An RST for this connection (it is being dropped).
    pub fn rst(&mut self) -> Header {
        self.header(Op::Rst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CID: u64 = 3;

    fn from_guest(c: &Conn, op: Op, len: u32, buf_alloc: u32, fwd_cnt: u32) -> Header {
        Header {
            src_cid: CID,
            dst_cid: HOST_CID,
            src_port: c.peer_port(),
            dst_port: c.local_port(),
            len,
            type_: TYPE_STREAM,
            op: op as u16,
            flags: 0,
            buf_alloc,
            fwd_cnt,
        }
    }

    fn established(buf_alloc: u32, peer_buf: u32) -> Conn {
        let mut c = Conn::connect(CID, 1024, 52, buf_alloc);
        let req = c.next_control().expect("request owed");
        assert_eq!(req.op(), Some(Op::Request));
        assert_eq!(
            (req.src_cid, req.dst_cid, req.src_port, req.dst_port),
            (2, CID, 1024, 52)
        );
        assert_eq!(req.buf_alloc, buf_alloc);
        assert!(c.next_control().is_none());
        let resp = from_guest(&c, Op::Response, 0, peer_buf, 0);
        assert_eq!(c.on_packet(&resp, 0), Action::Established);
        c
    }

    #[test]
    fn conn_peer_credit_limits_data() {
        let mut c = established(1000, 100);
        assert_eq!(c.peer_credit(), 100);
        let h = c.data_header(60);
        assert_eq!((h.op(), h.len), (Some(Op::Rw), 60));
        assert_eq!(c.peer_credit(), 40);
        c.data_header(40);
        assert_eq!(c.peer_credit(), 0);
        c.want_credit();
        c.want_credit();
        assert_eq!(
            c.next_control().map(|h| h.op()),
            Some(Some(Op::CreditRequest))
        );
        assert!(c.next_control().is_none(), "credit requested once");
        let upd = from_guest(&c, Op::CreditUpdate, 0, 100, 70);
        assert_eq!(c.on_packet(&upd, 0), Action::None);
        assert_eq!(c.peer_credit(), 70);
        // The guest shrinking its buffer below in-flight bytes: no credit.
        let upd = from_guest(&c, Op::CreditUpdate, 0, 10, 70);
        c.on_packet(&upd, 0);
        assert_eq!(c.peer_credit(), 0);
    }

    #[test]
    fn conn_guest_exceeding_credit_is_closed() {
        let mut c = established(100, 100);
        let rw = from_guest(&c, Op::Rw, 80, 100, 0);
        assert_eq!(c.on_packet(&rw, 80), Action::Data { len: 80 });
        let rw = from_guest(&c, Op::Rw, 30, 100, 0);
        assert_eq!(c.on_packet(&rw, 30), Action::Close { reply: true });
    }

    #[test]
    fn conn_len_beyond_buffers_is_closed() {
        let mut c = established(100, 100);
        let rw = from_guest(&c, Op::Rw, 50, 100, 0);
        assert_eq!(c.on_packet(&rw, 49), Action::Close { reply: true });
    }

    #[test]
    fn conn_forwarding_queues_credit_update() {
        let mut c = established(1000, 100);
        let rw = from_guest(&c, Op::Rw, 100, 100, 0);
        c.on_packet(&rw, 100);
        c.forwarded(100);
        assert!(!c.has_pending_control(), "small progress, guest not short");
        for _ in 0..7 {
            let rw = from_guest(&c, Op::Rw, 100, 100, 0);
            c.on_packet(&rw, 100);
            c.forwarded(100);
        }
        let upd = c.next_control().expect("credit update owed");
        assert_eq!((upd.op(), upd.fwd_cnt), (Some(Op::CreditUpdate), 800));
        // Data packets carry fwd_cnt too and clear the debt.
        c.forwarded(0);
        assert!(!c.has_pending_control());
    }

    #[test]
    fn conn_credit_request_is_answered() {
        let mut c = established(1000, 100);
        let req = from_guest(&c, Op::CreditRequest, 0, 100, 0);
        c.on_packet(&req, 0);
        let upd = c.next_control().expect("update owed");
        assert_eq!((upd.op(), upd.buf_alloc), (Some(Op::CreditUpdate), 1000));
    }

    #[test]
    fn conn_shutdowns_finish_the_connection() {
        let mut c = established(1000, 100);
        c.host_eof();
        let sd = c.next_control().expect("shutdown owed");
        assert_eq!((sd.op(), sd.flags), (Some(Op::Shutdown), SHUTDOWN_SEND));
        assert!(!c.can_send_data());
        assert!(!c.is_done());
        let mut sd = from_guest(&c, Op::Shutdown, 0, 100, 0);
        sd.flags = SHUTDOWN_SEND;
        assert_eq!(c.on_packet(&sd, 0), Action::PeerSendShutdown);
        assert!(c.is_done());
    }

    #[test]
    fn conn_guest_full_shutdown_is_done() {
        let mut c = established(1000, 100);
        let mut sd = from_guest(&c, Op::Shutdown, 0, 100, 0);
        sd.flags = SHUTDOWN_BOTH;
        assert_eq!(c.on_packet(&sd, 0), Action::PeerSendShutdown);
        assert!(c.is_done());
        assert!(!c.can_send_data());
    }

    #[test]
    fn conn_rst_and_protocol_errors_close() {
        let mut c = Conn::connect(CID, 1024, 52, 100);
        let rst = from_guest(&c, Op::Rst, 0, 0, 0);
        assert_eq!(c.on_packet(&rst, 0), Action::Close { reply: false });
        let rw = from_guest(&c, Op::Rw, 0, 0, 0);
        assert_eq!(c.on_packet(&rw, 0), Action::Close { reply: true });
        let mut c = established(100, 100);
        let mut bad = from_guest(&c, Op::Rw, 0, 0, 0);
        bad.op = 42;
        assert_eq!(c.on_packet(&bad, 0), Action::Close { reply: true });
        let req = from_guest(&c, Op::Request, 0, 0, 0);
        assert_eq!(c.on_packet(&req, 0), Action::Close { reply: true });
    }
}
