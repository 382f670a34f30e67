//! What a scheduling pass reads (the fleet's nodes, the jobs' requests) and what it decides
//! (placements, and why the rest wait).

use crate::links::{LinkClass, LinkMatrix};
use trainyard_model::domain::InterconnectClass;

/// One GPU of a node as the scheduler sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuView {
    pub index: u32,
    pub model: String,
    pub memory_mib: u64,
    /// Not held by any allocation of an unfinished job.
    pub free: bool,
    /// NUMA node the GPU hangs off (-1: unknown).
    pub numa_node: i32,
}

/// One schedulable node (a connected agent that is not leaving).
#[derive(Debug, Clone, PartialEq)]
pub struct NodeView {
    pub agent_id: String,
    pub gpus: Vec<GpuView>,
    /// The links between its GPUs, parsed once from the row-major n x n codes `nvidia-smi topo
    /// -m` prints ([`LinkMatrix::parse`]; all `Unknown` when unknown) and shared: a pass over
    /// 1,000 nodes neither copies nor parses 64,000 link strings.
    pub links: std::sync::Arc<LinkMatrix>,
    /// The class its newest preflight found; `None` before the first preflight.
    pub interconnect_class: Option<InterconnectClass>,
    /// CPU list of each NUMA node (kernel list format), by NUMA node id.
    pub numa_cpus: Vec<(u32, String)>,
}

/// What a job asks for, extracted from its spec.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    pub job_id: u64,
    pub priority: i32,
    pub gpus: u32,
    /// 0: the scheduler chooses how many ranks go on each node.
    pub gpus_per_node: u32,
    pub gpu_model: String,
    pub min_gpu_memory_mib: u64,
    /// The interconnect class every node must have; `None` for any.
    pub interconnect: Option<InterconnectClass>,
    /// Nodes this job must not use (blamed for its earlier failures), sorted; usually empty.
    pub avoid: Vec<String>,
}

/// The ranks of one job on one node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodePlacement {
    pub agent_id: String,
    pub node_rank: u32,
    /// Global rank of local rank 0 on this node.
    pub first_rank: u32,
    /// GPU index of each local rank, in local-rank order.
    pub gpus: Vec<u32>,
}

/// Where every rank of a job goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub job_id: u64,
    pub nodes: Vec<NodePlacement>,
    /// The slowest link class the placement uses (the network when it spans nodes and the
    /// network is slower than the nodes' own links); what the cost model prices.
    pub bottleneck: LinkClass,
}

impl Placement {
    /// (rank, node rank, local rank, agent, gpu) for every rank, in rank order.
    pub fn ranks(&self) -> impl Iterator<Item = (u32, u32, u32, &str, u32)> + '_ {
        self.nodes.iter().flat_map(|n| {
            n.gpus.iter().enumerate().map(move |(local, &gpu)| {
                (n.first_rank + local as u32, n.node_rank, local as u32, n.agent_id.as_str(), gpu)
            })
        })
    }

    pub fn world_size(&self) -> u32 {
        self.nodes.iter().map(|n| n.gpus.len() as u32).sum()
    }
}

/// What one scheduling pass decided.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Outcome {
    pub placements: Vec<Placement>,
    /// Why each job left pending waits, by job id (shown as `Job.waiting_reason`).
    pub waiting: Vec<(u64, String)>,
}
