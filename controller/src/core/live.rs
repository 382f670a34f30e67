//! The live diagnosis (docs/diagnosis.md, "Live"): every `live_every` (10 s, a telemetry
//! window) each running attempt is diagnosed over its latest steps and windows, read
//! incrementally from the store ([`Rolling`]); findings are stored when first seen, updated
//! while they last and closed when they stop ([`Tracker`]), exported as
//! `trainyard_job_finding{job,cause,node}`, and sent to the alert webhooks once opened and once
//! closed. The task owns its state: nothing else waits on it, and it is given the store, the
//! clock and a way to copy what a diagnosis reads under the core's lock ([`running_contexts`]),
//! never the controller.
//!
//! After a restart the open findings come back from the store, so a finding that is still there
//! is neither stored nor alerted twice; the windows are read again page by page, and nothing is
//! judged until they have caught up (old windows must not raise new alerts). Step receipts are
//! read newest first, at most what the rolling data keeps, so a diagnosis that fell behind a
//! flood of receipts (or a restart after a long run) catches up in one round.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use trainyard_analysis::diagnose::live::{LIVE_STEPS, Rolling, Tracker};
use trainyard_analysis::diagnose::{Finding, Input, NodeFacts};
use trainyard_store::{Allocation, JobId, JobRecord, JobState, LiveFinding};

use super::state::Core;
use super::{Clock, Result};
use crate::alerts::{Alert, RETRY_CAP, Webhooks};
use trainyard_store::Store;

/// Windows read per round at most (a round after a restart pages through a long run).
const WINDOW_PAGE: u32 = 20_000;
/// Step receipts read per round at most, whatever the job's size.
const RECEIPT_PAGE: u32 = 200_000;

/// Step receipts a round reads at most for `ranks` ranks: the newest, twice what the rolling
/// data keeps ([`LIVE_STEPS`] steps of every rank), so a round costs the same however far
/// behind the diagnosis fell (a flood of receipts, a restart after a long run).
fn receipt_limit(ranks: usize) -> u32 {
    let kept = (LIVE_STEPS as usize + 1).saturating_mul(ranks.max(1)).saturating_mul(2);
    u32::try_from(kept).unwrap_or(u32::MAX).min(RECEIPT_PAGE)
}

/// One running attempt as the live diagnosis follows it.
struct LiveJob {
    attempt: u32,
    after_window: u64,
    after_receipt: u64,
    rolling: Rolling,
    tracker: Tracker,
    /// Open findings by (cause, subject), as stored.
    open: HashMap<(String, String), LiveFinding>,
}

impl LiveJob {
    fn new(attempt: u32) -> LiveJob {
        LiveJob {
            attempt,
            after_window: 0,
            after_receipt: 0,
            rolling: Rolling::default(),
            tracker: Tracker::default(),
            open: HashMap::new(),
        }
    }
}

/// What a diagnosis of a running attempt reads besides the rolling data.
pub(super) struct Context {
    record: JobRecord,
    allocations: Vec<Allocation>,
    nodes: BTreeMap<String, NodeFacts>,
    predicted_comm_ms: f64,
}

/// Pending alert deliveries: (finding id, opening) -> (next try, delay, targets still to reach).
type Deliveries = HashMap<(u64, bool), (Instant, Duration, Vec<usize>)>;

/// Runs the live diagnosis and the alerts until `shutdown`, every `every`, on the running
/// attempts `running` copies (under the core's lock: the task takes nothing else of the core).
pub(super) async fn run(
    store: Arc<dyn Store>,
    clock: Clock,
    every: Duration,
    running: impl Fn() -> BTreeMap<JobId, Context>,
    webhooks: Webhooks,
    shutdown: tokio_util::sync::CancellationToken,
) {
    let store = store.as_ref();
    let mut jobs: HashMap<JobId, LiveJob> = HashMap::new();
    match store.open_live_findings().await {
        Ok(open) => {
            for f in open {
                let job = jobs.entry(f.job_id).or_insert_with(|| LiveJob::new(f.attempt));
                job.open.insert((f.cause.clone(), f.subject.clone()), f);
            }
            for job in jobs.values_mut() {
                job.tracker = Tracker::resume(job.open.keys().cloned());
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "could not read open findings; the live diagnosis starts afresh")
        }
    }
    for f in jobs.values().flat_map(|j| j.open.values()) {
        set_gauge(f, true);
    }
    let mut deliveries: Deliveries = HashMap::new();
    let mut round = tokio::time::interval(every);
    let mut alert_tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = round.tick() => {
                let started = Instant::now();
                if let Err(e) = live_round(store, running(), clock.now_ms(), &mut jobs).await {
                    tracing::warn!(error = %e, "live diagnosis round failed; trying again next round");
                }
                crate::metrics::metrics().live_diagnosis.observe(started.elapsed().as_secs_f64());
            }
            _ = alert_tick.tick() => {}
        }
        if !webhooks.is_empty() {
            deliver(store, &clock, &webhooks, &mut deliveries).await;
        }
    }
}

