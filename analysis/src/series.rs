//! Step series for plots: per-rank rollups of step receipts, and the downsampling that keeps a
//! 100,000-step x 64-rank job's plot to a few thousand points without losing its spikes.
//!
//! Step receipts are folded into buckets of 16, 128 and 1,024 steps per (attempt, rank), each
//! keeping count, min, max and sum of step time, loss, tokens/s and MFU (`step_rollups`). The
//! fold runs off the ingest path (a background pass and every series request), reads each
//! stored receipt once, past a per-job watermark (`step_rollup_progress`), so replays, which
//! the store never keeps twice, are never counted twice. A request reads the finest level
//! whose rows fit a budget, and merges adjacent buckets into at most the points asked for:
//! min of mins and max of maxes, so a one-step spike stays visible at any zoom.

use std::collections::BTreeMap;

/// Rollup levels, in steps per bucket, finest first.
pub const LEVELS: [i64; 3] = [16, 128, 1024];

/// Rollup rows one series request may read (all ranks together).
pub const ROW_BUDGET: i64 = 120_000;

/// Points per rank a request may ask for.
pub const MAX_BUCKETS: u32 = 4_000;

/// Receipts younger than this are left for the next fold: on PostgreSQL a transaction that
/// took a lower position may still be committing, and the watermark must not pass it.
pub const SETTLE_MS: i64 = 2_000;

/// A plotted metric of step receipts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Metric {
    StepMs,
    Loss,
    TokensPerS,
    Mfu,
}

impl Metric {
    pub const ALL: [Metric; 4] = [Metric::StepMs, Metric::Loss, Metric::TokensPerS, Metric::Mfu];

    /// The name in URLs and JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Metric::StepMs => "step_ms",
            Metric::Loss => "loss",
            Metric::TokensPerS => "tokens_per_s",
            Metric::Mfu => "mfu",
        }
    }

    pub fn parse(s: &str) -> Option<Metric> {
        Metric::ALL.into_iter().find(|m| m.as_str() == s)
    }

    pub fn unit(self) -> &'static str {
        match self {
            Metric::StepMs => "ms",
            Metric::Loss => "",
            Metric::TokensPerS => "tokens/s",
            Metric::Mfu => "fraction",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Count, min, max and sum of one metric in one bucket.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Agg {
    pub n: i64,
    pub min: f64,
    pub max: f64,
    pub sum: f64,
}

impl Agg {
    pub fn add(&mut self, v: f64) {
        if !v.is_finite() {
            return;
        }
        if self.n == 0 {
            (self.min, self.max) = (v, v);
        } else {
            self.min = self.min.min(v);
            self.max = self.max.max(v);
        }
        self.n += 1;
        self.sum += v;
    }

    pub fn merge(&mut self, o: &Agg) {
        if o.n == 0 {
            return;
        }
        if self.n == 0 {
            *self = *o;
            return;
        }
        self.min = self.min.min(o.min);
        self.max = self.max.max(o.max);
        self.n += o.n;
        self.sum += o.sum;
    }
}

/// One stored rollup bucket: `level` steps from `bucket * level` on, of one rank.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RollupRow {
    pub attempt: u32,
    pub level: i64,
    pub rank: u32,
    pub bucket: i64,
    /// By [`Metric`] order.
    pub aggs: [Agg; 4],
}

/// The step metrics of one step receipt, as the fold reads them.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct StepPoint {
    pub attempt: u32,
    pub rank: u32,
    pub step: i64,
    pub values: [Option<f64>; 4],
}

/// Folds points into new rollup rows at every level, keyed (attempt, level, rank, bucket).
pub fn fold(points: &[StepPoint]) -> BTreeMap<(u32, i64, u32, i64), [Agg; 4]> {
    let mut out: BTreeMap<(u32, i64, u32, i64), [Agg; 4]> = BTreeMap::new();
    for p in points.iter().filter(|p| p.step >= 0) {
        for level in LEVELS {
            let aggs = out.entry((p.attempt, level, p.rank, p.step / level)).or_default();
            for (agg, v) in aggs.iter_mut().zip(p.values) {
                if let Some(v) = v {
                    agg.add(v);
                }
            }
        }
    }
    out
}

/// The level a request over `steps` steps of `ranks` ranks reads: the coarsest that is not
/// coarser than the points asked for and fits [`ROW_BUDGET`] (merged points are the same from
/// any level finer than them, and coarser levels are fewer rows), else the finest that fits.
pub fn choose_level(steps: i64, ranks: i64, buckets: u32) -> i64 {
    let wanted = (steps / i64::from(buckets.max(1))).max(1);
    let fits = |level: i64| (steps / level + 1) * ranks.max(1) <= ROW_BUDGET;
    LEVELS
        .into_iter()
        .rev()
        .find(|&level| level <= wanted && fits(level))
        .or_else(|| LEVELS.into_iter().find(|&level| fits(level)))
        .unwrap_or(LEVELS[LEVELS.len() - 1])
}

