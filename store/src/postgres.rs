//! The fleet store: PostgreSQL through sqlx, schema in `migrations/postgres`.
//!
//! Same tables, columns, views and meaning as the SQLite store; the same test suite runs
//! against both (`store/tests.rs`). What differs is how the work reaches the server:
//! - Multi-row writes bind one array per column and insert `SELECT ... FROM UNNEST(...)`: one
//!   statement and one round trip for a whole receipt batch, whatever its size.
//! - Receipt writers serialise on a transaction-level advisory lock. Positions come from an
//!   identity column, and two concurrent batches could otherwise commit out of order: a `Watch`
//!   cursor that had read the later one would step over the earlier one for good.
//! - Every operation goes through [`PostgresStore::run`], which retries a transaction that
//!   failed on a serialization failure, a deadlock or a dropped connection (the server restarted,
//!   a proxy cut the link), with backoff, and maps SQLSTATE codes to [`StoreError`]s once.

use std::time::Duration;

use async_trait::async_trait;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPoolOptions, PgRow};
use sqlx::{AssertSqlSafe, PgPool};
use tracing::Instrument;

use super::rows::{
    SNAPSHOT_AGENTS, SNAPSHOT_ALLOCATIONS, SNAPSHOT_JOBS, allocation_columns, duplicate_or, encode_inventory,
    encode_spec, engine_columns, int, job_columns, job_id_from, preflight_queries,
};
use super::{
    AgentState, FleetStore, JobId, JobOwner, JobSpec, JobStore, NewReceipt, PreflightStore, ReceiptStore,
    Result, Snapshot, StoreError,
};

super::rows::diagnosis_queries!(PostgresStore, read: [], write: []);
super::rows::auth_queries!(PostgresStore, PgRow, read: [], write: []);
super::rows::series_queries!(PostgresStore, PgRow, read: [], write: []);
super::rows::row_readers!(PgRow, sqlx::Postgres);

/// Connections in the pool: receipt batches of several agents, the core's writes and the
/// readers (`Watch`, `ctl status`) run side by side.
const POOL_SIZE: u32 = 8;

/// How often a transaction is tried before its error reaches the caller, and the first pause
/// between tries (doubled each time, capped at [`MAX_BACKOFF`]): about 20 s in all, enough for
/// a PostgreSQL restart.
const TRIES: u32 = 12;
const FIRST_BACKOFF: Duration = Duration::from_millis(50);
const MAX_BACKOFF: Duration = Duration::from_secs(3);

/// Key of the advisory lock receipt writers hold until they commit (any constant; it only has
/// to differ from other users' advisory locks in the same database).
const RECEIPTS_LOCK: i64 = 0x7472_6169_6e79_6172; // "trainyar"

/// The PostgreSQL store.
///
/// # What we persist
/// See the [module documentation of the store](super); the schema with a comment on every
/// column is in `migrations/postgres/`, and `docs/schema.md` explains it to operators.
///
/// Durability is the server's: a receipt is acknowledged to its agent only after its
/// transaction committed, and with the server's default `synchronous_commit = on` a commit
/// has reached the server's WAL on disk.
#[derive(Debug, Clone)]
pub struct PostgresStore {
    pool: PgPool,
}

impl PostgresStore {
    /// Connects to a `postgres://` URL and applies the migrations. The database must exist.
    pub async fn open(url: &str) -> Result<Self> {
        let options: PgConnectOptions = url.parse()?;
        let pool = PgPoolOptions::new()
            .max_connections(POOL_SIZE)
            .acquire_timeout(Duration::from_secs(5))
            .connect_with(options.application_name("trainyard-controller"))
            .await
            .map_err(classify)?;
        sqlx::migrate!("../migrations/postgres").run(&pool).await?;
        Ok(PostgresStore { pool })
    }

