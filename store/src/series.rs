//! [`SeriesStore`]: the step rollups the web view's plots read ([`trainyard_analysis::series`]).

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

use async_trait::async_trait;
use trainyard_analysis::series::{Agg, LEVELS, Metric, RollupRow, StepPoint, fold};

use crate::rows::int;
use crate::sql::{Conn, Marks, Row, pow2_chunks, pow2_inserts};
use crate::{JobId, Result, SeriesStore, SqlStore};

/// A fold's result: the four aggregates of every (attempt, level, rank, bucket) it touched.
type Folded = BTreeMap<(u32, i64, u32, i64), [Agg; 4]>;

/// What one read pass found past the job's watermark.
struct Pass {
    /// The watermark the pass read from, and the position of the last receipt it took.
    from: i64,
    to: i64,
    points: Vec<StepPoint>,
    read: u64,
}

#[async_trait]
impl SeriesStore for SqlStore {
    async fn roll_up_steps(&self, job: JobId, settled_before_ms: i64, max_rows: u32) -> Result<u64> {
        let id = int(job)?;
        // Read outside any write transaction (receipts keep arriving meanwhile), fold, then
        // merge and write in one short transaction that first moves the watermark from where
        // this fold read it. Folds may run at once (the page asks for four series, the job's
        // end folds, a controller group has several processes): the one that finds the
        // watermark moved wrote nothing and reads again from there, so every receipt is
        // counted once without a lock.
        loop {
            let pass = self
                .read("roll_up_read", async |c| read_pass(c, id, settled_before_ms, max_rows).await)
                .await?;
            if pass.to == pass.from {
                return Ok(0);
            }
            let folded = fold(&pass.points);
            let claimed = self
                .write("roll_up_write", async |c| {
                    if !claim(c, id, pass.from, pass.to).await? {
                        return Ok(false);
                    }
                    // A retried transaction starts again from the fold.
                    let mut folded = folded.clone();
                    merge_stored(c, id, &mut folded).await?;
                    upsert(c, id, &folded).await?;
                    Ok(true)
                })
                .await?;
            if claimed {
                return Ok(pass.read);
            }
        }
    }

    async fn rollup_extent(&self, job: JobId, attempt: u32) -> Result<Option<(i64, i64, u32)>> {
        self.read("rollup_extent", async |c| {
            // The middle level: few rows, and its buckets bound the steps within 128.
            let level = LEVELS[1];
            let row = c
                .query(
                    "SELECT min(bucket) AS lo, max(bucket) AS hi, count(DISTINCT rank) AS ranks FROM step_rollups \
                     WHERE job_id = $1 AND attempt = $2 AND level = $3",
                )
                .bind(int(job)?)
                .bind(i64::from(attempt))
                .bind(level)
                .one()
                .await?;
            let t = "step_rollups";
            let (lo, hi): (Option<i64>, Option<i64>) = (row.get(t, "lo")?, row.get(t, "hi")?);
            Ok(match (lo, hi) {
                (Some(lo), Some(hi)) => Some((lo * level, hi * level + level - 1, row.num(t, "ranks")?)),
                _ => None,
            })
        })
        .await
    }

    async fn rollup_rows(
        &self,
        job: JobId,
        attempt: u32,
        metric: Metric,
        level: i64,
        from_bucket: i64,
        to_bucket: i64,
    ) -> Result<Vec<RollupRow>> {
        // One metric's four columns, read by position: a plot of 64 ranks reads 50,000 rows.
        let p = prefix(metric);
        let sql = format!(
            "SELECT attempt, rank, bucket, {p}_n, {p}_min, {p}_max, {p}_sum FROM step_rollups \
             WHERE job_id = $1 AND attempt = $2 AND level = $3 AND bucket BETWEEN $4 AND $5"
        );
        self.read("rollup_rows", async |c| {
            let found = c
                .query(sql.clone())
                .bind(int(job)?)
                .bind(i64::from(attempt))
                .bind(level)
                .bind(from_bucket)
                .bind(to_bucket)
                .all()
                .await?;
            let t = "step_rollups";
            found
                .iter()
                .map(|r| {
                    let at = |i: usize| -> Result<f64> { Ok(r.get::<Option<f64>>(t, i)?.unwrap_or(0.0)) };
                    let mut aggs = [Agg::default(); 4];
                    aggs[metric as usize] =
                        Agg { n: r.get(t, 3usize)?, min: at(4)?, max: at(5)?, sum: at(6)? };
                    Ok(RollupRow {
                        attempt: r.num(t, 0usize)?,
                        level,
                        rank: r.num(t, 1usize)?,
                        bucket: r.get(t, 2usize)?,
                        aggs,
                    })
                })
                .collect()
        })
        .await
    }
}

