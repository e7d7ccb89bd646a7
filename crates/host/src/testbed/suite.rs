//! Running a suite of tests where this machine cannot run microVMs: the
//! tests are split between one-CPU emulated hosts side by side, each shard
//! survives its host's own crash or wedge by resuming in a new host with
//! the tests that had not ended, and every test's start and end are
//! recorded in a ledger shared with this machine.
//!
//! Two suites speak this protocol: the VM trials (the Rust harness in
//! `crates/forkbox/tests/vm`, which splits by [`Suite`]) and the Python
//! SDK's pytest suite (`sdk/python/tests/conftest.py`, through `forkbox
//! testbed run --shards`). A shard's command finds its place in
//! [`SHARD_ENV`] (`i/n`) and its ledger in [`LEDGER_ENV`]; it runs only its
//! share, leaves out what the ledger says ended, and appends to it. Why
//! one CPU per host: with two emulated CPUs the emulated host's KVM lost a
//! few guests in a hundred, with one none (docs/SPEC.md, "The test bed").

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::{report_labelled, rerun_inside_with, shards, Outcome, RunOptions, TestbedError};

/// `i/n` (1-based) inside an emulated host that runs shard i of n.
pub const SHARD_ENV: &str = "FORKBOX_TESTBED_SHARD";

/// Names the ledger file where a shard's tests record how they started and
/// ended (set inside the emulated host only).
pub const LEDGER_ENV: &str = "FORKBOX_TESTBED_LEDGER";

/// A suite's trials, by name, and how long each is expected to take.
#[derive(Debug, Clone)]
pub struct Suite {
    /// Every trial's name, in the suite's order.
    pub names: Vec<&'static str>,
    /// Seconds a trial takes in a one-CPU emulated host, for spreading the
    /// long ones over the shards.
    pub seconds: &'static [(&'static str, u32)],
    /// Seconds of a trial not in `seconds`.
    pub default_seconds: u32,
    /// Most emulated hosts side by side (fewer where the machine has fewer
    /// CPUs, see [`shards`]).
    pub max_shards: usize,
    /// Time limit of one emulated host.
    pub timeout: Duration,
}

impl Suite {
    fn seconds(&self, name: &str) -> u32 {
        self.seconds
            .iter()
            .find(|(t, _)| *t == name)
            .map_or(self.default_seconds, |(_, s)| *s)
    }

    /// The trials of shard `i` of `n` (1-based): the longest trials first,
    /// each to the shard with the least time so far. Every shard computes
    /// the same split, so each trial runs in exactly one.
    pub fn split(&self, i: usize, n: usize) -> Vec<&'static str> {
        let mut order = self.names.clone();
        // Stable: equal weights keep the suite's order.
        order.sort_by_key(|name| std::cmp::Reverse(self.seconds(name)));
        let mut load = vec![0u32; n];
        let mut mine = Vec::new();
        for name in order {
            let shard = (0..n).min_by_key(|&s| (load[s], s)).unwrap_or(0);
            load[shard] += self.seconds(name);
            if shard == i - 1 {
                mine.push(name);
            }
        }
        mine
    }

    /// The trials this process runs: its shard's inside an emulated host
    /// that runs one ([`SHARD_ENV`]), else all of them.
    pub fn this_shard(&self) -> Vec<&'static str> {
        let shard = std::env::var(SHARD_ENV).ok().and_then(|v| {
            let (i, n) = v.split_once('/')?;
            Some((i.parse::<usize>().ok()?, n.parse::<usize>().ok()?))
        });
        match shard {
            Some((i, n)) if (1..=n).contains(&i) => self.split(i, n),
            _ => self.names.clone(),
        }
    }

    /// Runs the test binary again (with `args`) in one-CPU emulated hosts
    /// side by side, each taking its share of the trials ([`Sharded`]).
    pub fn run_in_emulated_hosts(&self, args: Vec<String>) -> i32 {
        let n = shards(self.max_shards);
        let mut split: Vec<&str> = (1..=n).flat_map(|i| self.split(i, n)).collect();
        split.sort_unstable();
        let mut all = self.names.clone();
        all.sort_unstable();
        if split != all {
            eprintln!("vm tests: the split into {n} shards does not hold every trial exactly once");
            return 1;
        }
        let sharded = Sharded {
            what: "vm",
            shards: n,
            // Wedges came about once in 25 minutes of a host on 2026-12-05
            // (docs/SPEC.md, known problems); each costs only the trials
            // that had not ended.
            hosts: 5,
            timeout: self.timeout,
        };
        sharded.run(|adjust| rerun_inside_with(args.clone(), self.timeout, adjust))
    }
}

