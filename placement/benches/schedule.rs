//! One scheduling decision over a simulated fleet: 1,000 hosts x 8 GPUs (SXM, NUMA-split SXM,
//! NVL and PCIe nodes, three quarters of the GPUs busy in a scattered pattern) and 10,000
//! queued jobs of 1 to 16 GPUs with mixed priorities and class constraints. A decision is one
//! `scheduler::schedule` pass: every queued job placed, backfilled or given its waiting reason.
//! Prints the median time per decision; the target (docs/architecture.md) is under 10 ms.
//! Writes its figures to `docs/results/schedule-<date>.jsonl` ([`trainyard_testkit::results`]).
//!
//! Run: `cargo bench -p trainyard-placement --bench schedule` (add `--profile dev` for a
//! quicker build).

use std::time::{Duration, Instant};

use serde_json::json;
use trainyard_testkit::results::{Results, results_dir};

use trainyard_model::domain::InterconnectClass;
use trainyard_placement::scheduler::{GpuView, LinkMatrix, NodeView, Request, schedule};

/// A small deterministic generator (no dependency, same fleet every run).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        self.0 >> 33
    }
}

fn matrix(cell: impl Fn(usize, usize) -> &'static str) -> Vec<String> {
    (0..8)
        .flat_map(|i| (0..8).map(move |j| (i, j)))
        .map(|(i, j)| if i == j { "X" } else { cell(i, j) }.into())
        .collect()
}

fn fleet(rng: &mut Lcg) -> Vec<NodeView> {
    (0..1000)
        .map(|i| {
            let kind = rng.next() % 10;
            let (class, numa, links): (&str, [i32; 8], Vec<String>) = match kind {
                0..=6 => ("nvswitch", [0; 8], matrix(|_, _| "NV18")),
                7 => ("nvswitch", [0, 0, 0, 0, 1, 1, 1, 1], matrix(|_, _| "NV18")),
                8 => (
                    "nvlink-pairs",
                    [0, 0, 0, 0, 1, 1, 1, 1],
                    matrix(|i, j| {
                        if i / 2 == j / 2 {
                            "NV12"
                        } else if i / 4 == j / 4 {
                            "NODE"
                        } else {
                            "SYS"
                        }
                    }),
                ),
                _ => (
                    "pcie",
                    [0, 0, 0, 0, 1, 1, 1, 1],
                    matrix(|i, j| {
                        if i / 2 == j / 2 {
                            "PIX"
                        } else if i / 4 == j / 4 {
                            "PHB"
                        } else {
                            "SYS"
                        }
                    }),
                ),
            };
            let gpus = (0..8)
                .map(|g| GpuView {
                    index: g,
                    model: "NVIDIA H100 80GB HBM3".into(),
                    memory_mib: 81_559,
                    free: rng.next().is_multiple_of(4),
                    numa_node: numa[g as usize],
                })
                .collect();
            NodeView {
                agent_id: format!("host-{i:04}"),
                gpus,
                links: std::sync::Arc::new(LinkMatrix::parse(&links, 8)),
                interconnect_class: InterconnectClass::parse(class),
                numa_cpus: vec![(0, "0-63".into()), (1, "64-127".into())],
            }
        })
        .collect()
}

fn queue(rng: &mut Lcg) -> Vec<Request> {
    (0..10_000u64)
        .map(|id| {
            let gpus = [1, 1, 2, 2, 4, 4, 8, 8, 16, 32][(rng.next() % 10) as usize];
            let interconnect = match rng.next() % 6 {
                0 => "nvswitch",
                1 => "pcie",
                _ => "",
            };
            Request {
                job_id: id + 1,
                priority: (rng.next() % 3) as i32,
                gpus,
                gpus_per_node: if gpus == 16 && rng.next().is_multiple_of(2) { 8 } else { 0 },
                gpu_model: if rng.next().is_multiple_of(8) { "H100".into() } else { String::new() },
                min_gpu_memory_mib: 0,
                interconnect: InterconnectClass::parse(interconnect),
                avoid: Vec::new(),
            }
        })
        .collect()
}

fn main() -> anyhow::Result<()> {
    let mut out = Results::create(&results_dir(), "schedule", &[])?;
    let mut rng = Lcg(42);
    let nodes = fleet(&mut rng);
    let jobs = queue(&mut rng);
    let free: usize = nodes.iter().map(|n| n.gpus.iter().filter(|g| g.free).count()).sum();
    let first = schedule(&jobs, &nodes);
    println!(
        "fleet: {} hosts, {} GPUs, {free} free; queue: {} jobs; one pass places {} and leaves {} waiting",
        nodes.len(),
        nodes.len() * 8,
        jobs.len(),
        first.placements.len(),
        first.waiting.len()
    );
    let mut times: Vec<Duration> = (0..31)
        .map(|_| {
            let start = Instant::now();
            let out = schedule(&jobs, &nodes);
            let took = start.elapsed();
            assert_eq!(out.placements.len(), first.placements.len());
            took
        })
        .collect();
    times.sort();
    let median = times[times.len() / 2];
    println!(
        "schedule: median {:.2} ms per decision (min {:.2} ms, max {:.2} ms, {} runs; target < 10 ms)",
        median.as_secs_f64() * 1e3,
        times[0].as_secs_f64() * 1e3,
        times[times.len() - 1].as_secs_f64() * 1e3,
        times.len()
    );
    let ms = |d: Duration| (d.as_secs_f64() * 1e5).round() / 100.0;
    out.line(&json!({"summary": {
        "hosts": nodes.len(), "gpus": nodes.len() * 8, "free_gpus": free, "queued": jobs.len(),
        "placed": first.placements.len(), "waiting": first.waiting.len(), "runs": times.len(),
        "median_ms": ms(median), "min_ms": ms(times[0]), "max_ms": ms(times[times.len() - 1]), "target_ms": 10,
    }}))?;
    println!("results: {}", out.path().display());
    Ok(())
}
