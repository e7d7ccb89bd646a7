//! The daemon's counters, gauges and latency histograms, rendered in
//! Prometheus' text format (0.0.4) by `prometheus-client`; and the VMMs'
//! own counters (`forkbox_vmm_*`), summed over live sandboxes at a scrape.

use std::sync::atomic::AtomicU64;
use std::time::Duration;

use forkbox_vmm_api::VmmCounters;

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
struct CauseLabel {
    cause: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DirectionLabel {
    direction: &'static str,
}

/// The VMMs' own counters summed over the live sandboxes asked at one
/// scrape.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VmmTotals {
    pub counters: VmmCounters,
    /// VMMs whose counters are in the sums.
    pub reporting: usize,
    /// VMMs that did not answer in time, or failed to: left out.
    pub unanswered: usize,
}

/// Gauges, not counters: a sum over live sandboxes falls when one ends.
#[derive(Debug)]
struct VmmGauges {
    exits: Family<KindLabel, Gauge>,
    control_requests: Gauge,
    control_seconds: Gauge<f64, AtomicU64>,
    vsock_connections: Gauge,
    net_frames: Family<DirectionLabel, Gauge>,
    net_bytes: Family<DirectionLabel, Gauge>,
    disk_written_bytes: Gauge,
    disk_host_write_errors: Gauge,
    reporting: Gauge,
    unanswered: Gauge,
    /// Every VMM that did not answer, over all scrapes.
    unanswered_total: Counter,
}

impl VmmGauges {
    fn register(registry: &mut Registry) -> Self {
        let r = registry.sub_registry_with_prefix("forkbox_vmm");
        let g = Self {
            exits: Family::default(),
            control_requests: Gauge::default(),
            control_seconds: Gauge::default(),
            vsock_connections: Gauge::default(),
            net_frames: Family::default(),
            net_bytes: Family::default(),
            disk_written_bytes: Gauge::default(),
            disk_host_write_errors: Gauge::default(),
            reporting: Gauge::default(),
            unanswered: Gauge::default(),
            unanswered_total: Counter::default(),
        };
        r.register(
            "exits",
            "vCPU exits to the VMM by kind (io, mmio, other), summed over live sandboxes",
            g.exits.clone(),
        );
        r.register(
            "control_requests",
            "Control requests (pause, fork, ...) the VMMs served, summed over live sandboxes",
            g.control_requests.clone(),
        );
        r.register(
            "control_seconds",
            "Time the VMMs spent serving control requests, summed over live sandboxes",
            g.control_seconds.clone(),
        );
        r.register(
            "vsock_connections",
            "Host connections to guest vsock ports, summed over live sandboxes",
            g.vsock_connections.clone(),
        );
        r.register(
            "net_frames",
            "Ethernet frames between guest and gateway by direction (tx: from the guest), summed over live sandboxes",
            g.net_frames.clone(),
        );
        r.register(
            "net_bytes",
            "Bytes of those frames by direction, summed over live sandboxes",
            g.net_bytes.clone(),
        );
        r.register(
            "disk_written_bytes",
            "Bytes guests wrote to their writable disks, summed over live sandboxes",
            g.disk_written_bytes.clone(),
        );
        r.register(
            "disk_host_write_errors",
            "Guest writes to writable disks the host failed (a full host disk: the guest saw an I/O error), summed over live sandboxes",
            g.disk_host_write_errors.clone(),
        );
        r.register(
            "reporting",
            "Live sandboxes' VMMs whose counters are in the forkbox_vmm sums of this scrape",
            g.reporting.clone(),
        );
        r.register(
            "unanswered",
            "Live sandboxes' VMMs left out of this scrape's sums: no answer in time",
            g.unanswered.clone(),
        );
        r.register(
            "unanswered_scrapes",
            "VMMs left out of a scrape's sums for want of an answer, over all scrapes",
            g.unanswered_total.clone(),
        );
        g
    }

