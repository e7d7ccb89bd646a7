//! Protected paths: a template's grader, tests and task, taken out of the
//! policy's hands when the template is baked and recorded then (the
//! baseline); a sandbox's integrity check compares what is there now with
//! that record. A sandbox keeps the baseline of the template it came from,
//! through forks and templates made from sandboxes, so a check never
//! compares with a state the policy could have shaped.
//!
//! The record and the check are made by the guest agent, which runs as
//! root: they hold while the policy cannot become root (it runs as `user`
//! by default; SECURITY.md, "Protected paths").

use std::collections::BTreeMap;

use forkbox_proto::client::AgentClient;
use forkbox_proto::DigestEntry;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{Daemon, DaemonError};
use crate::core::SandboxId;

/// What a template's protected paths held when it was baked.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Baseline {
    pub paths: Vec<String>,
    pub entries: Vec<DigestEntry>,
}

/// Whether a sandbox's protected paths still hold what its template's bake
/// recorded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct IntegrityReport {
    /// Nothing protected changed (true, too, when nothing is protected).
    pub intact: bool,
    /// The template's protected paths.
    pub protected: Vec<String>,
    /// Paths whose content, type, owner or permissions differ.
    pub changed: Vec<String>,
    /// Paths under a protected path that were not there at the bake.
    pub added: Vec<String>,
    /// Paths recorded at the bake that are gone.
    pub removed: Vec<String>,
    /// Entries recorded at the bake.
    pub entries: usize,
}

impl Baseline {
    /// Protects `paths` and records them. Each must exist: a template whose
    /// setup did not make its grader is refused, not baked.
    pub(super) fn take(agent: &AgentClient, paths: &[String]) -> Result<Self, DaemonError> {
        let recipe = |message: String| DaemonError::Recipe {
            step: "protect".into(),
            message,
            output: String::new(),
        };
        agent.protect(paths).map_err(|e| match e.agent_error() {
            Some(a) => recipe(format!("protecting {paths:?}: {}", a.message)),
            None => DaemonError::infra("protecting the template's paths", e),
        })?;
        let entries = agent.digest(paths).map_err(|e| match e.agent_error() {
            Some(a) => recipe(format!("recording {paths:?}: {}", a.message)),
            None => DaemonError::infra("recording the template's protected paths", e),
        })?;
        Ok(Self {
            paths: paths.to_vec(),
            entries,
        })
    }

    /// How `now` (a digest of the same paths) differs from this record.
    pub fn compare(&self, now: &[DigestEntry]) -> IntegrityReport {
        let then: BTreeMap<&str, &DigestEntry> =
            self.entries.iter().map(|e| (e.path.as_str(), e)).collect();
        let now: BTreeMap<&str, &DigestEntry> = now.iter().map(|e| (e.path.as_str(), e)).collect();
        let mut report = IntegrityReport {
            intact: true,
            protected: self.paths.clone(),
            changed: Vec::new(),
            added: Vec::new(),
            removed: Vec::new(),
            entries: self.entries.len(),
        };
        for (path, was) in &then {
            match now.get(path) {
                None => report.removed.push((*path).into()),
                Some(is) if is != was => report.changed.push((*path).into()),
                Some(_) => {}
            }
        }
        report.added = now
            .keys()
            .filter(|p| !then.contains_key(*p))
            .map(|p| (*p).into())
            .collect();
        report.intact =
            report.changed.is_empty() && report.added.is_empty() && report.removed.is_empty();
        report
    }
}

