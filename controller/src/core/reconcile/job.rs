//! A job the core holds, as the reconciler sees it: its record as stored (whose state only the
//! reconciler moves: the field is visible in `reconcile` alone, everything else reads it through
//! [`ActiveJob::record`]), its allocations, and the requests other parts leave for the
//! reconciler (a cancel, a detected failure, an eviction).

use std::collections::BTreeMap;

use tokio::time::Instant;
use trainyard_store::{Allocation, FailureKind, FailureRecord, JobId, JobRecord};

/// A job the core holds: not finished, or finished with ranks that have not all stopped.
pub(in crate::core) struct ActiveJob {
    /// The job as stored: its state moves only here, in the reconciler (read it through
    /// [`ActiveJob::record`] elsewhere).
    pub(super) record: JobRecord,
    /// An operator asked to cancel it, with this reason; the reconciler carries it out.
    pub(in crate::core) cancel: Option<String>,
    /// How many agents the launches of the current attempt went out to (the reconciler moves a
    /// `scheduled` job to `launching` once it is not 0).
    pub(in crate::core) launches_sent: usize,
    /// Allocations of the current attempt; empty while pending.
    pub(in crate::core) allocations: Vec<Allocation>,
    /// `MASTER_PORT` of the current attempt, as its rank-0 agent chose it and reported it in a
    /// rank report; `None` until then (and after a controller restart, until the agents' hellos
    /// report it again). The hosts without rank 0 are launched once it is known.
    pub(in crate::core) master_port: Option<u16>,
    /// A failure found outside the ranks' own reports (a hang), for the reconciler to act on.
    pub(in crate::core) detected: Option<trainyard_store::FailureRecord>,
    /// Nodes blamed for this job's failures, with when: left out of its next attempts until
    /// they pass a preflight.
    pub(in crate::core) avoid: BTreeMap<String, i64>,
    /// Restarts charged against `max_restarts` so far (the job's own failures).
    pub(in crate::core) charged: u32,
    /// The next attempt is not placed before this (the restart backoff).
    pub(in crate::core) not_before: Option<Instant>,
    /// The checkpoints the current attempt may resume from, newest first (`resume`).
    pub(in crate::core) resume_from: Vec<trainyard_proto::v1::ResumePoint>,
    /// Asked to checkpoint and move off a node (`evict`).
    pub(in crate::core) eviction: Option<Eviction>,
    /// Failures in a row of attempts that did not run for long: the backoff's exponent
    /// (`faults::next_streak`).
    pub(in crate::core) streak: u32,
    /// When the current attempt started running.
    pub(in crate::core) running_since: Option<Instant>,
    /// The spec's encoded size: what the job holds of its user's spec budget while active.
    pub(in crate::core) spec_bytes: usize,
    /// The attempt waits for a host of it that fell silent (`host_wait`).
    pub(in crate::core) host_wait: Option<HostWait>,
}

impl ActiveJob {
    /// The job as stored, its state included.
    pub(in crate::core) fn record(&self) -> &JobRecord {
        &self.record
    }

    pub(in crate::core) fn new(record: JobRecord) -> ActiveJob {
        let spec_bytes = prost::Message::encoded_len(&trainyard_proto::v1::JobSpec::from(&record.spec));
        ActiveJob {
            spec_bytes,
            record,
            cancel: None,
            launches_sent: 0,
            allocations: Vec::new(),
            master_port: None,
            detected: None,
            avoid: BTreeMap::new(),
            charged: 0,
            not_before: None,
            resume_from: Vec::new(),
            eviction: None,
            streak: 0,
            running_since: None,
            host_wait: None,
        }
    }
}

/// A job asked to checkpoint and move off a node.
#[derive(Debug, Clone)]
pub(in crate::core) struct Eviction {
    pub kind: FailureKind,
    /// The node it moves off; empty when it is preempted (it moves off every node).
    pub node: String,
    pub why: String,
    pub asked: Instant,
    pub deadline: Instant,
    /// The waiting job it makes room for (priority preemption).
    pub for_job: Option<JobId>,
}

impl Eviction {
    /// The failure that ends the moved attempt: the fleet's, so nobody is blamed or charged.
    pub(in crate::core) fn failure(
        &self,
        (job_id, attempt): (JobId, u32),
        at_ms: i64,
        evidence: String,
    ) -> FailureRecord {
        FailureRecord {
            job_id,
            attempt,
            at_ms,
            kind: self.kind,
            agent_id: Some(self.node.clone()).filter(|n| !n.is_empty()),
            rank: None,
            evidence,
            blamed: false,
            charged: false,
        }
    }
}

/// An attempt waiting for a host of it that fell silent (`host_wait`).
#[derive(Debug, Clone, PartialEq)]
pub(in crate::core) struct HostWait {
    pub agent_id: String,
    /// The host's last word before the silence (wall-clock milliseconds).
    pub since_ms: i64,
}
