//! A job's restart rules beyond how many: the wait before each new attempt ([`Backoff`]) and
//! when a running attempt counts as hung ([`HangRule`]). Pure; the spec's `[restart]` table.
//!
//! Seconds travel as `double` on the wire so that a negative or non-finite value from any client
//! reaches [`validate`] and is refused with the field's name, instead of wrapping around.

use std::time::Duration;

use trainyard_proto::v1::RestartPolicy;

/// The shortest hang timeout a job may set: below it, a checkpoint or a slow collective on a
/// loaded host would be taken for a hang.
pub const HANG_FLOOR: Duration = Duration::from_secs(5);
/// Signals a job may ask to get when it should checkpoint now; "" sends none.
pub const CHECKPOINT_SIGNALS: [&str; 3] = ["", "SIGUSR1", "SIGUSR2"];
/// The longest wait or timeout a job may set.
const MAX_SECONDS: f64 = 7.0 * 86_400.0;

/// Wait `initial x factor^(restarts so far)` before the next attempt, at most `cap`, so that a
/// job failing on start-up does not hammer the fleet (and its own storage) in a tight loop.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backoff {
    pub initial: Duration,
    pub factor: f64,
    pub cap: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff { initial: Duration::from_secs(1), factor: 2.0, cap: Duration::from_secs(60) }
    }
}

impl Backoff {
    /// The wait before the attempt that follows `restarts` earlier restarts (0 for the first).
    pub fn delay(&self, restarts: u32) -> Duration {
        let scaled = self.initial.as_secs_f64() * self.factor.powi(restarts.min(64) as i32);
        Duration::from_secs_f64(scaled.min(self.cap.as_secs_f64()).max(0.0))
    }
}

/// A running attempt is hung when no rank wrote a step receipt for
/// `max(factor x median step time, floor)`; before its first step (start-up, compilation) and
/// while it writes a checkpoint the clock allows for that (see the controller's hang watch).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HangRule {
    pub floor: Duration,
    pub factor: f64,
}

impl Default for HangRule {
    fn default() -> Self {
        HangRule { floor: Duration::from_secs(300), factor: 10.0 }
    }
}

impl HangRule {
    /// How long without a step before the attempt is hung, given its median step time so far.
    pub fn timeout(&self, median_step: Option<Duration>) -> Duration {
        let scaled = median_step.map_or(Duration::ZERO, |m| m.mul_f64(self.factor));
        scaled.max(self.floor)
    }
}

/// The rules of a wire policy (0 or unset: the default), after [`validate`].
pub fn rules_of(policy: &RestartPolicy) -> (Backoff, HangRule) {
    let or = |v: f64, d: f64| if v > 0.0 && v.is_finite() { v } else { d };
    let (b, h) = (Backoff::default(), HangRule::default());
    let backoff = Backoff {
        initial: Duration::from_secs_f64(or(policy.backoff_initial_s, b.initial.as_secs_f64())),
        factor: or(policy.backoff_factor, b.factor),
        cap: Duration::from_secs_f64(or(policy.backoff_cap_s, b.cap.as_secs_f64())),
    };
    let hang = HangRule {
        floor: Duration::from_secs_f64(or(policy.hang_timeout_s, h.floor.as_secs_f64())),
        factor: or(policy.hang_factor, h.factor),
    };
    (backoff, hang)
}

/// The wire form of the rules, every value spelled out.
pub fn write_rules(policy: &mut RestartPolicy, backoff: &Backoff, hang: &HangRule) {
    policy.backoff_initial_s = backoff.initial.as_secs_f64();
    policy.backoff_factor = backoff.factor;
    policy.backoff_cap_s = backoff.cap.as_secs_f64();
    policy.hang_timeout_s = hang.floor.as_secs_f64();
    policy.hang_factor = hang.factor;
}

/// A `[restart]` field and what is wrong with it (the spec's `SpecError` carries it on).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleError {
    pub field: &'static str,
    pub reason: String,
}

