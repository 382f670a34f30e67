//! Receipt schema v1, as the controller checks it at ingest (pure: a body in, a verdict out).
//!
//! docs/receipts.md is the contract for producers. In short: every receipt is one JSON object
//! with a string `kind` and `"schema": 1`; times are milliseconds (`*_ms`), sizes bytes
//! (`*_bytes`), throughput tokens per second, MFU a fraction of the GPU's dense bf16 peak
//! (0.45, not 45). A `step` receipt must carry `step` (an integer from 0) and `step_time_ms`.
//!
//! What the check decides:
//! - a body that is not a JSON object is not a receipt: acknowledged and left out;
//! - a receipt of a known kind whose fields have the wrong type or an impossible value (a
//!   negative time, an MFU above 1, an unknown schema version) is stored whole but flagged: its
//!   `problem` says which fields, and its typed step columns hold only the fields that passed;
//! - a step receipt's typed fields go to typed columns of its row (view `step_metrics`), which
//!   the views and the diagnosis read, on either backend.

use serde::Deserialize;
use serde_json::Value;

use crate::domain::ReceiptKind;

/// The receipt schema version this controller reads.
pub const SCHEMA_VERSION: u64 = 1;

/// The typed fields of a step receipt; `None` where the receipt did not carry the field or
/// carried something unusable (then the receipt's `problem` names it).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepMetrics {
    pub step_time_ms: Option<f64>,
    pub fwd_bwd_ms: Option<f64>,
    pub optimizer_ms: Option<f64>,
    pub optimizer_reduce_ms: Option<f64>,
    pub optimizer_compute_gather_ms: Option<f64>,
    pub optimizer_wait_ms: Option<f64>,
    pub tokens_per_s: Option<f64>,
    /// Fraction of the dense bf16 peak, 0..1.
    pub mfu: Option<f64>,
    pub loss: Option<f64>,
    pub mem_allocated_bytes: Option<i64>,
    pub mem_reserved_bytes: Option<i64>,
    pub mem_peak_allocated_bytes: Option<i64>,
}

/// What the check made of one body.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Checked {
    /// The typed fields of a step receipt (`None` for other kinds).
    pub metrics: Option<StepMetrics>,
    /// Why the receipt does not follow schema v1, if it does not.
    pub problem: Option<String>,
}

/// A body that is not one JSON object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotAnObject;

/// The fields the check reads; everything else in the body is skipped unparsed.
#[derive(Deserialize)]
struct Raw {
    schema: Option<Value>,
    step: Option<Value>,
    step_time_ms: Option<Value>,
    fwd_bwd_ms: Option<Value>,
    optimizer_ms: Option<Value>,
    optimizer_reduce_ms: Option<Value>,
    optimizer_compute_gather_ms: Option<Value>,
    optimizer_wait_ms: Option<Value>,
    tokens_per_s: Option<Value>,
    mfu: Option<Value>,
    loss: Option<Value>,
    mem_allocated_bytes: Option<Value>,
    mem_reserved_bytes: Option<Value>,
    mem_peak_allocated_bytes: Option<Value>,
}

/// Checks one receipt body of the given kind (the kind the agent read from it).
pub fn check(kind: &str, body: &str) -> Result<Checked, NotAnObject> {
    if !body.trim_start().starts_with('{') {
        return Err(NotAnObject);
    }
    let raw: Raw = serde_json::from_str(body).map_err(|_| NotAnObject)?;
    let mut problems = Problems::default();
    match &raw.schema {
        None => {}
        Some(v) if v.as_u64() == Some(SCHEMA_VERSION) => {}
        Some(v) => problems.push(format!("schema {v} is not one this controller reads ({SCHEMA_VERSION})")),
    }
    let metrics =
        (ReceiptKind::parse(kind) == Some(ReceiptKind::Step)).then(|| step_metrics(&raw, &mut problems));
    Ok(Checked { metrics, problem: problems.into_text() })
}

