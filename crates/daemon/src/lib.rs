//! forkboxd: the daemon that owns every sandbox on the host and serves the
//! HTTP API the CLI and the SDKs use.
//!
//! - [`core`]: the registry and its state machine, labels, TTLs, caps,
//!   lineage; no I/O, no clock of its own.
//! - [`template`]: templates and their ready recipe.
//! - [`backend`]: the [`backend::Backend`] trait between the daemon and
//!   VMs, implemented on `forkbox_host::vm`; [`gvisor`]: the same trait on
//!   gVisor, for hosts without hardware virtualization.
//! - [`service`]: the daemon proper: typed commands in, VMs driven through
//!   the backend on the blocking pool, the TTL reaper, metrics.
//! - [`metrics`]: counters, gauges and histograms in Prometheus' text
//!   format (`prometheus-client`).
//! - [`persist`]: the state directory a restarted daemon re-adopts its
//!   VMs from.
//! - [`network`]: the egress policy's API spelling and the sandboxes'
//!   egress logs, which outlive them until a TTL.
//! - [`api`]: the HTTP+JSON edge (axum) and its OpenAPI document.
//! - [`listen`]: where the daemon listens (unix socket or TCP).
//!
//! Must not depend on the VMM's internals (it starts VMs through
//! `forkbox_host::vm`) nor the agent's (it speaks `forkbox-proto`).
#![forbid(unsafe_code)]

pub mod api;
pub mod backend;
pub mod core;
pub mod gvisor;
pub mod listen;
pub mod metrics;
pub mod network;
pub mod persist;
pub mod service;
pub mod template;
