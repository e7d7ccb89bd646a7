//! Sandboxes' networks: reading and replacing a sandbox's egress policy,
//! and reading its egress log (kept past its death until the log TTL).

use forkbox_net::log::EgressRecord;
use forkbox_net::policy::Policy;

use super::view::network_info;
use super::{blocking, Daemon, DaemonError, NetworkInfo};
use crate::backend::BackendError;
use crate::core::SandboxId;

impl Daemon {
    /// The egress policy of a running or paused sandbox.
    pub(super) async fn network(&self, id: &SandboxId) -> Result<NetworkInfo, DaemonError> {
        let (machine, recorded) = {
            let s = self.lock();
            let (_, live) = s.forkable(id, "read its network policy")?;
            (live.machine.clone(), live.policy.clone())
        };
        let in_force = blocking(move || machine.network_policy()).await?;
        Ok(network_info(in_force, &recorded))
    }

    /// Replaces it: new connections and DNS lookups follow the new
    /// policy, open connections stay.
    pub(super) async fn set_network(
        &self,
        id: &SandboxId,
        policy: Policy,
    ) -> Result<NetworkInfo, DaemonError> {
        let machine = {
            let s = self.lock();
            s.forkable(id, "change its network policy")?
                .1
                .machine
                .clone()
        };
        let p = policy.clone();
        let in_force = blocking(move || {
            if machine.network_policy().is_none() {
                return Ok(None);
            }
            machine.set_network_policy(&p)?;
            Ok::<_, BackendError>(machine.network_policy())
        })
        .await??
        .ok_or_else(|| DaemonError::NoNetwork(id.clone()))?;
        let mut s = self.lock();
        // Killed meanwhile: nothing left to record.
        if let Some(live) = s.machines.get_mut(id) {
            live.policy = policy.clone();
        }
        self.save(&s, id);
        Ok(network_info(Some(in_force), &policy))
    }

    /// The last `limit` records of a sandbox's egress log, live or dead
    /// (until its log TTL), oldest first. A known sandbox without a log
    /// file (nothing logged yet, or deleted after the TTL) has an empty
    /// one; an unknown id is `NoSandbox` unless a log of it is left (its
    /// record forgotten, or from an earlier daemon run).
    pub async fn egress(
        &self,
        id: &SandboxId,
        limit: usize,
    ) -> Result<Vec<EgressRecord>, DaemonError> {
        let known = self.lock().registry.get(id).is_ok();
        let this = self.clone();
        let target = id.clone();
        match blocking(move || this.inner.egress.read(&target, limit)).await? {
            Ok(Some(records)) => Ok(records),
            Ok(None) if known => Ok(Vec::new()),
            Ok(None) => Err(DaemonError::NoSandbox(id.clone())),
            Err(e) => Err(DaemonError::infra(
                format!("reading the egress log of {id}"),
                e,
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::testing::*;

    #[tokio::test]
    async fn create_with_a_policy_gives_it_to_the_machine_and_none_denies_all() {
        let d = daemon(Fake::default(), 4);
        let open = created_with(&d, "minimal", Some(policy(&["PyPI.org:443"]))).await;
        let n = network(&d, &open.id).await.expect("network");
        assert!(n.active);
        assert_eq!(n.policy.allow_out, vec!["pypi.org:443".to_owned()]);
        let closed = created(&d, None).await;
        let n = network(&d, &closed.id).await.expect("network");
        assert!(n.active);
        assert_eq!(n.policy, NetworkPolicy::default(), "deny all");
    }

    #[tokio::test]
    async fn set_network_replaces_the_policy_and_forks_inherit_the_current_one() {
        let fake = Fake::default();
        let world = fake.world.clone();
        let d = daemon(fake, 4);
        let a = created(&d, None).await;
        let n = set_network(&d, &a.id, policy(&["*.debian.org"]))
            .await
            .expect("set");
        assert_eq!(n.policy.allow_out, vec!["*.debian.org".to_owned()]);
        assert_eq!(network(&d, &a.id).await.expect("get").policy, n.policy);
        let kids = forked(&d, &a.id, 2).await;
        for k in &kids {
            let k = k.as_ref().expect("child");
            assert_eq!(network(&d, &k.id).await.expect("child").policy, n.policy);
        }
        // Each child logs to its own file, named for it.
        let logs = world.egress_logs.lock().expect("logs").clone();
        let kid_logs: Vec<_> = kids
            .iter()
            .map(|k| Some(d.inner.egress.path(&k.as_ref().expect("child").id)))
            .collect();
        assert_eq!(logs[logs.len() - 2..], kid_logs[..]);
    }

    #[tokio::test]
    async fn network_of_a_dead_or_unknown_sandbox_is_refused() {
        let d = daemon(Fake::default(), 4);
        let a = created(&d, None).await;
        d.execute(Lifecycle::Kill { id: a.id.clone() })
            .await
            .expect("kill");
        let e = network(&d, &a.id).await.expect_err("dead");
        assert_eq!(e.kind(), "conflict");
        let e = set_network(&d, &a.id, Policy::deny_all())
            .await
            .expect_err("dead");
        assert_eq!(e.kind(), "conflict");
        let unknown = SandboxId::parse("sb-00000000deadbeef").expect("id");
        assert_eq!(
            network(&d, &unknown).await.expect_err("?").kind(),
            "not_found"
        );
    }

    #[tokio::test]
    async fn egress_log_outlives_the_sandbox_until_its_ttl() {
        let fake = Fake::default();
        let world = fake.world.clone();
        let d = daemon(fake, 4);
        let a = created(&d, None).await;
        let path = d.inner.egress.path(&a.id);
        assert_eq!(
            world.egress_logs.lock().expect("logs").last(),
            Some(&Some(path.clone())),
            "the VM logs where the daemon said"
        );
        assert!(d.egress(&a.id, 10).await.expect("empty").is_empty());
        crate::network::tests::append(&path, &["a.org", "b.org", "c.org"]);
        let got = d.egress(&a.id, 2).await.expect("records");
        assert_eq!(got.len(), 2);
        assert_eq!(got[1].name.as_deref(), Some("c.org"));
        assert_eq!(got[0].sandbox, a.id.as_str());
        d.execute(Lifecycle::Kill { id: a.id.clone() })
            .await
            .expect("kill");
        d.tick(Instant::now() + Duration::from_secs(3500));
        assert_eq!(d.egress(&a.id, 10).await.expect("kept").len(), 3);
        d.tick(Instant::now() + Duration::from_secs(3601));
        assert!(!path.exists(), "deleted after the TTL");
        assert!(d.egress(&a.id, 10).await.expect("known").is_empty());
        let unknown = SandboxId::parse("sb-00000000deadbeef").expect("id");
        assert_eq!(
            d.egress(&unknown, 10).await.expect_err("?").kind(),
            "not_found"
        );
    }
}