/// Every number of the `[restart]` table, checked: each error names the field as the TOML file
/// spells it.
pub fn validate(policy: &RestartPolicy) -> Result<(), RuleError> {
    let seconds = [
        ("restart.backoff_initial_s", policy.backoff_initial_s),
        ("restart.backoff_cap_s", policy.backoff_cap_s),
        ("restart.hang_timeout_s", policy.hang_timeout_s),
    ];
    for (field, v) in seconds {
        if !v.is_finite() {
            return Err(bad(field, format!("{v} is not a number of seconds")));
        }
        if v < 0.0 {
            return Err(bad(field, format!("{v} is negative; give seconds, 0 for the default")));
        }
        if v > MAX_SECONDS {
            return Err(bad(field, format!("{v} s is more than {MAX_SECONDS} s (7 days)")));
        }
    }
    let floor = HANG_FLOOR.as_secs_f64();
    if policy.hang_timeout_s > 0.0 && policy.hang_timeout_s < floor {
        return Err(bad(
            "restart.hang_timeout_s",
            format!(
                "{} s is below the floor of {floor} s (a checkpoint would look like a hang)",
                policy.hang_timeout_s
            ),
        ));
    }
    if !CHECKPOINT_SIGNALS.contains(&policy.checkpoint_signal.as_str()) {
        return Err(bad(
            "restart.checkpoint_signal",
            format!(
                "{:?} is not one of \"SIGUSR1\", \"SIGUSR2\" or \"\" (the request file only)",
                policy.checkpoint_signal
            ),
        ));
    }
    if let Some(v) = policy.host_wait_s {
        let field = "restart.host_wait_s";
        if !v.is_finite() || v <= 0.0 {
            return Err(bad(
                field,
                format!(
                    "{v} is not a wait: give seconds above 0, or leave it out for the controller's default"
                ),
            ));
        }
        if v > MAX_SECONDS {
            return Err(bad(field, format!("{v} s is more than {MAX_SECONDS} s (7 days)")));
        }
    }
    factor("restart.backoff_factor", policy.backoff_factor, 1.0, 100.0)?;
    factor("restart.hang_factor", policy.hang_factor, 2.0, 1000.0)?;
    let (b, _) = rules_of(policy);
    if b.cap < b.initial {
        return Err(bad(
            "restart.backoff_cap_s",
            format!(
                "{} s is below restart.backoff_initial_s ({} s)",
                b.cap.as_secs_f64(),
                b.initial.as_secs_f64()
            ),
        ));
    }
    Ok(())
}

/// How a `host_silent` job event begins: a host of the attempt fell silent past the agent
/// timeout, the attempt waited for it (`restart.host_wait_s`), and it came back with the
/// attempt's ranks alive, which were taken back: no restart.
pub const HOST_SILENT: &str = "host_silent: ";

/// The reason of a `host_silent` event: `node` was silent for `gap_ms`.
pub fn host_silent_reason(node: &str, gap_ms: i64, attempt: u32) -> String {
    format!(
        "{HOST_SILENT}{node} was silent for {:.1} s and came back with the ranks of attempt {attempt} alive; they were taken back (no restart, no step lost)",
        gap_ms.max(0) as f64 / 1000.0
    )
}

/// The length of the gap a `host_silent` event's reason records, in milliseconds.
pub fn host_silent_ms(reason: &str) -> Option<f64> {
    let rest = reason.strip_prefix(HOST_SILENT)?;
    let (_, after) = rest.split_once(" was silent for ")?;
    let (secs, _) = after.split_once(" s ")?;
    secs.parse::<f64>().ok().filter(|s| s.is_finite() && *s >= 0.0).map(|s| s * 1000.0)
}

fn factor(field: &'static str, v: f64, min: f64, max: f64) -> Result<(), RuleError> {
    if v == 0.0 {
        return Ok(());
    }
    if !v.is_finite() || v < min || v > max {
        return Err(bad(field, format!("{v} is not between {min} and {max} (0 for the default)")));
    }
    Ok(())
}

