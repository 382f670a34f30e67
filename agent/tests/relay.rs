//! The agent daemon against a fake controller on port 0: hello, launch, receipts before the
//! exit, acks, forget, and `Leaving` on shutdown.

mod common;

use std::time::Duration;

use trainyard_proto::PROTOCOL_VERSION;
use trainyard_proto::v1::agent_message::Msg as Out;
use trainyard_proto::v1::controller_message::Msg as In;
use trainyard_proto::v1::{ForgetRanks, HelloAck, RankAck, ReceiptAck};

use common::{msg, next};

const HOST: &str = r#"{"hostname": "test-host",
  "gpus": [{"index": 0, "uuid": "GPU-0", "model": "H100", "memory_mib": 80000,
            "pci_bus_id": "00000000:18:00.0", "numa_node": 0}],
  "links": [["X"]], "numa_nodes": [{"id": 0, "cpus": "0-1"}]}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipts_arrive_before_the_exit_and_leaving_ends_the_stream() {
    let common::Fake { mut seen, to_agent, server, stop, agent, dir, work, .. } = common::start(HOST).await;

    let Out::Hello(hello) = next(&mut seen).await else { panic!("first message must be Hello") };
    assert_eq!(hello.protocol_version, PROTOCOL_VERSION);
    assert_eq!(hello.agent_id, "test-host");
    assert!(hello.ranks.is_empty());
    to_agent
        .send(msg(In::HelloAck(HelloAck { protocol_version: PROTOCOL_VERSION, acks: vec![] })))
        .await
        .unwrap();

    let script = r#"for i in 0 1 2; do echo "{\"kind\":\"step\",\"step\":$i}" >> "$TRAINYARD_RECEIPTS"; done
echo garbage >> "$TRAINYARD_RECEIPTS"; printf '{"kind":"exit"}' >> "$TRAINYARD_RECEIPTS""#;
    let launch = common::sh_launch(9, &work, script);
    to_agent.send(msg(In::Launch(launch))).await.unwrap();

    let mut seqs = Vec::new();
    let exited = loop {
        match next(&mut seen).await {
            Out::Receipts(batch) => {
                let top = batch.receipts.iter().map(|r| r.seq).max().unwrap();
                seqs.extend(batch.receipts.iter().map(|r| r.seq));
                let key = batch.receipts[0].key;
                let ack = ReceiptAck { acks: vec![RankAck { key, seq: top }] };
                to_agent.send(msg(In::Ack(ack))).await.unwrap();
            }
            Out::RankUpdate(update) => {
                let report = update.report.unwrap();
                if report.state == "exited" {
                    break report;
                }
                assert!(["launching", "running"].contains(&report.state.as_str()), "{report:?}");
            }
            Out::Heartbeat(_) => {}
            other => panic!("unexpected {other:?}"),
        }
    };
    // The rank's receipts, its unterminated last one too, then the agent's exit receipt (on a
    // line of its own), all before the exit.
    assert_eq!(seqs, vec![0, 1, 2, 4, 5], "every receipt, the unterminated last one too, before the exit");
    assert_eq!((exited.exit_code, exited.signal, exited.skipped_lines), (0, 0, 1));

    let state_file = dir.path().join("data/state/ranks/9.0.0.json");
    assert!(state_file.exists());
    to_agent.send(msg(In::Forget(ForgetRanks { job_id: 9, attempt: 0 }))).await.unwrap();
    for _ in 0..100 {
        if !state_file.exists() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!state_file.exists(), "forgotten, fully acknowledged rank keeps its state file");
    assert!(dir.path().join("data/runs/job-9/attempt-0/rank-0/receipts.jsonl").exists());

    stop.send(()).unwrap();
    loop {
        match next(&mut seen).await {
            Out::Leaving(_) => break,
            Out::Heartbeat(_) | Out::RankUpdate(_) => {}
            other => panic!("unexpected {other:?} before Leaving"),
        }
    }
    drop(to_agent);
    let result = tokio::time::timeout(Duration::from_secs(5), agent).await.expect("agent did not stop");
    result.unwrap().unwrap();
    server.abort();
}
