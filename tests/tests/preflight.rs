//! Preflight through real agents: the verdict of a node described by a fixture reaches the
//! fleet table, a failing node gets no work, and a job whose own environment breaks NCCL fails
//! at launch with the check that caught it.

use std::time::Duration;

use trainyard_tests::{Cluster, repo_root};

#[test]
fn real_agent_with_a_broken_gpu_is_not_scheduled() -> anyhow::Result<()> {
    let mut c = Cluster::start()?;
    let fixture = repo_root().join("tests/fixtures/hosts/cuda-fails-gpu3.json");
    c.start_agent_with_host_file("broken", &fixture)?;
    c.start_agent("healthy", 2)?;

    let node = c.node("broken")?;
    assert_eq!(node["verdict"], "fail", "{node}");
    let reason = node["verdict_reason"].as_str().unwrap_or_default();
    assert!(reason.contains("cuda.init.gpu3"), "reason names the failing check: {node}");

    let report = c.ctl_ok(&["preflight", "broken"])?;
    assert!(report.contains("cuda.init.gpu3") && report.contains("fail"), "{report}");
    assert!(report.contains("NV18"), "the GPU matrix is printed: {report}");

    // An 8-GPU job could only fit on the broken node: it waits instead of landing there.
    let big = c.job_file("big", 8, 0, &["--steps", "1", "--step-ms", "1"], "");
    let big_job = c.submit(&big)?;
    let small = c.job_file("small", 2, 0, &["--steps", "2", "--step-ms", "1"], "");
    let small_job = c.submit(&small)?;
    let status = c.wait_state(small_job, &["succeeded", "failed"], Duration::from_secs(60))?;
    assert_eq!(status["state"], "succeeded", "{status}");
    assert!(status["ranks"].as_array().unwrap().iter().all(|r| r["agent_id"] == "healthy"), "{status}");
    let big = c.status(big_job)?;
    assert_eq!(big["state"], "pending", "nothing may land on the failing node");
    let why = big["waiting_reason"].as_str().unwrap_or_default();
    assert!(why.contains("8 GPUs"), "a waiting job says why: {big}");
    Ok(())
}

/// A job whose own environment fails its launch preflight fails, once and finally, and takes
/// no node with it: before, each failed report became the node's verdict for everyone and the
/// job's restarts walked it across the fleet ("0 such node(s) are free" for the next job).
#[test]
fn nccl_shm_disable_in_a_job_fails_it_at_launch_and_no_node() -> anyhow::Result<()> {
    let mut c = Cluster::start()?;
    c.start_agent("node-a", 2)?;
    c.start_agent("node-b", 2)?;
    let file = c.job_file(
        "noshm",
        2,
        0,
        &["--steps", "5", "--step-ms", "1"],
        "preflight = \"quick\"\n[restart]\nmax_restarts = 3\n[env]\nNCCL_SHM_DISABLE = \"1\"\n",
    );
    let job = c.submit(&file)?;
    let status = c.wait_state(job, &["failed", "succeeded"], Duration::from_secs(60))?;
    assert_eq!(status["state"], "failed", "{status}");
    let reason = status["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("preflight failed") && reason.contains("env.nccl_shm_disable"),
        "reason: {reason}"
    );
    assert!(reason.contains("not restarted"), "a restart cannot help, and it says so: {reason}");
    assert_eq!(status["attempt"], 0, "no restart: the same spec fails everywhere: {status}");
    assert_eq!(c.live_processes("python").len(), 0, "no rank was started");
    let receipts = c.query(&format!("SELECT COUNT(*) FROM receipts WHERE job_id = {job}"))?;
    assert_eq!(receipts[0][0], 0);
    // The failed report is the job's, on its GPUs; the nodes keep their own verdict.
    let stored =
        c.query_text(&format!("SELECT verdict, gpus FROM preflight_reports WHERE job_id = {job}"))?;
    assert_eq!(stored, vec![vec!["fail".to_string(), "0,1".to_string()]], "{stored:?}");
    for node in ["node-a", "node-b"] {
        let n = c.node(node)?;
        assert_ne!(n["verdict"], "fail", "a job's environment is not the node's verdict: {n}");
    }
    let next = c.job_file("next", 2, 0, &["--steps", "2", "--step-ms", "1"], "");
    let next_job = c.submit(&next)?;
    let status = c.wait_state(next_job, &["succeeded", "failed"], Duration::from_secs(60))?;
    assert_eq!(status["state"], "succeeded", "{status}");
    Ok(())
}

#[test]
fn launch_receipts_reference_the_preflight_report() -> anyhow::Result<()> {
    let mut c = Cluster::start()?;
    c.start_agent("node-a", 2)?;
    let file = c.job_file("ref", 2, 0, &["--steps", "2", "--step-ms", "1"], "preflight = \"quick\"\n");
    let job = c.submit(&file)?;
    c.wait_state(job, &["succeeded"], Duration::from_secs(60))?;
    let ids = c.query_text(&format!(
        "SELECT DISTINCT json_extract(body, '$.env.TRAINYARD_PREFLIGHT_REPORT') FROM receipts \
         WHERE job_id = {job} AND kind = 'launch'"
    ))?;
    assert_eq!(ids.len(), 1, "{ids:?}");
    let local_id = &ids[0][0];
    assert!(local_id.starts_with("node-a-"), "{local_id}");
    let stored = c.query(&format!("SELECT COUNT(*) FROM preflight_reports WHERE local_id = '{local_id}'"))?;
    assert_eq!(stored[0][0], 1, "the report the ranks ran under is in the store");
    Ok(())
}
