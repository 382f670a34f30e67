//! The agent's Prometheus metrics, served on `/metrics` of `--metrics-listen` (OpenMetrics text
//! through `prometheus-client`), with `/healthz`.
//!
//! | metric | type | what |
//! |---|---|---|
//! | `trainyard_agent_ranks{phase}` | gauge | ranks this agent holds, by phase (launching, running, exited, lost) |
//! | `trainyard_agent_connected` | gauge | 1 while the stream to the controller is open |
//! | `trainyard_agent_receipt_lag_bytes` | gauge | bytes of receipts files written by ranks but not yet acknowledged by the controller |
//! | `trainyard_agent_unacked_batches` | gauge | receipt batches sent and not yet acknowledged |
//! | `trainyard_agent_skipped_lines` | gauge | lines of the held ranks' receipts files that are not receipts |
//! | `trainyard_agent_receipts_relayed_total` | counter | receipts sent to the controller (resends after a reconnect included) |
//! | `trainyard_agent_receipt_bytes_relayed_total` | counter | their bytes |
//!
//! The gauges are refreshed from the connection loop about once a second.

use std::sync::OnceLock;

use axum::Router;
use axum::http::{StatusCode, header};
use axum::routing::get;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::launcher::Launcher;
use trainyard_proto::words::RankState;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabel {
    pub phase: &'static str,
}

pub struct Metrics {
    registry: Registry,
    pub ranks: Family<PhaseLabel, Gauge>,
    pub connected: Gauge,
    pub receipt_lag_bytes: Gauge,
    pub unacked_batches: Gauge,
    pub skipped_lines: Gauge,
    pub held_ranks: Gauge,
    pub receipts_relayed: Counter,
    pub receipt_bytes_relayed: Counter,
}

/// The process's metrics, registered on first use.
pub fn metrics() -> &'static Metrics {
    static METRICS: OnceLock<Metrics> = OnceLock::new();
    METRICS.get_or_init(Metrics::new)
}

impl Metrics {
    fn new() -> Metrics {
        let mut registry = Registry::with_prefix("trainyard_agent");
        let m = Metrics {
            registry: Registry::default(),
            ranks: Family::default(),
            connected: Gauge::default(),
            receipt_lag_bytes: Gauge::default(),
            unacked_batches: Gauge::default(),
            skipped_lines: Gauge::default(),
            held_ranks: Gauge::default(),
            receipts_relayed: Counter::default(),
            receipt_bytes_relayed: Counter::default(),
        };
        registry.register("ranks", "Ranks this agent holds, by phase", m.ranks.clone());
        registry.register("connected", "1 while the stream to the controller is open", m.connected.clone());
        registry.register(
            "receipt_lag_bytes",
            "Bytes of receipts files not yet acknowledged by the controller",
            m.receipt_lag_bytes.clone(),
        );
        registry.register(
            "unacked_batches",
            "Receipt batches awaiting acknowledgement",
            m.unacked_batches.clone(),
        );
        registry.register(
            "skipped_lines",
            "Receipts-file lines that are not receipts",
            m.skipped_lines.clone(),
        );
        registry.register(
            "held_ranks",
            "Ranks whose receipts the controller does not acknowledge (it does not know the job): kept in their files, not read further",
            m.held_ranks.clone(),
        );
        registry.register("receipts_relayed", "Receipts sent to the controller", m.receipts_relayed.clone());
        registry.register("receipt_bytes_relayed", "Bytes of receipts sent", m.receipt_bytes_relayed.clone());
        Metrics { registry, ..m }
    }

    /// Sets the gauges from the ranks the launcher holds.
    pub fn observe(&self, launcher: &Launcher, unacked_batches: usize) {
        for phase in [RankState::Launching, RankState::Running, RankState::Exited, RankState::Lost] {
            let n = launcher.ranks().filter(|r| r.record.phase == phase).count();
            self.ranks.get_or_create(&PhaseLabel { phase: phase.as_str() }).set(n as i64);
        }
        let lag: u64 = launcher
            .ranks()
            .map(|r| {
                let written = std::fs::metadata(r.tailer.path()).map_or(0, |m| m.len());
                written.saturating_sub(r.tailer.acked().offset)
            })
            .sum();
        self.receipt_lag_bytes.set(i64::try_from(lag).unwrap_or(i64::MAX));
        self.unacked_batches.set(unacked_batches as i64);
        let skipped: u64 = launcher.ranks().map(|r| r.tailer.skipped_lines()).sum();
        self.skipped_lines.set(i64::try_from(skipped).unwrap_or(i64::MAX));
        self.held_ranks.set(launcher.ranks().filter(|r| r.tailer.held()).count() as i64);
    }

    /// The metrics in the OpenMetrics text format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// `/metrics` and `/healthz`; anything else is a 404 that says what is served.
pub fn router() -> Router {
    Router::new()
        .route(
            "/metrics",
            get(|| async {
                (
                    [(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")],
                    metrics().encode(),
                )
            }),
        )
        .route("/healthz", get(|| async { "ok\n" }))
        .fallback(|uri: axum::http::Uri| async move {
            (
                StatusCode::NOT_FOUND,
                format!("no page {}; this listener serves /metrics and /healthz\n", uri.path()),
            )
        })
}
