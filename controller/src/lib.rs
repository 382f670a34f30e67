//! trainyard's controller: schedules training jobs onto GPU hosts and stores what they report.
//!
//! # Layout
//! - [`spec`]: validation of job specs at submit (pure).
//! - [`scheduler`]: gang placement over the fleet view (pure).
pub mod scheduler;
pub mod spec;
