//! Fork orchestration: forking this VMM once per requested child after one
//! capture, answering with each child's pid once it is ready, and, in the
//! child, breaking from the parent's objects and rebuilding the VM over
//! the inherited copy-on-write memory. The `fork()` syscall and its
//! readiness pipe are `crate::fork`'s.

use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixListener;
use std::sync::Arc;
use std::time::Instant;

use forkbox_vmm_api::{self as api, ChildResult, ChildSpec, Response, Then};

use crate::fork::{self, Forked};
use crate::state::MachineState;

use super::control_server::{CtlItem, Outcome};
use super::{chain, Endpoints, Machine, Opened, VmError};
use crate::net::BrokerLinks;
use crate::virtio::HostSides;

/// What a freshly forked child restores.
pub(super) struct ChildPlan {
    /// When the parent received the fork request (timing logs only).
    requested: Instant,
    /// Children this VMM process had forked, this one included.
    ordinal: u64,
    state: MachineState,
    spec: ChildSpec,
    fds: ChildFds,
    ready: OwnedFd,
}

/// One child's endpoints as the fork request carried them
/// ([`ChildSpec::carried`]; its cgroup is joined right after the fork).
struct ChildFds {
    cgroup: Option<OwnedFd>,
    control: OwnedFd,
    vsock: Option<OwnedFd>,
    serial_log: Option<OwnedFd>,
    end_note: OwnedFd,
    broker: Option<BrokerLinks>,
    /// Its writable disks' tops.
    disks: Vec<File>,
}

impl ChildFds {
    /// The next child's descriptors from `fds`, in the request's order;
    /// `None` if they run out (the caller counted them first).
    fn take(spec: &ChildSpec, fds: &mut impl Iterator<Item = OwnedFd>) -> Option<ChildFds> {
        // The next descriptor if the spec says one comes; `None` if it
        // should and none is left.
        let mut next_if = |comes: bool| match comes {
            true => fds.next().map(Some),
            false => Some(None),
        };
        let cgroup = next_if(spec.joins_cgroup)?;
        let control = next_if(true)??;
        let vsock = next_if(spec.vsock_uds.is_some())?;
        let serial_log = next_if(spec.serial_log.is_some())?;
        let end_note = next_if(true)??;
        let has_broker = spec.net_broker.is_some();
        let broker = match (next_if(has_broker)?, next_if(has_broker)?) {
            (Some(connector), Some(resolver)) => Some(BrokerLinks {
                connector,
                resolver,
            }),
            _ => None,
        };
        let disks = (0..spec.disks)
            .map(|_| fds.next().map(File::from))
            .collect::<Option<Vec<File>>>()?;
        Some(ChildFds {
            cgroup,
            control,
            vsock,
            serial_log,
            end_note,
            broker,
            disks,
        })
    }

    /// The descriptors the child keeps open (its cgroup's is spent; its
    /// disks' tops go to its disks, which say what they keep).
    fn kept(&self) -> Vec<RawFd> {
        let broker = self.broker.as_ref();
        [
            Some(&self.control),
            self.vsock.as_ref(),
            self.serial_log.as_ref(),
            Some(&self.end_note),
            broker.map(|b| &b.connector),
            broker.map(|b| &b.resolver),
        ]
        .into_iter()
        .flatten()
        .map(AsRawFd::as_raw_fd)
        .collect()
    }
}

