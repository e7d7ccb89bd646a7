//! The memory-isolation check (docs/SPEC.md, "Fork reliability"): a guest
//! process writes a counter into each of 4096 pages, in page order, round
//! after round, so that at any instant its memory is round r on pages
//! [0, k) and r-1 on [k, 4096). A fork child's copy must be one such
//! instant, and nothing a child writes may reach its parent. Used by the
//! VM suite (small) and `forkbox bench isolation` (thousands of forks).
//!
//! The writer is Python (the `debian` image). SIGUSR1 makes it check its
//! own memory between two page writes and write a verdict; SIGUSR2 makes
//! it write a marker no round reaches into every page and stop writing.

use forkbox_proto::client::AgentClient;
use forkbox_proto::ExecRequest;

/// The writer (see the module's doc).
const WRITER: &str = r#"
import mmap, os, signal, sys
N, PAGE, MARK = 4096, 4096, 1 << 62
mem = mmap.mmap(-1, N * PAGE)
state = {"r": 0, "p": 0, "marked": False}
def word(p):
    return int.from_bytes(mem[p * PAGE:p * PAGE + 8], "little")
def verify(signum, frame):
    v = [word(p) for p in range(N)]
    r = max(v)
    bad = [p for p in range(N) if v[p] not in (r, r - 1)]
    steps = [p for p in range(1, N) if v[p] != v[p - 1]]
    ok = not bad and len(steps) <= 1 and (not steps or v[steps[0] - 1] == r) and r < MARK
    msg = "ok %d %d" % (r, steps[0] if steps else N) if ok else "BAD max %d pages %s steps %s" % (r, bad[:8], steps[:8])
    with open("/tmp/verdict.new", "w") as f:
        print(msg, file=f)
    os.rename("/tmp/verdict.new", "/tmp/verdict")
def mark(signum, frame):
    state["marked"] = True
    for p in range(N):
        mem[p * PAGE:p * PAGE + 8] = (MARK + os.getpid()).to_bytes(8, "little")
    with open("/tmp/marked", "w") as f:
        print("marked", file=f)
signal.signal(signal.SIGUSR1, verify)
signal.signal(signal.SIGUSR2, mark)
with open("/tmp/writer.pid", "w") as f:
    f.write(str(os.getpid()))
while True:
    if state["marked"]:
        signal.pause()
        continue
    state["r"] += 1
    b = state["r"].to_bytes(8, "little")
    for p in range(N):
        if state["marked"]:
            break
        mem[p * PAGE:p * PAGE + 8] = b
    if state["r"] == 2:
        open("/tmp/writer.ready", "w").close()
"#;

/// What the writer found in its memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// One instant: rounds `round` on pages [0, `page`), `round - 1` after.
    Consistent { round: u64, page: u64 },
    /// Anything else, as the writer described it (pages and steps).
    Inconsistent(String),
}

impl Verdict {
    fn parse(text: &str) -> Self {
        let words: Vec<&str> = text.split_whitespace().collect();
        match words[..] {
            ["ok", r, p] => match (r.parse(), p.parse()) {
                (Ok(round), Ok(page)) => Verdict::Consistent { round, page },
                _ => Verdict::Inconsistent(text.trim().to_owned()),
            },
            _ => Verdict::Inconsistent(text.trim().to_owned()),
        }
    }

    pub fn is_consistent(&self) -> bool {
        matches!(self, Verdict::Consistent { .. })
    }
}

/// Longest a step of the check may take in a guest (reading 4096 pages
/// takes seconds in the emulated host): a guest that stops answering fails
/// the check instead of holding its caller.
const STEP_LIMIT: std::time::Duration = std::time::Duration::from_secs(300);

/// Runs `script` in the guest, within [`STEP_LIMIT`]; its stdout, or why
/// it failed.
fn sh(agent: &AgentClient, script: &str) -> Result<String, String> {
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let r = agent
        .clone()
        .with_call_timeout(STEP_LIMIT)
        .exec(
            &ExecRequest::shell(script),
            None,
            &mut |stream, b| match stream {
                forkbox_proto::OutputStream::Stdout => out.extend_from_slice(b),
                forkbox_proto::OutputStream::Stderr => err.extend_from_slice(b),
            },
        )
        .map_err(|e| forkbox_proto::error_chain(&e))?;
    if !r.success() {
        return Err(format!(
            "{r:?}: {}{}",
            String::from_utf8_lossy(&out),
            String::from_utf8_lossy(&err)
        ));
    }
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// Starts the writer in the guest (which must have python3) and waits
/// (up to 2 minutes) until it has written two rounds.
pub fn start_writer(agent: &AgentClient) -> Result<(), String> {
    sh(
        agent,
        &format!(
            "cat > /tmp/writer.py <<'EOF'\n{WRITER}\nEOF\n\
             nohup python3 /tmp/writer.py >/tmp/writer.log 2>&1 &\n\
             for i in $(seq 1200); do [ -f /tmp/writer.ready ] && exit 0; sleep 0.1; done; cat /tmp/writer.log; exit 1"
        ),
    )
    .map(drop)
    .map_err(|e| format!("the pattern writer did not start: {e}"))
}

/// Asks the writer to check its memory (it answers within a minute).
pub fn verdict(agent: &AgentClient) -> Result<Verdict, String> {
    sh(
        agent,
        "rm -f /tmp/verdict; kill -USR1 $(cat /tmp/writer.pid); \
         for i in $(seq 600); do [ -f /tmp/verdict ] && break; sleep 0.1; done; cat /tmp/verdict",
    )
    .map(|text| Verdict::parse(&text))
}

/// Makes the writer mark every page (a value no round reaches) and stop;
/// returns once it has.
pub fn mark(agent: &AgentClient) -> Result<(), String> {
    sh(
        agent,
        "kill -USR2 $(cat /tmp/writer.pid); for i in $(seq 600); do [ -f /tmp/marked ] && exit 0; sleep 0.1; done; exit 1",
    )
    .map(drop)
    .map_err(|e| format!("the pattern writer did not mark its pages: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdicts_parse_consistent_only_from_the_ok_line() {
        assert_eq!(
            Verdict::parse("ok 17 2048\n"),
            Verdict::Consistent {
                round: 17,
                page: 2048
            }
        );
        assert!(!Verdict::parse("BAD max 9 pages [3] steps [1, 3]").is_consistent());
        assert!(!Verdict::parse("").is_consistent());
        assert!(!Verdict::parse("ok x 1").is_consistent());
    }
}
