//! The main thread's epoll loop: the control epoll (vCPU exits, the
//! control socket, device work), the device epoll behind it (queue
//! ioeventfds and device event fds, wired here), and the watch for a
//! kernel panic that no reset follows.
//!
//! One turn of the loop serves what the control epoll reported (vCPU
//! exits and control clients first), then the devices: each ready queue
//! or device event source once, within the device's budget
//! (`forkbox_devices::virtio::BUDGET_CHAINS`). A device with work left
//! says `Work::More` and is carried to the next turn ([`Again`]), which
//! then does not sleep in `epoll_wait`. So a guest that keeps one queue
//! full, or kicks it in a loop, gets one budget per turn and the rest of
//! the VM's work is served between.

use std::os::fd::AsRawFd;
use std::time::Instant;

use kvm_ioctls::{IoEventAddress, VmFd};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use forkbox_devices::Work;
use forkbox_vmm_api::RunState;

use crate::layout::VIRTIO_MMIO_QUEUE_NOTIFY;
use crate::virtio::{self, VirtioSlot};

use super::{eventfd, kvm_err, LoopEnd, Machine, VmError};

/// How often the main loop looks at the serial tail for a kernel panic.
const PANIC_POLL_MS: i32 = 1000;
/// Polls a panic line may stay unanswered by a reset before the VMM stops
/// the VM itself (a guest booted without `panic=-1` would hang forever).
const PANIC_GRACE_POLLS: u32 = 5;

/// Decides when a kernel panic without a following reset ends the VM.
/// Driven by poll ticks, not clocks, so it is tested without sleeping.
#[derive(Debug, Default)]
pub struct PanicWatch {
    polls_since_panic: u32,
}

impl PanicWatch {
    /// Records one poll; true once a panic has been seen for longer than
    /// [`PANIC_GRACE_POLLS`] polls.
    pub fn poll(&mut self, panic_seen: bool) -> bool {
        if panic_seen {
            self.polls_since_panic += 1;
        }
        self.polls_since_panic > PANIC_GRACE_POLLS
    }
}

/// Device work carried from one turn of the loop to the next: the tokens
/// (indices into the device tokens) whose device ran out of budget.
#[derive(Debug, Default)]
pub struct Again {
    tokens: Vec<usize>,
}

impl Again {
    /// Every token in `0..n`, as after a start or restore: a device is asked
    /// once whether it has work (a kick may have gone to another process).
    pub fn all(n: usize) -> Again {
        Again {
            tokens: (0..n).collect(),
        }
    }

    /// Whether a turn must come soon, without waiting for an event.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The tokens to serve this turn, each once: those carried over, then
    /// the `ready` ones; the flag says whether epoll reported it (its
    /// eventfd has a count to read).
    pub fn turn(&mut self, ready: impl IntoIterator<Item = usize>) -> Vec<(usize, bool)> {
        let mut out: Vec<(usize, bool)> = self.tokens.drain(..).map(|t| (t, false)).collect();
        for t in ready {
            match out.iter_mut().find(|(c, _)| *c == t) {
                Some(entry) => entry.1 = true,
                None => out.push((t, true)),
            }
        }
        out
    }

    /// `token`'s device has work left: serve it next turn.
    pub fn carry(&mut self, token: usize, work: Work) {
        if work == Work::More && !self.tokens.contains(&token) {
            self.tokens.push(token);
        }
    }
}

/// Device work items, indexed by epoll token of the device epoll.
pub(super) enum DevToken {
    QueueNotify {
        slot: usize,
        queue: u16,
        evt: EventFd,
    },
    DeviceEvents {
        slot: usize,
    },
}

/// Control-epoll tokens below this are fixed; clients and children above.
pub(super) const TOKEN_EXIT: u64 = 0;
pub(super) const TOKEN_LISTENER: u64 = 1;
pub(super) const TOKEN_DEVICES: u64 = 2;
pub(super) const FIRST_DYNAMIC_TOKEN: u64 = 16;

