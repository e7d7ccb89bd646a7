//! Looking at a guest frame before smoltcp does, and the one frame the
//! gateway writes by hand: the RST that refuses a connection.
//!
//! The gateway must see a TCP SYN before smoltcp: it decides and asks for
//! the host-side connection first, and only then lets smoltcp answer the
//! SYN. Everything here reads guest bytes through smoltcp's checked
//! accessors and returns `None` for anything malformed.

use std::net::{Ipv4Addr, SocketAddrV4};

use smoltcp::wire::{
    ArpPacket, ArpRepr, EthernetAddress, EthernetFrame, EthernetProtocol, IpAddress, IpProtocol,
    Ipv4Packet, TcpPacket, TcpSeqNumber, UdpPacket,
};

/// What a guest frame is, as far as the gateway's checks go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Inbound {
    /// An ARP packet asking about (or answering to) `target`.
    Arp {
        target: Ipv4Addr,
    },
    /// A connection attempt: SYN without ACK.
    TcpSyn(Syn),
    /// Any other TCP segment, to or from the endpoints in it.
    Tcp {
        src: SocketAddrV4,
        dst: SocketAddrV4,
    },
    Udp {
        src: SocketAddrV4,
        dst: SocketAddrV4,
    },
    Icmp {
        dst: Ipv4Addr,
    },
}

/// The parts of a SYN the gateway needs to refuse or replay it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Syn {
    pub guest_mac: EthernetAddress,
    pub src: SocketAddrV4,
    pub dst: SocketAddrV4,
    pub seq: TcpSeqNumber,
    /// Sequence space the SYN takes: 1, plus any data it carries.
    pub seg_len: usize,
}

/// Classify a frame from the guest; `None` for anything the gateway drops
/// unseen (IPv6, fragments, bad checksums, truncated headers).
pub(super) fn classify(frame: &[u8]) -> Option<Inbound> {
    let eth = EthernetFrame::new_checked(frame).ok()?;
    match eth.ethertype() {
        EthernetProtocol::Arp => {
            let arp = ArpPacket::new_checked(eth.payload()).ok()?;
            match ArpRepr::parse(&arp).ok()? {
                ArpRepr::EthernetIpv4 {
                    target_protocol_addr,
                    ..
                } => Some(Inbound::Arp {
                    target: target_protocol_addr,
                }),
                _ => None,
            }
        }
        EthernetProtocol::Ipv4 => classify_ipv4(eth.src_addr(), eth.payload()),
        _ => None,
    }
}

fn classify_ipv4(guest_mac: EthernetAddress, bytes: &[u8]) -> Option<Inbound> {
    let ip = Ipv4Packet::new_checked(bytes).ok()?;
    if !ip.verify_checksum() || ip.more_frags() || ip.frag_offset() != 0 {
        return None;
    }
    let (src_ip, dst_ip) = (ip.src_addr(), ip.dst_addr());
    let (src_a, dst_a) = (IpAddress::Ipv4(src_ip), IpAddress::Ipv4(dst_ip));
    match ip.next_header() {
        IpProtocol::Tcp => {
            let tcp = TcpPacket::new_checked(ip.payload()).ok()?;
            if !tcp.verify_checksum(&src_a, &dst_a) {
                return None;
            }
            let src = SocketAddrV4::new(src_ip, tcp.src_port());
            let dst = SocketAddrV4::new(dst_ip, tcp.dst_port());
            if tcp.syn() && !tcp.ack() && !tcp.rst() {
                Some(Inbound::TcpSyn(Syn {
                    guest_mac,
                    src,
                    dst,
                    seq: tcp.seq_number(),
                    seg_len: tcp.segment_len(),
                }))
            } else {
                Some(Inbound::Tcp { src, dst })
            }
        }
        IpProtocol::Udp => {
            let udp = UdpPacket::new_checked(ip.payload()).ok()?;
            Some(Inbound::Udp {
                src: SocketAddrV4::new(src_ip, udp.src_port()),
                dst: SocketAddrV4::new(dst_ip, udp.dst_port()),
            })
        }
        IpProtocol::Icmp => Some(Inbound::Icmp { dst: dst_ip }),
        _ => None,
    }
}

const ETH_LEN: usize = 14;
const IP_LEN: usize = 20;
const TCP_LEN: usize = 20;

