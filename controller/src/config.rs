//! The controller's settings as a plain struct; the binary's clap `Cli` converts into it.

use std::time::Duration;

/// Settings of a [`crate::core::Controller`].
#[derive(Debug, Clone, PartialEq)]
pub struct ControllerConfig {
    /// Between SIGTERM and SIGKILL when ranks are stopped (cancel, or a failed peer rank).
    pub cancel_grace: Duration,
    /// How long an agent may stay disconnected, or connected but silent (no heartbeat: a cut
    /// network, a stopped machine), before its host counts as lost: its ranks are lost, their
    /// jobs restart elsewhere, and its stream is dropped so that it must say hello again (and
    /// have the ranks of the old attempt stopped) if it comes back. Agents heartbeat every 2 s.
    pub agent_timeout: Duration,
    /// How long a gone agent's verdict waits while ranks of its jobs on other hosts keep
    /// stepping (its own ranks evidently run: a dead agent, not a dead host), for the agent to
    /// come back and adopt them.
    pub agent_hold: Duration,
    /// How long an attempt waits for a host of it that fell silent, when no other placement
    /// can start now, before it restarts (a job's `restart.host_wait_s` overrides it). Counted
    /// from the host's last word, like `agent_hold`, so the two never add up: a job waits for a
    /// host at most the longer of the two. Below `agent_timeout` it has no effect.
    pub host_wait: Duration,
    /// A waiting job whose priority exceeds a running job's by at least this may preempt it:
    /// the running job checkpoints (within `preempt_deadline`) and is requeued. 0: never.
    pub preempt_gap: i32,
    pub preempt_deadline: Duration,
    /// A waiting job gains one priority point per this much waiting, so nothing starves
    /// (zero: no aging).
    pub age_every: Duration,
    /// After the controller starts (or takes over), how long agents have to reconnect before
    /// any host-loss or hang clock runs: a restart of the controller never restarts a job.
    pub reconnect_grace: Duration,
    /// A node blamed for this many failures (of any jobs) within `blame_window` is cordoned
    /// fleet-wide until it passes a preflight.
    pub cordon_after_blames: usize,
    pub blame_window: Duration,
    /// An agent whose stream stays open but sends nothing (not even a heartbeat) for this long
    /// is `unresponsive`: no new work goes there until it speaks again.
    pub unresponsive_after: Duration,
    /// Jobs one user may have waiting (`pending`) at once; a submit past it is refused
    /// (`ResourceExhausted`), so a loop of submits cannot bury the queue (every scheduling pass
    /// looks at every pending job) or the store.
    pub max_pending_per_user: usize,
    /// Bytes of spec (encoded) one user's unfinished jobs may hold in the controller's memory
    /// together; a submit past it is refused (`ResourceExhausted`), so 1,000 pending jobs of
    /// 512 KiB specs cannot take half a gigabyte of it.
    pub max_spec_bytes_per_user: usize,
    /// How much one job, and one user's unfinished jobs, may store of receipts.
    pub receipt_quota: QuotaConfig,
    /// GPU telemetry windows older than this are deleted (`None`: kept for ever).
    pub telemetry_retention: Option<Duration>,
    /// Receipts of jobs that ended longer ago than this are deleted (`None`: kept for ever).
    pub receipt_retention: Option<Duration>,
    /// How often running jobs are diagnosed live (a telemetry window, 10 s).
    pub live_every: Duration,
    /// Webhook URLs every live finding is posted to when it opens and when it closes.
    pub alert_webhooks: Vec<String>,
    /// CA bundle for https webhooks (default: the system's).
    pub alert_ca_file: Option<std::path::PathBuf>,
}

/// The budgets of receipts ([`ControllerConfig::receipt_quota`], `core::quota`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuotaConfig {
    /// Bytes of step receipts one job may store.
    pub job_step_bytes: u64,
    /// Bytes of receipts of every other kind one job may store.
    pub job_other_bytes: u64,
    /// Bytes of receipts one user's unfinished jobs may store together.
    pub user_bytes: u64,
}

