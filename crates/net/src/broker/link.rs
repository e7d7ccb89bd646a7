//! One broker message across a `SOCK_SEQPACKET` link, with the file
//! descriptor it carries (`SCM_RIGHTS`): the only I/O in this crate, on a
//! socket the caller owns (the VMM's end and the broker's end both use
//! these, so the two cannot drift). Safe `rustix` calls only.
//!
//! Errors stay [`io::Error`]s: callers decide by their kind
//! (`WouldBlock` on a non-blocking link, `Interrupted`, `EPIPE` when the
//! peer is gone). A message that is not the protocol's JSON is
//! `InvalidData`.

use std::io::{self, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

use super::{BrokerMessage, BrokerRequest, MAX_MESSAGE};

fn invalid(e: serde_json::Error) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

/// A new link to the broker listening at `path` (`SOCK_SEQPACKET`,
/// close-on-exec, blocking). The broker sends the policy first on it.
pub fn connect(path: &std::path::Path) -> io::Result<OwnedFd> {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let fd = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )?;
    rustix::net::connect(&fd, &SocketAddrUnix::new(path)?)?;
    Ok(fd)
}

/// A VMM's two links to its broker: the connector's (connect requests,
/// answered later) and the resolver's (lookups, each awaited).
#[derive(Debug)]
pub struct BrokerLinks {
    pub connector: OwnedFd,
    pub resolver: OwnedFd,
}

impl BrokerLinks {
    /// Connects both to the broker listening at `path`.
    pub fn connect(path: &std::path::Path) -> io::Result<Self> {
        Ok(Self {
            connector: connect(path)?,
            resolver: connect(path)?,
        })
    }
}

/// Sends a VMM's request to its broker (no fd travels this way).
pub fn send_request(link: impl AsFd, req: &BrokerRequest) -> io::Result<()> {
    let msg = serde_json::to_vec(req).map_err(invalid)?;
    rustix::net::send(link, &msg, SendFlags::NOSIGNAL)?;
    Ok(())
}

/// Sends a broker's message to a VMM, with `passed` (a connected socket)
/// as its `SCM_RIGHTS` if given.
pub fn send_message(
    link: impl AsFd,
    msg: &BrokerMessage,
    passed: Option<BorrowedFd<'_>>,
) -> io::Result<()> {
    let msg = serde_json::to_vec(msg).map_err(invalid)?;
    send_encoded(link, &msg, passed)
}

/// Sends a broker's message already encoded (`msg`, the JSON of a
/// [`BrokerMessage`]: a message sent to many VMMs is encoded once), with
/// `passed` as its `SCM_RIGHTS` if given.
pub fn send_encoded(link: impl AsFd, msg: &[u8], passed: Option<BorrowedFd<'_>>) -> io::Result<()> {
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    let fds;
    if let Some(fd) = passed {
        fds = [fd];
        if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
            return Err(io::Error::other("no room for the passed fd"));
        }
    }
    rustix::net::sendmsg(
        link,
        &[IoSlice::new(msg)],
        &mut control,
        SendFlags::NOSIGNAL,
    )?;
    Ok(())
}

/// Receives one message and the fd it carries, if any (close-on-exec).
/// `Ok(None)`: the peer hung up.
///
/// The buffer is the message's own size (peeked first), not
/// [`MAX_MESSAGE`]: a zeroed 64 KiB allocation per call wrote 16 heap
/// pages in every fork child (its first message is the policy) and in every
/// poll of the link that found nothing. Only one thread may read a link,
/// so the peeked message is the one `recvmsg` takes; a longer one is cut
/// at [`MAX_MESSAGE`].
pub fn recv_message(link: impl AsFd) -> io::Result<Option<(BrokerMessage, Option<OwnedFd>)>> {
    let link = link.as_fd();
    let mut nothing: [u8; 0] = [];
    let (_, len) = rustix::net::recv(link, &mut nothing[..], RecvFlags::PEEK | RecvFlags::TRUNC)?;
    let mut buf = vec![0u8; len.min(MAX_MESSAGE)];
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = rustix::net::recvmsg(
        link,
        &mut [IoSliceMut::new(&mut buf)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    )?;
    let mut passed = None;
    for msg in control.drain() {
        if let RecvAncillaryMessage::ScmRights(fds) = msg {
            for fd in fds {
                // One expected; any more are closed as they drop.
                passed.get_or_insert(fd);
            }
        }
    }
    if got.bytes == 0 {
        return Ok(None);
    }
    let msg = serde_json::from_slice(&buf[..got.bytes]).map_err(invalid)?;
    Ok(Some((msg, passed)))
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;

    use rustix::net::{socketpair, AddressFamily, SocketFlags, SocketType};

    use super::*;
    use crate::broker::BrokerReply;

    fn pair() -> (OwnedFd, OwnedFd) {
        socketpair(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
        .expect("socketpair")
    }

    #[test]
    fn recv_message_sized_messages_arrive_whole_with_their_fd() {
        let (a, b) = pair();
        let reply = BrokerReply {
            id: 7,
            ok: false,
            addresses: Vec::new(),
            not_found: false,
            denied: false,
            // Longer than a page, shorter than MAX_MESSAGE.
            error: Some("x".repeat(10_000)),
        };
        let (passed, _keep) = pair();
        let first = BrokerMessage::Reply(reply);
        send_message(&a, &first, Some(passed.as_fd())).expect("send");
        rustix::net::send(&a, br#"{"id":8,"ok":true}"#, SendFlags::NOSIGNAL).expect("send");
        let (got, fd) = recv_message(&b).expect("recv").expect("a message");
        assert_eq!(got, first);
        assert!(fd.is_some(), "the fd comes with its message");
        let (second, fd) = recv_message(&b).expect("recv").expect("a message");
        assert!(matches!(second, BrokerMessage::Reply(r) if r.id == 8 && r.ok));
        assert!(fd.is_none());
    }

    #[test]
    fn recv_message_hang_up_is_none_and_empty_link_would_block() {
        let (a, b) = pair();
        rustix::io::ioctl_fionbio(&b, true).expect("non-blocking");
        let err = recv_message(&b).expect_err("nothing to read");
        assert_eq!(err.kind(), io::ErrorKind::WouldBlock);
        drop(a);
        assert!(recv_message(&b).expect("recv").is_none());
    }

    #[test]
    fn send_request_arrives_as_one_json_datagram() {
        let (a, b) = pair();
        let req = BrokerRequest::Resolve {
            id: 3,
            name: "example.com".into(),
        };
        send_request(&a, &req).expect("send");
        let mut buf = [0u8; 256];
        let n = rustix::net::recv(&b, &mut buf[..], RecvFlags::empty())
            .expect("recv")
            .0;
        let back: BrokerRequest = serde_json::from_slice(&buf[..n]).expect("json");
        assert_eq!(back, req);
    }

    #[test]
    fn recv_message_not_json_is_invalid_data() {
        let (a, b) = pair();
        rustix::net::send(&a, b"not json", SendFlags::NOSIGNAL).expect("send");
        let err = recv_message(&b).expect_err("not the protocol");
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
    }
}
