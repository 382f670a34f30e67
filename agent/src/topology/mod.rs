//! The node as NCCL sees it: GPUs with their NUMA node and CPUs, the GPU-GPU link matrix, the
//! NUMA nodes, optional NICs, and the interconnect class that follows from the links.
//!
//! Three ways in, one model out: the host inventory (host file or NVML), and the text of
//! `nvidia-smi topo -m` that operators paste ([`parse`]). One way out: the same text layout
//! ([`render`]), so the agent's report reads like the command every operator already knows.

mod explain;
mod link;
mod parse;
mod render;

use std::collections::BTreeMap;

pub use explain::{compare, explain};
pub use link::Link;
pub use parse::{ParseError, parse};
pub use render::render;
use trainyard_proto::v1::HostInventory;
use trainyard_proto::words::InterconnectClass;

use trainyard_proto::contract::cpulist;

/// One GPU: its index, NUMA node (None when the platform reports none, or several) and local
/// CPUs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuNode {
    pub index: u32,
    pub numa_node: Option<u32>,
    /// Every NUMA node the platform ties the GPU to: one normally, several where
    /// `nvidia-smi topo -m` prints a range such as `0-1`, none for `N/A`.
    pub numa_affinity: Vec<u32>,
    /// Kernel CPU list of the CPUs local to the GPU, e.g. `0-51,104-155`; empty when unknown.
    pub cpus: String,
}

/// One NUMA node and its CPUs (kernel list format).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NumaNode {
    pub id: u32,
    pub cpus: String,
}

/// One NIC column of `nvidia-smi topo -m`: its name and its path to every GPU and every NIC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Nic {
    pub name: String,
    pub to_gpus: Vec<Link>,
    pub to_nics: Vec<Link>,
}

/// The node's topology: `links[i][j]` is the path between GPU i and GPU j.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    pub gpus: Vec<GpuNode>,
    pub links: Vec<Vec<Link>>,
    pub numa_nodes: Vec<NumaNode>,
    pub nics: Vec<Nic>,
}

/// Why an inventory cannot become a topology.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InventoryError(String);

impl Topology {
    /// The topology of `inventory` (links row-major, as the proto carries them).
    pub fn from_inventory(inventory: &HostInventory) -> Result<Self, InventoryError> {
        let n = inventory.gpus.len();
        if inventory.links.len() != n * n {
            return Err(InventoryError(format!(
                "inventory has {} link cells for {n} GPUs, expected {}",
                inventory.links.len(),
                n * n
            )));
        }
        let mut links = Vec::with_capacity(n);
        for (i, row) in inventory.links.chunks(n.max(1)).enumerate().take(n) {
            let row: Result<Vec<Link>, _> = row
                .iter()
                .enumerate()
                .map(|(j, c)| c.parse::<Link>().map_err(|e| InventoryError(format!("links[{i}][{j}]: {e}"))))
                .collect();
            links.push(row?);
        }
        let numa_nodes: Vec<NumaNode> =
            inventory.numa_nodes.iter().map(|n| NumaNode { id: n.id, cpus: n.cpus.clone() }).collect();
        let gpus = inventory
            .gpus
            .iter()
            .map(|g| {
                let numa_node = u32::try_from(g.numa_node).ok();
                let cpus = numa_node
                    .and_then(|id| numa_nodes.iter().find(|n| n.id == id))
                    .map(|n| n.cpus.clone())
                    .unwrap_or_default();
                GpuNode { index: g.index, numa_node, numa_affinity: numa_node.into_iter().collect(), cpus }
            })
            .collect();
        Ok(Self { gpus, links, numa_nodes, nics: Vec::new() })
    }

    /// The links as the proto's row-major strings.
    pub fn link_codes(&self) -> Vec<String> {
        self.links.iter().flatten().map(Link::to_string).collect()
    }

