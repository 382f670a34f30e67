//! `[slurm]` jobs (docs/slurm.md): each runs on the agents started inside its own Slurm
//! allocation, which joined with the job's token, and on no other; those agents take no other
//! job, and are dismissed when it ends, which ends their Slurm step and frees the nodes.
//!
//! The controller never talks to Slurm: `ctl`, as the user, submits and cancels the Slurm job and
//! tells the controller its id ([`submitted_event`]); the agents say how Slurm ended an
//! allocation when it does (their `Leaving`).

use trainyard_model::slurm::Ending;
use trainyard_placement::scheduler::{self, NodeView, Placement, Request};
use trainyard_proto::v1::controller_message::Msg;
use trainyard_proto::v1::{Dismiss, JobEvent};
use trainyard_store::JobId;

use super::state::Core;

/// The start of the event that records the Slurm job of a `[slurm]` job.
const SUBMITTED: &str = "allocation asked of Slurm as Slurm job ";

/// The event `ctl submit --slurm` leaves once `sbatch` accepted the allocation.
pub(super) fn submitted_event(slurm_job_id: u64, detail: &str) -> String {
    let detail: String = detail.chars().take(256).map(|c| if c.is_control() { ' ' } else { c }).collect();
    if detail.is_empty() {
        format!("{SUBMITTED}{slurm_job_id}")
    } else {
        format!("{SUBMITTED}{slurm_job_id} ({detail})")
    }
}

/// The Slurm job of a job, from its events (the newest such event).
pub(super) fn slurm_job_of(events: &[JobEvent]) -> u64 {
    events
        .iter()
        .rev()
        .find_map(|e| {
            let rest = e.reason.strip_prefix(SUBMITTED)?;
            rest.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
        })
        .unwrap_or(0)
}

/// Places each `[slurm]` job of `own` on the agents of its allocation (which `views` then holds
/// too, for the placements' pinning plans); a job that cannot start yet says why.
pub(super) fn place_in_allocations(
    core: &mut Core,
    own: &[Request],
    views: &mut Vec<NodeView>,
    placements: &mut Vec<Placement>,
) {
    for req in own {
        let mine = super::launch::views_of(core, false, Some(req.job_id));
        match scheduler::place(req, &mine) {
            Some(p) => {
                core.waiting.remove(&req.job_id);
                placements.push(p);
                views.extend(mine);
            }
            None => {
                let joined = mine.len();
                let nodes = req.gpus / req.gpus_per_node.max(1);
                let why = if joined == 0 {
                    "waiting for its Slurm allocation: no agent of it has joined yet (`ctl status` shows \
                     Slurm's reason)"
                        .to_string()
                } else {
                    let inner = scheduler::schedule(std::slice::from_ref(req), &mine).waiting;
                    let detail = inner.first().map(|(_, w)| w.clone()).unwrap_or_default();
                    format!(
                        "waiting for its Slurm allocation: {joined} of its {nodes} node(s) have joined ({detail})"
                    )
                };
                core.waiting.insert(req.job_id, why);
            }
        }
    }
}

/// Tells each connected agent of an allocation that its work is done, once: its job ended (or
/// is unknown to this controller), or its allocation nears its time limit (a Slurm warning, a
/// preemption notice to the controller) and the job was moved off it, when the agent requeues
/// the Slurm job if the job asks for that; a job that does not is cancelled, its newest
/// checkpoint kept.
pub(super) fn dismiss_ended(core: &mut Core) {
    let mut ending: Vec<(String, JobId, Dismiss)> = Vec::new();
    for e in core.agents.values().filter(|e| e.link.is_some() && !e.dismissed) {
        let Some(job) = e.bound else { continue };
        let dismiss = match core.jobs.get(&job) {
            None => Dismiss { reason: format!("job {job} is not active on this controller"), requeue: false },
            Some(j) if j.record().state.is_terminal() => Dismiss {
                reason: format!("job {job} {}: {}", j.record().state, j.record().reason),
                requeue: false,
            },
            Some(j) => {
                // Once every rank of the attempt stopped: the allocation ends as one.
                let warned = e.record.cordon.as_ref().is_some_and(|c| c.by == super::faults::BY_PREEMPTION);
                if !warned || !j.allocations.iter().all(super::state::rank_done) {
                    continue;
                }
                let requeue = j.record().spec.slurm.as_ref().is_some_and(|s| s.requeue);
                let reason = if requeue {
                    "the allocation nears its time limit: the Slurm job is requeued, and the job goes on in the                      new allocation from its newest checkpoint"
                } else {
                    "the Slurm allocation nears its time limit and the job asks for no requeue ([slurm] requeue =                      false): it ends here, its newest checkpoint kept"
                };
                Dismiss { reason: reason.to_string(), requeue }
            }
        };
        ending.push((e.record.agent_id.clone(), job, dismiss));
    }
    for (agent_id, job, dismiss) in ending {
        tracing::info!(agent_id, job_id = job, reason = %dismiss.reason, requeue = dismiss.requeue, "dismissing an agent of a Slurm allocation");
        if let Some(j) = core.jobs.get_mut(&job).filter(|j| !j.record().state.is_terminal())
            && !dismiss.requeue
        {
            j.cancel.get_or_insert_with(|| dismiss.reason.clone());
            core.dirty.insert(job);
        }
        super::launch::try_send(core, &agent_id, Msg::Dismiss(dismiss));
        if let Some(e) = core.agents.get_mut(&agent_id) {
            e.dismissed = true;
        }
    }
}

