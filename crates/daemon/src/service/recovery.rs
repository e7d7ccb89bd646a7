//! The daemon's side of `crate::persist`: writes each live sandbox down as
//! it changes, and re-adopts what an earlier run wrote down after a
//! restart.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use forkbox_net::policy::Policy;

use super::{chain, Daemon, Live, Shared, Template, Zygote};
use crate::backend::NetworkSpec;
use crate::core::{SandboxId, SandboxState};
use crate::persist::SavedSandbox;
use forkbox_host::vm::Expected;

impl Daemon {
    /// Writes a live sandbox down (when the daemon keeps state).
    pub(super) fn save(&self, s: &Shared, id: &SandboxId) {
        let Some(store) = &self.inner.store else {
            return;
        };
        let (Ok(r), Some(live)) = (s.registry.get(id), s.machines.get(id)) else {
            return;
        };
        let Some(vm) = live.machine.handle() else {
            return;
        };
        store.save_sandbox(&SavedSandbox {
            id: id.clone(),
            template: r.template.clone(),
            paused: r.state == SandboxState::Paused,
            labels: r.labels.clone(),
            ttl_secs: r.ttl.map(|t| t.as_secs_f64()),
            on_expiry: r.on_expiry,
            deadline_unix_ms: SavedSandbox::deadline_of(r, Instant::now(), SystemTime::now()),
            parent: r.parent.clone(),
            created_unix: r.created_unix,
            envs: live.envs.clone(),
            cwd: live.cwd.clone(),
            user: Some(live.user.clone()),
            spec: live.spec.clone(),
            image_id: live.image_id.clone(),
            vm,
            network: Some(live.policy.clone()),
            baseline: live.baseline.as_deref().cloned(),
        });
    }