fn bad(field: &'static str, reason: String) -> RuleError {
    RuleError { field, reason }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> RestartPolicy {
        RestartPolicy { max_restarts: 3, resume: true, ..Default::default() }
    }

    #[test]
    fn backoff_grows_by_its_factor_up_to_the_cap() {
        let b = Backoff { initial: Duration::from_millis(500), factor: 3.0, cap: Duration::from_secs(10) };
        let waits: Vec<u128> = (0..5).map(|n| b.delay(n).as_millis()).collect();
        assert_eq!(waits, [500, 1500, 4500, 10_000, 10_000]);
        assert_eq!(b.delay(u32::MAX), Duration::from_secs(10), "no overflow on a long history");
    }

    #[test]
    fn the_hang_timeout_is_the_larger_of_the_floor_and_k_median_steps() {
        let h = HangRule { floor: Duration::from_secs(30), factor: 10.0 };
        assert_eq!(h.timeout(None), Duration::from_secs(30));
        assert_eq!(h.timeout(Some(Duration::from_secs(1))), Duration::from_secs(30));
        assert_eq!(h.timeout(Some(Duration::from_secs(6))), Duration::from_secs(60));
    }

    #[test]
    fn unset_numbers_take_the_defaults_and_the_wire_form_round_trips() {
        let (b, h) = rules_of(&policy());
        assert_eq!((b, h), (Backoff::default(), HangRule::default()));
        let mut p = policy();
        p.backoff_initial_s = 2.5;
        p.hang_timeout_s = 45.0;
        let (b, h) = rules_of(&p);
        assert_eq!(
            (b.initial, b.factor, h.floor),
            (Duration::from_millis(2500), 2.0, Duration::from_secs(45))
        );
        let mut back = policy();
        write_rules(&mut back, &b, &h);
        assert_eq!(rules_of(&back), (b, h));
    }

    #[test]
    fn bad_numbers_name_their_field() {
        type Case = (fn(&mut RestartPolicy), &'static str, &'static str);
        let cases: [Case; 11] = [
            (|p| p.host_wait_s = Some(0.0), "restart.host_wait_s", "above 0"),
            (|p| p.host_wait_s = Some(-5.0), "restart.host_wait_s", "above 0"),
            (|p| p.host_wait_s = Some(1e9), "restart.host_wait_s", "7 days"),
            (|p| p.checkpoint_signal = "SIGKILL".into(), "restart.checkpoint_signal", "not one of"),
            (|p| p.backoff_initial_s = -1.0, "restart.backoff_initial_s", "negative"),
            (|p| p.backoff_cap_s = f64::NAN, "restart.backoff_cap_s", "not a number"),
            (|p| p.hang_timeout_s = 2.0, "restart.hang_timeout_s", "below the floor of 5 s"),
            (|p| p.hang_timeout_s = 1e9, "restart.hang_timeout_s", "7 days"),
            (|p| p.backoff_factor = 0.5, "restart.backoff_factor", "between 1 and 100"),
            (|p| p.hang_factor = f64::INFINITY, "restart.hang_factor", "between 2 and 1000"),
            (
                |p| {
                    p.backoff_initial_s = 30.0;
                    p.backoff_cap_s = 10.0
                },
                "restart.backoff_cap_s",
                "below restart.backoff_initial_s",
            ),
        ];
        for (set, field, words) in cases {
            let mut p = policy();
            set(&mut p);
            let e = validate(&p).unwrap_err();
            assert_eq!(e.field, field);
            assert!(e.reason.contains(words), "{field}: {}", e.reason);
        }
        assert_eq!(validate(&policy()), Ok(()));
        assert_eq!(validate(&RestartPolicy { host_wait_s: Some(300.0), ..policy() }), Ok(()));
    }

    #[test]
    fn a_host_silent_reason_carries_its_gap() {
        let reason = host_silent_reason("gpu-07", 30_240, 0);
        assert!(reason.starts_with("host_silent: gpu-07 was silent for 30.2 s"), "{reason}");
        assert_eq!(host_silent_ms(&reason), Some(30_200.0));
        assert_eq!(host_silent_ms("host_lost: gpu-07 was silent for 3.0 s and"), None);
    }
}
