//! What a request to the core can end in: the error each service returns, mapped to a gRPC
//! status in `crate::service::to_status`.

use trainyard_model::spec::SpecError;
use trainyard_store::{JobId, StoreError};

use trainyard_store::Lease;

/// Errors an operator or agent request can end in; mapped to `tonic::Status` in
/// `crate::service::to_status`.
#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    #[error("job spec rejected: {0}")]
    InvalidSpec(#[from] SpecError),
    #[error("job spec rejected: resources: {0}")]
    Unsatisfiable(String),
    #[error("job {0} not found")]
    JobNotFound(JobId),
    #[error("agent {0} closed its stream")]
    AgentGone(String),
    #[error("no node {0} is known to this controller (`ctl nodes` lists the known ones)")]
    AgentNotFound(String),
    #[error("node {0} is not connected, so it cannot run a preflight now")]
    AgentNotConnected(String),
    #[error("node {0} has not sent a preflight report yet (`ctl preflight {0} --run quick` asks for one)")]
    NoPreflight(String),
    #[error("node {agent} did not report its {level} preflight within {waited_s} s; see the agent's log")]
    PreflightTimeout { agent: String, level: String, waited_s: u64 },
    #[error("request rejected: {0}")]
    BadRequest(String),
    /// The logs cannot be read now (no ranks yet, the node is not connected), and why.
    #[error("{0}")]
    LogsUnavailable(String),
    /// A second stream of an agent that is connected: refused until the first one ends.
    #[error(
        "agent {0} is already connected; a second stream is refused until the first one ends (a dead one ends within ~30 s)"
    )]
    AlreadyConnected(String),
    /// An agent spoke for a rank it was not given (another agent's, or none at all).
    #[error("{0}")]
    NotYours(String),
    /// A per-user cap on a shared resource (pending jobs, open streams) is reached.
    #[error("{0}")]
    TooMany(String),
    /// This controller follows another in its group: writes go to the leader.
    #[error("{0}")]
    NotLeader(NotLeader),
    /// The host failed the controller (no random bytes, say): named, never a panic.
    #[error("{0}")]
    Internal(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

pub type Result<T, E = ControllerError> = std::result::Result<T, E>;

/// A write refused by a follower, naming the leader when one is known.
#[derive(Debug, Clone)]
pub struct NotLeader {
    pub leader: Option<Lease>,
}

impl std::fmt::Display for NotLeader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.leader {
            Some(l) => write!(
                f,
                "this controller does not lead its group: the leader is {} at {} (epoch {}); send writes \
                 there (ctl and agents given several controller addresses go there themselves)",
                l.holder, l.address, l.epoch
            ),
            None => f.write_str(
                "this controller does not lead its group and no leader is elected right now; try again in \
                 a few seconds",
            ),
        }
    }
}

impl NotLeader {
    /// The leader's gRPC address (host:port), when known.
    pub fn address(&self) -> Option<&str> {
        self.leader.as_ref().map(|l| l.address.as_str()).filter(|a| !a.is_empty())
    }
}
