//! [`JobStore`]: jobs, their events and the allocations of their ranks.

use async_trait::async_trait;

use crate::group::{Next, answer_each};
use crate::rows::{self, ALLOCATION_COLUMNS, JOB_COLUMNS, duplicate_or, encode_spec, engine_columns, int};
use crate::sql::{Conn, multi_row_insert};
use crate::waiting::Observation;
use crate::{
    Allocation, FailureRecord, JobEventRecord, JobId, JobOwner, JobRecord, JobSpec, JobState, JobStore,
    RankId, RankObserved, Result, SqlStore, StoreError,
};

#[async_trait]
impl JobStore for SqlStore {
    async fn create_job_for(
        &self,
        spec: &JobSpec,
        key: Option<&str>,
        owner: &JobOwner,
        reason: &str,
        now_ms: i64,
    ) -> Result<JobRecord> {
        self.write("create_job", async |c| {
            let (engine_kind, argv_json, workdir) = engine_columns(spec);
            let resources = &spec.resources;
            let row = c
                .query(
                    "INSERT INTO jobs (name, state, reason, attempt, priority, gpus, gpus_per_node, \
                     engine_kind, argv_json, workdir, spec_pb, created_at_ms, updated_at_ms, submit_key, \
                     submitted_by, run_as) \
                     VALUES ($1, 'pending', $2, 0, $3, $4, $5, $6, $7, $8, $9, $10, $10, $11, $12, $13) RETURNING id",
                )
                .bind(spec.name.as_str())
                .bind(reason)
                .bind(i64::from(spec.priority))
                .bind(i64::from(resources.gpus))
                .bind(i64::from(resources.gpus_per_node))
                .bind(engine_kind)
                .bind(argv_json.as_deref())
                .bind(workdir.as_deref())
                .bind(encode_spec(spec))
                .bind(now_ms)
                .bind(key)
                .bind(owner.user.as_str())
                .bind(owner.run_as.as_str())
                .one()
                .await
                .map_err(duplicate_or)?;
            let id = rows::job_id_from(row.get("jobs", "id")?)?;
            insert_event(c, id, None, JobState::Pending, 0, reason, now_ms).await?;
            fetch_job(c, id, false).await?.ok_or(StoreError::JobNotFound(id))
        })
        .await
    }

    async fn job_by_key(&self, key: &str) -> Result<Option<JobRecord>> {
        self.read("job_by_key", async |c| {
            let row = c
                .query(format!("SELECT {JOB_COLUMNS} FROM jobs WHERE submit_key = $1"))
                .bind(key)
                .optional()
                .await?;
            row.as_ref().map(rows::job).transpose()
        })
        .await
    }

    async fn transition(
        &self,
        job: JobId,
        from: JobState,
        to: JobState,
        attempt: u32,
        reason: &str,
        now_ms: i64,
    ) -> Result<JobRecord> {
        self.write("transition", async |c| move_job(c, job, from, to, attempt, reason, now_ms).await).await
    }

    async fn schedule(
        &self,
        job: JobId,
        attempt: u32,
        allocations: &[Allocation],
        reason: &str,
        now_ms: i64,
    ) -> Result<JobRecord> {
        self.write("schedule", async |c| {
            let record =
                move_job(c, job, JobState::Pending, JobState::Scheduled, attempt, reason, now_ms).await?;
            insert_allocations(c, job, attempt, allocations, now_ms).await?;
            Ok(record)
        })
        .await
    }

    async fn get_job(&self, job: JobId) -> Result<Option<JobRecord>> {
        self.read("get_job", async |c| fetch_job(c, job, false).await).await
    }

    async fn list_jobs(
        &self,
        active_only: bool,
        submitted_by: Option<&str>,
        limit: u32,
    ) -> Result<Vec<JobRecord>> {
        self.read("list_jobs", async |c| {
            let sql = format!(
                "SELECT {JOB_COLUMNS} FROM jobs WHERE (NOT $1 OR state NOT IN ('succeeded', 'failed', 'cancelled')) \
                 AND (CAST($2 AS TEXT) IS NULL OR submitted_by = $2) ORDER BY id DESC LIMIT $3"
            );
            let found = c.query(sql).bind(active_only).bind(submitted_by).bind(i64::from(limit)).all().await?;
            found.iter().map(rows::job).collect()
        })
        .await
    }

    async fn note_job_event(&self, job: JobId, reason: &str, now_ms: i64) -> Result<()> {
        self.write("note_job_event", async |c| {
            let row = c
                .query("SELECT state, attempt FROM jobs WHERE id = $1")
                .bind(int(job)?)
                .optional()
                .await?
                .ok_or(StoreError::JobNotFound(job))?;
            let state: JobState = row.word("jobs", "state")?;
            let attempt: u32 = row.num("jobs", "attempt")?;
            insert_event(c, job, Some(state), state, attempt, reason, now_ms).await
        })
        .await
    }

