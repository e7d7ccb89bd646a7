//! A forkboxd of our own, for `forkbox demo` and `forkbox bench service`:
//! started on a socket in a fresh temporary directory, so it never meets
//! the user's daemon, and stopped (with every sandbox it owns) on drop.

use std::ops::ControlFlow;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use forkbox_host::poll::{self, TimedOut};

use crate::client::{Client, Endpoint};

pub struct LocalDaemon {
    child: Child,
    socket: PathBuf,
    dir: tempfile::TempDir,
}

/// `forkboxd` next to this executable, else the first on `PATH`.
pub fn forkboxd_path() -> anyhow::Result<PathBuf> {
    let beside = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|d| d.join("forkboxd")))
        .filter(|p| p.is_file());
    let on_path = || {
        std::env::split_paths(&std::env::var_os("PATH")?)
            .map(|d| d.join("forkboxd"))
            .find(|p| p.is_file())
    };
    match beside.or_else(on_path) {
        Some(p) => Ok(p),
        None => bail!(
            "forkboxd not found next to this forkbox or on PATH (build it: `make build`, \
             or `cargo build --release -p forkboxd`)"
        ),
    }
}

impl LocalDaemon {
    /// Starts forkboxd with `args` (caps and such) and waits until it
    /// answers `/health`.
    pub fn start(args: &[String]) -> anyhow::Result<Self> {
        // /tmp: inside the emulated host everything else is read-only.
        let dir = tempfile::Builder::new()
            .prefix("forkboxd-")
            .tempdir_in("/tmp")
            .context("creating the daemon's directory")?;
        let socket = dir.path().join("forkbox.sock");
        let log = std::fs::File::create(dir.path().join("forkboxd.log"))?;
        let exe = forkboxd_path()?;
        let child = Command::new(&exe)
            .arg("--listen")
            .arg(format!("unix://{}", socket.display()))
            .args(args)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", exe.display()))?;
        let mut me = Self { child, socket, dir };
        let deadline = Instant::now() + Duration::from_secs(60);
        let answered = poll::until(deadline, Duration::from_millis(20), || match me.answers() {
            Ok(false) => ControlFlow::Continue(()),
            done => ControlFlow::Break(done),
        });
        match answered {
            Ok(answered) => answered.map(|_| me),
            Err(TimedOut(())) => bail!(
                "forkboxd did not answer within 60 s; its log:\n{}",
                me.log_tail(40)
            ),
        }
    }

    /// Whether the daemon answers `/health` yet; an error once it exited.
    fn answers(&mut self) -> anyhow::Result<bool> {
        if let Some(status) = self.child.try_wait()? {
            bail!(
                "forkboxd exited at start ({status}); its log:\n{}",
                self.log_tail(40)
            );
        }
        Ok(self.socket.exists() && self.client()?.get::<serde_json::Value>("/health").is_ok())
    }

    /// A client of this daemon (one per thread: a client owns a runtime).
    pub fn client(&self) -> anyhow::Result<Client> {
        Ok(Client::new(Endpoint::Unix(self.socket.clone()), None)?)
    }

    /// The last `lines` lines of the daemon's log.
    pub fn log_tail(&self, lines: usize) -> String {
        forkbox_host::testbed::tail(&self.dir.path().join("forkboxd.log"), lines)
    }
}

