//! [`StoreError`]: what a store operation can end in.

use crate::{JobId, JobState};

/// Errors of the store, mapped to `tonic::Status` in one place (the controller's
/// `service::status`).
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("job {0} not found")]
    JobNotFound(JobId),
    /// A transition was asked from a state the job is no longer in (someone else moved it).
    #[error("job {job} is {actual}, not {expected}")]
    StateConflict { job: JobId, expected: JobState, actual: JobState },
    /// A unique key is taken (SQLSTATE 23505, SQLite's UNIQUE constraint), e.g. a submit's
    /// idempotency key.
    #[error("already exists: {0}")]
    Duplicate(String),
    #[error("corrupt row in {table}: {detail}")]
    Corrupt { table: &'static str, detail: String },
    /// The database cannot be reached (connection refused or dropped, server shutting down)
    /// even after the retries of the backend's one database helper.
    #[error("the database is unavailable: {0}")]
    Unavailable(String),
    /// Another controller holds the SQLite file ([`crate::SqliteClaim`]).
    #[error("{0}")]
    InUse(String),
    /// This store's fence no longer holds: another controller leads, or the lease ran out.
    /// Nothing was written.
    #[error("fenced off: {0}")]
    Fenced(String),
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    #[error("migration: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
}

pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// A row of `table` that does not read as its record, with what is wrong.
pub(crate) fn corrupt(table: &'static str, detail: impl Into<String>) -> StoreError {
    StoreError::Corrupt { table, detail: detail.into() }
}
