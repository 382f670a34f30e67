//! Writes that wait for a commit group ([`crate::group`]): receipt batches and rank reports.
//! `SqlStore` holds one group of each; `receipts` and `jobs` write them.

use crate::group::{Answer, Group};
use crate::{NewReceipt, RankId, RankObserved};

/// Receipt batches waiting to be written together ([`crate::group`]). Every agent's stream
/// stores its batches in order; a group is written in one transaction, on PostgreSQL in one
/// statement (each batch still learns how many of its rows were new); on SQLite, with no round
/// trips to save, the inserts of each batch, bound before it joined the group.
pub(crate) type ReceiptGroup = Group<Pending>;

#[derive(Debug)]
pub(crate) struct Pending {
    pub(crate) batch: Batch,
    /// Receipts in the batch.
    pub(crate) rows: usize,
    pub(crate) done: Answer<u64>,
}

/// A queued receipt batch in the form its database takes (cloned only when a PostgreSQL
/// transaction is retried).
#[derive(Debug, Clone)]
pub(crate) enum Batch {
    /// PostgreSQL: the rows, and when they arrived (`stored_at_ms`).
    Rows(Vec<NewReceipt>, i64),
    /// SQLite: the batch's multi-row inserts, values bound.
    Bound(Vec<crate::sqlite::Insert>),
}

/// Rank reports waiting to be written together ([`crate::group`]): when a 64-rank job starts
/// or ends, its agents report every rank within a few milliseconds.
pub(crate) type RankGroup = Group<Observation>;

#[derive(Debug)]
pub(crate) struct Observation {
    pub(crate) id: RankId,
    pub(crate) observed: RankObserved,
    pub(crate) done: Answer<bool>,
}