    /// The pool, for read-only SQL that is not part of the [`Store`] contract (operator views,
    /// tests). Writes go through the trait.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The one helper every operation goes through: a span with the operation's label, one
    /// transaction, committed if `body` succeeds, rolled back (by drop) if it fails, and tried
    /// again from the start when the failure was transient.
    /// `body` is cloned for each try (it captures references only, so a clone is a copy).
    async fn run<T>(
        &self,
        op: &'static str,
        body: impl AsyncFnOnce(&mut PgConnection) -> Result<T> + Clone,
    ) -> Result<T> {
        let span = tracing::debug_span!("store", op);
        let started = std::time::Instant::now();
        let result = async move {
            let mut pause = FIRST_BACKOFF;
            let mut tries = 0;
            loop {
                tries += 1;
                match self.try_once(body.clone()).await {
                    Err(StoreError::Database(e)) if tries < TRIES && retryable(&e) => {
                        tracing::warn!(op, tries, error = %e, "database transaction failed, trying again");
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(MAX_BACKOFF);
                    }
                    Err(StoreError::Database(e)) => return Err(classify(e)),
                    other => return other,
                }
            }
        }
        .instrument(span)
        .await;
        crate::metrics::metrics().store_op(op, started.elapsed(), result.is_ok());
        result
    }

    async fn try_once<T>(&self, body: impl AsyncFnOnce(&mut PgConnection) -> Result<T>) -> Result<T> {
        let mut tx = self.pool.begin().await?;
        let value = body(&mut tx).await?;
        tx.commit().await?;
        Ok(value)
    }
}

/// The SQLSTATE of a database error, if the server sent one.
fn sqlstate(e: &sqlx::Error) -> Option<String> {
    match e {
        sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
        _ => None,
    }
}

/// Whether trying the whole transaction again may succeed: serialization failures (40001),
/// deadlocks (40P01), lost connections (class 08), a server shutting down or restarting
/// (57P01-57P03), and I/O or pool errors on the way to it.
fn retryable(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::Tls(_) => true,
        sqlx::Error::Protocol(_) | sqlx::Error::WorkerCrashed => true,
        _ => sqlstate(e).is_some_and(|c| {
            c == "40001"
                || c == "40P01"
                || c.starts_with("08")
                || matches!(c.as_str(), "57P01" | "57P02" | "57P03")
        }),
    }
}

/// Maps a database error that is not retried (or ran out of tries) to the store's error kinds.
fn classify(e: sqlx::Error) -> StoreError {
    if retryable(&e) && !matches!(sqlstate(&e).as_deref(), Some("40001" | "40P01")) {
        return StoreError::Unavailable(e.to_string());
    }
    StoreError::Database(e)
}

