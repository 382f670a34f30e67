//! The controller's clock: wall-clock milliseconds that follow Tokio's, so tests pause and
//! advance it.

use tokio::time::Instant;

/// Wall-clock milliseconds that advance with Tokio's clock: the wall time at start plus Tokio's
/// elapsed time since. In a running controller the two agree; a test that pauses Tokio's clock
/// (`tokio::time::pause`) pauses this one too, and moves it with `tokio::time::advance`.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    wall_base_ms: i64,
    base: Instant,
}

impl Clock {
    pub fn new() -> Clock {
        let wall = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as i64)
            .unwrap_or_default();
        Clock { wall_base_ms: wall, base: Instant::now() }
    }

    pub fn now_ms(&self) -> i64 {
        self.wall_base_ms + self.base.elapsed().as_millis() as i64
    }
}

impl Default for Clock {
    fn default() -> Self {
        Clock::new()
    }
}
