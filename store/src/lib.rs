//! The controller's durable store: SQLite (embedded default) or PostgreSQL (fleets), behind one
//! trait per concern.
//!
//! # Layout
//! - this page: the traits, one per concern ([`JobStore`], [`FleetStore`], [`ReceiptStore`],
//!   [`DiagnosisStore`], [`PreflightStore`], [`AuthStore`], [`SeriesStore`], [`TelemetryStore`],
//!   [`LeaseStore`]), the store's own rows and [`StoreError`].
//! - `db`: [`SqlStore`], the one implementation, on either database, and the one helper
//!   every operation goes through (a span, a transaction, metrics).
//! - `jobs`, `fleet`, `receipts`, `diagnosis`, `preflight`, `auth`, `series`, `telemetry`,
//!   `lease`: each trait's implementation with its SQL, written once for both databases;
//!   `fence`: the check of the leader's lease at the start of every write.
//! - `group` and `waiting`: group commit, for the writes a fleet sends by the thousand a
//!   second (receipt batches, rank reports): those that arrive together commit at once.
//! - `sql`: the seam between those queries and the two drivers: a connection, a query, a row.
//! - `sqlite` and `postgres`: what is each database's own: opening it, running a transaction
//!   (SQLite's writer queue, PostgreSQL's retries), and the receipt batch in its fastest form.
//! - `rows`: row readers and column conversions; `error`: [`StoreError`].
//! - [`metrics`]: the duration and failures of every store operation, for `/metrics`.
//!
//! The records the core holds (jobs, allocations, agents, preflight reports) are
//! [`trainyard_model::records`], re-exported here because every method speaks them; the analysis
//! types it reads and writes (samples, findings, goodput, rollups) are [`trainyard_analysis`]'s.
//!
//! # What we persist
//! Every table and view is listed in docs/architecture.md (the store) and documented in
//! docs/schema.md. Two rules hold across them: a job's state in `jobs` is a cache of the newest
//! row of `job_events`, written in the same transaction; and a node's verdict is its newest
//! preflight of the whole node (a job's launch preflight is stored with its job, never a verdict).
//!
//! Not persisted: which agents are connected now, and the fleet view the scheduler works on:
//! both are rebuilt at start-up from these tables and the agents' hellos.
//!
//! The traits are narrow on purpose, because a backend nobody runs rots: every method is one
//! transaction, there is one implementation, and its tests run on both databases.

mod auth;
mod db;
mod diagnosis;
mod error;
mod fence;
mod fleet;
mod group;
mod jobs;
mod lease;
pub mod metrics;
mod postgres;
mod preflight;
mod receipts;
mod rows;
mod series;
mod sql;
mod sqlite;
mod telemetry;
#[cfg(test)]
mod tests;
mod waiting;

use std::sync::Arc;

use async_trait::async_trait;

pub use db::SqlStore;
pub(crate) use error::corrupt;
pub use error::{Result, StoreError};
pub use fence::Fence;
pub use lease::{Election, Lease};
pub use sqlite::SqliteClaim;
pub use trainyard_model::domain::{
    AgentState, CheckStatus, FailureKind, InterconnectClass, Inventory, JobState, PreflightLevel, RankState,
    Verdict,
};
pub use trainyard_model::records::*;
pub use trainyard_model::spec::JobSpec;

/// Opens the store a `--db` value names: `postgres://` or `postgresql://` URLs open
/// PostgreSQL, `sqlite:` URLs and plain paths open SQLite. Migrations run on open.
pub async fn open(url_or_path: &str) -> Result<Arc<dyn Store>> {
    Ok(Arc::new(SqlStore::open(url_or_path).await?))
}

/// A row of `users`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UserRecord {
    pub name: String,
    pub admin: bool,
    /// The Unix account this user's ranks run as; `None`: the user cannot submit.
    pub unix_user: Option<String>,
    pub created_at_ms: i64,
    /// Set: every token of the user is refused.
    pub disabled_at_ms: Option<i64>,
}

