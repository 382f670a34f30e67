//! The reconciler: the one task that moves jobs between states, places pending jobs and sends
//! their launches (see the module documentation of `core`).
//!
//! Each step is decided under the lock from memory alone ([`decide`], pure), written to the
//! store without the lock, and applied to memory under it again. A store error ends the step
//! for that job only: it stays dirty and the next pass (at most 500 ms later) tries again.

use super::Result;
use super::faults::{self, Finding};
use super::shared::Shared;
use super::state::{Core, rank_done};
use trainyard_model::spec::JobSpec;
use trainyard_placement::cost;
use trainyard_placement::scheduler::{self, NodeView, Placement};
use trainyard_store::{
    Allocation, FailureRecord, JobId, JobRecord, JobState, RankId, RankObserved, RankState,
};

/// What a job needs next.
#[derive(Debug, Clone, PartialEq)]
enum Step {
    /// A transition to write (with the failure that caused it, if one did), and what to do
    /// once it is stored.
    Move {
        from: JobState,
        to: JobState,
        attempt: u32,
        reason: String,
        then: Then,
        failure: Option<Box<FailureRecord>>,
    },
    /// Finished and every rank stopped: tell the agents to forget it and drop it from memory.
    Forget,
}

#[derive(Debug, Clone, PartialEq)]
enum Then {
    Nothing,
    /// Stop the ranks of the current attempt that are not done, with this reason.
    StopRanks(String),
    /// A new attempt begins: the old one's allocations are history.
    NextAttempt,
}

/// The next step of one job, from what memory holds about it and what its ranks' failure is
/// ([`faults::classify`]); `None` when it is where it should be.
fn decide(job: &ActiveJob, finding: Finding) -> Option<Step> {
    let state = job.record.state;
    let attempt = job.record.attempt;
    let allocs = &job.allocations;
    let all_done = !allocs.is_empty() && allocs.iter().all(rank_done);
    let to = |to: JobState, reason: String, then: Then| {
        Some(Step::Move { from: state, to, attempt, reason, then, failure: None })
    };
    if let Some(reason) = &job.cancel
        && !state.is_terminal()
    {
        return to(JobState::Cancelled, reason.clone(), Then::StopRanks(reason.clone()));
    }
    let placed = matches!(state, JobState::Scheduled | JobState::Launching | JobState::Running);
    match (state, finding) {
        (_, Finding::Failed(f)) if placed => {
            let (to, reason) = faults::after_failure(job, &f);
            let stop = Then::StopRanks(format!("{}: {}", f.kind, f.evidence));
            Some(Step::Move { from: state, to, attempt, reason, then: stop, failure: Some(Box::new(f)) })
        }
        // A rank failed while a peer host is silent: its verdict decides the kind.
        (_, Finding::Undecided) if placed => None,
        _ if placed && all_done => {
            to(JobState::Succeeded, format!("all {} ranks exited with code 0", allocs.len()), Then::Nothing)
        }
        (JobState::Scheduled, _) if job.launches_sent > 0 => {
            let nodes = nodes_of(allocs);
            to(
                JobState::Launching,
                format!("launch sent to {} of {nodes} node(s)", job.launches_sent),
                Then::Nothing,
            )
        }
        (JobState::Launching, _)
            if allocs.iter().all(|a| a.observed.state == RankState::Running || rank_done(a)) =>
        {
            to(JobState::Running, format!("all {} ranks running", allocs.len()), Then::Nothing)
        }
        (JobState::Restarting, _) if all_done || allocs.is_empty() => {
            let next = attempt + 1;
            let wait = job.record.spec.backoff.delay(job.streak.saturating_sub(1));
            let reason = format!(
                "attempt {next} queued after every rank of attempt {attempt} stopped; placed after a backoff of {:.1} s",
                wait.as_secs_f64()
            );
            Some(Step::Move {
                from: state,
                to: JobState::Pending,
                attempt: next,
                reason,
                then: Then::NextAttempt,
                failure: None,
            })
        }
        (s, _) if s.is_terminal() && (all_done || allocs.is_empty()) => Some(Step::Forget),
        _ => None,
    }
}

