//! What the core holds only in memory, rebuilt at start-up from the store and the agents'
//! hellos: each agent's entry (its record, stream, preflight verdict and liveness), each active
//! job's (its record, allocations and the reconciler's bookkeeping), and the rank predicates
//! every part asks.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use tokio::sync::mpsc;
use tokio::time::Instant;
use trainyard_proto::v1::ControllerMessage;
use trainyard_store::{
    AgentRecord, Allocation, FailureKind, FailureRecord, JobId, JobRecord, RankState, Store,
};

use super::Result;

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
}

/// The send side of an agent's stream.
pub(super) struct AgentLink {
    pub(super) conn_id: u64,
    pub(super) tx: mpsc::Sender<ControllerMessage>,
}

pub(super) struct ActiveJob {
    pub(super) record: JobRecord,
    /// An operator asked to cancel it, with this reason; the reconciler carries it out.
    pub(super) cancel: Option<String>,
    /// How many agents the launches of the current attempt went out to (the reconciler moves a
    /// `scheduled` job to `launching` once it is not 0).
    pub(super) launches_sent: usize,
    /// Allocations of the current attempt; empty while pending.
    pub(super) allocations: Vec<Allocation>,
    /// `MASTER_PORT` of the current attempt, as its rank-0 agent chose it and reported it in a
    /// rank report; `None` until then (and after a controller restart, until the agents' hellos
    /// report it again). The hosts without rank 0 are launched once it is known.
    pub(super) master_port: Option<u16>,
    /// A failure found outside the ranks' own reports (a hang), for the reconciler to act on.
    pub(super) detected: Option<trainyard_store::FailureRecord>,
    /// Nodes blamed for this job's failures, with when: left out of its next attempts until
    /// they pass a preflight.
    pub(super) avoid: BTreeMap<String, i64>,
    /// Restarts charged against `max_restarts` so far (the job's own failures).
    pub(super) charged: u32,
    /// The next attempt is not placed before this (the restart backoff).
    pub(super) not_before: Option<Instant>,
    /// The checkpoints the current attempt may resume from, newest first (`resume`).
    pub(super) resume_from: Vec<trainyard_proto::v1::ResumePoint>,
    /// Asked to checkpoint and move off a node (`evict`).
    pub(super) eviction: Option<Eviction>,
    /// Failures in a row of attempts that did not run for long: the backoff's exponent
    /// (`faults::next_streak`).
    pub(super) streak: u32,
    /// When the current attempt started running.
    pub(super) running_since: Option<Instant>,
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

    /// The jobs and agents the store holds, agents counted disconnected since `now` (until they
    /// say hello), with their latest preflight verdicts (a node that failed stays unscheduled
    /// until it reports again).
    pub(super) async fn load(store: &dyn Store, now: Instant) -> Result<Core> {
        let snapshot = store.snapshot().await?;
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
            };
            core.agents.insert(entry.record.agent_id.clone(), entry);
        }
        for report in store.latest_preflights().await? {
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
        Ok(core)
    }
}

impl ActiveJob {
    pub(super) fn new(record: JobRecord) -> ActiveJob {
        ActiveJob {
            record,
            cancel: None,
            launches_sent: 0,
            allocations: Vec::new(),
            master_port: None,
            detected: None,
            avoid: BTreeMap::new(),
            charged: 0,
            not_before: None,
            resume_from: Vec::new(),
            eviction: None,
            streak: 0,
            running_since: None,
        }
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

/// A job asked to checkpoint and move off a node.
#[derive(Debug, Clone)]
pub(super) struct Eviction {
    pub kind: FailureKind,
    /// The node it moves off; empty when it is preempted (it moves off every node).
    pub node: String,
    pub why: String,
    pub asked: Instant,
    pub deadline: Instant,
    /// The waiting job it makes room for (priority preemption).
    pub for_job: Option<JobId>,
}

impl Eviction {
    /// The failure that ends the moved attempt: the fleet's, so nobody is blamed or charged.
    pub(super) fn failure(
        &self,
        (job_id, attempt): (JobId, u32),
        at_ms: i64,
        evidence: String,
    ) -> FailureRecord {
        FailureRecord {
            job_id,
            attempt,
            at_ms,
            kind: self.kind,
            agent_id: Some(self.node.clone()).filter(|n| !n.is_empty()),
            rank: None,
            evidence,
            blamed: false,
            charged: false,
        }
    }
}
