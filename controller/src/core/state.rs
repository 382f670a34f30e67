//! What the core holds only in memory, rebuilt at start-up from the store and the agents'
//! hellos: each agent's entry (its record, stream, preflight verdict and liveness), each active
//! job's (its record, allocations and the reconciler's bookkeeping), and the rank predicates
//! every part asks.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use tokio::sync::mpsc;
use tokio::time::Instant;
use trainyard_proto::v1::ControllerMessage;
use trainyard_store::{AgentRecord, Allocation, JobId, PreflightRecord, RankState, Snapshot};

use super::Result;
use super::reconcile::ActiveJob;

/// The in-memory state behind the core's lock (see `controller`).
#[derive(Default)]
pub(super) struct Core {
    pub(super) agents: HashMap<String, AgentEntry>,
    /// Jobs that are not finished, plus finished ones whose ranks have not all stopped yet.
    pub(super) jobs: BTreeMap<JobId, ActiveJob>,
    pub(super) next_conn_id: u64,
    /// Why each pending job waits, from the latest scheduling pass (`Job.waiting_reason`).
    pub(super) waiting: HashMap<JobId, String>,
    /// Jobs the reconciler should look at on its next pass.
    pub(super) dirty: std::collections::BTreeSet<JobId>,
    /// Ended jobs whose goodput and findings are still to be recorded (off the reconciler's path).
    pub(super) ended: Vec<JobId>,
    /// When each node was blamed for a failure, within the blame window (cordons).
    pub(super) blames: HashMap<String, Vec<i64>>,
    /// Agents gone past the timeout whose jobs keep stepping: the verdict waits (`liveness`).
    pub(super) holding: std::collections::BTreeSet<String>,
    /// Cordons decided under the lock, to be written to the store after it.
    pub(super) cordons_to_store: Vec<(String, Option<trainyard_store::Cordon>)>,
    /// Whether the fleet could ever hold a job of this shape (`launch::shape_of`), as a submit
    /// asks: answered once per shape until an agent's inventory or preflight changes
    /// ([`Core::fleet_changed`]).
    pub(super) feasible: HashMap<String, Result<(), String>>,
    /// Bumped by [`Core::fleet_changed`]: a feasibility answer computed outside the lock is
    /// kept only if the fleet did not change meanwhile.
    pub(super) fleet_generation: u64,
    /// The group's cluster id, in the run directory names launches carry (`keys::run_name`).
    pub(super) cluster_id: String,
}

pub(super) struct AgentEntry {
    pub(super) record: AgentRecord,
    pub(super) link: Option<AgentLink>,
    /// The agent announced it is stopping: no new work goes there.
    pub(super) leaving: bool,
    /// When the link went away (or the controller started without one).
    pub(super) disconnected_since: Option<Instant>,
    /// The agent's latest preflight report (from its hello or a re-run), if any.
    pub(super) preflight: Option<trainyard_store::PreflightRecord>,
    /// Its stream is open but it has sent nothing for `unresponsive_after`: no new work.
    pub(super) unresponsive: bool,
    /// It said hello since this controller started (until then the reconnect grace applies).
    pub(super) seen_since_start: bool,
    /// Its inventory's link matrix, parsed once: every scheduling pass shares it.
    pub(super) links: Arc<trainyard_placement::scheduler::LinkMatrix>,
    /// The `[slurm]` job it joined for, with that job's join token (docs/slurm.md): it takes
    /// that job's ranks alone, and that job goes on no other agent.
    pub(super) bound: Option<JobId>,
    /// It was told its job ended (`Dismiss`), so it stops and its allocation is freed.
    pub(super) dismissed: bool,
}

/// The send side of an agent's stream.
pub(super) struct AgentLink {
    pub(super) conn_id: u64,
    pub(super) tx: mpsc::Sender<ControllerMessage>,
}

/// An agent's link matrix, parsed from its inventory.
pub(super) fn link_matrix(record: &AgentRecord) -> Arc<trainyard_placement::scheduler::LinkMatrix> {
    let inv = &record.inventory;
    Arc::new(trainyard_placement::scheduler::LinkMatrix::parse(&inv.links, inv.gpus.len()))
}

impl Core {
    /// An agent joined, or its inventory or preflight verdict changed: what a submit's
    /// feasibility check read is stale.
    pub(super) fn fleet_changed(&mut self) {
        self.feasible.clear();
        self.fleet_generation += 1;
    }

    /// The jobs and agents the store holds (`snapshot`), agents counted disconnected since
    /// `now` (until they say hello), with their latest preflight verdicts (`preflights`: a node
    /// that failed stays unscheduled until it reports again).
    pub(super) fn from_stored(snapshot: Snapshot, preflights: Vec<PreflightRecord>, now: Instant) -> Core {
        let mut core = Core::default();
        for record in snapshot.agents {
            let links = link_matrix(&record);
            let entry = AgentEntry {
                record,
                link: None,
                leaving: false,
                disconnected_since: Some(now),
                preflight: None,
                unresponsive: false,
                seen_since_start: false,
                links,
                bound: None,
                dismissed: false,
            };
            core.agents.insert(entry.record.agent_id.clone(), entry);
        }
        for report in preflights {
            if let Some(entry) = core.agents.get_mut(&report.agent_id) {
                entry.preflight = Some(report);
            }
        }
        for record in snapshot.active_jobs {
            core.jobs.insert(record.id, ActiveJob::new(record));
        }
        for alloc in snapshot.allocations {
            if let Some(job) = core.jobs.get_mut(&alloc.id.job_id) {
                job.allocations.push(alloc);
            }
        }
        for job in core.jobs.values_mut() {
            job.allocations.sort_by_key(|a| a.id.rank);
        }
        core
    }
}

/// A rank is done when it exited or was lost.
pub(super) fn rank_done(a: &Allocation) -> bool {
    a.observed.state.is_done()
}

/// Why a rank failed, or `None` if it has not failed.
pub(super) fn rank_failure(a: &Allocation) -> Option<String> {
    let o = &a.observed;
    let on = format!("rank {} on {}", a.id.rank, a.agent_id);
    match o.state {
        RankState::Lost if o.message.is_empty() => Some(format!("{on} was lost")),
        RankState::Lost => Some(format!("{on} was lost: {}", o.message)),
        RankState::Exited => match (o.exit_code, o.signal) {
            (Some(0), _) => None,
            (Some(code), _) if o.message.is_empty() => Some(format!("{on} exited with code {code}")),
            // A launch the agent refused or could not spawn says why (exit code 127).
            (Some(code), _) => Some(format!("{on} exited with code {code}: {}", o.message)),
            (None, Some(sig)) => Some(format!("{on} was killed by signal {sig}")),
            (None, None) if o.message.is_empty() => Some(format!("{on} ended without an exit status")),
            (None, None) => Some(format!("{on} ended: {}", o.message)),
        },
        _ => None,
    }
}

#[cfg(test)]
mod tests;