/// Logs and counts a job's move between states that was just stored.
fn note_move(
    job_id: JobId,
    (from, to): (JobState, JobState),
    attempt: u32,
    reason: &str,
    failure: Option<&FailureRecord>,
) {
    tracing::info!(job_id, from = %from, to = %to, attempt, reason, "job state changed");
    if let Some(f) = failure {
        let label = crate::metrics::FailureLabel { kind: f.kind.to_string(), blamed: f.blamed.to_string() };
        crate::metrics::metrics().failures.get_or_create(&label).inc();
    }
    if to.is_terminal() {
        let state = crate::metrics::StateLabel { state: to.to_string() };
        crate::metrics::metrics().jobs_finished.get_or_create(&state).inc();
    }
}

/// A stored move (`record`, in its new state), applied to the job in memory: a next attempt
/// starts clean after its backoff, a failure is charged, a running attempt starts its clock.
fn apply_move(
    job: &mut ActiveJob,
    record: JobRecord,
    then: &Then,
    failure: Option<&FailureRecord>,
    resume_from: Vec<trainyard_proto::v1::ResumePoint>,
) {
    job.record = record;
    if *then == Then::NextAttempt {
        job.allocations.clear();
        job.launches_sent = 0;
        job.master_port = None;
        job.detected = None;
        job.eviction = None;
        job.host_wait = None;
        job.resume_from = resume_from;
        let wait = job.record.spec.backoff.delay(job.streak.saturating_sub(1));
        job.not_before = Some(tokio::time::Instant::now() + wait);
        job.running_since = None;
    }
    if let Some(f) = failure {
        job.detected = None;
        job.host_wait = None;
        job.charged += u32::from(f.charged);
        job.streak = super::faults::next_streak(job.streak, job.running_since);
    }
    if job.record.state == JobState::Running {
        job.running_since = Some(tokio::time::Instant::now());
    }
}

fn nodes_of(allocs: &[Allocation]) -> usize {
    allocs.iter().map(|a| a.agent_id.as_str()).collect::<std::collections::BTreeSet<_>>().len()
}

/// The running controller places pending jobs at most this often. A pass over 1,000 nodes
/// takes milliseconds under the core's lock, and at that scale wakes come hundreds of times a
/// second (every rank report): unpaced, back-to-back passes took a third of the leader's CPU
/// in the 1,000-host soak. A submit to a controller with nothing pending is still placed at
/// once.
pub(super) const SCHEDULE_EVERY: std::time::Duration = std::time::Duration::from_millis(100);

/// A placement turned into the rows to store, decided under the lock.
struct Plan {
    job_id: JobId,
    attempt: u32,
    allocations: Vec<Allocation>,
    reason: String,
}

/// The reconciler: the one path by which a job's state moves. A view of the core's shared
/// parts (`Reconciler(&shared)`: the store, the settings, the core's state, the clock, and the
/// wake-ups of the `Watch` streams and of the reconciler's own loop) with the moves as its
/// methods. Only this module writes a job's record (`ActiveJob::record` is visible to it
/// alone); everything else marks jobs for it (`Core::dirty`) or records what it must act on
/// (a rank's report, a detected failure, a cancel, an eviction).
#[derive(Clone, Copy)]
pub(super) struct Reconciler<'a>(pub(super) &'a Shared);

impl std::ops::Deref for Reconciler<'_> {
    type Target = Shared;

    fn deref(&self) -> &Shared {
        self.0
    }
}

