//! The embedded store: one SQLite file (WAL), schema in `migrations/sqlite`.
//!
//! Everything SQLite-specific lives in this module and its migration folder; the rest of the
//! controller sees only [`Store`].

use std::path::Path;
use std::str::FromStr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePoolOptions, SqliteRow,
    SqliteSynchronous,
};
use sqlx::{AssertSqlSafe, SqlitePool};
use tracing::Instrument;

use super::rows::{
    SNAPSHOT_AGENTS, SNAPSHOT_ALLOCATIONS, SNAPSHOT_JOBS, allocation_columns, duplicate_or, encode_inventory,
    encode_spec, engine_columns, int, job_columns, job_id_from, preflight_queries,
};
use super::{
    AgentState, FleetStore, JobId, JobOwner, JobSpec, JobStore, NewReceipt, PreflightStore, ReceiptStore,
    Result, Snapshot, StoreError,
};

super::rows::diagnosis_queries!(SqliteStore, read: [Mode::Read,], write: [Mode::Write,]);
super::rows::auth_queries!(SqliteStore, SqliteRow, read: [Mode::Read,], write: [Mode::Write,]);
super::rows::series_queries!(SqliteStore, SqliteRow, read: [Mode::Read,], write: [Mode::Write,]);
super::rows::row_readers!(SqliteRow, sqlx::Sqlite);

/// Connections in the pool. SQLite has one writer at a time anyway; a few connections let
/// readers (`Watch`, `ctl status`) run beside the writer under WAL.
const POOL_SIZE: u32 = 4;

/// How long a writer waits for another writer's lock before failing with `SQLITE_BUSY`.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

/// Columns bound per row of `receipts` in the multi-row insert (the typed step columns included).
const RECEIPT_PARAMS: usize = 21;

/// Largest multi-row insert, in rows: a power of two with `RECEIPT_PARAMS * rows` well under
/// SQLite's limit of 32,766 bound parameters. Smaller remainders are inserted with the power
/// of two sizes below it, so at most 11 distinct statements exist per table and all stay in the
/// connection's prepared-statement cache.
const MAX_CHUNK_LOG2: u32 = 10;

/// The SQLite store.
///
/// # What we persist
/// See the [module documentation of the store](super); the schema with a comment on every
/// column is in `migrations/sqlite/` (`0001_init.sql`, then one file per feature), and
/// `docs/schema.md` explains it to operators.
///
/// Durability: the file runs in WAL mode with `synchronous=FULL`. A receipt is acknowledged to
/// the agent only after its transaction commits, and the agent then moves its resend cursor
/// past it. A SIGKILL of the controller alone loses nothing once `write()` returned (the data
/// sits in the kernel's page cache), but a kernel panic or power cut would; `FULL` makes every
/// commit fsync the WAL, so an acknowledged receipt survives those too. With `NORMAL` the WAL
/// is only synced at checkpoints and the last acknowledged batches could vanish for good.
#[derive(Debug, Clone)]
pub struct SqliteStore {
    pool: SqlitePool,
    /// Writers of this process take turns here before `BEGIN IMMEDIATE`. SQLite admits one
    /// writer at a time, and one that finds the file locked waits in its busy handler, which
    /// sleeps in steps of up to 100 ms whether or not the lock is freed sooner: two agents'
    /// receipt batches would sleep past each other's commits. A queue in the process hands the
    /// lock over the moment the writer before commits (the busy handler still covers writers of
    /// other processes, such as `trainyard-controller admin`).
    writers: Arc<tokio::sync::Mutex<()>>,
}

/// Whether an operation writes: writers take the write lock at `BEGIN IMMEDIATE`, so they wait
/// in SQLite's busy handler instead of failing when a read lock cannot be upgraded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Read,
    Write,
}

impl SqliteStore {
    /// Opens `sqlite://...` URLs (options in the URL are kept, ours are applied on top) or a
    /// plain file path; see [`SqliteStore::open_file`].
    pub async fn open(url_or_path: &str) -> Result<Self> {
        if url_or_path.starts_with("sqlite:") {
            let options = SqliteConnectOptions::from_str(url_or_path)?;
            // Each connection to an in-memory URL would see its own database: keep one.
            let in_memory = url_or_path.contains(":memory:") || url_or_path.contains("mode=memory");
            Self::open_with(options, if in_memory { 1 } else { POOL_SIZE }).await
        } else {
            Self::open_file(Path::new(url_or_path)).await
        }
    }

