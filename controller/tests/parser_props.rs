//! Property tests of the controller's parsers of outside bytes: receipt bodies (any rank's
//! file), job specs and every other request as they arrive on the wire (prost-decoded from any
//! bytes), and the messages of both ends of an agent's stream. They return a verdict or an error
//! naming what is wrong; they never panic. Bounded: a few hundred cases each.

use proptest::prelude::*;
use prost::Message;
use trainyard_model::receipts::check;
use trainyard_model::spec;
use trainyard_proto::v1::{
    AgentMessage, CancelRequest, CompareRequest, ControllerMessage, DiagnoseRequest, GetJobRequest, JobSpec,
    ListJobsRequest, LogsRequest, NodesRequest, PreflightRequest, SubmitRequest, WatchRequest,
};

/// A JSON value of bounded depth, with the names receipts carry among random ones.
fn json() -> impl Strategy<Value = serde_json::Value> {
    let leaf = prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::from),
        any::<i64>().prop_map(serde_json::Value::from),
        any::<f64>()
            .prop_map(|f| serde_json::Number::from_f64(f).map_or(serde_json::Value::Null, Into::into)),
        "\\PC{0,10}".prop_map(serde_json::Value::from),
    ];
    leaf.prop_recursive(3, 24, 6, |inner| {
        let name = prop_oneof![
            Just("step".to_string()),
            Just("step_time_ms".to_string()),
            Just("mfu".to_string()),
            Just("schema".to_string()),
            Just("loss".to_string()),
            "[a-z_]{1,8}",
        ];
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::from),
            proptest::collection::btree_map(name, inner, 0..6)
                .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn receipt_bodies_of_any_text_get_a_verdict(kind in "[a-z]{0,8}", body in "(?s).{0,200}") {
        let _ = check(&kind, &body);
    }

    /// Any JSON object is a receipt (flagged or not); anything else is not.
    #[test]
    fn receipt_bodies_of_any_json_get_a_verdict(
        kind in prop_oneof![Just("step"), Just("eval"), Just("launch")],
        v in json(),
    ) {
        let verdict = check(kind, &v.to_string());
        prop_assert_eq!(verdict.is_ok(), v.is_object());
        if let Ok(checked) = verdict {
            prop_assert_eq!(checked.metrics.is_some(), kind == "step");
        }
    }

    /// Any bytes a client sends as a submit: decoded or refused by prost, and the spec inside
    /// accepted or refused with a field named.
    #[test]
    fn any_submit_bytes_are_decoded_and_judged(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        if let Ok(request) = SubmitRequest::decode(bytes.as_slice())
            && let Some(wire) = request.spec
            && let Err(e) = spec::parse(wire)
        {
            prop_assert!(!e.field.is_empty());
        }
    }

    /// Specs built field by field from random values: accepted whole, or refused naming a field.
    #[test]
    fn random_specs_are_accepted_or_name_a_field(
        name in "\\PC{0,20}", gpus in 0u32..100, per_node in 0u32..10,
        argv in proptest::collection::vec("\\PC{0,8}", 0..4), workdir in "\\PC{0,12}",
        env in proptest::collection::btree_map("\\PC{0,6}", "\\PC{0,6}", 0..4),
        preflight in "[a-z]{0,8}", priority in any::<i32>(),
    ) {
        use trainyard_proto::v1::{ExecEngine, Resources, job_spec::Engine};
        let wire = JobSpec {
            name,
            resources: Some(Resources { gpus, gpus_per_node: per_node, ..Default::default() }),
            engine: Some(Engine::Exec(ExecEngine { argv, workdir, source_dir: String::new() })),
            env: env.into_iter().collect(),
            preflight,
            priority,
            ..Default::default()
        };
        match spec::parse(wire.clone()) {
            Ok(parsed) => prop_assert_eq!(JobSpec::from(&parsed).name, wire.name),
            Err(e) => prop_assert!(!e.field.is_empty() && !e.reason.is_empty()),
        }
    }

    /// Every request type and both ends' stream messages decode or fail cleanly from any bytes;
    /// what decodes re-encodes to the same message.
    #[test]
    fn any_bytes_decode_or_fail_for_every_message(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let b = bytes.as_slice();
        let _ = GetJobRequest::decode(b);
        let _ = ListJobsRequest::decode(b);
        let _ = CancelRequest::decode(b);
        let _ = WatchRequest::decode(b);
        let _ = LogsRequest::decode(b);
        let _ = NodesRequest::decode(b);
        let _ = PreflightRequest::decode(b);
        let _ = DiagnoseRequest::decode(b);
        let _ = CompareRequest::decode(b);
        if let Ok(m) = AgentMessage::decode(b) {
            prop_assert_eq!(AgentMessage::decode(m.encode_to_vec().as_slice()).ok(), Some(m));
        }
        if let Ok(m) = ControllerMessage::decode(b) {
            prop_assert_eq!(ControllerMessage::decode(m.encode_to_vec().as_slice()).ok(), Some(m));
        }
    }
}
