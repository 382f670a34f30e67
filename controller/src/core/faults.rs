//! Failures: what ended an attempt, which node is to blame, and what it costs (docs/faults.md).
//!
//! The reconciler asks [`classify`] what its ranks' reports (or the hang watch) say; the answer
//! is a [`FailureRecord`] with a kind, a node, the evidence, whether the node is blamed and
//! whether it counts against `max_restarts`. The rules:
//! - a rank that exits non-zero fails the job's own way (charged, nobody blamed), but while a
//!   peer host of the job is silent the verdict waits for it: a cut network makes the ranks on
//!   the other side fail first, and the host is the cause;
//! - a host lost (its agent vanished, went silent or came back without its ranks) is the
//!   fleet's failure: not charged, the node blamed unless its agent announced it was leaving;
//!   so is a rank lost on a live host (its supervisor died), and a launch preflight that
//!   refused the ranks, unless a check of the job's own environment failed it (then the job is
//!   charged, since it would fail anywhere);
//! - a hang blames the nodes whose ranks stopped stepping while others' did not; when every
//!   rank stopped at once the job is charged and nobody is blamed.
//!
//! A blamed node is left out of the job's next attempts until it passes a preflight (it is
//! asked for one at once, and again when it reconnects), and a node blamed
//! `cordon_after_blames` times within `blame_window` is cordoned fleet-wide until it passes one.

use std::collections::{BTreeSet, HashMap};
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;
use trainyard_proto::v1::{RunPreflight, controller_message::Msg};
use trainyard_proto::words::PreflightLevel;
use trainyard_store::{
    Allocation, Cordon, FailureKind, FailureRecord, JobId, JobState, PreflightRecord, RankState, Store,
    Verdict,
};

use super::Result;
use super::reconcile::ActiveJob;
use super::state::{Core, rank_failure};
use super::steps::{StepWatch, StepWatches};
use crate::config::ControllerConfig;

/// Attempts a job may take, beyond `max_restarts`, for failures that are not its own (a lost
/// host, a preemption): enough to ride out a bad week on a flaky fleet, never a loop for ever.
pub(super) const FLEET_RESTARTS: u32 = 50;

/// How the controller's own reports of a lost host's ranks begin (`host_lost_message`).
const HOST_LOST: &str = "host lost: ";
/// How an agent's refusal to start ranks after a failed launch preflight begins.
const PREFLIGHT_REFUSED: &str = "preflight failed: ";

/// The message of the ranks of a host the controller declared lost: `why` says how.
pub(super) fn host_lost_message(why: &str) -> String {
    format!("{HOST_LOST}{why}")
}

/// `cordon_by` of a cordon set after repeated blamed failures.
pub(super) const BY_FAILURES: &str = "failures";
/// Cordons a passing preflight lifts: those set after failures, and after a preemption notice
/// (a host that comes back from one is a fresh machine). An operator's and a drain's stay
/// until `ctl uncordon`.
const LIFTED_BY_PREFLIGHT: [&str; 2] = [BY_FAILURES, BY_PREEMPTION];
/// `cordon_by` of a cordon set by `ctl cordon`.
pub(super) const BY_OPERATOR: &str = "operator";
/// A cordon a preemption notice (or a Slurm allocation's time-limit warning) put on a node.
pub(super) const BY_PREEMPTION: &str = "preemption";

/// What the ranks of an attempt say.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Finding {
    /// Nothing failed.
    Healthy,
    /// A rank failed while a peer host is silent: wait for that host's verdict.
    Undecided,
    Failed(FailureRecord),
}

