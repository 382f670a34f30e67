//! Where a job's ranks go, and what that placement will cost: pure functions from the queue
//! and an in-memory view of the fleet to decisions, unit-tested without network or GPU.
//!
//! # Layout
//! - [`links`]: the link class between two GPUs (`NV18` … `SYS`) and the best GPU set inside
//!   one node.
//! - [`cost`]: the collective cost model: time per optimizer step from bytes, world size and
//!   the slowest link class used.
//! - [`scheduler`]: gang placement with backfill behind a reserved head, and the CPU/memory
//!   pinning plan of each rank.
//!
//! The modules import downward only: `scheduler` uses `cost` and `links`, `cost` uses `links`.
pub mod cost;
pub mod links;
pub mod scheduler;
