//! Sandboxes under gVisor (`runsc`), for hosts without hardware
//! virtualization: the same guest agent serves each one, as the PID 1 of
//! a gVisor sandbox instead of a microVM's.
//!
//! - A sandbox is an OCI bundle forkbox writes: the image's files (a
//!   built-in image's ext4 unpacked once, [`crate::image::rootfs_dir`])
//!   as its root, read-only, under an overlay kept in the sandbox's memory
//!   (`--overlay2=root:memory`: its writes are its own, and go into its
//!   checkpoints); the static agent bound in at [`AGENT_PATH`]; and a
//!   directory of the host's at [`RUN_DIR`], where the agent listens
//!   (`--host-uds=create`).
//! - No network of the host's: `--network=none` gives the sandbox
//!   gVisor's own network stack with a loopback and nothing else. A
//!   sandbox with a network ([`SandboxNet`]) gets one more interface, from
//!   inside: its agent makes `eth0` a TAP device in gVisor's stack and
//!   serves its frames on a socket in the host's directory, where a
//!   `forkbox-vmm gateway` this process starts connects: the gateway a
//!   microVM's VMM runs, with the same policy, broker and egress log.
//! - A fork is a checkpoint and restores of it: [`Sandbox::checkpoint`]
//!   has the agent close its socket (gVisor cannot save one bound to a
//!   host file), checkpoints with `--leave-running` and lets the agent
//!   listen again; [`Sandbox::restore`] starts a copy with a bundle of its
//!   own, lets its agent listen on its own directory and runs the
//!   after-fork hook. The agent waits for that go-ahead on its stdin, a
//!   pipe whose other end the [`Sandbox`] holds.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use forkbox_net::policy::Policy;
use forkbox_proto::client::{AgentClient, ClientError};

use crate::netbroker::NetBroker;
use forkbox_proto::{AfterForkReport, Hello};

/// Where the agent is, inside a sandbox.
pub const AGENT_PATH: &str = "/.forkbox/agent";
/// The host directory the agent's socket is in, inside a sandbox.
pub const RUN_DIR: &str = "/.forkbox/run";
/// The agent's socket's name in [`RUN_DIR`].
const SOCKET: &str = "agent.sock";
/// The agent's frame socket's name in [`RUN_DIR`] (a sandbox with a network).
const NET_SOCKET: &str = "net.sock";
/// How long a quiesce waits for a sandbox's other requests to end.
const QUIESCE_TIMEOUT: Duration = Duration::from_secs(10);
/// Restores run at once by [`Sandbox::restore_each`]: each is mostly
/// runsc's own start (three Go processes).
pub const RESTORE_WORKERS: usize = 4;
/// How long a sandbox's agent has to answer after a start or restore.
pub const READY_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum GvisorError {
    #[error(
        "gVisor's runsc was not found ({looked}): install it (`make runsc`, or \
         `apt-get install runsc`; Debian 12 has a recent one in bookworm-backports), \
         or name it with FORKBOX_RUNSC"
    )]
    NoRunsc { looked: String },
    #[error("runsc {what} failed: {stderr}")]
    Runsc { what: String, stderr: String },
    #[error("cannot run runsc {what}")]
    Spawn {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{what}: {path}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("preparing the image's files")]
    Image(#[source] crate::image::ImageError),
    #[error("finding the static agent")]
    AgentBinary(#[source] crate::vm::VmError),
    #[error("the sandbox's agent {what}")]
    Agent {
        what: &'static str,
        #[source]
        source: ClientError,
    },
}

fn io_err<'a>(
    what: &'static str,
    path: &'a Path,
) -> impl FnOnce(std::io::Error) -> GvisorError + 'a {
    move |source| GvisorError::Io {
        what,
        path: path.to_owned(),
        source,
    }
}

/// The `runsc` binary and the directories its sandboxes live in.
#[derive(Debug)]
pub struct Runsc {
    bin: PathBuf,
    /// runsc's own state (`--root`).
    state: PathBuf,
    /// One directory per sandbox: its bundle, its agent's socket, its log.
    sandboxes: PathBuf,
}

/// Tells sandboxes of one process apart.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

