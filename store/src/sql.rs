//! The one seam between the store's queries and the two databases: a connection that is
//! either SQLite's or PostgreSQL's, queries bound and run on it, and rows read from it.
//!
//! Every query is written once, with `$N` placeholders (sqlx binds them by number on SQLite
//! too), and runs on either backend through [`Conn`]. A value is bound straight into the
//! backend's own argument buffer ([`Param`] holds for every type both drivers encode), and a
//! column is decoded by the backend's own decoder ([`Column`]), so the seam costs one `match`
//! per call. The few places where the SQL itself differs (PostgreSQL's `UNNEST` receipt batch
//! and advisory lock, SQLite's chunked multi-row insert, row locks) are in the backend modules
//! and marked by a `match` on [`Conn`].

use sqlx::postgres::{PgArguments, PgConnection, PgRow};
use sqlx::sqlite::{SqliteArguments, SqliteConnection, SqliteRow};
use sqlx::{AssertSqlSafe, Postgres, Row as _, Sqlite};

use crate::{Result, corrupt};

/// A connection inside one transaction of the store's one helper (`SqlStore::read`/`write`).
pub(crate) enum Conn<'c> {
    Sqlite(&'c mut SqliteConnection),
    Postgres(&'c mut PgConnection),
}

/// A value both drivers can bind (encoded into the query's arguments at once, so it may
/// borrow for as short as the call).
pub(crate) trait Param<'t>:
    sqlx::Encode<'t, Sqlite> + sqlx::Type<Sqlite> + sqlx::Encode<'t, Postgres> + sqlx::Type<Postgres>
{
}

impl<'t, T> Param<'t> for T where
    T: sqlx::Encode<'t, Sqlite> + sqlx::Type<Sqlite> + sqlx::Encode<'t, Postgres> + sqlx::Type<Postgres>
{
}

/// A value both drivers can decode from a column.
pub(crate) trait Column:
    for<'r> sqlx::Decode<'r, Sqlite>
    + sqlx::Type<Sqlite>
    + for<'r> sqlx::Decode<'r, Postgres>
    + sqlx::Type<Postgres>
{
}

impl<T> Column for T where
    T: for<'r> sqlx::Decode<'r, Sqlite>
        + sqlx::Type<Sqlite>
        + for<'r> sqlx::Decode<'r, Postgres>
        + sqlx::Type<Postgres>
{
}

/// A column named or numbered, on either backend's rows.
pub(crate) trait Index:
    sqlx::ColumnIndex<SqliteRow> + sqlx::ColumnIndex<PgRow> + std::fmt::Display
{
}

impl<T: sqlx::ColumnIndex<SqliteRow> + sqlx::ColumnIndex<PgRow> + std::fmt::Display> Index for T {}

/// SQL text: a literal, or text built at run time from literals only (multi-row inserts, a
/// chosen metric's columns), never from input.
pub(crate) enum Text {
    Static(&'static str),
    Built(std::sync::Arc<str>),
}

impl From<&'static str> for Text {
    fn from(s: &'static str) -> Self {
        Text::Static(s)
    }
}

impl From<std::sync::Arc<str>> for Text {
    fn from(s: std::sync::Arc<str>) -> Self {
        Text::Built(s)
    }
}

impl From<String> for Text {
    fn from(s: String) -> Self {
        Text::Built(s.into())
    }
}

enum Bound {
    Sqlite(sqlx::query::Query<'static, Sqlite, SqliteArguments>),
    Postgres(sqlx::query::Query<'static, Postgres, PgArguments>),
}

/// A query on a [`Conn`], bound value by value, then run by one of its four endings.
pub(crate) struct Query<'a, 'c> {
    conn: &'a mut Conn<'c>,
    bound: Bound,
}

impl<'c> Conn<'c> {
    /// Starts a query.
    pub(crate) fn query<'a>(&'a mut self, sql: impl Into<Text>) -> Query<'a, 'c> {
        let bound = match (&*self, sql.into()) {
            (Conn::Sqlite(_), Text::Static(s)) => Bound::Sqlite(sqlx::query(s)),
            (Conn::Sqlite(_), Text::Built(s)) => Bound::Sqlite(sqlx::query(AssertSqlSafe(s))),
            (Conn::Postgres(_), Text::Static(s)) => Bound::Postgres(sqlx::query(s)),
            (Conn::Postgres(_), Text::Built(s)) => Bound::Postgres(sqlx::query(AssertSqlSafe(s))),
        };
        Query { conn: self, bound }
    }
}

impl Conn<'_> {
    /// What a `SELECT` appends to lock the rows it reads until the transaction ends: `FOR
    /// UPDATE` on PostgreSQL; nothing on SQLite, whose writers hold the whole database from
    /// `BEGIN IMMEDIATE` on.
    pub(crate) fn for_update(&self) -> &'static str {
        match self {
            Conn::Sqlite(_) => "",
            Conn::Postgres(_) => " FOR UPDATE",
        }
    }
}

