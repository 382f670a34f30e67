//! Several controllers (docs/ha.md). SQLite serves one, so a second controller pointed at the
//! same SQLite file refuses to start and says why and what to use instead; the first keeps
//! serving, and one killed with SIGKILL leaves no claim behind. On PostgreSQL a follower serves
//! reads and sends writers and agents to the leader, takes over from a leader that died or froze
//! past its lease, the agents follow, and no job restarts and no receipt is lost or stored twice.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use trainyard_tests::group::Member;
use trainyard_tests::{Cluster, bin};

/// Runs a second `trainyard-controller` with `args`; (exit code, stderr) once it exits.
fn second_controller(args: &[&std::ffi::OsStr]) -> Result<(Option<i32>, String)> {
    let mut child = Command::new(bin("trainyard-controller")?)
        .args(args)
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
            anyhow::bail!("the second controller kept running");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_second_controller_on_the_same_sqlite_file_refuses_to_start() -> Result<()> {
    let mut c = Cluster::start()?;
    c.start_agent("node-a", 2)?;
    let pid = c.controller_pid().expect("running");
    let data_dir = c.path("controller");
    let (code, err) = second_controller(&["--data-dir".as_ref(), data_dir.as_os_str()])?;
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

/// A cluster on PostgreSQL whose controller leads, and a second controller (`standby`) that
/// follows it.
fn group_of_two() -> Result<(Cluster, Member)> {
    let c = Cluster::start_on(trainyard_tests::Backend::Postgres)?;
    let member = Member::start(&c, "standby")?;
    member.wait_log("following: another controller leads", Duration::from_secs(10))?;
    Ok((c, member))
}

/// The job succeeds on its first attempt (a failover restarts nothing), every one of its
/// `expected` step receipts is stored once (none lost, none twice), and the group leads under
/// epoch 2 (one takeover).
fn finished_once_on_epoch_2(c: &Cluster, job: u64, expected: i64) -> Result<()> {
    let status = c.wait_state(job, &["succeeded", "failed", "cancelled"], Duration::from_secs(120))?;
    ensure!(status["state"] == "succeeded" && status["attempt"] == 0, "no restart for a failover: {status}");
    let rows = c.query(&format!(
        "SELECT COUNT(*), COUNT(DISTINCT rank * 100000 + seq) FROM receipts WHERE job_id = {job} AND kind = 'step'"
    ))?;
    ensure!(rows[0][0] == expected, "{} step receipts stored (expected {expected}: none lost)", rows[0][0]);
    ensure!(rows[0][0] == rows[0][1], "a receipt stored twice: {:?}", rows[0]);
    let epoch = c.query("SELECT epoch FROM controller_lease")?[0][0];
    ensure!(epoch == 2, "the group leads under epoch 2 (one takeover), not {epoch}");
    Ok(())
}

/// The value of an unlabelled metric on a controller's `/metrics`.
fn metric(http: &str, name: &str) -> Result<f64> {
    let text = trainyard_tests::http(http, "GET", "/metrics")?.1;
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
        .with_context(|| format!("{name} on {http}: {text}"))
}

/// gRPC health of `url`: the status of each of `services`.
fn grpc_health(url: &str, services: &[&str]) -> Result<Vec<i32>> {
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async {
        let channel = tonic::transport::Endpoint::from_shared(url.to_string())?.connect().await?;
        let mut health = HealthClient::new(channel);
        let mut out = Vec::new();
        for service in services {
            out.push(
                health.check(HealthCheckRequest { service: service.to_string() }).await?.into_inner().status,
            );
        }
        Ok(out)
    })
}

/// Each submit that was in flight when the leader died either succeeded, its job the one job
/// of its key, or failed with an error and created at most one; sent again with the same key
/// to the new leader, it answers that job (or creates the one), never a second.
fn in_flight_submits_happened_once(
    c: &Cluster,
    keyed: Vec<(String, std::process::Child)>,
    file: &std::path::Path,
) -> Result<()> {
    let jobs_of = |key: &str| -> Result<Vec<String>> {
        Ok(c.query_text(&format!("SELECT CAST(id AS TEXT) FROM jobs WHERE submit_key = '{key}'"))?
            .into_iter()
            .map(|r| r[0].clone())
            .collect())
    };
    for (key, child) in keyed {
        let out = child.wait_with_output()?;
        let printed = String::from_utf8_lossy(&out.stdout).trim().to_string();
        let err = String::from_utf8_lossy(&out.stderr);
        let stored = jobs_of(&key)?;
        if out.status.success() {
            ensure!(stored == [printed.clone()], "{key}: ctl said job {printed}, the store holds {stored:?}");
        } else {
            ensure!(
                !err.trim().is_empty() && stored.len() <= 1,
                "{key}: failed silently or twice: {err} {stored:?}"
            );
        }
        let again = c.ctl_ok(&["submit", file.to_str().expect("utf-8"), "--key", &key])?;
        let stored_after = jobs_of(&key)?;
        ensure!(
            stored_after == [again.trim().to_string()],
            "{key}: resent, {again} against {stored_after:?}"
        );
        ensure!(stored.is_empty() || stored == stored_after, "{key}: a second job for one key");
        eprintln!(
            "{key}: in flight across the takeover: {}",
            if out.status.success() { "ok" } else { "failed, resent once" }
        );
    }
    Ok(())
}

/// Two controllers on one PostgreSQL: the first leads, the second follows. The leader is
/// killed mid-job: the follower takes over within the lease (5 s) plus its start, the agents
/// (given both addresses) move to it and resend what was not acknowledged, and the job finishes
/// on its first attempt with every receipt stored once.
#[test]
fn a_follower_takes_over_when_the_leader_dies_and_no_receipt_is_lost_or_doubled() -> Result<()> {
    let (mut c, member) = group_of_two()?;
    c.agent_controllers = Some(format!("{},{}", c.url(), member.url));
    c.start_agent("node-a", 2)?;
    c.start_agent("node-b", 2)?;
    let job = c.submit(&c.job_file("through", 4, 2, &["--steps", "300", "--step-ms", "50"], ""))?;
    c.wait_state(job, &["running"], Duration::from_secs(60))?;
    // A job that waits for the GPUs the first one holds: the new leader must place it.
    let waiting = c.submit(&c.job_file("waiting", 2, 2, &["--steps", "20", "--step-ms", "50"], ""))?;
    std::thread::sleep(Duration::from_secs(3));
    ensure!(c.status(waiting)?["state"] == "pending", "{}", c.status(waiting)?);
    // Submits in flight across the takeover, each under its own key, given both addresses.
    let both = format!("{},{}", c.url(), member.url);
    let small = c.job_file("keyed", 1, 1, &["--steps", "5", "--step-ms", "20"], "");
    let mut keyed = Vec::new();
    for i in 0..4 {
        let key = format!("takeover-{i}");
        let child = Command::new(bin("ctl")?)
            .args(["--controller", &both, "submit", small.to_str().expect("utf-8"), "--key", &key])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        keyed.push((key, child));
    }
    let killed = Instant::now();
    c.kill_controller();
    member.wait_log("leading the controller group", Duration::from_secs(20))?;
    let takeover = killed.elapsed();
    eprintln!("the follower took over {takeover:?} after the leader was killed (lease 5 s)");
    ensure!(takeover < Duration::from_secs(10), "takeover took {takeover:?} (target 10 s)");
    ensure!(member.health()?.contains("ok: leads (controller standby, epoch 2)"), "{}", member.health()?);
    // ctl given both addresses finds one that answers.
    let both = c.agent_controllers.clone().expect("set above");
    let out = Command::new(bin("ctl")?).args(["--controller", &both, "status", &job.to_string()]).output()?;
    ensure!(out.status.success(), "ctl over both addresses: {}", String::from_utf8_lossy(&out.stderr));
    c.addr = member.url.trim_start_matches("http://").to_string();
    in_flight_submits_happened_once(&c, keyed, &small)?;
    finished_once_on_epoch_2(&c, job, 4 * 300)?;
    let placed = c.wait_state(waiting, &["succeeded", "failed", "cancelled"], Duration::from_secs(60))?;
    ensure!(
        placed["state"] == "succeeded" && placed["attempt"] == 0,
        "pending across the takeover: {placed}"
    );
    // The new leader's lease on /metrics: it leads, under epoch 2, and has renewed.
    ensure!(metric(&member.http, "trainyard_controller_is_leader")? == 1.0);
    ensure!(metric(&member.http, "trainyard_controller_epoch")? == 2.0);
    ensure!(metric(&member.http, "trainyard_lease_renewals_total")? > 0.0);
    Ok(())
}

/// A follower serves reads (`ctl status`, `nodes`, the web API, `/metrics`, `/healthz`) from
/// the store and sends writers to the leader: `ctl submit` and `cancel` given only the
/// follower's address reach the leader it names, and agents that dial the follower first are
/// told the leader's address and connect there.
#[test]
fn a_follower_serves_reads_and_sends_writers_and_agents_to_the_leader() -> Result<()> {
    let (mut c, member) = group_of_two()?;
    let leader = c.url();
    let health = member.health()?;
    ensure!(
        health.contains("ok: follows (controller standby)") && health.contains(&format!("at {}", c.addr)),
        "{health}"
    );
    ensure!(c.http("GET", "/healthz")?.1.starts_with("ok: leads"), "the leader's /healthz");
    // Agents that know the follower first are sent to the leader.
    c.agent_controllers = Some(format!("{},{leader}", member.url));
    c.start_agent("node-a", 2)?;
    c.wait_agent_connected("node-a", Duration::from_secs(20))?;
    let agent_log = c.logs("agent-node-a");
    ensure!(agent_log.contains("this controller follows; dialing the leader it names"), "{agent_log}");
    // Writes given the follower alone reach the leader.
    let follower_only = |args: &[&str]| -> Result<String> {
        let out = Command::new(bin("ctl")?).args(["--controller", &member.url]).args(args).output()?;
        ensure!(
            out.status.success(),
            "ctl {args:?} via the follower: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let file = c.job_file("via-follower", 2, 2, &["--steps", "400", "--step-ms", "50"], "");
    let submitted = follower_only(&["submit", file.to_str().expect("utf-8")])?;
    let job: u64 = submitted.split_whitespace().find_map(|w| w.parse().ok()).context("a job id")?;
    c.wait_state(job, &["running"], Duration::from_secs(60))?;
    // Reads on the follower: from the store, the nodes from the leader's records.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let status = follower_only(&["status", &job.to_string(), "-o", "json"])?;
        let nodes = follower_only(&["nodes", "-o", "json"])?;
        if status.contains("\"running\"") && nodes.contains("\"connected\"") {
            break;
        }
        ensure!(Instant::now() < deadline, "the follower's reads lag: {status} {nodes}");
        std::thread::sleep(Duration::from_millis(200));
    }
    let (code, body) = trainyard_tests::http(&member.http, "GET", &format!("/api/jobs/{job}"))?;
    ensure!(code == 200 && body.contains("via-follower"), "web API on the follower: {code} {body}");
    let metrics = trainyard_tests::http(&member.http, "GET", "/metrics")?.1;
    ensure!(metrics.contains("trainyard_controller_is_leader 0"), "{metrics}");
    // gRPC health on the follower: its jobs service serves (reads, and writers sent on), its
    // agents service and the leader's entry do not.
    let (serving, not) = (1, 2);
    let health =
        grpc_health(&member.url, &["trainyard.v1.Jobs", "trainyard.v1.Agents", "trainyard.v1.Leader"])?;
    ensure!(health == [serving, not, not], "the follower's gRPC health: {health:?}");
    // `ctl watch` on the follower streams the job's receipts from the store.
    let mut watch = Command::new(bin("ctl")?)
        .args(["--controller", &member.url, "watch", &job.to_string(), "-o", "json"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    std::thread::sleep(Duration::from_secs(3));
    let _ = watch.kill();
    let out = watch.wait_with_output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    ensure!(
        text.lines().filter(|l| l.contains("\"step\"")).count() > 5,
        "ctl watch via the follower: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    follower_only(&["cancel", &job.to_string()])?;
    let status = c.wait_state(job, &["cancelled"], Duration::from_secs(30))?;
    ensure!(status["attempt"] == 0, "{status}");
    // Nothing of the follower's own was written: the leader did all of it, under epoch 1.
    ensure!(c.query("SELECT epoch FROM controller_lease")?[0][0] == 1);
    ensure!(!member.logs().contains("ERROR"), "{}", member.logs());
    Ok(())
}

/// The leader frozen (SIGSTOP) past its lease: the follower takes over, the agents' pings find
/// the frozen one and they move; thawed, the old leader finds its lease gone, writes nothing and
/// steps down to follow the new one. The job finishes on its first attempt, every receipt stored
/// once.
#[test]
fn a_leader_frozen_past_its_lease_is_replaced_and_steps_down_when_thawed() -> Result<()> {
    let (mut c, member) = group_of_two()?;
    c.agent_controllers = Some(format!("{},{}", c.url(), member.url));
    c.start_agent("node-a", 2)?;
    c.start_agent("node-b", 2)?;
    let job = c.submit(&c.job_file("frozen", 4, 2, &["--steps", "400", "--step-ms", "50"], ""))?;
    c.wait_state(job, &["running"], Duration::from_secs(60))?;
    std::thread::sleep(Duration::from_secs(2));
    let leader = c.controller_pid().expect("running") as i32;
    // SAFETY: signalling a child process of this test.
    unsafe { libc::kill(leader, libc::SIGSTOP) };
    let frozen = Instant::now();
    member.wait_log("leading the controller group", Duration::from_secs(20))?;
    eprintln!("the follower took over {:?} after the leader froze (lease 5 s)", frozen.elapsed());
    std::thread::sleep(Duration::from_secs(8).saturating_sub(frozen.elapsed()));
    unsafe { libc::kill(leader, libc::SIGCONT) };
    let old_http = c.http_addr.clone();
    c.addr = member.url.trim_start_matches("http://").to_string();
    // Thawed, the old leader finds its lease gone, steps down and follows the new one.
    let thawed = Instant::now();
    loop {
        let log = c.logs("controller");
        // Woken past its lease, it steps down before or at its first renewal.
        let gone = log.contains("lost the lease") || log.contains("no renewal for a whole lease");
        if gone && log.contains("stepped down") {
            break;
        }
        ensure!(thawed.elapsed() < Duration::from_secs(15), "the old leader did not step down: {log}");
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!("the old leader stepped down {:?} after it was thawed", thawed.elapsed());
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let health = trainyard_tests::http(&old_http, "GET", "/healthz").map(|r| r.1).unwrap_or_default();
        if health.contains("follows") && health.contains("the leader is standby") {
            break;
        }
        ensure!(Instant::now() < deadline, "the old leader does not follow: {health}");
        std::thread::sleep(Duration::from_millis(100));
    }
    finished_once_on_epoch_2(&c, job, 4 * 400)?;
    Ok(())
}

/// PostgreSQL lost for 8 s under a running job (lease 5 s): the leader cannot renew, steps down
/// and follows; when the database is back exactly one controller leads under a new epoch, the
/// agents find it, and the job finishes on its first attempt with every receipt stored once.
#[test]
fn a_leader_that_loses_postgres_steps_down_and_one_leads_when_it_is_back() -> Result<()> {
    let (mut c, member) = group_of_two()?;
    c.agent_controllers = Some(format!("{},{}", c.url(), member.url));
    c.start_agent("node-a", 2)?;
    c.start_agent("node-b", 2)?;
    let job = c.submit(&c.job_file("outage", 4, 2, &["--steps", "500", "--step-ms", "50"], ""))?;
    c.wait_state(job, &["running"], Duration::from_secs(60))?;
    std::thread::sleep(Duration::from_secs(2));
    let lost = Instant::now();
    c.postgres_outage(Duration::from_secs(8))?;
    loop {
        let log = c.logs("controller");
        if log.contains("no renewal for a whole lease: stepping down") && log.contains("stepped down") {
            break;
        }
        ensure!(lost.elapsed() < Duration::from_secs(30), "the leader did not step down: {log}");
        std::thread::sleep(Duration::from_millis(100));
    }
    // Back: one leads, the other follows, never both.
    let health = |http: &str| trainyard_tests::http(http, "GET", "/healthz").map(|r| r.1).unwrap_or_default();
    let deadline = Instant::now() + Duration::from_secs(30);
    let (first, second) = loop {
        let pair = (health(&c.http_addr), health(&member.http));
        ensure!(
            !(pair.0.starts_with("ok: leads") && pair.1.starts_with("ok: leads")),
            "two leaders: {pair:?}"
        );
        if pair.0.starts_with("ok: leads") ^ pair.1.starts_with("ok: leads") && pair.0.contains("epoch 2")
            || pair.1.contains("epoch 2")
        {
            break pair;
        }
        ensure!(Instant::now() < deadline, "no leader 30 s after the database came back: {pair:?}");
        std::thread::sleep(Duration::from_millis(100));
    };
    eprintln!("after the outage: {} / {}", first.trim(), second.trim());
    ensure!(
        metric(&c.http_addr, "trainyard_lease_failures_total")? > 0.0,
        "the renewals that could not reach the database are counted"
    );
    finished_once_on_epoch_2(&c, job, 4 * 500)?;
    Ok(())
}

/// Starts a second controller on `c`'s database serving under a CA of its own; returns what it
/// said when it refused to join (it must exit 1).
fn join_under_a_new_ca(c: &Cluster) -> Result<String> {
    let pki = c.path("other-pki");
    let made = Command::new(bin("trainyard-controller")?).arg("init-pki").arg("--dir").arg(&pki).output()?;
    ensure!(made.status.success(), "init-pki: {}", String::from_utf8_lossy(&made.stderr));
    let db = c.db_url().expect("postgres").to_string();
    let (code, err) =
        second_controller(&["--db".as_ref(), db.as_ref(), "--tls-dir".as_ref(), pki.as_os_str()])?;
    ensure!(code == Some(1), "exit code {code:?}: {err}");
    Ok(err)
}

/// A controller whose TLS CA differs from the leader's (here: TLS against a plaintext leader)
/// refuses to join the group, saying why, and the leader leads on.
#[test]
fn a_controller_with_another_tls_ca_refuses_to_join_the_group() -> Result<()> {
    let c = Cluster::start_on(trainyard_tests::Backend::Postgres)?;
    let err = join_under_a_new_ca(&c)?;
    ensure!(
        err.contains("serves under the TLS CA with SHA-256")
            && err.contains("serves under plaintext (no --tls-dir)")
            && err.contains("Give every controller of the group the same --tls-dir"),
        "{err}"
    );
    ensure!(c.http("GET", "/healthz")?.1.starts_with("ok: leads"), "the leader leads on");
    ensure!(c.query("SELECT epoch FROM controller_lease")?[0][0] == 1);
    Ok(())
}

/// Two controllers that both serve TLS, under two different CAs, refuse to form a group: the
/// second names both CAs by their fingerprints and exits; the leader leads on.
#[test]
fn two_controllers_under_two_tls_cas_refuse_to_form_a_group() -> Result<()> {
    let Some(c) = Cluster::start_lab_tls(trainyard_tests::Backend::Postgres, 0, &[], &[])? else {
        return Ok(());
    };
    let err = join_under_a_new_ca(&c)?;
    let fingerprints: Vec<&str> = err.split("the TLS CA with SHA-256 ").skip(1).map(|r| &r[..16]).collect();
    ensure!(
        fingerprints.len() == 2 && fingerprints[0] != fingerprints[1] && !err.contains("plaintext"),
        "both CAs named, and they differ: {err}"
    );
    ensure!(err.contains("Give every controller of the group the same --tls-dir"), "{err}");
    ensure!(c.query("SELECT epoch FROM controller_lease")?[0][0] == 1, "the leader leads on");
    Ok(())
}

/// A controller that cannot reach its PostgreSQL at start refuses to start, naming the
/// database (its password hidden) and why; it never serves without its store.
#[test]
fn a_controller_that_cannot_reach_postgres_refuses_to_start() -> Result<()> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port(); // closed once dropped
    let db = format!("postgres://trainyard:secret@127.0.0.1:{port}/trainyard");
    let (code, err) = second_controller(&["--db".as_ref(), db.as_ref()])?;
    ensure!(code == Some(1), "exit code {code:?}: {err}");
    ensure!(
        err.contains(&format!(
            "failed to open the database postgres://trainyard:***@127.0.0.1:{port}/trainyard"
        )) && err.contains("the database is unavailable")
            && !err.contains("secret"),
        "{err}"
    );
    Ok(())
}
