//! What a `Launch` asks the agent to run: the argv of its engine (an `exec` command, or the
//! built-in engine binary beside the agent's), and `launch.json`, the record of the launch with
//! its rank map.

use serde_json::json;
use trainyard_proto::v1::{ExecEngine, HostInventory, Launch, job_spec};

use crate::layout::{Layout, RankId};

pub(super) fn exec_engine(launch: &Launch) -> Result<ExecEngine, String> {
    match launch.spec.as_ref().and_then(|s| s.engine.as_ref()) {
        Some(job_spec::Engine::Exec(exec)) if !exec.argv.is_empty() => Ok(exec.clone()),
        Some(job_spec::Engine::Exec(_)) => Err("launch refused: exec engine with an empty argv".into()),
        Some(job_spec::Engine::Builtin(b)) => builtin_engine(b),
        None => Err("launch refused: the job spec has no engine".into()),
    }
}

/// The built-in engine: the `trainyard-engine` binary next to this agent's binary, run in the
/// data directory with the job's preset, data and settings (`key = value` -> `--key value`).
fn builtin_engine(b: &trainyard_proto::v1::BuiltinEngine) -> Result<ExecEngine, String> {
    let me = std::env::current_exe().map_err(|e| format!("launch refused: own path: {e}"))?;
    let engine = me.with_file_name("trainyard-engine");
    if !engine.is_file() {
        return Err(format!("launch refused: builtin engine {} not found", engine.display()));
    }
    let mut argv = vec![
        engine.display().to_string(),
        "train".to_string(),
        "--preset".to_string(),
        b.preset.clone(),
        "--data".to_string(),
        b.data.clone(),
    ];
    let mut settings: Vec<_> = b.settings.iter().collect();
    settings.sort();
    for (k, v) in settings {
        argv.push(format!("--{}", k.replace('_', "-")));
        if !(v == "true" && matches!(k.as_str(), "resume")) {
            argv.push(v.clone());
        }
    }
    Ok(ExecEngine { argv, workdir: b.data.clone(), source_dir: String::new() })
}

/// `launch.json`: the launch as received, plus the rank map (rank, GPU, NUMA node, CPUs, files).
pub(super) fn launch_json(
    launch: &Launch,
    run: &str,
    inventory: &HostInventory,
    layout: &Layout,
) -> serde_json::Value {
    let spec = launch.spec.clone().unwrap_or_default();
    let engine = match &spec.engine {
        Some(job_spec::Engine::Exec(e)) => {
            json!({"exec": {"argv": e.argv, "workdir": e.workdir, "source_dir": e.source_dir}})
        }
        Some(job_spec::Engine::Builtin(b)) => {
            json!({"builtin": {"preset": b.preset, "data": b.data, "settings": b.settings}})
        }
        None => serde_json::Value::Null,
    };
    let ranks: Vec<_> = launch
        .ranks
        .iter()
        .map(|a| {
            let gpu = inventory.gpus.iter().find(|g| g.index == a.gpu_index);
            let numa = gpu.map(|g| g.numa_node);
            let cpus =
                numa.and_then(|n| inventory.numa_nodes.iter().find(|x| i64::from(x.id) == i64::from(n)));
            let id = RankId { job_id: launch.job_id, attempt: launch.attempt, rank: a.rank };
            json!({
                "rank": a.rank, "local_rank": a.local_rank, "gpu_index": a.gpu_index,
                "gpu_uuid": gpu.map(|g| g.uuid.clone()), "gpu_pci_bus_id": gpu.map(|g| g.pci_bus_id.clone()),
                "cuda_device": format!("cuda:{}", a.local_rank), "numa_node": numa,
                "cpus": cpus.map(|n| n.cpus.clone()), "dir": layout.rank_dir(run, id),
                "planned_cpus": a.cpus, "planned_mems": (!a.cpus.is_empty() && a.numa_node >= 0).then_some(a.numa_node),
            })
        })
        .collect();
    let resources = spec.resources.unwrap_or_default();
    json!({
        "job_id": launch.job_id, "attempt": launch.attempt, "world_size": launch.world_size,
        "node_rank": launch.node_rank, "local_world_size": launch.local_world_size,
        "master_addr": launch.master_addr, "master_port": launch.master_port,
        "cuda_visible_devices": crate::env::visible_devices(launch, &inventory.gpus),
        "spec": {
            "name": spec.name, "engine": engine, "env": spec.env, "preflight": spec.preflight,
            "priority": spec.priority,
            "resources": {"gpus": resources.gpus, "gpus_per_node": resources.gpus_per_node,
                "gpu_model": resources.gpu_model, "min_gpu_memory_mib": resources.min_gpu_memory_mib,
                "interconnect": resources.interconnect},
        },
        "ranks": ranks,
    })
}
