//! Real scripts written by others, run unchanged as `exec` jobs: the DDP tutorial scripts of
//! pytorch/examples (tests/fixtures/scripts/pytorch-examples, with only the changes a CPU run
//! needs) and a PyTorch Lightning `Trainer(strategy="ddp")` script, each on 2 ranks on one
//! agent and 4 ranks over two agents (gloo on CPU); and the variables a rank gets compared
//! with what `torchrun` gives its workers. Uses the torch and lightning that deploy/setup.sh
//! installs into .venv.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, ensure};
use trainyard_tests::{Cluster, PythonJob, fixture_scripts, repo_root};

/// An exec job of `gpus` ranks (`per_node` per host) running `args` with .venv's python in
/// `workdir`, with the given `[env]` overlay.
fn job(
    c: &Cluster,
    name: &str,
    (gpus, per_node): (u32, u32),
    workdir: &Path,
    args: &[&str],
    env: &[(&str, &str)],
) -> PathBuf {
    c.python_job(&PythonJob { name, gpus, per_node, workdir, source_dir: None, args, env })
}

/// Runs `script ARGS` under `torchrun --standalone --nproc-per-node N` in `dir`: the reference
/// launcher, for the same scripts the jobs run.
fn under_torchrun(dir: &Path, nproc: u32, script: &str, args: &[&str]) -> anyhow::Result<()> {
    let out = std::process::Command::new(repo_root().join(".venv/bin/torchrun"))
        .args(["--standalone", "--nproc-per-node", &nproc.to_string(), script])
        .args(args)
        .current_dir(dir)
        .env_remove("OMP_NUM_THREADS")
        .output()
        .context("run torchrun")?;
    ensure!(out.status.success(), "torchrun {script}: {}", String::from_utf8_lossy(&out.stderr));
    Ok(())
}

fn run_to_success(c: &Cluster, file: &Path) -> anyhow::Result<u64> {
    let id = c.submit(file)?;
    let status = c.wait_state(id, &["succeeded", "failed", "cancelled"], Duration::from_secs(240))?;
    ensure!(status["state"] == "succeeded", "job {id}: {status}\n{}", c.logs("agent-a"));
    Ok(id)
}

/// A copy of the pytorch/examples DDP scripts in `dir` with exactly the changes a CPU needs;
/// each change must apply, so a change upstream shows here.
fn cpu_copy(dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    let src = fixture_scripts().join("pytorch-examples");
    std::fs::copy(src.join("datautils.py"), dir.join("datautils.py"))?;
    for (name, device) in [("multigpu_torchrun.py", "self.gpu_id"), ("multinode.py", "self.local_rank")] {
        let mut text = std::fs::read_to_string(src.join(name))?;
        let to_device = format!(".to({device})");
        let device_ids = format!("device_ids=[{device}]");
        for (from, to) in [
            ("init_process_group(backend=\"nccl\")", "init_process_group(backend=\"gloo\")"),
            ("torch.cuda.set_device(int(os.environ[\"LOCAL_RANK\"]))", "pass"),
            (to_device.as_str(), ".to(\"cpu\")"),
            (device_ids.as_str(), "device_ids=None"),
        ] {
            ensure!(text.contains(from), "{name} no longer contains {from:?}");
            text = text.replace(from, to);
        }
        std::fs::write(dir.join(name), text)?;
    }
    Ok(())
}

#[test]
fn pytorch_examples_ddp_scripts_run_on_one_and_two_agents() -> anyhow::Result<()> {
    let mut c = Cluster::start()?;
    c.start_agent("a", 2)?;
    c.start_agent("b", 2)?;
    let one = c.path("ddp-one");
    let two = c.path("ddp-two");
    cpu_copy(&one)?;
    cpu_copy(&two)?;
    // total_epochs 3, save_every 1 (the scripts' positional arguments).
    let single = job(&c, "ddp-single-node", (2, 2), &one, &["multigpu_torchrun.py", "3", "1"], &[]);
    let multi = job(&c, "ddp-multinode", (4, 2), &two, &["multinode.py", "3", "1"], &[]);
    let (a, b) = (c.submit(&single)?, c.submit(&multi)?);
    for id in [a, b] {
        let status = c.wait_state(id, &["succeeded", "failed", "cancelled"], Duration::from_secs(240))?;
        ensure!(
            status["state"] == "succeeded",
            "job {id}: {status}\n{}\n{}",
            c.logs("agent-a"),
            c.logs("agent-b")
        );
    }
    let nodes = c.query_text(&format!(
        "SELECT DISTINCT agent_id FROM allocations WHERE job_id = {b} ORDER BY agent_id"
    ))?;
    assert_eq!(nodes.len(), 2, "the multinode job spans both agents: {nodes:?}");
    for dir in [&one, &two] {
        assert!(dir.join("snapshot.pt").is_file(), "rank 0 saved its snapshot in {}", dir.display());
    }
    // The same script under torchrun, the launcher it was written for.
    let reference = c.path("ddp-torchrun");
    cpu_copy(&reference)?;
    under_torchrun(&reference, 2, "multigpu_torchrun.py", &["3", "1"])?;
    assert!(reference.join("snapshot.pt").is_file(), "under torchrun too");
    Ok(())
}

