//! Goodput: where a job's wall time went, per attempt and for the whole job, from its job
//! events and the receipts of its reporting rank (rank 0, or the lowest rank with step receipts
//! when rank 0 has none).
//!
//! An attempt runs from its placement (`scheduled`) to its `restarting` or final event (now,
//! while it runs). Its time splits into:
//! - **startup**: placement to the end of the first step, less that step's own time (process
//!   start, rendezvous, compilation, data loading);
//! - **training**: the step times (`step_time_ms`), of which **lost** is the part spent
//!   redoing steps an earlier attempt had already done (a restart resumes from its last
//!   checkpoint, not its last step);
//! - **eval** and **checkpoint**: the `duration_ms` of those receipts;
//! - **other**: what is left (stalls, waiting for a slow rank, receipts not written).
//!
//! Between attempts, **restart** is the time from one attempt's end to the next one's
//! placement. Goodput is training less lost, over the job's wall time.

use trainyard_model::domain::ReceiptKind;
use trainyard_proto::v1 as pb;

/// What the events and the reporting rank's receipts say about one attempt.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct AttemptFacts {
    pub attempt: u32,
    /// Its first `scheduled` event; `None` if it was never placed.
    pub scheduled_at_ms: Option<i64>,
    /// Its `restarting` or final event; `None` while it runs.
    pub ended_at_ms: Option<i64>,
    /// When the first step receipt was stored, and that step's own time.
    pub first_step_at_ms: Option<i64>,
    pub first_step_ms: f64,
    pub first_step: Option<i64>,
    pub last_step: Option<i64>,
    pub steps: u64,
    pub train_ms: f64,
    pub eval_ms: f64,
    pub checkpoint_ms: f64,
    /// The gaps of its `host_silent` events: a host of it was silent and came back with its
    /// ranks alive.
    pub silent_ms: f64,
}

impl AttemptFacts {
    /// Adds the `duration_ms` of one of rank 0's eval or checkpoint receipts (its body).
    pub fn add_duration(&mut self, kind: &str, body: &str) {
        let ms = serde_json::from_str::<serde_json::Value>(body)
            .ok()
            .and_then(|v| v.get("duration_ms").and_then(serde_json::Value::as_f64))
            .filter(|t| t.is_finite() && *t >= 0.0)
            .unwrap_or(0.0);
        match ReceiptKind::parse(kind) {
            Some(ReceiptKind::Eval) => self.eval_ms += ms,
            Some(ReceiptKind::Checkpoint) => self.checkpoint_ms += ms,
            _ => {}
        }
    }

    /// The attempt's placement and end from the job's events (all attempts, in order).
    pub fn place_in(&mut self, events: &[trainyard_model::records::JobEventRecord]) {
        use trainyard_model::domain::JobState;
        let mine = || events.iter().filter(|e| e.attempt == self.attempt);
        self.scheduled_at_ms = mine().find(|e| e.to_state == JobState::Scheduled).map(|e| e.at_ms);
        self.ended_at_ms = mine()
            .filter(|e| e.to_state == JobState::Restarting || e.to_state.is_terminal())
            .map(|e| e.at_ms)
            .next();
        self.silent_ms = mine().filter_map(|e| trainyard_model::restart::host_silent_ms(&e.reason)).sum();
    }
}

#[derive(Debug, Clone, PartialEq, Default, serde::Serialize)]
pub struct AttemptGoodput {
    pub attempt: u32,
    pub wall_ms: f64,
    pub startup_ms: f64,
    pub train_ms: f64,
    pub eval_ms: f64,
    pub checkpoint_ms: f64,
    /// Steps this attempt did again that an earlier one had done, and their time.
    pub steps_redone: u64,
    pub lost_ms: f64,
    /// From the previous attempt's end to this one's placement (0 for the first).
    pub restart_ms: f64,
    pub other_ms: f64,
}

#[derive(Debug, Clone, PartialEq, Default, serde::Serialize)]
pub struct Goodput {
    pub attempts: Vec<AttemptGoodput>,
    /// First placement to the end (or now): attempts and the restarts between them.
    pub wall_ms: f64,
    pub startup_ms: f64,
    pub train_ms: f64,
    pub eval_ms: f64,
    pub checkpoint_ms: f64,
    pub restart_ms: f64,
    pub lost_ms: f64,
    pub other_ms: f64,
    /// Of `other_ms`: host-silent gaps (`host_silent` events) the ranks did not spend in steps,
    /// evals or checkpoints (steps taken during a gap are training: their receipts arrive when
    /// the host speaks again).
    pub silent_ms: f64,
    /// Step receipts of the reporting rank over all attempts.
    pub steps: u64,
    /// (training - lost) / wall; `None` before any wall time, and for a job with no step
    /// receipt (its training time is unknown, not zero).
    pub goodput: Option<f64>,
}

