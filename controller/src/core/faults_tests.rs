//! Failures against in-process agents, on Tokio's paused clock: lost hosts (gone or silent),
//! the fence on a returning host, hangs, blame and exclusion, backoff, and cordons.

use std::time::Duration;

use trainyard_proto::v1::{RankKey, RankReport, Receipt, ReceiptBatch, controller_message::Msg};

use super::*;
use crate::config::ControllerConfig;
use crate::core::test_support::{Agent, connect, report, spec, store};
use std::sync::Arc;
use trainyard_store::FailureKind;

/// No host wait: these tests are about the verdicts on a silent host (host_wait_tests has the
/// wait for one that is the job's only place).
fn config() -> ControllerConfig {
    ControllerConfig::default()
        .with_host_wait(Duration::ZERO)
        .with_agent_timeout(Duration::from_secs(8))
        .with_unresponsive_after(Duration::from_secs(4))
        .with_reconnect_grace(Duration::ZERO)
}

/// Lets `d` pass on the controller's clock with nobody waiting for it.
async fn pass(d: Duration) {
    tokio::time::pause();
    tokio::time::advance(d).await;
    tokio::time::resume();
}

/// One liveness tick of the reconciler, then a pass.
async fn tick(c: &Controller) {
    super::liveness::check_liveness(&crate::core::reconcile::Reconciler(&c.s), &c.s.heard)
        .await
        .expect("liveness");
    crate::core::test_support::reap(c).await;
    super::faults::check_hangs(&mut c.s.lock(), &c.s.steps, c.now_ms());
    super::evict::check_evictions(&mut c.s.lock(), &c.s.steps, c.now_ms());
    super::faults::store_cordons(c.s.store.as_ref(), &c.s.core).await;
    crate::core::reconcile::Reconciler(&c.s).mark_all();
    crate::core::reconcile::Reconciler(&c.s).reconcile().await;
}

async fn state_of(c: &Controller, job: u64) -> (String, String) {
    let j = c.jobs().get(job).await.expect("job");
    (j.state, j.reason)
}

/// Nodes `a` and `b` with `gpus` GPUs each, and a running job of 2 x `gpus` ranks on both.
async fn running_job(
    c: &Arc<Controller>,
    gpus: u32,
    spec_of: impl Fn(JobSpecWire) -> JobSpecWire,
) -> (Agent, Agent, u64) {
    let mut a = connect(c, "a", gpus, None).await;
    let mut b = connect(c, "b", gpus, None).await;
    crate::core::reconcile::Reconciler(&c.s).reconcile().await;
    let job = c.jobs().submit(spec_of(spec(2 * gpus)), None).await.expect("submit");
    crate::core::reconcile::Reconciler(&c.s).reconcile().await;
    // Rank 0's host chose the port; the other host is launched then.
    c.jobs()
        .rank_report("a", &RankReport { master_port: 29500, ..report(job, 0, 0, "running", -1) })
        .await
        .expect("update");
    for rank in 0..2 * gpus {
        let host = if rank < gpus { "a" } else { "b" };
        c.jobs().rank_report(host, &report(job, 0, rank, "running", -1)).await.expect("update");
    }
    crate::core::reconcile::Reconciler(&c.s).reconcile().await;
    assert_eq!(state_of(c, job).await.0, "running");
    a.sent();
    b.sent();
    (a, b, job)
}

type JobSpecWire = trainyard_proto::v1::JobSpec;

fn with_restarts(max: u32) -> impl Fn(JobSpecWire) -> JobSpecWire {
    move |mut s| {
        s.restart = Some(trainyard_proto::v1::RestartPolicy {
            max_restarts: max,
            resume: true,
            ..Default::default()
        });
        s
    }
}

/// Both agents heartbeat (they are alive), `a` first.
fn heartbeat(c: &Controller, hosts: &[&str]) {
    for h in hosts {
        c.nodes().seen(h);
    }
}

