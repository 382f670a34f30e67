//! The GPU's own causes, from the telemetry windows beside the receipts (docs/telemetry.md).
//!
//! A window of a GPU names the rank that used it and the steps it ran; the rank's pace in the
//! window is its median time over those steps against the job's median at the same steps
//! (the median over every rank), so a window is *slow* when that ratio is at least
//! [`SLOW_WINDOW_RATIO`]. A condition (a throttle reason, low clocks, a downtrained link, an
//! NVLink down or erring) is a finding only where it explains the slowness it is blamed for:
//! - it coincides with slow windows of its rank: at least half of the condition's windows,
//!   and at least one, are slow;
//! - it tells the slow from the fast: fewer than half of the windows where ranks ran at the
//!   job's pace show it too (a property every fast GPU shares is not why one is slow).
//!
//! A condition that does not explain anything is kept as a telemetry note, not a verdict.
//! Health problems (an XID, ECC errors, a row remapping waiting for a reset) are findings
//! whether or not the rank was slow: they say the GPU needs attention.

use std::collections::{BTreeMap, BTreeSet};

use trainyard_model::domain::Cause;
use trainyard_model::records::GpuWindowRecord;
use trainyard_proto::telemetry::{self as tel, reason_words};

use super::report::{Finding, Measure, measure};
use super::stragglers::median;

/// A window is slow when its rank's median time is this much over the job's at the same steps.
pub const SLOW_WINDOW_RATIO: f64 = 1.2;
/// SM clocks under this share of the GPU's maximum, under load, with no throttle reason.
pub const LOW_CLOCK_SHARE: f64 = 0.75;
/// A GPU this busy (mean utilisation, %) should run its link and clocks at full speed.
const BUSY_UTIL_PCT: f64 = 50.0;
/// NVLink errors (CRC, replay, recovery) in one window that count as erring.
pub const NVLINK_ERRORS_PER_WINDOW: u64 = 10;
/// Corrected ECC errors in one window that count as a burst.
pub const ECC_CORRECTED_PER_WINDOW: u64 = 100;

/// What the field reports each GPU cause costs.
pub mod cost_of {
    pub const THERMAL: &str = "a GPU in thermal slowdown runs its SM clock far under boost (H100 SXM: 1980 MHz \
        max); in data-parallel training every rank waits for it at each collective";
    pub const POWER: &str = "a GPU held at its power cap or power brake loses clock: the whole job runs at \
        that GPU's pace";
    pub const HW_SLOWDOWN: &str = "HW slowdown halves the clocks or worse (power supply or board protection): \
        the slowest GPU sets every rank's pace";
    pub const CLOCKS: &str = "clocks held under their maximum (an application-clock or locked-clock setting, \
        a firmware state) slow every kernel of that rank";
    pub const PCIE: &str = "a link retrained to a lower generation or width cuts host-device bandwidth (data \
        loading, checkpoints, and PCIe-path collectives) by the same factor";
    pub const NVLINK: &str = "NVLink replays and recoveries stall collectives; a link down forces traffic onto \
        the remaining links or PCIe";
    pub const XID: &str = "an XID is the driver reporting a GPU fault: depending on the XID, the rank's \
        process, the GPU or the node must be restarted";
    pub const ECC: &str = "uncorrected ECC errors kill the rank's process (XID 48/94/95) and mean the memory \
        must be retired or the GPU replaced";
    pub const REMAP: &str = "a pending row remapping takes effect only after a GPU reset; until then the bad \
        row can fail again";
}

/// One telemetry condition that may explain slowness.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Condition {
    Thermal,
    Power,
    HwSlowdown,
    ClocksLow,
    Pcie,
    NvlinkDown,
    NvlinkErrors,
}

impl Condition {
    const ALL: [Condition; 7] = [
        Condition::Thermal,
        Condition::Power,
        Condition::HwSlowdown,
        Condition::ClocksLow,
        Condition::Pcie,
        Condition::NvlinkDown,
        Condition::NvlinkErrors,
    ];

