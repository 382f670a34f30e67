//! Scheduler tests over fixture fleets built in code: healthy SXM nodes, a NUMA-split SXM node,
//! H100 NVL nodes (NVLink pairs) and PCIe nodes, as their preflight would describe them.

use super::*;
use trainyard_model::domain::InterconnectClass;

fn gpus(numa: &[i32]) -> Vec<GpuView> {
    numa.iter()
        .enumerate()
        .map(|(i, &n)| GpuView {
            index: i as u32,
            model: "NVIDIA H100 80GB HBM3".into(),
            memory_mib: 81_559,
            free: true,
            numa_node: n,
        })
        .collect()
}

fn matrix(n: usize, cell: impl Fn(usize, usize) -> &'static str) -> Vec<String> {
    (0..n)
        .flat_map(|i| (0..n).map(move |j| (i, j)))
        .map(|(i, j)| if i == j { "X" } else { cell(i, j) }.into())
        .collect()
}

fn node(
    id: &str,
    class: InterconnectClass,
    numa: &[i32],
    cell: impl Fn(usize, usize) -> &'static str,
) -> NodeView {
    NodeView {
        agent_id: id.into(),
        gpus: gpus(numa),
        links: std::sync::Arc::new(LinkMatrix::parse(&matrix(numa.len(), cell), numa.len())),
        interconnect_class: Some(class),
        numa_cpus: vec![(0, "0-63".into()), (1, "64-127".into())],
    }
}

/// 8x H100 SXM, every GPU on NUMA node 0 (the healthy node of the field report in
/// docs/field-notes.md §1).
fn sxm(id: &str) -> NodeView {
    node(id, InterconnectClass::Nvswitch, &[0; 8], |_, _| "NV18")
}

/// 8x H100 SXM with GPUs split 4+4 across two NUMA nodes (the 1295 ms-per-step node).
fn split(id: &str) -> NodeView {
    node(id, InterconnectClass::Nvswitch, &[0, 0, 0, 0, 1, 1, 1, 1], |_, _| "NV18")
}

/// 8x H100 NVL: NVLink only inside pairs (0-1, 2-3, ...), PCIe elsewhere, SYS across sockets.
fn nvl(id: &str) -> NodeView {
    node(id, InterconnectClass::NvlinkPairs, &[0, 0, 0, 0, 1, 1, 1, 1], |i, j| {
        if i / 2 == j / 2 {
            "NV12"
        } else if i / 4 == j / 4 {
            "NODE"
        } else {
            "SYS"
        }
    })
}

/// 8x H100 PCIe: PIX inside pairs, PHB in a socket, SYS across.
fn pcie(id: &str) -> NodeView {
    node(id, InterconnectClass::Pcie, &[0, 0, 0, 0, 1, 1, 1, 1], |i, j| {
        if i / 2 == j / 2 {
            "PIX"
        } else if i / 4 == j / 4 {
            "PHB"
        } else {
            "SYS"
        }
    })
}

