//! Stalls: a running job whose ranks stopped writing step receipts. A rank that has not
//! written a step for [`STALL_FACTOR`] times the job's median step time (and at least
//! [`STALL_FLOOR_MS`]) is stalled; ranks still in warm-up (compilation, first collectives) are
//! not judged, nor is a job without a steady step time yet.

use super::median;

/// A rank is stalled after this many median step times without a step.
pub const STALL_FACTOR: f64 = 20.0;
/// ... and never before this long, so a checkpoint or an eval of a fast job is not a stall.
pub const STALL_FLOOR_MS: f64 = 5_000.0;
/// Steps a rank must have done before it can stall (warm-up).
pub const WARMUP_STEPS: i64 = 3;

/// Where the step receipts of one attempt stand.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct StepProgress {
    /// (rank, its last step, when that receipt was stored in ms since the epoch).
    pub ranks: Vec<(u32, i64, i64)>,
    /// `step_time_ms` of the attempt's most recent step receipts.
    pub recent_step_ms: Vec<f64>,
}

/// Stalled ranks and the evidence.
#[derive(Debug, Clone, PartialEq)]
pub struct Stall {
    pub ranks: Vec<u32>,
    /// The longest silence among them, ms.
    pub silent_ms: f64,
    pub median_step_ms: f64,
    /// The last step of the rank silent longest.
    pub last_step: i64,
}

impl Stall {
    /// The line `ctl status` shows.
    pub fn describe(&self) -> String {
        let ranks: Vec<String> = self.ranks.iter().map(u32::to_string).collect();
        format!(
            "stalled: rank(s) {} wrote no step for {:.1} s ({:.0}x the median step of {:.0} ms; last step {})",
            ranks.join(","),
            self.silent_ms / 1e3,
            self.silent_ms / self.median_step_ms,
            self.median_step_ms,
            self.last_step
        )
    }
}

/// The stalled ranks of a running attempt at `now_ms`, if any.
pub fn stall(progress: &StepProgress, now_ms: i64) -> Option<Stall> {
    let mut recent: Vec<f64> =
        progress.recent_step_ms.iter().copied().filter(|t| t.is_finite() && *t > 0.0).collect();
    if recent.is_empty() {
        return None;
    }
    let median_step_ms = median(&mut recent);
    let limit = (STALL_FACTOR * median_step_ms).max(STALL_FLOOR_MS);
    let mut stalled: Vec<(u32, i64, f64)> = progress
        .ranks
        .iter()
        .filter(|(_, step, _)| *step >= WARMUP_STEPS)
        .map(|&(rank, step, at)| (rank, step, (now_ms - at) as f64))
        .filter(|(_, _, silent)| *silent > limit)
        .collect();
    stalled.sort_by(|a, b| b.2.total_cmp(&a.2));
    let (_, last_step, silent_ms) = *stalled.first()?;
    let mut ranks: Vec<u32> = stalled.iter().map(|s| s.0).collect();
    ranks.sort_unstable();
    Some(Stall { ranks, silent_ms, median_step_ms, last_step })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_silent_for_twenty_median_steps_is_stalled() {
        let progress = StepProgress {
            ranks: vec![(0, 120, 100_000), (1, 96, 84_000), (2, 120, 100_000), (3, 2, 10_000)],
            recent_step_ms: vec![700.0, 702.0, 699.0, f64::NAN, -1.0],
        };
        // 20 x 700 ms = 14 s: rank 1 has been silent 16.5 s, the others 0.5 s.
        let s = stall(&progress, 100_500).expect("rank 1 stalled");
        assert_eq!((s.ranks.as_slice(), s.last_step), (&[1][..], 96));
        assert_eq!(
            s.describe(),
            "stalled: rank(s) 1 wrote no step for 16.5 s (24x the median step of 700 ms; last step 96)"
        );
        // Rank 3 is still in warm-up: not judged however long it has been.
        assert_eq!(stall(&progress, 90_000), None);
    }

    #[test]
    fn fast_jobs_get_the_floor_and_no_steps_no_verdict() {
        let progress = StepProgress { ranks: vec![(0, 50, 1_000)], recent_step_ms: vec![50.0] };
        assert_eq!(stall(&progress, 1_000 + 4_000), None, "20 x 50 ms is 1 s, but the floor is 5 s");
        assert!(stall(&progress, 1_000 + 6_000).is_some());
        assert_eq!(stall(&StepProgress::default(), 1_000_000), None);
    }
}
