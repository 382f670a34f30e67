//! What GPU telemetry sets off (docs/telemetry.md; the receipts service stores the windows).
//! An XID that asks for a GPU reset or a reboot drains the node (a cordon a preflight does not
//! lift: only `ctl uncordon`, once someone reset the GPU) and fails the attempt using that GPU
//! as the GPU's failure (`gpu_xid`: the node blamed, the job not charged). When the rank crashed
//! first and its exit was already recorded as the job's own failure, that failure is given to
//! the GPU instead and the restart it cost is given back. Windows older than the retention are
//! pruned.

use std::time::Duration;
use trainyard_proto::telemetry::Xid;
use trainyard_proto::v1::GpuWindow;

use trainyard_store::{Cordon, FailureKind, FailureRecord, GpuWindowRecord, JobState, Store};

use super::Result;
use super::agents::rank_id;
use super::reconcile::Reconciler;

/// How long before an XID a rank's exit on the same node counts as the XID's doing.
const XID_EXPLAINS_EXIT_MS: i64 = 60_000;

/// Acts on one XID of a window: logged and counted always; one that drains the node
/// cordons it and fails the attempt that used the GPU.
pub(super) async fn on_xid(r: &Reconciler<'_>, w: &GpuWindowRecord, xid: Xid) -> Result<()> {
    let node = w.agent_id.as_str();
    crate::metrics::metrics().xid(xid.number);
    let evidence =
        format!("XID {} ({}) on GPU {} of {node}: {}", xid.number, xid.meaning, w.gpu, xid.action.as_str());
    if !xid.action.drains() {
        tracing::warn!(agent_id = node, gpu = w.gpu, xid = xid.number, %evidence, "XID reported");
        return Ok(());
    }
    tracing::error!(agent_id = node, gpu = w.gpu, xid = xid.number, %evidence, "XID: the node is drained");
    let at_ms = r.now_ms();
    let already_failed = {
        let mut core = r.lock();
        if let Some(entry) = core.agents.get_mut(node)
            && entry.record.cordon.is_none()
        {
            let reason = format!("{evidence}; `ctl uncordon {node}` once that is done");
            let cordon = Cordon { by: "drain".into(), reason, at_ms };
            entry.record.cordon = Some(cordon.clone());
            core.cordons_to_store.push((node.to_string(), Some(cordon)));
        }
        let (Some(job_id), Some(attempt)) = (w.job_id, w.attempt) else { return Ok(()) };
        match core.jobs.get_mut(&job_id) {
            Some(job)
                if job.record().attempt == attempt
                    && matches!(job.record().state, JobState::Running | JobState::Launching)
                    && job.detected.is_none() =>
            {
                job.detected = Some(FailureRecord {
                    job_id,
                    attempt,
                    at_ms,
                    kind: FailureKind::GpuXid,
                    agent_id: Some(node.to_string()),
                    rank: w.rank,
                    evidence: evidence.clone(),
                    blamed: true,
                    charged: false,
                });
                core.dirty.insert(job_id);
                None
            }
            _ => Some((job_id, attempt)),
        }
    };
    r.wake();
    let Some((job_id, attempt)) = already_failed else { return Ok(()) };
    // The rank may have crashed before the window carrying the XID arrived: its exit was
    // then recorded as the job's own failure. It was the GPU's.
    let since = at_ms - XID_EXPLAINS_EXIT_MS;
    if let Some(f) = r.store.blame_failure_on_xid(job_id, attempt, node, since, &evidence).await? {
        tracing::warn!(
            job_id,
            attempt,
            agent_id = node,
            "a rank exit was the GPU's failure: not charged to the job"
        );
        let mut core = r.lock();
        if let Some(job) = core.jobs.get_mut(&job_id) {
            job.charged = job.charged.saturating_sub(1);
        }
        super::faults::blame(&mut core, &f, &r.config);
    }
    Ok(())
}

