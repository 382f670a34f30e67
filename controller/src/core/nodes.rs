//! The nodes service: the fleet table (`Jobs.Nodes`), preflight reports on request
//! (`Jobs.Preflight`), cordons and drains, and what each agent's stream says about its node
//! (hello, preflight reports, preemption notices, leaving, disconnects, liveness).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;
use trainyard_proto::v1::{
    ControllerMessage, Hello, HelloAck, NodeInfo, Notice, PreflightReport, RankAck, RunPreflight,
    controller_message::Msg,
};

use super::agents::{lost_report, rank_id, rank_key};
use super::evict::{DEFAULT_NOTICE_DEADLINE, NOTICE_MARGIN};
use super::faults::BY_OPERATOR;
use super::fleet::node_info;
use super::shared::Shared;
use super::state::{AgentEntry, AgentLink, rank_done};
use super::{ControllerError, Result};
use trainyard_model::domain::PreflightLevel;
use trainyard_store::{
    AgentRecord, AgentState, Cordon, FailureKind, JobId, JobState, PreflightRecord, RankId, RankState,
};

/// Levels an operator may ask an agent to run.
pub const PREFLIGHT_RUN_LEVELS: [PreflightLevel; 3] =
    [PreflightLevel::Quick, PreflightLevel::Standard, PreflightLevel::Full];

/// How long `Preflight` with a run level waits for the agent's new report. A `full` run sweeps
/// NCCL up to 1 GiB on every GPU, which takes tens of seconds on a healthy node.
pub const PREFLIGHT_RUN_TIMEOUT: Duration = Duration::from_secs(120);

/// The fleet and each agent's link ([`super::Controller::nodes`]).
#[derive(Clone, Copy)]
pub struct Nodes<'c> {
    pub(super) c: &'c Shared,
}

