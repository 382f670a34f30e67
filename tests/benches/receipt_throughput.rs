//! Receipts from rank files to SQL rows: sustained rate and rank-to-row latency.
//!
//! Targets (docs/architecture.md): at least 100,000 receipts/s sustained into SQLite on a 2-core
//! controller (50,000/s into PostgreSQL, whose server shares the same 2 cores here), and p99
//! under 1 s from a rank writing a receipt to the row being visible in SQL.
//! Two agents with 4 ranks each run `examples/flood.py`, which writes receipts stamped with their
//! write time. Two phases: *burst* (as fast as the ranks can write: the sustained store rate is
//! receipts over the span between the first and the last `stored_at_ms`) and *paced* (a steady
//! offered load below that rate, into SQLite half what the raw loop stored: the rank-to-row
//! latency `stored_at_ms - t_ms` per receipt; a burst's latency only measures its own backlog).
//! On this machine the ranks, the agents and the controller share the same 2 cores.
//!
//! After each burst the same rows go through a plain sqlx loop into a fresh SQLite file or a
//! fresh database on the same PostgreSQL server ([`trainyard_tests::raw_insert`]):
//! `trainyard / raw` is the figure that survives a change of machine (targets: at least 0.6 on
//! both; on PostgreSQL at least 50,000/s where the raw loop reaches 83,000/s). Each run's rate
//! is also held against the median of the three (stable: within 25 %).
//!
//! Every run writes its figures to `docs/results/receipt_throughput-<date>.jsonl`
//! ([`trainyard_tests::results`]): one line per run and phase, one summary per store.
//!
//! `secure` runs SQLite again on a secure cluster: TLS between agents and controller, agent
//! certificates, a token for ctl, ranks run as the user's account (`nobody` under root).
//! `soak [SECONDS [OFFERED]]` offers SQLite half what the raw loop stores on this machine (one
//! burst and its raw loop first), or `OFFERED` receipts/s, for 180 s or `SECONDS`: each whole
//! minute's p99 rank-to-row latency (target: under 1 s in every minute), and the last minute's
//! stored rate against the first's (target: no slower by more than 15 %), and each rank's worst
//! latency (ranks take turns: none waits behind the others). With `apart`, the agents'
//! directories (the ranks' receipts files) are on tmpfs, as on a fleet where the ranks write to
//! their node's disk and the controller's store has a disk of its own (on one disk the agent
//! starts the writeback of what it read, so the kernel's periodic writeback of the flood's rank
//! files does not hold the store's commits).
//!
//! Run: `cargo bench -p trainyard-tests --bench receipt_throughput
//! [-- sqlite|postgres|secure|soak [SECONDS [OFFERED]] [apart]]` (sqlite and postgres when none is named). The bench
//! builds and runs the release binaries. PostgreSQL runs with its default, durable settings
//! (`fsync`, `synchronous_commit` on).

use serde_json::json;
use trainyard_tests::flood::{flood, flood_job, median, rate_per_minute};
use trainyard_tests::raw_insert::{raw_insert_rate, raw_insert_rate_postgres};
use trainyard_tests::results::{Results, results_dir};
use trainyard_tests::{Backend, Cluster};

const PER_RANK: i64 = 50_000;
const RUNS: usize = 3;

/// Offered load of the paced phase, receipts per second per rank (8 ranks): into SQLite half
/// what the raw loop stored in the burst phase on this machine (`raw_rate`, its median), so
/// that the latency target means the same on any machine; into PostgreSQL half its 50,000/s
/// target (25,000/s).
fn paced_per_rank(backend: Backend, raw_rate: Option<f64>) -> i64 {
    match (backend, raw_rate) {
        (Backend::Sqlite, Some(raw)) => ((raw / 2.0 / 8.0) as i64 / 100 * 100).max(100),
        (Backend::Sqlite, None) => 10_000,
        (Backend::Postgres, _) => 3_125,
    }
}

