//! `-o json`: a stable JSON rendering of jobs, receipts, nodes and preflight reports.
//!
//! The structs mirror the proto fields by name but are ours, so a proto change (a new field, a
//! renumbering) never silently changes what scripts parse; fields are added here on purpose.

use std::collections::BTreeMap;

use serde::Serialize;
use trainyard_proto::v1::{
    Job, JobEvent, JobSpec, NodeInfo, PreflightCheck, PreflightReport, RankStatus, StoredReceipt,
    job_spec::Engine,
};

#[derive(Debug, Serialize)]
pub struct JobJson {
    pub id: u64,
    pub name: String,
    /// Who submitted the job, and the Unix account its ranks run as ("" = the agent's own).
    pub user: String,
    pub run_as: String,
    pub state: String,
    pub reason: String,
    pub attempt: u32,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
    pub receipts: u64,
    pub spec: Option<SpecJson>,
    pub ranks: Vec<RankJson>,
    pub events: Vec<EventJson>,
    /// What ended each failed attempt (single-job status only).
    pub failures: Vec<FailureJson>,
    /// Cost model: predicted collective time per optimizer step (0 = unknown).
    pub predicted_comm_ms: f64,
    /// Mean optimizer time from step receipts (0 = none yet).
    pub measured_optimizer_ms: f64,
    pub warnings: Vec<String>,
    /// Why a pending job waits ("" otherwise).
    pub waiting_reason: String,
    /// Where the wall time went (single-job status only).
    pub goodput: Option<GoodputJson>,
    /// A `[slurm]` job: the Slurm job holding its allocation (0: none yet; single-job status only).
    pub slurm_job_id: u64,
}

/// The goodput record as the analysis crate defines it (one type end to end), with the line
/// `ctl status` prints and the steps redone over all attempts.
#[derive(Debug, Serialize)]
pub struct GoodputJson {
    pub summary: String,
    pub steps_redone: u64,
    #[serde(flatten)]
    pub goodput: trainyard_analysis::diagnose::goodput::Goodput,
}

impl From<&trainyard_proto::v1::Goodput> for GoodputJson {
    fn from(g: &trainyard_proto::v1::Goodput) -> Self {
        GoodputJson { summary: g.summary.clone(), steps_redone: g.steps_redone, goodput: g.into() }
    }
}

#[derive(Debug, Serialize)]
pub struct SpecJson {
    pub name: String,
    pub priority: i32,
    pub preflight: String,
    pub resources: ResourcesJson,
    pub engine: Option<EngineJson>,
    /// Sorted by name, so the rendering is stable.
    pub env: BTreeMap<String, String>,
    pub restart: RestartJson,
}

#[derive(Debug, Default, Serialize)]
pub struct ResourcesJson {
    pub gpus: u32,
    pub gpus_per_node: u32,
    pub gpu_model: String,
    pub min_gpu_memory_mib: u64,
    pub interconnect: String,
    pub memory_limit_mib: u64,
    pub max_processes: u32,
}

#[derive(Debug, Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum EngineJson {
    Exec { argv: Vec<String>, workdir: String, source_dir: String },
    Builtin { preset: String, data: String, settings: BTreeMap<String, String> },
}

#[derive(Debug, Default, Serialize)]
pub struct RestartJson {
    pub max_restarts: u32,
    pub resume: bool,
    pub backoff_initial_s: f64,
    pub backoff_factor: f64,
    pub backoff_cap_s: f64,
    pub hang_timeout_s: f64,
    pub hang_factor: f64,
    pub checkpoint_signal: String,
    pub min_gpus: u32,
    /// `None`: the controller's default.
    pub host_wait_s: Option<f64>,
}

#[derive(Debug, Serialize)]
pub struct RankJson {
    pub rank: u32,
    pub node_rank: u32,
    pub local_rank: u32,
    pub agent_id: String,
    pub gpu_index: u32,
    pub state: String,
    pub pid: u32,
    pub exit_code: i32,
    pub signal: i32,
    pub last_seq: i64,
    pub skipped_lines: u64,
    pub planned_cpus: String,
    pub planned_mems: String,
    pub effective_cpus: String,
    pub effective_mems: String,
}