impl Goodput {
    /// One line for `ctl status`.
    pub fn describe(&self) -> String {
        let s = |ms: f64| human(ms);
        if self.steps == 0 {
            return format!(
                "unknown (no step receipts) of {} wall: restarts {}; the ranks wrote no step receipt, so training and startup cannot be told apart",
                s(self.wall_ms),
                s(self.restart_ms)
            );
        }
        let share = self.goodput.map_or("-".to_string(), |g| format!("{:.0}%", g * 100.0));
        let silent = if self.silent_ms > 0.0 {
            format!(" (of which a host silent {})", s(self.silent_ms))
        } else {
            String::new()
        };
        let redone: u64 = self.attempts.iter().map(|a| a.steps_redone).sum();
        format!(
            "{share} of {} wall: startup {}, training {}, eval {}, checkpoint {}, restarts {}, lost {} ({redone} steps redone), other {}{silent}",
            s(self.wall_ms),
            s(self.startup_ms),
            s(self.train_ms - self.lost_ms),
            s(self.eval_ms),
            s(self.checkpoint_ms),
            s(self.restart_ms),
            s(self.lost_ms),
            s(self.other_ms)
        )
    }
}

/// "850ms", "12.3s", "4m05s", "2h13m".
pub fn human(ms: f64) -> String {
    let ms = ms.max(0.0);
    if ms < 1_000.0 {
        format!("{ms:.0}ms")
    } else if ms < 60_000.0 {
        format!("{:.1}s", ms / 1e3)
    } else if ms < 3_600_000.0 {
        let s = (ms / 1e3).round() as u64;
        format!("{}m{:02}s", s / 60, s % 60)
    } else {
        let m = (ms / 60e3).round() as u64;
        format!("{}h{:02}m", m / 60, m % 60)
    }
}

/// The record on the wire: the same fields (and the one-line summary, and the steps redone
/// over all attempts, which `ctl` shows); `ctl` reads it back into a [`Goodput`] with `From`.
impl From<&Goodput> for pb::Goodput {
    fn from(g: &Goodput) -> pb::Goodput {
        pb::Goodput {
            summary: g.describe(),
            wall_ms: g.wall_ms,
            startup_ms: g.startup_ms,
            train_ms: g.train_ms,
            eval_ms: g.eval_ms,
            checkpoint_ms: g.checkpoint_ms,
            restart_ms: g.restart_ms,
            lost_ms: g.lost_ms,
            other_ms: g.other_ms,
            steps_redone: g.attempts.iter().map(|a| a.steps_redone).sum(),
            goodput: g.goodput,
            steps: g.steps,
            silent_ms: g.silent_ms,
            attempts: g.attempts.iter().map(pb::AttemptGoodput::from).collect(),
        }
    }
}

impl From<&pb::Goodput> for Goodput {
    fn from(g: &pb::Goodput) -> Goodput {
        Goodput {
            attempts: g.attempts.iter().map(AttemptGoodput::from).collect(),
            wall_ms: g.wall_ms,
            startup_ms: g.startup_ms,
            train_ms: g.train_ms,
            eval_ms: g.eval_ms,
            checkpoint_ms: g.checkpoint_ms,
            restart_ms: g.restart_ms,
            lost_ms: g.lost_ms,
            other_ms: g.other_ms,
            silent_ms: g.silent_ms,
            steps: g.steps,
            goodput: g.goodput,
        }
    }
}

impl From<&AttemptGoodput> for pb::AttemptGoodput {
    fn from(a: &AttemptGoodput) -> pb::AttemptGoodput {
        pb::AttemptGoodput {
            attempt: a.attempt,
            wall_ms: a.wall_ms,
            startup_ms: a.startup_ms,
            train_ms: a.train_ms,
            eval_ms: a.eval_ms,
            checkpoint_ms: a.checkpoint_ms,
            restart_ms: a.restart_ms,
            lost_ms: a.lost_ms,
            steps_redone: a.steps_redone,
            other_ms: a.other_ms,
        }
    }
}

