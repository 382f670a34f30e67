//! The records of jobs, ranks, agents and preflight reports that the core keeps in memory, the
//! store persists and the analysis reads. The store owns the rows these are read from and
//! written to; these are the values every layer passes around.

use trainyard_proto::v1::{PreflightCheck, PreflightReport};

use crate::domain::{
    AgentState, CheckStatus, FailureKind, InterconnectClass, Inventory, JobState, PreflightLevel, RankState,
    Verdict,
};
use crate::spec::JobSpec;

/// A job's id, assigned by the store.
pub type JobId = u64;

/// A row of `jobs`.
#[derive(Debug, Clone, PartialEq)]
pub struct JobRecord {
    pub id: JobId,
    pub spec: JobSpec,
    /// Who submitted it, and the Unix account its ranks run as.
    pub owner: JobOwner,
    pub state: JobState,
    pub reason: String,
    pub attempt: u32,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
}

/// Who owns a job (`jobs.submitted_by`, `jobs.run_as`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct JobOwner {
    /// The user who submitted the job; empty for jobs stored before users existed.
    pub user: String,
    /// The Unix account the ranks run as; empty: the agent's own account, which the agent
    /// allows only when it does not run as root (the loopback demo).
    pub run_as: String,
}

/// A row of `job_events`.
#[derive(Debug, Clone, PartialEq)]
pub struct JobEventRecord {
    pub job_id: JobId,
    pub at_ms: i64,
    /// `None` for the event that created the job.
    pub from_state: Option<JobState>,
    pub to_state: JobState,
    /// The job's attempt after the transition.
    pub attempt: u32,
    pub reason: String,
}

/// One failure of a job attempt (a row of `failures`): what it was, where, the evidence, and
/// what it cost the job and the node.
#[derive(Debug, Clone, PartialEq)]
pub struct FailureRecord {
    pub job_id: JobId,
    /// The attempt that failed.
    pub attempt: u32,
    pub at_ms: i64,
    pub kind: FailureKind,
    /// The node it happened on, if one is known.
    pub agent_id: Option<String>,
    /// The first rank it was seen on, if any.
    pub rank: Option<u32>,
    /// What the detector saw, in words.
    pub evidence: String,
    /// The node is held responsible: excluded from this job until it passes a preflight, and
    /// counted towards a fleet-wide cordon.
    pub blamed: bool,
    /// Counts against the job's `max_restarts` (the job's own failures do; the fleet's do not).
    pub charged: bool,
}

/// Why a node takes no new work although it is connected.
#[derive(Debug, Clone, PartialEq)]
pub struct Cordon {
    /// `operator` (lifted by `ctl uncordon`) or `failures` (lifted by a passing preflight).
    pub by: String,
    pub reason: String,
    pub at_ms: i64,
}

/// Identity of one rank of one attempt of a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RankId {
    pub job_id: JobId,
    pub attempt: u32,
    pub rank: u32,
}

/// A row of `allocations`: where a rank runs (intent) and what its agent reported (observed).
#[derive(Debug, Clone, PartialEq)]
pub struct Allocation {
    pub id: RankId,
    pub agent_id: String,
    pub gpu_index: u32,
    pub node_rank: u32,
    pub local_rank: u32,
    /// The binding the controller planned (kernel CPU list, NUMA memory node); empty when the
    /// rank runs unpinned.
    pub planned_cpus: String,
    pub planned_mems: String,
    pub observed: RankObserved,
}

/// What the agent last reported about a rank.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RankObserved {
    /// `planned` until the agent reports; then `launching`, `running`, `exited` or `lost`.
    pub state: RankState,
    pub pid: Option<u32>,
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub message: String,
    pub skipped_lines: u64,
    pub updated_at_ms: i64,
    /// What `/proc/<pid>/status` showed after spawn (`Cpus_allowed_list`, `Mems_allowed_list`);
    /// empty until read.
    pub effective_cpus: String,
    pub effective_mems: String,
}

