//! [`ReceiptStore`]: receipt batches in, and the reads of `Watch`, resends and `ctl status`.

use async_trait::async_trait;

use crate::rows::{self, int};
use crate::sql::Conn;
use crate::{JobId, NewReceipt, ReceiptStore, Result, SqlStore, StoredReceiptRecord, postgres, sqlite};

#[async_trait]
impl ReceiptStore for SqlStore {
    async fn insert_receipts(&self, receipts: &[NewReceipt], now_ms: i64) -> Result<u64> {
        if receipts.is_empty() {
            return Ok(0);
        }
        // The hot path: each database gets the batch in the form it takes fastest.
        self.write("insert_receipts", async |c| match c {
            Conn::Sqlite(c) => sqlite::insert_receipts(c, receipts, now_ms).await,
            Conn::Postgres(c) => postgres::insert_receipts(c, receipts, now_ms).await,
        })
        .await
    }

    async fn receipts_after(&self, job: JobId, after: u64, limit: u32) -> Result<Vec<StoredReceiptRecord>> {
        self.read("receipts_after", async |c| {
            let found = c
                .query(
                    "SELECT position, job_id, attempt, rank, seq, kind, step, body FROM receipts \
                     WHERE job_id = $1 AND position > $2 ORDER BY position LIMIT $3",
                )
                .bind(int(job)?)
                .bind(int(after)?)
                .bind(i64::from(limit))
                .all()
                .await?;
            found.iter().map(rows::receipt).collect()
        })
        .await
    }

    async fn last_seqs(&self, job: JobId, attempt: u32) -> Result<Vec<(u32, u64)>> {
        self.read("last_seqs", async |c| {
            let found = c
                .query(
                    "SELECT rank, max(seq) AS seq FROM receipts WHERE job_id = $1 AND attempt = $2 \
                     GROUP BY rank ORDER BY rank",
                )
                .bind(int(job)?)
                .bind(i64::from(attempt))
                .all()
                .await?;
            found.iter().map(|row| Ok((row.num("receipts", "rank")?, row.num("receipts", "seq")?))).collect()
        })
        .await
    }

    async fn checkpoint_receipts(&self, job: JobId, limit: u32) -> Result<Vec<StoredReceiptRecord>> {
        self.read("checkpoint_receipts", async |c| {
            let found = c
                .query(
                    "SELECT position, job_id, attempt, rank, seq, kind, step, body FROM receipts \
                     WHERE job_id = $1 AND kind = 'checkpoint' ORDER BY position DESC LIMIT $2",
                )
                .bind(int(job)?)
                .bind(i64::from(limit))
                .all()
                .await?;
            found.iter().map(rows::receipt).collect()
        })
        .await
    }

    async fn receipt_count(&self, job: JobId) -> Result<u64> {
        self.read("receipt_count", async |c| {
            let row =
                c.query("SELECT count(*) AS n FROM receipts WHERE job_id = $1").bind(int(job)?).one().await?;
            row.num("receipts", "n")
        })
        .await
    }

    async fn receipt_problems(&self, job: JobId) -> Result<(u64, Option<String>)> {
        self.read("receipt_problems", async |c| {
            let row = c
                .query(
                    "SELECT count(*) AS n, (SELECT problem FROM receipts WHERE job_id = $1 \
                     AND problem IS NOT NULL ORDER BY position DESC LIMIT 1) AS newest \
                     FROM receipts WHERE job_id = $1 AND problem IS NOT NULL",
                )
                .bind(int(job)?)
                .one()
                .await?;
            Ok((row.num("receipts", "n")?, row.get("receipts", "newest")?))
        })
        .await
    }
}
