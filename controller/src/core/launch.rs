//! The messages that start, stop and forget ranks, and the fleet as the scheduler sees it.
//! Only the reconciler and the agent-stream handlers call these, under the core's lock; a full
//! or closed agent stream drops the link (the agent's next hello gets whatever it missed).

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use trainyard_proto::v1::{
    CancelRanks, ControllerMessage, ForgetRanks, Launch, RankAssignment, controller_message::Msg,
};

use super::reconcile::ActiveJob;
use super::state::{Core, rank_done};
use trainyard_model::spec::JobSpec;
use trainyard_placement::scheduler::{GpuView, NodeView, Request};
use trainyard_store::{Allocation, JobId};

/// Sends `CancelRanks` for the current attempt to every agent holding a rank that is
/// not done yet.
pub(super) fn stop_ranks(core: &mut Core, job_id: JobId, reason: &str, grace: Duration) {
    let Some(job) = core.jobs.get(&job_id) else { return };
    let attempt = job.record().attempt;
    let agents: Vec<String> = agents_of(job.allocations.iter().filter(|a| !rank_done(a)));
    let grace_ms = grace.as_millis() as u64;
    for agent in agents {
        let msg = Msg::Cancel(CancelRanks { job_id, attempt, grace_ms, reason: reason.to_string() });
        send(&mut *core, &agent, msg);
    }
}

/// Tells the agents of a job's current attempt that the controller is done with its ranks.
pub(super) fn forget(core: &mut Core, job_id: JobId) {
    let Some(job) = core.jobs.get(&job_id) else { return };
    let attempt = job.record().attempt;
    for agent in agents_of(job.allocations.iter()) {
        send(&mut *core, &agent, Msg::Forget(ForgetRanks { job_id, attempt }));
    }
}

/// Which agents of a job [`send_launches`] sends to.
#[derive(Clone, Copy)]
pub(super) enum LaunchTo<'a> {
    /// Every agent of the job (those that may launch yet: see [`launch_messages`]).
    All,
    /// This agent only (it missed its launch).
    Only(&'a str),
    /// Every agent but this one (the rank-0 agent, launched first, reported its port).
    AllBut(&'a str),
}

/// Sends `Launch` to the job's agents `to` names; returns how many were sent.
pub(super) fn send_launches(core: &mut Core, job_id: JobId, to: LaunchTo<'_>) -> usize {
    let Some(job) = core.jobs.get(&job_id) else { return 0 };
    let launches = launch_messages(core, job);
    let mut sent = 0;
    for (agent, launch) in launches {
        let named = match to {
            LaunchTo::All => true,
            LaunchTo::Only(only) => only == agent,
            LaunchTo::AllBut(but) => but != agent,
        };
        if named && send(&mut *core, &agent, Msg::Launch(launch)) {
            sent += 1;
        }
    }
    sent
}

/// Sends a message to an agent's stream. A full or closed stream drops the link: the agent
/// reconnects, and its hello makes the controller send again whatever is still needed.
pub(super) fn send(core: &mut Core, agent_id: &str, msg: Msg) -> bool {
    let Some(entry) = core.agents.get_mut(agent_id) else { return false };
    let Some(link) = &entry.link else { return false };
    match link.tx.try_send(ControllerMessage { msg: Some(msg) }) {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!(agent_id, error = %e, "agent stream not taking messages; dropping the link");
            entry.link = None;
            entry.disconnected_since = Some(tokio::time::Instant::now());
            false
        }
    }
}

/// Sends a message to an agent's stream if it takes it now; a full or closed stream keeps
/// its link (for messages whose loss only fails the request they belong to).
pub(super) fn try_send(core: &Core, agent_id: &str, msg: Msg) {
    if let Some(link) = core.agents.get(agent_id).and_then(|e| e.link.as_ref()) {
        let _ = link.tx.try_send(ControllerMessage { msg: Some(msg) });
    }
}

/// The fleet as the scheduler sees it. `all`: every known agent with every GPU free (for
/// feasibility, failing nodes included: an operator can fix them); otherwise connected
/// agents that are not leaving and whose newest preflight verdict is not `fail`, with busy
/// GPUs marked. Agents that joined for one `[slurm]` job are not the fleet's
/// ([`super::slurm::allocation_views`]).
pub(super) fn node_views(core: &Core, all: bool) -> Vec<NodeView> {
    views_of(core, all, None)
}

