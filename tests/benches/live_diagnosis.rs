//! The live diagnosis's cost on a 64-rank job over a 10-minute run (docs/telemetry.md).
//!
//! Target: under 2 % of one core (CPU time of the diagnosis over the run's wall time). Replays
//! a 64-rank job (8 nodes x 8 GPUs, a step every 0.5 s with lognormal noise, sigma 0.15, one
//! GPU throttling and its rank 1.8x slower from minute 4 to 6) into a SQLite store in 10 s
//! slices, as ingest would store it; after each slice runs one round of the live diagnosis as
//! the controller does (read the new windows and step receipts, fold them into the rolling
//! data, diagnose, track findings). Only the rounds are timed: process CPU time (getrusage,
//! SQLite's worker thread included) and wall time. Prints the median and p99 round, the total
//! CPU, its share of one core over the 600 s the run lasted, and the findings opened/closed.
//!
//! Every run writes its figures to `docs/results/live_diagnosis-<date>.jsonl`
//! ([`trainyard_tests::results`]): one line per finding opened, then the summary (rounds, their
//! median, p99 and max, the CPU and its share of one core, findings opened and closed).
//!
//! `-- real [SECONDS]` measures the controller's own task instead, during a real run: a
//! controller (release binaries, SQLite, a round every 10 s) and 8 agents of 8 GPUs run a
//! 64-rank job of `examples/rank.py` (a step every 0.5 s) for SECONDS (default 600). The
//! controller counts the CPU time of its live-diagnosis task's polls in
//! `trainyard_live_diagnosis_cpu_seconds_total` (its finding writes and alerts included; a
//! query's execution on SQLite's worker thread not), read from `/metrics` when the job ends,
//! over the job's running time. Its summary has `"mode": "real"`.
//!
//! Run: `cargo bench -p trainyard-tests --bench live_diagnosis` (`-- --minutes N`, or
//! `-- real [SECONDS]`).

use std::collections::BTreeMap;
use std::time::Instant;

use serde_json::json;
use trainyard_analysis::diagnose::live::{Rolling, Tracker};
use trainyard_analysis::diagnose::{Input, NodeFacts};
use trainyard_model::domain::{GpuInfo, Inventory};
use trainyard_model::receipts;
use trainyard_model::records::{Allocation, GpuWindowRecord, RankObserved};
use trainyard_model::spec::{JobSpec, Resources};
use trainyard_store::{DiagnosisStore, JobStore, NewReceipt, RankId, ReceiptStore, SqlStore, TelemetryStore};
use trainyard_testkit::noise::Noise;
use trainyard_tests::results::{Results, results_dir};

const RANKS: u32 = 64;
const STEP_MS: i64 = 500;
const ROUND_MS: i64 = 10_000;
const SLOW_RANK: u32 = 42;

fn cpu_seconds() -> f64 {
    // SAFETY: getrusage fills the struct it is given.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    t(usage.ru_utime) + t(usage.ru_stime)
}

fn throttled(rank: u32, at_ms: i64) -> bool {
    rank == SLOW_RANK && (240_000..360_000).contains(&at_ms)
}

fn step_receipt(rank: u32, step: i64, ms: f64) -> NewReceipt {
    let body = format!(
        r#"{{"kind":"step","schema":1,"step":{step},"step_time_ms":{ms:.3},"fwd_bwd_ms":{:.3},"optimizer_ms":30.0,"tokens_per_s":{:.1}}}"#,
        ms - 30.0,
        524_288.0 / ms * 1000.0
    );
    let checked = receipts::check("step", &body).expect("a JSON object");
    NewReceipt {
        id: RankId { job_id: 1, attempt: 0, rank },
        seq: step as u64,
        kind: "step".into(),
        step: Some(step),
        body,
        problem: checked.problem,
        metrics: checked.metrics,
    }
}

