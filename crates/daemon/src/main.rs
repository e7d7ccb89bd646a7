//! `forkboxd`: parse flags, check this host can run microVMs, listen.
#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use forkbox_host::owned;
use forkbox_host::testbed::Environment;
use forkboxd::backend::{Backend, VmBackend};
use forkboxd::core::Limits;
use forkboxd::gvisor::GvisorBackend;
use forkboxd::listen::{default_socket, Listen, ListenError};
use forkboxd::network::EgressLogs;
use forkboxd::persist::Store;
use forkboxd::service::{Bounds, Config, Daemon};

/// The forkbox daemon: owns every sandbox on this host and serves the HTTP
/// API (see /openapi.json).
#[derive(Parser)]
#[command(version)]
struct Args {
    /// unix://PATH or tcp://ADDR (TCP needs a token). Default:
    /// /run/forkbox/forkbox.sock as root, else
    /// $XDG_RUNTIME_DIR/forkbox/forkbox.sock.
    #[arg(long)]
    listen: Option<Listen>,
    /// Bearer token required on every request but /health (also
    /// $FORKBOX_TOKEN); mandatory with tcp://.
    #[arg(long)]
    token: Option<String>,
    /// Most sandboxes creating, running or paused at once (a fork's
    /// children count one each). Default: as many as the host's memory
    /// holds less the reserve, at 8 MiB each, 16 to 4096 (what each
    /// template's sandboxes really take is checked at every admission too).
    #[arg(long)]
    max_live: Option<usize>,
    /// Most sandboxes being created from templates at once (the children
    /// of one fork request count once, against --max-live only).
    #[arg(long, default_value_t = 16)]
    max_creating: usize,
    /// Seconds a creation waits for room under the caps before failing.
    #[arg(long, default_value_t = 30.0)]
    create_wait: f64,
    /// MiB of the host's available memory every creation must leave free
    /// after what it is predicted to take (the mean of what its template's
    /// live sandboxes take); default: a sixteenth of the host's memory,
    /// 256 MiB to 2 GiB. 0: never refuse for memory.
    #[arg(long)]
    memory_reserve_mib: Option<u64>,
    /// Where live VMs are written down so that the next run re-adopts
    /// them after a crash (default: the socket's path + `.state`; with
    /// tcp://, `tcp-ADDR.state` in the default socket's directory). Made
    /// with mode 0700; one that exists must be this user's, not a
    /// symbolic link, not writable by group or others.
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// Keep no state: VMs left by a crash are not found again.
    #[arg(long, conflicts_with = "state_dir")]
    no_state: bool,
    /// Seconds a VM may take to boot.
    #[arg(long, default_value_t = 120)]
    boot_timeout: u64,
    /// Seconds a sandbox's egress log is kept after it died (in the state
    /// directory's `egress/`, or a temporary directory with --no-state).
    #[arg(long, default_value_t = 86400)]
    egress_log_ttl: u64,
    /// MiB all sandboxes' logs may hold together. A live sandbox's VMM
    /// caps its serial log at 8 MiB and its egress log at 64 MiB, and
    /// --max-live of them must fit; the rest is for dead sandboxes'
    /// egress logs, the oldest deleted before their TTL when it is full.
    /// Default: --max-live sandboxes' logs at their caps and 8192 more.
    #[arg(long)]
    log_max_total_mib: Option<u64>,
    /// Seconds any agent call but a command's (files, processes, ports)
    /// may take; past it the client gets a 504 `guest_timeout`.
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u64).range(1..=86400))]
    agent_call_secs: u64,
    /// Longest a command may run, in seconds: one without a timeout gets
    /// this one, a longer timeout is refused. Also bounds waiting on and
    /// following a background process.
    #[arg(long, default_value_t = 86400, value_parser = clap::value_parser!(u64).range(1..=31_536_000))]
    max_exec_secs: u64,
    /// Seconds a sandbox's VMM lives on after this daemon died (or was
    /// stopped) before it ends by itself: a daemon started again on the
    /// same state directory within this time adopts it.
    #[arg(long, default_value_t = 120, value_parser = clap::value_parser!(u64).range(1..=86400))]
    orphan_grace_secs: u64,
    /// Refuse to start when a part of the VMMs' jail cannot be set up here
    /// (see docs/SECURITY.md), instead of saying so and running without it.
    #[arg(long)]
    require_jail: bool,
    /// Most bytes a file read or tar download may ask for (`max_bytes`;
    /// 256 MiB when not asked).
    #[arg(long, default_value_t = 4 << 30)]
    max_download_bytes: u64,
    /// Largest file, tar or stdin upload, in bytes (the daemon holds one
    /// whole in memory while it is sent on).
    #[arg(long, default_value_t = 1 << 30)]
    max_upload_bytes: usize,
    /// What runs the sandboxes: `kvm` (microVMs: hardware virtualization,
    /// or the emulated host), `gvisor` (gVisor's runsc, which needs no
    /// virtualization; see the README for what it does not do yet), or
    /// `auto`: KVM where microVMs can run here, else gVisor.
    #[arg(long, value_enum, default_value_t = BackendKind::Auto)]
    backend: BackendKind,
    #[command(subcommand)]
    command: Option<Cmd>,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum BackendKind {
    Auto,
    Kvm,
    Gvisor,
}

