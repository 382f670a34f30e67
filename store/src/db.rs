//! [`SqlStore`]: the store on either database, and the one helper every operation goes
//! through.

use std::path::Path;

use sqlx::{PgPool, SqlitePool};
use tracing::Instrument;

use crate::Result;
use crate::postgres::Postgres;
use crate::sql::Conn;
use crate::sqlite::{Mode, Sqlite};

/// The controller's store on SQLite (the embedded default) or PostgreSQL (fleets). Every
/// query is written once for both (`jobs`, `fleet`, `receipts`, `preflight`, `auth`,
/// `series`); what differs between the two is in `sqlite` and `postgres`.
///
/// # What we persist
/// See the [crate documentation](crate); the schema with a comment on every column is in
/// `migrations/sqlite/` and `migrations/postgres/`, and `docs/schema.md` explains it to
/// operators.
#[derive(Debug, Clone)]
pub struct SqlStore {
    backend: Backend,
    /// When set, every write transaction first checks that this lease still holds
    /// (`fence::check_fence`); shared by the store's clones.
    fence: std::sync::Arc<std::sync::RwLock<Option<crate::Fence>>>,
    /// Notified when a leader's write is refused by its fence ([`crate::LeaseStore::fenced`]).
    fenced: std::sync::Arc<tokio::sync::Notify>,
    /// Receipt batches waiting to be written together ([`crate::group`]).
    pub(crate) receipt_group: std::sync::Arc<crate::waiting::ReceiptGroup>,
    /// Rank reports waiting to be written together ([`crate::group`]).
    pub(crate) rank_group: std::sync::Arc<crate::waiting::RankGroup>,
}

#[derive(Debug, Clone)]
enum Backend {
    Sqlite(Sqlite),
    Postgres(Postgres),
}

impl SqlStore {
    /// Opens the store a `--db` value names: `postgres://` or `postgresql://` URLs open
    /// PostgreSQL, `sqlite:` URLs and plain paths open SQLite. Migrations run on open.
    pub async fn open(url_or_path: &str) -> Result<Self> {
        if url_or_path.starts_with("postgres://") || url_or_path.starts_with("postgresql://") {
            Self::open_postgres(url_or_path).await
        } else {
            Self::open_sqlite(url_or_path).await
        }
    }

    /// SQLite at a `sqlite://...` URL (options in the URL are kept, ours are applied on top) or
    /// a plain file path.
    pub async fn open_sqlite(url_or_path: &str) -> Result<Self> {
        Ok(SqlStore::of(Backend::Sqlite(Sqlite::open(url_or_path).await?)))
    }

    /// SQLite in the file at `path`, created if missing.
    pub async fn open_sqlite_file(path: &Path) -> Result<Self> {
        Ok(SqlStore::of(Backend::Sqlite(Sqlite::open_file(path).await?)))
    }

    /// A private in-memory SQLite database, for tests.
    pub async fn sqlite_in_memory() -> Result<Self> {
        Ok(SqlStore::of(Backend::Sqlite(Sqlite::open_in_memory().await?)))
    }

    /// PostgreSQL at a `postgres://` URL; the database must exist.
    pub async fn open_postgres(url: &str) -> Result<Self> {
        Ok(SqlStore::of(Backend::Postgres(Postgres::open(url).await?)))
    }

    fn of(backend: Backend) -> SqlStore {
        SqlStore {
            backend,
            fence: Default::default(),
            fenced: Default::default(),
            receipt_group: Default::default(),
            rank_group: Default::default(),
        }
    }

    /// [`crate::LeaseStore::set_fence`].
    pub(crate) fn fenced_notify(&self) -> std::sync::Arc<tokio::sync::Notify> {
        self.fenced.clone()
    }

    pub(crate) fn fence(&self, fence: Option<crate::Fence>) {
        *self.fence.write().unwrap_or_else(|e| e.into_inner()) = fence;
    }

    /// For the controller daemon: takes the one-controller claim on a SQLite file
    /// ([`crate::SqliteClaim`]), held while the value lives. `Ok(None)` on PostgreSQL (where
    /// several controllers share the database and a lease elects the leader) and in memory.
    pub fn claim_for_controller(&self) -> Result<Option<crate::SqliteClaim>> {
        match &self.backend {
            Backend::Sqlite(s) => match s.path() {
                Some(path) => crate::sqlite::claim(path).map(Some).map_err(crate::StoreError::InUse),
                None => Ok(None),
            },
            Backend::Postgres(_) => Ok(None),
        }
    }