/// One command run in `shards` one-CPU emulated hosts side by side, each
/// told its shard ([`SHARD_ENV`]) and its ledger ([`LEDGER_ENV`]).
///
/// An emulated host's own kernel has crashed under load here (a fault
/// inside its KVM_RUN, in QEMU's SVM emulation or its kvm_amd, which no
/// user process may cause), and QEMU's TCG has wedged (docs/SPEC.md, known
/// problems). Neither is a test result: after one, a new emulated host runs
/// the shard's command again, and the command leaves out what its ledger
/// says ended (tests that failed stay failed). `hosts` such hosts in one
/// shard end it with 125.
#[derive(Debug, Clone)]
pub struct Sharded<'a> {
    /// What runs, for the labels of output lines (`[vm 1/2] `).
    pub what: &'a str,
    pub shards: usize,
    /// Emulated hosts one shard may use, the first included.
    pub hosts: u32,
    /// Time limit of one emulated host.
    pub timeout: Duration,
}

impl Sharded<'_> {
    /// Runs every shard; `start` boots one emulated host with the options
    /// `adjust` completes and returns its command line and how it ended.
    /// Output lines carry the shard's label. The exit code is the first
    /// failing shard's.
    pub fn run<F>(&self, start: F) -> i32
    where
        F: Fn(&dyn Fn(&mut RunOptions)) -> Result<(Vec<String>, Outcome), TestbedError> + Sync,
    {
        let n = self.shards.max(1);
        let what = self.what;
        if n > 1 {
            eprintln!(
                "forkbox testbed: {n} one-CPU emulated hosts side by side, the tests split between them"
            );
        }
        let codes: Vec<i32> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..n)
                .map(|i| {
                    let start = &start;
                    scope.spawn(move || self.run_shard(start, i, n))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or(101))
                .collect()
        });
        for (i, code) in codes.iter().enumerate().filter(|_| n > 1) {
            let verdict = match code {
                0 => "passed".to_owned(),
                c => format!("FAILED (exit {c})"),
            };
            eprintln!("forkbox testbed: [{what} {}/{n}] {verdict}", i + 1);
        }
        codes.into_iter().find(|&c| c != 0).unwrap_or(0)
    }

    /// One shard (0-based `shard`), in as many emulated hosts as it takes.
    fn run_shard<F>(&self, start: &F, shard: usize, shards: usize) -> i32
    where
        F: Fn(&dyn Fn(&mut RunOptions)) -> Result<(Vec<String>, Outcome), TestbedError>,
    {
        let what = self.what;
        let label = match shards {
            1 => String::new(),
            _ => format!("[{what} {}/{shards}] ", shard + 1),
        };
        let share = match tempfile::Builder::new()
            .prefix(&format!("forkbox-{what}-tests-"))
            .tempdir()
        {
            Ok(dir) => dir,
            Err(e) => {
                eprintln!("{label}forkbox testbed: cannot make a directory for the ledger: {e}");
                return 1;
            }
        };
        let ledger = Ledger::at(share.path().join("ledger"));
        let adjust = |opts: &mut RunOptions| {
            opts.share = Some(share.path().to_owned());
            opts.label = (!label.is_empty()).then(|| label.clone());
            opts.env
                .push((LEDGER_ENV.into(), ledger.path().display().to_string()));
            opts.env
                .push((SHARD_ENV.into(), format!("{}/{shards}", shard + 1)));
        };
        for host in 1..=self.hosts {
            let (argv, outcome) = match start(&adjust) {
                Ok(run) => run,
                Err(e) => {
                    eprintln!("{label}forkbox testbed: cannot run inside the emulated host: {e}");
                    return 1;
                }
            };
            let host_failed = outcome.host_failed();
            // Prints the host's serial log and QEMU's stderr, or where its
            // CPUs were.
            let code = report_labelled(&label, &argv, self.timeout, outcome);
            let running = ledger.running();
            if code != 0 && !running.is_empty() {
                eprintln!(
                    "{label}forkbox testbed: started and never ended in that host: {}",
                    running.join(", ")
                );
            }
            if !host_failed {
                return code;
            }
            if host == self.hosts {
                break;
            }
            eprintln!(
                "{label}forkbox testbed: the emulated host itself crashed or wedged (above) after {} tests had ended; \
                 a new one runs the rest ({} of {}; a test-bed fault, counted here, not a pass)",
                ledger.ended().len(),
                host + 1,
                self.hosts
            );
        }
        eprintln!(
            "{label}forkbox testbed: the emulated host crashed or wedged {} times; giving up",
            self.hosts
        );
        125
    }
}