    fn set(&self, t: &VmmTotals) {
        let v = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        let c = &t.counters;
        for (kind, n) in [
            ("io", c.exits_io),
            ("mmio", c.exits_mmio),
            ("other", c.exits_other),
        ] {
            self.exits.get_or_create(&KindLabel { kind }).set(v(n));
        }
        self.control_requests.set(v(c.control_requests));
        self.control_seconds
            .set(Duration::from_micros(c.control_micros).as_secs_f64());
        self.vsock_connections.set(v(c.vsock_connections));
        for (direction, frames, bytes) in [
            ("tx", c.net_tx_frames, c.net_tx_bytes),
            ("rx", c.net_rx_frames, c.net_rx_bytes),
        ] {
            let label = DirectionLabel { direction };
            self.net_frames.get_or_create(&label).set(v(frames));
            self.net_bytes.get_or_create(&label).set(v(bytes));
        }
        self.disk_written_bytes.set(v(c.disk_bytes_written));
        self.disk_host_write_errors.set(v(c.disk_host_write_errors));
        self.reporting.set(v(t.reporting as u64));
        self.unanswered.set(v(t.unanswered as u64));
        self.unanswered_total.inc_by(t.unanswered as u64);
    }
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
    /// Dead sandboxes' egress logs deleted before their TTL for room
    /// (`--log-max-total-mib`).
    pub egress_logs_removed: Counter,
    pub bakes_ok: Counter,
    pub bakes_failed: Counter,
    pub create_latency: Latency,
    /// A whole fork request: all children up and their hooks run.
    pub fork_latency: Latency,
    pub exec_latency: Latency,
    errors: Family<KindLabel, Counter>,
    deaths: Family<CauseLabel, Counter>,
    vmm: VmmGauges,
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
        let egress_logs_removed = counter(
            "forkbox_egress_logs_removed",
            "Dead sandboxes' egress logs deleted before their TTL because the logs reached their total",
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
        let deaths = Family::<CauseLabel, Counter>::default();
        registry.register(
            "forkbox_sandbox_deaths",
            "Sandboxes that ended, by cause: killed, expired, guest_ended (the guest ended its own VM: the policy's failure), vm_lost (infrastructure), daemon_stopped",
            deaths.clone(),
        );
        let vmm = VmmGauges::register(&mut registry);
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
            egress_logs_removed,
            create_latency,
            fork_latency,
            exec_latency,
            errors,
            deaths,
            vmm,
        }
    }
}

impl Metrics {
    /// Counts a sandbox's end by its cause.
    pub fn died(&self, cause: &crate::core::DeathCause) {
        use crate::core::DeathCause;
        let cause = match cause {
            DeathCause::Killed => "killed",
            DeathCause::Expired => "expired",
            DeathCause::VmLost { .. } => "vm_lost",
            DeathCause::GuestEnded { .. } => "guest_ended",
            DeathCause::DaemonStopped => "daemon_stopped",
        };
        self.deaths.get_or_create(&CauseLabel { cause }).inc();
    }

    /// Counts a failed request of this kind.
    pub fn error(&self, kind: &'static str) {
        self.errors.get_or_create(&KindLabel { kind }).inc();
    }

    /// Sets the `forkbox_vmm_*` gauges from one scrape's sums (and counts
    /// its unanswered VMMs); the next [`Metrics::render`] shows them.
    pub fn set_vmm(&self, totals: &VmmTotals) {
        self.vmm.set(totals);
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
    fn vmm_totals_render_as_forkbox_vmm_gauges() {
        let m = Metrics::default();
        let totals = VmmTotals {
            counters: VmmCounters {
                exits_io: 10,
                exits_mmio: 20,
                exits_other: 30,
                control_requests: 4,
                control_micros: 1_500_000,
                vsock_connections: 5,
                net_tx_frames: 6,
                net_tx_bytes: 600,
                net_rx_frames: 7,
                net_rx_bytes: 700,
                disk_bytes_written: 8192,
                disk_host_write_errors: 3,
            },
            reporting: 2,
            unanswered: 1,
        };
        m.set_vmm(&totals);
        m.set_vmm(&totals);
        let text = m.render(3, 0);
        for line in [
            "# TYPE forkbox_vmm_exits gauge",
            "forkbox_vmm_exits{kind=\"io\"} 10",
            "forkbox_vmm_exits{kind=\"mmio\"} 20",
            "forkbox_vmm_exits{kind=\"other\"} 30",
            "forkbox_vmm_control_requests 4",
            "forkbox_vmm_control_seconds 1.5",
            "forkbox_vmm_vsock_connections 5",
            "forkbox_vmm_net_frames{direction=\"tx\"} 6",
            "forkbox_vmm_net_frames{direction=\"rx\"} 7",
            "forkbox_vmm_net_bytes{direction=\"tx\"} 600",
            "forkbox_vmm_net_bytes{direction=\"rx\"} 700",
            "forkbox_vmm_disk_written_bytes 8192",
            "forkbox_vmm_disk_host_write_errors 3",
            "forkbox_vmm_reporting 2",
            "# TYPE forkbox_vmm_unanswered gauge",
            "forkbox_vmm_unanswered 1",
            // Counted at each of the two scrapes.
            "# TYPE forkbox_vmm_unanswered_scrapes_total counter",
            "forkbox_vmm_unanswered_scrapes_total 2",
        ] {
            assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
        }
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
            "# TYPE forkbox_egress_logs_removed_total counter",
            "forkbox_egress_logs_removed_total 0",
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