fn window(rank: u32, start_ms: i64, steps: (i64, i64)) -> GpuWindowRecord {
    let hot = throttled(rank, start_ms);
    GpuWindowRecord {
        agent_id: format!("node-{}", rank / 8),
        gpu: rank % 8,
        uuid: format!("GPU-{rank}"),
        start_ms,
        end_ms: start_ms + ROUND_MS,
        samples: 10,
        sm_clock_min: Some(if hot { 1_100.0 } else { 1_980.0 }),
        sm_clock_mean: Some(if hot { 1_150.0 } else { 1_980.0 }),
        sm_clock_max: Some(1_980.0),
        sm_clock_limit: 1_980.0,
        power_mean: Some(650.0),
        power_max: Some(690.0),
        power_limit: 700.0,
        gpu_temp_max: Some(if hot { 91.0 } else { 62.0 }),
        util_mean: Some(100.0),
        clock_reasons: if hot { trainyard_proto::telemetry::HW_THERMAL.bit } else { 0 },
        pcie_gen: 5,
        pcie_gen_max: 5,
        pcie_width: 16,
        pcie_width_max: 16,
        nvlinks_up: 18,
        nvlinks_total: 18,
        job_id: Some(1),
        attempt: Some(0),
        rank: Some(rank),
        first_step: Some(steps.0),
        last_step: Some(steps.1),
        ..Default::default()
    }
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let minutes: i64 = args
        .iter()
        .position(|a| a == "--minutes")
        .and_then(|i| args.get(i + 1))
        .and_then(|m| m.parse().ok())
        .unwrap_or(10);
    let named: Vec<String> = args.iter().skip(1).filter(|a| *a != "--bench").cloned().collect();
    let mut out = Results::create(&results_dir(), "live_diagnosis", &named)?;
    if let Some(at) = args.iter().position(|a| a == "real") {
        let seconds = args.get(at + 1).and_then(|s| s.parse().ok()).unwrap_or(600);
        real(&mut out, seconds)?;
        println!("results: {}", out.path().display());
        return Ok(());
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(run(&mut out, minutes))?;
    println!("results: {}", out.path().display());
    Ok(())
}

fn round_to(v: f64, decimals: i32) -> f64 {
    let scale = 10f64.powi(decimals);
    (v * scale).round() / scale
}

async fn run(out: &mut Results, minutes: i64) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let store = SqlStore::open_sqlite_file(&dir.path().join("live.db")).await?;
    let spec = JobSpec {
        resources: Resources { gpus: RANKS, gpus_per_node: 8, ..Default::default() },
        ..JobSpec::exec("live-64", RANKS, &["x"])
    };
    store.create_job(&spec, None, "submitted", 0).await?;
    let allocations: Vec<Allocation> = (0..RANKS)
        .map(|rank| Allocation {
            id: RankId { job_id: 1, attempt: 0, rank },
            agent_id: format!("node-{}", rank / 8),
            gpu_index: rank % 8,
            node_rank: rank / 8,
            local_rank: rank % 8,
            planned_cpus: String::new(),
            planned_mems: String::new(),
            observed: RankObserved::default(),
        })
        .collect();
    let nodes: BTreeMap<String, NodeFacts> = (0..RANKS / 8)
        .map(|n| {
            let gpus =
                (0..8).map(|i| GpuInfo { index: i, numa_node: Some(0), ..Default::default() }).collect();
            (
                format!("node-{n}"),
                NodeFacts { inventory: Inventory { gpus, ..Default::default() }, preflight: None },
            )
        })
        .collect();
    let mut noise = Noise::new(7);
    let mut next_step = vec![0i64; RANKS as usize];
    let mut clock = vec![0i64; RANKS as usize];
    let (mut rolling, mut tracker) = (Rolling::default(), Tracker::default());
    let (mut after_window, mut after_receipt) = (0u64, 0u64);
    let (mut round_ms, mut round_cpu) = (Vec::new(), 0.0);
    let (mut opened, mut closed) = (Vec::new(), 0usize);
    let rounds = minutes * 60_000 / ROUND_MS;
    for round in 0..rounds {
        let (from, to) = (round * ROUND_MS, (round + 1) * ROUND_MS);
        // The slice's receipts and windows, stored as ingest would (not timed).
        let mut batch = Vec::new();
        let mut windows = Vec::new();
        for rank in 0..RANKS {
            let r = rank as usize;
            let first = next_step[r];
            while clock[r] < to {
                let mut ms = STEP_MS as f64 * (0.15 * noise.normal()).exp();
                if throttled(rank, clock[r]) {
                    ms *= 1.8;
                }
                batch.push(step_receipt(rank, next_step[r], ms));
                clock[r] += ms as i64;
                next_step[r] += 1;
            }
            windows.push(window(rank, from, (first, next_step[r] - 1)));
        }
        store.insert_receipts(&batch, to).await?;
        store.insert_gpu_windows(&windows).await?;
        // One live round, timed.
        let (wall, cpu) = (Instant::now(), cpu_seconds());
        let new_windows = store.job_gpu_windows_after(1, after_window, 20_000).await?;
        if let Some((id, _)) = new_windows.last() {
            after_window = *id;
        }
        rolling.add_windows(new_windows.into_iter().map(|(_, w)| w));
        let samples = store.latest_step_samples_after(1, 0, after_receipt, 200_000).await?;
        if let Some((position, _)) = samples.last() {
            after_receipt = *position;
        }
        rolling.add_samples(samples.into_iter().map(|(_, s)| s));
        let input = Input {
            spec: &spec,
            attempt: 0,
            allocations: &allocations,
            samples: &[],
            nodes: &nodes,
            predicted_comm_ms: 0.0,
            windows: &[],
        };
        let d = rolling.judge(&input);
        let changes = tracker.round(d.findings);
        round_cpu += cpu_seconds() - cpu;
        round_ms.push(wall.elapsed().as_secs_f64() * 1000.0);
        for f in &changes.opened {
            opened.push(format!("{} [{}] at {} s", f.cause, f.subject, to / 1000));
            out.line(&json!({
                "event": "finding opened", "cause": f.cause.to_string(), "subject": f.subject,
                "at_s": to / 1000,
            }))?;
        }
        closed += changes.closed.len();
    }
    round_ms.sort_by(f64::total_cmp);
    let p = |q: f64| round_ms[((round_ms.len() - 1) as f64 * q) as usize];
    let run_s = (rounds * ROUND_MS) as f64 / 1000.0;
    let share_pct = round_cpu / run_s * 100.0;
    println!("live diagnosis, {RANKS} ranks, {rounds} rounds over {run_s:.0} s of run");
    println!("  round wall: median {:.2} ms, p99 {:.2} ms, max {:.2} ms", p(0.5), p(0.99), p(1.0));
    println!("  CPU: {round_cpu:.2} s in total, {share_pct:.3} % of one core over the run (target < 2 %)");
    println!("  findings opened: {opened:?}; closed: {closed}");
    out.line(&json!({"summary": {
        "ranks": RANKS, "rounds": rounds, "run_s": run_s.round(),
        "round_p50_ms": round_to(p(0.5), 2), "round_p99_ms": round_to(p(0.99), 2),
        "round_max_ms": round_to(p(1.0), 2), "cpu_s": round_to(round_cpu, 2),
        "core_share_pct": round_to(share_pct, 3), "target_pct": 2.0,
        "findings_opened": opened.len(), "findings_closed": closed,
    }}))
}

