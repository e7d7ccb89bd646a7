//! What the daemon writes down so that, after it dies (a crash, SIGKILL,
//! an OOM kill), its next run finds every VM it had: one JSON file per
//! live sandbox and per baked template in the state directory, written on
//! every change and removed when the sandbox or template goes.
//!
//! A stop by SIGTERM/SIGINT stops every VM and leaves nothing behind.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use forkbox_host::owned::OwnedError;
use forkbox_host::vm::VmHandle;
use forkbox_net::policy::Policy;
use serde::{Deserialize, Serialize};

use crate::core::{ExpiryAction, Labels, Record, SandboxId, SandboxState};
use crate::service::Baseline;
use crate::template::TemplateSpec;

/// A live sandbox as written down.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SavedSandbox {
    pub id: SandboxId,
    pub template: String,
    pub paused: bool,
    pub labels: Labels,
    pub ttl_secs: Option<f64>,
    pub on_expiry: ExpiryAction,
    /// When the time-to-live runs out, in Unix milliseconds.
    pub deadline_unix_ms: Option<u64>,
    pub parent: Option<SandboxId>,
    pub created_unix: u64,
    pub envs: BTreeMap<String, String>,
    /// Where its commands start when they do not say (its image's).
    #[serde(default)]
    pub cwd: Option<String>,
    /// Whom its calls act as when they name nobody (`None`, written
    /// before images had users: the built-in images' `user`).
    #[serde(default)]
    pub user: Option<forkbox_proto::User>,
    pub spec: TemplateSpec,
    /// Its stored image's id (`None`: a built-in image, or state written
    /// before templates kept the image they found).
    #[serde(default)]
    pub image_id: Option<forkbox_image::Digest>,
    pub vm: VmHandle,
    /// Its egress policy when last written: a re-adopted sandbox is
    /// served a new broker with it. `None` (state written before
    /// sandboxes had networks): adopted without a network.
    #[serde(default)]
    pub network: Option<Policy>,
    /// Its template's protected paths as baked.
    #[serde(default)]
    pub baseline: Option<Baseline>,
}

/// A baked template (its zygote) as written down.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SavedTemplate {
    pub spec: TemplateSpec,
    /// The stored image it boots, as found at its making (see
    /// [`SavedSandbox::image_id`]).
    #[serde(default)]
    pub image_id: Option<forkbox_image::Digest>,
    pub from_sandbox: Option<SandboxId>,
    /// Unregistered (not just un-baked) when deleted.
    pub drop_on_failure: bool,
    pub bake_ms: u64,
    pub vm: VmHandle,
    /// The zygote's egress policy (deny all), as for [`SavedSandbox`].
    #[serde(default)]
    pub network: Option<Policy>,
    #[serde(default)]
    pub baseline: Option<Baseline>,
    /// Bytes of its zygote's snapshot under `snapshots/` (`forkbox
    /// template save`): a daemon that cannot adopt the zygote (it was
    /// stopped, the host rebooted) starts it from there, without baking.
    #[serde(default)]
    pub saved_bytes: Option<u64>,
}

impl SavedSandbox {
    /// The registry record it stands for, `now` being the restart.
    pub fn record(&self, now: Instant, wall: SystemTime) -> Record {
        let now_ms = unix_ms(wall);
        let deadline = self
            .deadline_unix_ms
            .map(|d| now + Duration::from_millis(d.saturating_sub(now_ms)));
        Record {
            id: self.id.clone(),
            template: self.template.clone(),
            state: if self.paused {
                SandboxState::Paused
            } else {
                SandboxState::Running
            },
            labels: self.labels.clone(),
            ttl: self
                .ttl_secs
                .and_then(|s| Duration::try_from_secs_f64(s).ok()),
            on_expiry: self.on_expiry,
            deadline,
            parent: self.parent.clone(),
            children: Vec::new(),
            admitted: now,
            created_unix: self.created_unix,
            ready: Some(now),
            died: None,
        }
    }

