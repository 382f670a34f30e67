//! A fleet against PostgreSQL for a while: 64 agents and a steady stream of submits.
//!
//! Target (issue: the fleet store): for 10 minutes, 64 agents connected and jobs submitted
//! without pause, the controller's memory stays flat and its log holds no error line. Each
//! job is a 1-GPU `examples/rank.py` run of a few steps, so jobs start, report and finish all
//! the time; every agent stands in for a 2-GPU node. Prints the controller's resident memory
//! (VmRSS) after the agents connected and at the end, the jobs by final state, and the error
//! lines of its log.
//!
//! Every run writes its figures to `docs/results/fleet_soak-<date>.jsonl`
//! ([`trainyard_tests::results`]): one line per minute's RSS sample, then the summary (RSS at
//! start and end, jobs by state, error lines).
//!
//! Run: `cargo bench -p trainyard-tests --bench fleet_soak
//! [-- SECONDS [AGENTS]]` (default 600 s, 64 agents).

use std::time::{Duration, Instant};

use serde_json::json;
use trainyard_tests::results::{Results, results_dir};
use trainyard_tests::{Backend, Cluster, proc_status_field};

/// One submit every this long (and at most this many jobs unfinished, so a slow machine does
/// not build an ever-growing queue that would itself look like a leak).
const SUBMIT_EVERY: Duration = Duration::from_millis(500);
const MAX_IN_FLIGHT: i64 = 24;

fn rss_kib(pid: u32) -> u64 {
    proc_status_field(pid, "VmRSS")
        .and_then(|v| v.split_whitespace().next().and_then(|n| n.parse().ok()))
        .unwrap_or(0)
}

fn main() -> anyhow::Result<()> {
    trainyard_tests::build_release_binaries()?;
    let named: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    let mut out = Results::create(&results_dir(), "fleet_soak", &named)?;
    let args: Vec<u64> = named.iter().filter_map(|a| a.parse().ok()).collect();
    let seconds = args.first().copied().unwrap_or(600);
    let agents = args.get(1).copied().unwrap_or(64);
    let mut c = Cluster::start_on(Backend::Postgres)?;
    for i in 0..agents {
        c.start_agent(&format!("node-{i:02}"), 2)?;
    }
    let pid = c.controller_pid().expect("controller runs");
    let start_rss = rss_kib(pid);
    println!("{agents} agents connected; controller RSS {start_rss} KiB; submitting for {seconds} s");
    let file = c.job_file("soak", 1, 1, &["--steps", "5", "--step-ms", "20"], "");
    let started = Instant::now();
    let mut submitted = 0;
    let mut samples = Vec::new();
    let mut next_sample = Duration::from_secs(60);
    while started.elapsed() < Duration::from_secs(seconds) {
        let unfinished = c
            .query("SELECT COUNT(*) FROM jobs WHERE state NOT IN ('succeeded', 'failed', 'cancelled')")?[0]
            [0];
        if unfinished < MAX_IN_FLIGHT {
            c.submit(&file)?;
            submitted += 1;
        }
        if started.elapsed() >= next_sample {
            let (t_s, rss) = (started.elapsed().as_secs(), rss_kib(pid));
            out.line(&json!({"t_s": t_s, "rss_kib": rss, "submitted": submitted}))?;
            samples.push((t_s, rss));
            next_sample += Duration::from_secs(60);
        }
        std::thread::sleep(SUBMIT_EVERY);
    }
    c.wait_all_finished(Duration::from_secs(120))?;
    let end_rss = rss_kib(pid);
    let states =
        c.query_text("SELECT state, CAST(COUNT(*) AS TEXT) FROM jobs GROUP BY state ORDER BY state")?;
    let log = c.logs("controller");
    let errors: Vec<&str> = log.lines().filter(|l| l.contains(" ERROR ")).collect();
    let change_pct = (end_rss as f64 - start_rss as f64) * 100.0 / start_rss.max(1) as f64;
    println!("rss samples (s, KiB): {samples:?}");
    println!("jobs submitted: {submitted}; by state: {states:?}");
    println!("controller RSS: {start_rss} KiB at start, {end_rss} KiB at the end ({change_pct:+.1} %)");
    println!("error lines in the controller log: {}", errors.len());
    for line in errors.iter().take(10) {
        println!("  {line}");
    }
    let by_state: serde_json::Map<String, serde_json::Value> = states
        .iter()
        .filter_map(|row| {
            let jobs: i64 = row.get(1)?.parse().ok()?;
            Some((row.first()?.clone(), json!(jobs)))
        })
        .collect();
    // The first error lines, cut short: the file stays small whatever the log holds.
    let first_errors: Vec<String> =
        errors.iter().take(10).map(|l| l.chars().take(500).collect::<String>()).collect();
    out.line(&json!({"summary": {
        "seconds": seconds, "agents": agents, "jobs_submitted": submitted, "jobs_by_state": by_state,
        "rss_start_kib": start_rss, "rss_end_kib": end_rss,
        "rss_change_pct": (change_pct * 10.0).round() / 10.0,
        "error_lines": errors.len(), "first_errors": first_errors,
    }}))?;
    println!("results: {}", out.path().display());
    Ok(())
}
