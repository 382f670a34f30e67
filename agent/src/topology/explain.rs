//! What a topology means for training, in the operator's words and with the costs the field
//! reports measured (docs/field-notes.md §1-2), and the cell-by-cell comparison of two views of
//! one node (NVML's and `nvidia-smi topo -m`'s). `trainyard-agent topo` prints both.

use std::collections::BTreeSet;
use std::fmt::Write;

use trainyard_proto::contract::cpulist;

use trainyard_proto::words::InterconnectClass;

use super::{Link, Topology};

/// The class, the NUMA layout per GPU, the NICs, and what each means for a training job.
pub fn explain(t: &Topology) -> String {
    let mut out = String::new();
    let n = t.gpus.len();
    let worst = t.links.iter().flatten().filter(|l| **l != Link::X).max().map_or("-".into(), Link::to_string);
    let class = t.class();
    let _ = writeln!(
        out,
        "class: {class} ({n} GPU{}, worst GPU-GPU path {worst})",
        if n == 1 { "" } else { "s" }
    );
    let _ = writeln!(out, "  {}", class_meaning(class, n));
    let _ = writeln!(
        out,
        "\nNUMA layout: {}",
        if t.numa_layout().is_empty() { "unknown".into() } else { t.numa_layout() }
    );
    for gpu in &t.gpus {
        let node = match (gpu.numa_node, gpu.numa_affinity.len()) {
            (Some(id), _) => format!("NUMA node {id}"),
            (None, 0) => "NUMA node unknown (N/A)".to_string(),
            (None, _) => format!("NUMA nodes {} (several)", cpulist::format(&gpu.numa_affinity)),
        };
        let cpus =
            if gpu.cpus.is_empty() { "CPUs unknown".to_string() } else { format!("CPUs {}", gpu.cpus) };
        let _ = writeln!(out, "  GPU{}: {node}, {cpus}", gpu.index);
    }
    for line in numa_meaning(t) {
        let _ = writeln!(out, "  {line}");
    }
    if !t.nics.is_empty() {
        let _ = writeln!(out, "\nNICs (nearest GPUs):");
        for nic in &t.nics {
            let best = nic.to_gpus.iter().filter(|l| **l != Link::X).min().copied();
            let near: Vec<String> = match best {
                Some(best) => nic
                    .to_gpus
                    .iter()
                    .enumerate()
                    .filter(|(_, l)| **l == best)
                    .map(|(i, _)| format!("GPU{i}"))
                    .collect(),
                None => Vec::new(),
            };
            let via = best.map_or("-".to_string(), |l| l.to_string());
            let _ = writeln!(
                out,
                "  {}: {} ({via})",
                nic.name,
                if near.is_empty() { "-".into() } else { near.join(" ") }
            );
        }
    }
    out
}

fn class_meaning(class: InterconnectClass, n: usize) -> String {
    if n < 2 {
        return "one GPU: no GPU-to-GPU traffic, so the interconnect does not limit a single-GPU job".into();
    }
    match class {
        InterconnectClass::Nvswitch => "every GPU pair on NVLink through NVSwitch (NV18 on H100/H200 SXM): ~450 GB/s per GPU and \
             direction; NCCL all_reduce reaches ~370-410 GB/s bus bandwidth at ~1 GB. nanochat d26 on 8 such GPUs: \
             702 ms per step, 8.2 % of it communication"
            .into(),
        InterconnectClass::NvlinkPairs => "NVLink inside GPU pairs only (H100 NVL: 300 GB/s in a pair), PCIe between pairs: \
             nanochat d26 ran 2031 ms per step against 702 ms on NVSwitch (2.9x), its NCCL kernel time 7.7x"
            .into(),
        InterconnectClass::Pcie => "no NVLink: every collective crosses PCIe (~64 GB/s per GPU): nanochat d26 ran 1412 ms per \
             step against 702 ms on NVSwitch (2.0x), its NCCL kernel time 7.3x"
            .into(),
        InterconnectClass::Mixed => "some GPU pairs on NVLink and some not (or unequal link counts): on a node built as SXM a \
             link or an NVSwitch is down; ring collectives run at the slowest hop, ~7x slower than NVSwitch \
             (check `nvidia-smi nvlink -s` and the fabric manager)"
            .into(),
    }
}

fn numa_meaning(t: &Topology) -> Vec<String> {
    let per_node = t.gpus_per_numa_node();
    let mut lines = Vec::new();
    if per_node.len() > 1 {
        lines.push(format!(
            "GPUs split over {} NUMA nodes ({}): a job spanning them ran 1295 ms per step instead of 702 ms (1.8x) in \
             the field, its GPUs idle while NCCL's CPU proxy threads crossed the socket link; keep a job's GPUs on \
             one node where possible and pin each rank to its GPU's node (trainyard's placement and pinning do both)",
            per_node.len(),
            t.numa_layout()
        ));
    }
    let spanning: Vec<String> =
        t.gpus.iter().filter(|g| g.numa_affinity.len() > 1).map(|g| format!("GPU{}", g.index)).collect();
    if !spanning.is_empty() {
        lines.push(format!(
            "{} report several NUMA nodes: the platform does not tie them to one node (often a VM or a \
             single-socket host with sub-NUMA clustering), so pinning cannot choose the local node for them",
            spanning.join(" ")
        ));
    }
    lines
}

/// Where two views of one node disagree, one line per differing cell (GPU rows only: links,
/// CPU affinity and NUMA affinity); empty when they agree. `a` and `b` name the views.
pub fn compare(a_name: &str, a: &Topology, b_name: &str, b: &Topology) -> Vec<String> {
    if a.gpus.len() != b.gpus.len() {
        return vec![format!("{a_name} has {} GPUs, {b_name} has {}", a.gpus.len(), b.gpus.len())];
    }
    let mut diffs = Vec::new();
    for (i, (ga, gb)) in a.gpus.iter().zip(&b.gpus).enumerate() {
        for j in 0..a.gpus.len() {
            let (la, lb) = (a.links[i][j], b.links[i][j]);
            if la != lb {
                diffs.push(format!("GPU{i} to GPU{j}: {a_name} {la}, {b_name} {lb}"));
            }
        }
        let set =
            |s: &str| -> Option<BTreeSet<u32>> { cpulist::parse(s).ok().map(|v| v.into_iter().collect()) };
        if !ga.cpus.is_empty() && !gb.cpus.is_empty() && set(&ga.cpus) != set(&gb.cpus) {
            diffs.push(format!("GPU{i} CPU affinity: {a_name} {}, {b_name} {}", ga.cpus, gb.cpus));
        }
        if ga.numa_affinity != gb.numa_affinity {
            let show = |v: &[u32]| if v.is_empty() { "N/A".to_string() } else { cpulist::format(v) };
            diffs.push(format!(
                "GPU{i} NUMA affinity: {a_name} {}, {b_name} {}",
                show(&ga.numa_affinity),
                show(&gb.numa_affinity)
            ));
        }
    }
    diffs
}
