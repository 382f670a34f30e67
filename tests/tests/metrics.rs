//! The controller's `/metrics` (Prometheus) and `/healthz` on its HTTP listener, and gRPC
//! health checking (`grpc.health.v1`), against a running cluster.

use std::time::Duration;

use anyhow::{Context, ensure};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use trainyard_tests::Cluster;

/// The value of the sample `name` (with its labels, as written) in an OpenMetrics text.
fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.split(' ').next()?.parse().ok())
}

#[test]
fn metrics_count_what_the_store_holds_and_bad_requests_are_4xx() -> anyhow::Result<()> {
    let mut c = Cluster::start()?;
    c.start_agent("node-a", 2)?;
    let job = c.submit(&c.job_file("metered", 2, 2, &["--steps", "40", "--step-ms", "50"], ""))?;
    // While it runs, the agent counts its two ranks running.
    let agent = c.agent_metrics_addr("node-a")?;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (code, text) = trainyard_tests::http(&agent, "GET", "/metrics")?;
        ensure!(code == 200, "{code}: {text}");
        if sample(&text, "trainyard_agent_ranks{phase=\"running\"}") == Some(2.0) {
            break;
        }
        ensure!(std::time::Instant::now() < deadline, "agent metrics:\n{text}");
        std::thread::sleep(Duration::from_millis(100));
    }
    let status = c.wait_state(job, &["succeeded", "failed"], Duration::from_secs(60))?;
    ensure!(status["state"] == "succeeded", "{status}");

    let stored = c.query(&format!("SELECT COUNT(*) FROM receipts WHERE job_id = {job}"))?[0][0] as f64;
    // Receipts can trail the final state by a batch: wait until the counter caught up.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let text = loop {
        let (code, text) = c.http("GET", "/metrics")?;
        ensure!(code == 200, "{code}: {text}");
        let stored = c.query(&format!("SELECT COUNT(*) FROM receipts WHERE job_id = {job}"))?[0][0] as f64;
        if sample(&text, "trainyard_receipts_ingested_total") == Some(stored) {
            break text;
        }
        ensure!(std::time::Instant::now() < deadline, "ingested != {stored} stored:\n{text}");
        std::thread::sleep(Duration::from_millis(200));
    };
    ensure!(stored >= 84.0, "launch, 40 steps and exit per rank: {stored}");
    ensure!(sample(&text, "trainyard_jobs_finished_total{state=\"succeeded\"}") == Some(1.0), "{text}");
    ensure!(sample(&text, "trainyard_jobs{state=\"running\"}") == Some(0.0), "{text}");
    ensure!(sample(&text, "trainyard_agents_connected") == Some(1.0), "{text}");
    let inserts = sample(&text, "trainyard_store_operation_seconds_count{op=\"insert_receipts\"}");
    ensure!(inserts.is_some_and(|n| n >= 1.0), "{text}");
    ensure!(sample(&text, "trainyard_schedule_pass_seconds_count").is_some_and(|n| n >= 1.0), "{text}");
    ensure!(sample(&text, "trainyard_receipt_batch_seconds_count").is_some_and(|n| n >= 1.0), "{text}");
    ensure!(text.trim_end().ends_with("# EOF"), "OpenMetrics text ends with # EOF");

    // The agent's, once the job ended: its ranks forgotten, nothing left to relay, and at
    // least every stored receipt relayed.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let text = loop {
        let (code, text) = trainyard_tests::http(&agent, "GET", "/metrics")?;
        ensure!(code == 200, "{code}: {text}");
        let held: f64 = ["launching", "running", "exited", "lost"]
            .iter()
            .filter_map(|p| sample(&text, &format!("trainyard_agent_ranks{{phase=\"{p}\"}}")))
            .sum();
        if held == 0.0 && sample(&text, "trainyard_agent_receipt_lag_bytes") == Some(0.0) {
            break text;
        }
        ensure!(std::time::Instant::now() < deadline, "agent metrics:\n{text}");
        std::thread::sleep(Duration::from_millis(300));
    };
    ensure!(sample(&text, "trainyard_agent_connected") == Some(1.0), "{text}");
    let relayed = sample(&text, "trainyard_agent_receipts_relayed_total").unwrap_or(0.0);
    ensure!(relayed >= stored, "relayed {relayed} < stored {stored}: {text}");
    ensure!(
        sample(&text, "trainyard_agent_receipt_bytes_relayed_total").is_some_and(|b| b > 1_000.0),
        "{text}"
    );
    ensure!(trainyard_tests::http(&agent, "GET", "/healthz")?.0 == 200);
    ensure!(trainyard_tests::http(&agent, "GET", "/x")?.0 == 404);

    // A lone controller leads; probes match the leading "ok".
    ensure!(c.http("GET", "/healthz")? == (200, "ok: leads\n".to_string()));
    let (code, body) = c.http("GET", "/nope/%ff?x=%%")?;
    ensure!(code == 404 && body.contains("serves the web view at /, /metrics"), "{code}: {body}");
    let (code, body) = c.http("GET", "/api/jobs/%ff?x=%%")?;
    ensure!(code == 400 && body.contains("Invalid UTF-8"), "{code}: {body}");
    let (code, _) = c.http("POST", "/metrics")?;
    ensure!(code == 405, "POST /metrics: {code}");
    Ok(())
}

#[test]
fn grpc_health_reports_both_services_serving() -> anyhow::Result<()> {
    let c = Cluster::start()?;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async {
        let channel = tonic::transport::Endpoint::from_shared(c.url())?.connect().await.context("connect")?;
        let mut health = HealthClient::new(channel);
        for service in ["trainyard.v1.Jobs", "trainyard.v1.Agents", ""] {
            let reply = health.check(HealthCheckRequest { service: service.into() }).await?.into_inner();
            ensure!(reply.status == ServingStatus::Serving as i32, "{service:?}: {reply:?}");
        }
        let unknown = health.check(HealthCheckRequest { service: "nope.v1.Nothing".into() }).await;
        ensure!(unknown.is_err_and(|s| s.code() == tonic::Code::NotFound), "unknown service");
        Ok(())
    })
}
