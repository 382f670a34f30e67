//! `ctl compare A B`: two runs side by side (provenance, env overlay, placement, preflight
//! verdicts, step time and throughput, collectives predicted and measured) and one line on
//! what most likely explains the difference.
//!
//! The verdict takes the first of these that holds, most specific first: a diagnosis finding
//! the slower run has and the faster one lacks; an env knob that differs and moves NCCL or
//! CUDA; another interconnect class; another number of nodes; other torch/CUDA/NCCL/driver
//! versions; another code revision. Runs within [`SAME_PACE`] of each other are alike.

use std::collections::{BTreeMap, BTreeSet};

use super::{Diagnosis, median};
use trainyard_model::domain::{InterconnectClass, Verdict};
use trainyard_proto::v1 as pb;

/// Step times within this ratio are the same pace (machines are noisy).
pub const SAME_PACE: f64 = 1.05;

/// Launch-receipt fields compared as provenance, in this order.
pub const PROVENANCE_KEYS: [&str; 10] = [
    "source_rev",
    "source_dirty",
    "build_rev",
    "torch",
    "cuda",
    "nccl",
    "driver",
    "python",
    "device",
    "engine",
];

/// Env variables that change how NCCL, CUDA or the allocator behave: a difference in one of
/// them is a likely explanation.
pub fn is_performance_knob(name: &str) -> bool {
    ["NCCL_", "CUDA_", "TORCH_NCCL_", "PYTORCH_", "OMP_", "NVIDIA_"].iter().any(|p| name.starts_with(p))
}

/// p10, p50 and p90 of some values.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Distribution {
    pub n: usize,
    pub p10: f64,
    pub p50: f64,
    pub p90: f64,
}

impl Distribution {
    /// `None` for no values; non-finite values are left out.
    pub fn of(values: impl IntoIterator<Item = f64>) -> Option<Distribution> {
        let mut xs: Vec<f64> = values.into_iter().filter(|v| v.is_finite()).collect();
        if xs.is_empty() {
            return None;
        }
        xs.sort_by(f64::total_cmp);
        let at = |q: f64| xs[((xs.len() - 1) as f64 * q).round() as usize];
        let (p10, p90) = (at(0.1), at(0.9));
        Some(Distribution { n: xs.len(), p10, p50: median(&mut xs), p90 })
    }
}

/// One node of a run's placement.
#[derive(Debug, Clone, PartialEq)]
pub struct PlacedNode {
    pub agent_id: String,
    pub ranks: u32,
    pub numa_layout: String,
    pub class: Option<InterconnectClass>,
    pub verdict: Option<Verdict>,
    /// Checks of its newest preflight that did not pass, "id: measured".
    pub problems: Vec<String>,
}

/// One run as `compare` sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Side {
    pub job_id: u64,
    pub name: String,
    pub state: String,
    pub attempt: u32,
    /// [`PROVENANCE_KEYS`] found in rank 0's launch receipt.
    pub provenance: BTreeMap<String, String>,
    pub env: BTreeMap<String, String>,
    pub nodes: Vec<PlacedNode>,
    /// Steady-state step time (ms) and tokens/s over every rank.
    pub step_time_ms: Option<Distribution>,
    pub tokens_per_s: Option<Distribution>,
    pub diagnosis: Diagnosis,
}

