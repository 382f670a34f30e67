//! trainyard's shared words and records: what the controller's layers (placement, analysis,
//! store, daemon) and `ctl` all speak. Pure: no I/O, no async, no database.
//!
//! # Layout
//! - [`domain`]: job, rank, agent and preflight states as enums with one word each, and a
//!   host's inventory.
//! - [`spec`]: the job spec and its validation at submit.
//! - [`restart`]: the restart rules of a spec: backoff between attempts and the hang rule.
//! - [`receipts`]: receipt schema v1, checked at ingest.
//! - [`records`]: jobs, their events, the allocation of every rank, agents and preflight
//!   reports, as the core holds them and the store persists them.
//! - [`slurm`]: `[slurm]` of a spec, the `sbatch` line built from it, the names of its agents.
//! - [`text`]: user text made safe to print on a terminal.
pub mod domain;
pub mod receipts;
pub mod records;
pub mod restart;
pub mod slurm;
pub mod spec;
pub mod text;
