//! What the chaos bench (tests/benches/chaos.rs) measured, from the ranks' own step receipts
//! (each stamped with the rank's wall clock), the failures the controller recorded, and the
//! checkpoints on disk; and whether it met its targets. Pure, so the rules are unit-tested.
//!
//! Per injected failure: **recovery** is the first moment after it at which every rank of one
//! attempt has stepped again; **MTTR** runs from the injection to it, with the ranks' own
//! start-up (their launch receipt to their first step) apart. A failure whose recovery came
//! after the next injection is **overlapped**: counted and shown, never dropped silently; one that
//! never recovered fails the run. For a hang, the **verdict time** (injection to the `hang`
//! failure the controller recorded) is measured too.
//!
//! **Own share**, as the faults issue defines it: wall time, less the step time kept (the newest
//! attempt's time of each step), less the steps redone that no restart could have kept (those
//! after the newest checkpoint complete on disk when their attempt ended), less the ranks'
//! start-up: what is left is trainyard's (detection, decisions, backoff, placement, launch, and
//! steps redone because the resume point lagged). Printed beside the old proxy (MTTR less
//! start-up, summed over crash-like failures).

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{Value, json};

/// One step receipt: (attempt, rank, step, step_time_ms, at_ms).
pub type Step = (u64, usize, i64, f64, i64);

/// A failure the bench injected.
#[derive(Debug, Clone)]
pub struct Injected {
    pub kind: String,
    pub at_ms: i64,
    pub host: String,
    pub attempt: u64,
}

/// Everything the bench collected.
#[derive(Debug, Default)]
pub struct Facts {
    pub world: usize,
    pub steps: Vec<Step>,
    pub injected: Vec<Injected>,
    /// The controller's failures: (kind, attempt, at_ms).
    pub failures: Vec<(String, u64, i64)>,
    /// Per attempt, its ranks' last launch receipt (ms).
    pub launch_at: BTreeMap<u64, i64>,
    /// Checkpoints complete on disk: (step, when its last rank file was written, ms).
    pub checkpoints: Vec<(i64, i64)>,
    pub start_ms: i64,
    pub end_ms: i64,
}

/// The targets (docs/faults.md, "The chaos bench").
#[derive(Debug, Clone, Copy)]
pub struct Targets {
    pub agent_timeout_s: f64,
    pub hang_timeout_s: f64,
    /// Seconds between failures; the own-share target holds at the pace (120 s) or slower.
    pub every_s: f64,
    /// Seconds between checkpoints: ETTR's bound is 1 - (C / 2) / T.
    pub checkpoint_s: f64,
}

/// What became of one injected failure.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    pub kind: String,
    pub host: String,
    pub at_ms: i64,
    pub recovered_ms: Option<f64>,
    pub startup_ms: f64,
    pub attempts: (u64, u64),
    pub overlapped: bool,
    pub verdict_ms: Option<f64>,
}

/// The first moment after `at` at which every rank of one attempt from `from_attempt` on
/// stepped again, and that attempt.
fn recovery(f: &Facts, at: i64, from_attempt: u64) -> Option<(i64, u64)> {
    let mut first: BTreeMap<(u64, usize), i64> = BTreeMap::new();
    for s in f.steps.iter().filter(|s| s.4 > at && s.0 >= from_attempt) {
        first.entry((s.0, s.1)).and_modify(|t| *t = (*t).min(s.4)).or_insert(s.4);
    }
    let attempts: BTreeSet<u64> = first.keys().map(|k| k.0).collect();
    attempts
        .into_iter()
        .filter_map(|a| {
            let times: Vec<i64> = (0..f.world).filter_map(|r| first.get(&(a, r)).copied()).collect();
            (times.len() == f.world).then(|| (times.into_iter().max().unwrap_or(at), a))
        })
        .min()
}

/// An attempt that went on (its host taken back, no restart): it recovered when its ranks
/// stepped again after the longest pause (of a second or more) between `at` and `until`, the
/// moment every rank had stepped after that pause.
fn taken_back(f: &Facts, at: i64, until: i64, attempt: u64) -> Option<(i64, u64)> {
    let mut times: Vec<i64> =
        f.steps.iter().filter(|s| s.0 == attempt && s.4 > at && s.4 < until).map(|s| s.4).collect();
    times.sort_unstable();
    // The first of the longest pauses; none of a second or more: the ranks never stopped.
    let longest = times.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
    let resumed = match times.windows(2).find(|w| w[1] - w[0] == longest) {
        Some(w) if longest >= 1_000 => w[1],
        _ => *times.first()?,
    };
    let last_first = (0..f.world)
        .map(|r| f.steps.iter().filter(|s| s.0 == attempt && s.1 == r && s.4 >= resumed).map(|s| s.4).min())
        .collect::<Option<Vec<i64>>>()?;
    Some((last_first.into_iter().max()?, attempt))
}

