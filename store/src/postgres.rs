//! The fleet backend: PostgreSQL through sqlx, schema in `migrations/postgres`.
//!
//! What is PostgreSQL's own:
//! - A transaction that failed on a serialization failure, a deadlock or a dropped connection
//!   (the server restarted, a proxy cut the link) is tried again from the start, with backoff,
//!   and SQLSTATE codes map to [`StoreError`]s once ([`classify`]).
//! - A receipt batch binds one array per column and inserts `SELECT ... FROM UNNEST(...)`: one
//!   statement and one round trip for a whole batch, whatever its size.
//! - Receipt writers serialise on a transaction-level advisory lock. Positions come from an
//!   identity column, and two concurrent batches could otherwise commit out of order: a `Watch`
//!   cursor that had read the later one would step over the earlier one for good.
//!
//! Durability is the server's: a receipt is acknowledged to its agent only after its
//! transaction committed, and with the server's default `synchronous_commit = on` a commit has
//! reached the server's WAL on disk.

use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgConnection, PgPoolOptions};
use sqlx::{PgPool, Row};

use crate::rows::int;
use crate::sql::Conn;
use crate::{NewReceipt, RankId, Result, StoreError};

/// Connections in the pool: receipt batches of several agents, the core's writes and the
/// readers (`Watch`, `ctl status`) run side by side.
const POOL_SIZE: u32 = 8;

/// How often a transaction is tried before its error reaches the caller, and the first pause
/// between tries (doubled each time, capped at [`MAX_BACKOFF`]): about 20 s in all, enough for
/// a PostgreSQL restart.
const TRIES: u32 = 12;
const FIRST_BACKOFF: Duration = Duration::from_millis(50);
const MAX_BACKOFF: Duration = Duration::from_secs(3);

/// Key of the advisory lock receipt writers hold until they commit (any constant; it only has
/// to differ from other users' advisory locks in the same database).
const RECEIPTS_LOCK: i64 = 0x7472_6169_6e79_6172; // "trainyar"

/// Connections kept for the election alone (acquire, renew, resign the lease): a leader's
/// renewal must never queue for a connection behind a flood of receipt batches, or the lease
/// runs out under load and leadership flaps (1,000 agents flooding did exactly that).
const ELECTION_POOL_SIZE: u32 = 2;

/// How long the server lets a session sit idle inside an open transaction before it ends the
/// session (`idle_in_transaction_session_timeout`), for every connection of both pools. A
/// leader frozen (SIGSTOP) or cut off from the database between two statements of a write
/// would otherwise keep its share lock on the lease row, and the receipts lock, for as long
/// as it stays frozen: a follower's takeover (`FOR UPDATE` on that row) would wait behind it
/// and the group would have no leader at all. Our transactions never wait on the client
/// between statements for more than a few milliseconds; a session ended this way fails its
/// statement as a lost connection, tried again from the start, where the fence refuses it.
const IDLE_IN_TRANSACTION: Duration = Duration::from_secs(2);

/// The PostgreSQL pools: one for the store's work, one for the election.
#[derive(Debug, Clone)]
pub(crate) struct Postgres {
    pub(crate) pool: PgPool,
    election: PgPool,
}

impl Postgres {
    /// Connects to a `postgres://` URL and applies the migrations. The database must exist.
    pub(crate) async fn open(url: &str) -> Result<Self> {
        let idle = IDLE_IN_TRANSACTION.as_millis().to_string();
        let options: PgConnectOptions = url
            .parse::<PgConnectOptions>()?
            .options([("idle_in_transaction_session_timeout", idle.as_str())]);
        let pool = PgPoolOptions::new()
            .max_connections(POOL_SIZE)
            .acquire_timeout(Duration::from_secs(5))
            .connect_with(options.clone().application_name("trainyard-controller"))
            .await
            .map_err(classify)?;
        sqlx::migrate!("../migrations/postgres").run(&pool).await?;
        let election = PgPoolOptions::new()
            .max_connections(ELECTION_POOL_SIZE)
            .acquire_timeout(Duration::from_secs(5))
            .connect_lazy_with(options.application_name("trainyard-controller-election"));
        Ok(Postgres { pool, election })
    }

