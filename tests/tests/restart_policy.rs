//! The restart policy: a failed attempt is stopped everywhere and the job runs again as the
//! next attempt, until it succeeds or its restarts are used up.

use std::time::Duration;

use trainyard_tests::Cluster;

#[test]
fn a_failed_attempt_restarts_and_the_next_one_succeeds() -> anyhow::Result<()> {
    let mut c = Cluster::start()?;
    c.start_agent("node-a", 2)?;
    c.start_agent("node-b", 2)?;
    let args =
        ["--steps", "8", "--step-ms", "20", "--fail-at-step", "3", "--fail-rank", "2", "--fail-attempt", "0"];
    let file = c.job_file("flaky", 4, 2, &args, "[restart]\nmax_restarts = 2\n");
    let job = c.submit(&file)?;
    let status = c.wait_state(job, &["succeeded", "failed"], Duration::from_secs(90))?;
    assert_eq!(status["state"], "succeeded", "{status}");
    assert_eq!(status["attempt"], 1, "{status}");

    let events: Vec<String> = status["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["to_state"].as_str().unwrap().to_string())
        .collect();
    let restarting = events.iter().position(|s| s == "restarting").expect("a restarting event");
    assert_eq!(events[restarting + 1], "pending", "{events:?}");
    assert_eq!(events.last().unwrap(), "succeeded", "{events:?}");

    // Both attempts' receipts are kept apart; the second attempt ran every step on every rank.
    let rows = c.query(&format!(
        "SELECT attempt, COUNT(DISTINCT rank), SUM(kind = 'step') FROM receipts WHERE job_id = {job} \
         GROUP BY attempt ORDER BY attempt"
    ))?;
    assert_eq!(rows.len(), 2, "{rows:?}");
    assert_eq!(rows[1], vec![1, 4, 4 * 8], "{rows:?}");
    c.wait_no_ranks(Duration::from_secs(10))?;
    Ok(())
}

#[test]
fn restarts_run_out_and_the_job_fails() -> anyhow::Result<()> {
    let mut c = Cluster::start()?;
    c.start_agent("node-a", 2)?;
    let args = ["--steps", "50", "--step-ms", "10", "--fail-at-step", "2", "--fail-rank", "0"];
    let file = c.job_file("doomed", 2, 0, &args, "[restart]\nmax_restarts = 1\n");
    let job = c.submit(&file)?;
    let status = c.wait_state(job, &["failed", "succeeded"], Duration::from_secs(90))?;
    assert_eq!(status["state"], "failed", "{status}");
    assert_eq!(status["attempt"], 1);
    let reason = status["reason"].as_str().unwrap();
    assert!(reason.contains("no restarts left"), "{reason}");
    Ok(())
}
