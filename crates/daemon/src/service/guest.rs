//! Calls into a running sandbox's guest agent: commands (streamed),
//! background processes, files. Each runs on the blocking pool; a failed
//! call is the guest's refusal or the machinery's, and a VM found dead
//! on the way is marked lost.

use std::sync::Arc;
use std::time::{Duration, Instant};

use forkbox_proto::client::{AgentClient, ClientError};
use forkbox_proto::{ExecRequest, ExecResult, OutputStream, ProcessInfo};
use tokio::sync::mpsc;

use super::{blocking, deadline_in, send_until, Daemon, DaemonError, Upload};

/// How long a call's last event waits for a client that stopped reading.
pub(super) const LAST_EVENT_WAIT: Duration = Duration::from_secs(5);
use crate::backend::BackendVm;
use crate::core::{CoreError, DeathCause, SandboxId, SandboxState};

/// One event of a streamed command.
#[derive(Debug)]
pub enum ExecEvent {
    Output(OutputStream, Vec<u8>),
    Exit(ExecResult),
    Failed(DaemonError),
}

/// A background process that ended, with the output the guest kept.
#[derive(Debug)]
pub struct ProcessEnded {
    pub result: ExecResult,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    /// Bytes of output the guest's bounded buffer dropped.
    pub dropped: u64,
}

/// What reattaching to a background process yields.
#[derive(Debug)]
pub enum AttachEvent {
    Output(OutputStream, Vec<u8>),
    /// `dropped` bytes had left the guest's bounded buffer; `result` is
    /// `None` while the process runs.
    End {
        dropped: u64,
        result: Option<ExecResult>,
    },
    Failed(DaemonError),
}

impl Daemon {
    /// The running sandbox a command goes to; the sandbox's environment
    /// and starting directory fill in what `req` does not set itself.
    pub(super) fn command_target(
        &self,
        id: &SandboxId,
        req: &mut ExecRequest,
    ) -> Result<Arc<dyn BackendVm>, DaemonError> {
        let s = self.lock();
        super::usable(&s, id)?;
        let live = s
            .machines
            .get(id)
            .ok_or_else(|| DaemonError::NoSandbox(id.clone()))?;
        for (k, v) in &live.envs {
            req.env.entry(k.clone()).or_insert_with(|| v.clone());
        }
        if req.cwd.is_none() {
            req.cwd = live.cwd.clone();
        }
        Ok(live.machine.clone())
    }

    /// Turns an agent-call failure into a guest error or an infrastructure
    /// one; a VM found dead is marked so. Call [`settle`] first, on the
    /// blocking thread that made the call.
    pub(super) fn agent_failure(
        &self,
        id: &SandboxId,
        machine: &Arc<dyn BackendVm>,
        e: ClientError,
    ) -> DaemonError {
        if let ClientError::Agent(a) = e {
            return DaemonError::Guest(a);
        }
        if let ClientError::TooManyEntries { .. } = e {
            return DaemonError::TooLarge {
                message: e.to_string(),
            };
        }
        // Dead already while the call ran: killed or expired (the
        // caller's doing), or found ended by the reaper first (then as it
        // ended: the guest's doing, or the machinery's).
        if let Ok(r) = self.lock().registry.get(id) {
            if r.state == SandboxState::Dead {
                return match &r.died {
                    Some((_, DeathCause::GuestEnded { reason })) => DaemonError::GuestEnded {
                        what: format!("sandbox {id} died: {reason}"),
                    },
                    Some((_, DeathCause::VmLost { reason })) => DaemonError::Infrastructure {
                        what: format!("sandbox {id} died: {reason}"),
                        cause: Some(Box::new(e)),
                    },
                    _ => DaemonError::State(CoreError::WrongState {
                        id: id.clone(),
                        state: r.state,
                        wanted: "finish the call",
                        needs: "running",
                    }),
                };
            }
        }
        if let Some(end) = machine.exited() {
            let what = format!("sandbox {id} died: {}", end.how);
            let by_guest = end.by_guest;
            let _ = self.kill(id, DeathCause::ended(end));
            if by_guest {
                return DaemonError::GuestEnded { what };
            }
            return DaemonError::Infrastructure {
                what,
                cause: Some(Box::new(e)),
            };
        }
        if let ClientError::TimedOut { after } = e {
            return DaemonError::GuestTimeout {
                what: format!("sandbox {id}"),
                after,
            };
        }
        DaemonError::infra(format!("the agent channel of sandbox {id} failed"), e)
    }

