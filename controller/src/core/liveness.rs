//! Liveness: when each agent last spoke, which are unresponsive (no new work), and the reaper
//! that declares a host lost when its agent has been away or silent for `agent_timeout`.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use tokio::time::Instant;
use trainyard_store::{AgentState, JobId, RankId};

use super::Result;
use super::agents::lost_report;
use super::heard::Heard;
use super::host_wait::Decision;
use super::logs::LogRelay;
use super::reconcile::Reconciler;
use super::state::{Core, rank_done};
use super::steps::StepWatches;

/// Marks connected agents that have sent nothing for `unresponsive_after` as
/// `unresponsive` (no new work) and back when they speak again, moves their `last_seen_ms`
/// forward, and writes it to the store every [`super::heard::SEEN_PERSIST_EVERY`].
pub(super) async fn check_liveness(r: &Reconciler<'_>, heard: &Heard) -> Result<()> {
    let seen = heard.last();
    let limit = r.config.unresponsive_after.as_millis() as i64;
    let now = r.now_ms();
    let mut recovered = false;
    let mut touched = Vec::new();
    {
        let mut core = r.lock();
        for e in core.agents.values_mut() {
            if e.link.is_none() {
                e.unresponsive = false;
                continue;
            }
            let id = e.record.agent_id.clone();
            if let Some(&at) = seen.get(&id) {
                e.record.last_seen_ms = e.record.last_seen_ms.max(at);
            }
            let silent_ms = now - e.record.last_seen_ms;
            let silent = silent_ms > limit;
            if silent && !e.unresponsive {
                tracing::warn!(agent_id = %id, silent_s = silent_ms / 1000, "agent unresponsive: its stream is open but it sent nothing; no new work goes there");
            } else if !silent && e.unresponsive {
                tracing::info!(agent_id = %id, "agent responsive again");
                recovered = true;
            }
            e.unresponsive = silent;
            touched.push((id, e.record.last_seen_ms));
        }
    }
    if recovered {
        r.wake();
    }
    if heard.persist_due() {
        r.store.touch_agents(&touched).await?;
    }
    Ok(())
}

/// The reaper (every 500 ms): a host whose agent has been disconnected, or connected but
/// silent, for longer than `agent_timeout` is lost. Its ranks are recorded as lost (their
/// jobs restart elsewhere) and a silent agent's stream is dropped, so that if it comes back
/// it must say hello again and the ranks of the old attempt are stopped (`answer_unknown`).
///
/// Unless the verdict waits, for one of two reasons:
/// - the job is visibly alive: while ranks of the same job on other hosts keep stepping, the
///   host's ranks evidently take part in the collectives (a dead agent, not a dead host: the
///   ranks outlive their agent), so the verdict waits, up to `agent_hold`, for the agent to come
///   back and adopt them. A cut network or a dead machine stops the collectives, and with them
///   the other ranks, so that verdict is not delayed;
/// - a restart could not start now anyway (`host_wait`): the attempt waits for the host, up to
///   its host wait, and takes its ranks back if it returns with them alive.
///
/// While a verdict waits, a silent agent's stream stays open (it may only be stopped).
/// Agents the controller has not heard from since it started get `reconnect_grace` first.
pub(super) async fn reap_vanished_agents(
    r: &Reconciler<'_>,
    heard: &Heard,
    steps: &StepWatches,
    logs: &LogRelay,
    started: Instant,
) {
    let timeout = r.config.agent_timeout;
    let grace_over = Instant::now() >= started + r.config.reconnect_grace;
    let now_ms = r.now_ms();
    let stepping = steps.ranks_stepping_within(timeout / 2);
    let mut dropped = Vec::new();
    let (lost, events) = {
        let mut guard = r.lock();
        let core = &mut *guard;
        let gone = gone_agents(core, grace_over, now_ms, timeout);
        let mut events = super::host_wait::returned(core, &gone, now_ms);
        let Verdicts { held, lost, waits } = verdicts(core, &gone, &stepping, &r.config);
        events.extend(start_waits(core, waits, now_ms, &r.config));
        for id in &held {
            if core.holding.insert(id.clone()) {
                tracing::warn!(agent_id = %id, hold_s = r.config.agent_hold.as_secs(), "agent gone but its jobs keep stepping or cannot restart elsewhere now: holding the verdict for its return");
            }
        }
        core.holding.retain(|id| held.contains(id));
        for (id, (away, _, open)) in &gone {
            if !*open || held.contains(id) {
                continue;
            }
            let Some(e) = core.agents.get_mut(id) else { continue };
            tracing::error!(agent_id = %id, silent_s = away.as_secs_f64(), "host lost: its stream is open but it sent nothing; dropping the stream");
            if let Some(link) = e.link.take() {
                heard.fence(link.conn_id);
            }
            e.disconnected_since = Some(Instant::now());
            e.record.state = AgentState::Disconnected;
            dropped.push(id.clone());
        }
        (lost, events)
    };
    for (job_id, reason) in events {
        if let Err(e) = r.store.note_job_event(job_id, &reason, now_ms).await {
            tracing::error!(job_id, error = %e, "failed to record a host wait's event");
        }
        r.bump();
    }
    for agent_id in dropped {
        logs.fail_agent(&agent_id);
        if let Err(e) = r.store.set_agent_state(&agent_id, AgentState::Disconnected, now_ms).await {
            tracing::error!(agent_id, error = %e, "failed to record a lost host as disconnected");
        }
    }
    for (agent_id, id, message) in lost {
        tracing::warn!(agent_id, job_id = id.job_id, rank = id.rank, "rank lost with its host");
        if let Err(e) = super::agents::observe(
            r,
            &agent_id,
            &lost_report(id, &super::faults::host_lost_message(&message)),
        )
        .await
        {
            tracing::error!(agent_id, job_id = id.job_id, rank = id.rank, error = %e, "failed to record a lost rank; trying again");
        }
    }
}