fn make_test_nodes(n: usize, gpus: u32) -> Vec<NodeView> {
    (0..n)
        .map(|i| {
            let mut v = sxm(&format!("node-{i:02}"));
            v.gpus.truncate(gpus as usize);
            v.links =
                std::sync::Arc::new(LinkMatrix::parse(&matrix(gpus as usize, |_, _| "NV18"), gpus as usize));
            v
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
        interconnect: None,
        avoid: Vec::new(),
    }
}

fn busy(node: &mut NodeView, gpus: &[u32]) {
    for g in node.gpus.iter_mut().filter(|g| gpus.contains(&g.index)) {
        g.free = false;
    }
}

fn one_node(p: &Placement) -> (&str, Vec<u32>) {
    assert_eq!(p.nodes.len(), 1, "{p:?}");
    (p.nodes[0].agent_id.as_str(), p.nodes[0].gpus.clone())
}

#[test]
fn eight_gpu_job_picks_the_healthy_sxm_node_over_the_numa_split_one() {
    let fleet = vec![split("a-split"), sxm("b-sxm")];
    let p = place(&req(1, 8, 0), &fleet).unwrap();
    assert_eq!(one_node(&p).0, "b-sxm");
    assert_eq!(p.bottleneck, LinkClass::NvLink(18));
}

#[test]
fn two_gpu_job_on_an_nvl_node_gets_an_nvlink_pair() {
    let mut fleet = vec![nvl("nvl")];
    // GPU 0 busy breaks the first pair: the job must not take 1 with 2 (NODE).
    busy(&mut fleet[0], &[0]);
    let p = place(&req(1, 2, 0), &fleet).unwrap();
    let (_, g) = one_node(&p);
    assert_eq!(g[0] / 2, g[1] / 2, "a pair: {g:?}");
    assert_eq!(p.bottleneck, LinkClass::NvLink(12));
}

#[test]
fn four_gpu_job_on_the_split_node_stays_on_one_numa_node() {
    let mut fleet = vec![split("split")];
    assert_eq!(one_node(&place(&req(1, 4, 0), &fleet).unwrap()).1, vec![0, 1, 2, 3]);
    busy(&mut fleet[0], &[1]);
    assert_eq!(one_node(&place(&req(1, 4, 0), &fleet).unwrap()).1, vec![4, 5, 6, 7]);
    // Three GPUs fit on NUMA node 0's remaining three.
    assert_eq!(one_node(&place(&req(1, 3, 0), &fleet).unwrap()).1, vec![0, 2, 3]);
}

#[test]
fn best_worst_link_wins_across_node_kinds() {
    let fleet = vec![pcie("a-pcie"), nvl("b-nvl"), sxm("c-sxm")];
    assert_eq!(one_node(&place(&req(1, 4, 0), &fleet).unwrap()).0, "c-sxm");
    let fleet = vec![pcie("a-pcie"), nvl("b-nvl")];
    let p = place(&req(1, 2, 0), &fleet).unwrap();
    assert_eq!(one_node(&p).0, "b-nvl", "an NVLink pair beats a PIX pair");
    let p = place(&req(1, 4, 0), &fleet).unwrap();
    assert_eq!(one_node(&p).0, "a-pcie", "PHB inside a socket beats NODE");
    assert_eq!(p.bottleneck, LinkClass::Phb);
}

#[test]
fn tightest_fit_keeps_whole_nodes_for_whole_node_jobs() {
    let mut fleet = make_test_nodes(2, 8);
    busy(&mut fleet[1], &[0, 1, 2, 3]);
    let out = schedule(&[req(1, 4, 0), req(2, 8, 0)], &fleet);
    let where_: Vec<(u64, &str)> =
        out.placements.iter().map(|p| (p.job_id, p.nodes[0].agent_id.as_str())).collect();
    assert_eq!(where_, vec![(1, "node-01"), (2, "node-00")]);
    assert!(out.waiting.is_empty());
}

#[test]
fn fragmented_free_gpus_do_not_make_a_one_node_job_span_nodes() {
    let mut fleet = make_test_nodes(2, 8);
    busy(&mut fleet[0], &[0, 1, 2, 3]);
    busy(&mut fleet[1], &[0, 1, 2, 3, 4, 5]);
    let out = schedule(&[req(1, 6, 0)], &fleet);
    assert!(out.placements.is_empty(), "6 free GPUs in all, but 4 + 2: the job waits");
    assert!(
        out.waiting[0].1.starts_with("needs 6 GPUs on one node; largest free set is 4"),
        "{:?}",
        out.waiting
    );
}

#[test]
fn backfill_never_takes_what_the_head_job_waits_for() {
    let mut fleet = make_test_nodes(2, 8);
    busy(&mut fleet[0], &[0, 1, 2, 3, 4, 5]);
    busy(&mut fleet[1], &[0, 1, 2, 3]);
    // Job 1 (8 GPUs) is the head: it waits for node-01, which needs fewer busy GPUs to end.
    let out = schedule(&[req(1, 8, 0), req(2, 2, 0), req(3, 4, 0), req(4, 4, 0)], &fleet);
    let placed: Vec<u64> = out.placements.iter().map(|p| p.job_id).collect();
    assert_eq!(placed, vec![2], "job 2 fits beside the reservation; job 3 would sit on it");
    assert_eq!(one_node(&out.placements[0]), ("node-00", vec![6, 7]));
    let reasons: std::collections::BTreeMap<u64, String> = out.waiting.into_iter().collect();
    assert_eq!(
        reasons[&1],
        "needs 8 GPUs on one node; largest free set is 4; holding GPUs node-01 0-7 for it as they free up"
    );
    assert!(reasons[&3].contains("held for job 1"), "{}", reasons[&3]);
    // Job 4 has job 3's shape: it waits for the same reason, known without a search.
    assert_eq!(reasons[&4], reasons[&3]);
}

#[test]
fn priority_then_fifo() {
    let nodes = make_test_nodes(1, 8);
    let mut high = req(3, 8, 0);
    high.priority = 5;
    let out = schedule(&[req(1, 8, 0), req(2, 4, 0), high], &nodes);
    assert_eq!(out.placements.len(), 1);
    assert_eq!(out.placements[0].job_id, 3);
    let out = schedule(&[req(2, 4, 0), req(1, 4, 0)], &nodes);
    let ids: Vec<u64> = out.placements.iter().map(|p| p.job_id).collect();
    assert_eq!(ids, vec![1, 2]);
    assert_eq!(out.placements[1].nodes[0].gpus, vec![4, 5, 6, 7], "second job gets what the first left");
}

#[test]
fn larger_than_a_node_takes_whole_nodes_of_one_class() {
    let fleet = vec![sxm("a-sxm"), pcie("b-pcie"), sxm("c-sxm"), pcie("d-pcie"), pcie("e-pcie")];
    let p = place(&req(1, 16, 0), &fleet).unwrap();
    let nodes: Vec<&str> = p.nodes.iter().map(|n| n.agent_id.as_str()).collect();
    assert_eq!(nodes, vec!["a-sxm", "c-sxm"]);
    assert_eq!(p.bottleneck, LinkClass::Network);
    let ranks: Vec<_> = p.ranks().collect();
    assert_eq!(ranks[9], (9, 1, 1, "c-sxm", 1));
    // 24 GPUs: only the PCIe class has three nodes.
    let p = place(&req(1, 24, 0), &fleet).unwrap();
    assert!(p.nodes.iter().all(|n| n.agent_id.ends_with("pcie")), "{p:?}");
    assert_eq!(p.bottleneck, LinkClass::Sys);
    // 12 GPUs: two whole nodes, six ranks each.
    let p = place(&req(1, 12, 0), &fleet).unwrap();
    assert_eq!(p.nodes.iter().map(|n| n.gpus.len()).collect::<Vec<_>>(), vec![6, 6]);
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
    busy(&mut nodes[1], &[0]);
    assert_eq!(place(&req(1, 16, 8), &nodes), None);
    assert_eq!(place(&req(1, 16, 0), &nodes), None, "whole nodes only");
    assert!(place(&req(1, 14, 7), &nodes).is_some());
}

#[test]
fn interconnect_class_constraint() {
    let mut unknown = sxm("a-new");
    unknown.interconnect_class = None;
    let fleet = vec![unknown, pcie("b-pcie")];
    let mut r = req(1, 8, 0);
    r.interconnect = Some(InterconnectClass::Nvswitch);
    assert_eq!(place(&r, &fleet), None, "a node with no preflight yet satisfies only 'any'");
    let reason = feasible(&r, &fleet).unwrap_err();
    assert_eq!(reason, "needs 8 GPUs; the fleet has no nvswitch node with such GPUs");
    r.interconnect = Some(InterconnectClass::Pcie);
    assert_eq!(one_node(&place(&r, &fleet).unwrap()).0, "b-pcie");
    r.interconnect = None;
    assert_eq!(one_node(&place(&r, &fleet).unwrap()).0, "a-new");
}

#[test]
fn waiting_reason_names_the_class_and_the_largest_free_set() {
    let mut fleet = vec![sxm("a"), pcie("b")];
    busy(&mut fleet[0], &[0, 1]);
    let mut r = req(1, 8, 0);
    r.interconnect = Some(InterconnectClass::Nvswitch);
    let out = schedule(&[r], &fleet);
    assert!(out.placements.is_empty());
    assert!(
        out.waiting[0].1.starts_with("needs 8 GPUs on one nvswitch node; largest free set is 6"),
        "{}",
        out.waiting[0].1
    );
}

#[test]
fn a_model_matches_in_any_case_within_one_pass() {
    let nodes = make_test_nodes(1, 8);
    let jobs: Vec<Request> = ["H100", "h100", "h200", "Nvidia H100"]
        .iter()
        .enumerate()
        .map(|(i, model)| Request { gpu_model: model.to_string(), ..req(i as u64 + 1, 1, 0) })
        .collect();
    let out = schedule(&jobs, &nodes);
    let placed: Vec<u64> = out.placements.iter().map(|p| p.job_id).collect();
    assert_eq!(placed, vec![1, 2, 4], "each spelling of the node's model is found; h200 is not");
    assert_eq!(out.waiting.len(), 1);
    assert!(out.waiting[0].1.contains("h200"), "{:?}", out.waiting);
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
fn jobs_that_can_never_fit_are_refused_with_the_reason() {
    let nodes = make_test_nodes(2, 8);
    let reason = feasible(&req(1, 24, 0), &nodes).unwrap_err();
    assert_eq!(reason, "needs 24 GPUs on whole nodes; the fleet has 16 on 2 node(s)");
    let reason = feasible(&req(1, 16, 16), &nodes).unwrap_err();
    assert!(reason.contains("the largest node has 8"), "{reason}");
    let reason = feasible(&req(1, 18, 9), &nodes).unwrap_err();
    assert!(reason.contains("at most 8 GPUs on one node"), "{reason}");
    let mut busy_fleet = make_test_nodes(2, 8);
    busy(&mut busy_fleet[0], &[0, 1, 2, 3, 4, 5, 6, 7]);
    assert_eq!(feasible(&req(1, 16, 8), &busy_fleet), Ok(()), "busy GPUs still count for feasibility");
}

#[test]
fn pinning_plan_divides_numa_cores_among_its_gpus() {
    let node = split("split");
    let p = plan_cpus(&node, 5, &[]).unwrap();
    assert_eq!(p, CpuPlan { cpus: "80-95".into(), numa_node: 1 });
    assert_eq!(plan_cpus(&node, 0, &[]).unwrap().cpus, "0-15");
    // Fewer cores than GPUs: each rank gets the whole NUMA node.
    let mut small = sxm("small");
    small.numa_cpus = vec![(0, "0-1".into())];
    assert_eq!(plan_cpus(&small, 3, &[]).unwrap().cpus, "0-1");
    small.gpus.truncate(2);
    assert_eq!(plan_cpus(&small, 1, &[]).unwrap().cpus, "1");
    small.gpus[0].numa_node = -1;
    assert_eq!(plan_cpus(&small, 0, &[]), None, "unknown NUMA node: unpinned");
}

/// A real SXM layout: 2 sockets of 56 cores with SMT, NUMA node 0 = CPUs 0-55,112-167 (core c
/// has the siblings c and c+112), 4 GPUs per node. Each rank gets 14 whole cores, siblings
/// together, and no two ranks share a physical core; without the sibling map the same CPU list
/// cut in runs would hand GPU 0 and GPU 2 the two threads of the same 28 cores.
#[test]
fn pinning_keeps_hyperthread_siblings_together() {
    let mut node = split("smt");
    node.numa_cpus = vec![(0, "0-55,112-167".into()), (1, "56-111,168-223".into())];
    let cores: Vec<String> = (0..112).map(|c| format!("{c},{}", c + 112)).collect();
    let plan = |gpu: u32| plan_cpus(&node, gpu, &cores).unwrap().cpus;
    assert_eq!(plan(0), "0-13,112-125");
    assert_eq!(plan(2), "28-41,140-153");
    assert_eq!(plan(5), "70-83,182-195");
    let core_of = |cpu: u32| cpu % 112;
    let mut owner = std::collections::HashMap::new();
    for gpu in 0..8 {
        let cpus = trainyard_proto::contract::cpulist::parse(&plan(gpu)).unwrap();
        assert_eq!(cpus.len(), 28, "GPU {gpu}: 14 cores x 2 threads");
        for cpu in cpus {
            if let Some(other) = owner.insert(core_of(cpu), gpu) {
                assert_eq!(other, gpu, "core {} shared by GPUs {other} and {gpu}", core_of(cpu));
            }
        }
    }
    // Without the siblings: runs of the CPU list, and GPUs 0 and 2 share cores 0-27.
    let flat = |gpu: u32| plan_cpus(&node, gpu, &[]).unwrap().cpus;
    assert_eq!((flat(0).as_str(), flat(2).as_str()), ("0-27", "112-139"));
}

#[test]
fn a_job_never_lands_on_a_node_it_avoids_and_says_so_when_it_waits() {
    let nodes = make_test_nodes(3, 8);
    let mut job = req(1, 16, 8);
    job.avoid = vec!["node-00".into()];
    let outcome = schedule(std::slice::from_ref(&job), &nodes);
    let used: Vec<&str> = outcome.placements[0].nodes.iter().map(|n| n.agent_id.as_str()).collect();
    assert_eq!(used, ["node-01", "node-02"]);
    job.avoid = vec!["node-00".into(), "node-02".into()];
    let outcome = schedule(std::slice::from_ref(&job), &nodes);
    assert!(outcome.placements.is_empty());
    let reason = &outcome.waiting[0].1;
    assert!(reason.contains("avoiding node-00, node-02"), "{reason}");
    // The same shape without the exclusion is still placed in the same pass.
    let free = req(2, 16, 8);
    let outcome = schedule(&[job, free], &nodes);
    assert_eq!(outcome.placements.len(), 1);
    assert_eq!(outcome.placements[0].job_id, 2);
}
