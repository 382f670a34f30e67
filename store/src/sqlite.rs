//! The embedded backend: one SQLite file (WAL), schema in `migrations/sqlite`.
//!
//! What is SQLite's own: how the file is opened (WAL, `synchronous=FULL`, foreign keys, a busy
//! timeout), how a transaction starts (`BEGIN IMMEDIATE` after a turn in the process's writer
//! queue), and the receipt batch as chunked multi-row inserts under SQLite's parameter limit.
//!
//! Durability: a receipt is acknowledged to the agent only after its transaction commits, and
//! the agent then moves its resend cursor past it. A SIGKILL of the controller alone loses
//! nothing once `write()` returned (the data sits in the kernel's page cache), but a kernel
//! panic or power cut would; `FULL` makes every commit fsync the WAL, so an acknowledged
//! receipt survives those too. With `NORMAL` the WAL is only synced at checkpoints and the
//! last acknowledged batches could vanish for good.

use std::path::Path;
use std::str::FromStr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use sqlx::sqlite::{
    SqliteArguments, SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePoolOptions,
    SqliteSynchronous,
};
use sqlx::{Arguments as _, SqlitePool};

use crate::rows::int;
use crate::sql::{Conn, Marks, pow2_inserts, pow2_sizes};
use crate::{NewReceipt, Result};

/// Connections in the pool. SQLite has one writer at a time anyway; a few connections let
/// readers (`Watch`, `ctl status`) run beside the writer under WAL.
const POOL_SIZE: u32 = 4;

/// How long a writer waits for another writer's lock before failing with `SQLITE_BUSY`.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

/// Columns bound per row of `receipts` in the multi-row insert (the typed step columns included).
const RECEIPT_PARAMS: usize = 21;

/// Largest multi-row insert, in rows: a power of two with `RECEIPT_PARAMS * rows` well under
/// SQLite's limit of 32,766 bound parameters. Smaller remainders are inserted with the power
/// of two sizes below it, so at most 11 distinct statements exist and all stay in the
/// connection's prepared-statement cache.
const MAX_CHUNK_LOG2: u32 = 10;

// The largest statement stays under SQLite's limit of bound parameters.
const _: () = assert!(RECEIPT_PARAMS << MAX_CHUNK_LOG2 < 32_766);

/// Whether an operation writes: writers take the write lock at `BEGIN IMMEDIATE`, so they wait
/// in SQLite's busy handler instead of failing when a read lock cannot be upgraded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    Read,
    Write,
}

/// The SQLite pool and the queue its writers take turns in.
#[derive(Debug, Clone)]
pub(crate) struct Sqlite {
    pub(crate) pool: SqlitePool,
    /// Writers of this process take turns here before `BEGIN IMMEDIATE`. SQLite admits one
    /// writer at a time, and one that finds the file locked waits in its busy handler, which
    /// sleeps in steps of up to 100 ms whether or not the lock is freed sooner: two agents'
    /// receipt batches would sleep past each other's commits. A queue in the process hands the
    /// lock over the moment the writer before commits (the busy handler still covers writers of
    /// other processes, such as `trainyard-controller admin`).
    writers: Arc<tokio::sync::Mutex<()>>,
    /// The database file (`None` in memory).
    path: Option<std::path::PathBuf>,
}

/// A controller's claim on a SQLite file: an exclusive lock on `<file>.controller-lock`, held
/// for as long as this value lives (the kernel drops it when the process dies, SIGKILL
/// included). SQLite serves one controller: two would each hold jobs, agents and scheduling
/// decisions in memory that the other never sees. Tools that only read or edit rows (such as
/// `trainyard-controller user`) do not claim.
#[derive(Debug)]
pub struct SqliteClaim {
    _file: std::fs::File,
}

/// Takes the claim on the database at `db`; the error says who holds it and what to use
/// instead.
pub(crate) fn claim(db: &Path) -> std::result::Result<SqliteClaim, String> {
    use std::io::{Read, Seek, Write};
    let lock_path = std::path::PathBuf::from(format!("{}.controller-lock", db.display()));
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(&lock_path)
        .map_err(|e| format!("open {}: {e}", lock_path.display()))?;
    match file.try_lock() {
        Ok(()) => {
            // Who holds it, for the message a second controller prints.
            let _ = file.set_len(0);
            let _ = file.rewind();
            let _ = write!(file, "{}", std::process::id());
            let _ = file.flush();
            Ok(SqliteClaim { _file: file })
        }
        Err(std::fs::TryLockError::WouldBlock) => {
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            let holder = holder.trim();
            let who = if holder.is_empty() { String::new() } else { format!(" (pid {holder})") };
            Err(format!(
                "another trainyard-controller{who} already uses the SQLite database {}: SQLite serves one \
                 controller. To run several controllers (one leads, the others take over when it dies), point \
                 them all at one PostgreSQL with --db postgres://...; otherwise stop the other controller first",
                db.display()
            ))
        }
        Err(std::fs::TryLockError::Error(e)) => Err(format!("lock {}: {e}", lock_path.display())),
    }
}