#[tokio::test]
async fn a_silent_host_is_lost_within_the_timeout_blamed_and_its_job_restarts_elsewhere() {
    let store = store().await;
    let c = Controller::start(store.clone(), config()).await.expect("start");
    let (_a, b, job) = running_job(&c, 1, with_restarts(0)).await;
    let mut spare = connect(&c, "spare", 1, None).await;
    // b's network is cut: a keeps talking, b goes quiet.
    for _ in 0..3 {
        pass(Duration::from_secs(2)).await;
        heartbeat(&c, &["a", "spare"]);
        tick(&c).await;
    }
    assert_eq!(state_of(&c, job).await.0, "running", "6 s of silence is not yet a lost host");
    pass(Duration::from_millis(2500)).await;
    heartbeat(&c, &["a", "spare"]);
    tick(&c).await;
    let (state, reason) = state_of(&c, job).await;
    assert!(state == "restarting" || state == "pending", "{state}: {reason}");
    assert!(c.nodes().stream_fenced(b.conn_id), "b's open stream ends at its next message");
    let failures = store.failures(job).await.expect("failures");
    assert_eq!(failures.len(), 1);
    let f = &failures[0];
    assert_eq!(
        (f.kind, f.agent_id.as_deref(), f.blamed, f.charged),
        (FailureKind::HostLost, Some("b"), true, false)
    );
    assert!(f.evidence.contains("agent b sent nothing for 8."), "{}", f.evidence);
    let events = c.jobs().get(job).await.expect("job").events;
    let restart = events.iter().find(|e| e.to_state == "restarting").expect("restart event");
    assert!(
        restart.reason.contains("host_lost: rank 1 on b was lost")
            && restart.reason.contains("not counted against max_restarts")
            && restart.reason.contains("b is left out until it passes a preflight"),
        "{}",
        restart.reason
    );
    // a's rank stops when told; the next attempt goes on a and the spare, never on b, after the
    // backoff (1 s).
    c.jobs()
        .rank_report("a", &RankReport { signal: 15, ..report(job, 0, 0, "exited", -1) })
        .await
        .expect("update");
    tick(&c).await;
    assert!(spare.launched_jobs().is_empty(), "placed only after the backoff");
    let view = c.jobs().get(job).await.expect("job");
    assert!(view.waiting_reason.contains("restart backoff"), "{}", view.waiting_reason);
    pass(Duration::from_millis(1100)).await;
    heartbeat(&c, &["a", "spare"]);
    tick(&c).await;
    let view = c.jobs().get(job).await.expect("job");
    assert_eq!(view.attempt, 1);
    let mut nodes: Vec<&str> = view.ranks.iter().map(|r| r.agent_id.as_str()).collect();
    nodes.sort();
    assert_eq!(nodes, ["a", "spare"], "{view:?}");
    assert_eq!(view.failures.len(), 1, "ctl status lists the failure");
}

#[tokio::test]
async fn a_returning_host_has_the_ranks_of_the_old_attempt_stopped() {
    let store = store().await;
    let c = Controller::start(store.clone(), config()).await.expect("start");
    let (_a, b, job) = running_job(&c, 1, with_restarts(2)).await;
    c.nodes().disconnected("b", b.conn_id).await.expect("disconnect");
    pass(Duration::from_secs(9)).await;
    heartbeat(&c, &["a"]);
    tick(&c).await;
    assert_ne!(state_of(&c, job).await.0, "running");
    // The network heals: b says hello with its rank of attempt 0 still running.
    let (tx, mut rx) = tokio::sync::mpsc::channel(64);
    let hello = trainyard_proto::v1::Hello {
        protocol_version: trainyard_proto::PROTOCOL_VERSION,
        agent_id: "b".into(),
        address: "127.0.0.1".into(),
        inventory: Some(super::test_support::inventory("b", 1)),
        ranks: vec![report(job, 0, 1, "running", -1)],
        agent_version: "test".into(),
        preflight: None,
        join_token: String::new(),
    };
    c.nodes().hello(hello, tx).await.expect("hello");
    let sent: Vec<Msg> = std::iter::from_fn(|| rx.try_recv().ok()).filter_map(|m| m.msg).collect();
    assert!(
        sent.iter().any(|m| matches!(m, Msg::Cancel(x) if x.job_id == job && x.attempt == 0)),
        "the old attempt's rank is stopped: {sent:?}"
    );
    assert!(
        sent.iter().any(|m| matches!(m, Msg::RunPreflight(_))),
        "and the blamed node asked to clear itself"
    );
}

