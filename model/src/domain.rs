//! The controller's domain words as types: every state a job, a rank or an agent can be in has
//! one enum variant and one string form, the word the store keeps and `ctl` prints. Parsing a
//! word no variant has is an error naming the word, so a typo in a row or a message never turns
//! into a silent default.

/// Declares a `Copy` enum whose variants each have one string form, with `as_str`, `ALL`,
/// `Display` and `FromStr` (the error names the kind and the rejected word).
macro_rules! string_enum {
    ($(#[$meta:meta])* pub enum $name:ident ($what:literal) { $($(#[$vmeta:meta])* $variant:ident = $word:literal),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum $name { $($(#[$vmeta])* $variant),+ }

        impl $name {
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            pub fn as_str(self) -> &'static str {
                match self { $($name::$variant => $word),+ }
            }

            /// The variant whose word is `s`, if any.
            pub fn parse(s: &str) -> Option<$name> {
                match s { $($word => Some($name::$variant),)+ _ => None }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl std::str::FromStr for $name {
            type Err = UnknownWord;
            fn from_str(s: &str) -> Result<Self, UnknownWord> {
                $name::parse(s).ok_or_else(|| UnknownWord { kind: $what, word: s.to_owned() })
            }
        }
    };
}

/// A word that names no variant of a domain enum.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {kind} {word:?}")]
pub struct UnknownWord {
    pub kind: &'static str,
    pub word: String,
}

string_enum! {
    /// The job states: `pending → scheduled → launching → running → succeeded | failed |
    /// cancelled`, plus `restarting` between attempts (docs/architecture.md).
    pub enum JobState ("job state") {
        Pending = "pending",
        Scheduled = "scheduled",
        Launching = "launching",
        Running = "running",
        Restarting = "restarting",
        Succeeded = "succeeded",
        Failed = "failed",
        Cancelled = "cancelled",
    }
}

impl JobState {
    /// No transition leaves a terminal state.
    pub fn is_terminal(self) -> bool {
        matches!(self, JobState::Succeeded | JobState::Failed | JobState::Cancelled)
    }
}

string_enum! {
    /// A rank as the controller knows it: `planned` by the scheduler, then what its agent
    /// reported.
    pub enum RankState ("rank state") {
        /// Placed; the agent has not reported on it yet.
        Planned = "planned",
        /// The agent is starting its process.
        Launching = "launching",
        Running = "running",
        /// The process ended (exit code or signal in the allocation).
        Exited = "exited",
        /// The agent lost track of it, or the agent itself is gone.
        Lost = "lost",
    }
}

impl RankState {
    /// A rank is done when it exited or was lost.
    pub fn is_done(self) -> bool {
        matches!(self, RankState::Exited | RankState::Lost)
    }
}

// Written out: the enum comes from `string_enum!`, whose derives are shared by every enum.
#[allow(clippy::derivable_impls)]
impl Default for RankState {
    fn default() -> Self {
        RankState::Planned
    }
}

string_enum! {
    /// An agent's state as the `agents` table keeps it.
    pub enum AgentState ("agent state") {
        Connected = "connected",
        Disconnected = "disconnected",
        /// It announced that it is stopping: no new work goes there.
        Leaving = "leaving",
    }
}

string_enum! {
    /// A preflight report's verdict: the worst status of its checks, `skipped` counting as pass.
    pub enum Verdict ("preflight verdict") {
        Pass = "pass",
        Warn = "warn",
        /// The scheduler places nothing on the node while this is its newest verdict.
        Fail = "fail",
    }
}

string_enum! {
    /// The outcome of one preflight check.
    pub enum CheckStatus ("check status") {
        Pass = "pass",
        Warn = "warn",
        Fail = "fail",
        /// Not run, with the reason in `measured` (never counted as a pass in the report).
        Skipped = "skipped",
    }
}

string_enum! {
    /// How much a preflight checks: `none` (only in a job spec: no launch preflight), then each
    /// level adds to the one before it.
    pub enum PreflightLevel ("preflight level") {
        None = "none",
        Quick = "quick",
        Standard = "standard",
        Full = "full",
    }
}

string_enum! {
    /// A node's GPU-GPU fabric as its preflight classified it.
    pub enum InterconnectClass ("interconnect class") {
        /// Every GPU pair over NVSwitch (SXM).
        Nvswitch = "nvswitch",
        /// NVLink inside pairs, PCIe across them (NVL).
        NvlinkPairs = "nvlink-pairs",
        Pcie = "pcie",
        /// None of the above throughout.
        Mixed = "mixed",
    }
}

string_enum! {
    /// What a finding of `ctl diagnose` names as the likely cause of a slow or uneven run. The
    /// words are stable: scripts and dashboards match on them (docs/diagnosis.md).
    pub enum Cause ("cause") {
        /// A node's ranks are slow and the job's GPUs there sit on more than one NUMA node.
        NumaSplit = "numa.split",
        /// The agent could not apply the CPU or memory binding the controller planned.
        NumaBindingRefused = "numa.binding_refused",
        /// NCCL's shared-memory transport is off (`NCCL_SHM_DISABLE`, or no usable `/dev/shm`).
        ShmDisabled = "shm.disabled",
        /// NCCL's peer-to-peer transport is off (`NCCL_P2P_DISABLE`).
        P2pDisabled = "p2p.disabled",
        /// Collectives far slower than the cost model predicts for the placement's links.
        FabricFallback = "fabric.fallback",
        /// Too few CPUs per GPU on a slow node.
        CpuStarved = "cpu.starved",
        /// `CUDA_DEVICE_MAX_CONNECTIONS` set low, serialising communication with compute.
        CudaDeviceMaxConnections = "cuda_device_max_connections",
        /// A rank persistently slower than the job's median with nothing else to explain it.
        StragglerUnexplained = "straggler.unexplained",
    }
}

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

/// The words of `all`, for messages ("one of quick, standard, full").
pub fn words<T: Copy + std::fmt::Display>(all: &[T]) -> String {
    all.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_word_round_trips_and_unknown_words_are_named() {
        for s in JobState::ALL {
            assert_eq!(s.as_str().parse::<JobState>(), Ok(*s));
        }
        for s in RankState::ALL {
            assert_eq!(s.to_string().parse::<RankState>(), Ok(*s));
        }
        for s in AgentState::ALL {
            assert_eq!(AgentState::parse(s.as_str()), Some(*s));
        }
        let err = "exitted".parse::<RankState>().unwrap_err();
        assert_eq!(err.to_string(), "unknown rank state \"exitted\"");
        assert!(RankState::Lost.is_done() && !RankState::Running.is_done());
        assert!(JobState::Cancelled.is_terminal() && !JobState::Restarting.is_terminal());
        assert_eq!("nvlink-pairs".parse(), Ok(InterconnectClass::NvlinkPairs));
        assert_eq!(words(PreflightLevel::ALL), "none, quick, standard, full");
        assert_eq!("skipped".parse(), Ok(CheckStatus::Skipped));
        assert!("skip".parse::<CheckStatus>().is_err() && "ok".parse::<Verdict>().is_err());
    }
}