    /// The interconnect class that the GPU-GPU links make.
    pub fn class(&self) -> InterconnectClass {
        classify(&self.links)
    }

    /// GPUs per NUMA node, in node order; GPUs without a NUMA node are left out.
    pub fn gpus_per_numa_node(&self) -> BTreeMap<u32, Vec<u32>> {
        let mut map: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
        for gpu in &self.gpus {
            if let Some(node) = gpu.numa_node {
                map.entry(node).or_default().push(gpu.index);
            }
        }
        map
    }

    /// Logical CPUs of NUMA node `id` (0 when unknown or unparsable).
    pub fn cpus_on_node(&self, id: u32) -> usize {
        self.numa_nodes
            .iter()
            .find(|n| n.id == id)
            .and_then(|n| cpulist::parse(&n.cpus).ok())
            .map_or(0, |c| c.len())
    }

    /// The layout an operator reads at a glance: GPUs per NUMA node, e.g. `0:4 1:4`.
    pub fn numa_layout(&self) -> String {
        let parts: Vec<String> =
            self.gpus_per_numa_node().iter().map(|(node, gpus)| format!("{node}:{}", gpus.len())).collect();
        parts.join(" ")
    }
}

/// NVLink4 links per H100/H200 SXM GPU (`NV18`).
const FULL_NVLINK4: u32 = 18;

/// Classifies an n x n link matrix. A single GPU has no GPU-GPU path: `pcie`.
pub fn classify(links: &[Vec<Link>]) -> InterconnectClass {
    let n = links.len();
    let pairs: Vec<Link> =
        (0..n).flat_map(|i| (i + 1..n).map(move |j| (i, j))).map(|(i, j)| links[i][j]).collect();
    let nv_counts: Vec<u32> = pairs.iter().filter_map(|l| l.nvlinks()).collect();
    if nv_counts.is_empty() {
        return InterconnectClass::Pcie;
    }
    let all_nv_equal = nv_counts.len() == pairs.len() && nv_counts.iter().all(|&c| c == nv_counts[0]);
    // Two GPUs with all 18 NVLink4 links to each other are a slice of an NVSwitch node
    // (a 2-GPU VM of an 8xH100 SXM host): an NVL bridge gives a pair 12.
    if all_nv_equal && (n > 2 || nv_counts[0] >= FULL_NVLINK4) {
        return InterconnectClass::Nvswitch;
    }
    // Pairs: every GPU has exactly one NVLink peer.
    let one_peer_each =
        (0..n).all(|i| (0..n).filter(|&j| j != i && links[i][j].nvlinks().is_some()).count() == 1);
    if one_peer_each { InterconnectClass::NvlinkPairs } else { InterconnectClass::Mixed }
}

/// Expected all_reduce bus bandwidth (GB/s) at 1 GiB on a healthy 8-GPU node of `class`.
///
/// NVSwitch: the field reports (docs/field-notes.md §1) measure ~370-410 GB/s busbw at ~1 GB
/// on 8xH100 SXM; we expect the low end, 370. PCIe and NVL: the same reports measured 7.3x
/// (PCIe) and 7.7x (NVL) the NCCL kernel time of SXM for the same traffic (28.5 s and 30.1 s
/// vs 3.9 s per 10 steps), matching the ~7x link-bandwidth ratio (450 vs 64 GB/s per GPU),
/// hence 370/7.3 ≈ 50 and 370/7.7 ≈ 48. Mixed: a ring runs at its slowest hop, so PCIe's
/// figure.
pub fn expected_busbw_gbps(class: InterconnectClass) -> f64 {
    match class {
        InterconnectClass::Nvswitch => 370.0,
        InterconnectClass::Pcie | InterconnectClass::Mixed => 50.0,
        InterconnectClass::NvlinkPairs => 48.0,
    }
}

