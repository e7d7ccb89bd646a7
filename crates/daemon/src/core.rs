//! The daemon's decisions, free of transports, VMs and clocks: the sandbox
//! registry, its state machine (creating → running ⇄ paused → dead),
//! metadata labels, time-to-live deadlines and the caps on live sandboxes
//! and on creations in flight.
//!
//! Every method takes `now` from its caller, so tests drive time by hand
//! and never sleep.

use std::collections::BTreeMap;
use std::fmt;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// A sandbox's identity: `sb-` and 16 hex digits, never reused while the
/// daemon runs.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, ToSchema)]
#[serde(transparent)]
#[schema(value_type = String, example = "sb-00000001a3f09c11")]
pub struct SandboxId(String);

impl SandboxId {
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Accepts what [`Registry`] hands out; anything else cannot name a
    /// sandbox.
    pub fn parse(s: &str) -> Option<Self> {
        let hex = s.strip_prefix("sb-")?;
        (hex.len() == 16 && hex.bytes().all(|b| b.is_ascii_hexdigit())).then(|| Self(s.to_owned()))
    }
}

impl fmt::Display for SandboxId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Metadata labels: free-form string pairs set at creation.
pub type Labels = BTreeMap<String, String>;

/// Where a sandbox is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum SandboxState {
    /// Admitted; its VM is being booted (or forked).
    Creating,
    Running,
    /// vCPUs stopped in place.
    Paused,
    /// Its VM is gone; the record stays for a while so that `info` can say
    /// why.
    Dead,
}

impl SandboxState {
    pub fn is_live(self) -> bool {
        self != Self::Dead
    }
}

/// What happens when a sandbox's time-to-live runs out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ExpiryAction {
    #[default]
    Kill,
    Pause,
}

/// Why a sandbox died.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum DeathCause {
    /// A client asked (kill, kill by label).
    Killed,
    /// Its time-to-live ran out with action `kill`.
    Expired,
    /// The VM ended on its own or could not be reached: infrastructure.
    VmLost { reason: String },
    /// The guest ended its VM itself (powered off, rebooted, its kernel
    /// panicked): the guest's doing, not the infrastructure's.
    GuestEnded { reason: String },
    /// The daemon shut down.
    DaemonStopped,
}

impl DeathCause {
    /// The death of a VM that ended by itself as `end` says.
    pub fn ended(end: forkbox_host::vm::VmEnd) -> Self {
        if end.by_guest {
            Self::GuestEnded { reason: end.how }
        } else {
            Self::VmLost { reason: end.how }
        }
    }
}

/// Bounds that protect the host.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Sandboxes creating, running or paused, at most.
    pub max_live: usize,
    /// Sandboxes being created at once, at most (each a fork of a
    /// template's zygote plus its after-fork hook).
    pub max_creating: usize,
    /// Dead records kept for `info`; the oldest go first.
    pub keep_dead: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_live: 64,
            max_creating: 16,
            keep_dead: 1024,
        }
    }
}

/// What a creation asks for, as far as the registry cares.
#[derive(Debug, Clone, Default)]
pub struct Admission {
    pub template: String,
    pub labels: Labels,
    /// `None`: lives until killed.
    pub ttl: Option<Duration>,
    pub on_expiry: ExpiryAction,
    /// The sandbox this one is forked from. The children of one fork
    /// request are one operation on one VMM: they count against the live
    /// cap only, not against the cap on creations at once.
    pub parent: Option<SandboxId>,
}

/// One sandbox as the registry knows it.
#[derive(Debug, Clone)]
pub struct Record {
    pub id: SandboxId,
    pub template: String,
    pub state: SandboxState,
    pub labels: Labels,
    pub ttl: Option<Duration>,
    pub on_expiry: ExpiryAction,
    /// When the time-to-live runs out; counted from the end of creation
    /// (or from the last `set_timeout`). `None` while creating, while
    /// paused by expiry, or without a TTL.
    pub deadline: Option<Instant>,
    pub parent: Option<SandboxId>,
    pub children: Vec<SandboxId>,
    pub admitted: Instant,
    pub created_unix: u64,
    pub ready: Option<Instant>,
    pub died: Option<(Instant, DeathCause)>,
}