    /// Starts a command; its output and exit status arrive on the
    /// returned channel. Checks that the sandbox exists and runs before
    /// returning, so those errors come first and alone.
    pub fn exec(
        &self,
        id: &SandboxId,
        mut req: ExecRequest,
        stdin: Option<Vec<u8>>,
    ) -> Result<mpsc::Receiver<ExecEvent>, DaemonError> {
        let machine = self.command_target(id, &mut req)?;
        let within = self.bound_exec(&mut req)?;
        let (tx, rx) = mpsc::channel(64);
        let this = self.clone();
        let id = id.clone();
        tokio::task::spawn_blocking(move || {
            let start = Instant::now();
            let deadline = deadline_in(within);
            this.inner.metrics.execs.inc();
            let agent = machine.agent().with_call_timeout(within);
            let mut input = stdin.map(std::io::Cursor::new);
            let stdin: Option<&mut (dyn std::io::Read + Send)> =
                input.as_mut().map(|c| c as &mut (dyn std::io::Read + Send));
            // A client gone mid-stream drops the receiver: sends fail, the
            // output is discarded and the command runs to its end (its
            // timeout bounds that). One that stays but stops reading
            // holds each send at most until the call's deadline.
            let out_tx = tx.clone();
            let result = agent.exec(&req, stdin, &mut |stream, bytes| {
                send_until(&out_tx, ExecEvent::Output(stream, bytes.to_vec()), deadline);
            });
            let event = match result {
                Ok(r) => {
                    this.inner.metrics.exec_latency.observe(start.elapsed());
                    ExecEvent::Exit(r)
                }
                Err(e) => {
                    settle(&machine, &e);
                    ExecEvent::Failed(this.agent_failure(&id, &machine, e))
                }
            };
            send_until(&tx, event, deadline_in(LAST_EVENT_WAIT));
        });
        Ok(rx)
    }

    /// Bounds a command by [`Bounds::max_exec`](super::Bounds): one
    /// without a timeout gets that one (the guest kills it then), one
    /// with a longer timeout is refused. Returns the deadline of the call.
    pub(super) fn bound_exec(&self, req: &mut ExecRequest) -> Result<Duration, DaemonError> {
        self.check_timeout(req)?;
        let t = *req.timeout.get_or_insert(self.bounds().max_exec);
        Ok(self.bounds().waiting(t))
    }

    /// A command's timeout over [`Bounds::max_exec`](super::Bounds) is
    /// refused (the API refuses it first, as a 400).
    fn check_timeout(&self, req: &ExecRequest) -> Result<(), DaemonError> {
        let max = self.bounds().max_exec;
        match req.timeout {
            Some(t) if t > max => Err(DaemonError::Invalid(format!(
                "a command's timeout of {} s is over the daemon's limit of {} s \
                 (forkboxd --max-exec-secs)",
                t.as_secs_f64(),
                max.as_secs()
            ))),
            _ => Ok(()),
        }
    }