impl Machine {
    /// Forks one child per spec; `fds` are the parent's new tops of its
    /// `disks` writable disks, then the endpoints the request carried for
    /// the children ([`ChildSpec::carried`]), in their order.
    pub(super) fn fork(
        &mut self,
        children: &[ChildSpec],
        then: Then,
        disks: u8,
        fds: &mut Vec<OwnedFd>,
    ) -> Result<Outcome, VmError> {
        let needed = usize::from(disks) + children.iter().map(ChildSpec::carried).sum::<usize>();
        if needed != fds.len() {
            let carried = fds.len();
            fds.clear();
            return Err(VmError::ChildFds { needed, carried });
        }
        let want = self.disks.len();
        let wrong = std::iter::once(disks).chain(children.iter().map(|c| c.disks));
        if let Some(got) = wrong.into_iter().find(|&d| usize::from(d) != want) {
            fds.clear();
            return Err(VmError::WritableCount {
                got: usize::from(got),
                want,
            });
        }
        let mut fds = std::mem::take(fds).into_iter();
        let new_tops: Vec<File> = fds.by_ref().take(want).map(File::from).collect();
        let carried: Vec<ChildFds> = children
            .iter()
            .map_while(|c| ChildFds::take(c, &mut fds))
            .collect();
        let started = Instant::now();
        let vcpus = self.pause()?;
        let paused = started.elapsed();
        let saved = self.capture(vcpus)?;
        // Memory and disks of one instant: the devices serve nothing while
        // paused, and the children inherit the frozen layers.
        for (i, (disk, top)) in self.disks.iter().zip(new_tops).enumerate() {
            let base = self.hw.writable[i].base.clone();
            forkbox_devices::virtio::block::lock(disk)
                .freeze(top)
                .map_err(|source| VmError::WritableDisk {
                    index: i,
                    base,
                    source,
                })?;
        }
        tracing::debug!(?paused, captured = ?started.elapsed(), "fork: state captured");
        // Fork every child first, then wait for all: they restore in
        // parallel (KVM_CREATE_VM dominates a child's start).
        let mut pending: Vec<Result<(libc::pid_t, OwnedFd), String>> = Vec::new();
        let has_broker = self
            .endpoints
            .net
            .as_ref()
            .is_some_and(|n| n.broker.is_some());
        for (spec, mut mine) in children.iter().zip(carried) {
            if self.hw.vsock && spec.vsock_uds.is_none() {
                pending.push(Err(VmError::VsockPathMissing.to_string()));
                continue;
            }
            if has_broker && spec.net_broker.is_none() {
                pending.push(Err(VmError::ChildBrokerMissing.to_string()));
                continue;
            }
            let cgroup = mine.cgroup.take();
            let before_fork = Instant::now();
            let ordinal = FORKED.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
            // SAFETY: every vCPU thread is parked in a condition wait
            // holding no lock, device work runs only on this thread, and the
            // child uses none of the parent's objects (it forgets them).
            match unsafe { fork::fork() } {
                Err(e) => pending.push(Err(format!("fork: {e}"))),
                Ok(Forked::Child { ready }) => {
                    // Its own cgroup before it allocates anything.
                    if let Some(cgroup) = cgroup {
                        if let Err(e) = fork::join_cgroup(cgroup) {
                            let msg = format!("cannot join its own cgroup: {e}");
                            tracing::error!("fork child: {msg}");
                            fork::report_failure(ready, &msg);
                            std::process::exit(api::exit_code::VMM_ERROR);
                        }
                    }
                    // Earlier siblings' pipe ends close with everything else
                    // inherited (`close_inherited`).
                    std::mem::forget(pending);
                    return Ok(Outcome::Child(Box::new(ChildPlan {
                        requested: started,
                        ordinal,
                        state: saved.clone(),
                        spec: spec.clone(),
                        fds: mine,
                        ready,
                    })));
                }
                // The child has its copies; this process closes its own.
                Ok(Forked::Parent { pid, ready }) => {
                    tracing::debug!(pid, fork_syscall = ?before_fork.elapsed(), "fork: forked");
                    match fork::pidfd_open(pid) {
                        Ok(pidfd) => {
                            let fd = pidfd.as_raw_fd();
                            self.add_item(fd, CtlItem::Child { pid, _pidfd: pidfd });
                        }
                        Err(e) => tracing::warn!(pid, "pidfd_open: {e}; child not reaped"),
                    }
                    pending.push(Ok((pid, ready)));
                }
            }
        }
        let deadline = Instant::now() + fork::CHILD_READY_TIMEOUT;
        let results = pending
            .into_iter()
            .map(|p| match p {
                Err(error) => ChildResult::Failed {
                    error,
                    unready_pid: None,
                },
                Ok((pid, ready)) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    let r = fork::wait_ready(ready, left.max(std::time::Duration::from_millis(1)));
                    tracing::info!(pid, elapsed = ?started.elapsed(), ok = r.is_ok(), "fork child");
                    match r {
                        Ok(()) => ChildResult::Started { pid: pid as u32 },
                        // It may still come up: its asker ends it.
                        Err(error) => ChildResult::Failed {
                            error,
                            unready_pid: Some(pid as u32),
                        },
                    }
                }
            })
            .collect();
        if then == Then::Resume {
            self.resume();
        }
        Ok(Outcome::Reply(Response::Forked(api::Forked {
            children: results,
        })))
    }
}