/// The busbw floor (GB/s) the largest message of a sweep up to `bytes` must reach.
///
/// 85 % of the expectation: a healthy node varies by a few percent run to run, while the
/// faults this is for cost far more (a NUMA split 1.8x the step time, SHM disabled 3.2x, a
/// node falling back from NVLink to PCIe ~7x), so a 15 % margin separates the two. Below
/// 1 GiB, NCCL does not reach its peak: the field reports (docs/field-notes.md §1) measure
/// ~150 GB/s at 58 MB against ~370 at 1 GB on NVSwitch, so the floor scales log-linearly
/// between those two points (the same shape for every class, which is conservative for PCIe,
/// whose curve flattens earlier).
pub fn busbw_floor_gbps(class: InterconnectClass, bytes: u64) -> f64 {
    const MARGIN: f64 = 0.85;
    expected_busbw_gbps(class) * MARGIN * size_efficiency(bytes)
}

/// Fraction of the 1 GiB bus bandwidth an all_reduce of `bytes` reaches (docs/field-notes.md §1:
/// 150/370 at 58 MB, 1.0 at 1 GB), log-linear in between, clamped to those ends.
pub fn size_efficiency(bytes: u64) -> f64 {
    const SMALL_BYTES: f64 = 58e6;
    const SMALL_FRACTION: f64 = 150.0 / 370.0;
    const LARGE_BYTES: f64 = (1u64 << 30) as f64;
    let x = (bytes.max(1) as f64).log2();
    let (lo, hi) = (SMALL_BYTES.log2(), LARGE_BYTES.log2());
    let t = ((x - lo) / (hi - lo)).clamp(0.0, 1.0);
    SMALL_FRACTION + t * (1.0 - SMALL_FRACTION)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matrix(n: usize, cell: impl Fn(usize, usize) -> &'static str) -> Vec<Vec<Link>> {
        (0..n)
            .map(|i| (0..n).map(|j| if i == j { Link::X } else { cell(i, j).parse().unwrap() }).collect())
            .collect()
    }

    #[test]
    fn classes() {
        assert_eq!(classify(&matrix(8, |_, _| "NV18")), InterconnectClass::Nvswitch);
        assert_eq!(
            classify(&matrix(8, |i, j| if i / 2 == j / 2 { "NV12" } else { "SYS" })),
            InterconnectClass::NvlinkPairs
        );
        assert_eq!(
            classify(&matrix(8, |i, j| if i / 4 == j / 4 { "NODE" } else { "SYS" })),
            InterconnectClass::Pcie
        );
        // One pair down to 16 links: not the fabric that was paid for.
        assert_eq!(
            classify(&matrix(8, |i, j| if (i, j) == (2, 5) || (i, j) == (5, 2) { "NV16" } else { "NV18" })),
            InterconnectClass::Mixed
        );
        assert_eq!(
            classify(&matrix(8, |i, j| if i == 7 || j == 7 { "SYS" } else { "NV18" })),
            InterconnectClass::Mixed
        );
        assert_eq!(classify(&matrix(1, |_, _| "X")), InterconnectClass::Pcie);
        assert_eq!(classify(&matrix(2, |_, _| "NV12")), InterconnectClass::NvlinkPairs);
        assert_eq!(classify(&matrix(2, |_, _| "NV18")), InterconnectClass::Nvswitch);
    }

    #[test]
    fn floors_scale_with_message_size() {
        let gib = 1u64 << 30;
        assert!((busbw_floor_gbps(InterconnectClass::Nvswitch, gib) - 314.5).abs() < 0.1);
        let at_256 = busbw_floor_gbps(InterconnectClass::Nvswitch, 256 << 20);
        assert!(at_256 > 200.0 && at_256 < 260.0, "{at_256}");
        assert!((size_efficiency(58_000_000) - 150.0 / 370.0).abs() < 1e-9);
        assert_eq!(size_efficiency(4 << 30), 1.0);
        assert!(busbw_floor_gbps(InterconnectClass::Pcie, gib) < 45.0);
    }
}
