//! The ceiling the ingest figures are read against: the same receipt rows stored by a plain
//! sqlx loop, with nothing of trainyard around it.
//!
//! The loop is pinned so its rate means the same thing on every machine. SQLite: a fresh file
//! on the same disk as the cluster's, created by [`SqlStore::open_sqlite_file`] (so the store's
//! own PRAGMAs, WAL and `synchronous=FULL`, and the receipts table with its key and indexes).
//! PostgreSQL: a fresh database on the cluster's own server (same settings, same disk), its
//! schema made by [`SqlStore::open_postgres`]. The rows of a job the cluster stored are copied
//! back in from one client, 1,000 rows per transaction, in the statement shape the store issues
//! on that backend (a multi-row `INSERT` on SQLite; one `INSERT ... SELECT FROM UNNEST ... ON
//! CONFLICT DO NOTHING` on PostgreSQL). `trainyard / raw` then says how much of what the
//! database and the disk allow the controller reaches, a figure that survives a change of
//! machine where a rate does not.

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use sqlx::{AssertSqlSafe, ColumnIndex, PgPool, Row, SqlitePool};
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

/// [`raw_insert_rate`] on a [`crate::Backend::Postgres`] cluster: the rows of `job` copied
/// into a fresh database on the cluster's own server (dropped with the server).
pub fn raw_insert_rate_postgres(c: &Cluster, job: u64) -> Result<f64> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        let from = PgPool::connect(c.db_url().context("a PostgreSQL cluster")?).await?;
        let sql = format!("SELECT {} FROM receipts WHERE job_id = $1 ORDER BY position", COLUMNS.join(", "));
        let rows = sqlx::query(AssertSqlSafe(sql)).bind(job as i64).fetch_all(&from).await;
        from.close().await;
        let rows = rows?.iter().map(receipt_row).collect::<Result<Vec<_>>>()?;
        let url = c.create_postgres_database()?;
        let store = SqlStore::open_postgres(&url).await.context("create the raw loop's database")?;
        let pool = store.postgres_pool().expect("a PostgreSQL store");
        let rate = insert_all_postgres(pool, &rows).await;
        pool.close().await;
        rate
    })
}

async fn read_rows(c: &Cluster, job: u64) -> Result<Vec<ReceiptRow>> {
    let url = format!("sqlite://{}?mode=ro", c.db_path().display());
    let pool = SqlitePool::connect(&url).await?;
    let sql = format!("SELECT {} FROM receipts WHERE job_id = ? ORDER BY position", COLUMNS.join(", "));
    let rows = sqlx::query(AssertSqlSafe(sql)).bind(job as i64).fetch_all(&pool).await;
    pool.close().await;
    rows?.iter().map(receipt_row).collect()
}

/// One row of the SELECT of [`COLUMNS`], from either backend.
fn receipt_row<R: Row>(r: &R) -> Result<ReceiptRow>
where
    usize: ColumnIndex<R>,
    i64: for<'r> sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    f64: for<'r> sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    String: for<'r> sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    Ok(ReceiptRow {
        ints: [r.try_get(0)?, r.try_get(1)?, r.try_get(2)?, r.try_get(3)?, r.try_get(5)?],
        texts: [r.try_get(4)?, r.try_get(6)?, r.try_get(8)?],
        reals: columns(r, 9)?,
        mems: columns(r, 18)?,
    })
}

/// `N` consecutive nullable columns of `row` from index `first`.
fn columns<R: Row, T, const N: usize>(row: &R, first: usize) -> Result<[Option<T>; N]>
where
    usize: ColumnIndex<R>,
    T: for<'r> sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
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

/// The PostgreSQL loop: per transaction, one `INSERT ... SELECT FROM UNNEST(...) ON CONFLICT DO
/// NOTHING` of 1,000 rows, the store's statement shape, timed from the first to the last commit.
async fn insert_all_postgres(pool: &PgPool, rows: &[ReceiptRow]) -> Result<f64> {
    let cast = |i: usize| match i {
        4 | 6 | 8 => "text[]",
        9..=17 => "float8[]",
        _ => "bigint[]",
    };
    let arrays: Vec<String> = (0..COLUMNS.len()).map(|i| format!("${}::{}", i + 1, cast(i))).collect();
    let sql = format!(
        "INSERT INTO receipts ({cols}) SELECT {cols} FROM UNNEST({}) AS t({cols}) \
         ON CONFLICT (job_id, attempt, rank, seq) DO NOTHING",
        arrays.join(", "),
        cols = COLUMNS.join(", ")
    );
    let started = Instant::now();
    for chunk in rows.chunks(ROWS_PER_TRANSACTION) {
        let now_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_millis() as i64;
        let ints = |i: usize| chunk.iter().map(|r| r.ints[i]).collect::<Vec<_>>();
        let texts = |i: usize| chunk.iter().map(|r| r.texts[i].clone()).collect::<Vec<_>>();
        let mut query = sqlx::query(AssertSqlSafe(sql.as_str()))
            .bind(ints(0))
            .bind(ints(1))
            .bind(ints(2))
            .bind(ints(3))
            .bind(texts(0))
            .bind(ints(4))
            .bind(texts(1))
            .bind(vec![now_ms; chunk.len()])
            .bind(texts(2));
        for i in 0..9 {
            query = query.bind(chunk.iter().map(|r| r.reals[i]).collect::<Vec<_>>());
        }
        for i in 0..3 {
            query = query.bind(chunk.iter().map(|r| r.mems[i]).collect::<Vec<_>>());
        }
        let mut tx = pool.begin().await?;
        query.execute(&mut *tx).await?;
        tx.commit().await?;
    }
    Ok(rows.len() as f64 / started.elapsed().as_secs_f64())
}
