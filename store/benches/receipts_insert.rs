//! Receipt ingest rate of the SQLite store: `cargo bench -p trainyard-store --bench
//! receipts_insert`. Inserts `TOTAL` receipts of about 300 bytes in batches of `BATCH` (one
//! transaction each, as the agent stream does) into a store on a temporary file, `REPEATS`
//! times (a new job each time, so the tables grow as they would in service), and prints the
//! median rate. Optional arguments: total, batch, repeats. Writes its figures to
//! `docs/results/receipts_insert-<date>.jsonl` ([`trainyard_testkit::results`]).

use serde_json::json;
use std::time::Instant;
use trainyard_testkit::results::{Results, results_dir};

use trainyard_model::spec::JobSpec;
use trainyard_store::{JobStore, NewReceipt, RankId, ReceiptStore, SqlStore};

const TOTAL: usize = 200_000;
const BATCH: usize = 2_000;
const REPEATS: usize = 5;
const RANKS: u32 = 8;

fn main() -> anyhow::Result<()> {
    let arg = |i: usize, default: usize| -> anyhow::Result<usize> {
        std::env::args()
            .skip(1)
            .filter(|a| !a.starts_with('-'))
            .nth(i)
            .map_or(Ok(default), |a| Ok(a.parse()?))
    };
    let (total, batch, repeats) = (arg(0, TOTAL)?, arg(1, BATCH)?, arg(2, REPEATS)?);
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    let mut out = Results::create(&results_dir(), "receipts_insert", &args)?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(run(&mut out, total, batch, repeats))?;
    println!("results: {}", out.path().display());
    Ok(())
}

async fn run(out: &mut Results, total: usize, batch: usize, repeats: usize) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let store = SqlStore::open_sqlite_file(&dir.path().join("bench.db")).await?;
    let mut rates = Vec::with_capacity(repeats);
    for repeat in 0..repeats {
        let spec = JobSpec::exec(format!("bench-{repeat}"), RANKS, &["true"]);
        let job = store.create_job(&spec, None, "bench", 0).await?;
        let receipts = receipts(job.id, total);
        let started = Instant::now();
        let mut inserted = 0;
        for chunk in receipts.chunks(batch) {
            inserted += store.insert_receipts(chunk, 1).await?;
        }
        let secs = started.elapsed().as_secs_f64();
        anyhow::ensure!(inserted == total as u64, "inserted {inserted} of {total}");
        let rate = total as f64 / secs;
        println!("run {repeat}: {total} receipts in batches of {batch}: {secs:.3} s, {rate:.0} receipts/s");
        out.line(
            &json!({"run": repeat, "receipts": total, "batch": batch, "s": secs, "rate": rate.round()}),
        )?;
        rates.push(rate);
    }
    rates.sort_by(f64::total_cmp);
    let bytes = receipts(0, 1)[0].body.len();
    let median = rates[rates.len() / 2];
    println!(
        "median: {median:.0} receipts/s ({repeats} runs, {total} receipts of ~{bytes} bytes, batches of {batch})"
    );
    out.line(&json!({"summary": {"rate": median.round(), "runs": repeats, "receipts": total, "receipt_bytes": bytes, "batch": batch}}))
}

/// Step receipts as the engine writes them, round-robin over the ranks.
fn receipts(job_id: u64, n: usize) -> Vec<NewReceipt> {
    (0..n as u64)
        .map(|i| {
            let rank = (i % u64::from(RANKS)) as u32;
            let seq = i / u64::from(RANKS);
            let body = format!(
                    concat!(
                        r#"{{"kind":"step","job":{},"attempt":0,"rank":{},"seq":{},"step":{},"#,
                        r#""loss":{:.4},"lr":0.000600,"tokens":524288,"step_time_ms":{:.2},"#,
                        r#""fwd_bwd_ms":125.1,"optimizer_ms":7.1,"optimizer_reduce_ms":3.2,"tokens_per_s":{:.1},"#,
                        r#""mfu":0.412,"mem_allocated_bytes":53722316800,"mem_reserved_bytes":64424509440,"#,
                        r#""mem_peak_allocated_bytes":61668556800,"grad_norm":{:.4},"schema":1}}"#
                    ),
                    job_id,
                    rank,
                    seq,
                    seq,
                    3.2 - seq as f64 * 1e-4,
                    132.0 + (seq % 7) as f64,
                    3_950_000.0 + (seq % 13) as f64,
                    0.8 + (seq % 5) as f64 * 0.01
                );
            // As ingest stores it: checked against receipt schema v1, typed fields extracted.
            let checked = trainyard_model::receipts::check("step", &body).expect("a JSON object");
            NewReceipt {
                id: RankId { job_id, attempt: 0, rank },
                seq,
                kind: "step".into(),
                step: Some(seq as i64),
                body,
                problem: checked.problem,
                metrics: checked.metrics,
            }
        })
        .collect()
}
