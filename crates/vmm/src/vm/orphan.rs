//! How long a VM has gone without an owner, for `--orphan-grace-secs`.
//!
//! Counted by the VMM's own running loop: each turn credits the time since
//! the last one, at most [`MAX_TURN_CREDIT`]. A stall of the whole machine
//! (a loaded host that ran neither this process nor the owner for a while,
//! an emulated host whose CPU was descheduled) then does not count as time
//! the owner had to come: after it, the owner gets turns to connect again
//! before the VM gives up on it.

use std::time::{Duration, Instant};

/// Most time one turn of the loop credits. The idle loop turns every
/// second, so a running VMM's count keeps up with the clock.
pub const MAX_TURN_CREDIT: Duration = Duration::from_millis(1500);

#[derive(Debug)]
pub struct Unowned {
    counted: Duration,
    last_turn: Instant,
}

impl Unowned {
    pub fn new(now: Instant) -> Self {
        Self {
            counted: Duration::ZERO,
            last_turn: now,
        }
    }

    /// An owner came or went, or a connection that may be one: the count
    /// starts again.
    pub fn restart(&mut self, now: Instant) {
        *self = Self::new(now);
    }

    /// A turn of the loop at `now`; returns how long the VM has gone
    /// unowned, as counted.
    pub fn turn(&mut self, now: Instant) -> Duration {
        let gap = now.saturating_duration_since(self.last_turn);
        self.counted += gap.min(MAX_TURN_CREDIT);
        self.last_turn = now;
        self.counted
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stall_counts_one_turns_credit_and_regular_turns_count_in_full() {
        let t0 = Instant::now();
        let mut u = Unowned::new(t0);
        // The machine stalls for a minute right after the start.
        assert_eq!(u.turn(t0 + Duration::from_secs(60)), MAX_TURN_CREDIT);
        // Then the loop turns every second: the grace runs on from there.
        let mut now = t0 + Duration::from_secs(60);
        for i in 1..=4 {
            now += Duration::from_secs(1);
            assert_eq!(u.turn(now), MAX_TURN_CREDIT + Duration::from_secs(i));
        }
        u.restart(now);
        assert_eq!(
            u.turn(now + Duration::from_millis(300)),
            Duration::from_millis(300)
        );
    }
}
