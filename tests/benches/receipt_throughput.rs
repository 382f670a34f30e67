//! Receipts from rank files to SQL rows: sustained rate and rank-to-row latency.
//!
//! Targets (docs/architecture.md): at least 100,000 receipts/s sustained into SQLite on a 2-core
//! controller (50,000/s into PostgreSQL, whose server shares the same 2 cores here), and p99
//! under 1 s from a rank writing a receipt to the row being visible in SQL.
//! Two agents with 4 ranks each run `examples/flood.py`, which writes receipts stamped with their
//! write time. Two phases: *burst* (as fast as the ranks can write: the sustained store rate is
//! receipts over the span between the first and the last `stored_at_ms`) and *paced* (a steady
//! offered load below that rate: the rank-to-row latency `stored_at_ms - t_ms` per receipt; a
//! burst's latency only measures its own backlog). On this machine the ranks, the agents and the
//! controller share the same 2 cores.
//!
//! `secure` runs SQLite again on a secure cluster: TLS between agents and controller, agent
//! certificates, a token for ctl, ranks run as the user's account (`nobody` under root).
//!
//! Run: `cargo build --workspace --bins && cargo bench -p trainyard-tests --bench receipt_throughput
//! [-- sqlite|postgres|secure]` (sqlite and postgres when none is named). PostgreSQL runs with its default,
//! durable settings (`fsync`, `synchronous_commit` on).

use trainyard_tests::flood::{flood, median};
use trainyard_tests::{Backend, Cluster};

const PER_RANK: i64 = 50_000;
const RUNS: usize = 3;

/// Offered load of the paced phase, receipts per second per rank (8 ranks): 80,000/s into
/// SQLite, and half PostgreSQL's 50,000/s target (25,000/s) into PostgreSQL.
fn paced_per_rank(backend: Backend) -> i64 {
    match backend {
        Backend::Sqlite => 10_000,
        Backend::Postgres => 3_125,
    }
}

fn main() -> anyhow::Result<()> {
    let named: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    for (name, backend) in [("sqlite", Backend::Sqlite), ("postgres", Backend::Postgres)] {
        if named.is_empty() || named.iter().any(|n| n == name) {
            bench(backend, false)?;
        }
    }
    if named.iter().any(|n| n == "secure") {
        bench(Backend::Sqlite, true)?;
    }
    Ok(())
}

fn bench(backend: Backend, secure: bool) -> anyhow::Result<()> {
    let (store, target) = match backend {
        Backend::Sqlite => ("SQLite", 100_000),
        Backend::Postgres => ("PostgreSQL", 50_000),
    };
    println!("== {store}{}", if secure { " (TLS, certificates, tokens, run-as)" } else { "" });
    let mut c = if secure { Cluster::start_secure()? } else { Cluster::start_on(backend)? };
    c.start_agent("node-a", 4)?;
    c.start_agent("node-b", 4)?;
    for (phase, per_rank) in [("burst", 0), ("paced", paced_per_rank(backend))] {
        let mut results = Vec::new();
        for run in 0..RUNS {
            let f = flood(&c, &format!("flood-{run}-{per_rank}"), PER_RANK, per_rank)?;
            println!(
                "{phase} run {run}: {:.0} receipts/s stored, latency p50 {} ms, p99 {} ms",
                f.rate, f.p50_ms, f.p99_ms
            );
            results.push((f.rate, f.p99_ms));
        }
        let rate = median(results.iter().map(|r| r.0).collect());
        let p99 = median(results.iter().map(|r| r.1 as f64).collect());
        match phase {
            "burst" => {
                println!("burst: median {rate:.0} receipts/s sustained into {store} (target >= {target})")
            }
            _ => println!(
                "paced at {} receipts/s offered: median p99 rank-to-row latency {p99:.0} ms (target < 1000)",
                8 * per_rank
            ),
        }
    }
    Ok(())
}
