//! Submit-to-running latency: how long from `ctl submit` to every rank of a trivial exec job
//! running on localhost (target in docs/architecture.md: under 300 ms at the median).
//!
//! Starts a real controller and one agent standing in for an 8-GPU node, submits trivial jobs
//! one after another (each waits for the previous to finish), and reads the times back from the
//! store: `submitted → running` from the job's events, and `ctl start → running` against the
//! wall clock of this process (same machine, same clock). Prints medians and p90s, and beside
//! them the raw launch ([`raw`]): the same ranks started by one thread with nothing of
//! trainyard around them, the machine's floor, and `trainyard / raw` (`ctl start → running`
//! over the raw launch's median), the figure that travels between machines.
//!
//! Beside them, the agent's side of each launch from its own log ([`agent_log`]): how long it
//! took from the launch to its first shim, and between two shims.
//!
//! Two clusters: the loopback demo (plaintext, no credentials) and a secure one (TLS with agent
//! certificates, ctl with a token, ranks run as the user's account: `nobody` under root). Named
//! only, `demo-subreaper`: the demo with its agent's ranks held by their shims as subreapers
//! instead of a cgroup each (`--process-tracking subreaper`), what a launch cost before
//! per-rank cgroups.
//!
//! First, one shim's start ([`shim`]): the small `trainyard-shim` and the agent's own binary
//! supervising a rank that exits at once, against the rank forked and exec'd bare.
//!
//! Every run writes its figures to `docs/results/submit_latency-<date>.jsonl`
//! ([`trainyard_tests::results`]): one line per cluster and rank count (medians and p90s), then
//! the summary.
//!
//! Run: `cargo bench -p trainyard-tests --bench submit_latency
//! [-- demo|secure|demo-subreaper]` (it builds and runs the release binaries).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::json;
use trainyard_tests::Cluster;

#[path = "submit_latency/agent_log.rs"]
mod agent_log;
#[path = "submit_latency/raw.rs"]
mod raw;
#[path = "submit_latency/shim.rs"]
mod shim;
use trainyard_tests::results::{Results, results_dir};

const JOBS: usize = 25;
const TARGET_MEDIAN_MS: i64 = 300;

fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or_default()
}

