//! `ctl diagnose` against real controller, agents and ranks: the field's faults reproduced on
//! stand-in hosts by examples/rank.py (docs/diagnosis.md), each named with its cause, node and
//! ranks, and a healthy run named healthy.

use std::time::Duration;

use anyhow::{Context, ensure};
use serde_json::Value;
use trainyard_tests::{Cluster, allowed_cpus, host_file, host_file_numa};

/// Steps per rank: enough windows after warm-up for the straggler scores.
const STEPS: &str = "60";
const STEP_MS: &str = "60";

fn run_to_success(
    c: &Cluster,
    name: &str,
    gpus: u32,
    per_node: u32,
    args: &[&str],
    extra: &str,
) -> anyhow::Result<u64> {
    let mut all = vec!["--steps", STEPS, "--step-ms", STEP_MS];
    all.extend_from_slice(args);
    let id = c.submit(&c.job_file(name, gpus, per_node, &all, extra))?;
    let status = c.wait_state(id, &["succeeded", "failed", "cancelled"], Duration::from_secs(180))?;
    ensure!(status["state"] == "succeeded", "job {id}: {status}");
    Ok(id)
}

/// `ctl diagnose JOB -o json`, and its text form (which must name the same verdict).
fn diagnose(c: &Cluster, job: u64) -> anyhow::Result<Value> {
    let json = c.ctl_ok(&["diagnose", &job.to_string(), "-o", "json"])?;
    let d: Value = serde_json::from_str(&json).context("parse ctl diagnose -o json")?;
    let text = c.ctl_ok(&["diagnose", &job.to_string()])?;
    let verdict = d["verdict"].as_str().unwrap_or_default();
    ensure!(text.contains(verdict), "text and JSON disagree:\n{text}\n{json}");
    Ok(d)
}

fn causes(d: &Value) -> Vec<String> {
    d["findings"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|f| f["cause"].as_str().unwrap_or("").to_string())
        .collect()
}

fn ranks_of(finding: &Value) -> Vec<u64> {
    finding["ranks"].as_array().into_iter().flatten().filter_map(Value::as_u64).collect()
}

/// Two CPUs of this machine for the two NUMA nodes of a split stand-in host (one when it has
/// only one).
fn two_cpus() -> (String, String) {
    let cpus = allowed_cpus();
    let a = cpus[0];
    let b = *cpus.get(1).unwrap_or(&a);
    (a.to_string(), b.to_string())
}

