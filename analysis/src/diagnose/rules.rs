//! The rules of the diagnosis, one function each, in the order their findings are listed (the
//! crate's `diagnose` page names them). Each reads the [`Scene`]: the input, the diagnosis so far
//! (paces, scores, cost prediction) and what several rules share.

use std::collections::BTreeSet;

use trainyard_model::domain::{Cause, CheckStatus};
use trainyard_model::records::Allocation;

use super::input::{Input, bad, env_on, node_check, same_cpus};
use super::report::{Diagnosis, Finding, Measure, NodeSummary, measure};
use super::stragglers::{RankScore, median};

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

/// What the rules read.
struct Scene<'a> {
    input: &'a Input<'a>,
    d: &'a Diagnosis,
    /// The fastest node's median step (or forward-backward) time.
    fastest_ms: f64,
    /// Nodes at least [`SLOW_NODE_RATIO`] slower than the fastest.
    slow_nodes: Vec<&'a NodeSummary>,
    all_nodes: Vec<String>,
    all_ranks: Vec<u32>,
}

/// Every finding of the rules, most specific first: the GPU findings that explain slowness,
/// the node and job rules, the GPU's health findings, then the stragglers nothing explains.
/// Node properties the fast nodes share go to `notes`.
pub(super) fn findings(
    input: &Input<'_>,
    notes: &mut Vec<String>,
    d: &Diagnosis,
    gpu: Vec<Finding>,
) -> Vec<Finding> {
    let scene = Scene {
        input,
        d,
        fastest_ms: d.nodes.iter().filter_map(|n| n.median_ms).fold(f64::INFINITY, f64::min),
        slow_nodes: d.nodes.iter().filter(|n| n.vs_fastest.is_some_and(|r| r >= SLOW_NODE_RATIO)).collect(),
        all_nodes: d.nodes.iter().map(|n| n.agent_id.clone()).collect(),
        all_ranks: input.allocations.iter().map(|a| a.id.rank).collect(),
    };
    let health = [Cause::GpuXid, Cause::GpuEcc, Cause::GpuRowRemapPending];
    let (gpu_health, mut out): (Vec<Finding>, Vec<Finding>) =
        gpu.into_iter().partition(|f| health.contains(&f.cause));
    out.extend(numa_split(&scene, notes));
    out.extend(binding_refused(&scene, notes));
    out.extend(cpu_starved(&scene, notes));
    out.extend(shm_disabled(&scene));
    out.extend(p2p_disabled(&scene));
    out.extend(device_max_connections(&scene));
    let transport_off = out.iter().any(|f| matches!(f.cause, Cause::ShmDisabled | Cause::P2pDisabled));
    if !transport_off {
        out.extend(fabric_fallback(&scene));
    }
    out.extend(gpu_health);
    let slow = unexplained_slow_nodes(&scene, &out);
    out.extend(slow);
    let stragglers = unexplained_stragglers(&scene, &out);
    out.extend(stragglers);
    out
}

/// Whether some measured node that is not slow lacks the property: only then does the property
/// set the slow nodes apart. With no node at the job's pace to compare, it does.
fn sets_apart(s: &Scene<'_>, has: impl Fn(&NodeSummary) -> bool) -> bool {
    let fast: Vec<&NodeSummary> =
        s.d.nodes.iter().filter(|n| n.vs_fastest.is_some_and(|r| r < SLOW_NODE_RATIO)).collect();
    fast.is_empty() || fast.iter().any(|n| !has(n))
}

impl Scene<'_> {
    /// How a slow node compares with the fastest.
    fn pace(&self, n: &NodeSummary) -> Vec<Measure> {
        let metric = &self.d.metric;
        vec![
            measure(format!("median {metric} on {}", n.agent_id), n.median_ms.unwrap_or(0.0), "ms"),
            measure(format!("median {metric} on the fastest node"), self.fastest_ms, "ms"),
            measure("slowdown", n.vs_fastest.unwrap_or(1.0), "x"),
        ]
    }

    /// The measured optimizer step against the cost model's prediction.
    fn comm_evidence(&self) -> Vec<Measure> {
        let d = self.d;
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
    }

    /// A finding about the whole job (every node, every rank) with its cause's cost.
    fn job_wide(
        &self,
        cause: (Cause, &'static str),
        summary: String,
        evidence: Vec<Measure>,
        remedy: &str,
    ) -> Finding {
        Finding {
            cause: cause.0,
            summary,
            subject: "job".into(),
            steps: None,
            nodes: self.all_nodes.clone(),
            ranks: self.all_ranks.clone(),
            evidence,
            expected_cost: cause.1,
            remedy: remedy.into(),
        }
    }
}

