//! Drains and preemption notices: the node is cordoned, the jobs there are asked to checkpoint
//! now (a request file every rank sees), and once every rank has, the job moves to another node
//! and resumes after that checkpoint: no completed step is lost, and nothing counts against
//! max_restarts. Bad input (an unknown node, a notice source that cannot be read) is refused
//! with the name of what is wrong.

use std::time::Duration;

use anyhow::ensure;
use trainyard_tests::{Cluster, host_file};

/// A one-rank job of stand-in ranks that checkpoint only when asked, on `a`, with `b` idle.
fn job_on_a(c: &mut Cluster, notice: Option<&str>) -> anyhow::Result<u64> {
    job_on_a_with(c, notice, &[], "")
}

/// [`job_on_a`] with more rank arguments and `[restart]` lines.
fn job_on_a_with(c: &mut Cluster, notice: Option<&str>, more: &[&str], restart: &str) -> anyhow::Result<u64> {
    let host = host_file(c.dir.path(), "a", 1);
    match notice {
        Some(source) => c.start_agent_env("a", &host, &[("TRAINYARD_PREEMPTION_NOTICE", source)])?,
        None => c.start_agent_with_host_file("a", &host)?,
    }
    let ckpt = c.path("ckpt").display().to_string();
    let mut args = vec!["--steps", "100000", "--step-ms", "50", "--checkpoint-dir", &ckpt];
    args.extend_from_slice(more);
    let job =
        c.submit(&c.job_file("movable", 1, 1, &args, &format!("[restart]\nresume = true\n{restart}")))?;
    c.wait_first_steps(job, 1, Duration::from_secs(60))?;
    c.start_agent("b", 1)?;
    Ok(job)
}

/// The job moved off `a` to `b` with a failure of `kind`, and attempt 1 took up right after the
/// checkpoint attempt 0 wrote when asked, which was its last step.
fn moved_without_losing_a_step(c: &Cluster, job: u64, kind: &str) -> anyhow::Result<()> {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let status = loop {
        let status = c.status(job)?;
        if status["attempt"] == 1 && status["state"] == "running" {
            break status;
        }
        ensure!(std::time::Instant::now() < deadline, "the job did not move: {status}");
        std::thread::sleep(Duration::from_millis(100));
    };
    let f = &status["failures"][0];
    assert_eq!((f["kind"].as_str(), f["agent_id"].as_str()), (Some(kind), Some("a")), "{status}");
    assert_eq!((f["blamed"].as_bool(), f["charged"].as_bool()), (Some(false), Some(false)), "{f}");
    assert!(f["evidence"].as_str().unwrap_or("").contains("every rank checkpointed at step"), "{f}");
    assert_eq!(status["ranks"][0]["agent_id"], "b", "{status}");
    let q = |sql: String| -> anyhow::Result<i64> { Ok(c.query(&sql)?[0][0]) };
    let saved = q(format!(
        "SELECT MAX(step) FROM receipts WHERE job_id = {job} AND attempt = 0 AND kind = 'checkpoint'"
    ))?;
    let last =
        q(format!("SELECT MAX(step) FROM receipts WHERE job_id = {job} AND attempt = 0 AND kind = 'step'"))?;
    assert_eq!(last, saved, "attempt 0 took no step after the checkpoint it was asked for");
    c.wait_first_steps(job, 1, Duration::from_secs(30))?;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while q(format!("SELECT COUNT(*) FROM receipts WHERE job_id = {job} AND attempt = 1 AND kind = 'step'"))?
        == 0
    {
        ensure!(std::time::Instant::now() < deadline, "attempt 1 never stepped");
        std::thread::sleep(Duration::from_millis(100));
    }
    let first =
        q(format!("SELECT MIN(step) FROM receipts WHERE job_id = {job} AND attempt = 1 AND kind = 'step'"))?;
    assert_eq!(first, saved + 1, "attempt 1 resumes right after the checkpoint");
    Ok(())
}