impl Machine {
    pub(super) fn event_loop(&mut self) -> Result<LoopEnd, VmError> {
        let mut events = vec![EpollEvent::default(); 64];
        let mut panic_watch = PanicWatch::default();
        loop {
            if let Some(grace) = super::orphan_grace() {
                let unowned = self.unowned.turn(Instant::now());
                if self.owners == 0 && unowned >= grace {
                    // Its owner may be waiting to be accepted.
                    self.accept_clients();
                    if self.owners == 0 && self.unowned.turn(Instant::now()) >= grace {
                        return Err(VmError::Orphaned(grace));
                    }
                }
            }
            let busy = self.run_state == RunState::Running && !self.dev_again.is_empty();
            let timeout = if busy { 0 } else { PANIC_POLL_MS };
            let n = match self.ctl_epoll.wait(timeout, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(VmError::EventLoop("epoll_wait", e)),
            };
            if n == 0 && !busy {
                if self.run_state == RunState::Running {
                    let line = self.tail.lock().ok().and_then(|t| t.panic_line());
                    if panic_watch.poll(line.is_some()) {
                        if let Some(line) = line {
                            return Ok(LoopEnd::PanicWithoutReset(line));
                        }
                    }
                }
                continue;
            }
            let mut devices = busy;
            for ev in &events[..n] {
                match ev.data() {
                    TOKEN_EXIT => {
                        let _ = self.exit.evt.read();
                        if let Some((id, outcome)) = self.exit.take() {
                            return Ok(LoopEnd::Vcpu(id, outcome));
                        }
                    }
                    TOKEN_LISTENER => self.accept_clients(),
                    TOKEN_DEVICES => devices = true,
                    token => {
                        if let Some(plan) = self.item_event(token) {
                            return Ok(LoopEnd::Child(plan));
                        }
                    }
                }
            }
            // Devices last: exits and control requests of this turn first.
            if devices {
                self.device_events()?;
                if let Some(failure) = forkbox_devices::virtio::overlay::host_write_failure() {
                    return Err(VmError::HostDisk(failure.to_owned()));
                }
            }
        }
    }

    /// One turn of device work: every device token carried over or ready,
    /// once each, within its device's budget.
    pub(super) fn device_events(&mut self) -> Result<(), VmError> {
        if self.run_state != RunState::Running {
            return Ok(());
        }
        let mut events = vec![EpollEvent::default(); self.dev_tokens.len().max(1)];
        let n = match self.dev_epoll.wait(0, &mut events) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => 0,
            Err(e) => return Err(VmError::EventLoop("epoll_wait", e)),
        };
        let ready = events[..n].iter().map(|ev| ev.data() as usize);
        for (token, was_ready) in self.dev_again.turn(ready) {
            let work = match self.dev_tokens.get(token) {
                Some(DevToken::QueueNotify { slot, queue, evt }) => {
                    if was_ready {
                        let _ = evt.read();
                    }
                    virtio::lock(&self.slots[*slot].device).queue_notify(*queue)
                }
                Some(DevToken::DeviceEvents { slot }) => {
                    virtio::lock(&self.slots[*slot].device).handle_events()
                }
                None => Work::Done,
            };
            self.dev_again.carry(token, work);
        }
        Ok(())
    }

    /// Device events are watched only while the VM runs (a paused VM's
    /// devices do nothing; level-triggered fds would spin the loop).
    pub(super) fn watch_devices(&self, on: bool) {
        let op = if on {
            ControlOperation::Add
        } else {
            ControlOperation::Delete
        };
        let ev = EpollEvent::new(EventSet::IN, TOKEN_DEVICES);
        if let Err(e) = self.ctl_epoll.ctl(op, self.dev_epoll.as_raw_fd(), ev) {
            tracing::warn!("cannot change the device watch: {e}");
        }
    }
}