/// `numa.split`: a slow node whose GPUs of this job sit on more than one NUMA node.
fn numa_split(s: &Scene<'_>, notes: &mut Vec<String>) -> Vec<Finding> {
    let split = |n: &NodeSummary| n.numa_layout.split(' ').filter(|p| !p.starts_with("?:")).count() >= 2;
    let mut out = Vec::new();
    for n in &s.slow_nodes {
        let numa_nodes = n.numa_layout.split(' ').filter(|p| !p.starts_with("?:")).count();
        if numa_nodes < 2 {
            continue;
        }
        if !sets_apart(s, split) {
            notes.push(format!(
                "{}: the job's GPUs sit on NUMA nodes {}, as on the nodes at the job's pace: not why it is slow",
                n.agent_id, n.numa_layout
            ));
            continue;
        }
        let mut evidence = s.pace(n);
        evidence.push(measure("NUMA nodes under the job's GPUs", numa_nodes as f64, ""));
        out.push(Finding {
            cause: Cause::NumaSplit,
            subject: n.agent_id.clone(),
            steps: None,
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
                if s.input.spec.disable_pinning { " (this job set disable_pinning: turn it off)" } else { "" },
                n.agent_id
            ),
        });
    }
    out
}

/// `numa.binding_refused`: ranks whose binding read back from `/proc` differs from the plan, on
/// a node that is slow (or where no pace is measured to tell). On nodes that keep pace it
/// explains nothing: a note.
fn binding_refused(s: &Scene<'_>, notes: &mut Vec<String>) -> Option<Finding> {
    let f = refused_binding(s)?;
    let measured = s.d.nodes.iter().any(|n| n.vs_fastest.is_some());
    let slow = s.slow_nodes.iter().any(|n| f.nodes.contains(&n.agent_id));
    if measured && !slow {
        notes.push(format!(
            "{}; their nodes keep the job's pace, so it is not a cause of slowness",
            f.summary
        ));
        return None;
    }
    Some(f)
}

fn refused_binding(s: &Scene<'_>) -> Option<Finding> {
    let refused: Vec<&Allocation> = s
        .input
        .allocations
        .iter()
        .filter(|a| !a.planned_cpus.is_empty() && !a.observed.effective_cpus.is_empty())
        .filter(|a| {
            !same_cpus(&a.planned_cpus, &a.observed.effective_cpus)
                || (!a.planned_mems.is_empty() && a.planned_mems != a.observed.effective_mems)
        })
        .collect();
    let first = refused.first()?;
    let nodes: BTreeSet<String> = refused.iter().map(|a| a.agent_id.clone()).collect();
    Some(Finding {
        cause: Cause::NumaBindingRefused,
        subject: format!(
            "ranks {}",
            refused.iter().map(|a| a.id.rank.to_string()).collect::<Vec<_>>().join(",")
        ),
        steps: None,
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
        remedy:
            "check the agent's log for the binding error (cgroup cpuset limits, a container without those \
                 CPUs, numactl missing); the agent must be allowed every CPU of the node"
                .into(),
    })
}

/// `cpu.starved`: a slow node whose preflight found too few CPUs per GPU.
fn cpu_starved(s: &Scene<'_>, notes: &mut Vec<String>) -> Vec<Finding> {
    let starved =
        |n: &NodeSummary| node_check(s.input, &n.agent_id, "numa.cpus_per_gpu").is_some_and(|c| bad(c.1));
    let mut out = Vec::new();
    for n in &s.slow_nodes {
        let Some(check) = node_check(s.input, &n.agent_id, "numa.cpus_per_gpu").filter(|c| bad(c.1)) else {
            continue;
        };
        if !sets_apart(s, starved) {
            notes.push(format!(
                "{}: its preflight found {}, as on the nodes at the job's pace: not why it is slow",
                n.agent_id, check.0
            ));
            continue;
        }
        let mut evidence = s.pace(n);
        evidence.push(measure(format!("numa.cpus_per_gpu: {}", check.0), 0.0, ""));
        out.push(Finding {
            cause: Cause::CpuStarved,
            subject: n.agent_id.clone(),
            steps: None,
            summary: format!(
                "{} runs {:.2}x slower and its preflight found {}",
                n.agent_id,
                n.vs_fastest.unwrap_or(1.0),
                check.0
            ),
            nodes: vec![n.agent_id.clone()],
            ranks: n.ranks.clone(),
            evidence,
            expected_cost: cost_of::CPU,
            remedy: "use a machine shape with at least 4 logical CPUs per GPU on each GPU's NUMA node, or run fewer \
                     ranks there"
                .into(),
        });
    }
    out
}

