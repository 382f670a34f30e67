//! [`DiagnosisStore`]: what diagnosis, goodput and stall detection read out of the receipts,
//! and the outcome recorded when a job ends.

use async_trait::async_trait;
use trainyard_analysis::diagnose::goodput::{AttemptFacts, Goodput};
use trainyard_analysis::diagnose::stall::StepProgress;
use trainyard_analysis::diagnose::{Finding, StepSample};

use crate::rows::{self, int};
use crate::sql::Conn;
use crate::{DiagnosisStore, JobId, Result, SqlStore};

#[async_trait]
impl DiagnosisStore for SqlStore {
    async fn step_samples(&self, job: JobId, attempt: u32) -> Result<Vec<StepSample>> {
        self.read("step_samples", async |c| {
            // Sorted here, not by the database: without an order it reads the heap page by
            // page instead of row by row in index order (an ended job's receipts lie spread
            // among every other job's).
            let found = c
                .query(
                    "SELECT rank, seq, step, step_time_ms, fwd_bwd_ms, optimizer_ms, tokens_per_s, problem \
                     FROM receipts WHERE job_id = $1 AND attempt = $2 AND kind = 'step'",
                )
                .bind(int(job)?)
                .bind(i64::from(attempt))
                .all()
                .await?;
            let mut keyed = found
                .iter()
                .map(|row| Ok((row.num::<u64>("receipts", "seq")?, rows::step_sample(row)?)))
                .collect::<Result<Vec<_>>>()?;
            keyed.sort_unstable_by_key(|(seq, s)| (s.rank, *seq));
            Ok(keyed.into_iter().map(|(_, s)| s).collect())
        })
        .await
    }

    async fn latest_step_samples_after(
        &self,
        job: JobId,
        attempt: u32,
        after: u64,
        limit: u32,
    ) -> Result<Vec<(u64, StepSample)>> {
        self.read("latest_step_samples_after", async |c| {
            let found = c
                .query(
                    "SELECT * FROM (SELECT position, rank, step, step_time_ms, fwd_bwd_ms, optimizer_ms, \
                     tokens_per_s, problem FROM receipts WHERE job_id = $1 AND position > $2 AND attempt = $3 \
                     AND kind = 'step' ORDER BY position DESC LIMIT $4) AS newest ORDER BY position",
                )
                .bind(int(job)?)
                .bind(int(after)?)
                .bind(i64::from(attempt))
                .bind(i64::from(limit))
                .all()
                .await?;
            found.iter().map(|row| Ok((row.num("receipts", "position")?, rows::step_sample(row)?))).collect()
        })
        .await
    }

    async fn step_progress(&self, job: JobId, attempt: u32) -> Result<StepProgress> {
        self.read("step_progress", async |c| {
            let t = "receipts";
            let found = c
                .query(
                    "SELECT rank, max(step) AS step, max(stored_at_ms) AS at_ms FROM receipts \
                     WHERE job_id = $1 AND attempt = $2 AND kind = 'step' AND step IS NOT NULL GROUP BY rank",
                )
                .bind(int(job)?)
                .bind(i64::from(attempt))
                .all()
                .await?;
            let ranks = found
                .iter()
                .map(|r| Ok((r.num(t, "rank")?, r.get(t, "step")?, r.get(t, "at_ms")?)))
                .collect::<Result<_>>()?;
            let recent = c
                .query(
                    "SELECT step_time_ms FROM receipts WHERE job_id = $1 AND attempt = $2 AND kind = 'step' \
                     ORDER BY position DESC LIMIT 200",
                )
                .bind(int(job)?)
                .bind(i64::from(attempt))
                .all()
                .await?;
            let recent_step_ms =
                recent.iter().map(|r| r.get::<Option<f64>>(t, "step_time_ms")).collect::<Result<Vec<_>>>()?;
            Ok(StepProgress { ranks, recent_step_ms: recent_step_ms.into_iter().flatten().collect() })
        })
        .await
    }

    async fn first_receipt(&self, job: JobId, attempt: u32, kind: &str) -> Result<Option<String>> {
        self.read("first_receipt", async |c| {
            let row = c
                .query(
                    "SELECT body FROM receipts WHERE job_id = $1 AND attempt = $2 AND kind = $3 \
                     ORDER BY rank, seq LIMIT 1",
                )
                .bind(int(job)?)
                .bind(i64::from(attempt))
                .bind(kind)
                .optional()
                .await?;
            row.map(|r| r.get("receipts", "body")).transpose()
        })
        .await
    }

    async fn attempt_facts(&self, job: JobId, attempt: u32) -> Result<AttemptFacts> {
        self.read("attempt_facts", async |c| read_attempt_facts(c, job, attempt).await).await
    }

