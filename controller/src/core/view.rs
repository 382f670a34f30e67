//! The read side: jobs as `ctl` shows them, served from the store so that finished jobs and
//! jobs of a previous controller life look the same as live ones.

use std::collections::{BTreeMap, HashMap};

use trainyard_proto::v1::{Job, RankStatus};

use std::sync::Mutex;

use super::Result;
use super::state::Core;
use trainyard_analysis::diagnose::NodeFacts;
use trainyard_model::spec::JobSpec;
use trainyard_placement::cost;
use trainyard_placement::scheduler::LinkMatrix;
use trainyard_store::{Allocation, JobRecord, JobState, Store};

/// A job as `ctl` shows it: its record, its ranks as stored, and what the core knows of it now
/// (why it waits, the predicted collective time, warnings).
pub(super) async fn summary(
    store: &dyn Store,
    core: &Mutex<Core>,
    now_ms: i64,
    record: JobRecord,
    quota_warning: Option<String>,
) -> Result<Job> {
    let (id, attempt) = (record.id, record.attempt);
    let seqs: HashMap<u32, u64> = store.last_seqs(id, attempt).await?.into_iter().collect();
    let allocations = store.allocations(id, attempt).await?;
    let mut warnings = binding_warnings(&allocations);
    warnings.extend(quota_warning);
    if let (n @ 1.., newest) = store.receipt_problems(id).await? {
        warnings.push(format!(
            "{n} receipt(s) break receipt schema v1 and are stored flagged (receipts.problem); newest: {}",
            newest.unwrap_or_default()
        ));
    }
    if record.state == JobState::Running {
        let progress = store.step_progress(id, attempt).await?;
        if let Some(stall) = trainyard_analysis::diagnose::stall::stall(&progress, now_ms) {
            warnings.push(stall.describe());
        }
    }
    let (predicted_comm_ms, waiting_reason) = {
        let core = core.lock().unwrap_or_else(|p| p.into_inner());
        let waiting = match record.state {
            JobState::Pending => core.waiting.get(&id).cloned().unwrap_or_default(),
            _ => String::new(),
        };
        (predicted_comm_ms(&core, &allocations, &record.spec), waiting)
    };
    let measured_optimizer_ms = store.mean_optimizer_ms(id).await?.unwrap_or(0.0);
    let ranks = allocations
        .into_iter()
        .map(|a| RankStatus {
            rank: a.id.rank,
            agent_id: a.agent_id,
            gpu_index: a.gpu_index,
            state: a.observed.state.to_string(),
            exit_code: a.observed.exit_code.unwrap_or(-1),
            signal: a.observed.signal.unwrap_or(0),
            pid: a.observed.pid.unwrap_or(0),
            last_seq: seqs.get(&a.id.rank).map_or(-1, |&s| s as i64),
            skipped_lines: a.observed.skipped_lines,
            node_rank: a.node_rank,
            local_rank: a.local_rank,
            planned_cpus: a.planned_cpus,
            planned_mems: a.planned_mems,
            effective_cpus: a.observed.effective_cpus,
            effective_mems: a.observed.effective_mems,
        })
        .collect();
    Ok(Job {
        id,
        spec: Some((&record.spec).into()),
        state: record.state.to_string(),
        reason: record.reason,
        attempt,
        created_at_ms: record.created_at_ms,
        updated_at_ms: record.updated_at_ms,
        ranks,
        receipts: store.receipt_count(id).await?,
        events: Vec::new(),
        predicted_comm_ms,
        measured_optimizer_ms,
        warnings,
        waiting_reason,
        goodput: None,
        failures: Vec::new(),
        user: record.owner.user,
        run_as: record.owner.run_as,
        slurm_job_id: 0,
    })
}

/// The cost model's collective time per step for the job's placement: the worst link inside
/// each of its nodes (from the agents' inventories), the network when it spans nodes. 0 when
/// the job declares no bytes or a node is no longer known.
pub(super) fn predicted_comm_ms(core: &Core, allocations: &[Allocation], spec: &JobSpec) -> f64 {
    let builtin = cost::builtin_step_calls(spec);
    if (builtin.is_empty() && spec.resources.comm_bytes_per_step == 0) || allocations.is_empty() {
        return 0.0;
    }
    let mut by_agent: HashMap<&str, Vec<u32>> = HashMap::new();
    for a in allocations {
        by_agent.entry(a.agent_id.as_str()).or_default().push(a.gpu_index);
    }
    let mut worst = trainyard_placement::scheduler::LinkClass::Local;
    for (agent, gpus) in &by_agent {
        let Some(entry) = core.agents.get(*agent) else { return 0.0 };
        let inv = &entry.record.inventory;
        let mask = inv
            .gpus
            .iter()
            .enumerate()
            .filter(|(_, g)| gpus.contains(&g.index))
            .fold(0u64, |m, (p, _)| if p < 64 { m | 1 << p } else { m });
        worst = worst.min(LinkMatrix::parse(&inv.links, inv.gpus.len()).worst(mask));
    }
    let link = cost::bottleneck(worst, by_agent.len() > 1);
    let world = allocations.len() as u32;
    if builtin.is_empty() {
        cost::step_comm_ms(spec.resources.comm_bytes_per_step, world, link)
    } else {
        cost::calls_ms(&builtin, world, link)
    }
}

/// A warning per rank whose binding read back from `/proc` differs from the plan.
fn binding_warnings(allocations: &[Allocation]) -> Vec<String> {
    allocations
        .iter()
        .filter(|a| !a.planned_cpus.is_empty() && !a.observed.effective_cpus.is_empty())
        .filter(|a| {
            (&a.planned_cpus, &a.planned_mems) != (&a.observed.effective_cpus, &a.observed.effective_mems)
        })
        .map(|a| {
            format!(
                "rank {} on {}: bound to CPUs {} and memory {}, planned CPUs {} and memory node {}",
                a.id.rank,
                a.agent_id,
                a.observed.effective_cpus,
                a.observed.effective_mems,
                a.planned_cpus,
                a.planned_mems
            )
        })
        .collect()
}

/// What a diagnosis knows of each node of `allocations`: its inventory and newest preflight.
pub(super) fn node_facts(core: &Core, allocations: &[Allocation]) -> BTreeMap<String, NodeFacts> {
    allocations
        .iter()
        .filter_map(|a| core.agents.get(&a.agent_id))
        .map(|e| {
            let facts = NodeFacts { inventory: e.record.inventory.clone(), preflight: e.preflight.clone() };
            (e.record.agent_id.clone(), facts)
        })
        .collect()
}

/// Sets the gauges of [`crate::metrics`] from the core's state (on scrape).
pub(super) fn set_gauges(core: &Core) {
    let m = crate::metrics::metrics();
    for state in JobState::ALL.iter().filter(|s| !s.is_terminal()) {
        let n = core.jobs.values().filter(|j| j.record().state == *state).count();
        m.jobs.get_or_create(&crate::metrics::StateLabel { state: state.to_string() }).set(n as i64);
    }
    m.agents_connected.set(core.agents.values().filter(|e| e.link.is_some()).count() as i64);
    m.agents_known.set(core.agents.len() as i64);
    m.nodes_cordoned.set(core.agents.values().filter(|e| e.record.cordon.is_some()).count() as i64);
}
