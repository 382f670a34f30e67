//! GPU telemetry end to end (docs/telemetry.md): real controller, agents whose sampler replays
//! a telemetry script (no GPU here), and stand-in ranks.
//!
//! - A throttle on one GPU of a 16-rank job, its rank made slower at the same moment, is named
//!   live with its node, GPU and rank within 30 s of the onset (default 10 s windows and
//!   rounds), and the alert webhook (a local HTTP server) receives it opened and closed. A
//!   throttle on a GPU whose rank keeps pace is telemetry, not the verdict. The run's receipts
//!   are all there.
//! - On a group of two controllers, an alert the leader delivered is not sent again by the
//!   follower that takes over when the leader is killed; the new leader sends its closing.
//! - An XID 79 on a GPU of a running job fails the attempt as the GPU's (`gpu_xid`: the node
//!   blamed and drained, the job not charged), and the job finishes elsewhere.

use std::io::{BufRead, BufReader, Read, Write};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use trainyard_tests::group::Member;
use trainyard_tests::{Backend, Cluster, host_file};

/// A local webhook receiver: every POST body it got, answered 200.
fn receiver() -> Result<(String, Arc<Mutex<Vec<serde_json::Value>>>)> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let url = format!("http://{}/hook", listener.local_addr()?);
    let got = Arc::new(Mutex::new(Vec::new()));
    let sink = got.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let mut reader = BufReader::new(stream);
            let mut length = 0usize;
            let mut line = String::new();
            while reader.read_line(&mut line).is_ok_and(|n| n > 0) && line != "\r\n" {
                if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                    length = v.trim().parse().unwrap_or(0);
                }
                line.clear();
            }
            let mut body = vec![0u8; length];
            if reader.read_exact(&mut body).is_ok()
                && let Ok(v) = serde_json::from_slice(&body)
            {
                sink.lock().unwrap().push(v);
            }
            let _ = reader.get_mut().write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n");
        }
    });
    Ok((url, got))
}

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64
}

/// Starts agent `name` of `gpus` GPUs replaying telemetry script `script`.
fn agent(c: &mut Cluster, name: &str, gpus: u32, script: &std::path::Path) -> Result<()> {
    let host = host_file(&c.path("."), name, gpus);
    let telemetry = format!("script:{}", script.display());
    c.start_agent_env(
        name,
        &host,
        &[("TRAINYARD_TELEMETRY", &telemetry), ("TRAINYARD_TELEMETRY_EVERY_SECS", "0.5")],
    )
}