impl Runsc {
    /// Finds `runsc` (`$FORKBOX_RUNSC`, else `PATH`) and keeps its state
    /// and sandboxes under `dir`.
    pub fn find(dir: &Path) -> Result<Self, GvisorError> {
        let bin = match std::env::var_os("FORKBOX_RUNSC") {
            Some(p) => PathBuf::from(p),
            None => {
                let path = std::env::var_os("PATH").unwrap_or_default();
                let mut dirs: Vec<PathBuf> = std::env::split_paths(&path).collect();
                dirs.extend(["/usr/sbin", "/usr/bin", "/usr/local/bin"].map(PathBuf::from));
                dirs.into_iter()
                    .map(|d| d.join("runsc"))
                    .find(|p| p.is_file())
                    .ok_or_else(|| GvisorError::NoRunsc {
                        looked: "$FORKBOX_RUNSC, PATH, /usr/sbin, /usr/bin, /usr/local/bin".into(),
                    })?
            }
        };
        if !bin.is_file() {
            return Err(GvisorError::NoRunsc {
                looked: bin.display().to_string(),
            });
        }
        let state = dir.join("state");
        let sandboxes = dir.join("sandboxes");
        for d in [&state, &sandboxes] {
            std::fs::create_dir_all(d).map_err(io_err("making a directory", d))?;
        }
        Ok(Self {
            bin,
            state,
            sandboxes,
        })
    }

    /// `runsc` with the flags every call about a sandbox must repeat.
    fn command(&self) -> Command {
        let mut cmd = Command::new(&self.bin);
        cmd.arg("--root").arg(&self.state).args([
            "--network=none",
            "--host-uds=create",
            "--overlay2=root:memory",
        ]);
        cmd
    }

    /// Ends every sandbox in its state directory (those a process that
    /// died left); how many there were.
    pub fn delete_all(&self) -> usize {
        let Ok(out) = self.command().args(["list", "--format=json"]).output() else {
            return 0;
        };
        let list: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap_or_default();
        let ids: Vec<&str> = list.iter().filter_map(|c| c["id"].as_str()).collect();
        for id in &ids {
            let _ = self.run("delete", &["delete", "--force", id], Stdio::null(), None);
        }
        ids.len()
    }

    /// The pid `runsc state` gives for sandbox `id` (its sentry's).
    fn state_pid(&self, id: &str) -> Option<u32> {
        let out = self.command().args(["state", id]).output().ok()?;
        let state: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
        state["pid"].as_u64().and_then(|p| u32::try_from(p).ok())
    }

    /// Runs `runsc <args>` to its end; its stderr is the error.
    fn run(
        &self,
        what: &str,
        args: &[&str],
        stdin: Stdio,
        log: Option<&Path>,
    ) -> Result<(), GvisorError> {
        let mut cmd = self.command();
        cmd.args(args).stdin(stdin);
        match log {
            // The sandbox inherits these: its agent's log goes there. Opened
            // to append, so that no reader's offset moves its writes.
            Some(path) => {
                let open = || {
                    std::fs::OpenOptions::new()
                        .append(true)
                        .create(true)
                        .open(path)
                        .map_err(|source| GvisorError::Spawn {
                            what: what.into(),
                            source,
                        })
                };
                cmd.stdout(open()?).stderr(open()?);
            }
            None => {
                cmd.stdout(Stdio::null()).stderr(Stdio::piped());
            }
        }
        let out = cmd.output().map_err(|source| GvisorError::Spawn {
            what: what.into(),
            source,
        })?;
        if out.status.success() {
            return Ok(());
        }
        let mut stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
        if stderr.is_empty() {
            if let Some(f) = log {
                stderr = tail_of(f);
            }
        }
        // runsc prints a Go stack after its one-line reason: keep the reason.
        let reason = stderr
            .lines()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("(no message)")
            .to_string();
        Err(GvisorError::Runsc {
            what: what.into(),
            stderr: format!("{reason} ({})", out.status),
        })
    }
}

