//! Scripts nobody changed for trainyard, run as `exec` jobs: their step receipts come from the
//! bootstrap the agent puts on a Python rank's path (torch's optimizer hooks, and the loggers
//! the script already calls), and everything downstream works on them: goodput, the hang watch,
//! `ctl diagnose`. The script is tests/fixtures/scripts/plain_ddp.py, a DDP loop (gloo, 2
//! ranks) that logs through wandb (offline), MLflow (a local file store) or TensorBoard, the
//! real packages deploy/setup.sh installs.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, ensure};
use serde_json::Value;
use trainyard_tests::{Cluster, PythonJob, fixture_scripts};

const STEPS: u32 = 30;

/// A job file for a 2-rank job running the fixture `script` with `args` in `work`, with
/// `extra` TOML tables after its `[env]`.
fn script_job(
    c: &Cluster,
    name: &str,
    work: &Path,
    script: &str,
    args: &[&str],
    env: &[(&str, &str)],
    extra: &str,
) -> PathBuf {
    std::fs::create_dir_all(work).expect("make the job's directory");
    let script = fixture_scripts().join(script).display().to_string();
    let mut all = vec![script.as_str()];
    all.extend_from_slice(args);
    let file = c.python_job(&PythonJob {
        name,
        gpus: 2,
        per_node: 2,
        workdir: work,
        source_dir: None,
        args: &all,
        env,
    });
    let mut text = std::fs::read_to_string(&file).expect("read the job file");
    text.push_str(extra);
    std::fs::write(&file, text).expect("write the job file");
    file
}

/// A job file running plain_ddp.py with `args`, its `--out` in `work`.
fn plain_job(
    c: &Cluster,
    name: &str,
    work: &Path,
    args: &[&str],
    env: &[(&str, &str)],
    extra: &str,
) -> PathBuf {
    let out = work.display().to_string();
    let mut all = vec!["--out", out.as_str()];
    all.extend_from_slice(args);
    script_job(c, name, work, "plain_ddp.py", &all, env, extra)
}

/// Submits a 2-rank job running the fixture `script` with `args` in a directory of its own, with
/// `extra` TOML tables; returns the job's id and its directory.
fn fixture_job(
    c: &Cluster,
    name: &str,
    script: &str,
    args: &[&str],
    env: &[(&str, &str)],
    extra: &str,
) -> anyhow::Result<(u64, PathBuf)> {
    let work = c.path(name);
    let file = script_job(c, name, &work, script, args, env, extra);
    Ok((c.submit(&file)?, work))
}

/// The job's step receipts of `rank`, which must be steps 0..`steps`, one each.
fn one_per_step(c: &Cluster, job: u64, rank: u32, steps: u64) -> anyhow::Result<Vec<Value>> {
    let mine: Vec<Value> =
        receipts(c, job, "step")?.into_iter().filter(|(r, _)| *r == rank).map(|(_, b)| b).collect();
    let numbers: Vec<u64> = mine.iter().filter_map(|b| b["step"].as_u64()).collect();
    ensure!(numbers == (0..steps).collect::<Vec<_>>(), "job {job}, rank {rank}: steps {numbers:?}");
    Ok(mine)
}

fn wait_success(c: &Cluster, id: u64) -> anyhow::Result<Value> {
    let status = c.wait_state(id, &["succeeded", "failed", "cancelled"], Duration::from_secs(300))?;
    ensure!(status["state"] == "succeeded", "job {id}: {status}\n{}", c.logs("agent-a"));
    Ok(status)
}

/// The job's receipts of `kind`, as (rank, body) in (rank, seq) order.
fn receipts(c: &Cluster, job: u64, kind: &str) -> anyhow::Result<Vec<(u32, Value)>> {
    let rows = c.query_text(&format!(
        "SELECT CAST(rank AS TEXT), body FROM receipts WHERE job_id = {job} AND kind = '{kind}' AND {} ORDER BY rank, seq",
        trainyard_tests::RANK_WRITTEN
    ))?;
    rows.iter().map(|r| Ok((r[0].parse()?, serde_json::from_str(&r[1]).context("a receipt body")?))).collect()
}