#[derive(Subcommand)]
enum Cmd {
    /// Print the OpenAPI document and exit.
    Openapi,
}

fn main() -> ExitCode {
    // The host library's events too (a fork child replaced, a second
    // boot, the network broker's failures).
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "forkboxd=info,forkbox_host=info".into()),
        )
        .with_writer(std::io::stderr)
        // Colour codes only for a terminal, not for a log file.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match run(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("forkboxd: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> anyhow::Result<()> {
    if let Some(Cmd::Openapi) = args.command {
        print!("{}", forkboxd::api::openapi_json());
        return Ok(());
    }
    let environment = Environment::detect();
    let backend_kind = match args.backend {
        BackendKind::Auto if environment == Environment::NeedsEmulatedHost => BackendKind::Gvisor,
        BackendKind::Auto => BackendKind::Kvm,
        chosen => chosen,
    };
    let gaps = match backend_kind {
        BackendKind::Kvm => forkbox_host::jail::gaps(),
        _ => Vec::new(),
    };
    if !gaps.is_empty() {
        let list: Vec<String> = gaps.iter().map(|g| format!("  - {g}")).collect();
        if args.require_jail {
            bail!(
                "the VMMs' jail cannot be set up here, and --require-jail refuses to run without \
                 it:\n{}",
                list.join("\n")
            );
        }
        tracing::warn!(
            "THE VMMs' JAIL IS INCOMPLETE on this host; sandboxes run without:\n{}\n(pass \
             --require-jail to refuse to start instead)",
            list.join("\n")
        );
    }
    let default = || default_socket(is_root(), std::env::var("XDG_RUNTIME_DIR").ok().as_deref());
    let listen = match args.listen {
        // A socket's directory the daemon makes (mode 0700) must be ours;
        // one that exists is checked for who may change it (`/tmp` is
        // fine: sticky). A file already at the path must be a socket of
        // ours, left by an earlier run.
        Some(Listen::Unix(path)) => {
            let make_dir = path.parent().is_some_and(|d| !d.exists());
            Listen::Unix(
                owned::socket_path(&path, make_dir)
                    .with_context(|| format!("checking the socket path {}", path.display()))?,
            )
        }
        Some(tcp) => tcp,
        None => {
            let path = default()?;
            Listen::Unix(
                owned::socket_path(&path, true)
                    .with_context(|| format!("checking the default socket {}", path.display()))?,
            )
        }
    };
    let token = args
        .token
        .or_else(|| std::env::var("FORKBOX_TOKEN").ok())
        .filter(|t| !t.is_empty());
    if matches!(listen, Listen::Tcp(_)) && token.is_none() {
        bail!("listening on TCP needs a bearer token: pass --token or set FORKBOX_TOKEN");
    }
    if backend_kind == BackendKind::Kvm && environment == Environment::NeedsEmulatedHost {
        bail!(
            "this machine cannot run microVMs (no VMX/SVM behind /dev/kvm); run the daemon inside \
             the emulated host (`forkbox testbed run -- forkboxd --listen unix:///tmp/forkbox.sock`), \
             or on gVisor (`--backend gvisor`)"
        );
    }
    let backend: Box<dyn FnOnce(Option<forkbox_image::Store>) -> Arc<dyn Backend>> =
        match backend_kind {
            BackendKind::Gvisor => {
                let backend = GvisorBackend::temporary()
                    .context("starting the gVisor backend (run `make build`)")?;
                tracing::info!(
                    dir = %backend.dir().display(),
                    "sandboxes run on gVisor (runsc){}",
                    if args.backend == BackendKind::Auto {
                        ": this machine has no hardware virtualization (--backend kvm to refuse)"
                    } else {
                        ""
                    }
                );
                Box::new(move |_| Arc::new(backend))
            }
            _ => {
                let backend = VmBackend::new(
                    Duration::from_secs(args.orphan_grace_secs),
                    args.require_jail,
                )
                .context("preparing the guest assets (run `make build`)")?;
                tracing::info!("sandboxes run in KVM microVMs");
                Box::new(move |images| Arc::new(backend.with_images(images)))
            }
        };
    let memory_total = forkbox_host::measure::meminfo()
        .ok()
        .and_then(|m| m.get("MemTotal").copied())
        .map_or(0, |kib| kib << 10);
    let memory_reserve = match args.memory_reserve_mib {
        Some(mib) => mib << 20,
        None => forkboxd::service::default_memory_reserve(memory_total),
    };
    let max_live = args
        .max_live
        .unwrap_or_else(|| forkboxd::service::default_max_live(memory_total, memory_reserve));
    let log_max_total_mib = args
        .log_max_total_mib
        .unwrap_or_else(|| default_log_total_mib(max_live));
    let open_files = raise_open_files(max_live);
    tracing::info!(
        max_live,
        memory_total_mib = memory_total >> 20,
        memory_reserve_mib = memory_reserve >> 20,
        log_max_total_mib,
        open_files,
        "admission caps"
    );
    let mut config = Config {
        limits: Limits {
            max_live,
            max_creating: args.max_creating.max(1),
            ..Limits::default()
        },
        create_wait: Duration::try_from_secs_f64(args.create_wait)
            .context("--create-wait must be a non-negative number")?,
        boot_timeout: Duration::from_secs(args.boot_timeout),
        egress_log_ttl: Duration::from_secs(args.egress_log_ttl),
        bounds: Bounds {
            agent_call: Duration::from_secs(args.agent_call_secs),
            max_exec: Duration::from_secs(args.max_exec_secs),
            download_max: args.max_download_bytes,
            upload_max: args.max_upload_bytes,
            ..Bounds::default()
        },
        memory_reserve,
        host_memory: forkboxd::service::host_memory_available,
        images: None,
    };
    let egress_max = egress_max_bytes(max_live, log_max_total_mib)?;
    if let Listen::Unix(path) = &listen {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            bail!("{} is in use: another forkboxd is running", path.display());
        }
    }
    let store = match (args.no_state, args.state_dir) {
        (true, _) => None,
        (false, dir) => {
            let dir = match dir {
                Some(dir) => dir,
                None => state_dir_for(&listen, default)?,
            };
            Some(
                Store::open(&dir)
                    .with_context(|| format!("opening the state directory {}", dir.display()))?,
            )
        }
    };
    // Stored images (`forkbox image import`): the store forkbox shares,
    // under the cache; this daemon pins its templates' images there as
    // its state directory names it.
    let images_at = forkbox_host::cache::root().join("store");
    config.images = match forkbox_image::Store::open(&images_at) {
        Ok(images) => {
            let holder = match &store {
                Some(s) => format!("forkboxd {}", s.dir().display()),
                None => format!("forkboxd pid {}", std::process::id()),
            };
            Some((images, holder))
        }
        Err(e) => {
            tracing::warn!(
                "templates can name only the built-in images: the image store at {} cannot be opened: {e}",
                images_at.display()
            );
            None
        }
    };
    let egress = match &store {
        Some(store) => {
            let dir = store.egress_dir();
            EgressLogs::open(&dir, config.egress_log_ttl)
                .with_context(|| format!("opening the egress log directory {}", dir.display()))?
        }
        None => EgressLogs::temporary(config.egress_log_ttl)
            .context("making a temporary egress log directory")?,
    }
    .with_max_bytes(egress_max);
    if let Some(warning) = logs_outgrow_the_disk(egress.dir(), log_max_total_mib) {
        tracing::warn!("{warning}");
    }
    let backend = backend(config.images.as_ref().map(|(s, _)| s.clone()));
    let daemon = Daemon::with_store(backend, config, store.clone(), egress);
    if let Some(store) = &store {
        let (adopted, cleared) = daemon.recover();
        if adopted + cleared > 0 {
            tracing::info!(adopted, cleared, state = %store.dir().display(), "VMs of an earlier run");
        }
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(serve(daemon, listen, token))
}