/// The bytes of a checkpoint ([`Sandbox::checkpoint`]): its files' sizes.
pub fn checkpoint_bytes(image: &Path) -> u64 {
    std::fs::read_dir(image)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok()?.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

/// The last lines of a log file the sandbox writes.
fn tail_of(path: &Path) -> String {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut f) = File::open(path) else {
        return String::new();
    };
    let len = f.seek(SeekFrom::End(0)).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(2048)));
    let mut text = String::new();
    let _ = f.read_to_string(&mut text);
    text.trim().to_string()
}

/// What a sandbox runs.
#[derive(Debug, Clone)]
pub struct SandboxSpec {
    /// The image's files (read-only: the sandbox writes to its overlay).
    pub rootfs: PathBuf,
    /// The static `forkbox-agent`.
    pub agent: PathBuf,
    /// Its memory, all of gVisor's included (runsc's cgroup limit; the
    /// sandbox sees it as its total). `None`: the host's.
    pub memory_mib: Option<u32>,
    /// CPUs' worth of time it may use (a CFS quota). `None`: unbounded.
    pub cpus: Option<u8>,
    /// Its network; `None`: none but its loopback.
    pub net: Option<SandboxNet>,
}

/// A sandbox's network: as a microVM's, its own broker
/// ([`crate::netbroker`], started with it, deciding by `policy`) and its
/// own gateway, which logs every attempt.
#[derive(Debug, Clone, Default)]
pub struct SandboxNet {
    pub policy: Policy,
    /// Append the egress log (JSON lines) here; `None`: a file in the
    /// sandbox's own directory, removed with it.
    pub egress_log: Option<PathBuf>,
}

impl SandboxSpec {
    /// A built-in image's sandbox: its files unpacked (once) and the
    /// static agent the build made.
    pub fn image(name: crate::image::ImageName) -> Result<Self, GvisorError> {
        let rootfs = crate::image::rootfs_dir(name, &[(AGENT_PATH, true), (RUN_DIR, false)])
            .map_err(GvisorError::Image)?;
        let agent = crate::vm::find_binary("forkbox-agent", "FORKBOX_AGENT")
            .map_err(GvisorError::AgentBinary)?;
        Ok(Self {
            rootfs,
            agent,
            memory_mib: None,
            cpus: None,
            net: None,
        })
    }
}

/// One gVisor sandbox, ended (and its directory removed) when dropped.
#[derive(Debug)]
pub struct Sandbox {
    runsc: Arc<Runsc>,
    id: String,
    dir: PathBuf,
    /// The agent's stdin: one byte lets it listen again after a quiesce;
    /// its end (this process's, or [`release`](Sandbox::release)) ends
    /// the sandbox.
    go: Mutex<Option<File>>,
    log: PathBuf,
    agent: AgentClient,
    hello: Option<Hello>,
    pid: Option<u32>,
    /// Its network's gateway, when it has one.
    gateway: Mutex<Option<Gateway>>,
    /// Its network's broker and egress log, when it has one.
    net: Option<(NetBroker, PathBuf)>,
    /// Spawn (or restore) to the agent's first answer.
    pub ready_after: Duration,
}

impl Sandbox {
    /// Starts a sandbox and waits for its agent.
    pub fn start(runsc: &Arc<Runsc>, spec: &SandboxSpec) -> Result<Self, GvisorError> {
        Self::launch(runsc, spec, None)
    }

    /// A copy of the sandbox checkpointed in `image`, running, its
    /// after-fork hook done (the report says what it did); with `seed`,
    /// its guest gets it as `FORKBOX_SEED` (gVisor's own RNG stays the
    /// host's).
    pub fn restore(
        runsc: &Arc<Runsc>,
        spec: &SandboxSpec,
        image: &Path,
        seed: Option<u64>,
    ) -> Result<(Self, AfterForkReport), GvisorError> {
        let sandbox = Self::launch(runsc, spec, Some(image))?;
        let entropy = crate::vm::after_fork_entropy(seed).map_err(|source| GvisorError::Io {
            what: "reading the host's RNG",
            path: PathBuf::from("getrandom"),
            source,
        })?;
        let report = sandbox
            .agent
            .after_fork_seeded(crate::vm::unix_now_ns(), entropy, seed)
            .map_err(|source| GvisorError::Agent {
                what: "refused the after-fork hook",
                source,
            })?;
        Ok((sandbox, report))
    }

