//! Port forwards: a host listener on `127.0.0.2`
//! ([`PORT_FORWARD_IP`]) whose connections are relayed to a guest port
//! through the agent. Every forward of a sandbox closes when it dies (its
//! [`PortForward`] is dropped with it).
//!
//! Not `127.0.0.1`: that is where a sandbox's `host.forkbox.internal:P`
//! rule goes, and a sandbox must never reach another's forward. A listener
//! bound to `127.0.0.2` does not accept connections made to `127.0.0.1`,
//! and the broker connects to no other loopback address.

use std::net::SocketAddr;
use std::ops::ControlFlow;
use std::time::Duration;

use forkbox_host::poll::{self, TimedOut};
use forkbox_net::broker::PORT_FORWARD_IP;
use forkbox_proto::client::{AgentClient, ClientError};
use forkbox_proto::ErrorKind as GuestKind;
use serde::Serialize;
use utoipa::ToSchema;

use super::{blocking, chain, Daemon, DaemonError};
use crate::core::SandboxId;

/// A host listener relaying each connection to a guest port.
pub(super) struct PortForward {
    pub(super) host: SocketAddr,
    pub(super) task: tokio::task::AbortHandle,
}

impl Drop for PortForward {
    fn drop(&mut self) {
        // The task owns the listener and every relay: all close.
        self.task.abort();
    }
}

/// An open port forward.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct PortForwardInfo {
    /// The guest port.
    pub port: u16,
    /// Where to connect on the host: `127.0.0.2:NNNNN`.
    pub host: String,
}

impl Daemon {
    /// Opens (or returns the open) forward of guest `port`: a listener on
    /// [`PORT_FORWARD_IP`] of the host, each connection relayed to the guest port
    /// through the agent. With `check`, first makes sure the guest port
    /// accepts (one connection, closed at once), retrying for up to
    /// `wait`; a port that refuses is a guest error `ConnectionRefused`.
    pub async fn open_port(
        &self,
        id: &SandboxId,
        port: u16,
        check: bool,
        wait: Duration,
    ) -> Result<PortForwardInfo, DaemonError> {
        if port == 0 {
            return Err(DaemonError::Invalid(
                "guest port 0: expected 1-65535".into(),
            ));
        }
        let machine = self.machine(id)?;
        if let Some(host) = self.forward_of(id, port) {
            return Ok(PortForwardInfo { port, host });
        }
        if check {
            // Each attempt is an agent call with the usual deadline; the
            // retries stop at `wait`, itself at most that deadline.
            let within = self.bounds().agent_call;
            if wait > within {
                return Err(DaemonError::Invalid(format!(
                    "wait_secs {} is over the daemon's limit of {} s (forkboxd --agent-call-secs)",
                    wait.as_secs_f64(),
                    within.as_secs()
                )));
            }
            let agent = machine.agent().with_call_timeout(within);
            let probed = blocking(move || probe_port(&agent, port, wait)).await?;
            probed.map_err(|e| self.agent_failure(id, &machine, e))?;
        }
        let listener = tokio::net::TcpListener::bind((PORT_FORWARD_IP, 0))
            .await
            .map_err(|e| DaemonError::infra("binding a host port for a forward", e))?;
        let host = listener
            .local_addr()
            .map_err(|e| DaemonError::infra("binding a host port for a forward", e))?;
        let task = tokio::spawn(serve_forward(listener, machine.agent(), port)).abort_handle();
        let forward = PortForward { host, task };
        let mut s = self.lock();
        // Gone meanwhile: dropping `forward` closes it.
        let live = s
            .machines
            .get_mut(id)
            .ok_or_else(|| DaemonError::NoSandbox(id.clone()))?;
        // Opened concurrently: keep the first, drop ours.
        let kept = live.ports.entry(port).or_insert(forward);
        tracing::info!(%id, port, host = %kept.host, "port forward open");
        Ok(PortForwardInfo {
            port,
            host: kept.host.to_string(),
        })
    }

