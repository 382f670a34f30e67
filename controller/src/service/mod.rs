//! The gRPC facade: one module per service, errors mapped to `tonic::Status` in one place.
//!
//! - `jobs`: the operators' `Jobs` service (`ctl`).
//! - `agents`: the agents' `Agents.Connect` stream.
//! - `wire`: the wire form of diagnoses, comparisons and live findings.

mod agents;
mod jobs;
mod wire;

pub use agents::AgentsService;
pub use jobs::{JobsService, MAX_STREAMS_PER_USER};

use crate::auth::AuthError;
use crate::core::ControllerError;
use trainyard_store::StoreError;

/// The one place where controller errors become gRPC statuses.
pub fn to_status(e: ControllerError) -> tonic::Status {
    match e {
        ControllerError::InvalidSpec(_) | ControllerError::Unsatisfiable(_) => {
            tonic::Status::invalid_argument(e.to_string())
        }
        ControllerError::JobNotFound(_) => tonic::Status::not_found(e.to_string()),
        ControllerError::AgentGone(_) => tonic::Status::cancelled(e.to_string()),
        ControllerError::AgentNotFound(_) => tonic::Status::not_found(e.to_string()),
        ControllerError::AgentNotConnected(_) | ControllerError::NoPreflight(_) => {
            tonic::Status::failed_precondition(e.to_string())
        }
        ControllerError::PreflightTimeout { .. } => tonic::Status::deadline_exceeded(e.to_string()),
        ControllerError::BadRequest(_) => tonic::Status::invalid_argument(e.to_string()),
        ControllerError::LogsUnavailable(_) => tonic::Status::failed_precondition(e.to_string()),
        ControllerError::AlreadyConnected(_) => tonic::Status::already_exists(e.to_string()),
        ControllerError::NotYours(_) => tonic::Status::permission_denied(e.to_string()),
        ControllerError::TooMany(_) => tonic::Status::resource_exhausted(e.to_string()),
        ControllerError::NotLeader(refusal) => not_leader(&refusal),
        ControllerError::Internal(_) => tonic::Status::internal(e.to_string()),
        ControllerError::Store(StoreError::JobNotFound(_)) => tonic::Status::not_found(e.to_string()),
        ControllerError::Store(StoreError::StateConflict { .. }) => tonic::Status::aborted(e.to_string()),
        // Database text (SQL, constraint names, server messages) stays in the controller's log:
        // clients get what they can act on, and an incident id to quote.
        ControllerError::Store(StoreError::Unavailable(_)) => {
            tracing::warn!(error = %e, "the database is unavailable");
            tonic::Status::unavailable(DATABASE_UNAVAILABLE)
        }
        ControllerError::Store(_) => {
            let incident = incident_id();
            tracing::error!(incident, error = %e, "store failure");
            tonic::Status::internal(format!(
                "internal error {incident}: the controller could not use its database; its log has the details under this id"
            ))
        }
    }
}

pub use trainyard_proto::contract::LEADER_METADATA;

/// A follower's refusal of a write: `UNAVAILABLE` (try elsewhere), naming the leader in the
/// message and in [`LEADER_METADATA`].
fn not_leader(refusal: &crate::core::NotLeader) -> tonic::Status {
    let mut status = tonic::Status::unavailable(refusal.to_string());
    if let Some(value) = refusal.address().and_then(|a| a.parse().ok()) {
        status.metadata_mut().insert(LEADER_METADATA, value);
    }
    status
}

/// Authentication and permission refusals, as statuses.
pub fn auth_status(e: AuthError) -> tonic::Status {
    match e {
        AuthError::Unauthenticated(why) => tonic::Status::unauthenticated(why),
        AuthError::PermissionDenied(why) => tonic::Status::permission_denied(why),
        AuthError::Store(e) => to_status(ControllerError::Store(e)),
    }
}

/// What a client hears while the controller's database cannot be reached.
pub const DATABASE_UNAVAILABLE: &str =
    "the controller's database is unavailable; the controller keeps retrying, try again shortly";

/// A short id that ties a client's error to the controller's log line: the time in ms and a
/// counter, e.g. `E1763870000123-4`.
fn incident_id() -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis());
    format!("E{ms}-{}", NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn database_text_never_reaches_clients() {
        let sql = sqlx::Error::Protocol("syntax error at or near \"SELECT id FROM jobs\"".into());
        let status = to_status(ControllerError::Store(StoreError::Database(sql)));
        assert_eq!(status.code(), tonic::Code::Internal);
        assert!(status.message().starts_with("internal error E"), "{}", status.message());
        assert!(
            !status.message().contains("SELECT") && !status.message().contains("syntax"),
            "{}",
            status.message()
        );
        let corrupt = StoreError::Corrupt { table: "jobs", detail: "column spec_pb: bad wire type".into() };
        assert!(!to_status(ControllerError::Store(corrupt)).message().contains("spec_pb"));
        let down = to_status(ControllerError::Store(StoreError::Unavailable(
            "connection refused (os error 111) to 10.0.0.3:5432".into(),
        )));
        assert_eq!((down.code(), down.message()), (tonic::Code::Unavailable, DATABASE_UNAVAILABLE));
        assert_ne!(incident_id(), incident_id());
    }

    #[test]
    fn a_followers_refusal_names_the_leader_in_its_message_and_metadata() {
        let lease = trainyard_store::Lease {
            holder: "ctl-a".into(),
            epoch: 7,
            address: "ctl-a.example.net:7070".into(),
            remaining_ms: 4_000,
            tls_ca: String::new(),
        };
        let status = to_status(ControllerError::NotLeader(crate::core::NotLeader { leader: Some(lease) }));
        assert_eq!(status.code(), tonic::Code::Unavailable);
        assert!(status.message().contains("the leader is ctl-a at ctl-a.example.net:7070 (epoch 7)"));
        assert_eq!(
            status.metadata().get(LEADER_METADATA).unwrap().to_str().unwrap(),
            "ctl-a.example.net:7070"
        );
        let none = to_status(ControllerError::NotLeader(crate::core::NotLeader { leader: None }));
        assert_eq!(none.code(), tonic::Code::Unavailable);
        assert!(none.message().contains("no leader is elected right now"), "{}", none.message());
        assert!(none.metadata().get(LEADER_METADATA).is_none());
    }
}