    fn cause(self) -> Cause {
        match self {
            Condition::Thermal => Cause::GpuThermalThrottle,
            Condition::Power => Cause::GpuPowerCapped,
            Condition::HwSlowdown => Cause::GpuHwSlowdown,
            Condition::ClocksLow => Cause::GpuClocksLow,
            Condition::Pcie => Cause::PcieDowntrained,
            Condition::NvlinkDown => Cause::NvlinkDown,
            Condition::NvlinkErrors => Cause::NvlinkErrors,
        }
    }

    fn holds(self, w: &GpuWindowRecord) -> bool {
        let busy = w.util_mean.is_none_or(|u| u >= BUSY_UTIL_PCT);
        let reasons = w.clock_reasons;
        let thermal = reasons & (tel::HW_THERMAL.bit | tel::SW_THERMAL.bit) != 0;
        let power = reasons & (tel::SW_POWER_CAP.bit | tel::HW_POWER_BRAKE.bit) != 0;
        let slowing = tel::CLOCK_REASONS.iter().any(|r| r.slows && reasons & r.bit != 0);
        match self {
            Condition::Thermal => thermal,
            Condition::Power => power && !thermal,
            Condition::HwSlowdown => reasons & tel::HW_SLOWDOWN.bit != 0 && !thermal && !power,
            Condition::ClocksLow => {
                busy && !slowing
                    && w.sm_clock_limit > 0.0
                    && w.sm_clock_mean.is_some_and(|c| c < LOW_CLOCK_SHARE * w.sm_clock_limit)
            }
            Condition::Pcie => {
                busy && ((w.pcie_gen_max > 0 && w.pcie_gen < w.pcie_gen_max)
                    || (w.pcie_width_max > 0 && w.pcie_width < w.pcie_width_max))
            }
            Condition::NvlinkDown => w.nvlinks_total > 0 && w.nvlinks_up < w.nvlinks_total,
            Condition::NvlinkErrors => nvlink_errors(w) >= NVLINK_ERRORS_PER_WINDOW,
        }
    }

    fn cost(self) -> &'static str {
        match self {
            Condition::Thermal => cost_of::THERMAL,
            Condition::Power => cost_of::POWER,
            Condition::HwSlowdown => cost_of::HW_SLOWDOWN,
            Condition::ClocksLow => cost_of::CLOCKS,
            Condition::Pcie => cost_of::PCIE,
            Condition::NvlinkDown | Condition::NvlinkErrors => cost_of::NVLINK,
        }
    }

    /// What the windows show, in words.
    fn describe(self, ws: &[&GpuWindowRecord]) -> String {
        let min_clock = ws.iter().filter_map(|w| w.sm_clock_min).fold(f64::INFINITY, f64::min);
        let limit = ws.iter().map(|w| w.sm_clock_limit).fold(0.0, f64::max);
        let reasons = ws.iter().fold(0, |r, w| r | w.clock_reasons);
        match self {
            Condition::Thermal | Condition::Power | Condition::HwSlowdown => {
                let temp = ws.iter().filter_map(|w| w.gpu_temp_max).fold(f64::NAN, f64::max);
                let temp = if temp.is_nan() { String::new() } else { format!(", up to {temp:.0} C") };
                format!("{} (SM clock down to {min_clock:.0} of {limit:.0} MHz{temp})", reason_words(reasons))
            }
            Condition::ClocksLow => {
                format!("SM clock down to {min_clock:.0} of {limit:.0} MHz with no throttle reason")
            }
            Condition::Pcie => {
                let w = ws[0];
                format!(
                    "PCIe link at gen {} x{} of gen {} x{}",
                    w.pcie_gen, w.pcie_width, w.pcie_gen_max, w.pcie_width_max
                )
            }
            Condition::NvlinkDown => {
                let up = ws.iter().map(|w| w.nvlinks_up).min().unwrap_or(0);
                format!("{up} of {} NVLinks up{}", ws[0].nvlinks_total, links_of(ws))
            }
            Condition::NvlinkErrors => {
                let n: u64 = ws.iter().map(|w| nvlink_errors(w)).sum();
                format!("{n} NVLink errors (CRC, replay, recovery){}", links_of(ws))
            }
        }
    }

    fn remedy(self, node: &str, gpu: u32) -> String {
        match self {
            Condition::Thermal => format!(
                "check {node}'s cooling (fans, airflow, inlet temperature) and GPU {gpu}'s thermal paste; \
                 drain the node (`ctl drain {node}`) if it persists"
            ),
            Condition::Power => format!(
                "check GPU {gpu}'s power limit (`nvidia-smi -q -d POWER` on {node}: enforced under default?) and \
                 the node's power supply; a power brake is the PSU or the rack asking to shed load"
            ),
            Condition::HwSlowdown => format!(
                "HW slowdown on GPU {gpu} of {node} is the board protecting itself (power supply, temperature): \
                 drain the node and have it serviced"
            ),
            Condition::ClocksLow => format!(
                "look for locked or application clocks on {node} (`nvidia-smi -q -d CLOCK`); reset them \
                 (`nvidia-smi -rgc`, `-rac`) or reboot"
            ),
            Condition::Pcie => format!(
                "GPU {gpu} of {node} trained its link down: reseat the GPU or its riser; `ctl preflight {node} --run full`"
            ),
            Condition::NvlinkDown | Condition::NvlinkErrors => format!(
                "drain {node} and check GPU {gpu}'s NVLinks (`nvidia-smi nvlink -s`, `-e`); reset the GPU, and \
                 replace it or its baseboard if errors return"
            ),
        }
    }
}

