//! Which CPU cores and memory node each rank is bound to (docs/field-notes.md §2).
//!
//! A rank is bound to the CPUs and the memory of its GPU's NUMA node. The node's CPUs are cut
//! into one fixed slice per GPU hanging off that NUMA node (the `j`-th GPU by index gets the
//! `j`-th slice), so ranks sharing a NUMA node never overlap, whichever jobs they belong to, and
//! a restarted attempt gets the same cores. When a NUMA node has fewer CPUs than GPUs there is
//! nothing to divide without starving someone: each rank then gets the whole NUMA node's CPU
//! set (what `numactl --cpunodebind` does). CPUs the agent keeps for itself (its
//! `--reserve-cpus`) are already absent from the inventory the plan starts from.

use trainyard_proto::contract::cpulist;

use super::NodeView;

/// The binding planned for one rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuPlan {
    /// Kernel list format, e.g. `0-15`.
    pub cpus: String,
    pub numa_node: i32,
}

/// The plan for the rank on GPU `gpu_index` of `node`; `None` when the GPU's NUMA node or its
/// CPUs are unknown (the rank then runs unpinned).
pub fn plan_cpus(node: &NodeView, gpu_index: u32) -> Option<CpuPlan> {
    let gpu = node.gpus.iter().find(|g| g.index == gpu_index)?;
    let numa = u32::try_from(gpu.numa_node).ok()?;
    let (_, list) = node.numa_cpus.iter().find(|(id, _)| *id == numa)?;
    let cpus = cpulist::parse(list).ok()?;
    if cpus.is_empty() {
        return None;
    }
    let mut peers: Vec<u32> =
        node.gpus.iter().filter(|g| g.numa_node == gpu.numa_node).map(|g| g.index).collect();
    peers.sort_unstable();
    let n = peers.len();
    let j = peers.iter().position(|&i| i == gpu_index)?;
    let slice = if cpus.len() >= n { &cpus[j * cpus.len() / n..(j + 1) * cpus.len() / n] } else { &cpus[..] };
    Some(CpuPlan { cpus: cpulist::format(slice), numa_node: gpu.numa_node })
}
