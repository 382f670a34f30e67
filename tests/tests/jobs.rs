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
         FROM receipts WHERE job_id = {job} GROUP BY rank ORDER BY rank"
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