/// A row of `agents`, with its inventory (also flattened into `gpus`).
#[derive(Debug, Clone, PartialEq)]
pub struct AgentRecord {
    pub agent_id: String,
    pub address: String,
    pub agent_version: String,
    pub inventory: Inventory,
    pub state: AgentState,
    pub last_seen_ms: i64,
    /// Set while the node is cordoned (stored in `agents.cordon_*`; a hello leaves it alone).
    pub cordon: Option<Cordon>,
}

/// A preflight report as the controller keeps it: what an agent sent, with every word checked
/// ([`PreflightRecord::try_from`] names the first one that is not known).
#[derive(Debug, Clone, PartialEq)]
pub struct PreflightRecord {
    /// Assigned by the store (`preflight_reports.id`); 0 before it is stored.
    pub report_id: u64,
    pub agent_id: String,
    /// The agent's own name for it (`<agent_id>-<started_at_ms>`), '' if it gave none.
    pub local_id: String,
    pub level: PreflightLevel,
    pub started_at_ms: i64,
    pub finished_at_ms: i64,
    pub verdict: Verdict,
    /// `None` when the agent could not classify the fabric.
    pub interconnect_class: Option<InterconnectClass>,
    pub driver_version: String,
    pub cuda_version: String,
    pub nccl_version: String,
    /// Where the inventory came from: `nvml` or `host-file`.
    pub source: String,
    /// The GPU matrix as `nvidia-smi topo -m` prints it.
    pub topology: String,
    pub checks: Vec<CheckRecord>,
    /// The job whose launch preflight this is, on its GPUs `gpus`; `None` for a preflight of
    /// the whole node (the node's verdict).
    pub job_id: Option<u64>,
    pub gpus: Vec<u32>,
}

/// One check of a [`PreflightRecord`].
#[derive(Debug, Clone, PartialEq)]
pub struct CheckRecord {
    pub id: String,
    pub status: CheckStatus,
    pub measured: String,
    pub expected: String,
    pub remedy: String,
}

impl PreflightRecord {
    /// The ids of the failing checks, with what they measured.
    pub fn failing(&self) -> impl Iterator<Item = &CheckRecord> {
        self.checks.iter().filter(|c| c.status == CheckStatus::Fail)
    }
}

impl TryFrom<PreflightReport> for PreflightRecord {
    type Error = crate::domain::UnknownWord;

    fn try_from(r: PreflightReport) -> Result<Self, Self::Error> {
        let (level, verdict, interconnect_class) = (r.level()?, r.verdict()?, r.interconnect_class()?);
        let checks = r
            .checks
            .into_iter()
            .map(|c| {
                Ok(CheckRecord {
                    status: c.status()?,
                    id: c.id,
                    measured: c.measured,
                    expected: c.expected,
                    remedy: c.remedy,
                })
            })
            .collect::<Result<_, Self::Error>>()?;
        Ok(PreflightRecord {
            report_id: r.report_id,
            agent_id: r.agent_id,
            local_id: r.local_id,
            level,
            started_at_ms: r.started_at_ms,
            finished_at_ms: r.finished_at_ms,
            verdict,
            interconnect_class,
            driver_version: r.driver_version,
            cuda_version: r.cuda_version,
            nccl_version: r.nccl_version,
            source: r.source,
            topology: r.topology,
            checks,
            job_id: (r.job_id != 0).then_some(r.job_id),
            gpus: r.gpus,
        })
    }
}