/// `shm.disabled`: the overlay turns NCCL's shared memory off, or a node has no usable
/// `/dev/shm`.
fn shm_disabled(s: &Scene<'_>) -> Option<Finding> {
    let shm_env = env_on(s.input.spec, "NCCL_SHM_DISABLE");
    let shm_nodes: Vec<String> = s
        .all_nodes
        .iter()
        .filter(|n| node_check(s.input, n, "host.shm").is_some_and(|c| c.1 == CheckStatus::Fail))
        .cloned()
        .collect();
    let (summary, nodes) = match shm_env {
        Some(v) => (
            format!("the job's env sets NCCL_SHM_DISABLE={v}: NCCL moves intra-node traffic over sockets"),
            s.all_nodes.clone(),
        ),
        None if !shm_nodes.is_empty() => (
            format!("{} has no usable /dev/shm (preflight host.shm failed)", shm_nodes.join(", ")),
            shm_nodes,
        ),
        None => return None,
    };
    let mut evidence = s.comm_evidence();
    evidence.push(measure("nodes affected", nodes.len() as f64, ""));
    Some(Finding {
        nodes,
        ..s.job_wide(
            (Cause::ShmDisabled, cost_of::SHM),
            summary,
            evidence,
            "repair /dev/shm (mount it, at least 1 GiB; in containers --shm-size or --ipc=host) and drop \
             NCCL_SHM_DISABLE from the job's env",
        )
    })
}

/// `p2p.disabled`: the overlay turns NCCL's peer-to-peer transport off.
fn p2p_disabled(s: &Scene<'_>) -> Option<Finding> {
    let v = env_on(s.input.spec, "NCCL_P2P_DISABLE")?;
    Some(s.job_wide(
        (Cause::P2pDisabled, cost_of::P2P),
        format!("the job's env sets NCCL_P2P_DISABLE={v}: GPU-GPU traffic goes through host memory"),
        s.comm_evidence(),
        "drop NCCL_P2P_DISABLE from the job's env; if P2P fails on the node, check the IOMMU/ACS settings \
         and `nvidia-smi topo -m` instead",
    ))
}

/// `cuda_device_max_connections`: the overlay sets it under the default of 8.
fn device_max_connections(s: &Scene<'_>) -> Option<Finding> {
    let v = s.input.spec.env.get("CUDA_DEVICE_MAX_CONNECTIONS")?;
    let n = v.trim().parse::<u32>().ok().filter(|n| *n < DEFAULT_DEVICE_MAX_CONNECTIONS)?;
    let mut evidence = s.comm_evidence();
    evidence.push(measure("CUDA_DEVICE_MAX_CONNECTIONS", f64::from(n), ""));
    Some(s.job_wide(
        (Cause::CudaDeviceMaxConnections, cost_of::CONNECTIONS),
        format!(
            "the job's env sets CUDA_DEVICE_MAX_CONNECTIONS={v} (default {DEFAULT_DEVICE_MAX_CONNECTIONS})"
        ),
        evidence,
        "leave CUDA_DEVICE_MAX_CONNECTIONS unset unless the framework needs 1 (Megatron's sequence \
         parallelism); record why when a platform imposes it",
    ))
}

/// `fabric.fallback`: the measured optimizer step is at least [`FALLBACK_RATIO`] times what the
/// cost model predicts for the placement's links (with no transport turned off).
fn fabric_fallback(s: &Scene<'_>) -> Option<Finding> {
    let d = s.d;
    let opt = d
        .measured_optimizer_ms
        .filter(|opt| d.predicted_comm_ms > 0.0 && *opt >= FALLBACK_RATIO * d.predicted_comm_ms)?;
    let classes: Vec<String> = s
        .all_nodes
        .iter()
        .map(|n| {
            let class =
                s.input.nodes.get(n).and_then(|f| f.preflight.as_ref()).and_then(|p| p.interconnect_class);
            format!("{n}: {}", class.map_or("unknown", |c| c.as_str()))
        })
        .collect();
    Some(s.job_wide(
        (Cause::FabricFallback, cost_of::FABRIC),
        format!(
            "the optimizer step takes {opt:.1} ms, {:.1}x the {:.1} ms the cost model predicts for this placement's links ({})",
            opt / d.predicted_comm_ms,
            d.predicted_comm_ms,
            classes.join(", ")
        ),
        s.comm_evidence(),
        "run `ctl preflight NODE --run full` on the job's nodes: topology.class and nccl.busbw show a \
         link, NVSwitch or NIC that fell back; NCCL_DEBUG=INFO names the transport in use",
    ))
}

