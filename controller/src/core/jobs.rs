//! Submit, cancel, the per-job state machine and the scheduling pass.

use std::collections::BTreeMap;

use trainyard_proto::v1::{
    CancelRanks, ControllerMessage, ForgetRanks, JobSpec, Launch, RankAssignment, controller_message::Msg,
};

use super::{ActiveJob, Controller, ControllerError, Core, Result, now_ms, rank_done, rank_failure};
use crate::cost;
use crate::scheduler::{self, GpuView, NodeView, Placement, Request};
use crate::spec;
use crate::store::{Allocation, JobId, JobRecord, JobState, RankId, RankObserved, RankState, StoreError};

impl Controller {
    /// Validates, stores and queues a job; returns its id. Nothing is stored for a bad spec or
    /// one that no node set of the fleet could ever hold. With an idempotency `key`, a submit
    /// that was already stored (a client retrying after a lost reply) returns that job.
    pub async fn submit(&self, spec: JobSpec, key: Option<&str>) -> Result<JobId> {
        spec::validate(&spec)?;
        if let Some(key) = key
            && let Some(id) = self.submitted_before(&spec, key).await?
        {
            return Ok(id);
        }
        let mut core = self.core.lock().await;
        let request = request_of(0, &spec);
        let all_nodes = core.node_views(true);
        scheduler::feasible(&request, &all_nodes).map_err(ControllerError::Unsatisfiable)?;
        let record = match self.store.create_job(&spec, key, "submitted", now_ms()).await {
            Err(StoreError::Duplicate(_)) if let Some(key) = key => {
                // The same key raced in from another connection and won.
                drop(core);
                return self.submitted_before(&spec, key).await?.ok_or(StoreError::JobNotFound(0).into());
            }
            other => other?,
        };
        let id = record.id;
        tracing::info!(job_id = id, name = %spec.name, gpus = request.gpus, "job submitted");
        core.jobs.insert(id, ActiveJob { record, allocations: Vec::new(), master_port: None });
        self.bump();
        self.schedule_pass(&mut core).await?;
        Ok(id)
    }

    /// The job an earlier submit with `key` created, if any; an error if it had another spec.
    async fn submitted_before(&self, spec: &JobSpec, key: &str) -> Result<Option<JobId>> {
        let Some(job) = self.store.job_by_key(key).await? else { return Ok(None) };
        if &job.spec != spec {
            return Err(ControllerError::BadRequest(format!(
                "idempotency key {key:?} was used for job {} with a different spec",
                job.id
            )));
        }
        tracing::info!(job_id = job.id, key, "submit retried; returning the job it created");
        Ok(Some(job.id))
    }

    /// Cancels a job: pending jobs end at once; placed ones get their ranks stopped (SIGTERM,
    /// then SIGKILL after the grace period). Cancelling a finished job changes nothing.
    pub async fn cancel(&self, job_id: JobId, reason: &str) -> Result<JobRecord> {
        let mut core = self.core.lock().await;
        let Some(job) = core.jobs.get(&job_id) else {
            return self.store.get_job(job_id).await?.ok_or(ControllerError::JobNotFound(job_id));
        };
        if job.record.state.is_terminal() {
            return Ok(job.record.clone());
        }
        let reason = if reason.is_empty() { "cancelled by operator".to_string() } else { reason.to_string() };
        let record = self.move_job(&mut core, job_id, JobState::Cancelled, None, &reason).await?;
        self.stop_ranks(&mut core, job_id, &reason);
        self.settle(&mut core, job_id).await?;
        Ok(record)
    }

    /// Writes a transition to the store, then to memory.
    pub(super) async fn move_job(
        &self,
        core: &mut Core,
        job_id: JobId,
        to: JobState,
        attempt: Option<u32>,
        reason: &str,
    ) -> Result<JobRecord> {
        let job = core.jobs.get_mut(&job_id).ok_or(ControllerError::JobNotFound(job_id))?;
        let from = job.record.state;
        let attempt = attempt.unwrap_or(job.record.attempt);
        let record = self.store.transition(job_id, from, to, attempt, reason, now_ms()).await?;
        tracing::info!(job_id, from = %from, to = %to, attempt, reason, "job state changed");
        job.record = record.clone();
        self.bump();
        Ok(record)
    }

    /// Sends `CancelRanks` for the current attempt to every agent holding a rank that is
    /// not done yet.
    pub(super) fn stop_ranks(&self, core: &mut Core, job_id: JobId, reason: &str) {
        let Some(job) = core.jobs.get(&job_id) else { return };
        let attempt = job.record.attempt;
        let agents: Vec<String> = agents_of(job.allocations.iter().filter(|a| !rank_done(a)));
        let grace_ms = self.config.cancel_grace.as_millis() as u64;
        for agent in agents {
            let msg = Msg::Cancel(CancelRanks { job_id, attempt, grace_ms, reason: reason.to_string() });
            core.send(&agent, msg);
        }
    }

