//! trainyard's controller: schedules training jobs onto GPU hosts and stores what they report.
//!
//! # Layout
//! - [`config`]: the controller's settings, a plain struct.
//! - [`domain`]: job, rank and agent states as enums with one word each.
//! - [`spec`]: validation of job specs at submit (pure).
//! - [`receipts`]: receipt schema v1, checked at ingest (pure).
//! - [`scheduler`]: gang placement over the fleet view and the rank pinning plan (pure).
//! - [`cost`]: the placement cost model, collective time per optimizer step (pure).
//! - [`store`]: the durable store (SQLite by default, PostgreSQL for fleets) behind one trait.
//! - [`core`]: the in-memory state and the job state machine; the one place that mutates state.
//! - [`auth`]: who is calling (tokens, agent certificates, the demo's local admin), what they
//!   may do, the audit log, and the PKI `init-pki` writes.
//! - [`series`]: step rollups and min/max downsampling for plots (pure).
//! - [`service`]: the gRPC services (`Jobs` for operators, `Agents` for hosts).
//! - [`http`] and [`web`]: the HTTP listener: `/metrics`, `/healthz` and the web view.
//! - [`server`]: `run(listener, http, controller, security, shutdown)`, the entry point.
pub mod auth;
pub mod config;
pub mod core;
pub mod cost;
pub mod diagnose;
pub mod domain;
pub mod http;
pub mod metrics;
pub mod receipts;
pub mod scheduler;
pub mod series;
pub mod server;
pub mod service;
pub mod spec;
pub mod store;
pub mod web;

pub use config::ControllerConfig;
pub use core::Controller;