/// The default state directory: beside the socket, one per socket, so
/// that two daemons never adopt each other's VMs; for TCP, in the default
/// socket's directory (never a name anyone could guess under `/tmp`).
fn state_dir_for(
    listen: &Listen,
    default_socket: impl FnOnce() -> Result<PathBuf, ListenError>,
) -> anyhow::Result<PathBuf> {
    Ok(match listen {
        Listen::Unix(path) => {
            let mut p = path.clone().into_os_string();
            p.push(".state");
            p.into()
        }
        Listen::Tcp(addr) => {
            let socket = default_socket().context(
                "no default state directory for tcp://: pass --state-dir DIR or --no-state",
            )?;
            let dir = socket
                .parent()
                .context("the default socket has no directory")?;
            dir.join(format!(
                "tcp-{}.state",
                addr.to_string().replace([':', '[', ']'], "_")
            ))
        }
    })
}

/// The default `--log-max-total-mib`: `max_live` sandboxes' serial and
/// egress logs at their caps, and 8 GiB for dead sandboxes' egress logs.
fn default_log_total_mib(max_live: usize) -> u64 {
    use forkbox_vmm_api::{EGRESS_LOG_MAX_BYTES, SERIAL_LOG_MAX_BYTES};
    let each = (SERIAL_LOG_MAX_BYTES + EGRESS_LOG_MAX_BYTES) >> 20;
    (max_live as u64).saturating_mul(each).saturating_add(8192)
}

