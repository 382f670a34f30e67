//! The topology in the layout of `nvidia-smi topo -m`: tab-separated, a header row, one row per
//! GPU (then per NIC), `CPU Affinity` and `NUMA Affinity` columns, and the legend.

use std::fmt::Write;

use super::{Link, Topology};

const LEGEND: &str = "Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks
";

/// Renders `topology` as `nvidia-smi topo -m` prints it; [`super::parse`] reads it back.
pub fn render(topology: &Topology) -> String {
    let mut out = String::new();
    let mut header: Vec<String> = topology.gpus.iter().map(|g| format!("GPU{}", g.index)).collect();
    header.extend((0..topology.nics.len()).map(|i| format!("NIC{i}")));
    header.push("CPU Affinity".into());
    header.push("NUMA Affinity".into());
    let _ = writeln!(out, "\t{}", header.join("\t"));
    for (i, gpu) in topology.gpus.iter().enumerate() {
        let mut cells: Vec<String> = topology.links[i].iter().map(cell).collect();
        cells.extend(topology.nics.iter().map(|nic| cell(&nic.to_gpus[i])));
        cells.push(if gpu.cpus.is_empty() { "N/A".into() } else { gpu.cpus.clone() });
        cells.push(if gpu.numa_affinity.is_empty() {
            "N/A".into()
        } else {
            trainyard_proto::contract::cpulist::format(&gpu.numa_affinity)
        });
        let _ = writeln!(out, "GPU{}\t{}", gpu.index, cells.join("\t"));
    }
    // A NIC whose row was missing from the paste it was read from has no NIC-to-NIC cells: its
    // row is left out again (found by the property test of edited pastes).
    for (k, nic) in topology.nics.iter().enumerate().filter(|(_, nic)| !nic.to_nics.is_empty()) {
        let cells: Vec<String> = nic.to_gpus.iter().chain(&nic.to_nics).map(cell).collect();
        let _ = writeln!(out, "NIC{k}\t{}", cells.join("\t"));
    }
    out.push('\n');
    out.push_str(LEGEND);
    if !topology.nics.is_empty() {
        out.push_str("\nNIC Legend:\n\n");
        for (k, nic) in topology.nics.iter().enumerate() {
            let _ = writeln!(out, "  NIC{k}: {}", nic.name);
        }
    }
    out
}

fn cell(link: &Link) -> String {
    match link {
        Link::X => " X ".to_string(),
        other => other.to_string(),
    }
}
