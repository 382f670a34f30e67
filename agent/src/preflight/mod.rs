//! Preflight: the checks an operator runs on every fresh node (docs/field-notes.md §3), run by
//! the agent at start, before every launch at the job's level, and on the controller's request.
//!
//! [`run`] gathers (through the [`HostProbe`]: inventory, NVML health, CUDA, NCCL) and then
//! decides with pure functions in [`checks`] over plain data, so every verdict is unit-tested
//! from fixtures without a GPU. A library that is missing makes its check `skipped` with the
//! reason, never `pass`.
//!
//! - [`host`]: [`HostProbe`], the seam around the hardware, and the JSON host-description file.
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
pub mod runner;
pub mod table;

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

pub use facts::HostFacts;
use trainyard_proto::v1::{PreflightCheck, PreflightReport};

use crate::topology::{self, Topology};
use host::HostProbe;

/// How much the preflight does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// Inventory, topology, host checks, NVML health, CUDA init: seconds.
    Quick,
    /// Quick plus an NCCL all_reduce sweep up to 256 MiB.
    Standard,
    /// Quick plus an NCCL all_reduce sweep up to 1 GiB, where busbw peaks.
    Full,
}

impl Level {
    pub fn as_str(self) -> &'static str {
        match self {
            Level::Quick => "quick",
            Level::Standard => "standard",
            Level::Full => "full",
        }
    }

    /// The all_reduce message sizes of the NCCL sweep (none for `quick`).
    pub fn sweep_sizes(self) -> Vec<u64> {
        let max: u64 = match self {
            Level::Quick => return Vec::new(),
            Level::Standard => 256 << 20,
            Level::Full => 1 << 30,
        };
        // 1 MiB, 4 MiB, ... by factors of 4, ending exactly at the level's maximum.
        let mut sizes: Vec<u64> =
            std::iter::successors(Some(1u64 << 20), |s| Some(s * 4)).take_while(|s| *s < max).collect();
        sizes.push(max);
        sizes
    }

    /// The level a job spec asks for: `None` for "none" or empty (no preflight before launch).
    pub fn for_job(spec_level: &str) -> Result<Option<Level>, String> {
        match spec_level.trim() {
            "" | "none" => Ok(None),
            other => other.parse().map(Some),
        }
    }
}

impl FromStr for Level {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "quick" => Ok(Level::Quick),
            "standard" => Ok(Level::Standard),
            "full" => Ok(Level::Full),
            other => Err(format!("unknown preflight level {other:?} (quick, standard, full)")),
        }
    }
}

/// A check's outcome; the order is best to worst, and a report's verdict is the worst.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Status {
    /// The check could not run (a library or a fact is missing); counts as pass in the
    /// verdict, and says why in `measured`.
    Skipped,
    Pass,
    Warn,
    Fail,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Skipped => "skipped",
            Status::Pass => "pass",
            Status::Warn => "warn",
            Status::Fail => "fail",
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One check's row, before it becomes the proto's `PreflightCheck`.
#[derive(Debug, Clone, PartialEq)]
pub struct Check {
    pub id: String,
    pub status: Status,
    pub measured: String,
    pub expected: String,
    pub remedy: String,
}

impl Check {
    pub fn new(
        id: impl Into<String>,
        status: Status,
        measured: impl Into<String>,
        expected: impl Into<String>,
    ) -> Self {
        Self {
            id: id.into(),
            status,
            measured: measured.into(),
            expected: expected.into(),
            remedy: String::new(),
        }
    }

    /// A skipped check: `measured` reads `skipped: <why>`.
    pub fn skipped(id: impl Into<String>, why: &str, expected: impl Into<String>) -> Self {
        Self::new(id, Status::Skipped, format!("skipped: {why}"), expected)
    }

    pub fn remedy(mut self, remedy: impl Into<String>) -> Self {
        self.remedy = remedy.into();
        self
    }

    /// The remedy only when the check did not pass.
    pub fn remedy_if_bad(self, remedy: impl Into<String>) -> Self {
        if matches!(self.status, Status::Warn | Status::Fail) { self.remedy(remedy) } else { self }
    }

    fn into_proto(self) -> PreflightCheck {
        PreflightCheck {
            id: self.id,
            status: self.status.as_str().to_string(),
            measured: self.measured,
            expected: self.expected,
            remedy: self.remedy,
        }
    }
}

/// What a preflight is asked to do.
#[derive(Debug, Clone)]
pub struct Request<'a> {
    pub level: Level,
    pub agent_id: &'a str,
    /// The job's environment overlay (empty outside a launch): checked with the agent's own.
    pub job_env: &'a BTreeMap<String, String>,
}

/// The worst status of `checks`, skipped counting as pass.
pub fn verdict(checks: &[Check]) -> Status {
    checks
        .iter()
        .map(|c| if c.status == Status::Skipped { Status::Pass } else { c.status })
        .max()
        .unwrap_or(Status::Pass)
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
                Check::new("inventory", Status::Fail, e, "the host's GPUs, links and NUMA nodes")
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
    let n = topo.gpus.len();
    let cuda = probe.cuda_check(n);
    if let cuda::Outcome::Ran { driver_version, cuda_version, .. } = &cuda {
        if report.driver_version.is_empty() {
            report.driver_version = driver_version.clone();
        }
        if report.cuda_version.is_empty() {
            report.cuda_version = cuda_version.clone();
        }
    }
    let cuda_checks = checks::cuda(&cuda, n);
    let cuda_failed = verdict(&cuda_checks) == Status::Fail;
    all.extend(cuda_checks);
    let sizes = request.level.sweep_sizes();
    if !sizes.is_empty() {
        // A node whose CUDA init failed fails now: NCCL on it would only hang or fail again.
        let sweep = if cuda_failed {
            nccl::Outcome::Skipped("CUDA check failed on this node".into())
        } else {
            probe.nccl_sweep(n, &sizes)
        };
        if let nccl::Outcome::Ran { version, .. } = &sweep {
            report.nccl_version = version.clone();
        }
        all.extend(checks::nccl(&sweep, class, n));
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
        .find(|c| c.status == Status::Fail.as_str())
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
        assert!(Level::Quick.sweep_sizes().is_empty());
        let standard = Level::Standard.sweep_sizes();
        assert_eq!(standard.first(), Some(&(1 << 20)));
        assert_eq!(standard.last(), Some(&(256 << 20)));
        assert_eq!(Level::Full.sweep_sizes().last(), Some(&(1 << 30)));
        assert_eq!(Level::for_job("none"), Ok(None));
        assert_eq!(Level::for_job(""), Ok(None));
        assert_eq!(Level::for_job("full"), Ok(Some(Level::Full)));
        assert!(Level::for_job("fast").is_err());
    }

    #[test]
    fn verdict_is_the_worst_and_skipped_counts_as_pass() {
        let c = |s| Check::new("x", s, "", "");
        assert_eq!(verdict(&[]), Status::Pass);
        assert_eq!(verdict(&[c(Status::Skipped)]), Status::Pass);
        assert_eq!(verdict(&[c(Status::Pass), c(Status::Warn), c(Status::Skipped)]), Status::Warn);
        assert_eq!(verdict(&[c(Status::Fail), c(Status::Warn)]), Status::Fail);
    }
}