/// Creates the empty file `path`, mode 0600, unless it exists (then it is left as it is).
fn create_private(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
    match std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path) {
        Ok(file) => file.set_permissions(std::fs::Permissions::from_mode(0o600)),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(e),
    }
}

impl Sqlite {
    /// Opens `sqlite://...` URLs (options in the URL are kept, ours are applied on top) or a
    /// plain file path.
    pub(crate) async fn open(url_or_path: &str) -> Result<Self> {
        if url_or_path.starts_with("sqlite:") {
            let options = SqliteConnectOptions::from_str(url_or_path)?;
            // Each connection to an in-memory URL would see its own database: keep one.
            let in_memory = url_or_path.contains(":memory:") || url_or_path.contains("mode=memory");
            Self::open_with(options, if in_memory { 1 } else { POOL_SIZE }).await
        } else {
            Self::open_file(Path::new(url_or_path)).await
        }
    }

    /// Opens (creating it if missing) the database file at `path` and applies the migrations.
    /// A new file is created 0600 whatever the umask (it holds every job's spec and receipts);
    /// SQLite gives its `-wal` and `-shm` files the database file's mode.
    pub(crate) async fn open_file(path: &Path) -> Result<Self> {
        create_private(path).map_err(|e| {
            crate::StoreError::Database(sqlx::Error::Io(std::io::Error::new(
                e.kind(),
                format!("create {}: {e}", path.display()),
            )))
        })?;
        Self::open_with(SqliteConnectOptions::new().filename(path), POOL_SIZE).await
    }

    /// The database file, unless it is in memory.
    pub(crate) fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// A private in-memory database. One connection that never expires: every connection to
    /// `:memory:` would otherwise see its own empty database.
    pub(crate) async fn open_in_memory() -> Result<Self> {
        Self::open_with(SqliteConnectOptions::from_str("sqlite::memory:")?, 1).await
    }

    async fn open_with(options: SqliteConnectOptions, max_connections: u32) -> Result<Self> {
        let path = Some(options.get_filename().to_path_buf())
            .filter(|p| !p.as_os_str().is_empty() && p.as_os_str() != ":memory:" && max_connections > 1);
        let options = options
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .foreign_keys(true)
            .busy_timeout(BUSY_TIMEOUT);
        if max_connections > 1 {
            // One connection switches a new file to WAL and migrates it before the pool opens
            // more: connections racing to do that get SQLITE_BUSY without waiting.
            use sqlx::Connection as _;
            let mut first = SqliteConnection::connect_with(&options).await?;
            sqlx::migrate!("../migrations/sqlite").run(&mut first).await?;
            first.close().await?;
        }
        let pool = SqlitePoolOptions::new()
            .max_connections(max_connections)
            .min_connections(1)
            .idle_timeout(None)
            .max_lifetime(None)
            .connect_with(options)
            .await?;
        sqlx::migrate!("../migrations/sqlite").run(&pool).await?;
        Ok(Sqlite { pool, writers: Arc::default(), path })
    }

