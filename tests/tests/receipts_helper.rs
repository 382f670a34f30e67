//! The receipts helper (python/trainyard_receipts) in a real PyTorch DDP script
//! (tests/fixtures/scripts/receipts_ddp.py, gloo on CPU), run unchanged as an `exec` job of 2
//! ranks: every rank's launch receipt carries the torch that .venv runs, the job's env overlay
//! and the git revision of the job's `source_dir`; its step receipts fill the typed columns of
//! `step_metrics`; nothing it writes breaks receipt schema v1. The helper comes from python/
//! through `PYTHONPATH` in the job's env overlay, so it needs no install; torch is the one
//! deploy/setup.sh installs into .venv.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, ensure};
use trainyard_tests::{Cluster, PythonJob, fixture_scripts, repo_root, venv_python};

/// Ranks of the job, all on one agent.
const RANKS: u32 = 2;

/// Optimizer steps the script runs (its `--steps`).
const STEPS: i64 = 6;

/// Tokens the whole job processes per step: receipts_ddp.py's BATCH x SEQ_LEN per rank, times
/// the ranks.
const JOB_TOKENS_PER_STEP: f64 = (8 * 16 * RANKS) as f64;

fn script() -> PathBuf {
    fixture_scripts().join("receipts_ddp.py")
}

/// The version `.venv/bin/python -c 'import torch; print(torch.__version__)'` prints.
fn venv_torch_version() -> anyhow::Result<String> {
    let out = Command::new(venv_python())
        .args(["-c", "import torch; print(torch.__version__)"])
        .output()
        .context("run .venv/bin/python")?;
    ensure!(out.status.success(), "import torch: {}", String::from_utf8_lossy(&out.stderr));
    Ok(String::from_utf8(out.stdout)?.trim().to_string())
}

/// A git repository of one commit in `dir` (the job's source); its HEAD, or `None` where git
/// is not installed.
fn git_repo(dir: &Path) -> anyhow::Result<Option<String>> {
    std::fs::create_dir_all(dir)?;
    let git = |args: &[&str]| {
        Command::new("git")
            .arg("-C")
            .arg(dir)
            .args(["-c", "user.name=trainyard", "-c", "user.email=trainyard@example.com"])
            .args(["-c", "commit.gpgsign=false"])
            .args(args)
            .output()
    };
    let init = match git(&["init", "-q"]) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        other => other.context("run git")?,
    };
    ensure!(init.status.success(), "git init: {}", String::from_utf8_lossy(&init.stderr));
    std::fs::write(dir.join("train.toml"), "steps = 6\n")?;
    let commit: [&[&str]; 2] = [&["add", "train.toml"], &["commit", "-q", "-m", "source"]];
    for args in commit {
        let out = git(args)?;
        ensure!(out.status.success(), "git {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
    let out = git(&["rev-parse", "HEAD"])?;
    ensure!(out.status.success(), "git rev-parse: {}", String::from_utf8_lossy(&out.stderr));
    Ok(Some(String::from_utf8(out.stdout)?.trim().to_string()))
}

/// The receipts of one rank's file, as JSON objects.
fn read_receipts(path: &Path) -> anyhow::Result<Vec<serde_json::Value>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
    text.lines().map(|l| serde_json::from_str(l).with_context(|| format!("receipt line {l:?}"))).collect()
}

