//! A hang: ranks alive but no step receipt for the job's hang timeout. The controller declares
//! the attempt hung within its timeout plus 5 s, stops its ranks and restarts it; a hang of
//! every rank at once blames no node and counts against max_restarts.

use std::time::Duration;

use trainyard_tests::Cluster;

#[test]
fn ranks_that_stop_stepping_are_declared_hung_and_the_job_restarts() -> anyhow::Result<()> {
    let mut c = Cluster::start()?;
    c.start_agent("node-a", 2)?;
    let restart = "[restart]\nmax_restarts = 1\nhang_timeout_s = 5\nbackoff_initial_s = 0.5\n";
    let args = ["--steps", "60", "--step-ms", "50", "--hang-at-step", "20", "--hang-attempt", "0"];
    let job = c.submit(&c.job_file("wedged", 2, 2, &args, restart))?;
    let status = c.wait_state(job, &["succeeded", "failed"], Duration::from_secs(90))?;
    assert_eq!(status["state"], "succeeded", "attempt 1 does not hang: {status}");
    assert_eq!(status["attempt"], 1, "{status}");
    let f = &status["failures"][0];
    assert_eq!((f["kind"].as_str(), f["attempt"].as_u64()), (Some("hang"), Some(0)), "{status}");
    assert_eq!((f["blamed"].as_bool(), f["charged"].as_bool()), (Some(false), Some(true)), "{f}");
    let evidence = f["evidence"].as_str().unwrap_or_default();
    assert!(
        evidence.contains("no step receipt from rank(s) 0, 1") && evidence.contains("floor 5 s"),
        "{evidence}"
    );
    // Acted on within the timeout plus 5 s of the last step stored.
    let last_step = c.query(&format!(
        "SELECT MAX(stored_at_ms) FROM receipts WHERE job_id = {job} AND attempt = 0 AND kind = 'step'"
    ))?[0][0];
    let after = f["at_ms"].as_i64().unwrap_or(0) - last_step;
    eprintln!("hang declared {after} ms after the last step was stored (timeout 5 s)");
    assert!((5_000..10_000).contains(&after), "declared {after} ms after the last step");
    let steps = c.query(&format!(
        "SELECT COUNT(*) FROM receipts WHERE job_id = {job} AND attempt = 0 AND kind = 'step'"
    ))?;
    assert_eq!(steps[0][0], 40, "both ranks stepped to 20 before the hang");
    let metrics = c.http("GET", "/metrics")?.1;
    assert!(
        metrics.lines().any(|l| l.starts_with("trainyard_failures_total{") && l.contains("kind=\"hang\"")),
        "{metrics}"
    );
    Ok(())
}