/// A counter or gauge's value in a `/metrics` text, by its full name.
fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// `-- real`: the live diagnosis's cost on the controller's own task, during a real 64-rank run.
fn real(out: &mut Results, seconds: u64) -> anyhow::Result<()> {
    trainyard_tests::build_release_binaries()?;
    let mut c = trainyard_tests::Cluster::start_with(&[("--live-diagnosis-secs", "10")])?;
    for n in 0..8 {
        c.start_agent(&format!("node-{n}"), 8)?;
    }
    let steps = (seconds * 1000 / STEP_MS as u64).to_string();
    let file = c.job_file("live-real", RANKS, 8, &["--steps", &steps, "--step-ms", "500"], "");
    let job = c.submit(&file)?;
    c.wait_state(job, &["running"], std::time::Duration::from_secs(120))?;
    let (started, cpu_at_start) = (Instant::now(), controller_cpu(&c));
    println!("job {job}: {RANKS} ranks running; {seconds} s of steps");
    let end = c.wait_state(job, &["succeeded", "failed"], std::time::Duration::from_secs(seconds + 300))?;
    let wall = started.elapsed().as_secs_f64();
    let controller = controller_cpu(&c) - cpu_at_start;
    let (_, text) = c.http("GET", "/metrics")?;
    let cpu = metric(&text, "trainyard_live_diagnosis_cpu_seconds_total").unwrap_or(f64::NAN);
    let rounds = metric(&text, "trainyard_live_diagnosis_seconds_count").unwrap_or(f64::NAN);
    let round_s = metric(&text, "trainyard_live_diagnosis_seconds_sum").unwrap_or(f64::NAN);
    let share = 100.0 * cpu / wall;
    println!(
        "job {job} {}: live diagnosis {rounds} rounds over {wall:.0} s, its task {cpu:.3} s of CPU: {share:.3} % of one \
         core (target < 2 %); mean round {:.1} ms of wall; the whole controller {controller:.1} s of CPU ({:.1} %)",
        end["state"],
        1000.0 * round_s / rounds,
        100.0 * controller / wall
    );
    out.line(&json!({"summary": {
        "mode": "real", "ranks": RANKS, "run_s": round_to(wall, 1), "rounds": rounds,
        "cpu_s": round_to(cpu, 3), "core_share_pct": round_to(share, 3), "target_pct": 2.0,
        "round_mean_ms": round_to(1000.0 * round_s / rounds, 1),
        "controller_cpu_s": round_to(controller, 1), "controller_share_pct": round_to(100.0 * controller / wall, 1),
        "job_state": end["state"],
    }}))
}

fn controller_cpu(c: &trainyard_tests::Cluster) -> f64 {
    c.controller_pid().map_or(0.0, trainyard_tests::flood::process_cpu_s)
}