impl From<PreflightRecord> for PreflightReport {
    fn from(r: PreflightRecord) -> Self {
        PreflightReport {
            report_id: r.report_id,
            agent_id: r.agent_id,
            local_id: r.local_id,
            level: r.level.to_string(),
            started_at_ms: r.started_at_ms,
            finished_at_ms: r.finished_at_ms,
            verdict: r.verdict.to_string(),
            interconnect_class: r.interconnect_class.map(|c| c.to_string()).unwrap_or_default(),
            driver_version: r.driver_version,
            cuda_version: r.cuda_version,
            nccl_version: r.nccl_version,
            source: r.source,
            topology: r.topology,
            checks: r
                .checks
                .into_iter()
                .map(|c| PreflightCheck {
                    id: c.id,
                    status: c.status.to_string(),
                    measured: c.measured,
                    expected: c.expected,
                    remedy: c.remedy,
                })
                .collect(),
            job_id: r.job_id.unwrap_or_default(),
            gpus: r.gpus,
        }
    }
}

/// One GPU's telemetry over one window (a row of `gpu_samples`, docs/telemetry.md): gauges
/// summarised, throttle reasons OR-ed, counters as deltas over the window, and the rank that
/// used the GPU with the steps it ran in the window.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct GpuWindowRecord {
    pub agent_id: String,
    pub gpu: u32,
    pub uuid: String,
    pub start_ms: i64,
    pub end_ms: i64,
    pub samples: u32,
    pub sm_clock_min: Option<f64>,
    pub sm_clock_mean: Option<f64>,
    pub sm_clock_max: Option<f64>,
    /// The GPU's maximum SM clock (0: unknown).
    pub sm_clock_limit: f64,
    pub mem_clock_mean: Option<f64>,
    pub power_mean: Option<f64>,
    pub power_max: Option<f64>,
    pub power_limit: f64,
    pub gpu_temp_mean: Option<f64>,
    pub gpu_temp_max: Option<f64>,
    pub mem_temp_max: Option<f64>,
    pub util_mean: Option<f64>,
    pub mem_used_max: Option<f64>,
    /// NVML clocks-event reason bits (`trainyard_proto::telemetry`).
    pub clock_reasons: u64,
    pub pcie_gen: u32,
    pub pcie_gen_max: u32,
    pub pcie_width: u32,
    pub pcie_width_max: u32,
    pub pcie_replays: u64,
    pub nvlinks_up: u32,
    pub nvlinks_total: u32,
    pub nvlink_crc_errors: u64,
    pub nvlink_replay_errors: u64,
    pub nvlink_recovery_errors: u64,
    pub ecc_corrected: u64,
    pub ecc_uncorrected: u64,
    pub remap_pending: bool,
    pub remap_failed: bool,
    pub xids: Vec<u32>,
    /// The NVLinks that were down or counted errors in the window, in words
    /// (`link 3 down; link 7: 12 crc, 1 replay`); empty when all were up and clean.
    pub nvlink_detail: String,
    /// The rank on the GPU, if one ran there in the window.
    pub job_id: Option<JobId>,
    pub attempt: Option<u32>,
    pub rank: Option<u32>,
    /// Steps the rank ran in the window (`None`: it ran none).
    pub first_step: Option<i64>,
    pub last_step: Option<i64>,
}

/// A finding of the live diagnosis (a row of `live_findings`): opened when first seen, updated
/// while it lasts, closed when it stops, with the alerts sent about it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LiveFinding {
    /// 0 until stored.
    pub id: u64,
    pub job_id: JobId,
    pub attempt: u32,
    /// A diagnosis cause word (`trainyard_proto::words::Cause`).
    pub cause: String,
    /// What it is about (`node`, `node/gpu3`, or the ranks): one open finding per job, cause
    /// and subject.
    pub subject: String,
    pub nodes: Vec<String>,
    pub ranks: Vec<u32>,
    pub summary: String,
    pub evidence: String,
    pub remedy: String,
    /// The job's newest step when it opened, and when it was last seen (a plot's band).
    pub first_step: Option<i64>,
    pub last_step: Option<i64>,
    pub opened_at_ms: i64,
    pub updated_at_ms: i64,
    pub closed_at_ms: Option<i64>,
    pub alerted_open_ms: Option<i64>,
    pub alerted_close_ms: Option<i64>,
}