/// A row of `api_tokens`, without its hash.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenRecord {
    pub id: i64,
    pub user_name: String,
    /// The token's first characters, so an operator can tell two tokens of a user apart.
    pub prefix: String,
    pub created_at_ms: i64,
    pub expires_at_ms: Option<i64>,
    pub revoked_at_ms: Option<i64>,
}

/// A row of `audit_log`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditEntry {
    pub at_ms: i64,
    /// The user; `-` when no valid credential came with the call.
    pub actor: String,
    /// e.g. `job.submit`, `job.cancel`, `node.preflight`, `user.add`, `token.revoke`.
    pub action: String,
    /// e.g. `job:42`, `node:sxm-a`, `user:alice`.
    pub target: String,
    pub accepted: bool,
    /// Why it was refused, or what changed.
    pub detail: String,
}

/// One receipt to store.
#[derive(Debug, Clone, PartialEq)]
pub struct NewReceipt {
    pub id: RankId,
    pub seq: u64,
    pub kind: String,
    /// The receipt's `step` field, if it had one.
    pub step: Option<i64>,
    /// The line as the rank wrote it.
    pub body: String,
    /// Why it breaks receipt schema v1 (`trainyard_model::receipts::check`), if it does.
    pub problem: Option<String>,
    /// The typed fields of a step receipt, stored in `step_metrics`.
    pub metrics: Option<trainyard_model::receipts::StepMetrics>,
}

/// A stored receipt with its position (monotonic across the store) for `Watch` cursors.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredReceiptRecord {
    pub position: u64,
    pub id: RankId,
    pub seq: u64,
    pub kind: String,
    pub step: Option<i64>,
    pub body: String,
}

/// Everything the controller reloads at start-up.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// Jobs not in a terminal state, oldest first.
    pub active_jobs: Vec<JobRecord>,
    /// Allocations of the current attempt of every active job.
    pub allocations: Vec<Allocation>,
    pub agents: Vec<AgentRecord>,
}

/// Jobs, their events and their allocations. Every method is one transaction.
#[async_trait]
pub trait JobStore: Send + Sync {
    /// Stores a new job in `pending` with a creation event, and returns it. `key` is the
    /// submit's idempotency key: a second job with the same key fails with
    /// [`StoreError::Duplicate`] and stores nothing.
    async fn create_job_for(
        &self,
        spec: &JobSpec,
        key: Option<&str>,
        owner: &JobOwner,
        reason: &str,
        now_ms: i64,
    ) -> Result<JobRecord>;

    /// [`JobStore::create_job_for`] with no owner (tests and tools that predate users).
    async fn create_job(
        &self,
        spec: &JobSpec,
        key: Option<&str>,
        reason: &str,
        now_ms: i64,
    ) -> Result<JobRecord> {
        self.create_job_for(spec, key, &JobOwner::default(), reason, now_ms).await
    }

    /// The job created with idempotency key `key`, if any.
    async fn job_by_key(&self, key: &str) -> Result<Option<JobRecord>>;

    /// Moves a job from `from` to `to`, writing the event; fails with `StateConflict` if the job
    /// is not in `from`. `attempt` is the job's attempt after the transition.
    async fn transition(
        &self,
        job: JobId,
        from: JobState,
        to: JobState,
        attempt: u32,
        reason: &str,
        now_ms: i64,
    ) -> Result<JobRecord>;

    /// Writes the allocations of one attempt and moves the job `pending → scheduled` in the
    /// same transaction, so a placement is never half-recorded.
    async fn schedule(
        &self,
        job: JobId,
        attempt: u32,
        allocations: &[Allocation],
        reason: &str,
        now_ms: i64,
    ) -> Result<JobRecord>;

    async fn get_job(&self, job: JobId) -> Result<Option<JobRecord>>;

    /// Jobs newest first, at most `limit`; only unfinished ones with `active_only`, only those
    /// `submitted_by` submitted when given.
    async fn list_jobs(
        &self,
        active_only: bool,
        submitted_by: Option<&str>,
        limit: u32,
    ) -> Result<Vec<JobRecord>>;

    /// Oldest first.
    async fn job_events(&self, job: JobId) -> Result<Vec<JobEventRecord>>;