    /// `n` copies of `image` ([`restore`](Self::restore)), made on at most
    /// [`RESTORE_WORKERS`] threads, each handed to `on_child` with its
    /// index as soon as it is up; copy `i` runs `spec_of(i)` (its own
    /// network's egress log, say) and gets `seeds[i]` when given.
    pub fn restore_each(
        runsc: &Arc<Runsc>,
        spec_of: &(dyn Fn(usize) -> SandboxSpec + Sync),
        image: &Path,
        n: usize,
        seeds: &[u64],
        on_child: &(dyn Fn(usize, Result<(Self, AfterForkReport), GvisorError>) + Sync),
    ) {
        crate::vm::on_workers(n, RESTORE_WORKERS, |i| {
            on_child(
                i,
                Self::restore(runsc, &spec_of(i), image, seeds.get(i).copied()),
            )
        });
    }

    fn launch(
        runsc: &Arc<Runsc>,
        spec: &SandboxSpec,
        image: Option<&Path>,
    ) -> Result<Self, GvisorError> {
        let start = Instant::now();
        let id = format!(
            "forkbox-{}-{}",
            std::process::id(),
            NEXT_ID.fetch_add(1, Ordering::Relaxed)
        );
        let dir = runsc.sandboxes.join(&id);
        let run = dir.join("run");
        std::fs::create_dir_all(&run).map_err(io_err("making the sandbox's directory", &run))?;
        let config = dir.join("config.json");
        std::fs::write(&config, bundle_config(spec, &id, &run).to_string())
            .map_err(io_err("writing the bundle", &config))?;
        let log = dir.join("console.log");
        let (reader, writer) = std::io::pipe().map_err(io_err("making a pipe", &dir))?;
        let bundle = dir.to_string_lossy().into_owned();
        let mut sandbox = Self {
            runsc: Arc::clone(runsc),
            id: id.clone(),
            dir,
            go: Mutex::new(Some(File::from(std::os::fd::OwnedFd::from(writer)))),
            log,
            agent: AgentClient::unix(run.join(SOCKET)),
            hello: None,
            pid: None,
            gateway: Mutex::new(None),
            net: None,
            ready_after: Duration::ZERO,
        };
        match image {
            None => runsc.run(
                "run",
                &["run", "--detach", "--bundle", &bundle, &id],
                Stdio::from(reader),
                Some(sandbox.log.as_path()),
            )?,
            Some(image) => {
                let image = format!("--image-path={}", image.display());
                runsc.run(
                    "restore",
                    &["restore", &image, "--detach", "--bundle", &bundle, &id],
                    Stdio::from(reader),
                    Some(sandbox.log.as_path()),
                )?;
                // The restored agent waits where its original quiesced.
                sandbox.go_ahead()?;
            }
        }
        if let Some(net) = &spec.net {
            let log = net
                .egress_log
                .clone()
                .unwrap_or_else(|| sandbox.dir.join("egress.jsonl"));
            let broker_path = sandbox.dir.join("net-broker.sock");
            let broker =
                NetBroker::start_with_log(&broker_path, net.policy.clone(), Some(log.clone()))
                    .map_err(|e| GvisorError::Io {
                        what: "starting the network broker",
                        path: broker_path.clone(),
                        source: std::io::Error::other(forkbox_proto::error_chain(&e)),
                    })?;
            let gateway = Gateway::start(
                &net.policy,
                &broker_path,
                &log,
                &run.join(NET_SOCKET),
                &sandbox.dir,
            )?;
            sandbox.net = Some((broker, log));
            gateway.wait_connected(0, READY_TIMEOUT)?;
            *sandbox
                .gateway
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(gateway);
        }
        let hello =
            sandbox
                .agent
                .wait_ready(READY_TIMEOUT)
                .map_err(|source| GvisorError::Agent {
                    what: "did not answer",
                    source,
                })?;
        sandbox.hello = Some(hello);
        sandbox.pid = runsc.state_pid(&id);
        sandbox.ready_after = start.elapsed();
        Ok(sandbox)
    }

