//! `forkbox bench net`: the sandbox network between a guest and the host's
//! loopback, in one booted `debian` VM (python3 in the guest: busybox `nc`
//! writes 1 KiB at a time and would measure itself).
//!
//! The servers run here, on 127.0.0.1; the VM's policy allows exactly
//! their ports at `host.forkbox.internal` (the gateway, 10.0.2.2), and one
//! more loopback server stays off the list for the denied figure.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::{calibrate, percentile, progress, Stats};
use anyhow::Context;
use forkbox_host::image::ImageName;
use forkbox_host::testbed::Environment;
use forkbox_host::vm::{Assets, Vm, VmSpec};
use forkbox_net::policy::Policy;
use forkbox_proto::{ExecRequest, OutputStream};
use serde_json::{json, Value};

#[derive(clap::Args)]
pub struct Options {
    #[arg(long)]
    pub json: bool,
    /// MiB moved per throughput run, each way.
    #[arg(long, default_value_t = 64)]
    pub mib: u32,
    /// Throughput runs each way.
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    /// Connections the guest opens and closes to an allowed server.
    #[arg(long, default_value_t = 200)]
    pub connects: usize,
    /// Connection attempts to a loopback port the policy denies.
    #[arg(long, default_value_t = 50)]
    pub denied_connects: usize,
}

/// What one guest command may take before it is killed: 64 MiB at the
/// slowest rate seen in EMU (~3 Mbit/s) is about three minutes.
const EXEC_LIMIT: Duration = Duration::from_secs(900);

/// Guest → host: `sendall` of MIB × 1 MiB, half-close, print the server's
/// count.
const SEND: &str = "
import socket, sys
mib, port = int(sys.argv[1]), int(sys.argv[2])
buf = b'\\0' * (1 << 20)
s = socket.create_connection(('10.0.2.2', port))
for _ in range(mib):
    s.sendall(buf)
s.shutdown(socket.SHUT_WR)
print(s.recv(64).decode().strip())
";

/// Host → guest: read to EOF; print bytes and seconds from the first
/// byte to the last.
const RECEIVE: &str = "
import socket, sys, time
port = int(sys.argv[1])
m = memoryview(bytearray(1 << 20))
s = socket.create_connection(('10.0.2.2', port))
got, t0, t1 = 0, None, None
while True:
    k = s.recv_into(m)
    if not k:
        break
    t1 = time.perf_counter()
    if t0 is None:
        t0 = t1
    got += k
print(got, (t1 - t0) if t0 is not None else 0.0)
";

/// Connect latency: `connect()` timed with `perf_counter` for each of K
/// connections to the allowed server (closed at once), then for DK
/// attempts at the denied port; one JSON line of seconds.
const CONNECT: &str = "
import json, socket, sys, time
port, k, dport, dk = (int(a) for a in sys.argv[1:5])
ok = []
for _ in range(k):
    s = socket.socket()
    t = time.perf_counter()
    s.connect(('10.0.2.2', port))
    ok.append(time.perf_counter() - t)
    s.close()
denied, errors = [], {}
for _ in range(dk):
    s = socket.socket()
    s.settimeout(20)
    t = time.perf_counter()
    try:
        s.connect(('10.0.2.2', dport))
        e = 'connected'
    except OSError as x:
        e = type(x).__name__
    denied.append(time.perf_counter() - t)
    errors[e] = errors.get(e, 0) + 1
    s.close()
print(json.dumps({'ok': ok, 'denied': denied, 'errors': errors}))
";

/// Runs `python3 -c script args…` in the guest; its stdout.
fn python(vm: &Vm, script: &str, args: &[String]) -> anyhow::Result<String> {
    let mut argv = vec!["python3".to_owned(), "-c".to_owned(), script.to_owned()];
    argv.extend_from_slice(args);
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let r = vm
        .agent()
        .exec(
            &ExecRequest::argv(argv).timeout(EXEC_LIMIT),
            None,
            &mut |stream, b| match stream {
                OutputStream::Stdout => out.extend_from_slice(b),
                OutputStream::Stderr => err.extend_from_slice(b),
            },
        )
        .context("running python3 in the guest")?;
    anyhow::ensure!(
        r.success(),
        "python3 in the guest failed: {r:?}\nstderr: {}\negress log (last 5): {:?}",
        String::from_utf8_lossy(&err),
        vm.egress_log(5)
    );
    Ok(String::from_utf8_lossy(&out).into_owned())
}

