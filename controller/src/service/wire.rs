//! The wire form of what the analysis concludes: diagnoses, comparisons, live findings.

use trainyard_proto::v1::{Comparison, Diagnosis};

/// The wire form of a diagnosis.
pub(super) fn diagnosis_message(job_id: u64, d: &trainyard_analysis::diagnose::Diagnosis) -> Diagnosis {
    use trainyard_proto::v1 as pb;
    let agent_of = |rank: u32| {
        d.nodes.iter().find(|n| n.ranks.contains(&rank)).map(|n| n.agent_id.clone()).unwrap_or_default()
    };
    Diagnosis {
        job_id,
        attempt: d.attempt,
        verdict: d.verdict(),
        healthy: d.findings.is_empty(),
        findings: d
            .findings
            .iter()
            .map(|f| pb::Finding {
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
            })
            .collect(),
        notes: d.notes.clone(),
        ranks: d
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
        nodes: d
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
        unusable: d.unusable.clone(),
        metric: d.metric.to_string(),
        warmup_steps: d.warmup_steps,
        samples_used: d.samples_used as u64,
        predicted_comm_ms: d.predicted_comm_ms,
        measured_optimizer_ms: d.measured_optimizer_ms,
        median_step_ms: d.median_step_ms,
        median_tokens_per_s: d.median_tokens_per_s,
    }
}

/// The wire form of a comparison.
pub(super) fn comparison_message(c: &trainyard_analysis::diagnose::compare::Comparison) -> Comparison {
    use trainyard_analysis::diagnose::compare::{Diff, Distribution, Side};
    use trainyard_proto::v1 as pb;
    let dist = |d: &Option<Distribution>| {
        d.map(|d| pb::Distribution { n: d.n as u64, p10: d.p10, p50: d.p50, p90: d.p90 })
    };
    let side = |s: &Side| pb::JobSide {
        job_id: s.job_id,
        name: s.name.clone(),
        state: s.state.clone(),
        attempt: s.attempt,
        provenance: s.provenance.clone().into_iter().collect(),
        nodes: s
            .nodes
            .iter()
            .map(|n| pb::PlacedNode {
                agent_id: n.agent_id.clone(),
                ranks: n.ranks,
                numa_layout: n.numa_layout.clone(),
                interconnect_class: n.class.map(|c| c.to_string()).unwrap_or_default(),
                verdict: n.verdict.map(|v| v.to_string()).unwrap_or_default(),
                problems: n.problems.clone(),
            })
            .collect(),
        step_time_ms: dist(&s.step_time_ms),
        tokens_per_s: dist(&s.tokens_per_s),
        diagnosis: Some(diagnosis_message(s.job_id, &s.diagnosis)),
    };
    let diffs = |d: &[Diff]| -> Vec<pb::Difference> {
        d.iter().map(|d| pb::Difference { name: d.name.clone(), a: d.a.clone(), b: d.b.clone() }).collect()
    };
    Comparison {
        a: Some(side(&c.a)),
        b: Some(side(&c.b)),
        env: diffs(&c.env),
        provenance: diffs(&c.provenance),
        step_time_ratio: c.step_time_ratio,
        differences: c.differences.clone(),
        verdict: c.verdict.clone(),
    }
}

/// The wire form of a live finding.
pub(super) fn live_finding_message(f: &trainyard_store::LiveFinding) -> trainyard_proto::v1::LiveFinding {
    trainyard_proto::v1::LiveFinding {
        id: f.id,
        job_id: f.job_id,
        attempt: f.attempt,
        cause: f.cause.clone(),
        subject: f.subject.clone(),
        nodes: f.nodes.clone(),
        ranks: f.ranks.clone(),
        summary: f.summary.clone(),
        evidence: f.evidence.clone(),
        remedy: f.remedy.clone(),
        opened_at_ms: f.opened_at_ms,
        updated_at_ms: f.updated_at_ms,
        closed_at_ms: f.closed_at_ms.unwrap_or(0),
        first_step: f.first_step.unwrap_or(-1),
        last_step: f.last_step.unwrap_or(-1),
    }
}
