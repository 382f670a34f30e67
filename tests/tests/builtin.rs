//! The built-in engine through the whole system: `ctl submit` of a `builtin` job, the agent
//! running `trainyard-engine` once per rank (two CPU ranks over the TCP collectives), receipts in
//! SQLite; and a rank killed mid-run, restarted by the job's restart policy, resuming from its
//! last checkpoint with the same losses as an uninterrupted run.
//!
//! Takes ~30-60 s on 2 cores (two short d4 runs).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use trainyard_tests::{Cluster, bin, repo_root};

const STEPS: i64 = 24;

/// Tokenizes the corpus shipped with the engine into compact shards; returns (dir, vocab size).
fn shards(c: &Cluster) -> anyhow::Result<(PathBuf, u64)> {
    let out = c.path("shards");
    let corpus: Vec<PathBuf> = std::fs::read_dir(repo_root().join("engine/corpus"))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "txt"))
        .collect();
    ensure!(!corpus.is_empty(), "no corpus under engine/corpus");
    let status = Command::new(bin("trainyard-engine")?)
        .args(["tokenize", "--compact", "--out"])
        .arg(&out)
        .args(&corpus)
        .status()
        .context("run trainyard-engine tokenize")?;
    ensure!(status.success(), "tokenize failed");
    let vocab: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("vocab.json"))?)?;
    let size = vocab["vocab_size"].as_u64().context("vocab_size in vocab.json")?;
    Ok((out, size))
}

fn job(c: &Cluster, name: &str, data: &Path, vocab: u64, checkpoints: &Path) -> PathBuf {
    let text = format!(
        "name = {name:?}\n\n[resources]\ngpus = 2\n\n[engine]\nkind = \"builtin\"\npreset = \"d4\"\ndata = {:?}\n\n\
         [engine.settings]\nseq_len = \"32\"\ndevice_batch_size = \"2\"\nnum_iterations = \"{STEPS}\"\n\
         warmup_steps = \"2\"\nvocab_size = \"{vocab}\"\nlr_scale = \"1\"\nthreads = \"1\"\ndevice = \"cpu\"\n\
         checkpoint_every = \"4\"\ncheckpoint_dir = {:?}\n\n[restart]\nmax_restarts = 1\nresume = true\n",
        data.display().to_string(),
        checkpoints.display().to_string(),
    );
    let path = c.path(&format!("{name}.toml"));
    std::fs::write(&path, text).expect("write job file");
    path
}

/// Step -> loss of rank 0's step receipts of one attempt.
fn losses(c: &Cluster, job: u64, attempt: u32) -> anyhow::Result<BTreeMap<i64, String>> {
    let rows = c.query_text(&format!(
        "SELECT CAST(step AS TEXT), CAST(json_extract(body, '$.loss') AS TEXT) FROM receipts \
         WHERE job_id = {job} AND attempt = {attempt} AND rank = 0 AND kind = 'step' ORDER BY step"
    ))?;
    rows.into_iter().map(|r| Ok((r[0].parse()?, r[1].clone()))).collect()
}

