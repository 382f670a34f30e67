//! Gang placement: a pure function from (queue, fleet view) to placements.
//!
//! All ranks of a job are placed at once or none are. This is first fit over the nodes in a
//! stable order (agent id), the smallest policy that is correct; the topology-aware policy of
//! the placement issue replaces [`place`] and keeps the same inputs and outputs.
//!
//! Ranks are numbered node-major: the first node of a placement holds ranks `0..k`, and within a
//! node local rank `i` gets the node's `i`-th chosen GPU, so `RANK = node_rank * k + local_rank`
//! when every node holds `k` ranks.

use std::collections::BTreeMap;

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
    /// Row-major n x n link codes between GPUs (`NV18`, `PIX`, ..., `X` on the diagonal), as
    /// `nvidia-smi topo -m` prints them; empty when unknown.
    pub links: Vec<String>,
    /// `nvswitch`, `nvlink-pairs`, `pcie`, `mixed`, or empty before the first preflight.
    pub interconnect_class: String,
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
}

fn eligible(req: &Request, gpu: &GpuView) -> bool {
    (req.gpu_model.is_empty() || gpu.model.to_lowercase().contains(&req.gpu_model.to_lowercase()))
        && gpu.memory_mib >= req.min_gpu_memory_mib
}

/// GPUs of `node` that `req` may use: free ones, or all eligible ones when `include_busy`.
fn usable(req: &Request, node: &NodeView, include_busy: bool) -> Vec<u32> {
    node.gpus.iter().filter(|g| (include_busy || g.free) && eligible(req, g)).map(|g| g.index).collect()
}

/// Places one job on the free GPUs of `nodes`, or returns `None` if it does not fit now.
pub fn place(req: &Request, nodes: &[NodeView]) -> Option<Placement> {
    place_on(req, nodes, false)
}

/// Could the job ever run on this fleet, were every GPU free? Used to refuse at submit a job
/// that would otherwise wait forever; returns the reason when it could not.
pub fn feasible(req: &Request, nodes: &[NodeView]) -> Result<(), String> {
    if place_on(req, nodes, true).is_some() {
        return Ok(());
    }
    let total: usize = nodes.iter().map(|n| usable(req, n, true).len()).sum();
    let largest = nodes.iter().map(|n| usable(req, n, true).len()).max().unwrap_or(0);
    let what = match (req.gpu_model.is_empty(), req.min_gpu_memory_mib) {
        (true, 0) => "GPUs".to_string(),
        (true, mem) => format!("GPUs with at least {mem} MiB"),
        (false, 0) => format!("{} GPUs", req.gpu_model),
        (false, mem) => format!("{} GPUs with at least {mem} MiB", req.gpu_model),
    };
    Err(match req.gpus.checked_div(req.gpus_per_node) {
        Some(nodes) => format!(
            "needs {nodes} nodes with {} {what} each; the fleet has {total} {what} in all, at most {largest} on one node",
            req.gpus_per_node
        ),
        None => format!("needs {} {what}; the fleet has {total}", req.gpus),
    })
}

fn place_on(req: &Request, nodes: &[NodeView], include_busy: bool) -> Option<Placement> {
    let mut chosen: Vec<(&str, Vec<u32>)> = Vec::new();
    let mut left = req.gpus;
    for node in nodes {
        if left == 0 {
            break;
        }
        let gpus = usable(req, node, include_busy);
        let take = if req.gpus_per_node > 0 {
            if (gpus.len() as u32) < req.gpus_per_node {
                continue;
            }
            req.gpus_per_node
        } else {
            (gpus.len() as u32).min(left)
        };
        if take == 0 {
            continue;
        }
        chosen.push((&node.agent_id, gpus[..take as usize].to_vec()));
        left -= take;
    }
    if left > 0 {
        return None;
    }
    let mut first_rank = 0;
    let nodes = chosen
        .into_iter()
        .enumerate()
        .map(|(node_rank, (agent, gpus))| {
            let n =
                NodePlacement { agent_id: agent.to_string(), node_rank: node_rank as u32, first_rank, gpus };
            first_rank += n.gpus.len() as u32;
            n
        })
        .collect();
    Some(Placement { job_id: req.job_id, nodes })
}

/// One scheduling pass: jobs in priority order (higher first, then lower job id, i.e. FIFO),
/// each placed on what the jobs before it left free. Returns the placements made.
pub fn schedule(queue: &[Request], nodes: &[NodeView]) -> Vec<Placement> {
    let mut order: Vec<&Request> = queue.iter().collect();
    order.sort_by_key(|r| (std::cmp::Reverse(r.priority), r.job_id));
    let mut nodes: Vec<NodeView> = nodes.to_vec();
    nodes.sort_by(|a, b| a.agent_id.cmp(&b.agent_id));
    let mut placements = Vec::new();
    for req in order {
        let Some(p) = place(req, &nodes) else { continue };
        let taken: BTreeMap<&str, &[u32]> =
            p.nodes.iter().map(|n| (n.agent_id.as_str(), n.gpus.as_slice())).collect();
        for node in &mut nodes {
            if let Some(gpus) = taken.get(node.agent_id.as_str()) {
                for g in node.gpus.iter_mut().filter(|g| gpus.contains(&g.index)) {
                    g.free = false;
                }
            }
        }
        placements.push(p);
    }
    placements
}

