//! `ctl status [JOB] [-o json]`.

use trainyard_proto::v1::{GetJobRequest, ListJobsRequest};

use crate::client::Controller;
use crate::output::{JobJson, print_out, to_json};
use crate::render;

pub async fn run(ctl: &mut Controller, job: Option<u64>, json: bool) -> anyhow::Result<()> {
    match job {
        Some(job_id) => one(ctl, job_id, json).await,
        None => list(ctl, json).await,
    }
}

async fn one(ctl: &mut Controller, job_id: u64, json: bool) -> anyhow::Result<()> {
    let job = match ctl.jobs.get(GetJobRequest { job_id }).await {
        Ok(r) => r.into_inner(),
        Err(status) => return Err(ctl.error(status, Some(job_id))),
    };
    ctl.words(&job)?;
    if json {
        print_out(&to_json(&JobJson::from(&job))?)
    } else {
        let mut text = render::job_details(&job, render::now_ms());
        if job.slurm_job_id != 0 && !super::is_terminal(job.state()) {
            let slurm = super::slurm::queue_state(job.slurm_job_id);
            text.push_str(&format!("slurm: job {} {slurm}\n", job.slurm_job_id));
        }
        print_out(&text)
    }
}

async fn list(ctl: &mut Controller, json: bool) -> anyhow::Result<()> {
    let request = ListJobsRequest { active_only: false, limit: 0 };
    let (jobs, left_off) = match ctl.jobs.list(request).await {
        Ok(r) => {
            let r = r.into_inner();
            (r.jobs, r.left_off)
        }
        Err(status) => return Err(ctl.error(status, None)),
    };
    if left_off > 0 {
        eprintln!(
            "note: {left_off} more job(s) did not fit in one answer from the controller (64 MiB); the newest are shown"
        );
    }
    ctl.words(jobs.as_slice())?;
    if json {
        let jobs: Vec<JobJson> = jobs.iter().map(JobJson::from).collect();
        print_out(&to_json(&jobs)?)
    } else if jobs.is_empty() {
        print_out("no jobs\n")
    } else {
        print_out(&render::job_list(&jobs, render::now_ms()))
    }
}