/// Failures that end the attempt they strike, unless it waits for its host and takes it back;
/// a killed agent's ranks step on (it measures the adoption).
fn ends_attempt(kind: &str) -> bool {
    kind != "agent_kill"
}

/// Each injected failure's outcome.
pub fn outcomes(f: &Facts) -> Vec<Outcome> {
    let mut out = Vec::new();
    for (i, inj) in f.injected.iter().enumerate() {
        let next = f.injected.get(i + 1).map_or(i64::MAX, |n| n.at_ms);
        let found = if ends_attempt(&inj.kind) {
            recovery(f, inj.at_ms, inj.attempt + 1)
                .or_else(|| taken_back(f, inj.at_ms, next.min(f.end_ms.max(inj.at_ms)), inj.attempt))
        } else {
            recovery(f, inj.at_ms, inj.attempt)
        };
        let after = found.map_or(inj.attempt, |(_, a)| a);
        let startup_ms = match (found, f.launch_at.get(&after)) {
            (Some((_, a)), Some(launch)) if a > inj.attempt => {
                let first = f.steps.iter().filter(|s| s.0 == a).map(|s| s.4).min().unwrap_or(*launch);
                (first - launch).max(0) as f64
            }
            _ => 0.0,
        };
        let verdict_ms = (inj.kind == "hang")
            .then(|| f.failures.iter().find(|(k, _, at)| k == "hang" && *at >= inj.at_ms && *at < next))
            .flatten()
            .map(|(_, _, at)| (at - inj.at_ms) as f64);
        out.push(Outcome {
            kind: inj.kind.clone(),
            host: inj.host.clone(),
            at_ms: inj.at_ms,
            recovered_ms: found.map(|(t, _)| (t - inj.at_ms) as f64),
            startup_ms,
            attempts: (inj.attempt, after),
            overlapped: found.is_some_and(|(t, _)| t > next),
            verdict_ms,
        });
    }
    out
}

pub fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(v[v.len() / 2])
}

/// Rank 0's step time kept (the newest attempt's of each step), redone in all, and redone that
/// no restart could have kept, within the measured window.
fn step_time(f: &Facts) -> (f64, f64, f64) {
    let rank0: Vec<&Step> =
        f.steps.iter().filter(|s| s.1 == 0 && s.4 >= f.start_ms && s.4 <= f.end_ms).collect();
    let mut newest: BTreeMap<i64, &Step> = BTreeMap::new();
    for s in &rank0 {
        let keep = newest.get(&s.2).is_none_or(|k| s.0 > k.0);
        if keep {
            newest.insert(s.2, s);
        }
    }
    let kept: f64 = newest.values().map(|s| s.3).sum();
    let redone = rank0.iter().map(|s| s.3).sum::<f64>() - kept;
    // Each attempt that a later one replaced: its steps after the newest checkpoint complete
    // on disk when it stepped last were bound to be redone.
    let last_attempt = rank0.iter().map(|s| s.0).max().unwrap_or(0);
    let mut unavoidable = 0.0;
    for a in 0..last_attempt {
        let mine: Vec<&&Step> = rank0.iter().filter(|s| s.0 == a).collect();
        let Some(end) = mine.iter().map(|s| s.4).max() else { continue };
        let saved =
            f.checkpoints.iter().filter(|(_, at)| *at <= end).map(|(step, _)| *step).max().unwrap_or(-1);
        unavoidable += mine.iter().filter(|s| s.2 > saved).map(|s| s.3).sum::<f64>();
    }
    (kept, redone, unavoidable.min(redone))
}

