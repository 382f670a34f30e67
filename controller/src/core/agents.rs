//! Agents: hellos, disconnects, rank reports, receipts, and the reaper of vanished agents.

use std::collections::{BTreeMap, BTreeSet};
use tokio::time::Instant;

use tokio::sync::mpsc;
use trainyard_proto::v1::{
    CancelRanks, ControllerMessage, ForgetRanks, Hello, HelloAck, PreflightReport, RankAck, RankKey,
    RankReport, ReceiptAck, ReceiptBatch, controller_message::Msg,
};

use super::{AgentEntry, AgentLink, Controller, ControllerError, Result, rank_done};
use trainyard_model::receipts;
use trainyard_store::{
    AgentRecord, AgentState, JobState, NewReceipt, PreflightRecord, RankId, RankObserved, RankState,
};

/// Largest batch an agent may send; larger ones are refused as a protocol error.
pub const MAX_BATCH: usize = 20_000;

impl Controller {
    /// Registers an agent's stream: stores its inventory, adopts the ranks it reports, and sends
    /// again whatever it missed while away (launches of placed jobs, cancels of ended ones).
    /// Sends the hello ack first; returns the connection id (for [`Controller::agent_disconnected`]).
    pub async fn agent_hello(&self, hello: Hello, tx: mpsc::Sender<ControllerMessage>) -> Result<u64> {
        let agent_id = hello.agent_id.clone();
        // Checked before anything is stored, and again under the lock below (a racing hello).
        if self.lock().agents.get(&agent_id).is_some_and(|e| e.link.is_some()) {
            return Err(ControllerError::AlreadyConnected(agent_id));
        }
        let record = AgentRecord {
            agent_id: agent_id.clone(),
            address: hello.address.clone(),
            agent_version: hello.agent_version.clone(),
            inventory: hello.inventory.clone().unwrap_or_default().into(),
            state: AgentState::Connected,
            last_seen_ms: self.now_ms(),
            // A hello does not lift a cordon: the entry's is kept below.
            cordon: None,
        };
        self.store.upsert_agent(&record).await?;
        crate::metrics::metrics().agent_hellos.inc();
        let preflight = match hello.preflight.clone() {
            Some(report) => self.store_preflight(&agent_id, report).await?,
            None => None,
        };
        let reported: BTreeSet<RankId> = hello.ranks.iter().filter_map(|r| r.key.map(rank_id)).collect();
        let acks = self.acks_for(&reported).await?;
        let ack = HelloAck { protocol_version: trainyard_proto::PROTOCOL_VERSION, acks };
        // The ack goes first, so the agent knows where to resume before any launch arrives.
        if tx.try_send(ControllerMessage { msg: Some(Msg::HelloAck(ack)) }).is_err() {
            return Err(ControllerError::AgentGone(agent_id));
        }
        let (conn_id, lost) = {
            let mut core = self.lock();
            core.next_conn_id += 1;
            let conn_id = core.next_conn_id;
            let link = Some(AgentLink { conn_id, tx });
            // The newest report is the verdict: a hello without one, or with the report the agent
            // ran at start while a later re-run is stored, keeps what the node had (from the store
            // after a restart of the controller, or from before the reconnect).
            if core.agents.get(&agent_id).is_some_and(|e| e.link.is_some()) {
                return Err(ControllerError::AlreadyConnected(agent_id));
            }
            let previous = core.agents.get(&agent_id).and_then(|e| e.preflight.clone());
            let mut record = record;
            record.cordon = core.agents.get(&agent_id).and_then(|e| e.record.cordon.clone());
            let preflight = match (preflight, previous) {
                (Some(new), Some(old)) if old.report_id > new.report_id => Some(old),
                (new, old) => new.or(old),
            };
            let links = super::link_matrix(&record);
            let entry = AgentEntry {
                links,
                record,
                link,
                leaving: false,
                disconnected_since: None,
                preflight,
                unresponsive: false,
                seen_since_start: true,
            };
            self.agent_seen(&agent_id);
            let report = entry.preflight.clone();
            core.agents.insert(agent_id.clone(), entry);
            if let Some(report) = report {
                core.clear_by_preflight(&report);
            }
            core.ask_for_clearing(&agent_id);
            let lost = self.resend_missed(&mut core, &agent_id, &reported);
            (conn_id, lost)
        };
        tracing::info!(agent_id, conn_id, ranks = hello.ranks.len(), "agent connected");
        for report in &hello.ranks {
            self.observe(&agent_id, report).await?;
        }
        for id in lost {
            let message = format!("agent {agent_id} came back without it");
            self.observe(&agent_id, &lost_report(id, &super::faults::host_lost_message(&message))).await?;
        }
        self.wake();
        Ok(conn_id)
    }