    /// Lets a quiesced agent listen again.
    fn go_ahead(&self) -> Result<(), GvisorError> {
        let mut go = self
            .go
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(go) = go.as_mut() else {
            return Err(GvisorError::Io {
                what: "telling the agent to listen again",
                path: self.dir.clone(),
                source: std::io::Error::other("the sandbox was released"),
            });
        };
        go.write_all(b"g")
            .map_err(io_err("telling the agent to listen again", &self.dir))
    }

    /// A client of its agent.
    pub fn agent(&self) -> AgentClient {
        self.agent.clone()
    }

    /// What its agent said when it first answered.
    pub fn hello(&self) -> Option<&Hello> {
        self.hello.as_ref()
    }

    /// runsc's name for it.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The host process of gVisor's kernel for it (its sentry).
    pub fn pid(&self) -> Option<u32> {
        self.pid
    }

    /// Whether it has ended (its sentry is gone).
    pub fn ended(&self) -> bool {
        self.pid.is_none_or(crate::measure::exited)
    }

    /// Lets go of it as the end of this process would: its agent sees its
    /// stdin close and ends, and the sandbox with it.
    pub fn release(&self) {
        self.go
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        self.gateway
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
    }

    /// Ends it now; dropping it removes what is left.
    pub fn kill(&self) {
        let _ = self.runsc.run(
            "delete",
            &["delete", "--force", &self.id],
            Stdio::null(),
            None,
        );
    }

    /// Writes the running sandbox to `image` (a directory), which
    /// [`restore`](Self::restore) starts copies of; it goes on running.
    /// Requests still open to its agent are waited for, 10 s at most.
    pub fn checkpoint(&self, image: &Path) -> Result<(), GvisorError> {
        self.checkpoint_within(image, QUIESCE_TIMEOUT)
    }

    /// [`checkpoint`](Self::checkpoint), waiting at most `within` for open
    /// requests to end (then nothing is made, and the agent serves on).
    pub fn checkpoint_within(&self, image: &Path, within: Duration) -> Result<(), GvisorError> {
        std::fs::create_dir_all(image)
            .map_err(io_err("making the checkpoint's directory", image))?;
        let connects = self.gateway_connects();
        if let Err(source) = self.agent.quiesce(within) {
            // The agent listens again at once: back when it answers.
            let _ = self.agent.wait_ready(READY_TIMEOUT);
            return Err(GvisorError::Agent {
                what: "could not quiesce for the checkpoint",
                source,
            });
        }
        let image_arg = format!("--image-path={}", image.display());
        let made = self.runsc.run(
            "checkpoint",
            &[
                "checkpoint",
                &image_arg,
                "--compression=none",
                "--leave-running",
                &self.id,
            ],
            Stdio::null(),
            None,
        );
        // Listen again whether or not the checkpoint was made.
        let resumed = self.go_ahead();
        made?;
        resumed?;
        self.agent
            .wait_ready(READY_TIMEOUT)
            .map_err(|source| GvisorError::Agent {
                what: "did not answer after the checkpoint",
                source,
            })?;
        // Its network closed for the checkpoint: back when its gateway is.
        if let (Some(seen), Some(gateway)) = (
            connects,
            self.gateway
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .as_ref(),
        ) {
            gateway.wait_connected(seen, READY_TIMEOUT)?;
        }
        Ok(())
    }

    fn gateway_connects(&self) -> Option<u64> {
        self.gateway
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .map(Gateway::connects)
    }

    /// Stops it in place (`runsc pause`).
    pub fn pause(&self) -> Result<(), GvisorError> {
        self.runsc
            .run("pause", &["pause", &self.id], Stdio::null(), None)
    }

    pub fn resume(&self) -> Result<(), GvisorError> {
        self.runsc
            .run("resume", &["resume", &self.id], Stdio::null(), None)
    }

