//! What trainyard adds to a job's start on Slurm (docs/slurm.md): from `sbatch` accepted to the
//! first step, on the test's own Slurm cluster of two namespace hosts (tests/src/slurm.rs), for
//! the same script (tests/fixtures/scripts/first_step.py, DDP over gloo) started two ways, in
//! alternating runs:
//!
//! - plain: a batch script of `srun torchrun --nnodes 2 ...`; the first step is when rank 0's
//!   first step ended (the script writes its wall time);
//! - trainyard: `ctl submit --slurm` (its quick preflight included), an agent per node joining;
//!   the first step is when the first step receipt was stored, and the script's own time of
//!   its first step is kept beside it.
//!
//! `cargo bench -p trainyard-tests --bench slurm_start [-- RUNS]` (default 5 of each, as root).
//! Writes docs/results/slurm_start-<UTC>.jsonl: every run, and the medians and their difference
//! against the target (at most 3 s added). Exits non-zero when the target is missed.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use serde_json::json;
use trainyard_tests::slurm::SlurmLab;
use trainyard_tests::{Cluster, bin, host_file, run_account};

const TARGET_ADDED_MS: f64 = 3_000.0;

fn now_ms() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64() * 1000.0)
}

fn wait_for<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Result<Option<T>>) -> Result<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f()? {
            return Ok(v);
        }
        ensure!(Instant::now() < deadline, "{what}: not within {timeout:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The stamp rank 0 wrote, once it is there.
fn stamp(path: &Path) -> Option<f64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

fn chown(path: &Path) -> Result<()> {
    let status = std::process::Command::new("chown").arg(run_account()).arg(path).status()?;
    ensure!(status.success(), "chown {}", path.display());
    Ok(())
}

/// One plain start: sbatch of `srun torchrun`; milliseconds from sbatch's answer to the first step.
fn plain(slurm: &SlurmLab, work: &Path, python: &str, site: &str, run: usize) -> Result<f64> {
    let stamp_file = work.join(format!("plain-{run}.stamp"));
    let script = trainyard_tests::fixture_scripts().join("first_step.py");
    let batch = work.join(format!("plain-{run}.sh"));
    let text = format!(
        "#!/bin/sh\nmaster=$(ip -4 -o addr show eth0 | awk '{{print $4}}' | cut -d/ -f1)\n\
         export master\n\
         srun --ntasks-per-node=1 --whole sh -c 'exec env PYTHONPATH={site} GLOO_SOCKET_IFNAME=eth0 {python} -m torch.distributed.run \
         --nnodes 2 --node-rank $SLURM_NODEID --nproc-per-node 1 --master-addr $master --master-port 29511 \
         {} --steps 5 --stamp {}'\n",
        script.display(),
        stamp_file.display()
    );
    std::fs::write(&batch, text)?;
    let out = slurm
        .as_user(Path::new("sbatch"), &[])
        .args(["--parsable", "-N2", "--gres=gpu:1", "-o"])
        .arg(work.join(format!("plain-{run}.out")))
        .arg(&batch)
        .output()?;
    let accepted = now_ms();
    ensure!(out.status.success(), "sbatch: {}", String::from_utf8_lossy(&out.stderr));
    let id: u64 = String::from_utf8_lossy(&out.stdout).trim().parse()?;
    let first = wait_for("the plain run's first step", Duration::from_secs(120), || Ok(stamp(&stamp_file)))?;
    slurm.wait_completed(id, Duration::from_secs(60))?;
    Ok(first - accepted)
}

/// A trainyard start's times, in milliseconds from `sbatch` accepted.
struct Start {
    /// The first step receipt stored.
    stored: f64,
    /// The script's own first step.
    script: f64,
    /// The job placed: every agent of the allocation joined.
    placed: f64,
    /// The agents' start-up preflight (of their node) and the job's launch preflight (quick),
    /// the longest of each.
    startup_preflight: f64,
    launch_preflight: f64,
}

/// One trainyard start: `ctl submit --slurm`, timed from its answer (sbatch accepted).
fn trainyard(
    c: &Cluster,
    slurm: &SlurmLab,
    work: &Path,
    (python, site): (&str, &str),
    run: usize,
) -> Result<Start> {
    let stamp_file = work.join(format!("trainyard-{run}.stamp"));
    let script = trainyard_tests::fixture_scripts().join("first_step.py").display().to_string();
    let stamp_text = stamp_file.display().to_string();
    let out_dir = work.display().to_string();
    let text = format!(
        "name = \"start-{run}\"\npreflight = \"quick\"\n\n[resources]\ngpus = 2\ngpus_per_node = 1\n\n[engine]\nkind = \"exec\"\n\
         argv = [{python:?}, {script:?}, \"--steps\", \"5\", \"--stamp\", {stamp_text:?}]\nworkdir = {out_dir:?}\n\n\
         [env]\nPYTHONPATH = {site:?}\nGLOO_SOCKET_IFNAME = \"eth0\"\n\n[slurm]\npartition = \"debug\"\n"
    );
    let file = work.join(format!("trainyard-{run}.toml"));
    std::fs::write(&file, text)?;
    let env = [
        ("HOME", c.path("home").display().to_string()),
        ("TRAINYARD_TOKEN", c.token.clone().unwrap_or_default()),
    ];
    let host = format!("--agent-arg=--host-file={}", c.path("slurm-node.json").display());
    let out = slurm
        .as_user(&bin("ctl")?, &env)
        .args(["--controller", &c.url(), "submit", &file.display().to_string(), "--slurm", &host])
        .arg("--agent-arg=--telemetry=off")
        .output()?;
    let accepted = now_ms();
    ensure!(out.status.success(), "ctl submit --slurm: {}", String::from_utf8_lossy(&out.stderr));
    let job: u64 = String::from_utf8_lossy(&out.stdout).trim().parse()?;
    let sql = format!("SELECT COUNT(*) FROM receipts WHERE job_id = {job} AND kind = 'step'");
    let stored = wait_for("the first step receipt", Duration::from_secs(120), || {
        Ok((c.query(&sql)?[0][0] > 0).then(now_ms))
    })?;
    let first = wait_for("the script's stamp", Duration::from_secs(30), || Ok(stamp(&stamp_file)))?;
    let status = c.wait_state(job, &["succeeded", "failed", "cancelled"], Duration::from_secs(120))?;
    ensure!(status["state"] == "succeeded", "{status}");
    let slurm_id = status["slurm_job_id"].as_u64().context("the Slurm job")?;
    slurm.wait_completed(slurm_id, Duration::from_secs(60))?;
    let events = status["events"].as_array().cloned().unwrap_or_default();
    let placed =
        events.iter().find(|e| e["to_state"] == "scheduled").and_then(|e| e["at_ms"].as_f64()).unwrap_or(0.0);
    let longest = |filter: &str| -> Result<f64> {
        let sql = format!(
            "SELECT COALESCE(MAX(finished_at_ms - started_at_ms), 0) FROM preflight_reports WHERE {filter}"
        );
        Ok(c.query(&sql)?[0][0] as f64)
    };
    Ok(Start {
        stored: stored - accepted,
        script: first - accepted,
        placed: placed - accepted,
        startup_preflight: longest(&format!("agent_id LIKE 'j{job}-%' AND job_id IS NULL"))?,
        launch_preflight: longest(&format!("job_id = {job}"))?,
    })
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 }
}

