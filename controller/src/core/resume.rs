//! Where a restarted attempt resumes from: the newest checkpoints that every rank of an earlier
//! attempt reported, sent with its launches (`Launch.resume_from`). The agent hands the ranks the
//! newest one whose files exist on its host (`TRAINYARD_RESUME_STEP`, `TRAINYARD_RESUME_PATH`), so
//! a checkpoint only some ranks finished is never resumed from.

use std::collections::{BTreeMap, BTreeSet};

use trainyard_proto::v1::ResumePoint;
use trainyard_store::{JobId, JobSpec, Store, StoredReceiptRecord};

use super::Result;

/// Resume points sent with a launch, at most.
const POINTS: usize = 4;

/// The resume points of `job`, newest first; none when its spec does not resume.
pub(super) async fn points_of(store: &dyn Store, job: JobId, spec: &JobSpec) -> Result<Vec<ResumePoint>> {
    if !spec.resume {
        return Ok(Vec::new());
    }
    let limit = (spec.resources.gpus.max(1) as usize * POINTS * 2 + 16).min(20_000) as u32;
    let receipts = store.checkpoint_receipts(job, limit).await?;
    // Each attempt's own world size: a restart may have run on fewer GPUs (`min_gpus`).
    let mut worlds = BTreeMap::new();
    for attempt in receipts.iter().map(|r| r.id.attempt).collect::<BTreeSet<u32>>() {
        let ranks = store.allocations(job, attempt).await?.len() as u32;
        worlds.insert(attempt, ranks.max(1));
    }
    Ok(complete(&receipts, |attempt| worlds.get(&attempt).copied().unwrap_or(spec.resources.gpus)))
}

/// The checkpoints (attempt, step) for which every rank of the attempt (`world` of it) wrote a
/// receipt, newest step first, with the path rank 0's receipt named.
fn complete(receipts: &[StoredReceiptRecord], world: impl Fn(u32) -> u32) -> Vec<ResumePoint> {
    let mut seen: BTreeMap<(i64, u32), (BTreeSet<u32>, Option<String>)> = BTreeMap::new();
    for r in receipts {
        let Some(step) = r.step else { continue };
        let entry = seen.entry((step, r.id.attempt)).or_default();
        entry.0.insert(r.id.rank);
        if r.id.rank == 0 {
            let body: serde_json::Value = serde_json::from_str(&r.body).unwrap_or_default();
            entry.1 = body.get("path").and_then(|p| p.as_str()).map(str::to_string);
        }
    }
    seen.into_iter()
        .rev()
        .filter(|((_, attempt), (ranks, path))| ranks.len() as u32 >= world(*attempt) && path.is_some())
        .map(|((step, _), (_, path))| ResumePoint { step, path: path.unwrap_or_default() })
        .take(POINTS)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use trainyard_store::RankId;

    fn ckpt(attempt: u32, rank: u32, step: i64) -> StoredReceiptRecord {
        StoredReceiptRecord {
            position: 0,
            id: RankId { job_id: 1, attempt, rank },
            seq: 0,
            kind: "checkpoint".into(),
            step: Some(step),
            body: format!(r#"{{"kind":"checkpoint","step":{step},"path":"/ckpt/step_{step}/rank{rank}"}}"#),
        }
    }

    #[test]
    fn only_checkpoints_every_rank_wrote_are_resume_points_newest_first() {
        let receipts = [
            ckpt(0, 0, 10),
            ckpt(0, 1, 10),
            ckpt(0, 0, 20),
            ckpt(0, 1, 20),
            // Attempt 0 died while writing step 30: rank 1 never finished it.
            ckpt(0, 0, 30),
            ckpt(1, 0, 40),
            ckpt(1, 1, 40),
        ];
        let points = complete(&receipts, |_| 2);
        let steps: Vec<i64> = points.iter().map(|p| p.step).collect();
        assert_eq!(steps, [40, 20, 10]);
        assert_eq!(points[0].path, "/ckpt/step_40/rank0");
        assert!(complete(&receipts[..1], |_| 2).is_empty());
        // Attempt 1 ran on one GPU: its lone rank's checkpoint is complete.
        let small = [ckpt(1, 0, 50)];
        assert_eq!(complete(&small, |a| if a == 1 { 1 } else { 2 })[0].step, 50);
    }
}
