//! The one reaper: waits for every child, hands each exit status to the
//! exec that spawned that pid, and discards the statuses of orphans that
//! were reparented to us (we are PID 1, or a subreaper in `serve` mode).
//!
//! Nothing else in the agent may call `wait`: `std::process::Child::wait`
//! would race with this thread and lose statuses.
//!
//! Race freedom: spawning happens with the waiter table locked, and the
//! reaper only *peeks* at an exited pid (`WNOWAIT`) before taking the same
//! lock and reaping it. So an exit is never dispatched before its waiter is
//! registered, and a child whose exec failed (which `std` reaps itself
//! inside `spawn`) is never stolen from under `std`.

use std::collections::HashMap;
use std::io;
use std::process::{Child, Command};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread;
use std::time::Duration;

use crate::sys::{self, WaitStatus};

/// Called once with the exit status of the pid it was registered for.
pub type OnExit = Box<dyn FnOnce(WaitStatus) + Send>;

#[derive(Default)]
struct Table {
    waiters: HashMap<u32, OnExit>,
    /// Bumped on every spawn, so the reaper knows to retry after ECHILD.
    generation: u64,
}

/// Shared handle on the reaper thread.
#[derive(Default)]
pub struct Reaper {
    table: Mutex<Table>,
    spawned: Condvar,
}

impl Reaper {
    /// Starts the reaper thread.
    pub fn start() -> io::Result<Arc<Self>> {
        let reaper = Arc::new(Self::default());
        let r = Arc::clone(&reaper);
        thread::Builder::new()
            .name("reaper".into())
            .spawn(move || r.run())?;
        Ok(reaper)
    }

    fn lock(&self) -> MutexGuard<'_, Table> {
        // The table stays consistent even if a holder panicked.
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Spawns `cmd`; `on_exit` gets its exit status.
    pub fn spawn(&self, cmd: &mut Command, on_exit: OnExit) -> io::Result<Child> {
        let mut table = self.lock();
        let child = cmd.spawn()?;
        table.waiters.insert(child.id(), on_exit);
        table.generation += 1;
        self.spawned.notify_all();
        Ok(child)
    }

    fn run(&self) {
        loop {
            let generation = self.lock().generation;
            match sys::wait_any_exited() {
                Ok(pid) => {
                    let mut table = self.lock();
                    match sys::reap(pid) {
                        Ok(Some(status)) => {
                            if let Some(on_exit) = table.waiters.remove(&pid) {
                                drop(table);
                                on_exit(status);
                            }
                        }
                        // Reaped by `std` after a failed exec, or not a
                        // zombie after all: nothing to dispatch.
                        Ok(None) => {}
                        Err(e) => crate::log(&format!("reaper: waitpid({pid}): {e}")),
                    }
                }
                Err(e) if e.raw_os_error() == Some(libc::ECHILD) => {
                    let table = self.lock();
                    if table.generation == generation {
                        // No children: sleep until a spawn. The timeout is
                        // only a backstop; spawns always notify.
                        let _ = self
                            .spawned
                            .wait_timeout(table, Duration::from_secs(1))
                            .unwrap_or_else(PoisonError::into_inner);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    crate::log(&format!("reaper: waitid: {e}"));
                    thread::sleep(Duration::from_millis(100));
                }
            }
        }
    }
}
