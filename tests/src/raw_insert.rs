//! The ceiling the ingest figures are read against: the same receipt rows stored by a plain
//! sqlx loop, with nothing of trainyard around it.
//!
//! The loop is pinned so its rate means the same thing on every machine: a fresh SQLite file on
//! the same disk as the cluster's, created by [`SqlStore::open_sqlite_file`] (so the store's own
//! PRAGMAs, WAL and `synchronous=FULL`, and the receipts table with its key and indexes), and
//! the rows of a job the cluster stored, copied back in with multi-row `INSERT`s, 1,000 rows per
//! transaction. `trainyard / raw` then says how much of what SQLite and the disk allow the
//! controller reaches, a figure that survives a change of machine where a rate does not.

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use sqlx::{AssertSqlSafe, Row, SqlitePool};
use trainyard_store::SqlStore;

use crate::Cluster;

/// Rows per transaction, and per `INSERT` statement.
pub const ROWS_PER_TRANSACTION: usize = 1_000;

/// The columns the controller writes for every receipt, in its insert's order.
const COLUMNS: [&str; 21] = [
    "job_id",
    "attempt",
    "rank",
    "seq",
    "kind",
    "step",
    "body",
    "stored_at_ms",
    "problem",
    "step_time_ms",
    "fwd_bwd_ms",
    "optimizer_ms",
    "optimizer_reduce_ms",
    "optimizer_compute_gather_ms",
    "optimizer_wait_ms",
    "tokens_per_s",
    "mfu",
    "loss",
    "mem_allocated_bytes",
    "mem_reserved_bytes",
    "mem_peak_allocated_bytes",
];

/// One stored receipt, every column as the controller wrote it (`stored_at_ms` aside).
struct ReceiptRow {
    ints: [Option<i64>; 5],
    texts: [Option<String>; 3],
    reals: [Option<f64>; 9],
    mems: [Option<i64>; 3],
}

/// Copies the receipts of `job` from the cluster's SQLite store into a fresh file under `dir`
/// with the pinned raw loop and returns its rate, rows per second (the file is removed after).
pub fn raw_insert_rate(c: &Cluster, job: u64, dir: &Path) -> Result<f64> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        let rows = read_rows(c, job).await.context("read the job's receipts back")?;
        let path = dir.join("raw-insert.db");
        let store = SqlStore::open_sqlite_file(&path).await.context("create the raw loop's database")?;
        let rate = insert_all(store.sqlite_pool().expect("a SQLite store"), &rows).await;
        store.sqlite_pool().expect("a SQLite store").close().await;
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
        }
        rate
    })
}

async fn read_rows(c: &Cluster, job: u64) -> Result<Vec<ReceiptRow>> {
    let url = format!("sqlite://{}?mode=ro", c.db_path().display());
    let pool = SqlitePool::connect(&url).await?;
    let sql = format!("SELECT {} FROM receipts WHERE job_id = ? ORDER BY position", COLUMNS.join(", "));
    let rows = sqlx::query(AssertSqlSafe(sql)).bind(job as i64).fetch_all(&pool).await;
    pool.close().await;
    rows?
        .iter()
        .map(|r| {
            Ok(ReceiptRow {
                ints: [r.try_get(0)?, r.try_get(1)?, r.try_get(2)?, r.try_get(3)?, r.try_get(5)?],
                texts: [r.try_get(4)?, r.try_get(6)?, r.try_get(8)?],
                reals: columns(r, 9)?,
                mems: columns(r, 18)?,
            })
        })
        .collect()
}

/// `N` consecutive nullable columns of `row` from index `first`.
fn columns<T, const N: usize>(row: &sqlx::sqlite::SqliteRow, first: usize) -> Result<[Option<T>; N]>
where
    T: for<'r> sqlx::Decode<'r, sqlx::Sqlite> + sqlx::Type<sqlx::Sqlite>,
{
    let values = (first..first + N).map(|i| row.try_get(i)).collect::<Result<Vec<Option<T>>, _>>()?;
    values.try_into().map_err(|_| anyhow::anyhow!("expected {N} columns from {first}"))
}

/// The loop itself, timed from its first `BEGIN` to its last `COMMIT`.
async fn insert_all(pool: &SqlitePool, rows: &[ReceiptRow]) -> Result<f64> {
    let one = format!("({})", vec!["?"; COLUMNS.len()].join(", "));
    let head = format!("INSERT INTO receipts ({}) VALUES ", COLUMNS.join(", "));
    let started = Instant::now();
    for chunk in rows.chunks(ROWS_PER_TRANSACTION) {
        let sql = format!("{head}{}", vec![one.as_str(); chunk.len()].join(", "));
        let now_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_millis() as i64;
        let mut query = sqlx::query(AssertSqlSafe(sql));
        for r in chunk {
            let [job, attempt, rank, seq, step] = r.ints;
            let [kind, body, problem] = &r.texts;
            query = query.bind(job).bind(attempt).bind(rank).bind(seq).bind(kind).bind(step).bind(body);
            query = query.bind(now_ms).bind(problem);
            for v in r.reals {
                query = query.bind(v);
            }
            for v in r.mems {
                query = query.bind(v);
            }
        }
        let mut tx = pool.begin().await?;
        query.execute(&mut *tx).await?;
        tx.commit().await?;
    }
    Ok(rows.len() as f64 / started.elapsed().as_secs_f64())
}