/// A window with its pace (`None`: its rank ran no step in it).
type Paced<'a> = (&'a GpuWindowRecord, Option<f64>);

/// Which links, from the last window that says: ` (link 3 down; link 7: 12 crc)`.
fn links_of(ws: &[&GpuWindowRecord]) -> String {
    ws.iter()
        .rev()
        .find(|w| !w.nvlink_detail.is_empty())
        .map_or(String::new(), |w| format!(" ({})", w.nvlink_detail))
}

fn nvlink_errors(w: &GpuWindowRecord) -> u64 {
    w.nvlink_crc_errors + w.nvlink_replay_errors + w.nvlink_recovery_errors
}

/// A window's pace: its rank's median time over the window's steps against the job's median at
/// those steps; `None` without steps of the rank in the window.
fn pace(
    w: &GpuWindowRecord,
    series: &BTreeMap<u32, BTreeMap<i64, f64>>,
    job_at: &BTreeMap<i64, f64>,
) -> Option<f64> {
    let (rank, first, last) = (w.rank?, w.first_step?, w.last_step?);
    let mine: Vec<f64> = series.get(&rank)?.range(first..=last).map(|(_, t)| *t).collect();
    let job: Vec<f64> = job_at.range(first..=last).map(|(_, t)| *t).collect();
    if mine.is_empty() || job.is_empty() {
        return None;
    }
    let job = median(&mut job.clone());
    (job > 0.0).then(|| median(&mut mine.clone()) / job)
}

