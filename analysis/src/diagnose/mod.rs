//! `ctl diagnose`: the likely cause of a slow or uneven run, from what the controller already
//! holds: the step receipts, the allocations (planned and effective binding), the job's env
//! overlay, the nodes' inventories and preflight reports, and the cost model's prediction for
//! the placement. A pure function of those, so every rule is unit-tested (docs/diagnosis.md).
//!
//! The rules, in the order findings are listed:
//! - `numa.split`: a node clearly slower than the job's fastest node (>= 1.25x), whose GPUs of
//!   this job sit on more than one NUMA node.
//! - `numa.binding_refused`: ranks whose binding read back from `/proc` differs from the plan.
//! - `cpu.starved`: a slow node whose preflight found too few CPUs per GPU.
//! - `shm.disabled` / `p2p.disabled`: the overlay turns an NCCL transport off, or a node's
//!   preflight found `/dev/shm` unusable.
//! - `cuda_device_max_connections`: the overlay sets it under the default of 8.
//! - `fabric.fallback`: the measured optimizer step (collectives included) is >= 3x what the
//!   cost model predicts for the placement's links, with no transport turned off.
//! - the GPU's own causes from telemetry ([`gpu`]): `gpu.thermal_throttle`, `gpu.power_capped`,
//!   `gpu.hw_slowdown`, `gpu.clocks_low`, `pcie.downtrained`, `nvlink.down`, `nvlink.errors`
//!   where they coincide with the slow windows of their rank and set it apart from the fast
//!   ones (listed first: they name one GPU); `gpu.xid`, `gpu.ecc`, `gpu.row_remap_pending`
//!   whatever the pace (listed after the rules above).
//! - `straggler.unexplained`: stragglers (see [`stragglers`]) on nodes no finding covers.
//!
//! A node-level cause names a slow node only where it sets it apart: a property the job's fast
//! nodes share too (all of them split over NUMA nodes, all short of CPUs) is noted, not blamed.

pub mod compare;
pub mod goodput;
pub mod gpu;
pub mod live;
mod rules;
pub mod stall;
pub mod stragglers;

use std::collections::{BTreeMap, BTreeSet};

pub use stragglers::{RankScore, StragglerPolicy, median, score_ranks};
use trainyard_model::domain::{Cause, CheckStatus, Inventory};
use trainyard_model::records::{Allocation, GpuWindowRecord, PreflightRecord};
use trainyard_model::spec::JobSpec;

/// A node this much slower than the job's fastest node is slow.
pub const SLOW_NODE_RATIO: f64 = 1.25;
/// Measured collectives this many times the cost model's prediction are a fabric fallback.
pub const FALLBACK_RATIO: f64 = 3.0;
/// `CUDA_DEVICE_MAX_CONNECTIONS` below this serialises communication with compute.
pub const DEFAULT_DEVICE_MAX_CONNECTIONS: u32 = 8;

/// What the field reports measured for each cause (docs/field-notes.md §1, §2), quoted as the
/// expected cost of a finding.
pub mod cost_of {
    pub const NUMA_SPLIT: &str = "nanochat d26 on an 8xH100 SXM node ran 1295 ms per step instead of 702 ms \
        (1.84x) with its GPUs split 4+4 over two NUMA nodes: NCCL's CPU proxy threads starved";
    pub const BINDING: &str = "an unbound rank's NCCL threads run on any socket: the NUMA-split cost, up to \
        1.84x per step (1295 against 702 ms on SXM)";
    pub const CPU: &str = "too few CPUs per GPU stalls NCCL's control threads like a NUMA split: up to 1.84x \
        per step";
    pub const SHM: &str = "NCCL_SHM_DISABLE=1 made an H100 NVL node 3.2x slower per step (2031 -> 6495 ms), \
        its optimizer step 13.7x and total NCCL time 14.3x (traffic fell back to sockets)";
    pub const P2P: &str = "without P2P, GPU-GPU traffic goes through host memory: PCIe-class collectives, \
        ~7x slower than NVLink (28.5 s against 3.9 s of NCCL time per 10 steps of nanochat d26)";
    pub const FABRIC: &str = "collectives over PCIe instead of NVLink ran ~7x slower (nanochat d26: NCCL \
        28.5 s against 3.9 s per 10 steps; step 1412 against 702 ms)";
    pub const CONNECTIONS: &str = "CUDA_DEVICE_MAX_CONNECTIONS=1 serialises all_gather/reduce_scatter with \
        compute: the optimizer's collectives no longer overlap the backward pass";
    pub const STRAGGLER: &str = "in data-parallel training every rank waits for the slowest at each \
        collective: the whole job runs at the straggler's pace";
}

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

/// A number behind a finding.
#[derive(Debug, Clone, PartialEq)]
pub struct Measure {
    pub name: String,
    pub value: f64,
    pub unit: &'static str,
}

fn measure(name: impl Into<String>, value: f64, unit: &'static str) -> Measure {
    Measure { name: name.into(), value, unit }
}