/// The column prefix of a metric's aggregates in `step_rollups`.
fn prefix(metric: Metric) -> &'static str {
    match metric {
        Metric::StepMs => "step_ms",
        Metric::Loss => "loss",
        Metric::TokensPerS => "tps",
        Metric::Mfu => "mfu",
    }
}

/// Reads the job's receipts past its watermark, at most `max_rows`, stopping at the first
/// stored after `settled_before_ms`, and keeps the step receipts' plotted values.
async fn read_pass(c: &mut Conn<'_>, id: i64, settled_before_ms: i64, max_rows: u32) -> Result<Pass> {
    let t = "receipts";
    let watermark =
        c.query("SELECT position FROM step_rollup_progress WHERE job_id = $1").bind(id).optional().await?;
    let from: i64 = watermark.map(|r| r.get("step_rollup_progress", "position")).transpose()?.unwrap_or(0);
    let found = c
        .query(
            "SELECT position, kind, stored_at_ms, attempt, rank, step, step_time_ms, loss, tokens_per_s, mfu \
             FROM receipts WHERE job_id = $1 AND position > $2 ORDER BY position LIMIT $3",
        )
        .bind(id)
        .bind(from)
        .bind(i64::from(max_rows))
        .all()
        .await?;
    let mut pass = Pass { from, to: from, points: Vec::new(), read: 0 };
    for r in &found {
        if r.get::<i64>(t, "stored_at_ms")? > settled_before_ms {
            break;
        }
        pass.to = r.get(t, "position")?;
        pass.read += 1;
        let step: Option<i64> = r.get(t, "step")?;
        if let (Some(step), "step") = (step, r.get::<String>(t, "kind")?.as_str()) {
            pass.points.push(StepPoint {
                attempt: r.num(t, "attempt")?,
                rank: r.num(t, "rank")?,
                step,
                values: [
                    r.get(t, "step_time_ms")?,
                    r.get(t, "loss")?,
                    r.get(t, "tokens_per_s")?,
                    r.get(t, "mfu")?,
                ],
            });
        }
    }
    Ok(pass)
}

/// Moves the job's watermark from `from` to `to`; false when another fold moved it first.
async fn claim(c: &mut Conn<'_>, id: i64, from: i64, to: i64) -> Result<bool> {
    let moved = if from == 0 {
        c.query("INSERT INTO step_rollup_progress (job_id, position) VALUES ($1, $2) ON CONFLICT (job_id) DO NOTHING")
            .bind(id)
            .bind(to)
            .execute()
            .await?
    } else {
        c.query("UPDATE step_rollup_progress SET position = $2 WHERE job_id = $1 AND position = $3")
            .bind(id)
            .bind(to)
            .bind(from)
            .execute()
            .await?
    };
    Ok(moved > 0)
}

/// Merges the stored rollups of the buckets the fold touched into the fold: one read per
/// (attempt, level) over the buckets it spans, all ranks at once (a job of 64 ranks folded a
/// read per rank and level before, each a round trip inside the write transaction).
async fn merge_stored(c: &mut Conn<'_>, id: i64, folded: &mut Folded) -> Result<()> {
    let mut spans: BTreeMap<(u32, i64), (i64, i64)> = BTreeMap::new();
    for &(attempt, level, _, bucket) in folded.keys() {
        let span = spans.entry((attempt, level)).or_insert((bucket, bucket));
        (span.0, span.1) = (span.0.min(bucket), span.1.max(bucket));
    }
    for ((attempt, level), (lo, hi)) in spans {
        let found = c
            .query(
                "SELECT attempt, rank, bucket, step_ms_n, step_ms_min, step_ms_max, step_ms_sum, loss_n, loss_min, \
                 loss_max, loss_sum, tps_n, tps_min, tps_max, tps_sum, mfu_n, mfu_min, mfu_max, mfu_sum \
                 FROM step_rollups WHERE job_id = $1 AND attempt = $2 AND level = $3 AND bucket BETWEEN $4 AND $5",
            )
            .bind(id)
            .bind(i64::from(attempt))
            .bind(level)
            .bind(lo)
            .bind(hi)
            .all()
            .await?;
        for row in &found {
            let old = rollup(row, level)?;
            if let Some(new) = folded.get_mut(&(attempt, level, old.rank, old.bucket)) {
                for (n, o) in new.iter_mut().zip(old.aggs.iter()) {
                    n.merge(o);
                }
            }
        }
    }
    Ok(())
}