fn main() -> anyhow::Result<()> {
    trainyard_tests::build_release_binaries()?;
    let named: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    let mut out = Results::create(&results_dir(), "receipt_throughput", &named)?;
    for (name, backend) in [("sqlite", Backend::Sqlite), ("postgres", Backend::Postgres)] {
        if named.is_empty() || named.iter().any(|n| n == name) {
            bench(&mut out, backend, false)?;
        }
    }
    if named.iter().any(|n| n == "secure") {
        bench(&mut out, Backend::Sqlite, true)?;
    }
    if let Some(at) = named.iter().position(|n| n == "soak") {
        let seconds = named.get(at + 1).and_then(|s| s.parse().ok()).unwrap_or(180);
        let offered = named.get(at + 2).and_then(|s| s.parse().ok());
        soak(&mut out, seconds, offered, named.iter().any(|n| n == "apart"))?;
    }
    println!("results: {}", out.path().display());
    Ok(())
}

fn bench(out: &mut Results, backend: Backend, secure: bool) -> anyhow::Result<()> {
    let (store, target) = match backend {
        Backend::Sqlite => ("SQLite", 100_000),
        Backend::Postgres => ("PostgreSQL", 50_000),
    };
    let label = match (backend, secure) {
        (Backend::Sqlite, false) => "sqlite",
        (Backend::Sqlite, true) => "sqlite-secure",
        (Backend::Postgres, _) => "postgres",
    };
    println!("== {store}{}", if secure { " (TLS, certificates, tokens, run-as)" } else { "" });
    let mut c = if secure { Cluster::start_secure()? } else { Cluster::start_on(backend)? };
    c.start_agent("node-a", 4)?;
    c.start_agent("node-b", 4)?;
    let mut summary = json!({"store": label, "target_rate": target});
    for phase in ["burst", "paced"] {
        let per_rank = match phase {
            "burst" => 0,
            _ => paced_per_rank(backend, summary["raw_rate"].as_f64()),
        };
        let mut results = Vec::new();
        for run in 0..RUNS {
            let f = flood(&c, &format!("flood-{run}-{per_rank}"), PER_RANK, per_rank)?;
            print!(
                "{phase} run {run}: {:.0} receipts/s stored, latency p50 {} ms, p99 {} ms, controller {:.1} CPU-s",
                f.rate, f.p50_ms, f.p99_ms, f.controller_cpu_s
            );
            // The raw loop right after the run it is compared with, on the same rows and disk.
            let raw = match (phase, backend) {
                ("burst", Backend::Sqlite) => Some(raw_insert_rate(&c, f.job, c.dir.path())?),
                ("burst", Backend::Postgres) => Some(raw_insert_rate_postgres(&c, f.job)?),
                _ => None,
            };
            match raw {
                Some(raw) => println!("; raw sqlx loop {raw:.0} rows/s, ratio {:.2}", f.rate / raw),
                None => println!(),
            }
            out.line(&json!({
                "store": label, "phase": phase, "run": run, "offered_per_s": 8 * per_rank,
                "rate": f.rate.round(), "p50_ms": f.p50_ms, "p99_ms": f.p99_ms,
                "controller_cpu_s": f.controller_cpu_s, "raw_rate": raw.map(f64::round),
                "ratio": raw.map(|raw| round2(f.rate / raw)),
            }))?;
            results.push((f.rate, f.p99_ms, raw));
        }
        let rate = median(results.iter().map(|r| r.0).collect());
        let p99 = median(results.iter().map(|r| r.1 as f64).collect());
        match phase {
            "burst" => {
                let spread = results.iter().map(|r| (r.0 / rate - 1.0).abs()).fold(0.0, f64::max);
                println!(
                    "burst: median {rate:.0} receipts/s sustained into {store} (target >= {target}); \
                     runs within {:.0} % of it (target 25 %)",
                    spread * 100.0
                );
                let ratios: Vec<f64> = results.iter().filter_map(|r| Some(r.0 / r.2?)).collect();
                let raw = median(results.iter().filter_map(|r| r.2).collect());
                let ratio = median(ratios);
                println!(
                    "burst: raw sqlx loop median {raw:.0} rows/s; trainyard / raw median {ratio:.2} (target >= 0.6)"
                );
                summary["rate"] = json!(rate.round());
                summary["spread"] = json!(round2(spread));
                summary["raw_rate"] = json!(raw.round());
                summary["ratio"] = json!(round2(ratio));
            }
            _ => {
                println!(
                    "paced at {} receipts/s offered: median p99 rank-to-row latency {p99:.0} ms (target < 1000)",
                    8 * per_rank
                );
                summary["paced_offered_per_s"] = json!(8 * per_rank);
                summary["paced_p99_ms"] = json!(p99.round());
            }
        }
    }
    out.line(&json!({ "summary": summary }))
}

