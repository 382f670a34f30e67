//! Which CPU cores and memory node each rank is bound to (docs/field-notes.md §2).
//!
//! A rank is bound to the CPUs and the memory of its GPU's NUMA node. The node's physical cores
//! are cut into one fixed slice per GPU hanging off that NUMA node (the `j`-th GPU by index gets
//! the `j`-th slice), so ranks sharing a NUMA node never overlap, whichever jobs they belong to,
//! and a restarted attempt gets the same cores. A core's hyperthread siblings stay together
//! (the host's `cores`, from `thread_siblings_list`): cutting the CPU list `0-55,112-167` of a
//! 4-GPU NUMA node into four runs of CPUs would give GPU 0 the CPUs 0-27 and GPU 2 the CPUs
//! 112-139, their siblings, so two ranks would share 28 physical cores. Where the host did not
//! say which CPUs are siblings, each logical CPU counts as a core. When a NUMA node has fewer CPUs than GPUs there is
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

/// The plan for the rank on GPU `gpu_index` of `node`, whose physical cores are `cores` (one
/// CPU list per core, as the agent's inventory carries them; empty when unknown); `None` when
/// the GPU's NUMA node or its CPUs are unknown (the rank then runs unpinned).
pub fn plan_cpus(node: &NodeView, gpu_index: u32, cores: &[String]) -> Option<CpuPlan> {
    let gpu = node.gpus.iter().find(|g| g.index == gpu_index)?;
    let numa = u32::try_from(gpu.numa_node).ok()?;
    let (_, list) = node.numa_cpus.iter().find(|(id, _)| *id == numa)?;
    let cpus = cpulist::parse(list).ok()?;
    if cpus.is_empty() {
        return None;
    }
    let units = core_units(&cpus, cores);
    let mut peers: Vec<u32> =
        node.gpus.iter().filter(|g| g.numa_node == gpu.numa_node).map(|g| g.index).collect();
    peers.sort_unstable();
    let n = peers.len();
    let j = peers.iter().position(|&i| i == gpu_index)?;
    let mut slice: Vec<u32> = if units.len() >= n {
        units[j * units.len() / n..(j + 1) * units.len() / n].iter().flatten().copied().collect()
    } else {
        cpus
    };
    slice.sort_unstable();
    Some(CpuPlan { cpus: cpulist::format(&slice), numa_node: gpu.numa_node })
}

/// The NUMA node's CPUs grouped by physical core, cores ordered by their lowest CPU; a CPU that
/// no entry of `cores` names is a core of its own.
fn core_units(cpus: &[u32], cores: &[String]) -> Vec<Vec<u32>> {
    let mut core_of = std::collections::HashMap::new();
    for (k, list) in cores.iter().enumerate() {
        for cpu in cpulist::parse(list).unwrap_or_default() {
            core_of.insert(cpu, k);
        }
    }
    let mut units: Vec<Vec<u32>> = Vec::new();
    let mut unit_of_core = std::collections::HashMap::new();
    for &cpu in cpus {
        match core_of.get(&cpu) {
            Some(core) => {
                let u = *unit_of_core.entry(*core).or_insert_with(|| {
                    units.push(Vec::new());
                    units.len() - 1
                });
                units[u].push(cpu);
            }
            None => units.push(vec![cpu]),
        }
    }
    units
}