/// In a fork child: forget the parent's objects (their descriptors are the
/// parent's open files), close every inherited descriptor but guest RAM's,
/// and rebuild the VM from the captured state over the inherited mapping.
pub(super) fn become_child(parent: Machine, mut plan: Box<ChildPlan>) -> Machine {
    let ram = Arc::clone(&parent.ram);
    let echo = parent.endpoints.echo;
    let working_set = parent.working_set.clone();
    // Its disks: its parent's layers and map (this process's copy), its own
    // tops. Done before the inherited descriptors are closed, so that the
    // parent's new top (a descriptor number about to be closed, then
    // reused) is dropped while it is still that file.
    let disks = parent.disks.clone();
    let tops = std::mem::take(&mut plan.fds.disks);
    for (i, (disk, top)) in disks.iter().zip(tops).enumerate() {
        if let Err(source) = forkbox_devices::virtio::block::lock(disk).with_top(top) {
            let base = parent.hw.writable[i].base.clone();
            let msg = chain(VmError::WritableDisk {
                index: i,
                base,
                source,
            });
            tracing::error!("fork child: {msg}");
            fork::report_failure(plan.ready, &msg);
            std::process::exit(api::exit_code::VMM_ERROR);
        }
    }
    // Its own log (or none), its own broker (which sends the child's
    // policy) where its parent has one.
    let net = parent.endpoints.net.clone().map(|n| crate::net::NetConfig {
        log: plan.spec.net_log.clone(),
        broker: plan.spec.net_broker.clone(),
        ..n
    });
    // No Drop may run on the parent's objects: KVM fds, eventfds, epolls,
    // sockets and vCPU thread handles all belong to the parent's VM.
    std::mem::forget(parent);
    let mut keep = ram.fds();
    keep.extend([0, 1, 2, plan.ready.as_raw_fd()]);
    keep.extend(crate::opened::fds());
    keep.extend(plan.fds.kept());
    for disk in &disks {
        let disk = forkbox_devices::virtio::block::lock(disk);
        keep.extend(disk.files().map(AsRawFd::as_raw_fd));
    }
    fork::close_inherited(&keep);
    crate::net::forget_relinks();
    crate::counters::COUNTERS.reset();
    tracing::debug!(since_request = ?plan.requested.elapsed(), "fork child: inherited fds closed");
    let ChildFds {
        control,
        vsock,
        serial_log,
        end_note,
        broker,
        ..
    } = plan.fds;
    let opened = Opened {
        control: Some(UnixListener::from(control)),
        sides: HostSides {
            vsock: vsock.map(UnixListener::from),
            broker,
            disks,
        },
        serial_log: serial_log.map(File::from),
        end_note: Some(File::from(end_note)),
        tops: Vec::new(),
        names: Endpoints {
            control: Some(plan.spec.control.clone()),
            vsock_uds: plan.spec.vsock_uds.clone(),
            serial_log: plan.spec.serial_log.clone(),
            echo,
            net,
            writable_tops: Vec::new(),
        },
    };
    if test_child(FAIL_CHILD_ENV, plan.ordinal) {
        let msg = format!("{FAIL_CHILD_ENV}: this fork child fails to come up");
        tracing::warn!(ordinal = plan.ordinal, "{msg}");
        fork::report_failure(plan.ready, &msg);
        std::process::exit(api::exit_code::VMM_ERROR);
    }
    // Half its window to come up, at most, goes to mapping ahead.
    let map_until = plan.requested + fork::CHILD_READY_TIMEOUT / 2;
    match Machine::restore(ram, &plan.state, opened, &working_set, map_until) {
        Ok(mut m) => {
            tracing::debug!(since_request = ?plan.requested.elapsed(), "fork child: ready");
            if test_child(HANG_CHILD_ENV, plan.ordinal) {
                tracing::warn!(
                    ordinal = plan.ordinal,
                    "FORKBOX_VMM_TEST_HANG_CHILD: this fork child's vCPUs stay parked"
                );
                if let Err(e) = m.pause() {
                    tracing::error!("cannot park the test's hanging child: {}", chain(e));
                }
            }
            fork::report_ready(plan.ready);
            m
        }
        Err(e) => {
            let msg = chain(e);
            tracing::error!("fork child: {msg}");
            fork::report_failure(plan.ready, &msg);
            std::process::exit(api::exit_code::VMM_ERROR);
        }
    }
}

