//! trainyard jobs on a real Slurm cluster (tests/src/slurm.rs: munged, slurmctld, one slurmd per
//! network-namespace host): `ctl submit --slurm` as an unprivileged user asks Slurm for the
//! nodes, one agent per node joins for that job alone, the ranks meet across the hosts, every
//! rank's receipts are stored, and the allocation ends with the job. Cancelling either way
//! (`ctl cancel`, `scancel`) ends the job as cancelled. Needs root (namespaces, slurmd): elsewhere
//! each test prints `skipped: ...`; under `CI` it fails instead.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use trainyard_tests::slurm::{SlurmLab, text};
use trainyard_tests::{Cluster, bin, host_file, run_account};

/// A lab of `hosts` namespace hosts with a controller and a Slurm cluster of one fake GPU each.
fn start(hosts: usize) -> Result<Option<(Cluster, SlurmLab)>> {
    if !trainyard_tests::slurm::installed() {
        return Ok(None);
    }
    let Some(c) = Cluster::start_lab(hosts, &[])? else { return Ok(None) };
    let slurm = prepare(&c)?;
    Ok(Some((c, slurm)))
}

/// The Slurm cluster on `c`'s lab; the user's home (where ctl keeps the batch scripts, and the
/// controller's CA on a TLS cluster) and a host description the agents read.
fn prepare(c: &Cluster) -> Result<SlurmLab> {
    let slurm = SlurmLab::start(c.lab(), c.dir.path(), 1, "KillWait=5")?;
    let home = c.path("home");
    std::fs::create_dir_all(&home)?;
    chown(&home)?;
    if let Some(ca) = c.ca() {
        std::fs::copy(ca, home.join("ca.pem"))?;
    }
    host_file(c.dir.path(), "slurm-node", 1);
    Ok(slurm)
}

fn chown(path: &Path) -> Result<()> {
    let status = Command::new("chown").arg(run_account()).arg(path).status()?;
    ensure!(status.success(), "chown {}", path.display());
    Ok(())
}

/// `ctl ARGS` as the job's user, with the cluster's token and Slurm's configuration.
fn ctl_as_user(c: &Cluster, slurm: &SlurmLab, args: &[&str]) -> Result<Output> {
    let mut env = vec![
        ("HOME", c.path("home").display().to_string()),
        ("TRAINYARD_TOKEN", c.token.clone().unwrap_or_default()),
    ];
    if c.ca().is_some() {
        env.push(("TRAINYARD_CA", c.path("home/ca.pem").display().to_string()));
    }
    let mut command = slurm.as_user(&bin("ctl")?, &env);
    Ok(command.arg("--controller").arg(c.url()).args(args).output()?)
}

/// Submits `file` with `ctl submit --slurm`; returns the trainyard job and the Slurm job.
fn submit(c: &Cluster, slurm: &SlurmLab, file: &Path) -> Result<(u64, u64)> {
    let host_file = format!("--agent-arg=--host-file={}", c.path("slurm-node.json").display());
    let file = file.display().to_string();
    let out =
        ctl_as_user(c, slurm, &["submit", &file, "--slurm", &host_file, "--agent-arg=--telemetry=off"])?;
    ensure!(out.status.success(), "ctl submit --slurm failed: {}\n{}", text(&out), slurm.logs());
    let job: u64 = String::from_utf8_lossy(&out.stdout).trim().parse()?;
    let status = c.status(job)?;
    let slurm_id = status["slurm_job_id"].as_u64().unwrap_or(0);
    ensure!(slurm_id > 0, "the job records its Slurm job: {status}");
    Ok((job, slurm_id))
}

/// A job file of `gpus` ranks, one per node, running the stand-in rank with `args`, and `[slurm]`.
fn job_file(c: &Cluster, name: &str, gpus: u32, args: &[&str], slurm: &str) -> PathBuf {
    c.job_file(name, gpus, 1, args, &format!("[slurm]\npartition = \"debug\"\n{slurm}\n"))
}