/// What to say when the logs' budget is more than the disk under `dir`
/// has free: sandboxes that all flood their logs would fill it first.
fn logs_outgrow_the_disk(dir: &Path, log_max_total_mib: u64) -> Option<String> {
    let fs = rustix::fs::statvfs(dir).ok()?;
    let free_mib = fs.f_bavail.saturating_mul(fs.f_frsize) >> 20;
    (log_max_total_mib > free_mib).then(|| {
        format!(
            "sandboxes' logs may hold {log_max_total_mib} MiB at their caps, more than the \
             {free_mib} MiB free under {}: lower --max-live or --log-max-total-mib if the disk \
             must not fill",
            dir.display()
        )
    })
}

/// Open files each live sandbox may hold in the daemon (its VMM's pidfd,
/// control and agent connections, its network broker's sockets), with
/// room to spare.
const OPEN_FILES_PER_SANDBOX: u64 = 16;

/// Raises the daemon's open-file limit to what `max_live` sandboxes need;
/// returns the soft limit in force, having said so when it is short.
fn raise_open_files(max_live: usize) -> u64 {
    let need = (max_live as u64)
        .saturating_mul(OPEN_FILES_PER_SANDBOX)
        .saturating_add(1024);
    let raised = forkbox_host::open_files::raise_to(need);
    if raised < need {
        tracing::warn!(
            "the open-file limit is {raised}: {max_live} live sandboxes need about {need}; raise \
             it (`ulimit -Hn`, or LimitNOFILE= for a service) or lower --max-live"
        );
    }
    raised
}

/// What the egress log directory may hold: the total less the live
/// sandboxes' serial logs; an error when `max_live` sandboxes' logs at
/// their caps alone would not fit.
fn egress_max_bytes(max_live: usize, total_mib: u64) -> anyhow::Result<u64> {
    use forkbox_vmm_api::{EGRESS_LOG_MAX_BYTES, SERIAL_LOG_MAX_BYTES};
    let total = total_mib.saturating_mul(1 << 20);
    let live = (max_live as u64).saturating_mul(SERIAL_LOG_MAX_BYTES + EGRESS_LOG_MAX_BYTES);
    if live > total {
        bail!(
            "--max-live {max_live} sandboxes may hold {} MiB of logs at their caps, more than \
             --log-max-total-mib {total_mib}: raise --log-max-total-mib or lower --max-live",
            live >> 20
        );
    }
    Ok(total - (max_live as u64).saturating_mul(SERIAL_LOG_MAX_BYTES))
}

/// Whether we run as root (the owner of our own /proc entry; no unsafe
/// `geteuid` call needed).
fn is_root() -> bool {
    std::fs::metadata("/proc/self")
        .map(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0)
        .unwrap_or(false)
}

