//! Sandbox networks as the daemon sees them: the egress policy's API
//! spelling, and the egress logs the daemon owns.
//!
//! Every sandbox has a network device, egress denied unless its policy
//! allows. The VMM appends one JSON line per attempt to the log file the
//! daemon gave it (`<egress dir>/<sandbox id>.jsonl`); the file outlives
//! the sandbox until the log TTL, so a trainer can read what a finished
//! rollout tried to reach.

use std::collections::BTreeMap;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use forkbox_net::log::{read_json_lines, EgressRecord, ReadLogError};
use forkbox_net::policy::{Policy, PolicyError, PolicySpec};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::core::SandboxId;

/// An egress policy: rules that allow, and rules that deny (deny wins);
/// whatever no rule allows is denied. A rule is a name
/// (`pypi.example.org`), a suffix (`*.debian.org`: strictly below it), an
/// address or CIDR (`10.1.0.0/16`, `[2001:db8::/32]:443`) or `*`, with an
/// optional port or range (`:443`, `:8000-8999`). The host's loopback is
/// `host.forkbox.internal`, reachable only by an allow rule naming it with
/// one port (`host.forkbox.internal:8000`). A name rule or `*` never opens
/// a private, shared, unique-local or cloud-platform address, nor the
/// host's own: only a CIDR rule inside that range does (docs/SECURITY.md).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"allow_out": ["pypi.org:443", "*.pythonhosted.org:443"], "deny_out": []}))]
pub struct NetworkPolicy {
    #[serde(default)]
    pub allow_out: Vec<String>,
    #[serde(default)]
    pub deny_out: Vec<String>,
}

impl NetworkPolicy {
    /// Checks every rule.
    pub fn parse(self) -> Result<Policy, PolicyError> {
        Policy::try_from(PolicySpec {
            allow_out: self.allow_out,
            deny_out: self.deny_out,
        })
    }

    /// `policy` in normal form.
    pub fn of(policy: &Policy) -> Self {
        let spec = PolicySpec::from(policy.clone());
        Self {
            allow_out: spec.allow_out,
            deny_out: spec.deny_out,
        }
    }
}

/// Why an egress log could not be read.
#[derive(Debug, thiserror::Error)]
pub enum EgressError {
    #[error("reading the egress log {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the egress log {path} is damaged")]
    Damaged {
        path: PathBuf,
        #[source]
        source: ReadLogError,
    },
}

/// The directory of egress logs, one file per sandbox, and when the logs
/// of dead sandboxes go.
#[derive(Debug)]
pub struct EgressLogs {
    dir: PathBuf,
    ttl: Duration,
    /// Logs of dead sandboxes and when they are deleted.
    expiring: Mutex<BTreeMap<SandboxId, Instant>>,
    /// Most bytes the directory may hold; past it, logs of dead
    /// sandboxes go before their TTL, those that died first first.
    max_bytes: Option<u64>,
    /// When the directory's size was last added up.
    measured: Mutex<Option<Instant>>,
    /// A directory of our own (when the daemon keeps no state), removed
    /// with us.
    _temp: Option<tempfile::TempDir>,
}

/// How often [`EgressLogs::sweep`] adds up the directory's size.
pub const MEASURE_EVERY: Duration = Duration::from_secs(5);

