//! The controller's state and the single place that changes it.
//!
//! Intent and observation meet here: the scheduler writes placements (intent), agents report
//! what their ranks do (observed), and one reconciler drives each job from one to the other.
//! Every change goes to the store first and to memory second, so a controller killed at any
//! moment restarts from the store ([`Controller::start`]) and the agents' hellos fill in the rest.
//!
//! Requests only record: a submit stores its job, a rank report stores its observation, a
//! cancel marks the job; then they wake the reconciler ([`Controller::run_background`]), the
//! one task that moves jobs between states, schedules and launches. Because it is the only
//! writer of job states, it can decide under the lock, write to the store without it, and
//! apply the result under it again: nothing else could have moved the job in between. A store
//! error while placing one job is logged and retried on the next pass; it fails nobody's request.
//!
//! The in-memory state sits behind a `std::sync::Mutex`, not a Tokio one: no `.await` happens
//! while it is held (the compiler refuses a guard held across one, since the futures are
//! `Send`), so no request ever waits behind an fsync or a network round trip. Receipt
//! ingestion, the hot path, never takes it.
//!
//! Time comes from [`Clock`], which follows Tokio's clock: tests pause and advance it.
//!
//! # The way in: five services
//! Every request reaches the state and the store through one of these, each one type with one
//! `impl` in one file; nothing outside the core holds the store.
//! - [`Jobs`] (`jobs`): submit, cancel, jobs as `ctl` and the web view read them, rank reports,
//!   logs.
//! - [`Nodes`] (`nodes`): the fleet table, preflights on request, cordons and drains, and what
//!   each agent's stream says about its node (hello, preflight reports, notices, leaving).
//! - [`Receipts`] (`receipts`): step receipts and GPU telemetry in, and their reads.
//! - [`Diagnoses`] (`diagnosis`): `Diagnose`, `Compare`, goodput, live findings, and the outcome
//!   recorded at a job's end.
//! - [`Auth`] (`auth`): users, tokens and the audit log.
//!
//! # Inside
//! - `reconcile`: the reconciler: settling jobs, restarts, the scheduling pass and launches.
//! - `launch`: the messages that start, stop and forget ranks; the fleet as the scheduler sees it.
//! - `fleet`: each node's state as the table shows it, busy GPUs, hostnames to agent ids.
//! - `agents`: what agents observe about their ranks, and the check that an agent speaks only
//!   for its own ranks.
//! - `liveness`: unresponsive agents, and the reaper of lost hosts.
//! - `faults`: what ended an attempt (rank exit, host lost, hang), blame, exclusion, cordons,
//!   backoff, and the watch on each job's steps that finds hangs.
//! - `view`: a job's summary as `ctl` shows it, read from the store.
//! - `evict`: drains and preemption notices (checkpoint, then move without the node).
//! - `resume`: the checkpoints a restarted attempt resumes from.
//! - `live`: the live diagnosis of running jobs: findings opened, updated, closed, alerted.
//! - `telemetry`: XIDs that drain a node, and the retention of telemetry windows.
//! - `logs`: the relay of a rank's logs from its agent to the client.
//! - `leader`: leadership of a controller group on PostgreSQL: elections, lease, step-down.
//! - `follow`: a follower of a controller group: reads mirrored from the store, writers
//!   referred to the leader.

mod agents;
pub mod auth;
pub use auth::Auth;
mod diagnosis;
pub use diagnosis::Diagnoses;
mod evict;
mod faults;
mod follow;
pub use follow::{MIRROR_EVERY, NotLeader, Role};
#[cfg(test)]
mod faults_tests;
pub use evict::{DEFAULT_DRAIN_DEADLINE, DEFAULT_NOTICE_DEADLINE};
pub use receipts::{MAX_BATCH, Receipts};
mod jobs;
pub mod leader;
pub use jobs::Jobs;
mod launch;
mod live;
#[cfg(test)]
mod live_tests;
mod liveness;
mod logs;
mod receipts;
mod reconcile;
mod resume;
mod telemetry;
pub use logs::LogEvent;
mod fleet;
mod nodes;
pub use nodes::{Nodes, PREFLIGHT_RUN_LEVELS, PREFLIGHT_RUN_TIMEOUT};
#[cfg(test)]
mod agent_message_props;
#[cfg(test)]
mod lifecycle_tests;
#[cfg(test)]
mod test_support;
mod view;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{Notify, mpsc, watch};
use tokio::time::Instant;
use trainyard_proto::v1::ControllerMessage;