    /// Adds an event that is not a transition (its from and to are the job's state as it is, in
    /// the same transaction), e.g. receipts dropped over the job's quota.
    async fn note_job_event(&self, job: JobId, reason: &str, now_ms: i64) -> Result<()>;

    async fn allocations(&self, job: JobId, attempt: u32) -> Result<Vec<Allocation>>;

    /// [`JobStore::transition`] that also records the failure that caused it, in the same
    /// transaction: a restart is never stored without its cause, nor a cause without its move.
    #[allow(clippy::too_many_arguments)]
    async fn fail_attempt(
        &self,
        job: JobId,
        from: JobState,
        to: JobState,
        attempt: u32,
        reason: &str,
        failure: &FailureRecord,
    ) -> Result<JobRecord>;

    /// The failures of one job, oldest first.
    async fn failures(&self, job: JobId) -> Result<Vec<FailureRecord>>;

    /// Every failure detected at or after `since_ms` (rebuilding node blame at start-up).
    async fn failures_since(&self, since_ms: i64) -> Result<Vec<FailureRecord>>;

    /// Records what an agent reported about one rank. Unknown ranks are ignored (returns false).
    async fn observe_rank(&self, id: RankId, observed: &RankObserved) -> Result<bool>;
}

/// The agents and their GPUs, and the start-up snapshot. Every method is one transaction.
#[async_trait]
pub trait FleetStore: Send + Sync {
    /// Inserts or replaces an agent and its `gpus` rows.
    async fn upsert_agent(&self, agent: &AgentRecord) -> Result<()>;

    async fn set_agent_state(&self, agent_id: &str, state: AgentState, now_ms: i64) -> Result<()>;

    /// Moves `last_seen_ms` of connected agents forward (heartbeats), one transaction for all;
    /// unknown agents are ignored.
    async fn touch_agents(&self, seen: &[(String, i64)]) -> Result<()>;

    /// Cordons a node (`Some`) or lifts its cordon (`None`); false when no such agent is known.
    async fn set_cordon(&self, agent_id: &str, cordon: Option<&Cordon>) -> Result<bool>;

    /// Jobs, allocations and agents to rebuild the in-memory view after a restart.
    async fn snapshot(&self) -> Result<Snapshot>;
}

/// The wait for a queued receipt batch's commit: how many of its rows were new
/// ([`ReceiptStore::queue_receipts`]).
pub type Queued<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = Result<u64>> + Send + 'a>>;

/// Receipts: the hot path. Every method is one transaction.
#[async_trait]
pub trait ReceiptStore: Send + Sync {
    /// Stores a batch in one transaction; receipts already stored are skipped. Returns how many
    /// rows were new.
    async fn insert_receipts(&self, receipts: &[NewReceipt], now_ms: i64) -> Result<u64> {
        self.queue_receipts(receipts.to_vec(), now_ms).await
    }

    /// [`ReceiptStore::insert_receipts`] in two halves: the batch joins the next commit group
    /// now, in the order of the calls (so one agent's batches are written in the order they
    /// came, however their waits overlap), and the returned future waits for its commit. The
    /// ingest path queues a stream's next batch while the one before is being written.
    fn queue_receipts(&self, receipts: Vec<NewReceipt>, now_ms: i64) -> Queued<'_>;

    /// Receipts of a job with `position > after`, in position order, at most `limit`.
    async fn receipts_after(&self, job: JobId, after: u64, limit: u32) -> Result<Vec<StoredReceiptRecord>>;

    /// Highest stored seq per rank of one attempt (ranks with no receipt are absent).
    async fn last_seqs(&self, job: JobId, attempt: u32) -> Result<Vec<(u32, u64)>>;

    /// The newest `limit` checkpoint receipts of a job (all attempts), newest first.
    async fn checkpoint_receipts(&self, job: JobId, limit: u32) -> Result<Vec<StoredReceiptRecord>>;

    /// Number of receipts stored for a job, all attempts.
    async fn receipt_count(&self, job: JobId) -> Result<u64>;

    /// Deletes the receipts of jobs that ended (succeeded, failed, cancelled) before
    /// `ended_before_ms` (the receipt retention); their plot rollups, goodput and findings stay.
    /// Returns how many.
    async fn prune_receipts(&self, ended_before_ms: i64) -> Result<u64>;