/// Why the registry refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CoreError {
    #[error("no sandbox {0}")]
    NotFound(SandboxId),
    #[error("{live} sandboxes are live, the cap is {cap}")]
    TooManyLive { live: usize, cap: usize },
    #[error("{creating} sandboxes are being created, the cap is {cap}")]
    TooManyCreating { creating: usize, cap: usize },
    #[error(
        "host memory: {available_mib} MiB available, forkboxd keeps {reserve_mib} MiB free \
         (--memory-reserve-mib), and one more sandbox of template {template:?} is predicted to \
         take {each_mib} MiB ({basis})"
    )]
    HostMemory {
        available_mib: u64,
        reserve_mib: u64,
        each_mib: u64,
        template: String,
        /// How the prediction was made.
        basis: String,
    },
    #[error("sandbox {id} is {state:?}; {wanted} needs it {needs}")]
    WrongState {
        id: SandboxId,
        state: SandboxState,
        wanted: &'static str,
        needs: &'static str,
    },
}

impl CoreError {
    /// Capacity refusals may succeed if retried later.
    pub fn is_capacity(&self) -> bool {
        matches!(
            self,
            Self::TooManyLive { .. } | Self::TooManyCreating { .. } | Self::HostMemory { .. }
        )
    }
}

/// What one more sandbox of a template is predicted to take of the host's
/// memory: the mean of what is charged to its live sandboxes now (their
/// cgroups' `memory.current`: each one's own writes and VMM; the pages
/// they share with the template's zygote are the zygote's), at least
/// [`PREDICTED_FLOOR`]. `charged`: bytes charged to each live sandbox of
/// the template. Returns the bytes and how they were found.
pub fn predicted_memory(charged: &[u64]) -> (u64, String) {
    if charged.is_empty() {
        return (
            PREDICTED_FLOOR,
            format!(
                "none live yet: {} MiB, a fresh fork's",
                PREDICTED_FLOOR >> 20
            ),
        );
    }
    let mean = charged.iter().sum::<u64>() / charged.len() as u64;
    let each = mean.max(PREDICTED_FLOOR);
    (
        each,
        format!(
            "the mean of its {} live sandboxes, at least {} MiB",
            charged.len(),
            PREDICTED_FLOOR >> 20
        ),
    )
}

/// The least a new sandbox is predicted to take: a fresh fork's own
/// memory and its first command's writes (3-4 MiB measured, docs/SPEC.md)
/// with room to spare.
pub const PREDICTED_FLOOR: u64 = 8 << 20;

/// How many of `wanted` sandboxes of `each` bytes fit in `available` bytes
/// of host memory while `reserve` stays free.
pub fn fitting(available: u64, reserve: u64, each: u64, wanted: usize) -> usize {
    let room = available.saturating_sub(reserve);
    let fit = room.checked_div(each).unwrap_or(u64::MAX);
    usize::try_from(fit).unwrap_or(usize::MAX).min(wanted)
}

/// Every sandbox, live or recently dead.
#[derive(Debug)]
pub struct Registry {
    limits: Limits,
    records: BTreeMap<SandboxId, Record>,
    creating: usize,
    serial: u64,
    /// Mixed into ids so that two daemon runs hand out different ones.
    salt: u32,
}