#[test]
fn a_slow_node_with_split_numa_is_named_and_compare_names_the_split() -> anyhow::Result<()> {
    let mut c = Cluster::start()?;
    let healthy = host_file(c.dir.path(), "sxm-a", 8);
    let (cpu0, cpu1) = two_cpus();
    let split = host_file_numa(c.dir.path(), "sxm-b", &[0, 0, 0, 0, 1, 1, 1, 1], &[(0, &cpu0), (1, &cpu1)]);
    c.start_agent_with_host_file("sxm-a", &healthy)?;
    let reference = run_to_success(&c, "reference", 8, 8, &[], "")?;
    // The field's split node ran 1295 ms per step against 702: 1.84x.
    c.start_agent_env("sxm-b", &split, &[("TRAINYARD_STANDIN_SLOWDOWN", "1.8")])?;
    let job = run_to_success(&c, "split", 16, 8, &[], "")?;
    let d = diagnose(&c, job)?;
    // numa.split leads. This machine cannot be the stand-in host it plays: it has one NUMA node
    // and two CPUs, so the ranks planned on memory node 1 are bound elsewhere and the host has
    // under 4 CPUs per GPU. The diagnosis says so too, for sxm-b alone; nothing on sxm-a.
    let all = causes(&d);
    ensure!(all[0] == "numa.split", "{d:#}");
    ensure!(all[1..].iter().all(|c| c == "numa.binding_refused" || c == "cpu.starved"), "{d:#}");
    for f in d["findings"].as_array().unwrap() {
        ensure!(f["nodes"] == serde_json::json!(["sxm-b"]), "only sxm-b is at fault: {f:#}");
    }
    let f = &d["findings"][0];
    ensure!(f["nodes"] == serde_json::json!(["sxm-b"]), "{f:#}");
    ensure!(ranks_of(f) == (8..16).collect::<Vec<u64>>(), "{f:#}");
    let slowdown =
        f["evidence"].as_array().unwrap().iter().find(|m| m["name"] == "slowdown").unwrap()["value"]
            .as_f64()
            .unwrap();
    ensure!((1.5..2.2).contains(&slowdown), "slowdown {slowdown}");
    ensure!(f["remedy"].as_str().unwrap().contains("NUMA node"));
    ensure!(
        d["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n["agent_id"] == "sxm-b" && n["numa_layout"] == "0:4 1:4"),
        "{d:#}"
    );
    // The healthy run against the split one: the verdict names the split.
    let (a, b) = (reference.to_string(), job.to_string());
    let cmp: Value = serde_json::from_str(&c.ctl_ok(&["compare", &a, &b, "-o", "json"])?)?;
    let verdict = cmp["verdict"].as_str().unwrap_or_default();
    ensure!(
        verdict.contains("slower per step than A; most likely: B (job")
            && verdict.contains("numa.split: sxm-b"),
        "{cmp:#}"
    );
    let ratio = cmp["step_time_ratio"].as_f64().context("ratio")?;
    ensure!((1.2..2.0).contains(&ratio), "B/A step time {ratio}: {cmp:#}");
    ensure!(
        cmp["b"]["nodes"].as_array().unwrap().len() == 2 && cmp["a"]["provenance"]["python"].is_string(),
        "{cmp:#}"
    );
    let text = c.ctl_ok(&["compare", &a, &b])?;
    ensure!(
        text.starts_with(verdict) && text.contains("[0:4 1:4]") && text.contains("step time p10/p50/p90"),
        "{text}"
    );
    Ok(())
}

#[test]
fn shm_disabled_and_allowed_through_is_named() -> anyhow::Result<()> {
    let mut c = Cluster::start()?;
    c.start_agent("nvl", 8)?;
    let job =
        run_to_success(&c, "noshm", 8, 8, &[], "preflight = \"none\"\n[env]\nNCCL_SHM_DISABLE = \"1\"\n")?;
    let d = diagnose(&c, job)?;
    ensure!(causes(&d) == ["shm.disabled"], "{d:#}");
    let f = &d["findings"][0];
    ensure!(ranks_of(f).len() == 8 && f["expected_cost"].as_str().unwrap().contains("3.2x"), "{f:#}");
    // The optimizer phase ran 3x: about a quarter of the step instead of 8 %.
    let share = f["evidence"].as_array().unwrap().iter().find(|m| m["name"] == "optimizer share of the step");
    let share = share.context("optimizer share in the evidence")?["value"].as_f64().unwrap();
    ensure!((0.17..0.35).contains(&share), "optimizer share {share}");
    Ok(())
}

#[test]
fn one_slow_rank_is_an_unexplained_straggler_and_a_healthy_run_says_healthy() -> anyhow::Result<()> {
    let mut c = Cluster::start()?;
    c.start_agent("sxm", 8)?;
    let slow = run_to_success(&c, "straggler", 8, 8, &["--slow-rank", "5", "--slow-factor", "1.3"], "")?;
    let d = diagnose(&c, slow)?;
    ensure!(causes(&d) == ["straggler.unexplained"], "{d:#}");
    ensure!(ranks_of(&d["findings"][0]) == [5], "{d:#}");
    ensure!(d["metric"] == "fwd_bwd_ms", "rank.py reports its compute phase: {d:#}");
    let five = d["ranks"].as_array().unwrap().iter().find(|r| r["rank"] == 5).unwrap();
    ensure!(five["straggler"] == true && five["relative"].as_f64().unwrap() < 0.85, "{five:#}");

    // Stored with its evidence once the job ended.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let rows =
            c.query_text(&format!("SELECT cause, ranks, evidence FROM job_findings WHERE job_id = {slow}"))?;
        if let Some(row) = rows.first() {
            ensure!(
                row[0] == "straggler.unexplained"
                    && row[1] == "[5]"
                    && row[2].contains("rank 5 relative score"),
                "{rows:?}"
            );
            break;
        }
        ensure!(std::time::Instant::now() < deadline, "no finding stored for job {slow}");
        std::thread::sleep(Duration::from_millis(200));
    }

    let ok = run_to_success(&c, "healthy", 8, 8, &[], "")?;
    let d = diagnose(&c, ok)?;
    ensure!(causes(&d).is_empty() && d["healthy"] == true, "{d:#}");
    ensure!(d["verdict"].as_str().unwrap().starts_with("healthy: no finding"), "{d:#}");
    ensure!(d["samples_used"].as_u64() == Some(8 * 60), "{d:#}");
    ensure!(d["unusable"].as_array().unwrap().is_empty(), "{d:#}");

    // Receipts that break schema v1 (missing, mistyped, negative, NaN): the diagnosis says what
    // it could not use, per rank, and still judges the run by the rest.
    let messy = run_to_success(&c, "messy", 2, 2, &["--bad-steps"], "")?;
    let d = diagnose(&c, messy)?;
    ensure!(causes(&d).is_empty(), "{d:#}");
    let unusable: Vec<&str> = d["unusable"].as_array().unwrap().iter().filter_map(Value::as_str).collect();
    for rank in 0..2 {
        let want = [
            format!("rank {rank}: 3 step receipt(s) without a usable fwd_bwd_ms"),
            format!("rank {rank}: 3 step receipt(s) break receipt schema v1"),
            format!("rank {rank}: 1 line(s) of its receipts file were not JSON objects"),
        ];
        for w in &want {
            ensure!(unusable.iter().any(|u| u.starts_with(w.as_str())), "{w:?} not in {unusable:#?}");
        }
    }

    // A job that does not exist is an error that names it.
    let out = c.ctl(&["diagnose", "999"])?;
    ensure!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("999"));
    Ok(())
}

