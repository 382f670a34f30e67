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
//! - `straggler.unexplained`: stragglers (see [`stragglers`]) on nodes no finding covers.

pub mod compare;
pub mod goodput;
pub mod stall;
pub mod stragglers;

use std::collections::{BTreeMap, BTreeSet};

pub use stragglers::{RankScore, StragglerPolicy, median, score_ranks};
use trainyard_model::domain::{Cause, CheckStatus, Inventory};
use trainyard_model::records::{Allocation, PreflightRecord};
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
        predicted_comm_ms: input.predicted_comm_ms,
        measured_optimizer_ms: steady(|s| s.optimizer_ms),
        median_step_ms: steady(|s| s.step_time_ms),
        median_tokens_per_s: steady(|s| s.tokens_per_s),
        ranks,
        nodes,
    };
    d.findings = findings(input, &d);
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

fn findings(input: &Input<'_>, d: &Diagnosis) -> Vec<Finding> {
    let mut out = Vec::new();
    let fastest_ms = d.nodes.iter().filter_map(|n| n.median_ms).fold(f64::INFINITY, f64::min);
    let slow_nodes: Vec<&NodeSummary> =
        d.nodes.iter().filter(|n| n.vs_fastest.is_some_and(|r| r >= SLOW_NODE_RATIO)).collect();
    let pace = |n: &NodeSummary| {
        vec![
            measure(format!("median {} on {}", d.metric, n.agent_id), n.median_ms.unwrap_or(0.0), "ms"),
            measure(format!("median {} on the fastest node", d.metric), fastest_ms, "ms"),
            measure("slowdown", n.vs_fastest.unwrap_or(1.0), "x"),
        ]
    };
    for n in &slow_nodes {
        let numa_nodes = n.numa_layout.split(' ').filter(|p| !p.starts_with("?:")).count();
        if numa_nodes >= 2 {
            let mut evidence = pace(n);
            evidence.push(measure("NUMA nodes under the job's GPUs", numa_nodes as f64, ""));
            out.push(Finding {
                cause: Cause::NumaSplit,
                summary: format!(
                    "{} runs {:.2}x slower than the fastest node; the job's GPUs there sit on NUMA nodes {}",
                    n.agent_id,
                    n.vs_fastest.unwrap_or(1.0),
                    n.numa_layout
                ),
                nodes: vec![n.agent_id.clone()],
                ranks: n.ranks.clone(),
                evidence,
                expected_cost: cost_of::NUMA_SPLIT,
                remedy: format!(
                    "keep each rank bound to its GPU's NUMA node{} and prefer nodes whose GPUs share one NUMA node \
                     (`ctl preflight {}` shows numa.split); on a VM, ask for a shape that exposes the real NUMA layout",
                    if input.spec.disable_pinning { " (this job set disable_pinning: turn it off)" } else { "" },
                    n.agent_id
                ),
            });
        }
    }
    let refused: Vec<&Allocation> = input
        .allocations
        .iter()
        .filter(|a| !a.planned_cpus.is_empty() && !a.observed.effective_cpus.is_empty())
        .filter(|a| {
            !same_cpus(&a.planned_cpus, &a.observed.effective_cpus)
                || (!a.planned_mems.is_empty() && a.planned_mems != a.observed.effective_mems)
        })
        .collect();
    if !refused.is_empty() {
        let nodes: BTreeSet<String> = refused.iter().map(|a| a.agent_id.clone()).collect();
        let first = refused[0];
        out.push(Finding {
            cause: Cause::NumaBindingRefused,
            summary: format!(
                "{} rank(s) do not run on the CPUs and memory planned for them (rank {}: planned CPUs {} memory {}, got CPUs {} memory {})",
                refused.len(),
                first.id.rank,
                first.planned_cpus,
                first.planned_mems,
                first.observed.effective_cpus,
                first.observed.effective_mems
            ),
            nodes: nodes.into_iter().collect(),
            ranks: refused.iter().map(|a| a.id.rank).collect(),
            evidence: vec![measure("ranks with another binding than planned", refused.len() as f64, "")],
            expected_cost: cost_of::BINDING,
            remedy: "check the agent's log for the binding error (cgroup cpuset limits, a container without those \
                     CPUs, numactl missing); the agent must be allowed every CPU of the node"
                .into(),
        });
    }
    for n in &slow_nodes {
        let Some(check) = node_check(input, &n.agent_id, "numa.cpus_per_gpu").filter(|c| bad(c.1)) else {
            continue;
        };
        let mut evidence = pace(n);
        evidence.push(measure(format!("numa.cpus_per_gpu: {}", check.0), 0.0, ""));
        out.push(Finding {
            cause: Cause::CpuStarved,
            summary: format!("{} runs {:.2}x slower and its preflight found {}", n.agent_id, n.vs_fastest.unwrap_or(1.0), check.0),
            nodes: vec![n.agent_id.clone()],
            ranks: n.ranks.clone(),
            evidence,
            expected_cost: cost_of::CPU,
            remedy: "use a machine shape with at least 4 logical CPUs per GPU on each GPU's NUMA node, or run fewer ranks there".into(),
        });
    }
    let comm_evidence = |d: &Diagnosis| {
        let mut e = Vec::new();
        if let Some(opt) = d.measured_optimizer_ms {
            e.push(measure("median optimizer step (collectives included)", opt, "ms"));
            if d.predicted_comm_ms > 0.0 {
                e.push(measure("collectives predicted for the placement", d.predicted_comm_ms, "ms"));
                e.push(measure("measured over predicted", opt / d.predicted_comm_ms, "x"));
            }
            if let Some(step) = d.median_step_ms.filter(|s| *s > 0.0) {
                e.push(measure("optimizer share of the step", opt / step, "fraction"));
            }
        }
        e
    };
    let all_nodes: Vec<String> = d.nodes.iter().map(|n| n.agent_id.clone()).collect();
    let all_ranks: Vec<u32> = input.allocations.iter().map(|a| a.id.rank).collect();
    let shm_env = env_on(input.spec, "NCCL_SHM_DISABLE");
    let shm_nodes: Vec<String> = all_nodes
        .iter()
        .filter(|n| node_check(input, n, "host.shm").is_some_and(|c| c.1 == CheckStatus::Fail))
        .cloned()
        .collect();
    if shm_env.is_some() || !shm_nodes.is_empty() {
        let mut evidence = comm_evidence(d);
        let (summary, nodes) = match shm_env {
            Some(v) => (
                format!(
                    "the job's env sets NCCL_SHM_DISABLE={v}: NCCL moves intra-node traffic over sockets"
                ),
                all_nodes.clone(),
            ),
            None => (
                format!("{} has no usable /dev/shm (preflight host.shm failed)", shm_nodes.join(", ")),
                shm_nodes,
            ),
        };
        evidence.push(measure("nodes affected", nodes.len() as f64, ""));
        out.push(Finding {
            cause: Cause::ShmDisabled,
            summary,
            nodes,
            ranks: all_ranks.clone(),
            evidence,
            expected_cost: cost_of::SHM,
            remedy:
                "repair /dev/shm (mount it, at least 1 GiB; in containers --shm-size or --ipc=host) and drop \
                     NCCL_SHM_DISABLE from the job's env"
                    .into(),
        });
    }
    if let Some(v) = env_on(input.spec, "NCCL_P2P_DISABLE") {
        out.push(Finding {
            cause: Cause::P2pDisabled,
            summary: format!("the job's env sets NCCL_P2P_DISABLE={v}: GPU-GPU traffic goes through host memory"),
            nodes: all_nodes.clone(),
            ranks: all_ranks.clone(),
            evidence: comm_evidence(d),
            expected_cost: cost_of::P2P,
            remedy: "drop NCCL_P2P_DISABLE from the job's env; if P2P fails on the node, check the IOMMU/ACS settings \
                     and `nvidia-smi topo -m` instead"
                .into(),
        });
    }
    if let Some(v) = input.spec.env.get("CUDA_DEVICE_MAX_CONNECTIONS")
        && v.trim().parse::<u32>().is_ok_and(|n| n < DEFAULT_DEVICE_MAX_CONNECTIONS)
    {
        let mut evidence = comm_evidence(d);
        evidence.push(measure("CUDA_DEVICE_MAX_CONNECTIONS", v.trim().parse().unwrap_or(0.0), ""));
        out.push(Finding {
            cause: Cause::CudaDeviceMaxConnections,
            summary: format!("the job's env sets CUDA_DEVICE_MAX_CONNECTIONS={v} (default {DEFAULT_DEVICE_MAX_CONNECTIONS})"),
            nodes: all_nodes.clone(),
            ranks: all_ranks.clone(),
            evidence,
            expected_cost: cost_of::CONNECTIONS,
            remedy: "leave CUDA_DEVICE_MAX_CONNECTIONS unset unless the framework needs 1 (Megatron's sequence \
                     parallelism); record why when a platform imposes it"
                .into(),
        });
    }
    let transport_off = out.iter().any(|f| matches!(f.cause, Cause::ShmDisabled | Cause::P2pDisabled));
    if !transport_off
        && d.predicted_comm_ms > 0.0
        && let Some(opt) = d.measured_optimizer_ms
        && opt >= FALLBACK_RATIO * d.predicted_comm_ms
    {
        let classes: Vec<String> = all_nodes
            .iter()
            .map(|n| {
                let class =
                    input.nodes.get(n).and_then(|f| f.preflight.as_ref()).and_then(|p| p.interconnect_class);
                format!("{n}: {}", class.map_or("unknown", |c| c.as_str()))
            })
            .collect();
        out.push(Finding {
            cause: Cause::FabricFallback,
            summary: format!(
                "the optimizer step takes {opt:.1} ms, {:.1}x the {:.1} ms the cost model predicts for this placement's links ({})",
                opt / d.predicted_comm_ms,
                d.predicted_comm_ms,
                classes.join(", ")
            ),
            nodes: all_nodes.clone(),
            ranks: all_ranks.clone(),
            evidence: comm_evidence(d),
            expected_cost: cost_of::FABRIC,
            remedy: "run `ctl preflight NODE --run full` on the job's nodes: topology.class and nccl.busbw show a \
                     link, NVSwitch or NIC that fell back; NCCL_DEBUG=INFO names the transport in use"
                .into(),
        });
    }
    // Stragglers a finding already places (their node or the rank itself) are explained.
    let explained_nodes: BTreeSet<&str> = out
        .iter()
        .filter(|f| f.nodes.len() < all_nodes.len() || all_nodes.len() == 1)
        .flat_map(|f| f.nodes.iter().map(String::as_str))
        .collect();
    let explained_ranks: BTreeSet<u32> = out
        .iter()
        .filter(|f| f.ranks.len() < all_ranks.len())
        .flat_map(|f| f.ranks.iter().copied())
        .collect();
    let node_of = |rank: u32| {
        input.allocations.iter().find(|a| a.id.rank == rank).map(|a| a.agent_id.as_str()).unwrap_or("")
    };
    let unexplained: Vec<&RankScore> = d
        .ranks
        .iter()
        .filter(|r| {
            r.straggler && !explained_ranks.contains(&r.rank) && !explained_nodes.contains(node_of(r.rank))
        })
        .collect();
    if !unexplained.is_empty() {
        let job_median = {
            let mut xs: Vec<f64> = d.ranks.iter().map(|r| r.median_ms).collect();
            median(&mut xs)
        };
        let mut evidence = vec![measure(format!("job median {}", d.metric), job_median, "ms")];
        for r in &unexplained {
            evidence.push(measure(format!("rank {} median {}", r.rank, d.metric), r.median_ms, "ms"));
            evidence.push(measure(format!("rank {} relative score", r.rank), r.relative, ""));
            evidence.push(measure(
                format!("rank {} slow windows (of {})", r.rank, r.windows),
                r.slow_windows as f64,
                "",
            ));
        }
        let nodes: BTreeSet<String> = unexplained.iter().map(|r| node_of(r.rank).to_string()).collect();
        let names: Vec<String> = unexplained
            .iter()
            .map(|r| {
                format!(
                    "rank {} on {} ({:.0}% slower)",
                    r.rank,
                    node_of(r.rank),
                    (1.0 / r.relative - 1.0) * 100.0
                )
            })
            .collect();
        out.push(Finding {
            cause: Cause::StragglerUnexplained,
            summary: format!("{} persistently slower than the job's median, and nothing on its node explains it", names.join(", ")),
            nodes: nodes.into_iter().collect(),
            ranks: unexplained.iter().map(|r| r.rank).collect(),
            evidence,
            expected_cost: cost_of::STRAGGLER,
            remedy: "look at that GPU: `nvidia-smi -q -d PERFORMANCE,CLOCK,TEMPERATURE` for throttling, ECC and row \
                     remapping; run `ctl preflight NODE --run full`; drain the node if it persists"
                .into(),
        });
    }
    out
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
