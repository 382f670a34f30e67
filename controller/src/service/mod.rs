//! The gRPC facade: one module per service, errors mapped to `tonic::Status` in one place.
//!
//! - `jobs`: the operators' `Jobs` service (`ctl`).
//! - `agents`: the agents' `Agents.Connect` stream.

mod agents;
mod jobs;

pub use agents::AgentsService;
pub use jobs::JobsService;

use crate::core::ControllerError;
use crate::store::StoreError;

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
        ControllerError::Store(StoreError::JobNotFound(_)) => tonic::Status::not_found(e.to_string()),
        ControllerError::Store(StoreError::StateConflict { .. }) => tonic::Status::aborted(e.to_string()),
        ControllerError::Store(_) => {
            tracing::error!(error = %e, "store failure");
            tonic::Status::unavailable(format!("the controller's store failed: {e}"))
        }
    }
}
