//! The read model the outer layers (gRPC services, the web view) see: jobs, their events and
//! allocations, step rollups and stored receipts, read from the store through the core, so
//! nothing outside the core holds the store. Each read is one store transaction; none takes the
//! core's lock.

use trainyard_analysis::series::{Metric, RollupRow};
use trainyard_store::{Allocation, GpuWindowRecord, JobEventRecord, JobId, JobRecord, StoredReceiptRecord};

use super::{Controller, Result};

impl Controller {
    /// One job's record; `None` when no job has that id.
    pub async fn job_record(&self, job: JobId) -> Result<Option<JobRecord>> {
        Ok(self.store.get_job(job).await?)
    }

    /// Jobs newest first, at most `limit`; only unfinished ones with `active_only`, only those
    /// `submitted_by` submitted when given.
    pub async fn job_records(
        &self,
        active_only: bool,
        submitted_by: Option<&str>,
        limit: u32,
    ) -> Result<Vec<JobRecord>> {
        Ok(self.store.list_jobs(active_only, submitted_by, limit).await?)
    }

    /// A job's events, oldest first.
    pub async fn job_events(&self, job: JobId) -> Result<Vec<JobEventRecord>> {
        Ok(self.store.job_events(job).await?)
    }

    /// The ranks of one attempt of a job: where each was placed and what its agent reported.
    pub async fn allocations(&self, job: JobId, attempt: u32) -> Result<Vec<Allocation>> {
        Ok(self.store.allocations(job, attempt).await?)
    }

    /// A job's receipts stored after position `after`, in position order, at most `limit`.
    pub async fn receipts_after(
        &self,
        job: JobId,
        after: u64,
        limit: u32,
    ) -> Result<Vec<StoredReceiptRecord>> {
        Ok(self.store.receipts_after(job, after, limit).await?)
    }

    /// The GPU telemetry windows of one attempt, by start time, at most `limit`.
    pub async fn gpu_windows(&self, job: JobId, attempt: u32, limit: u32) -> Result<Vec<GpuWindowRecord>> {
        Ok(self.store.attempt_gpu_windows(job, attempt, limit).await?)
    }

    /// The folded steps of an attempt (first step, last step, ranks); `None` before any.
    pub async fn rollup_extent(&self, job: JobId, attempt: u32) -> Result<Option<(i64, i64, u32)>> {
        Ok(self.store.rollup_extent(job, attempt).await?)
    }

    /// One metric's rollup rows of one level over a range of buckets, every rank.
    pub async fn rollup_rows(
        &self,
        job: JobId,
        attempt: u32,
        metric: Metric,
        level: i64,
        buckets: (i64, i64),
    ) -> Result<Vec<RollupRow>> {
        Ok(self.store.rollup_rows(job, attempt, metric, level, buckets.0, buckets.1).await?)
    }
}
