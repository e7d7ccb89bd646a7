//! Running a suite of VM trials where this machine cannot run microVMs:
//! the trials are split between one-CPU emulated hosts side by side (by
//! their expected time), each shard survives its host's own kernel crash
//! by resuming in a new host with the trials that had not ended, and every
//! trial's end is recorded in a ledger shared with this machine.
//!
//! The trials and their harness (libtest-mimic) stay with the test; this
//! module owns the scheduling and the crash-resume. Why one CPU per host:
//! with two emulated CPUs the emulated host's KVM lost a few guests in a
//! hundred, with one none (docs/SPEC.md, "The test bed").

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::{report, rerun_inside_with, shards};

/// `i/n` (1-based) inside an emulated host that runs shard i of n.
pub const SHARD_ENV: &str = "FORKBOX_VM_TESTS_SHARD";

/// Names the ledger file where trials record how they ended (set inside
/// the emulated host only).
pub const LEDGER_ENV: &str = "FORKBOX_VM_TESTS_PROGRESS";

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
    /// side by side, each taking its share of the trials; their output
    /// lines carry the shard's label. The exit code is the first failing
    /// shard's.
    pub fn run_in_emulated_hosts(&self, args: Vec<String>) -> i32 {
        let n = shards(self.max_shards);
        eprintln!(
            "vm tests: {n} one-CPU emulated host(s) side by side, the trials split between them by their expected time"
        );
        let mut split: Vec<&str> = (1..=n).flat_map(|i| self.split(i, n)).collect();
        split.sort_unstable();
        let mut all = self.names.clone();
        all.sort_unstable();
        if split != all {
            eprintln!("vm tests: the split into {n} shards does not hold every trial exactly once");
            return 1;
        }
        let codes: Vec<i32> = std::thread::scope(|scope| {
            let shards: Vec<_> = (0..n)
                .map(|i| {
                    let args = args.clone();
                    scope.spawn(move || self.run_shard(args, i, n))
                })
                .collect();
            shards
                .into_iter()
                .map(|h| h.join().unwrap_or(101))
                .collect()
        });
        for (i, code) in codes.iter().enumerate() {
            let verdict = match code {
                0 => "passed".to_owned(),
                c => format!("FAILED (exit {c})"),
            };
            eprintln!("vm tests: shard {}/{n}: {verdict}", i + 1);
        }
        codes.into_iter().find(|&c| c != 0).unwrap_or(0)
    }

    /// One shard (0-based `shard`) in its emulated host. That host's own
    /// kernel has crashed under load here (a fault inside its KVM_RUN, in
    /// QEMU's SVM emulation or its kvm_amd, which no user process may
    /// cause; docs/SPEC.md, known problems). Such a crash is not a test
    /// result: after it a new emulated host runs only the trials that had
    /// not ended ([`Ledger`]); trials that failed stay failed. Three
    /// crashes in one shard end it with 125.
    fn run_shard(&self, args: Vec<String>, shard: usize, shards: usize) -> i32 {
        const HOSTS: u32 = 3;
        let label = format!("[vm {}/{shards}] ", shard + 1);
        let share = match tempfile::Builder::new()
            .prefix("forkbox-vm-tests-")
            .tempdir()
        {
            Ok(dir) => dir,
            Err(e) => {
                eprintln!("{label}vm tests: cannot make a directory for their progress: {e}");
                return 1;
            }
        };
        let ledger = share.path().join("ended");
        for host in 1..=HOSTS {
            let run = rerun_inside_with(args.clone(), self.timeout, |opts| {
                opts.share = Some(share.path().to_owned());
                opts.label = Some(label.clone());
                opts.env
                    .push((LEDGER_ENV.into(), ledger.display().to_string()));
                opts.env
                    .push((SHARD_ENV.into(), format!("{}/{shards}", shard + 1)));
            });
            match run {
                Ok((argv, outcome)) if outcome.host_failed() => {
                    // Prints the host's serial log and QEMU's stderr, or
                    // where its CPUs were.
                    report(&argv, self.timeout, outcome);
                    if host == HOSTS {
                        break;
                    }
                    eprintln!(
                        "{label}vm tests: the emulated host itself crashed or wedged (above) after {} trials had ended; \
                         a new one runs the rest ({} of {HOSTS}; a test-bed fault, counted here, not a pass)",
                        Ledger::at(ledger.clone()).ended().len(),
                        host + 1
                    );
                }
                Ok((argv, outcome)) => return report(&argv, self.timeout, outcome),
                Err(e) => {
                    eprintln!("{label}vm tests: cannot run inside the emulated host: {e}");
                    return 1;
                }
            }
        }
        eprintln!("{label}vm tests: the emulated host crashed or wedged {HOSTS} times; giving up");
        125
    }
}

/// How a trial ended in an earlier emulated host of this run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ended {
    Passed,
    Failed(String),
}

/// The file where a shard's trials record how they ended: one line each,
/// `ok NAME` or `FAILED NAME MESSAGE` (the message's newlines escaped),
/// each written whole so that a crash leaves whole lines.
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
        let text = std::fs::read_to_string(&self.path).unwrap_or_default();
        text.lines()
            .filter_map(|line| {
                let (verdict, rest) = line.split_once(' ')?;
                let (name, msg) = rest.split_once(' ').unwrap_or((rest, ""));
                match verdict {
                    "ok" => Some((name.to_owned(), Ended::Passed)),
                    "FAILED" => Some((name.to_owned(), Ended::Failed(msg.replace("\\n", "\n")))),
                    _ => None,
                }
            })
            .collect()
    }

    /// Appends how `name` ended: `Ok(())`, or its failure message.
    pub fn record(&self, name: &str, result: Result<(), &str>) {
        let line = match result {
            Ok(()) => format!("ok {name}\n"),
            Err(msg) => format!("FAILED {name} {}\n", msg.replace('\n', "\\n")),
        };
        let appended = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)
            .and_then(|mut f| f.write_all(line.as_bytes()));
        if let Err(e) = appended {
            eprintln!(
                "vm tests: cannot record that {name} ended in {}: {e}",
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

    #[test]
    fn ledger_reads_back_what_it_recorded_newlines_included() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ledger = Ledger::at(dir.path().join("ended"));
        assert!(ledger.ended().is_empty());
        ledger.record("first", Ok(()));
        ledger.record("second", Err("line one\nline two"));
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