    /// Runs a blocking call against a running sandbox's agent; a failure
    /// is the guest's refusal or the machinery's (a VM found dead is
    /// marked lost).
    pub(super) async fn with_agent<T: Send + 'static>(
        &self,
        id: &SandboxId,
        op: impl FnOnce(&AgentClient) -> Result<T, ClientError> + Send + 'static,
    ) -> Result<T, DaemonError> {
        self.with_agent_within(id, self.bounds().agent_call, op)
            .await
    }

    /// [`with_agent`](Self::with_agent) with a deadline of its own.
    pub(super) async fn with_agent_within<T: Send + 'static>(
        &self,
        id: &SandboxId,
        within: Duration,
        op: impl FnOnce(&AgentClient) -> Result<T, ClientError> + Send + 'static,
    ) -> Result<T, DaemonError> {
        let machine = self.machine(id)?;
        let m = machine.clone();
        let called = blocking(move || {
            let r = op(&m.agent().with_call_timeout(within));
            if let Err(e) = &r {
                settle(&m, e);
            }
            r
        });
        match called.await? {
            Ok(v) => Ok(v),
            Err(e) => Err(self.agent_failure(id, &machine, e)),
        }
    }

    /// Starts a command in the background; returns its guest pid. `stdin`
    /// is written to it (its stdin stays open for more).
    pub async fn spawn_process(
        &self,
        id: &SandboxId,
        mut req: ExecRequest,
        stdin: Option<Vec<u8>>,
    ) -> Result<u32, DaemonError> {
        let machine = self.command_target(id, &mut req)?;
        // A background process holds no daemon thread: no default timeout.
        self.check_timeout(&req)?;
        self.inner.metrics.execs.inc();
        let m = machine.clone();
        let within = self.bounds().agent_call;
        let spawned = blocking(move || {
            let agent = m.agent().with_call_timeout(within);
            let spawn = || {
                let pid = agent.spawn(&req)?;
                if let Some(bytes) = stdin {
                    agent.process_stdin(pid, false, &mut bytes.as_slice())?;
                }
                Ok(pid)
            };
            let r = spawn();
            if let Err(e) = &r {
                settle(&m, e);
            }
            r
        })
        .await?;
        spawned.map_err(|e| self.agent_failure(id, &machine, e))
    }

    /// The sandbox's background processes (running, and the last ones
    /// that ended) and the commands running with a client.
    pub async fn processes(&self, id: &SandboxId) -> Result<Vec<ProcessInfo>, DaemonError> {
        self.with_agent(id, |a| a.processes()).await
    }

    /// Waits up to `timeout` (none: until it ends) for background process
    /// `pid` to end; `None` if it still runs then. Its output is what the
    /// guest kept.
    pub async fn wait_process(
        &self,
        id: &SandboxId,
        pid: u32,
        timeout: Option<Duration>,
    ) -> Result<Option<ProcessEnded>, DaemonError> {
        let max = self.bounds().max_exec;
        let timeout = Some(timeout.map_or(max, |t| t.min(max)));
        let within = self.bounds().waiting(max);
        self.with_agent_within(id, within, move |a| {
            let Some(result) = a.wait_process(pid, timeout)? else {
                return Ok(None);
            };
            let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
            let (dropped, _) = a.attach_process(pid, false, &mut |s, bytes| match s {
                OutputStream::Stdout => stdout.extend_from_slice(bytes),
                OutputStream::Stderr => stderr.extend_from_slice(bytes),
            })?;
            Ok(Some(ProcessEnded {
                result,
                stdout,
                stderr,
                dropped,
            }))
        })
        .await
    }

    /// Sends `signal` to process `pid`'s group.
    pub async fn kill_process(
        &self,
        id: &SandboxId,
        pid: u32,
        signal: i32,
    ) -> Result<(), DaemonError> {
        self.with_agent(id, move |a| a.kill_process(pid, signal))
            .await
    }

    /// Writes `data` to process `pid`'s stdin, then closes it with
    /// `close`; returns the bytes written.
    pub async fn write_stdin(
        &self,
        id: &SandboxId,
        pid: u32,
        close: bool,
        data: Upload,
    ) -> Result<u64, DaemonError> {
        let into = format!("the stdin of process {pid}");
        self.upload_with_agent(id, data, into, move |a, data| {
            a.process_stdin(pid, close, data)
        })
        .await
    }

    /// Reattaches to background process `pid`: its buffered output, with
    /// `follow` then its output as it comes, then how it ended.
    pub fn attach(
        &self,
        id: &SandboxId,
        pid: u32,
        follow: bool,
    ) -> Result<mpsc::Receiver<AttachEvent>, DaemonError> {
        let machine = self.machine(id)?;
        let (tx, rx) = mpsc::channel(64);
        let this = self.clone();
        let id = id.clone();
        // Following a process lasts at most as long as a command may run.
        let within = match follow {
            true => self.bounds().waiting(self.bounds().max_exec),
            false => self.bounds().agent_call,
        };
        tokio::task::spawn_blocking(move || {
            let deadline = deadline_in(within);
            let out_tx = tx.clone();
            let r = machine.agent().with_call_timeout(within).attach_process(
                pid,
                follow,
                &mut |stream, bytes| {
                    send_until(
                        &out_tx,
                        AttachEvent::Output(stream, bytes.to_vec()),
                        deadline,
                    );
                },
            );
            let event = match r {
                Ok((dropped, result)) => AttachEvent::End { dropped, result },
                Err(e) => {
                    settle(&machine, &e);
                    AttachEvent::Failed(this.agent_failure(&id, &machine, e))
                }
            };
            send_until(&tx, event, deadline_in(LAST_EVENT_WAIT));
        });
        Ok(rx)
    }
}