/// The GPU findings of one attempt, and telemetry notes (conditions that explain nothing).
/// `series` holds each rank's step times (the metric the diagnosis compares).
pub(super) fn findings(
    windows: &[GpuWindowRecord],
    series: &BTreeMap<u32, Vec<(i64, f64)>>,
    metric: &str,
) -> (Vec<Finding>, Vec<String>) {
    let series: BTreeMap<u32, BTreeMap<i64, f64>> =
        series.iter().map(|(r, v)| (*r, v.iter().copied().collect())).collect();
    let mut at_step: BTreeMap<i64, Vec<f64>> = BTreeMap::new();
    for v in series.values() {
        for (s, t) in v {
            at_step.entry(*s).or_default().push(*t);
        }
    }
    let job_at: BTreeMap<i64, f64> = at_step.into_iter().map(|(s, mut ts)| (s, median(&mut ts))).collect();
    let paced: Vec<Paced<'_>> = windows.iter().map(|w| (w, pace(w, &series, &job_at))).collect();
    let mut by_gpu: BTreeMap<(&str, u32), Vec<Paced<'_>>> = BTreeMap::new();
    for (w, p) in &paced {
        by_gpu.entry((w.agent_id.as_str(), w.gpu)).or_default().push((w, *p));
    }
    let fast: Vec<&GpuWindowRecord> =
        paced.iter().filter(|(_, p)| p.is_some_and(|p| p < SLOW_WINDOW_RATIO)).map(|(w, _)| *w).collect();
    let (mut out, mut notes) = (Vec::new(), Vec::new());
    for ((node, gpu), ws) in &by_gpu {
        for c in Condition::ALL {
            let with: Vec<&Paced<'_>> = ws.iter().filter(|(w, _)| c.holds(w)).collect();
            if with.is_empty() {
                continue;
            }
            let judged: Vec<f64> = with.iter().filter_map(|(_, p)| *p).collect();
            let slow = judged.iter().filter(|p| **p >= SLOW_WINDOW_RATIO).count();
            let shared = fast.iter().filter(|w| c.holds(w)).count();
            let shared_by_fast = !fast.is_empty() && shared * 2 >= fast.len();
            let what = c.describe(&with.iter().map(|(w, _)| *w).collect::<Vec<_>>());
            if slow == 0 || slow * 2 < judged.len() || shared_by_fast {
                let why = if shared_by_fast {
                    format!("{shared} of {} windows at the job's pace show it too", fast.len())
                } else if judged.is_empty() {
                    "its rank wrote no step receipt in those windows".to_string()
                } else {
                    format!(
                        "its rank ran at the job's pace in {} of {} of them",
                        judged.len() - slow,
                        judged.len()
                    )
                };
                notes.push(format!(
                    "GPU {gpu} of {node}: {what} in {} window(s); not a cause: {why}",
                    with.len()
                ));
                continue;
            }
            out.push(slow_gpu_finding(c, (node, *gpu), &with, slow, &what, metric));
        }
        out.extend(health(node, *gpu, &ws.iter().map(|(w, _)| *w).collect::<Vec<_>>()));
    }
    (out, notes)
}