/// A preemption notice (the time-limit warning) from an agent of an allocation is the whole
/// allocation's: the other agents bound to the same job, to be cordoned with it.
pub(super) fn allocation_of(core: &Core, agent_id: &str) -> Vec<String> {
    let Some(job) = core.agents.get(agent_id).and_then(|e| e.bound) else { return Vec::new() };
    core.agents
        .values()
        .filter(|e| e.bound == Some(job) && e.record.agent_id != agent_id && e.record.cordon.is_none())
        .map(|e| e.record.agent_id.clone())
        .collect()
}

/// The unfinished ranks of a disconnected agent that left because Slurm ended its allocation:
/// they ended with it (an agent that merely lost its network is not one).
pub(super) fn ended_with_allocation(core: &Core, agent_id: &str) -> Vec<trainyard_store::RankId> {
    let Some(entry) = core.agents.get(agent_id) else { return Vec::new() };
    if entry.bound.is_none() || !entry.leaving || entry.link.is_some() {
        return Vec::new();
    }
    core.jobs
        .values()
        .flat_map(|j| &j.allocations)
        .filter(|a| a.agent_id == agent_id && !super::state::rank_done(a))
        .map(|a| a.id)
        .collect()
}

/// An agent of `[slurm]` job `job` says Slurm is ending its allocation with `state`: when the
/// user cancelled the Slurm job, the job is marked to be cancelled (true).
pub(super) fn cancel_for(core: &mut Core, agent_id: &str, job: JobId, state: &str) -> bool {
    // An allocation trainyard ends itself (a dismissed agent of it still connected: the job
    // moved on, ended, or is requeued) is no user's cancel; the agents of an allocation that
    // ended before (requeued) are gone, and a scancel of the new one counts.
    if core.agents.values().any(|e| e.bound == Some(job) && e.dismissed && e.link.is_some()) {
        return false;
    }
    let Some(active) = core.jobs.get_mut(&job).filter(|j| !j.record().state.is_terminal()) else {
        return false;
    };
    let requeue = active.record().spec.slurm.as_ref().is_some_and(|s| s.requeue);
    let Some(reason) = ending(agent_id, job, state, requeue) else { return false };
    tracing::info!(job_id = job, agent_id, state, "Slurm ended the allocation; the job ends with it");
    active.cancel.get_or_insert(reason);
    core.dirty.insert(job);
    true
}

/// The reason a job is cancelled for when its allocation's agent saw Slurm end it with
/// `state`; `None` when Slurm ended it and requeues the job (`requeue`): its agents join again
/// from the new allocation.
fn ending(agent_id: &str, job: JobId, state: &str, requeue: bool) -> Option<String> {
    match Ending::of(state) {
        Ending::Cancelled => Some(format!(
            "cancelled in Slurm (scancel): the allocation's agent {agent_id} saw Slurm job state {state}"
        )),
        Ending::BySlurm if requeue => {
            tracing::warn!(
                agent_id,
                job_id = job,
                state,
                "Slurm is ending the allocation; it requeues the job"
            );
            None
        }
        Ending::BySlurm => Some(format!(
            "Slurm ended the allocation ({state}, seen by its agent {agent_id}) and the job asks for no requeue \
             ([slurm] requeue = false): it ends here, its newest checkpoint kept"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_slurm_job_is_read_back_from_the_newest_event() {
        let event = |reason: String| JobEvent { reason, ..Default::default() };
        assert_eq!(slurm_job_of(&[]), 0);
        let events = vec![
            event("submitted".into()),
            event(submitted_event(41, "partition debug, 2 nodes")),
            event(submitted_event(52, "")),
            event("scheduled".into()),
        ];
        assert_eq!(slurm_job_of(&events), 52);
        assert_eq!(submitted_event(7, "a\nb"), "allocation asked of Slurm as Slurm job 7 (a b)");
        assert!(ending("j1-n0", 1, "CANCELLED by 65534", true).is_some_and(|r| r.contains("scancel")));
        assert_eq!(ending("j1-n0", 1, "NODE_FAIL", true), None, "Slurm requeues it");
        assert!(ending("j1-n0", 1, "TIMEOUT", false).is_some_and(|r| r.contains("requeue = false")));
    }
}
