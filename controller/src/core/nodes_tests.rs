//! The controller with in-process agents (channels instead of streams) and an in-memory
//! store: verdicts from hellos and re-runs, the fleet table, scheduling around failing nodes,
//! restarts, and preflight runs on request.

use std::time::Duration;

use tokio::sync::mpsc;
use trainyard_proto::PROTOCOL_VERSION;
use trainyard_proto::v1::{Hello, PreflightCheck, PreflightReport, controller_message::Msg};

use trainyard_model::domain::Inventory;

use super::*;
use crate::core::Controller;
use crate::core::fleet::{numa_layout, unschedulable_reason};
use crate::core::test_support::{connect, controller, inventory, spec, store};
use trainyard_model::domain::NodeState;

fn check(id: &str, status: &str, measured: &str) -> PreflightCheck {
    PreflightCheck {
        id: id.into(),
        status: status.into(),
        measured: measured.into(),
        expected: "ok".into(),
        remedy: if status == "fail" { "fix it".into() } else { String::new() },
    }
}

fn report(host: &str, started_at_ms: i64, failing: &[(&str, &str)]) -> PreflightReport {
    let mut checks = vec![check("topology.nvlink", "pass", "NV18 on every pair")];
    checks.extend(failing.iter().map(|(id, measured)| check(id, "fail", measured)));
    PreflightReport {
        agent_id: host.into(),
        local_id: format!("{host}-{started_at_ms}"),
        level: "quick".into(),
        started_at_ms,
        finished_at_ms: started_at_ms + 10,
        verdict: if failing.is_empty() { "pass".into() } else { "fail".into() },
        interconnect_class: "nvswitch".into(),
        topology: "GPU0\tX\n".into(),
        source: "host-file".into(),
        checks,
        ..Default::default()
    }
}

fn row<'a>(nodes: &'a [trainyard_proto::v1::NodeInfo], id: &str) -> &'a trainyard_proto::v1::NodeInfo {
    nodes.iter().find(|n| n.agent_id == id).expect("node in the table")
}

#[tokio::test]
async fn failing_node_is_not_scheduled_and_the_table_says_why() {
    let store = store().await;
    let c = controller(&store).await;
    let mut good = connect(&c, "good", 2, Some(report("good", 1, &[]))).await;
    let bad = report("bad", 1, &[("cuda.init.gpu3", "CUDA_ERROR_NO_DEVICE"), ("host.shm", "not mounted")]);
    let mut bad_agent = connect(&c, "bad", 8, Some(bad)).await;

    let nodes = c.nodes().list().await;
    assert_eq!(nodes.iter().map(|n| n.agent_id.as_str()).collect::<Vec<_>>(), ["bad", "good"]);
    let b = row(&nodes, "bad");
    assert_eq!((b.verdict.as_str(), b.state.as_str(), b.gpus, b.free_gpus), ("fail", "connected", 8, 8));
    assert_eq!(b.verdict_reason, "cuda.init.gpu3: CUDA_ERROR_NO_DEVICE; host.shm: not mounted");
    assert_eq!((b.numa_layout.as_str(), b.interconnect_class.as_str()), ("0:4 1:4", "nvswitch"));
    assert!(b.preflight_report_id > 0);
    let g = row(&nodes, "good");
    assert_eq!(
        (g.verdict.as_str(), g.verdict_reason.as_str(), g.gpu_model.as_str()),
        ("pass", "", "NVIDIA H100 80GB HBM3")
    );

    // Four 1-GPU jobs: two fit on the good node, two wait rather than go to the failing one.
    let mut ids = Vec::new();
    for _ in 0..4 {
        ids.push(c.jobs().submit(spec(1), None).await.expect("submit"));
        crate::core::reconcile::Reconciler(&c.s).reconcile().await;
    }
    assert_eq!(good.launched_jobs(), ids[..2]);
    assert!(bad_agent.launched_jobs().is_empty());
    assert_eq!(row(&c.nodes().list().await, "good").free_gpus, 0);
    // A job only the failing node could hold is still accepted: the node can be fixed.
    let big = c.jobs().submit(spec(8), None).await.expect("an 8-GPU job is feasible on the fleet");
    crate::core::reconcile::Reconciler(&c.s).reconcile().await;

    // The node is fixed and says so: the waiting jobs go there at once.
    c.nodes().preflight_report("bad", report("bad", 2, &[])).await.expect("report");
    crate::core::reconcile::Reconciler(&c.s).reconcile().await;
    assert_eq!(bad_agent.launched_jobs(), ids[2..]);
    let b = row(&c.nodes().list().await, "bad").clone();
    assert_eq!((b.verdict.as_str(), b.verdict_reason.as_str(), b.free_gpus), ("pass", "", 6));
    assert!(!ids.contains(&big));
}

