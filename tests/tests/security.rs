//! Nobody runs, reads or forges anything without a credential: a controller serving TLS (the
//! PKI of `init-pki`), agents with client certificates, users with tokens, ranks run as their
//! user's Unix account. Real processes, real TLS.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use tokio_stream::wrappers::ReceiverStream;
use trainyard_controller::auth::pki;
use trainyard_proto::PROTOCOL_VERSION;
use trainyard_proto::v1::agents_client::AgentsClient;
use trainyard_proto::v1::{
    AgentMessage, Hello, RankKey, RankReport, RankUpdate, Receipt, ReceiptBatch, agent_message,
};
use trainyard_tests::{Cluster, proc_status_field, run_account};

/// A job of `gpus` ranks that each sleep: nothing a rank run as `nobody` cannot do.
fn sleep_job(c: &Cluster, name: &str, gpus: u32) -> PathBuf {
    let text = format!(
        "name = {name:?}\n[resources]\ngpus = {gpus}\ngpus_per_node = {gpus}\n\n\
         [engine]\nkind = \"exec\"\nargv = [\"sleep\", \"60\"]\nworkdir = \"/\"\n"
    );
    let path = c.path(&format!("{name}.toml"));
    std::fs::write(&path, text).expect("write job file");
    path
}

fn stderr_of(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn controller_alive(c: &Cluster) -> bool {
    c.controller_pid().is_some_and(|pid| Path::new(&format!("/proc/{pid}")).exists())
        && c.ctl(&["status"]).is_ok_and(|o| o.status.success())
}

#[test]
fn calls_without_a_valid_credential_are_refused_and_store_nothing() -> anyhow::Result<()> {
    let mut c = Cluster::start_secure()?;
    c.start_agent("sxm-a", 2)?;
    let account = run_account();
    let carol = c.add_user("carol", &["--unix-user", &account])?;
    let job = sleep_job(&c, "nap", 1);
    let file = job.display().to_string();

    let none = c.ctl_as(None, &["submit", &file])?;
    assert!(!none.status.success());
    assert!(stderr_of(&none).contains("no token"), "{}", stderr_of(&none));
    let wrong = c.ctl_as(Some("tyt_0000000000000000"), &["submit", &file])?;
    assert!(stderr_of(&wrong).contains("did not accept your credentials"), "{}", stderr_of(&wrong));
    let out = c.admin(&["user", "revoke", "carol"])?;
    assert!(out.status.success(), "{}", stderr_of(&out));
    let revoked = c.ctl_as(Some(&carol), &["submit", &file])?;
    assert!(stderr_of(&revoked).contains("revoked"), "{}", stderr_of(&revoked));
    let listed = c.ctl_as(Some(&carol), &["status"])?;
    assert!(!listed.status.success(), "a revoked token reads nothing");

    // Plain-text gRPC against the TLS port: no answer, and the daemon stays up.
    let plain = std::process::Command::new(trainyard_tests::bin("ctl")?)
        .args(["--controller", &format!("http://{}", c.addr), "status"])
        .env("TRAINYARD_TOKEN", c.token.as_deref().unwrap_or_default())
        .output()?;
    assert!(!plain.status.success(), "plaintext against TLS must fail");

    assert_eq!(c.query("SELECT COUNT(*) FROM jobs")?[0][0], 0, "nothing was stored");
    let refused =
        c.query("SELECT COUNT(*) FROM audit_log WHERE outcome = 'refused' AND action = 'job.submit'")?;
    assert_eq!(refused[0][0], 3, "each refused submit is audited");
    let actors = c.query_text("SELECT actor FROM audit_log WHERE action = 'token.revoke'")?;
    assert!(actors[0][0].starts_with("cli:"), "{actors:?}");
    assert!(controller_alive(&c), "the controller survives bad credentials");

    // An agent whose certificate expired never gets in; the controller stays up.
    let dir = c.path("expired-agent");
    std::fs::create_dir_all(&dir)?;
    let past = time::OffsetDateTime::now_utc() - time::Duration::days(2);
    let validity = pki::Validity { not_before: past - time::Duration::days(1), not_after: past };
    let (cert, key) = pki::agent_cert(c.pki().context("pki")?, "sxm-old", validity)?;
    std::fs::write(dir.join("agent.pem"), cert)?;
    std::fs::write(dir.join("agent.key"), key)?;
    std::fs::copy(c.pki().context("pki")?.join("ca.pem"), dir.join("ca.pem"))?;
    let host = trainyard_tests::host_file(c.dir.path(), "sxm-old", 1);
    let mut agent = std::process::Command::new(trainyard_tests::bin("trainyard-agent")?)
        .args(["--controller", &c.url(), "--agent-id", "sxm-old", "--tls-dir"])
        .arg(&dir)
        .arg("--host-file")
        .arg(&host)
        .arg("--data-dir")
        .arg(c.path("agent-sxm-old"))
        .stderr(std::fs::File::create(c.path("agent-sxm-old.log"))?)
        .spawn()?;
    std::thread::sleep(Duration::from_secs(3));
    let _ = agent.kill();
    let _ = agent.wait();
    let seen = c.query("SELECT COUNT(*) FROM agents WHERE agent_id = 'sxm-old'")?;
    assert_eq!(seen[0][0], 0, "an expired certificate is refused at the handshake");
    let log = std::fs::read_to_string(c.path("agent-sxm-old.log"))?;
    assert!(log.contains("cannot reach controller") || log.contains("disconnected"), "{log}");
    assert!(controller_alive(&c));
    Ok(())
}

#[test]
fn users_reach_only_their_own_jobs_and_admins_reach_all() -> anyhow::Result<()> {
    let mut c = Cluster::start_secure()?;
    c.start_agent("sxm-a", 2)?;
    let account = run_account();
    let alice = c.add_user("alice", &["--unix-user", &account])?;
    let bob = c.add_user("bob", &["--unix-user", &account])?;
    let nobody_mapped = c.add_user("dave", &[])?;
    let job = c.submit_as(&alice, &sleep_job(&c, "alice-nap", 1))?;
    let id = job.to_string();
    c.wait_state(job, &["running"], Duration::from_secs(20))?;

    for args in [vec!["cancel", &id], vec!["watch", &id], vec!["logs", &id], vec!["status", &id]] {
        let out = c.ctl_as(Some(&bob), &args)?;
        assert!(!out.status.success(), "bob may not {args:?}");
        assert!(stderr_of(&out).contains("permission denied: job"), "{args:?}: {}", stderr_of(&out));
    }
    let bobs_list = c.ctl_as(Some(&bob), &["status", "-o", "json"])?;
    let listed: serde_json::Value = serde_json::from_slice(&bobs_list.stdout)?;
    assert_eq!(listed.as_array().map(Vec::len), Some(0), "bob sees none of alice's jobs: {listed}");
    let alices: serde_json::Value =
        serde_json::from_slice(&c.ctl_as(Some(&alice), &["status", "-o", "json"])?.stdout)?;
    assert_eq!(alices[0]["user"], "alice", "{alices}");
    // Only admins run preflight; a user without a Unix account cannot submit at all.
    let preflight = c.ctl_as(Some(&bob), &["preflight", "sxm-a", "--run", "quick"])?;
    assert!(stderr_of(&preflight).contains("only admins"), "{}", stderr_of(&preflight));
    let unmapped =
        c.ctl_as(Some(&nobody_mapped), &["submit", &sleep_job(&c, "d", 1).display().to_string()])?;
    assert!(stderr_of(&unmapped).contains("no Unix account"), "{}", stderr_of(&unmapped));
    let high = std::fs::read_to_string(sleep_job(&c, "rush", 1))?
        .replace("[resources]", "priority = 5\n[resources]");
    std::fs::write(c.path("rush.toml"), high)?;
    let rushed = c.ctl_as(Some(&bob), &["submit", &c.path("rush.toml").display().to_string()])?;
    assert!(stderr_of(&rushed).contains("priority 5 is above 0"), "{}", stderr_of(&rushed));

    assert_eq!(c.status(job)?["state"], "running", "bob's attempts changed nothing");
    c.ctl_ok(&["cancel", &id])?; // the admin may
    c.wait_state(job, &["cancelled"], Duration::from_secs(20))?;
    let refusals = c.query_text(
        "SELECT action, target FROM audit_log WHERE actor = 'bob' AND outcome = 'refused' ORDER BY id",
    )?;
    let actions: Vec<&str> = refusals.iter().map(|r| r[0].as_str()).collect();
    assert_eq!(actions, ["job.cancel", "job.watch", "job.logs", "job.get", "node.preflight", "job.submit"]);
    let accepted = c.query_text(
        "SELECT actor, action FROM audit_log WHERE outcome = 'accepted' AND action IN ('job.submit', 'job.cancel') ORDER BY id",
    )?;
    assert_eq!(accepted, [["alice", "job.submit"], ["admin", "job.cancel"]]);
    Ok(())
}

#[test]
fn ranks_run_as_their_users_account_never_root() -> anyhow::Result<()> {
    if unsafe { libc::geteuid() } != 0 {
        println!("skipped: switching a rank's user needs the agent to run as root; these tests do not");
        return Ok(());
    }
    let mut c = Cluster::start_secure()?;
    c.start_agent("sxm-a", 2)?;
    let nobody = trainyard_agent_uid("nobody")?;
    let alice = c.add_user("alice", &["--unix-user", "nobody"])?;
    let job = c.submit_as(&alice, &sleep_job(&c, "as-alice", 2))?;
    let status = c.wait_state(job, &["running"], Duration::from_secs(20))?;
    for rank in status["ranks"].as_array().context("ranks")? {
        let pid = rank["pid"].as_u64().context("pid")? as u32;
        let uid = proc_status_field(pid, "Uid").context("Uid")?;
        let gid = proc_status_field(pid, "Gid").context("Gid")?;
        let ids: Vec<u32> = uid.split_whitespace().map(|v| v.parse().unwrap_or(0)).collect();
        assert_eq!(ids, vec![nobody; 4], "real, effective, saved and fs uid of rank {}: {uid}", rank["rank"]);
        assert!(!gid.split_whitespace().any(|g| g == "0"), "no root group: {gid}");
        let groups = proc_status_field(pid, "Groups").unwrap_or_default();
        assert!(!groups.split_whitespace().any(|g| g == "0"), "no root supplementary group: {groups}");
    }
    // The rank's own files are the user's.
    use std::os::unix::fs::MetadataExt as _;
    let run_dir = c.run_dir("sxm-a", job).context("the job's run directory")?;
    let rank_dir = run_dir.join(format!("attempt-{}/rank-0", status["attempt"]));
    for f in ["receipts.jsonl", "stdout.log", "stderr.log"] {
        assert_eq!(std::fs::metadata(rank_dir.join(f))?.uid(), nobody, "{f}");
    }
    c.ctl_ok(&["cancel", &job.to_string()])?;
    c.wait_state(job, &["cancelled"], Duration::from_secs(20))?;

    // An account this node lacks: the agent refuses the launch and says why.
    let erin = c.add_user("erin", &["--unix-user", "no-such-account-here"])?;
    let job = c.submit_as(&erin, &sleep_job(&c, "as-erin", 1))?;
    let failed = c.wait_state(job, &["failed"], Duration::from_secs(30))?;
    assert!(failed.to_string().contains("no Unix account"), "{failed}");
    Ok(())
}

fn trainyard_agent_uid(name: &str) -> anyhow::Result<u32> {
    let out = std::process::Command::new("id").args(["-u", name]).output()?;
    Ok(String::from_utf8_lossy(&out.stdout).trim().parse()?)
}

#[test]
fn agents_speak_only_for_themselves() -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
    let mut c = Cluster::start_secure()?;
    c.start_agent("sxm-b", 1)?;
    let account = run_account();
    let bob = c.add_user("bob", &["--unix-user", &account])?;
    let job = c.submit_as(&bob, &sleep_job(&c, "bobs", 1))?;
    c.wait_state(job, &["running"], Duration::from_secs(20))?;
    let a_dir = c.agent_cert("sxm-a")?;
    let url = c.url();

    // Agent A's valid certificate, hello as B.
    let status = rt.block_on(connect_as(&url, &a_dir, "sxm-b", vec![])).expect_err("impostor hello accepted");
    assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status:?}");
    assert!(status.message().contains("agent sxm-a's"), "{}", status.message());
    // B's own certificate while B is connected: a second stream is refused.
    let b_dir = c.agent_cert("sxm-b")?;
    let twice = rt.block_on(connect_as(&url, &b_dir, "sxm-b", vec![])).expect_err("second stream accepted");
    assert_eq!(twice.code(), tonic::Code::AlreadyExists, "{twice:?}");
    // A, as itself, sending receipts of B's rank, then a report on it.
    let attempt = c.status(job)?["attempt"].as_u64().context("attempt")? as u32;
    let key = RankKey { job_id: job, attempt, rank: 0 };
    let receipt = Receipt {
        key: Some(key),
        seq: 0,
        kind: "step".into(),
        step: 1,
        body: r#"{"kind":"step","step":1}"#.into(),
    };
    let forged =
        AgentMessage { msg: Some(agent_message::Msg::Receipts(ReceiptBatch { receipts: vec![receipt] })) };
    let ended =
        rt.block_on(connect_as(&url, &a_dir, "sxm-a", vec![forged])).expect_err("forged receipts accepted");
    assert_eq!(ended.code(), tonic::Code::PermissionDenied, "{ended:?}");
    assert!(ended.message().contains("which runs on sxm-b"), "{}", ended.message());
    let report = RankReport { key: Some(key), state: "exited".into(), exit_code: 0, ..Default::default() };
    let update =
        AgentMessage { msg: Some(agent_message::Msg::RankUpdate(RankUpdate { report: Some(report) })) };
    let ended =
        rt.block_on(connect_as(&url, &a_dir, "sxm-a", vec![update])).expect_err("forged report accepted");
    assert_eq!(ended.code(), tonic::Code::PermissionDenied, "{ended:?}");

    assert_eq!(c.query(&format!("SELECT COUNT(*) FROM receipts WHERE job_id = {job}"))?[0][0], 0);
    assert_eq!(c.status(job)?["state"], "running", "B's job is untouched");
    assert_eq!(c.status(job)?["ranks"][0]["state"], "running");
    assert!(c.logs("controller").contains("impostor"), "the refusal is logged");
    Ok(())
}