/// What the reaper found: the gone hosts whose verdict waits, the ranks to record lost (with
/// why), and the attempts that start or go on waiting for a host.
#[derive(Default)]
struct Verdicts {
    held: BTreeSet<String>,
    lost: Vec<(String, RankId, String)>,
    waits: Vec<(JobId, String, Duration, String, String)>,
}

/// The verdict on each live rank of a gone host: held while the job keeps stepping elsewhere
/// (up to `agent_hold`) or while it waits for the host (`host_wait::decide`), lost otherwise.
fn verdicts(
    core: &Core,
    gone: &BTreeMap<String, (Duration, String, bool)>,
    stepping: &std::collections::HashMap<JobId, BTreeSet<u32>>,
    config: &crate::config::ControllerConfig,
) -> Verdicts {
    let mut v = Verdicts::default();
    let (held, lost, waits) = (&mut v.held, &mut v.lost, &mut v.waits);
    for job in core.jobs.values() {
        let mut decided: BTreeMap<&str, Option<String>> = BTreeMap::new();
        for a in job.allocations.iter().filter(|a| !rank_done(a)) {
            let Some((away, how, _)) = gone.get(&a.agent_id) else { continue };
            let alive_elsewhere = stepping.get(&job.record().id).is_some_and(|ranks| {
                job.allocations.iter().any(|o| o.agent_id != a.agent_id && ranks.contains(&o.id.rank))
            });
            if alive_elsewhere && *away < config.agent_hold {
                held.insert(a.agent_id.clone());
                continue;
            }
            let verdict =
                decided.entry(a.agent_id.as_str()).or_insert_with(|| {
                    match super::host_wait::decide(core, job, &a.agent_id, *away, config) {
                        Decision::Wait(why) => {
                            waits.push((job.record().id, a.agent_id.clone(), *away, how.clone(), why));
                            None
                        }
                        Decision::Lost(more) => Some(more),
                    }
                });
            let Some(more) = verdict else {
                held.insert(a.agent_id.clone());
                continue;
            };
            let why = if alive_elsewhere {
                format!("{how}; the job's other ranks kept stepping until the hold ran out{more}")
            } else {
                format!("{how}{more}")
            };
            lost.push((a.agent_id.clone(), a.id, why));
        }
    }
    v
}

/// The attempts that wait for a gone host from this pass on: each remembers the host and its
/// last word, and the first pass of a wait returns the event that says why.
fn start_waits(
    core: &mut Core,
    waits: Vec<(JobId, String, Duration, String, String)>,
    now_ms: i64,
    config: &crate::config::ControllerConfig,
) -> Vec<(JobId, String)> {
    let mut events = Vec::new();
    for (job_id, agent_id, away, how, why) in waits {
        let Some(job) = core.jobs.get_mut(&job_id) else { continue };
        if job.host_wait.as_ref().is_some_and(|w| w.agent_id == agent_id) {
            continue;
        }
        let wait = super::host_wait::limit(job, config);
        tracing::warn!(
            agent_id,
            job_id,
            wait_s = wait.as_secs_f64(),
            why,
            "a host of the job is silent and no other placement can start now: the attempt waits for it"
        );
        events.push((job_id, super::host_wait::waiting_reason(job, &how, wait, &why)));
        let since_ms = now_ms - away.as_millis() as i64;
        job.host_wait = Some(super::reconcile::HostWait { agent_id, since_ms });
    }
    events
}

/// Agents away or silent past `timeout`: for how long, how (in words), and whether their
/// stream is still open. Agents not seen since this controller started are left alone until
/// the reconnect grace is over.
fn gone_agents(
    core: &Core,
    grace_over: bool,
    now_ms: i64,
    timeout: Duration,
) -> BTreeMap<String, (Duration, String, bool)> {
    let mut gone = BTreeMap::new();
    for e in core.agents.values() {
        if !e.seen_since_start && !grace_over {
            continue;
        }
        let id = &e.record.agent_id;
        let (away, how, open) = match (&e.link, e.disconnected_since) {
            (None, Some(since)) => (
                since.elapsed(),
                format!(
                    "agent {id} disconnected {:.1} s ago and did not come back",
                    since.elapsed().as_secs_f64()
                ),
                false,
            ),
            (Some(_), _) => {
                let silent =
                    Duration::from_millis(u64::try_from(now_ms - e.record.last_seen_ms).unwrap_or(0));
                let how = format!(
                    "agent {id} sent nothing for {:.1} s (a cut network or a stopped machine)",
                    silent.as_secs_f64()
                );
                (silent, how, true)
            }
            (None, None) => continue,
        };
        if away > timeout {
            gone.insert(id.clone(), (away, how, open));
        }
    }
    gone
}