use crate::config::ControllerConfig;
use trainyard_model::spec::SpecError;
use trainyard_store::{AgentRecord, Allocation, JobId, JobRecord, RankState, Store, StoreError};

/// Errors an operator or agent request can end in; mapped to `tonic::Status` in
/// `crate::service::to_status`.
#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    #[error("job spec rejected: {0}")]
    InvalidSpec(#[from] SpecError),
    #[error("job spec rejected: resources: {0}")]
    Unsatisfiable(String),
    #[error("job {0} not found")]
    JobNotFound(JobId),
    #[error("agent {0} closed its stream")]
    AgentGone(String),
    #[error("no node {0} is known to this controller (`ctl nodes` lists the known ones)")]
    AgentNotFound(String),
    #[error("node {0} is not connected, so it cannot run a preflight now")]
    AgentNotConnected(String),
    #[error("node {0} has not sent a preflight report yet (`ctl preflight {0} --run quick` asks for one)")]
    NoPreflight(String),
    #[error("node {agent} did not report its {level} preflight within {waited_s} s; see the agent's log")]
    PreflightTimeout { agent: String, level: String, waited_s: u64 },
    #[error("request rejected: {0}")]
    BadRequest(String),
    /// The logs cannot be read now (no ranks yet, the node is not connected), and why.
    #[error("{0}")]
    LogsUnavailable(String),
    /// A second stream of an agent that is connected: refused until the first one ends.
    #[error(
        "agent {0} is already connected; a second stream is refused until the first one ends (a dead one ends within ~30 s)"
    )]
    AlreadyConnected(String),
    /// An agent spoke for a rank it was not given (another agent's, or none at all).
    #[error("{0}")]
    NotYours(String),
    /// A per-user cap on a shared resource (pending jobs, open streams) is reached.
    #[error("{0}")]
    TooMany(String),
    /// This controller follows another in its group: writes go to the leader.
    #[error("{0}")]
    NotLeader(follow::NotLeader),
    #[error(transparent)]
    Store(#[from] StoreError),
}

pub type Result<T, E = ControllerError> = std::result::Result<T, E>;

/// The controller: its store, its in-memory view of the fleet and its jobs, and a change
/// counter that watchers wait on.
pub struct Controller {
    store: Arc<dyn Store>,
    /// Users, tokens and the audit log (over the same store).
    auth: Auth,
    config: ControllerConfig,
    /// Leader (the one writer) or follower (reads only; `follow`).
    role: Role,
    /// Never held across an `.await` (see the module documentation).
    core: Mutex<Core>,
    /// Wakes the reconciler: a job or an agent changed and it may have work.
    wake: Notify,
    clock: Clock,
    /// Bumped whenever receipts are stored or a job changes; `Watch` streams wait on it.
    changes: watch::Sender<u64>,
    /// When each agent last sent anything (a heartbeat or any other message), in ms. A
    /// `std::sync::Mutex`, not the core's lock: every message of every agent touches it, no
    /// `.await` happens while it is held, and the liveness check reads it twice a second.
    seen: std::sync::Mutex<HashMap<String, i64>>,
    /// When `last_seen_ms` was last written to the store (at most every [`SEEN_PERSIST_EVERY`]).
    seen_persisted: std::sync::Mutex<Instant>,
    /// Open `Logs` requests by id (see `logs`), and the last id handed out.
    logs: std::sync::Mutex<HashMap<u64, logs::LogWaiter>>,
    next_log_request: std::sync::atomic::AtomicU64,
    /// When each running job's ranks last wrote a step receipt (the hang watch). Its own
    /// `std::sync::Mutex`: ingest updates it once per batch and never takes the core's lock.
    steps: std::sync::Mutex<HashMap<JobId, faults::StepWatch>>,
    /// When this controller started: host-loss and hang clocks wait `reconnect_grace` after it.
    started: Instant,
    /// Turns to record an ended job's outcome (`diagnosis::OUTCOMES_AT_ONCE` at a time).
    outcomes: tokio::sync::Semaphore,
    /// Streams of hosts declared lost while their stream stayed open (a cut network): the
    /// next message on one ends it, so the agent must say hello again and have the ranks of
    /// old attempts stopped. Its own small lock: every agent message checks it.
    fenced: std::sync::Mutex<std::collections::HashSet<u64>>,
}

