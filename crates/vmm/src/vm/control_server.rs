//! Serving the control socket: accepting clients, reading their bounded
//! lines, turning each request into the machine's action and its answer
//! (`forkbox-vmm-api`'s types), and reaping fork children by pidfd.

use std::fs::File;
use std::io::{IoSliceMut, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::Instant;

use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags};
use vmm_sys_util::epoll::{ControlOperation, EpollEvent, EventSet};

use forkbox_vmm_api::{
    self as api, Request, Response, Snapshotted, Status, ZygoteMemory, MAX_FDS_PER_REQUEST,
    MAX_LINE,
};

use crate::control::{Line, LineBuffer};
use crate::counters::{Counters, COUNTERS};
use crate::fork;

use super::forking::ChildPlan;
use super::{chain, Machine, VmError};

/// What handling one request led to.
pub(super) enum Outcome {
    Reply(Response),
    Child(Box<ChildPlan>),
    /// The connection that asked owns the VM now.
    Own,
}

pub(super) enum CtlItem {
    Client {
        stream: UnixStream,
        lines: LineBuffer,
        /// Descriptors it sent (`SCM_RIGHTS`) that no request took yet:
        /// the cgroups of a fork's children.
        fds: Vec<OwnedFd>,
        /// It asked to own the VM (`own`).
        owner: bool,
    },
    /// A fork child, reaped when its pidfd becomes readable.
    Child { pid: libc::pid_t, _pidfd: OwnedFd },
}

impl Machine {
    pub(super) fn add_item(&mut self, fd: i32, item: CtlItem) {
        let token = self.next_token;
        self.next_token += 1;
        let ev = EpollEvent::new(EventSet::IN | EventSet::READ_HANG_UP, token);
        match self.ctl_epoll.ctl(ControlOperation::Add, fd, ev) {
            Ok(()) => {
                self.items.insert(token, item);
            }
            Err(e) => tracing::warn!("cannot watch a control item: {e}"),
        }
    }

    pub(super) fn accept_clients(&mut self) {
        loop {
            let Some(l) = &self.listener else { return };
            match l.accept() {
                Ok((stream, _)) => {
                    if let Err(e) = stream.set_nonblocking(true) {
                        tracing::warn!("control client: {e}");
                        continue;
                    }
                    // A connection may be an owner about to say so: the
                    // orphan grace starts again.
                    if self.owners == 0 {
                        self.unowned.restart(Instant::now());
                        tracing::info!("a control connection while unowned");
                    }
                    let fd = stream.as_raw_fd();
                    self.add_item(
                        fd,
                        CtlItem::Client {
                            stream,
                            lines: LineBuffer::default(),
                            fds: Vec::new(),
                            owner: false,
                        },
                    );
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    tracing::warn!("control socket accept: {e}");
                    return;
                }
            }
        }
    }

