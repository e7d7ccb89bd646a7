//! A guest made of a second smoltcp interface, frames carried both ways in
//! memory, a table resolver and an in-memory connector.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::time::Duration;

use smoltcp::iface::{Config, Interface, SocketHandle, SocketSet};
use smoltcp::socket::{tcp, udp};
use smoltcp::wire::{
    ArpOperation, ArpPacket, ArpRepr, EthernetAddress, EthernetFrame, EthernetProtocol, IpAddress,
    IpCidr, IpEndpoint, IpProtocol, Ipv4Packet, TcpPacket, TcpSeqNumber, UdpPacket,
};

use super::super::device::QueueDevice;
use super::super::*;
use crate::dns::{ResolveError, Resolver};

const GUEST_MAC: EthernetAddress = EthernetAddress([0x02, 0, 0, 0, 0, 0x0f]);

#[derive(Default)]
pub struct Table {
    pub names: HashMap<String, Result<Vec<Ipv4Addr>, ResolveError>>,
}

impl Resolver for Table {
    fn resolve_v4(&mut self, name: &str) -> Result<Vec<Ipv4Addr>, ResolveError> {
        self.names
            .get(name)
            .cloned()
            .unwrap_or(Err(ResolveError::NotFound))
    }
}

/// What the in-memory connector does with every request.
#[derive(Clone)]
pub enum Behavior {
    Echo,
    Refuse,
    /// The host side's policy says no.
    BrokerDeny,
    Defer,
    /// Send these bytes, then end the stream.
    Greet(Vec<u8>),
}

pub struct MemConnector {
    pub behavior: Behavior,
    pub requests: Vec<ConnectRequest>,
}

impl Connector for MemConnector {
    fn connect(&mut self, request: &ConnectRequest) -> Option<ConnectOutcome> {
        self.requests.push(request.clone());
        match &self.behavior {
            Behavior::Echo => Some(ConnectOutcome::Connected(Box::new(EchoStream::default()))),
            Behavior::Refuse => Some(ConnectOutcome::Refused("connection refused".into())),
            Behavior::BrokerDeny => Some(ConnectOutcome::Denied("an address of this host".into())),
            Behavior::Defer => None,
            Behavior::Greet(bytes) => Some(ConnectOutcome::Connected(Box::new(Greeter {
                data: bytes.clone(),
                at: 0,
            }))),
        }
    }
}

pub struct Greeter {
    data: Vec<u8>,
    at: usize,
}

impl Greeter {
    pub fn new(data: &[u8]) -> Self {
        Self {
            data: data.to_vec(),
            at: 0,
        }
    }
}

