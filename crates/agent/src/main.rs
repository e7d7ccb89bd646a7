//! forkbox-agent: PID 1 inside every forkbox microVM.
//!
//! Owns: boot-time init duties, reaping, and the protocol server on vsock
//! port `forkbox_proto::AGENT_PORT`. Depends only on `forkbox-proto`; no
//! other forkbox crate may depend on it (it is a guest binary).
//!
//! Modes:
//! - run as PID 1 (the initramfs's `/init`): boot, then serve on vsock;
//!   any fatal error is printed and the VM powered off (PID 1 must never
//!   exit: that panics the kernel);
//! - `forkbox-agent serve --listen unix:/path.sock`: serve on a unix socket
//!   with no init duties (tests on the host);
//! - `forkbox-agent serve --listen vsock:PORT`: serve on vsock, no init;
//! - `forkbox-agent container --listen unix:/path.sock [--net unix:/net.sock]`:
//!   PID 1 of a gVisor sandbox, on a socket the host mounted in, quiescing
//!   around each checkpoint (`container`); with `--net`, its `eth0`'s frames
//!   are served on the second socket to the host's gateway (`container_net`).
//!
//! Module map:
//! - `sys`: every syscall: rustix's safe calls where it has them, raw
//!   `libc` for the rest (the only unsafe code: the crate denies
//!   `unsafe_code`, and only `sys` is allowed it);
//! - `init`: mounts, modules, root overlay, switch root, hostname, `lo`;
//! - `reaper`: the single `wait` loop dispatching exit statuses;
//! - `server`: accept loop, handshake, request dispatch;
//! - `exec`: running commands with streamed I/O, caps and timeouts;
//! - `execs`: the table of running execs, and those a fork cut off;
//! - `background`: background processes' output buffer, stdin, wait,
//!   kill and reattach;
//! - `ports`: relaying a host connection to a guest TCP port;
//! - `fork`: the after-fork hook (clock, RNG reseed, cut-off execs);
//! - `files`: file and tar requests;
//! - `container`: serving a gVisor sandbox around its checkpoints;
//! - `container_net`: a gVisor sandbox's `eth0`, a TAP device whose frames
//!   go to the host's gateway.

#![deny(unsafe_code)]

mod background;
mod cgroup;
mod container;
mod container_net;
mod exec;
mod execs;
mod files;
mod fork;
mod init;
mod ports;
mod protect;
mod reaper;
mod server;
#[allow(unsafe_code)]
mod sys;

use std::io::Write;
use std::os::unix::net::UnixListener;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use forkbox_proto::{BootInfo, Hello, AGENT_PORT, PROTOCOL_VERSION};

use crate::reaper::Reaper;
use crate::server::{Agent, Listener, ShutdownAction};

const USAGE: &str =
    "usage: forkbox-agent serve --listen unix:PATH|vsock:PORT | container --listen unix:PATH [--net unix:PATH]";

static LOG_PREFIX: OnceLock<&'static str> = OnceLock::new();

/// Logs one line to stderr, which is the console when we are PID 1.
pub fn log(msg: &str) {
    let prefix = LOG_PREFIX.get().copied().unwrap_or("forkbox-agent");
    let _ = writeln!(std::io::stderr().lock(), "{prefix}: {msg}");
}

/// `error: cause: cause` on one line.
pub use forkbox_proto::error_chain as chain;

/// Carries out a shutdown request. Never returns.
pub fn shutdown(action: ShutdownAction) -> ! {
    sys::sync();
    match action {
        ShutdownAction::Exit => std::process::exit(0),
        ShutdownAction::PowerOff => power_off_forever(),
    }
}

fn power_off_forever() -> ! {
    sys::sync();
    loop {
        let e = sys::power_off();
        log(&format!("power off failed: {e}"));
        std::thread::sleep(std::time::Duration::from_secs(1));
    }
}

/// PID 1: print why, power off. Never exits the process.
fn fatal(msg: &str) -> ! {
    log(&format!("fatal: {msg}; powering off"));
    power_off_forever()
}

fn hello(boot: BootInfo) -> Hello {
    Hello {
        protocol_version: PROTOCOL_VERSION,
        agent_version: env!("CARGO_PKG_VERSION").to_string(),
        boot,
    }
}

fn run_pid1() -> ! {
    let start = Instant::now();
    // A panic on any thread must not end PID 1 silently; on the main
    // thread it reaches `fatal` through `catch_unwind` below.
    let outcome = std::panic::catch_unwind(|| -> Result<(), String> {
        let boot = init::boot(start).map_err(|e| chain(&e))?;
        let reaper = Reaper::start().map_err(|e| format!("start reaper: {e}"))?;
        let fd = sys::vsock_listen(AGENT_PORT)
            .map_err(|e| format!("listen on vsock port {AGENT_PORT}: {e}"))?;
        log(&format!(
            "serving on vsock port {AGENT_PORT} after {} ms",
            boot.boot_ms
        ));
        let agent = Arc::new(Agent {
            hello: hello(boot),
            reaper,
            execs: Default::default(),
            on_shutdown: ShutdownAction::PowerOff,
            gate: None,
        });
        server::serve(&Listener::Vsock(fd), &agent).map_err(|e| chain(&e))
    });
    match outcome {
        Ok(Ok(())) => fatal("server stopped"),
        Ok(Err(msg)) => fatal(&msg),
        Err(_) => fatal("panic in the main thread"),
    }
}