fn loopback() -> anyhow::Result<(TcpListener, u16)> {
    let l = TcpListener::bind("127.0.0.1:0").context("binding a loopback server")?;
    let port = l.local_addr()?.port();
    Ok((l, port))
}

/// Bytes counted and the time from the first byte to the last.
type Counted = std::io::Result<(u64, Duration)>;

/// Counts each connection's bytes to EOF, answers the count, reports it.
fn sink(l: TcpListener, tx: mpsc::Sender<Counted>) {
    fn one(mut c: TcpStream) -> Counted {
        let mut buf = vec![0u8; 1 << 20];
        let (mut n, mut first, mut last) = (0u64, None, None);
        loop {
            let k = c.read(&mut buf)?;
            if k == 0 {
                break;
            }
            let now = Instant::now();
            first.get_or_insert(now);
            last = Some(now);
            n += k as u64;
        }
        c.write_all(format!("{n}\n").as_bytes())?;
        let took = match (first, last) {
            (Some(f), Some(l)) => l - f,
            _ => Duration::ZERO,
        };
        Ok((n, took))
    }
    for c in l.incoming() {
        let r = c.and_then(one);
        if tx.send(r).is_err() {
            return;
        }
    }
}

/// Writes `bytes` to each connection in 1 MiB writes, then closes it.
fn source(l: TcpListener, bytes: u64) {
    let buf = vec![0u8; 1 << 20];
    for c in l.incoming() {
        let Ok(mut c) = c else { continue };
        let mut left = bytes;
        while left > 0 {
            let k = left.min(buf.len() as u64) as usize;
            if c.write_all(&buf[..k]).is_err() {
                break;
            }
            left -= k as u64;
        }
    }
}

/// Accepts and drops every connection.
fn acceptor(l: TcpListener) {
    for c in l.incoming() {
        drop(c);
    }
}

fn mbit_s(bytes: u64, d: Duration) -> f64 {
    bytes as f64 * 8.0 / d.as_secs_f64().max(1e-9) / 1e6
}

/// p50 (nearest rank) and best of a set of rates.
fn rate_json(mib: u32, rates: &[f64]) -> Value {
    let mut sorted = rates.to_vec();
    sorted.sort_by(f64::total_cmp);
    json!({
        "mib": mib, "runs": rates.len(),
        "mbit_s_p50": percentile(&sorted, 50.0),
        "mbit_s_best": sorted.last().copied().unwrap_or(f64::NAN),
        "mbit_s_runs": rates,
    })
}

fn seconds(v: &Value, key: &str) -> anyhow::Result<Vec<Duration>> {
    v[key]
        .as_array()
        .with_context(|| format!("no `{key}` in the guest's answer"))?
        .iter()
        .map(|s| {
            s.as_f64()
                .map(Duration::from_secs_f64)
                .context("not a number of seconds")
        })
        .collect()
}