    /// A client or child fd is ready. Returns a plan if this process has
    /// just become a fork child.
    pub(super) fn item_event(&mut self, token: u64) -> Option<Box<ChildPlan>> {
        let mut item = self.items.remove(&token)?;
        match &mut item {
            CtlItem::Child { pid, .. } => {
                fork::reap(*pid);
                None // dropping the pidfd unwatches it
            }
            CtlItem::Client {
                stream,
                lines,
                fds,
                owner,
            } => {
                let mut buf = [0u8; 4096];
                let mut open = true;
                let mut got = Vec::new();
                // Bounded per wake-up; the level-triggered epoll calls again.
                let mut budget = 4 * MAX_LINE;
                while budget > 0 {
                    match recv_with_fds(stream, &mut buf, fds) {
                        Ok(0) => {
                            open = false;
                            break;
                        }
                        Ok(n) => {
                            budget = budget.saturating_sub(n);
                            got.extend(lines.push(&buf[..n]));
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(_) => {
                            open = false;
                            break;
                        }
                    }
                    if got.contains(&Line::TooLong) {
                        break;
                    }
                }
                for line in got {
                    let response = match line {
                        Line::TooLong => {
                            open = false;
                            Response::error(format!("request longer than {MAX_LINE} bytes"))
                        }
                        Line::Complete(line) => match self.handle_line(&line, fds) {
                            Outcome::Reply(r) => r,
                            // Dropping `item` here only closes this
                            // process's descriptor of the parent's client.
                            Outcome::Child(plan) => return Some(plan),
                            Outcome::Own => {
                                if !*owner {
                                    *owner = true;
                                    self.owners += 1;
                                    tracing::info!(owners = self.owners, "owned");
                                }
                                Response::Done
                            }
                        },
                    };
                    if stream.write_all(&response.to_line()).is_err() {
                        open = false;
                        break;
                    }
                    if !open {
                        break;
                    }
                }
                if open {
                    self.items.insert(token, item);
                } else if *owner {
                    self.owners -= 1;
                    if self.owners == 0 {
                        self.unowned.restart(Instant::now());
                        tracing::info!("the VM's last owner went away");
                    }
                }
                None
            }
        }
    }

    /// Answers one request; a fork takes the descriptors its client sent
    /// with it (`fds`).
    pub(super) fn handle_line(&mut self, line: &[u8], fds: &mut Vec<OwnedFd>) -> Outcome {
        let request = match Request::from_line(line) {
            Ok(r) => r,
            Err(e) => return Outcome::Reply(Response::error(e)),
        };
        tracing::debug!(?request, "control request");
        let started = Instant::now();
        // `status` is how the counters are read: not counted itself.
        let counted = !matches!(request, Request::Status);
        let outcome = match request {
            Request::Status => Outcome::Reply(Response::Status(Status {
                state: self.run_state,
                pid: std::process::id(),
                vcpus: self.hw.vcpus,
                memory_mib: self.hw.memory_mib,
                writable_disks: u8::try_from(self.disks.len()).unwrap_or(u8::MAX),
                counters: Some(COUNTERS.snapshot()),
            })),
            Request::Pause => Outcome::Reply(reply(self.pause().map(|_| ()))),
            Request::Resume => {
                self.resume();
                Outcome::Reply(Response::Done)
            }
            Request::Zygote => Outcome::Reply(match self.zygote() {
                Ok(copied) => Response::Zygote(ZygoteMemory {
                    bytes: copied.bytes,
                    huge_bytes: copied.huge_bytes,
                }),
                Err(e) => Response::error(chain(e)),
            }),
            Request::Snapshot { then, disks } => {
                // The memory's and the state's files, then the disks'.
                let disk_files = fds.split_off(2.min(fds.len()));
                Outcome::Reply(match carried_pair(fds) {
                    Err(e) => Response::error(e),
                    Ok(_) if usize::from(disks) != self.disks.len() => Response::error(format!(
                        "this VM has {} writable disks, the request sends files for {disks}",
                        self.disks.len()
                    )),
                    Ok(_) if disk_files.len() != usize::from(disks) => Response::error(format!(
                        "the request says {disks} disk files and carries {}",
                        disk_files.len()
                    )),
                    Ok([memory, state]) => {
                        let disks = disk_files.into_iter().map(File::from).collect();
                        match self.snapshot(File::from(memory), File::from(state), disks, then) {
                            Ok(n) => Response::Snapshotted(Snapshotted { bytes_written: n }),
                            Err(e) => Response::error(chain(e)),
                        }
                    }
                })
            }
            Request::Broker => Outcome::Reply(match carried_pair(fds) {
                Err(e) => Response::error(e),
                Ok([connector, resolver]) => {
                    crate::net::relink(crate::net::BrokerLinks {
                        connector,
                        resolver,
                    });
                    tracing::info!("network broker links handed over");
                    Response::Done
                }
            }),
            Request::Fork {
                children,
                then,
                disks,
            } => match self.fork(&children, then, disks, fds) {
                Ok(o) => o,
                Err(e) => Outcome::Reply(Response::error(chain(e))),
            },
            Request::Prefault { written, read } => {
                Outcome::Reply(self.set_working_set(&written, &read))
            }
            Request::Own => Outcome::Own,
            Request::Nmi => Outcome::Reply(match self.vcpus.nmi().as_slice() {
                [] => Response::Done,
                waiting => Response::error(format!(
                    "vCPU(s) {waiting:?} did not take the NMI within {:?} (parked?)",
                    crate::vcpu::PAUSE_TIMEOUT
                )),
            }),
            Request::Vcpus => Outcome::Reply(match self.report_vcpus() {
                Ok(vcpus) => Response::Vcpus(api::Vcpus {
                    state: self.run_state,
                    vcpus,
                }),
                Err(e) => Response::error(chain(e)),
            }),
        };
        let elapsed = started.elapsed();
        tracing::debug!(?elapsed, "control request done");
        if counted {
            Counters::bump(&COUNTERS.control_requests);
            let micros = u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX);
            Counters::add(&COUNTERS.control_micros, micros);
        }
        outcome
    }
}

