//! Waiting for something that happens soon but cannot be waited on
//! directly (a socket that appears, a process that exits, an agent that
//! answers): look, and look again a little later, until a deadline.

use std::ops::ControlFlow;
use std::time::{Duration, Instant};

/// The deadline passed before the wait ended; holds what the last look
/// saw (why it was not ready yet).
#[derive(Debug, thiserror::Error)]
#[error("still not ready at the deadline")]
pub struct TimedOut<W>(pub W);

/// Calls `look` until it breaks with an answer, sleeping `every` between
/// looks; looks at least once. After a look that says "not yet"
/// (`Continue(why)`) with `deadline` passed, gives up with that last
/// `why`. To fail at once (say, the process died), break with an `Err`.
pub fn until<T, W>(
    deadline: Instant,
    every: Duration,
    mut look: impl FnMut() -> ControlFlow<T, W>,
) -> Result<T, TimedOut<W>> {
    loop {
        match look() {
            ControlFlow::Break(answer) => return Ok(answer),
            ControlFlow::Continue(why) if Instant::now() >= deadline => return Err(TimedOut(why)),
            ControlFlow::Continue(_) => std::thread::sleep(every),
        }
    }
}

/// [`until`] for a yes-or-no look: whether `holds` came true by the
/// deadline.
pub fn holds_by(deadline: Instant, every: Duration, mut holds: impl FnMut() -> bool) -> bool {
    until(deadline, every, || {
        if holds() {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    })
    .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn until_ready_on_the_third_look_answers() {
        let mut looks = 0;
        let answer = until(
            Instant::now() + Duration::from_secs(3600),
            Duration::ZERO,
            || {
                looks += 1;
                if looks == 3 {
                    ControlFlow::Break(looks)
                } else {
                    ControlFlow::Continue(())
                }
            },
        );
        assert_eq!(answer.ok(), Some(3));
    }

    #[test]
    fn until_past_deadline_looks_once_and_keeps_the_last_why() {
        let mut looks = 0;
        let answer: Result<(), _> = until(Instant::now(), Duration::ZERO, || {
            looks += 1;
            ControlFlow::Continue("refused")
        });
        assert!(matches!(answer, Err(TimedOut("refused"))));
        assert_eq!(looks, 1);
    }

    #[test]
    fn holds_by_says_whether_the_condition_came_true() {
        let far = Instant::now() + Duration::from_secs(3600);
        let mut looks = 0;
        assert!(holds_by(far, Duration::ZERO, || {
            looks += 1;
            looks == 2
        }));
        assert!(!holds_by(Instant::now(), Duration::ZERO, || false));
    }
}
