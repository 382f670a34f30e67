//! Preflight: the checks an operator runs on every fresh node (docs/field-notes.md §3), run by
//! the agent at start, before every launch at the job's level, and on the controller's request.
//!
//! [`run`] gathers (through the [`HostProbe`]: inventory, NVML health, CUDA, NCCL) and then
//! decides with pure functions in [`checks`] over plain data, so every verdict is unit-tested
//! from fixtures without a GPU. A library that is missing makes its check `skipped` with the
//! reason, never `pass`.
//!
//! - [`probe`]: [`HostProbe`], the seam around the hardware, and the GPU health it reports.
//! - [`host`]: the JSON host-description file, the probe of machines without GPUs.
//! - [`facts`]: [`HostFacts`], the non-GPU state of the host (NUMA balancing, /dev/shm, env, NICs).
//! - [`checks`]: the pure checks over topology, facts and probe results.
//! - [`nvml`]: the NVML probe (inventory and GPU health), loaded at run time.
//! - [`cuda`]: CUDA driver init, context, allocation and copy on every GPU (cudarc).
//! - [`nccl`]: the all_reduce sweep over all GPUs of the node (cudarc's NCCL bindings).
//! - [`runner`]: the daemon's runner (blocking thread, latest report, `preflight.json`).
//! - [`table`]: the operator's text output: the matrix, then one row per check.

pub mod checks;
pub mod cuda;
pub mod facts;
pub mod host;
pub mod nccl;
pub mod nvml;
pub mod probe;
pub mod runner;
pub mod table;

use std::collections::BTreeMap;

pub use checks::Check;
pub use facts::HostFacts;
use trainyard_proto::v1::PreflightReport;
use trainyard_proto::words::{CheckStatus, PreflightLevel, UnknownWord, Verdict};

use crate::topology::{self, Topology};
use probe::HostProbe;

/// The all_reduce message sizes of the NCCL sweep at `level`: none for `quick`; up to 256 MiB
/// for `standard`; up to 1 GiB, where busbw peaks, for `full`.
pub fn sweep_sizes(level: PreflightLevel) -> Vec<u64> {
    let max: u64 = match level {
        PreflightLevel::None | PreflightLevel::Quick => return Vec::new(),
        PreflightLevel::Standard => 256 << 20,
        PreflightLevel::Full => 1 << 30,
    };
    // 1 MiB, 4 MiB, ... by factors of 4, ending exactly at the level's maximum.
    let mut sizes: Vec<u64> =
        std::iter::successors(Some(1u64 << 20), |s| Some(s * 4)).take_while(|s| *s < max).collect();
    sizes.push(max);
    sizes
}

/// The level a job spec asks for before launch: `None` for `none` or empty (no preflight).
pub fn level_for_job(spec_level: &str) -> Result<Option<PreflightLevel>, UnknownWord> {
    match spec_level.trim() {
        "" => Ok(None),
        word => word.parse().map(|level| Some(level).filter(|l| *l != PreflightLevel::None)),
    }
}

/// A level a preflight can run at, from its word: `quick`, `standard` or `full`.
pub fn runnable_level(word: &str) -> Result<PreflightLevel, String> {
    match word.parse::<PreflightLevel>().map_err(|e| e.to_string())? {
        PreflightLevel::None => {
            Err("preflight level \"none\" runs no check: use quick, standard or full".into())
        }
        level => Ok(level),
    }
}

/// What a preflight is asked to do.
#[derive(Debug, Clone)]
pub struct Request<'a> {
    pub level: PreflightLevel,
    pub agent_id: &'a str,
    /// The job's environment overlay (empty outside a launch): checked with the agent's own.
    pub job_env: &'a BTreeMap<String, String>,
    /// What is checked: the whole node (an admin's act, the node's verdict) or one job's GPUs.
    pub scope: Scope<'a>,
}

/// Whose preflight it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope<'a> {
    /// The whole node: at the agent's start and on an operator's or the controller's request.
    /// Its report is the node's verdict.
    Node,
    /// A job's launch preflight: the CUDA and NCCL checks run on the job's own GPUs only (NVML
    /// indices), and the report belongs to the job, never to the node.
    Job { job_id: u64, gpus: &'a [u32] },
}

/// The report's verdict: the worst status of `checks`, skipped counting as pass.
pub fn verdict(checks: &[Check]) -> Verdict {
    let severity = |status| match status {
        CheckStatus::Fail => 2,
        CheckStatus::Warn => 1,
        CheckStatus::Pass | CheckStatus::Skipped => 0,
    };
    match checks.iter().map(|c| severity(c.status)).max() {
        Some(2) => Verdict::Fail,
        Some(1) => Verdict::Warn,
        _ => Verdict::Pass,
    }
}