    /// The SQLite pool, for read-only SQL that is not part of the store's contract (operator
    /// views, tests); `None` on PostgreSQL. Writes go through the traits.
    pub fn sqlite_pool(&self) -> Option<&SqlitePool> {
        match &self.backend {
            Backend::Sqlite(s) => Some(&s.pool),
            Backend::Postgres(_) => None,
        }
    }

    /// The PostgreSQL pool, likewise; `None` on SQLite.
    pub fn postgres_pool(&self) -> Option<&PgPool> {
        match &self.backend {
            Backend::Postgres(p) => Some(&p.pool),
            Backend::Sqlite(_) => None,
        }
    }

    /// Runs `body` in one read transaction.
    pub(crate) async fn read<T>(
        &self,
        op: &'static str,
        body: impl AsyncFnOnce(&mut Conn<'_>) -> Result<T> + Clone,
    ) -> Result<T> {
        self.run(op, Mode::Read, body).await
    }

    /// Runs `body` in one write transaction, after the fence check when the store has a fence.
    pub(crate) async fn write<T>(
        &self,
        op: &'static str,
        body: impl AsyncFnOnce(&mut Conn<'_>) -> Result<T> + Clone,
    ) -> Result<T> {
        self.write_with(op, false, body).await
    }

    /// [`SqlStore::write`] for receipt batches: on PostgreSQL the receipts lock is taken first,
    /// then the fence is checked (see `postgres::lock_receipts`).
    pub(crate) async fn write_receipts<T>(
        &self,
        op: &'static str,
        body: impl AsyncFnOnce(&mut Conn<'_>) -> Result<T> + Clone,
    ) -> Result<T> {
        self.write_with(op, true, body).await
    }

    async fn write_with<T>(
        &self,
        op: &'static str,
        receipts_lock: bool,
        body: impl AsyncFnOnce(&mut Conn<'_>) -> Result<T> + Clone,
    ) -> Result<T> {
        let fence = self.fence.read().unwrap_or_else(|e| e.into_inner()).clone();
        let leads = fence.as_ref().is_some_and(|f| f.epoch > 0);
        let result = self
            .run(op, Mode::Write, async move |c: &mut Conn<'_>| {
                if let (true, Conn::Postgres(pg)) = (receipts_lock, &mut *c) {
                    crate::postgres::lock_receipts(pg).await?;
                }
                if let Some(fence) = &fence {
                    crate::fence::check_fence(c, fence).await?;
                }
                body(c).await
            })
            .await;
        if leads && matches!(result, Err(crate::StoreError::Fenced(_))) {
            self.fenced.notify_one();
        }
        result
    }

    /// Runs `body` in one write transaction that is not fenced: the election itself.
    pub(crate) async fn elect<T>(
        &self,
        op: &'static str,
        body: impl AsyncFnOnce(&mut Conn<'_>) -> Result<T> + Clone,
    ) -> Result<T> {
        match &self.backend {
            // On its own connections: see postgres::ELECTION_POOL_SIZE.
            Backend::Postgres(p) => {
                let started = std::time::Instant::now();
                let result =
                    p.election_transaction(op, body).instrument(tracing::debug_span!("store", op)).await;
                crate::metrics::metrics().store_op(op, started.elapsed(), result.is_ok());
                result
            }
            Backend::Sqlite(_) => self.run(op, Mode::Write, body).await,
        }
    }

    /// The one helper every operation goes through: a span with the operation's label, one
    /// transaction (tried again on PostgreSQL when it failed transiently), and the operation's
    /// duration and outcome in the store's metrics.
    async fn run<T>(
        &self,
        op: &'static str,
        mode: Mode,
        body: impl AsyncFnOnce(&mut Conn<'_>) -> Result<T> + Clone,
    ) -> Result<T> {
        let started = std::time::Instant::now();
        let result = match &self.backend {
            Backend::Sqlite(s) => {
                s.transaction(mode, body).instrument(tracing::debug_span!("store", op)).await
            }
            Backend::Postgres(p) => {
                p.transaction(op, body).instrument(tracing::debug_span!("store", op)).await
            }
        };
        crate::metrics::metrics().store_op(op, started.elapsed(), result.is_ok());
        result
    }
}
