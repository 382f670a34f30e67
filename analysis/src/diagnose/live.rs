//! The live diagnosis's memory of one running attempt: its latest step receipts and telemetry
//! windows, fed incrementally (only what is new each round) and bounded, so a round costs the
//! same at step 100 and at step 100,000 (docs/diagnosis.md, "Live").
//!
//! [`Rolling::judge`] runs the same [`super::diagnose`] as `ctl diagnose` over the rolling
//! data, and [`Tracker`] turns the findings of successive rounds into opened, still-open and
//! closed findings: a finding closes after it was missing from [`CLOSE_AFTER_MISSES`] rounds in
//! a row, so one noisy round neither closes nor reopens it.

use std::collections::{BTreeMap, VecDeque};

use trainyard_model::records::GpuWindowRecord;

use super::{Diagnosis, Finding, Input, StepSample, diagnose};

/// Steps of the job the rolling data keeps (a straggler needs a few windows of steps).
pub const LIVE_STEPS: i64 = 300;
/// Telemetry kept, by window end: 5 minutes.
pub const LIVE_SPAN_MS: i64 = 300_000;
/// Rounds a finding may be missing before it closes.
pub const CLOSE_AFTER_MISSES: u32 = 2;

/// The latest steps and windows of one attempt.
#[derive(Debug, Default, Clone)]
pub struct Rolling {
    samples: VecDeque<StepSample>,
    windows: VecDeque<GpuWindowRecord>,
    last_step: i64,
}

impl Rolling {
    /// Adds new step receipts (in the order they were stored) and drops the steps that fell
    /// out of the last [`LIVE_STEPS`].
    pub fn add_samples(&mut self, new: impl IntoIterator<Item = StepSample>) {
        for s in new {
            self.last_step = self.last_step.max(s.step);
            self.samples.push_back(s);
        }
        let keep_from = self.last_step - LIVE_STEPS;
        // Stored order is nearly step order: trim from the front, then sweep stragglers.
        while self.samples.front().is_some_and(|s| s.step < keep_from) {
            self.samples.pop_front();
        }
        if self.samples.len() > (LIVE_STEPS as usize + 1) * 1024 {
            self.samples.retain(|s| s.step >= keep_from);
        }
    }

    /// Drops every step receipt held and adds `new` (the newest of a backlog whose older part
    /// was not read: nothing older may sit beside them with a gap between).
    pub fn replace_samples(&mut self, new: impl IntoIterator<Item = StepSample>) {
        self.samples.clear();
        self.add_samples(new);
    }

    /// Adds new windows and drops those that ended more than [`LIVE_SPAN_MS`] before the newest.
    pub fn add_windows(&mut self, new: impl IntoIterator<Item = GpuWindowRecord>) {
        self.windows.extend(new);
        let newest = self.windows.iter().map(|w| w.end_ms).max().unwrap_or(0);
        self.windows.retain(|w| w.end_ms >= newest - LIVE_SPAN_MS);
    }

    /// The newest step any rank reported.
    pub fn last_step(&self) -> i64 {
        self.last_step
    }

    /// (step receipts, windows) held.
    pub fn sizes(&self) -> (usize, usize) {
        (self.samples.len(), self.windows.len())
    }

    /// The diagnosis of the rolling data; `input` gives everything but samples and windows.
    pub fn judge(&self, input: &Input<'_>) -> Diagnosis {
        let samples: Vec<StepSample> = self.samples.iter().copied().collect();
        let windows: Vec<GpuWindowRecord> = self.windows.iter().cloned().collect();
        diagnose(&Input { samples: &samples, windows: &windows, ..*input })
    }
}

/// What a round changed.
#[derive(Debug, Default, PartialEq)]
pub struct Changes {
    /// Seen for the first time.
    pub opened: Vec<Finding>,
    /// Still there (their numbers may have moved).
    pub ongoing: Vec<Finding>,
    /// Keys (cause, subject) of findings that stopped.
    pub closed: Vec<(String, String)>,
}

/// The findings open for one attempt, across rounds.
#[derive(Debug, Default, Clone)]
pub struct Tracker {
    /// (cause, subject) -> rounds missed in a row.
    open: BTreeMap<(String, String), u32>,
}

