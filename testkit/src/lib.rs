//! What the test suites and benches start around the code under test; never linked into a
//! binary that ships (the controller takes it as a dev-dependency only).
//!
//! # Layout
//! - [`pg_server`]: a throwaway PostgreSQL server on loopback ([`pg_server::TempPostgres`]),
//!   which the store's test suite, the end-to-end harness and the PostgreSQL benches run on.
//! - [`noise`]: reproducible random numbers (uniform, normal) for noisy runs in tests and benches.
//! - [`results`]: bench results as JSON-lines files in docs/results/, one per run, with the
//!   commit, the machine and the figures: what the docs' figures are read back from.

pub mod noise;
pub mod pg_server;
pub mod results;
