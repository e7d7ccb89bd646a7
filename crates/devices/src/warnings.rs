//! Warnings a guest causes, rate-limited per device.
//!
//! A malformed request or a broken descriptor chain is the guest's error,
//! worth one line in the VMM's log, but a guest can make a thousand of them
//! a second for as long as it likes: unbounded, those lines would fill the
//! disk under the VMM's log or the daemon's. [`Warnings`] lets the first
//! [`BURST`] of each [`INTERVAL`] through, counts the rest, and reports
//! that count with the next line it lets through. The clock is a
//! parameter ([`Warnings::admit`]), so tests need no sleeps.

use std::fmt::Display;
use std::time::{Duration, Instant};

/// Lines logged per device in each interval.
pub const BURST: u32 = 5;
/// Length of one interval.
pub const INTERVAL: Duration = Duration::from_secs(10);

/// Whether a warning is logged, and how many were kept quiet before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Log it; `suppressed` warnings were dropped since the last one logged.
    Log { suppressed: u64 },
    /// Count it, log nothing.
    Quiet,
}

/// The rate limiter of one device's guest-caused warnings.
#[derive(Debug, Default)]
pub struct Warnings {
    window_start: Option<Instant>,
    logged: u32,
    suppressed: u64,
    total: u64,
}

impl Warnings {
    /// Decides about one warning at `now`.
    pub fn admit(&mut self, now: Instant) -> Verdict {
        self.total = self.total.saturating_add(1);
        let new_window = match self.window_start {
            None => true,
            Some(start) => now.saturating_duration_since(start) >= INTERVAL,
        };
        if new_window {
            self.window_start = Some(now);
            self.logged = 0;
        }
        if self.logged < BURST {
            self.logged += 1;
            let suppressed = std::mem::take(&mut self.suppressed);
            Verdict::Log { suppressed }
        } else {
            self.suppressed = self.suppressed.saturating_add(1);
            Verdict::Quiet
        }
    }

    /// Every warning seen, logged or not.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Logs `what` at warn level for `device`, if [`Warnings::admit`]
    /// lets it through now.
    pub fn warn(&mut self, device: &str, whose: &str, what: &dyn Display) {
        match self.admit(Instant::now()) {
            Verdict::Log { suppressed: 0 } => {
                tracing::warn!("{device}: {whose} error: {what}");
            }
            Verdict::Log { suppressed } => tracing::warn!(
                "{device}: {whose} error: {what} ({suppressed} more not logged before this one)"
            ),
            Verdict::Quiet => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warnings_burst_then_quiet_then_summary_in_next_interval() {
        let t0 = Instant::now();
        let mut w = Warnings::default();
        for _ in 0..BURST {
            assert_eq!(w.admit(t0), Verdict::Log { suppressed: 0 });
        }
        // A flood within the interval logs nothing more.
        for i in 0..100_000u64 {
            let now = t0 + INTERVAL.mul_f64(i as f64 / 100_001.0);
            assert_eq!(w.admit(now), Verdict::Quiet);
        }
        // The next interval's first line carries the count.
        let t1 = t0 + INTERVAL;
        assert_eq!(
            w.admit(t1),
            Verdict::Log {
                suppressed: 100_000
            }
        );
        assert_eq!(w.admit(t1), Verdict::Log { suppressed: 0 });
        assert_eq!(w.total(), u64::from(BURST) + 100_002);
    }

    #[test]
    fn warnings_logged_lines_are_bounded_by_time_not_by_the_guest() {
        // One warning every millisecond for ten minutes: at most BURST lines
        // per interval get through.
        let t0 = Instant::now();
        let mut w = Warnings::default();
        let mut lines = 0u64;
        for ms in 0..600_000u64 {
            if matches!(w.admit(t0 + Duration::from_millis(ms)), Verdict::Log { .. }) {
                lines += 1;
            }
        }
        let intervals = 600 / INTERVAL.as_secs();
        assert_eq!(lines, intervals * u64::from(BURST));
    }

    #[test]
    fn warnings_clock_going_backwards_does_not_panic() {
        let t0 = Instant::now() + Duration::from_secs(100);
        let mut w = Warnings::default();
        w.admit(t0);
        assert_eq!(
            w.admit(t0 - Duration::from_secs(50)),
            Verdict::Log { suppressed: 0 }
        );
    }
}
