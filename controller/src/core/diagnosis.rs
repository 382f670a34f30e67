//! The diagnosis service: `Diagnose`, `Compare`, goodput and live findings. It gathers what
//! [`trainyard_analysis::diagnose`] reads (an attempt's step receipts and allocations from the
//! store, the nodes' inventories and newest preflight reports from memory, the cost model's
//! prediction for the placement) and runs it; at a job's end it records the job's goodput and
//! findings.

use std::collections::BTreeMap;

use super::receipts::Receipts;
use super::shared::Shared;
use super::{ControllerError, Result};
use trainyard_analysis::diagnose::compare::{
    self, Comparison, Distribution, PROVENANCE_KEYS, PlacedNode, Side,
};
use trainyard_analysis::diagnose::goodput::{self, Goodput};
use trainyard_analysis::diagnose::{self, Diagnosis, Input, NodeFacts, StepSample, stragglers};
use trainyard_model::domain::CheckStatus;
use trainyard_proto::words::ReceiptKind;
use trainyard_store::LiveFinding;
use trainyard_store::{Allocation, GpuWindowRecord, JobId, JobRecord};

/// What one attempt's diagnosis reads.
struct Evidence {
    record: JobRecord,
    attempt: u32,
    allocations: Vec<Allocation>,
    samples: Vec<StepSample>,
    nodes: BTreeMap<String, NodeFacts>,
    predicted_comm_ms: f64,
    windows: Vec<GpuWindowRecord>,
}

impl Evidence {
    fn diagnose(&self) -> Diagnosis {
        diagnose::diagnose(&Input {
            spec: &self.record.spec,
            attempt: self.attempt,
            allocations: &self.allocations,
            samples: &self.samples,
            nodes: &self.nodes,
            predicted_comm_ms: self.predicted_comm_ms,
            windows: &self.windows,
        })
    }
}

/// Ended jobs whose outcome is recorded at once, at most ([`Diagnoses::record_outcome`]).
pub(super) const OUTCOMES_AT_ONCE: usize = 2;

/// Telemetry windows a diagnosis reads at most (64 GPUs x 10 s windows for about 4.5 hours).
const MAX_WINDOWS: u32 = 100_000;

/// Diagnoses, comparisons, goodput and live findings ([`super::Controller::diagnoses`]).
#[derive(Clone, Copy)]
pub struct Diagnoses<'c> {
    pub(super) c: &'c Shared,
}