/// One step receipt per rank and step, 0..STEPS, each with its own compute time from rank 0's
/// hooks; rank 0's losses are the ones the script logged (`logged.json`), attributed to `source`.
fn check_steps(c: &Cluster, job: u64, work: &Path, source: &str) -> anyhow::Result<()> {
    let steps = receipts(c, job, "step")?;
    for rank in 0..2 {
        let mine = one_per_step(c, job, rank, u64::from(STEPS))?;
        for b in &mine[1..] {
            ensure!(b["fwd_bwd_ms"].as_f64().is_some_and(|t| t > 0.0), "rank {rank}: {b}");
            ensure!(b["step_time_ms"].as_f64().is_some_and(|t| t > 0.0), "rank {rank}: {b}");
            ensure!(b["sources"]["step_time_ms"] == "cpu_clock", "rank {rank}: {b}");
        }
    }
    let logged: Vec<f64> = serde_json::from_str(&std::fs::read_to_string(work.join("logged.json"))?)?;
    let losses: Vec<f64> =
        steps.iter().filter(|(r, _)| *r == 0).filter_map(|(_, b)| b["loss"].as_f64()).collect();
    ensure!(losses == logged, "job {job}: rank 0's receipts {losses:?}, the script logged {logged:?}");
    let rank0 = steps.iter().find(|(r, b)| *r == 0 && b["step"] == 3).map(|(_, b)| b).context("step 3")?;
    ensure!(rank0["sources"]["loss"] == source && rank0["lr"].as_f64().is_some(), "{rank0}");
    let launch = receipts(c, job, "launch")?;
    ensure!(launch.len() == 2, "one launch receipt per rank: {launch:?}");
    for (_, b) in &launch {
        ensure!(b["bootstrap_hash"].as_str().is_some_and(|h| h.len() == 64), "{b}");
        ensure!(b["producer"].as_str().is_some_and(|p| p.starts_with("trainyard bootstrap")), "{b}");
    }
    let exits = receipts(c, job, "exit")?;
    ensure!(exits.len() == 2 && exits.iter().all(|(_, b)| b["status"] == "ok"), "{exits:?}");
    let goodput = c.status(job)?["goodput"]["goodput"].as_f64().unwrap_or(0.0);
    ensure!(goodput > 0.0, "job {job}: goodput {goodput}");
    Ok(())
}

#[test]
fn unchanged_ddp_loops_get_a_receipt_per_rank_and_step_with_what_their_loggers_logged() -> anyhow::Result<()>
{
    let mut c = Cluster::start()?;
    c.start_agent("a", 8)?;
    let steps = STEPS.to_string();
    let mut jobs = Vec::new();
    for logger in ["wandb", "mlflow", "tensorboard"] {
        let work = c.path(logger);
        let file = plain_job(
            &c,
            logger,
            &work,
            &["--steps", &steps, "--logger", logger],
            &[("WANDB_SILENT", "true")],
            "",
        );
        jobs.push((logger, work, c.submit(&file)?));
    }
    // No logger, but a pattern for the line the script prints: the printed loss, merged.
    let printed_dir = c.path("pattern");
    let pattern = "\n[receipts]\npattern = '^step (?P<step>\\d+) loss (?P<loss>[\\d.]+)$'\n";
    let printed = plain_job(&c, "pattern", &printed_dir, &["--steps", &steps], &[], pattern);
    let printed = c.submit(&printed)?;
    // The same script with `[receipts] auto = false`: nothing but what the script writes.
    let off_dir = c.path("off");
    let off = plain_job(&c, "off", &off_dir, &["--steps", "5"], &[], "\n[receipts]\nauto = false\n");
    let off = c.submit(&off)?;
    for (logger, work, id) in &jobs {
        wait_success(&c, *id)?;
        check_steps(&c, *id, work, logger).with_context(|| {
            let logs = c
                .ctl(&["logs", &id.to_string(), "--tail", "30"])
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned());
            format!("the {logger} job; rank 0's output:\n{}", logs.unwrap_or_default())
        })?;
    }
    // The users' own records are what they would be without trainyard.
    let metrics = std::fs::read_dir(c.path("mlflow").join("mlruns/0"))?
        .filter_map(Result::ok)
        .map(|e| e.path().join("metrics/train/loss"))
        .find(|p| p.is_file())
        .context("MLflow's loss metric file")?;
    ensure!(std::fs::read_to_string(&metrics)?.lines().count() == STEPS as usize, "{}", metrics.display());
    ensure!(std::fs::read_dir(c.path("tensorboard").join("tb"))?.count() == 1, "one TensorBoard event file");
    ensure!(std::fs::read_dir(c.path("wandb").join("wandb"))?.count() > 0, "wandb's offline run");

    wait_success(&c, printed)?;
    let logged: Vec<f64> = serde_json::from_str(&std::fs::read_to_string(printed_dir.join("logged.json"))?)?;
    let rank0: Vec<Value> =
        receipts(&c, printed, "step")?.into_iter().filter(|(r, _)| *r == 0).map(|(_, b)| b).collect();
    ensure!(rank0.len() == STEPS as usize, "{rank0:?}");
    for (b, want) in rank0.iter().zip(&logged) {
        ensure!(b["sources"]["loss"] == "printed pattern", "{b}");
        ensure!(
            b["loss"].as_f64().is_some_and(|l| (l - want).abs() < 6e-5),
            "printed with 4 decimals: {b} vs {want}"
        );
        ensure!(b["fwd_bwd_ms"].as_f64().is_some() || b["step"] == 0, "the hook's fields stay: {b}");
    }

    let status = wait_success(&c, off)?;
    ensure!(receipts(&c, off, "step")?.is_empty(), "auto = false writes no step receipt");
    let summary = status["goodput"]["summary"].as_str().unwrap_or_default();
    ensure!(summary.starts_with("unknown (no step receipts)"), "{status}");
    ensure!(status["goodput"]["goodput"].is_null(), "{status}");

    // The agent compiled its bootstrap once, with the python3 on its PATH: no rank compiles it.
    let boot = std::fs::read_dir(c.path("agent-a").join("bootstrap"))?
        .filter_map(|e| Some(e.ok()?.path()))
        .find(|p| p.join("sitecustomize.py").is_file())
        .context("the agent's bootstrap directory")?;
    let pyc = std::fs::read_dir(boot.join("__pycache__"))
        .with_context(|| format!("{}: no __pycache__", boot.display()))?
        .filter_map(|e| Some(e.ok()?.path()))
        .find(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("sitecustomize.cpython-")))
        .with_context(|| format!("no compiled sitecustomize in {}", boot.display()))?;
    // Flags 3 (checked hash) as the agent compiles; a rank's interpreter would write 0 (timestamp).
    let flags = std::fs::read(&pyc)?.get(4..8).map(|f| u32::from_le_bytes(f.try_into().unwrap()));
    ensure!(flags == Some(3), "{}: flags {flags:?}", pyc.display());
    Ok(())
}

