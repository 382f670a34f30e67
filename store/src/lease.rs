//! [`LeaseStore`]: the leader lease of a controller group, and the fence on every write.
//!
//! One row of `controller_lease` says which controller leads, under which **epoch**, until when.
//! Time is the database's clock (never a controller's: a paused or skewed controller cannot
//! stretch its own lease), read in the same statement that decides. A controller leads only
//! while its lease is unexpired; taking over an expired lease (even one's own, after a pause)
//! bumps the epoch. Not a session advisory lock: a frozen leader's connection stays open and
//! would keep such a lock for as long as the process lives.
//!
//! **Fencing** (`fence`). A store that was given a [`Fence`] (the leader's holder and epoch) checks it at
//! the start of every write transaction: the lease row must still name that holder and epoch
//! and be unexpired, or the write fails with [`StoreError::Fenced`] and writes nothing. On
//! PostgreSQL the check takes a share lock on the lease row, so a new leader's takeover waits
//! for writes already past their check to commit, and none can commit after it. A leader
//! paused past its lease (SIGSTOP, a partition from the database) therefore cannot write when
//! it wakes; it learns it lost and steps down.

use crate::fence::{LEADER, now_ms};
use crate::sql::Conn;
use crate::{Fence, LeaseStore, Result, SqlStore, StoreError};

/// The lease as the database holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub holder: String,
    pub epoch: u64,
    /// Where the leader serves (followers send writers there).
    pub address: String,
    /// Milliseconds of lease left by the database's clock (0 or less: expired).
    pub remaining_ms: i64,
    /// The SHA-256 (hex) of the TLS CA the leader serves under; empty for plaintext.
    pub tls_ca: String,
}

/// What [`LeaseStore::acquire_lease`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Election {
    /// The caller leads, under this lease (renewed, or taken over with a new epoch).
    Leading(Lease),
    /// Another controller leads.
    Following(Lease),
}

async fn read_lease(c: &mut Conn<'_>, lock: &str) -> Result<Option<Lease>> {
    let sql = format!(
        "SELECT holder, epoch, address, tls_ca, expires_at_ms - {} AS remaining_ms FROM controller_lease WHERE name = $1{lock}",
        now_ms(c)
    );
    let Some(row) = c.query(sql).bind(LEADER).optional().await? else { return Ok(None) };
    let t = "controller_lease";
    Ok(Some(Lease {
        holder: row.get(t, "holder")?,
        epoch: row.num(t, "epoch")?,
        address: row.get(t, "address")?,
        remaining_ms: row.get(t, "remaining_ms")?,
        tls_ca: row.get(t, "tls_ca")?,
    }))
}

#[async_trait::async_trait]
impl LeaseStore for SqlStore {
    async fn acquire_lease(
        &self,
        holder: &str,
        address: &str,
        tls_ca: &str,
        ttl_ms: i64,
    ) -> Result<Election> {
        self.elect("acquire_lease", async |c| {
            // A lease another controller holds is read without a lock: a follower's attempt
            // must not queue a `FOR UPDATE` on the row, behind the leader's writes and ahead of
            // its renewal.
            if let Some(l) = read_lease(c, "").await?
                && l.holder != holder
                && l.remaining_ms > 0
            {
                return Ok(Election::Following(l));
            }
            // The row exists from the migration on (epoch 0, expired), so there is always a row
            // to lock: two controllers starting at once queue on it instead of racing an insert.
            let lock = match c {
                Conn::Postgres(_) => " FOR UPDATE",
                Conn::Sqlite(_) => "",
            };
            let current = read_lease(c, lock).await?;
            let now = now_ms(c);
            let lease = match current {
                None => return Err(crate::corrupt("controller_lease", "the leader row is missing")),
                Some(l) if l.holder == holder && l.remaining_ms > 0 => {
                    let sql = format!(
                        "UPDATE controller_lease SET expires_at_ms = {now} + $1, address = $2, tls_ca = $3 WHERE name = $4"
                    );
                    c.query(sql).bind(ttl_ms).bind(address).bind(tls_ca).bind(LEADER).execute().await?;
                    Lease { address: address.into(), remaining_ms: ttl_ms, tls_ca: tls_ca.into(), ..l }
                }
                Some(l) if l.remaining_ms > 0 => return Ok(Election::Following(l)),
                Some(l) => {
                    // Expired: whoever takes it (its old holder too, after a pause) starts an epoch.
                    let sql = format!(
                        "UPDATE controller_lease SET holder = $1, epoch = epoch + 1, address = $2, tls_ca = $3, \
                         expires_at_ms = {now} + $4 WHERE name = $5"
                    );
                    c.query(sql).bind(holder).bind(address).bind(tls_ca).bind(ttl_ms).bind(LEADER).execute().await?;
                    Lease {
                        holder: holder.into(),
                        epoch: l.epoch + 1,
                        address: address.into(),
                        remaining_ms: ttl_ms,
                        tls_ca: tls_ca.into(),
                    }
                }
            };
            Ok(Election::Leading(lease))
        })
        .await
    }

    async fn renew_lease(&self, fence: &Fence, ttl_ms: i64) -> Result<bool> {
        let epoch = i64::try_from(fence.epoch)
            .map_err(|_| StoreError::Fenced(format!("epoch {} out of range", fence.epoch)))?;
        self.elect("renew_lease", async |c| {
            let now = now_ms(c);
            let sql = format!(
                "UPDATE controller_lease SET expires_at_ms = {now} + $1 \
                 WHERE name = $2 AND holder = $3 AND epoch = $4 AND expires_at_ms > {now}"
            );
            let n = c
                .query(sql)
                .bind(ttl_ms)
                .bind(LEADER)
                .bind(fence.holder.as_str())
                .bind(epoch)
                .execute()
                .await?;
            Ok(n == 1)
        })
        .await
    }

    async fn resign_lease(&self, fence: &Fence) -> Result<()> {
        let epoch = i64::try_from(fence.epoch)
            .map_err(|_| StoreError::Fenced(format!("epoch {} out of range", fence.epoch)))?;
        self.elect("resign_lease", async |c| {
            c.query("UPDATE controller_lease SET expires_at_ms = 0 WHERE name = $1 AND holder = $2 AND epoch = $3")
                .bind(LEADER)
                .bind(fence.holder.as_str())
                .bind(epoch)
                .execute()
                .await?;
            Ok(())
        })
        .await
    }

    async fn lease(&self) -> Result<Option<Lease>> {
        self.read("lease", async |c| read_lease(c, "").await).await
    }

    fn set_fence(&self, fence: Option<Fence>) {
        self.fence(fence);
    }

    fn fenced(&self) -> std::sync::Arc<tokio::sync::Notify> {
        self.fenced_notify()
    }
}
