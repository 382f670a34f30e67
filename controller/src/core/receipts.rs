//! The receipts service: step receipts and GPU telemetry in from the agents, and the reads of
//! them the outer layers make (a job's receipts past a cursor, telemetry windows, the plots'
//! step rollups).
//!
//! Ingest is the hot path and takes no lock on the controller's state: a batch is checked (an
//! agent speaks only for its own ranks), stored in one transaction, and acknowledged with the
//! highest seq per rank; only then may the agent forget it.

use std::collections::BTreeMap;

use trainyard_analysis::series::{Metric, RollupRow};
use trainyard_model::receipts;
use trainyard_proto::telemetry;
use trainyard_proto::v1::{RankAck, ReceiptAck, ReceiptBatch, TelemetryAck, TelemetryBatch};
use trainyard_store::{GpuWindowRecord, JobId, NewReceipt, RankId, StoredReceiptRecord};

use super::Result;
use super::agents::{rank_id, rank_key};
use super::shared::Shared;

/// Receipts one fold pass reads.
const FOLD_PASS: u32 = 100_000;

/// A receipt batch checked and queued for the store ([`Receipts::queue`]): what is left is
/// its commit, after which the agent may forget it.
struct QueuedBatch<'c> {
    c: &'c Shared,
    commit: trainyard_store::Queued<'c>,
    /// Jobs whose first receipt over quota came in this batch: noted as events after the
    /// commit. Nothing between queueing a batch and waiting for its commit may wait for a store
    /// write: the batch queued before it, not polled meanwhile, may hold the writer's turn.
    over_quota: Vec<(JobId, String)>,
    /// Whether any row was queued (the reconciler is woken after the commit).
    any: bool,
    /// Receipts received, held back (unknown job), flagged.
    counts: (u64, u64, u64),
    arrived: std::time::Instant,
    ack: ReceiptAck,
}

impl QueuedBatch<'_> {
    /// Waits for the batch's commit; returns the ack to send back (the highest seq per rank).
    /// Takes no lock on the controller's state.
    async fn stored(self) -> Result<ReceiptAck> {
        let stored = self.commit.await?;
        (Receipts { c: self.c }).note_over_quota(self.over_quota).await;
        if self.any {
            self.c.bump();
        }
        let (received, held_back, flagged) = self.counts;
        count_batch(received, stored, held_back, flagged, self.arrived);
        Ok(self.ack)
    }
}

/// Receipts and telemetry, in and out ([`super::Controller::receipts`]).
#[derive(Clone, Copy)]
pub struct Receipts<'c> {
    pub(super) c: &'c Shared,
}

impl<'c> Receipts<'c> {
    /// Reads from the store what the batch's jobs not seen since this controller started have
    /// stored of their quota; returns the unfinished jobs, whose use counts against their users'.
    async fn seed_quotas(
        self,
        receipts: &[trainyard_proto::v1::Receipt],
    ) -> Result<std::collections::HashSet<JobId>> {
        let jobs: std::collections::BTreeSet<JobId> =
            receipts.iter().filter_map(|r| r.key.map(|k| k.job_id)).collect();
        let (users, active) = {
            let core = self.c.lock();
            let users: Vec<(JobId, String)> = jobs
                .iter()
                .filter(|j| !self.c.quotas.knows(**j))
                .filter_map(|j| core.jobs.get(j).map(|a| (*j, a.record().owner.user.clone())))
                .collect();
            let active = core
                .jobs
                .iter()
                .filter(|(_, a)| !a.record().state.is_terminal())
                .map(|(id, _)| *id)
                .collect();
            (users, active)
        };
        self.c.quotas.seed_each(users, |job| self.c.store.receipt_bytes(job)).await?;
        Ok(active)
    }

    /// A receipt's body as it is stored: a launch receipt's `[env]` values (tokens, passwords)
    /// as their keyed hashes, which compare; every other body as it came.
    fn stored_body(self, job_id: JobId, kind: &str, body: String) -> String {
        if kind != "launch" {
            return body;
        }
        let overlay: Option<Vec<String>> =
            self.c.lock().jobs.get(&job_id).map(|j| j.record().spec.env.keys().cloned().collect());
        self.c.keys.hash_launch_env(&body, overlay.as_deref()).unwrap_or(body)
    }

