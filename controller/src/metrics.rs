//! The controller's Prometheus metrics, served on `/metrics` of its HTTP listener in the
//! OpenMetrics text format (which Prometheus scrapes natively) through `prometheus-client`.
//!
//! | metric | type | what |
//! |---|---|---|
//! | `trainyard_jobs{state}` | gauge | jobs the controller holds (not finished), by state |
//! | `trainyard_jobs_finished_total{state}` | counter | jobs that reached a final state since start |
//! | `trainyard_failures_total{kind,blamed}` | counter | failures that ended a job attempt, by kind (`rank_exit`, `host_lost`, `rank_lost`, `preflight`, `hang`, `preemption`, `drain`, `preempted`) and whether a node was blamed |
//! | `trainyard_nodes_cordoned` | gauge | nodes that take no new work: cordoned by an operator or after repeated blamed failures |
//! | `trainyard_agents_connected` | gauge | agents with an open stream |
//! | `trainyard_agents_known` | gauge | agents ever seen |
//! | `trainyard_agent_hellos_total` | counter | agent streams accepted (a hello stored): every connect and reconnect |
//! | `trainyard_hosts_taken_back_total` | counter | silent hosts an attempt waited for that came back with its ranks alive (no restart) |
//! | `trainyard_receipts_ingested_total` | counter | receipts stored (replays not counted) |
//! | `trainyard_receipts_skipped_total` | counter | lines acknowledged but not stored (not JSON objects, replays) |
//! | `trainyard_receipts_unknown_job_total` | counter | receipts of jobs this controller does not know: neither stored nor acknowledged (the agent keeps them) |
//! | `trainyard_receipts_flagged_total` | counter | receipts stored flagged: they break schema v1 |
//! | `trainyard_receipt_batch_seconds` | histogram | a receipt batch from arrival to committed |
//! | `trainyard_store_operation_seconds{op}` | histogram | every store transaction, retries included (`trainyard_store::metrics`) |
//! | `trainyard_store_errors_total{op}` | counter | store operations that failed (`trainyard_store::metrics`) |
//! | `trainyard_schedule_pass_seconds` | histogram | one scheduling pass |
//! | `trainyard_gpu_windows_total` | counter | GPU telemetry windows stored (resends not counted) |
//! | `trainyard_gpu_xids_total{xid}` | counter | XIDs agents reported, by number |
//! | `trainyard_job_finding{job,cause,node}` | gauge | 1 while the live diagnosis holds a finding open (alert on it: `deploy/prometheus/trainyard-alerts.yml`) |
//! | `trainyard_alerts_total{outcome}` | counter | webhook alert deliveries: `delivered`, `failed` (retried later) |
//! | `trainyard_live_diagnosis_seconds` | histogram | one round of the live diagnosis over every running job |
//! | `trainyard_live_diagnosis_cpu_seconds_total` | counter | CPU time the live diagnosis's task took on the controller's threads (its finding writes and alerts included; a query's execution on SQLite's worker thread or in PostgreSQL not) |
//! | `trainyard_controller_is_leader` | gauge | 1 while this controller leads its group (on SQLite: 1) |
//! | `trainyard_controller_epoch` | gauge | the epoch of the lease it leads under |
//! | `trainyard_lease_renewals_total`, `trainyard_lease_failures_total` | counter | lease renewals that succeeded, and that could not reach the database |
//! | `trainyard_connections_turned_away_total` | counter | new gRPC and HTTPS connections closed at accept: their address is limited for a flood of calls without a valid credential |
//!
//! Metrics are process-wide ([`metrics`]): the store, the core and the services record into
//! them without passing a handle around; the gauges are set from the core when scraped.