impl From<&pb::AttemptGoodput> for AttemptGoodput {
    fn from(a: &pb::AttemptGoodput) -> AttemptGoodput {
        AttemptGoodput {
            attempt: a.attempt,
            wall_ms: a.wall_ms,
            startup_ms: a.startup_ms,
            train_ms: a.train_ms,
            eval_ms: a.eval_ms,
            checkpoint_ms: a.checkpoint_ms,
            steps_redone: a.steps_redone,
            lost_ms: a.lost_ms,
            restart_ms: a.restart_ms,
            other_ms: a.other_ms,
        }
    }
}

/// The goodput of a job from its attempts' facts (in attempt order) at `now_ms`.
pub fn goodput(facts: &[AttemptFacts], now_ms: i64) -> Goodput {
    let mut total = Goodput::default();
    let mut done_through: Option<i64> = None;
    let mut previous_end: Option<i64> = None;
    for f in facts {
        let Some(start) = f.scheduled_at_ms else { continue };
        let end = f.ended_at_ms.unwrap_or(now_ms).max(start);
        let wall_ms = (end - start) as f64;
        let startup_ms = f
            .first_step_at_ms
            .map_or(wall_ms, |at| ((at - start) as f64 - f.first_step_ms).clamp(0.0, wall_ms));
        let steps_redone = match (done_through, f.first_step, f.last_step) {
            (Some(done), Some(first), Some(last)) if first <= done => (done.min(last) - first + 1) as u64,
            _ => 0,
        };
        let mean_step = if f.steps > 0 { f.train_ms / f.steps as f64 } else { 0.0 };
        let accounted = startup_ms + f.train_ms + f.eval_ms + f.checkpoint_ms;
        let a = AttemptGoodput {
            attempt: f.attempt,
            wall_ms,
            startup_ms,
            train_ms: f.train_ms,
            eval_ms: f.eval_ms,
            checkpoint_ms: f.checkpoint_ms,
            steps_redone,
            lost_ms: (steps_redone as f64 * mean_step).min(f.train_ms),
            restart_ms: previous_end.map_or(0.0, |e| (start - e).max(0) as f64),
            other_ms: (wall_ms - accounted).max(0.0),
        };
        total.wall_ms += a.wall_ms + a.restart_ms;
        total.startup_ms += a.startup_ms;
        total.train_ms += a.train_ms;
        total.eval_ms += a.eval_ms;
        total.checkpoint_ms += a.checkpoint_ms;
        total.restart_ms += a.restart_ms;
        total.lost_ms += a.lost_ms;
        total.other_ms += a.other_ms;
        total.silent_ms += f.silent_ms.min(a.other_ms);
        total.steps += f.steps;
        total.attempts.push(a);
        if let Some(last) = f.last_step {
            done_through = Some(done_through.map_or(last, |d| d.max(last)));
        }
        previous_end = Some(end);
    }
    total.goodput = (total.wall_ms > 0.0 && total.steps > 0)
        .then(|| ((total.train_ms - total.lost_ms) / total.wall_ms).clamp(0.0, 1.0));
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_restart_costs_its_gap_and_the_steps_redone() {
        // Attempt 0: placed at 0, first step stored at 12 s (1 s step), 100 steps of 1 s, a
        // 5 s checkpoint at step 79, killed at 120 s after step 99. Attempt 1 placed 15 s later,
        // resumes from step 80: steps 80-99 are redone, then runs to step 149.
        let facts = [
            AttemptFacts {
                attempt: 0,
                scheduled_at_ms: Some(0),
                ended_at_ms: Some(120_000),
                first_step_at_ms: Some(12_000),
                first_step_ms: 1_000.0,
                first_step: Some(0),
                last_step: Some(99),
                steps: 100,
                train_ms: 100_000.0,
                eval_ms: 0.0,
                checkpoint_ms: 5_000.0,
                silent_ms: 0.0,
            },
            AttemptFacts {
                attempt: 1,
                scheduled_at_ms: Some(135_000),
                ended_at_ms: Some(215_000),
                first_step_at_ms: Some(146_000),
                first_step_ms: 1_000.0,
                first_step: Some(80),
                last_step: Some(149),
                steps: 70,
                train_ms: 70_000.0,
                eval_ms: 2_000.0,
                checkpoint_ms: 0.0,
                silent_ms: 0.0,
            },
        ];
        let g = goodput(&facts, 999_999);
        let (a0, a1) = (&g.attempts[0], &g.attempts[1]);
        assert_eq!((a0.startup_ms, a0.other_ms, a0.steps_redone, a0.restart_ms), (11_000.0, 4_000.0, 0, 0.0));
        assert_eq!(
            (a1.steps_redone, a1.lost_ms, a1.restart_ms, a1.startup_ms),
            (20, 20_000.0, 15_000.0, 10_000.0)
        );
        assert_eq!(g.wall_ms, 215_000.0);
        assert_eq!(g.goodput, Some((170_000.0 - 20_000.0) / 215_000.0));
        assert_eq!(
            g.describe(),
            "70% of 3m35s wall: startup 21.0s, training 2m30s, eval 2.0s, checkpoint 5.0s, restarts 15.0s, lost 20.0s (20 steps redone), other 4.0s"
        );
    }

    #[test]
    fn a_host_silent_gap_is_named_within_other_up_to_the_time_not_spent_stepping() {
        use trainyard_model::domain::JobState;
        use trainyard_model::records::JobEventRecord;
        let event = |at_ms: i64, to_state: JobState, reason: String| JobEventRecord {
            job_id: 1,
            at_ms,
            from_state: None,
            to_state,
            attempt: 0,
            reason,
        };
        let events = [
            event(0, JobState::Scheduled, "placed".into()),
            event(50_000, JobState::Running, trainyard_model::restart::host_silent_reason("b", 30_000, 0)),
        ];
        // 60 s of wall, 2 s of start-up, 20 s of steps: the 30 s gap is charged (in other).
        let mut f = AttemptFacts {
            attempt: 0,
            first_step_at_ms: Some(3_000),
            first_step_ms: 1_000.0,
            first_step: Some(0),
            last_step: Some(19),
            steps: 20,
            train_ms: 20_000.0,
            ended_at_ms: None,
            ..Default::default()
        };
        f.place_in(&events);
        assert_eq!((f.scheduled_at_ms, f.silent_ms), (Some(0), 30_000.0));
        let g = goodput(&[f.clone()], 60_000);
        assert_eq!((g.other_ms, g.silent_ms), (38_000.0, 30_000.0));
        assert!(g.describe().ends_with("other 38.0s (of which a host silent 30.0s)"), "{}", g.describe());
        // Ranks that stepped through the gap lost nothing: only what is left of it is named.
        f.train_ms = 50_000.0;
        let g = goodput(&[f], 60_000);
        assert_eq!((g.other_ms, g.silent_ms), (8_000.0, 8_000.0));
    }

    #[test]
    fn a_running_attempt_counts_until_now_and_an_unplaced_one_not_at_all() {
        let facts = [
            AttemptFacts { attempt: 0, scheduled_at_ms: Some(1_000), ..Default::default() },
            AttemptFacts { attempt: 1, scheduled_at_ms: None, ..Default::default() },
        ];
        let g = goodput(&facts, 31_000);
        assert_eq!((g.wall_ms, g.goodput), (30_000.0, None), "no step receipt: goodput unknown, not 0");
        assert!(g.describe().starts_with("unknown (no step receipts) of 30.0s wall"), "{}", g.describe());
        assert_eq!(goodput(&[], 5).goodput, None);
        assert_eq!(
            (human(850.0), human(12_345.0), human(245_000.0), human(7_980_000.0)),
            ("850ms".into(), "12.3s".into(), "4m05s".into(), "2h13m".into())
        );
    }

    /// The wire carries every field of the record: what `ctl` reads back is what was computed,
    /// and its JSON has the record's own field names.
    #[test]
    fn the_record_crosses_the_wire_whole() {
        let a = AttemptGoodput {
            attempt: 1,
            wall_ms: 9.0,
            train_ms: 5.0,
            steps_redone: 3,
            lost_ms: 1.5,
            ..Default::default()
        };
        let g = Goodput {
            attempts: vec![AttemptGoodput { attempt: 0, wall_ms: 4.0, ..Default::default() }, a],
            wall_ms: 15.0,
            train_ms: 5.0,
            lost_ms: 1.5,
            restart_ms: 2.0,
            steps: 42,
            goodput: Some(0.23),
            ..Default::default()
        };
        let wire = pb::Goodput::from(&g);
        assert_eq!((wire.steps_redone, wire.steps, wire.summary.clone()), (3, 42, g.describe()));
        assert_eq!(Goodput::from(&wire), g);
        let json = serde_json::to_value(&g).expect("serialises");
        assert_eq!(json["attempts"][1]["steps_redone"], 3);
        assert_eq!(json["goodput"], 0.23);
    }
}