    /// Opens (creating it if missing) the database file at `path` and applies the migrations.
    pub async fn open_file(path: &Path) -> Result<Self> {
        Self::open_with(SqliteConnectOptions::new().filename(path), POOL_SIZE).await
    }

    /// A private in-memory database, for tests. One connection that never expires: every
    /// connection to `:memory:` would otherwise see its own empty database.
    pub async fn open_in_memory() -> Result<Self> {
        let options = SqliteConnectOptions::from_str("sqlite::memory:")?;
        Self::open_with(options, 1).await
    }

    async fn open_with(options: SqliteConnectOptions, max_connections: u32) -> Result<Self> {
        let options = options
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .foreign_keys(true)
            .busy_timeout(BUSY_TIMEOUT);
        if max_connections > 1 {
            // One connection switches a new file to WAL and migrates it before the pool opens
            // more: connections racing to do that get SQLITE_BUSY without waiting.
            use sqlx::Connection as _;
            let mut first = SqliteConnection::connect_with(&options).await?;
            sqlx::migrate!("../migrations/sqlite").run(&mut first).await?;
            first.close().await?;
        }
        let pool = SqlitePoolOptions::new()
            .max_connections(max_connections)
            .min_connections(1)
            .idle_timeout(None)
            .max_lifetime(None)
            .connect_with(options)
            .await?;
        sqlx::migrate!("../migrations/sqlite").run(&pool).await?;
        Ok(SqliteStore { pool, writers: Arc::default() })
    }

    /// The pool, for read-only SQL that is not part of the [`Store`] contract (operator views,
    /// tests). Writes go through the trait.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// The one helper every operation goes through: a span with the operation's label, one
    /// transaction, committed if `body` succeeds and rolled back (by drop) if it fails.
    async fn run<T>(
        &self,
        op: &'static str,
        mode: Mode,
        body: impl AsyncFnOnce(&mut SqliteConnection) -> Result<T>,
    ) -> Result<T> {
        let span = tracing::debug_span!("store", op);
        let started = std::time::Instant::now();
        let result = async move {
            let _turn = match mode {
                Mode::Read => None,
                Mode::Write => Some(self.writers.lock().await),
            };
            let mut tx = match mode {
                Mode::Read => self.pool.begin().await?,
                Mode::Write => self.pool.begin_with("BEGIN IMMEDIATE").await?,
            };
            let value = body(&mut tx).await?;
            tx.commit().await?;
            Ok(value)
        }
        .instrument(span)
        .await;
        crate::metrics::metrics().store_op(op, started.elapsed(), result.is_ok());
        result
    }
}