/// Children this VMM process has forked (a fork child counts on from its
/// parent's count).
static FORKED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Test hook: `FORKBOX_VMM_TEST_HANG_CHILD=N` (set by the host for this
/// VMM only) makes the N-th fork child of this VMM process come up with its
/// vCPUs parked, a child that never answers its agent's calls: how the
/// host's handling of a hung child is tested. The guest cannot set it.
const HANG_CHILD_ENV: &str = "FORKBOX_VMM_TEST_HANG_CHILD";
/// Test hook: `FORKBOX_VMM_TEST_FAIL_CHILD=N` makes the N-th fork child
/// report that it could not come up, and end: how the host's replacing of
/// a child that failed is tested.
const FAIL_CHILD_ENV: &str = "FORKBOX_VMM_TEST_FAIL_CHILD";

/// Whether the test hook `env` names the fork child `ordinal`.
fn test_child(env: &str, ordinal: u64) -> bool {
    std::env::var(env).ok().and_then(|v| v.parse::<u64>().ok()) == Some(ordinal)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `n` distinct descriptors (one end of a new pipe each).
    fn fds(n: usize) -> Vec<OwnedFd> {
        (0..n)
            .map(|_| rustix::pipe::pipe().expect("pipe").0)
            .collect()
    }

    fn spec(full: bool) -> ChildSpec {
        ChildSpec {
            control: "/c".into(),
            vsock_uds: full.then(|| "/v".into()),
            serial_log: full.then(|| "/s".into()),
            net_log: None,
            net_broker: full.then(|| "/b".into()),
            joins_cgroup: full,
            disks: if full { 2 } else { 0 },
        }
    }

    #[test]
    fn a_childs_descriptors_are_taken_in_the_order_the_api_counts_them() {
        let (full, bare) = (spec(true), spec(false));
        let sent = fds(full.carried() + bare.carried());
        let raw: Vec<RawFd> = sent.iter().map(AsRawFd::as_raw_fd).collect();
        let mut it = sent.into_iter();
        let first = ChildFds::take(&full, &mut it).expect("the first child's");
        let second = ChildFds::take(&bare, &mut it).expect("the second child's");
        assert!(it.next().is_none(), "all taken");
        let broker = first.broker.as_ref().expect("broker links");
        let got = [
            first.cgroup.as_ref().map(AsRawFd::as_raw_fd),
            Some(first.control.as_raw_fd()),
            first.vsock.as_ref().map(AsRawFd::as_raw_fd),
            first.serial_log.as_ref().map(AsRawFd::as_raw_fd),
            Some(first.end_note.as_raw_fd()),
            Some(broker.connector.as_raw_fd()),
            Some(broker.resolver.as_raw_fd()),
            Some(first.disks[0].as_raw_fd()),
            Some(first.disks[1].as_raw_fd()),
            Some(second.control.as_raw_fd()),
            Some(second.end_note.as_raw_fd()),
        ];
        assert_eq!(got.map(Option::unwrap_or_default).to_vec(), raw);
        assert!(second.cgroup.is_none() && second.vsock.is_none() && second.broker.is_none());
        assert!(second.disks.is_empty());
        // What the child keeps: all but its cgroup's, spent on joining it.
        assert_eq!(first.kept(), raw[1..7].to_vec());
        // Too few: no child is made of a part of its descriptors.
        let mut short = fds(full.carried() - 1).into_iter();
        assert!(ChildFds::take(&full, &mut short).is_none());
    }
}