/// The job's failure, if its ranks (or the hang watch) report one. `silent` holds the nodes
/// that are disconnected or have not spoken for `unresponsive_after`; `leaving` those whose
/// agents announced they are stopping.
pub(super) fn classify(
    job: &ActiveJob,
    silent: &BTreeSet<&str>,
    leaving: &BTreeSet<&str>,
    now_ms: i64,
) -> Finding {
    if let Some(found) = &job.detected {
        return Finding::Failed(found.clone());
    }
    let allocs = &job.allocations;
    if allocs.iter().any(|a| rank_failure(a).is_some())
        && let Some(moved) = super::evict::moved_anyway(job, now_ms)
    {
        return Finding::Failed(moved);
    }
    let record = |a: &Allocation, kind: FailureKind, blamed: bool, charged: bool| FailureRecord {
        job_id: job.record().id,
        attempt: job.record().attempt,
        at_ms: now_ms,
        kind,
        agent_id: Some(a.agent_id.clone()),
        rank: Some(a.id.rank),
        evidence: rank_failure(a).unwrap_or_default(),
        blamed,
        charged,
    };
    if let Some(a) = allocs.iter().find(|a| a.observed.state == RankState::Lost) {
        let message = a.observed.message.as_str();
        let finding = if message.starts_with(HOST_LOST) {
            let blamed = !leaving.contains(a.agent_id.as_str());
            record(a, FailureKind::HostLost, blamed, false)
        } else if let Some(check) = message.strip_prefix(PREFLIGHT_REFUSED) {
            // A check of the job's own environment fails wherever the job goes.
            let the_jobs = check.starts_with("env.");
            record(a, FailureKind::Preflight, !the_jobs, the_jobs)
        } else {
            record(a, FailureKind::RankLost, true, false)
        };
        return Finding::Failed(finding);
    }
    let Some(a) = allocs.iter().find(|a| rank_failure(a).is_some()) else { return Finding::Healthy };
    let peer_silent =
        allocs.iter().any(|p| !super::state::rank_done(p) && silent.contains(p.agent_id.as_str()));
    if peer_silent {
        return Finding::Undecided;
    }
    Finding::Failed(record(a, FailureKind::RankExit, false, true))
}

/// An attempt that ran this long was no crash loop: the backoff starts over.
const STABLE_RUN: Duration = Duration::from_secs(60);

/// The backoff exponent after a failure: one more than before when the attempt failed within
/// [`STABLE_RUN`] of running (or never ran), 1 when it had run longer, so a job that fails once a
/// day waits the initial backoff and one that fails at start-up backs off further each time.
pub(super) fn next_streak(streak: u32, running_since: Option<Instant>) -> u32 {
    match running_since {
        Some(t) if t.elapsed() >= STABLE_RUN => 1,
        _ => streak.saturating_add(1),
    }
}

/// Where a failure leaves the job: restarting or failed, and the event's reason.
pub(super) fn after_failure(job: &ActiveJob, f: &FailureRecord) -> (JobState, String) {
    let max = job.record().spec.max_restarts;
    let attempt = job.record().attempt;
    let what = format!("{}: {}", f.kind, f.evidence);
    // The job's own environment fails the preflight wherever it goes: a restart cannot help.
    if f.kind == FailureKind::Preflight && f.charged {
        return (
            JobState::Failed,
            format!("{what}; not restarted: the job's own environment fails it on every node"),
        );
    }
    if f.charged && job.charged >= max {
        let why = if max > 0 { format!("{what}; no restarts left ({max} used)") } else { what };
        return (JobState::Failed, why);
    }
    if attempt >= max + FLEET_RESTARTS {
        return (JobState::Failed, format!("{what}; {} attempts, the most a job may take", attempt + 1));
    }
    let next = attempt + 1;
    let cost = if f.charged {
        format!("restart {} of at most {max}", job.charged + 1)
    } else {
        "not counted against max_restarts: the fleet's failure, not the job's".to_string()
    };
    let blame = match (&f.agent_id, f.blamed) {
        (Some(node), true) => format!("; {node} is left out until it passes a preflight"),
        _ => String::new(),
    };
    (JobState::Restarting, format!("{what}; restarting as attempt {next} ({cost}){blame}"))
}

