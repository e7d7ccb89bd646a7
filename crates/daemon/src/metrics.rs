//! The daemon's counters, gauges and latency histograms, rendered in
//! Prometheus' text format (0.0.4) by `prometheus-client`.

use std::time::Duration;

use prometheus_client::encoding::{prometheus_text, EncodeLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Upper bounds of the latency buckets, in seconds.
const BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// A latency histogram in seconds.
#[derive(Debug, Clone)]
pub struct Latency(Histogram);

impl Default for Latency {
    fn default() -> Self {
        Self(Histogram::new(BUCKETS.iter().copied()))
    }
}

impl Latency {
    pub fn observe(&self, d: Duration) {
        self.0.observe(d.as_secs_f64());
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: &'static str,
}

/// Everything `/metrics` shows. The counters are handles into the
/// registry: counting is `inc()`.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    live: Gauge,
    creating: Gauge,
    pub creations_ok: Counter,
    pub creations_failed: Counter,
    pub kills: Counter,
    pub expiries: Counter,
    pub execs: Counter,
    /// Fork requests (`POST /sandboxes/{id}/fork`) and children made.
    pub forks: Counter,
    pub fork_children: Counter,
    /// Fork children that replaced a lost one (its VMM died or it did not
    /// answer in time): each is a test-bed or host fault worth a look.
    pub fork_children_replaced: Counter,
    pub bakes_ok: Counter,
    pub bakes_failed: Counter,
    pub create_latency: Latency,
    /// A whole fork request: all children up and their hooks run.
    pub fork_latency: Latency,
    pub exec_latency: Latency,
    errors: Family<KindLabel, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        // Help texts without their final period: the encoder adds one.
        let mut registry = Registry::default();
        let live = Gauge::default();
        registry.register(
            "forkbox_sandboxes_live",
            "Sandboxes creating, running or paused",
            live.clone(),
        );
        let creating = Gauge::default();
        registry.register(
            "forkbox_sandboxes_creating",
            "Sandboxes being created",
            creating.clone(),
        );
        let creations = Family::<OutcomeLabel, Counter>::default();
        registry.register(
            "forkbox_sandbox_creations",
            "Sandbox creations by outcome",
            creations.clone(),
        );
        let mut counter = |name: &str, help: &str| {
            let c = Counter::default();
            registry.register(name, help, c.clone());
            c
        };
        let kills = counter("forkbox_sandbox_kills", "Sandboxes killed by a client");
        let expiries = counter(
            "forkbox_sandbox_expiries",
            "Sandboxes whose time-to-live ran out",
        );
        let execs = counter("forkbox_execs", "Commands run");
        let forks = counter("forkbox_forks", "Fork requests of running sandboxes");
        let fork_children = counter("forkbox_fork_children", "Children made by fork requests");
        let fork_children_replaced = counter(
            "forkbox_fork_children_replaced",
            "Fork children that replaced a lost one (its VMM died or it did not answer in time)",
        );
        let bakes = Family::<OutcomeLabel, Counter>::default();
        registry.register(
            "forkbox_template_bakes",
            "Template bakes by outcome",
            bakes.clone(),
        );
        let mut latency = |name: &str, help: &str| {
            let l = Latency::default();
            registry.register(name, help, l.0.clone());
            l
        };
        let fork_latency = latency(
            "forkbox_fork_seconds",
            "Fork request latency, request to every child ready",
        );
        let create_latency = latency(
            "forkbox_create_seconds",
            "Sandbox creation latency (a fork of the template's zygote), admission to ready",
        );
        let exec_latency = latency(
            "forkbox_exec_seconds",
            "Command latency through the daemon, request to exit status",
        );
        let errors = Family::<KindLabel, Counter>::default();
        registry.register(
            "forkbox_errors",
            "Failed requests by error kind",
            errors.clone(),
        );
        let outcome = |family: &Family<OutcomeLabel, Counter>, outcome| {
            family.get_or_create(&OutcomeLabel { outcome }).clone()
        };
        Self {
            creations_ok: outcome(&creations, "ok"),
            creations_failed: outcome(&creations, "failed"),
            bakes_ok: outcome(&bakes, "ok"),
            bakes_failed: outcome(&bakes, "failed"),
            registry,
            live,
            creating,
            kills,
            expiries,
            execs,
            forks,
            fork_children,
            fork_children_replaced,
            create_latency,
            fork_latency,
            exec_latency,
            errors,
        }
    }
}

impl Metrics {
    /// Counts a failed request of this kind.
    pub fn error(&self, kind: &'static str) {
        self.errors.get_or_create(&KindLabel { kind }).inc();
    }

    /// The text format, with the gauges the caller reads from the registry.
    pub fn render(&self, live: usize, creating: usize) -> String {
        self.live.set(live as i64);
        self.creating.set(creating as i64);
        let mut s = String::new();
        // Writing to a `String` cannot fail.
        let _ = prometheus_text::encode(&mut s, &self.registry);
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

    #[test]
    fn render_keeps_the_names_types_and_help_of_every_metric() {
        let m = Metrics::default();
        m.error("capacity");
        let text = m.render(2, 1);
        for line in [
            "# HELP forkbox_sandboxes_live Sandboxes creating, running or paused.",
            "# TYPE forkbox_sandboxes_live gauge",
            "forkbox_sandboxes_live 2",
            "# TYPE forkbox_sandboxes_creating gauge",
            "forkbox_sandboxes_creating 1",
            "# HELP forkbox_sandbox_creations_total Sandbox creations by outcome.",
            "# TYPE forkbox_sandbox_creations_total counter",
            "forkbox_sandbox_creations_total{outcome=\"ok\"} 0",
            "forkbox_sandbox_creations_total{outcome=\"failed\"} 0",
            "# TYPE forkbox_sandbox_kills_total counter",
            "# TYPE forkbox_sandbox_expiries_total counter",
            "# TYPE forkbox_execs_total counter",
            "# TYPE forkbox_forks_total counter",
            "# TYPE forkbox_fork_children_total counter",
            "# TYPE forkbox_fork_children_replaced_total counter",
            "forkbox_fork_children_replaced_total 0",
            "forkbox_template_bakes_total{outcome=\"ok\"} 0",
            "forkbox_template_bakes_total{outcome=\"failed\"} 0",
            "# TYPE forkbox_fork_seconds histogram",
            "# TYPE forkbox_create_seconds histogram",
            "# HELP forkbox_exec_seconds Command latency through the daemon, request to exit status.",
            "# TYPE forkbox_exec_seconds histogram",
            "forkbox_exec_seconds_count 0",
            "# HELP forkbox_errors_total Failed requests by error kind.",
            "# TYPE forkbox_errors_total counter",
            "forkbox_errors_total{kind=\"capacity\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
        }
    }
}