    /// Characters of the bodies of a job's stored receipts: of its step receipts, and of the
    /// others (its receipt quota's use, `core::quota`).
    async fn receipt_bytes(&self, job: JobId) -> Result<(u64, u64)>;

    /// How many of a job's receipts break receipt schema v1 (stored, flagged), with the
    /// problem of the newest one.
    async fn receipt_problems(&self, job: JobId) -> Result<(u64, Option<String>)>;
}

/// What diagnosis, goodput and stall detection read out of the receipts, and the outcome the
/// controller records when a job ends. Every method is one transaction.
#[async_trait]
pub trait DiagnosisStore: Send + Sync {
    /// The typed fields of every step receipt of one attempt, by rank and line (what
    /// `ctl diagnose` reads). A receipt without a `step` has step -1.
    async fn step_samples(
        &self,
        job: JobId,
        attempt: u32,
    ) -> Result<Vec<trainyard_analysis::diagnose::StepSample>>;

    /// The newest `limit` step receipts of one attempt stored after receipt position `after`
    /// (returned oldest first), with their positions: what the live diagnosis reads each round.
    /// Read backwards on the `(job_id, position)` index, so a round costs at most `limit` rows
    /// however far the reader fell behind; fewer than `limit` means nothing after `after` was
    /// left out.
    async fn latest_step_samples_after(
        &self,
        job: JobId,
        attempt: u32,
        after: u64,
        limit: u32,
    ) -> Result<Vec<(u64, trainyard_analysis::diagnose::StepSample)>>;

    /// Each rank's last step receipt of one attempt (step, stored at) and the step times of
    /// the attempt's latest 200 step receipts: what stall detection reads.
    async fn step_progress(
        &self,
        job: JobId,
        attempt: u32,
    ) -> Result<trainyard_analysis::diagnose::stall::StepProgress>;

    /// The body of the first receipt of `kind` of one attempt, from its lowest rank (rank 0's
    /// launch receipt: the run's provenance); `None` when there is none.
    async fn first_receipt(&self, job: JobId, attempt: u32, kind: &str) -> Result<Option<String>>;

    /// What rank 0's step, eval and checkpoint receipts of one attempt say about where its
    /// time went (the event times are left for the caller to fill in).
    async fn attempt_facts(
        &self,
        job: JobId,
        attempt: u32,
    ) -> Result<trainyard_analysis::diagnose::goodput::AttemptFacts>;

    /// Stores what the controller concluded about an ended job (`attempt_goodput`, and the
    /// findings of its last attempt's diagnosis in `job_findings`), replacing an earlier record.
    async fn record_outcome(
        &self,
        job: JobId,
        goodput: &trainyard_analysis::diagnose::goodput::Goodput,
        attempt: u32,
        findings: &[trainyard_analysis::diagnose::Finding],
        now_ms: i64,
    ) -> Result<()>;

    /// Mean optimizer time (ms) over the job's latest 1,000 step receipts that carry a valid
    /// `optimizer_ms` (from `step_metrics`); `None` when none does.
    async fn mean_optimizer_ms(&self, job: JobId) -> Result<Option<f64>>;
}

/// Preflight reports and their checks. Every method is one transaction.
#[async_trait]
pub trait PreflightStore: Send + Sync {
    /// Stores a preflight report with its checks (one transaction, checks in multi-row inserts)
    /// and returns its id. The same report sent again (same agent and non-empty `local_id`)
    /// is not stored twice: the id of the stored one comes back.
    async fn insert_preflight(&self, report: &PreflightRecord, now_ms: i64) -> Result<u64>;

    /// The newest report of one agent, with its checks and `report_id`.
    async fn latest_preflight(&self, agent_id: &str) -> Result<Option<PreflightRecord>>;

    /// The newest report of every agent that sent one, by agent id (start-up rebuild).
    async fn latest_preflights(&self) -> Result<Vec<PreflightRecord>>;
}

/// Users, their API tokens, and the audit log. Every method is one transaction.
#[async_trait]
pub trait AuthStore: Send + Sync {
    /// Adds a user; [`StoreError::Duplicate`] when the name is taken.
    async fn add_user(&self, user: &UserRecord) -> Result<()>;