impl Registry {
    pub fn new(limits: Limits, salt: u32) -> Self {
        Self {
            limits,
            records: BTreeMap::new(),
            creating: 0,
            serial: 0,
            salt,
        }
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    pub fn live(&self) -> usize {
        self.records.values().filter(|r| r.state.is_live()).count()
    }

    pub fn creating(&self) -> usize {
        self.creating
    }

    /// Admits a creation if both caps allow it: the record starts
    /// `Creating`. Capacity refusals are [`CoreError::is_capacity`].
    pub fn admit(
        &mut self,
        adm: Admission,
        now: Instant,
        wall: SystemTime,
    ) -> Result<SandboxId, CoreError> {
        let live = self.live();
        if live >= self.limits.max_live {
            return Err(CoreError::TooManyLive {
                live,
                cap: self.limits.max_live,
            });
        }
        if adm.parent.is_none() && self.creating >= self.limits.max_creating {
            return Err(CoreError::TooManyCreating {
                creating: self.creating,
                cap: self.limits.max_creating,
            });
        }
        if let Some(parent) = &adm.parent {
            let p = self.get(parent)?;
            if !matches!(p.state, SandboxState::Running | SandboxState::Paused) {
                return Err(CoreError::WrongState {
                    id: parent.clone(),
                    state: p.state,
                    wanted: "fork",
                    needs: "running or paused",
                });
            }
        }
        // Never one in use (sandboxes re-adopted from an earlier run carry
        // that run's salt).
        let id = loop {
            self.serial += 1;
            let id = SandboxId(format!("sb-{:08x}{:08x}", self.serial, self.salt));
            if !self.records.contains_key(&id) {
                break id;
            }
        };
        if let Some(parent) = &adm.parent {
            if let Some(p) = self.records.get_mut(parent) {
                p.children.push(id.clone());
            }
        }
        self.creating += 1;
        self.records.insert(
            id.clone(),
            Record {
                id: id.clone(),
                template: adm.template,
                state: SandboxState::Creating,
                labels: adm.labels,
                ttl: adm.ttl,
                on_expiry: adm.on_expiry,
                deadline: None,
                parent: adm.parent,
                children: Vec::new(),
                admitted: now,
                created_unix: wall
                    .duration_since(UNIX_EPOCH)
                    .map(|d| d.as_secs())
                    .unwrap_or(0),
                ready: None,
                died: None,
            },
        );
        Ok(id)
    }

    /// Takes back a sandbox a previous daemon run had (its VM re-adopted),
    /// as it was: running or paused, with its deadline. It counts against
    /// the live cap but is never refused: it exists already.
    pub fn restore(&mut self, r: Record) {
        if let Some(parent) = r.parent.as_ref().and_then(|p| self.records.get_mut(p)) {
            if !parent.children.contains(&r.id) {
                parent.children.push(r.id.clone());
            }
        }
        self.records.insert(r.id.clone(), r);
    }

    /// The VM is up: `Creating` → `Running`, and the TTL starts.
    pub fn created(&mut self, id: &SandboxId, now: Instant) -> Result<(), CoreError> {
        let r = self.get_mut(id)?;
        if r.state != SandboxState::Creating {
            return Err(wrong(r, "finish creating", "creating"));
        }
        r.state = SandboxState::Running;
        r.ready = Some(now);
        r.deadline = r.ttl.and_then(|t| now.checked_add(t));
        self.creating -= 1;
        Ok(())
    }

    /// The VM never came up: the record dies with the cause.
    pub fn creation_failed(
        &mut self,
        id: &SandboxId,
        now: Instant,
        reason: String,
    ) -> Result<(), CoreError> {
        let r = self.get_mut(id)?;
        if r.state != SandboxState::Creating {
            return Err(wrong(r, "fail creating", "creating"));
        }
        self.creating -= 1;
        self.bury(id, now, DeathCause::VmLost { reason });
        Ok(())
    }

    /// `Running` → `Paused`. An expiry pause clears the deadline.
    pub fn paused(&mut self, id: &SandboxId) -> Result<(), CoreError> {
        let r = self.get_mut(id)?;
        if r.state != SandboxState::Running {
            return Err(wrong(r, "pause", "running"));
        }
        r.state = SandboxState::Paused;
        Ok(())
    }

    /// `Paused` → `Running`; an expired TTL starts over.
    pub fn resumed(&mut self, id: &SandboxId, now: Instant) -> Result<(), CoreError> {
        let r = self.get_mut(id)?;
        if r.state != SandboxState::Paused {
            return Err(wrong(r, "resume", "paused"));
        }
        r.state = SandboxState::Running;
        if r.deadline.is_none() {
            r.deadline = r.ttl.and_then(|t| now.checked_add(t));
        }
        Ok(())
    }

    /// Checks that `id` may run commands (and touch files): it must be
    /// running.
    pub fn check_usable(&self, id: &SandboxId) -> Result<&Record, CoreError> {
        let r = self.get(id)?;
        if r.state != SandboxState::Running {
            return Err(wrong(r, "use", "running"));
        }
        Ok(r)
    }

    /// Marks a live sandbox dead. Killing a dead one is an error the caller
    /// may ignore (kill is idempotent at the API).
    pub fn kill(
        &mut self,
        id: &SandboxId,
        now: Instant,
        cause: DeathCause,
    ) -> Result<(), CoreError> {
        let r = self.get_mut(id)?;
        match r.state {
            SandboxState::Dead => Err(wrong(r, "kill", "live")),
            SandboxState::Creating => {
                // The creator sees the record dead when its boot returns
                // and throws the VM away.
                self.creating -= 1;
                self.bury(id, now, cause);
                Ok(())
            }
            SandboxState::Running | SandboxState::Paused => {
                self.bury(id, now, cause);
                Ok(())
            }
        }
    }

    /// A new time-to-live from `now` (`None`: no limit), and what to do
    /// when it runs out.
    pub fn set_timeout(
        &mut self,
        id: &SandboxId,
        ttl: Option<Duration>,
        on_expiry: Option<ExpiryAction>,
        now: Instant,
    ) -> Result<(), CoreError> {
        let r = self.get_mut(id)?;
        if !r.state.is_live() {
            return Err(wrong(r, "set a timeout", "live"));
        }
        r.ttl = ttl;
        if let Some(a) = on_expiry {
            r.on_expiry = a;
        }
        if r.state != SandboxState::Creating {
            r.deadline = ttl.and_then(|t| now.checked_add(t));
        }
        Ok(())
    }

    /// Sandboxes whose deadline has passed, with their action. A paused
    /// sandbox can still expire into `Kill`; `Pause` applies only to running
    /// ones. The caller acts, then reports with [`kill`](Self::kill) or
    /// [`paused`](Self::paused) and [`expiry_paused`](Self::expiry_paused).
    pub fn expired(&self, now: Instant) -> Vec<(SandboxId, ExpiryAction)> {
        self.records
            .values()
            .filter(|r| r.deadline.is_some_and(|d| d <= now))
            .filter_map(|r| match (r.state, r.on_expiry) {
                (SandboxState::Running, a) => Some((r.id.clone(), a)),
                (SandboxState::Paused, ExpiryAction::Kill) => {
                    Some((r.id.clone(), ExpiryAction::Kill))
                }
                _ => None,
            })
            .collect()
    }

    /// After an expiry pause: no deadline until resumed or a new timeout.
    pub fn expiry_paused(&mut self, id: &SandboxId) -> Result<(), CoreError> {
        self.get_mut(id)?.deadline = None;
        Ok(())
    }

    /// The earliest pending deadline, for the reaper's sleep.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.records
            .values()
            .filter(|r| r.state.is_live())
            .filter_map(|r| r.deadline)
            .min()
    }