impl Reconciler<'_> {
    /// One pass: settles every job a request marked (or every job, after
    /// [`Reconciler::mark_all`]), then places what is pending. The core's tests call it
    /// directly, with no task running; the running controller paces the placing
    /// ([`Reconciler::reconcile_paced`]).
    #[cfg(test)]
    pub(super) async fn reconcile(&self) {
        self.settle_dirty().await;
        self.schedule_logged().await;
    }

    /// [`Reconciler::reconcile`] as the running controller takes it: the woken jobs are settled
    /// at once, and a scheduling pass that finds jobs pending runs at most every
    /// [`SCHEDULE_EVERY`]. Returns false when a pass is owed: the caller comes back at
    /// `next_pass`.
    pub(super) async fn reconcile_paced(&self, next_pass: &mut tokio::time::Instant) -> bool {
        self.settle_dirty().await;
        let now = tokio::time::Instant::now();
        if now < *next_pass {
            return false;
        }
        // Only a pass that had something to place starts the interval: a submit to a
        // controller with nothing pending is placed at once.
        if self.schedule_logged().await {
            *next_pass = now + SCHEDULE_EVERY;
        }
        true
    }

    pub(super) async fn settle_dirty(&self) {
        let dirty: Vec<JobId> = std::mem::take(&mut self.lock().dirty).into_iter().collect();
        for job_id in dirty {
            self.settle_logged(job_id).await;
        }
        super::slurm::dismiss_ended(&mut self.lock());
    }

    /// A scheduling pass; whether it ran the scheduler (something was pending), which a failed
    /// one counts as.
    async fn schedule_logged(&self) -> bool {
        match self.schedule_pass().await {
            Ok(scheduled) => scheduled,
            Err(e) => {
                tracing::error!(error = %e, "scheduling pass failed; trying again on the next pass");
                true
            }
        }
    }

    /// Marks every job for the next pass (the periodic pass: a step a store error cut short is
    /// taken again).
    pub(super) fn mark_all(&self) {
        let mut core = self.lock();
        let ids: Vec<JobId> = core.jobs.keys().copied().collect();
        core.dirty.extend(ids);
    }

    async fn settle_logged(&self, job_id: JobId) {
        if let Err(e) = self.settle(job_id).await {
            tracing::error!(job_id, error = %e, "failed to move the job on; trying again on the next pass");
            self.lock().dirty.insert(job_id);
        }
    }

    /// Takes the steps of one job until it needs none.
    async fn settle(&self, job_id: JobId) -> Result<()> {
        loop {
            let step = {
                let core = self.lock();
                let Some(job) = core.jobs.get(&job_id) else { return Ok(()) };
                let (silent, leaving) = super::faults::silent_and_leaving(&core, job);
                decide(job, faults::classify(job, &silent, &leaving, self.now_ms()))
            };
            match step {
                None => return Ok(()),
                Some(Step::Forget) => {
                    {
                        let mut core = self.lock();
                        super::launch::forget(&mut core, job_id);
                        core.jobs.remove(&job_id);
                        core.ended.push(job_id);
                    }
                    self.bump();
                }
                Some(Step::Move { from, to, attempt, reason, then, failure }) => {
                    if then == Then::NextAttempt {
                        let mut core = self.lock();
                        super::launch::forget(&mut core, job_id);
                    }
                    let resume_from = match then {
                        Then::NextAttempt => {
                            let spec = self.lock().jobs.get(&job_id).map(|j| j.record.spec.clone());
                            match spec {
                                Some(spec) => {
                                    super::resume::points_of(self.store.as_ref(), job_id, &spec).await?
                                }
                                None => Vec::new(),
                            }
                        }
                        _ => Vec::new(),
                    };
                    let record = match &failure {
                        Some(f) => self.store.fail_attempt(job_id, from, to, attempt, &reason, f).await?,
                        None => {
                            self.store.transition(job_id, from, to, attempt, &reason, self.now_ms()).await?
                        }
                    };
                    note_move(job_id, (from, to), attempt, &reason, failure.as_deref());
                    {
                        let mut core = self.lock();
                        if let Some(job) = core.jobs.get_mut(&job_id) {
                            apply_move(job, record, &then, failure.as_deref(), resume_from);
                        }
                        if let Some(f) = &failure {
                            super::faults::blame(&mut core, f, &self.config);
                        }
                        if let Then::StopRanks(why) = &then {
                            super::launch::stop_ranks(&mut core, job_id, why, self.config.cancel_grace);
                        }
                    }
                    super::faults::store_cordons(self.store.as_ref(), &self.core).await;
                    self.bump();
                }
            }
        }
    }

    /// Places pending jobs on free GPUs of connected agents, records each placement and sends
    /// its launches. A placement that cannot be recorded leaves its job pending (and says why
    /// in `ctl status`); the others go ahead.
    async fn schedule_pass(&self) -> Result<bool> {
        let plans = {
            let mut core = self.lock();
            let now = tokio::time::Instant::now();
            let pending =
                core.jobs.values().filter(|j| j.record.state == JobState::Pending && j.cancel.is_none());
            let (ready, backing_off): (Vec<&ActiveJob>, Vec<&ActiveJob>) =
                pending.partition(|j| j.not_before.is_none_or(|t| t <= now));
            let backoff: Vec<(JobId, String)> = backing_off
                .iter()
                .map(|j| {
                    let left = j.not_before.map_or(0.0, |t| t.saturating_duration_since(now).as_secs_f64());
                    (j.record.id, format!("restart backoff: placed in {left:.1} s"))
                })
                .collect();
            let queue: Vec<scheduler::Request> = ready
                .iter()
                .map(|j| {
                    let mut req = super::launch::request_of(j.record.id, &j.record.spec);
                    req.avoid = j.avoid.keys().cloned().collect();
                    req.priority =
                        aged(req.priority, self.now_ms() - j.record.updated_at_ms, self.config.age_every);
                    req
                })
                .collect();
            core.waiting = backoff.into_iter().collect();
            if queue.is_empty() {
                return Ok(false);
            }
            // A `[slurm]` job goes only on the agents of its own allocation, and they take no other.
            let (own, queue): (Vec<_>, Vec<_>) = queue
                .into_iter()
                .partition(|r| core.jobs.get(&r.job_id).is_some_and(|j| j.record.spec.slurm.is_some()));
            let mut views = super::launch::node_views(&core, false);
            let started = std::time::Instant::now();
            let outcome = scheduler::schedule(&queue, &views);
            crate::metrics::metrics().schedule_pass.observe(started.elapsed().as_secs_f64());
            core.waiting.extend(outcome.waiting);
            let mut placements = outcome.placements;
            placements.extend(shrunk(&core, &queue, &views, &placements));
            for p in &placements {
                core.waiting.remove(&p.job_id);
            }
            super::evict::preempt(&mut core, &self.config, &queue, &views);
            super::slurm::place_in_allocations(&mut core, &own, &mut views, &mut placements);
            let now = self.now_ms();
            placements.into_iter().filter_map(|p| plan(&core, p, &views, now)).collect::<Vec<_>>()
        };
        for plan in plans {
            let Plan { job_id, attempt, allocations, reason } = plan;
            match self.store.schedule(job_id, attempt, &allocations, &reason, self.now_ms()).await {
                Ok(record) => {
                    tracing::info!(job_id, attempt, ranks = allocations.len(), "job scheduled");
                    {
                        let mut core = self.lock();
                        if let Some(job) = core.jobs.get_mut(&job_id) {
                            job.record = record;
                            job.allocations = allocations;
                            job.master_port = None;
                            job.launches_sent = 0;
                        }
                        let sent =
                            super::launch::send_launches(&mut core, job_id, super::launch::LaunchTo::All);
                        if let Some(job) = core.jobs.get_mut(&job_id) {
                            job.launches_sent = sent;
                        }
                    }
                    self.bump();
                    self.settle_logged(job_id).await;
                }
                Err(e) => {
                    tracing::error!(job_id, error = %e, "failed to record a placement; the job stays pending");
                    let why = format!("its placement could not be recorded ({e}); trying again");
                    self.lock().waiting.insert(job_id, why);
                }
            }
        }
        Ok(true)
    }
}