    /// Replaces a user's admin flag, Unix account and disabled time; false when no such user.
    async fn update_user(&self, user: &UserRecord) -> Result<bool>;

    async fn get_user(&self, name: &str) -> Result<Option<UserRecord>>;

    async fn list_users(&self) -> Result<Vec<UserRecord>>;

    /// Stores the SHA-256 (hex) of a new token of `user`; returns the token's id.
    async fn add_token(
        &self,
        user: &str,
        sha256_hex: &str,
        prefix: &str,
        now_ms: i64,
        expires_at_ms: Option<i64>,
    ) -> Result<i64>;

    /// Revokes the user's tokens that are not revoked yet (only the one whose prefix is
    /// `prefix`, when given); returns how many.
    async fn revoke_tokens(&self, user: &str, prefix: Option<&str>, now_ms: i64) -> Result<u64>;

    /// The tokens of a user, newest first.
    async fn tokens_of(&self, user: &str) -> Result<Vec<TokenRecord>>;

    /// The token with this hash and its user, revoked and expired ones included (the caller
    /// says why it refuses them).
    async fn token_owner(&self, sha256_hex: &str) -> Result<Option<(TokenRecord, UserRecord)>>;

    /// The hash of every token, revoked and expired ones included: the authenticator's set of
    /// hashes worth a lookup, so that a flood of unknown tokens costs no query each.
    async fn token_hashes(&self) -> Result<Vec<String>>;

    async fn audit(&self, entry: &AuditEntry) -> Result<()>;

    /// The value stored under `name` in `controller_secrets`; the first caller stores `fresh`
    /// (a concurrent first caller's value wins for both: every member of a group reads one).
    async fn secret(&self, name: &str, fresh: &str, now_ms: i64) -> Result<String>;

    /// The newest `limit` audit rows, newest first.
    async fn audit_log(&self, limit: u32) -> Result<Vec<AuditEntry>>;
}

/// Step rollups for plots ([`trainyard_analysis::series`]).
#[async_trait]
pub trait SeriesStore: Send + Sync {
    /// Folds the job's receipts stored after its watermark into `step_rollups`: at most
    /// `max_rows` of them, stopping at the first stored after `settled_before_ms`. Returns how
    /// many receipts it read (fewer than `max_rows`: the job is folded up to that time).
    async fn roll_up_steps(&self, job: JobId, settled_before_ms: i64, max_rows: u32) -> Result<u64>;

    /// The folded steps of an attempt: (first step, last step, ranks), to 128 steps; `None`
    /// before any step receipt is folded.
    async fn rollup_extent(&self, job: JobId, attempt: u32) -> Result<Option<(i64, i64, u32)>>;

    /// The rollup rows of one level over a range of buckets, every rank, with only `metric`'s
    /// aggregate read (the others stay empty).
    async fn rollup_rows(
        &self,
        job: JobId,
        attempt: u32,
        metric: trainyard_analysis::series::Metric,
        level: i64,
        from_bucket: i64,
        to_bucket: i64,
    ) -> Result<Vec<trainyard_analysis::series::RollupRow>>;
}

/// The controller's store: every concern's trait, implemented by [`SqlStore`] on both
/// databases and exercised by one test suite.
/// GPU telemetry windows and the live diagnosis's findings (docs/telemetry.md). Every method
/// is one transaction.
#[async_trait]
pub trait TelemetryStore: Send + Sync {
    /// Stores windows; one already stored (same agent, GPU and start) is skipped, so a resent
    /// batch is stored once. Returns the rows stored.
    async fn insert_gpu_windows(&self, windows: &[GpuWindowRecord]) -> Result<u64>;

    /// A job's windows stored after row `after_id`, oldest first, with their row ids: what the
    /// live diagnosis reads each round.
    async fn job_gpu_windows_after(
        &self,
        job: JobId,
        after_id: u64,
        limit: u32,
    ) -> Result<Vec<(u64, GpuWindowRecord)>>;

    /// The windows of one attempt, by start time, at most `limit`.
    async fn attempt_gpu_windows(&self, job: JobId, attempt: u32, limit: u32)
    -> Result<Vec<GpuWindowRecord>>;

