//! Several controllers (docs/ha.md). SQLite serves one, so a second controller pointed at the
//! same SQLite file refuses to start and says why and what to use instead; the first keeps
//! serving, and one killed with SIGKILL leaves no claim behind. On PostgreSQL a standby takes
//! over from a leader that died or froze past its lease, the agents follow, and no job restarts
//! and no receipt is lost or stored twice.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use trainyard_tests::{Cluster, bin};

/// Runs a second `trainyard-controller` on `data_dir`; (exit code, stderr) once it exits.
fn second_controller(data_dir: &std::path::Path) -> Result<(Option<i32>, String)> {
    let mut child = Command::new(bin("trainyard-controller")?)
        .arg("--data-dir")
        .arg(data_dir)
        .args(["--listen", "127.0.0.1:0", "--http-listen", "off"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(status) = child.try_wait()? {
            let mut err = String::new();
            std::io::Read::read_to_string(&mut child.stderr.take().expect("stderr"), &mut err)?;
            return Ok((status.code(), err));
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            anyhow::bail!("a second controller on the same SQLite file kept running");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_second_controller_on_the_same_sqlite_file_refuses_to_start() -> Result<()> {
    let mut c = Cluster::start()?;
    c.start_agent("node-a", 2)?;
    let pid = c.controller_pid().expect("running");
    let (code, err) = second_controller(&c.path("controller"))?;
    ensure!(code == Some(1), "exit code {code:?}: {err}");
    ensure!(
        err.contains(&format!("another trainyard-controller (pid {pid}) already uses the SQLite database"))
            && err.contains("SQLite serves one controller")
            && err.contains("--db postgres://"),
        "{err}"
    );
    // The first one serves on.
    let job = c.submit(&c.job_file("still", 2, 2, &["--steps", "5", "--step-ms", "10"], ""))?;
    c.wait_state(job, &["succeeded"], Duration::from_secs(60))?;
    // Killed, it leaves no claim: a new controller starts on the same file.
    c.kill_controller();
    c.start_controller()?;
    ensure!(c.ctl_ok(&["status", &job.to_string()])?.contains("succeeded"));
    Ok(())
}

/// A standby controller process, killed when dropped.
struct Standby(std::process::Child);

impl Drop for Standby {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts a second controller on the cluster's PostgreSQL, to listen on `port` once it leads
/// (writing `addr_file` then), logging to `standby.log`.
fn standby(c: &Cluster, db: &str, port: u16, addr_file: &std::path::Path) -> Result<Standby> {
    Ok(Standby(
        Command::new(bin("trainyard-controller")?)
            .args(["--db", db, "--listen", &format!("127.0.0.1:{port}"), "--http-listen", "off"])
            .args(["--controller-id", "standby", "--agent-timeout-secs", "30"])
            .arg("--addr-file")
            .arg(addr_file)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(c.path("standby.log"))?)
            .spawn()?,
    ))
}

/// A free port on loopback (the standby listens only once it leads, so agents are told its
/// address in advance).
fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Two controllers on one PostgreSQL: the first leads, the second waits as a standby. The
/// leader is killed mid-job: the standby takes over within the lease (5 s) plus its start, the
/// agents (given both addresses) move to it and resend what was not acknowledged, and the job
/// finishes on its first attempt with every receipt stored once.
#[test]
fn a_standby_takes_over_when_the_leader_dies_and_no_receipt_is_lost_or_doubled() -> Result<()> {
    let mut c = Cluster::start_on(trainyard_tests::Backend::Postgres)?;
    let url = c.db_url().expect("postgres").to_string();
    let port = free_port()?;
    let addr_file = c.path("standby.addr");
    let _standby = standby(&c, &url, port, &addr_file)?;
    std::thread::sleep(Duration::from_secs(1));
    let standby_log = std::fs::read_to_string(c.path("standby.log"))?;
    ensure!(standby_log.contains("standby: another controller leads"), "{standby_log}");
    ensure!(!addr_file.exists(), "a standby listens on nothing");
    c.agent_controllers = Some(format!("{},http://127.0.0.1:{port}", c.url()));
    c.start_agent("node-a", 2)?;
    c.start_agent("node-b", 2)?;
    let job = c.submit(&c.job_file("through", 4, 2, &["--steps", "300", "--step-ms", "50"], ""))?;
    c.wait_state(job, &["running"], Duration::from_secs(60))?;
    std::thread::sleep(Duration::from_secs(3));
    let killed = Instant::now();
    c.kill_controller();
    let new_addr = loop {
        if let Ok(a) = std::fs::read_to_string(&addr_file) {
            break a.trim().to_string();
        }
        ensure!(killed.elapsed() < Duration::from_secs(20), "no takeover 20 s after the leader died");
        std::thread::sleep(Duration::from_millis(50));
    };
    let takeover = killed.elapsed();
    eprintln!("the standby took over and listened {takeover:?} after the leader was killed (lease 5 s)");
    ensure!(takeover < Duration::from_secs(10), "takeover took {takeover:?} (target 10 s)");
    // ctl given both addresses finds the one that leads.
    let both = c.agent_controllers.clone().expect("set above");
    let out = Command::new(bin("ctl")?).args(["--controller", &both, "status", &job.to_string()]).output()?;
    ensure!(out.status.success(), "ctl over both addresses: {}", String::from_utf8_lossy(&out.stderr));
    c.addr = new_addr;
    let status = c.wait_state(job, &["succeeded", "failed", "cancelled"], Duration::from_secs(120))?;
    ensure!(status["state"] == "succeeded" && status["attempt"] == 0, "no restart for a failover: {status}");
    let rows = c.query(&format!(
        "SELECT COUNT(*), COUNT(DISTINCT rank * 100000 + seq) FROM receipts WHERE job_id = {job} AND kind = 'step'"
    ))?;
    ensure!(rows[0][0] == 4 * 300, "{} step receipts stored (expected 1200: none lost)", rows[0][0]);
    ensure!(rows[0][0] == rows[0][1], "a receipt stored twice");
    let epoch = c.query("SELECT epoch FROM controller_lease")?[0][0];
    ensure!(epoch == 2, "the standby leads under epoch 2, not {epoch}");
    Ok(())
}

/// The leader frozen (SIGSTOP) past its lease: the standby takes over, the agents' pings find
/// the frozen one and they move; thawed, the old leader finds its lease gone, writes nothing and
/// exits. The job finishes on its first attempt, every receipt stored once.
#[test]
fn a_leader_frozen_past_its_lease_is_replaced_and_steps_down_when_thawed() -> Result<()> {
    let mut c = Cluster::start_on(trainyard_tests::Backend::Postgres)?;
    let url = c.db_url().expect("postgres").to_string();
    let port = free_port()?;
    let addr_file = c.path("standby.addr");
    let _standby = standby(&c, &url, port, &addr_file)?;
    c.agent_controllers = Some(format!("{},http://127.0.0.1:{port}", c.url()));
    c.start_agent("node-a", 2)?;
    c.start_agent("node-b", 2)?;
    let job = c.submit(&c.job_file("frozen", 4, 2, &["--steps", "400", "--step-ms", "50"], ""))?;
    c.wait_state(job, &["running"], Duration::from_secs(60))?;
    std::thread::sleep(Duration::from_secs(2));
    let leader = c.controller_pid().expect("running") as i32;
    // SAFETY: signalling a child process of this test.
    unsafe { libc::kill(leader, libc::SIGSTOP) };
    let frozen = Instant::now();
    let new_addr = loop {
        if let Ok(a) = std::fs::read_to_string(&addr_file) {
            break a.trim().to_string();
        }
        ensure!(frozen.elapsed() < Duration::from_secs(20), "no takeover 20 s after the leader froze");
        std::thread::sleep(Duration::from_millis(50));
    };
    eprintln!("the standby took over {:?} after the leader froze (lease 5 s)", frozen.elapsed());
    std::thread::sleep(Duration::from_secs(8).saturating_sub(frozen.elapsed()));
    unsafe { libc::kill(leader, libc::SIGCONT) };
    c.addr = new_addr;
    // Thawed, the old leader finds its lease gone and exits.
    let thawed = Instant::now();
    loop {
        let log = c.logs("controller");
        if log.contains("lost the lease") && log.contains("restart as a standby") {
            break;
        }
        ensure!(thawed.elapsed() < Duration::from_secs(15), "the old leader did not step down: {log}");
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!("the old leader stepped down {:?} after it was thawed", thawed.elapsed());
    let status = c.wait_state(job, &["succeeded", "failed", "cancelled"], Duration::from_secs(120))?;
    ensure!(status["state"] == "succeeded" && status["attempt"] == 0, "no restart for a failover: {status}");
    let rows = c.query(&format!(
        "SELECT COUNT(*), COUNT(DISTINCT rank * 100000 + seq) FROM receipts WHERE job_id = {job} AND kind = 'step'"
    ))?;
    ensure!(
        rows[0][0] == 4 * 400 && rows[0][0] == rows[0][1],
        "step receipts stored: {:?} (expected 1600, once each)",
        rows[0]
    );
    ensure!(c.query("SELECT epoch FROM controller_lease")?[0][0] == 2);
    Ok(())
}