#[test]
fn a_hugging_face_trainer_run_gets_its_steps_and_the_losses_trainer_logged() -> anyhow::Result<()> {
    let mut c = Cluster::start()?;
    c.start_agent("a", 2)?;
    let out = c.path("hf").display().to_string();
    let env = [("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1")];
    let (id, work) = fixture_job(&c, "hf", "hf_trainer.py", &["--steps", "10", "--out", &out], &env, "")?;
    wait_success(&c, id)?;
    let rank0 = one_per_step(&c, id, 0, 10)?;
    one_per_step(&c, id, 1, 10)?;
    let history: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(work.join("log_history.json"))?)?;
    let logged: Vec<f64> = history.iter().filter_map(|h| h["loss"].as_f64()).collect();
    let losses: Vec<f64> = rank0.iter().filter_map(|b| b["loss"].as_f64()).collect();
    ensure!(losses == logged, "receipts {losses:?}, Trainer logged {logged:?}");
    for b in &rank0 {
        let logged_here = b["grad_norm"].as_f64().is_some() && b["lr"].as_f64().is_some();
        ensure!(b["sources"]["loss"] == "transformers" && logged_here, "{b}");
    }
    ensure!(c.status(id)?["goodput"]["goodput"].as_f64().unwrap_or(0.0) > 0.0, "goodput above zero");
    Ok(())
}

