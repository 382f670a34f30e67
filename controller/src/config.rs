//! The controller's settings as a plain struct; the binary's clap `Cli` converts into it.

use std::time::Duration;

/// Settings of a [`crate::core::Controller`].
#[derive(Debug, Clone, PartialEq)]
pub struct ControllerConfig {
    /// Between SIGTERM and SIGKILL when ranks are stopped (cancel, or a failed peer rank).
    pub cancel_grace: Duration,
    /// How long an agent may stay disconnected before its ranks count as lost.
    pub agent_timeout: Duration,
    /// An agent whose stream stays open but sends nothing (not even a heartbeat) for this long
    /// is `unresponsive`: no new work goes there until it speaks again.
    pub unresponsive_after: Duration,
    /// Jobs one user may have waiting (`pending`) at once; a submit past it is refused
    /// (`ResourceExhausted`), so a loop of submits cannot bury the queue (every scheduling pass
    /// looks at every pending job) or the store.
    pub max_pending_per_user: usize,
}

/// The default of [`ControllerConfig::max_pending_per_user`].
pub const MAX_PENDING_JOBS_PER_USER: usize = 1_000;

impl Default for ControllerConfig {
    fn default() -> Self {
        ControllerConfig {
            cancel_grace: Duration::from_secs(10),
            agent_timeout: Duration::from_secs(60),
            // Agents heartbeat every 2 s: 15 s is several missed beats, not a slow network.
            unresponsive_after: Duration::from_secs(15),
            max_pending_per_user: MAX_PENDING_JOBS_PER_USER,
        }
    }
}

impl ControllerConfig {
    pub fn with_cancel_grace(mut self, grace: Duration) -> Self {
        self.cancel_grace = grace;
        self
    }

    pub fn with_agent_timeout(mut self, timeout: Duration) -> Self {
        self.agent_timeout = timeout;
        self
    }

    pub fn with_unresponsive_after(mut self, after: Duration) -> Self {
        self.unresponsive_after = after;
        self
    }
}