    async fn job_events(&self, job: JobId) -> Result<Vec<JobEventRecord>> {
        self.read("job_events", async |c| {
            let found = c
                .query(
                    "SELECT job_id, at_ms, from_state, to_state, attempt, reason FROM job_events \
                     WHERE job_id = $1 ORDER BY id",
                )
                .bind(int(job)?)
                .all()
                .await?;
            found.iter().map(rows::event).collect()
        })
        .await
    }

    async fn fail_attempt(
        &self,
        job: JobId,
        from: JobState,
        to: JobState,
        attempt: u32,
        reason: &str,
        failure: &FailureRecord,
    ) -> Result<JobRecord> {
        self.write("fail_attempt", async |c| {
            let record = move_job(c, job, from, to, attempt, reason, failure.at_ms).await?;
            insert_failure(c, failure).await?;
            Ok(record)
        })
        .await
    }

    async fn failures(&self, job: JobId) -> Result<Vec<FailureRecord>> {
        self.read("failures", async |c| {
            let sql = format!("SELECT {FAILURE_COLUMNS} FROM failures WHERE job_id = $1 ORDER BY id");
            let found = c.query(sql).bind(int(job)?).all().await?;
            found.iter().map(rows::failure).collect()
        })
        .await
    }

    async fn failures_since(&self, since_ms: i64) -> Result<Vec<FailureRecord>> {
        self.read("failures_since", async |c| {
            let sql = format!("SELECT {FAILURE_COLUMNS} FROM failures WHERE at_ms >= $1 ORDER BY id");
            let found = c.query(sql).bind(since_ms).all().await?;
            found.iter().map(rows::failure).collect()
        })
        .await
    }

    async fn allocations(&self, job: JobId, attempt: u32) -> Result<Vec<Allocation>> {
        self.read("allocations", async |c| {
            let sql =
                format!("SELECT {ALLOCATION_COLUMNS} FROM allocations a WHERE a.job_id = $1 AND a.attempt = $2 ORDER BY a.rank");
            let found = c.query(sql).bind(int(job)?).bind(i64::from(attempt)).all().await?;
            found.iter().map(rows::allocation).collect()
        })
        .await
    }

    async fn observe_rank(&self, id: RankId, observed: &RankObserved) -> Result<bool> {
        let mut waiter = self.rank_group.enqueue(|done| Observation { id, observed: observed.clone(), done });
        loop {
            match waiter.next().await {
                Next::Answered(changed) => return changed,
                Next::Write(group) => write_observations(self, group).await,
            }
        }
    }
}

/// Rank reports in one transaction at most.
const GROUP_REPORTS: usize = 1_000;

/// Writes `group` in order (in rounds of at most [`GROUP_REPORTS`]) and answers each report:
/// whether its rank's row exists.
async fn write_observations(store: &SqlStore, mut group: Vec<Observation>) {
    while !group.is_empty() {
        let round: Vec<Observation> = group.drain(..group.len().min(GROUP_REPORTS)).collect();
        let reports: Vec<(RankId, &RankObserved)> = round.iter().map(|o| (o.id, &o.observed)).collect();
        let result = store
            .write("observe_rank", async |c| {
                let mut changed = Vec::with_capacity(reports.len());
                for (id, observed) in &reports {
                    changed.push(update_allocation(c, *id, observed).await?);
                }
                Ok(changed)
            })
            .await;
        answer_each(round, result, |w| w.done);
    }
}

/// Stores what an agent observed of one rank; whether the rank's row exists.
async fn update_allocation(c: &mut Conn<'_>, id: RankId, observed: &RankObserved) -> Result<bool> {
    let changed = c
        .query(
            "UPDATE allocations SET state = $1, pid = $2, exit_code = $3, signal = $4, \
             message = $5, skipped_lines = $6, updated_at_ms = $7, \
             effective_cpus = $8, effective_mems = $9 \
             WHERE job_id = $10 AND attempt = $11 AND rank = $12",
        )
        .bind(observed.state.as_str())
        .bind(observed.pid.map(i64::from))
        .bind(observed.exit_code.map(i64::from))
        .bind(observed.signal.map(i64::from))
        .bind(observed.message.as_str())
        .bind(int(observed.skipped_lines)?)
        .bind(observed.updated_at_ms)
        .bind(observed.effective_cpus.as_str())
        .bind(observed.effective_mems.as_str())
        .bind(int(id.job_id)?)
        .bind(i64::from(id.attempt))
        .bind(i64::from(id.rank))
        .execute()
        .await?;
    Ok(changed > 0)
}