    /// A job's first receipt over its quota is an event of the job (the count is its warning).
    async fn note_over_quota(self, over_quota: Vec<(JobId, String)>) {
        for (job_id, why) in over_quota {
            let reason = format!("receipts dropped from now on, not stored: {why}");
            if let Err(e) = self.c.store.note_job_event(job_id, &reason, self.c.now_ms()).await {
                tracing::warn!(job_id, error = %e, "could not record the quota event");
            }
        }
    }

    /// Stores a batch of receipts (one transaction) and returns the ack to send back: the
    /// highest seq per rank of the batch ([`Receipts::queue`], then its commit).
    pub async fn ingest(self, agent_id: &str, batch: ReceiptBatch) -> Result<ReceiptAck> {
        self.queue(agent_id, batch).await?.stored().await
    }

    /// Checks a batch and queues its rows for the store's next commit group; the returned
    /// [`QueuedBatch`] waits for the commit and makes the ack.
    async fn queue(self, agent_id: &str, batch: ReceiptBatch) -> Result<QueuedBatch<'c>> {
        let arrived = std::time::Instant::now();
        let received = batch.receipts.len() as u64;
        let mut highest: BTreeMap<RankId, u64> = BTreeMap::new();
        let mut rows = Vec::with_capacity(batch.receipts.len());
        let (mut not_objects, mut flagged) = (0, 0);
        let mut news: BTreeMap<(u64, u32), super::steps::StepNews> = BTreeMap::new();
        let (active, quota) = (self.seed_quotas(&batch.receipts).await?, self.c.config.receipt_quota);
        let mut users = self.c.quotas.users(&|j| active.contains(&j));
        let mut over_quota: Vec<(JobId, String)> = Vec::new();
        for r in batch.receipts {
            let Some(id) = r.key.map(rank_id) else { continue };
            let seq = highest.entry(id).or_insert(r.seq);
            *seq = (*seq).max(r.seq);
            // Agents send only lines that parse as JSON objects; the views of both stores
            // read bodies as JSON, so anything else is acked and left out here.
            let Ok(checked) = receipts::check(&r.kind, &r.body) else {
                not_objects += 1;
                continue;
            };
            flagged += usize::from(checked.problem.is_some());
            // Past its quota a receipt is acknowledged (in `highest` above) but not stored.
            let bytes = r.body.len() as u64;
            let admit = self.c.quotas.admit(&quota, id.job_id, r.kind == "step", bytes, &mut users);
            if let super::quota::Admit::Drop { first: true, why } = &admit {
                tracing::warn!(job_id = id.job_id, %why, "receipts over quota: dropped, not stored, from now on");
                over_quota.push((id.job_id, why.clone()));
            }
            if admit != super::quota::Admit::Store {
                continue;
            }
            let step = (r.step >= 0).then_some(r.step);
            super::steps::note_receipt(&mut news, id, (&r.kind, step), &r.body, checked.metrics.as_ref());
            let (problem, metrics) = (checked.problem, checked.metrics);
            let body = self.stored_body(id.job_id, &r.kind, r.body);
            rows.push(NewReceipt { id, seq: r.seq, kind: r.kind, step, body, problem, metrics });
        }
        if not_objects > 0 {
            tracing::warn!(not_objects, "dropping receipts whose body is not a JSON object");
        }
        if flagged > 0 {
            tracing::debug!(
                flagged,
                "storing receipts that break receipt schema v1, flagged (receipts.problem)"
            );
        }
        let mut held_back = 0;
        for job_id in
            super::agents::check_senders(self.c.store.as_ref(), &self.c.core, agent_id, &highest).await?
        {
            // Not acknowledged: the agent keeps them in the rank's file (up to its window) and
            // sends them again on its next stream, so nothing is lost if this controller is the
            // wrong one or its database is being restored.
            let held = rows.iter().filter(|r| r.id.job_id == job_id).count();
            tracing::warn!(
                agent_id,
                job_id,
                receipts = held,
                "receipts of a job this controller does not know: not stored and not acknowledged; the agent keeps them"
            );
            held_back += held as u64;
            rows.retain(|r| r.id.job_id != job_id);
            highest.retain(|id, _| id.job_id != job_id);
        }
        news.retain(|(job_id, _), _| highest.keys().any(|id| id.job_id == *job_id));
        self.c.steps.note(news);
        let any = !rows.is_empty();
        let acks = highest.into_iter().map(|(id, seq)| RankAck { key: Some(rank_key(id)), seq }).collect();
        Ok(QueuedBatch {
            c: self.c,
            commit: self.c.store.queue_receipts(rows, self.c.now_ms()),
            over_quota,
            any,
            counts: (received, held_back, flagged as u64),
            arrived,
            ack: ReceiptAck { acks },
        })
    }

    /// Stores a batch of GPU windows and returns its ack. Takes the core lock only to act on
    /// an XID.
    pub async fn telemetry(self, agent_id: &str, batch: TelemetryBatch) -> Result<TelemetryAck> {
        let mut named: BTreeMap<RankId, u64> = BTreeMap::new();
        for w in &batch.windows {
            for s in w.steps.iter().filter_map(|s| s.key) {
                named.insert(rank_id(s), 0);
            }
        }
        let unknown =
            super::agents::check_senders(self.c.store.as_ref(), &self.c.core, agent_id, &named).await?;
        let records: Vec<GpuWindowRecord> =
            batch.windows.iter().map(|w| super::telemetry::window_record(agent_id, w, &unknown)).collect();
        let stored = self.c.store.insert_gpu_windows(&records).await?;
        crate::metrics::metrics().gpu_windows_stored.inc_by(stored);
        for r in records.iter().filter(|r| !r.xids.is_empty()) {
            for &number in &r.xids {
                super::telemetry::on_xid(&super::reconcile::Reconciler(self.c), r, telemetry::xid(number))
                    .await?;
            }
        }
        Ok(TelemetryAck { id: batch.id })
    }

    /// Folds every settled step receipt of the job into its plot rollups
    /// ([`trainyard_analysis::series`]), in passes of `FOLD_PASS` receipts.
    pub async fn fold(self, job_id: JobId) -> Result<()> {
        let settled = self.c.now_ms() - trainyard_analysis::series::SETTLE_MS;
        while self.c.store.roll_up_steps(job_id, settled, FOLD_PASS).await? == u64::from(FOLD_PASS) {}
        Ok(())
    }

    /// A job's receipts stored after position `after`, in position order, at most `limit`.
    pub async fn after(self, job: JobId, after: u64, limit: u32) -> Result<Vec<StoredReceiptRecord>> {
        Ok(self.c.store.receipts_after(job, after, limit).await?)
    }

    /// The GPU telemetry windows of one attempt, by start time, at most `limit`.
    pub async fn gpu_windows(self, job: JobId, attempt: u32, limit: u32) -> Result<Vec<GpuWindowRecord>> {
        Ok(self.c.store.attempt_gpu_windows(job, attempt, limit).await?)
    }

    /// The folded steps of an attempt (first step, last step, ranks); `None` before any.
    pub async fn rollup_extent(self, job: JobId, attempt: u32) -> Result<Option<(i64, i64, u32)>> {
        Ok(self.c.store.rollup_extent(job, attempt).await?)
    }

    /// One metric's rollup rows of one level over a range of buckets, every rank.
    pub async fn rollup_rows(
        self,
        job: JobId,
        attempt: u32,
        metric: Metric,
        level: i64,
        buckets: (i64, i64),
    ) -> Result<Vec<RollupRow>> {
        Ok(self.c.store.rollup_rows(job, attempt, metric, level, buckets.0, buckets.1).await?)
    }
}

/// A batch in `/metrics`: stored, skipped, held back (unknown job), flagged, and how long it took.
fn count_batch(received: u64, stored: u64, held_back: u64, flagged: u64, arrived: std::time::Instant) {
    let m = crate::metrics::metrics();
    m.receipts_ingested.inc_by(stored);
    m.receipts_skipped.inc_by(received.saturating_sub(stored + held_back));
    m.receipts_unknown_job.inc_by(held_back);
    m.receipts_flagged.inc_by(flagged);
    m.receipt_batch.observe(arrived.elapsed().as_secs_f64());
}
