//! The table of running execs, so that a fork child can say what happened
//! to the commands that were running when its VM was forked.
//!
//! In a fork child every vsock connection that existed at fork time is
//! reset, so each exec inherited from the parent loses its client: `exec`
//! kills its process group (its output has nowhere to go) and records it
//! here as *interrupted*. The after-fork hook then waits for those execs
//! to end and reports them, once. Nothing is lost silently: an exec either
//! answers its client, or is reported by the next `AfterFork`.
//!
//! Background processes (`Spawn`) are in the same table, with no client
//! connection: a fork never cuts them off (the child runs its copy on).
//! Ended ones stay listed, with their output and result, until
//! [`KEPT_ENDED`] newer ones ended.

use std::collections::{HashMap, VecDeque};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use forkbox_proto::{Command, ExitStatus, ForkedExec, ProcessInfo};

use crate::background::Background;
use crate::sys;

/// Ended background processes kept for `WaitProcess`, `AttachProcess`
/// and the list.
pub const KEPT_ENDED: usize = 64;

struct Running {
    command: Command,
    pid: u32,
    started: Instant,
    /// A clone of the client connection, to see whether it is gone;
    /// `None` for a background process.
    conn: Option<UnixStream>,
    /// Already reported (as interrupted, before it ended): do not report
    /// it again when it ends.
    reported: bool,
    /// [`ExecTable::settle`] found its client gone and killed it: it is
    /// interrupted however its own thread sees the end (that thread may
    /// see the exit before it notices the hang-up).
    client_gone: bool,
}

/// A background process, running or ended.
struct Spawned {
    pid: u32,
    command: Command,
    started: Instant,
    ended: Option<Instant>,
    bg: Arc<Background>,
}