    /// After a hello: ranks placed on this agent that it does not know are launched again if
    /// their job is still starting and they never started; the others are returned, to be
    /// recorded as lost.
    fn resend_missed(
        &self,
        core: &mut super::Core,
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
            let starting = matches!(job.record.state, JobState::Scheduled | JobState::Launching);
            let never_started = job
                .allocations
                .iter()
                .filter(|a| unknown.contains(&a.id))
                .all(|a| a.observed.state == RankState::Planned);
            if starting && never_started {
                relaunch.push(job.record.id);
            } else {
                lost.extend(unknown);
            }
        }
        for job_id in relaunch {
            tracing::info!(job_id, agent_id, "agent missed a launch; sending it again");
            let sent = self.send_launches(core, job_id, Some(agent_id));
            if let Some(job) = core.jobs.get_mut(&job_id) {
                job.launches_sent += sent;
            }
            core.dirty.insert(job_id);
        }
        lost
    }

    async fn acks_for(&self, reported: &BTreeSet<RankId>) -> Result<Vec<RankAck>> {
        let attempts: BTreeSet<(u64, u32)> = reported.iter().map(|r| (r.job_id, r.attempt)).collect();
        let mut acks = Vec::new();
        for (job_id, attempt) in attempts {
            for (rank, seq) in self.store.last_seqs(job_id, attempt).await? {
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
    pub async fn agent_preflight(&self, agent_id: &str, report: PreflightReport) -> Result<()> {
        let Some(report) = self.store_preflight(agent_id, report).await? else { return Ok(()) };
        {
            let mut core = self.lock();
            if let Some(entry) = core.agents.get_mut(agent_id)
                && entry.preflight.as_ref().is_none_or(|r| r.report_id <= report.report_id)
            {
                entry.preflight = Some(report.clone());
                core.clear_by_preflight(&report);
            }
        }
        self.store_cordons().await;
        self.bump();
        self.wake();
        Ok(())
    }

    /// Stores a report as the agent's own (an agent speaks only for itself) and returns it
    /// with its `report_id`; a malformed report is logged and dropped (`None`).
    async fn store_preflight(
        &self,
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
        report.report_id = self.store.insert_preflight(&report, self.now_ms()).await?;
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

    /// A rank changed state on an agent. A report about a rank of the current attempt that
    /// another agent runs is refused ([`ControllerError::NotYours`]); nothing is stored.
    pub async fn rank_update(&self, agent_id: &str, report: &RankReport) -> Result<()> {
        if let Some(id) = report.key.map(rank_id) {
            let core = self.lock();
            let current = core.jobs.get(&id.job_id).filter(|j| j.record.attempt == id.attempt);
            if let Some(a) = current.and_then(|j| j.allocations.iter().find(|a| a.id == id))
                && a.agent_id != agent_id
            {
                return Err(ControllerError::NotYours(format!(
                    "agent {agent_id} reported on rank {} of job {} attempt {}, which runs on {}; an agent speaks only for its own ranks",
                    id.rank, id.job_id, id.attempt, a.agent_id
                )));
            }
        }
        self.observe(agent_id, report).await
    }

    /// Records what an agent observed about one of its ranks: in the store, then in memory,
    /// then wakes the reconciler to move the job on. A report about a rank the controller is
    /// done with is answered with a stop or a forget instead.
    pub(super) async fn observe(&self, agent_id: &str, report: &RankReport) -> Result<()> {
        let Some(id) = report.key.map(rank_id) else { return Ok(()) };
        let state = match report.state() {
            Ok(RankState::Planned) => {
                tracing::warn!(
                    agent_id,
                    job_id = id.job_id,
                    rank = id.rank,
                    "ignoring a rank report of state planned, which agents do not send"
                );
                return Ok(());
            }
            Err(e) => {
                tracing::warn!(agent_id, job_id = id.job_id, rank = id.rank, error = %e, "ignoring a rank report");
                return Ok(());
            }
            Ok(state) => state,
        };
        let observed = RankObserved {
            state,
            pid: (report.pid > 0).then_some(report.pid),
            exit_code: (state == RankState::Exited && report.signal == 0).then_some(report.exit_code),
            signal: (report.signal != 0).then_some(report.signal),
            message: report.message.clone(),
            skipped_lines: report.skipped_lines,
            updated_at_ms: self.now_ms(),
            effective_cpus: report.effective_cpus.clone(),
            effective_mems: report.effective_mems.clone(),
        };
        {
            let mut core = self.lock();
            let known = core.jobs.get(&id.job_id).and_then(|j| {
                let current = j.record.attempt == id.attempt;
                j.allocations.iter().position(|a| a.id == id && a.agent_id == agent_id && current)
            });
            let Some(pos) = known else {
                self.answer_unknown(&mut core, agent_id, id, state);
                return Ok(());
            };
            // Fenced: the rank was declared lost with its host, and the attempt moves on
            // without it; the host came back with it still running, so it is stopped.
            let job = core.jobs.get(&id.job_id).expect("job looked up above");
            if job.allocations[pos].observed.state == RankState::Lost && !state.is_done() {
                tracing::warn!(
                    agent_id,
                    job_id = id.job_id,
                    rank = id.rank,
                    "a rank declared lost is still running on a returning host; stopping it"
                );
                self.answer_unknown(&mut core, agent_id, id, state);
                return Ok(());
            }
            // The rank-0 agent chose the attempt's MASTER_PORT: the other hosts can launch now.
            let port = u16::try_from(report.master_port).unwrap_or(0);
            let started = matches!(state, RankState::Launching | RankState::Running);
            let job = core.jobs.get_mut(&id.job_id).expect("job looked up above");
            if port > 0 && started && job.master_port.is_none() {
                job.master_port = Some(port);
                let sent = self.send_launches(&mut core, id.job_id, None);
                if let Some(job) = core.jobs.get_mut(&id.job_id) {
                    job.launches_sent = job.launches_sent.max(sent);
                }
                tracing::info!(
                    job_id = id.job_id,
                    attempt = id.attempt,
                    agent_id,
                    port,
                    waiting = sent.saturating_sub(1),
                    "MASTER_PORT chosen by the rank-0 host; launching the others"
                );
            }
            let job = core.jobs.get(&id.job_id).expect("job looked up above");
            if unchanged(&job.allocations[pos].observed, &observed) {
                return Ok(());
            }
        }
        self.store.observe_rank(id, &observed).await?;
        {
            let mut core = self.lock();
            let current = core.jobs.get_mut(&id.job_id).filter(|j| j.record.attempt == id.attempt);
            if let Some(a) = current.and_then(|j| j.allocations.iter_mut().find(|a| a.id == id)) {
                a.observed = observed;
            }
            core.dirty.insert(id.job_id);
        }
        tracing::debug!(job_id = id.job_id, rank = id.rank, state = %report.state, "rank update");
        self.bump();
        self.wake();
        Ok(())
    }

    /// A report about a rank of a job or attempt the controller is done with: stop it, then
    /// forget it.
    fn answer_unknown(&self, core: &mut super::Core, agent_id: &str, id: RankId, state: RankState) {
        let (job_id, attempt) = (id.job_id, id.attempt);
        if state.is_done() {
            core.send(agent_id, Msg::Forget(ForgetRanks { job_id, attempt }));
        } else {
            let reason = "the controller no longer runs this job attempt".to_string();
            let grace_ms = self.config.cancel_grace.as_millis() as u64;
            core.send(agent_id, Msg::Cancel(CancelRanks { job_id, attempt, grace_ms, reason }));
        }
    }

    /// The agent said it is stopping: place nothing new there.
    pub async fn agent_leaving(&self, agent_id: &str, reason: &str) -> Result<()> {
        if let Some(entry) = self.lock().agents.get_mut(agent_id) {
            entry.leaving = true;
        }
        tracing::info!(agent_id, reason, "agent is leaving");
        self.store.set_agent_state(agent_id, AgentState::Leaving, self.now_ms()).await?;
        Ok(())
    }

    /// The stream `conn_id` of an agent ended. A newer stream of the same agent is left alone.
    pub async fn agent_disconnected(&self, agent_id: &str, conn_id: u64) -> Result<()> {
        let now = self.now_ms();
        let state = {
            let mut core = self.lock();
            self.fenced.lock().unwrap_or_else(|p| p.into_inner()).remove(&conn_id);
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
        self.fail_logs_of(agent_id);
        self.store.set_agent_state(agent_id, state, now).await?;
        Ok(())
    }

    /// Stores a batch of receipts (one transaction) and returns the ack to send back: the
    /// highest seq per rank of the batch. Takes no lock on the controller's state.
    pub async fn ingest(&self, agent_id: &str, batch: ReceiptBatch) -> Result<ReceiptAck> {
        let arrived = std::time::Instant::now();
        let received = batch.receipts.len() as u64;
        let mut highest: BTreeMap<RankId, u64> = BTreeMap::new();
        let mut rows = Vec::with_capacity(batch.receipts.len());
        let (mut not_objects, mut flagged) = (0, 0);
        let mut news: BTreeMap<(u64, u32), super::faults::StepNews> = BTreeMap::new();
        for r in batch.receipts {
            let Some(id) = r.key.map(rank_id) else { continue };
            let seq = highest.entry(id).or_insert(r.seq);
            *seq = (*seq).max(r.seq);
            // Agents send only lines that parse as JSON objects; the views of both stores
            // read bodies as JSON, so anything else is acked and left out here.
            let Ok(checked) = receipts::check(&r.kind, &r.body) else {
                not_objects += 1;
                continue;
            };
            flagged += usize::from(checked.problem.is_some());
            let step = (r.step >= 0).then_some(r.step);
            super::faults::note_receipt(&mut news, id, (&r.kind, step), &r.body, checked.metrics.as_ref());
            let step = (r.step >= 0).then_some(r.step);
            let (problem, metrics) = (checked.problem, checked.metrics);
            rows.push(NewReceipt { id, seq: r.seq, kind: r.kind, step, body: r.body, problem, metrics });
        }
        if not_objects > 0 {
            tracing::warn!(not_objects, "dropping receipts whose body is not a JSON object");
        }
        if flagged > 0 {
            tracing::debug!(
                flagged,
                "storing receipts that break receipt schema v1, flagged (receipts.problem)"
            );
        }
        let mut held_back = 0;
        for job_id in self.check_senders(agent_id, &highest).await? {
            // Not acknowledged: the agent keeps them in the rank's file (up to its window) and
            // sends them again on its next stream, so nothing is lost if this controller is the
            // wrong one or its database is being restored.
            let held = rows.iter().filter(|r| r.id.job_id == job_id).count();
            tracing::warn!(
                agent_id,
                job_id,
                receipts = held,
                "receipts of a job this controller does not know: not stored and not acknowledged; the agent keeps them"
            );
            held_back += held as u64;
            rows.retain(|r| r.id.job_id != job_id);
            highest.retain(|id, _| id.job_id != job_id);
        }
        news.retain(|(job_id, _), _| highest.keys().any(|id| id.job_id == *job_id));
        self.note_steps(news);
        let mut stored = 0;
        if !rows.is_empty() {
            stored = self.store.insert_receipts(&rows, self.now_ms()).await?;
            self.bump();
        }
        let m = crate::metrics::metrics();
        m.receipts_ingested.inc_by(stored);
        m.receipts_skipped.inc_by(received.saturating_sub(stored + held_back));
        m.receipts_unknown_job.inc_by(held_back);
        m.receipts_flagged.inc_by(flagged as u64);
        m.receipt_batch.observe(arrived.elapsed().as_secs_f64());
        let acks = highest.into_iter().map(|(id, seq)| RankAck { key: Some(rank_key(id)), seq }).collect();
        Ok(ReceiptAck { acks })
    }
}

impl Controller {
    /// Checks that every rank a batch carries receipts of was given to `agent_id`: an agent
    /// speaks only for itself. Returns the jobs this controller does not know (a wiped
    /// database, a foreign controller), whose receipts are neither stored nor acknowledged. A batch nearly
    /// always holds one attempt of one job; the current attempt of an active job is checked in
    /// memory, others (late receipts of ended jobs or earlier attempts) in the store.
    pub(super) async fn check_senders(
        &self,
        agent_id: &str,
        ranks: &BTreeMap<RankId, u64>,
    ) -> Result<Vec<u64>> {
        let attempts: BTreeSet<(u64, u32)> = ranks.keys().map(|id| (id.job_id, id.attempt)).collect();
        let mut unknown = Vec::new();
        for (job_id, attempt) in attempts {
            // The current attempt of an active job: checked in place, under the lock, with
            // nothing copied (a batch arrives for every agent several times a second).
            let checked = {
                let core = self.lock();
                core.jobs.get(&job_id).filter(|j| j.record.attempt == attempt).map(|j| {
                    stranger(ranks, (job_id, attempt), agent_id, |rank| {
                        // Allocations are in rank order; a lookup by position, checked.
                        let at = j.allocations.get(rank as usize).filter(|a| a.id.rank == rank);
                        at.or_else(|| j.allocations.iter().find(|a| a.id.rank == rank))
                            .map(|a| a.agent_id.as_str())
                    })
                })
            };
            let stranger = match checked {
                Some(stranger) => stranger,
                None => {
                    if self.store.get_job(job_id).await?.is_none() {
                        unknown.push(job_id);
                        continue;
                    }
                    let allocations = self.store.allocations(job_id, attempt).await?;
                    let owners: BTreeMap<u32, String> =
                        allocations.into_iter().map(|a| (a.id.rank, a.agent_id)).collect();
                    stranger(ranks, (job_id, attempt), agent_id, |rank| owners.get(&rank).map(String::as_str))
                }
            };
            if let Some((rank, owner)) = stranger {
                return Err(ControllerError::NotYours(format!(
                    "agent {agent_id} sent receipts of rank {rank} of job {job_id} attempt {attempt}, which runs on {owner}; an agent speaks only for its own ranks"
                )));
            }
        }
        Ok(unknown)
    }
}

/// The first rank of `(job_id, attempt)` among `ranks` that `owner` says runs on an agent
/// other than `agent_id` (or on none), with that owner.
fn stranger<'a>(
    ranks: &BTreeMap<RankId, u64>,
    (job_id, attempt): (u64, u32),
    agent_id: &str,
    owner: impl Fn(u32) -> Option<&'a str>,
) -> Option<(u32, String)> {
    let of_attempt = ranks.keys().filter(|id| id.job_id == job_id && id.attempt == attempt);
    let mut owners = of_attempt.map(|id| (id.rank, owner(id.rank).unwrap_or("no agent")));
    owners.find(|(_, o)| *o != agent_id).map(|(rank, o)| (rank, o.to_string()))
}

/// Same report apart from its time: nothing to write.
fn unchanged(a: &RankObserved, b: &RankObserved) -> bool {
    (
        &a.state,
        a.pid,
        a.exit_code,
        a.signal,
        &a.message,
        a.skipped_lines,
        &a.effective_cpus,
        &a.effective_mems,
    ) == (
        &b.state,
        b.pid,
        b.exit_code,
        b.signal,
        &b.message,
        b.skipped_lines,
        &b.effective_cpus,
        &b.effective_mems,
    )
}

pub(super) fn lost_report(id: RankId, message: &str) -> RankReport {
    RankReport {
        key: Some(rank_key(id)),
        state: RankState::Lost.to_string(),
        exit_code: -1,
        message: message.to_string(),
        ..Default::default()
    }
}

pub(crate) fn rank_id(k: RankKey) -> RankId {
    RankId { job_id: k.job_id, attempt: k.attempt, rank: k.rank }
}

pub(crate) fn rank_key(id: RankId) -> RankKey {
    RankKey { job_id: id.job_id, attempt: id.attempt, rank: id.rank }
}
