//! `forkbox demo` (what `make demo` runs): one GRPO-style step through the
//! daemon, as a training loop would drive it.
//!
//! It starts a forkboxd of its own, bakes a `debian` template with Python
//! warmed (setup starts a small HTTP server; the readiness check imports a
//! few stdlib modules and fetches a page from it), creates one sandbox from
//! the template (the prompt's state), forks it into a group, gives every
//! member a different small task and a candidate solution, grades each
//! with a grader that was in the template, kills the group and prints the
//! figures a practitioner asks for first.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::json;

use crate::bench::Stats;
use crate::local_daemon::{calls, LocalDaemon};
use forkbox_host::measure::{mem_available_kib, pss_kib};

/// The demo's knobs (`forkbox demo --group N`).
#[derive(Debug, Clone, clap::Args)]
pub struct Options {
    /// Sandboxes in the group (default 64; 16 inside the emulated host,
    /// whose own kernel has crashed under 64 busy guests).
    #[arg(long)]
    pub group: Option<usize>,
    /// Concurrent clients running the group's commands.
    #[arg(long, default_value_t = 16)]
    pub clients: usize,
}

const TEMPLATE: &str = "demo-python";

/// The warm Python of the template: a small HTTP server started by the
/// template's setup, modules imported, paused inside the zygote, so every
/// fork has it running already. It serves `/` (the readiness check),
/// `/run?n=N` (runs /tmp/solution.py on task N in an `os.fork()` of
/// itself: no interpreter start-up) and `/grade?n=N` (the grader: it
/// recomputes the answer its own way and says the reward). Once it
/// listens it prints its port on stdout (the template's `runner.log`).
const RUNNER: &str = r#"import collections, fractions, http.server, json, os, pathlib, re, urllib.parse

def reference(n):
    return sum(1 for k in range(2, n) if all(k % d for d in range(2, int(k ** 0.5) + 1)))

class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def answer(self, text):
        body = (text + "\n").encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        url = urllib.parse.urlparse(self.path)
        q = dict(urllib.parse.parse_qsl(url.query))
        if url.path == "/":
            return self.answer("forkbox")
        n = int(q.get("n", "0"))
        if url.path == "/run":
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    exec(pathlib.Path("/tmp/solution.py").read_text(), {"n": n})
                except BaseException:
                    code = 1
                os._exit(code)
            _, status = os.waitpid(pid, 0)
            return self.answer("ran" if status == 0 else "crashed")
        if url.path == "/grade":
            try:
                got = int(pathlib.Path("/tmp/answer").read_text())
            except (OSError, ValueError):
                got = None
            return self.answer("1.0" if got == reference(n) else "0.0")
        self.send_error(404)

server = http.server.HTTPServer(("127.0.0.1", 8000), Handler)
# Listening: says so with its port (the unit test's runner binds port 0).
print(server.server_address[1], flush=True)
server.serve_forever()
"#;

/// Candidate solutions to "count the primes below n", as a policy might
/// sample them: most right, one in eight that counts 1 as a prime, one in
/// eight that forgets 2.
fn solution(member: usize) -> &'static str {
    match member % 8 {
        3 => {
            "import pathlib\ns = [1] * n; s[0] = 0\n\
             for i in range(2, int(n ** 0.5) + 1):\n    s[i*i::i] = [0] * len(s[i*i::i])\n\
             pathlib.Path('/tmp/answer').write_text(str(sum(s)))\n"
        }
        6 => {
            "import pathlib\n\
             c = sum(1 for k in range(3, n, 2) if all(k % d for d in range(3, int(k ** 0.5) + 1, 2)))\n\
             pathlib.Path('/tmp/answer').write_text(str(c))\n"
        }
        _ => {
            "import pathlib\ns = [1] * n; s[0] = s[1] = 0\n\
             for i in range(2, int(n ** 0.5) + 1):\n    s[i*i::i] = [0] * len(s[i*i::i])\n\
             pathlib.Path('/tmp/answer').write_text(str(sum(s)))\n"
        }
    }
}

/// Single-quotes `s` for `/bin/sh`.
fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// A shell command that asks the warm runner for `path` and prints the
/// answer's body (bash's /dev/tcp: no client program to start).
fn ask_runner(path: &str) -> String {
    format!(
        "bash -c 'exec 3<>/dev/tcp/127.0.0.1/8000 && printf \"GET {path} HTTP/1.0\\r\\n\\r\\n\" >&3 && tail -n 1 <&3'"
    )
}

fn template_spec() -> serde_json::Value {
    json!({
        "name": TEMPLATE,
        "image": "debian",
        "vcpus": 1,
        "memory_mib": 512,
        "setup": [
            format!("mkdir -p /opt/demo && printf '%s' {} > /opt/demo/runner.py", sh_quote(RUNNER)),
            "cd /opt/demo && setsid python3 runner.py </dev/null >/opt/demo/runner.log 2>&1 &",
        ],
        "ready": { "command": ask_runner("/") + " | grep -qx forkbox" },
        "ready_timeout_secs": 120,
    })
}

