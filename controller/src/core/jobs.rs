//! The jobs service: submit and cancel (requests: they record and wake the reconciler), the
//! jobs as `ctl` and the web view read them, the ranks' reports from their agents, and logs.

use std::time::Duration;

use tokio::sync::mpsc;
use trainyard_proto::v1::{Job, JobEvent, JobSpec as WireSpec, LogData, RankReport, ReadLogs};

use super::agents::rank_id;
use super::diagnosis::Diagnoses;
use super::launch::request_of;
use super::reconcile::ActiveJob;
use super::shared::Shared;
use super::{ControllerError, LogEvent, Result};

/// The bytes of jobs one `List` answer carries: the response limit, less room for the rest of
/// the message and gRPC's framing.
pub const LIST_BUDGET: usize = trainyard_proto::limits::MAX_RESPONSE_BYTES - (64 << 10);
use trainyard_model::spec::{self, JobSpec};
use trainyard_placement::scheduler;
use trainyard_store::{Allocation, JobEventRecord, JobId, JobOwner, JobRecord, JobState, StoreError};

/// How long a cancel waits for the reconciler to store it before telling the caller so.
const CANCEL_STORE_WAIT: Duration = Duration::from_secs(30);

/// Jobs: submit, cancel, read, rank reports and logs ([`super::Controller::jobs`]).
#[derive(Clone, Copy)]
pub struct Jobs<'c> {
    pub(super) c: &'c Shared,
}