    /// Takes back every VM an earlier run of the daemon wrote down: baked
    /// templates' zygotes first, then sandboxes (parents before children).
    /// A VM that cannot be adopted (its VMM died, or its pid is another
    /// process now) is cleared away and forgotten. Blocking; call it before
    /// serving. Returns (adopted, cleared away).
    ///
    /// The network brokers of the earlier run died with it: each VM
    /// re-adopted is served a new one with its recorded policy (a zygote:
    /// deny all) and egress log; its VMM reconnects on the guest's next
    /// connection or lookup. A VM recorded without a policy (state an
    /// older daemon wrote) is adopted without a network: it opens no new
    /// connection, and its `network` says `active: false`. Egress logs of
    /// sandboxes not re-adopted are kept until the log TTL from their
    /// last write.
    pub fn recover(&self) -> (usize, usize) {
        let Some(store) = self.inner.store.clone() else {
            return (0, 0);
        };
        let backend = self.inner.backend.clone();
        let (templates, mut sandboxes) = store.load();
        let (mut adopted, mut cleared) = (0, 0);
        for t in templates {
            // Its image as found at its making (older state: as its name
            // finds it now); pinned in the store while it lives.
            let image = match t.spec.root_image(self.images(), t.image_id.as_ref()) {
                Ok(image) => Arc::new(image),
                Err(e) => {
                    cleared += 1;
                    tracing::warn!(template = %t.spec.name, "cannot find a template's image; clearing its zygote away: {e}");
                    backend.discard(&t.vm);
                    store.forget_template(&t.spec.name);
                    continue;
                }
            };
            let network = t.network.clone().map(|policy| NetworkSpec {
                policy,
                egress_log: None,
            });
            let name = t.spec.name.clone();
            let machine = match backend.adopt(&t.vm, network.as_ref()) {
                Ok(m) => Ok(m),
                Err(e) => {
                    backend.discard(&t.vm);
                    match t.saved_bytes {
                        // Stopped with the daemon, or gone with a reboot:
                        // started again from its snapshot, not baked.
                        Some(_) => {
                            let dir = store.snapshot_dir(&name);
                            let volumes = t.spec.disks.iter().map(|d| backend.volume(d));
                            let restored = volumes
                                .collect::<Result<Vec<_>, _>>()
                                .and_then(|volumes| {
                                    let expect = Expected {
                                        image: image.root.clone(),
                                        vcpus: t.spec.vcpus,
                                        memory_mib: t.spec.memory_mib,
                                        volumes,
                                    };
                                    backend.restore(&dir, network.as_ref(), &expect)
                                })
                                .and_then(|m| {
                                    m.make_zygote()?;
                                    Ok(m)
                                });
                            if restored.is_ok() {
                                tracing::info!(template = %name, "its zygote started again from its snapshot in {}", dir.display());
                            }
                            restored.map_err(|r| {
                                format!(
                                    "cannot re-adopt its zygote ({}) nor start it from its snapshot ({})",
                                    chain(&e),
                                    chain(&r)
                                )
                            })
                        }
                        None => Err(format!("cannot re-adopt its zygote: {}", chain(&e))),
                    }
                }
            };
            let (zygote, saved_bytes) = match machine {
                Ok(m) => {
                    adopted += 1;
                    let zygote = Zygote::Ready {
                        machine: Arc::from(m),
                        bake_ms: t.bake_ms,
                        baseline: t.baseline.map(Arc::new),
                    };
                    (zygote, t.saved_bytes)
                }
                // A saved template whose snapshot does not start (a new
                // forkbox whose state format changed, say) is kept, record
                // and snapshot, to be tried again at the next start; until
                // then it says why, and one with a recipe bakes on demand.
                Err(why) if t.saved_bytes.is_some() => {
                    cleared += 1;
                    tracing::error!(template = %name, "{why}; it stays registered, not baked, and its snapshot is tried again at the next start");
                    (Zygote::None { error: Some(why) }, None)
                }
                Err(why) => {
                    cleared += 1;
                    tracing::warn!(template = %name, "{why}; clearing it away");
                    store.forget_template(&name);
                    continue;
                }
            };
            let t = Template {
                spec: t.spec,
                image,
                from_sandbox: t.from_sandbox,
                drop_on_failure: t.drop_on_failure,
                zygote,
                saved_bytes,
            };
            // A zygote started from its snapshot is a new VM (a template
            // not started has no record to write: its old one stays).
            if let Some(record) = t.record() {
                store.save_template(&record);
            }
            self.lock().templates.insert(name, t);
        }
        sandboxes.sort_by_key(|s| (s.created_unix, s.parent.is_some()));
        for saved in sandboxes {
            let network = saved.network.clone().map(|policy| NetworkSpec {
                policy,
                egress_log: Some(self.inner.egress.path(&saved.id)),
            });
            match backend.adopt(&saved.vm, network.as_ref()) {
                Ok(m) => {
                    adopted += 1;
                    // A daemon that died during a fork request left its
                    // running parent paused (it is paused for the whole
                    // request): it runs again. Resuming a running VM
                    // changes nothing.
                    if !saved.paused {
                        if let Err(e) = m.resume() {
                            tracing::warn!(id = %saved.id, error = %chain(&e), "cannot resume a re-adopted running sandbox");
                        }
                    }
                    let mut s = self.lock();
                    s.registry
                        .restore(saved.record(Instant::now(), SystemTime::now()));
                    s.machines.insert(
                        saved.id.clone(),
                        Live {
                            machine: Arc::from(m),
                            policy: saved.network.unwrap_or_else(Policy::deny_all),
                            envs: saved.envs,
                            cwd: saved.cwd,
                            user: saved.user.unwrap_or_else(crate::template::builtin_user),
                            spec: saved.spec,
                            image_id: saved.image_id,
                            ports: BTreeMap::new(),
                            baseline: saved.baseline.map(Arc::new),
                        },
                    );
                }
                Err(e) => {
                    cleared += 1;
                    tracing::warn!(id = %saved.id, error = %chain(&e), "cannot re-adopt a sandbox's VM; clearing it away");
                    backend.discard(&saved.vm);
                    store.forget_sandbox(&saved.id);
                }
            }
        }
        let s = self.lock();
        self.inner
            .egress
            .retire_leftovers(&|id| s.machines.contains_key(id), Instant::now());
        (adopted, cleared)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::testing::*;

    #[tokio::test]
    async fn a_restarted_daemon_re_adopts_what_it_wrote_down_and_clears_the_rest() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = || Some(Store::open(dir.path()).expect("store"));
        let egress = || {
            EgressLogs::open(&dir.path().join("egress"), Duration::from_secs(60)).expect("egress")
        };
        let first_world = {
            let fake = Fake::default();
            let world = fake.world.clone();
            let d = Daemon::with_store(Arc::new(fake), Config::default(), store(), egress());
            let a = created(&d, Some(Duration::from_secs(600))).await;
            set_network(&d, &a.id, policy(&["pypi.org"]))
                .await
                .expect("set");
            let b = created(&d, None).await;
            d.execute(Lifecycle::Pause { id: b.id.clone() })
                .await
                .expect("pause");
            let kids = forked(&d, &a.id, 1).await;
            let c = kids[0].as_ref().expect("child").clone();
            let gone = created(&d, None).await;
            crate::network::tests::append(&d.inner.egress.path(&gone.id), &["x.org"]);
            d.execute(Lifecycle::Kill {
                id: gone.id.clone(),
            })
            .await
            .expect("kill");
            // The daemon "crashes": no shutdown; its state stays written.
            (world, a, b, c, gone)
        };
        let (old, a, b, c, gone) = first_world;
        let fake = Fake::default();
        let world = fake.world.clone();
        // Sandbox c's VMM died while no daemon ran.
        let c_pid = old.handed.load(ORD) as u32 + 1000 - 1 - 1;
        world.gone.lock().expect("gone").push(c_pid);
        // Sandbox b's state is as an older daemon wrote it: no policy.
        let b_file = dir.path().join(format!("sandboxes/{}.json", b.id));
        let mut b_state: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&b_file).expect("read")).expect("json");
        b_state.as_object_mut().expect("object").remove("network");
        std::fs::write(&b_file, b_state.to_string()).expect("write");
        let d = Daemon::with_store(Arc::new(fake), Config::default(), store(), egress());
        let (adopted, cleared) = d.recover();
        assert_eq!(
            (adopted, cleared),
            (3, 1),
            "zygote, a, b adopted; c cleared"
        );
        assert_eq!(*world.discarded.lock().expect("discarded"), vec![c_pid]);
        // The running sandbox is told to run (a dead daemon may have left
        // it paused mid-fork); the paused one and the zygote are not.
        assert_eq!(world.resumed.lock().expect("resumed").len(), 1);
        let info = |id: &SandboxId| d.execute_sync_info(id).expect("known");
        assert_eq!(info(&a.id).state, SandboxState::Running);
        assert!(info(&a.id).expires_in_ms.is_some_and(|ms| ms > 590_000));
        assert_eq!(info(&b.id).state, SandboxState::Paused);
        assert!(d.execute_sync_info(&c.id).is_none(), "cleared away");
        // A new broker serves its recorded policy, which can change.
        let n = network(&d, &a.id).await.expect("network");
        assert!(n.active);
        assert_eq!(n.policy.allow_out, vec!["pypi.org".to_owned()]);
        set_network(&d, &a.id, Policy::deny_all())
            .await
            .expect("set");
        // Without a recorded policy: no broker, said so, no changes.
        let n = network(&d, &b.id).await.expect("network");
        assert!(!n.active);
        assert_eq!(n.policy, NetworkPolicy::default());
        let e = set_network(&d, &b.id, Policy::deny_all())
            .await
            .expect_err("no broker");
        assert_eq!(e.kind(), "conflict");
        // A dead sandbox's log outlives the daemon (until its TTL).
        assert_eq!(d.egress(&gone.id, 10).await.expect("log").len(), 1);
        // The re-adopted zygote has a broker: its forks have networks.
        let fresh = created(&d, None).await;
        assert!(network(&d, &fresh.id).await.expect("network").active);
        assert_eq!(
            d.template("minimal").expect("t").state,
            TemplateState::Ready
        );
        // Adopted sandboxes work as before: fork one, no new bake.
        assert!(forked(&d, &a.id, 1).await[0].is_ok());
        created(&d, None).await;
        assert_eq!(world.boots.load(ORD), 0, "the zygote was re-adopted");
        // What was cleared is forgotten: a third run finds the zygote and
        // 5 sandboxes.
        let d3 = Daemon::with_store(
            Arc::new(Fake::default()),
            Config::default(),
            store(),
            egress(),
        );
        assert_eq!(d3.recover(), (6, 0));
    }

    /// A saved template outlives a daemon that stopped its zygote (as a
    /// reboot would): the next run starts it from its snapshot, without
    /// baking; an unsaved one is gone with the daemon; a deleted one
    /// leaves no snapshot.
    #[tokio::test]
    async fn a_saved_template_is_started_from_its_snapshot_not_baked_after_a_stop() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = || Some(Store::open(dir.path()).expect("store"));
        let egress = || {
            EgressLogs::open(&dir.path().join("egress"), Duration::from_secs(60)).expect("egress")
        };
        let d = Daemon::with_store(
            Arc::new(Fake::default()),
            Config::default(),
            store(),
            egress(),
        );
        let e = d.save_template("minimal").await.expect_err("not baked");
        assert_eq!(e.kind(), "conflict", "{e}");
        let a = created(&d, None).await;
        d.template_from_sandbox(&a.id, "snap".into())
            .await
            .expect("snapshot template");
        let saved = d.save_template("minimal").await.expect("saved");
        assert!(saved.saved_bytes.is_some_and(|b| b > 0), "{saved:?}");
        let memory = dir.path().join("snapshots/minimal/memory");
        assert!(memory.is_file(), "the snapshot is in the state directory");
        d.save_template("snap").await.expect("saved");
        d.delete_template("snap").expect("deleted");
        assert!(
            !dir.path().join("snapshots/snap").exists(),
            "deleted with it"
        );
        d.shutdown().await;
        assert!(memory.is_file(), "a stop keeps a saved template's snapshot");

        let fake = Fake::default();
        let world = fake.world.clone();
        // Every VM of the first run is gone, as after a reboot.
        world.gone.lock().expect("gone").extend(1000..1100);
        let d = Daemon::with_store(Arc::new(fake), Config::default(), store(), egress());
        assert_eq!(
            d.recover(),
            (1, 0),
            "minimal restored; nothing else was left"
        );
        assert_eq!(world.restores.load(ORD), 1);
        let t = d.template("minimal").expect("minimal");
        assert_eq!(
            (t.state, t.saved_bytes),
            (TemplateState::Ready, saved.saved_bytes)
        );
        assert!(
            d.template("snap").is_err(),
            "a deleted template stays deleted"
        );
        assert_eq!(
            *world.zygote_policies.lock().expect("zygote_policies"),
            vec![Some(Policy::deny_all())],
            "made a zygote again, denying all egress"
        );
        created(&d, None).await;
        assert_eq!(
            world.boots.load(ORD),
            0,
            "started from its snapshot, not baked"
        );

        // A snapshot that cannot start (a newer forkbox, say) is kept and
        // tried again at the next start; meanwhile the template says why,
        // and bakes on demand (its stale snapshot then goes).
        d.shutdown().await;
        std::fs::remove_file(&memory).expect("rm");
        for run in 0..2 {
            let fake = Fake::default();
            let world = fake.world.clone();
            world.gone.lock().expect("gone").extend(1000..1100);
            let d = Daemon::with_store(Arc::new(fake), Config::default(), store(), egress());
            assert_eq!(d.recover(), (0, 1), "run {run}");
            let t = d.template("minimal").expect("still registered");
            assert_eq!(t.state, TemplateState::Failed);
            assert!(
                t.error.as_deref().is_some_and(|e| e.contains("snapshot")),
                "{t:?}"
            );
            assert!(dir.path().join("snapshots/minimal").exists(), "kept");
            if run == 1 {
                created(&d, None).await;
                assert_eq!(world.boots.load(ORD), 1, "baked again");
                assert!(!dir.path().join("snapshots/minimal").exists(), "stale");
            }
            d.shutdown().await;
        }
    }
}
