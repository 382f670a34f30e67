//! Rank pinning on this machine's real cores: a host file whose NUMA node 0 holds two of the
//! CPUs this test may use, two GPUs on it, so each rank is planned onto one core of its own.
//! The live rank's `/proc/<pid>/status` must show the planned CPU and memory node 0, and the
//! binding the agent read back must be what the store, `ctl status` and the launch receipt show.

use std::time::Duration;

use trainyard_tests::{Cluster, allowed_cpus, host_file_numa, proc_status_field, repo_root};

fn job_toml(c: &Cluster, name: &str, top: &str) -> std::path::PathBuf {
    let text = format!(
        "name = {name:?}\n{top}\n[resources]\ngpus = 2\ncomm_bytes_per_step = 7100000000\n\n\
         [engine]\nkind = \"exec\"\nargv = [\"python3\", \"examples/rank.py\", \"--steps\", \"400\", \
         \"--step-ms\", \"50\"]\nworkdir = {:?}\n",
        repo_root().display().to_string()
    );
    let path = c.path(&format!("{name}.toml"));
    std::fs::write(&path, text).expect("write job file");
    path
}

#[test]
fn ranks_run_bound_to_their_planned_cores_and_numa_node() -> anyhow::Result<()> {
    let cpus = allowed_cpus();
    anyhow::ensure!(!cpus.is_empty(), "no CPU allowed?");
    // Two real CPUs (or the one there is, shared) form NUMA node 0 of the fake host.
    let (a, b) = (cpus[0], *cpus.get(1).unwrap_or(&cpus[0]));
    let node_cpus = if a == b { a.to_string() } else { format!("{a},{b}") };
    let mut c = Cluster::start()?;
    let host = host_file_numa(c.dir.path(), "pin", &[0, 0], &[(0, &node_cpus)]);
    c.start_agent_with_host_file("pin", &host)?;

    let job = c.submit(&job_toml(&c, "pinned", ""))?;
    c.wait_state(job, &["running"], Duration::from_secs(60))?;
    c.wait_ranks_alive(2, Duration::from_secs(20))?;
    c.wait_first_steps(job, 2, Duration::from_secs(30))?;
    // The agent reports the read-back with the rank's pid; wait for both.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let status = loop {
        let s = c.status(job)?;
        let ranks = s["ranks"].as_array().cloned().unwrap_or_default();
        if ranks.len() == 2 && ranks.iter().all(|r| r["effective_cpus"] != "") {
            break s;
        }
        anyhow::ensure!(std::time::Instant::now() < deadline, "no effective binding reported: {s}");
        std::thread::sleep(Duration::from_millis(100));
    };
    let ranks = status["ranks"].as_array().expect("ranks");
    let planned: Vec<String> =
        ranks.iter().map(|r| r["planned_cpus"].as_str().unwrap_or("").to_string()).collect();
    let expected =
        if a == b { vec![a.to_string(), a.to_string()] } else { vec![a.to_string(), b.to_string()] };
    assert_eq!(planned, expected, "GPU 0 gets the first core, GPU 1 the second");
    for r in ranks {
        let pid = r["pid"].as_u64().expect("pid") as u32;
        let live_cpus = proc_status_field(pid, "Cpus_allowed_list").expect("rank alive");
        let live_mems = proc_status_field(pid, "Mems_allowed_list").expect("rank alive");
        assert_eq!(live_cpus, r["planned_cpus"].as_str().unwrap(), "rank {}: {r}", r["rank"]);
        assert_eq!(live_mems, "0");
        assert_eq!(r["planned_mems"], "0");
        assert_eq!(r["effective_cpus"], r["planned_cpus"]);
        // set_mempolicy works here; where a container refuses it, this would be a warning.
        let policy = std::fs::read_to_string(format!("/proc/{pid}/numa_maps"))?;
        assert!(
            policy.lines().next().unwrap_or("").contains(" bind:0 "),
            "memory bound to node 0: {policy:.200}"
        );
        assert_eq!(r["effective_mems"], "0");
    }
    assert_eq!(status["warnings"], serde_json::json!([]), "binding as planned: no warning");
    let predicted = status["predicted_comm_ms"].as_f64().unwrap_or(0.0);
    assert!(predicted > 1.0, "7.1 GB per step over 2 NV18 GPUs has a cost: {status}");

    // The store holds the same binding; the launch receipt records what the rank saw itself.
    let rows = c.query_text(&format!(
        "SELECT planned_cpus, effective_cpus, planned_mems, effective_mems FROM allocations \
         WHERE job_id = {job} ORDER BY rank"
    ))?;
    for (row, cpu) in rows.iter().zip(&expected) {
        assert_eq!(row, &vec![cpu.clone(), cpu.clone(), "0".to_string(), "0".to_string()]);
    }
    let launches = c.query_text(&format!(
        "SELECT json_extract(body, '$.cpu_affinity'), json_extract(body, '$.planned_cpus'), \
         json_extract(body, '$.mems_allowed'), json_extract(body, '$.memory_policy') \
         FROM receipts WHERE job_id = {job} AND kind = 'launch' ORDER BY rank"
    ))?;
    assert_eq!(launches.len(), 2);
    for (l, cpu) in launches.iter().zip(&expected) {
        assert_eq!(l, &vec![cpu.clone(), cpu.clone(), "0".to_string(), "bind:0".to_string()]);
    }
    // ctl status shows the comparison an operator wants.
    let text = String::from_utf8(c.ctl(&["status", &job.to_string()])?.stdout)?;
    assert!(text.contains("comm:     predicted"), "{text}");
    let out = c.ctl(&["cancel", &job.to_string()])?;
    anyhow::ensure!(out.status.success(), "cancel: {}", String::from_utf8_lossy(&out.stderr));
    c.wait_state(job, &["cancelled"], Duration::from_secs(30))?;
    c.wait_no_ranks(Duration::from_secs(20))?;

    // A job may turn pinning off: nothing planned, the rank keeps every CPU of the host.
    let free = c.submit(&job_toml(&c, "unpinned", "pinning = false"))?;
    c.wait_state(free, &["running"], Duration::from_secs(60))?;
    c.wait_ranks_alive(2, Duration::from_secs(20))?;
    let status = c.status(free)?;
    for r in status["ranks"].as_array().expect("ranks") {
        assert_eq!(r["planned_cpus"], "");
        let pid = r["pid"].as_u64().unwrap_or(0) as u32;
        let mine = proc_status_field(std::process::id(), "Cpus_allowed_list");
        assert_eq!(proc_status_field(pid, "Cpus_allowed_list"), mine, "unpinned rank: {r}");
    }
    assert_eq!(status["warnings"], serde_json::json!([]));
    Ok(())
}