#[tokio::test]
async fn verdicts_come_back_after_a_restart() {
    let store = store().await;
    let first_id;
    {
        let c = controller(&store).await;
        let _bad = connect(&c, "bad", 4, Some(report("bad", 1, &[("numa.balancing", "1")]))).await;
        first_id = row(&c.nodes().list().await, "bad").preflight_report_id;
    }
    let c = controller(&store).await;
    let nodes = c.nodes().list().await;
    let b = row(&nodes, "bad");
    assert_eq!((b.state.as_str(), b.verdict.as_str()), ("disconnected", "fail"));
    assert_eq!((b.verdict_reason.as_str(), b.preflight_report_id), ("numa.balancing: 1", first_id));
    assert_eq!(c.nodes().latest_preflight("bad").await.expect("report").checks.len(), 2);

    // The agent comes back with a hello without a report: it stays failing, and a job waits.
    let mut bad = connect(&c, "bad", 4, None).await;
    c.jobs().submit(spec(1), None).await.expect("submit");
    crate::core::reconcile::Reconciler(&c.s).reconcile().await;
    assert!(bad.launched_jobs().is_empty());
    assert_eq!(row(&c.nodes().list().await, "bad").verdict, "fail");
    // A second stream while the first is open is refused, and stores nothing.
    let (tx, _rx) = mpsc::channel(8);
    let hello = Hello { agent_id: "bad".into(), protocol_version: PROTOCOL_VERSION, ..Default::default() };
    assert!(matches!(c.nodes().hello(hello, tx).await, Err(ControllerError::AlreadyConnected(_))));
    // Its hello with the same report again (after a reconnect) does not store it twice.
    c.nodes().disconnected("bad", bad.conn_id).await.expect("disconnect");
    let again = connect(&c, "bad", 4, Some(report("bad", 1, &[("numa.balancing", "1")]))).await;
    assert_eq!(row(&c.nodes().list().await, "bad").preflight_report_id, first_id);
    // Fixed and re-run; a later hello carrying the start report again keeps the newer verdict.
    c.nodes().preflight_report("bad", report("bad", 5, &[])).await.expect("report");
    let fixed = row(&c.nodes().list().await, "bad").preflight_report_id;
    assert!(fixed > first_id);
    c.nodes().disconnected("bad", again.conn_id).await.expect("disconnect");
    let _later = connect(&c, "bad", 4, Some(report("bad", 1, &[("numa.balancing", "1")]))).await;
    let b = row(&c.nodes().list().await, "bad").clone();
    assert_eq!((b.verdict.as_str(), b.preflight_report_id), ("pass", fixed));
}

#[tokio::test]
async fn preflight_on_request_waits_for_the_next_report() {
    let store = store().await;
    let c = controller(&store).await;
    let mut agent = connect(&c, "node-a", 8, Some(report("node-a", 1, &[]))).await;
    let old_id = c.nodes().latest_preflight("node-a").await.expect("report").report_id;

    let asked = tokio::spawn({
        let c = c.clone();
        async move { c.nodes().run_preflight("node-a", "standard", Duration::from_secs(10)).await }
    });
    let level = loop {
        match agent.rx.recv().await.and_then(|m| m.msg) {
            Some(Msg::RunPreflight(run)) => break run.level,
            Some(_) => continue,
            None => panic!("stream closed"),
        }
    };
    assert_eq!(level, "standard");
    let new = PreflightReport { level, ..report("node-a", 50, &[("nccl.busbw", "310 GB/s")]) };
    c.nodes().preflight_report("node-a", new).await.expect("report");
    let got = asked.await.expect("join").expect("report");
    assert!(got.report_id > old_id);
    assert_eq!((got.level.as_str(), got.verdict.as_str()), ("standard", "fail"));

    // By hostname too; and a bad level, an unknown node, silence and a gone agent are errors.
    assert_eq!(c.nodes().latest_preflight("node-a").await.expect("report").report_id, got.report_id);
    let err =
        c.nodes().run_preflight("node-a", "thorough", Duration::from_secs(1)).await.expect_err("bad level");
    assert!(matches!(err, ControllerError::BadRequest(_)), "{err}");
    let err = c.nodes().run_preflight("nowhere", "quick", Duration::from_secs(1)).await.expect_err("unknown");
    assert!(matches!(err, ControllerError::AgentNotFound(_)), "{err}");
    let err =
        c.nodes().run_preflight("node-a", "quick", Duration::from_millis(200)).await.expect_err("silence");
    assert!(matches!(err, ControllerError::PreflightTimeout { .. }), "{err}");
    c.nodes().disconnected("node-a", agent.conn_id).await.expect("disconnect");
    let err = c.nodes().run_preflight("node-a", "quick", Duration::from_secs(1)).await.expect_err("gone");
    assert!(matches!(err, ControllerError::AgentNotConnected(_)), "{err}");
    assert_eq!(row(&c.nodes().list().await, "node-a").state, "disconnected");
}