/// A likely cause, where it is, the numbers behind it, what it costs and what to do.
#[derive(Debug, Clone, PartialEq)]
pub struct Finding {
    pub cause: Cause,
    /// One line for people.
    pub summary: String,
    /// What it is about: `job`, a node, `node/gpuN`, or `ranks 3,5` (the live diagnosis keeps
    /// one open finding per job, cause and subject).
    pub subject: String,
    /// The steps it concerns, where a rule knows them (a GPU condition's windows): a plot's band.
    pub steps: Option<(i64, i64)>,
    pub nodes: Vec<String>,
    pub ranks: Vec<u32>,
    pub evidence: Vec<Measure>,
    pub expected_cost: &'static str,
    pub remedy: String,
}

/// The job's ranks on one node, with their pace.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeSummary {
    pub agent_id: String,
    pub ranks: Vec<u32>,
    /// Median over its ranks of their median measured time, ms; `None` without samples.
    pub median_ms: Option<f64>,
    /// `median_ms` over the fastest node's; `None` with fewer than two measured nodes.
    pub vs_fastest: Option<f64>,
    /// The job's GPUs on the node per NUMA node, "0:4 1:4" ("?" for unknown).
    pub numa_layout: String,
}

/// The answer of `ctl diagnose`.
#[derive(Debug, Clone, PartialEq)]
pub struct Diagnosis {
    pub attempt: u32,
    /// The time the scores compare: `fwd_bwd_ms` when every rank reports it (in synchronous
    /// training the fast ranks wait in collectives, so whole steps look alike), else
    /// `step_time_ms`.
    pub metric: &'static str,
    pub warmup_steps: i64,
    /// Step receipts the diagnosis used.
    pub samples_used: usize,
    pub ranks: Vec<RankScore>,
    pub nodes: Vec<NodeSummary>,
    pub findings: Vec<Finding>,
    /// What the diagnosis could not use, and why.
    pub unusable: Vec<String>,
    /// What it saw that explains nothing (a throttle on a GPU whose rank kept pace, a property
    /// the fast nodes share): said, not blamed.
    pub notes: Vec<String>,
    pub predicted_comm_ms: f64,
    /// Median optimizer step over all ranks (collectives included), ms.
    pub measured_optimizer_ms: Option<f64>,
    pub median_step_ms: Option<f64>,
    pub median_tokens_per_s: Option<f64>,
}

impl Diagnosis {
    /// One line: the first finding, or that the run is healthy.
    pub fn verdict(&self) -> String {
        match self.findings.first() {
            Some(f) if self.findings.len() == 1 => format!("{}: {}", f.cause, f.summary),
            Some(f) => {
                format!("{}: {} (and {} more finding(s))", f.cause, f.summary, self.findings.len() - 1)
            }
            None if self.samples_used == 0 => "no step receipts to judge yet".to_string(),
            None => format!(
                "healthy: no finding over {} step receipts of {} rank(s)",
                self.samples_used,
                self.ranks.len()
            ),
        }
    }
}

/// Diagnoses one attempt of a job.
pub fn diagnose(input: &Input<'_>) -> Diagnosis {
    let mut unusable = Vec::new();
    let usable = |x: Option<f64>| x.filter(|v| v.is_finite() && *v >= 0.0);
    let ranks_with_samples: BTreeSet<u32> = input.samples.iter().map(|s| s.rank).collect();
    let every_rank_has_fwd_bwd = !ranks_with_samples.is_empty()
        && ranks_with_samples
            .iter()
            .all(|r| input.samples.iter().any(|s| s.rank == *r && usable(s.fwd_bwd_ms).is_some()));
    let (metric, pick): (&'static str, fn(&StepSample) -> Option<f64>) = if every_rank_has_fwd_bwd {
        ("fwd_bwd_ms", |s| s.fwd_bwd_ms)
    } else {
        ("step_time_ms", |s| s.step_time_ms)
    };
    let mut series: BTreeMap<u32, Vec<(i64, f64)>> = BTreeMap::new();
    let mut missing: BTreeMap<u32, usize> = BTreeMap::new();
    let mut flagged: BTreeMap<u32, usize> = BTreeMap::new();
    for s in input.samples {
        if s.flagged {
            *flagged.entry(s.rank).or_default() += 1;
        }
        match usable(pick(s)) {
            Some(ms) if s.step >= 0 => series.entry(s.rank).or_default().push((s.step, ms)),
            _ => *missing.entry(s.rank).or_default() += 1,
        }
    }
    for (rank, n) in &missing {
        unusable.push(format!(
            "rank {rank}: {n} step receipt(s) without a usable {metric} (missing, wrong type or negative)"
        ));
    }
    for (rank, n) in &flagged {
        unusable.push(format!("rank {rank}: {n} step receipt(s) break receipt schema v1 (see receipts.problem); their valid fields were used"));
    }
    for a in input.allocations.iter().filter(|a| a.observed.skipped_lines > 0) {
        unusable.push(format!(
            "rank {}: {} line(s) of its receipts file were not JSON objects (NaN or Infinity make a line invalid) and were skipped",
            a.id.rank, a.observed.skipped_lines
        ));
    }
    for a in input.allocations.iter().filter(|a| !ranks_with_samples.contains(&a.id.rank)) {
        unusable.push(format!("rank {} on {}: no step receipts", a.id.rank, a.agent_id));
    }
    let samples_used = series.values().map(Vec::len).sum();
    let last_step = series.values().flatten().map(|&(s, _)| s).max().unwrap_or(0);
    let first_step = series.values().flatten().map(|&(s, _)| s).min().unwrap_or(0);
    let ranks = score_ranks(&series, StragglerPolicy::default());
    let nodes = node_summaries(input, &ranks);
    let steady = |f: fn(&StepSample) -> Option<f64>| -> Option<f64> {
        let warmup = stragglers::steady_from(first_step, last_step);
        let mut xs: Vec<f64> =
            input.samples.iter().filter(|s| s.step >= warmup).filter_map(|s| usable(f(s))).collect();
        (!xs.is_empty()).then(|| median(&mut xs))
    };
    let mut d = Diagnosis {
        attempt: input.attempt,
        metric,
        warmup_steps: stragglers::warmup_steps(last_step - first_step),
        samples_used,
        findings: Vec::new(),
        unusable,
        notes: Vec::new(),
        predicted_comm_ms: input.predicted_comm_ms,
        measured_optimizer_ms: steady(|s| s.optimizer_ms),
        median_step_ms: steady(|s| s.step_time_ms),
        median_tokens_per_s: steady(|s| s.tokens_per_s),
        ranks,
        nodes,
    };
    let (gpu_found, mut notes) = gpu::findings(input.windows, &series, metric);
    d.findings = rules::findings(input, &mut notes, &d, gpu_found);
    d.notes = notes;
    d
}

