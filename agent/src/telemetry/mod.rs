//! GPU telemetry beside every receipt (docs/telemetry.md): a thread samples each GPU of the
//! host's running ranks (`--telemetry-every`, 1 s), summarises them per window
//! (`--telemetry-window`, 10 s) and queues the windows; the connection loop ships them in
//! `TelemetryBatch`es, one unacknowledged batch at a time, and resends a batch on the next
//! stream until it is acknowledged.
//!
//! # Layout
//! - [`window`]: samples into windows (pure).
//! - [`nvml`]: the real sampler, through NVML.
//! - [`readout`]: a reading as text or JSON (`trainyard-agent telemetry`).
//! - [`script`]: a scripted sampler for hosts without a GPU (tests, demos), replaying a
//!   throttle, an XID or a link going down at given times.
//! - this module: the [`GpuSampler`] seam, the shared [`Telemetry`] queue and the sampling loop.
//!
//! The queue is bounded ([`MAX_QUEUED_WINDOWS`]): a controller away for hours costs the oldest
//! windows, counted in `trainyard_agent_telemetry_dropped_windows_total`, never the agent's
//! memory. Receipts are never dropped; telemetry is the part that can be.

pub mod nvml;
pub mod readout;
pub mod script;
pub mod window;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tracing::{info, warn};
use trainyard_proto::v1::{GpuWindow, RankKey, TelemetryBatch, WindowSteps};

pub use crate::gpu_sample::{Counters, Sample};
use crate::layout::RankId;

/// Windows kept while the controller does not take them: 8 GPUs x 10 s windows for ~6 hours.
pub const MAX_QUEUED_WINDOWS: usize = 20_000;
/// Windows per batch.
pub const MAX_BATCH_WINDOWS: usize = 256;
const _: () = assert!(MAX_BATCH_WINDOWS <= trainyard_proto::limits::MAX_TELEMETRY_WINDOWS);
/// Step stamps kept per rank (a window needs only the last few seconds).
const MAX_STEP_STAMPS: usize = 4096;
/// How long an ended rank's step stamps are kept, for its last window.
const STEPS_KEPT_MS: i64 = 120_000;

/// Reads GPUs. The real one is [`nvml::NvmlSampler`]; [`script::ScriptedSampler`] stands in
/// where there is no GPU.
pub trait GpuSampler: Send {
    /// Reads GPU `gpu` (its index on the host) now; the error is for the log.
    fn sample(&mut self, gpu: u32, at_ms: i64) -> Result<Sample, String>;
    /// What the sampler reads (for the start-up log line).
    fn describe(&self) -> String;
}

/// A rank's GPU on this host, as the connection loop last saw the launcher.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuUse {
    pub rank: RankId,
    pub gpu: u32,
}

/// What the sampling thread and the connection loop share.
#[derive(Debug, Default)]
struct Shared {
    /// GPUs of running ranks.
    gpus: Vec<GpuUse>,
    /// The rank each GPU ran last (a window that closes after its rank ended still names it).
    last_user: BTreeMap<u32, RankId>,
    /// (when read, step) per rank, oldest first.
    steps: HashMap<RankId, VecDeque<(i64, i64)>>,
    queue: VecDeque<GpuWindow>,
    /// The batch on the wire, until its ack.
    in_flight: Option<TelemetryBatch>,
    next_id: u64,
    dropped: u64,
}

/// The handle both sides hold.
#[derive(Debug, Clone, Default)]
pub struct Telemetry {
    shared: Arc<Mutex<Shared>>,
}

impl Telemetry {
    fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
        // A panic elsewhere while holding the lock leaves plain data behind: keep using it.
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The GPUs of the ranks now running.
    pub fn set_gpus(&self, gpus: Vec<GpuUse>) {
        let mut s = self.lock();
        let recent = now_ms() - STEPS_KEPT_MS;
        s.steps.retain(|rank, stamps| {
            gpus.iter().any(|g| g.rank == *rank) || stamps.back().is_some_and(|&(at, _)| at >= recent)
        });
        for g in &gpus {
            s.last_user.insert(g.gpu, g.rank);
        }
        s.gpus = gpus;
    }