/// How long a call whose connection dropped waits to see its VM end.
const VM_END_GRACE: Duration = Duration::from_secs(5);

/// How long a call that found no one listening on the VM's socket (or no
/// agent behind it) waits to see its VM end: a VMM that closed its socket is exiting, which
/// takes milliseconds (a guest's power-off, which takes longer, drops a
/// connection instead).
const VM_GONE_GRACE: Duration = Duration::from_secs(1);

/// After a call lost its agent connection, or found no one listening on
/// the VM's socket: waits, at most [`VM_END_GRACE`] (or
/// [`VM_GONE_GRACE`]), for the VM to be seen ended. A guest that powers off or panics drops the connection a
/// moment before its VMM has exited, and that end, not the dropped
/// connection, says whose doing it was; a VMM killed from outside closes
/// its socket a moment before it can be seen ended, and the call's answer
/// should already say it died. Blocks: call it on the blocking thread
/// that made the call.
pub(super) fn settle(machine: &Arc<dyn BackendVm>, e: &ClientError) {
    let grace = match e {
        ClientError::Disconnected(_) => VM_END_GRACE,
        ClientError::Connect { source, .. }
            if matches!(
                source.kind(),
                std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotFound
            ) =>
        {
            VM_GONE_GRACE
        }
        // Connected, but the VMM reset the connection before the agent
        // answered (a dying VMM's socket can still accept), or it never
        // answered: the same short wait, the call fails either way.
        ClientError::NotReady { .. } => VM_GONE_GRACE,
        _ => return,
    };
    let deadline = std::time::Instant::now() + grace;
    forkbox_host::poll::holds_by(deadline, Duration::from_millis(20), || {
        machine.exited().is_some()
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::chain;
    use crate::service::testing::*;

    fn gone() -> forkbox_proto::ClientError {
        forkbox_proto::ClientError::Disconnected(std::io::ErrorKind::ConnectionReset.into())
    }

    #[tokio::test]
    async fn a_call_that_fails_after_the_reaper_found_its_guest_ended_says_so() {
        // The race of a guest's `poweroff -f`: the reaper marks the sandbox
        // dead before the failed call is classified.
        let fake = Fake::default();
        let world = fake.world.clone();
        let d = daemon(fake, 4);
        let (a, b) = (created(&d, None).await, created(&d, None).await);
        world.guest_ends_last("the guest powered off");
        d.tick(Instant::now());
        let machine = d.machine_any(&b.id).ok();
        assert!(machine.is_none(), "dead and gone");
        let any = d.machine(&a.id).expect("a lives");
        let e = d.agent_failure(&b.id, &any, gone());
        assert!(matches!(e, DaemonError::GuestEnded { .. }), "{e:?}");
        assert!(!e.is_infrastructure());
        // Killed by its client meanwhile: a wrong state, the caller's.
        d.kill(&a.id, DeathCause::Killed).expect("kill");
        let e = d.agent_failure(&a.id, &any, gone());
        assert_eq!(e.kind(), "conflict", "{e:?}");
    }

    #[tokio::test]
    async fn exec_on_unreachable_agent_is_infrastructure() {
        let d = daemon(Fake::default(), 4);
        let a = created(&d, None).await;
        let mut rx = d
            .exec(&a.id, ExecRequest::shell("true"), None)
            .expect("starts");
        match rx.recv().await {
            Some(ExecEvent::Failed(e)) => assert!(e.is_infrastructure(), "{e:?}"),
            other => panic!("{other:?}"),
        }
    }

    /// An exec on `id` fails as infrastructure, saying its VMM died.
    async fn exec_finds_the_vmm_died(d: &Daemon, id: &SandboxId) {
        let mut rx = d
            .exec(id, ExecRequest::shell("true"), None)
            .expect("starts");
        match rx.recv().await {
            Some(ExecEvent::Failed(e)) => {
                assert!(e.is_infrastructure(), "{e:?}");
                assert!(chain(&e).contains("died: the VMM died (signal 9)"), "{e:?}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn exec_on_a_vm_that_ended_by_itself_marks_the_sandbox_lost() {
        let fake = Fake::default();
        let world = fake.world.clone();
        let d = daemon(fake, 4);
        let a = created(&d, None).await;
        world.lose_last("the VMM died (signal 9)");
        exec_finds_the_vmm_died(&d, &a.id).await;
        let i = d.execute_sync_info(&a.id).expect("remembered");
        assert_eq!(i.state, SandboxState::Dead);
        assert_eq!(
            i.death,
            Some(DeathCause::VmLost {
                reason: "the VMM died (signal 9)".into()
            })
        );
        assert_eq!(d.lock().registry.live(), 0);
    }

    /// A VMM killed from outside closes its socket a moment before it can
    /// be seen ended: the call that found no one listening waits for that
    /// end, so its answer says the sandbox died and the death is recorded
    /// with it, not a reaper round later.
    #[tokio::test]
    async fn a_call_that_finds_no_listener_waits_for_the_vmm_to_be_seen_ended() {
        let fake = Fake::default();
        let world = fake.world.clone();
        let d = daemon(fake, 4);
        let a = created(&d, None).await;
        let later = world.clone();
        let ender = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            later.lose_last("the VMM died (signal 9)");
        });
        exec_finds_the_vmm_died(&d, &a.id).await;
        ender.join().expect("ender");
        let i = d.execute_sync_info(&a.id).expect("remembered");
        assert_eq!(i.state, SandboxState::Dead, "recorded with the answer");
    }

    #[tokio::test]
    async fn exec_on_a_vm_its_guest_ended_is_the_guests_doing_not_infrastructure() {
        let fake = Fake::default();
        let world = fake.world.clone();
        let d = daemon(fake, 4);
        let a = created(&d, None).await;
        world.guest_ends_last("guest kernel panicked: sysrq triggered crash");
        let mut rx = d
            .exec(&a.id, ExecRequest::shell("true"), None)
            .expect("starts");
        match rx.recv().await {
            Some(ExecEvent::Failed(e)) => {
                assert!(!e.is_infrastructure(), "{e:?}");
                assert_eq!(e.kind(), "guest_ended");
                assert!(chain(&e).contains("sysrq triggered crash"), "{e:?}");
            }
            other => panic!("{other:?}"),
        }
        let i = d.execute_sync_info(&a.id).expect("remembered");
        assert_eq!(
            i.death,
            Some(DeathCause::GuestEnded {
                reason: "guest kernel panicked: sysrq triggered crash".into()
            })
        );
        // Later calls say the same, not merely "dead".
        let again = d
            .exec(&a.id, ExecRequest::shell("true"), None)
            .expect_err("dead");
        assert_eq!(again.kind(), "guest_ended", "{again:?}");
        assert!(!again.is_infrastructure());
        assert_eq!(d.lock().registry.live(), 0);
    }
}
