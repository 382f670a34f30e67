//! The `trainyard.v1` gRPC contract: the generated messages, and with the `grpc` feature the
//! clients and servers (the pure crates use the messages and words alone, without any I/O
//! crate); the few values the contract defines beyond its messages ([`contract`]); the bounds
//! on every size a peer controls ([`limits`]); and the vocabulary of GPU telemetry
//! ([`telemetry`]: throttle reasons and XIDs). Both ends share one definition.
//!
//! `proto/trainyard/v1/*.proto` (the spec, the Jobs and Agents services, the preflight report)
//! is the source of truth; see its comments for field meanings. The words a
//! message carries (states, verdicts, levels, statuses, classes, causes, streams) are defined
//! once in [`words`] and read through the typed accessors of [`typed`].

pub mod contract;
pub mod limits;
pub mod telemetry;
pub mod typed;
pub mod words;

/// Version of the agent protocol. An agent whose hello carries another number is refused
/// with `FailedPrecondition`, and the agent refuses a controller that answers with another.
/// 2: log reading is paced by `LogCredit` (an agent of version 1 would not be).
pub const PROTOCOL_VERSION: u32 = 2;

#[allow(clippy::all, missing_docs)]
#[rustfmt::skip]
pub mod v1 {
    include!(concat!(env!("OUT_DIR"), "/trainyard.v1.rs"));
}