/// What the batch script of `job` (Slurm job `slurm_id`) printed: the agents' logs.
fn batch_output(c: &Cluster, job: u64, slurm_id: u64) -> String {
    let path = c.path(&format!("home/.trainyard/slurm/job-{job}-slurm-{slurm_id}.out"));
    std::fs::read_to_string(path).unwrap_or_else(|e| format!("(no batch output: {e})"))
}

/// Waits until `job` runs; the error carries what Slurm says of its allocation.
fn running(c: &Cluster, slurm: &SlurmLab, job: u64, slurm_id: u64) -> Result<()> {
    c.wait_state(job, &["running"], Duration::from_secs(60)).map(|_| ()).map_err(|e| {
        let queue = slurm.run("squeue", &["-o", "%i %T %r %N"]).unwrap_or_default();
        e.context(format!(
            "squeue:\n{queue}\nbatch output:\n{}\n{}",
            batch_output(c, job, slurm_id),
            slurm.logs()
        ))
    })
}

fn wait_until(what: &str, timeout: Duration, mut done: impl FnMut() -> Result<bool>) -> Result<()> {
    let deadline = Instant::now() + timeout;
    while !done()? {
        ensure!(Instant::now() < deadline, "{what}: not within {timeout:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
    Ok(())
}

#[test]
fn a_two_node_allocation_runs_the_job_stores_every_ranks_receipts_and_ends_with_it() -> Result<()> {
    let Some((c, slurm)) = start(2)? else { return Ok(()) };
    let file = job_file(
        &c,
        "on-slurm",
        2,
        &["--steps", "20", "--step-ms", "20", "--collective"],
        "time_limit = \"10\"",
    );
    let (job, slurm_id) = submit(&c, &slurm, &file)?;
    let status = c.wait_state(job, &["succeeded", "failed", "cancelled"], Duration::from_secs(90))?;
    ensure!(status["state"] == "succeeded", "{status}\n{}", slurm.logs());
    // Each rank ran on its own node's agent, which joined for this job alone.
    let mut agents: Vec<String> = status["ranks"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|r| r["agent_id"].as_str().unwrap_or("").to_string())
        .collect();
    agents.sort();
    assert_eq!(agents, vec![format!("j{job}-n0"), format!("j{job}-n1")], "{status}");
    let steps = c.query(&format!(
        "SELECT rank, COUNT(*) FROM receipts WHERE job_id = {job} AND kind = 'step' GROUP BY rank"
    ))?;
    assert_eq!(steps, vec![vec![0, 20], vec![1, 20]], "every step of both ranks is stored");
    // The agents were dismissed when the job ended: their step ended, and so did the allocation.
    let line = slurm.wait_completed(slurm_id, Duration::from_secs(30))?;
    assert!(line.contains("JobState=COMPLETED"), "{line}");
    assert!(line.contains(&format!("UserId={}", run_account())), "the Slurm job is the user's: {line}");
    assert!(line.contains("NodeCnt=2"), "{line}");
    Ok(())
}

#[test]
fn ctl_cancel_and_scancel_each_end_the_job_as_cancelled() -> Result<()> {
    let Some((c, slurm)) = start(2)? else { return Ok(()) };
    let long = ["--steps", "100000", "--step-ms", "50"];
    // `ctl cancel`: the trainyard job is cancelled and the Slurm job with it.
    let (job, slurm_id) = submit(&c, &slurm, &job_file(&c, "cancel-ctl", 2, &long, ""))?;
    running(&c, &slurm, job, slurm_id)?;
    let out = ctl_as_user(&c, &slurm, &["cancel", &job.to_string()])?;
    ensure!(out.status.success(), "{}", text(&out));
    let status = c.wait_state(job, &["cancelled", "failed", "succeeded"], Duration::from_secs(30))?;
    assert_eq!(status["state"], "cancelled", "{status}");
    let line = slurm.wait_completed(slurm_id, Duration::from_secs(30))?;
    assert!(line.contains("JobState=CANCELLED") || line.contains("JobState=COMPLETED"), "{line}");
    // `scancel` by the user: the agents see Slurm cancel the job and say so.
    let (job, slurm_id) = submit(&c, &slurm, &job_file(&c, "cancel-slurm", 2, &long, ""))?;
    running(&c, &slurm, job, slurm_id)?;
    let out = slurm.as_user(Path::new("scancel"), &[]).arg(slurm_id.to_string()).output()?;
    ensure!(out.status.success(), "scancel: {}", text(&out));
    let status =
        c.wait_state(job, &["cancelled", "failed", "succeeded", "pending"], Duration::from_secs(30))?;
    assert_eq!(status["state"], "cancelled", "{status}\n{}", batch_output(&c, job, slurm_id));
    assert!(status["reason"].as_str().unwrap_or("").contains("scancel"), "{status}");
    let failures = c.query(&format!("SELECT COUNT(*) FROM failures WHERE job_id = {job}"))?;
    assert_eq!(failures[0][0], 0, "a cancel blames no node");
    slurm.wait_completed(slurm_id, Duration::from_secs(30))?;
    Ok(())
}

#[test]
fn what_slurm_refuses_and_waits_for_is_said_in_slurms_words() -> Result<()> {
    let Some((c, slurm)) = start(2)? else { return Ok(()) };
    // A partition Slurm does not have (given on the command line, over the table's): the submit
    // fails with sbatch's own message, the job is cancelled.
    let file = c.job_file("no-partition", 2, 1, &["--steps", "2"], "[slurm]\npartition = \"debug\"\n");
    let host_file = format!("--agent-arg=--host-file={}", c.path("slurm-node.json").display());
    let args = ["submit", &file.display().to_string(), "--slurm", &host_file, "--partition", "nosuch"];
    let out = ctl_as_user(&c, &slurm, &args)?;
    assert!(!out.status.success());
    let said = text(&out);
    assert!(said.contains("sbatch refused the allocation") && said.contains("invalid partition"), "{said}");
    // A machine without sbatch: named.
    let mut bare = Command::new(bin("ctl")?);
    bare.env("PATH", "/nonexistent").env("TRAINYARD_TOKEN", c.token.clone().unwrap_or_default());
    let out =
        bare.args(["--controller", &c.url(), "submit", &file.display().to_string(), "--slurm"]).output()?;
    assert!(text(&out).contains("sbatch is not on PATH"), "{}", text(&out));
    // Nodes held by another Slurm job: the job waits, and `ctl status` gives Slurm's reason.
    let blocker = slurm
        .run("sbatch", &["--parsable", "-N2", "--exclusive", "--wrap", "sleep 300", "-o", "/dev/null"])?;
    let blocker = blocker.trim().to_string();
    wait_until("the blocker runs", Duration::from_secs(30), || {
        Ok(slurm.state(blocker.parse()?).as_deref() == Some("RUNNING"))
    })?;
    let (job, slurm_id) = submit(&c, &slurm, &job_file(&c, "waits", 2, &["--steps", "2"], ""))?;
    let mut said = String::new();
    let want = format!("slurm: job {slurm_id} PENDING (Resources)");
    wait_until("Slurm's reason in ctl status", Duration::from_secs(30), || {
        said = text(&ctl_as_user(&c, &slurm, &["status", &job.to_string()])?);
        Ok(said.contains(&want))
    })
    .map_err(|e| e.context(said.clone()))?;
    let status = c.status(job)?;
    assert!(
        status["waiting_reason"].as_str().unwrap_or("").contains("waiting for its Slurm allocation"),
        "{status}"
    );
    slurm.run("scancel", &[&blocker])?;
    let status = c.wait_state(job, &["succeeded", "failed", "cancelled"], Duration::from_secs(90))?;
    ensure!(status["state"] == "succeeded", "{status}\n{}", slurm.logs());
    Ok(())
}

#[test]
fn the_time_limit_warning_checkpoints_and_the_requeued_allocation_resumes_from_it() -> Result<()> {
    let Some((c, slurm)) = start(2)? else { return Ok(()) };
    let ckpt = c.path("ckpt");
    std::fs::create_dir_all(&ckpt)?;
    chown(&ckpt)?;
    let ckpt = ckpt.display().to_string();
    // The ranks meet every step (across the two hosts), so a checkpoint asked of both is taken
    // at one step; they would run for hours, longer than any allocation.
    let args = ["--steps", "100000", "--step-ms", "50", "--collective", "--checkpoint-dir", &ckpt];
    // A one-minute limit, warned 30 s ahead (Slurm checks limits every few tens of seconds and may
    // warn early): the warning comes within the first allocation.
    let table = "time_limit = \"1\"\nwarning_s = 30\nrequeue = true\n";
    let (job, slurm_id) = submit(&c, &slurm, &job_file(&c, "requeued", 2, &args, table))?;
    let deadline = Instant::now() + Duration::from_secs(150);
    let resumed = loop {
        let resumed = c.query(&format!(
            "SELECT CAST(json_extract(body, '$.env.TRAINYARD_RESUME_STEP') AS INTEGER) FROM receipts \
             WHERE job_id = {job} AND attempt = 1 AND kind = 'launch'"
        ))?;
        let steps = c.query(&format!(
            "SELECT COUNT(*) FROM receipts WHERE job_id = {job} AND attempt = 1 AND kind = 'step'"
        ))?;
        if resumed.len() == 2 && steps[0][0] > 0 {
            break resumed;
        }
        if Instant::now() >= deadline {
            let status = c.status(job)?;
            let job_line =
                slurm.run("scontrol", &["show", "job", "-o", &slurm_id.to_string()]).unwrap_or_default();
            anyhow::bail!(
                "attempt 1 of job {job} not running in a requeued allocation: {status}\nSlurm: {job_line}\n{}\n{}",
                batch_output(&c, job, slurm_id),
                slurm.logs()
            );
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    // The move was the time limit's: not charged against max_restarts (0), blamed on no node.
    let failures = c.query_text(&format!("SELECT kind, CAST(charged AS TEXT), CAST(blamed AS TEXT) FROM failures WHERE job_id = {job} AND attempt = 0"))?;
    assert_eq!(failures, vec![vec!["preemption".to_string(), "0".into(), "0".into()]], "{failures:?}");
    // Both ranks checkpointed at one step before the first allocation ended, and attempt 1, in
    // the requeued allocation's agents, resumed from it.
    let checkpoints = c.query(&format!(
        "SELECT step FROM receipts WHERE job_id = {job} AND attempt = 0 AND kind = 'checkpoint' \
         GROUP BY step HAVING COUNT(*) = 2 ORDER BY step DESC LIMIT 1"
    ))?;
    assert_eq!(checkpoints.len(), 1, "both ranks checkpointed before the first allocation ended");
    assert!(
        resumed.iter().all(|r| r[0] == checkpoints[0][0]),
        "resumed {resumed:?}, checkpointed {checkpoints:?}"
    );
    let agents = c.query_text(&format!(
        "SELECT DISTINCT agent_id FROM allocations WHERE job_id = {job} AND attempt = 1 ORDER BY agent_id"
    ))?;
    assert_eq!(
        agents,
        vec![vec![format!("j{job}-n0-r1")], vec![format!("j{job}-n1-r1")]],
        "the requeued allocation's agents"
    );
    let line = slurm.run("scontrol", &["show", "job", "-o", &slurm_id.to_string()])?;
    assert!(
        line.contains("Restarts=1 ") && line.contains("JobState=RUNNING"),
        "Slurm requeued the job once: {line}"
    );
    let out = ctl_as_user(&c, &slurm, &["cancel", &job.to_string()])?;
    ensure!(out.status.success(), "{}", text(&out));
    slurm.wait_completed(slurm_id, Duration::from_secs(30))?;
    Ok(())
}

/// Kills the processes it holds when dropped (a test's agents that are refused and keep trying).
struct Killed(Vec<std::process::Child>);

impl Drop for Killed {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Where agents are refused the controller needs no Slurm: `ctl submit --slurm` runs a stand-in
/// `sbatch` that answers a Slurm job id and starts nothing, and the agents are started by hand
/// with the environment an allocation would give them. A made-up token, another job's token and
/// a token of an ended job are each refused and audited; the job's own token is taken.
#[test]
fn an_agent_is_refused_and_audited_with_a_token_not_its_jobs_or_after_its_job_ended() -> Result<()> {
    let c = Cluster::start()?;
    let fake = c.path("fake-slurm");
    std::fs::create_dir_all(&fake)?;
    for (name, body) in [("sbatch", "echo 4242"), ("scancel", "exit 0"), ("squeue", "exit 0")] {
        let path = fake.join(name);
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n"))?;
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))?;
    }
    let path = format!("{}:{}", fake.display(), std::env::var("PATH").unwrap_or_default());
    let submit = |name: &str| -> Result<(u64, String)> {
        let file = job_file(&c, name, 2, &["--steps", "2"], "");
        let mut ctl = Command::new(bin("ctl")?);
        ctl.env("PATH", &path).env("HOME", c.path("home")).env_remove("TRAINYARD_TOKEN");
        if let Some(token) = &c.token {
            ctl.env("TRAINYARD_TOKEN", token);
        }
        let out = ctl
            .args(["--controller", &c.url(), "submit", &file.display().to_string(), "--slurm"])
            .output()?;
        ensure!(out.status.success(), "{}", text(&out));
        let job: u64 = String::from_utf8_lossy(&out.stdout).trim().parse()?;
        let script = std::fs::read_to_string(c.path(&format!("home/.trainyard/slurm/job-{job}.sh")))?;
        let token = script
            .lines()
            .find_map(|l| l.strip_prefix("export TRAINYARD_JOIN_TOKEN='"))
            .and_then(|t| t.strip_suffix('\''))
            .expect("the script holds the token")
            .to_string();
        Ok((job, token))
    };
    let (a, token_a) = submit("job-a")?;
    let (b, _) = submit("job-b")?;
    assert_eq!(c.status(a)?["slurm_job_id"], 4242, "ctl recorded the Slurm job sbatch answered");
    let host = host_file(c.dir.path(), "allocation-node", 1);
    let mut agents = Killed(Vec::new());
    let mut join = |job: u64, token: &str, node: &str| -> Result<()> {
        let child = Command::new(bin("trainyard-agent")?)
            .args(["--controller", &c.url(), "--slurm-job", &job.to_string(), "--telemetry", "off"])
            .arg("--host-file")
            .arg(&host)
            .arg("--data-dir")
            .arg(c.path(&format!("agent-{node}")))
            .env("TRAINYARD_JOIN_TOKEN", token)
            .env(trainyard_tests::DISK_FLOOR_PERCENT, "0")
            .env("SLURM_JOB_ID", "4242")
            .env("SLURMD_NODENAME", node)
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(c.path(&format!("{node}.log")))?)
            .spawn()?;
        agents.0.push(child);
        Ok(())
    };
    let refusals = || -> Result<Vec<String>> {
        let rows = c.query_text(
            "SELECT target, detail FROM audit_log WHERE action = 'agent.join' AND outcome = 'refused'",
        )?;
        Ok(rows.into_iter().map(|r| format!("{}: {}", r[0], r[1])).collect())
    };
    // Job A's token for an agent that says it is job B's: refused, audited.
    join(b, &token_a, "n0")?;
    // A token nobody made.
    join(a, &format!("tyj_{a}_{}", "0".repeat(64)), "n1")?;
    // Job A's own token: taken (bound to job A).
    join(a, &token_a, "n2")?;
    wait_until("two refusals audited", Duration::from_secs(20), || Ok(refusals()?.len() >= 2))?;
    let seen = refusals()?;
    assert!(
        seen.iter().any(|r| r.contains(&format!("node:j{b}-n0")) && r.contains(&format!("job {a}'s"))),
        "{seen:?}"
    );
    assert!(
        seen.iter()
            .any(|r| r.contains(&format!("node:j{a}-n1")) && r.contains("not made by this controller")),
        "{seen:?}"
    );
    wait_until("job A's agent joins", Duration::from_secs(20), || {
        Ok(c.ctl_ok(&["nodes", "-o", "json"])?.contains(&format!("j{a}-n2")))
    })?;
    // Job A ends; an agent that joins with its token afterwards is refused.
    c.ctl_ok(&["cancel", &a.to_string()])?;
    join(a, &token_a, "n3")?;
    wait_until("the late join audited", Duration::from_secs(20), || {
        Ok(refusals()?.iter().any(|r| r.contains(&format!("node:j{a}-n3")) && r.contains("has ended")))
    })?;
    // A refused agent of an allocation stops (so its Slurm step ends and the node is freed);
    // the agent that joined for job A was dismissed when A ended, and stopped too.
    wait_until("every agent stopped", Duration::from_secs(20), || {
        Ok(agents.0.iter_mut().all(|a| a.try_wait().is_ok_and(|s| s.is_some())))
    })?;
    Ok(())
}

/// A cluster, its Slurm lab, the job, its Slurm job, and the agent whose host died.
type KilledHost = (Cluster, SlurmLab, u64, u64, String);

/// A 3-host lab whose 2-rank job (ranks meeting every step, `table` in its `[slurm]`) runs,
/// then the host of rank 1 dies. `None` where the test cannot run here (it says skipped).
fn job_on_a_killed_host(name: &str, table: &str) -> Result<Option<KilledHost>> {
    if !trainyard_tests::slurm::installed() {
        return Ok(None);
    }
    let flags = [("--agent-timeout-secs", "8"), ("--cancel-grace-secs", "2")];
    let Some(c) = Cluster::start_lab(3, &flags)? else { return Ok(None) };
    let mut slurm = prepare(&c)?;
    // The survivor stalls when its peer's host dies, as training does.
    let args = ["--steps", "100000", "--step-ms", "50", "--collective"];
    let (job, slurm_id) = submit(&c, &slurm, &job_file(&c, name, 2, &args, table))?;
    running(&c, &slurm, job, slurm_id)?;
    let status = c.status(job)?;
    let victim = status["ranks"][1]["agent_id"].as_str().unwrap_or("").to_string();
    let host: usize = victim.rsplit('n').next().unwrap_or("").parse()?;
    slurm.kill_host(host)?;
    Ok(Some((c, slurm, job, slurm_id, victim)))
}

/// Waits until a later attempt of `job` runs; the error carries the job, Slurm's word and the
/// agents' output.
fn later_attempt_runs(
    c: &Cluster,
    slurm: &SlurmLab,
    (job, slurm_id): (u64, u64),
    what: &str,
    timeout: Duration,
) -> Result<()> {
    wait_until(what, timeout, || {
        let s = c.status(job)?;
        Ok(s["attempt"].as_u64().unwrap_or(0) >= 1 && s["state"] == "running")
    })
    .map_err(|e| {
        let status = c.status(job).map(|s| s.to_string()).unwrap_or_default();
        let line = slurm.run("scontrol", &["show", "job", "-o", &slurm_id.to_string()]).unwrap_or_default();
        let log = c.logs("controller");
        let tail: Vec<&str> = log.lines().rev().take(40).collect();
        e.context(format!(
            "{status}\nSlurm: {line}\n{}\ncontroller: {tail:#?}",
            batch_output(c, job, slurm_id)
        ))
    })
}

#[test]
fn a_killed_host_of_the_allocation_is_a_lost_host_and_the_job_moves_to_its_spare() -> Result<()> {
    // Two ranks on two of three nodes: one spare, so the allocation outlives a node (--no-kill).
    let Some((c, slurm, job, slurm_id, victim)) = job_on_a_killed_host("spare", "spare_nodes = 1\n")? else {
        return Ok(());
    };
    let started = Instant::now();
    later_attempt_runs(&c, &slurm, (job, slurm_id), "attempt 1 runs on the spare", Duration::from_secs(60))?;
    let status = c.status(job)?;
    let agents: Vec<&str> =
        status["ranks"].as_array().into_iter().flatten().filter_map(|r| r["agent_id"].as_str()).collect();
    assert!(!agents.contains(&victim.as_str()) && agents.len() == 2, "{status}");
    let failure = &status["failures"][0];
    assert_eq!(failure["kind"], "host_lost", "{status}");
    assert_eq!(failure["charged"], false, "{status}");
    eprintln!("moved to the spare {:.1} s after the host died", started.elapsed().as_secs_f64());
    assert_eq!(slurm.state(slurm_id).as_deref(), Some("RUNNING"), "the allocation outlived its node");
    let out = ctl_as_user(&c, &slurm, &["cancel", &job.to_string()])?;
    ensure!(out.status.success(), "{}", text(&out));
    Ok(())
}

/// The same allocation with a real PyTorch script nobody changed for trainyard (plain_ddp.py:
/// DDP over gloo, as written for torchrun): the two ranks meet across the hosts through the
/// MASTER_ADDR the agents give them, and every step of each rank is recorded without code
/// changes (docs/receipts.md). With `slurmctld` frozen for the whole run, nothing already
/// written is lost: the agents need Slurm only to start and to end.
#[test]
fn an_unchanged_ddp_script_trains_over_gloo_across_the_allocation_with_slurmctld_frozen() -> Result<()> {
    let Some((python, site)) = trainyard_tests::torch_for_ranks() else {
        println!("skipped: no python with .venv's torch can be run by {}", run_account());
        return Ok(());
    };
    let Some((c, slurm)) = start(2)? else { return Ok(()) };
    let work = c.path("ddp");
    std::fs::create_dir_all(&work)?;
    chown(&work)?;
    let script = trainyard_tests::fixture_scripts().join("plain_ddp.py").display().to_string();
    let out = work.display().to_string();
    let text = format!(
        "name = \"ddp-on-slurm\"\n\n[resources]\ngpus = 2\ngpus_per_node = 1\n\n[engine]\nkind = \"exec\"\n\
         argv = [{python:?}, {script:?}, \"--steps\", \"12\", \"--out\", {out:?}]\nworkdir = {out:?}\n\n\
         [env]\nPYTHONPATH = {site:?}\nGLOO_SOCKET_IFNAME = \"eth0\"\n\n[slurm]\npartition = \"debug\"\n"
    );
    let file = c.path("ddp-on-slurm.toml");
    std::fs::write(&file, text)?;
    let (job, slurm_id) = submit(&c, &slurm, &file)?;
    running(&c, &slurm, job, slurm_id)?;
    let ctld = slurm.pid_of("slurmctld")?;
    // SAFETY: kill(2) on the test cluster's own slurmctld.
    unsafe { libc::kill(ctld, libc::SIGSTOP) };
    let status = c.wait_state(job, &["succeeded", "failed", "cancelled"], Duration::from_secs(180));
    // SAFETY: as above.
    unsafe { libc::kill(ctld, libc::SIGCONT) };
    let status = status?;
    ensure!(status["state"] == "succeeded", "{status}\n{}", batch_output(&c, job, slurm_id));
    let steps = c.query(&format!(
        "SELECT rank, COUNT(DISTINCT step) FROM receipts WHERE job_id = {job} AND kind = 'step' GROUP BY rank"
    ))?;
    assert_eq!(steps, vec![vec![0, 12], vec![1, 12]], "every step of both ranks, from an unchanged script");
    // DDP of world size 2 steps only once both ranks met, one on each host.
    let hosts =
        c.query_text(&format!("SELECT agent_id FROM allocations WHERE job_id = {job} ORDER BY rank"))?;
    assert_eq!(hosts, vec![vec![format!("j{job}-n0")], vec![format!("j{job}-n1")]]);
    slurm.wait_completed(slurm_id, Duration::from_secs(60))?;
    Ok(())
}

/// On a TLS controller that wants client certificates of its fleet's agents, the agents of an
/// allocation join with the job's token and the controller's CA alone (`ctl` passes its `--ca`
/// on), and the job runs as on plaintext.
#[test]
fn over_tls_an_allocations_agents_join_with_the_token_and_the_ca_alone() -> Result<()> {
    if !trainyard_tests::slurm::installed() {
        return Ok(());
    }
    let Some(c) = Cluster::start_lab_tls(trainyard_tests::Backend::Sqlite, 2, &[], &[])? else {
        return Ok(());
    };
    let slurm = prepare(&c)?;
    assert!(c.url().starts_with("https://"), "{}", c.url());
    let file = job_file(&c, "tls", 2, &["--steps", "10", "--step-ms", "20", "--collective"], "");
    let (job, slurm_id) = submit(&c, &slurm, &file)?;
    let status = c.wait_state(job, &["succeeded", "failed", "cancelled"], Duration::from_secs(90))?;
    ensure!(status["state"] == "succeeded", "{status}\n{}", batch_output(&c, job, slurm_id));
    let script = std::fs::read_to_string(c.path(&format!("home/.trainyard/slurm/job-{job}.sh")))?;
    assert!(script.contains("--tls-ca"), "the agents trust the controller's CA: {script}");
    let steps = c.query(&format!("SELECT COUNT(*) FROM receipts WHERE job_id = {job} AND kind = 'step'"))?;
    assert_eq!(steps[0][0], 20);
    Ok(())
}

/// Without a spare a lost node ends the whole allocation (Slurm's NODE_FAIL); a job that asks for
/// requeue is requeued by Slurm and goes on in the new allocation's nodes as a new attempt, not
/// charged, from its newest checkpoint.
#[test]
fn a_killed_host_without_a_spare_ends_the_allocation_and_the_requeued_one_takes_the_job() -> Result<()> {
    let Some((c, slurm, job, slurm_id, _)) = job_on_a_killed_host("no-spare", "requeue = true\n")? else {
        return Ok(());
    };
    let what = "attempt 1 runs in the requeued allocation";
    later_attempt_runs(&c, &slurm, (job, slurm_id), what, Duration::from_secs(120))?;
    let status = c.status(job)?;
    let agents: Vec<&str> =
        status["ranks"].as_array().into_iter().flatten().filter_map(|r| r["agent_id"].as_str()).collect();
    assert!(agents.iter().all(|a| a.ends_with("-r1")), "the requeued allocation's agents: {status}");
    let failures = status["failures"].as_array().cloned().unwrap_or_default();
    assert!(!failures.is_empty() && failures.iter().all(|f| f["charged"] == false), "{status}");
    let line = slurm.run("scontrol", &["show", "job", "-o", &slurm_id.to_string()])?;
    assert!(line.contains("Restarts=1 "), "Slurm requeued the job after the node failure: {line}");
    let out = ctl_as_user(&c, &slurm, &["cancel", &job.to_string()])?;
    ensure!(out.status.success(), "{}", text(&out));
    Ok(())
}
