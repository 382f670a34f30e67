//! What a diagnosis reads: the job's step samples, allocations and nodes, and the questions
//! the rules ask of them.

use std::collections::BTreeMap;

use trainyard_model::domain::{CheckStatus, Inventory};
use trainyard_model::records::{Allocation, GpuWindowRecord, PreflightRecord};
use trainyard_model::spec::JobSpec;

/// One step receipt's typed fields, as the diagnosis reads them.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct StepSample {
    pub rank: u32,
    pub step: i64,
    pub step_time_ms: Option<f64>,
    pub fwd_bwd_ms: Option<f64>,
    pub optimizer_ms: Option<f64>,
    pub tokens_per_s: Option<f64>,
    /// The receipt broke schema v1 (`receipts.problem`).
    pub flagged: bool,
}

/// What the controller knows of one node of the job.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct NodeFacts {
    pub inventory: Inventory,
    pub preflight: Option<PreflightRecord>,
}

/// Everything a diagnosis reads.
#[derive(Debug, Clone, Copy)]
pub struct Input<'a> {
    pub spec: &'a JobSpec,
    /// The attempt diagnosed (its allocations and samples).
    pub attempt: u32,
    pub allocations: &'a [Allocation],
    pub samples: &'a [StepSample],
    /// By agent id; nodes the controller no longer knows are absent.
    pub nodes: &'a BTreeMap<String, NodeFacts>,
    /// The cost model's collective time per step for this placement, ms; 0 when unknown.
    pub predicted_comm_ms: f64,
    /// GPU telemetry windows of the attempt (empty without telemetry).
    pub windows: &'a [GpuWindowRecord],
}

/// The value of `name` in the job's env overlay when it is set to something other than 0.
pub(super) fn env_on<'a>(spec: &'a JobSpec, name: &str) -> Option<&'a str> {
    spec.env.get(name).map(|v| v.trim()).filter(|v| !v.is_empty() && *v != "0")
}

/// (measured, status) of the check `id` in the node's newest preflight.
pub(super) fn node_check<'a>(input: &'a Input<'_>, agent: &str, id: &str) -> Option<(&'a str, CheckStatus)> {
    let report = input.nodes.get(agent)?.preflight.as_ref()?;
    report.checks.iter().find(|c| c.id == id).map(|c| (c.measured.as_str(), c.status))
}

pub(super) fn bad(status: CheckStatus) -> bool {
    matches!(status, CheckStatus::Warn | CheckStatus::Fail)
}

/// Two kernel CPU lists naming the same CPUs ("0-3" and "0,1,2,3").
pub(super) fn same_cpus(a: &str, b: &str) -> bool {
    use trainyard_proto::contract::cpulist;
    match (cpulist::parse(a), cpulist::parse(b)) {
        (Ok(x), Ok(y)) => x == y,
        _ => a == b,
    }
}
