//! What the service's tests share: a daemon on the fake backend and
//! shorthands for its commands.

// What most tests use, for their `use crate::service::testing::*`.
pub(super) use std::sync::atomic::Ordering::Relaxed as ORD;
pub(super) use std::sync::Arc;
pub(super) use std::time::{Duration, Instant};

pub(super) use forkbox_net::policy::Policy;
pub(super) use forkbox_proto::ExecRequest;

pub(super) use super::view::info;
pub(super) use super::{
    Config, CreateSandbox, Daemon, DaemonError, Lifecycle, NetworkInfo, Reply, SandboxInfo,
};
pub(super) use crate::backend::fake::Fake;
pub(super) use crate::core::{Limits, SandboxId, SandboxState};
pub(super) use crate::network::{EgressLogs, NetworkPolicy};
pub(super) use crate::persist::Store;
pub(super) use crate::template::TemplateState;

pub(super) fn daemon(fake: Fake, max_live: usize) -> Daemon {
    Daemon::new(Arc::new(fake), config(max_live)).expect("daemon")
}

/// The tests' daemon's configuration: nothing refused for host memory.
pub(super) fn config(max_live: usize) -> Config {
    Config {
        limits: Limits {
            max_live,
            max_creating: 2,
            keep_dead: 16,
        },
        create_wait: Duration::ZERO,
        boot_timeout: Duration::from_secs(1),
        egress_log_ttl: Duration::from_secs(3600),
        bounds: Default::default(),
        memory_reserve: 0,
        host_memory: || None,
        images: None,
    }
}

pub(super) fn create(template: &str, ttl: Option<Duration>) -> Lifecycle {
    Lifecycle::Create(CreateSandbox {
        template: template.into(),
        ttl,
        ..CreateSandbox::default()
    })
}

pub(super) async fn created(d: &Daemon, ttl: Option<Duration>) -> SandboxInfo {
    match d.execute(create("minimal", ttl)).await {
        Ok(Reply::Sandbox(i)) => *i,
        other => panic!("create: {other:?}"),
    }
}

pub(super) async fn forked(
    d: &Daemon,
    id: &SandboxId,
    count: u32,
) -> Vec<Result<SandboxInfo, DaemonError>> {
    match d
        .execute(Lifecycle::Fork {
            id: id.clone(),
            count,
            seed: None,
        })
        .await
    {
        Ok(Reply::Forked(v)) => v,
        other => panic!("fork: {other:?}"),
    }
}

pub(super) fn policy(allow: &[&str]) -> Policy {
    NetworkPolicy {
        allow_out: allow.iter().map(|r| r.to_string()).collect(),
        deny_out: vec![],
    }
    .parse()
    .expect("valid policy")
}

pub(super) async fn network(d: &Daemon, id: &SandboxId) -> Result<NetworkInfo, DaemonError> {
    match d.execute(Lifecycle::Network { id: id.clone() }).await? {
        Reply::Network(n) => Ok(n),
        other => panic!("network: {other:?}"),
    }
}

pub(super) async fn set_network(
    d: &Daemon,
    id: &SandboxId,
    p: Policy,
) -> Result<NetworkInfo, DaemonError> {
    match d
        .execute(Lifecycle::SetNetwork {
            id: id.clone(),
            policy: p,
        })
        .await?
    {
        Reply::Network(n) => Ok(n),
        other => panic!("set network: {other:?}"),
    }
}

pub(super) async fn created_with(
    d: &Daemon,
    template: &str,
    network: Option<Policy>,
) -> SandboxInfo {
    match d
        .execute(Lifecycle::Create(CreateSandbox {
            template: template.into(),
            network,
            ..CreateSandbox::default()
        }))
        .await
    {
        Ok(Reply::Sandbox(i)) => *i,
        other => panic!("create: {other:?}"),
    }
}

impl Daemon {
    pub(super) fn execute_sync_info(&self, id: &SandboxId) -> Option<SandboxInfo> {
        let s = self.lock();
        s.registry.get(id).ok().map(|r| info(r, s.machines.get(id)))
    }
}
