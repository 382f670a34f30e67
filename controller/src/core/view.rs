//! The read side: jobs as `ctl` shows them, served from the store so that finished jobs and
//! jobs of a previous controller life look the same as live ones.

use std::collections::HashMap;

use trainyard_proto::v1::{Job, JobEvent, RankStatus};

use super::{Controller, ControllerError, Result};
use crate::store::{JobId, JobRecord};

impl Controller {
    /// One job with its ranks (current attempt), events and receipt count.
    pub async fn job_view(&self, job_id: JobId) -> Result<Job> {
        let record = self.store.get_job(job_id).await?.ok_or(ControllerError::JobNotFound(job_id))?;
        let mut job = self.summary(record).await?;
        job.events = self
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
        Ok(job)
    }

    /// Jobs newest first, with their ranks but without events.
    pub async fn list_view(&self, active_only: bool, limit: u32) -> Result<Vec<Job>> {
        let limit = if limit == 0 { 100 } else { limit.min(10_000) };
        let mut jobs = Vec::new();
        for record in self.store.list_jobs(active_only, limit).await? {
            jobs.push(self.summary(record).await?);
        }
        Ok(jobs)
    }

    async fn summary(&self, record: JobRecord) -> Result<Job> {
        let (id, attempt) = (record.id, record.attempt);
        let seqs: HashMap<u32, u64> = self.store.last_seqs(id, attempt).await?.into_iter().collect();
        let ranks = self
            .store
            .allocations(id, attempt)
            .await?
            .into_iter()
            .map(|a| RankStatus {
                rank: a.id.rank,
                agent_id: a.agent_id,
                gpu_index: a.gpu_index,
                state: a.observed.state,
                exit_code: a.observed.exit_code.unwrap_or(-1),
                signal: a.observed.signal.unwrap_or(0),
                pid: a.observed.pid.unwrap_or(0),
                last_seq: seqs.get(&a.id.rank).map_or(-1, |&s| s as i64),
                skipped_lines: a.observed.skipped_lines,
                node_rank: a.node_rank,
                local_rank: a.local_rank,
                ..Default::default()
            })
            .collect();
        Ok(Job {
            id,
            spec: Some(record.spec),
            state: record.state.to_string(),
            reason: record.reason,
            attempt,
            created_at_ms: record.created_at_ms,
            updated_at_ms: record.updated_at_ms,
            ranks,
            receipts: self.store.receipt_count(id).await?,
            events: Vec::new(),
            ..Default::default()
        })
    }
}