/// One member's outcome.
struct Member {
    reward: f64,
    execs: Vec<Duration>,
}

pub fn run(o: &Options) -> anyhow::Result<()> {
    let total = Instant::now();
    let emulated = forkbox_host::testbed::Environment::detect()
        == forkbox_host::testbed::Environment::EmulatedHost;
    let n = match o.group {
        Some(n) => n.clamp(1, 256),
        None if emulated => {
            println!(
                "forkbox demo: a group of 16 inside the emulated host (one emulated CPU runs them \
                 all); `--group 64` asks for the full size"
            );
            16
        }
        None => 64,
    };
    println!("forkbox demo: starting a forkboxd of our own");
    let daemon = LocalDaemon::start(&[
        "--max-live".into(),
        (n + 8).to_string(),
        "--create-wait".into(),
        "600".into(),
    ])?;
    let client = daemon.client()?;

    println!("forkbox demo: baking `{TEMPLATE}` (debian, Python warmed, an HTTP server up)");
    let bake_ms = calls::bake(&client, &template_spec(), &mut |step, detail| {
        let detail: String = detail.chars().take(70).collect();
        println!("  bake: {step:<9} {detail}");
    })
    .with_context(|| {
        format!(
            "baking the demo template; daemon log:\n{}",
            daemon.log_tail(20)
        )
    })?;

    let labels = json!({ "demo": "grpo" });
    let t = Instant::now();
    let prompt = calls::create(&client, TEMPLATE, &labels)?;
    let create_to_ready = t.elapsed();
    let t = Instant::now();
    let first = calls::exec(&client, &prompt.id, "python3 -c 'print(6 * 7)'")?;
    let first_exec = t.elapsed();
    anyhow::ensure!(
        first.stdout.trim() == "42",
        "the prompt sandbox answered {first:?}"
    );

    println!("forkbox demo: forking the prompt's sandbox into a group of {n}");
    let mem_before = mem_available_kib();
    let t = Instant::now();
    let children = calls::fork(&client, &prompt.id, n)?;
    let fork_wall = t.elapsed();
    let mem_after = mem_available_kib();
    let mut group = Vec::new();
    let mut fork_ms = Vec::new();
    let mut not_started = 0;
    for (i, c) in children.into_iter().enumerate() {
        match c {
            Ok(s) => {
                fork_ms.push(Duration::from_millis(s.create_ms.unwrap_or(0)));
                group.push((i, s));
            }
            Err(e) => {
                not_started += 1;
                println!("  member {i} did not start (infrastructure, not scored): {e}");
            }
        }
    }
    let pss: Vec<u64> = group
        .iter()
        .filter_map(|(_, s)| s.metrics.as_ref()?.vmm_pid)
        .filter_map(pss_kib)
        .collect();

    println!("forkbox demo: every member solves its own task, then the grader scores it");
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<(usize, anyhow::Result<Member>)>> = Mutex::new(Vec::new());
    let step = Instant::now();
    std::thread::scope(|scope| {
        for _ in 0..o.clients.clamp(1, 64) {
            scope.spawn(|| {
                let client = match daemon.client() {
                    Ok(c) => c,
                    Err(e) => {
                        results
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .push((usize::MAX, Err(e)));
                        return;
                    }
                };
                loop {
                    let k = next.fetch_add(1, Ordering::Relaxed);
                    let Some((i, s)) = group.get(k) else { break };
                    let r = member(&client, &s.id, *i);
                    results
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push((*i, r));
                }
            });
        }
    });
    let step_wall = step.elapsed();
    let killed = calls::kill_label(&client, "demo", "grpo")?;

    let mut rewards = 0.0;
    let mut execs = Vec::new();
    let mut failed = 0;
    for (i, r) in results.into_inner().unwrap_or_else(|p| p.into_inner()) {
        match r {
            Ok(m) => {
                rewards += m.reward;
                execs.extend(m.execs);
            }
            Err(e) => {
                failed += 1;
                println!("  member {i} failed (infrastructure, not scored): {e:#}");
            }
        }
    }
    let fork = Stats::from_durations(&fork_ms);
    let exec = Stats::from_durations(&execs);
    let scored = group.len() - failed;
    let failures = not_started + failed;
    println!();
    println!("forkbox demo: one GRPO step, {n} sandboxes forked from a warm `debian` zygote");
    println!(
        "  environment               {}",
        forkbox_host::testbed::Environment::detect().label()
    );
    println!(
        "  bake (boot+setup+ready)   {:.1} s",
        bake_ms as f64 / 1000.0
    );
    println!(
        "  create from template      {:.0} ms to ready, first command {:.0} ms later",
        ms(create_to_ready),
        ms(first_exec)
    );
    println!(
        "  fork {n:<3} (one request)    wall {:.0} ms; per member to ready p50 {:.0} ms, p99 {:.0} ms",
        ms(fork_wall),
        fork.p50_ms,
        fork.p99_ms
    );
    println!(
        "  exec (run, grade)        p50 {:.0} ms, p99 {:.0} ms over {} commands",
        exec.p50_ms, exec.p99_ms, exec.runs
    );
    println!(
        "  rewards                   {rewards:.0} of {scored} members solved their task ({failures} infrastructure failures: {not_started} did not start, {failed} failed during the step)"
    );
    if let (Some(before), Some(after)) = (mem_before, mem_after) {
        println!(
            "  host memory per member    {:.1} MiB (host MemAvailable drop / {n}), {:.1} MiB PSS of its VMM",
            before.saturating_sub(after) as f64 / 1024.0 / n as f64,
            pss.iter().sum::<u64>() as f64 / 1024.0 / pss.len().max(1) as f64
        );
    }
    println!(
        "  group step (all commands) {:.1} s with {} clients",
        step_wall.as_secs_f64(),
        o.clients
    );
    println!("  killed                    {killed} sandboxes (the group and the prompt)");
    println!(
        "  total wall                {:.1} s",
        total.elapsed().as_secs_f64()
    );
    anyhow::ensure!(
        failures == 0 && group.len() == n,
        "{failures} of {n} members failed (infrastructure); see above"
    );
    Ok(())
}