/// Deletes telemetry windows older than the retention (run with the other periodic work).
pub(super) async fn prune(
    store: &dyn Store,
    retention: Option<Duration>,
    receipts: Option<Duration>,
    now_ms: i64,
) {
    if let Some(keep) = retention {
        match store.prune_gpu_windows(now_ms - keep.as_millis() as i64).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(windows = n, "pruned GPU telemetry past its retention"),
            Err(e) => tracing::warn!(error = %e, "failed to prune GPU telemetry; trying again later"),
        }
    }
    if let Some(keep) = receipts {
        match store.prune_receipts(now_ms - keep.as_millis() as i64).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(receipts = n, "pruned the receipts of jobs ended past their retention"),
            Err(e) => tracing::warn!(error = %e, "failed to prune receipts; trying again later"),
        }
    }
}

/// A window as the store keeps it; the rank of a job this controller does not know is left out.
pub(super) fn window_record(agent_id: &str, w: &GpuWindow, unknown: &[u64]) -> GpuWindowRecord {
    let stat = |s: &Option<trainyard_proto::v1::Stat>| s.map(|s| (s.min, s.mean, s.max));
    let sm = stat(&w.sm_clock_mhz);
    let power = stat(&w.power_w);
    let temp = stat(&w.gpu_temp_c);
    let user = w.steps.iter().find_map(|s| s.key.map(|k| (rank_id(k), s.first_step, s.last_step)));
    let user = user.filter(|(id, _, _)| !unknown.contains(&id.job_id));
    let step = |v: i64| (v >= 0).then_some(v);
    GpuWindowRecord {
        agent_id: agent_id.to_string(),
        gpu: w.gpu,
        uuid: w.uuid.clone(),
        start_ms: w.start_ms,
        end_ms: w.end_ms,
        samples: w.samples,
        sm_clock_min: sm.map(|s| s.0),
        sm_clock_mean: sm.map(|s| s.1),
        sm_clock_max: sm.map(|s| s.2),
        sm_clock_limit: w.max_sm_clock_mhz,
        mem_clock_mean: stat(&w.mem_clock_mhz).map(|s| s.1),
        power_mean: power.map(|s| s.1),
        power_max: power.map(|s| s.2),
        power_limit: w.power_limit_w,
        gpu_temp_mean: temp.map(|s| s.1),
        gpu_temp_max: temp.map(|s| s.2),
        mem_temp_max: stat(&w.mem_temp_c).map(|s| s.2),
        util_mean: stat(&w.util_pct).map(|s| s.1),
        mem_used_max: stat(&w.mem_used_bytes).map(|s| s.2),
        clock_reasons: w.clock_reasons,
        pcie_gen: w.pcie_gen,
        pcie_gen_max: w.pcie_gen_max,
        pcie_width: w.pcie_width,
        pcie_width_max: w.pcie_width_max,
        pcie_replays: w.pcie_replays,
        nvlinks_up: w.nvlinks_up,
        nvlinks_total: w.nvlinks_total,
        nvlink_crc_errors: w.nvlink_crc_errors,
        nvlink_replay_errors: w.nvlink_replay_errors,
        nvlink_recovery_errors: w.nvlink_recovery_errors,
        ecc_corrected: w.ecc_corrected,
        ecc_uncorrected: w.ecc_uncorrected,
        remap_pending: w.remap_pending,
        remap_failed: w.remap_failed,
        xids: w.xids.clone(),
        nvlink_detail: nvlink_detail(&w.nvlink_links),
        job_id: user.map(|u| u.0.job_id),
        attempt: user.map(|u| u.0.attempt),
        rank: user.map(|u| u.0.rank),
        first_step: user.and_then(|u| step(u.1)),
        last_step: user.and_then(|u| step(u.2)),
    }
}

/// The links that were down or erring, in words: `link 3 down; link 7: 12 crc, 1 replay`.
fn nvlink_detail(links: &[trainyard_proto::v1::NvlinkLink]) -> String {
    links
        .iter()
        .map(|l| {
            let counts: Vec<String> =
                [(l.crc_errors, "crc"), (l.replay_errors, "replay"), (l.recovery_errors, "recovery")]
                    .iter()
                    .filter(|(n, _)| *n > 0)
                    .map(|(n, what)| format!("{n} {what}"))
                    .collect();
            match (l.down, counts.is_empty()) {
                (true, true) => format!("link {} down", l.link),
                (true, false) => format!("link {} down: {}", l.link, counts.join(", ")),
                (false, _) => format!("link {}: {}", l.link, counts.join(", ")),
            }
        })
        .collect::<Vec<_>>()
        .join("; ")
}