/// `straggler.unexplained`: stragglers on nodes, and ranks, no finding so far places.
fn unexplained_stragglers(s: &Scene<'_>, so_far: &[Finding]) -> Option<Finding> {
    let (all_nodes, all_ranks) = (&s.all_nodes, &s.all_ranks);
    // Stragglers a finding already places (their node or the rank itself) are explained.
    let explained_nodes: BTreeSet<&str> = so_far
        .iter()
        .filter(|f| f.nodes.len() < all_nodes.len() || all_nodes.len() == 1)
        .flat_map(|f| f.nodes.iter().map(String::as_str))
        .collect();
    let explained_ranks: BTreeSet<u32> = so_far
        .iter()
        .filter(|f| f.ranks.len() < all_ranks.len())
        .flat_map(|f| f.ranks.iter().copied())
        .collect();
    let node_of = |rank: u32| {
        s.input.allocations.iter().find(|a| a.id.rank == rank).map(|a| a.agent_id.as_str()).unwrap_or("")
    };
    let unexplained: Vec<&RankScore> = s
        .d
        .ranks
        .iter()
        .filter(|r| {
            r.straggler && !explained_ranks.contains(&r.rank) && !explained_nodes.contains(node_of(r.rank))
        })
        .collect();
    if unexplained.is_empty() {
        return None;
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
    Some(Finding {
        cause: Cause::StragglerUnexplained,
        subject: format!(
            "ranks {}",
            unexplained.iter().map(|r| r.rank.to_string()).collect::<Vec<_>>().join(",")
        ),
        steps: None,
        summary: format!(
            "{} persistently slower than the job's median, and nothing on its node explains it",
            names.join(", ")
        ),
        nodes: nodes.into_iter().collect(),
        ranks: unexplained.iter().map(|r| r.rank).collect(),
        evidence: straggler_evidence(s.d, &unexplained),
        expected_cost: cost_of::STRAGGLER,
        remedy:
            "look at that GPU: `nvidia-smi -q -d PERFORMANCE,CLOCK,TEMPERATURE` for throttling, ECC and row \
                 remapping; run `ctl preflight NODE --run full`; drain the node if it persists"
                .into(),
    })
}

/// `straggler.unexplained` for a slow node (1.25x the fastest or more) that no finding so far
/// places: "slow, cause not identified" is still worth naming, with the node's pace.
fn unexplained_slow_nodes(s: &Scene<'_>, so_far: &[Finding]) -> Vec<Finding> {
    let all_nodes = &s.all_nodes;
    let placed: BTreeSet<&str> = so_far
        .iter()
        .filter(|f| f.nodes.len() < all_nodes.len())
        .flat_map(|f| f.nodes.iter().map(String::as_str))
        .collect();
    s.slow_nodes
        .iter()
        .filter(|n| !placed.contains(n.agent_id.as_str()))
        .map(|n| Finding {
            cause: Cause::StragglerUnexplained,
            subject: n.agent_id.clone(),
            steps: None,
            summary: format!(
                "{} runs {:.2}x slower than the fastest node, and nothing the diagnosis can see explains it (slow, cause not identified)",
                n.agent_id,
                n.vs_fastest.unwrap_or(1.0)
            ),
            nodes: vec![n.agent_id.clone()],
            ranks: n.ranks.clone(),
            evidence: s.pace(n),
            expected_cost: cost_of::STRAGGLER,
            remedy: format!(
                "look at {0}'s GPUs (`nvidia-smi -q -d PERFORMANCE,CLOCK,TEMPERATURE`), its CPUs and memory \
                 (another tenant, a BIOS power setting), and run `ctl preflight {0} --run full`; drain it if it persists",
                n.agent_id
            ),
        })
        .collect()
}

/// The job's median and each unexplained straggler's median, score and slow windows.
fn straggler_evidence(d: &Diagnosis, unexplained: &[&RankScore]) -> Vec<Measure> {
    let job_median = median(&mut d.ranks.iter().map(|r| r.median_ms).collect::<Vec<f64>>());
    let mut evidence = vec![measure(format!("job median {}", d.metric), job_median, "ms")];
    for r in unexplained {
        evidence.push(measure(format!("rank {} median {}", r.rank, d.metric), r.median_ms, "ms"));
        evidence.push(measure(format!("rank {} relative score", r.rank), r.relative, ""));
        evidence.push(measure(
            format!("rank {} slow windows (of {})", r.rank, r.windows),
            r.slow_windows as f64,
            "",
        ));
    }
    evidence
}