async fn serve(daemon: Daemon, listen: Listen, token: Option<String>) -> anyhow::Result<()> {
    let reaper = daemon.spawn_reaper();
    let app = forkboxd::api::router(daemon.clone(), token);
    let stop = shutdown_signal();
    match &listen {
        Listen::Unix(path) => {
            // `run` checked the directory, and that a file already at
            // `path` is a socket of ours.
            if path.exists() {
                if std::os::unix::net::UnixStream::connect(path).is_ok() {
                    bail!("{} is in use: another forkboxd is running", path.display());
                }
                std::fs::remove_file(path)
                    .with_context(|| format!("removing the stale socket {}", path.display()))?;
            }
            let listener = tokio::net::UnixListener::bind(path)
                .with_context(|| format!("listening on {}", path.display()))?;
            // Only the owner (and root) may drive sandboxes.
            std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o600))
                .context("restricting the socket's permissions")?;
            tracing::info!(listen = %listen, "forkboxd ready");
            axum::serve(listener, app)
                .with_graceful_shutdown(stop)
                .await
                .context("serving")?;
            let _ = std::fs::remove_file(path);
        }
        Listen::Tcp(addr) => {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("listening on {addr}"))?;
            tracing::info!(listen = %listen, "forkboxd ready");
            axum::serve(listener, app)
                .with_graceful_shutdown(stop)
                .await
                .context("serving")?;
        }
    }
    reaper.abort();
    tracing::info!("stopping every sandbox");
    daemon.shutdown().await;
    Ok(())
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_sized_from_the_host_hold_their_logs_and_files() {
        use forkboxd::service::{default_max_live, default_memory_reserve, MAX_LIVE_DEFAULT_CAP};
        let gib = |g: u64| g << 30;
        // 24 GiB less a 1.5 GiB reserve, at 8 MiB each.
        assert_eq!(
            default_max_live(gib(24), default_memory_reserve(gib(24))),
            2880
        );
        assert_eq!(default_max_live(gib(1), gib(2)), 16, "never below 16");
        assert_eq!(default_max_live(gib(1024), gib(2)), MAX_LIVE_DEFAULT_CAP);
        // The default log budget always holds the live sandboxes' logs.
        for live in [16, 64, 1025, MAX_LIVE_DEFAULT_CAP] {
            let total = default_log_total_mib(live);
            let egress = egress_max_bytes(live, total).expect("fits");
            assert_eq!(egress >> 20, total - live as u64 * 8, "{live}");
        }
        // A budget past the disk's free space is said, in one sentence.
        let dir = std::env::temp_dir();
        let said = logs_outgrow_the_disk(&dir, u64::MAX).expect("more than any disk");
        assert!(
            said.contains("--max-live") && !said.contains("  "),
            "{said}"
        );
        assert_eq!(logs_outgrow_the_disk(&dir, 0), None);
        // The soft limit ends at least what was there.
        let before = forkbox_host::open_files::limit();
        let soft = raise_open_files(16);
        assert!(soft >= before.min(16 * 16 + 1024));
        assert_eq!(forkbox_host::open_files::limit(), soft);
    }

    #[test]
    fn egress_max_bytes_leaves_room_for_live_logs_or_says_what_to_change() {
        assert_eq!(
            egress_max_bytes(64, 8192).expect("fits"),
            (8192 - 64 * 8) << 20
        );
        let e = egress_max_bytes(64, 1024).expect_err("too small");
        let msg = format!("{e:#}");
        assert!(
            msg.contains("4608 MiB") && msg.contains("--log-max-total-mib"),
            "{msg}"
        );
    }

    #[test]
    fn state_dir_for_tcp_is_in_the_runtime_dir_never_tmp() {
        let tcp = Listen::Tcp("127.0.0.1:7000".parse().expect("addr"));
        let dir = state_dir_for(&tcp, || default_socket(false, Some("/run/user/1000")))
            .expect("a default");
        assert_eq!(
            dir,
            PathBuf::from("/run/user/1000/forkbox/tcp-127.0.0.1_7000.state")
        );
        let e = state_dir_for(&tcp, || default_socket(false, None)).expect_err("no default");
        assert!(format!("{e:#}").contains("--state-dir"), "{e:#}");
        let unix = Listen::Unix("/srv/f.sock".into());
        assert_eq!(
            state_dir_for(&unix, || unreachable!()).expect("beside"),
            PathBuf::from("/srv/f.sock.state")
        );
    }
}