#[async_trait]
impl JobStore for SqliteStore {
    async fn create_job_for(
        &self,
        spec: &JobSpec,
        key: Option<&str>,
        owner: &JobOwner,
        reason: &str,
        now_ms: i64,
    ) -> Result<JobRecord> {
        self.run("create_job", Mode::Write, async |c| {
            let (engine_kind, argv_json, workdir) = engine_columns(spec);
            let resources = &spec.resources;
            let id: i64 = sqlx::query_scalar(
                "INSERT INTO jobs (name, state, reason, attempt, priority, gpus, gpus_per_node, \
                 engine_kind, argv_json, workdir, spec_pb, created_at_ms, updated_at_ms, submit_key, submitted_by, run_as) \
                 VALUES (?, 'pending', ?, 0, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING id",
            )
            .bind(spec.name.clone())
            .bind(reason.to_owned())
            .bind(spec.priority)
            .bind(resources.gpus)
            .bind(resources.gpus_per_node)
            .bind(engine_kind)
            .bind(argv_json)
            .bind(workdir)
            .bind(encode_spec(spec))
            .bind(now_ms)
            .bind(now_ms)
            .bind(key)
            .bind(&owner.user)
            .bind(&owner.run_as)
            .fetch_one(&mut *c)
            .await
            .map_err(duplicate_or)?;
            let id = job_id_from(id)?;
            insert_event(c, id, None, JobState::Pending, 0, reason, now_ms).await?;
            fetch_job(c, id).await?.ok_or(StoreError::JobNotFound(id))
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
        self.run("transition", Mode::Write, async |c| {
            move_job(c, job, from, to, attempt, reason, now_ms).await
        })
        .await
    }

    async fn schedule(
        &self,
        job: JobId,
        attempt: u32,
        allocations: &[Allocation],
        reason: &str,
        now_ms: i64,
    ) -> Result<JobRecord> {
        self.run("schedule", Mode::Write, async |c| {
            let record =
                move_job(c, job, JobState::Pending, JobState::Scheduled, attempt, reason, now_ms).await?;
            for a in allocations {
                insert_allocation(c, job, attempt, a, now_ms).await?;
            }
            Ok(record)
        })
        .await
    }

    async fn job_by_key(&self, key: &str) -> Result<Option<JobRecord>> {
        self.run("job_by_key", Mode::Read, async |c| {
            let row = sqlx::query(concat!("SELECT ", job_columns!(), " FROM jobs WHERE submit_key = ?"))
                .bind(key)
                .fetch_optional(&mut *c)
                .await?;
            row.as_ref().map(job_from_row).transpose()
        })
        .await
    }

    async fn get_job(&self, job: JobId) -> Result<Option<JobRecord>> {
        self.run("get_job", Mode::Read, async |c| fetch_job(c, job).await).await
    }

    async fn list_jobs(
        &self,
        active_only: bool,
        submitted_by: Option<&str>,
        limit: u32,
    ) -> Result<Vec<JobRecord>> {
        self.run("list_jobs", Mode::Read, async |c| {
            let rows = sqlx::query(concat!(
                "SELECT ",
                job_columns!(),
                " FROM jobs WHERE (? = 0 OR state NOT IN ('succeeded', 'failed', 'cancelled')) \
                 AND (? IS NULL OR submitted_by = ?) ORDER BY id DESC LIMIT ?"
            ))
            .bind(active_only)
            .bind(submitted_by)
            .bind(submitted_by)
            .bind(limit)
            .fetch_all(&mut *c)
            .await?;
            rows.iter().map(job_from_row).collect()
        })
        .await
    }

    async fn job_events(&self, job: JobId) -> Result<Vec<JobEventRecord>> {
        self.run("job_events", Mode::Read, async |c| {
            let rows = sqlx::query(
                "SELECT job_id, at_ms, from_state, to_state, attempt, reason FROM job_events \
                 WHERE job_id = ? ORDER BY id",
            )
            .bind(int(job)?)
            .fetch_all(&mut *c)
            .await?;
            rows.iter().map(event_from_row).collect()
        })
        .await
    }

    async fn allocations(&self, job: JobId, attempt: u32) -> Result<Vec<Allocation>> {
        self.run("allocations", Mode::Read, async |c| {
            let rows = sqlx::query(concat!(
                "SELECT ",
                allocation_columns!(),
                " FROM allocations a WHERE a.job_id = ? AND a.attempt = ? ORDER BY a.rank"
            ))
            .bind(int(job)?)
            .bind(attempt)
            .fetch_all(&mut *c)
            .await?;
            rows.iter().map(allocation_from_row).collect()
        })
        .await
    }

    async fn observe_rank(&self, id: RankId, observed: &RankObserved) -> Result<bool> {
        self.run("observe_rank", Mode::Write, async |c| {
            let done = sqlx::query(
                "UPDATE allocations SET state = ?, pid = ?, exit_code = ?, signal = ?, \
                 message = ?, skipped_lines = ?, updated_at_ms = ?, \
                 effective_cpus = ?, effective_mems = ? \
                 WHERE job_id = ? AND attempt = ? AND rank = ?",
            )
            .bind(observed.state.as_str())
            .bind(observed.pid)
            .bind(observed.exit_code)
            .bind(observed.signal)
            .bind(observed.message.clone())
            .bind(int(observed.skipped_lines)?)
            .bind(observed.updated_at_ms)
            .bind(observed.effective_cpus.clone())
            .bind(observed.effective_mems.clone())
            .bind(int(id.job_id)?)
            .bind(id.attempt)
            .bind(id.rank)
            .execute(&mut *c)
            .await?;
            Ok(done.rows_affected() > 0)
        })
        .await
    }
}

#[async_trait]
impl FleetStore for SqliteStore {
    async fn upsert_agent(&self, agent: &AgentRecord) -> Result<()> {
        self.run("upsert_agent", Mode::Write, async |c| {
            let inv = &agent.inventory;
            sqlx::query(
                "INSERT INTO agents (agent_id, hostname, address, agent_version, state, \
                 gpu_count, inventory_pb, first_seen_ms, last_seen_ms) \
                 VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) \
                 ON CONFLICT (agent_id) DO UPDATE SET hostname = excluded.hostname, \
                 address = excluded.address, agent_version = excluded.agent_version, \
                 state = excluded.state, gpu_count = excluded.gpu_count, \
                 inventory_pb = excluded.inventory_pb, last_seen_ms = excluded.last_seen_ms",
            )
            .bind(agent.agent_id.clone())
            .bind(inv.hostname.clone())
            .bind(agent.address.clone())
            .bind(agent.agent_version.clone())
            .bind(agent.state.as_str())
            .bind(inv.gpus.len() as i64)
            .bind(encode_inventory(inv))
            .bind(agent.last_seen_ms)
            .bind(agent.last_seen_ms)
            .execute(&mut *c)
            .await?;
            sqlx::query("DELETE FROM gpus WHERE agent_id = ?")
                .bind(agent.agent_id.clone())
                .execute(&mut *c)
                .await?;
            for gpu in &inv.gpus {
                sqlx::query(
                    "INSERT INTO gpus (agent_id, gpu_index, uuid, model, memory_mib, \
                     pci_bus_id, numa_node) VALUES (?, ?, ?, ?, ?, ?, ?)",
                )
                .bind(agent.agent_id.clone())
                .bind(gpu.index)
                .bind(gpu.uuid.clone())
                .bind(gpu.model.clone())
                .bind(int(gpu.memory_mib)?)
                .bind(gpu.pci_bus_id.clone())
                .bind(gpu.numa_node.map_or(-1, i64::from))
                .execute(&mut *c)
                .await?;
            }
            Ok(())
        })
        .await
    }

    async fn touch_agents(&self, seen: &[(String, i64)]) -> Result<()> {
        if seen.is_empty() {
            return Ok(());
        }
        self.run("touch_agents", Mode::Write, async |c| {
            for (agent_id, at_ms) in seen {
                sqlx::query("UPDATE agents SET last_seen_ms = max(last_seen_ms, ?) WHERE agent_id = ?")
                    .bind(*at_ms)
                    .bind(agent_id.to_owned())
                    .execute(&mut *c)
                    .await?;
            }
            Ok(())
        })
        .await
    }

    /// An unknown agent is ignored: it has never said hello, so there is nothing to update.
    async fn set_agent_state(&self, agent_id: &str, state: AgentState, now_ms: i64) -> Result<()> {
        self.run("set_agent_state", Mode::Write, async |c| {
            sqlx::query("UPDATE agents SET state = ?, last_seen_ms = ? WHERE agent_id = ?")
                .bind(state.as_str())
                .bind(now_ms)
                .bind(agent_id.to_owned())
                .execute(&mut *c)
                .await?;
            Ok(())
        })
        .await
    }

    async fn snapshot(&self) -> Result<Snapshot> {
        self.run("snapshot", Mode::Read, async |c| {
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
impl ReceiptStore for SqliteStore {
    async fn insert_receipts(&self, receipts: &[NewReceipt], now_ms: i64) -> Result<u64> {
        if receipts.is_empty() {
            return Ok(0);
        }
        self.run("insert_receipts", Mode::Write, async |c| {
            let mut inserted = 0;
            for (log2, chunk) in chunks(receipts) {
                let mut query = sqlx::query(AssertSqlSafe(insert_receipts_sql(log2)));
                for r in chunk {
                    let m = r.metrics.clone().unwrap_or_default();
                    query = query
                        .bind(int(r.id.job_id)?)
                        .bind(r.id.attempt)
                        .bind(r.id.rank)
                        .bind(int(r.seq)?)
                        .bind(r.kind.clone())
                        .bind(r.step)
                        .bind(r.body.clone())
                        .bind(now_ms)
                        .bind(r.problem.clone())
                        .bind(m.step_time_ms)
                        .bind(m.fwd_bwd_ms)
                        .bind(m.optimizer_ms)
                        .bind(m.optimizer_reduce_ms)
                        .bind(m.optimizer_compute_gather_ms)
                        .bind(m.optimizer_wait_ms)
                        .bind(m.tokens_per_s)
                        .bind(m.mfu)
                        .bind(m.loss)
                        .bind(m.mem_allocated_bytes)
                        .bind(m.mem_reserved_bytes)
                        .bind(m.mem_peak_allocated_bytes);
                }
                inserted += query.execute(&mut *c).await?.rows_affected();
            }
            Ok(inserted)
        })
        .await
    }

    async fn receipts_after(&self, job: JobId, after: u64, limit: u32) -> Result<Vec<StoredReceiptRecord>> {
        self.run("receipts_after", Mode::Read, async |c| {
            let rows = sqlx::query(
                "SELECT position, job_id, attempt, rank, seq, kind, step, body FROM receipts \
                 WHERE job_id = ? AND position > ? ORDER BY position LIMIT ?",
            )
            .bind(int(job)?)
            .bind(int(after)?)
            .bind(limit)
            .fetch_all(&mut *c)
            .await?;
            rows.iter().map(receipt_from_row).collect()
        })
        .await
    }

    async fn last_seqs(&self, job: JobId, attempt: u32) -> Result<Vec<(u32, u64)>> {
        self.run("last_seqs", Mode::Read, async |c| {
            let rows = sqlx::query(
                "SELECT rank, max(seq) AS seq FROM receipts WHERE job_id = ? AND attempt = ? \
                 GROUP BY rank ORDER BY rank",
            )
            .bind(int(job)?)
            .bind(attempt)
            .fetch_all(&mut *c)
            .await?;
            rows.iter().map(|row| Ok((num(row, "receipts", "rank")?, num(row, "receipts", "seq")?))).collect()
        })
        .await
    }

    async fn receipt_count(&self, job: JobId) -> Result<u64> {
        self.run("receipt_count", Mode::Read, async |c| {
            let row = sqlx::query("SELECT count(*) AS n FROM receipts WHERE job_id = ?")
                .bind(int(job)?)
                .fetch_one(&mut *c)
                .await?;
            num(&row, "receipts", "n")
        })
        .await
    }

    async fn receipt_problems(&self, job: JobId) -> Result<(u64, Option<String>)> {
        self.run("receipt_problems", Mode::Read, async |c| {
            let row = sqlx::query(
                "SELECT count(*) AS n, (SELECT problem FROM receipts WHERE job_id = ? \
                 AND problem IS NOT NULL ORDER BY position DESC LIMIT 1) AS newest \
                 FROM receipts WHERE job_id = ? AND problem IS NOT NULL",
            )
            .bind(int(job)?)
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
        self.run("mean_optimizer_ms", Mode::Read, async |c| {
            let row = sqlx::query(
                "SELECT avg(optimizer_ms) AS ms FROM (SELECT optimizer_ms FROM receipts \
                 WHERE job_id = ? AND kind = 'step' AND optimizer_ms IS NOT NULL \
                 ORDER BY position DESC LIMIT 1000)",
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
impl PreflightStore for SqliteStore {
    async fn insert_preflight(&self, report: &PreflightRecord, now_ms: i64) -> Result<u64> {
        self.run("insert_preflight", Mode::Write, async |c| {
            let stored: Option<i64> = sqlx::query_scalar(
                "SELECT id FROM preflight_reports WHERE agent_id = ? AND local_id = ? AND local_id <> ''",
            )
            .bind(report.agent_id.clone())
            .bind(report.local_id.clone())
            .fetch_optional(&mut *c)
            .await?;
            if let Some(id) = stored {
                return report_id_from(id);
            }
            let id: i64 = sqlx::query_scalar(
                "INSERT INTO preflight_reports (agent_id, local_id, level, started_at_ms, \
                 finished_at_ms, verdict, interconnect_class, driver_version, cuda_version, \
                 nccl_version, source, topology, received_at_ms) \
                 VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING id",
            )
            .bind(report.agent_id.clone())
            .bind(report.local_id.clone())
            .bind(report.level.as_str())
            .bind(report.started_at_ms)
            .bind(report.finished_at_ms)
            .bind(report.verdict.as_str())
            .bind(report.interconnect_class.map_or("", |c| c.as_str()))
            .bind(report.driver_version.clone())
            .bind(report.cuda_version.clone())
            .bind(report.nccl_version.clone())
            .bind(report.source.clone())
            .bind(report.topology.clone())
            .bind(now_ms)
            .fetch_one(&mut *c)
            .await?;
            insert_checks(c, id, &report.checks).await?;
            report_id_from(id)
        })
        .await
    }

    async fn latest_preflight(&self, agent_id: &str) -> Result<Option<PreflightRecord>> {
        self.run("latest_preflight", Mode::Read, async |c| {
            let newest = "(SELECT max(id) FROM preflight_reports WHERE agent_id = ?)";
            let mut reports = fetch_preflights(c, newest, Some(agent_id)).await?;
            Ok(reports.pop())
        })
        .await
    }

    async fn latest_preflights(&self) -> Result<Vec<PreflightRecord>> {
        self.run("latest_preflights", Mode::Read, async |c| {
            let newest = "(SELECT max(id) FROM preflight_reports GROUP BY agent_id)";
            fetch_preflights(c, newest, None).await
        })
        .await
    }
}

/// Columns bound per check row in [`insert_checks`].
const CHECK_PARAMS: usize = 7;

/// Largest multi-row insert of checks: a report has tens of checks, so one statement nearly
/// always holds them all; the bound keeps a pathological report under SQLite's parameter limit.
const MAX_CHECK_ROWS: usize = 1_024;

/// Writes the checks of report `report_id` in order, in as few statements as the parameter
/// limit allows.
async fn insert_checks(c: &mut SqliteConnection, report_id: i64, checks: &[CheckRecord]) -> Result<()> {
    for (chunk_no, chunk) in checks.chunks(MAX_CHECK_ROWS).enumerate() {
        let row = format!("({})", ["?"; CHECK_PARAMS].join(", "));
        let sql = format!(
            "INSERT INTO preflight_checks (report_id, position, check_id, status, measured, expected, \
             remedy) VALUES {}",
            vec![row.as_str(); chunk.len()].join(", ")
        );
        let mut query = sqlx::query(AssertSqlSafe(sql));
        for (i, check) in chunk.iter().enumerate() {
            query = query
                .bind(report_id)
                .bind((chunk_no * MAX_CHECK_ROWS + i) as i64)
                .bind(check.id.clone())
                .bind(check.status.as_str())
                .bind(check.measured.clone())
                .bind(check.expected.clone())
                .bind(check.remedy.clone());
        }
        query.execute(&mut *c).await?;
    }
    Ok(())
}

/// The reports whose id is in `ids` (a subquery taking `agent_id` as its only parameter, or
/// none), with their checks, ordered by agent id.
async fn fetch_preflights(
    c: &mut SqliteConnection,
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

/// `items` in chunks of power-of-two sizes (largest first, at most `2^MAX_CHUNK_LOG2`), with
/// the log2 of each chunk's size.
fn chunks<T>(mut items: &[T]) -> impl Iterator<Item = (u32, &[T])> {
    std::iter::from_fn(move || {
        if items.is_empty() {
            return None;
        }
        let log2 = items.len().ilog2().min(MAX_CHUNK_LOG2);
        let (chunk, rest) = items.split_at(1 << log2);
        items = rest;
        Some((log2, chunk))
    })
}

/// `INSERT ... VALUES (...), (...) ON CONFLICT DO NOTHING` for `2^log2` rows of `params`
/// columns, built once per size and kept in `cache`, so the statement text (the key of sqlx's
/// statement cache) is identical every time.
fn multi_row_sql(cache: &'static OnceLock<Vec<Arc<str>>>, head: &str, params: usize, log2: u32) -> Arc<str> {
    let all = cache.get_or_init(|| {
        (0..=MAX_CHUNK_LOG2)
            .map(|l| {
                let row = format!("({})", ["?"; 64][..params].join(", "));
                let rows = vec![row.as_str(); 1 << l].join(", ");
                format!("{head} VALUES {rows} ON CONFLICT (job_id, attempt, rank, seq) DO NOTHING").into()
            })
            .collect()
    });
    Arc::clone(&all[log2 as usize])
}

fn insert_receipts_sql(log2: u32) -> Arc<str> {
    static SQL: OnceLock<Vec<Arc<str>>> = OnceLock::new();
    let head = "INSERT INTO receipts (job_id, attempt, rank, seq, kind, step, body, stored_at_ms, problem, \
                step_time_ms, fwd_bwd_ms, optimizer_ms, optimizer_reduce_ms, optimizer_compute_gather_ms, \
                optimizer_wait_ms, tokens_per_s, mfu, loss, mem_allocated_bytes, mem_reserved_bytes, \
                mem_peak_allocated_bytes)";
    multi_row_sql(&SQL, head, RECEIPT_PARAMS, log2)
}

/// Moves `job` from `from` to `to` inside the caller's transaction.
async fn move_job(
    c: &mut SqliteConnection,
    job: JobId,
    from: JobState,
    to: JobState,
    attempt: u32,
    reason: &str,
    now_ms: i64,
) -> Result<JobRecord> {
    let current = fetch_job(c, job).await?.ok_or(StoreError::JobNotFound(job))?;
    if current.state != from {
        return Err(StoreError::StateConflict { job, expected: from, actual: current.state });
    }
    sqlx::query("UPDATE jobs SET state = ?, reason = ?, attempt = ?, updated_at_ms = ? WHERE id = ?")
        .bind(to.as_str())
        .bind(reason.to_owned())
        .bind(attempt)
        .bind(now_ms)
        .bind(int(job)?)
        .execute(&mut *c)
        .await?;
    insert_event(c, job, Some(from), to, attempt, reason, now_ms).await?;
    Ok(JobRecord { state: to, reason: reason.to_owned(), attempt, updated_at_ms: now_ms, ..current })
}

async fn insert_event(
    c: &mut SqliteConnection,
    job: JobId,
    from: Option<JobState>,
    to: JobState,
    attempt: u32,
    reason: &str,
    now_ms: i64,
) -> Result<()> {
    sqlx::query(
        "INSERT INTO job_events (job_id, at_ms, from_state, to_state, attempt, reason) \
         VALUES (?, ?, ?, ?, ?, ?)",
    )
    .bind(int(job)?)
    .bind(now_ms)
    .bind(from.map(JobState::as_str))
    .bind(to.as_str())
    .bind(attempt)
    .bind(reason.to_owned())
    .execute(&mut *c)
    .await?;
    Ok(())
}

/// Writes one planned rank; `job` and `attempt` come from the `schedule` call, the rank from
/// the allocation.
async fn insert_allocation(
    c: &mut SqliteConnection,
    job: JobId,
    attempt: u32,
    a: &Allocation,
    now_ms: i64,
) -> Result<()> {
    let o = &a.observed;
    sqlx::query(
        "INSERT INTO allocations (job_id, attempt, rank, agent_id, gpu_index, node_rank, \
         local_rank, state, pid, exit_code, signal, message, skipped_lines, updated_at_ms, \
         planned_cpus, planned_mems, effective_cpus, effective_mems) \
         VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
    )
    .bind(int(job)?)
    .bind(attempt)
    .bind(a.id.rank)
    .bind(a.agent_id.clone())
    .bind(a.gpu_index)
    .bind(a.node_rank)
    .bind(a.local_rank)
    .bind(o.state.as_str())
    .bind(o.pid)
    .bind(o.exit_code)
    .bind(o.signal)
    .bind(o.message.clone())
    .bind(int(o.skipped_lines)?)
    .bind(if o.updated_at_ms == 0 { now_ms } else { o.updated_at_ms })
    .bind(a.planned_cpus.clone())
    .bind(a.planned_mems.clone())
    .bind(o.effective_cpus.clone())
    .bind(o.effective_mems.clone())
    .execute(&mut *c)
    .await?;
    Ok(())
}

async fn fetch_job(c: &mut SqliteConnection, job: JobId) -> Result<Option<JobRecord>> {
    let row = sqlx::query(concat!("SELECT ", job_columns!(), " FROM jobs WHERE id = ?"))
        .bind(int(job)?)
        .fetch_optional(&mut *c)
        .await?;
    row.as_ref().map(job_from_row).transpose()
}

#[cfg(test)]
#[path = "tests.rs"]
mod tests;