pub fn run(o: &Options) -> anyhow::Result<Value> {
    let env = Environment::detect();
    let assets = Assets::prepare()?;
    let bytes = u64::from(o.mib) << 20;
    let (up, up_port) = loopback()?;
    let (down, down_port) = loopback()?;
    let (open, open_port) = loopback()?;
    // Off the allowlist: the guest's attempts must never reach it.
    let (denied, denied_port) = loopback()?;
    denied.set_nonblocking(true)?;
    let (tx, counted) = mpsc::channel();
    std::thread::spawn(move || sink(up, tx));
    std::thread::spawn(move || source(down, bytes));
    std::thread::spawn(move || acceptor(open));

    let rules: Vec<String> = [up_port, down_port, open_port]
        .iter()
        .map(|p| format!("host.forkbox.internal:{p}"))
        .collect();
    let policy = Policy::from_json(&json!({ "allow_out": rules }).to_string())
        .context("the bench's policy")?;
    let spec = VmSpec {
        image: ImageName::Debian.into(),
        network: Some(policy.clone().into()),
        ..VmSpec::default()
    };
    eprintln!("forkbox bench net: booting a `debian` microVM with a network");
    let vm = Vm::boot(&assets, &spec).context("booting the microVM with a network")?;

    // Guest → host, timed by the host's server.
    let mut up_rates = Vec::new();
    for i in 0..o.runs {
        let out = python(&vm, SEND, &[o.mib.to_string(), up_port.to_string()])?;
        let (n, took) = counted
            .recv_timeout(Duration::from_secs(60))
            .context("the host's server reported no transfer")?
            .context("the host's server")?;
        anyhow::ensure!(
            n == bytes && out.trim() == n.to_string(),
            "guest → host moved {n} of {bytes} bytes (the guest read {:?})",
            out.trim()
        );
        up_rates.push(mbit_s(n, took));
        progress("net", "guest → host", i + 1, o.runs);
    }

    // Host → guest, timed by the guest.
    let mut down_rates = Vec::new();
    for i in 0..o.runs {
        let out = python(&vm, RECEIVE, &[down_port.to_string()])?;
        let mut fields = out.split_whitespace();
        let n: u64 = fields.next().and_then(|f| f.parse().ok()).unwrap_or(0);
        let secs: f64 = fields.next().and_then(|f| f.parse().ok()).unwrap_or(0.0);
        anyhow::ensure!(
            n == bytes && secs > 0.0,
            "host → guest: the guest read {:?}, not {bytes} bytes",
            out.trim()
        );
        down_rates.push(mbit_s(n, Duration::from_secs_f64(secs)));
        progress("net", "host → guest", i + 1, o.runs);
    }

    // Connect latency, allowed and denied, timed in the guest.
    eprintln!(
        "forkbox bench net: {} connects, {} denied attempts",
        o.connects, o.denied_connects
    );
    let out = python(
        &vm,
        CONNECT,
        &[
            open_port.to_string(),
            o.connects.to_string(),
            denied_port.to_string(),
            o.denied_connects.to_string(),
        ],
    )?;
    let v: Value = serde_json::from_str(out.trim())
        .with_context(|| format!("the guest's connect figures: {out:?}"))?;
    let ok = Stats::from_durations(&seconds(&v, "ok")?);
    let no = Stats::from_durations(&seconds(&v, "denied")?);
    let errors = v["errors"].clone();
    anyhow::ensure!(
        errors.get("connected").is_none(),
        "a denied connect succeeded: {errors}"
    );
    anyhow::ensure!(
        matches!(denied.accept(), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "a denied connect reached the host"
    );

    let c = calibrate();
    Ok(json!({
        "bench": "net", "environment": env.label(),
        "image": "debian", "vcpus": spec.vcpus, "memory_mib": spec.memory_mib,
        "guest_to_host": rate_json(o.mib, &up_rates),
        "host_to_guest": rate_json(o.mib, &down_rates),
        "connect": ok.json(),
        "denied_connect": { "errors": errors, "stats": no.json() },
        "loop_ns_per_iter": c.loop_ns_per_iter, "fork_exec_us": c.fork_exec_us,
        "connect_p50_in_fork_execs": ok.p50_ms * 1000.0 / c.fork_exec_us,
    }))
}

/// The human table.
pub fn print(r: &Value) {
    let f = |v: &Value| v.as_f64().map_or("-".to_owned(), |x| format!("{x:.1}"));
    println!(
        "bench net ({}; `debian`, 1 vCPU)",
        r["environment"].as_str().unwrap_or("-")
    );
    for (what, key) in [
        ("guest → host", "guest_to_host"),
        ("host → guest", "host_to_guest"),
    ] {
        let t = &r[key];
        println!(
            "  {what}, {} MiB: p50 {} Mbit/s, best {} ({} runs)",
            t["mib"],
            f(&t["mbit_s_p50"]),
            f(&t["mbit_s_best"]),
            t["runs"]
        );
    }
    let ms = |s: &Value| {
        format!(
            "p50 {} ms, p99 {} ms, min {} ({} runs)",
            f(&s["p50_ms"]),
            f(&s["p99_ms"]),
            f(&s["min_ms"]),
            s["runs"]
        )
    };
    println!("  connect, allowed: {}", ms(&r["connect"]));
    println!(
        "  connect, denied (refused): {}, errors {}",
        ms(&r["denied_connect"]["stats"]),
        r["denied_connect"]["errors"]
    );
    println!(
        "  calibration: loop {} ns/iter, fork+exec {} µs; connect p50 = {} fork+execs",
        f(&r["loop_ns_per_iter"]),
        f(&r["fork_exec_us"]),
        f(&r["connect_p50_in_fork_execs"])
    );
}