    /// One transaction around `body`, committed if it succeeds, rolled back (by drop) if it
    /// fails, and tried again from the start when the failure was transient. `body` is cloned
    /// for each try (it captures references only, so a clone is a copy).
    pub(crate) async fn transaction<T>(
        &self,
        op: &'static str,
        body: impl AsyncFnOnce(&mut Conn<'_>) -> Result<T> + Clone,
    ) -> Result<T> {
        self.transaction_on(&self.pool, op, body).await
    }

    /// [`Postgres::transaction`] on the election's own connections.
    pub(crate) async fn election_transaction<T>(
        &self,
        op: &'static str,
        body: impl AsyncFnOnce(&mut Conn<'_>) -> Result<T> + Clone,
    ) -> Result<T> {
        self.transaction_on(&self.election, op, body).await
    }

    async fn transaction_on<T>(
        &self,
        pool: &PgPool,
        op: &'static str,
        body: impl AsyncFnOnce(&mut Conn<'_>) -> Result<T> + Clone,
    ) -> Result<T> {
        let mut pause = FIRST_BACKOFF;
        let mut tries = 0;
        loop {
            tries += 1;
            match try_once(pool, body.clone()).await {
                Err(StoreError::Database(e)) if tries < TRIES && retryable(&e) => {
                    tracing::warn!(op, tries, error = %e, "database transaction failed, trying again");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(MAX_BACKOFF);
                }
                Err(StoreError::Database(e)) => return Err(classify(e)),
                other => return other,
            }
        }
    }
}

async fn try_once<T>(pool: &PgPool, body: impl AsyncFnOnce(&mut Conn<'_>) -> Result<T>) -> Result<T> {
    let mut tx = pool.begin().await?;
    let value = body(&mut Conn::Postgres(&mut tx)).await?;
    tx.commit().await?;
    Ok(value)
}

/// Takes the receipts lock for the rest of the transaction: receipt writers commit one at a
/// time (see [`insert_receipt_group`]). Taken before the fence check, so that writers waiting for it
/// hold no lock on the lease row and a renewal waits for one batch at most.
pub(crate) async fn lock_receipts(c: &mut PgConnection) -> Result<()> {
    sqlx::query("SELECT pg_advisory_xact_lock($1)").bind(RECEIPTS_LOCK).execute(&mut *c).await?;
    Ok(())
}

/// The SQLSTATE of a database error, if the server sent one.
fn sqlstate(e: &sqlx::Error) -> Option<String> {
    match e {
        sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
        _ => None,
    }
}

/// Whether trying the whole transaction again may succeed: serialization failures (40001),
/// deadlocks (40P01), lost connections (class 08), a session the server ended for idling in a
/// transaction (25P03, see [`IDLE_IN_TRANSACTION`]), a server shutting down or restarting
/// (57P01-57P03), and I/O or pool errors on the way to it.
fn retryable(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::Tls(_) => true,
        sqlx::Error::Protocol(_) | sqlx::Error::WorkerCrashed => true,
        _ => sqlstate(e).is_some_and(|c| {
            c == "40001"
                || c == "40P01"
                || c.starts_with("08")
                || matches!(c.as_str(), "25P03" | "57P01" | "57P02" | "57P03")
        }),
    }
}

/// Maps a database error that is not retried (or ran out of tries) to the store's error kinds.
fn classify(e: sqlx::Error) -> StoreError {
    if retryable(&e) && !matches!(sqlstate(&e).as_deref(), Some("40001" | "40P01")) {
        return StoreError::Unavailable(e.to_string());
    }
    StoreError::Database(e)
}

/// Stores a group of receipt batches (each with its `stored_at_ms`) in one `UNNEST` insert, and
/// returns how many rows of each batch were new. One statement and one round trip however many
/// batches: a fleet of 1,000 agents sends thousands of small batches a second, and a statement
/// each kept the one writer busy with round trips while the rows waited. The caller holds the
/// receipts lock ([`lock_receipts`], taken by `SqlStore::write_receipts`).
///
/// New rows come back counted per rank, and a rank's count goes to the batch that carried it. A
/// rank with rows in two batches of one group (never from one agent's ordered stream, but not
/// impossible) cannot be split that way: such a group goes a statement per batch.
pub(crate) async fn insert_receipt_group(
    c: &mut PgConnection,
    batches: &[(&[NewReceipt], i64)],
) -> Result<Vec<u64>> {
    let mut owner: std::collections::HashMap<RankId, usize> = std::collections::HashMap::new();
    let mut shared = false;
    for (i, (rows, _)) in batches.iter().enumerate() {
        let mut last = None;
        for r in rows.iter().filter(|r| last.replace(r.id) != Some(r.id)) {
            shared |= *owner.entry(r.id).or_insert(i) != i;
        }
    }
    if shared {
        let mut counts = Vec::with_capacity(batches.len());
        for batch in batches {
            counts.push(insert(c, std::slice::from_ref(batch)).await?.iter().map(|(_, n)| n).sum());
        }
        return Ok(counts);
    }
    let mut counts = vec![0; batches.len()];
    for (id, n) in insert(c, batches).await? {
        if let Some(&i) = owner.get(&id) {
            counts[i] += n;
        }
    }
    Ok(counts)
}

/// The one `INSERT ... SELECT FROM UNNEST` of [`insert_receipt_group`]; new rows per rank.
async fn insert(c: &mut PgConnection, batches: &[(&[NewReceipt], i64)]) -> Result<Vec<(RankId, u64)>> {
    let columns = ReceiptColumns::of(batches)?;
    let [t0, t1, t2, t3, t4, t5, t6, t7, t8] = &columns.times;
    let [b0, b1, b2] = &columns.bytes;
    let found = sqlx::query(
        "WITH new AS (INSERT INTO receipts (job_id, attempt, rank, seq, kind, step, body, stored_at_ms, \
         problem, step_time_ms, fwd_bwd_ms, optimizer_ms, optimizer_reduce_ms, \
         optimizer_compute_gather_ms, optimizer_wait_ms, tokens_per_s, mfu, loss, mem_allocated_bytes, \
         mem_reserved_bytes, mem_peak_allocated_bytes) \
         SELECT job_id, attempt, rank, seq, kind, step, body, stored_at_ms, problem, t0, t1, t2, t3, t4, \
         t5, t6, t7, t8, b0, b1, b2 \
         FROM UNNEST($1::bigint[], $2::bigint[], $3::bigint[], $4::bigint[], $5::text[], \
         $6::bigint[], $7::text[], $8::bigint[], $9::text[], $10::float8[], $11::float8[], $12::float8[], \
         $13::float8[], $14::float8[], $15::float8[], $16::float8[], $17::float8[], $18::float8[], \
         $19::bigint[], $20::bigint[], $21::bigint[]) \
         AS t(job_id, attempt, rank, seq, kind, step, body, stored_at_ms, problem, t0, t1, t2, t3, t4, \
         t5, t6, t7, t8, b0, b1, b2) \
         ON CONFLICT (job_id, attempt, rank, seq) DO NOTHING \
         RETURNING job_id, attempt, rank) \
         SELECT job_id, attempt, rank, count(*) AS n FROM new GROUP BY job_id, attempt, rank",
    )
    .bind(&columns.job_id)
    .bind(&columns.attempt)
    .bind(&columns.rank)
    .bind(&columns.seq)
    .bind(&columns.kind)
    .bind(&columns.step)
    .bind(&columns.body)
    .bind(&columns.stored_at)
    .bind(&columns.problem)
    .bind(t0)
    .bind(t1)
    .bind(t2)
    .bind(t3)
    .bind(t4)
    .bind(t5)
    .bind(t6)
    .bind(t7)
    .bind(t8)
    .bind(b0)
    .bind(b1)
    .bind(b2)
    .fetch_all(&mut *c)
    .await?;
    found
        .iter()
        .map(|row| {
            let id = RankId {
                job_id: row.try_get::<i64, _>(0)? as u64,
                attempt: row.try_get::<i64, _>(1)? as u32,
                rank: row.try_get::<i64, _>(2)? as u32,
            };
            Ok((id, row.try_get::<i64, _>(3)? as u64))
        })
        .collect()
}

/// Receipt batches as one array per column.
struct ReceiptColumns<'a> {
    job_id: Vec<i64>,
    attempt: Vec<i64>,
    rank: Vec<i64>,
    seq: Vec<i64>,
    kind: Vec<&'a str>,
    step: Vec<Option<i64>>,
    body: Vec<&'a str>,
    stored_at: Vec<i64>,
    problem: Vec<Option<&'a str>>,
    /// The typed step columns (receipt schema v1), NULL for other kinds.
    times: [Vec<Option<f64>>; 9],
    bytes: [Vec<Option<i64>>; 3],
}

impl<'a> ReceiptColumns<'a> {
    fn of(batches: &[(&'a [NewReceipt], i64)]) -> Result<Self> {
        let n = batches.iter().map(|(rows, _)| rows.len()).sum();
        let mut c = ReceiptColumns {
            job_id: Vec::with_capacity(n),
            attempt: Vec::with_capacity(n),
            rank: Vec::with_capacity(n),
            seq: Vec::with_capacity(n),
            kind: Vec::with_capacity(n),
            step: Vec::with_capacity(n),
            body: Vec::with_capacity(n),
            stored_at: Vec::with_capacity(n),
            problem: Vec::with_capacity(n),
            times: Default::default(),
            bytes: Default::default(),
        };
        for (r, &stored_at) in batches.iter().flat_map(|(rows, at)| rows.iter().map(move |r| (r, at))) {
            c.job_id.push(int(r.id.job_id)?);
            c.attempt.push(i64::from(r.id.attempt));
            c.rank.push(i64::from(r.id.rank));
            c.seq.push(int(r.seq)?);
            c.kind.push(&r.kind);
            c.step.push(r.step);
            c.body.push(&r.body);
            c.stored_at.push(stored_at);
            c.problem.push(r.problem.as_deref());
            let m = r.metrics.clone().unwrap_or_default();
            let times = [
                m.step_time_ms,
                m.fwd_bwd_ms,
                m.optimizer_ms,
                m.optimizer_reduce_ms,
                m.optimizer_compute_gather_ms,
                m.optimizer_wait_ms,
                m.tokens_per_s,
                m.mfu,
                m.loss,
            ];
            for (column, v) in c.times.iter_mut().zip(times) {
                column.push(v);
            }
            let bytes = [m.mem_allocated_bytes, m.mem_reserved_bytes, m.mem_peak_allocated_bytes];
            for (column, v) in c.bytes.iter_mut().zip(bytes) {
                column.push(v);
            }
        }
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transient_errors_are_retried_and_the_rest_classified() {
        let io = sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert!(retryable(&io));
        assert!(matches!(classify(io), StoreError::Unavailable(_)));
        assert!(!retryable(&sqlx::Error::RowNotFound));
        assert!(matches!(classify(sqlx::Error::RowNotFound), StoreError::Database(_)));
    }
}