/// How a trial ended in an earlier emulated host of this run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ended {
    Passed,
    Failed(String),
}

/// The file where a shard's tests record how they started and ended: one
/// line each, `started NAME`, then `ok NAME` or `FAILED NAME MESSAGE` (the
/// message's newlines escaped; a NAME has no blanks, pytest's percent-encodes
/// them), each written whole so that a crash leaves whole lines.
#[derive(Debug, Clone)]
pub struct Ledger {
    path: PathBuf,
}

impl Ledger {
    /// The ledger of this run, inside an emulated host that keeps one.
    pub fn from_env() -> Option<Self> {
        std::env::var_os(LEDGER_ENV).map(|p| Self::at(PathBuf::from(p)))
    }

    pub fn at(path: PathBuf) -> Self {
        Self { path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Every trial that ended so far, in order.
    pub fn ended(&self) -> Vec<(String, Ended)> {
        self.lines()
            .into_iter()
            .filter_map(|(verdict, name, msg)| match verdict.as_str() {
                "ok" => Some((name, Ended::Passed)),
                "FAILED" => Some((name, Ended::Failed(msg.replace("\\n", "\n")))),
                _ => None,
            })
            .collect()
    }

    /// Tests that started and have not ended (what a host was running when
    /// it crashed, wedged or ran out of time), in the order they started.
    pub fn running(&self) -> Vec<String> {
        let mut running: Vec<String> = Vec::new();
        for (verdict, name, _) in self.lines() {
            match verdict.as_str() {
                "started" => running.push(name),
                "ok" | "FAILED" => running.retain(|n| *n != name),
                _ => {}
            }
        }
        running
    }

    /// Every line as (verdict, name, the rest).
    fn lines(&self) -> Vec<(String, String, String)> {
        let text = std::fs::read_to_string(&self.path).unwrap_or_default();
        text.lines()
            .filter_map(|line| {
                let (verdict, rest) = line.split_once(' ')?;
                let (name, msg) = rest.split_once(' ').unwrap_or((rest, ""));
                Some((verdict.to_owned(), name.to_owned(), msg.to_owned()))
            })
            .collect()
    }

    /// Appends that `name` started.
    pub fn start(&self, name: &str) {
        self.append(name, format!("started {name}\n"));
    }

    /// Appends how `name` ended: `Ok(())`, or its failure message.
    pub fn record(&self, name: &str, result: Result<(), &str>) {
        let line = match result {
            Ok(()) => format!("ok {name}\n"),
            Err(msg) => format!("FAILED {name} {}\n", msg.replace('\n', "\\n")),
        };
        self.append(name, line);
    }

    fn append(&self, name: &str, line: String) {
        let appended = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)
            .and_then(|mut f| f.write_all(line.as_bytes()));
        if let Err(e) = appended {
            eprintln!(
                "tests: cannot record that {name} started or ended in {}: {e}",
                self.path.display()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn suite(names: Vec<&'static str>) -> Suite {
        Suite {
            names,
            seconds: &[("long", 100), ("mid", 40)],
            default_seconds: 15,
            max_shards: 4,
            timeout: Duration::from_secs(1),
        }
    }

    #[test]
    fn split_puts_every_trial_in_one_shard_longest_first() {
        let s = suite(vec!["a", "b", "mid", "c", "long", "d"]);
        let one = s.split(1, 2);
        let two = s.split(2, 2);
        // long (100) to shard 1; mid (40) and the four 15 s trials reach
        // 100 on shard 2 only with the last.
        assert_eq!(one, ["long"]);
        assert_eq!(two, ["mid", "a", "b", "c", "d"]);
        let mut all: Vec<_> = one.into_iter().chain(two).collect();
        all.sort_unstable();
        assert_eq!(all, ["a", "b", "c", "d", "long", "mid"]);
        assert_eq!(s.split(1, 1).len(), 6);
    }

    fn env(opts: &RunOptions, key: &str) -> String {
        opts.env
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    }

    fn wedged() -> Outcome {
        Outcome::Wedged {
            serial_tail: String::new(),
            cpus: String::new(),
            stuck: Duration::from_secs(120),
        }
    }

    #[test]
    fn a_shard_whose_host_wedges_goes_on_in_a_new_one_with_the_same_ledger() {
        let seen = std::sync::Mutex::new(Vec::new());
        let sharded = Sharded {
            what: "t",
            shards: 2,
            hosts: 3,
            timeout: Duration::from_secs(1),
        };
        let code = sharded.run(|adjust| {
            let mut opts = RunOptions::new(vec!["cmd".into()]);
            adjust(&mut opts);
            let shard = env(&opts, SHARD_ENV);
            let ledger = Ledger::at(env(&opts, LEDGER_ENV).into());
            let mut seen = seen.lock().expect("not poisoned");
            let before = seen.iter().filter(|(s, _)| *s == shard).count();
            seen.push((shard.clone(), ledger.path().to_owned()));
            // Shard 1's first host wedges after one test ended.
            let outcome = if shard == "1/2" && before == 0 {
                ledger.start("one");
                ledger.record("one", Ok(()));
                ledger.start("two");
                wedged()
            } else {
                // What the earlier host of this shard recorded is there.
                let ended = ledger.ended().len();
                Outcome::Exited(if shard == "1/2" {
                    i32::from(ended != 1)
                } else {
                    0
                })
            };
            Ok((vec!["cmd".into()], outcome))
        });
        assert_eq!(code, 0);
        let seen = seen.into_inner().expect("not poisoned");
        let of = |s: &str| {
            seen.iter()
                .filter(|(x, _)| x == s)
                .cloned()
                .collect::<Vec<_>>()
        };
        assert_eq!(of("1/2").len(), 2, "shard 1 ran in a second host: {seen:?}");
        assert_eq!(of("1/2")[0].1, of("1/2")[1].1, "with the same ledger");
        assert_eq!(of("2/2").len(), 1);
        assert_ne!(of("1/2")[0].1, of("2/2")[0].1, "each shard its own ledger");
    }

    #[test]
    fn a_shard_gives_up_after_its_hosts_and_a_failing_one_fails_the_run() {
        let once = Sharded {
            what: "t",
            shards: 1,
            hosts: 2,
            timeout: Duration::from_secs(1),
        };
        let starts = std::sync::atomic::AtomicU32::new(0);
        let code = once.run(|_| {
            starts.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Ok((vec!["cmd".into()], wedged()))
        });
        assert_eq!((code, starts.into_inner()), (125, 2));
        let code = once.run(|adjust| {
            let mut opts = RunOptions::new(vec!["cmd".into()]);
            adjust(&mut opts);
            assert_eq!(env(&opts, SHARD_ENV), "1/1");
            assert_eq!(opts.label, None, "one shard: no label");
            Ok((vec!["cmd".into()], Outcome::Exited(3)))
        });
        assert_eq!(code, 3);
    }

    #[test]
    fn ledger_reads_back_what_it_recorded_newlines_included() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ledger = Ledger::at(dir.path().join("ended"));
        assert!(ledger.ended().is_empty());
        ledger.start("first");
        assert_eq!(ledger.running(), ["first"]);
        ledger.record("first", Ok(()));
        ledger.start("second");
        ledger.start("third");
        ledger.record("second", Err("line one\nline two"));
        // The host died while `third` ran.
        assert_eq!(ledger.running(), ["third"]);
        assert_eq!(
            ledger.ended(),
            [
                ("first".to_owned(), Ended::Passed),
                (
                    "second".to_owned(),
                    Ended::Failed("line one\nline two".into())
                ),
            ]
        );
    }
}