    /// Drives one job after its ranks changed: running, finished, failed, restarting, or gone.
    pub(super) async fn settle(&self, core: &mut Core, job_id: JobId) -> Result<()> {
        let Some(job) = core.jobs.get(&job_id) else { return Ok(()) };
        let state = job.record.state;
        let allocs = &job.allocations;
        let all_done = !allocs.is_empty() && allocs.iter().all(rank_done);
        let failure = allocs.iter().find_map(rank_failure);
        match state {
            JobState::Scheduled | JobState::Launching | JobState::Running if failure.is_some() => {
                let reason = failure.unwrap_or_default();
                self.fail_or_restart(core, job_id, &reason).await?;
                return Box::pin(self.settle(core, job_id)).await;
            }
            JobState::Scheduled | JobState::Launching | JobState::Running if all_done => {
                let reason = format!("all {} ranks exited with code 0", allocs.len());
                self.move_job(core, job_id, JobState::Succeeded, None, &reason).await?;
                return Box::pin(self.settle(core, job_id)).await;
            }
            JobState::Scheduled | JobState::Launching
                if allocs.iter().all(|a| a.observed.state == RankState::Running || rank_done(a)) =>
            {
                let reason = format!("all {} ranks running", allocs.len());
                self.move_job(core, job_id, JobState::Running, None, &reason).await?;
            }
            JobState::Restarting if all_done || allocs.is_empty() => {
                let next = job.record.attempt + 1;
                let reason =
                    format!("attempt {next} queued after every rank of attempt {} stopped", next - 1);
                self.forget(core, job_id);
                self.move_job(core, job_id, JobState::Pending, Some(next), &reason).await?;
                if let Some(job) = core.jobs.get_mut(&job_id) {
                    job.allocations.clear();
                }
                self.schedule_pass(core).await?;
            }
            s if s.is_terminal() && (all_done || allocs.is_empty()) => {
                self.forget(core, job_id);
                core.jobs.remove(&job_id);
                self.bump();
                self.schedule_pass(core).await?;
            }
            _ => {}
        }
        Ok(())
    }

    async fn fail_or_restart(&self, core: &mut Core, job_id: JobId, reason: &str) -> Result<()> {
        let Some(job) = core.jobs.get(&job_id) else { return Ok(()) };
        let max = job.record.spec.restart.as_ref().map_or(0, |r| r.max_restarts);
        let attempt = job.record.attempt;
        if attempt < max {
            let why = format!("{reason}; restarting (attempt {} of at most {})", attempt + 1, max);
            self.move_job(core, job_id, JobState::Restarting, None, &why).await?;
        } else {
            let why =
                if max > 0 { format!("{reason}; no restarts left ({max} used)") } else { reason.to_string() };
            self.move_job(core, job_id, JobState::Failed, None, &why).await?;
        }
        self.stop_ranks(core, job_id, reason);
        Ok(())
    }

    /// Tells the agents of a job's current attempt that the controller is done with its ranks.
    fn forget(&self, core: &mut Core, job_id: JobId) {
        let Some(job) = core.jobs.get(&job_id) else { return };
        let attempt = job.record.attempt;
        for agent in agents_of(job.allocations.iter()) {
            core.send(&agent, Msg::Forget(ForgetRanks { job_id, attempt }));
        }
    }

    /// Places pending jobs on free GPUs of connected agents and launches them.
    pub(super) async fn schedule_pass(&self, core: &mut Core) -> Result<()> {
        let queue: Vec<Request> = core
            .jobs
            .values()
            .filter(|j| j.record.state == JobState::Pending)
            .map(|j| request_of(j.record.id, &j.record.spec))
            .collect();
        if queue.is_empty() {
            core.waiting.clear();
            return Ok(());
        }
        let views = core.node_views(false);
        let outcome = scheduler::schedule(&queue, &views);
        core.waiting = outcome.waiting.into_iter().collect();
        for placement in outcome.placements {
            self.launch(core, placement, &views).await?;
        }
        Ok(())
    }

