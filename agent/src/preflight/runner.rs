//! The daemon's side of the preflight: runs [`super::run`] on a blocking thread (NVML, CUDA and
//! NCCL calls must not stall the connection's executor), keeps the latest report for `Hello`,
//! and writes reports into run directories.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;
use std::sync::{Arc, Mutex};

use trainyard_proto::v1::PreflightReport;

use trainyard_proto::words::{CheckStatus, PreflightLevel, Verdict};

use super::{HostFacts, Request, Scope};
use crate::layout::write_atomic;
use crate::preflight::probe::HostProbe;

/// Runs preflights for one agent; cheap to clone.
#[derive(Clone)]
pub struct Runner {
    agent_id: Arc<str>,
    probe: Arc<dyn HostProbe>,
    /// The latest report; a `std::sync::Mutex` because it is held for a clone, never across an
    /// `.await`.
    latest: Arc<Mutex<Option<PreflightReport>>>,
}

impl fmt::Debug for Runner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Runner").field("agent_id", &self.agent_id).finish_non_exhaustive()
    }
}

impl Runner {
    pub fn new(agent_id: &str, probe: Arc<dyn HostProbe>) -> Self {
        Self { agent_id: agent_id.into(), probe, latest: Arc::new(Mutex::new(None)) }
    }

    /// Runs a preflight of the whole node at `level` on a blocking thread and remembers its
    /// report as the node's latest (what `Hello` carries).
    pub async fn run(&self, level: PreflightLevel) -> PreflightReport {
        let report = self.run_blocking(level, BTreeMap::new(), None).await;
        *self.latest.lock().unwrap_or_else(|p| p.into_inner()) = Some(report.clone());
        report
    }

    /// Runs job `job_id`'s launch preflight at `level`, with its environment overlay `job_env`,
    /// on its GPUs `gpus` only. The report is the job's: it never becomes the node's latest.
    pub async fn run_for_job(
        &self,
        level: PreflightLevel,
        job_env: BTreeMap<String, String>,
        job_id: u64,
        gpus: Vec<u32>,
    ) -> PreflightReport {
        self.run_blocking(level, job_env, Some((job_id, gpus))).await
    }

    async fn run_blocking(
        &self,
        level: PreflightLevel,
        job_env: BTreeMap<String, String>,
        job: Option<(u64, Vec<u32>)>,
    ) -> PreflightReport {
        let (agent_id, probe) = (self.agent_id.clone(), self.probe.clone());
        tokio::task::spawn_blocking(move || {
            let facts = probe.host_facts().unwrap_or_else(HostFacts::gather);
            let scope = match &job {
                Some((job_id, gpus)) => Scope::Job { job_id: *job_id, gpus },
                None => Scope::Node,
            };
            super::run(
                &Request { level, agent_id: &agent_id, job_env: &job_env, scope },
                probe.as_ref(),
                &facts,
            )
        })
        .await
        .unwrap_or_else(|e| panicked(&self.agent_id, level, &e.to_string()))
    }

    /// The latest report, if a preflight ran.
    pub fn latest(&self) -> Option<PreflightReport> {
        self.latest.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// A report that fails the node because the preflight itself panicked.
fn panicked(agent_id: &str, level: PreflightLevel, error: &str) -> PreflightReport {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64);
    PreflightReport {
        agent_id: agent_id.to_string(),
        level: level.as_str().to_string(),
        started_at_ms: now,
        finished_at_ms: now,
        verdict: Verdict::Fail.to_string(),
        local_id: format!("{agent_id}-{now}"),
        checks: vec![trainyard_proto::v1::PreflightCheck {
            id: "preflight".into(),
            status: CheckStatus::Fail.to_string(),
            measured: format!("the preflight crashed: {error}"),
            expected: "the preflight completes".into(),
            remedy: "run `trainyard-agent preflight` on the node to see the failure".into(),
        }],
        ..Default::default()
    }
}

/// Writes `report` as JSON to `path` (atomically), creating the directory.
pub fn write_report(path: &Path, report: &PreflightReport) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let bytes = serde_json::to_vec_pretty(&super::to_json(report)).map_err(std::io::Error::other)?;
    write_atomic(path, &bytes)
}
