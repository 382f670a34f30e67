//! The wire form of what the store keeps of the live diagnosis (a diagnosis and a comparison
//! cross the wire in the analysis crate, beside their types).

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