    /// The host processes that make it up (gVisor's sentry, its gofer,
    /// those started with its bundle; its network's gateway).
    pub fn host_pids(&self) -> Vec<u32> {
        let flag = format!("--bundle={}", self.dir.display());
        let gateway = self
            .gateway
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .map(|g| g.child.id());
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        entries
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
            .filter(|pid| {
                Some(*pid) == gateway
                    || std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|cmdline| {
                        cmdline.split(|b| *b == 0).any(|arg| arg == flag.as_bytes())
                    })
            })
            .collect()
    }

    /// The egress policy its connections and lookups are decided by
    /// (`None`: no network).
    pub fn network_policy(&self) -> Option<Policy> {
        self.net.as_ref().map(|(broker, _)| broker.policy())
    }

    /// Decides its new connections and lookups by `policy` from now on
    /// (its broker's and its gateway's copy); open connections stay.
    pub fn set_network_policy(&self, policy: &Policy) -> Result<(), GvisorError> {
        let Some((broker, _)) = &self.net else {
            return Err(GvisorError::Io {
                what: "changing the network policy",
                path: self.dir.clone(),
                source: std::io::Error::other("the sandbox has no network"),
            });
        };
        broker
            .set_policy(policy.clone())
            .map_err(|e| GvisorError::Io {
                what: "changing the network policy",
                path: broker.path().to_owned(),
                source: std::io::Error::other(forkbox_proto::error_chain(&e)),
            })
    }

    /// Where its egress log is (JSON lines), if it has a network.
    pub fn egress_log_path(&self) -> Option<&Path> {
        self.net.as_ref().map(|(_, log)| log.as_path())
    }

    /// Its agent's log, and gVisor's about it.
    pub fn console(&self) -> String {
        tail_of(&self.log)
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        self.gateway
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        let _ = self.runsc.run(
            "delete",
            &["delete", "--force", &self.id],
            Stdio::null(),
            None,
        );
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A sandbox's `forkbox-vmm gateway`: it ends when its stdin, held here,
/// closes (this is dropped, or this process ends); dropping this also
/// kills and reaps it.
#[derive(Debug)]
struct Gateway {
    child: std::process::Child,
    /// How many times it connected to the sandbox's socket (one line on
    /// its stdout each), read by a thread of its own.
    connects: Arc<(Mutex<u64>, std::sync::Condvar)>,
}

impl Gateway {
    fn start(
        policy: &Policy,
        broker: &Path,
        egress_log: &Path,
        frames: &Path,
        dir: &Path,
    ) -> Result<Self, GvisorError> {
        let vmm = crate::vm::find_binary("forkbox-vmm", "FORKBOX_VMM")
            .map_err(GvisorError::AgentBinary)?;
        let policy_path = dir.join("net-policy.json");
        let json = serde_json::to_string(policy).map_err(|e| GvisorError::Io {
            what: "writing the network policy",
            path: policy_path.clone(),
            source: std::io::Error::other(e),
        })?;
        std::fs::write(&policy_path, json)
            .map_err(io_err("writing the network policy", &policy_path))?;
        let mut cmd = Command::new(vmm);
        cmd.arg("gateway")
            .arg("--frames")
            .arg(frames)
            .arg("--net-policy")
            .arg(&policy_path)
            .arg("--net-broker")
            .arg(broker)
            .arg("--net-log")
            .arg(egress_log)
            .arg("--until-stdin-closes");
        let log = dir.join("gateway.log");
        let stderr = File::create(&log).map_err(io_err("creating the gateway's log", &log))?;
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .map_err(|source| GvisorError::Spawn {
                what: "forkbox-vmm gateway".into(),
                source,
            })?;
        let connects = Arc::new((Mutex::new(0u64), std::sync::Condvar::new()));
        if let Some(out) = child.stdout.take() {
            let connects = Arc::clone(&connects);
            std::thread::spawn(move || {
                use std::io::BufRead;
                for line in std::io::BufReader::new(out).lines() {
                    if line.is_err() {
                        break;
                    }
                    *connects
                        .0
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner) += 1;
                    connects.1.notify_all();
                }
            });
        }
        Ok(Self { child, connects })
    }

    fn connects(&self) -> u64 {
        *self
            .connects
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Waits until it has connected more than `seen` times: the sandbox's
    /// network is up.
    fn wait_connected(&self, seen: u64, within: Duration) -> Result<(), GvisorError> {
        let (count, changed) = &*self.connects;
        let count = count
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (count, _) = changed
            .wait_timeout_while(count, within, |c| *c <= seen)
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if *count > seen {
            return Ok(());
        }
        Err(GvisorError::Io {
            what: "waiting for the sandbox's network",
            path: PathBuf::from("forkbox-vmm gateway"),
            source: std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("its gateway did not reach the sandbox within {within:?}"),
            ),
        })
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        // Its stdin closes first: it ends by itself; the kill is for one
        // that does not.
        drop(self.child.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The OCI runtime spec of a sandbox (`config.json`).
fn bundle_config(spec: &SandboxSpec, id: &str, run: &Path) -> serde_json::Value {
    // The agent is the sandbox's root: what it may do is bounded by gVisor,
    // not by capabilities; it needs setuid, chown and the like to run the
    // policy's commands as their user.
    let caps: Vec<&str> = vec![
        "CAP_CHOWN",
        "CAP_DAC_OVERRIDE",
        "CAP_DAC_READ_SEARCH",
        "CAP_FOWNER",
        "CAP_FSETID",
        "CAP_KILL",
        "CAP_SETGID",
        "CAP_SETUID",
        "CAP_SETPCAP",
        "CAP_LINUX_IMMUTABLE",
        "CAP_NET_BIND_SERVICE",
        "CAP_NET_ADMIN",
        "CAP_NET_RAW",
        "CAP_SYS_CHROOT",
        "CAP_SYS_PTRACE",
        "CAP_SYS_ADMIN",
        "CAP_SYS_NICE",
        "CAP_SYS_RESOURCE",
        "CAP_MKNOD",
        "CAP_AUDIT_WRITE",
    ];
    serde_json::json!({
        "ociVersion": "1.0.0",
        "process": {
            "terminal": false,
            "user": {"uid": 0, "gid": 0},
            "args": agent_args(spec),
            "env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root"],
            "cwd": "/",
            "capabilities": {
                "bounding": caps, "effective": caps, "permitted": caps,
            },
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 65536, "soft": 65536}],
        },
        "root": {"path": spec.rootfs, "readonly": false},
        "hostname": "forkbox",
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
             "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs",
             "options": ["nosuid", "noexec", "nodev", "ro"]},
            {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
             "options": tmp_options(spec)},
            {"destination": RUN_DIR, "type": "bind", "source": run, "options": ["rbind", "rw"]},
            {"destination": AGENT_PATH, "type": "bind", "source": spec.agent,
             "options": ["rbind", "ro"]},
        ],
        "linux": {
            "namespaces": [
                {"type": "pid"}, {"type": "network"}, {"type": "ipc"},
                {"type": "uts"}, {"type": "mount"},
            ],
            "cgroupsPath": format!("/forkbox-gvisor/{id}"),
            "resources": resources(spec),
        },
    })
}

