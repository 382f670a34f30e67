//! The fleet table (`Jobs.Nodes`) and preflight reports on request (`Jobs.Preflight`).
//!
//! A node's verdict is its agent's newest preflight report: `fail` keeps the scheduler away
//! from it (it still counts when a submitted job is checked for feasibility, since an operator
//! can fix the node), and the table says which checks failed and what they measured.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use trainyard_proto::v1::{NodeInfo, RunPreflight, controller_message::Msg};

use trainyard_model::domain::Inventory;

use super::{AgentEntry, Controller, ControllerError, Core, Result, rank_done};
use trainyard_model::domain::{NodeState, PreflightLevel, Verdict};
use trainyard_store::{AgentState, PreflightRecord};

/// Levels an operator may ask an agent to run.
pub const PREFLIGHT_RUN_LEVELS: [PreflightLevel; 3] =
    [PreflightLevel::Quick, PreflightLevel::Standard, PreflightLevel::Full];

/// How long `Preflight` with a run level waits for the agent's new report. A `full` run sweeps
/// NCCL up to 1 GiB on every GPU, which takes tens of seconds on a healthy node.
pub const PREFLIGHT_RUN_TIMEOUT: Duration = Duration::from_secs(120);

impl AgentEntry {
    /// The node's newest preflight verdict is `fail`: no new work goes there.
    pub(super) fn failing(&self) -> bool {
        self.preflight.as_ref().is_some_and(|r| r.verdict == Verdict::Fail)
    }

    /// The node's state as the leader recorded it in the store (what a follower shows).
    fn recorded_state(&self) -> NodeState {
        match self.record.state {
            AgentState::Connected => NodeState::Connected,
            AgentState::Disconnected => NodeState::Disconnected,
            AgentState::Leaving => NodeState::Leaving,
        }
    }

    /// The node's state as the fleet table shows it.
    fn state(&self) -> NodeState {
        match (self.link.is_some(), self.leaving || self.record.state == AgentState::Leaving) {
            (true, false) if self.unresponsive => NodeState::Unresponsive,
            (true, false) => NodeState::Connected,
            (_, true) => NodeState::Leaving,
            (false, false) => NodeState::Disconnected,
        }
    }
}

impl Controller {
    /// One row per known agent, by agent id.
    pub async fn nodes(&self) -> Vec<NodeInfo> {
        let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let follower = !self.leads();
        let core = self.lock();
        let busy = core.busy_gpus();
        core.agents
            .values()
            .map(|e| {
                // A connected agent's newest message may be younger than the last liveness pass.
                let heard = seen.get(&e.record.agent_id).copied().filter(|_| e.link.is_some());
                let last_seen = heard.map_or(e.record.last_seen_ms, |at| at.max(e.record.last_seen_ms));
                // A follower holds no agent's stream: the leader's record of it is the state.
                let state = if follower { e.recorded_state() } else { e.state() };
                node_info(e, state, &busy, last_seen)
            })
            .collect::<BTreeMap<_, _>>()
            .into_values()
            .collect()
    }

    /// The inventory a node reported in its last hello (GPUs, NUMA nodes, link matrix).
    pub fn node_inventory(&self, agent_id: &str) -> Option<trainyard_model::domain::Inventory> {
        self.lock().agents.get(agent_id).map(|e| e.record.inventory.clone())
    }

    /// The newest preflight report of a node (agent id, or hostname when unambiguous).
    pub async fn latest_preflight(&self, host: &str) -> Result<PreflightRecord> {
        let agent_id = {
            let core = self.lock();
            let agent_id = core.resolve(host)?;
            if let Some(report) = core.agents.get(&agent_id).and_then(|e| e.preflight.clone()) {
                return Ok(report);
            }
            agent_id
        };
        // Not in memory (a report whose store write raced a restart): the store is the record.
        self.store.latest_preflight(&agent_id).await?.ok_or(ControllerError::NoPreflight(agent_id))
    }

    /// Asks a node to run a preflight at `level` and waits up to `timeout` for its next report.
    pub async fn run_preflight(&self, host: &str, level: &str, timeout: Duration) -> Result<PreflightRecord> {
        if !PreflightLevel::parse(level).is_some_and(|l| PREFLIGHT_RUN_LEVELS.contains(&l)) {
            return Err(ControllerError::BadRequest(format!(
                "run level {level:?} is not one of {}",
                trainyard_model::domain::words(&PREFLIGHT_RUN_LEVELS)
            )));
        }
        // Subscribed before the request goes out, so a fast answer is not missed.
        let mut changes = self.subscribe();
        let (agent_id, before) = {
            let mut core = self.lock();
            let agent_id = core.resolve(host)?;
            let before =
                core.agents.get(&agent_id).and_then(|e| e.preflight.as_ref()).map_or(0, |r| r.report_id);
            let msg = Msg::RunPreflight(RunPreflight { level: level.to_string() });
            if !core.send(&agent_id, msg) {
                return Err(ControllerError::AgentNotConnected(agent_id));
            }
            (agent_id, before)
        };
        tracing::info!(agent_id, level, "preflight requested");
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            changes.borrow_and_update();
            {
                let core = self.lock();
                let entry = core
                    .agents
                    .get(&agent_id)
                    .ok_or_else(|| ControllerError::AgentNotFound(agent_id.clone()))?;
                match &entry.preflight {
                    Some(report) if report.report_id > before => return Ok(report.clone()),
                    _ if entry.link.is_none() => return Err(ControllerError::AgentNotConnected(agent_id)),
                    _ => {}
                }
            }
            tokio::select! {
                _ = changes.changed() => {}
                // The link can drop without a change being announced; look again now and then.
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                _ = tokio::time::sleep_until(deadline) => {
                    let waited_s = timeout.as_secs();
                    return Err(ControllerError::PreflightTimeout { agent: agent_id, level: level.to_string(), waited_s });
                }
            }
        }
    }
}

impl Core {
    /// GPUs held by a rank of an unfinished job, or by a rank still alive.
    fn busy_gpus(&self) -> BTreeSet<(String, u32)> {
        let mut busy = BTreeSet::new();
        for job in self.jobs.values() {
            for a in job.allocations.iter().filter(|a| !rank_done(a) || !job.record.state.is_terminal()) {
                busy.insert((a.agent_id.clone(), a.gpu_index));
            }
        }
        busy
    }

    /// The agent id an operator means by `host`: an agent id, or a hostname only one agent has.
    pub(super) fn resolve(&self, host: &str) -> Result<String> {
        if self.agents.contains_key(host) {
            return Ok(host.to_string());
        }
        let by_hostname: Vec<&String> = self
            .agents
            .iter()
            .filter(|(_, e)| e.record.inventory.hostname == host)
            .map(|(id, _)| id)
            .collect();
        match by_hostname.as_slice() {
            [one] => Ok((*one).clone()),
            _ => Err(ControllerError::AgentNotFound(host.to_string())),
        }
    }
}

/// (agent id, row of the fleet table) for one agent.
fn node_info(
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

#[cfg(test)]
#[path = "nodes_tests.rs"]
mod tests;