fn percentile(sorted: &[i64], p: f64) -> i64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// One cluster and rank count: its line in the results, and the medians for the summary.
fn measure(out: &mut Results, c: &Cluster, label: &str, ranks: u32) -> anyhow::Result<serde_json::Value> {
    let file = c.job_file(&format!("trivial-{ranks}"), ranks, 0, &[], "");
    // A trivial rank: a shell that sleeps a little so "all ranks running" is observable.
    let text = std::fs::read_to_string(&file)?
        .replace(r#"argv = ["python3", "examples/rank.py"]"#, r#"argv = ["sh", "-c", "sleep 0.3"]"#);
    std::fs::write(&file, text)?;
    let (mut in_controller, mut end_to_end) = (Vec::new(), Vec::new());
    // Where the time goes: ctl's start to the job stored, stored to placed, placed to running.
    let (mut ctl_part, mut placing, mut launching) = (Vec::new(), Vec::new(), Vec::new());
    let mut jobs = Vec::with_capacity(JOBS);
    for _ in 0..JOBS {
        let t0 = now_ms();
        let job = c.submit(&file)?;
        jobs.push(job);
        c.wait_state(job, &["succeeded"], Duration::from_secs(30))?;
        let rows = c.query(&format!(
            "SELECT MIN(CASE WHEN to_state = 'pending' THEN at_ms END), \
                    MIN(CASE WHEN to_state = 'scheduled' THEN at_ms END), \
                    MIN(CASE WHEN to_state = 'running' THEN at_ms END) FROM job_events WHERE job_id = {job}"
        ))?;
        let (submitted, scheduled, running) = (rows[0][0], rows[0][1], rows[0][2]);
        in_controller.push(running - submitted);
        end_to_end.push(running - t0);
        ctl_part.push(submitted - t0);
        placing.push(scheduled - submitted);
        launching.push(running - scheduled);
    }
    for v in [&mut in_controller, &mut end_to_end, &mut ctl_part, &mut placing, &mut launching] {
        v.sort_unstable();
    }
    let agent = agent_log::read(&c.path("agent-node-a.log"), &jobs)?;
    let raw = raw::launch_times(ranks, JOBS)?;
    let raw_p50 = percentile(&raw, 0.5).max(1);
    let (in_p50, in_p90) = (percentile(&in_controller, 0.5), percentile(&in_controller, 0.9));
    let (end_p50, end_p90) = (percentile(&end_to_end, 0.5), percentile(&end_to_end, 0.9));
    let (ctl_p50, placing_p50, launching_p50) =
        (percentile(&ctl_part, 0.5), percentile(&placing, 0.5), percentile(&launching, 0.5));
    let ratio = end_p50 as f64 / raw_p50 as f64;
    println!(
        "{label}: {ranks} rank(s), {JOBS} jobs: submitted→running median {in_p50} ms (p90 {in_p90} ms); \
         ctl start→running median {end_p50} ms (p90 {end_p90} ms); target median < {TARGET_MEDIAN_MS} ms; \
         medians of the parts: ctl start→stored {ctl_p50} ms, stored→placed {placing_p50} ms, \
         placed→running {launching_p50} ms; raw launch median {raw_p50} ms (trainyard / raw {ratio:.2}); \
         in the agent: launch→first shim {:.1} ms, between two shims {:.2} ms",
        agent.launch_to_first_shim_ms, agent.shim_gap_ms
    );
    out.line(&json!({
        "cluster": label, "ranks": ranks, "jobs": JOBS,
        "submitted_to_running_p50_ms": in_p50, "submitted_to_running_p90_ms": in_p90,
        "ctl_start_to_running_p50_ms": end_p50, "ctl_start_to_running_p90_ms": end_p90,
        "ctl_start_to_stored_p50_ms": ctl_p50, "stored_to_placed_p50_ms": placing_p50,
        "placed_to_running_p50_ms": launching_p50,
        "agent_launch_to_first_shim_p50_ms": (agent.launch_to_first_shim_ms * 100.0).round() / 100.0,
        "agent_shim_gap_p50_ms": (agent.shim_gap_ms * 100.0).round() / 100.0,
        "raw_launch_p50_ms": raw_p50, "raw_launch_p90_ms": percentile(&raw, 0.9),
        "ctl_start_to_running_over_raw": (ratio * 100.0).round() / 100.0,
        "target_median_ms": TARGET_MEDIAN_MS,
    }))?;
    Ok(json!({
        "cluster": label, "ranks": ranks,
        "submitted_to_running_p50_ms": in_p50, "ctl_start_to_running_p50_ms": end_p50,
        "raw_launch_p50_ms": raw_p50,
    }))
}

/// One shim's start, both binaries, and the bare rank: a line of the results.
fn shim_starts(out: &mut Results) -> anyhow::Result<()> {
    let [small, agent, bare] = shim::start_costs()?;
    let over =
        |c: shim::Cost| (c.cpu_mean_us as f64 / bare.cpu_mean_us.max(1) as f64 * 100.0).round() / 100.0;
    let ms = |us: i64| us as f64 / 1000.0;
    println!(
        "shim start, {} each, alternating (wall median, CPU mean): trainyard-shim {:.2} ms, {:.2} ms CPU \
         ({:.2} times the bare rank's CPU); trainyard-agent supervise {:.2} ms, {:.2} ms CPU ({:.2} times); \
         the bare rank {:.2} ms, {:.2} ms CPU",
        shim::STARTS,
        ms(small.wall_p50_us),
        ms(small.cpu_mean_us),
        over(small),
        ms(agent.wall_p50_us),
        ms(agent.cpu_mean_us),
        over(agent),
        ms(bare.wall_p50_us),
        ms(bare.cpu_mean_us),
    );
    let cost = |c: shim::Cost| json!({"wall_p50_us": c.wall_p50_us, "cpu_mean_us": c.cpu_mean_us, "cpu_over_bare": over(c)});
    out.line(&json!({"shim_start": {
        "starts": shim::STARTS, "trainyard_shim": cost(small), "trainyard_agent_supervise": cost(agent),
        "bare_rank": {"wall_p50_us": bare.wall_p50_us, "cpu_mean_us": bare.cpu_mean_us},
    }}))
}

fn main() -> anyhow::Result<()> {
    // `cargo bench` hands this process an `LD_LIBRARY_PATH` of some 45 build directories, which
    // the cluster's processes inherit: every program `ctl`, a rank or its shell runs would look
    // for each shared library in each of them first (some 130 failed opens an exec). No
    // operator's `ctl` or agent has it; the release binaries find libtorch by their RUNPATH.
    // SAFETY: at the start of `main`, before this process starts any thread.
    unsafe { std::env::remove_var("LD_LIBRARY_PATH") };
    trainyard_tests::build_release_binaries()?;
    let named: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    let mut out = Results::create(&results_dir(), "submit_latency", &named)?;
    shim_starts(&mut out)?;
    let mut medians = Vec::new();
    for label in ["demo", "secure", "demo-subreaper"] {
        let by_default = label != "demo-subreaper";
        if !(named.is_empty() && by_default || named.iter().any(|n| n == label)) {
            continue;
        }
        let mut c = if label == "secure" { Cluster::start_secure()? } else { Cluster::start()? };
        let host = trainyard_tests::host_file(c.dir.path(), "node-a", 8);
        let tracking: &[(&str, &str)] =
            if label == "demo-subreaper" { &[("TRAINYARD_PROCESS_TRACKING", "subreaper")] } else { &[] };
        c.start_agent_env("node-a", &host, tracking)?;
        medians.push(measure(&mut out, &c, label, 1)?);
        medians.push(measure(&mut out, &c, label, 8)?);
    }
    // The headline: the slowest median from `ctl submit` to every rank running, against 300 ms.
    let worst = medians.iter().filter_map(|m| m["ctl_start_to_running_p50_ms"].as_i64()).max();
    out.line(&json!({"summary": {
        "jobs_per_measurement": JOBS, "target_median_ms": TARGET_MEDIAN_MS,
        "worst_ctl_start_to_running_p50_ms": worst, "medians": medians,
    }}))?;
    println!("results: {}", out.path().display());
    Ok(())
}
