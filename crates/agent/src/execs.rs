//! The table of running execs, so that a fork child can say what happened
//! to the commands that were running when its VM was forked.
//!
//! In a fork child every vsock connection that existed at fork time is
//! reset, so each exec inherited from the parent loses its client: `exec`
//! kills its process group (its output has nowhere to go) and records it
//! here as *interrupted*. The after-fork hook then waits for those execs
//! to end and reports them, once. Nothing is lost silently: an exec either
//! answers its client, or is reported by the next `AfterFork`.

use std::collections::HashMap;
use std::os::unix::net::UnixStream;
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use forkbox_proto::{Command, ExitStatus, ForkedExec};

use crate::sys;

struct Running {
    command: Command,
    pid: u32,
    started: Instant,
    /// A clone of the client connection, to see whether it is gone.
    conn: UnixStream,
    /// Already reported (as interrupted, before it ended): do not report
    /// it again when it ends.
    reported: bool,
}

#[derive(Default)]
struct Inner {
    next_id: u64,
    running: HashMap<u64, Running>,
    /// Ended because their client vanished; not yet reported.
    interrupted: Vec<ForkedExec>,
}

/// Shared by every connection thread.
#[derive(Default)]
pub struct ExecTable {
    inner: Mutex<Inner>,
    ended: Condvar,
}

/// What the after-fork hook found.
#[derive(Debug, Default)]
pub struct Settled {
    pub interrupted: Vec<ForkedExec>,
    pub still_running: Vec<ForkedExec>,
}

impl ExecTable {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records a started exec; returns its id.
    pub fn register(&self, command: Command, pid: u32, conn: UnixStream) -> u64 {
        let mut inner = self.lock();
        inner.next_id += 1;
        let id = inner.next_id;
        inner.running.insert(
            id,
            Running {
                command,
                pid,
                started: Instant::now(),
                conn,
                reported: false,
            },
        );
        id
    }

    /// The exec ended. `client_gone`: it was killed because its client
    /// connection vanished, so nobody got its result.
    pub fn finished(&self, id: u64, status: ExitStatus, client_gone: bool) {
        let mut inner = self.lock();
        if let Some(r) = inner.running.remove(&id) {
            if client_gone && !r.reported {
                inner.interrupted.push(ForkedExec {
                    exec_id: id,
                    command: r.command,
                    pid: r.pid,
                    ran_for: r.started.elapsed(),
                    status: Some(status),
                });
            }
        }
        drop(inner);
        self.ended.notify_all();
    }

    /// Kills every running exec whose client is gone, waits up to
    /// `timeout` for them to end, and returns (and forgets) every
    /// interrupted exec not yet reported, plus those still running with a
    /// live client.
    pub fn settle(&self, timeout: Duration) -> Settled {
        let deadline = Instant::now() + timeout;
        let mut inner = self.lock();
        let doomed: Vec<u64> = inner
            .running
            .iter()
            .filter(|(_, r)| sys::peer_hung_up(&r.conn))
            .map(|(id, r)| {
                // The exec's own thread kills it too once it notices;
                // ESRCH from the second kill is fine.
                let _ = sys::kill_group(r.pid, libc::SIGKILL);
                *id
            })
            .collect();
        while doomed.iter().any(|id| inner.running.contains_key(id)) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            inner = self
                .ended
                .wait_timeout(inner, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        let mut settled = Settled {
            interrupted: std::mem::take(&mut inner.interrupted),
            still_running: Vec::new(),
        };
        let mut ids: Vec<u64> = inner.running.keys().copied().collect();
        ids.sort_unstable();
        for id in ids {
            let Some(r) = inner.running.get_mut(&id) else {
                continue;
            };
            let info = ForkedExec {
                exec_id: id,
                command: r.command.clone(),
                pid: r.pid,
                ran_for: r.started.elapsed(),
                status: None,
            };
            if doomed.contains(&id) {
                // Killed but not yet reaped (something holds its pipes):
                // report it as interrupted now, and not again later.
                r.reported = true;
                settled.interrupted.push(info);
            } else {
                settled.still_running.push(info);
            }
        }
        settled.interrupted.sort_by_key(|e| e.exec_id);
        settled
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> (UnixStream, UnixStream) {
        UnixStream::pair().expect("socketpair")
    }

    #[test]
    fn settle_reports_exec_whose_client_vanished_once() {
        let table = ExecTable::default();
        let (ours, theirs) = pair();
        let id = table.register(Command::Shell("sleep 9".into()), 999_999, ours);
        table.finished(id, ExitStatus::Signal(9), true);
        drop(theirs);
        let s = table.settle(Duration::ZERO);
        assert_eq!(s.interrupted.len(), 1);
        assert_eq!(s.interrupted[0].exec_id, id);
        assert_eq!(s.interrupted[0].status, Some(ExitStatus::Signal(9)));
        assert!(s.still_running.is_empty());
        assert!(table.settle(Duration::ZERO).interrupted.is_empty());
    }

    #[test]
    fn settle_lists_exec_with_live_client_as_running() {
        let table = ExecTable::default();
        let (ours, _theirs) = pair();
        let id = table.register(Command::Argv(vec!["sleep".into()]), 999_999, ours);
        let s = table.settle(Duration::ZERO);
        assert!(s.interrupted.is_empty());
        assert_eq!(s.still_running.len(), 1);
        assert_eq!(s.still_running[0].exec_id, id);
        assert_eq!(s.still_running[0].status, None);
    }

    #[test]
    fn settle_reports_unfinished_doomed_exec_only_once() {
        let table = ExecTable::default();
        let (ours, theirs) = pair();
        drop(theirs);
        // pid 999999: no such process group; the kill fails harmlessly.
        let id = table.register(Command::Shell("x".into()), 999_999, ours);
        let s = table.settle(Duration::from_millis(10));
        assert_eq!(s.interrupted.len(), 1);
        assert_eq!(s.interrupted[0].status, None);
        table.finished(id, ExitStatus::Signal(9), true);
        assert!(table.settle(Duration::ZERO).interrupted.is_empty());
    }

    #[test]
    fn finished_with_client_present_is_not_reported() {
        let table = ExecTable::default();
        let (ours, _theirs) = pair();
        let id = table.register(Command::Shell("true".into()), 999_999, ours);
        table.finished(id, ExitStatus::Code(0), false);
        let s = table.settle(Duration::ZERO);
        assert!(s.interrupted.is_empty() && s.still_running.is_empty());
    }
}