/// The agent's command line: with `--net`, it makes `eth0` and serves its
/// frames.
fn agent_args(spec: &SandboxSpec) -> Vec<String> {
    let mut args = vec![
        AGENT_PATH.to_string(),
        "container".into(),
        "--listen".into(),
        format!("unix:{RUN_DIR}/{SOCKET}"),
    ];
    if spec.net.is_some() {
        args.extend(["--net".into(), format!("unix:{RUN_DIR}/{NET_SOCKET}")]);
    }
    args
}

/// `/tmp`'s mount options: at most half the sandbox's memory, as a
/// Linux tmpfs is by default, so that a command filling it meets a full
/// disk (its own failure) instead of the memory limit, which ends the
/// whole sandbox.
fn tmp_options(spec: &SandboxSpec) -> Vec<String> {
    let mut options = vec!["nosuid".into(), "nodev".into(), "mode=1777".into()];
    if let Some(mib) = spec.memory_mib {
        options.push(format!("size={}m", (mib / 2).max(1)));
    }
    options
}

/// The limits runsc puts on the sandbox's cgroup.
fn resources(spec: &SandboxSpec) -> serde_json::Value {
    const PERIOD_US: u64 = 100_000;
    let mut resources = serde_json::json!({});
    if let Some(mib) = spec.memory_mib {
        resources["memory"] = serde_json::json!({"limit": u64::from(mib) << 20});
    }
    if let Some(cpus) = spec.cpus {
        resources["cpu"] =
            serde_json::json!({"quota": u64::from(cpus) * PERIOD_US, "period": PERIOD_US});
    }
    resources
}
