//! Which CPU cores and memory node each rank is bound to (DOMAIN.md section 2).
//!
//! A rank is bound to the CPUs and the memory of its GPU's NUMA node. The node's CPUs are cut
//! into one fixed slice per GPU hanging off that NUMA node (the `j`-th GPU by index gets the
//! `j`-th slice), so ranks sharing a NUMA node never overlap, whichever jobs they belong to, and
//! a restarted attempt gets the same cores. When a NUMA node has fewer CPUs than GPUs there is
//! nothing to divide without starving someone: each rank then gets the whole NUMA node's CPU
//! set (what `numactl --cpunodebind` does). CPUs the agent keeps for itself (its
//! `--reserve-cpus`) are already absent from the inventory the plan starts from.

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
    let cpus = parse_cpu_list(list)?;
    if cpus.is_empty() {
        return None;
    }
    let mut peers: Vec<u32> =
        node.gpus.iter().filter(|g| g.numa_node == gpu.numa_node).map(|g| g.index).collect();
    peers.sort_unstable();
    let n = peers.len();
    let j = peers.iter().position(|&i| i == gpu_index)?;
    let slice = if cpus.len() >= n { &cpus[j * cpus.len() / n..(j + 1) * cpus.len() / n] } else { &cpus[..] };
    Some(CpuPlan { cpus: format_cpu_list(slice), numa_node: gpu.numa_node })
}

/// Parses a kernel CPU list (`0-3,8,10-11`) into sorted, distinct ids; `None` if malformed.
pub fn parse_cpu_list(text: &str) -> Option<Vec<u32>> {
    let mut out = Vec::new();
    for part in text.trim().split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (u32, u32) = (a.parse().ok()?, b.parse().ok()?);
                if b < a || b - a > 65_536 {
                    return None;
                }
                out.extend(a..=b);
            }
            None => out.push(part.parse().ok()?),
        }
    }
    out.sort_unstable();
    out.dedup();
    Some(out)
}

/// Formats sorted CPU ids in the kernel's list format.
pub fn format_cpu_list(cpus: &[u32]) -> String {
    super::search::list(cpus)
}