/// Values of one `step_rollups` row in the upsert.
const ROLLUP_PARAMS: usize = 21;

/// Rows of one upsert statement at most, as a power of two (well under SQLite's 32,766 bound
/// parameters and PostgreSQL's 65,535).
const UPSERT_LOG2: u32 = 9;
const _: () = assert!(ROLLUP_PARAMS << UPSERT_LOG2 < 32_766);

/// The upsert of `2^log2` rows in this database's marks, built once per size.
fn upsert_sql(marks: Marks, log2: u32) -> Arc<str> {
    static SQL: OnceLock<[Vec<Arc<str>>; 2]> = OnceLock::new();
    let all = SQL.get_or_init(|| {
        let head = "step_rollups (job_id, attempt, level, rank, bucket, step_ms_n, step_ms_min, step_ms_max, \
                    step_ms_sum, loss_n, loss_min, loss_max, loss_sum, tps_n, tps_min, tps_max, tps_sum, mfu_n, \
                    mfu_min, mfu_max, mfu_sum)";
        let tail = " ON CONFLICT (job_id, attempt, level, rank, bucket) DO UPDATE SET \
                    step_ms_n = excluded.step_ms_n, step_ms_min = excluded.step_ms_min, \
                    step_ms_max = excluded.step_ms_max, step_ms_sum = excluded.step_ms_sum, \
                    loss_n = excluded.loss_n, loss_min = excluded.loss_min, loss_max = excluded.loss_max, \
                    loss_sum = excluded.loss_sum, tps_n = excluded.tps_n, tps_min = excluded.tps_min, \
                    tps_max = excluded.tps_max, tps_sum = excluded.tps_sum, mfu_n = excluded.mfu_n, \
                    mfu_min = excluded.mfu_min, mfu_max = excluded.mfu_max, mfu_sum = excluded.mfu_sum";
        [Marks::Numbered, Marks::Anonymous].map(|marks| pow2_inserts(marks, head, ROLLUP_PARAMS, UPSERT_LOG2, tail))
    });
    Arc::clone(&all[usize::from(marks == Marks::Anonymous)][log2 as usize])
}

/// Writes the merged rollups over the stored ones, in multi-row upserts.
async fn upsert(c: &mut Conn<'_>, id: i64, folded: &Folded) -> Result<()> {
    let rows: Vec<_> = folded.iter().collect();
    for (log2, chunk) in pow2_chunks(&rows, UPSERT_LOG2) {
        let sql = upsert_sql(c.marks(), log2);
        let mut q = c.query(sql);
        for &(&(attempt, level, rank, bucket), aggs) in chunk {
            q = q.bind(id).bind(i64::from(attempt)).bind(level).bind(i64::from(rank)).bind(bucket);
            for a in aggs {
                let present = a.n > 0;
                q = q
                    .bind(a.n)
                    .bind(present.then_some(a.min))
                    .bind(present.then_some(a.max))
                    .bind(present.then_some(a.sum));
            }
        }
        q.execute().await?;
    }
    Ok(())
}

/// A row of `step_rollups` with all four metrics' aggregates.
fn rollup(row: &Row, level: i64) -> Result<RollupRow> {
    let t = "step_rollups";
    let agg = |p: &str| -> Result<Agg> {
        Ok(Agg {
            n: row.get(t, format!("{p}_n").as_str())?,
            min: row.get::<Option<f64>>(t, format!("{p}_min").as_str())?.unwrap_or(0.0),
            max: row.get::<Option<f64>>(t, format!("{p}_max").as_str())?.unwrap_or(0.0),
            sum: row.get::<Option<f64>>(t, format!("{p}_sum").as_str())?.unwrap_or(0.0),
        })
    };
    Ok(RollupRow {
        attempt: row.num(t, "attempt")?,
        level,
        rank: row.num(t, "rank")?,
        bucket: row.get(t, "bucket")?,
        aggs: [agg("step_ms")?, agg("loss")?, agg("tps")?, agg("mfu")?],
    })
}
