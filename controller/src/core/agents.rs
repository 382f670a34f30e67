//! Agents: hellos, disconnects, rank reports, receipts, and the reaper of vanished agents.

use std::collections::{BTreeMap, BTreeSet};

use trainyard_proto::v1::{CancelRanks, ForgetRanks, RankKey, RankReport, controller_message::Msg};

use std::sync::Mutex;
use std::time::Duration;

use super::reconcile::Reconciler;
use super::state::Core;
use super::{ControllerError, Result};
use trainyard_store::{RankId, RankObserved, RankState, Store};

/// Records what an agent observed about one of its ranks: in the store, then in memory,
/// then wakes the reconciler to move the job on. A report about a rank the controller is
/// done with is answered with a stop or a forget instead.
pub(super) async fn observe(r: &Reconciler<'_>, agent_id: &str, report: &RankReport) -> Result<()> {
    let Some(id) = report.key.map(rank_id) else { return Ok(()) };
    let Some(observed) = observed_of(agent_id, id, report, r.now_ms()) else { return Ok(()) };
    let state = observed.state;
    {
        let mut core = r.lock();
        let known = core.jobs.get(&id.job_id).and_then(|j| {
            let current = j.record().attempt == id.attempt;
            j.allocations.iter().position(|a| a.id == id && a.agent_id == agent_id && current)
        });
        let Some(pos) = known else {
            answer_unknown(&mut core, r.config.cancel_grace, agent_id, id, state);
            return Ok(());
        };
        // Fenced: the rank was declared lost with its host, and the attempt moves on
        // without it; the host came back with it still running, so it is stopped.
        let job = core.jobs.get(&id.job_id).expect("job looked up above");
        if job.allocations[pos].observed.state == RankState::Lost && !state.is_done() {
            tracing::warn!(
                agent_id,
                job_id = id.job_id,
                rank = id.rank,
                "a rank declared lost is still running on a returning host; stopping it"
            );
            answer_unknown(&mut core, r.config.cancel_grace, agent_id, id, state);
            return Ok(());
        }
        // The rank-0 agent chose the attempt's MASTER_PORT: the other hosts can launch now.
        let port = u16::try_from(report.master_port).unwrap_or(0);
        let started = matches!(state, RankState::Launching | RankState::Running);
        let job = core.jobs.get_mut(&id.job_id).expect("job looked up above");
        if port > 0 && started && job.master_port.is_none() {
            job.master_port = Some(port);
            // Not to the reporting agent again: it has its launch, and a second one costs it
            // a durable rewrite of launch.json and a report of every rank while they start.
            let to = super::launch::LaunchTo::AllBut(agent_id);
            let sent = super::launch::send_launches(&mut core, id.job_id, to);
            if let Some(job) = core.jobs.get_mut(&id.job_id) {
                job.launches_sent += sent;
            }
            tracing::info!(
                job_id = id.job_id,
                attempt = id.attempt,
                agent_id,
                port,
                waiting = sent,
                "MASTER_PORT chosen by the rank-0 host; launching the others"
            );
        }
        let job = core.jobs.get(&id.job_id).expect("job looked up above");
        if unchanged(&job.allocations[pos].observed, &observed) {
            return Ok(());
        }
    }
    r.store.observe_rank(id, &observed).await?;
    {
        let mut core = r.lock();
        let current = core.jobs.get_mut(&id.job_id).filter(|j| j.record().attempt == id.attempt);
        if let Some(a) = current.and_then(|j| j.allocations.iter_mut().find(|a| a.id == id)) {
            a.observed = observed;
        }
        core.dirty.insert(id.job_id);
    }
    tracing::debug!(job_id = id.job_id, rank = id.rank, state = %report.state, "rank update");
    r.bump();
    r.wake();
    Ok(())
}

/// A report about a rank of a job or attempt the controller is done with: stop it, then
/// forget it.
fn answer_unknown(core: &mut Core, cancel_grace: Duration, agent_id: &str, id: RankId, state: RankState) {
    let (job_id, attempt) = (id.job_id, id.attempt);
    if state.is_done() {
        super::launch::send(&mut *core, agent_id, Msg::Forget(ForgetRanks { job_id, attempt }));
    } else {
        let reason = "the controller no longer runs this job attempt".to_string();
        let grace_ms = cancel_grace.as_millis() as u64;
        super::launch::send(
            &mut *core,
            agent_id,
            Msg::Cancel(CancelRanks { job_id, attempt, grace_ms, reason }),
        );
    }
}