fn run_serve(listen: &str) -> Result<(), String> {
    let listener = if let Some(path) = listen.strip_prefix("unix:") {
        let _ = std::fs::remove_file(path);
        Listener::Unix(UnixListener::bind(path).map_err(|e| format!("bind {path}: {e}"))?)
    } else if let Some(port) = listen.strip_prefix("vsock:") {
        let port: u32 = port.parse().map_err(|_| format!("bad vsock port {port}"))?;
        Listener::Vsock(sys::vsock_listen(port).map_err(|e| format!("listen vsock {port}: {e}"))?)
    } else {
        return Err(format!("bad --listen {listen:?}\n{USAGE}"));
    };
    // Adopt orphans like PID 1 would, so the reaper sees the same world.
    if let Err(e) = sys::set_child_subreaper() {
        log(&format!("cannot become a subreaper: {e}"));
    }
    let reaper = Reaper::start().map_err(|e| format!("start reaper: {e}"))?;
    let agent = Arc::new(Agent {
        hello: hello(BootInfo {
            pid1: false,
            kernel: init::kernel_release(),
            ..BootInfo::default()
        }),
        reaper,
        execs: Default::default(),
        on_shutdown: ShutdownAction::Exit,
        gate: None,
    });
    server::serve(&listener, &agent).map_err(|e| chain(&e))
}

/// `container` mode: PID 1 of a gVisor sandbox (its `init` process), or
/// a process of any other container. No init duties: the sandbox's
/// runtime mounted its filesystems. Ending the agent ends the sandbox.
fn run_container(listen: &str, net: Option<&str>) -> Result<(), String> {
    let start = Instant::now();
    fn unix<'a>(arg: &'a str, flag: &str) -> Result<&'a std::path::Path, String> {
        arg.strip_prefix("unix:")
            .map(std::path::Path::new)
            .ok_or_else(|| format!("container mode's {flag} is unix:PATH, not {arg:?}"))
    }
    let path = unix(listen, "--listen")?;
    let net = net.map(|n| unix(n, "--net")).transpose()?;
    if std::process::id() != 1 {
        if let Err(e) = sys::set_child_subreaper() {
            log(&format!("cannot become a subreaper: {e}"));
        }
    }
    let reaper = Reaper::start().map_err(|e| format!("start reaper: {e}"))?;
    let gate = container::gate(path, net);
    if let Some(net) = net {
        container_net::start(net, &gate)?;
    }
    if std::process::id() == 1 {
        // The sandbox's console is the agent's own stderr (the host keeps
        // it as the sandbox's console log), open to root only, as a
        // microVM guest's `/dev/console` is.
        let _ = std::os::unix::fs::symlink("/proc/1/fd/2", "/dev/console");
    }
    let agent = Arc::new(Agent {
        hello: hello(BootInfo {
            pid1: std::process::id() == 1,
            kernel: init::kernel_release(),
            boot_ms: u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX),
            ..BootInfo::default()
        }),
        reaper,
        execs: Default::default(),
        on_shutdown: ShutdownAction::Exit,
        gate: Some(Arc::clone(&gate)),
    });
    log(&format!("serving on {}", path.display()));
    container::serve(path, &agent, &gate)
}

/// The `--listen` of `serve` or `container`, and `container`'s `--net`.
fn listen_arg(args: &[String]) -> Option<(String, Option<String>)> {
    match args {
        [flag, listen] if flag == "--listen" => Some((listen.clone(), None)),
        [flag, listen, net_flag, net] if flag == "--listen" && net_flag == "--net" => {
            Some((listen.clone(), Some(net.clone())))
        }
        [flag] => flag
            .strip_prefix("--listen=")
            .map(|l| (l.to_string(), None)),
        _ => None,
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // The guest's `/init` (the kernel may pass it words of its command
    // line): PID 1 in any way but `container` mode.
    if std::process::id() == 1 && args.first().map(String::as_str) != Some("container") {
        let _ = LOG_PREFIX.set("forkbox-agent");
        run_pid1();
    }
    let (container, listen) = match args.split_first() {
        Some((cmd, rest)) if cmd == "serve" || cmd == "container" => {
            (cmd == "container", listen_arg(rest))
        }
        _ => (false, None),
    };
    let Some((listen, net)) = listen.filter(|(_, net)| container || net.is_none()) else {
        eprintln!("{USAGE}");
        std::process::exit(2);
    };
    let outcome = if container {
        let _ = LOG_PREFIX.set("forkbox-agent");
        std::panic::catch_unwind(|| run_container(&listen, net.as_deref()))
            .unwrap_or_else(|_| Err("panic in the main thread".into()))
    } else {
        run_serve(&listen)
    };
    if let Err(e) = outcome {
        log(&e);
        std::process::exit(1);
    }
}