    pub fn get(&self, id: &SandboxId) -> Result<&Record, CoreError> {
        self.records
            .get(id)
            .ok_or_else(|| CoreError::NotFound(id.clone()))
    }

    fn get_mut(&mut self, id: &SandboxId) -> Result<&mut Record, CoreError> {
        self.records
            .get_mut(id)
            .ok_or_else(|| CoreError::NotFound(id.clone()))
    }

    /// Live sandboxes carrying every label of `filter` (and dead ones too
    /// with `include_dead`), in id order.
    pub fn select(&self, filter: &Labels, include_dead: bool) -> Vec<&Record> {
        self.records
            .values()
            .filter(|r| include_dead || r.state.is_live())
            .filter(|r| filter.iter().all(|(k, v)| r.labels.get(k) == Some(v)))
            .collect()
    }

    fn bury(&mut self, id: &SandboxId, now: Instant, cause: DeathCause) {
        if let Some(r) = self.records.get_mut(id) {
            r.state = SandboxState::Dead;
            r.deadline = None;
            r.died = Some((now, cause));
        }
        let dead: Vec<(Instant, SandboxId)> = self
            .records
            .values()
            .filter_map(|r| r.died.as_ref().map(|(t, _)| (*t, r.id.clone())))
            .collect();
        if dead.len() > self.limits.keep_dead {
            let mut dead = dead;
            dead.sort();
            for (_, old) in dead.iter().take(dead.len() - self.limits.keep_dead) {
                self.records.remove(old);
            }
        }
    }
}