/// Checks that every rank a batch carries receipts of was given to `agent_id`: an agent
/// speaks only for itself. Returns the jobs this controller does not know (a wiped
/// database, a foreign controller), whose receipts are neither stored nor acknowledged. A batch nearly
/// always holds one attempt of one job; the current attempt of an active job is checked in
/// memory, others (late receipts of ended jobs or earlier attempts) in the store.
pub(super) async fn check_senders(
    store: &dyn Store,
    core: &Mutex<Core>,
    agent_id: &str,
    ranks: &BTreeMap<RankId, u64>,
) -> Result<Vec<u64>> {
    let attempts: BTreeSet<(u64, u32)> = ranks.keys().map(|id| (id.job_id, id.attempt)).collect();
    let mut unknown = Vec::new();
    for (job_id, attempt) in attempts {
        // The current attempt of an active job: checked in place, under the lock, with
        // nothing copied (a batch arrives for every agent several times a second).
        let checked = {
            let core = core.lock().unwrap_or_else(|p| p.into_inner());
            core.jobs.get(&job_id).filter(|j| j.record().attempt == attempt).map(|j| {
                stranger(ranks, (job_id, attempt), agent_id, |rank| {
                    // Allocations are in rank order; a lookup by position, checked.
                    let at = j.allocations.get(rank as usize).filter(|a| a.id.rank == rank);
                    at.or_else(|| j.allocations.iter().find(|a| a.id.rank == rank))
                        .map(|a| a.agent_id.as_str())
                })
            })
        };
        let stranger = match checked {
            Some(stranger) => stranger,
            None => {
                if store.get_job(job_id).await?.is_none() {
                    unknown.push(job_id);
                    continue;
                }
                let allocations = store.allocations(job_id, attempt).await?;
                let owners: BTreeMap<u32, String> =
                    allocations.into_iter().map(|a| (a.id.rank, a.agent_id)).collect();
                stranger(ranks, (job_id, attempt), agent_id, |rank| owners.get(&rank).map(String::as_str))
            }
        };
        if let Some((rank, owner)) = stranger {
            return Err(ControllerError::NotYours(format!(
                "agent {agent_id} sent receipts of rank {rank} of job {job_id} attempt {attempt}, which runs on {owner}; an agent speaks only for its own ranks"
            )));
        }
    }
    Ok(unknown)
}

/// The first rank of `(job_id, attempt)` among `ranks` that `owner` says runs on an agent
/// other than `agent_id` (or on none), with that owner.
fn stranger<'a>(
    ranks: &BTreeMap<RankId, u64>,
    (job_id, attempt): (u64, u32),
    agent_id: &str,
    owner: impl Fn(u32) -> Option<&'a str>,
) -> Option<(u32, String)> {
    let of_attempt = ranks.keys().filter(|id| id.job_id == job_id && id.attempt == attempt);
    let mut owners = of_attempt.map(|id| (id.rank, owner(id.rank).unwrap_or("no agent")));
    owners.find(|(_, o)| *o != agent_id).map(|(rank, o)| (rank, o.to_string()))
}

/// What a rank report says, as the store keeps it; `None` for a report no agent sends (state
/// `planned`) or whose state is no word, which is logged and ignored.
fn observed_of(agent_id: &str, id: RankId, report: &RankReport, now_ms: i64) -> Option<RankObserved> {
    let state = match report.state() {
        Ok(RankState::Planned) => {
            tracing::warn!(
                agent_id,
                job_id = id.job_id,
                rank = id.rank,
                "ignoring a rank report of state planned, which agents do not send"
            );
            return None;
        }
        Err(e) => {
            tracing::warn!(agent_id, job_id = id.job_id, rank = id.rank, error = %e, "ignoring a rank report");
            return None;
        }
        Ok(state) => state,
    };
    Some(RankObserved {
        state,
        pid: (report.pid > 0).then_some(report.pid),
        exit_code: (state == RankState::Exited && report.signal == 0).then_some(report.exit_code),
        signal: (report.signal != 0).then_some(report.signal),
        message: report.message.clone(),
        skipped_lines: report.skipped_lines,
        updated_at_ms: now_ms,
        effective_cpus: report.effective_cpus.clone(),
        effective_mems: report.effective_mems.clone(),
    })
}

/// Same report apart from its time: nothing to write.
fn unchanged(a: &RankObserved, b: &RankObserved) -> bool {
    (
        &a.state,
        a.pid,
        a.exit_code,
        a.signal,
        &a.message,
        a.skipped_lines,
        &a.effective_cpus,
        &a.effective_mems,
    ) == (
        &b.state,
        b.pid,
        b.exit_code,
        b.signal,
        &b.message,
        b.skipped_lines,
        &b.effective_cpus,
        &b.effective_mems,
    )
}

pub(super) fn lost_report(id: RankId, message: &str) -> RankReport {
    RankReport {
        key: Some(rank_key(id)),
        state: RankState::Lost.to_string(),
        exit_code: -1,
        message: message.to_string(),
        ..Default::default()
    }
}

pub(crate) fn rank_id(k: RankKey) -> RankId {
    RankId { job_id: k.job_id, attempt: k.attempt, rank: k.rank }
}

pub(crate) fn rank_key(id: RankId) -> RankKey {
    RankKey { job_id: id.job_id, attempt: id.attempt, rank: id.rank }
}