/// One round over every running attempt.
async fn live_round(
    store: &dyn Store,
    running: BTreeMap<JobId, Context>,
    now: i64,
    jobs: &mut HashMap<JobId, LiveJob>,
) -> Result<()> {
    // Attempts that ended (or jobs that left): close what they held.
    let ended: Vec<JobId> = jobs
        .iter()
        .filter(|(id, j)| running.get(id).is_none_or(|c| c.record.attempt != j.attempt))
        .map(|(id, _)| *id)
        .collect();
    for id in ended {
        if let Some(mut job) = jobs.remove(&id) {
            for key in job.tracker.close_all() {
                close_finding(store, &mut job, &key, now).await?;
            }
            for (_, f) in job.open.drain() {
                store.close_live_finding(f.id, now).await?;
                set_gauge(&f, false);
            }
        }
    }
    for (id, context) in running {
        let job = jobs.entry(id).or_insert_with(|| LiveJob::new(context.record.attempt));
        let caught_up = read_new(store, id, job, context.allocations.len()).await?;
        if !caught_up {
            continue;
        }
        let input = Input {
            spec: &context.record.spec,
            attempt: job.attempt,
            allocations: &context.allocations,
            samples: &[],
            nodes: &context.nodes,
            predicted_comm_ms: context.predicted_comm_ms,
            windows: &[],
        };
        let diagnosis = job.rolling.judge(&input);
        let changes = job.tracker.round(diagnosis.findings);
        for f in changes.opened.iter().chain(&changes.ongoing) {
            keep_finding(store, id, job, f, now).await?;
        }
        for key in &changes.closed {
            close_finding(store, job, key, now).await?;
        }
    }
    Ok(())
}

/// Running attempts with what their diagnosis reads, copied under the core's lock.
pub(super) fn running_contexts(core: &Core) -> BTreeMap<JobId, Context> {
    core.jobs
        .values()
        .filter(|j| j.record().state == JobState::Running)
        .map(|j| {
            let nodes = super::view::node_facts(core, &j.allocations);
            let predicted = super::view::predicted_comm_ms(core, &j.allocations, &j.record().spec);
            let context = Context {
                record: j.record().clone(),
                allocations: j.allocations.clone(),
                nodes,
                predicted_comm_ms: predicted,
            };
            (j.record().id, context)
        })
        .collect()
}

/// Reads the attempt's new windows and its newest step receipts; `false` while a page of
/// windows came back full (more to read: not judged yet). Step receipts older than the newest
/// [`receipt_limit`] are never read: when some were left out, the rolling steps start afresh
/// from the newest (what they keep of a long backlog anyway), so no gap hides inside them.
async fn read_new(store: &dyn Store, id: JobId, job: &mut LiveJob, ranks: usize) -> Result<bool> {
    let windows = store.job_gpu_windows_after(id, job.after_window, WINDOW_PAGE).await?;
    let full_windows = windows.len() == WINDOW_PAGE as usize;
    if let Some((last, _)) = windows.last() {
        job.after_window = *last;
    }
    job.rolling.add_windows(windows.into_iter().map(|(_, w)| w).filter(|w| w.attempt == Some(job.attempt)));
    let limit = receipt_limit(ranks);
    let samples = store.latest_step_samples_after(id, job.attempt, job.after_receipt, limit).await?;
    let skipped = samples.len() == limit as usize;
    if let Some((last, _)) = samples.last() {
        job.after_receipt = *last;
    }
    let samples = samples.into_iter().map(|(_, s)| s);
    if skipped {
        job.rolling.replace_samples(samples);
    } else {
        job.rolling.add_samples(samples);
    }
    Ok(!full_windows)
}

