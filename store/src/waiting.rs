//! Writes that wait for a commit group ([`crate::group`]): receipt batches and rank reports.
//! `SqlStore` holds one group of each; `receipts` and `jobs` write them.

use crate::group::{Answer, Group};
use crate::{NewReceipt, RankId, RankObserved};

/// Receipt batches waiting to be written together ([`crate::group`]). Every agent's stream
/// stores its batches in order; a group is written in one transaction, on PostgreSQL in one
/// statement (each batch still learns how many of its rows were new); on SQLite, with no round
/// trips to save, a statement per batch.
pub(crate) type ReceiptGroup = Group<Pending>;

#[derive(Debug)]
pub(crate) struct Pending {
    pub(crate) rows: Vec<NewReceipt>,
    pub(crate) now_ms: i64,
    pub(crate) done: Answer<u64>,
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
