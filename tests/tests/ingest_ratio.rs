//! Guard on receipt ingest: trainyard keeps a fair share of what a plain sqlx loop stores on the
//! same machine and disk. A short form of `tests/benches/receipt_throughput.rs` (whose figures
//! docs/status.md quotes): five floods of 8 x 15,000 receipts into SQLite, each followed by the
//! raw loop on the same rows ([`trainyard_tests::raw_insert`]), and the median ratio held against
//! a floor. These are debug builds of our own code (dependencies optimised); they measure about
//! 0.4 on a 2-core machine where the bench, with release binaries, measures 0.45 to 0.55: a
//! regression of the kind that once halved ingest unnoticed fails it.
//!
//! The only test in its binary, so no other test of this suite shares the cores while it runs
//! (cargo runs test binaries one after another).

use anyhow::Result;
use trainyard_tests::flood::{flood, median};
use trainyard_tests::raw_insert::raw_insert_rate;
use trainyard_tests::{Backend, Cluster};

/// Lowest median `trainyard / raw` accepted.
const FLOOR: f64 = 0.3;
const PER_RANK: i64 = 15_000;

#[test]
fn ingest_keeps_a_fair_share_of_a_raw_insert_loop() -> Result<()> {
    let mut c = Cluster::start_on(Backend::Sqlite)?;
    c.start_agent("node-a", 4)?;
    c.start_agent("node-b", 4)?;
    let mut ratios = Vec::new();
    for run in 0..5 {
        let f = flood(&c, &format!("guard-{run}"), PER_RANK, 0)?;
        let raw = raw_insert_rate(&c, f.job, c.dir.path())?;
        println!(
            "run {run}: trainyard {:.0} receipts/s, raw sqlx loop {raw:.0} rows/s, ratio {:.2}",
            f.rate,
            f.rate / raw
        );
        ratios.push(f.rate / raw);
    }
    let ratio = median(ratios);
    assert!(
        ratio >= FLOOR,
        "ingest reached {ratio:.2} of a raw sqlx insert loop on the same rows (floor {FLOOR})"
    );
    Ok(())
}
