//! The hang watch's memory: when each running job's ranks last wrote a step receipt, their
//! recent step times, and their checkpoints. Ingest notes what each receipt batch says
//! ([`StepWatches::note`], off the core's lock); the hang watch (`faults`), the drain
//! (`evict`) and the reaper of lost hosts (`liveness`) read it.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;
use trainyard_proto::words::ReceiptKind;
use trainyard_store::JobId;

/// Step times the hang watch keeps per job for its median.
const STEP_WINDOW: usize = 64;

/// The watches of the running jobs. Its own lock: ingest updates it once per batch and never
/// takes the core's; a reader that holds both takes the core's first.
#[derive(Default)]
pub(super) struct StepWatches {
    jobs: Mutex<HashMap<JobId, StepWatch>>,
}

impl StepWatches {
    /// The watches `faults::reload` seeded after a restart of the controller.
    pub(super) fn new(seeded: HashMap<JobId, StepWatch>) -> StepWatches {
        StepWatches { jobs: Mutex::new(seeded) }
    }

    /// Notes the steps and checkpoints a receipt batch carried (ingest; no core lock).
    pub(super) fn note(&self, news: BTreeMap<(JobId, u32), StepNews>) {
        if news.is_empty() {
            return;
        }
        let now = Instant::now();
        let mut steps = self.read();
        for ((job_id, attempt), n) in news {
            let watch = steps.entry(job_id).or_insert_with(|| StepWatch::new(attempt));
            if watch.attempt > attempt {
                continue;
            }
            if watch.attempt < attempt {
                *watch = StepWatch::new(attempt);
            }
            for rank in n.ranks {
                watch.last.insert(rank, now);
            }
            for t in n.step_ms {
                if watch.step_ms.len() == STEP_WINDOW {
                    watch.step_ms.pop_front();
                }
                watch.step_ms.push_back(t);
            }
            let ckpt = Duration::from_secs_f64(n.checkpoint_s.clamp(0.0, 86_400.0));
            watch.longest_checkpoint = watch.longest_checkpoint.max(ckpt);
            for (rank, step) in n.checkpoints {
                watch.checkpointed.insert(rank, (now, step));
            }
        }
    }

    /// The ranks of each job that stored a step receipt within `window` (the reaper's evidence
    /// that a job is alive).
    pub(super) fn ranks_stepping_within(&self, window: Duration) -> HashMap<JobId, BTreeSet<u32>> {
        let now = Instant::now();
        let steps = self.read();
        steps
            .iter()
            .map(|(job, w)| {
                // A clock seeded at a restart of the controller (`reload`) is no step.
                let ranks = w.last.iter().filter(|(_, at)| {
                    Some(**at) != w.seeded && now.saturating_duration_since(**at) <= window
                });
                (*job, ranks.map(|(r, _)| *r).collect())
            })
            .collect()
    }

    /// Every job's watch, for a reader that judges them (hangs, drains).
    pub(super) fn read(&self) -> MutexGuard<'_, HashMap<JobId, StepWatch>> {
        self.jobs.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// When a job's ranks last wrote a step receipt, and its recent step times.
#[derive(Debug)]
pub(super) struct StepWatch {
    pub(super) attempt: u32,
    /// Per rank, when its newest step receipt arrived.
    pub(super) last: HashMap<u32, Instant>,
    pub(super) step_ms: VecDeque<f64>,
    /// The longest checkpoint the attempt wrote, allowed for on top of the timeout.
    pub(super) longest_checkpoint: Duration,
    /// Per rank, when its newest checkpoint receipt arrived and its step (drains wait on it).
    pub(super) checkpointed: HashMap<u32, (Instant, i64)>,
    /// The time `reload` seeded `last` with after a restart of the controller (the end of the
    /// reconnect grace), which is no step.
    pub(super) seeded: Option<Instant>,
}

/// What one receipt batch says about a job's steps.
#[derive(Debug, Default)]
pub(super) struct StepNews {
    pub ranks: BTreeSet<u32>,
    pub step_ms: Vec<f64>,
    pub checkpoint_s: f64,
    /// Ranks that wrote a checkpoint receipt, with its step.
    pub checkpoints: BTreeMap<u32, i64>,
}

/// Adds what one receipt says to a batch's [`StepNews`] (a step: its rank and step time; a
/// checkpoint: how long it took).
pub(super) fn note_receipt(
    news: &mut BTreeMap<(JobId, u32), StepNews>,
    id: trainyard_store::RankId,
    (kind, step): (&str, Option<i64>),
    body: &str,
    metrics: Option<&trainyard_model::receipts::StepMetrics>,
) {
    match kind.parse::<ReceiptKind>() {
        Ok(ReceiptKind::Step) => {
            let n = news.entry((id.job_id, id.attempt)).or_default();
            n.ranks.insert(id.rank);
            if let Some(t) = metrics.and_then(|m| m.step_time_ms) {
                n.step_ms.push(t);
            }
        }
        Ok(ReceiptKind::Checkpoint) => {
            let seconds = serde_json::from_str::<serde_json::Value>(body)
                .ok()
                .and_then(|v| v.get("duration_ms").and_then(serde_json::Value::as_f64))
                .unwrap_or(0.0)
                / 1000.0;
            let n = news.entry((id.job_id, id.attempt)).or_default();
            n.checkpoint_s = n.checkpoint_s.max(seconds);
            n.checkpoints.insert(id.rank, step.unwrap_or(-1));
        }
        _ => {}
    }
}

impl StepWatch {
    fn new(attempt: u32) -> StepWatch {
        StepWatch {
            attempt,
            last: HashMap::new(),
            step_ms: VecDeque::new(),
            longest_checkpoint: Duration::ZERO,
            checkpointed: HashMap::new(),
            seeded: None,
        }
    }

    /// The watch of an attempt that had stepped before a restart of the controller: every rank
    /// counts as stepping at `at` (the end of the reconnect grace, which is no step), with the
    /// attempt's recent step times from the store, newest first.
    pub(super) fn seeded(
        attempt: u32,
        ranks: impl Iterator<Item = u32>,
        at: Instant,
        recent: impl Iterator<Item = f64>,
    ) -> StepWatch {
        let mut watch = StepWatch::new(attempt);
        watch.last = ranks.map(|r| (r, at)).collect();
        watch.seeded = Some(at);
        watch.step_ms = recent.take(STEP_WINDOW).collect();
        watch
    }

    /// The step every rank of `live` checkpointed at since `asked`, in `attempt` (the lowest,
    /// should they differ); `None` until all have.
    pub(super) fn checkpoint_since(&self, attempt: u32, asked: Instant, live: &[u32]) -> Option<i64> {
        if self.attempt != attempt || live.is_empty() {
            return None;
        }
        live.iter()
            .map(|r| self.checkpointed.get(r).filter(|(at, _)| *at >= asked).map(|(_, step)| *step))
            .collect::<Option<Vec<i64>>>()?
            .into_iter()
            .min()
    }

    pub(super) fn median_step(&self) -> Option<Duration> {
        let mut v: Vec<f64> = self.step_ms.iter().copied().filter(|t| t.is_finite() && *t >= 0.0).collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        Some(Duration::from_secs_f64(v[v.len() / 2] / 1000.0))
    }
}