/// The step lines of nanochat, modded-nanogpt, torchtitan and Megatron-LM, printed by a script
/// that writes no receipt (tests/fixtures/scripts/print_steps.py): the agent reads them and
/// writes one step receipt per printed step, from the rank that printed it; look-alike lines (a
/// `nan` loss, a step that goes back) make none.
#[test]
fn printed_step_lines_of_four_trainers_become_step_receipts() -> anyhow::Result<()> {
    let mut c = Cluster::start()?;
    c.start_agent("a", 8)?;
    let script = fixture_scripts().join("print_steps.py").display().to_string();
    let work = c.path("printed");
    std::fs::create_dir_all(&work)?;
    // (format, the ranks that print, decimals of the printed loss; modded-nanogpt prints none)
    let cases = [
        ("nanochat", vec![0u32], Some(1e-6)),
        ("modded", vec![0], None),
        ("titan", vec![0, 1], Some(1e-5)),
        ("megatron", vec![1], Some(1e-6)),
    ];
    let mut jobs = Vec::new();
    for (format, _, _) in &cases {
        let args = [script.as_str(), format, "20", "40"];
        let file = c.python_job(&PythonJob {
            name: format,
            gpus: 2,
            per_node: 2,
            workdir: &work,
            source_dir: None,
            args: &args,
            env: &[],
        });
        jobs.push(c.submit(&file)?);
    }
    for ((format, printers, precision), id) in cases.iter().zip(jobs) {
        wait_success(&c, id)?;
        let steps = receipts(&c, id, "step")?;
        for rank in 0..2 {
            if !printers.contains(&rank) {
                let mine: Vec<_> = steps.iter().filter(|(r, _)| *r == rank).collect();
                ensure!(mine.is_empty(), "{format}: rank {rank} printed nothing: {mine:?}");
                continue;
            }
            for b in &one_per_step(&c, id, rank, 20)? {
                ensure!(b["producer"] == "trainyard agent (printed lines)", "{format}: {b}");
                ensure!(b["step_time_ms"].as_f64().is_some_and(|t| t > 0.0), "{format}: {b}");
                let want = 10.0 / (b["step"].as_f64().unwrap_or(0.0) + 1.0);
                let got = b["loss"].as_f64().or(b["loss_smoothed"].as_f64());
                match precision {
                    Some(p) => ensure!(got.is_some_and(|l| (l - want).abs() <= *p * 10.0), "{format}: {b}"),
                    None => ensure!(got.is_none(), "{format}: {b}"),
                }
            }
        }
        ensure!(c.status(id)?["goodput"]["goodput"].as_f64().unwrap_or(0.0) > 0.0, "{format}: goodput");
    }
    Ok(())
}

/// Lightning runs forward and backward inside `optimizer.step(closure)`: still one step receipt
/// per rank and step, and the loss it logs through its TensorBoardLogger (rank 0 only).
#[test]
fn a_lightning_run_with_a_tensorboard_logger_gets_its_steps() -> anyhow::Result<()> {
    let mut c = Cluster::start()?;
    c.start_agent("a", 2)?;
    let tb = c.path("lightning").join("tb").display().to_string();
    let (id, work) =
        fixture_job(&c, "lightning", "lightning_ddp.py", &["--devices", "2", "--tensorboard", &tb], &[], "")?;
    wait_success(&c, id)?;
    // 2 epochs of 256 samples in batches of 32 over 2 ranks: 4 steps an epoch per rank.
    let rank0 = one_per_step(&c, id, 0, 8)?;
    one_per_step(&c, id, 1, 8)?;
    ensure!(
        rank0.iter().all(|b| b["loss"].as_f64().is_some() && b["sources"]["loss"] == "tensorboard"),
        "the loss Lightning logged, every step: {rank0:?}"
    );
    ensure!(std::fs::read_dir(work.join("tb"))?.count() > 0, "Lightning's own event files are there");
    Ok(())
}

/// A job whose rank starts torchrun itself (2 local workers): the trainyard rank has one
/// receipts file, written by torchrun's first local worker alone: one receipt per step.
#[test]
fn a_torchrun_inside_a_job_writes_one_receipt_per_step() -> anyhow::Result<()> {
    let mut c = Cluster::start()?;
    c.start_agent("a", 1)?;
    let work = c.path("nested");
    std::fs::create_dir_all(&work)?;
    let script = fixture_scripts().join("plain_ddp.py").display().to_string();
    let out = work.display().to_string();
    let args = [
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        &script,
        "--steps",
        "12",
        "--out",
        &out,
    ];
    let file = c.python_job(&PythonJob {
        name: "nested",
        gpus: 1,
        per_node: 1,
        workdir: &work,
        source_dir: None,
        args: &args,
        env: &[],
    });
    let id = c.submit(&file)?;
    wait_success(&c, id)?;
    let rank0 = one_per_step(&c, id, 0, 12)?;
    let logged: Vec<f64> = serde_json::from_str(&std::fs::read_to_string(work.join("logged.json"))?)?;
    ensure!(rank0.len() == logged.len(), "{rank0:?}");
    ensure!(receipts(&c, id, "launch")?.len() == 1, "one launch receipt");
    Ok(())
}

