//! The compact progress line of `ctl submit --follow`, built from step receipts.
//!
//! Pure: receipts go in, a line comes out when one is due (at most once per interval), so the
//! rate limiting is tested without clocks or a controller.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::Value;
use trainyard_proto::words::ReceiptKind;

/// What we last heard from one rank.
#[derive(Debug, Clone, Copy, Default)]
struct RankStep {
    step: i64,
    loss: Option<f64>,
    tokens_per_s: Option<f64>,
}

#[derive(Debug)]
pub struct Progress {
    job_id: u64,
    attempt: u32,
    ranks: BTreeMap<u32, RankStep>,
    interval: Duration,
    last_print: Option<Duration>,
    dirty: bool,
}

impl Progress {
    pub fn new(job_id: u64, interval: Duration) -> Self {
        Progress { job_id, attempt: 0, ranks: BTreeMap::new(), interval, last_print: None, dirty: false }
    }

    /// Records a receipt; ignores everything but step receipts of the newest attempt.
    pub fn record(&mut self, attempt: u32, rank: u32, kind: &str, body: &str) {
        if kind != ReceiptKind::Step.as_str() || attempt < self.attempt {
            return;
        }
        if attempt > self.attempt {
            self.attempt = attempt;
            self.ranks.clear();
        }
        let Ok(Value::Object(body)) = serde_json::from_str::<Value>(body) else {
            return;
        };
        let Some(step) = body.get("step").and_then(Value::as_i64) else {
            return;
        };
        self.ranks.insert(
            rank,
            RankStep {
                step,
                loss: body.get("loss").and_then(Value::as_f64),
                tokens_per_s: body.get("tokens_per_s").and_then(Value::as_f64),
            },
        );
        self.dirty = true;
    }

    /// The line to print now, if something new arrived and the interval has passed since the
    /// last one. `now` is any monotonic clock reading.
    pub fn due(&mut self, now: Duration) -> Option<String> {
        let waited = self.last_print.is_none_or(|t| now.saturating_sub(t) >= self.interval);
        if !self.dirty || !waited {
            return None;
        }
        self.last_print = Some(now);
        self.flush()
    }

    /// The line for whatever has not been printed yet (at the end of the job).
    pub fn flush(&mut self) -> Option<String> {
        if !self.dirty {
            return None;
        }
        self.dirty = false;
        Some(self.line())
    }

    fn line(&self) -> String {
        let steps = self.ranks.values().map(|r| r.step);
        let (lo, hi) = (steps.clone().min().unwrap_or(0), steps.max().unwrap_or(0));
        let range = if lo == hi { format!("{lo}") } else { format!("{lo}..{hi}") };
        let mut line = format!(
            "job {} attempt {}: step {range} ({} ranks reporting)",
            self.job_id,
            self.attempt,
            self.ranks.len()
        );
        // Loss of the lowest rank that reports one (rank 0 normally).
        if let Some(loss) = self.ranks.values().find_map(|r| r.loss) {
            line.push_str(&format!(", loss {loss:.4}"));
        }
        let rates: Vec<f64> = self.ranks.values().filter_map(|r| r.tokens_per_s).collect();
        if !rates.is_empty() {
            line.push_str(&format!(", {} tokens/s", human(rates.iter().sum())));
        }
        line
    }
}

/// 1234567.0 -> "1.23M".
fn human(x: f64) -> String {
    match x {
        x if x >= 1e9 => format!("{:.2}G", x / 1e9),
        x if x >= 1e6 => format!("{:.2}M", x / 1e6),
        x if x >= 1e3 => format!("{:.1}k", x / 1e3),
        x => format!("{x:.0}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(step: i64, loss: f64) -> String {
        format!(r#"{{"kind":"step","step":{step},"loss":{loss},"tokens_per_s":5000}}"#)
    }

    #[test]
    fn aggregates_ranks_and_limits_the_rate() {
        let mut p = Progress::new(4, Duration::from_secs(1));
        p.record(1, 0, "step", &step(10, 3.5));
        p.record(1, 1, "step", &step(12, 3.4));
        p.record(1, 1, "launch", "{}");
        let line = p.due(Duration::from_millis(100)).expect("first line is due");
        assert_eq!(line, "job 4 attempt 1: step 10..12 (2 ranks reporting), loss 3.5000, 10.0k tokens/s");
        p.record(1, 0, "step", &step(13, 3.3));
        assert_eq!(p.due(Duration::from_millis(600)), None, "within the interval");
        assert!(p.due(Duration::from_millis(1200)).is_some());
        assert_eq!(p.flush(), None, "nothing new since");
    }

    #[test]
    fn a_new_attempt_starts_over() {
        let mut p = Progress::new(1, Duration::ZERO);
        p.record(1, 0, "step", &step(50, 2.0));
        p.record(2, 0, "step", &step(3, 4.0));
        p.record(1, 1, "step", &step(51, 2.0));
        let line = p.flush().expect("line");
        assert!(line.starts_with("job 1 attempt 2: step 3 (1 ranks reporting)"), "{line}");
    }
}