    pub(super) fn forward_of(&self, id: &SandboxId, port: u16) -> Option<String> {
        let s = self.lock();
        let f = s.machines.get(id)?.ports.get(&port)?;
        Some(f.host.to_string())
    }

    /// A sandbox's open forwards (none once it died).
    pub fn ports(&self, id: &SandboxId) -> Result<Vec<PortForwardInfo>, DaemonError> {
        let s = self.lock();
        s.registry.get(id)?;
        Ok(s.machines.get(id).map_or_else(Vec::new, |l| {
            l.ports
                .iter()
                .map(|(port, f)| PortForwardInfo {
                    port: *port,
                    host: f.host.to_string(),
                })
                .collect()
        }))
    }

    /// Closes the forward of guest `port` and its connections; `false`
    /// if there was none.
    pub fn close_port(&self, id: &SandboxId, port: u16) -> Result<bool, DaemonError> {
        let mut s = self.lock();
        s.registry.get(id)?;
        Ok(s.machines
            .get_mut(id)
            .and_then(|l| l.ports.remove(&port))
            .is_some())
    }
}

/// Connects to guest `port` until it accepts or `wait` passed (then the
/// last refusal is the answer); closes the probe connection at once.
pub(super) fn probe_port(
    agent: &AgentClient,
    port: u16,
    wait: Duration,
) -> Result<(), ClientError> {
    poll::until(
        super::deadline_in(wait),
        Duration::from_millis(100),
        || match agent.connect_port(port) {
            Ok(_probe) => ControlFlow::Break(Ok(())),
            Err(ClientError::Agent(a)) if a.kind == GuestKind::ConnectionRefused => {
                ControlFlow::Continue(ClientError::Agent(a))
            }
            Err(e) => ControlFlow::Break(Err(e)),
        },
    )
    .unwrap_or_else(|TimedOut(refused)| Err(refused))
}

/// Accepts connections forever, relaying each to guest `port`. Aborting
/// the task drops the listener and the relays with it.
pub(super) async fn serve_forward(
    listener: tokio::net::TcpListener,
    agent: AgentClient,
    port: u16,
) {
    let mut relays = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => {
                    relays.spawn(relay_connection(tcp, agent.clone(), port));
                }
                Err(e) => {
                    // Out of descriptors, say: back off rather than spin.
                    tracing::warn!(port, error = %e, "port forward: accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = relays.join_next(), if !relays.is_empty() => {}
        }
    }
}

/// One forwarded connection: the agent connects to the guest port, then
/// bytes flow both ways. If the guest refuses, the host connection is
/// reset, so the client sees a failure rather than an empty answer.
pub(super) async fn relay_connection(
    mut tcp: tokio::net::TcpStream,
    agent: AgentClient,
    port: u16,
) {
    // The connection itself is bounded; the relay after is the client's.
    let guest = tokio::task::spawn_blocking(move || {
        agent.with_call_timeout(CONNECT_WITHIN).connect_port(port)
    })
    .await;
    let guest = match guest {
        Ok(Ok(g)) => g,
        Ok(Err(e)) => {
            tracing::info!(port, error = %chain(&e), "port forward: guest connection failed; resetting the client's");
            reset(tcp);
            return;
        }
        Err(_) => return,
    };
    let guest = guest
        .set_nonblocking(true)
        .and_then(|()| tokio::net::UnixStream::from_std(guest));
    match guest {
        Ok(mut g) => {
            let _ = tokio::io::copy_bidirectional(&mut tcp, &mut g).await;
        }
        Err(e) => {
            tracing::warn!(port, error = %e, "port forward: cannot use the agent connection");
            reset(tcp);
        }
    }
}

/// Bound on the agent connecting a forwarded connection to its guest port.
const CONNECT_WITHIN: Duration = Duration::from_secs(30);

/// Closes with a reset (`SO_LINGER` 0) instead of an orderly close.
pub(super) fn reset(tcp: tokio::net::TcpStream) {
    let _ = tcp.set_zero_linger();
}
