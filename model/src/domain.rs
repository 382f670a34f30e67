//! The controller's domain words and a host's inventory. The words (job, rank, agent and node
//! states, verdicts, levels, check statuses, interconnect classes, causes) are the protocol's,
//! defined once in [`trainyard_proto::words`] and re-exported here; the inventory is what an
//! agent's hello said about its host.

pub use trainyard_proto::words::*;

/// A host as its agent described it in its hello: GPUs, NUMA nodes, GPU links and cores.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Inventory {
    pub hostname: String,
    pub gpus: Vec<GpuInfo>,
    pub numa_nodes: Vec<NumaNodeInfo>,
    /// Row-major n x n link codes between GPUs as `nvidia-smi topo -m` prints them (`X` on the
    /// diagonal, `NV18`, `PIX`, `SYS`, ...); empty when unknown.
    pub links: Vec<String>,
    /// The logical CPUs of each physical core, in the kernel's list format; empty when unknown.
    pub cores: Vec<String>,
}

/// One GPU of a host.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GpuInfo {
    pub index: u32,
    pub uuid: String,
    pub model: String,
    pub memory_mib: u64,
    pub pci_bus_id: String,
    /// The NUMA node it hangs off; `None` when the host does not say.
    pub numa_node: Option<u32>,
}

/// One NUMA node of a host and its CPUs (kernel list format, e.g. `0-31,64-95`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NumaNodeInfo {
    pub id: u32,
    pub cpus: String,
}

impl Inventory {
    /// The GPU with host index `index`.
    pub fn gpu(&self, index: u32) -> Option<&GpuInfo> {
        self.gpus.iter().find(|g| g.index == index)
    }
}

impl From<trainyard_proto::v1::HostInventory> for Inventory {
    fn from(inv: trainyard_proto::v1::HostInventory) -> Inventory {
        Inventory {
            hostname: inv.hostname,
            gpus: inv
                .gpus
                .into_iter()
                .map(|g| GpuInfo {
                    index: g.index,
                    uuid: g.uuid,
                    model: g.model,
                    memory_mib: g.memory_mib,
                    pci_bus_id: g.pci_bus_id,
                    numa_node: u32::try_from(g.numa_node).ok(),
                })
                .collect(),
            numa_nodes: inv.numa_nodes.into_iter().map(|n| NumaNodeInfo { id: n.id, cpus: n.cpus }).collect(),
            links: inv.links,
            cores: inv.cores,
        }
    }
}

impl From<&Inventory> for trainyard_proto::v1::HostInventory {
    fn from(inv: &Inventory) -> Self {
        use trainyard_proto::v1 as pb;
        pb::HostInventory {
            hostname: inv.hostname.clone(),
            gpus: inv
                .gpus
                .iter()
                .map(|g| pb::Gpu {
                    index: g.index,
                    uuid: g.uuid.clone(),
                    model: g.model.clone(),
                    memory_mib: g.memory_mib,
                    pci_bus_id: g.pci_bus_id.clone(),
                    numa_node: g.numa_node.map_or(-1, |n| n as i32),
                })
                .collect(),
            numa_nodes: inv
                .numa_nodes
                .iter()
                .map(|n| pb::NumaNode { id: n.id, cpus: n.cpus.clone() })
                .collect(),
            links: inv.links.clone(),
            cores: inv.cores.clone(),
        }
    }
}