#[tokio::test]
async fn a_rank_exit_while_a_peer_host_is_silent_waits_for_the_host_verdict() {
    let store = store().await;
    let c = Controller::start(store.clone(), config()).await.expect("start");
    let (_a, _b, job) = running_job(&c, 1, with_restarts(0)).await;
    // b is cut off; a's rank fails first, its collective broken by the cut.
    pass(Duration::from_secs(5)).await;
    heartbeat(&c, &["a"]);
    tick(&c).await;
    c.jobs().rank_report("a", &report(job, 0, 0, "exited", 1)).await.expect("update");
    tick(&c).await;
    assert_eq!(state_of(&c, job).await.0, "running", "undecided while b is silent");
    pass(Duration::from_secs(4)).await;
    heartbeat(&c, &["a"]);
    tick(&c).await;
    let failures = store.failures(job).await.expect("failures");
    assert_eq!(failures.iter().map(|f| f.kind).collect::<Vec<_>>(), [FailureKind::HostLost]);
    assert_ne!(state_of(&c, job).await.0, "failed", "the fleet's failure does not use up max_restarts = 0");
}

/// Sends one step receipt per rank of `ranks` from `host`.
async fn steps(c: &Controller, host: &str, job: u64, ranks: &[u32], seq: u64) {
    let receipts = ranks
        .iter()
        .map(|&rank| Receipt {
            key: Some(RankKey { job_id: job, attempt: 0, rank }),
            seq,
            kind: "step".into(),
            step: seq as i64,
            body: format!(r#"{{"schema":1,"kind":"step","step":{seq},"step_time_ms":500}}"#),
        })
        .collect();
    c.receipts().ingest(host, ReceiptBatch { receipts }).await.expect("ingest");
}

fn with_hang(floor_s: f64) -> impl Fn(JobSpecWire) -> JobSpecWire {
    move |mut s| {
        s.restart = Some(trainyard_proto::v1::RestartPolicy {
            max_restarts: 1,
            resume: true,
            hang_timeout_s: floor_s,
            ..Default::default()
        });
        s
    }
}

#[tokio::test]
async fn ranks_that_stop_stepping_are_a_hang_and_the_node_that_stopped_alone_is_blamed() {
    let store = store().await;
    let c = Controller::start(store.clone(), config()).await.expect("start");
    let (_a, _b, job) = running_job(&c, 2, with_hang(10.0)).await;
    for seq in 1..=3 {
        steps(&c, "a", job, &[0, 1], seq).await;
        steps(&c, "b", job, &[2, 3], seq).await;
    }
    // b's ranks stop stepping; a's go on (a real hang in a collective stops everyone, but a
    // node whose ranks wedged alone is the one to blame).
    for seq in 4..=12 {
        pass(Duration::from_secs(1)).await;
        heartbeat(&c, &["a", "b"]);
        steps(&c, "a", job, &[0, 1], seq).await;
        tick(&c).await;
    }
    assert_eq!(state_of(&c, job).await.0, "running", "9 s of silence is inside the 10 s timeout");
    pass(Duration::from_millis(1500)).await;
    heartbeat(&c, &["a", "b"]);
    steps(&c, "a", job, &[0, 1], 13).await;
    tick(&c).await;
    let failures = store.failures(job).await.expect("failures");
    assert_eq!(failures.len(), 1, "{failures:?}");
    let f = &failures[0];
    assert_eq!(
        (f.kind, f.agent_id.as_deref(), f.blamed, f.charged),
        (FailureKind::Hang, Some("b"), true, false)
    );
    assert!(f.evidence.contains("no step receipt from rank(s) 2, 3 on b for 1"), "{}", f.evidence);
    assert!(f.evidence.contains("hang timeout 10 s"), "{}", f.evidence);
}

#[tokio::test]
async fn a_hang_of_every_rank_blames_nobody_and_is_charged() {
    let store = store().await;
    let c = Controller::start(store.clone(), config()).await.expect("start");
    let (_a, _b, job) = running_job(&c, 1, with_hang(5.0)).await;
    steps(&c, "a", job, &[0], 1).await;
    steps(&c, "b", job, &[1], 1).await;
    for _ in 0..6 {
        pass(Duration::from_secs(1)).await;
        heartbeat(&c, &["a", "b"]);
        tick(&c).await;
    }
    let failures = store.failures(job).await.expect("failures");
    assert_eq!(failures.len(), 1);
    assert_eq!((failures[0].kind, failures[0].blamed, failures[0].charged), (FailureKind::Hang, false, true));
    let (state, reason) = state_of(&c, job).await;
    assert!(state == "restarting" || state == "pending", "{state}");
    let _ = reason;
}

#[tokio::test]
async fn repeated_blame_cordons_a_node_until_it_passes_a_preflight_and_operators_cordon_too() {
    let store = store().await;
    let c = Controller::start(store.clone(), config().with_cordon_after(2, Duration::from_secs(3600)))
        .await
        .expect("start");
    for round in 0..2 {
        let mut flaky = connect(&c, "flaky", 1, None).await;
        crate::core::reconcile::Reconciler(&c.s).reconcile().await;
        let job = c.jobs().submit(spec(1), None).await.expect("submit");
        crate::core::reconcile::Reconciler(&c.s).reconcile().await;
        assert_eq!(flaky.launched_jobs(), [job], "round {round}: the only node");
        c.jobs().rank_report("flaky", &report(job, 0, 0, "running", -1)).await.expect("update");
        crate::core::reconcile::Reconciler(&c.s).reconcile().await;
        c.nodes().disconnected("flaky", flaky.conn_id).await.expect("disconnect");
        pass(Duration::from_secs(9)).await;
        tick(&c).await;
        let view = c.jobs().get(job).await.expect("job");
        assert_eq!(view.state, "pending", "round {round}: {}", view.reason);
        let reconciler = crate::core::reconcile::Reconciler(&c.s);
        let (cancelled, ()) = tokio::join!(c.jobs().cancel(job, "done with it"), reconciler.reconcile());
        cancelled.expect("cancel");
    }
    let node = |nodes: Vec<trainyard_proto::v1::NodeInfo>, id: &str| {
        nodes.into_iter().find(|n| n.agent_id == id).expect("node")
    };
    let flaky = node(c.nodes().list().await, "flaky");
    assert!(flaky.cordon_reason.contains("blamed for 2 failures"), "{}", flaky.cordon_reason);
    assert_eq!(flaky.cordon_by, "failures");
    let stored = store.snapshot().await.expect("snapshot");
    assert!(
        stored.agents.iter().any(|a| a.agent_id == "flaky" && a.cordon.is_some()),
        "the cordon is stored"
    );
    // Back with a passing preflight: the cordon is lifted, in memory and in the store.
    let report = super::test_support::passing_report("flaky", c.now_ms());
    let mut flaky = connect(&c, "flaky", 1, Some(report)).await;
    super::faults::store_cordons(c.s.store.as_ref(), &c.s.core).await;
    assert_eq!(node(c.nodes().list().await, "flaky").cordon_reason, "");
    let stored = store.snapshot().await.expect("snapshot");
    assert!(stored.agents.iter().all(|a| a.cordon.is_none()));
    // An operator's cordon: no new work, and only uncordon lifts it.
    c.nodes().cordon("flaky", Some("fan noise")).await.expect("cordon");
    let job = c.jobs().submit(spec(1), None).await.expect("submit");
    crate::core::reconcile::Reconciler(&c.s).reconcile().await;
    assert!(flaky.launched_jobs().is_empty());
    assert_eq!(node(c.nodes().list().await, "flaky").cordon_by, "operator");
    assert!(matches!(c.nodes().cordon("nope", None).await, Err(ControllerError::AgentNotFound(_))));
    c.nodes().cordon("flaky", None).await.expect("uncordon");
    crate::core::reconcile::Reconciler(&c.s).reconcile().await;
    assert_eq!(flaky.launched_jobs(), [job]);
}

#[tokio::test]
async fn after_a_controller_restart_hang_and_host_loss_clocks_wait_for_the_reconnect_grace() {
    let store = store().await;
    let c = Controller::start(store.clone(), config()).await.expect("start");
    let (_a, _b, job) = running_job(&c, 1, with_hang(5.0)).await;
    steps(&c, "a", job, &[0], 1).await;
    steps(&c, "b", job, &[1], 1).await;
    drop(c);
    // The new controller hears from no agent for a while: they are reconnecting.
    let grace = config().with_reconnect_grace(Duration::from_secs(30));
    let c = Controller::start(store.clone(), grace).await.expect("restart");
    for _ in 0..28 {
        pass(Duration::from_secs(1)).await;
        tick(&c).await;
    }
    assert_eq!(state_of(&c, job).await.0, "running", "nothing is declared during the grace");
    assert!(store.failures(job).await.expect("failures").is_empty());
    // Past the grace with no agent back: their hosts are lost.
    for _ in 0..4 {
        pass(Duration::from_secs(1)).await;
        tick(&c).await;
    }
    let kinds: Vec<FailureKind> =
        store.failures(job).await.expect("failures").iter().map(|f| f.kind).collect();
    assert!(kinds == [FailureKind::HostLost] || kinds == [FailureKind::Hang], "{kinds:?}");
}

#[tokio::test]
async fn a_drain_moves_a_job_that_never_checkpoints_at_its_deadline_and_a_notice_shortens_it() {
    let store = store().await;
    let c = Controller::start(store.clone(), config()).await.expect("start");
    let (mut a, mut b, job) = running_job(&c, 1, with_restarts(0)).await;
    let (node, jobs) = c.nodes().drain("a", Duration::from_secs(60), "kernel update").await.expect("drain");
    assert_eq!((node.as_str(), jobs), ("a", vec![job]));
    for agent in [&mut a, &mut b] {
        let asked = agent.sent().into_iter().any(|m| matches!(m, Msg::CheckpointNow(x) if x.job_id == job));
        assert!(asked, "every host of the job is asked to checkpoint");
    }
    // A preemption notice on b, due in 10 s, shortens the wait (2 s kept for the stop).
    let due = c.now_ms() + 10_000;
    let notice =
        trainyard_proto::v1::Notice { kind: "preemption".into(), deadline_ms: due, detail: "spot".into() };
    c.nodes().notice("b", &notice).await.expect("notice");
    for _ in 0..7 {
        pass(Duration::from_secs(1)).await;
        heartbeat(&c, &["a", "b"]);
        tick(&c).await;
    }
    assert!(store.failures(job).await.expect("failures").is_empty(), "7 s: inside the notice's 8 s");
    pass(Duration::from_millis(1500)).await;
    heartbeat(&c, &["a", "b"]);
    tick(&c).await;
    let failures = store.failures(job).await.expect("failures");
    assert_eq!(failures.len(), 1, "{failures:?}");
    let f = &failures[0];
    assert_eq!((f.kind, f.blamed, f.charged), (FailureKind::Drain, false, false));
    assert!(
        f.evidence.contains("no checkpoint from every rank") && f.evidence.contains("kernel update"),
        "{}",
        f.evidence
    );
    let state = state_of(&c, job).await.0;
    assert!(
        state == "restarting" || state == "pending",
        "max_restarts = 0, but a drain is not the job's: {state}"
    );
}

#[tokio::test]
async fn backoff_grows_in_a_crash_loop_and_starts_over_after_a_stable_run() {
    use super::faults::next_streak;
    tokio::time::pause();
    let started = tokio::time::Instant::now();
    assert_eq!(next_streak(0, None), 1, "an attempt that never ran");
    assert_eq!(next_streak(3, Some(started)), 4, "failed right after it started running");
    tokio::time::advance(Duration::from_secs(61)).await;
    assert_eq!(next_streak(3, Some(started)), 1, "a minute of running was no crash loop");
}

#[tokio::test]
async fn a_job_far_higher_in_priority_preempts_a_running_one_through_a_checkpoint() {
    let store = store().await;
    let c = Controller::start(store.clone(), config()).await.expect("start");
    let (mut a, _b, low) = running_job(&c, 1, with_restarts(0)).await;
    // 5 above: not enough (the gap is 10); it waits.
    let mut near = spec(2);
    near.priority = 5;
    let near = c.jobs().submit(near, None).await.expect("submit");
    crate::core::reconcile::Reconciler(&c.s).reconcile().await;
    assert!(a.sent().iter().all(|m| !matches!(m, Msg::CheckpointNow(_))), "no preemption for a gap of 5");
    let mut urgent = spec(2);
    urgent.priority = 20;
    let urgent = c.jobs().submit(urgent, None).await.expect("submit");
    crate::core::reconcile::Reconciler(&c.s).reconcile().await;
    assert!(
        a.sent().iter().any(|m| matches!(m, Msg::CheckpointNow(x) if x.job_id == low)),
        "the low job is asked to checkpoint"
    );
    let why = c.jobs().get(urgent).await.expect("job").waiting_reason;
    assert!(why.contains(&format!("preempting job {low}")), "{why}");
    // Both ranks checkpoint; the low job moves, its ranks stop, and the urgent job runs.
    for (host, rank) in [("a", 0u32), ("b", 1)] {
        let receipts = vec![Receipt {
            key: Some(RankKey { job_id: low, attempt: 0, rank }),
            seq: 1,
            kind: "checkpoint".into(),
            step: 40,
            body: r#"{"kind":"checkpoint","step":40,"path":"/ck/40","duration_ms":3}"#.into(),
        }];
        c.receipts().ingest(host, ReceiptBatch { receipts }).await.expect("ingest");
    }
    tick(&c).await;
    let f = &store.failures(low).await.expect("failures")[0];
    assert_eq!((f.kind, f.charged, f.blamed), (FailureKind::Preempted, false, false));
    assert!(
        f.evidence.contains(&format!("preempted by job {urgent} (priority 20 against 0")),
        "{}",
        f.evidence
    );
    for (host, rank) in [("a", 0u32), ("b", 1)] {
        c.jobs()
            .rank_report(host, &RankReport { signal: 15, ..report(low, 0, rank, "exited", -1) })
            .await
            .expect("update");
    }
    tick(&c).await;
    let placed = state_of(&c, urgent).await.0;
    assert!(placed == "scheduled" || placed == "launching", "the urgent job got the GPUs: {placed}");
    assert_eq!(state_of(&c, low).await.0, "pending", "the low job waits again, not failed");
    assert_eq!(state_of(&c, near).await.0, "pending");
}

#[tokio::test]
async fn a_restart_may_run_smaller_when_the_spec_allows_and_the_full_size_does_not_fit() {
    let store = store().await;
    let c = Controller::start(store.clone(), config()).await.expect("start");
    let elastic = |mut s: JobSpecWire| {
        s.restart = Some(trainyard_proto::v1::RestartPolicy {
            max_restarts: 1,
            resume: true,
            min_gpus: 1,
            ..Default::default()
        });
        s
    };
    let (_a, b, job) = running_job(&c, 1, elastic).await;
    // b is gone for good, and there is no spare: the full size (2 GPUs) does not fit.
    c.nodes().disconnected("b", b.conn_id).await.expect("disconnect");
    pass(Duration::from_secs(9)).await;
    heartbeat(&c, &["a"]);
    tick(&c).await;
    c.jobs()
        .rank_report("a", &RankReport { signal: 15, ..report(job, 0, 0, "exited", -1) })
        .await
        .expect("update");
    tick(&c).await;
    pass(Duration::from_millis(1100)).await;
    heartbeat(&c, &["a"]);
    tick(&c).await;
    let view = c.jobs().get(job).await.expect("job");
    assert_eq!(view.attempt, 1);
    assert_eq!(view.ranks.len(), 1, "attempt 1 runs on the one GPU left: {view:?}");
    let placed = view.events.iter().rev().find(|e| e.to_state == "scheduled").expect("scheduled");
    assert!(
        placed.reason.contains("1 of its 2 GPUs") && placed.reason.contains("restart.min_gpus is 1"),
        "{}",
        placed.reason
    );
}

#[tokio::test]
async fn a_notice_during_a_restart_only_cordons_its_node_and_the_next_attempt_avoids_it() {
    let store = store().await;
    let c = Controller::start(store.clone(), config()).await.expect("start");
    let (mut a, mut b, job) = running_job(&c, 1, with_restarts(1)).await;
    let _spare = connect(&c, "spare", 1, None).await;
    // Rank 0 fails: the attempt restarts, b's rank is being stopped.
    c.jobs().rank_report("a", &report(job, 0, 0, "exited", 1)).await.expect("update");
    tick(&c).await;
    assert_eq!(state_of(&c, job).await.0, "restarting");
    b.sent();
    let notice =
        trainyard_proto::v1::Notice { kind: "preemption".into(), deadline_ms: 0, detail: "spot".into() };
    c.nodes().notice("b", &notice).await.expect("notice");
    assert!(
        !b.sent().iter().any(|m| matches!(m, Msg::CheckpointNow(_))),
        "an attempt that is stopping is not asked to checkpoint"
    );
    c.jobs()
        .rank_report("b", &RankReport { signal: 15, ..report(job, 0, 1, "exited", -1) })
        .await
        .expect("update");
    pass(Duration::from_secs(2)).await;
    heartbeat(&c, &["a", "b", "spare"]);
    tick(&c).await;
    let kinds: Vec<FailureKind> =
        store.failures(job).await.expect("failures").iter().map(|f| f.kind).collect();
    assert_eq!(kinds, [FailureKind::RankExit], "the notice adds no failure to a restarting job");
    // Placed after the backoff (1 s).
    pass(Duration::from_millis(1100)).await;
    heartbeat(&c, &["a", "b", "spare"]);
    tick(&c).await;
    let view = c.jobs().get(job).await.expect("job");
    assert_eq!(view.attempt, 1, "{view:?}");
    let mut nodes: Vec<&str> = view.ranks.iter().map(|r| r.agent_id.as_str()).collect();
    nodes.sort();
    assert_eq!(nodes, ["a", "spare"], "the next attempt avoids the cordoned node: {view:?}");
    assert!(a.launched_jobs().contains(&job), "attempt 1 launched on a first (rank 0's host)");
}
