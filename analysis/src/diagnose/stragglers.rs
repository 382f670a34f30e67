//! Straggler scores: per rank and per window of steps, how the rank compares with the job's
//! median (relative score) and with its own best window (individual score).
//!
//! A score is a ratio of times, `reference / rank`, so 1.0 is on par and 0.8 means the rank
//! took 25 % longer. Warm-up steps (compilation, allocator growth, the first collectives) are
//! left out. A rank whose relative score stays under the threshold in most windows is a
//! straggler; one slow window is noise.

use std::collections::BTreeMap;

/// The knobs of straggler detection.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StragglerPolicy {
    /// Steps per window at most (short runs use smaller windows, at least [`MIN_WINDOW`]).
    pub window_steps: i64,
    /// A window is slow when the relative score is under this (0.85: ~18 % slower).
    pub threshold: f64,
    /// A rank is a straggler when at least this share of its windows is slow.
    pub persistence: f64,
}

impl Default for StragglerPolicy {
    fn default() -> Self {
        StragglerPolicy { window_steps: 25, threshold: 0.85, persistence: 0.6 }
    }
}

/// Fewest steps in a window.
pub const MIN_WINDOW: i64 = 5;
/// Fewest full windows a rank needs before it can be called a straggler.
pub const MIN_WINDOWS: usize = 2;

/// Steps treated as warm-up: the first tenth of the steps seen, at least 3 and at most 100.
pub fn warmup_steps(steps_seen: i64) -> i64 {
    (steps_seen / 10).clamp(3, 100)
}

/// The first step past warm-up of an attempt whose steps run from `first` to `last` (an attempt
/// that resumes at step 800 warms up from there, not from 0).
pub fn steady_from(first: i64, last: i64) -> i64 {
    first + warmup_steps(last - first)
}

/// One rank's scores over the steady part of the run.
#[derive(Debug, Clone, PartialEq)]
pub struct RankScore {
    pub rank: u32,
    /// Steady-state steps the scores rest on.
    pub steps: usize,
    /// Median of the measured time over those steps, in ms.
    pub median_ms: f64,
    /// Median over windows of (job median / rank median): 1.0 on par, under 1 slower.
    pub relative: f64,
    /// Median over windows of (rank's best window / this window): under 1 when the rank got
    /// slower than it was.
    pub individual: f64,
    pub windows: usize,
    pub slow_windows: usize,
    pub straggler: bool,
}

/// Scores every rank of `series` (rank → (step, time in ms), any order; non-finite and
/// negative times must already be filtered out).
pub fn score_ranks(series: &BTreeMap<u32, Vec<(i64, f64)>>, policy: StragglerPolicy) -> Vec<RankScore> {
    let last = series.values().flatten().map(|&(s, _)| s).max().unwrap_or(0);
    let first = series.values().flatten().map(|&(s, _)| s).min().unwrap_or(0);
    let warmup = steady_from(first, last);
    let steady = |v: &Vec<(i64, f64)>| -> Vec<(i64, f64)> {
        v.iter().copied().filter(|&(s, _)| s >= warmup).collect()
    };
    let steady: BTreeMap<u32, Vec<(i64, f64)>> = series.iter().map(|(r, v)| (*r, steady(v))).collect();
    let window = ((last - warmup + 1) / 4).clamp(MIN_WINDOW, policy.window_steps.max(MIN_WINDOW));
    // Per rank, per window index: the median time in that window.
    let per_window: BTreeMap<u32, BTreeMap<i64, f64>> = steady
        .iter()
        .map(|(rank, v)| {
            let mut buckets: BTreeMap<i64, Vec<f64>> = BTreeMap::new();
            for &(step, ms) in v {
                buckets.entry((step - warmup) / window).or_default().push(ms);
            }
            // A window of fewer than MIN_WINDOW steps (the run's newest, still filling) is
            // noise, not evidence.
            let full = buckets.into_iter().filter(|(_, xs)| xs.len() as i64 >= MIN_WINDOW);
            (*rank, full.map(|(w, mut xs)| (w, median(&mut xs))).collect())
        })
        .collect();
    let mut job_median: BTreeMap<i64, f64> = BTreeMap::new();
    let windows: std::collections::BTreeSet<i64> =
        per_window.values().flat_map(|m| m.keys().copied()).collect();
    for w in windows {
        let mut xs: Vec<f64> = per_window.values().filter_map(|m| m.get(&w).copied()).collect();
        job_median.insert(w, median(&mut xs));
    }
    steady
        .iter()
        .filter(|(_, v)| !v.is_empty())
        .map(|(&rank, v)| {
            let mine = &per_window[&rank];
            let best = mine.values().copied().fold(f64::INFINITY, f64::min);
            let mut relative: Vec<f64> = mine.iter().map(|(w, ms)| ratio(job_median[w], *ms)).collect();
            let mut individual: Vec<f64> = mine.values().map(|ms| ratio(best, *ms)).collect();
            let slow_windows = relative.iter().filter(|r| **r < policy.threshold).count();
            let windows = relative.len();
            let mut times: Vec<f64> = v.iter().map(|&(_, ms)| ms).collect();
            RankScore {
                rank,
                steps: v.len(),
                median_ms: median(&mut times),
                relative: median(&mut relative),
                individual: median(&mut individual),
                windows,
                slow_windows,
                // One window is one sample of the pace: persistence needs two at least.
                straggler: windows >= MIN_WINDOWS
                    && slow_windows as f64 >= policy.persistence * windows as f64,
            }
        })
        .collect()
}