#[tokio::test]
async fn malformed_reports_are_dropped_and_nodes_without_one_are_named() {
    let store = store().await;
    let c = controller(&store).await;
    let _a = connect(&c, "node-a", 2, None).await;
    let err = c.nodes().latest_preflight("node-a").await.expect_err("no report yet");
    assert!(matches!(err, ControllerError::NoPreflight(_)), "{err}");
    let bogus = PreflightReport { verdict: "excellent".into(), ..report("node-a", 1, &[]) };
    c.nodes().preflight_report("node-a", bogus).await.expect("dropped, not an error");
    let n = c.nodes().list().await;
    assert_eq!((n[0].verdict.as_str(), n[0].preflight_report_id, n[0].verdict_reason.as_str()), ("", 0, ""));
    // A report claiming to be another agent's is stored as the sender's.
    c.nodes().preflight_report("node-a", report("node-z", 2, &[])).await.expect("report");
    assert_eq!(c.nodes().latest_preflight("node-a").await.expect("report").agent_id, "node-a");
}

#[test]
fn numa_layout_counts_gpus_per_node() {
    assert_eq!(numa_layout(&inventory("h", 8).into()), "0:4 1:4");
    let mut inv = inventory("h", 2);
    inv.gpus[1].numa_node = -1;
    assert_eq!(numa_layout(&inv.into()), "?:1 0:1");
    assert_eq!(numa_layout(&Inventory::default()), "");
}

#[test]
fn reasons_name_failing_checks_or_the_state() {
    let record = |r: PreflightReport| trainyard_store::PreflightRecord::try_from(r).expect("known words");
    let bad = record(report("h", 1, &[("host.shm", "")]));
    assert_eq!(unschedulable_reason(Some(&bad), NodeState::Connected), "host.shm");
    let no_checks = trainyard_store::PreflightRecord { checks: vec![], ..bad };
    assert_eq!(unschedulable_reason(Some(&no_checks), NodeState::Connected), "preflight verdict fail");
    assert_eq!(unschedulable_reason(None, NodeState::Leaving), "agent is leaving");
    assert_eq!(unschedulable_reason(None, NodeState::Disconnected), "agent is not connected");
    assert_eq!(unschedulable_reason(Some(&record(report("h", 1, &[]))), NodeState::Connected), "");
}

/// An agent whose stream stays open but sends nothing is `unresponsive` after
/// `unresponsive_after`: the table says so with its real age, and no new work goes there; the
/// next message it sends brings it back and the waiting job is placed at once.
#[tokio::test]
async fn a_silent_agent_is_unresponsive_and_gets_no_work_until_it_speaks() {
    let store = store().await;
    let config = crate::ControllerConfig::default().with_unresponsive_after(Duration::from_millis(300));
    let c = Controller::start(store.clone(), config).await.expect("start");
    let mut quiet = connect(&c, "quiet", 2, Some(report("quiet", 1, &[]))).await;
    crate::core::liveness::check_liveness(&crate::core::reconcile::Reconciler(&c.s), &c.s.heard)
        .await
        .expect("liveness");
    assert_eq!(row(&c.nodes().list().await, "quiet").state, "connected");

    // The controller's clock follows Tokio's: 450 ms pass without anyone waiting for them.
    tokio::time::pause();
    tokio::time::advance(Duration::from_millis(450)).await;
    crate::core::liveness::check_liveness(&crate::core::reconcile::Reconciler(&c.s), &c.s.heard)
        .await
        .expect("liveness");
    let nodes = c.nodes().list().await;
    let q = row(&nodes, "quiet");
    assert_eq!(q.state, "unresponsive");
    assert!(q.verdict_reason.contains("heartbeats stopped"), "{}", q.verdict_reason);
    let age = c.now_ms() - q.last_seen_ms;
    assert!(age >= 450, "ctl nodes shows the real age of the last message: {age} ms");
    tokio::time::resume();
    let job = c.jobs().submit(spec(1), None).await.expect("submit");
    crate::core::reconcile::Reconciler(&c.s).reconcile().await;
    assert!(quiet.launched_jobs().is_empty(), "no work for an unresponsive agent");

    c.nodes().seen("quiet");
    crate::core::liveness::check_liveness(&crate::core::reconcile::Reconciler(&c.s), &c.s.heard)
        .await
        .expect("liveness");
    crate::core::reconcile::Reconciler(&c.s).reconcile().await;
    assert_eq!(row(&c.nodes().list().await, "quiet").state, "connected");
    assert_eq!(quiet.launched_jobs(), [job], "the waiting job goes there once it speaks");
    let stored = store.snapshot().await.expect("snapshot");
    assert!(
        stored
            .agents
            .iter()
            .any(|a| a.agent_id == "quiet" && a.state == trainyard_store::AgentState::Connected)
    );
}
