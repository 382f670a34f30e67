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
mod input;
pub mod live;
mod report;
mod rules;
pub mod stall;
pub mod stragglers;

use std::collections::{BTreeMap, BTreeSet};

pub use input::{Input, NodeFacts, StepSample};
pub use report::{Diagnosis, Finding, Measure, NodeSummary};
pub use rules::{DEFAULT_DEVICE_MAX_CONNECTIONS, FALLBACK_RATIO, SLOW_NODE_RATIO, cost_of};
pub use stragglers::{RankScore, StragglerPolicy, median, score_ranks};
use trainyard_model::records::Allocation;

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

#[cfg(test)]
mod tests;