impl Jobs<'_> {
    /// Validates, stores and queues a job; returns its id. Nothing is stored for a bad spec or
    /// one that no node set of the fleet could ever hold. With an idempotency `key`, a submit
    /// that was already stored (a client retrying after a lost reply) returns that job. The
    /// reconciler places it; nothing that happens there can fail this request.
    pub async fn submit(self, spec: WireSpec, key: Option<&str>) -> Result<JobId> {
        self.submit_as(spec, key, &JobOwner::default()).await
    }

    /// [`Jobs::submit`] on behalf of `owner`, who the job is recorded as belonging to.
    pub async fn submit_as(self, spec: WireSpec, key: Option<&str>, owner: &JobOwner) -> Result<JobId> {
        let spec = spec::parse(spec)?;
        if let Some(key) = key
            && let Some(id) = self.submitted_before(&spec, key, owner).await?
        {
            return Ok(id);
        }
        let request = request_of(0, &spec);
        self.within_user_caps(&spec, owner)?;
        // A `[slurm]` job brings its own nodes (its allocation's agents): the fleet need not hold it.
        if spec.slurm.is_none() {
            self.feasible(&request)?;
        }
        let record = match self.c.store.create_job_for(&spec, key, owner, "submitted", self.c.now_ms()).await
        {
            Err(StoreError::Duplicate(_)) if let Some(key) = key => {
                // The same key raced in from another connection and won.
                return self
                    .submitted_before(&spec, key, owner)
                    .await?
                    .ok_or(StoreError::JobNotFound(0).into());
            }
            other => other?,
        };
        let id = record.id;
        tracing::info!(job_id = id, name = %spec.name, gpus = request.gpus, user = %owner.user, "job submitted");
        {
            let mut core = self.c.lock();
            core.jobs.insert(id, ActiveJob::new(record));
            core.dirty.insert(id);
        }
        self.c.bump();
        self.c.wake();
        Ok(id)
    }

    /// `Err(TooMany)` when `owner` already has `max_pending_per_user` jobs waiting, or when
    /// `spec` would take the specs of the user's unfinished jobs past `max_spec_bytes_per_user`.
    fn within_user_caps(self, spec: &spec::JobSpec, owner: &JobOwner) -> Result<()> {
        if owner.user.is_empty() {
            return Ok(());
        }
        let (cap, byte_cap) = (self.c.config.max_pending_per_user, self.c.config.max_spec_bytes_per_user);
        let (pending, held) = {
            let core = self.c.lock();
            let mine = core.jobs.values().filter(|j| j.record().owner.user == owner.user);
            mine.fold((0, 0), |(n, bytes), j| {
                let waiting = usize::from(j.record().state == JobState::Pending);
                let active = if j.record().state.is_terminal() { 0 } else { j.spec_bytes };
                (n + waiting, bytes + active)
            })
        };
        if pending >= cap {
            return Err(ControllerError::TooMany(format!(
                "user {} already has {pending} jobs waiting, the most one user may have ({cap}); \
                 cancel some or wait for them to start",
                owner.user
            )));
        }
        let size = prost::Message::encoded_len(&trainyard_proto::v1::JobSpec::from(spec));
        if held + size > byte_cap {
            return Err(ControllerError::TooMany(format!(
                "user {}'s unfinished jobs hold {held} bytes of specs; this one ({size} bytes) would pass \
                 the most one user may hold ({byte_cap} bytes); cancel some or wait for them to finish",
                owner.user
            )));
        }
        Ok(())
    }

    /// Whether the fleet could ever hold `request` (every node, every GPU free): answered once
    /// per shape until the fleet changes, since building the fleet's view for it costs
    /// milliseconds at 1,000 nodes and submits come several times a second.
    fn feasible(self, request: &scheduler::Request) -> Result<()> {
        let shape = super::launch::shape_of(request);
        let (views, generation) = {
            let core = self.c.lock();
            if let Some(known) = core.feasible.get(&shape) {
                return known.clone().map_err(ControllerError::Unsatisfiable);
            }
            (super::launch::node_views(&core, true), core.fleet_generation)
        };
        let verdict = scheduler::feasible(request, &views);
        let mut core = self.c.lock();
        if core.fleet_generation == generation {
            core.feasible.insert(shape, verdict.clone());
        }
        verdict.map_err(ControllerError::Unsatisfiable)
    }

    /// The job an earlier submit with `key` created, if any; an error if it had another spec.
    async fn submitted_before(self, spec: &JobSpec, key: &str, owner: &JobOwner) -> Result<Option<JobId>> {
        let Some(job) = self.c.store.job_by_key(key).await? else { return Ok(None) };
        if job.owner.user != owner.user {
            return Err(ControllerError::BadRequest(format!(
                "idempotency key {key:?} was used by another user; choose another key"
            )));
        }
        if &job.spec != spec {
            return Err(ControllerError::BadRequest(format!(
                "idempotency key {key:?} was used for job {} with a different spec",
                job.id
            )));
        }
        tracing::info!(job_id = job.id, key, "submit retried; returning the job it created");
        Ok(Some(job.id))
    }

    /// Cancels a job: pending jobs end at once; placed ones get their ranks stopped (SIGTERM,
    /// then SIGKILL after the grace period). Cancelling a finished job changes nothing. Returns
    /// once the cancel is stored (the reconciler carries it out), so an acknowledged cancel
    /// survives a controller restart.
    pub async fn cancel(self, job_id: JobId, reason: &str) -> Result<JobRecord> {
        let mut changes = self.c.subscribe();
        let known = {
            let mut core = self.c.lock();
            match core.jobs.get_mut(&job_id) {
                None => false,
                Some(job) if job.record().state.is_terminal() => return Ok(job.record().clone()),
                Some(job) => {
                    let reason = if reason.is_empty() { "cancelled by operator" } else { reason };
                    job.cancel.get_or_insert_with(|| reason.to_string());
                    core.dirty.insert(job_id);
                    true
                }
            }
        };
        if !known {
            return self.c.store.get_job(job_id).await?.ok_or(ControllerError::JobNotFound(job_id));
        }
        self.c.wake();
        let deadline = tokio::time::Instant::now() + CANCEL_STORE_WAIT;
        loop {
            changes.borrow_and_update();
            let done = match self.c.lock().jobs.get(&job_id) {
                Some(job) if job.record().state.is_terminal() => return Ok(job.record().clone()),
                Some(_) => false,
                // Finished and forgotten already: the store has the final state.
                None => true,
            };
            if done {
                break;
            }
            tokio::select! {
                _ = changes.changed() => {}
                _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                _ = tokio::time::sleep_until(deadline) => {
                    return Err(StoreError::Unavailable(format!(
                        "the cancel of job {job_id} is not stored yet; the controller keeps trying"
                    ))
                    .into());
                }
            }
        }
        self.c.store.get_job(job_id).await?.ok_or(ControllerError::JobNotFound(job_id))
    }

    /// One job with its ranks (current attempt), events and receipt count.
    pub async fn get(self, job_id: JobId) -> Result<Job> {
        let record = self.c.store.get_job(job_id).await?.ok_or(ControllerError::JobNotFound(job_id))?;
        let warning = self.c.quotas.warning(job_id);
        let mut job =
            super::view::summary(self.c.store.as_ref(), &self.c.core, self.c.now_ms(), record, warning)
                .await?;
        let g = Diagnoses { c: self.c }.goodput(job_id).await?;
        job.goodput = Some(trainyard_proto::v1::Goodput::from(&g));
        job.events = self
            .c
            .store
            .job_events(job_id)
            .await?
            .into_iter()
            .map(|e| JobEvent {
                at_ms: e.at_ms,
                from_state: e.from_state.map(|s| s.to_string()).unwrap_or_default(),
                to_state: e.to_state.to_string(),
                reason: e.reason,
            })
            .collect();
        job.slurm_job_id = super::slurm::slurm_job_of(&job.events);
        job.failures = self
            .c
            .store
            .failures(job_id)
            .await?
            .into_iter()
            .map(|f| trainyard_proto::v1::Failure {
                attempt: f.attempt,
                at_ms: f.at_ms,
                kind: f.kind.to_string(),
                agent_id: f.agent_id.unwrap_or_default(),
                rank: f.rank.map_or(-1, i64::from),
                evidence: f.evidence,
                blamed: f.blamed,
                charged: f.charged,
            })
            .collect();
        Ok(job)
    }

    /// Jobs newest first (only those `submitted_by` submitted, when given), with their ranks
    /// but without events, as many as fit in one answer ([`LIST_BUDGET`] bytes encoded); the
    /// second value counts the jobs asked for that did not fit.
    pub async fn list(
        self,
        active_only: bool,
        submitted_by: Option<&str>,
        limit: u32,
    ) -> Result<(Vec<Job>, u32)> {
        self.list_within(active_only, submitted_by, limit, LIST_BUDGET).await
    }

    /// [`Jobs::list`] within `budget` bytes of encoded jobs.
    pub async fn list_within(
        self,
        active_only: bool,
        submitted_by: Option<&str>,
        limit: u32,
        budget: usize,
    ) -> Result<(Vec<Job>, u32)> {
        use prost::Message as _;
        let limit = if limit == 0 { 100 } else { limit.min(10_000) };
        let records = self.c.store.list_jobs(active_only, submitted_by, limit).await?;
        let (mut jobs, mut used, asked) = (Vec::new(), 0usize, records.len());
        for record in records {
            let warning = self.c.quotas.warning(record.id);
            let job =
                super::view::summary(self.c.store.as_ref(), &self.c.core, self.c.now_ms(), record, warning)
                    .await?;
            // The job's bytes with its field tag and length prefix, as the response encodes it.
            let bytes = job.encoded_len() + 1 + prost::length_delimiter_len(job.encoded_len());
            if used + bytes > budget {
                break;
            }
            used += bytes;
            jobs.push(job);
        }
        let left_off = (asked - jobs.len()) as u32;
        Ok((jobs, left_off))
    }

    /// One job's record; `None` when no job has that id.
    pub async fn record(self, job: JobId) -> Result<Option<JobRecord>> {
        Ok(self.c.store.get_job(job).await?)
    }

    /// Jobs newest first, at most `limit`; only unfinished ones with `active_only`, only those
    /// `submitted_by` submitted when given.
    pub async fn records(
        self,
        active_only: bool,
        submitted_by: Option<&str>,
        limit: u32,
    ) -> Result<Vec<JobRecord>> {
        Ok(self.c.store.list_jobs(active_only, submitted_by, limit).await?)
    }

    /// The token the agents of `[slurm]` job `job_id` join with (docs/slurm.md).
    pub fn join_token_of(self, job_id: JobId) -> String {
        self.c.keys.join_token(job_id)
    }

    /// A job's stored record, if it exists.
    pub async fn get_record(self, job_id: JobId) -> Result<Option<JobRecord>> {
        Ok(self.c.store.get_job(job_id).await?)
    }

    /// The job a join token was made for, if this group made it.
    pub fn join_job(self, token: &str) -> Option<JobId> {
        self.c.keys.join_job(token)
    }

    /// Records that Slurm job `slurm_job_id` holds the allocation of `[slurm]` job `job_id`.
    pub async fn slurm_submitted(self, job_id: JobId, slurm_job_id: u64, detail: &str) -> Result<()> {
        let record = self.c.store.get_job(job_id).await?.ok_or(ControllerError::JobNotFound(job_id))?;
        if record.spec.slurm.is_none() {
            return Err(ControllerError::BadRequest(format!(
                "job {job_id} has no [slurm] table; it runs on the fleet"
            )));
        }
        if slurm_job_id == 0 {
            return Err(ControllerError::BadRequest("Slurm job id 0 is not a Slurm job".into()));
        }
        let reason = super::slurm::submitted_event(slurm_job_id, detail);
        self.c.store.note_job_event(job_id, &reason, self.c.now_ms()).await?;
        tracing::info!(job_id, slurm_job_id, "Slurm job recorded");
        self.c.bump();
        Ok(())
    }

    /// A job's events, oldest first.
    pub async fn events(self, job: JobId) -> Result<Vec<JobEventRecord>> {
        Ok(self.c.store.job_events(job).await?)
    }

    /// The ranks of one attempt of a job: where each was placed and what its agent reported.
    pub async fn allocations(self, job: JobId, attempt: u32) -> Result<Vec<Allocation>> {
        Ok(self.c.store.allocations(job, attempt).await?)
    }

    /// Asks the agent of `rank` of the job's current attempt for its logs (`logs`); the
    /// receiver yields them and closes when they are all sent (or, with `follow`, when the rank
    /// has ended). Returns the request's id, for [`Jobs::log_credit`] and [`Jobs::close_logs`].
    pub async fn logs(
        self,
        job_id: JobId,
        rank: u32,
        tail_lines: u32,
        follow: bool,
    ) -> Result<(u64, mpsc::Receiver<LogEvent>)> {
        let c = self.c;
        let job = c.store.get_job(job_id).await?.ok_or(ControllerError::JobNotFound(job_id))?;
        let attempt = job.attempt;
        let allocations = c.store.allocations(job_id, attempt).await?;
        if allocations.is_empty() {
            return Err(ControllerError::LogsUnavailable(format!(
                "job {job_id} has no ranks placed yet (it is {}): there are no logs",
                job.state.as_str()
            )));
        }
        let Some(alloc) = allocations.iter().find(|a| a.id.rank == rank) else {
            return Err(ControllerError::BadRequest(format!(
                "job {job_id} has ranks 0 to {}; there is no rank {rank}",
                allocations.len() - 1
            )));
        };
        let agent_id = alloc.agent_id.as_str();
        let link = c.lock().agents.get(agent_id).and_then(|e| e.link.as_ref()).map(|l| l.tx.clone());
        let Some(link) = link else {
            return Err(ControllerError::LogsUnavailable(format!(
                "node {agent_id} is not connected, so the logs of job {job_id} rank {rank} cannot be read now; they \
                 stay on that host under the agent's data directory, in runs/{}/attempt-{attempt}/rank-{rank}/",
                c.keys.run_name(&job)
            )));
        };
        let run_name = c.keys.run_name(&job);
        let read = ReadLogs { request_id: 0, job_id, attempt, rank, tail_lines, follow, run_name };
        c.logs.open(agent_id, link, read).await
    }

    /// The client of a `Logs` request read `pieces` more: the agent may send that many more.
    /// Lost only when the agent's stream is full or gone, and then the request fails anyway.
    pub fn log_credit(self, request_id: u64, pieces: u32) {
        if let Some((agent_id, msg)) = self.c.logs.credit(request_id, pieces) {
            super::launch::try_send(&self.c.lock(), &agent_id, msg);
        }
    }

    /// The client of a `Logs` request went away: the agent stops reading.
    pub fn close_logs(self, request_id: u64) {
        if let Some((agent_id, msg)) = self.c.logs.close(request_id) {
            super::launch::try_send(&self.c.lock(), &agent_id, msg);
        }
    }

    /// A piece of a `Logs` answer from an agent, for the client that asked.
    pub fn log_data(self, agent_id: &str, data: LogData) {
        if let Some(stop) = self.c.logs.data(agent_id, data) {
            super::launch::try_send(&self.c.lock(), agent_id, stop);
        }
    }

    /// A rank changed state on an agent. A report about a rank of the current attempt that
    /// another agent runs is refused ([`ControllerError::NotYours`]); nothing is stored.
    pub async fn rank_report(self, agent_id: &str, report: &RankReport) -> Result<()> {
        if let Some(id) = report.key.map(rank_id) {
            let core = self.c.lock();
            let current = core.jobs.get(&id.job_id).filter(|j| j.record().attempt == id.attempt);
            if let Some(a) = current.and_then(|j| j.allocations.iter().find(|a| a.id == id))
                && a.agent_id != agent_id
            {
                return Err(ControllerError::NotYours(format!(
                    "agent {agent_id} reported on rank {} of job {} attempt {}, which runs on {}; an agent speaks only for its own ranks",
                    id.rank, id.job_id, id.attempt, a.agent_id
                )));
            }
        }
        super::agents::observe(&super::reconcile::Reconciler(self.c), agent_id, report).await
    }
}
