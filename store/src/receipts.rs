//! [`ReceiptStore`]: receipt batches in, and the reads of `Watch`, resends and `ctl status`.

use async_trait::async_trait;

use crate::group::{Next, answer_each};
use crate::rows::{self, int};
use crate::sql::Conn;
use crate::waiting::{Batch, Pending};
use crate::{
    JobId, NewReceipt, Queued, ReceiptStore, Result, SqlStore, StoredReceiptRecord, postgres, sqlite,
};

#[async_trait]
impl ReceiptStore for SqlStore {
    fn queue_receipts(&self, rows: Vec<NewReceipt>, now_ms: i64) -> Queued<'_> {
        if rows.is_empty() {
            return Box::pin(std::future::ready(Ok(0)));
        }
        let count = rows.len();
        // SQLite's values are bound here, while another caller's group may be writing.
        let batch = match self.sqlite_pool() {
            Some(_) => match sqlite::bind_receipts(rows, now_ms) {
                Ok(inserts) => Batch::Bound(inserts),
                Err(e) => return Box::pin(std::future::ready(Err(e))),
            },
            None => Batch::Rows(rows, now_ms),
        };
        let mut waiter = self.receipt_group.enqueue(|done| Pending { batch, rows: count, done });
        Box::pin(async move {
            loop {
                match waiter.next().await {
                    Next::Answered(stored) => return stored,
                    Next::Write(group) => write_group(self, group).await,
                }
            }
        })
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
                // Rank by rank down the (job_id, attempt, rank, seq) index, a few probes each:
                // a `GROUP BY rank` read every receipt of the attempt, and an agent's hello
                // after a failover waited seconds for it on a job of millions of receipts.
                .query(
                    "WITH RECURSIVE ranks(rank) AS ( \
                       SELECT min(rank) FROM receipts WHERE job_id = $1 AND attempt = $2 \
                       UNION ALL \
                       SELECT (SELECT min(rank) FROM receipts \
                               WHERE job_id = $1 AND attempt = $2 AND rank > ranks.rank) \
                       FROM ranks WHERE ranks.rank IS NOT NULL) \
                     SELECT rank, (SELECT max(seq) FROM receipts \
                                   WHERE job_id = $1 AND attempt = $2 AND rank = ranks.rank) AS seq \
                     FROM ranks WHERE rank IS NOT NULL ORDER BY rank",
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

    async fn prune_receipts(&self, ended_before_ms: i64) -> Result<u64> {
        self.write("prune_receipts", async |c| {
            Ok(c.query(
                "DELETE FROM receipts WHERE job_id IN (SELECT id FROM jobs \
                 WHERE state IN ('succeeded', 'failed', 'cancelled') AND updated_at_ms < $1)",
            )
            .bind(ended_before_ms)
            .execute()
            .await?)
        })
        .await
    }

    async fn receipt_bytes(&self, job: JobId) -> Result<(u64, u64)> {
        self.read("receipt_bytes", async |c| {
            let row = c
                .query(
                    "SELECT COALESCE(SUM(CASE WHEN kind = 'step' THEN length(body) ELSE 0 END), 0) AS step, \
                     COALESCE(SUM(CASE WHEN kind <> 'step' THEN length(body) ELSE 0 END), 0) AS other \
                     FROM receipts WHERE job_id = $1",
                )
                .bind(int(job)?)
                .one()
                .await?;
            Ok((row.num("receipts", "step")?, row.num("receipts", "other")?))
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

/// Rows in one group at most: a group's transaction stays short.
const GROUP_ROWS: usize = 50_000;

/// Writes `group` (in rounds of at most [`GROUP_ROWS`] rows) and answers every batch.
async fn write_group(store: &SqlStore, mut group: Vec<Pending>) {
    while !group.is_empty() {
        let mut rows = 0;
        let take = group.iter().take_while(|p| {
            rows += p.rows;
            rows <= GROUP_ROWS || rows == p.rows
        });
        let n = take.count().max(1);
        let (batches, answers): (Vec<Batch>, Vec<_>) = group.drain(..n).map(|p| (p.batch, p.done)).unzip();
        // The hot path: each database gets each batch in the form it takes fastest. A
        // PostgreSQL transaction retried after a conflict reads the rows again from the moved
        // batches, which its closure keeps.
        let result = store
            .write_receipts("insert_receipts", async move |c| match c {
                Conn::Sqlite(c) => {
                    let mut counts = Vec::with_capacity(batches.len());
                    for batch in batches {
                        let inserts = match batch {
                            Batch::Bound(inserts) => inserts,
                            Batch::Rows(rows, now_ms) => sqlite::bind_receipts(rows, now_ms)?,
                        };
                        counts.push(sqlite::insert_receipts(c, inserts).await?);
                    }
                    Ok(counts)
                }
                Conn::Postgres(c) => {
                    let borrowed = batches
                        .iter()
                        .map(|b| match b {
                            Batch::Rows(rows, now_ms) => Ok((rows.as_slice(), *now_ms)),
                            Batch::Bound(_) => Err(sqlx::Error::Protocol(
                                "a receipt batch bound for SQLite reached PostgreSQL".into(),
                            )),
                        })
                        .collect::<std::result::Result<Vec<(&[NewReceipt], i64)>, _>>()?;
                    postgres::insert_receipt_group(c, &borrowed).await
                }
            })
            .await;
        answer_each(answers, result, |done| done);
    }
}