/// The job's failures and cordons as they stood before a restart of the controller, and the
/// hang watch of every running job that had stepped: its clock starts after the reconnect
/// grace, so a failover never declares a hang the agents could not have reported.
pub(super) async fn reload(
    core: &mut Core,
    store: &dyn Store,
    config: &ControllerConfig,
    now_ms: i64,
) -> Result<HashMap<JobId, StepWatch>> {
    let since = now_ms - config.blame_window.as_millis() as i64;
    for f in store.failures_since(since).await? {
        if let (true, Some(node)) = (f.blamed, &f.agent_id) {
            core.blames.entry(node.clone()).or_default().push(f.at_ms);
        }
    }
    let ids: Vec<JobId> = core.jobs.keys().copied().collect();
    for id in ids {
        let failures = store.failures(id).await?;
        let Some(job) = core.jobs.get_mut(&id) else { continue };
        if job.record().attempt > 0 {
            job.resume_from = super::resume::points_of(store, id, &job.record().spec).await?;
        }
        job.charged = failures.iter().filter(|f| f.charged).count() as u32;
        for f in failures.iter().filter(|f| f.blamed) {
            if let Some(node) = &f.agent_id {
                job.avoid.insert(node.clone(), f.at_ms);
            }
        }
    }
    // A blame that a later passing preflight cleared stays cleared.
    let cleared: Vec<(String, i64)> = core
        .agents
        .values()
        .filter_map(|e| e.preflight.as_ref().filter(|r| r.verdict != Verdict::Fail))
        .map(|r| (r.agent_id.clone(), r.finished_at_ms))
        .collect();
    for (node, at) in cleared {
        for job in core.jobs.values_mut() {
            job.avoid.retain(|n, blamed_at| *n != node || *blamed_at > at);
        }
    }
    let mut watches = HashMap::new();
    let resume_at = Instant::now() + config.reconnect_grace;
    for job in core.jobs.values().filter(|j| j.record().state == JobState::Running) {
        let progress = store.step_progress(job.record().id, job.record().attempt).await?;
        if progress.ranks.is_empty() {
            continue;
        }
        let ranks = job.allocations.iter().map(|a| a.id.rank);
        let recent = progress.recent_step_ms.iter().rev().copied();
        watches.insert(job.record().id, StepWatch::seeded(job.record().attempt, ranks, resume_at, recent));
    }
    Ok(watches)
}

/// Nodes of `job` that are disconnected or silent, and those that announced they leave.
pub(super) fn silent_and_leaving<'j>(
    core: &Core,
    job: &'j ActiveJob,
) -> (BTreeSet<&'j str>, BTreeSet<&'j str>) {
    let (mut silent, mut leaving) = (BTreeSet::new(), BTreeSet::new());
    for a in &job.allocations {
        if let Some(e) = core.agents.get(&a.agent_id) {
            if e.link.is_none() || e.unresponsive {
                silent.insert(a.agent_id.as_str());
            }
            if e.leaving {
                leaving.insert(a.agent_id.as_str());
            }
        }
    }
    (silent, leaving)
}

/// Records that `f` blamed its node: the job avoids it, the node's blame count grows (and
/// may cordon it), and the node is asked for a preflight that can clear it.
pub(super) fn blame(core: &mut Core, f: &FailureRecord, config: &ControllerConfig) {
    let Some(node) = f.agent_id.clone().filter(|_| f.blamed) else { return };
    if let Some(job) = core.jobs.get_mut(&f.job_id) {
        job.avoid.insert(node.clone(), f.at_ms);
    }
    let window = config.blame_window.as_millis() as i64;
    let times = core.blames.entry(node.clone()).or_default();
    times.push(f.at_ms);
    times.retain(|t| *t > f.at_ms - window);
    let count = times.len();
    tracing::warn!(agent_id = %node, job_id = f.job_id, kind = %f.kind, blames = count, "node blamed for a failure");
    let threshold = config.cordon_after_blames;
    if let Some(entry) = core.agents.get_mut(&node)
        && threshold > 0
        && count >= threshold
        && entry.record.cordon.is_none()
    {
        let minutes = config.blame_window.as_secs() / 60;
        let reason = format!(
            "blamed for {count} failures within {minutes} min (the last: job {} {}); lifted when it passes a preflight",
            f.job_id, f.kind
        );
        tracing::error!(agent_id = %node, reason, "node cordoned: no new work goes there");
        let cordon = Cordon { by: BY_FAILURES.into(), reason, at_ms: f.at_ms };
        entry.record.cordon = Some(cordon.clone());
        core.cordons_to_store.push((node.clone(), Some(cordon)));
    }
    ask_for_clearing(&mut *core, &node);
}