/// One job; `lock` keeps its row locked for the rest of the transaction, so two transitions
/// of one job never interleave.
pub(crate) async fn fetch_job(c: &mut Conn<'_>, job: JobId, lock: bool) -> Result<Option<JobRecord>> {
    let lock = if lock { c.for_update() } else { "" };
    let row = c
        .query(format!("SELECT {JOB_COLUMNS} FROM jobs WHERE id = $1{lock}"))
        .bind(int(job)?)
        .optional()
        .await?;
    row.as_ref().map(rows::job).transpose()
}

/// Moves `job` from `from` to `to` inside the caller's transaction.
async fn move_job(
    c: &mut Conn<'_>,
    job: JobId,
    from: JobState,
    to: JobState,
    attempt: u32,
    reason: &str,
    now_ms: i64,
) -> Result<JobRecord> {
    let current = fetch_job(c, job, true).await?.ok_or(StoreError::JobNotFound(job))?;
    if current.state != from {
        return Err(StoreError::StateConflict { job, expected: from, actual: current.state });
    }
    c.query("UPDATE jobs SET state = $1, reason = $2, attempt = $3, updated_at_ms = $4 WHERE id = $5")
        .bind(to.as_str())
        .bind(reason)
        .bind(i64::from(attempt))
        .bind(now_ms)
        .bind(int(job)?)
        .execute()
        .await?;
    insert_event(c, job, Some(from), to, attempt, reason, now_ms).await?;
    Ok(JobRecord { state: to, reason: reason.to_owned(), attempt, updated_at_ms: now_ms, ..current })
}

async fn insert_event(
    c: &mut Conn<'_>,
    job: JobId,
    from: Option<JobState>,
    to: JobState,
    attempt: u32,
    reason: &str,
    now_ms: i64,
) -> Result<()> {
    c.query(
        "INSERT INTO job_events (job_id, at_ms, from_state, to_state, attempt, reason) \
         VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(int(job)?)
    .bind(now_ms)
    .bind(from.map(JobState::as_str))
    .bind(to.as_str())
    .bind(i64::from(attempt))
    .bind(reason)
    .execute()
    .await?;
    Ok(())
}

/// Columns bound per row of `allocations`.
const ALLOCATION_PARAMS: usize = 18;

/// Allocations per statement: a job of thousands of ranks stays under SQLite's limit of
/// 32,766 bound parameters.
const ALLOCATIONS_PER_INSERT: usize = 1_024;

/// Writes the planned ranks of one attempt, in as few statements as the parameter limit allows.
async fn insert_allocations(
    c: &mut Conn<'_>,
    job: JobId,
    attempt: u32,
    allocations: &[Allocation],
    now_ms: i64,
) -> Result<()> {
    let head = "allocations (job_id, attempt, rank, agent_id, gpu_index, node_rank, local_rank, state, pid, \
                exit_code, signal, message, skipped_lines, updated_at_ms, planned_cpus, planned_mems, \
                effective_cpus, effective_mems)";
    for chunk in allocations.chunks(ALLOCATIONS_PER_INSERT) {
        let mut q = c.query(multi_row_insert(c.marks(), head, ALLOCATION_PARAMS, chunk.len(), ""));
        for a in chunk {
            let o = &a.observed;
            q = q
                .bind(int(job)?)
                .bind(i64::from(attempt))
                .bind(i64::from(a.id.rank))
                .bind(a.agent_id.as_str())
                .bind(i64::from(a.gpu_index))
                .bind(i64::from(a.node_rank))
                .bind(i64::from(a.local_rank))
                .bind(o.state.as_str())
                .bind(o.pid.map(i64::from))
                .bind(o.exit_code.map(i64::from))
                .bind(o.signal.map(i64::from))
                .bind(o.message.as_str())
                .bind(int(o.skipped_lines)?)
                .bind(if o.updated_at_ms == 0 { now_ms } else { o.updated_at_ms })
                .bind(a.planned_cpus.as_str())
                .bind(a.planned_mems.as_str())
                .bind(o.effective_cpus.as_str())
                .bind(o.effective_mems.as_str());
        }
        q.execute().await?;
    }
    Ok(())
}

/// Columns of `failures`, read by [`rows::failure`].
pub(crate) const FAILURE_COLUMNS: &str =
    "job_id, attempt, at_ms, kind, agent_id, rank, evidence, blamed, charged";

async fn insert_failure(c: &mut Conn<'_>, f: &FailureRecord) -> Result<()> {
    c.query(
        "INSERT INTO failures (job_id, attempt, at_ms, kind, agent_id, rank, evidence, blamed, charged) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
    )
    .bind(int(f.job_id)?)
    .bind(i64::from(f.attempt))
    .bind(f.at_ms)
    .bind(f.kind.as_str())
    .bind(f.agent_id.as_deref())
    .bind(f.rank.map(i64::from))
    .bind(f.evidence.as_str())
    .bind(f.blamed)
    .bind(f.charged)
    .execute()
    .await?;
    Ok(())
}
