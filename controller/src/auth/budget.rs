//! A token bucket for refusals and lookups the authenticator bounds.

/// A token bucket: of [`Authenticator::audit_refusal`] (rows it may still write, and the
/// refusals it left out since the last row), and of lookups of unknown tokens.
#[derive(Debug)]
pub(crate) struct RefusalBudget {
    tokens: f64,
    at_ms: i64,
    pub(crate) suppressed: u64,
    per_sec: f64,
    burst: f64,
}

impl RefusalBudget {
    pub(crate) fn new(per_sec: f64, burst: f64) -> Self {
        RefusalBudget { tokens: burst, at_ms: 0, suppressed: 0, per_sec, burst }
    }

    /// Whether one more may go at `now_ms`; when not, it is counted.
    pub(crate) fn take(&mut self, now_ms: i64) -> bool {
        let elapsed = (now_ms - self.at_ms).max(0) as f64 / 1000.0;
        self.tokens = (self.tokens + elapsed * self.per_sec).min(self.burst);
        self.at_ms = now_ms;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            self.suppressed += 1;
            false
        }
    }
}