/// Dials `url` with the TLS files in `dir`, says hello as `agent_id`, sends `then`, and waits
/// for the stream to end: `Err` with the status it ended with.
async fn connect_as(
    url: &str,
    dir: &Path,
    agent_id: &str,
    then: Vec<AgentMessage>,
) -> Result<(), tonic::Status> {
    use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};
    let read = |f: &str| std::fs::read(dir.join(f)).expect("tls file");
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(read("ca.pem")))
        .identity(Identity::from_pem(read("agent.pem"), read("agent.key")));
    let channel = Endpoint::from_shared(url.to_string())
        .expect("url")
        .tls_config(tls)
        .expect("tls")
        .connect()
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    let hello = Hello {
        protocol_version: PROTOCOL_VERSION,
        agent_id: agent_id.into(),
        address: "127.0.0.1".into(),
        inventory: None,
        ranks: vec![],
        agent_version: "impostor".into(),
        preflight: None,
        join_token: String::new(),
    };
    tx.send(AgentMessage { msg: Some(agent_message::Msg::Hello(hello)) }).await.expect("queue hello");
    for m in then {
        tx.send(m).await.expect("queue message");
    }
    let mut inbound = AgentsClient::new(channel).connect(ReceiverStream::new(rx)).await?.into_inner();
    let deadline = tokio::time::sleep(Duration::from_secs(10));
    tokio::pin!(deadline);
    loop {
        tokio::select! {
            _ = &mut deadline => return Ok(()),
            msg = inbound.message() => match msg {
                Ok(Some(_)) => continue,
                Ok(None) => return Ok(()),
                Err(status) => return Err(status),
            },
        }
    }
}
