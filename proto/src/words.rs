//! The words of the protocol: every state a job, a rank, an agent or a node can be in, every
//! preflight verdict, level and check status, interconnect class, diagnosis cause, log stream
//! and receipt kind, as one enum per concept with one string form each. The agent, the
//! controller, `ctl` and the store all speak these; the wire and the tables carry the word.
//! Parsing a word no variant has is an error naming the word and what it should have been, so
//! a typo in a row or a message, or a peer newer than this build, never turns into a silent
//! default. Messages that carry words read them through the typed accessors of [`crate::typed`].

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

        /// Written as its word, so durable files and JSON carry the same word as the wire.
        impl serde::Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }

        impl<'de> serde::Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let word = String::deserialize(d)?;
                word.parse().map_err(serde::de::Error::custom)
            }
        }

        impl std::str::FromStr for $name {
            type Err = UnknownWord;
            fn from_str(s: &str) -> Result<Self, UnknownWord> {
                $name::parse(s).ok_or_else(|| UnknownWord { kind: $what, word: s.to_owned(), expected: words($name::ALL) })
            }
        }
    };
}

/// A word that names no variant of a domain enum.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {kind} {word:?} (expected one of {expected})")]
pub struct UnknownWord {
    pub kind: &'static str,
    pub word: String,
    /// The words that would have been understood.
    pub expected: String,
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
        /// A GPU's clocks held down by temperature (HW or SW thermal slowdown) while its rank ran slow.
        GpuThermalThrottle = "gpu.thermal_throttle",
        /// A GPU held at its power cap (SW power cap, HW power brake) while its rank ran slow.
        GpuPowerCapped = "gpu.power_capped",
        /// HW slowdown (the board's protection: power supply, temperature) while its rank ran slow.
        GpuHwSlowdown = "gpu.hw_slowdown",
        /// SM clocks far under the GPU's maximum with no throttle reason given.
        GpuClocksLow = "gpu.clocks_low",
        /// A PCIe link running under its maximum generation or width.
        PcieDowntrained = "pcie.downtrained",
        /// NVLink CRC, replay or recovery errors counting up.
        NvlinkErrors = "nvlink.errors",
        /// NVLinks of a GPU down.
        NvlinkDown = "nvlink.down",
        /// The driver reported an XID.
        GpuXid = "gpu.xid",
        /// Uncorrected (or a burst of corrected) ECC errors.
        GpuEcc = "gpu.ecc",
        /// A row remapping waits for a GPU reset (or failed).
        GpuRowRemapPending = "gpu.row_remap_pending",
    }
}

string_enum! {
    /// A node as `ctl nodes` shows it: its agent's state, plus `unresponsive` for a stream that
    /// is open but whose heartbeats stopped.
    pub enum NodeState ("node state") {
        Connected = "connected",
        Unresponsive = "unresponsive",
        Disconnected = "disconnected",
        Leaving = "leaving",
    }
}

string_enum! {
    /// What ended a job attempt (docs/faults.md): each has its detector, its recovery, and a
    /// rule for whether it counts against `max_restarts` and whether it blames a node.
    pub enum FailureKind ("failure kind") {
        /// A rank exited non-zero or was killed by a signal: the job's own failure.
        RankExit = "rank_exit",
        /// A host's agent vanished, was cut off or came back without its ranks.
        HostLost = "host_lost",
        /// A rank vanished on a live host (its supervisor died, its exit status unreadable).
        RankLost = "rank_lost",
        /// The node's launch preflight refused the ranks.
        Preflight = "preflight",
        /// Ranks alive but no step receipt for the job's hang timeout.
        Hang = "hang",
        /// The node is being taken away (a cloud's preemption notice).
        Preemption = "preemption",
        /// An operator drained the node.
        Drain = "drain",
        /// A waiting job of much higher priority needed its GPUs.
        Preempted = "preempted",
        /// The driver reported an XID on a GPU of the attempt that asks for a GPU reset or a
        /// reboot (`trainyard_proto::telemetry::XIDS`).
        GpuXid = "gpu_xid",
    }
}

string_enum! {
    /// Which output of a rank a log chunk comes from.
    pub enum LogStream ("log stream") {
        Stdout = "stdout",
        Stderr = "stderr",
    }
}

string_enum! {
    /// The kinds of receipt schema v1 (docs/receipts.md). A receipt of another kind is stored
    /// and flagged, so the wire and the store carry the kind as its word.
    pub enum ReceiptKind ("receipt kind") {
        Launch = "launch",
        Step = "step",
        Eval = "eval",
        Checkpoint = "checkpoint",
        Exit = "exit",
        Goodput = "goodput",
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
        assert_eq!(
            err.to_string(),
            "unknown rank state \"exitted\" (expected one of planned, launching, running, exited, lost)"
        );
        assert_eq!(serde_json::to_string(&RankState::Exited).unwrap(), "\"exited\"");
        assert_eq!(serde_json::from_str::<LogStream>("\"stderr\"").unwrap(), LogStream::Stderr);
        let refused = serde_json::from_str::<LogStream>("\"stdin\"").unwrap_err().to_string();
        assert!(refused.contains("unknown log stream \"stdin\""), "{refused}");
        assert!(RankState::Lost.is_done() && !RankState::Running.is_done());
        assert!(JobState::Cancelled.is_terminal() && !JobState::Restarting.is_terminal());
        assert_eq!("nvlink-pairs".parse(), Ok(InterconnectClass::NvlinkPairs));
        assert_eq!(words(PreflightLevel::ALL), "none, quick, standard, full");
        assert_eq!("skipped".parse(), Ok(CheckStatus::Skipped));
        assert!("skip".parse::<CheckStatus>().is_err() && "ok".parse::<Verdict>().is_err());
    }
}