/// Asks a connected node that some job avoids, or that failures cordoned, to run a quick
/// preflight: passing it clears the node.
pub(super) fn ask_for_clearing(core: &mut Core, node: &str) {
    let avoided = core.jobs.values().any(|j| j.avoid.contains_key(node));
    let cordoned =
        core.agents.get(node).is_some_and(|e| e.record.cordon.as_ref().is_some_and(|c| c.by == BY_FAILURES));
    let connected = core.agents.get(node).is_some_and(|e| e.link.is_some());
    if (avoided || cordoned) && connected {
        tracing::info!(agent_id = node, "asking a blamed node for a quick preflight to clear it");
        super::launch::send(
            &mut *core,
            node,
            Msg::RunPreflight(RunPreflight { level: PreflightLevel::Quick.as_str().into() }),
        );
    }
}

/// A passing preflight report clears the node of the blames before it: jobs may use it
/// again, and a cordon set after failures is lifted (an operator's stays).
pub(super) fn clear_by_preflight(core: &mut Core, report: &PreflightRecord) {
    if report.verdict == Verdict::Fail {
        return;
    }
    let (node, at) = (report.agent_id.as_str(), report.finished_at_ms);
    for job in core.jobs.values_mut() {
        if job.avoid.get(node).is_some_and(|blamed_at| *blamed_at <= at) {
            job.avoid.remove(node);
            tracing::info!(
                agent_id = node,
                job_id = job.record().id,
                "node passed a preflight: the job may use it again"
            );
            core.dirty.insert(job.record().id);
        }
    }
    if let Some(entry) = core.agents.get_mut(node)
        && entry
            .record
            .cordon
            .as_ref()
            .is_some_and(|c| LIFTED_BY_PREFLIGHT.contains(&c.by.as_str()) && c.at_ms <= at)
    {
        entry.record.cordon = None;
        core.blames.remove(node);
        tracing::info!(agent_id = node, "node passed a preflight: its cordon is lifted");
        core.cordons_to_store.push((node.to_string(), None));
    }
}

/// The hang watch (every 500 ms): a running attempt whose ranks wrote no step receipt for
/// the job's [`trainyard_model::restart::HangRule`] timeout is hung. Attempts that never
/// stepped are not watched (start-up and compilation take as long as they take); after a
/// restart of the controller the clocks start once the reconnect grace is over (`reload`);
/// while a host of the job is silent or away, its verdict comes first.
pub(super) fn check_hangs(core: &mut Core, steps: &StepWatches, now_ms: i64) {
    let now = Instant::now();
    let steps = steps.read();
    let mut found = Vec::new();
    for job in core.jobs.values().filter(|j| j.record().state == JobState::Running && j.detected.is_none()) {
        let Some(watch) = steps.get(&job.record().id).filter(|w| w.attempt == job.record().attempt) else {
            continue;
        };
        // A host of the job that is silent or away cannot deliver its ranks' receipts, and a
        // cut one stops everyone's collectives: the host's verdict (`liveness`) comes first.
        if !silent_and_leaving(&*core, job).0.is_empty() {
            continue;
        }
        // Ranks asked to checkpoint and move wait to be stopped: the move's deadline rules.
        if job.eviction.is_some() {
            continue;
        }
        if let Some(f) = hang_of(job, watch, now, now_ms) {
            found.push(f);
        }
    }
    drop(steps);
    for f in found {
        tracing::error!(job_id = f.job_id, attempt = f.attempt, evidence = %f.evidence, "job attempt hung");
        core.dirty.insert(f.job_id);
        if let Some(job) = core.jobs.get_mut(&f.job_id) {
            job.detected = Some(f);
        }
    }
}