fn wrong(r: &Record, wanted: &'static str, needs: &'static str) -> CoreError {
    CoreError::WrongState {
        id: r.id.clone(),
        state: r.state,
        wanted,
        needs,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_memory_admits_what_fits_above_the_reserve() {
        const MIB: u64 = 1 << 20;
        assert_eq!(fitting(1000 * MIB, 200 * MIB, 100 * MIB, 16), 8);
        assert_eq!(fitting(1000 * MIB, 200 * MIB, 100 * MIB, 3), 3);
        assert_eq!(fitting(150 * MIB, 200 * MIB, 100 * MIB, 1), 0);
        assert_eq!(fitting(1000 * MIB, 0, 0, 5), 5);
        // Nothing live: the floor; else the mean, never under the floor.
        assert_eq!(predicted_memory(&[]).0, PREDICTED_FLOOR);
        let (each, basis) = predicted_memory(&[100 * MIB, 300 * MIB]);
        assert_eq!(each, 200 * MIB);
        assert!(basis.contains("mean of its 2 live"), "{basis}");
        assert_eq!(predicted_memory(&[MIB]).0, PREDICTED_FLOOR);
        let e = CoreError::HostMemory {
            available_mib: 900,
            reserve_mib: 1024,
            each_mib: 8,
            template: "py".into(),
            basis: "none live yet".into(),
        };
        assert!(e.is_capacity());
        assert!(e.to_string().contains("--memory-reserve-mib"), "{e}");
    }

    fn registry(max_live: usize, max_creating: usize) -> Registry {
        Registry::new(
            Limits {
                max_live,
                max_creating,
                keep_dead: 2,
            },
            7,
        )
    }

    #[test]
    fn restored_sandboxes_count_as_live_and_their_ids_are_never_handed_out() {
        let mut reg = registry(2, 2);
        let now = Instant::now();
        let first = admit(&mut reg, now).expect("admit");
        reg.created(&first, now).expect("created");
        let mut old = reg.get(&first).expect("record").clone();
        // A fresh registry with the same salt, as after a restart.
        let mut reg = registry(2, 2);
        old.children.clear();
        reg.restore(old);
        assert_eq!(reg.live(), 1);
        let next = admit(&mut reg, now).expect("admit");
        assert_ne!(next, first);
        assert!(matches!(
            admit(&mut reg, now),
            Err(CoreError::TooManyLive { .. })
        ));
    }

    fn admit(reg: &mut Registry, now: Instant) -> Result<SandboxId, CoreError> {
        reg.admit(Admission::default(), now, SystemTime::now())
    }

    fn labels(pairs: &[(&str, &str)]) -> Labels {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn admit_then_created_is_running() {
        let mut reg = registry(4, 4);
        let now = Instant::now();
        let id = admit(&mut reg, now).expect("admit");
        assert_eq!(reg.get(&id).expect("get").state, SandboxState::Creating);
        assert_eq!(reg.creating(), 1);
        reg.created(&id, now).expect("created");
        assert_eq!(reg.get(&id).expect("get").state, SandboxState::Running);
        assert_eq!(reg.creating(), 0);
        assert_eq!(reg.live(), 1);
    }

    #[test]
    fn admit_beyond_live_cap_is_refused_until_a_kill() {
        let mut reg = registry(2, 4);
        let now = Instant::now();
        let a = admit(&mut reg, now).expect("a");
        reg.created(&a, now).expect("a up");
        let b = admit(&mut reg, now).expect("b");
        let err = admit(&mut reg, now).expect_err("cap");
        assert_eq!(err, CoreError::TooManyLive { live: 2, cap: 2 });
        assert!(err.is_capacity());
        reg.kill(&b, now, DeathCause::Killed).expect("kill b");
        admit(&mut reg, now).expect("room again");
    }

    #[test]
    fn admit_beyond_creating_cap_is_refused_until_one_finishes() {
        let mut reg = registry(10, 1);
        let now = Instant::now();
        let a = admit(&mut reg, now).expect("a");
        assert!(matches!(
            admit(&mut reg, now),
            Err(CoreError::TooManyCreating {
                creating: 1,
                cap: 1
            })
        ));
        reg.creation_failed(&a, now, "boom".into()).expect("fail");
        assert_eq!(reg.live(), 0);
        let b = admit(&mut reg, now).expect("b");
        assert_ne!(a, b, "ids are never reused");
    }

    #[test]
    fn creation_failed_records_the_reason() {
        let mut reg = registry(4, 4);
        let now = Instant::now();
        let id = admit(&mut reg, now).expect("admit");
        reg.creation_failed(&id, now, "no kernel".into())
            .expect("fail");
        let r = reg.get(&id).expect("kept");
        assert_eq!(r.state, SandboxState::Dead);
        assert_eq!(
            r.died.as_ref().map(|(_, c)| c.clone()),
            Some(DeathCause::VmLost {
                reason: "no kernel".into()
            })
        );
    }

    #[test]
    fn kill_while_creating_frees_the_creation_slot() {
        let mut reg = registry(4, 1);
        let now = Instant::now();
        let id = admit(&mut reg, now).expect("admit");
        reg.kill(&id, now, DeathCause::Killed).expect("kill");
        assert_eq!(reg.creating(), 0);
        assert!(matches!(
            reg.created(&id, now),
            Err(CoreError::WrongState { .. })
        ));
    }

    #[test]
    fn kill_dead_sandbox_is_wrong_state() {
        let mut reg = registry(4, 4);
        let now = Instant::now();
        let id = admit(&mut reg, now).expect("admit");
        reg.created(&id, now).expect("up");
        reg.kill(&id, now, DeathCause::Killed).expect("kill");
        assert!(matches!(
            reg.kill(&id, now, DeathCause::Killed),
            Err(CoreError::WrongState { .. })
        ));
    }

    #[test]
    fn ttl_starts_when_created_and_expires_with_its_action() {
        let mut reg = registry(4, 4);
        let t0 = Instant::now();
        let id = reg
            .admit(
                Admission {
                    ttl: Some(Duration::from_secs(10)),
                    ..Admission::default()
                },
                t0,
                SystemTime::now(),
            )
            .expect("admit");
        assert!(
            reg.expired(t0 + Duration::from_secs(100)).is_empty(),
            "creating never expires"
        );
        let t1 = t0 + Duration::from_secs(5);
        reg.created(&id, t1).expect("up");
        assert!(reg.expired(t1 + Duration::from_secs(9)).is_empty());
        assert_eq!(
            reg.expired(t1 + Duration::from_secs(10)),
            vec![(id.clone(), ExpiryAction::Kill)]
        );
        assert_eq!(reg.next_deadline(), Some(t1 + Duration::from_secs(10)));
    }

    #[test]
    fn set_timeout_moves_the_deadline_and_action() {
        let mut reg = registry(4, 4);
        let t0 = Instant::now();
        let id = admit(&mut reg, t0).expect("admit");
        reg.created(&id, t0).expect("up");
        assert!(
            reg.expired(t0 + Duration::from_secs(1_000_000)).is_empty(),
            "no TTL, no expiry"
        );
        let t1 = t0 + Duration::from_secs(60);
        reg.set_timeout(
            &id,
            Some(Duration::from_secs(30)),
            Some(ExpiryAction::Pause),
            t1,
        )
        .expect("set");
        assert!(reg.expired(t1 + Duration::from_secs(29)).is_empty());
        assert_eq!(
            reg.expired(t1 + Duration::from_secs(30)),
            vec![(id.clone(), ExpiryAction::Pause)]
        );
        reg.set_timeout(&id, None, None, t1).expect("clear");
        assert_eq!(reg.next_deadline(), None);
    }

    #[test]
    fn expiry_pause_clears_deadline_and_resume_restarts_it() {
        let mut reg = registry(4, 4);
        let t0 = Instant::now();
        let id = reg
            .admit(
                Admission {
                    ttl: Some(Duration::from_secs(10)),
                    on_expiry: ExpiryAction::Pause,
                    ..Admission::default()
                },
                t0,
                SystemTime::now(),
            )
            .expect("admit");
        reg.created(&id, t0).expect("up");
        let t1 = t0 + Duration::from_secs(10);
        assert_eq!(reg.expired(t1), vec![(id.clone(), ExpiryAction::Pause)]);
        reg.paused(&id).expect("pause");
        reg.expiry_paused(&id).expect("clear");
        assert!(reg.expired(t1 + Duration::from_secs(1000)).is_empty());
        let t2 = t1 + Duration::from_secs(1000);
        reg.resumed(&id, t2).expect("resume");
        assert_eq!(reg.next_deadline(), Some(t2 + Duration::from_secs(10)));
    }

    #[test]
    fn paused_sandbox_with_kill_action_still_expires() {
        let mut reg = registry(4, 4);
        let t0 = Instant::now();
        let id = reg
            .admit(
                Admission {
                    ttl: Some(Duration::from_secs(1)),
                    ..Admission::default()
                },
                t0,
                SystemTime::now(),
            )
            .expect("admit");
        reg.created(&id, t0).expect("up");
        reg.paused(&id).expect("pause");
        assert_eq!(
            reg.expired(t0 + Duration::from_secs(1)),
            vec![(id, ExpiryAction::Kill)]
        );
    }

    #[test]
    fn pause_and_resume_need_the_right_state() {
        let mut reg = registry(4, 4);
        let now = Instant::now();
        let id = admit(&mut reg, now).expect("admit");
        assert!(matches!(reg.paused(&id), Err(CoreError::WrongState { .. })));
        reg.created(&id, now).expect("up");
        assert!(matches!(
            reg.resumed(&id, now),
            Err(CoreError::WrongState { .. })
        ));
        reg.paused(&id).expect("pause");
        assert!(matches!(
            reg.check_usable(&id),
            Err(CoreError::WrongState { .. })
        ));
        reg.resumed(&id, now).expect("resume");
        reg.check_usable(&id).expect("usable");
    }

    #[test]
    fn select_matches_every_label_and_skips_dead() {
        let mut reg = registry(8, 8);
        let now = Instant::now();
        let mut mk = |l: Labels| {
            let id = reg
                .admit(
                    Admission {
                        labels: l,
                        ..Admission::default()
                    },
                    now,
                    SystemTime::now(),
                )
                .expect("admit");
            reg.created(&id, now).expect("up");
            id
        };
        let a = mk(labels(&[("run", "1"), ("task", "x")]));
        let b = mk(labels(&[("run", "1"), ("task", "y")]));
        let _c = mk(labels(&[("run", "2")]));
        let ids = |v: Vec<&Record>| v.into_iter().map(|r| r.id.clone()).collect::<Vec<_>>();
        assert_eq!(
            ids(reg.select(&labels(&[("run", "1")]), false)),
            vec![a.clone(), b.clone()]
        );
        assert_eq!(
            ids(reg.select(&labels(&[("run", "1"), ("task", "y")]), false)),
            vec![b.clone()]
        );
        assert_eq!(reg.select(&Labels::new(), false).len(), 3);
        reg.kill(&a, now, DeathCause::Killed).expect("kill");
        assert_eq!(ids(reg.select(&labels(&[("run", "1")]), false)), vec![b]);
        assert_eq!(reg.select(&labels(&[("run", "1")]), true).len(), 2);
    }

    #[test]
    fn fork_admission_records_lineage_and_needs_live_parent() {
        let mut reg = registry(8, 8);
        let now = Instant::now();
        let parent = admit(&mut reg, now).expect("parent");
        let early = reg.admit(
            Admission {
                parent: Some(parent.clone()),
                ..Admission::default()
            },
            now,
            SystemTime::now(),
        );
        assert!(
            matches!(early, Err(CoreError::WrongState { .. })),
            "creating parent"
        );
        reg.created(&parent, now).expect("up");
        let child = reg
            .admit(
                Admission {
                    parent: Some(parent.clone()),
                    ..Admission::default()
                },
                now,
                SystemTime::now(),
            )
            .expect("child");
        assert_eq!(reg.get(&child).expect("child").parent, Some(parent.clone()));
        assert_eq!(reg.get(&parent).expect("parent").children, vec![child]);
    }

    #[test]
    fn dead_records_beyond_keep_dead_are_forgotten_oldest_first() {
        let mut reg = registry(8, 8);
        let t0 = Instant::now();
        let ids: Vec<SandboxId> = (0..3)
            .map(|i| {
                let id = admit(&mut reg, t0).expect("admit");
                reg.created(&id, t0).expect("up");
                reg.kill(&id, t0 + Duration::from_secs(i), DeathCause::Killed)
                    .expect("kill");
                id
            })
            .collect();
        assert!(matches!(reg.get(&ids[0]), Err(CoreError::NotFound(_))));
        reg.get(&ids[1]).expect("kept");
        reg.get(&ids[2]).expect("kept");
    }

    #[test]
    fn sandbox_id_parse_accepts_only_registry_ids() {
        let mut reg = registry(1, 1);
        let id = admit(&mut reg, Instant::now()).expect("admit");
        assert_eq!(SandboxId::parse(id.as_str()), Some(id));
        assert_eq!(SandboxId::parse("sb-xyz"), None);
        assert_eq!(SandboxId::parse("../etc"), None);
    }
}

#[cfg(test)]
mod overflow_tests {
    use std::time::{Duration, Instant, SystemTime};

    use super::*;

    /// A TTL past what an `Instant` holds means no deadline, never a
    /// panic with the creation half counted.
    #[test]
    fn created_with_an_overflowing_ttl_has_no_deadline_and_frees_its_slot() {
        let mut reg = Registry::new(Limits::default(), 1);
        let t0 = Instant::now();
        let id = reg
            .admit(
                Admission {
                    template: "minimal".into(),
                    labels: Labels::new(),
                    ttl: Some(Duration::MAX),
                    on_expiry: ExpiryAction::Kill,
                    parent: None,
                },
                t0,
                SystemTime::now(),
            )
            .expect("admitted");
        assert_eq!(reg.creating(), 1);
        reg.created(&id, t0).expect("created");
        assert_eq!(reg.creating(), 0);
        assert_eq!(reg.get(&id).expect("record").deadline, None);
        reg.set_timeout(&id, Some(Duration::from_secs(u64::MAX)), None, t0)
            .expect("set");
        assert_eq!(reg.next_deadline(), None);
    }
}
