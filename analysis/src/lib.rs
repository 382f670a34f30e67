//! What a run's receipts and placement say about it: pure functions over records the store
//! reads, unit-tested without a database. The analysis owns its types (findings, step samples,
//! goodput, rollup rows); the store reads them out of rows and writes them back.
//!
//! # Layout
//! - [`diagnose`]: the likely cause of a slow or uneven run (`ctl diagnose`), with the
//!   straggler scores, the goodput of each attempt, stall detection and the comparison of two
//!   runs in its submodules.
//! - [`series`]: per-rank rollups of step receipts and the min/max downsampling for plots.
pub mod diagnose;
pub mod series;
