//! The receipt flood the ingest benches run: 8 ranks (4 per node) of `examples/flood.py`, each
//! writing receipts stamped with their write time, and what the store made of them.

use std::time::Duration;

use anyhow::Result;

use crate::{Backend, Cluster};

/// What one flood job measured.
#[derive(Debug, Clone, Copy)]
pub struct Flood {
    /// The flood job.
    pub job: u64,
    /// Receipts over the span between the first and the last `stored_at_ms`.
    pub rate: f64,
    /// Rank-to-row latency (`stored_at_ms - t_ms`), median and 99th percentile, ms.
    pub p50_ms: i64,
    pub p99_ms: i64,
    /// CPU seconds the controller process spent from submit to the job's outcome being recorded.
    pub controller_cpu_s: f64,
}

/// Runs one flood job of `per_rank` receipts on each of 8 ranks, `rate_per_rank` receipts a
/// second each (0: as fast as they can), checks every receipt was stored, and waits for the
/// controller to record the job's outcome (off the ingest path: so that work is not billed to
/// the next run).
pub fn flood(c: &Cluster, name: &str, per_rank: i64, rate_per_rank: i64) -> Result<Flood> {
    let cpu_before = c.controller_pid().map(process_cpu_s).unwrap_or_default();
    let job = flood_job(c, name, per_rank, rate_per_rank)?;
    let span =
        c.query(&format!("SELECT MAX(stored_at_ms) - MIN(stored_at_ms) FROM receipts WHERE job_id = {job}"))?;
    let count = 8 * per_rank;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while c.query(&format!("SELECT COUNT(*) FROM attempt_goodput WHERE job_id = {job}"))?[0][0] == 0
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(100));
    }
    let controller_cpu_s = c.controller_pid().map(process_cpu_s).unwrap_or_default() - cpu_before;
    let t_ms = match c.backend() {
        Backend::Sqlite => "json_extract(body, '$.t_ms')",
        Backend::Postgres => "CAST(receipt_number(body, 't_ms') AS BIGINT)",
    };
    let latency = |q: f64| -> Result<i64> {
        let offset = ((count - 1) as f64 * q) as i64;
        let rows = c.query(&format!(
            "SELECT stored_at_ms - {t_ms} AS l FROM receipts WHERE job_id = {job} \
             ORDER BY l LIMIT 1 OFFSET {offset}"
        ))?;
        Ok(rows[0][0])
    };
    Ok(Flood {
        job,
        rate: count as f64 * 1000.0 / span[0][0].max(1) as f64,
        p50_ms: latency(0.5)?,
        p99_ms: latency(0.99)?,
        controller_cpu_s,
    })
}

/// Submits a flood job, waits for it to succeed and checks that every receipt was stored.
pub fn flood_job(c: &Cluster, name: &str, per_rank: i64, rate_per_rank: i64) -> Result<u64> {
    let job = c.submit(&flood_file(c, name, (8, 4), per_rank, rate_per_rank)?)?;
    // Generous: a flood of 50,000 receipts per rank takes seconds, the soak's minutes.
    let timeout = Duration::from_secs(300 + per_rank as u64 / 1_000);
    let state = wait_ended(c, job, timeout)?;
    anyhow::ensure!(state == "succeeded", "flood job ended {state}: {}", c.status(job)?);
    let count = c
        .query(&format!("SELECT COUNT(*) FROM receipts WHERE job_id = {job} AND {}", crate::RANK_WRITTEN))?
        [0][0];
    anyhow::ensure!(count == 8 * per_rank, "stored {count} receipts, expected {}", 8 * per_rank);
    Ok(job)
}

/// A job file of `examples/flood.py` ranks, `(gpus, per node)`, each writing `per_rank`
/// receipts at `rate_per_rank` a second (0: as fast as it can), in chunks of 100.
pub fn flood_file(
    c: &Cluster,
    name: &str,
    (gpus, per_node): (u32, u32),
    per_rank: i64,
    rate_per_rank: i64,
) -> Result<std::path::PathBuf> {
    let file = c.job_file(name, gpus, per_node, &[], "");
    let text = std::fs::read_to_string(&file)?.replace(
        r#"argv = ["python3", "examples/rank.py"]"#,
        &format!(
            r#"argv = ["python3", "examples/flood.py", "--receipts", "{per_rank}", "--rate", "{rate_per_rank}", "--chunk", "100"]"#
        ),
    );
    std::fs::write(&file, text)?;
    Ok(file)
}

/// For each whole minute from the job's first `stored_at_ms` (a last, partial minute left
/// out): receipts stored per second, and the p99 rank-to-row latency (ms) of those receipts.
/// SQLite only.
pub fn rate_per_minute(c: &Cluster, job: u64) -> Result<Vec<(f64, i64)>> {
    let minute =
        format!("(stored_at_ms - (SELECT MIN(stored_at_ms) FROM receipts WHERE job_id = {job})) / 60000");
    let counts = c.query(&format!(
        "SELECT {minute} AS minute, COUNT(*) FROM receipts WHERE job_id = {job} GROUP BY minute ORDER BY minute"
    ))?;
    let whole = counts.len().saturating_sub(1);
    let mut minutes = Vec::new();
    for row in &counts[..whole] {
        let offset = (row[1] - 1) * 99 / 100;
        let p99 = c.query(&format!(
            "SELECT stored_at_ms - json_extract(body, '$.t_ms') AS l FROM receipts \
             WHERE job_id = {job} AND {minute} = {} ORDER BY l LIMIT 1 OFFSET {offset}",
            row[0]
        ))?;
        minutes.push((row[1] as f64 / 60.0, p99[0][0]));
    }
    Ok(minutes)
}

/// Waits for the job to end by reading its row, not through `ctl status`: a status of a job of
/// hundreds of thousands of receipts computes its progress and goodput, and polling it ten times
/// a second would load the controller the bench measures.
pub fn wait_ended(c: &Cluster, job: u64, timeout: Duration) -> Result<String> {
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

/// User plus system CPU seconds a process has used, from `/proc/<pid>/stat` (0 if gone).
pub fn process_cpu_s(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return 0.0 };
    // Fields after the command name, which is in parentheses and may hold spaces.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok()).unwrap_or(0.0);
    // utime and stime are fields 14 and 15 of stat(5), 12 and 13 after the name.
    (ticks(11) + ticks(12)) / clock_ticks_per_s()
}

fn clock_ticks_per_s() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if hz > 0 { hz as f64 } else { 100.0 }
}

/// The median of `values` (the upper one of an even count).
pub fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(|a, b| a.total_cmp(b));
    values[values.len() / 2]
}