/// An RST|ACK answering `syn`, as if from its destination: the guest's
/// `connect()` fails at once with ECONNREFUSED instead of timing out.
pub(super) fn rst_for(syn: &Syn, gateway_mac: EthernetAddress) -> Vec<u8> {
    let mut frame = vec![0u8; ETH_LEN + IP_LEN + TCP_LEN];
    let mut eth = EthernetFrame::new_unchecked(&mut frame[..]);
    eth.set_dst_addr(syn.guest_mac);
    eth.set_src_addr(gateway_mac);
    eth.set_ethertype(EthernetProtocol::Ipv4);

    let (src, dst) = (*syn.dst.ip(), *syn.src.ip());
    let mut ip = Ipv4Packet::new_unchecked(&mut frame[ETH_LEN..]);
    ip.set_version(4);
    ip.set_header_len(IP_LEN as u8);
    ip.set_total_len((IP_LEN + TCP_LEN) as u16);
    ip.set_dont_frag(true);
    ip.set_hop_limit(64);
    ip.set_next_header(IpProtocol::Tcp);
    ip.set_src_addr(src);
    ip.set_dst_addr(dst);
    ip.fill_checksum();

    let mut tcp = TcpPacket::new_unchecked(&mut frame[ETH_LEN + IP_LEN..]);
    tcp.set_src_port(syn.dst.port());
    tcp.set_dst_port(syn.src.port());
    tcp.set_seq_number(TcpSeqNumber(0));
    tcp.set_ack_number(syn.seq + syn.seg_len);
    tcp.set_header_len(TCP_LEN as u8);
    tcp.clear_flags();
    tcp.set_rst(true);
    tcp.set_ack(true);
    tcp.set_window_len(0);
    tcp.set_urgent_at(0);
    tcp.fill_checksum(&IpAddress::Ipv4(src), &IpAddress::Ipv4(dst));
    frame
}

#[cfg(test)]
mod tests {
    use super::*;

    fn syn() -> Syn {
        Syn {
            guest_mac: EthernetAddress([2, 0, 0, 0, 0, 15]),
            src: "10.0.2.15:40000".parse().expect("addr"),
            dst: "192.0.2.1:443".parse().expect("addr"),
            seq: TcpSeqNumber(1000),
            seg_len: 1,
        }
    }

    #[test]
    fn rst_for_syn_is_valid_and_acks_the_syn() {
        let s = syn();
        let frame = rst_for(&s, EthernetAddress([2, 0, 0, 0, 0, 2]));
        let eth = EthernetFrame::new_checked(&frame[..]).expect("ethernet");
        assert_eq!(eth.dst_addr(), s.guest_mac);
        let ip = Ipv4Packet::new_checked(eth.payload()).expect("ipv4");
        assert!(ip.verify_checksum());
        assert_eq!(ip.src_addr(), *s.dst.ip());
        let tcp = TcpPacket::new_checked(ip.payload()).expect("tcp");
        let (a, b) = (
            IpAddress::Ipv4(ip.src_addr()),
            IpAddress::Ipv4(ip.dst_addr()),
        );
        assert!(tcp.verify_checksum(&a, &b));
        assert!(tcp.rst() && tcp.ack() && !tcp.syn());
        assert_eq!(tcp.ack_number(), TcpSeqNumber(1001));
        assert_eq!((tcp.src_port(), tcp.dst_port()), (443, 40000));
        // The gateway's own classifier reads it as plain TCP, not a SYN.
        assert!(matches!(classify(&frame), Some(Inbound::Tcp { .. })));
    }

    #[test]
    fn classify_random_bytes_never_panics() {
        let mut rng = fastrand::Rng::with_seed(7);
        let base = rst_for(&syn(), EthernetAddress([2, 0, 0, 0, 0, 2]));
        for i in 0..20_000 {
            let bytes: Vec<u8> = if i % 2 == 0 {
                (0..rng.usize(0..200)).map(|_| rng.u8(..)).collect()
            } else {
                let mut b = base.clone();
                let at = rng.usize(..b.len());
                b[at] = rng.u8(..);
                b.truncate(rng.usize(..=b.len()));
                b
            };
            let _ = classify(&bytes);
        }
    }
}