/// One output point: the first step of the merged bucket, min, max and mean.
pub type Point = [f64; 4];

/// Merges one rank's rollup buckets (of one level, any order) of `metric` into at most
/// `buckets` points over `[from, to]`, each covering `width` steps (a multiple of the level).
pub fn downsample(
    rows: &[&RollupRow],
    metric: Metric,
    from: i64,
    to: i64,
    buckets: u32,
) -> (i64, Vec<Point>) {
    let Some(level) = rows.first().map(|r| r.level) else { return (0, Vec::new()) };
    let span = (to - from + 1).max(1);
    let per = (span / i64::from(buckets.max(1))).max(1);
    // A width of whole rollup buckets, so no stored bucket is split between two points.
    let width = (per + level - 1) / level * level;
    let start = from.div_euclid(width) * width;
    let mut merged: BTreeMap<i64, Agg> = BTreeMap::new();
    for r in rows {
        let agg = &r.aggs[metric.index()];
        let first = r.bucket * level;
        if agg.n == 0 || first + level <= from || first > to {
            continue;
        }
        merged.entry((first - start).div_euclid(width)).or_default().merge(agg);
    }
    let points = merged
        .into_iter()
        .map(|(i, a)| [(start + i * width) as f64, a.min, a.max, round4(a.sum / a.n as f64)])
        .collect();
    (width, points)
}

/// A mean to 4 decimals: the digits a plot can show, and half the JSON of a full `f64`.
fn round4(v: f64) -> f64 {
    (v * 1e4).round() / 1e4
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(rank: u32, step: i64, ms: f64) -> StepPoint {
        StepPoint { attempt: 0, rank, step, values: [Some(ms), Some(2.0), None, Some(0.5)] }
    }

    #[test]
    fn folding_keeps_count_min_max_and_sum_per_level() {
        let pts: Vec<StepPoint> = (0..40).map(|s| point(1, s, if s == 17 { 900.0 } else { 100.0 })).collect();
        let rows = fold(&pts);
        let fine = rows[&(0, 16, 1, 1)];
        assert_eq!((fine[0].n, fine[0].min, fine[0].max, fine[0].sum), (16, 100.0, 900.0, 2_400.0));
        assert_eq!(fine[2].n, 0, "tokens/s absent");
        let coarse = rows[&(0, 128, 1, 0)];
        assert_eq!((coarse[0].n, coarse[0].max), (40, 900.0));
        assert_eq!(rows.keys().filter(|k| k.1 == 16).count(), 3);
    }

    #[test]
    fn merging_is_exact_across_folds() {
        let pts: Vec<StepPoint> = (0..100).map(|s| point(0, s, s as f64)).collect();
        let (a, b) = pts.split_at(37);
        let mut whole = fold(a);
        for (k, v) in fold(b) {
            let e = whole.entry(k).or_default();
            for (x, y) in e.iter_mut().zip(v.iter()) {
                x.merge(y);
            }
        }
        assert_eq!(whole, fold(&pts));
    }

    #[test]
    fn downsampling_keeps_spikes_and_caps_points() {
        let pts: Vec<StepPoint> =
            (0..100_000).map(|s| point(0, s, if s == 54_321 { 5_000.0 } else { 100.0 })).collect();
        let rows: Vec<RollupRow> = fold(&pts)
            .into_iter()
            .filter(|(k, _)| k.1 == 128)
            .map(|((attempt, level, rank, bucket), aggs)| RollupRow { attempt, level, rank, bucket, aggs })
            .collect();
        let refs: Vec<&RollupRow> = rows.iter().collect();
        let (width, points) = downsample(&refs, Metric::StepMs, 0, 99_999, 800);
        assert!(points.len() <= 800 && points.len() > 700, "{}", points.len());
        assert_eq!(width % 128, 0);
        let spike = points.iter().find(|p| p[2] == 5_000.0).expect("the spike survives");
        assert!(spike[0] <= 54_321.0 && 54_321.0 < spike[0] + width as f64);
        assert!(points.iter().all(|p| p[1] == 100.0));
        // A zoomed window reads only its buckets.
        let (_, zoomed) = downsample(&refs, Metric::StepMs, 50_000, 59_999, 800);
        assert!(zoomed.first().unwrap()[0] >= 49_920.0 && zoomed.last().unwrap()[0] <= 59_999.0);
    }

    #[test]
    fn the_level_fits_the_row_budget() {
        assert_eq!(choose_level(100_000, 64, 800), 128);
        assert_eq!(choose_level(1_000, 64, 800), 16);
        assert_eq!(choose_level(2_000_000, 64, 800), 1024);
        assert_eq!(choose_level(10_000, 8, 4000), 16);
        assert_eq!(choose_level(160_000, 8, 800), 128, "coarser when it is still finer than a point");
        assert_eq!(Metric::parse("tokens_per_s"), Some(Metric::TokensPerS));
        assert_eq!(Metric::parse("nope"), None);
    }
}
