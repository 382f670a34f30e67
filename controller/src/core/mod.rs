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
//! writer of job states (a fact of the types: a job's record is visible to `reconcile` alone),
//! it can decide under the lock, write to the store without it, and apply the result under it
//! again: nothing else could have moved the job in between. A store
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
//! - `controller`: [`Controller`], its constructors, the services' way in, the reconciler's
//!   loop and a follower's mirror; `shared`: the parts the services and the reconciler borrow
//!   (never the `Controller`); `state`: what the lock guards, plain data; `error`: what a
//!   request can end in; `clock`: time that follows Tokio's.
//! - `reconcile`: the `Reconciler`, the one path of a job's state: settling jobs, restarts,
//!   the scheduling pass and launches; `reconcile/job.rs`: a job as the core holds it.
//! - `launch`: the messages that start, stop and forget ranks; the fleet as the scheduler sees it.
//! - `fleet`: each node's state as the table shows it, busy GPUs, hostnames to agent ids.
//! - `agents`: what agents observe about their ranks, and the check that an agent speaks only
//!   for its own ranks.
//! - `liveness`: unresponsive agents, and the reaper of lost hosts; `heard`: when each agent
//!   last spoke, and the streams of hosts declared lost (outside the core's lock).
//! - `faults`: what ended an attempt (rank exit, host lost, hang), blame, exclusion, cordons,
//!   backoff, and the hang watch over each job's steps.
//! - `steps`: when each running job's ranks last stepped and checkpointed (the hang watch's
//!   memory, updated by ingest under its own lock).
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
mod clock;
mod controller;
mod diagnosis;
mod error;
mod evict;
mod faults;
mod fleet;
mod follow;
mod heard;
mod host_wait;
mod jobs;
mod keys;
mod launch;
pub mod leader;
mod live;
mod liveness;
mod logs;
mod nodes;
mod quota;
mod receipts;
mod reconcile;
mod resume;
mod shared;
mod slurm;
mod state;
mod steps;
mod telemetry;
mod view;

#[cfg(test)]
mod agent_message_props;
#[cfg(test)]
mod faults_tests;
#[cfg(test)]
mod host_wait_tests;
#[cfg(test)]
mod lifecycle_tests;
#[cfg(test)]
mod live_tests;
#[cfg(test)]
mod test_support;

pub use auth::Auth;
pub use clock::Clock;
pub use controller::Controller;
pub use diagnosis::Diagnoses;
pub use error::{ControllerError, NotLeader, Result};
pub use evict::{DEFAULT_DRAIN_DEADLINE, DEFAULT_NOTICE_DEADLINE};
pub use follow::{MIRROR_EVERY, Role};
pub use jobs::Jobs;
pub use logs::LogEvent;
pub use nodes::{Nodes, PREFLIGHT_RUN_LEVELS, PREFLIGHT_RUN_TIMEOUT};
pub use receipts::Receipts;