impl Diagnoses<'_> {
    /// Diagnoses `attempt` of a job (default: its current attempt).
    pub async fn diagnose(self, job_id: JobId, attempt: Option<u32>) -> Result<Diagnosis> {
        Ok(self.evidence(job_id, attempt).await?.diagnose())
    }

    /// Where the job's wall time went, attempt by attempt (until now for a running attempt).
    pub async fn goodput(self, job_id: JobId) -> Result<Goodput> {
        Ok(self.goodput_and_facts(job_id).await?.0)
    }

    /// [`Diagnoses::goodput`] and the facts of the job's current attempt it was computed from
    /// (its last step, for progress): one pass over the receipts, not two.
    pub async fn goodput_and_facts(self, job_id: JobId) -> Result<(Goodput, goodput::AttemptFacts)> {
        let record = self.c.store.get_job(job_id).await?.ok_or(ControllerError::JobNotFound(job_id))?;
        let events = self.c.store.job_events(job_id).await?;
        let mut facts = Vec::new();
        for attempt in 0..=record.attempt {
            let mut f = self.c.store.attempt_facts(job_id, attempt).await?;
            f.place_in(&events);
            facts.push(f);
        }
        let g = goodput::goodput(&facts, self.c.now_ms());
        Ok((g, facts.pop().unwrap_or_default()))
    }

    /// Records an ended job's goodput and its last attempt's findings (tables
    /// `attempt_goodput`, `job_findings`). A failure is logged: the live answers of
    /// `ctl status` and `ctl diagnose` do not depend on it.
    ///
    /// First the job's last step receipts are folded into its plot rollups, once they settled.
    /// At most [`OUTCOMES_AT_ONCE`] jobs are recorded at a time: each reads all of its step
    /// receipts, and at 1,000 hosts jobs end several times a second; unbounded, their reads
    /// held the store's connections that receipt batches and rank reports wait for.
    pub(super) async fn record_outcome(self, job_id: JobId) {
        tokio::time::sleep(std::time::Duration::from_millis(trainyard_analysis::series::SETTLE_MS as u64))
            .await;
        let Ok(_turn) = self.c.outcomes.acquire().await else { return };
        if let Err(e) = (Receipts { c: self.c }).fold(job_id).await {
            tracing::warn!(job_id, error = %e, "could not fold the job's step receipts for its plots");
        }
        let outcome = async {
            let goodput = self.goodput(job_id).await?;
            let evidence = self.evidence(job_id, None).await?;
            let diagnosis = evidence.diagnose();
            self.c
                .store
                .record_outcome(job_id, &goodput, evidence.attempt, &diagnosis.findings, self.c.now_ms())
                .await?;
            Ok::<_, ControllerError>(diagnosis.verdict())
        };
        match outcome.await {
            Ok(verdict) => tracing::info!(job_id, verdict, "job outcome recorded"),
            Err(e) => tracing::warn!(job_id, error = %e, "could not record the job's goodput and findings"),
        }
    }

    /// Compares the current attempts of two jobs; `a` is the reference.
    pub async fn compare(self, a: JobId, b: JobId) -> Result<Comparison> {
        let a = self.side(a).await?;
        let b = self.side(b).await?;
        Ok(compare::compare(a, b))
    }

    async fn evidence(self, job_id: JobId, attempt: Option<u32>) -> Result<Evidence> {
        let record = self.c.store.get_job(job_id).await?.ok_or(ControllerError::JobNotFound(job_id))?;
        let attempt = attempt.unwrap_or(record.attempt);
        if attempt > record.attempt {
            return Err(ControllerError::BadRequest(format!(
                "job {job_id} has no attempt {attempt}; its attempts are 0 to {}",
                record.attempt
            )));
        }
        let allocations = self.c.store.allocations(job_id, attempt).await?;
        let samples = self.c.store.step_samples(job_id, attempt).await?;
        let windows = self.c.store.attempt_gpu_windows(job_id, attempt, MAX_WINDOWS).await?;
        let (nodes, predicted_comm_ms) = {
            let core = self.c.lock();
            let nodes = super::view::node_facts(&core, &allocations);
            (nodes, super::view::predicted_comm_ms(&core, &allocations, &record.spec))
        };
        Ok(Evidence { record, attempt, allocations, samples, nodes, predicted_comm_ms, windows })
    }

    async fn side(self, job_id: JobId) -> Result<Side> {
        let evidence = self.evidence(job_id, None).await?;
        let diagnosis = evidence.diagnose();
        let launch =
            self.c.store.first_receipt(job_id, evidence.attempt, ReceiptKind::Launch.as_str()).await?;
        let provenance = launch.as_deref().map(provenance_of).unwrap_or_default();
        let last_step = evidence.samples.iter().map(|s| s.step).max().unwrap_or(0);
        let first_step = evidence.samples.iter().map(|s| s.step).filter(|s| *s >= 0).min().unwrap_or(0);
        let warmup = stragglers::steady_from(first_step, last_step);
        let steady = || evidence.samples.iter().filter(move |s| s.step >= warmup);
        let nodes = diagnosis
            .nodes
            .iter()
            .map(|n| {
                let report = evidence.nodes.get(&n.agent_id).and_then(|f| f.preflight.as_ref());
                PlacedNode {
                    agent_id: n.agent_id.clone(),
                    ranks: n.ranks.len() as u32,
                    numa_layout: n.numa_layout.clone(),
                    class: report.and_then(|r| r.interconnect_class),
                    verdict: report.map(|r| r.verdict),
                    problems: report
                        .map(|r| {
                            r.checks
                                .iter()
                                .filter(|c| matches!(c.status, CheckStatus::Warn | CheckStatus::Fail))
                                .map(|c| format!("{}: {}", c.id, c.measured))
                                .collect()
                        })
                        .unwrap_or_default(),
                }
            })
            .collect();
        Ok(Side {
            job_id,
            name: evidence.record.spec.name.clone(),
            state: evidence.record.state.to_string(),
            attempt: evidence.attempt,
            provenance,
            env: evidence.record.spec.env.clone(),
            nodes,
            step_time_ms: Distribution::of(steady().filter_map(|s| s.step_time_ms)),
            tokens_per_s: Distribution::of(steady().filter_map(|s| s.tokens_per_s)),
            diagnosis,
        })
    }

    /// A job's live findings, open and closed, oldest first.
    pub async fn live_findings(self, job: JobId) -> Result<Vec<LiveFinding>> {
        if self.c.store.get_job(job).await?.is_none() {
            return Err(super::ControllerError::JobNotFound(job));
        }
        Ok(self.c.store.live_findings(job, 0).await?)
    }
}

/// The provenance fields of a launch receipt, as text.
fn provenance_of(body: &str) -> BTreeMap<String, String> {
    let Ok(serde_json::Value::Object(fields)) = serde_json::from_str::<serde_json::Value>(body) else {
        return BTreeMap::new();
    };
    PROVENANCE_KEYS
        .iter()
        .filter_map(|k| {
            let text = match fields.get(*k)? {
                serde_json::Value::Null => return None,
                serde_json::Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            Some((k.to_string(), text))
        })
        .collect()
}