impl Default for QuotaConfig {
    /// Far above what any bench or a zero-code-receipts job sends (docs/security.md, "Limits"):
    /// the largest, the 3-minute soak, writes 18 million receipts of ~300 bytes (5.4 GB) in one
    /// job; 32 GiB of step receipts is ~100 million steps of such receipts.
    fn default() -> Self {
        QuotaConfig { job_step_bytes: 32 << 30, job_other_bytes: 1 << 30, user_bytes: 128 << 30 }
    }
}

/// The default of [`ControllerConfig::max_pending_per_user`].
pub const MAX_PENDING_JOBS_PER_USER: usize = 1_000;
/// The default of [`ControllerConfig::max_spec_bytes_per_user`]: 1,000 specs of 64 KiB (a
/// long argv and env overlay), or 128 of the largest allowed (512 KiB).
pub const MAX_SPEC_BYTES_PER_USER: usize = 64 << 20;

impl Default for ControllerConfig {
    fn default() -> Self {
        ControllerConfig {
            cancel_grace: Duration::from_secs(10),
            // Agents heartbeat every 2 s: 8 s is four missed beats, not a slow network, and well
            // inside the 10 s target for detecting a lost host (docs/faults.md).
            agent_timeout: Duration::from_secs(8),
            agent_hold: Duration::from_secs(120),
            host_wait: Duration::from_secs(120),
            preempt_gap: 10,
            preempt_deadline: Duration::from_secs(120),
            age_every: Duration::from_secs(600),
            reconnect_grace: Duration::from_secs(30),
            cordon_after_blames: 3,
            blame_window: Duration::from_secs(3600),
            // Two missed beats: no new work goes there, and a rank exit elsewhere in its jobs
            // waits for the host's verdict (a cut network makes peers' collectives fail first).
            unresponsive_after: Duration::from_secs(5),
            max_pending_per_user: MAX_PENDING_JOBS_PER_USER,
            max_spec_bytes_per_user: MAX_SPEC_BYTES_PER_USER,
            receipt_quota: QuotaConfig::default(),
            telemetry_retention: Some(Duration::from_secs(30 * 86_400)),
            receipt_retention: None,
            live_every: Duration::from_secs(10),
            alert_webhooks: Vec::new(),
            alert_ca_file: None,
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

    pub fn with_preemption(mut self, gap: i32, deadline: Duration, age_every: Duration) -> Self {
        self.preempt_gap = gap;
        self.preempt_deadline = deadline;
        self.age_every = age_every;
        self
    }

    pub fn with_agent_hold(mut self, hold: Duration) -> Self {
        self.agent_hold = hold;
        self
    }

    pub fn with_host_wait(mut self, wait: Duration) -> Self {
        self.host_wait = wait;
        self
    }

    pub fn with_reconnect_grace(mut self, grace: Duration) -> Self {
        self.reconnect_grace = grace;
        self
    }

    pub fn with_cordon_after(mut self, blames: usize, window: Duration) -> Self {
        self.cordon_after_blames = blames;
        self.blame_window = window;
        self
    }

    pub fn with_receipt_quota(mut self, quota: QuotaConfig, retention: Option<Duration>) -> Self {
        self.receipt_quota = quota;
        self.receipt_retention = retention;
        self
    }

    pub fn with_telemetry_retention(mut self, keep: Option<Duration>) -> Self {
        self.telemetry_retention = keep;
        self
    }

    pub fn with_live(
        mut self,
        every: Duration,
        webhooks: Vec<String>,
        ca_file: Option<std::path::PathBuf>,
    ) -> Self {
        self.live_every = every;
        self.alert_webhooks = webhooks;
        self.alert_ca_file = ca_file;
        self
    }

    pub fn with_unresponsive_after(mut self, after: Duration) -> Self {
        self.unresponsive_after = after;
        self
    }
}
