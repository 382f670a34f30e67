//! One DNS name for a controller group, through the real resolver (docs/ha.md): agents and `ctl`
//! expand a controller URL whose host is a name into every address it resolves to, and find the
//! leader among them. Here the name lives in a network-namespace host's own /etc/hosts, which
//! gives it both controllers' addresses.

use std::process::Output;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use trainyard_tests::group::Member;
use trainyard_tests::{Backend, Cluster, bin};

/// `ctl` inside lab host 0, given only the group's name.
fn ctl_by_name(c: &Cluster, name: &str, args: &[&str]) -> Result<Output> {
    let mut command = c.lab().command(0, &bin("ctl")?);
    command.arg("--controller").arg(name).args(args);
    command.env_remove("TRAINYARD_TOKEN_FILE").env("HOME", c.dir.path());
    if let Some(pki) = c.pki() {
        command.env("TRAINYARD_CA", pki.join("ca.pem"));
    }
    if let Some(token) = &c.token {
        command.env("TRAINYARD_TOKEN", token);
    }
    command.output().context("run ctl in the lab host")
}

fn wait_succeeded(c: &Cluster, name: &str, job: &str, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        let out = ctl_by_name(c, name, &["status", job, "-o", "json"])?;
        if out.status.success() {
            let status: serde_json::Value = serde_json::from_slice(&out.stdout)?;
            match status["state"].as_str() {
                Some("succeeded") => return Ok(()),
                Some("failed" | "cancelled") => bail!("job {job} ended {status}"),
                _ => {}
            }
        }
        ensure!(Instant::now() < deadline, "job {job} did not succeed within {timeout:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Waits until `log` (a controller's log file) says node `agent` connected.
fn wait_connected(log: &std::path::Path, agent: &str, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    let needle = format!("agent_id=\"{agent}\"");
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if text.lines().any(|l| l.contains("agent connected") && l.contains(&needle)) {
            return Ok(());
        }
        ensure!(Instant::now() < deadline, "{agent} did not connect within {timeout:?}: {text}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Two controllers on one PostgreSQL, on two addresses of the lab bridge and one port; in the
/// agent's host `controllers.test` resolves to both (the follower's first). The agent and `ctl`
/// there are given only `http://controllers.test:PORT`: the agent connects to the leader, and
/// `ctl` submits (a write: it reaches the leader) and reads. The leader is killed: the follower
/// takes over, the agent finds it under the same name, and a second job submitted by name runs.
#[test]
fn one_name_for_the_group_finds_the_leader_and_follows_a_takeover() -> Result<()> {
    let Some(c) = Cluster::start_lab_on(Backend::Postgres, 1, &[])? else { return Ok(()) };
    one_name_for_the_group(c, "http")
}

/// The same under TLS, as an operator would issue the certificate: it names the group's name
/// and the first controller's address, not the second's. The second controller is reached
/// only through the name (agents and `ctl` check its certificate against the name they
/// resolved, not the address they dialed), so after the takeover nothing else would connect.
#[test]
fn one_name_for_the_group_under_tls_checks_the_certificate_against_the_name() -> Result<()> {
    let sans = ["controllers.test"];
    let Some(c) = Cluster::start_lab_tls(Backend::Postgres, 1, &[], &sans)? else { return Ok(()) };
    one_name_for_the_group(c, "https")
}

fn one_name_for_the_group(mut c: Cluster, scheme: &str) -> Result<()> {
    let port = c.addr.rsplit(':').next().context("the controller's port")?.to_string();
    let second = c.lab().second_gateway()?;
    let listen = format!("{second}:{port}");
    let flags: Vec<String> = match c.pki() {
        Some(pki) => vec!["--tls-dir".into(), pki.display().to_string()],
        None => vec!["--insecure-plaintext-on-network".into()],
    };
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let member = Member::start_at(&c, "standby", &listen, &flags)?;
    member.wait_log("following: another controller leads", Duration::from_secs(10))?;
    let gateway = c.lab().gateway();
    c.lab().set_hosts(0, &[(second, "controllers.test"), (gateway, "controllers.test")])?;
    let name = format!("{scheme}://controllers.test:{port}");
    c.agent_controllers = Some(name.clone());
    c.start_agent_on(0, "node-a", 2)?;
    wait_connected(&c.path("controller.log"), "node-a", Duration::from_secs(30))?;

    let job_file = c.job_file("by-name", 2, 2, &["--steps", "20", "--step-ms", "50"], "");
    let submit = |c: &Cluster| -> Result<String> {
        let out = ctl_by_name(c, &name, &["submit", &job_file.display().to_string()])?;
        ensure!(out.status.success(), "ctl submit by name: {}", String::from_utf8_lossy(&out.stderr));
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    };
    let first = submit(&c)?;
    wait_succeeded(&c, &name, &first, Duration::from_secs(60))?;

    c.kill_controller();
    member.wait_log("leading the controller group", Duration::from_secs(20))?;
    wait_connected(&member.log, "node-a", Duration::from_secs(30))?;
    let second_job = submit(&c)?;
    wait_succeeded(&c, &name, &second_job, Duration::from_secs(60))?;
    let nodes = ctl_by_name(&c, &name, &["nodes"])?;
    ensure!(
        nodes.status.success(),
        "ctl nodes by name after the takeover: {}",
        String::from_utf8_lossy(&nodes.stderr)
    );
    Ok(())
}