    /// Step receipts of ranks were read at `at_ms`; steps not above the last one noted for
    /// their rank (a re-read after a reconnect) are ignored.
    pub fn note_steps(&self, steps: impl Iterator<Item = (RankId, i64)>, at_ms: i64) {
        let mut s = self.lock();
        for (rank, step) in steps {
            let stamps = s.steps.entry(rank).or_default();
            if stamps.back().is_some_and(|&(_, last)| last >= step) {
                continue;
            }
            if stamps.len() >= MAX_STEP_STAMPS {
                stamps.pop_front();
            }
            stamps.push_back((at_ms, step));
        }
    }

    fn gpus(&self) -> Vec<GpuUse> {
        self.lock().gpus.clone()
    }

    /// The steps of the rank on `gpu` read within `[start, end)`.
    fn steps_in(&self, gpu: u32, start_ms: i64, end_ms: i64) -> Vec<WindowSteps> {
        let s = self.lock();
        let Some(user) = s.last_user.get(&gpu) else { return Vec::new() };
        let key = RankKey { job_id: user.job_id, attempt: user.attempt, rank: user.rank };
        let mut inside =
            s.steps.get(user).into_iter().flatten().filter(|(at, _)| *at >= start_ms && *at < end_ms);
        let Some(&(_, first)) = inside.next() else {
            return vec![WindowSteps { key: Some(key), first_step: -1, last_step: -1 }];
        };
        let last = inside.next_back().map_or(first, |&(_, step)| step);
        vec![WindowSteps { key: Some(key), first_step: first, last_step: last }]
    }

    fn enqueue(&self, windows: Vec<GpuWindow>) {
        let mut s = self.lock();
        for w in windows {
            if s.queue.len() >= MAX_QUEUED_WINDOWS {
                s.queue.pop_front();
                s.dropped += 1;
                crate::metrics::metrics().telemetry_dropped.inc();
            }
            s.queue.push_back(w);
        }
    }

    /// The batch to send now: the one awaiting its ack when `resend` (a new stream), else a new
    /// one if nothing is on the wire.
    pub fn next_batch(&self, resend: bool) -> Option<TelemetryBatch> {
        let mut s = self.lock();
        if let Some(batch) = &s.in_flight {
            return resend.then(|| batch.clone());
        }
        if s.queue.is_empty() {
            return None;
        }
        let n = s.queue.len().min(MAX_BATCH_WINDOWS);
        let windows: Vec<GpuWindow> = s.queue.drain(..n).collect();
        s.next_id += 1;
        let batch = TelemetryBatch { id: s.next_id, windows };
        s.in_flight = Some(batch.clone());
        Some(batch)
    }

    /// The controller stored batch `id`.
    pub fn ack(&self, id: u64) {
        let mut s = self.lock();
        if s.in_flight.as_ref().is_some_and(|b| b.id == id) {
            s.in_flight = None;
        }
    }

    /// Windows waiting (queued plus on the wire).
    pub fn pending(&self) -> usize {
        let s = self.lock();
        s.queue.len() + s.in_flight.as_ref().map_or(0, |b| b.windows.len())
    }
}

/// How the sampling loop runs.
#[derive(Debug, Clone, Copy)]
pub struct Cadence {
    pub every: Duration,
    pub window: Duration,
}