impl Read for Greeter {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        let n = out.len().min(self.data.len() - self.at);
        out[..n].copy_from_slice(&self.data[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

impl Write for Greeter {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        Ok(data.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl HostStream for Greeter {
    fn shutdown_write(&mut self) -> io::Result<()> {
        Ok(())
    }
}

pub struct Net {
    pub gw: Gateway<Table, MemConnector>,
    iface: Interface,
    device: QueueDevice,
    sockets: SocketSet<'static>,
    received: HashMap<SocketHandle, Vec<u8>>,
    udp: SocketHandle,
    next_port: u16,
    clock: Duration,
    /// The largest frame seen each way: (guest → gateway, gateway → guest).
    pub largest: (usize, usize),
}

impl Net {
    pub fn new(policy: &str, behavior: Behavior) -> Self {
        let clock = Duration::from_secs(1);
        let now = Now {
            monotonic: clock,
            unix_ms: 1_700_000_000_000,
        };
        let config = GatewayConfig {
            sandbox: "sb-test".into(),
            random_seed: 42,
            ..GatewayConfig::default()
        };
        let policy = Policy::from_json(policy).expect("test policy parses");
        let connector = MemConnector {
            behavior,
            requests: Vec::new(),
        };
        let gw = Gateway::new(config, policy, Table::default(), connector, now);

        let mut device = QueueDevice::new(usize::MAX, usize::MAX);
        let mut cfg = Config::new(GUEST_MAC.into());
        cfg.random_seed = 7;
        let mut iface = Interface::new(cfg, &mut device, now.instant());
        iface.update_ip_addrs(|a| {
            a.push(IpCidr::new(IpAddress::Ipv4(GUEST_IP), PREFIX_LEN))
                .expect("room for one address");
        });
        iface
            .routes_mut()
            .add_default_ipv4_route(GATEWAY_IP)
            .expect("room for one route");
        let mut sockets = SocketSet::new(Vec::new());
        let mut u = udp::Socket::new(
            udp::PacketBuffer::new(vec![udp::PacketMetadata::EMPTY; 8], vec![0; 4096]),
            udp::PacketBuffer::new(vec![udp::PacketMetadata::EMPTY; 8], vec![0; 4096]),
        );
        u.bind(33_333).expect("bind");
        let udp = sockets.add(u);
        Self {
            gw,
            iface,
            device,
            sockets,
            received: HashMap::new(),
            udp,
            next_port: 49_152,
            clock,
            largest: (0, 0),
        }
    }

    pub fn now(&self) -> Now {
        Now {
            monotonic: self.clock,
            unix_ms: 1_700_000_000_000 + self.clock.as_millis() as u64,
        }
    }

    pub fn advance(&mut self, by: Duration) {
        self.clock += by;
    }

    /// One round: the guest runs, its frames reach the gateway, the
    /// gateway runs, its frames reach the guest, the guest runs again.
    pub fn step(&mut self) {
        let now = self.now();
        self.iface
            .poll(now.instant(), &mut self.device, &mut self.sockets);
        while let Some(f) = self.device.tx.pop_front() {
            self.largest.0 = self.largest.0.max(f.len());
            self.gw.receive_frame(&f, now);
        }
        self.gw.poll(now);
        while let Some(f) = self.gw.take_frame() {
            self.largest.1 = self.largest.1.max(f.len());
            self.device.rx.push_back(f);
        }
        self.iface
            .poll(now.instant(), &mut self.device, &mut self.sockets);
        let handles: Vec<SocketHandle> = self.received.keys().copied().collect();
        for h in handles {
            let sock = self.sockets.get_mut::<tcp::Socket>(h);
            let mut buf = [0u8; 4096];
            while let Ok(n) = sock.recv_slice(&mut buf) {
                if n == 0 {
                    break;
                }
                self.received
                    .entry(h)
                    .or_default()
                    .extend_from_slice(&buf[..n]);
            }
        }
    }

    pub fn run_ms(&mut self, ms: u64) {
        for _ in 0..ms {
            self.advance(Duration::from_millis(1));
            self.step();
        }
    }

    /// Step 1 ms at a time until `done`, for at most `ms`.
    pub fn run_until(&mut self, ms: u64, mut done: impl FnMut(&mut Self) -> bool) -> bool {
        for _ in 0..ms {
            self.advance(Duration::from_millis(1));
            self.step();
            if done(self) {
                return true;
            }
        }
        false
    }

    pub fn connect(&mut self, to: SocketAddrV4) -> SocketHandle {
        let mut s = tcp::Socket::new(
            tcp::SocketBuffer::new(vec![0; 64 * 1024]),
            tcp::SocketBuffer::new(vec![0; 64 * 1024]),
        );
        let remote = IpEndpoint::new(IpAddress::Ipv4(*to.ip()), to.port());
        s.connect(self.iface.context(), remote, self.next_port)
            .expect("guest connect");
        self.next_port += 1;
        let h = self.sockets.add(s);
        self.received.insert(h, Vec::new());
        h
    }

    /// A guest socket listening on `port`; what it receives is recorded.
    pub fn listen(&mut self, port: u16) -> SocketHandle {
        let mut s = tcp::Socket::new(
            tcp::SocketBuffer::new(vec![0; 64 * 1024]),
            tcp::SocketBuffer::new(vec![0; 64 * 1024]),
        );
        s.listen(port).expect("guest listen");
        let h = self.sockets.add(s);
        self.received.insert(h, Vec::new());
        h
    }

    pub fn state(&self, h: SocketHandle) -> tcp::State {
        self.sockets.get::<tcp::Socket>(h).state()
    }

    /// Queue what fits; returns how much did.
    pub fn send(&mut self, h: SocketHandle, data: &[u8]) -> usize {
        self.sockets
            .get_mut::<tcp::Socket>(h)
            .send_slice(data)
            .unwrap_or(0)
    }

    pub fn received(&self, h: SocketHandle) -> &[u8] {
        self.received.get(&h).map(Vec::as_slice).unwrap_or(&[])
    }

    pub fn close(&mut self, h: SocketHandle) {
        self.sockets.get_mut::<tcp::Socket>(h).close();
    }

    pub fn udp_send(&mut self, to: SocketAddrV4, data: &[u8]) {
        let remote = IpEndpoint::new(IpAddress::Ipv4(*to.ip()), to.port());
        self.sockets
            .get_mut::<udp::Socket>(self.udp)
            .send_slice(data, remote)
            .expect("udp send");
    }

    /// Ask the gateway's DNS server; the reply, if one came within 100 ms.
    pub fn dns(&mut self, query: &[u8]) -> Option<Vec<u8>> {
        self.udp_send(SocketAddrV4::new(GATEWAY_IP, 53), query);
        for _ in 0..100 {
            self.advance(Duration::from_millis(1));
            self.step();
            if let Ok((payload, _)) = self.sockets.get_mut::<udp::Socket>(self.udp).recv() {
                return Some(payload.to_vec());
            }
        }
        None
    }
}

const ETH: usize = 14;
const IP: usize = 20;

fn ipv4_frame(proto: IpProtocol, dst: Ipv4Addr, l4: &[u8]) -> Vec<u8> {
    let mut frame = vec![0u8; ETH + IP + l4.len()];
    let mut eth = EthernetFrame::new_unchecked(&mut frame[..]);
    eth.set_dst_addr(EthernetAddress(GATEWAY_MAC));
    eth.set_src_addr(GUEST_MAC);
    eth.set_ethertype(EthernetProtocol::Ipv4);
    let mut ip = Ipv4Packet::new_unchecked(&mut frame[ETH..]);
    ip.set_version(4);
    ip.set_header_len(IP as u8);
    ip.set_total_len((IP + l4.len()) as u16);
    ip.set_hop_limit(64);
    ip.set_next_header(proto);
    ip.set_src_addr(GUEST_IP);
    ip.set_dst_addr(dst);
    ip.fill_checksum();
    frame[ETH + IP..].copy_from_slice(l4);
    frame
}

/// A guest SYN from `GUEST_IP:src_port`, as a raw frame.
pub fn syn_frame(src_port: u16, to: SocketAddrV4) -> Vec<u8> {
    let mut seg = vec![0u8; 20];
    let mut tcp = TcpPacket::new_unchecked(&mut seg[..]);
    tcp.set_src_port(src_port);
    tcp.set_dst_port(to.port());
    tcp.set_seq_number(TcpSeqNumber(1_000));
    tcp.set_header_len(20);
    tcp.clear_flags();
    tcp.set_syn(true);
    tcp.set_window_len(65_535);
    tcp.fill_checksum(&IpAddress::Ipv4(GUEST_IP), &IpAddress::Ipv4(*to.ip()));
    ipv4_frame(IpProtocol::Tcp, *to.ip(), &seg)
}

pub fn udp_frame(src_port: u16, to: SocketAddrV4, payload: &[u8]) -> Vec<u8> {
    let mut seg = vec![0u8; 8 + payload.len()];
    let mut udp = UdpPacket::new_unchecked(&mut seg[..]);
    udp.set_src_port(src_port);
    udp.set_dst_port(to.port());
    udp.set_len((8 + payload.len()) as u16);
    udp.payload_mut().copy_from_slice(payload);
    udp.fill_checksum(&IpAddress::Ipv4(GUEST_IP), &IpAddress::Ipv4(*to.ip()));
    ipv4_frame(IpProtocol::Udp, *to.ip(), &seg)
}

/// "Who has `target`?" from the guest.
pub fn arp_request(target: Ipv4Addr) -> Vec<u8> {
    let repr = ArpRepr::EthernetIpv4 {
        operation: ArpOperation::Request,
        source_hardware_addr: GUEST_MAC,
        source_protocol_addr: GUEST_IP,
        target_hardware_addr: EthernetAddress([0; 6]),
        target_protocol_addr: target,
    };
    let mut frame = vec![0u8; ETH + repr.buffer_len()];
    let mut eth = EthernetFrame::new_unchecked(&mut frame[..]);
    eth.set_dst_addr(EthernetAddress::BROADCAST);
    eth.set_src_addr(GUEST_MAC);
    eth.set_ethertype(EthernetProtocol::Arp);
    repr.emit(&mut ArpPacket::new_unchecked(&mut frame[ETH..]));
    frame
}
