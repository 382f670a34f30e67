//! The receipt flood the ingest benches run: 8 ranks (4 per node) of `examples/flood.py`, each
//! writing receipts stamped with their write time, and what the store made of them.

use std::time::Duration;

use anyhow::Result;

use crate::{Backend, Cluster};

/// What one flood job measured.
#[derive(Debug, Clone, Copy)]
pub struct Flood {
    /// Receipts over the span between the first and the last `stored_at_ms`.
    pub rate: f64,
    /// Rank-to-row latency (`stored_at_ms - t_ms`), median and 99th percentile, ms.
    pub p50_ms: i64,
    pub p99_ms: i64,
}

/// Runs one flood job of `per_rank` receipts on each of 8 ranks, `rate_per_rank` receipts a
/// second each (0: as fast as they can), and checks every receipt was stored.
pub fn flood(c: &Cluster, name: &str, per_rank: i64, rate_per_rank: i64) -> Result<Flood> {
    let file = c.job_file(name, 8, 4, &[], "");
    let text = std::fs::read_to_string(&file)?.replace(
        r#"argv = ["python3", "examples/rank.py"]"#,
        &format!(
            r#"argv = ["python3", "examples/flood.py", "--receipts", "{per_rank}", "--rate", "{rate_per_rank}", "--chunk", "100"]"#
        ),
    );
    std::fs::write(&file, text)?;
    let job = c.submit(&file)?;
    let state = wait_ended(c, job, Duration::from_secs(300))?;
    anyhow::ensure!(state == "succeeded", "flood job ended {state}: {}", c.status(job)?);
    let rows = c.query(&format!(
        "SELECT COUNT(*), MAX(stored_at_ms) - MIN(stored_at_ms) FROM receipts WHERE job_id = {job}"
    ))?;
    let (count, span_ms) = (rows[0][0], rows[0][1].max(1));
    anyhow::ensure!(count == 8 * per_rank, "stored {count} receipts, expected {}", 8 * per_rank);
    let t_ms = match c.backend() {
        Backend::Sqlite => "json_extract(body, '$.t_ms')",
        Backend::Postgres => "CAST(receipt_number(body, 't_ms') AS BIGINT)",
    };
    // The controller records an ended job's goodput and findings off the ingest path: wait for
    // it, so that work is not billed to the next run.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while c.query(&format!("SELECT COUNT(*) FROM attempt_goodput WHERE job_id = {job}"))?[0][0] == 0
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(100));
    }
    let latency = |q: f64| -> Result<i64> {
        let offset = ((count - 1) as f64 * q) as i64;
        let rows = c.query(&format!(
            "SELECT stored_at_ms - {t_ms} AS l FROM receipts WHERE job_id = {job} \
             ORDER BY l LIMIT 1 OFFSET {offset}"
        ))?;
        Ok(rows[0][0])
    };
    Ok(Flood { rate: count as f64 * 1000.0 / span_ms as f64, p50_ms: latency(0.5)?, p99_ms: latency(0.99)? })
}

/// Waits for the job to end by reading its row, not through `ctl status`: a status of a job of
/// hundreds of thousands of receipts computes its progress and goodput, and polling it ten times
/// a second would load the controller the bench measures.
fn wait_ended(c: &Cluster, job: u64, timeout: Duration) -> Result<String> {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let rows = c.query_text(&format!("SELECT state FROM jobs WHERE id = {job}"))?;
        let state = rows.first().and_then(|r| r.first()).cloned().unwrap_or_default();
        if matches!(state.as_str(), "succeeded" | "failed" | "cancelled") {
            return Ok(state);
        }
        anyhow::ensure!(std::time::Instant::now() < deadline, "job {job} still {state} after {timeout:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The median of `values` (the upper one of an even count).
pub fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(|a, b| a.total_cmp(b));
    values[values.len() / 2]
}