#[derive(Debug, Serialize)]
pub struct EventJson {
    pub at_ms: i64,
    pub from_state: String,
    pub to_state: String,
    pub reason: String,
}

/// One failure of a job attempt (docs/faults.md).
#[derive(Debug, Serialize)]
pub struct FailureJson {
    pub attempt: u32,
    pub at_ms: i64,
    pub kind: String,
    pub agent_id: String,
    /// -1 when no rank is known.
    pub rank: i64,
    pub evidence: String,
    pub blamed: bool,
    pub charged: bool,
}

impl From<&trainyard_proto::v1::Failure> for FailureJson {
    fn from(f: &trainyard_proto::v1::Failure) -> Self {
        FailureJson {
            attempt: f.attempt,
            at_ms: f.at_ms,
            kind: f.kind.clone(),
            agent_id: f.agent_id.clone(),
            rank: f.rank,
            evidence: f.evidence.clone(),
            blamed: f.blamed,
            charged: f.charged,
        }
    }
}

/// One receipt as `ctl watch -o json` prints it: where it belongs, and the body as written.
#[derive(Debug, Serialize)]
pub struct ReceiptJson {
    pub job_id: u64,
    pub attempt: u32,
    pub rank: u32,
    pub seq: u64,
    pub position: u64,
    pub kind: String,
    /// The rank's JSON object, embedded as JSON (or as a string if it is somehow not JSON).
    pub body: serde_json::Value,
}

/// One row of `ctl nodes -o json`.
#[derive(Debug, Serialize)]
pub struct NodeJson {
    pub agent_id: String,
    pub hostname: String,
    pub state: String,
    pub gpus: u32,
    pub free_gpus: u32,
    pub gpu_model: String,
    pub interconnect_class: String,
    pub numa_layout: String,
    pub verdict: String,
    pub verdict_reason: String,
    pub last_seen_ms: i64,
    pub preflight_report_id: u64,
    /// "operator" or "failures" while cordoned, "" otherwise.
    pub cordon_by: String,
    pub cordon_reason: String,
    pub cordoned_at_ms: i64,
}

/// `ctl preflight HOST -o json`: the report with its checks, in the agent's order.
#[derive(Debug, Serialize)]
pub struct PreflightJson {
    pub report_id: u64,
    pub local_id: String,
    pub agent_id: String,
    pub level: String,
    pub started_at_ms: i64,
    pub finished_at_ms: i64,
    pub verdict: String,
    pub interconnect_class: String,
    pub driver_version: String,
    pub cuda_version: String,
    pub nccl_version: String,
    pub source: String,
    pub topology: String,
    pub checks: Vec<CheckJson>,
}

#[derive(Debug, Serialize)]
pub struct CheckJson {
    pub id: String,
    pub status: String,
    pub measured: String,
    pub expected: String,
    pub remedy: String,
}

impl From<&NodeInfo> for NodeJson {
    fn from(n: &NodeInfo) -> Self {
        NodeJson {
            agent_id: n.agent_id.clone(),
            hostname: n.hostname.clone(),
            state: n.state.clone(),
            gpus: n.gpus,
            free_gpus: n.free_gpus,
            gpu_model: n.gpu_model.clone(),
            interconnect_class: n.interconnect_class.clone(),
            numa_layout: n.numa_layout.clone(),
            verdict: n.verdict.clone(),
            verdict_reason: n.verdict_reason.clone(),
            last_seen_ms: n.last_seen_ms,
            preflight_report_id: n.preflight_report_id,
            cordon_by: n.cordon_by.clone(),
            cordon_reason: n.cordon_reason.clone(),
            cordoned_at_ms: n.cordoned_at_ms,
        }
    }
}

impl From<&PreflightReport> for PreflightJson {
    fn from(r: &PreflightReport) -> Self {
        PreflightJson {
            report_id: r.report_id,
            local_id: r.local_id.clone(),
            agent_id: r.agent_id.clone(),
            level: r.level.clone(),
            started_at_ms: r.started_at_ms,
            finished_at_ms: r.finished_at_ms,
            verdict: r.verdict.clone(),
            interconnect_class: r.interconnect_class.clone(),
            driver_version: r.driver_version.clone(),
            cuda_version: r.cuda_version.clone(),
            nccl_version: r.nccl_version.clone(),
            source: r.source.clone(),
            topology: r.topology.clone(),
            checks: r.checks.iter().map(CheckJson::from).collect(),
        }
    }
}