/// How often heartbeats move `agents.last_seen_ms` forward in the store.
const SEEN_PERSIST_EVERY: Duration = Duration::from_secs(10);

/// What lives only in memory, rebuilt at start-up from the store and the agents' hellos.
/// How often telemetry past its retention is deleted.
const PRUNE_EVERY: Duration = Duration::from_secs(600);

#[derive(Default)]
struct Core {
    agents: HashMap<String, AgentEntry>,
    /// Jobs that are not finished, plus finished ones whose ranks have not all stopped yet.
    jobs: BTreeMap<JobId, ActiveJob>,
    next_conn_id: u64,
    /// Why each pending job waits, from the latest scheduling pass (`Job.waiting_reason`).
    waiting: HashMap<JobId, String>,
    /// Jobs the reconciler should look at on its next pass.
    dirty: std::collections::BTreeSet<JobId>,
    /// Ended jobs whose goodput and findings are still to be recorded (off the reconciler's path).
    ended: Vec<JobId>,
    /// When each node was blamed for a failure, within the blame window (cordons).
    blames: HashMap<String, Vec<i64>>,
    /// Agents gone past the timeout whose jobs keep stepping: the verdict waits (`liveness`).
    holding: std::collections::BTreeSet<String>,
    /// Cordons decided under the lock, to be written to the store after it.
    cordons_to_store: Vec<(String, Option<trainyard_store::Cordon>)>,
    /// Whether the fleet could ever hold a job of this shape (`launch::shape_of`), as a submit
    /// asks: answered once per shape until an agent's inventory or preflight changes
    /// ([`Core::fleet_changed`]).
    feasible: HashMap<String, Result<(), String>>,
    /// Bumped by [`Core::fleet_changed`]: a feasibility answer computed outside the lock is
    /// kept only if the fleet did not change meanwhile.
    fleet_generation: u64,
}

struct AgentEntry {
    record: AgentRecord,
    link: Option<AgentLink>,
    /// The agent announced it is stopping: no new work goes there.
    leaving: bool,
    /// When the link went away (or the controller started without one).
    disconnected_since: Option<Instant>,
    /// The agent's latest preflight report (from its hello or a re-run), if any.
    preflight: Option<trainyard_store::PreflightRecord>,
    /// Its stream is open but it has sent nothing for `unresponsive_after`: no new work.
    unresponsive: bool,
    /// It said hello since this controller started (until then the reconnect grace applies).
    seen_since_start: bool,
    /// Its inventory's link matrix, parsed once: every scheduling pass shares it.
    links: Arc<trainyard_placement::scheduler::LinkMatrix>,
}

/// The send side of an agent's stream.
struct AgentLink {
    conn_id: u64,
    tx: mpsc::Sender<ControllerMessage>,
}

