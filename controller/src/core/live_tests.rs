//! The live diagnosis's findings and alerts across a restart of the controller: an alert
//! already delivered is not sent again, and a finding whose job is gone is closed and alerted
//! once (real webhook over HTTP on port 0).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use trainyard_store::LiveFinding;

use super::Controller;
use super::test_support::{spec, store};
use crate::config::ControllerConfig;

/// A webhook receiver on port 0 answering 200: the `event` of every alert it got.
async fn receiver() -> (String, Arc<Mutex<Vec<String>>>) {
    flaky_receiver(0).await
}

/// A webhook receiver that answers 503 to its first `failures` posts (recorded as
/// `refused:EVENT`), then 200.
async fn flaky_receiver(failures: usize) -> (String, Arc<Mutex<Vec<String>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    let got = Arc::new(Mutex::new(Vec::new()));
    let sink = got.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let mut request = Vec::new();
            let mut buf = [0u8; 4096];
            while !request.ends_with(b"}") {
                match s.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => request.extend_from_slice(&buf[..n]),
                }
            }
            let text = String::from_utf8_lossy(&request);
            let body = text.split("\r\n\r\n").nth(1).unwrap_or("{}");
            let v: serde_json::Value = serde_json::from_str(body).unwrap_or_default();
            let event = v["event"].as_str().unwrap_or("?").to_string();
            let refuse = sink.lock().unwrap().len() < failures;
            if refuse {
                sink.lock().unwrap().push(format!("refused:{event}"));
                let _ = s.write_all(b"HTTP/1.1 503 Service Unavailable\r\n\r\n").await;
            } else {
                sink.lock().unwrap().push(event);
                let _ = s.write_all(b"HTTP/1.1 200 OK\r\n\r\n").await;
            }
        }
    });
    (url, got)
}

/// A store with a job that is not running and one open finding of `cause` on `node`'s `gpu`,
/// its opening alert already delivered (a controller's life before a restart).
async fn opened_and_alerted(
    cause: &str,
    node: &str,
    gpu: u32,
) -> (std::sync::Arc<dyn trainyard_store::Store>, u64) {
    let store = store().await;
    let job = store.create_job(&spec(2).try_into().unwrap(), None, "submitted", 1).await.unwrap().id;
    let open = LiveFinding {
        job_id: job,
        cause: cause.into(),
        subject: format!("{node}/gpu{gpu}"),
        nodes: vec![node.into()],
        summary: format!("GPU {gpu} of {node}: {cause}"),
        opened_at_ms: 10,
        updated_at_ms: 10,
        ..Default::default()
    };
    let stored = store.upsert_live_finding(&open).await.unwrap();
    store.mark_alerted(stored.id, true, 11).await.unwrap();
    (store, job)
}

#[tokio::test]
async fn an_alert_delivered_before_a_restart_is_not_sent_again_and_the_close_is_sent_once() {
    // Before the restart: a finding opened and its opening alert delivered.
    let (store, job) = opened_and_alerted("gpu.thermal_throttle", "b", 3).await;
    let (hook, got) = receiver().await;
    let config = ControllerConfig::default().with_live(Duration::from_millis(100), vec![hook], None);
    let c = Controller::start(store.clone(), config).await.unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let live = c.spawn_live(stop.clone()).unwrap();
    // The job is not running: the finding closes, and only its closing alert goes out.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while got.lock().unwrap().is_empty() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(*got.lock().unwrap(), vec!["closed".to_string()]);
    let after = c.diagnoses().live_findings(job).await.unwrap();
    assert!(after[0].closed_at_ms.is_some() && after[0].alerted_close_ms.is_some(), "{after:?}");
    stop.cancel();
    live.await.unwrap();
    // Another restart, with a second receiver, sends nothing more: nothing is left to deliver.
    let (hook2, got2) = receiver().await;
    let again = Controller::start(
        store.clone(),
        ControllerConfig::default().with_live(Duration::from_millis(100), vec![hook2], None),
    )
    .await
    .unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let live = again.spawn_live(stop.clone()).unwrap();
    tokio::time::sleep(Duration::from_millis(600)).await;
    stop.cancel();
    live.await.unwrap();
    assert!(got2.lock().unwrap().is_empty(), "sent again after a restart: {:?}", got2.lock().unwrap());
    assert!(store.unalerted_findings(10).await.unwrap().is_empty());
    assert_eq!(got.lock().unwrap().len(), 1);
}

/// A target that refuses is tried again (after 1 s, then 2 s) until it takes the alert; the
/// alert is recorded delivered only then.
#[tokio::test]
async fn an_alert_a_target_refuses_is_retried_until_it_is_delivered() {
    let (store, job) = opened_and_alerted("gpu.power_capped", "a", 1).await;
    let (hook, got) = flaky_receiver(2).await;
    let config = ControllerConfig::default().with_live(Duration::from_millis(100), vec![hook], None);
    let c = Controller::start(store.clone(), config).await.unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let live = c.spawn_live(stop.clone()).unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while !got.lock().unwrap().contains(&"closed".to_string()) && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.cancel();
    live.await.unwrap();
    assert_eq!(*got.lock().unwrap(), vec!["refused:closed", "refused:closed", "closed"]);
    let after = c.diagnoses().live_findings(job).await.unwrap();
    assert!(after[0].alerted_close_ms.is_some(), "delivered at last: {after:?}");
}

#[tokio::test]
async fn a_bad_webhook_is_refused_with_its_url() {
    let store = store().await;
    let config = ControllerConfig::default().with_live(Duration::from_secs(1), vec!["smtp://x".into()], None);
    let c = Controller::start(store, config).await.unwrap();
    let err = c.spawn_live(tokio_util::sync::CancellationToken::new()).unwrap_err();
    assert!(err.contains("smtp://x") && err.contains("http:// or https://"), "{err}");
}

/// The live diagnosis's own CPU is counted where it runs: a future that computes shows up in
/// `trainyard_live_diagnosis_cpu_seconds_total` (the metric is process-wide: other tests may
/// add to it too, so only the lower bound is held).
#[tokio::test]
async fn the_cpu_the_live_diagnosis_takes_is_counted() {
    let counter = &crate::metrics::metrics().live_diagnosis_cpu;
    let before = counter.get();
    super::live::cpu_counted(async {
        let mut x = 0u64;
        for i in 0..30_000_000u64 {
            x = std::hint::black_box(x.wrapping_add(i.wrapping_mul(i)));
        }
        tokio::task::yield_now().await;
        std::hint::black_box(x)
    })
    .await;
    let spent = counter.get() - before;
    assert!(spent > 0.005, "a loop of 30 M steps counted {spent} s of CPU");
}