use std::sync::OnceLock;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabel {
    pub state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct XidLabel {
    pub xid: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FindingLabel {
    pub job: String,
    pub cause: String,
    pub node: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FailureLabel {
    pub kind: String,
    pub blamed: String,
}

/// 0.25 ms to ~8 s, doubling: store transactions and receipt batches.
fn latency() -> Histogram {
    Histogram::new(exponential_buckets(0.000_25, 2.0, 16))
}

pub struct Metrics {
    registry: Registry,
    pub jobs: Family<StateLabel, Gauge>,
    pub jobs_finished: Family<StateLabel, Counter>,
    pub failures: Family<FailureLabel, Counter>,
    pub nodes_cordoned: Gauge,
    pub agents_connected: Gauge,
    pub agents_known: Gauge,
    pub agent_hellos: Counter,
    pub hosts_taken_back: Counter,
    pub receipts_ingested: Counter,
    pub receipts_skipped: Counter,
    pub receipts_unknown_job: Counter,
    pub receipts_flagged: Counter,
    pub receipt_batch: Histogram,
    pub schedule_pass: Histogram,
    pub connections_turned_away: Counter,
    pub gpu_windows_stored: Counter,
    pub xids: Family<XidLabel, Counter>,
    pub job_finding: Family<FindingLabel, Gauge>,
    pub alerts: Family<OutcomeLabel, Counter>,
    pub live_diagnosis: Histogram,
    pub live_diagnosis_cpu: Counter<f64, std::sync::atomic::AtomicU64>,
    pub is_leader: Gauge,
    pub epoch: Gauge,
    pub lease_renewals: Counter,
    pub lease_failures: Counter,
}

/// The process's metrics, registered on first use.
pub fn metrics() -> &'static Metrics {
    static METRICS: OnceLock<Metrics> = OnceLock::new();
    METRICS.get_or_init(Metrics::new)
}

impl Metrics {
    fn new() -> Metrics {
        let mut registry = Registry::with_prefix("trainyard");
        let m = Metrics {
            jobs: Family::default(),
            jobs_finished: Family::default(),
            failures: Family::default(),
            nodes_cordoned: Gauge::default(),
            agents_connected: Gauge::default(),
            agents_known: Gauge::default(),
            agent_hellos: Counter::default(),
            hosts_taken_back: Counter::default(),
            receipts_ingested: Counter::default(),
            receipts_skipped: Counter::default(),
            receipts_unknown_job: Counter::default(),
            receipts_flagged: Counter::default(),
            receipt_batch: latency(),
            schedule_pass: Histogram::new(exponential_buckets(0.000_1, 2.0, 16)),
            connections_turned_away: Counter::default(),
            gpu_windows_stored: Counter::default(),
            xids: Family::default(),
            job_finding: Family::default(),
            alerts: Family::default(),
            live_diagnosis: latency(),
            live_diagnosis_cpu: Counter::default(),
            is_leader: Gauge::default(),
            epoch: Gauge::default(),
            lease_renewals: Counter::default(),
            lease_failures: Counter::default(),
            registry: Registry::default(),
        };
        registry.register("jobs", "Jobs the controller holds (not finished), by state", m.jobs.clone());
        registry.register(
            "jobs_finished",
            "Jobs that reached a final state since start",
            m.jobs_finished.clone(),
        );
        registry.register(
            "failures",
            "Failures that ended a job attempt, by kind and whether a node was blamed",
            m.failures.clone(),
        );
        registry.register(
            "nodes_cordoned",
            "Nodes that take no new work: cordoned by an operator or after repeated blamed failures",
            m.nodes_cordoned.clone(),
        );
        registry.register("agents_connected", "Agents with an open stream", m.agents_connected.clone());
        registry.register(
            "agent_hellos",
            "Agent streams accepted (every connect and reconnect, after a failover too)",
            m.agent_hellos.clone(),
        );
        registry.register("agents_known", "Agents ever seen", m.agents_known.clone());
        registry.register(
            "hosts_taken_back",
            "Silent hosts an attempt waited for that came back with its ranks alive (no restart)",
            m.hosts_taken_back.clone(),
        );
        m.register_receipts(&mut registry);
        trainyard_store::metrics::metrics().register(&mut registry);
        registry.register("schedule_pass_seconds", "One scheduling pass", m.schedule_pass.clone());
        registry.register(
            "connections_turned_away",
            "New gRPC and HTTPS connections closed at accept: their address is limited for a flood of calls without a valid credential",
            m.connections_turned_away.clone(),
        );
        m.register_telemetry_and_group(&mut registry);
        Metrics { registry, ..m }
    }

    /// The receipts' metrics: stored, skipped, refused, flagged, and a batch's latency.
    fn register_receipts(&self, registry: &mut Registry) {
        let m = self;
        registry.register("receipts_ingested", "Receipts stored", m.receipts_ingested.clone());
        registry.register(
            "receipts_skipped",
            "Receipt lines acknowledged but not stored (not JSON objects, replays)",
            m.receipts_skipped.clone(),
        );
        registry.register(
            "receipts_unknown_job",
            "Receipts of jobs this controller does not know, neither stored nor acknowledged",
            m.receipts_unknown_job.clone(),
        );
        registry.register(
            "receipts_flagged",
            "Receipts stored flagged because they break receipt schema v1",
            m.receipts_flagged.clone(),
        );
        registry.register(
            "receipt_batch_seconds",
            "A receipt batch from arrival to committed",
            m.receipt_batch.clone(),
        );
    }

    /// The GPU telemetry, live diagnosis and controller group metrics.
    fn register_telemetry_and_group(&self, registry: &mut Registry) {
        let m = self;
        registry.register("gpu_windows", "GPU telemetry windows stored", m.gpu_windows_stored.clone());
        registry.register("gpu_xids", "XIDs agents reported, by number", m.xids.clone());
        registry.register(
            "job_finding",
            "1 while the live diagnosis holds a finding of a running job open",
            m.job_finding.clone(),
        );
        registry.register("alerts", "Webhook alert deliveries, by outcome", m.alerts.clone());
        registry.register(
            "live_diagnosis_seconds",
            "One round of the live diagnosis over every running job",
            m.live_diagnosis.clone(),
        );
        registry.register(
            "live_diagnosis_cpu_seconds",
            "CPU time the live diagnosis's task took on the controller's threads",
            m.live_diagnosis_cpu.clone(),
        );
        registry.register(
            "controller_is_leader",
            "1 while this controller leads its group",
            m.is_leader.clone(),
        );
        registry.register(
            "controller_epoch",
            "The epoch of the lease this controller leads under",
            m.epoch.clone(),
        );
        registry.register("lease_renewals", "Lease renewals that succeeded", m.lease_renewals.clone());
        registry.register(
            "lease_failures",
            "Lease renewals that could not reach the database",
            m.lease_failures.clone(),
        );
    }

    /// Records whether this controller leads, and under which epoch.
    pub fn leading(&self, leading: bool, epoch: u64) {
        self.is_leader.set(i64::from(leading));
        self.epoch.set(i64::try_from(epoch).unwrap_or(i64::MAX));
    }

    /// Counts an alert delivery.
    pub fn alert(&self, delivered: bool) {
        let outcome = if delivered { "delivered" } else { "failed" };
        self.alerts.get_or_create(&OutcomeLabel { outcome }).inc();
    }

    /// Counts an XID.
    pub fn xid(&self, number: u32) {
        self.xids.get_or_create(&XidLabel { xid: number.to_string() }).inc();
    }

    /// The metrics in the OpenMetrics text format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// The content type of [`Metrics::encode`].
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