    /// The deadline of `r` in Unix milliseconds.
    pub fn deadline_of(r: &Record, now: Instant, wall: SystemTime) -> Option<u64> {
        r.deadline
            .map(|d| unix_ms(wall) + d.saturating_duration_since(now).as_millis() as u64)
    }
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The state directory.
#[derive(Debug, Clone)]
pub struct Store {
    dir: PathBuf,
}

impl Store {
    /// Opens `dir`, with `sandboxes/`, `templates/`, `snapshots/` and
    /// `egress/` in it,
    /// making each (mode 0700) if missing. Each must be ours
    /// ([`forkbox_host::owned`]): a directory another user made, a
    /// symbolic link, one group or others may write, or a path with `..`
    /// is refused, since the daemon would adopt VMs and remove files by
    /// what it reads there. The store keeps the canonical path.
    pub fn open(dir: &Path) -> Result<Self, OwnedError> {
        let dir = forkbox_host::owned::ensure_dir(dir)?;
        for sub in ["sandboxes", "templates", "snapshots", "egress"] {
            forkbox_host::owned::ensure_dir(&dir.join(sub))?;
        }
        // What a save, push or pull that did not finish left: a snapshot
        // written aside (`.NAME.new`), a memory compressed or downloaded
        // (`.tmpXXXX`). No template's name starts with a dot.
        if let Ok(entries) = std::fs::read_dir(dir.join("snapshots")) {
            for e in entries.flatten() {
                if e.file_name().as_encoded_bytes().starts_with(b".") {
                    let path = e.path();
                    let _ = std::fs::remove_dir_all(&path).or_else(|_| std::fs::remove_file(&path));
                }
            }
        }
        Ok(Self { dir })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Where the sandboxes' egress logs are kept (`crate::network`).
    pub fn egress_dir(&self) -> PathBuf {
        self.dir.join("egress")
    }

    fn sandbox_path(&self, id: &SandboxId) -> PathBuf {
        self.dir.join("sandboxes").join(format!("{id}.json"))
    }

    fn template_path(&self, name: &str) -> PathBuf {
        // Template names are [a-z0-9._-], never `..` alone: validated.
        self.dir.join("templates").join(format!("{name}.json"))
    }

    pub fn save_sandbox(&self, s: &SavedSandbox) {
        write_json(&self.sandbox_path(&s.id), s);
    }

    pub fn forget_sandbox(&self, id: &SandboxId) {
        let _ = std::fs::remove_file(self.sandbox_path(id));
    }

    pub fn save_template(&self, t: &SavedTemplate) {
        write_json(&self.template_path(&t.spec.name), t);
    }

    /// Forgets a template: its record and its snapshot, if it has one.
    pub fn forget_template(&self, name: &str) {
        let _ = std::fs::remove_file(self.template_path(name));
        self.forget_snapshot(name);
    }

    /// Removes template `name`'s snapshot, if it has one.
    pub fn forget_snapshot(&self, name: &str) {
        let _ = std::fs::remove_dir_all(self.snapshot_dir(name));
    }

    /// Where a snapshot of template `name` is written before it replaces
    /// the one in [`Self::snapshot_dir`] (no template name starts with
    /// `.`).
    pub fn snapshot_tmp_dir(&self, name: &str) -> PathBuf {
        self.dir.join("snapshots").join(format!(".{name}.new"))
    }

    /// Where the snapshot of template `name`'s zygote is kept.
    pub fn snapshot_dir(&self, name: &str) -> PathBuf {
        // Template names are [a-z0-9._-], never `..` alone: validated.
        self.dir.join("snapshots").join(name)
    }

    /// Everything written down, each file read on its own: one that does
    /// not parse is reported and removed, the rest still load.
    pub fn load(&self) -> (Vec<SavedTemplate>, Vec<SavedSandbox>) {
        (
            read_all(&self.dir.join("templates")),
            read_all(&self.dir.join("sandboxes")),
        )
    }
}

/// Writes `v` to `path` atomically (a temporary file renamed over it).
fn write_json(path: &Path, v: &impl Serialize) {
    let tmp = path.with_extension("json.tmp");
    let written = std::fs::File::create(&tmp).and_then(|mut f| {
        f.write_all(&serde_json::to_vec_pretty(v).map_err(std::io::Error::other)?)?;
        f.sync_all()
    });
    match written.and_then(|()| std::fs::rename(&tmp, path)) {
        Ok(()) => {}
        Err(e) => tracing::error!(path = %path.display(), error = %e, "cannot write daemon state"),
    }
}

fn read_all<T: serde::de::DeserializeOwned>(dir: &Path) -> Vec<T> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for path in entries.flatten().map(|e| e.path()) {
        if path.extension().is_none_or(|e| e != "json") {
            let _ = std::fs::remove_file(&path);
            continue;
        }
        match std::fs::read(&path)
            .map_err(|e| e.to_string())
            .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()))
        {
            Ok(v) => out.push(v),
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "unreadable daemon state; removing it");
                let _ = std::fs::remove_file(&path);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn saved(id: &str) -> SavedSandbox {
        SavedSandbox {
            id: SandboxId::parse(id).expect("id"),
            template: "minimal".into(),
            paused: true,
            labels: [("k".to_owned(), "v".to_owned())].into(),
            ttl_secs: Some(60.0),
            on_expiry: ExpiryAction::Kill,
            deadline_unix_ms: None,
            parent: None,
            created_unix: 1,
            envs: BTreeMap::new(),
            cwd: Some("/work".into()),
            user: Some(forkbox_proto::User::Uid(1000)),
            spec: TemplateSpec::builtin(forkbox_host::image::ImageName::Minimal),
            image_id: None,
            vm: VmHandle {
                dir: "/tmp/forkbox-vm-x".into(),
                pid: 42,
            },
            network: Some(Policy::deny_all()),
            baseline: Some(Baseline {
                paths: vec!["/task/tests".into()],
                entries: Vec::new(),
            }),
        }
    }

