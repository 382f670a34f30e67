//! The fleet in memory: each node's state as the table shows it, the GPUs ranks hold, the
//! agent an operator means by a hostname, and the rows of the fleet table.
//!
//! A node's verdict is its agent's newest preflight report: `fail` keeps the scheduler away
//! from it (it still counts when a submitted job is checked for feasibility, since an operator
//! can fix the node), and the table says which checks failed and what they measured.

use std::collections::{BTreeMap, BTreeSet};

use trainyard_proto::v1::NodeInfo;

use trainyard_model::domain::Inventory;

use super::state::{AgentEntry, Core, rank_done};
use super::{ControllerError, Result};
use trainyard_model::domain::{NodeState, Verdict};
use trainyard_store::{AgentState, PreflightRecord};

impl AgentEntry {
    /// The node's newest preflight verdict is `fail`: no new work goes there.
    pub(super) fn failing(&self) -> bool {
        self.preflight.as_ref().is_some_and(|r| r.verdict == Verdict::Fail)
    }

    /// The node's state as the leader recorded it in the store (what a follower shows).
    pub(super) fn recorded_state(&self) -> NodeState {
        match self.record.state {
            AgentState::Connected => NodeState::Connected,
            AgentState::Disconnected => NodeState::Disconnected,
            AgentState::Leaving => NodeState::Leaving,
        }
    }

    /// The node's state as the fleet table shows it.
    pub(super) fn state(&self) -> NodeState {
        match (self.link.is_some(), self.leaving || self.record.state == AgentState::Leaving) {
            (true, false) if self.unresponsive => NodeState::Unresponsive,
            (true, false) => NodeState::Connected,
            (_, true) => NodeState::Leaving,
            (false, false) => NodeState::Disconnected,
        }
    }
}

/// GPUs held by a rank of an unfinished job, or by a rank still alive.
pub(super) fn busy_gpus(core: &Core) -> BTreeSet<(String, u32)> {
    let mut busy = BTreeSet::new();
    for job in core.jobs.values() {
        for a in job.allocations.iter().filter(|a| !rank_done(a) || !job.record().state.is_terminal()) {
            busy.insert((a.agent_id.clone(), a.gpu_index));
        }
    }
    busy
}

/// The agent id an operator means by `host`: an agent id, or a hostname only one agent has.
pub(super) fn resolve(core: &Core, host: &str) -> Result<String> {
    if core.agents.contains_key(host) {
        return Ok(host.to_string());
    }
    let by_hostname: Vec<&String> =
        core.agents.iter().filter(|(_, e)| e.record.inventory.hostname == host).map(|(id, _)| id).collect();
    match by_hostname.as_slice() {
        [one] => Ok((*one).clone()),
        _ => Err(ControllerError::AgentNotFound(host.to_string())),
    }
}

/// (agent id, row of the fleet table) for one agent.
pub(super) fn node_info(
    e: &AgentEntry,
    state: NodeState,
    busy: &BTreeSet<(String, u32)>,
    last_seen_ms: i64,
) -> (String, NodeInfo) {
    let inv = &e.record.inventory;
    let id = &e.record.agent_id;
    let report = e.preflight.as_ref();
    let free = inv.gpus.iter().filter(|g| !busy.contains(&(id.clone(), g.index))).count();
    let info = NodeInfo {
        agent_id: id.clone(),
        hostname: inv.hostname.clone(),
        state: state.to_string(),
        gpus: inv.gpus.len() as u32,
        free_gpus: free as u32,
        gpu_model: gpu_models(inv),
        interconnect_class: report
            .and_then(|r| r.interconnect_class)
            .map(|c| c.to_string())
            .unwrap_or_default(),
        numa_layout: numa_layout(inv),
        verdict: report.map(|r| r.verdict.to_string()).unwrap_or_default(),
        verdict_reason: match (&e.record.cordon, unschedulable_reason(report, state)) {
            (Some(c), r) if r.is_empty() => format!("cordoned ({}): {}", c.by, c.reason),
            (_, r) => r,
        },
        // The last message of a connected agent (heartbeats every 2 s), or when it went away.
        last_seen_ms,
        preflight_report_id: report.map_or(0, |r| r.report_id),
        cordon_by: e.record.cordon.as_ref().map(|c| c.by.clone()).unwrap_or_default(),
        cordon_reason: e.record.cordon.as_ref().map(|c| c.reason.clone()).unwrap_or_default(),
        cordoned_at_ms: e.record.cordon.as_ref().map_or(0, |c| c.at_ms),
    };
    (id.clone(), info)
}

/// Distinct GPU models of a node, in index order ("NVIDIA H100 80GB HBM3").
fn gpu_models(inv: &Inventory) -> String {
    let mut models: Vec<&str> = Vec::new();
    for g in &inv.gpus {
        if !models.contains(&g.model.as_str()) {
            models.push(&g.model);
        }
    }
    models.join(" + ")
}

/// GPUs per NUMA node, "0:4 1:4"; a GPU whose NUMA node is unknown counts under "?".
pub fn numa_layout(inv: &Inventory) -> String {
    let mut per_node: BTreeMap<Option<u32>, u32> = BTreeMap::new();
    for g in &inv.gpus {
        *per_node.entry(g.numa_node).or_default() += 1;
    }
    let parts: Vec<String> = per_node
        .into_iter()
        .map(|(node, n)| node.map_or_else(|| format!("?:{n}"), |node| format!("{node}:{n}")))
        .collect();
    parts.join(" ")
}

/// Why the scheduler leaves a node alone, or "" when it does not: the failing checks with what
/// they measured, else the agent's state.
pub fn unschedulable_reason(report: Option<&PreflightRecord>, state: NodeState) -> String {
    let failing: Vec<String> =
        report
            .filter(|r| r.verdict == Verdict::Fail)
            .map(|r| {
                r.failing()
                    .map(|c| {
                        if c.measured.is_empty() { c.id.clone() } else { format!("{}: {}", c.id, c.measured) }
                    })
                    .collect()
            })
            .unwrap_or_default();
    match (report.is_some_and(|r| r.verdict == Verdict::Fail), state) {
        (true, _) if failing.is_empty() => "preflight verdict fail".to_string(),
        (true, _) => failing.join("; "),
        (false, NodeState::Connected) => String::new(),
        (false, NodeState::Leaving) => "agent is leaving".to_string(),
        (false, NodeState::Unresponsive) => {
            "agent is unresponsive: its stream is open but its heartbeats stopped".to_string()
        }
        (false, NodeState::Disconnected) => "agent is not connected".to_string(),
    }
}