#[async_trait]
impl JobStore for PostgresStore {
    async fn create_job_for(
        &self,
        spec: &JobSpec,
        key: Option<&str>,
        owner: &JobOwner,
        reason: &str,
        now_ms: i64,
    ) -> Result<JobRecord> {
        self.run("create_job", async |c| {
            let (engine_kind, argv_json, workdir) = engine_columns(spec);
            let resources = &spec.resources;
            let id: i64 = sqlx::query_scalar(
                "INSERT INTO jobs (name, state, reason, attempt, priority, gpus, gpus_per_node, \
                 engine_kind, argv_json, workdir, spec_pb, created_at_ms, updated_at_ms, submit_key, submitted_by, run_as) \
                 VALUES ($1, 'pending', $2, 0, $3, $4, $5, $6, $7, $8, $9, $10, $10, $11, $12, $13) RETURNING id",
            )
            .bind(&spec.name)
            .bind(reason)
            .bind(i64::from(spec.priority))
            .bind(i64::from(resources.gpus))
            .bind(i64::from(resources.gpus_per_node))
            .bind(engine_kind)
            .bind(&argv_json)
            .bind(&workdir)
            .bind(encode_spec(spec))
            .bind(now_ms)
            .bind(key)
            .bind(&owner.user)
            .bind(&owner.run_as)
            .fetch_one(&mut *c)
            .await
            .map_err(duplicate_or)?;
            let id = job_id_from(id)?;
            insert_event(c, id, None, JobState::Pending, 0, reason, now_ms).await?;
            fetch_job(c, id, false).await?.ok_or(StoreError::JobNotFound(id))
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
        self.run("transition", async |c| move_job(c, job, from, to, attempt, reason, now_ms).await).await
    }

    async fn schedule(
        &self,
        job: JobId,
        attempt: u32,
        allocations: &[Allocation],
        reason: &str,
        now_ms: i64,
    ) -> Result<JobRecord> {
        self.run("schedule", async |c| {
            let record =
                move_job(c, job, JobState::Pending, JobState::Scheduled, attempt, reason, now_ms).await?;
            insert_allocations(c, job, attempt, allocations, now_ms).await?;
            Ok(record)
        })
        .await
    }

    async fn job_by_key(&self, key: &str) -> Result<Option<JobRecord>> {
        self.run("job_by_key", async |c| {
            let row = sqlx::query(concat!("SELECT ", job_columns!(), " FROM jobs WHERE submit_key = $1"))
                .bind(key)
                .fetch_optional(&mut *c)
                .await?;
            row.as_ref().map(job_from_row).transpose()
        })
        .await
    }

    async fn get_job(&self, job: JobId) -> Result<Option<JobRecord>> {
        self.run("get_job", async |c| fetch_job(c, job, false).await).await
    }

    async fn list_jobs(
        &self,
        active_only: bool,
        submitted_by: Option<&str>,
        limit: u32,
    ) -> Result<Vec<JobRecord>> {
        self.run("list_jobs", async |c| {
            let rows = sqlx::query(concat!(
                "SELECT ",
                job_columns!(),
                " FROM jobs WHERE (NOT $1 OR state NOT IN ('succeeded', 'failed', 'cancelled')) \
                 AND ($2::TEXT IS NULL OR submitted_by = $2) ORDER BY id DESC LIMIT $3"
            ))
            .bind(active_only)
            .bind(submitted_by)
            .bind(i64::from(limit))
            .fetch_all(&mut *c)
            .await?;
            rows.iter().map(job_from_row).collect()
        })
        .await
    }

    async fn job_events(&self, job: JobId) -> Result<Vec<JobEventRecord>> {
        self.run("job_events", async |c| {
            let rows = sqlx::query(
                "SELECT job_id, at_ms, from_state, to_state, attempt, reason FROM job_events \
                 WHERE job_id = $1 ORDER BY id",
            )
            .bind(int(job)?)
            .fetch_all(&mut *c)
            .await?;
            rows.iter().map(event_from_row).collect()
        })
        .await
    }

    async fn allocations(&self, job: JobId, attempt: u32) -> Result<Vec<Allocation>> {
        self.run("allocations", async |c| {
            let rows = sqlx::query(concat!(
                "SELECT ",
                allocation_columns!(),
                " FROM allocations a WHERE a.job_id = $1 AND a.attempt = $2 ORDER BY a.rank"
            ))
            .bind(int(job)?)
            .bind(i64::from(attempt))
            .fetch_all(&mut *c)
            .await?;
            rows.iter().map(allocation_from_row).collect()
        })
        .await
    }

    async fn observe_rank(&self, id: RankId, observed: &RankObserved) -> Result<bool> {
        self.run("observe_rank", async |c| {
            let done = sqlx::query(
                "UPDATE allocations SET state = $1, pid = $2, exit_code = $3, signal = $4, \
                 message = $5, skipped_lines = $6, updated_at_ms = $7, \
                 effective_cpus = $8, effective_mems = $9 \
                 WHERE job_id = $10 AND attempt = $11 AND rank = $12",
            )
            .bind(observed.state.as_str())
            .bind(observed.pid.map(i64::from))
            .bind(observed.exit_code.map(i64::from))
            .bind(observed.signal.map(i64::from))
            .bind(&observed.message)
            .bind(int(observed.skipped_lines)?)
            .bind(observed.updated_at_ms)
            .bind(&observed.effective_cpus)
            .bind(&observed.effective_mems)
            .bind(int(id.job_id)?)
            .bind(i64::from(id.attempt))
            .bind(i64::from(id.rank))
            .execute(&mut *c)
            .await?;
            Ok(done.rows_affected() > 0)
        })
        .await
    }
}

#[async_trait]
impl FleetStore for PostgresStore {
    async fn upsert_agent(&self, agent: &AgentRecord) -> Result<()> {
        self.run("upsert_agent", async |c| {
            let inv = &agent.inventory;
            sqlx::query(
                "INSERT INTO agents (agent_id, hostname, address, agent_version, state, \
                 gpu_count, inventory_pb, first_seen_ms, last_seen_ms) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $8) \
                 ON CONFLICT (agent_id) DO UPDATE SET hostname = excluded.hostname, \
                 address = excluded.address, agent_version = excluded.agent_version, \
                 state = excluded.state, gpu_count = excluded.gpu_count, \
                 inventory_pb = excluded.inventory_pb, last_seen_ms = excluded.last_seen_ms",
            )
            .bind(&agent.agent_id)
            .bind(&inv.hostname)
            .bind(&agent.address)
            .bind(&agent.agent_version)
            .bind(agent.state.as_str())
            .bind(inv.gpus.len() as i64)
            .bind(encode_inventory(inv))
            .bind(agent.last_seen_ms)
            .execute(&mut *c)
            .await?;
            sqlx::query("DELETE FROM gpus WHERE agent_id = $1")
                .bind(&agent.agent_id)
                .execute(&mut *c)
                .await?;
            let gpus = &inv.gpus;
            sqlx::query(
                "INSERT INTO gpus (agent_id, gpu_index, uuid, model, memory_mib, pci_bus_id, numa_node) \
                 SELECT $1, * FROM UNNEST($2::bigint[], $3::text[], $4::text[], $5::bigint[], \
                 $6::text[], $7::bigint[])",
            )
            .bind(&agent.agent_id)
            .bind(gpus.iter().map(|g| i64::from(g.index)).collect::<Vec<_>>())
            .bind(gpus.iter().map(|g| g.uuid.clone()).collect::<Vec<_>>())
            .bind(gpus.iter().map(|g| g.model.clone()).collect::<Vec<_>>())
            .bind(gpus.iter().map(|g| int(g.memory_mib)).collect::<Result<Vec<_>>>()?)
            .bind(gpus.iter().map(|g| g.pci_bus_id.clone()).collect::<Vec<_>>())
            .bind(gpus.iter().map(|g| g.numa_node.map_or(-1, i64::from)).collect::<Vec<_>>())
            .execute(&mut *c)
            .await?;
            Ok(())
        })
        .await
    }

    async fn touch_agents(&self, seen: &[(String, i64)]) -> Result<()> {
        if seen.is_empty() {
            return Ok(());
        }
        let ids: Vec<&str> = seen.iter().map(|(id, _)| id.as_str()).collect();
        let times: Vec<i64> = seen.iter().map(|(_, at)| *at).collect();
        self.run("touch_agents", async |c| {
            sqlx::query(
                "UPDATE agents SET last_seen_ms = GREATEST(last_seen_ms, t.at_ms) \
                 FROM UNNEST($1::text[], $2::bigint[]) AS t(agent_id, at_ms) \
                 WHERE agents.agent_id = t.agent_id",
            )
            .bind(&ids)
            .bind(&times)
            .execute(&mut *c)
            .await?;
            Ok(())
        })
        .await
    }

    /// An unknown agent is ignored: it has never said hello, so there is nothing to update.
    async fn set_agent_state(&self, agent_id: &str, state: AgentState, now_ms: i64) -> Result<()> {
        self.run("set_agent_state", async |c| {
            sqlx::query("UPDATE agents SET state = $1, last_seen_ms = $2 WHERE agent_id = $3")
                .bind(state.as_str())
                .bind(now_ms)
                .bind(agent_id)
                .execute(&mut *c)
                .await?;
            Ok(())
        })
        .await
    }

    async fn snapshot(&self) -> Result<Snapshot> {
        self.run("snapshot", async |c| {
            let jobs = sqlx::query(SNAPSHOT_JOBS).fetch_all(&mut *c).await?;
            let allocations = sqlx::query(SNAPSHOT_ALLOCATIONS).fetch_all(&mut *c).await?;
            let agents = sqlx::query(SNAPSHOT_AGENTS).fetch_all(&mut *c).await?;
            Ok(Snapshot {
                active_jobs: jobs.iter().map(job_from_row).collect::<Result<_>>()?,
                allocations: allocations.iter().map(allocation_from_row).collect::<Result<_>>()?,
                agents: agents.iter().map(agent_from_row).collect::<Result<_>>()?,
            })
        })
        .await
    }
}

#[async_trait]
impl ReceiptStore for PostgresStore {
    async fn insert_receipts(&self, receipts: &[NewReceipt], now_ms: i64) -> Result<u64> {
        if receipts.is_empty() {
            return Ok(0);
        }
        let columns = ReceiptColumns::of(receipts)?;
        self.run("insert_receipts", async |c| {
            sqlx::query("SELECT pg_advisory_xact_lock($1)").bind(RECEIPTS_LOCK).execute(&mut *c).await?;
            let [t0, t1, t2, t3, t4, t5, t6, t7, t8] = &columns.times;
            let [b0, b1, b2] = &columns.bytes;
            let done = sqlx::query(
                "INSERT INTO receipts (job_id, attempt, rank, seq, kind, step, body, stored_at_ms, problem, \
                 step_time_ms, fwd_bwd_ms, optimizer_ms, optimizer_reduce_ms, optimizer_compute_gather_ms, \
                 optimizer_wait_ms, tokens_per_s, mfu, loss, mem_allocated_bytes, mem_reserved_bytes, \
                 mem_peak_allocated_bytes) \
                 SELECT job_id, attempt, rank, seq, kind, step, body, $8, problem, t0, t1, t2, t3, t4, t5, t6, \
                 t7, t8, b0, b1, b2 \
                 FROM UNNEST($1::bigint[], $2::bigint[], $3::bigint[], $4::bigint[], $5::text[], \
                 $6::bigint[], $7::text[], $9::text[], $10::float8[], $11::float8[], $12::float8[], \
                 $13::float8[], $14::float8[], $15::float8[], $16::float8[], $17::float8[], $18::float8[], \
                 $19::bigint[], $20::bigint[], $21::bigint[]) \
                 AS t(job_id, attempt, rank, seq, kind, step, body, problem, t0, t1, t2, t3, t4, t5, t6, t7, \
                 t8, b0, b1, b2) \
                 ON CONFLICT (job_id, attempt, rank, seq) DO NOTHING",
            )
            .bind(&columns.job_id)
            .bind(&columns.attempt)
            .bind(&columns.rank)
            .bind(&columns.seq)
            .bind(&columns.kind)
            .bind(&columns.step)
            .bind(&columns.body)
            .bind(now_ms)
            .bind(&columns.problem)
            .bind(t0)
            .bind(t1)
            .bind(t2)
            .bind(t3)
            .bind(t4)
            .bind(t5)
            .bind(t6)
            .bind(t7)
            .bind(t8)
            .bind(b0)
            .bind(b1)
            .bind(b2)
            .execute(&mut *c)
            .await?;
            Ok(done.rows_affected())
        })
        .await
    }

    async fn receipts_after(&self, job: JobId, after: u64, limit: u32) -> Result<Vec<StoredReceiptRecord>> {
        self.run("receipts_after", async |c| {
            let rows = sqlx::query(
                "SELECT position, job_id, attempt, rank, seq, kind, step, body FROM receipts \
                 WHERE job_id = $1 AND position > $2 ORDER BY position LIMIT $3",
            )
            .bind(int(job)?)
            .bind(int(after)?)
            .bind(i64::from(limit))
            .fetch_all(&mut *c)
            .await?;
            rows.iter().map(receipt_from_row).collect()
        })
        .await
    }

    async fn last_seqs(&self, job: JobId, attempt: u32) -> Result<Vec<(u32, u64)>> {
        self.run("last_seqs", async |c| {
            let rows = sqlx::query(
                "SELECT rank, max(seq) AS seq FROM receipts WHERE job_id = $1 AND attempt = $2 \
                 GROUP BY rank ORDER BY rank",
            )
            .bind(int(job)?)
            .bind(i64::from(attempt))
            .fetch_all(&mut *c)
            .await?;
            rows.iter().map(|row| Ok((num(row, "receipts", "rank")?, num(row, "receipts", "seq")?))).collect()
        })
        .await
    }

    async fn receipt_count(&self, job: JobId) -> Result<u64> {
        self.run("receipt_count", async |c| {
            let row = sqlx::query("SELECT count(*) AS n FROM receipts WHERE job_id = $1")
                .bind(int(job)?)
                .fetch_one(&mut *c)
                .await?;
            num(&row, "receipts", "n")
        })
        .await
    }

    async fn receipt_problems(&self, job: JobId) -> Result<(u64, Option<String>)> {
        self.run("receipt_problems", async |c| {
            let row = sqlx::query(
                "SELECT count(*) AS n, (SELECT problem FROM receipts WHERE job_id = $1 \
                 AND problem IS NOT NULL ORDER BY position DESC LIMIT 1) AS newest \
                 FROM receipts WHERE job_id = $1 AND problem IS NOT NULL",
            )
            .bind(int(job)?)
            .fetch_one(&mut *c)
            .await?;
            Ok((num(&row, "receipts", "n")?, col(&row, "receipts", "newest")?))
        })
        .await
    }

    async fn step_samples(
        &self,
        job: JobId,
        attempt: u32,
    ) -> Result<Vec<trainyard_analysis::diagnose::StepSample>> {
        self.q_step_samples(job, attempt).await
    }

    async fn step_progress(
        &self,
        job: JobId,
        attempt: u32,
    ) -> Result<trainyard_analysis::diagnose::stall::StepProgress> {
        self.q_step_progress(job, attempt).await
    }

    async fn first_receipt(&self, job: JobId, attempt: u32, kind: &str) -> Result<Option<String>> {
        self.q_first_receipt(job, attempt, kind).await
    }

    async fn attempt_facts(
        &self,
        job: JobId,
        attempt: u32,
    ) -> Result<trainyard_analysis::diagnose::goodput::AttemptFacts> {
        self.q_attempt_facts(job, attempt).await
    }

    async fn record_outcome(
        &self,
        job: JobId,
        goodput: &trainyard_analysis::diagnose::goodput::Goodput,
        attempt: u32,
        findings: &[trainyard_analysis::diagnose::Finding],
        now_ms: i64,
    ) -> Result<()> {
        self.q_record_outcome(job, goodput, attempt, findings, now_ms).await
    }

    async fn mean_optimizer_ms(&self, job: JobId) -> Result<Option<f64>> {
        self.run("mean_optimizer_ms", async |c| {
            let row = sqlx::query(
                "SELECT avg(optimizer_ms) AS ms FROM (SELECT optimizer_ms FROM receipts \
                 WHERE job_id = $1 AND kind = 'step' AND optimizer_ms IS NOT NULL \
                 ORDER BY position DESC LIMIT 1000) AS latest",
            )
            .bind(int(job)?)
            .fetch_one(&mut *c)
            .await?;
            col(&row, "receipts", "ms")
        })
        .await
    }
}

#[async_trait]
impl PreflightStore for PostgresStore {
    async fn insert_preflight(&self, report: &PreflightRecord, now_ms: i64) -> Result<u64> {
        self.run("insert_preflight", async |c| {
            let stored: Option<i64> = sqlx::query_scalar(
                "SELECT id FROM preflight_reports WHERE agent_id = $1 AND local_id = $2 AND local_id <> ''",
            )
            .bind(&report.agent_id)
            .bind(&report.local_id)
            .fetch_optional(&mut *c)
            .await?;
            if let Some(id) = stored {
                return report_id_from(id);
            }
            let id: i64 = sqlx::query_scalar(
                "INSERT INTO preflight_reports (agent_id, local_id, level, started_at_ms, \
                 finished_at_ms, verdict, interconnect_class, driver_version, cuda_version, \
                 nccl_version, source, topology, received_at_ms) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13) RETURNING id",
            )
            .bind(&report.agent_id)
            .bind(&report.local_id)
            .bind(report.level.as_str())
            .bind(report.started_at_ms)
            .bind(report.finished_at_ms)
            .bind(report.verdict.as_str())
            .bind(report.interconnect_class.map_or("", |c| c.as_str()))
            .bind(&report.driver_version)
            .bind(&report.cuda_version)
            .bind(&report.nccl_version)
            .bind(&report.source)
            .bind(&report.topology)
            .bind(now_ms)
            .fetch_one(&mut *c)
            .await?;
            insert_checks(c, id, &report.checks).await?;
            report_id_from(id)
        })
        .await
    }

    async fn latest_preflight(&self, agent_id: &str) -> Result<Option<PreflightRecord>> {
        self.run("latest_preflight", async |c| {
            let newest = "(SELECT max(id) FROM preflight_reports WHERE agent_id = $1)";
            let mut reports = fetch_preflights(c, newest, Some(agent_id)).await?;
            Ok(reports.pop())
        })
        .await
    }

    async fn latest_preflights(&self) -> Result<Vec<PreflightRecord>> {
        self.run("latest_preflights", async |c| {
            let newest = "(SELECT max(id) FROM preflight_reports GROUP BY agent_id)";
            fetch_preflights(c, newest, None).await
        })
        .await
    }
}

/// A receipt batch as one array per column, built once before the transaction (which may be
/// tried more than once).
struct ReceiptColumns {
    job_id: Vec<i64>,
    attempt: Vec<i64>,
    rank: Vec<i64>,
    seq: Vec<i64>,
    kind: Vec<String>,
    step: Vec<Option<i64>>,
    body: Vec<String>,
    problem: Vec<Option<String>>,
    /// The typed step columns (receipt schema v1), NULL for other kinds.
    times: [Vec<Option<f64>>; 9],
    bytes: [Vec<Option<i64>>; 3],
}

impl ReceiptColumns {
    fn of(receipts: &[NewReceipt]) -> Result<Self> {
        let n = receipts.len();
        let mut c = ReceiptColumns {
            job_id: Vec::with_capacity(n),
            attempt: Vec::with_capacity(n),
            rank: Vec::with_capacity(n),
            seq: Vec::with_capacity(n),
            kind: Vec::with_capacity(n),
            step: Vec::with_capacity(n),
            body: Vec::with_capacity(n),
            problem: Vec::with_capacity(n),
            times: Default::default(),
            bytes: Default::default(),
        };
        for r in receipts {
            c.job_id.push(int(r.id.job_id)?);
            c.attempt.push(i64::from(r.id.attempt));
            c.rank.push(i64::from(r.id.rank));
            c.seq.push(int(r.seq)?);
            c.kind.push(r.kind.clone());
            c.step.push(r.step);
            c.body.push(r.body.clone());
            c.problem.push(r.problem.clone());
            let m = r.metrics.clone().unwrap_or_default();
            let times = [
                m.step_time_ms,
                m.fwd_bwd_ms,
                m.optimizer_ms,
                m.optimizer_reduce_ms,
                m.optimizer_compute_gather_ms,
                m.optimizer_wait_ms,
                m.tokens_per_s,
                m.mfu,
                m.loss,
            ];
            for (column, v) in c.times.iter_mut().zip(times) {
                column.push(v);
            }
            let bytes = [m.mem_allocated_bytes, m.mem_reserved_bytes, m.mem_peak_allocated_bytes];
            for (column, v) in c.bytes.iter_mut().zip(bytes) {
                column.push(v);
            }
        }
        Ok(c)
    }
}

/// Writes the checks of report `report_id` in order, in one statement.
async fn insert_checks(c: &mut PgConnection, report_id: i64, checks: &[CheckRecord]) -> Result<()> {
    let text = |f: fn(&CheckRecord) -> &String| checks.iter().map(|x| f(x).clone()).collect::<Vec<_>>();
    sqlx::query(
        "INSERT INTO preflight_checks (report_id, position, check_id, status, measured, expected, remedy) \
         SELECT $1, position - 1, check_id, status, measured, expected, remedy \
         FROM UNNEST($2::text[], $3::text[], $4::text[], $5::text[], $6::text[]) \
         WITH ORDINALITY AS t(check_id, status, measured, expected, remedy, position)",
    )
    .bind(report_id)
    .bind(text(|x| &x.id))
    .bind(checks.iter().map(|x| x.status.to_string()).collect::<Vec<_>>())
    .bind(text(|x| &x.measured))
    .bind(text(|x| &x.expected))
    .bind(text(|x| &x.remedy))
    .execute(&mut *c)
    .await?;
    Ok(())
}

/// The reports whose id is in `ids` (a subquery taking `agent_id` as `$1`, or no parameter),
/// with their checks, ordered by agent id.
async fn fetch_preflights(
    c: &mut PgConnection,
    ids: &'static str,
    agent_id: Option<&str>,
) -> Result<Vec<PreflightRecord>> {
    let (reports_sql, checks_sql) = preflight_queries(ids);
    let mut reports_query = sqlx::query(AssertSqlSafe(reports_sql));
    let mut checks_query = sqlx::query(AssertSqlSafe(checks_sql));
    if let Some(agent_id) = agent_id {
        reports_query = reports_query.bind(agent_id.to_owned());
        checks_query = checks_query.bind(agent_id.to_owned());
    }
    let mut reports: Vec<PreflightRecord> =
        reports_query.fetch_all(&mut *c).await?.iter().map(preflight_from_row).collect::<Result<_>>()?;
    let checks = checks_query.fetch_all(&mut *c).await?.iter().map(check_from_row).collect::<Result<_>>()?;
    attach_checks(&mut reports, checks);
    Ok(reports)
}

/// Moves `job` from `from` to `to` inside the caller's transaction; the row is locked first,
/// so two transitions of one job never interleave.
async fn move_job(
    c: &mut PgConnection,
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
    sqlx::query("UPDATE jobs SET state = $1, reason = $2, attempt = $3, updated_at_ms = $4 WHERE id = $5")
        .bind(to.as_str())
        .bind(reason)
        .bind(i64::from(attempt))
        .bind(now_ms)
        .bind(int(job)?)
        .execute(&mut *c)
        .await?;
    insert_event(c, job, Some(from), to, attempt, reason, now_ms).await?;
    Ok(JobRecord { state: to, reason: reason.to_owned(), attempt, updated_at_ms: now_ms, ..current })
}

async fn insert_event(
    c: &mut PgConnection,
    job: JobId,
    from: Option<JobState>,
    to: JobState,
    attempt: u32,
    reason: &str,
    now_ms: i64,
) -> Result<()> {
    sqlx::query(
        "INSERT INTO job_events (job_id, at_ms, from_state, to_state, attempt, reason) \
         VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(int(job)?)
    .bind(now_ms)
    .bind(from.map(JobState::as_str))
    .bind(to.as_str())
    .bind(i64::from(attempt))
    .bind(reason)
    .execute(&mut *c)
    .await?;
    Ok(())
}

/// Writes the planned ranks of one attempt in one statement.
async fn insert_allocations(
    c: &mut PgConnection,
    job: JobId,
    attempt: u32,
    allocations: &[Allocation],
    now_ms: i64,
) -> Result<()> {
    let ints = |f: fn(&Allocation) -> u32| allocations.iter().map(|a| i64::from(f(a))).collect::<Vec<_>>();
    let opts = |f: fn(&Allocation) -> Option<i64>| allocations.iter().map(f).collect::<Vec<_>>();
    let text = |f: fn(&Allocation) -> &str| allocations.iter().map(|a| f(a).to_owned()).collect::<Vec<_>>();
    let skipped = allocations.iter().map(|a| int(a.observed.skipped_lines)).collect::<Result<Vec<_>>>()?;
    let updated: Vec<i64> = allocations
        .iter()
        .map(|a| if a.observed.updated_at_ms == 0 { now_ms } else { a.observed.updated_at_ms })
        .collect();
    sqlx::query(
        "INSERT INTO allocations (job_id, attempt, rank, agent_id, gpu_index, node_rank, \
         local_rank, state, pid, exit_code, signal, message, skipped_lines, updated_at_ms, \
         planned_cpus, planned_mems, effective_cpus, effective_mems) \
         SELECT $1, $2, * FROM UNNEST($3::bigint[], $4::text[], $5::bigint[], $6::bigint[], \
         $7::bigint[], $8::text[], $9::bigint[], $10::bigint[], $11::bigint[], $12::text[], \
         $13::bigint[], $14::bigint[], $15::text[], $16::text[], $17::text[], $18::text[])",
    )
    .bind(int(job)?)
    .bind(i64::from(attempt))
    .bind(ints(|a| a.id.rank))
    .bind(text(|a| &a.agent_id))
    .bind(ints(|a| a.gpu_index))
    .bind(ints(|a| a.node_rank))
    .bind(ints(|a| a.local_rank))
    .bind(text(|a| a.observed.state.as_str()))
    .bind(opts(|a| a.observed.pid.map(i64::from)))
    .bind(opts(|a| a.observed.exit_code.map(i64::from)))
    .bind(opts(|a| a.observed.signal.map(i64::from)))
    .bind(text(|a| &a.observed.message))
    .bind(skipped)
    .bind(updated)
    .bind(text(|a| &a.planned_cpus))
    .bind(text(|a| &a.planned_mems))
    .bind(text(|a| &a.observed.effective_cpus))
    .bind(text(|a| &a.observed.effective_mems))
    .execute(&mut *c)
    .await?;
    Ok(())
}

/// One job; `lock` takes the row lock for the rest of the transaction (`FOR UPDATE`).
async fn fetch_job(c: &mut PgConnection, job: JobId, lock: bool) -> Result<Option<JobRecord>> {
    let sql = if lock {
        concat!("SELECT ", job_columns!(), " FROM jobs WHERE id = $1 FOR UPDATE")
    } else {
        concat!("SELECT ", job_columns!(), " FROM jobs WHERE id = $1")
    };
    let row = sqlx::query(sql).bind(int(job)?).fetch_optional(&mut *c).await?;
    row.as_ref().map(job_from_row).transpose()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transient_errors_are_retried_and_the_rest_classified() {
        let io = sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert!(retryable(&io));
        assert!(matches!(classify(io), StoreError::Unavailable(_)));
        assert!(!retryable(&sqlx::Error::RowNotFound));
        assert!(matches!(classify(sqlx::Error::RowNotFound), StoreError::Database(_)));
    }
}