fn slow_gpu_finding(
    c: Condition,
    (node, gpu): (&str, u32),
    with: &[&Paced<'_>],
    slow: usize,
    what: &str,
    metric: &str,
) -> Finding {
    let ranks: BTreeSet<u32> = with.iter().filter_map(|(w, _)| w.rank).collect();
    let first_step = with.iter().filter_map(|(w, _)| w.first_step).min();
    let ratio = median(&mut with.iter().filter_map(|(_, p)| *p).collect::<Vec<_>>());
    let rank_words = ranks.iter().map(|r| format!("rank {r}")).collect::<Vec<_>>().join(", ");
    let from = first_step.map(|s| format!(" from step {s}")).unwrap_or_default();
    let mut evidence: Vec<Measure> = vec![
        measure("windows with the condition", with.len() as f64, ""),
        measure("of them slow", slow as f64, ""),
        measure(format!("{metric} over the job's median at the same steps"), ratio, "x"),
    ];
    if let Some(clock) = with.iter().filter_map(|(w, _)| w.sm_clock_mean).reduce(f64::min) {
        evidence.push(measure("lowest mean SM clock in a window", clock, "MHz"));
    }
    let last_step = with.iter().filter_map(|(w, _)| w.last_step).max();
    Finding {
        cause: c.cause(),
        steps: first_step.zip(last_step),
        summary: format!(
            "GPU {gpu} of {node} ({rank_words}): {what}{from}; {rank_words} ran {ratio:.2}x the job's median meanwhile"
        ),
        subject: format!("{node}/gpu{gpu}"),
        nodes: vec![node.to_string()],
        ranks: ranks.into_iter().collect(),
        evidence,
        expected_cost: c.cost(),
        remedy: c.remedy(node, gpu),
    }
}

/// XIDs, ECC errors and row remapping of one GPU: findings whatever the pace.
fn health(node: &str, gpu: u32, ws: &[&GpuWindowRecord]) -> Vec<Finding> {
    let ranks: Vec<u32> = ws.iter().filter_map(|w| w.rank).collect::<BTreeSet<_>>().into_iter().collect();
    // The steps of the windows that show a problem: a plot's band.
    let steps_where = |pred: &dyn Fn(&GpuWindowRecord) -> bool| {
        let hit: Vec<&&GpuWindowRecord> = ws.iter().filter(|w| pred(w)).collect();
        hit.iter().filter_map(|w| w.first_step).min().zip(hit.iter().filter_map(|w| w.last_step).max())
    };
    let finding = |cause, steps, summary: String, evidence, cost, remedy: String| Finding {
        cause,
        steps,
        summary,
        subject: format!("{node}/gpu{gpu}"),
        nodes: vec![node.to_string()],
        ranks: ranks.clone(),
        evidence,
        expected_cost: cost,
        remedy,
    };
    let mut out = Vec::new();
    let xids: BTreeSet<u32> = ws.iter().flat_map(|w| w.xids.iter().copied()).collect();
    if !xids.is_empty() {
        let told: Vec<String> = xids
            .iter()
            .map(|n| {
                let x = tel::xid(*n);
                format!("XID {n} ({}: {})", x.meaning, x.action.as_str())
            })
            .collect();
        let drains = xids.iter().any(|n| tel::xid(*n).action.drains());
        out.push(finding(
            Cause::GpuXid,
            steps_where(&|w| !w.xids.is_empty()),
            format!("GPU {gpu} of {node} reported {}", told.join(", ")),
            vec![measure("XIDs", xids.len() as f64, "")],
            cost_of::XID,
            if drains {
                format!("drain {node} (`ctl drain {node}`), reset GPU {gpu} or reboot, then `ctl preflight {node} --run full`")
            } else {
                "look at the rank's log for the fault (an XID of this kind is usually the application's)".into()
            },
        ));
    }
    let uncorrected: u64 = ws.iter().map(|w| w.ecc_uncorrected).sum();
    let corrected_burst = ws.iter().map(|w| w.ecc_corrected).max().unwrap_or(0);
    if uncorrected > 0 || corrected_burst >= ECC_CORRECTED_PER_WINDOW {
        out.push(finding(
            Cause::GpuEcc,
            steps_where(&|w| w.ecc_uncorrected > 0 || w.ecc_corrected >= ECC_CORRECTED_PER_WINDOW),
            format!("GPU {gpu} of {node}: {uncorrected} uncorrected ECC error(s), up to {corrected_burst} corrected in a window"),
            vec![measure("uncorrected ECC errors", uncorrected as f64, ""), measure("most corrected in a window", corrected_burst as f64, "")],
            cost_of::ECC,
            format!("drain {node} and reset GPU {gpu}; replace it if uncorrected errors return"),
        ));
    }
    if ws.iter().any(|w| w.remap_pending || w.remap_failed) {
        let failed = ws.iter().any(|w| w.remap_failed);
        out.push(finding(
            Cause::GpuRowRemapPending,
            steps_where(&|w| w.remap_pending || w.remap_failed),
            format!(
                "GPU {gpu} of {node}: {}",
                if failed { "a row remapping failed" } else { "a row remapping waits for a GPU reset" }
            ),
            vec![measure(
                "windows with a remapping pending or failed",
                ws.iter().filter(|w| w.remap_pending || w.remap_failed).count() as f64,
                "",
            )],
            cost_of::REMAP,
            if failed {
                format!("the GPU is out of spare rows: drain {node} and replace GPU {gpu} (RMA)")
            } else {
                format!("drain {node} and reset GPU {gpu} at the next chance")
            },
        ));
    }
    out
}