/// A restart that may run smaller (`restart.min_gpus`) and was left waiting at full size, at the
/// head of the queue: placed at the largest size from `gpus` down to `min_gpus` (in steps of
/// `gpus_per_node`) that fits on what the pass's placements left free.
fn shrunk(
    core: &Core,
    queue: &[scheduler::Request],
    views: &[NodeView],
    placed: &[Placement],
) -> Option<Placement> {
    let mut free = views.to_vec();
    for n in placed.iter().flat_map(|p| &p.nodes) {
        if let Some(view) = free.iter_mut().find(|v| v.agent_id == n.agent_id) {
            for g in view.gpus.iter_mut().filter(|g| n.gpus.contains(&g.index)) {
                g.free = false;
            }
        }
    }
    // Only the head of the waiting queue shrinks: a smaller restart must not take the GPUs a job
    // ahead of it waits for.
    let head = queue
        .iter()
        .filter(|r| core.waiting.contains_key(&r.job_id))
        .min_by_key(|r| (std::cmp::Reverse(r.priority), r.job_id));
    let req = head?;
    let job = core.jobs.get(&req.job_id)?;
    let min = job.record.spec.min_gpus;
    if job.record.attempt == 0 || min == 0 || min >= req.gpus {
        return None;
    }
    let step = req.gpus_per_node.max(1);
    let mut sizes = (min..req.gpus).rev().filter(|g| g % step == 0);
    sizes.find_map(|gpus| scheduler::place(&scheduler::Request { gpus, ..req.clone() }, &free))
}

