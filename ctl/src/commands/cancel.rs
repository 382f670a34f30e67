//! `ctl cancel JOB`: ask, then wait until every rank of the current attempt has stopped.

use std::time::{Duration, Instant};

use anyhow::bail;
use trainyard_proto::v1::{CancelRequest, GetJobRequest, Job, RankStatus};

use super::is_terminal;
use crate::client::Controller;
use trainyard_proto::words::{JobState, RankState};

const POLL_EVERY: Duration = Duration::from_millis(200);
const GIVE_UP_AFTER: Duration = Duration::from_secs(60);

pub async fn run(ctl: &mut Controller, job_id: u64) -> anyhow::Result<()> {
    let request = CancelRequest { job_id, reason: "cancelled with ctl".into() };
    let mut job = match ctl.jobs.cancel(request).await {
        Ok(r) => r.into_inner().job.unwrap_or_default(),
        Err(status) => return Err(ctl.error(status, Some(job_id))),
    };
    ctl.words(&job)?;
    if job.slurm_job_id != 0 {
        // The allocation is freed whether or not it started (its agents exit with the job too).
        match super::slurm::scancel(job.slurm_job_id) {
            Ok(()) => eprintln!("job {job_id}: Slurm job {} cancelled (scancel)", job.slurm_job_id),
            Err(e) => eprintln!("ctl: warning: {e:#}"),
        }
    }
    let deadline = Instant::now() + GIVE_UP_AFTER;
    loop {
        let alive = alive_ranks(&job);
        if alive.is_empty() {
            let stopped = job.ranks.len();
            let state = job.state();
            if is_terminal(state.clone()) && state != Ok(JobState::Cancelled) {
                // Cancelling a job that had already ended changes nothing; say so.
                println!("job {job_id} had already {}; {stopped} ranks stopped", job.state);
            } else {
                println!("cancelled job {job_id}; {stopped} ranks stopped");
            }
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!(
                "job {job_id}: {} ranks still alive after {}s: {}",
                alive.len(),
                GIVE_UP_AFTER.as_secs(),
                describe(&alive)
            );
        }
        tokio::time::sleep(POLL_EVERY).await;
        job = match ctl.jobs.get(GetJobRequest { job_id }).await {
            Ok(r) => r.into_inner(),
            Err(status) => return Err(ctl.error(status, Some(job_id))),
        };
        ctl.words(&job)?;
    }
}

/// Ranks that may still have a process: not exited or lost. A rank still `planned` once the
/// job is over was never started, so it has nothing to stop.
fn alive_ranks(job: &Job) -> Vec<&RankStatus> {
    let over = is_terminal(job.state());
    job.ranks
        .iter()
        .filter(|r| !r.state().is_ok_and(RankState::is_done))
        .filter(|r| !(over && r.state() == Ok(RankState::Planned)))
        .collect()
}

/// "rank 3 (running on node-a, pid 4242), rank 5 (...)".
fn describe(ranks: &[&RankStatus]) -> String {
    let parts: Vec<String> = ranks
        .iter()
        .map(|r| format!("rank {} ({} on {}, pid {})", r.rank, r.state, r.agent_id, r.pid))
        .collect();
    parts.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rank(rank: u32, state: &str) -> RankStatus {
        RankStatus { rank, state: state.into(), ..Default::default() }
    }

    #[test]
    fn exited_and_lost_ranks_are_stopped() {
        let mut job = Job {
            state: "running".into(),
            ranks: vec![rank(0, "exited"), rank(1, "lost"), rank(2, "running"), rank(3, "planned")],
            ..Default::default()
        };
        let alive: Vec<u32> = alive_ranks(&job).iter().map(|r| r.rank).collect();
        assert_eq!(alive, vec![2, 3]);
        job.state = "cancelled".into();
        let alive: Vec<u32> = alive_ranks(&job).iter().map(|r| r.rank).collect();
        assert_eq!(alive, vec![2], "planned ranks of an ended job never started");
    }
}
