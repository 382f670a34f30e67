//! Property test of the agent daemon against whatever a controller sends on its stream: each of
//! the twelve controller messages with any values (acks for ranks it never had, launches of any
//! shape, cancels with any grace, preflights of any level, log reads of any rank and run name,
//! credits and stops for requests it never had, checkpoint requests with any signal name, a
//! second hello), and messages decoded from any bytes. Whatever comes, no task of the agent
//! panics, its stream stays open, and it still does its work: a rank launched after each case
//! runs and its exit is reported. A dismissal, sent last, ends the agent cleanly. One agent
//! for all cases (real shims and ranks in a temporary data directory), as a controller's
//! stream would be.

mod common;

use std::cell::{Cell, RefCell};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use prost::Message;
use trainyard_proto::PROTOCOL_VERSION;
use trainyard_proto::v1::agent_message::Msg as Out;
use trainyard_proto::v1::controller_message::Msg as In;
use trainyard_proto::v1::{
    CancelRanks, CheckpointNow, ControllerMessage, Dismiss, ForgetRanks, HelloAck, LogCredit, RankAck,
    RankAssignment, RankKey, ReadLogs, ReceiptAck, RunPreflight, StopLogs, TelemetryAck,
};

use common::msg;

const HOST: &str = r#"{"hostname": "props-host",
  "gpus": [{"index": 0, "uuid": "GPU-0", "model": "NVIDIA H100 80GB HBM3", "memory_mib": 81559,
            "pci_bus_id": "00000000:18:00.0", "numa_node": 0},
           {"index": 1, "uuid": "GPU-1", "model": "NVIDIA H100 80GB HBM3", "memory_mib": 81559,
            "pci_bus_id": "00000000:19:00.0", "numa_node": 0}],
  "links": [["X", "NV18"], ["NV18", "X"]], "numa_nodes": [{"id": 0, "cpus": "0-1"}],
  "host": {"numa_balancing": 0, "dev_shm_bytes": 17179869184},
  "cuda": {"cuda_version": "12.8"}}"#;

/// Jobs the cases name; the probe launches use ids far above them.
const JOBS: u64 = 2;
const PROBE_JOBS: u64 = 1_000_000;

/// One of `fixed`, or any string `free` matches.
fn word(fixed: &'static [&'static str], free: &'static str) -> impl Strategy<Value = String> + Clone {
    prop_oneof![proptest::sample::select(fixed).prop_map(str::to_string), free]
}

fn rank_ack() -> impl Strategy<Value = RankAck> {
    (prop_oneof![0..JOBS, any::<u64>()], 0u32..2, 0u32..4, any::<u64>()).prop_map(
        |(job_id, attempt, rank, seq)| RankAck { key: Some(RankKey { job_id, attempt, rank }), seq },
    )
}

fn launch() -> impl Strategy<Value = In> {
    let script =
        prop_oneof![Just("true"), Just("exit 3"), Just("sleep 1"), Just("sleep 0.3"), Just("kill -9 $$")];
    // GPU 0 is the probes' own: a rank of another job still holding it would refuse a probe.
    let assignment = (0u32..4, 1u32..4).prop_map(|(rank, gpu_index)| RankAssignment {
        rank,
        local_rank: rank,
        gpu_index,
        ..Default::default()
    });
    let preflight = word(&["", "none", "quick"], "[a-z]{0,6}");
    let run_name = word(&["", "", "run-a", "run-b"], "\\PC{0,30}");
    (0..JOBS, 0u32..2, script, vec(assignment, 0..3), preflight, run_name).prop_map(
        |(job_id, attempt, script, ranks, preflight, run_name)| {
            let mut launch = common::sh_launch(job_id, std::path::Path::new("/tmp"), script);
            launch.attempt = attempt;
            launch.world_size = ranks.len() as u32;
            launch.local_world_size = ranks.len() as u32;
            launch.ranks = ranks;
            launch.run_name = run_name;
            launch.spec.as_mut().expect("spec").preflight = preflight;
            In::Launch(launch)
        },
    )
}

fn message() -> impl Strategy<Value = ControllerMessage> {
    let job = || prop_oneof![0..JOBS, any::<u64>()];
    let signal = word(&["", "SIGUSR1", "SIGKILL", "SIGSTOP"], "\\PC{0,12}");
    let level = word(&["", "quick", "none", "admin"], "\\PC{0,12}");
    let run_name = word(&["", "../../etc", "/etc/shadow"], "\\PC{0,40}");
    let request = 0u64..6;
    let named = prop_oneof![
        (any::<u32>(), vec(rank_ack(), 0..4))
            .prop_map(|(protocol_version, acks)| In::HelloAck(HelloAck { protocol_version, acks })),
        vec(rank_ack(), 0..4).prop_map(|acks| In::Ack(ReceiptAck { acks })),
        launch(),
        (0..JOBS, 0u32..2, prop_oneof![0u64..200, Just(u64::MAX), any::<u64>()], "\\PC{0,20}").prop_map(
            |(job_id, attempt, grace_ms, reason)| {
                In::Cancel(CancelRanks { job_id, attempt, grace_ms, reason })
            }
        ),
        level.prop_map(|level| In::RunPreflight(RunPreflight { level })),
        (job(), 0u32..2).prop_map(|(job_id, attempt)| In::Forget(ForgetRanks { job_id, attempt })),
        (request.clone(), job(), 0u32..2, 0u32..4, any::<u32>(), any::<bool>(), run_name).prop_map(
            |(request_id, job_id, attempt, rank, tail_lines, follow, run_name)| {
                In::ReadLogs(ReadLogs { request_id, job_id, attempt, rank, tail_lines, follow, run_name })
            }
        ),
        request.clone().prop_map(|request_id| In::StopLogs(StopLogs { request_id })),
        (request, any::<u32>())
            .prop_map(|(request_id, pieces)| In::LogCredit(LogCredit { request_id, pieces })),
        (job(), 0u32..2, "\\PC{0,20}", signal).prop_map(|(job_id, attempt, reason, signal)| {
            In::CheckpointNow(CheckpointNow { job_id, attempt, reason, signal })
        }),
        any::<u64>().prop_map(|id| In::TelemetryAck(TelemetryAck { id })),
    ];
    prop_oneof![
        4 => named.prop_map(|m| ControllerMessage { msg: Some(m) }),
        1 => vec(any::<u8>(), 0..64).prop_map(|bytes| {
            // Any bytes that decode; a dismissal among them is left to the end of the test.
            let decoded = ControllerMessage::decode(bytes.as_slice()).unwrap_or_default();
            match decoded.msg {
                Some(In::Dismiss(_)) => ControllerMessage::default(),
                _ => decoded,
            }
        }),
    ]
}