fn round2(v: f64) -> f64 {
    (v * 100.0).round() / 100.0
}

/// One flood of `seconds` into SQLite at half what the raw loop stores on this machine (one
/// burst and its raw loop first, as in [`bench`]; or `offered` receipts/s when given): the
/// rate and the p99 rank-to-row latency of each whole minute (target: under 1 s in every
/// minute), and the last minute's rate against the first's (target: no slower by more than
/// 15 %). Paced, so the ranks' own writing costs the same CPU in every minute (unpaced, they
/// finish writing early and the later minutes run faster).
fn soak(out: &mut Results, seconds: u64, offered: Option<i64>, apart: bool) -> anyhow::Result<()> {
    // Declared before the cluster: removed after its processes are gone.
    let tmpfs = apart
        .then(|| tempfile::Builder::new().prefix("trainyard-soak-").tempdir_in("/dev/shm"))
        .transpose()?;
    let mut c = Cluster::start_on(Backend::Sqlite)?;
    for node in ["node-a", "node-b"] {
        if let Some(tmpfs) = &tmpfs {
            let dir = tmpfs.path().join(node);
            std::fs::create_dir(&dir)?;
            std::os::unix::fs::symlink(&dir, c.path(&format!("agent-{node}")))?;
        }
        c.start_agent(node, 4)?;
    }
    let disks = if apart { "rank files on tmpfs, store on disk" } else { "rank files and store on one disk" };
    let (offered, raw) = match offered {
        Some(offered) => (offered, None),
        None => {
            println!("== SQLite, one burst and the raw loop on its rows, for the soak's offered rate");
            let f = flood(&c, "soak-burst", PER_RANK, 0)?;
            let raw = raw_insert_rate(&c, f.job, c.dir.path())?;
            println!(
                "burst: {:.0} receipts/s stored; raw sqlx loop {raw:.0} rows/s, ratio {:.2}",
                f.rate,
                f.rate / raw
            );
            (8 * paced_per_rank(Backend::Sqlite, Some(raw)), Some(raw))
        }
    };
    println!("== SQLite, one flood of {seconds} s at {offered} receipts/s offered ({disks})");
    let per_rank = offered * seconds as i64 / 8;
    let job = flood_job(&c, "soak", per_rank, offered / 8)?;
    let minutes = rate_per_minute(&c, job)?;
    for (i, (rate, p99)) in minutes.iter().enumerate() {
        println!("minute {}: {rate:.0} receipts/s stored, p99 rank-to-row latency {p99} ms", i + 1);
        out.line(&json!({"store": "sqlite-soak", "minute": i + 1, "rate": rate.round(), "p99_ms": p99}))?;
    }
    let ranks = c.query(&format!(
        "SELECT rank, MAX(stored_at_ms - json_extract(body, '$.t_ms')) FROM receipts \
         WHERE job_id = {job} AND kind = 'step' GROUP BY rank ORDER BY rank"
    ))?;
    let worst_by_rank: Vec<i64> = ranks.iter().map(|r| r[1]).collect();
    println!("each rank's worst rank-to-row latency (ms), ranks 0-7: {worst_by_rank:?}");
    anyhow::ensure!(minutes.len() >= 2, "the flood lasted less than two whole minutes");
    let (first, last) = (minutes[0].0, minutes[minutes.len() - 1].0);
    let worst = minutes.iter().map(|m| m.1).max().unwrap_or_default();
    println!(
        "soak: {} receipts at {offered}/s offered; worst minute's p99 {worst} ms (target < 1000); \
         last minute / first minute {:.2} (target >= 0.85)",
        8 * per_rank,
        last / first
    );
    out.line(&json!({"summary": {
        "store": "sqlite-soak", "seconds": seconds, "offered_per_s": offered, "raw_rate": raw.map(f64::round),
        "disks": disks, "worst_ms_by_rank": worst_by_rank,
        "receipts": 8 * per_rank, "worst_minute_p99_ms": worst,
        "first_minute_rate": first.round(), "last_minute_rate": last.round(), "last_over_first": round2(last / first),
    }}))
}
