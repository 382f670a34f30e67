//! trainyard's controller daemon: schedules training jobs onto GPU hosts and stores what they
//! report. This crate wires the layers below it, each a crate of its own:
//! `trainyard_model` (the words and records), `trainyard_placement` (scheduler and cost model),
//! `trainyard_analysis` (diagnosis, goodput, series) and `trainyard_store` (SQLite or
//! PostgreSQL). Cargo keeps the imports pointing down; `tests/tests/house.rs` keeps the modules
//! inside each crate free of circles.
//!
//! # Layout
//! - [`config`]: the controller's settings, a plain struct.
//! - [`core`]: the in-memory state and the job state machine; the one place that mutates state.
//! - [`auth`]: who is calling (tokens, agent certificates, the demo's local admin), what they
//!   may do, the audit log, and the PKI `init-pki` writes.
//! - [`service`]: the gRPC services (`Jobs` for operators, `Agents` for hosts).
//! - [`metrics`]: the Prometheus metrics served on `/metrics`.
//! - [`http`] and [`web`]: the HTTP listener: `/metrics`, `/healthz` and the web view.
//! - [`alerts`]: the alert webhooks live findings are posted to (opened, closed).
//! - [`tls`]: the certificate, key and client CA both listeners load.
//! - [`server`]: `run(listener, http, controller, security, shutdown)`, the entry point.
//! - [`group`]: a member of a controller group on PostgreSQL: follows, leads, steps down,
//!   hands its listeners from one role to the other.
pub mod alerts;
pub mod auth;
pub mod config;
pub mod core;
pub mod group;
pub mod http;
pub mod metrics;
pub mod server;
pub mod service;
pub mod tls;
pub mod web;

pub use config::ControllerConfig;
pub use core::Controller;
