//! `ctl submit FILE [--follow]`.

use std::ops::ControlFlow;
use std::time::{Duration, Instant};

use anyhow::bail;
use trainyard_proto::v1::{GetJobRequest, JobSpec, SubmitRequest, watch_event::Event};

use super::watch::stream_events;
use crate::client::Controller;
use crate::progress::Progress;
use trainyard_proto::words::JobState;

/// How often `--follow` prints a progress line at most.
const PROGRESS_INTERVAL: Duration = Duration::from_secs(1);

/// How often a submit whose reply was lost (controller restarting, connection cut) is sent
/// again, with the same idempotency key, and the pause before the first retry (doubled each time).
const SUBMIT_TRIES: u32 = 5;
const FIRST_RETRY_PAUSE: Duration = Duration::from_millis(250);

/// Submits `spec` under idempotency key `key` (a fresh one when `None`), prints the job id
/// alone on stdout, and with `follow` streams progress to stderr until the job ends; fails
/// unless it succeeded. A submit that fails with `Unavailable` is sent again with the same key,
/// so it never creates a second job.
pub async fn run(
    ctl: &mut Controller,
    spec: JobSpec,
    key: Option<String>,
    follow: bool,
    slurm: Option<super::slurm::AgentLaunch>,
) -> anyhow::Result<()> {
    if let Some(agent) = &slurm {
        if spec.slurm.is_none() {
            bail!(
                "--slurm: the spec has no [slurm] table (at least `[slurm]`, with partition, time_limit, ...)"
            );
        }
        super::slurm::need_slurm("sbatch")?;
        if agent.controller.contains("://127.") || agent.controller.contains("://localhost") {
            eprintln!(
                "ctl: warning: the agents will dial {} from the compute nodes, which is this machine's loopback;                  give --agent-controller a URL they reach",
                agent.controller
            );
        }
    } else if spec.slurm.is_some() {
        bail!("the spec has a [slurm] table: submit it with `ctl submit --slurm` from a Slurm login node");
    }
    let key = key.unwrap_or_else(super::new_key);
    let mut pause = FIRST_RETRY_PAUSE;
    let mut tries = 0;
    let (job_id, token) = loop {
        tries += 1;
        let request = SubmitRequest { spec: Some(spec.clone()), idempotency_key: key.clone() };
        match ctl.jobs.submit(request).await {
            Ok(r) => {
                let r = r.into_inner();
                break (r.job_id, r.join_token);
            }
            Err(status) if status.code() == tonic::Code::Unavailable && tries < SUBMIT_TRIES => {
                eprintln!(
                    "ctl: the controller did not answer ({}); submitting again with the same key",
                    status.message()
                );
                tokio::time::sleep(pause).await;
                pause *= 2;
            }
            Err(status) => return Err(ctl.error(status, None)),
        }
    };
    if let Some(agent) = &slurm {
        if token.is_empty() {
            bail!(
                "job {job_id}: the controller gave no join token for its agents; is it older than this ctl?"
            );
        }
        super::slurm::allocate(ctl, job_id, &spec, &token, agent).await?;
    }
    println!("{job_id}");
    if follow {
        follow_job(ctl, job_id).await?;
    }
    Ok(())
}

/// Prints state changes and progress lines (stderr, so stdout stays the job id) until the
/// job ends, then fails unless it succeeded.
async fn follow_job(ctl: &mut Controller, job_id: u64) -> anyhow::Result<()> {
    let start = Instant::now();
    let mut progress = Progress::new(job_id, PROGRESS_INTERVAL);
    stream_events(ctl, job_id, 0, |event| match event {
        Event::State(s) => {
            if let Some(line) = progress.flush() {
                eprintln!("{line}");
            }
            let reason = if s.reason.is_empty() { String::new() } else { format!(" ({})", s.reason) };
            eprintln!("job {job_id}: {}{reason}", s.state);
            ControlFlow::Continue(())
        }
        Event::Receipt(r) => {
            progress.record(r.attempt, r.rank, &r.kind, &r.body);
            if let Some(line) = progress.due(start.elapsed()) {
                eprintln!("{line}");
            }
            ControlFlow::Continue(())
        }
    })
    .await?;
    if let Some(line) = progress.flush() {
        eprintln!("{line}");
    }
    // The stream's last word may be lost or late; the job itself is the authority.
    let job = match ctl.jobs.get(GetJobRequest { job_id }).await {
        Ok(r) => r.into_inner(),
        Err(status) => return Err(ctl.error(status, Some(job_id))),
    };
    ctl.words(&job)?;
    if job.state() == Ok(JobState::Succeeded) {
        eprintln!("job {job_id} succeeded: {} receipts", job.receipts);
        return Ok(());
    }
    bail!("job {job_id} {}: {}", job.state, job.reason)
}