/// [`node_views`] of the agents bound to `pool` (`None`: the fleet's own).
pub(super) fn views_of(core: &Core, all: bool, pool: Option<JobId>) -> Vec<NodeView> {
    // Busy GPU indices per agent, as bits. An index of 128 or more counts as free here; no
    // such node is placed on (the scheduler leaves nodes of more than 64 GPUs out).
    // A job's allocations come in rank order, a node's ranks together: the map is touched
    // once per run of one agent's ranks, not once per rank.
    let mut busy: HashMap<&str, u128> = HashMap::with_capacity(core.agents.len());
    let mut run: Option<(&str, u128)> = None;
    for job in core.jobs.values() {
        for a in job.allocations.iter().filter(|a| !rank_done(a) || !job.record().state.is_terminal()) {
            if a.gpu_index >= 128 {
                continue;
            }
            let bit = 1u128 << a.gpu_index;
            match &mut run {
                Some((agent, bits)) if *agent == a.agent_id => *bits |= bit,
                _ => {
                    if let Some((agent, bits)) = run.replace((a.agent_id.as_str(), bit)) {
                        *busy.entry(agent).or_default() |= bits;
                    }
                }
            }
        }
    }
    if let Some((agent, bits)) = run {
        *busy.entry(agent).or_default() |= bits;
    }
    core.agents
        .values()
        .filter(|e| e.bound == pool)
        .filter(|e| {
            all || (e.link.is_some()
                && !e.leaving
                && !e.unresponsive
                && !e.failing()
                && e.record.cordon.is_none())
        })
        .map(|e| {
            let inv = &e.record.inventory;
            let held = busy.get(e.record.agent_id.as_str()).copied().unwrap_or(0);
            let gpus = inv
                .gpus
                .iter()
                .map(|g| GpuView {
                    index: g.index,
                    model: g.model.clone(),
                    memory_mib: g.memory_mib,
                    free: all || g.index >= 128 || held & (1u128 << g.index) == 0,
                    numa_node: g.numa_node.map_or(-1, |n| n as i32),
                })
                .collect();
            NodeView {
                agent_id: e.record.agent_id.clone(),
                gpus,
                links: e.links.clone(),
                interconnect_class: e.preflight.as_ref().and_then(|r| r.interconnect_class),
                numa_cpus: inv.numa_nodes.iter().map(|n| (n.id, n.cpus.clone())).collect(),
            }
        })
        .collect()
}

pub(super) fn request_of(job_id: JobId, spec: &JobSpec) -> Request {
    let res = spec.resources.clone();
    Request {
        job_id,
        priority: spec.priority,
        gpus: res.gpus,
        gpus_per_node: res.gpus_per_node,
        gpu_model: res.gpu_model,
        min_gpu_memory_mib: res.min_gpu_memory_mib,
        interconnect: res.interconnect,
        avoid: Vec::new(),
    }
}

/// What a submit's feasibility depends on in a request: all of it but the job, its priority
/// and the nodes it avoids (none at submit).
pub(super) fn shape_of(r: &Request) -> String {
    format!(
        "{} {:?} {:?} {} {:?}",
        r.gpus, r.gpus_per_node, r.gpu_model, r.min_gpu_memory_mib, r.interconnect
    )
}

/// Distinct agents of some allocations, in order of first appearance.
fn agents_of<'a>(allocs: impl Iterator<Item = &'a Allocation>) -> Vec<String> {
    let mut agents: Vec<String> = Vec::new();
    for a in allocs {
        if !agents.contains(&a.agent_id) {
            agents.push(a.agent_id.clone());
        }
    }
    agents
}

/// One `Launch` per node of the job's current attempt, rebuilt from its allocations so the
/// same message can be sent again after a reconnect.
fn launch_messages(core: &Core, job: &ActiveJob) -> Vec<(String, Launch)> {
    let world_size = job.allocations.len() as u32;
    let rank0 = job.allocations.iter().find(|a| a.id.rank == 0);
    let master_addr = rank0
        .and_then(|a| core.agents.get(&a.agent_id))
        .map(|e| e.record.address.clone())
        .unwrap_or_else(|| "127.0.0.1".into());
    // Until the rank-0 agent has reported the port it chose, only it is launched (with 0).
    let master_port = job.master_port.map_or(0, u32::from);
    let mut by_agent: BTreeMap<&str, Vec<&Allocation>> = BTreeMap::new();
    for a in &job.allocations {
        by_agent.entry(a.agent_id.as_str()).or_default().push(a);
    }
    let node_count = by_agent.len() as u32;
    by_agent
        .into_iter()
        .filter(|(agent, _)| master_port != 0 || rank0.is_some_and(|a| a.agent_id == *agent))
        .map(|(agent, allocs)| {
            let launch = Launch {
                node_count,
                job_id: job.record().id,
                attempt: job.record().attempt,
                world_size,
                node_rank: allocs[0].node_rank,
                local_world_size: allocs.len() as u32,
                master_addr: master_addr.clone(),
                master_port,
                ranks: allocs
                    .iter()
                    .map(|a| RankAssignment {
                        rank: a.id.rank,
                        local_rank: a.local_rank,
                        gpu_index: a.gpu_index,
                        cpus: a.planned_cpus.clone(),
                        numa_node: a.planned_mems.parse().unwrap_or(-1),
                    })
                    .collect(),
                spec: Some((&job.record().spec).into()),
                run_as: job.record().owner.run_as.clone(),
                resume_from: job.resume_from.clone(),
                run_name: super::keys::run_name(&core.cluster_id, job.record()),
            };
            (agent.to_string(), launch)
        })
        .collect()
}