/// Registers a device's irqfd and queue ioeventfds (fresh eventfds), and
/// watches its events.
pub(super) fn wire_device(
    vm: &VmFd,
    index: usize,
    slot: &VirtioSlot,
    epoll: &Epoll,
    tokens: &mut Vec<DevToken>,
) -> Result<(), VmError> {
    let mut watch = |fd: i32, token: DevToken| -> Result<(), VmError> {
        let ev = EpollEvent::new(EventSet::IN, tokens.len() as u64);
        epoll
            .ctl(ControlOperation::Add, fd, ev)
            .map_err(|e| VmError::EventLoop("epoll_ctl", e))?;
        tokens.push(token);
        Ok(())
    };
    vm.register_irqfd(&slot.irq, slot.window.gsi)
        .map_err(kvm_err("register a virtio irqfd"))?;
    // A restored device whose interrupt was raised but not acknowledged at
    // the capture may have had it still in flight (an irqfd injects
    // asynchronously): raise it again on the fresh irqfd, or the driver can
    // wait forever. A driver that already saw it finds the status it
    // acknowledges, so a repeat is harmless.
    if virtio::lock(&slot.device).interrupt_status() != 0 {
        slot.irq
            .write(1)
            .map_err(|e| VmError::EventLoop("raise a restored interrupt", e))?;
    }
    // The other way round: a queue the driver kicked just before the
    // capture may not have been served (the kick waited in the parent's
    // ioeventfd), and a fresh ioeventfd has no kick in it. The driver will
    // not kick for those buffers again, so a restored device is kicked on
    // every queue once; a device finds nothing new where nothing was.
    let restored = virtio::lock(&slot.device).is_activated();
    for queue in 0..slot.queues {
        let evt = eventfd()?;
        let addr = IoEventAddress::Mmio(slot.window.base + VIRTIO_MMIO_QUEUE_NOTIFY);
        vm.register_ioevent(&evt, &addr, u32::from(queue))
            .map_err(kvm_err("register a queue ioeventfd"))?;
        if restored {
            evt.write(1)
                .map_err(|e| VmError::EventLoop("kick a restored queue", e))?;
        }
        let fd = evt.as_raw_fd();
        watch(
            fd,
            DevToken::QueueNotify {
                slot: index,
                queue,
                evt,
            },
        )?;
    }
    if let Some(fd) = virtio::lock(&slot.device).event_fd() {
        watch(fd, DevToken::DeviceEvents { slot: index })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panic_watch_without_panic_never_fires() {
        let mut w = PanicWatch::default();
        assert!((0..100).all(|_| !w.poll(false)));
    }

    #[test]
    fn again_serves_each_token_once_carried_first() {
        let mut again = Again::default();
        assert!(again.is_empty());
        again.carry(3, Work::More);
        again.carry(3, Work::More);
        again.carry(1, Work::Done);
        assert!(!again.is_empty());
        // 3 is both carried and ready: served once, its eventfd read.
        assert_eq!(again.turn([5, 3]), vec![(3, true), (5, true)]);
        assert!(again.is_empty());
        assert_eq!(again.turn([]), vec![]);
        assert_eq!(Again::all(2).turn([]), vec![(0, false), (1, false)]);
    }

    /// A device whose queue is never empty (its guest refills it as fast as
    /// it is served) next to one that gets a single kick: the busy one is
    /// served one budget per turn, carried over, and the other one is served
    /// in the very turn its kick arrived.
    #[test]
    fn again_busy_queue_does_not_starve_another_device() {
        const BUSY: usize = 0;
        const OTHER: usize = 1;
        let mut again = Again::default();
        let mut served = [0usize; 2];
        let mut other_served_in = None;
        for turn in 0..10 {
            // The busy queue is kicked every turn; the other one once.
            let ready: Vec<usize> = if turn == 4 {
                vec![BUSY, OTHER]
            } else {
                vec![BUSY]
            };
            for (token, _) in again.turn(ready) {
                served[token] += 1;
                let work = if token == BUSY {
                    Work::More
                } else {
                    other_served_in = Some(turn);
                    Work::Done
                };
                again.carry(token, work);
            }
        }
        assert_eq!(served, [10, 1]);
        assert_eq!(other_served_in, Some(4));
    }

    #[test]
    fn panic_watch_fires_after_grace_polls() {
        let mut w = PanicWatch::default();
        for _ in 0..PANIC_GRACE_POLLS {
            assert!(!w.poll(true));
        }
        assert!(w.poll(true));
    }
}