#[test]
fn builtin_job_trains_and_resumes_after_a_killed_rank() -> anyhow::Result<()> {
    let mut c = Cluster::start()?;
    c.start_agent("node-a", 2)?;
    let (data, vocab) = shards(&c)?;

    // An uninterrupted run: both ranks' receipts arrive through the agent.
    let reference = c.submit(&job(&c, "reference", &data, vocab, &c.path("ckpt-reference")))?;
    let status = c.wait_state(reference, &["succeeded", "failed"], Duration::from_secs(240))?;
    ensure!(status["state"] == "succeeded", "{status}\n{}", c.logs("agent-node-a"));
    let per_rank = c.query(&format!(
        "SELECT rank, SUM(kind = 'launch'), SUM(kind = 'step'), SUM(kind = 'checkpoint') FROM receipts \
         WHERE job_id = {reference} GROUP BY rank ORDER BY rank"
    ))?;
    assert_eq!(per_rank.len(), 2, "{per_rank:?}");
    for row in &per_rank {
        assert_eq!(row[1], 1, "one launch receipt per rank: {per_rank:?}");
        assert_eq!(row[2], STEPS, "a step receipt per step per rank: {per_rank:?}");
        assert!(row[3] >= 1, "checkpoints recorded: {per_rank:?}");
    }
    // The engine writes receipt schema v1: nothing flagged, every step's typed fields stored, and
    // the operator view answers for a built-in job.
    let flagged = c.query(&format!(
        "SELECT COUNT(*) FROM receipts WHERE job_id = {reference} AND problem IS NOT NULL"
    ))?;
    assert_eq!(
        flagged[0][0],
        0,
        "{:?}",
        c.query_text(&format!(
            "SELECT problem FROM receipts WHERE job_id = {reference} AND problem IS NOT NULL LIMIT 3"
        ))
    );
    let typed = c.query(&format!(
        "SELECT COUNT(*), COUNT(step_time_ms), COUNT(optimizer_ms), COUNT(tokens_per_s) FROM step_metrics WHERE job_id = {reference}"
    ))?;
    assert_eq!(typed[0], vec![2 * STEPS; 4], "typed step fields");
    let summary = c.query(&format!("SELECT step_receipts, CAST(mean_step_time_ms > 0 AS INTEGER) FROM step_time_summary WHERE job_id = {reference}"))?;
    assert_eq!(summary, vec![vec![2 * STEPS, 1]]);
    let launch = c.query_text(&format!(
        "SELECT json_extract(body, '$.env.TRAINYARD_PREFLIGHT_REPORT'), json_extract(body, '$.binding.cpus_allowed'), \
                json_extract(body, '$.env.WORLD_SIZE'), json_extract(body, '$.torch') FROM receipts \
         WHERE job_id = {reference} AND kind = 'launch' AND rank = 1"
    ))?;
    // The torch version is read at run time from the libtorch the engine loaded: the wheel's.
    let wheel = Command::new(repo_root().join(".venv/bin/python"))
        .args(["-c", "import torch; print(torch.__version__)"])
        .output()?;
    assert_eq!(launch[0][3], String::from_utf8_lossy(&wheel.stdout).trim(), "launch receipt: {launch:?}");
    assert!(launch[0][0].starts_with("node-a-"), "launch receipt names its preflight report: {launch:?}");
    assert!(!launch[0][1].is_empty(), "launch receipt records the CPU binding it got: {launch:?}");
    assert_eq!(launch[0][2], "2");
    let expected = losses(&c, reference, 0)?;

    // The same run, with rank 1 killed mid-run: the restart resumes from the last checkpoint.
    let victim = c.submit(&job(&c, "victim", &data, vocab, &c.path("ckpt-victim")))?;
    let deadline = Instant::now() + Duration::from_secs(240);
    let pid = loop {
        let status = c.status(victim)?;
        let stepped = c.query(&format!(
            "SELECT COALESCE(MAX(step), -1) FROM receipts WHERE job_id = {victim} AND kind = 'step'"
        ))?[0][0];
        if stepped >= 6 {
            let pid = status["ranks"][1]["pid"].as_u64().context("rank 1 pid")?;
            break pid;
        }
        if Instant::now() > deadline || status["state"] != "running" && stepped >= 0 {
            bail!("victim never reached step 6 while running: {status}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    // SAFETY: kill(2) on the pid the agent reported for rank 1.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    let status = c.wait_state(victim, &["succeeded", "failed"], Duration::from_secs(240))?;
    ensure!(status["state"] == "succeeded", "{status}\n{}", c.logs("agent-node-a"));
    assert_eq!(status["attempt"], 1, "{status}");

    let resumed = losses(&c, victim, 1)?;
    let first = *resumed.keys().next().context("attempt 1 wrote step receipts")?;
    let checkpoints = c.query(&format!(
        "SELECT DISTINCT step FROM receipts WHERE job_id = {victim} AND attempt = 0 AND kind = 'checkpoint'"
    ))?;
    assert!(
        first > 0 && checkpoints.iter().any(|r| r[0] + 1 == first),
        "attempt 1 starts right after a checkpoint of attempt 0, not from scratch: step {first}, \
         checkpoints {checkpoints:?}"
    );
    assert_eq!(resumed.keys().last(), Some(&STEPS), "steps count from 1");
    for (step, loss) in &resumed {
        assert_eq!(
            Some(loss),
            expected.get(step),
            "step {step}: resumed loss differs from the uninterrupted run"
        );
    }
    Ok(())
}

/// A drain of a node running a built-in job: the engine's ranks agree on the request, write a
/// checkpoint, take no further step, and the job moves to the other node and resumes right after
/// that checkpoint.
#[test]
fn builtin_job_checkpoints_when_its_node_is_drained_and_moves() -> anyhow::Result<()> {
    let mut c = Cluster::start()?;
    c.start_agent("node-a", 2)?;
    let (data, vocab) = shards(&c)?;
    let checkpoints = c.path("ckpt-drain");
    let text = std::fs::read_to_string(job(&c, "drained", &data, vocab, &checkpoints))?
        .replace(&format!("num_iterations = \"{STEPS}\""), "num_iterations = \"100000\"")
        .replace("checkpoint_every = \"4\"", "checkpoint_every = \"100000\"");
    let file = c.path("drained-long.toml");
    std::fs::write(&file, text)?;
    let id = c.submit(&file)?;
    c.wait_first_steps(id, 2, Duration::from_secs(120))?;
    c.start_agent("node-b", 2)?;
    c.ctl_ok(&["drain", "node-a", "--deadline", "120s"])?;
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        let status = c.status(id)?;
        if status["attempt"] == 1 && status["state"] == "running" {
            break status;
        }
        ensure!(Instant::now() < deadline, "the job did not move: {status}");
        std::thread::sleep(Duration::from_millis(200));
    };
    let f = &status["failures"][0];
    assert_eq!(f["kind"], "drain", "{status}");
    assert!(f["evidence"].as_str().unwrap_or("").contains("every rank checkpointed at step"), "{f}");
    let q = |sql: String| -> anyhow::Result<i64> { Ok(c.query(&sql)?[0][0]) };
    let saved = q(format!(
        "SELECT MAX(step) FROM receipts WHERE job_id = {id} AND attempt = 0 AND kind = 'checkpoint'"
    ))?;
    let last =
        q(format!("SELECT MAX(step) FROM receipts WHERE job_id = {id} AND attempt = 0 AND kind = 'step'"))?;
    assert_eq!(last, saved, "no step after the requested checkpoint");
    let deadline = Instant::now() + Duration::from_secs(120);
    while q(format!("SELECT COUNT(*) FROM receipts WHERE job_id = {id} AND attempt = 1 AND kind = 'step'"))?
        == 0
    {
        ensure!(Instant::now() < deadline, "attempt 1 never stepped");
        std::thread::sleep(Duration::from_millis(200));
    }
    let first =
        q(format!("SELECT MIN(step) FROM receipts WHERE job_id = {id} AND attempt = 1 AND kind = 'step'"))?;
    assert_eq!(first, saved + 1, "attempt 1 resumes right after the drain's checkpoint");
    c.ctl_ok(&["cancel", &id.to_string()])?;
    Ok(())
}