impl Nodes<'_> {
    /// One row per known agent, by agent id.
    pub async fn list(self) -> Vec<NodeInfo> {
        let seen = self.c.heard.last();
        let follower = !self.c.role.leads();
        let core = self.c.lock();
        let busy = super::fleet::busy_gpus(&core);
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
    pub fn inventory(self, agent_id: &str) -> Option<trainyard_model::domain::Inventory> {
        self.c.lock().agents.get(agent_id).map(|e| e.record.inventory.clone())
    }

    /// The newest preflight report of a node (agent id, or hostname when unambiguous).
    pub async fn latest_preflight(self, host: &str) -> Result<PreflightRecord> {
        let agent_id = {
            let core = self.c.lock();
            let agent_id = super::fleet::resolve(&core, host)?;
            if let Some(report) = core.agents.get(&agent_id).and_then(|e| e.preflight.clone()) {
                return Ok(report);
            }
            agent_id
        };
        // Not in memory (a report whose store write raced a restart): the store is the record.
        self.c.store.latest_preflight(&agent_id).await?.ok_or(ControllerError::NoPreflight(agent_id))
    }

    /// Asks a node to run a preflight at `level` and waits up to `timeout` for its next report.
    pub async fn run_preflight(self, host: &str, level: &str, timeout: Duration) -> Result<PreflightRecord> {
        if !PreflightLevel::parse(level).is_some_and(|l| PREFLIGHT_RUN_LEVELS.contains(&l)) {
            return Err(ControllerError::BadRequest(format!(
                "run level {level:?} is not one of {}",
                trainyard_model::domain::words(&PREFLIGHT_RUN_LEVELS)
            )));
        }
        // Subscribed before the request goes out, so a fast answer is not missed.
        let mut changes = self.c.subscribe();
        let (agent_id, before) = {
            let mut core = self.c.lock();
            let agent_id = super::fleet::resolve(&core, host)?;
            let before =
                core.agents.get(&agent_id).and_then(|e| e.preflight.as_ref()).map_or(0, |r| r.report_id);
            let msg = Msg::RunPreflight(RunPreflight { level: level.to_string() });
            if !super::launch::send(&mut core, &agent_id, msg) {
                return Err(ControllerError::AgentNotConnected(agent_id));
            }
            (agent_id, before)
        };
        tracing::info!(agent_id, level, "preflight requested");
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            changes.borrow_and_update();
            {
                let core = self.c.lock();
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

    /// `ctl cordon` (`Some(reason)`) and `ctl uncordon` (`None`): an operator's cordon stays
    /// until an operator lifts it; lifting also clears a cordon set after failures.
    /// `node` is an agent id or a hostname only one agent has; returns the agent id.
    pub async fn cordon(self, node: &str, reason: Option<&str>) -> Result<String> {
        let cordon =
            reason.map(|r| Cordon { by: BY_OPERATOR.into(), reason: r.to_string(), at_ms: self.c.now_ms() });
        let agent_id = super::fleet::resolve(&self.c.lock(), node)?;
        let agent_id = agent_id.as_str();
        self.c.store.set_cordon(agent_id, cordon.as_ref()).await?;
        {
            let mut core = self.c.lock();
            if let Some(entry) = core.agents.get_mut(agent_id) {
                entry.record.cordon = cordon.clone();
            }
            if cordon.is_none() {
                core.blames.remove(agent_id);
            }
        }
        match reason {
            Some(reason) => tracing::warn!(agent_id, reason, "node cordoned by an operator"),
            None => tracing::info!(agent_id, "node uncordoned by an operator"),
        }
        self.c.bump();
        self.c.wake();
        Ok(agent_id.to_string())
    }

    /// `ctl drain`: cordons `node` and moves its jobs once they checkpoint (or at `deadline`).
    /// Returns the agent id and the jobs asked to move.
    pub async fn drain(self, node: &str, deadline: Duration, reason: &str) -> Result<(String, Vec<JobId>)> {
        let agent_id = super::fleet::resolve(&self.c.lock(), node)?;
        let why = format!("node {agent_id} drained by an operator: {reason}");
        let cordon = Cordon { by: "drain".into(), reason: reason.to_string(), at_ms: self.c.now_ms() };
        self.c.store.set_cordon(&agent_id, Some(&cordon)).await?;
        let jobs = {
            let mut core = self.c.lock();
            if let Some(entry) = core.agents.get_mut(&agent_id) {
                entry.record.cordon = Some(cordon);
            }
            super::evict::evict(&mut core, &agent_id, FailureKind::Drain, deadline, &why)
        };
        tracing::warn!(agent_id, reason, jobs = jobs.len(), deadline_s = deadline.as_secs(), "node draining");
        self.c.bump();
        self.c.wake();
        Ok((agent_id, jobs))
    }

    /// Registers an agent's stream: stores its inventory, adopts the ranks it reports, and sends
    /// again whatever it missed while away (launches of placed jobs, cancels of ended ones).
    /// Sends the hello ack first; returns the connection id (for [`Nodes::disconnected`]).
    pub async fn hello(self, hello: Hello, tx: mpsc::Sender<ControllerMessage>) -> Result<u64> {
        self.hello_for(hello, tx, None).await
    }

    /// [`Nodes::hello`] of an agent that joined for one `[slurm]` job (`bound`, checked by the
    /// caller against its join token): it takes that job's ranks alone.
    pub async fn hello_for(
        self,
        hello: Hello,
        tx: mpsc::Sender<ControllerMessage>,
        bound: Option<JobId>,
    ) -> Result<u64> {
        let agent_id = hello.agent_id.clone();
        // Checked before anything is stored, and again under the lock below (a racing hello).
        if self.c.lock().agents.get(&agent_id).is_some_and(|e| e.link.is_some()) {
            return Err(ControllerError::AlreadyConnected(agent_id));
        }
        let record = AgentRecord {
            agent_id: agent_id.clone(),
            address: hello.address.clone(),
            agent_version: hello.agent_version.clone(),
            inventory: hello.inventory.clone().unwrap_or_default().into(),
            state: AgentState::Connected,
            last_seen_ms: self.c.now_ms(),
            // A hello does not lift a cordon: the entry's is kept below.
            cordon: None,
        };
        self.c.store.upsert_agent(&record).await?;
        crate::metrics::metrics().agent_hellos.inc();
        let preflight = match hello.preflight.clone() {
            // Only a preflight of the whole node is its verdict, whatever an agent sends.
            Some(report) => self.store_preflight(&agent_id, report).await?.filter(|r| r.job_id.is_none()),
            None => None,
        };
        let reported: BTreeSet<RankId> = hello.ranks.iter().filter_map(|r| r.key.map(rank_id)).collect();
        let acks = self.acks_for(&reported).await?;
        let ack = HelloAck { protocol_version: trainyard_proto::PROTOCOL_VERSION, acks };
        // The ack goes first, so the agent knows where to resume before any launch arrives.
        if tx.try_send(ControllerMessage { msg: Some(Msg::HelloAck(ack)) }).is_err() {
            return Err(ControllerError::AgentGone(agent_id));
        }
        let (conn_id, lost) = self.register(&agent_id, (record, bound), preflight, tx, &reported)?;
        tracing::info!(agent_id, conn_id, ranks = hello.ranks.len(), "agent connected");
        for report in &hello.ranks {
            super::agents::observe(&super::reconcile::Reconciler(self.c), &agent_id, report).await?;
        }
        for id in lost {
            let message = format!("agent {agent_id} came back without it");
            super::agents::observe(
                &super::reconcile::Reconciler(self.c),
                &agent_id,
                &lost_report(id, &super::faults::host_lost_message(&message)),
            )
            .await?;
        }
        self.c.wake();
        Ok(conn_id)
    }

    /// Records the agent's new stream under the lock (refused if another is open), with the
    /// newer of its hello's and its known preflight report; returns the connection id and the
    /// ranks it came back without.
    fn register(
        self,
        agent_id: &str,
        (record, bound): (AgentRecord, Option<JobId>),
        preflight: Option<PreflightRecord>,
        tx: mpsc::Sender<ControllerMessage>,
        reported: &BTreeSet<RankId>,
    ) -> Result<(u64, Vec<RankId>)> {
        let mut core = self.c.lock();
        core.next_conn_id += 1;
        let conn_id = core.next_conn_id;
        let link = Some(AgentLink { conn_id, tx });
        // The newest report is the verdict: a hello without one, or with the report the agent
        // ran at start while a later re-run is stored, keeps what the node had (from the store
        // after a restart of the controller, or from before the reconnect).
        if core.agents.get(agent_id).is_some_and(|e| e.link.is_some()) {
            return Err(ControllerError::AlreadyConnected(agent_id.to_string()));
        }
        let previous = core.agents.get(agent_id).and_then(|e| e.preflight.clone());
        let mut record = record;
        record.cordon = core.agents.get(agent_id).and_then(|e| e.record.cordon.clone());
        let preflight = match (preflight, previous) {
            (Some(new), Some(old)) if old.report_id > new.report_id => Some(old),
            (new, old) => new.or(old),
        };
        let links = super::state::link_matrix(&record);
        let entry = AgentEntry {
            links,
            record,
            link,
            leaving: false,
            disconnected_since: None,
            preflight,
            unresponsive: false,
            seen_since_start: true,
            bound,
            dismissed: false,
        };
        self.seen(agent_id);
        let report = entry.preflight.clone();
        core.agents.insert(agent_id.to_string(), entry);
        core.fleet_changed();
        if let Some(report) = report {
            super::faults::clear_by_preflight(&mut core, &report);
        }
        super::faults::ask_for_clearing(&mut core, agent_id);
        let lost = self.resend_missed(&mut core, agent_id, reported);
        Ok((conn_id, lost))
    }

    /// After a hello: ranks placed on this agent that it does not know are launched again if
    /// their job is still starting and they never started; the others are returned, to be
    /// recorded as lost.
    fn resend_missed(
        self,
        core: &mut super::state::Core,
        agent_id: &str,
        reported: &BTreeSet<RankId>,
    ) -> Vec<RankId> {
        let mut relaunch = Vec::new();
        let mut lost = Vec::new();
        for job in core.jobs.values() {
            let unknown: Vec<RankId> = job
                .allocations
                .iter()
                .filter(|a| a.agent_id == agent_id && !rank_done(a) && !reported.contains(&a.id))
                .map(|a| a.id)
                .collect();
            if unknown.is_empty() {
                continue;
            }
            let starting = matches!(job.record().state, JobState::Scheduled | JobState::Launching);
            let never_started = job
                .allocations
                .iter()
                .filter(|a| unknown.contains(&a.id))
                .all(|a| a.observed.state == RankState::Planned);
            if starting && never_started {
                relaunch.push(job.record().id);
            } else {
                lost.extend(unknown);
            }
        }
        // An attempt that waited for this host gets no ranks back: the wait is over, and the
        // ranks are recorded lost (a restart), not taken back.
        for id in &lost {
            if let Some(job) = core.jobs.get_mut(&id.job_id)
                && job.host_wait.as_ref().is_some_and(|w| w.agent_id == agent_id)
            {
                job.host_wait = None;
            }
        }
        for job_id in relaunch {
            tracing::info!(job_id, agent_id, "agent missed a launch; sending it again");
            let sent = super::launch::send_launches(core, job_id, super::launch::LaunchTo::Only(agent_id));
            if let Some(job) = core.jobs.get_mut(&job_id) {
                job.launches_sent += sent;
            }
            core.dirty.insert(job_id);
        }
        lost
    }

    async fn acks_for(self, reported: &BTreeSet<RankId>) -> Result<Vec<RankAck>> {
        let attempts: BTreeSet<(u64, u32)> = reported.iter().map(|r| (r.job_id, r.attempt)).collect();
        let mut acks = Vec::new();
        for (job_id, attempt) in attempts {
            for (rank, seq) in self.c.store.last_seqs(job_id, attempt).await? {
                let id = RankId { job_id, attempt, rank };
                if reported.contains(&id) {
                    acks.push(RankAck { key: Some(rank_key(id)), seq });
                }
            }
        }
        Ok(acks)
    }

    /// An agent sent a preflight report (a re-run, or one the controller asked for): store it,
    /// make it the node's verdict, and schedule again, since a node that passes now may take
    /// pending jobs.
    pub async fn preflight_report(self, agent_id: &str, report: PreflightReport) -> Result<()> {
        let Some(report) = self.store_preflight(agent_id, report).await? else { return Ok(()) };
        // A job's launch preflight is the job's: its failure fails the job (the ranks the agent
        // refused say so), never the node's verdict, which only a preflight of the whole node
        // sets.
        if report.job_id.is_some() {
            return Ok(());
        }
        {
            let mut core = self.c.lock();
            if let Some(entry) = core.agents.get_mut(agent_id)
                && entry.preflight.as_ref().is_none_or(|r| r.report_id <= report.report_id)
            {
                entry.preflight = Some(report.clone());
                super::faults::clear_by_preflight(&mut core, &report);
                core.fleet_changed();
            }
        }
        super::faults::store_cordons(self.c.store.as_ref(), &self.c.core).await;
        self.c.bump();
        self.c.wake();
        Ok(())
    }

    /// Stores a report as the agent's own (an agent speaks only for itself) and returns it
    /// with its `report_id`; a malformed report is logged and dropped (`None`).
    async fn store_preflight(
        self,
        agent_id: &str,
        report: PreflightReport,
    ) -> Result<Option<PreflightRecord>> {
        let mut report = match PreflightRecord::try_from(report) {
            Ok(report) => report,
            Err(why) => {
                tracing::error!(agent_id, %why, "preflight report dropped: malformed");
                return Ok(None);
            }
        };
        report.agent_id = agent_id.to_string();
        report.report_id = self.c.store.insert_preflight(&report, self.c.now_ms()).await?;
        let failing: Vec<&str> = report.failing().map(|c| c.id.as_str()).collect();
        tracing::info!(
            agent_id,
            report_id = report.report_id,
            level = %report.level,
            verdict = %report.verdict,
            class = %report.interconnect_class.map_or("", |c| c.as_str()),
            failing = %failing.join(","),
            "preflight report stored"
        );
        Ok(Some(report))
    }

    /// An agent's preemption notice: as a drain, with the deadline the notice gives.
    pub async fn notice(self, agent_id: &str, notice: &Notice) -> Result<()> {
        let now_ms = self.c.now_ms();
        let left = match notice.deadline_ms {
            0 => DEFAULT_NOTICE_DEADLINE,
            at => Duration::from_millis(u64::try_from(at - now_ms).unwrap_or(0)),
        };
        let deadline = left.saturating_sub(NOTICE_MARGIN);
        // The detail (the notice's first line) is for admins: it goes to this log only, never
        // into a reason every user sees (`ctl nodes`, job events).
        let detail: String = notice.detail.chars().take(200).collect();
        let why = format!("preemption notice on {agent_id} (its detail is in the controller's log)");
        let cordon = Cordon { by: super::faults::BY_PREEMPTION.into(), reason: why.clone(), at_ms: now_ms };
        // The time-limit warning of a Slurm allocation comes to one agent but ends them all.
        let mut nodes = super::slurm::allocation_of(&self.c.lock(), agent_id);
        nodes.push(agent_id.to_string());
        for node in &nodes {
            self.c.store.set_cordon(node, Some(&cordon)).await?;
        }
        let jobs = {
            let mut core = self.c.lock();
            for node in &nodes {
                if let Some(entry) = core.agents.get_mut(node) {
                    entry.record.cordon = Some(cordon.clone());
                }
            }
            super::evict::evict(&mut core, agent_id, FailureKind::Preemption, deadline, &why)
        };
        tracing::warn!(agent_id, kind = %notice.kind, detail, jobs = jobs.len(), deadline_s = deadline.as_secs(), "preemption notice");
        self.c.bump();
        self.c.wake();
        Ok(())
    }

    /// The agent said it is stopping: place nothing new there.
    pub async fn leaving(self, agent_id: &str, reason: &str) -> Result<()> {
        if let Some(entry) = self.c.lock().agents.get_mut(agent_id) {
            entry.leaving = true;
        }
        tracing::info!(agent_id, reason, "agent is leaving");
        self.c.store.set_agent_state(agent_id, AgentState::Leaving, self.c.now_ms()).await?;
        Ok(())
    }

    /// An agent of a `[slurm]` job says Slurm is ending its allocation, the Slurm job now in
    /// `state` (as Slurm says it): a `scancel` cancels the job. Not waited for: the ranks' ends
    /// come on the stream this is called from.
    pub fn slurm_ending(self, agent_id: &str, state: &str) {
        let cancelled = {
            let mut core = self.c.lock();
            let job = core.agents.get(agent_id).and_then(|e| e.bound);
            job.is_some_and(|job| super::slurm::cancel_for(&mut core, agent_id, job, state))
        };
        if cancelled {
            self.c.bump();
            self.c.wake();
        }
    }

    /// The stream `conn_id` of an agent ended. A newer stream of the same agent is left alone.
    pub async fn disconnected(self, agent_id: &str, conn_id: u64) -> Result<()> {
        let now = self.c.now_ms();
        let state = {
            let mut core = self.c.lock();
            self.c.heard.unfence(conn_id);
            let Some(entry) = core.agents.get_mut(agent_id) else { return Ok(()) };
            if entry.link.as_ref().is_none_or(|l| l.conn_id != conn_id) {
                return Ok(());
            }
            entry.link = None;
            entry.disconnected_since = Some(Instant::now());
            let state = if entry.leaving { AgentState::Leaving } else { AgentState::Disconnected };
            entry.record.state = state;
            entry.record.last_seen_ms = now;
            state
        };
        tracing::info!(agent_id, conn_id, %state, "agent stream ended");
        self.c.logs.fail_agent(agent_id);
        self.c.store.set_agent_state(agent_id, state, now).await?;
        // An agent of a Slurm allocation that Slurm ended: what it still ran is gone with it.
        let gone = super::slurm::ended_with_allocation(&self.c.lock(), agent_id);
        for id in gone {
            let report = lost_report(id, "its Slurm allocation ended");
            super::agents::observe(&super::reconcile::Reconciler(self.c), agent_id, &report).await?;
        }
        Ok(())
    }

    /// Notes that `agent_id` just sent something (every message of its stream counts, a
    /// heartbeat included). Takes no lock on the controller's state.
    pub fn seen(self, agent_id: &str) {
        self.c.heard.note(agent_id, self.c.now_ms());
    }

    /// Whether stream `conn_id` belongs to a host declared lost: it must end, and the agent
    /// say hello again.
    pub fn stream_fenced(self, conn_id: u64) -> bool {
        self.c.heard.is_fenced(conn_id)
    }
}

#[cfg(test)]
#[path = "nodes_tests.rs"]
mod tests;
