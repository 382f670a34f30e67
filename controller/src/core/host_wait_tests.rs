//! Waiting for a silent host (`host_wait`), on Tokio's paused clock with in-process agents: a
//! single-node job with nowhere else to go waits for its host and takes its ranks back; with a
//! spare, or once the wait runs out, or when the host returns without its ranks, it restarts.

use std::sync::Arc;
use std::time::Duration;

use trainyard_proto::v1::{Hello, RankReport};
use trainyard_store::FailureKind;

use super::Controller;
use super::reconcile::Reconciler;
use super::test_support::{Agent, connect, inventory, report, spec, store};
use crate::config::ControllerConfig;

fn config() -> ControllerConfig {
    ControllerConfig::default()
        .with_agent_timeout(Duration::from_secs(8))
        .with_unresponsive_after(Duration::from_secs(4))
        .with_reconnect_grace(Duration::ZERO)
        .with_host_wait(Duration::from_secs(60))
}

async fn pass(d: Duration) {
    tokio::time::pause();
    tokio::time::advance(d).await;
    tokio::time::resume();
}

/// One liveness tick and reaper pass, then a reconcile.
async fn tick(c: &Controller) {
    super::liveness::check_liveness(&Reconciler(&c.s), &c.s.heard).await.expect("liveness");
    super::test_support::reap(c).await;
    Reconciler(&c.s).mark_all();
    Reconciler(&c.s).reconcile().await;
}

/// `seconds` of silence from `silent`, one tick a second, while `talking` heartbeat.
async fn silence(c: &Controller, talking: &[&str], seconds: u32) {
    for _ in 0..seconds {
        pass(Duration::from_secs(1)).await;
        for h in talking {
            c.nodes().seen(h);
        }
        tick(c).await;
    }
}

/// A running one-rank job on `a` (1 GPU), with `restart.host_wait_s` as given.
async fn job_on_a(c: &Arc<Controller>, host_wait_s: Option<f64>) -> (Agent, u64) {
    let a = connect(c, "a", 1, None).await;
    let mut wire = spec(1);
    wire.restart = Some(trainyard_proto::v1::RestartPolicy { host_wait_s, ..Default::default() });
    let job = c.jobs().submit(wire, None).await.expect("submit");
    Reconciler(&c.s).reconcile().await;
    c.jobs()
        .rank_report("a", &RankReport { master_port: 29500, ..report(job, 0, 0, "running", -1) })
        .await
        .expect("report");
    Reconciler(&c.s).reconcile().await;
    assert_eq!(c.jobs().get(job).await.expect("job").state, "running");
    (a, job)
}

async fn events(c: &Controller, job: u64) -> Vec<String> {
    c.jobs().get(job).await.expect("job").events.into_iter().map(|e| e.reason).collect()
}

#[tokio::test]
async fn a_frozen_host_with_nowhere_else_to_go_is_waited_for_and_keeps_its_attempt() {
    let db = store().await;
    let c = super::test_support::controller_with(&db, config()).await;
    let (_a, job) = job_on_a(&c, None).await;
    let taken_back = crate::metrics::metrics().hosts_taken_back.get();
    silence(&c, &[], 30).await;
    let view = c.jobs().get(job).await.expect("job");
    assert_eq!((view.state.as_str(), view.attempt), ("running", 0), "{view:?}");
    assert!(db.failures(job).await.expect("failures").is_empty(), "no failure while it waits");
    let said = events(&c, job).await;
    let waiting = said.iter().find(|r| r.starts_with("host_lost pending")).expect("a waiting event");
    assert!(
        waiting.contains("agent a sent nothing for 8.")
            && waiting.contains("waits up to 60 s")
            && waiting.contains("no other placement can start now"),
        "{waiting}"
    );
    assert!(!c.nodes().stream_fenced(_a.conn_id), "the stream of a host waited for stays open");
    // It thaws: its next heartbeat ends the wait, and the ranks go on as attempt 0.
    c.nodes().seen("a");
    tick(&c).await;
    let said = events(&c, job).await;
    let back = said.iter().find(|r| r.starts_with("host_silent: ")).expect("a host_silent event");
    let gap = trainyard_model::restart::host_silent_ms(back).expect("its gap");
    assert!((30_000.0..31_500.0).contains(&gap), "gap {gap} ms: {back}");
    assert!(crate::metrics::metrics().hosts_taken_back.get() > taken_back, "counted on /metrics");
    c.jobs().rank_report("a", &report(job, 0, 0, "exited", 0)).await.expect("report");
    tick(&c).await;
    let view = c.jobs().get(job).await.expect("job");
    assert_eq!((view.state.as_str(), view.attempt), ("succeeded", 0), "{view:?}");
    assert!(db.failures(job).await.expect("failures").is_empty());
}

