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

/// The newest checkpoint directory under `dir` whose manifest rank 0 wrote.
fn newest_complete_on_disk(dir: &std::path::Path) -> Option<i64> {
    std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .filter(|e| e.path().join("manifest.json").is_file())
        .filter_map(|e| e.file_name().to_str()?.strip_prefix("step_")?.parse().ok())
        .max()
}

/// Polls `what` every 100 ms until it returns `Some`, for at most `timeout`.
fn poll<T>(
    what: &str,
    timeout: Duration,
    mut f: impl FnMut() -> anyhow::Result<Option<T>>,
) -> anyhow::Result<T> {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        if let Some(v) = f()? {
            return Ok(v);
        }
        anyhow::ensure!(std::time::Instant::now() < deadline, "{what}: not within {timeout:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Checkpoint receipts lag while an agent is away: its ranks go on checkpointing, but what they
/// report arrives only when it returns. A restart meanwhile resumes from the newest checkpoint
/// complete on disk (its manifest written last), not the newest whose receipts arrived.
#[test]
fn a_restart_resumes_from_the_newest_complete_checkpoint_whose_receipts_had_not_arrived() -> anyhow::Result<()>
{
    let mut c = Cluster::start_with(&[("--agent-timeout-secs", "8"), ("--cancel-grace-secs", "3")])?;
    c.start_agent("a", 1)?;
    c.start_agent("b", 1)?;
    let dir = c.path("ckpt");
    let ckpt = dir.display().to_string();
    let args = [
        "--steps",
        "100000",
        "--step-ms",
        "50",
        "--collective",
        "--checkpoint-dir",
        &ckpt,
        "--checkpoint-every",
        "20",
    ];
    let restart = "[restart]\nmax_restarts = 1\nresume = true\nbackoff_initial_s = 0.2\n";
    let job = c.submit(&c.job_file("lagging", 2, 1, &args, restart))?;
    let reported = |c: &Cluster| -> anyhow::Result<i64> {
        Ok(c.query(&format!(
            "SELECT COALESCE(MAX(step), -1) FROM (SELECT step FROM receipts WHERE job_id = {job} AND attempt = 0 \
             AND kind = 'checkpoint' GROUP BY step HAVING COUNT(DISTINCT rank) = 2)"
        ))?[0][0])
    };
    poll("a checkpoint both ranks reported", Duration::from_secs(60), || {
        Ok((reported(&c)? >= 0).then_some(()))
    })?;
    c.start_agent("spare", 1)?;
    // b's agent dies: its rank steps and checkpoints on, its receipts stay in its file.
    let on_b =
        c.query(&format!("SELECT rank FROM allocations WHERE job_id = {job} AND agent_id = 'b'"))?[0][0];
    c.kill_agent("b");
    std::thread::sleep(Duration::from_secs(4));
    for pid in trainyard_tests::rank_pids(job, 0, Some(1 - on_b as u32)) {
        // SAFETY: kill(2) on a rank process this test's cluster started.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    // The collective broke: b's rank stops too. What is on disk and what was reported, now.
    std::thread::sleep(Duration::from_secs(1));
    let on_disk = newest_complete_on_disk(&dir).unwrap_or(-1);
    let stored = reported(&c)?;
    anyhow::ensure!(
        on_disk > stored,
        "the receipts lagged (reported {stored}, on disk {on_disk}): nothing to show"
    );
    let sql = format!(
        "SELECT json_extract(body, '$.env.TRAINYARD_RESUME_STEP') FROM receipts WHERE job_id = {job} \
         AND attempt = 1 AND kind = 'launch'"
    );
    let launch = poll("attempt 1's launch receipts", Duration::from_secs(90), || {
        let rows = c.query_text(&sql)?;
        Ok((rows.len() == 2).then_some(rows))
    })
    .map_err(|e| e.context(format!("{}", c.status(job).unwrap_or_default())))?;
    let resumed: Vec<i64> = launch.iter().filter_map(|r| r[0].parse().ok()).collect();
    anyhow::ensure!(
        resumed == [on_disk, on_disk],
        "resumed from {resumed:?}: the newest complete on disk was {on_disk}, the newest reported {stored}"
    );
    c.ctl_ok(&["cancel", &job.to_string()])?;
    Ok(())
}