#[derive(Default)]
struct Inner {
    next_id: u64,
    running: HashMap<u64, Running>,
    /// Ended because their client vanished; not yet reported.
    interrupted: Vec<ForkedExec>,
    /// By exec id, oldest first.
    background: VecDeque<(u64, Spawned)>,
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
        self.insert(command, pid, Some(conn))
    }

    /// Records a started background process; returns its exec id.
    pub fn register_background(&self, command: Command, pid: u32, bg: Arc<Background>) -> u64 {
        let id = self.insert(command.clone(), pid, None);
        let mut inner = self.lock();
        // A pid the kernel reused: the older record is stale.
        inner.background.retain(|(_, s)| s.pid != pid);
        inner.background.push_back((
            id,
            Spawned {
                pid,
                command,
                started: Instant::now(),
                ended: None,
                bg,
            },
        ));
        id
    }

    fn insert(&self, command: Command, pid: u32, conn: Option<UnixStream>) -> u64 {
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
                client_gone: false,
            },
        );
        id
    }

    /// The background process with this pid, running or ended.
    pub fn background(&self, pid: u32) -> Option<Arc<Background>> {
        let inner = self.lock();
        inner
            .background
            .iter()
            .rev()
            .find(|(_, s)| s.pid == pid)
            .map(|(_, s)| Arc::clone(&s.bg))
    }

    /// Whether a process the agent started with this pid still runs.
    pub fn is_running(&self, pid: u32) -> bool {
        self.lock().running.values().any(|r| r.pid == pid)
    }

    /// Background processes (running or kept after they ended), then
    /// running execs with a client; each by start.
    pub fn list(&self) -> Vec<ProcessInfo> {
        let inner = self.lock();
        let mut out: Vec<ProcessInfo> = inner
            .background
            .iter()
            .map(|(_, s)| ProcessInfo {
                pid: s.pid,
                command: s.command.clone(),
                background: true,
                ran_for: s.ended.unwrap_or_else(Instant::now) - s.started,
                result: s.bg.result(),
            })
            .collect();
        let mut fg: Vec<(&u64, &Running)> = inner
            .running
            .iter()
            .filter(|(_, r)| r.conn.is_some())
            .collect();
        fg.sort_by_key(|(id, _)| **id);
        out.extend(fg.into_iter().map(|(_, r)| ProcessInfo {
            pid: r.pid,
            command: r.command.clone(),
            background: false,
            ran_for: r.started.elapsed(),
            result: None,
        }));
        out
    }

    /// The exec ended. `client_gone`: it was killed because its client
    /// connection vanished, so nobody got its result.
    pub fn finished(&self, id: u64, status: ExitStatus, client_gone: bool) {
        let mut inner = self.lock();
        if let Some((_, s)) = inner.background.iter_mut().find(|(i, _)| *i == id) {
            s.ended = Some(Instant::now());
        }
        let ended = inner
            .background
            .iter()
            .filter(|(_, s)| s.ended.is_some())
            .count();
        if ended > KEPT_ENDED {
            let mut excess = ended - KEPT_ENDED;
            inner.background.retain(|(_, s)| {
                let drop_it = excess > 0 && s.ended.is_some();
                excess -= usize::from(drop_it);
                !drop_it
            });
        }
        if let Some(r) = inner.running.remove(&id) {
            if (client_gone || r.client_gone) && !r.reported {
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
            .iter_mut()
            .filter(|(_, r)| r.conn.as_ref().is_some_and(sys::peer_hung_up))
            .map(|(id, r)| {
                r.client_gone = true;
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

    /// The exec's own thread may see the exit of settle's kill before it
    /// notices its client is gone, and so says "client present": the exec
    /// is still reported as interrupted (a fresh-clone run lost it so).
    #[test]
    fn settle_reports_exec_it_killed_though_its_thread_saw_only_the_exit() {
        use std::os::unix::process::CommandExt;
        let table = Arc::new(ExecTable::default());
        let (ours, theirs) = pair();
        drop(theirs);
        let mut child = std::process::Command::new("sleep")
            .arg("1000")
            .process_group(0)
            .spawn()
            .expect("sleep");
        let id = table.register(Command::Shell("sleep 1000".into()), child.id(), ours);
        let settling = {
            let table = Arc::clone(&table);
            std::thread::spawn(move || table.settle(Duration::from_secs(60)))
        };
        // Returns once settle's SIGKILL landed: settle has marked it then.
        let status = child.wait().expect("wait");
        assert!(!status.success());
        table.finished(id, ExitStatus::Signal(9), false);
        let s = settling.join().expect("settle");
        assert_eq!(s.interrupted.len(), 1, "{s:?}");
        assert_eq!(s.interrupted[0].exec_id, id);
        assert_eq!(s.interrupted[0].status, Some(ExitStatus::Signal(9)));
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
    fn background_is_listed_after_it_ends_and_never_interrupted() {
        let table = ExecTable::default();
        let bg = Arc::new(Background::new(None));
        let id = table.register_background(Command::Shell("true".into()), 999_999, bg);
        assert!(table.is_running(999_999));
        let s = table.settle(Duration::ZERO);
        assert!(s.interrupted.is_empty());
        assert_eq!(s.still_running.len(), 1);
        table.finished(id, ExitStatus::Code(0), false);
        assert!(!table.is_running(999_999));
        assert!(table.background(999_999).is_some());
        let list = table.list();
        assert_eq!(list.len(), 1);
        assert!(list[0].background);
    }

    #[test]
    fn ended_background_processes_beyond_the_bound_are_forgotten() {
        let table = ExecTable::default();
        for pid in 0..(KEPT_ENDED as u32 + 5) {
            let bg = Arc::new(Background::new(None));
            let id = table.register_background(Command::Shell("true".into()), 10_000 + pid, bg);
            table.finished(id, ExitStatus::Code(0), false);
        }
        assert_eq!(table.list().len(), KEPT_ENDED);
        assert!(table.background(10_000).is_none());
        assert!(table.background(10_000 + KEPT_ENDED as u32 + 4).is_some());
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