impl Tracker {
    /// Starts from findings already open (after a restart of the controller).
    pub fn resume(keys: impl IntoIterator<Item = (String, String)>) -> Tracker {
        Tracker { open: keys.into_iter().map(|k| (k, 0)).collect() }
    }

    /// Folds one round's findings in.
    pub fn round(&mut self, findings: Vec<Finding>) -> Changes {
        let mut changes = Changes::default();
        let mut seen = Vec::new();
        for f in findings {
            let key = (f.cause.to_string(), f.subject.clone());
            seen.push(key.clone());
            match self.open.insert(key, 0) {
                Some(_) => changes.ongoing.push(f),
                None => changes.opened.push(f),
            }
        }
        for (key, misses) in &mut self.open {
            if !seen.contains(key) {
                *misses += 1;
            }
        }
        let gone: Vec<(String, String)> =
            self.open.iter().filter(|(_, m)| **m >= CLOSE_AFTER_MISSES).map(|(k, _)| k.clone()).collect();
        for key in gone {
            self.open.remove(&key);
            changes.closed.push(key);
        }
        changes
    }

    /// Closes everything (the attempt ended).
    pub fn close_all(&mut self) -> Vec<(String, String)> {
        std::mem::take(&mut self.open).into_keys().collect()
    }

    pub fn is_empty(&self) -> bool {
        self.open.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use trainyard_model::domain::Cause;

    fn finding(cause: Cause, subject: &str) -> Finding {
        Finding {
            cause,
            summary: String::new(),
            subject: subject.into(),
            steps: None,
            nodes: vec![],
            ranks: vec![],
            evidence: vec![],
            expected_cost: "",
            remedy: String::new(),
        }
    }

    #[test]
    fn findings_open_last_through_one_miss_and_close_after_two() {
        let mut t = Tracker::default();
        let hot = || finding(Cause::GpuThermalThrottle, "b/gpu3");
        let c = t.round(vec![hot()]);
        assert_eq!((c.opened.len(), c.ongoing.len(), c.closed.len()), (1, 0, 0));
        assert_eq!(t.round(vec![hot()]).ongoing.len(), 1);
        assert!(t.round(vec![]).closed.is_empty(), "one quiet round keeps it open");
        assert_eq!(t.round(vec![hot()]).ongoing.len(), 1, "and it goes on, not reopened");
        t.round(vec![]);
        let c = t.round(vec![]);
        assert_eq!(c.closed, vec![("gpu.thermal_throttle".to_string(), "b/gpu3".to_string())]);
        assert!(t.is_empty());
        let mut resumed = Tracker::resume([("gpu.xid".to_string(), "a/gpu1".to_string())]);
        assert!(
            resumed.round(vec![finding(Cause::GpuXid, "a/gpu1")]).opened.is_empty(),
            "open before a restart"
        );
    }

    #[test]
    fn rolling_data_stays_bounded() {
        let mut r = Rolling::default();
        for step in 0..2_000 {
            r.add_samples((0..4).map(|rank| StepSample {
                rank,
                step,
                step_time_ms: Some(1.0),
                ..Default::default()
            }));
            r.add_windows([GpuWindowRecord { end_ms: step * 1_000, ..Default::default() }]);
        }
        let (samples, windows) = r.sizes();
        assert_eq!(samples, 4 * (LIVE_STEPS as usize + 1));
        assert_eq!(windows, (LIVE_SPAN_MS / 1_000) as usize + 1);
    }

    #[test]
    fn newest_receipts_of_a_backlog_replace_what_was_held() {
        let sample = |rank, step| StepSample { rank, step, step_time_ms: Some(1.0), ..Default::default() };
        let mut r = Rolling::default();
        r.add_samples((0..50).map(|step| sample(0, step)));
        // Steps 50..1,000 were never read; the newest 20 of rank 0 and 1 arrive.
        r.replace_samples((990..1_000).flat_map(|step| [sample(0, step), sample(1, step)]));
        assert_eq!(r.sizes().0, 20, "nothing held from before the gap");
        assert_eq!(r.last_step(), 999);
        r.add_samples([sample(0, 1_000)]);
        assert_eq!(r.sizes().0, 21);
    }
}