/// Stores a finding seen this round: opened, or its numbers updated.
async fn keep_finding(store: &dyn Store, id: JobId, job: &mut LiveJob, f: &Finding, now: i64) -> Result<()> {
    let key = (f.cause.to_string(), f.subject.clone());
    let evidence: Vec<String> =
        f.evidence.iter().map(|m| format!("{}={:.4} {}", m.name, m.value, m.unit)).collect();
    let record = LiveFinding {
        job_id: id,
        attempt: job.attempt,
        cause: key.0.clone(),
        subject: key.1.clone(),
        nodes: f.nodes.clone(),
        ranks: f.ranks.clone(),
        summary: f.summary.clone(),
        evidence: evidence.join("; "),
        remedy: f.remedy.clone(),
        // A rule that knows its steps (a GPU condition's windows) gives them; otherwise the
        // job's newest step when the round saw it.
        first_step: Some(f.steps.map_or(job.rolling.last_step(), |s| s.0)),
        last_step: Some(f.steps.map_or(job.rolling.last_step(), |s| s.1)),
        opened_at_ms: now,
        updated_at_ms: now,
        ..Default::default()
    };
    let first = !job.open.contains_key(&key);
    let stored = store.upsert_live_finding(&record).await?;
    if first {
        tracing::warn!(job_id = id, cause = %stored.cause, subject = %stored.subject, summary = %stored.summary, "finding opened");
        set_gauge(&stored, true);
    }
    job.open.insert(key, stored);
    Ok(())
}

async fn close_finding(store: &dyn Store, job: &mut LiveJob, key: &(String, String), now: i64) -> Result<()> {
    if let Some(f) = job.open.remove(key) {
        store.close_live_finding(f.id, now).await?;
        tracing::info!(job_id = f.job_id, cause = %f.cause, subject = %f.subject, "finding closed");
        set_gauge(&f, false);
    }
    Ok(())
}

/// Sends the alerts not yet delivered, each target retried with a doubling delay.
async fn deliver(store: &dyn Store, clock: &Clock, webhooks: &Webhooks, deliveries: &mut Deliveries) {
    let due = match store.unalerted_findings(100).await {
        Ok(due) => due,
        Err(e) => {
            tracing::warn!(error = %e, "could not read the alerts to send");
            return;
        }
    };
    let all: Vec<usize> = (0..webhooks.targets().len()).collect();
    for f in due {
        for opening in [true, false] {
            let sent = if opening { f.alerted_open_ms } else { f.alerted_close_ms };
            if sent.is_some() || (!opening && f.closed_at_ms.is_none()) {
                continue;
            }
            let entry = deliveries
                .entry((f.id, opening))
                .or_insert_with(|| (Instant::now(), Duration::from_secs(1), all.clone()));
            if entry.0 > Instant::now() {
                continue;
            }
            let alert = Alert::of(&f, opening);
            let mut left = Vec::new();
            for &i in &entry.2 {
                match webhooks.post(i, &alert).await {
                    Ok(()) => crate::metrics::metrics().alert(true),
                    Err(e) => {
                        crate::metrics::metrics().alert(false);
                        tracing::warn!(finding = f.id, error = %e, retry_in_s = entry.1.as_secs(), "alert not delivered");
                        left.push(i);
                    }
                }
            }
            if left.is_empty() {
                deliveries.remove(&(f.id, opening));
                if let Err(e) = store.mark_alerted(f.id, opening, clock.now_ms()).await {
                    tracing::warn!(finding = f.id, error = %e, "could not record a delivered alert; it may be sent again");
                }
            } else {
                entry.2 = left;
                entry.0 = Instant::now() + entry.1;
                entry.1 = (entry.1 * 2).min(RETRY_CAP);
            }
        }
    }
}

/// Counts an open finding in `trainyard_job_finding{job,cause,node}` (one series per node it
/// names; two GPUs of one node with the same cause count 2), or takes it out.
fn set_gauge(f: &LiveFinding, open: bool) {
    let family = &crate::metrics::metrics().job_finding;
    for node in f.nodes.iter().map(String::as_str).chain(f.nodes.is_empty().then_some("")) {
        let label = crate::metrics::FindingLabel {
            job: f.job_id.to_string(),
            cause: f.cause.clone(),
            node: node.to_string(),
        };
        if open {
            family.get_or_create(&label).inc();
        } else if family.get_or_create(&label).dec() <= 1 {
            family.remove(&label);
        }
    }
}

/// `future` with the CPU time of each of its polls (the polling thread's own,
/// `CLOCK_THREAD_CPUTIME_ID`) added to `trainyard_live_diagnosis_cpu_seconds_total`: what the
/// live diagnosis costs the controller, measured where it runs, its finding writes and alerts
/// included. Work it hands to another thread (a query's execution on SQLite's worker thread) or
/// process (PostgreSQL) is not in it.
pub(super) async fn cpu_counted<F: Future>(future: F) -> F::Output {
    let mut future = std::pin::pin!(future);
    std::future::poll_fn(|cx| {
        let started = thread_cpu_seconds();
        let polled = future.as_mut().poll(cx);
        let spent = (thread_cpu_seconds() - started).max(0.0);
        crate::metrics::metrics().live_diagnosis_cpu.inc_by(spent);
        polled
    })
    .await
}

/// CPU seconds this thread has used.
fn thread_cpu_seconds() -> f64 {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes into the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}