#[cfg(test)]
mod tests {
    use super::*;

    fn make_test_nodes(n: usize, gpus: u32) -> Vec<NodeView> {
        (0..n)
            .map(|i| NodeView {
                agent_id: format!("node-{i:02}"),
                links: Vec::new(),
                interconnect_class: String::new(),
                numa_cpus: Vec::new(),
                gpus: (0..gpus)
                    .map(|g| GpuView {
                        index: g,
                        model: "NVIDIA H100 80GB HBM3".into(),
                        memory_mib: 81_559,
                        free: true,
                        numa_node: 0,
                    })
                    .collect(),
            })
            .collect()
    }

    fn req(job_id: u64, gpus: u32, per_node: u32) -> Request {
        Request {
            job_id,
            priority: 0,
            gpus,
            gpus_per_node: per_node,
            gpu_model: String::new(),
            min_gpu_memory_mib: 0,
        }
    }

    #[test]
    fn sixteen_ranks_fill_two_nodes_node_major() {
        let p = place(&req(1, 16, 8), &make_test_nodes(2, 8)).unwrap();
        let ranks: Vec<_> = p.ranks().collect();
        assert_eq!(ranks.len(), 16);
        assert_eq!(ranks[0], (0, 0, 0, "node-00", 0));
        assert_eq!(ranks[9], (9, 1, 1, "node-01", 1));
    }

    #[test]
    fn gang_is_all_or_nothing() {
        let mut nodes = make_test_nodes(2, 8);
        nodes[1].gpus[0].free = false;
        assert_eq!(place(&req(1, 16, 8), &nodes), None);
        // Without a per-node constraint it still needs 16 free GPUs; 15 are free.
        assert_eq!(place(&req(1, 16, 0), &nodes), None);
        assert!(place(&req(1, 15, 0), &nodes).is_some());
    }

    #[test]
    fn per_node_count_skips_nodes_too_small() {
        let mut nodes = make_test_nodes(3, 8);
        for g in &mut nodes[0].gpus[..3] {
            g.free = false;
        }
        let p = place(&req(1, 8, 8), &nodes).unwrap();
        assert_eq!(p.nodes.len(), 1);
        assert_eq!(p.nodes[0].agent_id, "node-01");
    }

    #[test]
    fn constraints_filter_gpus() {
        let nodes = make_test_nodes(1, 8);
        let mut r = req(1, 8, 0);
        r.gpu_model = "h200".into();
        assert_eq!(place(&r, &nodes), None);
        r.gpu_model = "h100".into();
        assert!(place(&r, &nodes).is_some());
        r.min_gpu_memory_mib = 140_000;
        assert_eq!(place(&r, &nodes), None);
        let reason = feasible(&r, &nodes).unwrap_err();
        assert!(reason.contains("140000 MiB"), "{reason}");
    }

    #[test]
    fn priority_then_fifo() {
        let nodes = make_test_nodes(1, 8);
        let mut high = req(3, 8, 0);
        high.priority = 5;
        let placed = schedule(&[req(1, 8, 0), req(2, 4, 0), high], &nodes);
        assert_eq!(placed.len(), 1);
        assert_eq!(placed[0].job_id, 3);
        let placed = schedule(&[req(2, 4, 0), req(1, 4, 0)], &nodes);
        let ids: Vec<u64> = placed.iter().map(|p| p.job_id).collect();
        assert_eq!(ids, vec![1, 2]);
        assert_eq!(placed[1].nodes[0].gpus, vec![4, 5, 6, 7], "second job gets what the first left");
    }

    #[test]
    fn infeasible_jobs_say_why() {
        let nodes = make_test_nodes(2, 8);
        let reason = feasible(&req(1, 24, 0), &nodes).unwrap_err();
        assert_eq!(reason, "needs 24 GPUs; the fleet has 16");
        let reason = feasible(&req(1, 16, 16), &nodes).unwrap_err();
        assert!(reason.contains("at most 8 on one node"), "{reason}");
        let mut busy = make_test_nodes(2, 8);
        busy[0].gpus.iter_mut().for_each(|g| g.free = false);
        assert_eq!(feasible(&req(1, 16, 8), &busy), Ok(()), "busy GPUs still count for feasibility");
    }
}
