//! How long `ctl diagnose` takes on a big job: `cargo bench -p trainyard-controller --bench
//! diagnose [-- sqlite|postgres]`. A job of 64 ranks on 8 nodes with 1,000 step receipts per
//! rank (64,000 rows, one rank 30 % slower), stored as ingest stores them; then the
//! controller's `diagnose` (what the RPC runs: the store reads and the analysis) `RUNS` times
//! on each backend, printing the median. Target: under 1 s on SQLite and PostgreSQL. Writes its
//! figures to `docs/results/diagnose-<date>.jsonl` ([`trainyard_testkit::results`]).

use std::sync::Arc;
use std::time::Instant;

use serde_json::json;
use trainyard_controller::config::ControllerConfig;
use trainyard_controller::core::Controller;
use trainyard_model::domain::{AgentState, GpuInfo, Inventory, NumaNodeInfo};
use trainyard_model::spec::{JobSpec, Resources};
use trainyard_store::{
    AgentRecord, Allocation, NewReceipt, RankId, RankObserved, RankState, SqlStore, Store,
};
use trainyard_testkit::pg_server::{Durability, TempPostgres};
use trainyard_testkit::results::{Results, results_dir};

const NODES: u32 = 8;
const GPUS: u32 = 8;
const STEPS: u64 = 1_000;
const RUNS: usize = 7;
const SLOW_RANK: u32 = 37;

fn main() -> anyhow::Result<()> {
    let only = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let mut out = Results::create(&results_dir(), "diagnose", only.as_slice())?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async {
        let dir = tempfile::tempdir()?;
        if only.as_deref().is_none_or(|b| b == "sqlite") {
            let store = Arc::new(SqlStore::open_sqlite_file(&dir.path().join("bench.db")).await?);
            bench(&mut out, "sqlite", store).await?;
        }
        if only.as_deref().is_none_or(|b| b == "postgres") {
            let server = TempPostgres::start(Durability::Relaxed).map_err(anyhow::Error::msg)?;
            let url = server.create_database().map_err(anyhow::Error::msg)?;
            bench(&mut out, "postgres", trainyard_store::open(&url).await?).await?;
        }
        anyhow::Ok(())
    })?;
    println!("results: {}", out.path().display());
    Ok(())
}

async fn bench(out: &mut Results, backend: &str, store: Arc<dyn Store>) -> anyhow::Result<()> {
    let job = fill(store.as_ref()).await?;
    let controller = Controller::start(store, ControllerConfig::default()).await?;
    let mut times = Vec::with_capacity(RUNS);
    let mut verdict = String::new();
    for _ in 0..RUNS {
        let started = Instant::now();
        let d = controller.diagnoses().diagnose(job, None).await?;
        times.push(started.elapsed().as_secs_f64() * 1e3);
        anyhow::ensure!(d.samples_used as u64 == u64::from(NODES * GPUS) * STEPS, "read {}", d.samples_used);
        verdict = d.verdict();
    }
    times.sort_by(f64::total_cmp);
    println!(
        "{backend}: diagnose of {} ranks x {STEPS} steps: median {:.1} ms (min {:.1}, max {:.1}, {RUNS} runs)\n  {verdict}",
        NODES * GPUS,
        times[RUNS / 2],
        times[0],
        times[RUNS - 1]
    );
    let ms = |v: f64| (v * 10.0).round() / 10.0;
    out.line(&json!({"summary": {
        "backend": backend, "ranks": NODES * GPUS, "steps": STEPS, "runs": RUNS,
        "median_ms": ms(times[RUNS / 2]), "min_ms": ms(times[0]), "max_ms": ms(times[RUNS - 1]),
        "target_ms": 1000, "verdict": verdict,
    }}))
}

/// Nodes, a placed job and its receipts, as a controller would have stored them.
async fn fill(store: &dyn Store) -> anyhow::Result<u64> {
    for n in 0..NODES {
        let inventory = Inventory {
            hostname: format!("node-{n}"),
            gpus: (0..GPUS)
                .map(|i| GpuInfo {
                    index: i,
                    uuid: format!("GPU-{n}-{i}"),
                    model: "NVIDIA H100 80GB HBM3".into(),
                    memory_mib: 81_559,
                    pci_bus_id: format!("00000000:{:02x}:00.0", 0x18 + i),
                    numa_node: Some(0),
                })
                .collect(),
            numa_nodes: vec![NumaNodeInfo { id: 0, cpus: "0-111".into() }],
            links: (0..GPUS * GPUS)
                .map(|c| if c % (GPUS + 1) == 0 { "X" } else { "NV18" }.to_string())
                .collect(),
            cores: Vec::new(),
        };
        let agent = AgentRecord {
            agent_id: format!("node-{n}"),
            address: "10.0.0.1".into(),
            agent_version: "bench".into(),
            inventory,
            state: AgentState::Disconnected,
            last_seen_ms: 0,
            cordon: None,
        };
        store.upsert_agent(&agent).await?;
    }
    let spec = JobSpec {
        resources: Resources {
            gpus: NODES * GPUS,
            gpus_per_node: GPUS,
            comm_bytes_per_step: 7_100_000_000,
            ..Default::default()
        },
        ..JobSpec::exec("diagnose-bench", NODES * GPUS, &["train"])
    };
    let job = store.create_job(&spec, None, "bench", 0).await?.id;
    let allocations: Vec<Allocation> = (0..NODES * GPUS)
        .map(|rank| Allocation {
            id: RankId { job_id: job, attempt: 0, rank },
            agent_id: format!("node-{}", rank / GPUS),
            gpu_index: rank % GPUS,
            node_rank: rank / GPUS,
            local_rank: rank % GPUS,
            planned_cpus: String::new(),
            planned_mems: String::new(),
            observed: RankObserved { state: RankState::Planned, ..Default::default() },
        })
        .collect();
    store.schedule(job, 0, &allocations, "bench", 0).await?;
    for rank in 0..NODES * GPUS {
        let batch: Vec<NewReceipt> = (0..STEPS).map(|step| receipt(job, rank, step)).collect();
        store.insert_receipts(&batch, 1).await?;
    }
    Ok(job)
}

/// A step receipt of the built-in engine's shape, checked as ingest checks it.
fn receipt(job_id: u64, rank: u32, step: u64) -> NewReceipt {
    let slow = if rank == SLOW_RANK { 1.3 } else { 1.0 };
    let fwd_bwd = 640.0 * slow + (step % 7) as f64;
    let body = format!(
        concat!(
            r#"{{"kind":"step","schema":1,"step":{},"loss":{:.4},"step_time_ms":{:.2},"fwd_bwd_ms":{:.2},"#,
            r#""optimizer_ms":57.8,"tokens_per_s":746420.0,"mfu":0.41}}"#
        ),
        step,
        3.2 - step as f64 * 1e-4,
        fwd_bwd + 62.0,
        fwd_bwd
    );
    let checked = trainyard_model::receipts::check("step", &body).expect("a JSON object");
    NewReceipt {
        id: RankId { job_id, attempt: 0, rank },
        seq: step + 1,
        kind: "step".into(),
        step: Some(step as i64),
        body,
        problem: checked.problem,
        metrics: checked.metrics,
    }
}