/// Reads what the agent sends until the probe rank `job_id` is reported exited (its exit code),
/// acknowledging receipt batches as a controller would.
async fn probe_exit(fake: &mut common::Fake, job_id: u64) -> Result<i32, String> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let next = tokio::time::timeout_at(deadline, fake.seen.recv()).await;
        let message = match next {
            Err(_) => return Err(format!("probe job {job_id}: no exit reported in 30 s")),
            Ok(None) => return Err("the agent's stream ended".into()),
            Ok(Some(m)) => m.msg,
        };
        match message {
            Some(Out::Receipts(batch)) => {
                let acks = batch.receipts.iter().map(|r| RankAck { key: r.key, seq: r.seq }).collect();
                let _ = fake.to_agent.send(msg(In::Ack(ReceiptAck { acks }))).await;
            }
            Some(Out::RankUpdate(update)) => {
                let report = update.report.unwrap_or_default();
                if report.key.is_some_and(|k| k.job_id == job_id) && report.state == "exited" {
                    return Ok(report.exit_code);
                }
                if report.key.is_some_and(|k| k.job_id == job_id) && report.state == "lost" {
                    return Err(format!("probe job {job_id} lost: {}", report.message));
                }
            }
            Some(Out::Leaving(l)) => return Err(format!("the agent left: {}", l.reason)),
            _ => {}
        }
    }
}

#[test]
fn any_controller_message_leaves_the_agent_serving() {
    let panics = Arc::new(AtomicUsize::new(0));
    let default_hook = std::panic::take_hook();
    let seen_panics = panics.clone();
    std::panic::set_hook(Box::new(move |info| {
        seen_panics.fetch_add(1, Ordering::SeqCst);
        default_hook(info);
    }));
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let mut fake = rt.block_on(common::start(HOST));
    let Some(Out::Hello(_)) = rt.block_on(fake.seen.recv()).and_then(|m| m.msg) else {
        panic!("first message must be Hello")
    };
    let ack = HelloAck { protocol_version: PROTOCOL_VERSION, acks: vec![] };
    rt.block_on(fake.to_agent.send(msg(In::HelloAck(ack)))).unwrap();
    let work = fake.work.clone();
    let fake = RefCell::new(fake);
    let probe = Cell::new(PROBE_JOBS);
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(24);
    let mut runner = TestRunner::new(Config { cases, failure_persistence: None, ..Config::default() });
    let result = runner.run(&vec(message(), 1..10), |messages| {
        let job_id = probe.get() + 1;
        probe.set(job_id);
        let mut fake = fake.borrow_mut();
        rt.block_on(async {
            for m in messages {
                fake.to_agent.send(Ok(m)).await.map_err(|_| TestCaseError::fail("stream closed"))?;
            }
            let launch = common::sh_launch(job_id, &work, "exit 7");
            fake.to_agent.send(msg(In::Launch(launch))).await.map_err(|_| TestCaseError::fail("closed"))?;
            let code = probe_exit(&mut fake, job_id).await.map_err(TestCaseError::fail)?;
            prop_assert_eq!(code, 7, "the probe rank's exit code");
            prop_assert!(!fake.agent.is_finished(), "the agent stopped");
            prop_assert_eq!(panics.load(Ordering::SeqCst), 0, "a task of the agent panicked");
            Ok::<(), TestCaseError>(())
        })
    });
    let mut fake = fake.into_inner();
    if let Err(e) = result {
        let _ = fake.stop.send(());
        panic!("{e}");
    }
    // A dismissal ends the agent cleanly: its ranks stopped, the daemon done.
    rt.block_on(async {
        let dismiss = Dismiss { reason: "test over".into(), requeue: false };
        fake.to_agent.send(msg(In::Dismiss(dismiss))).await.unwrap();
        let ended = tokio::time::timeout(Duration::from_secs(30), &mut fake.agent).await;
        let ended = ended.expect("the agent ended within 30 s of its dismissal").expect("joined");
        assert!(ended.is_ok(), "{ended:?}");
        fake.server.abort();
    });
    assert_eq!(panics.load(Ordering::SeqCst), 0, "a task of the agent panicked");
}