fn step_metrics(raw: &Raw, problems: &mut Problems) -> StepMetrics {
    match &raw.step {
        Some(v) if v.as_u64().is_some() => {}
        Some(v) => problems.push(format!("step {v} is not an integer from 0")),
        None => problems.push("no step".to_string()),
    }
    if raw.step_time_ms.is_none() {
        problems.push("no step_time_ms".to_string());
    }
    let mut time = |name: &str, v: &Option<Value>| problems.number(name, v, 0.0, f64::INFINITY);
    StepMetrics {
        step_time_ms: time("step_time_ms", &raw.step_time_ms),
        fwd_bwd_ms: time("fwd_bwd_ms", &raw.fwd_bwd_ms),
        optimizer_ms: time("optimizer_ms", &raw.optimizer_ms),
        optimizer_reduce_ms: time("optimizer_reduce_ms", &raw.optimizer_reduce_ms),
        optimizer_compute_gather_ms: time("optimizer_compute_gather_ms", &raw.optimizer_compute_gather_ms),
        optimizer_wait_ms: time("optimizer_wait_ms", &raw.optimizer_wait_ms),
        tokens_per_s: time("tokens_per_s", &raw.tokens_per_s),
        mfu: problems.number("mfu", &raw.mfu, 0.0, 1.0),
        loss: problems.number("loss", &raw.loss, f64::NEG_INFINITY, f64::INFINITY),
        mem_allocated_bytes: problems.bytes("mem_allocated_bytes", &raw.mem_allocated_bytes),
        mem_reserved_bytes: problems.bytes("mem_reserved_bytes", &raw.mem_reserved_bytes),
        mem_peak_allocated_bytes: problems.bytes("mem_peak_allocated_bytes", &raw.mem_peak_allocated_bytes),
    }
}

#[derive(Default)]
struct Problems(Vec<String>);

impl Problems {
    fn push(&mut self, p: String) {
        self.0.push(p);
    }

    /// A number in `lo..=hi`, `None` (and a problem) for anything else; JSON `null` is absent.
    fn number(&mut self, name: &str, v: &Option<Value>, lo: f64, hi: f64) -> Option<f64> {
        match v {
            None | Some(Value::Null) => None,
            Some(Value::Number(n)) => match n.as_f64() {
                Some(x) if (lo..=hi).contains(&x) => Some(x),
                _ if name == "mfu" => {
                    self.push(format!("mfu {n} is not a fraction from 0 to 1 (schema 1: 0.45, not 45)"));
                    None
                }
                _ => {
                    self.push(format!("{name} {n} is out of range"));
                    None
                }
            },
            Some(other) => {
                self.push(format!("{name} {other} is not a number"));
                None
            }
        }
    }

    fn bytes(&mut self, name: &str, v: &Option<Value>) -> Option<i64> {
        match v {
            None | Some(Value::Null) => None,
            Some(Value::Number(n)) if n.as_i64().is_some_and(|b| b >= 0) => n.as_i64(),
            Some(other) => {
                self.push(format!("{name} {other} is not a byte count"));
                None
            }
        }
    }

    fn into_text(self) -> Option<String> {
        (!self.0.is_empty()).then(|| self.0.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_v1_step_receipt_yields_its_typed_fields() {
        let body = r#"{"schema":1,"kind":"step","step":12,"step_time_ms":702.5,"optimizer_ms":57.8,
            "optimizer_reduce_ms":30.1,"tokens_per_s":746000.0,"mfu":0.41,"loss":3.2,
            "mem_allocated_bytes":51000000000,"extra":{"anything":[1,2]}}"#;
        let c = check("step", body).unwrap();
        assert_eq!(c.problem, None);
        let m = c.metrics.unwrap();
        assert_eq!((m.step_time_ms, m.optimizer_ms, m.mfu), (Some(702.5), Some(57.8), Some(0.41)));
        assert_eq!((m.mem_allocated_bytes, m.fwd_bwd_ms), (Some(51_000_000_000), None));
    }

    #[test]
    fn wrong_types_and_impossible_values_are_named_and_left_out() {
        let body = r#"{"kind":"step","step":3,"step_time_ms":"slow","optimizer_ms":-4,"mfu":45.2,
            "loss":null,"mem_reserved_bytes":1.5}"#;
        let c = check("step", body).unwrap();
        let problem = c.problem.unwrap();
        for expected in [
            "step_time_ms \"slow\" is not a number",
            "optimizer_ms -4 is out of range",
            "mfu 45.2 is not a fraction",
            "mem_reserved_bytes 1.5",
        ] {
            assert!(problem.contains(expected), "{problem}");
        }
        let m = c.metrics.unwrap();
        assert_eq!(
            (m.step_time_ms, m.optimizer_ms, m.mfu, m.loss, m.mem_reserved_bytes),
            (None, None, None, None, None)
        );
    }

    #[test]
    fn missing_required_fields_unknown_schemas_and_non_objects() {
        let c = check("step", r#"{"kind":"step"}"#).unwrap();
        assert_eq!(c.problem.as_deref(), Some("no step; no step_time_ms"));
        let c = check("eval", r#"{"kind":"eval","schema":2,"step":3}"#).unwrap();
        assert_eq!(
            (c.metrics, c.problem.as_deref()),
            (None, Some("schema 2 is not one this controller reads (1)"))
        );
        assert_eq!(check("launch", r#"{"kind":"launch","torch":"2.11.0"}"#).unwrap(), Checked::default());
        assert_eq!(check("step", "[1,2]"), Err(NotAnObject));
        assert_eq!(check("step", "{\"kind\":"), Err(NotAnObject));
    }
}
