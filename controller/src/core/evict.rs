//! Drains and preemption notices: checkpoint first, then move the job without the node.
//!
//! `ctl drain NODE` and an agent's preemption notice cordon the node and ask every job running
//! there to checkpoint now (`CheckpointNow` to each of its hosts: a request file for every rank,
//! and the job's checkpoint signal if it names one). The job moves once every live rank has
//! written a checkpoint receipt since the request, or at the deadline, whichever comes first:
//! its ranks are stopped and it is requeued (not counted against `max_restarts`), resuming from
//! the newest complete checkpoint; the cordon keeps the node out of its next attempt. A notice
//! that arrives during a drain shortens the deadline; one that arrives while a job restarts
//! only cordons the node, so the next attempt avoids it.
//!
//! Priority preemption takes the same path: when a job waits and running jobs of a priority at
//! least `preempt_gap` lower hold GPUs that would let it run, the fewest such jobs (lowest
//! priority first) are asked to checkpoint and are requeued; the waiting job, ahead in priority
//! order, gets their GPUs. Waiting jobs age (`age_every`), so a low-priority job is never
//! starved for good. The victim's failure names who preempted it, and the waiting job says whom
//! it preempts.

use std::time::Duration;

use tokio::time::Instant;
use trainyard_placement::scheduler::{self, NodeView, Request};
use trainyard_proto::v1::{CheckpointNow, controller_message::Msg};
use trainyard_store::{FailureKind, FailureRecord, JobId, JobState};

use super::reconcile::ActiveJob;
use super::reconcile::Eviction;
use super::state::{Core, rank_done};
use super::steps::StepWatches;
use crate::config::ControllerConfig;

/// The deadline of a drain that names none, and of a notice that carries none.
pub const DEFAULT_DRAIN_DEADLINE: Duration = Duration::from_secs(120);
pub const DEFAULT_NOTICE_DEADLINE: Duration = Duration::from_secs(30);
/// Stop a moment before the host goes away, so the stop itself is not cut off.
pub(super) const NOTICE_MARGIN: Duration = Duration::from_secs(2);

/// After a scheduling pass: the first waiting job (in `queue`'s priority order) that the
/// GPUs of lower-priority running jobs would let run preempts the fewest of them. One
/// preemption at a time: none starts while another is still checkpointing.
pub(super) fn preempt(core: &mut Core, config: &ControllerConfig, queue: &[Request], views: &[NodeView]) {
    let gap = config.preempt_gap;
    let preempting: Vec<(JobId, JobId)> = core
        .jobs
        .values()
        .filter_map(|j| j.eviction.as_ref().and_then(|e| e.for_job).map(|p| (p, j.record().id)))
        .collect();
    if !preempting.is_empty() {
        for (preemptor, victim) in preempting {
            let why = format!("preempting job {victim} (checkpointing, then requeued)");
            core.waiting.insert(preemptor, why);
        }
        return;
    }
    if gap <= 0 {
        return;
    }
    let mut order: Vec<&Request> = queue.iter().filter(|r| core.waiting.contains_key(&r.job_id)).collect();
    order.sort_by_key(|r| (std::cmp::Reverse(r.priority), r.job_id));
    for req in order {
        let Some(base_priority) = core.jobs.get(&req.job_id).map(|j| j.record().spec.priority) else {
            continue;
        };
        let mut candidates: Vec<&ActiveJob> = core
            .jobs
            .values()
            .filter(|j| j.record().state == JobState::Running && j.eviction.is_none())
            // The job's own priority, not its aged one: aging orders the queue, and must not
            // let jobs of equal priority take turns preempting each other.
            .filter(|j| j.record().spec.priority.saturating_add(gap) <= base_priority)
            .collect();
        candidates.sort_by_key(|j| (j.record().spec.priority, std::cmp::Reverse(j.record().id)));
        let Some(victims) = fewest_victims(req, views, &candidates) else { continue };
        let names: Vec<String> = victims.iter().map(|v| format!("job {v}")).collect();
        let reasons: Vec<(JobId, String)> = victims
            .iter()
            .filter_map(|v| core.jobs.get(v).map(|j| (*v, j.record().spec.priority)))
            .map(|(v, p)| {
                let why = format!(
                    "preempted by job {} (priority {base_priority} against {p}, at least {gap} apart)",
                    req.job_id
                );
                (v, why)
            })
            .collect();
        for (victim, reason) in reasons {
            ask_to_move(core, victim, FailureKind::Preempted, "", config.preempt_deadline, &reason);
            if let Some(e) = core.jobs.get_mut(&victim).and_then(|j| j.eviction.as_mut()) {
                e.for_job = Some(req.job_id);
            }
        }
        tracing::warn!(job_id = req.job_id, victims = %names.join(", "), "priority preemption");
        let waiting = format!("preempting {} (checkpointing, then requeued)", names.join(", "));
        core.waiting.insert(req.job_id, waiting);
        return;
    }
}

