//! The daemon's preflight against a fake controller: the report in `Hello`, a launch whose
//! preflight fails (ranks reported lost with the check, nothing started), a launch that passes
//! (ranks see `TRAINYARD_PREFLIGHT_REPORT`, `preflight.json` in the run directory), and
//! `RunPreflight`.

mod common;

use tokio::sync::mpsc;
use trainyard_proto::PROTOCOL_VERSION;
use trainyard_proto::v1::agent_message::Msg as Out;
use trainyard_proto::v1::controller_message::Msg as In;
use trainyard_proto::v1::{AgentMessage, HelloAck, Launch, RankReport, RunPreflight};

use common::{msg, next};

/// One H100 SXM GPU with fixture host facts and CUDA, so the verdicts do not depend on the
/// machine running the test.
const HOST: &str = r#"{"hostname": "pf-host",
  "gpus": [{"index": 0, "uuid": "GPU-0", "model": "NVIDIA H100 80GB HBM3", "memory_mib": 81559,
            "pci_bus_id": "00000000:18:00.0", "numa_node": 0}],
  "links": [["X"]], "numa_nodes": [{"id": 0, "cpus": "0-7"}],
  "host": {"numa_balancing": 0, "dev_shm_bytes": 17179869184},
  "cuda": {"cuda_version": "12.8"}}"#;

/// The next rank update in a final state, skipping heartbeats and the rest.
async fn final_update(seen: &mut mpsc::Receiver<AgentMessage>) -> RankReport {
    loop {
        if let Out::RankUpdate(u) = next(seen).await {
            let report = u.report.unwrap();
            if ["exited", "lost"].contains(&report.state.as_str()) {
                return report;
            }
        }
    }
}

fn launch(job_id: u64, work: &std::path::Path, env: &[(&str, &str)]) -> Launch {
    let script = r#"printf '%s' "$TRAINYARD_PREFLIGHT_REPORT" > report-id"#;
    let mut launch = common::sh_launch(job_id, work, script);
    let spec = launch.spec.as_mut().expect("spec");
    spec.env = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    spec.preflight = "quick".into();
    launch
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn launch_preflight_refuses_or_starts_ranks_under_its_report() {
    let common::Fake { mut seen, to_agent, server, stop, agent, dir: _dir, work, data } =
        common::start(HOST).await;

    let Out::Hello(hello) = next(&mut seen).await else { panic!("first message must be Hello") };
    let start = hello.preflight.expect("Hello carries the start-up preflight");
    assert_eq!((start.level.as_str(), start.verdict.as_str()), ("quick", "pass"), "{start:?}");
    assert_eq!(start.local_id, format!("pf-host-{}", start.started_at_ms));
    to_agent
        .send(msg(In::HelloAck(HelloAck { protocol_version: PROTOCOL_VERSION, acks: vec![] })))
        .await
        .unwrap();

    // NCCL_SHM_DISABLE=1 in the job's overlay: the preflight fails, the rank is never started.
    to_agent.send(msg(In::Launch(launch(1, &work, &[("NCCL_SHM_DISABLE", "1")])))).await.unwrap();
    let report = loop {
        if let Out::Preflight(report) = next(&mut seen).await {
            break report;
        }
    };
    assert_eq!(report.verdict, "fail");
    let lost = final_update(&mut seen).await;
    assert_eq!(lost.state, "lost");
    assert_eq!(
        lost.message,
        "preflight failed: env.nccl_shm_disable: NCCL_SHM_DISABLE=1 (job environment) (expected unset)"
    );
    assert!(!work.join("report-id").exists(), "the rank must not have run");
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(data.join("runs/job-1/attempt-0/preflight.json")).unwrap())
            .unwrap();
    assert_eq!(json["verdict"], "fail");

    // A clean job: the rank runs and sees the report's id.
    to_agent.send(msg(In::Launch(launch(2, &work, &[])))).await.unwrap();
    let report = loop {
        if let Out::Preflight(report) = next(&mut seen).await {
            break report;
        }
    };
    assert_eq!(report.verdict, "pass");
    let exited = final_update(&mut seen).await;
    assert_eq!((exited.state.as_str(), exited.exit_code), ("exited", 0), "{exited:?}");
    assert_eq!(std::fs::read_to_string(work.join("report-id")).unwrap(), report.local_id);
    assert!(data.join("runs/job-2/attempt-0/preflight.json").is_file());

    // On request the agent re-runs at the asked level and sends the report.
    to_agent.send(msg(In::RunPreflight(RunPreflight { level: "standard".into() }))).await.unwrap();
    let rerun = loop {
        if let Out::Preflight(report) = next(&mut seen).await {
            break report;
        }
    };
    assert_eq!(rerun.level, "standard");
    let nccl = rerun.checks.iter().find(|c| c.id == "nccl.busbw").expect("standard runs the NCCL check");
    assert_eq!(nccl.status, "skipped", "one GPU, or no NCCL here: {}", nccl.measured);

    let _ = stop.send(());
    agent.await.unwrap().unwrap();
    server.abort();
}
