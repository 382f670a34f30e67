//! No caller exhausts what every caller shares: a user holds at most 16 `watch`/`logs` streams
//! at once, and a stream given up frees its place. (Pending jobs per user, refused-call auditing
//! and slow log clients are tested in the controller's unit tests; the ingest rate under attack
//! is `tests/benches/receipts_under_attack.rs`.)

use std::time::{Duration, Instant};

use anyhow::Result;
use trainyard_controller::service::MAX_STREAMS_PER_USER;
use trainyard_proto::v1::WatchRequest;
use trainyard_proto::v1::jobs_client::JobsClient;
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