    async fn record_outcome(
        &self,
        job: JobId,
        goodput: &Goodput,
        attempt: u32,
        findings: &[Finding],
        now_ms: i64,
    ) -> Result<()> {
        let findings: Vec<FindingRow> = findings.iter().map(FindingRow::of).collect();
        self.write("record_outcome", async |c| {
            let id = int(job)?;
            c.query("DELETE FROM attempt_goodput WHERE job_id = $1").bind(id).execute().await?;
            c.query("DELETE FROM job_findings WHERE job_id = $1").bind(id).execute().await?;
            for a in &goodput.attempts {
                c.query(
                    "INSERT INTO attempt_goodput (job_id, attempt, wall_ms, startup_ms, train_ms, eval_ms, \
                     checkpoint_ms, restart_ms, lost_ms, steps_redone, other_ms, recorded_at_ms) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)",
                )
                .bind(id)
                .bind(i64::from(a.attempt))
                .bind(a.wall_ms)
                .bind(a.startup_ms)
                .bind(a.train_ms)
                .bind(a.eval_ms)
                .bind(a.checkpoint_ms)
                .bind(a.restart_ms)
                .bind(a.lost_ms)
                .bind(int(a.steps_redone)?)
                .bind(a.other_ms)
                .bind(now_ms)
                .execute()
                .await?;
            }
            for (position, f) in findings.iter().enumerate() {
                c.query(
                    "INSERT INTO job_findings (job_id, attempt, position, cause, summary, nodes, ranks, \
                     evidence, remedy, recorded_at_ms) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
                )
                .bind(id)
                .bind(i64::from(attempt))
                .bind(position as i64)
                .bind(f.cause)
                .bind(f.summary)
                .bind(f.nodes.as_str())
                .bind(f.ranks.as_str())
                .bind(f.evidence.as_str())
                .bind(f.remedy)
                .bind(now_ms)
                .execute()
                .await?;
            }
            Ok(())
        })
        .await
    }

    async fn mean_optimizer_ms(&self, job: JobId) -> Result<Option<f64>> {
        self.read("mean_optimizer_ms", async |c| {
            let row = c
                .query(
                    "SELECT avg(optimizer_ms) AS ms FROM (SELECT optimizer_ms FROM receipts \
                     WHERE job_id = $1 AND kind = 'step' AND optimizer_ms IS NOT NULL \
                     ORDER BY position DESC LIMIT 1000) AS latest",
                )
                .bind(int(job)?)
                .one()
                .await?;
            row.get("receipts", "ms")
        })
        .await
    }
}

/// What the step, eval and checkpoint receipts of one attempt's reporting rank say about where
/// its time went. The reporting rank is rank 0, or the lowest rank with step receipts when rank
/// 0 has none (Megatron-LM prints its steps from the last rank; a rank may write none of its
/// own).
async fn read_attempt_facts(c: &mut Conn<'_>, job: JobId, attempt: u32) -> Result<AttemptFacts> {
    let t = "receipts";
    let mut facts = AttemptFacts { attempt, ..Default::default() };
    let reporting = c
        .query("SELECT min(rank) AS rank FROM receipts WHERE job_id = $1 AND attempt = $2 AND kind = 'step'")
        .bind(int(job)?)
        .bind(i64::from(attempt))
        .one()
        .await?;
    let rank: i64 = reporting.get::<Option<i64>>(t, "rank")?.unwrap_or(0);
    // The steps are summed where they lie: a long run has one row per step.
    let totals = c
        .query(
            "SELECT count(*) AS steps, max(step) AS last_step, coalesce(sum(step_time_ms), 0.0) AS train_ms \
             FROM receipts WHERE job_id = $1 AND attempt = $2 AND rank = $3 AND kind = 'step'",
        )
        .bind(int(job)?)
        .bind(i64::from(attempt))
        .bind(rank)
        .one()
        .await?;
    facts.steps = totals.num(t, "steps")?;
    facts.last_step = totals.get(t, "last_step")?;
    facts.train_ms = totals.get(t, "train_ms")?;
    let first = c
        .query(
            "SELECT step, step_time_ms, stored_at_ms FROM receipts \
             WHERE job_id = $1 AND attempt = $2 AND rank = $3 AND kind = 'step' ORDER BY seq LIMIT 1",
        )
        .bind(int(job)?)
        .bind(i64::from(attempt))
        .bind(rank)
        .optional()
        .await?;
    if let Some(row) = first {
        facts.first_step = row.get(t, "step")?;
        facts.first_step_ms = row.get::<Option<f64>>(t, "step_time_ms")?.unwrap_or(0.0);
        facts.first_step_at_ms = Some(row.get(t, "stored_at_ms")?);
    }
    let timed = c
        .query(
            "SELECT kind, body FROM receipts WHERE job_id = $1 AND attempt = $2 AND rank = $3 \
             AND kind IN ('eval', 'checkpoint') ORDER BY seq",
        )
        .bind(int(job)?)
        .bind(i64::from(attempt))
        .bind(rank)
        .all()
        .await?;
    for row in &timed {
        facts.add_duration(&row.get::<String>(t, "kind")?, &row.get::<String>(t, "body")?);
    }
    Ok(facts)
}

/// A diagnosis finding as the columns of `job_findings` (lists and evidence as JSON).
struct FindingRow<'a> {
    cause: &'static str,
    summary: &'a str,
    nodes: String,
    ranks: String,
    evidence: String,
    remedy: &'a str,
}

impl<'a> FindingRow<'a> {
    fn of(f: &'a Finding) -> Self {
        let evidence = f
            .evidence
            .iter()
            .map(|m| serde_json::json!({"name": m.name, "value": m.value, "unit": m.unit}))
            .collect();
        FindingRow {
            cause: f.cause.as_str(),
            summary: &f.summary,
            nodes: serde_json::to_string(&f.nodes).unwrap_or_default(),
            ranks: serde_json::to_string(&f.ranks).unwrap_or_default(),
            evidence: serde_json::Value::Array(evidence).to_string(),
            remedy: &f.remedy,
        }
    }
}