/// A value that differs between the runs (`None`: absent on that side).
#[derive(Debug, Clone, PartialEq)]
pub struct Diff {
    pub name: String,
    pub a: Option<String>,
    pub b: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Comparison {
    pub a: Side,
    pub b: Side,
    pub env: Vec<Diff>,
    pub provenance: Vec<Diff>,
    /// B's median step time over A's; `None` unless both have one.
    pub step_time_ratio: Option<f64>,
    /// Every difference found, the most likely explanation first.
    pub differences: Vec<String>,
    pub verdict: String,
}

/// The record on the wire, which `ctl -o json` and the web view serialise as it is.
impl From<&Comparison> for pb::Comparison {
    fn from(c: &Comparison) -> pb::Comparison {
        let diffs = |d: &[Diff]| -> Vec<pb::Difference> {
            d.iter()
                .map(|d| pb::Difference { name: d.name.clone(), a: d.a.clone(), b: d.b.clone() })
                .collect()
        };
        pb::Comparison {
            a: Some(pb::JobSide::from(&c.a)),
            b: Some(pb::JobSide::from(&c.b)),
            env: diffs(&c.env),
            provenance: diffs(&c.provenance),
            step_time_ratio: c.step_time_ratio,
            differences: c.differences.clone(),
            verdict: c.verdict.clone(),
        }
    }
}

impl From<&Side> for pb::JobSide {
    fn from(s: &Side) -> pb::JobSide {
        let dist = |d: &Option<Distribution>| {
            d.map(|d| pb::Distribution { n: d.n as u64, p10: d.p10, p50: d.p50, p90: d.p90 })
        };
        pb::JobSide {
            job_id: s.job_id,
            name: s.name.clone(),
            state: s.state.clone(),
            attempt: s.attempt,
            provenance: s.provenance.clone(),
            nodes: s
                .nodes
                .iter()
                .map(|n| pb::PlacedNode {
                    agent_id: n.agent_id.clone(),
                    ranks: n.ranks,
                    numa_layout: n.numa_layout.clone(),
                    interconnect_class: n.class.map(|c| c.to_string()).unwrap_or_default(),
                    verdict: n.verdict.map(|v| v.to_string()).unwrap_or_default(),
                    problems: n.problems.clone(),
                })
                .collect(),
            step_time_ms: dist(&s.step_time_ms),
            tokens_per_s: dist(&s.tokens_per_s),
            diagnosis: Some(s.diagnosis.message(s.job_id)),
        }
    }
}

fn diffs(a: &BTreeMap<String, String>, b: &BTreeMap<String, String>) -> Vec<Diff> {
    let names: BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    names
        .into_iter()
        .filter(|n| a.get(*n) != b.get(*n))
        .map(|n| Diff { name: n.clone(), a: a.get(n).cloned(), b: b.get(n).cloned() })
        .collect()
}

fn shown(v: &Option<String>) -> &str {
    v.as_deref().unwrap_or("unset")
}

fn classes(side: &Side) -> BTreeSet<String> {
    side.nodes.iter().map(|n| n.class.map_or("unknown", |c| c.as_str()).to_string()).collect()
}

/// Compares two runs; `a` is the reference.
pub fn compare(a: Side, b: Side) -> Comparison {
    let env = diffs(&a.env, &b.env);
    let provenance = diffs(&a.provenance, &b.provenance);
    let step_time_ratio = match (a.step_time_ms, b.step_time_ms) {
        (Some(x), Some(y)) if x.p50 > 0.0 => Some(y.p50 / x.p50),
        _ => None,
    };
    let (slow, fast) = if step_time_ratio.unwrap_or(1.0) >= 1.0 { (&b, &a) } else { (&a, &b) };
    let label = |s: &Side| {
        if s.job_id == a.job_id { format!("A (job {})", s.job_id) } else { format!("B (job {})", s.job_id) }
    };
    let mut differences = Vec::new();
    let fast_causes: BTreeSet<_> = fast.diagnosis.findings.iter().map(|f| f.cause).collect();
    for f in slow.diagnosis.findings.iter().filter(|f| !fast_causes.contains(&f.cause)) {
        differences.push(format!("{}: {}: {}", label(slow), f.cause, f.summary));
    }
    for d in env.iter().filter(|d| is_performance_knob(&d.name)) {
        differences.push(format!("env {}: {} in A, {} in B", d.name, shown(&d.a), shown(&d.b)));
    }
    let (ca, cb) = (classes(&a), classes(&b));
    if ca != cb {
        let join = |s: &BTreeSet<String>| s.iter().cloned().collect::<Vec<_>>().join("+");
        differences.push(format!("interconnect: {} nodes in A, {} in B", join(&ca), join(&cb)));
    }
    if a.nodes.len() != b.nodes.len() {
        differences.push(format!("placement: {} node(s) in A, {} in B", a.nodes.len(), b.nodes.len()));
    }
    for d in provenance.iter().filter(|d| ["torch", "cuda", "nccl", "driver"].contains(&d.name.as_str())) {
        differences.push(format!("{} {} in A, {} in B", d.name, shown(&d.a), shown(&d.b)));
    }
    for d in provenance.iter().filter(|d| d.name.starts_with("source_") || d.name == "build_rev") {
        differences.push(format!("code: {} {} in A, {} in B", d.name, shown(&d.a), shown(&d.b)));
    }
    for d in env.iter().filter(|d| !is_performance_knob(&d.name)) {
        differences.push(format!("env {}: {} in A, {} in B", d.name, shown(&d.a), shown(&d.b)));
    }
    let pace = match step_time_ratio {
        None => "step times cannot be compared (a run has no step receipts)".to_string(),
        Some(r) if r.max(1.0 / r) < SAME_PACE => format!("same pace (B/A step time {r:.2})"),
        Some(r) if r >= 1.0 => format!("B is {r:.2}x slower per step than A"),
        Some(r) => format!("B is {:.2}x faster per step than A", 1.0 / r),
    };
    let same_pace = step_time_ratio.is_none_or(|r| r.max(1.0 / r) < SAME_PACE);
    let verdict = match differences.first() {
        Some(first) if !same_pace => format!("{pace}; most likely: {first}"),
        Some(first) => format!("{pace}; they differ in: {first}"),
        None if same_pace => format!("{pace}; nothing recorded differs"),
        None => {
            format!("{pace}, and nothing recorded (findings, env, placement, versions, code) explains it")
        }
    };
    Comparison { a, b, env, provenance, step_time_ratio, differences, verdict }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::diagnose::{Finding, Measure};
    use trainyard_model::domain::Cause;

    fn side(job_id: u64, p50: f64) -> Side {
        Side {
            job_id,
            name: format!("job-{job_id}"),
            state: "succeeded".into(),
            attempt: 0,
            provenance: [("torch".to_string(), "2.11.0".to_string()), ("source_rev".into(), "abc".into())]
                .into(),
            env: [("WANDB_MODE".to_string(), "offline".to_string())].into(),
            nodes: vec![PlacedNode {
                agent_id: "sxm-a".into(),
                ranks: 8,
                numa_layout: "0:8".into(),
                class: Some(InterconnectClass::Nvswitch),
                verdict: Some(Verdict::Pass),
                problems: vec![],
            }],
            step_time_ms: Distribution::of([p50 * 0.98, p50, p50 * 1.02]),
            tokens_per_s: Distribution::of([1e6 / p50]),
            diagnosis: Diagnosis {
                attempt: 0,
                metric: "step_time_ms",
                warmup_steps: 3,
                samples_used: 100,
                ranks: vec![],
                nodes: vec![],
                findings: vec![],
                unusable: vec![],
                notes: vec![],
                predicted_comm_ms: 0.0,
                measured_optimizer_ms: None,
                median_step_ms: Some(p50),
                median_tokens_per_s: None,
            },
        }
    }

    #[test]
    fn a_finding_of_the_slower_run_is_the_verdict() {
        let a = side(1, 702.0);
        let mut b = side(2, 1295.0);
        b.nodes.push(PlacedNode {
            agent_id: "sxm-b".into(),
            numa_layout: "0:4 1:4".into(),
            ..a.nodes[0].clone()
        });
        b.diagnosis.findings.push(Finding {
            cause: Cause::NumaSplit,
            summary: "sxm-b runs 1.84x slower than the fastest node".into(),
            subject: "sxm-b".into(),
            steps: None,
            nodes: vec!["sxm-b".into()],
            ranks: (8..16).collect(),
            evidence: vec![Measure { name: "slowdown".into(), value: 1.84, unit: "x" }],
            expected_cost: "",
            remedy: String::new(),
        });
        let c = compare(a, b);
        assert_eq!(
            c.verdict,
            "B is 1.84x slower per step than A; most likely: B (job 2): numa.split: sxm-b runs 1.84x slower than the fastest node"
        );
        assert_eq!(c.differences[1], "placement: 1 node(s) in A, 2 in B");
        assert!((c.step_time_ratio.unwrap() - 1295.0 / 702.0).abs() < 1e-9);
    }

    #[test]
    fn env_knobs_then_fabric_then_versions_then_code() {
        let a = side(1, 700.0);
        let mut b = side(2, 2100.0);
        b.env.insert("NCCL_SHM_DISABLE".into(), "1".into());
        b.env.remove("WANDB_MODE");
        b.nodes[0].class = Some(InterconnectClass::Pcie);
        b.provenance.insert("torch".into(), "2.10.0".into());
        b.provenance.insert("source_rev".into(), "def".into());
        let c = compare(a, b);
        assert_eq!(
            c.differences,
            vec![
                "env NCCL_SHM_DISABLE: unset in A, 1 in B",
                "interconnect: nvswitch nodes in A, pcie in B",
                "torch 2.11.0 in A, 2.10.0 in B",
                "code: source_rev abc in A, def in B",
                "env WANDB_MODE: offline in A, unset in B",
            ]
        );
        assert!(
            c.verdict.starts_with("B is 3.00x slower per step than A; most likely: env NCCL_SHM_DISABLE")
        );
        assert_eq!(c.env.len(), 2);
    }

    #[test]
    fn alike_runs_say_so_and_a_faster_b_is_named_faster() {
        let c = compare(side(1, 700.0), side(2, 710.0));
        assert_eq!(c.verdict, "same pace (B/A step time 1.01); nothing recorded differs");
        let mut b = side(2, 350.0);
        b.provenance.insert("nccl".into(), "2.28.9".into());
        let c = compare(side(1, 700.0), b);
        assert_eq!(c.verdict, "B is 2.00x faster per step than A; most likely: nccl unset in A, 2.28.9 in B");
        let mut empty = side(3, 1.0);
        empty.step_time_ms = None;
        assert!(compare(side(1, 700.0), empty).verdict.starts_with("step times cannot be compared"));
        let d = Distribution::of((1..=100).map(f64::from)).unwrap();
        assert_eq!((d.n, d.p10, d.p50, d.p90), (100, 11.0, 50.5, 90.0));
        assert_eq!(Distribution::of([f64::NAN]), None);
    }

    /// `ctl compare -o json` and the web view's `/api/compare` print the wire record as it is:
    /// its field names are the documented interface (docs/diagnosis.md), down to the diagnosis.
    #[test]
    fn the_record_crosses_the_wire_whole_and_keeps_its_field_names() {
        let mut b = side(2, 1295.0);
        b.env.insert("NCCL_ALGO".into(), "Ring".into());
        b.diagnosis.findings.push(Finding {
            cause: Cause::NumaSplit,
            summary: "slow".into(),
            subject: "sxm-a".into(),
            steps: None,
            nodes: vec!["sxm-a".into()],
            ranks: vec![3],
            evidence: vec![Measure { name: "slowdown".into(), value: 1.84, unit: "x" }],
            expected_cost: "",
            remedy: String::new(),
        });
        let c = compare(side(1, 702.0), b);
        let json = serde_json::to_value(pb::Comparison::from(&c)).expect("serialises");
        let keys = |v: &serde_json::Value| -> Vec<String> {
            let mut k: Vec<String> = v.as_object().expect("an object").keys().cloned().collect();
            k.sort();
            k
        };
        assert_eq!(keys(&json), ["a", "b", "differences", "env", "provenance", "step_time_ratio", "verdict"]);
        assert_eq!(
            keys(&json["b"]),
            [
                "attempt",
                "diagnosis",
                "job_id",
                "name",
                "nodes",
                "provenance",
                "state",
                "step_time_ms",
                "tokens_per_s"
            ]
        );
        assert_eq!(json["b"]["nodes"][0]["interconnect_class"], "nvswitch");
        assert_eq!(json["b"]["provenance"]["torch"], "2.11.0");
        assert_eq!(json["b"]["step_time_ms"]["p50"], 1295.0);
        let d = &json["b"]["diagnosis"];
        assert_eq!((d["job_id"].as_u64(), d["healthy"].as_bool()), (Some(2), Some(false)));
        assert_eq!(d["findings"][0]["cause"], "numa.split");
        assert_eq!(d["findings"][0]["evidence"][0]["unit"], "x");
        assert_eq!(json["verdict"], c.verdict.as_str());
        assert_eq!(
            (&json["env"][0]["name"], &json["env"][0]["a"], &json["env"][0]["b"]),
            (&serde_json::json!("NCCL_ALGO"), &serde_json::Value::Null, &serde_json::json!("Ring")),
            "{json:#}"
        );
    }
}