    /// One transaction around `body`: committed if it succeeds, rolled back (by drop) if not.
    pub(crate) async fn transaction<T>(
        &self,
        mode: Mode,
        body: impl AsyncFnOnce(&mut Conn<'_>) -> Result<T>,
    ) -> Result<T> {
        let _turn = match mode {
            Mode::Read => None,
            Mode::Write => Some(self.writers.lock().await),
        };
        let mut tx = match mode {
            Mode::Read => self.pool.begin().await?,
            Mode::Write => self.pool.begin_with("BEGIN IMMEDIATE").await?,
        };
        let value = body(&mut Conn::Sqlite(&mut tx)).await?;
        tx.commit().await?;
        Ok(value)
    }
}

/// One multi-row receipt insert with its values bound: its statement (one of
/// [`MAX_CHUNK_LOG2`] + 1 texts) and its arguments.
pub(crate) type Insert = (Arc<str>, SqliteArguments);

/// Binds a receipt batch into multi-row inserts of power-of-two sizes. The caller does this
/// before its batch joins a commit group, so the group's writer only executes: binding ran
/// inside the transaction before, between statements, while SQLite's thread waited. The
/// rows' strings move into the arguments (each body bound without a copy).
pub(crate) fn bind_receipts(receipts: Vec<NewReceipt>, now_ms: i64) -> Result<Vec<Insert>> {
    let mut inserts = Vec::new();
    let mut rows = receipts.into_iter();
    for log2 in pow2_sizes(rows.len(), MAX_CHUNK_LOG2) {
        let mut a = SqliteArguments::default();
        a.reserve(RECEIPT_PARAMS << log2, 0);
        for r in rows.by_ref().take(1 << log2) {
            let m = r.metrics.unwrap_or_default();
            add(&mut a, int(r.id.job_id)?)?;
            add(&mut a, i64::from(r.id.attempt))?;
            add(&mut a, i64::from(r.id.rank))?;
            add(&mut a, int(r.seq)?)?;
            add(&mut a, kind_text(&r.kind))?;
            add(&mut a, r.step)?;
            add(&mut a, r.body)?;
            add(&mut a, now_ms)?;
            add(&mut a, r.problem)?;
            let times = [m.step_time_ms, m.fwd_bwd_ms, m.optimizer_ms, m.optimizer_reduce_ms];
            let rest = [m.optimizer_compute_gather_ms, m.optimizer_wait_ms, m.tokens_per_s, m.mfu, m.loss];
            for v in times.into_iter().chain(rest) {
                add(&mut a, v)?;
            }
            for v in [m.mem_allocated_bytes, m.mem_reserved_bytes, m.mem_peak_allocated_bytes] {
                add(&mut a, v)?;
            }
        }
        inserts.push((insert_receipts_sql(log2), a));
    }
    Ok(inserts)
}

fn add<T>(a: &mut SqliteArguments, value: T) -> Result<()>
where
    T: sqlx::Encode<'static, sqlx::Sqlite> + sqlx::Type<sqlx::Sqlite>,
{
    a.add(value).map_err(|e| crate::StoreError::Database(sqlx::Error::Encode(e)))
}

/// Runs a batch's bound inserts; returns how many rows were new.
pub(crate) async fn insert_receipts(c: &mut SqliteConnection, inserts: Vec<Insert>) -> Result<u64> {
    let mut inserted = 0;
    for (sql, arguments) in inserts {
        let query = sqlx::query_with(sqlx::AssertSqlSafe(sql), arguments);
        inserted += query.execute(&mut *c).await?.rows_affected();
    }
    Ok(inserted)
}

/// A receipt's kind as a shared string: the common kinds are one allocation each for the
/// life of the process, bound by a reference count; any other is copied.
fn kind_text(kind: &str) -> Arc<str> {
    static KNOWN: OnceLock<Vec<Arc<str>>> = OnceLock::new();
    let known = KNOWN.get_or_init(|| {
        trainyard_model::domain::ReceiptKind::ALL.iter().map(|k| Arc::from(k.as_str())).collect()
    });
    known.iter().find(|k| ***k == *kind).cloned().unwrap_or_else(|| Arc::from(kind))
}

/// The receipt insert for `2^log2` rows, built once per size, so the statement text (the key
/// of sqlx's statement cache) is identical every time.
fn insert_receipts_sql(log2: u32) -> Arc<str> {
    static SQL: OnceLock<Vec<Arc<str>>> = OnceLock::new();
    let all = SQL.get_or_init(|| {
        let head = "receipts (job_id, attempt, rank, seq, kind, step, body, stored_at_ms, problem, \
                    step_time_ms, fwd_bwd_ms, optimizer_ms, optimizer_reduce_ms, optimizer_compute_gather_ms, \
                    optimizer_wait_ms, tokens_per_s, mfu, loss, mem_allocated_bytes, mem_reserved_bytes, \
                    mem_peak_allocated_bytes)";
        let tail = " ON CONFLICT (job_id, attempt, rank, seq) DO NOTHING";
        pow2_inserts(Marks::Anonymous, head, RECEIPT_PARAMS, MAX_CHUNK_LOG2, tail)
    });
    Arc::clone(&all[log2 as usize])
}
