//! Daemons killed with SIGKILL mid-job, and the database restarted under a running controller:
//! the job finishes, and no receipt is lost or stored twice. Every scenario runs on SQLite and
//! on PostgreSQL.

use std::time::Duration;

use trainyard_tests::{Backend, Cluster};

const STEPS: i64 = 60;

/// Per rank: exactly `STEPS` step receipts, `STEPS` distinct steps, one launch, one exit.
fn assert_complete(c: &Cluster, job: u64, ranks: usize) -> anyhow::Result<()> {
    let rows = c.query(&format!(
        "SELECT rank, COUNT(*) FILTER (WHERE kind = 'step'), COUNT(DISTINCT step), \
         COUNT(*) FILTER (WHERE kind = 'launch'), COUNT(*) FILTER (WHERE kind = 'exit') FROM receipts WHERE job_id = {job} \
         AND {} GROUP BY rank ORDER BY rank",
        trainyard_tests::RANK_WRITTEN
    ))?;
    assert_eq!(rows.len(), ranks, "{rows:?}");
    for (rank, row) in rows.iter().enumerate() {
        assert_eq!(row, &vec![rank as i64, STEPS, STEPS, 1, 1], "rank {rank}");
    }
    Ok(())
}

/// Waits until every rank has stored a few step receipts (a fixed sleep is not mid-job on a
/// loaded 2-core machine, where 8 Python ranks can take over a second to start).
fn wait_until_stepping(c: &Cluster, job: u64) -> anyhow::Result<()> {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let stored = c.query(&format!(
            "SELECT COUNT(DISTINCT rank) FROM receipts WHERE job_id = {job} AND kind = 'step' AND step >= 3"
        ))?;
        if stored[0][0] == 8 {
            return Ok(());
        }
        anyhow::ensure!(std::time::Instant::now() < deadline, "ranks did not reach step 3 within 60 s");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The kill really happened mid-job: some but not all step receipts were stored.
fn assert_mid_job(c: &Cluster, job: u64) -> anyhow::Result<()> {
    let stored = c.query(&format!("SELECT COUNT(*) FROM receipts WHERE job_id = {job} AND kind = 'step'"))?;
    assert!(stored[0][0] > 0 && stored[0][0] < 8 * STEPS, "kill not mid-job: {} step receipts", stored[0][0]);
    Ok(())
}

#[test]
fn controller_killed_mid_job_loses_nothing_sqlite() -> anyhow::Result<()> {
    controller_killed_mid_job_loses_nothing(Backend::Sqlite)
}

#[test]
fn controller_killed_mid_job_loses_nothing_postgres() -> anyhow::Result<()> {
    controller_killed_mid_job_loses_nothing(Backend::Postgres)
}

#[test]
fn agent_killed_mid_job_loses_nothing_sqlite() -> anyhow::Result<()> {
    agent_killed_mid_job_loses_nothing(Backend::Sqlite)
}

#[test]
fn agent_killed_mid_job_loses_nothing_postgres() -> anyhow::Result<()> {
    agent_killed_mid_job_loses_nothing(Backend::Postgres)
}

fn controller_killed_mid_job_loses_nothing(backend: Backend) -> anyhow::Result<()> {
    let mut c = Cluster::start_on(backend)?;
    c.start_agent("node-a", 4)?;
    c.start_agent("node-b", 4)?;
    let file = c.job_file("survivor", 8, 4, &["--steps", &STEPS.to_string(), "--step-ms", "50"], "");
    let job = c.submit(&file)?;
    c.wait_state(job, &["running"], Duration::from_secs(60))?;
    wait_until_stepping(&c, job)?;
    c.kill_controller();
    assert_mid_job(&c, job)?;
    std::thread::sleep(Duration::from_millis(1200));
    c.start_controller()?;
    let status = c.wait_state(job, &["succeeded", "failed", "cancelled"], Duration::from_secs(90))?;
    assert_eq!(status["state"], "succeeded", "{status}\n{}", c.logs("controller"));
    assert_complete(&c, job, 8)
}

fn agent_killed_mid_job_loses_nothing(backend: Backend) -> anyhow::Result<()> {
    let mut c = Cluster::start_on(backend)?;
    c.start_agent("node-a", 4)?;
    c.start_agent("node-b", 4)?;
    let file = c.job_file("orphans", 8, 4, &["--steps", &STEPS.to_string(), "--step-ms", "50"], "");
    let job = c.submit(&file)?;
    c.wait_state(job, &["running"], Duration::from_secs(60))?;
    wait_until_stepping(&c, job)?;
    c.kill_agent("node-b");
    assert_mid_job(&c, job)?;
    // The ranks outlive their agent.
    c.wait_ranks_alive(8, Duration::from_secs(5))?;
    std::thread::sleep(Duration::from_millis(1200));
    c.start_agent("node-b", 4)?;
    let status = c.wait_state(job, &["succeeded", "failed", "cancelled"], Duration::from_secs(90))?;
    assert_eq!(status["state"], "succeeded", "{status}\n{}", c.logs("agent-node-b"));
    assert_complete(&c, job, 8)
}

/// PostgreSQL restarted (fast shutdown: every connection cut) while receipts stream in: the
/// controller's store retries, the agents resend what was not acknowledged, nothing is lost or
/// doubled and the job succeeds without anyone restarting the controller.
#[test]
fn postgres_restarted_under_a_running_controller_loses_nothing() -> anyhow::Result<()> {
    let mut c = Cluster::start_on(Backend::Postgres)?;
    c.start_agent("node-a", 4)?;
    c.start_agent("node-b", 4)?;
    let file = c.job_file("db-restart", 8, 4, &["--steps", &STEPS.to_string(), "--step-ms", "50"], "");
    let job = c.submit(&file)?;
    c.wait_state(job, &["running"], Duration::from_secs(60))?;
    wait_until_stepping(&c, job)?;
    c.restart_postgres()?;
    assert_mid_job(&c, job)?;
    let status = c.wait_state(job, &["succeeded", "failed", "cancelled"], Duration::from_secs(90))?;
    assert_eq!(status["state"], "succeeded", "{status}\n{}", c.logs("controller"));
    assert_complete(&c, job, 8)?;
    let log = c.logs("controller");
    // The pool found its connections cut (or a transaction failed and was tried again).
    let noticed = log.contains("terminating connection") || log.contains("trying again");
    assert!(noticed, "the restart was not noticed:\n{log}");
    Ok(())
}

/// The agent dies after recording a rank and before spawning its shim: restarted, it reports the
/// rank lost (it was never started) instead of starting it; nothing ever ran for the attempt.
/// That is the node's failure, not the job's: the node is asked for a preflight, passes it, and
/// attempt 1 runs there to the end.
#[test]
fn agent_killed_between_record_and_spawn_never_starts_the_rank() -> anyhow::Result<()> {
    let mut c = Cluster::start()?;
    let host = trainyard_tests::host_file(c.dir.path(), "node-a", 1);
    c.start_agent_env("node-a", &host, &[("TRAINYARD_AGENT_FAILPOINT", "before-spawn")])?;
    let job = c.submit(&c.job_file("unborn", 1, 1, &["--steps", "5"], ""))?;
    c.wait_agent_exit("node-a", Duration::from_secs(30))?;
    assert!(c.live_processes("python").is_empty(), "a rank started before the failpoint");
    c.start_agent_with_host_file("node-a", &host)?;
    let status = c.wait_state(job, &["succeeded", "failed", "cancelled"], Duration::from_secs(60))?;
    assert_eq!(status["state"], "succeeded", "{status}");
    let failure = &status["failures"][0];
    assert_eq!(
        (failure["kind"].as_str(), failure["attempt"].as_u64()),
        (Some("rank_lost"), Some(0)),
        "{status}"
    );
    assert!(failure["evidence"].as_str().unwrap_or_default().contains("was not started"), "{status}");
    assert_eq!(status["attempt"], 1, "{status}");
    let attempt0 = c.query(&format!("SELECT COUNT(*) FROM receipts WHERE job_id = {job} AND attempt = 0"))?;
    assert_eq!(attempt0[0][0], 0, "nothing ran for attempt 0");
    Ok(())
}

/// The agent dies right after spawning a shim and before recording it: restarted, it finds the
/// shim by its command line and adopts it; the rank runs exactly once and the job succeeds.
#[test]
fn agent_killed_between_spawn_and_record_adopts_the_rank_it_started() -> anyhow::Result<()> {
    let mut c = Cluster::start()?;
    let host = trainyard_tests::host_file(c.dir.path(), "node-a", 1);
    c.start_agent_env("node-a", &host, &[("TRAINYARD_AGENT_FAILPOINT", "after-spawn")])?;
    let job = c.submit(&c.job_file("orphan", 1, 1, &["--steps", "40", "--step-ms", "50"], ""))?;
    c.wait_agent_exit("node-a", Duration::from_secs(30))?;
    c.start_agent_with_host_file("node-a", &host)?;
    let status = c.wait_state(job, &["succeeded", "failed", "cancelled"], Duration::from_secs(60))?;
    assert_eq!(status["state"], "succeeded", "{status}\n{}", c.logs("agent-node-a"));
    assert_eq!(status["attempt"], 0, "{status}");
    let launches = c.query(&format!(
        "SELECT COUNT(*) FILTER (WHERE kind = 'launch'), COUNT(*) FILTER (WHERE kind = 'step') \
         FROM receipts WHERE job_id = {job}"
    ))?;
    assert_eq!(launches[0], vec![1, 40], "the rank ran exactly once");
    Ok(())
}

/// An agent upgraded while its rank runs: the old agent had no `trainyard-shim` beside it and
/// started the rank under its own binary's `supervise`; the new one, with the small shim beside
/// it, adopts that shim instead of losing the rank. One attempt, every step once.
#[test]
fn an_agent_given_the_small_shim_adopts_a_rank_its_own_binary_started() -> anyhow::Result<()> {
    let mut c = Cluster::start()?;
    let bin = c.path("bin");
    std::fs::create_dir(&bin)?;
    let agent = bin.join("trainyard-agent");
    std::fs::copy(trainyard_tests::bin("trainyard-agent")?, &agent)?;
    let host = trainyard_tests::host_file(c.dir.path(), "node-a", 1);
    c.start_agent_program(&agent, "node-a", &host, &[])?;
    let job = c.submit(&c.job_file("upgraded", 1, 1, &["--steps", "100", "--step-ms", "50"], ""))?;
    c.wait_state(job, &["running"], Duration::from_secs(60))?;
    let before = c.logs("agent-node-a");
    assert!(
        before.contains(&format!("shim={}", agent.display())),
        "the old agent's shim is itself:\n{before}"
    );
    c.kill_agent("node-a");
    std::fs::copy(trainyard_tests::bin("trainyard-shim")?, bin.join("trainyard-shim"))?;
    c.start_agent_program(&agent, "node-a", &host, &[])?;
    let status = c.wait_state(job, &["succeeded", "failed", "cancelled"], Duration::from_secs(60))?;
    let after = c.logs("agent-node-a");
    assert!(after.contains(&format!("shim={}", bin.join("trainyard-shim").display())), "{after}");
    assert_eq!(status["state"], "succeeded", "{status}\n{after}");
    assert_eq!(status["attempt"], 0, "{status}");
    let counts = c.query(&format!(
        "SELECT COUNT(*) FILTER (WHERE kind = 'launch'), COUNT(*) FILTER (WHERE kind = 'step'), \
         COUNT(DISTINCT step) FROM receipts WHERE job_id = {job}"
    ))?;
    assert_eq!(counts[0], vec![1, 100, 100], "the rank ran once and its steps were stored once");
    Ok(())
}

/// The controller SIGKILLed while 8 ranks stream receipts into PostgreSQL at 40,000 per second:
/// after its restart every receipt is stored exactly once.
#[test]
fn controller_killed_during_heavy_ingest_on_postgres_loses_and_doubles_nothing() -> anyhow::Result<()> {
    const PER_RANK: i64 = 30_000;
    let mut c = Cluster::start_on(Backend::Postgres)?;
    c.start_agent("node-a", 4)?;
    c.start_agent("node-b", 4)?;
    let file = c.job_file("heavy", 8, 4, &[], "");
    let text = std::fs::read_to_string(&file)?.replace(
        r#"argv = ["python3", "examples/rank.py"]"#,
        &format!(r#"argv = ["python3", "examples/flood.py", "--receipts", "{PER_RANK}", "--rate", "5000", "--chunk", "100"]"#),
    );
    std::fs::write(&file, text)?;
    let job = c.submit(&file)?;
    let stored = |c: &Cluster| c.query(&format!("SELECT COUNT(*) FROM receipts WHERE job_id = {job}"));
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while stored(&c)?[0][0] < 8 * PER_RANK / 3 {
        anyhow::ensure!(std::time::Instant::now() < deadline, "ingest did not get going");
        std::thread::sleep(Duration::from_millis(20));
    }
    c.kill_controller();
    let at_kill = stored(&c)?[0][0];
    assert!(at_kill < 8 * PER_RANK, "killed after the ingest was over: {at_kill}");
    std::thread::sleep(Duration::from_millis(500));
    c.start_controller()?;
    let status = c.wait_state(job, &["succeeded", "failed", "cancelled"], Duration::from_secs(120))?;
    assert_eq!(status["state"], "succeeded", "{status}\n{}", c.logs("controller"));
    let rows = c.query(&format!(
        "SELECT rank, COUNT(*), COUNT(DISTINCT seq), MIN(seq), MAX(seq) FROM receipts WHERE job_id = {job} \
         AND {} GROUP BY rank ORDER BY rank",
        trainyard_tests::RANK_WRITTEN
    ))?;
    assert_eq!(rows.len(), 8);
    for (rank, row) in rows.iter().enumerate() {
        assert_eq!(row, &vec![rank as i64, PER_RANK, PER_RANK, 0, PER_RANK - 1], "rank {rank}");
    }
    Ok(())
}
