//! `ctl submit FILE [--follow]`.

use std::ops::ControlFlow;
use std::time::{Duration, Instant};

use anyhow::bail;
use trainyard_proto::v1::{GetJobRequest, JobSpec, SubmitRequest, watch_event::Event};

use super::watch::stream_events;
use crate::client::Controller;
use crate::progress::Progress;

/// How often `--follow` prints a progress line at most.
const PROGRESS_INTERVAL: Duration = Duration::from_secs(1);

/// Submits `spec`, prints the job id alone on stdout, and with `follow` streams
/// progress to stderr until the job ends; fails unless it succeeded.
pub async fn run(ctl: &mut Controller, spec: JobSpec, follow: bool) -> anyhow::Result<()> {
    let request = SubmitRequest { spec: Some(spec) };
    let job_id = match ctl.jobs.submit(request).await {
        Ok(r) => r.into_inner().job_id,
        Err(status) => return Err(ctl.error(status, None)),
    };
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
    match job.state.as_str() {
        "succeeded" => {
            eprintln!("job {job_id} succeeded: {} receipts", job.receipts);
            Ok(())
        }
        state => bail!("job {job_id} {state}: {}", job.reason),
    }
}
