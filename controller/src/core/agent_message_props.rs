//! Property test: whatever an agent sends on its stream (receipt batches with any keys, bodies
//! and kinds, rank reports with any states, preflight reports, hellos, preemption notices and
//! telemetry batches decoded from any bytes, log pieces, heartbeats, a leave), the controller
//! answers each message with a result, never a panic, and still serves afterwards. The messages
//! go through the same calls the `Agents` service makes; a heartbeat is only a sign of life, which
//! the service notes before it reaches the core.

use proptest::prelude::*;
use prost::Message;
use trainyard_proto::v1::{
    Hello, LogData, Notice, PreflightReport, RankKey, RankReport, Receipt, TelemetryBatch,
};

use crate::core::test_support::{connect, controller, spec, store};

#[derive(Debug, Clone)]
enum Sent {
    Receipts(Vec<Receipt>),
    Report(RankReport),
    Preflight(Vec<u8>),
    Hello(Vec<u8>),
    Notice(Vec<u8>),
    Telemetry(Vec<u8>),
    Log(LogData),
    Leaving(String),
}

fn key() -> impl Strategy<Value = RankKey> {
    (0u64..4, 0u32..3, 0u32..4).prop_map(|(job_id, attempt, rank)| RankKey { job_id, attempt, rank })
}

fn body() -> impl Strategy<Value = String> {
    prop_oneof![
        (0i64..100, any::<f64>())
            .prop_map(|(s, t)| format!(r#"{{"kind":"step","step":{s},"step_time_ms":{t}}}"#)),
        Just(r#"{"kind":"step","schema":9,"mfu":7}"#.to_string()),
        "\\PC{0,40}",
    ]
}

fn sent() -> impl Strategy<Value = Sent> {
    let receipt =
        (key(), any::<u64>(), prop_oneof![Just("step".to_string()), "[a-z]{0,6}"], any::<i64>(), body())
            .prop_map(|(key, seq, kind, step, body)| Receipt { key: Some(key), seq, kind, step, body });
    let state = prop_oneof![
        Just("running".to_string()),
        Just("exited".to_string()),
        Just("lost".to_string()),
        Just("planned".to_string()),
        "[a-z]{0,8}",
    ];
    let report = (key(), state, any::<u32>(), any::<i32>(), any::<i32>(), "\\PC{0,20}").prop_map(
        |(key, state, pid, exit_code, signal, message)| RankReport {
            key: Some(key),
            state,
            pid,
            exit_code,
            signal,
            message,
            ..Default::default()
        },
    );
    prop_oneof![
        4 => proptest::collection::vec(receipt, 0..8).prop_map(Sent::Receipts),
        3 => report.prop_map(Sent::Report),
        1 => proptest::collection::vec(any::<u8>(), 0..200).prop_map(Sent::Preflight),
        1 => proptest::collection::vec(any::<u8>(), 0..200).prop_map(Sent::Hello),
        1 => proptest::collection::vec(any::<u8>(), 0..60).prop_map(Sent::Notice),
        1 => proptest::collection::vec(any::<u8>(), 0..300).prop_map(Sent::Telemetry),
        1 => (any::<u64>(), any::<bool>(), "\\PC{0,10}").prop_map(|(request_id, done, error)| Sent::Log(LogData {
            request_id,
            done,
            error,
            ..Default::default()
        })),
        1 => "\\PC{0,10}".prop_map(Sent::Leaving),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn any_agent_message_gets_an_answer_and_the_controller_keeps_serving(
        messages in proptest::collection::vec(sent(), 1..12)
    ) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let store = store().await;
            let c = controller(&store).await;
            let _agent = connect(&c, "node-a", 4, None).await;
            let job = c.jobs().submit(spec(2), None).await.expect("submit");
            crate::core::reconcile::Reconciler(&c.s).reconcile().await;
            for m in messages {
                // Errors are answers (the service ends or refuses the stream); panics are not.
                match m {
                    Sent::Receipts(receipts) => {
                        let _ = c.receipts().ingest("node-a", trainyard_proto::v1::ReceiptBatch { receipts }).await;
                    }
                    Sent::Report(report) => {
                        let _ = c.jobs().rank_report("node-a", &report).await;
                    }
                    Sent::Preflight(bytes) => {
                        if let Ok(report) = PreflightReport::decode(bytes.as_slice()) {
                            let _ = c.nodes().preflight_report("node-a", report).await;
                        }
                    }
                    Sent::Hello(bytes) => {
                        // A second agent's hello, whatever it says of itself.
                        if let Ok(hello) = Hello::decode(bytes.as_slice()) {
                            let (tx, _rx) = tokio::sync::mpsc::channel(16);
                            let _ = c.nodes().hello(hello, tx).await;
                        }
                    }
                    Sent::Notice(bytes) => {
                        if let Ok(notice) = Notice::decode(bytes.as_slice()) {
                            let _ = c.nodes().notice("node-a", &notice).await;
                        }
                    }
                    Sent::Telemetry(bytes) => {
                        if let Ok(batch) = TelemetryBatch::decode(bytes.as_slice()) {
                            let _ = c.receipts().telemetry("node-a", batch).await;
                        }
                    }
                    Sent::Log(data) => c.jobs().log_data("node-a", data),
                    Sent::Leaving(reason) => {
                        let _ = c.nodes().leaving("node-a", &reason).await;
                    }
                }
                crate::core::reconcile::Reconciler(&c.s).reconcile().await;
            }
            assert!(c.jobs().get(job).await.is_ok(), "the controller still answers");
            assert!(!c.nodes().list().await.is_empty());
        });
    }
}