/// The two descriptors a snapshot or broker request carries, taken from
/// `fds`; a request that carried another number is refused (and what it
/// carried closed).
fn carried_pair(fds: &mut Vec<OwnedFd>) -> Result<[OwnedFd; 2], String> {
    <[OwnedFd; 2]>::try_from(std::mem::take(fds)).map_err(|got| {
        format!(
            "this request carries 2 descriptors (SCM_RIGHTS), not {}",
            got.len()
        )
    })
}

/// Reads what a client sent into `buf`, and the descriptors that came
/// with it (close-on-exec) onto `fds`. A client that sends more than one
/// fork request takes is an error: the connection is then dropped.
fn recv_with_fds(
    stream: &UnixStream,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
) -> std::io::Result<usize> {
    let mut space =
        [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS_PER_REQUEST))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = rustix::net::recvmsg(
        stream,
        &mut [IoSliceMut::new(buf)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    )?;
    for msg in control.drain() {
        if let RecvAncillaryMessage::ScmRights(passed) = msg {
            fds.extend(passed);
        }
    }
    if got.flags.contains(ReturnFlags::CTRUNC) || fds.len() > MAX_FDS_PER_REQUEST {
        return Err(std::io::Error::other(
            "more descriptors than a fork request takes",
        ));
    }
    Ok(got.bytes)
}

fn reply(r: Result<(), VmError>) -> Response {
    match r {
        Ok(()) => Response::Done,
        Err(e) => Response::error(chain(e)),
    }
}

#[cfg(test)]
mod tests {
    use std::io::IoSlice;
    use std::os::fd::AsFd;

    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};

    use super::*;

    /// Sends `bytes` with `n` descriptors (copies of one pipe end).
    fn send(stream: &UnixStream, bytes: &[u8], n: usize) {
        let (r, _w) = rustix::pipe::pipe().expect("pipe");
        let fds = vec![r.as_fd(); n];
        let mut space = vec![MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(n))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        assert!(control.push(SendAncillaryMessage::ScmRights(&fds)));
        let sent = rustix::net::sendmsg(
            stream,
            &[IoSlice::new(bytes)],
            &mut control,
            SendFlags::empty(),
        )
        .expect("sendmsg");
        assert_eq!(sent, bytes.len());
    }

    #[test]
    fn a_clients_descriptors_come_with_its_bytes_and_are_bounded() {
        let (client, vmm) = UnixStream::pair().expect("socketpair");
        send(&client, b"{\"op\":\"fork\"", 3);
        let mut buf = [0u8; 64];
        let mut fds = Vec::new();
        let n = recv_with_fds(&vmm, &mut buf, &mut fds).expect("received");
        assert_eq!(&buf[..n], b"{\"op\":\"fork\"");
        assert_eq!(fds.len(), 3);
        // Close-on-exec, as everything the VMM holds.
        let flags = rustix::io::fcntl_getfd(&fds[0]).expect("getfd");
        assert!(flags.contains(rustix::io::FdFlags::CLOEXEC));
        // More than a fork request takes, however they come: refused.
        send(&client, b"x", MAX_FDS_PER_REQUEST - 2);
        assert!(recv_with_fds(&vmm, &mut buf, &mut fds).is_err());
        // The most one message can carry (the kernel's SCM_MAX_FD) is taken.
        let (client, vmm) = UnixStream::pair().expect("socketpair");
        let mut fresh = Vec::new();
        send(&client, b"y", MAX_FDS_PER_REQUEST);
        recv_with_fds(&vmm, &mut buf, &mut fresh).expect("a whole message");
        assert_eq!(fresh.len(), MAX_FDS_PER_REQUEST);
    }
}