impl From<&PreflightCheck> for CheckJson {
    fn from(c: &PreflightCheck) -> Self {
        CheckJson {
            id: c.id.clone(),
            status: c.status.clone(),
            measured: c.measured.clone(),
            expected: c.expected.clone(),
            remedy: c.remedy.clone(),
        }
    }
}

impl From<&Job> for JobJson {
    fn from(j: &Job) -> Self {
        JobJson {
            id: j.id,
            name: j.spec.as_ref().map(|s| s.name.clone()).unwrap_or_default(),
            user: j.user.clone(),
            run_as: j.run_as.clone(),
            state: j.state.clone(),
            reason: j.reason.clone(),
            attempt: j.attempt,
            created_at_ms: j.created_at_ms,
            updated_at_ms: j.updated_at_ms,
            receipts: j.receipts,
            spec: j.spec.as_ref().map(SpecJson::from),
            ranks: j.ranks.iter().map(RankJson::from).collect(),
            events: j.events.iter().map(EventJson::from).collect(),
            failures: j.failures.iter().map(FailureJson::from).collect(),
            predicted_comm_ms: j.predicted_comm_ms,
            measured_optimizer_ms: j.measured_optimizer_ms,
            warnings: j.warnings.clone(),
            waiting_reason: j.waiting_reason.clone(),
            slurm_job_id: j.slurm_job_id,
            goodput: j.goodput.as_ref().map(GoodputJson::from),
        }
    }
}

impl From<&JobSpec> for SpecJson {
    fn from(s: &JobSpec) -> Self {
        let resources = s.resources.as_ref().map_or_else(ResourcesJson::default, |r| ResourcesJson {
            gpus: r.gpus,
            gpus_per_node: r.gpus_per_node,
            gpu_model: r.gpu_model.clone(),
            min_gpu_memory_mib: r.min_gpu_memory_mib,
            interconnect: r.interconnect.clone(),
            memory_limit_mib: r.memory_limit_mib,
            max_processes: r.max_processes,
        });
        let restart = s.restart.as_ref().map_or_else(RestartJson::default, |r| RestartJson {
            max_restarts: r.max_restarts,
            resume: r.resume,
            backoff_initial_s: r.backoff_initial_s,
            backoff_factor: r.backoff_factor,
            backoff_cap_s: r.backoff_cap_s,
            hang_timeout_s: r.hang_timeout_s,
            hang_factor: r.hang_factor,
            checkpoint_signal: r.checkpoint_signal.clone(),
            min_gpus: r.min_gpus,
            host_wait_s: r.host_wait_s,
        });
        SpecJson {
            name: s.name.clone(),
            priority: s.priority,
            preflight: s.preflight.clone(),
            resources,
            engine: s.engine.as_ref().map(EngineJson::from),
            env: s.env.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            restart,
        }
    }
}

impl From<&Engine> for EngineJson {
    fn from(e: &Engine) -> Self {
        match e {
            Engine::Exec(x) => EngineJson::Exec {
                argv: x.argv.clone(),
                workdir: x.workdir.clone(),
                source_dir: x.source_dir.clone(),
            },
            Engine::Builtin(b) => EngineJson::Builtin {
                preset: b.preset.clone(),
                data: b.data.clone(),
                settings: b.settings.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            },
        }
    }
}

impl From<&RankStatus> for RankJson {
    fn from(r: &RankStatus) -> Self {
        RankJson {
            rank: r.rank,
            node_rank: r.node_rank,
            local_rank: r.local_rank,
            agent_id: r.agent_id.clone(),
            gpu_index: r.gpu_index,
            state: r.state.clone(),
            pid: r.pid,
            exit_code: r.exit_code,
            signal: r.signal,
            last_seq: r.last_seq,
            skipped_lines: r.skipped_lines,
            planned_cpus: r.planned_cpus.clone(),
            planned_mems: r.planned_mems.clone(),
            effective_cpus: r.effective_cpus.clone(),
            effective_mems: r.effective_mems.clone(),
        }
    }
}

