//! The VMMs' own counters in `/metrics`: at a scrape, every live
//! sandbox's VMM is asked (in parallel, on the blocking pool) and the
//! answers are summed. A VMM that has not answered within the scrape's
//! bound is left out and counted, so a hung VMM cannot hold the scrape;
//! one still busy with an earlier scrape's question is not asked again,
//! so hung VMMs cannot pile up blocked threads either.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::backend::BackendVm;
use crate::core::SandboxId;
use crate::metrics::VmmTotals;

use super::{chain, Daemon};

/// Longest a scrape waits for the VMMs' counters.
pub const VMM_COUNTERS_WAIT: Duration = Duration::from_millis(500);

/// The sandboxes whose VMM has a question out.
#[derive(Debug, Default)]
pub(super) struct Asking(Mutex<HashSet<SandboxId>>);

impl Asking {
    fn lock(&self) -> MutexGuard<'_, HashSet<SandboxId>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Daemon {
    /// `/metrics`: asks the VMMs for their counters, waiting at most
    /// [`VMM_COUNTERS_WAIT`], then renders everything.
    pub async fn scrape(&self) -> String {
        self.scrape_within(VMM_COUNTERS_WAIT).await
    }

    /// [`Daemon::scrape`], waiting at most `wait` for the VMMs.
    pub async fn scrape_within(&self, wait: Duration) -> String {
        let totals = self.vmm_totals(wait).await;
        self.inner.metrics.set_vmm(&totals);
        self.metrics_text()
    }

    /// Asks every live sandbox's VMM for its counters and sums them.
    async fn vmm_totals(&self, wait: Duration) -> VmmTotals {
        let machines: Vec<(SandboxId, Arc<dyn BackendVm>)> = self
            .lock()
            .machines
            .iter()
            .map(|(id, live)| (id.clone(), live.machine.clone()))
            .collect();
        let deadline = tokio::time::Instant::now() + wait;
        let mut totals = VmmTotals::default();
        let mut questions = Vec::with_capacity(machines.len());
        for (id, machine) in machines {
            if !self.inner.asking.lock().insert(id.clone()) {
                totals.unanswered += 1;
                continue;
            }
            let this = self.clone();
            let question = tokio::task::spawn_blocking(move || {
                let answer = machine.vmm_counters(wait);
                this.inner.asking.lock().remove(&id);
                (id, answer)
            });
            questions.push(question);
        }
        for question in questions {
            match tokio::time::timeout_at(deadline, question).await {
                Ok(Ok((_, Ok(Some(counters))))) => {
                    totals.counters.add(&counters);
                    totals.reporting += 1;
                }
                // A VMM older than its counters: nothing to add.
                Ok(Ok((_, Ok(None)))) => {}
                Ok(Ok((id, Err(e)))) => {
                    tracing::debug!(%id, error = %chain(&e), "a VMM's counters are left out");
                    totals.unanswered += 1;
                }
                Ok(Err(_)) | Err(_) => totals.unanswered += 1,
            }
        }
        totals
    }
}

#[cfg(test)]
mod tests {
    use forkbox_vmm_api::VmmCounters;

    use super::super::testing::*;

    /// The pid of the fake machine handed out last.
    fn last_pid(fake_world: &crate::backend::fake::World) -> u32 {
        fake_world.handed.load(ORD) as u32 + 1000 - 1
    }

    fn counters(n: u64) -> VmmCounters {
        VmmCounters {
            exits_io: n,
            exits_mmio: 2 * n,
            control_requests: n,
            vsock_connections: n,
            net_rx_frames: n,
            ..VmmCounters::default()
        }
    }

    #[tokio::test]
    async fn vmm_metrics_sum_over_live_sandboxes() {
        let fake = Fake::default();
        *fake.world.vmm_counters.lock().expect("counters") = Some(counters(3));
        let d = daemon(fake, 4);
        created(&d, None).await;
        created(&d, None).await;
        let text = d.scrape().await;
        for line in [
            "forkbox_vmm_exits{kind=\"io\"} 6",
            "forkbox_vmm_exits{kind=\"mmio\"} 12",
            "forkbox_vmm_exits{kind=\"other\"} 0",
            "forkbox_vmm_control_requests 6",
            "forkbox_vmm_vsock_connections 6",
            "forkbox_vmm_net_frames{direction=\"rx\"} 6",
            "forkbox_vmm_reporting 2",
            "forkbox_vmm_unanswered 0",
        ] {
            assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
        }
    }

    #[tokio::test]
    async fn vmm_metrics_of_older_vmms_are_neither_summed_nor_unanswered() {
        let d = daemon(Fake::default(), 4);
        created(&d, None).await;
        let text = d.scrape().await;
        assert!(text.contains("forkbox_vmm_reporting 0\n"), "{text}");
        assert!(text.contains("forkbox_vmm_unanswered 0\n"), "{text}");
    }

    #[tokio::test]
    async fn vmm_metrics_leave_out_and_count_a_failing_vmm() {
        let fake = Fake::default();
        *fake.world.vmm_counters.lock().expect("counters") = Some(counters(1));
        let world = fake.world.clone();
        let d = daemon(fake, 4);
        created(&d, None).await;
        created(&d, None).await;
        let pid = last_pid(&world);
        world.vmm_silent.lock().expect("silent").push(pid);
        let text = d.scrape().await;
        assert!(
            text.contains("forkbox_vmm_exits{kind=\"io\"} 1\n"),
            "{text}"
        );
        assert!(text.contains("forkbox_vmm_reporting 1\n"), "{text}");
        assert!(text.contains("forkbox_vmm_unanswered 1\n"), "{text}");
        assert!(
            text.contains("forkbox_vmm_unanswered_scrapes_total 1\n"),
            "{text}"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn vmm_metrics_do_not_wait_for_a_hung_vmm_nor_ask_it_twice() {
        let fake = Fake::default();
        *fake.world.vmm_counters.lock().expect("counters") = Some(counters(1));
        let world = fake.world.clone();
        let d = daemon(fake, 4);
        created(&d, None).await;
        created(&d, None).await;
        let pid = last_pid(&world);
        world.vmm_hung.lock().expect("hung").push(pid);
        // The scrape ends at its bound, the hung VMM left out.
        let text = d.scrape_within(Duration::from_millis(50)).await;
        assert!(text.contains("forkbox_vmm_reporting 1\n"), "{text}");
        assert!(text.contains("forkbox_vmm_unanswered 1\n"), "{text}");
        // Still hung: the next scrape does not ask it again, and the
        // question still out is the only one.
        let text = d.scrape_within(Duration::from_millis(50)).await;
        assert!(text.contains("forkbox_vmm_unanswered 1\n"), "{text}");
        assert_eq!(d.inner.asking.lock().len(), 1);
        let (over, cond) = &world.vmm_hang_over;
        *over.lock().expect("hang_over") = true;
        cond.notify_all();
    }
}