impl Query<'_, '_> {
    /// Binds the next `$N`.
    pub(crate) fn bind<'t, T: Param<'t>>(self, value: T) -> Self {
        let bound = match self.bound {
            Bound::Sqlite(q) => Bound::Sqlite(q.bind(value)),
            Bound::Postgres(q) => Bound::Postgres(q.bind(value)),
        };
        Query { bound, ..self }
    }

    /// Every row.
    pub(crate) async fn all(self) -> Result<Vec<Row>, sqlx::Error> {
        Ok(match (self.conn, self.bound) {
            (Conn::Sqlite(c), Bound::Sqlite(q)) => {
                q.fetch_all(&mut **c).await?.into_iter().map(Row::Sqlite).collect()
            }
            (Conn::Postgres(c), Bound::Postgres(q)) => {
                q.fetch_all(&mut **c).await?.into_iter().map(Row::Postgres).collect()
            }
            _ => unreachable!("a query is bound for the connection that started it"),
        })
    }

    /// The first row, if any.
    pub(crate) async fn optional(self) -> Result<Option<Row>, sqlx::Error> {
        Ok(match (self.conn, self.bound) {
            (Conn::Sqlite(c), Bound::Sqlite(q)) => q.fetch_optional(&mut **c).await?.map(Row::Sqlite),
            (Conn::Postgres(c), Bound::Postgres(q)) => q.fetch_optional(&mut **c).await?.map(Row::Postgres),
            _ => unreachable!("a query is bound for the connection that started it"),
        })
    }

    /// The one row (an aggregate, or an insert's `RETURNING`).
    pub(crate) async fn one(self) -> Result<Row, sqlx::Error> {
        Ok(match (self.conn, self.bound) {
            (Conn::Sqlite(c), Bound::Sqlite(q)) => Row::Sqlite(q.fetch_one(&mut **c).await?),
            (Conn::Postgres(c), Bound::Postgres(q)) => Row::Postgres(q.fetch_one(&mut **c).await?),
            _ => unreachable!("a query is bound for the connection that started it"),
        })
    }

    /// Runs a statement; returns how many rows it changed.
    pub(crate) async fn execute(self) -> Result<u64, sqlx::Error> {
        Ok(match (self.conn, self.bound) {
            (Conn::Sqlite(c), Bound::Sqlite(q)) => q.execute(&mut **c).await?.rows_affected(),
            (Conn::Postgres(c), Bound::Postgres(q)) => q.execute(&mut **c).await?.rows_affected(),
            _ => unreachable!("a query is bound for the connection that started it"),
        })
    }
}

/// A row of either backend.
pub(crate) enum Row {
    Sqlite(SqliteRow),
    Postgres(PgRow),
}

impl Row {
    /// Column `at` of a row of `table`; a value that does not decode is a corrupt row naming
    /// the table and the column.
    pub(crate) fn get<T: Column>(&self, table: &'static str, at: impl Index) -> Result<T> {
        let value = match self {
            Row::Sqlite(r) => r.try_get(&at),
            Row::Postgres(r) => r.try_get(&at),
        };
        value.map_err(|e| corrupt(table, format!("column {at}: {e}")))
    }

    /// An integer column converted to the record's integer type, with a range check.
    pub(crate) fn num<T: TryFrom<i64>>(&self, table: &'static str, at: impl Index) -> Result<T> {
        let v: i64 = self.get(table, &at)?;
        T::try_from(v).map_err(|_| corrupt(table, format!("column {at}: {v} out of range")))
    }

    /// A nullable integer column, likewise.
    pub(crate) fn opt_num<T: TryFrom<i64>>(&self, table: &'static str, at: impl Index) -> Result<Option<T>> {
        let v: Option<i64> = self.get(table, &at)?;
        v.map(|v| T::try_from(v).map_err(|_| corrupt(table, format!("column {at}: {v} out of range"))))
            .transpose()
    }

    /// A column holding one of a domain enum's words.
    pub(crate) fn word<T>(&self, table: &'static str, at: impl Index) -> Result<T>
    where
        T: std::str::FromStr<Err = trainyard_model::domain::UnknownWord>,
    {
        let s: String = self.get(table, &at)?;
        s.parse().map_err(|e| corrupt(table, format!("column {at}: {e}")))
    }
}

/// How a statement marks its parameters. SQLite looks a numbered (`$N`) parameter up in a
/// list, when preparing and again for every value bound, so a multi-row insert of thousands of
/// `$N` costs quadratic time on every execution (ingest measured at 1 % of a raw loop); its
/// multi-row statements use anonymous `?` marks, bound in order. PostgreSQL only knows `$N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Marks {
    Numbered,
    Anonymous,
}