/// Per node: its ranks, their pace, and how the job's GPUs there spread over NUMA nodes.
fn node_summaries(input: &Input<'_>, ranks: &[RankScore]) -> Vec<NodeSummary> {
    let mut by_node: BTreeMap<&str, Vec<&Allocation>> = BTreeMap::new();
    for a in input.allocations {
        by_node.entry(a.agent_id.as_str()).or_default().push(a);
    }
    let mut nodes: Vec<NodeSummary> = by_node
        .into_iter()
        .map(|(agent, allocs)| {
            let mut medians: Vec<f64> = allocs
                .iter()
                .filter_map(|a| ranks.iter().find(|r| r.rank == a.id.rank).map(|r| r.median_ms))
                .collect();
            let inventory = input.nodes.get(agent).map(|n| &n.inventory);
            let mut per_numa: BTreeMap<Option<u32>, u32> = BTreeMap::new();
            for a in &allocs {
                let numa = inventory.and_then(|i| i.gpu(a.gpu_index)).and_then(|g| g.numa_node);
                *per_numa.entry(numa).or_default() += 1;
            }
            let numa_layout = per_numa
                .iter()
                .map(|(n, c)| n.map_or_else(|| format!("?:{c}"), |n| format!("{n}:{c}")))
                .collect::<Vec<_>>()
                .join(" ");
            NodeSummary {
                agent_id: agent.to_string(),
                ranks: allocs.iter().map(|a| a.id.rank).collect(),
                median_ms: (!medians.is_empty()).then(|| median(&mut medians)),
                vs_fastest: None,
                numa_layout,
            }
        })
        .collect();
    let measured: Vec<f64> = nodes.iter().filter_map(|n| n.median_ms).collect();
    if measured.len() >= 2 {
        let fastest = measured.iter().copied().fold(f64::INFINITY, f64::min);
        for n in &mut nodes {
            n.vs_fastest = n.median_ms.filter(|_| fastest > 0.0).map(|m| m / fastest);
        }
    }
    nodes
}

/// The value of `name` in the job's env overlay when it is set to something other than 0.
fn env_on<'a>(spec: &'a JobSpec, name: &str) -> Option<&'a str> {
    spec.env.get(name).map(|v| v.trim()).filter(|v| !v.is_empty() && *v != "0")
}

/// (measured, status) of the check `id` in the node's newest preflight.
fn node_check<'a>(input: &'a Input<'_>, agent: &str, id: &str) -> Option<(&'a str, CheckStatus)> {
    let report = input.nodes.get(agent)?.preflight.as_ref()?;
    report.checks.iter().find(|c| c.id == id).map(|c| (c.measured.as_str(), c.status))
}

fn bad(status: CheckStatus) -> bool {
    matches!(status, CheckStatus::Warn | CheckStatus::Fail)
}

/// Two kernel CPU lists naming the same CPUs ("0-3" and "0,1,2,3").
fn same_cpus(a: &str, b: &str) -> bool {
    use trainyard_proto::contract::cpulist;
    match (cpulist::parse(a), cpulist::parse(b)) {
        (Ok(x), Ok(y)) => x == y,
        _ => a == b,
    }
}

#[cfg(test)]
mod tests;