/// Samples until `stop` is set: every `every`, each GPU of a running rank; windows close as
/// they come of age, and a GPU's window closes at once when its rank stops. Runs on its own
/// thread: NVML calls block, and a GPU that fell off the bus can block them for seconds.
pub fn run(
    mut sampler: Box<dyn GpuSampler>,
    telemetry: Telemetry,
    cadence: Cadence,
    stop: Arc<std::sync::atomic::AtomicBool>,
) {
    info!(sampler = %sampler.describe(), every_ms = cadence.every.as_millis() as u64, window_s = cadence.window.as_secs_f64(), "GPU telemetry on");
    let mut windows = window::Windows::new(cadence.window);
    let mut failing: BTreeMap<u32, String> = BTreeMap::new();
    let mut sampled: Vec<u32> = Vec::new();
    let metrics = crate::metrics::metrics();
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let now = now_ms();
        let gpus = telemetry.gpus();
        let current: Vec<u32> = gpus.iter().map(|g| g.gpu).collect();
        let gone: Vec<u32> = sampled.iter().copied().filter(|g| !current.contains(g)).collect();
        if !gone.is_empty() {
            let closed = windows.close(now, true, |gpu, a, b| telemetry.steps_in(gpu, a, b));
            telemetry.enqueue(closed);
            for gpu in &gone {
                windows.forget(*gpu);
                metrics.forget_gpu(*gpu);
            }
        }
        let mut urgent = Vec::new();
        for user in &gpus {
            match sampler.sample(user.gpu, now) {
                Ok(sample) => {
                    if failing.remove(&user.gpu).is_some() {
                        info!(gpu = user.gpu, "GPU telemetry readable again");
                    }
                    if !sample.xids.is_empty() {
                        warn!(gpu = user.gpu, xids = ?sample.xids, "XID reported by the driver");
                        urgent.push(user.gpu);
                    }
                    metrics.observe_gpu(&sample, user.rank);
                    windows.push(&sample);
                }
                Err(e) => {
                    if failing.insert(user.gpu, e.clone()).as_ref() != Some(&e) {
                        warn!(gpu = user.gpu, error = %e, "cannot read GPU telemetry");
                    }
                }
            }
        }
        sampled = current;
        // An XID goes out at once, ahead of the rank's exit it may cause.
        let mut closed = windows.close_these(&urgent, now, |gpu, a, b| telemetry.steps_in(gpu, a, b));
        closed.extend(windows.close(now, false, |gpu, a, b| telemetry.steps_in(gpu, a, b)));
        telemetry.enqueue(closed);
        std::thread::sleep(cadence.every);
    }
    let closed = windows.close(now_ms(), true, |gpu, a, b| telemetry.steps_in(gpu, a, b));
    telemetry.enqueue(closed);
}

pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rank(r: u32) -> RankId {
        RankId { job_id: 7, attempt: 1, rank: r }
    }

    #[test]
    fn windows_name_the_steps_their_rank_ran() {
        let t = Telemetry::default();
        t.set_gpus(vec![GpuUse { rank: rank(2), gpu: 5 }]);
        for (at, step) in [(100, 0), (900, 1), (1_500, 2), (1_400, 2), (2_100, 3)] {
            t.note_steps([(rank(2), step)].into_iter(), at);
        }
        let steps = t.steps_in(5, 500, 2_000);
        assert_eq!((steps[0].first_step, steps[0].last_step), (1, 2), "{steps:?}");
        assert_eq!(steps[0].key.as_ref().unwrap().rank, 2);
        assert_eq!(t.steps_in(5, 3_000, 4_000)[0].first_step, -1, "a rank that did not step");
        assert!(t.steps_in(4, 0, 4_000).is_empty(), "an idle GPU");
    }

    #[test]
    fn one_batch_on_the_wire_until_acked_and_resent_on_a_new_stream() {
        let t = Telemetry::default();
        t.enqueue(vec![GpuWindow { gpu: 0, ..GpuWindow::default() }; MAX_BATCH_WINDOWS + 3]);
        let first = t.next_batch(false).unwrap();
        assert_eq!(first.windows.len(), MAX_BATCH_WINDOWS);
        assert!(t.next_batch(false).is_none(), "one batch in flight");
        assert_eq!(t.next_batch(true).unwrap().id, first.id, "resent whole on a new stream");
        t.ack(first.id + 5);
        assert!(t.next_batch(false).is_none(), "a wrong id acknowledges nothing");
        t.ack(first.id);
        let second = t.next_batch(false).unwrap();
        assert_eq!((second.id, second.windows.len()), (first.id + 1, 3));
        assert_eq!(t.pending(), 3);
    }

    #[test]
    fn a_full_queue_drops_its_oldest_windows() {
        let t = Telemetry::default();
        let windows: Vec<GpuWindow> = (0..MAX_QUEUED_WINDOWS + 2)
            .map(|i| GpuWindow { start_ms: i as i64, ..GpuWindow::default() })
            .collect();
        t.enqueue(windows);
        assert_eq!(t.pending(), MAX_QUEUED_WINDOWS);
        assert_eq!(t.next_batch(false).unwrap().windows[0].start_ms, 2);
    }
}