/// Asks every placed job with a live rank on `node` to checkpoint now; keeps the earlier
/// deadline when a job is already being moved.
pub(super) fn evict(
    core: &mut Core,
    node: &str,
    kind: FailureKind,
    within: Duration,
    why: &str,
) -> Vec<JobId> {
    let placed = |j: &ActiveJob| {
        matches!(j.record().state, JobState::Scheduled | JobState::Launching | JobState::Running)
    };
    let ids: Vec<JobId> = core
        .jobs
        .values()
        .filter(|j| placed(j) && j.allocations.iter().any(|a| a.agent_id == node && !rank_done(a)))
        .map(|j| j.record().id)
        .collect();
    for id in &ids {
        ask_to_move(core, *id, kind, node, within, why);
    }
    ids
}

/// Asks one job to checkpoint now and move (off `node`, or off everything when it is
/// empty) within `within`; a job already moving keeps the earlier deadline.
fn ask_to_move(core: &mut Core, id: JobId, kind: FailureKind, node: &str, within: Duration, why: &str) {
    let now = Instant::now();
    let Some(job) = core.jobs.get_mut(&id) else { return };
    let deadline = now + within;
    match &mut job.eviction {
        Some(e) if e.deadline <= deadline => return,
        Some(e) => e.deadline = deadline,
        None => {
            let (node, why) = (node.to_string(), why.to_string());
            job.eviction = Some(Eviction { kind, node, why, asked: now, deadline, for_job: None });
        }
    }
    let attempt = job.record().attempt;
    let signal = job.record().spec.checkpoint_signal.clone();
    let hosts: std::collections::BTreeSet<String> =
        job.allocations.iter().map(|a| a.agent_id.clone()).collect();
    for host in hosts {
        let (reason, signal) = (why.to_string(), signal.clone());
        super::launch::send(
            &mut *core,
            &host,
            Msg::CheckpointNow(CheckpointNow { job_id: id, attempt, reason, signal }),
        );
    }
    core.dirty.insert(id);
}

/// Every 500 ms: a job being moved goes once each live rank wrote a checkpoint receipt since
/// the request, or at its deadline, or at once when it is not running yet (nothing to save).
pub(super) fn check_evictions(core: &mut Core, steps: &StepWatches, now_ms: i64) {
    let now = Instant::now();
    let steps = steps.read();
    let mut done = Vec::new();
    for job in core.jobs.values().filter(|j| j.detected.is_none()) {
        let Some(e) = &job.eviction else { continue };
        let live: Vec<u32> = job.allocations.iter().filter(|a| !rank_done(a)).map(|a| a.id.rank).collect();
        let watch = steps.get(&job.record().id);
        let saved = watch.and_then(|w| w.checkpoint_since(job.record().attempt, e.asked, &live));
        let waited = now.saturating_duration_since(e.asked).as_secs_f64();
        let evidence = match (saved, job.record().state) {
            (Some(step), _) => {
                format!("{}; every rank checkpointed at step {step} {waited:.1} s after the request", e.why)
            }
            (None, JobState::Running) if now >= e.deadline => format!(
                "{}; no checkpoint from every rank within {waited:.0} s, the deadline: it resumes from its newest complete one",
                e.why
            ),
            (None, JobState::Running) => continue,
            (None, _) => format!("{}; it had not started running, so there was nothing to save", e.why),
        };
        done.push(e.failure((job.record().id, job.record().attempt), now_ms, evidence));
    }
    drop(steps);
    for f in done {
        tracing::info!(job_id = f.job_id, evidence = %f.evidence, "moving a job off a node");
        core.dirty.insert(f.job_id);
        if let Some(job) = core.jobs.get_mut(&f.job_id) {
            job.detected = Some(f);
        }
    }
}

/// The failure of a job being moved whose ranks ended before it moved (a rank that does not
/// handle the checkpoint signal, a host that went away first): still the move, not the job's.
pub(super) fn moved_anyway(job: &ActiveJob, now_ms: i64) -> Option<FailureRecord> {
    let e = job.eviction.as_ref()?;
    Some(e.failure(
        (job.record().id, job.record().attempt),
        now_ms,
        format!("{}; its ranks ended while it was being moved", e.why),
    ))
}

/// The fewest of `candidates` (tried in their order) whose GPUs, freed, let `req` be placed on
/// `views`; `None` when even all of them would not.
fn fewest_victims(req: &Request, views: &[NodeView], candidates: &[&ActiveJob]) -> Option<Vec<JobId>> {
    let freed = |chosen: &[&ActiveJob]| {
        let mut v = views.to_vec();
        for job in chosen {
            for a in job.allocations.iter().filter(|a| !rank_done(a)) {
                let node = v.iter_mut().find(|n| n.agent_id == a.agent_id);
                if let Some(g) = node.and_then(|n| n.gpus.iter_mut().find(|g| g.index == a.gpu_index)) {
                    g.free = true;
                }
            }
        }
        v
    };
    let mut chosen: Vec<&ActiveJob> = Vec::new();
    for c in candidates {
        chosen.push(c);
        if scheduler::place(req, &freed(&chosen)).is_none() {
            continue;
        }
        // Leave out every one the placement does not need.
        let mut i = 0;
        while i < chosen.len() {
            let mut without = chosen.clone();
            without.remove(i);
            if scheduler::place(req, &freed(&without)).is_some() {
                chosen = without;
            } else {
                i += 1;
            }
        }
        return Some(chosen.iter().map(|j| j.record().id).collect());
    }
    None
}
