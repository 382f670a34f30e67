//! No caller exhausts what every caller shares: a user holds at most 16 `watch`/`logs` streams
//! at once, and a stream given up frees its place; an address that floods the controller with
//! calls it has no credential for is turned away at accept, while the agents' streams go on. (Pending jobs per user, refused-call auditing
//! and slow log clients are tested in the controller's unit tests; the ingest rate under attack
//! is `tests/benches/receipts_under_attack.rs`.)

use std::time::{Duration, Instant};

use anyhow::Result;
use trainyard_controller::service::MAX_STREAMS_PER_USER;
use trainyard_proto::v1::jobs_client::JobsClient;
use trainyard_proto::v1::{ListJobsRequest, WatchRequest};
use trainyard_tests::Cluster;

#[test]
fn a_user_holds_so_many_streams_and_a_closed_one_frees_its_place() -> Result<()> {
    let mut c = Cluster::start()?;
    c.start_agent("node-a", 1)?;
    let file = c.job_file("long", 1, 0, &["--steps", "600", "--step-ms", "100"], "");
    let job = c.submit(&file)?;
    c.wait_state(job, &["running"], Duration::from_secs(20))?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let url = c.url();
    rt.block_on(async {
        let channel = tonic::transport::Endpoint::from_shared(url)?.connect().await?;
        let mut client = JobsClient::new(channel);
        let watch = WatchRequest { job_id: job, after_position: 0 };
        let mut open = Vec::new();
        for _ in 0..MAX_STREAMS_PER_USER {
            open.push(client.watch(watch).await?.into_inner());
        }
        let refused = client.watch(watch).await.expect_err("one stream over the cap");
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted, "{refused:?}");
        assert!(refused.message().contains(&format!("({MAX_STREAMS_PER_USER})")), "{}", refused.message());
        // Closing one frees its place (the server notices the reset within moments).
        drop(open.pop());
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match client.watch(watch).await {
                Ok(stream) => {
                    open.push(stream.into_inner());
                    break;
                }
                Err(s) if s.code() == tonic::Code::ResourceExhausted && Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(s) => anyhow::bail!("the freed place was not given back: {s:?}"),
            }
        }
        anyhow::Ok(())
    })?;
    c.ctl_ok(&["cancel", &job.to_string()])?;
    Ok(())
}

#[test]
fn a_flood_of_bad_tokens_is_turned_away_at_accept_and_the_agents_stream_goes_on() -> Result<()> {
    use trainyard_controller::auth::door::{ACCEPTS_PER_SEC_WHEN_LIMITED, REFUSALS_BURST};
    let mut c = Cluster::start_secure()?;
    c.start_agent("node-a", 1)?;
    let file = c.job_file("steady", 1, 0, &["--steps", "60", "--step-ms", "100"], "");
    let job = c.submit(&file)?;
    c.wait_first_steps(job, 1, Duration::from_secs(30))?;
    let ca = std::fs::read(c.pki().expect("a secure cluster has a PKI").join("ca.pem"))?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let (mut refused, mut turned_away) = (0, 0);
    rt.block_on(async {
        for n in 0..60u32 {
            let tls = tonic::transport::ClientTlsConfig::new()
                .ca_certificate(tonic::transport::Certificate::from_pem(&ca));
            let endpoint = tonic::transport::Endpoint::from_shared(c.url())?.tls_config(tls)?;
            let Ok(channel) = endpoint.connect().await else {
                turned_away += 1;
                continue;
            };
            let mut request = tonic::Request::new(ListJobsRequest::default());
            let token = format!("Bearer tyt_{n:064x}");
            request.metadata_mut().insert("authorization", token.parse()?);
            match JobsClient::new(channel).list(request).await {
                Err(s) if s.code() == tonic::Code::Unauthenticated => refused += 1,
                // Closed after the accept: the handshake or the call finds the socket gone.
                Err(_) => turned_away += 1,
                Ok(_) => anyhow::bail!("a made-up token was accepted"),
            }
        }
        anyhow::Ok(())
    })?;
    // The burst is refused one by one; past it, at most a few a second get to a handshake.
    let limit = REFUSALS_BURST as usize + 1 + 2 * ACCEPTS_PER_SEC_WHEN_LIMITED as usize;
    assert!(refused <= limit, "{refused} refused calls got through to the service (at most {limit})");
    assert!(turned_away >= 60 - limit, "only {turned_away} of 60 connections were turned away");
    let (_, metrics) = c.http("GET", "/metrics")?;
    let counted: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("trainyard_connections_turned_away_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0);
    assert!(
        counted >= turned_away as f64,
        "/metrics counts {counted} turned away, the client saw {turned_away}"
    );
    // The agent's stream, open before the flood, carried on: the job ran to its end. (Read from
    // the store: `ctl status` ten times a second would itself be limited from this address.)
    let deadline = Instant::now() + Duration::from_secs(60);
    let state = loop {
        let state = c.query_text(&format!("SELECT state FROM jobs WHERE id = {job}"))?[0][0].clone();
        if state == "succeeded" || state == "failed" || Instant::now() > deadline {
            break state;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(state, "succeeded");
    let steps = c.query(&format!("SELECT COUNT(*) FROM receipts WHERE job_id = {job} AND kind = 'step'"))?;
    assert_eq!(steps[0][0], 60, "every step receipt stored");
    // A user with a valid token behind the same address still gets in (at the limited rate).
    std::thread::sleep(Duration::from_secs(1));
    c.ctl_ok(&["status", &job.to_string()])?;
    Ok(())
}