/// The member's candidate solution written in, run by the warm runner,
/// then graded: one file write and two commands through the daemon.
fn member(client: &crate::client::Client, id: &str, i: usize) -> anyhow::Result<Member> {
    let n = 1000 + 37 * i;
    let mut execs = Vec::new();
    let mut timed = |cmd: &str| -> anyhow::Result<calls::Output> {
        let t = Instant::now();
        let out = calls::exec(client, id, cmd)?;
        execs.push(t.elapsed());
        Ok(out)
    };
    let go = (|| {
        calls::write_file(client, id, "/tmp/solution.py", solution(i).as_bytes())?;
        // A wrong or crashing solution is the policy's problem: it scores 0.
        timed(&ask_runner(&format!("/run?n={n}")))?;
        let grade = timed(&ask_runner(&format!("/grade?n={n}")))?;
        grade.stdout.trim().parse::<f64>().with_context(|| {
            format!(
                "the grader answered {:?} ({:?})",
                grade.stdout, grade.stderr
            )
        })
    })();
    match go {
        Ok(reward) => Ok(Member { reward, execs }),
        // Say why the sandbox is gone, if it is.
        Err(e) => Err(match calls::death(client, id) {
            Some(death) => e.context(format!("sandbox {id} died: {death}")),
            None => e,
        }),
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A child process killed and reaped when dropped, so that a failed
    /// test leaves no runner behind.
    struct Reaped(std::process::Child);

    impl Drop for Reaped {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    #[test]
    fn runner_grades_right_and_wrong_solutions() {
        use std::io::{BufRead, BufReader};
        use std::process::{Command, Stdio};

        // The runner and solutions with the host's python3, on a loopback
        // port the runner picks and announces on its stdout once it
        // listens: asked after that, it answers the first time.
        let dir = tempfile::tempdir().expect("tempdir");
        let d = dir.path().display().to_string();
        let in_dir = |s: &str| s.replace("/tmp/", &format!("{d}/"));
        let runner = in_dir(RUNNER).replace("8000", "0");
        std::fs::write(dir.path().join("runner.py"), runner).expect("runner");
        let mut server = Reaped(
            Command::new("python3")
                .arg(dir.path().join("runner.py"))
                .stdout(Stdio::piped())
                .spawn()
                .expect("python3 is needed (make deps installs it)"),
        );
        let mut listening = String::new();
        BufReader::new(server.0.stdout.take().expect("the runner's stdout"))
            .read_line(&mut listening)
            .expect("read the runner's stdout");
        let port: u16 = listening
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("the runner ended or did not say its port: {listening:?}"));
        let ask = |path: &str| -> String {
            let out = Command::new("sh")
                .arg("-c")
                .arg(ask_runner(path).replace("8000", &port.to_string()))
                .output()
                .expect("run sh");
            assert!(
                out.status.success(),
                "asking the runner for {path}: {out:?}"
            );
            String::from_utf8_lossy(&out.stdout).trim().to_owned()
        };
        assert_eq!(ask("/"), "forkbox");
        let grade = |i: usize| -> String {
            std::fs::write(dir.path().join("solution.py"), in_dir(solution(i))).expect("solution");
            let n = 1000 + 37 * i;
            assert_eq!(ask(&format!("/run?n={n}")), "ran");
            ask(&format!("/grade?n={n}"))
        };
        assert_eq!([grade(0), grade(3), grade(6)], ["1.0", "0.0", "0.0"]);
    }
}
