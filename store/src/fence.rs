//! The fence on every write of a leader (see `lease` for the lease it checks), and the SQL
//! pieces the fence and the lease share.

use crate::sql::Conn;
use crate::{Result, StoreError};

/// The one lease a group elects.
pub(crate) const LEADER: &str = "leader";

/// Who may write: the holder and epoch of a lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fence {
    pub holder: String,
    pub epoch: u64,
}

impl Fence {
    /// A fence no lease ever matches (epoch 0 is never led: the first leader takes epoch 1), for
    /// a controller that follows: its store writes nothing.
    pub fn read_only(holder: &str) -> Fence {
        Fence { holder: holder.to_string(), epoch: 0 }
    }
}

/// The database's clock in ms, as SQL: the one place the backends differ here.
pub(crate) fn now_ms(c: &Conn<'_>) -> &'static str {
    match c {
        Conn::Postgres(_) => "CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)",
        Conn::Sqlite(_) => "CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)",
    }
}

pub(crate) fn share_lock(c: &Conn<'_>) -> &'static str {
    match c {
        // KEY SHARE: a takeover (`FOR UPDATE`, below) waits for every write that passed its
        // fence, but the leader's renewal (an UPDATE of no key column) does not. Under `FOR
        // SHARE` a stream of writes held the row share-locked without pause, the renewal
        // queued behind them until the lease ran out, and leadership flapped under load.
        Conn::Postgres(_) => " FOR KEY SHARE",
        Conn::Sqlite(_) => "",
    }
}

/// The fence check at the start of a write transaction.
pub(crate) async fn check_fence(c: &mut Conn<'_>, fence: &Fence) -> Result<()> {
    let sql = format!(
        "SELECT epoch FROM controller_lease WHERE name = $1 AND holder = $2 AND epoch = $3 \
         AND expires_at_ms > {}{}",
        now_ms(c),
        share_lock(c)
    );
    let epoch = i64::try_from(fence.epoch)
        .map_err(|_| StoreError::Fenced(format!("epoch {} out of range", fence.epoch)))?;
    let held = c.query(sql).bind(LEADER).bind(fence.holder.as_str()).bind(epoch).optional().await?;
    match held {
        Some(_) => Ok(()),
        None if fence.epoch == 0 => Err(StoreError::Fenced(format!(
            "controller {} follows: its store is read-only until it leads",
            fence.holder
        ))),
        None => Err(StoreError::Fenced(format!(
            "controller {} no longer holds the lease of epoch {}: another controller leads, or the lease ran out",
            fence.holder, fence.epoch
        ))),
    }
}