    /// A node's windows that started at or after `since_ms`, at most `limit`.
    async fn node_gpu_windows(&self, agent: &str, since_ms: i64, limit: u32) -> Result<Vec<GpuWindowRecord>>;

    /// Deletes the windows that ended before `before_ms` (retention); returns how many.
    async fn prune_gpu_windows(&self, before_ms: i64) -> Result<u64>;

    /// Opens a finding, or updates the open one of the same job, cause and subject (its
    /// nodes, ranks, summary, evidence, remedy and `updated_at_ms`); returns the row.
    async fn upsert_live_finding(&self, finding: &LiveFinding) -> Result<LiveFinding>;

    /// Closes an open finding.
    async fn close_live_finding(&self, id: u64, at_ms: i64) -> Result<()>;

    /// A job's findings with ids above `after_id`, open and closed, oldest first.
    async fn live_findings(&self, job: JobId, after_id: u64) -> Result<Vec<LiveFinding>>;

    /// Every open finding (what the live diagnosis resumes from after a restart).
    async fn open_live_findings(&self) -> Result<Vec<LiveFinding>>;

    /// Findings whose opening or closing alert has not been delivered, oldest first.
    async fn unalerted_findings(&self, limit: u32) -> Result<Vec<LiveFinding>>;

    /// Records that a finding's opening (or closing) alert was delivered.
    async fn mark_alerted(&self, id: u64, opening: bool, at_ms: i64) -> Result<()>;

    /// An XID that asks for a reset came from `agent` after a rank of the attempt there had
    /// already failed it as `rank_exit` (at or after `since_ms`): that failure becomes the
    /// GPU's (`gpu_xid`, the node blamed, not charged, `evidence` appended). Returns the
    /// failure as it now reads; `None` when there was no such failure.
    async fn blame_failure_on_xid(
        &self,
        job: JobId,
        attempt: u32,
        agent: &str,
        since_ms: i64,
        evidence: &str,
    ) -> Result<Option<FailureRecord>>;
}

/// The leader lease of a controller group and its fence (`lease`; docs/ha.md). Every method is
/// one transaction; none is itself fenced.
#[async_trait]
pub trait LeaseStore: Send + Sync {
    /// Leads (renews the caller's unexpired lease, or takes over an expired one under a new
    /// epoch) or reports who leads. `tls_ca`: the SHA-256 of the TLS CA the caller serves under
    /// ('' for plaintext), recorded with its lease. `ttl_ms` by the database's clock.
    async fn acquire_lease(&self, holder: &str, address: &str, tls_ca: &str, ttl_ms: i64)
    -> Result<Election>;

    /// Extends the lease of `fence` if it still holds; `false` when it was lost.
    async fn renew_lease(&self, fence: &Fence, ttl_ms: i64) -> Result<bool>;

    /// Ends the lease of `fence` now (a controller stopping on purpose), so another takes over
    /// at once.
    async fn resign_lease(&self, fence: &Fence) -> Result<()>;

    /// The lease as it stands.
    async fn lease(&self) -> Result<Option<Lease>>;

    /// Fences every later write of this store on `fence` (the lease its controller leads
    /// under), or lifts the fence with `None`. A write whose fence no longer holds fails with
    /// [`StoreError::Fenced`] and writes nothing.
    fn set_fence(&self, fence: Option<Fence>);

    /// Notified (one stored permit) whenever a write of a leader is refused by its fence: its
    /// lease is gone, and it should step down now rather than at its next renewal.
    fn fenced(&self) -> std::sync::Arc<tokio::sync::Notify>;
}

pub trait Store:
    JobStore
    + FleetStore
    + ReceiptStore
    + DiagnosisStore
    + PreflightStore
    + AuthStore
    + SeriesStore
    + TelemetryStore
    + LeaseStore
    + 'static
{
}

impl<T> Store for T where
    T: JobStore
        + FleetStore
        + ReceiptStore
        + DiagnosisStore
        + PreflightStore
        + AuthStore
        + SeriesStore
        + TelemetryStore
        + LeaseStore
        + 'static
{
}
