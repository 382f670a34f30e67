//! A restarted attempt learns where to resume from: the agent gives its ranks the newest
//! checkpoint every rank of the earlier attempt reported and whose files exist
//! (`TRAINYARD_RESUME_STEP`, `TRAINYARD_RESUME_PATH`), and the stand-in ranks continue after it.

use std::time::Duration;

use trainyard_tests::Cluster;

#[test]
fn a_restarted_attempt_resumes_after_the_last_complete_checkpoint() -> anyhow::Result<()> {
    let mut c = Cluster::start()?;
    c.start_agent("node-a", 2)?;
    let ckpt = c.path("ckpt").display().to_string();
    let args = [
        "--steps",
        "40",
        "--step-ms",
        "20",
        "--checkpoint-dir",
        &ckpt,
        "--checkpoint-every",
        "10",
        "--fail-at-step",
        "25",
        "--fail-rank",
        "1",
        "--fail-attempt",
        "0",
    ];
    let restart = "[restart]\nmax_restarts = 1\nresume = true\nbackoff_initial_s = 0.2\n";
    let job = c.submit(&c.job_file("resumes", 2, 2, &args, restart))?;
    let status = c.wait_state(job, &["succeeded", "failed"], Duration::from_secs(90))?;
    assert_eq!(status["state"], "succeeded", "{status}");
    assert_eq!(status["attempt"], 1);
    let launch = c.query_text(&format!(
        "SELECT json_extract(body, '$.env.TRAINYARD_RESUME_STEP'), json_extract(body, '$.env.TRAINYARD_RESUME_PATH') \
         FROM receipts WHERE job_id = {job} AND attempt = 1 AND kind = 'launch' ORDER BY rank"
    ))?;
    assert_eq!(launch.len(), 2);
    for row in &launch {
        assert_eq!(row[0], "19", "the newest complete checkpoint before the failure at 25: {row:?}");
        assert_eq!(row[1], format!("{ckpt}/step_19"));
    }
    let first = c.query(&format!(
        "SELECT MIN(step), COUNT(*) FROM receipts WHERE job_id = {job} AND attempt = 1 AND kind = 'step'"
    ))?;
    assert_eq!(first[0], [20, 40], "attempt 1 steps 20..39 on both ranks");
    Ok(())
}