impl EgressLogs {
    /// Logs in `dir` (created). Files left there by an earlier run are
    /// deleted once `ttl` has passed since they were last written.
    pub fn open(dir: &Path, ttl: Duration) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        Ok(Self::with_dir(dir.to_owned(), ttl, None))
    }

    /// Logs in a temporary directory of our own, removed when this is
    /// dropped.
    pub fn temporary(ttl: Duration) -> std::io::Result<Self> {
        let temp = tempfile::Builder::new()
            .prefix("forkboxd-egress-")
            .tempdir()?;
        Ok(Self::with_dir(temp.path().to_owned(), ttl, Some(temp)))
    }

    fn with_dir(dir: PathBuf, ttl: Duration, temp: Option<tempfile::TempDir>) -> Self {
        Self {
            dir,
            ttl,
            expiring: Mutex::new(BTreeMap::new()),
            max_bytes: None,
            measured: Mutex::new(None),
            _temp: temp,
        }
    }

    /// Keeps the directory under `max_bytes` (see [`EgressLogs::sweep`]).
    pub fn with_max_bytes(mut self, max_bytes: u64) -> Self {
        self.max_bytes = Some(max_bytes);
        self
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn expiring(&self) -> MutexGuard<'_, BTreeMap<SandboxId, Instant>> {
        self.expiring.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Where sandbox `id`'s VMM writes its log.
    pub fn path(&self, id: &SandboxId) -> PathBuf {
        // Ids are `sb-` and hex digits: never a path of their own.
        self.dir.join(format!("{id}.jsonl"))
    }

    /// Whether there is a log of `id`.
    pub fn exists(&self, id: &SandboxId) -> bool {
        self.path(id).exists()
    }

    /// The last `limit` records of `id`'s log, oldest first, each naming
    /// the sandbox (the VMM does not know its id); `None` without a log.
    /// Blocking.
    pub fn read(
        &self,
        id: &SandboxId,
        limit: usize,
    ) -> Result<Option<Vec<EgressRecord>>, EgressError> {
        let path = self.path(id);
        let file = match std::fs::File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(EgressError::Io { path, source }),
        };
        let mut records = read_json_lines(BufReader::new(file), limit)
            .map_err(|source| EgressError::Damaged { path, source })?;
        for r in &mut records {
            r.sandbox = id.to_string();
        }
        Ok(Some(records))
    }

    /// Sandbox `id` died at `now`: its log goes after the TTL.
    pub fn retire(&self, id: &SandboxId, now: Instant) {
        self.expiring().insert(id.clone(), now + self.ttl);
    }

    /// Deletes the logs whose time is up; then, at most every
    /// [`MEASURE_EVERY`], adds up the directory and, while it holds more
    /// than its most, deletes dead sandboxes' logs, those that died first
    /// first (live sandboxes' logs are bounded by the VMM's cap). Returns
    /// how many logs went for room. Blocking.
    pub fn sweep(&self, now: Instant) -> u64 {
        self.expire(now);
        let Some(max) = self.max_bytes else {
            return 0;
        };
        {
            let mut measured = self.measured.lock().unwrap_or_else(|p| p.into_inner());
            if measured.is_some_and(|at| now.saturating_duration_since(at) < MEASURE_EVERY) {
                return 0;
            }
            *measured = Some(now);
        }
        self.make_room(max)
    }

    /// Deletes dead sandboxes' logs, those that died first first, until
    /// the directory's logs hold at most `max` bytes.
    fn make_room(&self, max: u64) -> u64 {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return 0;
        };
        let mut total: u64 = entries
            .flatten()
            .filter(|e| {
                e.file_name()
                    .to_str()
                    .is_some_and(|n| n.ends_with(".jsonl"))
            })
            .filter_map(|e| e.metadata().ok())
            .map(|m| m.len())
            .sum();
        if total <= max {
            return 0;
        }
        let mut dead: Vec<(Instant, SandboxId)> = self
            .expiring()
            .iter()
            .map(|(id, at)| (*at, id.clone()))
            .collect();
        dead.sort();
        let mut removed = 0;
        for (_, id) in dead {
            if total <= max {
                break;
            }
            let path = self.path(&id);
            let len = std::fs::metadata(&path).map_or(0, |m| m.len());
            match std::fs::remove_file(&path) {
                Ok(()) => {
                    total = total.saturating_sub(len);
                    removed += 1;
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => tracing::warn!(%id, error = %e, "cannot delete an egress log for room"),
            }
            self.expiring().remove(&id);
        }
        if removed > 0 {
            tracing::warn!(
                removed,
                max_bytes = max,
                "egress logs over their total: the oldest dead sandboxes' logs were deleted before their TTL"
            );
        }
        removed
    }

    /// Deletes the logs whose time is up.
    fn expire(&self, now: Instant) {
        let due: Vec<SandboxId> = {
            let mut expiring = self.expiring();
            let due: Vec<SandboxId> = expiring
                .iter()
                .filter(|(_, at)| **at <= now)
                .map(|(id, _)| id.clone())
                .collect();
            for id in &due {
                expiring.remove(id);
            }
            due
        };
        for id in due {
            match std::fs::remove_file(self.path(&id)) {
                Ok(()) => tracing::debug!(%id, "egress log expired"),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => tracing::warn!(%id, error = %e, "cannot delete an expired egress log"),
            }
        }
    }

    /// After a restart: every log in the directory not of a `live`
    /// sandbox is a dead one's, retired as of its last write. Files that
    /// are not logs are left alone.
    pub fn retire_leftovers(&self, live: &dyn Fn(&SandboxId) -> bool, now: Instant) {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        let wall = SystemTime::now();
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(id) = name
                .to_str()
                .and_then(|n| n.strip_suffix(".jsonl"))
                .and_then(SandboxId::parse)
            else {
                continue;
            };
            if live(&id) {
                continue;
            }
            let age = entry
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| wall.duration_since(t).ok())
                .unwrap_or_default();
            let at = now + self.ttl.saturating_sub(age);
            self.expiring().insert(id, at);
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use forkbox_net::log::{JsonLinesWriter, LogReason};
    use forkbox_net::policy::{Protocol, Verdict};

    fn id(n: u32) -> SandboxId {
        SandboxId::parse(&format!("sb-{n:08x}deadbeef")).expect("id")
    }

    pub(crate) fn record(name: &str) -> EgressRecord {
        EgressRecord {
            time_ms: 1_700_000_000_000,
            sandbox: String::new(),
            protocol: Protocol::Dns,
            name: Some(name.into()),
            address: None,
            port: 53,
            verdict: Verdict::Deny,
            reason: LogReason::NoRule,
            rule: None,
            answers: vec![],
            bytes_out: 0,
            bytes_in: 0,
            duration_ms: 0,
            error: None,
        }
    }

    /// Appends records to a log as the VMM does.
    pub(crate) fn append(path: &Path, names: &[&str]) {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .expect("open log");
        let mut w = JsonLinesWriter::new(file);
        for n in names {
            w.write(&record(n)).expect("write record");
        }
    }

    #[test]
    fn network_policy_bad_rule_names_list_and_index() {
        let bad = NetworkPolicy {
            allow_out: vec!["pypi.org".into(), "x:99999".into()],
            deny_out: vec![],
        };
        let e = bad.parse().expect_err("bad port");
        assert!(e.to_string().starts_with("allow_out[1] \"x:99999\""), "{e}");
    }

    #[test]
    fn network_policy_round_trips_in_normal_form() {
        let p = NetworkPolicy {
            allow_out: vec!["PyPI.org:443".into()],
            deny_out: vec!["10.0.0.0/8".into()],
        };
        let back = NetworkPolicy::of(&p.parse().expect("valid"));
        assert_eq!(back.allow_out, vec!["pypi.org:443".to_owned()]);
        assert_eq!(back.deny_out, vec!["10.0.0.0/8".to_owned()]);
    }

    #[test]
    fn egress_read_names_the_sandbox_and_keeps_the_last() {
        let logs = EgressLogs::temporary(Duration::from_secs(60)).expect("logs");
        assert!(logs.read(&id(1), 10).expect("read").is_none());
        append(&logs.path(&id(1)), &["a.org", "b.org", "c.org"]);
        let got = logs.read(&id(1), 2).expect("read").expect("a log");
        let names: Vec<_> = got.iter().filter_map(|r| r.name.as_deref()).collect();
        assert_eq!(names, ["b.org", "c.org"]);
        assert!(got.iter().all(|r| r.sandbox == id(1).as_str()));
    }

    #[test]
    fn egress_sweep_deletes_retired_logs_after_the_ttl_only() {
        let logs = EgressLogs::temporary(Duration::from_secs(60)).expect("logs");
        let t0 = Instant::now();
        append(&logs.path(&id(1)), &["a.org"]);
        append(&logs.path(&id(2)), &["b.org"]);
        logs.retire(&id(1), t0);
        logs.sweep(t0 + Duration::from_secs(59));
        assert!(logs.exists(&id(1)));
        logs.sweep(t0 + Duration::from_secs(60));
        assert!(!logs.exists(&id(1)));
        assert!(logs.exists(&id(2)), "a live sandbox's log stays");
    }

    #[test]
    fn egress_over_the_total_dead_logs_go_first_died_first_live_stay() {
        let logs = EgressLogs::temporary(Duration::from_secs(3600)).expect("logs");
        for n in 1..=4 {
            append(&logs.path(&id(n)), &["n.org"; 4]);
        }
        let one = std::fs::metadata(logs.path(&id(1))).expect("meta").len();
        // Room for two and a half logs.
        let logs = logs.with_max_bytes(one * 5 / 2);
        let t0 = Instant::now();
        // 3 died before 2, 2 before 1; 4 lives on.
        logs.retire(&id(3), t0);
        logs.retire(&id(2), t0 + Duration::from_secs(1));
        logs.retire(&id(1), t0 + Duration::from_secs(2));
        assert_eq!(logs.sweep(t0 + Duration::from_secs(3)), 2);
        let left: Vec<bool> = (1..=4).map(|n| logs.exists(&id(n))).collect();
        assert_eq!(
            left,
            [true, false, false, true],
            "the first to die go first"
        );
        // Measured at most every MEASURE_EVERY.
        append(&logs.path(&id(4)), &["more.org"; 40]);
        assert_eq!(logs.sweep(t0 + Duration::from_secs(4)), 0);
    }

    #[test]
    fn egress_leftovers_of_an_earlier_run_expire_unless_live() {
        let logs = EgressLogs::temporary(Duration::from_secs(60)).expect("logs");
        append(&logs.path(&id(1)), &["a.org"]);
        append(&logs.path(&id(2)), &["b.org"]);
        std::fs::write(logs.dir().join("notes.txt"), b"keep").expect("write");
        let t0 = Instant::now();
        logs.retire_leftovers(&|i| *i == id(2), t0);
        logs.sweep(t0 + Duration::from_secs(61));
        assert!(!logs.exists(&id(1)));
        assert!(logs.exists(&id(2)));
        assert!(logs.dir().join("notes.txt").exists());
    }

    #[test]
    fn egress_temporary_dir_goes_with_the_logs() {
        let logs = EgressLogs::temporary(Duration::from_secs(60)).expect("logs");
        let dir = logs.dir().to_owned();
        append(&logs.path(&id(1)), &["a.org"]);
        drop(logs);
        assert!(!dir.exists());
    }
}