struct ActiveJob {
    record: JobRecord,
    /// An operator asked to cancel it, with this reason; the reconciler carries it out.
    cancel: Option<String>,
    /// How many agents the launches of the current attempt went out to (the reconciler moves a
    /// `scheduled` job to `launching` once it is not 0).
    launches_sent: usize,
    /// Allocations of the current attempt; empty while pending.
    allocations: Vec<Allocation>,
    /// `MASTER_PORT` of the current attempt, as its rank-0 agent chose it and reported it in a
    /// rank report; `None` until then (and after a controller restart, until the agents' hellos
    /// report it again). The hosts without rank 0 are launched once it is known.
    master_port: Option<u16>,
    /// A failure found outside the ranks' own reports (a hang), for the reconciler to act on.
    detected: Option<trainyard_store::FailureRecord>,
    /// Nodes blamed for this job's failures, with when: left out of its next attempts until
    /// they pass a preflight.
    avoid: BTreeMap<String, i64>,
    /// Restarts charged against `max_restarts` so far (the job's own failures).
    charged: u32,
    /// The next attempt is not placed before this (the restart backoff).
    not_before: Option<Instant>,
    /// The checkpoints the current attempt may resume from, newest first (`resume`).
    resume_from: Vec<trainyard_proto::v1::ResumePoint>,
    /// Asked to checkpoint and move off a node (`evict`).
    eviction: Option<evict::Eviction>,
    /// Failures in a row of attempts that did not run for long: the backoff's exponent
    /// (`faults::next_streak`).
    streak: u32,
    /// When the current attempt started running.
    running_since: Option<Instant>,
}

impl Controller {
    /// Rebuilds the in-memory state from the store. Agents count as disconnected until they
    /// say hello again; those that do not come back within `agent_timeout` lose their ranks.
    /// The controller leads: alone (SQLite), or under `lease` in a group ([`Controller::follow`]
    /// builds one that does not).
    pub async fn start(store: Arc<dyn Store>, config: ControllerConfig) -> Result<Arc<Controller>> {
        Controller::start_as(store, config, Role::Leader(None)).await
    }

    /// As [`Controller::start`], for the leader of a group under `lease`.
    pub async fn start_leading(
        store: Arc<dyn Store>,
        config: ControllerConfig,
        lease: trainyard_store::Lease,
    ) -> Result<Arc<Controller>> {
        Controller::start_as(store, config, Role::Leader(Some(lease))).await
    }

    async fn start_as(
        store: Arc<dyn Store>,
        config: ControllerConfig,
        role: Role,
    ) -> Result<Arc<Controller>> {
        let clock = Clock::new();
        let now = Instant::now();
        let mut core = match (Core::load(store.as_ref(), now).await, &role) {
            (Ok(core), _) => core,
            // A follower may start while the database is away: its mirror fills in later.
            (Err(e), Role::Follower { .. }) => {
                tracing::warn!(error = %e, "follower: the store cannot be read yet; serving an empty mirror until it can");
                Core::default()
            }
            (Err(e), Role::Leader(_)) => return Err(e),
        };
        let watches = match role {
            Role::Leader(_) => faults::reload(&mut core, store.as_ref(), &config, clock.now_ms()).await?,
            Role::Follower { .. } => HashMap::new(),
        };
        tracing::info!(jobs = core.jobs.len(), agents = core.agents.len(), "state reloaded from the store");
        let (changes, _) = watch::channel(0);
        Ok(Arc::new(Controller {
            auth: Auth::new(store.clone()),
            store,
            config,
            role,
            core: Mutex::new(core),
            wake: Notify::new(),
            clock,
            changes,
            seen: std::sync::Mutex::new(HashMap::new()),
            seen_persisted: std::sync::Mutex::new(now),
            logs: std::sync::Mutex::new(HashMap::new()),
            next_log_request: std::sync::atomic::AtomicU64::new(0),
            steps: std::sync::Mutex::new(watches),
            started: now,
            fenced: std::sync::Mutex::new(Default::default()),
            outcomes: tokio::sync::Semaphore::new(diagnosis::OUTCOMES_AT_ONCE),
        }))
    }

    /// The auth service: users, tokens and the audit log.
    pub fn auth(&self) -> &Auth {
        &self.auth
    }

