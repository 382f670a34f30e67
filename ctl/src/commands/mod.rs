//! One module per subcommand; each takes a connected [`Controller`] and prints its result.

pub mod cancel;
pub mod compare;
pub mod diagnose;
pub mod logs;
pub mod nodes;
pub mod preflight;
pub mod slurm;
pub mod status;
pub mod submit;
pub mod watch;

use trainyard_proto::words::{JobState, UnknownWord};

/// A job in a state it does not leave (its words checked where the reply arrived).
pub fn is_terminal(state: Result<JobState, UnknownWord>) -> bool {
    state.is_ok_and(JobState::is_terminal)
}

#[cfg(test)]
mod tests;