#[test]
fn a_throttle_that_slows_a_rank_is_named_live_and_alerted() -> Result<()> {
    let (hook, alerts) = receiver()?;
    let mut c = Cluster::start_with(&[("--alert-webhook", &hook)])?;
    // 16 ranks, 100 ms steps for ~80 s. Onset 20 s from now for 30 s: GPU 3 throttles (and
    // rank 11, on node-b's GPU 3, slows 2x); GPU 5 is power-capped, but its ranks keep pace.
    let onset = now_ms() + 20_000;
    let until = onset + 30_000;
    let throttle =
        r#""set": {"clock_reasons": "hw_thermal_slowdown", "sm_clock_mhz": 1100, "gpu_temp_c": 91}"#;
    let text = format!(
        r#"{{"base": {{"sm_clock_mhz": 1980, "max_sm_clock_mhz": 1980, "util_pct": 100, "gpu_temp_c": 60, "power_w": 610, "power_limit_w": 700}},
            "events": [{{"at_ms": {onset}, "until_ms": {until}, "gpu": 3, {throttle}}},
                       {{"at_ms": {onset}, "until_ms": {until}, "gpu": 5, "set": {{"clock_reasons": "sw_power_cap"}}}}]}}"#
    );
    let script = c.path("telemetry.json");
    std::fs::write(&script, text)?;
    agent(&mut c, "node-a", 8, &script)?;
    agent(&mut c, "node-b", 8, &script)?;
    let (from, to) = (onset.to_string(), until.to_string());
    let args = [
        "--steps",
        "800",
        "--step-ms",
        "100",
        "--slow-rank",
        "11",
        "--slow-factor",
        "2",
        "--slow-from-ms",
        &from,
        "--slow-until-ms",
        &to,
    ];
    let job = c.submit(&c.job_file("hot", 16, 8, &args, ""))?;
    c.wait_state(job, &["running"], Duration::from_secs(60))?;
    // An operator follows the live diagnosis from the start; it ends with the job.
    let follow = std::process::Command::new(trainyard_tests::bin("ctl")?)
        .args(["--controller", &c.url(), "diagnose", &job.to_string(), "--follow", "-o", "json"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    // Both agents replay the same script, so GPU 3 of node-a (rank 3) throttles too, and GPU 5
    // of both nodes (ranks 5 and 13) sits at its power cap. Only rank 11 slows: only
    // node-b/gpu3 explains anything.
    let deadline = Instant::now() + Duration::from_secs(90);
    let named = loop {
        let rows = c.query_text(&format!(
            "SELECT cause, subject, CAST(opened_at_ms AS TEXT), summary FROM live_findings WHERE job_id = {job}"
        ))?;
        if let Some(row) = rows.iter().find(|r| r[0] == "gpu.thermal_throttle") {
            break row.clone();
        }
        ensure!(Instant::now() < deadline, "no thermal finding 90 s after submit; findings: {rows:?}");
        std::thread::sleep(Duration::from_millis(250));
    };
    let after = named[2].parse::<i64>()? - onset;
    eprintln!("throttle named {after} ms after its onset: {}", named[3]);
    ensure!(named[1] == "node-b/gpu3", "{named:?}");
    ensure!(named[3].contains("rank 11"), "{named:?}");
    ensure!(after < 30_000, "named {after} ms after the onset (target: 30 s)");
    // While it is open, Prometheus sees it.
    let metrics = c.http("GET", "/metrics")?.1;
    ensure!(
        metrics.lines().any(|l| l.starts_with("trainyard_job_finding{")
            && l.contains("cause=\"gpu.thermal_throttle\"")
            && l.contains("node=\"node-b\"")),
        "{metrics}"
    );
    // The agent exports the GPU under DCGM exporter's names with the rank's labels.
    let agent_metrics = trainyard_tests::http(&c.agent_metrics_addr("node-b")?, "GET", "/metrics")?.1;
    ensure!(
        agent_metrics.lines().any(|l| l.starts_with("DCGM_FI_DEV_SM_CLOCK{") && l.contains("rank=\"11\"")),
        "{agent_metrics}"
    );
    let status = c.wait_state(job, &["succeeded", "failed"], Duration::from_secs(120))?;
    ensure!(status["state"] == "succeeded", "{status}");
    // `ctl diagnose --follow` printed the finding when it opened and when it closed, then
    // returned when the job ended.
    let followed = follow.wait_with_output()?;
    let lines = String::from_utf8_lossy(&followed.stdout).into_owned();
    ensure!(followed.status.success(), "diagnose --follow: {}", String::from_utf8_lossy(&followed.stderr));
    let events: Vec<serde_json::Value> = lines.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    let thermal = |event: &str| {
        events.iter().any(|e| {
            e["event"] == event && e["cause"] == "gpu.thermal_throttle" && e["subject"] == "node-b/gpu3"
        })
    };
    ensure!(thermal("opened") && (thermal("closed") || thermal("was")), "diagnose --follow printed: {lines}");
    // The other throttles explained nothing: no finding names them.
    let causes = c.query_text(&format!("SELECT cause, subject FROM live_findings WHERE job_id = {job}"))?;
    ensure!(
        causes.iter().all(|r| r[0] != "gpu.power_capped" && r[1] != "node-a/gpu3"),
        "a throttle whose rank kept pace became a finding: {causes:?}"
    );
    let diagnosis = c.ctl_ok(&["diagnose", &job.to_string(), "-o", "json"])?;
    let d: serde_json::Value = serde_json::from_str(&diagnosis)?;
    let notes = d["notes"].to_string();
    ensure!(notes.contains("sw_power_cap") && notes.contains("not a cause"), "{diagnosis}");
    // Receipts are unaffected: every step of every rank is stored.
    let steps = c.query(&format!("SELECT COUNT(*) FROM receipts WHERE job_id = {job} AND kind = 'step'"))?;
    ensure!(steps[0][0] == 16 * 800, "{} step receipts", steps[0][0]);
    let windows = c.query(&format!("SELECT COUNT(*) FROM gpu_samples WHERE job_id = {job}"))?[0][0];
    ensure!(windows >= 16 * 6, "{windows} telemetry windows stored");
    // The job page marks the finding on the step-time plot and plots the node's telemetry.
    match trainyard_tests::chromium() {
        None => println!("skipped: the web view's bands and telemetry plots: chromium is not installed"),
        Some(_) => {
            let url = format!("http://{}/jobs/{job}", c.http_addr);
            let shot = std::env::var_os("TRAINYARD_SCREENSHOTS")
                .map(|d| std::path::PathBuf::from(d).join("job-telemetry.png"));
            let page = trainyard_tests::browse(&url, Duration::from_secs(10), shot.as_deref())?;
            ensure!(page.contains(r#"data-ready="1""#), "job page not ready: {page}");
            let findings = page.split(r#"id="live-findings""#).nth(1).unwrap_or("");
            ensure!(findings.contains("gpu.thermal_throttle") && findings.contains("node-b/gpu3"), "{page}");
            let step_plot = page.split(r#"id="plot-step_ms""#).nth(1).unwrap_or("");
            let attrs = &step_plot[..step_plot.find('>').unwrap_or(0)];
            ensure!(
                attrs.contains("data-bands=\"") && !attrs.contains("data-bands=\"0\""),
                "no band: {attrs}"
            );
            for m in ["sm_clock", "power", "temp"] {
                let plot = page.split(&format!(r#"id="plot-telemetry-{m}""#)).nth(1).unwrap_or("");
                ensure!(
                    plot.split(r#"id="plot-"#).next().unwrap_or("").contains("<canvas"),
                    "no {m} plot: {page}"
                );
            }
        }
    }
    // The webhook got the finding opened, then closed (the throttle ended or the job did).
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let got = alerts.lock().unwrap().clone();
        let of = |event: &str| {
            got.iter().filter(|a| a["cause"] == "gpu.thermal_throttle" && a["event"] == event).count()
        };
        if of("opened") == 1 && of("closed") == 1 {
            let opened = got.iter().find(|a| a["event"] == "opened").context("opened")?;
            ensure!(opened["text"].as_str().unwrap_or("").contains("node-b"), "{opened}");
            break;
        }
        ensure!(Instant::now() < deadline, "alerts received: {got:?}");
        std::thread::sleep(Duration::from_millis(250));
    }
    Ok(())
}

/// The alerts the webhook got of `cause`'s `event` ("opened" or "closed").
fn alerts_of(alerts: &Mutex<Vec<serde_json::Value>>, cause: &str, event: &str) -> usize {
    alerts.lock().unwrap().iter().filter(|a| a["cause"] == cause && a["event"] == event).count()
}

/// Two controllers on PostgreSQL, both with the webhook: the leader names a throttle live and
/// delivers its opening alert, then is SIGKILLed. The follower takes over, finds the finding
/// open and its opening delivered (the store says so), and sends only the closing alert when
/// the job ends: each event once across the takeover.
#[test]
fn an_alert_delivered_before_a_takeover_is_not_sent_again_by_the_new_leader() -> Result<()> {
    let (hook, alerts) = receiver()?;
    let live = [("--alert-webhook", hook.as_str()), ("--live-diagnosis-secs", "2")];
    let mut c = Cluster::start_on_with(Backend::Postgres, &live)?;
    let member = Member::start_at(&c, "standby", "127.0.0.1:0", &live.map(|(k, v)| [k, v]).concat())?;
    member.wait_log("following: another controller leads", Duration::from_secs(10))?;
    c.agent_controllers = Some(format!("{},{}", c.url(), member.url));
    // GPU 3 throttles from 6 s on, and its rank computes 2x slower, until the job ends.
    let onset = now_ms() + 6_000;
    let until = onset + 600_000;
    let text = format!(
        r#"{{"base": {{"sm_clock_mhz": 1980, "max_sm_clock_mhz": 1980, "util_pct": 100, "gpu_temp_c": 60}},
            "events": [{{"at_ms": {onset}, "until_ms": {until}, "gpu": 3,
                         "set": {{"clock_reasons": "hw_thermal_slowdown", "sm_clock_mhz": 1100, "gpu_temp_c": 91}}}}]}}"#
    );
    let script = c.path("telemetry.json");
    std::fs::write(&script, text)?;
    agent(&mut c, "node-a", 8, &script)?;
    let (from, to) = (onset.to_string(), until.to_string());
    let args = ["--steps", "300", "--step-ms", "100", "--slow-rank", "3", "--slow-factor", "2"];
    let args: Vec<&str> = args.into_iter().chain(["--slow-from-ms", &from, "--slow-until-ms", &to]).collect();
    let job = c.submit(&c.job_file("hot", 8, 8, &args, ""))?;
    const CAUSE: &str = "gpu.thermal_throttle";
    let deadline = Instant::now() + Duration::from_secs(60);
    while alerts_of(&alerts, CAUSE, "opened") == 0 {
        ensure!(Instant::now() < deadline, "no opening alert: {:?}", alerts.lock().unwrap());
        std::thread::sleep(Duration::from_millis(100));
    }
    ensure!(c.status(job)?["state"] == "running", "the job ended before the takeover: {}", c.status(job)?);
    c.kill_controller();
    member.wait_log("leading the controller group", Duration::from_secs(20))?;
    c.addr = member.url.trim_start_matches("http://").to_string();
    let status = c.wait_state(job, &["succeeded", "failed", "cancelled"], Duration::from_secs(120))?;
    ensure!(status["state"] == "succeeded", "{status}");
    // The job's end closes the finding: the new leader alerts it, once.
    let deadline = Instant::now() + Duration::from_secs(20);
    while alerts_of(&alerts, CAUSE, "closed") == 0 {
        ensure!(
            Instant::now() < deadline,
            "no closing alert from the new leader: {:?}",
            alerts.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_secs(3));
    let (opened, closed) = (alerts_of(&alerts, CAUSE, "opened"), alerts_of(&alerts, CAUSE, "closed"));
    ensure!(
        (opened, closed) == (1, 1),
        "opened {opened}, closed {closed} times: {:?}",
        alerts.lock().unwrap()
    );
    ensure!(member.logs().contains("finding closed"), "the new leader did not close it: {}", member.logs());
    Ok(())
}

#[test]
fn an_xid_79_fails_the_attempt_as_the_gpus_and_cordons_the_node() -> Result<()> {
    let mut c = Cluster::start()?;
    let script = c.path("telemetry.json");
    let at = now_ms() + 12_000;
    std::fs::write(
        &script,
        format!(
            r#"{{"base": {{"sm_clock_mhz": 1980}}, "events": [{{"at_ms": {at}, "gpu": 1, "xid": 79}}]}}"#
        ),
    )?;
    agent(&mut c, "node-c", 2, &script)?;
    let job = c.submit(&c.job_file(
        "xid",
        2,
        2,
        &["--steps", "400", "--step-ms", "50"],
        "[restart]\nmax_restarts = 0\n",
    ))?;
    c.wait_state(job, &["running"], Duration::from_secs(60))?;
    // A spare node with a quiet script takes the restart.
    let quiet = c.path("quiet.json");
    std::fs::write(&quiet, r#"{"base": {"sm_clock_mhz": 1980}}"#)?;
    agent(&mut c, "node-d", 2, &quiet)?;
    let status = c.wait_state(job, &["succeeded", "failed"], Duration::from_secs(120))?;
    ensure!(status["state"] == "succeeded", "not charged: max_restarts 0 did not fail it: {status}");
    let f = &status["failures"][0];
    ensure!(f["kind"] == "gpu_xid" && f["blamed"] == true && f["charged"] == false, "{status}");
    let evidence = f["evidence"].as_str().unwrap_or("");
    ensure!(evidence.contains("XID 79 (GPU has fallen off the bus) on GPU 1 of node-c"), "{evidence}");
    let after = f["at_ms"].as_i64().unwrap_or(0) - at;
    eprintln!("XID 79 failed the attempt {after} ms after the driver reported it (scripted)");
    ensure!((0..30_000).contains(&after), "acted on {after} ms after the XID (target: 30 s)");
    let node = c.node("node-c")?;
    // Drained: a quick preflight cannot tell a reset GPU from a broken one; an operator can.
    ensure!(node["cordon_by"] == "drain", "{node}");
    ensure!(node["cordon_reason"].as_str().unwrap_or("").contains("XID 79"), "{node}");
    let xids = c.query("SELECT COUNT(*) FROM gpu_samples WHERE agent_id = 'node-c' AND xids = '79'")?;
    ensure!(xids[0][0] == 1, "the XID is stored once with its window");
    Ok(())
}
