//! The device rule with real processes: two 4-GPU jobs share an 8-GPU host, and in each the
//! device a rank opens as `cuda:LOCAL_RANK` (resolved through the job's CUDA_VISIBLE_DEVICES,
//! as CUDA does) is the GPU the scheduler allocated to it; the job on GPUs 4-7 has rank 0 on
//! GPU 4. Also: every torchrun variable reaches the rank.

use std::time::Duration;

use trainyard_tests::Cluster;

#[test]
fn cuda_local_rank_is_the_allocated_gpu_on_part_of_a_host() -> anyhow::Result<()> {
    let mut c = Cluster::start()?;
    c.start_agent("eight", 8)?;
    let long = c.job_file("first", 4, 4, &["--steps", "2000", "--step-ms", "50"], "");
    let first = c.submit(&long)?;
    c.wait_state(first, &["running"], Duration::from_secs(60))?;
    let short = c.job_file("second", 4, 4, &["--steps", "3", "--step-ms", "10"], "");
    let second = c.submit(&short)?;
    let status = c.wait_state(second, &["succeeded", "failed"], Duration::from_secs(60))?;
    assert_eq!(status["state"], "succeeded", "{status}");
    c.wait_first_steps(first, 4, Duration::from_secs(30))?;

    let mut on_gpu4 = None;
    for job in [first, second] {
        let rows = c.query_text(&format!(
            "SELECT CAST(rank AS TEXT), json_extract(body, '$.gpu'), CAST(json_extract(body, '$.cuda_device_gpu') AS TEXT), \
                    json_extract(body, '$.env.CUDA_VISIBLE_DEVICES'), json_extract(body, '$.env.LOCAL_RANK') \
             FROM receipts WHERE job_id = {job} AND kind = 'launch' ORDER BY rank"
        ))?;
        assert_eq!(rows.len(), 4, "job {job}: {rows:?}");
        for row in &rows {
            assert_eq!(
                row[2], row[1],
                "job {job} rank {}: cuda:LOCAL_RANK opens GPU {} but GPU {} was allocated ({row:?})",
                row[0], row[2], row[1]
            );
            assert_eq!(row[4], row[0], "one host: LOCAL_RANK = RANK");
        }
        let list = &rows[0][3];
        assert!(list == "0,1,2,3" || list == "4,5,6,7", "job {job}: CUDA_VISIBLE_DEVICES {list}");
        if list == "4,5,6,7" {
            assert_eq!(rows[0][1], "4", "rank 0 of the job on GPUs 4-7 is on GPU 4");
            on_gpu4 = Some(job);
        }
    }
    assert!(on_gpu4.is_some(), "one of the two jobs holds GPUs 4-7");

    let env = c.query_text(&format!(
        "SELECT json_extract(body, '$.env.GROUP_RANK'), json_extract(body, '$.env.GROUP_WORLD_SIZE'), \
                json_extract(body, '$.env.ROLE_RANK'), json_extract(body, '$.env.ROLE_WORLD_SIZE'), \
                json_extract(body, '$.env.ROLE_NAME'), json_extract(body, '$.env.TORCHELASTIC_RESTART_COUNT'), \
                json_extract(body, '$.env.TORCHELASTIC_MAX_RESTARTS'), json_extract(body, '$.env.TORCHELASTIC_RUN_ID'), \
                json_extract(body, '$.env.TORCHELASTIC_USE_AGENT_STORE'), json_extract(body, '$.env.OMP_NUM_THREADS') \
         FROM receipts WHERE job_id = {second} AND kind = 'launch' AND rank = 2"
    ))?;
    // The agent was started without --address: it advertises the address it reaches the
    // controller (127.0.0.1 here) from, and that is the job's MASTER_ADDR.
    let addr = c.query_text("SELECT address FROM agents WHERE agent_id = 'eight'")?;
    assert_eq!(addr, vec![vec!["127.0.0.1".to_string()]]);
    let master = c.query_text(&format!(
        "SELECT DISTINCT json_extract(body, '$.env.MASTER_ADDR') FROM receipts WHERE job_id = {second} AND kind = 'launch'"
    ))?;
    assert_eq!(master, vec![vec!["127.0.0.1".to_string()]]);
    let run_id = format!("trainyard-job-{second}");
    let want = ["0", "1", "2", "4", "default", "0", "0", run_id.as_str(), "False", "1"];
    assert_eq!(env[0], want, "torchrun's variables in the launch receipt");
    c.ctl_ok(&["cancel", &first.to_string()])?;
    Ok(())
}
