//! A host that is a job's only place (docs/faults.md, "A host that is the only place"): a
//! single-node job with no spare, on a namespace host whose agent is frozen (30 s), whose network
//! is cut (20 s), or whose agent is killed and started again 20 s later, keeps its attempt: the
//! controller waits for the host instead of queueing a restart that could only wait for it
//! too, takes the ranks back when the host returns, and records the gap as a `host_silent`
//! event. Every step is stored exactly once, in attempt 0. With a spare the job moves as before
//! (hosts_apart.rs). Needs root: elsewhere each test prints `skipped: ...`.

use std::time::{Duration, Instant};

use anyhow::ensure;
use trainyard_tests::Cluster;

/// 45 s of steps: the job outlasts the longest gap (30 s) after its first step.
const STEPS: i64 = 450;

fn lab_flags() -> [(&'static str, &'static str); 2] {
    [("--agent-timeout-secs", "8"), ("--cancel-grace-secs", "2")]
}

/// A lab of one host running a one-rank job of [`STEPS`] steps of 100 ms, stepping already.
fn lone_job(name: &str) -> anyhow::Result<Option<(Cluster, u64)>> {
    let Some(mut c) = Cluster::start_lab(1, &lab_flags())? else { return Ok(None) };
    c.start_agent_on(0, "b", 1)?;
    let steps = STEPS.to_string();
    let job = c.submit(&c.job_file(name, 1, 1, &["--steps", &steps, "--step-ms", "100"], ""))?;
    c.wait_first_steps(job, 1, Duration::from_secs(60))?;
    Ok(Some((c, job)))
}

/// The job succeeded in attempt 0 with no failure, every step stored once, and its events hold a
/// wait and a `host_silent` gap of at least `gap_s`.
fn kept_its_attempt(c: &Cluster, job: u64, gap_s: f64) -> anyhow::Result<()> {
    let status = c.wait_state(job, &["succeeded", "failed", "cancelled"], Duration::from_secs(120))?;
    let context = || format!("{status}\n{}", c.logs("controller"));
    ensure!(status["state"] == "succeeded" && status["attempt"] == 0, "{}", context());
    let failures = status["failures"].as_array().map_or(0, Vec::len);
    ensure!(failures == 0, "no failure was recorded: {}", context());
    let rows = c.query(&format!(
        "SELECT COUNT(*), COUNT(DISTINCT step), MAX(attempt) FROM receipts WHERE job_id = {job} AND kind = 'step'"
    ))?;
    ensure!(rows[0] == [STEPS, STEPS, 0], "every step once, in attempt 0: {:?}", rows[0]);
    let reasons = c.query_text(&format!("SELECT reason FROM job_events WHERE job_id = {job} ORDER BY id"))?;
    let reasons: Vec<&str> = reasons.iter().map(|r| r[0].as_str()).collect();
    ensure!(
        reasons
            .iter()
            .any(|r| r.starts_with("host_lost pending: ") && r.contains("no other placement can start now")),
        "the wait was announced: {reasons:?}"
    );
    let gap = reasons
        .iter()
        .find_map(|r| trainyard_model::restart::host_silent_ms(r))
        .ok_or_else(|| anyhow::anyhow!("no host_silent event: {reasons:?}"))?;
    ensure!(gap >= gap_s * 1000.0, "the gap ({gap} ms) covers the {gap_s} s the host was away: {reasons:?}");
    eprintln!("host silent for {gap:.0} ms; attempt 0 kept, {STEPS} steps stored once");
    Ok(())
}

fn sleep_s(s: u64) {
    std::thread::sleep(Duration::from_secs(s));
}

#[test]
fn a_frozen_agent_on_the_only_host_is_waited_for_and_the_attempt_goes_on() -> anyhow::Result<()> {
    let Some((c, job)) = lone_job("frozen")? else { return Ok(()) };
    c.signal_agent("b", libc::SIGSTOP)?;
    sleep_s(30);
    c.signal_agent("b", libc::SIGCONT)?;
    kept_its_attempt(&c, job, 28.0)
}

#[test]
fn a_cut_network_on_the_only_host_is_waited_for_and_the_attempt_goes_on() -> anyhow::Result<()> {
    let Some((c, job)) = lone_job("cut")? else { return Ok(()) };
    let cut = Instant::now();
    c.cut("b")?;
    sleep_s(20);
    c.heal("b")?;
    eprintln!("healed after {:?}", cut.elapsed());
    kept_its_attempt(&c, job, 18.0)
}

#[test]
fn a_killed_agent_started_again_on_the_only_host_takes_its_ranks_back() -> anyhow::Result<()> {
    let Some((mut c, job)) = lone_job("killed")? else { return Ok(()) };
    c.kill_agent("b");
    sleep_s(20);
    c.start_agent_on(0, "b", 1)?;
    kept_its_attempt(&c, job, 18.0)
}