#[test]
fn a_ddp_script_with_the_receipts_helper_writes_v1_receipts() -> anyhow::Result<()> {
    let mut c = Cluster::start()?;
    c.start_agent("a", RANKS)?;
    let work = c.path("receipts-ddp");
    std::fs::create_dir_all(&work)?;
    let source = c.path("source");
    let head = git_repo(&source)?;
    let helper = repo_root().join("python").display().to_string();
    let script_path = script().display().to_string();
    let steps = STEPS.to_string();
    let file = c.python_job(&PythonJob {
        name: "receipts-ddp",
        gpus: RANKS,
        per_node: RANKS,
        workdir: &work,
        source_dir: Some(&source),
        args: &[&script_path, "--steps", &steps],
        env: &[("PYTHONPATH", &helper), ("TRAINYARD_DEMO_FLAG", "1")],
    });
    let id = c.submit(&file)?;
    let status = c.wait_state(id, &["succeeded", "failed", "cancelled"], Duration::from_secs(240))?;
    ensure!(status["state"] == "succeeded", "job {id}: {status}\n{}", c.logs("agent-a"));
    for r in status["ranks"].as_array().context("ranks in ctl status")? {
        assert_eq!(r["skipped_lines"], 0, "every line the helper wrote is a JSON object: {r}");
    }

    // Launch receipts: provenance read at run time, the overlay, the source revision.
    let torch = venv_torch_version()?;
    let launches = c.query_text(&format!(
        "SELECT CAST(rank AS TEXT), CAST(json_extract(body, '$.schema') AS TEXT), json_extract(body, '$.torch'), \
                json_extract(body, '$.env'), CAST(json_extract(body, '$.world_size') AS TEXT), \
                json_extract(body, '$.source_rev'), CAST(json_extract(body, '$.source_dirty') AS TEXT) \
         FROM receipts WHERE job_id = {id} AND kind = 'launch' ORDER BY rank"
    ))?;
    assert_eq!(launches.len(), RANKS as usize, "one launch receipt per rank: {launches:?}");
    let mut hashed_flag = None;
    for (rank, row) in launches.iter().enumerate() {
        assert_eq!((row[0].as_str(), row[1].as_str()), (rank.to_string().as_str(), "1"), "rank, schema");
        assert_eq!(row[2], torch, "rank {rank}: the torch .venv runs, read at run time");
        // The job's env overlay, and only it: names kept, values as the controller's keyed
        // hash (never stored; equal values compare equal).
        let env: BTreeMap<String, String> =
            serde_json::from_str(&row[3]).context("env of the launch receipt")?;
        assert_eq!(env.keys().collect::<Vec<_>>(), ["PYTHONPATH", "TRAINYARD_DEMO_FLAG"], "rank {rank}");
        for (name, value) in &env {
            assert!(value.starts_with("hmac-sha256:") && value.len() == 44, "rank {rank}: {name}={value}");
        }
        assert_ne!(env["TRAINYARD_DEMO_FLAG"], env["PYTHONPATH"]);
        let flag = hashed_flag.get_or_insert_with(|| env["TRAINYARD_DEMO_FLAG"].clone());
        assert_eq!(&env["TRAINYARD_DEMO_FLAG"], flag, "rank {rank}: one value, one hash");
        assert_eq!(row[4], RANKS.to_string(), "rank {rank}: world_size");
        match &head {
            // json_extract gives a JSON false as 0.
            Some(head) => {
                assert_eq!((&row[5], row[6].as_str()), (head, "0"), "rank {rank}: source_dir's git")
            }
            None => eprintln!("git is not installed: the source revision is not checked"),
        }
    }

    // Step receipts: every step of every rank, with the typed fields the helper computed.
    let counts = c.query(&format!(
        "SELECT rank, COUNT(*), COUNT(DISTINCT step), MIN(step), MAX(step) FROM step_metrics \
         WHERE job_id = {id} AND step_time_ms IS NOT NULL AND tokens_per_s IS NOT NULL AND loss IS NOT NULL \
         GROUP BY rank ORDER BY rank"
    ))?;
    let want: Vec<Vec<i64>> = (0..RANKS as i64).map(|r| vec![r, STEPS, STEPS, 0, STEPS - 1]).collect();
    assert_eq!(counts, want, "rank, steps with step_time_ms, tokens_per_s and loss, distinct, first, last");
    // The agent's bootstrap is on this rank's path too: it sees the helper and writes nothing.
    let all = c.query(&format!("SELECT COUNT(*) FROM receipts WHERE job_id = {id} AND kind = 'step'"))?;
    assert_eq!(all[0][0], RANKS as i64 * STEPS, "no second receipt for a step: {all:?}");
    let rates = c.query_text(&format!(
        "SELECT CAST(step_time_ms AS TEXT), CAST(tokens_per_s AS TEXT) FROM step_metrics WHERE job_id = {id}"
    ))?;
    for row in &rates {
        let (ms, rate): (f64, f64) = (row[0].parse()?, row[1].parse()?);
        ensure!(ms > 0.0, "a step time of {ms} ms");
        let tokens = rate * ms / 1000.0;
        ensure!(
            (tokens - JOB_TOKENS_PER_STEP).abs() < 1e-6 * JOB_TOKENS_PER_STEP,
            "tokens_per_s {rate} x step_time_ms {ms} is {tokens} tokens, not the job's {JOB_TOKENS_PER_STEP}"
        );
    }

    // Exit receipts, and nothing flagged.
    let exits = c.query_text(&format!(
        "SELECT CAST(rank AS TEXT), CAST(step AS TEXT), json_extract(body, '$.status'), \
                CAST(json_extract(body, '$.dropped_receipts_total') AS TEXT) \
         FROM receipts WHERE job_id = {id} AND kind = 'exit' AND {} ORDER BY rank",
        trainyard_tests::RANK_WRITTEN
    ))?;
    let want: Vec<Vec<String>> = (0..RANKS)
        .map(|r| vec![r.to_string(), (STEPS - 1).to_string(), "ok".to_string(), "0".to_string()])
        .collect();
    assert_eq!(exits, want, "rank, step, status, dropped_receipts_total");
    let problems = c.query_text(&format!(
        "SELECT kind, problem FROM receipts WHERE job_id = {id} AND problem IS NOT NULL"
    ))?;
    assert!(problems.is_empty(), "receipts breaking schema v1: {problems:?}");
    let flagged = c.query(&format!("SELECT COUNT(*) FROM receipt_problems WHERE job_id = {id}"))?;
    assert_eq!(flagged, vec![vec![0]], "no row in receipt_problems for job {id}");

    // The same script under torchrun, the launcher it was written for: each rank writes its own
    // file from the path template, and the script finds the helper in the checkout by itself.
    let reference = c.path("receipts-torchrun");
    std::fs::create_dir_all(&reference)?;
    let out = Command::new(repo_root().join(".venv/bin/torchrun"))
        .args(["--standalone", "--nproc-per-node", &RANKS.to_string(), &script_path, "--steps", &steps])
        .current_dir(&reference)
        .env("TRAINYARD_RECEIPTS", reference.join("receipts-{rank}.jsonl"))
        .env_remove("OMP_NUM_THREADS")
        .env_remove("PYTHONPATH")
        .output()
        .context("run torchrun")?;
    ensure!(out.status.success(), "torchrun: {}", String::from_utf8_lossy(&out.stderr));
    for rank in 0..RANKS {
        let receipts = read_receipts(&reference.join(format!("receipts-{rank}.jsonl")))?;
        let kinds: Vec<&str> = receipts.iter().filter_map(|r| r["kind"].as_str()).collect();
        let mut want = vec!["launch"];
        want.extend(std::iter::repeat_n("step", STEPS as usize));
        want.push("exit");
        assert_eq!(kinds, want, "rank {rank} under torchrun");
        assert_eq!(receipts[0]["torch"], torch.as_str(), "rank {rank} under torchrun");
        assert!(receipts.iter().all(|r| r["schema"] == 1), "rank {rank}: schema 1 throughout");
    }
    Ok(())
}

/// The helper's own unit tests (python/tests), with .venv's python (torch present) and with the
/// system's python3 (no torch: every CUDA and torch read must be guarded).
#[test]
fn the_helpers_unit_tests_pass_with_and_without_torch() -> anyhow::Result<()> {
    for interpreter in [venv_python(), PathBuf::from("python3")] {
        let out = Command::new(&interpreter)
            .args(["-m", "unittest", "discover", "-s"])
            .arg(repo_root().join("python/tests"))
            .env("PYTHONPATH", repo_root().join("python"))
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .output()
            .with_context(|| format!("run {}", interpreter.display()))?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        ensure!(out.status.success(), "{}: {stderr}", interpreter.display());
        ensure!(stderr.contains("OK"), "{}: {stderr}", interpreter.display());
    }
    Ok(())
}
