//! A job's whole path: `ctl submit` → controller → two agents → 16 ranks → receipts in SQLite.

use std::time::Duration;

use trainyard_tests::Cluster;

#[test]
fn sixteen_rank_job_completes_with_every_receipt_stored() -> anyhow::Result<()> {
    let mut c = Cluster::start()?;
    c.start_agent("node-a", 8)?;
    c.start_agent("node-b", 8)?;
    let steps = 20;
    let file = c.job_file("sixteen", 16, 8, &["--steps", &steps.to_string(), "--step-ms", "20"], "");
    let job = c.submit(&file)?;
    let status = c.wait_state(job, &["succeeded", "failed", "cancelled"], Duration::from_secs(90))?;
    assert_eq!(status["state"], "succeeded", "{status}\n{}", c.logs("controller"));

    // Per rank: exactly `steps` step receipts, one launch and one exit, no duplicates.
    let rows = c.query(&format!(
        "SELECT rank, SUM(kind = 'step'), SUM(kind = 'launch'), SUM(kind = 'exit'), COUNT(DISTINCT step) \
         FROM receipts WHERE job_id = {job} AND {} GROUP BY rank ORDER BY rank",
        trainyard_tests::RANK_WRITTEN
    ))?;
    assert_eq!(rows.len(), 16, "receipts from every rank: {rows:?}");
    for (rank, row) in rows.iter().enumerate() {
        assert_eq!(row, &vec![rank as i64, steps, 1, 1, steps], "rank {rank}");
    }

    // Ranks were spread node-major over both agents, each with the torchrun environment.
    let ranks = status["ranks"].as_array().expect("ranks");
    assert_eq!(ranks.len(), 16);
    for r in ranks {
        let rank = r["rank"].as_u64().unwrap();
        let expected_agent = if rank < 8 { "node-a" } else { "node-b" };
        assert_eq!(r["agent_id"], expected_agent, "{r}");
        assert_eq!(r["state"], "exited");
        assert_eq!(r["exit_code"], 0);
    }
    // The example records the environment it saw as strings.
    let env = c.query(&format!(
        "SELECT CAST(json_extract(body, '$.env.WORLD_SIZE') AS INTEGER), \
                CAST(json_extract(body, '$.env.LOCAL_RANK') AS INTEGER), \
                CAST(json_extract(body, '$.env.NODE_RANK') AS INTEGER), \
                CAST(json_extract(body, '$.env.TRAINYARD_JOB_ID') AS INTEGER) \
         FROM receipts WHERE job_id = {job} AND kind = 'launch' AND rank = 11"
    ))?;
    assert_eq!(env, vec![vec![16, 3, 1, job as i64]]);

    // Every transition is an event, in order.
    let events = c.query(&format!("SELECT COUNT(*) FROM job_events WHERE job_id = {job}"))?;
    assert!(events[0][0] >= 5, "pending, scheduled, launching, running, succeeded: {events:?}");
    Ok(())
}

#[test]
fn follow_and_watch_stream_until_the_job_ends() -> anyhow::Result<()> {
    let mut c = Cluster::start()?;
    c.start_agent("node-a", 2)?;
    let file = c.job_file("followed", 2, 0, &["--steps", "15", "--step-ms", "30"], "");
    let out = c.ctl(&["submit", &file.display().to_string(), "--follow"])?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "--follow exits 0 when the job succeeded: {stderr}");
    let job: u64 = String::from_utf8_lossy(&out.stdout).trim().parse()?;
    assert!(stderr.contains("succeeded"), "the end state is shown: {stderr}");

    // Watching a finished job replays every receipt, then ends by itself.
    let out = c.ctl(&["watch", &job.to_string(), "-o", "json"])?;
    assert!(out.status.success());
    let lines: Vec<serde_json::Value> =
        String::from_utf8_lossy(&out.stdout).lines().map(serde_json::from_str).collect::<Result<_, _>>()?;
    let steps = lines.iter().filter(|l| l["kind"] == "step").count();
    assert_eq!(steps, 2 * 15, "every step receipt of both ranks");
    // Resuming from a position sends only what came after it.
    let mid = lines[lines.len() / 2]["position"].as_u64().unwrap();
    let out = c.ctl(&["watch", &job.to_string(), "-o", "json", "--from", &mid.to_string()])?;
    let rest = String::from_utf8_lossy(&out.stdout).lines().count();
    assert_eq!(rest, lines.len() - lines.len() / 2 - 1);

    // A failing job: --follow exits non-zero.
    let bad = c.job_file("followed-bad", 1, 0, &["--steps", "15", "--fail-at-step", "2"], "");
    let out = c.ctl(&["submit", &bad.display().to_string(), "--follow"])?;
    assert!(!out.status.success());
    Ok(())
}

/// A submit retried with the same idempotency key returns the first job; the same key with
/// another spec is refused, and neither creates a second job.
#[test]
fn submit_with_the_same_key_creates_one_job() -> anyhow::Result<()> {
    let mut c = Cluster::start()?;
    c.start_agent("node-a", 2)?;
    let file = c.job_file("once", 1, 1, &["--steps", "3"], "");
    let submit =
        |file: &std::path::Path| c.ctl(&["submit", &file.display().to_string(), "--key", "deploy-42"]);
    let first = submit(&file)?;
    let again = submit(&file)?;
    assert!(first.status.success() && again.status.success(), "{first:?} {again:?}");
    assert_eq!(first.stdout, again.stdout, "the retry returned another job");
    let other = c.job_file("other", 2, 2, &["--steps", "3"], "");
    let refused = submit(&other)?;
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("deploy-42") && stderr.contains("different spec"), "{stderr}");
    assert_eq!(c.query("SELECT COUNT(*) FROM jobs")?[0][0], 1);
    Ok(())
}