impl Conn<'_> {
    /// The marks this database's multi-row statements use.
    pub(crate) fn marks(&self) -> Marks {
        match self {
            Conn::Sqlite(_) => Marks::Anonymous,
            Conn::Postgres(_) => Marks::Numbered,
        }
    }
}

/// `($1, .., $k), ($k+1, ..), ..` (or `(?, .., ?), ..`) for `rows` rows of `columns` values:
/// the rows of a multi-row `INSERT` or of a `VALUES` list.
pub(crate) fn placeholders(marks: Marks, columns: usize, rows: usize) -> String {
    let mut sql = String::with_capacity(rows * columns * 6);
    for r in 0..rows {
        sql.push_str(if r == 0 { "(" } else { ", (" });
        for c in 0..columns {
            if c > 0 {
                sql.push_str(", ");
            }
            match marks {
                Marks::Anonymous => sql.push('?'),
                Marks::Numbered => {
                    sql.push('$');
                    sql.push_str(&(r * columns + c + 1).to_string());
                }
            }
        }
        sql.push(')');
    }
    sql
}

/// `items` in chunks of power-of-two sizes, largest first and at most `2^max_log2`, with the
/// log2 of each chunk's size: a multi-row statement for each size is built once and stays in
/// the connection's prepared-statement cache (at most `max_log2 + 1` of them).
pub(crate) fn pow2_chunks<T>(mut items: &[T], max_log2: u32) -> impl Iterator<Item = (u32, &[T])> {
    std::iter::from_fn(move || {
        if items.is_empty() {
            return None;
        }
        let log2 = items.len().ilog2().min(max_log2);
        let (chunk, rest) = items.split_at(1 << log2);
        items = rest;
        Some((log2, chunk))
    })
}

/// The log2 sizes [`pow2_chunks`] cuts `len` items into, for a caller that consumes its items
/// by value.
pub(crate) fn pow2_sizes(mut len: usize, max_log2: u32) -> impl Iterator<Item = u32> {
    std::iter::from_fn(move || {
        if len == 0 {
            return None;
        }
        let log2 = len.ilog2().min(max_log2);
        len -= 1 << log2;
        Some(log2)
    })
}

/// The multi-row inserts of `1, 2, 4, .. 2^max_log2` rows, indexed by log2: built once per size
/// by the caller (in a `OnceLock`), so each size's text, the key of sqlx's statement cache, is
/// the same every time ([`pow2_chunks`] cuts the rows to fit).
pub(crate) fn pow2_inserts(
    marks: Marks,
    head: &str,
    columns: usize,
    max_log2: u32,
    tail: &str,
) -> Vec<std::sync::Arc<str>> {
    (0..=max_log2).map(|l| multi_row_insert(marks, head, columns, 1 << l, tail).into()).collect()
}

/// `INSERT INTO {head} VALUES (..), (..), ..{tail}`: several rows in one statement.
pub(crate) fn multi_row_insert(marks: Marks, head: &str, columns: usize, rows: usize, tail: &str) -> String {
    format!("INSERT INTO {head} VALUES {}{tail}", placeholders(marks, columns, rows))
}

#[cfg(test)]
mod tests {
    use super::{Marks, multi_row_insert, pow2_chunks, pow2_sizes};

    #[test]
    fn chunks_are_powers_of_two_largest_first_and_cover_everything() {
        let items: Vec<u32> = (0..2_000 + 1_024 + 7).collect();
        let sizes: Vec<usize> = pow2_chunks(&items, 10).map(|(_, c)| c.len()).collect();
        assert_eq!(sizes.iter().sum::<usize>(), items.len());
        assert!(pow2_chunks(&items, 10).all(|(log2, c)| c.len() == 1 << log2 && log2 <= 10));
        assert!(sizes.windows(2).all(|w| w[0] >= w[1]), "largest first: {sizes:?}");
        let by_value: Vec<usize> = pow2_sizes(items.len(), 10).map(|log2| 1 << log2).collect();
        assert_eq!(by_value, sizes);
    }

    #[test]
    fn multi_row_inserts_mark_every_value() {
        assert_eq!(
            multi_row_insert(Marks::Numbered, "t (a, b)", 2, 3, " ON CONFLICT DO NOTHING"),
            "INSERT INTO t (a, b) VALUES ($1, $2), ($3, $4), ($5, $6) ON CONFLICT DO NOTHING"
        );
        assert_eq!(
            multi_row_insert(Marks::Anonymous, "t (a)", 1, 2, ""),
            "INSERT INTO t (a) VALUES (?), (?)"
        );
    }
}
