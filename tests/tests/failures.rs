//! Ranks that fail and jobs that are cancelled: no rank process may survive either.

use std::time::Duration;

use trainyard_tests::Cluster;

#[test]
fn cancel_leaves_no_rank_alive() -> anyhow::Result<()> {
    let mut c = Cluster::start()?;
    c.start_agent("node-a", 4)?;
    c.start_agent("node-b", 4)?;
    let file = c.job_file("long", 8, 4, &["--steps", "100000", "--step-ms", "50"], "");
    let job = c.submit(&file)?;
    c.wait_state(job, &["running"], Duration::from_secs(60))?;
    c.wait_ranks_alive(8, Duration::from_secs(10))?;
    c.wait_first_steps(job, 8, Duration::from_secs(20))?;

    let out = c.ctl(&["cancel", &job.to_string()])?;
    assert!(out.status.success(), "ctl cancel: {}", String::from_utf8_lossy(&out.stderr));
    c.wait_no_ranks(Duration::from_secs(20))?;
    let status = c.wait_ranks_exited(job, Duration::from_secs(10))?;
    assert_eq!(status["state"], "cancelled");
    // The example writes an exit receipt on SIGTERM; it reached the store after the cancel.
    let exits = c.query(&format!(
        "SELECT COUNT(*) FROM receipts WHERE job_id = {job} AND kind = 'exit' AND {}",
        trainyard_tests::RANK_WRITTEN
    ))?;
    assert_eq!(exits[0][0], 8);
    // And the agent's own exit receipt of each rank, with what all its processes used.
    let agents = c.query(&format!(
        "SELECT COUNT(*) FROM receipts WHERE job_id = {job} AND kind = 'exit' AND NOT {}",
        trainyard_tests::RANK_WRITTEN
    ))?;
    assert_eq!(agents[0][0], 8);
    Ok(())
}

#[test]
fn a_failing_rank_fails_the_job_and_stops_the_others() -> anyhow::Result<()> {
    let mut c = Cluster::start()?;
    c.start_agent("node-a", 4)?;
    c.start_agent("node-b", 4)?;
    let file = c.job_file(
        "failing",
        8,
        4,
        &["--steps", "100000", "--step-ms", "30", "--fail-at-step", "5", "--fail-rank", "6"],
        "",
    );
    let job = c.submit(&file)?;
    let status = c.wait_state(job, &["failed", "succeeded", "cancelled"], Duration::from_secs(60))?;
    assert_eq!(status["state"], "failed", "{status}");
    let reason = status["reason"].as_str().unwrap();
    assert!(reason.contains("rank 6") && reason.contains("exited with code 1"), "reason: {reason}");
    c.wait_no_ranks(Duration::from_secs(20))?;
    c.wait_ranks_exited(job, Duration::from_secs(10))?;
    Ok(())
}