#[test]
fn a_drained_node_hands_its_job_over_after_a_checkpoint() -> anyhow::Result<()> {
    let mut c = Cluster::start()?;
    let job = job_on_a(&mut c, None)?;
    let out = c.ctl_ok(&["drain", "a", "--deadline", "60s", "--reason", "kernel update"])?;
    assert!(out.contains(&format!("job(s) {job} asked to checkpoint")), "{out}");
    moved_without_losing_a_step(&c, job, "drain")?;
    let node = c.node("a")?;
    assert_eq!(
        (node["cordon_by"].as_str(), node["cordon_reason"].as_str()),
        (Some("drain"), Some("kernel update"))
    );
    // Bad input: a node nobody knows.
    let out = c.ctl(&["drain", "nope"])?;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no node nope"), "{err}");
    c.ctl_ok(&["cancel", &job.to_string()])?;
    Ok(())
}

#[test]
fn a_preemption_notice_moves_the_job_before_the_host_goes() -> anyhow::Result<()> {
    let mut c = Cluster::start()?;
    let notice = c.path("notice-a");
    let job = job_on_a(&mut c, Some(&format!("file:{}", notice.display())))?;
    std::fs::write(&notice, "spot instance-action: terminate\n")?;
    moved_without_losing_a_step(&c, job, "preemption")?;
    let node = c.node("a")?;
    assert_eq!(node["cordon_by"], "preemption", "{node}");
    // The notice's detail is for admins: in the controller's log, never in what users see.
    let reason = node["cordon_reason"].as_str().unwrap_or("");
    assert!(reason.contains("preemption notice on a") && !reason.contains("instance-action"), "{node}");
    assert!(c.logs("controller").contains("spot instance-action: terminate"));
    c.ctl_ok(&["cancel", &job.to_string()])?;
    Ok(())
}

/// A rank that asked for a signal (`checkpoint_signal = "SIGUSR1"`) gets one with the notice:
/// these stand-in ranks checkpoint on SIGUSR1 alone, never on the request file, so the job moves
/// without losing a step only if the signal was delivered.
#[test]
fn a_preemption_notice_is_delivered_as_sigusr1_to_a_rank_that_asked_for_it() -> anyhow::Result<()> {
    let mut c = Cluster::start()?;
    let notice = c.path("notice-a");
    let source = format!("file:{}", notice.display());
    let job = job_on_a_with(&mut c, Some(&source), &["--signal-only"], "checkpoint_signal = \"SIGUSR1\"\n")?;
    std::fs::write(&notice, "spot instance-action: terminate\n")?;
    moved_without_losing_a_step(&c, job, "preemption")?;
    c.ctl_ok(&["cancel", &job.to_string()])?;
    Ok(())
}

/// A notice file in a directory other users can write (as /tmp) could be planted or linked to
/// a root-only file: the agent refuses it at start, naming it.
#[test]
fn an_agent_refuses_a_notice_file_others_could_forge() -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = tempfile::tempdir()?;
    let open = dir.path().join("open");
    std::fs::create_dir(&open)?;
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o1777))?;
    let out = std::process::Command::new(trainyard_tests::bin("trainyard-agent")?)
        .args(["--controller", "http://127.0.0.1:9", "--data-dir"])
        .arg(dir.path().join("data"))
        .arg("--preemption-notice")
        .arg(format!("file:{}/notice", open.display()))
        .output()?;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--preemption-notice") && err.contains("writable by others"), "{err}");
    Ok(())
}

#[test]
fn an_agent_refuses_a_notice_source_it_cannot_read() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let out = std::process::Command::new(trainyard_tests::bin("trainyard-agent")?)
        .args(["--controller", "http://127.0.0.1:9", "--data-dir"])
        .arg(dir.path())
        .args(["--preemption-notice", "file:/no/such/dir/notice"])
        .output()?;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--preemption-notice") && err.contains("/no/such/dir"), "{err}");
    Ok(())
}