#[test]
fn a_slowed_rank_is_named_and_a_stopped_rank_is_declared_hung() -> anyhow::Result<()> {
    let mut c = Cluster::start()?;
    c.start_agent("a", 4)?;
    // Rank 1 sleeps 40 ms before every forward, as a slow GPU computes: every rank's step time
    // is the same (they meet in the all-reduce), its own compute time is not.
    let slow = c.path("slow");
    let slow =
        plain_job(&c, "slow", &slow, &["--steps", "60"], &[("SLOW_RANK", "1"), ("SLOW_RANK_MS", "40")], "");
    let slow = c.submit(&slow)?;
    let wedged = c.path("wedged");
    let restart = "\n[restart]\nmax_restarts = 0\nhang_timeout_s = 5\n";
    let wedged = plain_job(&c, "wedged", &wedged, &["--steps", "2000"], &[("STEP_SLEEP_MS", "50")], restart);
    let wedged = c.submit(&wedged)?;
    // Steps 1.5 s apart: each receipt leaves the rank when the bootstrap stops waiting for the
    // next step (1 s), and must be stored within 2 s of its step's end.
    let live = c.path("live");
    let live = plain_job(&c, "live", &live, &["--steps", "4"], &[("STEP_SLEEP_MS", "1500")], "");
    let live = c.submit(&live)?;

    wait_success(&c, slow)?;
    let json = c.ctl_ok(&["diagnose", &slow.to_string(), "-o", "json"])?;
    let d: Value = serde_json::from_str(&json)?;
    ensure!(d["metric"] == "fwd_bwd_ms", "the diagnosis compares the ranks' own compute time: {d:#}");
    let finding = d["findings"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|f| f["cause"].as_str().is_some_and(|c| c.starts_with("straggler")))
        .with_context(|| format!("a straggler finding: {d:#}"))?;
    ensure!(finding["ranks"] == serde_json::json!([1]), "rank 1 is named: {finding:#}");

    wait_success(&c, live)?;
    let lag = c.query(&format!(
        "SELECT stored_at_ms - CAST(json_extract(body, '$.ended_at_ms') AS INTEGER) FROM receipts \
         WHERE job_id = {live} AND kind = 'step' ORDER BY seq"
    ))?;
    ensure!(
        lag.len() == 8 && lag.iter().all(|r| (0..2000).contains(&r[0])),
        "stored ms after each step ended: {lag:?}"
    );
    eprintln!("step receipts stored {lag:?} ms after their step ended");

    declared_hung(&c, wedged, 20, &[1])
}

/// Once `job` stored `steps` step receipts (its receipts keep coming, so no hang yet), SIGSTOPs
/// the ranks `stop`: the hang watch must stop the job, its failure a hang.
fn declared_hung(c: &Cluster, job: u64, steps: i64, stop: &[usize]) -> anyhow::Result<()> {
    c.wait_first_steps(job, 2, Duration::from_secs(120))?;
    let sql = format!("SELECT COUNT(*) FROM receipts WHERE job_id = {job} AND kind = 'step'");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while c.query(&sql)?[0][0] < steps {
        ensure!(
            std::time::Instant::now() < deadline,
            "job {job}: not {steps} steps in 60 s: {}",
            c.status(job)?
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let status = c.status(job)?;
    for &rank in stop {
        let pid = status["ranks"][rank]["pid"].as_i64().with_context(|| format!("rank {rank}'s pid"))?;
        // SAFETY: a plain kill(2) of a process this test's job started.
        ensure!(unsafe { libc::kill(pid as i32, libc::SIGSTOP) } == 0, "SIGSTOP {pid}: {status}");
    }
    let status = c.wait_state(job, &["succeeded", "failed", "cancelled"], Duration::from_secs(60))?;
    ensure!(status["state"] == "failed", "job {job}: {status}");
    ensure!(status["failures"][0]["kind"] == "hang", "job {job} declared hung: {status}");
    Ok(())
}

/// The hang watch on the receipts of a Hugging Face Trainer run and of printed step lines alone.
#[test]
fn stopped_ranks_of_a_trainer_run_and_of_a_printing_script_are_declared_hung() -> anyhow::Result<()> {
    let mut c = Cluster::start()?;
    c.start_agent("a", 4)?;
    let restart = "\n[restart]\nmax_restarts = 0\nhang_timeout_s = 5\n";
    let out = c.path("hf-hang").display().to_string();
    let env = [("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1")];
    let (hf, _) =
        fixture_job(&c, "hf-hang", "hf_trainer.py", &["--steps", "100000", "--out", &out], &env, restart)?;
    let (printing, _) =
        fixture_job(&c, "print-hang", "print_steps.py", &["titan", "100000", "50"], &[], restart)?;
    declared_hung(&c, hf, 20, &[1])?;
    declared_hung(&c, printing, 100, &[0, 1])
}
