//! Counters and histograms, rendered in Prometheus' text format.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// Upper bounds of the latency buckets, in seconds.
const BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// A cumulative latency histogram.
#[derive(Debug, Default)]
pub struct Histogram {
    inner: Mutex<HistState>,
}

#[derive(Debug, Default)]
struct HistState {
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    pub fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        let mut h = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if h.counts.is_empty() {
            h.counts = vec![0; BUCKETS.len()];
        }
        for (i, b) in BUCKETS.iter().enumerate() {
            if s <= *b {
                h.counts[i] += 1;
            }
        }
        h.sum += s;
        h.count += 1;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let h = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (i, b) in BUCKETS.iter().enumerate() {
            let c = h.counts.get(i).copied().unwrap_or(0);
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", h.count);
        let _ = writeln!(out, "{name}_sum {}", h.sum);
        let _ = writeln!(out, "{name}_count {}", h.count);
    }
}

/// Everything `/metrics` shows besides the live gauges.
#[derive(Debug, Default)]
pub struct Metrics {
    pub creations_ok: AtomicU64,
    pub creations_failed: AtomicU64,
    pub kills: AtomicU64,
    pub expiries: AtomicU64,
    pub execs: AtomicU64,
    /// Fork requests (`POST /sandboxes/{id}/fork`) and children made.
    pub forks: AtomicU64,
    pub fork_children: AtomicU64,
    /// Fork children that replaced a lost one (its VMM died or it did not
    /// answer in time): each is a test-bed or host fault worth a look.
    pub fork_children_replaced: AtomicU64,
    pub bakes_ok: AtomicU64,
    pub bakes_failed: AtomicU64,
    pub create_latency: Histogram,
    /// A whole fork request: all children up and their hooks run.
    pub fork_latency: Histogram,
    pub exec_latency: Histogram,
    errors: Mutex<BTreeMap<&'static str, u64>>,
}

impl Metrics {
    pub fn error(&self, kind: &'static str) {
        *self
            .errors
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(kind)
            .or_default() += 1;
    }

    /// The text format, with the gauges the caller reads from the registry.
    pub fn render(&self, live: usize, creating: usize) -> String {
        let mut s = String::new();
        let g = |s: &mut String, name: &str, help: &str, kind: &str, v: u64| {
            let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}");
        };
        g(
            &mut s,
            "forkbox_sandboxes_live",
            "Sandboxes creating, running or paused.",
            "gauge",
            live as u64,
        );
        g(
            &mut s,
            "forkbox_sandboxes_creating",
            "Sandboxes being created.",
            "gauge",
            creating as u64,
        );
        let _ = writeln!(
            s,
            "# HELP forkbox_sandbox_creations_total Sandbox creations by outcome.\n# TYPE forkbox_sandbox_creations_total counter"
        );
        let _ = writeln!(
            s,
            "forkbox_sandbox_creations_total{{outcome=\"ok\"}} {}",
            self.creations_ok.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            s,
            "forkbox_sandbox_creations_total{{outcome=\"failed\"}} {}",
            self.creations_failed.load(Ordering::Relaxed)
        );
        g(
            &mut s,
            "forkbox_sandbox_kills_total",
            "Sandboxes killed by a client.",
            "counter",
            self.kills.load(Ordering::Relaxed),
        );
        g(
            &mut s,
            "forkbox_sandbox_expiries_total",
            "Sandboxes whose time-to-live ran out.",
            "counter",
            self.expiries.load(Ordering::Relaxed),
        );
        g(
            &mut s,
            "forkbox_execs_total",
            "Commands run.",
            "counter",
            self.execs.load(Ordering::Relaxed),
        );
        g(
            &mut s,
            "forkbox_forks_total",
            "Fork requests of running sandboxes.",
            "counter",
            self.forks.load(Ordering::Relaxed),
        );
        g(
            &mut s,
            "forkbox_fork_children_total",
            "Children made by fork requests.",
            "counter",
            self.fork_children.load(Ordering::Relaxed),
        );
        g(
            &mut s,
            "forkbox_fork_children_replaced_total",
            "Fork children that replaced a lost one (its VMM died or it did not answer in time).",
            "counter",
            self.fork_children_replaced.load(Ordering::Relaxed),
        );
        let _ = writeln!(
            s,
            "# HELP forkbox_template_bakes_total Template bakes by outcome.\n# TYPE forkbox_template_bakes_total counter"
        );
        for (outcome, n) in [("ok", &self.bakes_ok), ("failed", &self.bakes_failed)] {
            let _ = writeln!(
                s,
                "forkbox_template_bakes_total{{outcome=\"{outcome}\"}} {}",
                n.load(Ordering::Relaxed)
            );
        }
        self.fork_latency.render(
            &mut s,
            "forkbox_fork_seconds",
            "Fork request latency, request to every child ready.",
        );
        self.create_latency.render(
            &mut s,
            "forkbox_create_seconds",
            "Sandbox creation latency (a fork of the template's zygote), admission to ready.",
        );
        self.exec_latency.render(
            &mut s,
            "forkbox_exec_seconds",
            "Command latency through the daemon, request to exit status.",
        );
        let _ = writeln!(
            s,
            "# HELP forkbox_errors_total Failed requests by error kind.\n# TYPE forkbox_errors_total counter"
        );
        for (kind, n) in self.errors.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            let _ = writeln!(s, "forkbox_errors_total{{kind=\"{kind}\"}} {n}");
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let m = Metrics::default();
        m.exec_latency.observe(Duration::from_millis(3));
        m.exec_latency.observe(Duration::from_secs(2));
        let text = m.render(0, 0);
        assert!(
            text.contains("forkbox_exec_seconds_bucket{le=\"0.005\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("forkbox_exec_seconds_bucket{le=\"2.5\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("forkbox_exec_seconds_bucket{le=\"+Inf\"} 2"),
            "{text}"
        );
        assert!(text.contains("forkbox_exec_seconds_count 2"), "{text}");
    }

    #[test]
    fn errors_are_counted_by_kind() {
        let m = Metrics::default();
        m.error("infrastructure");
        m.error("infrastructure");
        m.error("not_found");
        let text = m.render(3, 1);
        assert!(text.contains("forkbox_errors_total{kind=\"infrastructure\"} 2"));
        assert!(text.contains("forkbox_errors_total{kind=\"not_found\"} 1"));
        assert!(text.contains("forkbox_sandboxes_live 3"));
    }
}