/// Runs the preflight: gathers through `probe`, decides with [`checks`]. Blocking (NVML, CUDA
/// and NCCL calls): async callers use `spawn_blocking`.
pub fn run(request: &Request<'_>, probe: &dyn HostProbe, facts: &HostFacts) -> PreflightReport {
    let started_at_ms = now_ms();
    let mut report = PreflightReport {
        agent_id: request.agent_id.to_string(),
        level: request.level.as_str().to_string(),
        started_at_ms,
        local_id: format!("{}-{started_at_ms}", request.agent_id),
        source: probe.source().to_string(),
        ..Default::default()
    };
    let mut all: Vec<Check> = Vec::new();
    let topo = probe
        .inventory()
        .map_err(|e| format!("{e:#}"))
        .and_then(|inv| Topology::from_inventory(&inv).map(|t| (inv, t)).map_err(|e| e.to_string()));
    let (inventory, topo) = match topo {
        Ok(pair) => pair,
        Err(e) => {
            all.push(
                Check::new("inventory", CheckStatus::Fail, e, "the host's GPUs, links and NUMA nodes")
                    .remedy("fix the host description (or the driver, for NVML) and run the preflight again"),
            );
            return finish(report, all);
        }
    };
    let class = topo.class();
    report.interconnect_class = class.as_str().to_string();
    report.topology = topology::render(&topo);
    all.extend(checks::topology(&inventory, &topo));
    all.extend(checks::numa(&topo, facts));
    all.extend(checks::host(facts, request.job_env));
    let health = probe.gpu_health();
    if let Ok(h) = &health {
        report.driver_version = h.driver_version.clone();
        report.cuda_version = h.cuda_version.clone();
    }
    all.extend(checks::nvml(&health));
    let present: Vec<u32> = topo.gpus.iter().map(|g| g.index).collect();
    let gpus: Vec<u32> = match request.scope {
        Scope::Node => present,
        Scope::Job { job_id, gpus } => {
            report.job_id = job_id;
            report.gpus = gpus.to_vec();
            gpus.iter().copied().filter(|i| present.contains(i)).collect()
        }
    };
    let cuda = probe.cuda_check(&gpus);
    if let cuda::Outcome::Ran { driver_version, cuda_version, .. } = &cuda {
        if report.driver_version.is_empty() {
            report.driver_version = driver_version.clone();
        }
        if report.cuda_version.is_empty() {
            report.cuda_version = cuda_version.clone();
        }
    }
    let cuda_checks = checks::cuda(&cuda, &gpus);
    let cuda_failed = verdict(&cuda_checks) == Verdict::Fail;
    all.extend(cuda_checks);
    let sizes = sweep_sizes(request.level);
    if !sizes.is_empty() {
        // A node whose CUDA init failed fails now: NCCL on it would only hang or fail again.
        let sweep = if cuda_failed {
            nccl::Outcome::Skipped("CUDA check failed on this node".into())
        } else {
            probe.nccl_sweep(&gpus, &sizes)
        };
        if let nccl::Outcome::Ran { version, .. } = &sweep {
            report.nccl_version = version.clone();
        }
        all.extend(checks::nccl(&sweep, class, gpus.len()));
    }
    finish(report, all)
}

fn finish(mut report: PreflightReport, checks: Vec<Check>) -> PreflightReport {
    report.verdict = verdict(&checks).as_str().to_string();
    report.checks = checks.into_iter().map(Check::into_proto).collect();
    report.finished_at_ms = now_ms();
    report
}

/// The first failing check of `report`, as the launch's failure reason:
/// `preflight failed: <id>: <measured> (expected <expected>)`.
pub fn failure_reason(report: &PreflightReport) -> Option<String> {
    report
        .checks
        .iter()
        .find(|c| c.status() == Ok(CheckStatus::Fail))
        .map(|c| format!("preflight failed: {}: {} (expected {})", c.id, c.measured, c.expected))
}

/// The report as pretty JSON (what `-o json` prints and `preflight.json` holds).
pub fn to_json(report: &PreflightReport) -> serde_json::Value {
    let checks: Vec<serde_json::Value> = report
        .checks
        .iter()
        .map(|c| {
            serde_json::json!({"id": c.id, "status": c.status, "measured": c.measured,
                "expected": c.expected, "remedy": c.remedy})
        })
        .collect();
    serde_json::json!({
        "local_id": report.local_id, "agent_id": report.agent_id, "level": report.level,
        "started_at_ms": report.started_at_ms, "finished_at_ms": report.finished_at_ms,
        "verdict": report.verdict, "interconnect_class": report.interconnect_class,
        "source": report.source, "driver_version": report.driver_version,
        "cuda_version": report.cuda_version, "nccl_version": report.nccl_version,
        "topology": report.topology, "checks": checks,
    })
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_and_sweeps() {
        assert!(sweep_sizes(PreflightLevel::Quick).is_empty());
        let standard = sweep_sizes(PreflightLevel::Standard);
        assert_eq!(standard.first(), Some(&(1 << 20)));
        assert_eq!(standard.last(), Some(&(256 << 20)));
        assert_eq!(sweep_sizes(PreflightLevel::Full).last(), Some(&(1 << 30)));
        assert_eq!(level_for_job("none"), Ok(None));
        assert_eq!(level_for_job(""), Ok(None));
        assert_eq!(level_for_job("full"), Ok(Some(PreflightLevel::Full)));
        assert!(level_for_job("fast").is_err());
        assert_eq!(runnable_level("standard"), Ok(PreflightLevel::Standard));
        assert!(runnable_level("none").unwrap_err().contains("runs no check"));
        assert!(runnable_level("fast").unwrap_err().contains("expected one of none, quick, standard, full"));
    }

    #[test]
    fn verdict_is_the_worst_and_skipped_counts_as_pass() {
        let c = |s| Check::new("x", s, "", "");
        assert_eq!(verdict(&[]), Verdict::Pass);
        assert_eq!(verdict(&[c(CheckStatus::Skipped)]), Verdict::Pass);
        assert_eq!(
            verdict(&[c(CheckStatus::Pass), c(CheckStatus::Warn), c(CheckStatus::Skipped)]),
            Verdict::Warn
        );
        assert_eq!(verdict(&[c(CheckStatus::Fail), c(CheckStatus::Warn)]), Verdict::Fail);
    }
}