#[test]
fn a_rank_that_stops_stepping_is_shown_stalled_in_status() -> anyhow::Result<()> {
    let mut c = Cluster::start()?;
    c.start_agent("sxm", 2)?;
    let args = ["--steps", "100000", "--step-ms", "50", "--hang-at-step", "20", "--hang-rank", "1"];
    let job = c.submit(&c.job_file("hang", 2, 2, &args, ""))?;
    c.wait_state(job, &["running"], Duration::from_secs(60))?;
    // 20 x 50 ms is under the 5 s floor: the stall shows after 5 s of silence.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let warning = loop {
        let status = c.status(job)?;
        let found = status["warnings"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .find(|w| w.starts_with("stalled"));
        if let Some(w) = found {
            break w.to_string();
        }
        ensure!(std::time::Instant::now() < deadline, "no stall warning: {status:#}");
        std::thread::sleep(Duration::from_millis(500));
    };
    ensure!(
        warning.starts_with("stalled: rank(s) 1 wrote no step for") && warning.ends_with("last step 19)"),
        "{warning}"
    );
    let text = c.ctl_ok(&["status", &job.to_string()])?;
    ensure!(text.contains("stalled: rank(s) 1"), "{text}");
    c.ctl_ok(&["cancel", &job.to_string()])?;
    Ok(())
}

#[test]
fn goodput_splits_the_wall_time_and_counts_the_steps_a_restart_redid() -> anyhow::Result<()> {
    let mut c = Cluster::start()?;
    c.start_agent("sxm", 2)?;
    // Rank 0, whose receipts goodput reads, fails at step 20 of attempt 0 (steps 0-19 done);
    // attempt 1 starts over from step 0.
    let args = [
        "--steps",
        "40",
        "--step-ms",
        "50",
        "--fail-at-step",
        "20",
        "--fail-rank",
        "0",
        "--fail-attempt",
        "0",
    ];
    let job = c.submit(&c.job_file("flaky", 2, 2, &args, "[restart]\nmax_restarts = 1\n"))?;
    let status = c.wait_state(job, &["succeeded", "failed"], Duration::from_secs(90))?;
    ensure!(status["state"] == "succeeded", "{status:#}");
    let g = &status["goodput"];
    ensure!(g["attempts"].as_array().map(Vec::len) == Some(2), "{g:#}");
    ensure!(g["steps_redone"] == 20, "steps 0-19 were done twice: {g:#}");
    let share = g["goodput"].as_f64().context("goodput")?;
    ensure!(share > 0.0 && share < 1.0, "{g:#}");
    ensure!(g["restart_ms"].as_f64().unwrap() > 0.0 && g["lost_ms"].as_f64().unwrap() > 500.0, "{g:#}");
    let text = c.ctl_ok(&["status", &job.to_string()])?;
    ensure!(text.contains("goodput:") && text.contains("(20 steps redone)"), "{text}");

    // Once every rank stopped, the controller records it: the job_goodput view and
    // job_findings (none for this run).
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let rows =
            c.query(&format!("SELECT attempts, steps_redone FROM job_goodput WHERE job_id = {job}"))?;
        if rows == vec![vec![2, 20]] {
            break;
        }
        ensure!(std::time::Instant::now() < deadline, "job_goodput: {rows:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
    ensure!(c.query(&format!("SELECT COUNT(*) FROM job_findings WHERE job_id = {job}"))? == vec![vec![0]]);
    Ok(())
}