    /// Records a placement (with each rank's planned CPU/memory binding unless the job turned
    /// pinning off) and sends the launches.
    async fn launch(&self, core: &mut Core, placement: Placement, views: &[NodeView]) -> Result<()> {
        let job_id = placement.job_id;
        let Some(job) = core.jobs.get(&job_id) else { return Ok(()) };
        let attempt = job.record.attempt;
        let pin = !job.record.spec.disable_pinning;
        let bytes = job.record.spec.resources.as_ref().map_or(0, |r| r.comm_bytes_per_step);
        let now = now_ms();
        let allocations: Vec<Allocation> = placement
            .ranks()
            .map(|(rank, node_rank, local_rank, agent, gpu)| {
                let plan = views.iter().find(|v| v.agent_id == agent).filter(|_| pin).and_then(|v| {
                    let cores = core.agents.get(agent).map_or(&[][..], |e| &e.record.inventory.cores[..]);
                    scheduler::plan_cpus(v, gpu, cores)
                });
                Allocation {
                    id: RankId { job_id, attempt, rank },
                    agent_id: agent.to_string(),
                    gpu_index: gpu,
                    node_rank,
                    local_rank,
                    planned_cpus: plan.as_ref().map(|p| p.cpus.clone()).unwrap_or_default(),
                    planned_mems: plan.map(|p| p.numa_node.to_string()).unwrap_or_default(),
                    observed: RankObserved {
                        state: RankState::Planned,
                        updated_at_ms: now,
                        ..Default::default()
                    },
                }
            })
            .collect();
        let nodes = placement.nodes.len();
        let predicted = cost::step_comm_ms(bytes, placement.world_size(), placement.bottleneck);
        let mut reason = format!(
            "placed {} ranks on {nodes} node(s); slowest link {}",
            allocations.len(),
            placement.bottleneck.label()
        );
        if predicted > 0.0 {
            reason.push_str(&format!("; predicted communication {predicted:.1} ms per step"));
        }
        let record = self.store.schedule(job_id, attempt, &allocations, &reason, now).await?;
        tracing::info!(job_id, attempt, ranks = allocations.len(), nodes, "job scheduled");
        if let Some(job) = core.jobs.get_mut(&job_id) {
            job.record = record;
            job.allocations = allocations;
            job.master_port = None;
        }
        self.bump();
        let sent = self.send_launches(core, job_id, None);
        let reason = format!("launch sent to {sent} of {nodes} node(s)");
        self.move_job(core, job_id, JobState::Launching, None, &reason).await?;
        Ok(())
    }

    /// Sends `Launch` to every agent of the job (or only `only`); returns how many were sent.
    pub(super) fn send_launches(&self, core: &mut Core, job_id: JobId, only: Option<&str>) -> usize {
        let Some(job) = core.jobs.get(&job_id) else { return 0 };
        let launches = launch_messages(core, job);
        let mut sent = 0;
        for (agent, launch) in launches {
            if only.is_none_or(|o| o == agent) && core.send(&agent, Msg::Launch(launch)) {
                sent += 1;
            }
        }
        sent
    }
}

impl Core {
    /// Sends a message to an agent's stream. A full or closed stream drops the link: the agent
    /// reconnects, and its hello makes the controller send again whatever is still needed.
    pub(super) fn send(&mut self, agent_id: &str, msg: Msg) -> bool {
        let Some(entry) = self.agents.get_mut(agent_id) else { return false };
        let Some(link) = &entry.link else { return false };
        match link.tx.try_send(ControllerMessage { msg: Some(msg) }) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(agent_id, error = %e, "agent stream not taking messages; dropping the link");
                entry.link = None;
                entry.disconnected_since = Some(std::time::Instant::now());
                false
            }
        }
    }

    /// The fleet as the scheduler sees it. `all`: every known agent with every GPU free (for
    /// feasibility, failing nodes included: an operator can fix them); otherwise connected
    /// agents that are not leaving and whose newest preflight verdict is not `fail`, with busy
    /// GPUs marked.
    pub(super) fn node_views(&self, all: bool) -> Vec<NodeView> {
        let mut busy: BTreeMap<(&str, u32), ()> = BTreeMap::new();
        for job in self.jobs.values() {
            for a in job.allocations.iter().filter(|a| !rank_done(a) || !job.record.state.is_terminal()) {
                busy.insert((a.agent_id.as_str(), a.gpu_index), ());
            }
        }
        self.agents
            .values()
            .filter(|e| all || (e.link.is_some() && !e.leaving && !e.unresponsive && !e.failing()))
            .map(|e| {
                let inv = &e.record.inventory;
                let id = e.record.agent_id.as_str();
                let gpus = inv
                    .gpus
                    .iter()
                    .map(|g| GpuView {
                        index: g.index,
                        model: g.model.clone(),
                        memory_mib: g.memory_mib,
                        free: all || !busy.contains_key(&(id, g.index)),
                        numa_node: g.numa_node,
                    })
                    .collect();
                NodeView {
                    agent_id: e.record.agent_id.clone(),
                    gpus,
                    links: inv.links.clone(),
                    interconnect_class: e
                        .preflight
                        .as_ref()
                        .map(|r| r.interconnect_class.clone())
                        .unwrap_or_default(),
                    numa_cpus: inv.numa_nodes.iter().map(|n| (n.id, n.cpus.clone())).collect(),
                }
            })
            .collect()
    }
}

fn request_of(job_id: JobId, spec: &JobSpec) -> Request {
    let res = spec.resources.clone().unwrap_or_default();
    Request {
        job_id,
        priority: spec.priority,
        gpus: res.gpus,
        gpus_per_node: res.gpus_per_node,
        gpu_model: res.gpu_model,
        min_gpu_memory_mib: res.min_gpu_memory_mib,
        interconnect: res.interconnect,
    }
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
                job_id: job.record.id,
                attempt: job.record.attempt,
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
                spec: Some(job.record.spec.clone()),
            };
            (agent.to_string(), launch)
        })
        .collect()
}