fn main() -> Result<()> {
    trainyard_tests::build_release_binaries()?;
    let raw: Vec<String> = std::env::args().skip(1).filter(|a| a != "--bench").collect();
    let runs: usize = raw.first().and_then(|a| a.parse().ok()).unwrap_or(5);
    let (python, site) =
        trainyard_tests::torch_for_ranks().context("no python with .venv's torch for the ranks")?;
    ensure!(trainyard_tests::slurm::installed(), "Slurm is not installed (deploy/setup.sh)");
    let mut results = trainyard_tests::results::Results::create(
        &trainyard_tests::results::results_dir(),
        "slurm_start",
        &raw,
    )?;
    let c = Cluster::start_lab(2, &[])?.context("the bench needs root (namespace hosts, slurmd)")?;
    let slurm = SlurmLab::start(c.lab(), c.dir.path(), 1, "KillWait=5")?;
    for dir in ["home", "work"] {
        std::fs::create_dir_all(c.path(dir))?;
        chown(&c.path(dir))?;
    }
    host_file(c.dir.path(), "slurm-node", 1);
    let work = c.path("work");
    let (mut plain_ms, mut stored_ms, mut script_ms, mut preflight_ms) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for run in 0..runs {
        let p = plain(&slurm, &work, &python, &site, run)?;
        let t = trainyard(&c, &slurm, &work, (&python, &site), run)?;
        println!(
            "run {run}: plain {p:.0} ms; trainyard first receipt stored {:.0} ms (script's first step {:.0} ms; \
             placed at {:.0} ms; preflights: start-up {:.0} ms, launch {:.0} ms)",
            t.stored, t.script, t.placed, t.startup_preflight, t.launch_preflight
        );
        results.line(&json!({
            "run": run, "plain_ms": p, "trainyard_stored_ms": t.stored, "trainyard_script_ms": t.script,
            "trainyard_placed_ms": t.placed, "startup_preflight_ms": t.startup_preflight,
            "launch_preflight_ms": t.launch_preflight,
        }))?;
        plain_ms.push(p);
        stored_ms.push(t.stored);
        script_ms.push(t.script);
        preflight_ms.push(t.launch_preflight + t.startup_preflight);
    }
    let (p, s, f) = (median(&mut plain_ms), median(&mut stored_ms), median(&mut script_ms));
    let preflights = median(&mut preflight_ms);
    let added = s - p;
    let met = added <= TARGET_ADDED_MS;
    results.line(&json!({
        "summary": true, "runs": runs, "median_plain_ms": p, "median_trainyard_stored_ms": s,
        "median_trainyard_script_ms": f, "median_preflights_ms": preflights, "added_ms": added, "ratio": s / p, "target_added_ms": TARGET_ADDED_MS, "met": met,
    }))?;
    println!(
        "medians of {runs}: plain {p:.0} ms, trainyard {s:.0} ms to the first stored receipt ({f:.0} ms to the script's \
         first step; its preflights {preflights:.0} ms of it): {added:+.0} ms added ({:.2}x), target at most \
         {TARGET_ADDED_MS:.0} ms: {}\nresults: {}",
        s / p,
        if met { "met" } else { "MISSED" },
        results.path().display()
    );
    ensure!(met, "trainyard adds {added:.0} ms to the start, more than {TARGET_ADDED_MS:.0} ms");
    Ok(())
}
