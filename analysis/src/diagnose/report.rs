//! What a diagnosis answers: findings with their evidence, each node's pace, the verdict.

use trainyard_model::domain::Cause;
use trainyard_proto::v1 as pb;

use super::stragglers::RankScore;

/// A number behind a finding.
#[derive(Debug, Clone, PartialEq)]
pub struct Measure {
    pub name: String,
    pub value: f64,
    pub unit: &'static str,
}

pub(super) fn measure(name: impl Into<String>, value: f64, unit: &'static str) -> Measure {
    Measure { name: name.into(), value, unit }
}

/// A likely cause, where it is, the numbers behind it, what it costs and what to do.
#[derive(Debug, Clone, PartialEq)]
pub struct Finding {
    pub cause: Cause,
    /// One line for people.
    pub summary: String,
    /// What it is about: `job`, a node, `node/gpuN`, or `ranks 3,5` (the live diagnosis keeps
    /// one open finding per job, cause and subject).
    pub subject: String,
    /// The steps it concerns, where a rule knows them (a GPU condition's windows): a plot's band.
    pub steps: Option<(i64, i64)>,
    pub nodes: Vec<String>,
    pub ranks: Vec<u32>,
    pub evidence: Vec<Measure>,
    pub expected_cost: &'static str,
    pub remedy: String,
}

/// The job's ranks on one node, with their pace.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeSummary {
    pub agent_id: String,
    pub ranks: Vec<u32>,
    /// Median over its ranks of their median measured time, ms; `None` without samples.
    pub median_ms: Option<f64>,
    /// `median_ms` over the fastest node's; `None` with fewer than two measured nodes.
    pub vs_fastest: Option<f64>,
    /// The job's GPUs on the node per NUMA node, "0:4 1:4" ("?" for unknown).
    pub numa_layout: String,
}

/// The answer of `ctl diagnose`.
#[derive(Debug, Clone, PartialEq)]
pub struct Diagnosis {
    pub attempt: u32,
    /// The time the scores compare: `fwd_bwd_ms` when every rank reports it (in synchronous
    /// training the fast ranks wait in collectives, so whole steps look alike), else
    /// `step_time_ms`.
    pub metric: &'static str,
    pub warmup_steps: i64,
    /// Step receipts the diagnosis used.
    pub samples_used: usize,
    pub ranks: Vec<RankScore>,
    pub nodes: Vec<NodeSummary>,
    pub findings: Vec<Finding>,
    /// What the diagnosis could not use, and why.
    pub unusable: Vec<String>,
    /// What it saw that explains nothing (a throttle on a GPU whose rank kept pace, a property
    /// the fast nodes share): said, not blamed.
    pub notes: Vec<String>,
    pub predicted_comm_ms: f64,
    /// Median optimizer step over all ranks (collectives included), ms.
    pub measured_optimizer_ms: Option<f64>,
    pub median_step_ms: Option<f64>,
    pub median_tokens_per_s: Option<f64>,
}

impl Diagnosis {
    /// One line: the first finding, or that the run is healthy.
    pub fn verdict(&self) -> String {
        match self.findings.first() {
            Some(f) if self.findings.len() == 1 => format!("{}: {}", f.cause, f.summary),
            Some(f) => {
                format!("{}: {} (and {} more finding(s))", f.cause, f.summary, self.findings.len() - 1)
            }
            None if self.samples_used == 0 => "no step receipts to judge yet".to_string(),
            None => format!(
                "healthy: no finding over {} step receipts of {} rank(s)",
                self.samples_used,
                self.ranks.len()
            ),
        }
    }

    /// The record on the wire, which `ctl -o json` and the web view serialise as it is: the
    /// verdict spelled out, and each rank with the node it ran on.
    pub fn message(&self, job_id: u64) -> pb::Diagnosis {
        let agent_of = |rank: u32| {
            self.nodes
                .iter()
                .find(|n| n.ranks.contains(&rank))
                .map(|n| n.agent_id.clone())
                .unwrap_or_default()
        };
        pb::Diagnosis {
            job_id,
            attempt: self.attempt,
            verdict: self.verdict(),
            healthy: self.findings.is_empty(),
            findings: self.findings.iter().map(pb::Finding::from).collect(),
            notes: self.notes.clone(),
            ranks: self
                .ranks
                .iter()
                .map(|r| pb::RankScore {
                    rank: r.rank,
                    agent_id: agent_of(r.rank),
                    steps: r.steps as u64,
                    median_ms: r.median_ms,
                    relative: r.relative,
                    individual: r.individual,
                    windows: r.windows as u32,
                    slow_windows: r.slow_windows as u32,
                    straggler: r.straggler,
                })
                .collect(),
            nodes: self
                .nodes
                .iter()
                .map(|n| pb::NodePace {
                    agent_id: n.agent_id.clone(),
                    ranks: n.ranks.clone(),
                    median_ms: n.median_ms,
                    vs_fastest: n.vs_fastest,
                    numa_layout: n.numa_layout.clone(),
                })
                .collect(),
            unusable: self.unusable.clone(),
            metric: self.metric.to_string(),
            warmup_steps: self.warmup_steps,
            samples_used: self.samples_used as u64,
            predicted_comm_ms: self.predicted_comm_ms,
            measured_optimizer_ms: self.measured_optimizer_ms,
            median_step_ms: self.median_step_ms,
            median_tokens_per_s: self.median_tokens_per_s,
        }
    }
}

impl From<&Finding> for pb::Finding {
    fn from(f: &Finding) -> pb::Finding {
        pb::Finding {
            cause: f.cause.to_string(),
            summary: f.summary.clone(),
            nodes: f.nodes.clone(),
            ranks: f.ranks.clone(),
            evidence: f
                .evidence
                .iter()
                .map(|m| pb::Measure { name: m.name.clone(), value: m.value, unit: m.unit.to_string() })
                .collect(),
            expected_cost: f.expected_cost.to_string(),
            remedy: f.remedy.clone(),
            subject: f.subject.clone(),
        }
    }
}
