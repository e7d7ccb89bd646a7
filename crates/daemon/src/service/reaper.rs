//! The reaper: kills (or pauses) sandboxes whose time ran out, notices
//! VMs that ended by themselves, and deletes egress logs past their TTL.

use std::time::{Duration, Instant};

use super::{blocking, chain, Daemon};
use crate::core::{DeathCause, ExpiryAction, SandboxId};
use forkbox_host::vm::VmEnd;

impl Daemon {
    /// Kills expired sandboxes, notices VMs that ended by themselves and
    /// deletes egress logs past their TTL. The reaper task calls it; tests
    /// call it with their own `now`.
    pub fn tick(&self, now: Instant) {
        let expired = self.lock().registry.expired(now);
        for (id, action) in expired {
            match action {
                ExpiryAction::Kill => {
                    let _ = self.kill(&id, DeathCause::Expired);
                }
                ExpiryAction::Pause => self.expiry_pause(&id),
            }
        }
        let ended: Vec<(SandboxId, VmEnd)> = {
            let s = self.lock();
            s.machines
                .iter()
                .filter_map(|(id, live)| live.machine.exited().map(|end| (id.clone(), end)))
                .collect()
        };
        for (id, end) in ended {
            if end.by_guest {
                tracing::info!(%id, reason = %end.how, "sandbox's guest ended its VM");
            } else {
                tracing::warn!(%id, reason = %end.how, "sandbox VM ended by itself");
            }
            let _ = self.kill(&id, DeathCause::ended(end));
        }
        let removed = self.inner.egress.sweep(now);
        self.inner.metrics.egress_logs_removed.inc_by(removed);
    }

    /// Pauses a sandbox whose time ran out; one that cannot be paused is
    /// killed rather than left running past its time.
    pub(super) fn expiry_pause(&self, id: &SandboxId) {
        let Ok(machine) = self.machine(id) else {
            return;
        };
        match machine.pause() {
            Ok(()) => {
                let mut s = self.lock();
                let _ = s.registry.paused(id);
                let _ = s.registry.expiry_paused(id);
                self.save(&s, id);
                self.inner.metrics.expiries.inc();
            }
            Err(e) => {
                tracing::warn!(%id, error = %chain(&e), "cannot pause an expired sandbox; killing it");
                let _ = self.kill(id, DeathCause::Expired);
            }
        }
    }

    /// Enforces TTLs even when no client comes back.
    pub fn spawn_reaper(&self) -> tokio::task::JoinHandle<()> {
        let this = self.clone();
        tokio::spawn(async move {
            let mut every = tokio::time::interval(Duration::from_millis(200));
            loop {
                every.tick().await;
                let this = this.clone();
                let _ = blocking(move || this.tick(Instant::now())).await;
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::testing::*;

    #[tokio::test]
    async fn tick_kills_expired_sandboxes_and_stops_their_vms() {
        let fake = Fake::default();
        let world = fake.world.clone();
        let d = daemon(fake, 4);
        let a = created(&d, Some(Duration::from_secs(5))).await;
        let b = created(&d, None).await;
        assert_eq!(world.vms().alive, 3, "the zygote and two sandboxes");
        d.tick(Instant::now() + Duration::from_secs(4));
        assert_eq!(d.lock().registry.live(), 2);
        d.tick(Instant::now() + Duration::from_secs(6));
        let info = |id: &SandboxId| match d.execute_sync_info(id) {
            Some(i) => i,
            None => panic!("info"),
        };
        assert_eq!(info(&a.id).state, SandboxState::Dead);
        assert_eq!(info(&a.id).death, Some(DeathCause::Expired));
        assert_eq!(info(&b.id).state, SandboxState::Running);
        // Reaping runs on the blocking pool: it stops the VM, then drops it.
        let vms = world
            .vms_until("the expired sandbox's VM dropped", |v| v.alive == 2)
            .await;
        assert_eq!(vms.kills, 1, "stopped before it was dropped: {vms:?}");
    }

    #[tokio::test]
    async fn expiry_with_pause_pauses_instead_of_killing() {
        let d = daemon(Fake::default(), 4);
        let a = match d
            .execute(Lifecycle::Create(CreateSandbox {
                template: "minimal".into(),
                ttl: Some(Duration::from_secs(5)),
                on_expiry: ExpiryAction::Pause,
                ..CreateSandbox::default()
            }))
            .await
        {
            Ok(Reply::Sandbox(i)) => *i,
            other => panic!("{other:?}"),
        };
        d.tick(Instant::now() + Duration::from_secs(6));
        let i = d.execute_sync_info(&a.id).expect("info");
        assert_eq!(i.state, SandboxState::Paused);
        assert_eq!(i.expires_in_ms, None);
    }

    #[tokio::test]
    async fn tick_marks_a_vm_that_ended_by_itself_lost_and_frees_its_slot() {
        let fake = Fake::default();
        let world = fake.world.clone();
        let d = daemon(fake, 1);
        let a = created(&d, None).await;
        d.tick(Instant::now());
        assert_eq!(
            d.execute_sync_info(&a.id).expect("info").state,
            SandboxState::Running
        );
        world.lose_last("guest reset (triple fault or KVM reset)");
        d.tick(Instant::now());
        let i = d.execute_sync_info(&a.id).expect("remembered");
        assert_eq!(i.state, SandboxState::Dead);
        assert!(
            matches!(i.death, Some(DeathCause::VmLost { ref reason }) if reason.starts_with("guest reset")),
            "{i:?}"
        );
        // Its slot under the live cap of 1 is free again.
        created(&d, None).await;
    }

    #[tokio::test]
    async fn tick_marks_a_vm_its_guest_powered_off_as_the_guests_end() {
        let fake = Fake::default();
        let world = fake.world.clone();
        let d = daemon(fake, 1);
        let a = created(&d, None).await;
        world.guest_ends_last("the guest powered off");
        d.tick(Instant::now());
        let i = d.execute_sync_info(&a.id).expect("remembered");
        assert_eq!(i.state, SandboxState::Dead);
        assert_eq!(
            i.death,
            Some(DeathCause::GuestEnded {
                reason: "the guest powered off".into()
            })
        );
        // Counted as the guest's end, not as a client's kill.
        let text = d.metrics_text();
        assert!(
            text.contains("forkbox_sandbox_deaths_total{cause=\"guest_ended\"} 1"),
            "{text}"
        );
        assert!(text.contains("forkbox_sandbox_kills_total 0"), "{text}");
        created(&d, None).await;
    }
}