    /// The jobs service: submit, cancel, read, rank reports and logs.
    pub fn jobs(&self) -> Jobs<'_> {
        Jobs { c: self }
    }

    /// The diagnosis service: diagnoses, comparisons, goodput and live findings.
    pub fn diagnoses(&self) -> Diagnoses<'_> {
        Diagnoses { c: self }
    }

    /// The nodes service: the fleet table, preflights, cordons and drains, and what each
    /// agent's stream says about its node.
    pub fn nodes(&self) -> Nodes<'_> {
        Nodes { c: self }
    }

    /// The receipts service: step receipts and telemetry in, and their reads.
    pub fn receipts(&self) -> Receipts<'_> {
        Receipts { c: self }
    }

    pub fn config(&self) -> &ControllerConfig {
        &self.config
    }

    /// A receiver that changes whenever receipts are stored or a job changes state.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    fn bump(&self) {
        self.changes.send_modify(|n| *n += 1);
    }

    /// Something changed that the reconciler may act on.
    fn wake(&self) {
        self.wake.notify_one();
    }

    /// The in-memory state. Callers drop the guard before any `.await`.
    fn lock(&self) -> MutexGuard<'_, Core> {
        self.core.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Milliseconds since the Unix epoch, from the controller's [`Clock`].
    pub fn now_ms(&self) -> i64 {
        self.clock.now_ms()
    }

    /// The reconciler: runs a pass whenever a request wakes it, and every 500 ms (the reaper
    /// of vanished agents, liveness, and any pass a store error cut short) until `shutdown`
    /// resolves; the scheduling part of a pass at most every 100 ms. The only task that
    /// reconciles in a running controller.
    pub async fn run_background(self: Arc<Self>, shutdown: tokio_util::sync::CancellationToken) {
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        let mut prune = tokio::time::interval(PRUNE_EVERY);
        // The scheduling pass is paced (`reconcile::SCHEDULE_EVERY`): one owed comes at `next_pass`.
        let (mut next_pass, mut owed) = (Instant::now(), false);
        loop {
            let periodic = tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = prune.tick() => {
                    self.prune_telemetry().await;
                    continue;
                }
                _ = self.wake.notified() => false,
                _ = tokio::time::sleep_until(next_pass), if owed => false,
                _ = tick.tick() => true,
            };
            if periodic {
                self.mark_all();
                if let Err(e) = self.check_liveness().await {
                    tracing::error!(error = %e, "failed to check agent liveness");
                }
                self.reap_vanished_agents().await;
                self.check_hangs();
                self.check_evictions();
                self.store_cordons().await;
            }
            owed = !self.reconcile_paced(&mut next_pass).await;
            let ended = std::mem::take(&mut self.lock().ended);
            for job_id in ended {
                let controller = self.clone();
                tokio::spawn(async move { controller.diagnoses().record_outcome(job_id).await });
            }
        }
    }
}

/// An agent's link matrix, parsed from its inventory.
fn link_matrix(record: &AgentRecord) -> Arc<trainyard_placement::scheduler::LinkMatrix> {
    let inv = &record.inventory;
    Arc::new(trainyard_placement::scheduler::LinkMatrix::parse(&inv.links, inv.gpus.len()))
}

impl Core {
    /// An agent joined, or its inventory or preflight verdict changed: what a submit's
    /// feasibility check read is stale.
    fn fleet_changed(&mut self) {
        self.feasible.clear();
        self.fleet_generation += 1;
    }

    /// The jobs and agents the store holds, agents counted disconnected since `now` (until they
    /// say hello), with their latest preflight verdicts (a node that failed stays unscheduled
    /// until it reports again).
    async fn load(store: &dyn Store, now: Instant) -> Result<Core> {
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
    fn new(record: JobRecord) -> ActiveJob {
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

/// Wall-clock milliseconds that advance with Tokio's clock: the wall time at start plus Tokio's
/// elapsed time since. In a running controller the two agree; a test that pauses Tokio's clock
/// (`tokio::time::pause`) pauses this one too, and moves it with `tokio::time::advance`.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    wall_base_ms: i64,
    base: Instant,
}

impl Clock {
    pub fn new() -> Clock {
        let wall = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as i64)
            .unwrap_or_default();
        Clock { wall_base_ms: wall, base: Instant::now() }
    }

    pub fn now_ms(&self) -> i64 {
        self.wall_base_ms + self.base.elapsed().as_millis() as i64
    }
}

impl Default for Clock {
    fn default() -> Self {
        Clock::new()
    }
}

/// A rank is done when it exited or was lost.
fn rank_done(a: &Allocation) -> bool {
    a.observed.state.is_done()
}

/// Why a rank failed, or `None` if it has not failed.
fn rank_failure(a: &Allocation) -> Option<String> {
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
