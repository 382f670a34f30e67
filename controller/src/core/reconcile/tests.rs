//! The reconciler's pure decisions: what each job needs next.

use super::*;

fn job(state: JobState, ranks: &[(RankState, Option<i32>)], max_restarts: u32) -> ActiveJob {
    let spec = JobSpec { max_restarts, ..JobSpec::try_from(crate::core::test_support::spec(1)).unwrap() };
    let mut job = ActiveJob::new(crate::core::test_support::record(7, state, spec));
    job.allocations = ranks
        .iter()
        .enumerate()
        .map(|(i, (state, code))| Allocation {
            id: RankId { job_id: 7, attempt: 0, rank: i as u32 },
            agent_id: format!("node-{}", i / 2),
            gpu_index: i as u32,
            node_rank: (i / 2) as u32,
            local_rank: (i % 2) as u32,
            planned_cpus: String::new(),
            planned_mems: String::new(),
            observed: RankObserved { state: *state, exit_code: *code, ..Default::default() },
        })
        .collect();
    job
}

/// What the ranks say, with every node connected.
fn found(job: &ActiveJob) -> Finding {
    faults::classify(job, &Default::default(), &Default::default(), 0)
}

fn target(step: Option<Step>) -> Option<(JobState, String)> {
    match step? {
        Step::Move { to, reason, .. } => Some((to, reason)),
        Step::Forget => None,
    }
}

#[test]
fn the_next_step_follows_the_ranks() {
    use RankState::*;
    let running = job(JobState::Launching, &[(Running, None), (Running, None)], 0);
    assert_eq!(target(decide(&running, found(&running))).map(|t| t.0), Some(JobState::Running));
    let half = job(JobState::Launching, &[(Running, None), (Launching, None)], 0);
    assert_eq!(decide(&half, found(&half)), None);
    let done = job(JobState::Running, &[(Exited, Some(0)), (Exited, Some(0))], 0);
    assert_eq!(target(decide(&done, found(&done))).map(|t| t.0), Some(JobState::Succeeded));
    let failed = job(JobState::Running, &[(Exited, Some(3)), (Running, None)], 1);
    let (to, reason) = target(decide(&failed, found(&failed))).unwrap();
    assert_eq!(to, JobState::Restarting);
    assert!(
        reason.contains("rank_exit: rank 0 on node-0 exited with code 3")
            && reason.contains("restarting as attempt 1 (restart 1 of at most 1)"),
        "{reason}"
    );
    let no_restarts = job(JobState::Running, &[(Exited, Some(1)), (Running, None)], 0);
    assert_eq!(target(decide(&no_restarts, found(&no_restarts))).map(|t| t.0), Some(JobState::Failed));
    // A lost host is the fleet's failure: the job restarts whatever its max_restarts.
    let mut lost = job(JobState::Running, &[(Lost, None), (Running, None)], 0);
    lost.allocations[0].observed.message = faults::host_lost_message("agent node-0 sent nothing for 8.1 s");
    let (to, reason) = target(decide(&lost, found(&lost))).unwrap();
    assert_eq!(to, JobState::Restarting);
    assert!(reason.starts_with("host_lost: rank 0 on node-0 was lost: host lost: agent node-0"), "{reason}");
    // A launch preflight that a check of the job's own environment failed is the job's.
    let mut refused = job(JobState::Launching, &[(Lost, None), (Lost, None)], 0);
    refused.allocations[0].observed.message =
        "preflight failed: env.nccl_shm_disable: 1 (expected unset)".into();
    assert_eq!(target(decide(&refused, found(&refused))).map(|t| t.0), Some(JobState::Failed));
    refused.allocations[0].observed.message = "preflight failed: cuda.init.gpu3: error (expected ok)".into();
    let (to, reason) = target(decide(&refused, found(&refused))).unwrap();
    assert_eq!(to, JobState::Restarting, "a node check blames the node: {reason}");
    let restarting = job(JobState::Restarting, &[(Exited, Some(3)), (Exited, None)], 1);
    assert!(matches!(
        decide(&restarting, found(&restarting)),
        Some(Step::Move { to: JobState::Pending, attempt: 1, .. })
    ));
    let finished = job(JobState::Failed, &[(Exited, Some(3)), (Lost, None)], 0);
    assert_eq!(decide(&finished, found(&finished)), Some(Step::Forget));
    let stopping = job(JobState::Failed, &[(Exited, Some(3)), (Running, None)], 0);
    assert_eq!(decide(&stopping, found(&stopping)), None, "a finished job waits for its ranks to stop");
}

#[test]
fn waiting_jobs_age_one_point_per_interval() {
    let ten_min = std::time::Duration::from_secs(600);
    assert_eq!(aged(3, 0, ten_min), 3);
    assert_eq!(aged(3, 599_999, ten_min), 3);
    assert_eq!(aged(3, 1_800_000, ten_min), 6, "half an hour: three points");
    assert_eq!(aged(3, 1_800_000, std::time::Duration::ZERO), 3, "aging off");
    assert_eq!(aged(i32::MAX, i64::MAX, std::time::Duration::from_millis(1)), i32::MAX);
}

#[test]
fn a_cancel_comes_first_and_stops_the_ranks() {
    let mut j = job(JobState::Running, &[(RankState::Running, None)], 0);
    j.cancel = Some("operator".into());
    assert!(matches!(
        decide(&j, found(&j)),
        Some(Step::Move { to: JobState::Cancelled, then: Then::StopRanks(_), .. })
    ));
    let mut pending = job(JobState::Pending, &[], 0);
    pending.cancel = Some("operator".into());
    assert_eq!(target(decide(&pending, found(&pending))).map(|t| t.0), Some(JobState::Cancelled));
}