impl From<&JobEvent> for EventJson {
    fn from(e: &JobEvent) -> Self {
        EventJson {
            at_ms: e.at_ms,
            from_state: e.from_state.clone(),
            to_state: e.to_state.clone(),
            reason: e.reason.clone(),
        }
    }
}

impl ReceiptJson {
    pub fn new(job_id: u64, r: &StoredReceipt) -> Self {
        let body =
            serde_json::from_str(&r.body).unwrap_or_else(|_| serde_json::Value::String(r.body.clone()));
        ReceiptJson {
            job_id,
            attempt: r.attempt,
            rank: r.rank,
            seq: r.seq,
            position: r.position,
            kind: r.kind.clone(),
            body,
        }
    }
}

/// Writes `text` to stdout, every terminal control in it shown as `\uXXXX` rather than acted
/// on (job names, argv and reasons are users' text). A reader that went away
/// (`ctl status | head`) is not an error.
pub fn print_out(text: &str) -> anyhow::Result<()> {
    use std::io::Write as _;
    let text = trainyard_model::text::printable(text);
    let mut stdout = std::io::stdout().lock();
    match stdout.write_all(text.as_bytes()).and_then(|()| stdout.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}

/// Pretty JSON for one value, for `status -o json`.
pub fn to_json<T: Serialize>(value: &T) -> anyhow::Result<String> {
    Ok(serde_json::to_string_pretty(value)? + "\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use trainyard_proto::v1::{ExecEngine, Resources};

    #[test]
    fn job_json_is_stable_and_named_like_the_proto() {
        let job = Job {
            id: 3,
            spec: Some(JobSpec {
                name: "demo".into(),
                resources: Some(Resources { gpus: 16, ..Default::default() }),
                engine: Some(Engine::Exec(ExecEngine {
                    argv: vec!["true".into()],
                    workdir: "/w".into(),
                    source_dir: String::new(),
                })),
                ..Default::default()
            }),
            state: "running".into(),
            ranks: vec![RankStatus { rank: 0, state: "running".into(), last_seq: -1, ..Default::default() }],
            ..Default::default()
        };
        let v = serde_json::to_value(JobJson::from(&job)).expect("serialize");
        assert_eq!(v["id"], 3);
        assert_eq!(v["name"], "demo");
        assert_eq!(v["spec"]["resources"]["gpus"], 16);
        assert_eq!(v["spec"]["engine"]["kind"], "exec");
        assert_eq!(v["spec"]["engine"]["workdir"], "/w");
        assert_eq!(v["ranks"][0]["last_seq"], -1);
    }

    #[test]
    fn preflight_json_keeps_checks_in_order() {
        let report = PreflightReport {
            report_id: 4,
            agent_id: "sxm-a".into(),
            verdict: "fail".into(),
            checks: vec![
                PreflightCheck { id: "host.shm".into(), status: "pass".into(), ..Default::default() },
                PreflightCheck { id: "cuda.init.gpu3".into(), status: "fail".into(), ..Default::default() },
            ],
            ..Default::default()
        };
        let v = serde_json::to_value(PreflightJson::from(&report)).expect("serialize");
        assert_eq!((v["report_id"].as_u64(), v["verdict"].as_str()), (Some(4), Some("fail")));
        assert_eq!(v["checks"][1]["id"], "cuda.init.gpu3");
        let node = NodeInfo { agent_id: "sxm-a".into(), free_gpus: 3, ..Default::default() };
        let v = serde_json::to_value(NodeJson::from(&node)).expect("serialize");
        assert_eq!((v["agent_id"].as_str(), v["free_gpus"].as_u64()), (Some("sxm-a"), Some(3)));
    }

    #[test]
    fn receipt_body_is_embedded_as_json() {
        let r = StoredReceipt {
            position: 9,
            attempt: 1,
            rank: 2,
            seq: 4,
            kind: "step".into(),
            body: r#"{"kind":"step","step":3,"loss":2.5}"#.into(),
        };
        let v = serde_json::to_value(ReceiptJson::new(5, &r)).expect("serialize");
        assert_eq!(v["job_id"], 5);
        assert_eq!(v["body"]["loss"], 2.5);
    }
}