/// The run's summary line and the targets it missed.
pub fn summary(f: &Facts, t: &Targets, outcomes: &[Outcome]) -> (Value, Vec<String>) {
    let wall = (f.end_ms - f.start_ms).max(1) as f64;
    let (kept, redone, unavoidable) = step_time(f);
    let startup: f64 = outcomes.iter().filter(|o| o.attempts.1 > o.attempts.0).map(|o| o.startup_ms).sum();
    let own = (wall - kept - unavoidable - startup).max(0.0);
    let proxy: f64 = outcomes
        .iter()
        .filter(|o| matches!(o.kind.as_str(), "rank_kill" | "agent_kill" | "preemption" | "host_reboot"))
        .filter_map(|o| o.recovered_ms.map(|r| (r - o.startup_ms).max(0.0)))
        .sum();
    let mut misses = Vec::new();
    let mut kinds = serde_json::Map::new();
    let by_kind: BTreeSet<&str> = outcomes.iter().map(|o| o.kind.as_str()).collect();
    for kind in by_kind {
        let mine: Vec<&Outcome> = outcomes.iter().filter(|o| o.kind == kind).collect();
        let measured: Vec<f64> = mine
            .iter()
            .filter(|o| !o.overlapped)
            .filter_map(|o| o.recovered_ms.map(|r| (r - o.startup_ms).max(0.0)))
            .collect();
        let p50 = median(measured.clone());
        let target_s = match kind {
            "rank_kill" => Some(5.0),
            "host_reboot" => Some(t.agent_timeout_s + 5.0),
            "partition" => Some(15.0),
            _ => None,
        };
        if let (Some(p), Some(limit)) = (p50, target_s)
            && p / 1000.0 >= limit
        {
            misses.push(format!(
                "{kind}: MTTR p50 {:.2} s (start-up apart), target under {limit} s",
                p / 1000.0
            ));
        }
        let verdicts: Vec<f64> = mine.iter().filter_map(|o| o.verdict_ms).collect();
        for o in mine.iter().filter(|o| kind == "hang" && !o.overlapped) {
            match o.verdict_ms {
                Some(v) if v / 1000.0 > t.hang_timeout_s + 5.0 => misses.push(format!(
                    "hang at +{:.0} s: acted on after {:.1} s, target its timeout ({} s) plus 5 s",
                    (o.at_ms - f.start_ms) as f64 / 1e3,
                    v / 1e3,
                    t.hang_timeout_s
                )),
                None => misses
                    .push(format!("hang at +{:.0} s: never acted on", (o.at_ms - f.start_ms) as f64 / 1e3)),
                _ => {}
            }
        }
        kinds.insert(
            kind.to_string(),
            json!({
                "n": mine.len(),
                "measured": measured.len(),
                "overlapped": mine.iter().filter(|o| o.overlapped).count(),
                "mttr_p50_s": p50.map(|p| p / 1e3),
                "startup_p50_s": median(mine.iter().map(|o| o.startup_ms).collect()).map(|p| p / 1e3),
                "target_s": target_s,
                "verdict_p50_s": median(verdicts).map(|v| v / 1e3),
            }),
        );
    }
    for o in outcomes.iter().filter(|o| o.recovered_ms.is_none()) {
        misses.push(format!(
            "{} on {} at +{:.0} s never recovered",
            o.kind,
            o.host,
            (o.at_ms - f.start_ms) as f64 / 1e3
        ));
    }
    let own_share = own / wall;
    if t.every_s >= 120.0 && own_share >= 0.05 {
        misses.push(format!(
            "own share {:.2} % of wall, target under 5 % at one failure every 2 minutes",
            own_share * 100.0
        ));
    }
    let bound = 1.0 - (t.checkpoint_s / 2.0) / t.every_s;
    let summary = json!({
        "wall_s": wall / 1e3,
        "failures_injected": outcomes.len(),
        "overlapped": outcomes.iter().filter(|o| o.overlapped).count(),
        "attempts_ended": f.failures.len(),
        "ettr": kept / wall,
        "ettr_bound": bound,
        "steps_redone_s": redone / 1e3,
        "steps_redone_unavoidable_s": unavoidable / 1e3,
        "steps_redone_lagging_resume_s": (redone - unavoidable) / 1e3,
        "own_share": own_share,
        "own_share_proxy": proxy / wall,
        "kinds": kinds,
        "misses": misses,
    });
    (summary, misses)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two ranks stepping every 100 ms from `from` to `to` in `attempt`, steps from `first`.
    fn stepping(attempt: u64, first: i64, from: i64, to: i64) -> Vec<Step> {
        let mut v = Vec::new();
        for (i, at) in (from..to).step_by(100).enumerate() {
            for rank in 0..2 {
                v.push((attempt, rank, first + i as i64, 100.0, at));
            }
        }
        v
    }

    #[test]
    fn recovery_start_up_overlap_and_own_share_follow_the_definitions() {
        // Attempt 0 steps 0..99 from 0 to 10 s; a rank is killed at 10 s; attempt 1 launches at
        // 13 s, first steps at 14 s resuming after the checkpoint at step 49 (complete at 5 s).
        let mut steps = stepping(0, 0, 0, 10_000);
        steps.extend(stepping(1, 50, 14_000, 30_000));
        let f = Facts {
            world: 2,
            steps,
            injected: vec![
                Injected { kind: "rank_kill".into(), at_ms: 10_000, host: "h1".into(), attempt: 0 },
                Injected { kind: "hang".into(), at_ms: 20_000, host: "h0".into(), attempt: 1 },
            ],
            failures: vec![("rank_exit".into(), 0, 10_500)],
            launch_at: BTreeMap::from([(1, 13_000)]),
            checkpoints: vec![(49, 5_000)],
            start_ms: 0,
            end_ms: 30_000,
        };
        let o = outcomes(&f);
        assert_eq!((o[0].recovered_ms, o[0].startup_ms, o[0].attempts), (Some(4_000.0), 1_000.0, (0, 1)));
        assert!(!o[0].overlapped);
        // The "hang" never stopped anything here: it recovers at once and no verdict came.
        assert_eq!((o[1].recovered_ms, o[1].verdict_ms), (Some(100.0), None));
        let t = Targets { agent_timeout_s: 8.0, hang_timeout_s: 10.0, every_s: 120.0, checkpoint_s: 5.0 };
        let (s, misses) = summary(&f, &t, &o);
        assert_eq!(s["kinds"]["rank_kill"]["mttr_p50_s"], 3.0, "start-up apart");
        assert!(misses.iter().any(|m| m.contains("never acted on")), "{misses:?}");
        // Kept: steps 0..49 of attempt 0 (5 s) and 50..209 of attempt 1 (16 s): 21 s.
        // Redone: steps 50..99 (5 s), all bound to be redone (after the checkpoint at 49).
        assert_eq!(s["steps_redone_s"], 5.0);
        assert_eq!(s["steps_redone_unavoidable_s"], 5.0);
        // Own: 30 s - 21 s kept - 5 s unavoidable - 1 s start-up = 3 s, 10 %: over the target.
        assert!((s["own_share"].as_f64().unwrap() - 0.1).abs() < 1e-9, "{s}");
        assert!(misses.iter().any(|m| m.starts_with("own share 10.00 %")), "{misses:?}");
    }

    #[test]
    fn a_failure_that_recovers_only_after_the_next_is_overlapped_and_one_that_never_does_fails() {
        let f = Facts {
            world: 2,
            steps: stepping(1, 0, 25_000, 26_000),
            injected: vec![
                Injected { kind: "partition".into(), at_ms: 10_000, host: "h1".into(), attempt: 0 },
                Injected { kind: "rank_kill".into(), at_ms: 20_000, host: "h0".into(), attempt: 0 },
                Injected { kind: "host_reboot".into(), at_ms: 27_000, host: "h0".into(), attempt: 1 },
            ],
            start_ms: 0,
            end_ms: 30_000,
            ..Default::default()
        };
        let o = outcomes(&f);
        assert!(o[0].overlapped && !o[1].overlapped);
        let t = Targets { agent_timeout_s: 8.0, hang_timeout_s: 10.0, every_s: 30.0, checkpoint_s: 5.0 };
        let (s, misses) = summary(&f, &t, &o);
        assert_eq!(s["kinds"]["partition"]["overlapped"], 1);
        assert_eq!(s["kinds"]["partition"]["measured"], 0);
        assert!(
            misses.iter().any(|m| m.starts_with("host_reboot on h0 at +27 s never recovered")),
            "{misses:?}"
        );
        assert!(!misses.iter().any(|m| m.contains("own share")), "not at the issue's pace");
    }

    #[test]
    fn a_host_taken_back_recovers_its_attempt_when_the_ranks_step_again_after_the_pause() {
        // A partition at 10 s pauses attempt 0 until 30.5 s; no restart.
        let mut steps = stepping(0, 0, 0, 10_000);
        steps.extend(stepping(0, 100, 30_500, 40_000));
        let f = Facts {
            world: 2,
            steps,
            injected: vec![Injected {
                kind: "partition".into(),
                at_ms: 10_000,
                host: "h1".into(),
                attempt: 0,
            }],
            start_ms: 0,
            end_ms: 40_000,
            ..Default::default()
        };
        let o = outcomes(&f);
        assert_eq!((o[0].recovered_ms, o[0].attempts), (Some(20_500.0), (0, 0)));
    }
}
