//! Waiting for a silent host instead of restarting without it (docs/faults.md, "A host that
//! is the only place").
//!
//! A host silent past the agent timeout gets no new work, but its job restarts elsewhere only
//! when a new placement could start now. While none could (the host was the only place big
//! enough, the spare is busy), the attempt waits for the host, up to the job's
//! `restart.host_wait_s` (the controller's `--host-wait-secs` by default) counted from the
//! host's last word, as the hold of a dead agent's live ranks is, so the two never add up. A
//! host that comes back within it with the attempt's ranks alive has them taken back: no
//! restart, no step lost, the gap recorded as a `host_silent` event. The rest is as before: a
//! wait that runs out, a placement that becomes possible, a rank that fails elsewhere, or a
//! host that returns without its ranks ends the attempt as `host_lost`.

use std::collections::BTreeMap;
use std::time::Duration;

use trainyard_model::restart::host_silent_reason;
use trainyard_placement::scheduler;
use trainyard_store::{JobId, JobState, RankState};

use super::reconcile::ActiveJob;
use super::state::{Core, rank_failure};
use crate::config::ControllerConfig;

/// What the reaper does with a job whose host is gone.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Decision {
    /// Wait for the host; the words say why no other placement can start now.
    Wait(String),
    /// Declare the host's ranks lost; the words (maybe empty) add why it did not wait.
    Lost(String),
}

/// How long `job` may wait for a silent host.
pub(super) fn limit(job: &ActiveJob, config: &ControllerConfig) -> Duration {
    job.record().spec.host_wait.unwrap_or(config.host_wait)
}

/// Whether `job` waits for `agent`, gone for `away`: only a whole attempt (placed, no rank failed
/// anywhere, nothing else already ending it) within its wait, with no other placement that
/// could start now.
pub(super) fn decide(
    core: &Core,
    job: &ActiveJob,
    agent: &str,
    away: Duration,
    config: &ControllerConfig,
) -> Decision {
    let placed = matches!(job.record().state, JobState::Scheduled | JobState::Launching | JobState::Running);
    let whole = job.allocations.iter().all(|a| rank_failure(a).is_none());
    let ending = job.cancel.is_some() || job.detected.is_some() || job.eviction.is_some();
    if !placed || !whole || ending {
        return Decision::Lost(String::new());
    }
    let wait = limit(job, config);
    if away >= wait {
        let words = if job.host_wait.is_some() {
            format!(
                "; the attempt waited {:.0} s for it (its host wait), and no other placement could start",
                wait.as_secs_f64()
            )
        } else {
            String::new()
        };
        return Decision::Lost(words);
    }
    match placement_now(core, job, agent) {
        Ok(()) => Decision::Lost("; a placement without it can start now".to_string()),
        Err(why) => Decision::Wait(why),
    }
}

/// Whether the job could be placed now without `gone`: on the nodes that take new work, with
/// its own GPUs on them counted free (a restart frees them), avoiding the nodes it avoids; at a
/// smaller size too when its `restart.min_gpus` allows; a `[slurm]` job on its own allocation's
/// agents (a spare of it). The error says why not.
fn placement_now(core: &Core, job: &ActiveJob, gone: &str) -> Result<(), String> {
    let pool = job.record().spec.slurm.is_some().then_some(job.record().id);
    let mut views = super::launch::views_of(core, false, pool);
    views.retain(|v| v.agent_id != gone);
    for a in &job.allocations {
        if let Some(view) = views.iter_mut().find(|v| v.agent_id == a.agent_id) {
            view.gpus.iter_mut().filter(|g| g.index == a.gpu_index).for_each(|g| g.free = true);
        }
    }
    let spec = &job.record().spec;
    let mut req = super::launch::request_of(job.record().id, spec);
    req.avoid = job.avoid.keys().cloned().collect();
    if scheduler::place(&req, &views).is_some() {
        return Ok(());
    }
    let step = req.gpus_per_node.max(1);
    let smaller = (spec.min_gpus.max(1)..req.gpus).rev().filter(|g| g % step == 0 && spec.min_gpus > 0);
    for gpus in smaller {
        if scheduler::place(&scheduler::Request { gpus, ..req.clone() }, &views).is_some() {
            return Ok(());
        }
    }
    let outcome = scheduler::schedule(std::slice::from_ref(&req), &views);
    Err(outcome.waiting.into_iter().next().map_or_else(|| "no node fits it".to_string(), |(_, why)| why))
}

/// The event of an attempt that starts to wait.
pub(super) fn waiting_reason(job: &ActiveJob, how: &str, wait: Duration, why: &str) -> String {
    format!(
        "host_lost pending: {how}; attempt {} waits up to {:.0} s from the host's last word (its host wait) for it to come back, rather than restart: no other placement can start now ({why})",
        job.record().attempt,
        wait.as_secs_f64()
    )
}

/// Jobs whose awaited host speaks again: the wait ends, and where none of the attempt's ranks on
/// it was declared lost, they are taken back (the `host_silent` events to store are returned). `gone`
/// holds the hosts still away.
pub(super) fn returned(
    core: &mut Core,
    gone: &BTreeMap<String, (Duration, String, bool)>,
    now_ms: i64,
) -> Vec<(JobId, String)> {
    let mut events = Vec::new();
    let agents = &core.agents;
    for job in core.jobs.values_mut() {
        let Some(w) = &job.host_wait else { continue };
        if gone.contains_key(&w.agent_id) {
            continue;
        }
        let back = agents.get(&w.agent_id).is_some_and(|e| e.link.is_some() && !e.unresponsive);
        if !back {
            continue;
        }
        // Taken back: none of its ranks was declared lost (some may have ended meanwhile, and
        // their exits are reported as from any live host).
        let mut on_it = job.allocations.iter().filter(|a| a.agent_id == w.agent_id).peekable();
        let kept = on_it.peek().is_some() && on_it.all(|a| a.observed.state != RankState::Lost);
        if kept && job.detected.is_none() {
            let gap = now_ms - w.since_ms;
            tracing::warn!(agent_id = %w.agent_id, job_id = job.record().id, gap_s = gap as f64 / 1e3, "a silent host came back with its ranks alive; they are taken back, no restart");
            crate::metrics::metrics().hosts_taken_back.inc();
            events.push((job.record().id, host_silent_reason(&w.agent_id, gap, job.record().attempt)));
        }
        job.host_wait = None;
    }
    events
}