/// `reference / value`, 1.0 when either is zero (nothing measured is nothing slow).
fn ratio(reference: f64, value: f64) -> f64 {
    if value > 0.0 && reference > 0.0 { reference / value } else { 1.0 }
}

/// The median of `xs` (the mean of the middle two for an even count); 0 for none.
pub fn median(xs: &mut [f64]) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n % 2 == 1 { xs[n / 2] } else { (xs[n / 2 - 1] + xs[n / 2]) / 2.0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn series(ranks: u32, steps: i64, ms: impl Fn(u32, i64) -> f64) -> BTreeMap<u32, Vec<(i64, f64)>> {
        (0..ranks).map(|r| (r, (0..steps).map(|s| (s, ms(r, s))).collect())).collect()
    }

    #[test]
    fn a_rank_thirty_percent_slower_is_a_straggler_and_the_others_are_not() {
        let s = series(8, 200, |r, s| if r == 5 { 130.0 } else { 100.0 + (s % 3) as f64 });
        let scores = score_ranks(&s, StragglerPolicy::default());
        let five = &scores[5];
        assert!(five.straggler && (0.75..0.8).contains(&five.relative), "{five:?}");
        assert!(scores.iter().filter(|r| r.rank != 5).all(|r| !r.straggler && r.relative > 0.97));
        assert_eq!(five.windows, 8, "180 steady steps in windows of 25");
    }

    #[test]
    fn warm_up_and_one_slow_window_do_not_make_a_straggler() {
        // Rank 2 compiles slowly (first 10 steps) and hiccups once in a window of its own.
        let s = series(4, 200, |r, s| match (r, s) {
            (2, 0..10) => 5_000.0,
            (2, 100..125) => 150.0,
            _ => 100.0,
        });
        let scores = score_ranks(&s, StragglerPolicy::default());
        assert!(scores.iter().all(|r| !r.straggler), "{scores:?}");
        assert_eq!(scores[2].slow_windows, 1);
        assert!(scores[2].individual > 0.99, "median over windows ignores the one bad window");
    }

    #[test]
    fn a_rank_that_slows_down_loses_individual_score() {
        let s = series(4, 200, |r, s| if r == 1 && s >= 100 { 200.0 } else { 100.0 });
        let one = &score_ranks(&s, StragglerPolicy::default())[1];
        assert!(one.individual < 0.6, "{one:?}");
        assert!(one.straggler, "slow in more than 60 % of its windows");
    }

    #[test]
    fn short_runs_use_small_windows_and_empty_input_gives_nothing() {
        let s = series(2, 20, |r, _| if r == 0 { 100.0 } else { 200.0 });
        let scores = score_ranks(&s, StragglerPolicy::default());
        assert_eq!(scores[1].windows, 3, "17 steady steps: three full windows of 5 (2 steps still filling)");
        assert!(scores[1].straggler && scores[1].relative < 0.8);
        // 7 steady steps make one full window: one sample of the pace is not persistence.
        let s = series(2, 10, |r, _| if r == 0 { 100.0 } else { 200.0 });
        let scores = score_ranks(&s, StragglerPolicy::default());
        assert_eq!((scores[1].windows, scores[1].straggler), (1, false), "{scores:?}");
        assert!(score_ranks(&BTreeMap::new(), StragglerPolicy::default()).is_empty());
        assert_eq!(median(&mut [3.0, 1.0, 2.0, 10.0]), 2.5);
        assert_eq!(warmup_steps(5), 3);
        assert_eq!(warmup_steps(10_000), 100);
        assert_eq!(steady_from(800, 1_000), 820, "a resumed attempt warms up again");
        // Scores of a resumed attempt: its own first steps are warm-up.
        let resumed: BTreeMap<u32, Vec<(i64, f64)>> = (0..4)
            .map(|r| (r, (800..1_000).map(|s| (s, if s < 810 && r == 2 { 900.0 } else { 100.0 })).collect()))
            .collect();
        assert!(score_ranks(&resumed, StragglerPolicy::default()).iter().all(|r| r.slow_windows == 0));
    }
}