#[tokio::test]
async fn with_a_spare_the_job_moves_at_the_timeout_as_before() {
    let db = store().await;
    let c = super::test_support::controller_with(&db, config()).await;
    let (_a, job) = job_on_a(&c, None).await;
    let _spare = connect(&c, "spare", 1, None).await;
    silence(&c, &["spare"], 9).await;
    let failures = db.failures(job).await.expect("failures");
    assert_eq!(failures.len(), 1, "lost at the agent timeout");
    assert_eq!(failures[0].kind, FailureKind::HostLost);
    assert!(
        failures[0].evidence.contains("a placement without it can start now"),
        "{}",
        failures[0].evidence
    );
    assert!(!events(&c, job).await.iter().any(|r| r.starts_with("host_lost pending")));
}

#[tokio::test]
async fn the_wait_ends_when_it_runs_out_or_when_a_placement_opens() {
    let db = store().await;
    let c = super::test_support::controller_with(&db, config()).await;
    // The job's own wait (20 s) runs out: host_lost, saying it waited.
    let (_a, job) = job_on_a(&c, Some(20.0)).await;
    silence(&c, &[], 19).await;
    assert!(db.failures(job).await.expect("failures").is_empty(), "within its 20 s");
    silence(&c, &[], 2).await;
    let f = db.failures(job).await.expect("failures");
    assert_eq!(f.len(), 1);
    assert!(f[0].evidence.contains("waited 20 s for it"), "{}", f[0].evidence);

    // A spare that joins during a wait ends it at once: the job moves.
    let c = super::test_support::controller_with(&store().await, config()).await;
    let (_a, job) = job_on_a(&c, None).await;
    silence(&c, &[], 12).await;
    assert!(c.s.store.failures(job).await.expect("failures").is_empty());
    let _spare = connect(&c, "spare", 1, None).await;
    silence(&c, &["spare"], 1).await;
    let f = c.s.store.failures(job).await.expect("failures");
    assert_eq!(f.len(), 1, "moved once the spare could take it");
    assert!(f[0].evidence.contains("can start now"), "{}", f[0].evidence);
}

fn hello(ranks: Vec<RankReport>) -> Hello {
    Hello {
        protocol_version: trainyard_proto::PROTOCOL_VERSION,
        agent_id: "a".into(),
        address: "127.0.0.1".into(),
        inventory: Some(inventory("a", 1)),
        ranks,
        agent_version: "test".into(),
        preflight: None,
        join_token: String::new(),
    }
}

#[tokio::test]
async fn a_restarted_agent_takes_its_ranks_back_and_a_rebooted_host_restarts_the_job() {
    let db = store().await;
    let c = super::test_support::controller_with(&db, config()).await;
    let (a, job) = job_on_a(&c, None).await;
    // The agent is killed; its rank lives on; the agent comes back 20 s later and adopts it.
    c.nodes().disconnected("a", a.conn_id).await.expect("disconnect");
    silence(&c, &[], 20).await;
    assert!(db.failures(job).await.expect("failures").is_empty());
    let (tx, _rx) = tokio::sync::mpsc::channel(64);
    c.nodes().hello(hello(vec![report(job, 0, 0, "running", -1)]), tx).await.expect("hello");
    tick(&c).await;
    let said = events(&c, job).await;
    assert!(said.iter().any(|r| r.starts_with("host_silent: a was silent for 2")), "{said:?}");
    assert_eq!(c.jobs().get(job).await.expect("job").attempt, 0);

    // A reboot: the host comes back without the rank. The attempt is lost, not taken back.
    let db = store().await;
    let c = super::test_support::controller_with(&db, config()).await;
    let (a, job) = job_on_a(&c, None).await;
    c.nodes().disconnected("a", a.conn_id).await.expect("disconnect");
    silence(&c, &[], 20).await;
    let (tx, _rx) = tokio::sync::mpsc::channel(64);
    c.nodes().hello(hello(vec![]), tx).await.expect("hello");
    tick(&c).await;
    let f = db.failures(job).await.expect("failures");
    assert_eq!(f.len(), 1, "{f:?}");
    assert!(f[0].evidence.contains("came back without it"), "{}", f[0].evidence);
    assert!(!events(&c, job).await.iter().any(|r| r.starts_with("host_silent")));
}
