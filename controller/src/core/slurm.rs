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

/// Tells each connected agent whose job has ended (or is unknown to this controller) that its
/// work is done, once.
pub(super) fn dismiss_ended(core: &mut Core) {
    let ended: Vec<(String, JobId, String)> = core
        .agents
        .values()
        .filter(|e| e.link.is_some() && !e.dismissed)
        .filter_map(|e| {
            let job = e.bound?;
            let reason = match core.jobs.get(&job) {
                Some(j) if !j.record().state.is_terminal() => return None,
                Some(j) => format!("job {job} {}: {}", j.record().state, j.record().reason),
                None => format!("job {job} is not active on this controller"),
            };
            Some((e.record.agent_id.clone(), job, reason))
        })
        .collect();
    for (agent_id, job, reason) in ended {
        tracing::info!(agent_id, job_id = job, reason, "dismissing the agent of an ended Slurm job");
        super::launch::try_send(core, &agent_id, Msg::Dismiss(Dismiss { reason }));
        if let Some(e) = core.agents.get_mut(&agent_id) {
            e.dismissed = true;
        }
    }
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
    let Some(reason) = ending(agent_id, job, state) else { return false };
    let Some(active) = core.jobs.get_mut(&job).filter(|j| !j.record().state.is_terminal()) else {
        return false;
    };
    tracing::info!(job_id = job, agent_id, state, "the Slurm job was cancelled; cancelling the job");
    active.cancel.get_or_insert(reason);
    core.dirty.insert(job);
    true
}

/// The reason a job is cancelled for when its allocation's agent saw Slurm end it with
/// `state`; `None` when Slurm, not the user, ended it.
fn ending(agent_id: &str, job: JobId, state: &str) -> Option<String> {
    match Ending::of(state) {
        Ending::Cancelled => Some(format!(
            "cancelled in Slurm (scancel): the allocation's agent {agent_id} saw Slurm job state {state}"
        )),
        Ending::BySlurm => {
            tracing::warn!(agent_id, job_id = job, state, "Slurm is ending the allocation");
            None
        }
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
        assert!(ending("j1-n0", 1, "CANCELLED by 65534").is_some_and(|r| r.contains("scancel")));
        assert_eq!(ending("j1-n0", 1, "TIMEOUT"), None);
    }
}