    #[test]
    fn saved_state_round_trips_and_forgets() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(dir.path()).expect("open");
        let a = saved("sb-00000001deadbeef");
        store.save_sandbox(&a);
        store.save_sandbox(&saved("sb-00000002deadbeef"));
        std::fs::write(dir.path().join("sandboxes/bad.json"), b"{").expect("write");
        let (templates, sandboxes) = store.load();
        assert!(templates.is_empty());
        assert_eq!(sandboxes.len(), 2, "the unreadable file is skipped");
        assert!(
            sandboxes.iter().all(|s| s.baseline == a.baseline),
            "a sandbox keeps its template's record of protected paths"
        );
        assert!(
            !dir.path().join("sandboxes/bad.json").exists(),
            "and removed"
        );
        store.forget_sandbox(&a.id);
        assert_eq!(store.load().1.len(), 1);
    }

    /// A save, push or pull cut short leaves its debris in `snapshots/`;
    /// the next open clears it and keeps every saved snapshot.
    #[test]
    fn opening_clears_what_an_unfinished_snapshot_write_left() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(dir.path()).expect("open");
        let snaps = dir.path().join("snapshots");
        for d in ["t", ".t.new"] {
            std::fs::create_dir(snaps.join(d)).expect("dir");
            std::fs::write(snaps.join(d).join("memory"), b"m").expect("memory");
        }
        std::fs::write(snaps.join(".tmpAbC123"), b"packed").expect("temp");
        drop(store);
        Store::open(dir.path()).expect("open again");
        let mut left: Vec<_> = std::fs::read_dir(&snaps)
            .expect("read")
            .map(|e| e.expect("entry").file_name())
            .collect();
        left.sort();
        assert_eq!(left, ["t"]);
        assert!(snaps.join("t/memory").is_file());
    }

    #[test]
    fn store_open_refuses_a_directory_it_did_not_make() {
        use std::os::unix::fs::PermissionsExt;
        let t = tempfile::tempdir().expect("tempdir");
        let made = t.path().join("state");
        let store = Store::open(&made).expect("made");
        assert_eq!(
            store.dir(),
            std::fs::canonicalize(&made).expect("canonical")
        );
        for sub in ["", "sandboxes", "templates", "egress"] {
            let mode = std::fs::metadata(made.join(sub))
                .expect("meta")
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o700, "{sub:?}");
        }
        Store::open(&made).expect("ours: opened again");

        let link = t.path().join("link");
        std::os::unix::fs::symlink(&made, &link).expect("symlink");
        let e = Store::open(&link).expect_err("a symlink");
        assert!(e.to_string().contains("symbolic link"), "{e}");

        let e = Store::open(&t.path().join("state/../state")).expect_err("`..`");
        assert!(e.to_string().contains("`..`"), "{e}");

        let open = t.path().join("open");
        std::fs::create_dir(&open).expect("mkdir");
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        let e = Store::open(&open).expect_err("world-writable");
        assert!(e.to_string().contains("chmod go-w"), "{e}");

        // A subdirectory swapped for a link to elsewhere.
        let elsewhere = tempfile::tempdir().expect("tempdir");
        std::fs::remove_dir(made.join("sandboxes")).expect("rmdir");
        std::os::unix::fs::symlink(elsewhere.path(), made.join("sandboxes")).expect("symlink");
        let e = Store::open(&made).expect_err("a linked subdirectory");
        assert!(e.to_string().contains("symbolic link"), "{e}");
    }

    #[test]
    fn deadline_survives_as_wall_clock_time() {
        let (now, wall) = (Instant::now(), SystemTime::now());
        let mut s = saved("sb-00000001deadbeef");
        s.deadline_unix_ms = Some(unix_ms(wall) + 30_000);
        let r = s.record(now, wall);
        assert_eq!(r.state, SandboxState::Paused);
        let left = r.deadline.expect("deadline").duration_since(now);
        assert!((29..=30).contains(&left.as_secs()), "{left:?}");
        assert_eq!(SavedSandbox::deadline_of(&r, now, wall), s.deadline_unix_ms);
    }
}