#[test]
fn lightning_ddp_runs_on_one_and_two_agents() -> anyhow::Result<()> {
    let mut c = Cluster::start()?;
    c.start_agent("a", 2)?;
    c.start_agent("b", 2)?;
    let work = c.path("lightning");
    std::fs::create_dir_all(&work)?;
    let script = fixture_scripts().join("lightning_ddp.py").display().to_string();
    let cases = [(2u32, 1u32), (4, 2)];
    for (gpus, nodes) in cases {
        let file = job(
            &c,
            &format!("lightning-{gpus}"),
            (gpus, 2),
            &work,
            &[&script, "--devices", "2", "--num-nodes", &nodes.to_string()],
            &[],
        );
        let id = run_to_success(&c, &file)?;
        let rows = c.query_text(&format!(
            "SELECT CAST(rank AS TEXT), CAST(json_extract(body, '$.global_rank') AS TEXT), \
                    CAST(json_extract(body, '$.world_size') AS TEXT), CAST(json_extract(body, '$.node_rank') AS TEXT), \
                    CAST(json_extract(body, '$.local_rank') AS TEXT), json_extract(body, '$.cluster_environment') \
             FROM receipts WHERE job_id = {id} AND kind = 'lightning' ORDER BY rank"
        ))?;
        assert_eq!(rows.len(), gpus as usize, "one record per rank: {rows:?}");
        for row in &rows {
            let rank: u32 = row[0].parse()?;
            let want = [
                rank.to_string(),
                rank.to_string(),
                gpus.to_string(),
                (rank / 2).to_string(),
                (rank % 2).to_string(),
                "TorchElasticEnvironment".to_string(),
            ];
            assert_eq!(row, &want, "Lightning's view of rank {rank} (rank, global, world, node, local, env)");
        }
    }
    // The same script under torchrun, the launcher it was written for.
    under_torchrun(&work, 2, &script, &["--devices", "2", "--num-nodes", "1"])?;
    Ok(())
}

fn read_dump(path: &Path) -> anyhow::Result<BTreeMap<String, String>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
    Ok(serde_json::from_str(&text)?)
}

/// The same script under `torchrun --nproc-per-node 2` and as a 2-rank trainyard job sees the
/// same variables with the same values, except where the launchers differ by design: the
/// rendezvous address and port, the run id, and whether the launcher hosts the TCP store.
#[test]
fn ranks_get_the_variables_torchrun_gives_its_workers() -> anyhow::Result<()> {
    let mut c = Cluster::start()?;
    c.start_agent("a", 2)?;
    let script = fixture_scripts().join("env_dump.py");
    let under_torchrun = c.path("torchrun");
    let under_trainyard = c.path("trainyard");
    std::fs::create_dir_all(&under_torchrun)?;
    std::fs::create_dir_all(&under_trainyard)?;
    let out = std::process::Command::new(repo_root().join(".venv/bin/torchrun"))
        .args(["--standalone", "--nproc-per-node", "2"])
        .arg(&script)
        .env("ENV_DUMP_DIR", &under_torchrun)
        .env_remove("OMP_NUM_THREADS")
        .output()
        .context("run torchrun")?;
    ensure!(out.status.success(), "torchrun: {}", String::from_utf8_lossy(&out.stderr));
    let dir = under_trainyard.display().to_string();
    let file =
        job(&c, "env", (2, 2), &under_trainyard, &[&script.display().to_string()], &[("ENV_DUMP_DIR", &dir)]);
    run_to_success(&c, &file)?;
    for rank in 0..2 {
        let theirs = read_dump(&under_torchrun.join(format!("env-{rank}.json")))?;
        let ours = read_dump(&under_trainyard.join(format!("env-{rank}.json")))?;
        assert_eq!(
            ours.keys().collect::<Vec<_>>(),
            theirs.keys().collect::<Vec<_>>(),
            "rank {rank}: the same variable names"
        );
        for (name, value) in &theirs {
            let by_design =
                ["MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE"];
            if !by_design.contains(&name.as_str()) {
                assert_eq!(ours.get(name), Some(value), "rank {rank}: {name}");
            }
        }
    }
    Ok(())
}