/// A waiting job's priority after `waited_ms` of waiting: one point more per `every` (none when
/// `every` is zero), so a low-priority job is never starved for good.
fn aged(priority: i32, waited_ms: i64, every: std::time::Duration) -> i32 {
    let every_ms = every.as_millis() as i64;
    if every_ms == 0 || waited_ms <= 0 {
        return priority;
    }
    priority.saturating_add(i32::try_from(waited_ms / every_ms).unwrap_or(i32::MAX))
}

/// The allocations of a placement (with each rank's planned CPU/memory binding unless the job
/// turned pinning off) and the reason of its `scheduled` event.
fn plan(core: &Core, placement: Placement, views: &[NodeView], now_ms: i64) -> Option<Plan> {
    let job_id = placement.job_id;
    let job = core.jobs.get(&job_id)?;
    let attempt = job.record.attempt;
    let spec: &JobSpec = &job.record.spec;
    let pin = !spec.disable_pinning;
    let bytes = spec.resources.comm_bytes_per_step;
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
                    updated_at_ms: now_ms,
                    ..Default::default()
                },
            }
        })
        .collect();
    let predicted = cost::step_comm_ms(bytes, placement.world_size(), placement.bottleneck);
    let mut reason = format!(
        "placed {} ranks on {} node(s); slowest link {}",
        allocations.len(),
        placement.nodes.len(),
        placement.bottleneck.label()
    );
    if allocations.len() < spec.resources.gpus as usize {
        reason.push_str(&format!(
            "; {} of its {} GPUs: the full size does not fit now and restart.min_gpus is {}",
            allocations.len(),
            spec.resources.gpus,
            spec.min_gpus
        ));
    }
    if predicted > 0.0 {
        reason.push_str(&format!("; predicted communication {predicted:.1} ms per step"));
    }
    Some(Plan { job_id, attempt, allocations, reason })
}

mod job;
#[cfg(test)]
mod tests;

pub(super) use job::{ActiveJob, Eviction, HostWait};