impl Drop for LocalDaemon {
    fn drop(&mut self) {
        // SIGTERM: forkboxd stops every sandbox and zygote, then exits.
        if let Ok(pid) = i32::try_from(self.child.id()) {
            if let Some(pid) = rustix::process::Pid::from_raw(pid) {
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
            }
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        if poll::holds_by(deadline, Duration::from_millis(20), || {
            matches!(self.child.try_wait(), Ok(Some(_)))
        }) {
            return;
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The few API calls the demo and the service benchmark make, typed just
/// enough for them.
pub mod calls {
    use anyhow::{bail, Context};
    use hyper::Method;
    use serde::Deserialize;
    use serde_json::{json, Value};

    use crate::client::{segment, with_query, Body, Client};

    /// A sandbox as far as these callers look.
    #[derive(Debug, Clone, Deserialize)]
    pub struct Sandbox {
        pub id: String,
        /// Admission to ready, as the daemon measured it.
        pub create_ms: Option<u64>,
        pub metrics: Option<Metrics>,
    }

    #[derive(Debug, Clone, Deserialize)]
    pub struct Metrics {
        pub vmm_pid: Option<u32>,
        /// Fork request to the child's after-fork hook answered.
        pub boot_ms: u64,
    }

    /// A command's buffered result.
    #[derive(Debug, Clone, Deserialize)]
    pub struct Output {
        pub stdout: String,
        pub stderr: String,
        pub exit_code: Option<i32>,
    }

    /// Registers and bakes `spec`; `progress` sees each step as it starts.
    /// Returns the bake's total milliseconds.
    pub fn bake(
        client: &Client,
        spec: &Value,
        progress: &mut dyn FnMut(&str, &str),
    ) -> anyhow::Result<u64> {
        let mut resp = client
            .send(
                Method::POST,
                "/templates",
                Body::json(spec),
                Some("application/x-ndjson"),
            )?
            .ok()?;
        while let Some(event) = resp.next_json::<Value>()? {
            match event["type"].as_str() {
                Some("step") => progress(
                    event["step"].as_str().unwrap_or(""),
                    event["detail"].as_str().unwrap_or(""),
                ),
                Some("done") => return Ok(event["total_ms"].as_u64().unwrap_or(0)),
                Some("failed") => bail!(
                    "baking failed at {}: {}\n{}",
                    event["step"].as_str().unwrap_or("?"),
                    event["message"].as_str().unwrap_or("?"),
                    event["output"].as_str().unwrap_or("")
                ),
                _ => {}
            }
        }
        bail!("the bake's event stream ended without `done` or `failed`")
    }

    pub fn create(client: &Client, template: &str, labels: &Value) -> anyhow::Result<Sandbox> {
        let body = json!({ "template": template, "metadata": labels, "wait_secs": 600 });
        Ok(client
            .call(Method::POST, "/sandboxes", Body::json(&body))?
            .json()?)
    }

    /// `n` children of `id`, each a sandbox or the error it failed with.
    pub fn fork(
        client: &Client,
        id: &str,
        n: usize,
    ) -> anyhow::Result<Vec<Result<Sandbox, String>>> {
        let path = format!("/sandboxes/{}/fork", segment(id));
        let children: Vec<Value> = client
            .call(Method::POST, &path, Body::json(&json!({ "count": n })))?
            .json()?;
        children
            .into_iter()
            .map(|c| match c.get("sandbox") {
                Some(s) => Ok(Ok(
                    serde_json::from_value(s.clone()).context("reading a fork child")?
                )),
                None => Ok(Err(c["error"]["message"]
                    .as_str()
                    .unwrap_or("unknown error")
                    .to_owned())),
            })
            .collect()
    }

    pub fn exec(client: &Client, id: &str, cmd: &str) -> anyhow::Result<Output> {
        let path = format!("/sandboxes/{}/commands", segment(id));
        Ok(client
            .call(Method::POST, &path, Body::json(&json!({ "cmd": cmd })))?
            .json()?)
    }

    /// Writes `bytes` to `path` in the guest.
    pub fn write_file(client: &Client, id: &str, path: &str, bytes: &[u8]) -> anyhow::Result<()> {
        let url = with_query(
            &format!("/sandboxes/{}/files", segment(id)),
            [("path", path)],
        );
        client.call(
            Method::PUT,
            &url,
            Body::Raw(bytes.to_vec(), "application/octet-stream"),
        )?;
        Ok(())
    }

    /// Why a sandbox died, if it has.
    pub fn death(client: &Client, id: &str) -> Option<String> {
        let info: Value = client.get(&format!("/sandboxes/{}", segment(id))).ok()?;
        let death = info.get("death")?;
        (!death.is_null()).then(|| death.to_string())
    }

    pub fn kill(client: &Client, id: &str) -> anyhow::Result<()> {
        let path = format!("/sandboxes/{}", segment(id));
        client.call(Method::DELETE, &path, Body::Empty)?;
        Ok(())
    }

    /// Kills every sandbox carrying `key=value`.
    pub fn kill_label(client: &Client, key: &str, value: &str) -> anyhow::Result<usize> {
        let body = json!({ "metadata": { key: value } });
        let v: Value = client
            .call(Method::POST, "/sandboxes/kill", Body::json(&body))?
            .json()?;
        Ok(v["killed"].as_array().map_or(0, Vec::len))
    }
}
