//! The after-fork hook: what a fork child or a restored VM does before it
//! runs anything else. Sets the clock from the host, reseeds the kernel
//! RNG with host entropy (the guest kernel has no vmgenid driver, so
//! nothing else tells it that it was cloned), and reports the execs the
//! fork cut off.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use forkbox_proto::{
    AfterForkReport, AgentError, ErrorKind, HookStep, MIN_AFTER_FORK_ENTROPY, SEED_FILE,
};

use crate::execs::ExecTable;
use crate::sys;

/// How long to wait for cut-off execs to end (their process groups are
/// killed; the exec threads allow 2 s for pipes held outside the group).
const SETTLE_TIMEOUT: Duration = Duration::from_secs(3);

/// Where this agent runs, which decides whether it may change the
/// system's clock and RNG.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunsOn {
    /// PID 1 of a forkbox guest: the system is ours.
    Guest,
    /// `serve` mode on some host: never touch its clock or RNG.
    Host,
    /// PID 1 of a gVisor sandbox (`container` mode): its kernel reads the
    /// host's clock and draws every random byte from the host's RNG, so
    /// a restored copy has both fresh already.
    Sandbox,
}

/// The seed of the fork that made this guest, if it was seeded: every
/// command's environment has it as `FORKBOX_SEED`.
static SEED: std::sync::Mutex<Option<u64>> = std::sync::Mutex::new(None);

/// This guest's seed (see [`SEED`]).
pub fn seed() -> Option<u64> {
    *SEED.lock().unwrap_or_else(|p| p.into_inner())
}

pub fn after_fork(
    runs_on: RunsOn,
    execs: &ExecTable,
    unix_time_ns: u64,
    entropy: &[u8],
    seed: Option<u64>,
) -> Result<AfterForkReport, AgentError> {
    if entropy.len() < MIN_AFTER_FORK_ENTROPY {
        return Err(AgentError::new(
            ErrorKind::InvalidRequest,
            format!(
                "after-fork entropy is {} bytes; at least {MIN_AFTER_FORK_ENTROPY} are needed",
                entropy.len()
            ),
        ));
    }
    let before = now_ns();
    let clock_offset_ns = (i128::from(before) - i128::from(unix_time_ns))
        .clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64;
    let (clock, rng) = match runs_on {
        RunsOn::Host => {
            let reason = "not PID 1 of a guest: serve mode never changes its host's clock or RNG";
            (
                HookStep::Skipped {
                    reason: reason.into(),
                },
                HookStep::Skipped {
                    reason: reason.into(),
                },
            )
        }
        RunsOn::Sandbox => (
            HookStep::Skipped {
                reason: "gVisor's clock is the host's".into(),
            },
            HookStep::Skipped {
                reason: "gVisor draws every random byte from the host's RNG".into(),
            },
        ),
        RunsOn::Guest => {
            sys::set_realtime(unix_time_ns)
                .map_err(|e| AgentError::new(ErrorKind::Internal, format!("clock_settime: {e}")))?;
            sys::add_entropy_and_reseed(entropy).map_err(|e| {
                AgentError::new(ErrorKind::Internal, format!("reseeding the RNG: {e}"))
            })?;
            (
                HookStep::Done {
                    detail: format!(
                        "CLOCK_REALTIME set to the host's time (was {:+.3} s off)",
                        clock_offset_ns as f64 / 1e9
                    ),
                },
                HookStep::Done {
                    detail: format!(
                        "RNDADDENTROPY {} bits, then RNDRESEEDCRNG",
                        entropy.len() * 8
                    ),
                },
            )
        }
    };
    // A fork of a seeded guest without a seed of its own has none.
    *SEED.lock().unwrap_or_else(|p| p.into_inner()) = seed;
    if runs_on != RunsOn::Host {
        note_seed(seed)
            .map_err(|e| AgentError::new(ErrorKind::Internal, format!("{SEED_FILE}: {e}")))?;
    }
    let settled = execs.settle(SETTLE_TIMEOUT);
    if !settled.interrupted.is_empty() {
        crate::log(&format!(
            "after fork: {} exec(s) interrupted by the fork",
            settled.interrupted.len()
        ));
    }
    Ok(AfterForkReport {
        clock,
        clock_offset_ns,
        rng,
        interrupted: settled.interrupted,
        still_running: settled.still_running,
    })
}

/// Writes the seed to [`SEED_FILE`] (readable by all, written by root),
/// or removes a parent's.
fn note_seed(seed: Option<u64>) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let path = std::path::Path::new(SEED_FILE);
    match seed {
        Some(seed) => {
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir)?;
            }
            std::fs::write(path, format!("{seed}\n"))?;
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o444))
        }
        None => match std::fs::remove_file(path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        },
    }
}

fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}
