//! Sandboxes and their networks as the API shows them (the JSON shapes
//! and their OpenAPI schemas), built from the registry's records.

use std::time::Instant;

use forkbox_host::measure;
use forkbox_net::policy::Policy;
use serde::Serialize;
use utoipa::ToSchema;

use super::Live;
use crate::core::{DeathCause, ExpiryAction, Labels, Record, SandboxId, SandboxState};
use crate::network::NetworkPolicy;
use crate::template::SandboxLimits;

/// A sandbox as the API shows it.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct SandboxInfo {
    pub id: SandboxId,
    pub template: String,
    pub state: SandboxState,
    pub metadata: Labels,
    /// Seconds since the Unix epoch, at admission.
    pub created_at: u64,
    /// Since the sandbox became ready, in milliseconds.
    pub uptime_ms: Option<u64>,
    /// The time-to-live in seconds, `null` for none.
    pub timeout_secs: Option<f64>,
    pub on_timeout: ExpiryAction,
    /// Milliseconds until the time-to-live runs out.
    pub expires_in_ms: Option<u64>,
    /// The sandbox this one was forked from.
    pub parent: Option<SandboxId>,
    pub children: Vec<SandboxId>,
    /// How the sandbox started: always `fork` (of its template's zygote,
    /// or of `parent`).
    pub started_by: &'static str,
    /// Admission to ready, in milliseconds.
    pub create_ms: Option<u64>,
    pub metrics: Option<SandboxMetrics>,
    /// Why it died.
    pub death: Option<DeathCause>,
}

/// A sandbox's egress policy as the API shows it.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct NetworkInfo {
    #[serde(flatten)]
    pub policy: NetworkPolicy,
    /// Whether the policy is in force. False only for a sandbox without
    /// a network broker (re-adopted from state an older daemon wrote, or
    /// forked from such a zygote): it opens no new connection whatever
    /// the policy says (the policy shown is the one recorded).
    pub active: bool,
}

/// What the host sees of a live sandbox's VMM process.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct SandboxMetrics {
    pub vmm_pid: Option<u32>,
    /// Resident memory of the VMM process (guest RAM touched plus the VMM).
    pub memory_rss_kib: Option<u64>,
    /// CPU time of the VMM process (all vCPUs plus devices).
    pub cpu_ms: Option<u64>,
    pub boot_ms: u64,
    /// Set when the first VM forked for this sandbox was lost (its VMM
    /// died, or it did not answer in time) and this one replaced it: what
    /// kind of loss (`triple fault`, `hang`, `VMM died`, ...). The full
    /// cause is in forkboxd's log.
    pub replaced_lost_child: Option<String>,
    /// The host resources it may take (its VMM's cgroup); `null` where the
    /// host gives VMMs no cgroup (forkboxd said so at start).
    pub limits: Option<SandboxLimits>,
    /// Host memory charged to it now (its cgroup's `memory.current`): what
    /// its guest wrote of its own and its VMM's own memory, not the pages
    /// it shares with its template's zygote.
    pub memory_charged_kib: Option<u64>,
}

/// The policy in force (`None`: the VM has no network) or else the one
/// recorded.
pub(super) fn network_info(in_force: Option<Policy>, recorded: &Policy) -> NetworkInfo {
    NetworkInfo {
        policy: NetworkPolicy::of(in_force.as_ref().unwrap_or(recorded)),
        active: in_force.is_some(),
    }
}

pub(super) fn info(r: &Record, live: Option<&Live>) -> SandboxInfo {
    let now = Instant::now();
    let metrics = live.map(|l| {
        let pid = l.machine.pid();
        SandboxMetrics {
            vmm_pid: pid,
            memory_rss_kib: pid.and_then(measure::rss_kib),
            cpu_ms: pid
                .and_then(measure::cpu_time)
                .map(|d| d.as_millis() as u64),
            boot_ms: l.machine.boot_time().as_millis() as u64,
            replaced_lost_child: l
                .machine
                .replaced()
                .map(|why| forkbox_host::vm::loss_signature(&why).to_owned()),
            limits: l.machine.cgroup().map(|c| SandboxLimits::of(c.limits())),
            memory_charged_kib: l
                .machine
                .cgroup()
                .and_then(|c| c.memory_current())
                .map(|b| b >> 10),
        }
    });
    SandboxInfo {
        id: r.id.clone(),
        template: r.template.clone(),
        state: r.state,
        metadata: r.labels.clone(),
        created_at: r.created_unix,
        uptime_ms: r
            .ready
            .filter(|_| r.state.is_live())
            .map(|t| now.saturating_duration_since(t).as_millis() as u64),
        timeout_secs: r.ttl.map(|t| t.as_secs_f64()),
        on_timeout: r.on_expiry,
        expires_in_ms: r
            .deadline
            .map(|d| d.saturating_duration_since(now).as_millis() as u64),
        parent: r.parent.clone(),
        children: r.children.clone(),
        started_by: "fork",
        create_ms: r
            .ready
            .map(|t| t.saturating_duration_since(r.admitted).as_millis() as u64),
        metrics,
        death: r.died.as_ref().map(|(_, c)| c.clone()),
    }
}