/// Writes the cordons decided under the lock; on a store error they are kept for the next
/// pass (memory already holds them, so scheduling is right meanwhile).
pub(super) async fn store_cordons(store: &dyn Store, core: &Mutex<Core>) {
    let lock = || core.lock().unwrap_or_else(|p| p.into_inner());
    let pending = std::mem::take(&mut lock().cordons_to_store);
    for (i, (node, cordon)) in pending.iter().enumerate() {
        if let Err(e) = store.set_cordon(node, cordon.as_ref()).await {
            tracing::error!(agent_id = %node, error = %e, "failed to store a cordon; trying again");
            lock().cordons_to_store.extend(pending[i..].iter().cloned());
            return;
        }
    }
}

/// The hang of one running attempt, if its ranks stopped stepping for longer than the job's
/// hang timeout.
fn hang_of(job: &ActiveJob, watch: &StepWatch, now: Instant, now_ms: i64) -> Option<FailureRecord> {
    if watch.last.is_empty() {
        return None;
    }
    let median = watch.median_step();
    let timeout = job.record().spec.hang.timeout(median) + watch.longest_checkpoint * 2;
    let live: Vec<&Allocation> = job.allocations.iter().filter(|a| !super::state::rank_done(a)).collect();
    // A rank that has not stepped yet counts from the attempt's first step anywhere.
    let first = watch.last.values().min().copied()?;
    let quiet = |a: &Allocation| now.saturating_duration_since(*watch.last.get(&a.id.rank).unwrap_or(&first));
    let stale: Vec<&&Allocation> = live.iter().filter(|a| quiet(a) > timeout).collect();
    let first_stale = stale.first()?;
    let stale_nodes: BTreeSet<&str> = stale.iter().map(|a| a.agent_id.as_str()).collect();
    let fresh_nodes: BTreeSet<&str> =
        live.iter().filter(|a| quiet(a) <= timeout).map(|a| a.agent_id.as_str()).collect();
    // Blame only a node all of whose ranks stopped while another node's kept stepping.
    let blamed_node = (stale_nodes.len() == 1 && !fresh_nodes.is_empty())
        .then(|| *stale_nodes.first().expect("one"))
        .filter(|n| !fresh_nodes.contains(n));
    let ranks: Vec<String> = stale.iter().map(|a| a.id.rank.to_string()).collect();
    let median_words =
        median.map_or("no step time yet".to_string(), |m| format!("median step {:.2} s", m.as_secs_f64()));
    let evidence = format!(
        "no step receipt from rank(s) {} on {} for {:.0} s (hang timeout {:.0} s: max({} x {median_words}, floor {:.0} s){})",
        ranks.join(", "),
        stale_nodes.iter().copied().collect::<Vec<_>>().join(", "),
        quiet(first_stale).as_secs_f64(),
        timeout.as_secs_f64(),
        job.record().spec.hang.factor,
        job.record().spec.hang.floor.as_secs_f64(),
        if watch.longest_checkpoint > Duration::ZERO { ", plus twice the longest checkpoint" } else { "" },
    );
    Some(FailureRecord {
        job_id: job.record().id,
        attempt: job.record().attempt,
        at_ms: now_ms,
        kind: FailureKind::Hang,
        agent_id: Some(blamed_node.unwrap_or(first_stale.agent_id.as_str()).to_string()),
        rank: Some(first_stale.id.rank),
        evidence,
        blamed: blamed_node.is_some(),
        charged: blamed_node.is_none(),
    })
}