impl Daemon {
    /// Compares a sandbox's protected paths with its template's record.
    pub async fn integrity(&self, id: &SandboxId) -> Result<IntegrityReport, DaemonError> {
        self.machine(id)?;
        let baseline = self
            .lock()
            .machines
            .get(id)
            .and_then(|l| l.baseline.clone());
        let Some(baseline) = baseline else {
            return Ok(IntegrityReport {
                intact: true,
                protected: Vec::new(),
                changed: Vec::new(),
                added: Vec::new(),
                removed: Vec::new(),
                entries: 0,
            });
        };
        let paths = baseline.paths.clone();
        let now = self.with_agent(id, move |a| a.digest(&paths)).await?;
        Ok(baseline.compare(&now))
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixStream;

    use forkbox_proto::frame::write_frame;
    use forkbox_proto::Response;
    use forkbox_proto::{encode_control, AgentError, ErrorKind, FileKind, FrameKind, Request};

    use super::*;
    use crate::backend::fake::scripted_agent;
    use crate::service::templates::BakeEvent;
    use crate::service::testing::*;
    use crate::template::TemplateSpec;

    fn answer(conn: &mut UnixStream, r: &Response) {
        let _ = write_frame(conn, FrameKind::Control, &encode_control(r));
    }

    async fn baked(d: &Daemon, name: &str, protect: &[&str]) -> BakeEvent {
        let mut spec = TemplateSpec::builtin(forkbox_host::image::ImageName::Minimal);
        spec.name = name.into();
        spec.protect = protect.iter().map(|p| p.to_string()).collect();
        let mut rx = d.bake(spec).expect("bake starts");
        let mut last = None;
        while let Some(e) = rx.recv().await {
            last = Some(e);
        }
        last.expect("a last event")
    }

    #[tokio::test]
    async fn sandboxes_and_their_forks_are_checked_against_their_templates_bake() {
        let dir = tempfile::tempdir().expect("tempdir");
        // An agent whose task file reads "good" for its first two digests
        // (the bake's record, the sandbox's check), then "edited".
        let digests = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let seen = digests.clone();
        let sock = scripted_agent(dir.path(), move |conn, req| match req {
            Request::Protect { paths } if paths == ["/task/tests"] => answer(conn, &Response::Ok),
            Request::Protect { paths } => answer(
                conn,
                &Response::Error {
                    error: AgentError::new(ErrorKind::NotFound, format!("{paths:?}: no such file")),
                },
            ),
            Request::Digest { paths } => {
                assert_eq!(paths, ["/task/tests"]);
                let n = seen.fetch_add(1, ORD);
                let entries = vec![file(
                    "/task/tests/t.py",
                    if n < 2 { "good" } else { "edited" },
                )];
                answer(conn, &Response::Digests { entries });
                answer(conn, &Response::Done { bytes: 1 });
            }
            other => panic!("unexpected {other:?}"),
        });
        let fake = Fake::default();
        *fake.world.agent_sock.lock().expect("agent_sock") = Some(sock);
        let d = daemon(fake, 4);

        let done = baked(&d, "task", &["/task/tests"]).await;
        assert!(matches!(done, BakeEvent::Done { .. }), "{done:?}");
        assert_eq!(digests.load(ORD), 1, "recorded at the bake");
        let a = created_with(&d, "task", None).await;
        let r = d.integrity(&a.id).await.expect("check");
        assert!(r.intact, "{r:?}");
        assert_eq!(
            (r.protected.as_slice(), r.entries),
            (&["/task/tests".to_owned()][..], 1)
        );

        // A fork is checked against the template's record, not its
        // parent's state: here the file changed after the first check.
        let child = forked(&d, &a.id, 1).await.remove(0).expect("child");
        let r = d.integrity(&child.id).await.expect("check");
        assert!(!r.intact);
        assert_eq!(r.changed, ["/task/tests/t.py"]);

        // A template from the sandbox keeps the same record.
        d.template_from_sandbox(&a.id, "task-later".into())
            .await
            .expect("snapshot");
        let b = created_with(&d, "task-later", None).await;
        let r = d.integrity(&b.id).await.expect("check");
        assert_eq!(r.changed, ["/task/tests/t.py"]);

        // Nothing protected: nothing to tamper with, and it says so.
        let plain = created(&d, None).await;
        let r = d.integrity(&plain.id).await.expect("check");
        assert!(r.intact && r.protected.is_empty(), "{r:?}");

        // A protected path the setup did not make fails the bake.
        match baked(&d, "broken", &["/task/grader.py"]).await {
            BakeEvent::Failed(f) => {
                assert_eq!(
                    (f.step.as_str(), f.kind.as_str()),
                    ("protect", "template_failed")
                );
                assert!(f.message.contains("no such file"), "{}", f.message);
            }
            other => panic!("{other:?}"),
        }
    }

    fn file(path: &str, content: &str) -> DigestEntry {
        DigestEntry {
            path: path.into(),
            kind: FileKind::File,
            mode: 0o644,
            uid: 0,
            gid: 0,
            size: content.len() as u64,
            content: content.into(),
        }
    }

    #[test]
    fn compare_names_each_changed_added_and_removed_path() {
        let baseline = Baseline {
            paths: vec!["/task/tests".into()],
            entries: vec![
                file("/task/tests/a.py", "aa"),
                file("/task/tests/b.py", "bb"),
                file("/task/tests/c.py", "cc"),
            ],
        };
        let same = baseline.compare(&baseline.entries);
        assert!(same.intact, "{same:?}");
        assert_eq!(same.entries, 3);

        let mut owned = file("/task/tests/c.py", "cc");
        owned.uid = 1000;
        let now = vec![
            file("/task/tests/a.py", "a!"),
            owned,
            file("/task/tests/conftest.py", ""),
        ];
        let r = baseline.compare(&now);
        assert!(!r.intact);
        assert_eq!(r.changed, ["/task/tests/a.py", "/task/tests/c.py"]);
        assert_eq!(r.added, ["/task/tests/conftest.py"]);
        assert_eq!(r.removed, ["/task/tests/b.py"]);
    }
}
