//! One module per subcommand; each takes a connected [`Controller`] and prints its result.

pub mod cancel;
pub mod compare;
pub mod diagnose;
pub mod logs;
pub mod nodes;
pub mod preflight;
pub mod status;
pub mod submit;
pub mod watch;

/// States a job does not leave.
pub fn is_terminal(state: &str) -> bool {
    matches!(state, "succeeded" | "failed" | "cancelled")
}

#[cfg(test)]
mod tests;
